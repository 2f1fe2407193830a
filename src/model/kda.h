/* kda.h — Kimi Delta Attention, the linear-attention layer of Kimi-Linear
 * and K3 (prefix kda_).
 *
 * Per token and head h (K = V = head_dim):
 *   q, k, v  = SiLU(causal depthwise conv_W(W_{q,k,v} x))   (per channel)
 *   q, k     = l2norm(.) (eps 1e-6 inside the rsqrt); q *= K^-1/2
 *   decay[k] = exp(g[k]),  g = lb*sigmoid(exp(A)*(f + dt_bias))  with a lower bound lb
 *                          g = -exp(A)*softplus(f + dt_bias)     without (Kimi-Linear)
 *              where f = W_fb W_fa x and A = A_log[h], one value per head
 *   beta     = sigmoid(W_b x)[h]
 *   S        = diag(decay) S;  S += beta k (v - S^T k)^T;  o = S^T q
 *   out      = W_o concat_h( RMSNorm(o_h, o_norm) * sigmoid(gate_h) ),
 *              gate = W_g x (full rank, K3) or W_gb W_ga x (Kimi-Linear)
 *
 * Session state per layer: the last W-1 raw conv inputs of q, k and v, and
 * S [H][K][V] fp32. Tokens are processed in order, so a T-token prefill
 * leaves exactly the state of T single steps. kda_shape, the state layout
 * and the per-channel / per-head math are in kda_core.h (engine-free).
 */
#ifndef DF_MODEL_KDA_H
#define DF_MODEL_KDA_H
#include "kda_core.h"
#include "model.h"

/* How A_log was stored; both readings give one value per head (Moonshot's
 * KimiDeltaAttention declares [num_heads], fla indexes it per head):
 *   PER_HEAD         [H] (K3 fixtures) or [1, 1, H, 1] (Kimi-Linear-48B)
 *   PER_HEAD_PADDED  a vector of n > H values whose first H are the heads'
 *                    and the rest zero: the K3 release stores [128] for 96
 *                    heads (padded to head_dim). A tail that is not zero is
 *                    refused: it would be ambiguous (per key channel?). */
typedef enum { KDA_A_PER_HEAD = 0, KDA_A_PER_HEAD_PADDED } kda_a_mode;

typedef struct {
    df_weight q, k, v, fa, fb, b, g, ga, gb, o;
    float *conv[3];             /* q, k, v conv weights [P][W], owned */
    float *a;                   /* exp(A_log) expanded to [H][D], owned */
    float *dt_bias;             /* [P] owned */
    float *o_norm;              /* [D] owned */
    kda_a_mode a_mode;
    int a_stored;               /* values A_log holds (H, or the padded length) */
    df_accel_kda dev;           /* the same layer for an accelerator's kda hook */
} kda_layer;

typedef struct {
    int rows;                   /* the rows a pass may have (DF_CHUNK for a session) */
    float *qr, *kr, *vr, *f, *fa, *gate, *gl, *braw, *o; /* [rows][...] per-pass scratch */
    float *decay;               /* [rows][P]: the recurrence's decay factors (kda_fast.h) */
} kda_scratch;

df_status kda_bind(df_engine *e, const kda_shape *sh, const char *base, kda_layer *k, char *err);
void kda_free(kda_layer *k);
/* Scratch for passes of up to `rows` rows (~8 H D floats a row). */
df_status kda_scratch_new(const kda_shape *sh, int rows, kda_scratch *s);
void kda_scratch_free(kda_scratch *s);
/* n tokens: xn [n][hidden] normalised input, state of this layer (host
 * floats, or with dev_state non-NULL the device state from acc_state_new:
 * the conv + recurrence then run on the accelerator), out [n][hidden].
 * trail (host state only; else NULL): NULL, or [n][kda_state_floats] that
 * receives the state after each token (kda_io.trail).
 * Fails only on the device (err says why; the state is then undefined). */
df_status kda_forward(df_engine *e, const kda_shape *sh, const kda_layer *k, float *state, void *dev_state,
                      float *trail, kda_scratch *s, int n, const float *xn, float *out, char *err);
/* n rows of a layer-major prompt block on the host state: at once on blk
 * when it holds them (blk->rows >= n: every projection sees every row, the
 * recurrence runs them in order), else in DF_CHUNK pieces on the session's
 * scratch s. The same bits as DF_CHUNK passes. blk may be NULL. */
df_status kda_forward_block(df_engine *e, const kda_shape *sh, const kda_layer *k, float *state, kda_scratch *blk,
                            kda_scratch *s, int n, const float *xn, float *out, char *err);
/* Several timelines in one pass: segment i is seg[i].n consecutive rows of
 * xn / out with its own state (host, device, trail as in kda_forward).
 * The projections run once over all rows (each weight read once); each row
 * is bit-identical to running its segment alone (kn_matmul's row contract).
 * Total rows <= s->rows. */
typedef struct {
    float *state;
    void *dev_state;
    float *trail;
    int n;
} kda_seg;
/* The whole layer through acc_kda_layer on the device state dev_state (xn
 * and out in host or device memory, acc_dev_alloc): 1 done, 0 not taken
 * (nothing changed), -1 a device failure (err; the state is undefined). */
int kda_layer_on_device(df_engine *e, const kda_shape *sh, const kda_layer *k, void *dev_state, int n,
                        const float *xn, float *out, char *err);
df_status kda_forward_batch(df_engine *e, const kda_shape *sh, const kda_layer *k, const kda_seg *seg, int nseg,
                            kda_scratch *s, const float *xn, float *out, char *err);
/* "per head", "per head (first 96 of 128, rest zero: release layout)" */
void kda_a_mode_text(const kda_layer *k, int H, char *out, size_t cap);
#endif
