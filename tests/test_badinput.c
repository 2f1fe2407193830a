/* test_badinput.c — whole-model bad input through the CLI (suite bad_), and
 * the weight formats against an independent decoder (suite fmtfix_).
 *
 * bad_: each case copies a good fixture into a temporary directory, breaks
 * one thing, and requires `deltafin run` to exit 1 with one message naming
 * the file / tensor / field, without crashing (ASan runs these too).
 * fmtfix_: tests/fixtures/formats/quant.safetensors holds one matrix per
 * stored type; decoded.safetensors holds their float32 values computed by
 * numpy/torch on the fixture machine. Every value must decode bit-exactly.
 */
#include "test.h"
#include "../src/format/safetensors.h"
#include "../src/format/weight.h"
#include "../src/kernels/kernels.h"
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#define GOOD "tests/fixtures/dsv3_qlora"
#define PROMPT "1,2,3"

/* Copies GOOD into a fresh temp dir, runs `fix` (a shell snippet run inside
 * it), then `deltafin run`; returns its exit status and output. */
static int run_broken_from(const char *good, const char *tag, const char *fix, char *out, size_t cap) {
    const char *d = t_tmpdir(tag);
    if (!d) return -100;
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cp -r %s/. %s/ && cd %s && %s", good, d, d, fix);
    if (t_sh(out, cap, "%s", cmd) != 0) return -101;
    return t_sh(out, cap, "%s run --model %s --tokens " PROMPT " --max-new 2 --ids", t_bin(), d);
}

static int run_broken(const char *tag, const char *fix, char *out, size_t cap) {
    return run_broken_from(GOOD, tag, fix, out, cap);
}

#define EXPECT_FAIL_FROM(good, tag, fix, needle1, needle2)                         \
    do {                                                                          \
        char out_[8192];                                                          \
        int rc_ = run_broken_from(good, tag, fix, out_, sizeof out_);             \
        CHECK(rc_ == 1, "%s: exit %d (want 1): %s", tag, rc_, out_);              \
        CHECK(strstr(out_, needle1) != NULL, "%s: message lacks '%s': %s", tag, needle1, out_); \
        CHECK(strstr(out_, needle2) != NULL, "%s: message lacks '%s': %s", tag, needle2, out_); \
    } while (0)

#define EXPECT_FAIL(tag, fix, needle1, needle2)                                    \
    do {                                                                          \
        char out_[8192];                                                          \
        int rc_ = run_broken(tag, fix, out_, sizeof out_);                        \
        CHECK(rc_ == 1, "%s: exit %d (want 1): %s", tag, rc_, out_);              \
        CHECK(strstr(out_, needle1) != NULL, "%s: message lacks '%s': %s", tag, needle1, out_); \
        CHECK(strstr(out_, needle2) != NULL, "%s: message lacks '%s': %s", tag, needle2, out_); \
        CHECK(strstr(out_, "internal error") == NULL && strstr(out_, "Sanitizer") == NULL, \
              "%s: crashed: %s", tag, out_);                                     \
    } while (0)

TEST(bad_truncated_shard) {
    EXPECT_FAIL("trunc", "truncate -s 500000 model-00002-of-00002.safetensors",
                "model-00002-of-00002.safetensors", "past");
}

TEST(bad_header_length_past_end) {
    EXPECT_FAIL("hdrlen",
                "printf '\\377\\377\\377\\000\\000\\000\\000\\000' | dd of=model-00001-of-00002.safetensors "
                "bs=1 count=8 conv=notrunc 2>/dev/null",
                "model-00001-of-00002.safetensors", "header");
}

TEST(bad_missing_shard) {
    EXPECT_FAIL("noshard", "rm model-00002-of-00002.safetensors", "model-00002-of-00002.safetensors", "");
}

TEST(bad_missing_tensor) {
    /* rename the tensor (same length) in its shard and in the index */
    EXPECT_FAIL("notensor",
                "python3 -c \"import json,glob;o=b'experts.3.up_proj';n=b'experts.3.up_prxj';"
                "ps=glob.glob('*.safetensors')+['model.safetensors.index.json'];"
                "bs=[open(p,'rb').read() for p in ps];[open(p,'wb').write(b.replace(o,n)) for p,b in zip(ps,bs)]\"",
                "model.layers.1.mlp.experts.3.up_proj", "not found");
}

TEST(bad_shape_disagrees_with_config) {
    EXPECT_FAIL("shape",
                "python3 -c \"import json;p='config.json';j=json.load(open(p));j['moe_intermediate_size']+=8;"
                "json.dump(j,open(p,'w'))\"",
                "gate_proj.weight", "expected");
}

TEST(bad_config_absurd_field) {
    EXPECT_FAIL("absurd",
                "python3 -c \"import json;p='config.json';j=json.load(open(p));j['hidden_size']=-4;"
                "json.dump(j,open(p,'w'))\"",
                "config.json", "hidden_size");
}

TEST(bad_config_missing_field) {
    EXPECT_FAIL("missingfield",
                "python3 -c \"import json;p='config.json';j=json.load(open(p));del j['num_hidden_layers'];"
                "json.dump(j,open(p,'w'))\"",
                "config.json", "num_hidden_layers");
}

TEST(bad_config_not_json) {
    EXPECT_FAIL("notjson", "echo '{\"hidden_size\": 96,' > config.json", "config.json", "");
}

TEST(bad_unknown_dtype) {
    /* rewrite one dtype in the first shard's header to an unknown name of the same length */
    EXPECT_FAIL("dtype",
                "python3 -c \"p='model-00001-of-00002.safetensors';b=bytearray(open(p,'rb').read());"
                "i=b.index(b'\\\"BF16\\\"');b[i+1:i+5]=b'BX16';open(p,'wb').write(bytes(b))\"",
                "model-00001-of-00002.safetensors", "BX16");
}

/* ---- K3 configs: refused before any weight is read, naming the field ---- */

#define K3 "tests/fixtures/kimi_k3_mxfp4"
#define K3EDIT(code) "python3 -c \"import json;p='config.json';j=json.load(open(p));t=j['text_config'];" code ";json.dump(j,open(p,'w'))\""

TEST(bad_k3_layer_lists_overlap) {
    EXPECT_FAIL_FROM(K3, "k3overlap", K3EDIT("t['linear_attn_config']['kda_layers']=[1,2,3,4]"), "kda_layers", "twice");
}

TEST(bad_k3_layer_lists_leave_a_gap) {
    EXPECT_FAIL_FROM(K3, "k3gap", K3EDIT("t['linear_attn_config']['kda_layers']=[1,2]"), "layer 4", "neither");
}

TEST(bad_k3_latent_size_disagrees) {
    EXPECT_FAIL_FROM(K3, "k3latent", K3EDIT("t['routed_expert_hidden_size']=72"), "routed_expert", "expected");
}

TEST(bad_k3_unknown_activation) {
    EXPECT_FAIL_FROM(K3, "k3act", K3EDIT("t['hidden_act']='gelu'"), "hidden_act", "gelu");
}

TEST(bad_k3_unsupported_quantization) {
    EXPECT_FAIL_FROM(K3, "k3quant", K3EDIT("t['quantization_config']['format']='nvfp4-pack-quantized'"), "quantization",
                     "nvfp4");
}

TEST(bad_k3_missing_linear_attn_config) {
    EXPECT_FAIL_FROM(K3, "k3lac", K3EDIT("del t['linear_attn_config']"), "linear_attn_config", "missing");
}

TEST(bad_usage_exit_code) {
    char out[4096];
    int rc = t_sh(out, sizeof out, "%s run --model " GOOD, t_bin());
    CHECK(rc == 2, "missing --tokens: exit %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens 1,x,3", t_bin());
    CHECK(rc == 2, "bad token list: exit %d: %s", rc, out);
    /* sizes past int64, inf and nan are refused, not cast (fuzz_cli_args found 5e96) */
    const char *sizes[] = {"5e96", "inf", "nan", "9.3e18", "8E", "-1K"};
    for (int i = 0; i < 6; i++) {
        rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens 1 --ram %s", t_bin(), sizes[i]);
        CHECK(rc == 2 && strstr(out, "bad size for --ram"), "--ram %s: exit %d: %s", sizes[i], rc, out);
    }
    rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens 1 --spine-copy later", t_bin());
    CHECK(rc == 2 && strstr(out, "--spine-copy must be idle, open or off"), "--spine-copy later: exit %d: %s", rc, out);
    /* every mode gives the same ids */
    char ids[3][256];
    const char *modes[3] = {"idle", "open", "off"};
    for (int i = 0; i < 3; i++) {
        rc = t_sh(ids[i], sizeof ids[i], "%s run --model " GOOD " --tokens 3,1,4 --max-new 4 --ids --spine-copy %s 2>/dev/null",
                  t_bin(), modes[i]);
        CHECK(rc == 0 && (i == 0 || !strcmp(ids[i], ids[0])), "--spine-copy %s: exit %d: %s", modes[i], rc, ids[i]);
    }
    rc = t_sh(out, sizeof out, "%s frobnicate", t_bin());
    CHECK(rc == 2, "unknown command: exit %d", rc);
    rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens 1,99999 --max-new 1", t_bin());
    CHECK(rc == 1 && strstr(out, "vocabulary"), "out-of-vocab token: exit %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s --help && %s run --help && %s logits --help && %s inspect --help && %s bench --help",
              t_bin(), t_bin(), t_bin(), t_bin(), t_bin());
    CHECK(rc == 0 && strstr(out, "usage"), "help: exit %d", rc);
}

/* --cpus: a list this process cannot use, a CPU listed twice or fewer CPUs
 * than --threads is a usage error that says so; a good list gives the same
 * ids as no list, and bench reports the pinning. */
TEST(cli_cpus_pin_or_say_why) {
    cpu_set_t set;
    CPU_ZERO(&set);
    REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0, "sched_getaffinity");
    int first = -1, second = -1, outside = -1;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) { if (first < 0) first = c; else if (second < 0) second = c; }
        else if (outside < 0) outside = c;
    char out[4096], plain[4096], list[64];
    snprintf(list, sizeof list, second >= 0 ? "%d,%d" : "%d", second >= 0 ? second : first, first);
    int rc = t_sh(plain, sizeof plain, "%s run --model " GOOD " --tokens " PROMPT " --max-new 4 --ids --threads %d",
                  t_bin(), second >= 0 ? 2 : 1);
    CHECK(rc == 0, "unpinned: exit %d: %s", rc, plain);
    rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens " PROMPT " --max-new 4 --ids --cpus %s", t_bin(), list);
    CHECK(rc == 0 && !strcmp(out, plain), "--cpus %s: exit %d: '%s', unpinned '%s'", list, rc, out, plain);
    if (outside >= 0) {
        rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens " PROMPT " --cpus %d", t_bin(), outside);
        CHECK(rc == 2 && strstr(out, "--cpus") && strstr(out, "may run on"), "CPU %d: exit %d: %s", outside, rc, out);
    }
    rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens " PROMPT " --cpus %d,%d", t_bin(), first, first);
    CHECK(rc == 2 && strstr(out, "listed twice"), "twice: exit %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens " PROMPT " --cpus %d --threads 3", t_bin(), first);
    CHECK(rc == 2 && strstr(out, "--threads 3"), "--threads past the list: exit %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s run --model " GOOD " --tokens " PROMPT " --cpus 0-x", t_bin());
    CHECK(rc == 2 && strstr(out, "CPU list"), "syntax: exit %d: %s", rc, out);
    rc = t_sh(out, sizeof out,
              "%s bench --decode --model " GOOD " --tokens 2 --prompt-tokens 2 --probe-seconds 0.05 --json --cpus %s "
              "2>/dev/null",
              t_bin(), list);
    char want[96];
    snprintf(want, sizeof want, "\"cpus\":[%s]", list);
    CHECK(rc == 0 && strstr(out, want), "bench: exit %d, want %s: %s", rc, want, out);
}

/* bench's JSON `"KEY":V` and `"KEY_probes":[P0,P1]` (0 where absent) */
static void json_rate_probes(const char *out, const char *key, double *v, double *p0, double *p1) {
    char k[64], kp[72];
    snprintf(k, sizeof k, "\"%s\":", key);
    snprintf(kp, sizeof kp, "\"%s_probes\":[", key);
    const char *g = strstr(out, k), *p = strstr(out, kp);
    *v = g ? strtod(g + strlen(k), NULL) : 0;
    *p0 = *p1 = 0;
    if (p) {
        char *end;
        *p0 = strtod(p + strlen(kp), &end);
        *p1 = *end == ',' ? strtod(end + 1, NULL) : 0;
    }
}

/* bench --warmup: the warm-up tokens are decoded (the session holds them)
 * and stay out of the figures; with --prefill-again the first token after
 * the prompt is still the one compared; refused beside --spec and below 0.
 * --prefill-again N: N warm prompts, each run's time listed; 0 refused. The
 * memory and compute floors' rates: each the better of two probes. */
TEST(bench_warmup_stays_out_of_the_figures) {
    char out[16384];
    int rc = t_sh(out, sizeof out,
                  "%s bench --decode --model " GOOD " --tokens 2 --prompt-tokens 3 --warmup 4 --probe-seconds 0.05 "
                  "--prefill-again 3 --json 2>/dev/null",
                  t_bin());
    CHECK(rc == 0 && strstr(out, "\"decode_warmup_tokens\":4") && strstr(out, "\"decode_tokens\":2"), "exit %d: %s",
          rc, out);
    CHECK(strstr(out, "\"prefill_again_same_token\":true"), "the first token after the prompt: %s", out);
    const char *runs = strstr(out, "\"prefill_again_runs_s\":[");
    int commas = 0;
    for (const char *c = runs ? strchr(runs, '[') : NULL; c && *c && *c != ']'; c++) commas += *c == ',';
    CHECK(runs && commas == 2, "three warm prompts, each listed: %s", out);
    /* the memory floor's rate and the compute floor's: each the better of
     * its probes before and after */
    const char *const rate[2] = {"dram_gbps", "fma_gflops"};
    for (int k = 0; k < 2; k++) {
        double v, p0, p1;
        json_rate_probes(out, rate[k], &v, &p0, &p1);
        CHECK(v > 0 && p0 > 0 && p1 > 0 && v == (p0 > p1 ? p0 : p1), "%s %g of the probes %g, %g: %s", rate[k], v, p0,
              p1, out);
    }
    rc = t_sh(out, sizeof out, "%s bench --decode --model " GOOD " --prefill-again 0 2>&1", t_bin());
    CHECK(rc == 2 && strstr(out, "--prefill-again"), "zero runs: exit %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s bench --decode --model " GOOD " --warmup 2 --spec ngram 2>&1", t_bin());
    CHECK(rc == 2 && strstr(out, "--warmup"), "beside --spec: exit %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s bench --decode --model " GOOD " --warmup -1 2>&1", t_bin());
    CHECK(rc == 2 && strstr(out, "--warmup"), "negative: exit %d: %s", rc, out);
}

/* ---- formats fixture ---- */

static st_set *open_one(const char *file, const char *tag) {
    const char *d = t_tmpdir(tag);
    char out[512];
    if (!d || t_sh(out, sizeof out, "ln -s \"$PWD/%s\" %s/", file, d) != 0) return NULL;
    st_set *s = NULL;
    char err[DF_ERRMSG];
    if (st_open_dir(d, df_io_default(), 1, &s, err) != DF_OK) {
        fprintf(stderr, "    %s: %s\n", file, err);
        return NULL;
    }
    return s;
}

TEST(fmtfix_every_type_decodes_exactly) {
    st_set *q = open_one("tests/fixtures/formats/quant.safetensors", "fq");
    st_set *d = open_one("tests/fixtures/formats/decoded.safetensors", "fd");
    if (!q || !d) { st_close(q); st_close(d); SKIP("formats fixture not present"); }
    static const char *names[] = {"bf16_a", "f16_a", "f32_a", "fp8_a", "int4_a", "int4_b", "mxfp4_a"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char err[DF_ERRMSG];
        const st_tensor *ref = st_find(d, names[i]);
        CHECK(ref && ref->ndim == 2, "%s: no decoded values", names[i]);
        if (!ref) continue;
        int64_t rows = ref->shape[0], cols = ref->shape[1];
        df_weight w = {0};
        df_status st = DF_OK;
        const st_tensor *plain = st_find(q, names[i]); /* bf16/f16/f32 are stored bare */
        if (plain) {
            w.type = plain->dtype == DT_BF16 ? WT_BF16 : plain->dtype == DT_F16 ? WT_F16 : WT_F32;
            w.rows = rows;
            w.cols = cols;
            w.data = st_data(q, plain, err);
        } else {
            st = wt_bind(q, names[i], rows, cols, 128, 128, &w, err);
        }
        CHECK(st == DF_OK, "%s: %s", names[i], err);
        if (st != DF_OK) continue;
        const float *want = st_data(d, ref, err);
        float *row = malloc((size_t)cols * sizeof(float));
        int64_t bad = 0;
        for (int64_t r = 0; r < rows; r++) {
            kn_dequant_row(&w, r, row);
            for (int64_t c = 0; c < cols; c++)
                if (memcmp(&row[c], &want[r * cols + c], sizeof(float)) != 0) {
                    if (!bad)
                        fprintf(stderr, "    %s[%lld][%lld]: got %g want %g\n", names[i], (long long)r,
                                (long long)c, row[c], want[r * cols + c]);
                    bad++;
                }
        }
        free(row);
        CHECK(bad == 0, "%s: %lld values differ from the independent decode", names[i], (long long)bad);
    }
    st_close(q);
    st_close(d);
}
