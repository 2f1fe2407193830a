/* attn_mla_avx512.c — AVX-512 MLA attention kernels (see attn_mla.c).
 *
 * Owns: kn_mla_rowsum_avx512 and kn_mla_scores_avx512. Refuses anything that
 * changes a bit against the scalar level: no FMA (a multiply, then an add),
 * no reassociation; each lane runs one scalar sequence of op_dot / op_axpy.
 *
 * rowsum: a tile of J rows of A (queries) x V vectors of 16 columns stays in
 * registers while k runs over a block of KB rows of B (kept in L2), so a B
 * row is loaded once per J queries and Y is read back once per block.
 * scores: 16 queries in the lanes (qT), G cache rows at a time, four partial
 * sums each; the cache element is broadcast.
 *
 * Sections: rowsum; scores.
 */
#include "kernels.h"
#include <immintrin.h>
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#define AI static inline __attribute__((always_inline))
enum { KB = 128 }; /* B rows per block: 128 x (512 + 64) floats = 288 KiB, in L2 */

/* ---- rowsum ---- */

/* Y rows 0..J-1 (at stride ldy), columns [0, 16V), terms
 * k in [kb, ke); query jj takes k < cnt0 + jj * inc. The last vector is
 * masked by `tail` when `masked` (the ragged end of R). */
AI void rs_tile(const float *A, int64_t lda, const float *B, int64_t ldb, float *Y, int64_t ldy, int kb, int ke,
                int cnt0, int inc, const int J, const int V, const int masked, __mmask16 tail) {
#define LD(p) (masked && v == V - 1 ? _mm512_maskz_loadu_ps(tail, (p)) : _mm512_loadu_ps(p))
    __m512 acc[4][4];
    const float *b = B;
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++)
            acc[jj][v] = LD(Y + jj * ldy + 16 * v);
    int kfull = cnt0 < ke ? cnt0 : ke, kmax = cnt0 + (J - 1) * inc;
    if (kmax > ke) kmax = ke;
    int k = kb;
    for (; k < kfull; k++) { /* every query of the tile takes row k */
        __m512 bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++)
            bv[v] = LD(b + k * ldb + 16 * v);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            __m512 a = _mm512_set1_ps(A[jj * lda + k]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[jj][v] = _mm512_add_ps(acc[jj][v], _mm512_mul_ps(a, bv[v]));
        }
    }
    for (; k < kmax; k++) { /* the causal edge: query jj stops at cnt0 + jj */
        __m512 bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++)
            bv[v] = LD(b + k * ldb + 16 * v);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            if (k >= cnt0 + jj * inc) continue;
            __m512 a = _mm512_set1_ps(A[jj * lda + k]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[jj][v] = _mm512_add_ps(acc[jj][v], _mm512_mul_ps(a, bv[v]));
        }
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) {
            if (masked && v == V - 1) _mm512_mask_storeu_ps(Y + jj * ldy + 16 * v, tail, acc[jj][v]);
            else _mm512_storeu_ps(Y + jj * ldy + 16 * v, acc[jj][v]);
        }
#undef LD
}

/* One tile of J queries over all columns, k in [kb, ke). */
AI void rs_rows(const float *A, int64_t lda, const float *B, int64_t ldb, float *Y, int64_t ldy, int kb, int ke,
                int cnt0, int inc, int R, const int J) {
    int r = 0;
    for (; r + 64 <= R; r += 64) rs_tile(A, lda, B + r, ldb, Y + r, ldy, kb, ke, cnt0, inc, J, 4, 0, 0xffff);
    for (; r + 16 <= R; r += 16) rs_tile(A, lda, B + r, ldb, Y + r, ldy, kb, ke, cnt0, inc, J, 1, 0, 0xffff);
    if (r < R)
        rs_tile(A, lda, B + r, ldb, Y + r, ldy, kb, ke, cnt0, inc, J, 1, 1, (__mmask16)((1u << (R - r)) - 1));
}

void kn_mla_rowsum_avx512(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R,
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

/* op_dot(q_j, c_g, n) for the 16 queries j of qT (row stride 16) and G rows
 * c_g: four partial sums over i mod 4, the tail into s0, (s0+s1)+(s2+s3). */
AI void dot_g(const float *qT, const float *const *c, int off, int n, const int G, __m512 *out) {
    __m512 s[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) s[g][p] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 4 <= n; i += 4) {
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            __m512 q = _mm512_loadu_ps(qT + (int64_t)(i + p) * 16);
#pragma GCC unroll 4
            for (int g = 0; g < G; g++)
                s[g][p] = _mm512_add_ps(s[g][p], _mm512_mul_ps(q, _mm512_set1_ps(c[g][off + i + p])));
        }
    }
    for (; i < n; i++) {
        __m512 q = _mm512_loadu_ps(qT + (int64_t)i * 16);
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) s[g][0] = _mm512_add_ps(s[g][0], _mm512_mul_ps(q, _mm512_set1_ps(c[g][off + i])));
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
        out[g] = _mm512_add_ps(_mm512_add_ps(s[g][0], s[g][1]), _mm512_add_ps(s[g][2], s[g][3]));
}

AI void scores_g(const float *cache, int R, int dr, __m512 scale, const float *qT, int m, int k, float *sc,
                 int64_t ldsc, const int G) {
    const float *c[4];
    int64_t stride = (int64_t)R + dr;
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) c[g] = cache + (int64_t)(k + g) * stride;
    __m512 nope[4], rope[4];
    dot_g(qT, c, 0, R, G, nope);
    dot_g(qT + (int64_t)R * 16, c, R, dr, G, rope);
    float tmp[4][16];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) _mm512_storeu_ps(tmp[g], _mm512_mul_ps(_mm512_add_ps(nope[g], rope[g]), scale));
    for (int j = 0; j < m; j++)
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) sc[j * ldsc + k + g] = tmp[g][j];
}

void kn_mla_scores_avx512(const float *cache, int R, int dr, float scale, const float *qT, int m, int kend,
                          float *sc, int64_t ldsc) {
    __m512 vs = _mm512_set1_ps(scale);
    int k = 0;
    for (; k + 4 <= kend; k += 4) scores_g(cache, R, dr, vs, qT, m, k, sc, ldsc, 4);
    for (; k < kend; k++) scores_g(cache, R, dr, vs, qT, m, k, sc, ldsc, 1);
}
