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

/* Columns [c0, c0 + 4 nv) of S through all n tokens. */
AI void block(const kn_kda_head *a, int c0, const int nv) {
    const int D = a->D;
    float *S = a->S + c0;
    for (int t = 0; t < a->n; t++) {
        const int64_t off = (int64_t)t * a->ld;
        const float *q = a->q + off, *k = a->k + off, *v = a->v + off + c0, *dec = a->decay + off;
        float32x4_t u[NV_MAX], o[NV_MAX];
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) u[j] = vld1q_f32(v + 4 * j);
        for (int d = 0; d < D; d++) {
            float *row = S + (size_t)d * D;
            const float32x4_t dc = vdupq_n_f32(dec[d]), nk = vdupq_n_f32(-k[d]);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nv; j++) {
                float32x4_t r = vmulq_f32(vld1q_f32(row + 4 * j), dc);
                vst1q_f32(row + 4 * j, r);
                u[j] = vaddq_f32(u[j], vmulq_f32(nk, r));
            }
        }
        const float beta = a->beta[t];
        float *tr = a->trail ? a->trail + (int64_t)t * a->trail_ld + c0 : NULL;
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) o[j] = vdupq_n_f32(0.0f);
        for (int d = 0; d < D; d++) {
            float *row = S + (size_t)d * D;
            const float32x4_t bk = vdupq_n_f32(beta * k[d]), qd = vdupq_n_f32(q[d]);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nv; j++) {
                float32x4_t r = vaddq_f32(vld1q_f32(row + 4 * j), vmulq_f32(bk, u[j]));
                vst1q_f32(row + 4 * j, r);
                if (tr) vst1q_f32(tr + (size_t)d * D + 4 * j, r);
                o[j] = vaddq_f32(o[j], vmulq_f32(qd, r));
            }
        }
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) vst1q_f32(a->o + off + c0 + 4 * j, o[j]);
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
