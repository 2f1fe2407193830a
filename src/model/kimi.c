/* kimi.c — the Kimi-Linear and Kimi K3 model program (prefix km_).
 *
 * One program for both: the config says which parts a checkpoint has.
 *
 *   embed -> for each layer i:
 *     x_attn = AttnRes(h, anchors, self_attention_res)   (K3; h otherwise)
 *     if i % block == 0: anchors += h, the block sum restarts   (K3)
 *     a      = KDA or NoPE-MLA (+ sigmoid output gate on K3) of RMSNorm(x_attn)
 *     h      = h + a   (or a, at a block start)
 *     x_mlp  = AttnRes(h, anchors, mlp_res)               (K3; h otherwise)
 *     m      = dense MLP or MoE of RMSNorm(x_mlp)  (SiTU on K3, SiLU otherwise;
 *              K3's routed experts work in a latent space)
 *     h      = h + m
 *   -> AttnRes(h, anchors, output_attn_res) (K3) -> RMSNorm -> lm_head
 *
 * AttnRes(cur, anchors, w): softmax over [anchors..., cur] of
 * (w . v / rms(v)), w = res_norm * res_proj; the output mixes the rows.
 * Anchors are per position and live only inside one forward pass; the
 * session keeps the MLA latent caches and the KDA conv + recurrent states.
 * Tensor names follow the release: `block_sparse_moe.experts.E.w1/w2/w3`
 * (w1 gate, w3 up, w2 down), plain bf16 or MXFP4 `weight_packed`.
 *
 * Sections: weights; state; forward (AttnRes is op_attn_res, ops.c); describe;
 * table. The pass with its activations on the device is kimi_dev.c; the
 * types both share are in kimi_internal.h.
 */
#include "kimi_internal.h"
#include "prompt.h"
#include "../base/err.h"
#include "../kernels/ops.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- weights ---- */

static const char *const km_expert_names[3] = {"w1", "w3", "w2"};
static const char *const km_mlp_names[3] = {"gate_proj", "up_proj", "down_proj"};

static void km_close(void *p) {
    km_model *m = p;
    if (!m) return;
    for (int l = 0; m->layers && l < m->L; l++) {
        km_layer *y = &m->layers[l];
        free(y->attn_norm); free(y->ffn_norm); free(y->res_attn); free(y->res_mlp);
        kda_free(&y->k);
        mla_free(&y->a);
        moe_layer_free(&y->experts);
    }
    free(m->layers);
    free(m->final_norm);
    free(m->res_out);
    free(m);
}

/* w = norm.weight * proj.weight ([1, H] row), the AttnRes score probe. */
static float *res_probe(df_engine *e, const char *norm, const char *proj, int H, df_status *st, char *err) {
    float *w = model_vec(e, norm, H, st, err);
    if (!w) return NULL;
    float *p = model_vec(e, proj, H, st, err);
    if (!p) { free(w); return NULL; }
    for (int i = 0; i < H; i++) w[i] *= p[i];
    free(p);
    return w;
}

/* Moonshot masks dropped groups with -inf and renormalises only when top-k > 1 */
static const moe_flavour km_moe = {km_mlp_names, km_expert_names, -INFINITY, 0};

static df_status bind_layer(df_engine *e, km_model *m, int l, char *err) {
    e->spine_group = l; /* this layer's matrices stream together when the spine streams */
    const df_config *c = &e->cfg;
    km_layer *y = &m->layers[l];
    char b[DF_NAME], b2[DF_NAME];
    df_status st = DF_OK;
    const char *P = c->prefix;
    tname(b, "%slayers.%d.input_layernorm.weight", P, l);
    if (!(y->attn_norm = model_vec(e, b, m->H, &st, err))) return st;
    tname(b, "%slayers.%d.post_attention_layernorm.weight", P, l);
    if (!(y->ffn_norm = model_vec(e, b, m->H, &st, err))) return st;
    if (m->block > 0) {
        tname(b, "%slayers.%d.self_attention_res_norm.weight", P, l);
        tname(b2, "%slayers.%d.self_attention_res_proj.weight", P, l);
        if (!(y->res_attn = res_probe(e, b, b2, m->H, &st, err))) return st;
        tname(b, "%slayers.%d.mlp_res_norm.weight", P, l);
        tname(b2, "%slayers.%d.mlp_res_proj.weight", P, l);
        if (!(y->res_mlp = res_probe(e, b, b2, m->H, &st, err))) return st;
    }
    y->kda = c->is_kda[l];
    tname(b, "%slayers.%d.self_attn.", P, l);
    if (y->kda) {
        y->slot = m->n_kda++;
        if ((st = kda_bind(e, &m->kda, b, &y->k, err))) return st;
    } else {
        y->slot = m->n_mla++;
        if ((st = mla_bind(e, &m->mla, b, c->mla_use_output_gate, &y->a, err))) return st;
    }
    y->moe = cfg_is_moe_layer(c, l);
    if (!y->moe) {
        tname(b, "%slayers.%d.mlp.", P, l);
        return ffn_bind(e, b, km_mlp_names, c->intermediate_size, m->H, &y->mlp, err);
    }
    m->n_moe++;
    tname(b, "%slayers.%d.block_sparse_moe.", P, l);
    df_status mst = moe_bind(e, l, b, &km_moe, &y->experts, &m->expert_bytes_total, err);
    m->expert_bytes = y->experts.expert_bytes;
    return mst;
}

static df_status km_open(df_engine *e, void **out, char *err) {
    const df_config *c = &e->cfg;
    df_status st = model_find_prefix(e, err);
    if (st != DF_OK) return st;
    km_model *m = calloc(1, sizeof *m);
    if (!m) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    m->H = c->hidden_size;
    m->V = c->vocab_size;
    m->L = c->num_hidden_layers;
    m->eps = (float)c->rms_norm_eps;
    m->block = c->attn_res_block_size;
    m->max_anchors = m->block > 0 ? (m->L + m->block - 1) / m->block + 1 : 0;
    m->inter = c->intermediate_size;
    if (c->moe_intermediate_size > m->inter) m->inter = c->moe_intermediate_size;
    if ((int64_t)c->moe_intermediate_size * c->n_shared_experts > m->inter)
        m->inter = c->moe_intermediate_size * c->n_shared_experts;
    mla_shape *sh = &m->mla;
    sh->hidden = m->H;
    sh->nh = c->num_attention_heads;
    sh->dn = c->qk_nope_head_dim;
    sh->dr = c->qk_rope_head_dim;
    sh->dv = c->v_head_dim;
    sh->dq = sh->dn + sh->dr;
    sh->R = c->kv_lora_rank;
    sh->qlr = c->q_lora_rank;
    sh->use_rope = 0; /* NoPE: the rope dims take part in q.k unrotated */
    sh->softmax_scale = (float)(1.0 / sqrt((double)sh->dq));
    sh->latent_eps = 1e-6f;
    kda_shape *ks = &m->kda;
    ks->hidden = m->H;
    ks->H = c->kda_num_heads;
    ks->D = c->kda_head_dim;
    ks->W = c->kda_conv_kernel;
    ks->full_rank_gate = c->kda_full_rank_gate;
    ks->has_lower_bound = c->kda_has_lower_bound;
    ks->lower_bound = (float)c->kda_lower_bound;
    ks->norm_eps = (float)c->rms_norm_eps;
    m->act.situ = strcmp(c->hidden_act, "situ") == 0;
    m->act.beta = (float)c->situ_beta;
    m->act.linear_beta = (float)c->situ_linear_beta;

    char name[DF_NAME];
    if ((st = model_bind_ends(e, &m->embed, &m->head, &m->final_norm, err))) goto fail;
    if (m->block > 0) {
        char n2[DF_NAME];
        tname(name, "%soutput_attn_res_norm.weight", c->prefix);
        tname(n2, "%soutput_attn_res_proj.weight", c->prefix);
        if (!(m->res_out = res_probe(e, name, n2, m->H, &st, err))) goto fail;
    }
    m->layers = calloc((size_t)m->L, sizeof(km_layer));
    if (!m->layers) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto fail; }
    for (int l = 0; l < m->L; l++)
        if ((st = bind_layer(e, m, l, err))) goto fail;
    model_link_moe(e, &m->layers[0].experts, sizeof(km_layer), m->L);
    *out = m;
    return DF_OK;
fail:
    km_close(m);
    return st;
}

/* ---- state ---- */

static int64_t km_state_bytes_per_pos(const df_engine *e) {
    const df_config *c = &e->cfg;
    int n_mla = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) n_mla += !c->is_kda[l];
    return (int64_t)n_mla * (c->kv_lora_rank + c->qk_rope_head_dim) * (int64_t)sizeof(float);
}

/* From the config alone: the memory plan asks before the program is open. */
static int64_t km_state_fixed_bytes(const df_engine *e) {
    const df_config *c = &e->cfg;
    int n_kda = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) n_kda += c->is_kda[l] != 0;
    kda_shape ks = {0};
    ks.H = c->kda_num_heads;
    ks.D = c->kda_head_dim;
    ks.W = c->kda_conv_kernel;
    return (int64_t)n_kda * kda_state_floats(&ks) * (int64_t)sizeof(float);
}

static void km_state_free(void *p) {
    km_state *s = p;
    if (!s) return;
    free(s->mla_cache); free(s->kda_state); free(s->h); free(s->xin); free(s->xn); free(s->y);
    free(s->anchors);
    free(s->rw_keep);
    acc_states_free(s->acc, s->kda_dev, s->n_dev);
    acc_states_free(s->acc, s->mla_dev, s->n_mla_dev);
    acc_dev_free(s->acc, s->dv);
    mla_scratch_free(&s->mla);
    kda_scratch_free(&s->kda);
    moe_scratch_free(&s->moe);
    free(s);
}

static void km_state_reset(df_engine *e, void *p) {
    km_model *m = e->prog;
    km_state *s = p;
    memset(s->kda_state, 0, (size_t)(m->n_kda ? m->n_kda : 1) * kda_state_floats(&m->kda) * sizeof(float));
    for (int i = 0; i < s->n_dev; i++) acc_state_zero(s->acc, s->kda_dev[i], NULL); /* a failure shows at the next step */
}

static df_status km_rewind_setup(df_engine *e, void *p, int depth, int mode) {
    km_model *m = e->prog;
    km_state *s = p;
    if (s->kda_dev && depth > 0) return DF_ERR_UNSUPPORTED;
    free(s->rw_keep);
    s->rw_keep = NULL;
    s->rw_depth = 0;
    if (depth <= 0 || m->n_kda == 0) return DF_OK;
    size_t per = (size_t)m->n_kda * (size_t)kda_state_floats(&m->kda);
    s->rw_keep = malloc(per * (mode == DF_REWIND_TRAIL ? (size_t)depth : 1) * sizeof(float));
    if (!s->rw_keep) return DF_ERR_NOMEM;
    s->rw_depth = depth;
    s->rw_mode = mode;
    return DF_OK;
}

static void km_rewind_to(df_engine *e, void *p, int t) {
    km_model *m = e->prog;
    km_state *s = p;
    if (!s->rw_keep) return;
    size_t F = (size_t)kda_state_floats(&m->kda);
    for (int k = 0; k < m->n_kda; k++) {
        const float *src = t < 0 ? s->rw_keep + (size_t)k * F : s->rw_keep + ((size_t)k * s->rw_depth + (size_t)t) * F;
        memcpy(s->kda_state + (size_t)k * F, src, F * sizeof(float));
    }
}

/* The session states of one kind on the device when the accelerator offers
 * it: KDA states (kda = 1) or MLA latent caches, one per layer of that kind
 * in slot order, all or none. */
static void states_on_device(df_engine *e, const km_model *m, km_state *s, int kda, void ***dev, int *count) {
    int want = kda ? m->n_kda : m->n_mla, k = 0;
    const void **desc = want > 0 ? calloc((size_t)want, sizeof *desc) : NULL;
    if (!desc) return;
    for (int l = 0; l < m->L; l++) {
        const km_layer *y = &m->layers[l];
        if (!y->kda != !kda || y->slot >= want) continue;
        desc[y->slot] = kda ? (const void *)&y->k.dev : (const void *)&y->a.dev;
        k++;
    }
    int64_t floats = kda ? kda_state_floats(&m->kda) : (int64_t)s->max_ctx * mla_cache_floats_per_pos(&m->mla);
    if (k == want &&
        (*dev = acc_states_new(e->acc, want, kda ? (const df_accel_kda *const *)desc : NULL,
                               kda ? NULL : (const df_accel_mla *const *)desc, floats * (int64_t)sizeof(float)))) {
        *count = want;
        s->acc = e->acc;
    }
    free(desc);
}

static df_status km_state_new(df_engine *e, int max_ctx, void **out) {
    km_model *m = e->prog;
    const df_config *c = &e->cfg;
    km_state *s = calloc(1, sizeof *s);
    if (!s) return DF_ERR_NOMEM;
    const size_t C = DF_CHUNK, F = sizeof(float);
    s->max_ctx = max_ctx;
    s->mla_cache = malloc((size_t)(m->n_mla ? m->n_mla : 1) * max_ctx * mla_cache_floats_per_pos(&m->mla) * F);
    s->kda_state = calloc((size_t)(m->n_kda ? m->n_kda : 1) * kda_state_floats(&m->kda), F);
    s->h = malloc(C * m->H * F);
    s->xin = malloc(C * m->H * F);
    s->xn = malloc(C * m->H * F);
    s->y = malloc(C * m->H * F);
    s->anchors = malloc(C * (m->max_anchors ? m->max_anchors : 1) * m->H * F);
    int dl = c->routed_expert_hidden_size > 0 ? c->routed_expert_hidden_size : m->H;
    if (!s->mla_cache || !s->kda_state || !s->h || !s->xin || !s->xn || !s->y || !s->anchors ||
        (m->n_mla && mla_scratch_new(&m->mla, pool_size(e->pool), max_ctx, DF_CHUNK, &s->mla) != DF_OK) ||
        (m->n_kda && kda_scratch_new(&m->kda, DF_CHUNK, &s->kda) != DF_OK) ||
        moe_scratch_new(DF_CHUNK, m->H, m->inter, c->n_routed_experts, c->num_experts_per_tok, dl, &s->moe) != DF_OK) {
        km_state_free(s);
        return DF_ERR_NOMEM;
    }
    states_on_device(e, m, s, 1, &s->kda_dev, &s->n_dev);
    states_on_device(e, m, s, 0, &s->mla_dev, &s->n_mla_dev);
    km_step_on_device(e, m, s, dl, c->num_experts_per_tok);
    *out = s;
    return DF_OK;
}

/* ---- forward ---- */

/* Early lookahead: the first MoE layer's router on the embedding h (its own
 * norm, into xn), so its likely experts are read while the layers before it
 * compute; the usual lookahead refines it a layer ahead. */
void km_early_lookahead(df_engine *e, const km_model *m, moe_scratch *ms, const float *h, float *xn, int n) {
    int H = m->H;
    for (int l = 0; l < m->L; l++) {
        if (!m->layers[l].moe) continue;
        if (l > 0 && !moe_all_on_device(e, &m->layers[l].experts)) {
            for (int t = 0; t < n; t++)
                op_rmsnorm(xn + (size_t)t * H, h + (size_t)t * H, m->layers[l].ffn_norm, H, m->eps);
            moe_lookahead(e, &m->layers[l].experts, ms, xn, n);
        }
        break;
    }
}

/* The per-row work around a layer, rows split over the pool (each row's
 * values depend on that row alone: the same bits for any split). */
typedef struct {
    const km_model *m;
    const km_layer *y;
    int l, na, restart;
    float *h, *anchors, *xin, *xn;
    const float *yv;
} rows_job;

/* Rows [t0, t1) of layer_in: the attention residual (or h) into xin, the
 * block's anchor, the attention norm. */
static void in_rows(void *ctx, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const rows_job *j = ctx;
    const km_model *m = j->m;
    const int H = m->H, A = m->max_anchors;
    for (int64_t t = t0; t < t1; t++) {
        const float *ht = j->h + (size_t)t * H;
        float *xt = j->xin + (size_t)t * H;
        if (m->block > 0) {
            float *anc = j->anchors + (size_t)t * A * H;
            if (j->na > 0) op_attn_res(anc, j->na, ht, j->y->res_attn, H, m->eps, xt);
            else memcpy(xt, ht, (size_t)H * sizeof(float));
            if (j->l % m->block == 0) memcpy(anc + (size_t)j->na * H, ht, (size_t)H * sizeof(float));
        } else {
            memcpy(xt, ht, (size_t)H * sizeof(float));
        }
        op_rmsnorm(j->xn + (size_t)t * H, xt, j->y->attn_norm, H, m->eps);
    }
}

/* Rows [t0, t1) of layer_mid: h = yv (restart) or h + yv, the MLP residual's
 * input, its norm. */
static void mid_rows(void *ctx, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const rows_job *j = ctx;
    const km_model *m = j->m;
    const int H = m->H, A = m->max_anchors;
    for (int64_t t = t0; t < t1; t++) {
        float *ht = j->h + (size_t)t * H, *xt = j->xin + (size_t)t * H;
        const float *yt = j->yv + (size_t)t * H;
        if (j->restart) memcpy(ht, yt, (size_t)H * sizeof(float));
        else for (int i = 0; i < H; i++) ht[i] += yt[i];
        if (m->block > 0) op_attn_res(j->anchors + (size_t)t * A * H, j->na, ht, j->y->res_mlp, H, m->eps, xt);
        else memcpy(xt, ht, (size_t)H * sizeof(float));
        op_rmsnorm(j->xn + (size_t)t * H, xt, j->y->ffn_norm, H, m->eps);
    }
}

/* A layer's input for rows [0, n) of h: K3's attention residual over the
 * anchors so far (or h itself) into xin, an anchor saved at each block's
 * first layer, then the attention norm into xn. Returns 1 when layer l
 * starts a block (the attention output then replaces h). */
static int layer_in(df_engine *e, const km_model *m, const km_layer *y, int l, int n, float *h, float *anchors,
                    int *na, float *xin, float *xn) {
    rows_job j = {m, y, l, *na, 0, h, anchors, xin, xn, NULL};
    pool_for(e->pool, n, 8, in_rows, &j);
    if (m->block > 0 && l % m->block == 0) {
        (*na)++;
        return 1;
    }
    return 0;
}

/* After the attention output yv: h = yv (restart) or h + yv, then the MLP
 * residual's input into xin and its norm into xn. */
static void layer_mid(df_engine *e, const km_model *m, const km_layer *y, int n, float *h, const float *yv,
                      float *anchors, int na, int restart, float *xin, float *xn) {
    rows_job j = {m, y, 0, na, restart, h, anchors, xin, xn, yv};
    pool_for(e->pool, n, 8, mid_rows, &j);
}

/* The head's input for one row: the output attention residual (or x), then
 * the final norm into xn. */
static void head_in(const km_model *m, const float *x, const float *anchors, int na, float *xo, float *xn) {
    int H = m->H;
    if (m->block > 0) op_attn_res(anchors, na, x, m->res_out, H, m->eps, xo);
    else memcpy(xo, x, (size_t)H * sizeof(float));
    op_rmsnorm(xn, xo, m->final_norm, H, m->eps);
}

/* Segment i's embedding rows into h from row off, with each row's
 * position and segment (rpos, rseg; NULL: not kept). */
void km_embed_rows(df_engine *e, const km_model *m, float *h, const df_fwd_seg *sg, int i, int off, int *rpos,
                   int *rseg) {
    model_embed_tokens(e, &m->embed, sg->tokens, sg->n, h + (size_t)off * m->H);
    for (int t = 0; t < sg->n; t++) {
        if (rpos) rpos[off + t] = sg->pos + t;
        if (rseg) rseg[off + t] = i;
    }
}

/* Rows of several sessions in one pass (seg[0]'s scratch holds them all):
 * per-row work (embedding, AttnRes, norms, the MoE block, the head) and the
 * projections see every row at once; attention runs per segment on its own
 * state. Each row is bit-identical to running its session alone. */
static df_status km_forward_batch(df_engine *e, const df_fwd_seg *seg, int nseg, char *err) {
    km_model *m = e->prog;
    km_state *s = seg[0].state;
    int H = m->H, A = m->max_anchors, n = 0;
    for (int i = 0; i < nseg; i++) {
        const km_state *si = seg[i].state;
        if (seg[i].n < 1 || seg[i].pos + seg[i].n > si->max_ctx) return DF_ERR_ARG;
        n += seg[i].n;
    }
    if (n > DF_CHUNK || nseg > DF_CHUNK) return DF_ERR_ARG;
    if (s->dv) {
        const km_pass p = {s, &s->dev, s->h, s->xin, s->xn, s->y, s->anchors, &s->moe};
        return km_pass_dev(e, &p, seg, nseg, n, err);
    }
    size_t nh = (size_t)n * H;
    int64_t kstride = kda_state_floats(&m->kda);
    kda_seg ks[DF_CHUNK];
    mla_seg ms[DF_CHUNK];
    float *trail[DF_CHUNK];
    int rpos[DF_CHUNK], rseg[DF_CHUNK];
    double pt = prof_now(e);
    for (int i = 0, off = 0; i < nseg; off += seg[i].n, i++) {
        km_state *si = seg[i].state;
        int keep = si->rw_keep && seg[i].n <= si->rw_depth; /* rewind_setup: keep what a rewind needs */
        if (keep && si->rw_mode == DF_REWIND_REPLAY)
            memcpy(si->rw_keep, si->kda_state, (size_t)m->n_kda * kstride * sizeof(float));
        trail[i] = keep && si->rw_mode == DF_REWIND_TRAIL ? si->rw_keep : NULL;
        km_embed_rows(e, m, s->h, &seg[i], i, off, rpos, rseg);
    }
    s->moe.rpos = nseg > 1 ? rpos : NULL;
    s->moe.rseg = nseg > 1 ? rseg : NULL;
    km_early_lookahead(e, m, &s->moe, s->h, s->xn, n);
    prof_add(e, DF_PROF_EMBED, &pt);
    int na = 0; /* anchors so far (same count for every position) */
    for (int l = 0; l < m->L; l++) {
        km_layer *y = &m->layers[l];
        df_status est = model_enter(e, l, err);
        if (est != DF_OK) return est;
        pt = prof_now(e);
        int restart = layer_in(e, m, y, l, n, s->h, s->anchors, &na, s->xin, s->xn);
        prof_add(e, DF_PROF_NORMS, &pt);
        if (y->kda) {
            for (int i = 0; i < nseg; i++) {
                km_state *si = seg[i].state;
                ks[i] = (kda_seg){si->kda_state + y->slot * kstride, si->kda_dev ? si->kda_dev[y->slot] : NULL,
                                  trail[i] ? trail[i] + (size_t)y->slot * si->rw_depth * kstride : NULL, seg[i].n};
            }
            df_status kst = kda_forward_batch(e, &m->kda, &y->k, ks, nseg, &s->kda, s->xn, s->y, err);
            if (kst != DF_OK) return kst;
        } else {
            for (int i = 0; i < nseg; i++) {
                km_state *si = seg[i].state;
                int64_t cstride = (int64_t)si->max_ctx * mla_cache_floats_per_pos(&m->mla);
                ms[i] = (mla_seg){si->mla_cache + y->slot * cstride, si->mla_dev ? si->mla_dev[y->slot] : NULL, &si->mla,
                                  seg[i].pos, seg[i].n};
            }
            df_status ast = mla_forward_batch(e, &m->mla, &y->a, ms, nseg, &s->mla, s->xn, s->y, err);
            if (ast != DF_OK) return ast;
        }
        prof_add(e, y->kda ? DF_PROF_KDA : DF_PROF_MLA, &pt);
        layer_mid(e, m, y, n, s->h, s->y, s->anchors, na, restart, s->xin, s->xn);
        prof_add(e, DF_PROF_NORMS, &pt);
        const moe_layer *next = l + 1 < m->L && m->layers[l + 1].moe ? &m->layers[l + 1].experts : NULL;
        df_status st = ffn_block(e, y->moe ? &y->experts : NULL, &y->mlp, next, &m->act, &s->moe, s->xn, n, seg[0].pos,
                                 s->y, &pt, err);
        if (st != DF_OK) return st;
        for (size_t i = 0; i < nh; i++) s->h[i] += s->y[i];
        prof_add(e, DF_PROF_NORMS, &pt);
    }
    s->moe.rpos = NULL;
    s->moe.rseg = NULL;
    /* the head: every row of a segment that wants all rows, else its last */
    int rows = 0;
    for (int i = 0, off = 0; i < nseg; off += seg[i].n, i++) {
        if (!seg[i].out) continue;
        for (int t = seg[i].all_rows ? 0 : seg[i].n - 1; t < seg[i].n; t++, rows++)
            head_in(m, s->h + (size_t)(off + t) * H, s->anchors + (size_t)(off + t) * A * H, na,
                    s->xin + (size_t)rows * H, s->xn + (size_t)rows * H);
    }
    return model_batch_head(e, m->L, &m->head, s->xn, rows, seg, nseg, err);
}

static df_status km_forward(df_engine *e, void *state, int pos, const int32_t *tokens, int n,
                            float *out, int all_rows, char *err) {
    km_state *s = state;
    if (n > DF_CHUNK || pos + n > s->max_ctx) return DF_ERR_ARG;
    df_fwd_seg seg = {state, pos, tokens, n, out, all_rows};
    return km_forward_batch(e, &seg, 1, err);
}

/* ---- a long prompt, layer by layer ---- */

/* One block of a prompt (prompt.h): every layer over all of its rows before
 * the next layer starts (attention's projections over the block's rows,
 * kda_forward_block / mla_forward_block), the feed-forward block over every
 * row at once, so each routed expert the block uses is read and decoded once
 * per layer, in GEMM tiles of several rows. Every row's values are those of
 * the chunked passes (per-row operations; products whose rows do not depend
 * on their neighbours). */
static df_status km_prompt_block(df_engine *e, void *ctx, prompt_buf *b, int pos, const int32_t *tokens, int n,
                                 float *out, int all_rows, char *err) {
    km_model *m = e->prog;
    km_state *s = ctx; /* the session; the block's attention scratch is b's */
    const int H = m->H;
    const int64_t kstride = kda_state_floats(&m->kda);
    const int64_t cstride = (int64_t)s->max_ctx * mla_cache_floats_per_pos(&m->mla);
    float *h = b->h, *xin = b->xin, *xn = b->xn, *yv = b->y, *anc = b->anchors;
    double pt = prof_now(e);
    model_embed_tokens(e, &m->embed, tokens, n, h);
    km_early_lookahead(e, m, &b->moe, h, xn, n);
    prof_add(e, DF_PROF_EMBED, &pt);
    int na = 0;
    for (int l = 0; l < m->L; l++) {
        km_layer *y = &m->layers[l];
        df_status st = model_enter(e, l, err);
        if (st != DF_OK) return st;
        pt = prof_now(e);
        int restart = layer_in(e, m, y, l, n, h, anc, &na, xin, xn);
        prof_add(e, DF_PROF_NORMS, &pt);
        /* attention over the block's rows at once where the block's scratch holds them */
        st = y->kda ? kda_forward_block(e, &m->kda, &y->k, s->kda_state + y->slot * kstride, &b->kda, &s->kda, n,
                                        xn, yv, err)
                    : mla_forward_block(e, &m->mla, &y->a, s->mla_cache + y->slot * cstride, &b->mla, &s->mla, pos,
                                        n, xn, yv, err);
        if (st != DF_OK) return st;
        prof_add(e, y->kda ? DF_PROF_KDA : DF_PROF_MLA, &pt);
        layer_mid(e, m, y, n, h, yv, anc, na, restart, xin, xn);
        prof_add(e, DF_PROF_NORMS, &pt);
        const moe_layer *next = l + 1 < m->L && m->layers[l + 1].moe ? &m->layers[l + 1].experts : NULL;
        st = ffn_block(e, y->moe ? &y->experts : NULL, &y->mlp, next, &m->act, &b->moe, xn, n, pos, yv, &pt, err);
        if (st != DF_OK) return st;
        for (size_t i = 0; i < (size_t)n * H; i++) h[i] += yv[i];
        prof_add(e, DF_PROF_NORMS, &pt);
    }
    if (!out) return DF_OK;
    const int t0 = all_rows ? 0 : n - 1;
    for (int t = t0; t < n; t++)
        head_in(m, h + (size_t)t * H, anc + (size_t)t * m->max_anchors * H, na, xin + (size_t)(t - t0) * H,
                xn + (size_t)(t - t0) * H);
    df_fwd_seg seg = {s, pos + t0, tokens + t0, n - t0, out, all_rows};
    return model_batch_head(e, m->L, &m->head, xn, n - t0, &seg, 1, err);
}

/* A block of a layer-major prompt on the device: km_pass_dev over the
 * block's rows in a device block of as many (km_forward_prompt's), so
 * every product sees all of them at once. */
typedef struct {
    km_state *s;
    km_dev d;
} km_prompt_dev;

static df_status km_prompt_block_dev(df_engine *e, void *ctx, prompt_buf *b, int pos, const int32_t *tokens, int n,
                                     float *out, int all_rows, char *err) {
    km_prompt_dev *c = ctx;
    const km_pass p = {c->s, &c->d, b->h, b->xin, b->xn, b->y, b->anchors, &b->moe};
    const df_fwd_seg seg = {c->s, pos, tokens, n, out, all_rows};
    return km_pass_dev(e, &p, &seg, 1, n, err);
}

/* With an accelerator the prompt runs layer by layer only on the device
 * (the session's states live there): a session with a device pass. */
static int km_prompt_takes(df_engine *e, void *state) {
    const km_state *s = state;
    return !e->acc || s->dv != NULL;
}

static df_status km_forward_prompt(df_engine *e, void *state, int pos, const int32_t *tokens, int n, float *out,
                                   int all_rows, char *err) {
    km_model *m = e->prog;
    km_state *s = state;
    const df_config *c = &e->cfg;
    if (n < 1 || pos + n > s->max_ctx || !km_prompt_takes(e, state)) return DF_ERR_ARG;
    const int dl = c->routed_expert_hidden_size > 0 ? c->routed_expert_hidden_size : m->H;
    if (!e->acc) {
        const prompt_attn attn = {m->n_kda ? &m->kda : NULL, m->n_mla ? &m->mla : NULL};
        return prompt_run(e, m->H, m->max_anchors, m->inter, dl, attn, pos, tokens, n, out, all_rows,
                          km_prompt_block, s, err);
    }
    const int rows = n < e->opts.prompt_block ? n : e->opts.prompt_block, K = c->num_experts_per_tok;
    km_prompt_dev pd = {s, {0}};
    float *blk = acc_dev_alloc(e->acc, km_dev_floats(m, rows, dl, K));
    if (!blk) { /* no room for the block: passes of the session's DF_CHUNK rows */
        const int V = c->vocab_size;
        for (int i = 0; i < n; i += DF_CHUNK) {
            const int cn = n - i < DF_CHUNK ? n - i : DF_CHUNK;
            float *o = all_rows ? out + (size_t)i * V : i + cn == n ? out : NULL;
            df_status st = km_forward(e, state, pos + i, tokens + i, cn, o, all_rows, err);
            if (st != DF_OK) return st;
        }
        return DF_OK;
    }
    km_dev_place(&pd.d, m, blk, rows, dl, K);
    const prompt_attn none = {NULL, NULL}; /* attention runs on the device */
    df_status st = prompt_run(e, m->H, m->max_anchors, m->inter, dl, none, pos, tokens, n, out, all_rows,
                              km_prompt_block_dev, &pd, err);
    acc_dev_free(e->acc, blk);
    return st;
}

/* ---- describe ---- */

static void km_describe(df_engine *e, char *b, size_t cap) {
    km_model *m = e->prog;
    const df_config *c = &e->cfg;
    int64_t total = st_total_bytes(e->st);
    int64_t per_tok = (int64_t)c->num_experts_per_tok * m->n_moe * m->expert_bytes;
    char am[128] = "per head";
    for (int l = 0; l < m->L; l++)
        if (m->layers[l].kda) { kda_a_mode_text(&m->layers[l].k, m->kda.H, am, sizeof am); break; }
    int64_t kda_bytes = (int64_t)m->n_kda * kda_state_floats(&m->kda) * (int64_t)sizeof(float);
    snprintf(b, cap,
             "layers         %d KDA + %d MLA (NoPE%s); attention residuals %s\n"
             "kda            %d heads x %d, conv %d, gate %s%s, A_log %s\n"
             "mla            q_lora %d, kv_lora %d, heads %d x (nope %d + rope %d), v %d\n"
             "moe            %d MoE layers, %d routed experts, top-%d, %d shared, %s, latent %d%s\n"
             "experts        %d in all, %.3f MB each, %.3f GB together\n"
             "resident       %.3f GB (everything but routed experts)\n"
             "expert bytes   %.3f MB per token (%d x %d layers)\n"
             "context state  %lld bytes per token (compact MLA latent cache) + %.3f MB fixed (KDA states)\n",
             m->n_kda, m->n_mla, c->mla_use_output_gate ? ", output gate" : "",
             m->block > 0 ? "on" : "off", m->kda.H, m->kda.D, m->kda.W,
             m->kda.full_rank_gate ? "full rank" : "low rank",
             m->kda.has_lower_bound ? ", lower bound" : "", am, m->mla.qlr, m->mla.R,
             m->mla.nh, m->mla.dn, m->mla.dr, m->mla.dv, m->n_moe, c->n_routed_experts,
             c->num_experts_per_tok, c->n_shared_experts, m->act.situ ? "SiTU" : "SiLU",
             c->routed_expert_hidden_size, c->latent_moe_use_norm ? " (normed)" : "",
             c->n_routed_experts * m->n_moe, m->expert_bytes / 1e6, m->expert_bytes_total / 1e9,
             (total - m->expert_bytes_total) / 1e9, per_tok / 1e6, c->num_experts_per_tok, m->n_moe,
             (long long)km_state_bytes_per_pos(e), kda_bytes / 1e6);
}

const df_program_ops kimi_program = {
    .name = "kimi",
    .open = km_open,
    .close = km_close,
    .state_bytes_per_pos = km_state_bytes_per_pos,
    .state_fixed_bytes = km_state_fixed_bytes,
    .state_new = km_state_new,
    .state_free = km_state_free,
    .state_reset = km_state_reset,
    .forward = km_forward,
    .forward_batch = km_forward_batch,
    .forward_prompt = km_forward_prompt,
    .prompt_takes = km_prompt_takes,
    .describe = km_describe,
    .rewind_setup = km_rewind_setup,
    .rewind_to = km_rewind_to,
};
