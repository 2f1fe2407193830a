/* gpu_bf16_tc.cu — bf16 weights times fp32 vectors on the tensor cores
 * (gpu_bf16_tc, gpu_internal.h), for gpu_matmul_tc and the shared experts of
 * gpu_experts: one matrix, or a gate and an up matrix with the expert's
 * activation on their outputs.
 * Refuses: other weight types, columns that are not a multiple of 64.
 *
 * Why: the CUDA-core kernel (gpu.cu) reads bf16 at the copy bandwidth for
 * one vector, but a prefill's many vectors ran at ~8 TFLOP/s on the CUDA
 * cores; here they run as mma.sync tiles. Measured (bench/cuda_NOTES.md,
 * H200, `cuda_bench 2 prefill`, K3's 12288 x 7168 KDA projection): n = 512
 * at ~95 TFLOP/s (CUDA cores 7.9; the mma.sync peak 618-632, which the
 * three limbs cut to a third), but n = 1 at 2.5-2.7 TB/s (CUDA cores
 * 3.6-3.8). So callers send bf16 here from gpu_ws.bf16_tc_rows rows on
 * (the CLI's --bf16-tc-rows, off by default), prefill only in practice.
 *
 * Exactness. x is split into three bf16 limbs, hi = rn(x), mid = rn(x - hi),
 * lo = rn(x - hi - mid) (each difference exact), which carry x whole for
 * normal fp32 x; bf16 times bf16 is exact in fp32. The row's columns are cut
 * into S slices of whole 64-column chunks by shape alone (bf16_slices). Per
 * slice one fp32 accumulator a, from zero, takes the tensor cores' m16n8k16
 * steps in a fixed order: chunk by chunk, in a chunk its four k steps (a
 * fixed permutation of its 64 columns, below), in a step the hi, mid, lo
 * limb; then, in fp32 round-to-nearest,
 *   y = ((0 + a_0) + a_1) + ...   (slices in order)
 * so every output is one fixed sequence of operations on its own row and
 * vector, whatever the kernel (one vector or a tile of 128), n, the row
 * range, the block shape or the batch around it: row i of n vectors is
 * bit-equal to vector i alone. Bound (the tensor cores' sums, 3 cols / 16
 * steps a row, and the slice adds):
 *   |y - exact| <= (cols + 64) 2^-24 sum|w x| + 2^-21 sum|w x|
 * plus the underflow of lo products for |x| near the fp32 floor; one-hot x
 * gives the weights exactly. Infinite or NaN x gives NaN.
 *
 * Work layout. A chunk is 64 columns, 128 bytes of a row; lane (g, t) of a
 * warp holds bytes 16t and 64 + 16t of it (columns 8t .. 8t+7 and 32 + 8t
 * .. 32 + 8t+7) for rows g and g + 8 of a 16-row tile, and k step j of the
 * chunk takes u32 2j and 2j + 1 of those 8 as the mma's k pairs (2t, 2t+1)
 * and (2t+8, 2t+9); B (the limbs of 8 vectors, one per mma column) is read
 * the same way, so the permutation of k cancels.
 *  - k_bt_split: the limbs of the n vectors, once per product, [n][3][cols].
 *  - k_bt_vec (n <= 8): a warp per (16-row tile, slice), its weights and
 *    the limbs streamed through shared buffers by cp.async; slices meet in
 *    shared memory.
 *  - k_bt_gemm (n > 8): a block of 8 warps (2 x 4) per BM rows of each of
 *    its NM matrices (AROWS staged rows) x BN vectors, chunks of weights
 *    and limbs staged by cp.async through BT_STAGES buffers; a warp holds
 *    MTW 16-row tiles x WN 8-vector tiles, each weight fragment read from
 *    shared memory serving 3 WN mma. Blocks of 64 x 32, 64 x 64 or
 *    128 x 128 (launch_gemms). One accumulator per output, not one per limb
 *    and chunk, leaves the registers for the large blocks.
 *  - n > 8 on Hopper, a product that fills the device (wg_takes): the same
 *    steps on wgmma blocks of 256 rows x 64 vectors, gpu_bf16_wg.cu; a gate
 *    and up pair in one launch there (the up's rows in the scratch after
 *    the limbs), then the act (k_wg_act).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_internal.h"

#ifndef GPU_BT_GEMM_BLOCKS
#define GPU_BT_GEMM_BLOCKS 1 /* k_bt_gemm blocks per SM the registers must allow */
#endif

namespace {

enum { BT_CH = 64, BT_CHB = 128, BT_VEC_MAX = 8, BT_STAGES = 3, BT_SLICES = 12 };

} // namespace

/* Slices per row, from the shape alone: enough (tile, slice) warps to keep
 * the device's loads in flight for one vector (about 4096), at most
 * BT_SLICES, at least 4 chunks each. */
int gpu_bf16_slices(int64_t rows, int64_t nch) {
    const int64_t tiles = (rows + 15) / 16;
    int64_t s = (4096 + tiles - 1) / tiles;
    if (s > BT_SLICES) s = BT_SLICES;
    if (s > nch / 4) s = nch / 4;
    return s < 1 ? 1 : (int)s;
}

namespace {

__device__ __forceinline__ int64_t slice_end(int s, int64_t per, int64_t nch) {
    const int64_t e = (int64_t)(s + 1) * per;
    return e < nch ? e : nch;
}

/* One k step of one 16-row tile against one 8-column B tile, its three
 * limbs in order into one accumulator: d += W hi, d += W mid, d += W lo.
 * a0..a3: the rows' k pairs; h, m, l: the limbs' two u32 of this step. */
__device__ __forceinline__ void mma3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                     const uint32_t *h, const uint32_t *m, const uint32_t *l) {
    mma_bf16(d, a0, a1, a2, a3, h[0], h[1]);
    mma_bf16(d, a0, a1, a2, a3, m[0], m[1]);
    mma_bf16(d, a0, a1, a2, a3, l[0], l[1]);
}

struct bt_mats {
    const uint8_t *w[2]; /* [rows][cols] bf16 each; w[1] only for gate + up */
};

__device__ __forceinline__ void u4_to(const uint4 &a, const uint4 &b, uint32_t (&u)[8]) {
    u[0] = a.x; u[1] = a.y; u[2] = a.z; u[3] = a.w;
    u[4] = b.x; u[5] = b.y; u[6] = b.z; u[7] = b.w;
}

/* ---- n <= 8: a warp per (tile, slice) ---- */

/* Shared rows of 128 bytes; 16-byte piece i of row r sits at i ^ 4 (r & 1),
 * so the eight lanes of a 16-byte load phase (rows g, g + 1; pieces t, t + 4)
 * hit 32 different banks. */
__device__ __forceinline__ int swz(int r, int i) { return (r * 8 + (i ^ ((r & 1) << 2))) * 16; }

enum { BV_TILE = 16 * BT_CHB, BV_SMEM = 200 << 10 }; /* bytes of a tile's chunk; shared bytes for 3 stages */

/* The 8 u32 of lane (g, t) of rows g and g + 8 of a staged chunk. */
__device__ __forceinline__ void tile_frags(const uint8_t *st, int g, int t, uint32_t (&ra)[8], uint32_t (&rb)[8]) {
    const uint4 a0 = *(const uint4 *)(st + swz(g, t)), a1 = *(const uint4 *)(st + swz(g, 4 + t));
    const uint4 b0 = *(const uint4 *)(st + swz(g + 8, t)), b1 = *(const uint4 *)(st + swz(g + 8, 4 + t));
    u4_to(a0, a1, ra);
    u4_to(b0, b1, rb);
}

/* Block: tpb tiles x S slices, warp w = tile (w / S), slice (w % S); each
 * warp streams its chunks of the weights (lane l copies 64 bytes of row
 * l / 2) and of the n vectors' limbs (Lg, k_bt_split) through STG
 * shared buffers by cp.async, then the tile's first warp adds the slices in
 * order. Dynamic shared memory: warps x STG x vec_stage(NM, n); STG = 3
 * (two chunks in flight) when that fits in BV_SMEM, else 2. */
__host__ __device__ constexpr int vec_stage(int nm, int n) { return nm * BV_TILE + n * 3 * BT_CHB; }

template <int NM, int STG>
__global__ void __launch_bounds__(BT_SLICES * 32) k_bt_vec(const __grid_constant__ bt_mats mats, const gpu_act act,
                                               const uint8_t *__restrict__ Lg, int n, int64_t cols,
                                               float *__restrict__ Y, int64_t ldy, int64_t row0, int64_t row1,
                                               int S, int tpb) {
    extern __shared__ __align__(16) uint8_t vsm[];
    __shared__ float part[BT_SLICES][NM][16][BT_VEC_MAX];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wt = warp / S, slice = warp % S;
    const int64_t r0 = row0 + ((int64_t)blockIdx.x * tpb + wt) * 16;
    const int64_t nch = cols / BT_CH, per = (nch + S - 1) / S, rowb = cols * 2;
    const int64_t c0 = min((int64_t)slice * per, nch), c1 = slice_end(slice, per, nch);
    const bool live = r0 < row1;
    const int sbytes = vec_stage(NM, n);
    uint8_t *st = vsm + (size_t)warp * STG * sbytes;
    float acc[NM][4]; /* the slice's one accumulator per output */
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[m][e] = 0.0f;
    if (live) {
        /* this lane's copies: row cr of each matrix, pieces 4 ch .. 4 ch + 3;
         * limb rows (v 3 + L) piece by piece, lane l taking l, l + 32, ... */
        const int cr = lane >> 1, ch = lane & 1;
        const uint8_t *src[NM];
#pragma unroll
        for (int m = 0; m < NM; m++) src[m] = mats.w[m] + min(r0 + cr, row1 - 1) * rowb + 64 * ch;
        const int nlp = n * 3 * 8; /* limb pieces per chunk */
        auto stage = [&](int buf, int64_t c) {
            uint8_t *b = st + (size_t)buf * sbytes;
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int k = 0; k < 4; k++)
                    cp_async16(b + m * BV_TILE + swz(cr, 4 * ch + k), src[m] + c * BT_CHB + 16 * k, 16);
            for (int p = lane; p < nlp; p += 32)
                cp_async16(b + NM * BV_TILE + swz(p >> 3, p & 7),
                           Lg + (int64_t)(p >> 3) * rowb + c * BT_CHB + (p & 7) * 16, 16);
        };
#pragma unroll
        for (int i = 0; i < STG - 1; i++) {
            if (c0 + i < c1) stage(i, c0 + i);
            cp_commit();
        }
        const bool xl = g < n;
        for (int64_t c = c0, i = 0; c < c1; c++, i++) {
            cp_wait<STG - 2>();
            __syncwarp();
            if (c + STG - 1 < c1) stage((int)((i + STG - 1) % STG), c + STG - 1);
            cp_commit();
            const uint8_t *b = st + (size_t)(i % STG) * sbytes;
            uint32_t bl[3][8];
#pragma unroll
            for (int L = 0; L < 3; L++) {
                uint4 p0 = make_uint4(0, 0, 0, 0), p1 = p0;
                if (xl) {
                    p0 = *(const uint4 *)(b + NM * BV_TILE + swz(g * 3 + L, t));
                    p1 = *(const uint4 *)(b + NM * BV_TILE + swz(g * 3 + L, 4 + t));
                }
                u4_to(p0, p1, bl[L]);
            }
#pragma unroll
            for (int m = 0; m < NM; m++) {
                uint32_t ra[8], rbv[8];
                tile_frags(b + m * BV_TILE, g, t, ra, rbv);
#pragma unroll
                for (int j = 0; j < 4; j++)
                    mma3(acc[m], ra[2 * j], rbv[2 * j], ra[2 * j + 1], rbv[2 * j + 1], &bl[0][2 * j], &bl[1][2 * j],
                         &bl[2][2 * j]);
            }
            __syncwarp(); /* every lane has read the buffer before it is refilled */
        }
        cp_wait<0>();
    }
    /* element e: row g + 8 (e >> 1), vector 2t + (e & 1) */
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int e = 0; e < 4; e++) part[warp][m][g + 8 * (e >> 1)][2 * t + (e & 1)] = acc[m][e];
    __syncthreads();
    /* the tile's 16 rows x 8 vectors, slices in order, by its first warp */
    if (slice != 0 || !live) return;
    for (int i = lane; i < 16 * BT_VEC_MAX; i += 32) {
        const int r = i / BT_VEC_MAX, v = i % BT_VEC_MAX;
        if (v >= n || r0 + r >= row1) continue;
        float y[NM];
#pragma unroll
        for (int m = 0; m < NM; m++) {
            y[m] = 0.0f;
            for (int k = 0; k < S; k++) y[m] = __fadd_rn(y[m], part[warp + k][m][r][v]);
        }
        float o;
        if (NM == 2)
            o = gpu_act1(act, y[0], y[NM - 1]);
        else
            o = y[0];
        Y[(int64_t)v * ldy + (r0 + r - row0)] = o;
    }
}

/* ---- the limbs of n vectors for k_bt_vec and k_bt_gemm: L [n][3][cols] bf16 ---- */
__global__ void __launch_bounds__(256) k_bt_split(const float *__restrict__ X, int64_t cols, int64_t total8,
                                                 uint4 *__restrict__ L) {
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < total8; i += (int64_t)gridDim.x * 256) {
        const int64_t v = i / (cols / 8), q = i % (cols / 8);
        const float4 *x = (const float4 *)(X + v * cols + q * 8);
        uint32_t h[4], m[4], l[4];
        bf16_limbs8(x[0], x[1], h, m, l);
        uint4 *o = L + (v * 3) * (cols / 8) + q;
        o[0] = make_uint4(h[0], h[1], h[2], h[3]);
        o[cols / 8] = make_uint4(m[0], m[1], m[2], m[3]);
        o[2 * (cols / 8)] = make_uint4(l[0], l[1], l[2], l[3]);
    }
}

/* ---- n > 8: blocks of BM rows (of each matrix) x BN vectors ---- */

/* MTW: 16-row tiles a warp holds, MTW / NM of each matrix; WN: its 8-vector
 * tiles. launch_gemm picks the shape (below); the shapes never change a
 * value (chunks and slices are the matrix's). */
template <int NM, int MTW, int WN> struct gemm_cfg {
    static constexpr int MT = MTW / NM;         /* 16-row tiles of each matrix a warp holds */
    static constexpr int BM = 2 * 16 * MT;      /* rows of each matrix per block (2 warp rows) */
    static constexpr int BN = 4 * WN * 8;       /* vectors per block (4 warp columns) */
    static constexpr int AROWS = NM * BM;       /* staged weight rows */
    static constexpr int BROWS = 3 * BN;        /* staged limb rows */
    static constexpr int STAGE = (AROWS + BROWS) * BT_CHB;
    static_assert(MT * NM == MTW && (AROWS + BROWS) % 32 == 0, "gemm_cfg shape");
};

template <int NM, int MTW, int WN>
__global__ void __launch_bounds__(256, GPU_BT_GEMM_BLOCKS)
k_bt_gemm(const __grid_constant__ bt_mats mats, const gpu_act act, const uint8_t *__restrict__ Lg, int n, int64_t cols,
          float *__restrict__ Y, int64_t ldy, int64_t row0, int64_t row1, int S) {
    using C = gemm_cfg<NM, MTW, WN>;
    extern __shared__ __align__(16) uint8_t sm[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wr = warp >> 2, wc = warp & 3;
    const int64_t v0 = (int64_t)blockIdx.x * C::BN;
    const int64_t r0 = row0 + (int64_t)blockIdx.y * C::BM;
    const int64_t nch = cols / BT_CH, per = (nch + S - 1) / S, rowb = cols * 2;

    /* thread tid copies piece tid % 8 of staged rows tid / 8 + 32 k (weight
     * rows first, then the limb rows); row parity, hence the swizzle, is the
     * same for all its rows. Row k's source is a base (its matrix's row r0,
     * or the limbs) plus a 32-bit offset: fewer registers than pointers. */
    constexpr int NCP = (C::AROWS + C::BROWS) / 32, NCA = C::AROWS / 32;
    const int piece0 = tid & 7, row0c = tid >> 3;
    const uint8_t *wb[NM];
#pragma unroll
    for (int m = 0; m < NM; m++) wb[m] = mats.w[m] + r0 * rowb + piece0 * 16;
    const uint8_t *lb = Lg + piece0 * 16;
    int32_t off[NCP];
#pragma unroll
    for (int k = 0; k < NCP; k++) {
        const int row = row0c + 32 * k;
        if (k < NCA) {
            off[k] = (int32_t)(min((int64_t)(row % C::BM), row1 - 1 - r0) * rowb);
        } else {
            const int b = row - C::AROWS, L = b / C::BN;
            const int64_t v = min(v0 + (b % C::BN), (int64_t)n - 1);
            off[k] = (int32_t)((v * 3 + L) * rowb);
        }
    }
    const int dst0 = swz(row0c, piece0);
    auto stage = [&](int buf, int64_t c) {
        uint8_t *base = sm + (size_t)buf * C::STAGE + dst0;
#pragma unroll
        for (int k = 0; k < NCP; k++)
            cp_async16(base + k * 32 * BT_CHB, (k < NCA ? wb[32 * k / C::BM] : lb) + off[k] + c * BT_CHB, 16);
    };

    /* accumulators q = (matrix m, m tile mt, vector tile vt), row-major */
    constexpr int Q = MTW * WN;
    float d[Q][4], y[Q][4];
#pragma unroll
    for (int q = 0; q < Q; q++)
#pragma unroll
        for (int e = 0; e < 4; e++) d[q][e] = y[q][e] = 0.0f;

#pragma unroll
    for (int i = 0; i < BT_STAGES - 1; i++) {
        if (i < nch) stage(i, i);
        cp_commit();
    }
    int s = 0;
    for (int64_t c = 0; c < nch; c++) {
        cp_wait<BT_STAGES - 2>();
        __syncthreads();
        if (c + BT_STAGES - 1 < nch) stage((int)((c + BT_STAGES - 1) % BT_STAGES), c + BT_STAGES - 1);
        cp_commit();
        const uint8_t *base = sm + (size_t)(c % BT_STAGES) * C::STAGE;
#pragma unroll
        for (int h = 0; h < 2; h++) { /* pieces t (steps 0, 1) and 4 + t (steps 2, 3) */
            const int piece = 4 * h + t;
            uint32_t a[MTW][2][4]; /* (matrix, m tile), row g / g + 8 */
#pragma unroll
            for (int mm = 0; mm < MTW; mm++)
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    const int row = (mm / C::MT) * C::BM + wr * 16 * C::MT + (mm % C::MT) * 16 + g + 8 * hr;
                    const uint4 u = *(const uint4 *)(base + swz(row, piece));
                    a[mm][hr][0] = u.x, a[mm][hr][1] = u.y, a[mm][hr][2] = u.z, a[mm][hr][3] = u.w;
                }
#pragma unroll
            for (int vt = 0; vt < WN; vt++) {
                uint32_t b[3][4];
#pragma unroll
                for (int L = 0; L < 3; L++) {
                    const int row = C::AROWS + L * C::BN + wc * WN * 8 + vt * 8 + g;
                    const uint4 u = *(const uint4 *)(base + swz(row, piece));
                    b[L][0] = u.x, b[L][1] = u.y, b[L][2] = u.z, b[L][3] = u.w;
                }
#pragma unroll
                for (int jj = 0; jj < 2; jj++)
#pragma unroll
                    for (int mm = 0; mm < MTW; mm++)
                        mma3(d[mm * WN + vt], a[mm][0][2 * jj], a[mm][1][2 * jj], a[mm][0][2 * jj + 1],
                             a[mm][1][2 * jj + 1], &b[0][2 * jj], &b[1][2 * jj], &b[2][2 * jj]);
            }
        }
        /* slices ending here (and empty ones after them) fold into y */
        while (s < S && c + 1 == slice_end(s, per, nch)) {
#pragma unroll
            for (int q = 0; q < Q; q++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    y[q][e] = __fadd_rn(y[q][e], d[q][e]);
                    d[q][e] = 0.0f;
                }
            s++;
        }
    }
    cp_wait<0>();
#pragma unroll
    for (int mt = 0; mt < C::MT; mt++)
#pragma unroll
        for (int vt = 0; vt < WN; vt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t r = r0 + wr * 16 * C::MT + mt * 16 + g + 8 * (e >> 1);
                const int64_t v = v0 + wc * WN * 8 + vt * 8 + 2 * t + (e & 1);
                if (r >= row1 || v >= n) continue;
                const int q = mt * WN + vt; /* matrix 0; the up matrix's tile is q + MT WN */
                Y[v * ldy + (r - row0)] = NM == 2 ? gpu_act1(act, y[q][e], y[C::MT * WN + q][e]) : y[q][e];
            }
}

df_status split_limbs(const float *X, int n, int64_t cols, void *limbs, cudaStream_t s) {
    const int64_t total8 = (int64_t)n * cols / 8;
    const int64_t sb = (total8 + 255) / 256;
    k_bt_split<<<(unsigned)(sb < 4096 ? sb : 4096), 256, 0, s>>>(X, cols, total8, (uint4 *)limbs);
    return gpu_cuda_status(cudaGetLastError(), "k_bt_split");
}

template <int NM, int MTW, int WN>
df_status launch_gemm(const bt_mats &mats, const gpu_act &act, int n, int64_t rows, int64_t cols, float *Y,
                      int64_t ldy, int64_t row0, int64_t row1, const void *limbs, cudaStream_t s) {
    using C = gemm_cfg<NM, MTW, WN>;
    const size_t smem = (size_t)BT_STAGES * C::STAGE;
    df_status st = gpu_cuda_status(
        cudaFuncSetAttribute(k_bt_gemm<NM, MTW, WN>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
        "k_bt_gemm shared memory");
    if (st) {
        (void)cudaGetLastError();
        return st;
    }
    const dim3 grid((unsigned)((n + C::BN - 1) / C::BN), (unsigned)((row1 - row0 + C::BM - 1) / C::BM));
    k_bt_gemm<NM, MTW, WN><<<grid, 256, smem, s>>>(mats, act, (const uint8_t *)limbs, n, cols, Y, ldy, row0, row1,
                                                    gpu_bf16_slices(rows, cols / BT_CH));
    return gpu_cuda_status(cudaGetLastError(), "k_bt_gemm");
}

/* The block shape for n > 8 vectors: 32 vectors a block up to 32 (64 x 32
 * blocks: fewer idle columns), else 64 x 64 or 128 x 128 blocks (rows are
 * staged weight rows: one matrix, or half of each), whichever grid a model
 * fitted to `cuda_bench 2 prefill` on the H200 says finishes first. Two
 * 64 x 64 blocks share an SM (116 registers, 96 KB of shared memory) and
 * take ~174 us a pair at 7168 columns; a 128 x 128 block takes an SM alone,
 * ~316 us (it stages 42 bytes from L2 per mma against 85: the limbs triple
 * the vectors). An SM's time is its share of the waves. Measured (TFLOP/s
 * of the model's products at 256 / 512 vectors, 64 x 64 against 128 x 128):
 * K3's 12288 x 7168 84 / 86 against 71 / 95, 7168 x 12288 74 / 85 against
 * 83 / 84, 6144 x 7168 78 / 82 against 70 / 71 (the model's one miss, at
 * 256), 1536 x 7168 46 / 58 against 17 / 35; 128 x 64 blocks were never
 * ahead by more than the noise. Every shape gives the same bits.
 * GPU_BT_SHAPE (a build flag, for measurements) forces 1: 64 x 64, 2: 128 x
 * 128. */
#ifndef GPU_BT_SHAPE
#define GPU_BT_SHAPE 0
#endif
bool wide_blocks(int nm, int64_t span, int n) {
    if (GPU_BT_SHAPE > 0) return GPU_BT_SHAPE == 2;
    int sms = 0, dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms < 1)
        sms = 132;
    const int64_t small = (span + 64 / nm - 1) / (64 / nm) * ((n + 63) / 64);
    const int64_t wide = (span + 128 / nm - 1) / (128 / nm) * ((n + 127) / 128);
    return (wide + sms - 1) / sms * 316 < (small + 2 * sms - 1) / (2 * sms) * 174;
}

template <int NM>
df_status launch_gemms(const bt_mats &mats, const gpu_act &act, const float *X, int n, int64_t rows, int64_t cols,
                       float *Y, int64_t ldy, int64_t row0, int64_t row1, void *limbs, cudaStream_t s) {
    /* the kernel's limb offsets are 32-bit: vectors in batches below 2^31 bytes of limbs */
    const int64_t vmax = ((int64_t)1 << 31) / (3 * cols * 2) - 1;
    if (n > vmax) {
        for (int64_t v = 0; v < n; v += vmax) {
            const int nb = (int)(n - v < vmax ? n - v : vmax);
            df_status st = launch_gemms<NM>(mats, act, X + v * cols, nb, rows, cols, Y + v * ldy, ldy, row0, row1,
                                            limbs, s);
            if (st) return st;
        }
        return DF_OK;
    }
    df_status st = split_limbs(X, n, cols, limbs, s);
    if (st) return st;
    if (n <= 32) return launch_gemm<NM, 2, 1>(mats, act, n, rows, cols, Y, ldy, row0, row1, limbs, s);
    if (wide_blocks(NM, row1 - row0, n))
        return launch_gemm<NM, 4, 4>(mats, act, n, rows, cols, Y, ldy, row0, row1, limbs, s);
    return launch_gemm<NM, 2, 2>(mats, act, n, rows, cols, Y, ldy, row0, row1, limbs, s);
}

template <int NM, int STG>
df_status launch_vec_stg(const bt_mats &mats, const gpu_act &act, int n, int64_t cols, float *Y, int64_t ldy,
                         int64_t row0, int64_t row1, const void *limbs, int S, int tpb, int64_t blocks,
                         cudaStream_t s) {
    const int warps = S * tpb;
    const size_t smem = (size_t)warps * STG * vec_stage(NM, n);
    df_status st = gpu_cuda_status(
        cudaFuncSetAttribute(k_bt_vec<NM, STG>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
        "k_bt_vec shared memory");
    if (st) {
        (void)cudaGetLastError(); /* not sticky: later launches must not see it */
        return st;
    }
    k_bt_vec<NM, STG><<<(unsigned)blocks, 32 * warps, smem, s>>>(mats, act, (const uint8_t *)limbs, n, cols, Y, ldy,
                                                                row0, row1, S, tpb);
    return gpu_cuda_status(cudaGetLastError(), "k_bt_vec");
}

template <int NM>
df_status launch_vec(const bt_mats &mats, const gpu_act &act, const float *X, int n, int64_t rows, int64_t cols,
                     float *Y, int64_t ldy, int64_t row0, int64_t row1, void *limbs, cudaStream_t s) {
    const int S = gpu_bf16_slices(rows, cols / BT_CH), tpb = S >= 8 ? 1 : 8 / S; /* S x tpb <= BT_SLICES warps */
    const int64_t tiles = (row1 - row0 + 15) / 16, blocks = (tiles + tpb - 1) / tpb;
    if (blocks > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    df_status st = split_limbs(X, n, cols, limbs, s);
    if (st) return st;
    if ((size_t)S * tpb * 3 * vec_stage(NM, n) <= BV_SMEM)
        return launch_vec_stg<NM, 3>(mats, act, n, cols, Y, ldy, row0, row1, limbs, S, tpb, blocks, s);
    return launch_vec_stg<NM, 2>(mats, act, n, cols, Y, ldy, row0, row1, limbs, S, tpb, blocks, s);
}

/* The wgmma blocks take a product when they may (wg, gpu_ws_wg) and, under
 * auto (0), when their grid of 256-row x 64-vector blocks (of each of nm
 * matrices, one launch) has at least WG_MIN_BLOCKS_ANY, or WG_MIN_BLOCKS with
 * 64 vectors or more (a block pads its vectors to 64, and fewer were not
 * measured against the mma.sync blocks). `cuda_bench 2 wg` on an
 * H100 after the folds' batches (bench/cuda_NOTES.md, fifty-sixth session),
 * mma.sync / wgmma TFLOP/s: every K3 shape with 48 blocks ran faster on
 * wgmma (12288 x 7168 at n = 64 58.2 / 65.8, 6144 x 7168 at n = 70 and 128
 * 31.0 / 34.5 and 58.5 / 63.7, 1536 x 7168 at n = 512 57.6 / 59.8), as did
 * 56 blocks (7168 x 12288 at n = 128 71.2 / 83.8), and every one with 28
 * or fewer slower (7168 x 12288 at n = 64 57.2 / 42.2, 1536 x 7168 at n =
 * 256 46.9 / 31.4): the mma.sync blocks' smaller tiles fill the device
 * better there. (96 until then, from the blocks' rates before the folds'
 * batches.) The same bits either way. */
enum { WG_MIN_BLOCKS_ANY = 96, WG_MIN_BLOCKS = 48 };
bool wg_takes(int wg, int64_t span, int n, int64_t cols, int nm) {
    if (cols >= (int64_t)1 << 22) return false; /* TMA's 32-bit coordinates */
    const int64_t blocks = nm * ((span + 255) / 256) * ((n + 63) / 64);
    return wg > 0 || (wg == 0 && (blocks >= WG_MIN_BLOCKS_ANY || (n >= 64 && blocks >= WG_MIN_BLOCKS)));
}

__global__ void __launch_bounds__(256) k_wg_act(float *__restrict__ Y, int64_t ldy, const float *__restrict__ U,
                                               int64_t span, int64_t total, const gpu_act act) {
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < total; i += (int64_t)gridDim.x * 256) {
        const int64_t v = i / span, r = i % span;
        float *y = Y + v * ldy + r;
        *y = gpu_act1(act, *y, U[i]);
    }
}

size_t wg_up_offset(int n, int64_t cols) { return (gpu_bf16_wg_bytes(n, cols) + 255) / 256 * 256; }

} // namespace

extern "C" int gpu_bf16_tc_takes(const gpu_weight *w) {
    return w && w->type == WT_BF16 && w->data && w->cols >= BT_CH && w->cols % BT_CH == 0 &&
           ((uintptr_t)w->data & 15) == 0;
}

size_t gpu_bf16_tc_bytes(int n, int64_t rows, int64_t cols, int nm) {
    const size_t mma = (size_t)n * 3 * (size_t)cols * 2, wg = wg_up_offset(n, cols);
    return nm == 2 ? wg + (size_t)n * (size_t)rows * 4 : (wg > mma ? wg : mma);
}

size_t gpu_bf16_tc_groups_bytes(int groups, int n, int64_t grows, int64_t cols) {
    const size_t one = gpu_bf16_tc_bytes(n, grows, cols, 1), all = gpu_bf16_wg_groups_bytes(groups, n, cols);
    return one > all ? one : all;
}

df_status gpu_bf16_tc_groups(const gpu_weight *w, int64_t woff, int64_t wpitch, int64_t grows, int groups,
                             const float *X, int n, float *Y, int64_t ygs, int64_t ldy, void *limbs, int wg,
                             cudaStream_t s) {
    if (!gpu_bf16_tc_takes(w) || !X || !Y || !limbs || n < 1 || groups < 1 || grows < 1 || woff < 0 || wpitch < 0 ||
        woff + (int64_t)(groups - 1) * wpitch + grows > w->rows || ldy < grows || ((uintptr_t)X & 15))
        return DF_ERR_ARG;
    if (wg >= 0) {
        df_status st = gpu_bf16_wg_groups(w, woff, wpitch, grows, groups, X, n, Y, ygs, ldy, limbs, s);
        if (st != DF_ERR_UNSUPPORTED) return st; /* else a group at a time below: the same bits */
    }
    for (int g = 0; g < groups; g++) {
        gpu_weight v = *w; /* the group's rows as a matrix of their own */
        v.data = (uint8_t *)w->data + (woff + (int64_t)g * wpitch) * w->cols * 2;
        v.rows = grows;
        df_status st = gpu_bf16_tc(&v, NULL, NULL, X + (int64_t)g * n * w->cols, n, Y + (int64_t)g * ygs, ldy, 0,
                                   grows, limbs, -1, s);
        if (st) return st;
    }
    return DF_OK;
}

df_status gpu_bf16_tc(const gpu_weight *w0, const gpu_weight *w1, const gpu_act *act, const float *X, int n,
                      float *Y, int64_t ldy, int64_t row0, int64_t row1, void *limbs, int wg, cudaStream_t s) {
    if (!gpu_bf16_tc_takes(w0) || (w1 && (!gpu_bf16_tc_takes(w1) || w1->rows != w0->rows || w1->cols != w0->cols)) ||
        (w1 && !act) || !X || !Y || n < 1 || row0 < 0 || row1 > w0->rows || row1 <= row0 || ldy < row1 - row0 ||
        ((uintptr_t)X & 15) || !limbs)
        return DF_ERR_ARG;
    if ((row1 - row0 + 31) / 32 > 65535) return DF_ERR_UNSUPPORTED; /* the smallest gemm blocks' rows */
    bt_mats mats;
    mats.w[0] = (const uint8_t *)w0->data;
    mats.w[1] = (const uint8_t *)(w1 ? w1->data : w0->data);
    const gpu_act a = act ? *act : gpu_act{0, 0.0f, 0.0f};
    const int64_t rows = w0->rows, cols = w0->cols, span = row1 - row0;
    if (n > BT_VEC_MAX && wg_takes(wg, span, n, cols, w1 ? 2 : 1)) {
        /* gate + up: the up's rows in the scratch after the limbs, then the act */
        float *U = w1 ? (float *)((char *)limbs + wg_up_offset(n, cols)) : NULL;
        df_status st = gpu_bf16_wg(w0, w1, X, n, Y, ldy, U, row0, row1, limbs, s);
        if (st != DF_ERR_UNSUPPORTED) { /* else the mma.sync kernels below: the same bits */
            if (st || !w1) return st;
            const int64_t total = (int64_t)n * span, b = (total + 255) / 256;
            k_wg_act<<<(unsigned)(b < 8192 ? b : 8192), 256, 0, s>>>(Y, ldy, U, span, total, a);
            return gpu_cuda_status(cudaGetLastError(), "k_wg_act");
        }
    }
    if (n <= BT_VEC_MAX)
        return w1 ? launch_vec<2>(mats, a, X, n, rows, cols, Y, ldy, row0, row1, limbs, s)
                  : launch_vec<1>(mats, a, X, n, rows, cols, Y, ldy, row0, row1, limbs, s);
    return w1 ? launch_gemms<2>(mats, a, X, n, rows, cols, Y, ldy, row0, row1, limbs, s)
              : launch_gemms<1>(mats, a, X, n, rows, cols, Y, ldy, row0, row1, limbs, s);
}
