/* config.h — config.json -> df_config (prefix cfg_).
 *
 * Reads the DeepSeek-V3 / Kimi-K2.x fields (nested `text_config` accepted,
 * as Kimi-K2.5 and K3 write it), with defaults exactly as transformers'
 * DeepseekV3Config has them, validates ranges, and records the tensor-name
 * prefix the checkpoint uses. Refuses absurd or missing fields with a message
 * naming the field. Reads no weights.
 */
#ifndef DF_FORMAT_CONFIG_H
#define DF_FORMAT_CONFIG_H
#include "deltafin.h"
#include "../base/io.h"

enum { DF_MAX_LAYERS = 1024 };

typedef enum { ARCH_DEEPSEEK_V3 = 1, ARCH_KIMI_LINEAR, ARCH_KIMI_K3 } df_arch;
typedef enum { ROPE_NONE = 0, ROPE_DEFAULT, ROPE_YARN } df_rope_type;
typedef enum { QUANT_NONE = 0, QUANT_FP8_BLOCK, QUANT_CT_INT4, QUANT_CT_MXFP4 } df_quant;

typedef struct {
    df_arch arch;
    char model_type[64];          /* as written (root or text_config) */
    int nested_text_config;       /* 1 if fields came from text_config */

    int vocab_size, hidden_size, intermediate_size, moe_intermediate_size;
    int num_hidden_layers, num_attention_heads, num_key_value_heads;
    int n_routed_experts, num_experts_per_tok, n_shared_experts;
    int n_group, topk_group, first_k_dense_replace, moe_layer_freq;
    int norm_topk_prob;
    double routed_scaling_factor;
    int scoring_sigmoid;          /* 1 sigmoid (DeepSeek-V3), 0 softmax */
    int q_lora_rank;              /* 0 = plain q_proj */
    int kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    double rms_norm_eps;
    int max_position_embeddings;
    int bos_token_id, eos_token_id, pad_token_id;
    int tie_word_embeddings;
    char hidden_act[16];

    /* RoPE */
    df_rope_type rope_type;
    int rope_interleave;
    double rope_theta;
    double yarn_factor, yarn_beta_fast, yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim;
    int yarn_original_max_pos;

    /* Quantisation of stored weights */
    df_quant quant;
    int fp8_block_rows, fp8_block_cols;

    /* Tensor names: prefix of the decoder ("model." or "language_model.model.")
     * and full name of the head. */
    char prefix[64];
    char lm_head[96];

    /* Kimi-Linear / K3 (config_kimi.c) */
    int kda_num_heads, kda_head_dim, kda_conv_kernel;
    int kda_full_rank_gate;         /* linear_attn_config.use_full_rank_gate */
    int kda_has_lower_bound;        /* gate_lower_bound present */
    double kda_lower_bound;
    unsigned char is_kda[DF_MAX_LAYERS]; /* from the 1-based kda_layers list */
    int mla_use_output_gate, mla_use_nope;
    int attn_res_block_size;        /* 0: plain residuals */
    double situ_beta, situ_linear_beta; /* SiTU betas; linear 0 = up unchanged */
    int routed_expert_hidden_size;  /* 0: experts on the full hidden size */
    int latent_moe_use_norm;
} df_config;

/* Parses dir/config.json into *c. */
df_status cfg_load(const char *dir, const df_io *io, df_config *c, char *err);
/* Reads the Kimi-Linear / K3 fields from the object holding the model
 * fields (root or text_config); `path` names config.json in messages.
 * Called by cfg_load for ARCH_KIMI_LINEAR and ARCH_KIMI_K3. */
struct json_t;
df_status cfg_load_kimi(struct json_t *tc, const char *path, df_config *c, char *err);
/* 1 if layer i (0-based) has a routed MoE block. */
int cfg_is_moe_layer(const df_config *c, int layer);
#endif
