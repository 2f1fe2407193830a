/* test_text_run.c — `deltafin run --prompt` and `deltafin chat` through the
 * CLI (suite text_run_). The model is the kimi_k3_a fixture (random weights,
 * vocabulary 1000) given a tokenizer that fits it: cl100k's first 744 ranks
 * (every single byte and the commonest merges) plus the 256 Kimi reserved
 * specials, six of them named like K3's by a tokenizer_config.json.
 */
#include "test.h"
#include <stdlib.h>
#include <string.h>

static char mdir[256];

__attribute__((destructor)) static void run_cleanup(void) {
    if (mdir[0]) t_sh(NULL, 0, "rm -rf '%s'", mdir);
}

static const char *model(void) {
    if (mdir[0]) return mdir;
    const char *d = t_tmpdir("textmodel");
    if (!d) return NULL;
    char out[1024];
    int rc = t_sh(out, sizeof out,
                  "cp -r tests/fixtures/kimi_k3_a/. %s/ && gzip -dc tests/text/cl100k_base.tiktoken.gz | head -744 > %s/tiktoken.model && "
                  "printf '%%s' '{\"added_tokens_decoder\": {\"744\": {\"content\": \"[BOS]\"}, \"745\": {\"content\": \"[EOS]\"},"
                  "\"746\": {\"content\": \"<|end_of_msg|>\"}, \"747\": {\"content\": \"<|open|>\"}, \"748\": {\"content\": \"<|close|>\"},"
                  "\"749\": {\"content\": \"<|sep|>\"}}}' > %s/tokenizer_config.json",
                  d, d, d);
    if (rc != 0) { fprintf(stderr, "    %s\n", out); return NULL; }
    snprintf(mdir, sizeof mdir, "%s", d);
    return mdir;
}

/* greedy text == detokenize(greedy ids of `run --tokens`) */
TEST(text_run_prompt_matches_token_run) {
    const char *m = model();
    REQUIRE(m);
    char ids[4096], gen[4096], text[4096], want[4096];
    int rc = t_sh(ids, sizeof ids, "printf 'The weather today is' | %s tokenize --model %s", t_bin(), m);
    REQUIRE(rc == 0, "%s", ids);
    ids[strcspn(ids, "\n")] = 0;
    for (char *p = ids; *p; p++) if (*p == ' ') *p = ',';
    rc = t_sh(gen, sizeof gen, "%s run --model %s --tokens %s --max-new 16 --ids 2>/dev/null | head -1", t_bin(), m, ids);
    REQUIRE(rc == 0, "%s", gen);
    gen[strcspn(gen, "\n")] = 0;
    rc = t_sh(want, sizeof want, "%s detokenize --model %s --skip-special --ids '%s'", t_bin(), m, gen);
    REQUIRE(rc == 0, "%s", want);
    rc = t_sh(text, sizeof text, "%s run --model %s --prompt 'The weather today is' --max-new 16 --ignore-eos 2>/dev/null", t_bin(), m);
    CHECK(rc == 0, "rc %d: %s", rc, text);
    size_t wl = strlen(want);
    CHECK(strlen(text) == wl + 1 && !strncmp(text, want, wl) && text[wl] == '\n', "run --prompt printed '%s', want '%s' + newline", text, want);

    /* a stop string: the output ends just before it */
    if (wl >= 6) {
        char stop[8], pre[4096];
        memcpy(stop, want + wl / 2, 3);
        stop[3] = 0;
        if (!strchr(stop, '\'') && !strchr(stop, '\\') && !strchr(stop, '%')) {
            const char *first = strstr(want, stop);
            snprintf(pre, sizeof pre, "%.*s\n", (int)(first - want), want);
            rc = t_sh(text, sizeof text, "%s run --model %s --prompt 'The weather today is' --max-new 16 --ignore-eos --stop '%s' 2>/dev/null",
                      t_bin(), m, stop);
            CHECK(rc == 0 && !strcmp(text, pre), "stop '%s': printed '%s', want '%s'", stop, text, pre);
        }
    }
}

TEST(text_run_seeded_sampling_is_reproducible) {
    const char *m = model();
    REQUIRE(m);
    char a[4096], b[4096], c[4096];
    const char *fmt = "%s run --model %s --prompt 'Once upon a time' --max-new 24 --ignore-eos --temperature 1.0 --top-p 0.95 --seed %d 2>/dev/null";
    CHECK(t_sh(a, sizeof a, fmt, t_bin(), m, 11) == 0, "%s", a);
    CHECK(t_sh(b, sizeof b, fmt, t_bin(), m, 11) == 0, "%s", b);
    CHECK(t_sh(c, sizeof c, fmt, t_bin(), m, 12) == 0, "%s", c);
    CHECK(!strcmp(a, b), "same seed, different text:\n%s\n%s", a, b);
    CHECK(strcmp(a, c) != 0, "different seeds, same text");
}

TEST(text_run_bad_input) {
    const char *m = model();
    REQUIRE(m);
    char out[4096];
    int rc = t_sh(out, sizeof out, "%s run --model %s --prompt \"$(printf 'ab\\377')\" --max-new 2", t_bin(), m);
    CHECK(rc == 1 && strstr(out, "invalid UTF-8"), "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s run --model %s --ctx 4 --prompt 'a long prompt that cannot fit in four positions' --max-new 2", t_bin(), m);
    CHECK(rc == 1 && strstr(out, "does not fit the context"), "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s run --model tests/fixtures/kimi_k3_a --prompt hi --max-new 2", t_bin());
    CHECK(rc == 1 && strstr(out, "no tokenizer"), "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s run --model %s --prompt hi --top-p 0", t_bin(), m);
    CHECK(rc == 2, "rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s run --model %s --prompt hi --chat --effort extreme", t_bin(), m);
    CHECK(rc == 1 && strstr(out, "extreme"), "rc %d: %s", rc, out);
    CHECK(strstr(out, "internal error") == NULL && strstr(out, "Sanitizer") == NULL, "%s", out);
}

/* chat keeps the session between turns: turn 2 evaluates only its own tokens */
TEST(text_run_chat_turns_keep_state) {
    const char *m = model();
    REQUIRE(m);
    char out[16384];
    int rc = t_sh(out, sizeof out,
                  "printf 'hello\\nhow are you\\n/stats\\n/reset\\n/stats\\n/quit\\n' | %s chat --model %s --max-new 6 --stats 2>&1 >/dev/null",
                  t_bin(), m);
    REQUIRE(rc == 0, "rc %d: %s", rc, out);
    int p1 = -1, p2 = -1, c1 = -1, c2 = -1, c3 = -1, c4 = -1, ctx;
    const char *a = strstr(out, "prompt ");
    if (a) sscanf(a, "prompt %d tokens", &p1);
    const char *ac = a ? strstr(a, "context ") : NULL;
    if (ac) sscanf(ac, "context %d/%d", &c1, &ctx);
    const char *b = ac ? strstr(ac, "prompt ") : NULL;
    if (b) sscanf(b, "prompt %d tokens", &p2);
    const char *bc = b ? strstr(b, "context ") : NULL;
    if (bc) sscanf(bc, "context %d/%d", &c2, &ctx);
    const char *s1 = bc ? strstr(bc + 1, "context ") : NULL; /* /stats */
    if (s1) sscanf(s1, "context %d/%d", &c3, &ctx);
    const char *s2 = s1 ? strstr(s1 + 1, "context ") : NULL; /* /stats after /reset */
    if (s2) sscanf(s2, "context %d/%d", &c4, &ctx);
    CHECK(p1 > 0 && p2 > 0 && p2 < p1, "turn prompts %d then %d tokens (the second has no effort message)", p1, p2);
    CHECK(c2 >= c1 + p2, "context after turn 1 %d, after turn 2 %d, turn 2 prompt %d: earlier turns re-evaluated?", c1, c2, p2);
    CHECK(c3 == c2 && c4 == 0, "/stats: %d (want %d), after /reset %d (want 0)\n%s", c3, c2, c4, out);
    CHECK(strstr(out, "[conversation reset]") != NULL, "%s", out);
}

/* on a terminal (a pseudo-terminal made by script(1)) */
TEST(text_run_chat_on_a_pty) {
    const char *m = model();
    REQUIRE(m);
    char out[16384];
    if (t_sh(out, sizeof out, "command -v script") != 0) SKIP("script(1) not installed");
    int rc = t_sh(out, sizeof out, "printf 'hi there\\n/quit\\n' | script -qec '%s chat --model %s --max-new 4 --temperature 0' /dev/null",
                  t_bin(), m);
    CHECK(rc == 0, "rc %d: %s", rc, out);
    CHECK(strstr(out, "> ") != NULL, "no prompt on the terminal: %s", out);
}
