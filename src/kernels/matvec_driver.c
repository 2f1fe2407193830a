/* matvec_driver.c — kn_drive: the walk over rows and vectors that every SIMD
 * level shares (see matvec_driver.h). Owns the row blocking, the vector
 * grouping and the buffer for prepared x; no arithmetic on weights.
 */
#include "matvec_driver.h"
#include "../base/err.h"
#include <stdlib.h>

enum { BLOCK_BYTES = 256 << 10, X_STACK = 16384 };

#ifndef KN_X_BLOCK_BYTES
#define KN_X_BLOCK_BYTES (4 << 20)
#endif

/* Vectors [v0, v1) of X (one every cols floats) through prep into out (one
 * every kn_px_len(cols) floats). */
static void prep_vectors(kn_prep_fn prep, const df_weight *w, const float *X, int v0, int v1, float *out) {
    const int64_t cols = w->cols, ld = kn_px_len(cols);
    for (int v = v0; v < v1; v++) prep(X + (int64_t)v * cols, cols, out + (int64_t)v * ld);
}

/* X (n vectors, prepped as kn_drive's) as t's tiles read it: X itself, or
 * prepared into stack (stack_floats) when it fits, else into a buffer left
 * in *owned for the caller to free (NULL when none). *ldx: floats from one
 * vector to the next. */
static const float *x_for_tiles(const kn_tiles *t, const df_weight *w, const float *X, int prepped, int n,
                                float *stack, int64_t stack_floats, float **owned, int64_t *ldx) {
    *owned = NULL;
    *ldx = t->prep ? kn_px_len(w->cols) : w->cols;
    if (!t->prep || prepped) return X;
    const int64_t need = (int64_t)n * *ldx;
    float *buf = stack;
    if (need > stack_floats) {
        buf = *owned = aligned_alloc(64, (size_t)need * sizeof *buf);
        ASSERT(buf);
    }
    prep_vectors(t->prep, w, X, 0, n, buf);
    return buf;
}

/* Rows [r, b1) of one group of mv vectors after its whole many tiles (y is
 * row row0's output): two or more rows left, one more whole tile ending at
 * b1, over rows of this call (those before r are written again with the
 * same bits: a row's value does not depend on its tile), where a row at a
 * time runs a fraction of the FMA chains (AVX2 bf16 5 x 2: a lone row costs
 * ~0.7 of a whole tile, two ~1.4); else a row at a time. */
static void many_rest(const kn_tiles *t, const df_weight *w, int64_t row0, int64_t r, int64_t b1, const float *x,
                      int64_t ldx, float *y, int64_t ldy) {
    if (b1 - r >= 2 && b1 - row0 >= t->mr) t->many(w, b1 - t->mr, x, ldx, y + (b1 - t->mr - row0), ldy);
    else for (; r < b1; r++) t->many_1(w, r, x, ldx, y + (r - row0), ldy);
}

/* Prefill by panels (levels with many_part, where x of a group of mv
 * vectors is wider than PART_X_BYTES): rows in panels of PART_TILES many
 * tiles, each panel by column blocks whose x of one group takes at most
 * PART_X_BYTES, and inside a column block every group of the vector block
 * over the panel's tiles. A block's x of one group stays in L1 across the
 * panel's tiles, and the panel's weights of one block (16 x 4 rows x 2048
 * bf16 columns: 256 KB) in L2 across the groups. Before, a row block of a
 * 33792-column matrix was a tile or two (256 KB of weights), and each such
 * block streamed the vector block's whole x (4 MB) from L3. Each tile's
 * accumulators wait in a buffer between column blocks; its parts run its
 * columns in order, so every output has the many tile's bits (kn_part_fn). */
enum { PART_X_BYTES = 24 << 10, PART_TILES = 16, PART_ACC_MAX = 512 };

/* Columns a part covers: 0 where a group's whole x fits PART_X_BYTES (whole
 * tiles then) or the level has no parts. */
static int64_t part_cols(const kn_tiles *t, int64_t cols) {
    if (!t->many || !t->many_part) return 0;
    const int64_t step = t->part_step, full = cols / step * step;
    int64_t cb = PART_X_BYTES / ((int64_t)t->mv * (int64_t)sizeof(float)) / step * step;
    if (cb < step) cb = step;
    return full > cb ? cb : 0;
}

/* Groups [0, groups) of mv vectors (x of group g at x + g mv ldx) over rows
 * [row0, row1) by panels, cb columns a part (part_cols). */
static void many_by_panels(const kn_tiles *t, const df_weight *w, int64_t row0, int64_t row1, int groups,
                           int64_t cb, const float *x, int64_t ldx, float *Y, int64_t ldy) {
    const int64_t full = w->cols / t->part_step * t->part_step, gx = (int64_t)t->mv * ldx, gy = (int64_t)t->mv * ldy;
    const int64_t ntiles = (row1 - row0) / t->mr, pa = t->part_acc;
    ASSERT(pa > 0 && pa <= PART_ACC_MAX && pa % 16 == 0);
    float *acc = ntiles > 0 ? aligned_alloc(64, (size_t)groups * PART_TILES * (size_t)pa * sizeof *acc) : NULL;
    ASSERT(ntiles == 0 || acc);
    for (int64_t t0 = 0; t0 < ntiles; t0 += PART_TILES) {
        const int nt = ntiles - t0 < PART_TILES ? (int)(ntiles - t0) : PART_TILES;
        const int64_t r = row0 + t0 * t->mr;
        for (int64_t c0 = 0; c0 < full; c0 += cb) {
            const int64_t c1 = c0 + cb < full ? c0 + cb : full;
            for (int g = 0; g < groups; g++)
                for (int i = 0; i < nt; i++)
                    t->many_part(w, r + i * t->mr, c0, c1, x + g * gx, ldx, acc + ((int64_t)g * PART_TILES + i) * pa,
                                 Y + g * gy + (r - row0) + i * t->mr, ldy);
        }
    }
    free(acc);
    const int64_t r = row0 + ntiles * t->mr;
    if (r < row1)
        for (int g = 0; g < groups; g++) many_rest(t, w, row0, r, row1, x + g * gx, ldx, Y + g * gy, ldy);
}

/* X: n vectors as given (prepped 0, one every cols floats), or as t->prep
 * wrote them (prepped 1, one every kn_px_len(cols) floats). */
static void drive_block(const kn_tiles *t, const df_weight *w, const float *X, int prepped, int n, float *Y,
                        int64_t ldy, int64_t row0, int64_t row1) {
    const int64_t cols = w->cols;
    const int mv = t->many ? t->mv : 1;
    ASSERT(mv >= 1 && mv <= KN_DRIVE_MAX_MV && t->nr >= 1 && (!t->many || t->mr >= 1));
    /* rows per block: ~BLOCK_BYTES of weights, a multiple of both tile heights */
    const int step = t->many ? t->nr * t->mr : t->nr;
    int64_t rb = BLOCK_BYTES / (t->row_bytes > 0 ? t->row_bytes : 1);
    rb = rb < step ? step : rb / step * step;
    /* x as the tiles read it: X itself, or every vector prepared once here,
     * not once per row block (an MXFP4 row block is ~70 rows of 7168
     * columns: preparing x per block cost ~5% of a 1536 x 7168 matmul of
     * 3 to 45 vectors, one thread) */
    _Alignas(64) float xstack[X_STACK];
    float *xbuf;
    int64_t ldx;
    const float *xs = x_for_tiles(t, w, X, prepped, n, xstack, X_STACK, &xbuf, &ldx);
    /* vectors [0, i0) by panels over all the rows, where parts pay */
    const int64_t cb = part_cols(t, cols);
    const int i0 = cb ? n / mv * mv : 0;
    if (i0) many_by_panels(t, w, row0, row1, i0 / mv, cb, xs, ldx, Y, ldy);
    for (int64_t b0 = row0; b0 < row1; b0 += rb) {
        const int64_t b1 = b0 + rb < row1 ? b0 + rb : row1;
        int i = i0;
        for (; t->many && i + mv <= n; i += mv) {
            const float *x = xs + (int64_t)i * ldx;
            float *y = Y + (int64_t)i * ldy;
            int64_t r = b0;
            for (; r + t->mr <= b1; r += t->mr) t->many(w, r, x, ldx, y + (r - row0), ldy);
            if (r < b1) many_rest(t, w, row0, r, b1, x, ldx, y, ldy);
        }
        for (; i < n; i++) {
            const float *x = xs + (int64_t)i * ldx;
            float *y = Y + (int64_t)i * ldy;
            int64_t r = b0;
            for (; r + t->nr <= b1; r += t->nr) t->one(w, r, x, ldx, y + (r - row0), ldy);
            for (; r < b1; r++) t->one_1(w, r, x, ldx, y + (r - row0), ldy);
        }
    }
    free(xbuf);
}

/* Vectors at least this many go through the level's lanes (its weights are
 * transposed once per panel for all of them). */
#ifndef KN_LANES_MIN_N
#define KN_LANES_MIN_N 64
#endif
/* Vectors a lanes call takes at most (a multiple of 8; a build flag for
 * measurements): fewer keep a call's parked chains in L2 but transpose the
 * weights once per block of vectors (this VM, 2 threads, 512 vectors: 128
 * and 256 read 7-12% less than one block). */
#ifndef KN_LANES_BLOCK
#define KN_LANES_BLOCK 1024
#endif

/* The lanes' rows and vectors (multiples of lanes_mr, lanes_mv) through
 * t->lanes, x prepared first where the level reads its own form; the rows
 * and vectors left over through the tiles. */
static void drive_lanes(const kn_tiles *t, const df_weight *w, const float *X, int prepped, int n, float *Y,
                        int64_t ldy, int64_t row0, int64_t row1) {
    const int64_t rl = (row1 - row0) / t->lanes_mr * t->lanes_mr;
    const int nl = n / t->lanes_mv * t->lanes_mv;
    float *xbuf;
    int64_t ldx;
    const float *xs = x_for_tiles(t, w, X, prepped, n, NULL, 0, &xbuf, &ldx);
    const int nb = nl < KN_LANES_BLOCK ? nl : KN_LANES_BLOCK;
    float *scratch = aligned_alloc(64, (size_t)(t->lanes_scratch + nb / t->lanes_mv * t->lanes_scratch_group) * sizeof(float));
    ASSERT(scratch);
    for (int v0 = 0; v0 < nl; v0 += KN_LANES_BLOCK)
        t->lanes(w, row0, rl, xs + (int64_t)v0 * ldx, ldx, nl - v0 < KN_LANES_BLOCK ? nl - v0 : KN_LANES_BLOCK,
                 Y + (int64_t)v0 * ldy, ldy, scratch);
    free(scratch);
    kn_tiles rest = *t;
    rest.lanes = NULL;
    const int pp = prepped || xbuf; /* the tiles' form from here on */
    if (row0 + rl < row1) kn_drive(&rest, w, xs, pp, n, Y + rl, ldy, row0 + rl, row1);
    if (nl < n) kn_drive(&rest, w, xs + (int64_t)nl * ldx, pp, n - nl, Y + (int64_t)nl * ldy, ldy, row0, row0 + rl);
    free(xbuf);
}

/* Vectors in equal blocks (a multiple of the many tile's vectors) whose x
 * takes at most KN_X_BLOCK_BYTES, each over all the rows: every row block
 * streams a block's x, not all of X (measured: a 7168 x 18432 bf16 matmul
 * of 256 vectors ran at 55-64% of the FMA probe as one block, 76-84% in
 * blocks of 4 MB). */
void kn_drive(const kn_tiles *t, const df_weight *w, const float *X, int prepped, int n, float *Y, int64_t ldy,
              int64_t row0, int64_t row1) {
    if (n <= 0) return;
    if (t->lanes && n >= KN_LANES_MIN_N && row1 - row0 >= t->lanes_mr) {
        drive_lanes(t, w, X, prepped, n, Y, ldy, row0, row1);
        return;
    }
    const int mv = t->many ? t->mv : 1;
    int64_t cap = w->cols > 0 ? (int64_t)KN_X_BLOCK_BYTES / (w->cols * (int64_t)sizeof(float)) : n;
    cap = cap < mv ? mv : cap / mv * mv;
    const int64_t blocks = (n + cap - 1) / cap;
    int64_t nb = (n + blocks - 1) / blocks;
    nb = (nb + mv - 1) / mv * mv;
    const int64_t ldx = prepped && t->prep ? kn_px_len(w->cols) : w->cols;
    for (int i = 0; i < n; i += (int)nb) {
        int m = n - i < nb ? n - i : (int)nb;
        drive_block(t, w, X + (int64_t)i * ldx, prepped, m, Y + (int64_t)i * ldy, ldy, row0, row1);
    }
}

static int kind_of(const df_weight *w) {
    switch (w->type) {
    case WT_F32: return KN_K_F32;
    case WT_BF16: return KN_K_BF16;
    case WT_F16: return KN_K_F16;
    case WT_I8_ROW: return KN_K_I8;
    case WT_FP8_BLOCK: return KN_K_FP8;
    case WT_MXFP4: return KN_K_MXFP4;
    case WT_INT4_G32:
        switch (w->scale_dtype) {
        case DT_BF16: return KN_K_I4_BF16;
        case DT_F16: return KN_K_I4_F16;
        case DT_F32: return KN_K_I4_F32;
        default: return -1;
        }
    default: return -1;
    }
}

/* Bytes of one row of weights (its scales included, roughly): sets the row blocks. */
static int64_t row_bytes(const df_weight *w) {
    switch (w->type) {
    case WT_F32: return w->cols * 4;
    case WT_BF16: case WT_F16: return w->cols * 2;
    case WT_INT4_G32: case WT_MXFP4: return w->cols / 2 + w->cols / 32 * 2;
    default: return w->cols + 4;
    }
}

int kn_drive_kind(const kn_tiles tables[KN_K_COUNT], const df_weight *w, const float *X, int prepped, int n,
                  float *Y, int64_t ldy, int64_t row0, int64_t row1) {
    const int k = kind_of(w);
    if (k < 0) return 0;
    kn_tiles t = tables[k];
    t.row_bytes = row_bytes(w);
    if (kn_pf_next_l1()) t.one = t.one_l1, t.one_1 = t.one_1_l1, t.nr = t.nr_l1; /* the one place the choice is made */
    kn_drive(&t, w, X, prepped, n, Y, ldy, row0, row1);
    return 1;
}

int kn_prep_kind(const kn_tiles tables[KN_K_COUNT], const df_weight *w, const float *X, int v0, int v1,
                 float *out) {
    const int k = kind_of(w);
    if (k < 0 || !tables[k].prep) return 0;
    prep_vectors(tables[k].prep, w, X, v0, v1, out);
    return 1;
}
