/* cuda_bench.cu — bandwidth of the CUDA kernels against the device's own
 * measured ceilings (built by `make cuda` as build/cuda_bench).
 *
 *   build/cuda_bench [GB per matrix, default 2] [quick | experts | prefill | vec | wg]
 *
 * Measures, in one process: device-to-device copy (bytes read + written),
 * a read-only probe kernel, host-to-device from pinned and from pageable
 * memory; then gpu_matmul per weight type on a cols = 7168 matrix of the
 * given size (far larger than L2) at n = 1, 8, 64, and a K3-shaped MXFP4
 * expert (7168 x 1536, 17.55 MB) over 64 distinct experts, one by one and
 * as layer batches of 16 (gpu_experts; `experts`: ceilings and these
 * only). `vec`: every bf16 shape of a K3 decode step at n = 1, 2, 4, 8 on
 * the tensor cores and on the CUDA cores (copies of small matrices, so
 * that they come from HBM, not L2). `wg`: K3's bf16 prompt shapes at n = 64
 * .. 512 through gpu_bf16_tc's mma.sync blocks and through the wgmma blocks
 * (gpu_ws.bf16_wg -1 and 1), their outputs compared bit for bit. Weights are
 * random (never zeros). Times are medians of CUDA-event-timed repeats after
 * a warm-up. GB = 1e9 bytes.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#include "../src/cuda/gpu.h"

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)
#define DK(x)                                                                              \
    do {                                                                                   \
        df_status s_ = (x);                                                                \
        if (s_ != DF_OK) {                                                                 \
            fprintf(stderr, "%s:%d: %s: status %d %s\n", __FILE__, __LINE__, #x, (int)s_,  \
                    gpu_last_error());                                                     \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

/* Median seconds of fn() over reps, after warm-ups, timed with events. */
template <class F> static double time_it(F fn, int warm, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < warm; i++) fn();
    CK(cudaDeviceSynchronize());
    std::vector<double> t;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a));
        fn();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1e-3);
    }
    CK(cudaGetLastError());
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return median(t);
}

static __device__ uint32_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

enum { F_RAW, F_BF16, F_FP8, F_E8M0, F_BF16SCALE, F_F32SCALE, F_FLOAT };

/* Random but valid contents: finite bf16 in (-1, 1), fp8 without NaN codes,
 * e8m0 in [118, 129], positive small scales. */
__global__ void k_fill(uint32_t *p, size_t n, uint64_t seed, int mode) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t r = mix(seed * 0x9e3779b97f4a7c15ull + i);
        uint32_t v = r;
        switch (mode) {
        case F_BF16: { /* two bf16: sign, exponent 118..125, random mantissa */
            uint32_t lo = (r & 0x807f) | ((118 + (r >> 8) % 8) << 7);
            uint32_t r2 = mix(i ^ 0x1234567ull ^ seed);
            uint32_t hi = (r2 & 0x807f) | ((118 + (r2 >> 8) % 8) << 7);
            v = lo | (hi << 16);
            break;
        }
        case F_FP8: v = r & ~0x01010101u; break; /* low mantissa bit 0: never 0x7f/0xff */
        case F_E8M0: {
            v = 0;
            for (int k = 0; k < 4; k++) v |= (118u + ((r >> (8 * k)) & 0xff) % 12) << (8 * k);
            break;
        }
        case F_BF16SCALE: v = 0x3c003c00u | (r & 0x007f007fu); break; /* ~0.0078..0.0156 */
        case F_F32SCALE: v = 0x3b800000u | (r & 0x007fffffu); break;
        case F_FLOAT: v = __float_as_uint((float)(r >> 8) * 0x1p-23f - 1.0f); break;
        default: break;
        }
        p[i] = v;
    }
}

static void fill(void *p, size_t bytes, uint64_t seed, int mode) {
    k_fill<<<4096, 256>>>((uint32_t *)p, bytes / 4, seed, mode);
    CK(cudaGetLastError());
}

/* Reads every 16 bytes of p; writes only if the xor of all is a magic value. */
__global__ void k_read(const uint4 *p, size_t n, uint32_t *sink) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;
}

static void make_weight(wt_type t, int64_t rows, int64_t cols, gpu_weight *g, uint64_t seed) {
    df_weight w;
    memset(&w, 0, sizeof w);
    w.type = t;
    w.rows = rows;
    w.cols = cols;
    w.scale_dtype = DT_BF16;
    w.block_rows = w.block_cols = 128;
    char err[DF_ERRMSG] = "";
    if (gpu_weight_alloc(&w, g, err)) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
    int dm = t == WT_BF16 ? F_BF16 : t == WT_FP8_BLOCK ? F_FP8 : F_RAW;
    fill(g->data, (size_t)g->data_bytes, seed, dm);
    if (g->scale_bytes) {
        int sm = t == WT_MXFP4 ? F_E8M0 : t == WT_FP8_BLOCK || t == WT_I8_ROW ? F_F32SCALE : F_BF16SCALE;
        fill(g->scale, (size_t)g->scale_bytes, seed + 1, sm);
    }
}

static const char *tname(wt_type t) {
    return t == WT_BF16 ? "bf16" : t == WT_FP8_BLOCK ? "fp8-block" : t == WT_INT4_G32 ? "int4-g32" : t == WT_I8_ROW ? "i8-row" : "mxfp4";
}

/* bf16 mma.sync m16n8k16 on registers only: the tensor cores' rate for the
 * instruction the bf16 kernels use (FLOP/s). */
__global__ void k_mma_peak(float *out, int iters) {
    uint32_t a = threadIdx.x * 0x00010001u, b = 0x3f803f80u;
    float d[8][4] = {};
    for (int i = 0; i < iters; i++)
#pragma unroll
        for (int k = 0; k < 8; k++)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(d[k][0]), "+f"(d[k][1]), "+f"(d[k][2]), "+f"(d[k][3])
                         : "r"(a), "r"(a), "r"(a), "r"(a), "r"(b), "r"(b));
    float s = 0;
    for (int k = 0; k < 8; k++) s += d[k][0] + d[k][1] + d[k][2] + d[k][3];
    if (s == 12345.0f) out[0] = s;
}
static double mma_peak() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float *o;
    CK(cudaMalloc(&o, 4));
    const int iters = 4096, blocks = sms * 4;
    double t = time_it([&] { k_mma_peak<<<blocks, 256>>>(o, iters); }, 1, 5);
    CK(cudaFree(o));
    return (double)blocks * 8 * iters * 8 * 4096.0 / t;
}

/* L2 -> SM read probe: the blocks read a 16 MB buffer (far below L2) again
 * and again, 16 bytes a thread a load, L1 bypassed. */
__global__ void __launch_bounds__(512) k_l2_probe(const uint4 *__restrict__ p, uint32_t mask, int reps,
                                                 uint32_t *out) {
    uint32_t acc = 0, i = blockIdx.x * 512u * 64u + threadIdx.x;
    for (int r = 0; r < reps; r++)
#pragma unroll 8
        for (int k = 0; k < 64; k++, i += 512) {
            const uint4 v = __ldcg(p + (i & mask));
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    if (acc == 0x12345678u) out[0] = acc;
}

/* `wg`: gpu_bf16_tc's mma.sync blocks against its wgmma blocks, bits and time */
static int wg_bench() {
    {
        int sms = 0;
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const size_t bytes = (size_t)16 << 20;
        uint4 *p;
        uint32_t *o;
        CK(cudaMalloc(&p, bytes));
        CK(cudaMalloc(&o, 4));
        CK(cudaMemset(p, 1, bytes));
        const int reps = 64;
        for (int bps : {1, 2, 4}) {
            double t = time_it([&] { k_l2_probe<<<sms * bps, 512>>>(p, (uint32_t)(bytes / 16 - 1), reps, o); }, 2, 7);
            printf("L2 read probe (16 MB, %d blocks of 512 an SM): %.0f GB/s\n", bps,
                   (double)sms * bps * 512 * 64 * reps * 16 / t / 1e9);
        }
        CK(cudaFree(p));
        CK(cudaFree(o));
    }
    struct { int64_t rows, cols; const char *what; } sh[] = {
        {12288, 7168, "KDA q/k/v/g"}, {7168, 12288, "o_proj"}, {6144, 7168, "shared gate"}, {1536, 7168, "q_a"}};
    const int ns[] = {64, 70, 128, 256, 512};
    float *dX, *dY, *dY2;
    CK(cudaMalloc(&dX, (size_t)512 * 12288 * 4));
    CK(cudaMalloc(&dY, (size_t)512 * 12288 * 4));
    CK(cudaMalloc(&dY2, (size_t)512 * 12288 * 4));
    fill(dX, (size_t)512 * 12288 * 4, 9, F_FLOAT);
    gpu_ws wm = {NULL, 0, 1, -1, 0, 0, 0}, wg = {NULL, 0, 1, 1, 0, 0, 0}; /* mma.sync blocks only / wgmma blocks always */
    printf("wgmma blocks present: %s\n", gpu_ws_wg(&wg) > 0 ? "yes" : "no");
    std::vector<float> a((size_t)512 * 12288), b(a.size());
    for (auto &m : sh) {
        gpu_weight g;
        make_weight(WT_BF16, m.rows, m.cols, &g, 300 + (int)m.rows);
        const double fl = 2.0 * m.rows * m.cols;
        for (int n : ns) {
            const size_t cnt = (size_t)n * m.rows;
            double to = time_it([&] { DK(gpu_matmul_tc(&g, dX, n, dY, m.rows, 0, m.rows, &wm, NULL)); }, 2, 7);
            CK(cudaMemcpy(a.data(), dY, cnt * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemset(dY2, 0xff, cnt * 4));
            DK(gpu_matmul_tc(&g, dX, n, dY2, m.rows, 0, m.rows, &wg, NULL));
            CK(cudaMemcpy(b.data(), dY2, cnt * 4, cudaMemcpyDeviceToHost));
            size_t diff = 0;
            for (size_t i = 0; i < cnt; i++) diff += memcmp(&a[i], &b[i], 4) != 0;
            double tw = time_it([&] { DK(gpu_matmul_tc(&g, dX, n, dY2, m.rows, 0, m.rows, &wg, NULL)); }, 2, 7);
            printf("%-12s %6lld x %6lld n=%-4d mma.sync %7.2f, wgmma %7.2f TFLOP/s, %zu outputs differ\n", m.what,
                   (long long)m.rows, (long long)m.cols, n, fl * n / to / 1e12, fl * n / tw / 1e12, diff);
        }
        gpu_weight_free(&g);
    }
    gpu_ws_free(&wm);
    gpu_ws_free(&wg);
    CK(cudaFree(dX));
    CK(cudaFree(dY));
    CK(cudaFree(dY2));
    return 0;
}

int main(int argc, char **argv) {
    double gb = argc > 1 ? atof(argv[1]) : 2.0;
    int quick = argc > 2 && strcmp(argv[2], "quick") == 0; /* ceilings + n=1 only */
    int experts_only = argc > 2 && strcmp(argv[2], "experts") == 0;
    int prefill = argc > 2 && strcmp(argv[2], "prefill") == 0; /* K3 shapes at n = 1 .. 512 */
    int vec = argc > 2 && strcmp(argv[2], "vec") == 0; /* K3's bf16 shapes at n = 1 .. 8 */
    if (prefill || vec) quick = 1;
    char why[256];
    if (!gpu_probe(why, sizeof why)) {
        printf("cuda_bench: %s\n", why);
        return 0;
    }
    if (argc > 2 && strcmp(argv[2], "wg") == 0) return wg_bench();
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    int memclk = 0, busw = 0;
    cudaDeviceGetAttribute(&memclk, cudaDevAttrMemoryClockRate, 0);
    cudaDeviceGetAttribute(&busw, cudaDevAttrGlobalMemoryBusWidth, 0);
    printf("device: %s, %d SMs, L2 %.0f MB, %.1f GB, bus %d bit, mem clock %d MHz\n", p.name,
           p.multiProcessorCount, p.l2CacheSize / 1e6, p.totalGlobalMem / 1e9, busw, memclk / 1000);

    /* ---- ceilings ---- */
    const size_t cb = (size_t)2 << 30;
    void *a, *b;
    uint32_t *sink;
    CK(cudaMalloc(&a, cb));
    CK(cudaMalloc(&b, cb));
    CK(cudaMalloc(&sink, 4));
    fill(a, cb, 1, F_RAW);
    double tc = time_it([&] { CK(cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice)); }, 2, 15);
    double copy_gbps = 2.0 * cb / tc / 1e9;
    int nsm = p.multiProcessorCount;
    double tr = time_it([&] { k_read<<<nsm * 8, 512>>>((const uint4 *)a, cb / 16, sink); }, 2, 15);
    double read_gbps = cb / tr / 1e9;
    printf("D2D copy  %.2f GiB: %7.1f GB/s (read + write)\n", cb / 1073741824.0, copy_gbps);
    printf("read probe %.2f GiB: %7.1f GB/s (read only)\n", cb / 1073741824.0, read_gbps);
    CK(cudaFree(b));

    const size_t hb = (size_t)1 << 30;
    if (quick || experts_only) goto kernels;
    {
    void *pin, *pag = malloc(hb);
    CK(cudaMallocHost(&pin, hb));
    memset(pin, 1, hb);
    memset(pag, 1, hb);
    double th_pin = time_it([&] { CK(cudaMemcpyAsync(a, pin, hb, cudaMemcpyHostToDevice)); }, 1, 5);
    double th_pag = time_it([&] { CK(cudaMemcpy(a, pag, hb, cudaMemcpyHostToDevice)); }, 1, 5);
    double td_pin = time_it([&] { CK(cudaMemcpyAsync(pin, a, hb, cudaMemcpyDeviceToHost)); }, 1, 5);
    printf("H2D 1 GiB pinned:   %6.1f GB/s\n", hb / th_pin / 1e9);
    printf("H2D 1 GiB pageable: %6.1f GB/s\n", hb / th_pag / 1e9);
    printf("D2H 1 GiB pinned:   %6.1f GB/s\n", hb / td_pin / 1e9);
    CK(cudaFreeHost(pin));
    free(pag);
    }
kernels:
    CK(cudaFree(a));

    /* ---- matvec / matmul ---- */
    const int64_t cols = 7168;
    const wt_type types[] = {WT_MXFP4, WT_INT4_G32, WT_FP8_BLOCK, WT_BF16, WT_I8_ROW};
    float *dX, *dY;
    CK(cudaMalloc(&dX, 64 * cols * 4));
    fill(dX, 64 * cols * 4, 7, F_FLOAT);
    if (!experts_only) {
    printf("\n%-10s %9s %9s | %9s %6s %6s | %9s %8s | %9s %8s\n", "type", "rows", "GB", "n=1 GB/s",
           "%copy", "%read", "n=8 GB/s", "TFLOP/s", "n=64 GB/s", "TFLOP/s");
    for (wt_type t : types) {
        df_weight w;
        memset(&w, 0, sizeof w);
        w.type = t;
        w.rows = 1;
        w.cols = cols;
        w.scale_dtype = DT_BF16;
        w.block_rows = w.block_cols = 128;
        double row_bytes = t == WT_BF16 ? cols * 2.0 : t == WT_FP8_BLOCK ? cols + cols / 128.0 * 4 / 128
                         : t == WT_INT4_G32 ? cols / 2.0 + cols / 16.0 : t == WT_I8_ROW ? cols + 4.0
                         : cols / 2.0 + cols / 32.0;
        int64_t rows = (int64_t)(gb * 1e9 / row_bytes) / 128 * 128;
        gpu_weight g;
        make_weight(t, rows, cols, &g, 100 + t);
        CK(cudaMalloc(&dY, rows * 64 * 4));
        double bytes = (double)(g.data_bytes + g.scale_bytes);
        double t1 = time_it([&] { DK(gpu_matmul(&g, dX, 1, dY, rows, 0, rows, NULL)); }, 3, 21);
        double t8 = quick ? 1 : time_it([&] { DK(gpu_matmul(&g, dX, 8, dY, rows, 0, rows, NULL)); }, 1, 5);
        double t64 = quick ? 1 : time_it([&] { DK(gpu_matmul(&g, dX, 64, dY, rows, 0, rows, NULL)); }, 1, 3);
        double fl = 2.0 * rows * cols;
        printf("%-10s %9lld %9.3f | %9.1f %5.1f%% %5.1f%% | %9.1f %8.2f | %9.1f %8.2f\n", tname(t),
               (long long)rows, bytes / 1e9, bytes / t1 / 1e9, 100 * bytes / t1 / 1e9 / copy_gbps,
               100 * bytes / t1 / 1e9 / read_gbps, bytes / t8 / 1e9, fl * 8 / t8 / 1e12,
               bytes / t64 / 1e9, fl * 64 / t64 / 1e12);
        if (gpu_matmul_tc_takes(&g) || gpu_bf16_tc_takes(&g)) { /* the tensor-core path on the same matrix */
            gpu_ws ws = {NULL, 0, 1, 0, 0, 0, 0};
            double c1 = time_it([&] { DK(gpu_matmul_tc(&g, dX, 1, dY, rows, 0, rows, &ws, NULL)); }, 3, 21);
            double c4 = time_it([&] { DK(gpu_matmul_tc(&g, dX, 4, dY, rows, 0, rows, &ws, NULL)); }, 1, 7);
            double c8 = quick ? 1 : time_it([&] { DK(gpu_matmul_tc(&g, dX, 8, dY, rows, 0, rows, &ws, NULL)); }, 1, 5);
            double c64 = quick ? 1 : time_it([&] { DK(gpu_matmul_tc(&g, dX, 64, dY, rows, 0, rows, &ws, NULL)); }, 1, 3);
            printf("%-10s %9lld %9.3f | %9.1f %5.1f%% %5.1f%% | %9.1f %8.2f | %9.1f %8.2f   (tensor cores; n=4: %.1f GB/s)\n",
                   t == WT_BF16 ? "bf16-tc" : "mxfp4-tc", (long long)rows, bytes / 1e9, bytes / c1 / 1e9, 100 * bytes / c1 / 1e9 / copy_gbps,
                   100 * bytes / c1 / 1e9 / read_gbps, bytes / c8 / 1e9, fl * 8 / c8 / 1e12, bytes / c64 / 1e9,
                   fl * 64 / c64 / 1e12, bytes / c4 / 1e9);
            if (t == WT_MXFP4) { /* the fragment layout: same bits, its speed */
                void *fr;
                CK(cudaMalloc(&fr, (size_t)gpu_mx_frag_bytes(rows, cols)));
                DK(gpu_mx_frag_pack(&g, fr, NULL));
                float *dZ;
                CK(cudaMalloc(&dZ, rows * 64 * 4));
                int same = 1;
                const int nn[] = {1, 3, 4, 37};
                for (int nv : nn) { /* whole matrix, then an unaligned row range */
                    DK(gpu_matmul_tc(&g, dX, nv, dY, rows, 0, rows, &ws, NULL));
                    g.frag = fr;
                    DK(gpu_matmul_tc(&g, dX, nv, dZ, rows, 0, rows, &ws, NULL));
                    g.frag = NULL;
                    CK(cudaDeviceSynchronize());
                    std::vector<float> h1((size_t)rows * nv), h2((size_t)rows * nv);
                    CK(cudaMemcpy(h1.data(), dY, h1.size() * 4, cudaMemcpyDeviceToHost));
                    CK(cudaMemcpy(h2.data(), dZ, h2.size() * 4, cudaMemcpyDeviceToHost));
                    same &= memcmp(h1.data(), h2.data(), h1.size() * 4) == 0;
                    DK(gpu_matmul_tc(&g, dX, nv, dY, 1000, 37, 1037, &ws, NULL));
                    g.frag = fr;
                    DK(gpu_matmul_tc(&g, dX, nv, dZ, 1000, 37, 1037, &ws, NULL));
                    g.frag = NULL;
                    CK(cudaDeviceSynchronize());
                    CK(cudaMemcpy(h1.data(), dY, (size_t)1000 * nv * 4, cudaMemcpyDeviceToHost));
                    CK(cudaMemcpy(h2.data(), dZ, (size_t)1000 * nv * 4, cudaMemcpyDeviceToHost));
                    same &= memcmp(h1.data(), h2.data(), (size_t)1000 * nv * 4) == 0;
                }
                g.frag = fr;
                double f1 = time_it([&] { DK(gpu_matmul_tc(&g, dX, 1, dZ, rows, 0, rows, &ws, NULL)); }, 3, 21);
                double f4 = time_it([&] { DK(gpu_matmul_tc(&g, dX, 4, dZ, rows, 0, rows, &ws, NULL)); }, 1, 7);
                g.frag = NULL;
                printf("%-10s %9lld %9.3f | %9.1f %5.1f%% %5.1f%% | n=4: %.1f GB/s  (fragment layout; bits %s)\n",
                       "mxfp4-frag", (long long)rows, bytes / 1e9, bytes / f1 / 1e9, 100 * bytes / f1 / 1e9 / copy_gbps,
                       100 * bytes / f1 / 1e9 / read_gbps, bytes / f4 / 1e9, same ? "equal" : "DIFFER");
                CK(cudaFree(dZ));
                CK(cudaFree(fr));
            }
            gpu_ws_free(&ws);
        }
        CK(cudaFree(dY));
        gpu_weight_free(&g);
    }
    }

    if (vec) {
        /* ---- decode: each bf16 shape of a K3 step, tensor cores against CUDA cores ---- */
        struct { int64_t rows, cols; const char *what; } sh[] = {
            {12288, 7168, "KDA q/k/v/g"}, {7168, 12288, "o_proj"}, {6144, 7168, "shared gate"},
            {7168, 6144, "shared down"}, {3584, 7168, "latent down"}, {7168, 3584, "latent up"},
            {1536, 7168, "q_a"}, {18432, 1536, "q_b"}, {576, 7168, "kv_a"}, {896, 7168, "router"},
            {128, 7168, "f_a"}, {12288, 128, "f_b"}, {163840, 7168, "head"}, {33792, 7168, "dense gate"},
            {7168, 33792, "dense down"}};
        const int ns[] = {1, 2, 4, 8};
        float *dXp, *dYp;
        CK(cudaMalloc(&dXp, (size_t)8 * 33792 * 4));
        CK(cudaMalloc(&dYp, (size_t)8 * 163840 * 4));
        fill(dXp, (size_t)8 * 33792 * 4, 9, F_FLOAT);
        gpu_ws ws = {NULL, 0, 1, 0, 0, 0, 0}, wcc = {NULL, 0, 0, 0, 0, 0, 0};
        printf("\n%-12s %6s %6s %4s |", "matrix", "rows", "cols", "cp");
        for (int n : ns) printf(" n=%d GB/s tc / cc      |", n);
        printf("\n");
        double sum_tc = 0, sum_cc = 0, sum_b = 0;
        for (auto &m : sh) {
            const double one = (double)m.rows * m.cols * 2;
            const int cp = one >= 256e6 ? 1 : (int)(256e6 / one) + 1; /* copies past L2 */
            std::vector<gpu_weight> g(cp);
            for (int i = 0; i < cp; i++) make_weight(WT_BF16, m.rows, m.cols, &g[i], 300 + (int)m.rows + i);
            printf("%-12s %6lld %6lld %4d |", m.what, (long long)m.rows, (long long)m.cols, cp);
            for (int n : ns) {
                double t[2];
                for (int k = 0; k < 2; k++) {
                    gpu_ws *w = k ? &wcc : &ws;
                    t[k] = time_it([&] {
                        for (int i = 0; i < cp; i++) DK(gpu_matmul_tc(&g[i], dXp, n, dYp, m.rows, 0, m.rows, w, NULL));
                    }, 2, 9) / cp;
                }
                printf(" %6.0f / %6.0f %5.2fx |", one / t[0] / 1e9, one / t[1] / 1e9, t[1] / t[0]);
                if (n == 1) sum_tc += t[0], sum_cc += t[1], sum_b += one;
            }
            printf("\n");
            for (auto &x : g) gpu_weight_free(&x);
        }
        printf("n=1, all shapes once: tensor cores %.1f us (%.0f GB/s), CUDA cores %.1f us (%.0f GB/s)\n",
               sum_tc * 1e6, sum_b / sum_tc / 1e9, sum_cc * 1e6, sum_b / sum_cc / 1e9);
        gpu_ws_free(&ws);
        gpu_ws_free(&wcc);
        CK(cudaFree(dXp));
        CK(cudaFree(dYp));
        return 0;
    }
    if (prefill) {
        /* ---- prefill: K3's bf16 spine shapes and an MXFP4 expert matrix at many vectors ---- */
        printf("\ntensor-core peak (bf16 mma.sync, registers only): %.1f TFLOP/s\n", mma_peak() / 1e12);
        struct { wt_type t; int64_t rows, cols; const char *what; } sh[] = {
            {WT_BF16, 12288, 7168, "KDA q/k/v/g"}, {WT_BF16, 7168, 12288, "o_proj"},
            {WT_BF16, 6144, 7168, "shared gate"}, {WT_BF16, 1536, 7168, "q_a"},
            {WT_MXFP4, 3072, 3584, "expert gate"}};
        const int ns[] = {1, 8, 32, 64, 256, 512};
        float *dXp, *dYp;
        CK(cudaMalloc(&dXp, (size_t)512 * 12288 * 4));
        CK(cudaMalloc(&dYp, (size_t)512 * 12288 * 4));
        fill(dXp, (size_t)512 * 12288 * 4, 9, F_FLOAT);
        gpu_ws ws = {NULL, 0, 1, 0, 0, 0, 0}, wcc = {NULL, 0, 0, 0, 0, 0, 0}; /* bf16 on the tensor cores / on the CUDA cores */
        printf("%-12s %6s %6s |", "matrix", "rows", "cols");
        for (int n : ns) printf(" n=%-3d GB/s TFLOP/s |", n);
        printf("\n");
        for (auto &m : sh) {
            gpu_weight g;
            make_weight(m.t, m.rows, m.cols, &g, 300 + (int)m.rows);
            const double bytes = (double)(g.data_bytes + g.scale_bytes), fl = 2.0 * m.rows * m.cols;
            printf("%-12s %6lld %6lld |", m.what, (long long)m.rows, (long long)m.cols);
            for (int n : ns) {
                double tt = time_it([&] { DK(gpu_matmul_tc(&g, dXp, n, dYp, m.rows, 0, m.rows, &ws, NULL)); }, 2, 7);
                printf(" %9.1f %7.2f |", bytes / tt / 1e9, fl * n / tt / 1e12);
            }
            printf("\n");
            if (m.t == WT_BF16) {
                printf("%-12s %13s |", "  CUDA cores", "");
                for (int n : ns) {
                    double tt = time_it([&] { DK(gpu_matmul_tc(&g, dXp, n, dYp, m.rows, 0, m.rows, &wcc, NULL)); }, 1, 3);
                    printf(" %9.1f %7.2f |", bytes / tt / 1e9, fl * n / tt / 1e12);
                }
                printf("\n");
            }
            gpu_weight_free(&g);
        }
        gpu_ws_free(&ws);
        gpu_ws_free(&wcc);
        CK(cudaFree(dXp));
        CK(cudaFree(dYp));
        return 0;
    }
    if (quick) return 0;
    /* ---- K3-shaped MXFP4 experts ---- */
    enum { NE = 64, HID = 7168, INTER = 1536 };
    std::vector<gpu_weight> eg(NE), eu(NE), ed(NE);
    for (int e = 0; e < NE; e++) {
        make_weight(WT_MXFP4, INTER, HID, &eg[e], 1000 + 3 * e);
        make_weight(WT_MXFP4, INTER, HID, &eu[e], 1001 + 3 * e);
        make_weight(WT_MXFP4, HID, INTER, &ed[e], 1002 + 3 * e);
    }
    double ebytes = (double)(eg[0].data_bytes + eg[0].scale_bytes) * 3;
    float *dH, *dO;
    CK(cudaMalloc(&dH, 64 * INTER * 4));
    CK(cudaMalloc(&dO, 64 * HID * 4));
    gpu_act act = {1, 10.0f, 10.0f};
    printf("\nexpert MXFP4 %dx%d (%.2f MB), %d distinct experts per pass (%.2f GB)\n", HID, INTER,
           ebytes / 1e6, NE, ebytes * NE / 1e9);
    { /* one expert's products one by one at n = 1: CUDA cores vs tensor cores */
        gpu_ws ws = {NULL, 0, 0, 0, 0, 0, 0};
        double tg = time_it([&] { for (int e = 0; e < NE; e++) DK(gpu_matvec(&eg[e], dX, dH, NULL)); }, 2, 9);
        double tgc = time_it([&] { for (int e = 0; e < NE; e++) DK(gpu_matmul_tc(&eg[e], dX, 1, dH, INTER, 0, INTER, &ws, NULL)); }, 2, 9);
        double td = time_it([&] { for (int e = 0; e < NE; e++) DK(gpu_matvec(&ed[e], dX, dO, NULL)); }, 2, 9);
        double tdc = time_it([&] { for (int e = 0; e < NE; e++) DK(gpu_matmul_tc(&ed[e], dX, 1, dO, HID, 0, HID, &ws, NULL)); }, 2, 9);
        double mb = ebytes / 3;
        printf("  gate %dx%d n=1: cuda cores %6.1f us (%6.1f GB/s), tensor cores %6.1f us (%6.1f GB/s)\n", INTER, HID,
               tg / NE * 1e6, mb * NE / tg / 1e9, tgc / NE * 1e6, mb * NE / tgc / 1e9);
        printf("  down %dx%d n=1: cuda cores %6.1f us (%6.1f GB/s), tensor cores %6.1f us (%6.1f GB/s)\n", HID, INTER,
               td / NE * 1e6, mb * NE / td / 1e9, tdc / NE * 1e6, mb * NE / tdc / 1e9);
        gpu_ws_free(&ws);
    }
    const int ens[] = {1, 4, 16};
    for (int n : ens) {
        double te = time_it([&] {
            for (int e = 0; e < NE; e++) DK(gpu_expert(&eg[e], &eu[e], &ed[e], &act, dX, n, dH, dO, NULL));
        }, 1, 7);
        printf("  n=%-3d %8.1f us/expert  %7.1f GB/s  %5.1f%% of copy\n", n, te / NE * 1e6,
               ebytes * NE / te / 1e9, 100 * ebytes * NE / te / 1e9 / copy_gbps);
    }
    { /* a layer's 16 experts in one batch (gpu_experts: two tensor-core launches) */
        enum { B = 16, EW = 48 }; /* EW: the vectors an output slot holds */
        float *dOB;
        CK(cudaMalloc(&dOB, (size_t)B * EW * HID * 4));
        gpu_ws ws = {NULL, 0, 0, 0, 0, 0, 0};
        for (int n : ens) {
            std::vector<gpu_expert_job> jobs(NE);
            for (int e = 0; e < NE; e++)
                jobs[e] = {&eg[e], &eu[e], &ed[e], dX, n, dOB + (size_t)(e % B) * 16 * HID};
            double te = time_it([&] {
                for (int l = 0; l < NE / B; l++) DK(gpu_experts(&jobs[l * B], B, &act, &ws, NULL));
            }, 1, 7);
            printf("  batch of %d, n=%-3d %8.1f us/expert  %7.1f GB/s  %5.1f%% of copy  %5.1f%% of read\n", B, n,
                   te / NE * 1e6, ebytes * NE / te / 1e9, 100 * ebytes * NE / te / 1e9 / copy_gbps,
                   100 * ebytes * NE / te / 1e9 / read_gbps);
        }
        /* the same batches on the fragment layout: bits against the above, speed */
        std::vector<void *> fr;
        for (int e = 0; e < NE; e++)
            for (gpu_weight *w : {&eg[e], &eu[e], &ed[e]}) {
                void *p;
                CK(cudaMalloc(&p, (size_t)gpu_mx_frag_bytes(w->rows, w->cols)));
                DK(gpu_mx_frag_pack(w, p, NULL));
                fr.push_back(p);
            }
        float *dOF;
        CK(cudaMalloc(&dOF, (size_t)B * EW * HID * 4));
        /* the many-vector kernels (gpu_ws.frag_xs: k split, x staged in
         * shared memory; gpu_ws.frag_wg: wgmma, xs = 2 here) */
        for (int xs : {-1, 1, 2})
        for (int n : {1, 4, 16, 48}) {
            ws.frag_xs = xs > 0 ? 1 : -1;
            ws.frag_wg = xs == 2 ? 1 : -1;
            if (n <= 4 && xs > 0) continue; /* one kernel below 5 vectors */
            std::vector<gpu_expert_job> jobs(B);
            for (int e = 0; e < B; e++) jobs[e] = {&eg[e], &eu[e], &ed[e], dX, n, dOB + (size_t)e * EW * HID};
            DK(gpu_experts(jobs.data(), B, &act, &ws, NULL));
            for (int e = 0; e < NE; e++) eg[e].frag = fr[3 * e], eu[e].frag = fr[3 * e + 1], ed[e].frag = fr[3 * e + 2];
            for (int e = 0; e < B; e++) jobs[e].out = dOF + (size_t)e * EW * HID;
            DK(gpu_experts(jobs.data(), B, &act, &ws, NULL));
            CK(cudaDeviceSynchronize());
            std::vector<float> h1((size_t)B * EW * HID), h2(h1.size());
            CK(cudaMemcpy(h1.data(), dOB, h1.size() * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h2.data(), dOF, h2.size() * 4, cudaMemcpyDeviceToHost));
            int same = 1;
            for (int e = 0; e < B; e++)
                same &= memcmp(&h1[(size_t)e * EW * HID], &h2[(size_t)e * EW * HID], (size_t)n * HID * 4) == 0;
            std::vector<gpu_expert_job> all(NE);
            for (int e = 0; e < NE; e++)
                all[e] = {&eg[e], &eu[e], &ed[e], dX, n, dOB + (size_t)(e % B) * EW * HID};
            double te = time_it([&] {
                for (int l = 0; l < NE / B; l++) DK(gpu_experts(&all[l * B], B, &act, &ws, NULL));
            }, 1, 7);
            printf("  batch of %d, n=%-3d %8.1f us/expert  %7.1f GB/s  %5.1f%% of copy  (fragment layout%s; bits %s)\n",
                   B, n, te / NE * 1e6, ebytes * NE / te / 1e9, 100 * ebytes * NE / te / 1e9 / copy_gbps,
                   n <= 4 ? "" : xs == 2 ? ", wgmma" : xs > 0 ? ", x staged" : ", k split", same ? "equal" : "DIFFER");
            for (int e = 0; e < NE; e++) eg[e].frag = eu[e].frag = ed[e].frag = NULL;
        }
        for (void *p : fr) CK(cudaFree(p));
        CK(cudaFree(dOF));
        gpu_ws_free(&ws);
        CK(cudaFree(dOB));
    }
    for (int e = 0; e < NE; e++) {
        gpu_weight_free(&eg[e]);
        gpu_weight_free(&eu[e]);
        gpu_weight_free(&ed[e]);
    }
    CK(cudaFree(dH));
    CK(cudaFree(dO));
    CK(cudaFree(dX));
    CK(cudaFree(sink));
    return 0;
}
