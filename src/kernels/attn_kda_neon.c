/* attn_kda_neon.c — kn_kda_recur on 4 columns per vector (AArch64 NEON).
 *
 * Owns: kn_kda_recur_neon. Compiled only for AArch64 (the Makefile picks
 * *_neon.c by target), reached through kn_kda_recur. Refuses fused
 * multiply-adds (vmulq then vaddq; the build's -ffp-contract=off keeps the
 * C tail unfused too) and any reordering: each lane computes exactly the
 * scalar form's product, then its add, in its order over d (see kernels.h),
 * so the bits equal KN_SCALAR's.
 *
 * As in attn_kda_avx512.c the columns of S are independent, so a block of
 * up to 16 columns runs all n tokens (its rows stay in L1, u and o in
 * registers); the D % 4 last columns run one at a time in plain C.
 */
#include "kernels.h"
#include <arm_neon.h>

#define AI static inline __attribute__((always_inline))
#define NV_MAX 4 /* vectors per block: 16 columns */

/* Rows of S, columns [c0, c0 + 4 nv), for token t's second half (row +=
 * (beta k[d]) * u; o += q[d] * row) and, when fuse, token t+1's first half
 * in the same visit of the row (row *= decay'[d]; un += (-k'[d]) * row):
 * each element still sees the same operations in the same order. */
AI void rows(const kn_kda_head *a, float *S, int64_t t, const int nv, const float32x4_t *u, float32x4_t *o,
             float32x4_t *un, const int fuse) {
    const int D = a->D;
    const int64_t off = t * a->ld, off1 = off + a->ld;
    const float *q = a->q + off, *k = a->k + off, beta = a->beta[t];
    const float *k1 = fuse ? a->k + off1 : NULL, *dec1 = fuse ? a->decay + off1 : NULL;
    float *tr = a->trail ? a->trail + t * a->trail_ld + (S - a->S) : NULL;
    for (int d = 0; d < D; d++) {
        float *row = S + (size_t)d * D;
        const float32x4_t bk = vdupq_n_f32(beta * k[d]), qd = vdupq_n_f32(q[d]);
        float32x4_t dc = vdupq_n_f32(0.0f), nk = vdupq_n_f32(0.0f);
        if (fuse) dc = vdupq_n_f32(dec1[d]), nk = vdupq_n_f32(-k1[d]);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) {
            float32x4_t r = vaddq_f32(vld1q_f32(row + 4 * j), vmulq_f32(bk, u[j]));
            if (tr) vst1q_f32(tr + (size_t)d * D + 4 * j, r);
            o[j] = vaddq_f32(o[j], vmulq_f32(qd, r));
            if (fuse) {
                r = vmulq_f32(r, dc);
                un[j] = vaddq_f32(un[j], vmulq_f32(nk, r));
            }
            vst1q_f32(row + 4 * j, r);
        }
    }
}

/* Columns [c0, c0 + 4 nv) of S through all n tokens: token 0's first half
 * (decay, u) alone, then each token's second half fused with the next
 * token's first half (as attn_kda_avx512.c). */
AI void block(const kn_kda_head *a, int c0, const int nv) {
    const int D = a->D;
    float *S = a->S + c0;
    float32x4_t u[NV_MAX], un[NV_MAX], o[NV_MAX];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < nv; j++) u[j] = vld1q_f32(a->v + c0 + 4 * j);
    for (int d = 0; d < D; d++) {
        float *row = S + (size_t)d * D;
        const float32x4_t dc = vdupq_n_f32(a->decay[d]), nk = vdupq_n_f32(-a->k[d]);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) {
            float32x4_t r = vmulq_f32(vld1q_f32(row + 4 * j), dc);
            vst1q_f32(row + 4 * j, r);
            u[j] = vaddq_f32(u[j], vmulq_f32(nk, r));
        }
    }
    for (int64_t t = 0; t < a->n; t++) {
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) o[j] = vdupq_n_f32(0.0f);
        if (t + 1 < a->n) {
            const float *v1 = a->v + (t + 1) * a->ld + c0;
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nv; j++) un[j] = vld1q_f32(v1 + 4 * j);
            rows(a, S, t, nv, u, o, un, 1);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nv; j++) u[j] = un[j];
        } else {
            rows(a, S, t, nv, u, o, un, 0);
        }
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) vst1q_f32(a->o + t * a->ld + c0 + 4 * j, o[j]);
    }
}

/* One column e in plain C (the same operations as a lane above). */
static void column(const kn_kda_head *a, int e) {
    const int D = a->D;
    for (int t = 0; t < a->n; t++) {
        const int64_t off = (int64_t)t * a->ld;
        const float *q = a->q + off, *k = a->k + off, *dec = a->decay + off;
        float u = a->v[off + e], o = 0.0f;
        for (int d = 0; d < D; d++) {
            float *x = a->S + (size_t)d * D + e;
            *x *= dec[d];
            u += -k[d] * *x;
        }
        const float beta = a->beta[t];
        for (int d = 0; d < D; d++) {
            float *x = a->S + (size_t)d * D + e;
            *x += beta * k[d] * u;
            if (a->trail) a->trail[(int64_t)t * a->trail_ld + (size_t)d * D + e] = *x;
            o += q[d] * *x;
        }
        a->o[off + e] = o;
    }
}

void kn_kda_recur_neon(const kn_kda_head *a) {
    const int D = a->D;
    int c0 = 0;
    for (; c0 + 4 * NV_MAX <= D; c0 += 4 * NV_MAX) block(a, c0, NV_MAX);
    switch ((D - c0) / 4) {
    case 3: block(a, c0, 3); break;
    case 2: block(a, c0, 2); break;
    case 1: block(a, c0, 1); break;
    default: break;
    }
    for (c0 += (D - c0) / 4 * 4; c0 < D; c0++) column(a, c0);
}
