/* cmd_synth.c — `deltafin synth`: write a random-weight checkpoint of a
 * supported family (the work is in src/synth; this file parses options and
 * prints the plan and the write rate).
 *
 *   deltafin synth --arch kimi_k3 --preset k3-slice --gb 4 --out /tmp/k3s
 *   deltafin synth --arch kimi_k3 --tokenizer cl100k_base.tiktoken --out /tmp/k3t
 */
#include "cli.h"
#include "../synth/synth.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char synth_help[] =
    "usage: deltafin synth --arch ARCH --out DIR [options]\n"
    "Writes a checkpoint directory in the official Hugging Face layout of ARCH with\n"
    "random weights drawn so activations stay finite (config.json, safetensors shards,\n"
    "index). Writing is streamed in 4 MiB chunks on all CPUs.\n"
    "\n"
    "  --arch ARCH        deepseek_v3, kimi_k2 (int4 experts), kimi_linear, kimi_k3 (MXFP4)\n"
    "  --out DIR          output directory (created if needed)\n"
    "  --preset P         tiny (default): toy sizes that run in milliseconds;\n"
    "                     k3-slice (kimi_k3): K3's real widths, 3 layers (KDA+dense,\n"
    "                       KDA+MoE, MLA+MoE), 448 experts per MoE layer;\n"
    "                     full: the public config's sizes (kimi_k3: 93 layers, 896\n"
    "                       experts, 1.56 TB in 96 shards; use with --sparse)\n"
    "  --gb G             choose the experts per MoE layer so the total is about G x 1e9\n"
    "                     bytes (shrinks vocab and the dense layer if they alone do not fit)\n"
    "  --layers N         decoder layers (Kimi: MLA every 4th layer and the last, KDA else)\n"
    "  --experts N        routed experts per MoE layer\n"
    "  --vocab N          vocabulary size\n"
    "  --dense-inter N    intermediate size of the dense layer(s)\n"
    "  --seed S           random seed (default 0); same seed, same bytes\n"
    "  --shard-size SIZE  bytes per shard, e.g. 2G, 500M, 1GiB (default 5G; full kimi_k3:\n"
    "                     96 shards); a layer's routed experts always stay in one shard\n"
    "  --sparse           write headers only; data regions stay holes (plumbing tests)\n"
    "  --dtype T          bf16 (default) or f32 for the unquantised weights\n"
    "  --threads N        writer threads (default: all CPUs)\n"
    "  --tokenizer SRC    also write a tokenizer that fits the vocabulary (Kimi families):\n"
    "                     SRC is a tiktoken rank file (plain, not .gz), a tokenizer.json\n"
    "                     or a model directory; its 256 bytes and lowest ids fill ids\n"
    "                     0..vocab-257 (tiktoken.model), K3's special tokens the last 256\n"
    "                     ids where config.json's bos/eos/pad point (tokenizer_config.json),\n"
    "                     so run --prompt/--chat and chat work (K3's XTML template)\n"
    "  --force            replace a checkpoint already in DIR\n"
    "  --quiet            print nothing on success\n";

/* "2G", "500M", "1.5GB", "2GiB", "123": decimal K/M/G/T, binary with "i". */
static int parse_size(const char *s, int64_t *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !(v > 0)) return -1;
    double mul = 1;
    if (*end) {
        const char *u = "KMGT";
        const char *q = strchr(u, *end >= 'a' ? *end - 32 : *end);
        if (!q || !*end) return -1;
        int bin = end[1] == 'i';
        double base = bin ? 1024.0 : 1000.0;
        for (const char *k = u; k <= q; k++) mul *= base;
        end += 1 + bin;
        if (*end == 'B' || *end == 'b') end++;
        if (*end) return -1;
    }
    v *= mul;
    if (v > 9e18) return -1;
    *out = (int64_t)v;
    return *out > 0 ? 0 : -1;
}

static int parse_count(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

int cmd_synth(int argc, char **argv) {
    sy_opts o;
    memset(&o, 0, sizeof o);
    const char *out = NULL, *tokenizer = NULL;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(synth_help, stdout); return CLI_OK; }
        if (!strcmp(a, "--sparse")) { o.sparse = 1; continue; }
        if (!strcmp(a, "--force")) { o.overwrite = 1; continue; }
        if (!strcmp(a, "--quiet")) { quiet = 1; continue; }
        if (!v) return cli_usage("synth", "unknown option or missing value");
        i++;
        int bad = 0;
        if (!strcmp(a, "--arch")) bad = !(o.arch = sy_arch_from_name(v));
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--tokenizer")) tokenizer = v;
        else if (!strcmp(a, "--preset")) bad = !(o.preset = sy_preset_from_name(v));
        else if (!strcmp(a, "--gb")) {
            char *end;
            o.gb = strtod(v, &end);
            bad = *end || !(o.gb > 0 && o.gb < 1e7);
        } else if (!strcmp(a, "--layers")) bad = parse_count(v, 1, 1024, &o.layers);
        else if (!strcmp(a, "--experts")) bad = parse_count(v, 1, 65536, &o.experts);
        else if (!strcmp(a, "--vocab")) bad = parse_count(v, 256, 4 << 20, &o.vocab);
        else if (!strcmp(a, "--dense-inter")) bad = parse_count(v, 1, 1 << 20, &o.dense_inter);
        else if (!strcmp(a, "--threads")) bad = parse_count(v, 1, 4096, &o.threads);
        else if (!strcmp(a, "--shard-size")) bad = parse_size(v, &o.shard_size);
        else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            o.seed = strtoull(v, &end, 0);
            bad = errno || *end || end == v;
        } else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "bf16")) o.dtype = DT_BF16;
            else if (!strcmp(v, "f32")) o.dtype = DT_F32;
            else bad = 1;
        } else {
            return cli_usage("synth", "unknown option");
        }
        if (bad) {
            fprintf(stderr, "deltafin synth: bad value for %s: '%s' (see `deltafin synth --help`)\n", a, v);
            return CLI_USAGE;
        }
    }
    if (!o.arch || !out) return cli_usage("synth", "--arch and --out are required");
    char err[DF_ERRMSG];
    sy_plan *p;
    df_status st = sy_plan_new(&o, &p, err);
    if (st != DF_OK) {
        fprintf(stderr, "deltafin synth: %s\n", err);
        return st == DF_ERR_ARG ? CLI_USAGE : CLI_FAIL;
    }
    if (tokenizer && (st = sy_plan_tokenizer(p, tokenizer, err)) != DF_OK) {
        fprintf(stderr, "deltafin synth: %s\n", err);
        sy_plan_free(p);
        return st == DF_ERR_ARG ? CLI_USAGE : CLI_FAIL;
    }
    char desc[4096];
    sy_plan_describe(p, desc, sizeof desc);
    if (!quiet) {
        fputs(desc, stdout);
        fflush(stdout);
    }
    double t0 = cli_now();
    int64_t wrote = 0;
    st = sy_write(p, out, NULL, &wrote, err);
    double dt = cli_now() - t0;
    const sy_summary *s = sy_plan_summary(p);
    if (st != DF_OK) {
        fprintf(stderr, "deltafin synth: %s\n", err);
        sy_plan_free(p);
        return CLI_FAIL;
    }
    if (!quiet) {
        if (o.sparse)
            printf("wrote          %s: headers only, %.3f GB apparent, in %.2f s\n", out, s->total_bytes / 1e9, dt);
        else
            printf("wrote          %s: %.3f GB in %.2f s (%.0f MB/s)\n", out, wrote / 1e9, dt,
                   wrote / 1e6 / (dt > 1e-9 ? dt : 1e-9));
    }
    sy_plan_free(p);
    return CLI_OK;
}
