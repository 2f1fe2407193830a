/* gpu_accel.h — the CUDA df_accel (include/deltafin.h) over the gpu_ kernels.
 *
 * Owns: one CUDA stream, pinned host staging for activations and results,
 * device activation buffers (grown on demand), and the device copies it
 * hands out as handles. Matrix products use gpu_matmul_tc (MXFP4 on the
 * tensor cores) and gpu_matmul (bf16, fp8 block, int4 g32); other types are
 * refused (the engine keeps them on the CPU). Routed experts go through the
 * expert hook: gpu_expert (gate/up + activation fused, then down) with one
 * round trip per expert. Weight bytes are copied from
 * wherever the engine has them (mapped shards, expert cache slots) with
 * cudaMemcpy; the engine page-locks the expert cache through pin
 * (cudaHostRegister), so expert uploads run at the DMA rate instead of
 * through the driver's pageable bounce buffers. Up to 32 released copies of
 * at most 64 MiB stay allocated for the next upload of the same size (an
 * expert swap then costs one copy, no cudaMalloc / cudaFree); they are given
 * back when an allocation fails, so the budget can be exceeded by at most
 * those spares.
 */
#ifndef DF_CUDA_GPU_ACCEL_H
#define DF_CUDA_GPU_ACCEL_H
#include "deltafin.h"
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Opens device `device`. gpu_mem: bytes of device memory for matrices
 * (0: free memory minus 2 GiB). NULL with one line in err (DF_ERRMSG) when
 * there is no usable device. */
const df_accel *gpu_accel_open(int device, int64_t gpu_mem, char *err);
/* Frees everything the accelerator holds (NULL-safe). Close engines first. */
void gpu_accel_close(const df_accel *a);

#ifdef __cplusplus
}
#endif
#endif
