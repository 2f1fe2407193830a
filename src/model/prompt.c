/* prompt.c — the block loop of a layer-major prompt (prompt.h). */
#include "prompt.h"
#include "../base/err.h"
#include <stdlib.h>
#include <string.h>

static void buf_free(prompt_buf *b) {
    free(b->h); free(b->xin); free(b->xn); free(b->y); free(b->anchors);
    moe_scratch_free(&b->moe);
}

df_status prompt_run(df_engine *e, int hidden, int anchors, int inter, int dl, int pos, const int32_t *tokens, int n,
                     float *out, int all_rows, prompt_block_fn fn, void *ctx, char *err) {
    const df_config *c = &e->cfg;
    prompt_buf b;
    memset(&b, 0, sizeof b);
    b.rows = n < e->opts.prompt_block ? n : e->opts.prompt_block;
    const size_t act = (size_t)b.rows * hidden * sizeof(float);
    b.h = malloc(act);
    b.xin = malloc(act);
    b.xn = malloc(act);
    b.y = malloc(act);
    b.anchors = malloc(act * (size_t)(anchors > 0 ? anchors : 1));
    df_status st = DF_OK;
    if (!b.h || !b.xin || !b.xn || !b.y || !b.anchors ||
        moe_scratch_new(b.rows, hidden, inter, c->n_routed_experts, c->num_experts_per_tok, dl, &b.moe) != DF_OK)
        st = df_fail(err, DF_ERR_NOMEM, "out of memory for a prompt block of %d positions", b.rows);
    for (int b0 = 0; st == DF_OK && b0 < n; b0 += b.rows) {
        int nb = n - b0 < b.rows ? n - b0 : b.rows;
        float *o = all_rows ? out + (size_t)b0 * c->vocab_size : b0 + nb == n ? out : NULL;
        st = fn(e, ctx, &b, pos + b0, tokens + b0, nb, o, all_rows, err);
    }
    buf_free(&b);
    return st;
}
