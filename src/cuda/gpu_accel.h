/* gpu_accel.h — the CUDA df_accel (include/deltafin.h) over the gpu_ kernels.
 *
 * Owns: two CUDA streams (products; weight uploads), pinned host staging
 * for activations and results, device activation buffers (grown on demand),
 * the expert queue's buffers, and the device copies it hands out as handles.
 * Matrix products use gpu_matmul_tc (MXFP4 on the tensor cores) and
 * gpu_matmul (bf16, fp8 block, int4 g32); other types are refused (the
 * engine keeps them on the CPU).
 *
 * Uploads run on the copy stream and record an event per copy; products
 * wait for it on the device, so an upload overlaps whatever runs before its
 * first use. Routed experts are queued (expert_queue: x up, gpu_expert =
 * gate/up + activation fused then down, y back to pinned memory) and the
 * host waits once per batch (expert_finish), not once per expert. A released
 * copy records an event on the product stream; up to 32 released copies of
 * at most 64 MiB stay allocated as spares, and refilling one waits for that
 * event on the copy stream (no queued product ever reads bytes of the next
 * matrix). Spares are given back when an allocation fails, so the budget can
 * be exceeded by at most those spares. Weight bytes are copied from wherever
 * the engine has them; the engine page-locks the expert cache through pin
 * (cudaHostRegister), so expert uploads run at the DMA rate and truly
 * asynchronously. KDA (state_new / kda): a session's per-layer states live
 * in device memory with device copies of each layer's parameters taken at
 * state_new; a step stages q, k, v, f, gate and beta logits through pinned
 * memory in one copy, runs gpu_kda, and returns o (head dims without a
 * kernel are refused at state_new: the engine keeps those states on the
 * CPU). Fewer host round trips (issue 15): matmul_many (several products,
 * one wait), kda_layer / mla_layer (a whole attention layer, activations
 * kept on the device), the expert queue launched as one gpu_experts batch
 * at finish, and moe_tail (a latent MoE layer's weighted sum, norm, lat_up
 * and shared add on the device); read_gbps is bench's HBM probe. The dev_
 * hooks keep a decode step's activations on the device (dev_alloc blocks;
 * the other hooks read and write such pointers in place and wait only when
 * an output is for host memory or a staged input must be read first); a
 * resident copy's upload, once seen complete, costs no stream wait.
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
 * (0: free memory minus 2 GiB). bf16_tc_rows: bf16 products of at least
 * this many rows on the tensor cores (gpu_ws), 0: never; bf16_wg: those of
 * many rows on the wgmma blocks, gpu_ws.bf16_wg's 0 auto, 1 on, -1 off;
 * mx_wg: the MXFP4 expert batches of many rows on wgmma, gpu_ws.frag_wg's
 * 0 (the build's default), 1, -1. NULL with one line in err (DF_ERRMSG)
 * when there is no usable device. */
const df_accel *gpu_accel_open(int device, int64_t gpu_mem, int bf16_tc_rows, int bf16_wg, int mx_wg, char *err);
/* Frees everything the accelerator holds (NULL-safe). Close engines first. */
void gpu_accel_close(const df_accel *a);

#ifdef __cplusplus
}
#endif
#endif
