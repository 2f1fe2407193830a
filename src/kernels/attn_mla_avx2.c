/* attn_mla_avx2.c — AVX2 MLA attention kernels (see attn_mla.c).
 *
 * Owns: kn_mla_rowsum_avx2, kn_mla_scores_avx2 and kn_mla_scores1_avx2 (one
 * query; the AVX-512 level uses it too). Refuses anything that changes a bit
 * against the scalar level: no FMA (a multiply, then an add), no
 * reassociation; each lane runs one scalar sequence of op_dot / op_axpy.
 *
 * rowsum: a tile of J rows of A (queries) x V vectors of 8 columns stays in
 * registers while k runs over a block of KB rows of B (kept in L2).
 * scores: 8 queries in the lanes (qT), G cache rows at a time, four partial
 * sums each; the cache element is broadcast.
 * scores1: one query; op_dot's four partial sums ARE one 4-lane vector, so
 * G cache rows run side by side (G independent add chains instead of one).
 *
 * Sections: rowsum; scores; scores1.
 */
#include "kernels.h"
#include <immintrin.h>
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#define AI static inline __attribute__((always_inline))
enum { KB = 128 }; /* B rows per block: 128 x (512 + 64) floats = 288 KiB, in L2 */

/* ---- rowsum ---- */

/* Y rows 0..J-1 (at stride ldy), columns [0, 8V), terms k in [kb, ke);
 * query jj takes k < cnt0 + jj * inc. The last vector is masked by `tail`
 * when `masked` (the ragged end of R). */
AI void rs_tile(const float *A, int64_t lda, const float *B, int64_t ldb, float *Y, int64_t ldy, int kb, int ke,
                int cnt0, int inc, const int J, const int V, const int masked, __m256i tail) {
#define LD(p) (masked ? _mm256_maskload_ps((p), tail) : _mm256_loadu_ps(p))
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) acc[jj][v] = LD(Y + jj * ldy + 8 * v);
    int kfull = cnt0 < ke ? cnt0 : ke, kmax = cnt0 + (J - 1) * inc;
    if (kmax > ke) kmax = ke;
    int k = kb;
    for (; k < kfull; k++) { /* every query of the tile takes row k */
        __m256 bv[2];
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) bv[v] = LD(B + k * ldb + 8 * v);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            __m256 a = _mm256_set1_ps(A[jj * lda + k]);
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) acc[jj][v] = _mm256_add_ps(acc[jj][v], _mm256_mul_ps(a, bv[v]));
        }
    }
    for (; k < kmax; k++) { /* the causal edge: query jj stops at cnt0 + jj */
        __m256 bv[2];
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) bv[v] = LD(B + k * ldb + 8 * v);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            if (k >= cnt0 + jj * inc) continue;
            __m256 a = _mm256_set1_ps(A[jj * lda + k]);
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) acc[jj][v] = _mm256_add_ps(acc[jj][v], _mm256_mul_ps(a, bv[v]));
        }
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) {
            if (masked) _mm256_maskstore_ps(Y + jj * ldy + 8 * v, tail, acc[jj][v]);
            else _mm256_storeu_ps(Y + jj * ldy + 8 * v, acc[jj][v]);
        }
#undef LD
}

AI void rs_rows(const float *A, int64_t lda, const float *B, int64_t ldb, float *Y, int64_t ldy, int kb, int ke,
                int cnt0, int inc, int R, const int J) {
    const __m256i all = _mm256_set1_epi32(-1);
    int r = 0;
    for (; r + 16 <= R; r += 16) rs_tile(A, lda, B + r, ldb, Y + r, ldy, kb, ke, cnt0, inc, J, 2, 0, all);
    for (; r + 8 <= R; r += 8) rs_tile(A, lda, B + r, ldb, Y + r, ldy, kb, ke, cnt0, inc, J, 1, 0, all);
    if (r < R) {
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(R - r), lane);
        rs_tile(A, lda, B + r, ldb, Y + r, ldy, kb, ke, cnt0, inc, J, 1, 1, tail);
    }
}

void kn_mla_rowsum_avx2(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R,
                        float *Y, int64_t ldy) {
    for (int j = 0; j < m; j++)
        for (int r = 0; r < R; r++) Y[(int64_t)j * ldy + r] = 0.0f;
    int kend = k0 + (m - 1) * inc;
    for (int kb = 0; kb < kend; kb += KB) {
        int ke = kb + KB < kend ? kb + KB : kend;
        int j = 0;
        for (; j + 4 <= m; j += 4)
            rs_rows(A + (int64_t)j * lda, lda, B, ldb, Y + (int64_t)j * ldy, ldy, kb, ke, k0 + j * inc, inc, R, 4);
        for (; j < m; j++)
            rs_rows(A + (int64_t)j * lda, lda, B, ldb, Y + (int64_t)j * ldy, ldy, kb, ke, k0 + j * inc, inc, R, 1);
    }
}

/* ---- scores ---- */

/* op_dot(q_j, c_g + off, n) for the 8 queries j of qT (row stride 8) and G
 * rows c_g: four partial sums over i mod 4, the tail into s0,
 * (s0+s1)+(s2+s3). */
AI void dot_g(const float *qT, const float *const *c, int off, int n, const int G, __m256 *out) {
    __m256 s[2][4];
#pragma GCC unroll 2
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) s[g][p] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 4 <= n; i += 4) {
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            __m256 q = _mm256_loadu_ps(qT + (int64_t)(i + p) * 8);
#pragma GCC unroll 2
            for (int g = 0; g < G; g++)
                s[g][p] = _mm256_add_ps(s[g][p], _mm256_mul_ps(q, _mm256_set1_ps(c[g][off + i + p])));
        }
    }
    for (; i < n; i++) {
        __m256 q = _mm256_loadu_ps(qT + (int64_t)i * 8);
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) s[g][0] = _mm256_add_ps(s[g][0], _mm256_mul_ps(q, _mm256_set1_ps(c[g][off + i])));
    }
#pragma GCC unroll 2
    for (int g = 0; g < G; g++)
        out[g] = _mm256_add_ps(_mm256_add_ps(s[g][0], s[g][1]), _mm256_add_ps(s[g][2], s[g][3]));
}

AI void scores_g(const float *cache, int R, int dr, __m256 scale, const float *qT, int m, int k, float *sc,
                 int64_t ldsc, const int G) {
    const float *c[2];
    int64_t stride = (int64_t)R + dr;
#pragma GCC unroll 2
    for (int g = 0; g < G; g++) c[g] = cache + (int64_t)(k + g) * stride;
    __m256 nope[2], rope[2];
    dot_g(qT, c, 0, R, G, nope);
    dot_g(qT + (int64_t)R * 8, c, R, dr, G, rope);
    float tmp[2][8];
#pragma GCC unroll 2
    for (int g = 0; g < G; g++) _mm256_storeu_ps(tmp[g], _mm256_mul_ps(_mm256_add_ps(nope[g], rope[g]), scale));
    for (int j = 0; j < m; j++)
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) sc[j * ldsc + k + g] = tmp[g][j];
}

void kn_mla_scores_avx2(const float *cache, int R, int dr, float scale, const float *qT, int m, int kend, float *sc,
                        int64_t ldsc) {
    __m256 vs = _mm256_set1_ps(scale);
    int k = 0;
    for (; k + 2 <= kend; k += 2) scores_g(cache, R, dr, vs, qT, m, k, sc, ldsc, 2);
    for (; k < kend; k++) scores_g(cache, R, dr, vs, qT, m, k, sc, ldsc, 1);
}

/* ---- scores1 ---- */

/* op_dot(q, c_g + off, n) for G rows: lane p of the 4-lane sum is s_p. */
AI void dot1_g(const float *q, const float *const *c, int off, int n, const int G, float *out) {
    __m128 s[8];
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) s[g] = _mm_setzero_ps();
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        __m128 qv = _mm_loadu_ps(q + i);
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) s[g] = _mm_add_ps(s[g], _mm_mul_ps(qv, _mm_loadu_ps(c[g] + off + i)));
    }
    for (; i < n; i++) { /* the tail goes to s0 alone */
        __m128 qv = _mm_load_ss(q + i);
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) s[g] = _mm_add_ss(s[g], _mm_mul_ss(qv, _mm_load_ss(c[g] + off + i)));
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) {
        float f[4];
        _mm_storeu_ps(f, s[g]);
        out[g] = (f[0] + f[1]) + (f[2] + f[3]);
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

void kn_mla_scores1_avx2(const float *cache, int R, int dr, float scale, const float *ql, const float *qp, int kend,
                         float *sc) {
    int k = 0;
    for (; k + 8 <= kend; k += 8) scores1_g(cache, R, dr, scale, ql, qp, k, sc, 8);
    for (; k < kend; k++) scores1_g(cache, R, dr, scale, ql, qp, k, sc, 1);
}
