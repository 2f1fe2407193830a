/* cmd_convert.c — `deltafin convert-spine DIR`: the checkpoint's spine
 * matrices to row-wise int8 beside it (src/spine8), with a progress bar,
 * resumable after a kill, published atomically; --verify checks the hashes
 * of a finished conversion.
 *
 *   deltafin convert-spine /models/k3 [--out DIR] [--dry-run] [--force] [--verify]
 */
#include "cli.h"
#include "../spine8/spine8.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char help[] =
    "usage: deltafin convert-spine DIR [--dtype int8] [--out SUBDIR] [--dry-run] [--force] [--verify]\n"
    "Converts every 2-D spine matrix of the checkpoint in DIR (attention, shared experts, latent MoE\n"
    "projections, routers, lm_head; not the embedding, norms, conv1d, A_log, dt_bias, res_proj, the\n"
    "score-correction bias or routed experts) to row-wise symmetric int8 with an f32 scale per row,\n"
    "written as safetensors in DIR/int8-spine (one shard per layer, its own index, names as in the\n"
    "checkpoint). The engine then loads it with --spine-dtype auto|int8 (LOSSY: labelled everywhere).\n"
    "Resumable after a kill (finished shards are kept), published atomically (manifest.json last),\n"
    "verified by the sha256 of every shard recorded in the manifest. Works on stream-mode mirrors\n"
    "(fetches only the spine's bytes).\n\n"
    "  --dtype int8   the only target type (default)\n"
    "  --out SUBDIR   where to write (default DIR/int8-spine; the engine looks there)\n"
    "  --dry-run      print what would be converted and the sizes\n"
    "  --force        replace a finished conversion\n"
    "  --verify       check a finished conversion's shards against their recorded sha256\n"
    "  --threads N    quantisation threads (default: all CPUs)\n";

typedef struct {
    int tty;
    double t0, last;
} bar;

static void progress(void *ctx, int64_t done, int64_t total, int shard, int n_shards) {
    bar *b = ctx;
    double t = cli_now();
    if (!b->tty && t - b->last < 5 && done < total) return;
    if (b->tty && t - b->last < 0.2 && done < total) return;
    b->last = t;
    double f = total > 0 ? (double)done / total : 1, el = t - b->t0;
    int w = 30, k = (int)(f * w);
    char line[160];
    snprintf(line, sizeof line, "[%.*s%.*s] %5.1f%%  shard %d/%d  %.2f / %.2f GB  %.0f MB/s", k,
             "##############################", w - k, "                              ", f * 100, shard, n_shards,
             done / 1e9, total / 1e9, el > 0 ? done / el / 1e6 : 0.0);
    fprintf(stderr, b->tty ? "\r%s" : "%s\n", line);
}

int cmd_convert_spine(int argc, char **argv) {
    const char *dir = NULL;
    s8_opts o;
    memset(&o, 0, sizeof o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(help, stdout); return 0; }
        if (!strcmp(a, "--dry-run")) o.dry_run = 1;
        else if (!strcmp(a, "--force")) o.force = 1;
        else if (!strcmp(a, "--verify")) o.verify = 1;
        else if (!strcmp(a, "--out") && i + 1 < argc) o.out = argv[++i];
        else if (!strcmp(a, "--threads") && i + 1 < argc) o.threads = atoi(argv[++i]);
        else if (!strcmp(a, "--dtype") && i + 1 < argc) {
            if (strcmp(argv[++i], "int8") != 0) return cli_usage("convert-spine", "--dtype: only int8 is supported");
        } else if (a[0] != '-' && !dir) dir = a;
        else return cli_usage("convert-spine", "unknown or incomplete option");
    }
    if (!dir) return cli_usage("convert-spine", "the model directory is required");
    df_engine_opts eo;
    cli_model_opts mo;
    cli_model_opts_init(&mo);
    mo.model = dir;
    if (cli_engine_opts(&mo, &eo) != 0) return CLI_FAIL; /* a stream mirror: reads fetch what is missing */
    o.io = eo.io;
    bar b = {isatty(2), cli_now(), 0};
    o.progress = progress;
    o.progress_ctx = &b;
    s8_report r;
    char err[DF_ERRMSG];
    df_status st = s8_convert(dir, &o, &r, err);
    if (b.tty && b.last > 0) fputc('\n', stderr);
    if (st != DF_OK) {
        fprintf(stderr, "deltafin: convert-spine: %s\n", err);
        return CLI_FAIL;
    }
    if (o.verify) {
        printf("verified: %d shards match their sha256\n", r.n_shards);
        return CLI_OK;
    }
    printf("%s%d matrices in %d shards: %.3f GB read, %.3f GB int8 written%s", o.dry_run ? "would convert " : "",
           r.n_tensors, r.n_shards, r.in_bytes / 1e9, o.dry_run ? 0.0 : r.out_bytes / 1e9,
           o.dry_run ? "" : "");
    if (o.dry_run) printf(" (%.3f GB int8 would be written)\n", r.out_bytes / 1e9);
    else
        printf("; %d shards kept from an earlier run; %.1f s, %.0f MB/s read\n", r.shards_skipped, r.seconds,
               r.seconds > 0 ? (r.in_bytes / r.seconds) / 1e6 : 0.0);
    return CLI_OK;
}
