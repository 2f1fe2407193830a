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
    df_engine *e = cli_open(&mo);
    if (!e) { free(ids); return CLI_FAIL; }
    int V = df_engine_vocab_size(e), rc = CLI_FAIL;
    df_session *s = NULL;
    if (df_session_new(e, mo.ctx > 0 ? mo.ctx : 0, &s) != DF_OK) {
        fprintf(stderr, "deltafin: cannot allocate a session\n");
        goto done;
    }
    double t0 = cli_now();
    if (df_session_eval(s, ids, n, NULL) != DF_OK) {
        fprintf(stderr, "deltafin: %s\n", df_session_error(s));
        goto done;
    }
    double t1 = cli_now();
    int made = 0;
    for (; made < max_new; made++) {
        int32_t tok = df_argmax(df_session_logits(s), V);
        printf(made ? " %d" : "%d", tok);
        fflush(stdout);
        if (made + 1 == max_new) { made++; break; }
        if (df_session_eval(s, &tok, 1, NULL) != DF_OK) {
            printf("\n");
            fprintf(stderr, "deltafin: %s\n", df_session_error(s));
            goto done;
        }
    }
    printf("\n");
    fflush(stdout);
    double t2 = cli_now();
    if (stats) {
        int steps = made > 1 ? made - 1 : 0;
        fprintf(stderr, "prefill: %d tokens in %.3f s (%.1f tok/s); decode: %d tokens in %.3f s (%.2f tok/s, %.1f ms/token); threads %d\n",
                n, t1 - t0, n / (t1 - t0 + 1e-12), steps, t2 - t1,
                steps ? steps / (t2 - t1 + 1e-12) : 0.0, steps ? (t2 - t1) * 1e3 / steps : 0.0,
                df_engine_n_threads(e));
    }
    rc = CLI_OK;
done:
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
    df_engine *e = cli_open(&mo);
    if (!e) return CLI_FAIL;
    fputs(df_engine_describe(e), stdout);
    df_engine_close(e);
    return CLI_OK;
}
