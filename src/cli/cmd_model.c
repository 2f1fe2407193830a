/* cmd_model.c — the model subcommands: logits, run, inspect.
 *
 * CLI contract (scripts depend on it; keep it stable):
 *   deltafin logits --model DIR --tokens 1,2,3 --out FILE
 *       float32 little-endian, one row of vocab_size per input position
 *   deltafin run --model DIR --tokens 1,2,3 --max-new N --ids
 *       greedy continuation; generated ids space-separated on one stdout line
 *   deltafin inspect --model DIR
 */
#include "cli.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return 1;
    return 0;
}

/* ---- logits ---- */

int cmd_logits(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        printf("usage: deltafin logits --model DIR --tokens 1,2,3 --out FILE [options]\n"
               "Writes float32 little-endian logits: one row of vocab_size values per input\n"
               "position (row i = next-token logits after tokens[0..i]).\n\n%s",
               cli_model_opts_help);
        return 0;
    }
    cli_model_opts mo;
    cli_model_opts_init(&mo);
    const char *toks = NULL, *outp = NULL;
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(&mo, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) toks = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) outp = argv[++i];
        else return cli_usage("logits", "unknown or incomplete option");
    }
    if (!mo.model || !toks || !outp) return cli_usage("logits", "--model, --tokens and --out are required");
    int32_t *ids;
    int n = cli_parse_tokens(toks, &ids);
    if (n < 0) return cli_usage("logits", "--tokens must be a comma-separated list of token ids");
    df_engine *e = cli_open(&mo);
    if (!e) { free(ids); return CLI_FAIL; }
    int V = df_engine_vocab_size(e), rc = CLI_FAIL;
    df_session *s = NULL;
    float *lg = malloc((size_t)n * V * sizeof(float));
    FILE *f = NULL;
    if (!lg) { fprintf(stderr, "deltafin: out of memory\n"); goto done; }
    if (df_session_new(e, mo.ctx > 0 ? mo.ctx : (n > 4096 ? n : 0), &s) != DF_OK) {
        fprintf(stderr, "deltafin: cannot allocate a session\n");
        goto done;
    }
    if (df_session_eval(s, ids, n, lg) != DF_OK) {
        fprintf(stderr, "deltafin: %s\n", df_session_error(s));
        goto done;
    }
    f = fopen(outp, "wb");
    if (!f || fwrite(lg, sizeof(float), (size_t)n * V, f) != (size_t)n * V || fclose(f) != 0) {
        fprintf(stderr, "deltafin: cannot write %s\n", outp);
        f = NULL;
        goto done;
    }
    f = NULL;
    rc = CLI_OK;
done:
    df_session_free(s);
    df_engine_close(e);
    free(lg);
    free(ids);
    return rc;
}

/* ---- run ---- */

int cmd_run(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        printf("usage: deltafin run --model DIR --tokens 1,2,3 [--max-new N] [--ids] [--stats] [options]\n"
               "Greedy continuation of a token prompt. --ids prints the generated ids\n"
               "space-separated on one line; --stats prints timings to stderr.\n\n"
               "  --max-new N        tokens to generate (default 16)\n%s",
               cli_model_opts_help);
        return 0;
    }
    cli_model_opts mo;
    cli_model_opts_init(&mo);
    const char *toks = NULL;
    int max_new = 16, stats = 0;
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(&mo, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) toks = argv[++i];
        else if (!strcmp(argv[i], "--max-new") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 0 || v > 1000000) return cli_usage("run", "--max-new needs a count");
            max_new = (int)v;
        } else if (!strcmp(argv[i], "--ids")) { /* ids are the only output until text arrives */
        } else if (!strcmp(argv[i], "--stats")) stats = 1;
        else return cli_usage("run", "unknown or incomplete option");
    }
    if (!mo.model || !toks) return cli_usage("run", "--model and --tokens are required");
    int32_t *ids;
    int n = cli_parse_tokens(toks, &ids);
    if (n < 0) return cli_usage("run", "--tokens must be a comma-separated list of token ids");
    double t_start = cli_now();
    df_engine *e = cli_open(&mo);
    if (!e) { free(ids); return CLI_FAIL; }
    double t_engine = cli_now();
    int V = df_engine_vocab_size(e), rc = CLI_FAIL;
    df_session *s = NULL;
    char *statbuf = NULL;
    if (df_session_new(e, mo.ctx > 0 ? mo.ctx : 0, &s) != DF_OK) {
        fprintf(stderr, "deltafin: cannot allocate a session\n");
        goto done;
    }
    double t_session = cli_now();
    int live = !stats && isatty(2);
    size_t statcap = 4096;
    statbuf = calloc(statcap, 1);
    if (!statbuf) goto done;
    double t0 = cli_now();
    if (df_session_eval(s, ids, n, NULL) != DF_OK) {
        fprintf(stderr, "deltafin: %s\n", df_session_error(s));
        goto done;
    }
    double t1 = cli_now();
    df_stats before, after;
    df_engine_stats(e, &after);
    if (stats)
        snprintf(statbuf, statcap, "prefill: %d tokens, %.3f s, %.1f MB read (experts %.1f, spine %.1f)\n", n,
                 t1 - t0, (after.bytes_read + after.spine_bytes_read) / 1e6, after.bytes_read / 1e6,
                 after.spine_bytes_read / 1e6);
    int made = 0;
    double tprev = t1;
    for (; made < max_new; made++) {
        int32_t tok = df_argmax(df_session_logits(s), V);
        printf(made ? " %d" : "%d", tok);
        fflush(stdout);
        if (made + 1 == max_new) { made++; break; }
        before = after;
        if (df_session_eval(s, &tok, 1, NULL) != DF_OK) {
            printf("\n");
            fprintf(stderr, "deltafin: %s\n", df_session_error(s));
            goto done;
        }
        double tnow = cli_now();
        df_engine_stats(e, &after);
        uint64_t rd = after.bytes_read - before.bytes_read + after.spine_bytes_read - before.spine_bytes_read;
        uint64_t hit = after.expert_hits - before.expert_hits; /* prefetched experts were read: not hits */
        uint64_t all = hit + (after.expert_misses - before.expert_misses) + (after.prefetch_used - before.prefetch_used);
        double dt = tnow - tprev;
        tprev = tnow;
        char line[256];
        snprintf(line, sizeof line, "%s%stoken %d: %.1f ms, %.2f MB read, hit %.0f%%, io wait %.1f ms, depth %d, %.2f GB/s",
                 df_engine_lossy(e), *df_engine_lossy(e) ? " | " : "", made + 1, dt * 1e3, rd / 1e6,
                 all ? 100.0 * hit / all : 100.0, (after.io_wait_s - before.io_wait_s) * 1e3, after.max_in_flight,
                 dt > 0 ? rd / dt / 1e9 : 0.0);
        if (live) fprintf(stderr, "\r%s   ", line);
        if (stats) { /* printed after the id line, so the two never interleave */
            size_t need = strlen(statbuf) + strlen(line) + 2;
            if (need > statcap) {
                char *nb = realloc(statbuf, need * 2);
                if (nb) { statbuf = nb; statcap = need * 2; }
            }
            if (need <= statcap) { strcat(statbuf, line); strcat(statbuf, "\n"); }
        }
    }
    if (live) fprintf(stderr, "\r\033[K");
    printf("\n");
    fflush(stdout);
    double t2 = cli_now();
    if (stats) {
        fputs(statbuf, stderr);
        long hwm_kb = -1;
        FILE *st = fopen("/proc/self/status", "r");
        char ln[256];
        while (st && fgets(ln, sizeof ln, st))
            if (!strncmp(ln, "VmHWM:", 6)) hwm_kb = atol(ln + 6);
        if (st) fclose(st);
        fprintf(stderr, "open: %.3f s (engine %.3f s, session %.3f s); first token %.3f s after the start\n",
                t_session - t_start, t_engine - t_start, t_session - t_engine, t1 - t_start);
        fprintf(stderr, "spine: %s\n", df_engine_spine_why(e));
        int64_t ct = 0, cb = 0, crss = 0, c2 = 0;
        double cs = 0;
        const int copy = df_engine_spine_copy(e, &ct, &cb, &cs, &crss, &c2);
        if (copy == 1)
            fprintf(stderr, "spine copy: %.2f %s out of the page cache in %.2f s, %s (--spine-copy off: used in "
                    "place)\n", cb >= 1e9 ? cb / 1e9 : cb / 1e6, cb >= 1e9 ? "GB" : "MB", cs,
                    mo.spine_copy == 2 ? "in the open" : "while the engine was idle");
        else if (*df_engine_spine_copy_error(e))
            fprintf(stderr, "spine copy: %s\n", df_engine_spine_copy_error(e));
        else if (copy == 2)
            fprintf(stderr, "spine copy: %.2f %s out of the page cache, still running (the steps read the mapping "
                    "until it ends)\n", cb >= 1e9 ? cb / 1e9 : cb / 1e6, cb >= 1e9 ? "GB" : "MB");
        if (hwm_kb >= 0)
            fprintf(stderr, "memory: peak RSS %.1f MB, plan %.1f MB\n", hwm_kb / 1024.0,
                    df_engine_plan_bytes(e, df_session_pos(s) > 0 ? (mo.ctx > 0 ? mo.ctx : 4096) : 4096) / 1048576.0);
        int steps = made > 1 ? made - 1 : 0;
        fprintf(stderr, "%s%sprefill: %d tokens in %.3f s (%.1f tok/s); decode: %d tokens in %.3f s (%.2f tok/s, %.1f ms/token); threads %d, experts via %s\n",
                df_engine_lossy(e), *df_engine_lossy(e) ? " | " : "", n, t1 - t0, n / (t1 - t0 + 1e-12), steps, t2 - t1,
                steps ? steps / (t2 - t1 + 1e-12) : 0.0, steps ? (t2 - t1) * 1e3 / steps : 0.0,
                df_engine_n_threads(e), after.expert_io);
    }
    rc = CLI_OK;
done:
    free(statbuf);
    df_session_free(s);
    df_engine_close(e);
    free(ids);
    return rc;
}

/* ---- inspect ---- */

int cmd_inspect(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        printf("usage: deltafin inspect --model DIR [options]\n"
               "Prints the architecture, tensor and byte totals, experts and bytes per expert,\n"
               "resident bytes, expert bytes per token and context memory per token.\n\n%s",
               cli_model_opts_help);
        return 0;
    }
    cli_model_opts mo;
    cli_model_opts_init(&mo);
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(&mo, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (!r) return cli_usage("inspect", "unknown option");
    }
    if (!mo.model) return cli_usage("inspect", "--model is required");
    mo.plan_only = 1;
    df_engine *e = cli_open(&mo);
    if (!e) return CLI_FAIL;
    fputs(df_engine_describe(e), stdout);
    df_engine_close(e);
    return CLI_OK;
}
