/* resident_copy.c — the resident spine's matrices copied into anonymous
 * memory (resident_copy.h).
 *
 * Owns: the region (one mmap, unmapped by rcopy_free) and the table of the
 * tensors in it. The views stay the program's; only their data and scale
 * pointers change, once, at open, before any step.
 */
#include "resident_copy.h"
#include "../base/err.h"
#include "../base/mem.h"
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Pieces the pool's threads read: large enough for the disk's full rate,
 * small enough that a 500 MB matrix spreads over every thread. */
enum { PIECE = 4 << 20 };
static const int64_t HUGE_PAGE = (int64_t)2 << 20;

typedef struct {
    const st_tensor *t;
    int64_t at; /* offset in the region */
} placed;

struct rcopy {
    char *base;      /* region, HUGE_PAGE-aligned */
    int64_t len;     /* region bytes */
    placed *tab;     /* sorted by tensor address */
    int64_t n;
    rcopy_stats stats;
};

typedef struct {
    st_set *st;
    rcopy *c;
    int64_t *first; /* per tensor: its first piece's index (n + 1 entries) */
    _Atomic int failed;
    char *errs;     /* per thread: DF_ERRMSG */
} copy_job;

static int by_tensor(const void *a, const void *b) {
    const st_tensor *x = ((const placed *)a)->t, *y = ((const placed *)b)->t;
    return x < y ? -1 : x > y;
}

static int64_t pieces_of(const st_tensor *t) { return (t->nbytes + PIECE - 1) / PIECE; }

/* Pieces [i0, i1): piece p is tensor k's piece p - first[k]. */
static void copy_pieces(void *ctx, int64_t i0, int64_t i1, int tid) {
    copy_job *j = ctx;
    int64_t k = 0;
    while (j->first[k + 1] <= i0) k++;
    for (int64_t p = i0; p < i1 && !atomic_load(&j->failed); p++) {
        while (j->first[k + 1] <= p) k++;
        const placed *e = &j->c->tab[k];
        int64_t off = (p - j->first[k]) * PIECE;
        int64_t len = e->t->nbytes - off < PIECE ? e->t->nbytes - off : PIECE;
        if (st_pread(j->st, e->t, j->c->base + e->at + off, off, len, j->errs + (size_t)tid * DF_ERRMSG) != DF_OK)
            atomic_store(&j->failed, tid + 1);
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
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

df_status rcopy_make(st_set *st, df_weight *const *views, int n, df_pool *pool, rcopy **out, char *err) {
    *out = NULL;
    double t0 = now_s();
    rcopy *c = calloc(1, sizeof *c);
    if (!c || !(c->tab = mapped_tensors(st, views, n, &c->n))) {
        free(c);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    if (!c->n) {
        rcopy_free(c);
        return DF_OK;
    }
    int64_t at = 0, pieces = 0;
    for (int64_t k = 0; k < c->n; k++) {
        c->tab[k].at = at;
        at += (c->tab[k].t->nbytes + ST_DATA_ALIGN - 1) / ST_DATA_ALIGN * ST_DATA_ALIGN;
        pieces += pieces_of(c->tab[k].t);
    }
    c->len = (at + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    int nt = pool_size(pool);
    copy_job j = {.st = st, .c = c};
    j.first = malloc((size_t)(c->n + 1) * sizeof *j.first);
    j.errs = calloc((size_t)nt, DF_ERRMSG);
    if (!j.first || !j.errs || !(c->base = mem_huge_alloc((size_t)c->len))) {
        free(j.first);
        free(j.errs);
        rcopy_free(c);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for a %.2f GB copy of the resident spine (--map-spine "
                       "uses it from the page cache)", at / 1e9);
    }
    j.first[0] = 0;
    for (int64_t k = 0; k < c->n; k++) j.first[k + 1] = j.first[k] + pieces_of(c->tab[k].t);
    atomic_init(&j.failed, 0);
    pool_for(pool, pieces, 1, copy_pieces, &j);
    int failed = atomic_load(&j.failed);
    df_status st_ = DF_OK;
    if (failed) st_ = df_fail(err, DF_ERR_IO, "%s", j.errs + (size_t)(failed - 1) * DF_ERRMSG);
    free(j.first);
    free(j.errs);
    if (st_ != DF_OK) {
        rcopy_free(c);
        return st_;
    }
    for (int i = 0; i < n; i++) {
        const placed *d = find(c, views[i]->t_data), *s = find(c, views[i]->t_scale);
        if (d) views[i]->data = c->base + d->at;
        if (s) views[i]->scale = c->base + s->at;
    }
    c->stats.tensors = c->n;
    c->stats.bytes = 0;
    for (int64_t k = 0; k < c->n; k++) c->stats.bytes += c->tab[k].t->nbytes;
    c->stats.seconds = now_s() - t0;
    *out = c;
    return DF_OK;
}

void rcopy_free(rcopy *c) {
    if (!c) return;
    mem_huge_free(c->base, (size_t)c->len);
    free(c->tab);
    free(c);
}

void rcopy_get_stats(const rcopy *c, rcopy_stats *s) {
    if (c) *s = c->stats;
    else memset(s, 0, sizeof *s);
}

const void *rcopy_base(const rcopy *c) { return c ? c->base : NULL; }
int64_t rcopy_region_bytes(const rcopy *c) { return c ? c->len : 0; }
