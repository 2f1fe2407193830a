/* kda_recur.c — the time of one KDA layer's work between its projections
 * on one thread: the short convolution (kda_conv_channel, every channel),
 * the reference recurrence (kda_recur_head, kda_core.c) and the engine's
 * (kda_recur_head_fast at each level this CPU has; kn_kda_recur alone too).
 *
 *   make && cc -std=c17 -O2 -D_GNU_SOURCE -Iinclude -pthread bench/kda_recur.c \
 *       build/libdeltafin.a -lm -lpthread -o build/kda_recur
 *   build/kda_recur [H D n reps]     (default 96 128 32 5: a K3 layer, one prefill chunk)
 *
 * Prints the median over reps of ms per call of n tokens (all H heads), us
 * per token, and the fastest rep (on a shared machine the steadier figure). Inputs are random; the gate has the K3 lower bound (-5).
 */
#include "../src/kernels/kernels.h"
#include "../src/model/kda_core.h"
#include "../src/model/kda_fast.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static uint64_t rs = 88172645463325252ull;
static float frand(float lo, float hi) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return lo + (hi - lo) * (float)((double)(rs >> 11) * 0x1p-53);
}
static float *rvec(size_t n, float lo, float hi) {
    float *x = malloc(n * sizeof *x);
    if (!x) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (size_t i = 0; i < n; i++) x[i] = frand(lo, hi);
    return x;
}
static int cmpd(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

enum { CONV, CONV_FAST, REF, FAST, KERNEL };

int main(int argc, char **argv) {
    int H = argc > 1 ? atoi(argv[1]) : 96, D = argc > 2 ? atoi(argv[2]) : 128;
    int n = argc > 3 ? atoi(argv[3]) : 32, reps = argc > 4 ? atoi(argv[4]) : 5;
    if (H < 1 || D < 1 || n < 1 || reps < 1 || reps > 99) { fprintf(stderr, "usage: kda_recur [H D n reps]\n"); return 2; }
    kda_shape sh = {0, H, D, 4, 1, 1, -5.0f, 1e-5f};
    size_t P = (size_t)H * D, NP = (size_t)n * P, SF = (size_t)kda_state_floats(&sh);
    kda_params p = {{rvec(P * 4, -0.5f, 0.5f), rvec(P * 4, -0.5f, 0.5f), rvec(P * 4, -0.5f, 0.5f)},
                    rvec(P, 0.2f, 3.0f), rvec(P, -2, 2), rvec((size_t)D, 0.5f, 1.5f)};
    float *q0 = rvec(NP, -1, 1), *k0 = rvec(NP, -1, 1), *v0 = rvec(NP, -1, 1), *f = rvec(NP, -3, 3);
    float *braw = rvec((size_t)n * H, -3, 3), *gate = rvec(NP, -3, 3), *state = rvec(SF, -0.5f, 0.5f);
    float *q = malloc(NP * 4), *k = malloc(NP * 4), *v = malloc(NP * 4), *o = malloc(NP * 4), *decay = rvec(NP, 0.8f, 1.0f);
    float *beta = rvec((size_t)n, 0.1f, 0.9f);
    kda_io io = {q, k, v, f, braw, gate, o, NULL};
    printf("H %d D %d n %d, one thread, median of %d (ms per call; us per token)\n", H, D, n, reps);
    struct { const char *name; int what; int lv; } rows[] = {
        {"conv, reference (kda_conv_channel x 3P)", CONV, 0},
        {"conv, fast scalar (kda_conv_fast)", CONV_FAST, KN_SCALAR},
        {"conv, fast avx2", CONV_FAST, KN_AVX2},
        {"conv, fast avx512", CONV_FAST, KN_AVX512},
        {"recurrence, reference (kda_recur_head)", REF, 0},
        {"recurrence, fast scalar", FAST, KN_SCALAR},
        {"recurrence, fast avx2", FAST, KN_AVX2},
        {"recurrence, fast avx512", FAST, KN_AVX512},
        {"recurrence, fast neon", FAST, KN_NEON},
        {"  kn_kda_recur alone, scalar", KERNEL, KN_SCALAR},
        {"  kn_kda_recur alone, avx2", KERNEL, KN_AVX2},
        {"  kn_kda_recur alone, avx512", KERNEL, KN_AVX512},
        {"  kn_kda_recur alone, neon", KERNEL, KN_NEON},
    };
    for (size_t r = 0; r < sizeof rows / sizeof *rows; r++) {
        if (rows[r].what != CONV && rows[r].what != REF && !kn_level_available((kn_level)rows[r].lv)) continue;
        double t[99];
        for (int i = 0; i < reps; i++) {
            memcpy(q, q0, NP * 4), memcpy(k, k0, NP * 4), memcpy(v, v0, NP * 4);
            double t0 = now();
            switch (rows[r].what) {
            case CONV:
                for (int w = 0; w < 3; w++)
                    for (int c = 0; c < (int)P; c++) kda_conv_channel(&sh, &p, state, w, c, n, &io);
                break;
            case CONV_FAST:
                for (int w = 0; w < 3; w++) kda_conv_fast((kn_level)rows[r].lv, &sh, &p, state, w, 0, (int)P, n, &io);
                break;
            case REF:
                for (int h = 0; h < H; h++) kda_recur_head(&sh, &p, state, h, n, &io);
                break;
            case FAST:
                for (int h = 0; h < H; h++) kda_recur_head_fast((kn_level)rows[r].lv, &sh, &p, state, h, n, &io, decay);
                break;
            default:
                for (int h = 0; h < H; h++) {
                    kn_kda_head a = {D, n, state + 3 * P * 3 + (size_t)h * D * D, q + (size_t)h * D, k + (size_t)h * D,
                                     v + (size_t)h * D, decay + (size_t)h * D, (int64_t)P, beta, o + (size_t)h * D, NULL, 0};
                    kn_kda_recur((kn_level)rows[r].lv, &a);
                }
            }
            t[i] = now() - t0;
        }
        qsort(t, (size_t)reps, sizeof *t, cmpd);
        double med = t[reps / 2];
        printf("  %-42s %9.3f ms  %9.1f us/token   (min %.3f ms)\n", rows[r].name, 1e3 * med, 1e6 * med / n, 1e3 * t[0]);
    }
    return 0;
}
