/* attn_mla_avx512.c — AVX-512 MLA attention kernels (see attn_mla.c).
 *
 * Owns: kn_mla_rowsum_avx512, kn_mla_rowsum_bf16_avx512, kn_mla_rowsum_i8_avx512
 * and kn_mla_scores_avx512: the AVX-512 vector
 * operations for the shared body in attn_mla_simd.h (which says why it is
 * exact and how it tiles): 16 lanes, rowsum tiles of 4 queries x 64 columns,
 * 4 cache rows scored side by side, masks for the ragged end of R.
 */
#include "kernels.h"
#include <immintrin.h>
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#define AI static inline __attribute__((always_inline))

#define MV __m512
#define MMASK __mmask16
#define ML 16
#define M_RS_V 4
#define M_SC_G 4
#define M_ZERO() _mm512_setzero_ps()
#define M_SET1 _mm512_set1_ps
#define M_ADD _mm512_add_ps
#define M_MUL _mm512_mul_ps
#define M_LOADU _mm512_loadu_ps
#define M_STOREU _mm512_storeu_ps
#define M_MASKLOAD(p, m) _mm512_maskz_loadu_ps(m, p)
#define M_MASKSTORE(p, m, x) _mm512_mask_storeu_ps(p, m, x)
#define M_MASK_ALL ((__mmask16)0xffff)
#define M_MASK_TAIL(n) ((__mmask16)((1u << (n)) - 1)) /* 0 < n < 16 */
#define M_LOADU_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define M_LOADN_BF16(p, n) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(M_MASK_TAIL(n), (p))), 16))
#define M_LOADU_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define M_LOADN_I8(p, n) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(M_MASK_TAIL(n), (p))))
#define MLA_ROWSUM kn_mla_rowsum_avx512
#define MLA_ROWSUM_I8 kn_mla_rowsum_i8_avx512
#define MLA_ROWSUM_BF16 kn_mla_rowsum_bf16_avx512
#define MLA_SCORES kn_mla_scores_avx512
#include "attn_mla_simd.h"
