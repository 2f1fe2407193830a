/* matmul_pool.c — kn_matmul_pool: one product's rows split over a pool, the
 * way the engine runs every product on the CPU: at KN_AMX through
 * kn_matmul_amx_pool (x packed once); else, where the level reads x in a
 * form of its own (kn_px_*: the 4-bit tiles' fixed point, bf16's even / odd
 * columns), x prepared once for all threads instead of once per chunk of
 * rows a thread claims; else kn_matmul per chunk. The values are
 * kn_matmul's bit for bit whichever way runs. Owns the prepared x for the
 * call (on the stack up to a decode vector's, else allocated).
 *
 * kn_matmul_pool_many: several products in one pass (a decode step's
 * attention projections are 6-10 products of one input, each ~1 ms at 16
 * threads, where one pass's wake and tail cost ~0.05-0.1 ms).
 */
#include "kernels.h"
#include "../base/pool.h"
#include <stdlib.h>

enum { PX_STACK = 16384, ROW_GRAIN = 16 }; /* floats of prepared x on the stack; rows a chunk is a multiple of */

typedef struct {
    kn_level lv;
    const df_weight *w;
    const float *X;
    float *Xp; /* the prepared x (written by prep_vectors, then read), or NULL */
    int n;
    float *Y;
    int64_t ldy;
} mp_job;

static void plain_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const mp_job *j = ctx;
    kn_matmul(j->lv, j->w, j->X, j->n, j->Y + r0, j->ldy, r0, r1);
}

static void prep_vectors(void *ctx, int64_t v0, int64_t v1, int tid) {
    (void)tid;
    const mp_job *j = ctx;
    kn_px_prep(j->lv, j->w, j->X, (int)v0, (int)v1, j->Xp);
}

static void px_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const mp_job *j = ctx;
    kn_matmul_px(j->lv, j->w, j->Xp, j->n, j->Y + r0, j->ldy, r0, r1);
}

void kn_matmul_pool(struct df_pool *pool, kn_level lv, const df_weight *w, const float *X, int n, float *Y,
                    int64_t ldy, int64_t rows) {
    if (n <= 0 || rows <= 0) return;
    if (lv == KN_AMX && kn_matmul_amx_pool(pool, w, X, n, Y, ldy, rows)) return;
    mp_job j = {lv, w, X, NULL, n, Y, ldy};
    const int64_t pf = kn_px_floats(lv, w, n);
    _Alignas(64) float stack[PX_STACK];
    float *Xp = pf <= 0 ? NULL : pf <= PX_STACK ? stack : aligned_alloc(64, (size_t)pf * sizeof(float));
    if (!Xp) { /* x read as given, or no memory for it: kn_matmul prepares it per chunk */
        pool_for(pool, rows, ROW_GRAIN, plain_rows, &j);
        return;
    }
    j.Xp = Xp;
    if (n == 1) kn_px_prep(lv, w, X, 0, 1, Xp);
    else pool_for(pool, n, 1, prep_vectors, &j);
    pool_for(pool, rows, ROW_GRAIN, px_rows, &j);
    if (Xp != stack) free(Xp);
}

/* ---- several products in one pass ---- */

typedef struct {
    kn_level lv;
    const kn_mm_item *it;
    int64_t start[KN_POOL_MANY + 1]; /* item i's rows are [start[i], start[i + 1]) of the pass */
    const float *xp[KN_POOL_MANY];   /* item i's prepared x, or NULL: kn_matmul reads X */
} many_job;

/* Rows [r0, r1) of the pass: each item's part with its own x. */
static void many_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const many_job *j = ctx;
    int i = 0;
    for (int64_t r = r0; r < r1;) {
        while (j->start[i + 1] <= r) i++;
        const kn_mm_item *m = &j->it[i];
        const int64_t a = r - j->start[i], b = (r1 < j->start[i + 1] ? r1 : j->start[i + 1]) - j->start[i];
        if (j->xp[i]) kn_matmul_px(j->lv, m->w, j->xp[i], m->n, m->Y + a, m->ldy, a, b);
        else kn_matmul(j->lv, m->w, m->X, m->n, m->Y + a, m->ldy, a, b);
        r = j->start[i] + b;
    }
}

/* Whether items a and b read their x in the same prepared form. */
static int same_prep(const kn_mm_item *a, const kn_mm_item *b) {
    return a->X == b->X && a->n == b->n && a->w->type == b->w->type && a->w->cols == b->w->cols &&
           a->w->scale_dtype == b->w->scale_dtype;
}

void kn_matmul_pool_many(struct df_pool *pool, kn_level lv, const kn_mm_item *items, int count) {
    int one_by_one = count > KN_POOL_MANY;
    for (int i = 0; i < count && !one_by_one; i++) one_by_one = lv == KN_AMX && items[i].n >= KN_AMX_MIN_N;
    if (one_by_one) {
        for (int i = 0; i < count; i++)
            kn_matmul_pool(pool, lv, items[i].w, items[i].X, items[i].n, items[i].Y, items[i].ldy, items[i].w->rows);
        return;
    }
    many_job j = {.lv = lv, .it = items};
    /* where each item's prepared x goes: an earlier item's when they share it */
    int64_t off[KN_POOL_MANY], total = 0;
    int owner[KN_POOL_MANY];
    for (int i = 0; i < count; i++) {
        j.start[i + 1] = j.start[i] + (items[i].n > 0 ? items[i].w->rows : 0);
        owner[i] = -1;
        off[i] = -1;
        const int64_t pf = items[i].n > 0 ? kn_px_floats(lv, items[i].w, items[i].n) : 0;
        if (pf <= 0) continue;
        for (int k = 0; k < i && owner[i] < 0; k++)
            if (off[k] >= 0 && owner[k] == k && same_prep(&items[k], &items[i])) owner[i] = k;
        if (owner[i] < 0) {
            owner[i] = i;
            off[i] = total;
            total += pf;
        } else {
            off[i] = off[owner[i]];
        }
    }
    if (j.start[count] == 0) return;
    _Alignas(64) float stack[PX_STACK];
    float *Xp = total <= 0 ? NULL : total <= PX_STACK ? stack : aligned_alloc(64, (size_t)total * sizeof(float));
    for (int i = 0; i < count; i++) {
        j.xp[i] = Xp && off[i] >= 0 ? Xp + off[i] : NULL; /* no memory: kn_matmul prepares per chunk */
        if (!j.xp[i] || owner[i] != i) continue;
        if (items[i].n == 1) {
            kn_px_prep(lv, items[i].w, items[i].X, 0, 1, Xp + off[i]);
        } else {
            mp_job pj = {lv, items[i].w, items[i].X, Xp + off[i], items[i].n, NULL, 0};
            pool_for(pool, items[i].n, 1, prep_vectors, &pj);
        }
    }
    pool_for(pool, j.start[count], ROW_GRAIN, many_rows, &j);
    if (Xp && Xp != stack) free(Xp);
}
