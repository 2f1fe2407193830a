/* ops.h — small vector operations on fp32 activations (deterministic).
 *
 * These run on vectors of hidden size, not on weights, so they are a small
 * share of a token's time; they stay plain C with a fixed summation order so
 * every path (decode, prefill, any thread count) gets the same bits.
 */
#ifndef DF_KERNELS_OPS_H
#define DF_KERNELS_OPS_H
#include <stdint.h>

/* sum of x[i]^2 in double (each square exact), in a fixed order */
double op_sumsq(const float *x, int n);
/* out = w * x / sqrt(mean(x^2) + eps); w may be NULL (no weight). out may alias x. */
void op_rmsnorm(float *out, const float *x, const float *w, int n, float eps);
float op_dot(const float *a, const float *b, int n);
/* y += a * x (x and y do not overlap, or are the same array) */
void op_axpy(float *y, float a, const float *x, int n);
/* AArch64 only (ops_neon.c): op_axpy's NEON loop, the same bits. */
void op_axpy_neon(float *y, float a, const float *x, int n);
/* In-place softmax over n values (max-subtracted, fp32). */
void op_softmax(float *x, int n);
static inline float op_sigmoid(float x);
float op_silu(float x);
/* Rotates pairs of x (length d) for one position. interleaved: pairs
 * (2i, 2i+1); otherwise (i, i + d/2). cos/sin hold d/2 values. */
void op_rope(float *x, int d, const float *cos_, const float *sin_, int interleaved);
/* Attention-residual mixing (Kimi K3): over V = [anchors[0..na) (each H
 * floats, contiguous), cur], out = sum_j softmax_j(dot(V_j, w) / rms(V_j)) V_j
 * with rms = sqrt(sum of squares (double) / H + eps). out must not alias. */
void op_attn_res(const float *anchors, int na, const float *cur, const float *w, int H, float eps, float *out);

#include <math.h>
static inline float op_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
#endif
