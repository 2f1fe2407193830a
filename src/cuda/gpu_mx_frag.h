/* gpu_mx_frag.h — what the MXFP4 tensor-core kernels share (gpu_mma.cu's
 * mma.sync kernels, gpu_mx_wg.cu's wgmma kernel): the e2m1 decode to f16,
 * the e8m0 scales, the fragment layout and its loads, the k split's walk,
 * and a batch's table of items.
 * Refuses: nothing; device helpers and plain structs only (gpu_mma.cu's
 * header states the exactness contract they serve).
 *
 * The fragment layout (gpu_mx_frag_pack): a matrix re-laid once on the
 * device so that each lane loads what it feeds the mma straight from global
 * memory, whole lines, no staging: per 16-row tile and group m of four
 * 32-value blocks a chunk of FRAG_BYTES: lane l = 4 g + t's eight code words
 * as two uint4, at 16 l and 512 + 16 l, {wa0, wb0, wa1, wb1} and {wa2, wb2,
 * wa3, wb3} (wa_k: bytes 4t .. 4t+3 of block 4m + k of row g; wb_k: of row
 * g + 8), then 8 scale bytes per g (row g's four, row g + 8's four). Rows
 * past the matrix repeat its last row, blocks past it are zero codes under
 * scale 127 (never summed).
 */
#ifndef DF_GPU_MX_FRAG_H
#define DF_GPU_MX_FRAG_H

#include <cuda_fp16.h>
#include <stdint.h>

#include "gpu_internal.h"

#ifndef GPU_TC_QUAD
#define GPU_TC_QUAD 1 /* 0: decode code pairs by shifts and masks (e2m1_pair), ~2% slower */
#endif
#ifndef GPU_TC_SUBNORMAL
#define GPU_TC_SUBNORMAL 1 /* 0: scale the e2m1 codes out of the f16 subnormals (HMUL2) */
#endif

/* A batch's products (gpu_tc_batch): up to TCB_MAX items a launch, an item
 * some vectors of one job against one matrix (data / scale, or its
 * fragment layout), their splits at xb / inv, their outputs at Y. */
enum { TCB_MAX = 64 };
struct gpu_tc_item {
    const uint8_t *data, *scale, *frag; /* frag: the fragment layout, or NULL */
    const uint4 *xb;
    const float *inv;
    float *Y;
    int64_t ldy;
    int nv;
};
struct gpu_tc_tab {
    gpu_tc_item it[TCB_MAX];
};

namespace {

enum { TC_VEC = 4 }; /* vectors per mma: 8 columns = 4 x (hi, lo) */

/* Codes j and j + 4 of u as one f16x2, exact: the f16 bits (s << 15) |
 * (e1 e0 m << 9) are value * 2^-14 (e = 0 on the subnormals); times 2^14. */
#if !GPU_TC_SUBNORMAL
__device__ __forceinline__ uint32_t e2m1_scale_up(uint32_t h) { /* times 2^14, exact */
    __half2 r = __hmul2(*reinterpret_cast<__half2 *>(&h), __half2half2(__ushort_as_half(0x7400)));
    return *reinterpret_cast<uint32_t *>(&r);
}
#endif
#if !GPU_TC_QUAD
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t u, int j) {
    uint32_t v = u << (12 - 4 * j);
    uint32_t h = (v & 0x80008000u) | ((v >> 3) & 0x0e000e00u);
#if GPU_TC_SUBNORMAL
    return h; /* the tensor cores take the f16 subnormals as they are */
#else
    return e2m1_scale_up(h);
#endif
}
#endif
#if GPU_TC_SUBNORMAL
#define E2M1_UNDO 16384.0f
#else
#define E2M1_UNDO 1.0f
#endif

/* The four f16x2 A registers of one lane's u32 at once: each code's high
 * f16 byte hb = (s << 7) | (e1 e0 m << 1) (the low byte is 0), built for the
 * even codes (low nibbles) and the odd ones (high nibbles) four at a time,
 * then paired with zero bytes by byte permutes. Same values as e2m1_pair. */
#if GPU_TC_QUAD
__device__ __forceinline__ void e2m1_quad(uint32_t u, uint32_t (&h)[4]) {
    const uint32_t lo = ((u << 4) & 0x80808080u) | ((u << 1) & 0x0e0e0e0eu); /* codes 0 2 4 6 */
    const uint32_t hi = (u & 0x80808080u) | ((u >> 3) & 0x0e0e0e0eu);        /* codes 1 3 5 7 */
    h[0] = __byte_perm(lo, 0u, 0x2404); /* codes 0, 4 */
    h[1] = __byte_perm(hi, 0u, 0x2404); /* codes 1, 5 */
    h[2] = __byte_perm(lo, 0u, 0x3414); /* codes 2, 6 */
    h[3] = __byte_perm(hi, 0u, 0x3414); /* codes 3, 7 */
#if !GPU_TC_SUBNORMAL
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = e2m1_scale_up(h[j]);
#endif
}
#endif

__device__ __forceinline__ float e8m0(uint32_t s) {
    return __uint_as_float(s == 0 ? 0x00400000u : s == 255 ? 0x7fc00000u : s << 23);
}
/* byte k of four packed e8m0 scales */
__device__ __forceinline__ float e8m0_of(uint32_t s4, int k) {
    const uint32_t s = (s4 >> (8 * k)) & 0xffu;
    return e8m0(s);
}

enum { FRAG_CODES = 1024, FRAG_BYTES = FRAG_CODES + 64 };

__host__ __device__ inline int64_t frag_groups(int64_t cols) { return (cols / 32 + 3) / 4; }

__device__ __forceinline__ uint4 ld_stream16(const uint8_t *p) { return __ldcs((const uint4 *)p); }
__device__ __forceinline__ uint2 ld_stream8(const uint8_t *p) { return __ldcs((const uint2 *)p); }

/* lane's part of the group chunk at c: its two code uint4s and its row
 * pair's scale bytes (the layout above) */
__device__ __forceinline__ void frag_load(const uint8_t *c, int lane, uint4 &c0, uint4 &c1, uint2 &sc) {
    c0 = ld_stream16(c + 16 * lane);
    c1 = ld_stream16(c + 512 + 16 * lane);
    sc = ld_stream8(c + FRAG_CODES + 8 * (lane >> 2));
}

/* the group after m in the walk (class by class), or -1 */
__device__ __forceinline__ int64_t walk_next(int64_t m, int64_t ngrp, int KS) {
    if (m + KS < ngrp) return m + KS;
    const int64_t c = m % KS + 1;
    return c < KS && c < ngrp ? c : -1;
}

/* The staging of a walk (the x-staged and wgmma batches): stage(m, p) puts
 * group m into stage p by cp.async. walk_stage_first stages the walk's
 * first P - 1 groups, one cp.async group each, and returns the next group
 * to stage (-1: none left); walk_stage_next, at the walk's i-th group,
 * stages the one P - 1 ahead into the stage it frees, and commits. */
template <int P, class F> __device__ __forceinline__ int64_t walk_stage_first(F &&stage, int64_t ngrp, int KS) {
    int64_t ms = 0;
#pragma unroll
    for (int p = 0; p < P - 1; p++) {
        if (ms >= 0) stage(ms, p), ms = walk_next(ms, ngrp, KS);
        cp_commit();
    }
    return ms;
}
template <int P, class F>
__device__ __forceinline__ void walk_stage_next(F &&stage, int64_t &ms, int64_t i, int64_t ngrp, int KS) {
    if (ms >= 0) stage(ms, (int)(((uint32_t)i + P - 1) % P)), ms = walk_next(ms, ngrp, KS); /* 32-bit: i < 2^31 groups */
    cp_commit();
}

} // namespace

#endif
