/* matvec_avx2.c — AVX2 + FMA + F16C tiles for every weight type.
 *
 * Owns: kn_matmul_avx2 (a table of tiles per weight type handed to the
 * shared driver, matvec_driver.c). Compiled with -mavx2 -mfma -mf16c; only
 * reached when kn_detect() says the CPU has them. matvec_avxvnni.c builds
 * this file again with -mavxvnni and KN_AVXVNNI (kn_matmul_avxvnni: the
 * 4-bit tiles' integer sums by vpdpbusd, the same values). Refuses: allocation, scalar
 * float math on the data path (every product and sum is an explicit
 * intrinsic, so the compiler cannot contract or reorder it).
 *
 * A tile computes nr rows x nv vectors (nr, nv compile-time: NR x 1 for
 * decode, a per-type mr x mv for prefill, and 1-row variants of both). Every
 * dense (row, vector) output owns one accumulator fed in a fixed order that
 * depends only on cols (each full 16-column step: columns 0-7, then 8-15,
 * except bf16: the step's even columns, then its odd ones, from one 32-byte
 * load split by a shift and a mask, x laid out to match by bf16_prep; then
 * a lone 8-column step; then the zero-padded tail), then hsum. One chain an
 * output lets a prefill tile hold 4 x 2 outputs in the 16 registers (with
 * two accumulators an output, 3 x 2 and the x loads of every row: bf16 79
 * -> 93 GFLOP/s a thread on Zen 4). All tiles run the same always-inlined
 * body, so a value does not depend on which tile computed it (kernels.h's
 * contract).
 *
 * fp8 blocks keep per-block partials in two lane sets (p0: each 16-column
 * step's columns 0-7 and a lone 8-column step, p1: columns 8-15 and the
 * padded tail) and multiply them by the scale once per block into a0 / a1
 * (see matvec.c for the value computed); int4 / mxfp4 groups run in
 * integers on a fixed-point x (section 4, one accumulator an output).
 *
 * Streaming: for one vector each tile prefetches the columns it reads of
 * the rows PF_TILES tiles on (as matvec_avx512.c, which looks one of its
 * 8-row tiles ahead); many vectors, and a matrix's last tiles, prefetch
 * KN_PF bytes ahead in each row, and the head of the next tile's rows
 * (matvec_prefetch.h).
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
enum { NR = 4, NR_L1 = NR /* 16 ymm registers: no room for more rows */, TR = 5, TV = 4, PF_SCALES = 64 /* groups ahead */ };
/* How many tiles ahead a one-vector tile prefetches: into L1 (AMD CPUs)
 * two, as many bytes as matvec_avx512.c's 8-row L1 tile looks ahead; into
 * L2 one. A 2-vCPU Zen 5 VM, two threads from DRAM, one tile against two
 * (`kn_stream T avx2 65536 7168 1 1 2`, alternating, GB/s): bf16 44.1-45.0
 * (one low 39.1) -> 44.7-47.7 in 8 of 8 rounds, int8 37.7-45.3 -> 41.1-42.6;
 * the 4-bit tiles, bound by their arithmetic, within noise (3 or 4 tiles:
 * no better). The Xeon host's AVX-512 tiles (the L2 form) lost with 2 or 3
 * (bench/cpu_NOTES.md, twentieth session). */
#ifndef KN_AVX2_PF_TILES_L1
#define KN_AVX2_PF_TILES_L1 2
#endif
#define PF_TILES(l1) ((l1) ? KN_AVX2_PF_TILES_L1 : 1)
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

AI void dense_tile(int e, const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X,
                   int64_t ldx, float *Y, int64_t ldy) {
    const int64_t cols = w->cols;
    const int es = esize(e);
    const char *row[TR];
    __m256 acc[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        row[j] = (const char *)w->data + (r + j) * cols * es;
        UNROLL for (int v = 0; v < nv; v++) acc[j][v] = _mm256_setzero_ps();
    }
    /* one vector: the same columns of the rows PF_TILES tiles on; else
     * KN_PF bytes ahead in each row */
    const int64_t next = kn_pf_next_tile(w->rows, r, nr, nv, cols * es, PF_TILES(l1));
    if (!next) kn_pf_rows(w->data, cols * es, r + nr, nr, w->rows);
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        /* 16 columns are 16-64 bytes: one prefetch per 64 */
        if (es == 4 || (c & (es == 2 ? 16 : 48)) == 0) {
            if (next) UNROLL for (int j = 0; j < nr; j++) kn_pf_next(row[j] + next + c * es, l1);
            else UNROLL for (int j = 0; j < nr; j++) kn_pf(row[j] + c * es, 64);
        }
        __m256 x0[TV], x1[TV]; /* loaded once, shared by the tile's rows */
        UNROLL for (int v = 0; v < nv; v++) {
            x0[v] = _mm256_loadu_ps(X + v * ldx + c);
            x1[v] = _mm256_loadu_ps(X + v * ldx + c + 8);
        }
        UNROLL for (int j = 0; j < nr; j++) {
            __m256 w0, w1;
            if (e == E_BF16) { /* even columns (low halves) and odd ones: x comes as bf16_prep lays it */
                __m256i d = _mm256_loadu_si256((const __m256i *)(row[j] + c * 2));
                __asm__("" : "+x"(d)); /* one load for both halves (gcc would fold it into each) */
                w0 = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
                w1 = _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32((int)0xffff0000u)));
            } else {
                w0 = ld8(e, row[j], c), w1 = ld8(e, row[j], c + 8);
            }
            UNROLL for (int v = 0; v < nv; v++)
                acc[j][v] = _mm256_fmadd_ps(w1, x1[v], _mm256_fmadd_ps(w0, x0[v], acc[j][v]));
        }
    }
    if (c + 8 <= cols) {
        UNROLL for (int j = 0; j < nr; j++) {
            __m256 w0 = ld8(e, row[j], c);
            UNROLL for (int v = 0; v < nv; v++)
                acc[j][v] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(X + v * ldx + c), acc[j][v]);
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
                acc[j][v] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt[v]), acc[j][v]);
        }
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++) {
        float s = hsum8(acc[j][v]);
        if (e == E_I8) {
            /* row scale after the sum, as a vector op so it is never contracted */
            __m128 m = _mm_mul_ss(_mm_set_ss(s), _mm_set_ss(((const float *)w->scale)[r + j]));
            s = _mm_cvtss_f32(m);
        }
        Y[v * ldy + j] = s;
    }
}

/* x for the bf16 tiles: per full 16-column step its 8 even columns, then
 * its 8 odd ones (a row's 32 bytes there split into the two by one shift and
 * one mask); the columns past the last full step as they are. */
static void bf16_prep(const float *x, int64_t cols, float *out) {
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        const __m256 a = _mm256_loadu_ps(x + c), b = _mm256_loadu_ps(x + c + 8);
        /* shuffle_ps takes 0,2 | 1,3 of each 4; permute4x64 orders the halves */
        const __m256i e = _mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88));
        const __m256i o = _mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xdd));
        _mm256_storeu_ps(out + c, _mm256_castsi256_ps(_mm256_permute4x64_epi64(e, 0xd8)));
        _mm256_storeu_ps(out + c + 8, _mm256_castsi256_ps(_mm256_permute4x64_epi64(o, 0xd8)));
    }
    if (c < cols) memcpy(out + c, x + c, (size_t)(cols - c) * sizeof *out);
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
AI void fp8_tile(const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    (void)l1; /* its rows are prefetched KN_PF bytes ahead in themselves */
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
AI __m256 scales8_full(int k, const uint8_t *sp) {
    switch (k) {
    case N_MX: {
        uint64_t e8;
        memcpy(&e8, sp, 8);
        const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)e8));
        const __m256i bits = _mm256_slli_epi32(e, 23);
        /* e << 23 is the value unless a byte is 0 or 255 (looked for on the
         * scalar ports: a zero byte of e8 or of ~e8) */
        const uint64_t lo = 0x0101010101010101u, hi = 0x8080808080808080u;
        if (!(((e8 - lo) & ~e8 & hi) | ((~e8 - lo) & e8 & hi))) return _mm256_castsi256_ps(bits);
        __m256i b = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000),
                                       _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
        b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
        return _mm256_castsi256_ps(b);
    }
    case N_I4_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)sp)), 16));
    case N_I4_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sp));
    default: return _mm256_loadu_ps((const float *)sp);
    }
}
AI __m256 scales8(int k, const void *scale, int64_t idx, int64_t left) {
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    const uint8_t *sp = (const uint8_t *)scale + idx * ssz;
    if (left >= 8) return scales8_full(k, sp);
    uint8_t tmp[32] = {0};
    memcpy(tmp, sp, (size_t)(left * ssz));
    return scales8_full(k, tmp);
}

/* The 4-bit tiles in integers, as matvec_avx512.c's (same fixed point for
 * x, same exact integer sums a lane, so the same bound), per 64-column
 * chunk (two groups, 32 code bytes a row): a code becomes an unsigned byte
 * u = v + c0 (vpshufb; int4 u = q), vpmaddubsw multiplies it by x's signed
 * digit bytes in pairs (|u L| sums of four <= 12288: no saturation),
 * vpmaddwd adds pairs of those into dword lanes (lane i: columns 8i .. 8i+7,
 * group i / 4), and per lane
 *   (madd(t0, 256) + madd(t1, 1)) << 8 + madd(t2, 1) - c0 sum X
 * is the exact integer sum v X of its eight columns; then one rounding to
 * fp32 and one FMA with the lane's (group scale x 2^-s). */
enum { CH = 64, CH_BYTES = 256, CH_XS = 56 /* floats: the 8-group block's 2^-s, in its first chunk */ };

/* One chunk (64 columns from c; `full`, else only its first group) of
 * nib_tile's rows and vectors into acc; sx: each (row, vector)'s 8 lane
 * scales of the chunk's 8-group block, sidx: the chunk's place in it. */
AI void nib_chunk(int k, int nr, int nv, const uint8_t *const q[TR], int64_t c, int full,
                  const __m256 sx[TR][TV], __m256i sidx, const float *X, int64_t ldx, __m256 acc[TR][TV]) {
    const __m256i tab = k == N_MX
        ? _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                           12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)
        : _mm256_setzero_si256();
    const __m256i m0f = _mm256_set1_epi8(0x0f);
#ifndef KN_AVXVNNI
    const __m256i ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
#endif
    UNROLL for (int j = 0; j < nr; j++) {
        const __m256i b = full ? _mm256_loadu_si256((const __m256i *)(q[j] + c / 2))
                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(q[j] + c / 2)));
        __m256i ue = _mm256_and_si256(b, m0f), uo = _mm256_and_si256(_mm256_srli_epi16(b, 4), m0f);
        if (k == N_MX) {
            ue = _mm256_shuffle_epi8(tab, ue);
            uo = _mm256_shuffle_epi8(tab, uo);
        }
        UNROLL for (int v = 0; v < nv; v++) {
            const __m256i *xp = (const __m256i *)(X + v * ldx + c);
#ifdef KN_AVXVNNI
            /* the same integer per lane, by vpdpbusd (four u x L a lane) */
            __m256i a = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ue, _mm256_loadu_si256(xp + 0));
            a = _mm256_dpbusd_avx_epi32(a, uo, _mm256_loadu_si256(xp + 1));
            a = _mm256_slli_epi32(a, 8);
            a = _mm256_dpbusd_avx_epi32(a, ue, _mm256_loadu_si256(xp + 2));
            a = _mm256_dpbusd_avx_epi32(a, uo, _mm256_loadu_si256(xp + 3));
            a = _mm256_slli_epi32(a, 8);
            a = _mm256_dpbusd_avx_epi32(a, ue, _mm256_loadu_si256(xp + 4));
            a = _mm256_dpbusd_avx_epi32(a, uo, _mm256_loadu_si256(xp + 5));
            a = _mm256_add_epi32(a, _mm256_loadu_si256(xp + 6)); /* - c0 sum X */
#else
            const __m256i t0 = _mm256_add_epi16(_mm256_maddubs_epi16(ue, _mm256_loadu_si256(xp + 0)),
                                                _mm256_maddubs_epi16(uo, _mm256_loadu_si256(xp + 1)));
            const __m256i t1 = _mm256_add_epi16(_mm256_maddubs_epi16(ue, _mm256_loadu_si256(xp + 2)),
                                                _mm256_maddubs_epi16(uo, _mm256_loadu_si256(xp + 3)));
            const __m256i t2 = _mm256_add_epi16(_mm256_maddubs_epi16(ue, _mm256_loadu_si256(xp + 4)),
                                                _mm256_maddubs_epi16(uo, _mm256_loadu_si256(xp + 5)));
            __m256i a = _mm256_add_epi32(_mm256_madd_epi16(t0, k256), _mm256_madd_epi16(t1, ones));
            a = _mm256_add_epi32(_mm256_slli_epi32(a, 8), _mm256_madd_epi16(t2, ones));
            a = _mm256_add_epi32(a, _mm256_loadu_si256(xp + 6)); /* - c0 sum X */
#endif
            acc[j][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_permutevar8x32_ps(sx[j][v], sidx), acc[j][v]);
        }
    }
}

/* Each (row, vector)'s lane scales of the 8-group block from group g: the
 * weight scale times x's 2^-s (exact), and the scales' stream prefetched. */
AI void nib_block_scales(int k, const df_weight *w, const int64_t si[TR], int nr, int nv, int64_t g,
                         int64_t c, const float *X, int64_t ldx, __m256 sx[TR][TV]) {
    const int64_t ng = w->cols / 32;
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    UNROLL for (int j = 0; j < nr; j++) {
        const __m256 ws = scales8(k, w->scale, si[j] + g, ng - g);
        UNROLL for (int v = 0; v < nv; v++)
            sx[j][v] = _mm256_mul_ps(ws, _mm256_loadu_ps(X + v * ldx + c + CH_XS));
        _mm_prefetch((const char *)w->scale + (si[j] + g + PF_SCALES) * ssz, _MM_HINT_T0);
    }
}

/* Whole 8-group blocks of full chunks run unrolled for one vector (each
 * chunk's place in its block a constant); the chunks after them, and many
 * vectors, one at a time. Both do the same arithmetic per chunk, so the
 * split changes no bits. */
AI void nib_tile(int k, const df_weight *w, int64_t r, int nr, int nv, int l1, const float *X, int64_t ldx,
                 float *Y, int64_t ldy) {
    const int64_t cols = w->cols, ng = cols / 32, nfull = cols / CH, nch = (cols + CH - 1) / CH;
    const uint8_t *q[TR];
    int64_t si[TR];
    __m256 acc[TR][TV], sx[TR][TV];
    UNROLL for (int j = 0; j < nr; j++) {
        q[j] = (const uint8_t *)w->data + (r + j) * (cols / 2);
        si[j] = (r + j) * ng;
        UNROLL for (int v = 0; v < nv; v++) acc[j][v] = sx[j][v] = _mm256_setzero_ps();
    }
    const __m256i lane_grp = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const int ssz = k == N_MX ? 1 : k == N_I4_F32 ? 4 : 2;
    /* one vector: this chunk of the rows PF_TILES tiles on */
    const int64_t next = kn_pf_next_tile(w->rows, r, nr, nv, cols / 2, PF_TILES(l1));
    if (nv == 1 && !next) kn_pf_nib_rows(w, r + nr, nr, ssz);
    int64_t ch = 0;
    if (nv == 1) { /* (many vectors are bound by their decode; unrolled, they lost ~5%) */
        for (; ch + 4 <= nfull; ch += 4) {
            nib_block_scales(k, w, si, nr, nv, ch * 2, ch * CH, X, ldx, sx);
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
                kn_pf_step(q, nr, next, (ch + i) * CH / 2, l1);
                nib_chunk(k, nr, nv, q, (ch + i) * CH, 1, sx, _mm256_add_epi32(lane_grp, _mm256_set1_epi32(2 * i)), X,
                          ldx, acc);
            }
        }
    }
    for (; ch < nch; ch++) {
        const int64_t c = ch * CH;
        if ((ch & 3) == 0) nib_block_scales(k, w, si, nr, nv, ch * 2, c, X, ldx, sx);
        const __m256i sidx = _mm256_add_epi32(lane_grp, _mm256_set1_epi32((int)(ch & 3) * 2));
        kn_pf_step(q, nr, next, c / 2, l1);
        if (ch < nfull) nib_chunk(k, nr, nv, q, c, 1, sx, sidx, X, ldx, acc);
        else nib_chunk(k, nr, nv, q, c, 0, sx, sidx, X, ldx, acc);
    }
    UNROLL for (int j = 0; j < nr; j++) UNROLL for (int v = 0; v < nv; v++) Y[v * ldy + j] = hsum8(acc[j][v]);
}

/* 8 int32 as their three balanced digit bytes (X + 0x808080's bytes, each
 * xor 0x80): the top digit L0 of the 8 in bytes 0-7, L1 in 8-15, L2 in 16-23. */
AI __m256i digits8(__m256i X) {
    const __m256i sel = _mm256_setr_epi8(2, 6, 10, 14, 1, 5, 9, 13, 0, 4, 8, 12, -1, -1, -1, -1,
                                         2, 6, 10, 14, 1, 5, 9, 13, 0, 4, 8, 12, -1, -1, -1, -1);
    __m256i b = _mm256_shuffle_epi8(_mm256_add_epi32(X, _mm256_set1_epi32(0x808080)), sel);
    b = _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* x for nib_tile: per 64-column chunk (CH_BYTES, the last one zero-padded)
 * the digit planes L0e L0o L1e L1o L2e L2o (32 bytes each: a group's 16
 * even or odd columns at 16 g), -c0 sum X per lane (8 int32), and in each
 * 8-group block's first chunk the block's 2^-s (times half). Each group is
 * scaled so its largest |x| lies in [2^22, 2^23) (one step lower when it
 * would round above 8355711), at most by 2^126. */
AI void nib_prep(const float *x, int64_t cols, float *out, int c0, float half) {
    const int64_t ng = cols / 32, nch = (cols + CH - 1) / CH;
    if (ng % 2) memset((char *)out + (nch - 1) * CH_BYTES, 0, CH_BYTES);
    if (ng % 8) memset(out + (ng / 8) * 4 * CH + CH_XS, 0, 8 * sizeof(float));
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t g = 0; g < ng; g++) {
        char *o = (char *)out + (g / 2) * CH_BYTES + (g % 2) * 16;
        const float *xg = x + g * 32;
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
        const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
        __m256 mv = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, absm), _mm256_and_ps(x1, absm)),
                                  _mm256_max_ps(_mm256_and_ps(x2, absm), _mm256_and_ps(x3, absm)));
        mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1));
        mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0x4e));
        mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0xb1));
        /* (vmaxps drops NaNs, so they are looked for apart) */
        const __m256 un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q), _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q)),
                                       _mm256_or_ps(_mm256_cmp_ps(x2, x2, _CMP_UNORD_Q), _mm256_cmp_ps(x3, x3, _CMP_UNORD_Q)));
        const float m = _mm256_cvtss_f32(mv);
        __m256i Xe0 = _mm256_setzero_si256(), Xe1 = Xe0, Xo0 = Xe0, Xo1 = Xe0;
        float inv = 0.0f;
        if (_mm256_movemask_ps(un) || !(m <= 3.4028235e38f)) {
            inv = __builtin_nanf("");
        } else if (m > 0.0f) {
            uint32_t mb;
            memcpy(&mb, &m, 4);
            int e = (int)(mb >> 23); /* 0 for subnormal m: scaled by the most, 2^126 */
            int sh = e ? 149 - e : 126;
            if (sh > 126) sh = 126;
            uint32_t sb = (uint32_t)(sh + 127) << 23, ib = (uint32_t)(127 - sh) << 23;
            float sc, is;
            memcpy(&sc, &sb, 4), memcpy(&is, &ib, 4);
            if (m * sc > 8355711.5f) { /* one step lower: both exact powers of two */
                sc *= 0.5f;
                is *= 2.0f;
            }
            const __m256 s8 = _mm256_set1_ps(sc);
            /* even and odd columns: shuffle_ps takes 0,2 | 1,3 of each 4, permute4x64 orders them */
            const __m256 e0 = _mm256_shuffle_ps(x0, x1, 0x88), o0 = _mm256_shuffle_ps(x0, x1, 0xdd);
            const __m256 e1 = _mm256_shuffle_ps(x2, x3, 0x88), o1 = _mm256_shuffle_ps(x2, x3, 0xdd);
#define DF_ORD(v) _mm256_castsi256_ps(_mm256_permute4x64_epi64(_mm256_castps_si256(v), 0xd8))
            Xe0 = _mm256_cvtps_epi32(_mm256_mul_ps(DF_ORD(e0), s8));
            Xe1 = _mm256_cvtps_epi32(_mm256_mul_ps(DF_ORD(e1), s8));
            Xo0 = _mm256_cvtps_epi32(_mm256_mul_ps(DF_ORD(o0), s8));
            Xo1 = _mm256_cvtps_epi32(_mm256_mul_ps(DF_ORD(o1), s8));
#undef DF_ORD
            inv = is * half;
        }
        const __m256i de0 = digits8(Xe0), de1 = digits8(Xe1), do0 = digits8(Xo0), do1 = digits8(Xo1);
        for (int d = 0; d < 3; d++) { /* digit d of the 16 even columns at plane 2d, odd at 2d + 1 */
            const __m128i e0 = d < 2 ? _mm256_castsi256_si128(de0) : _mm256_extracti128_si256(de0, 1);
            const __m128i e1 = d < 2 ? _mm256_castsi256_si128(de1) : _mm256_extracti128_si256(de1, 1);
            const __m128i f0 = d < 2 ? _mm256_castsi256_si128(do0) : _mm256_extracti128_si256(do0, 1);
            const __m128i f1 = d < 2 ? _mm256_castsi256_si128(do1) : _mm256_extracti128_si256(do1, 1);
            __m128i ev = d == 1 ? _mm_unpackhi_epi64(e0, e1) : _mm_unpacklo_epi64(e0, e1);
            __m128i od = d == 1 ? _mm_unpackhi_epi64(f0, f1) : _mm_unpacklo_epi64(f0, f1);
            _mm_storeu_si128((__m128i *)(o + 64 * d), ev);
            _mm_storeu_si128((__m128i *)(o + 64 * d + 32), od);
        }
        /* lane m of the group (columns 8m .. 8m+7): dwords 4m' .. of Xe + Xo */
        const __m256i S0 = _mm256_add_epi32(Xe0, Xo0), S1 = _mm256_add_epi32(Xe1, Xo1);
        __m256i t = _mm256_hadd_epi32(S0, S1);
        t = _mm256_hadd_epi32(t, t); /* lane 0: m0 m2 . ., lane 1: m1 m3 . . */
        t = _mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
        t = _mm256_mullo_epi32(t, _mm256_set1_epi32(-c0));
        _mm_storeu_si128((__m128i *)(o + 192), _mm256_castsi256_si128(t));
        out[(g / 8) * 4 * CH + CH_XS + g % 8] = inv;
    }
}
static void nib_prep_i4(const float *x, int64_t cols, float *out) { nib_prep(x, cols, out, 8, 1.0f); }
static void nib_prep_mx(const float *x, int64_t cols, float *out) { nib_prep(x, cols, out, 12, 0.5f); }

/* ---- 5. tiles per type ----------------------------------------------------- */

/* rows x vectors for prefill, within the 16 registers: the accumulators
 * (dense: one an output; fp8: two and two block partials) plus the decoded
 * weights of the tile's rows and x. Zen 4 VM, one thread (bench --kernels,
 * gemm column): dense 5x2 (one accumulator: ten FMA chains, two more than
 * the FMA latency needs, x held in four registers; bf16 86 -> 96 GFLOP/s
 * against 4x2, 6x2 70, 3x2 76) beat 4x2, 3x2, 2x4 and 4x3, fp8 1x4 beat
 * 1x2, 2x2 and 1x3, 4-bit 2x4 (kn_stream, 24 vectors: 60 GFLOP/s) beat
 * 3x4, 2x5, 3x3, 4x3 (58-60) and 1x8 (54), and 2x6 (62 at multiples of 6
 * vectors) loses where a product's vectors are not: the last n % 6 run one
 * at a time (5 vectors: 49 against 57; K3's experts see ~9 in a 512-row
 * block). */
enum { D_MR = 5, D_MV = 2, F_MR = 1, F_MV = 4, N_MR = 2, N_MV = 4 };
#ifdef KN_AVXVNNI
KN_LEVEL(kn_matmul_avxvnni, bf16_prep, nib_prep_i4, nib_prep_mx)
#else
KN_LEVEL(kn_matmul_avx2, bf16_prep, nib_prep_i4, nib_prep_mx)

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
#endif /* KN_AVXVNNI */
