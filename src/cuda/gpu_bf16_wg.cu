/* gpu_bf16_wg.cu — bf16 weights times fp32 vectors on Hopper's warpgroup
 * tensor-core instructions (wgmma), for the many-vector products of a
 * prompt (gpu_bf16_wg, gpu_internal.h; gpu_bf16_tc sends them here).
 * Refuses: devices other than compute capability 9.0, builds without an
 * sm_90a target and drivers without a tensor-map encoder (gpu_ws_wg says
 * -1; the caller keeps gpu_bf16_tc's mma.sync kernels), columns that are
 * not a multiple of 64 (DF_ERR_ARG), rows of 4M columns or more and weights
 * off 16-byte boundaries (DF_ERR_UNSUPPORTED: TMA's coordinates and
 * addresses; gpu_bf16_tc sends neither, and on that answer runs its
 * mma.sync kernels instead, the same bits).
 *
 * Why: gpu_bf16_tc's mma.sync blocks ran K3's large products at ~84-96
 * TFLOP/s of the model's FLOPs. Here a block holds 256 weight rows x 64
 * vectors (4 warpgroups) and wgmma reads the limbs from shared memory
 * itself: 122-140 TFLOP/s at 512 vectors (bench/cuda_NOTES.md, twenty-ninth
 * session, where L2 was measured not to be the bound); a fifth warpgroup
 * copying each chunk by TMA, with mbarriers in place of a block barrier a
 * chunk, took that to 139-159 on an H100 (fifty-first session).
 *
 * Bits. The same operations in the same order as gpu_bf16_tc.cu (its header
 * states the contract and the bound): x split into hi, mid, lo bf16 limbs;
 * per slice (bf16_slices, the same S) one fp32 accumulator from zero takes,
 * chunk by chunk, the chunk's four k steps, each the hi, mid, lo limb; the
 * slices are added in order at their ends. Step j of a chunk takes the same
 * 16 columns in the same k positions as there: k pair (2t, 2t + 1) is
 * columns b + 8t + {0, 1} and k pair (2t + 8, 2t + 9) is b + 8t + {2, 3},
 * b = 4 (j & 1) + 32 (j >> 1). The weights are wgmma's A operand from
 * registers, loaded exactly as gpu_bf16_tc loads its A fragments; the limbs
 * are B from shared memory, so k_wg_split writes them already permuted into
 * that k order. Tests compare every output with gpu_bf16_tc's kernels bit
 * for bit (tests/cuda: cuda_tc_bf16_wg).
 *
 * Groups (gpu_bf16_wg_groups): one launch may take several products of
 * one matrix's row blocks, each against its own vectors (MLA's heads: W_UV
 * rows of kv_b times each head's latent); a group's rows and vectors are
 * a product of their own, so its outputs have those bits.
 *
 * Limb layout (k_wg_split): [chunk][q][npad][16 bytes], q = (j * 3 + L) * 2
 * + h the 16-byte half h of step j's limb L, npad = groups x n rounded up
 * to the block's vectors (each group's pad vectors zero), so that a block's copy of one q
 * is one contiguous run and its shared copy is wgmma's no-swizzle K-major
 * layout: core matrices of 8 vectors x 16 bytes, 128 bytes apart along the
 * vectors, WG_BN x 16 bytes apart along k.
 */
#include <cuda.h> /* CUtensorMap and its encoder's types; the encoder comes through the runtime */
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "gpu.h"
#include "gpu_internal.h"
#include "gpu_wgmma.h"

#ifndef GPU_WG_NWG
#define GPU_WG_NWG 4 /* build flag, for measurements */
#endif
#ifndef GPU_WG_BN
#define GPU_WG_BN 64 /* build flag, for measurements: 64 or 128 */
#endif
#ifndef GPU_WG_FOLD
#define GPU_WG_FOLD 8 /* build flag, for measurements: values a fold loads before it stores (4, 8, 16, 32) */
#endif
#ifndef GPU_WG_PROBE
#define GPU_WG_PROBE 0 /* build flag, a diagnosis that gives wrong outputs: 1 copies only the first stages'
                          chunks (the copy warpgroup then hands stale stages on), 2 also skips the weight
                          fragments' shared loads, so the blocks' rate without their feed */
#endif
#ifndef GPU_WG_NARROW
#define GPU_WG_NARROW 1 /* build flag, for measurements: 0 runs groups of <= 128 rows on 256-row blocks too */
#endif

namespace {

enum {
    WG_CH = 64,    /* columns a chunk */
    WG_CHB = 128,  /* bytes of a weight row's chunk */
    WG_Q = 24,     /* 16-byte limb pieces of a vector's chunk: 4 steps x 3 limbs x 2 halves */
    WG_NWG = GPU_WG_NWG, /* warpgroups a block: 256 weight rows */
    WG_BN = GPU_WG_BN, /* vectors a block (wgmma's n); n is padded to a multiple */
    WG_FOLD = GPU_WG_FOLD, /* a fold's batch of loads */
    WG_SMEM = 227 << 10
};

/* A block: NWG warpgroups of 64 weight rows each, BN vectors (wgmma's n,
 * 64; 128 with -DGPU_WG_BN=128), and a copy warpgroup. Measured (`cuda_bench
 * 2 wg`, H100, K3's shapes at 512 vectors, TFLOP/s of the model's products):
 * 4 x 64 102-159, 3 x 128 98-152, 2 x 128 82-142 (bench/cuda_NOTES.md,
 * fifty-first session); so 4 x 64 is the build.
 * Stages: as many as fit, at most 4 (with the 1024-byte alignment of the
 * swizzled weight boxes and the 2 mbarriers a stage). Registers: the
 * block's allocation at launch (65536 over the threads, in steps of 8) is
 * all there is, so once the copy warpgroup keeps 24 a thread the others
 * may take REGS (4 x 64: 112; 96 at launch). */
template <int NWG, int BN> struct wg_cfg {
    static constexpr int MMA_THREADS = NWG * 128, THREADS = MMA_THREADS + 128, BM = NWG * 64;
    static constexpr int A_BYTES = BM * WG_CHB, B_BYTES = WG_Q * BN * 16, STAGE = A_BYTES + B_BYTES;
    static constexpr int FIT = (WG_SMEM - 1024 - 64) / STAGE, STAGES = FIT > 4 ? 4 : FIT;
    static constexpr size_t SMEM = (size_t)STAGES * STAGE + 1024 + 16 * STAGES;
    static constexpr int FREE = (65536 / THREADS / 8 * 8 * THREADS - 24 * 128) / MMA_THREADS / 8 * 8;
    static constexpr int REGS = FREE > 240 ? 240 : FREE; /* setmaxnreg's most */
    static_assert(STAGES >= 2 && A_BYTES % 1024 == 0 && STAGE % 1024 == 0 && BN % 64 == 0 && REGS >= 64,
                  "wg_cfg shape");
};

/* ---- limbs: X [groups][n][cols] fp32 -> [chunk][q][npad][16 B] bf16, npad
 * = groups x npadg (group g's vectors from g npadg on, its pad zero) ---- */
__global__ void __launch_bounds__(256) k_wg_split(const float *__restrict__ X, int n, int npad, int npadg,
                                                 int64_t cols, uint4 *__restrict__ L) {
    const int64_t nch = cols / WG_CH, total = (int64_t)npad * nch * 8; /* (vector, chunk, step-half) */
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < total; i += (int64_t)gridDim.x * 256) {
        const int p = (int)(i & 7); /* p = 2 j + h */
        const int64_t vc = i >> 3, v = vc % npad, c = vc / npad, vg = v % npadg;
        const int j = p >> 1, h = p & 1;
        uint32_t hi[4] = {0, 0, 0, 0}, mi[4] = {0, 0, 0, 0}, lo[4] = {0, 0, 0, 0};
        if (vg < n) {
            /* k pair t of this half: columns b + 2h + 8t + {0, 1} */
            const float *x = X + (v / npadg * n + vg) * cols + c * WG_CH + 4 * (j & 1) + 32 * (j >> 1) + 2 * h;
            const float2 x0 = *(const float2 *)(x), x1 = *(const float2 *)(x + 8);
            const float2 x2 = *(const float2 *)(x + 16), x3 = *(const float2 *)(x + 24);
            bf16_limbs8(make_float4(x0.x, x0.y, x1.x, x1.y), make_float4(x2.x, x2.y, x3.x, x3.y), hi, mi, lo);
        }
        uint4 *o = L + (c * WG_Q + (j * 3) * 2 + h) * npad + v; /* q = (j 3 + limb) 2 + h */
        o[0] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        o[2 * npad] = make_uint4(mi[0], mi[1], mi[2], mi[3]);
        o[4 * npad] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
}


/* The products of one launch (blockIdx.z): a matrix, or a gate and an up
 * matrix of one shape (their grids in one, so that a wave holds both). */
struct wg_mats {
    CUtensorMap tw[2]; /* the weights, boxes of 64 columns x BM rows, rows past the map read as 0 */
    float *y[2];
    int64_t ldy[2];
};

/* Groups of one launch (blockIdx.y / blocks a group): group g's rows
 * [0, rows) are weight rows woff + g wpitch + .., its vectors the limbs'
 * g lvec + .., its outputs from y + g ygs. One product: a group of
 * row1 - row0 rows from woff = row0, the other fields 0. */
struct wg_grp {
    int64_t rows, woff, wpitch, lvec, ygs;
};

#if WG_DEVICE
__device__ __forceinline__ int64_t wg_slice_end(int s, int64_t per, int64_t nch) {
    const int64_t e = (int64_t)(s + 1) * per;
    return e < nch ? e : nch;
}

/* mbarriers, TMA and bulk copies into this block's shared memory */
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!ok);
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap *map, int x, int y, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];" ::"r"(dst),
                 "l"((uint64_t)map), "r"(x), "r"(y), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
#endif

/* Block (blockIdx.x: BN vectors, blockIdx.y: BM rows of a group, grp's,
 * blockIdx.z: the matrix): warpgroup k < NWG takes rows 64 k .. 64 k + 63, its warp w
 * rows 16 w .. 16 w + 15 (warp 4 k + w of the block); warpgroup NWG copies.
 * Stage c % STAGES holds chunk c: its weight rows (one TMA box, 128-byte
 * swizzle: 16-byte piece i of row r at i ^ (r & 7)) and its limbs (24 bulk
 * copies of BN x 16 bytes), both completing on the stage's `full`
 * mbarrier. A warpgroup waits on that barrier alone, loads its fragments,
 * issues the chunk's wgmma while chunk c - 1's still run (two fragment
 * buffers, wgmma.wait_group 1), and then hands chunk c - 1's stage back on
 * its `empty` mbarrier (a warp each). No block-wide barrier in the loop: a
 * warpgroup runs ahead of another by as many stages as are loaded. A
 * slice's sum goes to Y at the slice's end (Y = 0 + sum, then Y = Y + sum:
 * the fold's order). */
template <int NWG, int BN>
__global__ void __launch_bounds__(wg_cfg<NWG, BN>::THREADS, 1)
k_bt_wg(const __grid_constant__ wg_mats mats, const wg_grp grp, const uint8_t *__restrict__ Lg, int n, int npad,
        int64_t cols, int S) {
#if WG_DEVICE
    using C = wg_cfg<NWG, BN>;
    constexpr int ND = BN / 2, NS = C::STAGES;
    extern __shared__ __align__(1024) uint8_t sm_raw[];
    uint8_t *sm = (uint8_t *)(((uintptr_t)sm_raw + 1023) & ~(uintptr_t)1023); /* the swizzle's 1024-byte atoms */
    const uint32_t full0 = smem_u32(sm + NS * C::STAGE), empty0 = full0 + 8 * NS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t v0 = (int64_t)blockIdx.x * BN, bpg = (grp.rows + C::BM - 1) / C::BM;
    const int64_t gi = blockIdx.y / bpg, rb = blockIdx.y % bpg * C::BM; /* group, first row in it */
    const int64_t nch = cols / WG_CH, per = (nch + S - 1) / S;
    if (tid == 0) {
        for (int i = 0; i < NS; i++) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, NWG * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp >= NWG * 4) { /* the copy warpgroup: its first warp copies */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
        if (warp != NWG * 4) return;
        const CUtensorMap *tw = &mats.tw[blockIdx.z];
        const uint8_t *lb = Lg + (gi * grp.lvec + v0) * 16;
        const int wr = (int)(grp.woff + gi * grp.wpitch + rb); /* the box's first weight row */
        for (int64_t c = 0; c < nch; c++) {
            const int st = (int)(c % NS);
            if (c >= NS) mbar_wait(empty0 + 8 * st, (uint32_t)((c / NS - 1) & 1));
            const uint32_t a = smem_u32(sm + (size_t)st * C::STAGE), full = full0 + 8 * st;
#if GPU_WG_PROBE
            if (c >= NS) { /* the diagnosis: the stage as it is */
                if (lane == 0) mbar_arrive(full);
                continue;
            }
#endif
            if (lane == 0) {
                mbar_expect(full, C::STAGE);
                tma_2d(a, tw, (int)(c * WG_CH), wr, full);
            }
            __syncwarp();
            if (lane < WG_Q)
                bulk_copy(a + C::A_BYTES + lane * BN * 16, lb + (c * WG_Q + lane) * (int64_t)npad * 16, BN * 16, full);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(C::REGS));
    const int g = lane >> 2, t = lane & 3;
    float *const Y = mats.y[blockIdx.z] + gi * grp.ygs;
    const int64_t ldy = mats.ldy[blockIdx.z];
    /* the limbs of stage 0: core matrices 128 bytes apart along the vectors, BN x 16 along k */
    const uint64_t desc0 = wg_desc(sm + C::A_BYTES, BN * 16, 128);
    float d[ND]; /* accumulators a thread: 64 rows x BN over 128 threads */
#pragma unroll
    for (int e = 0; e < ND; e++) d[e] = 0.0f;
    const int arow = warp * 16 + g, sw = arow & 7; /* this lane's rows arow, arow + 8 (the same swizzle) */
    /* d[4 i + e]: row arow + 8 (e >> 1), vector 8 i + 2 t + (e & 1) */
    auto fold = [&](int &s, int64_t c) {
        if (!(s < S && c + 1 == wg_slice_end(s, per, nch))) return;
        wg_wait<0>();
        wg_hold(d);
        /* made here from laundered values, so that no address or bound is
         * hoisted out of the chunk loop into registers of its own */
        int64_t yo = (v0 + 2 * t) * ldy + (rb + arow), ld = ldy, rl = grp.rows - (rb + arow), vl = n - (v0 + 2 * t);
        asm volatile("mov.b64 %0, %0;" : "+l"(yo));
        asm volatile("mov.b64 %0, %0;" : "+l"(ld));
        asm volatile("mov.b64 %0, %0;" : "+l"(rl));
        asm volatile("mov.b64 %0, %0;" : "+l"(vl));
        /* the slice sums so far in batches of WG_FOLD values, each batch's
         * loads issued before its stores: the compiler cannot tell that the
         * rows do not overlap, so loads between stores wait one L2 round
         * trip each (32 a fold) */
        constexpr int FI = WG_FOLD / 4;
        static_assert(WG_FOLD % 4 == 0 && FI > 0 && (BN / 8) % FI == 0, "a fold's batch: whole groups of 4 values");
#pragma unroll
        for (int i0 = 0; i0 < BN / 8; i0 += FI) {
            float prev[WG_FOLD];
#pragma unroll
            for (int i = i0; i < i0 + FI; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const bool in = 8 * (e >> 1) < rl && 8 * i + (e & 1) < vl;
                    prev[4 * (i - i0) + e] = s > 0 && in ? Y[yo + (8 * i + (e & 1)) * ld + 8 * (e >> 1)] : 0.0f;
                }
#pragma unroll
            for (int i = i0; i < i0 + FI; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float *o = Y + yo + (8 * i + (e & 1)) * ld + 8 * (e >> 1);
                    const bool in = 8 * (e >> 1) < rl && 8 * i + (e & 1) < vl;
                    float y = __fadd_rn(prev[4 * (i - i0) + e], d[4 * i + e]);
                    for (int s2 = s + 1; s2 < S && c + 1 == wg_slice_end(s2, per, nch); s2++)
                        y = __fadd_rn(y, 0.0f); /* empty slices ending here too */
                    if (in) *o = y;
                    d[4 * i + e] = 0.0f;
                }
        }
        while (s < S && c + 1 == wg_slice_end(s, per, nch)) s++;
    };
    auto chunk = [&](int64_t c, uint32_t(&ra)[8], uint32_t(&rb)[8], int &s) {
        const int st = (int)(c % NS);
        mbar_wait(full0 + 8 * st, (uint32_t)((c / NS) & 1));
#if GPU_WG_PROBE >= 2
        for (int i = 0; i < 8; i++) ra[i] = rb[i] = (uint32_t)c * 0x3f803f80u; /* the diagnosis: no fragment loads */
#else
        const uint8_t *a = sm + (size_t)st * C::STAGE + arow * WG_CHB;
        const uint4 p0 = *(const uint4 *)(a + ((t ^ sw) << 4)), p1 = *(const uint4 *)(a + (((4 + t) ^ sw) << 4));
        const uint4 q0 = *(const uint4 *)(a + 8 * WG_CHB + ((t ^ sw) << 4)),
                    q1 = *(const uint4 *)(a + 8 * WG_CHB + (((4 + t) ^ sw) << 4));
        ra[0] = p0.x, ra[1] = p0.y, ra[2] = p0.z, ra[3] = p0.w, ra[4] = p1.x, ra[5] = p1.y, ra[6] = p1.z, ra[7] = p1.w;
        rb[0] = q0.x, rb[1] = q0.y, rb[2] = q0.z, rb[3] = q0.w, rb[4] = q1.x, rb[5] = q1.y, rb[6] = q1.z, rb[7] = q1.w;
#endif
        /* this stage's limb descriptor, made in the loop (not hoisted: one
         * 64-bit descriptor per stage and step would hold 24 registers each) */
        uint64_t db = desc0 + (uint64_t)((st * C::STAGE) >> 4);
        asm volatile("mov.b64 %0, %0;" : "+l"(db));
        wg_fence();
        wg_hold(d);
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int L = 0; L < 3; L++)
                wg_mma(d, ra[2 * j], rb[2 * j], ra[2 * j + 1], rb[2 * j + 1],
                       db + (uint64_t)(((j * 3 + L) * 2 * BN * 16) >> 4));
        wg_commit();
        wg_wait<1>(); /* chunk c - 1's wgmma done: its fragments and its stage are free */
        wg_hold(d);
        if (c > 0) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * (int)((c - 1) % NS));
        }
        fold(s, c);
    };
    uint32_t fa[2][8], fb[2][8];
    int s = 0;
    for (int64_t c = 0; c < nch; c += 2) {
        chunk(c, fa[0], fb[0], s);
        if (c + 1 < nch) chunk(c + 1, fa[1], fb[1], s);
    }
    wg_wait<0>();
#endif
}

/* The driver's tensor-map encoder, found through the runtime (no link to
 * libcuda); NULL where the driver has none. */
PFN_cuTensorMapEncodeTiled_v12000 wg_encoder(void) {
    void *f = NULL;
#if CUDART_VERSION >= 12050
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
        f = NULL;
#else /* toolkits before 12.5: the call that 12.5 deprecates */
    if (cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault) != cudaSuccess) f = NULL;
#endif
    if (!f) (void)cudaGetLastError();
    return (PFN_cuTensorMapEncodeTiled_v12000)f;
}

/* k_bt_wg's launch over w[0] (and w[1]: nm = 2) for groups of grp: the
 * weights' tensor maps (map_rows rows, the rows past them read as 0) made
 * here; DF_ERR_UNSUPPORTED where a map cannot be made. npadg: a group's
 * vectors, a multiple of BN (the limbs hold groups x npadg). */
template <int NWG, int BN>
df_status launch_wg(const gpu_weight *const w[2], float *const y[2], const int64_t ldy[2], int nm, const void *limbs,
                    int n, int64_t npadg, int64_t cols, const wg_grp &grp, int64_t groups,
                    int64_t map_rows, int S, cudaStream_t s) {
    using C = wg_cfg<NWG, BN>;
    const PFN_cuTensorMapEncodeTiled_v12000 enc = wg_encoder();
    const int64_t yblocks = groups * ((grp.rows + C::BM - 1) / C::BM);
    if (!enc || yblocks > 65535) return DF_ERR_UNSUPPORTED;
    wg_mats m;
    memset(&m, 0, sizeof m);
    for (int z = 0; z < nm; z++) {
        const cuuint64_t dim[2] = {(cuuint64_t)cols, (cuuint64_t)map_rows}, stride[1] = {(cuuint64_t)cols * 2};
        const cuuint32_t box[2] = {WG_CH, C::BM}, es[2] = {1, 1};
        if (((uintptr_t)w[z]->data & 15) ||
            enc(&m.tw[z], CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, w[z]->data, dim, stride, box, es,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
            return DF_ERR_UNSUPPORTED;
        m.y[z] = y[z];
        m.ldy[z] = ldy[z];
    }
    df_status st = gpu_cuda_status(
        cudaFuncSetAttribute(k_bt_wg<NWG, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM),
        "k_bt_wg shared memory");
    if (st) {
        (void)cudaGetLastError();
        return st;
    }
    const dim3 grid((unsigned)(npadg / BN), (unsigned)yblocks, (unsigned)nm);
    k_bt_wg<NWG, BN><<<grid, C::THREADS, C::SMEM, s>>>(m, grp, (const uint8_t *)limbs, n, (int)(groups * npadg),
                                                             cols, S);
    return gpu_cuda_status(cudaGetLastError(), "k_bt_wg");
}

/* n vectors padded to whole blocks of WG_BN */
int64_t wg_npad(int n) { return ((int64_t)n + WG_BN - 1) / WG_BN * WG_BN; }

/* X's limbs for k_bt_wg: groups x npadg vectors (see k_wg_split). */
df_status wg_split(const float *X, int n, int64_t npadg, int64_t groups, int64_t cols, void *limbs, cudaStream_t s) {
    const int64_t total = groups * npadg * (cols / WG_CH) * 8, sb = (total + 255) / 256;
    k_wg_split<<<(unsigned)(sb < 8192 ? sb : 8192), 256, 0, s>>>(X, n, (int)(groups * npadg), (int)npadg, cols,
                                                                 (uint4 *)limbs);
    return gpu_cuda_status(cudaGetLastError(), "k_wg_split");
}

/* The tensor-core probe's wgmma half (gpu_tc_probe.cu times it): each of
 * WG_PROBE_WG warpgroups a block issues `iters` x 8 m64n256k16 bf16 wgmma
 * into one accumulator set, operands from a zeroed shared tile (their
 * values do not change the rate); a sum of the results that is never
 * 1234.5 keeps them. */
enum { WG_PROBE_WG = 2, WG_PROBE_A = 64 * 16 * 2, WG_PROBE_B = 256 * 16 * 2 };
__global__ void __launch_bounds__(WG_PROBE_WG * 128) k_wg_probe(int iters, float *out) {
#if WG_DEVICE
    __shared__ __align__(128) uint8_t sm[WG_PROBE_A + WG_PROBE_B];
    for (int i = threadIdx.x; i < (WG_PROBE_A + WG_PROBE_B) / 16; i += blockDim.x)
        ((uint4 *)sm)[i] = make_uint4(0, 0, 0, 0);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* the stores, seen by wgmma */
    __syncthreads();
    /* no-swizzle K-major core matrices: 8 rows x 16 bytes, 128 bytes apart
     * along k, 256 along the rows */
    const uint64_t a = wg_desc(sm, 128, 256), b = wg_desc(sm + WG_PROBE_A, 128, 256);
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.0f;
    for (int it = 0; it < iters; it++) {
        wg_fence();
#pragma unroll
        for (int j = 0; j < 8; j++) wg_mma_ss256(d, a, b);
        wg_commit();
        wg_wait<0>();
    }
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 128; i++) sum += d[i];
    if (sum == 1234.5f) out[0] = sum;
#endif
}

} // namespace

/* 1 when this build and device can run k_bt_wg (compute capability 9.0 and
 * an sm_90a image in this object). */
static int wg_present(void) {
#ifndef DF_WG_SM90A
    return 0; /* no sm_90a pass in this build: k_bt_wg's body is empty */
#else
    int dev = 0, ma = 0, mi = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev) ||
        cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev)) {
        (void)cudaGetLastError();
        return 0;
    }
    if (ma != 9 || mi != 0) return 0;
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, k_bt_wg<WG_NWG, WG_BN>) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return fa.binaryVersion == 90 && wg_encoder() != NULL;
#endif
}

extern "C" int gpu_ws_wg_present(gpu_ws *ws) {
    if (!ws->wg_known) ws->wg_known = wg_present() ? 1 : 2;
    return ws->wg_known == 1;
}

extern "C" int gpu_ws_wg(gpu_ws *ws) {
    if (ws->bf16_wg < 0) return -1;
    return gpu_ws_wg_present(ws) ? ws->bf16_wg : -1;
}

/* Launches the probe's wgmma kernel (blocks x WG_PROBE_WG warpgroups, each
 * iters x 8 wgmma of 2 x 64 x 256 x 16 FLOPs) on s: its FLOPs in *flops, or
 * DF_ERR_UNSUPPORTED where k_bt_wg cannot run (no sm_90a image, another
 * device). */
df_status gpu_wg_probe_launch(int blocks, int iters, float *out, double *flops, cudaStream_t s) {
    if (!wg_present()) return DF_ERR_UNSUPPORTED;
    k_wg_probe<<<(unsigned)blocks, WG_PROBE_WG * 128, 0, s>>>(iters, out);
    *flops = (double)blocks * WG_PROBE_WG * iters * 8 * 2.0 * 64 * 256 * 16;
    return gpu_cuda_status(cudaGetLastError(), "k_wg_probe");
}

size_t gpu_bf16_wg_bytes(int n, int64_t cols) { return gpu_bf16_wg_groups_bytes(1, n, cols); }

size_t gpu_bf16_wg_groups_bytes(int groups, int n, int64_t cols) {
    return (size_t)groups * (size_t)wg_npad(n) * 3 * (size_t)cols * 2;
}

df_status gpu_bf16_wg(const gpu_weight *w0, const gpu_weight *w1, const float *X, int n, float *Y, int64_t ldy,
                      float *U, int64_t row0, int64_t row1, void *limbs, cudaStream_t s) {
    const gpu_weight *w = w0;
    if (!w || w->type != WT_BF16 || !w->data || w->cols < WG_CH || w->cols % WG_CH || !X || !Y || n < 1 ||
        row0 < 0 || row1 > w->rows || row1 <= row0 || ldy < row1 - row0 || !limbs || ((uintptr_t)X & 7) ||
        (w1 && (w1->type != WT_BF16 || !w1->data || w1->rows != w->rows || w1->cols != w->cols || !U)))
        return DF_ERR_ARG;
    const int64_t npad = wg_npad(n), cols = w->cols;
    if (cols >= (int64_t)1 << 22 || row1 > 0x7fffffff || npad > 0x7fffffff)
        return DF_ERR_UNSUPPORTED; /* TMA's 32-bit coordinates, the kernel's int npad */
    df_status st = wg_split(X, n, npad, 1, cols, limbs, s);
    if (st) return st;
    const gpu_weight *ws[2] = {w0, w1 ? w1 : w0};
    float *const y[2] = {Y, w1 ? U : Y};
    const int64_t ldys[2] = {ldy, row1 - row0};
    const wg_grp grp = {row1 - row0, row0, 0, 0, 0};
    return launch_wg<WG_NWG, WG_BN>(ws, y, ldys, w1 ? 2 : 1, limbs, n, npad, cols, grp, 1, row1,
                                    gpu_bf16_slices(w->rows, cols / WG_CH), s);
}

df_status gpu_bf16_wg_groups(const gpu_weight *w, int64_t woff, int64_t wpitch, int64_t grows, int groups,
                             const float *X, int n, float *Y, int64_t ygs, int64_t ldy, void *limbs, cudaStream_t s) {
    if (!w || w->type != WT_BF16 || !w->data || w->cols < WG_CH || w->cols % WG_CH || !X || !Y || n < 1 ||
        groups < 1 || grows < 1 || woff < 0 || wpitch < 0 || woff + (int64_t)(groups - 1) * wpitch + grows > w->rows ||
        ldy < grows || !limbs || ((uintptr_t)X & 7))
        return DF_ERR_ARG;
    const int64_t npadg = wg_npad(n), cols = w->cols;
    if (cols >= (int64_t)1 << 22 || w->rows > 0x7fffffff || npadg * groups > 0x7fffffff)
        return DF_ERR_UNSUPPORTED; /* TMA's 32-bit coordinates, the kernel's int npad */
    df_status st = wg_split(X, n, npadg, groups, cols, limbs, s);
    if (st) return st;
    const gpu_weight *ws[2] = {w, w};
    float *const y[2] = {Y, Y};
    const int64_t ldys[2] = {ldy, ldy};
    const wg_grp grp = {grows, woff, wpitch, npadg, ygs};
    const int S = gpu_bf16_slices(grows, cols / WG_CH);
    if (GPU_WG_NARROW && grows <= 128) /* blocks of 128 rows: no half-empty blocks for a head's 128 W_UV rows */
        return launch_wg<2, WG_BN>(ws, y, ldys, 1, limbs, n, npadg, cols, grp, groups, w->rows, S, s);
    return launch_wg<WG_NWG, WG_BN>(ws, y, ldys, 1, limbs, n, npadg, cols, grp, groups, w->rows, S, s);
}
