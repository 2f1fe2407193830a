/* cmd_text.c — the text subcommands: tokenize, detokenize.
 *
 * CLI contract (scripts and tests depend on it; keep it stable):
 *   deltafin tokenize (--model DIR | --tokenizer FILE) [--pattern kimi|o200k|cl100k
 *                     | --pattern-file F] [--config F] [--text-file F] [--special] [--time]
 *       reads the text (stdin by default), prints its ids space-separated on
 *       one line; no special tokens are added, and special spellings in the
 *       text are ordinary bytes unless --special. --time prints the
 *       tokenisation throughput (MB/s, excluding loading) to stderr.
 *   deltafin detokenize (--model DIR | --tokenizer FILE) [--ids "1 2 3"] [--skip-special]
 *       reads ids (space/comma/newline separated; stdin by default) and writes
 *       the text exactly (no newline added).
 *   deltafin bench --tokenizer FILE|DIR [--pattern P] [--text-file F] [--seconds S]
 *       tokenisation throughput: encodes the text (default: a built-in
 *       multilingual sample repeated to 1 MB) for S seconds (default 2), one
 *       line: bytes, tokens, MB/s. (main.c sends `bench --tokenizer` here.)
 * Exit codes: 0 ok, 1 bad tokenizer / text / ids, 2 usage.
 */
#include "cli.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    const char *model, *tokenizer, *pattern, *pattern_file, *config;
} tok_opts;

static int tok_opt(tok_opts *o, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    const char **dst = !strcmp(a, "--model") ? &o->model
                     : !strcmp(a, "--tokenizer") ? &o->tokenizer
                     : !strcmp(a, "--pattern") ? &o->pattern
                     : !strcmp(a, "--pattern-file") ? &o->pattern_file
                     : !strcmp(a, "--config") ? &o->config : NULL;
    if (!dst) return 0;
    if (*i + 1 >= argc) { fprintf(stderr, "deltafin: %s needs a value\n", a); return -1; }
    *dst = argv[++*i];
    return 1;
}

static const char tok_opts_help[] =
    "  --model DIR          the model's tokenizer (tiktoken.model + tokenizer_config.json, or tokenizer.json)\n"
    "  --tokenizer FILE     a tiktoken rank file, or a tokenizer.json (*.json)\n"
    "  --pattern NAME       pre-tokenisation of a rank file: kimi (default), o200k, cl100k\n"
    "  --pattern-file F     ... or a PCRE2 pattern read from F (UTF + UCP)\n"
    "  --config F           tokenizer_config.json whose added_tokens_decoder names the specials\n";

/* Reads a whole file ("-" or NULL: stdin) into a malloc'd buffer. */
static char *slurp(const char *path, size_t *n) {
    FILE *f = path && strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) { fprintf(stderr, "deltafin: %s: %s\n", path, strerror(errno)); return NULL; }
    size_t cap = 1 << 16, len = 0;
    char *b = malloc(cap + 1);
    while (b) {
        size_t got = fread(b + len, 1, cap - len, f);
        len += got;
        if (len < cap) break;
        cap *= 2;
        char *nb = realloc(b, cap + 1);
        if (!nb) { free(b); b = NULL; }
        else b = nb;
    }
    int bad = ferror(f);
    if (f != stdin) fclose(f);
    if (!b || bad) { free(b); fprintf(stderr, "deltafin: cannot read %s\n", path ? path : "stdin"); return NULL; }
    b[len] = 0;
    *n = len;
    return b;
}

static df_tokenizer *open_tok(const tok_opts *o) {
    df_tokenizer *t = NULL;
    char err[DF_ERRMSG];
    df_status st;
    struct stat sb;
    if (o->model || (o->tokenizer && stat(o->tokenizer, &sb) == 0 && S_ISDIR(sb.st_mode))) {
        st = df_tokenizer_load_dir(o->model ? o->model : o->tokenizer, &t, err);
    } else {
        size_t L = strlen(o->tokenizer);
        if (L >= 5 && !strcmp(o->tokenizer + L - 5, ".json")) {
            st = df_tokenizer_load_hf(o->tokenizer, &t, err);
        } else {
            char *rx = NULL;
            if (o->pattern_file) {
                size_t n;
                if (!(rx = slurp(o->pattern_file, &n))) return NULL;
                while (n && (rx[n - 1] == '\n' || rx[n - 1] == '\r')) rx[--n] = 0;
            }
            st = df_tokenizer_load_tiktoken(o->tokenizer, o->pattern, rx, o->config, &t, err);
            free(rx);
        }
    }
    if (st != DF_OK) {
        fprintf(stderr, "deltafin: cannot load the tokenizer: %s\n", err);
        return NULL;
    }
    return t;
}

static int check_src(const char *cmd, const tok_opts *o) {
    if (!o->model == !o->tokenizer) return cli_usage(cmd, "give one of --model DIR or --tokenizer FILE");
    if (o->pattern && o->pattern_file) return cli_usage(cmd, "--pattern and --pattern-file exclude each other");
    if (o->model && (o->pattern || o->pattern_file || o->config))
        return cli_usage(cmd, "--pattern, --pattern-file and --config go with --tokenizer");
    return 0;
}

int cmd_tokenize(int argc, char **argv) {
    tok_opts o = {0};
    const char *text_file = NULL;
    int special = 0, timing = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: deltafin tokenize (--model DIR | --tokenizer FILE) [options]\n"
                   "Prints the token ids of the text (stdin by default) space-separated on one\n"
                   "line. No special tokens are added.\n\n%s"
                   "  --text-file F        read the text from F\n"
                   "  --special            recognise special-token spellings in the text\n"
                   "  --time               print tokenisation throughput (MB/s) to stderr\n",
                   tok_opts_help);
            return 0;
        }
        int r = tok_opt(&o, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        if (!strcmp(argv[i], "--text-file") && i + 1 < argc) text_file = argv[++i];
        else if (!strcmp(argv[i], "--special")) special = 1;
        else if (!strcmp(argv[i], "--time")) timing = 1;
        else return cli_usage("tokenize", "unknown or incomplete option");
    }
    int u = check_src("tokenize", &o);
    if (u) return u;
    df_tokenizer *t = open_tok(&o);
    if (!t) return CLI_FAIL;
    size_t n;
    char *text = slurp(text_file, &n);
    if (!text) { df_tokenizer_free(t); return CLI_FAIL; }
    df_tokens ids = {0};
    char err[DF_ERRMSG];
    double t0 = cli_now();
    df_status st = df_tokenize(t, text, n, special ? DF_TOK_SPECIAL : 0, &ids, err);
    double dt = cli_now() - t0;
    int rc = CLI_FAIL;
    if (st != DF_OK) {
        fprintf(stderr, "deltafin: %s%s\n", err, text_file ? "" : " (stdin)");
        goto done;
    }
    /* one line, built in a buffer: stdout is written once */
    char *line = malloc((size_t)ids.n * 12 + 2);
    if (!line) { fprintf(stderr, "deltafin: out of memory\n"); goto done; }
    size_t w = 0;
    for (int i = 0; i < ids.n; i++) w += (size_t)sprintf(line + w, i ? " %d" : "%d", ids.ids[i]);
    line[w++] = '\n';
    fwrite(line, 1, w, stdout);
    free(line);
    if (fflush(stdout)) { fprintf(stderr, "deltafin: cannot write the ids\n"); goto done; }
    if (timing)
        fprintf(stderr, "tokenize: %zu bytes -> %d tokens in %.3f s: %.2f MB/s (%s)\n", n, ids.n, dt,
                dt > 0 ? n / dt / 1e6 : 0.0, df_tokenizer_describe(t));
    rc = CLI_OK;
done:
    df_tokens_free(&ids);
    free(text);
    df_tokenizer_free(t);
    return rc;
}

/* Parses ids separated by spaces, commas, tabs or newlines. -1 on a bad id. */
static int parse_ids(const char *s, df_tokens *out) {
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n' || *p == '\r') p++;
        if (!*p) return 0;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) return -1;
        if (df_tokens_push(out, (int32_t)v) != DF_OK) return -1;
        p = end;
        if (*p && *p != ' ' && *p != ',' && *p != '\t' && *p != '\n' && *p != '\r') return -1;
    }
}

int cmd_detokenize(int argc, char **argv) {
    tok_opts o = {0};
    const char *ids_arg = NULL;
    int skip = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: deltafin detokenize (--model DIR | --tokenizer FILE) [options]\n"
                   "Writes the text of token ids (stdin by default; separated by spaces, commas\n"
                   "or newlines) exactly, without a newline. Invalid UTF-8 becomes U+FFFD.\n\n%s"
                   "  --ids \"1 2 3\"        the ids on the command line\n"
                   "  --skip-special       leave special tokens out\n",
                   tok_opts_help);
            return 0;
        }
        int r = tok_opt(&o, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        if (!strcmp(argv[i], "--ids") && i + 1 < argc) ids_arg = argv[++i];
        else if (!strcmp(argv[i], "--skip-special")) skip = 1;
        else return cli_usage("detokenize", "unknown or incomplete option");
    }
    int u = check_src("detokenize", &o);
    if (u) return u;
    size_t n;
    char *in = ids_arg ? strdup(ids_arg) : slurp(NULL, &n);
    if (!in) return CLI_FAIL;
    df_tokens ids = {0};
    if (parse_ids(in, &ids)) {
        free(in);
        df_tokens_free(&ids);
        return cli_usage("detokenize", "ids must be non-negative integers separated by spaces or commas");
    }
    free(in);
    df_tokenizer *t = open_tok(&o);
    if (!t) { df_tokens_free(&ids); return CLI_FAIL; }
    char *text = NULL, err[DF_ERRMSG];
    size_t tl;
    int rc = CLI_FAIL;
    if (df_detokenize(t, ids.ids, ids.n, skip, &text, &tl, err) != DF_OK) {
        fprintf(stderr, "deltafin: %s\n", err);
    } else if (fwrite(text, 1, tl, stdout) != tl || fflush(stdout)) {
        fprintf(stderr, "deltafin: cannot write the text\n");
    } else {
        rc = CLI_OK;
    }
    free(text);
    df_tokens_free(&ids);
    df_tokenizer_free(t);
    return rc;
}

/* ---- bench --tokenizer ---- */

int cmd_bench_wants_tokenizer(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--tokenizer")) return 1;
    return 0;
}

static const char bench_sample[] =
    "The quick brown fox jumps over the lazy dog; it's 12:45 and we've 3,141 reasons.\n"
    "int main(void) {\n    for (int i = 0; i < n; i++) total += values[i] * 2;\n    return 0;\n}\n"
    "\xe6\xb7\xb1\xe5\xba\xa6\xe5\xad\xa6\xe4\xb9\xa0\xe6\xa8\xa1\xe5\x9e\x8b\xe7\x9a\x84\xe6\x8e\xa8\xe7\x90\x86\xe3\x80\x82 "
    "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88\xe3\x80\x82 "
    "\xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd   \t  spaces\n\n";

int cmd_bench_tokenizer(int argc, char **argv) {
    tok_opts o = {0};
    const char *text_file = NULL;
    double seconds = 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: deltafin bench --tokenizer FILE|DIR [--pattern P | --pattern-file F] [--text-file F] [--seconds S]\n"
                   "Tokenisation throughput (bench/tokenizer.sh compares with js-tiktoken).\n");
            return 0;
        }
        int r = tok_opt(&o, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        if (!strcmp(argv[i], "--text-file") && i + 1 < argc) text_file = argv[++i];
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) {
            char *end;
            seconds = strtod(argv[++i], &end);
            if (*end || !(seconds > 0 && seconds < 3600)) return cli_usage("bench", "--seconds needs a positive number");
        } else return cli_usage("bench", "unknown or incomplete option");
    }
    int u = check_src("bench", &o);
    if (u) return u;
    df_tokenizer *t = open_tok(&o);
    if (!t) return CLI_FAIL;
    size_t n;
    char *text;
    if (text_file) text = slurp(text_file, &n);
    else {
        size_t one = sizeof bench_sample - 1, reps = (1000000 + one - 1) / one;
        n = one * reps;
        text = malloc(n + 1);
        if (text) {
            for (size_t k = 0; k < reps; k++) memcpy(text + k * one, bench_sample, one);
            text[n] = 0;
        }
    }
    if (!text) { df_tokenizer_free(t); return CLI_FAIL; }
    df_tokens ids = {0};
    char err[DF_ERRMSG];
    int passes = 0, rc = CLI_OK;
    double t0 = cli_now(), dt = 0;
    do {
        ids.n = 0;
        if (df_tokenize(t, text, n, 0, &ids, err) != DF_OK) { fprintf(stderr, "deltafin: %s\n", err); rc = CLI_FAIL; break; }
        passes++;
        dt = cli_now() - t0;
    } while (dt < seconds);
    if (rc == CLI_OK)
        printf("tokenizer: %zu bytes -> %d tokens, %d passes in %.2f s: %.2f MB/s, %.2f M tokens/s (%s)\n", n, ids.n, passes,
               dt, (double)n * passes / dt / 1e6, (double)ids.n * passes / dt / 1e6, df_tokenizer_describe(t));
    df_tokens_free(&ids);
    free(text);
    df_tokenizer_free(t);
    return rc;
}
