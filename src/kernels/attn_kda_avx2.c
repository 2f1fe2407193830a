/* attn_kda_avx2.c — the KDA kernels on 8 lanes (AVX2): kn_kda_recur with 8
 * columns of S per vector, kn_kda_conv with 8 channels.
 *
 * Owns: kn_kda_recur_avx2, kn_kda_conv_avx2: the AVX2 vector operations for
 * the shared body in attn_kda_simd.h (which says why it is exact and how it
 * blocks). Compiled with the Makefile's AVX2_FLAGS and reached only through
 * kernels.h's dispatchers when the CPU has them. Blocks of 3 vectors (24
 * columns: 3 x 3 accumulators + 4 broadcasts of the 16 registers); the last
 * vector of a D that is not a multiple of 8 goes through maskload/maskstore
 * (a lane takes part when its mask word's sign bit is set).
 */
#include "kernels.h"
#include <immintrin.h>
#include <math.h>

#define AI static inline __attribute__((always_inline))

#define KV __m256
#define KMASK __m256i
#define KL 8
#define KNV_MAX 3
#define K_ZERO() _mm256_setzero_ps()
#define K_SET1 _mm256_set1_ps
#define K_ADD _mm256_add_ps
#define K_MUL _mm256_mul_ps
#define K_DIV _mm256_div_ps
#define K_LOADU _mm256_loadu_ps
#define K_STOREU _mm256_storeu_ps
#define K_LOADA _mm256_load_ps
#define K_STOREA _mm256_store_ps
#define K_MASKLOAD(p, m) _mm256_maskload_ps(p, m)
#define K_MASKSTORE(p, m, x) _mm256_maskstore_ps(p, m, x)
#define K_MASK_ALL _mm256_set1_epi32(-1)
#define K_MASK_TAIL(tail) \
    _mm256_cmpgt_epi32(_mm256_set1_epi32((tail) ? (tail) : 8), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define KDA_RECUR kn_kda_recur_avx2
#define KDA_CONV kn_kda_conv_avx2
#include "attn_kda_simd.h"
