/* expert_pass.c — the decode's routed-expert passes alone, beside one big
 * matrix of the same bytes, to see where the passes lose to the DRAM probe.
 *
 * A pool of E MXFP4 experts in K3's shapes (gate and up 3072 x 3584, down
 * 3584 x 3072; laid out one after another as in a shard) in one anonymous
 * buffer. A "token" picks 16 distinct experts and runs the two passes the
 * way moe_batch.c does: one pool_for over the gate and up rows of all 16
 * (chunks of 16 rows), then one over their downs. Before each pass the
 * calling thread may spin GAP microseconds (the serial work between passes
 * in a real step: long enough, and the pool's workers go to sleep).
 *
 *   make && cc -std=c17 -O2 -D_GNU_SOURCE -Iinclude -pthread bench/expert_pass.c \
 *       build/libdeltafin.a -ljansson -luring -lcurl -lnettle -lm -lmvec -lpthread \
 *       -o build/expert_pass
 * (pool variants: add src/base/pool.c with -DDF_POOL_SPIN_NS=... or
 * -DDF_POOL_LEAST=... before the library)
 *   build/expert_pass LEVEL THREADS [EXPERTS [TOKENS [GAP_US [HUGE]]]]
 *
 * Prints, per pass kind, the median GB/s over the tokens, the median time
 * from the pass's start to the last thread's first chunk (wake) and from the
 * first thread's last chunk end to the pass's end (tail); then the same pass
 * over one contiguous matrix of the gate+up pass's rows (187 MB, read every
 * token: a large L3 keeps part of it, so it can read above the probe), and
 * the DRAM probe.
 */
#include "../src/kernels/kernels.h"
#include "../src/base/pool.h"
#include "deltafin.h"
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { I = 3072, D = 3584, K = 16, MAXT = 256 };

#include "bench_util.h"

static int64_t mx_bytes(int64_t rows, int64_t cols) { return rows * cols / 2 + rows * (cols / 32); }

static df_weight mx_at(uint8_t *p, int64_t rows, int64_t cols) {
    df_weight w;
    memset(&w, 0, sizeof w);
    w.type = WT_MXFP4, w.rows = rows, w.cols = cols;
    w.data = p, w.scale = p + rows * cols / 2;
    return w;
}

typedef struct {
    kn_level lv;
    df_weight gate[K], up[K], down[K];
    const float *x; /* K x D, the passes' inputs */
    const float *h; /* K x I */
    float *g, *u, *o;
    int big;        /* gate+up pass over one matrix of 2 K I rows */
    df_weight bigw;
    double t0;
    _Atomic int64_t first_ns[MAXT], last_ns[MAXT];
} pass_ctx;

static void stamp(pass_ctx *c, int tid, double a, double b) {
    int64_t na = (int64_t)((a - c->t0) * 1e9), nb = (int64_t)((b - c->t0) * 1e9);
    if (atomic_load(&c->first_ns[tid]) < 0) atomic_store(&c->first_ns[tid], na);
    atomic_store(&c->last_ns[tid], nb);
}

static void gateup(void *vc, int64_t i0, int64_t i1, int tid) {
    pass_ctx *c = vc;
    double a = now();
    if (c->big) {
        kn_matmul(c->lv, &c->bigw, c->x, 1, c->g + i0, 2 * K * I, i0, i1);
    } else {
        for (int64_t i = i0; i < i1;) {
            const int x = (int)(i / (2 * I));
            const int64_t r = i % (2 * I), end = r < I ? I : 2 * I, r1 = r + (i1 - i) < end ? r + (i1 - i) : end;
            const int up = r >= I;
            const int64_t lo = r - (up ? I : 0), hi = r1 - (up ? I : 0);
            kn_matmul(c->lv, up ? &c->up[x] : &c->gate[x], c->x + (size_t)x * D, 1,
                      (up ? c->u : c->g) + (size_t)x * I + lo, I, lo, hi);
            i += r1 - r;
        }
    }
    stamp(c, tid, a, now());
}

static void downs(void *vc, int64_t i0, int64_t i1, int tid) {
    pass_ctx *c = vc;
    double a = now();
    for (int64_t i = i0; i < i1;) {
        const int x = (int)(i / D);
        const int64_t r = i % D, r1 = r + (i1 - i) < D ? r + (i1 - i) : D;
        kn_matmul(c->lv, &c->down[x], c->h + (size_t)x * I, 1, c->o + (size_t)x * D + r, D, r, r1);
        i += r1 - r;
    }
    stamp(c, tid, a, now());
}

static int cmpd(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmpd);
    return n ? v[n / 2] : 0;
}

static void spin_us(double us) {
    double end = now() + us * 1e-6;
    while (now() < end) {}
}

/* One pass; returns seconds, and the wake and tail in wake[], tail[]. */
static double run_pass(df_pool *pool, pass_ctx *c, int threads, int down, double *wake, double *tail) {
    for (int t = 0; t < threads; t++) atomic_store(&c->first_ns[t], -1), atomic_store(&c->last_ns[t], -1);
    c->t0 = now();
    if (down) pool_for(pool, (int64_t)K * D, 16, downs, c);
    else pool_for(pool, (int64_t)K * 2 * I, 16, gateup, c);
    double dt = now() - c->t0;
    int64_t wmax = 0, lmin = INT64_MAX;
    for (int t = 0; t < threads; t++) {
        int64_t f = atomic_load(&c->first_ns[t]), l = atomic_load(&c->last_ns[t]);
        if (f < 0) continue; /* a thread that got no chunk */
        if (f > wmax) wmax = f;
        if (l < lmin) lmin = l;
    }
    *wake = (double)wmax * 1e-9;
    *tail = lmin == INT64_MAX ? 0 : dt - (double)lmin * 1e-9;
    return dt;
}

int main(int argc, char **argv) {
    static const kn_level all[] = {KN_SCALAR, KN_AVX2, KN_AVX512, KN_NEON, KN_AMX};
    kn_level lv = KN_SCALAR;
    int ok = 0;
    if (argc > 2)
        for (int i = 0; i < 5; i++)
            if (!strcmp(argv[1], kn_level_name(all[i]))) lv = all[i], ok = kn_level_available(all[i]);
    if (!ok) {
        fprintf(stderr, "usage: expert_pass LEVEL THREADS [EXPERTS [TOKENS [GAP_US [HUGE]]]]\n");
        return 2;
    }
    const int threads = atoi(argv[2]), E = argc > 3 ? atoi(argv[3]) : 448;
    const int tokens = argc > 4 ? atoi(argv[4]) : 40;
    const double gap = argc > 5 ? atof(argv[5]) : 0;
    const int huge = argc > 6 ? atoi(argv[6]) : 0;
    if (threads < 1 || threads > MAXT || E < K || tokens < 1) {
        fprintf(stderr, "expert_pass: THREADS 1..%d, EXPERTS >= %d, TOKENS >= 1\n", MAXT, K);
        return 2;
    }
    const int64_t gb = mx_bytes(I, D), db = mx_bytes(D, I), eb = 2 * gb + db;
    const size_t total = (size_t)(eb * E);
    uint8_t *buf = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
        fprintf(stderr, "expert_pass: cannot map %.1f GB\n", (double)total / 1e9);
        return 1;
    }
    madvise(buf, total, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    for (size_t i = 0; i < total; i += 8) {
        uint64_t v = (uint64_t)rnd() << 32 | rnd();
        memcpy(buf + i, &v, total - i < 8 ? total - i : 8);
    }
    for (int e = 0; e < E; e++) { /* scales near 1 (118..129) */
        uint8_t *p = buf + (size_t)e * eb;
        for (int m = 0; m < 3; m++) {
            int64_t rows = m < 2 ? I : D, cols = m < 2 ? D : I;
            uint8_t *s = p + m * gb + rows * cols / 2;
            for (int64_t i = 0; i < rows * (cols / 32); i++) s[i] = (uint8_t)(118 + s[i] % 12);
        }
    }
    float *x = malloc(sizeof(float) * K * D), *h = malloc(sizeof(float) * K * I);
    float *g = malloc(sizeof(float) * K * I * 2), *u = malloc(sizeof(float) * K * I), *o = malloc(sizeof(float) * K * D);
    pass_ctx *c = calloc(1, sizeof *c);
    uint8_t *bigp = malloc((size_t)(2 * K * gb));
    df_pool *pool = pool_new(threads);
    if (!x || !h || !g || !u || !o || !c || !bigp || !pool) {
        fprintf(stderr, "expert_pass: out of memory\n");
        return 1;
    }
    for (int i = 0; i < K * D; i++) x[i] = (float)rnd() * 0x1p-32f - 0.5f;
    for (int i = 0; i < K * I; i++) h[i] = (float)rnd() * 0x1p-32f - 0.5f;
    memcpy(bigp, buf, (size_t)(2 * K * gb)); /* 2K matrices' bytes as one of 2 K I rows */
    {
        /* one matrix: data of all rows first, then scales (the layout kn_matmul reads) */
        df_weight w = mx_at(bigp, 2 * K * I, D);
        uint8_t *sc = (uint8_t *)w.scale;
        for (int64_t i = 0; i < 2 * K * I * (D / 32); i++) sc[i] = (uint8_t)(118 + sc[i] % 12);
        c->bigw = w;
    }
    c->lv = lv, c->x = x, c->h = h, c->g = g, c->u = u, c->o = o;
    double *gu = malloc(sizeof(double) * tokens * 3), *dn = malloc(sizeof(double) * tokens * 3);
    double *bg = malloc(sizeof(double) * tokens * 3);
    if (!gu || !dn || !bg) return 1;
    for (int pass = 0; pass < 2; pass++) { /* pass 0 warms up */
        for (int t = 0; t < tokens; t++) {
            int pick[K];
            for (int k = 0; k < K; k++) {
                int e, dup;
                do {
                    e = (int)(rnd() % (uint32_t)E), dup = 0;
                    for (int j = 0; j < k; j++) dup |= pick[j] == e;
                } while (dup);
                pick[k] = e;
                uint8_t *p = buf + (size_t)e * eb;
                c->gate[k] = mx_at(p, I, D), c->up[k] = mx_at(p + gb, I, D), c->down[k] = mx_at(p + 2 * gb, D, I);
            }
            double wk, tl;
            c->big = 0;
            spin_us(gap);
            double a = run_pass(pool, c, threads, 0, &wk, &tl);
            gu[t] = (double)(2 * K * gb) / a / 1e9, gu[tokens + t] = wk * 1e6, gu[2 * tokens + t] = tl * 1e6;
            spin_us(gap);
            a = run_pass(pool, c, threads, 1, &wk, &tl);
            dn[t] = (double)(K * db) / a / 1e9, dn[tokens + t] = wk * 1e6, dn[2 * tokens + t] = tl * 1e6;
            c->big = 1;
            spin_us(gap);
            a = run_pass(pool, c, threads, 0, &wk, &tl);
            bg[t] = (double)(2 * K * gb) / a / 1e9, bg[tokens + t] = wk * 1e6, bg[2 * tokens + t] = tl * 1e6;
        }
    }
    const char *names[3] = {"gate+up (16 experts)", "downs (16 experts)", "one matrix, gate+up's bytes"};
    double *v[3] = {gu, dn, bg};
    printf("%s %d threads, %d experts, gap %.0f us, %s pages; medians of %d passes:\n", kn_level_name(lv), threads,
           E, gap, huge ? "huge" : "4 KB", tokens);
    for (int k = 0; k < 3; k++)
        printf("  %-28s %7.1f GB/s  wake %6.1f us  tail %6.1f us\n", names[k], median(v[k], tokens),
               median(v[k] + tokens, tokens), median(v[k] + 2 * tokens, tokens));
    printf("  DRAM probe                   %7.1f GB/s\n", df_dram_probe(threads, NULL, df_probe_default_mb(), 0.5));
    pool_free(pool);
    munmap(buf, total);
    free(x), free(h), free(g), free(u), free(o), free(c), free(bigp), free(gu), free(dn), free(bg);
    return 0;
}
