/* act.c — the gated activations of an MLP over whole arrays (SiLU and SiTU
 * gate times up): their dispatch point and scalar reference.
 *
 * Owns: kn_act_silu_mul and kn_act_situ_mul. The scalar level is libm's
 * expf / tanhf element by element (the values ffn.c always computed); the
 * x86 levels (act_avx2.c, act_avx512.c) call glibc's vector forms of the
 * same functions (libmvec), within kernels.h's stated bound of it; a build
 * without libmvec (DF_NO_MVEC: another libc, glibc < 2.35) runs the scalar
 * level at every level. Every level computes each element by one formula
 * whatever n or the element's place in the array is, so a split over
 * threads or rows never changes a bit.
 */
#include "kernels.h"
#include "ops.h"
#include <math.h>

static void silu_scalar(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = op_silu(g[i]) * u[i];
}

static void situ_scalar(float *g, const float *u, int64_t n, float b, float lb) {
    for (int64_t i = 0; i < n; i++) {
        const float a = b * tanhf(g[i] / b) * op_sigmoid(g[i]);
        const float up = lb > 0 ? lb * tanhf(u[i] / lb) : u[i];
        g[i] = a * up;
    }
}

#if (defined(__x86_64__) || defined(__i386__)) && !defined(DF_NO_MVEC)
#define ACT_X86 1
#endif

static kn_level act_level(kn_level lv) {
    if (!kn_level_available(lv)) lv = kn_detect();
    return lv == KN_AMX ? KN_AVX512 : lv;
}

void kn_act_silu_mul(kn_level lv, float *g, const float *u, int64_t n) {
    if (n <= 0) return;
    lv = act_level(lv);
#if ACT_X86
    if (lv == KN_AVX512) { kn_act_silu_mul_avx512(g, u, n); return; }
    if (lv == KN_AVX2) { kn_act_silu_mul_avx2(g, u, n); return; }
#endif
    silu_scalar(g, u, n);
}

void kn_act_situ_mul(kn_level lv, float *g, const float *u, int64_t n, float beta, float linear_beta) {
    if (n <= 0) return;
    lv = act_level(lv);
#if ACT_X86
    if (lv == KN_AVX512) { kn_act_situ_mul_avx512(g, u, n, beta, linear_beta); return; }
    if (lv == KN_AVX2) { kn_act_situ_mul_avx2(g, u, n, beta, linear_beta); return; }
#endif
    situ_scalar(g, u, n, beta, linear_beta);
}
