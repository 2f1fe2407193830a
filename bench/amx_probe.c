/* amx_probe.c — what Intel AMX's bf16 tiles compute, and how fast, on the
 * machine it runs on (issue 14: AMX untried). Not part of the engine.
 *
 *   cc -std=c17 -O2 -D_GNU_SOURCE -mamx-tile -mamx-bf16 -mavx512f -pthread \
 *       bench/amx_probe.c -lm -o build/amx_probe
 *   build/amx_probe [THREADS]
 *
 * 1. Rounding: C (16 x 16 fp32) += A (16 x 32 bf16) B (32 x 16 bf16) by
 *    TDPBF16PS against software models of the accumulation, each element
 *    counted where its bits agree:
 *      seq   c = rn(c + a_k b_k) for k = 0..31 (products exact in fp32)
 *      pair  c = rn(c + rn(a_2i b_2i + a_2i+1 b_2i+1)) for i = 0..15
 *      pairx c = rn(c + (a_2i b_2i + a_2i+1 b_2i+1) exactly)
 *      once  c = rn(c + sum of all 32 products exactly)
 *    with random signs and spread exponents (so orders differ), and the
 *    same with subnormal inputs and outputs (DAZ / FTZ).
 * 2. Throughput: four C tiles fed from registers (the peak), one thread and
 *    THREADS threads; a streaming product (A rows from a 64 MB buffer through
 *    tileloadd, B in registers) as GB/s of A.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t pad[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg;

#include "bench_util.h"
static float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
/* a random bf16 with exponent in [lo, hi] (unbiased), random sign */
static uint16_t rbf(int lo, int hi) {
    int e = lo + (int)(rnd() % (uint32_t)(hi - lo + 1));
    uint32_t m = rnd() & 0x7f, s = rnd() & 1;
    if (e < -126) return (uint16_t)((s << 15) | (m ? m : 1)); /* subnormal */
    return (uint16_t)((s << 15) | ((uint32_t)(e + 127) << 7) | m);
}

static void config(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* flush subnormal to signed zero */
static float ftz(float f) { return (fpclassify(f) == FP_SUBNORMAL) ? copysignf(0.0f, f) : f; }

static void rounding(int sub) {
    static uint16_t A[16][32], B[32][16], Bv[16][32];
    static float C0[16][16], C[16][16];
    long agree[4] = {0}, agree_daz[4] = {0}, total = 0;
    for (int trial = 0; trial < 2000; trial++) {
        for (int m = 0; m < 16; m++)
            for (int k = 0; k < 32; k++) A[m][k] = sub && (rnd() & 7) == 0 ? rbf(-140, -127) : rbf(-20, 20);
        for (int k = 0; k < 32; k++)
            for (int n = 0; n < 16; n++) B[k][n] = sub && (rnd() & 7) == 0 ? rbf(-140, -127) : rbf(-20, 20);
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 16; n++) {
                float c = ldexpf((float)(rnd() % 1000) - 500.0f, (int)(rnd() % 40) - 20);
                if (sub && (rnd() & 7) == 0) c = ldexpf(1.0f, -130);
                C0[m][n] = c;
            }
        for (int k2 = 0; k2 < 16; k2++)
            for (int n = 0; n < 16; n++) Bv[k2][2 * n] = B[2 * k2][n], Bv[k2][2 * n + 1] = B[2 * k2 + 1][n];
        memcpy(C, C0, sizeof C);
        _tile_loadd(0, C, 64);
        _tile_loadd(1, A, 64);
        _tile_loadd(2, Bv, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, C, 64);
        for (int daz = 0; daz < 2; daz++)
            for (int m = 0; m < 16; m++)
                for (int n = 0; n < 16; n++) {
                    float p[32];
                    for (int k = 0; k < 32; k++) {
                        float a = bf(A[m][k]), b = bf(B[k][n]);
                        if (daz) a = ftz(a), b = ftz(b);
                        p[k] = a * b; /* exact unless it underflows */
                    }
                    float c = daz ? ftz(C0[m][n]) : C0[m][n];
                    float seq = c, pair = c, pairx = c;
                    long double all = 0;
                    for (int k = 0; k < 32; k++) seq = daz ? ftz(seq + p[k]) : seq + p[k], all += p[k];
                    for (int i = 0; i < 16; i++) {
                        float s2 = p[2 * i] + p[2 * i + 1];
                        pair = daz ? ftz(pair + s2) : pair + s2;
                        pairx = (float)((long double)pairx + (long double)p[2 * i] + (long double)p[2 * i + 1]);
                        if (daz) pairx = ftz(pairx);
                    }
                    float once = (float)((long double)c + all);
                    if (daz) once = ftz(once);
                    const float model[4] = {seq, pair, pairx, once};
                    for (int h = 0; h < 4; h++)
                        if (bits(model[h]) == bits(C[m][n])) (daz ? agree_daz : agree)[h]++;
                    if (!daz) total++;
                }
    }
    printf("rounding (%s): %ld elements; bits agree: seq %ld, pair %ld, pairx %ld, once %ld;"
           " with DAZ/FTZ models: seq %ld, pair %ld, pairx %ld, once %ld\n",
           sub ? "with subnormals" : "normal inputs", total, agree[0], agree[1], agree[2], agree[3], agree_daz[0],
           agree_daz[1], agree_daz[2], agree_daz[3]);
}

typedef struct {
    long iters;
    double secs;
    const uint8_t *buf;
    size_t bytes;
    int stream;
} job;

static void *peak(void *arg) {
    job *j = arg;
    config();
    static __thread uint16_t z[16][32];
    _tile_loadd(4, z, 64);
    _tile_loadd(5, z, 64);
    _tile_loadd(6, z, 64);
    _tile_loadd(7, z, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    double t0 = now();
    if (!j->stream) {
        for (long i = 0; i < j->iters; i++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        /* A: 16-row tiles of a [rows][2048] bf16 matrix (4 KB a row), walked
         * tile by tile; B (two tiles, 32 columns of x limbs) in registers */
        const size_t rowb = 4096, tiles = j->bytes / (16 * rowb);
        for (long it = 0; it < j->iters; it++)
            for (size_t t = 0; t < tiles; t++) {
                const uint8_t *a = j->buf + t * 16 * rowb;
                for (int k = 0; k < 64; k += 2) {
                    _tile_loadd(4, a + k * 64, (long)rowb);
                    _tile_loadd(5, a + (k + 1) * 64, (long)rowb);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
    }
    j->secs = now() - t0;
    float out[16][16];
    _tile_stored(0, out, 64);
    _tile_release();
    return NULL;
}

static void run(int threads, int stream, const uint8_t *buf, size_t bytes) {
    pthread_t th[256];
    job jb[256];
    for (int i = 0; i < threads; i++) {
        jb[i] = (job){stream ? 4 : 2000000, 0, buf + (stream ? (bytes / threads) * i : 0), bytes / threads, stream};
        pthread_create(&th[i], NULL, peak, &jb[i]);
    }
    double flops = 0, worst = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        if (jb[i].secs > worst) worst = jb[i].secs;
        if (!stream)
            flops += 4.0 * 2 * 16 * 16 * 32 * (double)jb[i].iters;
        else
            flops += 2.0 * 32 * ((double)jb[i].bytes / 2) * (double)jb[i].iters;
    }
    if (!stream)
        printf("peak, %d threads: %.0f GFLOP/s (%.1f per thread)\n", threads, flops / worst * 1e-9,
               flops / worst * 1e-9 / threads);
    else
        printf("stream A from %zu MB, %d threads, 32 columns: %.1f GB/s of A, %.0f GFLOP/s\n", bytes >> 20, threads,
               (double)bytes * 4 / worst * 1e-9, flops / worst * 1e-9);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        perror("arch_prctl(ARCH_REQ_XCOMP_PERM): no AMX here");
        return 1;
    }
    config();
    rounding(0);
    rounding(1);
    _tile_release();
    run(1, 0, NULL, 0);
    if (threads > 1) run(threads, 0, NULL, 0);
    size_t big = (size_t)1 << 30;
    uint8_t *buf = aligned_alloc(4096, big);
    for (size_t i = 0; i < big; i += 2) buf[i] = 0, buf[i + 1] = 0x3f;
    run(1, 1, buf, (size_t)64 << 20);
    if (threads > 1) run(threads, 1, buf, big);
    free(buf);
    return 0;
}
