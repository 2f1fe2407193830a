/* cmd_generate.c — text generation: `deltafin run --prompt` and `deltafin chat`.
 *
 * CLI contract (tests depend on it; keep it stable):
 *   deltafin run --model DIR --prompt TEXT [--chat] [--system TEXT] [--max-new N]
 *                [sampling options] [--stop STR]... [--ignore-eos] [--stats]
 *                [--spec ngram [--spec-depth K] [--spec-ngram N] [--spec-fixed]]
 *       streams the continuation to stdout as it is generated (with --chat:
 *       the answer to stdout, the thinking channel to stderr) and ends it
 *       with a newline. Ctrl-C stops cleanly, keeping what was printed.
 *       (`run --tokens` is the id-level command in cmd_model.c; main.c sends
 *       `run` here when --prompt is given.)
 *   deltafin chat --model DIR [--system TEXT] [options]
 *       one user message per stdin line; /reset forgets the conversation,
 *       /stats prints the session's numbers, /quit or end of input leaves.
 *       The session keeps every turn: a turn evaluates only its new tokens.
 * Chat formats: Kimi K3 XTML (the tokenizer has <|open|>; thinking to
 * stderr) or DeepSeek-V3's chat_template (the tokenizer has <｜User｜>).
 * Generation stops at an end-of-sequence id (config.json eos_token_id, and
 * the tokenizer's <|end_of_msg|> / [EOS] / <|endoftext|> specials), at a stop
 * string (matched on the text across token boundaries, not printed), at
 * --max-new, at the context limit, or on Ctrl-C.
 * --spec ngram: exact speculative decoding (src/model/spec.c): the same
 * output, several tokens per step where prompt lookup finds the text; a
 * chat session is settled after each turn to hold what was shown.
 * Exit codes: 0 ok (also after Ctrl-C), 1 the work failed, 2 usage.
 */
#include "cli.h"
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t interrupted;
static void on_sigint(int sig) { (void)sig; interrupted = 1; }

enum { MAX_STOP = 8, MAX_EOS = 8 };

typedef struct {
    df_engine *e;
    df_session *s;
    df_tokenizer *t;
    df_sampler *smp;
    df_detok *dt;
    int V, ctx;
    int32_t eos[MAX_EOS];
    int n_eos, ignore_eos;
    const char *stop[MAX_STOP];
    int n_stop;
    int max_new, chat, stats;
    int k3;                /* K3 XTML (thinking + parser); else DeepSeek-V3: plain answer text */
    /* per turn */
    char *pend;            /* answer text held back: it may begin a stop string */
    size_t npend, cap;
    int stopped;           /* a stop string matched */
    int saw_reasoning;
    int prefill_n, gen_n;
    double prefill_s, gen_s;
    df_spec *spec;         /* --spec ngram: exact speculative decoding; NULL: one token per step */
} gen;

/* ---- options ---- */

typedef struct {
    cli_model_opts mo;
    df_sampler_params sp;
    const char *prompt, *system, *effort;
    int chat, max_new, stats, ignore_eos, no_think;
    const char *stop[MAX_STOP];
    int n_stop;
    cli_spec_opts so;
} gen_opts;

static const char gen_opts_help[] =
    "  --max-new N          tokens to generate per answer (default 256)\n"
    "  --temperature T      0: greedy (default 0.6 with --chat / in chat, else 0)\n"
    "  --top-k K            keep the K most likely tokens (0: off)\n"
    "  --top-p P            keep the smallest set holding P of the mass (1: off)\n"
    "  --min-p P            keep tokens with p >= P * p_max (0: off)\n"
    "  --repeat-penalty R   divide positive / multiply negative logits of recent tokens (1: off)\n"
    "  --presence-penalty X, --frequency-penalty X   OpenAI-style penalties (0: off)\n"
    "  --penalty-last-n N   window of the penalties (default 64; -1: everything)\n"
    "  --seed S             sampling seed (default 0x5eed)\n"
    "  --stop STR           stop when the text contains STR (not printed; up to 8)\n"
    "  --ignore-eos         do not stop at end-of-sequence tokens\n"
    "  --system TEXT        a system message (chat)\n"
    "  --effort E           thinking effort: low, medium, high, max (default), none\n"
    "  --no-think           open the response channel directly\n"
    "  --stats              timings and token counts on stderr\n"
    "%s";

static const char *gen_opts_help_text(void) {
    static char buf[4096];
    snprintf(buf, sizeof buf, gen_opts_help, cli_spec_opts_help);
    return buf;
}

static int num(const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) return -1;
    *out = v;
    return 0;
}

/* 1 consumed, 0 not ours, -1 bad */
static int gen_opt(gen_opts *o, int argc, char **argv, int *i) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    double x;
    if (!strcmp(a, "--chat")) { o->chat = 1; return 1; }
    if (!strcmp(a, "--stats")) { o->stats = 1; return 1; }
    if (!strcmp(a, "--ignore-eos")) { o->ignore_eos = 1; return 1; }
    if (!strcmp(a, "--no-think")) { o->no_think = 1; return 1; }
    int r = cli_spec_opt(&o->so, argc, argv, i);
    if (r) return r;
    static const char *const with_value[] = {"--prompt", "--system", "--effort", "--stop", "--max-new", "--temperature",
                                             "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--presence-penalty",
                                             "--frequency-penalty", "--penalty-last-n", "--seed", NULL};
    int known = 0;
    for (int k = 0; with_value[k]; k++) known |= !strcmp(a, with_value[k]);
    if (!known) return 0;
    if (!v) { fprintf(stderr, "deltafin: %s needs a value\n", a); return -1; }
    (*i)++;
    if (!strcmp(a, "--prompt")) o->prompt = v;
    else if (!strcmp(a, "--system")) o->system = v;
    else if (!strcmp(a, "--effort")) o->effort = v;
    else if (!strcmp(a, "--stop")) {
        if (o->n_stop == MAX_STOP || !*v) { fprintf(stderr, "deltafin: at most %d non-empty --stop strings\n", MAX_STOP); return -1; }
        o->stop[o->n_stop++] = v;
    } else if (!strcmp(a, "--max-new")) { if (num(v, 0, 1 << 24, &x)) goto bad; o->max_new = (int)x; }
    else if (!strcmp(a, "--temperature")) { if (num(v, 0, 100, &x)) goto bad; o->sp.temperature = (float)x; }
    else if (!strcmp(a, "--top-k")) { if (num(v, 0, 1 << 24, &x)) goto bad; o->sp.top_k = (int)x; }
    else if (!strcmp(a, "--top-p")) { if (num(v, 1e-6, 1, &x)) goto bad; o->sp.top_p = (float)x; }
    else if (!strcmp(a, "--min-p")) { if (num(v, 0, 1, &x)) goto bad; o->sp.min_p = (float)x; }
    else if (!strcmp(a, "--repeat-penalty")) { if (num(v, 1e-3, 100, &x)) goto bad; o->sp.repetition_penalty = (float)x; }
    else if (!strcmp(a, "--presence-penalty")) { if (num(v, -100, 100, &x)) goto bad; o->sp.presence_penalty = (float)x; }
    else if (!strcmp(a, "--frequency-penalty")) { if (num(v, -100, 100, &x)) goto bad; o->sp.frequency_penalty = (float)x; }
    else if (!strcmp(a, "--penalty-last-n")) { if (num(v, -1, 1 << 24, &x)) goto bad; o->sp.penalty_last_n = (int)x; }
    else if (!strcmp(a, "--seed")) {
        char *end;
        errno = 0;
        unsigned long long sd = strtoull(v, &end, 0);
        if (errno || end == v || *end) goto bad;
        o->sp.seed = (uint64_t)sd;
    }
    return 1;
bad:
    fprintf(stderr, "deltafin: bad value for %s: '%s'\n", a, v);
    return -1;
}

static void gen_opts_init(gen_opts *o, int chat_default) {
    memset(o, 0, sizeof *o);
    cli_model_opts_init(&o->mo);
    df_sampler_params_default(&o->sp);
    o->sp.temperature = chat_default ? 0.6f : 0.0f;
    o->max_new = 256;
    o->effort = "max";
    cli_spec_opts_init(&o->so);
}

/* ---- setup ---- */

/* eos_token_id from config.json (root or text_config; a number or a list) */
static void config_eos(gen *g, const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_t *root = json_load_file(path, 0, NULL);
    if (!root) return;
    json_t *tc = json_object_get(root, "text_config");
    json_t *v = json_object_get(json_is_object(tc) ? tc : root, "eos_token_id");
    if (!v) v = json_object_get(root, "eos_token_id");
    if (json_is_integer(v) && g->n_eos < MAX_EOS) g->eos[g->n_eos++] = (int32_t)json_integer_value(v);
    size_t k;
    json_t *x;
    if (json_is_array(v)) json_array_foreach(v, k, x) if (json_is_integer(x) && g->n_eos < MAX_EOS) g->eos[g->n_eos++] = (int32_t)json_integer_value(x);
    json_decref(root);
}

static int setup(gen *g, gen_opts *o, int chat) {
    memset(g, 0, sizeof *g);
    char err[DF_ERRMSG];
    if (df_tokenizer_load_dir(o->mo.model, &g->t, err) != DF_OK) {
        fprintf(stderr, "deltafin: %s\n(run --tokens works without a tokenizer)\n", err);
        return CLI_FAIL;
    }
    g->e = cli_open(&o->mo);
    if (!g->e) return CLI_FAIL;
    g->V = df_engine_vocab_size(g->e);
    g->ctx = o->mo.ctx > 0 ? o->mo.ctx : (df_engine_max_context(g->e) < 4096 ? df_engine_max_context(g->e) : 4096);
    if (df_session_new(g->e, g->ctx, &g->s) != DF_OK) { fprintf(stderr, "deltafin: cannot allocate a session\n"); return CLI_FAIL; }
    if (df_sampler_new(&o->sp, g->V, &g->smp, err) != DF_OK) { fprintf(stderr, "deltafin: %s\n", err); return CLI_FAIL; }
    g->k3 = df_tokenizer_special(g->t, "<|open|>") >= 0;
    if (df_detok_new(g->t, !(chat && g->k3), &g->dt) != DF_OK) { fprintf(stderr, "deltafin: out of memory\n"); return CLI_FAIL; }
    config_eos(g, o->mo.model);
    static const char *const eos_names[] = {"<|end_of_msg|>", "[EOS]", "<|im_end|>", "<|endoftext|>", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", NULL};
    for (int k = 0; eos_names[k] && g->n_eos < MAX_EOS; k++) {
        int32_t id = df_tokenizer_special(g->t, eos_names[k]);
        if (id >= 0) g->eos[g->n_eos++] = id;
    }
    g->ignore_eos = o->ignore_eos;
    g->n_stop = o->n_stop;
    memcpy(g->stop, o->stop, sizeof g->stop);
    g->max_new = o->max_new;
    g->chat = chat;
    g->stats = o->stats;
    if (o->so.on) g->spec = cli_spec_new(&o->so, g->s, g->smp); /* NULL: said why, no drafts */
    return CLI_OK;
}

static void teardown(gen *g) {
    df_spec_free(g->spec);
    df_detok_free(g->dt);
    df_sampler_free(g->smp);
    df_session_free(g->s);
    df_engine_close(g->e);
    df_tokenizer_free(g->t);
    free(g->pend);
}

/* ---- output: stop strings across token boundaries ---- */

static void out_answer(gen *g, const char *s, size_t n) {
    if (g->stopped || !n) return;
    if (!g->n_stop) { fwrite(s, 1, n, stdout); fflush(stdout); return; }
    if (g->npend + n + 1 > g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 256;
        while (cap < g->npend + n + 1) cap *= 2;
        char *p = realloc(g->pend, cap);
        if (!p) return;
        g->pend = p;
        g->cap = cap;
    }
    memcpy(g->pend + g->npend, s, n);
    g->npend += n;
    size_t cut = g->npend, keep = 0;
    for (int k = 0; k < g->n_stop; k++) {
        char *hit = memmem(g->pend, g->npend, g->stop[k], strlen(g->stop[k]));
        if (hit && (size_t)(hit - g->pend) < cut) { cut = (size_t)(hit - g->pend); g->stopped = 1; }
    }
    if (!g->stopped) /* hold back the longest tail that begins a stop string */
        for (int k = 0; k < g->n_stop; k++) {
            size_t L = strlen(g->stop[k]);
            for (size_t j = L - 1 < g->npend ? L - 1 : g->npend; j > keep; j--)
                if (!memcmp(g->pend + g->npend - j, g->stop[k], j)) { keep = j; break; }
        }
    size_t out = g->stopped ? cut : g->npend - keep;
    fwrite(g->pend, 1, out, stdout);
    fflush(stdout);
    memmove(g->pend, g->pend + out, g->npend - out);
    g->npend -= out;
    if (g->stopped) g->npend = 0;
}

static void flush_answer(gen *g) {
    if (g->npend && !g->stopped) fwrite(g->pend, 1, g->npend, stdout);
    g->npend = 0;
    fflush(stdout);
}

static void on_chat(void *ud, int kind, const char *s, size_t n) {
    gen *g = ud;
    if (kind == DF_CHAT_CONTENT) { out_answer(g, s, n); return; }
    if (kind == DF_CHAT_REASONING) {
        if (!g->saw_reasoning && isatty(2)) fputs("\033[2m", stderr);
        g->saw_reasoning = 1;
        fwrite(s, 1, n, stderr);
        return;
    }
    fprintf(stderr, "\n[tool call] %.*s\n", (int)n, s);
}

/* ---- one generation turn ---- */

/* Shows one generated token (EOS is not shown); 1 if it is an EOS. */
static int show(gen *g, df_chat_parser *cp, int32_t tok) {
    for (int k = 0; k < g->n_eos && !g->ignore_eos; k++)
        if (tok == g->eos[k]) return 1;
    const char *txt;
    size_t tl;
    if (df_detok_push(g->dt, tok, &txt, &tl) == DF_OK) {
        if (cp) df_chat_parser_feed(cp, txt, tl);
        else out_answer(g, txt, tl);
    }
    return 0;
}

/* The generation loop with --spec: steps return several tokens; those past
 * a stop are dropped, and a chat session is settled to hold what was shown
 * (as the plain loop leaves it). */
static int spec_turn(gen *g, df_chat_parser *cp, const int32_t *ids, int n, int *made, int *finished) {
    if (df_spec_context(g->spec, ids, n) != DF_OK) { fprintf(stderr, "deltafin: out of memory\n"); return CLI_FAIL; }
    int unshown = 0, full = 0;
    while (*made < g->max_new && !interrupted && !g->stopped && !*finished) {
        int32_t toks[DF_SPEC_MAX + 1];
        int k;
        df_status st = df_spec_step(g->spec, g->max_new - *made, toks, NULL, &k);
        if (st == DF_ERR_CONTEXT) { full = 1; if (g->stats) fprintf(stderr, "\n[context limit reached]\n"); break; }
        if (st != DF_OK) { fprintf(stderr, "\ndeltafin: %s\n", df_session_error(g->s)); return CLI_FAIL; }
        for (int i = 0; i < k; i++) {
            if (*made >= g->max_new || g->stopped || interrupted) { unshown = k - i; break; }
            (*made)++;
            if (show(g, cp, toks[i])) { *finished = 1; unshown = k - i - 1; break; }
        }
    }
    if (g->chat && df_spec_settle(g->spec, full ? 1 : unshown) != DF_OK) {
        fprintf(stderr, "\ndeltafin: %s\n", df_session_error(g->s));
        return CLI_FAIL;
    }
    return CLI_OK;
}

/* Evaluates the prompt ids, then samples until a stop. *finished is 1 when
 * the model closed its message (EOS; the EOS is evaluated too, so a chat
 * session holds the whole turn). */
static int turn(gen *g, const int32_t *ids, int n, int in_thinking, int *finished) {
    *finished = 0;
    g->stopped = 0;
    g->npend = 0;
    g->saw_reasoning = 0;
    int pos = df_session_pos(g->s);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= g->V) {
            fprintf(stderr, "deltafin: prompt token %d is outside the model's vocabulary (%d): tokenizer and model disagree\n", ids[i], g->V);
            return CLI_FAIL;
        }
    if (pos + n > g->ctx) {
        fprintf(stderr, "deltafin: the prompt (%d tokens) does not fit the context limit (%d tokens, %d used); raise --ctx%s\n",
                n, g->ctx, pos, g->chat ? " or /reset" : "");
        return CLI_FAIL;
    }
    df_chat_parser *cp = NULL;
    if (g->chat && g->k3 && df_chat_parser_new(in_thinking, on_chat, g, &cp) != DF_OK) return CLI_FAIL;
    df_detok_reset(g->dt);
    double t0 = cli_now();
    int rc = CLI_FAIL;
    if (df_session_eval(g->s, ids, n, NULL) != DF_OK) { fprintf(stderr, "deltafin: %s\n", df_session_error(g->s)); goto done; }
    double t1 = cli_now();
    g->prefill_n = n;
    g->prefill_s = t1 - t0;
    int made = 0;
    if (g->spec) {
        if (spec_turn(g, cp, ids, n, &made, finished) != CLI_OK) goto done;
        goto out;
    }
    for (; made < g->max_new && !interrupted && !g->stopped; made++) {
        int32_t tok = df_sampler_sample(g->smp, df_session_logits(g->s), NULL);
        df_sampler_accept(g->smp, tok);
        int is_eos = 0;
        for (int k = 0; k < g->n_eos && !g->ignore_eos; k++) is_eos |= tok == g->eos[k];
        const char *txt;
        size_t tl;
        if (!is_eos && df_detok_push(g->dt, tok, &txt, &tl) == DF_OK) {
            if (cp) df_chat_parser_feed(cp, txt, tl);
            else out_answer(g, txt, tl);
        }
        int room = df_session_pos(g->s) < g->ctx;
        if (is_eos) {
            *finished = 1;
            if (g->chat && room && df_session_eval(g->s, &tok, 1, NULL) != DF_OK) {
                fprintf(stderr, "\ndeltafin: %s\n", df_session_error(g->s));
                goto done;
            }
            made++;
            break;
        }
        if (made + 1 == g->max_new || g->stopped || interrupted) {
            /* a chat session keeps what was shown: evaluate the last token too */
            if (g->chat && room && df_session_eval(g->s, &tok, 1, NULL) != DF_OK) {
                fprintf(stderr, "\ndeltafin: %s\n", df_session_error(g->s));
                goto done;
            }
            made++;
            break;
        }
        if (!room) { made++; if (g->stats) fprintf(stderr, "\n[context limit reached]\n"); break; }
        if (df_session_eval(g->s, &tok, 1, NULL) != DF_OK) {
            fprintf(stderr, "\ndeltafin: %s\n", df_session_error(g->s));
            goto done;
        }
    }
out:;
    const char *txt;
    size_t tl;
    df_detok_flush(g->dt, &txt, &tl);
    if (cp) {
        df_chat_parser_feed(cp, txt, tl);
        if (df_chat_parser_done(cp)) *finished = 1;
        df_chat_parser_finish(cp);
    } else out_answer(g, txt, tl);
    flush_answer(g);
    if (g->saw_reasoning && isatty(2)) fputs("\033[0m", stderr);
    if (g->saw_reasoning) fputc('\n', stderr);
    g->gen_n = made;
    g->gen_s = cli_now() - t1;
    rc = CLI_OK;
done:
    df_chat_parser_free(cp);
    return rc;
}

static void print_stats(gen *g) {
    const char *lossy = df_engine_lossy(g->e);
    int steps = g->gen_n > 1 ? g->gen_n - 1 : 0;
    fprintf(stderr, "%s%sprompt %d tokens in %.3f s (%.1f tok/s); generated %d tokens in %.3f s (%.2f tok/s); context %d/%d\n",
            lossy, *lossy ? " | " : "", g->prefill_n, g->prefill_s, g->prefill_n / (g->prefill_s + 1e-12), g->gen_n,
            g->gen_s, steps / (g->gen_s + 1e-12), df_session_pos(g->s), g->ctx);
    if (g->spec) cli_spec_print(g->spec, stderr);
}

static void catch_sigint(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
}

/* ---- run --prompt ---- */

int cmd_run_wants_text(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--prompt")) return 1;
    return 0;
}

static int parse_gen(gen_opts *o, const char *cmd, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(&o->mo, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        r = gen_opt(o, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        return cli_usage(cmd, "unknown or incomplete option");
    }
    if (o->effort && (!strcmp(o->effort, "none") || !*o->effort)) o->effort = NULL;
    return 0;
}

int cmd_run_text(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: deltafin run --model DIR --prompt TEXT [--chat] [options]\n"
                   "Streams the continuation of TEXT (with --chat: the answer to a user message in\n"
                   "the model's chat format; the thinking goes to stderr). Ctrl-C stops cleanly.\n\n%s%s",
                   gen_opts_help_text(), cli_model_opts_help);
            return 0;
        }
    int chat = 0;
    for (int i = 1; i < argc; i++) chat |= !strcmp(argv[i], "--chat");
    gen_opts o;
    gen_opts_init(&o, chat);
    int u = parse_gen(&o, "run", argc, argv);
    if (u) return u;
    if (!o.mo.model || !o.prompt) return cli_usage("run", "--model and --prompt are required");
    gen g;
    int rc = setup(&g, &o, o.chat);
    df_tokens ids = {0};
    char err[DF_ERRMSG];
    if (rc != CLI_OK) goto done;
    rc = CLI_FAIL;
    if (o.chat) {
        df_chat_msg m[2];
        int n = 0;
        if (o.system) m[n++] = (df_chat_msg){.role = "system", .content = o.system};
        m[n++] = (df_chat_msg){.role = "user", .content = o.prompt};
        df_chat_opts co;
        df_chat_opts_default(&co);
        co.reasoning_effort = o.effort;
        co.thinking = !o.no_think;
        if (df_chat_render(g.t, m, n, &co, &ids, NULL, err) != DF_OK) { fprintf(stderr, "deltafin: %s\n", err); goto done; }
    } else if (df_tokenize(g.t, o.prompt, strlen(o.prompt), 0, &ids, err) != DF_OK) {
        fprintf(stderr, "deltafin: the prompt: %s\n", err);
        goto done;
    }
    if (ids.n == 0) { fprintf(stderr, "deltafin: the prompt is empty\n"); goto done; }
    catch_sigint();
    int finished;
    rc = turn(&g, ids.ids, ids.n, !o.no_think, &finished);
    printf("\n");
    fflush(stdout);
    if (rc == CLI_OK && o.stats) print_stats(&g);
    if (interrupted) fprintf(stderr, "[interrupted]\n");
done:
    df_tokens_free(&ids);
    teardown(&g);
    return rc;
}

/* ---- chat ---- */

int cmd_chat(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: deltafin chat --model DIR [options]\n"
                   "An interactive conversation: one message per line; /reset starts over,\n"
                   "/stats prints timings and context use, /quit (or end of input) leaves.\n"
                   "Earlier turns stay in the session: each turn evaluates only its new tokens.\n\n%s%s",
                   gen_opts_help_text(), cli_model_opts_help);
            return 0;
        }
    gen_opts o;
    gen_opts_init(&o, 1);
    int u = parse_gen(&o, "chat", argc, argv);
    if (u) return u;
    if (!o.mo.model) return cli_usage("chat", "--model is required");
    if (o.prompt) return cli_usage("chat", "--prompt belongs to run; chat reads stdin");
    gen g;
    int rc = setup(&g, &o, 1);
    if (rc != CLI_OK) { teardown(&g); return rc; }
    catch_sigint();
    int tty = isatty(0);
    char *line = NULL;
    size_t lcap = 0;
    df_tokens ids = {0};
    char err[DF_ERRMSG];
    int turns = 0;
    for (;;) {
        if (tty) { fputs("> ", stderr); fflush(stderr); }
        interrupted = 0;
        ssize_t got = getline(&line, &lcap, stdin);
        if (got < 0) break;
        while (got && (line[got - 1] == '\n' || line[got - 1] == '\r')) line[--got] = 0;
        if (!got) continue;
        if (!strcmp(line, "/quit") || !strcmp(line, "/exit")) break;
        if (!strcmp(line, "/reset")) {
            df_session_reset(g.s);
            df_sampler_reset(g.smp);
            if (g.spec) df_spec_reset(g.spec);
            turns = 0;
            fprintf(stderr, "[conversation reset]\n");
            continue;
        }
        if (!strcmp(line, "/stats")) {
            print_stats(&g);
            continue;
        }
        ids.n = 0;
        df_chat_msg m[2];
        int n = 0;
        if (!turns && o.system) m[n++] = (df_chat_msg){.role = "system", .content = o.system};
        m[n++] = (df_chat_msg){.role = "user", .content = line};
        df_chat_opts co;
        df_chat_opts_default(&co);
        co.reasoning_effort = turns ? NULL : o.effort; /* the effort message opens the conversation */
        co.thinking = !o.no_think;
        if (df_chat_render(g.t, m, n, &co, &ids, NULL, err) != DF_OK) {
            fprintf(stderr, "deltafin: %s\n", err);
            continue;
        }
        int finished;
        if (turn(&g, ids.ids, ids.n, !o.no_think, &finished) != CLI_OK) {
            if (df_session_pos(g.s) + ids.n > g.ctx) continue; /* said why; the conversation is unchanged */
            rc = CLI_FAIL;
            break;
        }
        printf("\n");
        fflush(stdout);
        if (!finished) {
            /* cut short (length, stop string, Ctrl-C): close the message so the
             * next turn starts where the format expects it */
            const char *close = g.k3 ? "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
                                : df_tokenizer_special(g.t, "<|im_end|>") >= 0 ? "<|im_end|>"
                                : "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
            df_tokens c = {0};
            if (df_tokenize(g.t, close, strlen(close), DF_TOK_SPECIAL, &c, err) == DF_OK &&
                df_session_pos(g.s) + c.n <= g.ctx && df_session_eval(g.s, c.ids, c.n, NULL) == DF_OK && g.spec)
                df_spec_context(g.spec, c.ids, c.n);
            df_tokens_free(&c);
        }
        if (o.stats) print_stats(&g);
        turns++;
    }
    free(line);
    df_tokens_free(&ids);
    teardown(&g);
    return rc;
}
