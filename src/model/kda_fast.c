/* kda_fast.c — kda_recur_head and kda_conv_channel (kda_core.c) for the CPU
 * engine, fast and bit-identical (see kda_fast.h).
 *
 * Owns: kda_recur_head_fast, kda_conv_fast. Refuses: allocation (the caller hands in the
 * decay scratch), threads, and any change of a value's operations: the
 * norms keep kda_core.c's double sums in index order (several tokens run
 * side by side, each in its own sum), the gates call the same libm functions
 * on the same fp32 values, and the state recurrence is kn_kda_recur, whose
 * every level equals kda_core.c's loops bit for bit, as kn_kda_conv's
 * equal kda_conv_channel's.
 *
 * Sections: norms of several tokens; gates; the short convolution; the head.
 */
#include "kda_fast.h"
#include "../kernels/ops.h"
#include <math.h>

/* ---- norms of several tokens ---- */

enum { TB = 4 }; /* tokens per group of sums */

/* ss[b] = op_sumsq(x_b, D), x_b = x + b * ld, for b < nb <= TB (kda_core.c's
 * l2norm and ops.c's rmsnorm take their sums from op_sumsq too). */
static void sumsq_tokens(const float *x, int64_t ld, int nb, int D, double *ss) {
    for (int b = 0; b < nb; b++) ss[b] = op_sumsq(x + b * ld, D);
}

/* x_t *= (float)(1 / sqrt(sum_i x_t[i]^2 + 1e-6)), then *= scale (when scale
 * != 1) for t < n, x_t = x + t * ld: kda_core.c's l2norm (and the q scaling
 * as a second rounding, as there). */
static void l2norm_tokens(float *x, int64_t ld, int n, int D, float scale) {
    for (int t0 = 0; t0 < n; t0 += TB) {
        const int nb = n - t0 < TB ? n - t0 : TB;
        double ss[TB];
        sumsq_tokens(x + t0 * ld, ld, nb, D, ss);
        for (int b = 0; b < nb; b++) {
            float *v = x + (t0 + b) * ld;
            const float inv = (float)(1.0 / sqrt(ss[b] + 1e-6));
            if (scale != 1.0f) /* two roundings, as kda_core.c's two passes */
                for (int i = 0; i < D; i++) v[i] = v[i] * inv * scale;
            else
                for (int i = 0; i < D; i++) v[i] *= inv;
        }
    }
}

/* o_t = op_rmsnorm(o_t, w, eps) * sigmoid(gate_t) for t < n (ops.c's
 * formula, its double sum from op_sumsq). */
static void out_norm_tokens(float *o, const float *gate, int64_t ld, int n, int D, const float *w, float eps) {
    for (int t0 = 0; t0 < n; t0 += TB) {
        const int nb = n - t0 < TB ? n - t0 : TB;
        double ss[TB];
        sumsq_tokens(o + t0 * ld, ld, nb, D, ss);
        for (int b = 0; b < nb; b++) {
            float *v = o + (t0 + b) * ld;
            const float *g = gate + (t0 + b) * ld;
            const float inv = (float)(1.0 / sqrt(ss[b] / D + (double)eps));
            for (int i = 0; i < D; i++) v[i] = w ? w[i] * (v[i] * inv) : v[i] * inv;
            for (int i = 0; i < D; i++) v[i] *= op_sigmoid(g[i]);
        }
    }
}

/* ---- gates ---- */

/* dec[d] = kda_decay of one token's channels. */
static void decay_token(const kda_shape *sh, const float *a, const float *dt_bias, const float *f, float *dec) {
    for (int d = 0; d < sh->D; d++) dec[d] = kda_decay(sh, a[d], f[d] + dt_bias[d]);
}

/* ---- the short convolution ---- */

void kda_conv_fast(kn_level lv, const kda_shape *sh, const kda_params *p, float *state, int which, int c0, int c1,
                   int n, const kda_io *io) {
    const int W = sh->W, P = sh->H * sh->D;
    float *x = which == 0 ? io->q : which == 1 ? io->k : io->v;
    const size_t st = ((size_t)which * P + c0) * (W - 1); /* this range's conv state, from the layer's start */
    kn_kda_conv_args a = {W, c1 - c0, n, x + c0, P, p->conv[which] + (size_t)c0 * W, state + st,
                          io->trail ? io->trail + st : NULL, kda_state_floats(sh)};
    kn_kda_conv(lv, &a);
}

/* ---- the head ---- */

void kda_recur_head_fast(kn_level lv, const kda_shape *sh, const kda_params *p, float *state, int h, int n,
                         const kda_io *io, float *decay) {
    if (n <= 0) return;
    const int D = sh->D, P = sh->H * D;
    const float qscale = 1.0f / sqrtf((float)D);
    const size_t hd = (size_t)h * D;
    float *S = state + (size_t)3 * P * (sh->W - 1) + hd * D;
    float beta[n];
    l2norm_tokens(io->q + hd, P, n, D, qscale);
    l2norm_tokens(io->k + hd, P, n, D, 1.0f);
    for (int t = 0; t < n; t++) {
        beta[t] = op_sigmoid(io->braw[(size_t)t * sh->H + h]);
        decay_token(sh, p->a + hd, p->dt_bias + hd, io->f + (size_t)t * P + hd, decay + (size_t)t * P + hd);
    }
    kn_kda_head a = {D, n, S, io->q + hd, io->k + hd, io->v + hd, decay + hd, P, beta, io->o + hd,
                     io->trail ? io->trail + (S - state) : NULL, kda_state_floats(sh)};
    kn_kda_recur(lv, &a);
    out_norm_tokens(io->o + hd, io->gate + hd, P, n, D, p->o_norm, sh->norm_eps);
}
