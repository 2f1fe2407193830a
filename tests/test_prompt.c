/* test_prompt.c — a long prompt run layer by layer (forward_prompt, suite
 * prompt_): the last position's logits, every row's logits, and every step
 * after the prompt, bit-identical to the same prompt in 32-position passes
 * (df_engine_opts.prompt_chunks), Kimi and DeepSeek-V3 programs, experts
 * from the store and mapped, across the blocks' boundaries, at 1 and 2
 * threads, and from a position other than 0 (a second turn); the batch
 * stats count the blocks; the block buffers the engine keeps between
 * prompts change no row.
 */
#include "test.h"
#include "deltafin.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* dir opened with o (NULL on failure, the reason on stderr) */
static df_engine *open_opts(const char *dir, const df_engine_opts *o) {
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    if (df_engine_open(dir, o, &e, err) != DF_OK) fprintf(stderr, "%s: %s\n", dir, err);
    return e;
}

static df_engine *open_model(const char *dir, int io, int threads, int64_t cache, int chunks) {
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = threads;
    o.expert_io = io;
    o.expert_cache_bytes = cache;
    o.prompt_chunks = chunks;
    o.prompt_block = 256; /* the cases below cross 256-position boundaries */
    o.spine_dtype = DF_SPINE_DTYPE_CHECKPOINT;
    return open_opts(dir, &o);
}

enum { STEPS = 3, DF_PROMPT_BLOCK_MAX_TEST = 65537 /* one past the engine's limit */ };

/* The prompt (n tokens) on engine e (layer by layer) and on c (chunks):
 * the last logits alone, then every row's, then STEPS single steps. */
static void prompt_case(const char *dir, int io, int threads, int n, int64_t cache) {
    df_engine *e = open_model(dir, io, threads, cache, 0), *c = open_model(dir, io, threads, cache, 1);
    if (!e || !c) { CHECK(0, "%s", dir); df_engine_close(e); df_engine_close(c); return; }
    const int V = df_engine_vocab_size(e);
    const size_t row = (size_t)V * sizeof(float);
    int32_t *tok = malloc((size_t)(n + STEPS) * sizeof *tok);
    float *ra = malloc((size_t)n * row), *rb = malloc((size_t)n * row), *la = malloc(row);
    df_session *a = NULL, *b = NULL;
    REQUIRE(tok && ra && rb && la);
    REQUIRE(df_session_new(e, n + STEPS + 1, &a) == DF_OK && df_session_new(c, n + STEPS + 1, &b) == DF_OK);
    uint32_t r = 2024u + (uint32_t)n;
    for (int t = 0; t < n + STEPS; t++) { r = r * 1664525u + 1013904223u; tok[t] = (int32_t)((r >> 8) % (uint32_t)V); }
    /* the last row alone */
    df_engine_reset_stats(e);
    CHECK(df_session_eval(a, tok, n, NULL) == DF_OK, "%s: %s", dir, df_session_error(a));
    df_batch_stats bs;
    df_engine_batch_stats(e, &bs);
    CHECK(bs.prompt_blocks == (uint64_t)((n + 255) / 256), "%s: %llu layer-major blocks for %d tokens", dir,
          (unsigned long long)bs.prompt_blocks, n);
    memcpy(la, df_session_logits(a), row);
    CHECK(df_session_eval(b, tok, n, rb) == DF_OK, "%s: %s", dir, df_session_error(b));
    df_engine_batch_stats(c, &bs);
    CHECK(bs.prompt_blocks == 0, "%s: --prefill chunks ran %llu blocks", dir, (unsigned long long)bs.prompt_blocks);
    CHECK(!memcmp(la, rb + (size_t)(n - 1) * V, row),
          "%s io %d threads %d: the layer-major prompt's last logits differ from the chunked passes'", dir, io,
          threads);
    /* every row, from a fresh session */
    df_session_reset(a);
    CHECK(df_session_eval(a, tok, n, ra) == DF_OK, "%s: %s", dir, df_session_error(a));
    CHECK(!memcmp(ra, rb, (size_t)n * row), "%s: the layer-major prompt's rows differ from the chunked passes'", dir);
    for (int i = 0; i < STEPS; i++) {
        CHECK(df_session_eval(a, tok + n + i, 1, NULL) == DF_OK && df_session_eval(b, tok + n + i, 1, NULL) == DF_OK,
              "%s step %d", dir, i);
        CHECK(!memcmp(df_session_logits(a), df_session_logits(b), row),
              "%s: step %d after the prompt differs (state carried from the layer-major prompt)", dir, i);
    }
    df_session_free(a);
    df_session_free(b);
    df_engine_close(e);
    df_engine_close(c);
    free(tok); free(ra); free(rb); free(la);
}

/* A prompt that continues a session (a second turn): `first` tokens in one
 * evaluation, then n more from that position, layer by layer (e) and in
 * chunks (c); every row of the second evaluation and STEPS steps after it. */
static void continued_case(const char *dir, int io, int first, int n) {
    df_engine *e = open_model(dir, io, 2, 0, 0), *c = open_model(dir, io, 2, 0, 1);
    if (!e || !c) { CHECK(0, "%s", dir); df_engine_close(e); df_engine_close(c); return; }
    const int V = df_engine_vocab_size(e), total = first + n + STEPS;
    const size_t row = (size_t)V * sizeof(float);
    int32_t *tok = malloc((size_t)total * sizeof *tok);
    float *ra = malloc((size_t)n * row), *rb = malloc((size_t)n * row);
    df_session *a = NULL, *b = NULL;
    REQUIRE(tok && ra && rb);
    REQUIRE(df_session_new(e, total + 1, &a) == DF_OK && df_session_new(c, total + 1, &b) == DF_OK);
    uint32_t r = 77u + (uint32_t)n;
    for (int t = 0; t < total; t++) { r = r * 1664525u + 1013904223u; tok[t] = (int32_t)((r >> 8) % (uint32_t)V); }
    CHECK(df_session_eval(a, tok, first, NULL) == DF_OK && df_session_eval(b, tok, first, NULL) == DF_OK, "%s", dir);
    df_engine_reset_stats(e);
    CHECK(df_session_eval(a, tok + first, n, ra) == DF_OK, "%s: %s", dir, df_session_error(a));
    CHECK(df_session_eval(b, tok + first, n, rb) == DF_OK, "%s: %s", dir, df_session_error(b));
    df_batch_stats bs;
    df_engine_batch_stats(e, &bs);
    CHECK(bs.prompt_blocks == (uint64_t)((n + 255) / 256), "%s: %llu blocks for %d tokens at position %d", dir,
          (unsigned long long)bs.prompt_blocks, n, first);
    CHECK(!memcmp(ra, rb, (size_t)n * row), "%s: a prompt from position %d, layer by layer, differs from chunks",
          dir, first);
    for (int i = 0; i < STEPS; i++) {
        const int32_t *t = tok + first + n + i;
        CHECK(df_session_eval(a, t, 1, NULL) == DF_OK && df_session_eval(b, t, 1, NULL) == DF_OK, "%s", dir);
        CHECK(!memcmp(df_session_logits(a), df_session_logits(b), row), "%s: step %d after the second turn", dir, i);
    }
    df_session_free(a);
    df_session_free(b);
    df_engine_close(e);
    df_engine_close(c);
    free(tok); free(ra); free(rb);
}

TEST(prompt_layer_major_second_turn) {
    continued_case("tests/fixtures/kimi_k3_a", DF_EXPERTS_DIRECT, 45, 33);  /* just past one pass */
    continued_case("tests/fixtures/kimi_k3_a", DF_EXPERTS_DIRECT, 7, 257);  /* one row past a block */
    continued_case("models/kimi-k3-tiny", DF_EXPERTS_DIRECT, 100, 150);
    continued_case("tests/fixtures/kimi_linear_b", DF_EXPERTS_MMAP, 40, 70);
    continued_case("tests/fixtures/dsv3_qlora", DF_EXPERTS_DIRECT, 33, 64);
}

TEST(prompt_layer_major_k3_store) { prompt_case("tests/fixtures/kimi_k3_a", DF_EXPERTS_DIRECT, 2, 300, 0); }
TEST(prompt_layer_major_k3_mxfp4_mapped) { prompt_case("tests/fixtures/kimi_k3_mxfp4", DF_EXPERTS_MMAP, 1, 129, 0); }
TEST(prompt_layer_major_kimi_linear) { prompt_case("tests/fixtures/kimi_linear_b", DF_EXPERTS_MMAP, 2, 200, 0); }
TEST(prompt_layer_major_trained) { prompt_case("models/kimi-k3-tiny", DF_EXPERTS_DIRECT, 2, 260, 0); }

TEST(prompt_layer_major_dsv3) { prompt_case("tests/fixtures/dsv3_qlora", DF_EXPERTS_DIRECT, 2, 300, 0); }
TEST(prompt_layer_major_dsv3_fp8_mapped) { prompt_case("tests/fixtures/dsv3_fp8_yarn", DF_EXPERTS_MMAP, 1, 140, 0); }
TEST(prompt_layer_major_kimi_k2_int4) { prompt_case("tests/fixtures/kimi_k2_int4", DF_EXPERTS_DIRECT, 2, 270, 0); }

/* 300 experts, top-4: a block's union (~280 of 300) is far more than the
 * 16 slots of a 128 KB cache, so every pass reads while it runs */
TEST(prompt_layer_major_store_smaller_than_a_pass) {
    const char *dir = t_tmpdir("prompt_wide");
    char out[4096];
    int rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --experts 300 --out %s --force --quiet", t_bin(), dir);
    REQUIRE(rc == 0, "synth: %s", out);
    prompt_case(dir, DF_EXPERTS_DIRECT, 2, 200, 128 * 1024);
    prompt_case(dir, DF_EXPERTS_PREAD, 1, 140, 128 * 1024);
}

/* the CLI flag: the same ids both ways; a bad value is a usage error */
TEST(prompt_cli_prefill_flag) {
    char a[4096], b[4096], c[4096];
    const char *toks = "5,17,300,2,901,44,7,7,512,3,88,61,250,9,1000,12,33,64,128,255,1,2,3,4,5,6,7,8,9,10,11,12,13,"
                       "14,15,16,17,18,19,20";
    int ra = t_sh(a, sizeof a, "%s run --model models/kimi-k3-tiny --tokens %s --max-new 4 --ids --prefill layers",
                  t_bin(), toks);
    int rb = t_sh(b, sizeof b, "%s run --model models/kimi-k3-tiny --tokens %s --max-new 4 --ids --prefill chunks",
                  t_bin(), toks);
    CHECK(ra == 0 && rb == 0, "%s | %s", a, b);
    CHECK(!strcmp(a, b), "--prefill layers '%s' vs chunks '%s'", a, b);
    int rc = t_sh(c, sizeof c, "%s run --model models/kimi-k3-tiny --tokens 1,2 --prefill sideways", t_bin());
    CHECK(rc != 0 && strstr(c, "--prefill must be layers or chunks"), "rc %d: %s", rc, c);
    rc = t_sh(c, sizeof c, "%s run --model models/kimi-k3-tiny --tokens 1,2 --prefill-block 0", t_bin());
    CHECK(rc == 2 && strstr(c, "--prefill-block needs a count of positions"), "rc %d: %s", rc, c);
    rb = t_sh(b, sizeof b, "%s run --model models/kimi-k3-tiny --tokens %s --max-new 4 --ids --prefill-block 33",
              t_bin(), toks);
    CHECK(rb == 0 && !strcmp(a, b), "--prefill-block 33 '%s' vs the default '%s'", b, a);
}

/* Every row of an n-token prompt on e, in a new session (NULL on failure). */
static float *rows_on(df_engine *e, int n) {
    const int V = df_engine_vocab_size(e);
    int32_t *tok = malloc((size_t)n * sizeof *tok);
    float *rows = malloc((size_t)n * V * sizeof(float));
    df_session *s = NULL;
    if (!tok || !rows || df_session_new(e, n + 1, &s) != DF_OK) {
        free(tok), free(rows);
        return NULL;
    }
    uint32_t r = 99u + (uint32_t)n;
    for (int t = 0; t < n; t++) { r = r * 1664525u + 1013904223u; tok[t] = (int32_t)((r >> 8) % (uint32_t)V); }
    if (df_session_eval(s, tok, n, rows) != DF_OK) free(rows), rows = NULL;
    df_session_free(s);
    free(tok);
    return rows;
}

static df_engine *open_rows_engine(const char *dir, int threads, int lv, int block) {
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = threads;
    o.simd_level = lv;
    o.prompt_block = block;
    o.spine_dtype = DF_SPINE_DTYPE_CHECKPOINT;
    return open_opts(dir, &o);
}

/* Every row of an n-token prompt, layer by layer in blocks of `block`
 * positions (0: the default), at kernel level lv (-1: the best), on an
 * engine of its own. */
static float *prompt_rows(const char *dir, int threads, int lv, int block, int n) {
    df_engine *e = open_rows_engine(dir, threads, lv, block);
    float *rows = e ? rows_on(e, n) : NULL;
    df_engine_close(e);
    return rows;
}

/* The engine keeps a prompt's block buffers for the next prompt (prompt.h):
 * prompts of other lengths after it, in new sessions, shorter ones (whose
 * block fits the kept buffers) and longer ones (which replace them), give
 * every row as an engine of their own does. Kimi K3 (KDA + MLA scratch),
 * Kimi-Linear and DeepSeek-V3 (MLA alone); lengths at, under and over one
 * session pass (DF_CHUNK 32) and a block of 100. */
TEST(prompt_buffers_kept_between_prompts) {
    const char *dirs[] = {"tests/fixtures/kimi_k3_a", "tests/fixtures/kimi_linear_b", "tests/fixtures/dsv3_qlora"};
    const int lens[] = {40, 230, 33, 70, 230, 20, 150};
    for (size_t d = 0; d < sizeof dirs / sizeof *dirs; d++) {
        df_engine *e = open_rows_engine(dirs[d], 2, -1, 100);
        REQUIRE(e, "%s", dirs[d]);
        const size_t V = (size_t)df_engine_vocab_size(e);
        for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
            const int n = lens[i];
            float *kept = rows_on(e, n), *own = prompt_rows(dirs[d], 2, -1, 100, n);
            CHECK(kept && own, "%s: %d tokens", dirs[d], n);
            if (kept && own)
                CHECK(!memcmp(kept, own, (size_t)n * V * sizeof(float)),
                      "%s: prompt %zu (%d tokens) on the kept buffers differs from a fresh engine's", dirs[d], i, n);
            free(kept), free(own);
        }
        df_engine_close(e);
    }
}

/* The block size never changes the output: one block of the default 512,
 * blocks of 100 and of 37 (across a DF_CHUNK piece), Kimi and DeepSeek-V3. */
TEST(prompt_block_sizes_agree) {
    const char *dirs[] = {"tests/fixtures/kimi_k3_a", "tests/fixtures/dsv3_qlora"};
    for (size_t d = 0; d < sizeof dirs / sizeof *dirs; d++) {
        const int n = 230;
        float *a = prompt_rows(dirs[d], 2, -1, 0, n), *b = prompt_rows(dirs[d], 2, -1, 100, n),
              *c = prompt_rows(dirs[d], 1, -1, 37, n);
        CHECK(a && b && c, "%s", dirs[d]);
        if (a && b && c) {
            df_engine *e = NULL;
            char err[DF_ERRMSG];
            REQUIRE(df_engine_open(dirs[d], NULL, &e, err) == DF_OK, "%s", err);
            const size_t bytes = (size_t)n * df_engine_vocab_size(e) * sizeof(float);
            df_engine_close(e);
            CHECK(!memcmp(a, b, bytes), "%s: blocks of 100 differ from one block", dirs[d]);
            CHECK(!memcmp(a, c, bytes), "%s: blocks of 37 differ from one block", dirs[d]);
        }
        free(a), free(b), free(c);
    }
    df_engine_opts o;
    df_engine_opts_default(&o);
    df_engine *d = open_opts("tests/fixtures/kimi_k3_a", &o);
    CHECK(d && df_engine_prompt_block(d) == 512, "the CPU's default block: %d", d ? df_engine_prompt_block(d) : -1);
    df_engine_close(d);
    o.prompt_block = 100;
    d = open_opts("tests/fixtures/kimi_k3_a", &o);
    CHECK(d && df_engine_prompt_block(d) == 100, "a block of 100 asked for: %d", d ? df_engine_prompt_block(d) : -1);
    df_engine_close(d);
    o.prompt_block = DF_PROMPT_BLOCK_MAX_TEST;
    df_engine *e = NULL;
    char err[DF_ERRMSG] = "";
    CHECK(df_engine_open("tests/fixtures/kimi_k3_a", &o, &e, err) == DF_ERR_ARG && strstr(err, "prompt block"),
          "a block of %d positions: '%s'", o.prompt_block, err);
    df_engine_close(e);
}

/* KN_AMX (where the CPU has it): the layer-major prompt's experts run on
 * packed inputs shared by the threads (moe_batch.c, mm()): every row
 * bit-equal at 1 and 3 threads, and within the kernels' bound of AVX-512. */
TEST(prompt_amx_threads_bit_equal) {
    if (!t_simd_level_available(4)) SKIP("no AMX on this CPU");
    const struct { const char *dir; int n; } cases[] = {{"tests/fixtures/kimi_k3_mxfp4", 129},
                                                        {"models/kimi-k3-tiny", 260}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const char *dir = cases[c].dir;
        const int n = cases[c].n;
        float *a = prompt_rows(dir, 1, 4, 0, n), *b = prompt_rows(dir, 3, 4, 0, n), *v = prompt_rows(dir, 3, 2, 0, n);
        CHECK(a && b && v, "%s", dir);
        if (a && b && v) {
            df_engine_opts o;
            df_engine_opts_default(&o);
            df_engine *e = NULL;
            char err[DF_ERRMSG];
            REQUIRE(df_engine_open(dir, &o, &e, err) == DF_OK, "%s", err);
            const size_t cnt = (size_t)n * df_engine_vocab_size(e);
            df_engine_close(e);
            CHECK(!memcmp(a, b, cnt * sizeof(float)), "%s: AMX rows differ between 1 and 3 threads", dir);
            double scale = 0, worst = 0;
            for (size_t i = 0; i < cnt; i++) {
                if (fabs(v[i]) > scale) scale = fabs(v[i]);
                if (fabs((double)a[i] - v[i]) > worst) worst = fabs((double)a[i] - v[i]);
            }
            CHECK(worst <= 1e-4 * scale, "%s: AMX %.3g from AVX-512 (scale %.3g)", dir, worst, scale);
        }
        free(a), free(b), free(v);
    }
}
