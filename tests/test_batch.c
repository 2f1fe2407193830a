/* test_batch.c — several sessions in one step (suite batch_): every
 * session's logits bit-identical to evaluating it alone, whatever the mix
 * of prefill and decode rows, the split over passes, or rewinding inside a
 * batch; the union statistics; argument errors change nothing.
 */
#include "test.h"
#include "deltafin.h"
#include <stdlib.h>
#include <string.h>

static df_engine *open_model(const char *dir, int threads) {
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = threads;
    o.spine_dtype = DF_SPINE_DTYPE_CHECKPOINT;
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    if (df_engine_open(dir, &o, &e, err) != DF_OK) fprintf(stderr, "%s: %s\n", dir, err);
    return e;
}

enum { NS = 5, STEPS = 6 };

/* Session i gets a prompt of plen[i] tokens, then STEPS steps of step_n[i]
 * tokens each (rows of all sessions batched); the same schedule is run solo
 * on a second engine, and every logits row must match bit for bit. */
static void batch_case(const char *dir, int threads) {
    df_engine *e = open_model(dir, threads), *e1 = open_model(dir, 1);
    if (!e || !e1) { CHECK(0, "%s", dir); df_engine_close(e); df_engine_close(e1); return; }
    int V = df_engine_vocab_size(e);
    static const int plen[NS] = {3, 17, 40, 1, 9};  /* 40: more than one pass */
    static const int step_n[NS] = {1, 2, 1, 5, 1};
    df_session *b[NS] = {0}, *a[NS] = {0};
    float *lb[NS], *la[NS];
    int32_t *tok[NS];
    uint32_t r = 777;
    for (int i = 0; i < NS; i++) {
        int len = plen[i] + STEPS * step_n[i];
        tok[i] = malloc((size_t)len * sizeof(int32_t));
        lb[i] = malloc((size_t)len * V * sizeof(float));
        la[i] = malloc((size_t)len * V * sizeof(float));
        REQUIRE(tok[i] && lb[i] && la[i]);
        for (int t = 0; t < len; t++) { r = r * 1664525u + 1013904223u; tok[i][t] = (int32_t)((r >> 8) % (uint32_t)V); }
        REQUIRE(df_session_new(e, 128, &b[i]) == DF_OK && df_session_new(e1, 128, &a[i]) == DF_OK);
    }
    /* batched: prompts of sessions 0..2 together, then 3 and 4 join while 0..2 decode */
    df_batch_item it[NS];
    for (int i = 0; i < 3; i++) it[i] = (df_batch_item){b[i], tok[i], plen[i], lb[i]};
    CHECK(df_session_eval_batch(it, 3) == DF_OK, "%s", df_session_error(b[0]));
    int off[NS] = {plen[0], plen[1], plen[2], 0, 0};
    for (int st = 0; st < STEPS; st++) {
        int k = 0;
        for (int i = 0; i < NS; i++) {
            if (i >= 3 && st == 0) { it[k++] = (df_batch_item){b[i], tok[i], plen[i], lb[i]}; off[i] = plen[i]; continue; }
            if (i >= 3 && off[i] + step_n[i] > plen[i] + (STEPS - 1) * step_n[i]) continue;
            it[k++] = (df_batch_item){b[i], tok[i] + off[i], step_n[i], lb[i] + (size_t)off[i] * V};
            off[i] += step_n[i];
        }
        CHECK(df_session_eval_batch(it, k) == DF_OK, "%s", df_session_error(it[0].s));
    }
    /* solo, one session at a time, the same tokens (any chunking gives the same bits) */
    for (int i = 0; i < NS; i++) {
        CHECK(df_session_eval(a[i], tok[i], off[i], la[i]) == DF_OK);
        CHECK(df_session_pos(a[i]) == df_session_pos(b[i]), "session %d: pos %d vs %d", i, df_session_pos(a[i]),
              df_session_pos(b[i]));
        CHECK(memcmp(la[i], lb[i], (size_t)off[i] * V * sizeof(float)) == 0, "%s session %d: batched logits differ", dir, i);
        CHECK(memcmp(df_session_logits(a[i]), df_session_logits(b[i]), (size_t)V * sizeof(float)) == 0);
    }
    df_batch_stats bs;
    df_engine_batch_stats(e, &bs);
    CHECK(bs.multi_passes > 0 && bs.union_experts <= bs.solo_experts, "passes %llu union %llu solo %llu",
          (unsigned long long)bs.multi_passes, (unsigned long long)bs.union_experts, (unsigned long long)bs.solo_experts);
    /* argument errors change nothing */
    int p0 = df_session_pos(b[0]);
    int32_t bad = V;
    it[0] = (df_batch_item){b[0], tok[0], 1, NULL};
    it[1] = (df_batch_item){b[1], &bad, 1, NULL};
    CHECK(df_session_eval_batch(it, 2) == DF_ERR_ARG && df_session_pos(b[0]) == p0);
    it[1] = (df_batch_item){b[0], tok[0], 1, NULL};
    CHECK(df_session_eval_batch(it, 2) == DF_ERR_ARG && strstr(df_session_error(b[0]), "twice"));
    for (int i = 0; i < NS; i++) {
        df_session_free(a[i]);
        df_session_free(b[i]);
        free(tok[i]); free(la[i]); free(lb[i]);
    }
    df_engine_close(e);
    df_engine_close(e1);
}

TEST(batch_bit_identical_k3) { batch_case("tests/fixtures/kimi_k3_a", 2); }
TEST(batch_bit_identical_kimi_linear_mxfp4) {
    batch_case("tests/fixtures/kimi_linear_a", 2);
    batch_case("tests/fixtures/kimi_k3_mxfp4", 2);
}
TEST(batch_bit_identical_dsv3) { batch_case("tests/fixtures/dsv3_qlora", 2); }

/* A speculative verify of two sessions in one batch, each rewound after. */
TEST(batch_rewind_inside_batch) {
    df_engine *e = open_model("tests/fixtures/kimi_k3_a", 2);
    REQUIRE(e);
    int V = df_engine_vocab_size(e);
    df_session *s[2], *ref;
    REQUIRE(df_session_new(e, 64, &s[0]) == DF_OK && df_session_new(e, 64, &s[1]) == DF_OK &&
            df_session_new(e, 64, &ref) == DF_OK);
    int32_t p[2][12];
    for (int i = 0; i < 2; i++)
        for (int t = 0; t < 12; t++) p[i][t] = (i * 31 + t * 7 + 3) % V;
    float *lg = malloc((size_t)8 * V * sizeof(float)), *lr = malloc((size_t)V * sizeof(float));
    REQUIRE(lg && lr);
    for (int i = 0; i < 2; i++) {
        CHECK(df_session_set_rewind(s[i], 5, DF_REWIND_TRAIL) == DF_OK);
        CHECK(df_session_eval(s[i], p[i], 8, NULL) == DF_OK);
    }
    /* a 30-token prompt first: the 4-row item does not fit its pass and waits
     * for the next one whole (an item of at most 32 rows is never split) */
    df_session *big;
    REQUIRE(df_session_new(e, 64, &big) == DF_OK);
    int32_t bt[30];
    for (int t = 0; t < 30; t++) bt[t] = (t * 13 + 1) % V;
    df_batch_item it3[3] = {{big, bt, 30, NULL}, {s[0], p[0] + 8, 4, lg}, {s[1], p[1] + 8, 3, lg + (size_t)4 * V}};
    CHECK(df_session_eval_batch(it3, 3) == DF_OK);
    df_session_free(big);
    CHECK(df_session_rewind(s[0], 10) == DF_OK && df_session_rewind(s[1], 9) == DF_OK);
    for (int i = 0; i < 2; i++) {
        int keep = i == 0 ? 10 : 9;
        int32_t nxt = 5;
        CHECK(df_session_eval(s[i], &nxt, 1, lg) == DF_OK);
        df_session_reset(ref);
        CHECK(df_session_eval(ref, p[i], keep, NULL) == DF_OK && df_session_eval(ref, &nxt, 1, lr) == DF_OK);
        CHECK(memcmp(lg, lr, (size_t)V * sizeof(float)) == 0, "session %d after a batched verify + rewind", i);
    }
    free(lg);
    free(lr);
    df_session_free(s[0]);
    df_session_free(s[1]);
    df_session_free(ref);
    df_engine_close(e);
}
