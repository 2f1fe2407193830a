/* act_avx2.c — AVX2 gated activations (see act.c, act_simd.h): 8 lanes,
 * maskload / maskstore for the end of an array, glibc's _ZGVdN8v_expf /
 * _ZGVdN8v_tanhf (libmvec) for exp and tanh.
 */
#include "kernels.h"
#ifndef DF_NO_MVEC /* else act.c never calls this level (no libmvec) */
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

/* libmvec's AVX2 forms (glibc >= 2.35 for tanhf); math.h declares them only
 * under -ffast-math, so they are named here */
__m256 _ZGVdN8v_expf(__m256 x);
__m256 _ZGVdN8v_tanhf(__m256 x);

/* lanes below n set (maskload / maskstore read each lane's sign bit) */
AI __m256i lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#define AV __m256
#define AL 8
#define A_SET1 _mm256_set1_ps
#define A_ADD _mm256_add_ps
#define A_MUL _mm256_mul_ps
#define A_DIV _mm256_div_ps
#define A_NEG(x) _mm256_xor_ps((x), _mm256_set1_ps(-0.0f))
#define A_LOADU _mm256_loadu_ps
#define A_STOREU _mm256_storeu_ps
#define A_LOADN(p, n) _mm256_maskload_ps((p), lanes(n))
#define A_STOREN(p, n, v) _mm256_maskstore_ps((p), lanes(n), (v))
#define A_EXP _ZGVdN8v_expf
#define A_TANH _ZGVdN8v_tanhf
#define ACT_SILU kn_act_silu_mul_avx2
#define ACT_SITU kn_act_situ_mul_avx2
#include "act_simd.h"
#endif
