/* gpu.h — the CUDA backend's C interface (prefix gpu_), built by `make cuda`.
 *
 * Owns: device weight matrices (gpu_weight: a df_weight's bytes in device
 * memory, same layout as on the host), matvec / small-batch matmul per weight
 * type, the fused expert (gate/up + SiLU or SiTU, then down), RMSNorm and the
 * MoE router. Every function here is callable from C; the CUDA types stay in
 * gpu.cu (streams are passed as void *, NULL = the default stream).
 * It also owns the attention step's kernels (last section: gpu_kda.cu,
 * gpu_mla.cu, gpu_attn_res.cu):
 * the KDA conv + recurrence, the MLA cache-row write and latent attention,
 * and K3's attention-residual mix, each the device twin of an engine-free
 * CPU function (kda_core.h, mla_core.h, ops.h) on the same memory layouts.
 * Refuses: placement, caching and streaming policy (callers decide what lives
 * on the device), and any host-side math (the CPU kernels are the oracle).
 *
 * Supported weight types and shapes (anything else: DF_ERR_UNSUPPORTED):
 *   WT_BF16        cols % 8 == 0
 *   WT_FP8_BLOCK   cols % 16 == 0, block_cols % 16 == 0, f32 scales
 *   WT_INT4_G32    cols % 32 == 0, scales bf16 / f16 / f32
 *   WT_MXFP4       cols % 32 == 0, e8m0 scales
 * Layouts are exactly weight.h's, so a span read from a checkpoint can be
 * copied to the device byte for byte.
 *
 * Value computed (fp32 activations, fp32 products and sums, like kn_matvec):
 * each row is split into 16-byte chunks (8 bf16, 16 fp8, 32 int4/e2m1 codes);
 * lane l of one warp sums chunks l, l+32, ... (per chunk: exact decode, the
 * products summed left to right, then times the chunk's scale), and the 32
 * lane sums are added by a fixed butterfly. So, as on the CPU:
 *   - error bound (cols + 2) * 2^-24 * sum_c |w_c x_c| against exact math;
 *   - a one-hot x reproduces kn_dequant_row bit-exactly;
 *   - output row r depends only on row r and x: gpu_matmul row i is bit-equal
 *     to gpu_matvec on vector i, for any row range and any n.
 * The GPU and CPU results differ only by summation order (not bit-equal).
 *
 * Errors: DF_ERR_ARG for bad arguments, DF_ERR_UNSUPPORTED for a type or
 * shape above, DF_ERR_NOMEM when device memory runs out, DF_ERR_IO for any
 * other CUDA failure (a launch or copy error; gpu_last_error() names it).
 */
#ifndef DF_CUDA_GPU_H
#define DF_CUDA_GPU_H
#include "../format/weight.h"
#include "../model/kda_core.h"
#include "../model/mla_core.h"
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 if a CUDA device this build can run on (sm_90 or newer) is present;
 * else 0 and one line saying why in why[cap] ("no CUDA device: ..."). */
int gpu_probe(char *why, size_t cap);
/* Text of the last CUDA error seen by this thread ("" if none). */
const char *gpu_last_error(void);

/* ---- device buffers (for callers without cuda_runtime.h: tests, C code) ---- */

void *gpu_malloc(size_t bytes);               /* NULL on failure */
void gpu_free(void *p);                        /* NULL-safe */
df_status gpu_put(void *dst, const void *src, size_t bytes); /* host -> device, synchronous */
df_status gpu_get(void *dst, const void *src, size_t bytes); /* device -> host, synchronous */
df_status gpu_fill(void *dst, int byte, size_t bytes);       /* cudaMemset */
df_status gpu_sync(void);                      /* waits for the device; reports launch errors */
/* dst <- src by a kernel on `stream` (asynchronous): each side device memory
 * or mapped page-locked host memory (cudaMallocHost under unified
 * addressing). Never queues behind copy-engine transfers such as uploads. */
df_status gpu_copy(void *dst, const void *src, size_t bytes, void *stream);

/* ---- device weights ---- */

typedef struct {
    wt_type type;
    int64_t rows, cols;
    void *data;                 /* device bytes, weight.h layout */
    void *scale;                /* device bytes; NULL for bf16 */
    st_dtype scale_dtype;       /* WT_INT4_G32 */
    int block_rows, block_cols; /* WT_FP8_BLOCK */
    int64_t data_bytes, scale_bytes;
    /* MXFP4: the matrix in the fragment layout (gpu_mx_frag_pack), or NULL;
     * when set, gpu_matmul_tc and the expert batches read it instead of data
     * and scale. gpu_weight_alloc_frag makes a weight that holds only this
     * (data and scale NULL, data_bytes its size): gpu_matmul and gpu_expert
     * refuse it (DF_ERR_UNSUPPORTED). Freed by gpu_weight_free. */
    void *frag;
} gpu_weight;

/* DF_OK if the GPU kernels take w's type and shape; else the reason in err. */
df_status gpu_weight_check(const df_weight *w, char *err);
/* Allocates device memory for a matrix shaped like `shape` (its data and
 * scale pointers are ignored); contents undefined. On error *g is zeroed and
 * nothing is held. */
df_status gpu_weight_alloc(const df_weight *shape, gpu_weight *g, char *err);
/* gpu_weight_alloc + copies w's bytes (synchronous). On error *g is zeroed. */
df_status gpu_weight_upload(const df_weight *w, gpu_weight *g, char *err);
/* The fragment layout (MXFP4, cols % 32 == 0: gpu_mx_frag_takes): device
 * memory for it alone, shaped like `shape` (see gpu_weight.frag); on error
 * *g is zeroed. The same matrix in less time per product than data + scale
 * (bench/cuda_bench.cu), the same bits. */
int gpu_mx_frag_takes(const df_weight *w);
df_status gpu_weight_alloc_frag(const df_weight *shape, gpu_weight *g, char *err);
/* Device bytes a refill of w into a fragment-layout weight stages through
 * (w's data and scale, each 256-byte aligned). */
int64_t gpu_mx_frag_stage_bytes(const df_weight *w);
/* Copies w into g (gpu_weight_alloc_frag, gpu_weight_fits) through `stage`
 * (device, gpu_mx_frag_stage_bytes(w)), re-laying it on the device, all on
 * `stream`: stage is busy until the stream passes this point; w's bytes
 * must stay in place until then. */
df_status gpu_weight_refill_frag_async(const df_weight *w, gpu_weight *g, void *stage, void *stream, char *err);
/* gpu_weight_alloc_frag + the refill through a stage of its own (synchronous). */
df_status gpu_weight_upload_frag(const df_weight *w, gpu_weight *g, char *err);
void gpu_weight_free(gpu_weight *g); /* NULL-safe; leaves *g zeroed */
/* 1 if w's data and scale need exactly g's allocation sizes (for a
 * fragment-layout g: w's fragment layout does). */
int gpu_weight_fits(const df_weight *w, const gpu_weight *g);
/* Copies w into g's existing allocation (gpu_weight_fits; not a
 * fragment-layout g), taking w's shape fields (synchronous). On error g
 * keeps its memory, contents undefined. */
df_status gpu_weight_refill(const df_weight *w, gpu_weight *g, char *err);
/* The same on `stream`, asynchronous: w's bytes must stay in place until the
 * copies are done (page-locked sources make them truly asynchronous). */
df_status gpu_weight_refill_async(const df_weight *w, gpu_weight *g, void *stream, char *err);

/* ---- matvec / matmul ---- */

/* For i in [0, n): Y[i*ldy + (r - row0)] = sum_c W[r][c] * X[i*cols + c],
 * r in [row0, row1). X, Y device pointers. Tuned for n = 1 (weight-bandwidth
 * bound) and n <= 64 (one weight read per 8 vectors). Asynchronous. */
df_status gpu_matmul(const gpu_weight *w, const float *X, int n, float *Y, int64_t ldy,
                     int64_t row0, int64_t row1, void *stream);
df_status gpu_matvec(const gpu_weight *w, const float *x, float *y, void *stream);

/* ---- tensor-core MXFP4 matmul (gpu_mma.cu) ---- */

/* Device scratch owned by the caller (one per stream), grown on demand;
 * zero-initialise, release with gpu_ws_free. */
typedef struct {
    void *buf;
    size_t cap;
    /* bf16 products of at least this many vectors run on the tensor cores
     * (gpu_bf16_tc.cu); 0: never (the CUDA cores, gpu_matmul). A product's
     * rows then depend on whether n reached it (the same bound either way). */
    int bf16_tc_rows;
    /* Those products of many vectors on Hopper's wgmma blocks
     * (gpu_bf16_wg.cu; the same bits as the mma.sync blocks): 0 where the
     * device and build have them and the product fills the device, 1
     * wherever they have them, -1 never. */
    int bf16_wg;
    int wg_known; /* private to gpu_ws_wg: 0 not yet asked, 1 present, 2 absent */
    /* MXFP4 batches of many vectors on the fragment layout (gpu_experts):
     * 1 with x staged in shared memory (k_mx_frag_xs), -1 the k-split
     * kernel (k_mx_frag_batch), 0 the build's default (GPU_FRAG_XS); the
     * same bits either way. */
    int frag_xs;
    /* Those batches on Hopper's wgmma (gpu_mx_wg.cu; the same bits, items
     * of up to 48 vectors): 1 where the device and build have it, 0 the
     * build's default (GPU_FRAG_WG), -1 never (frag_xs then picks). */
    int frag_wg;
} gpu_ws;
void gpu_ws_free(gpu_ws *ws); /* NULL-safe; leaves it empty */
/* ws->bf16_wg where this build and device run the wgmma blocks (asked once
 * per ws), else -1. */
int gpu_ws_wg(gpu_ws *ws);
/* 1 when this build and device run the wgmma kernels (compute capability
 * 9.0 and an sm_90a image; asked once per ws). */
int gpu_ws_wg_present(gpu_ws *ws);

/* 1 if gpu_matmul_tc runs w on the tensor cores as MXFP4, else 0. */
int gpu_matmul_tc_takes(const gpu_weight *w);
/* The fragment layout of an MXFP4 matrix (gpu_mma.cu): its codes and scales
 * re-laid per 16-row tile so each lane loads its mma operands straight from
 * global memory. gpu_mx_frag_bytes: its size; gpu_mx_frag_pack: w's bytes
 * (device, gpu_matmul_tc_takes) into out (device, that many bytes),
 * asynchronous on stream. Products through it are bit-equal to w's. */
int64_t gpu_mx_frag_bytes(int64_t rows, int64_t cols);
df_status gpu_mx_frag_pack(const gpu_weight *w, void *out, void *stream);
/* 1 if gpu_matmul_tc can run w on the tensor cores as bf16 (cols a
 * multiple of 64; gpu_bf16_tc.cu; it does for n >= ws->bf16_tc_rows > 0),
 * else 0. */
int gpu_bf16_tc_takes(const gpu_weight *w);
/* gpu_matmul's contract, with MXFP4 and bf16 on the tensor cores: exact
 * weights; MXFP4: x as f16 hi + lo (22 bits) under a per-vector
 * power-of-two scale, fp32 block scales and sums; bf16: x as three bf16
 * limbs (all of x), fp32 sums. Error bound (gpu_mma.cu, gpu_bf16_tc.cu):
 *   (cols + 64) 2^-24 sum|w x| + 2^-21 sum|w x| + 2^-38 max|x| sum|w|.
 * Row i is bit-equal to the matvec of vector i (bf16: while both n are on
 * the same side of ws->bf16_tc_rows); one-hot x is exact. Other types, bf16
 * below ws->bf16_tc_rows, and bf16 x that is not 16-byte aligned, go to
 * gpu_matmul.
 * Asynchronous on stream; ws must not be shared by two streams at once. */
df_status gpu_matmul_tc(const gpu_weight *w, const float *X, int n, float *Y, int64_t ldy,
                        int64_t row0, int64_t row1, gpu_ws *ws, void *stream);

/* ---- activations, norms ---- */

typedef struct {
    int situ;          /* 0: silu(g) * u; 1: SiTU, as ffn.h's ffn_act */
    float beta;        /* SiTU gate beta */
    float linear_beta; /* SiTU up beta; 0 = up unchanged */
} gpu_act;

/* One expert on n token vectors (n >= 1): H[n][inter] = act(gate X, up X),
 * out[n][hidden] = down H. gate, up: [inter, hidden], same type; down:
 * [hidden, inter]. H is caller scratch (device, n*inter floats). The gate/up
 * stage is one kernel; gate and up rows are each bit-equal to gpu_matmul. */
df_status gpu_expert(const gpu_weight *gate, const gpu_weight *up, const gpu_weight *down,
                     const gpu_act *act, const float *X, int n, float *H, float *out,
                     void *stream);

/* One expert of a gpu_experts batch: out [n][down rows] = the expert on X
 * [n][gate cols] (device pointers). */
typedef struct {
    const gpu_weight *gate, *up, *down;
    const float *X;
    int n;
    float *out;
} gpu_expert_job;

/* Every job's expert in few launches (gpu_experts.cu): runs of MXFP4 jobs of
 * one shape as two tensor-core batches (gate and up of all of them, then
 * down) around one activation kernel; bf16 jobs that gpu_bf16_tc_takes on
 * the tensor cores one by one; other jobs through gpu_expert. Each MXFP4 or
 * bf16 gate / up / down row is bit-equal to gpu_matmul_tc on that matrix
 * (its bound), the activation is gpu_expert's, so a job's out depends
 * neither on the other jobs nor on n. ws: scratch (hidden rows and
 * splits), grown on demand, not shared by two streams at once. Outputs must
 * not overlap any X. Asynchronous on stream. */
df_status gpu_experts(const gpu_expert_job *jobs, int njobs, const gpu_act *act, gpu_ws *ws, void *stream);

/* A MoE layer's weighted sum of expert outputs, for t < n and c < dim:
 *   out[t][c] = sum_k w[t K + k] * rows[t K + k][c]   (k ascending from 0;
 *   each product and each sum rounded to fp32 separately, as op_axpy's
 *   y += a * x spelled without contraction), then, when add is set,
 *   out[t][c] += add[t][c].
 * rows and add: device arrays of device row pointers ([n K] and [n]);
 * w, out: device. Asynchronous. */
df_status gpu_moe_combine(const float *const *rows, const float *w, int n, int K, int64_t dim,
                          const float *const *add, float *out, void *stream);

/* out[i] = w * x[i] / sqrt(mean(x[i]^2) + eps) for n vectors of dim floats
 * (sum of squares in double, as op_rmsnorm). w may be NULL; out may alias x. */
df_status gpu_rmsnorm(float *out, const float *x, const float *w, int n, int dim, float eps,
                      void *stream);

/* x[i] *= 1 / (1 + exp(-g[i])) for i < n (ops.h's op_sigmoid, CUDA's
 * expf: within 8 ulp of the CPU's per element, tests/cuda). */
df_status gpu_sigmoid_mul(float *x, const float *g, int64_t n, void *stream);
/* y[i] += x[i] (fp32, rounded once, as the host's) for i < n. */
df_status gpu_add(float *y, const float *x, int64_t n, void *stream);
/* Row i of dst <- row idx[i] of src (rows of width floats) for i < count;
 * idx device or mapped page-locked memory. */
df_status gpu_gather_rows(float *dst, const float *src, const int *idx, int count, int64_t width, void *stream);

/* ---- router ---- */

typedef struct {
    int E, K;            /* experts (<= 1024), picked per token */
    int n_group, topk_group; /* group limit (n_group <= 32); n_group <= 1: none */
    int sigmoid;         /* 1 sigmoid scores, 0 softmax */
    float group_mask;    /* value given to experts of dropped groups */
    int renorm;          /* divide by the sum of chosen scores (+1e-20) */
    float scale;         /* routed scaling factor */
    const float *bias;   /* device [E], selection only; NULL = zeros */
} gpu_router;

/* moe_route (ffn.c) for n tokens: logits [n][E] -> sel [n][K] ascending
 * expert ids, selw [n][K] weights. Device pointers. */
df_status gpu_route(const gpu_router *r, const float *logits, int n, int *sel, float *selw,
                    void *stream);

/* ---- attention (gpu_kda.cu, gpu_mla.cu, gpu_attn_res.cu) ------------------
 *
 * Device twins of the engine-free CPU functions, on their layouts, so a
 * session's state or cache can be copied host <-> device byte for byte.
 * All pointers are device pointers (the shape structs are host values);
 * every call is asynchronous on stream. DF_ERR_ARG / DF_ERR_UNSUPPORTED /
 * DF_ERR_NOMEM (workspace) return before anything is launched, leaving
 * every output and state untouched; DF_ERR_IO (a launch failed) leaves them
 * undefined. Bounds are against the CPU oracle named in each contract or
 * exact math, on the same inputs (u = 2^-24); tests/cuda/test_cuda_attn.c
 * checks them on random data. */

/* KDA for n >= 1 tokens of one layer in one launch, in token order (a
 * prefill chunk is one launch; inside it tokens run one after another, as
 * on the CPU): kda_conv_channel on all 3P channels, then kda_recur_head on
 * all H heads (kda_core.h), one block per head. With a workspace ws (grown
 * here; NULL: none), n >= 16 and D <= 128, the scan path instead: the conv,
 * norms and decays of every token in parallel, then only the recurrence
 * token by token (two column slices a head while heads are fewer than the
 * SMs), then the output norms in parallel; the same bits (below).
 *   state [kda_state_floats] this layer's state, kda_core.h's layout;
 *   q, k, v, f, gate [n][P], braw [n][H]: read only (the CPU overwrites
 *   q, k, v in place; here they stay as given);  o [n][P] written.
 *   p: device copies of the conv weights, exp(A_log), dt_bias, o_norm.
 * Supported: D % 16 == 0 and 16 <= D <= 256, 1 <= W <= 16, else
 * DF_ERR_UNSUPPORTED. D <= 128 keeps S in registers across the chunk
 * (D^2 / 16 threads); larger D works on S in place in memory.
 * Exactness: the conv part of the state is bit-equal to the CPU's (raw
 * inputs); a launch on n tokens gives bit-for-bit the state and o of n
 * one-token launches. Bounds (sums in other orders, CUDA's expf/log1pf):
 *   ||o_t - o_t,cpu||_2 <= 4 (t + 1)(D + 16) u ||o_t,cpu||_2  per token t
 *   and head, and ||S - S_cpu||_F <= 4 n (D + 16) u ||S_cpu||_F per head
 * (the delta rule is non-expansive: |k| = 1, 0 < beta < 1, decay <= 1, so
 * each token adds its own rounding error and damps the earlier ones). */
/* 1 if gpu_kda takes this shape (the limits above). */
int gpu_kda_takes(const kda_shape *sh);
df_status gpu_kda(const kda_shape *sh, const kda_params *p, float *state, int n, const float *q,
                  const float *k, const float *v, const float *f, const float *braw,
                  const float *gate, float *o, gpu_ws *ws, void *stream);

/* mla_write_row (mla_core.h) for tokens t < n at positions pos + t: cache
 * rows pos .. pos+n-1 of cache [ctx][R + dr] from kva [n][R + dr]
 * (kv_a_proj output), and with sh->use_rope the q_pe of every head of q
 * [n][nh][dq] rotated in place. cos/sin are computed here from inv_freq
 * (device [dr/2]; sh->inv_freq is a host pointer and is not read) as
 * cosf((float)(pos + t) * inv_freq[i]) * rope_mscale; without RoPE q and
 * inv_freq may be NULL. Needs dr even and dr <= 512 (DF_ERR_UNSUPPORTED). Bounds: c_kv within 2^-22 |ref| per
 * element (gpu_rmsnorm's; usually bit-equal), k_pe copied exactly, each
 * rotated value within 2^-20 (|x_a| + |x_b|) |rope_mscale| of op_rope's
 * (CUDA's cosf/sinf are within 2 ulp; the rotation itself is spelled as
 * op_rope's roundings). */
df_status gpu_mla_write(const mla_shape *sh, const float *kv_a_norm, const float *inv_freq,
                        const float *kva, float *cache, int pos, int n, float *q, void *stream);

/* mla_attend_one (mla_core.h) for every head h < nh and token t < n at
 * position p = pos + t over cache rows 0..p:
 *   qlat [nh][n][R] absorbed queries, q [n][nh][dq] (q_pe at offset dn),
 *   cache [>= pos + n][R + dr] with rows 0..pos+n-1 written (gpu_mla_write
 *   first; 16-byte aligned: rows are read as float4), olat [nh][n][R].
 * Online softmax over tiles of 32 positions; long contexts are split over
 * blocks, 256 positions each from position 0 (at most 1024 splits: longer
 * ones past 262144 positions), whose partial sums are combined by a second
 * kernel through ws (grown on demand, like gpu_matmul_tc's; not shared by
 * two streams at once). Up to 262144 positions a query's o is the same bits
 * whatever n, pos and the other queries of the launch (a prompt's tokens
 * equal one-token launches). Any context length works (nothing per position is
 * kept on chip). Needs R % 4 == 0, dr % 4 == 0, R <= 1024, R + dr <= 1280
 * (DF_ERR_UNSUPPORTED).
 * Bound, per (h, t) and column c, with L = p + 1, M_c = max_{k<=p}
 * |c_kv[k][c]| and A = softmax_scale * max_{k<=p} sum_i |qcat_i row_k,i|
 * (qcat = [q_lat | q_pe], row_k = cache row k):
 *   |o[c] - exact| <= ((R + dr + 24) A + 2 L + 96) u M_c
 * (scores in four fp32 chains, rescales of the running sums, at most L
 * fp32 terms per sum); mla_attend_one meets the same bound (op_dot's four
 * chains, L-term axpy), so |o - o_cpu| is within twice it.
 * If every score of a query is equal (e.g. q = 0), the sums are exact for
 * integer c_kv whose partial sums stay below 2^24 and o is the mean of
 * c_kv[0..p] correctly rounded: a skipped or repeated position shows. */
df_status gpu_mla_attend(const mla_shape *sh, const float *cache, const float *q, const float *qlat,
                         int pos, int n, float *olat, gpu_ws *ws, void *stream);

/* op_attn_res (ops.h) for n tokens: token t mixes V = [anchors + t *
 * astride + j * H for j < na, cur + t * H] with the probe w [H] into
 * out + t * H. 0 <= na <= 64 (else DF_ERR_UNSUPPORTED); out may alias cur
 * (not the anchors). One block of 256 threads per token; the mix is
 * spelled like op_attn_res (the same roundings, j ascending). Bound, with
 * a_j = sum_d |V_j[d] w[d]| / rms(V_j) and V_d = max_j |V_j[d]|:
 *   |out[d] - exact| <= (2 (ceil(H / 256) + 8) max_j a_j + 2 na + 16) u V_d
 * op_attn_res meets it with ceil(H / 4) in place of ceil(H / 256) (its dot
 * runs four chains of H / 4), so |out - out_cpu| is within the sum. */
df_status gpu_attn_res(const float *anchors, int64_t astride, int na, const float *cur, const float *w,
                       int H, float eps, int n, float *out, void *stream);

/* df_accel.dev_res_norm's step for n rows of H floats in one launch:
 * h = d (restart) or h + d (when d is set), the row copied to anc_out
 * (when set), its attention residual over na anchors with the probe (na >
 * 0), then its RMSNorm with nw into xn; the same bits as gpu_add /
 * gpu_copy, gpu_copy, gpu_attn_res and gpu_rmsnorm in turn.
 * DF_ERR_UNSUPPORTED (nothing launched) unless H % 4 == 0, H <= 8192,
 * na <= 64, astride % 4 == 0 and every pointer is 16-byte aligned. */
df_status gpu_res_norm(float *xn, float *h, const float *d, int restart, float *anc_out, const float *anchors,
                       int64_t astride, int na, const float *probe, const float *nw, int H, float eps, int n,
                       void *stream);

/* The absorbed MLA products around gpu_mla_attend (mla.h's mla_head), for
 * kv_b [nh (dn + dv)][R] in bf16 or row-int8 (gpu_mla_products_take; other types:
 * DF_ERR_UNSUPPORTED) and n <= 32 tokens:
 *   absorb: qlat[h][t][r] = sum_d q[t][h][d] W_UK[h][d][r]   (q [n][nh][dq])
 *   lift:   attn[t][h dv + v] = sum_r W_UV[h][v][r] olat[h][t][r]
 * fp32 sums over exact weights: |y - exact| <= K u sum |w x| with K = dn
 * (absorb) and R/32 + 5 (lift). */
int gpu_mla_products_take(const gpu_weight *kv_b);
/* 1 if every MLA kernel here (write, attend, absorb, lift) takes this shape
 * for any n <= 32 tokens; the kv_b type is gpu_mla_products_take's. */
int gpu_mla_takes(const mla_shape *sh);
df_status gpu_mla_absorb(const gpu_weight *kv_b, const mla_shape *sh, const float *q, int n, float *qlat,
                         void *stream);
df_status gpu_mla_lift(const gpu_weight *kv_b, const mla_shape *sh, const float *olat, int n, float *attn,
                       void *stream);
/* The same two products with kv_b's rows on the tensor cores, for any n
 * (meant for prompts with ws->bf16_tc_rows reached, where gpu_accel.cu
 * calls them; -DGPU_MLA_TC=0 builds keep the CUDA cores): per head,
 * absorb multiplies a transposed copy of W_UK (R rows of dn, made in ws)
 * and lift W_UV (dv rows of R), each output with the bits and bound
 * gpu_matmul_tc gives a bf16 row of that many columns (gpu_bf16_tc.cu: x
 * in three bf16 limbs), the
 * same whether the wgmma blocks run (ws->bf16_wg) or not. ws: scratch,
 * grown on demand (not kept). gpu_mla_products_tc_take: kv_b bf16 and dn,
 * R multiples of 64 (else DF_ERR_UNSUPPORTED). */
int gpu_mla_products_tc_take(const gpu_weight *kv_b, const mla_shape *sh);
df_status gpu_mla_absorb_tc(const gpu_weight *kv_b, const mla_shape *sh, const float *q, int n, float *qlat,
                            gpu_ws *ws, void *stream);
df_status gpu_mla_lift_tc(const gpu_weight *kv_b, const mla_shape *sh, const float *olat, int n, float *attn,
                          gpu_ws *ws, void *stream);

/* The tensor cores' bf16 rate with fp32 accumulation in TFLOP/s (1e12
 * FLOP/s, a multiply-add two), measured now (gpu_tc_probe.cu): *sync by
 * mma.sync m16n8k16 (the form of the MXFP4 and bf16 blocks), *wg by
 * wgmma m64n256k16 where the build and device have it (else 0). Each the
 * median of five timed launches after a warm-up. DF_ERR_IO on a CUDA
 * failure (gpu_last_error). */
df_status gpu_tc_probe(void *stream, double *sync_tflops, double *wg_tflops);

#ifdef __cplusplus
}
#endif
#endif
