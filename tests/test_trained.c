/* test_trained.c — the trained tiny K3 (models/kimi-k3-tiny) against the
 * reference module it was measured with (suite trained_).
 *
 * Oracles, written by tools/train/train_k3_tiny.py on the GPU machine from
 * Moonshot's modeling file (float32, TF32 off) over the exported files:
 * eval/reference_logits.bin, the logits at a few positions of window 0 of
 * eval/val_windows.u16 (deltafin within 1e-4 x max|logit|, same top-1), and
 * eval/ppl.json's per-window NLL sums (deltafin eval on the first windows
 * within 1e-4 relative), plus a sanity check that the model writes text.
 */
#include "test.h"
#include "deltafin.h"
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MODEL "models/kimi-k3-tiny"

static char out[16384];

TEST(trained_logits_match_reference) {
    json_t *r = json_load_file(MODEL "/eval/reference.json", 0, NULL);
    if (!r) SKIP("models/kimi-k3-tiny/eval is missing");
    int V = (int)json_integer_value(json_object_get(r, "vocab"));
    json_t *pos = json_object_get(r, "positions"), *top = json_object_get(r, "top1");
    size_t np = json_array_size(pos);
    int32_t tok[256];
    FILE *f = fopen(MODEL "/eval/val_windows.u16", "rb");
    REQUIRE(f, "val_windows.u16");
    uint16_t t16[256];
    REQUIRE(fread(t16, 2, 256, f) == 256);
    fclose(f);
    for (int i = 0; i < 256; i++) tok[i] = t16[i];
    float *ref = malloc(np * (size_t)V * sizeof(float)), *lg = malloc((size_t)256 * V * sizeof(float));
    f = fopen(MODEL "/eval/reference_logits.bin", "rb");
    REQUIRE(f && ref && lg && fread(ref, sizeof(float), np * (size_t)V, f) == np * (size_t)V, "reference logits");
    fclose(f);
    df_engine *e = NULL;
    df_session *s = NULL;
    char err[DF_ERRMSG];
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.spine_dtype = DF_SPINE_DTYPE_CHECKPOINT;
    REQUIRE(df_engine_open(MODEL, &o, &e, err) == DF_OK, "%s", err);
    REQUIRE(df_engine_vocab_size(e) == V && df_session_new(e, 256, &s) == DF_OK);
    REQUIRE(df_session_eval(s, tok, 256, lg) == DF_OK, "%s", df_session_error(s));
    double worst = 0, scale = 0;
    for (size_t i = 0; i < np; i++) {
        int p = (int)json_integer_value(json_array_get(pos, i));
        const float *a = lg + (size_t)p * V, *b = ref + i * V;
        for (int v = 0; v < V; v++) {
            double d = fabs((double)a[v] - b[v]);
            if (d > worst) worst = d;
            if (fabs(b[v]) > scale) scale = fabs(b[v]);
        }
        CHECK(df_argmax(a, V) == json_integer_value(json_array_get(top, i)), "position %d: top-1 %d", p, df_argmax(a, V));
    }
    CHECK(worst <= 1e-4 * scale, "max |diff| %.3g = %.3g x max|logit|", worst, worst / scale);
    fprintf(stderr, "[max|diff| %.3g = %.3g x max|logit|] ", worst, worst / scale);
    df_session_free(s);
    df_engine_close(e);
    free(ref);
    free(lg);
    json_decref(r);
}

TEST(trained_eval_matches_reference_perplexity) {
    json_t *p = json_load_file(MODEL "/eval/ppl.json", 0, NULL);
    if (!p) SKIP("models/kimi-k3-tiny/eval is missing");
    const int W = 6, ctx = 256;
    double want = 0;
    for (int w = 0; w < W; w++) want += json_real_value(json_array_get(json_object_get(p, "per_window_nll_sum"), (size_t)w));
    want /= (double)W * (ctx - 1);
    json_decref(p);
    int rc = t_sh(out, sizeof out, "%s eval --model %s --tokens-file %s/eval/val_windows.u16 --ctx %d --windows %d --json "
                  "--spine-dtype bf16 2>/dev/null", t_bin(), MODEL, MODEL, ctx, W);
    REQUIRE(rc == 0, "%s", out);
    json_t *j = json_loads(out, 0, NULL);
    double got = json_real_value(json_object_get(j, "mean_nll"));
    CHECK(fabs(got - want) <= 1e-4 * want, "mean NLL %.9f, the reference's %.9f", got, want);
    fprintf(stderr, "[mean NLL %.9f vs %.9f: rel %.2g] ", got, want, fabs(got - want) / want);
    json_decref(j);
}

TEST(trained_writes_python) {
    json_t *p = json_load_file(MODEL "/config.json", 0, NULL);
    if (!p) SKIP("models/kimi-k3-tiny is missing");
    json_decref(p);
    int rc = t_sh(out, sizeof out, "%s run --model %s --prompt 'import os\nimport sys\n\n\ndef main(' --max-new 40 "
                  "--spine-dtype bf16 2>/dev/null", t_bin(), MODEL);
    CHECK(rc == 0 && (strstr(out, "return") || strstr(out, "self") || strstr(out, "\"\"\"") || strstr(out, "    ")),
          "the model writes something like Python: %s", out);
}

/* bench's per-part floors: every weight byte of a step lands in exactly one
 * part, and the experts count in mmap mode too (no cache slots there). */
TEST(trained_part_bytes_cover_the_step) {
    for (int io = 0; io < 2; io++) {
        df_engine *e = NULL;
        char err[DF_ERRMSG];
        df_engine_opts o;
        df_engine_opts_default(&o);
        o.spine_dtype = DF_SPINE_DTYPE_CHECKPOINT;
        o.expert_io = io ? DF_EXPERTS_MMAP : DF_EXPERTS_DIRECT;
        REQUIRE(df_engine_open(MODEL, &o, &e, err) == DF_OK, "%s", err);
        double part[DF_PROF_N], sum = 0;
        df_engine_part_bytes(e, part);
        for (int i = 0; i < DF_PROF_N; i++) sum += part[i];
        int64_t ex = df_engine_expert_bytes(e);
        double step = (double)df_engine_spine_bytes_per_token(e) +
                      (double)ex * df_engine_experts_per_token(e) * df_engine_moe_layers(e);
        CHECK(ex > 0, "io %d: expert bytes %lld", io, (long long)ex);
        CHECK(fabs(sum - step) <= 1e-9 * step + 1, "io %d: parts sum to %.0f, the step reads %.0f", io, sum, step);
        CHECK(part[DF_PROF_KDA] > 0 && part[DF_PROF_MLA] > 0 && part[DF_PROF_DENSE] > 0 && part[DF_PROF_SHARED] > 0 &&
                  part[DF_PROF_ROUTER] > 0 && part[DF_PROF_ROUTED] > 0 && part[DF_PROF_HEAD] > 0,
              "io %d: a part has no bytes", io);
        df_engine_close(e);
    }
}
