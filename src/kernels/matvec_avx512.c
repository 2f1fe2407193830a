/* matvec_avx512.c — AVX-512 (F BW VL DQ) matvec/matmul for every weight type.
 *
 * Owns: kn_matmul_avx512. Compiled with the Makefile's AVX512_FLAGS; only
 * reached when kn_detect() found all of them. Refuses: allocation, scalar
 * float math on the data path, and VNNI/BF16 dot instructions (vdpbf16ps
 * would round x to bf16, which changes the model's math).
 *
 * Same shape as matvec_avx2.c with 16 lanes: a tile of NR = 4 rows (or 1)
 * shares each x load; each row has accumulators a0/a1 fed in a pattern that
 * depends only on cols (32-column steps: a0 columns 0-15, a1 16-31; a lone
 * 16-column step to a0; the masked tail to a1; fp8 keeps per-block partials
 * in the same pattern and scales them once per block), then hsum(a0 + a1). Masked
 * loads zero the lanes past the end, so tails need no copies.
 *
 * Nibble types: one 32-column group is 16 bytes; vpmovzxbd puts byte k in
 * lane k, vpermps (which reads only the low 4 index bits) looks the low nibble
 * (even column) up in a 16-entry table already multiplied by the group's
 * scale, and the byte shifted right by 4 (odd column) likewise; x is split
 * into even/odd halves with vpermt2ps once per tile.
 *
 * Sections: 1. helpers  2. dense (f32 bf16 f16 i8)  3. fp8 block
 *           4. int4 / mxfp4  5. driver
 */
#include "kernels.h"
#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
enum { NR = 4 };
/* Full unrolling of the per-row loops keeps the accumulator arrays in registers. */
#define UNROLL _Pragma("GCC unroll 4")

/* ---- 1. helpers ------------------------------------------------------------ */

AI float hsum16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

AI __mmask16 tailmask(int64_t n) { return (__mmask16)((1u << n) - 1u); } /* 0 < n < 16 */

/* ---- 2. dense (f32 bf16 f16 i8) -------------------------------------------- */

enum { E_F32, E_BF16, E_F16, E_I8 };

AI int esize(int e) { return e == E_F32 ? 4 : e == E_I8 ? 1 : 2; }

/* 16 weights of row p from column c as fp32; lanes outside k read as 0. */
AI __m512 ld16(int e, const void *p, int64_t c, __mmask16 k, int masked) {
    switch (e) {
    case E_F32: {
        const float *f = (const float *)p + c;
        return masked ? _mm512_maskz_loadu_ps(k, f) : _mm512_loadu_ps(f);
    }
    case E_BF16: {
        const uint16_t *h = (const uint16_t *)p + c;
        __m256i v = masked ? _mm256_maskz_loadu_epi16(k, h) : _mm256_loadu_si256((const __m256i *)h);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    case E_F16: {
        const uint16_t *h = (const uint16_t *)p + c;
        __m256i v = masked ? _mm256_maskz_loadu_epi16(k, h) : _mm256_loadu_si256((const __m256i *)h);
        return _mm512_cvtph_ps(v);
    }
    default: {
        const int8_t *b = (const int8_t *)p + c;
        __m128i v = masked ? _mm_maskz_loadu_epi8(k, b) : _mm_loadu_si128((const __m128i *)b);
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
    }
    }
}

AI void dense_tile(int e, const df_weight *w, int64_t r, int nr, const float *x, float *y) {
    const int64_t cols = w->cols;
    const int es = esize(e);
    const char *row[NR];
    __m512 a0[NR], a1[NR];
    UNROLL for (int j = 0; j < nr; j++) {
        row[j] = (const char *)w->data + (r + j) * cols * es;
        a0[j] = a1[j] = _mm512_setzero_ps();
    }
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
        UNROLL for (int j = 0; j < nr; j++) {
            a0[j] = _mm512_fmadd_ps(ld16(e, row[j], c, 0, 0), x0, a0[j]);
            a1[j] = _mm512_fmadd_ps(ld16(e, row[j], c + 16, 0, 0), x1, a1[j]);
        }
    }
    if (c + 16 <= cols) {
        __m512 x0 = _mm512_loadu_ps(x + c);
        UNROLL for (int j = 0; j < nr; j++) a0[j] = _mm512_fmadd_ps(ld16(e, row[j], c, 0, 0), x0, a0[j]);
        c += 16;
    }
    if (c < cols) {
        __mmask16 k = tailmask(cols - c);
        __m512 x1 = _mm512_maskz_loadu_ps(k, x + c);
        UNROLL for (int j = 0; j < nr; j++) a1[j] = _mm512_fmadd_ps(ld16(e, row[j], c, k, 1), x1, a1[j]);
    }
    UNROLL for (int j = 0; j < nr; j++) {
        float s = hsum16(_mm512_add_ps(a0[j], a1[j]));
        if (e == E_I8) {
            __m128 v = _mm_mul_ss(_mm_set_ss(s), _mm_set_ss(((const float *)w->scale)[r + j]));
            s = _mm_cvtss_f32(v);
        }
        y[j] = s;
    }
}

/* ---- 3. fp8 block ---------------------------------------------------------- */

/* 16 e4m3 bytes -> 16 floats equal to the fp8 values times 2^-8 (re-packed as
 * f16 bits, see matvec_avx2.c). NaN codes decode as 480; fp8_tile tracks them. */
AI __m512 fp8_16(__m128i b) {
    __m256i h = _mm256_cvtepi8_epi16(b);
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbfff));
    return _mm512_cvtph_ps(h);
}

/* Per block and row: partials p0/p1 of (fp8 * 2^-8) * x, then a += p * (s * 2^8)
 * (or (p * 2^8) * s when s * 2^8 would overflow), as in matvec_avx2.c. */
AI void fp8_tile(const df_weight *w, int64_t r, int nr, const float *x, float *y) {
    const int64_t cols = w->cols, bc = w->block_cols;
    const int64_t nbc = (cols + bc - 1) / bc;
    const __m128i m7f = _mm_set1_epi8(0x7f);
    const uint8_t *q[NR];
    const float *sc[NR];
    __m512 a0[NR], a1[NR];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * cols;
        sc[j] = (const float *)w->scale + ((r + j) / w->block_rows) * nbc;
        a0[j] = a1[j] = _mm512_setzero_ps();
    }
    for (int64_t cb = 0; cb < nbc; cb++) {
        const int64_t c0 = cb * bc, c1 = c0 + bc < cols ? c0 + bc : cols;
        __m512 p0[NR], p1[NR];
        __m128i mx[NR]; /* running max of (byte & 0x7f): 0x7f means a NaN code */
        UNROLL for (int j = 0; j < nr; j++) {
            p0[j] = p1[j] = _mm512_setzero_ps();
            mx[j] = _mm_setzero_si128();
        }
        int64_t c = c0;
        for (; c + 32 <= c1; c += 32) {
            __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b0 = _mm_loadu_si128((const __m128i *)(q[j] + c));
                __m128i b1 = _mm_loadu_si128((const __m128i *)(q[j] + c + 16));
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(_mm_max_epu8(b0, b1), m7f));
                p0[j] = _mm512_fmadd_ps(fp8_16(b0), x0, p0[j]);
                p1[j] = _mm512_fmadd_ps(fp8_16(b1), x1, p1[j]);
            }
        }
        if (c + 16 <= c1) {
            __m512 x0 = _mm512_loadu_ps(x + c);
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(q[j] + c));
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                p0[j] = _mm512_fmadd_ps(fp8_16(b), x0, p0[j]);
            }
            c += 16;
        }
        if (c < c1) {
            __mmask16 k = tailmask(c1 - c);
            __m512 x1 = _mm512_maskz_loadu_ps(k, x + c);
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b = _mm_maskz_loadu_epi8(k, q[j] + c);
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                p1[j] = _mm512_fmadd_ps(fp8_16(b), x1, p1[j]);
            }
        }
        UNROLL for (int j = 0; j < nr; j++) {
            const float f = sc[j][cb];
            const __m512 s = _mm512_set1_ps(f), k256 = _mm512_set1_ps(256.0f);
            if (_mm_movemask_epi8(_mm_cmpeq_epi8(mx[j], m7f))) p0[j] = _mm512_set1_ps(__builtin_nanf(""));
            if (f < 0x1p120f && f > -0x1p120f) {
                const __m512 s256 = _mm512_mul_ps(s, k256);
                a0[j] = _mm512_fmadd_ps(p0[j], s256, a0[j]);
                a1[j] = _mm512_fmadd_ps(p1[j], s256, a1[j]);
            } else {
                a0[j] = _mm512_fmadd_ps(_mm512_mul_ps(p0[j], k256), s, a0[j]);
                a1[j] = _mm512_fmadd_ps(_mm512_mul_ps(p1[j], k256), s, a1[j]);
            }
        }
    }
    UNROLL for (int j = 0; j < nr; j++) y[j] = hsum16(_mm512_add_ps(a0[j], a1[j]));
}

/* ---- 4. int4 / mxfp4 ------------------------------------------------------- */

enum { N_I4_BF16, N_I4_F16, N_I4_F32, N_MX };

AI float e8m0(uint8_t s) {
    if (s == 0) return 0x1p-127f;
    if (s == 255) return __builtin_nanf("");
    uint32_t u = (uint32_t)s << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

AI float nib_scale(int k, const void *scale, int64_t idx) {
    switch (k) {
    case N_I4_BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)scale)[idx] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case N_I4_F16: return _cvtsh_ss(((const uint16_t *)scale)[idx]);
    case N_I4_F32: return ((const float *)scale)[idx];
    default: return e8m0(((const uint8_t *)scale)[idx]);
    }
}

AI void nib_tile(int k, const df_weight *w, int64_t r, int nr, const float *x, float *y) {
    const int64_t cols = w->cols, ng = cols / 32;
    const uint8_t *q[NR];
    int64_t si[NR];
    __m512 a0[NR], a1[NR];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * (cols / 2);
        si[j] = (r + j) * ng;
        a0[j] = a1[j] = _mm512_setzero_ps();
    }
    /* values of the 16 codes before scaling: int4 q - 8, or e2m1 */
    const __m512 base = k == N_MX
        ? _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f)
        : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t g = 0; g < ng; g++) {
        const int64_t c = g * 32;
        __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
        __m512 xe = _mm512_permutex2var_ps(x0, ie, x1), xo = _mm512_permutex2var_ps(x0, io, x1);
        UNROLL for (int j = 0; j < nr; j++) {
            /* table * s: exact for bf16/f16/e8m0 scales, and for f32 scales
             * the same single rounding as kn_dequant_row's (q - 8) * s */
            __m512 tab = _mm512_mul_ps(base, _mm512_set1_ps(nib_scale(k, w->scale, si[j] + g)));
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q[j] + c / 2)));
            __m512 we = _mm512_permutexvar_ps(v, tab);
            __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab);
            a0[j] = _mm512_fmadd_ps(we, xe, a0[j]);
            a1[j] = _mm512_fmadd_ps(wo, xo, a1[j]);
        }
    }
    UNROLL for (int j = 0; j < nr; j++) y[j] = hsum16(_mm512_add_ps(a0[j], a1[j]));
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

int kn_matmul_avx512(const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
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
    /* Row blocks of ~256 KB stay in L2 while every vector of X passes over them. */
    int64_t rb = (256 << 10) / (row_bytes > 0 ? row_bytes : 1);
    rb = rb < NR ? NR : rb / NR * NR;
    for (int64_t b0 = row0; b0 < row1; b0 += rb) {
        const int64_t b1 = b0 + rb < row1 ? b0 + rb : row1;
        for (int i = 0; i < n; i++) {
            const float *x = X + (int64_t)i * w->cols;
            float *y = Y + (int64_t)i * ldy;
            int64_t r = b0;
            for (; r + NR <= b1; r += NR) f4(w, r, x, y + (r - row0));
            for (; r < b1; r++) f1(w, r, x, y + (r - row0));
        }
    }
    return 1;
}
