/* prompt.h — a long prompt run layer by layer (df_program_ops.forward_prompt).
 *
 * Owns: the buffers of one block of positions (activations, K3's anchors, a
 * MoE scratch and the attention projections' scratch sized for the block)
 * and the loop over blocks; each program supplies the block itself (every
 * layer over the block's rows, attention over them at once or in DF_CHUNK-
 * row pieces carrying the state, the feed-forward block over all rows at
 * once, the head on the last row of the last block).
 *
 * The engine keeps the buffers between prompts (df_engine.prompt_ws, freed
 * by prompt_ws_free), so a prompt after the first writes into pages that
 * are already in: a K3-width block of 512 positions touches ~370 MB of them,
 * which took ~1 s to fault in on a 2-vCPU VM (2.7 us a 4 KB page), every
 * prompt, when each prompt allocated its own. They (and the MoE, KDA and
 * MLA scratch) come from mem_big_alloc, on 2 MB pages where the kernel has
 * them, so the first prompt faults them in 512x fewer times (this VM: a
 * K8g 512-token first prompt 16.1 -> 14.3 s). Nothing in them carries from
 * one prompt to the next: every value is written before it is read.
 */
#ifndef DF_MODEL_PROMPT_H
#define DF_MODEL_PROMPT_H
#include "model.h"
#include "ffn.h"
#include "kda.h"
#include "mla.h"

struct prompt_buf {
    int rows;                  /* the block's capacity */
    int n_anchors;             /* anchors a row it was made for (the other widths: moe's) */
    float *h, *xin, *xn, *y;   /* [rows][hidden] */
    float *anchors;            /* [rows][anchors][hidden] (anchors >= 1) */
    moe_scratch moe;           /* sized for rows */
    /* the attention projections over all of the block's rows at once
     * (kda_forward_block, mla_forward_block); rows 0 when the model has no
     * such layer, the block is one session pass (<= DF_CHUNK rows) or the
     * memory could not be had: attention then runs in DF_CHUNK pieces on
     * the session's scratch */
    kda_scratch kda;
    mla_scratch mla;
};
typedef struct prompt_buf prompt_buf;

/* The attention layers a program has (NULL: none of that kind): the
 * block's scratch is made for them. */
typedef struct {
    const kda_shape *kda;
    const mla_shape *mla;
} prompt_attn;

/* fn runs n <= b->rows positions from pos (tokens), writing logits into
 * out when out is set: every row's (all_rows) or the last row's. */
typedef df_status (*prompt_block_fn)(df_engine *e, void *ctx, prompt_buf *b, int pos, const int32_t *tokens, int n,
                                     float *out, int all_rows, char *err);

/* Runs tokens [0, n) in blocks of df_engine_opts.prompt_block through fn (buffers for
 * hidden, anchors per row, the MoE widths inter / dl and attn's layers):
 * with all_rows every block writes its rows' logits at their place in out
 * (vocab floats each), else the last block writes the last row's into out.
 * DF_ERR_NOMEM (with err) when the buffers do not fit. */
df_status prompt_run(df_engine *e, int hidden, int anchors, int inter, int dl, prompt_attn attn, int pos,
                     const int32_t *tokens, int n, float *out, int all_rows, prompt_block_fn fn, void *ctx,
                     char *err);

/* Frees the buffers the engine keeps between prompts (NULL-safe). */
void prompt_ws_free(df_engine *e);
#endif
