/* config_kimi.c — the Kimi-Linear / K3 fields of config.json (cfg_load_kimi).
 *
 * Reads linear_attn_config (KDA shape, the 1-based kda_layers and
 * full_attn_layers lists, full-rank gate, gate lower bound), the MLA output
 * gate, attention residuals, SiTU betas and the latent MoE size (any of
 * them makes the model K3, whatever model_type says). Refuses
 * layer lists that overlap or leave a gap, unknown activations and absurd
 * sizes, naming the field. Reads no weights.
 */
#include "config.h"
#include "../base/err.h"
#include <jansson.h>
#include <string.h>

static int get_int(json_t *o, const char *k, int def, int *out) {
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_integer(v)) return -1;
    json_int_t x = json_integer_value(v);
    if (x < -(1 << 30) || x > (1 << 30)) return -1;
    *out = (int)x;
    return 0;
}

static int get_num(json_t *o, const char *k, double def, double *out, int *present) {
    json_t *v = json_object_get(o, k);
    if (present) *present = v && !json_is_null(v);
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_number(v)) return -1;
    *out = json_number_value(v);
    return 0;
}

static int get_bool(json_t *o, const char *k, int def, int *out) {
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) { *out = def; return 0; }
    if (!json_is_boolean(v)) return -1;
    *out = json_is_true(v);
    return 0;
}


/* Marks the layers of a 1-based list with `mark`; refuses duplicates. */
static df_status mark_layers(json_t *lac, const char *key, const char *path, df_config *c,
                             unsigned char *seen, int mark, char *err) {
    json_t *a = json_object_get(lac, key);
    if (!a || json_is_null(a)) return DF_OK;
    if (!json_is_array(a))
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'linear_attn_config.%s' must be a list of layer numbers", path, key);
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v))
            return df_fail(err, DF_ERR_CONFIG, "%s: field 'linear_attn_config.%s' must hold integers", path, key);
        json_int_t l = json_integer_value(v);
        if (l < 1 || l > c->num_hidden_layers)
            return df_fail(err, DF_ERR_CONFIG,
                           "%s: field 'linear_attn_config.%s' names layer %lld; layers are numbered 1..%d",
                           path, key, (long long)l, c->num_hidden_layers);
        if (seen[l - 1])
            return df_fail(err, DF_ERR_CONFIG,
                           "%s: field 'linear_attn_config.%s': layer %lld is listed twice (kda_layers and "
                           "full_attn_layers must not overlap)",
                           path, key, (long long)l);
        seen[l - 1] = 1;
        c->is_kda[l - 1] = (unsigned char)mark;
    }
    return DF_OK;
}

df_status cfg_load_kimi(json_t *tc, const char *path, df_config *c, char *err) {
    json_t *lac = json_object_get(tc, "linear_attn_config");
    if (!json_is_object(lac))
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'linear_attn_config' is missing (Kimi-Linear and K3 need it)", path);
    if (c->num_hidden_layers > DF_MAX_LAYERS)
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'num_hidden_layers' is above %d", path, DF_MAX_LAYERS);
    if (get_int(lac, "num_heads", c->num_attention_heads, &c->kda_num_heads) || c->kda_num_heads <= 0 ||
        c->kda_num_heads > 4096)
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'linear_attn_config.num_heads' must be a positive integer", path);
    if (get_int(lac, "head_dim", 0, &c->kda_head_dim) || c->kda_head_dim <= 0 || c->kda_head_dim > 1024)
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'linear_attn_config.head_dim' must be a positive integer", path);
    if (get_int(lac, "short_conv_kernel_size", 4, &c->kda_conv_kernel) || c->kda_conv_kernel < 1 ||
        c->kda_conv_kernel > 16)
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'linear_attn_config.short_conv_kernel_size' must be 1..16", path);
    if (get_bool(lac, "use_full_rank_gate", 0, &c->kda_full_rank_gate))
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'linear_attn_config.use_full_rank_gate' must be true or false", path);
    if (get_num(lac, "gate_lower_bound", 0, &c->kda_lower_bound, &c->kda_has_lower_bound) ||
        (c->kda_has_lower_bound && c->kda_lower_bound >= 0))
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'linear_attn_config.gate_lower_bound' must be a negative number", path);

    unsigned char seen[DF_MAX_LAYERS];
    memset(seen, 0, sizeof seen);
    memset(c->is_kda, 0, sizeof c->is_kda);
    df_status st;
    if ((st = mark_layers(lac, "kda_layers", path, c, seen, 1, err))) return st;
    if ((st = mark_layers(lac, "full_attn_layers", path, c, seen, 0, err))) return st;
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (!seen[l])
            return df_fail(err, DF_ERR_CONFIG,
                           "%s: layer %d (1-based) is in neither linear_attn_config.kda_layers nor "
                           "full_attn_layers",
                           path, l + 1);

    if (get_bool(tc, "mla_use_output_gate", 0, &c->mla_use_output_gate))
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'mla_use_output_gate' must be true or false", path);
    if (get_bool(tc, "mla_use_nope", 1, &c->mla_use_nope))
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'mla_use_nope' must be true or false", path);
    if (get_int(tc, "attn_res_block_size", 0, &c->attn_res_block_size) || c->attn_res_block_size < 0)
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'attn_res_block_size' must be a positive integer or null", path);
    int situ = strcmp(c->hidden_act, "situ") == 0;
    if (!situ && strcmp(c->hidden_act, "silu") != 0)
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'hidden_act' is '%s'; supported: silu, situ", path, c->hidden_act);
    int present;
    if (get_num(tc, "activation_situ_beta", 1.0, &c->situ_beta, &present) || c->situ_beta <= 0)
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'activation_situ_beta' must be a positive number", path);
    if (get_num(tc, "activation_situ_linear_beta", 0.0, &c->situ_linear_beta, &present) ||
        (present && c->situ_linear_beta <= 0))
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'activation_situ_linear_beta' must be a positive number or null", path);
    if (get_int(tc, "routed_expert_hidden_size", 0, &c->routed_expert_hidden_size) ||
        c->routed_expert_hidden_size < 0 || c->routed_expert_hidden_size > 65536)
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'routed_expert_hidden_size' must be a positive integer or null", path);
    if (get_bool(tc, "latent_moe_use_norm", 0, &c->latent_moe_use_norm))
        return df_fail(err, DF_ERR_CONFIG, "%s: field 'latent_moe_use_norm' must be true or false", path);
    /* Features follow the fields, never the root model_type: a text config
     * saved on its own by Moonshot's code says kimi_linear but carries K3's
     * fields, and is K3. */
    if (situ || c->attn_res_block_size > 0 || c->routed_expert_hidden_size > 0 || c->mla_use_output_gate)
        c->arch = ARCH_KIMI_K3;
    json_t *f = json_object_get(tc, "moe_router_activation_func");
    if (f && !json_is_null(f)) {
        const char *s = json_string_value(f);
        if (!s || (strcmp(s, "sigmoid") && strcmp(s, "softmax")))
            return df_fail(err, DF_ERR_CONFIG, "%s: field 'moe_router_activation_func' must be sigmoid or softmax", path);
        c->scoring_sigmoid = strcmp(s, "sigmoid") == 0;
    }
    return DF_OK;
}
