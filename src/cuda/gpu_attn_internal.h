/* gpu_attn_internal.h — what the attention step's CUDA files share
 * (gpu_kda.cu, gpu_mla.cu, gpu_attn_res.cu): launch checks, shared-memory
 * opt-in, the split workspace's growth, and two scalar activations.
 * Included by those files only (gpu.cu keeps its own launch helpers).
 */
#pragma once
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_internal.h"

static inline df_status launched(const char *what) { return gpu_cuda_status(cudaGetLastError(), what); }

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Dynamic shared memory above the default 48 KB must be asked for. */
template <typename K> static inline df_status smem_opt_in(K kernel, size_t bytes, const char *what) {
    if (bytes <= 48 * 1024) return DF_OK;
    return gpu_cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                           what);
}

/* Grows ws to at least need bytes (its contents are not kept). */
static inline df_status ws_reserve(gpu_ws *ws, size_t need, const char *what) {
    if (ws->cap >= need) return DF_OK;
    gpu_ws_free(ws);
    df_status st = gpu_cuda_status(cudaMalloc(&ws->buf, need), what);
    if (st) {
        ws->buf = NULL;
        return st;
    }
    ws->cap = need;
    return DF_OK;
}

static __device__ __forceinline__ float sigmoid1(float x) { return 1.0f / (1.0f + expf(-x)); }
static __device__ __forceinline__ float silu1(float x) { return x / (1.0f + expf(-x)); }
