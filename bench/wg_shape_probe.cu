/* wg_shape_probe.cu — the wgmma issue patterns of the prompt's bf16 blocks
 * (k_bt_wg, src/cuda/gpu_bf16_wg.cu) timed with no memory traffic: how fast
 * can the tensor cores take m64nNk16 bf16 wgmma when A comes from registers
 * (k_bt_wg's weights) or shared memory, with k_bt_wg's warpgroups a block
 * and its commit / wait pattern (12 wgmma a chunk, wait_group 1), against
 * the widest form (m64n256k16, both from shared memory: gpu_tc_probe's).
 * A measurement tool, not part of the engine: if a pattern's ceiling is far
 * below the widest form's, the blocks' shape caps them; if near it, their
 * loss is in feeding and synchronising the chunks.
 *
 *   make cuda   (builds it as build/wg_shape_probe; by hand:
 *   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Isrc/cuda -o build/wg_shape_probe bench/wg_shape_probe.cu)
 *   build/wg_shape_probe [ITERS]
 *
 * Operands are zeros (their values do not change the rate); a sum of the
 * accumulators that is never 1234.5 keeps the work. TFLOP/s = 2 m n k a
 * wgmma, timed by gpu_median_rate (the median of 5 launches after a warm-up).
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "gpu_internal.h" /* gpu_median_rate */
#include "gpu_wgmma.h"

#if WG_DEVICE
/* the SS forms of n = 64 and 128 (A from a descriptor too); the RS forms and
 * m64n256k16 SS are gpu_wgmma.h's (wg_mma, wg_mma_ss256) */
template <int N> struct mma_ss;
template <> struct mma_ss<64> {
    static __device__ __forceinline__ void run(float (&d)[32], uint64_t a, uint64_t b) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                     "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
                     "%32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
                     : "l"(a), "l"(b));
    }
};
template <> struct mma_ss<128> {
    static __device__ __forceinline__ void run(float (&d)[64], uint64_t a, uint64_t b) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                     "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                     "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                     "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
                     "%64, %65, p, 1, 1, 0, 0;\n}\n"
                     : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
                     : "l"(a), "l"(b));
    }
};
template <> struct mma_ss<256> {
    static __device__ __forceinline__ void run(float (&d)[128], uint64_t a, uint64_t b) { wg_mma_ss256(d, a, b); }
};
#endif

enum { SMEM = 64 * 1024 };

/* WG warpgroups a block, each iters chunks of 12 wgmma m64nNk16 (RS: A from
 * registers, as k_bt_wg, n 64 or 128; else SS), committed a chunk, waiting
 * with wait_group W (k_bt_wg: 1) before the next chunk's. */
template <int N, int WG, int RS, int W>
__global__ void __launch_bounds__(WG * 128, 1) k_shape(int iters, float *out) {
#if WG_DEVICE
    extern __shared__ __align__(1024) uint8_t sm[];
    for (int i = threadIdx.x; i < SMEM / 16; i += blockDim.x) ((uint4 *)sm)[i] = make_uint4(0, 0, 0, 0);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int wg = threadIdx.x >> 7;
    /* each warpgroup its own A and B tiles (one k step's; every wgmma reads them) */
    uint8_t *base = sm + (size_t)wg * (SMEM / WG);
    const uint64_t a = wg_desc(base, 128, 256), b = wg_desc(base + 2048, N * 16, 128);
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) d[i] = 0.0f;
    uint32_t r[4] = {threadIdx.x & 1u, 0, 0, 0};
    for (int it = 0; it < iters; it++) {
        wg_fence();
        wg_hold(d);
#pragma unroll
        for (int j = 0; j < 12; j++) {
            if constexpr (RS) wg_mma(d, r[0], r[1], r[2], r[3], b);
            else mma_ss<N>::run(d, a, b);
        }
        wg_commit();
        wg_wait<W>();
        wg_hold(d);
    }
    wg_wait<0>();
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < N / 2; i++) s += d[i];
    if (s == 1234.5f) out[0] = s;
#endif
}

template <int N, int WG, int RS, int W> static void run(const char *name, int sms, int iters, float *out) {
    auto k = k_shape<N, WG, RS, W>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    const double flops = (double)sms * WG * iters * 12 * 2.0 * 64 * N * 16;
    const double rate = gpu_median_rate(0, flops, [&] { k<<<sms, WG * 128, SMEM>>>(iters, out); });
    cudaError_t e = cudaGetLastError();
    printf("%-44s %8.1f TFLOP/s%s%s\n", name, rate / 1e12, e ? "  error: " : "", e ? cudaGetErrorString(e) : "");
}

int main(int argc, char **argv) {
    const int iters = argc > 1 ? atoi(argv[1]) : 4096;
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    float *out = NULL;
    cudaMalloc((void **)&out, 4);
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    printf("%s, %d SMs, one block an SM, %d chunks of 12 wgmma a warpgroup\n", p.name, sms, iters);
    run<256, 2, 0, 0>("m64n256k16 SS, 2 warpgroups, wait 0 (the probe)", sms, iters, out);
    run<64, 4, 1, 1>("m64n64k16  RS, 4 warpgroups, wait 1 (k_bt_wg)", sms, iters, out);
    run<64, 4, 1, 0>("m64n64k16  RS, 4 warpgroups, wait 0", sms, iters, out);
    run<64, 4, 0, 1>("m64n64k16  SS, 4 warpgroups, wait 1", sms, iters, out);
    run<64, 2, 1, 1>("m64n64k16  RS, 2 warpgroups, wait 1", sms, iters, out);
    run<128, 4, 1, 1>("m64n128k16 RS, 4 warpgroups, wait 1", sms, iters, out);
    run<128, 2, 1, 1>("m64n128k16 RS, 2 warpgroups, wait 1", sms, iters, out);
    run<128, 2, 0, 1>("m64n128k16 SS, 2 warpgroups, wait 1", sms, iters, out);
    cudaFree(out);
    return 0;
}
