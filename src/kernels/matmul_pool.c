/* matmul_pool.c — kn_matmul_pool: one product's rows split over a pool, the
 * way the engine runs every product on the CPU: at KN_AMX through
 * kn_matmul_amx_pool (x packed once); else, where the level reads x in a
 * form of its own (kn_px_*: the 4-bit tiles' fixed point, bf16's even / odd
 * columns), x prepared once for all threads instead of once per chunk of
 * rows a thread claims; else kn_matmul per chunk. The values are
 * kn_matmul's bit for bit whichever way runs. Owns the prepared x for the
 * call (on the stack up to a decode vector's, else allocated), unless the
 * caller lends a kn_px_buf it keeps between calls (the _kept forms).
 *
 * kn_matmul_pool_many: several products in one pass (a decode step's
 * attention projections are 6-10 products of one input, each ~1 ms at 16
 * threads, where one pass's wake and tail cost ~0.05-0.1 ms). Both run
 * run_pass; kn_matmul_pool is its one-product case.
 */
#include "kernels.h"
#include "../base/mem.h"
#include "../base/pool.h"
#include <stdlib.h>

enum { PX_STACK = 16384, ROW_GRAIN = 16 }; /* floats of prepared x on the stack; rows a chunk is a multiple of */

/* x of one product for its prepared form: vectors [v0, v1) of X into Xp. */
typedef struct {
    kn_level lv;
    const kn_mm_item *it;
    float *Xp;
} prep_job;

static void prep_vectors(void *ctx, int64_t v0, int64_t v1, int tid) {
    (void)tid;
    const prep_job *j = ctx;
    kn_px_prep(j->lv, j->it->w, j->it->X, (int)v0, (int)v1, j->Xp);
}

typedef struct {
    kn_level lv;
    const kn_mm_item *it;
    int64_t start[KN_POOL_MANY + 1]; /* item i's rows are [start[i], start[i + 1]) of the pass */
    const float *xp[KN_POOL_MANY];   /* item i's prepared x, or NULL: kn_matmul reads X */
} pass_job;

/* Rows [r0, r1) of the pass: each item's part with its own x. */
static void pass_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const pass_job *j = ctx;
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

float *kn_px_buf_get(kn_px_buf *kept, int64_t floats) {
    if (kept->cap < floats) {
        free(kept->p);
        kept->p = mem_big_alloc((size_t)floats * sizeof(float));
        kept->cap = kept->p ? floats : 0;
    }
    return kept->p;
}

void kn_px_buf_free(kn_px_buf *b) {
    if (!b) return;
    free(b->p);
    b->p = NULL;
    b->cap = 0;
}

/* The items' rows in one pass over the pool (at most KN_POOL_MANY, none for
 * the AMX tiles), x prepared once per item that reads it in a form of its
 * own, or shared with an earlier item that reads the same x in the same
 * form (no memory for it: kn_matmul prepares it per chunk). */
static void run_pass(struct df_pool *pool, kn_level lv, const kn_mm_item *items, int count, kn_px_buf *kept) {
    pass_job j = {.lv = lv, .it = items};
    int64_t off[KN_POOL_MANY], total = 0; /* where item i's prepared x goes; -1: none */
    int owner[KN_POOL_MANY];              /* the item that prepares it */
    for (int i = 0; i < count; i++) {
        j.start[i + 1] = j.start[i] + (items[i].n > 0 ? items[i].w->rows : 0);
        owner[i] = i;
        off[i] = -1;
        const int64_t pf = items[i].n > 0 ? kn_px_floats(lv, items[i].w, items[i].n) : 0;
        if (pf <= 0) continue;
        for (int k = 0; k < i && owner[i] == i; k++)
            if (off[k] >= 0 && same_prep(&items[k], &items[i])) owner[i] = owner[k];
        off[i] = owner[i] == i ? total : off[owner[i]];
        if (owner[i] == i) total += pf;
    }
    if (j.start[count] == 0) return;
    _Alignas(64) float stack[PX_STACK];
    float *Xp = total <= 0 ? NULL : total <= PX_STACK ? stack : kept ? kn_px_buf_get(kept, total)
                                                                     : aligned_alloc(64, (size_t)total * sizeof(float));
    for (int i = 0; i < count; i++) {
        j.xp[i] = Xp && off[i] >= 0 ? Xp + off[i] : NULL;
        if (!j.xp[i] || owner[i] != i) continue;
        prep_job pj = {lv, &items[i], Xp + off[i]};
        if (items[i].n == 1) prep_vectors(&pj, 0, 1, 0);
        else pool_for(pool, items[i].n, 1, prep_vectors, &pj);
    }
    pool_for(pool, j.start[count], ROW_GRAIN, pass_rows, &j);
    if (Xp && Xp != stack && !kept) free(Xp);
}

void kn_matmul_pool(struct df_pool *pool, kn_level lv, const df_weight *w, const float *X, int n, float *Y,
                    int64_t ldy, int64_t rows) {
    kn_matmul_pool_kept(pool, lv, w, X, n, Y, ldy, rows, NULL);
}

void kn_matmul_pool_kept(struct df_pool *pool, kn_level lv, const df_weight *w, const float *X, int n, float *Y,
                         int64_t ldy, int64_t rows, kn_px_buf *kept) {
    if (n <= 0 || rows <= 0) return;
    if (lv == KN_AMX && kn_matmul_amx_pool(pool, w, X, n, Y, ldy, rows, kept)) return;
    df_weight v = *w; /* rows [0, rows): a row-major prefix of w is a matrix of its own */
    v.rows = rows;
    const kn_mm_item it = {&v, X, n, Y, ldy};
    run_pass(pool, lv, &it, 1, kept);
}

void kn_matmul_pool_many(struct df_pool *pool, kn_level lv, const kn_mm_item *items, int count) {
    kn_matmul_pool_many_kept(pool, lv, items, count, NULL);
}

void kn_matmul_pool_many_kept(struct df_pool *pool, kn_level lv, const kn_mm_item *items, int count,
                              kn_px_buf *kept) {
    int one_by_one = count > KN_POOL_MANY;
    for (int i = 0; i < count && !one_by_one; i++) one_by_one = lv == KN_AMX && items[i].n >= KN_AMX_MIN_N;
    if (!one_by_one) {
        run_pass(pool, lv, items, count, kept);
        return;
    }
    for (int i = 0; i < count; i++)
        kn_matmul_pool_kept(pool, lv, items[i].w, items[i].X, items[i].n, items[i].Y, items[i].ldy, items[i].w->rows,
                            kept);
}
