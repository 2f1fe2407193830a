/* attn_kda.c — the KDA kernels of kernels.h (the delta-rule recurrence of
 * one head, kn_kda_recur; the short convolution, kn_kda_conv): the level
 * dispatch and the plain C forms (KN_SCALAR).
 *
 * Owns: kn_kda_recur, kn_kda_conv. The scalar forms are kda_core.c's loops
 * (the oracle: kda_recur_head with the per-token preparation, norms and
 * gates, left to the caller; kda_conv_channel); attn_kda_avx2.c /
 * attn_kda_avx512.c / attn_kda_neon.c run the same per-element operations on
 * 8 / 16 / 4 columns or channels at once, so every level returns the same
 * bits (tests/test_kda_fast.c checks it).
 * Refuses: allocation beyond one row on the stack, ISA-specific code (this
 * file is compiled without -m flags), and any reordering of a sum.
 *
 * Sections: recurrence, scalar form; convolution, scalar form; dispatch.
 */
#include "kernels.h"
#include "ops.h"
#include <string.h>

/* ---- recurrence, scalar form ---- */

static void recur_scalar(const kn_kda_head *a) {
    const int D = a->D;
    float u[D];
    for (int t = 0; t < a->n; t++) {
        const int64_t off = (int64_t)t * a->ld;
        const float *q = a->q + off, *k = a->k + off, *v = a->v + off, *dec = a->decay + off;
        float *o = a->o + off;
        /* pass 1: decay each row and take its share of u = v - S^T k */
        memcpy(u, v, (size_t)D * sizeof(float));
        for (int d = 0; d < D; d++) {
            float *row = a->S + (size_t)d * D;
            for (int e = 0; e < D; e++) row[e] *= dec[d];
            op_axpy(u, -k[d], row, D);
        }
        /* pass 2: S += beta k u^T, and o = S^T q */
        memset(o, 0, (size_t)D * sizeof(float));
        for (int d = 0; d < D; d++) {
            float *row = a->S + (size_t)d * D;
            op_axpy(row, a->beta[t] * k[d], u, D);
            op_axpy(o, q[d], row, D);
        }
        if (a->trail) memcpy(a->trail + (int64_t)t * a->trail_ld, a->S, (size_t)D * D * sizeof(float));
    }
}

/* ---- convolution, scalar form ---- */

/* Channels [c0, nc): kda_conv_channel's loop. */
static void conv_scalar(const kn_kda_conv_args *a, int c0) {
    const int W = a->W;
    for (int c = c0; c < a->nc; c++) {
        const float *w = a->w + (size_t)c * W;
        float *st = a->st + (size_t)c * (W - 1);
        float win[16]; /* sliding window, oldest first */
        for (int q = 0; q < W - 1; q++) win[q] = st[q];
        for (int t = 0; t < a->n; t++) {
            float *v = a->x + (int64_t)t * a->ld + c;
            win[W - 1] = *v;
            float acc = 0.0f;
            for (int q = 0; q < W; q++) acc += w[q] * win[q];
            *v = op_silu(acc);
            for (int q = 0; q < W - 1; q++) win[q] = win[q + 1];
            if (a->trail)
                memcpy(a->trail + (int64_t)t * a->trail_ld + (size_t)c * (W - 1), win, (size_t)(W - 1) * sizeof(float));
        }
        for (int q = 0; q < W - 1; q++) st[q] = win[q];
    }
}

/* ---- dispatch ---- */

void kn_kda_recur(kn_level lv, const kn_kda_head *a) {
    if (a->n <= 0 || a->D <= 0) return;
    if (!kn_level_available(lv)) lv = kn_detect(); /* never run instructions the CPU lacks */
#if defined(__x86_64__) || defined(__i386__)
    if (lv >= KN_AVX512) { kn_kda_recur_avx512(a); return; }
    if (lv >= KN_AVX2) { kn_kda_recur_avx2(a); return; }
#elif defined(__aarch64__)
    if (lv == KN_NEON) { kn_kda_recur_neon(a); return; }
#endif
    recur_scalar(a);
}

void kn_kda_conv(kn_level lv, const kn_kda_conv_args *a) {
    if (a->n <= 0 || a->nc <= 0) return;
    if (!kn_level_available(lv)) lv = kn_detect();
    int done = 0;
#if defined(__x86_64__) || defined(__i386__)
    if (lv >= KN_AVX512) done = kn_kda_conv_avx512(a);
    else if (lv >= KN_AVX2) done = kn_kda_conv_avx2(a);
#endif
    conv_scalar(a, done);
}
