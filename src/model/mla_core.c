/* mla_core.c — the engine-free MLA math (see mla_core.h): the cache row
 * write (latent RMSNorm, RoPE) and the attention of one (head, token).
 *
 * Refuses: projections, threads, allocation (mla.c does those and calls in
 * here per token and per (head, token)). Plain fp32 / double C in a fixed
 * order; also the oracle of gpu_mla_write / gpu_mla_attend (gpu_mla.cu).
 *
 * Sections: cache rows; attention.
 */
#include "mla_core.h"
#include "../kernels/ops.h"
#include <math.h>
#include <string.h>

/* ---- cache rows ---- */

int64_t mla_cache_floats_per_pos(const mla_shape *sh) { return sh->R + sh->dr; }

void mla_rope_at(const mla_shape *sh, int pos, float *cs, float *sn) {
    for (int i = 0; i < sh->dr / 2; i++) {
        float f = (float)pos * sh->inv_freq[i];
        cs[i] = cosf(f) * sh->rope_mscale;
        sn[i] = sinf(f) * sh->rope_mscale;
    }
}

void mla_write_row(const mla_shape *sh, const float *kv_a_norm, const float *kv, int pos, float *row,
                   float *q_t) {
    op_rmsnorm(row, kv, kv_a_norm, sh->R, sh->latent_eps);
    memcpy(row + sh->R, kv + sh->R, (size_t)sh->dr * sizeof(float));
    if (!sh->use_rope) return;
    float cs[256], sn[256];
    mla_rope_at(sh, pos, cs, sn);
    op_rope(row + sh->R, sh->dr, cs, sn, sh->rope_interleave);
    for (int h = 0; h < sh->nh; h++) op_rope(q_t + (size_t)h * sh->dq + sh->dn, sh->dr, cs, sn, sh->rope_interleave);
}

/* ---- attention ---- */

void mla_attend_one(const mla_shape *sh, const float *cache, const float *ql, const float *qp, int p,
                    float *sc, float *o) {
    int64_t stride = sh->R + sh->dr;
    for (int k = 0; k <= p; k++) {
        const float *c = cache + (size_t)k * stride;
        sc[k] = (op_dot(ql, c, sh->R) + op_dot(qp, c + sh->R, sh->dr)) * sh->softmax_scale;
    }
    op_softmax(sc, p + 1);
    memset(o, 0, (size_t)sh->R * sizeof(float));
    for (int k = 0; k <= p; k++) op_axpy(o, sc[k], cache + (size_t)k * stride, sh->R);
}
