/* test_kda_fast.c — the CPU engine's KDA recurrence (kda_recur_head_fast,
 * kn_kda_recur at every level) against kda_core.c's kda_recur_head, bit for
 * bit.
 *
 * Every level this CPU runs (scalar, AVX2, AVX-512 on x86; scalar, NEON on
 * AArch64) on random layers: D = 128 (the release's head dim) and small or
 * odd D (vector tails and masked lanes: 1, 5, 8, 17, 24, 40), several heads,
 * n = 1..33 tokens, with and without the gate's lower bound, with and
 * without a trail, from a random state and then again from the state the
 * first call left. The outputs, the state, the trail and q, k (normalised in
 * place) must all equal the reference's bytes.
 */
#include "test.h"
#include "../src/kernels/kernels.h"
#include "../src/model/kda_core.h"
#include "../src/model/kda_fast.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}
static float frand(uint64_t *s, float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(rng_next(s) >> 11) * 0x1p-53);
}
static float *rvec(uint64_t *s, size_t n, float lo, float hi) {
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = frand(s, lo, hi);
    return x;
}
static float *dup(const float *x, size_t n) {
    float *y = malloc(n * sizeof *y);
    memcpy(y, x, n * sizeof *y);
    return y;
}

/* One layer's inputs; run() copies them, so every level starts from the same bytes. */
typedef struct {
    kda_shape sh;
    kda_params p;
    int n;
    float *q, *k, *v, *f, *braw, *gate, *state;
} layer;

static layer make_layer(uint64_t *s, int H, int D, int n, int lb) {
    layer L = {0};
    L.sh = (kda_shape){0, H, D, 4, 1, lb, -5.0f, 1e-5f};
    L.n = n;
    size_t P = (size_t)H * D, NP = (size_t)n * P;
    float *a = malloc(P * sizeof *a);
    for (int h = 0; h < H; h++) {
        float ah = frand(s, 0.2f, 3.0f);
        for (int d = 0; d < D; d++) a[h * D + d] = ah;
    }
    L.p = (kda_params){{NULL, NULL, NULL}, a, rvec(s, P, -2, 2), rvec(s, (size_t)D, 0.5f, 1.5f)};
    L.q = rvec(s, NP, -1, 1), L.k = rvec(s, NP, -1, 1), L.v = rvec(s, NP, -1, 1);
    L.f = rvec(s, NP, -3, 3), L.braw = rvec(s, (size_t)n * H, -3, 3), L.gate = rvec(s, NP, -3, 3);
    L.state = rvec(s, (size_t)kda_state_floats(&L.sh), -0.5f, 0.5f);
    return L;
}

static void free_layer(layer *L) {
    free((void *)L->p.a), free((void *)L->p.dt_bias), free((void *)L->p.o_norm);
    free(L->q), free(L->k), free(L->v), free(L->f), free(L->braw), free(L->gate), free(L->state);
}

/* The outputs of one run: o, the state after, the trail, q and k after. */
typedef struct {
    float *o, *state, *trail, *q, *k;
} result;

/* lv < 0: the reference (kda_recur_head); else kda_recur_head_fast at lv.
 * Runs L's n tokens from L's state, then (when n > 1) the same tokens' inputs
 * again from the state that left, as a second chunk. */
static result run(const layer *L, int lv, int trail) {
    const kda_shape *sh = &L->sh;
    size_t P = (size_t)sh->H * sh->D, NP = (size_t)L->n * P, SF = (size_t)kda_state_floats(sh);
    result r = {calloc(NP, sizeof(float)), dup(L->state, SF), trail ? calloc((size_t)L->n * SF, sizeof(float)) : NULL,
                dup(L->q, NP), dup(L->k, NP)};
    float *decay = malloc(NP * sizeof *decay);
    for (int pass = 0; pass < (L->n > 1 ? 2 : 1); pass++) {
        float *v = dup(L->v, NP);
        if (pass) { /* a second chunk from the state the first left */
            free(r.q), free(r.k);
            r.q = dup(L->q, NP), r.k = dup(L->k, NP);
        }
        kda_io io = {r.q, r.k, v, L->f, L->braw, L->gate, r.o, r.trail};
        for (int h = 0; h < sh->H; h++) {
            if (lv < 0) kda_recur_head(sh, &L->p, r.state, h, L->n, &io);
            else kda_recur_head_fast((kn_level)lv, sh, &L->p, r.state, h, L->n, &io, decay);
        }
        free(v);
    }
    free(decay);
    return r;
}

static void free_result(result *r) { free(r->o), free(r->state), free(r->trail), free(r->q), free(r->k); }

static int same(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

static void check_layer(const layer *L, const char *what) {
    const kda_shape *sh = &L->sh;
    size_t NP = (size_t)L->n * sh->H * sh->D, SF = (size_t)kda_state_floats(sh);
    for (int trail = 0; trail <= 1; trail++) {
        result ref = run(L, -1, trail);
        for (int lv = KN_SCALAR; lv <= KN_NEON; lv++) {
            if (!kn_level_available((kn_level)lv)) continue;
            result got = run(L, lv, trail);
            CHECK(same(got.o, ref.o, NP), "%s %s trail %d: outputs differ", what, kn_level_name((kn_level)lv), trail);
            CHECK(same(got.state, ref.state, SF), "%s %s trail %d: states differ", what, kn_level_name((kn_level)lv),
                  trail);
            CHECK(same(got.q, ref.q, NP) && same(got.k, ref.k, NP), "%s %s trail %d: normalised q, k differ", what,
                  kn_level_name((kn_level)lv), trail);
            if (trail)
                CHECK(same(got.trail, ref.trail, (size_t)L->n * SF), "%s %s: trails differ", what,
                      kn_level_name((kn_level)lv));
            free_result(&got);
        }
        free_result(&ref);
    }
}

TEST(kda_fast_bit_identical_small_d) {
    static const int Ds[] = {1, 5, 8, 17, 24, 40};
    static const int ns[] = {1, 2, 3, 7, 16, 33};
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < sizeof Ds / sizeof *Ds; i++)
        for (size_t j = 0; j < sizeof ns / sizeof *ns; j++)
            for (int lb = 0; lb <= 1; lb++) {
                layer L = make_layer(&s, 3, Ds[i], ns[j], lb);
                char what[64];
                snprintf(what, sizeof what, "D %d n %d lb %d", Ds[i], ns[j], lb);
                check_layer(&L, what);
                free_layer(&L);
            }
}

TEST(kda_fast_bit_identical_d128) {
    static const int ns[] = {1, 5, 32, 33};
    uint64_t s = 0x2545f4914f6cdd1dull;
    for (size_t j = 0; j < sizeof ns / sizeof *ns; j++)
        for (int lb = 0; lb <= 1; lb++) {
            layer L = make_layer(&s, 2, 128, ns[j], lb);
            char what[64];
            snprintf(what, sizeof what, "D 128 n %d lb %d", ns[j], lb);
            check_layer(&L, what);
            free_layer(&L);
        }
}

/* The kernel alone: a level the CPU lacks runs as the best one it has, and
 * n = 0 leaves everything untouched. */
TEST(kda_fast_kernel_edges) {
    uint64_t s = 7;
    const int D = 24;
    float *S = rvec(&s, (size_t)D * D, -1, 1), *S0 = dup(S, (size_t)D * D);
    float q[24], k[24], v[24], dec[24], o[24] = {0}, beta = 0.5f;
    for (int i = 0; i < D; i++) q[i] = k[i] = v[i] = 0.1f * (float)i, dec[i] = 0.9f;
    kn_kda_head a = {D, 0, S, q, k, v, dec, D, &beta, o, NULL, 0};
    kn_kda_recur(kn_detect(), &a);
    CHECK(same(S, S0, (size_t)D * D), "n = 0 changed the state");
    a.n = 1;
    kn_kda_recur(kn_level_available(KN_NEON) ? KN_AVX512 : KN_NEON, &a);
    float o1[24];
    memcpy(o1, o, sizeof o1);
    memcpy(S, S0, (size_t)D * D * sizeof *S);
    kn_kda_recur(KN_SCALAR, &a);
    CHECK(same(o, o1, (size_t)D), "a level of the other architecture gave other bits");
    free(S), free(S0);
}

/* The short convolution: kda_conv_fast over channel ranges (whole, and split
 * at an odd point) against kda_conv_channel per channel, for every
 * projection, kernel widths with and without a SIMD form (2-4; 1 and 5), odd
 * channel counts (vector tails) and with and without a trail. */
TEST(kda_fast_conv_bit_identical) {
    static const int Ds[] = {5, 8, 17, 40, 128};
    static const int Ws[] = {1, 2, 3, 4, 5};
    static const int ns[] = {1, 2, 7, 33};
    uint64_t s = 0x51ed2701ull;
    for (size_t di = 0; di < sizeof Ds / sizeof *Ds; di++)
        for (size_t wi = 0; wi < sizeof Ws / sizeof *Ws; wi++)
            for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
                for (int trail = 0; trail <= 1; trail++) {
                    const int H = 3, D = Ds[di], W = Ws[wi], n = ns[ni];
                    kda_shape sh = {0, H, D, W, 1, 1, -5.0f, 1e-5f};
                    const size_t P = (size_t)H * D, NP = (size_t)n * P, SF = (size_t)kda_state_floats(&sh);
                    float *w[3] = {rvec(&s, P * W, -1, 1), rvec(&s, P * W, -1, 1), rvec(&s, P * W, -1, 1)};
                    kda_params p = {{w[0], w[1], w[2]}, NULL, NULL, NULL};
                    float *x[3] = {rvec(&s, NP, -3, 3), rvec(&s, NP, -3, 3), rvec(&s, NP, -3, 3)};
                    float *state = rvec(&s, SF, -2, 2);
                    /* the reference */
                    float *rx[3] = {dup(x[0], NP), dup(x[1], NP), dup(x[2], NP)}, *rst = dup(state, SF);
                    float *rtr = trail ? calloc((size_t)n * SF, sizeof(float)) : NULL;
                    kda_io rio = {rx[0], rx[1], rx[2], NULL, NULL, NULL, NULL, rtr};
                    for (int which = 0; which < 3; which++)
                        for (int c = 0; c < (int)P; c++) kda_conv_channel(&sh, &p, rst, which, c, n, &rio);
                    for (int lv = KN_SCALAR; lv <= KN_NEON; lv++) {
                        if (!kn_level_available((kn_level)lv)) continue;
                        for (int split = 0; split <= 1; split++) {
                            float *gx[3] = {dup(x[0], NP), dup(x[1], NP), dup(x[2], NP)}, *gst = dup(state, SF);
                            float *gtr = trail ? calloc((size_t)n * SF, sizeof(float)) : NULL;
                            kda_io gio = {gx[0], gx[1], gx[2], NULL, NULL, NULL, NULL, gtr};
                            const int cut = split ? (int)P / 2 + 1 : (int)P;
                            for (int which = 0; which < 3; which++) {
                                kda_conv_fast((kn_level)lv, &sh, &p, gst, which, 0, cut, n, &gio);
                                if (cut < (int)P) kda_conv_fast((kn_level)lv, &sh, &p, gst, which, cut, (int)P, n, &gio);
                            }
                            int ok = same(gst, rst, SF) && (!trail || same(gtr, rtr, (size_t)n * SF));
                            for (int which = 0; which < 3; which++) ok = ok && same(gx[which], rx[which], NP);
                            CHECK(ok, "conv D %d W %d n %d trail %d split %d %s: differs", D, W, n, trail, split,
                                  kn_level_name((kn_level)lv));
                            for (int which = 0; which < 3; which++) free(gx[which]);
                            free(gst), free(gtr);
                        }
                    }
                    for (int which = 0; which < 3; which++) free(w[which]), free(x[which]), free(rx[which]);
                    free(state), free(rst), free(rtr);
                }
}
