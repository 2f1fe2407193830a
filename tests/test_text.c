/* test_text.c — tokenizers (suite text_): tiktoken rank files against
 * js-tiktoken, the Kimi pattern against Python's regex module, tokenizer.json
 * against @huggingface/transformers, round trips, streaming detokenisation,
 * pathological inputs, special tokens and bad files.
 *
 * Test data (tests/text/, made by tools/tokref/, see its README.md):
 *   o200k_base.tiktoken.gz, cl100k_base.tiktoken.gz  js-tiktoken's ranks as
 *       tiktoken rank files, gunzipped into a temp dir once per run
 *   corpus.json, kimi_extra.json                     the test strings
 *   ref_<enc>.json        [{text, ids[, special]}] from js-tiktoken
 *   ref_kimi_pieces.json  [{text, pieces}] from the original pattern (regex V1)
 */
#include "test.h"
#include "deltafin.h"
#include "../src/text/text.h"
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TD "tests/text"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Frees the cached tokenizers and removes the rank files at exit. */
static df_tokenizer *cache_list[8];
static char cache_dir[256];
__attribute__((destructor)) static void text_cleanup(void) {
    for (int i = 0; i < 8; i++) df_tokenizer_free(cache_list[i]);
    if (cache_dir[0]) t_sh(NULL, 0, "rm -rf '%s'", cache_dir);
}

/* Rank files are loaded once per run (o200k takes ~0.1 s). */
static df_tokenizer *load_enc(const char *name, const char *pattern) {
    static struct { char key[64]; df_tokenizer *t; } cache[8];
    static char dir[256]; /* t_tmpdir's slots are reused: keep a copy */
    char key[64];
    snprintf(key, sizeof key, "%s/%s", name, pattern);
    for (int i = 0; i < 8; i++)
        if (cache[i].t && !strcmp(cache[i].key, key)) return cache[i].t;
    if (!dir[0]) {
        const char *d = t_tmpdir("ranks");
        if (!d) return NULL;
        snprintf(dir, sizeof dir, "%s", d);
        snprintf(cache_dir, sizeof cache_dir, "%s", d);
        char out[512];
        if (t_sh(out, sizeof out, "gzip -dc " TD "/o200k_base.tiktoken.gz > %s/o200k_base.tiktoken && "
                                  "gzip -dc " TD "/cl100k_base.tiktoken.gz > %s/cl100k_base.tiktoken",
                 dir, dir) != 0)
            return NULL;
    }
    char path[512], err[DF_ERRMSG];
    snprintf(path, sizeof path, "%s/%s.tiktoken", dir, name);
    df_tokenizer *t = NULL;
    if (df_tokenizer_load_tiktoken(path, pattern, NULL, NULL, &t, err) != DF_OK) {
        fprintf(stderr, "    load %s: %s\n", path, err);
        return NULL;
    }
    for (int i = 0; i < 8; i++)
        if (!cache[i].t) {
            snprintf(cache[i].key, sizeof cache[i].key, "%s", key);
            cache[i].t = cache_list[i] = t;
            break;
        }
    return t;
}


static int valid_utf8(const char *s, size_t n) { return tok_utf8_check(s, n) == n; }

/* encode, compare with the reference, decode back, stream-decode back */
static void check_ref_tok(df_tokenizer *t, const char *enc) {
    char path[256];
    snprintf(path, sizeof path, TD "/ref_%s.json", enc);
    json_error_t je;
    json_t *rows = json_load_file(path, 0, &je);
    REQUIRE(json_is_array(rows), "%s: %s", path, je.text);
    size_t i;
    json_t *r;
    int bad = 0;
    json_array_foreach(rows, i, r) {
        const char *text = json_string_value(json_object_get(r, "text"));
        size_t tl = json_string_length(json_object_get(r, "text"));
        json_t *ids = json_object_get(r, "ids");
        unsigned flags = json_is_true(json_object_get(r, "special")) ? DF_TOK_SPECIAL : 0;
        df_tokens got = {0};
        char err[DF_ERRMSG];
        df_status st = df_tokenize(t, text, tl, flags, &got, err);
        CHECK(st == DF_OK, "%s: '%s': %s", enc, text, err);
        int same = (size_t)got.n == json_array_size(ids);
        for (int k = 0; same && k < got.n; k++) same = got.ids[k] == json_integer_value(json_array_get(ids, (size_t)k));
        if (!same && bad++ < 5) {
            fprintf(stderr, "    %s: '%s'\n      got ", enc, text);
            for (int k = 0; k < got.n; k++) fprintf(stderr, "%d ", got.ids[k]);
            fprintf(stderr, "\n      want ");
            for (size_t k = 0; k < json_array_size(ids); k++) fprintf(stderr, "%lld ", json_integer_value(json_array_get(ids, k)));
            fprintf(stderr, "\n");
        }
        CHECK(same, "%s: ids differ for string %zu", enc, i);
        /* round trip */
        char *back = NULL;
        size_t bl = 0;
        st = df_detokenize(t, got.ids, got.n, 0, &back, &bl, err);
        CHECK(st == DF_OK && bl == tl && !memcmp(back, text, tl), "%s: round trip of string %zu", enc, i);
        free(back);
        /* streaming: every chunk is valid UTF-8, the chunks add up to the text */
        df_detok *d;
        REQUIRE(df_detok_new(t, 0, &d) == DF_OK);
        char *acc = malloc(tl + 16);
        size_t an = 0;
        int chunks_ok = 1;
        for (int k = 0; k < got.n; k++) {
            const char *c;
            size_t cl;
            CHECK(df_detok_push(d, got.ids[k], &c, &cl) == DF_OK);
            chunks_ok &= valid_utf8(c, cl);
            if (an + cl <= tl) memcpy(acc + an, c, cl);
            an += cl;
        }
        const char *c;
        size_t cl;
        df_detok_flush(d, &c, &cl);
        CHECK(cl == 0, "%s: string %zu left bytes pending", enc, i);
        CHECK(chunks_ok && an == tl && !memcmp(acc, text, tl), "%s: streaming decode of string %zu", enc, i);
        free(acc);
        df_detok_free(d);
        df_tokens_free(&got);
    }
    CHECK(json_array_size(rows) > 40);
    json_decref(rows);
}

static void check_ref_file(const char *enc, const char *pattern) {
    df_tokenizer *t = load_enc(enc, pattern);
    REQUIRE(t, "cannot load %s", enc);
    check_ref_tok(t, enc);
}

TEST(text_tiktoken_o200k_matches_js_tiktoken) { check_ref_file("o200k_base", "o200k"); }
TEST(text_tiktoken_cl100k_matches_js_tiktoken) { check_ref_file("cl100k_base", "cl100k"); }

/* DeepSeek-V3's tokenizer.json (Split x3 + ByteLevel, merges by pair rank)
 * against @huggingface/transformers */
TEST(text_hf_deepseek_v3_matches_transformers) {
    const char *d = t_tmpdir("hf");
    REQUIRE(d);
    char out[512], path[300];
    snprintf(path, sizeof path, "%s/tokenizer.json", d);
    int rc = t_sh(out, sizeof out, "gzip -dc " TD "/deepseek_v3.tokenizer.json.gz > %s", path);
    REQUIRE(rc == 0, "%s", out);
    df_tokenizer *t = NULL;
    char err[DF_ERRMSG];
    double t0 = now_s();
    REQUIRE(df_tokenizer_load_hf(path, &t, err) == DF_OK, "%s", err);
    double dt = now_s() - t0;
    fprintf(stderr, "[load %.2f s] ", dt); /* a speed figure, not a check: under ASan on a loaded 2-core VM it took 5.7 s */
    CHECK(df_tokenizer_vocab_size(t) == 128815, "vocab %d", df_tokenizer_vocab_size(t));
    check_ref_tok(t, "deepseek_v3");
    /* a model dir with only tokenizer.json */
    df_tokenizer *t2 = NULL;
    CHECK(df_tokenizer_load_dir(d, &t2, err) == DF_OK, "%s", err);
    df_tokenizer_free(t2);
    df_tokenizer_free(t);
    t_sh(NULL, 0, "rm -rf '%s'", d);
}

/* Unsupported tokenizer.json parts are refused by name. */
static void expect_hf_error(const char *tag, const char *json, const char *needle) {
    const char *d = t_tmpdir(tag);
    REQUIRE(d);
    char path[300];
    snprintf(path, sizeof path, "%s/tokenizer.json", d);
    FILE *f = fopen(path, "wb");
    REQUIRE(f);
    fputs(json, f);
    fclose(f);
    df_tokenizer *t = NULL;
    char err[DF_ERRMSG] = "";
    CHECK(df_tokenizer_load_hf(path, &t, err) != DF_OK && !t, "%s: accepted", tag);
    CHECK(strstr(err, needle) != NULL, "%s: message '%s' lacks '%s'", tag, err, needle);
    t_sh(NULL, 0, "rm -rf '%s'", d);
}

TEST(text_hf_unsupported_parts_named) {
    /* a tiny valid byte-level vocabulary: the 256 byte symbols */
    static char vocab[8192];
    uint32_t cp[256];
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        cp[b] = keep ? (uint32_t)b : (uint32_t)(256 + n++);
    }
    size_t w = (size_t)sprintf(vocab, "{");
    for (int b = 0; b < 256; b++) {
        char u[8];
        int k = tok_utf8_put(cp[b], u);
        u[k] = 0;
        if (cp[b] == '"' || cp[b] == '\\') w += (size_t)sprintf(vocab + w, "%s\"\\%s\": %d", b ? "," : "", u, b);
        else w += (size_t)sprintf(vocab + w, "%s\"%s\": %d", b ? "," : "", u, b);
    }
    sprintf(vocab + w, "}");
    char json[12000];
#define HF(norm, pre, model_extra) \
    (snprintf(json, sizeof json, "{\"normalizer\": %s, \"pre_tokenizer\": %s, \"model\": {\"type\": \"BPE\", \"vocab\": %s, \"merges\": []%s}}", \
              norm, pre, vocab, model_extra), json)
    static const char bl[] = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}";
    /* the good one loads */
    const char *d = t_tmpdir("hfok");
    char path[300];
    snprintf(path, sizeof path, "%s/tokenizer.json", d);
    FILE *f = fopen(path, "wb");
    REQUIRE(f);
    fputs(HF("null", bl, ""), f);
    fclose(f);
    df_tokenizer *t = NULL;
    char err[DF_ERRMSG];
    CHECK(df_tokenizer_load_hf(path, &t, err) == DF_OK, "%s", err);
    if (t) {
        df_tokens ids = {0};
        CHECK(df_tokenize(t, "hi there", 8, 0, &ids, err) == DF_OK && ids.n == 8, "n %d", ids.n);
        df_tokens_free(&ids);
    }
    df_tokenizer_free(t);
    t_sh(NULL, 0, "rm -rf '%s'", d);
    expect_hf_error("hf_nfc", HF("{\"type\": \"NFC\"}", bl, ""), "normalizer 'NFC'");
    expect_hf_error("hf_seqnfkc", HF("{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFKC\"}]}", bl, ""), "NFKC");
    expect_hf_error("hf_meta", HF("null", "{\"type\": \"Metaspace\"}", ""), "pre_tokenizer type 'Metaspace'");
    expect_hf_error("hf_prefix", HF("null", "{\"type\": \"ByteLevel\", \"add_prefix_space\": true}", ""), "add_prefix_space");
    expect_hf_error("hf_nobl", HF("null", "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": \"Isolated\"}", ""), "no ByteLevel");
    expect_hf_error("hf_beh", HF("null", "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": \"MergedWithNext\"}]}", ""), "MergedWithNext");
    expect_hf_error("hf_drop", HF("null", bl, ", \"dropout\": 0.1"), "dropout");
    expect_hf_error("hf_bf", HF("null", bl, ", \"byte_fallback\": true"), "byte_fallback");
    expect_hf_error("hf_wp", "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", "model type 'WordPiece'");
    expect_hf_error("hf_json", "{\"model\": ", "line");
#undef HF
}

/* ---- the Kimi pattern ---- */

typedef struct {
    char buf[8192];
    size_t n;
    int count;
} pieces_acc;

static void acc_piece(void *ud, const char *p, size_t n) {
    pieces_acc *a = ud;
    /* pieces joined with \x01 */
    if (a->n + n + 1 < sizeof a->buf) {
        memcpy(a->buf + a->n, p, n);
        a->n += n;
        a->buf[a->n++] = 1;
    }
    a->count++;
}

TEST(text_kimi_pattern_matches_python_regex) {
    df_tokenizer *t = load_enc("cl100k_base", "kimi");
    REQUIRE(t);
    json_error_t je;
    json_t *rows = json_load_file(TD "/ref_kimi_pieces.json", 0, &je);
    REQUIRE(json_is_array(rows), "%s", je.text);
    size_t i;
    json_t *r;
    json_array_foreach(rows, i, r) {
        const char *text = json_string_value(json_object_get(r, "text"));
        pieces_acc got = {0}, want = {0};
        size_t k;
        json_t *p;
        json_array_foreach(json_object_get(r, "pieces"), k, p) acc_piece(&want, json_string_value(p), json_string_length(p));
        char err[DF_ERRMSG];
        CHECK(tok_pieces(t, text, strlen(text), 0, acc_piece, &got, err) == DF_OK, "%s", err);
        int same = got.n == want.n && !memcmp(got.buf, want.buf, got.n);
        if (!same) {
            for (size_t q = 0; q < got.n; q++) if (got.buf[q] == 1) got.buf[q] = '|';
            for (size_t q = 0; q < want.n; q++) if (want.buf[q] == 1) want.buf[q] = '|';
            fprintf(stderr, "    got  %.*s\n    want %.*s\n", (int)got.n, got.buf, (int)want.n, want.buf);
        }
        CHECK(same, "kimi pieces differ for string %zu", i);
    }
    json_decref(rows);
}

/* tokenization_kimi.py cuts runs of whitespace / non-whitespace at 25,000
 * code points before the regex: a 60,000-letter run becomes pieces of
 * 25,000 + 25,000 + 10,000 letters. */
TEST(text_kimi_slices_long_runs) {
    df_tokenizer *t = load_enc("cl100k_base", "kimi");
    REQUIRE(t);
    size_t n = 60000;
    char *s = malloc(n + 8);
    memset(s, 'a', n);
    memcpy(s + n, " b", 3);
    pieces_acc *a = calloc(1, sizeof *a);
    char err[DF_ERRMSG];
    /* count pieces only: the buffer holds just the first few */
    CHECK(tok_pieces(t, s, n + 2, 0, acc_piece, a, err) == DF_OK, "%s", err);
    CHECK(a->count == 4, "pieces: %d (want 25000, 25000, 10000, ' b')", a->count);
    free(a);
    free(s);
}

/* ---- special tokens ---- */

TEST(text_special_tokens_only_when_asked) {
    df_tokenizer *t = load_enc("o200k_base", "o200k");
    REQUIRE(t);
    const char *s = "x<|endoftext|>y";
    df_tokens a = {0}, b = {0};
    char err[DF_ERRMSG];
    REQUIRE(df_tokenize(t, s, strlen(s), 0, &a, err) == DF_OK);
    REQUIRE(df_tokenize(t, s, strlen(s), DF_TOK_SPECIAL, &b, err) == DF_OK);
    int found_a = 0, found_b = 0;
    for (int i = 0; i < a.n; i++) found_a |= a.ids[i] == 199999;
    for (int i = 0; i < b.n; i++) found_b |= b.ids[i] == 199999;
    CHECK(!found_a && found_b && b.n == 3, "plain %d tokens, special %d tokens", a.n, b.n);
    CHECK(df_tokenizer_special(t, "<|endoftext|>") == 199999);
    CHECK(df_tokenizer_is_special(t, 199999) && !df_tokenizer_is_special(t, 100));
    char *txt;
    size_t tl;
    REQUIRE(df_detokenize(t, b.ids, b.n, 1, &txt, &tl, err) == DF_OK);
    CHECK(!strcmp(txt, "xy"), "skip_special: '%s'", txt);
    free(txt);
    /* nothing to decode (no ids, or only skipped specials): "", no
     * arithmetic on a NULL buffer (fuzz_tokenizer_json found it under UBSan) */
    int32_t only = 199999;
    REQUIRE(df_detokenize(t, &only, 1, 1, &txt, &tl, err) == DF_OK);
    CHECK(txt && !txt[0] && tl == 0, "only a skipped special: '%s'", txt);
    free(txt);
    REQUIRE(df_detokenize(t, NULL, 0, 0, &txt, &tl, err) == DF_OK);
    CHECK(txt && !txt[0] && tl == 0, "no ids: '%s'", txt);
    free(txt);
    df_tokens_free(&a);
    df_tokens_free(&b);
}

/* A model dir: tiktoken.model + tokenizer_config.json spelling the Kimi
 * specials; user text containing <|open|> stays ordinary bytes. */
TEST(text_model_dir_specials_from_config) {
    const char *d = t_tmpdir("tokdir");
    REQUIRE(d);
    char out[512];
    int rc = t_sh(out, sizeof out, "gzip -dc " TD "/cl100k_base.tiktoken.gz > %s/tiktoken.model && "
                                  "printf '{\"added_tokens_decoder\": {\"100256\": {\"content\": \"[BOS]\", \"special\": true},"
                                  "\"100259\": {\"content\": \"<|open|>\", \"special\": true}}}' > %s/tokenizer_config.json",
                  d, d);
    REQUIRE(rc == 0, "%s", out);
    df_tokenizer *t = NULL;
    char err[DF_ERRMSG];
    REQUIRE(df_tokenizer_load_dir(d, &t, err) == DF_OK, "%s", err);
    CHECK(df_tokenizer_vocab_size(t) == 100256 + 256, "vocab %d", df_tokenizer_vocab_size(t));
    CHECK(df_tokenizer_special(t, "[BOS]") == 100256);
    CHECK(df_tokenizer_special(t, "<|open|>") == 100259);
    CHECK(df_tokenizer_special(t, "<|reserved_token_100300|>") == 100300);
    const char *s = "<|open|>hi";
    df_tokens a = {0}, b = {0};
    REQUIRE(df_tokenize(t, s, strlen(s), 0, &a, err) == DF_OK);
    REQUIRE(df_tokenize(t, s, strlen(s), DF_TOK_SPECIAL, &b, err) == DF_OK);
    CHECK(a.n > 2 && a.ids[0] != 100259, "user text must stay bytes");
    CHECK(b.n >= 2 && b.ids[0] == 100259, "structural text must be special");
    size_t bl;
    const char *bytes = df_token_bytes(t, 100259, &bl);
    CHECK(bytes && bl == 8 && !memcmp(bytes, "<|open|>", 8));
    df_tokens_free(&a);
    df_tokens_free(&b);
    df_tokenizer_free(t);
    t_sh(NULL, 0, "rm -rf '%s'", d);
}

/* ---- pathological inputs: O(n log n) BPE ---- */

static void time_run(const char *enc, const char *pattern, const char *unit, size_t reps) {
    df_tokenizer *t = load_enc(enc, pattern);
    REQUIRE(t);
    size_t ul = strlen(unit);
    char *s = malloc(ul * reps + 1);
    for (size_t i = 0; i < reps; i++) memcpy(s + i * ul, unit, ul);
    df_tokens ids = {0};
    char err[DF_ERRMSG];
    double t0 = now_s();
    df_status st = df_tokenize(t, s, ul * reps, 0, &ids, err);
    double dt = now_s() - t0;
    CHECK(st == DF_OK, "%s", err);
    CHECK(dt < 1.0, "%s/%s: %zu x '%s' took %.3f s", enc, pattern, reps, unit, dt);
    char *back;
    size_t bl;
    REQUIRE(df_detokenize(t, ids.ids, ids.n, 0, &back, &bl, err) == DF_OK);
    CHECK(bl == ul * reps && !memcmp(back, s, bl), "round trip");
    free(back);
    df_tokens_free(&ids);
    free(s);
}

TEST(text_pathological_runs_are_fast) {
    time_run("o200k_base", "o200k", "\xF0\x9F\xA4\x96", 100000); /* robot emoji */
    time_run("o200k_base", "o200k", "a", 100000);
    time_run("cl100k_base", "cl100k", "\xF0\x9F\xA4\x96", 100000);
    time_run("cl100k_base", "kimi", "\xF0\x9F\xA4\x96", 100000);
    time_run("cl100k_base", "kimi", "Q", 100000);
    time_run("cl100k_base", "kimi", "\xE4\xB8\xAD", 100000);          /* Han */
    time_run("cl100k_base", "kimi", " ", 100000);
    time_run("o200k_base", "o200k", "1", 100000);
}

/* ---- streaming detokenisation on split code points ---- */

TEST(text_stream_holds_partial_code_points) {
    df_tokenizer *t = load_enc("cl100k_base", "cl100k");
    REQUIRE(t);
    /* single-byte tokens of a 4-byte emoji, then an invalid byte */
    const char *emoji = "\xF0\x9F\xA4\x96";
    df_detok *d;
    REQUIRE(df_detok_new(t, 0, &d) == DF_OK);
    const char *c;
    size_t cl;
    df_tokens one = {0};
    char err[DF_ERRMSG];
    for (int i = 0; i < 3; i++) {
        df_tokens_free(&one);
        /* a single byte of the emoji is always its own rank */
        int32_t id = -1;
        for (int32_t k = 0; k < 256 && id < 0; k++) {
            size_t bl;
            const char *b = df_token_bytes(t, k, &bl);
            if (b && bl == 1 && (unsigned char)b[0] == (unsigned char)emoji[i]) id = k;
        }
        REQUIRE(id >= 0);
        CHECK(df_detok_push(d, id, &c, &cl) == DF_OK && cl == 0, "byte %d emitted %zu bytes early", i, cl);
    }
    REQUIRE(df_tokenize(t, emoji + 3, 1, 0, &one, err) != DF_OK); /* a lone continuation byte is not text */
    int32_t last = -1;
    for (int32_t k = 0; k < 256 && last < 0; k++) {
        size_t bl;
        const char *b = df_token_bytes(t, k, &bl);
        if (b && bl == 1 && (unsigned char)b[0] == 0x96) last = k;
    }
    CHECK(df_detok_push(d, last, &c, &cl) == DF_OK && cl == 4 && !memcmp(c, emoji, 4), "emoji completes");
    /* an unfinished sequence at the end becomes U+FFFD at flush */
    int32_t f0 = -1;
    for (int32_t k = 0; k < 256 && f0 < 0; k++) {
        size_t bl;
        const char *b = df_token_bytes(t, k, &bl);
        if (b && bl == 1 && (unsigned char)b[0] == 0xF0) f0 = k;
    }
    CHECK(df_detok_push(d, f0, &c, &cl) == DF_OK && cl == 0);
    df_detok_flush(d, &c, &cl);
    CHECK(cl == 3 && !memcmp(c, "\xEF\xBF\xBD", 3), "flush gives U+FFFD");
    /* an impossible byte is replaced at once */
    int32_t ff = -1;
    for (int32_t k = 0; k < 256 && ff < 0; k++) {
        size_t bl;
        const char *b = df_token_bytes(t, k, &bl);
        if (b && bl == 1 && (unsigned char)b[0] == 0xFF) ff = k;
    }
    CHECK(df_detok_push(d, ff, &c, &cl) == DF_OK && cl == 3 && !memcmp(c, "\xEF\xBF\xBD", 3));
    CHECK(df_detok_push(d, 1 << 30, &c, &cl) == DF_ERR_ARG);
    df_detok_free(d);
    df_tokens_free(&one);
}

/* ---- bad input ---- */

TEST(text_invalid_utf8_is_an_error) {
    df_tokenizer *t = load_enc("cl100k_base", "cl100k");
    REQUIRE(t);
    df_tokens ids = {0};
    char err[DF_ERRMSG] = "";
    CHECK(df_tokenize(t, "ok\xC3(", 4, 0, &ids, err) == DF_ERR_ARG);
    CHECK(strstr(err, "byte 2") != NULL, "%s", err);
    CHECK(df_tokenize(t, "\xED\xA0\x80", 3, 0, &ids, err) == DF_ERR_ARG, "surrogates are not UTF-8");
    CHECK(ids.n == 0);
    df_tokens_free(&ids);
}

static void expect_rank_error(const char *content, const char *needle) {
    const char *d = t_tmpdir("badrank");
    REQUIRE(d);
    char path[300], out[256];
    snprintf(path, sizeof path, "%s/bad.tiktoken", d);
    FILE *f = fopen(path, "wb");
    REQUIRE(f);
    /* all 256 single bytes, then the broken line */
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int b = 0; b < 256; b++)
        fprintf(f, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    fputs(content, f);
    fclose(f);
    df_tokenizer *t = NULL;
    char err[DF_ERRMSG] = "";
    df_status st = df_tokenizer_load_tiktoken(path, "cl100k", NULL, NULL, &t, err);
    CHECK(st != DF_OK && !t, "'%s' was accepted", content);
    CHECK(strstr(err, needle) != NULL, "message '%s' lacks '%s'", err, needle);
    t_sh(out, sizeof out, "rm -rf '%s'", d);
}

TEST(text_bad_rank_files) {
    expect_rank_error("aGk= 256\naGk= 257\n", "appear twice");
    expect_rank_error("aGk= 5\n", "rank 5 appears twice");
    expect_rank_error("!!!! 256\n", ":257: bad base64");
    expect_rank_error("aGk=256\n", ":257: expected");
    expect_rank_error("aGk= x\n", ":257: bad rank");
    expect_rank_error("aGk= -3\n", "bad rank");
    char err[DF_ERRMSG];
    df_tokenizer *t = NULL;
    CHECK(df_tokenizer_load_tiktoken("/nonexistent/x.tiktoken", NULL, NULL, NULL, &t, err) == DF_ERR_IO);
    CHECK(df_tokenizer_load_tiktoken(TD "/corpus.json", "nope", NULL, NULL, &t, err) == DF_ERR_ARG);
    CHECK(df_tokenizer_load_tiktoken(TD "/corpus.json", NULL, "(unclosed", NULL, &t, err) != DF_OK);
    /* a missing single byte */
    const char *d = t_tmpdir("badrank2");
    char path[300];
    snprintf(path, sizeof path, "%s/r", d);
    FILE *f = fopen(path, "wb");
    REQUIRE(f);
    fputs("YQ== 0\n", f);
    fclose(f);
    CHECK(df_tokenizer_load_tiktoken(path, NULL, NULL, NULL, &t, err) == DF_ERR_FORMAT && strstr(err, "single byte"), "%s", err);
    t_sh(NULL, 0, "rm -rf '%s'", d);
    df_tokenizer_free(NULL);
}

/* ---- CLI contract: deltafin tokenize / detokenize ---- */

TEST(text_cli_tokenize_detokenize) {
    REQUIRE(load_enc("cl100k_base", "cl100k")); /* makes the rank files */
    char rf[300], out[4096];
    snprintf(rf, sizeof rf, "%s/cl100k_base.tiktoken", cache_dir);
    int rc = t_sh(out, sizeof out, "printf 'Hello, world! \\344\\275\\240\\345\\245\\275' | %s tokenize --tokenizer %s --pattern cl100k",
                  t_bin(), rf);
    CHECK(rc == 0 && !strcmp(out, "9906 11 1917 0 220 57668 53901\n"), "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s detokenize --tokenizer %s --ids '9906 11 1917 0 220 57668 53901'", t_bin(), rf);
    CHECK(rc == 0 && !strcmp(out, "Hello, world! \xe4\xbd\xa0\xe5\xa5\xbd"), "rc %d: %s", rc, out);
    /* special spellings are text unless --special */
    rc = t_sh(out, sizeof out, "printf '<|endoftext|>' | %s tokenize --tokenizer %s --pattern cl100k --special", t_bin(), rf);
    CHECK(rc == 0 && !strcmp(out, "100257\n"), "%s", out);
    rc = t_sh(out, sizeof out, "printf '<|endoftext|>' | %s tokenize --tokenizer %s --pattern cl100k", t_bin(), rf);
    CHECK(rc == 0 && strcmp(out, "100257\n") != 0, "%s", out);
    /* bad input: invalid UTF-8, unknown pattern, bad ids, no tokenizer */
    rc = t_sh(out, sizeof out, "printf 'a\\377' | %s tokenize --tokenizer %s", t_bin(), rf);
    CHECK(rc == 1 && strstr(out, "invalid UTF-8 at byte 1"), "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s tokenize --tokenizer %s --pattern nope </dev/null", t_bin(), rf);
    CHECK(rc == 1 && strstr(out, "unknown pattern"), "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s detokenize --tokenizer %s --ids '1 x'", t_bin(), rf);
    CHECK(rc == 2, "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s detokenize --tokenizer %s --ids '999999'", t_bin(), rf);
    CHECK(rc == 1 && strstr(out, "999999"), "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s tokenize --model /nonexistent </dev/null", t_bin());
    CHECK(rc == 1 && strstr(out, "no tokenizer"), "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s tokenize </dev/null", t_bin());
    CHECK(rc == 2, "rc %d: %s", rc, out);
}

TEST(text_cli_bench_tokenizer) {
    REQUIRE(load_enc("o200k_base", "o200k"));
    char out[4096];
    int rc = t_sh(out, sizeof out, "%s bench --tokenizer %s/o200k_base.tiktoken --pattern o200k --seconds 0.2", t_bin(), cache_dir);
    CHECK(rc == 0 && strstr(out, "MB/s") && strstr(out, "pattern o200k"), "rc %d: %s", rc, out);
}
