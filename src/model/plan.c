/* plan.c — the engine's memory plan (prefix plan_): how one budget is split
 * between the spine, the expert cache, session state and metadata.
 *
 * The budget is the whole process's: --ram (df_engine_opts.ram_bytes) when
 * given, else what the kernel can give back (MemAvailable capped by the
 * cgroup, src/base/mem.c) minus a margin. Out of it come, in this order:
 *
 *   fixed     tensor metadata and the expert tables + session state for
 *             plan_ctx positions + scratch (64 MB and the per-chunk buffers)
 *   spine     resident: every non-expert tensor (the embedding counted by
 *             the rows a session can touch); streamed: what stays resident
 *             (routers, norms, small vectors) + two layer buffers
 *   cache     the expert cache: --expert-cache when given, else the rest
 *
 * Auto keeps the spine resident whenever it fits beside the cache (it is
 * mapped, so the kernel can still reclaim it under pressure), and streams
 * it only when it does not; plan_decide records why, in one line that
 * inspect, run --stats and bench print. A budget the user gave that cannot
 * hold even the minimum (spine streamed, one token's experts of one layer)
 * is refused, naming every part.
 *
 * Sections: estimates from the tensor list (before the program binds);
 * the decision (before open); the final split (after open, before the
 * expert cache is allocated); plan bytes.
 */
#include "model.h"
#include "../base/err.h"
#include "../base/mem.h"
#include "../experts/spine.h"
#include "../experts/store.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GIB ((int64_t)1 << 30)
#define MIB ((int64_t)1 << 20)

/* ---- estimates from the tensor list ---- */

int model_is_routed_expert(const char *name) {
    return strstr(name, ".experts.") && !strstr(name, "shared_experts");
}

static int is_embedding(const char *name) { return strstr(name, "embed_tokens.") != NULL; }

int model_layer_of(const char *name) {
    const char *p = strstr(name, ".layers.");
    if (!p) return -1;
    return atoi(p + 8);
}

/* Matrices a streamed spine moves through its buffers: 2-D, not routers,
 * not the embedding (read a row at a time), not 1-row probes. */
static int is_streamed_matrix(const st_tensor *t) {
    if (t->ndim != 2 || t->shape[0] <= 1 || t->shape[1] <= 1) return 0;
    if (is_embedding(t->name) || model_is_routed_expert(t->name)) return 0;
    size_t n = strlen(t->name);
    if (n >= 12 && strcmp(t->name + n - 12, ".gate.weight") == 0) return 0; /* MoE router */
    return 1;
}

/* Bytes of the embedding a session of ctx positions can touch (all of it
 * when it doubles as the head). */
static int64_t embed_touched(const df_engine *e, int64_t embed_bytes, int ctx) {
    const df_config *c = &e->cfg;
    if (c->tie_word_embeddings || c->vocab_size <= 0) return embed_bytes;
    int64_t rows = ctx < c->vocab_size ? ctx : c->vocab_size;
    return embed_bytes / c->vocab_size * rows;
}

typedef struct {
    int64_t routed;       /* every routed expert tensor */
    int64_t spine;        /* every non-expert tensor */
    int64_t embed;        /* the embedding's bytes */
    int64_t streamed;     /* matrices a streamed spine moves */
    int64_t max_group;    /* the largest streamed group (a layer, or the head) */
} tensor_sums;

static tensor_sums sums_of(const df_engine *e) {
    tensor_sums s = {0};
    int L = e->cfg.num_hidden_layers;
    int64_t *g = calloc((size_t)L + 1, sizeof(int64_t));
    for (int64_t i = 0; i < st_count(e->st); i++) {
        const st_tensor *t = st_at(e->st, i);
        if (model_is_routed_expert(t->name)) { s.routed += t->nbytes; continue; }
        if (!model_spine_live(e, t)) continue;
        s.spine += t->nbytes;
        if (is_embedding(t->name)) s.embed += t->nbytes;
        if (!is_streamed_matrix(t)) continue;
        s.streamed += t->nbytes;
        int l = model_layer_of(t->name);
        if (g) g[l >= 0 && l < L ? l : L] += t->nbytes;
    }
    for (int l = 0; g && l <= L; l++)
        if (g[l] > s.max_group) s.max_group = g[l];
    free(g);
    return s;
}

static int64_t meta_bytes(const df_engine *e) {
    /* tensor index and the JSON parse at open: ~640 bytes per tensor,
     * measured on the full K3 inventory (497k tensors, 298 MB peak); the
     * expert store's tables (an entry of spans and views per expert, its
     * slot, heat): ~440 bytes per routed expert */
    const df_config *c = &e->cfg;
    int64_t experts = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) experts += cfg_is_moe_layer(c, l) ? c->n_routed_experts : 0;
    return st_count(e->st) * 640 + experts * 440;
}

/* Scratch and code: 64 MB, plus a session's per-chunk buffers, which grow
 * with the widths (the chunk's logits rows, projections and MLP rows), plus
 * a layer-major prompt's block (forward_prompt: activations and anchors,
 * the MoE rows of every slot, the MLP rows, router logits, and the KDA and
 * MLA projections of the block's rows: ~10 H D floats a row, and MLA's q,
 * latents, gate and output). */
static int64_t scratch_bytes(const df_engine *e) {
    const df_config *c = &e->cfg;
    int64_t wide = (int64_t)c->vocab_size + 16 * (int64_t)c->hidden_size + 4 * (int64_t)c->intermediate_size;
    int64_t dl = c->routed_expert_hidden_size > 0 ? c->routed_expert_hidden_size : c->hidden_size;
    const int64_t heads = c->num_attention_heads,
                  mla_row = c->q_lora_rank + heads * (c->qk_nope_head_dim + c->qk_rope_head_dim) + c->kv_lora_rank +
                            c->qk_rope_head_dim + 2 * heads * c->v_head_dim;
    int64_t block = e->ops->forward_prompt
                        ? (int64_t)e->opts.prompt_block * 4 *
                              (16 * (int64_t)c->hidden_size + (int64_t)c->num_experts_per_tok * dl +
                               2 * (int64_t)c->intermediate_size + 2 * (int64_t)c->n_routed_experts +
                              10 * (int64_t)c->kda_num_heads * c->kda_head_dim + mla_row)
                        : 0;
    return 64 * MIB + (int64_t)DF_CHUNK * 4 * wide + block;
}

static int64_t state_bytes(const df_engine *e, int ctx) {
    return e->ops->state_bytes_per_pos(e) * (int64_t)ctx +
           (e->ops->state_fixed_bytes ? e->ops->state_fixed_bytes(e) : 0);
}

static int plan_ctx(const df_engine *e) {
    int ctx = e->opts.plan_ctx > 0 ? e->opts.plan_ctx : 4096;
    if (e->cfg.max_position_embeddings > 0 && ctx > e->cfg.max_position_embeddings)
        ctx = e->cfg.max_position_embeddings;
    return ctx;
}

/* ---- the decision ---- */

static double gb(int64_t b) { return (double)b / 1e9; }

df_status plan_decide(df_engine *e, char *err) {
    eng_plan *p = &e->plan;
    const df_engine_opts *o = &e->opts;
    const df_config *c = &e->cfg;
    memset(p, 0, sizeof *p);
    int n_moe = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) n_moe += cfg_is_moe_layer(c, l);
    int experts_per_tok = o->top_k > 0 && o->top_k < c->num_experts_per_tok ? o->top_k : c->num_experts_per_tok;
    p->avail = mem_available();
    p->budget_given = o->ram_bytes > 0;
    /* room for what others allocate meanwhile (a mapped spine that loses its
     * page cache to them is read again every token): 1/16 of what is
     * available, at least 2 GiB (half of it on a small machine), at most 8 */
    int64_t margin = p->avail / 16;
    if (margin < 2 * GIB) margin = p->avail < 4 * GIB ? p->avail / 2 : 2 * GIB;
    if (margin > 8 * GIB) margin = 8 * GIB;
    p->budget = p->budget_given ? o->ram_bytes : p->avail - margin;
    int ctx = plan_ctx(e);
    tensor_sums s = sums_of(e);
    p->spine = s.spine;
    p->embed = s.embed;
    p->routed = s.routed;
    int64_t expert_bytes = n_moe > 0 && c->n_routed_experts > 0 ? s.routed / ((int64_t)n_moe * c->n_routed_experts) : 0;
    p->fixed = meta_bytes(e) + state_bytes(e, ctx) + scratch_bytes(e);
    int64_t emb = embed_touched(e, s.embed, ctx);
    p->spine_resident = s.spine - s.embed + emb;
    p->spine_stream = (s.spine - s.streamed - s.embed + emb) + 2 * s.max_group;
    int experts = o->expert_io != DF_EXPERTS_MMAP && e->cfg.n_routed_experts > 0;
    p->min_cache = experts ? (int64_t)(experts_per_tok > 0 ? experts_per_tok : 1) * expert_bytes : 0;
    /* a cache never needs more than every routed expert (in slots: each
     * expert's bytes plus up to 8 KB of O_DIRECT alignment) */
    int64_t n_experts = (int64_t)n_moe * c->n_routed_experts;
    int64_t want_cache = o->expert_cache_bytes > 0 && experts ? o->expert_cache_bytes : p->min_cache;
    if (want_cache > s.routed + n_experts * 8192) want_cache = s.routed + n_experts * 8192;
    int64_t room = p->budget - p->fixed;
    int fits_resident = p->spine_resident + want_cache <= room;
    int fits_stream = p->spine_stream + want_cache <= room;
    if (o->spine == DF_SPINE_STREAM) p->stream = 1;
    else if (o->spine == DF_SPINE_RESIDENT) p->stream = 0;
    else p->stream = !fits_resident && s.streamed > 0;
    const char *src = p->budget_given ? "--ram" : "available memory";
    if (p->budget_given && !(p->stream ? fits_stream : fits_resident)) {
        int64_t need = p->fixed + want_cache + (p->stream ? p->spine_stream : p->spine_resident);
        return df_fail(err, DF_ERR_ARG,
                       "--ram %.2f GB cannot hold this model: it needs at least %.2f GB (spine %s %.2f GB; "
                       "expert cache %.2f GB%s; session state for %d positions %.2f GB; metadata and "
                       "scratch %.2f GB). Raise --ram%s%s",
                       gb(p->budget), gb(need), p->stream ? "streamed per layer:" : "resident:",
                       gb(p->stream ? p->spine_stream : p->spine_resident), gb(want_cache),
                       o->expert_cache_bytes > 0 ? ", --expert-cache" : " (one token's experts of one layer)",
                       ctx, gb(state_bytes(e, ctx)), gb(p->fixed - state_bytes(e, ctx)),
                       o->expert_cache_bytes > 0 ? ", lower --expert-cache" : "",
                       p->stream || s.streamed == 0 ? ", or a smaller --ctx" : ", or let the spine stream (--spine auto)");
    }
    int64_t spine_cost = p->stream ? p->spine_stream : p->spine_resident;
    if (!experts) p->cache = 0;
    else if (o->expert_cache_bytes > 0) p->cache = want_cache;
    else p->cache = room - spine_cost > p->min_cache ? room - spine_cost : p->min_cache;
    if (o->spine == DF_SPINE_STREAM)
        snprintf(p->why, sizeof p->why, "streamed per layer as asked (--spine stream)");
    else if (o->spine == DF_SPINE_RESIDENT)
        snprintf(p->why, sizeof p->why, "resident as asked (--spine resident)");
    else if (p->stream)
        snprintf(p->why, sizeof p->why,
                 "streamed per layer: the spine (%.2f GB) does not fit beside a %.2f GB expert cache in the "
                 "%.2f GB budget (%s)", gb(p->spine_resident), gb(want_cache), gb(p->budget), src);
    else
        snprintf(p->why, sizeof p->why, "resident: it fits beside the expert cache in the %.2f GB budget (%s)",
                 gb(p->budget), src);
    return DF_OK;
}

/* ---- the final split ---- */

int64_t plan_expert_cache(df_engine *e) {
    eng_plan *p = &e->plan;
    if (e->opts.expert_cache_bytes > 0 || !e->store) return p->cache;
    /* the weights the program really bound replace the estimate */
    int64_t used = p->fixed + plan_weight_bytes(e);
    int64_t c = p->budget - used;
    p->cache = c > p->min_cache ? c : p->min_cache;
    return p->cache;
}

/* ---- plan bytes ---- */

int64_t plan_weight_bytes(const df_engine *e) {
    /* the tensor sums plan_decide took (the set does not change after open) */
    const eng_plan *p = &e->plan;
    int64_t untouched = p->embed - embed_touched(e, p->embed, plan_ctx(e));
    if (e->spine) return e->resident_bound - untouched + 2 * sp_slot_bytes(e->spine);
    return p->spine + (e->store ? 0 : p->routed) - untouched;
}

int64_t df_engine_plan_bytes(const df_engine *e, int max_ctx) {
    int64_t cache = e->store ? xs_pool_bytes(e->store) : 0;
    return plan_weight_bytes(e) + cache + state_bytes(e, max_ctx) + meta_bytes(e) + scratch_bytes(e);
}

void plan_describe(const df_engine *e, char *b, size_t cap) {
    int ctx = plan_ctx(e);
    int64_t cache = e->store ? xs_pool_bytes(e->store) : 0, w = plan_weight_bytes(e);
    snprintf(b, cap,
             "memory plan    %.3f GB of a %.3f GB budget (%s) for a %d-token session: weights %.3f + expert "
             "cache %.3f + state %.3f + metadata and scratch %.3f; the kernel can give %.3f GB now\n",
             gb(df_engine_plan_bytes(e, ctx)), gb(e->plan.budget),
             e->plan.budget_given ? "--ram" : "available memory less a margin", ctx, gb(w), gb(cache),
             gb(state_bytes(e, ctx)), gb(meta_bytes(e) + scratch_bytes(e)), gb(e->plan.avail));
}
