/* attn_mla_avx2.c — AVX2 MLA attention kernels (see attn_mla.c).
 *
 * Owns: kn_mla_rowsum_avx2, kn_mla_rowsum_bf16_avx2, kn_mla_rowsum_i8_avx2
 * and kn_mla_scores_avx2 (the AVX2 vector operations for the shared body in
 * attn_mla_simd.h, which says why it is
 * exact and how it tiles: 8 lanes, rowsum tiles of 4 queries x 16 columns,
 * 2 cache rows scored side by side, maskload/maskstore for the ragged end of
 * R), and kn_mla_scores1_avx2 (one query; the AVX-512 level uses it too):
 * op_dot's four partial sums ARE one 4-lane vector, so G cache rows run side
 * by side (G independent add chains instead of one). Refuses anything that
 * changes a bit against the scalar level: no FMA, no reassociation.
 *
 * Sections: rowsum and scores (the shared body); scores1.
 */
#include "kernels.h"
#include <immintrin.h>
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#define AI static inline __attribute__((always_inline))

#define MV __m256
#define MMASK __m256i
#define ML 8
#define M_RS_V 2
#define M_SC_G 2
#define M_ZERO() _mm256_setzero_ps()
#define M_SET1 _mm256_set1_ps
#define M_ADD _mm256_add_ps
#define M_MUL _mm256_mul_ps
#define M_LOADU _mm256_loadu_ps
#define M_STOREU _mm256_storeu_ps
#define M_MASKLOAD(p, m) _mm256_maskload_ps(p, m)
#define M_MASKSTORE(p, m, x) _mm256_maskstore_ps(p, m, x)
#define M_MASK_ALL _mm256_set1_epi32(-1)
/* lane i takes part when i < n (maskload/maskstore read the sign bit) */
#define M_MASK_TAIL(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define M_LOADU_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define M_LOADN_BF16(p, n) loadn_bf16((p), (n))
/* n < 8 bf16 widened to fp32, the lanes past n zero */
AI __m256 loadn_bf16(const uint16_t *p, int n) {
    uint16_t t[8] = {0};
    for (int i = 0; i < n; i++) t[i] = p[i];
    return M_LOADU_BF16(t);
}
#define M_LOADU_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define M_LOADN_I8(p, n) loadn_i8((p), (n))
/* n < 8 int8 as fp32, the lanes past n zero */
AI __m256 loadn_i8(const int8_t *p, int n) {
    int8_t t[8] = {0};
    for (int i = 0; i < n; i++) t[i] = p[i];
    return M_LOADU_I8(t);
}
#define MLA_ROWSUM kn_mla_rowsum_avx2
#define MLA_ROWSUM_I8 kn_mla_rowsum_i8_avx2
#define MLA_ROWSUM_BF16 kn_mla_rowsum_bf16_avx2
#define MLA_SCORES kn_mla_scores_avx2
#include "attn_mla_simd.h"

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
