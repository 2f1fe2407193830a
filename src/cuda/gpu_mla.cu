/* gpu_mla.cu — MLA's CUDA kernels behind gpu.h's attention section
 * (prefix gpu_mla): the cache row write (latent norm, rotary parts), the
 * absorbed products (q_nope into the latent, the latent back out through
 * kv_b) and the latent attention over the cache.
 *
 * Owns: those kernels, their launch checks, the attention's split
 * workspace and the tensor-core products' scratch (W_UK transposed, q_nope
 * by head). Refuses: the other projections (gpu_matmul), the cache's
 * placement (the caller holds it, laid out as on the CPU), host math (the
 * oracle is mla_core.c, see tests/cuda/test_cuda_attn.c).
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
 * Speed: fp32 FMAs fed from shared memory (a 16-byte cache-row load per 4
 * FMAs of each of the warp's queries in the scores), not tensor cores, so
 * at long contexts the attention is bound by shared memory well above the
 * cache-read time (an mma version, as FlashMLA, would change the sums'
 * order). Measured on the H200: bench/cuda_NOTES.md.
 *
 * Sections: 1. cache rows  2. attention  3. absorbed products  3b. the same
 * on the tensor cores (prompts with bf16 on the tensor cores)
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_attn_internal.h"
#include "gpu_internal.h"

/* ---- 1. cache rows ---------------------------------------------------------- */

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

/* ---- 2. attention ---------------------------------------------------------- */

enum {
    MLA_QB = 8,          /* queries per block = warps */
    MLA_KB = 32,         /* cache rows per tile = lanes */
    MLA_T = MLA_QB * 32, /* threads */
    MLA_MAX_R = 4 * MLA_T, /* latent columns: at most 4 a thread */
    MLA_MAX_DK = 1280,   /* R + dr */
    MLA_SPLIT = 256,     /* positions per split (more past MLA_MAX_SPLITS of them) */
    MLA_MAX_SPLITS = 1024
};
/* Two queries a warp from this many queries (a prompt: K3's 96 heads x 32
 * tokens, one of the engine's 32-row pieces; 4096 until the thirty-second
 * session, which no K3 piece reached), while a block's shared memory leaves
 * two blocks an SM.
 * GPU_MLA_WIDE_QPW 4 (a measurement build): four a warp, one block an SM
 * (32 query rows: ~150 KB at K3's widths). */
#ifndef GPU_MLA_WIDE_QPW
#define GPU_MLA_WIDE_QPW 2
#endif
#ifndef GPU_MLA_WIDE_Q
#define GPU_MLA_WIDE_Q 3072
#endif
enum { MLA_WIDE_Q = GPU_MLA_WIDE_Q, MLA_WIDE_QPW = GPU_MLA_WIDE_QPW,
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
        /* this thread's column c of cache row k (0 past R) */
        auto kcol = [&](int k, int c) {
            const int col = tid + c * MLA_T;
            return col < R ? Ks[k * a.kstride + col] : 0.0f;
        };
        /* rows four at a time: their K columns first, then each query's
         * four p (one 16-byte load) into its sums, rows in order */
        int k = 0;
        for (; k + 4 <= nk; k += 4) {
            float kv[4][CPT];
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < CPT; c++) kv[r][c] = kcol(k + r, c);
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
            for (int c = 0; c < CPT; c++) kv[c] = kcol(k, c);
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

/* ---- 3. absorbed products ------------------------------------------------
 *
 * kv_b [nh (dn + dv)][R] (bf16, or row-int8 from the int8 spine: q x its
 * row's scale, as kn_dequant_row gives it): head h's rows h (dn + dv) .. + dn are W_UK,
 * the next dv rows W_UV. Absorb: a block per (head, 128 latent columns),
 * thread r sums q_nope[t][h][d] W_UK[h][d][r] over d ascending (one FMA
 * chain per token, q of the head in shared memory). Lift: a warp per 4
 * output rows (h, v .. v + 3) x 8 tokens in a prompt, per row and token in
 * decode, lanes over r, a fixed butterfly per (row, token) (k_mla_lift's
 * comment). Both are fp32 sums over exact weights, so
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
#ifndef GPU_MLA_ABS_V4
#define GPU_MLA_ABS_V4 1 /* build flag, for measurements: 0 reads q one value at a time */
#endif

/* V4 (dn % 4 == 0): a token's q values four at a time from shared memory
 * (one 16-byte load for four FMAs; one load a FMA made the absorb bound by
 * shared-memory loads), each token's chain still over d ascending. */
template <int I8, bool V4>
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
        if constexpr (V4) {
#pragma unroll
            for (int j = 0; j < ABS_D; j += 4) {
                if (d0 + j >= dn) break;
#pragma unroll
                for (int t = 0; t < 32; t++)
                    if (t < n) {
                        const float4 q4 = *(const float4 *)&qs[t * dn + d0 + j];
                        acc[t] = fmaf(q4.x, wv[j], acc[t]);
                        acc[t] = fmaf(q4.y, wv[j + 1], acc[t]);
                        acc[t] = fmaf(q4.z, wv[j + 2], acc[t]);
                        acc[t] = fmaf(q4.w, wv[j + 3], acc[t]);
                    }
            }
        } else {
#pragma unroll
            for (int j = 0; j < ABS_D; j++) {
                if (d0 + j >= dn) break;
#pragma unroll
                for (int t = 0; t < 32; t++)
                    if (t < n) acc[t] = fmaf(qs[t * dn + d0 + j], wv[j], acc[t]);
            }
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
    const bool v4 = GPU_MLA_ABS_V4 && sh->dn % 4 == 0, i8 = kv_b->type == WT_I8_ROW;
    void (*absorb)(const void *, const float *, int, int, int, int, int, const float *, int, float *) =
        i8 ? (v4 ? k_mla_absorb<1, true> : k_mla_absorb<1, false>) : (v4 ? k_mla_absorb<0, true> : k_mla_absorb<0, false>);
    absorb<<<grid, ABS_T, smem, (cudaStream_t)stream>>>(kv_b->data, i8 ? (const float *)kv_b->scale : NULL, sh->nh, sh->dn,
                                                        sh->dv, sh->dq, sh->R, q, n, qlat);
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

/* ---- 3b. absorbed products on the tensor cores ------------------------------
 *
 * For prompts with bf16 on the tensor cores (n >= ws->bf16_tc_rows): per
 * head, absorb is the R x dn matrix W_UK^T (a transposed copy of the
 * head's W_UK rows, made in ws) times q_nope (gathered per head), lift the
 * dv x R rows W_UV times the head's olat; both through gpu_bf16_tc_groups
 * (one launch for all heads on the wgmma blocks), so each output has
 * gpu_bf16_tc's bits and bound for its row. */

enum { UKT_T = 32 };

/* wt[h][r][d] = W_UK[h][d][r]: a 32 x 32 tile a block (bf16 bits copied). */
__global__ void __launch_bounds__(UKT_T * 8) k_mla_ukt(const uint16_t *__restrict__ w, int dn, int dv, int R,
                                                      uint16_t *__restrict__ wt) {
    __shared__ uint16_t tile[UKT_T][UKT_T + 1];
    const int h = blockIdx.z, r0 = blockIdx.x * UKT_T, d0 = blockIdx.y * UKT_T;
    for (int j = threadIdx.y; j < UKT_T; j += 8) {
        const int d = d0 + j, r = r0 + threadIdx.x;
        if (d < dn && r < R) tile[j][threadIdx.x] = w[((int64_t)h * (dn + dv) + d) * R + r];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < UKT_T; j += 8) {
        const int r = r0 + j, d = d0 + threadIdx.x;
        if (r < R && d < dn) wt[((int64_t)h * R + r) * dn + d] = tile[threadIdx.x][j];
    }
}

/* out[h][t][d] = q[t][h][d] for d < dn (q_nope of each head, contiguous). */
__global__ void __launch_bounds__(256) k_mla_qnope(const float *__restrict__ q, int n, int nh, int dq, int dn,
                                                  float *__restrict__ out) {
    const int64_t total = (int64_t)nh * n * dn;
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < total; i += (int64_t)gridDim.x * 256) {
        const int64_t d = i % dn, ht = i / dn, t = ht % n, h = ht / n;
        out[i] = q[(t * nh + h) * dq + d];
    }
}

static size_t al256(size_t b) { return (b + 255) / 256 * 256; }

extern "C" int gpu_mla_products_tc_take(const gpu_weight *kv_b, const mla_shape *sh) {
    return kv_b && sh && kv_b->type == WT_BF16 && kv_b->data && sh->dn >= 64 && sh->dn % 64 == 0 && sh->R >= 64 &&
           sh->R % 64 == 0 && kv_b->rows == (int64_t)sh->nh * (sh->dn + sh->dv) && kv_b->cols == sh->R;
}

extern "C" df_status gpu_mla_absorb_tc(const gpu_weight *kv_b, const mla_shape *sh, const float *q, int n,
                                       float *qlat, gpu_ws *ws, void *stream) {
    if (!kv_b || !sh || !q || !qlat || !ws || n < 1) return DF_ERR_ARG;
    if (!gpu_mla_products_tc_take(kv_b, sh)) return DF_ERR_UNSUPPORTED;
    const int nh = sh->nh, dn = sh->dn, R = sh->R;
    const size_t bwt = al256((size_t)nh * R * dn * 2), bq = al256((size_t)nh * n * dn * sizeof(float));
    df_status st = ws_reserve(ws, bwt + bq + gpu_bf16_tc_groups_bytes(nh, n, R, dn), "gpu_mla_absorb_tc workspace");
    if (st) return st;
    cudaStream_t s = (cudaStream_t)stream;
    uint16_t *wt = (uint16_t *)ws->buf;
    float *qn = (float *)((char *)ws->buf + bwt);
    k_mla_ukt<<<dim3((unsigned)cdiv(R, UKT_T), (unsigned)cdiv(dn, UKT_T), (unsigned)nh), dim3(UKT_T, 8), 0, s>>>(
        (const uint16_t *)kv_b->data, dn, sh->dv, R, wt);
    if ((st = launched("k_mla_ukt"))) return st;
    const int64_t total = (int64_t)nh * n * dn, b = cdiv(total, 256);
    k_mla_qnope<<<(unsigned)(b < 8192 ? b : 8192), 256, 0, s>>>(q, n, nh, sh->dq, dn, qn);
    if ((st = launched("k_mla_qnope"))) return st;
    gpu_weight wtw = *kv_b; /* W_UK^T of every head: nh R rows of dn */
    wtw.data = wt;
    wtw.rows = (int64_t)nh * R;
    wtw.cols = dn;
    return gpu_bf16_tc_groups(&wtw, 0, R, R, nh, qn, n, qlat, (int64_t)n * R, R, (char *)ws->buf + bwt + bq,
                              gpu_ws_wg(ws), s);
}

extern "C" df_status gpu_mla_lift_tc(const gpu_weight *kv_b, const mla_shape *sh, const float *olat, int n,
                                     float *attn, gpu_ws *ws, void *stream) {
    if (!kv_b || !sh || !olat || !attn || !ws || n < 1) return DF_ERR_ARG;
    if (!gpu_mla_products_tc_take(kv_b, sh)) return DF_ERR_UNSUPPORTED;
    const int nh = sh->nh, dn = sh->dn, dv = sh->dv, R = sh->R;
    df_status st = ws_reserve(ws, gpu_bf16_tc_groups_bytes(nh, n, dv, R), "gpu_mla_lift_tc workspace");
    if (st) return st;
    return gpu_bf16_tc_groups(kv_b, dn, dn + dv, dv, nh, olat, n, attn, dv, (int64_t)nh * dv, ws->buf,
                              gpu_ws_wg(ws), (cudaStream_t)stream);
}

