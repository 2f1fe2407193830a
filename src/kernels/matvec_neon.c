/* matvec_neon.c — AArch64 Advanced SIMD (NEON) matvec/matmul for every weight type.
 *
 * Owns: kn_matmul_neon. Compiled only for AArch64 (the Makefile picks the
 * kernel files by target), where Advanced SIMD is part of the base ISA;
 * kn_detect() still checks AT_HWCAP on Linux. Refuses: allocation, scalar
 * float math on the data path (every product and sum is an explicit
 * intrinsic, so the compiler cannot contract or reorder it), and rounding x
 * to a narrower type.
 *
 * Why only base NEON: the dotprod (SDOT), i8mm (SMMLA) and bf16 (BFDOT,
 * BFMMLA) extensions multiply int8 or bf16 operands, so using them would
 * quantise the fp32 activations; kernels.h promises fp32 products of the
 * exact weight values. They would be a lossy, opt-in mode (named, printed in
 * every stats line), not a faster way to the same numbers, so they are left
 * out. Every code value (f16, bf16, e4m3, int4, e2m1, int8) widens exactly to
 * fp32 with base instructions (shifts, FCVTL, table lookups).
 *
 * Shape of every kernel (as matvec_avx2.c, with 4-lane vectors): a tile of
 * nr rows x nv vectors (NR x 1 for decode, a per-type mr x mv for prefill,
 * 1-row variants of both; the walk is the shared driver, matvec_driver.c)
 * streams its rows once, sharing each x load. Every (row, vector) output
 * owns two accumulators a0/a1 fed in a fixed pattern that depends only on
 * cols (full 8-column steps: a0 gets columns 0-3, a1 columns 4-7; a lone
 * 4-column step goes to a0; the zero-padded tail to a1), then the pairwise
 * sum of a0 + a1. All tiles run the same always-inlined body, so a value
 * does not depend on which tile computed it (the determinism contract in
 * kernels.h).
 *
 * Scaled types keep per-block partials (fp8 block, int4/mxfp4 group of 32)
 * and multiply them by the scale once per block, as the scalar reference
 * does (see matvec.c for the value computed and the shared error bound).
 *
 * Sections: 1. helpers  2. dense (f32 bf16 f16 i8)  3. fp8 block
 *           4. int4 / mxfp4  5. tiles per type
 */
#include "kernels.h"
#include "matvec_driver.h"
#include <arm_neon.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
/* NR rows for one vector (decode); each type's table sets its own rows x
 * vectors for several vectors (prefill), within TR x TV */
enum { NR = 4, NR_L1 = NR /* (no tile-ahead prefetch here) */, TR = 4, TV = 4 };
#define UNROLL _Pragma("GCC unroll 8")

/* ---- 1. helpers ------------------------------------------------------------ */

/* a0 + a1, then the lanes pairwise ((l0 + l1) + (l2 + l3)): a fixed tree. */
AI float hsum2(float32x4_t a0, float32x4_t a1) {
    float32x4_t s = vaddq_f32(a0, a1);
    float32x2_t p = vpadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(vpadd_f32(p, p), 0);
}

/* 8 f16 bit patterns -> 2 x 4 floats (exact: FCVTL widens every f16, subnormals
 * included; FPCR.FZ does not apply to widening conversions of normal inputs
 * and Linux/macOS leave it clear). */
AI void f16x8(uint16x8_t h, float32x4_t *lo, float32x4_t *hi) {
    float16x8_t f = vreinterpretq_f16_u16(h);
    *lo = vcvt_f32_f16(vget_low_f16(f));
    *hi = vcvt_high_f32_f16(f);
}

/* ---- 2. dense (f32 bf16 f16 i8) -------------------------------------------- */

enum { E_F32, E_BF16, E_F16, E_I8 };

AI int esize(int e) { return e == E_F32 ? 4 : e == E_I8 ? 1 : 2; }

/* 8 weights of a row starting at column c, as 2 x 4 floats. */
AI void ld8(int e, const void *p, int64_t c, float32x4_t *lo, float32x4_t *hi) {
    switch (e) {
    case E_F32:
        *lo = vld1q_f32((const float *)p + c);
        *hi = vld1q_f32((const float *)p + c + 4);
        return;
    case E_BF16: {
        uint16x8_t h = vld1q_u16((const uint16_t *)p + c);
        *lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        *hi = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
        return;
    }
    case E_F16: f16x8(vld1q_u16((const uint16_t *)p + c), lo, hi); return;
    default: {
        int16x8_t s = vmovl_s8(vld1_s8((const int8_t *)p + c));
        *lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(s)));
        *hi = vcvtq_f32_s32(vmovl_high_s16(s));
        return;
    }
    }
}

AI void dense_tile(int e, const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X,
                   int64_t ldx, float *Y, int64_t ldy) {
    (void)l1; /* no tile-ahead prefetch at this level */
    const int64_t cols = w->cols;
    const int es = esize(e);
    const char *row[TR];
    float32x4_t a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        row[j] = (const char *)w->data + (r + j) * cols * es;
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = vdupq_n_f32(0.0f);
    }
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        float32x4_t x0[TV], x1[TV]; /* loaded once, shared by the tile's rows */
        UNROLL for (int v = 0; v < nv; v++) {
            x0[v] = vld1q_f32(X + v * ldx + c);
            x1[v] = vld1q_f32(X + v * ldx + c + 4);
        }
        UNROLL for (int j = 0; j < nr; j++) {
            float32x4_t w0, w1;
            ld8(e, row[j], c, &w0, &w1);
            UNROLL for (int v = 0; v < nv; v++) {
                a0[j][v] = vfmaq_f32(a0[j][v], w0, x0[v]);
                a1[j][v] = vfmaq_f32(a1[j][v], w1, x1[v]);
            }
        }
    }
    if (c + 4 <= cols) {
        UNROLL for (int j = 0; j < nr; j++) {
            _Alignas(16) char wt[32] = {0};
            memcpy(wt, row[j] + c * es, (size_t)(4 * es));
            float32x4_t w0, w1;
            ld8(e, wt, 0, &w0, &w1);
            UNROLL for (int v = 0; v < nv; v++) a0[j][v] = vfmaq_f32(a0[j][v], w0, vld1q_f32(X + v * ldx + c));
        }
        c += 4;
    }
    if (c < cols) {
        float xt[TV][4];
        UNROLL for (int v = 0; v < nv; v++) {
            memset(xt[v], 0, sizeof xt[v]);
            memcpy(xt[v], X + v * ldx + c, (size_t)(cols - c) * sizeof(float));
        }
        UNROLL for (int j = 0; j < nr; j++) {
            _Alignas(16) char wt[32] = {0};
            memcpy(wt, row[j] + c * es, (size_t)((cols - c) * es));
            float32x4_t w0, w1;
            ld8(e, wt, 0, &w0, &w1);
            UNROLL for (int v = 0; v < nv; v++) a1[j][v] = vfmaq_f32(a1[j][v], w0, vld1q_f32(xt[v]));
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++) {
        float s = hsum2(a0[j][v], a1[j][v]);
        /* row scale after the sum, as a vector op so it is never contracted */
        if (e == E_I8)
            s = vget_lane_f32(vmul_f32(vdup_n_f32(s), vdup_n_f32(((const float *)w->scale)[r + j])), 0);
        Y[v * ldy + j] = s;
    }
}

/* ---- 3. fp8 block ---------------------------------------------------------- */

/* 8 e4m3 bytes -> 2 x 4 floats equal to the fp8 values times 2^-8: each byte
 * re-packed as f16 bits (sign to bit 15, exponent+mantissa to bits 13..7;
 * f16's bias is 8 more than e4m3's and subnormals map to subnormals), then
 * widened. The NaN codes (0x7f, 0xff) become an f16 NaN. */
AI void fp8_8(uint8x8_t b, float32x4_t *lo, float32x4_t *hi) {
    int16x8_t s = vmovl_s8(vreinterpret_s8_u8(b)); /* sign-extend: bits 15..8 = sign */
    uint16x8_t h = vandq_u16(vshlq_n_u16(vreinterpretq_u16_s16(s), 7), vdupq_n_u16(0xbfff));
    uint8x8_t nan8 = vceq_u8(vand_u8(b, vdup_n_u8(0x7f)), vdup_n_u8(0x7f));
    uint16x8_t nan = vreinterpretq_u16_s16(vmovl_s8(vreinterpret_s8_u8(nan8)));
    h = vbslq_u16(nan, vdupq_n_u16(0x7e00), h);
    f16x8(h, lo, hi);
}

/* Per block of bc columns and row: partials p0/p1 of (fp8 * 2^-8) * x in the
 * a0/a1 pattern above (restarted per block), then a += p * (scale * 2^8).
 * scale * 2^8 is exact unless it overflows (|s| >= 2^120, never in real
 * checkpoints), where p * 2^8 (exact) times s is used. */
AI void fp8_tile(const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    (void)l1; /* no tile-ahead prefetch at this level */
    const int64_t cols = w->cols, bc = w->block_cols;
    const int64_t nbc = (cols + bc - 1) / bc;
    const uint8_t *q[TR];
    const float *sc[TR];
    float32x4_t a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * cols;
        sc[j] = (const float *)w->scale + ((r + j) / w->block_rows) * nbc;
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = vdupq_n_f32(0.0f);
    }
    for (int64_t cb = 0; cb < nbc; cb++) {
        const int64_t c0 = cb * bc, c1 = c0 + bc < cols ? c0 + bc : cols;
        float32x4_t p0[TR][TV], p1[TR][TV];
        UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++) p0[j][v] = p1[j][v] = vdupq_n_f32(0.0f);
        int64_t c = c0;
        for (; c + 8 <= c1; c += 8) {
            float32x4_t x0[TV], x1[TV];
            UNROLL for (int v = 0; v < nv; v++) {
                x0[v] = vld1q_f32(X + v * ldx + c);
                x1[v] = vld1q_f32(X + v * ldx + c + 4);
            }
            UNROLL for (int j = 0; j < nr; j++) {
                float32x4_t lo, hi;
                fp8_8(vld1_u8(q[j] + c), &lo, &hi);
                UNROLL for (int v = 0; v < nv; v++) {
                    p0[j][v] = vfmaq_f32(p0[j][v], lo, x0[v]);
                    p1[j][v] = vfmaq_f32(p1[j][v], hi, x1[v]);
                }
            }
        }
        if (c + 4 <= c1) {
            UNROLL for (int j = 0; j < nr; j++) {
                uint8_t bt[8] = {0};
                memcpy(bt, q[j] + c, 4);
                float32x4_t lo, hi;
                fp8_8(vld1_u8(bt), &lo, &hi);
                UNROLL for (int v = 0; v < nv; v++) p0[j][v] = vfmaq_f32(p0[j][v], lo, vld1q_f32(X + v * ldx + c));
            }
            c += 4;
        }
        if (c < c1) {
            float xt[TV][4];
            UNROLL for (int v = 0; v < nv; v++) {
                memset(xt[v], 0, sizeof xt[v]);
                memcpy(xt[v], X + v * ldx + c, (size_t)(c1 - c) * sizeof(float));
            }
            UNROLL for (int j = 0; j < nr; j++) {
                uint8_t bt[8] = {0};
                memcpy(bt, q[j] + c, (size_t)(c1 - c));
                float32x4_t lo, hi;
                fp8_8(vld1_u8(bt), &lo, &hi);
                UNROLL for (int v = 0; v < nv; v++) p1[j][v] = vfmaq_f32(p1[j][v], lo, vld1q_f32(xt[v]));
            }
        }
        UNROLL for (int j = 0; j < nr; j++) {
            const float f = sc[j][cb];
            const float32x4_t s = vdupq_n_f32(f);
            UNROLL for (int v = 0; v < nv; v++) {
                if (f < 0x1p120f && f > -0x1p120f) {
                    const float32x4_t s256 = vmulq_n_f32(s, 256.0f);
                    a0[j][v] = vfmaq_f32(a0[j][v], p0[j][v], s256);
                    a1[j][v] = vfmaq_f32(a1[j][v], p1[j][v], s256);
                } else {
                    a0[j][v] = vfmaq_f32(a0[j][v], vmulq_n_f32(p0[j][v], 256.0f), s);
                    a1[j][v] = vfmaq_f32(a1[j][v], vmulq_n_f32(p1[j][v], 256.0f), s);
                }
            }
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++)
        Y[v * ldy + j] = hsum2(a0[j][v], a1[j][v]);
}

/* ---- 4. int4 / mxfp4 ------------------------------------------------------- */

enum { N_I4_BF16, N_I4_F16, N_I4_F32, N_MX };

/* A group's scale as fp32, exactly as the scalar reference decodes it. */
AI float group_scale(int k, const void *scale, int64_t i) {
    switch (k) {
    case N_I4_BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)scale)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case N_I4_F16: {
        float16x4_t h = vreinterpret_f16_u16(vdup_n_u16(((const uint16_t *)scale)[i]));
        return vgetq_lane_f32(vcvt_f32_f16(h), 0);
    }
    case N_I4_F32: return ((const float *)scale)[i];
    default: { /* e8m0: 0 -> 2^-127 (a subnormal), 255 -> NaN */
        uint32_t e = ((const uint8_t *)scale)[i];
        uint32_t u = e == 0 ? 0x00400000u : e == 255 ? 0x7fc00000u : e << 23;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    }
}

/* A 32-column group is 16 bytes: low nibbles are the even columns, high
 * nibbles the odd ones. Every code value (int4 q - 8 in -8..7, e2m1) is an
 * f16 whose low byte is 0, so TBL maps nibbles straight to f16 high bytes;
 * ZIP with a zero vector makes them f16 words and FCVTL widens them. The even
 * and odd columns stay apart, and x is loaded to match with LD2 (which
 * de-interleaves), so no permuted copy of x is needed. Per group and row:
 * partials p0 (even columns) and p1 (odd), then a += p * scale. */
AI void nib_tile(int k, const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    (void)l1; /* no tile-ahead prefetch at this level */
    const int64_t cols = w->cols, ng = cols / 32;
    static const uint8_t tab_mx[16] = {0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46, /* 0 .5 1 1.5 2 3 4 6 */
                                       0x80, 0xb8, 0xbc, 0xbe, 0xc0, 0xc2, 0xc4, 0xc6};
    static const uint8_t tab_i4[16] = {0xc8, 0xc7, 0xc6, 0xc5, 0xc4, 0xc2, 0xc0, 0xbc, /* -8 .. -1 */
                                       0x00, 0x3c, 0x40, 0x42, 0x44, 0x45, 0x46, 0x47}; /* 0 .. 7 */
    const uint8x16_t tab = vld1q_u8(k == N_MX ? tab_mx : tab_i4);
    const uint8x16_t m0f = vdupq_n_u8(0x0f), zero = vdupq_n_u8(0);
    const uint8_t *q[TR];
    float32x4_t a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * (cols / 2);
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = vdupq_n_f32(0.0f);
    }
    for (int64_t g = 0; g < ng; g++) {
        const int64_t c = g * 32;
        /* xe[i]: columns c + 8i + {0,2,4,6}; xo[i]: c + 8i + {1,3,5,7} */
        float32x4x2_t v0[TV], v1[TV], v2[TV], v3[TV];
        UNROLL for (int v = 0; v < nv; v++) {
            const float *x = X + v * ldx + c;
            v0[v] = vld2q_f32(x), v1[v] = vld2q_f32(x + 8), v2[v] = vld2q_f32(x + 16), v3[v] = vld2q_f32(x + 24);
        }
        UNROLL for (int j = 0; j < nr; j++) {
            uint8x16_t b = vld1q_u8(q[j] + c / 2);
            uint8x16_t tl = vqtbl1q_u8(tab, vandq_u8(b, m0f)); /* columns 0, 2, .., 30 */
            uint8x16_t th = vqtbl1q_u8(tab, vshrq_n_u8(b, 4));  /* columns 1, 3, .., 31 */
            float32x4_t e0, e1, e2, e3, o0, o1, o2, o3;
            f16x8(vreinterpretq_u16_u8(vzip1q_u8(zero, tl)), &e0, &e1);
            f16x8(vreinterpretq_u16_u8(vzip2q_u8(zero, tl)), &e2, &e3);
            f16x8(vreinterpretq_u16_u8(vzip1q_u8(zero, th)), &o0, &o1);
            f16x8(vreinterpretq_u16_u8(vzip2q_u8(zero, th)), &o2, &o3);
            const float32x4_t s = vdupq_n_f32(group_scale(k, w->scale, (r + j) * ng + g));
            UNROLL for (int v = 0; v < nv; v++) {
                float32x4_t p0 = vmulq_f32(e0, v0[v].val[0]);
                p0 = vfmaq_f32(p0, e1, v1[v].val[0]);
                p0 = vfmaq_f32(p0, e2, v2[v].val[0]);
                p0 = vfmaq_f32(p0, e3, v3[v].val[0]);
                float32x4_t p1 = vmulq_f32(o0, v0[v].val[1]);
                p1 = vfmaq_f32(p1, o1, v1[v].val[1]);
                p1 = vfmaq_f32(p1, o2, v2[v].val[1]);
                p1 = vfmaq_f32(p1, o3, v3[v].val[1]);
                a0[j][v] = vfmaq_f32(a0[j][v], p0, s);
                a1[j][v] = vfmaq_f32(a1[j][v], p1, s);
            }
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++)
        Y[v * ldy + j] = hsum2(a0[j][v], a1[j][v]);
}

/* ---- 5. tiles per type ----------------------------------------------------- */

/* rows x vectors for prefill within the 32 registers (unmeasured: no ARM64
 * machine here); x stays in the caller's order (LD2 de-interleaves) */
enum { D_MR = 4, D_MV = 2, F_MR = 2, F_MV = 2, N_MR = 1, N_MV = 2 };
KN_LEVEL(kn_matmul_neon, NULL, NULL, NULL)

/* FMA throughput probe (kn_fma_loop): ACC independent chains of `iters`
 * FMAs; returns the flops done, with a result in *sink so none is dead. */
double kn_fma_loop_neon(int64_t iters, float *sink) {
    enum { ACC = 16 };
    float32x4_t a[ACC];
    const float32x4_t m = vdupq_n_f32(0.999999f), k = vdupq_n_f32(1e-7f);
    _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) a[i] = vdupq_n_f32(1.0f + (float)i);
    for (int64_t it = 0; it < iters; it++)
        _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) a[i] = vfmaq_f32(k, a[i], m);
    float32x4_t t = a[0];
    _Pragma("GCC unroll 16") for (int i = 1; i < ACC; i++) t = vaddq_f32(t, a[i]);
    *sink = vaddvq_f32(t);
    return 2.0 * ACC * 4 * (double)iters;
}
