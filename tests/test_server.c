/* test_server.c — `deltafin serve` end to end (suite server_).
 *
 * Builds a tiny K3 model directory that runs the whole text path: `deltafin
 * synth --arch kimi_k3 --vocab 1280 --tokenizer cl100k` (cl100k's rank file
 * from tests/text, decompressed): the first 1024 ranks as tiktoken.model and
 * a tokenizer_config.json naming K3's specials at the ids config.json uses:
 * 1024 [BOS], 1025 [EOS], 1026 <|end_of_msg|> (= eos_token_id), 1027
 * <|open|>, 1028 <|close|>, 1029 <|sep|>, ... 1279 [PAD]. Starts two servers on free loopback ports: "main" (--api-key,
 * --max-request-bytes 64K) and "slow" (--test-delay-ms, --queue 1) for the
 * queue and disconnect tests. Then:
 *   server_1_*  unit checks of the stop-string filter, tool-call conversion
 *               and request validation (the stop filter in src/server/gen.c,
 *               the rest in src/server/api.c; no sockets)
 *   server_2_*  curl: malformed JSON, wrong types, missing fields, huge
 *               bodies, unknown routes, wrong methods, no key: status +
 *               OpenAI error object, and the server keeps serving
 *   server_3_*  node --test tests/server (the official openai client);
 *               skipped with a message when node or the npm packages are
 *               missing (.ci/run installs them)
 *   server_4_*  SIGTERM: both servers exit 0 (under SAN=1: no leaks)
 */
#include "test.h"
#include <jansson.h>
#include "deltafin.h"
#include "../src/server/server.h"
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define SRV_SAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SRV_SAN 1
#endif
#endif
#ifndef SRV_SAN
#define SRV_SAN 0
#endif

typedef struct {
    int pid, port;
    char dir[256], out[300], err[300];
} server;

static char model_dir[256];
static server main_srv, slow_srv;
static int started, start_failed;

static void msleep(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int make_model(void) {
    const char *d = t_tmpdir("srv-model");
    if (!d) return -1;
    snprintf(model_dir, sizeof model_dir, "%s", d);
    char out[4096];
    int rc = t_sh(out, sizeof out,
                  "gzip -dc tests/text/cl100k_base.tiktoken.gz > %s.cl100k && "
                  "%s synth --arch kimi_k3 --vocab 1280 --tokenizer %s.cl100k --out %s --force --quiet; "
                  "r=$?; rm -f %s.cl100k; exit $r",
                  d, t_bin(), d, d, d);
    if (rc) fprintf(stderr, "    %s\n", out);
    return rc ? -1 : 0;
}

/* Starts `deltafin serve` in the background under a shell that records its
 * pid and, once it exits, its exit status; waits for "ready". */
static int start_server(server *s, const char *tag, const char *extra) {
    const char *d = t_tmpdir(tag);
    if (!d) return -1;
    snprintf(s->dir, sizeof s->dir, "%s", d);
    snprintf(s->out, sizeof s->out, "%s/out", d);
    snprintf(s->err, sizeof s->err, "%s/err", d);
    if (t_sh(NULL, 0, "sh -c '%s serve --model %s --port 0 --threads 1 %s > %s/out 2> %s/err < /dev/null & "
                      "echo $! > %s/pid; wait $!; echo $? > %s/rc' > /dev/null 2>&1 < /dev/null &",
             t_bin(), model_dir, extra, d, d, d, d) != 0)
        return -1;
    for (int i = 0; i < 300; i++) { /* up to 30 s (ASan builds load slower) */
        char buf[512] = {0}, path[320];
        snprintf(path, sizeof path, "%s/pid", d);
        FILE *f = fopen(path, "r");
        if (f) {
            if (fscanf(f, "%d", &s->pid) != 1) s->pid = 0;
            fclose(f);
        }
        f = fopen(s->out, "r");
        if (f) {
            size_t n = fread(buf, 1, sizeof buf - 1, f);
            buf[n] = 0;
            fclose(f);
        }
        const char *p = strstr(buf, "127.0.0.1:");
        if (p && strstr(buf, "ready") && s->pid > 0) {
            s->port = atoi(p + 10);
            return 0;
        }
        snprintf(path, sizeof path, "%s/rc", d);
        if (access(path, F_OK) == 0) break; /* it exited */
        msleep(100);
    }
    char log[2048];
    t_sh(log, sizeof log, "cat %s %s", s->out, s->err);
    fprintf(stderr, "    server %s did not start:\n%s\n", tag, log);
    return -1;
}

static int servers(void) {
    if (started) return !start_failed;
    started = 1;
    start_failed = make_model() || start_server(&main_srv, "srv-main", "--api-key testkey --queue 8 --max-request-bytes 64K --name tiny-k3") ||
                   start_server(&slow_srv, "srv-slow", "--queue 1 --test-delay-ms 25");
    return !start_failed;
}

/* SIGTERM, then the exit status the shell recorded (-1: it did not exit). */
static void stop_server(server *s, int *status) {
    *status = -1;
    if (s->pid <= 0) return;
    kill(s->pid, SIGTERM);
    char path[320];
    snprintf(path, sizeof path, "%s/rc", s->dir);
    for (int i = 0; i < 200 && access(path, F_OK) != 0; i++) msleep(100); /* up to 20 s */
    msleep(50);
    FILE *f = fopen(path, "r");
    if (!f) {
        kill(s->pid, SIGKILL);
        s->pid = 0;
        return;
    }
    if (fscanf(f, "%d", status) != 1) *status = -1;
    fclose(f);
    s->pid = 0;
}

__attribute__((destructor)) static void server_cleanup(void) {
    if (main_srv.pid > 0) kill(main_srv.pid, SIGKILL);
    if (slow_srv.pid > 0) kill(slow_srv.pid, SIGKILL);
}

/* ---- 1. units ---------------------------------------------------------------------- */

TEST(server_1_stop_strings) {
    const char *stops[] = {"END", "xyz"};
    srv_stopper st = {.stop = stops, .n_stop = 2};
    srv_buf out = {0};
    CHECK(!srv_stop_feed(&st, "hello E", 7, &out));
    CHECK(out.n == 6 && !memcmp(out.p, "hello ", 6), "'E' may start END: held back");
    CHECK(!srv_stop_feed(&st, "Nx", 2, &out));
    CHECK(out.n == 8 && !memcmp(out.p, "hello EN", 8), "'EN' cannot become END any more; 'x' may start xyz");
    CHECK(!srv_stop_feed(&st, "q", 1, &out));
    CHECK(out.n == 10 && !memcmp(out.p, "hello ENxq", 10), "released once it cannot match");
    CHECK(srv_stop_feed(&st, "abxyzEND", 8, &out));
    CHECK(out.n == 12 && !memcmp(out.p + 10, "ab", 2), "cut before the first match");
    CHECK(srv_stop_feed(&st, "more", 4, &out) && out.n == 12, "nothing after a match");
    srv_stop_flush(&st, &out);
    CHECK(out.n == 12);
    srv_buf_free(&st.pending);
    srv_buf_free(&out);
    srv_stopper none = {0};
    srv_buf o2 = {0};
    CHECK(!srv_stop_feed(&none, "E", 1, &o2) && o2.n == 1, "no stop strings: passes through");
    srv_buf_free(&o2);
}

TEST(server_1_tool_call_conversion) {
    const char *call = "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"days\":2}}";
    json_t *o = srv_tool_call_openai(call, strlen(call), 1);
    REQUIRE(o);
    CHECK(json_integer_value(json_object_get(o, "index")) == 1);
    CHECK(!strcmp(json_string_value(json_object_get(o, "type")), "function"));
    CHECK(!strncmp(json_string_value(json_object_get(o, "id")), "call_", 5));
    json_t *fn = json_object_get(o, "function");
    CHECK(!strcmp(json_string_value(json_object_get(fn, "name")), "get_weather"));
    const char *args = json_string_value(json_object_get(fn, "arguments"));
    CHECK(args && !strcmp(args, "{\"city\":\"Paris\",\"days\":2}"), "arguments as a JSON string: %s", args ? args : "(null)");
    json_decref(o);
    /* raw (unparsable) arguments stay the string the model wrote */
    const char *raw = "{\"name\":\"f\",\"arguments\":\"not json\"}";
    o = srv_tool_call_openai(raw, strlen(raw), 0);
    CHECK(!strcmp(json_string_value(json_object_get(json_object_get(o, "function"), "arguments")), "not json"));
    json_decref(o);
    /* no arguments, or not JSON at all: "{}" (the empty object made for it
     * was leaked; fuzz_openai_request found it) */
    const char *bad[] = {"{\"name\":\"f\"}", "not json", ""};
    for (int i = 0; i < 3; i++) {
        o = srv_tool_call_openai(bad[i], strlen(bad[i]), 0);
        fn = json_object_get(o, "function");
        CHECK(o && !strcmp(json_string_value(json_object_get(fn, "arguments")), "{}"), "%s", bad[i]);
        json_decref(o);
    }
    /* invalid UTF-8 from a model becomes U+FFFD, never a NULL JSON string */
    json_t *t = srv_json_text("a\xff" "b", 3);
    CHECK(t && !strcmp(json_string_value(t), "a\xEF\xBF\xBD" "b"));
    json_decref(t);
}

/* the parser's tool calls, from a K3 rendering, converted as the server does */
static void collect(void *ud, int kind, const char *text, size_t n) {
    if (kind != DF_CHAT_TOOL_CALL) return;
    json_t *arr = ud;
    json_array_append_new(arr, srv_tool_call_openai(text, n, (int)json_array_size(arr)));
}

TEST(server_1_tool_calls_from_model_output) {
    json_t *calls = json_array();
    df_chat_parser *p = NULL;
    REQUIRE(df_chat_parser_new(0, collect, calls, &p) == DF_OK);
    const char *out = "Let me check.<|close|>response<|sep|><|open|>tools<|sep|>"
                      "<|open|>call tool=\"get_weather\" index=\"0\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris"
                      "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
    size_t n = strlen(out);
    for (size_t i = 0; i < n; i += 7) df_chat_parser_feed(p, out + i, n - i < 7 ? n - i : 7); /* streamed in pieces */
    df_chat_parser_finish(p);
    df_chat_parser_free(p);
    REQUIRE(json_array_size(calls) == 1, "%zu calls", json_array_size(calls));
    json_t *fn = json_object_get(json_array_get(calls, 0), "function");
    CHECK(!strcmp(json_string_value(json_object_get(fn, "name")), "get_weather"));
    CHECK(!strcmp(json_string_value(json_object_get(fn, "arguments")), "{\"city\":\"Paris\"}"));
    json_decref(calls);
}

TEST(server_1_request_validation) {
    if (!servers()) SKIP("no model directory");
    df_tokenizer *tok = NULL;
    char err[DF_ERRMSG];
    REQUIRE(df_tokenizer_load_dir(model_dir, &tok, err) == DF_OK, "%s", err);
    static const struct { const char *body; int kind, status; const char *param; } cases[] = {
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", SRV_CHAT, 200, NULL},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"hi\"}]}], \"stop\": [\"a\", \"b\"]}", SRV_CHAT, 200, NULL},
        {"{\"messages\": []}", SRV_CHAT, 400, "messages"},
        {"{\"model\": \"m\"}", SRV_CHAT, 400, "messages"},
        {"{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", SRV_CHAT, 400, "messages[0].role"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", SRV_CHAT, 400, "messages[0].content[0].type"},
        {"{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}", SRV_CHAT, 400, "messages[0].tool_call_id"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_logprobs\": 2}", SRV_CHAT, 400, "top_logprobs"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stop\": [\"a\",\"b\",\"c\",\"d\",\"e\"]}", SRV_CHAT, 400, "stop"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stream_options\": {\"include_usage\": true}}", SRV_CHAT, 400, "stream_options"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": 5000}", SRV_CHAT, 400, "max_tokens"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"presence_penalty\": 3}", SRV_CHAT, 400, "presence_penalty"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"seed\": 1.5}", SRV_CHAT, 400, "seed"},
        {"{\"prompt\": \"hi\", \"max_tokens\": 3}", SRV_COMPLETION, 200, NULL},
        {"{\"prompt\": [1, 2, 3]}", SRV_COMPLETION, 200, NULL},
        {"{\"prompt\": [1, 99999]}", SRV_COMPLETION, 400, "prompt"},
        {"{\"prompt\": \"hi\", \"suffix\": \"x\"}", SRV_COMPLETION, 400, "suffix"},
        {"{\"prompt\": \"hi\", \"best_of\": 3}", SRV_COMPLETION, 400, "best_of"},
        {"{\"prompt\": \"hi\", \"messages\": []}", SRV_COMPLETION, 400, "messages"},
        {"{\"max_tokens\": 3}", SRV_COMPLETION, 400, "prompt"},
        {"[1, 2]", SRV_CHAT, 400, NULL},
        {"{\"messages\": ", SRV_CHAT, 400, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        srv_err e;
        srv_job *j = srv_job_from_request(cases[i].kind, cases[i].body, strlen(cases[i].body), tok, 1280, 4096, 4096, "m", &e);
        int status = j ? 200 : e.status;
        CHECK(status == cases[i].status, "%s: status %d, want %d (%s)", cases[i].body, status, cases[i].status, e.msg);
        if (!j && cases[i].param) CHECK(!strcmp(e.param, cases[i].param), "%s: param '%s', want '%s'", cases[i].body, e.param, cases[i].param);
        srv_job_free(j);
    }
    /* the context limit: a prompt too long for the room left */
    srv_err e;
    const char *longp = "{\"prompt\": \"hello world\", \"max_tokens\": 20}";
    srv_job *j = srv_job_from_request(SRV_COMPLETION, longp, strlen(longp), tok, 1280, 4096, 10, "m", &e);
    CHECK(!j && e.status == 400 && e.code && !strcmp(e.code, "context_length_exceeded"), "%s", e.msg);
    srv_job_free(j);
    df_tokenizer_free(tok);
}

/* ---- 2. curl --------------------------------------------------------------------- */

/* Sends one request with curl: args are curl options then, last, the path
 * (after the last space). Returns the status, the body in body. */
static int http(char *body, size_t cap, const char *args) {
    char out[8192], opts[1024];
    const char *path = strrchr(args, ' ') ? strrchr(args, ' ') + 1 : args;
    snprintf(opts, sizeof opts, "%.*s", (int)(path - args), args);
    int rc = t_sh(out, sizeof out, "curl -s -S --max-time 20 -w '\\n%%{http_code}' %s http://127.0.0.1:%d%s", opts, main_srv.port, path);
    if (rc != 0) {
        snprintf(body, cap, "curl failed (%d): %.4000s", rc, out);
        return -1;
    }
    char *nl = strrchr(out, '\n');
    if (!nl) return -1;
    *nl = 0;
    snprintf(body, cap, "%s", out);
    return atoi(nl + 1);
}

static void check_error(const char *what, const char *args, int want, const char *param) {
    char body[8200];
    int st = http(body, sizeof body, args);
    CHECK(st == want, "%s: status %d, want %d: %s", what, st, want, body);
    json_t *j = json_loads(body, 0, NULL);
    json_t *e = json_object_get(j, "error");
    CHECK(json_is_string(json_object_get(e, "message")) && json_is_string(json_object_get(e, "type")) &&
              json_object_get(e, "param") && json_object_get(e, "code"),
          "%s: not an OpenAI error object: %s", what, body);
    if (param) CHECK(json_is_string(json_object_get(e, "param")) && !strcmp(json_string_value(json_object_get(e, "param")), param),
                     "%s: param %s, want %s", what, body, param);
    json_decref(j);
}

#define AUTH "-H 'Authorization: Bearer testkey' "
#define JSONH "-H 'Content-Type: application/json' "

TEST(server_2_curl_bad_requests) {
    if (!servers()) { CHECK(0, "the servers did not start"); return; }
    char out[256];
    if (t_sh(out, sizeof out, "command -v curl") != 0) SKIP("curl is not installed (scripts/install-deps.sh installs it)");
    check_error("malformed JSON", AUTH JSONH "-d '{\"model\": \"m\", \"messages\": [' /v1/chat/completions", 400, NULL);
    check_error("not an object", AUTH JSONH "-d '[1, 2, 3]' /v1/chat/completions", 400, NULL);
    check_error("messages of the wrong type", AUTH JSONH "-d '{\"messages\": \"hi\"}' /v1/chat/completions", 400, "messages");
    check_error("max_tokens of the wrong type", AUTH JSONH "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": \"5\"}' /v1/chat/completions", 400, "max_tokens");
    check_error("stream of the wrong type", AUTH JSONH "-d '{\"prompt\": \"x\", \"stream\": 1}' /v1/completions", 400, "stream");
    check_error("missing messages", AUTH JSONH "-d '{\"model\": \"m\"}' /v1/chat/completions", 400, "messages");
    check_error("unknown field", AUTH JSONH "-d '{\"model\": \"m\", \"prompt\": \"x\", \"wibble\": true}' /v1/completions", 400, "wibble");
    check_error("empty body", AUTH JSONH "-X POST /v1/completions", 400, NULL);
    /* bodies past --max-request-bytes 64K: with a Content-Length and chunked */
    const char *big = t_tmpdir("srv-big");
    REQUIRE(big);
    int rc = t_sh(out, sizeof out, "head -c 200000 /dev/zero | tr '\\0' 'a' | sed 's/^/{\"prompt\": \"/; s/$/\"}/' > %s/big.json", big);
    REQUIRE(rc == 0, "%s", out);
    char args[512];
    rc = t_sh(out, sizeof out, "printf '{\"prompt\": \"\\377\\376\"}' > %s/bad-utf8.json", big);
    REQUIRE(rc == 0, "%s", out);
    snprintf(args, sizeof args, AUTH JSONH "--data-binary @%s/bad-utf8.json /v1/completions", big);
    check_error("invalid UTF-8", args, 400, NULL);
    snprintf(args, sizeof args, AUTH JSONH "--data-binary @%s/big.json /v1/completions", big);
    check_error("huge body", args, 413, NULL);
    snprintf(args, sizeof args, AUTH JSONH "-H 'Transfer-Encoding: chunked' --data-binary @%s/big.json /v1/completions", big);
    check_error("huge chunked body", args, 413, NULL);
    check_error("unknown route", AUTH "/v1/nothing", 404, NULL);
    check_error("unknown route, POST", AUTH JSONH "-d '{}' /v2/chat/completions", 404, NULL);
    check_error("GET on a POST route", AUTH "/v1/chat/completions", 405, NULL);
    check_error("POST on a GET route", "-d '{}' /health", 405, NULL);
    check_error("DELETE on models", AUTH "-X DELETE /v1/models", 405, NULL);
    check_error("no API key", JSONH "-d '{\"prompt\": \"x\"}' /v1/completions", 401, NULL);
    check_error("wrong API key", "-H 'Authorization: Bearer nope' /v1/models", 401, NULL);
    check_error("unknown model id", AUTH "/v1/models/gpt-4", 404, "model");
    /* 405 says what is allowed */
    char body[8192];
    rc = t_sh(body, sizeof body, "curl -s -D - -o /dev/null http://127.0.0.1:%d/v1/completions", main_srv.port);
    REQUIRE(rc == 0, "%s", body);
    CHECK(strstr(body, "Allow: POST") != NULL, "%s", body);
    /* and the server keeps serving */
    CHECK(http(body, sizeof body, "/health") == 200 && strstr(body, "\"ok\""), "%s", body);
    int st = http(body, sizeof body, AUTH JSONH "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 3}' /v1/chat/completions");
    CHECK(st == 200 && strstr(body, "\"chat.completion\""), "%d %s", st, body);
    st = http(body, sizeof body, AUTH "/v1/models");
    CHECK(st == 200 && strstr(body, "tiny-k3") && strstr(body, "\"spine_dtype\":\"bf16\"") && strstr(body, "\"lossy\":\"\""),
          "%d %s", st, body);
    st = http(body, sizeof body, "/metrics");
    CHECK(st == 200 && strstr(body, "# TYPE deltafin_requests_total counter") && strstr(body, "code=\"413\""), "%d %s", st, body);
}

/* A lossy setting is named in every response's X-Deltafin-Lossy header, in
 * /v1/models and in /metrics (here --top-k; the int8 spine uses the same label). */
TEST(server_2_lossy_label) {
    if (!servers()) { CHECK(0, "the servers did not start"); return; }
    server lossy;
    REQUIRE(start_server(&lossy, "srv-lossy", "--top-k 1") == 0, "lossy server");
    char out[8192];
    int rc = t_sh(out, sizeof out, "curl -s -i -H 'Content-Type: application/json' -d '{\"prompt\": \"hi\", \"max_tokens\": 2}' "
                  "http://127.0.0.1:%d/v1/completions; curl -s http://127.0.0.1:%d/v1/models; curl -s http://127.0.0.1:%d/metrics",
                  lossy.port, lossy.port, lossy.port);
    CHECK(rc == 0 && strstr(out, "X-Deltafin-Lossy: LOSSY top-k 1 of 4"), "header: %.2000s", out);
    CHECK(strstr(out, "\"lossy\":\"LOSSY top-k 1 of 4\""), "/v1/models: %.2000s", out);
    CHECK(strstr(out, "deltafin_spine_info{dtype=\"bf16\",lossy=\"LOSSY top-k 1 of 4\"} 1"), "/metrics: %.3000s", out);
    int status;
    stop_server(&lossy, &status);
}

/* The trained tiny K3 (models/kimi-k3-tiny) behind the server: a chat
 * request answers in text, not noise (printable, with words and spaces). */
TEST(server_2_trained_model_answers_text) {
    if (access("models/kimi-k3-tiny/config.json", F_OK) != 0) SKIP("models/kimi-k3-tiny is missing");
    if (!servers()) { CHECK(0, "the servers did not start"); return; }
    char saved[256];
    snprintf(saved, sizeof saved, "%s", model_dir);
    snprintf(model_dir, sizeof model_dir, "models/kimi-k3-tiny");
    server tr;
    int started_ok = start_server(&tr, "srv-trained", "--spine-dtype bf16") == 0;
    snprintf(model_dir, sizeof model_dir, "%s", saved);
    REQUIRE(started_ok, "a server on the trained model");
    char out[16384];
    int rc = t_sh(out, sizeof out, "curl -s -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", "
                  "\"content\": \"How do I read a file line by line?\"}], \"max_tokens\": 80, \"temperature\": 0}' "
                  "http://127.0.0.1:%d/v1/chat/completions", tr.port);
    json_t *j = rc == 0 ? json_loads(out, 0, NULL) : NULL;
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    const char *content = json_string_value(json_object_get(msg, "content"));
    const char *reasoning = json_string_value(json_object_get(msg, "reasoning_content"));
    const char *text = content && *content ? content : reasoning ? reasoning : "";
    int letters = 0, spaces = 0, odd = 0;
    for (const unsigned char *c = (const unsigned char *)text; *c; c++) {
        letters += (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z');
        spaces += *c == ' ' || *c == '\n';
        odd += *c < 32 && *c != '\n' && *c != '\t';
    }
    CHECK(letters > 20 && spaces > 3 && odd == 0, "text, not noise: %.1000s", out);
    json_decref(j);
    int status;
    stop_server(&tr, &status);
}

/* ---- 3. node + openai -------------------------------------------------------------- */

TEST(server_3_openai_node_client) {
    char out[256];
    if (t_sh(out, sizeof out, "command -v node") != 0) SKIP("node is not installed (scripts/install-deps.sh installs nodejs)");
    if (t_sh(out, sizeof out, "test -f tests/server/node_modules/openai/package.json") != 0)
        SKIP("the openai npm package is missing: run `npm ci --prefix tests/server` (.ci/run does)");
    if (!servers()) { CHECK(0, "the servers did not start"); return; }
    static char log[1 << 18];
    int rc = t_sh(log, sizeof log,
                  "cd tests/server && DF_URL=http://127.0.0.1:%d DF_KEY=testkey DF_PID=%d DF_SLOW_URL=http://127.0.0.1:%d "
                  "DF_RSS_SLACK_MB=%d DF_MODEL_DIR=%s timeout 240 node --test --test-reporter=tap server.test.mjs",
                  main_srv.port, main_srv.pid, slow_srv.port, SRV_SAN ? 0 : 24, model_dir);
    const char *p = strstr(log, "\n# pass "), *f = strstr(log, "\n# fail ");
    int pass = p ? atoi(p + 8) : -1, fail = f ? atoi(f + 8) : -1;
    if (rc != 0 || fail != 0 || pass <= 0) {
        /* the failing tests' diagnostics */
        size_t n = strlen(log);
        fprintf(stderr, "\n%s\n", n > 12000 ? log + n - 12000 : log);
    }
    CHECK(rc == 0 && fail == 0 && pass >= 15, "node --test: rc %d, %d passed, %d failed", rc, pass, fail);
    const char *load = strstr(log, "# load:");
    if (load) {
        const char *e = strchr(load, '\n');
        fprintf(stderr, "[%.*s] ", e ? (int)(e - load - 2) : 80, load + 2);
    }
}

/* The kept-session pool: --retain sets its capacity, --retain-mem caps it
 * (never below --parallel); a bad --parallel is a usage error. */
TEST(server_2_retained_sessions_capacity) {
    if (!servers()) { CHECK(0, "the servers did not start"); return; }
    static const struct { const char *opts; int cap; } cases[] = {
        {"--parallel 2 --retain 6", 6}, {"--parallel 2 --retain 6 --retain-mem 1K", 2}, {"--parallel 3", 3}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        server x = {0};
        if (start_server(&x, "srv-retain", cases[i].opts) != 0) { CHECK(0, "%s: did not start", cases[i].opts); continue; }
        char out[65536];
        t_sh(out, sizeof out, "curl -s --max-time 20 http://127.0.0.1:%d/metrics", x.port);
        const char *c = strstr(out, "\ndeltafin_sessions_capacity "), *p = strstr(out, "\ndeltafin_parallel ");
        CHECK(c && atoi(c + 28) == cases[i].cap, "%s: capacity %s", cases[i].opts, c ? c + 1 : "missing");
        CHECK(p && atoi(p + 19) == (strstr(cases[i].opts, "--parallel 3") ? 3 : 2), "%s", cases[i].opts);
        int st;
        stop_server(&x, &st);
        CHECK(st == 0, "exit %d", st);
    }
    char out[512];
    int rc = t_sh(out, sizeof out, "%s serve --model %s --parallel 0 2>&1", t_bin(), model_dir);
    CHECK(rc == 2 && strstr(out, "--parallel"), "rc %d: %s", rc, out);
}

/* --parallel and --spec against a plain server, on the trained tiny K3
 * (its repetitive Python makes drafts pay): tests/server/parallel.test.mjs. */
TEST(server_3_parallel_openai_node_client) {
    char out[256];
    if (t_sh(out, sizeof out, "command -v node") != 0) SKIP("node is not installed (scripts/install-deps.sh installs nodejs)");
    if (t_sh(out, sizeof out, "test -f tests/server/node_modules/openai/package.json") != 0)
        SKIP("the openai npm package is missing: run `npm ci --prefix tests/server` (.ci/run does)");
    if (access("models/kimi-k3-tiny/config.json", F_OK) != 0) SKIP("models/kimi-k3-tiny is missing");
    char saved[sizeof model_dir];
    memcpy(saved, model_dir, sizeof saved);
    snprintf(model_dir, sizeof model_dir, "models/kimi-k3-tiny");
    server p = {0}, q = {0};
    int ok = start_server(&p, "srv-par", "--parallel 3 --spec ngram --spec-fixed --spec-depth 4 --retain 5") == 0 &&
             start_server(&q, "srv-solo", "") == 0;
    memcpy(model_dir, saved, sizeof saved);
    static char log[1 << 17];
    int rc = -1, pass = -1, fail = -1;
    if (ok) {
        rc = t_sh(log, sizeof log,
                  "cd tests/server && DF_PAR_URL=http://127.0.0.1:%d DF_SOLO_URL=http://127.0.0.1:%d "
                  "timeout 240 node --test --test-reporter=tap parallel.test.mjs",
                  p.port, q.port);
        const char *ps = strstr(log, "\n# pass "), *fs = strstr(log, "\n# fail ");
        pass = ps ? atoi(ps + 8) : -1;
        fail = fs ? atoi(fs + 8) : -1;
        if (rc != 0 || fail != 0 || pass <= 0) {
            size_t n = strlen(log);
            fprintf(stderr, "\n%s\n", n > 12000 ? log + n - 12000 : log);
        }
        const char *note = strstr(log, "# parallel:");
        if (note) {
            const char *e = strchr(note, '\n');
            fprintf(stderr, "[%.*s] ", e ? (int)(e - note - 2) : 80, note + 2);
        }
    }
    int st;
    stop_server(&p, &st);
    CHECK(!ok || st == 0, "the parallel server exited with %d", st);
    stop_server(&q, &st);
    CHECK(ok, "the servers did not start");
    CHECK(rc == 0 && fail == 0 && pass >= 2, "node --test: rc %d, %d passed, %d failed", rc, pass, fail);
}

/* ---- 4. shutdown ------------------------------------------------------------------- */

TEST(server_4_sigterm_exits_cleanly) {
    if (!started || start_failed) SKIP("the servers were not started");
    int st;
    stop_server(&main_srv, &st);
    CHECK(st == 0, "main server: exit status %d", st);
    stop_server(&slow_srv, &st);
    CHECK(st == 0, "slow server: exit status %d", st);
    char log[4096];
    t_sh(log, sizeof log, "tail -n 3 %s", main_srv.err);
    CHECK(strstr(log, "SIGTERM, stopping") != NULL, "%s", log);
}
