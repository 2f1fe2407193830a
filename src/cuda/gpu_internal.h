/* gpu_internal.h — what the CUDA translation units share and C callers never
 * see: the error recorder behind gpu_last_error(). C++ (nvcc) only. */
#ifndef DF_CUDA_GPU_INTERNAL_H
#define DF_CUDA_GPU_INTERNAL_H
#include <cuda_runtime.h>
#include "gpu.h"

/* DF_OK for cudaSuccess; else remembers "what: cuda text" for
 * gpu_last_error() and returns DF_ERR_NOMEM (allocation) or DF_ERR_IO. */
df_status gpu_cuda_status(cudaError_t e, const char *what);

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

/* Device scratch bytes gpu_tc_batch needs for these jobs. */
size_t gpu_tc_batch_bytes(const gpu_tc_job *jobs, int njobs);
/* gpu_matmul_tc for every job in few launches (one split launch, one mma
 * launch per 64 products): every job's matrices MXFP4 of one shape (else
 * DF_ERR_ARG). Each output row is bit-equal to gpu_matmul_tc's for that
 * matrix and vector (the same kernel body, split and work layout).
 * scratch: device, gpu_tc_batch_bytes. Asynchronous on s. */
df_status gpu_tc_batch(const gpu_tc_job *jobs, int njobs, void *scratch, cudaStream_t s);

#endif
