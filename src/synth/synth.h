/* synth.h — synthetic checkpoints with random weights (prefix sy_).
 *
 * `deltafin synth` writes a model directory in the official Hugging Face
 * layout of a supported family (config.json, model.safetensors or
 * model-0000i-of-0000n.safetensors + model.safetensors.index.json) whose
 * weights are random but drawn so activations stay finite, so the engine can
 * load and run it. Two steps:
 *
 *   sy_plan_new   resolves the options into model sizes (a preset, then the
 *                 overrides, then --gb sizing), the config.json text and the
 *                 full tensor inventory: names, dtypes, shapes, how each
 *                 tensor's values are drawn, and which shard holds it at
 *                 which offset. No I/O.
 *   sy_plan_tokenizer (optional) picks a source tokenizer's tokens that fit
 *                 the vocabulary and K3's special tokens at config.json's
 *                 ids (vocab.c); sy_write then writes tiktoken.model and
 *                 tokenizer_config.json too, so the text path runs.
 *   sy_write      creates the directory and streams every shard out in
 *                 fixed chunks (never a full-size buffer), on a thread pool;
 *                 with `sparse` only the headers (and the 16-byte int4
 *                 weight_shape vectors the loader checks) are written and
 *                 the data regions are left as holes.
 *
 * Determinism: a tensor's bytes depend only on the seed, its name, its
 * generator and its size, never on the thread count, the shard layout or the
 * other tensors.
 *
 * Ownership: the plan owns its inventory and config text; sy_write borrows
 * the plan. Nothing here prints or exits; errors come back as a df_status and
 * one line in a DF_ERRMSG buffer.
 */
#ifndef DF_SYNTH_SYNTH_H
#define DF_SYNTH_SYNTH_H
#include "deltafin.h"
#include "../format/dtype.h"
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef enum { SY_DEEPSEEK_V3 = 1, SY_KIMI_K2, SY_KIMI_LINEAR, SY_KIMI_K3 } sy_arch;
typedef enum { SY_TINY = 1, SY_K3_SLICE, SY_FULL } sy_preset;

typedef struct {
    sy_arch arch;
    sy_preset preset;
    int layers;          /* 0: the preset's */
    int experts;         /* routed experts per MoE layer; 0: the preset's (or --gb) */
    int vocab;           /* 0: the preset's */
    int dense_inter;     /* intermediate size of the dense layers; 0: the preset's */
    double gb;           /* > 0: choose the expert count so the total is about gb x 1e9 bytes */
    uint64_t seed;
    int64_t shard_size;  /* bytes per shard; 0: the preset's default */
    int sparse;          /* headers only (+ int4 weight_shape), data regions left as holes */
    st_dtype dtype;      /* DT_BF16 (default, 0 means it) or DT_F32 for unquantised weights */
    int threads;         /* writer threads; 0: one per online CPU */
    int overwrite;       /* replace an existing checkpoint in the directory */
} sy_opts;

const char *sy_arch_name(sy_arch a);
const char *sy_preset_name(sy_preset p);
/* "kimi_k3" -> SY_KIMI_K3 etc.; 0 if unknown. */
sy_arch sy_arch_from_name(const char *s);
sy_preset sy_preset_from_name(const char *s);

/* The resolved sizes (field names follow DeepseekV3Config / K3's config). */
typedef struct {
    int vocab, hidden, inter, moe_inter, layers, heads;
    int experts, topk, shared, n_group, topk_group, first_dense;
    double routed_scale, eps;
    int q_lora, kv_lora, nope, rope, v;
    int kda_heads, kda_dim, conv;         /* Kimi-Linear / K3 */
    int latent;                           /* K3 routed_expert_hidden_size; 0: none */
    int attn_res_block;                   /* K3 attn_res_block_size; 0: none */
    int max_pos;
    double rope_theta;
    int yarn;                             /* Kimi-K2 YaRN rope_scaling */
} sy_dims;

typedef struct {
    sy_dims d;
    int64_t n_tensors;
    int64_t total_bytes;     /* sum of tensor bytes (metadata.total_size) */
    int64_t expert_bytes;    /* all routed experts */
    int64_t expert_span;     /* one routed expert, as stored */
    int n_moe_layers, n_shards;
    int64_t shard_size;      /* the size the layout was cut with */
    char notes[512];         /* adjustments the plan made, "" if none */
} sy_summary;

typedef struct sy_plan sy_plan;

/* Builds the plan. On error *out is NULL and err names the option. */
df_status sy_plan_new(const sy_opts *o, sy_plan **out, char *err);
void sy_plan_free(sy_plan *p);
const sy_summary *sy_plan_summary(const sy_plan *p);
/* Human-readable description of the plan (a few lines). */
void sy_plan_describe(const sy_plan *p, char *buf, size_t cap);
/* The config.json text. */
const char *sy_plan_config(const sy_plan *p);

/* Adds a tokenizer to the plan (vocab.c): src is a tiktoken rank file, a
 * tokenizer.json or a model directory; its 256 single bytes and lowest
 * multi-byte ids fill ids 0..vocab-257, K3's special tokens the last 256
 * ids, where config.json's bos/eos/pad ids point. Kimi families only. On
 * error the plan is unchanged and err names the option or the file. */
df_status sy_plan_tokenizer(sy_plan *p, const char *src, char *err);

/* Writer I/O (SQLite-style indirection so tests can inject failures). */
typedef struct {
    int (*open)(const char *path, int flags, int mode);
    int (*close)(int fd);
    ssize_t (*pwrite)(int fd, const void *buf, size_t n, off_t off);
    int (*ftruncate)(int fd, off_t len);
    int (*mkdir)(const char *path, int mode);
    int (*unlink)(const char *path);
    int (*fdatasync)(int fd); /* each shard, once written */
} sy_io;
const sy_io *sy_io_default(void);

/* Writes the checkpoint into dir (created if absent). Refuses a directory
 * that already holds a config.json or *.safetensors unless opts.overwrite,
 * which first removes those files and the index (and a tokenizer.json when
 * the plan has a tokenizer, which replaces tiktoken.model and
 * tokenizer_config.json). *data_bytes (optional)
 * receives the tensor bytes generated (0 when sparse). On error the
 * directory holds a partial checkpoint without config.json (written last),
 * which the engine refuses to open. */
df_status sy_write(const sy_plan *p, const char *dir, const sy_io *io, int64_t *data_bytes,
                   char *err);

/* ---- internals shared by plan.c and write.c ---- */

typedef enum {
    SY_GEN_NORMAL = 1,   /* a + b * N(0,1)            (F32, BF16) */
    SY_GEN_LOGUNIF,      /* log(U(a, b)); with i0 > 0 only the first i0 values, the rest 0 (F32, BF16) */
    SY_GEN_BYTES,        /* uniform random bytes: MXFP4 e2m1 code pairs (U8) */
    SY_GEN_E8M0,         /* i0, or i0 + 1 with probability i1/256: MXFP4 scales (U8) */
    SY_GEN_INT4,         /* 8 nibbles q+8 per word, q in [-7, 7] (I32) */
    SY_GEN_INT4_SCALE,   /* a * U(0.75, 1.25)         (BF16) */
    SY_GEN_SHAPE         /* [i0, i1] (I64): compressed-tensors weight_shape */
} sy_gen;

typedef struct {
    const char *name;    /* in the plan's arena */
    st_dtype dtype;
    int ndim;
    int64_t shape[4];
    int64_t nbytes;
    uint8_t gen;         /* sy_gen */
    float a, b;
    int64_t i0, i1;
    int group;           /* layer index for routed-expert tensors (kept in one shard), else -1 */
    int shard;
    int64_t offset;      /* from the start of the shard's data section */
} sy_tensor;

/* One output shard: its file name and its tensors in data order. */
typedef struct {
    char file[48];
    int64_t first, count;  /* range of the plan's order[] */
    int64_t data_bytes;
} sy_shard;

struct sy_plan {
    sy_opts o;
    sy_summary s;
    char prefix[32];      /* "model." or "language_model.model." */
    char head[48];        /* the lm_head tensor's full name */
    char *config;         /* config.json text (malloc'd) */
    sy_tensor *t;         /* inventory in layout order */
    int64_t n, cap;
    int64_t *order;       /* tensor indices, shard by shard, each in data order */
    sy_shard *shards;
    struct sy_arena *arena;
    int oom;              /* set when an allocation failed while building */
    char *tok_ranks;      /* tiktoken.model text (malloc'd), NULL: no tokenizer */
    size_t tok_ranks_n;
    char *tok_config;     /* tokenizer_config.json text (malloc'd) */
    char tok_note[512];   /* one line for sy_plan_describe */
};

/* Bytes [chunk * SY_CHUNK, chunk * SY_CHUNK + nbytes) of tensor t into out.
 * The bytes depend only on the seed, t's name and generator, and their
 * position in the tensor: a chunk is the same whichever thread makes it. */
enum { SY_CHUNK = 4 << 20 }; /* bytes per generated chunk (a multiple of 8) */
void sy_fill(const sy_tensor *t, uint64_t seed, int64_t chunk, void *out, int64_t nbytes);
/* The safetensors header of shard i (length prefix excluded), padded with
 * spaces to a multiple of 8; malloc'd, *len set. NULL if out of memory. */
char *sy_header(const sy_plan *p, int shard, size_t *len);
#endif
