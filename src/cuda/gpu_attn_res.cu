/* gpu_attn_res.cu — K3's attention residuals on the device behind gpu.h's
 * attention section: the softmax mix over a layer's anchors (gpu_attn_res)
 * and the residual step between two parts of a layer in one launch
 * (gpu_res_norm: add, anchor, mix, RMSNorm on a row held in registers,
 * gpu_internal.h).
 *
 * Owns: those kernels and their launch checks. Refuses: ownership of the
 * anchors (the caller's buffers), host math (the oracle is op_attn_res, see
 * tests/cuda/test_cuda_attn.c).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_attn_internal.h"
#include "gpu_internal.h"

/* ---- attention residuals ---------------------------------------------------- */

enum { RES_THREADS = 256, RES_MAX_A = 64, RES_W = ROW_T / 32 };

/* One block per token: the na + 1 scores (squares summed in double, the
 * dot's per-thread float sums added in double, each over the block in a
 * fixed order), the softmax as op_softmax (thread 0), then out = sum_j p_j
 * V_j spelled as op_attn_res (from 0, j ascending, product then sum,
 * rounded each). A row's result depends on H only, never on n. */
__device__ __forceinline__ void res_softmax(float *score, int na) { /* thread 0: op_softmax */
    float m = score[0];
    for (int j = 1; j <= na; j++)
        if (score[j] > m) m = score[j];
    double s = 0.0;
    for (int j = 0; j <= na; j++) {
        score[j] = expf(score[j] - m);
        s += score[j];
    }
    const float inv = (float)(1.0 / s);
    for (int j = 0; j <= na; j++) score[j] = __fmul_rn(score[j], inv);
}

__device__ __forceinline__ float res_score(double ss, double dd, int H, float eps) {
    return __fmul_rn((float)dd, norm_scale(ss, H, eps));
}

/* Shared memory of res_mix. */
struct res_smem {
    double part[2][RES_MAX_A + 1][RES_W];
    float score[RES_MAX_A + 1];
};

/* x = the attention residual of the row c (registers, gpu_internal.h) over
 * the na anchor rows at at (float4 rows of q) with the probe w: each
 * vector's loads all in flight at once, its sums reduced per warp with no
 * barrier (the warp sums meet once, after the last vector). x may be c. */
__device__ __forceinline__ void res_mix(const float4 *at, int na, const float4 (&c)[ROW_V4], const float *w, int H,
                                        float eps, res_smem *sm, float4 (&x)[ROW_V4]) {
    const int q = H >> 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float4 wv[ROW_V4];
    row_load(w, q, wv);
    for (int j = 0; j <= na; j++) {
        float4 v[ROW_V4];
        if (j == na) {
#pragma unroll
            for (int k = 0; k < ROW_V4; k++) v[k] = c[k];
        } else {
            row_load((const float *)(at + (size_t)j * q), q, v);
        }
        float dp = 0.0f;
#pragma unroll
        for (int k = 0; k < ROW_V4; k++) {
            dp = __fmaf_rn(v[k].x, wv[k].x, dp);
            dp = __fmaf_rn(v[k].y, wv[k].y, dp);
            dp = __fmaf_rn(v[k].z, wv[k].z, dp);
            dp = __fmaf_rn(v[k].w, wv[k].w, dp);
        }
        const double ss = warp_sum_d(row_sumsq(v)), dd = warp_sum_d((double)dp);
        if (lane == 0) {
            sm->part[0][j][warp] = ss;
            sm->part[1][j][warp] = dd;
        }
    }
    __syncthreads();
    if ((int)threadIdx.x <= na) {
        const int j = threadIdx.x;
        double ss = 0.0, dd = 0.0;
        for (int k = 0; k < RES_W; k++) {
            ss += sm->part[0][j][k];
            dd += sm->part[1][j][k];
        }
        sm->score[j] = res_score(ss, dd, H, eps);
    }
    __syncthreads();
    if (threadIdx.x == 0) res_softmax(sm->score, na);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < ROW_V4; k++) {
        const int i = threadIdx.x + k * ROW_T;
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < q)
            for (int j = 0; j < na; j++) {
                const float p = sm->score[j];
                const float4 a = at[(size_t)j * q + i];
                o = make_float4(__fadd_rn(o.x, __fmul_rn(p, a.x)), __fadd_rn(o.y, __fmul_rn(p, a.y)),
                                __fadd_rn(o.z, __fmul_rn(p, a.z)), __fadd_rn(o.w, __fmul_rn(p, a.w)));
            }
        const float p = sm->score[na];
        x[k] = make_float4(__fadd_rn(o.x, __fmul_rn(p, c[k].x)), __fadd_rn(o.y, __fmul_rn(p, c[k].y)),
                           __fadd_rn(o.z, __fmul_rn(p, c[k].z)), __fadd_rn(o.w, __fmul_rn(p, c[k].w)));
    }
}

/* Aligned rows of at most 4 ROW_T ROW_V4 floats, H % 4 == 0 (out may alias cur). */
__global__ void __launch_bounds__(ROW_T)
k_attn_res4(const float *anchors, int64_t astride, int na, const float *cur, const float *__restrict__ w, int H,
            float eps, float *out) {
    __shared__ res_smem sm;
    const int t = blockIdx.x;
    float4 c[ROW_V4];
    row_load(cur + (size_t)t * H, H >> 2, c);
    res_mix((const float4 *)(anchors + (size_t)t * astride), na, c, w, H, eps, &sm, c);
    row_store(out + (size_t)t * H, H >> 2, c);
}

/* gpu_res_norm: one block per row, the steps of gpu_add / gpu_copy,
 * gpu_copy, gpu_attn_res and gpu_rmsnorm on the row in registers, so the
 * same bits as those calls in turn. */
__global__ void __launch_bounds__(ROW_T)
k_res_norm4(float *xn, float *h, const float *d, int restart, float *anc_out, const float *anchors, int64_t astride,
            int na, const float *__restrict__ probe, const float *__restrict__ nw, int H, float eps) {
    __shared__ res_smem sm;
    __shared__ double buf[33];
    const int t = blockIdx.x, q = H >> 2;
    float *ht = h + (size_t)t * H;
    float4 c[ROW_V4];
    if (d && restart) {
        row_load(d + (size_t)t * H, q, c);
    } else {
        row_load(ht, q, c);
        if (d) {
            float4 e[ROW_V4];
            row_load(d + (size_t)t * H, q, e);
#pragma unroll
            for (int k = 0; k < ROW_V4; k++)
                c[k] = make_float4(__fadd_rn(c[k].x, e[k].x), __fadd_rn(c[k].y, e[k].y), __fadd_rn(c[k].z, e[k].z),
                                   __fadd_rn(c[k].w, e[k].w));
        }
    }
    if (d) row_store(ht, q, c);
    if (anc_out) row_store(anc_out + (size_t)t * astride, q, c);
    if (na > 0) res_mix((const float4 *)(anchors + (size_t)t * astride), na, c, probe, H, eps, &sm, c);
    row_rmsnorm(c, H, nw, eps, xn + (size_t)t * H, buf);
}

extern "C" df_status gpu_res_norm(float *xn, float *h, const float *d, int restart, float *anc_out,
                                  const float *anchors, int64_t astride, int na, const float *probe, const float *nw,
                                  int H, float eps, int n, void *stream) {
    if (!xn || !h || H < 1 || n < 1 || na < 0 || (na > 0 && (!anchors || !probe)) ||
        ((na > 0 || anc_out) && astride < (int64_t)(na + (anc_out != NULL)) * H))
        return DF_ERR_ARG;
    if (na > RES_MAX_A || astride % 4 ||
        !row_fits(H, (uintptr_t)xn | (uintptr_t)h | (uintptr_t)d | (uintptr_t)anc_out | (uintptr_t)anchors |
                         (uintptr_t)probe | (uintptr_t)nw))
        return DF_ERR_UNSUPPORTED;
    k_res_norm4<<<n, ROW_T, 0, (cudaStream_t)stream>>>(xn, h, d, restart, anc_out, anchors, astride, na, probe, nw,
                                                       H, eps);
    return launched("k_res_norm4");
}

/* Any other shape: strided, the same sums per thread, reduced by block_sum2. */
__global__ void __launch_bounds__(RES_THREADS)
k_attn_res(const float *anchors, int64_t astride, int na, const float *cur, const float *__restrict__ w, int H,
           float eps, float *out) {
    __shared__ double rbuf[66];
    __shared__ float score[RES_MAX_A + 1];
    const int t = blockIdx.x;
    const float *at = anchors + (size_t)t * astride, *ct = cur + (size_t)t * H;
    for (int j = 0; j <= na; j++) {
        const float *v = j < na ? at + (size_t)j * H : ct;
        double ss = 0.0;
        float dp = 0.0f;
        for (int d = threadIdx.x; d < H; d += RES_THREADS) {
            ss += (double)v[d] * v[d];
            dp = __fmaf_rn(v[d], w[d], dp);
        }
        double dd = dp;
        block_sum2(ss, dd, rbuf);
        if (threadIdx.x == 0) score[j] = res_score(ss, dd, H, eps);
    }
    __syncthreads();
    if (threadIdx.x == 0) res_softmax(score, na);
    __syncthreads();
    float *ot = out + (size_t)t * H;
    for (int d = threadIdx.x; d < H; d += RES_THREADS) {
        float o = 0.0f;
        for (int j = 0; j <= na; j++) o = __fadd_rn(o, __fmul_rn(score[j], j < na ? at[(size_t)j * H + d] : ct[d]));
        ot[d] = o;
    }
}

extern "C" df_status gpu_attn_res(const float *anchors, int64_t astride, int na, const float *cur, const float *w,
                                  int H, float eps, int n, float *out, void *stream) {
    if (na > RES_MAX_A) return DF_ERR_UNSUPPORTED;
    if (!cur || !w || !out || H < 1 || n < 1 || na < 0 || (na > 0 && (!anchors || astride < (int64_t)na * H)))
        return DF_ERR_ARG;
    if (astride % 4 == 0 && row_fits(H, (uintptr_t)anchors | (uintptr_t)cur | (uintptr_t)w | (uintptr_t)out)) k_attn_res4<<<n, ROW_T, 0, (cudaStream_t)stream>>>(anchors, astride, na, cur, w, H, eps, out);
    else k_attn_res<<<n, RES_THREADS, 0, (cudaStream_t)stream>>>(anchors, astride, na, cur, w, H, eps, out);
    return launched("k_attn_res");
}
