/* attn_kda_avx512.c — the KDA kernels on 16 lanes (AVX-512F): kn_kda_recur
 * with 16 columns of S per vector, kn_kda_conv with 16 channels.
 *
 * Owns: kn_kda_recur_avx512, kn_kda_conv_avx512: the AVX-512 vector
 * operations for the shared body in attn_kda_simd.h (which says why it is
 * exact and how it blocks). Compiled with the Makefile's AVX512_FLAGS and
 * reached only through kernels.h's dispatchers when the CPU has them.
 * Blocks of 4 vectors (64 columns: D x 64 floats, 32 KiB at D = 128, in L1;
 * u, the next u and o take 12 of the 32 registers); the last vector of a D
 * that is not a multiple of 16 goes through a lane mask.
 */
#include "kernels.h"
#include <immintrin.h>
#include <math.h>

#define AI static inline __attribute__((always_inline))

#define KV __m512
#define KMASK __mmask16
#define KL 16
#define KNV_MAX 4
#define K_ZERO() _mm512_setzero_ps()
#define K_SET1 _mm512_set1_ps
#define K_ADD _mm512_add_ps
#define K_MUL _mm512_mul_ps
#define K_DIV _mm512_div_ps
#define K_LOADU _mm512_loadu_ps
#define K_STOREU _mm512_storeu_ps
#define K_LOADA _mm512_load_ps
#define K_STOREA _mm512_store_ps
#define K_MASKLOAD(p, m) _mm512_maskz_loadu_ps(m, p)
#define K_MASKSTORE(p, m, x) _mm512_mask_storeu_ps(p, m, x)
#define K_MASK_ALL ((__mmask16)0xffff)
#define K_MASK_TAIL(tail) ((tail) ? (__mmask16)((1u << (tail)) - 1) : K_MASK_ALL)
#define KDA_RECUR kn_kda_recur_avx512
#define KDA_CONV kn_kda_conv_avx512
#include "attn_kda_simd.h"
