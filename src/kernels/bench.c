/* bench.c — the kernel benchmark: matvec GB/s per weight type against a DRAM
 * read probe measured in the same process (kn_bench, df_bench_kernels).
 *
 * Owns: the probe (every pool thread sums its slice of a buffer far larger
 * than the last-level cache), random matrices of each weight type, and the
 * timing loop (matvec split across the pool by row ranges, as the engine
 * does). Refuses: printing (the CLI formats rows) and anything the engine
 * uses; this file is only reached from `deltafin bench --kernels`.
 *
 * Numbers: GB = 1e9 bytes, MB = 1e6; a matvec's bytes are wt_bytes (data +
 * scales). Every figure is the best of the timed repetitions (probe and
 * kernels alike, so their ratio compares like with like); the probe runs
 * before and after the kernels and reports the better of the two.
 *
 * Sections: 1. timing helpers  2. DRAM probe  3. random matrices
 *           4. matvec timing  5. kn_bench / df_bench_kernels
 */
#include "kernels.h"
#include "../base/pool.h"
#include "deltafin.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- 1. timing helpers ------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

enum { MAX_REPS = 4096 };

/* Runs fn(ctx) until `seconds` have passed (at least min_reps times, at most
 * MAX_REPS) after one untimed warm-up; returns the best time of one call. */
static double time_best(void (*fn)(void *), void *ctx, double seconds, int min_reps) {
    fn(ctx);
    double best = 1e30, t_end = now_s() + seconds;
    for (int i = 0; i < MAX_REPS; i++) {
        double t0 = now_s();
        fn(ctx);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
        if (i + 1 >= min_reps && now_s() >= t_end) break;
    }
    return best;
}

/* ---- 2. DRAM probe ------------------------------------------------------------ */

enum { PROBE_CHUNK = 1 << 15 }; /* words per pool index (256 KB) */

typedef struct {
    const uint64_t *buf;
    int64_t words;
    uint64_t sink[64 * 8]; /* one padded slot per thread, so the sums are not dead code */
    df_pool *pool;
} probe_ctx;

/* Each thread reads its slice as 4 interleaved streams over 4 consecutive
 * 16 KB segments (64-byte steps), the access pattern of a 4-row matvec tile:
 * on the machines measured a single sequential stream reads 20-40% slower,
 * which would flatter every kernel. 16-byte vectors keep this file portable. */
typedef uint64_t probe_v2 __attribute__((vector_size(16)));
enum { SEG = 2048 }; /* words per stream segment (16 KB); PROBE_CHUNK is a multiple of 4 * SEG */

static void probe_part(void *vctx, int64_t i0, int64_t i1, int tid) {
    probe_ctx *p = vctx;
    int64_t a = i0 * PROBE_CHUNK, b = i1 * PROBE_CHUNK;
    if (b > p->words) b = p->words;
    probe_v2 s0 = {0, 0}, s1 = {0, 0}, s2 = {0, 0}, s3 = {0, 0};
    int64_t i = a;
    for (; i + 4 * SEG <= b; i += 4 * SEG) {
        const uint64_t *w = p->buf + i;
        /* the next 4 segments' same lines into L2 as these are read, as the
         * one-vector matvec tiles prefetch (matvec_avx512.c), so the probe
         * reads the way they do (the bf16 / int8 tiles still outread it on
         * the machines measured: bench/cpu_NOTES.md, nineteenth session) */
        const int ahead = i + 8 * SEG <= b;
        for (int64_t k = 0; k < SEG; k += 8) {
            probe_v2 v0, v1, v2, v3;
            if (ahead)
                for (int m = 0; m < 4; m++) __builtin_prefetch(w + 4 * SEG + m * SEG + k, 0, 2);
#define PROBE_SUM(S, OFF)                                                       \
            memcpy(&v0, w + (OFF) + k, 16), memcpy(&v1, w + (OFF) + k + 2, 16), \
            memcpy(&v2, w + (OFF) + k + 4, 16), memcpy(&v3, w + (OFF) + k + 6, 16); \
            S += (v0 + v1) + (v2 + v3);
            PROBE_SUM(s0, 0)
            PROBE_SUM(s1, SEG)
            PROBE_SUM(s2, 2 * SEG)
            PROBE_SUM(s3, 3 * SEG)
#undef PROBE_SUM
        }
    }
    uint64_t t = 0;
    for (; i < b; i++) t += p->buf[i];
    probe_v2 s = (s0 + s1) + (s2 + s3);
    p->sink[(tid & 63) * 8] += t + s[0] + s[1];
}

static void probe_once(void *vctx) {
    probe_ctx *p = vctx;
    pool_for(p->pool, (p->words + PROBE_CHUNK - 1) / PROBE_CHUNK, 1, probe_part, p);
}

static void fill_part(void *vctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    probe_ctx *p = vctx;
    int64_t a = i0 * PROBE_CHUNK, b = i1 * PROBE_CHUNK;
    if (b > p->words) b = p->words;
    uint64_t *w = (uint64_t *)p->buf;
    for (int64_t i = a; i < b; i++) w[i] = (uint64_t)i * 0x9e3779b97f4a7c15ull;
}

/* A sixteenth of physical memory, but at least 512 MB: the most a probe
 * buffer may take (the decode bench probes with the model in the page
 * cache; a 5.4 GB buffer on a 23 GB VM pushed a 7.5 GB model out of it, and
 * the VM's sysconf reports a 320 MB L3 where lscpu says 32). */
static int64_t mem_cap(void) {
    const int64_t floor_ = (int64_t)512 << 20;
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    int64_t cap = pages > 0 && psz > 0 ? (int64_t)pages * psz / 16 : floor_;
    return cap > floor_ ? cap : floor_;
}

/* The last-level cache in bytes (0 when the system does not say). */
static int64_t l3_bytes(void) {
#ifdef _SC_LEVEL3_CACHE_SIZE
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? (int64_t)l3 : 0;
#else
    return 0;
#endif
}

/* Bytes for the probe buffer: >= 512 MB, >= 16x the last-level cache and
 * >= twice the matrices, within mem_cap. Smaller buffers read partly from a
 * large L3 between passes: on the H200 machine's host (300 MB L3, 16
 * threads) a 2.4 GB buffer read 149-151 GB/s and an 8 GB one 134, and 4 GB
 * bf16 / int8 matrices read 96-97% of the latter. */
static int64_t probe_bytes(double mb) {
    const int64_t l3 = l3_bytes(), cap = mem_cap();
    int64_t n = (int64_t)512 << 20;
    if (16 * l3 > n) n = 16 * l3;
    if ((int64_t)(2 * mb * 1e6) > n) n = (int64_t)(2 * mb * 1e6);
    return n < cap ? n : cap;
}

static double probe_gbps_run(df_pool *pool, double mb, double seconds) {
    int64_t bytes = probe_bytes(mb);
    probe_ctx *p = calloc(1, sizeof *p);
    uint64_t *buf = malloc((size_t)bytes);
    if (!p || !buf) { free(p); free(buf); return 0; }
    p->buf = buf;
    p->words = bytes / 8;
    p->pool = pool;
    pool_for(pool, (p->words + PROBE_CHUNK - 1) / PROBE_CHUNK, 1, fill_part, p); /* fault pages in */
    double t = time_best(probe_once, p, seconds, 5);
    free(buf);
    free(p);
    return (double)bytes / t / 1e9;
}

/* ---- 3. random matrices ------------------------------------------------------- */

typedef struct {
    const char *name;
    wt_type type;
    st_dtype scale_dtype;
} bench_kind;

static const bench_kind KINDS[] = {
    {"f32", WT_F32, DT_UNKNOWN},       {"bf16", WT_BF16, DT_UNKNOWN},
    {"f16", WT_F16, DT_UNKNOWN},       {"int8", WT_I8_ROW, DT_UNKNOWN},
    {"fp8", WT_FP8_BLOCK, DT_UNKNOWN}, {"int4", WT_INT4_G32, DT_BF16},
    {"mxfp4", WT_MXFP4, DT_UNKNOWN},
};

enum { COLS = 7168, FILL_CHUNK = 1 << 16 };

typedef struct {
    uint8_t *p;
    int64_t n;
    wt_type type;
} fill_ctx;

/* Random bytes made valid for the type: finite floats of moderate size, no
 * fp8 NaN codes; every nibble code is valid for int4 / mxfp4. */
static void fill_data(void *vctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    fill_ctx *f = vctx;
    int64_t a = i0 * FILL_CHUNK, b = i1 * FILL_CHUNK;
    if (b > f->n) b = f->n;
    uint64_t s = (uint64_t)a * 0x9e3779b97f4a7c15ull + 0x1234567ull;
    for (int64_t i = a; i < b; i += 8) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        uint64_t v = s;
        switch (f->type) {
        case WT_F32: v = (v & 0x807fffff807fffffull) | 0x3f0000003f000000ull; break;
        case WT_BF16: v = (v & 0x807f807f807f807full) | 0x3f003f003f003f00ull; break;
        case WT_F16: v = (v & 0x83ff83ff83ff83ffull) | 0x3800380038003800ull; break;
        case WT_FP8_BLOCK: v &= 0xbfbfbfbfbfbfbfbfull; break; /* exponent <= 7 */
        default: break;
        }
        int64_t k = b - i < 8 ? b - i : 8;
        memcpy(f->p + i, &v, (size_t)k);
    }
}

/* Builds a rows x COLS matrix of about mb MB; the caller frees data/scale. */
static int make_matrix(df_pool *pool, const bench_kind *k, double mb, df_weight *w) {
    memset(w, 0, sizeof *w);
    w->type = k->type;
    w->cols = COLS;
    w->scale_dtype = k->scale_dtype;
    w->block_rows = w->block_cols = 128;
    double bpe = k->type == WT_F32 ? 4 : k->type == WT_BF16 || k->type == WT_F16 ? 2
               : k->type == WT_INT4_G32 || k->type == WT_MXFP4 ? 0.5 : 1;
    int64_t rows = (int64_t)(mb * 1e6 / (bpe * COLS));
    w->rows = rows < 16 ? 16 : rows / 16 * 16;
    int64_t n = w->rows * COLS, dbytes = (int64_t)((double)n * bpe);
    int64_t nsc = 0, ssize = 4;
    switch (k->type) {
    case WT_FP8_BLOCK: nsc = ((w->rows + 127) / 128) * ((COLS + 127) / 128); break;
    case WT_INT4_G32: nsc = n / 32, ssize = 2; break;
    case WT_MXFP4: nsc = n / 32, ssize = 1; break;
    case WT_I8_ROW: nsc = w->rows; break;
    default: break;
    }
    uint8_t *data = malloc((size_t)dbytes);
    uint8_t *scale = nsc ? malloc((size_t)(nsc * ssize)) : NULL;
    if (!data || (nsc && !scale)) { free(data); free(scale); return 0; }
    fill_ctx f = {data, dbytes, k->type};
    pool_for(pool, (dbytes + FILL_CHUNK - 1) / FILL_CHUNK, 1, fill_data, &f);
    for (int64_t i = 0; i < nsc; i++) {
        switch (k->type) {
        case WT_INT4_G32: ((uint16_t *)scale)[i] = (uint16_t)(0x3c00 + (i & 0x7f)); break; /* bf16 ~0.008 */
        case WT_MXFP4: scale[i] = (uint8_t)(120 + (i & 7)); break;
        default: ((float *)scale)[i] = 0.01f + 1e-6f * (float)(i & 1023); break;
        }
    }
    w->data = data;
    w->scale = scale;
    return 1;
}

/* ---- 4. matvec timing --------------------------------------------------------- */

typedef struct {
    df_pool *pool;
    kn_level lv;
    const df_weight *w;
    const float *x; /* n vectors of COLS */
    float *y;       /* n rows of `rows` outputs */
    int n;
    int64_t rows;   /* the first `rows` rows of w */
} mv_ctx;

static void mv_once(void *vctx) {
    mv_ctx *m = vctx;
    /* as the engine's products run (engine.c's mm) */
    kn_matmul_pool(m->pool, m->lv, m->w, m->x, m->n, m->y, m->rows, m->rows);
}

/* GFLOP/s of a DF_BENCH_GEMM_N-vector matmul over the first rows of w
 * (about GEMM_FLOP flops a call, or all of w). */
enum { GEMM_FLOP = 1000000000 };
static double gemm_gflops(df_pool *pool, kn_level lv, const df_weight *w, const float *X,
                          double seconds) {
    const int n = DF_BENCH_GEMM_N;
    int64_t rows = (int64_t)GEMM_FLOP / (2LL * n * w->cols);
    rows = rows < 16 ? 16 : rows / 16 * 16;
    if (rows > w->rows) rows = w->rows;
    float *Y = malloc((size_t)(rows * n) * sizeof *Y);
    if (!Y) return 0;
    mv_ctx m = {pool, lv, w, X, Y, n, rows};
    double t = time_best(mv_once, &m, seconds, 2);
    free(Y);
    return 2.0 * (double)n * (double)rows * (double)w->cols / t / 1e9;
}

/* All pool threads run the FMA probe at once: GFLOP/s of the whole pool. */
typedef struct {
    df_pool *pool;
    kn_level lv;
    int64_t iters;
    double flops[64];
    float sink[64];
} fma_ctx;

static void fma_part(void *vctx, int64_t i0, int64_t i1, int tid) {
    fma_ctx *f = vctx;
    for (int64_t i = i0; i < i1; i++) f->flops[i % 64] = kn_fma_loop(f->lv, f->iters, &f->sink[tid % 64]);
}

static void fma_once(void *vctx) {
    fma_ctx *f = vctx;
    pool_for(f->pool, pool_size(f->pool), 1, fma_part, f);
}

/* ---- 5. kn_bench / df_bench_kernels ------------------------------------------- */

static double fma_gflops(df_pool *pool, kn_level lv, double seconds) {
    fma_ctx f = {.pool = pool, .lv = lv, .iters = 1 << 18};
    double t = time_best(fma_once, &f, seconds, 3), flops = 0;
    for (int i = 0; i < pool_size(pool) && i < 64; i++) flops += f.flops[i];
    return flops / t / 1e9;
}

int kn_bench(struct df_pool *pool, kn_level lv, double mb, double seconds, df_bench_row *rows,
             double *probe_gbps, double *fma) {
    if (mb < 1) mb = 1;
    if (seconds <= 0) seconds = 0.1;
    *fma = fma_gflops(pool, lv, seconds);
    *probe_gbps = probe_gbps_run(pool, mb, seconds);
    if (*probe_gbps <= 0) return 0;
    float *x = malloc((size_t)COLS * DF_BENCH_GEMM_N * sizeof *x);
    if (!x) return 0;
    for (int i = 0; i < COLS * DF_BENCH_GEMM_N; i++) x[i] = (float)((i * 37) % 101 - 50) * 0.02f;
    int n = 0;
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0] && n < 16; i++) {
        df_weight w;
        if (!make_matrix(pool, &KINDS[i], mb, &w)) break;
        float *y = malloc((size_t)w.rows * sizeof *y);
        if (!y) { free((void *)w.data); free((void *)w.scale); break; }
        mv_ctx m = {pool, lv, &w, x, y, 1, w.rows};
        double t = time_best(mv_once, &m, seconds, 3);
        double bytes = (double)wt_bytes(&w);
        df_bench_row *r = &rows[n++];
        memset(r, 0, sizeof *r);
        snprintf(r->name, sizeof r->name, "%s", KINDS[i].name);
        r->gbps = bytes / t / 1e9;
        r->ms_per_call = t * 1e3;
        r->weight_mb = bytes / 1e6;
        r->gemm_gflops = gemm_gflops(pool, lv, &w, x, seconds);
        free(y);
        free((void *)w.data);
        free((void *)w.scale);
    }
    free(x);
    /* probe again after the kernels and keep the better one: on a shared
     * machine bandwidth drifts, and the ratio must not flatter the kernels */
    double again = probe_gbps_run(pool, mb, seconds);
    if (again > *probe_gbps) *probe_gbps = again;
    return n;
}

/* The level simd_level runs as: it if this CPU has it, else the default. */
static kn_level resolve_level(int simd_level) {
    if (simd_level >= 0 && simd_level <= KN_AMX && kn_level_available((kn_level)simd_level))
        return (kn_level)simd_level;
    return kn_detect();
}

const char *df_simd_level_name(int simd_level) { return kn_level_name(resolve_level(simd_level)); }

const char *df_simd_level_desc(int simd_level) {
    const kn_level lv = resolve_level(simd_level);
    const int x86 = lv == KN_AVX2 || lv == KN_AVX512 || lv == KN_AMX;
    const int l1 = x86 && kn_pf_next_l1(); /* the decode tiles' next-tile prefetch level */
    if (lv == KN_AVX2 && kn_avxvnni_usable())
        return l1 ? "avx2 (4-bit tiles by avx-vnni, decode prefetch into L1)" : "avx2 (4-bit tiles by avx-vnni)";
    if (!l1) return kn_level_name(lv);
    return lv == KN_AVX2 ? "avx2 (decode prefetch into L1)"
           : lv == KN_AVX512 ? "avx512 (decode prefetch into L1)" : "amx (decode prefetch into L1)";
}

int df_bench_kernels(int n_threads, const int *cpus, int simd_level, double mb, double seconds,
                     df_bench_row *rows, double *probe_gbps, double *fma_gflops) {
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)c : 1;
    }
    *probe_gbps = *fma_gflops = 0;
    df_pool *pool = pool_new_on(n_threads, cpus);
    if (!pool) return 0;
    int n = kn_bench(pool, resolve_level(simd_level), mb, seconds, rows, probe_gbps, fma_gflops);
    pool_free(pool);
    return n;
}

double df_dram_probe(int n_threads, const int *cpus, double mb, double seconds) {
    if (n_threads <= 0) n_threads = 1;
    df_pool *pool = pool_new_on(n_threads, cpus);
    if (!pool) return 0;
    double g = probe_gbps_run(pool, mb, seconds);
    pool_free(pool);
    return g;
}

double df_fma_probe(int n_threads, const int *cpus, double seconds) {
    if (n_threads <= 0) n_threads = 1;
    df_pool *pool = pool_new_on(n_threads, cpus);
    if (!pool) return 0;
    double g = fma_gflops(pool, kn_detect(), seconds);
    pool_free(pool);
    return g;
}

double df_probe_default_mb(void) {
    /* eight times the last-level cache, so at most an eighth of a pass can
     * hit it (a 512 MB matrix on a 300 MB L3 read 119-127% of the probe for
     * the dense types, a 1.26 GB one 101-113%, a 4 GB one 96-97%), within
     * half of mem_cap (the probe buffer takes twice this) */
    double mb = 8.0 * (double)l3_bytes() / 1e6, cap = (double)mem_cap() / 2e6;
    if (mb > cap) mb = cap;
    return mb > 512 ? mb : 512;
}
