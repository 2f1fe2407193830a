/* deepseek_v3.c — the DeepSeek-V3 / Kimi-K2.x model program (prefix ds_).
 *
 * Owns the weight views of one DeepSeek-V3-family checkpoint and runs chunks
 * of up to DF_CHUNK positions through it with fp32 activations:
 *
 *   embed -> for each layer: RMSNorm -> MLA -> +residual -> RMSNorm ->
 *            (dense SiLU MLP | MoE: sigmoid router, grouped top-k, routed +
 *            shared experts) -> +residual  -> RMSNorm -> lm_head
 *
 * MLA runs in the absorbed form against the compact latent cache: per layer
 * and position the cache holds c_kv (kv_lora_rank floats, already
 * RMS-normalised) and the rotated k_pe (qk_rope_head_dim floats). Queries are
 * mapped into latent space with W_UK^T, attention is taken over the latents,
 * and W_UV lifts the result back per head. This equals the expanded form of
 * transformers up to float rounding.
 *
 * Exactness: every position's result depends only on its own inputs and the
 * cache, never on the chunk it was computed in or on the thread count
 * (kernels.h contract; attention and expert sums run in a fixed order), so
 * prefill and token-by-token decode produce identical bits.
 *
 * Attention lives in mla.c, the MLP and MoE block in ffn.c. Sections:
 * weights (binding, RoPE tables); state; forward; describe; the program table.
 */
#include "ffn.h"
#include "mla.h"
#include "prompt.h"
#include "../base/err.h"
#include "../kernels/ops.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- weights ---- */

static const char *const ds_ffn_names[3] = {"gate_proj", "up_proj", "down_proj"};

typedef struct {
    float *attn_norm, *ffn_norm;  /* owned f32 copies */
    mla_layer attn;
    int moe;
    ffn_weights mlp;              /* dense layers */
    moe_layer experts;            /* MoE layers */
} ds_layer;

typedef struct {
    int H, V, L, inter;           /* inter: widest MLP intermediate */
    float eps;
    mla_shape mla;
    ffn_act act;
    df_weight embed, head;
    float *final_norm;
    ds_layer *layers;
    float *inv_freq;
    int64_t expert_bytes_total;
    int n_moe_layers;
} ds_model;

static double yarn_mscale(double scale, double m) {
    return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

static double yarn_corr_dim(double rot, int dim, double base, double maxpos) {
    return (dim * log(maxpos / (rot * 2.0 * M_PI))) / (2.0 * log(base));
}

/* RoPE frequencies and scales, as transformers computes them (default, YaRN). */
static void rope_setup(const df_config *c, mla_shape *sh, float *inv_freq) {
    int d = sh->dr, h = d / 2;
    double base = c->rope_theta;
    sh->rope_mscale = 1.0f;
    sh->softmax_scale = (float)(1.0 / sqrt((double)sh->dq));
    for (int i = 0; i < h; i++) inv_freq[i] = 1.0f / (float)pow(base, (double)(2 * i) / d);
    if (c->rope_type != ROPE_YARN) return;
    double f = c->yarn_factor;
    double lo = floor(yarn_corr_dim(c->yarn_beta_fast, d, base, c->yarn_original_max_pos));
    double hi = ceil(yarn_corr_dim(c->yarn_beta_slow, d, base, c->yarn_original_max_pos));
    if (lo < 0) lo = 0;
    if (hi > d - 1) hi = d - 1;
    if (lo == hi) hi += 0.001;
    for (int i = 0; i < h; i++) {
        float pos_freq = (float)pow(base, (double)(2 * i) / d);
        float extra = 1.0f / pos_freq, inter = 1.0f / ((float)f * pos_freq);
        float ramp = (float)((i - lo) / (hi - lo));
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        float ext_factor = 1.0f - ramp;
        inv_freq[i] = inter * (1.0f - ext_factor) + extra * ext_factor;
    }
    if (c->yarn_mscale != 0 && c->yarn_mscale_all_dim != 0)
        sh->rope_mscale = (float)(yarn_mscale(f, c->yarn_mscale) / yarn_mscale(f, c->yarn_mscale_all_dim));
    else
        sh->rope_mscale = (float)yarn_mscale(f, 1.0);
    if (c->yarn_mscale_all_dim != 0) {
        double ms = yarn_mscale(f, c->yarn_mscale_all_dim);
        sh->softmax_scale = (float)(sh->softmax_scale * ms * ms);
    }
}

static void ds_close(void *p) {
    ds_model *m = p;
    if (!m) return;
    for (int l = 0; m->layers && l < m->L; l++) {
        ds_layer *y = &m->layers[l];
        free(y->attn_norm);
        free(y->ffn_norm);
        mla_free(&y->attn);
        moe_layer_free(&y->experts);
    }
    free(m->layers);
    free(m->final_norm);
    free(m->inv_freq);
    free(m);
}

/* transformers' DeepseekV3 masks dropped groups with 0.0 and renormalises at any top-k */
static const moe_flavour ds_moe = {ds_ffn_names, ds_ffn_names, 0.0f, 1};

static df_status bind_layer(df_engine *e, ds_model *m, int l, char *err) {
    e->spine_group = l; /* this layer's matrices stream together when the spine streams */
    const df_config *c = &e->cfg;
    ds_layer *y = &m->layers[l];
    char b[DF_NAME];
    df_status st = DF_OK;
    tname(b, "%slayers.%d.input_layernorm.weight", c->prefix, l);
    if (!(y->attn_norm = model_vec(e, b, m->H, &st, err))) return st;
    tname(b, "%slayers.%d.post_attention_layernorm.weight", c->prefix, l);
    if (!(y->ffn_norm = model_vec(e, b, m->H, &st, err))) return st;
    tname(b, "%slayers.%d.self_attn.", c->prefix, l);
    if ((st = mla_bind(e, &m->mla, b, 0, &y->attn, err))) return st;
    y->moe = cfg_is_moe_layer(c, l);
    tname(b, "%slayers.%d.mlp.", c->prefix, l);
    if (!y->moe) return ffn_bind(e, b, ds_ffn_names, c->intermediate_size, m->H, &y->mlp, err);
    m->n_moe_layers++;
    return moe_bind(e, l, b, &ds_moe, &y->experts, &m->expert_bytes_total, err);
}

static df_status ds_open(df_engine *e, void **out, char *err) {
    const df_config *c = &e->cfg;
    df_status st = model_find_prefix(e, err);
    if (st != DF_OK) return st;
    if (c->qk_rope_head_dim % 2 || c->qk_rope_head_dim > 512)
        return df_fail(err, DF_ERR_CONFIG, "%s/config.json: field 'qk_rope_head_dim' must be even and <= 512 (got %d)",
                       e->dir, c->qk_rope_head_dim);
    ds_model *m = calloc(1, sizeof *m);
    if (!m) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    m->H = c->hidden_size;
    m->V = c->vocab_size;
    m->L = c->num_hidden_layers;
    m->eps = (float)c->rms_norm_eps;
    m->inter = c->intermediate_size;
    int64_t ish = (int64_t)c->moe_intermediate_size * c->n_shared_experts;
    if (c->moe_intermediate_size > m->inter) m->inter = c->moe_intermediate_size;
    if (ish > m->inter) m->inter = (int)ish;
    mla_shape *sh = &m->mla;
    sh->hidden = m->H;
    sh->nh = c->num_attention_heads;
    sh->dn = c->qk_nope_head_dim;
    sh->dr = c->qk_rope_head_dim;
    sh->dv = c->v_head_dim;
    sh->dq = sh->dn + sh->dr;
    sh->R = c->kv_lora_rank;
    sh->qlr = c->q_lora_rank;
    sh->use_rope = 1;
    sh->rope_interleave = c->rope_interleave;
    sh->latent_eps = 1e-6f;
    m->act.situ = 0;
    if ((st = model_bind_ends(e, &m->embed, &m->head, &m->final_norm, err))) goto fail;
    m->inv_freq = calloc((size_t)(sh->dr / 2 + 1), sizeof(float));
    m->layers = calloc((size_t)m->L, sizeof(ds_layer));
    if (!m->inv_freq || !m->layers) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto fail; }
    rope_setup(c, sh, m->inv_freq);
    sh->inv_freq = m->inv_freq;
    for (int l = 0; l < m->L; l++)
        if ((st = bind_layer(e, m, l, err)) != DF_OK) goto fail;
    model_link_moe(e, &m->layers[0].experts, sizeof(ds_layer), m->L);
    *out = m;
    return DF_OK;
fail:
    ds_close(m);
    return st;
}

/* ---- state ---- */

typedef struct {
    int max_ctx, L;
    float *cache;                /* [L][max_ctx][R+dr] */
    void **cache_dev;            /* [L] the same on the device (acc_has_mla), else NULL */
    acc_table *acc;              /* owner of cache_dev */
    float *x, *xn, *y;           /* [C][H] */
    mla_scratch mla;
    moe_scratch moe;
} ds_state;

static int64_t ds_state_bytes_per_pos(const df_engine *e) {
    const df_config *c = &e->cfg;
    return (int64_t)c->num_hidden_layers * (c->kv_lora_rank + c->qk_rope_head_dim) * (int64_t)sizeof(float);
}

static void ds_state_free(void *p) {
    ds_state *s = p;
    if (!s) return;
    free(s->cache); free(s->x); free(s->xn); free(s->y);
    acc_states_free(s->acc, s->cache_dev, s->cache_dev ? s->L : 0);
    mla_scratch_free(&s->mla);
    moe_scratch_free(&s->moe);
    free(s);
}

static df_status ds_state_new(df_engine *e, int max_ctx, void **out) {
    ds_model *m = e->prog;
    const df_config *c = &e->cfg;
    ds_state *s = calloc(1, sizeof *s);
    if (!s) return DF_ERR_NOMEM;
    const size_t C = DF_CHUNK, F = sizeof(float);
    s->max_ctx = max_ctx;
    s->cache = malloc((size_t)m->L * max_ctx * mla_cache_floats_per_pos(&m->mla) * F);
    s->x = malloc(C * m->H * F);
    s->xn = malloc(C * m->H * F);
    s->y = malloc(C * m->H * F);
    if (!s->cache || !s->x || !s->xn || !s->y ||
        mla_scratch_new(&m->mla, pool_size(e->pool), max_ctx, DF_CHUNK, &s->mla) != DF_OK ||
        moe_scratch_new(DF_CHUNK, m->H, m->inter, c->n_routed_experts, c->num_experts_per_tok, m->H, &s->moe) != DF_OK) {
        ds_state_free(s);
        return DF_ERR_NOMEM;
    }
    /* the latent caches on the device when the accelerator runs MLA there */
    const df_accel_mla **desc = calloc((size_t)m->L, sizeof *desc);
    if (desc && acc_has_mla(e->acc)) {
        for (int l = 0; l < m->L; l++) desc[l] = &m->layers[l].attn.dev;
        int64_t bytes = (int64_t)max_ctx * mla_cache_floats_per_pos(&m->mla) * (int64_t)sizeof(float);
        s->L = m->L;
        s->acc = e->acc;
        s->cache_dev = acc_states_new(e->acc, m->L, NULL, desc, bytes);
    }
    free(desc);
    *out = s;
    return DF_OK;
}

/* ---- forward ---- */

/* Several sessions' rows in one pass (seg[0]'s scratch holds them all; see
 * df_program_ops.forward_batch): MLA runs per segment on its own cache. */
static df_status ds_forward_batch(df_engine *e, const df_fwd_seg *seg, int nseg, char *err) {
    ds_model *m = e->prog;
    ds_state *s = seg[0].state;
    int H = m->H, n = 0;
    for (int i = 0; i < nseg; i++) {
        const ds_state *si = seg[i].state;
        if (seg[i].n < 1 || seg[i].pos + seg[i].n > si->max_ctx) return DF_ERR_ARG;
        n += seg[i].n;
    }
    if (n > DF_CHUNK || nseg > DF_CHUNK) return DF_ERR_ARG;
    size_t nh = (size_t)n * H;
    mla_seg ms[DF_CHUNK];
    int rpos[DF_CHUNK], rseg[DF_CHUNK];
    double pt = prof_now(e);
    for (int i = 0, off = 0; i < nseg; off += seg[i].n, i++) {
        model_embed_tokens(e, &m->embed, seg[i].tokens, seg[i].n, s->x + (size_t)off * H);
        for (int t = 0; t < seg[i].n; t++) {
            rpos[off + t] = seg[i].pos + t;
            rseg[off + t] = i;
        }
    }
    s->moe.rpos = nseg > 1 ? rpos : NULL;
    s->moe.rseg = nseg > 1 ? rseg : NULL;
    prof_add(e, DF_PROF_EMBED, &pt);
    for (int l = 0; l < m->L; l++) {
        ds_layer *y = &m->layers[l];
        df_status est = model_enter(e, l, err);
        if (est != DF_OK) return est;
        for (int t = 0; t < n; t++) op_rmsnorm(s->xn + (size_t)t * H, s->x + (size_t)t * H, y->attn_norm, H, m->eps);
        prof_add(e, DF_PROF_NORMS, &pt);
        for (int i = 0; i < nseg; i++) {
            ds_state *si = seg[i].state;
            int64_t cstride = (int64_t)si->max_ctx * mla_cache_floats_per_pos(&m->mla);
            ms[i] = (mla_seg){si->cache + l * cstride, si->cache_dev ? si->cache_dev[l] : NULL, &si->mla, seg[i].pos,
                              seg[i].n};
        }
        df_status ast = mla_forward_batch(e, &m->mla, &y->attn, ms, nseg, &s->mla, s->xn, s->y, err);
        if (ast != DF_OK) return ast;
        prof_add(e, DF_PROF_MLA, &pt);
        for (size_t i = 0; i < nh; i++) s->x[i] += s->y[i];
        for (int t = 0; t < n; t++) op_rmsnorm(s->xn + (size_t)t * H, s->x + (size_t)t * H, y->ffn_norm, H, m->eps);
        prof_add(e, DF_PROF_NORMS, &pt);
        const moe_layer *next = l + 1 < m->L && m->layers[l + 1].moe ? &m->layers[l + 1].experts : NULL;
        df_status st = ffn_block(e, y->moe ? &y->experts : NULL, &y->mlp, next, &m->act, &s->moe, s->xn, n, seg[0].pos,
                                 s->y, &pt, err);
        if (st != DF_OK) return st;
        for (size_t i = 0; i < nh; i++) s->x[i] += s->y[i];
    }
    s->moe.rpos = NULL;
    s->moe.rseg = NULL;
    int rows = 0;
    for (int i = 0, off = 0; i < nseg; off += seg[i].n, i++) {
        if (!seg[i].out) continue;
        for (int t = seg[i].all_rows ? 0 : seg[i].n - 1; t < seg[i].n; t++, rows++)
            op_rmsnorm(s->xn + (size_t)rows * H, s->x + (size_t)(off + t) * H, m->final_norm, H, m->eps);
    }
    return model_batch_head(e, m->L, &m->head, s->xn, rows, seg, nseg, err);
}

static df_status ds_forward(df_engine *e, void *state, int pos, const int32_t *tokens, int n,
                            float *out, int all_rows, char *err) {
    ds_state *s = state;
    if (n > DF_CHUNK || pos + n > s->max_ctx) return DF_ERR_ARG;
    df_fwd_seg seg = {state, pos, tokens, n, out, all_rows};
    return ds_forward_batch(e, &seg, 1, err);
}

/* ---- a long prompt, layer by layer ---- */

/* Rows [t0, t1) of a block: x += add (when add), then xn = rmsnorm(x) with
 * norm (the rows split over the pool: each row depends on itself alone). */
typedef struct {
    float *x, *xn;
    const float *add, *norm;
    int H;
    float eps;
} ds_rows_job;

static void norm_rows(void *ctx, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const ds_rows_job *j = ctx;
    for (int64_t t = t0; t < t1; t++) {
        float *xt = j->x + (size_t)t * j->H;
        if (j->add)
            for (int i = 0; i < j->H; i++) xt[i] += j->add[(size_t)t * j->H + i];
        op_rmsnorm(j->xn + (size_t)t * j->H, xt, j->norm, j->H, j->eps);
    }
}

static void block_norms(df_engine *e, int n, float *x, const float *add, const float *norm, float *xn, int H,
                        float eps) {
    ds_rows_job j = {x, xn, add, norm, H, eps};
    pool_for(e->pool, n, 8, norm_rows, &j);
}

/* One block of a prompt (prompt.h; the same contract as kimi.c's): every
 * layer over all of its rows, MLA's projections over the block's rows at
 * once (mla_forward_block), the MoE block over every row at once. */
static df_status ds_prompt_block(df_engine *e, void *ctx, prompt_buf *b, int pos, const int32_t *tokens, int n,
                                 float *out, int all_rows, char *err) {
    ds_model *m = e->prog;
    ds_state *s = ctx; /* the session; the block's attention scratch is b's */
    const int H = m->H;
    const int64_t cstride = (int64_t)s->max_ctx * mla_cache_floats_per_pos(&m->mla);
    const size_t nh = (size_t)n * H;
    float *x = b->h, *xn = b->xn, *yv = b->y;
    double pt = prof_now(e);
    model_embed_tokens(e, &m->embed, tokens, n, x);
    prof_add(e, DF_PROF_EMBED, &pt);
    for (int l = 0; l < m->L; l++) {
        ds_layer *y = &m->layers[l];
        df_status st = model_enter(e, l, err);
        if (st != DF_OK) return st;
        block_norms(e, n, x, NULL, y->attn_norm, xn, H, m->eps);
        prof_add(e, DF_PROF_NORMS, &pt);
        /* the block's rows at once where the block's scratch holds them */
        st = mla_forward_block(e, &m->mla, &y->attn, s->cache + l * cstride, &b->mla, &s->mla, pos, n, xn, yv, err);
        if (st != DF_OK) return st;
        prof_add(e, DF_PROF_MLA, &pt);
        block_norms(e, n, x, yv, y->ffn_norm, xn, H, m->eps);
        prof_add(e, DF_PROF_NORMS, &pt);
        const moe_layer *next = l + 1 < m->L && m->layers[l + 1].moe ? &m->layers[l + 1].experts : NULL;
        st = ffn_block(e, y->moe ? &y->experts : NULL, &y->mlp, next, &m->act, &b->moe, xn, n, pos, yv, &pt, err);
        if (st != DF_OK) return st;
        for (size_t i = 0; i < nh; i++) x[i] += yv[i];
    }
    if (!out) return DF_OK;
    const int t0 = all_rows ? 0 : n - 1;
    for (int t = t0; t < n; t++)
        op_rmsnorm(xn + (size_t)(t - t0) * H, x + (size_t)t * H, m->final_norm, H, m->eps);
    df_fwd_seg seg = {s, pos + t0, tokens + t0, n - t0, out, all_rows};
    return model_batch_head(e, m->L, &m->head, xn, n - t0, &seg, 1, err);
}

static df_status ds_forward_prompt(df_engine *e, void *state, int pos, const int32_t *tokens, int n, float *out,
                                   int all_rows, char *err) {
    ds_model *m = e->prog;
    ds_state *s = state;
    if (n < 1 || pos + n > s->max_ctx) return DF_ERR_ARG;
    const prompt_attn attn = {NULL, &m->mla};
    return prompt_run(e, m->H, 0, m->inter, m->H, attn, pos, tokens, n, out, all_rows, ds_prompt_block, s, err);
}

/* ---- describe ---- */

static void ds_describe(df_engine *e, char *b, size_t cap) {
    ds_model *m = e->prog;
    const df_config *c = &e->cfg;
    const mla_shape *sh = &m->mla;
    int64_t total = st_total_bytes(e->st);
    int64_t one = 0;
    for (int l = 0; l < m->L; l++)
        if (m->layers[l].moe) { one = m->layers[l].experts.expert_bytes; break; }
    int64_t per_tok = (int64_t)c->num_experts_per_tok * m->n_moe_layers * one;
    snprintf(b, cap,
             "attention      MLA: q_lora %d, kv_lora %d, heads %d x (nope %d + rope %d), v %d; rope %s%s\n"
             "moe            %d MoE layers (first %d dense), %d routed experts, top-%d, %d shared; "
             "groups %d/%d, scale %.3g\n"
             "experts        %d in all, %.3f MB each, %.3f GB together\n"
             "resident       %.3f GB (everything but routed experts)\n"
             "expert bytes   %.3f MB per token (%d x %d layers)\n"
             "context state  %lld bytes per token (compact MLA latent cache)\n"
             "weights        embed %s, head %s, quantisation %s\n",
             sh->qlr, sh->R, sh->nh, sh->dn, sh->dr, sh->dv,
             c->rope_type == ROPE_YARN ? "yarn" : "default", c->rope_interleave ? " (interleaved)" : "",
             m->n_moe_layers, c->first_k_dense_replace, c->n_routed_experts, c->num_experts_per_tok,
             c->n_shared_experts, c->n_group, c->topk_group, c->routed_scaling_factor,
             c->n_routed_experts * m->n_moe_layers, one / 1e6, m->expert_bytes_total / 1e9,
             (total - m->expert_bytes_total) / 1e9, per_tok / 1e6, c->num_experts_per_tok,
             m->n_moe_layers, (long long)ds_state_bytes_per_pos(e), wt_type_name(m->embed.type),
             wt_type_name(m->head.type),
             c->quant == QUANT_FP8_BLOCK ? "fp8 e4m3 block" : c->quant == QUANT_CT_INT4 ? "int4 g32 (compressed-tensors)"
             : c->quant == QUANT_CT_MXFP4 ? "mxfp4 (compressed-tensors)" : "none");
}

const df_program_ops dsv3_program = {
    .name = "deepseek_v3",
    .open = ds_open,
    .close = ds_close,
    .state_bytes_per_pos = ds_state_bytes_per_pos,
    .state_new = ds_state_new,
    .state_free = ds_state_free,
    .forward = ds_forward,
    .forward_batch = ds_forward_batch,
    .forward_prompt = ds_forward_prompt,
    .describe = ds_describe,
};
