/* weight.h — a 2-D weight matrix in any stored type (prefix wt_).
 *
 * A df_weight is a non-owning view: rows x cols logical values ([out, in],
 * row-major as in the checkpoint), the packed data and, for block/group
 * quantised types, the scales. Layouts:
 *
 *   WT_F32/WT_BF16/WT_F16  data: rows*cols elements.
 *   WT_FP8_BLOCK   data: e4m3 bytes rows*cols; scale: f32 [ceil(rows/br)][ceil(cols/bc)]
 *                  (DeepSeek-V3 `weight_scale_inv`), W = fp8 * scale[r/br][c/bc].
 *   WT_INT4_G32    compressed-tensors pack-quantized: data int32 [rows][cols/8],
 *                  element j of each word at bits 4j..4j+3 holding q+8 (unsigned),
 *                  scale [rows][cols/32] of type scale_dtype; W = (nib-8) * scale.
 *   WT_MXFP4       compressed-tensors mxfp4: data u8 [rows][cols/2], low nibble =
 *                  even column, e2m1 codes; scale u8 e8m0 [rows][cols/32].
 *   WT_I8_ROW      data int8 rows*cols; scale f32 [rows]; W = q * scale[r].
 */
#ifndef DF_FORMAT_WEIGHT_H
#define DF_FORMAT_WEIGHT_H
#include "dtype.h"
#include "safetensors.h"
#include <stdint.h>

typedef enum { WT_F32 = 0, WT_BF16, WT_F16, WT_FP8_BLOCK, WT_INT4_G32, WT_MXFP4, WT_I8_ROW, WT_NTYPES } wt_type;

typedef struct {
    wt_type type;
    int64_t rows, cols;
    const void *data;
    const void *scale;
    st_dtype scale_dtype;    /* WT_INT4_G32: DT_BF16, DT_F16 or DT_F32 */
    int block_rows, block_cols; /* WT_FP8_BLOCK */
    const st_tensor *t_data;    /* the tensors behind data and scale (NULL for */
    const st_tensor *t_scale;   /* views made by hand); the expert store reads them */
} df_weight;

const char *wt_type_name(wt_type t);
/* Bytes the matrix occupies (data + scales). */
int64_t wt_bytes(const df_weight *w);
/* Bytes of one row of w's data (row r starts at data + r times this; its
 * scales, where the type has them, lie apart); 0 for no known type. */
int64_t wt_data_row_bytes(const df_weight *w);

/* Binds the matrix stored under `base` (e.g. "model.layers.0.mlp.gate_proj"):
 * base.weight (f32/bf16/f16, or f8_e4m3 with base.weight_scale_inv), or
 * base.weight_packed + base.weight_scale (+ base.weight_shape) for
 * compressed-tensors int4 (I32 packed) and mxfp4 (U8 packed). Checks every
 * shape against rows x cols. Errors name the tensor and what was expected. */
df_status wt_bind(st_set *s, const char *base, int64_t rows, int64_t cols, int fp8_br,
                  int fp8_bc, df_weight *w, char *err);
/* Like wt_load_vec for a tensor of any shape holding n values (row-major). */
df_status wt_load_flat(st_set *s, const char *name, int64_t n, float *out, char *err);
/* Like wt_bind, but leaves data and scale NULL and reads no weight bytes:
 * only t_data / t_scale are set (the expert store fills the pointers when it
 * has the bytes in RAM). */
df_status wt_bind_lazy(st_set *s, const char *base, int64_t rows, int64_t cols, int fp8_br,
                       int fp8_bc, df_weight *w, char *err);
/* Points a lazily bound view at a copy of its bytes: `base` holds the bytes
 * of shard range [origin, ...) that contains both tensors. */
void wt_point(df_weight *w, const uint8_t *base, int64_t origin);
/* 1 if any tensor of `base` exists. */
int wt_exists(const st_set *s, const char *base);
/* Binds a 1-D f32/bf16/f16 vector `name` of n elements, converted to f32 into out. */
df_status wt_load_vec(st_set *s, const char *name, int64_t n, float *out, char *err);
#endif
