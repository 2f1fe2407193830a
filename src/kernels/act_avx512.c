/* act_avx512.c — AVX-512 gated activations (see act.c, act_simd.h): 16
 * lanes, masked loads and stores for the end of an array, glibc's
 * _ZGVeN16v_expf / _ZGVeN16v_tanhf (libmvec) for exp and tanh.
 */
#include "kernels.h"
#ifndef DF_NO_MVEC /* else act.c never calls this level (no libmvec) */
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

/* libmvec's AVX-512 forms (glibc >= 2.35 for tanhf); math.h declares them
 * only under -ffast-math, so they are named here */
__m512 _ZGVeN16v_expf(__m512 x);
__m512 _ZGVeN16v_tanhf(__m512 x);

#define AV __m512
#define AL 16
#define A_SET1 _mm512_set1_ps
#define A_ADD _mm512_add_ps
#define A_MUL _mm512_mul_ps
#define A_DIV _mm512_div_ps
#define A_NEG(x) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)))
#define A_LOADU _mm512_loadu_ps
#define A_STOREU _mm512_storeu_ps
#define A_LOADN(p, n) _mm512_maskz_loadu_ps((__mmask16)(0xffffu >> (16 - (n))), (p))
#define A_STOREN(p, n, v) _mm512_mask_storeu_ps((p), (__mmask16)(0xffffu >> (16 - (n))), (v))
#define A_EXP _ZGVeN16v_expf
#define A_TANH _ZGVeN16v_tanhf
#define ACT_SILU kn_act_silu_mul_avx512
#define ACT_SITU kn_act_situ_mul_avx512
#include "act_simd.h"
#endif
