/* gpu_tc_probe.cu — the tensor cores' measured bf16 rate (gpu_tc_probe,
 * gpu.h): bench's floor for a prompt on the device, as the DRAM and FMA
 * probes are the CPU's and k_read_probe the device's read floor.
 *
 * Owns: the mma.sync probe kernel and the timing of both probes (the wgmma
 * kernel lives in gpu_bf16_wg.cu, the only file built for sm_90a).
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

void sort5(double t[5]) {
    for (int i = 1; i < 5; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
}

/* TFLOP/s of launch(): one warm-up, the median of five timed runs;
 * launch returns DF_OK and its FLOPs, or a status that ends the probe. */
template <typename Launch> df_status median_tflops(cudaStream_t s, Launch launch, double *tflops) {
    *tflops = 0;
    double t[5] = {0}, flops = 0;
    cudaEvent_t e0 = NULL, e1 = NULL;
    df_status st = DF_OK;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
        st = gpu_cuda_status(cudaGetLastError(), "tc probe events");
        goto out;
    }
    for (int i = 0; i < 6; i++) {
        float ms = 0;
        cudaEventRecord(e0, s);
        if ((st = launch(&flops)) != DF_OK) goto out;
        cudaEventRecord(e1, s);
        cudaError_t e = cudaEventSynchronize(e1);
        if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
        if (e != cudaSuccess) {
            st = gpu_cuda_status(e, "tc probe");
            goto out;
        }
        if (i) t[i - 1] = ms * 1e-3; /* the first one warms up */
    }
    sort5(t);
    if (t[2] > 0) *tflops = flops / t[2] / 1e12;
out:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    return st;
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
    /* ~10 ms a launch at ~600 TFLOP/s (mma.sync) and ~800 (wgmma) on 132 SMs */
    const int blocks = sms * TP_BLOCKS_PER_SM;
    df_status st = median_tflops(
        s,
        [&](double *flops) {
            k_tc_probe<<<(unsigned)blocks, TP_WARPS * 32, 0, s>>>(48, out);
            *flops = (double)blocks * TP_WARPS * 48 * TP_CHAINS * 2.0 * 16 * 8 * 16;
            return gpu_cuda_status(cudaGetLastError(), "k_tc_probe");
        },
        sync_tflops);
    if (st == DF_OK) {
        st = median_tflops(s, [&](double *flops) { return gpu_wg_probe_launch(sms * 2, 8, out, flops, s); },
                           wg_tflops);
        if (st == DF_ERR_UNSUPPORTED) st = DF_OK, *wg_tflops = 0;
    }
    cudaFree(out);
    return st;
}
