/* test_text_sampler.c — samplers (suite text_sampler_): each truncation is
 * checked statistically against a target distribution computed here
 * independently (sort, cut, renormalise), plus greedy, penalties, bias,
 * seeds and logprobs.
 *
 * Tolerance: N = 200,000 draws; each frequency must be within 5 standard
 * errors (sqrt(p(1-p)/N)) + 1e-4 of its target, and excluded tokens must
 * never be drawn.
 */
#include "test.h"
#include "deltafin.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { NV = 10, NDRAW = 200000 };
static const float L[NV] = {2.0f, 1.5f, 1.4f, 0.3f, 0.0f, -0.5f, -1.0f, 1.0f, -3.0f, 0.7f};

/* target: softmax(L/T) over the top-k, then the smallest prefix with mass >=
 * top_p, then p >= min_p * p_max, renormalised */
static void target(float T, int top_k, float top_p, float min_p, double *q) {
    int order[NV];
    for (int i = 0; i < NV; i++) order[i] = i;
    for (int i = 0; i < NV; i++)
        for (int j = i + 1; j < NV; j++)
            if (L[order[j]] > L[order[i]]) { int t = order[i]; order[i] = order[j]; order[j] = t; }
    int n = top_k > 0 && top_k < NV ? top_k : NV;
    double e[NV], tot = 0;
    for (int i = 0; i < n; i++) { e[i] = exp(L[order[i]] / T); tot += e[i]; }
    int m = n;
    if (top_p < 1) {
        double acc = 0;
        for (int i = 0; i < n; i++) { acc += e[i] / tot; if (acc >= top_p) { m = i + 1; break; } }
    }
    if (min_p > 0) {
        int k = 1;
        while (k < m && e[k] / e[0] >= min_p) k++;
        m = k;
    }
    double z = 0;
    for (int i = 0; i < m; i++) z += e[i];
    memset(q, 0, NV * sizeof *q);
    for (int i = 0; i < m; i++) q[order[i]] = e[i] / z;
}

static void check_dist(float T, int top_k, float top_p, float min_p) {
    df_sampler_params p;
    df_sampler_params_default(&p);
    p.temperature = T;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.seed = 1234;
    df_sampler *s;
    char err[DF_ERRMSG];
    REQUIRE(df_sampler_new(&p, NV, &s, err) == DF_OK, "%s", err);
    long cnt[NV] = {0};
    for (int i = 0; i < NDRAW; i++) {
        int32_t t = df_sampler_sample(s, L, NULL);
        REQUIRE(t >= 0 && t < NV);
        cnt[t]++;
    }
    double q[NV];
    target(T, top_k, top_p, min_p, q);
    for (int i = 0; i < NV; i++) {
        double f = (double)cnt[i] / NDRAW;
        double tol = 5 * sqrt(q[i] * (1 - q[i]) / NDRAW) + 1e-4;
        if (q[i] == 0) CHECK(cnt[i] == 0, "T=%g k=%d p=%g min_p=%g: token %d drawn %ld times, excluded", T, top_k, top_p, min_p, i, cnt[i]);
        else CHECK(fabs(f - q[i]) <= tol, "T=%g k=%d p=%g min_p=%g: token %d freq %.4f want %.4f", T, top_k, top_p, min_p, i, f, q[i]);
    }
    df_sampler_free(s);
}

TEST(text_sampler_temperature_matches_softmax) {
    check_dist(1.0f, 0, 1.0f, 0);
    check_dist(0.5f, 0, 1.0f, 0);
    check_dist(2.0f, 0, 1.0f, 0);
}
TEST(text_sampler_top_k) { check_dist(1.0f, 3, 1.0f, 0); check_dist(0.8f, 5, 1.0f, 0); }
TEST(text_sampler_top_p) { check_dist(1.0f, 0, 0.5f, 0); check_dist(1.3f, 0, 0.9f, 0); }
TEST(text_sampler_min_p) { check_dist(1.0f, 0, 1.0f, 0.3f); check_dist(0.7f, 0, 1.0f, 0.05f); }
TEST(text_sampler_combined) { check_dist(0.9f, 6, 0.8f, 0.1f); }

/* a large vocabulary: top-p's growing candidate set and quickselect */
TEST(text_sampler_large_vocab_top_p) {
    int V = 163840;
    float *lg = malloc((size_t)V * sizeof *lg);
    REQUIRE(lg);
    uint32_t r = 7;
    for (int i = 0; i < V; i++) { r = r * 1664525u + 1013904223u; lg[i] = (float)(r >> 8) / (float)(1 << 24) * 4.0f; }
    lg[777] = 20.0f; /* holds ~all the mass */
    lg[778] = 19.0f;
    df_sampler_params p;
    df_sampler_params_default(&p);
    p.top_p = 0.5f;
    df_sampler *s;
    char err[DF_ERRMSG];
    REQUIRE(df_sampler_new(&p, V, &s, err) == DF_OK);
    for (int i = 0; i < 10; i++) CHECK(df_sampler_sample(s, lg, NULL) == 777);
    df_sampler_free(s);
    p.top_p = 0.999f;
    p.top_k = 1000;
    REQUIRE(df_sampler_new(&p, V, &s, err) == DF_OK);
    int seen_other = 0;
    for (int i = 0; i < 40; i++) { int t = df_sampler_sample(s, lg, NULL); seen_other |= t != 777 && t != 778; }
    CHECK(!seen_other, "tokens outside the top-p set were drawn");
    df_sampler_free(s);
    free(lg);
}

TEST(text_sampler_greedy_and_bias) {
    df_sampler_params p;
    df_sampler_params_default(&p);
    p.temperature = 0;
    df_sampler *s;
    char err[DF_ERRMSG];
    REQUIRE(df_sampler_new(&p, NV, &s, err) == DF_OK);
    CHECK(df_sampler_sample(s, L, NULL) == 0);
    REQUIRE(df_sampler_set_bias(s, 0, -INFINITY) == DF_OK);
    CHECK(df_sampler_sample(s, L, NULL) == 1);
    REQUIRE(df_sampler_set_bias(s, 8, 10.0f) == DF_OK);
    CHECK(df_sampler_sample(s, L, NULL) == 8);
    CHECK(df_sampler_set_bias(s, NV, 1.0f) == DF_ERR_ARG);
    df_sampler_free(s);
    /* ties go to the lowest id */
    float tie[4] = {1, 3, 3, 2};
    REQUIRE(df_sampler_new(&p, 4, &s, err) == DF_OK);
    CHECK(df_sampler_sample(s, tie, NULL) == 1);
    df_sampler_free(s);
    /* a banned token is never drawn at temperature 1 */
    df_sampler_params_default(&p);
    REQUIRE(df_sampler_new(&p, NV, &s, err) == DF_OK);
    df_sampler_set_bias(s, 0, -INFINITY);
    int hit = 0;
    for (int i = 0; i < 5000; i++) hit |= df_sampler_sample(s, L, NULL) == 0;
    CHECK(!hit);
    df_sampler_free(s);
}

TEST(text_sampler_penalties) {
    df_sampler_params p;
    df_sampler_params_default(&p);
    p.temperature = 0;
    p.repetition_penalty = 2.0f; /* 2.0 -> 1.0 for token 0 */
    df_sampler *s;
    char err[DF_ERRMSG];
    REQUIRE(df_sampler_new(&p, NV, &s, err) == DF_OK);
    df_sampler_accept(s, 0);
    CHECK(df_sampler_sample(s, L, NULL) == 1, "repetition penalty");
    df_sampler_free(s);
    /* presence: -0.65 once; frequency: -0.3 per occurrence */
    df_sampler_params_default(&p);
    p.temperature = 0;
    p.presence_penalty = 0.65f;
    REQUIRE(df_sampler_new(&p, NV, &s, err) == DF_OK);
    df_sampler_accept(s, 0);
    df_sampler_accept(s, 1);
    CHECK(df_sampler_sample(s, L, NULL) == 2, "presence penalty");
    df_sampler_free(s);
    p.presence_penalty = 0;
    p.frequency_penalty = 0.3f;
    REQUIRE(df_sampler_new(&p, NV, &s, err) == DF_OK);
    df_sampler_accept(s, 0);
    CHECK(df_sampler_sample(s, L, NULL) == 0, "one occurrence: 1.7 > 1.5");
    df_sampler_accept(s, 0);
    CHECK(df_sampler_sample(s, L, NULL) == 1, "two occurrences: 1.4 < 1.5");
    df_sampler_free(s);
    /* the window forgets */
    p.frequency_penalty = 0;
    p.presence_penalty = 5;
    p.penalty_last_n = 2;
    REQUIRE(df_sampler_new(&p, NV, &s, err) == DF_OK);
    df_sampler_accept(s, 0);
    CHECK(df_sampler_sample(s, L, NULL) == 1);
    df_sampler_accept(s, 5);
    df_sampler_accept(s, 6);
    CHECK(df_sampler_sample(s, L, NULL) == 0, "token 0 left the window");
    df_sampler_reset(s);
    df_sampler_free(s);
}

TEST(text_sampler_seed_reproducible) {
    df_sampler_params p;
    df_sampler_params_default(&p);
    p.seed = 42;
    df_sampler *a, *b, *c;
    char err[DF_ERRMSG];
    REQUIRE(df_sampler_new(&p, NV, &a, err) == DF_OK);
    REQUIRE(df_sampler_new(&p, NV, &b, err) == DF_OK);
    p.seed = 43;
    REQUIRE(df_sampler_new(&p, NV, &c, err) == DF_OK);
    int same_ab = 1, same_ac = 1;
    int32_t first[64];
    for (int i = 0; i < 64; i++) {
        int32_t x = df_sampler_sample(a, L, NULL), y = df_sampler_sample(b, L, NULL), z = df_sampler_sample(c, L, NULL);
        first[i] = x;
        same_ab &= x == y;
        same_ac &= x == z;
    }
    CHECK(same_ab, "one seed, one sequence");
    CHECK(!same_ac, "another seed, another sequence");
    df_sampler_reset(a);
    int again = 1;
    for (int i = 0; i < 64; i++) again &= df_sampler_sample(a, L, NULL) == first[i];
    CHECK(again, "reset reseeds");
    df_sampler_free(a);
    df_sampler_free(b);
    df_sampler_free(c);
}

TEST(text_sampler_logprobs) {
    df_sampler_params p;
    df_sampler_params_default(&p);
    p.n_logprobs = 3;
    p.temperature = 0;
    df_sampler *s;
    char err[DF_ERRMSG];
    REQUIRE(df_sampler_new(&p, NV, &s, err) == DF_OK);
    df_sample info;
    int32_t t = df_sampler_sample(s, L, &info);
    double z = 0;
    for (int i = 0; i < NV; i++) z += exp(L[i]);
    CHECK(t == 0 && info.token == 0 && info.n_top == 3);
    CHECK(info.top_id[0] == 0 && info.top_id[1] == 1 && info.top_id[2] == 2, "%d %d %d", info.top_id[0], info.top_id[1], info.top_id[2]);
    for (int k = 0; k < 3; k++)
        CHECK(fabs(info.top_logprob[k] - (L[info.top_id[k]] - log(z))) < 1e-5, "logprob %d: %g", k, info.top_logprob[k]);
    CHECK(fabs(info.logprob - info.top_logprob[0]) < 1e-6);
    df_sampler_free(s);
    p.n_logprobs = 21;
    CHECK(df_sampler_new(&p, NV, &s, err) == DF_ERR_ARG && !s);
    p.n_logprobs = 0;
    p.top_p = 0;
    CHECK(df_sampler_new(&p, NV, &s, err) == DF_ERR_ARG);
    df_sampler_free(NULL);
}
