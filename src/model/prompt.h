/* prompt.h — a long prompt run layer by layer (df_program_ops.forward_prompt).
 *
 * Owns: the buffers of one block of positions (activations, K3's anchors, a
 * MoE scratch sized for the block) and the loop over blocks; each program
 * supplies the block itself (every layer over the block's rows, attention
 * in DF_CHUNK-row pieces carrying the state, the feed-forward block over
 * all rows at once, the head on the last row of the last block).
 */
#ifndef DF_MODEL_PROMPT_H
#define DF_MODEL_PROMPT_H
#include "model.h"
#include "ffn.h"

typedef struct {
    int rows;                  /* the block's capacity */
    float *h, *xin, *xn, *y;   /* [rows][hidden] */
    float *anchors;            /* [rows][anchors][hidden] (anchors >= 1) */
    moe_scratch moe;           /* sized for rows */
} prompt_buf;

/* fn runs n <= b->rows positions from pos (tokens), writing logits into
 * out when out is set: every row's (all_rows) or the last row's. */
typedef df_status (*prompt_block_fn)(df_engine *e, void *ctx, prompt_buf *b, int pos, const int32_t *tokens, int n,
                                     float *out, int all_rows, char *err);

/* Runs tokens [0, n) in blocks of df_engine_opts.prompt_block through fn (buffers for
 * hidden, anchors per row, and the MoE widths inter / dl): with all_rows
 * every block writes its rows' logits at their place in out (vocab floats
 * each), else the last block writes the last row's into out.
 * DF_ERR_NOMEM (with err) when the buffers do not fit. */
df_status prompt_run(df_engine *e, int hidden, int anchors, int inter, int dl, int pos, const int32_t *tokens, int n,
                     float *out, int all_rows, prompt_block_fn fn, void *ctx, char *err);
#endif
