/* pool.c — fixed-size thread pool with a blocking parallel-for.
 *
 * Owns its worker threads. One job at a time: pool_for publishes (fn, ctx, n,
 * grain), bumps a generation counter, runs chunk 0 itself and waits until
 * every worker has finished its chunk. Chunking is a pure function of n,
 * grain and the thread count (see pool.h on determinism).
 */
#include "pool.h"
#include <pthread.h>
#include <stdlib.h>

struct df_pool {
    int n;
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t gen;        /* job generation; workers run when it changes */
    int pending;         /* workers still running the current job */
    int quit;
    pool_fn fn;
    void *ctx;
    int64_t total, grain;
};

typedef struct { df_pool *p; int tid; } worker_arg;

static void chunk(const df_pool *p, int tid, int64_t *i0, int64_t *i1) {
    int64_t per = (p->total + p->n - 1) / p->n;
    if (p->grain > 1) per = (per + p->grain - 1) / p->grain * p->grain;
    int64_t a = (int64_t)tid * per, b = a + per;
    if (a > p->total) a = p->total;
    if (b > p->total) b = p->total;
    *i0 = a;
    *i1 = b;
}

static void *worker(void *argp) {
    worker_arg *a = argp;
    df_pool *p = a->p;
    int tid = a->tid;
    free(a);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (p->gen == seen && !p->quit) pthread_cond_wait(&p->go, &p->mu);
        if (p->quit) { pthread_mutex_unlock(&p->mu); return NULL; }
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        int64_t i0, i1;
        chunk(p, tid, &i0, &i1);
        if (i1 > i0) p->fn(p->ctx, i0, i1, tid);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0) pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
}

df_pool *pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    df_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    p->th = calloc((size_t)n_threads, sizeof *p->th);
    if (!p->th) { free(p); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *a = malloc(sizeof *a);
        if (!a) { p->n = i; pool_free(p); return NULL; }
        a->p = p;
        a->tid = i;
        if (pthread_create(&p->th[i], NULL, worker, a) != 0) {
            free(a);
            p->n = i;
            pool_free(p);
            return NULL;
        }
    }
    return p;
}

void pool_free(df_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    free(p->th);
    free(p);
}

int pool_size(const df_pool *p) { return p ? p->n : 1; }

void pool_for(df_pool *p, int64_t n, int64_t grain, pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (!p || p->n == 1 || n <= (grain > 1 ? grain : 1)) {
        fn(ctx, 0, n, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->total = n;
    p->grain = grain;
    p->pending = p->n - 1;
    p->gen++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    int64_t i0, i1;
    chunk(p, 0, &i0, &i1);
    if (i1 > i0) fn(ctx, i0, i1, 0);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
