/* prompt.c — the block loop of a layer-major prompt, and the block buffers
 * the engine keeps between prompts (prompt.h). */
#include "prompt.h"
#include "../base/err.h"
#include "../base/mem.h"
#include <stdlib.h>
#include <string.h>

static void buf_free(prompt_buf *b) {
    if (!b) return;
    free(b->h); free(b->xin); free(b->xn); free(b->y); free(b->anchors);
    moe_scratch_free(&b->moe);
    kda_scratch_free(&b->kda);
    mla_scratch_free(&b->mla);
    free(b);
}

void prompt_ws_free(df_engine *e) {
    buf_free(e->prompt_ws);
    e->prompt_ws = NULL;
}

/* The block's attention scratch for rows (none at or below DF_CHUNK rows,
 * where the block is one session pass); kept when it already holds them. */
static void attn_scratch(prompt_buf *b, prompt_attn attn, int rows) {
    const int want = rows > DF_CHUNK ? rows : 0;
    if (attn.kda && want && b->kda.rows < want) {
        kda_scratch_free(&b->kda);
        if (kda_scratch_new(attn.kda, want, &b->kda) != DF_OK) b->kda.rows = 0;
    }
    if (attn.mla && want && b->mla.rows < want) {
        mla_scratch_free(&b->mla);
        /* threads 0: no per-thread attention rows (the session lends its
         * own), so the context length does not enter */
        if (mla_scratch_new(attn.mla, 0, 0, want, &b->mla) != DF_OK) b->mla.rows = 0;
    }
}

/* Buffers for blocks of rows positions: the engine's kept ones when they
 * hold as many with the same widths, else new ones (the kept ones freed
 * first); NULL when out of memory. */
static prompt_buf *buf_take(df_engine *e, int rows, int hidden, int anchors, int inter, int dl) {
    const df_config *c = &e->cfg;
    prompt_buf *b = e->prompt_ws;
    e->prompt_ws = NULL;
    if (b && b->rows >= rows && b->n_anchors == anchors && b->moe.hidden == hidden && b->moe.inter == inter &&
        b->moe.dl == dl) {
        /* what a failed pass may have left: the MoE batch, the device rows */
        moe_batch_clear(&b->moe.batch);
        memset(b->moe.mark, 0, (size_t)b->moe.E);
        b->moe.dv = NULL;
        return b;
    }
    buf_free(b);
    if (!(b = calloc(1, sizeof *b))) return NULL;
    b->rows = rows, b->n_anchors = anchors;
    const size_t act = (size_t)rows * hidden * sizeof(float);
    b->h = mem_big_alloc(act);
    b->xin = mem_big_alloc(act);
    b->xn = mem_big_alloc(act);
    b->y = mem_big_alloc(act);
    b->anchors = mem_big_alloc(act * (size_t)(anchors > 0 ? anchors : 1));
    if (!b->h || !b->xin || !b->xn || !b->y || !b->anchors ||
        moe_scratch_new(rows, hidden, inter, c->n_routed_experts, c->num_experts_per_tok, dl, &b->moe) != DF_OK) {
        buf_free(b);
        return NULL;
    }
    return b;
}

df_status prompt_run(df_engine *e, int hidden, int anchors, int inter, int dl, prompt_attn attn, int pos,
                     const int32_t *tokens, int n, float *out, int all_rows, prompt_block_fn fn, void *ctx,
                     char *err) {
    const df_config *c = &e->cfg;
    const int block = e->opts.prompt_block, rows = n < block ? n : block;
    prompt_buf *b = buf_take(e, rows, hidden, anchors, inter, dl);
    if (!b) return df_fail(err, DF_ERR_NOMEM, "out of memory for a prompt block of %d positions", rows);
    attn_scratch(b, attn, rows);
    df_status st = DF_OK;
    for (int b0 = 0; st == DF_OK && b0 < n; b0 += block) {
        int nb = n - b0 < block ? n - b0 : block;
        float *o = all_rows ? out + (size_t)b0 * c->vocab_size : b0 + nb == n ? out : NULL;
        st = fn(e, ctx, b, pos + b0, tokens + b0, nb, o, all_rows, err);
    }
    e->prompt_ws = b; /* kept for the next prompt, whatever happened to this one */
    return st;
}
