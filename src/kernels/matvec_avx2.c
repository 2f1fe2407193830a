/* matvec_avx2.c — AVX2 + FMA + F16C matvec/matmul for every weight type.
 *
 * Owns: kn_matmul_avx2. Compiled with -mavx2 -mfma -mf16c; only reached when
 * kn_detect() says the CPU has them. Refuses: allocation, scalar float math on
 * the data path (every product and sum is an explicit intrinsic, so the
 * compiler cannot contract or reorder it).
 *
 * Shape of every kernel: a tile of NR = 4 rows (or 1 for the leftover rows)
 * streams its rows once, sharing each x load. Every row owns two accumulators
 * a0/a1 fed in a fixed pattern that depends only on cols (full 16-column
 * steps: a0 gets columns 0-7, a1 columns 8-15; a lone 8-column step goes to
 * a0; the zero-padded tail to a1), then hsum(a0 + a1). The 4-row and 1-row
 * tiles run the same always-inlined body, so a row's value does not depend
 * on which tile computed it (the determinism contract in kernels.h).
 *
 * Scaled types (fp8 blocks, int4/mxfp4 groups) keep per-block partials in
 * the same two-lane-set pattern and multiply them by the scale once per block
 * (see matvec.c for the value computed).
 *
 * Sections: 1. helpers  2. dense (f32 bf16 f16 i8)  3. fp8 block
 *           4. int4 / mxfp4  5. driver
 */
#include "kernels.h"
#include "../base/err.h"
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
enum { NR = 4, XP_STACK = 8192 };
/* Full unrolling of the per-row loops keeps the accumulator arrays in registers. */
#define UNROLL _Pragma("GCC unroll 4")

/* ---- 1. helpers ------------------------------------------------------------ */

AI float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* Tail of n < 16 columns: x padded with zeros (weights past the end are
 * padded too, so every padded lane adds exactly +0 * 0). */
AI void pad_x(const float *x, int64_t n, float *xt) {
    memset(xt, 0, 16 * sizeof *xt);
    memcpy(xt, x, (size_t)n * sizeof *xt);
}

/* ---- 2. dense (f32 bf16 f16 i8) -------------------------------------------- */

enum { E_F32, E_BF16, E_F16, E_I8 };

AI int esize(int e) { return e == E_F32 ? 4 : e == E_I8 ? 1 : 2; }

/* 8 weights of row p starting at column c, as fp32. */
AI __m256 ld8(int e, const void *p, int64_t c) {
    switch (e) {
    case E_F32: return _mm256_loadu_ps((const float *)p + c);
    case E_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + c));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case E_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + c)));
    default: {
        __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)p + c));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    }
}

AI void dense_tile(int e, const df_weight *w, int64_t r, int nr, const float *x, float *y) {
    const int64_t cols = w->cols;
    const int es = esize(e);
    const char *row[NR];
    __m256 a0[NR], a1[NR];
    UNROLL for (int j = 0; j < nr; j++) {
        row[j] = (const char *)w->data + (r + j) * cols * es;
        a0[j] = a1[j] = _mm256_setzero_ps();
    }
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
        UNROLL for (int j = 0; j < nr; j++) {
            a0[j] = _mm256_fmadd_ps(ld8(e, row[j], c), x0, a0[j]);
            a1[j] = _mm256_fmadd_ps(ld8(e, row[j], c + 8), x1, a1[j]);
        }
    }
    if (c + 8 <= cols) {
        __m256 x0 = _mm256_loadu_ps(x + c);
        UNROLL for (int j = 0; j < nr; j++) a0[j] = _mm256_fmadd_ps(ld8(e, row[j], c), x0, a0[j]);
        c += 8;
    }
    if (c < cols) {
        float xt[16];
        pad_x(x + c, cols - c, xt);
        __m256 x1 = _mm256_loadu_ps(xt);
        UNROLL for (int j = 0; j < nr; j++) {
            _Alignas(32) char wt[32] = {0};
            memcpy(wt, row[j] + c * es, (size_t)((cols - c) * es));
            a1[j] = _mm256_fmadd_ps(ld8(e, wt, 0), x1, a1[j]);
        }
    }
    UNROLL for (int j = 0; j < nr; j++) {
        float s = hsum8(_mm256_add_ps(a0[j], a1[j]));
        if (e == E_I8) {
            /* row scale after the sum, as a vector op so it is never contracted */
            __m128 v = _mm_mul_ss(_mm_set_ss(s), _mm_set_ss(((const float *)w->scale)[r + j]));
            s = _mm_cvtss_f32(v);
        }
        y[j] = s;
    }
}

/* ---- 3. fp8 block ---------------------------------------------------------- */

/* 16 e4m3 bytes -> 2 x 8 floats equal to the fp8 values times 2^-8: each byte
 * re-packed as f16 bits (sign to bit 15, exponent+mantissa to bits 13..7;
 * f16's bias is 8 more than e4m3's and subnormals map to subnormals), then
 * vcvtph2ps. The NaN codes (0x7f, 0xff) decode as 480 here; fp8_tile tracks
 * them separately. */
AI void fp8_16(__m128i b, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepi8_epi16(b); /* sign-extend: bits 15..8 = sign */
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbfff));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* Per block of bc columns and row: partials p0/p1 of (fp8 * 2^-8) * x, then
 * a += p * (scale * 2^8). scale * 2^8 is exact unless it overflows (|s| >=
 * 2^120, never in real checkpoints), where p * 2^8 (exact) times s is used. */
AI void fp8_tile(const df_weight *w, int64_t r, int nr, const float *x, float *y) {
    const int64_t cols = w->cols, bc = w->block_cols;
    const int64_t nbc = (cols + bc - 1) / bc;
    const __m128i m7f = _mm_set1_epi8(0x7f);
    const uint8_t *q[NR];
    const float *sc[NR];
    __m256 a0[NR], a1[NR];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * cols;
        sc[j] = (const float *)w->scale + ((r + j) / w->block_rows) * nbc;
        a0[j] = a1[j] = _mm256_setzero_ps();
    }
    for (int64_t cb = 0; cb < nbc; cb++) {
        const int64_t c0 = cb * bc, c1 = c0 + bc < cols ? c0 + bc : cols;
        __m256 p0[NR], p1[NR];
        __m128i mx[NR]; /* running max of (byte & 0x7f): 0x7f means a NaN code */
        UNROLL for (int j = 0; j < nr; j++) {
            p0[j] = p1[j] = _mm256_setzero_ps();
            mx[j] = _mm_setzero_si128();
        }
        int64_t c = c0;
        for (; c + 16 <= c1; c += 16) {
            __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(q[j] + c));
                __m256 lo, hi;
                fp8_16(b, &lo, &hi);
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                p0[j] = _mm256_fmadd_ps(lo, x0, p0[j]);
                p1[j] = _mm256_fmadd_ps(hi, x1, p1[j]);
            }
        }
        if (c + 8 <= c1) {
            __m256 x0 = _mm256_loadu_ps(x + c);
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(q[j] + c));
                __m256 lo, hi;
                fp8_16(b, &lo, &hi);
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                p0[j] = _mm256_fmadd_ps(lo, x0, p0[j]);
            }
            c += 8;
        }
        if (c < c1) {
            float xt[16];
            pad_x(x + c, c1 - c, xt);
            __m256 x1 = _mm256_loadu_ps(xt);
            UNROLL for (int j = 0; j < nr; j++) {
                uint8_t bt[16] = {0};
                memcpy(bt, q[j] + c, (size_t)(c1 - c));
                __m128i b = _mm_loadu_si128((const __m128i *)bt);
                __m256 lo, hi;
                fp8_16(b, &lo, &hi);
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                p1[j] = _mm256_fmadd_ps(lo, x1, p1[j]);
            }
        }
        UNROLL for (int j = 0; j < nr; j++) {
            const float f = sc[j][cb];
            const __m256 s = _mm256_set1_ps(f), k256 = _mm256_set1_ps(256.0f);
            if (_mm_movemask_epi8(_mm_cmpeq_epi8(mx[j], m7f))) p0[j] = _mm256_set1_ps(__builtin_nanf(""));
            if (f < 0x1p120f && f > -0x1p120f) {
                const __m256 s256 = _mm256_mul_ps(s, k256);
                a0[j] = _mm256_fmadd_ps(p0[j], s256, a0[j]);
                a1[j] = _mm256_fmadd_ps(p1[j], s256, a1[j]);
            } else {
                a0[j] = _mm256_fmadd_ps(_mm256_mul_ps(p0[j], k256), s, a0[j]);
                a1[j] = _mm256_fmadd_ps(_mm256_mul_ps(p1[j], k256), s, a1[j]);
            }
        }
    }
    UNROLL for (int j = 0; j < nr; j++) y[j] = hsum8(_mm256_add_ps(a0[j], a1[j]));
}

/* ---- 4. int4 / mxfp4 ------------------------------------------------------- */

enum { N_I4_BF16, N_I4_F16, N_I4_F32, N_MX };

/* A 32-column group is 16 bytes. Every code value (int4 q - 8 in -8..7, e2m1)
 * is an f16 whose low byte is 0, so vpshufb maps nibbles straight to f16 high
 * bytes: tl = codes of columns 2k (low nibbles), th = columns 2k+1. Read as
 * 16-bit words, tl << 8 holds columns 4m, tl & 0xff00 columns 4m+2 (and th
 * likewise 4m+1, 4m+3), ready for vcvtph2ps without any byte shuffling. x
 * arrives pre-permuted to match (nib_permute_x). Per group and row: partials
 * p0 (columns 4m, 4m+2) and p1 (4m+1, 4m+3), then a += p * scale. */
AI void nib_tile(int k, const df_weight *w, int64_t r, int nr, const float *xp, float *y) {
    const int64_t cols = w->cols, ng = cols / 32;
    const uint8_t *q[NR];
    int64_t si[NR];
    __m256 a0[NR], a1[NR];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * (cols / 2);
        si[j] = (r + j) * ng;
        a0[j] = a1[j] = _mm256_setzero_ps();
    }
    const __m128i tab = k == N_MX
        ? _mm_setr_epi8(0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46, /* 0 .5 1 1.5 2 3 4 6 */
                        (char)0x80, (char)0xb8, (char)0xbc, (char)0xbe, (char)0xc0, (char)0xc2,
                        (char)0xc4, (char)0xc6)
        : _mm_setr_epi8((char)0xc8, (char)0xc7, (char)0xc6, (char)0xc5, (char)0xc4, (char)0xc2,
                        (char)0xc0, (char)0xbc, /* -8 .. -1 */
                        0x00, 0x3c, 0x40, 0x42, 0x44, 0x45, 0x46, 0x47); /* 0 .. 7 */
    const __m128i m0f = _mm_set1_epi8(0x0f), hi8 = _mm_set1_epi16((short)0xff00);
    /* group scales are decoded 8 groups at a time per row, in vectors: e8m0
     * by exponent construction (0 -> 2^-127 and 255 -> NaN, as the scalar
     * reference), bf16 by a shift, f16 by vcvtph2ps */
    float sbuf[NR][8];
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    for (int64_t g = 0; g < ng; g++) {
        const int64_t c = g * 32;
        if ((g & 7) == 0) {
            UNROLL for (int j = 0; j < nr; j++) {
                const uint8_t *sp = (const uint8_t *)w->scale + (si[j] + g) * ssz;
                uint8_t tmp[32] = {0};
                if (g + 8 > ng) {
                    memcpy(tmp, sp, (size_t)((ng - g) * ssz));
                    sp = tmp;
                }
                __m256 v;
                if (k == N_MX) {
                    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sp));
                    __m256i bits = _mm256_slli_epi32(e, 23);
                    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000),
                                              _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
                    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000),
                                              _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
                    v = _mm256_castsi256_ps(bits);
                } else if (k == N_I4_BF16) {
                    v = _mm256_castsi256_ps(
                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)sp)), 16));
                } else if (k == N_I4_F16) {
                    v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sp));
                } else {
                    v = _mm256_loadu_ps((const float *)sp);
                }
                _mm256_storeu_ps(sbuf[j], v);
            }
        }
        __m256 x0 = _mm256_loadu_ps(xp + c), x1 = _mm256_loadu_ps(xp + c + 8);
        __m256 x2 = _mm256_loadu_ps(xp + c + 16), x3 = _mm256_loadu_ps(xp + c + 24);
        UNROLL for (int j = 0; j < nr; j++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(q[j] + c / 2));
            __m128i tl = _mm_shuffle_epi8(tab, _mm_and_si128(b, m0f));
            __m128i th = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(b, 4), m0f));
            __m256 w0 = _mm256_cvtph_ps(_mm_slli_epi16(tl, 8));    /* cols 4m */
            __m256 w1 = _mm256_cvtph_ps(_mm_slli_epi16(th, 8));    /* 4m+1 */
            __m256 w2 = _mm256_cvtph_ps(_mm_and_si128(tl, hi8));   /* 4m+2 */
            __m256 w3 = _mm256_cvtph_ps(_mm_and_si128(th, hi8));   /* 4m+3 */
            __m256 p0 = _mm256_fmadd_ps(w2, x2, _mm256_mul_ps(w0, x0));
            __m256 p1 = _mm256_fmadd_ps(w3, x3, _mm256_mul_ps(w1, x1));
            __m256 s = _mm256_broadcast_ss(&sbuf[j][g & 7]);
            a0[j] = _mm256_fmadd_ps(p0, s, a0[j]);
            a1[j] = _mm256_fmadd_ps(p1, s, a1[j]);
        }
    }
    UNROLL for (int j = 0; j < nr; j++) y[j] = hsum8(_mm256_add_ps(a0[j], a1[j]));
}

/* xp[32g + 8p + m] = x[32g + 4m + p]: the column order nib_tile's vectors use. */
static void nib_permute_x(const float *x, int64_t cols, float *xp) {
    for (int64_t g = 0; g < cols; g += 32)
        for (int p = 0; p < 4; p++)
            for (int m = 0; m < 8; m++) xp[g + 8 * p + m] = x[g + 4 * m + p];
}

/* ---- 5. driver ------------------------------------------------------------- */

typedef void (*tile_fn)(const df_weight *w, int64_t r, const float *x, float *y);

#define INST(name, call)                                                                   \
    static void name##_4(const df_weight *w, int64_t r, const float *x, float *y) {         \
        call(w, r, NR, x, y);                                                              \
    }                                                                                      \
    static void name##_1(const df_weight *w, int64_t r, const float *x, float *y) {         \
        call(w, r, 1, x, y);                                                               \
    }

#define DENSE(e) AI void dense_##e(const df_weight *w, int64_t r, int nr, const float *x, float *y) { dense_tile(e, w, r, nr, x, y); }
#define NIB(k) AI void nib_##k(const df_weight *w, int64_t r, int nr, const float *x, float *y) { nib_tile(k, w, r, nr, x, y); }
DENSE(E_F32)
DENSE(E_BF16)
DENSE(E_F16)
DENSE(E_I8)
NIB(N_I4_BF16)
NIB(N_I4_F16)
NIB(N_I4_F32)
NIB(N_MX)
INST(f32, dense_E_F32)
INST(bf16, dense_E_BF16)
INST(f16, dense_E_F16)
INST(i8, dense_E_I8)
INST(fp8, fp8_tile)
INST(i4b, nib_N_I4_BF16)
INST(i4h, nib_N_I4_F16)
INST(i4f, nib_N_I4_F32)
INST(mx, nib_N_MX)

int kn_matmul_avx2(const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                   int64_t row0, int64_t row1) {
    tile_fn f4, f1;
    int64_t row_bytes;
    switch (w->type) {
    case WT_F32: f4 = f32_4, f1 = f32_1, row_bytes = w->cols * 4; break;
    case WT_BF16: f4 = bf16_4, f1 = bf16_1, row_bytes = w->cols * 2; break;
    case WT_F16: f4 = f16_4, f1 = f16_1, row_bytes = w->cols * 2; break;
    case WT_I8_ROW: f4 = i8_4, f1 = i8_1, row_bytes = w->cols; break;
    case WT_FP8_BLOCK: f4 = fp8_4, f1 = fp8_1, row_bytes = w->cols; break;
    case WT_MXFP4: f4 = mx_4, f1 = mx_1, row_bytes = w->cols / 2; break;
    case WT_INT4_G32:
        row_bytes = w->cols / 2;
        switch (w->scale_dtype) {
        case DT_BF16: f4 = i4b_4, f1 = i4b_1; break;
        case DT_F16: f4 = i4h_4, f1 = i4h_1; break;
        case DT_F32: f4 = i4f_4, f1 = i4f_1; break;
        default: return 0;
        }
        break;
    default: return 0;
    }
    /* Row blocks of ~256 KB stay in L2 while every vector of X passes over
     * them; with n == 1 this is just the plain row loop. */
    int64_t rb = (256 << 10) / (row_bytes > 0 ? row_bytes : 1);
    rb = rb < NR ? NR : rb / NR * NR;
    /* int4 / mxfp4 read x in nib_tile's column order: a stack copy for the
     * usual widths, the heap past them (the values are the same either way). */
    const int nib = w->type == WT_INT4_G32 || w->type == WT_MXFP4;
    float xstack[XP_STACK], *xp = xstack;
    if (nib && w->cols > XP_STACK) {
        xp = malloc((size_t)w->cols * sizeof *xp);
        ASSERT(xp);
    }
    for (int64_t b0 = row0; b0 < row1; b0 += rb) {
        const int64_t b1 = b0 + rb < row1 ? b0 + rb : row1;
        for (int i = 0; i < n; i++) {
            const float *x = X + (int64_t)i * w->cols;
            if (nib) {
                nib_permute_x(x, w->cols, xp);
                x = xp;
            }
            float *y = Y + (int64_t)i * ldy;
            int64_t r = b0;
            for (; r + NR <= b1; r += NR) f4(w, r, x, y + (r - row0));
            for (; r < b1; r++) f1(w, r, x, y + (r - row0));
        }
    }
    if (xp != xstack) free(xp);
    return 1;
}
