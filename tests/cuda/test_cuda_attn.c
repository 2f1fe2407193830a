/* test_cuda_attn.c — the attention kernels (gpu_kda.cu, gpu_mla.cu,
 * gpu_attn_res.cu) against the engine's own CPU functions (suite
 * cuda_attn_). Built into build/run_cuda_tests; every test skips, saying
 * why, without a GPU.
 *
 * Oracles (linked from the engine: kda_core.o, mla_core.o, ops.o) and the
 * bounds checked (u = 2^-24; random data from a per-test seed; device
 * outputs poisoned with NaN bytes before each launch):
 *  - gpu_kda vs kda_conv_channel + kda_recur_head: per token t and head,
 *    ||o - o_cpu||_2 <= 4 (t + 1)(D + 16) u ||o_cpu||_2; per head
 *    ||S - S_cpu||_F <= 4 n (D + 16) u ||S_cpu||_F; the conv state bit-equal;
 *    q, k, v left as given; n one-token launches bit-equal (state and o) to
 *    one n-token launch (that one with a workspace: from 16 tokens the
 *    scan path, so k_kda and the scan path give the same bits). Both gates,
 *    K3-like shapes (D = 128, W = 4, n = 1 and a 17-token chunk), D = 16 ..
 *    256 (S in memory above 128), W = 1 and 16, the scan path at D = 16, 48,
 *    64, 128.
 *  - gpu_mla_write vs mla_write_row: c_kv within 2^-22 |ref|, k_pe exact
 *    without RoPE, rotated values within 2^-20 (|x_a| + |x_b|) mscale, rows
 *    outside pos .. pos+n-1 untouched, q_nope untouched.
 *  - gpu_mla_attend vs mla_attend_one and vs a float64 evaluation: with
 *    B = ((R + dr + 24) A + 2 L + 96) u M_c (gpu.h), |o - exact| <= B,
 *    |o_cpu - exact| <= B (the CPU meets it too), |o - o_cpu| <= 2B; an
 *    n-token launch bit-equal to n one-token launches; and
 *    with q = 0 and integer c_kv, o is the mean of rows 0..p within
 *    2^-23 |mean| (any skipped or repeated position shows). Shapes: R = 512,
 *    dr = 64, nh = 4 at pos 0, pos 37 n = 5, pos ~5000 (split over blocks,
 *    decode and a 17-token chunk); a small odd shape.
 *  - gpu_attn_res vs op_attn_res and a float64 evaluation (H = 7168,
 *    na = 0..3, n = 3): with B(m) = (2 (m + 8) max_j a_j + 2 na + 16) u V_d
 *    (gpu.h), |out - exact| <= B(ceil(H/256)), |out_cpu - exact| <=
 *    B(ceil(H/4)), |out - out_cpu| <= their sum; na = 0 is exactly cur; out
 *    aliasing cur gives the same bits.
 *  - gpu_res_norm (the residual step in one launch) vs gpu_add / gpu_copy,
 *    gpu_copy, gpu_attn_res and gpu_rmsnorm in turn: the same bits for
 *    h, the anchor written and xn (H = 7168 and 96, na = 0..3, with and
 *    without d, restart, an anchor out); refused (nothing written) for an
 *    unaligned row, H % 4 != 0 and na > 64.
 *  - gpu_mla_absorb / gpu_mla_lift vs float64 sums over the same bf16 kv_b:
 *    |y - exact| <= K u sum|w x|, K = dn (absorb), R/32 + 5 (lift); n = 1
 *    and 17; n > 32 and non-bf16 kv_b refused.
 *  - gpu_mla_absorb_tc / gpu_mla_lift_tc (tensor cores) vs float64 sums
 *    within gpu_matmul_tc's bf16 bound; the wgmma launch bit-equal to a head
 *    at a time on mma.sync; one token bit-equal to its row of 300 or 70.
 * Each test prints its largest error as a fraction of its bound.
 */
#include "../test.h"
#include "cuda_test_util.h"
#include "../../src/cuda/gpu.h"
#include "../../src/kernels/ops.h"
#include "../../src/model/kda_core.h"
#include "../../src/model/mla_core.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const double U = 0x1p-24;

/* ---- helpers ------------------------------------------------------------------ */

static float *hrand(size_t n, float lo, float hi, uint64_t *s) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = lo + (hi - lo) * 0.5f * (frand(s) + 1.0f);
    return x;
}

static float *dcopy(const float *h, size_t n) {
    float *d = gpu_malloc(n * sizeof(float));
    if (d && gpu_put(d, h, n * sizeof(float)) != DF_OK) {
        gpu_free(d);
        return NULL;
    }
    return d;
}

static float *hdup(const float *h, size_t n) {
    float *c = malloc(n * sizeof(float));
    memcpy(c, h, n * sizeof(float));
    return c;
}

static int poison(float *d, size_t n) { return gpu_fill(d, 0xff, n * sizeof(float)) == DF_OK; }

static void gpu_free_each(float *const *d, int n) {
    for (int i = 0; i < n; i++) gpu_free(d[i]);
}

/* ||a - b||_2 and ||b||_2 over n values spaced by stride */
static void norms(const float *a, const float *b, size_t n, size_t stride, double *diff, double *ref) {
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        double x = (double)a[i * stride] - b[i * stride];
        d += x * x;
        r += (double)b[i * stride] * b[i * stride];
    }
    *diff = sqrt(d);
    *ref = sqrt(r);
}

/* ---- KDA ---------------------------------------------------------------------- */

typedef struct {
    kda_shape sh;
    int n, P;
    int64_t SF;
    float *conv[3], *a, *dt_bias, *o_norm;            /* host parameters */
    float *q, *k, *v, *f, *braw, *gate, *state;       /* host inputs */
    float *dconv[3], *da, *ddt, *dnorm;               /* device copies */
    float *dq, *dk, *dv, *df, *db, *dg, *dstate, *do_;
    kda_params dp;
} kda_case;

static void kda_case_free(kda_case *c) {
    for (int i = 0; i < 3; i++) { free(c->conv[i]); gpu_free(c->dconv[i]); }
    free(c->a); free(c->dt_bias); free(c->o_norm); free(c->q); free(c->k); free(c->v); free(c->f);
    free(c->braw); free(c->gate); free(c->state);
    gpu_free(c->da); gpu_free(c->ddt); gpu_free(c->dnorm); gpu_free(c->dq); gpu_free(c->dk); gpu_free(c->dv);
    gpu_free(c->df); gpu_free(c->db); gpu_free(c->dg); gpu_free(c->dstate); gpu_free(c->do_);
}

static int kda_case_make(kda_case *c, int H, int D, int W, int lb, int n, const char *tag) {
    memset(c, 0, sizeof *c);
    uint64_t s = seed_of(tag);
    c->sh = (kda_shape){.hidden = 0, .H = H, .D = D, .W = W, .full_rank_gate = 1, .has_lower_bound = lb,
                        .lower_bound = -5.0f, .norm_eps = 1e-5f};
    c->n = n;
    c->P = H * D;
    c->SF = kda_state_floats(&c->sh);
    size_t P = (size_t)c->P, nP = (size_t)n * P;
    for (int i = 0; i < 3; i++) c->conv[i] = hrand(P * W, -0.5f, 0.5f, &s);
    c->a = hrand(P, -1.0f, 0.5f, &s); /* A_log, then exp(A_log) as kda_bind stores it */
    for (size_t i = 0; i < P; i++) c->a[i] = expf(c->a[i]);
    c->dt_bias = hrand(P, -0.5f, 0.5f, &s);
    c->o_norm = hrand((size_t)D, 0.8f, 1.2f, &s);
    c->q = hrand(nP, -2.0f, 2.0f, &s);
    c->k = hrand(nP, -2.0f, 2.0f, &s);
    c->v = hrand(nP, -1.0f, 1.0f, &s);
    c->f = hrand(nP, -1.0f, 1.0f, &s);
    c->braw = hrand((size_t)n * H, -2.0f, 2.0f, &s);
    c->gate = hrand(nP, -2.0f, 2.0f, &s);
    c->state = hrand((size_t)c->SF, -0.2f, 0.2f, &s);
    for (int64_t i = 0; i < 3 * (int64_t)P * (W - 1); i++) c->state[i] = frand(&s); /* raw conv inputs */
    for (int i = 0; i < 3; i++) c->dconv[i] = dcopy(c->conv[i], P * W);
    c->da = dcopy(c->a, P);
    c->ddt = dcopy(c->dt_bias, P);
    c->dnorm = dcopy(c->o_norm, (size_t)D);
    c->dq = dcopy(c->q, nP);
    c->dk = dcopy(c->k, nP);
    c->dv = dcopy(c->v, nP);
    c->df = dcopy(c->f, nP);
    c->db = dcopy(c->braw, (size_t)n * H);
    c->dg = dcopy(c->gate, nP);
    c->dstate = gpu_malloc((size_t)c->SF * sizeof(float));
    c->do_ = gpu_malloc(nP * sizeof(float));
    c->dp = (kda_params){{c->dconv[0], c->dconv[1], c->dconv[2]}, c->da, c->ddt, c->dnorm};
    return c->dconv[0] && c->dconv[1] && c->dconv[2] && c->da && c->ddt && c->dnorm && c->dq && c->dk && c->dv &&
           c->df && c->db && c->dg && c->dstate && c->do_;
}

/* The CPU step, as kda_forward runs it: every channel's conv, then every head. */
static void kda_cpu(const kda_case *c, float *state, float *o) {
    size_t nP = (size_t)c->n * c->P;
    float *q = hdup(c->q, nP), *k = hdup(c->k, nP), *v = hdup(c->v, nP);
    kda_params p = {{c->conv[0], c->conv[1], c->conv[2]}, c->a, c->dt_bias, c->o_norm};
    kda_io io = {q, k, v, c->f, c->braw, c->gate, o, NULL};
    for (int which = 0; which < 3; which++)
        for (int ch = 0; ch < c->P; ch++) kda_conv_channel(&c->sh, &p, state, which, ch, c->n, &io);
    for (int h = 0; h < c->sh.H; h++) kda_recur_head(&c->sh, &p, state, h, c->n, &io);
    free(q); free(k); free(v);
}

static void check_kda(int H, int D, int W, int lb, int n, const char *tag) {
    if (!need_gpu()) return;
    kda_case c;
    if (!kda_case_make(&c, H, D, W, lb, n, tag)) {
        kda_case_free(&c);
        REQUIRE(0, "%s: device allocation failed", tag);
    }
    const int P = c.P;
    const size_t nP = (size_t)n * P, SF = (size_t)c.SF, conv = (size_t)3 * P * (W - 1);
    float *st_cpu = hdup(c.state, SF), *o_cpu = malloc(nP * sizeof(float));
    float *st_gpu = malloc(SF * sizeof(float)), *o_gpu = malloc(nP * sizeof(float));
    float *st_one = malloc(SF * sizeof(float)), *o_one = malloc(nP * sizeof(float)), *qback = malloc(nP * sizeof(float));
    kda_cpu(&c, st_cpu, o_cpu);

    df_status st = gpu_put(c.dstate, c.state, SF * sizeof(float));
    if (st == DF_OK && !poison(c.do_, nP)) st = DF_ERR_IO;
    gpu_ws ws = {0};
    if (st == DF_OK) st = gpu_kda(&c.sh, &c.dp, c.dstate, n, c.dq, c.dk, c.dv, c.df, c.db, c.dg, c.do_, &ws, NULL);
    if (st == DF_OK) st = gpu_sync();
    gpu_ws_free(&ws);
    if (st == DF_OK) st = gpu_get(st_gpu, c.dstate, SF * sizeof(float));
    if (st == DF_OK) st = gpu_get(o_gpu, c.do_, nP * sizeof(float));
    if (st == DF_OK) st = gpu_get(qback, c.dq, nP * sizeof(float));
    CHECK(st == DF_OK, "%s: gpu_kda: status %d (%s)", tag, st, gpu_last_error());
    /* the same tokens one launch each, from the same state */
    df_status st1 = gpu_put(c.dstate, c.state, SF * sizeof(float));
    if (st1 == DF_OK && !poison(c.do_, nP)) st1 = DF_ERR_IO;
    for (int t = 0; t < n && st1 == DF_OK; t++) {
        size_t off = (size_t)t * P;
        st1 = gpu_kda(&c.sh, &c.dp, c.dstate, 1, c.dq + off, c.dk + off, c.dv + off, c.df + off, c.db + (size_t)t * H,
                      c.dg + off, c.do_ + off, NULL, NULL);
    }
    if (st1 == DF_OK) st1 = gpu_sync();
    if (st1 == DF_OK) st1 = gpu_get(st_one, c.dstate, SF * sizeof(float));
    if (st1 == DF_OK) st1 = gpu_get(o_one, c.do_, nP * sizeof(float));
    CHECK(st1 == DF_OK, "%s: one-token launches: status %d (%s)", tag, st1, gpu_last_error());
    if (st == DF_OK && st1 == DF_OK) {
        CHECK(memcmp(st_gpu, st_cpu, conv * sizeof(float)) == 0, "%s: conv state differs from the CPU's", tag);
        CHECK(memcmp(qback, c.q, nP * sizeof(float)) == 0, "%s: q was modified on the device", tag);
        CHECK(memcmp(st_one, st_gpu, SF * sizeof(float)) == 0, "%s: state after %d one-token launches != one %d-token launch",
              tag, n, n);
        CHECK(memcmp(o_one, o_gpu, nP * sizeof(float)) == 0, "%s: o of one-token launches != one %d-token launch", tag, n);
        double worst_o = 0, worst_s = 0;
        int bad = 0;
        for (int t = 0; t < n; t++)
            for (int h = 0; h < H; h++) {
                size_t off = (size_t)t * P + (size_t)h * D;
                double d, r;
                norms(o_gpu + off, o_cpu + off, (size_t)D, 1, &d, &r);
                double bound = 4.0 * (t + 1) * (D + 16) * U * r;
                if (!(d <= bound) && bad++ < 5) CHECK(0, "%s: o token %d head %d: |diff| %.3g, bound %.3g", tag, t, h, d, bound);
                if (bound > 0 && d / bound > worst_o) worst_o = d / bound;
            }
        for (int h = 0; h < H; h++) {
            size_t off = conv + (size_t)h * D * D;
            double d, r;
            norms(st_gpu + off, st_cpu + off, (size_t)D * D, 1, &d, &r);
            double bound = 4.0 * n * (D + 16) * U * r;
            if (!(d <= bound) && bad++ < 10) CHECK(0, "%s: S head %d: |diff|_F %.3g, bound %.3g", tag, h, d, bound);
            if (bound > 0 && d / bound > worst_s) worst_s = d / bound;
        }
        fprintf(stderr, "[%s: worst %.3g of the o bound, %.3g of the S bound] ", tag, worst_o, worst_s);
    }
    free(st_cpu); free(o_cpu); free(st_gpu); free(o_gpu); free(st_one); free(o_one); free(qback);
    kda_case_free(&c);
}

TEST(cuda_attn_kda_k3_decode) { check_kda(4, 128, 4, 1, 1, "kda-k3-n1"); }
TEST(cuda_attn_kda_k3_chunk) { check_kda(4, 128, 4, 1, 17, "kda-k3-n17"); }
TEST(cuda_attn_kda_linear_decode) { check_kda(2, 128, 4, 0, 1, "kda-linear-n1"); }
TEST(cuda_attn_kda_linear_chunk) { check_kda(8, 128, 4, 0, 17, "kda-linear-n17"); }
TEST(cuda_attn_kda_shapes) {
    if (!need_gpu()) return;
    check_kda(8, 64, 4, 1, 5, "kda-d64");
    check_kda(8, 64, 4, 1, 20, "kda-d64-scan");
    check_kda(3, 16, 1, 0, 4, "kda-d16-w1");
    check_kda(3, 16, 1, 0, 16, "kda-d16-w1-scan");
    check_kda(2, 48, 16, 1, 3, "kda-d48-w16");
    check_kda(2, 48, 16, 1, 18, "kda-d48-w16-scan");
    check_kda(2, 144, 3, 0, 3, "kda-d144");
    check_kda(2, 256, 4, 1, 5, "kda-d256");
}

TEST(cuda_attn_kda_refused) {
    if (!need_gpu()) return;
    kda_case c;
    REQUIRE(kda_case_make(&c, 2, 16, 4, 1, 1, "kda-refused"), "device allocation failed");
    REQUIRE(gpu_put(c.dstate, c.state, (size_t)c.SF * sizeof(float)) == DF_OK);
    REQUIRE(poison(c.do_, (size_t)c.P));
    kda_shape bad = c.sh;
    bad.D = 8;
    CHECK(gpu_kda(&bad, &c.dp, c.dstate, 1, c.dq, c.dk, c.dv, c.df, c.db, c.dg, c.do_, NULL, NULL) == DF_ERR_UNSUPPORTED);
    bad = c.sh;
    bad.W = 17;
    CHECK(gpu_kda(&bad, &c.dp, c.dstate, 1, c.dq, c.dk, c.dv, c.df, c.db, c.dg, c.do_, NULL, NULL) == DF_ERR_UNSUPPORTED);
    CHECK(gpu_kda(&c.sh, &c.dp, c.dstate, 0, c.dq, c.dk, c.dv, c.df, c.db, c.dg, c.do_, NULL, NULL) == DF_ERR_ARG);
    CHECK(gpu_kda(&c.sh, &c.dp, NULL, 1, c.dq, c.dk, c.dv, c.df, c.db, c.dg, c.do_, NULL, NULL) == DF_ERR_ARG);
    /* refused calls leave the state and the output as they were */
    float *st = malloc((size_t)c.SF * sizeof(float)), *o = malloc((size_t)c.P * sizeof(float));
    CHECK(gpu_get(st, c.dstate, (size_t)c.SF * sizeof(float)) == DF_OK &&
          memcmp(st, c.state, (size_t)c.SF * sizeof(float)) == 0, "state changed by a refused call");
    uint32_t nan = 0xffffffffu;
    int untouched = gpu_get(o, c.do_, (size_t)c.P * sizeof(float)) == DF_OK;
    for (int i = 0; untouched && i < c.P; i++) untouched = memcmp(o + i, &nan, 4) == 0;
    CHECK(untouched, "output written by a refused call");
    free(st); free(o);
    kda_case_free(&c);
}

/* ---- MLA cache rows ------------------------------------------------------------ */

static mla_shape mla_make(int nh, int R, int dr, int dn, int rope, int interleave, const float *inv_freq) {
    mla_shape sh;
    memset(&sh, 0, sizeof sh);
    sh.nh = nh;
    sh.R = R;
    sh.dr = dr;
    sh.dn = dn;
    sh.dv = dn;
    sh.dq = dn + dr;
    sh.use_rope = rope;
    sh.rope_interleave = interleave;
    sh.inv_freq = inv_freq;
    sh.rope_mscale = rope ? 1.1f : 1.0f;
    sh.softmax_scale = (float)(1.0 / sqrt((double)sh.dq));
    sh.latent_eps = 1e-6f;
    return sh;
}

static void check_mla_write(int nh, int R, int dr, int dn, int rope, int interleave, int pos, int n, const char *tag) {
    if (!need_gpu()) return;
    uint64_t s = seed_of(tag);
    float *inv_freq = malloc((size_t)(dr / 2 + 1) * sizeof(float));
    for (int i = 0; i < dr / 2; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / dr);
    mla_shape sh = mla_make(nh, R, dr, dn, rope, interleave, inv_freq);
    const size_t stride = (size_t)(R + dr), rows = (size_t)pos + n + 2, qn = (size_t)n * nh * sh.dq;
    float *kva = hrand((size_t)n * stride, -3.0f, 3.0f, &s), *wn = hrand((size_t)R, 0.5f, 1.5f, &s);
    float *q = hrand(qn, -2.0f, 2.0f, &s);
    float *cache_cpu = malloc(rows * stride * sizeof(float)), *q_cpu = hdup(q, qn);
    float *cache_gpu = malloc(rows * stride * sizeof(float)), *q_gpu = malloc(qn * sizeof(float));
    memset(cache_cpu, 0xff, rows * stride * sizeof(float));
    for (int t = 0; t < n; t++)
        mla_write_row(&sh, wn, kva + t * stride, pos + t, cache_cpu + (size_t)(pos + t) * stride,
                      q_cpu + (size_t)t * nh * sh.dq);
    float *dkva = dcopy(kva, (size_t)n * stride), *dwn = dcopy(wn, (size_t)R), *dq = dcopy(q, qn);
    float *dfreq = dcopy(inv_freq, (size_t)(dr / 2 + 1)), *dcache = gpu_malloc(rows * stride * sizeof(float));
    df_status st = dkva && dwn && dq && dfreq && dcache ? DF_OK : DF_ERR_NOMEM;
    if (st == DF_OK && !poison(dcache, rows * stride)) st = DF_ERR_IO;
    if (st == DF_OK) st = gpu_mla_write(&sh, dwn, dfreq, dkva, dcache, pos, n, dq, NULL);
    if (st == DF_OK) st = gpu_sync();
    if (st == DF_OK) st = gpu_get(cache_gpu, dcache, rows * stride * sizeof(float));
    if (st == DF_OK) st = gpu_get(q_gpu, dq, qn * sizeof(float));
    CHECK(st == DF_OK, "%s: gpu_mla_write: status %d (%s)", tag, st, gpu_last_error());
    if (st == DF_OK) {
        double worst = 0;
        int bad = 0, exact = 0, total = 0;
        CHECK(memcmp(cache_gpu, cache_cpu, (size_t)pos * stride * sizeof(float)) == 0, "%s: rows before pos written", tag);
        CHECK(memcmp(cache_gpu + (size_t)(pos + n) * stride, cache_cpu + (size_t)(pos + n) * stride,
                     2 * stride * sizeof(float)) == 0, "%s: rows after pos + n written", tag);
        for (int t = 0; t < n; t++) {
            const float *g = cache_gpu + (size_t)(pos + t) * stride, *c = cache_cpu + (size_t)(pos + t) * stride;
            for (int i = 0; i < R; i++) {
                double b = 0x1p-22 * fabs(c[i]);
                total++;
                exact += g[i] == c[i];
                if (!(fabs(g[i] - c[i]) <= b) && bad++ < 5) CHECK(0, "%s: t %d c_kv[%d]: gpu %.9g cpu %.9g", tag, t, i, g[i], c[i]);
                if (b > 0 && fabs(g[i] - c[i]) / b > worst) worst = fabs(g[i] - c[i]) / b;
            }
            /* rotated (or copied) vectors: k_pe (v = 0) and each head's q_pe; q_nope untouched */
            for (int v = 0; v <= nh; v++) {
                const float *x = v == 0 ? kva + t * stride + R : q + ((size_t)t * nh + v - 1) * sh.dq + dn;
                const float *yg = v == 0 ? g + R : q_gpu + ((size_t)t * nh + v - 1) * sh.dq + dn;
                const float *yc = v == 0 ? c + R : q_cpu + ((size_t)t * nh + v - 1) * sh.dq + dn;
                if (v > 0)
                    CHECK(memcmp(q_gpu + ((size_t)t * nh + v - 1) * sh.dq, q + ((size_t)t * nh + v - 1) * sh.dq,
                                 (size_t)dn * sizeof(float)) == 0, "%s: q_nope changed", tag);
                for (int i = 0; i < dr / 2; i++) {
                    int ia = interleave ? 2 * i : i, ib = interleave ? 2 * i + 1 : i + dr / 2;
                    double b = rope ? 0x1p-20 * (fabs(x[ia]) + fabs(x[ib])) * sh.rope_mscale : 0.0;
                    for (int k = 0; k < 2; k++) {
                        int e = k ? ib : ia;
                        double d = fabs((double)yg[e] - yc[e]);
                        if (!(d <= b) && bad++ < 10)
                            CHECK(0, "%s: t %d vector %d [%d]: gpu %.9g cpu %.9g bound %.3g", tag, t, v, e, yg[e], yc[e], b);
                        if (b > 0 && d / b > worst) worst = d / b;
                    }
                }
            }
        }
        fprintf(stderr, "[%s: worst %.3g of the bound; %d of %d c_kv bit-equal] ", tag, worst, exact, total);
    }
    gpu_free(dkva); gpu_free(dwn); gpu_free(dq); gpu_free(dfreq); gpu_free(dcache);
    free(inv_freq); free(kva); free(wn); free(q); free(cache_cpu); free(q_cpu); free(cache_gpu); free(q_gpu);
}

TEST(cuda_attn_mla_write_nope) { check_mla_write(4, 512, 64, 128, 0, 0, 37, 5, "mla-write-nope"); }
TEST(cuda_attn_mla_write_rope) {
    if (!need_gpu()) return;
    check_mla_write(4, 512, 64, 128, 1, 1, 37, 5, "mla-write-rope-interleaved");
    check_mla_write(3, 64, 32, 16, 1, 0, 0, 3, "mla-write-rope-halves");
    check_mla_write(2, 64, 64, 32, 1, 1, 70000, 2, "mla-write-rope-far"); /* large cosf / sinf arguments */
}

/* ---- MLA attention ------------------------------------------------------------- */

/* o over rows 0..p in float64 (the "exact" reference), plus A and M_c of the bound */
static void attend_exact(const mla_shape *sh, const float *cache, const float *ql, const float *qp, int p,
                         double *o, double *A, double *M) {
    const int R = sh->R, dk = sh->R + sh->dr;
    double *sc = malloc((size_t)(p + 1) * sizeof(double)), mx = -INFINITY, a = 0, sum = 0;
    for (int k = 0; k <= p; k++) {
        const float *c = cache + (size_t)k * dk;
        double d = 0, ad = 0;
        for (int i = 0; i < R; i++) { d += (double)ql[i] * c[i]; ad += fabs((double)ql[i] * c[i]); }
        for (int i = 0; i < sh->dr; i++) { d += (double)qp[i] * c[R + i]; ad += fabs((double)qp[i] * c[R + i]); }
        sc[k] = d * sh->softmax_scale;
        if (sc[k] > mx) mx = sc[k];
        if (ad * sh->softmax_scale > a) a = ad * sh->softmax_scale;
    }
    for (int i = 0; i < R; i++) { o[i] = 0; M[i] = 0; }
    for (int k = 0; k <= p; k++) {
        double w = exp(sc[k] - mx);
        sum += w;
        const float *c = cache + (size_t)k * dk;
        for (int i = 0; i < R; i++) {
            o[i] += w * c[i];
            if (fabs(c[i]) > M[i]) M[i] = fabs(c[i]);
        }
    }
    for (int i = 0; i < R; i++) o[i] /= sum;
    *A = a;
    free(sc);
}

/* zero_q: q = 0 and integer cache values, so o must be the exact mean. */
static void check_mla_attend(int nh, int R, int dr, int dn, int pos, int n, int zero_q, gpu_ws *ws, const char *tag) {
    uint64_t s = seed_of(tag);
    mla_shape sh = mla_make(nh, R, dr, dn, 0, 0, NULL);
    const int dk = R + dr, L = pos + n;
    const size_t Q = (size_t)nh * n, qn = (size_t)n * nh * sh.dq;
    float *cache = hrand((size_t)L * dk, -1.0f, 1.0f, &s), *q = hrand(qn, -1.0f, 1.0f, &s);
    float *qlat = hrand(Q * R, -1.0f, 1.0f, &s);
    if (zero_q) {
        for (size_t i = 0; i < (size_t)L * dk; i++) cache[i] = (float)(int)(rng_next(&s) % 17) - 8.0f;
        memset(q, 0, qn * sizeof(float));
        memset(qlat, 0, Q * R * sizeof(float));
    }
    float *o_gpu = malloc(Q * R * sizeof(float)), *o_cpu = malloc(Q * R * sizeof(float));
    float *sc = malloc((size_t)L * sizeof(float));
    double *ex = malloc((size_t)R * sizeof(double)), *M = malloc((size_t)R * sizeof(double));
    float *dcache = dcopy(cache, (size_t)L * dk), *dq = dcopy(q, qn), *dql = dcopy(qlat, Q * R);
    float *dout = gpu_malloc(Q * R * sizeof(float));
    df_status st = dcache && dq && dql && dout ? DF_OK : DF_ERR_NOMEM;
    if (st == DF_OK && !poison(dout, Q * R)) st = DF_ERR_IO;
    if (st == DF_OK) st = gpu_mla_attend(&sh, dcache, dq, dql, pos, n, dout, ws, NULL);
    if (st == DF_OK) st = gpu_sync();
    if (st == DF_OK) st = gpu_get(o_gpu, dout, Q * R * sizeof(float));
    CHECK(st == DF_OK, "%s: gpu_mla_attend: status %d (%s)", tag, st, gpu_last_error());
    if (st == DF_OK) {
        double worst_ex = 0, worst_cpu = 0, worst_self = 0;
        int bad = 0;
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < n; t++) {
                const size_t qi = (size_t)h * n + t;
                const int p = pos + t;
                const float *ql = qlat + qi * R, *qp = q + ((size_t)t * nh + h) * sh.dq + dn;
                mla_attend_one(&sh, cache, ql, qp, p, sc, o_cpu + qi * R);
                double A;
                attend_exact(&sh, cache, ql, qp, p, ex, &A, M);
                for (int c = 0; c < R; c++) {
                    double g = o_gpu[qi * R + c], cp = o_cpu[qi * R + c];
                    if (zero_q) { /* exact mean, correctly rounded */
                        double b = 0x1p-23 * fabs(ex[c]) + 1e-30;
                        if (!(fabs(g - ex[c]) <= b) && bad++ < 5)
                            CHECK(0, "%s: h %d t %d c %d: gpu %.9g, mean of rows 0..%d %.9g", tag, h, t, c, g, p, ex[c]);
                        if (fabs(g - ex[c]) / b > worst_ex) worst_ex = fabs(g - ex[c]) / b;
                        continue;
                    }
                    double B = ((dk + 24.0) * A + 2.0 * (p + 1) + 96) * U * M[c];
                    if (!(fabs(g - ex[c]) <= B) && bad++ < 5)
                        CHECK(0, "%s: h %d t %d c %d: gpu %.9g exact %.9g bound %.3g", tag, h, t, c, g, ex[c], B);
                    if (!(fabs(cp - ex[c]) <= B) && bad++ < 5)
                        CHECK(0, "%s: h %d t %d c %d: cpu %.9g exact %.9g bound %.3g", tag, h, t, c, cp, ex[c], B);
                    if (!(fabs(g - cp) <= 2 * B) && bad++ < 5)
                        CHECK(0, "%s: h %d t %d c %d: gpu %.9g cpu %.9g bound %.3g", tag, h, t, c, g, cp, 2 * B);
                    if (B > 0) {
                        if (fabs(g - ex[c]) / B > worst_ex) worst_ex = fabs(g - ex[c]) / B;
                        if (fabs(g - cp) / (2 * B) > worst_cpu) worst_cpu = fabs(g - cp) / (2 * B);
                        if (fabs(cp - ex[c]) / B > worst_self) worst_self = fabs(cp - ex[c]) / B;
                    }
                }
            }
        if (n > 1) { /* each token alone: the same bits (splits from positions alone) */
            const size_t hr = (size_t)nh * R;
            float *ql1 = malloc(hr * sizeof(float)), *o1 = malloc(hr * sizeof(float));
            float *dql1 = gpu_malloc(hr * sizeof(float)), *do1 = gpu_malloc(hr * sizeof(float));
            df_status s1 = ql1 && o1 && dql1 && do1 ? DF_OK : DF_ERR_NOMEM;
            int differ = 0;
            for (int t = 0; s1 == DF_OK && t < n; t++) {
                for (int h = 0; h < nh; h++) memcpy(ql1 + (size_t)h * R, qlat + ((size_t)h * n + t) * R, R * sizeof(float));
                s1 = gpu_put(dql1, ql1, hr * sizeof(float));
                if (s1 == DF_OK) s1 = gpu_mla_attend(&sh, dcache, dq + (size_t)t * nh * sh.dq, dql1, pos + t, 1, do1, ws, NULL);
                if (s1 == DF_OK) s1 = gpu_sync();
                if (s1 == DF_OK) s1 = gpu_get(o1, do1, hr * sizeof(float));
                for (int h = 0; s1 == DF_OK && h < nh; h++)
                    differ += memcmp(o1 + (size_t)h * R, o_gpu + ((size_t)h * n + t) * R, R * sizeof(float)) != 0;
            }
            CHECK(s1 == DF_OK && differ == 0, "%s: %d (head, token) rows differ from one-token launches (status %d)", tag,
                  differ, s1);
            gpu_free(dql1); gpu_free(do1); free(ql1); free(o1);
        }
        if (zero_q) fprintf(stderr, "[%s: worst %.3g of 2^-23 |mean|] ", tag, worst_ex);
        else
            fprintf(stderr, "[%s: worst %.3g of the bound vs exact, %.3g vs cpu (cpu: %.3g)] ", tag, worst_ex,
                    worst_cpu, worst_self);
    }
    gpu_free(dcache); gpu_free(dq); gpu_free(dql); gpu_free(dout);
    free(cache); free(q); free(qlat); free(o_gpu); free(o_cpu); free(sc); free(ex); free(M);
}

TEST(cuda_attn_mla_short) {
    if (!need_gpu()) return;
    gpu_ws ws = {0};
    check_mla_attend(4, 512, 64, 128, 0, 1, 0, &ws, "mla-pos0");
    check_mla_attend(4, 512, 64, 128, 37, 5, 0, &ws, "mla-pos37-n5");
    check_mla_attend(3, 96, 32, 16, 300, 4, 0, &ws, "mla-small");
    check_mla_attend(2, 64, 0, 16, 9, 2, 0, &ws, "mla-no-rope-dims");
    gpu_ws_free(&ws);
}

TEST(cuda_attn_mla_long) {
    if (!need_gpu()) return;
    gpu_ws ws = {0};
    check_mla_attend(4, 512, 64, 128, 5000, 1, 0, &ws, "mla-ctx5000");
    check_mla_attend(4, 512, 64, 128, 4990, 17, 0, &ws, "mla-ctx5000-n17");
    check_mla_attend(16, 512, 64, 128, 4990, 32, 0, &ws, "mla-ctx5000-n32-h16"); /* a prompt piece's many queries */
    gpu_ws_free(&ws);
}

/* Prompts with enough queries for two a warp (MLA_WIDE_Q), against one-token
 * launches (one a warp): K3's widths over two splits, narrow rows (columns
 * past R), and R = 1024 (four columns a thread, one query a warp). */
TEST(cuda_attn_mla_prompt) {
    if (!need_gpu()) return;
    gpu_ws ws = {0};
    check_mla_attend(16, 512, 64, 128, 0, 300, 0, &ws, "mla-prompt300-h16");
    check_mla_attend(64, 96, 32, 16, 200, 70, 0, &ws, "mla-prompt70-h64-narrow");
    check_mla_attend(16, 1024, 64, 64, 3, 260, 0, &ws, "mla-prompt260-r1024");
    check_mla_attend(16, 512, 64, 128, 0, 290, 1, &ws, "mla-prompt-mean");
    /* one of the engine's 32-row pieces of a K3 prompt (96 heads: 3072
     * queries, the threshold), across the split at 256 */
    check_mla_attend(96, 512, 64, 128, 230, 32, 0, &ws, "mla-prompt32-h96-k3-piece");
    gpu_ws_free(&ws);
}

/* Every position counts once: q = 0 gives equal scores, integer rows give exact sums. */
TEST(cuda_attn_mla_coverage) {
    if (!need_gpu()) return;
    gpu_ws ws = {0};
    check_mla_attend(4, 512, 64, 128, 37, 5, 1, &ws, "mla-mean-short");
    check_mla_attend(4, 512, 64, 128, 4999, 3, 1, &ws, "mla-mean-5000");
    check_mla_attend(1, 64, 4, 16, 70000, 1, 1, &ws, "mla-mean-70000");
    gpu_ws_free(&ws);
}

TEST(cuda_attn_mla_refused) {
    if (!need_gpu()) return;
    gpu_ws ws = {0};
    float *d = gpu_malloc(4096);
    REQUIRE(d != NULL);
    mla_shape sh = mla_make(1, 1028, 64, 16, 0, 0, NULL);
    CHECK(gpu_mla_attend(&sh, d, d, d, 0, 1, d, &ws, NULL) == DF_ERR_UNSUPPORTED, "R > 1024");
    sh = mla_make(1, 510, 64, 16, 0, 0, NULL);
    CHECK(gpu_mla_attend(&sh, d, d, d, 0, 1, d, &ws, NULL) == DF_ERR_UNSUPPORTED, "R %% 4");
    sh = mla_make(1, 512, 64, 16, 0, 0, NULL);
    CHECK(gpu_mla_attend(&sh, d, d, d, 0, 1, d, NULL, NULL) == DF_ERR_ARG, "no workspace");
    CHECK(gpu_mla_attend(&sh, d, d, d, -1, 1, d, &ws, NULL) == DF_ERR_ARG, "pos < 0");
    CHECK(ws.buf == NULL, "a refused call grew the workspace");
    gpu_free(d);
    gpu_ws_free(&ws);
}

/* ---- attention residuals ------------------------------------------------------- */

TEST(cuda_attn_res) {
    if (!need_gpu()) return;
    enum { H = 7168, N = 3, A = 4 };
    uint64_t s = seed_of("attn-res");
    float *anc = malloc((size_t)N * A * H * sizeof(float)), *cur = malloc((size_t)N * H * sizeof(float));
    float *w = hrand(H, -0.02f, 0.02f, &s), *ref = malloc((size_t)N * H * sizeof(float));
    float *out = malloc((size_t)N * H * sizeof(float)), *out2 = malloc((size_t)N * H * sizeof(float));
    for (int t = 0; t < N; t++) {
        for (int j = 0; j < A; j++)
            for (int d = 0; d < H; d++) anc[((size_t)t * A + j) * H + d] = (1.0f + j) * frand(&s);
        for (int d = 0; d < H; d++) cur[(size_t)t * H + d] = 2.5f * frand(&s);
    }
    float *danc = dcopy(anc, (size_t)N * A * H), *dcur = dcopy(cur, (size_t)N * H), *dw = dcopy(w, H);
    float *dout = gpu_malloc((size_t)N * H * sizeof(float));
    REQUIRE(danc && dcur && dw && dout, "device allocation failed");
    const float eps = 1e-6f;
    double worst = 0, worst_cpu = 0;
    int bad = 0;
    for (int na = 0; na <= 3; na++) {
        for (int t = 0; t < N; t++)
            op_attn_res(anc + (size_t)t * A * H, na, cur + (size_t)t * H, w, H, eps, ref + (size_t)t * H);
        df_status st = poison(dout, (size_t)N * H) ? DF_OK : DF_ERR_IO;
        if (st == DF_OK) st = gpu_attn_res(danc, (int64_t)A * H, na, dcur, dw, H, eps, N, dout, NULL);
        if (st == DF_OK) st = gpu_sync();
        if (st == DF_OK) st = gpu_get(out, dout, (size_t)N * H * sizeof(float));
        CHECK(st == DF_OK, "na %d: gpu_attn_res: status %d (%s)", na, st, gpu_last_error());
        if (st != DF_OK) continue;
        if (na == 0) CHECK(memcmp(out, cur, (size_t)N * H * sizeof(float)) == 0, "na 0: out != cur");
        for (int t = 0; t < N; t++) {
            const float *at = anc + (size_t)t * A * H, *ct = cur + (size_t)t * H;
            double amax = 0, sc[4];
            for (int j = 0; j <= na; j++) {
                const float *v = j < na ? at + (size_t)j * H : ct;
                double ss = 0, ad = 0, dt = 0;
                for (int d = 0; d < H; d++) {
                    ss += (double)v[d] * v[d];
                    ad += fabs((double)v[d] * w[d]);
                    dt += (double)v[d] * w[d];
                }
                double r = sqrt(ss / H + eps);
                sc[j] = dt / r;
                if (ad / r > amax) amax = ad / r;
            }
            for (int d = 0; d < H; d++) {
                double vmax = 0, ex = 0, z = 0, mx = -INFINITY;
                for (int j = 0; j <= na; j++) {
                    double v = fabs(j < na ? at[(size_t)j * H + d] : ct[d]);
                    if (v > vmax) vmax = v;
                    if (sc[j] > mx) mx = sc[j];
                }
                for (int j = 0; j <= na; j++) {
                    double e = exp(sc[j] - mx);
                    z += e;
                    ex += e * (j < na ? at[(size_t)j * H + d] : ct[d]);
                }
                ex /= z;
                double bg = (2.0 * ((H + 255) / 256 + 8) * amax + 2.0 * na + 16) * U * vmax;
                double bc = (2.0 * ((H + 3) / 4 + 8) * amax + 2.0 * na + 16) * U * vmax;
                double g = out[(size_t)t * H + d], c = ref[(size_t)t * H + d];
                if (!(fabs(g - ex) <= bg) && bad++ < 5)
                    CHECK(0, "na %d t %d d %d: gpu %.9g exact %.9g bound %.3g", na, t, d, g, ex, bg);
                if (!(fabs(c - ex) <= bc) && bad++ < 5)
                    CHECK(0, "na %d t %d d %d: cpu %.9g exact %.9g bound %.3g", na, t, d, c, ex, bc);
                if (!(fabs(g - c) <= bg + bc) && bad++ < 5)
                    CHECK(0, "na %d t %d d %d: gpu %.9g cpu %.9g bound %.3g", na, t, d, g, c, bg + bc);
                if (bg > 0 && fabs(g - ex) / bg > worst) worst = fabs(g - ex) / bg;
                if (bg + bc > 0 && fabs(g - c) / (bg + bc) > worst_cpu) worst_cpu = fabs(g - c) / (bg + bc);
            }
        }
        /* in place over cur (a scratch copy of it): the same bits */
        float *dtmp = dcopy(cur, (size_t)N * H);
        REQUIRE(dtmp != NULL);
        st = gpu_attn_res(danc, (int64_t)A * H, na, dtmp, dw, H, eps, N, dtmp, NULL);
        if (st == DF_OK) st = gpu_get(out2, dtmp, (size_t)N * H * sizeof(float));
        CHECK(st == DF_OK && memcmp(out2, out, (size_t)N * H * sizeof(float)) == 0, "na %d: in place differs", na);
        gpu_free(dtmp);
    }
    CHECK(gpu_attn_res(danc, (int64_t)A * H, 65, dcur, dw, H, eps, N, dout, NULL) == DF_ERR_UNSUPPORTED);
    fprintf(stderr, "[worst %.3g of the bound vs exact, %.3g vs cpu] ", worst, worst_cpu);
    gpu_free(danc); gpu_free(dcur); gpu_free(dw); gpu_free(dout);
    free(anc); free(cur); free(w); free(ref); free(out); free(out2);
}

/* ---- the residual step in one launch -------------------------------------------- */

static void check_res_norm(int H) {
    enum { N = 3, A = 5 };
    uint64_t s = seed_of(H > 100 ? "res-norm-7168" : "res-norm-96");
    const size_t nh = (size_t)N * H, na_all = (size_t)N * A * H;
    float *anc = hrand(na_all, -2.0f, 2.0f, &s), *h = hrand(nh, -3.0f, 3.0f, &s), *d = hrand(nh, -1.0f, 1.0f, &s);
    float *pw = hrand(H, -0.05f, 0.05f, &s), *nw = hrand(H, 0.5f, 1.5f, &s);
    float *a1 = malloc(na_all * sizeof(float)), *a2 = malloc(na_all * sizeof(float));
    float *h1 = malloc(nh * sizeof(float)), *h2 = malloc(nh * sizeof(float));
    float *x1 = malloc(nh * sizeof(float)), *x2 = malloc(nh * sizeof(float));
    float *danc = gpu_malloc(na_all * sizeof(float)), *dh = gpu_malloc(nh * sizeof(float));
    float *dd = dcopy(d, nh), *dpw = dcopy(pw, H), *dnw = dcopy(nw, H);
    float *dxn = gpu_malloc(nh * sizeof(float)), *dx = gpu_malloc(nh * sizeof(float));
    REQUIRE(a1 && a2 && h1 && h2 && x1 && x2 && danc && dh && dd && dpw && dnw && dxn && dx);
    for (int na = 0; na <= 3; na++)
        for (int mode = 0; mode < 3; mode++) /* no d, h + d, restart h = d */
            for (int ao = 0; ao < 2; ao++) {
                const float *dv = mode ? dd : NULL;
                float *aout = ao ? danc + (size_t)na * H : NULL;
                /* the steps in turn */
                df_status st = gpu_put(danc, anc, na_all * sizeof(float));
                if (st == DF_OK) st = gpu_put(dh, h, nh * sizeof(float));
                if (st == DF_OK && mode == 1) st = gpu_add(dh, dd, (int64_t)nh, NULL);
                if (st == DF_OK && mode == 2) st = gpu_copy(dh, dd, nh * sizeof(float), NULL);
                const float *xin = dh;
                if (st == DF_OK && na > 0) {
                    st = gpu_attn_res(danc, (int64_t)A * H, na, dh, dpw, H, 1e-6f, N, dx, NULL);
                    xin = dx;
                }
                for (int t = 0; st == DF_OK && ao && t < N; t++)
                    st = gpu_copy(aout + (size_t)t * A * H, dh + (size_t)t * H, (size_t)H * sizeof(float), NULL);
                if (st == DF_OK) st = gpu_rmsnorm(dxn, xin, dnw, N, H, 1e-6f, NULL);
                if (st == DF_OK) st = gpu_get(h1, dh, nh * sizeof(float));
                if (st == DF_OK) st = gpu_get(a1, danc, na_all * sizeof(float));
                if (st == DF_OK) st = gpu_get(x1, dxn, nh * sizeof(float));
                /* in one launch */
                if (st == DF_OK) st = gpu_put(danc, anc, na_all * sizeof(float));
                if (st == DF_OK) st = gpu_put(dh, h, nh * sizeof(float));
                if (st == DF_OK) st = poison(dxn, nh) ? DF_OK : DF_ERR_IO;
                if (st == DF_OK)
                    st = gpu_res_norm(dxn, dh, dv, mode == 2, aout, danc, (int64_t)A * H, na, dpw, dnw, H, 1e-6f, N,
                                      NULL);
                if (st == DF_OK) st = gpu_get(h2, dh, nh * sizeof(float));
                if (st == DF_OK) st = gpu_get(a2, danc, na_all * sizeof(float));
                if (st == DF_OK) st = gpu_get(x2, dxn, nh * sizeof(float));
                CHECK(st == DF_OK, "H %d na %d mode %d: status %d (%s)", H, na, mode, st, gpu_last_error());
                if (st != DF_OK) continue;
                CHECK(memcmp(h1, h2, nh * sizeof(float)) == 0, "H %d na %d mode %d anchor %d: h differs", H, na, mode,
                      ao);
                CHECK(memcmp(a1, a2, na_all * sizeof(float)) == 0, "H %d na %d mode %d anchor %d: anchors differ", H,
                      na, mode, ao);
                CHECK(memcmp(x1, x2, nh * sizeof(float)) == 0, "H %d na %d mode %d anchor %d: xn differs", H, na,
                      mode, ao);
            }
    /* refused, nothing written: an unaligned row, too many anchors */
    REQUIRE(poison(dxn, nh));
    CHECK(gpu_res_norm(dxn + 1, dh, dd, 0, NULL, danc, (int64_t)A * H, 1, dpw, dnw, H, 1e-6f, 1, NULL) ==
          DF_ERR_UNSUPPORTED);
    CHECK(gpu_res_norm(dxn, dh, dd, 0, NULL, danc, (int64_t)65 * H, 65, dpw, dnw, H, 1e-6f, 1, NULL) ==
          DF_ERR_UNSUPPORTED);
    CHECK(gpu_res_norm(dxn, dh, dd, 0, NULL, danc, (int64_t)A * H, 1, dpw, dnw, H - 1, 1e-6f, 1, NULL) ==
          DF_ERR_UNSUPPORTED);
    CHECK(gpu_get(x1, dxn, nh * sizeof(float)) == DF_OK);
    int untouched = 1;
    for (size_t i = 0; i < nh; i++) untouched &= x1[i] != x1[i]; /* still NaN */
    CHECK(untouched, "a refused call wrote");
    gpu_free(danc); gpu_free(dh); gpu_free(dd); gpu_free(dpw); gpu_free(dnw); gpu_free(dxn); gpu_free(dx);
    free(anc); free(h); free(d); free(pw); free(nw); free(a1); free(a2); free(h1); free(h2); free(x1); free(x2);
}

TEST(cuda_res_norm) {
    if (!need_gpu()) return;
    check_res_norm(7168);
    check_res_norm(96);
}

/* ---- MLA absorbed products ------------------------------------------------------ */

/* gpu_mla_absorb / gpu_mla_lift against float64 sums over the same bf16
 * kv_b: |y - exact| <= K u sum|w x| with K = dn (absorb) and R/32 + 5
 * (lift), gpu.h's bounds; n = 1 and a 17-token chunk, bf16 and row-int8
 * (the int8 spine's kv_b: q times its row scale); a refused type (fp8) and
 * n > 32; each token's lift alone bit-equal to its row of the n-token lift. */
static void check_mla_products(int nh, int dn, int dv, int R, int n, int i8, const char *tag) {
    uint64_t s = seed_of(tag);
    const int dr = 64, dq = dn + dr;
    const int64_t rows = (int64_t)nh * (dn + dv);
    /* bf16, or row-int8 (the int8 spine); wv: the weights as the kernels see them */
    uint16_t *wb = malloc((size_t)rows * R * sizeof(uint16_t));
    int8_t *w8 = malloc((size_t)rows * R);
    float *wsc = malloc((size_t)rows * sizeof(float)), *wv = malloc((size_t)rows * R * sizeof(float));
    for (int64_t i = 0; i < rows; i++) wsc[i] = ldexpf(1.0f + 0.25f * frand(&s), -10);
    for (int64_t i = 0; i < rows * R; i++) {
        float f = frand(&s) * 0.1f;
        uint32_t u;
        memcpy(&u, &f, 4);
        wb[i] = (uint16_t)(u >> 16);
        w8[i] = (int8_t)((int)(f * 1270.0f));
        u = (uint32_t)wb[i] << 16;
        memcpy(&wv[i], &u, 4);
        if (i8) wv[i] = (float)w8[i] * wsc[i / R];
    }
    df_weight w = {.type = i8 ? WT_I8_ROW : WT_BF16, .rows = rows, .cols = R, .data = i8 ? (void *)w8 : (void *)wb,
                   .scale = i8 ? wsc : NULL};
    gpu_weight g;
    char err[DF_ERRMSG];
    REQUIRE(gpu_weight_upload(&w, &g, err) == DF_OK, "%s", err);
    mla_shape sh = {0, nh, dn, dr, dv, dq, R, 0, 0, 0, NULL, 1.0f, 1.0f, 1e-6f};
    float *q = hrand((size_t)n * nh * dq, -1, 1, &s), *olat = hrand((size_t)nh * n * R, -1, 1, &s);
    float *dq_ = dcopy(q, (size_t)n * nh * dq), *dol = dcopy(olat, (size_t)nh * n * R);
    size_t nlat = (size_t)nh * n * R, nat = (size_t)n * nh * dv;
    float *dql = gpu_malloc(nlat * sizeof(float)), *dat = gpu_malloc(nat * sizeof(float));
    REQUIRE(dq_ && dol && dql && dat, "device memory");
    REQUIRE(poison(dql, nlat) && poison(dat, nat), "poison");
    CHECK(gpu_mla_absorb(&g, &sh, dq_, n, dql, NULL) == DF_OK && gpu_mla_lift(&g, &sh, dol, n, dat, NULL) == DF_OK &&
              gpu_sync() == DF_OK,
          "%s: launch: %s", tag, gpu_last_error());
    float *ql = malloc(nlat * sizeof(float)), *at = malloc(nat * sizeof(float));
    REQUIRE(gpu_get(ql, dql, nlat * sizeof(float)) == DF_OK && gpu_get(at, dat, nat * sizeof(float)) == DF_OK, "get");
    double worst_a = 0, worst_l = 0;
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < n; t++) {
            for (int r = 0; r < R; r++) { /* absorb */
                double ex = 0, mag = 0;
                for (int d = 0; d < dn; d++) {
                    float wf = wv[((int64_t)h * (dn + dv) + d) * R + r];
                    double p = (double)q[((size_t)t * nh + h) * dq + d] * wf;
                    ex += p;
                    mag += fabs(p);
                }
                double got = ql[((size_t)h * n + t) * R + r], bound = dn * U * mag + 1e-30;
                if (!(fabs(got - ex) <= bound)) worst_a = INFINITY;
                else worst_a = fmax(worst_a, fabs(got - ex) / bound);
            }
            for (int v = 0; v < dv; v++) { /* lift */
                double ex = 0, mag = 0;
                for (int r = 0; r < R; r++) {
                    float wf = wv[((int64_t)h * (dn + dv) + dn + v) * R + r];
                    double p = (double)wf * olat[((size_t)h * n + t) * R + r];
                    ex += p;
                    mag += fabs(p);
                }
                double got = at[(size_t)t * nh * dv + (size_t)h * dv + v], bound = (R / 32 + 5) * U * mag + 1e-30;
                if (!(fabs(got - ex) <= bound)) worst_l = INFINITY;
                else worst_l = fmax(worst_l, fabs(got - ex) / bound);
            }
        }
    CHECK(worst_a <= 1 && worst_l <= 1, "%s: worst absorb %.3g, lift %.3g of the bound", tag, worst_a, worst_l);
    fprintf(stderr, "[%s: worst absorb %.3g, lift %.3g of the bound] ", tag, worst_a, worst_l);
    /* the lift of each token alone (the one-token kernel) equals its row of the n-token lift, bit for bit */
    if (n > 1) {
        float *o1 = malloc((size_t)nh * R * sizeof(float)), *a1 = malloc((size_t)nh * dv * sizeof(float));
        float *do1 = gpu_malloc((size_t)nh * R * sizeof(float)), *da1 = gpu_malloc((size_t)nh * dv * sizeof(float));
        REQUIRE(o1 && a1 && do1 && da1);
        const int ts[3] = {0, n / 2, n - 1};
        for (int k = 0; k < 3; k++) {
            for (int h = 0; h < nh; h++) memcpy(o1 + (size_t)h * R, olat + ((size_t)h * n + ts[k]) * R, (size_t)R * 4);
            REQUIRE(gpu_put(do1, o1, (size_t)nh * R * sizeof(float)) == DF_OK);
            CHECK(gpu_mla_lift(&g, &sh, do1, 1, da1, NULL) == DF_OK &&
                      gpu_get(a1, da1, (size_t)nh * dv * sizeof(float)) == DF_OK,
                  "%s: one-token lift: %s", tag, gpu_last_error());
            CHECK(memcmp(a1, at + (size_t)ts[k] * nh * dv, (size_t)nh * dv * sizeof(float)) == 0,
                  "%s: token %d's lift alone differs from its row of n = %d", tag, ts[k], n);
        }
        gpu_free(do1);
        gpu_free(da1);
        free(o1);
        free(a1);
    }
    /* refused: n > 32, a type other than bf16 */
    CHECK(gpu_mla_absorb(&g, &sh, dq_, 33, dql, NULL) == DF_ERR_UNSUPPORTED, "%s: n = 33 must be refused", tag);
    gpu_weight g8 = g;
    g8.type = WT_FP8_BLOCK;
    CHECK(!gpu_mla_products_take(&g8) && gpu_mla_lift(&g8, &sh, dol, n, dat, NULL) == DF_ERR_UNSUPPORTED,
          "%s: fp8 kv_b must be refused", tag);
    gpu_weight_free(&g);
    gpu_free_each((float *[]){dq_, dol, dql, dat}, 4);
    free(wb);
    free(w8);
    free(wsc);
    free(wv);
    free(q);
    free(olat);
    free(ql);
    free(at);
}

/* gpu_mla_absorb_tc / gpu_mla_lift_tc (kv_b's rows on the tensor cores)
 * against float64 sums over the same bf16 kv_b within gpu_matmul_tc's bf16
 * bound, (cols + 64) 2^-24 S + 2^-21 S + 2^-38 max|x| sum|w| (S = sum|w x|,
 * cols = dn for absorb, R for lift); the wgmma blocks (one launch for all
 * heads, where present) bit-equal to a head at a time on the mma.sync
 * blocks; token 0 alone bit-equal to its row of the n-token products; a
 * row-int8 kv_b and a dn off 64 refused. */
static void check_mla_products_tc(int nh, int dn, int dv, int R, int n, const char *tag) {
    uint64_t s = seed_of(tag);
    const int dr = 64, dq = dn + dr;
    const int64_t rows = (int64_t)nh * (dn + dv);
    uint16_t *wb = malloc((size_t)rows * R * sizeof(uint16_t));
    float *wv = malloc((size_t)rows * R * sizeof(float));
    for (int64_t i = 0; i < rows * R; i++) {
        float f = frand(&s) * 0.1f;
        uint32_t u;
        memcpy(&u, &f, 4);
        wb[i] = (uint16_t)(u >> 16);
        u = (uint32_t)wb[i] << 16;
        memcpy(&wv[i], &u, 4);
    }
    df_weight w = {.type = WT_BF16, .rows = rows, .cols = R, .data = wb};
    gpu_weight g;
    char err[DF_ERRMSG];
    REQUIRE(gpu_weight_upload(&w, &g, err) == DF_OK, "%s", err);
    mla_shape sh = {0, nh, dn, dr, dv, dq, R, 0, 0, 0, NULL, 1.0f, 1.0f, 1e-6f};
    float *q = hrand((size_t)n * nh * dq, -1, 1, &s), *olat = hrand((size_t)nh * n * R, -1, 1, &s);
    for (size_t i = 0; i < (size_t)n * nh * dq; i += 7) q[i] = ldexpf(q[i], -30); /* small and large together */
    float *dq_ = dcopy(q, (size_t)n * nh * dq), *dol = dcopy(olat, (size_t)nh * n * R);
    const size_t nlat = (size_t)nh * n * R, nat = (size_t)n * nh * dv;
    float *ql[2], *at[2];
    gpu_ws ws[2];
    memset(ws, 0, sizeof ws);
    ws[0].bf16_tc_rows = ws[1].bf16_tc_rows = 1;
    ws[0].bf16_wg = 1;  /* one launch for all heads where the wgmma blocks run */
    ws[1].bf16_wg = -1; /* a head at a time, mma.sync */
    const int wg = gpu_ws_wg(&ws[0]) > 0;
    float *dql = gpu_malloc(nlat * sizeof(float)), *dat = gpu_malloc(nat * sizeof(float));
    REQUIRE(dq_ && dol && dql && dat && gpu_mla_products_tc_take(&g, &sh), "device memory, shape");
    for (int k = 0; k < 2; k++) {
        REQUIRE(poison(dql, nlat) && poison(dat, nat), "poison");
        CHECK(gpu_mla_absorb_tc(&g, &sh, dq_, n, dql, &ws[k], NULL) == DF_OK &&
                  gpu_mla_lift_tc(&g, &sh, dol, n, dat, &ws[k], NULL) == DF_OK && gpu_sync() == DF_OK,
              "%s: launch %d: %s", tag, k, gpu_last_error());
        ql[k] = malloc(nlat * sizeof(float));
        at[k] = malloc(nat * sizeof(float));
        REQUIRE(gpu_get(ql[k], dql, nlat * sizeof(float)) == DF_OK && gpu_get(at[k], dat, nat * sizeof(float)) == DF_OK);
    }
    CHECK(!memcmp(ql[0], ql[1], nlat * 4) && !memcmp(at[0], at[1], nat * 4),
          "%s: the wgmma launch and a head at a time differ", tag);
    double worst_a = 0, worst_l = 0;
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < n; t++) {
            double mx = 0;
            for (int d = 0; d < dn; d++) mx = fmax(mx, fabs(q[((size_t)t * nh + h) * dq + d]));
            for (int r = 0; r < R; r++) { /* absorb: cols dn */
                double ex = 0, mag = 0, sw = 0;
                for (int d = 0; d < dn; d++) {
                    const float wf = wv[((int64_t)h * (dn + dv) + d) * R + r];
                    const double p = (double)q[((size_t)t * nh + h) * dq + d] * wf;
                    ex += p;
                    mag += fabs(p);
                    sw += fabs(wf);
                }
                const double got = ql[0][((size_t)h * n + t) * R + r];
                const double bound = ((dn + 64) * U + 0x1p-21) * mag + 0x1p-38 * mx * sw + 1e-37;
                worst_a = !(fabs(got - ex) <= bound) ? INFINITY : fmax(worst_a, fabs(got - ex) / bound);
            }
            mx = 0;
            for (int r = 0; r < R; r++) mx = fmax(mx, fabs(olat[((size_t)h * n + t) * R + r]));
            for (int v = 0; v < dv; v++) { /* lift: cols R */
                double ex = 0, mag = 0, sw = 0;
                for (int r = 0; r < R; r++) {
                    const float wf = wv[((int64_t)h * (dn + dv) + dn + v) * R + r];
                    const double p = (double)wf * olat[((size_t)h * n + t) * R + r];
                    ex += p;
                    mag += fabs(p);
                    sw += fabs(wf);
                }
                const double got = at[0][(size_t)t * nh * dv + (size_t)h * dv + v];
                const double bound = ((R + 64) * U + 0x1p-21) * mag + 0x1p-38 * mx * sw + 1e-37;
                worst_l = !(fabs(got - ex) <= bound) ? INFINITY : fmax(worst_l, fabs(got - ex) / bound);
            }
        }
    CHECK(worst_a <= 1 && worst_l <= 1, "%s: worst absorb %.3g, lift %.3g of the bound", tag, worst_a, worst_l);
    fprintf(stderr, "[%s (%s): worst absorb %.3g, lift %.3g of the bound] ", tag,
            wg ? "wgmma and mma.sync" : "mma.sync", worst_a, worst_l);
    if (n > 1) { /* token 0 alone: q's first row, olat's row 0 of each head */
        float *o1 = malloc((size_t)nh * R * sizeof(float)), *a1 = malloc((size_t)nh * dv * sizeof(float));
        float *l1 = malloc((size_t)nh * R * sizeof(float));
        for (int h = 0; h < nh; h++) memcpy(o1 + (size_t)h * R, olat + (size_t)h * n * R, (size_t)R * 4);
        float *do1 = dcopy(o1, (size_t)nh * R), *dq1 = dcopy(q, (size_t)nh * dq);
        float *da1 = gpu_malloc((size_t)nh * dv * sizeof(float)), *dl1 = gpu_malloc((size_t)nh * R * sizeof(float));
        REQUIRE(do1 && dq1 && da1 && dl1);
        CHECK(gpu_mla_absorb_tc(&g, &sh, dq1, 1, dl1, &ws[0], NULL) == DF_OK &&
                  gpu_mla_lift_tc(&g, &sh, do1, 1, da1, &ws[0], NULL) == DF_OK &&
                  gpu_get(a1, da1, (size_t)nh * dv * sizeof(float)) == DF_OK &&
                  gpu_get(l1, dl1, (size_t)nh * R * sizeof(float)) == DF_OK,
              "%s: one token: %s", tag, gpu_last_error());
        int same = !memcmp(a1, at[0], (size_t)dv * 4);
        for (int h = 0; h < nh; h++) same = same && !memcmp(l1 + (size_t)h * R, ql[0] + (size_t)h * n * R, (size_t)R * 4);
        for (int h = 1; h < nh; h++) same = same && !memcmp(a1 + (size_t)h * dv, at[0] + (size_t)h * dv, (size_t)dv * 4);
        CHECK(same, "%s: token 0 alone differs from its row of n = %d", tag, n);
        gpu_free(do1);
        gpu_free(dq1);
        gpu_free(da1);
        gpu_free(dl1);
        free(o1);
        free(a1);
        free(l1);
    }
    /* refused: row-int8 kv_b, dn off 64 */
    gpu_weight g8 = g;
    g8.type = WT_I8_ROW;
    mla_shape odd = sh;
    odd.dn = dn - 16;
    odd.dv = dv + 16;
    CHECK(gpu_mla_absorb_tc(&g8, &sh, dq_, n, dql, &ws[0], NULL) == DF_ERR_UNSUPPORTED &&
              gpu_mla_lift_tc(&g, &odd, dol, n, dat, &ws[0], NULL) == DF_ERR_UNSUPPORTED,
          "%s: int8 kv_b and dn %% 64 != 0 must be refused", tag);
    for (int k = 0; k < 2; k++) {
        gpu_ws_free(&ws[k]);
        free(ql[k]);
        free(at[k]);
    }
    gpu_weight_free(&g);
    gpu_free_each((float *[]){dq_, dol, dql, dat}, 4);
    free(wb);
    free(wv);
    free(q);
    free(olat);
}

TEST(cuda_attn_mla_products_tc) {
    if (!need_gpu()) return;
    check_mla_products_tc(3, 64, 64, 128, 1, "mla-products-tc-n1");
    check_mla_products_tc(4, 128, 128, 512, 300, "mla-products-tc-n300");
    check_mla_products_tc(3, 64, 40, 192, 70, "mla-products-tc-dv40-n70");
}

TEST(cuda_attn_mla_products) {
    if (!need_gpu()) return;
    check_mla_products(4, 128, 128, 512, 1, 0, "mla-products-n1");
    check_mla_products(3, 48, 40, 96, 17, 0, "mla-products-n17");
    check_mla_products(4, 128, 128, 512, 1, 1, "mla-products-i8-n1");
    check_mla_products(3, 48, 40, 96, 17, 1, "mla-products-i8-n17");
    check_mla_products(2, 128, 128, 512, 32, 0, "mla-products-n32");
    check_mla_products(2, 16, 6, 64, 9, 0, "mla-products-dv6-n9"); /* dv % 4 != 0: a row a warp */
}
