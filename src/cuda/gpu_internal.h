/* gpu_internal.h — what the CUDA translation units share and C callers never
 * see: the error recorder behind gpu_last_error(). C++ (nvcc) only. */
#ifndef DF_CUDA_GPU_INTERNAL_H
#define DF_CUDA_GPU_INTERNAL_H
#include <cuda_runtime.h>
#include "gpu.h"

/* DF_OK for cudaSuccess; else remembers "what: cuda text" for
 * gpu_last_error() and returns DF_ERR_NOMEM (allocation) or DF_ERR_IO. */
df_status gpu_cuda_status(cudaError_t e, const char *what);

#endif
