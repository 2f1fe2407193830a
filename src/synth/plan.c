/* plan.c — synthetic checkpoint plans: sizes, config.json, tensor inventory
 * and shard layout (sy_plan_new; see synth.h).
 *
 * Owns: the presets of each family (tiny toy sizes, K3's real widths in
 * k3-slice, the public configs in full), applying the overrides, sizing the
 * expert count for --gb (shrinking vocab and the dense layer when even the
 * non-expert part does not fit), the tensor inventory with each tensor's
 * initialisation, config.json in each family's official spelling, and the
 * shard layout (next-fit in inventory order, a layer's routed experts kept
 * whole in one shard, data inside a shard ordered as safetensors' own writer
 * does: larger dtypes first, then by name).
 * Refuses: sizes the engine could not load (quantised widths that are not
 * multiples of 32, fewer experts than top-k, a vocabulary below 256) and a
 * --gb budget below the smallest model; messages name the option.
 * Does no I/O (write.c does).
 *
 * Tensor names and shapes follow the engine's loaders (src/model/
 * deepseek_v3.c, kimi.c, mla.c, kda.c, ffn.c) and K3.md §1.3.
 *
 * Initialisation (why: activations stay O(1) through every block):
 *   linear weights      N(0, 1/sqrt(fan_in)); KDA v_proj gain 3 (keeps KDA
 *                       outputs well above o_norm's eps), lm_head gain 2
 *   norms               N(1, 0.05);  embeddings N(0, 1)
 *   router              N(0, 1.5/sqrt(hidden)), correction bias N(0, 0.1)
 *   KDA                 A_log = log U(1, 16), dt_bias N(-2, 0.1), conv N(0, 0.3)
 *   AttnRes probes      N(0, 1/sqrt(hidden))
 *   int4 experts        q uniform in [-7, 7], bf16 scale so std = 1/sqrt(fan_in)
 *   MXFP4 experts       random e2m1 codes, e8m0 scales of two neighbouring
 *                       values mixed so std = 1/sqrt(fan_in) in expectation
 *
 * Sections: 1. names and arena  2. presets  3. inventory  4. config.json
 *           5. shard layout and headers  6. sizing and sy_plan_new  7. describe
 */
#include "synth.h"
#include "../base/port.h"
#include "../base/err.h"
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- 1. names and arena ------------------------------------------------------ */

typedef struct sy_arena {
    struct sy_arena *next;
    size_t used, cap;
    char data[];
} sy_arena;

static const char *arena_dup(sy_plan *p, const char *s) {
    size_t n = strlen(s) + 1;
    sy_arena *a = p->arena;
    if (!a || a->cap - a->used < n) {
        size_t cap = n > ((size_t)1 << 20) ? n : ((size_t)1 << 20);
        a = malloc(sizeof *a + cap);
        if (!a) return NULL;
        a->next = p->arena;
        a->used = 0;
        a->cap = cap;
        p->arena = a;
    }
    char *d = a->data + a->used;
    memcpy(d, s, n);
    a->used += n;
    return d;
}

static const struct { const char *name; sy_arch a; } arch_names[] = {
    {"deepseek_v3", SY_DEEPSEEK_V3}, {"kimi_k2", SY_KIMI_K2},
    {"kimi_linear", SY_KIMI_LINEAR}, {"kimi_k3", SY_KIMI_K3}};
static const struct { const char *name; sy_preset p; } preset_names[] = {
    {"tiny", SY_TINY}, {"k3-slice", SY_K3_SLICE}, {"full", SY_FULL}};

const char *sy_arch_name(sy_arch a) {
    for (size_t i = 0; i < sizeof arch_names / sizeof arch_names[0]; i++)
        if (arch_names[i].a == a) return arch_names[i].name;
    return "?";
}

const char *sy_preset_name(sy_preset p) {
    for (size_t i = 0; i < sizeof preset_names / sizeof preset_names[0]; i++)
        if (preset_names[i].p == p) return preset_names[i].name;
    return "?";
}

sy_arch sy_arch_from_name(const char *s) {
    for (size_t i = 0; i < sizeof arch_names / sizeof arch_names[0]; i++)
        if (strcmp(arch_names[i].name, s) == 0) return arch_names[i].a;
    return 0;
}

sy_preset sy_preset_from_name(const char *s) {
    for (size_t i = 0; i < sizeof preset_names / sizeof preset_names[0]; i++)
        if (strcmp(preset_names[i].name, s) == 0) return preset_names[i].p;
    return 0;
}

static int is_kimi(sy_arch a) { return a == SY_KIMI_LINEAR || a == SY_KIMI_K3; }

/* Kimi layer schedule (0-based l): MLA every 4th layer from the 4th, plus
 * the last one (K3.md §1.2); KDA elsewhere. */
static int is_mla_layer(const sy_dims *d, int l) { return (l + 1) % 4 == 0 || l == d->layers - 1; }

static int is_moe_layer(const sy_dims *d, int l) { return d->experts > 0 && l >= d->first_dense; }

/* ---- 2. presets ------------------------------------------------------------- */

/* K3's text_config (K3.md §1.1). */
static void preset_k3(sy_dims *d) {
    *d = (sy_dims){.vocab = 163840, .hidden = 7168, .inter = 33792, .moe_inter = 3072,
                   .layers = 93, .heads = 96, .experts = 896, .topk = 16, .shared = 2,
                   .n_group = 1, .topk_group = 1, .first_dense = 1, .routed_scale = 1.0,
                   .eps = 1e-5, .q_lora = 1536, .kv_lora = 512, .nope = 128, .rope = 64,
                   .v = 128, .kda_heads = 96, .kda_dim = 128, .conv = 4, .latent = 3584,
                   .attn_res_block = 12, .max_pos = 1048576, .rope_theta = 0};
}

static df_status preset(sy_arch a, sy_preset pr, sy_dims *d, int64_t *shard_size, char *err) {
    memset(d, 0, sizeof *d);
    *shard_size = (int64_t)5000000000; /* transformers' default max_shard_size "5GB" */
    if (pr == SY_K3_SLICE) {
        if (a != SY_KIMI_K3)
            return df_fail(err, DF_ERR_ARG, "--preset k3-slice is for --arch kimi_k3 (got %s)", sy_arch_name(a));
        preset_k3(d);
        d->layers = 3; /* KDA + dense, KDA + MoE, MLA + MoE */
        d->experts = 448;
        return DF_OK;
    }
    if (pr == SY_TINY) {
        /* Small awkward sizes: hidden not a power of two, 3 heads, head dims
         * 16/8/16, quantised widths multiples of 32. */
        *d = (sy_dims){.vocab = 1024, .hidden = 96, .inter = 160, .moe_inter = 32, .layers = 3,
                       .heads = 3, .experts = 12, .topk = 4, .shared = 1, .n_group = 1,
                       .topk_group = 1, .first_dense = 1, .routed_scale = 2.5, .eps = 1e-6,
                       .q_lora = 48, .kv_lora = 40, .nope = 16, .rope = 8, .v = 16,
                       .max_pos = 4096, .rope_theta = 10000.0};
        switch (a) {
        case SY_DEEPSEEK_V3:
            d->n_group = 4; /* exercise the group limit */
            d->topk_group = 2;
            break;
        case SY_KIMI_K2:
            d->experts = 16;
            d->moe_inter = 64;
            d->routed_scale = 2.827;
            d->rope_theta = 50000.0;
            d->yarn = 1;
            d->max_pos = 131072;
            break;
        case SY_KIMI_LINEAR:
            d->layers = 4; /* KDA, KDA, KDA, MLA */
            d->q_lora = 0;
            d->routed_scale = 2.446;
            d->eps = 1e-5;
            d->kda_heads = 3;
            d->kda_dim = 32;
            d->conv = 4;
            d->rope_theta = 0;
            break;
        case SY_KIMI_K3:
            d->layers = 5;  /* KDA, KDA, KDA, MLA, MLA: the last two are MLA as in K3 */
            d->shared = 2;
            d->latent = 64;
            d->routed_scale = 1.0;
            d->eps = 1e-5;
            d->kda_heads = 3;
            d->kda_dim = 32;
            d->conv = 4;
            d->attn_res_block = 2; /* three anchor blocks in five layers */
            d->rope_theta = 0;
            break;
        }
        *shard_size = (int64_t)5000000000;
        return DF_OK;
    }
    /* full: the public configs' sizes. */
    switch (a) {
    case SY_DEEPSEEK_V3:
        *d = (sy_dims){.vocab = 129280, .hidden = 7168, .inter = 18432, .moe_inter = 2048,
                       .layers = 61, .heads = 128, .experts = 256, .topk = 8, .shared = 1,
                       .n_group = 8, .topk_group = 4, .first_dense = 3, .routed_scale = 2.5,
                       .eps = 1e-6, .q_lora = 1536, .kv_lora = 512, .nope = 128, .rope = 64,
                       .v = 128, .max_pos = 163840, .rope_theta = 10000.0};
        break;
    case SY_KIMI_K2:
        *d = (sy_dims){.vocab = 163840, .hidden = 7168, .inter = 18432, .moe_inter = 2048,
                       .layers = 61, .heads = 64, .experts = 384, .topk = 8, .shared = 1,
                       .n_group = 1, .topk_group = 1, .first_dense = 1, .routed_scale = 2.827,
                       .eps = 1e-6, .q_lora = 1536, .kv_lora = 512, .nope = 128, .rope = 64,
                       .v = 128, .max_pos = 262144, .rope_theta = 50000.0, .yarn = 1};
        break;
    case SY_KIMI_LINEAR:
        *d = (sy_dims){.vocab = 163840, .hidden = 2304, .inter = 9216, .moe_inter = 1024,
                       .layers = 27, .heads = 32, .experts = 256, .topk = 8, .shared = 1,
                       .n_group = 1, .topk_group = 1, .first_dense = 1, .routed_scale = 2.446,
                       .eps = 1e-5, .q_lora = 0, .kv_lora = 512, .nope = 128, .rope = 64,
                       .v = 128, .kda_heads = 32, .kda_dim = 128, .conv = 4, .max_pos = 1048576};
        break;
    case SY_KIMI_K3:
        preset_k3(d);
        *shard_size = 0; /* 96 shards like the release (sy_plan_new) */
        break;
    }
    return DF_OK;
}

/* ---- 3. inventory ------------------------------------------------------------- */

enum { Q_NONE = 0, Q_INT4, Q_MXFP4 };

static int expert_quant(sy_arch a) { return a == SY_KIMI_K2 ? Q_INT4 : a == SY_KIMI_K3 ? Q_MXFP4 : Q_NONE; }

static sy_tensor *add(sy_plan *p, const char *name, st_dtype dt, int ndim, int64_t d0, int64_t d1,
                      int64_t d2) {
    if (p->oom) return NULL;
    if (p->n == p->cap) {
        int64_t cap = p->cap ? p->cap * 2 : 1024;
        sy_tensor *nt = realloc(p->t, (size_t)cap * sizeof *nt);
        if (!nt) { p->oom = 1; return NULL; }
        p->t = nt;
        p->cap = cap;
    }
    sy_tensor *t = &p->t[p->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = arena_dup(p, name))) { p->oom = 1; return NULL; }
    p->n++;
    t->dtype = dt;
    t->ndim = ndim;
    int64_t dims[3] = {d0, d1, d2}, ne = 1;
    for (int i = 0; i < ndim; i++) { t->shape[i] = dims[i]; ne *= dims[i]; }
    t->nbytes = ne * dtype_size(dt);
    t->group = -1;
    return t;
}

static void gen(sy_tensor *t, sy_gen g, float a, float b, int64_t i0, int64_t i1) {
    if (!t) return;
    t->gen = (uint8_t)g;
    t->a = a;
    t->b = b;
    t->i0 = i0;
    t->i1 = i1;
}

/* Name = base + leaf in a scratch buffer. */
static const char *nm(char *buf, const char *base, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static const char *nm(char *buf, const char *base, const char *fmt, ...) {
    int k = snprintf(buf, 384, "%s", base);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + k, (size_t)(384 - k), fmt, ap);
    va_end(ap);
    return buf;
}

/* <base><leaf>.weight [rows, cols], N(0, gain/sqrt(cols)). */
static void lin(sy_plan *p, const char *base, const char *leaf, int64_t rows, int64_t cols, double gain) {
    char b[384];
    gen(add(p, nm(b, base, "%s.weight", leaf), p->o.dtype, 2, rows, cols, 0), SY_GEN_NORMAL, 0.0f,
        (float)(gain / sqrt((double)cols)), 0, 0);
}

static void norm(sy_plan *p, const char *base, const char *leaf, int64_t n, st_dtype dt) {
    char b[384];
    gen(add(p, nm(b, base, "%s", leaf), dt, 1, n, 0, 0), SY_GEN_NORMAL, 1.0f, 0.05f, 0, 0);
}

/* A routed expert's matrix [rows, cols] in the family's storage. */
static void expert_mat(sy_plan *p, const char *base, const char *leaf, int64_t rows, int64_t cols,
                       int quant, int group) {
    char b[384];
    double target = 1.0 / sqrt((double)cols);
    int64_t first = p->n;
    if (quant == Q_NONE) {
        lin(p, base, leaf, rows, cols, 1.0);
    } else if (quant == Q_INT4) {
        /* compressed-tensors pack-quantized: 8 nibbles (q + 8) per I32, low
         * bits first; q uniform in [-7, 7] has std sqrt(56/3) = 4.32. */
        gen(add(p, nm(b, base, "%s.weight_packed", leaf), DT_I32, 2, rows, cols / 8, 0), SY_GEN_INT4, 0, 0, 0, 0);
        gen(add(p, nm(b, base, "%s.weight_scale", leaf), DT_BF16, 2, rows, cols / 32, 0), SY_GEN_INT4_SCALE,
            (float)(target / 4.3205), 0, 0, 0);
        gen(add(p, nm(b, base, "%s.weight_shape", leaf), DT_I64, 1, 2, 0, 0), SY_GEN_SHAPE, 0, 0, rows, cols);
    } else {
        /* MXFP4: uniform e2m1 codes have E[v^2] = 8.5625. Scale bytes are
         * base or base + 1 (2^(s-127)), base + 1 with the probability q
         * that makes E[w^2] = 1/cols exactly: 4^(base-127) (1 + 3q) = t2. */
        double t2 = target * target / 8.5625;
        int base_s = (int)floor(127.0 + 0.5 * log2(t2));
        double q1 = (t2 / pow(4.0, base_s - 127) - 1.0) / 3.0;
        gen(add(p, nm(b, base, "%s.weight_packed", leaf), DT_U8, 2, rows, cols / 2, 0), SY_GEN_BYTES, 0, 0, 0, 0);
        gen(add(p, nm(b, base, "%s.weight_scale", leaf), DT_U8, 2, rows, cols / 32, 0), SY_GEN_E8M0, 0, 0,
            base_s, lround(q1 * 256.0));
    }
    for (int64_t i = first; i < p->n; i++) p->t[i].group = group;
}

static void mla(sy_plan *p, const char *b, const sy_dims *d, int out_gate) {
    int64_t H = d->hidden, dq = d->nope + d->rope;
    if (d->q_lora > 0) {
        lin(p, b, "q_a_proj", d->q_lora, H, 1.0);
        norm(p, b, "q_a_layernorm.weight", d->q_lora, p->o.dtype);
        lin(p, b, "q_b_proj", (int64_t)d->heads * dq, d->q_lora, 1.0);
    } else {
        lin(p, b, "q_proj", (int64_t)d->heads * dq, H, 1.0);
    }
    lin(p, b, "kv_a_proj_with_mqa", d->kv_lora + d->rope, H, 1.0);
    norm(p, b, "kv_a_layernorm.weight", d->kv_lora, p->o.dtype);
    lin(p, b, "kv_b_proj", (int64_t)d->heads * (d->nope + d->v), d->kv_lora, 1.0);
    if (out_gate) lin(p, b, "g_proj", (int64_t)d->heads * d->v, H, 1.0);
    lin(p, b, "o_proj", H, (int64_t)d->heads * d->v, 1.0);
}

/* KDA (K3.md §1.6). K3: full-rank g_proj, A_log as the release stores it:
 * [head_dim] f32 whose first H values are the per-head ones and the rest
 * zero ([H] when there are more heads than channels); Kimi-Linear: low-rank
 * g_a/g_b, A_log [1, 1, H, 1]. The small vectors are F32 as in the release. */
static void kda(sy_plan *p, const char *b, const sy_dims *d, int k3) {
    int64_t H = d->hidden, P = (int64_t)d->kda_heads * d->kda_dim;
    char s[384];
    lin(p, b, "q_proj", P, H, 1.0);
    lin(p, b, "k_proj", P, H, 1.0);
    lin(p, b, "v_proj", P, H, 3.0);
    static const char *const convs[3] = {"q_conv1d", "k_conv1d", "v_conv1d"};
    for (int i = 0; i < 3; i++)
        gen(add(p, nm(s, b, "%s.weight", convs[i]), DT_F32, 3, P, 1, d->conv), SY_GEN_NORMAL, 0.0f, 0.3f, 0, 0);
    if (k3) {
        int64_t n = d->kda_dim > d->kda_heads ? d->kda_dim : d->kda_heads;
        gen(add(p, nm(s, b, "A_log"), DT_F32, 1, n, 0, 0), SY_GEN_LOGUNIF, 1.0f, 16.0f, d->kda_heads, 0);
    }
    else {
        sy_tensor *t = add(p, nm(s, b, "A_log"), DT_F32, 3, 1, 1, d->kda_heads);
        if (t) { t->ndim = 4; t->shape[3] = 1; } /* [1, 1, H, 1] */
        gen(t, SY_GEN_LOGUNIF, 1.0f, 16.0f, 0, 0);
    }
    gen(add(p, nm(s, b, "dt_bias"), DT_F32, 1, P, 0, 0), SY_GEN_NORMAL, -2.0f, 0.1f, 0, 0);
    lin(p, b, "f_a_proj", d->kda_dim, H, 1.0);
    lin(p, b, "f_b_proj", P, d->kda_dim, 1.0);
    lin(p, b, "b_proj", d->kda_heads, H, 1.0);
    if (k3) lin(p, b, "g_proj", P, H, 1.0);
    else {
        lin(p, b, "g_a_proj", d->kda_dim, H, 1.0);
        lin(p, b, "g_b_proj", P, d->kda_dim, 1.0);
    }
    norm(p, b, "o_norm.weight", d->kda_dim, DT_F32);
    lin(p, b, "o_proj", H, P, 1.0);
}

static void mlp(sy_plan *p, const char *b, int64_t inter, int64_t H) {
    lin(p, b, "gate_proj", inter, H, 1.0);
    lin(p, b, "up_proj", inter, H, 1.0);
    lin(p, b, "down_proj", H, inter, 1.0);
}

static void moe(sy_plan *p, const char *b, const sy_dims *d, sy_arch a, int layer) {
    int64_t H = d->hidden, E = d->experts, mi = d->moe_inter;
    char s[384], e[384];
    gen(add(p, nm(s, b, "gate.weight"), p->o.dtype, 2, E, H, 0), SY_GEN_NORMAL, 0.0f,
        (float)(1.5 / sqrt((double)H)), 0, 0);
    gen(add(p, nm(s, b, "gate.e_score_correction_bias"), DT_F32, 1, E, 0, 0), SY_GEN_NORMAL, 0.0f, 0.1f, 0, 0);
    if (d->shared > 0) mlp(p, nm(s, b, "shared_experts."), mi * d->shared, H);
    int64_t dl = H;
    if (d->latent > 0) {
        dl = d->latent;
        lin(p, b, "routed_expert_down_proj", dl, H, 1.0);
        norm(p, b, "routed_expert_norm.weight", dl, p->o.dtype);
        lin(p, b, "routed_expert_up_proj", H, dl, 1.0);
    }
    int q = expert_quant(a);
    for (int64_t x = 0; x < E; x++) {
        nm(e, b, "experts.%lld.", (long long)x);
        if (is_kimi(a)) {
            expert_mat(p, e, "w1", mi, dl, q, layer);
            expert_mat(p, e, "w2", dl, mi, q, layer);
            expert_mat(p, e, "w3", mi, dl, q, layer);
        } else {
            expert_mat(p, e, "gate_proj", mi, dl, q, layer);
            expert_mat(p, e, "up_proj", mi, dl, q, layer);
            expert_mat(p, e, "down_proj", dl, mi, q, layer);
        }
    }
}

/* The whole inventory, in layout order: embedding, layers (non-expert
 * tensors, then the routed experts), final norm and head. */
static void inventory(sy_plan *p, sy_arch a, const sy_dims *d) {
    int64_t H = d->hidden;
    int k3 = a == SY_KIMI_K3;
    const char *P = p->prefix;
    char b[384], s[384];
    gen(add(p, nm(b, P, "embed_tokens.weight"), p->o.dtype, 2, d->vocab, H, 0), SY_GEN_NORMAL, 0.0f, 1.0f, 0, 0);
    for (int l = 0; l < d->layers && !p->oom; l++) {
        nm(b, P, "layers.%d.", l);
        norm(p, b, "input_layernorm.weight", H, p->o.dtype);
        norm(p, b, "post_attention_layernorm.weight", H, p->o.dtype);
        if (k3) {
            norm(p, b, "self_attention_res_norm.weight", H, p->o.dtype);
            gen(add(p, nm(s, b, "self_attention_res_proj.weight"), p->o.dtype, 2, 1, H, 0), SY_GEN_NORMAL, 0.0f,
                (float)(1.0 / sqrt((double)H)), 0, 0);
            norm(p, b, "mlp_res_norm.weight", H, p->o.dtype);
            gen(add(p, nm(s, b, "mlp_res_proj.weight"), p->o.dtype, 2, 1, H, 0), SY_GEN_NORMAL, 0.0f,
                (float)(1.0 / sqrt((double)H)), 0, 0);
        }
        nm(s, b, "self_attn.");
        if (is_kimi(a) && !is_mla_layer(d, l)) kda(p, s, d, k3);
        else mla(p, s, d, k3);
        if (!is_moe_layer(d, l)) mlp(p, nm(s, b, "mlp."), d->inter, H);
        else moe(p, nm(s, b, is_kimi(a) ? "block_sparse_moe." : "mlp."), d, a, l);
    }
    norm(p, nm(b, P, "norm.weight"), "", H, p->o.dtype);
    if (k3) {
        norm(p, nm(b, P, "output_attn_res_norm.weight"), "", H, p->o.dtype);
        gen(add(p, nm(b, P, "output_attn_res_proj.weight"), p->o.dtype, 2, 1, H, 0), SY_GEN_NORMAL, 0.0f,
            (float)(1.0 / sqrt((double)H)), 0, 0);
    }
    gen(add(p, p->head, p->o.dtype, 2, d->vocab, H, 0), SY_GEN_NORMAL, 0.0f, (float)(2.0 / sqrt((double)H)), 0, 0);
}

/* ---- 4. config.json ----------------------------------------------------------- */

static json_t *int_list(const sy_dims *d, int want_mla) {
    json_t *a = json_array();
    for (int l = 0; l < d->layers; l++)
        if (is_mla_layer(d, l) == want_mla) json_array_append_new(a, json_integer(l + 1));
    return a;
}

#define SETI(o, k, v) json_object_set_new(o, k, json_integer(v))
#define SETR(o, k, v) json_object_set_new(o, k, json_real(v))
#define SETS(o, k, v) json_object_set_new(o, k, json_string(v))
#define SETB(o, k, v) json_object_set_new(o, k, json_boolean(v))

static json_t *quant_config(sy_arch a) {
    json_t *q = json_object(), *groups = json_object(), *g0 = json_object(), *w = json_object();
    SETS(q, "quant_method", "compressed-tensors");
    SETS(q, "format", a == SY_KIMI_K3 ? "mxfp4-pack-quantized" : "pack-quantized");
    SETS(q, "quantization_status", "compressed");
    json_t *targets = json_array();
    json_array_append_new(targets, json_string("Linear"));
    json_object_set_new(g0, "targets", targets);
    SETI(w, "num_bits", 4);
    SETS(w, "type", a == SY_KIMI_K3 ? "float" : "int");
    SETB(w, "symmetric", 1);
    SETI(w, "group_size", 32);
    SETS(w, "strategy", "group");
    SETB(w, "dynamic", 0);
    json_object_set_new(w, "actorder", json_null());
    json_object_set_new(w, "block_structure", json_null());
    SETS(w, "observer", "minmax");
    json_object_set_new(w, "observer_kwargs", json_object());
    if (a == SY_KIMI_K3) SETS(w, "scale_dtype", "torch.uint8");
    json_object_set_new(g0, "weights", w);
    json_object_set_new(g0, "input_activations", json_null());
    json_object_set_new(g0, "output_activations", json_null());
    json_object_set_new(groups, "group_0", g0);
    json_object_set_new(q, "config_groups", groups);
    /* Everything but the routed experts stays unquantised. */
    static const char *const ign_ds[] = {"re:.*lm_head.*", "re:.*self_attn.*", "re:.*shared_experts.*",
                                         "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*mlp\\.gate$"};
    static const char *const ign_k3[] = {"re:.*lm_head.*", "re:.*self_attn.*", "re:.*shared_experts.*",
                                         "re:.*mlp\\.(gate|up|down)_proj.*", "re:.*block_sparse_moe\\.gate$",
                                         "re:.*routed_expert_(down|up)_proj.*", "re:.*vision_tower.*",
                                         "re:.*mm_projector.*"};
    json_t *ign = json_array();
    const char *const *list = a == SY_KIMI_K3 ? ign_k3 : ign_ds;
    size_t n = a == SY_KIMI_K3 ? sizeof ign_k3 / sizeof ign_k3[0] : sizeof ign_ds / sizeof ign_ds[0];
    for (size_t i = 0; i < n; i++) json_array_append_new(ign, json_string(list[i]));
    json_object_set_new(q, "ignore", ign);
    json_object_set_new(q, "kv_cache_scheme", json_null());
    return q;
}

static void token_ids(json_t *o, sy_arch a, int V) {
    if (a == SY_DEEPSEEK_V3) {
        SETI(o, "bos_token_id", 0);
        SETI(o, "eos_token_id", 1);
        return;
    }
    /* Kimi's ids sit at the top of the vocabulary: 163584/163585 (K2) or
     * 163586 (Kimi-Linear, K3) and pad 163839 of 163840; same offsets here. */
    SETI(o, "bos_token_id", V - 256);
    SETI(o, "eos_token_id", a == SY_KIMI_K2 ? V - 255 : V - 254);
    SETI(o, "pad_token_id", V - 1);
}

/* DeepseekV3Config spelling (deepseek_v3, kimi_k2). */
static json_t *config_ds(sy_arch a, const sy_dims *d) {
    json_t *o = json_object(), *arch = json_array();
    json_array_append_new(arch, json_string("DeepseekV3ForCausalLM"));
    json_object_set_new(o, "architectures", arch);
    SETS(o, "model_type", a == SY_KIMI_K2 ? "kimi_k2" : "deepseek_v3");
    SETI(o, "vocab_size", d->vocab);
    SETI(o, "hidden_size", d->hidden);
    SETI(o, "intermediate_size", d->inter);
    SETI(o, "moe_intermediate_size", d->moe_inter);
    SETI(o, "num_hidden_layers", d->layers);
    SETI(o, "num_attention_heads", d->heads);
    SETI(o, "num_key_value_heads", d->heads);
    SETI(o, "n_shared_experts", d->shared);
    SETI(o, "n_routed_experts", d->experts);
    SETI(o, "num_experts_per_tok", d->topk);
    SETR(o, "routed_scaling_factor", d->routed_scale);
    SETI(o, "n_group", d->n_group);
    SETI(o, "topk_group", d->topk_group);
    SETS(o, "topk_method", "noaux_tc");
    SETS(o, "scoring_func", "sigmoid");
    SETB(o, "norm_topk_prob", 1);
    SETI(o, "first_k_dense_replace", d->first_dense);
    SETI(o, "moe_layer_freq", 1);
    SETI(o, "ep_size", 1);
    if (d->q_lora > 0) SETI(o, "q_lora_rank", d->q_lora);
    else json_object_set_new(o, "q_lora_rank", json_null());
    SETI(o, "kv_lora_rank", d->kv_lora);
    SETI(o, "qk_nope_head_dim", d->nope);
    SETI(o, "qk_rope_head_dim", d->rope);
    SETI(o, "v_head_dim", d->v);
    SETS(o, "hidden_act", "silu");
    SETI(o, "max_position_embeddings", d->max_pos);
    SETR(o, "rms_norm_eps", d->eps);
    SETR(o, "rope_theta", d->rope_theta);
    if (d->yarn) {
        json_t *y = json_object();
        SETS(y, "type", "yarn");
        SETR(y, "factor", 32.0);
        SETR(y, "beta_fast", 1.0);
        SETR(y, "beta_slow", 1.0);
        SETR(y, "mscale", 1.0);
        SETR(y, "mscale_all_dim", 1.0);
        SETI(y, "original_max_position_embeddings", 4096);
        json_object_set_new(o, "rope_scaling", y);
    } else {
        json_object_set_new(o, "rope_scaling", json_null());
    }
    SETB(o, "attention_bias", 0);
    SETR(o, "attention_dropout", 0.0);
    SETR(o, "initializer_range", 0.02);
    SETI(o, "num_nextn_predict_layers", 0); /* no MTP weights are written */
    token_ids(o, a, d->vocab);
    SETB(o, "tie_word_embeddings", 0);
    SETB(o, "use_cache", 1);
    SETS(o, "torch_dtype", "bfloat16");
    if (a == SY_KIMI_K2) json_object_set_new(o, "quantization_config", quant_config(a));
    return o;
}

/* KimiLinearConfig spelling; K3's text_config adds its own keys (K3.md §1.1). */
static json_t *config_kimi_text(sy_arch a, const sy_dims *d) {
    int k3 = a == SY_KIMI_K3;
    json_t *o = json_object();
    if (!k3) {
        json_t *arch = json_array();
        json_array_append_new(arch, json_string("KimiLinearForCausalLM"));
        json_object_set_new(o, "architectures", arch);
    }
    SETS(o, "model_type", "kimi_linear");
    SETS(o, "dtype", "bfloat16");
    SETS(o, "hidden_act", k3 ? "situ" : "silu");
    if (k3) {
        SETR(o, "activation_situ_beta", 4.0);
        SETR(o, "activation_situ_linear_beta", 25.0);
    }
    SETR(o, "rms_norm_eps", d->eps);
    SETB(o, "use_cache", 1);
    SETI(o, "num_nextn_predict_layers", 0);
    SETI(o, "hidden_size", d->hidden);
    SETI(o, "vocab_size", d->vocab);
    SETI(o, "max_position_embeddings", d->max_pos);
    SETI(o, "num_hidden_layers", d->layers);
    SETI(o, "first_k_dense_replace", d->first_dense);
    SETI(o, "moe_layer_freq", 1);
    SETI(o, "intermediate_size", d->inter);
    SETI(o, "moe_intermediate_size", d->moe_inter);
    if (k3) {
        SETI(o, "routed_expert_hidden_size", d->latent);
        SETB(o, "latent_moe_use_norm", 1);
    }
    SETI(o, "num_experts", d->experts);
    SETI(o, "num_experts_per_token", d->topk);
    SETI(o, "num_shared_experts", d->shared);
    SETS(o, "moe_router_activation_func", "sigmoid");
    SETS(o, "topk_method", "noaux_tc");
    SETB(o, "use_grouped_topk", 1);
    SETI(o, "num_expert_group", d->n_group);
    SETI(o, "topk_group", d->topk_group);
    SETB(o, "moe_renormalize", 1);
    SETR(o, "routed_scaling_factor", d->routed_scale);
    SETI(o, "num_attention_heads", d->heads);
    SETI(o, "num_key_value_heads", d->heads);
    if (d->q_lora > 0) SETI(o, "q_lora_rank", d->q_lora);
    else json_object_set_new(o, "q_lora_rank", json_null());
    SETI(o, "kv_lora_rank", d->kv_lora);
    SETI(o, "qk_nope_head_dim", d->nope);
    SETI(o, "qk_rope_head_dim", d->rope);
    SETI(o, "v_head_dim", d->v);
    SETB(o, "mla_use_nope", 1);
    if (k3) {
        SETB(o, "mla_use_output_gate", 1);
        SETI(o, "attn_res_block_size", d->attn_res_block);
    }
    json_t *lac = json_object();
    SETI(lac, "head_dim", d->kda_dim);
    SETI(lac, "num_heads", d->kda_heads);
    SETI(lac, "short_conv_kernel_size", d->conv);
    if (k3) {
        SETB(lac, "use_full_rank_gate", 1);
        SETR(lac, "gate_lower_bound", -5.0);
    }
    json_object_set_new(lac, "kda_layers", int_list(d, 0));
    json_object_set_new(lac, "full_attn_layers", int_list(d, 1));
    json_object_set_new(o, "linear_attn_config", lac);
    token_ids(o, a, d->vocab);
    SETB(o, "tie_word_embeddings", 0);
    if (k3) json_object_set_new(o, "quantization_config", quant_config(a));
    return o;
}

static char *config_text(sy_arch a, const sy_dims *d) {
    json_t *root;
    if (a == SY_KIMI_K3) {
        root = json_object();
        SETS(root, "model_type", "kimi_k3");
        SETS(root, "dtype", "bfloat16");
        SETB(root, "tie_word_embeddings", 0);
        token_ids(root, a, d->vocab);
        json_object_set_new(root, "text_config", config_kimi_text(a, d));
    } else if (a == SY_KIMI_LINEAR) {
        root = config_kimi_text(a, d);
    } else {
        root = config_ds(a, d);
    }
    char *s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(15));
    json_decref(root);
    if (!s) return NULL;
    size_t n = strlen(s);
    char *t = realloc(s, n + 2); /* end with a newline */
    if (!t) { free(s); return NULL; }
    t[n] = '\n';
    t[n + 1] = 0;
    return t;
}

/* ---- 5. shard layout and headers ---------------------------------------------- */

/* Next-fit over the units of the inventory (a tensor, or a layer's whole
 * run of routed experts) with shards of at most S bytes (a unit larger than
 * S gets a shard of its own). Returns the shard count; assigns t->shard if
 * assign. */
static int layout_pass(sy_plan *p, int64_t S, int assign) {
    int shard = 0;
    int64_t used = 0;
    for (int64_t i = 0; i < p->n;) {
        int64_t j = i + 1, bytes = p->t[i].nbytes;
        if (p->t[i].group >= 0)
            while (j < p->n && p->t[j].group == p->t[i].group) bytes += p->t[j++].nbytes;
        if (used > 0 && used + bytes > S) {
            shard++;
            used = 0;
        }
        used += bytes;
        if (assign)
            for (int64_t k = i; k < j; k++) p->t[k].shard = shard;
        i = j;
    }
    return p->n ? shard + 1 : 0;
}

static int64_t largest_unit(const sy_plan *p) {
    int64_t best = 0;
    for (int64_t i = 0; i < p->n;) {
        int64_t j = i + 1, bytes = p->t[i].nbytes;
        if (p->t[i].group >= 0)
            while (j < p->n && p->t[j].group == p->t[i].group) bytes += p->t[j++].nbytes;
        if (bytes > best) best = bytes;
        i = j;
    }
    return best;
}

/* Splits shards until there are `target` (or no shard holds two units): the
 * biggest shard with two or more units is cut at the unit boundary nearest
 * its middle. Next-fit with the smallest size that gives at most `target`
 * shards can give fewer when a few units are huge (K3: 92 expert blocks of
 * 15.7 GB); this keeps the largest shard as it is. Returns the count. */
static int split_to(sy_plan *p, int ns, int target) {
    int64_t *bytes = calloc((size_t)target, sizeof *bytes), *units = calloc((size_t)target, sizeof *units);
    if (!bytes || !units) { free(bytes); free(units); return ns; } /* keep the next-fit layout */
    while (ns < target) {
        memset(bytes, 0, (size_t)ns * sizeof *bytes);
        memset(units, 0, (size_t)ns * sizeof *units);
        for (int64_t i = 0; i < p->n; i++) {
            const sy_tensor *t = &p->t[i];
            bytes[t->shard] += t->nbytes;
            units[t->shard] += i == 0 || p->t[i - 1].shard != t->shard || t->group < 0 || t->group != p->t[i - 1].group;
        }
        int best = -1;
        for (int k = 0; k < ns; k++)
            if (units[k] >= 2 && (best < 0 || bytes[k] > bytes[best])) best = k;
        if (best < 0) break;
        /* the unit boundary nearest the middle: tensors from the cut on
         * move to shard best + 1, later shards shift by one */
        int64_t acc = 0, cut = -1, cut_err = INT64_MAX;
        for (int64_t i = 0; i < p->n; i++) {
            if (p->t[i].shard != best) continue;
            int boundary = acc > 0 && (p->t[i].group < 0 || p->t[i].group != p->t[i - 1].group);
            int64_t e = acc * 2 - bytes[best];
            if (e < 0) e = -e;
            if (boundary && e < cut_err) { cut = i; cut_err = e; }
            acc += p->t[i].nbytes;
        }
        for (int64_t i = 0; i < p->n; i++)
            if (p->t[i].shard > best || (p->t[i].shard == best && i >= cut)) p->t[i].shard++;
        ns++;
    }
    free(bytes);
    free(units);
    return ns;
}

/* safetensors' writer order inside a file: larger dtypes first (which keeps
 * every tensor aligned to its element size), then by name. For a layer's
 * MXFP4 experts this gives the release's order: expert ids as strings
 * ("0", "1", "10", ...), and w1_p, w1_s, w2_p, w2_s, w3_p, w3_s inside one. */
static int data_order(const void *x, const void *y, void *ctx) {
    const sy_plan *p = ctx;
    const sy_tensor *a = &p->t[*(const int64_t *)x], *b = &p->t[*(const int64_t *)y];
    if (a->shard != b->shard) return a->shard < b->shard ? -1 : 1;
    int sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
    if (sa != sb) return sa > sb ? -1 : 1;
    if (a->dtype != b->dtype) return a->dtype < b->dtype ? -1 : 1;
    return strcmp(a->name, b->name);
}

static df_status layout(sy_plan *p, int64_t S, int target_shards, char *err) {
    int64_t total = 0;
    for (int64_t i = 0; i < p->n; i++) total += p->t[i].nbytes;
    if (target_shards > 0) {
        /* The smallest size that gives at most target_shards shards (the
         * count only falls as the size grows under next-fit). */
        int64_t lo = largest_unit(p), hi = total > lo ? total : lo;
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (layout_pass(p, mid, 0) <= target_shards) hi = mid;
            else lo = mid + 1;
        }
        S = lo;
    }
    p->s.shard_size = S;
    int ns = layout_pass(p, S, 1);
    if (target_shards > 0) ns = split_to(p, ns, target_shards);
    p->s.n_shards = ns;
    p->shards = calloc((size_t)(ns ? ns : 1), sizeof *p->shards);
    p->order = malloc((size_t)(p->n ? p->n : 1) * sizeof *p->order);
    if (!p->shards || !p->order) return df_fail(err, DF_ERR_NOMEM, "out of memory for the shard layout");
    for (int64_t i = 0; i < p->n; i++) p->order[i] = i;
    port_qsort_r(p->order, (size_t)p->n, sizeof *p->order, data_order, p);
    for (int64_t k = 0; k < p->n; k++) {
        sy_tensor *t = &p->t[p->order[k]];
        sy_shard *sh = &p->shards[t->shard];
        if (sh->count == 0) sh->first = k;
        sh->count++;
        t->offset = sh->data_bytes;
        sh->data_bytes += t->nbytes;
    }
    for (int i = 0; i < ns; i++) {
        if (ns == 1) snprintf(p->shards[i].file, sizeof p->shards[i].file, "model.safetensors");
        else snprintf(p->shards[i].file, sizeof p->shards[i].file, "model-%05d-of-%05d.safetensors", i + 1, ns);
    }
    p->s.total_bytes = total;
    return DF_OK;
}

char *sy_header(const sy_plan *p, int shard, size_t *len) {
    const sy_shard *sh = &p->shards[shard];
    size_t cap = 64 + (size_t)sh->count * 96, n = 0;
    for (int64_t k = sh->first; k < sh->first + sh->count; k++) cap += strlen(p->t[p->order[k]].name);
    char *h = malloc(cap + 8);
    if (!h) return NULL;
    n += (size_t)snprintf(h, cap, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int64_t k = sh->first; k < sh->first + sh->count; k++) {
        const sy_tensor *t = &p->t[p->order[k]];
        n += (size_t)snprintf(h + n, cap - n, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name, dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++)
            n += (size_t)snprintf(h + n, cap - n, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        n += (size_t)snprintf(h + n, cap - n, "],\"data_offsets\":[%lld,%lld]}", (long long)t->offset,
                              (long long)(t->offset + t->nbytes));
    }
    h[n++] = '}';
    while (n % 8) h[n++] = ' ';
    h[n] = 0;
    *len = n;
    return h;
}

/* ---- 6. sizing and sy_plan_new ---------------------------------------------- */

static df_status check_dims(const sy_opts *o, const sy_dims *d, char *err) {
    if (d->layers < 1 || d->layers > 1024) return df_fail(err, DF_ERR_ARG, "--layers must be 1..1024 (got %d)", d->layers);
    if (d->vocab < 256 || d->vocab > (4 << 20))
        return df_fail(err, DF_ERR_ARG, "--vocab must be 256..%d (got %d)", 4 << 20, d->vocab);
    if (d->inter < 1) return df_fail(err, DF_ERR_ARG, "--dense-inter must be positive (got %d)", d->inter);
    int moe_layers = 0;
    for (int l = 0; l < d->layers; l++) moe_layers += is_moe_layer(d, l);
    if (moe_layers > 0) {
        if (d->experts < d->topk)
            return df_fail(err, DF_ERR_ARG, "--experts %d is below the %d experts each token uses", d->experts, d->topk);
        if (d->experts % d->n_group)
            return df_fail(err, DF_ERR_ARG, "--experts %d must be a multiple of the %d expert groups", d->experts,
                           d->n_group);
    }
    int q = expert_quant(o->arch);
    int64_t in1 = d->latent > 0 ? d->latent : d->hidden;
    if (q != Q_NONE && (in1 % 32 || d->moe_inter % 32))
        return df_fail(err, DF_ERR_ARG, "quantised experts need widths that are multiples of 32 (got %lld and %d)",
                       (long long)in1, d->moe_inter);
    return DF_OK;
}

/* Builds the inventory of dims d into a fresh plan (no layout, no config). */
static df_status build(const sy_opts *o, const sy_dims *d, sy_plan **out, char *err) {
    sy_plan *p = calloc(1, sizeof *p);
    if (!p) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    p->o = *o;
    p->s.d = *d;
    snprintf(p->prefix, sizeof p->prefix, "%s", o->arch == SY_KIMI_K3 ? "language_model.model." : "model.");
    snprintf(p->head, sizeof p->head, "%s", o->arch == SY_KIMI_K3 ? "language_model.lm_head.weight" : "lm_head.weight");
    inventory(p, o->arch, d);
    if (p->oom) {
        sy_plan_free(p);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for the tensor inventory");
    }
    *out = p;
    return DF_OK;
}

static df_status bytes_for(const sy_opts *o, const sy_dims *d, int64_t *bytes, char *err) {
    sy_plan *p;
    df_status st = build(o, d, &p, err);
    if (st) return st;
    *bytes = 0;
    for (int64_t i = 0; i < p->n; i++) *bytes += p->t[i].nbytes;
    sy_plan_free(p);
    return DF_OK;
}

/* --gb: the expert count (a multiple of n_group, at least top-k) whose total
 * is closest to the budget from below. When even top-k experts do not fit, or
 * fewer than 2 x top-k would, halves the vocabulary and the dense layer
 * (whichever is bigger, unless the user fixed it) down to 8192 / 2048. */
static df_status size_for_gb(const sy_opts *o, sy_dims *d, char *notes, size_t ncap, char *err) {
    int64_t G = (int64_t)(o->gb * 1e9);
    int step = d->n_group > 0 ? d->n_group : 1;
    int emin = (d->topk + step - 1) / step * step;
    int v0 = d->vocab, i0 = d->inter;
    int moe_layers = 0;
    for (int l = 0; l < d->layers; l++) moe_layers += l >= d->first_dense;
    if (moe_layers == 0) return df_fail(err, DF_ERR_ARG, "--gb sizes the experts, but this model has no MoE layer");
    int n_dense = d->first_dense < d->layers ? d->first_dense : d->layers;
    for (;;) {
        int64_t b0, b1;
        df_status st;
        d->experts = emin;
        if ((st = bytes_for(o, d, &b0, err))) return st;
        d->experts = emin + step;
        if ((st = bytes_for(o, d, &b1, err))) return st;
        int64_t per = b1 - b0;
        int64_t e = G >= b0 ? emin + (G - b0) / per * step : 0;
        if (e >= 2 * d->topk) {
            d->experts = e > 65536 ? 65536 : (int)e;
            break;
        }
        int64_t es = dtype_size(o->dtype);
        int64_t vb = o->vocab ? 0 : 2LL * d->vocab * d->hidden * es;
        int64_t ib = o->dense_inter ? 0 : 3LL * d->inter * d->hidden * es * n_dense;
        int can_v = !o->vocab && d->vocab > 8192, can_i = !o->dense_inter && n_dense > 0 && d->inter > 2048;
        if (can_v && (!can_i || vb >= ib)) d->vocab = d->vocab / 2 > 8192 ? d->vocab / 2 : 8192;
        else if (can_i) d->inter = d->inter / 2 > 2048 ? d->inter / 2 : 2048;
        else if (G >= b0 && e >= emin) {
            d->experts = (int)e;
            break;
        } else
            return df_fail(err, DF_ERR_ARG,
                           "--gb %g is too small: with vocab %d, dense intermediate %d and %d experts per MoE "
                           "layer this model needs %.3f GB",
                           o->gb, d->vocab, d->inter, emin, b0 / 1e9);
    }
    if (d->vocab != v0 || d->inter != i0)
        snprintf(notes, ncap, "to fit --gb %g: vocab %d -> %d, dense intermediate %d -> %d", o->gb, v0, d->vocab,
                 i0, d->inter);
    return DF_OK;
}

df_status sy_plan_new(const sy_opts *oin, sy_plan **out, char *err) {
    *out = NULL;
    sy_opts o = *oin;
    if (!o.dtype) o.dtype = DT_BF16;
    if (o.dtype != DT_BF16 && o.dtype != DT_F32)
        return df_fail(err, DF_ERR_ARG, "--dtype must be bf16 or f32 (got %s)", dtype_name(o.dtype));
    if (!o.arch) return df_fail(err, DF_ERR_ARG, "an architecture is required (deepseek_v3, kimi_k2, kimi_linear, kimi_k3)");
    if (!o.preset) o.preset = SY_TINY;
    sy_dims d;
    int64_t shard_default;
    df_status st = preset(o.arch, o.preset, &d, &shard_default, err);
    if (st) return st;
    if (o.layers) {
        d.layers = o.layers;
        if (d.first_dense > d.layers) d.first_dense = d.layers;
    }
    if (o.vocab) d.vocab = o.vocab;
    if (o.dense_inter) d.inter = o.dense_inter;
    if (o.experts) d.experts = o.experts;
    if (o.experts && o.gb > 0) return df_fail(err, DF_ERR_ARG, "--experts and --gb both set the expert count; give one");
    if (o.gb < 0 || o.shard_size < 0) return df_fail(err, DF_ERR_ARG, "--gb and --shard-size must be positive");
    char notes[512] = "";
    if (o.gb > 0 && (st = size_for_gb(&o, &d, notes, sizeof notes, err))) return st;
    if ((st = check_dims(&o, &d, err))) return st;
    sy_plan *p;
    if ((st = build(&o, &d, &p, err))) return st;
    snprintf(p->s.notes, sizeof p->s.notes, "%s", notes);
    int target = 0;
    int64_t S = o.shard_size ? o.shard_size : shard_default;
    if (!S) target = 96; /* K3 full: the release's 96 shards */
    if ((st = layout(p, S, target, err))) { sy_plan_free(p); return st; }
    if (!(p->config = config_text(o.arch, &d))) {
        sy_plan_free(p);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for config.json");
    }
    sy_summary *s = &p->s;
    s->n_tensors = p->n;
    for (int l = 0; l < d.layers; l++) s->n_moe_layers += is_moe_layer(&d, l);
    for (int64_t i = 0; i < p->n; i++)
        if (p->t[i].group >= 0) s->expert_bytes += p->t[i].nbytes;
    s->expert_span = s->n_moe_layers && d.experts ? s->expert_bytes / ((int64_t)s->n_moe_layers * d.experts) : 0;
    *out = p;
    return DF_OK;
}

void sy_plan_free(sy_plan *p) {
    if (!p) return;
    free(p->t);
    free(p->order);
    free(p->shards);
    free(p->config);
    free(p->tok_ranks);
    free(p->tok_config);
    while (p->arena) {
        sy_arena *n = p->arena->next;
        free(p->arena);
        p->arena = n;
    }
    free(p);
}

const sy_summary *sy_plan_summary(const sy_plan *p) { return &p->s; }
const char *sy_plan_config(const sy_plan *p) { return p->config; }

/* ---- 7. describe ------------------------------------------------------------ */

void sy_plan_describe(const sy_plan *p, char *buf, size_t cap) {
    const sy_summary *s = &p->s;
    const sy_dims *d = &s->d;
    size_t n = 0;
#define PUT(...) do { if (n < cap) n += (size_t)snprintf(buf + n, cap - n, __VA_ARGS__); } while (0)
    PUT("synth          %s, preset %s, seed %llu, %s weights%s\n", sy_arch_name(p->o.arch), sy_preset_name(p->o.preset),
        (unsigned long long)p->o.seed, p->o.dtype == DT_F32 ? "f32" : "bf16", p->o.sparse ? ", sparse" : "");
    PUT("layers         %d: ", d->layers);
    for (int l = 0; l < d->layers && l < 12; l++)
        PUT("%s%s+%s", l ? ", " : "", is_kimi(p->o.arch) && !is_mla_layer(d, l) ? "KDA" : "MLA",
            is_moe_layer(d, l) ? "MoE" : "dense");
    PUT("%s\n", d->layers > 12 ? ", ..." : "");
    PUT("sizes          hidden %d, heads %d, vocab %d, dense intermediate %d, moe intermediate %d", d->hidden,
        d->heads, d->vocab, d->inter, d->moe_inter);
    if (d->latent) PUT(" in latent %d", d->latent);
    if (d->kda_heads && is_kimi(p->o.arch)) PUT("; KDA %d x %d, conv %d", d->kda_heads, d->kda_dim, d->conv);
    PUT("\n");
    if (s->n_moe_layers)
        PUT("experts        %d per MoE layer x %d layers, top-%d, %d shared; %.3f MB each (%s), %.3f GB in all\n",
            d->experts, s->n_moe_layers, d->topk, d->shared, s->expert_span / 1e6,
            expert_quant(p->o.arch) == Q_MXFP4 ? "mxfp4" : expert_quant(p->o.arch) == Q_INT4 ? "int4"
            : p->o.dtype == DT_F32 ? "f32" : "bf16",
            s->expert_bytes / 1e9);
    PUT("tensors        %lld in %d shard%s (shard size %.3f GB), %.3f GB\n", (long long)s->n_tensors, s->n_shards,
        s->n_shards == 1 ? "" : "s", s->shard_size / 1e9, s->total_bytes / 1e9);
    if (s->notes[0]) PUT("adjusted       %s\n", s->notes);
    if (p->tok_ranks) PUT("tokenizer      %s\n", p->tok_note);
#undef PUT
}
