/* cmd_eval.c — `deltafin eval`: perplexity of a model on a text, and the
 * divergence of its logits from a base run's (as llama-perplexity
 * --kl-divergence-base does), so lossy settings (--spine-dtype int8,
 * --top-k) are measured, not claimed.
 *
 * Windows: the token stream (the text tokenised by the model's tokenizer,
 * no specials added; or --tokens-file) is cut into consecutive,
 * non-overlapping windows of --ctx tokens (a last partial window is
 * dropped); each runs in a fresh session, and every position i < ctx-1 of
 * a window is scored on token i+1: NLL = -log softmax(logits_i)[t_{i+1}],
 * perplexity = exp(mean NLL) over all scored positions.
 *
 * Logits files (--save-logits / --base-logits): "DFLG" magic, then u32
 * version 1, vocab, ctx, windows, n scored positions; the window tokens
 * (i32, windows x ctx); then each scored row's f32 logits in order.
 *
 *   deltafin eval --model DIR --text-file held_out.txt --ctx 256 --save-logits base.lg
 *   deltafin eval --model DIR --text-file held_out.txt --ctx 256 --spine-dtype int8 --base-logits base.lg
 */
#include "cli.h"
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char help[] =
    "usage: deltafin eval --model DIR (--text-file F | --tokens-file F) [--ctx N] [--windows W]\n"
    "                     [--save-logits FILE | --base-logits FILE] [--json] [model options]\n"
    "Perplexity over consecutive, non-overlapping windows of --ctx tokens (default 512; each in a\n"
    "fresh session, every position but the last scored on the next token). With --base-logits (a\n"
    "file from --save-logits of a base run on the same tokens): mean and max KL divergence\n"
    "KL(base || this) per position, top-1 agreement and the base perplexity.\n\n"
    "  --text-file F     text, tokenised by the model's tokenizer (no special tokens)\n"
    "  --tokens-file F   token ids instead: little-endian uint16 (*.u16 / *.bin) or int32 (*.i32)\n"
    "  --ctx N           window length in tokens (default 512)\n"
    "  --windows W       at most W windows (default: all)\n"
    "  --chunk N         positions per evaluation call, 1..4096 (default 32; 1 routes as decode does;\n"
    "                    above 32 a call runs layer by layer in blocks of --prefill-block positions, as a long\n"
    "                    prompt does; the numbers do not depend on it, the expert cache's behaviour does)\n"
    "  --json            one JSON object on stdout\n\n%s";

/* log-softmax of one row in double precision: out[v], returns nothing */
static void log_softmax(const float *x, int V, double *out) {
    double m = -INFINITY;
    for (int v = 0; v < V; v++) if (x[v] > m) m = x[v];
    double s = 0;
    for (int v = 0; v < V; v++) s += exp((double)x[v] - m);
    double lse = m + log(s);
    for (int v = 0; v < V; v++) out[v] = (double)x[v] - lse;
}

static int read_tokens_file(const char *path, df_tokens *out) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    size_t n = strlen(path);
    int i32 = n > 4 && strcmp(path + n - 4, ".i32") == 0;
    unsigned char b[4];
    int rc = 0;
    while (fread(b, i32 ? 4 : 2, 1, f) == 1) {
        int32_t id = i32 ? (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24)
                         : (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8);
        if (df_tokens_push(out, id) != DF_OK) { rc = -1; break; }
    }
    fclose(f);
    return rc;
}

static int put_u32(FILE *f, uint32_t v) { return fwrite(&v, 4, 1, f) == 1 ? 0 : -1; }
static int get_u32(FILE *f, uint32_t *v) { return fread(v, 4, 1, f) == 1 ? 0 : -1; }

int cmd_eval(int argc, char **argv) {
    cli_model_opts mo;
    cli_model_opts_init(&mo);
    const char *text_file = NULL, *tokens_file = NULL, *save = NULL, *base = NULL;
    int ctx = 512, max_windows = 0, json = 0, chunk = 32;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { printf(help, cli_model_opts_help); return 0; }
        int r = cli_model_opt(&mo, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        if (!strcmp(a, "--text-file") && i + 1 < argc) text_file = argv[++i];
        else if (!strcmp(a, "--tokens-file") && i + 1 < argc) tokens_file = argv[++i];
        else if (!strcmp(a, "--save-logits") && i + 1 < argc) save = argv[++i];
        else if (!strcmp(a, "--base-logits") && i + 1 < argc) base = argv[++i];
        else if (!strcmp(a, "--windows") && i + 1 < argc) max_windows = atoi(argv[++i]);
        else if (!strcmp(a, "--chunk") && i + 1 < argc) chunk = atoi(argv[++i]);
        else if (!strcmp(a, "--json")) json = 1;
        else return cli_usage("eval", "unknown or incomplete option");
    }
    if (mo.ctx > 0) ctx = mo.ctx;
    if (!mo.model || (!text_file == !tokens_file)) return cli_usage("eval", "--model and one of --text-file / --tokens-file are required");
    if (ctx < 2) return cli_usage("eval", "--ctx must be at least 2");
    if (chunk < 1 || chunk > 4096) return cli_usage("eval", "--chunk must be 1..4096");
    if (save && base) return cli_usage("eval", "--save-logits and --base-logits are two runs");
    mo.ctx = ctx;
    char err[DF_ERRMSG];
    df_tokens toks = {0};
    if (tokens_file) {
        if (read_tokens_file(tokens_file, &toks) != 0) {
            fprintf(stderr, "deltafin: eval: cannot read %s\n", tokens_file);
            df_tokens_free(&toks);
            return CLI_FAIL;
        }
    } else {
        df_tokenizer *t = NULL;
        FILE *f = fopen(text_file, "rb");
        char *buf = NULL;
        size_t len = 0;
        if (f) {
            fseek(f, 0, SEEK_END);
            long n = ftell(f);
            fseek(f, 0, SEEK_SET);
            buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
            len = buf ? fread(buf, 1, (size_t)n, f) : 0;
            fclose(f);
        }
        if (!buf) { fprintf(stderr, "deltafin: eval: cannot read %s\n", text_file); return CLI_FAIL; }
        int rc = df_tokenizer_load_dir(mo.model, &t, err) == DF_OK && df_tokenize(t, buf, len, 0, &toks, err) == DF_OK;
        free(buf);
        df_tokenizer_free(t);
        if (!rc) { fprintf(stderr, "deltafin: eval: %s\n", err); df_tokens_free(&toks); return CLI_FAIL; }
    }
    int windows = toks.n / ctx;
    if (max_windows > 0 && windows > max_windows) windows = max_windows;
    if (windows < 1) {
        fprintf(stderr, "deltafin: eval: %d tokens make no window of %d (lower --ctx)\n", toks.n, ctx);
        df_tokens_free(&toks);
        return CLI_FAIL;
    }
    df_engine *e = cli_open(&mo);
    if (!e) { df_tokens_free(&toks); return CLI_FAIL; }
    int V = df_engine_vocab_size(e), rc = CLI_FAIL;
    uint32_t nscored = (uint32_t)windows * (uint32_t)(ctx - 1);
    df_session *s = NULL;
    FILE *sf = NULL, *bf = NULL;
    float *lg = malloc((size_t)(chunk < ctx ? chunk : ctx) * V * sizeof(float)), *brow = malloc((size_t)V * sizeof(float));
    double *lp = malloc((size_t)V * sizeof(double)), *lq = malloc((size_t)V * sizeof(double));
    if (!lg || !brow || !lp || !lq) goto done;
    for (int i = 0; i < windows * ctx; i++)
        if (toks.ids[i] < 0 || toks.ids[i] >= V) {
            fprintf(stderr, "deltafin: eval: token %d at %d is outside the model's vocabulary (%d)\n", toks.ids[i], i, V);
            goto done;
        }
    if (save) {
        sf = fopen(save, "wb");
        if (!sf || fwrite("DFLG", 4, 1, sf) != 1 || put_u32(sf, 1) || put_u32(sf, (uint32_t)V) || put_u32(sf, (uint32_t)ctx) ||
            put_u32(sf, (uint32_t)windows) || put_u32(sf, nscored) ||
            fwrite(toks.ids, 4, (size_t)windows * ctx, sf) != (size_t)windows * ctx) {
            fprintf(stderr, "deltafin: eval: cannot write %s\n", save);
            goto done;
        }
    }
    if (base) {
        char mg[4];
        uint32_t ver, bv, bc, bw, bn;
        bf = fopen(base, "rb");
        if (!bf || fread(mg, 4, 1, bf) != 1 || memcmp(mg, "DFLG", 4) || get_u32(bf, &ver) || ver != 1 || get_u32(bf, &bv) ||
            get_u32(bf, &bc) || get_u32(bf, &bw) || get_u32(bf, &bn)) {
            fprintf(stderr, "deltafin: eval: %s is not a logits file from eval --save-logits\n", base);
            goto done;
        }
        if (bv != (uint32_t)V || bc != (uint32_t)ctx || bw != (uint32_t)windows) {
            fprintf(stderr, "deltafin: eval: %s has vocab %u, ctx %u, %u windows; this run has %d, %d, %d\n", base, bv, bc,
                    bw, V, ctx, windows);
            goto done;
        }
        for (int i = 0; i < windows * ctx; i++) {
            int32_t id;
            if (fread(&id, 4, 1, bf) != 1 || id != toks.ids[i]) {
                fprintf(stderr, "deltafin: eval: %s was made on other tokens (position %d)\n", base, i);
                goto done;
            }
        }
    }
    if (df_session_new(e, ctx, &s) != DF_OK) { fprintf(stderr, "deltafin: cannot allocate a session\n"); goto done; }
    double nll = 0, bnll = 0, kl_sum = 0, kl_max = 0;
    long top1 = 0, n = 0;
    double t0 = cli_now();
    for (int w = 0; w < windows; w++) {
        df_session_reset(s);
        const int32_t *wt = toks.ids + (size_t)w * ctx;
        for (int p0 = 0; p0 < ctx; p0 += chunk) {
            int m = ctx - p0 < chunk ? ctx - p0 : chunk;
            if (df_session_eval(s, wt + p0, m, lg) != DF_OK) {
                fprintf(stderr, "deltafin: %s\n", df_session_error(s));
                goto done;
            }
            for (int k = 0; k < m; k++) {
                int pos = p0 + k;
                if (pos == ctx - 1) break;
                const float *row = lg + (size_t)k * V;
                log_softmax(row, V, lq);
                nll -= lq[wt[pos + 1]];
                n++;
                if (sf && fwrite(row, 4, (size_t)V, sf) != (size_t)V) {
                    fprintf(stderr, "deltafin: eval: cannot write %s\n", save);
                    goto done;
                }
                if (bf) {
                    if (fread(brow, 4, (size_t)V, bf) != (size_t)V) {
                        fprintf(stderr, "deltafin: eval: %s is truncated\n", base);
                        goto done;
                    }
                    log_softmax(brow, V, lp);
                    bnll -= lp[wt[pos + 1]];
                    double kl = 0;
                    for (int v = 0; v < V; v++) kl += exp(lp[v]) * (lp[v] - lq[v]);
                    kl_sum += kl;
                    if (kl > kl_max) kl_max = kl;
                    top1 += df_argmax(brow, V) == df_argmax(row, V);
                }
            }
        }
        if (!json && isatty(2)) fprintf(stderr, "\rwindow %d/%d: ppl so far %.4f", w + 1, windows, exp(nll / n));
    }
    if (!json && isatty(2)) fputc('\n', stderr);
    double secs = cli_now() - t0, ppl = exp(nll / n);
    const char *lossy = df_engine_lossy(e);
    df_stats xs;
    df_engine_stats(e, &xs);
    uint64_t used = xs.expert_hits + xs.expert_misses + xs.prefetch_used;
    if (json) {
        json_t *o = json_pack("{s:s, s:i, s:i, s:I, s:f, s:f, s:s, s:s, s:f}", "model", mo.model, "ctx", ctx, "windows",
                              windows, "scored", (json_int_t)n, "mean_nll", nll / n, "ppl", ppl, "lossy", lossy,
                              "spine_dtype", df_engine_spine_dtype(e), "seconds", secs);
        /* the expert cache over the run: hits (found without a read), reads, lookahead */
        json_object_set_new(o, "expert_hit_rate", json_real(used ? (double)xs.expert_hits / used : 0));
        json_object_set_new(o, "expert_bytes_read", json_integer((json_int_t)xs.bytes_read));
        json_object_set_new(o, "prefetch_precision",
                            json_real(xs.prefetch_used + xs.prefetch_wasted
                                          ? (double)xs.prefetch_used / (xs.prefetch_used + xs.prefetch_wasted) : 0));
        json_object_set_new(o, "prefetch_recall",
                            json_real(xs.prefetch_used + xs.expert_misses
                                          ? (double)xs.prefetch_used / (xs.prefetch_used + xs.expert_misses) : 0));
        json_object_set_new(o, "cache_slots", json_integer(xs.cache_slots));
        if (bf) {
            json_object_set_new(o, "base_ppl", json_real(exp(bnll / n)));
            json_object_set_new(o, "kl_mean", json_real(kl_sum / n));
            json_object_set_new(o, "kl_max", json_real(kl_max));
            json_object_set_new(o, "top1_agreement", json_real((double)top1 / n));
        }
        char *txt = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(10));
        if (txt) printf("%s\n", txt);
        free(txt);
        json_decref(o);
    } else {
        if (*lossy) printf("%s\n", lossy);
        printf("perplexity %.6f (mean NLL %.6f) over %ld tokens: %d windows of %d, spine %s, %.1f s\n", ppl, nll / n, n,
               windows, ctx, df_engine_spine_dtype(e), secs);
        if (bf)
            printf("against the base: base perplexity %.6f; KL divergence mean %.6f, max %.6f; top-1 agreement %.2f%%\n",
                   exp(bnll / n), kl_sum / n, kl_max, 100.0 * top1 / n);
    }
    rc = CLI_OK;
done:
    if (sf && fclose(sf) != 0 && rc == CLI_OK) { fprintf(stderr, "deltafin: eval: cannot write %s\n", save); rc = CLI_FAIL; }
    if (bf) fclose(bf);
    df_session_free(s);
    df_engine_close(e);
    free(lg); free(brow); free(lp); free(lq);
    df_tokens_free(&toks);
    return rc;
}
