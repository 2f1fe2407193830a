/* gpu_internal.h — what the CUDA translation units share and C callers never
 * see: the error recorder behind gpu_last_error(), the activation of one
 * element, block reductions in a fixed order, a row held in one block's
 * registers (load, store, RMSNorm), the tensor-core batch. C++ (nvcc) only. */
#ifndef DF_CUDA_GPU_INTERNAL_H
#define DF_CUDA_GPU_INTERNAL_H
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "gpu.h"

/* DF_OK for cudaSuccess; else remembers "what: cuda text" for
 * gpu_last_error() and returns DF_ERR_NOMEM (allocation) or DF_ERR_IO. */
df_status gpu_cuda_status(cudaError_t e, const char *what);

/* units per second of op (bench's probes: bytes, FLOPs): six runs of op on
 * s timed between two events, the first a warm-up, the median of the other
 * five; 0 when an event cannot be made. When a run's timing fails, the
 * middle of the runs timed so far (unsorted) is used as it stands. */
template <typename Op> static double gpu_median_rate(cudaStream_t s, double units, Op op) {
    double t[5] = {0};
    cudaEvent_t e0 = NULL, e1 = NULL;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) goto out;
    for (int i = 0; i < 6; i++) {
        float ms = 0;
        cudaEventRecord(e0, s);
        op();
        cudaEventRecord(e1, s);
        if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) goto out;
        if (i) t[i - 1] = ms * 1e-3; /* the first one warms up */
    }
    for (int i = 1; i < 5; i++) /* sorted: t[2] the median */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
out:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    return t[2] > 0 ? units / t[2] : 0.0;
}

/* ffn.c's act_apply for one element (same formulas, CUDA's expf/tanhf):
 * the fused expert (gpu.cu) and the expert batch (gpu_experts.cu) share it,
 * so their hidden activations are bit-equal. */
static __device__ __forceinline__ float gpu_act1(const gpu_act &a, float g, float u) {
    if (!a.situ) return (g / (1.0f + expf(-g))) * u;
    const float b = a.beta, lb = a.linear_beta;
    float s = b * tanhf(g / b) * (1.0f / (1.0f + expf(-g)));
    float up = lb > 0 ? lb * tanhf(u / lb) : u;
    return s * up;
}

/* Block reductions in a fixed order (so results never depend on timing):
 * warp butterflies, then the warp sums in warp order. blockDim.x a
 * multiple of 32, <= 1024. Every thread gets the sums. */

/* v summed over a warp by a butterfly: every lane gets the same bits. */
static __device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* buf: shared, 33 doubles; reusable on return (the last barrier is inside). */
static __device__ __forceinline__ double block_sum1(double a, double *buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    a = warp_sum_d(a);
    if (lane == 0) buf[warp] = a;
    __syncthreads();
    if (warp == 0) {
        double x = warp_sum_d(lane < nw ? buf[lane] : 0.0);
        if (lane == 0) buf[32] = x;
    }
    __syncthreads();
    a = buf[32];
    __syncthreads();
    return a;
}

/* Both a and b; buf: shared, 66 doubles. */
static __device__ __forceinline__ void block_sum2(double &a, double &b, double *buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (lane == 0) {
        buf[warp] = a;
        buf[33 + warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        double x = lane < nw ? buf[lane] : 0.0, y = lane < nw ? buf[33 + lane] : 0.0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            x += __shfl_xor_sync(0xffffffffu, x, o);
            y += __shfl_xor_sync(0xffffffffu, y, o);
        }
        if (lane == 0) {
            buf[32] = x;
            buf[65] = y;
        }
    }
    __syncthreads();
    a = buf[32];
    b = buf[65];
    __syncthreads();
}

/* RMSNorm's 1 / sqrt(mean + eps) from a row's sum of squares. */
static __device__ __forceinline__ float norm_scale(double ss, int dim, float eps) {
    return (float)(1.0 / sqrt(ss / dim + (double)eps));
}

/* A row of up to 4 ROW_T ROW_V4 floats in the registers of one block of
 * ROW_T threads: thread i holds float4s i, i + ROW_T, ... (zero past the row).
 * A decode row is latency-bound on its one block, so every load of it is
 * issued at once. Rows must be 16-byte aligned with dim % 4 == 0. */
enum { ROW_T = 256, ROW_V4 = 8 };

/* Host side: 1 if rows of dim floats at these addresses (OR-ed together,
 * NULLs count as aligned) take the register kernels. */
static inline int row_fits(int64_t dim, uintptr_t addrs) {
    return dim % 4 == 0 && dim <= 4 * ROW_T * ROW_V4 && (addrs & 15) == 0;
}

static __device__ __forceinline__ void row_load(const float *x, int q, float4 (&v)[ROW_V4]) {
    const float4 *x4 = (const float4 *)x;
#pragma unroll
    for (int k = 0; k < ROW_V4; k++) {
        const int i = threadIdx.x + k * ROW_T;
        v[k] = i < q ? x4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

static __device__ __forceinline__ void row_store(float *x, int q, const float4 (&v)[ROW_V4]) {
    float4 *x4 = (float4 *)x;
#pragma unroll
    for (int k = 0; k < ROW_V4; k++) {
        const int i = threadIdx.x + k * ROW_T;
        if (i < q) x4[i] = v[k];
    }
}

/* This thread's sum of squares of its part of the row, in double, in k order. */
static __device__ __forceinline__ double row_sumsq(const float4 (&v)[ROW_V4]) {
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < ROW_V4; k++)
        ss += (double)v[k].x * v[k].x + (double)v[k].y * v[k].y + (double)v[k].z * v[k].z + (double)v[k].w * v[k].w;
    return ss;
}

/* out = v / sqrt(mean(v^2) + eps) (times w when set): the RMSNorm of
 * gpu_rmsnorm's row kernel (the sum of squares by block_sum1; x * inv,
 * then w * that, rounded each). buf: shared, 33 doubles. w's loads are all
 * issued before the reduction: loaded between the stores to out (which
 * the compiler cannot tell apart from w), each waited one round trip. */
static __device__ __forceinline__ void row_rmsnorm(const float4 (&v)[ROW_V4], int dim, const float *w, float eps,
                                                   float *out, double *buf) {
    const int q = dim >> 2;
    float4 g[ROW_V4];
    if (w) row_load(w, q, g);
    const float inv = norm_scale(block_sum1(row_sumsq(v), buf), dim, eps);
    float4 *o = (float4 *)out;
#pragma unroll
    for (int k = 0; k < ROW_V4; k++) {
        const int i = threadIdx.x + k * ROW_T;
        if (i >= q) break;
        float4 r = make_float4(__fmul_rn(v[k].x, inv), __fmul_rn(v[k].y, inv), __fmul_rn(v[k].z, inv),
                               __fmul_rn(v[k].w, inv));
        if (w) r = make_float4(__fmul_rn(g[k].x, r.x), __fmul_rn(g[k].y, r.y), __fmul_rn(g[k].z, r.z),
                               __fmul_rn(g[k].w, r.w));
        o[i] = r;
    }
}

/* One product of a tensor-core batch (gpu_tc_batch): Y0 = w0 X and, when
 * w1 is set, Y1 = w1 X (the two share X's split), for n vectors of X
 * (device, [n][cols]); Y rows at Y + i * ldy. */
typedef struct {
    const gpu_weight *w0, *w1;
    const float *X;
    int n;
    float *Y0, *Y1;
    int64_t ldy;
} gpu_tc_job;

/* bf16 on the tensor cores (gpu_bf16_tc.cu): Y = w0 X (w1 NULL), or
 * Y = act(w0 X, w1 X) for a gate and an up matrix of one shape, rows
 * [row0, row1), Y[v * ldy + r - row0]; X [n][cols] 16-byte aligned. limbs:
 * device scratch of gpu_bf16_tc_bytes(n, rows, cols, w1 ? 2 : 1) (rows of
 * w0, or more). wg: gpu_ws_wg's answer (may products of many vectors take
 * the wgmma blocks). Each output depends on its row and vector only
 * (bit-equal for any n, row range, wg or caller). gpu_bf16_tc_takes(w0)
 * must hold. Asynchronous on s. */
size_t gpu_bf16_tc_bytes(int n, int64_t rows, int64_t cols, int nm);
df_status gpu_bf16_tc(const gpu_weight *w0, const gpu_weight *w1, const gpu_act *act, const float *X, int n,
                      float *Y, int64_t ldy, int64_t row0, int64_t row1, void *limbs, int wg, cudaStream_t s);
/* Groups of such products in one call: for g < groups, rows [0, grows) of
 * the matrix w's rows woff + g wpitch .. (a head's block of kv_b, say)
 * times X_g = X + g n cols ([n][cols], X 16-byte aligned) into
 * Y_g[v * ldy + r], Y_g = Y + g ygs. Each output has the bits gpu_bf16_tc
 * gives it with those rows as a matrix of grows rows (its slices by that
 * shape), whatever wg says: one wgmma launch for all groups where the
 * blocks run (wg >= 0), else gpu_bf16_tc per group. limbs: device scratch
 * of gpu_bf16_tc_groups_bytes. Asynchronous on s. */
size_t gpu_bf16_tc_groups_bytes(int groups, int n, int64_t grows, int64_t cols);
df_status gpu_bf16_tc_groups(const gpu_weight *w, int64_t woff, int64_t wpitch, int64_t grows, int groups,
                             const float *X, int n, float *Y, int64_t ygs, int64_t ldy, void *limbs, int wg,
                             cudaStream_t s);
/* Slices of a bf16 row on the tensor cores, from its shape alone (rows,
 * 64-column chunks): part of every such output's order of operations. */
int gpu_bf16_slices(int64_t rows, int64_t nch);
/* The same products on Hopper's wgmma (gpu_bf16_wg.cu), the same bits as
 * gpu_bf16_tc's mma.sync kernels: Y = w0 X (Y, rows and X as there; X
 * 8-byte aligned) and, when w1 is set (its shape w0's), U = w1 X in rows of
 * row1 - row0 (no act: the caller applies it). limbs: device scratch of
 * gpu_bf16_wg_bytes(n, cols). Asynchronous on s. */
size_t gpu_bf16_wg_bytes(int n, int64_t cols);
df_status gpu_bf16_wg(const gpu_weight *w0, const gpu_weight *w1, const float *X, int n, float *Y, int64_t ldy,
                      float *U, int64_t row0, int64_t row1, void *limbs, cudaStream_t s);
/* gpu_bf16_tc_groups' wgmma launch (X 8-byte aligned; limbs of
 * gpu_bf16_wg_groups_bytes); DF_ERR_UNSUPPORTED where a tensor map cannot
 * be made or a count passes TMA's or the grid's limits. */
size_t gpu_bf16_wg_groups_bytes(int groups, int n, int64_t cols);
df_status gpu_bf16_wg_groups(const gpu_weight *w, int64_t woff, int64_t wpitch, int64_t grows, int groups,
                             const float *X, int n, float *Y, int64_t ygs, int64_t ldy, void *limbs, cudaStream_t s);
/* The tensor-core probe's wgmma kernel (gpu_bf16_wg.cu; gpu_tc_probe
 * times it): blocks x iters x 8 x 2 warpgroups of m64n256k16 bf16 wgmma on
 * s, their FLOPs in *flops; DF_ERR_UNSUPPORTED where k_bt_wg cannot run. */
df_status gpu_wg_probe_launch(int blocks, int iters, float *out, double *flops, cudaStream_t s);
/* A batch's many-vector products on the fragment layout on wgmma
 * (gpu_mx_wg.cu), the same bits as gpu_mma.cu's kernels: t's count items
 * (each in the fragment layout, at most GPU_MX_WG_PASS vectors, their
 * splits in wgmma's order), all rows x cols; ks: the k split's classes of
 * that shape (4 or 8). DF_ERR_UNSUPPORTED without an sm_90a build (the
 * caller asks gpu_ws_wg_present first). Asynchronous on s. */
enum { GPU_MX_WG_PASS = 48, GPU_MX_WG_NV = 16 }; /* vectors an item; a launch's n: its largest item's, rounded up to GPU_MX_WG_NV */
struct gpu_tc_tab;
df_status gpu_mx_wg_batch(const gpu_tc_tab &t, int count, int64_t cols, int64_t rows, int ks, cudaStream_t s);
/* Device scratch bytes gpu_tc_batch needs for these jobs. */
size_t gpu_tc_batch_bytes(const gpu_tc_job *jobs, int njobs);
/* gpu_matmul_tc for every job in few launches (one split launch, one mma
 * launch per 64 products): every job's matrices MXFP4 of one shape (else
 * DF_ERR_ARG). Each output row is bit-equal to gpu_matmul_tc's for that
 * matrix and vector (the same kernel body, split and work layout).
 * scratch: device, gpu_tc_batch_bytes. xs: gpu_ws.frag_xs; wg: gpu_ws.frag_wg
 * where gpu_ws_wg_present, else -1. Asynchronous on s. */
df_status gpu_tc_batch(const gpu_tc_job *jobs, int njobs, void *scratch, int xs, int wg, cudaStream_t s);

/* The three bf16 limbs of eight floats (gpu_bf16_tc.cu, gpu_bf16_wg.cu):
 * hi = rn(x), mid = rn(x - hi), lo = rn(x - hi - mid), each as four u32
 * (value 2i low, 2i + 1 high), two values per conversion (cvt.rn.bf16x2.f32,
 * round to nearest even). */
static __device__ __forceinline__ void bf16_limbs8(const float4 &a, const float4 &b, uint32_t *h, uint32_t *m, uint32_t *l) {
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float x0 = v[2 * i], x1 = v[2 * i + 1];
        const __nv_bfloat162 bh = __floats2bfloat162_rn(x0, x1);
        const float r0 = __fsub_rn(x0, __low2float(bh)), r1 = __fsub_rn(x1, __high2float(bh));
        const __nv_bfloat162 bm = __floats2bfloat162_rn(r0, r1);
        const __nv_bfloat162 bl =
            __floats2bfloat162_rn(__fsub_rn(r0, __low2float(bm)), __fsub_rn(r1, __high2float(bm)));
        h[i] = *reinterpret_cast<const uint32_t *>(&bh);
        m[i] = *reinterpret_cast<const uint32_t *>(&bm);
        l[i] = *reinterpret_cast<const uint32_t *>(&bl);
    }
}

/* The PTX the tensor-core kernels share (gpu_mma.cu, gpu_bf16_tc.cu). */
/* d += A B, m16n8k16, fp32 accumulators; A, B f16 (mma_f16) or bf16 (mma_bf16). */
static __device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
static __device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
/* 16-byte global -> shared copy that bypasses L1; src_bytes < 16 zero-fills. */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes));
}
static __device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
/* waits until at most N of this thread's committed groups are in flight */
template <int N> static __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
#endif
