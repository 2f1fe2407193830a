/* mla.h — Multi-head Latent Attention with the compact latent cache (prefix mla_).
 *
 * Used by DeepSeek-V3 / Kimi-K2 (interleaved RoPE, optional YaRN) and by
 * Kimi-Linear / K3 (NoPE, optional sigmoid output gate). Absorbed form: the
 * cache holds, per position, c_kv (kv_lora_rank floats, RMS-normalised) and
 * k_pe (qk_rope_head_dim floats, rotated when RoPE is on):
 *
 *   cache[pos] = | c_kv (R) | k_pe (dr) |
 *
 * q_nope is mapped into latent space with W_UK^T, scores are taken against
 * the latents, the weighted latent sum is lifted per head with W_UV.
 * mla_shape and the row-write / attention math are in mla_core.h
 * (engine-free).
 */
#ifndef DF_MODEL_MLA_H
#define DF_MODEL_MLA_H
#include "mla_core.h"
#include "model.h"

typedef struct {
    float *q_a_norm, *kv_a_norm; /* owned f32 copies */
    df_weight q_a, q_b, q, kv_a, kv_b, o;
    int has_gate;               /* sigmoid output gate g_proj (K3) */
    df_weight g;
    df_accel_mla dev;           /* the same layer for an accelerator's mla hook */
} mla_layer;

/* Per-pass scratch shared by every MLA layer of a session (rows DF_CHUNK),
 * or of a layer-major prompt's block (more rows; the attention then runs in
 * pieces of DF_CHUNK rows, so qlat and olat hold DF_CHUNK rows). */
typedef struct {
    int rows;                   /* the rows a pass may have */
    float *qa, *q, *kva, *attn, *gate; /* [rows][...] */
    float *qlat, *olat;         /* [nh][min(rows, DF_CHUNK)][R] */
    float *tscratch;            /* [threads][tstride]; NULL when made for 0 threads */
    int64_t tstride;
} mla_scratch;

/* The absorbed attention of head h for n tokens at pos.. (the cache rows
 * written, q_pe rotated): q_lat[h] = W_UK[h]^T q_nope, softmax over the
 * cache, attn[t][h*dv..] = W_UV[h] o_lat[h][t]. q [n][nh][dq], qlat and
 * olat [nh][n][R], attn [n][nh*dv]; scratch mla_head_scratch_floats(sh,
 * pos + n) floats. Heads are independent (the pool runs them in any order,
 * the result is the same); every kernel level gives the same bits (the
 * kn_mla_* kernels reproduce mla_attend_one and the scalar absorb exactly). */
/* Per-thread scratch floats of mla_head for contexts up to ctx positions. */
int64_t mla_head_scratch_floats(const mla_shape *sh, int ctx);
void mla_head(const mla_shape *sh, kn_level lv, const df_weight *kv_b, const float *cache, const float *q, int pos,
              int n, int h, float *qlat, float *olat, float *attn, float *scratch);

/* mla_head for heads h0..h1-1 (same results). Below
 * MLA_HEADS_IN_LANES_BELOW tokens (decode) the heads' attention runs with
 * HEADS in the SIMD lanes (kn_mla_attend_heads: each cache row loaded once
 * per block of heads), else head by head with the queries in the lanes. */
enum { MLA_HEADS_IN_LANES_BELOW = 8 };
void mla_heads(const mla_shape *sh, kn_level lv, const df_weight *kv_b, const float *cache, const float *q, int pos,
               int n, int h0, int h1, float *qlat, float *olat, float *attn, float *scratch);

/* Binds `<base>q_a_proj` ... `<base>o_proj` (+ `<base>g_proj` if gate). */
df_status mla_bind(df_engine *e, const mla_shape *sh, const char *base, int gate, mla_layer *a,
                   char *err);
void mla_free(mla_layer *a);
/* threads 0: no per-thread attention rows (the passes' segments then name
 * a session scratch that has them, mla_seg.scratch). */
df_status mla_scratch_new(const mla_shape *sh, int threads, int max_ctx, int rows, mla_scratch *s);
void mla_scratch_free(mla_scratch *s);
/* Runs n positions pos..pos+n-1: xn [n][hidden] normalised input, cache
 * [max_ctx][R+dr] of this layer (host floats, or with dev_cache non-NULL
 * the device cache from acc_state_new: the attention then runs on the
 * accelerator), out [n][hidden] = attention output. Fails only on the
 * device (err says why; the cache is then undefined). */
df_status mla_forward(df_engine *e, const mla_shape *sh, const mla_layer *a, float *cache, void *dev_cache,
                      mla_scratch *s, int pos, int n, const float *xn, float *out, char *err);
/* n rows of a layer-major prompt block on the host cache: at once on blk
 * when it holds them (blk->rows >= n: every projection sees every row, the
 * heads run in DF_CHUNK pieces), else in DF_CHUNK pieces on the session's
 * scratch s; s lends the per-thread attention rows either way. The same
 * bits as DF_CHUNK passes (kn_matmul's row contract). blk may be NULL. */
df_status mla_forward_block(df_engine *e, const mla_shape *sh, const mla_layer *a, float *cache, mla_scratch *blk,
                            mla_scratch *s, int pos, int n, const float *xn, float *out, char *err);
/* Several timelines in one pass: segment i is seg[i].n consecutive rows of
 * xn / out at positions pos.. of its own cache (host or device); scratch:
 * the segment's session scratch for the per-thread attention rows (sized
 * for its context; NULL: s). Projections run once over all rows; each row
 * is bit-identical to running its segment alone. Total rows <= s->rows. */
typedef struct {
    float *cache;
    void *dev_cache;
    const mla_scratch *scratch;
    int pos, n;
} mla_seg;
/* The whole layer through acc_mla_layer on the device cache (as
 * kda_layer_on_device: 1 done, 0 not taken, -1 a device failure). */
int mla_layer_on_device(df_engine *e, const mla_shape *sh, const mla_layer *a, void *dev_cache, int pos, int n,
                        const float *xn, float *out, char *err);
df_status mla_forward_batch(df_engine *e, const mla_shape *sh, const mla_layer *a, const mla_seg *seg, int nseg,
                            mla_scratch *s, const float *xn, float *out, char *err);
#endif
