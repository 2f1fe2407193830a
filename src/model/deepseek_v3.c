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
 * Sections: weights (binding, RoPE tables); state; attention; MLP and MoE;
 * forward; describe; the program table.
 */
#include "model.h"
#include "../base/err.h"
#include "../kernels/ops.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- weights ---- */

typedef struct {
    float *attn_norm, *ffn_norm, *q_a_norm, *kv_a_norm; /* f32 copies */
    df_weight q_a, q_b, q, kv_a, kv_b, o;
    int moe;
    df_weight gate, up, down;   /* dense MLP, or the shared experts of a MoE layer */
    int has_mlp;                /* dense MLP or shared experts present */
    df_weight router;           /* [E, hidden] */
    float *router_bias;         /* [E] e_score_correction_bias, zeros when absent */
    df_weight *eg, *eu, *ed;    /* routed experts [E] */
} ds_layer;

typedef struct {
    int H, nh, dn, dr, dv, dq, R, qlr, V, E, K, I, Ie, Ish, L;
    float eps;
    df_weight embed, head;
    float *final_norm;
    ds_layer *layers;
    float *inv_freq;            /* [dr/2] */
    float rope_mscale;          /* YaRN attention factor applied to cos/sin */
    float softmax_scale;
    int64_t expert_bytes;       /* one routed expert (gate+up+down) */
    int64_t expert_bytes_total;
    int n_moe_layers;
} ds_model;

static float *load_vec(df_engine *e, const char *name, int64_t n, df_status *st, char *err) {
    float *v = malloc((size_t)n * sizeof(float));
    if (!v) { *st = df_fail(err, DF_ERR_NOMEM, "out of memory"); return NULL; }
    *st = wt_load_vec(e->st, name, n, v, err);
    if (*st != DF_OK) { free(v); return NULL; }
    return v;
}

/* Finds the decoder prefix actually used by the tensors. */
static df_status find_prefix(df_engine *e, char *err) {
    df_config *c = &e->cfg;
    static const char *cands[] = {"model.", "language_model.model."};
    char name[256];
    snprintf(name, sizeof name, "%sembed_tokens.weight", c->prefix);
    if (st_find(e->st, name)) return DF_OK;
    for (size_t i = 0; i < sizeof cands / sizeof cands[0]; i++) {
        snprintf(name, sizeof name, "%sembed_tokens.weight", cands[i]);
        if (st_find(e->st, name)) {
            snprintf(c->prefix, sizeof c->prefix, "%s", cands[i]);
            snprintf(c->lm_head, sizeof c->lm_head, "%slm_head.weight",
                     strcmp(cands[i], "model.") == 0 ? "" : "language_model.");
            return DF_OK;
        }
    }
    return df_fail(err, DF_ERR_MISMATCH,
                   "%s: tensor '%sembed_tokens.weight' not found (looked for prefixes 'model.' "
                   "and 'language_model.model.')",
                   e->dir, c->prefix);
}

static df_status bind(df_engine *e, const char *base, int64_t rows, int64_t cols, df_weight *w,
                      char *err) {
    return wt_bind(e->st, base, rows, cols, e->cfg.fp8_block_rows, e->cfg.fp8_block_cols, w, err);
}

static double yarn_mscale(double scale, double m) {
    return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

static double yarn_corr_dim(double rot, int dim, double base, double maxpos) {
    return (dim * log(maxpos / (rot * 2.0 * M_PI))) / (2.0 * log(base));
}

/* RoPE frequencies and scales, as transformers computes them (default, YaRN). */
static void rope_setup(const df_config *c, ds_model *m) {
    int d = m->dr, h = d / 2;
    double base = c->rope_theta;
    m->rope_mscale = 1.0f;
    m->softmax_scale = (float)(1.0 / sqrt((double)m->dq));
    for (int i = 0; i < h; i++) {
        float pos_freq = (float)pow(base, (double)(2 * i) / d);
        m->inv_freq[i] = 1.0f / pos_freq;
    }
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
        m->inv_freq[i] = inter * (1.0f - ext_factor) + extra * ext_factor;
    }
    if (c->yarn_mscale != 0 && c->yarn_mscale_all_dim != 0)
        m->rope_mscale = (float)(yarn_mscale(f, c->yarn_mscale) / yarn_mscale(f, c->yarn_mscale_all_dim));
    else
        m->rope_mscale = (float)yarn_mscale(f, 1.0);
    if (c->yarn_mscale_all_dim != 0) {
        double ms = yarn_mscale(f, c->yarn_mscale_all_dim);
        m->softmax_scale = (float)(m->softmax_scale * ms * ms);
    }
}

static void ds_close(void *p) {
    ds_model *m = p;
    if (!m) return;
    if (m->layers) {
        for (int l = 0; l < m->L; l++) {
            ds_layer *y = &m->layers[l];
            free(y->attn_norm); free(y->ffn_norm); free(y->q_a_norm); free(y->kv_a_norm);
            free(y->router_bias); free(y->eg); free(y->eu); free(y->ed);
        }
    }
    free(m->layers);
    free(m->final_norm);
    free(m->inv_freq);
    free(m);
}

static df_status bind_layer(df_engine *e, ds_model *m, int l, char *err) {
    const df_config *c = &e->cfg;
    ds_layer *y = &m->layers[l];
    char b[320];
    df_status st = DF_OK;
#define NAME(...) (snprintf(b, sizeof b, __VA_ARGS__), b)
#define TRY(x) do { if ((st = (x)) != DF_OK) return st; } while (0)
    const char *P = c->prefix;
    if (!(y->attn_norm = load_vec(e, NAME("%slayers.%d.input_layernorm.weight", P, l), m->H, &st, err))) return st;
    if (!(y->ffn_norm = load_vec(e, NAME("%slayers.%d.post_attention_layernorm.weight", P, l), m->H, &st, err))) return st;
    if (m->qlr > 0) {
        TRY(bind(e, NAME("%slayers.%d.self_attn.q_a_proj", P, l), m->qlr, m->H, &y->q_a, err));
        if (!(y->q_a_norm = load_vec(e, NAME("%slayers.%d.self_attn.q_a_layernorm.weight", P, l), m->qlr, &st, err))) return st;
        TRY(bind(e, NAME("%slayers.%d.self_attn.q_b_proj", P, l), (int64_t)m->nh * m->dq, m->qlr, &y->q_b, err));
    } else {
        TRY(bind(e, NAME("%slayers.%d.self_attn.q_proj", P, l), (int64_t)m->nh * m->dq, m->H, &y->q, err));
    }
    TRY(bind(e, NAME("%slayers.%d.self_attn.kv_a_proj_with_mqa", P, l), m->R + m->dr, m->H, &y->kv_a, err));
    if (!(y->kv_a_norm = load_vec(e, NAME("%slayers.%d.self_attn.kv_a_layernorm.weight", P, l), m->R, &st, err))) return st;
    TRY(bind(e, NAME("%slayers.%d.self_attn.kv_b_proj", P, l), (int64_t)m->nh * (m->dn + m->dv), m->R, &y->kv_b, err));
    TRY(bind(e, NAME("%slayers.%d.self_attn.o_proj", P, l), m->H, (int64_t)m->nh * m->dv, &y->o, err));

    y->moe = cfg_is_moe_layer(c, l);
    if (!y->moe) {
        y->has_mlp = 1;
        TRY(bind(e, NAME("%slayers.%d.mlp.gate_proj", P, l), m->I, m->H, &y->gate, err));
        TRY(bind(e, NAME("%slayers.%d.mlp.up_proj", P, l), m->I, m->H, &y->up, err));
        TRY(bind(e, NAME("%slayers.%d.mlp.down_proj", P, l), m->H, m->I, &y->down, err));
        return DF_OK;
    }
    m->n_moe_layers++;
    TRY(bind(e, NAME("%slayers.%d.mlp.gate", P, l), m->E, m->H, &y->router, err));
    y->router_bias = calloc((size_t)m->E, sizeof(float));
    if (!y->router_bias) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    NAME("%slayers.%d.mlp.gate.e_score_correction_bias", P, l);
    if (st_find(e->st, b)) TRY(wt_load_vec(e->st, b, m->E, y->router_bias, err));
    if (m->Ish > 0) {
        y->has_mlp = 1;
        TRY(bind(e, NAME("%slayers.%d.mlp.shared_experts.gate_proj", P, l), m->Ish, m->H, &y->gate, err));
        TRY(bind(e, NAME("%slayers.%d.mlp.shared_experts.up_proj", P, l), m->Ish, m->H, &y->up, err));
        TRY(bind(e, NAME("%slayers.%d.mlp.shared_experts.down_proj", P, l), m->H, m->Ish, &y->down, err));
    }
    y->eg = calloc((size_t)m->E, sizeof(df_weight));
    y->eu = calloc((size_t)m->E, sizeof(df_weight));
    y->ed = calloc((size_t)m->E, sizeof(df_weight));
    if (!y->eg || !y->eu || !y->ed) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int x = 0; x < m->E; x++) {
        TRY(bind(e, NAME("%slayers.%d.mlp.experts.%d.gate_proj", P, l, x), m->Ie, m->H, &y->eg[x], err));
        TRY(bind(e, NAME("%slayers.%d.mlp.experts.%d.up_proj", P, l, x), m->Ie, m->H, &y->eu[x], err));
        TRY(bind(e, NAME("%slayers.%d.mlp.experts.%d.down_proj", P, l, x), m->H, m->Ie, &y->ed[x], err));
        int64_t bytes = wt_bytes(&y->eg[x]) + wt_bytes(&y->eu[x]) + wt_bytes(&y->ed[x]);
        m->expert_bytes = bytes;
        m->expert_bytes_total += bytes;
    }
#undef TRY
#undef NAME
    return DF_OK;
}

static df_status ds_open(df_engine *e, void **out, char *err) {
    const df_config *c = &e->cfg;
    df_status st = find_prefix(e, err);
    if (st != DF_OK) return st;
    ds_model *m = calloc(1, sizeof *m);
    if (!m) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    m->H = c->hidden_size;
    m->nh = c->num_attention_heads;
    m->dn = c->qk_nope_head_dim;
    m->dr = c->qk_rope_head_dim;
    m->dv = c->v_head_dim;
    m->dq = m->dn + m->dr;
    m->R = c->kv_lora_rank;
    m->qlr = c->q_lora_rank;
    m->V = c->vocab_size;
    m->E = c->n_routed_experts;
    m->K = c->num_experts_per_tok;
    m->I = c->intermediate_size;
    m->Ie = c->moe_intermediate_size;
    m->Ish = c->moe_intermediate_size * c->n_shared_experts;
    m->L = c->num_hidden_layers;
    m->eps = (float)c->rms_norm_eps;
    if (m->dr % 2) {
        ds_close(m);
        return df_fail(err, DF_ERR_CONFIG, "%s/config.json: field 'qk_rope_head_dim' must be even (got %d)", e->dir, m->dr);
    }
    char name[320];
    snprintf(name, sizeof name, "%sembed_tokens", c->prefix);
    if ((st = bind(e, name, m->V, m->H, &m->embed, err)) != DF_OK) goto fail;
    if (c->tie_word_embeddings) m->head = m->embed;
    else {
        snprintf(name, sizeof name, "%s", c->lm_head);
        size_t n = strlen(name);
        if (n > 7 && strcmp(name + n - 7, ".weight") == 0) name[n - 7] = 0;
        if ((st = bind(e, name, m->V, m->H, &m->head, err)) != DF_OK) goto fail;
    }
    snprintf(name, sizeof name, "%snorm.weight", c->prefix);
    if (!(m->final_norm = load_vec(e, name, m->H, &st, err))) goto fail;
    m->inv_freq = calloc((size_t)(m->dr / 2 + 1), sizeof(float));
    m->layers = calloc((size_t)m->L, sizeof(ds_layer));
    if (!m->inv_freq || !m->layers) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto fail; }
    rope_setup(c, m);
    for (int l = 0; l < m->L; l++)
        if ((st = bind_layer(e, m, l, err)) != DF_OK) goto fail;
    *out = m;
    return DF_OK;
fail:
    ds_close(m);
    return st;
}

/* ---- state ---- */

typedef struct {
    int max_ctx, nthreads;
    float *ckv;      /* [L][max_ctx][R]  normalised latent */
    float *kpe;      /* [L][max_ctx][dr] rotated shared key */
    /* per-chunk scratch (DF_CHUNK rows) */
    float *x, *xn, *y;           /* [C][H] */
    float *qa;                   /* [C][qlr] */
    float *q;                    /* [C][nh*dq] */
    float *kva;                  /* [C][R+dr] */
    float *qlat, *olat;          /* [nh][C][R] */
    float *attn;                 /* [C][nh*dv] */
    float *g, *u;                /* [C][max intermediate] */
    float *rlog;                 /* [C][E] router logits */
    int *sel;                    /* [C][K] selected experts, ascending */
    float *selw;                 /* [C][K] their weights */
    float *ys;                   /* [C][K][H] expert outputs per slot */
    int *etok;                   /* [C*K] token of each (expert, use) */
    int *eslot;                  /* [C*K] slot of each (expert, use) */
    float *xe, *ye;              /* [C][H] gathered expert inputs / outputs */
    float *tscratch;             /* [nthreads][max(max_ctx, R, H)] */
    int64_t tstride;
} ds_state;

static int64_t ds_state_bytes_per_pos(const df_engine *e) {
    const df_config *c = &e->cfg;
    return (int64_t)c->num_hidden_layers * (c->kv_lora_rank + c->qk_rope_head_dim) * (int64_t)sizeof(float);
}

static void ds_state_free(void *p) {
    ds_state *s = p;
    if (!s) return;
    void *bufs[] = {s->ckv, s->kpe, s->x, s->xn, s->y, s->qa, s->q, s->kva, s->qlat, s->olat,
                    s->attn, s->g, s->u, s->rlog, s->sel, s->selw, s->ys, s->etok, s->eslot,
                    s->xe, s->ye, s->tscratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(s);
}

static df_status ds_state_new(df_engine *e, int max_ctx, void **out) {
    ds_model *m = e->prog;
    ds_state *s = calloc(1, sizeof *s);
    if (!s) return DF_ERR_NOMEM;
    const size_t C = DF_CHUNK, F = sizeof(float);
    int K = m->K > 0 ? m->K : 1, E = m->E > 0 ? m->E : 1;
    int inter = m->I > m->Ie ? m->I : m->Ie;
    if (m->Ish > inter) inter = m->Ish;
    s->max_ctx = max_ctx;
    s->nthreads = pool_size(e->pool);
    s->tstride = max_ctx > m->R ? max_ctx : m->R;
    if (m->H > s->tstride) s->tstride = m->H;
    s->ckv = malloc((size_t)m->L * max_ctx * m->R * F);
    s->kpe = malloc((size_t)m->L * max_ctx * (m->dr ? m->dr : 1) * F);
    s->x = malloc(C * m->H * F);
    s->xn = malloc(C * m->H * F);
    s->y = malloc(C * m->H * F);
    s->qa = malloc(C * (m->qlr ? m->qlr : 1) * F);
    s->q = malloc(C * m->nh * m->dq * F);
    s->kva = malloc(C * (m->R + m->dr) * F);
    s->qlat = malloc(C * m->nh * m->R * F);
    s->olat = malloc(C * m->nh * m->R * F);
    s->attn = malloc(C * m->nh * m->dv * F);
    s->g = malloc(C * inter * F);
    s->u = malloc(C * inter * F);
    s->rlog = malloc(C * E * F);
    s->sel = malloc(C * K * sizeof(int));
    s->selw = malloc(C * K * F);
    s->ys = malloc(C * K * m->H * F);
    s->etok = malloc(C * K * sizeof(int));
    s->eslot = malloc(C * K * sizeof(int));
    s->xe = malloc(C * m->H * F);
    s->ye = malloc(C * m->H * F);
    s->tscratch = malloc((size_t)s->nthreads * s->tstride * F);
    if (!s->ckv || !s->kpe || !s->x || !s->xn || !s->y || !s->qa || !s->q || !s->kva || !s->qlat ||
        !s->olat || !s->attn || !s->g || !s->u || !s->rlog || !s->sel || !s->selw || !s->ys ||
        !s->etok || !s->eslot || !s->xe || !s->ye || !s->tscratch) {
        ds_state_free(s);
        return DF_ERR_NOMEM;
    }
    *out = s;
    return DF_OK;
}

/* ---- attention ---- */

typedef struct {
    df_engine *e;
    ds_model *m;
    ds_state *s;
    ds_layer *y;
    int layer, pos, n;
} attn_job;

/* q_lat[h][t] = W_UK[h]^T q_nope[t][h], one head per index. */
static void absorb_heads(void *ctx, int64_t h0, int64_t h1, int tid) {
    attn_job *j = ctx;
    ds_model *m = j->m;
    ds_state *s = j->s;
    float *row = s->tscratch + (size_t)tid * s->tstride;
    for (int64_t h = h0; h < h1; h++) {
        float *ql = s->qlat + (size_t)h * j->n * m->R;
        memset(ql, 0, (size_t)j->n * m->R * sizeof(float));
        for (int d = 0; d < m->dn; d++) {
            kn_dequant_row(&j->y->kv_b, h * (m->dn + m->dv) + d, row);
            for (int t = 0; t < j->n; t++) {
                float qv = s->q[((size_t)t * m->nh + h) * m->dq + d];
                op_axpy(ql + (size_t)t * m->R, qv, row, m->R);
            }
        }
    }
}

/* Softmax attention over the cached latents, one (head, token) per index. */
static void attend(void *ctx, int64_t i0, int64_t i1, int tid) {
    attn_job *j = ctx;
    ds_model *m = j->m;
    ds_state *s = j->s;
    float *sc = s->tscratch + (size_t)tid * s->tstride;
    const float *ckv = s->ckv + (size_t)j->layer * s->max_ctx * m->R;
    const float *kpe = s->kpe + (size_t)j->layer * s->max_ctx * m->dr;
    for (int64_t i = i0; i < i1; i++) {
        int h = (int)(i / j->n), t = (int)(i % j->n), p = j->pos + t;
        const float *ql = s->qlat + ((size_t)h * j->n + t) * m->R;
        const float *qp = s->q + ((size_t)t * m->nh + h) * m->dq + m->dn;
        for (int k = 0; k <= p; k++)
            sc[k] = (op_dot(ql, ckv + (size_t)k * m->R, m->R) + op_dot(qp, kpe + (size_t)k * m->dr, m->dr)) *
                    m->softmax_scale;
        op_softmax(sc, p + 1);
        float *o = s->olat + ((size_t)h * j->n + t) * m->R;
        memset(o, 0, (size_t)m->R * sizeof(float));
        for (int k = 0; k <= p; k++) op_axpy(o, sc[k], ckv + (size_t)k * m->R, m->R);
    }
}

/* attn[t][h*dv..] = W_UV[h] o_lat[h][t], one head per index. */
static void lift_heads(void *ctx, int64_t h0, int64_t h1, int tid) {
    attn_job *j = ctx;
    ds_model *m = j->m;
    ds_state *s = j->s;
    for (int64_t h = h0; h < h1; h++) {
        int64_t r0 = h * (m->dn + m->dv) + m->dn;
        kn_matmul(j->e->level, &j->y->kv_b, s->olat + (size_t)h * j->n * m->R, j->n,
                  s->attn + h * m->dv, (int64_t)m->nh * m->dv, r0, r0 + m->dv);
    }
}

static void rope_at(const ds_model *m, int pos, float *cs, float *sn) {
    for (int i = 0; i < m->dr / 2; i++) {
        float f = (float)pos * m->inv_freq[i];
        cs[i] = cosf(f) * m->rope_mscale;
        sn[i] = sinf(f) * m->rope_mscale;
    }
}

static void attention(df_engine *e, ds_model *m, ds_state *s, int l, int pos, int n) {
    ds_layer *y = &m->layers[l];
    const df_config *c = &e->cfg;
    int qdim = m->nh * m->dq;
    if (m->qlr > 0) {
        mm(e, &y->q_a, s->xn, n, s->qa, m->qlr);
        for (int t = 0; t < n; t++) op_rmsnorm(s->qa + (size_t)t * m->qlr, s->qa + (size_t)t * m->qlr, y->q_a_norm, m->qlr, 1e-6f);
        mm(e, &y->q_b, s->qa, n, s->q, qdim);
    } else {
        mm(e, &y->q, s->xn, n, s->q, qdim);
    }
    mm(e, &y->kv_a, s->xn, n, s->kva, m->R + m->dr);
    float cs[512], sn[512];
    for (int t = 0; t < n; t++) {
        int p = pos + t;
        const float *kv = s->kva + (size_t)t * (m->R + m->dr);
        float *ckv = s->ckv + ((size_t)l * s->max_ctx + p) * m->R;
        float *kpe = s->kpe + ((size_t)l * s->max_ctx + p) * m->dr;
        op_rmsnorm(ckv, kv, y->kv_a_norm, m->R, 1e-6f);
        memcpy(kpe, kv + m->R, (size_t)m->dr * sizeof(float));
        rope_at(m, p, cs, sn);
        op_rope(kpe, m->dr, cs, sn, c->rope_interleave);
        for (int h = 0; h < m->nh; h++)
            op_rope(s->q + ((size_t)t * m->nh + h) * m->dq + m->dn, m->dr, cs, sn, c->rope_interleave);
    }
    attn_job j = {e, m, s, y, l, pos, n};
    pool_for(e->pool, m->nh, 1, absorb_heads, &j);
    pool_for(e->pool, (int64_t)m->nh * n, 1, attend, &j);
    pool_for(e->pool, m->nh, 1, lift_heads, &j);
    mm(e, &y->o, s->attn, n, s->y, m->H);
    for (size_t i = 0; i < (size_t)n * m->H; i++) s->x[i] += s->y[i];
}

/* ---- MLP and MoE ---- */

/* out[t] = down(silu(gate x) * up x) for n rows of s->xn-like input. */
static void swiglu(df_engine *e, ds_state *s, const df_weight *gw, const df_weight *uw,
                   const df_weight *dw, const float *X, int n, float *out) {
    int64_t I = gw->rows, H = dw->rows;
    mm(e, gw, X, n, s->g, I);
    mm(e, uw, X, n, s->u, I);
    for (int t = 0; t < n; t++) op_silu_mul(s->g + (size_t)t * I, s->u + (size_t)t * I, (int)I);
    mm(e, dw, s->g, n, out, H);
}

/* Sigmoid scores, bias for selection, group limit, top-k; the chosen experts
 * come back in ascending id order with renormalised, scaled weights. */
static void route(const df_config *c, const ds_model *m, const ds_layer *y, const float *logit,
                  int *sel, float *selw) {
    int E = m->E, K = m->K, G = c->n_group > 0 ? c->n_group : 1, per = E / G;
    float score[E], choice[E];
    for (int x = 0; x < E; x++) {
        score[x] = c->scoring_sigmoid ? op_sigmoid(logit[x]) : logit[x];
        choice[x] = score[x] + y->router_bias[x];
    }
    if (!c->scoring_sigmoid) { /* softmax scoring (DeepSeek-V2 style) */
        memcpy(score, logit, sizeof score);
        op_softmax(score, E);
        for (int x = 0; x < E; x++) choice[x] = score[x] + y->router_bias[x];
    }
    if (G > 1 && c->topk_group < G) {
        float gs[G];
        int keep[G];
        for (int g = 0; g < G; g++) {
            float a = -INFINITY, b = -INFINITY; /* top two of the group */
            for (int x = g * per; x < (g + 1) * per; x++) {
                if (choice[x] > a) { b = a; a = choice[x]; }
                else if (choice[x] > b) b = choice[x];
            }
            gs[g] = per > 1 ? a + b : a;
            keep[g] = 0;
        }
        for (int k = 0; k < c->topk_group; k++) {
            int best = -1;
            for (int g = 0; g < G; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        for (int x = 0; x < E; x++)
            if (!keep[x / per]) choice[x] = 0.0f; /* transformers masks with 0.0 */
    }
    int taken[E];
    memset(taken, 0, sizeof taken);
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int x = 0; x < E; x++)
            if (!taken[x] && (best < 0 || choice[x] > choice[best])) best = x;
        taken[best] = 1;
    }
    int k = 0;
    float sum = 0.0f;
    for (int x = 0; x < E; x++)
        if (taken[x]) { sel[k] = x; selw[k] = score[x]; sum += score[x]; k++; }
    for (k = 0; k < K; k++) {
        if (c->norm_topk_prob) selw[k] /= (sum + 1e-20f);
        selw[k] *= (float)c->routed_scaling_factor;
    }
}

static void moe(df_engine *e, ds_model *m, ds_state *s, ds_layer *y, int n) {
    const df_config *c = &e->cfg;
    int H = m->H, K = m->K;
    mm(e, &y->router, s->xn, n, s->rlog, m->E);
    for (int t = 0; t < n; t++)
        route(c, m, y, s->rlog + (size_t)t * m->E, s->sel + t * K, s->selw + t * K);
    /* each expert used in this chunk runs once over all its tokens */
    for (int x = 0; x < m->E; x++) {
        int cnt = 0;
        for (int t = 0; t < n; t++)
            for (int k = 0; k < K; k++)
                if (s->sel[t * K + k] == x) { s->etok[cnt] = t; s->eslot[cnt] = k; cnt++; }
        if (!cnt) continue;
        for (int i = 0; i < cnt; i++)
            memcpy(s->xe + (size_t)i * H, s->xn + (size_t)s->etok[i] * H, (size_t)H * sizeof(float));
        swiglu(e, s, &y->eg[x], &y->eu[x], &y->ed[x], s->xe, cnt, s->ye);
        for (int i = 0; i < cnt; i++)
            memcpy(s->ys + ((size_t)s->etok[i] * K + s->eslot[i]) * H, s->ye + (size_t)i * H,
                   (size_t)H * sizeof(float));
    }
    for (int t = 0; t < n; t++) {
        float *out = s->y + (size_t)t * H;
        memset(out, 0, (size_t)H * sizeof(float));
        for (int k = 0; k < K; k++) op_axpy(out, s->selw[t * K + k], s->ys + ((size_t)t * K + k) * H, H);
    }
    if (y->has_mlp) {
        swiglu(e, s, &y->gate, &y->up, &y->down, s->xn, n, s->ye);
        for (size_t i = 0; i < (size_t)n * H; i++) s->y[i] += s->ye[i];
    }
    for (size_t i = 0; i < (size_t)n * H; i++) s->x[i] += s->y[i];
}

/* ---- forward ---- */

static df_status ds_forward(df_engine *e, void *state, int pos, const int32_t *tokens, int n,
                            float *out, int all_rows) {
    ds_model *m = e->prog;
    ds_state *s = state;
    int H = m->H;
    if (n > DF_CHUNK || pos + n > s->max_ctx) return DF_ERR_ARG;
    for (int t = 0; t < n; t++) kn_dequant_row(&m->embed, tokens[t], s->x + (size_t)t * H);
    for (int l = 0; l < m->L; l++) {
        ds_layer *y = &m->layers[l];
        for (int t = 0; t < n; t++) op_rmsnorm(s->xn + (size_t)t * H, s->x + (size_t)t * H, y->attn_norm, H, m->eps);
        attention(e, m, s, l, pos, n);
        for (int t = 0; t < n; t++) op_rmsnorm(s->xn + (size_t)t * H, s->x + (size_t)t * H, y->ffn_norm, H, m->eps);
        if (y->moe) moe(e, m, s, y, n);
        else {
            swiglu(e, s, &y->gate, &y->up, &y->down, s->xn, n, s->y);
            for (size_t i = 0; i < (size_t)n * H; i++) s->x[i] += s->y[i];
        }
    }
    if (!out) return DF_OK;
    int first = all_rows ? 0 : n - 1, rows = n - first;
    for (int t = first; t < n; t++)
        op_rmsnorm(s->xn + (size_t)(t - first) * H, s->x + (size_t)t * H, m->final_norm, H, m->eps);
    mm(e, &m->head, s->xn, rows, out, m->V);
    return DF_OK;
}

/* ---- describe ---- */

static void ds_describe(df_engine *e, char *b, size_t cap) {
    ds_model *m = e->prog;
    const df_config *c = &e->cfg;
    int64_t total = st_total_bytes(e->st);
    int64_t per_tok = (int64_t)m->K * m->n_moe_layers * m->expert_bytes;
    snprintf(b, cap,
             "attention      MLA: q_lora %d, kv_lora %d, heads %d x (nope %d + rope %d), v %d; rope %s%s\n"
             "moe            %d MoE layers (first %d dense), %d routed experts, top-%d, %d shared; "
             "groups %d/%d, scale %.3g\n"
             "experts        %d in all, %.3f MB each, %.3f GB together\n"
             "resident       %.3f GB (everything but routed experts)\n"
             "expert bytes   %.3f MB per token (%d x %d layers)\n"
             "context state  %lld bytes per token (compact MLA latent cache)\n"
             "weights        embed %s, head %s, quantisation %s\n",
             m->qlr, m->R, m->nh, m->dn, m->dr, m->dv,
             c->rope_type == ROPE_YARN ? "yarn" : "default", c->rope_interleave ? " (interleaved)" : "",
             m->n_moe_layers, c->first_k_dense_replace, m->E, m->K, c->n_shared_experts, c->n_group,
             c->topk_group, c->routed_scaling_factor, m->E * m->n_moe_layers, m->expert_bytes / 1e6,
             m->expert_bytes_total / 1e9, (total - m->expert_bytes_total) / 1e9, per_tok / 1e6, m->K,
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
    .describe = ds_describe,
};
