/* matvec_avx512.c — AVX-512 (F BW VL DQ) tiles for every weight type.
 *
 * Owns: kn_matmul_avx512 (a table of tiles per weight type handed to the
 * shared driver, matvec_driver.c). Compiled with the Makefile's AVX512_FLAGS;
 * only reached when kn_detect() found all of them. Refuses: allocation,
 * scalar float math on the data path, and VNNI/BF16 dot instructions
 * (vdpbf16ps would round x to bf16, which changes the model's math).
 *
 * A tile computes nr rows x nv vectors (nr, nv compile-time: NR x 1 for
 * decode, MR x MV for prefill, and 1-row variants of both). Each (row,
 * vector) output owns accumulators a0/a1 fed in a pattern that depends only
 * on cols (32-column steps: a0 columns 0-15, a1 16-31; a lone 16-column step
 * to a0; the masked tail to a1; fp8 keeps per-block partials in the same
 * pattern and scales them once per block), then hsum(a0 + a1): the same
 * instructions whatever nr and nv are, so a value never depends on the tile
 * that computed it. Masked loads zero the lanes past the end, so tails need
 * no copies.
 *
 * Streaming: each row's stream is prefetched KN_PF bytes ahead, once per 64
 * bytes read; the hardware prefetcher alone left the 4-bit and int8 kernels
 * at half the DRAM bandwidth (their rows are read slowly, so it ramps late).
 * Each tile also prefetches the head of the next tile's rows
 * (matvec_prefetch.h says why).
 *
 * Nibble types: one 32-column group is 16 bytes; vpmovzxbd puts byte k in
 * lane k, vpermps (which reads only the low 4 index bits) looks the low nibble
 * (even column) up in a 16-entry table already multiplied by the group's
 * scale, and the byte shifted right by 4 (odd column) likewise; x arrives
 * split into even/odd halves per group (nib_prep).
 *
 * Sections: 1. helpers  2. dense (f32 bf16 f16 i8)  3. fp8 block
 *           4. int4 / mxfp4  5. tiles per type
 */
#include "kernels.h"
#include "matvec_driver.h"
/* 512 bytes ahead (AVX2 keeps 256): the GPU machine's 16-core Xeon, bench
 * --kernels, three alternating rounds, medians, % of the DRAM probe, 256 ->
 * 512: 16 threads mxfp4 71.1 -> 76.4, int4 75.2 -> 79.7, int8 94 -> 103;
 * 2 threads mxfp4 68.0 -> 75.0, int4 63.0 -> 69.3, bf16 92.6 -> 102.3; this
 * 2-vCPU Zen 5 VM, two pinned copies of bench/kn_stream.c, mxfp4 31-32 ->
 * 35-35.5 GB/s in one session, 35.8-36.3 -> 34.1-35.1 in the next (its
 * drift). The VM's AVX2 was slower at 512 (18.2-20.0 -> 16.8-18.9). */
#ifndef KN_PF
#define KN_PF 512
#endif
#include "matvec_prefetch.h"
#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
/* NR rows for one vector (decode); each type's tile table sets its own rows x
 * vectors for several vectors (prefill), within TR x TV */
enum { NR = 4, TR = 4, TV = 4, PF_SCALES = 64 /* groups ahead */ };
/* Full unrolling of the per-row loops keeps the accumulator arrays in registers. */
#define UNROLL _Pragma("GCC unroll 8")

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

AI void dense_tile(int e, const df_weight *w, int64_t r, int nr, int nv, const float *X,
                   int64_t ldx, float *Y, int64_t ldy) {
    const int64_t cols = w->cols;
    const int es = esize(e);
    const char *row[TR];
    __m512 a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        row[j] = (const char *)w->data + (r + j) * cols * es;
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = _mm512_setzero_ps();
    }
    kn_pf_rows(w->data, cols * es, r + nr, nr, w->rows);
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        if (es == 1 ? (c & 32) == 0 : 1) UNROLL for (int j = 0; j < nr; j++) kn_pf(row[j] + c * es, 32 * es < 64 ? 64 : 32 * es);
        __m512 x0[TV], x1[TV]; /* loaded once, shared by the tile's rows */
        UNROLL for (int v = 0; v < nv; v++) {
            x0[v] = _mm512_loadu_ps(X + v * ldx + c);
            x1[v] = _mm512_loadu_ps(X + v * ldx + c + 16);
        }
        UNROLL for (int j = 0; j < nr; j++) {
            __m512 w0 = ld16(e, row[j], c, 0, 0), w1 = ld16(e, row[j], c + 16, 0, 0);
            UNROLL for (int v = 0; v < nv; v++) {
                a0[j][v] = _mm512_fmadd_ps(w0, x0[v], a0[j][v]);
                a1[j][v] = _mm512_fmadd_ps(w1, x1[v], a1[j][v]);
            }
        }
    }
    if (c + 16 <= cols) {
        UNROLL for (int j = 0; j < nr; j++) {
            __m512 w0 = ld16(e, row[j], c, 0, 0);
            UNROLL for (int v = 0; v < nv; v++)
                a0[j][v] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(X + v * ldx + c), a0[j][v]);
        }
        c += 16;
    }
    if (c < cols) {
        __mmask16 k = tailmask(cols - c);
        UNROLL for (int j = 0; j < nr; j++) {
            __m512 w1 = ld16(e, row[j], c, k, 1);
            UNROLL for (int v = 0; v < nv; v++)
                a1[j][v] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(k, X + v * ldx + c), a1[j][v]);
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++) {
        float s = hsum16(_mm512_add_ps(a0[j][v], a1[j][v]));
        if (e == E_I8) {
            __m128 m = _mm_mul_ss(_mm_set_ss(s), _mm_set_ss(((const float *)w->scale)[r + j]));
            s = _mm_cvtss_f32(m);
        }
        Y[v * ldy + j] = s;
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
AI void fp8_tile(const df_weight *w, int64_t r, int nr, int nv, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    const int64_t cols = w->cols, bc = w->block_cols;
    const int64_t nbc = (cols + bc - 1) / bc;
    const __m128i m7f = _mm_set1_epi8(0x7f);
    const uint8_t *q[TR];
    const float *sc[TR];
    __m512 a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * cols;
        sc[j] = (const float *)w->scale + ((r + j) / w->block_rows) * nbc;
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = _mm512_setzero_ps();
    }
    kn_pf_rows(w->data, cols, r + nr, nr, w->rows);
    for (int64_t cb = 0; cb < nbc; cb++) {
        const int64_t c0 = cb * bc, c1 = c0 + bc < cols ? c0 + bc : cols;
        __m512 p0[TR][TV], p1[TR][TV];
        __m128i mx[TR]; /* running max of (byte & 0x7f): 0x7f means a NaN code */
        UNROLL for (int j = 0; j < nr; j++) {
            UNROLL for (int v = 0; v < nv; v++) p0[j][v] = p1[j][v] = _mm512_setzero_ps();
            mx[j] = _mm_setzero_si128();
        }
        int64_t c = c0;
        for (; c + 32 <= c1; c += 32) {
            if ((c & 32) == 0) UNROLL for (int j = 0; j < nr; j++) kn_pf(q[j] + c, 64);
            __m512 x0[TV], x1[TV];
            UNROLL for (int v = 0; v < nv; v++) {
                x0[v] = _mm512_loadu_ps(X + v * ldx + c);
                x1[v] = _mm512_loadu_ps(X + v * ldx + c + 16);
            }
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b0 = _mm_loadu_si128((const __m128i *)(q[j] + c));
                __m128i b1 = _mm_loadu_si128((const __m128i *)(q[j] + c + 16));
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(_mm_max_epu8(b0, b1), m7f));
                __m512 w0 = fp8_16(b0), w1 = fp8_16(b1);
                UNROLL for (int v = 0; v < nv; v++) {
                    p0[j][v] = _mm512_fmadd_ps(w0, x0[v], p0[j][v]);
                    p1[j][v] = _mm512_fmadd_ps(w1, x1[v], p1[j][v]);
                }
            }
        }
        if (c + 16 <= c1) {
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(q[j] + c));
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                __m512 w0 = fp8_16(b);
                UNROLL for (int v = 0; v < nv; v++)
                    p0[j][v] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(X + v * ldx + c), p0[j][v]);
            }
            c += 16;
        }
        if (c < c1) {
            __mmask16 k = tailmask(c1 - c);
            UNROLL for (int j = 0; j < nr; j++) {
                __m128i b = _mm_maskz_loadu_epi8(k, q[j] + c);
                mx[j] = _mm_max_epu8(mx[j], _mm_and_si128(b, m7f));
                __m512 w1 = fp8_16(b);
                UNROLL for (int v = 0; v < nv; v++)
                    p1[j][v] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(k, X + v * ldx + c), p1[j][v]);
            }
        }
        UNROLL for (int j = 0; j < nr; j++) {
            const float f = sc[j][cb];
            const __m512 s = _mm512_set1_ps(f), k256 = _mm512_set1_ps(256.0f);
            const int nan = _mm_movemask_epi8(_mm_cmpeq_epi8(mx[j], m7f));
            UNROLL for (int v = 0; v < nv; v++) {
                if (nan) p0[j][v] = _mm512_set1_ps(__builtin_nanf(""));
                if (f < 0x1p120f && f > -0x1p120f) {
                    const __m512 s256 = _mm512_mul_ps(s, k256);
                    a0[j][v] = _mm512_fmadd_ps(p0[j][v], s256, a0[j][v]);
                    a1[j][v] = _mm512_fmadd_ps(p1[j][v], s256, a1[j][v]);
                } else {
                    a0[j][v] = _mm512_fmadd_ps(_mm512_mul_ps(p0[j][v], k256), s, a0[j][v]);
                    a1[j][v] = _mm512_fmadd_ps(_mm512_mul_ps(p1[j][v], k256), s, a1[j][v]);
                }
            }
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++)
        Y[v * ldy + j] = hsum16(_mm512_add_ps(a0[j][v], a1[j][v]));
}

/* ---- 4. int4 / mxfp4 ------------------------------------------------------- */

enum { N_I4_BF16, N_I4_F16, N_I4_F32, N_MX };

/* 16 group scales from sp as fp32: e8m0 by exponent construction (0 ->
 * 2^-127 and 255 -> NaN, as the scalar reference), bf16 by a shift, f16 by
 * vcvtph2ps, f32 as they are. Past ng - g the lanes are don't-care. */
AI __m512 scales16(int k, const void *scale, int64_t idx, int64_t left) {
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    const uint8_t *sp = (const uint8_t *)scale + idx * ssz;
    __mmask16 m = left >= 16 ? (__mmask16)0xffff : tailmask(left);
    switch (k) {
    case N_MX: {
        __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, sp));
        __m512i bits = _mm512_slli_epi32(e, 23);
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                     _mm512_set1_epi32(0x00400000));
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                                     _mm512_set1_epi32(0x7fc00000));
        return _mm512_castsi512_ps(bits);
    }
    case N_I4_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, sp)), 16));
    case N_I4_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, sp));
    default: return _mm512_maskz_loadu_ps(m, sp);
    }
}

AI void nib_tile(int k, const df_weight *w, int64_t r, int nr, int nv, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    const int64_t cols = w->cols, ng = cols / 32;
    const uint8_t *q[TR];
    int64_t si[TR];
    __m512 a0[TR][TV], a1[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * (cols / 2);
        si[j] = (r + j) * ng;
        UNROLL for (int v = 0; v < nv; v++) a0[j][v] = a1[j][v] = _mm512_setzero_ps();
    }
    /* values of the 16 codes before scaling: int4 q - 8, or e2m1 */
    const __m512 base = k == N_MX
        ? _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f)
        : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    float sbuf[TR][16];
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    /* the next tile's rows; not for many vectors, whose decode is the limit (-5% with it) */
    if (nv == 1) kn_pf_nib_rows(w, r + nr, nr, ssz);
    for (int64_t g = 0; g < ng; g++) {
        const int64_t c = g * 32;
        if ((g & 15) == 0) {
            UNROLL for (int j = 0; j < nr; j++) {
                _mm512_storeu_ps(sbuf[j], scales16(k, w->scale, si[j] + g, ng - g));
                /* the scales are a stream too (one line per 4-16 blocks of them) */
                _mm_prefetch((const char *)w->scale + (si[j] + g + PF_SCALES) * ssz, _MM_HINT_T0);
            }
        }
        /* every group (16 bytes), not once per line: measured faster here */
        UNROLL for (int j = 0; j < nr; j++) kn_pf(q[j] + c / 2, 64);
        __m512 xe[TV], xo[TV]; /* loaded once, shared by the tile's rows */
        UNROLL for (int v = 0; v < nv; v++) {
            xe[v] = _mm512_loadu_ps(X + v * ldx + c);
            xo[v] = _mm512_loadu_ps(X + v * ldx + c + 16);
        }
        UNROLL for (int j = 0; j < nr; j++) {
            /* table * s: exact for bf16/f16/e8m0 scales, and for f32 scales
             * the same single rounding as kn_dequant_row's (q - 8) * s */
            __m512 tab = _mm512_mul_ps(base, _mm512_set1_ps(sbuf[j][g & 15]));
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q[j] + c / 2)));
            __m512 we = _mm512_permutexvar_ps(b, tab);
            __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
            UNROLL for (int v = 0; v < nv; v++) {
                a0[j][v] = _mm512_fmadd_ps(we, xe[v], a0[j][v]);
                a1[j][v] = _mm512_fmadd_ps(wo, xo[v], a1[j][v]);
            }
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++)
        Y[v * ldy + j] = hsum16(_mm512_add_ps(a0[j][v], a1[j][v]));
}

/* Per 32-column group: the 16 even columns, then the 16 odd ones. */
static void nib_prep(const float *x, int64_t cols, float *out) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t c = 0; c < cols; c += 32) {
        __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
        _mm512_storeu_ps(out + c, _mm512_permutex2var_ps(x0, ie, x1));
        _mm512_storeu_ps(out + c + 16, _mm512_permutex2var_ps(x0, io, x1));
    }
}

/* ---- 5. tiles per type ----------------------------------------------------- */

/* measured on the 16-core host (bench --kernels, gemm column): dense 4x3
 * beat 4x2 by 14-27% (and a 512-token prefill by 26%), 4-bit 4x2 beat 4x3 */
enum { D_MR = 4, D_MV = 3, F_MR = 2, F_MV = 2, N_MR = 4, N_MV = 2 };
KN_LEVEL(kn_matmul_avx512, nib_prep)

/* FMA throughput probe (kn_fma_loop): ACC independent chains of `iters`
 * FMAs; returns the flops done, with a result in *sink so none is dead. */
double kn_fma_loop_avx512(int64_t iters, float *sink) {
    enum { ACC = 12 };
    __m512 a[ACC];
    const __m512 m = _mm512_set1_ps(0.999999f), k = _mm512_set1_ps(1e-7f);
    _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) a[i] = _mm512_set1_ps(1.0f + (float)i);
    for (int64_t it = 0; it < iters; it++) {
        _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) a[i] = _mm512_fmadd_ps(a[i], m, k);
    }
    __m512 t = a[0];
    UNROLL for (int i = 1; i < ACC; i++) t = _mm512_add_ps(t, a[i]);
    *sink = hsum16(t);
    return 2.0 * ACC * 16 * (double)iters;
}
