/* matvec_driver.h — the row/vector driver every SIMD level shares.
 *
 * A SIMD file (matvec_avx2.c, matvec_avx512.c) owns only tiles: functions
 * that compute a small block of outputs (some rows of W against some
 * vectors of X) for one weight type. kn_drive walks [row0, row1) x [0, n)
 * with them. It owns the walk and nothing else: no arithmetic, so every
 * level's row order, blocking and x preparation are the same code.
 *
 * A tile writes Y[v * ldy + j] for its rows r + j and vectors v, reading
 * vector v at X + v * ldx (after prep, when the level reorders x). Every
 * tile of a table computes a given (row, vector) output with the same
 * instructions in the same order, so the value does not depend on which
 * tile, row block or vector block produced it (kernels.h's contract).
 *
 * Walk: vectors in blocks whose x takes at most 4 MB (KN_X_BLOCK_BYTES;
 * one block unless n x cols is large), each block over all rows; rows in
 * blocks of about 256 KB of weights, so a block stays in L2 while the
 * block's vectors pass over it; inside a row block, vectors in groups of mv
 * through the mr-row "many" tile (weights decoded once per group of
 * vectors: prefill; where a level has many_part and a group's x is past
 * 24 KB, all rows instead in panels of 16 tiles, each by column blocks,
 * every group of the vector block over the panel per column block, so
 * that a group's x stays in L1 and the panel's weights in L2), the
 * vectors left over one at a time through the nr-row
 * "one" tile (decode). Leftover rows take the 1-row variants. A level that
 * reorders x (prep) has each vector of a block prepared once per call.
 */
#ifndef DF_KERNELS_MATVEC_DRIVER_H
#define DF_KERNELS_MATVEC_DRIVER_H
#include "../format/weight.h"
#include "kernels.h"
#include <stdint.h>

typedef void (*kn_tile_fn)(const df_weight *w, int64_t r, const float *X, int64_t ldx, float *Y,
                           int64_t ldy);
/* Writes x (cols floats) in the form the level's tiles read, into
 * kn_px_len(cols) floats (kernels.h: cols rounded up to a multiple of 128,
 * so a level may pad its last chunk). */
typedef void (*kn_prep_fn)(const float *x, int64_t cols, float *out);

/* Columns [c0, c1) of the mr x mv many tile at row r (c0, c1 multiples of
 * the level's part_step, c1 at most cols rounded down to it): its
 * accumulators start from zero where c0 is 0, else from acc (part_acc
 * floats, 64-byte aligned); where c1 is the last whole step it finishes
 * (the columns past it, the sums into Y as the many tile writes them),
 * else it leaves them in acc. A tile's parts over its columns in order
 * take the many tile's operations in its order: the same bits. */
typedef void (*kn_part_fn)(const df_weight *w, int64_t r, int64_t c0, int64_t c1, const float *X, int64_t ldx,
                           float *acc, float *Y, int64_t ldy);
/* Rows [r0, r0 + rows) (a multiple of lanes_mr) x vectors [0, n) (a
 * multiple of lanes_mv) of the many tile's products, with the rows in the
 * SIMD lanes (a level's prefill form for its dense kinds): X in the tiles'
 * form (after prep), ldx floats apart; Y[v * ldy + j] is row r0 + j;
 * scratch (64-byte aligned) holds lanes_scratch + n / lanes_mv x
 * lanes_scratch_group floats. Every output has the many tile's bits. */
typedef void (*kn_lanes_fn)(const df_weight *w, int64_t r0, int64_t rows, const float *X, int64_t ldx, int n,
                            float *Y, int64_t ldy, float *scratch);
typedef struct {
    kn_tile_fn one, one_1;   /* nr rows x 1 vector, 1 row x 1 vector */
    kn_tile_fn one_l1, one_1_l1; /* nr_l1 rows x 1 vector, 1 x 1, the tile-ahead prefetch into L1 (kn_pf_next) */
    kn_tile_fn many, many_1; /* mr rows x mv vectors, 1 row x mv vectors (NULL: none) */
    int nr, nr_l1, mr, mv;   /* mv <= KN_DRIVE_MAX_MV */
    kn_prep_fn prep;         /* NULL: tiles read x as given */
    int64_t row_bytes;       /* bytes of one row of weights (data + scales) */
    kn_part_fn many_part;    /* the many tile by column ranges (NULL: whole tiles only) */
    int part_step, part_acc; /* many_part's column step, floats of its accumulators */
    kn_lanes_fn lanes;       /* NULL: none */
    int lanes_mr, lanes_mv;
    int64_t lanes_scratch, lanes_scratch_group;
} kn_tiles;

enum { KN_DRIVE_MAX_MV = 8 };

/* The tile tables a level provides, one per weight kind, in this order. */
typedef enum {
    KN_K_F32, KN_K_BF16, KN_K_F16, KN_K_I8, KN_K_FP8, KN_K_I4_BF16, KN_K_I4_F16, KN_K_I4_F32,
    KN_K_MXFP4, KN_K_COUNT
} kn_kind;

/* Runs w through tables[kind of w]; 0 when w has no kind (an unknown type or
 * int4 scale dtype), without writing Y. prepped: X is as kn_prep_kind wrote
 * it (one vector every kn_px_len(cols) floats), else as given. */
int kn_drive_kind(const kn_tiles tables[KN_K_COUNT], const df_weight *w, const float *X, int prepped, int n,
                  float *Y, int64_t ldy, int64_t row0, int64_t row1);
/* Vectors [v0, v1) of X prepared for tables[kind of w] into out (vector v
 * at out + v * kn_px_len(cols)); 0 (nothing written) when that kind reads
 * x as given. */
int kn_prep_kind(const kn_tiles tables[KN_K_COUNT], const df_weight *w, const float *X, int v0, int v1,
                 float *out);

/* A level's file defines its kernel bodies with the shared names
 *   dense_tile(e, w, r, nr, nv, l1, X, ldx, Y, ldy)   e in E_F32 E_BF16 E_F16 E_I8
 *   fp8_tile(w, r, nr, nv, l1, X, ldx, Y, ldy)
 *   nib_tile(k, w, r, nr, nv, l1, X, ldx, Y, ldy)     k in N_I4_BF16 N_I4_F16 N_I4_F32 N_MX
 * (l1: where a one-vector tile prefetches the next tile's rows, 1 L1, 0 L2;
 * a level without that prefetch ignores it)
 * and the constants NR and NR_L1 (decode rows: of the tiles that prefetch
 * into L2, into L1) and D_/F_/N_ MR, MV (prefill rows x
 * vectors of dense, fp8 and 4-bit tiles), then says
 *   KN_LEVEL(kn_matmul_LEVEL, prep for the bf16 tiles, prep for the int4 tiles,
 *            prep for the MXFP4 tiles)
 * (each NULL when the tiles read x as given)
 * which instantiates every tile and the table, and defines the entry point. */
#define KN_TILES_(name, mr, mv, body, ...)                                                        \
    static void name##_one(const df_weight *w, int64_t r, const float *X, int64_t ldx, float *Y,  \
                           int64_t ldy) { body(__VA_ARGS__ w, r, NR, 1, 0, X, ldx, Y, ldy); }        \
    static void name##_one1(const df_weight *w, int64_t r, const float *X, int64_t ldx, float *Y, \
                            int64_t ldy) { body(__VA_ARGS__ w, r, 1, 1, 0, X, ldx, Y, ldy); }        \
    static void name##_one_l1(const df_weight *w, int64_t r, const float *X, int64_t ldx,         \
                              float *Y, int64_t ldy) { body(__VA_ARGS__ w, r, NR_L1, 1, 1, X, ldx, Y, ldy); } \
    static void name##_one1_l1(const df_weight *w, int64_t r, const float *X, int64_t ldx,        \
                               float *Y, int64_t ldy) { body(__VA_ARGS__ w, r, 1, 1, 1, X, ldx, Y, ldy); } \
    static void name##_many(const df_weight *w, int64_t r, const float *X, int64_t ldx, float *Y, \
                            int64_t ldy) { body(__VA_ARGS__ w, r, mr, mv, 0, X, ldx, Y, ldy); }      \
    static void name##_many1(const df_weight *w, int64_t r, const float *X, int64_t ldx,          \
                             float *Y, int64_t ldy) { body(__VA_ARGS__ w, r, 1, mv, 0, X, ldx, Y, ldy); }
#define KN_TABLE_(name, mr, mv, prep, part, lanes) {name##_one, name##_one1, name##_one_l1, name##_one1_l1, name##_many, name##_many1, NR, NR_L1, mr, mv, prep, 0, part, lanes}
/* The dense kinds' many_part, step and accumulator floats: a level that has
 * them redefines this after including this header, before KN_LEVEL. */
#define KN_NO_PART NULL, 0, 0
#define KN_PART(name) KN_NO_PART
/* Likewise the dense kinds' lanes, lanes_mr, lanes_mv and scratch floats. */
#define KN_NO_LANES NULL, 0, 0, 0, 0
#define KN_LANES(name) KN_NO_LANES
#define KN_LEVEL(entry, prep_bf16, prep_i4, prep_mx)                                                       \
    KN_TILES_(f32, D_MR, D_MV, dense_tile, E_F32,)                                                 \
    KN_TILES_(bf16, D_MR, D_MV, dense_tile, E_BF16,)                                               \
    KN_TILES_(f16, D_MR, D_MV, dense_tile, E_F16,)                                                 \
    KN_TILES_(i8, D_MR, D_MV, dense_tile, E_I8,)                                                   \
    KN_TILES_(fp8, F_MR, F_MV, fp8_tile,)                                                          \
    KN_TILES_(i4b, N_MR, N_MV, nib_tile, N_I4_BF16,)                                               \
    KN_TILES_(i4h, N_MR, N_MV, nib_tile, N_I4_F16,)                                                \
    KN_TILES_(i4f, N_MR, N_MV, nib_tile, N_I4_F32,)                                                \
    KN_TILES_(mx, N_MR, N_MV, nib_tile, N_MX,)                                                     \
    static const kn_tiles kn_level_tables_[KN_K_COUNT] = {                                         \
        [KN_K_F32] = KN_TABLE_(f32, D_MR, D_MV, NULL, KN_PART(f32), KN_LANES(f32)),                                             \
        [KN_K_BF16] = KN_TABLE_(bf16, D_MR, D_MV, prep_bf16, KN_PART(bf16), KN_LANES(bf16)),                                      \
        [KN_K_F16] = KN_TABLE_(f16, D_MR, D_MV, NULL, KN_PART(f16), KN_LANES(f16)),                                             \
        [KN_K_I8] = KN_TABLE_(i8, D_MR, D_MV, NULL, KN_PART(i8), KN_LANES(i8)),                                               \
        [KN_K_FP8] = KN_TABLE_(fp8, F_MR, F_MV, NULL, KN_NO_PART, KN_NO_LANES),                                             \
        [KN_K_I4_BF16] = KN_TABLE_(i4b, N_MR, N_MV, prep_i4, KN_NO_PART, KN_NO_LANES),                                      \
        [KN_K_I4_F16] = KN_TABLE_(i4h, N_MR, N_MV, prep_i4, KN_NO_PART, KN_NO_LANES),                                       \
        [KN_K_I4_F32] = KN_TABLE_(i4f, N_MR, N_MV, prep_i4, KN_NO_PART, KN_NO_LANES),                                       \
        [KN_K_MXFP4] = KN_TABLE_(mx, N_MR, N_MV, prep_mx, KN_NO_PART, KN_NO_LANES),                                         \
    };                                                                                             \
    int entry(const df_weight *w, const float *X, int n, float *Y, int64_t ldy, int64_t row0,      \
              int64_t row1) {                                                                      \
        return kn_drive_kind(kn_level_tables_, w, X, 0, n, Y, ldy, row0, row1);                    \
    }                                                                                              \
    int entry##_prep(const df_weight *w, const float *X, int v0, int v1, float *out) {            \
        return kn_prep_kind(kn_level_tables_, w, X, v0, v1, out);                                  \
    }                                                                                              \
    int entry##_px(const df_weight *w, const float *Xp, int n, float *Y, int64_t ldy, int64_t row0, \
                   int64_t row1) {                                                                 \
        return kn_drive_kind(kn_level_tables_, w, Xp, 1, n, Y, ldy, row0, row1);                   \
    }

void kn_drive(const kn_tiles *t, const df_weight *w, const float *X, int prepped, int n, float *Y, int64_t ldy,
              int64_t row0, int64_t row1);
#endif
