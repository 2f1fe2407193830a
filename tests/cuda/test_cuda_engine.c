/* test_cuda_engine.c — `deltafin-cuda --device cuda` against `--device cpu`
 * on every reference fixture (suite cuda_engine_). Needs a GPU; skips,
 * saying why, without one. The binary is DF_CUDA_BIN (default
 * build/deltafin-cuda, built by `make cuda`).
 *
 * Checks per fixture (tests/fixtures/<name>/reference.json):
 *  - run --ids: the 8 greedy ids after `prompt` are identical on cuda and
 *    cpu (and equal to the reference `greedy`);
 *  - logits over `tokens`: max |cuda - cpu| <= 1e-4 * max |cpu logit|
 *    (the GPU kernels differ from the CPU ones only by summation order);
 *  - logits with --gpu-mem 1M (every routed expert uploaded per use, most
 *    matrices transient), with --gpu-mem 200K --expert-cache 1K (device evictions,
 *    spare copies refilled under queued experts, a two-slot RAM cache whose
 *    slots are reused while uploads may read them) and with --expert-cache 1K alone
 *    are bit-identical to the default budget: placement never changes the
 *    result;
 *  - KDA and MLA on the device (synth's tiny kimi_k3 / kimi_linear /
 *    kimi_k2 / deepseek_v3, bf16): logits within 1e-4 max|logit| of the
 *    CPU's, greedy ids equal, bit-identical across --gpu-mem, bench reports
 *    the device steps.
 */
#include "../test.h"
#include "../../src/cuda/gpu.h"
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *bin(void) {
    const char *b = getenv("DF_CUDA_BIN");
    return b && *b ? b : "build/deltafin-cuda";
}

static int have_gpu(void) {
    char why[256];
    if (!gpu_probe(why, sizeof why)) { t_skip(why); return 0; }
    FILE *f = fopen(bin(), "rb");
    if (!f) { t_skip("no build/deltafin-cuda (make cuda)"); return 0; }
    fclose(f);
    return 1;
}

/* Reads the integer array `key` of a reference.json into ids (comma list). */
static int json_ids(const char *path, const char *key, char *out, size_t cap) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    char *p = strstr(buf, pat);
    if (!p || !(p = strchr(p, '['))) return -1;
    p++;
    size_t o = 0;
    int cnt = 0;
    while (*p && *p != ']') {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p) { p++; continue; }
        o += (size_t)snprintf(out + o, cap - o, cnt ? ",%ld" : "%ld", v);
        cnt++;
        p = end;
    }
    return cnt;
}

static int list(char names[][256], int cap) {
    glob_t g;
    if (glob("tests/fixtures/*/reference.json", 0, NULL, &g) != 0) return 0;
    int n = 0;
    for (size_t i = 0; i < g.gl_pathc && n < cap; i++) {
        const char *p = g.gl_pathv[i] + strlen("tests/fixtures/");
        const char *slash = strchr(p, '/');
        snprintf(names[n++], 256, "%.*s", (int)(slash - p), p);
    }
    globfree(&g);
    return n;
}

static float *read_floats(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    float *v = malloc((size_t)sz + 4);
    *n = v && fread(v, 1, (size_t)sz, f) == (size_t)sz ? (size_t)sz / 4 : 0;
    fclose(f);
    return v;
}

/* `deltafin logits` over tokens with each of the n device options dev[d],
 * written to <dir>/<stem><d>.bin and read back into lg[d] (NULL when
 * unread; the caller frees) of nl[d] floats. A failing run fails the test,
 * naming `name`; out (cap bytes) holds the last run's output. 1 when every
 * lg[d] was read, all of the same nonzero length nl[0]. */
static int device_logits(const char *model, const char *tokens, const char *dir, const char *stem, const char *name,
                         const char *const *dev, int n, float **lg, size_t *nl, char *out, size_t cap) {
    int same = 1;
    for (int d = 0; d < n; d++) {
        char path[900];
        snprintf(path, sizeof path, "%.600s/%.200s%d.bin", dir, stem, d);
        int rc = t_sh(out, cap, "%s logits --model %s --tokens %s --out %s --device %s", bin(), model, tokens, path,
                      dev[d]);
        CHECK(rc == 0, "%s logits %s: %s", name, dev[d], out);
        lg[d] = read_floats(path, &nl[d]);
    }
    for (int d = 0; d < n; d++) same &= lg[d] && nl[d] == nl[0];
    return same && nl[0];
}

/* `deltafin synth` of arch's tiny preset (seed 7) into <tmp>/<arch>, its
 * path in model[600]; the exit status (out holds the output). */
static int synth_tiny(const char *tmp, const char *arch, char model[600], char *out, size_t cap) {
    snprintf(model, 600, "%.400s/%s", tmp, arch);
    return t_sh(out, cap, "%s synth --arch %s --preset tiny --seed 7 --out %s", bin(), arch, model);
}

/* lg[0] (cpu), lg[1] (cuda), lg[2] (cuda --gpu-mem 1M) of n floats each:
 * max |cuda - cpu| within 1e-4 max|cpu logit| and the two device runs
 * bit-identical; prints the margin, labelled `what`. */
static void check_three(const char *name, const char *what, float *const lg[3], size_t n) {
    double mx = 0, md = 0;
    for (size_t k = 0; k < n; k++) {
        mx = fmax(mx, fabs(lg[0][k]));
        md = fmax(md, fabs((double)lg[1][k] - lg[0][k]));
    }
    CHECK(md <= 1e-4 * mx, "%s, %s: max |cuda - cpu| %.3g > %.3g", name, what, md, 1e-4 * mx);
    CHECK(!memcmp(lg[1], lg[2], n * 4), "%s, %s: logits depend on --gpu-mem", name, what);
    fprintf(stderr, "    %-12s %s: max|d| %.3g = %.3f of tol\n", name, what, md, mx > 0 ? md / (1e-4 * mx) : 0);
}

enum { ND = 5 }; /* device configurations compared per fixture */

TEST(cuda_engine_fixtures) {
    if (!have_gpu()) return;
    char names[32][256];
    int nf = list(names, 32);
    if (!nf) SKIP("no fixtures");
    const char *tmp = t_tmpdir("cuda_engine");
    for (int i = 0; i < nf; i++) {
        char ref[512], prompt[4096], tokens[4096], greedy[4096], out[8192], ids_cpu[4096], ids_gpu[4096];
        char model[300];
        snprintf(model, sizeof model, "tests/fixtures/%.200s", names[i]);
        snprintf(ref, sizeof ref, "%s/reference.json", model);
        REQUIRE(json_ids(ref, "prompt", prompt, sizeof prompt) > 0, "%s: prompt", names[i]);
        REQUIRE(json_ids(ref, "tokens", tokens, sizeof tokens) > 0, "%s: tokens", names[i]);
        int ng = json_ids(ref, "greedy", greedy, sizeof greedy);
        int rc = t_sh(ids_cpu, sizeof ids_cpu, "%s run --model %s --tokens %s --max-new %d --ids --device cpu", bin(),
                      model, prompt, ng);
        CHECK(rc == 0, "%s cpu run: %s", names[i], ids_cpu);
        rc = t_sh(ids_gpu, sizeof ids_gpu, "%s run --model %s --tokens %s --max-new %d --ids --device cuda", bin(),
                  model, prompt, ng);
        CHECK(rc == 0, "%s cuda run: %s", names[i], ids_gpu);
        CHECK(!strcmp(ids_cpu, ids_gpu), "%s: greedy ids differ: cpu '%s' cuda '%s'", names[i], ids_cpu, ids_gpu);
        /* logits */
        /* the last two: a device cache with evictions and reused spare copies,
         * over a RAM cache of two slots (slots reused under queued uploads) */
        const char *dev[ND] = {"cpu", "cuda", "cuda --gpu-mem 1M", "cuda --gpu-mem 200K --expert-cache 1K",
                               "cuda --expert-cache 1K"};
        float *lg[ND] = {0};
        size_t nl[ND] = {0};
        char stem[210];
        snprintf(stem, sizeof stem, "%.200s_", names[i]);
        if (device_logits(model, tokens, tmp, stem, names[i], dev, ND, lg, nl, out, sizeof out)) {
            double mx = 0, md = 0;
            for (size_t k = 0; k < nl[0]; k++) {
                mx = fmax(mx, fabs(lg[0][k]));
                md = fmax(md, fabs((double)lg[1][k] - lg[0][k]));
            }
            double tol = 1e-4 * mx;
            CHECK(md <= tol, "%s: max |cuda - cpu| %.3g > %.3g", names[i], md, tol);
            for (int d = 2; d < ND; d++)
                CHECK(!memcmp(lg[1], lg[d], nl[0] * 4), "%s: logits with '%s' differ from plain cuda", names[i],
                      dev[d]);
            fprintf(stderr, "    %-20s ids %s | max|d| %.3g = %.3f of tol (max|logit| %.2f)\n", names[i],
                    !strcmp(ids_cpu, ids_gpu) ? "equal" : "DIFFER", md, tol > 0 ? md / tol : 0, mx);
        } else {
            CHECK(0, "%s: logits files missing or of different sizes", names[i]);
        }
        for (int d = 0; d < ND; d++) free(lg[d]);
    }
}

TEST(cuda_engine_inspect_placement) {
    if (!have_gpu()) return;
    char out[16384];
    int rc = t_sh(out, sizeof out, "%s inspect --model tests/fixtures/kimi_k3_mxfp4", bin());
    CHECK(rc == 0, "%s", out);
    CHECK(strstr(out, "device         cuda:0") != NULL, "inspect names the device: %s", out);
    CHECK(strstr(out, "gpu placement") != NULL, "inspect shows the placement: %s", out);
    rc = t_sh(out, sizeof out, "%s inspect --model tests/fixtures/kimi_k3_mxfp4 --device cpu", bin());
    CHECK(rc == 0 && strstr(out, "device         cpu") != NULL, "%s", out);
}

/* Attention on the device (the state hooks with kda / mla): the fixtures'
 * KDA head dims (20, 24) have no kernel and their kv_b is f32, so their
 * states stay on the CPU; synth's tiny models have KDA head dim 32 and bf16
 * weights (Kimi K3 and Kimi-Linear: KDA + NoPE MLA; Kimi-K2 and
 * DeepSeek-V3: MLA with RoPE, YaRN on K2). Logits within 1e-4 max|logit| of the CPU's, the same greedy ids,
 * bit-identical across --gpu-mem, and bench reports KDA and MLA steps on
 * the device. */
TEST(cuda_engine_attention_on_device) {
    if (!have_gpu()) return;
    const char *tmp = t_tmpdir("cuda_kda");
    static const char *arch[4] = {"kimi_k3", "kimi_linear", "kimi_k2", "deepseek_v3"};
    const char *toks = "5,17,300,2,901,44,7,7,512,3,88,61,250,9,1000,12,33,64,128,255";
    for (int i = 0; i < 4; i++) {
        const int has_kda = i < 2; /* the DeepSeek-V3 family has MLA only (with RoPE) */
        char model[600], out[16384];
        int rc = synth_tiny(tmp, arch[i], model, out, sizeof out);
        REQUIRE(rc == 0, "synth %s: %s", arch[i], out);
        const char *dev[3] = {"cpu", "cuda", "cuda --gpu-mem 1M"};
        float *lg[3] = {0};
        size_t nl[3] = {0};
        if (device_logits(model, toks, model, "l", arch[i], dev, 3, lg, nl, out, sizeof out)) {
            check_three(arch[i], "attention on the device", lg, nl[0]);
        } else {
            CHECK(0, "%s: logits missing", arch[i]);
        }
        for (int d = 0; d < 3; d++) free(lg[d]);
        char ids[2][4096];
        for (int d = 0; d < 2; d++) {
            rc = t_sh(ids[d], sizeof ids[d], "%s run --model %s --tokens %s --max-new 8 --ids --device %s", bin(),
                      model, toks, d ? "cuda" : "cpu");
            CHECK(rc == 0, "%s run: %s", arch[i], ids[d]);
        }
        CHECK(!strcmp(ids[0], ids[1]), "%s: greedy ids differ: cpu '%s' cuda '%s'", arch[i], ids[0], ids[1]);
        rc = t_sh(out, sizeof out, "%s bench --decode --model %s --tokens 3 --prompt-tokens 4 --device cuda", bin(),
                  model);
        const char *steps = strstr(out, "attention on the device");
        double kda = 0, mla = 0;
        int got = steps ? sscanf(steps, "attention on the device %lf KDA + %lf MLA", &kda, &mla) : 0;
        CHECK(rc == 0 && got == 2 && (kda > 0) == has_kda && mla > 0,
              "%s: bench does not report KDA and MLA on the device: %s", arch[i], out);
    }
}

/* --spine stream on the device: once the first step has uploaded every
 * layer group, decode reads no spine bytes (bench: "spine 0.0" MB per
 * token, every group entered from its device copies), and the logits are
 * bit-identical to --spine resident on the device, also when nothing fits
 * (--gpu-mem 1M: every group read and uploaded per use). */
TEST(cuda_engine_stream_spine_on_device) {
    if (!have_gpu()) return;
    const char *tmp = t_tmpdir("cuda_stream");
    static const char *arch[2] = {"kimi_k3", "deepseek_v3"};
    const char *toks = "5,17,300,2,901,44,7,7,512,3,88,61,250,9,1000,12,33,64,128,255";
    for (int i = 0; i < 2; i++) {
        char model[600], out[16384];
        int rc = synth_tiny(tmp, arch[i], model, out, sizeof out);
        REQUIRE(rc == 0, "synth %s: %s", arch[i], out);
        const char *dev[3] = {"cuda --spine resident", "cuda --spine stream", "cuda --spine stream --gpu-mem 1M"};
        float *lg[3] = {0};
        size_t nl[3] = {0};
        if (device_logits(model, toks, model, "s", arch[i], dev, 3, lg, nl, out, sizeof out)) {
            CHECK(!memcmp(lg[0], lg[1], nl[0] * 4), "%s: --spine stream changes the logits", arch[i]);
            CHECK(!memcmp(lg[0], lg[2], nl[0] * 4), "%s: --spine stream --gpu-mem 1M changes the logits", arch[i]);
        } else {
            CHECK(0, "%s: logits missing", arch[i]);
        }
        for (int d = 0; d < 3; d++) free(lg[d]);
        rc = t_sh(out, sizeof out, "%s bench --decode --model %s --tokens 4 --prompt-tokens 4 --spine stream --device cuda",
                  bin(), model);
        const char *r = strstr(out, "bytes read per token");
        double all = -1, ex = -1, sp = -1;
        int got = r ? sscanf(r, "bytes read per token %lf MB (experts %lf + spine %lf", &all, &ex, &sp) : 0;
        CHECK(rc == 0 && got == 3 && sp == 0.0, "%s: decode with --spine stream on the device read %.1f MB of spine "
              "per token: %s", arch[i], sp, out);
        const char *g = strstr(out, "streamed spine on device");
        fprintf(stderr, "    %-12s --spine stream: %.1f MB spine read per token; %.80s\n", arch[i], sp, g ? g : "?");
    }
}

/* The rows of an `eval --save-logits` file (cmd_eval.c: "DFLG", u32 version,
 * vocab, ctx, windows, scored rows; window tokens; rows), into *n floats. */
static float *eval_rows(const char *path, size_t *n) {
    size_t all = 0;
    float *v = read_floats(path, &all);
    *n = 0;
    if (!v || all < 6) { free(v); return NULL; }
    const uint32_t *u = (const uint32_t *)v;
    size_t head = 6 + (size_t)u[3] * u[4];
    if (all < head) { free(v); return NULL; }
    *n = all - head;
    memmove(v, v + head, *n * sizeof(float));
    return v;
}

/* n token ids ((i * 7919 + 13) mod 1000) as int32 into dir/toks.i32 (the
 * path into path); 0 on success. */
static int write_ids(const char *dir, int n, char path[600]) {
    snprintf(path, 600, "%.500s/toks.i32", dir);
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    for (int i = 0; i < n; i++) {
        int32_t id = (int32_t)((i * 7919 + 13) % 1000);
        if (fwrite(&id, 4, 1, f) != 1) { fclose(f); return -1; }
    }
    return fclose(f) == 0 ? 0 : -1;
}

/* The number after "key": in a JSON object printed by bench --json, or -1. */
static double json_field(const char *out, const char *key) {
    char k[96];
    snprintf(k, sizeof k, "\"%s\"", key);
    const char *p = strstr(out, k);
    if (!p || !(p = strchr(p + strlen(k), ':'))) return -1;
    return atof(p + 1);
}

/* The decode step with its activations on the device (km_forward_dev over
 * the dev_ hooks: norms, attention residuals and the residual stream on the
 * device, one host wait per MoE layer): synth's tiny Kimi K3 and
 * Kimi-Linear (their attention states fit the kernels) decoded one token at
 * a time (`eval --chunk 1`): every row within 1e-4 max|logit| of the CPU's,
 * bit-identical across --gpu-mem (and with --bf16-tc-rows 1, across chunk
 * 1 and 24), the greedy ids of `run` equal, and bench
 * reports the host waits per decoded token (printed). Prompts (rows of one
 * pass, the experts' rows gathered on the device) are checked by
 * cuda_engine_attention_on_device's logits. */
TEST(cuda_engine_decode_step_on_device) {
    if (!have_gpu()) return;
    const char *tmp = t_tmpdir("cuda_step");
    static const char *arch[2] = {"kimi_k3", "kimi_linear"};
    char toks[600];
    REQUIRE(write_ids(tmp, 24, toks) == 0, "%s", toks);
    for (int i = 0; i < 2; i++) {
        char model[600], out[16384];
        int rc = synth_tiny(tmp, arch[i], model, out, sizeof out);
        REQUIRE(rc == 0, "synth %s: %s", arch[i], out);
        /* then bf16 on the tensor cores at any row count, one token at a
         * time and the whole window in one pass: the same bits */
        const char *dev[5] = {"cpu", "cuda", "cuda --gpu-mem 1M", "cuda --bf16-tc-rows 1 --chunk 1",
                              "cuda --bf16-tc-rows 1 --chunk 24"};
        float *lg[5] = {0};
        size_t nl[5] = {0};
        for (int d = 0; d < 5; d++) {
            char path[900];
            snprintf(path, sizeof path, "%.600s/ev%d.lg", model, d);
            rc = t_sh(out, sizeof out, "%s eval --model %s --tokens-file %s --ctx 24 %s --save-logits %s --device %s",
                      bin(), model, toks, d < 3 ? "--chunk 1" : "", path, dev[d]);
            CHECK(rc == 0, "%s eval %s: %s", arch[i], dev[d], out);
            lg[d] = eval_rows(path, &nl[d]);
        }
        if (lg[0] && lg[1] && lg[2] && lg[3] && lg[4] && nl[0] && nl[0] == nl[1] && nl[0] == nl[2] && nl[0] == nl[3] &&
            nl[0] == nl[4]) {
            check_three(arch[i], "decode step on the device", lg, nl[0]);
            float *tc[3] = {lg[0], lg[3], lg[4]};
            check_three(arch[i], "bf16 on the tensor cores (chunk 1 vs 24)", tc, nl[0]);
        } else {
            CHECK(0, "%s: eval logits missing", arch[i]);
        }
        for (int d = 0; d < 5; d++) free(lg[d]);
        char ids[2][4096];
        const char *prompt = "5,17,300,2,901,44,7";
        for (int d = 0; d < 2; d++) {
            rc = t_sh(ids[d], sizeof ids[d], "%s run --model %s --tokens %s --max-new 12 --ids --device %s", bin(),
                      model, prompt, d ? "cuda" : "cpu");
            CHECK(rc == 0, "%s run: %s", arch[i], ids[d]);
        }
        CHECK(!strcmp(ids[0], ids[1]), "%s: greedy ids differ: cpu '%s' cuda '%s'", arch[i], ids[0], ids[1]);
        rc = t_sh(out, sizeof out,
                  "%s bench --decode --model %s --tokens 4 --prompt-tokens 40 --device cuda --json --prefill-again 2",
                  bin(), model);
        CHECK(strstr(out, "\"prefill_again_same_token\":true") != NULL, "%s: warm prefill on the device: %s",
              arch[i], out);
        const double waits = json_field(out, "device_waits_per_token"), passes = json_field(out, "device_passes_per_token");
        fprintf(stderr, "    %-12s host waits per decoded token: %.1f; device passes %.1f\n", arch[i], waits, passes);
        CHECK(rc == 0 && waits >= 0, "%s: bench reports no device waits: %s", arch[i], out);
        CHECK(passes >= 1.0, "%s: decode did not run with its activations on the device: %s", arch[i], out);
        /* the warm prompt's two device floors, and the larger of them */
        const double hf = json_field(out, "prefill_hbm_floor_s"), lf = json_field(out, "prefill_tc_limb_floor_s"),
                     df = json_field(out, "prefill_device_floor_s");
        CHECK(json_field(out, "prefill_again_device_read_gb") > 0 && hf > 0 && lf > 0 && df == (hf > lf ? hf : lf),
              "%s: warm prompt's device floors: reads %g s, limbs %g s, larger %g s: %s", arch[i], hf, lf, df, out);
    }
}

/* A long prompt on the device, layer by layer (km_forward_prompt: blocks
 * of up to --prefill-block rows, 256 here, in a device block of as many,
 * every product over all of them, MLA attention in pieces of 32): 300
 * tokens of synth's tiny Kimi K3 and Kimi-Linear in one call (`eval
 * --chunk 300`: two blocks)
 * give bit-identical logits to one token at a time (--chunk 1) and to
 * 32-row passes (--prefill chunks), also across --gpu-mem and with bf16 on
 * the tensor cores (--bf16-tc-rows 1, against its own --chunk 1), within
 * 1e-4 max|logit| of the CPU's layer-major prompt; bench says the prompt
 * ran as layer-major blocks. */
TEST(cuda_engine_prompt_on_device) {
    if (!have_gpu()) return;
    const char *tmp = t_tmpdir("cuda_prompt");
    static const char *arch[2] = {"kimi_k3", "kimi_linear"};
    char toks[600];
    REQUIRE(write_ids(tmp, 300, toks) == 0, "%s", toks);
    enum { NV = 7 };
    const char *dev[NV] = {"cpu --chunk 300", "cuda --chunk 1", "cuda --chunk 300", "cuda --chunk 300 --prefill chunks",
                           "cuda --chunk 300 --gpu-mem 1M", "cuda --bf16-tc-rows 1 --chunk 1",
                           "cuda --bf16-tc-rows 1 --chunk 300"};
    for (int i = 0; i < 2; i++) {
        char model[600], out[16384];
        int rc = synth_tiny(tmp, arch[i], model, out, sizeof out);
        REQUIRE(rc == 0, "synth %s: %s", arch[i], out);
        float *lg[NV] = {0};
        size_t nl[NV] = {0};
        int ok = 1;
        for (int d = 0; d < NV; d++) {
            char path[900];
            snprintf(path, sizeof path, "%.600s/pr%d.lg", model, d);
            rc = t_sh(out, sizeof out,
                      "%s eval --model %s --tokens-file %s --ctx 300 --save-logits %s --prefill-block 256 --device %s",
                      bin(), model, toks, path, dev[d]);
            CHECK(rc == 0, "%s eval %s: %s", arch[i], dev[d], out);
            lg[d] = eval_rows(path, &nl[d]);
            ok = ok && lg[d] && nl[d] && nl[d] == nl[0];
        }
        if (ok) {
            float *a[3] = {lg[0], lg[1], lg[2]};
            check_three(arch[i], "prompt on the device, layer by layer", a, nl[0]);
            CHECK(!memcmp(lg[1], lg[3], nl[0] * 4), "%s: 32-row passes differ from one token at a time", arch[i]);
            CHECK(!memcmp(lg[1], lg[4], nl[0] * 4), "%s: the layer-major prompt depends on --gpu-mem", arch[i]);
            float *b[3] = {lg[0], lg[5], lg[6]};
            check_three(arch[i], "prompt with bf16 on the tensor cores", b, nl[0]);
        } else {
            CHECK(0, "%s: eval logits missing", arch[i]);
        }
        for (int d = 0; d < NV; d++) free(lg[d]);
        for (int blk = 0; blk < 2; blk++) { /* --prefill-block 256, then the default (512) */
            rc = t_sh(out, sizeof out,
                      "%s bench --decode --model %s --tokens 2 --prompt-tokens 300 --device cuda --json%s", bin(), model,
                      blk ? "" : " --prefill-block 256");
            const char *w = strstr(out, "\"prefill_layer_major_blocks\"");
            int blocks = w && (w = strchr(w, ':')) ? atoi(w + 1) : -1;
            CHECK(rc == 0 && blocks == 2 - blk, "%s: a 300-token prompt on the device ran %d layer-major blocks (%s): %s",
                  arch[i], blocks, blk ? "default" : "--prefill-block 256", out);
        }
    }
}
