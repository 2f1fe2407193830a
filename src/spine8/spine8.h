/* spine8.h — the int8 spine (prefix s8_): which non-expert matrices are
 * converted, the row-wise int8 scheme, the converted folder's manifest, and
 * the converter behind `deltafin convert-spine`.
 *
 * Layout of a converted spine, beside the checkpoint (default DIR/int8-spine):
 *
 *   int8-spine/
 *   ├── spine-00000.safetensors ...   one shard per layer group (layer i, the
 *   │                                 head last): for every converted matrix
 *   │                                 X.weight (I8 [rows, cols]) and
 *   │                                 X.weight_scale (F32 [rows]); names as in
 *   │                                 the checkpoint, one-to-one
 *   ├── model.safetensors.index.json
 *   ├── progress.json                 shards finished so far (resume)
 *   └── manifest.json                 written last: the conversion is
 *                                     complete; source shard sizes and
 *                                     mtimes, every shard's size and sha256
 *
 * Scheme (K3.md 1.13, with an f32 scale): per output row r,
 * scale_r = max|W_r| / 127 in f32 (1 for an all-zero row),
 * q = clamp(round_half_even(W / scale_r), -127, 127), W' = q * scale_r.
 *
 * Which matrices: every 2-D non-expert weight whose name contains none of
 * conv1d, norm, A_log, dt_bias, res_proj, e_score_correction_bias,
 * embed_tokens (read a row at a time: it stays as stored), vision,
 * mm_projector; stored as bf16, f16, f32 or fp8 blocks (dequantised first).
 */
#ifndef DF_SPINE8_H
#define DF_SPINE8_H
#include "deltafin.h"
#include "../base/io.h"
#include "../format/safetensors.h"

#define S8_DIR "int8-spine"
#define S8_MANIFEST "manifest.json"
#define S8_PREFIX "int8:"     /* the overlay's tensor names in an engine's set */

/* 1 if the tensor `name` (a `.weight` of a 2-D matrix) is converted. */
int s8_selected(const char *name, const st_tensor *t);
/* Quantises one row of n floats: q[n], returns the scale. */
float s8_quantize_row(const float *w, int64_t n, int8_t *q);

/* sha256 (hex) of a safetensors file's length prefix and JSON header, and
 * the file's size: what identifies a source shard in the manifest. */
df_status s8_header_hash(const df_io *io, const char *path, int64_t *size, char hex[65], char *err);
/* Checks a converted folder against the checkpoint it was made from: the
 * manifest exists (a complete conversion), the source shards' sizes and
 * mtimes are the ones recorded, the int8 shards have the recorded sizes.
 * DF_ERR_IO / DF_ERR_MISMATCH with a message naming the file otherwise;
 * *absent set when there is no manifest at all (never converted). */
df_status s8_check(const df_io *io, const char *model_dir, const char *s8_dir, int *absent, char *err);

/* The converter (convert.c). */
typedef struct {
    const char *out;      /* folder (default: MODEL/int8-spine) */
    int dry_run;          /* plan only */
    int force;            /* replace a complete conversion */
    int verify;           /* only check an existing conversion's hashes */
    int threads;          /* 0: one per CPU */
    const df_io *io;      /* reads of the checkpoint (a stream mirror's table fetches) */
    /* progress: called after each shard (and during long ones) */
    void (*progress)(void *ctx, int64_t done_bytes, int64_t total_bytes, int shard, int n_shards);
    void *progress_ctx;
} s8_opts;

typedef struct {
    int n_tensors, n_shards, shards_skipped;  /* skipped: finished by an earlier run */
    int64_t in_bytes, out_bytes;              /* source bytes read, int8 bytes written */
    double seconds;
} s8_report;

df_status s8_convert(const char *model_dir, const s8_opts *o, s8_report *r, char *err);
#endif
