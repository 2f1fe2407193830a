/* pool.c — fixed-size thread pool with a blocking parallel-for.
 *
 * Owns its worker threads. One job at a time: pool_for publishes (fn, ctx, n,
 * grain), bumps a generation counter and runs chunks itself beside the
 * workers until none is left, then waits for the workers.
 *
 * Chunks are claimed from a shared counter, so a thread that gets less memory
 * bandwidth than the others does less of the job instead of holding everyone
 * at the end. They shrink as the job drains: a claim takes 1/(2 n) of what is
 * left, at most n / (CHUNKS_PER_THREAD x threads) indices and at least a
 * LEAST_PART-th of that, so the threads' last chunks end close together (16
 * threads on a routed-expert pass of ~2 ms: the first thread to run out
 * waited ~440 us for the last with fixed quarter-share chunks, ~120 us with
 * these; measured with bench/expert_pass.c). LEAST_PART 16, not 4: at 2
 * threads a quarter of a step is 1536 of a pass's 49152 gate+up rows (~0.4
 * ms of reading), and the pass's tail was ~290 us; with 16, 13-35 us, and a
 * K8g decode step 2% faster (an Intel Xeon VM, 2 vCPUs); at 16 threads on
 * the GPU machine's host 0.0425-0.0439 s against 0.0439-0.0449 (three
 * rounds). Which thread runs a chunk, and where chunks begin and end, vary
 * from call to call; callers make every output element depend on its index
 * alone (pool.h), so results do not change.
 *
 * Waking: a worker that finished a job spins for up to SPIN_NS on the
 * generation before sleeping on the condition variable, and pool_for spins
 * as long on the workers' count before sleeping: a decode step issues
 * hundreds of short jobs, and a sleep/wake pair costs more than many of them.
 * The spin outlasts a job's tail and the caller's work between jobs: a worker
 * that went to sleep costs the next job ~15-50 us to wake (16 threads on the
 * H200 machine's host: 4 us with a 200 us spin, 15-55 us with 50 us). On a
 * 2-vCPU VM, where a wake costs more, decode ran ~10% faster with 200 than
 * with 50 (4 of 4 alternating rounds); the 16-core host showed no difference.
 *
 * Pinned pools (pool_new_on): worker i starts on cpus[i] (a thread
 * attribute, so a CPU that cannot be had fails pool_new_on), and the thread
 * that calls pool_for is pinned to cpus[0] at its first call, its CPUs
 * saved and put back when the same thread frees the pool.
 */
#include "pool.h"
#include "cpus.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef DF_POOL_SPIN_NS /* -D overrides for experiments (bench/expert_pass.c) */
#define DF_POOL_SPIN_NS 200000LL
#endif
#ifndef DF_POOL_LEAST
#define DF_POOL_LEAST 16
#endif
enum { CHUNKS_PER_THREAD = 4, LEAST_PART = DF_POOL_LEAST /* the smallest claim: step / LEAST_PART */ };
#define SPIN_NS ((int64_t)DF_POOL_SPIN_NS)

struct df_pool {
    int n;
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    _Atomic uint64_t gen;  /* job generation; workers run when it changes */
    _Atomic int pending;   /* workers still running the current job */
    _Atomic int quit;
    _Atomic int64_t next;  /* first index of the next unclaimed chunk */
    pool_fn fn;            /* the job: written before gen is bumped */
    void *ctx;
    int64_t total, step, grain, least; /* chunks: at most step, at least least, whole grains */
    int *cpus;             /* pinned pools: thread i's CPU; NULL: unpinned */
    int caller_pinned;     /* caller (the last thread to call pool_for) runs on cpus[0] */
    pthread_t caller;
    cpus_saved *caller_cpus; /* its CPUs before */
};

typedef struct { df_pool *p; int tid; } worker_arg;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Runs chunks of the current job until none is left. */
static void run_chunks(df_pool *p, int tid) {
    int64_t i0 = atomic_load_explicit(&p->next, memory_order_relaxed), i1;
    for (;;) {
        do { /* claim [i0, i1): 1/(2n) of the rest, within [least, step], whole grains */
            if (i0 >= p->total) return;
            int64_t k = (p->total - i0) / (2 * p->n);
            k = k < p->least ? p->least : k > p->step ? p->step : (k + p->grain - 1) / p->grain * p->grain;
            i1 = i0 + k < p->total ? i0 + k : p->total;
        } while (!atomic_compare_exchange_weak_explicit(&p->next, &i0, i1, memory_order_relaxed,
                                                        memory_order_relaxed));
        p->fn(p->ctx, i0, i1, tid);
        i0 = atomic_load_explicit(&p->next, memory_order_relaxed);
    }
}

/* Spins up to SPIN_NS while the generation is `seen`; returns its last value. */
static uint64_t spin_gen(df_pool *p, uint64_t seen) {
    int64_t t_end = 0;
    for (int i = 0;; i++) {
        uint64_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->quit, memory_order_relaxed)) return g;
        if ((i & 63) == 0) {
            int64_t t = now_ns();
            if (!t_end) t_end = t + SPIN_NS;
            else if (t > t_end) return g;
        }
        pool_cpu_relax();
    }
}

static void *worker(void *argp) {
    worker_arg *a = argp;
    df_pool *p = a->p;
    int tid = a->tid;
    free(a);
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = spin_gen(p, seen);
        if (g == seen && !atomic_load(&p->quit)) {
            pthread_mutex_lock(&p->mu);
            while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->quit)) pthread_cond_wait(&p->go, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->quit)) return NULL;
        seen = g;
        run_chunks(p, tid);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

df_pool *pool_new(int n_threads) { return pool_new_on(n_threads, NULL); }

df_pool *pool_new_on(int n_threads, const int *cpus) {
    if (n_threads < 1) n_threads = 1;
    df_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    p->th = calloc((size_t)n_threads, sizeof *p->th);
    if (cpus && (p->cpus = malloc((size_t)n_threads * sizeof *p->cpus)))
        memcpy(p->cpus, cpus, (size_t)n_threads * sizeof *p->cpus);
    if (!p->th || (cpus && !p->cpus)) { p->n = 1; pool_free(p); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *a = malloc(sizeof *a);
        if (!a) { p->n = i; pool_free(p); return NULL; }
        a->p = p;
        a->tid = i;
        pthread_attr_t attr;
        int rc = pthread_attr_init(&attr);
        if (!rc && cpus) rc = cpus_attr_pin(&attr, cpus[i]);
        if (!rc) rc = pthread_create(&p->th[i], &attr, worker, a);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            free(a);
            p->n = i;
            pool_free(p);
            return NULL;
        }
    }
    return p;
}

/* A pinned pool's caller runs as thread 0 on cpus[0]: pinned at its first
 * call (a thread that takes over from another is pinned in turn). */
static void pin_caller(df_pool *p) {
    const pthread_t self = pthread_self();
    if (p->caller_pinned && pthread_equal(p->caller, self)) return;
    cpus_saved *sv = NULL;
    if (cpus_pin_self(p->cpus[0], &sv) != 0) return; /* checked when the pool started: runs unpinned */
    free(p->caller_cpus); /* the previous caller's: that thread keeps its pin */
    p->caller = self;
    p->caller_pinned = 1;
    p->caller_cpus = sv;
}

void pool_free(df_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    if (p->caller_pinned && pthread_equal(p->caller, pthread_self())) cpus_restore(p->caller_cpus);
    else free(p->caller_cpus);
    free(p->cpus);
    free(p->th);
    free(p);
}

int pool_size(const df_pool *p) { return p ? p->n : 1; }

void pool_for(df_pool *p, int64_t n, int64_t grain, pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (p && p->cpus) pin_caller(p);
    if (!p || p->n == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    int64_t step = (n + (int64_t)p->n * CHUNKS_PER_THREAD - 1) / ((int64_t)p->n * CHUNKS_PER_THREAD);
    step = (step + grain - 1) / grain * grain;
    p->fn = fn;
    p->ctx = ctx;
    p->total = n;
    p->step = step;
    p->grain = grain;
    p->least = step / LEAST_PART / grain * grain > grain ? step / LEAST_PART / grain * grain : grain;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->pending, p->n - 1, memory_order_relaxed);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    run_chunks(p, 0);
    int64_t t_end = now_ns() + SPIN_NS;
    for (int i = 0; atomic_load_explicit(&p->pending, memory_order_acquire) > 0; i++) {
        if ((i & 63) == 0 && now_ns() > t_end) break;
        pool_cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
