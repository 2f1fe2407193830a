/* kda_core.h — the engine-free math of one Kimi Delta Attention layer
 * (prefix kda_; kda.h has the formulas): the short convolution of one
 * channel and the recurrence of one head, on plain float arrays.
 *
 * kda.c's pool jobs call these (so the CPU engine and the CUDA tests share
 * one oracle); src/cuda/gpu_kda.cu implements the same contract on the
 * device and is tested against them. Nothing here allocates, knows the
 * engine or touches a weight format.
 *
 * Per-layer session state (floats, kda_state_floats), P = H * D:
 *
 *   | conv q [P][W-1] | conv k [P][W-1] | conv v [P][W-1] | S [H][D][D] |
 *     last W-1 raw inputs per channel, oldest first         S[h][k][v]
 */
#ifndef DF_MODEL_KDA_CORE_H
#define DF_MODEL_KDA_CORE_H
#include <stdint.h>

typedef struct {
    int hidden, H, D, W;        /* heads, head dim (K = V), conv kernel (W <= 16) */
    int full_rank_gate;
    int has_lower_bound;
    float lower_bound;
    float norm_eps;             /* o_norm eps (rms_norm_eps) */
} kda_shape;

/* The per-channel parameters of one layer. Host pointers for the kda_
 * functions, device pointers for gpu_kda (gpu.h). */
typedef struct {
    const float *conv[3];       /* q, k, v conv weights [P][W] */
    const float *a;             /* exp(A_log) expanded to [H][D] */
    const float *dt_bias;       /* [P] */
    const float *o_norm;        /* [D] */
} kda_params;

/* One step's activations for n tokens, token stride P (H for braw). */
typedef struct {
    float *q, *k, *v;           /* [n][P] projections; conv + SiLU in place, then
                                   q, k l2-normalised (q also times D^-1/2) in place */
    const float *f;             /* [n][P] gate input f = W_fb W_fa x */
    const float *braw;          /* [n][H] beta logits */
    const float *gate;          /* [n][P] output gate logits */
    float *o;                   /* [n][P] out: RMSNorm(o_h, o_norm) * sigmoid(gate) */
    float *trail;               /* NULL, or [n][kda_state_floats]: receives the layer's state after
                                   each token (rewinding a speculative step is then one copy) */
} kda_io;

/* Floats of session state per layer (conv + recurrent). */
int64_t kda_state_floats(const kda_shape *sh);

/* Channel c of x (0 = q, 1 = k, 2 = v; c < P): for t < n, in token order,
 * x_t = SiLU(sum_j w[j] src[t + j]) over src = [the W-1 inputs in the state
 * | x_0 .. x_{n-1}]; the state then holds the last W-1 inputs. */
void kda_conv_channel(const kda_shape *sh, const kda_params *p, float *state, int which, int c, int n,
                      const kda_io *io);

/* Head h for n tokens in order (conv already applied): l2norm q, k; q *=
 * D^-1/2; decay = exp(g); S = diag(decay) S; S += beta k (v - S^T k)^T;
 * o = S^T q; o = RMSNorm(o, o_norm) * sigmoid(gate). S is this layer's
 * state (the [H][D][D] part is read and written at head h only). */
void kda_recur_head(const kda_shape *sh, const kda_params *p, float *state, int h, int n, const kda_io *io);
/* One channel's per-token decay factor exp(g): g = lower_bound * sigmoid(a z)
 * with a gate lower bound, else -a softplus(z); z = f + dt_bias (the one
 * formula kda_recur_head and kda_fast.c both use). */
float kda_decay(const kda_shape *sh, float a, float z);
#endif
