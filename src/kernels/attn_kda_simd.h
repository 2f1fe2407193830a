/* attn_kda_simd.h — the KDA kernels' body, written once for every x86 level.
 *
 * Owns: nothing by itself; attn_kda_avx2.c and attn_kda_avx512.c define the
 * vector type and operations below, then include this file, which defines
 * KDA_RECUR (kn_kda_recur's level form) and KDA_CONV (kn_kda_conv's).
 *   KV, KMASK     vector of KL floats, a lane mask for the last, partial vector
 *   KNV_MAX       vectors per block of columns (what the registers hold)
 *   K_ZERO K_SET1 K_ADD K_MUL K_DIV K_LOADU K_STOREU K_LOADA K_STOREA
 *   K_MASKLOAD K_MASKSTORE K_MASK_ALL K_MASK_TAIL(tail)
 * Only separate multiplies and adds (never FMA), each lane doing exactly the
 * scalar forms' operations in their order (kernels.h), so every level gives
 * the same bits.
 *
 * Recurrence, why blocks of columns: the columns of S are independent (u[e]
 * and o[e] read column e only), so a block of up to KL x KNV_MAX columns
 * runs all n tokens before the next block starts; its D x block floats stay
 * in L1 for the whole chunk, and u, the next token's u and o live in
 * registers. Each token visits the block's rows once: its update of S and its
 * output are fused with the next token's decay and u (per element the same
 * sequence as two passes per token). The last block of a D that is not a
 * multiple of KL loads and stores its last vector under a mask (the lanes
 * past D are zero and never written back).
 */

/* ---- recurrence ---- */

AI KV ld(const float *p, int last, KMASK m) { return last ? K_MASKLOAD(p, m) : K_LOADU(p); }
AI void st(float *p, KV x, int last, KMASK m) {
    if (last) K_MASKSTORE(p, m, x);
    else K_STOREU(p, x);
}

/* Rows of S, columns [c0, c0 + KL nv), for token t's second half (row +=
 * (beta k[d]) * u; o += q[d] * row) and, when fuse, token t+1's first half
 * in the same visit of the row (row *= decay'[d]; un += (-k'[d]) * row):
 * each element still sees the same operations in the same order. */
AI void rows(const kn_kda_head *a, float *S, int64_t t, const int nv, const int masked, KMASK m,
             const KV *u, KV *o, KV *un, const int fuse) {
    const int D = a->D;
    const int64_t off = t * a->ld, off1 = off + a->ld;
    const float *q = a->q + off, *k = a->k + off, beta = a->beta[t];
    const float *k1 = fuse ? a->k + off1 : NULL, *dec1 = fuse ? a->decay + off1 : NULL;
    float *tr = a->trail ? a->trail + t * a->trail_ld + (S - a->S) : NULL;
    for (int d = 0; d < D; d++) {
        float *row = S + (size_t)d * D;
        const KV bk = K_SET1(beta * k[d]), qd = K_SET1(q[d]);
        KV dc = K_ZERO(), nk = K_ZERO();
        if (fuse) dc = K_SET1(dec1[d]), nk = K_SET1(-k1[d]);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) {
            const int last = masked && j == nv - 1;
            KV r = K_ADD(ld(row + KL * j, last, m), K_MUL(bk, u[j]));
            if (tr) st(tr + (size_t)d * D + KL * j, r, last, m);
            o[j] = K_ADD(o[j], K_MUL(qd, r));
            if (fuse) {
                r = K_MUL(r, dc);
                un[j] = K_ADD(un[j], K_MUL(nk, r));
            }
            st(row + KL * j, r, last, m);
        }
    }
}

/* Columns [c0, c0 + KL nv) of S (the last vector masked by m when masked)
 * through all n tokens: token 0's first half (decay, u) alone, then for each
 * token its second half fused with the next token's first half. */
AI void block(const kn_kda_head *a, int c0, const int nv, const int masked, KMASK m) {
    const int D = a->D;
    float *S = a->S + c0;
    KV u[KNV_MAX], un[KNV_MAX], o[KNV_MAX];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < nv; j++) u[j] = ld(a->v + c0 + KL * j, masked && j == nv - 1, m);
    for (int d = 0; d < D; d++) { /* token 0: row *= decay[d]; u += (-k[d]) * row */
        float *row = S + (size_t)d * D;
        const KV dc = K_SET1(a->decay[d]), nk = K_SET1(-a->k[d]);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) {
            const int last = masked && j == nv - 1;
            KV r = K_MUL(ld(row + KL * j, last, m), dc);
            st(row + KL * j, r, last, m);
            u[j] = K_ADD(u[j], K_MUL(nk, r));
        }
    }
    for (int64_t t = 0; t < a->n; t++) {
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) o[j] = K_ZERO();
        if (t + 1 < a->n) {
            const float *v1 = a->v + (t + 1) * a->ld + c0;
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nv; j++) un[j] = ld(v1 + KL * j, masked && j == nv - 1, m);
            rows(a, S, t, nv, masked, m, u, o, un, 1);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < nv; j++) u[j] = un[j];
        } else {
            rows(a, S, t, nv, masked, m, u, o, un, 0);
        }
        float *out = a->o + t * a->ld + c0;
        _Pragma("GCC unroll 4")
        for (int j = 0; j < nv; j++) st(out + KL * j, o[j], masked && j == nv - 1, m);
    }
}

void KDA_RECUR(const kn_kda_head *a) {
    const int D = a->D;
    int c0 = 0;
    for (; c0 + KL * KNV_MAX <= D; c0 += KL * KNV_MAX) block(a, c0, KNV_MAX, 0, K_MASK_ALL);
    const int rest = D - c0;
    if (!rest) return;
    const int nv = (rest + KL - 1) / KL, tail = rest % KL;
    const KMASK m = K_MASK_TAIL(tail); /* lanes below tail (all when tail is 0) */
    switch (nv) { /* compile-time vector counts; masked only where the tail is partial */
    case 1: tail ? block(a, c0, 1, 1, m) : block(a, c0, 1, 0, m); break;
    case 2: tail ? block(a, c0, 2, 1, m) : block(a, c0, 2, 0, m); break;
#if KNV_MAX > 3
    case 3: tail ? block(a, c0, 3, 1, m) : block(a, c0, 3, 0, m); break;
    default: tail ? block(a, c0, 4, 1, m) : block(a, c0, 4, 0, m); break;
#else
    default: tail ? block(a, c0, 3, 1, m) : block(a, c0, 3, 0, m); break;
#endif
    }
}

/* ---- the short convolution ---- */

/* dst[(c + l) * (W - 1) + q] = lane l of win[q]: the [channel][W-1] layout
 * of the state and the trail. */
AI void put_window(float *dst, int c, const KV *win, const int W) {
    float tmp[3][KL] __attribute__((aligned(64)));
    for (int q = 0; q < W - 1; q++) K_STOREA(tmp[q], win[q]);
    for (int l = 0; l < KL; l++)
        for (int q = 0; q < W - 1; q++) dst[(size_t)(c + l) * (W - 1) + q] = tmp[q][l];
}

/* Channels [c, c + KL) for a compile-time W <= 4: kn_kda_conv's operations,
 * lane l being channel c + l (expf called per lane, as op_silu does). */
AI void conv_block(const kn_kda_conv_args *a, int c, const int W) {
    KV wv[4], win[3];
    float tmp[4][KL] __attribute__((aligned(64)));
    for (int q = 0; q < W; q++) {
        for (int l = 0; l < KL; l++) tmp[q][l] = a->w[(size_t)(c + l) * W + q];
        wv[q] = K_LOADA(tmp[q]);
    }
    for (int q = 0; q < W - 1; q++) {
        for (int l = 0; l < KL; l++) tmp[q][l] = a->st[(size_t)(c + l) * (W - 1) + q];
        win[q] = K_LOADA(tmp[q]);
    }
    const KV one = K_SET1(1.0f);
    for (int t = 0; t < a->n; t++) {
        float *xp = a->x + (int64_t)t * a->ld + c;
        const KV xv = K_LOADU(xp);
        KV acc = K_ZERO();
        for (int q = 0; q < W - 1; q++) acc = K_ADD(acc, K_MUL(wv[q], win[q]));
        acc = K_ADD(acc, K_MUL(wv[W - 1], xv));
        float e[KL] __attribute__((aligned(64)));
        K_STOREA(e, acc);
        for (int l = 0; l < KL; l++) e[l] = expf(-e[l]);
        K_STOREU(xp, K_DIV(acc, K_ADD(one, K_LOADA(e))));
        for (int q = 0; q + 1 < W - 1; q++) win[q] = win[q + 1];
        win[W - 2] = xv;
        if (a->trail) put_window(a->trail + (int64_t)t * a->trail_ld, c, win, W);
    }
    put_window(a->st, c, win, W);
}

int KDA_CONV(const kn_kda_conv_args *a) {
    const int full = a->nc / KL * KL;
    for (int c = 0; c < full; c += KL) switch (a->W) {
        case 2: conv_block(a, c, 2); break;
        case 3: conv_block(a, c, 3); break;
        case 4: conv_block(a, c, 4); break;
        default: return 0; /* other widths: the plain C form */
        }
    return full;
}
