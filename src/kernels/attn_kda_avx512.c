/* attn_kda_avx512.c — the KDA kernels on 16 lanes (AVX-512F): kn_kda_recur
 * with 16 columns of S per vector, kn_kda_conv with 16 channels.
 *
 * Owns: kn_kda_recur_avx512, kn_kda_conv_avx512 (sections: recurrence; the
 * short convolution). Compiled with the Makefile's AVX512_FLAGS and
 * reached only through kernels.h's dispatchers when the CPU has them.
 * Refuses FMA and any float arithmetic but the scalar forms' own: each lane
 * computes exactly their product, then their add, in their order (see
 * kernels.h); the broadcast factors -k[d] and beta * k[d] are the same scalar
 * operations, and the SiLU calls libm's expf per lane; so the bits equal
 * KN_SCALAR's.
 *
 * Recurrence, why blocks of columns: the columns of S are independent (u[e]
 * and o[e] read column e only), so a block of up to 64 columns runs all n
 * tokens before the next block starts; its D x 64 floats (32 KiB at D = 128)
 * stay in L1 for the whole chunk, and u, the next token's u and o live in
 * registers (12 of the 32). Each token visits the block's rows once: its
 * update of S and its output are fused with the next token's decay and u (per
 * element the same sequence as two passes per token). The last block of a D
 * that is not a multiple of 16 loads and stores its last vector under a mask
 * (the lanes past D are zero and never written back).
 */
#include "kernels.h"
#include <immintrin.h>
#include <math.h>

#define AI static inline __attribute__((always_inline))

/* ---- recurrence ---- */

#define NV_MAX 4 /* vectors per block: 64 columns */

AI __m512 ld(const float *p, int last, __mmask16 m) { return last ? _mm512_maskz_loadu_ps(m, p) : _mm512_loadu_ps(p); }
AI void st(float *p, __m512 x, int last, __mmask16 m) {
    if (last) _mm512_mask_storeu_ps(p, m, x);
    else _mm512_storeu_ps(p, x);
}

/* Rows of S, columns [c0, c0 + 16 nv), for token t's second half (row +=
 * (beta k[d]) * u; o += q[d] * row) and, when fuse, token t+1's first half
 * in the same visit of the row (row *= decay'[d]; un += (-k'[d]) * row):
 * each element still sees the same operations in the same order. */
AI void rows(const kn_kda_head *a, float *S, int64_t t, const int nv, const int masked, __mmask16 m,
             const __m512 *u, __m512 *o, __m512 *un, const int fuse) {
    const int D = a->D;
    const int64_t off = t * a->ld, off1 = off + a->ld;
    const float *q = a->q + off, *k = a->k + off, beta = a->beta[t];
    const float *k1 = fuse ? a->k + off1 : NULL, *dec1 = fuse ? a->decay + off1 : NULL;
    float *tr = a->trail ? a->trail + t * a->trail_ld + (S - a->S) : NULL;
    for (int d = 0; d < D; d++) {
        float *row = S + (size_t)d * D;
        const __m512 bk = _mm512_set1_ps(beta * k[d]), qd = _mm512_set1_ps(q[d]);
        __m512 dc = _mm512_setzero_ps(), nk = _mm512_setzero_ps();
        if (fuse) dc = _mm512_set1_ps(dec1[d]), nk = _mm512_set1_ps(-k1[d]);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) {
            const int last = masked && j == nv - 1;
            __m512 r = _mm512_add_ps(ld(row + 16 * j, last, m), _mm512_mul_ps(bk, u[j]));
            if (tr) st(tr + (size_t)d * D + 16 * j, r, last, m);
            o[j] = _mm512_add_ps(o[j], _mm512_mul_ps(qd, r));
            if (fuse) {
                r = _mm512_mul_ps(r, dc);
                un[j] = _mm512_add_ps(un[j], _mm512_mul_ps(nk, r));
            }
            st(row + 16 * j, r, last, m);
        }
    }
}

/* Columns [c0, c0 + 16 nv) of S (the last vector masked by m when masked)
 * through all n tokens: token 0's first half (decay, u) alone, then for each
 * token its second half fused with the next token's first half. */
AI void block(const kn_kda_head *a, int c0, const int nv, const int masked, __mmask16 m) {
    const int D = a->D;
    float *S = a->S + c0;
    __m512 u[NV_MAX], un[NV_MAX], o[NV_MAX];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < nv; j++) u[j] = ld(a->v + c0 + 16 * j, masked && j == nv - 1, m);
    for (int d = 0; d < D; d++) { /* token 0: row *= decay[d]; u += (-k[d]) * row */
        float *row = S + (size_t)d * D;
        const __m512 dc = _mm512_set1_ps(a->decay[d]), nk = _mm512_set1_ps(-a->k[d]);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) {
            const int last = masked && j == nv - 1;
            __m512 r = _mm512_mul_ps(ld(row + 16 * j, last, m), dc);
            st(row + 16 * j, r, last, m);
            u[j] = _mm512_add_ps(u[j], _mm512_mul_ps(nk, r));
        }
    }
    for (int64_t t = 0; t < a->n; t++) {
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) o[j] = _mm512_setzero_ps();
        if (t + 1 < a->n) {
            const float *v1 = a->v + (t + 1) * a->ld + c0;
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nv; j++) un[j] = ld(v1 + 16 * j, masked && j == nv - 1, m);
            rows(a, S, t, nv, masked, m, u, o, un, 1);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nv; j++) u[j] = un[j];
        } else {
            rows(a, S, t, nv, masked, m, u, o, un, 0);
        }
        float *out = a->o + t * a->ld + c0;
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) st(out + 16 * j, o[j], masked && j == nv - 1, m);
    }
}

void kn_kda_recur_avx512(const kn_kda_head *a) {
    const int D = a->D;
    int c0 = 0;
    for (; c0 + 16 * NV_MAX <= D; c0 += 16 * NV_MAX) block(a, c0, NV_MAX, 0, 0xffff);
    const int rest = D - c0;
    if (!rest) return;
    const int nv = (rest + 15) / 16, tail = rest % 16;
    const __mmask16 m = tail ? (__mmask16)((1u << tail) - 1) : (__mmask16)0xffff;
    switch (nv) { /* compile-time vector counts; masked only where the tail is partial */
    case 1: tail ? block(a, c0, 1, 1, m) : block(a, c0, 1, 0, m); break;
    case 2: tail ? block(a, c0, 2, 1, m) : block(a, c0, 2, 0, m); break;
    case 3: tail ? block(a, c0, 3, 1, m) : block(a, c0, 3, 0, m); break;
    default: tail ? block(a, c0, 4, 1, m) : block(a, c0, 4, 0, m); break;
    }
}

/* ---- the short convolution ---- */

/* dst[(c + l) * (W - 1) + q] = lane l of win[q]: the [channel][W-1] layout
 * of the state and the trail. */
AI void put_window(float *dst, int c, const __m512 *win, const int W) {
    float tmp[3][16] __attribute__((aligned(64)));
    for (int q = 0; q < W - 1; q++) _mm512_store_ps(tmp[q], win[q]);
    for (int l = 0; l < 16; l++)
        for (int q = 0; q < W - 1; q++) dst[(size_t)(c + l) * (W - 1) + q] = tmp[q][l];
}

/* Channels [c, c + 16) for a compile-time W <= 4: kn_kda_conv's operations,
 * lane l being channel c + l (expf called per lane, as op_silu does). */
AI void conv_block(const kn_kda_conv_args *a, int c, const int W) {
    __m512 wv[4], win[3];
    float tmp[4][16] __attribute__((aligned(64)));
    for (int q = 0; q < W; q++) {
        for (int l = 0; l < 16; l++) tmp[q][l] = a->w[(size_t)(c + l) * W + q];
        wv[q] = _mm512_load_ps(tmp[q]);
    }
    for (int q = 0; q < W - 1; q++) {
        for (int l = 0; l < 16; l++) tmp[q][l] = a->st[(size_t)(c + l) * (W - 1) + q];
        win[q] = _mm512_load_ps(tmp[q]);
    }
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int t = 0; t < a->n; t++) {
        float *xp = a->x + (int64_t)t * a->ld + c;
        const __m512 xv = _mm512_loadu_ps(xp);
        __m512 acc = _mm512_setzero_ps();
        for (int q = 0; q < W - 1; q++) acc = _mm512_add_ps(acc, _mm512_mul_ps(wv[q], win[q]));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(wv[W - 1], xv));
        float e[16] __attribute__((aligned(64)));
        _mm512_store_ps(e, acc);
        for (int l = 0; l < 16; l++) e[l] = expf(-e[l]);
        _mm512_storeu_ps(xp, _mm512_div_ps(acc, _mm512_add_ps(one, _mm512_load_ps(e))));
        for (int q = 0; q + 1 < W - 1; q++) win[q] = win[q + 1];
        win[W - 2] = xv;
        if (a->trail) put_window(a->trail + (int64_t)t * a->trail_ld, c, win, W);
    }
    put_window(a->st, c, win, W);
}

int kn_kda_conv_avx512(const kn_kda_conv_args *a) {
    const int full = a->nc / 16 * 16;
    for (int c = 0; c < full; c += 16) switch (a->W) {
        case 2: conv_block(a, c, 2); break;
        case 3: conv_block(a, c, 3); break;
        case 4: conv_block(a, c, 4); break;
        default: return 0; /* other widths: the plain C form */
        }
    return full;
}
