/* kn_stream.c — one kernel on one thread, steadier than `bench --kernels` on
 * a shared machine: a random matrix of one weight type, kn_matmul at one
 * SIMD level, the best of many timed calls. Two copies pinned to two CPUs
 * (bench/kn_pair.sh) load the memory as two engine threads do.
 *
 *   make && cc -std=c17 -O2 -D_GNU_SOURCE -Iinclude -pthread bench/kn_stream.c \
 *       build/libdeltafin.a -lm -lpthread -o build/kn_stream
 *   build/kn_stream TYPE LEVEL ROWS COLS [N [REPS [THREADS [OFFSET]]]]
 *     TYPE mxfp4 | int4 (bf16 scales a 32-column group) | bf16 | int8 | f32 | fp8; LEVEL scalar | avx2 | avx512 | amx | neon;
 *     N vectors (default 1: a matvec), REPS calls per timing (default 1),
 *     THREADS > 1: the rows split over a pool as the engine's mm() splits
 *     them (chunks of 16 rows; at amx, x packed once by kn_matmul_amx_pool),
 *     OFFSET: the weights' data that many bytes past a page (default 0; a
 *     release's tensors lie 8-56 bytes past a line: src/experts/place.h)
 *
 * Prints GB/s of weights (data + scales) and GFLOP/s of the best timing of
 * 40 (5 when the matrix exceeds 256 MB, which comes from DRAM anyway), and
 * y[0] (the same for two builds whose bits agree). Matrices of a few MB sit
 * in L2 / L3 and measure the kernel's arithmetic; of hundreds of MB, its
 * streaming.
 */
#include "../src/kernels/kernels.h"
#include "../src/base/pool.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
static float frand(void) { return (float)rnd() * 0x1p-32f - 0.5f; }

static int level_of(const char *s, kn_level *lv) {
    static const kn_level all[] = {KN_SCALAR, KN_AVX2, KN_AVX512, KN_NEON, KN_AMX};
    for (int i = 0; i < 5; i++)
        if (!strcmp(s, kn_level_name(all[i]))) return *lv = all[i], kn_level_available(all[i]);
    return 0;
}

/* One product: on the pool the way engine.c's mm() runs it, else one call. */
static void product(df_pool *pool, kn_level lv, const df_weight *w, const float *x, int n, float *y) {
    if (!pool) {
        kn_matmul(lv, w, x, n, y, w->rows, 0, w->rows);
        return;
    }
    kn_matmul_pool(pool, lv, w, x, n, y, w->rows, w->rows);
}

int main(int argc, char **argv) {
    kn_level lv;
    if (argc < 5 || !level_of(argv[2], &lv)) {
        fprintf(stderr, "usage: kn_stream mxfp4|int4|bf16|int8|f32|fp8 LEVEL ROWS COLS [N [REPS [THREADS [OFFSET]]]] "
                        "(LEVEL available here)\n");
        return 2;
    }
    const char *type = argv[1];
    const int64_t rows = atoll(argv[3]), cols = atoll(argv[4]);
    const int n = argc > 5 ? atoi(argv[5]) : 1, reps = argc > 6 ? atoi(argv[6]) : 1;
    const int threads = argc > 7 ? atoi(argv[7]) : 1;
    const int offset = argc > 8 ? atoi(argv[8]) : 0;
    df_weight w;
    memset(&w, 0, sizeof w);
    w.rows = rows, w.cols = cols;
    int64_t dbytes, sbytes;
    if (!strcmp(type, "mxfp4")) {
        w.type = WT_MXFP4, dbytes = rows * cols / 2, sbytes = rows * (cols / 32);
    } else if (!strcmp(type, "int4")) {
        w.type = WT_INT4_G32, w.scale_dtype = DT_BF16, dbytes = rows * cols / 2, sbytes = rows * (cols / 32) * 2;
    } else if (!strcmp(type, "bf16")) {
        w.type = WT_BF16, dbytes = rows * cols * 2, sbytes = 0;
    } else if (!strcmp(type, "int8")) {
        w.type = WT_I8_ROW, dbytes = rows * cols, sbytes = rows * 4;
    } else if (!strcmp(type, "f32")) {
        w.type = WT_F32, dbytes = rows * cols * 4, sbytes = 0;
    } else if (!strcmp(type, "fp8")) {
        w.type = WT_FP8_BLOCK, w.block_rows = w.block_cols = 128, dbytes = rows * cols;
        sbytes = (rows + 127) / 128 * ((cols + 127) / 128) * 4;
    } else {
        fprintf(stderr, "kn_stream: type %s: mxfp4, int4, bf16, int8, f32 or fp8\n", type);
        return 2;
    }
    if (rows < 1 || cols < 32 || cols % 32 || n < 1 || reps < 1 || threads < 1 || offset < 0 || offset >= 4096) {
        fprintf(stderr, "kn_stream: ROWS >= 1, COLS a multiple of 32, N >= 1, REPS >= 1, THREADS >= 1, "
                        "0 <= OFFSET < 4096\n");
        return 2;
    }
    uint8_t *dbuf = aligned_alloc(4096, ((size_t)dbytes + (size_t)offset + 4095) / 4096 * 4096);
    uint8_t *d = dbuf ? dbuf + offset : NULL, *s = malloc((size_t)sbytes + 4);
    float *x = malloc((size_t)(n * cols) * sizeof *x), *y = malloc((size_t)(n * rows) * sizeof *y);
    if (!d || !s || !x || !y) {
        fprintf(stderr, "kn_stream: out of memory\n");
        return 1;
    }
    for (int64_t i = 0; i < dbytes; i++) {
        uint8_t b = (uint8_t)rnd();
        if (w.type == WT_BF16 && (i & 1)) b = (uint8_t)(0x3c + (b & 3)); /* bf16 high bytes: |v| ~ 0.01-1 */
        if (w.type == WT_FP8_BLOCK) b &= 0x6f;                             /* no NaN codes */
        d[i] = b;
    }
    if (w.type == WT_MXFP4)
        for (int64_t i = 0; i < sbytes; i++) s[i] = (uint8_t)(118 + rnd() % 12);
    if (w.type == WT_I8_ROW)
        for (int64_t i = 0; i < rows; i++) ((float *)s)[i] = 0.01f;
    if (w.type == WT_F32) /* small finite values */
        for (int64_t i = 0; i < dbytes / 4; i++) ((float *)d)[i] = frand();
    if (w.type == WT_FP8_BLOCK)
        for (int64_t i = 0; i < sbytes / 4; i++) ((float *)s)[i] = 0.01f;
    if (w.type == WT_INT4_G32) /* bf16 scales ~ 0.01 */
        for (int64_t i = 0; i < sbytes / 2; i++) ((uint16_t *)s)[i] = (uint16_t)(0x3c20 + rnd() % 64);
    w.data = d, w.scale = sbytes ? s : NULL;
    for (int64_t i = 0; i < n * cols; i++) x[i] = frand();
    df_pool *pool = threads > 1 ? pool_new(threads) : NULL;
    if (threads > 1 && !pool) {
        fprintf(stderr, "kn_stream: cannot start %d threads\n", threads);
        return 1;
    }
    /* 40 timings (5 for a matrix past 256 MB), fewer when they pass ~2 s, at least 3 */
    const int tries = dbytes + sbytes > (256 << 20) ? 5 : 40;
    double best = 1e30, spent = 0, dts[40];
    int done = 0;
    product(pool, lv, &w, x, n, y); /* warm-up */
    for (int t = 0; t < tries && (t < 3 || spent < 2.0); t++) {
        double t0 = now();
        for (int r = 0; r < reps; r++) product(pool, lv, &w, x, n, y);
        double dt = (now() - t0) / reps;
        spent += dt * reps;
        dts[done++] = dt;
        if (dt < best) best = dt;
    }
    for (int i = 1; i < done; i++) /* the median timing too: the best hides a shared machine's spread */
        for (int k = i; k > 0 && dts[k - 1] > dts[k]; k--) {
            const double s = dts[k];
            dts[k] = dts[k - 1], dts[k - 1] = s;
        }
    const double med = dts[done / 2], flop = 2.0 * (double)rows * (double)cols * n;
    printf("%s %s %lld x %lld n=%d t=%d off=%d: %.2f GB/s %.1f GFLOP/s, median %.1f of %d (y0 %.9g)\n", type,
           kn_level_name(lv), (long long)rows, (long long)cols, n, threads, offset, (double)(dbytes + sbytes) / best / 1e9,
           flop / best / 1e9, flop / med / 1e9, done, (double)y[0]);
    pool_free(pool);
    free(dbuf), free(s), free(x), free(y);
    return 0;
}
