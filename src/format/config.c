/* config.c — config.json -> df_config (prefix cfg_).
 *
 * Owns: reading dir/config.json with jansson, choosing the architecture,
 * filling the DeepSeek-V3 fields shared by DeepSeek-V3, Kimi-K2(.5),
 * Kimi-Linear and K3 with transformers 5.x DeepseekV3Config's defaults,
 * accepting Kimi's spellings of the same fields, the RoPE and quantisation
 * descriptions, and range checks that name the offending field.
 * Refuses: DeepSeek-V2 and unknown model types, unknown quantisation methods,
 * activations other than SiLU (SiTU for K3), and any field of the wrong JSON
 * type. Kimi-Linear/K3-only fields (linear_attn_config, SiTU betas, AttnRes)
 * are read by cfg_load_kimi (config_kimi.c), which cfg_load calls for those
 * architectures once the shared fields are in place.
 *
 * Where fields come from: when the root has an object "text_config" (Kimi-K2.5,
 * K3), model fields are read from it and nested_text_config is set; token ids,
 * tie_word_embeddings and quantization_config fall back to the root.
 *
 * Sections: 1. typed field access  2. architecture  3. fields and defaults
 *           4. RoPE  5. quantisation  6. validation  7. cfg_load
 */
#include "config.h"
#include "../base/err.h"
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CFG_MAX_BYTES ((size_t)16 << 20)

/* ---- 1. typed field access --------------------------------------------------- */

/* Where we are reading: the object, how to name its fields in messages, and
 * the file path. */
typedef struct {
    json_t *obj;        /* text_config or root */
    json_t *root;
    const char *where;  /* "" or "text_config." */
    const char *path;   /* dir/config.json */
    char *err;
} reader;

static const char *jtype(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

/* The value of the first of `names` (NULL-terminated list of spellings)
 * present in obj; *used receives the spelling found. NULL if none. */
static json_t *get_any(json_t *obj, const char *const *names, const char **used) {
    for (; *names; names++) {
        json_t *v = json_object_get(obj, *names);
        if (v) {
            *used = *names;
            return v;
        }
    }
    return NULL;
}

#define NAMES(...) ((const char *const[]){__VA_ARGS__, NULL})

/* Reads an integer field. Absent or null -> *out = def (returns 0). A real
 * with an integral value is accepted (7168.0). Returns 1 if the field was
 * present, 0 if defaulted, -1 on a type error (err filled). */
static int get_int(reader *r, json_t *obj, const char *const *names, int def, int *out) {
    const char *nm = names[0];
    json_t *v = get_any(obj, names, &nm);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (json_is_integer(v)) {
        json_int_t x = json_integer_value(v);
        if (x < INT_MIN || x > INT_MAX) {
            df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' is out of range (got %lld)", r->path,
                    r->where, nm, (long long)x);
            return -1;
        }
        *out = (int)x;
        return 1;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d == floor(d) && d >= INT_MIN && d <= INT_MAX) {
            *out = (int)d;
            return 1;
        }
        df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be an integer (got %g)", r->path,
                r->where, nm, d);
        return -1;
    }
    if (json_is_string(v))
        df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be an integer (got string \"%.64s\")",
                r->path, r->where, nm, json_string_value(v));
    else
        df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be an integer (got %s)", r->path,
                r->where, nm, jtype(v));
    return -1;
}

static int get_num(reader *r, json_t *obj, const char *const *names, double def, double *out) {
    const char *nm = names[0];
    json_t *v = get_any(obj, names, &nm);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (json_is_number(v)) {
        *out = json_number_value(v);
        return 1;
    }
    if (json_is_string(v))
        df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be a number (got string \"%.64s\")",
                r->path, r->where, nm, json_string_value(v));
    else
        df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be a number (got %s)", r->path,
                r->where, nm, jtype(v));
    return -1;
}

static int get_bool(reader *r, json_t *obj, const char *const *names, int def, int *out) {
    const char *nm = names[0];
    json_t *v = get_any(obj, names, &nm);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (json_is_boolean(v)) {
        *out = json_is_true(v);
        return 1;
    }
    if (json_is_integer(v) && (json_integer_value(v) == 0 || json_integer_value(v) == 1)) {
        *out = (int)json_integer_value(v);
        return 1;
    }
    df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be true or false (got %s)", r->path,
            r->where, nm, jtype(v));
    return -1;
}

/* String field into buf; absent/null -> def. */
static int get_str(reader *r, json_t *obj, const char *const *names, const char *def, char *buf,
                   size_t cap) {
    const char *nm = names[0];
    json_t *v = get_any(obj, names, &nm);
    if (!v || json_is_null(v)) {
        snprintf(buf, cap, "%s", def);
        return 0;
    }
    if (!json_is_string(v)) {
        df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be a string (got %s)", r->path,
                r->where, nm, jtype(v));
        return -1;
    }
    if (strlen(json_string_value(v)) >= cap) {
        df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' is too long (\"%.64s...\")", r->path,
                r->where, nm, json_string_value(v));
        return -1;
    }
    snprintf(buf, cap, "%s", json_string_value(v));
    return 1;
}

/* Token ids: an integer, null (-> def), or a list whose first entry counts
 * (some configs list several eos ids). Read from obj, else from the root. */
static int get_token(reader *r, const char *name, int def, int *out) {
    json_t *obj = json_object_get(r->obj, name) ? r->obj : r->root;
    json_t *v = json_object_get(obj, name);
    const char *where = obj == r->obj ? r->where : "";
    if (json_is_array(v)) {
        if (json_array_size(v) == 0) {
            *out = def;
            return 0;
        }
        v = json_array_get(v, 0);
    }
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < -1 || json_integer_value(v) > INT_MAX) {
        df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be a token id (got %s)", r->path,
                where, name, jtype(v));
        return -1;
    }
    *out = (int)json_integer_value(v);
    return 1;
}

/* ---- 2. architecture -------------------------------------------------------- */

static int has_arch(json_t *obj, const char *name) {
    json_t *a = json_object_get(obj, "architectures");
    if (!json_is_array(a)) return 0;
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *s = json_array_get(a, i);
        if (json_is_string(s) && strcmp(json_string_value(s), name) == 0) return 1;
    }
    return 0;
}

static df_status pick_arch(reader *r, df_config *c) {
    json_t *rmt = json_object_get(r->root, "model_type");
    json_t *tmt = r->obj != r->root ? json_object_get(r->obj, "model_type") : NULL;
    if (rmt && !json_is_string(rmt))
        return df_fail(r->err, DF_ERR_CONFIG, "%s: field 'model_type' must be a string (got %s)",
                       r->path, jtype(rmt));
    if (tmt && !json_is_string(tmt))
        return df_fail(r->err, DF_ERR_CONFIG,
                       "%s: field 'text_config.model_type' must be a string (got %s)", r->path,
                       jtype(tmt));
    const char *root_mt = rmt ? json_string_value(rmt) : "";
    const char *mt = tmt ? json_string_value(tmt) : root_mt;
    snprintf(c->model_type, sizeof c->model_type, "%s", mt);
    if (strcmp(root_mt, "kimi_k3") == 0) {
        c->arch = ARCH_KIMI_K3;
        return DF_OK;
    }
    if (strcmp(mt, "deepseek_v3") == 0 || strcmp(mt, "kimi_k2") == 0) {
        c->arch = ARCH_DEEPSEEK_V3;
        return DF_OK;
    }
    if (strcmp(mt, "kimi_linear") == 0) {
        c->arch = ARCH_KIMI_LINEAR;
        return DF_OK;
    }
    if (strcmp(mt, "deepseek_v2") == 0)
        return df_fail(r->err, DF_ERR_UNSUPPORTED,
                       "%s: model_type 'deepseek_v2' is not supported (DeepSeek-V3, Kimi-K2, "
                       "Kimi-Linear and Kimi-K3 are)",
                       r->path);
    if (has_arch(r->obj, "DeepseekV3ForCausalLM") || has_arch(r->root, "DeepseekV3ForCausalLM")) {
        c->arch = ARCH_DEEPSEEK_V3;
        return DF_OK;
    }
    return df_fail(r->err, DF_ERR_UNSUPPORTED,
                   "%s: model_type '%s' is not supported (expected deepseek_v3, kimi_k2, "
                   "kimi_linear or kimi_k3, or architectures [\"DeepseekV3ForCausalLM\"])",
                   r->path, mt);
}

/* ---- 3. fields and defaults ------------------------------------------------- */

/* Each field with its spellings and DeepseekV3Config default. */
typedef struct {
    const char *const *names;
    int *dst;
    int def;
} int_field;

static df_status read_fields(reader *r, df_config *c, int *has_kv_heads) {
    json_t *o = r->obj;
    int kimi = c->arch != ARCH_DEEPSEEK_V3;
    /* Required: no default makes sense for the sizes of a real checkpoint. */
    static const char *const required[] = {"hidden_size", "num_hidden_layers",
                                           "num_attention_heads", "vocab_size"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        json_t *v = json_object_get(o, required[i]);
        if (!v || json_is_null(v))
            return df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' is missing (required)",
                           r->path, r->where, required[i]);
    }
    const int_field ints[] = {
        {NAMES("vocab_size"), &c->vocab_size, 129280},
        {NAMES("hidden_size"), &c->hidden_size, 7168},
        {NAMES("intermediate_size"), &c->intermediate_size, 18432},
        {NAMES("moe_intermediate_size"), &c->moe_intermediate_size, 2048},
        {NAMES("num_hidden_layers"), &c->num_hidden_layers, 61},
        {NAMES("num_attention_heads"), &c->num_attention_heads, 128},
        {NAMES("n_shared_experts", "num_shared_experts"), &c->n_shared_experts, 1},
        {NAMES("n_routed_experts", "num_experts"), &c->n_routed_experts, 256},
        {NAMES("kv_lora_rank"), &c->kv_lora_rank, 512},
        {NAMES("qk_rope_head_dim"), &c->qk_rope_head_dim, 64},
        {NAMES("v_head_dim"), &c->v_head_dim, 128},
        {NAMES("qk_nope_head_dim"), &c->qk_nope_head_dim, 128},
        /* Kimi-Linear's own defaults are 1/1/1 (K3 sets them explicitly). */
        {NAMES("n_group", "num_expert_group"), &c->n_group, kimi ? 1 : 8},
        {NAMES("topk_group"), &c->topk_group, kimi ? 1 : 4},
        {NAMES("num_experts_per_tok", "num_experts_per_token"), &c->num_experts_per_tok, 8},
        {NAMES("first_k_dense_replace"), &c->first_k_dense_replace, kimi ? 1 : 3},
        {NAMES("moe_layer_freq"), &c->moe_layer_freq, 1},
        {NAMES("max_position_embeddings"), &c->max_position_embeddings, 4096},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (get_int(r, o, ints[i].names, ints[i].def, ints[i].dst) < 0) return DF_ERR_CONFIG;

    /* num_key_value_heads: None means num_attention_heads. */
    int got = get_int(r, o, NAMES("num_key_value_heads"), 0, &c->num_key_value_heads);
    if (got < 0) return DF_ERR_CONFIG;
    *has_kv_heads = got;
    if (!got) c->num_key_value_heads = c->num_attention_heads;

    /* q_lora_rank: absent -> 1536; null -> 0 (plain q_proj). */
    json_t *q = json_object_get(o, "q_lora_rank");
    if (q && json_is_null(q))
        c->q_lora_rank = 0;
    else if (get_int(r, o, NAMES("q_lora_rank"), 1536, &c->q_lora_rank) < 0)
        return DF_ERR_CONFIG;

    if (get_bool(r, o, NAMES("norm_topk_prob", "moe_renormalize"), 1, &c->norm_topk_prob) < 0 ||
        get_num(r, o, NAMES("routed_scaling_factor"), 2.5, &c->routed_scaling_factor) < 0 ||
        get_num(r, o, NAMES("rms_norm_eps"), 1e-6, &c->rms_norm_eps) < 0 ||
        get_str(r, o, NAMES("hidden_act"), "silu", c->hidden_act, sizeof c->hidden_act) < 0)
        return DF_ERR_CONFIG;

    if (get_token(r, "bos_token_id", 0, &c->bos_token_id) < 0 ||
        get_token(r, "eos_token_id", 1, &c->eos_token_id) < 0 ||
        get_token(r, "pad_token_id", -1, &c->pad_token_id) < 0)
        return DF_ERR_CONFIG;
    json_t *tie_obj = json_object_get(o, "tie_word_embeddings") ? o : r->root;
    reader rt = *r;
    if (tie_obj == r->root) rt.where = "";
    if (get_bool(&rt, tie_obj, NAMES("tie_word_embeddings"), 0, &c->tie_word_embeddings) < 0)
        return DF_ERR_CONFIG;

    /* Router scoring: DeepSeek's scoring_func, Kimi's moe_router_activation_func. */
    char sf[32];
    if (get_str(r, o, NAMES("scoring_func", "moe_router_activation_func"), "sigmoid", sf,
                sizeof sf) < 0)
        return DF_ERR_CONFIG;
    if (strcmp(sf, "sigmoid") == 0)
        c->scoring_sigmoid = 1;
    else if (strcmp(sf, "softmax") == 0)
        c->scoring_sigmoid = 0;
    else
        return df_fail(r->err, DF_ERR_UNSUPPORTED,
                       "%s: field '%sscoring_func' is '%s' (sigmoid or softmax are supported)",
                       r->path, r->where, sf);
    char tm[32];
    if (get_str(r, o, NAMES("topk_method"), "noaux_tc", tm, sizeof tm) < 0) return DF_ERR_CONFIG;
    if (strcmp(tm, "noaux_tc") != 0 && strcmp(tm, "greedy") != 0)
        return df_fail(r->err, DF_ERR_UNSUPPORTED,
                       "%s: field '%stopk_method' is '%s' (noaux_tc or greedy are supported)",
                       r->path, r->where, tm);
    return DF_OK;
}

/* ---- 4. RoPE ------------------------------------------------------------------ */

static df_status read_rope(reader *r, df_config *c) {
    json_t *o = r->obj;
    if (get_num(r, o, NAMES("rope_theta"), 10000.0, &c->rope_theta) < 0 ||
        get_bool(r, o, NAMES("rope_interleave"), 1, &c->rope_interleave) < 0)
        return DF_ERR_CONFIG;
    c->rope_type = ROPE_DEFAULT;
    c->yarn_factor = 1.0;
    c->yarn_beta_fast = 32.0;
    c->yarn_beta_slow = 1.0;
    c->yarn_mscale = 1.0;
    c->yarn_mscale_all_dim = 0.0;
    c->yarn_original_max_pos = c->max_position_embeddings;

    /* transformers 5 writes rope_parameters; older files rope_scaling. As in
     * DeepseekV3Config, rope_scaling wins when both are set. */
    const char *key = "rope_scaling";
    json_t *rs = json_object_get(o, key);
    if (!rs || json_is_null(rs)) {
        key = "rope_parameters";
        rs = json_object_get(o, key);
    }
    if (!rs || json_is_null(rs)) return DF_OK;
    if (!json_is_object(rs))
        return df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be an object or null (got %s)",
                       r->path, r->where, key, jtype(rs));
    char where[64];
    snprintf(where, sizeof where, "%s%s.", r->where, key);
    reader rr = *r;
    rr.where = where;
    char type[32];
    if (get_str(&rr, rs, NAMES("rope_type", "type"), "default", type, sizeof type) < 0)
        return DF_ERR_CONFIG;
    if (get_num(&rr, rs, NAMES("rope_theta"), c->rope_theta, &c->rope_theta) < 0)
        return DF_ERR_CONFIG;
    if (strcmp(type, "default") == 0) return DF_OK;
    if (strcmp(type, "yarn") != 0)
        return df_fail(r->err, DF_ERR_UNSUPPORTED,
                       "%s: field '%srope_type' is '%s' (default and yarn are supported)", r->path,
                       where, type);
    c->rope_type = ROPE_YARN;
    if (!json_object_get(rs, "factor"))
        return df_fail(r->err, DF_ERR_CONFIG, "%s: field '%sfactor' is missing (required for yarn)",
                       r->path, where);
    if (get_num(&rr, rs, NAMES("factor"), 1.0, &c->yarn_factor) < 0 ||
        get_num(&rr, rs, NAMES("beta_fast"), 32.0, &c->yarn_beta_fast) < 0 ||
        get_num(&rr, rs, NAMES("beta_slow"), 1.0, &c->yarn_beta_slow) < 0 ||
        get_num(&rr, rs, NAMES("mscale"), 1.0, &c->yarn_mscale) < 0 ||
        get_num(&rr, rs, NAMES("mscale_all_dim"), 0.0, &c->yarn_mscale_all_dim) < 0 ||
        get_int(&rr, rs, NAMES("original_max_position_embeddings"), c->max_position_embeddings,
                &c->yarn_original_max_pos) < 0)
        return DF_ERR_CONFIG;
    if (!(c->yarn_factor >= 1.0 && c->yarn_factor <= 1e4))
        return df_fail(r->err, DF_ERR_CONFIG,
                       "%s: field '%sfactor' must be between 1 and 10000 (got %g)", r->path, where,
                       c->yarn_factor);
    if (c->yarn_original_max_pos <= 0)
        return df_fail(r->err, DF_ERR_CONFIG,
                       "%s: field '%soriginal_max_position_embeddings' must be a positive integer "
                       "(got %d)",
                       r->path, where, c->yarn_original_max_pos);
    if (!isfinite(c->yarn_beta_fast) || !isfinite(c->yarn_beta_slow) ||
        !isfinite(c->yarn_mscale) || !isfinite(c->yarn_mscale_all_dim) || c->yarn_mscale < 0 ||
        c->yarn_mscale_all_dim < 0)
        return df_fail(r->err, DF_ERR_CONFIG,
                       "%s: fields '%sbeta_fast/beta_slow/mscale/mscale_all_dim' must be finite "
                       "and mscale* >= 0",
                       r->path, where);
    return DF_OK;
}

/* ---- 5. quantisation ------------------------------------------------------ */

static df_status read_quant(reader *r, df_config *c) {
    const char *where = r->where;
    json_t *q = json_object_get(r->obj, "quantization_config");
    if ((!q || json_is_null(q)) && r->obj != r->root) {
        q = json_object_get(r->root, "quantization_config");
        where = "";
    }
    c->quant = QUANT_NONE;
    c->fp8_block_rows = c->fp8_block_cols = 0;
    if (!q || json_is_null(q)) return DF_OK;
    char w[64];
    snprintf(w, sizeof w, "%squantization_config.", where);
    if (!json_is_object(q))
        return df_fail(r->err, DF_ERR_CONFIG, "%s: field '%squantization_config' must be an object (got %s)",
                       r->path, where, jtype(q));
    reader rq = *r;
    rq.where = w;
    char method[48];
    if (get_str(&rq, q, NAMES("quant_method"), "", method, sizeof method) < 0) return DF_ERR_CONFIG;
    if (strcmp(method, "fp8") == 0) {
        json_t *bs = json_object_get(q, "weight_block_size");
        if (!json_is_array(bs) || json_array_size(bs) != 2 ||
            !json_is_integer(json_array_get(bs, 0)) || !json_is_integer(json_array_get(bs, 1)))
            return df_fail(r->err, DF_ERR_UNSUPPORTED,
                           "%s: field '%sweight_block_size' must be [rows, cols] (fp8 without "
                           "block scales is not supported)",
                           r->path, w);
        json_int_t br = json_integer_value(json_array_get(bs, 0));
        json_int_t bc = json_integer_value(json_array_get(bs, 1));
        if (br <= 0 || bc <= 0 || br > 65536 || bc > 65536)
            return df_fail(r->err, DF_ERR_CONFIG,
                           "%s: field '%sweight_block_size' must hold two positive integers "
                           "(got [%lld, %lld])",
                           r->path, w, (long long)br, (long long)bc);
        c->quant = QUANT_FP8_BLOCK;
        c->fp8_block_rows = (int)br;
        c->fp8_block_cols = (int)bc;
        return DF_OK;
    }
    if (strcmp(method, "compressed-tensors") == 0) {
        char fmt[48];
        if (get_str(&rq, q, NAMES("format"), "", fmt, sizeof fmt) < 0) return DF_ERR_CONFIG;
        /* The format may also sit only in the first config group. */
        json_t *groups = json_object_get(q, "config_groups");
        json_t *g0 = NULL;
        if (json_is_object(groups)) {
            const char *k;
            json_t *v;
            json_object_foreach(groups, k, v) {
                g0 = v;
                break;
            }
        }
        if (!fmt[0] && json_is_object(g0)) {
            json_t *f = json_object_get(g0, "format");
            if (json_is_string(f)) snprintf(fmt, sizeof fmt, "%s", json_string_value(f));
        }
        if (strcmp(fmt, "pack-quantized") == 0)
            c->quant = QUANT_CT_INT4;
        else if (strcmp(fmt, "mxfp4-pack-quantized") == 0)
            c->quant = QUANT_CT_MXFP4;
        else
            return df_fail(r->err, DF_ERR_UNSUPPORTED,
                           "%s: field '%sformat' is '%s' (compressed-tensors pack-quantized and "
                           "mxfp4-pack-quantized are supported)",
                           r->path, w, fmt);
        /* Both layouts are 4-bit with groups of 32 along the input. */
        json_t *wq = json_is_object(g0) ? json_object_get(g0, "weights") : NULL;
        if (json_is_object(wq)) {
            json_t *nb = json_object_get(wq, "num_bits"), *gs = json_object_get(wq, "group_size");
            if ((json_is_integer(nb) && json_integer_value(nb) != 4) ||
                (json_is_integer(gs) && json_integer_value(gs) != 32))
                return df_fail(r->err, DF_ERR_UNSUPPORTED,
                               "%s: %s weights are %lld-bit with group_size %lld (4-bit, group 32 "
                               "supported)",
                               r->path, fmt, json_is_integer(nb) ? (long long)json_integer_value(nb) : 4LL,
                               json_is_integer(gs) ? (long long)json_integer_value(gs) : 32LL);
        }
        return DF_OK;
    }
    return df_fail(r->err, DF_ERR_UNSUPPORTED,
                   "%s: field '%squant_method' is '%s' (fp8 with weight_block_size and "
                   "compressed-tensors are supported)",
                   r->path, w, method);
}

/* ---- 6. validation ---------------------------------------------------------- */

static df_status need_range(reader *r, const char *field, long long v, long long lo, long long hi) {
    if (v >= lo && v <= hi) return DF_OK;
    if (lo == 1)
        return df_fail(r->err, DF_ERR_CONFIG,
                       "%s: field '%s%s' must be a positive integer <= %lld (got %lld)", r->path,
                       r->where, field, hi, v);
    return df_fail(r->err, DF_ERR_CONFIG, "%s: field '%s%s' must be in [%lld, %lld] (got %lld)",
                   r->path, r->where, field, lo, hi, v);
}

static df_status validate(reader *r, const df_config *c) {
    df_status st;
#define RANGE(f, lo, hi)                                                      \
    if ((st = need_range(r, #f, c->f, lo, hi)) != DF_OK) return st
    RANGE(vocab_size, 1, 4 << 20);
    RANGE(hidden_size, 1, 65536);
    RANGE(num_hidden_layers, 1, DF_MAX_LAYERS);
    RANGE(num_attention_heads, 1, 4096);
    RANGE(num_key_value_heads, 1, 4096);
    RANGE(n_routed_experts, 0, 65536);
    RANGE(n_shared_experts, 0, 256);
    RANGE(first_k_dense_replace, 0, c->num_hidden_layers);
    RANGE(moe_layer_freq, 1, 1024);
    RANGE(q_lora_rank, 0, 65536);
    RANGE(kv_lora_rank, 1, 65536);
    RANGE(qk_nope_head_dim, 0, 4096);
    RANGE(qk_rope_head_dim, 0, 4096);
    RANGE(v_head_dim, 1, 4096);
    RANGE(max_position_embeddings, 1, 1 << 26);
    if (c->first_k_dense_replace > 0 || c->n_routed_experts == 0) {
        RANGE(intermediate_size, 1, 1 << 20);
    }
    if (c->n_routed_experts > 0) {
        RANGE(moe_intermediate_size, 1, 1 << 20);
        RANGE(num_experts_per_tok, 1, c->n_routed_experts);
        RANGE(n_group, 1, c->n_routed_experts);
        RANGE(topk_group, 1, c->n_group);
        if (c->n_routed_experts % c->n_group != 0)
            return df_fail(r->err, DF_ERR_CONFIG,
                           "%s: field '%sn_group' (%d) must divide n_routed_experts (%d)", r->path,
                           r->where, c->n_group, c->n_routed_experts);
    }
#undef RANGE
    if (c->qk_rope_head_dim % 2)
        return df_fail(r->err, DF_ERR_CONFIG, "%s: field '%sqk_rope_head_dim' must be even (got %d)",
                       r->path, r->where, c->qk_rope_head_dim);
    if (c->qk_nope_head_dim + c->qk_rope_head_dim <= 0)
        return df_fail(r->err, DF_ERR_CONFIG,
                       "%s: fields '%sqk_nope_head_dim' + 'qk_rope_head_dim' must be positive",
                       r->path, r->where);
    if (!(c->rms_norm_eps > 0 && c->rms_norm_eps < 1))
        return df_fail(r->err, DF_ERR_CONFIG, "%s: field '%srms_norm_eps' must be in (0, 1) (got %g)",
                       r->path, r->where, c->rms_norm_eps);
    if (!(c->routed_scaling_factor > 0 && c->routed_scaling_factor < 1e6))
        return df_fail(r->err, DF_ERR_CONFIG,
                       "%s: field '%srouted_scaling_factor' must be positive (got %g)", r->path,
                       r->where, c->routed_scaling_factor);
    if (!(c->rope_theta > 0 && isfinite(c->rope_theta)))
        return df_fail(r->err, DF_ERR_CONFIG, "%s: field '%srope_theta' must be positive (got %g)",
                       r->path, r->where, c->rope_theta);
    /* the Kimi family's activations (silu, K3's situ) are checked by cfg_load_kimi */
    if (c->arch == ARCH_DEEPSEEK_V3 && strcmp(c->hidden_act, "silu") != 0)
        return df_fail(r->err, DF_ERR_UNSUPPORTED,
                       "%s: field '%shidden_act' is '%s' (DeepSeek-V3 / Kimi-K2 use silu; situ is a "
                       "Kimi K3 activation)",
                       r->path, r->where, c->hidden_act);
    return DF_OK;
}

/* ---- 7. cfg_load ---------------------------------------------------------- */

/* On error *c holds whatever was parsed before the failure; callers must not
 * use it. */
df_status cfg_load(const char *dir, const df_io *io, df_config *c, char *err) {
    if (!io) io = df_io_default();
    memset(c, 0, sizeof *c);
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s%sconfig.json", dir,
                         *dir && dir[strlen(dir) - 1] == '/' ? "" : "/") >= sizeof path)
        return df_fail(err, DF_ERR_ARG, "%s: directory name too long", dir);
    size_t len = 0;
    char *text = io_read_text(io, path, CFG_MAX_BYTES, &len);
    if (!text) {
        if (errno == ENOENT) return df_fail(err, DF_ERR_CONFIG, "%s: not found", path);
        return df_fail(err, DF_ERR_IO, "%s: cannot read: %s", path, strerror(errno));
    }
    json_error_t je;
    json_t *root = json_loadb(text, len, 0, &je);
    free(text);
    if (!root)
        return df_fail(err, DF_ERR_CONFIG, "%s: not valid JSON (line %d, column %d: %s)", path,
                       je.line, je.column, je.text);
    df_status st = DF_OK;
    if (!json_is_object(root)) {
        st = df_fail(err, DF_ERR_CONFIG, "%s: expected a JSON object, got %s", path, jtype(root));
        goto done;
    }
    reader r = {root, root, "", path, err};
    json_t *tc = json_object_get(root, "text_config");
    if (tc && !json_is_null(tc)) {
        if (!json_is_object(tc)) {
            st = df_fail(err, DF_ERR_CONFIG, "%s: field 'text_config' must be an object (got %s)",
                         path, jtype(tc));
            goto done;
        }
        r.obj = tc;
        r.where = "text_config.";
        c->nested_text_config = 1;
    }
    int has_kv = 0;
    if ((st = pick_arch(&r, c)) != DF_OK || (st = read_fields(&r, c, &has_kv)) != DF_OK ||
        (st = read_rope(&r, c)) != DF_OK || (st = read_quant(&r, c)) != DF_OK ||
        (st = validate(&r, c)) != DF_OK)
        goto done;
    /* The Kimi-Linear / K3 fields live in config_kimi.c. */
    if (c->arch != ARCH_DEEPSEEK_V3 && (st = cfg_load_kimi(r.obj, path, c, err)) != DF_OK)
        goto done;
    if (c->nested_text_config) {
        snprintf(c->prefix, sizeof c->prefix, "language_model.model.");
        snprintf(c->lm_head, sizeof c->lm_head, "language_model.lm_head.weight");
    } else {
        snprintf(c->prefix, sizeof c->prefix, "model.");
        snprintf(c->lm_head, sizeof c->lm_head, "lm_head.weight");
    }
done:
    json_decref(root);
    return st;
}

int cfg_is_moe_layer(const df_config *c, int layer) {
    return c->n_routed_experts > 0 && layer >= c->first_k_dense_replace && layer >= 0 &&
           layer < c->num_hidden_layers && layer % c->moe_layer_freq == 0;
}
