/* test_pool.c — the thread pool's parallel-for (src/base/pool.c): every index
 * runs exactly once, chunks begin on whole grains, and a job's calls stay
 * within its range, for thread counts, sizes and grains of every shape; an
 * index may wait for a lower one (chunks are claimed in order); pinned
 * pools run each thread on its CPU, and CPU lists parse or say why not. */
#include "test.h"
#include "../src/base/cpus.h"
#include "../src/base/pool.h"
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    _Atomic int *hits;
    int64_t n, grain;
    _Atomic int bad; /* a chunk that starts off a grain, is empty or leaves [0, n) */
} cover_job;

static void cover(void *ctx, int64_t i0, int64_t i1, int tid) {
    cover_job *j = ctx;
    (void)tid;
    if (i0 < 0 || i1 > j->n || i0 >= i1 || i0 % j->grain) atomic_store(&j->bad, 1);
    for (int64_t i = i0; i < i1 && i >= 0 && i < j->n; i++) atomic_fetch_add(&j->hits[i], 1);
}

TEST(pool_every_index_once) {
    static const int threads[] = {1, 2, 3, 7, 16};
    static const int64_t sizes[] = {1, 5, 16, 17, 100, 1000, 4097, 98304};
    static const int64_t grains[] = {1, 4, 16, 32, 1024};
    for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
        df_pool *p = pool_new(threads[t]);
        REQUIRE(p, "pool_new(%d)", threads[t]);
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
            for (size_t g = 0; g < sizeof grains / sizeof *grains; g++) {
                const int64_t n = sizes[s];
                cover_job j = {calloc((size_t)n, sizeof(_Atomic int)), n, grains[g], 0};
                REQUIRE(j.hits, "out of memory");
                for (int rep = 0; rep < 3; rep++) pool_for(p, n, grains[g], cover, &j);
                int64_t wrong = 0;
                for (int64_t i = 0; i < n; i++) wrong += atomic_load(&j.hits[i]) != 3;
                CHECK(!wrong, "%d threads, n %lld, grain %lld: %lld indices not run once a call", threads[t],
                      (long long)n, (long long)grains[g], (long long)wrong);
                CHECK(!atomic_load(&j.bad), "%d threads, n %lld, grain %lld: a chunk off its grain or range",
                      threads[t], (long long)n, (long long)grains[g]);
                free((void *)j.hits);
            }
        pool_free(p);
    }
}

/* Chunks are claimed in increasing order (pool.h), so an index may wait for
 * a lower one (moe_batch.c's one pass: a down row waits for its expert's
 * gate and up rows). The upper half waits for the lower half, index by
 * index; a spin that gives up after 2 s records a failure instead of hanging. */
typedef struct {
    _Atomic int *done;
    int64_t half;
    _Atomic int stuck;
} wait_job;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void wait_lower(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    wait_job *j = ctx;
    for (int64_t i = i0; i < i1; i++) {
        if (i < j->half) {
            atomic_store_explicit(&j->done[i], 1, memory_order_release);
            continue;
        }
        const int64_t until = now_ms() + 2000;
        while (!atomic_load_explicit(&j->done[i - j->half], memory_order_acquire))
            if (now_ms() > until) { atomic_store(&j->stuck, 1); break; }
            else sched_yield();
    }
}

TEST(pool_claims_in_order_so_waits_on_lower_indices_finish) {
    static const int threads[] = {2, 5, 16};
    static const int64_t grains[] = {1, 16, 64};
    for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
        df_pool *p = pool_new(threads[t]);
        REQUIRE(p, "pool_new(%d)", threads[t]);
        for (size_t g = 0; g < sizeof grains / sizeof *grains; g++) {
            const int64_t n = 6000;
            wait_job j = {calloc((size_t)n / 2, sizeof(_Atomic int)), n / 2, 0};
            REQUIRE(j.done, "out of memory");
            pool_for(p, n, grains[g], wait_lower, &j);
            CHECK(!atomic_load(&j.stuck), "%d threads, grain %lld: an index waited 2 s for a lower one",
                  threads[t], (long long)grains[g]);
            free((void *)j.done);
        }
        pool_free(p);
    }
}

/* Pinned pools (pool_new_on): thread i runs on cpus[i] (sched_getcpu inside
 * fn, the caller as thread 0 included), the caller gets its own CPUs back at
 * pool_free, and a CPU the process may not run on fails the pool. */
typedef struct {
    const int *cpus;
    _Atomic int wrong, calls;
} where_job;

static void where(void *ctx, int64_t i0, int64_t i1, int tid) {
    where_job *j = ctx;
    (void)i0;
    (void)i1;
    if (sched_getcpu() != j->cpus[tid]) atomic_fetch_add(&j->wrong, 1);
    atomic_fetch_add(&j->calls, 1);
}

/* up to cap CPUs this process may run on, in decreasing order; *outside: one it may not (-1 if none) */
static int allowed_cpus(int *cpus, int cap, int *outside) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set)) return 0;
    int n = 0;
    *outside = -1;
    for (int c = CPU_SETSIZE - 1; c >= 0; c--)
        if (CPU_ISSET(c, &set)) { if (n < cap) cpus[n++] = c; }
        else if (*outside < 0 || c < *outside) *outside = c;
    return n;
}

TEST(pool_pinned_threads_run_on_their_cpus) {
    int cpus[4], outside;
    const int n = allowed_cpus(cpus, 4, &outside);
    REQUIRE(n >= 1, "sched_getaffinity");
    cpu_set_t before, after;
    CPU_ZERO(&before);
    CPU_ZERO(&after);
    REQUIRE(sched_getaffinity(0, sizeof before, &before) == 0, "sched_getaffinity");
    for (int threads = 1; threads <= n; threads++) {
        df_pool *p = pool_new_on(threads, cpus);
        REQUIRE(p, "pool_new_on(%d)", threads);
        where_job j = {cpus, 0, 0};
        for (int rep = 0; rep < 50; rep++) pool_for(p, 4096, 1, where, &j);
        CHECK(atomic_load(&j.calls) > 0 && !atomic_load(&j.wrong), "%d threads: %d of %d calls off their CPU",
              threads, atomic_load(&j.wrong), atomic_load(&j.calls));
        pool_free(p);
        CHECK(sched_getaffinity(0, sizeof after, &after) == 0 && CPU_EQUAL(&before, &after),
              "%d threads: the caller's CPUs were not put back", threads);
    }
    if (outside >= 0) {
        const int bad[2] = {cpus[0], outside};
        df_pool *p = pool_new_on(2, bad);
        CHECK(!p, "a pool on CPU %d, which this process may not run on, started", outside);
        pool_free(p);
    }
}

TEST(pool_cpu_lists_parse_or_say_why) {
    int cpus[4], outside, got[8];
    const int n = allowed_cpus(cpus, 4, &outside);
    REQUIRE(n >= 1, "sched_getaffinity");
    char s[64], err[512];
    snprintf(s, sizeof s, "%d", cpus[0]);
    CHECK(cpus_parse(s, got, 8, err, sizeof err) == 1 && got[0] == cpus[0], "'%s': %s", s, err);
    if (n >= 2) { /* the order written: thread i on the i-th */
        snprintf(s, sizeof s, "%d,%d", cpus[0], cpus[1]);
        CHECK(cpus_parse(s, got, 8, err, sizeof err) == 2 && got[0] == cpus[0] && got[1] == cpus[1], "'%s': %s", s,
              err);
        snprintf(s, sizeof s, "%d-%d", cpus[1], cpus[0]);
        if (cpus[0] == cpus[1] + 1)
            CHECK(cpus_parse(s, got, 8, err, sizeof err) == 2 && got[0] == cpus[1] && got[1] == cpus[0], "'%s': %s",
                  s, err);
    }
    static const char *bad[] = {"", "x", "1-", "-1", "3-1", "0,,1", "0,", "1024", "0 1", "99999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err[0] = 0;
        CHECK(cpus_parse(bad[i], got, 8, err, sizeof err) < 0 && strstr(err, "CPU list"), "'%s': %s", bad[i], err);
    }
    snprintf(s, sizeof s, "%d,%d", cpus[0], cpus[0]);
    CHECK(cpus_parse(s, got, 8, err, sizeof err) < 0 && strstr(err, "listed twice"), "'%s': %s", s, err);
    CHECK(cpus_parse("0-100", got, 8, err, sizeof err) < 0 && strstr(err, "more than 8"), "'0-100': %s", err);
    if (outside >= 0) {
        snprintf(s, sizeof s, "%d", outside);
        CHECK(cpus_parse(s, got, 8, err, sizeof err) < 0 && strstr(err, "may run on"), "'%s': %s", s, err);
    }
}
