/* gpu_kda.cu — KDA's CUDA kernels behind gpu.h's attention section
 * (prefix gpu_kda): the short convolution, the gated delta-rule recurrence
 * and the gated output norm, token by token (k_kda) or, for a prompt, the
 * per-token steps for every token at once around the two passes over S
 * (k_kda_prep / k_kda_scan / k_kda_norm).
 *
 * Owns: those kernels and their launch checks. Refuses: projections
 * (gpu_matmul), the state's placement (the caller holds it, laid out as on
 * the CPU), host math (the oracle is kda_core.c, see
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
 * Speed: decode runs H blocks, two passes over S per token.
 *
 * Sections: 1. token by token  2. the scan path
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_attn_internal.h"
#include "gpu_internal.h"

/* ---- 1. token by token ------------------------------------------------------ */

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

/* ---- 2. the scan path (prompts: gpu_kda with a workspace) ----
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
