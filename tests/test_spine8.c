/* test_spine8.c — the int8 spine: conversion, loading, refusals, resume,
 * and the eval harness (suite s8_).
 *
 * Oracles: every converted matrix equals the scheme applied to the
 * checkpoint's rows (s8_quantize_row on the decoded values, byte for byte,
 * with the same scale); int8 logits are bit-identical across thread counts,
 * mmap / pread, resident / streamed spine and prefill / decode; a checkpoint
 * that changed since the conversion, a damaged shard, a missing conversion
 * asked for by --spine-dtype int8 are refused with a message naming the
 * file; a conversion killed with SIGKILL mid-shard and run again ends with
 * the shards of a clean conversion (same sha256); eval against its own
 * base logits gives KL 0 and top-1 100%, against the int8 spine the label
 * LOSSY and a finite KL.
 */
#include "test.h"
#include "deltafin.h"
#include "../src/format/safetensors.h"
#include "../src/format/weight.h"
#include "../src/kernels/kernels.h"
#include "../src/spine8/spine8.h"
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char out[16384];

static const char *synth(const char *tag, const char *extra) {
    const char *d = t_tmpdir(tag);
    if (!d || t_sh(out, sizeof out, "%s synth --arch kimi_k3 --out %s --quiet %s", t_bin(), d, extra ? extra : "") != 0)
        return NULL;
    return d;
}

static void check_rule(const char *d, int fp8_block) {
    int rc = t_sh(out, sizeof out, "%s convert-spine %s 2>&1", t_bin(), d);
    REQUIRE(rc == 0, "%s", out);
    char err[DF_ERRMSG], s8[600];
    snprintf(s8, sizeof s8, "%s/int8-spine", d);
    st_set *src = NULL, *q8 = NULL;
    REQUIRE(st_open_dir(d, NULL, 1, &src, err) == DF_OK, "%s", err);
    REQUIRE(st_open_dir(s8, NULL, 1, &q8, err) == DF_OK, "%s", err);
    int checked = 0, bad = 0, embed = 0, fp8s = 0;
    for (int64_t i = 0; i < st_count(q8); i++) {
        const st_tensor *t = st_at(q8, i);
        size_t n = strlen(t->name);
        if (n < 7 || strcmp(t->name + n - 7, ".weight")) continue;
        embed += strstr(t->name, "embed_tokens") != NULL;
        char base[400];
        snprintf(base, sizeof base, "%.*s", (int)(n - 7), t->name);
        df_weight w8, w;
        CHECK(wt_bind(q8, base, t->shape[0], t->shape[1], 0, 0, &w8, err) == DF_OK && w8.type == WT_I8_ROW, "%s", err);
        REQUIRE(wt_bind(src, base, t->shape[0], t->shape[1], fp8_block, fp8_block, &w, err) == DF_OK, "%s", err);
        fp8s += w.type == WT_FP8_BLOCK;
        float *row = malloc((size_t)w.cols * sizeof(float));
        int8_t *q = malloc((size_t)w.cols);
        for (int64_t r = 0; r < w.rows; r++) { /* the scheme, written here with rintf */
            kn_dequant_row(&w, r, row);
            float amax = 0;
            for (int64_t c = 0; c < w.cols; c++) amax = fabsf(row[c]) > amax ? fabsf(row[c]) : amax;
            float sc = amax > 0 ? amax / 127.0f : 1.0f;
            for (int64_t c = 0; c < w.cols; c++) {
                float v = rintf(row[c] / sc);
                q[c] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : (int)v);
            }
            bad += sc != ((const float *)w8.scale)[r] || memcmp(q, (const int8_t *)w8.data + r * w.cols, (size_t)w.cols);
        }
        free(row);
        free(q);
        checked++;
    }
    CHECK(checked > 10 && bad == 0 && embed == 0, "%s: %d matrices, %d rows differ, %d embeddings", d, checked, bad, embed);
    CHECK(!fp8_block || fp8s > 0, "fp8 blocks dequantised first: %d", fp8s);
    /* what is left as stored: norms, conv1d, A_log, dt_bias, res_proj, the bias, the embedding, the experts */
    int wrong = 0;
    for (int64_t i = 0; i < st_count(q8); i++) {
        const char *nm = st_at(q8, i)->name;
        wrong += strstr(nm, "norm") || strstr(nm, "conv1d") || strstr(nm, "A_log") || strstr(nm, "dt_bias") ||
                 strstr(nm, "res_proj") || strstr(nm, "correction_bias") ||
                 (strstr(nm, ".experts.") && !strstr(nm, "shared_experts"));
    }
    CHECK(wrong == 0, "%d tensors converted against the rule", wrong);
    /* every shard's data begins on a 128-byte line (its header padded) */
    int off_line = 0;
    for (int i = 0; i < st_n_shards(q8); i++) {
        FILE *f = fopen(st_shard_path(q8, i), "rb");
        uint8_t lb[8] = {0};
        off_line += !f || fread(lb, 1, 8, f) != 8 || (8 + (lb[0] | (uint64_t)lb[1] << 8 | (uint64_t)lb[2] << 16)) % 128;
        if (f) fclose(f);
    }
    CHECK(off_line == 0, "%d of %d shards' data off a 128-byte line", off_line, st_n_shards(q8));
    st_close(src);
    st_close(q8);
}

TEST(s8_converted_rows_follow_the_scheme) {
    const char *d = synth("s8_rule", NULL);
    REQUIRE(d, "synth: %s", out);
    check_rule(d, 0);
    /* DeepSeek-V3's fp8 spine (128 x 128 block scales) */
    const char *f = t_tmpdir("s8_fp8");
    REQUIRE(f);
    int rc = t_sh(out, sizeof out, "cp tests/fixtures/dsv3_fp8_yarn/* %s/", f);
    REQUIRE(rc == 0, "%s", out);
    check_rule(f, 128);
}

TEST(s8_int8_logits_bit_identical_across_paths) {
    const char *d = synth("s8_paths", NULL);
    REQUIRE(d, "synth: %s", out);
    int crc = t_sh(out, sizeof out, "%s convert-spine %s 2>&1", t_bin(), d);
    REQUIRE(crc == 0, "%s", out);
    static const char *variants[] = {"--threads 1", "--threads 2 --no-mmap", "--spine stream", "--spine stream --io pread",
                                     "--spine-dtype int8 --expert-cache 1K"};
    char base[300];
    snprintf(base, sizeof base, "%s/base.f32", d);
    int rc = t_sh(out, sizeof out, "%s logits --model %s --tokens 5,9,200,31,7,66,400,12,3 --out %s 2>&1", t_bin(), d, base);
    REQUIRE(rc == 0 && strstr(out, "LOSSY int8 spine"), "auto takes the conversion and says so: %s", out);
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        rc = t_sh(out, sizeof out,
                  "%s logits --model %s --tokens 5,9,200,31,7,66,400,12,3 --out %s/v.f32 %s 2>&1 && cmp %s %s/v.f32", t_bin(),
                  d, d, variants[i], base, d);
        CHECK(rc == 0, "%s: %s", variants[i], out);
    }
    /* decode token by token = prefill */
    rc = t_sh(out, sizeof out, "%s run --model %s --tokens 5,9,200 --max-new 6 --ids 2>/dev/null", t_bin(), d);
    char a[256];
    snprintf(a, sizeof a, "%.200s", out);
    rc |= t_sh(out, sizeof out, "%s run --model %s --tokens 5,9,200 --max-new 6 --ids --spine stream 2>/dev/null", t_bin(), d);
    CHECK(rc == 0 && !strcmp(a, out), "%s vs %s", a, out);
    /* the checkpoint's own matrices are still there */
    rc = t_sh(out, sizeof out, "%s inspect --model %s --spine-dtype bf16", t_bin(), d);
    CHECK(rc == 0 && !strstr(out, "LOSSY"), "%s", out);
    rc = t_sh(out, sizeof out,
              "%s bench --decode --model %s --tokens 2 --prompt-tokens 40 --probe-seconds 0.05 --prefill-again --json "
              "2>/dev/null", t_bin(), d);
    CHECK(rc == 0 && strstr(out, "\"lossy\":\"LOSSY int8 spine\""), "bench labels it: %s", out);
    /* the warm prefill gives the same next token */
    CHECK(strstr(out, "\"prefill_again_same_token\":true") && strstr(out, "\"prefill_again_tokens_per_s\""),
          "bench --prefill-again: %s", out);
}

TEST(s8_refusals_name_the_file) {
    const char *d = synth("s8_refuse", NULL);
    REQUIRE(d, "synth: %s", out);
    int rc = t_sh(out, sizeof out, "%s run --model %s --tokens 1,2 --max-new 1 --ids --spine-dtype int8 2>&1", t_bin(), d);
    CHECK(rc == 1 && strstr(out, "convert-spine"), "int8 asked for, none there: %s", out);
    int crc = t_sh(out, sizeof out, "%s convert-spine %s 2>&1", t_bin(), d);
    REQUIRE(crc == 0, "%s", out);
    rc = t_sh(out, sizeof out, "%s convert-spine %s --verify", t_bin(), d);
    CHECK(rc == 0 && strstr(out, "verified"), "%s", out);
    /* a damaged int8 shard: --verify finds it */
    rc = t_sh(out, sizeof out, "printf 'Z' | dd of=%s/int8-spine/spine-00001.safetensors bs=1 seek=5000 conv=notrunc 2>/dev/null; "
              "%s convert-spine %s --verify 2>&1", d, t_bin(), d);
    CHECK(rc == 1 && strstr(out, "spine-00001.safetensors") && strstr(out, "damaged"), "%s", out);
    /* a truncated one: every open refuses it */
    rc = t_sh(out, sizeof out, "truncate -s -1 %s/int8-spine/spine-00002.safetensors; %s run --model %s --tokens 1,2 "
              "--max-new 1 --ids 2>&1", d, t_bin(), d);
    CHECK(rc == 1 && strstr(out, "spine-00002.safetensors") && strstr(out, "--force"), "%s", out);
    rc = t_sh(out, sizeof out, "%s run --model %s --tokens 1,2 --max-new 1 --ids --spine-dtype bf16 2>&1", t_bin(), d);
    CHECK(rc == 0, "the checkpoint's own spine still runs: %s", out);
    /* the checkpoint changed since: refused, even in auto */
    rc = t_sh(out, sizeof out, "%s convert-spine %s --force >/dev/null 2>&1 && printf '\\0\\0\\0\\0\\0\\0\\0\\0' >> %s/model.safetensors && "
              "%s run --model %s --tokens 1,2 --max-new 1 --ids 2>&1", t_bin(), d, d, t_bin(), d);
    CHECK(rc == 1 && strstr(out, "changed since its spine was converted") && strstr(out, "model.safetensors"), "%s", out);
}

/* kill -9 mid-shard, then again: the shards of a clean conversion */
static int kill_at, calls;
static void kill_progress(void *ctx, int64_t done, int64_t total, int shard, int n) {
    (void)ctx; (void)done; (void)total; (void)shard; (void)n;
    if (++calls == kill_at) raise(SIGKILL);
}
static void count_progress(void *ctx, int64_t done, int64_t total, int shard, int n) {
    (void)done; (void)total; (void)shard; (void)n;
    ++*(int *)ctx;
}

static int manifest_hashes(const char *dir, char *buf, size_t cap) {
    char p[700];
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    json_t *m = json_load_file(p, 0, NULL);
    if (!m) return -1;
    buf[0] = 0;
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(m, "shards"), i, v) {
        size_t u = strlen(buf);
        snprintf(buf + u, cap - u, "%s=%s\n", json_string_value(json_object_get(v, "file")),
                 json_string_value(json_object_get(v, "sha256")));
    }
    json_decref(m);
    return 0;
}

TEST(s8_resumes_after_kill) {
    /* a vocabulary of 20000 makes the head shard several row blocks */
    const char *d = synth("s8_kill", "--vocab 40000");
    REQUIRE(d, "synth: %s", out);
    char clean[700], killed[700], a[4096], b[4096], err[DF_ERRMSG];
    snprintf(clean, sizeof clean, "%s/clean", d);
    snprintf(killed, sizeof killed, "%s/int8-spine", d);
    s8_opts o;
    memset(&o, 0, sizeof o);
    o.out = clean;
    int total = 0;
    o.progress = count_progress;
    o.progress_ctx = &total;
    s8_report r;
    REQUIRE(s8_convert(d, &o, &r, err) == DF_OK, "%s", err);
    REQUIRE(total >= 8, "progress calls %d", total);
    int kills = 0;
    /* killed a quarter, then (counting again from the resumed start) a
     * third and half of the way: at row blocks and between shards */
    int at_list[3] = {total / 4, total / 3, total / 2};
    for (int ai = 0; ai < 3; ai++) {
        int at = at_list[ai];
        pid_t pid = fork();
        if (pid == 0) {
            s8_opts k;
            memset(&k, 0, sizeof k);
            kill_at = at;
            k.progress = kill_progress;
            s8_report kr;
            char e2[DF_ERRMSG];
            s8_convert(d, &k, &kr, e2);
            _exit(0);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        kills += WIFSIGNALED(status);
        char p[800];
        snprintf(p, sizeof p, "%s/manifest.json", killed);
        CHECK(!WIFSIGNALED(status) || access(p, F_OK) != 0, "no manifest after a kill at call %d", at);
    }
    CHECK(kills == 3, "the conversion was killed %d times", kills);
    memset(&o, 0, sizeof o);
    REQUIRE(s8_convert(d, &o, &r, err) == DF_OK, "%s", err);
    CHECK(r.shards_skipped > 0, "shards kept from the killed runs: %d", r.shards_skipped);
    REQUIRE(manifest_hashes(clean, a, sizeof a) == 0 && manifest_hashes(killed, b, sizeof b) == 0);
    CHECK(!strcmp(a, b), "resumed shards differ from a clean conversion:\n%s\nvs\n%s", a, b);
    int rc = t_sh(out, sizeof out, "ls %s | grep -c tmp", killed);
    CHECK(atoi(out) == 0, "no temporary file left: %s", out);
    (void)rc;
}

TEST(s8_eval_against_base_logits) {
    const char *d = t_tmpdir("s8_eval");
    REQUIRE(d);
    int rc = t_sh(out, sizeof out,
                  "gunzip -c tests/text/cl100k_base.tiktoken.gz > %s/ranks && %s synth --arch kimi_k3 --tokenizer %s/ranks "
                  "--out %s/m --quiet && head -c 4000 src/model/engine.c > %s/text",
                  d, t_bin(), d, d, d);
    REQUIRE(rc == 0, "%s", out);
    rc = t_sh(out, sizeof out, "%s eval --model %s/m --text-file %s/text --ctx 48 --save-logits %s/base.lg --json 2>&1",
              t_bin(), d, d, d);
    REQUIRE(rc == 0 && strstr(out, "\"ppl\":"), "%s", out);
    rc = t_sh(out, sizeof out, "%s eval --model %s/m --text-file %s/text --ctx 48 --base-logits %s/base.lg --json 2>&1",
              t_bin(), d, d, d);
    CHECK(rc == 0 && strstr(out, "\"kl_mean\":0.0,") && strstr(out, "\"top1_agreement\":1.0"), "%s", out);
    rc = t_sh(out, sizeof out, "%s convert-spine %s/m >/dev/null 2>&1 && %s eval --model %s/m --text-file %s/text --ctx 48 "
              "--base-logits %s/base.lg 2>&1", t_bin(), d, t_bin(), d, d, d);
    CHECK(rc == 0 && strstr(out, "LOSSY int8 spine") && strstr(out, "KL divergence mean"), "%s", out);
    rc = t_sh(out, sizeof out, "%s eval --model %s/m --text-file %s/text --ctx 32 --base-logits %s/base.lg 2>&1", t_bin(),
              d, d, d);
    CHECK(rc == 1 && strstr(out, "ctx 48"), "another window is refused: %s", out);
}
