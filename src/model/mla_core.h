/* mla_core.h — the engine-free math of absorbed MLA over the compact latent
 * cache (prefix mla_; mla.h has the layer): writing one cache row and
 * attending for one (head, token), on plain float arrays.
 *
 * mla.c calls these (so the CPU engine and the CUDA tests share one oracle);
 * src/cuda/gpu_mla.cu implements the same contract on the device and is
 * tested against them. Nothing here allocates or knows the engine.
 *
 *   cache[pos] = | c_kv (R) | k_pe (dr) |      stride R + dr floats
 *   q[t][h]    = | q_nope (dn) | q_pe (dr) |   stride dq = dn + dr floats
 */
#ifndef DF_MODEL_MLA_CORE_H
#define DF_MODEL_MLA_CORE_H
#include <stdint.h>

typedef struct {
    int hidden, nh, dn, dr, dv, dq, R, qlr;
    int use_rope, rope_interleave;
    const float *inv_freq;      /* [dr/2], owned by the model (host) */
    float rope_mscale;          /* factor on cos/sin (YaRN) */
    float softmax_scale;
    float latent_eps;           /* q_a / kv_a RMSNorm eps (1e-6 in every reference) */
} mla_shape;

int64_t mla_cache_floats_per_pos(const mla_shape *sh);

/* cs[i] = cosf((float)pos * inv_freq[i]) * mscale, sn likewise, i < dr/2. */
void mla_rope_at(const mla_shape *sh, int pos, float *cs, float *sn);

/* The cache row of position pos from kv = kv_a_proj x ([R + dr]):
 * row = | RMSNorm(kv[0..R), kv_a_norm, latent_eps) | kv[R..R+dr) |, then,
 * with RoPE on (dr <= 512), k_pe in the row and q_pe of each of the nh heads
 * of this token (q_t [nh][dq], q_pe at offset dn) rotated by op_rope at pos. */
void mla_write_row(const mla_shape *sh, const float *kv_a_norm, const float *kv, int pos, float *row,
                   float *q_t);

/* One (head, token) at position p over cache rows 0..p:
 *   s_k = (dot(ql, c_kv[k]) + dot(qp, k_pe[k])) * softmax_scale,
 *   o   = sum_k softmax(s)_k c_kv[k]
 * ql [R] the absorbed query, qp [dr] its q_pe, sc scratch [p + 1], o [R]. */
void mla_attend_one(const mla_shape *sh, const float *cache, const float *ql, const float *qp, int p,
                    float *sc, float *o);
#endif
