/* attn_mla_neon.c — AArch64 NEON MLA attention kernels (see attn_mla.c).
 *
 * Owns: kn_mla_rowsum_neon, kn_mla_rowsum_bf16_neon, kn_mla_rowsum_i8_neon,
 * kn_mla_scores_neon and kn_mla_scores1_neon. Compiled only for AArch64 (the Makefile picks *_neon.c by target). Refuses anything that
 * changes a bit against the scalar level: vmulq then vaddq, never fused
 * (the build has -ffp-contract=off there, so the plain C tails stay unfused
 * too), no reassociation.
 *
 * rowsum: a tile of J rows of A (queries) x V vectors of 4 columns stays in
 * registers while k runs over a block of KB rows of B (kept in L2).
 * scores: 4 heads of one position in the lanes (qT), G cache rows at a time,
 * four partial sums each, the cache element taken by lane from a vector
 * load: the same multiply-adds as scores1 per head, but each cache row is
 * loaded once per 4 heads (decode; attn_mla.c uses it for heads only, the
 * prefill's queries take scores1, as before: untimed here).
 * scores1: one query; op_dot's four partial sums ARE one 4-lane vector, so
 * G cache rows run side by side.
 *
 * Sections: rowsum; scores; scores1.
 */
#include "kernels.h"
#include <string.h>
#include <arm_neon.h>

#define AI static inline __attribute__((always_inline))
enum { KB = 128 }; /* B rows per block: 128 x (512 + 64) floats = 288 KiB */

/* ---- rowsum ---- */

enum { B_F32, B_BF16, B_I8 }; /* what B holds (as attn_mla_simd.h) */

/* 4 values of row k of B from element i: fp32, bf16 widened exactly, or
 * int8 times the row's scale bs[k] (one rounding, as kn_dequant_row). */
AI float32x4_t ld4(const void *B, const float *bs, int k, int64_t i, const int bt) {
    if (bt == B_BF16) return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)B + i), 16));
    if (bt == B_I8) {
        int8_t q[8] = {0};
        memcpy(q, (const int8_t *)B + i, 4);
        const float32x4_t f = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(q)))));
        return vmulq_f32(f, vdupq_n_f32(bs[k]));
    }
    return vld1q_f32((const float *)B + i);
}
AI float b1(const void *B, const float *bs, int k, int64_t i, const int bt) {
    if (bt == B_F32) return ((const float *)B)[i];
    if (bt == B_I8) return (float)((const int8_t *)B)[i] * bs[k];
    const uint32_t u = (uint32_t)((const uint16_t *)B)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Y rows 0..J-1 (at stride ldy), columns [0, 4V), terms k in [kb, ke);
 * query jj takes k < cnt0 + jj * inc. B as bt says (ld4). */
AI void rs_tile(const float *A, int64_t lda, const void *B, int64_t ldb, const float *bs, float *Y, int64_t ldy,
                int kb, int ke, int cnt0, int inc, const int J, const int V, const int bt) {
    float32x4_t acc[4][4];
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[jj][v] = vld1q_f32(Y + jj * ldy + 4 * v);
    int kfull = cnt0 < ke ? cnt0 : ke, kmax = cnt0 + (J - 1) * inc;
    if (kmax > ke) kmax = ke;
    int k = kb;
    for (; k < kfull; k++) { /* every query of the tile takes row k */
        float32x4_t bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) bv[v] = ld4(B, bs, k, k * ldb + 4 * v, bt);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            float32x4_t a = vdupq_n_f32(A[jj * lda + k]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[jj][v] = vaddq_f32(acc[jj][v], vmulq_f32(a, bv[v]));
        }
    }
    for (; k < kmax; k++) { /* the causal edge: query jj stops at cnt0 + jj */
        float32x4_t bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) bv[v] = ld4(B, bs, k, k * ldb + 4 * v, bt);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            if (k >= cnt0 + jj * inc) continue;
            float32x4_t a = vdupq_n_f32(A[jj * lda + k]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[jj][v] = vaddq_f32(acc[jj][v], vmulq_f32(a, bv[v]));
        }
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) vst1q_f32(Y + jj * ldy + 4 * v, acc[jj][v]);
}

AI void rs_rows(const float *A, int64_t lda, const void *B, int64_t ldb, const float *bs, float *Y, int64_t ldy,
                int kb, int ke, int cnt0, int inc, int R, const int J, const int bt) {
    const size_t esz = bt == B_BF16 ? sizeof(uint16_t) : bt == B_I8 ? 1 : sizeof(float);
    const char *b = B;
    int r = 0;
    for (; r + 16 <= R; r += 16) rs_tile(A, lda, b + r * esz, ldb, bs, Y + r, ldy, kb, ke, cnt0, inc, J, 4, bt);
    for (; r + 4 <= R; r += 4) rs_tile(A, lda, b + r * esz, ldb, bs, Y + r, ldy, kb, ke, cnt0, inc, J, 1, bt);
    for (; r < R; r++) /* the ragged end of R: op_axpy's scalar step */
        for (int jj = 0; jj < J; jj++)
            for (int k = kb; k < ke && k < cnt0 + jj * inc; k++)
                Y[jj * ldy + r] += A[jj * lda + k] * b1(B, bs, k, k * ldb + r, bt);
}

AI void rowsum_body(const float *A, int64_t lda, const void *B, int64_t ldb, const float *bs, int m, int k0, int inc,
                    int R, float *Y, int64_t ldy, const int bt) {
    for (int j = 0; j < m; j++)
        for (int r = 0; r < R; r++) Y[(int64_t)j * ldy + r] = 0.0f;
    int kend = k0 + (m - 1) * inc;
    for (int kb = 0; kb < kend; kb += KB) {
        int ke = kb + KB < kend ? kb + KB : kend;
        int j = 0;
        for (; j + 4 <= m; j += 4)
            rs_rows(A + (int64_t)j * lda, lda, B, ldb, bs, Y + (int64_t)j * ldy, ldy, kb, ke, k0 + j * inc, inc, R, 4,
                    bt);
        for (; j < m; j++)
            rs_rows(A + (int64_t)j * lda, lda, B, ldb, bs, Y + (int64_t)j * ldy, ldy, kb, ke, k0 + j * inc, inc, R, 1,
                    bt);
    }
}

void kn_mla_rowsum_neon(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R,
                        float *Y, int64_t ldy) {
    rowsum_body(A, lda, B, ldb, NULL, m, k0, inc, R, Y, ldy, B_F32);
}

void kn_mla_rowsum_bf16_neon(const float *A, int64_t lda, const uint16_t *B, int64_t ldb, int m, int k0, int inc,
                             int R, float *Y, int64_t ldy) {
    rowsum_body(A, lda, B, ldb, NULL, m, k0, inc, R, Y, ldy, B_BF16);
}

void kn_mla_rowsum_i8_neon(const float *A, int64_t lda, const int8_t *B, int64_t ldb, const float *bs, int m, int k0,
                           int inc, int R, float *Y, int64_t ldy) {
    rowsum_body(A, lda, B, ldb, bs, m, k0, inc, R, Y, ldy, B_I8);
}

/* ---- scores ---- */

/* op_dot(q_j, c_g + off, n) for the 4 heads j of qT (row stride 4) and G
 * rows c_g: four partial sums over i mod 4, the tail into s0,
 * (s0+s1)+(s2+s3). */
AI void dot_g(const float *qT, const float *const *c, int off, int n, const int G, float32x4_t *out) {
    float32x4_t s[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) s[g][p] = vdupq_n_f32(0.0f);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t cv[4];
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) cv[g] = vld1q_f32(c[g] + off + i);
        float32x4_t q0 = vld1q_f32(qT + (int64_t)i * 4), q1 = vld1q_f32(qT + (int64_t)(i + 1) * 4),
                    q2 = vld1q_f32(qT + (int64_t)(i + 2) * 4), q3 = vld1q_f32(qT + (int64_t)(i + 3) * 4);
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) {
            s[g][0] = vaddq_f32(s[g][0], vmulq_laneq_f32(q0, cv[g], 0));
            s[g][1] = vaddq_f32(s[g][1], vmulq_laneq_f32(q1, cv[g], 1));
            s[g][2] = vaddq_f32(s[g][2], vmulq_laneq_f32(q2, cv[g], 2));
            s[g][3] = vaddq_f32(s[g][3], vmulq_laneq_f32(q3, cv[g], 3));
        }
    }
    for (; i < n; i++) {
        float32x4_t q = vld1q_f32(qT + (int64_t)i * 4);
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) s[g][0] = vaddq_f32(s[g][0], vmulq_n_f32(q, c[g][off + i]));
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) out[g] = vaddq_f32(vaddq_f32(s[g][0], s[g][1]), vaddq_f32(s[g][2], s[g][3]));
}

AI void scores_g(const float *cache, int R, int dr, float32x4_t scale, const float *qT, int m, int k, float *sc,
                 int64_t ldsc, const int G) {
    const float *c[4];
    int64_t stride = (int64_t)R + dr;
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) c[g] = cache + (int64_t)(k + g) * stride;
    float32x4_t nope[4], rope[4];
    dot_g(qT, c, 0, R, G, nope);
    dot_g(qT + (int64_t)R * 4, c, R, dr, G, rope);
    float tmp[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) vst1q_f32(tmp[g], vmulq_f32(vaddq_f32(nope[g], rope[g]), scale));
    for (int j = 0; j < m; j++)
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) sc[j * ldsc + k + g] = tmp[g][j];
}

void kn_mla_scores_neon(const float *cache, int R, int dr, float scale, const float *qT, int m, int kend, float *sc,
                        int64_t ldsc) {
    float32x4_t vs = vdupq_n_f32(scale);
    int k = 0;
    for (; k + 4 <= kend; k += 4) scores_g(cache, R, dr, vs, qT, m, k, sc, ldsc, 4);
    for (; k < kend; k++) scores_g(cache, R, dr, vs, qT, m, k, sc, ldsc, 1);
}

/* ---- scores1 ---- */

/* op_dot(q, c_g + off, n) for G rows: lane p of the 4-lane sum is s_p; the
 * tail goes to s0 after the vector loop, as in op_dot. */
AI void dot1_g(const float *q, const float *const *c, int off, int n, const int G, float *out) {
    float32x4_t s[8];
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) s[g] = vdupq_n_f32(0.0f);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t qv = vld1q_f32(q + i);
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) s[g] = vaddq_f32(s[g], vmulq_f32(qv, vld1q_f32(c[g] + off + i)));
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) {
        float s0 = vgetq_lane_f32(s[g], 0);
        for (int t = i; t < n; t++) s0 += q[t] * c[g][off + t];
        out[g] = (s0 + vgetq_lane_f32(s[g], 1)) + (vgetq_lane_f32(s[g], 2) + vgetq_lane_f32(s[g], 3));
    }
}

AI void scores1_g(const float *cache, int R, int dr, float scale, const float *ql, const float *qp, int k, float *sc,
                  const int G) {
    const float *c[8];
    int64_t stride = (int64_t)R + dr;
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) c[g] = cache + (int64_t)(k + g) * stride;
    float nope[8], rope[8];
    dot1_g(ql, c, 0, R, G, nope);
    dot1_g(qp, c, R, dr, G, rope);
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) sc[k + g] = (nope[g] + rope[g]) * scale;
}

void kn_mla_scores1_neon(const float *cache, int R, int dr, float scale, const float *ql, const float *qp, int kend,
                         float *sc) {
    int k = 0;
    for (; k + 8 <= kend; k += 8) scores1_g(cache, R, dr, scale, ql, qp, k, sc, 8);
    for (; k < kend; k++) scores1_g(cache, R, dr, scale, ql, qp, k, sc, 1);
}
