/* kda_core.c — the engine-free KDA math (see kda_core.h): the state size,
 * the short convolution of one channel, the recurrence of one head.
 *
 * Refuses: projections, threads, allocation (kda.c does those and calls in
 * here per channel and per head). Every operation is plain fp32 / double C
 * with a fixed order, so the engine's bits do not depend on how the pool
 * splits the work; this file is also the oracle of gpu_kda (gpu_kda.cu).
 *
 * Sections: state; the short convolution; the recurrence.
 */
#include "kda_core.h"
#include "../kernels/ops.h"
#include <math.h>
#include <string.h>

/* ---- state ---- */

/* Layout: conv q | conv k | conv v ([P][W-1] each) | S [H][D][D]. */
int64_t kda_state_floats(const kda_shape *sh) {
    int64_t P = (int64_t)sh->H * sh->D;
    return 3 * P * (sh->W - 1) + (int64_t)sh->H * sh->D * sh->D;
}

/* ---- the short convolution ---- */

void kda_conv_channel(const kda_shape *sh, const kda_params *p, float *state, int which, int c, int n,
                      const kda_io *io) {
    int W = sh->W, P = sh->H * sh->D;
    float *x = which == 0 ? io->q : which == 1 ? io->k : io->v;
    const float *w = p->conv[which] + (size_t)c * W;
    float *st = state + ((size_t)which * P + c) * (W - 1);
    float win[16]; /* sliding window, oldest first */
    for (int q = 0; q < W - 1; q++) win[q] = st[q];
    for (int t = 0; t < n; t++) {
        float *v = x + (size_t)t * P + c;
        win[W - 1] = *v;
        float acc = 0.0f;
        for (int q = 0; q < W; q++) acc += w[q] * win[q];
        *v = op_silu(acc);
        for (int q = 0; q < W - 1; q++) win[q] = win[q + 1];
        if (io->trail) memcpy(io->trail + (size_t)t * kda_state_floats(sh) + (st - state), win,
                              (size_t)(W - 1) * sizeof(float));
    }
    for (int q = 0; q < W - 1; q++) st[q] = win[q];
}

/* ---- the recurrence ---- */

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

float kda_decay(const kda_shape *sh, float a, float z) {
    float g = sh->has_lower_bound ? sh->lower_bound * op_sigmoid(a * z) : -a * softplus(z);
    return expf(g);
}

static void l2norm(float *x, int n) {
    double ss = op_sumsq(x, n);
    float inv = (float)(1.0 / sqrt(ss + 1e-6));
    for (int i = 0; i < n; i++) x[i] *= inv;
}

void kda_recur_head(const kda_shape *sh, const kda_params *p, float *state, int h, int n, const kda_io *io) {
    int D = sh->D, P = sh->H * D;
    float qscale = 1.0f / sqrtf((float)D);
    float *S = state + (size_t)3 * P * (sh->W - 1) + (size_t)h * D * D; /* S[kk][vv] */
    for (int t = 0; t < n; t++) {
        size_t off = (size_t)t * P + (size_t)h * D;
        float *q = io->q + off, *kk = io->k + off, *v = io->v + off, *o = io->o + off;
        const float *f = io->f + off;
        l2norm(q, D);
        l2norm(kk, D);
        for (int d = 0; d < D; d++) q[d] *= qscale;
        float beta = op_sigmoid(io->braw[(size_t)t * sh->H + h]);
        float u[D];
        /* two passes over S, each row once: decay it and take its share of
         * u = v - S^T k; then add beta k u^T to it and take its share of
         * o = S^T q (the same operations in the same order as four passes) */
        for (int e2 = 0; e2 < D; e2++) u[e2] = v[e2];
        for (int d = 0; d < D; d++) {
            float decay = kda_decay(sh, p->a[h * D + d], f[d] + p->dt_bias[h * D + d]);
            float *row = S + (size_t)d * D;
            for (int e2 = 0; e2 < D; e2++) row[e2] *= decay;
            op_axpy(u, -kk[d], row, D);
        }
        memset(o, 0, (size_t)D * sizeof(float));
        for (int d = 0; d < D; d++) {
            op_axpy(S + (size_t)d * D, beta * kk[d], u, D);
            op_axpy(o, q[d], S + (size_t)d * D, D);
        }
        /* gated RMSNorm of the head output */
        op_rmsnorm(o, o, p->o_norm, D, sh->norm_eps);
        const float *gt = io->gate + off;
        for (int e2 = 0; e2 < D; e2++) o[e2] *= op_sigmoid(gt[e2]);
        if (io->trail) memcpy(io->trail + (size_t)t * kda_state_floats(sh) + (S - state), S,
                              (size_t)D * D * sizeof(float));
    }
}
