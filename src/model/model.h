/* model.h — the engine and session internals shared by the model programs.
 *
 * An engine owns the parsed config, the shard set, the thread pool and one
 * model program (a vtable + its weight views). A session owns the program's
 * per-timeline state (allocated once, at df_session_new, for max_ctx
 * positions and a fixed prefill chunk) and a logits row.
 */
#ifndef DF_MODEL_H
#define DF_MODEL_H
#include "deltafin.h"
#include "../base/io.h"
#include "../base/pool.h"
#include "../format/config.h"
#include "../format/safetensors.h"
#include "../format/weight.h"
#include "../kernels/kernels.h"

enum { DF_CHUNK = 32 }; /* positions per forward pass during prefill */
/* Positions per block of a layer-major prompt (forward_prompt) unless
 * df_engine_opts.prompt_block says otherwise. On the CPU 512: a block reads
 * each routed expert it uses once per layer (a 256-position block of a
 * 448-expert top-16 layer already uses nearly all of them, so 512 halves a
 * prompt's expert reads from disk) and gives ~18 rows an expert (the AMX
 * tiles pay off from 8), at ~0.5 GB of block buffers for K3 widths. With an
 * accelerator 512 too (H200, warm prompts of the 3-layer K3 slices: 1024
 * tokens of the 448-expert slice 0.136 s in 512-row blocks, 0.144 in 256;
 * 512 tokens of the 195-expert one 0.066 / 0.068 s. The 256 chosen before
 * had been measured on first warm prompts that paid the expert queue's
 * staging growth, bench/cuda_NOTES.md). */
enum { DF_PROMPT_BLOCK = 512, DF_PROMPT_BLOCK_MAX = 65536 };

typedef struct df_program df_program;

/* One session's part of a batched forward pass: n tokens at pos.. of its
 * state; out: NULL, or its logits rows (all n if all_rows, else the last). */
typedef struct {
    void *state;
    int pos;
    const int32_t *tokens;
    int n;
    float *out;
    int all_rows;
} df_fwd_seg;

/* What a model program provides. */
typedef struct {
    const char *name;
    /* Binds weights; returns the program state (owned, freed by close). */
    df_status (*open)(df_engine *e, void **prog, char *err);
    void (*close)(void *prog);
    /* Bytes of per-session state per context position, and fixed per session. */
    int64_t (*state_bytes_per_pos)(const df_engine *e);
    /* Bytes of per-session state that do not grow with the context (NULL: 0). */
    int64_t (*state_fixed_bytes)(const df_engine *e);
    /* Allocates session state for max_ctx positions (owned by the session). */
    df_status (*state_new)(df_engine *e, int max_ctx, void **state);
    void (*state_free)(void *state);
    /* Forgets the timeline (recurrent states to zero); NULL if positions
     * alone define it (caches are overwritten as positions are reused). */
    void (*state_reset)(df_engine *e, void *state);
    /* Runs n <= DF_CHUNK tokens at positions pos..pos+n-1. Writes logits rows
     * for every token if all_rows, else only for the last into out[0]. */
    df_status (*forward)(df_engine *e, void *state, int pos, const int32_t *tokens, int n,
                         float *out, int all_rows, char *err);
    /* Several sessions' rows in one pass, total <= DF_CHUNK (NULL: the
     * engine runs them one by one). Each session's results are
     * bit-identical to its forward alone. seg[0]'s state lends the scratch. */
    df_status (*forward_batch)(df_engine *e, const df_fwd_seg *seg, int nseg, char *err);
    /* Optional: a prompt of n > DF_CHUNK tokens run layer by layer over
     * blocks of df_engine_opts.prompt_block positions, so a block reads each routed
     * expert it uses once per layer; logits rows for every token if
     * all_rows, else only for the last into out[0]; bit-identical to
     * chunked forwards. The engine calls it unless
     * df_engine_opts.prompt_chunks, and with an accelerator only when
     * prompt_takes says so. */
    df_status (*forward_prompt)(df_engine *e, void *state, int pos, const int32_t *tokens, int n, float *out,
                                int all_rows, char *err);
    /* Optional: 1 when forward_prompt takes this session's prompt (NULL:
     * only without an accelerator, whose states may live on the device). */
    int (*prompt_takes)(df_engine *e, void *state);
    /* Appends program-specific lines to the describe text. */
    void (*describe)(df_engine *e, char *buf, size_t cap);
    /* Rewinding (NULL when positions alone define the timeline: caches are
     * overwritten as positions are reused). rewind_setup(depth > 0) makes
     * every later forward of n <= depth tokens keep what rewind_to needs:
     * DF_REWIND_TRAIL the recurrent state after each token, DF_REWIND_REPLAY
     * one copy of it before the pass; depth 0 frees that. rewind_to(t) puts
     * back the state after token t of the last such forward (t >= 0, trail)
     * or the state before it (t = -1, replay). DF_ERR_UNSUPPORTED when the
     * state lives on an accelerator. */
    df_status (*rewind_setup)(df_engine *e, void *state, int depth, int mode);
    void (*rewind_to)(df_engine *e, void *state, int t);
} df_program_ops;

/* The memory plan (plan.c): one budget split between the spine, the expert
 * cache, session state and metadata. */
typedef struct {
    int64_t avail;            /* what the kernel can give: MemAvailable capped by the cgroup */
    int64_t budget;           /* --ram, or avail minus a margin */
    int budget_given;         /* 1: --ram (a ceiling the user set: refused when too small) */
    int64_t spine, embed, routed; /* stored bytes: the spine in use, its embedding, every routed expert */
    int64_t fixed;            /* metadata + session state for the planned context + scratch */
    int64_t spine_resident;   /* the spine's bytes resident (embedding: rows a session touches) */
    int64_t spine_stream;     /* streamed: what stays resident + two layer buffers (estimate) */
    int64_t min_cache;        /* one token's experts of one layer */
    int64_t cache;            /* the expert cache */
    int stream;               /* the spine streams */
    char why[320];            /* why the spine streams or stays resident */
} eng_plan;

/* Decides spine residency and the cache estimate before the program binds
 * (refuses a --ram too small for the minimum); after binding,
 * plan_expert_cache sizes the cache from what was really bound. */
df_status plan_decide(df_engine *e, char *err);
int64_t plan_expert_cache(df_engine *e);
/* Bytes of weights the plan holds in RAM (mapped or in the stream buffers). */
int64_t plan_weight_bytes(const df_engine *e);
/* The "memory plan" line of the describe text. */
void plan_describe(const df_engine *e, char *b, size_t cap);

struct df_engine {
    char dir[1024];
    df_config cfg;
    const df_io *io;
    st_set *st;
    df_pool *pool;
    kn_level level;
    const df_program_ops *ops;
    void *prog;
    char *describe_text;
    struct xs_store *store;   /* routed experts read into the RAM cache; NULL: mmap */
    struct sp_store *spine;   /* non-expert weights streamed per layer; NULL: resident */
    int spine_group;          /* while binding: the group new matrices join (-1: resident) */
    int64_t resident_bound;   /* bytes of matrices bound resident and of f32 copies made at open */
    int embed_paged;          /* the (untied) embedding is mapped, MADV_RANDOM: rows hinted before use */
    df_engine_opts opts;
    char lossy[64];           /* "" or the label of the lossy settings in force */
    double prof[DF_PROF_N];   /* seconds per part of a step, when opts.profile */
    struct acc_table *acc;    /* device copies when opts.accel is set (accel.c); NULL: CPU only */
    eng_plan plan;
    int64_t spine_read0;      /* sp_bytes_read at the last df_engine_reset_stats */
    int spine_cur;            /* the spine group being computed (-1 none) */
    int spine_fault;          /* a failed read of a group served from the device (model_host); 0 none */
    char spine_fault_msg[DF_ERRMSG];
    int int8;                 /* the converted int8 spine is bound (tensors "int8:NAME" in st) */
    char spine_dtype[16];     /* "int8", or the checkpoint's matrices' type */
    float *batch_logits;      /* [DF_CHUNK][vocab] head rows of a batched pass (model_batch_logits) */
    df_batch_stats bstats;    /* batched steps (df_engine_batch_stats) */
    uint64_t moe_on_dev[4];   /* bit l: every expert of MoE layer l's last pass (any session's)
                                 ran from device copies, so its router lookahead would read
                                 nothing (moe_all_on_device); a hint, never a result */
    char meta_note[512];      /* what the metadata cache did at open (st_cache.h), "" if nothing to say */
    struct prompt_buf *prompt_ws; /* a layer-major prompt's block buffers, kept between prompts (prompt.h) */
    kn_px_buf px;             /* mm()'s prepared x, kept between products (kernels.h) */
    df_weight **res_views;    /* views bound resident (model_bind_resident), for the copy at open */
    int n_res_views, cap_res_views;
    const st_tensor *paged_embed; /* the embedding left mapped (embed_paged), else NULL */
    _Atomic unsigned char *embed_hinted; /* [vocab]: rows of the paged embedding hinted already
                                            (model_embed_tokens), NULL: hint every row */
    struct rcopy *rcopy;      /* the resident spine's copy (resident_copy.h); NULL: views of the mapping */
    df_weight **copy_views;   /* the views it will move while it runs (settle_copy), else NULL */
    int n_copy_views;
    char copy_error[DF_ERRMSG]; /* why a copy failed (settle_copy), else "" */
};
/* The engine's scratch for a batched pass's logits rows, allocated on first
 * use (NULL when out of memory). */
float *model_batch_logits(df_engine *e);
/* The embedding rows of n tokens into out ([n][embed->cols]); a prompt's
 * rows split over the engine's pool (a new session's rows are fresh pages:
 * one thread took ~6 ms to fault 256 K3-width rows in). */
void model_embed_tokens(df_engine *e, const df_weight *embed, const int32_t *tokens, int n, float *out);
/* The end of a model program's batched pass (forward_batch): the head
 * (layer group L, entered here) over xn's rows [rows][hidden], the final-
 * normed rows of the segments with an out, in segment order (every row of
 * one with all_rows, else its last), written to those outs. DF_OK at once
 * when rows is 0. */
/* The head's rows (lg [rows][V], rows in segment order: each segment's
 * last, or all of its rows) to the segments' outputs. */
void model_batch_scatter(const df_fwd_seg *seg, int nseg, const float *lg, int V);
df_status model_batch_head(df_engine *e, int L, const df_weight *head, const float *xn, int rows,
                           const df_fwd_seg *seg, int nseg, char *err);

struct df_session {
    df_engine *e;
    void *state;
    int max_ctx, pos;
    float *logits;        /* vocab_size */
    int rw_depth, rw_mode;    /* df_session_set_rewind: evals of <= depth tokens can be rewound */
    int rw_start, rw_n;       /* the last such eval: positions rw_start .. rw_start + rw_n - 1 */
    int32_t *rw_tokens;       /* [rw_depth] its tokens (replay re-evaluates them) */
    char err[DF_ERRMSG];
};

enum { DF_NAME = 384 }; /* room for a tensor name */
/* Formats a tensor name into out[DF_NAME] (truncation cannot go unnoticed:
 * names that long do not exist, so the lookup fails with the name shown). */
void tname(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Binding helpers shared by the model programs (engine.c). */
df_status model_bind(df_engine *e, const char *base, int64_t rows, int64_t cols, df_weight *w, char *err);
/* Like model_bind but always resident (routers: the lookahead reads them early). */
df_status model_bind_resident(df_engine *e, const char *base, int64_t rows, int64_t cols, df_weight *w,
                              char *err);
/* Before computing layer group g (layers 0..L-1, the head is L): makes its
 * streamed weights valid. DF_OK at once when the spine is resident. */
df_status model_enter(df_engine *e, int group, char *err);
/* Makes w's host bytes valid when the spine group being computed was
 * entered without them (its device copies served it, sp_skip) and a device
 * product failed: reads the group now. 1 if w->data is valid; 0 if the read
 * failed (the error is kept and the step fails: df_session_eval). */
int model_host(df_engine *e, const df_weight *w);
/* model_bind of the matrix named base + leaf. */
df_status model_bind_at(df_engine *e, const char *base, const char *leaf, int64_t rows, int64_t cols,
                        df_weight *w, char *err);
/* A 1-D vector of n values as f32 (malloc'd); NULL with *st set on error.
 * model_vec_flat takes any shape holding n values (conv weights [C, 1, W]). */
float *model_vec(df_engine *e, const char *name, int64_t n, df_status *st, char *err);
float *model_vec_flat(df_engine *e, const char *name, int64_t n, df_status *st, char *err);
/* Binds the ends of the decoder: embedding (resident; read a row at a time),
 * lm_head (the embedding when tied; else the last streamed group) and the
 * final norm (f32 copy, malloc'd into *final_norm). */
df_status model_bind_ends(df_engine *e, df_weight *embed, df_weight *head, float **final_norm, char *err);
/* 1 if a non-expert tensor is part of the spine in use: with the int8
 * spine, a converted matrix's original (and its fp8 scales) is not, its
 * "int8:" twin is; without it, no "int8:" tensor is. */
int model_spine_live(const df_engine *e, const st_tensor *t);
/* Tensor names (plan.c): a routed expert's tensor (".experts." but not the
 * shared experts); the layer of ".layers.N.", -1 for none. */
int model_is_routed_expert(const char *name);
int model_layer_of(const char *name);
/* Settles cfg.prefix / cfg.lm_head on the names the tensors really use. */
df_status model_find_prefix(df_engine *e, char *err);

/* Links each MoE layer to the next one (router lookahead). `first` is the
 * moe_layer inside layer 0's struct, `stride` the size of a layer struct;
 * layers without experts have E == 0. */
struct moe_layer_s;
void model_link_moe(df_engine *e, struct moe_layer_s *first, size_t stride, int n_layers);

/* Profiling: t = prof_now(e) ... prof_add(e, DF_PROF_X, &t) adds the time
 * since t to part X and restarts t. Both are no-ops unless opts.profile. */
double prof_now(const df_engine *e);
void prof_add(df_engine *e, int part, double *t);

/* Parallel y = W x over rows for n vectors: Y[i*ldy + r]. */
void mm(df_engine *e, const df_weight *w, const float *X, int n, float *Y, int64_t ldy);
/* Products of one layer that do not depend on each other: mm for each, the
 * ones the accelerator takes in one call with one host wait (accel.c,
 * df_accel.matmul_many). Same results as count mm calls in any order. */
typedef kn_mm_item mm_req; /* w, X, n, Y, ldy (kernels.h) */
void mm_many(df_engine *e, const mm_req *r, int count);
/* mm for each of r (host X and Y), the products the CPU computes in one pass
 * over the pool (kn_matmul_pool_many: one wake and one tail for all). */
void mm_host_many(df_engine *e, const mm_req *r, int count);
/* mm_many where X or Y may be device memory (acc_dev_alloc): the products
 * the accelerator does not take run on the CPU with those brought over
 * (a device Y then needs ldy == rows). No host wait when every X and Y is
 * on the device. */
df_status mm_many_dev(df_engine *e, const mm_req *r, int count, char *err);

/* The accelerator table (accel.c): bound matrices are registered at open
 * and uploaded on first use; acc_mm returns 1 when the accelerator computed
 * the product, 0 when the caller must use the CPU kernels. */
typedef struct acc_table acc_table;
acc_table *acc_new(const df_accel *a);
void acc_free(acc_table *t);
void acc_bind(acc_table *t, const df_weight *w);
/* Page-locks [p, p + bytes) through the accelerator's pin hook (unpinned in
 * acc_free); 1 if done, 0 if not offered or refused (uploads then stay
 * pageable: slower, same results). */
int acc_pin_host(acc_table *t, void *p, int64_t bytes);
/* When the matrices bound resident exceed the budget (they then go through
 * the device cache and are uploaded again and again), page-locks their host
 * bytes (page-aligned, overlapping ranges merged) so those uploads run at the
 * DMA rate. acc_mm does the same the first time such a matrix finds no room.
 * Once at most; best effort; returns the bytes page-locked. */
int64_t acc_pin_spine(acc_table *t);
/* Page-locks [p, p + bytes) for uploads (not the expert cache); 1 if done. */
int acc_pin_range(acc_table *t, void *p, int64_t bytes);
int acc_mm(acc_table *t, const df_weight *w, const float *X, int n, float *Y, int64_t ldy);
/* A streamed spine on the device. acc_keep_group plans one layer group
 * (its views v[n], lazily bound) to stay on the device: bound PENDING
 * (uploaded on first use, then resident) when the group fits beside what is
 * planned so far and `reserve` bytes for expert copies; 1 if kept.
 * acc_views_on_device: 1 if every v[i] has a device copy now. acc_hold:
 * the same check, and then the cached ones among them are held (never
 * evicted) until the next acc_hold or acc_unhold: the group may then run
 * without host bytes. 0: nothing held. */
int acc_keep_group(acc_table *t, df_weight *const *v, int n, int64_t reserve);
int acc_views_on_device(acc_table *t, df_weight *const *v, int n);
int acc_hold(acc_table *t, df_weight *const *v, int n);
void acc_unhold(acc_table *t);
/* 1 if w has a device copy now (acc_mm then needs no host bytes: w->data
 * may be NULL, and acc_mm returns 0 only on a device failure). */
int acc_on_device(acc_table *t, const df_weight *w);
/* Queues one routed expert (gate, up, down) through the accelerator's
 * expert_queue hook (uploading what is missing): its n outputs land in rows
 * rows[i] of out (stride out_stride floats) once acc_expert_finish returns
 * DF_OK; until then w's host bytes must stay in place. 1 if queued, 0 if
 * the hooks are absent, a matrix stays on the CPU or the device refused
 * (then nothing is queued: run it on the CPU). */
int acc_expert_queue(acc_table *t, const df_weight w[3], int situ, float beta, float linear_beta, const float *X,
                     int n, float *out, const int *rows, int64_t out_stride);
/* Waits for every queued expert and writes their outputs (DF_OK without the
 * hooks). On error the queued outputs are lost and err says why. */
df_status acc_expert_finish(acc_table *t, char *err);
/* Waits until no upload still reads host memory (before the expert store
 * reuses a RAM slot an early upload may be reading). */
void acc_uploads_wait(acc_table *t);
void acc_count_tier_hit(acc_table *t); /* a routed expert served without the RAM cache */
/* Starts uploads of the n matrices w that have no device copy (cached, if
 * they fit; the accelerator copies asynchronously where it can, so this
 * overlaps the products running now). Never changes results. */
void acc_prefetch(acc_table *t, const df_weight *w, int n);
/* Session state on the device (the accelerator's state hooks with kda /
 * mla): 1 if offered. */
int acc_has_kda(const acc_table *t);
int acc_has_mla(const acc_table *t);
/* bytes of zeroed device memory for the state of a KDA layer (kda) or an
 * MLA layer's cache (mla); NULL if not offered, refused (a shape or type
 * without a kernel) or out of memory. */
void *acc_state_new(acc_table *t, const df_accel_kda *kda, const df_accel_mla *mla, int64_t bytes);
void acc_state_free(acc_table *t, void *state); /* NULL-safe */
/* One device state per layer i < count (kda[i], or mla[i] when kda is
 * NULL), bytes each: all or none (NULL: every state of this kind stays on
 * the CPU). Freed with acc_states_free (NULL-safe). */
void **acc_states_new(acc_table *t, int count, const df_accel_kda *const *kda, const df_accel_mla *const *mla,
                      int64_t bytes);
void acc_states_free(acc_table *t, void **st, int count);
df_status acc_state_zero(acc_table *t, void *state, char *err);
/* kda_core.h's conv + recurrence on the device state for n tokens (inputs
 * and o in host memory). On error the state is undefined. */
/* A whole KDA layer through df_accel.kda_layer (w[DF_KDA_MATS], NULL where
 * the layer has none): 1 done (out written), 0 not offered or a matrix
 * without a device copy (nothing changed: run the layer the usual way),
 * -1 a device failure (err; the state is undefined). */
int acc_kda_layer(acc_table *t, const df_accel_kda *layer, void *state, int n, const df_weight *const *w,
                  const float *xn, float *out, char *err);
/* The same for a whole MLA layer (df_accel.mla_layer, w[DF_MLA_MATS]). */
int acc_mla_layer(acc_table *t, const df_accel_mla *layer, void *state, int pos, int n, const df_weight *const *w,
                  const float *xn, float *out, char *err);
/* A latent MoE layer's end through df_accel.moe_tail (in place of
 * acc_expert_finish + the combine, norm, lat_up and shared add on the
 * host): 1 done (out written, the queue finished), 0 not offered or lat_up
 * without a device copy (nothing changed), -1 a device failure (err). */
int acc_moe_tail(acc_table *t, int n, int K, const float *selw, const float *routed, int64_t dl,
                 const float *lat_norm, float eps, const df_weight *lat_up, const float *shared, float *out,
                 char *err);
df_status acc_kda(acc_table *t, const df_accel_kda *layer, void *state, int n, const float *q, const float *k,
                  const float *v, const float *f, const float *braw, const float *gate, float *o, char *err);
/* An MLA layer's attention on the device (cache rows pos.., q_pe rotation,
 * absorbed attention for every head; q, kva, attn in host memory). On error
 * the cache is undefined. */
df_status acc_mla(acc_table *t, const df_accel_mla *layer, void *state, int pos, int n, const float *q,
                  const float *kva, float *attn, char *err);
/* Activations on the device (df_accel.dev_*): acc_has_dev says whether the
 * accelerator offers them (with matmul_many and the expert queue);
 * acc_dev_alloc makes a block (at most 64 live; NULL when it cannot),
 * acc_is_dev says whether p points into one. The rest wrap the hooks
 * (errors: the hook's message in err). */
int acc_has_dev(const acc_table *t);
void acc_count_device_pass(acc_table *t);
int acc_is_dev(const acc_table *t, const void *p);
float *acc_dev_alloc(acc_table *t, int64_t floats);
void acc_dev_free(acc_table *t, float *p); /* NULL-safe */
df_status acc_dev_put(acc_table *t, float *dst, const float *src, int64_t floats, char *err);
/* The accelerator's dev_stage (host floats that acc_dev_put uploads in
 * place), NULL when it has none or cannot: the caller then puts its own. */
float *acc_dev_stage(acc_table *t, int64_t floats);
df_status acc_dev_get(acc_table *t, float *dst, const float *src, int64_t floats, char *err);
df_status acc_dev_rmsnorm(acc_table *t, float *out, const float *x, const float *w, int n, int dim, float eps,
                          char *err);
df_status acc_dev_attn_res(acc_table *t, float *out, const float *anchors, int64_t astride, int na, const float *cur,
                           const float *w, int n, int dim, float eps, char *err);
df_status acc_dev_add(acc_table *t, float *y, const float *x, int64_t floats, char *err);
df_status acc_dev_copy(acc_table *t, float *dst, const float *src, int64_t floats, char *err);
df_status acc_dev_gather(acc_table *t, float *dst, const float *src, const int *idx, int count, int64_t width,
                         char *err);
/* df_accel.dev_res_norm; DF_ERR_UNSUPPORTED (quietly) where the accelerator
 * has no such hook or does not take the shape: the caller runs the steps. */
df_status acc_dev_res_norm(acc_table *t, float *xn, float *h, const float *d, int restart, float *anc_out,
                           const float *anchors, int64_t astride, int na, const float *probe, const float *nw, int n,
                           int dim, float eps, char *err);
void acc_get_stats(const acc_table *t, df_accel_stats *out);
void acc_reset_stats(acc_table *t);
/* The placement: budget, what is resident, the tiers, and the plan for the
 * routed experts (expert_bytes each, n_experts of them; 0 without a store). */
void acc_describe(const acc_table *t, char *buf, size_t cap, int64_t expert_bytes, int n_experts);
const char *acc_last_error(const acc_table *t);

extern const df_program_ops dsv3_program;
extern const df_program_ops kimi_program;
#endif
