/* bench_util.h — what the standalone bench programs (kn_stream.c,
 * expert_pass.c, amx_probe.c) share: a monotonic clock in seconds and a
 * xorshift generator. Each program has one seed (file-scope state: these are
 * single-threaded setup helpers, not library code). */
#ifndef DF_BENCH_UTIL_H
#define DF_BENCH_UTIL_H
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static uint64_t rs = 88172645463325252ull;
static uint32_t rnd(void) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (uint32_t)(rs >> 32);
}
#endif
