/* test_spec.c — session rewinding and exact speculative decoding (suite spec_).
 *
 * Oracles: a rewound session against a fresh one that never saw the rolled-
 * back tokens (logits bit-identical, both rewind modes, KDA and MLA models);
 * greedy generation with prompt-lookup drafts against plain greedy, token
 * for token (trained tiny K3 and random fixtures), and seeded sampling with
 * penalties likewise; the CLI's --spec output against the output without.
 */
#include "test.h"
#include "deltafin.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TINY "models/kimi-k3-tiny"

static df_engine *open_model(const char *dir) {
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = 2;
    o.spine_dtype = DF_SPINE_DTYPE_CHECKPOINT;
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    if (df_engine_open(dir, &o, &e, err) != DF_OK) {
        fprintf(stderr, "%s: %s\n", dir, err);
        return NULL;
    }
    return e;
}

/* Tokens of the trained model's validation text (repetitive Python), or a
 * pseudo-random repetitive sequence for the fixtures. */
static int sample_tokens(int V, int32_t *tok, int n) {
    FILE *f = fopen(TINY "/eval/val_windows.u16", "rb");
    if (V == 4096 && f) {
        uint16_t t16[512];
        int got = (int)fread(t16, 2, (size_t)n, f);
        fclose(f);
        for (int i = 0; i < got; i++) tok[i] = t16[i];
        if (got == n) return n;
    } else if (f) fclose(f);
    uint32_t r = 12345;
    for (int i = 0; i < n; i++) {
        if (i >= 24 && (i / 8) % 3 == 0) { tok[i] = tok[i - 16]; continue; } /* repeats: drafts find them */
        r = r * 1664525u + 1013904223u;
        tok[i] = (int32_t)((r >> 8) % (uint32_t)V);
    }
    return n;
}

/* ---- rewinding ---- */

static void rewind_case(const char *dir, int mode) {
    df_engine *e = open_model(dir);
    if (!e) { CHECK(0, "%s", dir); return; }
    int V = df_engine_vocab_size(e);
    int32_t tok[40];
    sample_tokens(V, tok, 40);
    df_session *a = NULL, *b = NULL;
    float *la = malloc((size_t)8 * V * sizeof(float)), *lb = malloc((size_t)8 * V * sizeof(float));
    if (df_session_new(e, 64, &a) != DF_OK || df_session_new(e, 64, &b) != DF_OK || !la || !lb) {
        CHECK(0, "alloc");
        goto done;
    }
    CHECK(df_session_set_rewind(a, 8, mode) == DF_OK, "%s", df_session_error(a));
    CHECK(df_session_eval(a, tok, 20, NULL) == DF_OK, "%s", df_session_error(a));
    if (!strstr(dir, "dsv3")) /* positions alone define a DeepSeek-V3 timeline: any rewind works */
        CHECK(df_session_rewind(a, 10) == DF_ERR_ARG, "a prompt longer than the depth cannot be rewound");
    /* a speculative step: 6 tokens, keep 3 (2 when replaying keeps 0..) */
    int32_t step[6] = {tok[20], tok[21], 7 % V, 11 % V, 13 % V, 17 % V};
    for (int keep = 6; keep >= (mode == DF_REWIND_REPLAY ? 0 : 1); keep -= 2) {
        CHECK(df_session_eval(a, step, 6, la) == DF_OK, "%s", df_session_error(a));
        CHECK(df_session_rewind(a, 20 + keep) == DF_OK, "%s", df_session_error(a));
        CHECK(df_session_pos(a) == 20 + keep);
        /* the next token evaluated after the rewind, against a fresh timeline */
        int32_t nxt = tok[30];
        CHECK(df_session_eval(a, &nxt, 1, la) == DF_OK, "%s", df_session_error(a));
        df_session_reset(b);
        CHECK(df_session_eval(b, tok, 20, NULL) == DF_OK);
        if (keep) CHECK(df_session_eval(b, step, keep, NULL) == DF_OK);
        CHECK(df_session_eval(b, &nxt, 1, lb) == DF_OK);
        CHECK(memcmp(la, lb, (size_t)V * sizeof(float)) == 0, "%s mode %d keep %d: logits differ after rewind", dir,
              mode, keep);
        /* back to 20 for the next round */
        df_session_reset(a);
        CHECK(df_session_eval(a, tok, 20, NULL) == DF_OK);
    }
    CHECK(df_session_rewind(a, 25) == DF_ERR_ARG, "past the end");
done:
    free(la);
    free(lb);
    df_session_free(a);
    df_session_free(b);
    df_engine_close(e);
}

TEST(spec_rewind_bit_identical_k3) {
    rewind_case("tests/fixtures/kimi_k3_a", DF_REWIND_TRAIL);
    rewind_case("tests/fixtures/kimi_k3_a", DF_REWIND_REPLAY);
}

TEST(spec_rewind_bit_identical_kimi_linear_and_dsv3) {
    rewind_case("tests/fixtures/kimi_linear_a", DF_REWIND_TRAIL);
    rewind_case("tests/fixtures/kimi_linear_a", DF_REWIND_REPLAY);
    rewind_case("tests/fixtures/dsv3_qlora", DF_REWIND_TRAIL);
}

/* ---- greedy: drafts change nothing ---- */

/* The session (512 positions) and sampler a case decodes with: greedy at
 * temp 0, else seeded top-k 40 with a repetition penalty. 1 when both open. */
static int open_decoder(df_engine *e, float temp, df_session **s, df_sampler **smp) {
    char err[DF_ERRMSG];
    df_sampler_params p;
    df_sampler_params_default(&p);
    p.temperature = temp;
    if (temp > 0) { p.top_k = 40; p.repetition_penalty = 1.1f; p.seed = 4242; }
    return df_session_new(e, 512, s) == DF_OK && df_sampler_new(&p, df_engine_vocab_size(e), smp, err) == DF_OK;
}

static void gen_case(const char *dir, int n_prompt, int n_gen, int depth, int adaptive, int want_accepts, float temp) {
    df_engine *e = open_model(dir);
    if (!e) { CHECK(0, "%s", dir); return; }
    int V = df_engine_vocab_size(e);
    int32_t *tok = malloc(512 * sizeof *tok), *plain = malloc(512 * sizeof *plain), *fast = malloc(512 * sizeof *fast);
    df_session *s = NULL;
    df_sampler *smp = NULL;
    df_spec *sp = NULL;
    char err[DF_ERRMSG];
    if (!tok || !plain || !fast || !open_decoder(e, temp, &s, &smp)) {
        CHECK(0, "alloc");
        goto done;
    }
    sample_tokens(V, tok, n_prompt);
    /* plain greedy, one token per step */
    CHECK(df_session_eval(s, tok, n_prompt, NULL) == DF_OK);
    for (int i = 0; i < n_gen; i++) {
        plain[i] = df_sampler_sample(smp, df_session_logits(s), NULL);
        df_sampler_accept(smp, plain[i]);
        CHECK(df_session_eval(s, &plain[i], 1, NULL) == DF_OK);
    }
    /* with drafts */
    df_session_reset(s);
    df_sampler_reset(smp);
    df_spec_params sprm;
    df_spec_params_default(&sprm);
    sprm.depth = depth;
    sprm.adaptive = adaptive;
    REQUIRE(df_spec_new(s, smp, &sprm, &sp, err) == DF_OK, "%s", err);
    CHECK(df_session_eval(s, tok, n_prompt, NULL) == DF_OK);
    CHECK(df_spec_context(sp, tok, n_prompt) == DF_OK);
    int made = 0;
    while (made < n_gen) {
        int32_t out[DF_SPEC_MAX + 1];
        int k;
        df_status st = df_spec_step(sp, n_gen - made, out, NULL, &k);
        REQUIRE(st == DF_OK, "%s", df_session_error(s));
        REQUIRE(k >= 1 && made + k <= n_gen);
        memcpy(fast + made, out, (size_t)k * sizeof *out);
        made += k;
    }
    int first_diff = -1;
    for (int i = 0; i < n_gen && first_diff < 0; i++)
        if (plain[i] != fast[i]) first_diff = i;
    CHECK(first_diff < 0, "%s (temperature %.1f): output with drafts differs from plain at token %d", dir, temp, first_diff);
    df_spec_stats st;
    df_spec_get_stats(sp, &st);
    fprintf(stderr, "[%s: %llu/%llu drafts accepted, %.2f tokens/step] ", dir, (unsigned long long)st.accepted,
            (unsigned long long)st.drafted, st.steps ? (double)st.tokens / st.steps : 0);
    if (want_accepts) CHECK(st.accepted > 0 && st.accepted < st.drafted, "drafts both accepted and rejected");
    /* settle: the session holds exactly prompt + n_gen - 1 tokens (the pending one dropped) */
    CHECK(df_spec_settle(sp, 1) == DF_OK, "%s", df_session_error(s));
    CHECK(df_session_pos(s) == n_prompt + n_gen - 1, "pos %d", df_session_pos(s));
done:
    df_spec_free(sp);
    df_sampler_free(smp);
    df_session_free(s);
    df_engine_close(e);
    free(tok);
    free(plain);
    free(fast);
}

TEST(spec_greedy_equals_plain_trained) {
    FILE *f = fopen(TINY "/eval/val_windows.u16", "rb");
    if (!f) SKIP("models/kimi-k3-tiny/eval is missing");
    fclose(f);
    gen_case(TINY, 200, 120, 6, 0, 1, 0);
    gen_case(TINY, 100, 60, 16, 1, 0, 0);
}

TEST(spec_greedy_equals_plain_fixtures) {
    gen_case("tests/fixtures/kimi_k3_a", 48, 40, 4, 0, 0, 0);
    gen_case("tests/fixtures/kimi_linear_a", 48, 40, 3, 0, 0, 0);
    gen_case("tests/fixtures/dsv3_qlora", 48, 40, 5, 0, 0, 0);
}

/* Seeded sampling (temperature, top-k, repetition penalty): each row is
 * sampled as plain decoding samples it, so the tokens are the same too. */
TEST(spec_sampled_equals_plain_seeded) {
    FILE *f = fopen(TINY "/eval/val_windows.u16", "rb");
    if (!f) SKIP("models/kimi-k3-tiny/eval is missing");
    fclose(f);
    gen_case(TINY, 200, 120, 6, 0, 1, 0.7f);
    gen_case("tests/fixtures/kimi_k3_a", 48, 40, 4, 0, 0, 1.0f);
}

/* Adaptive depth: where drafts are never accepted (random weights), the
 * policy settles on no drafting; where they are (the trained model on
 * repetitive text), it keeps drafting. */
/* A step's cost for the adaptive depth: 100 ms, plus 10 ms a further row
 * (the shape measured in RAM, where rows share the weight reads). */
static double model_cost(void *ctx, int rows) {
    (void)ctx;
    return 0.1 + 0.01 * (rows - 1);
}

static double rows_per_step(const char *dir, const char *text_file, int n_prompt, int n_gen, df_spec_stats *out) {
    df_engine *e = open_model(dir);
    if (!e) return -1;
    int V = df_engine_vocab_size(e);
    int32_t tok[1024];
    sample_tokens(V, tok, n_prompt);
    if (text_file) { /* a document, then its beginning again (bench/prompts/edit_code.txt) */
        df_tokenizer *tk = NULL;
        df_tokens ids = {0};
        char err[DF_ERRMSG], text[8192];
        FILE *f = fopen(text_file, "rb");
        size_t tn = f ? fread(text, 1, sizeof text, f) : 0;
        if (f) fclose(f);
        if (df_tokenizer_load_dir(dir, &tk, err) == DF_OK && df_tokenize(tk, text, tn, 0, &ids, err) == DF_OK &&
            ids.n <= 1024 && ids.n > 0) {
            memcpy(tok, ids.ids, (size_t)ids.n * sizeof *tok);
            n_prompt = ids.n;
        }
        df_tokens_free(&ids);
        df_tokenizer_free(tk);
    }
    df_session *s = NULL;
    df_sampler *smp = NULL;
    df_spec *sp = NULL;
    char err[DF_ERRMSG];
    double r = -1;
    df_spec_params sprm;
    df_spec_params_default(&sprm);
    sprm.step_cost = model_cost; /* the policy, not this machine's speed */
    if (open_decoder(e, 0, &s, &smp) &&
        df_spec_new(s, smp, &sprm, &sp, err) == DF_OK && df_session_eval(s, tok, n_prompt, NULL) == DF_OK &&
        df_spec_context(sp, tok, n_prompt) == DF_OK) {
        int made = 0;
        while (made < n_gen) {
            int32_t o[DF_SPEC_MAX + 1];
            int k;
            if (df_spec_step(sp, n_gen - made, o, NULL, &k) != DF_OK) break;
            made += k;
            if (made > n_gen / 2 && made - k <= n_gen / 2) df_spec_reset_stats(sp); /* the second half */
        }
        df_spec_get_stats(sp, out);
        r = out->steps ? (double)out->rows / out->steps : 0;
    }
    df_spec_free(sp);
    df_sampler_free(smp);
    df_session_free(s);
    df_engine_close(e);
    return r;
}

TEST(spec_adaptive_depth_turns_off_when_it_does_not_pay) {
    df_spec_stats st;
    double r = rows_per_step("tests/fixtures/kimi_k3_a", NULL, 48, 120, &st);
    CHECK(r >= 1 && r < 1.5, "random weights: %.2f rows per step (acceptance %.2f)", r, st.alpha);
    FILE *f = fopen(TINY "/eval/val_windows.u16", "rb");
    if (!f) return;
    fclose(f);
    r = rows_per_step(TINY, "bench/prompts/edit_code.txt", 0, 100, &st);
    CHECK(r > 2, "trained model copying a document: %.2f rows per step (acceptance %.2f)", r, st.alpha);
    fprintf(stderr, "[trained: %.2f rows, %.2f tokens per step] ", r, st.steps ? (double)st.tokens / st.steps : 0);
}

/* ---- CLI ---- */

static char out1[16384], out2[16384];

TEST(spec_cli_run_and_chat_same_output) {
    FILE *f = fopen(TINY "/config.json", "r");
    if (!f) SKIP("models/kimi-k3-tiny is missing");
    fclose(f);
    const char *prompt = "def add(a, b):\\n    return a + b\\n\\ndef sub(a, b):\\n    return a - b\\n\\ndef add(a, b):\\n";
    int r1 = t_sh(out1, sizeof out1, "%s run --model %s --threads 2 --max-new 80 --prompt \"$(printf '%s')\" 2>/dev/null",
                  t_bin(), TINY, prompt);
    int r2 = t_sh(out2, sizeof out2,
                  "%s run --model %s --threads 2 --max-new 80 --spec ngram --spec-depth 5 --spec-fixed --prompt \"$(printf '%s')\" 2>/dev/null",
                  t_bin(), TINY, prompt);
    CHECK(r1 == 0 && r2 == 0, "exit %d %d", r1, r2);
    CHECK(strcmp(out1, out2) == 0, "run output differs with --spec:\n%s\n---\n%s", out1, out2);
    /* chat: two turns; the session after each turn must hold what was shown */
    const char *lines = "def add(a, b):\\ndef add(a, b):\\n";
    r1 = t_sh(out1, sizeof out1, "printf '%s' | %s chat --model %s --threads 2 --max-new 30 --temperature 0 2>/dev/null",
              lines, t_bin(), TINY);
    r2 = t_sh(out2, sizeof out2,
              "printf '%s' | %s chat --model %s --threads 2 --max-new 30 --temperature 0 --spec ngram 2>/dev/null",
              lines, t_bin(), TINY);
    CHECK(r1 == 0 && r2 == 0, "exit %d %d", r1, r2);
    CHECK(strcmp(out1, out2) == 0, "chat output differs with --spec:\n%s\n---\n%s", out1, out2);
    r1 = t_sh(out1, sizeof out1, "%s run --model %s --prompt x --spec eagle 2>&1", t_bin(), TINY);
    CHECK(r1 == 2 && strstr(out1, "--spec takes ngram or off"), "%s", out1);
    r1 = t_sh(out1, sizeof out1, "%s run --model %s --prompt x --spec ngram --spec-depth 99 2>&1", t_bin(), TINY);
    CHECK(r1 == 2 && strstr(out1, "--spec-depth takes 1..16"), "%s", out1);
    r1 = t_sh(out1, sizeof out1, "%s run --model %s --threads 2 --prompt 'a = 1' --max-new 8 --spec ngram --stats 2>&1",
              t_bin(), TINY);
    CHECK(r1 == 0 && strstr(out1, "spec ngram:") && strstr(out1, "rows and"), "%s", out1);
}
