/* deltafin.h — the one public C API of deltafin.
 *
 * Ownership, in one paragraph: a df_engine owns everything read from a model
 * directory (the safetensors shards, the parsed config, the weight views, the
 * thread pool). A df_session borrows its engine (the engine must outlive every
 * session made from it) and owns one timeline: the per-layer attention caches
 * and a logits buffer. Strings returned by the library are owned by the
 * object they came from and stay valid until that object is freed. Every
 * _open/_new has a NULL-safe _close/_free.
 *
 * Errors: every fallible call returns a df_status. Loading errors come with
 * one human message (file, tensor, what was expected) written into the
 * caller's buffer; session errors are kept in the session (df_session_error).
 * Nothing in the library prints, exits or reads the environment.
 */
#ifndef DELTAFIN_H
#define DELTAFIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    DF_OK = 0,
    DF_ERR_IO,          /* a file could not be opened or read */
    DF_ERR_FORMAT,      /* a weight file is malformed (header, offsets, dtype) */
    DF_ERR_CONFIG,      /* config.json missing, malformed or absurd */
    DF_ERR_MISMATCH,    /* a tensor is missing or disagrees with the config */
    DF_ERR_UNSUPPORTED, /* valid input this build cannot run */
    DF_ERR_NOMEM,
    DF_ERR_ARG,         /* the caller passed something invalid */
    DF_ERR_CONTEXT      /* the session's context limit is reached */
} df_status;

const char *df_status_name(df_status st);

enum { DF_ERRMSG = 1024 }; /* size of the error buffers the API fills */

typedef struct df_engine df_engine;
typedef struct df_session df_session;

/* How routed experts reach RAM. */
typedef enum {
    DF_EXPERTS_DIRECT = 0, /* O_DIRECT reads into the expert cache (default) */
    DF_EXPERTS_PREAD,      /* buffered reads into the expert cache */
    DF_EXPERTS_MMAP        /* used in place through the page cache (for comparison) */
} df_expert_io;

typedef struct {
    int n_threads;   /* 0: one per online CPU */
    /* NULL, or n_threads CPU numbers: compute thread i runs on cpus[i] (the
     * thread that drives the engine is thread 0: pinned to cpus[0] at its
     * first step). Linux; a CPU the process may not run on is refused at
     * open. Never changes the output. Borrowed only during df_engine_open. */
    const int *cpus;
    int use_mmap;    /* non-expert tensors: 1 map shards (default); 0 read into RAM with pread */
    /* With use_mmap: 1 keeps the resident spine's matrices as views of the
     * page cache (memory shared with the cache); 0 (default) copies them
     * into anonymous memory on 128-byte lines (df_engine_spine_copy): by a
     * thread started at open that runs at idle priority, the views moving
     * at the first evaluation after it ends; with spine_copy_at_open, by
     * the open itself on the engine's threads. Never changes the output. */
    int map_spine;
    int spine_copy_at_open;
    int simd_level;  /* -1: best available; 0 scalar, 1 AVX2, 2 AVX-512, 3 NEON (one the CPU lacks: the best) */
    int expert_io;   /* df_expert_io */
    /* Memory budget of the whole process (spine, expert cache, session
     * state, metadata); 0: what the kernel can give (MemAvailable capped
     * by the cgroup) minus a margin. A budget given here that cannot hold
     * the minimum is refused at open (DF_ERR_ARG, naming every part). */
    int64_t ram_bytes;
    int64_t expert_cache_bytes; /* the expert cache alone; 0: what ram_bytes leaves */
    int plan_ctx;    /* context positions the plan reserves session state for (0: 4096) */
    int prefetch;    /* 1: router lookahead prefetch (default); never changes the output */
    int prompt_chunks; /* 1: prompts in 32-position passes through every layer; 0 (default): prompts
                        * longer than that layer by layer in blocks (CPU path); never changes the output */
    int prompt_block;  /* positions per block of a layer-major prompt (0: 512, with or without an accelerator;
                        * at most 65536); each
                        * routed expert is read once per layer per block; never changes the output
                        * (except at simd level amx: kernels.h) */
    int io_depth;    /* expert reads in flight (default 32) */
    int top_k;       /* LOSSY when > 0 and below the model's: route to only this many experts */
    const char *heat_path; /* expert heat statistics: loaded at open if present, saved at close */
    int64_t pin_bytes; /* keep the hottest experts (by heat) resident, up to this many bytes */
    /* Router trace: called for every token and MoE layer with the chosen
     * experts (ascending) and their weights. */
    void (*trace)(void *ctx, int pos, int layer, const int *experts, const float *weights, int k);
    void *trace_ctx;
    /* System calls used for every file access (src/base/io.h); NULL: POSIX.
     * Tests pass tables that inject EINTR, short reads, EIO and delays. */
    const struct df_io *io;
    int plan_only;   /* describe only: plan the expert cache without allocating it */
    int profile;     /* time each part of a step (df_engine_profile) */
    int spine;       /* df_spine_mode: keep non-expert weights resident or stream them per layer */
    int spine_dtype; /* df_spine_dtype: the checkpoint's matrices or a converted int8 spine (LOSSY) */
    int evict_heat;  /* expert cache eviction: 0 least recently used (default), 1 lowest decayed heat */
    /* Optional accelerator (struct df_accel below): NULL runs every matrix
     * on the CPU. Borrowed: it must outlive the engine. */
    const struct df_accel *accel;
    /* Parsed-metadata cache (src/format/st_cache.h): a folder for one file per
     * checkpoint holding its parsed index and shard headers, used while
     * every shard's size and mtime are unchanged; NULL: parse every time.
     * Only checkpoints whose index has at least meta_cache_min_bytes. */
    const char *meta_cache_dir;
    int64_t meta_cache_min_bytes;
} df_engine_opts;

/* One Kimi Delta Attention layer as an accelerator's kda hook sees it (the
 * math and the state layout: src/model/kda_core.h): shape and host copies
 * of its per-channel parameters, stable while the engine is open (a hook
 * may key its device copies by this struct's address). */
typedef struct df_accel_kda {
    int H, D, W;              /* heads, head dim (K = V), conv kernel */
    int has_lower_bound;      /* K3's gate (lower_bound * sigmoid), else Kimi-Linear's softplus */
    float lower_bound, norm_eps;
    const float *conv[3];     /* q, k, v conv weights [H*D][W] */
    const float *a;           /* exp(A_log) per head and key channel [H*D] */
    const float *dt_bias;     /* [H*D] */
    const float *o_norm;      /* [D] */
} df_accel_kda;

/* One MLA layer as an accelerator's mla hook sees it (the math and the
 * cache layout: src/model/mla_core.h and mla.h's mla_head): shape, RoPE
 * and host copies of its small parameters, stable while the engine is open. */
typedef struct df_accel_mla {
    int nh, dn, dr, dv, R;    /* heads, nope / rope / value head dims, kv_lora_rank */
    int use_rope, rope_interleave;
    const float *inv_freq;    /* [dr/2] (RoPE only) */
    float rope_mscale, softmax_scale, latent_eps;
    const float *kv_a_norm;   /* [R] */
    const void *kv_b;         /* const df_weight * (src/format/weight.h): [nh*(dn+dv)][R] */
    const float *q_a_norm;    /* [qlr] when the layer has q_a / q_b (mla_layer), else NULL */
    int qlr;                  /* q_lora_rank; 0: a plain q_proj */
    int has_gate;             /* K3's sigmoid output gate (g_proj) */
} df_accel_mla;

/* An accelerator for the matrix products (deltafin-cuda: src/cuda/gpu_accel.h).
 * The engine uploads each matrix bound resident once at open; matrices whose
 * bytes come and go (routed experts from the expert cache, a streamed spine)
 * go through an LRU cache of device copies keyed by their tensor, bounded by
 * `budget` bytes for all device copies together; one that does not fit is
 * uploaded for the call and released after it. Matrices the accelerator
 * refuses (a type or shape it has no kernel for) stay on the CPU. With the
 * state hooks, KDA recurrences and MLA attention (with their states) move
 * to the device too; with the dev_ hooks a decode step keeps its
 * activations, norms and residual mixing there as well (the host routes
 * each MoE layer from its router logits). The results differ from the CPU
 * kernels only by summation order (tests bound the logits and require the
 * same greedy ids).
 * Calls come from one thread at a time. */
typedef struct df_accel {
    const char *name;  /* one line for inspect, e.g. "cuda: NVIDIA H200 (sm_90, 132 SMs)" */
    void *ctx;
    int64_t budget;    /* bytes of device memory for matrices */
    /* A device copy of one matrix: `weight` is a const df_weight * (the
     * layout of src/format/weight.h: data + scale). NULL with the reason in
     * err (DF_ERRMSG) when refused or out of memory; *refused is set to 1
     * when the type or shape has no kernel (then retrying is pointless). */
    void *(*upload)(void *ctx, const void *weight, int *refused, char *err);
    void (*release)(void *ctx, void *handle);
    /* Y[i*ldy + (r - row0)] = sum_c W[r][c] * X[i*cols + c] for i < n,
     * r in [row0, row1); X and Y in host memory; synchronous. */
    df_status (*matmul)(void *ctx, void *handle, const float *X, int n, float *Y, int64_t ldy,
                        int64_t row0, int64_t row1, char *err);
    /* Optional (NULL: not offered). pin page-locks host memory the engine
     * uploads from (the expert cache), so uploads from it run at the DMA
     * rate; the engine calls unpin before it frees that memory. h2d_gbps
     * measures host-to-device GB/s from page-locked memory (for bench). */
    df_status (*pin)(void *ctx, void *ptr, size_t bytes, char *err);
    void (*unpin)(void *ctx, void *ptr);
    double (*h2d_gbps)(void *ctx);
    /* Optional (both or neither): routed experts queued on the device. When
     * offered, every routed expert goes through them. expert_queue starts
     *   out[rows[i] * out_stride + r] = (down act(gate x_i, up x_i))[r]
     * for i < n, r < down's rows, on device copies from upload; act: situ 0
     * is silu(g) u, 1 is SiTU(beta, linear_beta) (ffn.h). X (n x gate's cols
     * floats) and rows are copied before it returns, and the handles may be
     * released right after (the accelerator keeps what queued work needs).
     * out is written, and the host bytes the handles were uploaded from may
     * be reused, once expert_finish has returned. An error from queue means
     * nothing was queued for that expert; from finish, every output queued
     * since the last finish is lost (the step fails). */
    df_status (*expert_queue)(void *ctx, void *gate, void *up, void *down, int situ, float beta,
                              float linear_beta, const float *X, int n, float *out, const int *rows,
                              int64_t out_stride, char *err);
    df_status (*expert_finish)(void *ctx, char *err);
    /* Optional: waits until every upload started so far has read its host
     * bytes (uploads may run behind the calls that started them; the engine
     * calls this before it reuses host memory an upload may read). */
    void (*uploads_wait)(void *ctx);
    /* Optional: session state kept on the device, so attention runs there.
     * state_new returns `bytes` of zeroed device memory for the state of a
     * KDA layer (kda non-NULL: its recurrent state) or an MLA layer (mla
     * non-NULL: its latent cache); NULL with err when it cannot, e.g. a
     * shape or type without a kernel (the session then keeps those states
     * on the CPU). state_zero clears one. Session state is not part of
     * `budget`. Both hooks below are synchronous, with inputs and outputs in
     * host memory; an error leaves the state undefined (the engine then
     * resets the session).
     * kda: kda_core.h's conv + recurrence for n tokens of one layer: q, k,
     *   v, f, gate [n][H*D] and braw [n][H] (read only), o [n][H*D] out.
     * mla: for positions pos .. pos+n-1: writes the cache rows from kva
     *   [n][R+dr] (kv_a_proj's output), rotates q_pe, and computes attn
     *   [n][nh*dv] = mla_head for every head from q [n][nh][dn+dr] (read
     *   only); kv_b is the device copy of layer->kv_b from upload. */
    void *(*state_new)(void *ctx, const df_accel_kda *kda, const df_accel_mla *mla, int64_t bytes, char *err);
    void (*state_free)(void *ctx, void *state);
    df_status (*state_zero)(void *ctx, void *state, char *err);
    df_status (*kda)(void *ctx, const df_accel_kda *layer, void *state, int n, const float *q, const float *k,
                     const float *v, const float *f, const float *braw, const float *gate, float *o, char *err);
    df_status (*mla)(void *ctx, const df_accel_mla *layer, void *kv_b, void *state, int pos, int n,
                     const float *q, const float *kva, float *attn, char *err);
    /* Optional: the device's read bandwidth in GB/s (1e9 B/s), measured now
     * by a short read-only kernel over a buffer far larger than its caches
     * (bench's device floor: the bytes a step reads on the device at it). */
    double (*read_gbps)(void *ctx);
    /* Optional: count independent products in one call with one host wait:
     * for i < count, Y[i][j * ldy[i] + r] = sum_c W_i[r][c] X[i][j * cols_i + c]
     * for j < n[i] and every row r of W_i (handles from upload; X, Y host
     * memory; products with the same X pointer share its copy). Each result
     * is bit-equal to matmul's. Synchronous; on error no Y is defined. */
    df_status (*matmul_many)(void *ctx, int count, void *const *handles, const float *const *X, const int *n,
                             float *const *Y, const int64_t *ldy, char *err);
    /* Optional: a whole KDA layer step with one host wait, its activations
     * kept on the device between the products: xn [n][hidden] in, out
     * [n][hidden] out (host memory); mats[DF_KDA_MATS]: device copies from
     * upload of the layer's projections in the order of df_kda_mat (g, or
     * g_a and g_b, NULL as the layer has them). The same values as those
     * products through matmul and the kda hook (bit-equal on one device).
     * Errors as kda's (the state is then undefined). */
    df_status (*kda_layer)(void *ctx, const df_accel_kda *layer, void *state, int n, void *const *mats,
                           const float *xn, float *out, char *err);
    /* Optional: a whole MLA layer (see df_mla_mat below). */
    df_status (*mla_layer)(void *ctx, const struct df_accel_mla *layer, void *kv_b, void *state, int pos, int n,
                           void *const *mats, const float *xn, float *out, char *err);
    /* Optional (with expert_queue): ends a latent MoE layer on the device in
     * place of expert_finish and the host's combine: for t < n
     *   a = sum_k selw[t K + k] y[t K + k]   (k ascending, fp32 products and
     *       sums rounded separately, as ffn.c's op_axpy from zero),
     *   a = RMSNorm(a) * lat_norm (when lat_norm; eps),
     *   out[t] = lat_up a, then + shared[t] when shared is set,
     * where y[r] is row r (dl floats) of `routed` and shared[t] row t of
     * `shared` (hidden floats): rows that queued experts were to write there
     * are taken from the device (and not written to host memory), the
     * others from host memory. lat_up: a device copy from upload. Finishes
     * the queue as expert_finish does (errors alike). */
    df_status (*moe_tail)(void *ctx, int n, int K, const float *selw, const float *routed, int64_t dl,
                          const float *lat_norm, float eps, void *lat_up, const float *shared, float *out,
                          char *err);
    /* Optional, all or none: activations that stay on the device between
     * calls (a decode step without a host round trip per layer). dev_alloc
     * returns `floats` floats of device memory (64-byte aligned), NULL with
     * err; dev_free gives it back (NULL-safe). The host never reads such
     * memory. Wherever matmul_many (X, Y), expert_queue (X, out), moe_tail
     * (out), kda_layer and mla_layer (xn, out) take activations, a pointer
     * into a dev_alloc block may stand for host memory: it is read or
     * written there, and a call whose outputs all stay on the device does
     * not wait for them (work is queued in order on one stream; the host
     * bytes the weights were uploaded from may still be reused once it
     * returns). The dev_ hooks below take device pointers, queue their work
     * and do not wait, except dev_get.
     *   dev_put:  dst <- src (host, copied before it returns)
     *   dev_get:  dst (host) <- src, after the work queued before it
     *   dev_rmsnorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, t < n rows of dim
     *   dev_attn_res: out[t] = AttnRes of anchors[t * astride + j * dim], j < na,
     *     and cur[t] with the probe w (op_attn_res), t < n; DF_ERR_UNSUPPORTED
     *     when na is more than the device takes (the engine mixes on the host)
     *   dev_add:  y[i] += x[i] (fp32), i < floats; dev_copy: dst <- src
     *   dev_gather: row i of dst <- row idx[i] of src, i < count, rows of
     *     width floats (idx: host memory, copied before it returns) */
    float *(*dev_alloc)(void *ctx, int64_t floats, char *err);
    void (*dev_free)(void *ctx, float *p);
    df_status (*dev_put)(void *ctx, float *dst, const float *src, int64_t floats, char *err);
    df_status (*dev_get)(void *ctx, float *dst, const float *src, int64_t floats, char *err);
    df_status (*dev_rmsnorm)(void *ctx, float *out, const float *x, const float *w, int n, int dim, float eps,
                             char *err);
    df_status (*dev_attn_res)(void *ctx, float *out, const float *anchors, int64_t astride, int na, const float *cur,
                              const float *w, int n, int dim, float eps, char *err);
    df_status (*dev_add)(void *ctx, float *y, const float *x, int64_t floats, char *err);
    df_status (*dev_copy)(void *ctx, float *dst, const float *src, int64_t floats, char *err);
    df_status (*dev_gather)(void *ctx, float *dst, const float *src, const int *idx, int count, int64_t width,
                            char *err);
    /* Optional (NULL: the engine runs the dev_ hooks above in turn), the
     * residual stream's step between two parts of a layer in one call, for
     * rows t < n of dim floats (anchor rows at anchors + t * astride + j * dim):
     *   h[t] = d[t] (restart) or h[t] + d[t], when d is set;
     *   anc_out[t * astride] <- h[t], when anc_out is set;
     *   x = dev_attn_res of h[t] over its na anchors with the probe (na > 0),
     *       else h[t];
     *   xn[t] = dev_rmsnorm of x with the weights nw.
     * It must give the bits those hooks in turn give. DF_ERR_UNSUPPORTED
     * (nothing done, err untouched): a shape or alignment it does not take. */
    df_status (*dev_res_norm)(void *ctx, float *xn, float *h, const float *d, int restart, float *anc_out,
                              const float *anchors, int64_t astride, int na, const float *probe, const float *nw,
                              int n, int dim, float eps, char *err);
    /* Optional: the tensor cores' bf16 rate with fp32 sums, TFLOP/s, measured
     * now by short kernels: *sync by mma.sync, *wg by Hopper's wgmma (0 where
     * the build or device lacks it); 0 on failure (bench's prefill floor). */
    void (*tc_tflops)(void *ctx, double *sync, double *wg);
    /* Optional, with the dev_ hooks (NULL: dev_put copies the caller's
     * memory first): host memory for `floats` floats that dev_put reads in
     * place when its src lies in it (page-locked on CUDA, so the upload
     * starts without a copy into staging); NULL with err when it cannot. It
     * waits for the uploads still reading an earlier stage; the caller
     * writes it, then may put parts of it in turn and keep writing other
     * parts meanwhile, until the next dev_stage. */
    float *(*dev_stage)(void *ctx, int64_t floats, char *err);
} df_accel;

/* df_accel.mla_layer (optional, with the state hooks): a whole MLA layer step with one host
 * wait: the projections of xn [n][hidden], q_a's RMSNorm (q_a_norm, eps
 * latent_eps), the mla hook's cache write and attention (kv_b as there),
 * the sigmoid output gate and the output projection into out [n][hidden]
 * (host memory). mats[DF_MLA_MATS] in the order of df_mla_mat, NULL where
 * the layer has none. Within the mla hook's bounds of the products and
 * the CPU's norm and gate (CUDA's expf). Errors as mla's. */
enum df_mla_mat { DF_MLA_QA, DF_MLA_QB, DF_MLA_Q, DF_MLA_KVA, DF_MLA_G, DF_MLA_O, DF_MLA_MATS };

/* The order of df_accel.kda_layer's matrices. */
enum df_kda_mat { DF_KDA_Q, DF_KDA_K, DF_KDA_V, DF_KDA_FA, DF_KDA_FB, DF_KDA_B, DF_KDA_G, DF_KDA_GA, DF_KDA_GB,
                  DF_KDA_O, DF_KDA_MATS };

/* Non-expert weights: mapped and resident, or streamed layer by layer
 * through a double buffer (for models whose spine does not fit in RAM).
 * Auto streams when those weights exceed the memory left beside the expert
 * cache. Never changes the output. */
typedef enum { DF_SPINE_AUTO = 0, DF_SPINE_RESIDENT, DF_SPINE_STREAM } df_spine_mode;

/* Which copy of the spine's matrices is used: auto takes DIR/int8-spine
 * when `deltafin convert-spine` made one (and refuses one that no longer
 * matches the checkpoint), else the checkpoint's own; int8 requires it;
 * checkpoint never uses it. The int8 spine changes the math: the engine
 * labels it LOSSY (df_engine_lossy). */
typedef enum { DF_SPINE_DTYPE_AUTO = 0, DF_SPINE_DTYPE_CHECKPOINT, DF_SPINE_DTYPE_INT8 } df_spine_dtype;

void df_engine_opts_default(df_engine_opts *o);

/* Opens a model directory (config.json + safetensors, single or sharded).
 * On error *out is NULL and err holds one line naming file/tensor/field. */
df_status df_engine_open(const char *dir, const df_engine_opts *opts, df_engine **out,
                         char err[DF_ERRMSG]);
void df_engine_close(df_engine *e);

int df_engine_vocab_size(const df_engine *e);
int df_engine_max_context(const df_engine *e);
int df_engine_n_threads(const df_engine *e);
/* Positions per block of a layer-major prompt (df_engine_opts.prompt_block, resolved). */
int df_engine_prompt_block(const df_engine *e);
/* Human-readable description (architecture, tensor and byte totals, experts,
 * per-token bytes, memory per context token). Owned by the engine. */
const char *df_engine_describe(df_engine *e);

/* A session with room for max_ctx positions (0: the model's limit, capped at 4096). */
df_status df_session_new(df_engine *e, int max_ctx, df_session **out);
void df_session_free(df_session *s);
/* Forgets every position (the caches are kept allocated). */
void df_session_reset(df_session *s);
int df_session_pos(const df_session *s);
const char *df_session_error(const df_session *s);

/* Appends n tokens to the timeline. If logits is non-NULL it receives one row
 * of vocab_size floats per token (row i = next-token logits after token i);
 * otherwise only the last row is computed and df_session_logits returns it.
 * On error the session is unchanged (its position does not move). */
df_status df_session_eval(df_session *s, const int32_t *tokens, int n, float *logits);
/* Several sessions of one engine in one step: item i appends n tokens to
 * its session as df_session_eval would (logits: NULL, or one row per
 * token). Rows of different sessions share each pass (up to 32 rows a
 * pass; an item of more is split over passes, one of at most 32 never):
 * the spine and every routed expert the
 * rows choose are read once for all of them. Each session's results are
 * bit-identical to evaluating it alone. The sessions must be distinct. On
 * error every session of the batch is reset (its error says why), except
 * for argument errors, which change nothing. */
typedef struct {
    df_session *s;
    const int32_t *tokens;
    int n;
    float *logits;
} df_batch_item;
df_status df_session_eval_batch(df_batch_item *items, int count);
/* Batched steps since open or the last df_engine_reset_stats. */
typedef struct {
    uint64_t passes, rows;        /* forward passes of df_session_eval(_batch), rows they computed */
    uint64_t multi_passes;        /* passes with rows of more than one session */
    uint64_t prompt_blocks;       /* passes that were layer-major blocks of a long prompt
                                     (df_engine_prompt_block positions each) */
    uint64_t union_experts;       /* routed experts the passes used, summed over MoE layers */
    uint64_t solo_experts;        /* what the sessions would have used running alone (>= union) */
} df_batch_stats;
void df_engine_batch_stats(const df_engine *e, df_batch_stats *out);

/* Rewinding, for speculative decoding: after df_session_set_rewind(s,
 * depth, mode), every df_session_eval of n <= depth tokens (depth <=
 * DF_REWIND_MAX) keeps what it takes to go back to any position inside it:
 *   DF_REWIND_TRAIL   the recurrent (KDA) state after each token: a rewind
 *                     is one copy (memory: depth x the KDA state);
 *   DF_REWIND_REPLAY  one copy of it before the eval: a rewind restores it
 *                     and evaluates the kept tokens again (a forward pass).
 * Attention caches need nothing: positions past the end are overwritten.
 * depth 0 turns it off. DF_ERR_UNSUPPORTED when the session's recurrent
 * state lives on an accelerator; DF_ERR_NOMEM leaves it off. */
typedef enum { DF_REWIND_TRAIL = 0, DF_REWIND_REPLAY } df_rewind_mode;
enum { DF_REWIND_MAX = 32 };
df_status df_session_set_rewind(df_session *s, int depth, int mode);
/* Moves the session back to position pos: pos == the current position, or
 * after the first token of the last eval that kept its rewind data (any
 * pos < current for a model without recurrent state). The state is then
 * bit-identical to having evaluated only the tokens before pos.
 * df_session_logits is not updated (keep the rows the eval returned).
 * DF_ERR_ARG (session unchanged) when pos cannot be reached. */
df_status df_session_rewind(df_session *s, int pos);
/* Logits of the last evaluated position (vocab_size floats), owned by the session. */
const float *df_session_logits(const df_session *s);

/* Index of the largest value; ties go to the lowest index. */
int df_argmax(const float *v, int n);

/* Counters since open or the last reset (expert cache and reads). */
typedef struct {
    uint64_t expert_hits;      /* experts a pass found in RAM, not read for it (prefetched ones are not hits) */
    uint64_t expert_misses;    /* experts a pass had to read */
    uint64_t prefetched;       /* lookahead reads issued */
    uint64_t prefetch_used;    /* of those, experts the pass they were read for used */
    uint64_t prefetch_wasted;  /* of those, experts that pass did not use, or evicted unused */
    uint64_t bytes_read;       /* expert bytes read from storage */
    uint64_t spine_bytes_read; /* non-expert bytes read from storage by a streamed spine */
    double io_wait_s;          /* time compute waited for expert reads */
    double io_submit_s;        /* time compute spent handing expert reads to the kernel */
    int cache_slots, cache_slots_used;
    int64_t slot_bytes;
    int max_in_flight;         /* most reads outstanding at once */
    const char *expert_io;     /* "direct", "pread", "mmap" */
    int dio_mem_align;         /* direct: the memory alignment expert reads land at (the device's,
                                * statx); up to 128 a read lands its first tensor on a line */
} df_stats;

/* Where decode time goes, seconds since open or the last reset (filled
 * only when df_engine_opts.profile is set; otherwise zero). */
enum { DF_PROF_EMBED = 0, DF_PROF_KDA, DF_PROF_MLA, DF_PROF_NORMS, DF_PROF_ROUTER, DF_PROF_SHARED,
       DF_PROF_ROUTED, DF_PROF_DENSE, DF_PROF_HEAD, DF_PROF_SPINE_WAIT, DF_PROF_N };
const char *df_prof_name(int i);
void df_engine_profile(const df_engine *e, double out[DF_PROF_N]);
/* The weight bytes one token's step reads in each part (each part's DRAM
 * floor is this over the memory bandwidth): attention tensors by their
 * layer's kind, the router with a latent layer's down-projection (they run
 * together), routed = K experts per MoE layer plus the latent
 * up-projection and norm, the head, one embedding row; layer norms and
 * attention-residual vectors under norms. Approximate where a part reads
 * more than its own tensors (router lookahead reads the next router too). */
void df_engine_part_bytes(const df_engine *e, double out[DF_PROF_N]);

void df_engine_stats(const df_engine *e, df_stats *out);

/* Accelerator counters (all zero without df_engine_opts.accel). */
typedef struct {
    int64_t resident_mats, resident_bytes; /* uploaded at open, kept */
    int64_t cpu_mats;                      /* refused: computed on the CPU */
    int64_t cached_bytes;                  /* device copies in the LRU cache now */
    uint64_t calls, cpu_calls;             /* matrix products on the device / on the CPU */
    uint64_t cache_hits, cache_uploads, cache_evictions, transient_uploads;
    uint64_t upload_bytes;                 /* host-to-device weight bytes since open or reset */
    int64_t pinned_bytes;                  /* expert cache page-locked for uploads (0: none) */
    int64_t spine_pinned_bytes;            /* other host bytes page-locked for uploads (a spine
                                              that does not fit the device, its stream buffers) */
    uint64_t tier_hits;                    /* routed experts run from device copies, never read into RAM */
    uint64_t sync_calls;                   /* calls the host waited on: products, expert batches */
    double sync_s;                         /* host time inside them (device work + round trips) */
    uint64_t kda_calls, mla_calls;         /* KDA / MLA layer steps run on the device (state there) */
    uint64_t device_read_bytes;            /* bytes device work read: the weights of every product
                                              run there, KDA states, the MLA cache rows attended */
    uint64_t spine_groups_on_device;       /* streamed spine groups entered without reading them
                                              (every matrix had a device copy) */
    int64_t spine_kept_groups;             /* streamed spine groups planned to stay on the device */
    uint64_t device_passes;                /* forward passes with their activations on the device
                                              (the dev_ hooks: norms and residuals there too) */
    uint64_t macs_mxfp4, macs_bf16, macs_other; /* multiply-adds of the weight products run on
                                              the device (rows x cols x vectors), by the weight
                                              type: MXFP4, bf16 or f16, the rest (bench's
                                              tensor-core floor; MLA's kv_b counted once a
                                              layer call, its absorb and lift rows; attention's
                                              own products not counted) */
} df_accel_stats;
void df_engine_accel_stats(const df_engine *e, df_accel_stats *out);
void df_engine_reset_stats(df_engine *e);
/* Measures the O_DIRECT read bandwidth of the model's largest shard with
 * expert-sized reads at the engine's queue depth (the disk floor of a
 * benchmark, measured in the same run). *gbps in 1e9 bytes/s. */
df_status df_engine_probe_disk(df_engine *e, double seconds, double *gbps, char err[DF_ERRMSG]);
/* Host-to-device GB/s from page-locked memory, measured now by the
 * accelerator; 0 without one (or when it offers no probe). */
double df_engine_probe_h2d(df_engine *e);
/* The accelerator's device read bandwidth (GB/s) measured now by a read
 * probe kernel; 0 without one (or when it offers no probe). */
double df_engine_probe_device_read(df_engine *e);
/* The accelerator's tensor-core probe (df_accel.tc_tflops): both 0 without one. */
void df_engine_probe_device_tc(df_engine *e, double *sync_tflops, double *wg_tflops);
/* Bytes of a session's state for max_ctx positions (attention caches +
 * recurrent state; scratch not included), and of its recurrent (KDA) part
 * alone (what a rewind trail keeps per token). */
int64_t df_engine_session_bytes(const df_engine *e, int max_ctx);
int64_t df_engine_recurrent_bytes(const df_engine *e);
/* Bytes of one routed expert as stored (0 without experts). */
int64_t df_engine_expert_bytes(const df_engine *e);
/* Weight bytes a decode step reads besides routed experts (every non-expert
 * matrix once; the embedding counts one row). */
int64_t df_engine_spine_bytes_per_token(const df_engine *e);
/* The memory plan: at most this many bytes resident for a session of max_ctx
 * positions (non-expert weights + the expert cache + session state + a
 * fixed allowance for scratch and code). */
int64_t df_engine_plan_bytes(const df_engine *e, int max_ctx);
/* The spine's matrices in use: "int8" (converted) or the checkpoint's
 * stored type, e.g. "bf16". */
const char *df_engine_spine_dtype(const df_engine *e);
/* The weights this process maps from the checkpoint's files (the resident
 * spine; routed experts too with --io mmap): *resident bytes in memory and,
 * of those, *in_2mb mapped by 2 MB entries. Weights the page cache holds in
 * small folios (as write(2) leaves a file) decode slower. -1 where the
 * system does not say (no /proc/self/smaps), else 0. */
int df_engine_mapped_weights(const df_engine *e, int64_t *resident, int64_t *in_2mb);
/* The resident spine's copy (map_spine 0), started at open on a thread of
 * its own: tensors and bytes copied, the copy's seconds (0 while it runs),
 * and of its memory the bytes resident and in 2 MB pages (-1 without
 * /proc/self/smaps). With a streamed spine only its resident rest
 * (routers) is copied. Returns 0, and zeros, when there is none (map_spine,
 * --no-mmap, a device); 2 while it runs; 1 once it is made (the views read
 * it from the first evaluation after it ended). */
int df_engine_spine_copy(const df_engine *e, int64_t *tensors, int64_t *bytes, double *seconds, int64_t *rss,
                         int64_t *in_2mb);
/* Waits for a running spine copy and moves the views into it now (as the
 * next evaluation would). DF_OK when there is none; a failed read:
 * DF_ERR_IO naming the file, and the views stay on the mapping (as they
 * do, silently but for df_engine_spine_copy_error, when an evaluation
 * finds the copy failed). Not while a step runs. */
df_status df_engine_spine_copy_wait(df_engine *e, char err[DF_ERRMSG]);
/* Why the spine's copy failed (the steps then read the mapping), or "". */
const char *df_engine_spine_copy_error(const df_engine *e);
/* 1 when the spine streams per layer; the plan's reason for its choice
 * (one line, owned by the engine). */
int df_engine_spine_streamed(const df_engine *e);
const char *df_engine_spine_why(const df_engine *e);
/* Multiply-adds of one token's weight products (the spine's matrices and K
 * routed experts per MoE layer; attention scores excluded): prefill's
 * compute floor is 2 x this x tokens at the CPU's FMA rate. */
int64_t df_engine_macs_per_token(const df_engine *e);
/* Of those, the output head's (vocabulary x hidden): a prompt computes
 * logits for its last position only, so its floor counts the head once. */
int64_t df_engine_head_macs(const df_engine *e);
/* Layers with routed experts. */
int df_engine_moe_layers(const df_engine *e);
/* Routed experts per token (after a --top-k override). */
int df_engine_experts_per_token(const df_engine *e);
/* "" for exact runs; otherwise a label naming every lossy setting, e.g.
 * "LOSSY top-k 8 of 16". Print it in every stats line. */
const char *df_engine_lossy(const df_engine *e);
/* "" or one line about the metadata cache at open (written, stale and
 * rebuilt, corrupt and ignored, not written and why). */
const char *df_engine_meta_note(const df_engine *e);
/* Saves the heat statistics to opts.heat_path now (also done at close). */
df_status df_engine_save_heat(df_engine *e, char err[DF_ERRMSG]);

/* ---- kernel benchmark (deltafin bench --kernels) ---- */
typedef struct {
    char name[32];      /* weight type, e.g. "bf16" */
    double gbps;        /* weight bytes streamed per second, GB/s */
    double ms_per_call; /* one full matvec */
    double weight_mb;   /* size of the matrix in MB */
    double gemm_gflops; /* kn_matmul over DF_BENCH_GEMM_N vectors (prefill): GFLOP/s, 2 per weight and vector */
} df_bench_row;

enum { DF_BENCH_GEMM_N = 32 };

/* The name of the kernel level simd_level runs as on this CPU (-1: the
 * default; 0 scalar, 1 AVX2, 2 AVX-512, 3 NEON, 4 AMX; a level the CPU
 * lacks runs as the default), e.g. "avx512". */
const char *df_simd_level_name(int simd_level);
/* The same for people: the name, and the variant of the level that runs
 * (e.g. "avx2 (4-bit tiles by avx-vnni)" on an AVX2 CPU with AVX-VNNI;
 * "decode prefetch into L1" where the one-vector tiles prefetch the next
 * tile's rows into L1 rather than L2, as on AMD CPUs). */
const char *df_simd_level_desc(int simd_level);

/* Measures a DRAM read probe, a matvec and a DF_BENCH_GEMM_N-vector matmul
 * per weight type on matrices of about `mb` MB each, with n_threads threads
 * at kernel level simd_level (as df_simd_level_name resolves it). rows must hold 16 entries;
 * returns the number filled; probe_gbps receives the probe's bandwidth and
 * fma_gflops the fp32 FMA rate of all threads at that level (prefill's
 * compute ceiling). */
int df_bench_kernels(int n_threads, const int *cpus, int simd_level, double mb, double seconds,
                     df_bench_row *rows, double *probe_gbps, double *fma_gflops);
/* The matrix size (MB) the kernel benchmark uses by default: 512, or eight
 * times the last-level cache when that is larger (within a 32nd of physical
 * memory). The DRAM probe's buffer is at least twice this and 16 times the
 * last-level cache, within a 16th of physical memory. */
double df_probe_default_mb(void);
/* fp32 FMA rate (GFLOP/s) of n_threads at the best kernel level. */
double df_fma_probe(int n_threads, const int *cpus, double seconds);
/* The DRAM read probe alone: GB/s reading a buffer of >= mb MB with n_threads. */
double df_dram_probe(int n_threads, const int *cpus, double mb, double seconds);
/* In the three above, cpus is NULL or n_threads CPU numbers that thread i
 * runs on (as df_engine_opts.cpus; a CPU the process may not run on: 0 /
 * no rows). */
/* Parses a CPU list in taskset -c's form ("0-3,8,10-11") into cpus (room
 * for cap); returns how many, or -1 with err (DF_ERRMSG bytes) saying what is
 * wrong: the syntax, a CPU listed twice, or one this process may not run on
 * (naming those it may). */
int df_cpus_parse(const char *list, int *cpus, int cap, char *err);


/* ---- text: tokenizers, detokenisation, sampling, chat (src/text) ----
 *
 * Ownership: a df_tokenizer owns its vocabulary, merges, special tokens and
 * compiled pre-tokenisation regexes; it is immutable after loading, so one
 * tokenizer may be shared by threads (every call takes its scratch from the
 * caller's df_tokens or allocates it per call). A df_detok (streaming
 * decoder), df_sampler and df_chat_parser each own their small state and
 * borrow nothing but the tokenizer given to them (which must outlive them).
 * df_tokens is a caller-owned growable id buffer: zero-initialise it, let
 * calls append, free with df_tokens_free. Every _load/_new has a NULL-safe
 * _free. Errors: df_status + one line in the caller's DF_ERRMSG buffer.
 */
typedef struct df_tokenizer df_tokenizer;

typedef struct {
    int32_t *ids;
    int n, cap;
} df_tokens;
void df_tokens_free(df_tokens *t);                    /* frees ids, zeroes *t */
df_status df_tokens_push(df_tokens *t, int32_t id);  /* DF_ERR_NOMEM on failure */

/* Loads the tokenizer of a model directory: tiktoken.model (Kimi pattern,
 * 256 reserved special ids after the ranks, names overridden by
 * tokenizer_config.json added_tokens_decoder) or else tokenizer.json
 * (Hugging Face byte-level BPE; tokenizer_config.json is not needed). */
df_status df_tokenizer_load_dir(const char *dir, df_tokenizer **out, char err[DF_ERRMSG]);
/* A tiktoken rank file (`base64(bytes) rank` per line). The file does not
 * carry its pre-tokenisation pattern: pattern is a built-in name ("kimi",
 * "o200k", "cl100k"; NULL means "kimi") unless regex (PCRE2 syntax, UTF+UCP)
 * is given. Built-in specials: o200k/cl100k get their <|endoftext|> family,
 * kimi the 256 reserved ids after the ranks. config_json (a
 * tokenizer_config.json, may be NULL) overrides special token spellings. */
df_status df_tokenizer_load_tiktoken(const char *rank_file, const char *pattern,
                                     const char *regex, const char *config_json,
                                     df_tokenizer **out, char err[DF_ERRMSG]);
/* A Hugging Face tokenizer.json. Supported: model BPE over the ByteLevel
 * alphabet, normalizer null or an empty Sequence, pre_tokenizer Split
 * (Regex/String, behavior Isolated/Removed) and ByteLevel in a Sequence;
 * anything else fails with DF_ERR_UNSUPPORTED naming the part. */
df_status df_tokenizer_load_hf(const char *tokenizer_json, df_tokenizer **out,
                               char err[DF_ERRMSG]);
void df_tokenizer_free(df_tokenizer *t);

int df_tokenizer_vocab_size(const df_tokenizer *t);  /* largest id + 1 */
/* One line: kind, pattern, ranks, specials. Owned by the tokenizer. */
const char *df_tokenizer_describe(const df_tokenizer *t);
/* Id of a special token spelled exactly `text`, or -1. */
int32_t df_tokenizer_special(const df_tokenizer *t, const char *text);
int df_tokenizer_is_special(const df_tokenizer *t, int32_t id);
/* The raw bytes of one token (not NUL-terminated), or NULL for an id
 * outside the vocabulary. Owned by the tokenizer. */
const char *df_token_bytes(const df_tokenizer *t, int32_t id, size_t *len);

enum {
    DF_TOK_SPECIAL = 1  /* recognise special token spellings in the text */
};
/* Appends the ids of text[0..len) to out. Without DF_TOK_SPECIAL, text that
 * spells a special token is ordinary bytes. Fails (DF_ERR_ARG) on invalid
 * UTF-8, naming the byte offset. On error out->n is unchanged. */
df_status df_tokenize(const df_tokenizer *t, const char *text, size_t len, unsigned flags,
                      df_tokens *out, char err[DF_ERRMSG]);
/* Decodes ids into a malloc'd NUL-terminated string (*len bytes, excluding
 * the NUL). Invalid UTF-8 produced by the ids becomes U+FFFD; special
 * tokens are included unless skip_special. DF_ERR_ARG on an unknown id. */
df_status df_detokenize(const df_tokenizer *t, const int32_t *ids, int n, int skip_special,
                        char **text, size_t *len, char err[DF_ERRMSG]);

/* Streaming detokenisation: push one id at a time; each push yields the
 * text that is now complete (never a partial UTF-8 sequence: incomplete
 * code points wait for the next token; bytes that can never form a valid
 * sequence become U+FFFD). The text pointer is owned by the df_detok and
 * valid until the next call. */
typedef struct df_detok df_detok;
df_status df_detok_new(const df_tokenizer *t, int skip_special, df_detok **out);
void df_detok_free(df_detok *d);
df_status df_detok_push(df_detok *d, int32_t id, const char **text, size_t *len);
/* End of stream: pending bytes of an unfinished code point become U+FFFD. */
void df_detok_flush(df_detok *d, const char **text, size_t *len);
void df_detok_reset(df_detok *d);

/* ---- sampling ----
 * Order of operations on one logits row (a private copy; the input is not
 * modified): logit bias, repetition / presence / frequency penalties over
 * the last penalty_last_n accepted tokens, then the top-n logprobs are
 * taken (log-softmax at temperature 1 of the adjusted logits), then either
 * greedy (temperature <= 0: argmax, lowest id on ties) or temperature,
 * top-k, top-p, min-p, and a draw from the renormalised distribution with
 * the sampler's own PRNG (xoshiro256**, seeded; no global state). */
typedef struct {
    float temperature;         /* <= 0: greedy */
    int top_k;                 /* 0: off */
    float top_p;               /* >= 1: off */
    float min_p;               /* 0: off; keep p >= min_p * p_max */
    float repetition_penalty;  /* 1: off; logit > 0 divided, else multiplied */
    float presence_penalty;    /* 0: off; subtracted once per seen token */
    float frequency_penalty;   /* 0: off; subtracted per occurrence */
    int penalty_last_n;        /* window of accepted tokens (default 64; -1: all) */
    uint64_t seed;
    int n_logprobs;            /* 0..20 top logprobs reported per step */
} df_sampler_params;
void df_sampler_params_default(df_sampler_params *p);

typedef struct {
    int32_t token;
    float logprob;             /* of the chosen token, same distribution as top */
    int n_top;
    int32_t top_id[20];
    float top_logprob[20];
} df_sample;

typedef struct df_sampler df_sampler;
/* Allocates all scratch for vocab_size here; nothing is allocated per call. */
df_status df_sampler_new(const df_sampler_params *p, int vocab_size, df_sampler **out,
                         char err[DF_ERRMSG]);
void df_sampler_free(df_sampler *s);
/* Adds bias to a token's logit at every step (-INFINITY bans it). */
df_status df_sampler_set_bias(df_sampler *s, int32_t id, float bias);
/* Records a token in the penalty history (prompt tokens too, if wanted). */
void df_sampler_accept(df_sampler *s, int32_t id);
/* Forgets the history and reseeds the PRNG with the original seed. */
void df_sampler_reset(df_sampler *s);
/* Picks the next token from logits[vocab_size]; fills *info if non-NULL.
 * Does not accept the token (call df_sampler_accept). */
int32_t df_sampler_sample(df_sampler *s, const float *logits, df_sample *info);

/* ---- speculative decoding (src/model/spec.c) ----
 * Exact: drafts come from prompt lookup (the latest earlier occurrence of
 * the last n-gram, and what followed it), are verified in one multi-row
 * df_session_eval and rolled back past the first rejection
 * (df_session_rewind). Verification samples each row as plain decoding
 * would (df_sampler_sample, one draw per token, in order) and accepts a
 * draft when the sample equals it: P(accept d) = p(d), and a rejected
 * draft's replacement is distributed as p without d renormalised — the
 * standard rule for a deterministic (one-hot) proposal — with the coupling
 * that the output is token for token the output without drafts, greedy or
 * seeded sampling alike.
 * A df_spec borrows a session and a sampler (both must outlive it) and
 * keeps the session's token history (the lookup's text):
 *
 *   df_session_eval(s, prompt, n, NULL); df_spec_context(sp, prompt, n);
 *   while (...) { df_spec_step(sp, room, toks, NULL, &k); show toks[0..k) }
 *   df_spec_settle(sp, unshown);  // the session then holds what was shown
 *
 * Each step returns 1 .. depth + 1 tokens; the last one is sampled but not
 * yet evaluated (the next step evaluates it with its drafts). */
enum { DF_SPEC_MAX = 16 };
typedef struct {
    int depth;     /* most drafts per step, 1..DF_SPEC_MAX (default 8) */
    int ngram;     /* longest suffix looked up (default 3; shorter ones are tried after) */
    int adaptive;  /* 1 (default): the depth maximising measured tokens per second, 0 when
                      drafting does not pay; 0: always depth */
    /* The adaptive depth's cost of a step of `rows` rows, in seconds, in place
     * of the measured time (NULL, the default: measured). For tests, which
     * must not depend on the machine's speed. */
    double (*step_cost)(void *ctx, int rows);
    void *step_cost_ctx;
} df_spec_params;
void df_spec_params_default(df_spec_params *p);
typedef struct {
    uint64_t steps, rows;      /* verify steps and the rows they evaluated */
    uint64_t drafted, accepted; /* draft tokens proposed / accepted */
    uint64_t tokens;           /* tokens returned */
    double step_s;             /* time in verify steps */
    int depth_now;             /* the depth the last step used */
    double alpha;              /* estimated acceptance of one draft */
    double row1_s, per_row_s;  /* the cost model: a 1-row step, each further row */
} df_spec_stats;
typedef struct df_spec df_spec;
/* Turns on the session's rewinding (df_session_set_rewind, depth + 1):
 * a trail while (depth + 1) x the recurrent state stays within
 * DF_SPEC_TRAIL_BYTES, else snapshot + replay; fails (DF_ERR_UNSUPPORTED)
 * when the session cannot be rewound. */
#define DF_SPEC_TRAIL_BYTES ((int64_t)256 << 20)
df_status df_spec_new(df_session *s, df_sampler *smp, const df_spec_params *p, df_spec **out, char err[DF_ERRMSG]);
void df_spec_free(df_spec *sp);
/* Appends tokens the caller evaluated in the session (the prompt, a closing
 * tag) to the history. DF_ERR_ARG while a token is pending (settle first). */
df_status df_spec_context(df_spec *sp, const int32_t *ids, int n);
/* Forgets the history (after df_session_reset). */
void df_spec_reset(df_spec *sp);
/* One step: up to max tokens (1..DF_SPEC_MAX + 1) into out, their sample
 * info into info[] when non-NULL. The first step after context samples
 * from df_session_logits. DF_ERR_CONTEXT when the session is full; other
 * errors are the session's (df_session_error). */
df_status df_spec_step(df_spec *sp, int max, int32_t *out, df_sample *info, int *n);
/* df_spec_step in two halves, for callers that batch sessions
 * (df_session_eval_batch): begin sets *toks / *n to the tokens to evaluate
 * (the pending one and its drafts; n = 0 for the first step of a turn,
 * which needs no evaluation) and *rows to where their n logits rows must
 * go; the caller evaluates them; end verifies and returns the tokens as
 * df_spec_step does. The depth's cost model then times the batched step. */
df_status df_spec_begin(df_spec *sp, int max, const int32_t **toks, int *n, float **rows);
df_status df_spec_end(df_spec *sp, int32_t *out, df_sample *info, int *n);
/* Ends a run of steps: the last n_drop tokens returned (by the last step:
 * n_drop <= its count) are forgotten and the
 * session holds exactly the history (the pending token evaluated, or the
 * dropped ones rewound). */
df_status df_spec_settle(df_spec *sp, int n_drop);
void df_spec_get_stats(const df_spec *sp, df_spec_stats *out);
void df_spec_reset_stats(df_spec *sp);

/* ---- chat: Kimi K3 "XTML" (../shared/K3.md §2.3-2.4) ----
 * Rendering puts special tokens only at structural places: message text,
 * names and arguments are ordinary text even when they spell <|open|>. */
typedef struct {
    const char *role;          /* "system", "user", "assistant", "tool" */
    const char *content;       /* NULL: empty */
    const char *reasoning;     /* assistant: reasoning_content (the think channel) */
    const char *name;          /* user/system: optional name attribute; tool: the tool's name */
    const char *tool_calls;    /* assistant: JSON array [{"id", "function": {"name", "arguments"}}] */
    const char *tool_call_id;  /* tool: the id of the call it answers (results are reordered to call order) */
} df_chat_msg;

typedef struct {
    const char *tools;            /* JSON array of tool declarations, or NULL */
    const char *reasoning_effort; /* low, medium, high, max (default); NULL or "": no effort message */
    int thinking;                 /* 1 (default): the generation prompt opens the think channel */
    int add_generation_prompt;    /* 1 (default) */
    const char *format;           /* "k3", "kimi_k2", "deepseek_v3" (their chat_templates, reproduced),
                                   * or NULL: k3 with <|open|>, else kimi_k2 with <|im_middle|>, else
                                   * deepseek_v3 with <｜User｜> */
} df_chat_opts;
void df_chat_opts_default(df_chat_opts *o);

/* Appends the conversation's ids to out (t may be NULL when out is NULL);
 * *text (if non-NULL) receives the same rendering as a malloc'd string with
 * the specials spelled out. On error out->n is unchanged. */
df_status df_chat_render(const df_tokenizer *t, const df_chat_msg *msgs, int n, const df_chat_opts *opts,
                         df_tokens *out, char **text, char err[DF_ERRMSG]);

/* Output parsing: feed decoded model output (specials spelled, as df_detok
 * with skip_special = 0 gives it); the parser calls emit with reasoning and
 * content text as it becomes certain (a partial control marker at the end is
 * held back), and one compact JSON object {"name", "arguments"} per tool
 * call when its block closes. Structural markers are never emitted (a stray
 * one that is not where the format puts it stays text). */
enum { DF_CHAT_REASONING = 1, DF_CHAT_CONTENT = 2, DF_CHAT_TOOL_CALL = 3 };
typedef void (*df_chat_emit)(void *ud, int kind, const char *text, size_t n);
typedef struct df_chat_parser df_chat_parser;
/* in_thinking: the prompt opened the think channel (the default prompt does). */
df_status df_chat_parser_new(int in_thinking, df_chat_emit emit, void *ud, df_chat_parser **out);
void df_chat_parser_free(df_chat_parser *p);
df_status df_chat_parser_feed(df_chat_parser *p, const char *text, size_t n);
/* End of output (EOS, length limit): held-back text is emitted as text. */
void df_chat_parser_finish(df_chat_parser *p);
/* 1 once the assistant message has closed. */
int df_chat_parser_done(const df_chat_parser *p);

/* ---- hub mirrors (src/hub; `deltafin setup`) ----
 * A model directory made by `deltafin setup --stream` holds every file of a
 * hub repository, its safetensors shards as sparse files at the remote
 * offsets with routed experts fetched on first use. df_hub_stream_open
 * opens such a directory; df_hub_stream_io gives the df_io table to put in
 * df_engine_opts.io: reads of a missing span of a shard fetch it from the hub
 * (one HTTP range request), write it durably, record it, then read it. The
 * table stays valid until df_hub_stream_close (close engines using it
 * first). Routed experts must be read through the expert store
 * (expert_io direct or pread, not mmap); O_DIRECT opens of a shard are
 * refused so the store falls back to exact buffered reads. */
typedef struct {
    int64_t expert_local, expert_total; /* routed expert bytes present / in the model */
    int64_t fetched;                    /* bytes fetched by this process */
    int requests;                       /* range requests made by this process */
    char last_error[DF_ERRMSG];         /* the last failed fetch, "" if none */
} df_hub_stream_stats;

/* 1 if dir is a stream-mode mirror (.deltafin-hub/manifest.json, mode stream). */
int df_hub_is_stream(const char *dir);
typedef struct df_hub_stream df_hub_stream; /* an open stream mirror */
/* endpoint NULL: the one recorded at setup; token NULL: anonymous. */
df_status df_hub_stream_open(const char *dir, const char *endpoint, const char *token, df_hub_stream **out,
                             char err[DF_ERRMSG]);
const struct df_io *df_hub_stream_io(const df_hub_stream *s);
void df_hub_stream_info(df_hub_stream *s, df_hub_stream_stats *out);
void df_hub_stream_close(df_hub_stream *s); /* NULL-safe; saves the use clock and rate */

#ifdef __cplusplus
}
#endif
#endif
