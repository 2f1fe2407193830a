/* amx_pool.c — kn_matmul_amx_pool: a product at KN_AMX with x packed once
 * for all threads (its groups split over the pool), then rows [0, rows) split
 * over the pool. kn_matmul called from each thread would pack x again for every
 * chunk of rows a thread claims. Owns the packed x for the call, unless the
 * caller lends a kn_px_buf it keeps between calls.
 */
#include "kernels.h"
#include "../base/pool.h"
#include <stdlib.h>
#include <string.h>

typedef struct {
    const kn_amx_x *px;
    const float *X;
    float *Y;
    int64_t ldy;
} amx_job;

static void pack_groups(void *ctx, int64_t g0, int64_t g1, int tid) {
    (void)tid;
    const amx_job *a = ctx;
    kn_amx_x_pack(a->px, a->X, (int)g0, (int)g1);
}

static void row_range(void *ctx, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const amx_job *a = ctx;
    kn_matmul_amx_x(a->px, a->X, a->Y + r0, a->ldy, r0, r1);
}

int64_t kn_amx_x_plan(kn_amx_x *px, const df_weight *w, int n) {
    memset(px, 0, sizeof *px);
    if (n < KN_AMX_MIN_N || !kn_level_available(KN_AMX)) return 0;
    return kn_amx_x_init(px, w, n);
}

int kn_matmul_amx_pool(struct df_pool *pool, const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                       int64_t rows, kn_px_buf *kept) {
    kn_amx_x px;
    const int64_t bytes = kn_amx_x_plan(&px, w, n);
    if (bytes <= 0) return 0;
    px.B = kept ? kn_px_buf_get(kept, (bytes + 3) / 4) : aligned_alloc(64, (size_t)bytes);
    if (!px.B) return 0;
    amx_job a = {&px, X, Y, ldy};
    pool_for(pool, px.groups, 1, pack_groups, &a);
    pool_for(pool, rows, 32, row_range, &a);
    if (!kept) free(px.B);
    return 1;
}
