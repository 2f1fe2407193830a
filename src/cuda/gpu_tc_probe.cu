/* gpu_tc_probe.cu — the tensor cores' measured bf16 rate (gpu_tc_probe,
 * gpu.h): bench's floor for a prompt on the device, as the DRAM and FMA
 * probes are the CPU's and k_read_probe the device's read floor.
 *
 * Owns: the mma.sync probe kernel and the probe of both forms (the wgmma
 * kernel lives in gpu_bf16_wg.cu, the only file built for sm_90a; the
 * timing is gpu_median_rate, the device read probe's too).
 * Refuses: nothing; a form the device or build lacks reads 0.
 *
 * Both kernels run independent chains of one instruction on operands whose
 * values do not change its rate, enough warps to fill every SM, and keep
 * the results alive by a sum that is never written in practice. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_internal.h"

namespace {

enum { TP_WARPS = 8, TP_CHAINS = 8, TP_BLOCKS_PER_SM = 4 };

/* Each warp: iters x TP_CHAINS m16n8k16 bf16 mma.sync, TP_CHAINS
 * independent accumulators (2 x 16 x 8 x 16 FLOPs each). */
__global__ void __launch_bounds__(TP_WARPS * 32) k_tc_probe(int iters, float *out) {
    const uint32_t a = 0x3f803f80u ^ (threadIdx.x & 7); /* bf16 pairs near 1 */
    float d[TP_CHAINS][4];
#pragma unroll
    for (int j = 0; j < TP_CHAINS; j++) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int j = 0; j < TP_CHAINS; j++) mma_bf16(d[j], a, a ^ 1u, a ^ 2u, a ^ 3u, a ^ (uint32_t)j, a);
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < TP_CHAINS; j++) sum += (d[j][0] + d[j][1]) + (d[j][2] + d[j][3]);
    if (sum == 1234.5f) out[0] = sum;
}

} // namespace

extern "C" df_status gpu_tc_probe(void *stream, double *sync_tflops, double *wg_tflops) {
    const cudaStream_t s = (cudaStream_t)stream;
    *sync_tflops = *wg_tflops = 0;
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) ||
        sms < 1)
        return gpu_cuda_status(cudaGetLastError(), "tc probe: device");
    float *out = NULL;
    if (cudaMalloc((void **)&out, sizeof *out) != cudaSuccess) return gpu_cuda_status(cudaGetLastError(), "tc probe");
    /* ~5-10 ms a launch at 600-1000 TFLOP/s on 132 SMs. The thirty-second
     * session's 48 and 8 iterations made launches of ~20-30 us, which read
     * 330-364 (mma.sync) and 593-660 TFLOP/s where cuda_bench's long
     * mma.sync loop had read 595-629: likely the launch's ramp, not the
     * rate (not yet measured at this length). A first launch checks each
     * form (and says its FLOPs), then the timed ones. */
    const int blocks = sms * TP_BLOCKS_PER_SM, iters = 48 * 256, wg_iters = 8 * 256;
    const double sync_flops = (double)blocks * TP_WARPS * iters * TP_CHAINS * 2.0 * 16 * 8 * 16;
    auto sync_launch = [&] { k_tc_probe<<<(unsigned)blocks, TP_WARPS * 32, 0, s>>>(iters, out); };
    sync_launch();
    df_status st = gpu_cuda_status(cudaGetLastError(), "k_tc_probe");
    if (st == DF_OK) *sync_tflops = gpu_median_rate(s, sync_flops, sync_launch) / 1e12;
    double wg_flops = 0;
    const df_status wst = st == DF_OK ? gpu_wg_probe_launch(sms * 2, wg_iters, out, &wg_flops, s) : DF_ERR_UNSUPPORTED;
    if (wst == DF_OK)
        *wg_tflops = gpu_median_rate(s, wg_flops, [&] { gpu_wg_probe_launch(sms * 2, wg_iters, out, &wg_flops, s); }) / 1e12;
    else if (wst != DF_ERR_UNSUPPORTED)
        st = wst;
    cudaFree(out);
    return st;
}
