/* gpu_mx_wg.cu — a batch's many-vector MXFP4 products on the fragment
 * layout (a prompt's routed experts) on Hopper's warpgroup tensor-core
 * instructions (wgmma), the same bits as gpu_mma.cu's mma.sync kernels
 * (gpu_mx_wg_batch, gpu_internal.h; gpu_tc_batch sends them here).
 * Refuses: builds without an sm_90a target (DF_ERR_UNSUPPORTED; the caller
 * asks gpu_ws_wg_present first, which also rules out devices other than
 * compute capability 9.0, and keeps the mma.sync kernels), items of more
 * than GPU_MX_WG_PASS vectors or not in the fragment layout (DF_ERR_ARG).
 *
 * Why: the mma.sync kernels hold 16 vectors an item, so an expert that
 * sees ~42 rows of a 512-token prompt is read and decoded three times, and
 * they ran the prompt's expert products at ~14% of the wgmma rate
 * (bench/cuda_NOTES.md). Here an item holds up to 48 vectors (wgmma's n is
 * 2 x 48: each vector's hi and lo limb columns side by side), so such an
 * expert is read once, and the products run on wgmma.
 *
 * Bits. The operations of gpu_mma.cu's kernels, in their order: per 32-value
 * block an f32 sum from zero takes the block's two k steps (the same 16
 * codes in the same k positions: A is the mma.sync A fragment of the
 * fragment layout, decoded by e2m1_quad; B is the split in wgmma's order,
 * k_xsplit_jobs<true>), then acc = fma(scale x 2^-k_v, sum, acc) per
 * (row, vector, limb); the k split's classes (groups c, c + KS, ... of
 * four blocks) each sum from zero in that order, and the classes are added
 * in class order (an empty class adds +0), as tile_sums adds its warps'
 * sums; y = hi sum + lo sum. wgmma's k16 sums equal mma.sync's (the bf16
 * blocks of gpu_bf16_wg.cu showed it; tests/cuda compares every output
 * with the mma.sync kernels bit for bit: cuda_frag_batch_shapes).
 *
 * Work layout. A block of MW_WG warpgroups owns 64 MW_WG consecutive rows of
 * one item (warp w: 16-row tile w, its A fragments from the fragment
 * layout, one group ahead in registers) and walks the groups class by
 * class; each group's x (NV vectors x 2 limbs x 128 values) is staged once
 * for the block by cp.async, MW_P stages deep, as wgmma's no-swizzle
 * K-major B: per block and half-step the NV / 4 core matrices of 8 columns
 * x 16 bytes, 128 bytes apart (the split's 512 bytes a block and vector
 * group are already in that order). Two accumulator sets a thread take
 * alternate blocks, so a block's wgmma runs while the one before is folded
 * into acc; the class sums sit in shared memory.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_internal.h"
#include "gpu_mx_frag.h"
#include "gpu_wgmma.h"

#ifndef GPU_MW_WG
#define GPU_MW_WG 2 /* warpgroups a block (build flag, for measurements) */
#endif
#ifndef GPU_MW_P
#define GPU_MW_P 3 /* x stages (build flag, for measurements) */
#endif

namespace {

enum {
    MW_WG = GPU_MW_WG,
    MW_THREADS = MW_WG * 128,
    MW_ROWS = MW_WG * 64,
    MW_P = GPU_MW_P,
};

/* bytes of one group's staged x for NV vectors: 4 blocks x 4 half-steps x NV / 4 core matrices of 128 */
__host__ __device__ constexpr int mw_stage_bytes(int nv) { return nv * 512; }
/* shared bytes of a block: the stages, then each thread's NV class sums */
__host__ __device__ constexpr int mw_smem_bytes(int nv) { return MW_P * mw_stage_bytes(nv) + nv * MW_THREADS * 4; }

#if WG_DEVICE
/* d = A B + (acc ? d : 0): A 64 x 16 f16 (this warp's 16 rows in a0..a3,
 * mma.sync's fragment layout), B 16 x 2 NV f16 from shared memory
 * (descriptor b). */
template <int NV> struct wg_f16;
template <> struct wg_f16<16> {
    static __device__ __forceinline__ void mma(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t b, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
                     "{%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
                     : WG_D8(0), WG_D8(8)
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(acc));
    }
};
template <> struct wg_f16<32> {
    static __device__ __forceinline__ void mma(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t b, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
                     "%24,%25,%26,%27,%28,%29,%30,%31}, "
                     "{%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                     : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(acc));
    }
};
template <> struct wg_f16<48> {
    static __device__ __forceinline__ void mma(float (&d)[48], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t b, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
                     "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,"
                     "%46,%47}, "
                     "{%48,%49,%50,%51}, %52, p, 1, 1, 0;\n}\n"
                     : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40)
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(acc));
    }
};
#endif

/* Block (blockIdx.x: MW_ROWS rows, blockIdx.y: the item); see the file
 * comment. KS: the k split's classes for this shape (gpu_mma.cu's
 * tc_layout), NV: vectors an item at most (a multiple of 16). */
template <int KS, int NV>
__global__ void __launch_bounds__(MW_THREADS, 1)
k_mx_frag_wg(const __grid_constant__ gpu_tc_tab tt, int64_t cols, int64_t rows) {
#if WG_DEVICE
    constexpr int NVG = NV / 4, STAGE = mw_stage_bytes(NV);
    extern __shared__ __align__(128) uint8_t sm[];
    float *const sums = (float *)(sm + MW_P * STAGE); /* [NV][MW_THREADS]: each thread's class sums */
    const gpu_tc_item &it = tt.it[blockIdx.y];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n = it.nv;
    const int nvg = min(NVG, (n + TC_VEC - 1) / TC_VEC);
    const int64_t nblk = cols / 32, ngrp = frag_groups(cols), gstride = nblk * 32;
    const int64_t r0 = (int64_t)blockIdx.x * MW_ROWS + warp * 16;
    const bool live = r0 < rows; /* a tile past the matrix: zero codes, its wgmma run, nothing written */
    const uint8_t *base = it.frag + (live ? r0 >> 4 : 0) * ngrp * FRAG_BYTES;
    float f[NVG]; /* this lane's vectors' 2^-k (times 2^14: the codes' f16 form) */
#pragma unroll
    for (int i = 0; i < NVG; i++) f[i] = (i < nvg && TC_VEC * i + t < n ? it.inv[TC_VEC * i + t] : 1.0f) * E2M1_UNDO;

    /* group m's x into stage p: a vector group's 128 pieces of 16 bytes
     * lie in the split as u = 8 kq + pc (k q kq, 16 bytes pc: block m * 4
     * + kq / 4), and go to stage offset (kq NVG + vg) 128 + 16 pc. A thread
     * keeps one u and takes every (MW_THREADS / 128)-th vector group, so its
     * addresses step by constants (a group's index arithmetic, not a piece's). */
    static_assert(NVG % (MW_THREADS / 128) == 0, "k_mx_frag_wg: vector groups a thread stages");
    constexpr int SV = MW_THREADS / 128; /* vector groups between a thread's pieces */
    const int su = tid & 127, svg = tid >> 7;
    const uint4 *const sx = it.xb + svg * gstride + su; /* this thread's first piece of group 0 */
    const int64_t sstep = SV * gstride;                 /* its next piece's, in uint4 */
    uint8_t *const sdst = sm + ((su >> 3) * NVG + svg) * 128 + (su & 7) * 16;
    auto stage = [&](int64_t m, int p) {
        uint8_t *dst = sdst + p * STAGE;
        const uint4 *src = sx + m * 128;
        const bool bin = m * 4 + (su >> 5) < nblk;
#pragma unroll
        for (int r = 0; r < NVG / SV; r++, src += sstep) {
            const bool in = bin && svg + r * SV < nvg;
            cp_async16(dst + r * SV * 128, in ? (const void *)src : (const void *)it.xb, in ? 16 : 0);
        }
    };
    int64_t ms = walk_stage_first<MW_P>(stage, ngrp, KS); /* the next group to stage, in walk order */
    uint4 c0 = make_uint4(0, 0, 0, 0), c1 = c0;
    uint2 sc = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
    if (live) frag_load(base, lane, c0, c1, sc);

    /* the stage's B descriptor: half-steps NV x 32 bytes apart (wgmma's k
     * direction), core matrices 128 apart along the columns */
    const uint64_t desc0 = wg_desc(sm, NV * 32, 128);
    float acc[NV], d0[NV], d1[NV];
#pragma unroll
    for (int e = 0; e < NV; e++) d0[e] = d1[e] = 0.0f; /* never read (each block's first k step ignores d) */
    int64_t i = 0;
    for (int c = 0; c < KS; c++) {
#pragma unroll
        for (int e = 0; e < NV; e++) acc[e] = 0.0f;
        for (int64_t m = c; m < ngrp; m += KS, i++) {
            cp_wait<MW_P - 2>();
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* cp.async's writes, seen by wgmma */
            __syncthreads(); /* group i's stage is in; every warpgroup is done with group i - 1's */
            walk_stage_next<MW_P>(stage, ms, i, ngrp, KS);
            const uint32_t wa[4] = {c0.x, c0.z, c1.x, c1.z}, wb[4] = {c0.y, c0.w, c1.y, c1.w};
            const uint32_t sca = sc.x, scb = sc.y;
            const int64_t mn = walk_next(m, ngrp, KS);
            if (live && mn >= 0) frag_load(base + mn * FRAG_BYTES, lane, c0, c1, sc);
            uint64_t db = desc0 + (uint64_t)((((uint32_t)i % MW_P) * STAGE) >> 4); /* 32-bit: i < 2^31 groups */
            asm volatile("mov.b64 %0, %0;" : "+l"(db)); /* made here, not hoisted per stage */
            const int nb = (int)min((int64_t)4, nblk - m * 4); /* blocks of this group inside the matrix */
            /* block k's two k steps into dd: the first writes A B (scale-d 0),
             * the second adds. mma.sync's kernels sum from +0 (d = 0; d += ...;
             * d += ...); the two differ at most in the sign of an all-zero
             * sum, which cannot reach y: acc starts at +0, and fma(s, +-0, +0)
             * is +0 under round-to-nearest, fma(s, +-0, a) = a otherwise, so acc
             * is never -0. (ptxas makes the same substitution for zeroed
             * accumulators on its own where it can prove them zero.) */
            auto issue = [&](float(&dd)[NV], int k) {
                uint32_t ha[4], hb[4];
                e2m1_quad(wa[k], ha);
                e2m1_quad(wb[k], hb);
                wg_fence();
                wg_hold(dd);
                const uint64_t bk = db + (uint64_t)((k * 4 * NV * 32) >> 4);
                wg_f16<NV>::mma(dd, ha[0], hb[0], ha[1], hb[1], bk, 0);
                wg_f16<NV>::mma(dd, ha[2], hb[2], ha[3], hb[3], bk + (uint64_t)((2 * NV * 32) >> 4), 1);
                wg_commit();
            };
            /* acc += block k's sums times its scales: dd[4 j + e] is row g + 8 (e >> 1),
             * column 8 j + 2 t + (e & 1): vector 4 j + t's hi (e even) or lo limb.
             * Every j: the vector groups past nvg fold their zero columns into
             * sums that are never written (no branch per j). */
            auto fold = [&](float(&dd)[NV], int k) {
                wg_hold(dd);
                const float sfa = e8m0_of(sca, k), sfb = e8m0_of(scb, k);
#pragma unroll
                for (int j = 0; j < NVG; j++) {
                    const float fa = __fmul_rn(sfa, f[j]), fb = __fmul_rn(sfb, f[j]);
                    acc[4 * j + 0] = __fmaf_rn(fa, dd[4 * j + 0], acc[4 * j + 0]);
                    acc[4 * j + 1] = __fmaf_rn(fa, dd[4 * j + 1], acc[4 * j + 1]);
                    acc[4 * j + 2] = __fmaf_rn(fb, dd[4 * j + 2], acc[4 * j + 2]);
                    acc[4 * j + 3] = __fmaf_rn(fb, dd[4 * j + 3], acc[4 * j + 3]);
                }
            };
            if (nb == 4) {
                issue(d0, 0);
                issue(d1, 1);
                wg_wait<1>();
                fold(d0, 0);
                issue(d0, 2);
                wg_wait<1>();
                fold(d1, 1);
                issue(d1, 3);
                wg_wait<1>();
                fold(d0, 2);
                wg_wait<0>();
                fold(d1, 3);
            } else { /* the matrix's last group: one block at a time */
#pragma unroll
                for (int k = 0; k < 3; k++)
                    if (k < nb) {
                        issue(d0, k);
                        wg_wait<0>();
                        fold(d0, k);
                    }
            }
        }
        /* tile_sums' order: class 0's sum, then + each later class's */
#pragma unroll
        for (int e = 0; e < NV; e++) {
            if (e >= 4 * nvg) break;
            float *o = sums + e * MW_THREADS + tid;
            *o = c ? __fadd_rn(*o, acc[e]) : acc[e];
        }
    }
    cp_wait<0>();
    if (!live) return;
#pragma unroll
    for (int j = 0; j < NVG; j++) {
        if (j >= nvg || TC_VEC * j + t >= n) break;
        float *y = it.Y + (int64_t)(TC_VEC * j + t) * it.ldy;
        const float *s = sums + 4 * j * MW_THREADS + tid;
        if (r0 + g < rows) y[r0 + g] = __fadd_rn(s[0], s[MW_THREADS]);
        if (r0 + g + 8 < rows) y[r0 + g + 8] = __fadd_rn(s[2 * MW_THREADS], s[3 * MW_THREADS]);
    }
#endif
}

template <int KS, int NV>
df_status launch_mw(const gpu_tc_tab &t, int count, int64_t cols, int64_t rows, cudaStream_t s) {
    const int smem = mw_smem_bytes(NV);
    df_status st = gpu_cuda_status(
        cudaFuncSetAttribute(k_mx_frag_wg<KS, NV>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "k_mx_frag_wg shared memory");
    if (st) {
        (void)cudaGetLastError();
        return st;
    }
    const dim3 grid((unsigned)((rows + MW_ROWS - 1) / MW_ROWS), (unsigned)count);
    k_mx_frag_wg<KS, NV><<<grid, MW_THREADS, smem, s>>>(t, cols, rows);
    return gpu_cuda_status(cudaGetLastError(), "k_mx_frag_wg");
}

template <int KS>
df_status launch_mw_ks(const gpu_tc_tab &t, int count, int64_t cols, int64_t rows, int nv, cudaStream_t s) {
    static_assert(GPU_MX_WG_NV == 16 && GPU_MX_WG_PASS == 48, "one kernel per class of GPU_MX_WG_NV vectors");
    if (nv <= 16) return launch_mw<KS, 16>(t, count, cols, rows, s);
    if (nv <= 32) return launch_mw<KS, 32>(t, count, cols, rows, s);
    return launch_mw<KS, 48>(t, count, cols, rows, s);
}

} // namespace

df_status gpu_mx_wg_batch(const gpu_tc_tab &t, int count, int64_t cols, int64_t rows, int ks, cudaStream_t s) {
    if (count < 1) return DF_OK;
    if (count > TCB_MAX || cols < 32 || cols % 32 || rows < 1 || (ks != 4 && ks != 8)) return DF_ERR_ARG;
    int nv = 0;
    for (int i = 0; i < count; i++) {
        if (!t.it[i].frag || t.it[i].nv < 1 || t.it[i].nv > GPU_MX_WG_PASS) return DF_ERR_ARG;
        nv = t.it[i].nv > nv ? t.it[i].nv : nv;
    }
    if ((rows + MW_ROWS - 1) / MW_ROWS > 0x7fffffff) return DF_ERR_UNSUPPORTED;
#ifndef DF_WG_SM90A
    return DF_ERR_UNSUPPORTED; /* no sm_90a pass in this build: the kernel's body is empty */
#endif
    return ks == 8 ? launch_mw_ks<8>(t, count, cols, rows, nv, s) : launch_mw_ks<4>(t, count, cols, rows, nv, s);
}
