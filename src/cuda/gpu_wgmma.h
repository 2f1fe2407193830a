/* gpu_wgmma.h — the PTX of Hopper's warpgroup tensor-core instructions that
 * the wgmma kernels share (gpu_bf16_wg.cu, gpu_mx_wg.cu): descriptors,
 * fences, groups, and the register hold that keeps the compiler from moving
 * accumulator reads or writes across an asynchronous wgmma.
 * Refuses: nothing; WG_DEVICE is 1 only in a pass compiled for sm_90a (the
 * Makefile builds these files for sm_90a alone), and the helpers exist only
 * there.
 */
#ifndef DF_GPU_WGMMA_H
#define DF_GPU_WGMMA_H

#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_DEVICE 1 /* this pass compiles for sm_90a: wgmma exists */
#else
#define WG_DEVICE 0
#endif

#if WG_DEVICE
namespace {
/* wgmma's shared-memory matrix descriptor: no swizzle, K-major; lbo the byte
 * step between core matrices along k, sbo along the vectors. */
__device__ __forceinline__ uint64_t wg_desc(const void *smem, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a & 0x3ffff) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/* keeps the compiler from moving accumulator reads or writes across a wgmma */
template <int R> __device__ __forceinline__ void wg_hold(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

} // namespace
#endif

#endif
