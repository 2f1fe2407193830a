/* matvec_amx.c — bf16 and MXFP4 products on Intel AMX tiles (level KN_AMX).
 *
 * Owns: kn_matmul_amx, and its parts for callers that pack x once per
 * product and split the rows over threads (kn_amx_x_init, kn_amx_x_pack,
 * kn_matmul_amx_x). With -DKN_AMX_EMU (matvec_amxemu_avx512.c) the same code
 * is built as *_emu over a plain-C model of the tile unit, so the layouts
 * are tested on any AVX-512 machine. Every other weight type,
 * and every other kernel, runs as KN_AVX512 (the dispatcher falls back when
 * this returns 0). Compiled with the Makefile's AVX512_FLAGS plus AMX_FLAGS;
 * only reached when matvec.c found AMX-TILE, AMX-BF16 and the kernel's
 * permission to use the tile data (arch_prctl).
 *
 * Exactness (the GPU's tensor-core argument, gpu_bf16_tc.cu): x is split into
 * three bf16 limbs, hi = rn(x), mid = rn(x - hi), lo = rn(x - hi - mid), each
 * difference exact, which carry x whole for normal x; a bf16 weight, and an
 * MXFP4 value (e2m1 times its e8m0 scale, folded into the bf16 exponent), is
 * exact in bf16, and bf16 x bf16 is exact in fp32. Each limb of each vector is
 * one column of B; TDPBF16PS sums a row's 32-column steps into its C element
 * in column order, step after step from zero, and then
 *   y = (C_hi + C_mid) + C_lo      (fp32, round to nearest)
 * The tile unit's own accumulation is not plain fp32 round-to-nearest per
 * product (bench/amx_probe.c: no simple model matches all of its bits), but
 * an element's sum depends only on its row of A and its column of B, so
 * row i of n vectors is bit-equal to vector i in any other call of this
 * code, whatever n, the row range, the thread or the group a vector lands
 * in (the tests check it). The AVX-512 tiles round differently, which is
 * why the dispatcher sends only products of KN_AMX_MIN_N or more vectors
 * here (kernels.h's exception for KN_AMX). The tile unit treats bf16 subnormals as zero and flushes
 * subnormal sums (DAZ, FTZ): a term below 2^-126 in magnitude is lost, which
 * only matters when |x| or a weight is that small. The bound of the tests,
 * (cols + 2) 2^-24 sum |w x|, holds with room.
 *
 * MXFP4 rows whose scales leave the range where every value is a normal
 * bf16 (e8m0 bytes 2..252: values 2^-126 .. 6 * 2^125) are computed by the
 * AVX-512 tiles instead, row by row, so a row's result depends on that row
 * alone. No real checkpoint has such scales.
 *
 * Work layout. Vectors in groups of up to GV = 10 (30 limb columns: B tile 0
 * holds columns 0-15, tile 1 the rest; column 3v + L is limb L of vector v),
 * groups in blocks whose packed B for one column chunk stays in L2. Rows in
 * tiles of 32 (A tiles 0 and 1, rows 0-15 and 16-31), columns in chunks of
 * KC: bf16 weights load straight from the matrix when all 32 rows are there;
 * MXFP4 rows (and a short bf16 tile) are decoded into a panel of 32 rows x
 * KC bf16 first (rows past the range are zero). Measured on a 16-core Xeon
 * (bench/cpu_NOTES.md, fifteenth session), one thread: MXFP4 1536 x 7168 at
 * 8 / 18 / 32 vectors 124 / 173 / 185 GFLOP/s (AVX-512 70), bf16 12288 x
 * 7168 at 256 vectors 200 (AVX-512 70).
 * An MXFP4 step of 32 columns holds the block's even columns then its odd
 * ones (the decode's natural order); B's rows follow the same order.
 * C tiles 0-3 = (A tile, B tile) (0,0) (0,1) (1,0) (1,1); A 4, 5; B 6, 7.
 */
#include "kernels.h"
#include "../base/err.h"
#include "../format/dtype.h"
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* Column chunks (-D to try others; bits do not depend on them). Sixteenth
 * session, 16-core Xeon, bench/kn_stream.c at 1 and 16 threads: panels of
 * 256 or 512 columns and in-place chunks of 512 or 2048 were no faster than
 * 1024 on MXFP4 3072 x 3584 / 3584 x 3072 (18 vectors) and bf16 12288 x 7168
 * (512) / 2048 x 18432 (256), mostly slower. */
#ifndef KN_AMX_KC
#define KN_AMX_KC 1024
#endif
#ifndef KN_AMX_KC_PANEL
#define KN_AMX_KC_PANEL 1024
#endif

enum {
    GV = 10,                /* vectors per group */
    KSTEP = 32,             /* columns per tile step */
    SC_LO = 2, SC_HI = 252, /* e8m0 bytes whose values stay normal bf16 */
    PF_STEPS = 8,           /* bf16 rows from memory: prefetched 8 steps (512 bytes) ahead */
    KC = KN_AMX_KC,         /* columns per chunk of bf16 rows read in place (32 rows: 64 KB) */
    KC_PANEL = KN_AMX_KC_PANEL, /* ... of rows decoded into the panel (MXFP4) */
    RP = 8,                 /* row tiles per panel (their C: RP x groups x 4 KB, in L2) */
};

/* packed B bytes of one column chunk for a block of groups (kept in L2
 * while the chunk's rows pass every group): the weights stream once per block */
#ifndef KN_AMX_L2_B
#define KN_AMX_L2_B (1 << 20)
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* ---- the tile operations (real, or a plain-C model for tests) ------------- */

#ifdef KN_AMX_EMU
#define NAME(f) f##_emu
typedef struct {
    amx_cfg cfg;
    uint8_t t[8][16][64];
} tiles;
static float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static void t_config(tiles *T, const amx_cfg *c) { T->cfg = *c; }
static void t_load(tiles *T, int t, const void *p, int64_t stride) {
    memset(T->t[t], 0, sizeof T->t[t]);
    for (int r = 0; r < T->cfg.rows[t]; r++) memcpy(T->t[t][r], (const uint8_t *)p + r * stride, T->cfg.colsb[t]);
}
static void t_store(tiles *T, int t, void *p, int64_t stride) {
    for (int r = 0; r < T->cfg.rows[t]; r++) memcpy((uint8_t *)p + r * stride, T->t[t][r], T->cfg.colsb[t]);
}
static void t_zero(tiles *T, int t) { memset(T->t[t], 0, sizeof T->t[t]); }
/* C[m][n] += sum over k pairs, each pair's two products added in turn */
static void t_dp(tiles *T, int c, int a, int b) {
    for (int m = 0; m < T->cfg.rows[a]; m++)
        for (int n = 0; n < T->cfg.colsb[b] / 4; n++) {
            float acc;
            memcpy(&acc, &T->t[c][m][4 * n], 4);
            for (int k2 = 0; k2 < T->cfg.rows[b]; k2++) {
                uint16_t a2[2], b2[2];
                memcpy(a2, &T->t[a][m][4 * k2], 4);
                memcpy(b2, &T->t[b][k2][4 * n], 4);
                acc += bf16f(a2[0]) * bf16f(b2[0]);
                acc += bf16f(a2[1]) * bf16f(b2[1]);
            }
            memcpy(&T->t[c][m][4 * n], &acc, 4);
        }
}
static void t_release(tiles *T) { (void)T; }
#define T_LOAD(t, p, s) t_load(T, t, p, s)
#define T_STORE(t, p, s) t_store(T, t, p, s)
#define T_ZERO(t) t_zero(T, t)
#define T_DP(c, a, b) t_dp(T, c, a, b)
#else
#define NAME(f) f
typedef struct {
    int unused;
} tiles;
static void t_config(tiles *T, const amx_cfg *c) {
    (void)T;
    _tile_loadconfig(c);
}
static void t_release(tiles *T) {
    (void)T;
    _tile_release();
}
#define T_LOAD(t, p, s) _tile_loadd(t, p, s)
#define T_STORE(t, p, s) _tile_stored(t, p, s)
#define T_ZERO(t) _tile_zero(t)
#define T_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* ---- B: the limbs of a group's vectors, packed as tiles ------------------- */

/* 16 floats as their three bf16 limbs (round to nearest even each). */
static inline void split16(__m512 x, __m256i *h, __m256i *m, __m256i *l) {
    const __m256bh bh = _mm512_cvtneps_pbh(x);
    const __m512 fh = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)bh), 16));
    const __m512 r1 = _mm512_sub_ps(x, fh);
    const __m256bh bm = _mm512_cvtneps_pbh(r1);
    const __m512 fm = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)bm), 16));
    const __m256bh bl = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, fm));
    *h = (__m256i)bh, *m = (__m256i)bm, *l = (__m256i)bl;
}

/* Group layout: per step, B tile 0 (16 rows x nc0 columns of 4 bytes), then
 * tile 1 (16 x nc1); row k2 of a tile holds, per column, the limbs of tile
 * positions 2 k2 and 2 k2 + 1. nv vectors of X (the rest of the group's
 * columns zero). perm: the MXFP4 order (even columns of the step, then odd). */
static void pack_group(const float *X, int64_t cols, int nv, int nc0, int nc1, int perm, uint8_t *B) {
    const int64_t steps = cols / KSTEP, sb = 64 * (int64_t)(nc0 + nc1);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    memset(B, 0, (size_t)(sb * steps));
    for (int v = 0; v < nv; v++) {
        const float *x = X + (int64_t)v * cols;
        for (int64_t s = 0; s < steps; s++) {
            __m512 a = _mm512_loadu_ps(x + s * KSTEP), b = _mm512_loadu_ps(x + s * KSTEP + 16);
            if (perm) {
                const __m512 e = _mm512_permutex2var_ps(a, ie, b), o = _mm512_permutex2var_ps(a, io, b);
                a = e, b = o;
            }
            __m256i la[3], lb[3];
            split16(a, &la[0], &la[1], &la[2]);
            split16(b, &lb[0], &lb[1], &lb[2]);
            for (int L = 0; L < 3; L++) {
                const int col = 3 * v + L, t = col >= 16, c = col - 16 * t, nc = t ? nc1 : nc0;
                uint8_t *tb = B + s * sb + (t ? 64 * nc0 : 0) + 4 * c;
                /* positions 0-15 then 16-31 as 16 u32 pairs: rows k2 = 0..15 */
                uint32_t pr[16];
                _mm256_storeu_si256((__m256i *)pr, la[L]);
                _mm256_storeu_si256((__m256i *)(pr + 8), lb[L]);
                for (int k2 = 0; k2 < 16; k2++) memcpy(tb + (int64_t)k2 * 4 * nc, &pr[k2], 4);
            }
        }
    }
}

/* ---- A: MXFP4 rows decoded to bf16 ----------------------------------------- */

/* e2m1 codes as bf16 bits, each twice: entry 2c for the first block of a
 * pair, 2c + 1 for the second (the table of vpermw, 32 entries) */
static const uint16_t E2M1_BF16_2[32] = {
    0x0000, 0x0000, 0x3f00, 0x3f00, 0x3f80, 0x3f80, 0x3fc0, 0x3fc0,
    0x4000, 0x4000, 0x4040, 0x4040, 0x4080, 0x4080, 0x40c0, 0x40c0,
    0x8000, 0x8000, 0xbf00, 0xbf00, 0xbf80, 0xbf80, 0xbfc0, 0xbfc0,
    0xc000, 0xc000, 0xc040, 0xc040, 0xc080, 0xc080, 0xc0c0, 0xc0c0,
};

/* Row r's scales all in [SC_LO, SC_HI]? */
static int mx_row_ok(const df_weight *w, int64_t r) {
    const int64_t nb = w->cols / 32;
    const uint8_t *s = (const uint8_t *)w->scale + r * nb;
    const __m512i lo = _mm512_set1_epi8((char)SC_LO), hi = _mm512_set1_epi8((char)SC_HI);
    int64_t i = 0;
    for (; i + 64 <= nb; i += 64) {
        const __m512i v = _mm512_loadu_si512(s + i);
        if (_mm512_cmplt_epu8_mask(v, lo) | _mm512_cmpgt_epu8_mask(v, hi)) return 0;
    }
    for (; i < nb; i++)
        if (s[i] < SC_LO || s[i] > SC_HI) return 0;
    return 1;
}

/* Row r, blocks [b0, b1), into out (bf16): per 32-column block its 16 even
 * columns, then its 16 odd ones, each e2m1 value with the block's scale
 * added to its exponent (nonzero codes only). Two blocks at a time: the
 * table gets the pair's two scales in its even and odd entries (one masked
 * add), and each code looks up entry 2c (first block) or 2c + 1. */
static void mx_decode_row(const df_weight *w, int64_t r, int64_t b0, int64_t b1, uint16_t *out) {
    const uint8_t *q = (const uint8_t *)w->data + r * (w->cols / 2);
    const uint8_t *sc = (const uint8_t *)w->scale + r * (w->cols / 32);
    const __m512i tab = _mm512_loadu_si512(E2M1_BF16_2), m30 = _mm512_set1_epi16(30), one = _mm512_set1_epi16(1);
    const __m512i bias = _mm512_set1_epi16(127);
    const __mmask32 nonzero = ~(__mmask32)0x00030003u; /* entries of codes 0 and 8 (+-0) stay 0 */
    for (int64_t c0 = b0; c0 < b1; c0 += 32) {
        const int64_t c1 = c0 + 32 < b1 ? c0 + 32 : b1, nb = c1 - c0;
        /* the blocks' exponent offsets, (s - 127) * 128, as 16-bit words */
        uint16_t ew[32];
        const __mmask32 km = nb >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << nb) - 1u);
        const __m512i s16 = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(km, sc + c0));
        _mm512_storeu_si512(ew, _mm512_slli_epi16(_mm512_sub_epi16(s16, bias), 7));
        uint16_t *o = out + 32 * (c0 - b0);
        const uint8_t *qb = q + 16 * c0;
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qb + 16 * b)));
            /* 2 x code: low nibble (even column), high nibble (odd column) */
            const __m512i lo = _mm512_and_si512(_mm512_slli_epi16(bytes, 1), m30);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 3), m30);
            int32_t e2;
            memcpy(&e2, ew + b, 4); /* the pair's offsets: even entries, odd entries */
            const __m512i t = _mm512_mask_add_epi16(tab, nonzero, tab, _mm512_set1_epi32(e2));
            _mm512_storeu_si512(o + 32 * b, _mm512_permutexvar_epi16(_mm512_shuffle_i64x2(lo, hi, 0x44), t));
            _mm512_storeu_si512(o + 32 * b + 32,
                                _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_shuffle_i64x2(lo, hi, 0xee), one), t));
        }
        if (b < nb) { /* an odd last block */
            const __m512i bytes =
                _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qb + 16 * b))));
            const __m512i lo = _mm512_and_si512(_mm512_slli_epi16(bytes, 1), m30);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 3), m30);
            const __m512i t = _mm512_mask_add_epi16(tab, nonzero, tab, _mm512_set1_epi16((short)ew[b]));
            _mm512_storeu_si512(o + 32 * b, _mm512_permutexvar_epi16(_mm512_shuffle_i64x2(lo, hi, 0x44), t));
        }
    }
}

/* ---- the walk ---------------------------------------------------------------- */

typedef struct {
    const df_weight *w;
    int64_t cols, steps, sb;  /* sb: packed B bytes per step of a group */
    int nc0, nc1;             /* columns of B tiles 0 and 1 (nc1 may be 0) */
    uint16_t *panel;          /* 32 rows x kc columns, bf16 */
    int64_t kc;               /* columns per chunk: KC, or KC_PANEL where rows go through the panel */
    float *cst;               /* per tile of a panel and group of a block: C, [32][32] floats */
} walk;

/* One 32-row tile against one packed group, in parts: C zeroed (begin);
 * steps [s0, s1) with A (row i of the tile at A + i * lda, step s0 at A)
 * and the group's packed B (steps; pf: A streams from memory, prefetch
 * it); C stored to or reloaded from memory between column chunks (save,
 * load: exact, so a broken pass sums as an unbroken one); each output
 * combined, (hi + mid) + lo, into Y[v * ldy + yoff + i] (combine). */
static void tg_begin(tiles *T, const walk *k) {
    (void)T; /* the real tile operations name no state */
    T_ZERO(0);
    T_ZERO(2);
    if (k->nc1) {
        T_ZERO(1);
        T_ZERO(3);
    }
}

static void tg_steps(tiles *T, const walk *k, const uint8_t *A, int64_t lda, int pf, const uint8_t *B, int64_t s0,
                     int64_t s1) {
    (void)T;
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *a = A + (s - s0) * 64, *b = B + s * k->sb;
        if (pf && s + PF_STEPS < k->steps) /* rows streamed from memory: one line of each, ahead */
            for (int i = 0; i < 32; i++) _mm_prefetch((const char *)a + PF_STEPS * 64 + i * lda, _MM_HINT_T0);
        T_LOAD(4, a, lda);
        T_LOAD(5, a + 16 * lda, lda);
        T_LOAD(6, b, 4 * k->nc0);
        T_DP(0, 4, 6);
        T_DP(2, 5, 6);
        if (k->nc1) {
            T_LOAD(7, b + 64 * k->nc0, 4 * k->nc1);
            T_DP(1, 4, 7);
            T_DP(3, 5, 7);
        }
    }
}

/* C tiles to and from c ([32][32] floats: rows, limb columns); OP is
 * T_STORE or T_LOAD (the tile numbers must be constants) */
#define TG_C_TILES(OP, c)                                                                                            \
    do {                                                                                                             \
        OP(0, (c), 128);                                                                                             \
        OP(2, (c) + 16 * 32, 128);                                                                                   \
        if (k->nc1) {                                                                                                \
            OP(1, (c) + 16, 128);                                                                                    \
            OP(3, (c) + 16 * 32 + 16, 128);                                                                          \
        }                                                                                                            \
    } while (0)

static void tg_save(tiles *T, const walk *k, float *c) {
    (void)T;
    TG_C_TILES(T_STORE, c);
}

static void tg_load(tiles *T, const walk *k, const float *c) {
    (void)T;
    TG_C_TILES(T_LOAD, c);
}

static void tg_combine(const float *c, int nv, int rows, float *Y, int64_t ldy, int64_t yoff) {
    for (int v = 0; v < nv; v++)
        for (int i = 0; i < rows; i++) {
            const float *e = c + i * 32 + 3 * v;
            Y[(int64_t)v * ldy + yoff + i] = (e[0] + e[1]) + e[2];
        }
}

/* Rows [r, r + rows) of W (zero rows after them, up to 32), columns
 * [s0, s1) steps, into panel rows of stride ld bf16. */
static void fill_panel(const walk *k, int64_t r, int rows, int64_t s0, int64_t s1, uint16_t *panel, int64_t ld) {
    const df_weight *w = k->w;
    for (int i = 0; i < 32; i++) {
        uint16_t *o = panel + (int64_t)i * ld;
        if (i >= rows)
            memset(o, 0, (size_t)(s1 - s0) * KSTEP * 2);
        else if (w->type == WT_MXFP4)
            mx_decode_row(w, r + i, s0, s1, o);
        else
            memcpy(o, (const uint16_t *)w->data + (r + i) * k->cols + s0 * KSTEP, (size_t)(s1 - s0) * KSTEP * 2);
    }
}

/* ---- x packed once per product, then the rows -------------------------------- */

int64_t NAME(kn_amx_x_init)(kn_amx_x *px, const df_weight *w, int n) {
    memset(px, 0, sizeof *px);
    if ((w->type != WT_BF16 && w->type != WT_MXFP4) || w->cols % KSTEP || n < 1) return 0;
    px->w = w;
    px->n = n;
    px->nv = n < GV ? n : GV;
    px->groups = (n + px->nv - 1) / px->nv;
    px->nc0 = 3 * px->nv < 16 ? 3 * px->nv : 16;
    px->nc1 = 3 * px->nv - px->nc0;
    px->gbytes = 64 * (int64_t)(3 * px->nv) * (w->cols / KSTEP);
    return px->gbytes * px->groups;
}

void NAME(kn_amx_x_pack)(const kn_amx_x *px, const float *X, int g0, int g1) {
    const int64_t cols = px->w->cols;
    for (int g = g0; g < g1; g++) {
        const int v0 = g * px->nv, m = px->n - v0 < px->nv ? px->n - v0 : px->nv;
        pack_group(X + (int64_t)v0 * cols, cols, m, px->nc0, px->nc1, px->w->type == WT_MXFP4, px->B + g * px->gbytes);
    }
}

void NAME(kn_matmul_amx_x)(const kn_amx_x *px, const float *X, float *Y, int64_t ldy, int64_t row0, int64_t row1) {
    const df_weight *w = px->w;
    const int mx = w->type == WT_MXFP4, n = px->n, nv = px->nv, groups = px->groups;
    walk k = {.w = w, .cols = w->cols, .steps = w->cols / KSTEP, .nc0 = px->nc0, .nc1 = px->nc1};
    k.sb = 64 * (int64_t)(px->nc0 + px->nc1);
    /* groups per block: their B for one chunk of KC columns within KN_AMX_L2_B
     * (the weights stream once per block); blocks of equal size */
    k.kc = mx ? KC_PANEL : KC;
    int64_t most = KN_AMX_L2_B / (k.sb * (k.kc / KSTEP));
    if (most < 1) most = 1;
    const int blocks = (int)((groups + most - 1) / most), per_block = (groups + blocks - 1) / blocks;
    /* the panel only where rows are decoded or copied: MXFP4, or a bf16
     * range that is not a whole number of 32-row tiles */
    const int need_panel = mx || (row1 - row0) % 32;
    k.panel = need_panel ? aligned_alloc(64, (size_t)32 * k.kc * 2) : NULL;
    k.cst = aligned_alloc(64, (size_t)RP * per_block * 32 * 32 * sizeof(float));
    ASSERT((k.panel || !need_panel) && k.cst);

    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16;
    cfg.colsb[0] = cfg.colsb[2] = cfg.colsb[6] = (uint16_t)(4 * k.nc0);
    cfg.colsb[1] = cfg.colsb[3] = cfg.colsb[7] = (uint16_t)(4 * k.nc1);
    cfg.colsb[4] = cfg.colsb[5] = 64;
    if (!k.nc1) cfg.rows[1] = cfg.rows[3] = cfg.rows[7] = 0;
    tiles T_, *T = &T_;
    t_config(T, &cfg);

    /* One group: per 32-row tile, C stays in the tiles while the columns
     * pass in chunks of KC (rows straight from a whole bf16 tile, else
     * decoded or copied into the panel). Several: per panel of RP tiles and
     * chunk, every tile's rows pass every group of the block, so the block's
     * B for the chunk stays in L2; C tiles wait in cst between chunks (saved
     * and reloaded exactly: the sums of one unbroken pass, so the same bits). */
    const int64_t kc = k.kc / KSTEP;
    for (int g0 = 0; g0 < groups; g0 += per_block) {
        const int g1 = g0 + per_block < groups ? g0 + per_block : groups, ng = g1 - g0;
        for (int64_t p0 = row0; p0 < row1; p0 += 32 * RP) {
            const int64_t p1 = p0 + 32 * RP < row1 ? p0 + 32 * RP : row1;
            const int ntile = (int)((p1 - p0 + 31) / 32);
            for (int t = 0; t < (ng == 1 ? ntile : 1); t++) {
                const int t0 = ng == 1 ? t : 0, t1 = ng == 1 ? t + 1 : ntile;
                if (ng == 1) tg_begin(T, &k);
                for (int64_t s0 = 0; s0 < k.steps; s0 += kc) {
                    const int64_t s1 = s0 + kc < k.steps ? s0 + kc : k.steps;
                    for (int ti = t0; ti < t1; ti++) {
                        const int64_t r = p0 + 32 * (int64_t)ti;
                        const int rows = p1 - r < 32 ? (int)(p1 - r) : 32, direct = !mx && rows == 32;
                        const uint8_t *A = (const uint8_t *)w->data + (r * k.cols + s0 * KSTEP) * 2;
                        int64_t lda = k.cols * 2;
                        if (!direct) {
                            fill_panel(&k, r, rows, s0, s1, k.panel, k.kc);
                            A = (const uint8_t *)k.panel, lda = k.kc * 2;
                        }
                        for (int g = g0; g < g1; g++) {
                            float *c = k.cst + ((int64_t)ti * per_block + (g - g0)) * 32 * 32;
                            if (ng > 1) {
                                if (s0 == 0)
                                    tg_begin(T, &k);
                                else
                                    tg_load(T, &k, c);
                            }
                            tg_steps(T, &k, A, lda, direct && g == g0, px->B + g * px->gbytes, s0, s1);
                            if (ng > 1) tg_save(T, &k, c);
                        }
                    }
                }
                for (int ti = t0; ti < t1; ti++) {
                    const int64_t r = p0 + 32 * (int64_t)ti;
                    const int rows = p1 - r < 32 ? (int)(p1 - r) : 32;
                    for (int g = g0; g < g1; g++) {
                        const int v0 = g * nv, m = n - v0 < nv ? n - v0 : nv;
                        float *c = k.cst + ((int64_t)ti * per_block + (g - g0)) * 32 * 32;
                        if (ng == 1) tg_save(T, &k, c);
                        tg_combine(c, m, rows, Y + (int64_t)v0 * ldy, ldy, r - row0);
                    }
                }
            }
        }
    }
    t_release(T);
    /* MXFP4 rows outside the bf16 range: the AVX-512 tiles, row by row */
    if (mx)
        for (int64_t r = row0; r < row1; r++)
            if (!mx_row_ok(w, r)) kn_matmul_avx512(w, X, n, Y + (r - row0), ldy, r, r + 1);
    free(k.panel);
    free(k.cst);
}

int NAME(kn_matmul_amx)(const df_weight *w, const float *X, int n, float *Y, int64_t ldy, int64_t row0,
                        int64_t row1) {
    kn_amx_x px;
    const int64_t bytes = NAME(kn_amx_x_init)(&px, w, n);
    if (!bytes) return 0;
    px.B = aligned_alloc(64, (size_t)bytes);
    ASSERT(px.B);
    NAME(kn_amx_x_pack)(&px, X, 0, px.groups);
    NAME(kn_matmul_amx_x)(&px, X, Y, ldy, row0, row1);
    free(px.B);
    return 1;
}
