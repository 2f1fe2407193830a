/* resident_copy.c — the resident spine's matrices copied into anonymous
 * memory (resident_copy.h).
 *
 * Owns: the region (one mmap, unmapped by rcopy_free), the table of the
 * tensors in it and the thread that fills it. The views stay the
 * program's; only their data and scale pointers change, once, in
 * rcopy_finish, which the engine calls between steps.
 */
#include "resident_copy.h"
#include "../base/err.h"
#include "../base/mem.h"
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Pieces the copy reads one at a time: large enough for the disk's full
 * rate, small enough that a 500 MB matrix spreads over a pool's threads
 * and a close waits at most one of them. */
enum { PIECE = 4 << 20 };
static const int64_t HUGE_PAGE = (int64_t)2 << 20;

typedef struct {
    const st_tensor *t;
    int64_t at; /* offset in the region */
} placed;

enum { RUNNING, COPIED, FAILED }; /* the copy's state */

struct rcopy {
    char *base;      /* region, HUGE_PAGE-aligned */
    int64_t len;     /* region bytes */
    placed *tab;     /* sorted by tensor address */
    int64_t n;
    int64_t *first;  /* per tensor: its first piece's index (n + 1 entries) */
    st_set *st;      /* borrowed: outlives the copy (rcopy_free joins first) */
    pthread_t thread;
    int joined;      /* 1 once the thread was joined (or none was started) */
    _Atomic int state, cancel, failed_tid; /* failed_tid: 1 + the thread whose read failed */
    pthread_mutex_t mu;   /* with go: the thread waits while paused */
    pthread_cond_t go;
    int paused;           /* under mu */
    char *errs;      /* per thread: DF_ERRMSG, the failed read's message */
    double t0;
    rcopy_stats stats; /* seconds written before the state */
};

static int by_tensor(const void *a, const void *b) {
    const st_tensor *x = ((const placed *)a)->t, *y = ((const placed *)b)->t;
    return x < y ? -1 : x > y;
}

static int64_t pieces_of(const st_tensor *t) { return (t->nbytes + PIECE - 1) / PIECE; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The background thread, before a piece: waits while the copy is paused. */
static void wait_unpaused(rcopy *c) {
    pthread_mutex_lock(&c->mu);
    while (c->paused && !atomic_load(&c->cancel)) pthread_cond_wait(&c->go, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

/* Pieces [i0, i1): piece p is tensor k's piece p - first[k]; stops at a
 * failed read or a cancel; the background thread (bg) heeds pauses. */
static void copy_range(rcopy *c, int64_t i0, int64_t i1, int tid, int bg) {
    int64_t k = 0;
    while (c->first[k + 1] <= i0) k++;
    for (int64_t p = i0; p < i1 && !atomic_load(&c->failed_tid) && !atomic_load(&c->cancel); p++) {
        if (bg) {
            wait_unpaused(c);
            if (atomic_load(&c->cancel)) break;
        }
        while (c->first[k + 1] <= p) k++;
        const placed *e = &c->tab[k];
        int64_t off = (p - c->first[k]) * PIECE;
        int64_t len = e->t->nbytes - off < PIECE ? e->t->nbytes - off : PIECE;
        if (st_pread(c->st, e->t, c->base + e->at + off, off, len, c->errs + (size_t)tid * DF_ERRMSG) != DF_OK)
            atomic_store(&c->failed_tid, tid + 1);
    }
}

static void copy_pieces(void *ctx, int64_t i0, int64_t i1, int tid) { copy_range(ctx, i0, i1, tid, 0); }

static void copy_ended(rcopy *c) {
    c->stats.seconds = now_s() - c->t0;
    const int bad = atomic_load(&c->failed_tid) || atomic_load(&c->cancel);
    if (bad && !atomic_load(&c->failed_tid)) snprintf(c->errs, DF_ERRMSG, "the copy was cancelled");
    atomic_store(&c->state, bad ? FAILED : COPIED);
}

/* The background thread: every piece in the region's order, between
 * pauses (the engine's evaluations) and on CPU time no other thread wants
 * (SCHED_IDLE where there is one). On a 2-vCPU VM beside the pool's two
 * busy threads, a 5.6 GB copy at normal priority took 9.9 s instead of 0.5
 * s and slowed every step it ran beside by ~70%; at idle priority it still
 * slowed decode ~15% (its page faults and memory traffic in the steps'
 * gaps), hence the pauses. */
static void *copy_all(void *arg) {
    rcopy *c = arg;
#ifdef SCHED_IDLE
    struct sched_param sp = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp); /* best effort: else it shares the CPUs */
#endif
    copy_range(c, 0, c->first[c->n], 0, 1);
    copy_ended(c);
    return NULL;
}

/* The mapped tensors behind the views, sorted and each once; *n their count. */
static placed *mapped_tensors(const st_set *st, df_weight *const *views, int nv, int64_t *n) {
    placed *tab = malloc(((size_t)nv * 2 + 1) * sizeof *tab);
    if (!tab) return NULL;
    int64_t k = 0;
    for (int i = 0; i < nv; i++) {
        const st_tensor *ts[2] = {views[i]->t_data, views[i]->t_scale};
        for (int u = 0; u < 2; u++)
            if (ts[u] && st_mapped(st, ts[u])) tab[k++] = (placed){ts[u], 0};
    }
    qsort(tab, (size_t)k, sizeof *tab, by_tensor);
    int64_t m = 0;
    for (int64_t i = 0; i < k; i++)
        if (!m || tab[m - 1].t != tab[i].t) tab[m++] = tab[i];
    *n = m;
    return tab;
}

static const placed *find(const rcopy *c, const st_tensor *t) {
    if (!t) return NULL;
    placed key = {t, 0};
    return bsearch(&key, c->tab, (size_t)c->n, sizeof key, by_tensor);
}

df_status rcopy_start(st_set *st, df_weight *const *views, int n, df_pool *pool, rcopy **out, char *err) {
    *out = NULL;
    rcopy *c = calloc(1, sizeof *c);
    if (!c || !(c->tab = mapped_tensors(st, views, n, &c->n))) {
        free(c);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    c->joined = 1;
    c->st = st;
    c->t0 = now_s();
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->go, NULL);
    if (!c->n) {
        rcopy_free(c);
        return DF_OK;
    }
    int64_t at = 0;
    for (int64_t k = 0; k < c->n; k++) {
        c->tab[k].at = at;
        at += (c->tab[k].t->nbytes + ST_DATA_ALIGN - 1) / ST_DATA_ALIGN * ST_DATA_ALIGN;
        c->stats.bytes += c->tab[k].t->nbytes;
    }
    c->stats.tensors = c->n;
    c->len = (at + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    const int nt = pool ? pool_size(pool) : 1;
    c->first = malloc((size_t)(c->n + 1) * sizeof *c->first);
    c->errs = calloc((size_t)nt, DF_ERRMSG);
    if (!c->first || !c->errs || !(c->base = mem_huge_alloc((size_t)c->len))) {
        rcopy_free(c);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for a %.2f GB copy of the resident spine (--map-spine "
                       "uses it from the page cache)", at / 1e9);
    }
    c->first[0] = 0;
    for (int64_t k = 0; k < c->n; k++) c->first[k + 1] = c->first[k] + pieces_of(c->tab[k].t);
    atomic_init(&c->state, RUNNING);
    atomic_init(&c->cancel, 0);
    atomic_init(&c->failed_tid, 0);
    if (pool) {
        pool_for(pool, c->first[c->n], 1, copy_pieces, c);
        copy_ended(c);
    } else {
        if (pthread_create(&c->thread, NULL, copy_all, c) != 0) {
            rcopy_free(c);
            return df_fail(err, DF_ERR_NOMEM, "no thread for the resident spine's copy");
        }
        c->joined = 0;
    }
    *out = c;
    return DF_OK;
}

int rcopy_done(const rcopy *c) { return !c || atomic_load((_Atomic int *)&c->state) != RUNNING; }

df_status rcopy_finish(rcopy *c, df_weight *const *views, int n, char *err) {
    if (!c->joined) {
        pthread_join(c->thread, NULL);
        c->joined = 1;
    }
    if (atomic_load(&c->state) != COPIED) {
        const int t = atomic_load(&c->failed_tid);
        return df_fail(err, DF_ERR_IO, "%s", c->errs + (size_t)(t ? t - 1 : 0) * DF_ERRMSG);
    }
    for (int i = 0; i < n; i++) {
        const placed *d = find(c, views[i]->t_data), *s = find(c, views[i]->t_scale);
        if (d) views[i]->data = c->base + d->at;
        if (s) views[i]->scale = c->base + s->at;
    }
    return DF_OK;
}

df_status rcopy_make(st_set *st, df_weight *const *views, int n, df_pool *pool, rcopy **out, char *err) {
    df_status s = rcopy_start(st, views, n, pool, out, err);
    if (s != DF_OK || !*out) return s;
    if ((s = rcopy_finish(*out, views, n, err)) != DF_OK) {
        rcopy_free(*out);
        *out = NULL;
    }
    return s;
}

void rcopy_pause(rcopy *c, int paused) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->paused = paused;
    pthread_cond_broadcast(&c->go);
    pthread_mutex_unlock(&c->mu);
}

void rcopy_free(rcopy *c) {
    if (!c) return;
    if (!c->joined) {
        atomic_store(&c->cancel, 1);
        rcopy_pause(c, 0);
        pthread_join(c->thread, NULL);
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->go);
    mem_huge_free(c->base, (size_t)c->len);
    free(c->first);
    free(c->errs);
    free(c->tab);
    free(c);
}

void rcopy_get_stats(const rcopy *c, rcopy_stats *s) {
    memset(s, 0, sizeof *s);
    if (!c) return;
    s->tensors = c->stats.tensors;
    s->bytes = c->stats.bytes;
    const int state = atomic_load((_Atomic int *)&c->state);
    s->done = state != RUNNING;
    s->failed = state == FAILED;
    if (s->done) s->seconds = c->stats.seconds;
}

const void *rcopy_base(const rcopy *c) { return c ? c->base : NULL; }
int64_t rcopy_region_bytes(const rcopy *c) { return c ? c->len : 0; }
