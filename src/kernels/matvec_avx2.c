/* matvec_avx2.c — AVX2 + FMA + F16C tiles for every weight type.
 *
 * Owns: kn_matmul_avx2 (a table of tiles per weight type handed to the
 * shared driver, matvec_driver.c). Compiled with -mavx2 -mfma -mf16c; only
 * reached when kn_detect() says the CPU has them. Refuses: allocation, scalar
 * float math on the data path (every product and sum is an explicit
 * intrinsic, so the compiler cannot contract or reorder it).
 *
 * A tile computes nr rows x nv vectors (nr, nv compile-time: NR x 1 for
 * decode, a per-type mr x mv for prefill, and 1-row variants of both). Every
 * (row, vector) output owns two accumulators a0/a1 fed in a fixed pattern
 * that depends only on cols (full 16-column steps: a0 gets columns 0-7, a1
 * columns 8-15; a lone 8-column step goes to a0; the zero-padded tail to
 * a1), then hsum(a0 + a1). All tiles run the same always-inlined body, so a
 * value does not depend on which tile computed it (kernels.h's contract).
 *
 * Scaled types (fp8 blocks, int4/mxfp4 groups) keep per-block partials in
 * the same two-lane-set pattern and multiply them by the scale once per block
 * (see matvec.c for the value computed).
 *
 * Streaming: each row's stream is prefetched KN_PF bytes ahead, once per 64
 * bytes read, and each tile prefetches the head of the next tile's rows
 * (matvec_prefetch.h, shared with matvec_avx512.c).
 *
 * Sections: 1. helpers  2. dense (f32 bf16 f16 i8)  3. fp8 block
 *           4. int4 / mxfp4  5. tiles per type
 */
#include "kernels.h"
#include "matvec_driver.h"
#include "matvec_prefetch.h"
#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
/* NR rows for one vector (decode); each type's table sets its own rows x
 * vectors for several vectors (prefill), within TR x TV */
enum { NR = 4, TR = 4, TV = 4, PF_SCALES = 64 /* groups ahead */ };
/* Full unrolling of the per-row loops keeps the accumulator arrays in registers. */
#define UNROLL _Pragma("GCC unroll 8")

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

AI void dense_tile(int e, const df_weight *w, int64_t r, int nr, int nv, const float *X,
                   int64_t ldx, float *Y, int64_t ldy) {
    const int64_t cols = w->cols;
    const int es = esize(e);
    const char *row[TR];
    __m256 a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        row[j] = (const char *)w->data + (r + j) * cols * es;
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = _mm256_setzero_ps();
    }
    kn_pf_rows(w->data, cols * es, r + nr, nr, w->rows);
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        /* 16 columns are 16-64 bytes: one prefetch per 64 */
        if (es == 4 || (c & (es == 2 ? 16 : 48)) == 0)
            UNROLL for (int j = 0; j < nr; j++) kn_pf(row[j] + c * es, 64);
        __m256 x0[TV], x1[TV]; /* loaded once, shared by the tile's rows */
        UNROLL for (int v = 0; v < nv; v++) {
            x0[v] = _mm256_loadu_ps(X + v * ldx + c);
            x1[v] = _mm256_loadu_ps(X + v * ldx + c + 8);
        }
        UNROLL for (int j = 0; j < nr; j++) {
            __m256 w0 = ld8(e, row[j], c), w1 = ld8(e, row[j], c + 8);
            UNROLL for (int v = 0; v < nv; v++) {
                a0[j][v] = _mm256_fmadd_ps(w0, x0[v], a0[j][v]);
                a1[j][v] = _mm256_fmadd_ps(w1, x1[v], a1[j][v]);
            }
        }
    }
    if (c + 8 <= cols) {
        UNROLL for (int j = 0; j < nr; j++) {
            __m256 w0 = ld8(e, row[j], c);
            UNROLL for (int v = 0; v < nv; v++)
                a0[j][v] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(X + v * ldx + c), a0[j][v]);
        }
        c += 8;
    }
    if (c < cols) {
        float xt[TV][16];
        UNROLL for (int v = 0; v < nv; v++) pad_x(X + v * ldx + c, cols - c, xt[v]);
        UNROLL for (int j = 0; j < nr; j++) {
            _Alignas(32) char wt[32] = {0};
            memcpy(wt, row[j] + c * es, (size_t)((cols - c) * es));
            __m256 w1 = ld8(e, wt, 0);
            UNROLL for (int v = 0; v < nv; v++)
                a1[j][v] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt[v]), a1[j][v]);
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++) {
        float s = hsum8(_mm256_add_ps(a0[j][v], a1[j][v]));
        if (e == E_I8) {
            /* row scale after the sum, as a vector op so it is never contracted */
            __m128 m = _mm_mul_ss(_mm_set_ss(s), _mm_set_ss(((const float *)w->scale)[r + j]));
            s = _mm_cvtss_f32(m);
        }
        Y[v * ldy + j] = s;
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
AI void fp8_tile(const df_weight *w, int64_t r, int nr, int nv, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    const int64_t cols = w->cols, bc = w->block_cols;
    const int64_t nbc = (cols + bc - 1) / bc;
    const __m128i m7f = _mm_set1_epi8(0x7f);
    const uint8_t *q[TR];
    const float *sc[TR];
    __m256 a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * cols;
        sc[j] = (const float *)w->scale + ((r + j) / w->block_rows) * nbc;
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = _mm256_setzero_ps();
    }
    kn_pf_rows(w->data, cols, r + nr, nr, w->rows);
    for (int64_t cb = 0; cb < nbc; cb++) {
        const int64_t c0 = cb * bc, c1 = c0 + bc < cols ? c0 + bc : cols;
        __m256 p0[TR][TV], p1[TR][TV];
        __m128i mx[TR]; /* running max of (byte & 0x7f): 0x7f means a NaN code */
        UNROLL for (int j = 0; j < nr; j++) {
            UNROLL for (int v = 0; v < nv; v++) p0[j][v] = p1[j][v] = _mm256_setzero_ps();
            mx[j] = _mm_setzero_si128();
        }
        int64_t c = c0;
        for (; c + 16 <= c1; c += 16) {
            if ((c & 48) == 0) UNROLL for (int j = 0; j < nr; j++) kn_pf(q[j] + c, 64);
            __m256 x0[TV], x1[TV];
            UNROLL for (int v = 0; v < nv; v++) {
                x0[v] = _mm256_loadu_ps(X + v * ldx + c);
                x1[v] = _mm256_loadu_ps(X + v * ldx + c + 8);
            }
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(q[j] + c));
                __m256 lo, hi;
                fp8_16(b, &lo, &hi);
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                UNROLL for (int v = 0; v < nv; v++) {
                    p0[j][v] = _mm256_fmadd_ps(lo, x0[v], p0[j][v]);
                    p1[j][v] = _mm256_fmadd_ps(hi, x1[v], p1[j][v]);
                }
            }
        }
        if (c + 8 <= c1) {
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(q[j] + c));
                __m256 lo, hi;
                fp8_16(b, &lo, &hi);
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                UNROLL for (int v = 0; v < nv; v++)
                    p0[j][v] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(X + v * ldx + c), p0[j][v]);
            }
            c += 8;
        }
        if (c < c1) {
            float xt[TV][16];
            UNROLL for (int v = 0; v < nv; v++) pad_x(X + v * ldx + c, c1 - c, xt[v]);
            UNROLL for (int j = 0; j < nr; j++) {
                uint8_t bt[16] = {0};
                memcpy(bt, q[j] + c, (size_t)(c1 - c));
                __m128i b = _mm_loadu_si128((const __m128i *)bt);
                __m256 lo, hi;
                fp8_16(b, &lo, &hi);
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                UNROLL for (int v = 0; v < nv; v++)
                    p1[j][v] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xt[v]), p1[j][v]);
            }
        }
        UNROLL for (int j = 0; j < nr; j++) {
            const float f = sc[j][cb];
            const __m256 s = _mm256_set1_ps(f), k256 = _mm256_set1_ps(256.0f);
            const int nan = _mm_movemask_epi8(_mm_cmpeq_epi8(mx[j], m7f));
            UNROLL for (int v = 0; v < nv; v++) {
                if (nan) p0[j][v] = _mm256_set1_ps(__builtin_nanf(""));
                if (f < 0x1p120f && f > -0x1p120f) {
                    const __m256 s256 = _mm256_mul_ps(s, k256);
                    a0[j][v] = _mm256_fmadd_ps(p0[j][v], s256, a0[j][v]);
                    a1[j][v] = _mm256_fmadd_ps(p1[j][v], s256, a1[j][v]);
                } else {
                    a0[j][v] = _mm256_fmadd_ps(_mm256_mul_ps(p0[j][v], k256), s, a0[j][v]);
                    a1[j][v] = _mm256_fmadd_ps(_mm256_mul_ps(p1[j][v], k256), s, a1[j][v]);
                }
            }
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++)
        Y[v * ldy + j] = hsum8(_mm256_add_ps(a0[j][v], a1[j][v]));
}

/* ---- 4. int4 / mxfp4 ------------------------------------------------------- */

enum { N_I4_BF16, N_I4_F16, N_I4_F32, N_MX };

/* 8 group scales of a row from sp as fp32 (lanes past `left` are don't-care):
 * e8m0 by exponent construction (0 -> 2^-127 and 255 -> NaN, as the scalar
 * reference), bf16 by a shift, f16 by vcvtph2ps. */
AI __m256 scales8(int k, const void *scale, int64_t idx, int64_t left) {
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    const uint8_t *sp = (const uint8_t *)scale + idx * ssz;
    uint8_t tmp[32] = {0};
    if (left < 8) {
        memcpy(tmp, sp, (size_t)(left * ssz));
        sp = tmp;
    }
    switch (k) {
    case N_MX: {
        __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sp));
        __m256i bits = _mm256_slli_epi32(e, 23);
        bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000),
                                  _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
        bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000),
                                  _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
        return _mm256_castsi256_ps(bits);
    }
    case N_I4_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)sp)), 16));
    case N_I4_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sp));
    default: return _mm256_loadu_ps((const float *)sp);
    }
}

/* A 32-column group is 16 bytes. Every code value (int4 q - 8 in -8..7, e2m1)
 * is a bf16, so two vpshufb tables give its high and low bytes. The 16 bytes
 * go to both 128-bit lanes; lane 0 keeps the low nibbles (columns 2i), lane
 * 1 the high ones (2i+1, a per-lane dword shift by 4). Bytes then words
 * unpacked against zero are the fp32 values themselves (bf16 << 16): four
 * vectors holding columns {0,2,4,6 | 1,3,5,7}, {8..14 | 9..15}, {16..22 |
 * 17..23}, {24..30 | 25..31} of the group, ten uops where an f16 table and
 * vcvtph2ps took about seventeen. x arrives permuted to match (nib_prep).
 * Per group, row and vector: partials p0 (the first two vectors) and p1
 * (the last two), then a += p * scale. */
AI void nib_tile(int k, const df_weight *w, int64_t r, int nr, int nv, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    const int64_t cols = w->cols, ng = cols / 32;
    const uint8_t *q[TR];
    int64_t si[TR];
    __m256 a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * (cols / 2);
        si[j] = (r + j) * ng;
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = _mm256_setzero_ps();
    }
    /* bf16 of the 16 code values: high bytes, low bytes */
    const __m256i thi = k == N_MX
        ? _mm256_setr_epi8(0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, /* 0 .5 1 1.5 2 3 4 6 */
                           (char)0x80, (char)0xbf, (char)0xbf, (char)0xbf, (char)0xc0, (char)0xc0, (char)0xc0,
                           (char)0xc0, 0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xbf,
                           (char)0xbf, (char)0xbf, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0)
        : _mm256_setr_epi8((char)0xc1, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0,
                           (char)0xbf, 0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, /* -8 .. 7 */
                           (char)0xc1, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0,
                           (char)0xbf, 0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40);
    const __m256i tlo = k == N_MX
        ? _mm256_setr_epi8(0x00, 0x00, (char)0x80, (char)0xc0, 0x00, 0x40, (char)0x80, (char)0xc0, 0x00, 0x00,
                           (char)0x80, (char)0xc0, 0x00, 0x40, (char)0x80, (char)0xc0, 0x00, 0x00, (char)0x80,
                           (char)0xc0, 0x00, 0x40, (char)0x80, (char)0xc0, 0x00, 0x00, (char)0x80, (char)0xc0,
                           0x00, 0x40, (char)0x80, (char)0xc0)
        : _mm256_setr_epi8(0x00, (char)0xe0, (char)0xc0, (char)0xa0, (char)0x80, 0x40, 0x00, (char)0x80, 0x00,
                           (char)0x80, 0x00, 0x40, (char)0x80, (char)0xa0, (char)0xc0, (char)0xe0, 0x00,
                           (char)0xe0, (char)0xc0, (char)0xa0, (char)0x80, 0x40, 0x00, (char)0x80, 0x00,
                           (char)0x80, 0x00, 0x40, (char)0x80, (char)0xa0, (char)0xc0, (char)0xe0);
    const __m256i m0f = _mm256_set1_epi8(0x0f), lane_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i zero = _mm256_setzero_si256();
    float sbuf[TR][8];
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    /* the next tile's rows; not for many vectors, whose decode is the limit (-5% with it) */
    if (nv == 1) kn_pf_nib_rows(w, r + nr, nr, ssz);
    for (int64_t g = 0; g < ng; g++) {
        const int64_t c = g * 32;
        if ((g & 7) == 0)
            UNROLL for (int j = 0; j < nr; j++) {
                _mm256_storeu_ps(sbuf[j], scales8(k, w->scale, si[j] + g, ng - g));
                /* the scales are a stream too (one line per 4-16 blocks of them) */
                _mm_prefetch((const char *)w->scale + (si[j] + g + PF_SCALES) * ssz, _MM_HINT_T0);
            }
        if ((g & 3) == 0) UNROLL for (int j = 0; j < nr; j++) kn_pf(q[j] + c / 2, 64);
        __m256 x0[TV], x1[TV], x2[TV], x3[TV]; /* loaded once, shared by the tile's rows */
        UNROLL for (int v = 0; v < nv; v++) {
            const float *x = X + v * ldx + c;
            x0[v] = _mm256_loadu_ps(x), x1[v] = _mm256_loadu_ps(x + 8);
            x2[v] = _mm256_loadu_ps(x + 16), x3[v] = _mm256_loadu_ps(x + 24);
        }
        UNROLL for (int j = 0; j < nr; j++) {
            __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q[j] + c / 2)));
            __m256i cd = _mm256_and_si256(_mm256_srlv_epi32(b, lane_shift), m0f);
            __m256i h = _mm256_shuffle_epi8(thi, cd), l = _mm256_shuffle_epi8(tlo, cd);
            __m256i wl = _mm256_unpacklo_epi8(l, h), wh = _mm256_unpackhi_epi8(l, h);
            __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wl));
            __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wl));
            __m256 w2 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wh));
            __m256 w3 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wh));
            __m256 s = _mm256_broadcast_ss(&sbuf[j][g & 7]);
            UNROLL for (int v = 0; v < nv; v++) {
                __m256 p0 = _mm256_fmadd_ps(w1, x1[v], _mm256_mul_ps(w0, x0[v]));
                __m256 p1 = _mm256_fmadd_ps(w3, x3[v], _mm256_mul_ps(w2, x2[v]));
                a0[j][v] = _mm256_fmadd_ps(p0, s, a0[j][v]);
                a1[j][v] = _mm256_fmadd_ps(p1, s, a1[j][v]);
            }
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++)
        Y[v * ldy + j] = hsum8(_mm256_add_ps(a0[j][v], a1[j][v]));
}

/* Per 8-column block of a group: its 4 even columns, then its 4 odd ones
 * (the lanes nib_tile's vectors hold). */
static void nib_prep(const float *x, int64_t cols, float *xp) {
    for (int64_t b = 0; b < cols; b += 8)
        for (int m = 0; m < 4; m++) {
            xp[b + m] = x[b + 2 * m];
            xp[b + 4 + m] = x[b + 2 * m + 1];
        }
}

/* ---- 5. tiles per type ----------------------------------------------------- */

/* rows x vectors for prefill, within the 16 registers: accumulators (2 per
 * output) plus the decoded weights of the tile's rows */
enum { D_MR = 2, D_MV = 2, F_MR = 1, F_MV = 2, N_MR = 1, N_MV = 4 };
KN_LEVEL(kn_matmul_avx2, nib_prep, nib_prep)

/* FMA throughput probe (kn_fma_loop): ACC independent chains of `iters`
 * FMAs; returns the flops done, with a result in *sink so none is dead. */
double kn_fma_loop_avx2(int64_t iters, float *sink) {
    enum { ACC = 12 };
    __m256 a[ACC];
    const __m256 m = _mm256_set1_ps(0.999999f), k = _mm256_set1_ps(1e-7f);
    _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) a[i] = _mm256_set1_ps(1.0f + (float)i);
    for (int64_t it = 0; it < iters; it++) {
        _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) a[i] = _mm256_fmadd_ps(a[i], m, k);
    }
    __m256 t = a[0];
    UNROLL for (int i = 1; i < ACC; i++) t = _mm256_add_ps(t, a[i]);
    *sink = hsum8(t);
    return 2.0 * ACC * 8 * (double)iters;
}
