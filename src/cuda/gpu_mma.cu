/* gpu_mma.cu — MXFP4 matmul on the tensor cores (gpu_matmul_tc, gpu.h; its
 * bf16 matrices go to gpu_bf16_tc.cu).
 *
 * Owns: the activation split kernel (x -> f16 hi + lo, per-vector power-of-
 * two scale), the mma.sync MXFP4 kernel, and the caller-owned workspace.
 * Refuses: other weight types (they go to gpu_matmul), placement policy.
 *
 * Why: the CUDA-core kernel (gpu.cu) spends ~4 instructions per 4-bit value
 * (decode, f16->f32 conversion, FFMA) and reaches only ~40% of the copy
 * bandwidth. Here the products run on the tensor cores, leaving the decode.
 *
 * Exactness. Every e2m1 code is exact in f16 (as value * 2^-14, the e = 0
 * codes on the f16 subnormals, which the tensor cores keep: the one-hot
 * tests would see a flush; 2^14 is folded into the scale); the e8m0 scale stays fp32 and
 * is applied per 32-value block after the mma. x is scaled by 2^k (k per
 * vector, so max|x| 2^k lies in [2^14, 2^15)) and split into f16 hi =
 * rn(x 2^k) and lo = rn(x 2^k - hi): hi + lo carries 22 bits of x, so
 *   |y - exact| <= (cols + 64) 2^-24 sum|w x| + 2^-21 sum|w x|
 *                  + 2^-38 max|x| sum|w|
 * (f32 products and tensor-core sums, the split, and the f16 subnormal
 * floor of lo). Results do not depend on n, on the row range or on timing
 * (fixed order everywhere), so row i of a matmul is bit-equal to the matvec
 * of vector i. One-hot x decodes the weights exactly.
 *
 * Work layout. A block of KS warps owns a tile of 16 rows; warp w takes the
 * groups of four 32-value blocks m = w, w + KS, ... of those rows (64 bytes
 * a row: whole sectors), copied global -> shared by cp.async through P
 * stages per warp, and the KS partial sums meet in shared memory in warp
 * order. Per block b one warp issues two
 * m16n8k16 mma (k = 2 x 16 values of the block) with
 *   A = 16 rows x 16 codes (lane g,t decodes 4 bytes of rows g and g + 8:
 *       the u32 at byte 4t of the block holds codes 8t .. 8t+7),
 *   B = 16 codes x 8 columns: column 2v = hi of vector v, 2v + 1 = lo,
 * and the k order inside a block is permuted (codes j and j + 4 of a lane's
 * u32 share one f16x2 register), with x stored in the same order by the
 * split kernel, so the permutation cancels. A lane decodes its u32 of 8
 * codes in 9 integer instructions: the high f16 byte of each code for the
 * even and the odd nibbles four at a time, then four byte permutes against
 * zero (e2m1_quad).
 *
 * The fragment layout (gpu_mx_frag_pack; what the engine uploads): the same
 * matrix re-laid once on the device so each lane loads its operands of a
 * group straight from global memory (2 x 16 bytes of codes, 8 of scales),
 * no cp.async stage, no shared memory but the partial sums. Same warps per
 * tile, same groups per warp, same sums in the same order: bit-equal to
 * the staged kernel (tests compare them).
 *
 * Measured (bench/cuda_NOTES.md, H200, n = 1, 2 GB matrix): staged 2.2 TB/s,
 * 53% of the device's copy bandwidth (1.7 TB/s, 40%, on the CUDA cores);
 * the fragment layout 3.1 TB/s, 72-74%; a layer's 16 experts in one batch
 * 38% -> 55%.
 *
 * A batch's items of many vectors on the fragment layout take one of three
 * kernels of the same bits: the k split above, x staged in shared memory
 * for warps that each own a tile (k_mx_frag_xs; gpu_ws.frag_xs picks
 * between the two), or wgmma (gpu_mx_wg.cu; gpu_ws.frag_wg).
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_internal.h"
#include "gpu_mx_frag.h"

namespace {

/* groups of TC_VEC vectors per pass over the weights when there are more
 * than TC_VEC (prefill): the weights are read and decoded once for them all */
#ifndef GPU_TC_VG
#define GPU_TC_VG 8
#endif
enum { TC_VG = GPU_TC_VG };
/* A batch's items (gpu_tc_batch: a layer's experts, ~9-18 vectors each in a
 * prompt) take up to TCB_VG groups per pass, and in the fragment layout
 * TC_MT 16-row tiles per block, so each x load serves that many tiles.
 * cuda_bench experts, H200, a batch of 16 at n = 16 in the fragment layout:
 * 23.3 -> 18.0 us an expert (staged: 39.3 -> 25.4 from the groups alone);
 * 8 groups and 2 tiles took 188 registers against 128. */
#ifndef GPU_TCB_VG
#define GPU_TCB_VG 4
#endif
#ifndef GPU_TC_MT
#define GPU_TC_MT 2
#endif
enum { TCB_VG = GPU_TCB_VG, TCB_PASS = TC_VEC * TCB_VG, TC_MT = GPU_TC_MT };
/* From this many rows on, 4 warps per row tile (enough tiles to fill the
 * device); below, 8 warps share a tile (an expert's 1536 rows make only 96). */
#ifndef GPU_TC_WIDE_ROWS
#define GPU_TC_WIDE_ROWS (16 * 132 * 4)
#endif
enum { TC_WIDE_ROWS = GPU_TC_WIDE_ROWS };
/* Rows of at most this many columns take the wide layout too: an expert's
 * down projection (1536 columns, 12 groups of four blocks) gave 8 warps
 * 2, 2, 2, 2, 1, 1, 1, 1 groups; 4 warps take 3 each (a layer's batch of 16
 * at n = 1: 39.6 -> 41.0% of copy; 6 warps x 3 stages 40.4%). 0: off. */
#ifndef GPU_TC_SHORT_COLS
#define GPU_TC_SHORT_COLS 2048
#endif

/* A work layout: KS warps per 16-row tile, P stages, S4: scales read four at a time. */
template <int KS_, int P_, bool S4_> struct tc_cfg {
    static constexpr int KS = KS_, P = P_;
    static constexpr bool S4 = S4_;
};

/* The layout of a matrix, from its shape alone, so that gpu_matmul_tc and
 * the batches give the same bits: f(tc_cfg<...>()) with the chosen one. */
template <class F> df_status tc_layout(int64_t rows, int64_t cols, F &&f) {
    const bool s4 = (cols / 32) % 4 == 0;
    if (rows >= TC_WIDE_ROWS || cols <= GPU_TC_SHORT_COLS)
        return s4 ? f(tc_cfg<4, 4, true>()) : f(tc_cfg<4, 4, false>());
    return s4 ? f(tc_cfg<8, 3, true>()) : f(tc_cfg<8, 3, false>());
}

/* One group's split: xb [nblk][8 columns][4 lanes] uint4, then inv [TC_VEC]
 * floats (gpu_matmul_tc's ws holds TC_VG groups' xb, then their inv). */
size_t ws_bytes(int64_t cols) { return (size_t)(cols / 32) * 8 * 4 * 16 + TC_VEC * sizeof(float); }

/* x 2^k as f16 hi and lo, two values (codes j and j + 4 of a lane's u32)
 * per word. */
__device__ __forceinline__ void split_pair(float a, float c, int k, uint32_t *hw, uint32_t *lw) {
    a = ldexpf(a, k);
    c = ldexpf(c, k);
    __half ah = __float2half_rn(a), ch = __float2half_rn(c);
    __half al = __float2half_rn(a - __half2float(ah)), cl = __float2half_rn(c - __half2float(ch));
    *hw = (uint32_t)__half_as_ushort(ah) | ((uint32_t)__half_as_ushort(ch) << 16);
    *lw = (uint32_t)__half_as_ushort(al) | ((uint32_t)__half_as_ushort(cl) << 16);
}

/* 2^k with max 2^k in [2^14, 2^15); k = 0 for zero, inf or NaN input */
__device__ __forceinline__ int split_exp(float m) { return (m > 0.0f && m <= 3.4e38f) ? 14 - ilogbf(m) : 0; }

/* max|x| over the block (exact in any order); red: 8 floats of shared
 * memory, blockDim 256. */
__device__ __forceinline__ float block_absmax(float m, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int i = 1; i < 8; i++) m = fmaxf(m, red[i]);
    return m;
}

enum { SPLIT_G = 4 }; /* groups of 8 values per thread held in registers: cols <= 8192 */

/* Lane t's hi and lo words of block b of slot v: in mma order (xb [block]
 * [8 columns][4 lanes] uint4, what the mma.sync kernels load), or with WGL
 * in wgmma's (gpu_mx_wg.cu: [block][4 halves of the two k steps][8 columns]
 * uint4 of the four lanes' word j = half, each 16 bytes one column's 8 k
 * values in the mma's k order). */
template <bool WGL>
__device__ __forceinline__ void xsplit_store(uint4 *xb, int64_t b, int v, int t, const uint32_t (&hw)[4],
                                             const uint32_t (&lw)[4]) {
    if (!WGL) {
        xb[(b * 8 + 2 * v) * 4 + t] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
        xb[(b * 8 + 2 * v + 1) * 4 + t] = make_uint4(lw[0], lw[1], lw[2], lw[3]);
        return;
    }
    uint32_t *w = (uint32_t *)(xb + b * 32);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        w[(j * 8 + 2 * v) * 4 + t] = hw[j];
        w[(j * 8 + 2 * v + 1) * 4 + t] = lw[j];
    }
}

/* One block splits one vector x into slot v of xb / inv: k from max|x|,
 * then hi/lo in mma order (WGL: xsplit_store). red: 8 floats of shared memory. A 16-byte
 * aligned x of at most 256 SPLIT_G groups of 8 is read once, every load
 * in flight at once (a decode vector is latency-bound on one block). */
template <bool WGL = false>
__device__ __forceinline__ void xsplit_one(const float *__restrict__ x, int64_t cols, uint4 *xb, float *inv, int v,
                                           float *red) {
    const int64_t nq = cols / 8; /* one uint4 per (8 values, hi or lo) */
    if (nq <= 256 * SPLIT_G && ((uintptr_t)x & 15) == 0) {
        float4 a[SPLIT_G], c[SPLIT_G];
        float m = 0.0f;
#pragma unroll
        for (int g = 0; g < SPLIT_G; g++) {
            const int64_t q = threadIdx.x + g * 256;
            const float4 *s = (const float4 *)(x + q * 8);
            a[g] = q < nq ? s[0] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            c[g] = q < nq ? s[1] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            m = fmaxf(m, fmaxf(fmaxf(fabsf(a[g].x), fabsf(a[g].y)), fmaxf(fabsf(a[g].z), fabsf(a[g].w))));
            m = fmaxf(m, fmaxf(fmaxf(fabsf(c[g].x), fabsf(c[g].y)), fmaxf(fabsf(c[g].z), fabsf(c[g].w))));
        }
        const int k = split_exp(block_absmax(m, red));
        if (threadIdx.x == 0) inv[v] = ldexpf(1.0f, -k);
#pragma unroll
        for (int g = 0; g < SPLIT_G; g++) {
            const int64_t q = threadIdx.x + g * 256;
            if (q >= nq) break;
            const int64_t b = q >> 2;
            const int t = (int)(q & 3);
            uint32_t hw[4], lw[4];
            split_pair(a[g].x, c[g].x, k, &hw[0], &lw[0]);
            split_pair(a[g].y, c[g].y, k, &hw[1], &lw[1]);
            split_pair(a[g].z, c[g].z, k, &hw[2], &lw[2]);
            split_pair(a[g].w, c[g].w, k, &hw[3], &lw[3]);
            xsplit_store<WGL>(xb, b, v, t, hw, lw);
        }
        return;
    }
    float m = 0.0f;
    for (int64_t i = threadIdx.x; i < cols; i += 256) m = fmaxf(m, fabsf(x[i]));
    const int k = split_exp(block_absmax(m, red));
    if (threadIdx.x == 0) inv[v] = ldexpf(1.0f, -k);
    for (int64_t q = threadIdx.x; q < nq; q += 256) {
        const int64_t b = q >> 2;
        const int t = (int)(q & 3);
        const float *s = x + b * 32 + t * 8;
        uint32_t hw[4], lw[4];
#pragma unroll
        for (int j = 0; j < 4; j++) split_pair(s[j], s[j + 4], k, &hw[j], &lw[j]);
        xsplit_store<WGL>(xb, b, v, t, hw, lw);
    }
}

/* One block per vector: vector v into slot v % TC_VEC of group v / TC_VEC
 * (groups (cols / 32) 32 uint4 and TC_VEC floats apart). */
__global__ void __launch_bounds__(256) k_xsplit(const float *__restrict__ X, int64_t cols, uint4 *xb,
                                                float *inv) {
    __shared__ float red[8];
    const int v = blockIdx.x, grp = v / TC_VEC;
    xsplit_one(X + (int64_t)v * cols, cols, xb + (int64_t)grp * (cols / 32) * 32, inv + grp * TC_VEC, v % TC_VEC,
               red);
}

/* A batch's splits, one launch for up to SPLIT_JOBS jobs: block b splits
 * the batch's vector b. Job j holds the batch's vectors v0[j] .. v0[j + 1] -
 * 1 (every job at least one), x[j] its first, g0[j] its first group; its
 * vector v goes to slot v % TC_VEC of group g0[j] + v / TC_VEC (groups
 * xbytes apart from base, their inv arrays TC_VEC floats apart from inv0).
 * (One launch per 96 vectors had run ~340 launches of 96 blocks a 512-token
 * prompt, each under one wave.) */
enum { SPLIT_JOBS = 256 };
struct split_jobs {
    const float *x[SPLIT_JOBS];
    int64_t g0[SPLIT_JOBS];
    int v0[SPLIT_JOBS + 1];
    int njobs;
};
template <bool WGL>
__global__ void __launch_bounds__(256) k_xsplit_jobs(const __grid_constant__ split_jobs t, int64_t cols, uint8_t *base,
                                                     int64_t xbytes, float *inv0) {
    __shared__ float red[8];
    const int b = (int)blockIdx.x;
    int lo = 0, hi = t.njobs - 1; /* the job j with v0[j] <= b < v0[j + 1] */
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (t.v0[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    const int v = b - t.v0[lo];
    const int64_t g = t.g0[lo] + v / TC_VEC;
    xsplit_one<WGL>(t.x[lo] + (int64_t)v * cols, cols, (uint4 *)(base + g * xbytes), inv0 + g * TC_VEC, v % TC_VEC,
                    red);
}

/* How a group finds its block scales: one byte load each (any cols), four
 * packed bytes with the 0 / 255 cases, four packed bytes none of which is 0
 * or 255 (the common case: the bits are byte << 23). */
enum { SC_BYTES, SC_PACKED, SC_PLAIN };
enum { ROWB = 80 }; /* shared bytes per staged row: 64 + 16 pad, conflict-free LDS */

/* 1 if no byte of s is 0x00 or 0xff */
__device__ __forceinline__ bool plain_e8m0(uint32_t s) {
    const uint32_t z = (s - 0x01010101u) & ~s & 0x80808080u, n = ~s;
    const uint32_t f = (n - 0x01010101u) & ~n & 0x80808080u;
    return (z | f) == 0;
}

/* 1 if every lane's scales are plain: the choice of group_sum must be
 * warp-uniform, its mma.sync runs on all 32 lanes (a 0 or 255 byte in one
 * row of a tile and not in another split the warp around it: a hang) */
__device__ __forceinline__ bool plain_warp(uint32_t sca, uint32_t scb) {
    return __all_sync(0xffffffffu, plain_e8m0(sca) && plain_e8m0(scb));
}

template <int SC>
__device__ __forceinline__ float block_scale(const uint8_t *sr, int64_t b, uint32_t s4, int k) {
    if (SC == SC_BYTES) return e8m0(__ldg(sr + b));
    if (SC == SC_PACKED) return e8m0_of(s4, k);
    return __uint_as_float(((s4 >> (8 * k)) & 0xffu) << 23);
}

/* acc[mt][v] += the four blocks of group m of tile mt (its code words wa4,
 * wb4, scales sca, scb; see the file comment), for the nvg groups of four
 * vectors v (xl(v, b): this lane's uint4 of block b of group v's split,
 * from global memory or a shared stage): the weights are decoded
 * once for all of them, and each block's x is loaded once for the MT tiles
 * (a tile's sums are those of a one-tile call: the same bits). */
template <int SC, int VG, int MT, class XL>
__device__ __forceinline__ void group_sum_w(float (&acc)[MT][VG][4], const uint32_t (&wa4)[MT][4],
                                            const uint32_t (&wb4)[MT][4], int64_t m, int64_t nblk,
                                            const bool (&xcol)[VG], const XL &xl, const float (&f)[VG], int nvg,
                                            const uint8_t *sa, const uint8_t *sb, const uint32_t (&sca)[MT],
                                            const uint32_t (&scb)[MT]) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int64_t b = m * 4 + k;
        if (b >= nblk) break;
        uint4 xs[VG]; /* from global memory every group's x first: their loads in flight together */
#pragma unroll
        for (int v = 0; v < VG; v++)
            if constexpr (XL::ahead) xs[v] = v < nvg && xcol[v] ? xl(v, b) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const uint32_t wa = wa4[mt][k], wb = wb4[mt][k];
            const float sfa = block_scale<SC>(sa, b, sca[mt], k), sfb = block_scale<SC>(sb, b, scb[mt], k);
#if GPU_TC_QUAD
            uint32_t ha[4], hb[4];
            e2m1_quad(wa, ha);
            e2m1_quad(wb, hb);
#else
            uint32_t ha[4], hb[4];
#pragma unroll
            for (int j = 0; j < 4; j++) ha[j] = e2m1_pair(wa, j), hb[j] = e2m1_pair(wb, j);
#endif
#pragma unroll
            for (int v = 0; v < VG; v++) {
                if (v >= nvg) break;
                const uint4 xv = XL::ahead ? xs[v] : xcol[v] ? xl(v, b) : make_uint4(0, 0, 0, 0);
                const float fa = __fmul_rn(sfa, f[v]);
                const float fb = __fmul_rn(sfb, f[v]);
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_f16(d, ha[0], hb[0], ha[1], hb[1], xv.x, xv.y);
                mma_f16(d, ha[2], hb[2], ha[3], hb[3], xv.z, xv.w);
                acc[mt][v][0] = __fmaf_rn(fa, d[0], acc[mt][v][0]);
                acc[mt][v][1] = __fmaf_rn(fa, d[1], acc[mt][v][1]);
                acc[mt][v][2] = __fmaf_rn(fb, d[2], acc[mt][v][2]);
                acc[mt][v][3] = __fmaf_rn(fb, d[3], acc[mt][v][3]);
            }
        }
    }
}

/* x from global memory: group v's splits gstride uint4 apart, block b's 32
 * uint4 at b * 32 (xp: this lane's first) */
struct x_global {
    static constexpr bool ahead = true;
    const uint4 *xp;
    int64_t gstride;
    __device__ __forceinline__ uint4 operator()(int v, int64_t b) const { return __ldg(xp + v * gstride + b * 32); }
};

/* group_sum_w with the group's codes staged at cur (rows g and g + 8 of ROWB bytes) */
template <int SC, int VG>
__device__ __forceinline__ void group_sum(float (&acc)[1][VG][4], const uint8_t *cur, int g, int t, int64_t m,
                                          int64_t nblk, const bool (&xcol)[VG], const uint4 *xp, int64_t gstride,
                                          const float (&f)[VG], int nvg, const uint8_t *sa, const uint8_t *sb,
                                          uint32_t sca, uint32_t scb) {
    uint32_t wa[1][4], wb[1][4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        wa[0][k] = *(const uint32_t *)(cur + g * ROWB + 16 * k + 4 * t);
        wb[0][k] = *(const uint32_t *)(cur + (g + 8) * ROWB + 16 * k + 4 * t);
    }
    const uint32_t sa1[1] = {sca}, sb1[1] = {scb};
    group_sum_w<SC, VG, 1>(acc, wa, wb, m, nblk, xcol, x_global{xp, gstride}, f, nvg, sa, sb, sa1, sb1);
}




/* The KS warps' partial sums of a tile meet in shared memory in warp order;
 * warp 0 writes the rows r0 + g, r0 + g + 8 of each vector that lie in
 * [row0, row1). */
template <int KS, int VG>
__device__ __forceinline__ void tile_sums(float (*part)[32][4], const float (&acc)[VG][4], int n, int nvg,
                                          float *__restrict__ Y, int64_t ldy, int64_t r0, int64_t row0,
                                          int64_t row1) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int v = 0; v < VG; v++) {
        if (v >= nvg) break;
        if (v) __syncthreads(); /* warp 0 has read the previous group's sums */
#pragma unroll
        for (int c = 0; c < 4; c++) part[warp][lane][c] = acc[v][c];
        __syncthreads();
        if (warp != 0 || t >= n - v * TC_VEC) continue;
        float s[4];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            s[c] = part[0][lane][c];
            for (int w = 1; w < KS; w++) s[c] = __fadd_rn(s[c], part[w][lane][c]);
        }
        float *y = Y + (int64_t)(v * TC_VEC + t) * ldy;
        if (r0 + g >= row0 && r0 + g < row1) y[r0 + g - row0] = __fadd_rn(s[0], s[1]);
        if (r0 + g + 8 >= row0 && r0 + g + 8 < row1) y[r0 + g + 8 - row0] = __fadd_rn(s[2], s[3]);
    }
}

/* Stages group m (blocks 4m .. 4m+3, 64 bytes of each of the 16 rows):
 * lane l copies 32 bytes of row l / 2, whole sectors, nothing past a row. */
__device__ __forceinline__ void stage_group(uint8_t *st, const uint8_t *data, int64_t rowb, int64_t r0,
                                            int64_t row1, int64_t m, int lane) {
    const int row = lane >> 1, half = lane & 1;
    const int64_t r = min(r0 + row, row1 - 1);
    const int64_t off = m * 64 + half * 32;
    const uint8_t *src = data + r * rowb + off;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int64_t left = rowb - (off + 16 * k);
        const int nb = left >= 16 ? 16 : 0; /* rowb % 16 == 0: a chunk is all in or all out */
        cp_async16(st + row * ROWB + half * 32 + 16 * k, nb ? src + 16 * k : data, nb);
    }
}

/* KS warps per 16-row tile (the k split), P cp.async stages per warp (P - 1
 * groups of 4 blocks in flight), up to VG groups of TC_VEC vectors per pass
 * over the weights (n vectors: group v's splits at xb + v gstride, its inv at
 * inv + v TC_VEC, its outputs at Y + v TC_VEC ldy). */
template <int KS, int P, bool S4, int VG>
__device__ __forceinline__ void mx_tc_tile(uint8_t (*stage)[P][16 * ROWB], float (*part)[32][4],
                                           const uint8_t *__restrict__ data, const uint8_t *__restrict__ scale,
                                           int64_t cols, const uint4 *__restrict__ xb, const float *__restrict__ inv,
                                           int n, float *__restrict__ Y, int64_t ldy, int64_t row0, int64_t row1,
                                           int64_t tile) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int64_t r0 = row0 + tile * 16;
    const int64_t ra = min(r0 + g, row1 - 1), rb = min(r0 + g + 8, row1 - 1);
    const int64_t nblk = cols / 32, rowb = cols / 2, ngrp = (nblk + 3) / 4, gstride = nblk * 32;
    const uint8_t *sa = scale + ra * nblk, *sb = scale + rb * nblk;
    const int nvg = VG == 1 ? 1 : min(VG, (n + TC_VEC - 1) / TC_VEC);
    const uint4 *xp = xb + g * 4 + t;
    bool xcol[VG]; /* this lane's B column holds data */
    float f[VG];
    float acc[1][VG][4]; /* one tile (group_sum_w's form) */
#pragma unroll
    for (int v = 0; v < VG; v++) {
        const int nv = n - v * TC_VEC; /* vectors of group v (more than TC_VEC: all TC_VEC) */
        xcol[v] = g < 2 * nv;
        /* 2^-k of this lane's vector (times 2^14 when the codes stay at value *
         * 2^-14), folded into each block scale: exact (powers of two) unless
         * scale * max|x| leaves the fp32 range, where the result does too */
        f[v] = (v < nvg && t < nv ? inv[v * TC_VEC + t] : 1.0f) * E2M1_UNDO;
#pragma unroll
        for (int c = 0; c < 4; c++) acc[0][v][c] = 0.0f;
    }
    uint8_t(*st)[16 * ROWB] = stage[warp];
    /* groups m = warp, warp + KS, ...; the i-th of them lives in stage i % P */
#pragma unroll
    for (int i = 0; i < P - 1; i++) {
        const int64_t m = warp + (int64_t)i * KS;
        if (m < ngrp) stage_group(st[i], data, rowb, r0, row1, m, lane);
        cp_commit();
    }
    for (int64_t i = 0, m = warp; m < ngrp; i++, m += KS) {
        cp_wait<P - 2>();
        __syncwarp();
        const int64_t mn = m + (int64_t)(P - 1) * KS;
        if (mn < ngrp) stage_group(st[(i + P - 1) % P], data, rowb, r0, row1, mn, lane);
        cp_commit();
        const uint8_t *cur = st[i % P];
        uint32_t sca = 0, scb = 0; /* the group's four e8m0 bytes of rows g, g + 8 */
        if (S4 && m * 4 + 3 < nblk) {
            sca = __ldg((const uint32_t *)(sa + m * 4));
            scb = __ldg((const uint32_t *)(sb + m * 4));
        } else if (S4) {
            for (int k = 3; k >= 0; k--) {
                sca = sca << 8 | (m * 4 + k < nblk ? __ldg(sa + m * 4 + k) : 127u);
                scb = scb << 8 | (m * 4 + k < nblk ? __ldg(sb + m * 4 + k) : 127u);
            }
        }
        if (!S4)
            group_sum<SC_BYTES, VG>(acc, cur, g, t, m, nblk, xcol, xp, gstride, f, nvg, sa, sb, 0, 0);
        else if (plain_warp(sca, scb))
            group_sum<SC_PLAIN, VG>(acc, cur, g, t, m, nblk, xcol, xp, gstride, f, nvg, sa, sb, sca, scb);
        else
            group_sum<SC_PACKED, VG>(acc, cur, g, t, m, nblk, xcol, xp, gstride, f, nvg, sa, sb, sca, scb);
        __syncwarp(); /* every lane has read stage i % P before it is refilled */
    }
    cp_wait<0>();
    tile_sums<KS, VG>(part, acc[0], n, nvg, Y, ldy, r0, row0, row1);
}

template <int KS, int P, bool S4, int VG>
__global__ void __launch_bounds__(KS * 32)
k_mx_tc(const uint8_t *__restrict__ data, const uint8_t *__restrict__ scale, int64_t cols,
        const uint4 *__restrict__ xb, const float *__restrict__ inv, int n, float *__restrict__ Y,
        int64_t ldy, int64_t row0, int64_t row1) {
    __shared__ __align__(16) uint8_t stage[KS][P][16 * ROWB];
    __shared__ float part[KS][32][4];
    mx_tc_tile<KS, P, S4, VG>(stage, part, data, scale, cols, xb, inv, n, Y, ldy, row0, row1, blockIdx.x);
}

/* ---- the fragment layout (gpu_mx_frag_pack; gpu_mx_frag.h describes it) ----
 * The sums on it are the staged kernel's, in its order: the same bits. */
#ifndef GPU_FRAG_D
#define GPU_FRAG_D 1 /* groups a warp holds in registers ahead of the one it sums (1, 2, 4 measured: 1 best, bench/cuda_NOTES.md) */
#endif

/* One thread per (tile, group, lane): its 32 code bytes, and lanes t = 0
 * their row pair's 8 scale bytes. */
__global__ void __launch_bounds__(256) k_mx_frag_pack(const uint8_t *__restrict__ data,
                                                      const uint8_t *__restrict__ scale, int64_t rows,
                                                      int64_t cols, uint8_t *__restrict__ out, int64_t units) {
    const int64_t u = (int64_t)blockIdx.x * 256 + threadIdx.x;
    if (u >= units) return;
    const int lane = (int)(u & 31), g = lane >> 2, t = lane & 3;
    const int64_t ng = frag_groups(cols), chunk = u >> 5, m = chunk % ng, tile = chunk / ng;
    const int64_t nblk = cols / 32, rowb = cols / 2;
    const int64_t ra = min(tile * 16 + g, rows - 1), rb = min(tile * 16 + g + 8, rows - 1);
    uint32_t w[8];
    uint8_t sc[8];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int64_t b = m * 4 + k;
        const bool in = b < nblk;
        w[2 * k] = in ? *(const uint32_t *)(data + ra * rowb + b * 16 + 4 * t) : 0u;
        w[2 * k + 1] = in ? *(const uint32_t *)(data + rb * rowb + b * 16 + 4 * t) : 0u;
        sc[k] = in ? scale[ra * nblk + b] : 127;
        sc[4 + k] = in ? scale[rb * nblk + b] : 127;
    }
    uint8_t *c = out + chunk * FRAG_BYTES;
    *(uint4 *)(c + 16 * lane) = make_uint4(w[0], w[1], w[2], w[3]);
    *(uint4 *)(c + 512 + 16 * lane) = make_uint4(w[4], w[5], w[6], w[7]);
    if (t == 0)
#pragma unroll
        for (int k = 0; k < 8; k++) c[FRAG_CODES + 8 * g + k] = sc[k];
}

/* mx_tc_tile on the fragment layout: the same groups per warp, the same
 * sums; each warp keeps GPU_FRAG_D groups in flight in registers. MT
 * tiles from tile0 (those of the matrix): each warp's groups of all of them,
 * so every x load serves MT tiles (an expert's ~9-18 vectors in a batch read
 * their splits from L2 at twice the weight bytes per group of four vectors,
 * once per tile); each tile's sums are a one-tile call's, in its order. */
template <int KS, int VG, int MT>
__device__ __forceinline__ void mx_tc_tile_frag(float (*part)[32][4], const uint8_t *__restrict__ frag,
                                                int64_t cols, const uint4 *__restrict__ xb,
                                                const float *__restrict__ inv, int n, float *__restrict__ Y,
                                                int64_t ldy, int64_t row0, int64_t row1, int64_t tile0) {
    enum { D = GPU_FRAG_D };
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int64_t rb0 = row0 & ~(int64_t)15; /* the layout's tiles start at row 0 */
    const int64_t nblk = cols / 32, ngrp = frag_groups(cols), gstride = nblk * 32;
    const int nvg = VG == 1 ? 1 : min(VG, (n + TC_VEC - 1) / TC_VEC);
    const uint4 *xp = xb + g * 4 + t;
    bool xcol[VG];
    float f[VG];
    float acc[MT][VG][4];
#pragma unroll
    for (int v = 0; v < VG; v++) {
        const int nv = n - v * TC_VEC;
        xcol[v] = g < 2 * nv;
        f[v] = (v < nvg && t < nv ? inv[v * TC_VEC + t] : 1.0f) * E2M1_UNDO;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[mt][v][c] = 0.0f;
    }
    /* the tiles this block owns: a tile past the matrix's rows is never loaded or written */
    int nt = 0;
    const uint8_t *base[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int64_t r0 = rb0 + (tile0 + mt) * 16;
        base[mt] = frag + (r0 >> 4) * ngrp * FRAG_BYTES;
        if (r0 < row1) nt = mt + 1;
    }
    uint4 c0[MT][D], c1[MT][D];
    uint2 sc[MT][D];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int d = 0; d < D; d++) {
            const int64_t m = warp + (int64_t)d * KS;
            if (mt < nt && m < ngrp) frag_load(base[mt] + m * FRAG_BYTES, lane, c0[mt][d], c1[mt][d], sc[mt][d]);
            else c0[mt][d] = c1[mt][d] = make_uint4(0, 0, 0, 0), sc[mt][d] = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
        }
    for (int64_t m0 = warp; m0 < ngrp; m0 += (int64_t)D * KS) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            const int64_t m = m0 + (int64_t)d * KS;
            if (m >= ngrp) break;
            uint32_t wa[MT][4], wb[MT][4], sca[MT], scb[MT];
            bool plain = true;
            const int64_t mn = m + (int64_t)D * KS;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                wa[mt][0] = c0[mt][d].x, wa[mt][1] = c0[mt][d].z, wa[mt][2] = c1[mt][d].x, wa[mt][3] = c1[mt][d].z;
                wb[mt][0] = c0[mt][d].y, wb[mt][1] = c0[mt][d].w, wb[mt][2] = c1[mt][d].y, wb[mt][3] = c1[mt][d].w;
                sca[mt] = sc[mt][d].x, scb[mt] = sc[mt][d].y;
                plain = plain && plain_warp(sca[mt], scb[mt]);
                if (mt < nt && mn < ngrp) frag_load(base[mt] + mn * FRAG_BYTES, lane, c0[mt][d], c1[mt][d], sc[mt][d]);
            }
            /* the plain-scale form only when every tile's scales are plain
             * (both forms give plain scales the same value) */
            const x_global xl{xp, gstride};
            if (plain)
                group_sum_w<SC_PLAIN, VG, MT>(acc, wa, wb, m, nblk, xcol, xl, f, nvg, NULL, NULL, sca, scb);
            else
                group_sum_w<SC_PACKED, VG, MT>(acc, wa, wb, m, nblk, xcol, xl, f, nvg, NULL, NULL, sca, scb);
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        if (mt) __syncthreads(); /* warp 0 has read the previous tile's sums */
        tile_sums<KS, VG>(part, acc[mt], n, nvg, Y, ldy, rb0 + (tile0 + mt) * 16, row0, row1);
    }
}

template <int KS, int VG>
__global__ void __launch_bounds__(KS * 32)
k_mx_tc_frag(const uint8_t *__restrict__ frag, int64_t cols, const uint4 *__restrict__ xb,
             const float *__restrict__ inv, int n, float *__restrict__ Y, int64_t ldy, int64_t row0, int64_t row1) {
    __shared__ float part[KS][32][4];
    mx_tc_tile_frag<KS, VG, 1>(part, frag, cols, xb, inv, n, Y, ldy, row0, row1, blockIdx.x);
}

/* A batch's products (gpu_tc_batch): block (tile, i) runs tile `tile` of
 * item i, all items of one shape; an item is up to TCB_PASS vectors of one job
 * (XS_PASS for k_mx_frag_xs). */
typedef gpu_tc_item tc_item;
typedef gpu_tc_tab tc_tab;
/* k_mx_tc_batch when every item is in the fragment layout: no stage */
/* Warps an SM the fragment batches are compiled to hold (registers capped to
 * fit: 16 warps = 128 a thread): two 8-warp blocks of gate + up, four 4-warp
 * blocks of down. Left to itself, nvcc 13.0 gave the many-vector kernels
 * 140 registers, one 8-warp block an SM: a batch of 16 at n = 16 took 24.2
 * us an expert against 16.8 at 128 (cuda_bench 2 experts, H200; 24 warps at
 * 80 registers with one tile a block 17.4, 32 warps at 64 spilled 19.5;
 * n = 1 unchanged; bench/cuda_NOTES.md). 0: no cap. */
#ifndef GPU_FRAG_WARPS
#define GPU_FRAG_WARPS 16
#endif
template <int KS, int VG, int MT>
__global__ void __launch_bounds__(KS * 32, GPU_FRAG_WARPS > 0 ? GPU_FRAG_WARPS / KS : 1) k_mx_frag_batch(const __grid_constant__ tc_tab t, int64_t cols, int64_t rows) {
    __shared__ float part[KS][32][4];
    const tc_item &it = t.it[blockIdx.y];
    mx_tc_tile_frag<KS, VG, MT>(part, it.frag, cols, it.xb, it.inv, it.nv, it.Y, it.ldy, 0, rows,
                                (int64_t)blockIdx.x * MT);
}

/* The many-vector fragment batches with x staged in shared memory
 * (GPU_FRAG_XS): a block of XS_W warps owns XS_W consecutive 16-row tiles of
 * one item, one tile a warp, and every warp sums all of its tile's groups
 * for all the item's vector groups. The block walks the groups in the k
 * split's order, class by class (c = 0 .. KS - 1: groups c, c + KS, ...),
 * and stages each group's x (every vector group's 2 KB) once for its warps
 * by cp.async, XS_P stages deep; each warp's weights come straight from the
 * fragment layout, one group ahead in registers. A class's sum is the
 * k-split warp c's partial sum, and the classes are added in warp order as
 * tile_sums adds them (an empty class adds +0 as its idle warp does), so
 * every output has the bits of k_mx_frag_batch. Against it: no block
 * reduction, x from shared memory (k_mx_frag_batch's warps each load their
 * own from L2), XS_W-fold reuse of each x load, and fewer registers an
 * output (one tile a warp: more warps an SM). */
#ifndef GPU_FRAG_XS
/* gpu_ws.frag_xs's default: on. H100, K3s warm 512-token prompt (`bench
 * --decode --device cuda --prefill-again 3 --bf16-tc-rows 9`), alternating:
 * k split 0.0555 / 0.0549 s, x staged 0.0519 / 0.0517, logits md5-equal
 * (bench/cuda_NOTES.md, thirty-fifth session) */
#define GPU_FRAG_XS 1
#endif
/* gpu_ws.frag_wg's default (gpu_mx_wg.cu): on. H100, K3s warm 512-token
 * prompt (as above), alternating, one binary: --mx-wg off 0.0522 / 0.0510 /
 * 0.0510 s, on 0.0473 / 0.0481 / 0.0479; ncu, the expert batches' kernel
 * 23.5 -> 18.4 ms; logits md5-equal (bench/cuda_NOTES.md, thirty-seventh
 * session) */
#ifndef GPU_FRAG_WG
#define GPU_FRAG_WG 1
#endif
#ifndef GPU_XS_W
#define GPU_XS_W 8
#endif
#ifndef GPU_XS_P
#define GPU_XS_P 3
#endif
#ifndef GPU_XS_BLOCKS
#define GPU_XS_BLOCKS 3 /* blocks an SM the registers are capped for (80: no spill) */
#endif
/* vector groups an item of this kernel holds (its items need not be the
 * other kernels': an output's sums do not depend on its item's other
 * vectors). More groups, fewer passes over an expert's weights when it
 * sees more than 16 rows; within 48 KB of static shared memory. */
#ifndef GPU_XS_VG
#define GPU_XS_VG GPU_TCB_VG
#endif
enum { XS_W = GPU_XS_W, XS_P = GPU_XS_P, XS_VG = GPU_XS_VG, XS_PASS = TC_VEC * XS_VG,
       XS_GRP = 4 * 32 }; /* XS_GRP: uint4 of one vector group's x in a group */
static_assert((XS_P * XS_GRP + XS_W * 32) * XS_VG * 16 <= 48 * 1024, "k_mx_frag_xs: static shared memory");

struct x_stage {
    static constexpr bool ahead = false; /* loaded where used: shared memory's latency is short */
    const uint4 *s; /* this lane's uint4 of the staged group's first block of vector group 0 */
    int64_t b0;     /* the staged group's first block */
    __device__ __forceinline__ uint4 operator()(int v, int64_t b) const { return s[v * XS_GRP + (b - b0) * 32]; }
};

template <int KS, int VG>
__global__ void __launch_bounds__(XS_W * 32, GPU_XS_BLOCKS)
k_mx_frag_xs(const __grid_constant__ tc_tab tt, int64_t cols, int64_t rows) {
    __shared__ __align__(16) uint4 xs[XS_P][VG][XS_GRP];
    __shared__ float4 sums[XS_W][VG][32]; /* each lane's running sum over the classes (registers kept for acc) */
    const tc_item &it = tt.it[blockIdx.y];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n = it.nv;
    const int64_t nblk = cols / 32, ngrp = frag_groups(cols), gstride = nblk * 32;
    const int nvg = min(VG, (n + TC_VEC - 1) / TC_VEC);
    const int64_t r0 = ((int64_t)blockIdx.x * XS_W + warp) * 16;
    const bool live = r0 < rows; /* a tile past the matrix: stages x, sums nothing */
    const uint8_t *base = it.frag + (r0 >> 4) * ngrp * FRAG_BYTES;
    bool xcol[VG];
    float f[VG], acc[1][VG][4];
    float4(&sum)[VG][32] = sums[warp];
#pragma unroll
    for (int v = 0; v < VG; v++) {
        const int nv = n - v * TC_VEC;
        xcol[v] = g < 2 * nv;
        f[v] = (v < nvg && t < nv ? it.inv[v * TC_VEC + t] : 1.0f) * E2M1_UNDO;
    }
    /* stage group m's x (its blocks below nblk; the rest zero) into xs[p] */
    auto stage = [&](int64_t m, int p) {
        for (int i = threadIdx.x; i < nvg * XS_GRP; i += XS_W * 32) {
            const int v = i / XS_GRP, u = i % XS_GRP;
            const bool in = m * 4 + u / 32 < nblk;
            cp_async16(&xs[p][v][u], in ? it.xb + v * gstride + m * XS_GRP + u : it.xb, in ? 16 : 0);
        }
    };
    int64_t ms = walk_stage_first<XS_P>(stage, ngrp, KS); /* the next group to stage, in walk order */
    uint4 c0 = make_uint4(0, 0, 0, 0), c1 = c0;
    uint2 sc = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
    if (live) frag_load(base, lane, c0, c1, sc);
    int64_t i = 0;
    for (int c = 0; c < KS; c++) {
#pragma unroll
        for (int v = 0; v < VG; v++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[0][v][q] = 0.0f;
        for (int64_t m = c; m < ngrp; m += KS, i++) {
            cp_wait<XS_P - 2>();
            __syncthreads(); /* group i's stage is in; every warp is done with group i - 1's */
            walk_stage_next<XS_P>(stage, ms, i, ngrp, KS);
            if (!live) continue;
            const uint32_t wa[1][4] = {{c0.x, c0.z, c1.x, c1.z}}, wb[1][4] = {{c0.y, c0.w, c1.y, c1.w}};
            const uint32_t sca[1] = {sc.x}, scb[1] = {sc.y};
            const int64_t mn = walk_next(m, ngrp, KS);
            if (mn >= 0) frag_load(base + mn * FRAG_BYTES, lane, c0, c1, sc);
            const x_stage xl{&xs[i % XS_P][0][lane], m * 4};
            if (plain_warp(sca[0], scb[0]))
                group_sum_w<SC_PLAIN, VG, 1>(acc, wa, wb, m, nblk, xcol, xl, f, nvg, NULL, NULL, sca, scb);
            else
                group_sum_w<SC_PACKED, VG, 1>(acc, wa, wb, m, nblk, xcol, xl, f, nvg, NULL, NULL, sca, scb);
        }
        /* tile_sums' order: class 0's sum, then + each later class's */
#pragma unroll
        for (int v = 0; v < VG; v++) {
            const float4 a = make_float4(acc[0][v][0], acc[0][v][1], acc[0][v][2], acc[0][v][3]);
            if (c) {
                const float4 o = sum[v][lane];
                sum[v][lane] = make_float4(__fadd_rn(o.x, a.x), __fadd_rn(o.y, a.y), __fadd_rn(o.z, a.z),
                                           __fadd_rn(o.w, a.w));
            } else {
                sum[v][lane] = a;
            }
        }
    }
    cp_wait<0>();
    if (!live) return;
#pragma unroll
    for (int v = 0; v < VG; v++) {
        if (v >= nvg || t >= n - v * TC_VEC) break;
        float *y = it.Y + (int64_t)(v * TC_VEC + t) * it.ldy;
        const float4 o = sum[v][lane];
        if (r0 + g < rows) y[r0 + g] = __fadd_rn(o.x, o.y);
        if (r0 + g + 8 < rows) y[r0 + g + 8] = __fadd_rn(o.z, o.w);
    }
}

template <int KS, int P, bool S4, int VG>
__global__ void __launch_bounds__(KS * 32)
k_mx_tc_batch(const __grid_constant__ tc_tab t, int64_t cols, int64_t rows) {
    __shared__ __align__(16) uint8_t stage[KS][P][16 * ROWB];
    __shared__ float part[KS][32][4];
    const tc_item &it = t.it[blockIdx.y];
    if (it.frag)
        mx_tc_tile_frag<KS, VG, 1>(part, it.frag, cols, it.xb, it.inv, it.nv, it.Y, it.ldy, 0, rows, blockIdx.x);
    else
        mx_tc_tile<KS, P, S4, VG>(stage, part, it.data, it.scale, cols, it.xb, it.inv, it.nv, it.Y, it.ldy, 0, rows,
                                  blockIdx.x);
}

} // namespace

extern "C" void gpu_ws_free(gpu_ws *ws) {
    if (!ws) return;
    cudaFree(ws->buf);
    ws->buf = NULL;
    ws->cap = 0;
}

extern "C" int gpu_matmul_tc_takes(const gpu_weight *w) {
    return w && w->type == WT_MXFP4 && w->cols % 32 == 0;
}

extern "C" df_status gpu_matmul_tc(const gpu_weight *w, const float *X, int n, float *Y, int64_t ldy,
                                   int64_t row0, int64_t row1, gpu_ws *ws, void *stream) {
    if (!w || (!w->data && !w->frag) || !X || !Y || !ws || n < 1 || row0 < 0 || row1 > w->rows || row1 <= row0 ||
        ldy < row1 - row0)
        return DF_ERR_ARG;
    const bool bf = ws->bf16_tc_rows > 0 && n >= ws->bf16_tc_rows && gpu_bf16_tc_takes(w) &&
                    ((uintptr_t)X & 15) == 0;
    if (!bf && !gpu_matmul_tc_takes(w)) return gpu_matmul(w, X, n, Y, ldy, row0, row1, stream);
    const uint8_t *frag = bf ? NULL : (const uint8_t *)w->frag;
    const int vg = n > TC_VEC ? TC_VG : 1; /* groups per pass */
    const size_t need = bf ? gpu_bf16_tc_bytes(n, w->rows, w->cols, 1) : (size_t)vg * ws_bytes(w->cols);
    if (ws->cap < need) {
        gpu_ws_free(ws);
        df_status st = gpu_cuda_status(cudaMalloc(&ws->buf, need), "gpu_matmul_tc workspace");
        if (st) {
            ws->buf = NULL;
            return st;
        }
        ws->cap = need;
    }
    cudaStream_t s = (cudaStream_t)stream;
    if (bf) return gpu_bf16_tc(w, NULL, NULL, X, n, Y, ldy, row0, row1, ws->buf, gpu_ws_wg(ws), s);
    uint4 *xb = (uint4 *)ws->buf;
    float *inv = (float *)((char *)ws->buf + (size_t)vg * (ws_bytes(w->cols) - TC_VEC * sizeof(float)));
    const int64_t tiles = frag ? (row1 + 15) / 16 - row0 / 16 : (row1 - row0 + 15) / 16;
    if (tiles > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    const int pass = vg * TC_VEC;
    for (int v0 = 0; v0 < n; v0 += pass) {
        const int nv = n - v0 < pass ? n - v0 : pass;
        k_xsplit<<<nv, 256, 0, s>>>(X + (int64_t)v0 * w->cols, w->cols, xb, inv);
        df_status st = gpu_cuda_status(cudaGetLastError(), "k_xsplit");
        if (st) return st;
        const uint8_t *d = (const uint8_t *)w->data, *sc = (const uint8_t *)w->scale;
        float *y = Y + (int64_t)v0 * ldy;
        /* the layout follows the matrix, not the row range: same sums for any range */
        st = tc_layout(w->rows, w->cols, [&](auto c) {
            using C = decltype(c);
            if (frag && nv > TC_VEC)
                k_mx_tc_frag<C::KS, TC_VG><<<(unsigned)tiles, C::KS * 32, 0, s>>>(frag, w->cols, xb, inv, nv, y, ldy,
                                                                                row0, row1);
            else if (frag)
                k_mx_tc_frag<C::KS, 1><<<(unsigned)tiles, C::KS * 32, 0, s>>>(frag, w->cols, xb, inv, nv, y, ldy,
                                                                            row0, row1);
            else if (nv > TC_VEC)
                k_mx_tc<C::KS, C::P, C::S4, TC_VG><<<(unsigned)tiles, C::KS * 32, 0, s>>>(d, sc, w->cols, xb, inv, nv,
                                                                                       y, ldy, row0, row1);
            else
                k_mx_tc<C::KS, C::P, C::S4, 1><<<(unsigned)tiles, C::KS * 32, 0, s>>>(d, sc, w->cols, xb, inv, nv, y,
                                                                                   ldy, row0, row1);
            return gpu_cuda_status(cudaGetLastError(), "k_mx_tc");
        });
        if (st) return st;
    }
    return DF_OK;
}


/* ---- the fragment layout (gpu_internal.h) ---- */

extern "C" int64_t gpu_mx_frag_bytes(int64_t rows, int64_t cols) {
    return (rows + 15) / 16 * frag_groups(cols) * FRAG_BYTES;
}

extern "C" df_status gpu_mx_frag_pack(const gpu_weight *w, void *out, void *stream) {
    if (!w || !w->data || !w->scale || !out || !gpu_matmul_tc_takes(w)) return DF_ERR_ARG;
    const int64_t units = (w->rows + 15) / 16 * frag_groups(w->cols) * 32;
    if ((units + 255) / 256 > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    k_mx_frag_pack<<<(unsigned)((units + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
        (const uint8_t *)w->data, (const uint8_t *)w->scale, w->rows, w->cols, (uint8_t *)out, units);
    return gpu_cuda_status(cudaGetLastError(), "k_mx_frag_pack");
}


/* ---- batches (gpu_internal.h) ----
 * Scratch layout: the splits of every (job, group of TC_VEC vectors) one
 * after another (ws_bytes less its inv part each), then their inv arrays
 * (TC_VEC floats each). */

static int64_t tc_groups(const gpu_tc_job *jobs, int njobs) {
    int64_t g = 0;
    for (int j = 0; j < njobs; j++) g += (jobs[j].n + TC_VEC - 1) / TC_VEC;
    return g;
}

size_t gpu_tc_batch_bytes(const gpu_tc_job *jobs, int njobs) {
    if (njobs < 1 || !jobs[0].w0) return 0;
    return (size_t)tc_groups(jobs, njobs) * ws_bytes(jobs[0].w0->cols);
}

/* use_xs: the items are k_mx_frag_xs's (all in the fragment layout, up to
 * XS_PASS vectors); use_wg: gpu_mx_wg_batch's (up to GPU_MX_WG_PASS, the
 * splits in its order) */
static df_status flush_items(const tc_tab &t, int count, int64_t cols, int64_t rows, bool use_xs, bool use_wg,
                             cudaStream_t s) {
    if (!count) return DF_OK;
    if (use_wg) return tc_layout(rows, cols, [&](auto c) { return gpu_mx_wg_batch(t, count, cols, rows, decltype(c)::KS, s); });
    int wide = 0, frag = 1; /* an item of more than one group: the many-group kernel */
    for (int i = 0; i < count; i++) wide |= t.it[i].nv > TC_VEC, frag &= t.it[i].frag != NULL;
    /* gpu_matmul_tc's layout, so every row is bit-equal to it */
    return tc_layout(rows, cols, [&](auto c) {
        using C = decltype(c);
        const dim3 grid((unsigned)((rows + 15) / 16), (unsigned)count);
        const dim3 grid_mt((unsigned)((rows + 16 * TC_MT - 1) / (16 * TC_MT)), (unsigned)count);
        const dim3 grid_xs((unsigned)((rows + 16 * XS_W - 1) / (16 * XS_W)), (unsigned)count);
        if (frag && wide && use_xs)
            k_mx_frag_xs<C::KS, XS_VG><<<grid_xs, XS_W * 32, 0, s>>>(t, cols, rows);
        else if (frag && wide)
            k_mx_frag_batch<C::KS, TCB_VG, TC_MT><<<grid_mt, C::KS * 32, 0, s>>>(t, cols, rows);
        else if (frag)
            k_mx_frag_batch<C::KS, 1, 1><<<grid, C::KS * 32, 0, s>>>(t, cols, rows);
        else if (wide)
            k_mx_tc_batch<C::KS, C::P, C::S4, TCB_VG><<<grid, C::KS * 32, 0, s>>>(t, cols, rows);
        else
            k_mx_tc_batch<C::KS, C::P, C::S4, 1><<<grid, C::KS * 32, 0, s>>>(t, cols, rows);
        return gpu_cuda_status(cudaGetLastError(), "k_mx_tc_batch");
    });
}

df_status gpu_tc_batch(const gpu_tc_job *jobs, int njobs, void *scratch, int xs, int wg, cudaStream_t s) {
    if (njobs < 1) return DF_OK;
    if (!jobs || !scratch || !jobs[0].w0) return DF_ERR_ARG;
    const int64_t rows = jobs[0].w0->rows, cols = jobs[0].w0->cols;
    for (int j = 0; j < njobs; j++)
        for (int k = 0; k < 2; k++) {
            const gpu_weight *w = k ? jobs[j].w1 : jobs[j].w0;
            if (k && !w) continue;
            if (!w || (!w->data && !w->frag) || !gpu_matmul_tc_takes(w) || w->rows != rows || w->cols != cols || !jobs[j].X ||
                !(k ? jobs[j].Y1 : jobs[j].Y0) || jobs[j].n < 1 || jobs[j].ldy < rows)
                return DF_ERR_ARG;
        }
    /* the walks count groups of 128 columns in 32 bits (walk_stage_next) */
    if (rows > 16 * (int64_t)0x7fffffff || cols / 128 > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    /* every item in the fragment layout and one of more than TC_VEC vectors:
     * the many-vector kernels (wgmma's wants the splits in its own order) */
    bool all_frag = true, wide = false;
    for (int j = 0; j < njobs; j++) {
        all_frag = all_frag && jobs[j].w0->frag && (!jobs[j].w1 || jobs[j].w1->frag);
        wide = wide || jobs[j].n > TC_VEC;
    }
    const bool use_wg = all_frag && wide && (wg > 0 || (wg == 0 && GPU_FRAG_WG));
    const bool use_xs = !use_wg && all_frag && (xs > 0 || (xs == 0 && GPU_FRAG_XS));
    const int64_t ng = tc_groups(jobs, njobs);
    const size_t xbytes = ws_bytes(cols) - TC_VEC * sizeof(float);
    uint8_t *base = (uint8_t *)scratch;
    float *inv0 = (float *)(base + (size_t)ng * xbytes);
    /* the splits, SPLIT_JOBS jobs per launch */
    df_status st = DF_OK;
    int64_t gi = 0;
    for (int j0 = 0; j0 < njobs; j0 += SPLIT_JOBS) {
        const int nj = njobs - j0 < SPLIT_JOBS ? njobs - j0 : SPLIT_JOBS;
        split_jobs sp;
        int64_t nv = 0;
        for (int j = 0; j < nj; j++) {
            sp.x[j] = jobs[j0 + j].X;
            sp.g0[j] = gi;
            sp.v0[j] = (int)nv;
            nv += jobs[j0 + j].n;
            gi += (jobs[j0 + j].n + TC_VEC - 1) / TC_VEC;
        }
        if (nv > 0x7fffffff) return DF_ERR_UNSUPPORTED; /* one block a vector */
        sp.v0[nj] = (int)nv;
        sp.njobs = nj;
        if (use_wg) k_xsplit_jobs<true><<<(unsigned)nv, 256, 0, s>>>(sp, cols, base, (int64_t)xbytes, inv0);
        else k_xsplit_jobs<false><<<(unsigned)nv, 256, 0, s>>>(sp, cols, base, (int64_t)xbytes, inv0);
        if ((st = gpu_cuda_status(cudaGetLastError(), "k_xsplit_jobs"))) return st;
    }
    /* the products, TCB_MAX per launch, in items of up to `pass` vectors;
     * wgmma's launches by the items' vector class (its n is the launch's
     * largest item's, rounded up to GPU_MX_WG_NV: a 10-vector item beside
     * a 40-vector one ran n = 48's tensor work and fold). An item's outputs
     * do not depend on its launch, so the bits do not change. */
    const int pass = use_wg ? (int)GPU_MX_WG_PASS : use_xs ? (int)XS_PASS : (int)TCB_PASS;
    enum { CLASSES = GPU_MX_WG_PASS / GPU_MX_WG_NV };
    tc_tab tt[CLASSES];
    int nt[CLASSES] = {0};
    gi = 0;
    for (int j = 0; j < njobs; gi += (jobs[j].n + TC_VEC - 1) / TC_VEC, j++)
        for (int v0 = 0; v0 < jobs[j].n; v0 += pass) {
            const int nv = jobs[j].n - v0 < pass ? jobs[j].n - v0 : pass;
            const int c = use_wg ? (nv - 1) / GPU_MX_WG_NV : 0;
            for (int k = 0; k < 2; k++) {
                const gpu_weight *w = k ? jobs[j].w1 : jobs[j].w0;
                if (!w) continue;
                tc_item &it = tt[c].it[nt[c]++];
                it.data = (const uint8_t *)w->data;
                it.scale = (const uint8_t *)w->scale;
                it.frag = (const uint8_t *)w->frag;
                const int64_t g0 = gi + v0 / TC_VEC; /* the pass's first group */
                it.xb = (const uint4 *)(base + (size_t)g0 * xbytes);
                it.inv = inv0 + g0 * TC_VEC;
                it.Y = (k ? jobs[j].Y1 : jobs[j].Y0) + (int64_t)v0 * jobs[j].ldy;
                it.ldy = jobs[j].ldy;
                it.nv = nv;
                if (nt[c] == TCB_MAX) {
                    if ((st = flush_items(tt[c], nt[c], cols, rows, use_xs, use_wg, s))) return st;
                    nt[c] = 0;
                }
            }
        }
    for (int c = 0; c < CLASSES; c++)
        if ((st = flush_items(tt[c], nt[c], cols, rows, use_xs, use_wg, s))) return st;
    return DF_OK;
}
