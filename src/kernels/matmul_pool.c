/* matmul_pool.c — kn_matmul_pool: one product's rows split over a pool, the
 * way the engine runs every product on the CPU: at KN_AMX through
 * kn_matmul_amx_pool (x packed once); else, where the level reads x in a
 * form of its own (kn_px_*: the 4-bit tiles' fixed point, bf16's even / odd
 * columns), x prepared once for all threads instead of once per chunk of
 * rows a thread claims; else kn_matmul per chunk. The values are
 * kn_matmul's bit for bit whichever way runs. Owns the prepared x for the
 * call (on the stack up to a decode vector's, else allocated).
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
