/* matvec_avx512.c — AVX-512 (F BW VL DQ VNNI VBMI BF16) tiles for every weight type.
 *
 * Owns: kn_matmul_avx512 (a table of tiles per weight type handed to the
 * shared driver, matvec_driver.c). Compiled with the Makefile's AVX512_FLAGS;
 * only reached when kn_detect() found all of them. Refuses: allocation,
 * scalar float math on the data path, and BF16 dot instructions (vdpbf16ps
 * would round x to bf16, which changes the model's math); VNNI only on
 * integers it sums exactly (the 4-bit tiles, section 4).
 *
 * A tile computes nr rows x nv vectors (nr, nv compile-time: NR or NR_L1 x 1 for
 * decode, MR x MV for prefill, and 1-row variants of both). Each dense (row,
 * vector) output owns accumulators a0/a1 fed in a pattern that depends only
 * on cols (32-column steps: a0 columns 0-15, a1 16-31, except bf16: a0 the
 * step's even columns, a1 its odd ones, from one 64-byte load split by a
 * shift and a mask, x laid out to match by bf16_prep; a lone 16-column step
 * to a0; the masked tail to a1; fp8 keeps per-block partials in the same
 * pattern and scales them once per block), then hsum(a0 + a1): the same
 * instructions whatever nr and nv are, so a value never depends on the tile
 * that computed it (the 4-bit tiles likewise, one accumulator, section 4).
 * Masked loads zero the lanes past the end, so tails need no copies.
 *
 * Prefill: the dense tiles also run by column ranges (dense_part, the
 * driver's many_part), so the driver can keep a block of x in L1 across
 * tiles; each output keeps dense_tile's FMAs in dense_tile's order.
 *
 * Streaming: for one vector (decode) each tile prefetches the columns it is
 * reading of the next tile's rows, a tile ahead (into L1 or L2, kn_pf_next; Zen 4 VM, 2
 * threads: the 4-bit kernels ~15 -> ~30 GB/s, int8 ~26 -> ~41; one stream
 * KN_PF bytes ahead in the row had been measured on the Xeon host, whose
 * figures with this scheme are in bench/cpu_NOTES.md). Many vectors, and the
 * last tile of a matrix, prefetch KN_PF bytes ahead in each row
 * (matvec_prefetch.h).
 *
 * Sections: 1. helpers  2. dense (f32 bf16 f16 i8)  3. fp8 block
 *           4. int4 / mxfp4  5. dense prefill, rows in the lanes  6. tiles per type
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
/* NR rows for one vector (decode) where the tiles prefetch the next tile's
 * rows into L2, NR_L1 where into L1 (kn_pf_next_l1: AMD CPUs); each type's
 * tile table sets its own rows x vectors for several vectors (prefill),
 * within TR x TV. 8 rows read x once per 8 rows instead of 4: a 2-vCPU Zen
 * 5 VM, two threads streaming 176 MB (`kn_stream T avx512 49152 7168 1 5
 * 2`, alternating, medians of 5-7, GFLOP/s), 4 -> 8 rows with the L1
 * prefetch: mxfp4 124 -> 156 and 142 -> 169, bf16 40.2 -> 43.3 and 41.6 ->
 * 43.2, int4 157 -> 150; with L2, mxfp4 109 -> 146 and bf16 35.0 -> 38.8
 * (12 rows: mxfp4 134, int4 131, bf16 39.6; 6 rows between 4 and 8; 2
 * rows mxfp4 102). The GPU machine's 16-core Xeon (the L2 form), same
 * command, three rounds, GB/s, 4 rows L2 / 8 rows L1 / 8 rows L2, 16
 * threads: mxfp4 173-177 / 150-155 / 161-193, bf16 (two steady rounds)
 * 139 / 109-136 / 139-142: so NR stays 4 there. */
enum { NR = 4, NR_L1 = 8, TR = 8, TV = 4, PF_SCALES = 64 /* groups ahead */ };
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

/* A dense tile's 32-column steps [c0, c1) (multiples of 32) into a0 / a1:
 * with next (kn_pf_next_tile) prefetching the same columns of the next
 * tile's rows, else KN_PF bytes ahead in its own. */
AI void dense_steps(int e, const char *const *row, int nr, int nv, const float *X, int64_t ldx, int64_t c0,
                    int64_t c1, int64_t next, int l1, __m512 a0[TR][TV], __m512 a1[TR][TV]) {
    const int es = esize(e);
    for (int64_t c = c0; c < c1; c += 32) {
        if (next) {
            if (es == 1 ? (c & 32) == 0 : 1)
                UNROLL for (int j = 0; j < nr; j++) UNROLL for (int o = 0; o < 32 * es; o += 64)
                    kn_pf_next(row[j] + next + c * es + o, l1);
        } else if (es == 1 ? (c & 32) == 0 : 1) UNROLL for (int j = 0; j < nr; j++) kn_pf(row[j] + c * es, 32 * es < 64 ? 64 : 32 * es);
        __m512 x0[TV], x1[TV]; /* loaded once, shared by the tile's rows */
        UNROLL for (int v = 0; v < nv; v++) {
            x0[v] = _mm512_loadu_ps(X + v * ldx + c);
            x1[v] = _mm512_loadu_ps(X + v * ldx + c + 16);
        }
        UNROLL for (int j = 0; j < nr; j++) {
            __m512 w0, w1;
            if (e == E_BF16) { /* even columns (low halves) and odd ones: x comes as bf16_prep lays it */
                __m512i d = _mm512_loadu_si512(row[j] + c * 2);
                __asm__("" : "+v"(d)); /* one load for both halves (gcc would fold it into each) */
                w0 = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
                w1 = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32((int)0xffff0000u)));
            } else {
                w0 = ld16(e, row[j], c, 0, 0), w1 = ld16(e, row[j], c + 16, 0, 0);
            }
            UNROLL for (int v = 0; v < nv; v++) {
                a0[j][v] = _mm512_fmadd_ps(w0, x0[v], a0[j][v]);
                a1[j][v] = _mm512_fmadd_ps(w1, x1[v], a1[j][v]);
            }
        }
    }
}

/* A dense tile's columns after its full steps (a 16-column step, the masked
 * tail), then each output's hsum(a0 + a1) (times the row scale for int8) into Y. */
AI void dense_finish(int e, const df_weight *w, int64_t r, const char *const *row, int nr, int nv, const float *X,
                     int64_t ldx, float *Y, int64_t ldy, __m512 a0[TR][TV], __m512 a1[TR][TV]) {
    const int64_t cols = w->cols;
    int64_t c = cols / 32 * 32;
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

/* A dense tile's row pointers, and its accumulators: zero (acc NULL) or
 * as dense_part parked them in acc (a0 then a1, nr x nv each). */
AI void dense_start(int e, const df_weight *w, int64_t r, int nr, int nv, const float *acc, const char *row[TR],
                    __m512 a0[TR][TV], __m512 a1[TR][TV]) {
    UNROLL for (int j = 0; j < nr; j++) {
        row[j] = (const char *)w->data + (r + j) * w->cols * esize(e);
        UNROLL for (int v = 0; v < nv; v++) {
            a0[j][v] = acc ? _mm512_load_ps(acc + (j * nv + v) * 16) : _mm512_setzero_ps();
            a1[j][v] = acc ? _mm512_load_ps(acc + ((nr + j) * nv + v) * 16) : _mm512_setzero_ps();
        }
    }
}

AI void dense_tile(int e, const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X,
                   int64_t ldx, float *Y, int64_t ldy) {
    const int64_t cols = w->cols;
    const int es = esize(e);
    const char *row[TR];
    __m512 a0[TR][TV], a1[TR][TV];
    dense_start(e, w, r, nr, nv, NULL, row, a0, a1);
    /* one vector: the same columns of the next tile's rows, as nib_tile */
    const int64_t next = kn_pf_next_tile(w->rows, r, nr, nv, cols * es, 1);
    if (!next) kn_pf_rows(w->data, cols * es, r + nr, nr, w->rows);
    dense_steps(e, row, nr, nv, X, ldx, 0, cols / 32 * 32, next, l1, a0, a1);
    dense_finish(e, w, r, row, nr, nv, X, ldx, Y, ldy, a0, a1);
}

/* x for the bf16 tiles: per full 32-column step its 16 even columns, then
 * its 16 odd ones (a row's 64 bytes there split into the two by one shift
 * and one mask); the columns past the last full step as they are. */
static void bf16_prep(const float *x, int64_t cols, float *out) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
        _mm512_storeu_ps(out + c, _mm512_permutex2var_ps(a, ev, b));
        _mm512_storeu_ps(out + c + 16, _mm512_permutex2var_ps(a, od, b));
    }
    if (c < cols) memcpy(out + c, x + c, (size_t)(cols - c) * sizeof *out);
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
AI void fp8_tile(const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    (void)l1; /* its rows are prefetched KN_PF bytes ahead in themselves */
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

/* The 4-bit tiles work in integers (VNNI), per 128-column chunk (four
 * groups, 64 code bytes a row):
 *   - a code becomes an unsigned byte u = v + c0: int4 u = q (v = q - 8,
 *     c0 = 8); MXFP4 u = 2 e2m1 + 12 (v = twice the e2m1 value, exact,
 *     in -12..12; c0 = 12), by one table lookup (vpermb, on the low 4
 *     bits of each byte);
 *   - x comes as three signed bytes a column (nib_prep_i4 / nib_prep_mx):
 *     each 32-column group g is scaled by 2^s_g so its largest |x| lies in
 *     [2^22, 2^23) (one group at most one step lower, so the rounded value
 *     fits three balanced digits) and rounded to the integer
 *     X = L0 2^16 + L1 2^8 + L2 (digits in -128..127);
 *   - vpdpbusd sums four u x L products a dword lane: lane i of the chunk
 *     holds columns 8i .. 8i+7 (its four even columns from the low
 *     nibbles, its four odd ones from the high), so a lane belongs to group
 *     i / 4; per lane ((dp L0 << 8) + dp L1) << 8) + dp L2 - c0 sum X = the
 *     exact integer sum v X of its eight columns (|.| < 2^30; int32 wraps
 *     are harmless, the result fits);
 *   - that integer becomes fp32 (one rounding) and is added into the
 *     lane's accumulator by one FMA with (group scale x 2^-s_g, the e2m1
 *     halving folded in: an exact product, formed once per 16 groups).
 * The same instructions in the same order for every (row, vector) output
 * whatever the tile: a value never depends on nr, nv or the row range.
 * Against the exact sum: the fp32 steps bound like any order of n products,
 * and x's rounding adds at most 2^-23 max|x_g| sum_{c in g} |w_c| per
 * group (kernels.h). Groups of x with a NaN or infinity give NaN; a group
 * whose largest |x| is below 2^-125 keeps its bits down to 2^-148 only. */
/* prepared x per chunk (CH_BYTES): digit planes L0e L0o L1e L1o L2e L2o (64
 * bytes each), -c0 sum X per lane (16 int32); the first chunk of each
 * 16-group block then holds the block's 2^-s (16 floats, from float CH_XS) */
enum { CH = 128, CH_BYTES = 512, CH_XS = 112 };

/* One chunk (128 columns from c; `full`, else the first cm bytes of codes)
 * of nib_tile's rows and vectors into acc; sx: each (row, vector)'s 16
 * lane scales of the chunk's 16-group block. */
AI void nib_chunk(int k, int nr, int nv, const uint8_t *const q[TR], int64_t c, int full, __mmask64 cm,
                  const __m512 sx[TR][TV], __m512i sidx, const float *X, int64_t ldx, __m512 acc[TR][TV]) {
    /* MXFP4: u = 2 e2m1 + 12 by the low 4 bits of an index (vpermb reads 6);
     * int4: u = q, the nibble by a mask (2.6% faster than an identity vpermb) */
    const __m512i tab =
        _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    __m512i ue[TR], uo[TR];
    UNROLL for (int j = 0; j < nr; j++) {
        const __m512i b = full ? _mm512_loadu_si512(q[j] + c / 2) : _mm512_maskz_loadu_epi8(cm, q[j] + c / 2);
        /* low nibbles: byte k's own; high: shifted down within each 16-bit word */
        if (k == N_MX) {
            ue[j] = _mm512_permutexvar_epi8(b, tab);
            uo[j] = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 4), tab);
        } else {
            const __m512i m0f = _mm512_set1_epi8(0x0f);
            ue[j] = _mm512_and_si512(b, m0f);
            uo[j] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m0f);
        }
    }
    UNROLL for (int v = 0; v < nv; v++) {
        /* x's planes loaded once a chunk, shared by the rows */
        const __m512i *xp = (const __m512i *)(X + v * ldx + c);
        __m512i xl[7];
        UNROLL for (int i = 0; i < 7; i++) xl[i] = _mm512_loadu_si512(xp + i);
        UNROLL for (int j = 0; j < nr; j++) {
            /* the three digits' sums side by side, the correction as a2's
             * start (integer sums: the same value as one chain; shorter
             * dependencies: Zen 4, one vector in cache, +5%) */
            __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ue[j], xl[0]);
            __m512i a1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ue[j], xl[2]);
            __m512i a2 = _mm512_dpbusd_epi32(xl[6], ue[j], xl[4]);
            a0 = _mm512_dpbusd_epi32(a0, uo[j], xl[1]);
            a1 = _mm512_dpbusd_epi32(a1, uo[j], xl[3]);
            a2 = _mm512_dpbusd_epi32(a2, uo[j], xl[5]);
            __m512i a = _mm512_add_epi32(_mm512_slli_epi32(a0, 8), a1);
            a = _mm512_add_epi32(_mm512_slli_epi32(a, 8), a2);
            acc[j][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(sidx, sx[j][v]), acc[j][v]);
        }
    }
}

/* Each (row, vector)'s lane scales of the 16-group block from group g:
 * the weight scale times x's 2^-s (exact), and the scales' stream
 * prefetched (one line per 4-16 blocks of them). */
AI void nib_block_scales(int k, const df_weight *w, const int64_t si[TR], int nr, int nv, int64_t g,
                         int64_t c, const float *X, int64_t ldx, __m512 sx[TR][TV]) {
    const int64_t ng = w->cols / 32;
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    UNROLL for (int j = 0; j < nr; j++) {
        const __m512 ws = scales16(k, w->scale, si[j] + g, ng - g);
        UNROLL for (int v = 0; v < nv; v++)
            sx[j][v] = _mm512_mul_ps(ws, _mm512_loadu_ps(X + v * ldx + c + CH_XS));
        _mm_prefetch((const char *)w->scale + (si[j] + g + PF_SCALES) * ssz, _MM_HINT_T0);
    }
}

/* Whole 16-group blocks of full chunks run unrolled for one vector (each
 * chunk's place in its block a constant); the chunks after them, and many
 * vectors, one at a time. Both do the same arithmetic per chunk, so the
 * split changes no bits. */
AI void nib_tile(int k, const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    const int64_t cols = w->cols, ng = cols / 32, nfull = cols / CH, nch = (cols + CH - 1) / CH;
    const uint8_t *q[TR];
    int64_t si[TR];
    __m512 acc[TR][TV], sx[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * (cols / 2);
        si[j] = (r + j) * ng;
        UNROLL for (int v = 0; v < nv; v++) acc[j][v] = sx[j][v] = _mm512_setzero_ps();
    }
    /* lane i takes the scale of group i / 4 of the chunk */
    const __m512i lane_grp = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    /* Streaming one vector, each chunk prefetches the same chunk of the
     * next tile's rows (a tile ahead, kn_pf_next; Zen 4 VM, kn_stream 98304 x
     * 3584: 8 -> 16 GB/s one thread, 15-18 -> 30-32 two, against 512 bytes
     * ahead in the row); the last tile of the matrix prefetches in its rows. */
    const int64_t next = kn_pf_next_tile(w->rows, r, nr, nv, cols / 2, 1);
    if (nv == 1 && !next) kn_pf_nib_rows(w, r + nr, nr, ssz);
    int64_t ch = 0;
    if (nv == 1) { /* (many vectors are bound by their decode; unrolled, they lost ~5%) */
        for (; ch + 4 <= nfull; ch += 4) {
            nib_block_scales(k, w, si, nr, nv, ch * 4, ch * CH, X, ldx, sx);
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
                kn_pf_step(q, nr, next, (ch + i) * CH / 2, l1);
                nib_chunk(k, nr, nv, q, (ch + i) * CH, 1, 0, sx, _mm512_add_epi32(lane_grp, _mm512_set1_epi32(4 * i)),
                          X, ldx, acc);
            }
        }
    }
    for (; ch < nch; ch++) {
        const int64_t c = ch * CH;
        if ((ch & 3) == 0) nib_block_scales(k, w, si, nr, nv, ch * 4, c, X, ldx, sx);
        const __m512i sidx = _mm512_add_epi32(lane_grp, _mm512_set1_epi32((int)(ch & 3) * 4));
        kn_pf_step(q, nr, next, c / 2, l1);
        if (ch < nfull) nib_chunk(k, nr, nv, q, c, 1, 0, sx, sidx, X, ldx, acc);
        else nib_chunk(k, nr, nv, q, c, 0, ((__mmask64)1 << ((cols - c) / 2)) - 1, sx, sidx, X, ldx, acc);
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++) Y[v * ldy + j] = hsum16(acc[j][v]);
}

/* x for nib_tile: per 128-column chunk (CH_BYTES, the last one zero-padded)
 * the three digit planes of the even and of the odd columns, -c0 times each
 * lane's sum of X, and each lane's 2^-s (times half: 0.5 for MXFP4's
 * doubled codes). See nib_tile for the scaling. */
AI void nib_prep(const float *x, int64_t cols, float *out, int c0, float half) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i lane0 = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const int64_t ng = cols / 32, nch = (cols + CH - 1) / CH;
    /* the last chunk's missing groups stay zero */
    if (ng % 4) memset((char *)out + (nch - 1) * CH_BYTES, 0, CH_BYTES);
    if (ng % 16) memset(out + (ng / 16) * 4 * CH + CH_XS, 0, 16 * sizeof(float)); /* the last block's 2^-s */
    /* a group at most one step lower when its largest |x| rounds above the three digits' 8355711 */
    const float dig_max = 8355711.5f;
    for (int64_t g = 0; g < ng; g++) {
        char *o = (char *)out + (g / 4) * CH_BYTES + (g % 4) * 16;
        const __m512 x0 = _mm512_loadu_ps(x + g * 32), x1 = _mm512_loadu_ps(x + g * 32 + 16);
        const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        __m512i Xe = _mm512_setzero_si512(), Xo = Xe;
        float inv = 0.0f;
        /* (vmaxps drops NaNs, so they are looked for apart) */
        const int nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
        if (nan || !(m <= 3.4028235e38f)) { /* NaN or infinity */
            inv = __builtin_nanf("");
        } else if (m > 0.0f) {
            /* s = 22 - floor(log2 m) (getexp: subnormals too), at most 147 */
            const __m512 mv = _mm512_set1_ps(m);
            __m512 sc = _mm512_min_ps(_mm512_sub_ps(_mm512_set1_ps(22.0f), _mm512_getexp_ps(mv)),
                                      _mm512_set1_ps(147.0f));
            if (_mm512_cvtss_f32(_mm512_scalef_ps(mv, sc)) > dig_max) sc = _mm512_sub_ps(sc, _mm512_set1_ps(1.0f));
            Xe = _mm512_cvtps_epi32(_mm512_scalef_ps(_mm512_permutex2var_ps(x0, ie, x1), sc));
            Xo = _mm512_cvtps_epi32(_mm512_scalef_ps(_mm512_permutex2var_ps(x0, io, x1), sc));
            inv = _mm512_cvtss_f32(_mm512_scalef_ps(_mm512_set1_ps(half), _mm512_sub_ps(_mm512_setzero_ps(), sc)));
        }
        __m512i X2[2] = {Xe, Xo};
        for (int h = 0; h < 2; h++) { /* digits: L2 = low byte (signed), then L1, L0 */
            const __m512i X = X2[h];
            const __m512i l2 = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
            const __m512i r1 = _mm512_srai_epi32(_mm512_sub_epi32(X, l2), 8);
            const __m512i l1 = _mm512_srai_epi32(_mm512_slli_epi32(r1, 24), 24);
            const __m512i l0 = _mm512_srai_epi32(_mm512_sub_epi32(r1, l1), 8);
            _mm_storeu_si128((__m128i *)(o + 64 * h), _mm512_cvtepi32_epi8(l0));
            _mm_storeu_si128((__m128i *)(o + 128 + 64 * h), _mm512_cvtepi32_epi8(l1));
            _mm_storeu_si128((__m128i *)(o + 256 + 64 * h), _mm512_cvtepi32_epi8(l2));
        }
        /* lane m of the group: columns 8m .. 8m+7 = dwords 4m .. 4m+3 of Xe + Xo */
        __m512i t = _mm512_add_epi32(Xe, Xo);
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
        t = _mm512_mullo_epi32(_mm512_permutexvar_epi32(lane0, t), _mm512_set1_epi32(-c0));
        _mm_storeu_si128((__m128i *)(o + 384), _mm512_castsi512_si128(t));
        out[(g / 16) * 4 * CH + CH_XS + g % 16] = inv;
    }
}
static void nib_prep_i4(const float *x, int64_t cols, float *out) { nib_prep(x, cols, out, 8, 1.0f); }
static void nib_prep_mx(const float *x, int64_t cols, float *out) { nib_prep(x, cols, out, 12, 0.5f); }

/* ---- 5. dense prefill with the rows in the lanes ---------------------------- */

/* The dense tiles give each output (row, vector) 32 chains of FMAs, one per
 * position p of a 32-column step (a0's lanes p 0-15, a1's p 16-31: the
 * column position(c, p) below), each chain over the steps in order, then
 * hsum(a0 + a1). Here a zmm holds one position's chain for 16 rows (their
 * weights transposed into wp) and one vector's x is broadcast: the same
 * FMAs on the same values in the same order per chain, and the same adds
 * after, so the same bits; but a step of a 48 x 8 block is 24 FMAs against
 * 3 loads and 8 broadcasts, no decoding (this Zen 5 VM, a kernel alone with
 * its data in L2: 200 GFLOP/s of 217 the FMA probe reads, where the dense
 * tile with x in L1 reads ~60%). The weights are decoded and transposed once
 * per panel and column block, for every group of vectors.
 * A lane of a position no step has (the tail's) gets weight 0 and x 0: an
 * FMA then adds +0 to a chain that started at +0, so no value changes. */
enum { L_Z = 3, L_MR = 16 * L_Z, L_MV = 8, L_STEPS = 32, L_TILES = 2, L_XPAD = 16 };
enum { L_SET_FLOATS = 1024 }; /* 4 KB: vectors a multiple of this apart share L1 sets */
enum { L_TILE_POS = L_Z * L_MV * 16, L_POS = L_TILES * L_TILE_POS }; /* floats of one position's chains: a tile's, a panel's */

/* Row row's 32 weights of step c as fp32 in position order (lanes 0-15 in
 * lo, 16-31 in hi): a full step, or the tail step (c == full / 32) as
 * dense_finish reads it (a 16-column step to positions 0-15, the masked
 * rest to 16-31), zero where that has nothing. */
AI void lanes_wstep(int e, const char *row, int64_t cols, int64_t c, __m512 *lo, __m512 *hi) {
    const int64_t full = cols / 32 * 32, c0 = c * 32;
    if (c0 < full) {
        if (e == E_BF16) {
            __m512i d = _mm512_loadu_si512(row + c0 * 2);
            *lo = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
            *hi = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32((int)0xffff0000u)));
        } else {
            *lo = ld16(e, row, c0, 0, 0), *hi = ld16(e, row, c0 + 16, 0, 0);
        }
        return;
    }
    const int has16 = cols - full >= 16;
    const int64_t ct = full + (has16 ? 16 : 0);
    *lo = has16 ? ld16(e, row, full, 0, 0) : _mm512_setzero_ps();
    *hi = ct < cols ? ld16(e, row, ct, tailmask(cols - ct), 1) : _mm512_setzero_ps();
}

/* r[j] lane q -> r[q] lane j: unpack 32-bit pairs, then 64-bit pairs, then
 * 128-bit lanes twice. */
AI void transpose16(__m512 r[16]) {
    __m512 t[16];
    UNROLL for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#define PD_(f, a, b) _mm512_castpd_ps(f(_mm512_castps_pd(a), _mm512_castps_pd(b)))
    UNROLL for (int i = 0; i < 4; i++) { /* r[4 i + j] lane k: rows 4i..4i+3 of column 4k + j */
        r[4 * i] = PD_(_mm512_unpacklo_pd, t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = PD_(_mm512_unpackhi_pd, t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = PD_(_mm512_unpacklo_pd, t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = PD_(_mm512_unpackhi_pd, t[4 * i + 1], t[4 * i + 3]);
    }
#undef PD_
    UNROLL for (int j = 0; j < 4; j++) {
        const __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xee);
        const __m512 v0 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44), v1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xee);
        t[j] = _mm512_shuffle_f32x4(u0, v0, 0x88), t[4 + j] = _mm512_shuffle_f32x4(u0, v0, 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(u1, v1, 0x88), t[12 + j] = _mm512_shuffle_f32x4(u1, v1, 0xdd);
    }
    UNROLL for (int q = 0; q < 16; q++) r[q] = t[q];
}

/* x of one vector (position form: bf16_prep's, or as given) for steps
 * [s0, s0 + ns) into out (32 floats a step, position order): as an f32 row,
 * so the tail step's positions are those of its weights. */
static void lanes_xcopy(const float *x, int64_t cols, int64_t s0, int ns, float *out) {
    for (int i = 0; i < ns; i++) {
        __m512 lo, hi;
        lanes_wstep(E_F32, (const char *)x, cols, s0 + i, &lo, &hi);
        _mm512_store_ps(out + i * 32, lo), _mm512_store_ps(out + i * 32 + 16, hi);
    }
}

/* One position's chains of a 48-row tile x 8 vectors over ns steps: wp the
 * tile's weights of that position ([step][48]), xb + p the vectors' x
 * (xs floats apart, 32 a step), acc the chains (parked, or zero when first). */
AI void lanes_kern(const float *wp, const float *xb, int64_t xs, int ns, float *acc, int first) {
    __m512 a[L_Z][L_MV];
    UNROLL for (int z = 0; z < L_Z; z++) UNROLL for (int v = 0; v < L_MV; v++)
        a[z][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (z * L_MV + v) * 16);
    /* the next call's chains (the next tile's, or the next position's): acc
     * of every group waits in L3 between column blocks */
    UNROLL for (int q = 0; q < L_Z * L_MV; q++) _mm_prefetch((const char *)(acc + L_TILE_POS + q * 16), _MM_HINT_T0);
    for (int c = 0; c < ns; c++) {
        __m512 w[L_Z];
        UNROLL for (int z = 0; z < L_Z; z++) w[z] = _mm512_load_ps(wp + c * L_MR + z * 16);
        UNROLL for (int v = 0; v < L_MV; v++) {
            const __m512 b = _mm512_set1_ps(xb[v * xs + c * 32]);
            UNROLL for (int z = 0; z < L_Z; z++) a[z][v] = _mm512_fmadd_ps(w[z], b, a[z][v]);
        }
    }
    UNROLL for (int z = 0; z < L_Z; z++) UNROLL for (int v = 0; v < L_MV; v++)
        _mm512_store_ps(acc + (z * L_MV + v) * 16, a[z][v]);
}

/* A tile's chains (acc: [32 positions][L_TILES tiles][L_Z][L_MV] zmm, at
 * the tile's) to its outputs:
 * hsum16's adds lane by lane (t = a0 + a1, then halves 8, 4, 2, 1), times
 * the row scale for int8. */
AI void lanes_finish(int e, const df_weight *w, int64_t r, const float *acc, float *Y, int64_t ldy) {
    UNROLL for (int z = 0; z < L_Z; z++) UNROLL for (int v = 0; v < L_MV; v++) {
        const float *q = acc + (z * L_MV + v) * 16;
        __m512 t[16];
        UNROLL for (int l = 0; l < 16; l++) t[l] = _mm512_add_ps(_mm512_load_ps(q + l * L_POS), _mm512_load_ps(q + (16 + l) * L_POS));
        UNROLL for (int l = 0; l < 8; l++) t[l] = _mm512_add_ps(t[l], t[l + 8]);
        UNROLL for (int l = 0; l < 4; l++) t[l] = _mm512_add_ps(t[l], t[l + 4]);
        __m512 s = _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3]));
        if (e == E_I8) s = _mm512_mul_ps(s, _mm512_loadu_ps((const float *)w->scale + r + z * 16));
        _mm512_storeu_ps(Y + v * ldy + z * 16, s);
    }
}

/* Floats of lanes_prod's scratch: wp and xb, and acc per group of vectors. */
enum {
    L_XS = L_STEPS * 32 + L_XPAD, /* floats from one vector's x to the next in xb */
    L_SCRATCH = 32 * L_TILES * L_STEPS * L_MR + L_MV * L_XS,
    L_SCRATCH_GROUP = 32 * L_POS
};

/* Rows [r0, r0 + rows) x vectors [0, n) (multiples of L_MR and L_MV), x in
 * position form ldx floats apart; Y[v * ldy + j] is row r0 + j; scratch
 * (64-byte aligned) L_SCRATCH + n / L_MV x L_SCRATCH_GROUP floats. Rows in
 * panels of L_TILES tiles; a panel by blocks of L_STEPS steps: its weights
 * of the block decoded and transposed into wp ([position][tile][step][48]),
 * then every group of 8 vectors (its x of the block read in place, or
 * copied into xb) over every position and tile; chains parked in acc
 * between blocks. */
AI void lanes_prod(int e, const df_weight *w, int64_t r0, int64_t rows, const float *X, int64_t ldx, int n,
                   float *Y, int64_t ldy, float *scratch) {
    const int64_t cols = w->cols, steps = (cols + 31) / 32, es = esize(e);
    const int groups = n / L_MV;
    const int64_t xs = L_XS;
    float *wp = scratch, *xb = wp + 32 * L_TILES * L_STEPS * L_MR, *acc = xb + L_MV * L_XS;
    for (int64_t pr = 0; pr < rows; pr += L_TILES * L_MR) {
        const int nt = (int)((rows - pr) / L_MR < L_TILES ? (rows - pr) / L_MR : L_TILES);
        for (int64_t s0 = 0; s0 < steps; s0 += L_STEPS) {
            const int ns = (int)(steps - s0 < L_STEPS ? steps - s0 : L_STEPS);
            for (int t = 0; t < nt; t++)
                for (int z = 0; z < L_Z; z++) {
                    const char *row = (const char *)w->data + (r0 + pr + t * L_MR + z * 16) * cols * es;
                    for (int i = 0; i < ns; i++) {
                        __m512 lo[16], hi[16];
                        UNROLL for (int j = 0; j < 16; j++) lanes_wstep(e, row + j * cols * es, cols, s0 + i, &lo[j], &hi[j]);
                        float *o = wp + ((int64_t)t * L_STEPS + i) * L_MR + z * 16;
                        const int64_t ps = (int64_t)L_TILES * L_STEPS * L_MR; /* floats from one position to the next */
                        transpose16(lo);
                        UNROLL for (int q = 0; q < 16; q++) _mm512_store_ps(o + q * ps, lo[q]);
                        transpose16(hi);
                        UNROLL for (int q = 0; q < 16; q++) _mm512_store_ps(o + (16 + q) * ps, hi[q]);
                    }
                }
            /* the weights of the next block (this panel's, else the next
             * panel's first), a few rows at each (group, position) */
            int64_t nr0 = r0 + pr, ns0 = s0 + L_STEPS, nrows = (int64_t)nt * L_MR;
            if (ns0 >= steps) {
                ns0 = 0, nr0 += (int64_t)L_TILES * L_MR;
                nrows = r0 + rows - nr0 < L_TILES * L_MR ? r0 + rows - nr0 : L_TILES * L_MR;
            }
            const int64_t ncols = (ns0 + L_STEPS) * 32 < cols ? L_STEPS * 32 : cols - ns0 * 32;
            const int64_t nbytes = ncols * es;
            const int64_t slots = (int64_t)groups * 32;
            /* x read in place where the block has no tail step and vectors
             * are not a multiple of 4 KB apart (kn_px_len), else copied */
            const int in_place = (s0 + ns) * 32 <= cols && ldx % L_SET_FLOATS != 0;
            const int64_t xst = in_place ? ldx : xs;
            for (int g = 0; g < groups; g++) {
                const float *xg = in_place ? X + (int64_t)g * L_MV * ldx + s0 * 32 : xb;
                if (!in_place)
                    for (int v = 0; v < L_MV; v++) lanes_xcopy(X + (int64_t)(g * L_MV + v) * ldx, cols, s0, ns, xb + v * xs);
                for (int p = 0; p < 32; p++) {
                    if (g + 1 < groups) { /* a 32nd of the next group's x */
                        enum { PARTS = 32 / L_MV }; /* of a vector's x of the block */
                        const float *nx = X + (int64_t)((g + 1) * L_MV + p % L_MV) * ldx + s0 * 32 + (p / L_MV) * ns * (32 / PARTS);
                        for (int o = 0; o < ns * 128 / PARTS; o += 64) _mm_prefetch((const char *)nx + o, _MM_HINT_T1);
                    }
                    const int64_t k = (int64_t)g * 32 + p;
                    for (int64_t q = k * nrows / slots; q < (k + 1) * nrows / slots; q++) {
                        const char *nw = (const char *)w->data + ((nr0 + q) * cols + ns0 * 32) * es;
                        for (int64_t o = 0; o < nbytes; o += 64) _mm_prefetch(nw + o, _MM_HINT_T1);
                    }
                    for (int t = 0; t < nt; t++)
                        lanes_kern(wp + ((int64_t)p * L_TILES + t) * L_STEPS * L_MR, xg + p, xst, ns,
                                   acc + ((int64_t)g * 32 + p) * L_POS + t * L_TILE_POS, s0 == 0);
                }
            }
        }
        for (int g = 0; g < groups; g++)
            for (int t = 0; t < nt; t++)
                lanes_finish(e, w, r0 + pr + t * L_MR, acc + (int64_t)g * L_SCRATCH_GROUP + t * L_TILE_POS,
                             Y + (int64_t)g * L_MV * ldy + pr + t * L_MR, ldy);
    }
}

/* ---- 6. tiles per type ----------------------------------------------------- */

/* measured on the 16-core host (bench --kernels, gemm column): dense 4x3
 * beat 4x2 by 14-27% (and a 512-token prefill by 26%), 4-bit 4x2 beat 4x3;
 * on a Zen 4 VM fp8 2x4 beat 2x2 by 31% (one thread) */
enum { D_MR = 4, D_MV = 3, F_MR = 2, F_MV = 4, N_MR = 4, N_MV = 2 };

/* The D_MR x D_MV dense tile at row r over columns [c0, c1) (kn_part_fn:
 * the driver's column blocks, so a block's x stays in L1 across tiles):
 * dense_tile's steps in dense_tile's order, a0 then a1 parked in acc
 * between parts. */
enum { DENSE_PART_ACC = 2 * D_MR * D_MV * 16 };
AI void dense_part(int e, const df_weight *w, int64_t r, int64_t c0, int64_t c1, const float *X, int64_t ldx,
                   float *acc, float *Y, int64_t ldy) {
    const int64_t cols = w->cols;
    const char *row[TR];
    __m512 a0[TR][TV], a1[TR][TV];
    dense_start(e, w, r, D_MR, D_MV, c0 ? acc : NULL, row, a0, a1);
    dense_steps(e, row, D_MR, D_MV, X, ldx, c0, c1, 0, 0, a0, a1);
    if (c1 < cols / 32 * 32)
        UNROLL for (int j = 0; j < D_MR; j++) UNROLL for (int v = 0; v < D_MV; v++) {
            _mm512_store_ps(acc + (j * D_MV + v) * 16, a0[j][v]);
            _mm512_store_ps(acc + ((D_MR + j) * D_MV + v) * 16, a1[j][v]);
        }
    else
        dense_finish(e, w, r, row, D_MR, D_MV, X, ldx, Y, ldy, a0, a1);
}
#define DENSE_PART_(name, e)                                                                                   \
    static void name##_part(const df_weight *w, int64_t r, int64_t c0, int64_t c1, const float *X, int64_t ldx, \
                            float *acc, float *Y, int64_t ldy) { dense_part(e, w, r, c0, c1, X, ldx, acc, Y, ldy); }
DENSE_PART_(f32, E_F32)
DENSE_PART_(bf16, E_BF16)
DENSE_PART_(f16, E_F16)
DENSE_PART_(i8, E_I8)
#undef KN_PART
#define KN_PART(name) name##_part, 32, DENSE_PART_ACC
#define DENSE_LANES_(name, e)                                                                                   \
    static void name##_lanes(const df_weight *w, int64_t r0, int64_t rows, const float *X, int64_t ldx, int n, \
                             float *Y, int64_t ldy, float *scratch) {                                          \
        lanes_prod(e, w, r0, rows, X, ldx, n, Y, ldy, scratch);                                               \
    }
DENSE_LANES_(f32, E_F32)
DENSE_LANES_(bf16, E_BF16)
DENSE_LANES_(f16, E_F16)
DENSE_LANES_(i8, E_I8)
#undef KN_LANES
#define KN_LANES(name) name##_lanes, L_MR, L_MV, L_SCRATCH, L_SCRATCH_GROUP
KN_LEVEL(kn_matmul_avx512, bf16_prep, nib_prep_i4, nib_prep_mx)

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
