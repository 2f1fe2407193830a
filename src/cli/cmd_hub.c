/* cmd_hub.c — the hub subcommands: setup, fetch-experts, warm, doctor; and
 * the hook that lets every model command open a stream-mode mirror.
 *
 *   deltafin setup moonshotai/Kimi-K3 --dir /models/k3 [--stream] [--cache-limit 200G]
 *   deltafin fetch-experts /models/k3 --layers 1-40,45 --workers 8
 *   deltafin warm /models/k3 --trace chat.jsonl --fetch 2000
 *   deltafin doctor /models/k3 [--hash]
 *
 * Environment (read here, never by the library): HF_ENDPOINT (default
 * https://huggingface.co), HF_TOKEN; DF_HUB_RETRY_MS (first retry backoff)
 * and DF_HUB_FREE_BYTES (pretend this much disk is free) exist for tests.
 */
#include "cli.h"
#include "../hub/hub.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static pthread_mutex_t out_mu = PTHREAD_MUTEX_INITIALIZER;
static int progress_tty;

static int wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return 1;
    return 0;
}

static void client_from_env(hub_client *c) {
    memset(c, 0, sizeof *c);
    const char *ep = getenv("HF_ENDPOINT"), *tok = getenv("HF_TOKEN"), *rm = getenv("DF_HUB_RETRY_MS");
    c->endpoint = ep && *ep ? ep : "https://huggingface.co";
    c->token = tok && *tok ? tok : NULL;
    c->retries = 5;
    c->retry_ms = rm && *rm ? atoi(rm) : 500;
    c->timeout_s = 60;
}

static void fmt_eta(char *b, size_t n, double s) {
    if (s < 0 || s > 1e7) snprintf(b, n, "?");
    else if (s < 60) snprintf(b, n, "%.0fs", s);
    else if (s < 3600) snprintf(b, n, "%.0fm%02.0fs", s / 60, s - 60 * (int)(s / 60));
    else snprintf(b, n, "%.0fh%02.0fm", s / 3600, (s - 3600 * (int)(s / 3600)) / 60);
}

/* Progress of one file: a redrawn bar on a terminal, a plain line every few
 * seconds (and at the end) otherwise. */
static void on_progress(void *ctx, const hub_progress *p) {
    (void)ctx;
    static double last_line;
    double t = cli_now();
    char eta[32];
    fmt_eta(eta, sizeof eta, p->rate > 0 ? (double)(p->total - p->done) / p->rate : -1);
    double pct = p->total ? 100.0 * (double)p->done / (double)p->total : 100.0;
    pthread_mutex_lock(&out_mu);
    if (progress_tty) {
        char bar[26];
        int k = (int)(pct / 4);
        for (int i = 0; i < 25; i++) bar[i] = i < k ? '#' : '.';
        bar[25] = 0;
        fprintf(stderr, "\r\033[K%-40.40s [%s] %5.1f%% %9.1f MB %7.1f MB/s ETA %s%s", p->file, bar, pct,
                p->done / 1e6, p->rate / 1e6, eta, p->finished ? "\n" : "");
    } else if (p->finished || t - last_line >= 5.0) {
        last_line = t;
        fprintf(stderr, "%s: %.1f of %.1f MB (%.0f%%), %.1f MB/s%s%s\n", p->file, p->done / 1e6, p->total / 1e6, pct,
                p->rate / 1e6, p->finished ? ", done" : ", ETA ", p->finished ? "" : eta);
    }
    pthread_mutex_unlock(&out_mu);
}

static void on_note(void *ctx, const char *line) {
    (void)ctx;
    pthread_mutex_lock(&out_mu);
    fprintf(stderr, "%s%s\n", progress_tty ? "\r\033[K" : "", line);
    pthread_mutex_unlock(&out_mu);
}

static int parse_count(const char *s, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || end == s || v < 1 || v > 1024) return -1;
    *out = (int)v;
    return 0;
}

/* ---- setup ---- */

static const char setup_help[] =
    "usage: deltafin setup REPO [--revision REV] [--dir DIR] [--full | --stream] [--dry-run] [--workers N]\n"
    "Installs a model from a Hugging Face-compatible hub (HF_ENDPOINT, default\n"
    "https://huggingface.co; HF_TOKEN for gated or private repositories).\n"
    "\n"
    "  --dir DIR      where the model goes (default: the repository's name)\n"
    "  --revision R   branch, tag or commit (default main); the mirror pins the commit\n"
    "  --full         download every file (resumable, sha256-checked, atomic)\n"
    "  --stream       download metadata and non-expert tensors; routed experts are\n"
    "                 fetched on first use into sparse local shards (same offsets)\n"
    "                 default: --full when it fits the free disk with a 5%% margin\n"
    "  --dry-run      print the plan only\n"
    "  --int8-spine   then convert the spine to row-wise int8 (deltafin convert-spine DIR): a\n"
    "                 smaller resident spine, LOSSY, used by default once converted\n"
    "  --workers N    parallel transfers (default 4)\n"
    "  --cache-limit SIZE  stream: disk budget for fetched routed experts (e.g. 150G); when\n"
    "                 a fetch would pass it, the least recently used experts are evicted\n"
    "                 (holes punched); kept in the mirror, 0 = none; `run --cache-limit`\n"
    "                 overrides it for one process\n"
    "Run it again to resume; on a stream mirror, --full fills the gaps.\n";

int cmd_setup(int argc, char **argv) {
    if (wants_help(argc, argv)) { printf(setup_help); return CLI_OK; }
    hub_setup_opts o;
    memset(&o, 0, sizeof o);
    client_from_env(&o.client);
    o.workers = 4;
    o.cache_limit = -1;
    int int8 = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--full")) o.mode = HUB_FULL;
        else if (!strcmp(a, "--stream")) o.mode = HUB_STREAM;
        else if (!strcmp(a, "--dry-run")) o.dry_run = 1;
        else if (!strcmp(a, "--int8-spine")) int8 = 1;
        else if (!strcmp(a, "--dir") && v) { o.dir = v; i++; }
        else if (!strcmp(a, "--revision") && v) { o.revision = v; i++; }
        else if (!strcmp(a, "--cache-limit") && v) {
            if ((o.cache_limit = cli_parse_size(v)) < 0) return cli_usage("setup", "--cache-limit needs a size, e.g. 150G");
            i++;
        }
        else if (!strcmp(a, "--workers") && v) {
            if (parse_count(v, &o.workers)) return cli_usage("setup", "--workers needs a count 1..1024");
            i++;
        } else if (a[0] != '-' && !o.repo) o.repo = a;
        else return cli_usage("setup", "unknown or incomplete option");
    }
    if (!o.repo || !strchr(o.repo, '/')) return cli_usage("setup", "REPO (owner/name) is required");
    if (!o.dir) o.dir = strrchr(o.repo, '/') + 1;
    const char *fb = getenv("DF_HUB_FREE_BYTES");
    if (fb && *fb) o.free_bytes = cli_parse_size(fb);
    progress_tty = isatty(2);
    o.client.progress = on_progress;
    o.note = on_note;
    hub_report rep;
    char err[DF_ERRMSG];
    double t0 = cli_now();
    df_status st = hub_setup(&o, &rep, err);
    if (st != DF_OK) {
        fprintf(stderr, "deltafin setup: %s\n", err);
        return CLI_FAIL;
    }
    if (o.dry_run) return CLI_OK;
    double dt = cli_now() - t0;
    printf("%s: %s mirror of %s ready (%.3f GB fetched in %d transfers, %.1f s)\n", o.dir,
           rep.mode == HUB_STREAM ? "stream" : "full", o.repo, rep.fetched_bytes / 1e9, rep.requests, dt);
    if (rep.mode == HUB_STREAM)
        printf("routed experts: %.3f of %.3f GB local; they are fetched on first use, or now with "
               "`deltafin fetch-experts %s`\n",
               rep.local_expert_bytes / 1e9, rep.expert_bytes / 1e9, o.dir);
    if (int8) { /* the spine is local in both modes: convert it now */
        char *args[] = {(char *)"convert-spine", (char *)o.dir, NULL};
        return cmd_convert_spine(2, args);
    }
    return CLI_OK;
}

/* ---- fetch-experts ---- */

/* "1-40,45" into a bitmap of n entries; -1 on a bad list. */
static int parse_layers(const char *s, uint8_t *bits, int n) {
    const char *p = s;
    while (*p) {
        char *end;
        long a = strtol(p, &end, 10), b = a;
        if (end == p || a < 0) return -1;
        p = end;
        if (*p == '-') {
            b = strtol(p + 1, &end, 10);
            if (end == p + 1 || b < a) return -1;
            p = end;
        }
        for (long i = a; i <= b && i < n; i++) bits[i] = 1;
        if (*p == ',') p++;
        else if (*p) return -1;
    }
    return 0;
}

int cmd_fetch_experts(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        printf("usage: deltafin fetch-experts DIR [--layers 1-40,45] [--dry-run] [--workers N] [--cache-limit SIZE]\n"
               "Completes a stream-mode mirror: fetches the missing spans (only the routed experts\n"
               "of --layers if given), adjacent spans coalesced into requests of up to 64 MiB.\n"
               "Resumable; a complete mirror is checked against the hub's sha256 and becomes full.\n"
               "With a cache limit (set at setup, or --cache-limit here) a fetch that cannot fit fails first.\n");
        return CLI_OK;
    }
    const char *dir = NULL, *layers = NULL;
    int dry = 0, workers = 4;
    int64_t limit = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--dry-run")) dry = 1;
        else if (!strcmp(a, "--layers") && v) { layers = v; i++; }
        else if (!strcmp(a, "--cache-limit") && v) {
            if ((limit = cli_parse_size(v)) < 0) return cli_usage("fetch-experts", "--cache-limit needs a size");
            i++;
        }
        else if (!strcmp(a, "--workers") && v) {
            if (parse_count(v, &workers)) return cli_usage("fetch-experts", "--workers needs a count 1..1024");
            i++;
        } else if (a[0] != '-' && !dir) dir = a;
        else return cli_usage("fetch-experts", "unknown or incomplete option");
    }
    if (!dir) return cli_usage("fetch-experts", "DIR is required");
    enum { MAXL = 4096 };
    uint8_t *bits = NULL;
    if (layers) {
        bits = calloc(MAXL, 1);
        if (!bits || parse_layers(layers, bits, MAXL)) { free(bits); return cli_usage("fetch-experts", "--layers wants e.g. 1-40,45"); }
    }
    hub_client c;
    client_from_env(&c);
    if (!getenv("HF_ENDPOINT")) c.endpoint = NULL; /* the mirror's own */
    hub_report rep;
    char err[DF_ERRMSG];
    double t0 = cli_now();
    df_status st = hub_fill(dir, &c, bits, bits ? MAXL : 0, workers, dry, limit, &rep, err);
    free(bits);
    if (st != DF_OK) {
        fprintf(stderr, "deltafin fetch-experts: %s\n", err);
        return CLI_FAIL;
    }
    double dt = cli_now() - t0;
    if (dry)
        printf("%s: would fetch %.3f MB in %d requests; experts %.3f of %.3f MB local\n", dir, rep.total_bytes / 1e6,
               rep.requests, rep.local_expert_bytes / 1e6, rep.expert_bytes / 1e6);
    else
        printf("%s: fetched %.3f MB in %d requests (%.1f s, %.1f MB/s); mirror is %s\n", dir, rep.fetched_bytes / 1e6,
               rep.requests, dt, dt > 0 ? rep.fetched_bytes / 1e6 / dt : 0.0, rep.mode == HUB_FULL ? "full" : "stream");
    return CLI_OK;
}

/* ---- warm ---- */

int cmd_warm(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        printf("usage: deltafin warm DIR (--trace FILE | --heat FILE) --fetch N [--dry-run] [--workers N]\n"
               "                          [--cache-limit SIZE]\n"
               "Fetches the N most-used routed experts of a stream-mode mirror that are not local yet,\n"
               "ranked from a router trace (`--trace FILE` of run/logits/serve: one JSON line per token\n"
               "and MoE layer; by selections, then summed weight) or heat statistics (`--heat FILE`).\n"
               "Adjacent experts are fetched in one request. With a cache limit, only as many as fit\n"
               "are fetched, and the ranked experts are marked used so the hottest are evicted last.\n"
               "  --dry-run   print what would be fetched\n");
        return CLI_OK;
    }
    const char *dir = NULL, *trace = NULL, *heat = NULL;
    int dry = 0, workers = 4, n = -1;
    int64_t limit = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--dry-run")) dry = 1;
        else if (!strcmp(a, "--trace") && v) { trace = v; i++; }
        else if (!strcmp(a, "--heat") && v) { heat = v; i++; }
        else if (!strcmp(a, "--fetch") && v) {
            char *end;
            long x = strtol(v, &end, 10);
            if (*end || end == v || x < 0 || x > 1 << 30) return cli_usage("warm", "--fetch needs a count");
            n = (int)x;
            i++;
        } else if (!strcmp(a, "--workers") && v) {
            if (parse_count(v, &workers)) return cli_usage("warm", "--workers needs a count 1..1024");
            i++;
        } else if (!strcmp(a, "--cache-limit") && v) {
            if ((limit = cli_parse_size(v)) < 0) return cli_usage("warm", "--cache-limit needs a size");
            i++;
        } else if (a[0] != '-' && !dir) dir = a;
        else return cli_usage("warm", "unknown or incomplete option");
    }
    if (!dir) return cli_usage("warm", "DIR is required");
    if (!trace == !heat) return cli_usage("warm", "give one of --trace FILE or --heat FILE");
    if (n < 0) return cli_usage("warm", "--fetch N is required");
    hub_rank *r = NULL;
    int nr = 0, unknown = 0;
    char err[DF_ERRMSG];
    df_status st = trace ? hub_rank_trace(trace, &r, &nr, err) : hub_rank_heat(heat, &r, &nr, err);
    if (st != DF_OK) {
        fprintf(stderr, "deltafin warm: %s\n", err);
        return CLI_FAIL;
    }
    hub_client c;
    client_from_env(&c);
    if (!getenv("HF_ENDPOINT")) c.endpoint = NULL; /* the mirror's own */
    hub_report rep;
    double t0 = cli_now();
    st = hub_warm(dir, &c, r, nr, n, workers, dry, limit, &rep, &unknown, err);
    free(r);
    if (st != DF_OK) {
        fprintf(stderr, "deltafin warm: %s\n", err);
        return CLI_FAIL;
    }
    if (unknown)
        fprintf(stderr, "deltafin warm: %d of the %d ranked experts are not in %s (a trace of another model?)\n",
                unknown, nr, dir);
    double dt = cli_now() - t0;
    const char *capped = rep.requests < n ? " (fewer than asked: the other ranked experts are local, or do not fit the cache limit)" : "";
    if (dry)
        printf("%s: would fetch %d experts, %.3f MB%s; experts %.3f of %.3f MB local\n", dir, rep.requests,
               rep.total_bytes / 1e6, capped, rep.local_expert_bytes / 1e6, rep.expert_bytes / 1e6);
    else
        printf("%s: warmed %d experts, fetched %.3f MB (%.1f s)%s; experts %.3f of %.3f MB local\n", dir, rep.requests,
               rep.fetched_bytes / 1e6, dt, capped, rep.local_expert_bytes / 1e6, rep.expert_bytes / 1e6);
    return CLI_OK;
}

/* ---- doctor ---- */

static void doctor_line(void *ctx, const char *line) {
    (void)ctx;
    printf("%s\n", line);
}

int cmd_doctor(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        printf("usage: deltafin doctor DIR [--hash]\n"
               "Offline, read-only check of a mirror made by `deltafin setup`: files present with\n"
               "their sizes, span logs readable and consistent, non-expert tensors local, free disk.\n"
               "  --hash   also check complete files against the commit's sha256\n");
        return CLI_OK;
    }
    const char *dir = NULL;
    int hash = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--hash")) hash = 1;
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else return cli_usage("doctor", "unknown option");
    }
    if (!dir) return cli_usage("doctor", "DIR is required");
    hub_report rep;
    char err[DF_ERRMSG];
    df_status st = hub_doctor(dir, hash, doctor_line, NULL, &rep, err);
    if (st != DF_OK) {
        printf("deltafin doctor: %s\n", err);
        return CLI_FAIL;
    }
    printf("ok\n");
    return CLI_OK;
}

/* ---- the stream hook of every model command ---- */

static df_hub_stream *attached; /* the CLI's stream mirror, open until exit */

static void report_fetch_error(void) {
    df_hub_stream_stats s;
    df_hub_stream_info(attached, &s);
    if (s.last_error[0]) fprintf(stderr, "deltafin: fetching from the hub failed: %s\n", s.last_error);
    hub_meta mt;
    hub_stream_meta(attached, &mt);
    if (mt.evict_err[0]) fprintf(stderr, "deltafin: --cache-limit could not be kept: %s\n", mt.evict_err);
    hub_stream_flush(attached); /* the use clock and the measured rate, for the next run */
}

int cli_hub_attach(const char *model, int expert_io, int64_t cache_limit, df_engine_opts *eo) {
    if (!model || !df_hub_is_stream(model)) return 0;
    if (expert_io == DF_EXPERTS_MMAP) {
        fprintf(stderr, "deltafin: %s is a stream-mode mirror: routed experts must be read with --io direct or "
                        "pread (mmap would see holes)\n", model);
        return -1;
    }
    const char *ep = getenv("HF_ENDPOINT"), *tok = getenv("HF_TOKEN");
    df_hub_stream *hs;
    char err[DF_ERRMSG];
    if (df_hub_stream_open(model, ep && *ep ? ep : NULL, tok && *tok ? tok : NULL, &hs, err) != DF_OK) {
        fprintf(stderr, "deltafin: cannot open the stream mirror: %s\n", err);
        return -1;
    }
    eo->io = df_hub_stream_io(hs);
    if (cache_limit >= 0 && hub_stream_set_limit(hs, cache_limit, err) != DF_OK)
        fprintf(stderr, "deltafin: --cache-limit: %s\n", err);
    df_hub_stream_stats s;
    hub_meta mt;
    df_hub_stream_info(hs, &s);
    hub_stream_meta(hs, &mt);
    double pct = s.expert_total ? 100.0 * (double)s.expert_local / (double)s.expert_total : 100.0;
    int64_t missing = s.expert_total - s.expert_local;
    char eta[96] = "";
    if (missing > 0 && mt.rate > 0) {
        char t[32];
        fmt_eta(t, sizeof t, (double)missing / mt.rate);
        snprintf(eta, sizeof eta, ", about %s at the %.1f MB/s last measured", t, mt.rate / 1e6);
    } else if (missing > 0) {
        snprintf(eta, sizeof eta, ", time unknown until a fetch is measured");
    }
    char lim[128] = "";
    if (mt.cache_limit > 0)
        snprintf(lim, sizeof lim, "; cache limit %.3f GB (%.3f GB used), coldest experts evicted", mt.cache_limit / 1e9,
                 mt.cache_used / 1e9);
    fprintf(stderr, "deltafin: stream mirror: routed experts %.3f of %.3f GB local (%.0f%%)%s; missing ones are "
                    "fetched on first use; completing needs %.3f GB%s (`deltafin fetch-experts %s`)\n",
            s.expert_local / 1e9, s.expert_total / 1e9, pct, lim, missing / 1e9, eta, model);
    attached = hs;
    atexit(report_fetch_error);
    return 0;
}
