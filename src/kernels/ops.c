/* ops.c — vector operations (see ops.h): plain C with a fixed order; on
 * AArch64 op_axpy runs as ops_neon.c's bit-identical NEON loop. */
#include "ops.h"
#include <math.h>
#include <stddef.h>
#include <string.h>

double op_sumsq(const float *x, int n) {
    /* eight partial sums (element i goes to i mod 8 while eight are left),
     * added in a fixed tree: one chain of dependent double adds was ~11 us
     * per 7168-vector, most of a step's host time between device calls */
    double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) p[k] += (double)x[i + k] * (double)x[i + k];
    for (; i < n; i++) p[0] += (double)x[i] * (double)x[i];
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

void op_rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = op_sumsq(x, n);
    float inv = (float)(1.0 / sqrt(ss / n + (double)eps));
    for (int i = 0; i < n; i++) out[i] = w ? w[i] * (x[i] * inv) : x[i] * inv;
}

float op_dot(const float *a, const float *b, int n) {
    /* four partial sums in a fixed order: deterministic and a little faster */
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

void op_axpy(float *y, float a, const float *x, int n) {
#if defined(__aarch64__)
    op_axpy_neon(y, a, x, n);
#else
    for (int i = 0; i < n; i++) y[i] += a * x[i];
#endif
}

void op_softmax(float *x, int n) {
    float m = x[0];
    for (int i = 1; i < n; i++) if (x[i] > m) m = x[i];
    double s = 0.0;
    for (int i = 0; i < n; i++) { x[i] = expf(x[i] - m); s += x[i]; }
    float inv = (float)(1.0 / s);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

float op_silu(float x) { return x / (1.0f + expf(-x)); }


void op_rope(float *x, int d, const float *c, const float *s, int interleaved) {
    int h = d / 2;
    for (int i = 0; i < h; i++) {
        int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + h;
        float x0 = x[a], x1 = x[b];
        x[a] = x0 * c[i] - x1 * s[i];
        x[b] = x1 * c[i] + x0 * s[i];
    }
}

void op_attn_res(const float *anchors, int na, const float *cur, const float *w, int H, float eps, float *out) {
    float score[na + 1];
    for (int j = 0; j <= na; j++) {
        const float *v = j < na ? anchors + (size_t)j * H : cur;
        double ss = op_sumsq(v, H);
        float inv = (float)(1.0 / sqrt(ss / H + (double)eps));
        score[j] = op_dot(v, w, H) * inv;
    }
    op_softmax(score, na + 1);
    memset(out, 0, (size_t)H * sizeof(float));
    for (int j = 0; j <= na; j++) op_axpy(out, score[j], j < na ? anchors + (size_t)j * H : cur, H);
}
