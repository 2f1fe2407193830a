/* pool.h — a fixed thread pool with a blocking parallel-for.
 *
 * pool_for splits [0, n) into contiguous chunks (a few per thread) that the
 * threads claim as they go: which thread runs a chunk varies from call to
 * call, so the caller's function must make each output element depend on its
 * index alone (never on the thread or on which other indices share its
 * call); results are then byte-identical for any thread count and any run.
 * Per-thread scratch indexed by thread_index is fine. Calls must come from
 * one thread. Chunks are claimed in increasing order, each only after every
 * chunk below it was claimed by a running call of fn, so fn may wait for
 * the work of lower indices (test pool_claims_in_order_so_waits_on_lower_indices_finish).
 */
#ifndef DF_BASE_POOL_H
#define DF_BASE_POOL_H
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

typedef struct df_pool df_pool;
/* fn(ctx, i0, i1, thread_index) handles indices [i0, i1). */
typedef void (*pool_fn)(void *ctx, int64_t i0, int64_t i1, int tid);

df_pool *pool_new(int n_threads); /* n_threads >= 1; NULL on failure */
/* pool_new with thread i pinned to CPU cpus[i] (n_threads entries; NULL:
 * unpinned). Thread 0 is the caller of pool_for: it is pinned to cpus[0] at
 * its first call, and its CPUs are put back if the same thread frees the
 * pool (threads it creates meanwhile inherit its pin). NULL on failure
 * (among others a CPU the process may not run on: cpus_check first). */
df_pool *pool_new_on(int n_threads, const int *cpus);
void pool_free(df_pool *p);
int pool_size(const df_pool *p);
/* Runs fn over [0, n) and waits. `grain` is the smallest chunk worth a
 * thread (chunks are rounded to multiples of it, except the last); fn may be
 * called several times per thread. */
void pool_for(df_pool *p, int64_t n, int64_t grain, pool_fn fn, void *ctx);
/* One step of a spin-wait (pause / yield: the core's hint, not the OS's). */
static inline void pool_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
/* Inside fn: takes k from *left (acquire-release); 1 for the call that
 * brings it to 0, which then sees every earlier call's writes (it may
 * finish the shared work and set a flag for pool_wait_flag). */
static inline int pool_count_done(_Atomic int64_t *left, int64_t k) {
    return atomic_fetch_sub_explicit(left, k, memory_order_acq_rel) == k;
}
/* Inside fn: waits until *flag is set (acquire) by the work of a lower
 * index; spins, then yields to the OS (more threads than cores: let the
 * thread we wait for run). */
static inline void pool_wait_flag(_Atomic int *flag) {
    for (int k = 0; !atomic_load_explicit(flag, memory_order_acquire); k++) {
        if (k < 4096) pool_cpu_relax();
        else sched_yield();
    }
}
#endif
