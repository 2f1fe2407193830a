/* gpu_attn.cu — the attention step's CUDA kernels behind gpu.h's last
 * section (prefix gpu_): KDA (conv + delta-rule recurrence), the MLA cache
 * row write and latent attention, K3's attention-residual mix, and the
 * residual step between two parts of a layer in one launch (gpu_res_norm:
 * add, anchor, mix, RMSNorm on a row held in registers, gpu_internal.h).
 *
 * Owns: those kernels, their launch checks and the MLA split workspace.
 * Refuses: projections (gpu_matmul), placement and state ownership (the
 * caller holds the state / cache buffers, laid out as on the CPU), host
 * math (the oracles are kda_core.c, mla_core.c and op_attn_res, see
 * tests/cuda/test_cuda_attn.c).
 *
 * KDA, one block per head (k_kda). Thread (g, e) owns column e of the
 * head's S and the rows d of its group g (16 rows each, in registers, when
 * D <= 128; otherwise D * G <= 1024 threads work on S in place in memory):
 *
 *      S [D][D]      e ->
 *   d  | g = 0: rows  0..15 |  column e: thread (g, e)
 *   |  | g = 1: rows 16..31 |  u_e = v_e - sum_g part_g(e)   (no cross-
 *   v  | ...                |  o_e = sum_g part'_g(e)         lane sums)
 *
 * Per token: conv + SiLU of the head's 3D channels (windows in shared
 * memory), l2 norms (double, block sums), decay and beta, pass 1 (S *=
 * decay, partial S^T k), pass 2 (S += beta k u^T, partial S^T q), gated
 * RMSNorm. Every token runs the same code whatever n is, so n tokens in one
 * launch equal n launches of one token, bit for bit. A prompt (n >= 16, a
 * workspace) takes the scan path instead: the per-token steps that do not
 * read S (conv, norms, decays, the output norm) for every token at once,
 * and only the two passes over S token by token (k_kda_prep / k_kda_scan /
 * k_kda_norm, section 2; the same bits as k_kda: H200, 512 tokens of K3's
 * 96 heads, 3.4 ms -> 1.25 ms a layer).
 *
 * MLA attention (k_mla_attend), a block per (tile of 8 or 16 queries,
 * split of positions); a query is one (head, token) (index h * n + t,
 * olat's order), all of them share the cache rows, so a tile reads each row
 * once:
 *
 *   shared: Q [QB][R + dr] | K [32 rows][R + dr, padded] | p [QB][32] | alpha
 *   scores: warp w = queries QPW w .. QPW w + QPW - 1, lane = row of the
 *           tile (one dot a query; QPW = 2 in prompts: each K load serves two)
 *   online softmax per query (running max m, sum l), then
 *   acc[q][c] = acc[q][c] * alpha_q + sum_k p[q][k] K[k][c], thread owns c
 *   (2 columns a thread up to R = 512, else 4)
 *
 * With one split the block writes o = acc / l; otherwise it leaves (m, l,
 * acc) in the workspace and k_mla_combine merges the splits. Splits of 256
 * positions from position 0 (longer past 1024 of them), so a query's sums
 * depend on its position alone, not on the launch around it.
 *
 * Speed: KDA decode runs H blocks, two passes over S per token; MLA is
 * fp32 FMAs fed from shared memory (a 16-byte cache-row load per 4 FMAs of
 * each of the warp's queries in the scores), not tensor cores, so at long
 * contexts it is bound by shared memory well above the cache-read time (an
 * mma version, as FlashMLA, would change the sums' order). Measured on the
 * H200: bench/cuda_NOTES.md.
 *
 * Sections: 1. helpers  2. KDA  3. MLA cache rows  4. MLA attention
 *           5. attention residuals  6. MLA absorbed products
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_internal.h"

/* ---- 1. helpers ------------------------------------------------------------- */

static df_status launched(const char *what) { return gpu_cuda_status(cudaGetLastError(), what); }

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Dynamic shared memory above the default 48 KB must be asked for. */
template <typename K> static df_status smem_opt_in(K kernel, size_t bytes, const char *what) {
    if (bytes <= 48 * 1024) return DF_OK;
    return gpu_cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                           what);
}

/* Grows ws to at least need bytes (its contents are not kept). */
static df_status ws_reserve(gpu_ws *ws, size_t need, const char *what) {
    if (ws->cap >= need) return DF_OK;
    gpu_ws_free(ws);
    df_status st = gpu_cuda_status(cudaMalloc(&ws->buf, need), what);
    if (st) {
        ws->buf = NULL;
        return st;
    }
    ws->cap = need;
    return DF_OK;
}

static __device__ __forceinline__ float sigmoid1(float x) { return 1.0f / (1.0f + expf(-x)); }
static __device__ __forceinline__ float silu1(float x) { return x / (1.0f + expf(-x)); }

/* ---- 2. KDA ----------------------------------------------------------------- */

/* KDA_SCAN_MIN: tokens from which gpu_kda with a workspace takes the scan
 * path (below, one launch of k_kda costs less than three; at least 15, the
 * longest conv window, which the scan path's state update assumes) */
#ifndef GPU_KDA_SCAN_MIN
#define GPU_KDA_SCAN_MIN 16
#endif
enum { KDA_RP = 16, KDA_MAX_T = 1024, KDA_SCAN_MIN = GPU_KDA_SCAN_MIN < 15 ? 15 : GPU_KDA_SCAN_MIN };

struct kda_args {
    int H, D, W, P, G, rows;   /* G groups of `rows` rows of S per column */
    int lb;                    /* lower-bound gate (K3), else softplus (Kimi-Linear) */
    float lower_bound, norm_eps, qscale;
    const float *conv[3], *a, *dt_bias, *o_norm;
    float *state;
    const float *q, *k, *v, *f, *braw, *gate;
    float *o;
    int n;
    /* the scan path (gpu_kda with a workspace): per token and channel the
     * conv outputs q^, k^ (normalised), v and the decay, [n][P] each, and
     * beta [n][H]; Dc columns of S per block */
    float *xq, *xk, *xv, *xd, *xb;
    int Dc;
};

/* The per-channel steps every KDA kernel spells the same way (k_kda and
 * the scan path must give the same bits): channel j's decay of head h for
 * the token at off, and the gated RMSNorm of an output value ov given the
 * head's sum of squares so. */
static __device__ __forceinline__ float kda_decay(const kda_args &a, int h, int j, size_t off) {
    const float av = a.a[h * a.D + j], z = __fadd_rn(a.f[off + j], a.dt_bias[h * a.D + j]);
    float gv;
    if (a.lb) gv = a.lower_bound * sigmoid1(av * z);
    else gv = -av * (z > 20.0f ? z : log1pf(expf(z)));
    return expf(gv);
}
static __device__ __forceinline__ float kda_gated_out(const kda_args &a, float ov, double so, size_t at, int j) {
    const float inv = (float)(1.0 / sqrt(so / a.D + (double)a.norm_eps));
    const float y = __fmul_rn(a.o_norm[j], __fmul_rn(ov, inv));
    return __fmul_rn(y, sigmoid1(a.gate[at]));
}

/* RP > 0: each thread keeps its RP rows of S in registers (rows == RP);
 * RP == 0: it reads and writes them in the state (rows at run time). Only
 * thread (g, e) ever touches S[d][e] for d in group g, so there are no
 * races either way. */
template <int RP>
__global__ void __launch_bounds__(KDA_MAX_T) k_kda(const __grid_constant__ kda_args a) {
    extern __shared__ float ksm[];
    __shared__ double rbuf[66];
    __shared__ float beta_s;
    const int h = blockIdx.x, D = a.D, W = a.W, P = a.P, G = a.G, NT = blockDim.x;
    const int tid = threadIdx.x, e = tid % D, g = tid / D;
    const bool owner = g < G;
    const int d0 = g * a.rows, d1 = min(D, d0 + a.rows);
    /* shared: q, k, v, decay [D] each | red, red2 [G][D] | conv windows [3][D][W-1] */
    float *qs = ksm, *ks = qs + D, *vs = ks + D, *dec = vs + D, *red = dec + D, *red2 = red + G * D;
    float *win = red2 + G * D;
    const int w1 = W - 1;
    float *Sg = a.state + (size_t)3 * P * w1 + (size_t)h * D * D;
    /* the head's conv windows: [which][h*D .. h*D+D)[W-1] is contiguous per which */
    for (int i = tid; i < 3 * D * w1; i += NT) {
        const int which = i / (D * w1), rem = i % (D * w1);
        win[i] = a.state[((size_t)which * P + (size_t)h * D) * w1 + rem];
    }
    float sreg[RP > 0 ? RP : 1];
    if (RP > 0 && owner) {
#pragma unroll
        for (int r = 0; r < (RP > 0 ? RP : 1); r++) sreg[r] = Sg[(size_t)(d0 + r) * D + e];
    }
    __syncthreads();
    for (int t = 0; t < a.n; t++) {
        const size_t off = (size_t)t * P + (size_t)h * D;
        /* conv + SiLU, spelled as kda_conv_channel: sum of w[j] * src[j], left to right */
        for (int i = tid; i < 3 * D; i += NT) {
            const int which = i / D, j = i % D;
            const float *x = which == 0 ? a.q : which == 1 ? a.k : a.v;
            const float *w = a.conv[which] + ((size_t)h * D + j) * W;
            float *wn = win + (size_t)(which * D + j) * w1;
            const float xin = x[off + j];
            float acc = 0.0f;
            for (int q = 0; q < w1; q++) acc = __fadd_rn(acc, __fmul_rn(w[q], wn[q]));
            acc = __fadd_rn(acc, __fmul_rn(w[w1], xin));
            for (int q = 0; q + 1 < w1; q++) wn[q] = wn[q + 1];
            if (w1 > 0) wn[w1 - 1] = xin;
            (which == 0 ? qs : which == 1 ? ks : vs)[j] = silu1(acc);
        }
        if (tid == 0) beta_s = sigmoid1(a.braw[(size_t)t * a.H + h]);
        __syncthreads();
        /* l2 norms of q and k (double), q *= D^-1/2, decay = exp(g) */
        double sq = 0.0, sk = 0.0;
        for (int j = tid; j < D; j += NT) {
            sq += (double)qs[j] * qs[j];
            sk += (double)ks[j] * ks[j];
        }
        block_sum2(sq, sk, rbuf);
        const float iq = (float)(1.0 / sqrt(sq + 1e-6)), ik = (float)(1.0 / sqrt(sk + 1e-6));
        for (int j = tid; j < D; j += NT) {
            qs[j] = __fmul_rn(__fmul_rn(qs[j], iq), a.qscale);
            ks[j] = __fmul_rn(ks[j], ik);
            dec[j] = kda_decay(a, h, j, off);
        }
        __syncthreads();
        /* pass 1: S = diag(decay) S, partial (S^T k)_e over this group's rows */
        if (owner) {
            float part = 0.0f;
            if (RP > 0) {
#pragma unroll
                for (int r = 0; r < (RP > 0 ? RP : 1); r++) {
                    sreg[r] = __fmul_rn(sreg[r], dec[d0 + r]);
                    part = __fmaf_rn(ks[d0 + r], sreg[r], part);
                }
            } else {
                for (int d = d0; d < d1; d++) {
                    const float s = __fmul_rn(Sg[(size_t)d * D + e], dec[d]);
                    Sg[(size_t)d * D + e] = s;
                    part = __fmaf_rn(ks[d], s, part);
                }
            }
            red[g * D + e] = part;
        }
        __syncthreads();
        /* pass 2: u = v - S^T k; S += (beta k) u^T; partial (S^T q)_e */
        if (owner) {
            float u = vs[e];
            for (int gg = 0; gg < G; gg++) u = __fsub_rn(u, red[gg * D + e]);
            const float beta = beta_s;
            float part = 0.0f;
            if (RP > 0) {
#pragma unroll
                for (int r = 0; r < (RP > 0 ? RP : 1); r++) {
                    sreg[r] = __fmaf_rn(__fmul_rn(beta, ks[d0 + r]), u, sreg[r]);
                    part = __fmaf_rn(qs[d0 + r], sreg[r], part);
                }
            } else {
                for (int d = d0; d < d1; d++) {
                    const float s = __fmaf_rn(__fmul_rn(beta, ks[d]), u, Sg[(size_t)d * D + e]);
                    Sg[(size_t)d * D + e] = s;
                    part = __fmaf_rn(qs[d], s, part);
                }
            }
            red2[g * D + e] = part;
        }
        __syncthreads();
        /* o = S^T q, gated RMSNorm (sum of squares in double, as op_rmsnorm) */
        float ov = 0.0f;
        double so = 0.0, unused = 0.0;
        if (tid < D) {
            for (int gg = 0; gg < G; gg++) ov = __fadd_rn(ov, red2[gg * D + tid]);
            so = (double)ov * ov;
        }
        block_sum2(so, unused, rbuf);
        if (tid < D) a.o[off + tid] = kda_gated_out(a, ov, so, off + tid, tid);
        /* the next token's writes (qs, ks, vs, dec, red, red2, beta_s) all
         * come after block_sum2's barriers, past every read of this token */
    }
    if (RP > 0 && owner) {
#pragma unroll
        for (int r = 0; r < (RP > 0 ? RP : 1); r++) Sg[(size_t)(d0 + r) * D + e] = sreg[r];
    }
    /* each window was read and written by one thread only: no barrier needed */
    for (int i = tid; i < 3 * D * w1; i += NT) {
        const int which = i / (D * w1), rem = i % (D * w1);
        a.state[((size_t)which * P + (size_t)h * D) * w1 + rem] = win[i];
    }
}

/* ---- KDA, the scan path (prompts: gpu_kda with a workspace) ----
 * The same arithmetic as k_kda in three launches, so only the delta-rule
 * recurrence runs token after token:
 *  k_kda_prep (block per token and head, all in parallel): conv + SiLU of
 *    the 3D channels (each window rebuilt from the inputs before it and the
 *    conv state), q and k l2-normalised (the same block sums: one channel
 *    a thread), q scaled, the decays and beta, to the workspace;
 *  k_kda_scan (block per head and slice of Dc columns of S; a column's
 *    steps depend on no other column): per token pass 1 and pass 2 as in
 *    k_kda, o_e = sum_g part'_g(e) raw into o; the conv state moved on;
 *  k_kda_norm (block per token and head): the gated RMSNorm of o in place.
 * Every value is computed by k_kda's expressions in k_kda's order (the
 * block sums over one channel a thread, zeros past D, give k_kda's sums),
 * so the scan path's state and o are k_kda's, bit for bit (tests). */
__global__ void __launch_bounds__(256) k_kda_prep(const __grid_constant__ kda_args a) {
    __shared__ double rbuf[66];
    __shared__ float qk[2][256];
    const int t = blockIdx.x, h = blockIdx.y, D = a.D, W = a.W, P = a.P, tid = threadIdx.x, NT = blockDim.x;
    const int w1 = W - 1;
    const size_t off = (size_t)t * P + (size_t)h * D;
    for (int i = tid; i < 3 * D; i += NT) {
        const int which = i / D, j = i % D;
        const float *x = which == 0 ? a.q : which == 1 ? a.k : a.v;
        const float *w = a.conv[which] + ((size_t)h * D + j) * W;
        const float *old = a.state + ((size_t)which * P + (size_t)h * D + j) * w1;
        float acc = 0.0f;
        for (int q = 0; q < w1; q++) { /* the window before token t: position t - w1 + q */
            const int pos = t - w1 + q;
            const float wv = pos >= 0 ? x[(size_t)pos * P + (size_t)h * D + j] : old[q + t];
            acc = __fadd_rn(acc, __fmul_rn(w[q], wv));
        }
        acc = __fadd_rn(acc, __fmul_rn(w[w1], x[off + j]));
        const float y = silu1(acc);
        if (which < 2) qk[which][j] = y;
        else a.xv[off + j] = y;
    }
    if (tid == 0) a.xb[(size_t)t * a.H + h] = sigmoid1(a.braw[(size_t)t * a.H + h]);
    __syncthreads();
    double sq = 0.0, sk = 0.0;
    for (int j = tid; j < D; j += NT) {
        sq += (double)qk[0][j] * qk[0][j];
        sk += (double)qk[1][j] * qk[1][j];
    }
    block_sum2(sq, sk, rbuf);
    const float iq = (float)(1.0 / sqrt(sq + 1e-6)), ik = (float)(1.0 / sqrt(sk + 1e-6));
    for (int j = tid; j < D; j += NT) {
        a.xq[off + j] = __fmul_rn(__fmul_rn(qk[0][j], iq), a.qscale);
        a.xk[off + j] = __fmul_rn(qk[1][j], ik);
        a.xd[off + j] = kda_decay(a, h, j, off);
    }
}

/* Threads: G x Dc owners (thread (g, el) owns column c0 + el, rows of group
 * g, as k_kda's (g, e)), at least 3D in all (each loads one of the token's
 * q^, k^, decay values a token ahead). */
__global__ void __launch_bounds__(KDA_MAX_T) k_kda_scan(const __grid_constant__ kda_args a) {
    __shared__ float qs[128], ks[128], dec[128], red[KDA_MAX_T], red2[KDA_MAX_T];
    const int nsl = a.D / a.Dc, h = blockIdx.x / nsl, c0 = (blockIdx.x % nsl) * a.Dc;
    const int D = a.D, Dc = a.Dc, G = a.G, P = a.P, tid = threadIdx.x, NT = blockDim.x;
    const int el = tid % Dc, g = tid / Dc, e = c0 + el, d0 = g * KDA_RP;
    const bool owner = g < G;
    const int w1 = a.W - 1;
    float *Sg = a.state + (size_t)3 * P * w1 + (size_t)h * D * D;
    if (c0 == 0) /* the conv state: the last w1 inputs (n >= w1; k_kda_prep has read the old one) */
        for (int i = tid; i < 3 * D * w1; i += NT) {
            const int which = i / (D * w1), rem = i % (D * w1), j = rem / w1, q = rem % w1;
            const float *x = which == 0 ? a.q : which == 1 ? a.k : a.v;
            a.state[((size_t)which * P + (size_t)h * D + j) * w1 + q] =
                x[(size_t)(a.n - w1 + q) * P + (size_t)h * D + j];
        }
    float sreg[KDA_RP];
#pragma unroll
    for (int r = 0; r < KDA_RP; r++) sreg[r] = owner ? Sg[(size_t)(d0 + r) * D + e] : 0.0f;
    const int lw = tid < 3 * D ? tid / D : 3, lj = tid % D;
    const float *lsrc = lw == 0 ? a.xq : lw == 1 ? a.xk : a.xd;
    float nxt = lw < 3 ? lsrc[(size_t)h * D + lj] : 0.0f;
    float nv = owner ? a.xv[(size_t)h * D + e] : 0.0f, nb = a.xb[h];
    for (int t = 0; t < a.n; t++) {
        const size_t off = (size_t)t * P + (size_t)h * D;
        if (lw < 3) (lw == 0 ? qs : lw == 1 ? ks : dec)[lj] = nxt;
        const float vt = nv, beta = nb;
        if (t + 1 < a.n) {
            if (lw < 3) nxt = lsrc[off + P + lj];
            if (owner) nv = a.xv[off + P + e];
            nb = a.xb[(size_t)(t + 1) * a.H + h];
        }
        __syncthreads(); /* this token's q^, k^, decay in; the last token's red2 read */
        if (owner) { /* pass 1: S = diag(decay) S, partial (S^T k)_e */
            float part = 0.0f;
#pragma unroll
            for (int r = 0; r < KDA_RP; r++) {
                sreg[r] = __fmul_rn(sreg[r], dec[d0 + r]);
                part = __fmaf_rn(ks[d0 + r], sreg[r], part);
            }
            red[g * Dc + el] = part;
        }
        __syncthreads();
        if (owner) { /* pass 2: u = v - S^T k; S += (beta k) u^T; partial (S^T q)_e */
            float u = vt;
            for (int gg = 0; gg < G; gg++) u = __fsub_rn(u, red[gg * Dc + el]);
            float part = 0.0f;
#pragma unroll
            for (int r = 0; r < KDA_RP; r++) {
                sreg[r] = __fmaf_rn(__fmul_rn(beta, ks[d0 + r]), u, sreg[r]);
                part = __fmaf_rn(qs[d0 + r], sreg[r], part);
            }
            red2[g * Dc + el] = part;
        }
        __syncthreads(); /* red2 in; every read of qs, ks, dec, red done */
        if (tid < Dc) {
            float ov = 0.0f;
            for (int gg = 0; gg < G; gg++) ov = __fadd_rn(ov, red2[gg * Dc + tid]);
            a.o[off + c0 + tid] = ov;
        }
    }
    if (owner)
#pragma unroll
        for (int r = 0; r < KDA_RP; r++) Sg[(size_t)(d0 + r) * D + e] = sreg[r];
}

__global__ void __launch_bounds__(256) k_kda_norm(const __grid_constant__ kda_args a) {
    __shared__ double rbuf[66];
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const size_t off = (size_t)t * a.P + (size_t)h * a.D;
    float ov = 0.0f;
    double so = 0.0, unused = 0.0;
    if (tid < a.D) {
        ov = a.o[off + tid];
        so = (double)ov * ov;
    }
    block_sum2(so, unused, rbuf);
    if (tid < a.D) a.o[off + tid] = kda_gated_out(a, ov, so, off + tid, tid);
}

extern "C" int gpu_kda_takes(const kda_shape *sh) {
    return sh && sh->D >= 16 && sh->D <= 256 && sh->D % 16 == 0 && sh->W >= 1 && sh->W <= 16;
}

extern "C" df_status gpu_kda(const kda_shape *sh, const kda_params *p, float *state, int n, const float *q,
                             const float *k, const float *v, const float *f, const float *braw,
                             const float *gate, float *o, gpu_ws *ws, void *stream) {
    if (!sh || !p || !state || !q || !k || !v || !f || !braw || !gate || !o || n < 1 || sh->H < 1 ||
        !p->conv[0] || !p->conv[1] || !p->conv[2] || !p->a || !p->dt_bias || !p->o_norm)
        return DF_ERR_ARG;
    const int D = sh->D, W = sh->W;
    if (!gpu_kda_takes(sh)) return DF_ERR_UNSUPPORTED;
    kda_args a;
    a.H = sh->H;
    a.D = D;
    a.W = W;
    a.P = sh->H * D;
    if (D <= 128) {
        a.rows = KDA_RP;
        a.G = D / KDA_RP;
    } else {
        a.G = KDA_MAX_T / D;
        a.rows = (int)cdiv(D, a.G);
        a.G = (int)cdiv(D, a.rows);
    }
    a.lb = sh->has_lower_bound;
    a.lower_bound = sh->lower_bound;
    a.norm_eps = sh->norm_eps;
    a.qscale = 1.0f / sqrtf((float)D); /* kda_recur_head's qscale, same expression */
    for (int i = 0; i < 3; i++) a.conv[i] = p->conv[i];
    a.a = p->a;
    a.dt_bias = p->dt_bias;
    a.o_norm = p->o_norm;
    a.state = state;
    a.q = q;
    a.k = k;
    a.v = v;
    a.f = f;
    a.braw = braw;
    a.gate = gate;
    a.o = o;
    a.n = n;
    const int threads = (int)cdiv((int64_t)D * a.G, 32) * 32;
    const size_t smem = ((size_t)4 * D + (size_t)2 * a.G * D + (size_t)3 * D * (W - 1)) * sizeof(float);
    cudaStream_t s = (cudaStream_t)stream;
    df_status st;
    a.xq = a.xk = a.xv = a.xd = a.xb = NULL;
    a.Dc = D;
    if (ws && n >= KDA_SCAN_MIN && D <= 128) { /* the scan path (n >= W - 1: W <= 16) */
        const size_t nP = (size_t)n * a.P;
        if ((st = ws_reserve(ws, (4 * nP + (size_t)n * a.H) * sizeof(float), "gpu_kda workspace"))) return st;
        a.xq = (float *)ws->buf;
        a.xk = a.xq + nP;
        a.xv = a.xk + nP;
        a.xd = a.xv + nP;
        a.xb = a.xd + nP;
        /* two column slices a head while heads alone leave SMs idle */
        const int nsl = a.H < 132 && D >= 64 ? 2 : 1;
        a.Dc = D / nsl;
        const int pt = (int)cdiv(D, 32) * 32;
        const int owners = a.G * a.Dc, st_threads = (int)cdiv(owners > 3 * D ? owners : 3 * D, 32) * 32;
        k_kda_prep<<<dim3((unsigned)n, (unsigned)a.H), pt, 0, s>>>(a);
        if ((st = launched("k_kda_prep"))) return st;
        k_kda_scan<<<(unsigned)(a.H * nsl), st_threads, 0, s>>>(a);
        if ((st = launched("k_kda_scan"))) return st;
        k_kda_norm<<<dim3((unsigned)n, (unsigned)a.H), pt, 0, s>>>(a);
        return launched("k_kda_norm");
    }
    if (D <= 128) {
        if ((st = smem_opt_in(k_kda<KDA_RP>, smem, "k_kda smem"))) return st;
        k_kda<KDA_RP><<<sh->H, threads, smem, s>>>(a);
    } else {
        if ((st = smem_opt_in(k_kda<0>, smem, "k_kda smem"))) return st;
        k_kda<0><<<sh->H, threads, smem, s>>>(a);
    }
    return launched("k_kda");
}

/* ---- 3. MLA cache rows ------------------------------------------------------ */

enum { MLA_W_THREADS = 256 };

/* One block per token: RMSNorm of c_kv into the cache row (as op_rmsnorm),
 * k_pe copied or rotated, and each head's q_pe rotated (as op_rope). */
__global__ void __launch_bounds__(MLA_W_THREADS)
k_mla_write(const float *__restrict__ kva, const float *__restrict__ wnorm, const float *__restrict__ inv_freq,
            float *cache, float *q, int R, int dr, int nh, int dq, int dn, float eps, int use_rope,
            int interleave, float mscale, int pos) {
    __shared__ double rbuf[66];
    __shared__ float cs[256], sn[256];
    const int t = blockIdx.x, stride = R + dr, half = dr / 2;
    const float *kv = kva + (size_t)t * stride;
    float *row = cache + (size_t)(pos + t) * stride;
    double ss = 0.0, unused = 0.0;
    for (int i = threadIdx.x; i < R; i += MLA_W_THREADS) ss += (double)kv[i] * (double)kv[i];
    block_sum2(ss, unused, rbuf);
    const float inv = (float)(1.0 / sqrt(ss / R + (double)eps));
    for (int i = threadIdx.x; i < R; i += MLA_W_THREADS) row[i] = __fmul_rn(wnorm[i], __fmul_rn(kv[i], inv));
    if (!use_rope) {
        for (int i = threadIdx.x; i < dr; i += MLA_W_THREADS) row[R + i] = kv[R + i];
        return;
    }
    for (int i = threadIdx.x; i < half; i += MLA_W_THREADS) {
        const float fr = __fmul_rn((float)(pos + t), inv_freq[i]);
        cs[i] = __fmul_rn(cosf(fr), mscale);
        sn[i] = __fmul_rn(sinf(fr), mscale);
    }
    __syncthreads();
    /* pair i of vector v: v = 0 the row's k_pe (read from kva), v = 1 + h head h's q_pe (in place) */
    for (int j = threadIdx.x; j < (nh + 1) * half; j += MLA_W_THREADS) {
        const int vi = j / half, i = j % half;
        const int ia = interleave ? 2 * i : i, ib = interleave ? 2 * i + 1 : i + half;
        const float *src = vi == 0 ? kv + R : q + ((size_t)t * nh + (vi - 1)) * dq + dn;
        float *dst = vi == 0 ? row + R : q + ((size_t)t * nh + (vi - 1)) * dq + dn;
        const float x0 = src[ia], x1 = src[ib];
        dst[ia] = __fsub_rn(__fmul_rn(x0, cs[i]), __fmul_rn(x1, sn[i]));
        dst[ib] = __fadd_rn(__fmul_rn(x1, cs[i]), __fmul_rn(x0, sn[i]));
    }
}

extern "C" df_status gpu_mla_write(const mla_shape *sh, const float *kv_a_norm, const float *inv_freq,
                                   const float *kva, float *cache, int pos, int n, float *q, void *stream) {
    if (!sh || !kv_a_norm || !kva || !cache || pos < 0 || n < 1 || sh->R < 1 || sh->dr < 0 ||
        (sh->use_rope && (!inv_freq || !q || sh->nh < 1 || sh->dq < sh->dn + sh->dr)))
        return DF_ERR_ARG;
    if (sh->dr % 2 || sh->dr > 512) return DF_ERR_UNSUPPORTED;
    k_mla_write<<<n, MLA_W_THREADS, 0, (cudaStream_t)stream>>>(
        kva, kv_a_norm, inv_freq, cache, q, sh->R, sh->dr, sh->nh, sh->dq, sh->dn, sh->latent_eps,
        sh->use_rope, sh->rope_interleave, sh->rope_mscale, pos);
    return launched("k_mla_write");
}

/* ---- 4. MLA attention ------------------------------------------------------- */

enum {
    MLA_QB = 8,          /* queries per block = warps */
    MLA_KB = 32,         /* cache rows per tile = lanes */
    MLA_T = MLA_QB * 32, /* threads */
    MLA_MAX_R = 4 * MLA_T, /* latent columns: at most 4 a thread */
    MLA_MAX_DK = 1280,   /* R + dr */
    MLA_SPLIT = 256,     /* positions per split (more past MLA_MAX_SPLITS of them) */
    MLA_MAX_SPLITS = 1024
};
/* Two queries a warp from this many queries (a prompt: K3's 96 heads x 43
 * tokens or more), while a block's shared memory leaves two blocks an SM.
 * GPU_MLA_WIDE_QPW 4 (a measurement build): four a warp, one block an SM
 * (32 query rows: ~150 KB at K3's widths). */
#ifndef GPU_MLA_WIDE_QPW
#define GPU_MLA_WIDE_QPW 2
#endif
enum { MLA_WIDE_Q = 4096, MLA_WIDE_QPW = GPU_MLA_WIDE_QPW,
       MLA_WIDE_SMEM = (MLA_WIDE_QPW == 2 ? 113 : 227) * 1024 };
/* the splits' partial sums of one launch at most (gpu_mla_attend's ws) */
static const size_t MLA_PART_BYTES = (size_t)256 << 20;

struct mla_args {
    const float *cache, *q, *qlat;
    float *olat;
    float *part;         /* splits > 1: [Q][splits][2 + R] = m, l, acc */
    int R, dr, dk, nh, dq, dn, n, pos, Q;
    int qstride, kstride; /* shared row strides (floats) */
    int split_len, splits;
    int qbeg; /* the launch's first query (queries run in chunks while splits > 1: part's size) */
    float scale;
};

/* QPW queries a warp (a block's MLA_QB x QPW queries share each cache row
 * it stages), CPT latent columns a thread (R <= CPT x MLA_T). Every
 * query's sums are the one-query-a-warp kernel's, step for step: a score is
 * one lane's four chains over the columns, a tile's softmax the same
 * butterflies, P K the rows in order; tiles past a query's position add
 * exact zeros (p = 0, alpha = 1), so a query's bits never depend on the
 * queries beside it (QPW) or on R's columns past R (CPT). */
template <int QPW, int CPT>
__global__ void __launch_bounds__(MLA_T, QPW >= 4 ? 1 : 2) k_mla_attend(const __grid_constant__ mla_args a) {
    constexpr int QB = MLA_QB * QPW;
    extern __shared__ __align__(16) float sm[];
    float *Qs = sm, *Ks = Qs + QB * a.qstride, *Ps = Ks + MLA_KB * a.kstride, *alpha = Ps + QB * MLA_KB;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int q0 = a.qbeg + blockIdx.x * QB, split = blockIdx.y;
    const int R = a.R, dk = a.dk;
    /* the tile's queries: [q_lat | q_pe] rows; absent queries (q0 + qq >= Q) see no position */
    int pmax = -1;
    for (int qq = 0; qq < QB; qq++) {
        const int qi = q0 + qq;
        if (qi < a.Q) pmax = max(pmax, a.pos + qi % a.n);
    }
    for (int i = tid; i < QB * dk; i += MLA_T) {
        const int qq = i / dk, c = i % dk, qi = q0 + qq;
        float v = 0.0f;
        if (qi < a.Q) {
            const int h = qi / a.n, t = qi % a.n;
            v = c < R ? a.qlat[(size_t)qi * R + c] : a.q[((size_t)t * a.nh + h) * a.dq + a.dn + (c - R)];
        }
        Qs[qq * a.qstride + c] = v;
    }
    /* this warp's queries: warp * QPW + j */
    int myp[QPW]; /* the last position each sees */
    float m[QPW], l[QPW]; /* running max and sum, the same in every lane */
#pragma unroll
    for (int j = 0; j < QPW; j++) {
        const int qi = q0 + warp * QPW + j;
        myp[j] = qi < a.Q ? a.pos + qi % a.n : -1;
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    const int k_begin = split * a.split_len;
    const int k_end = min(k_begin + a.split_len, pmax + 1);
    float acc[QB][CPT];
#pragma unroll
    for (int qq = 0; qq < QB; qq++)
#pragma unroll
        for (int c = 0; c < CPT; c++) acc[qq][c] = 0.0f;
    for (int k0 = k_begin; k0 < k_end; k0 += MLA_KB) {
        const int nk = min(MLA_KB, k_end - k0);
        __syncthreads(); /* the previous tile's K and P are consumed */
        const int d4 = dk / 4;
        for (int i = tid; i < nk * d4; i += MLA_T) {
            const int r = i / d4, c4 = i % d4;
            const float4 v = __ldg((const float4 *)(a.cache + (size_t)(k0 + r) * dk) + c4);
            *(float4 *)(Ks + r * a.kstride + 4 * c4) = v;
        }
        __syncthreads();
        /* scores of (query, row lane): four chains (columns c % 4) a query,
         * then (0 + 1) + (2 + 3), times the scale; the row is read once for
         * the warp's QPW queries */
        float s[QPW];
        bool live = false;
#pragma unroll
        for (int j = 0; j < QPW; j++) live |= lane < nk && k0 + lane <= myp[j];
        if (live) {
            const float4 *kr = (const float4 *)(Ks + lane * a.kstride);
            float d[QPW][4];
#pragma unroll
            for (int j = 0; j < QPW; j++) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
            for (int c4 = 0; c4 < d4; c4++) {
                const float4 y = kr[c4];
#pragma unroll
                for (int j = 0; j < QPW; j++) {
                    const float4 x = ((const float4 *)(Qs + (warp * QPW + j) * a.qstride))[c4];
                    d[j][0] = __fmaf_rn(x.x, y.x, d[j][0]);
                    d[j][1] = __fmaf_rn(x.y, y.y, d[j][1]);
                    d[j][2] = __fmaf_rn(x.z, y.z, d[j][2]);
                    d[j][3] = __fmaf_rn(x.w, y.w, d[j][3]);
                }
            }
#pragma unroll
            for (int j = 0; j < QPW; j++)
                s[j] = lane < nk && k0 + lane <= myp[j]
                           ? __fmul_rn(__fadd_rn(__fadd_rn(d[j][0], d[j][1]), __fadd_rn(d[j][2], d[j][3])), a.scale)
                           : -INFINITY;
        } else {
#pragma unroll
            for (int j = 0; j < QPW; j++) s[j] = -INFINITY;
        }
#pragma unroll
        for (int j = 0; j < QPW; j++) {
            float tmax = s[j];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
            const float mn = fmaxf(m[j], tmax);
            float p = 0.0f, al = 1.0f;
            if (mn != -INFINITY) {
                p = s[j] == -INFINITY ? 0.0f : expf(s[j] - mn);
                al = m[j] == -INFINITY ? 0.0f : expf(m[j] - mn);
            }
            float ts = p;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ts += __shfl_xor_sync(0xffffffffu, ts, o);
            l[j] = __fadd_rn(__fmul_rn(l[j], al), ts);
            m[j] = mn;
            Ps[(warp * QPW + j) * MLA_KB + lane] = p;
            if (lane == 0) alpha[warp * QPW + j] = al;
        }
        __syncthreads();
        /* acc = acc * alpha + P K over this tile's rows, columns c = tid + j * MLA_T */
#pragma unroll
        for (int qq = 0; qq < QB; qq++) {
            const float aq = alpha[qq];
#pragma unroll
            for (int c = 0; c < CPT; c++) acc[qq][c] = __fmul_rn(acc[qq][c], aq);
        }
        /* rows four at a time: their K columns first, then each query's
         * four p (one 16-byte load) into its sums, rows in order */
        int k = 0;
        for (; k + 4 <= nk; k += 4) {
            float kv[4][CPT];
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < CPT; c++) {
                    const int col = tid + c * MLA_T;
                    kv[r][c] = col < R ? Ks[(k + r) * a.kstride + col] : 0.0f;
                }
#pragma unroll
            for (int qq = 0; qq < QB; qq++) {
                const float4 p4 = *(const float4 *)(Ps + qq * MLA_KB + k);
#pragma unroll
                for (int c = 0; c < CPT; c++) {
                    float v = __fmaf_rn(p4.x, kv[0][c], acc[qq][c]);
                    v = __fmaf_rn(p4.y, kv[1][c], v);
                    v = __fmaf_rn(p4.z, kv[2][c], v);
                    acc[qq][c] = __fmaf_rn(p4.w, kv[3][c], v);
                }
            }
        }
        for (; k < nk; k++) {
            float kv[CPT];
#pragma unroll
            for (int c = 0; c < CPT; c++) {
                const int col = tid + c * MLA_T;
                kv[c] = col < R ? Ks[k * a.kstride + col] : 0.0f;
            }
#pragma unroll
            for (int qq = 0; qq < QB; qq++) {
                const float pq = Ps[qq * MLA_KB + k];
#pragma unroll
                for (int c = 0; c < CPT; c++) acc[qq][c] = __fmaf_rn(pq, kv[c], acc[qq][c]);
            }
        }
    }
    /* m and l of each query live in its warp: share them */
    __syncthreads();
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < QPW; j++) {
            Ps[warp * QPW + j] = m[j];
            Ps[QB + warp * QPW + j] = l[j];
        }
    __syncthreads();
#pragma unroll
    for (int qq = 0; qq < QB; qq++) {
        const int qi = q0 + qq;
        if (qi >= a.Q) continue;
        const float mq = Ps[qq], lq = Ps[QB + qq];
        if (a.splits == 1) {
#pragma unroll
            for (int c = 0; c < CPT; c++) {
                const int col = tid + c * MLA_T;
                if (col < R) a.olat[(size_t)qi * R + col] = __fdiv_rn(acc[qq][c], lq);
            }
        } else {
            float *pp = a.part + ((size_t)(qi - a.qbeg) * a.splits + split) * (2 + R);
            if (tid == 0) {
                pp[0] = mq;
                pp[1] = lq;
            }
#pragma unroll
            for (int c = 0; c < CPT; c++) {
                const int col = tid + c * MLA_T;
                if (col < R) pp[2 + col] = acc[qq][c];
            }
        }
    }
}

/* One block per query: o = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp(m_s - M),
 * splits in order. Splits past the query's position have m = -inf, w = 0. */
__global__ void __launch_bounds__(256) k_mla_combine(const float *__restrict__ part, int splits, int R,
                                                      float *__restrict__ olat, int qbeg) {
    extern __shared__ float wsh[]; /* [splits] */
    __shared__ float Ls;
    const float *pq = part + (size_t)blockIdx.x * splits * (2 + R);
    if (threadIdx.x == 0) {
        float M = -INFINITY;
        for (int s = 0; s < splits; s++) M = fmaxf(M, pq[(size_t)s * (2 + R)]);
        float L = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float ms = pq[(size_t)s * (2 + R)];
            const float w = ms == -INFINITY ? 0.0f : expf(ms - M);
            wsh[s] = w;
            L = __fmaf_rn(w, pq[(size_t)s * (2 + R) + 1], L);
        }
        Ls = L;
    }
    __syncthreads();
    const float L = Ls;
    for (int c = threadIdx.x; c < R; c += 256) {
        float o = 0.0f;
        for (int s = 0; s < splits; s++) o = __fmaf_rn(wsh[s], pq[(size_t)s * (2 + R) + 2 + c], o);
        olat[((size_t)qbeg + blockIdx.x) * R + c] = __fdiv_rn(o, L);
    }
}

extern "C" df_status gpu_mla_attend(const mla_shape *sh, const float *cache, const float *q, const float *qlat,
                                    int pos, int n, float *olat, gpu_ws *ws, void *stream) {
    if (!sh || !cache || !q || !qlat || !olat || !ws || pos < 0 || n < 1 || sh->nh < 1 || sh->R < 1 ||
        sh->dr < 0 || sh->dq < sh->dn + sh->dr || sh->dn < 0)
        return DF_ERR_ARG;
    if (sh->R % 4 || sh->dr % 4 || sh->R > MLA_MAX_R || sh->R + sh->dr > MLA_MAX_DK) return DF_ERR_UNSUPPORTED;
    mla_args a;
    a.cache = cache;
    a.q = q;
    a.qlat = qlat;
    a.olat = olat;
    a.part = NULL;
    a.R = sh->R;
    a.dr = sh->dr;
    a.dk = sh->R + sh->dr;
    a.nh = sh->nh;
    a.dq = sh->dq;
    a.dn = sh->dn;
    a.n = n;
    a.pos = pos;
    a.Q = sh->nh * n;
    a.scale = sh->softmax_scale;
    a.qstride = a.dk;
    /* K rows: a multiple of 4 floats (float4) that is an odd multiple of 4,
     * so the 8 rows of a quarter-warp's 16-byte reads hit distinct banks */
    a.kstride = a.dk % 8 ? a.dk : a.dk + 4;
    const int64_t L = (int64_t)pos + n; /* positions the last token sees */
    /* Splits of MLA_SPLIT positions from position 0, whatever n and the
     * other queries: a query's splits past its position are empty and add
     * exact zeros in k_mla_combine, and one split alone gives acc / l either
     * way, so a query's bits depend on its position alone (a prompt gives
     * token-by-token decode's bits) up to MLA_SPLIT x MLA_MAX_SPLITS
     * positions; past that the splits lengthen with L. (The split length
     * used to aim at 512 blocks from the launch's queries: a 32-row prompt
     * piece and a decode step split a long context differently.) */
    int64_t len = MLA_SPLIT;
    if (cdiv(L, len) > MLA_MAX_SPLITS) len = cdiv(cdiv(L, MLA_MAX_SPLITS), MLA_KB) * MLA_KB;
    if (len >= L) len = L;
    /* Queries a block: 16 (two a warp) when there are many and 16 rows of
     * [q_lat | q_pe] still leave room for two blocks an SM; else 8. Latent
     * columns a thread: 2 up to R = 512, else 4. Neither changes a bit. */
    const int cpt = a.R <= 2 * MLA_T ? 2 : 4;
    auto smem_of = [&](int qb) {
        return ((size_t)qb * a.qstride + (size_t)MLA_KB * a.kstride + (size_t)qb * MLA_KB + qb) * sizeof(float);
    };
    const int qpw =
        cpt == 2 && a.Q >= MLA_WIDE_Q && smem_of(MLA_WIDE_QPW * MLA_QB) <= MLA_WIDE_SMEM ? MLA_WIDE_QPW : 1;
    const int qbk = qpw * MLA_QB;
    const int64_t qtiles = cdiv(a.Q, qbk);
    if (len > 0x7fffffff || qtiles > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    a.split_len = (int)len;
    a.splits = (int)cdiv(L, len);
    a.qbeg = 0;
    cudaStream_t s = (cudaStream_t)stream;
    df_status st;
    /* with splits, queries in chunks whose partial sums fit MLA_PART_BYTES
     * (a 32-row K3 prompt piece at 100K positions would want 1.6 GB);
     * tiles never straddle two chunks, and no query's sums depend on them */
    int64_t chunk = qtiles * qbk;
    if (a.splits > 1) {
        const size_t per_q = (size_t)a.splits * (2 + a.R) * sizeof(float);
        chunk = (int64_t)(MLA_PART_BYTES / per_q) / qbk * qbk;
        if (chunk < qbk) chunk = qbk;
        if (chunk > qtiles * qbk) chunk = qtiles * qbk;
        const int64_t rows = chunk < a.Q ? chunk : a.Q;
        if ((st = ws_reserve(ws, (size_t)rows * per_q, "gpu_mla_attend workspace"))) return st;
        a.part = (float *)ws->buf;
    }
    const size_t smem = smem_of(qbk);
    void (*kern)(mla_args) =
        qpw > 1 ? k_mla_attend<MLA_WIDE_QPW, 2> : cpt == 2 ? k_mla_attend<1, 2> : k_mla_attend<1, 4>;
    if ((st = smem_opt_in(kern, smem, "k_mla_attend smem"))) return st;
    for (int64_t qb = 0; qb < a.Q; qb += chunk) {
        const int64_t nq = a.Q - qb < chunk ? a.Q - qb : chunk;
        a.qbeg = (int)qb;
        kern<<<dim3((unsigned)cdiv(nq, qbk), (unsigned)a.splits), MLA_T, smem, s>>>(a);
        if ((st = launched("k_mla_attend"))) return st;
        if (a.splits == 1) continue;
        k_mla_combine<<<(unsigned)nq, 256, (size_t)a.splits * sizeof(float), s>>>(a.part, a.splits, a.R, olat, (int)qb);
        if ((st = launched("k_mla_combine"))) return st;
    }
    return DF_OK;
}

/* ---- 5. attention residuals ------------------------------------------------- */

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

/* ---- 6. MLA absorbed products ------------------------------------------------
 *
 * kv_b [nh (dn + dv)][R] (bf16, or row-int8 from the int8 spine: q x its
 * row's scale, as kn_dequant_row gives it): head h's rows h (dn + dv) .. + dn are W_UK,
 * the next dv rows W_UV. Absorb: a block per (head, 128 latent columns),
 * thread r sums q_nope[t][h][d] W_UK[h][d][r] over d ascending (one FMA
 * chain per token, q of the head in shared memory). Lift: a warp per output
 * row (h, v), lanes over r, a fixed butterfly; each row is read once per
 * token (from L1 after the first). Both are fp32 sums over exact weights, so
 *   |y - exact| <= K u sum |w x|   (K = dn for absorb, R/32 + 5 for lift).
 */

__device__ __forceinline__ float bf16_at(const uint16_t *w, int64_t i) { return __uint_as_float((uint32_t)w[i] << 16); }

/* Element (row, i) of kv_b with row-major rows of R: bf16, or int8 times the row's scale. */
template <int I8>
__device__ __forceinline__ float kvb_at(const void *w, const float *scale, int64_t row, int64_t i, int R) {
    if (I8) return __fmul_rn((float)((const int8_t *)w)[row * R + i], __ldg(scale + row));
    return bf16_at((const uint16_t *)w, row * R + i);
}

enum { ABS_T = 128, ABS_D = 32, LIFT_WARPS = 8 };

template <int I8>
__global__ void __launch_bounds__(ABS_T) k_mla_absorb(const void *__restrict__ w, const float *__restrict__ wscale, int nh,
                                                     int dn, int dv, int dq, int R, const float *__restrict__ q, int n,
                                                     float *__restrict__ qlat) {
    extern __shared__ float qs[]; /* [n][dn] */
    const int h = blockIdx.x, r = blockIdx.y * ABS_T + threadIdx.x;
    for (int i = threadIdx.x; i < n * dn; i += ABS_T) {
        const int t = i / dn, d = i % dn;
        qs[i] = q[((int64_t)t * nh + h) * dq + d];
    }
    __syncthreads();
    if (r >= R) return;
    float acc[32];
#pragma unroll
    for (int t = 0; t < 32; t++) acc[t] = 0.0f;
    const int64_t row0 = (int64_t)h * (dn + dv);
    /* ABS_D rows of weights loaded before their products, so each thread
     * keeps that many loads in flight (one at a time: ~120 us for K3's
     * kv_b under ncu, ~100 GB/s; 8 at a time: ~62 us); the products still
     * run in d order, so the bits do not change. */
    for (int d0 = 0; d0 < dn; d0 += ABS_D) {
        float wv[ABS_D];
#pragma unroll
        for (int j = 0; j < ABS_D; j++) wv[j] = d0 + j < dn ? kvb_at<I8>(w, wscale, row0 + d0 + j, r, R) : 0.0f;
#pragma unroll
        for (int j = 0; j < ABS_D; j++) {
            if (d0 + j >= dn) break;
#pragma unroll
            for (int t = 0; t < 32; t++)
                if (t < n) acc[t] = fmaf(qs[t * dn + d0 + j], wv[j], acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < 32; t++)
        if (t < n) qlat[((int64_t)h * n + t) * R + r] = acc[t];
}

/* A warp takes RW rows (h, v .. v + RW - 1) of one head and the tokens TK
 * at a time: per step of its columns r = lane + 32 i it loads RW weights
 * and TK latent values for RW x TK FMAs (one row and one token a warp read
 * both for each FMA: bound by L1). Each (row, token) sum is the same chain
 * as one row and token alone: fmaf over r = lane, lane + 32, ... from zero,
 * then the butterfly (16, 8, 4, 2, 1), so the bits do not depend on RW, TK
 * or n. Lane k TK + t stores sum (k, t). RW = TK = 1: a row a warp, a
 * token at a time (one-token decode). */
template <int I8, int RW, int TK>
__global__ void __launch_bounds__(LIFT_WARPS * 32) k_mla_lift(const void *__restrict__ w, const float *__restrict__ wscale,
                                                             int nh, int dn, int dv, int R, const float *__restrict__ olat,
                                                             int n, float *__restrict__ attn) {
    static_assert(RW * TK <= 32, "a lane stores at most one sum");
    const int lane = threadIdx.x & 31, gw = blockIdx.x * LIFT_WARPS + (threadIdx.x >> 5);
    if ((int64_t)gw * RW >= (int64_t)nh * dv) return;
    const int h = gw * RW / dv, v0 = gw * RW % dv; /* dv % RW == 0: the RW rows share head h */
    const int64_t row0 = (int64_t)h * (dn + dv) + dn + v0;
    for (int t0 = 0; t0 < n; t0 += TK) {
        float s[RW][TK];
#pragma unroll
        for (int k = 0; k < RW; k++)
#pragma unroll
            for (int t = 0; t < TK; t++) s[k][t] = 0.0f;
        const float *o = olat + ((int64_t)h * n + t0) * R;
        for (int r = lane; r < R; r += 32) {
            float wv[RW], ov[TK];
#pragma unroll
            for (int k = 0; k < RW; k++) wv[k] = kvb_at<I8>(w, wscale, row0 + k, r, R);
#pragma unroll
            for (int t = 0; t < TK; t++) ov[t] = t0 + t < n ? o[(int64_t)t * R + r] : 0.0f;
#pragma unroll
            for (int k = 0; k < RW; k++)
#pragma unroll
                for (int t = 0; t < TK; t++) s[k][t] = fmaf(wv[k], ov[t], s[k][t]);
        }
        float mine = 0.0f;
#pragma unroll
        for (int k = 0; k < RW; k++)
#pragma unroll
            for (int t = 0; t < TK; t++) {
                float x = s[k][t];
#pragma unroll
                for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
                if (lane == k * TK + t) mine = x;
            }
        const int k = lane / TK, t = lane % TK;
        if (k < RW && t0 + t < n) attn[(int64_t)(t0 + t) * nh * dv + (int64_t)h * dv + v0 + k] = mine;
    }
}

enum { ABS_SMEM = 48 * 1024 }; /* absorb keeps q of <= 32 tokens in shared memory */

static df_status mla_kv_b_check(const gpu_weight *kv_b, const mla_shape *sh, int n) {
    if (!kv_b || !kv_b->data || !sh || n < 1) return DF_ERR_ARG;
    if (n > 32 || !gpu_mla_products_take(kv_b) || (size_t)n * sh->dn * sizeof(float) > ABS_SMEM) return DF_ERR_UNSUPPORTED;
    if (kv_b->rows != (int64_t)sh->nh * (sh->dn + sh->dv) || kv_b->cols != sh->R) return DF_ERR_ARG;
    return DF_OK;
}

extern "C" int gpu_mla_products_take(const gpu_weight *kv_b) {
    return kv_b && (kv_b->type == WT_BF16 || kv_b->type == WT_I8_ROW);
}

extern "C" int gpu_mla_takes(const mla_shape *sh) {
    return sh && sh->nh >= 1 && sh->R >= 1 && sh->dr >= 0 && sh->dr % 4 == 0 && sh->dr <= 512 && sh->R % 4 == 0 &&
           sh->R <= MLA_MAX_R && sh->R + sh->dr <= MLA_MAX_DK && (size_t)32 * sh->dn * sizeof(float) <= ABS_SMEM;
}

extern "C" df_status gpu_mla_absorb(const gpu_weight *kv_b, const mla_shape *sh, const float *q, int n, float *qlat,
                                    void *stream) {
    df_status st = mla_kv_b_check(kv_b, sh, n);
    if (st != DF_OK) return st;
    if (!q || !qlat) return DF_ERR_ARG;
    const size_t smem = (size_t)n * sh->dn * sizeof(float);
    dim3 grid((unsigned)sh->nh, (unsigned)cdiv(sh->R, ABS_T));
    if (kv_b->type == WT_I8_ROW)
        k_mla_absorb<1><<<grid, ABS_T, smem, (cudaStream_t)stream>>>(kv_b->data, (const float *)kv_b->scale, sh->nh, sh->dn,
                                                                     sh->dv, sh->dq, sh->R, q, n, qlat);
    else
        k_mla_absorb<0><<<grid, ABS_T, smem, (cudaStream_t)stream>>>(kv_b->data, NULL, sh->nh, sh->dn, sh->dv, sh->dq,
                                                                     sh->R, q, n, qlat);
    return launched("k_mla_absorb");
}

extern "C" df_status gpu_mla_lift(const gpu_weight *kv_b, const mla_shape *sh, const float *olat, int n, float *attn,
                                  void *stream) {
    df_status st = mla_kv_b_check(kv_b, sh, n);
    if (st != DF_OK) return st;
    if (!olat || !attn) return DF_ERR_ARG;
    /* 4 rows x 8 tokens a warp when a head's rows split in fours and there
     * are tokens to share them, else a row a warp, a token at a time */
    const int64_t rows = (int64_t)sh->nh * sh->dv;
    const bool four = sh->dv % 4 == 0 && n > 1;
    const unsigned blocks = (unsigned)cdiv(four ? rows / 4 : rows, LIFT_WARPS);
    const bool i8 = kv_b->type == WT_I8_ROW;
    void (*lift)(const void *, const float *, int, int, int, int, const float *, int, float *) =
        i8 ? (four ? k_mla_lift<1, 4, 8> : k_mla_lift<1, 1, 1>) : (four ? k_mla_lift<0, 4, 8> : k_mla_lift<0, 1, 1>);
    lift<<<blocks, LIFT_WARPS * 32, 0, (cudaStream_t)stream>>>(kv_b->data, i8 ? (const float *)kv_b->scale : NULL, sh->nh,
                                                              sh->dn, sh->dv, sh->R, olat, n, attn);
    return launched("k_mla_lift");
}
