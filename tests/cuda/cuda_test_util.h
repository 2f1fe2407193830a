/* cuda_test_util.h — what the CUDA test files share: the skip-without-GPU
 * check and a seeded xorshift generator (each test draws from its own seed,
 * so a failure reproduces alone). Header-only, static inline. */
#ifndef DF_TESTS_CUDA_TEST_UTIL_H
#define DF_TESTS_CUDA_TEST_UTIL_H
#include "../test.h"
#include "../../src/cuda/gpu.h"
#include <stdint.h>

/* 1 if a usable GPU is present; else marks the test skipped (saying why). */
static inline int need_gpu(void) {
    static int state = -1;
    static char why[256];
    if (state < 0) state = gpu_probe(why, sizeof why);
    if (!state) t_skip(why);
    return state;
}

static inline uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}
/* uniform in [-1, 1) */
static inline float frand(uint64_t *s) { return (float)((double)(rng_next(s) >> 11) * 0x1p-52 - 1.0); }
static inline uint64_t seed_of(const char *tag) {
    uint64_t h = 1469598103934665603ull;
    for (; *tag; tag++) h = (h ^ (uint8_t)*tag) * 1099511628211ull;
    return h | 1;
}
#endif
