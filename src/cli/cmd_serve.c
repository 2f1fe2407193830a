/* cmd_serve.c — `deltafin serve`: the OpenAI-compatible HTTP server (the
 * work is in src/server; this file parses options, prints the address and
 * log lines, and waits for SIGINT / SIGTERM).
 *
 *   deltafin serve --model DIR --host 127.0.0.1 --port 8000 [--api-key KEY]
 *
 * Output contract (tests read it): one stdout line
 *   "deltafin serve: listening on http://HOST:PORT"
 * as soon as the socket is bound (the model may still be loading: /health
 * answers 503 "loading" until it is), then "deltafin serve: ready" once the
 * model is loaded. Log lines go to stderr.
 */
#include "cli.h"
#include "../server/server.h"
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char serve_help[] =
    "usage: deltafin serve --model DIR [options]\n"
    "Serves the model over HTTP with the OpenAI API: GET /v1/models, POST /v1/chat/completions,\n"
    "POST /v1/completions (streaming with server-sent events), GET /health, GET /metrics\n"
    "(Prometheus text). Up to --parallel generations decode together (one step, each chosen\n"
    "expert read once for all of them; every request's output is what it would be alone);\n"
    "others wait in a FIFO queue. Request fields beyond OpenAI's, as vLLM and llama.cpp take them:\n"
    "top_k, min_p, repetition_penalty, and ignore_eos (end tokens neither end the reply nor show\n"
    "in it: it runs to max_tokens, or to a stop string).\n"
    "The model directory needs its tokenizer (tiktoken.model or tokenizer.json).\n"
    "\n"
    "  --host ADDR             address to listen on (default 127.0.0.1: loopback only)\n"
    "  --port N                port (default 8000; 0: any free port, printed)\n"
    "  --api-key KEY           require 'Authorization: Bearer KEY' on /v1/* (401 otherwise)\n"
    "  --parallel N            generations decoded together (default 1; joining and leaving at\n"
    "                          token boundaries, a new prompt's prefill interleaved)\n"
    "  --retain N              sessions kept for prefix reuse, least recently used dropped\n"
    "                          (default: --parallel)\n"
    "  --retain-mem SIZE       cap on the kept sessions' state (default: none)\n"
    "  --queue N               requests that may wait behind the running ones (default 8);\n"
    "                          past it: 429 with Retry-After\n"
    "  --max-request-bytes S   largest request body (default 1M; 413 above)\n"
    "  --max-tokens N          ceiling on a request's max_tokens (default 4096; 400 above)\n"
    "  --name NAME             model id in /v1/models and responses (default: DIR's base name)\n"
    "  --max-connections N     open connections at once (default 128)\n"
    "  --test-delay-ms N       testing aid: sleep N ms after every generated token\n"
    "                          (never changes the output)\n"
    "%s"
    "\n"
    "model options:\n";

static int parse_nonneg(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

static void log_line(void *ud, const char *line) {
    (void)ud;
    fprintf(stderr, "deltafin serve: %s\n", line);
}

int cmd_serve(int argc, char **argv) {
    cli_model_opts mo;
    cli_model_opts_init(&mo);
    srv_opts so;
    srv_opts_default(&so);
    cli_spec_opts spec;
    cli_spec_opts_init(&spec);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf(serve_help, cli_spec_opts_help);
            fputs(cli_model_opts_help, stdout);
            return CLI_OK;
        }
        int r = cli_model_opt(&mo, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        if ((r = cli_spec_opt(&spec, argc, argv, &i)) < 0) return CLI_USAGE;
        if (r) continue;
        if (!v) return cli_usage("serve", "unknown option or missing value");
        i++;
        int bad = 0;
        if (!strcmp(a, "--host")) so.host = v;
        else if (!strcmp(a, "--port")) bad = parse_nonneg(v, 0, 65535, &so.port);
        else if (!strcmp(a, "--api-key")) { so.api_key = v; bad = !*v; }
        else if (!strcmp(a, "--queue")) bad = parse_nonneg(v, 0, 1 << 20, &so.queue);
        else if (!strcmp(a, "--max-request-bytes")) bad = (so.max_request_bytes = cli_parse_size(v)) <= 0;
        else if (!strcmp(a, "--max-tokens")) bad = parse_nonneg(v, 1, 1 << 24, &so.max_tokens);
        else if (!strcmp(a, "--name")) { so.model_name = v; bad = !*v; }
        else if (!strcmp(a, "--max-connections")) bad = parse_nonneg(v, 1, 1 << 16, &so.max_connections);
        else if (!strcmp(a, "--test-delay-ms")) bad = parse_nonneg(v, 0, 60000, &so.test_delay_ms);
        else if (!strcmp(a, "--parallel")) bad = parse_nonneg(v, 1, 256, &so.parallel);
        else if (!strcmp(a, "--retain")) bad = parse_nonneg(v, 1, 4096, &so.retain);
        else if (!strcmp(a, "--retain-mem")) bad = (so.retain_bytes = cli_parse_size(v)) <= 0;
        else return cli_usage("serve", "unknown option");
        if (bad) {
            fprintf(stderr, "deltafin serve: bad value for %s: '%s' (see `deltafin serve --help`)\n", a, v);
            return CLI_USAGE;
        }
    }
    if (!mo.model) return cli_usage("serve", "--model is required");
    if (mo.trace_path) return cli_usage("serve", "--trace is not available in serve");
    so.model_dir = mo.model;
    so.ctx = mo.ctx;
    if (cli_engine_opts(&mo, &so.engine) != 0) return CLI_FAIL;
    so.log = log_line;
    so.spec = spec.on;
    so.spec_params = spec.p;

    /* Signals: every thread the server starts inherits this mask, so
     * SIGINT / SIGTERM reach only the sigwait below. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    srv *s = NULL;
    char err[DF_ERRMSG];
    if (srv_start(&so, &s, err) != DF_OK) {
        fprintf(stderr, "deltafin serve: %s\n", err);
        return CLI_FAIL;
    }
    const char *h = so.host;
    int v6 = strchr(h, ':') != NULL;
    printf("deltafin serve: listening on http://%s%s%s:%d\n", v6 ? "[" : "", h, v6 ? "]" : "", srv_port(s));
    fflush(stdout);
    if (srv_wait_loaded(s, err) != DF_OK) {
        fprintf(stderr, "deltafin serve: cannot load the model: %s\n", err);
        srv_stop(s);
        return CLI_FAIL;
    }
    printf("deltafin serve: ready\n");
    fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    fprintf(stderr, "deltafin serve: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    srv_stop(s);
    return CLI_OK;
}
