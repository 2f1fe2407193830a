/* ops_neon.c — AArch64 NEON forms of the vector ops that sit in attention's
 * inner loops (see ops.h), bit-identical to the plain C ones.
 *
 * Owns: op_axpy_neon. Compiled only for AArch64 (the Makefile picks *_neon.c
 * by target); ops.c calls it there. Refuses anything that would change a
 * single bit: every lane computes exactly the scalar y[i] + a * x[i] (a
 * multiply, then an add, never fused: -ffp-contract=off keeps the plain C
 * loop unfused too), so decode, prefill and every thread count still agree.
 * op_dot needs no hand-written form: its four fixed partial sums are what
 * gcc already emits as one 4-lane multiply-add loop (fmul/fadd .4s).
 * The ops that accumulate in double (RMSNorm, softmax) or call expf (SiLU)
 * stay scalar: vectorising them would change their summation order or their
 * rounding.
 */
#include "ops.h"
#include <arm_neon.h>

void op_axpy_neon(float *y, float a, const float *x, int n) {
    const float32x4_t va = vdupq_n_f32(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        float32x4_t y0 = vaddq_f32(vld1q_f32(y + i), vmulq_f32(va, vld1q_f32(x + i)));
        float32x4_t y1 = vaddq_f32(vld1q_f32(y + i + 4), vmulq_f32(va, vld1q_f32(x + i + 4)));
        vst1q_f32(y + i, y0);
        vst1q_f32(y + i + 4, y1);
    }
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vaddq_f32(vld1q_f32(y + i), vmulq_f32(va, vld1q_f32(x + i))));
    for (; i < n; i++) y[i] += a * x[i];
}
