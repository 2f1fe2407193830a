/* gpu.h — the CUDA backend's C interface (prefix gpu_), built by `make cuda`.
 *
 * Owns: device weight matrices (gpu_weight: a df_weight's bytes in device
 * memory, same layout as on the host), matvec / small-batch matmul per weight
 * type, the fused expert (gate/up + SiLU or SiTU, then down), RMSNorm and the
 * MoE router. Every function here is callable from C; the CUDA types stay in
 * gpu.cu (streams are passed as void *, NULL = the default stream).
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
} gpu_weight;

/* DF_OK if the GPU kernels take w's type and shape; else the reason in err. */
df_status gpu_weight_check(const df_weight *w, char *err);
/* Allocates device memory for a matrix shaped like `shape` (its data and
 * scale pointers are ignored); contents undefined. On error *g is zeroed and
 * nothing is held. */
df_status gpu_weight_alloc(const df_weight *shape, gpu_weight *g, char *err);
/* gpu_weight_alloc + copies w's bytes (synchronous). On error *g is zeroed. */
df_status gpu_weight_upload(const df_weight *w, gpu_weight *g, char *err);
void gpu_weight_free(gpu_weight *g); /* NULL-safe; leaves *g zeroed */
/* 1 if w's data and scale need exactly g's allocation sizes. */
int gpu_weight_fits(const df_weight *w, const gpu_weight *g);
/* Copies w into g's existing allocation (gpu_weight_fits), taking w's shape
 * fields (synchronous). On error g keeps its memory, contents undefined. */
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
} gpu_ws;
void gpu_ws_free(gpu_ws *ws); /* NULL-safe; leaves it empty */

/* 1 if gpu_matmul_tc runs w on the tensor cores (MXFP4), else 0. */
int gpu_matmul_tc_takes(const gpu_weight *w);
/* gpu_matmul's contract, with MXFP4 on the tensor cores: exact weights,
 * x as f16 hi + lo (22 bits) under a per-vector power-of-two scale, fp32
 * block scales and sums. Error bound (gpu_mma.cu):
 *   (cols + 64) 2^-24 sum|w x| + 2^-21 sum|w x| + 2^-38 max|x| sum|w|.
 * Row i is bit-equal to the matvec of vector i; one-hot x is exact. Other
 * types go to gpu_matmul. Asynchronous on stream; ws must not be shared by
 * two streams at once. */
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

/* out[i] = w * x[i] / sqrt(mean(x[i]^2) + eps) for n vectors of dim floats
 * (sum of squares in double, as op_rmsnorm). w may be NULL; out may alias x. */
df_status gpu_rmsnorm(float *out, const float *x, const float *w, int n, int dim, float eps,
                      void *stream);

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

#ifdef __cplusplus
}
#endif
#endif
