/* api.c — OpenAI request and response JSON for the server (prefix srv_).
 *
 * Owns: srv_buf (the byte buffer every server file uses: the bottom of the
 * server's call graph, so http.c and gen.c call into this file and it calls
 * neither), turning a /v1/chat/completions or /v1/completions body into a
 * srv_job (every field either honoured, accepted as having no effect on the
 * output (user, metadata, store, service_tier, prompt_cache_key,
 * safety_identifier), or refused with a 400 that names it, as OpenAI names
 * an unrecognised argument), and turning the generator's events into
 * OpenAI's JSON: stream chunks (chat's role delta or completions' echoed
 * prompt first, content / reasoning_content / tool_calls deltas,
 * finish_reason, the usage chunk, [DONE]) and whole responses.
 * Refuses: n or best_of other than 1, tool_choice "required" or a named
 * function (the sampler cannot force a call), response_format other than
 * text, completions' suffix, images and audio in messages.
 *
 * Sections: 1. buffers and JSON helpers  2. field checks  3. chat requests
 *           4. completion requests  5. jobs  6. output events  7. responses
 */
#include "server.h"
#include "../base/port.h"
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- 1. buffers and JSON helpers ------------------------------------------------------ */

int srv_buf_add(srv_buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

void srv_buf_free(srv_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* length of a valid UTF-8 sequence at s (max n bytes), 0 if invalid */
static size_t utf8_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t k;
    unsigned min;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) { k = 2; min = 0x80; }
    else if (c >= 0xE0 && c <= 0xEF) { k = 3; min = 0x800; }
    else if (c >= 0xF0 && c <= 0xF4) { k = 4; min = 0x10000; }
    else return 0;
    if (k > n) return 0;
    unsigned cp = c & (0x7F >> k);
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return k;
}

json_t *srv_json_text(const char *s, size_t n) {
    json_t *v = json_stringn(s, n);
    if (v) return v;
    srv_buf b = {0};
    for (size_t i = 0; i < n;) {
        size_t k = utf8_len((const unsigned char *)s + i, n - i);
        if (k) { srv_buf_add(&b, s + i, k); i += k; }
        else { srv_buf_add(&b, "\xEF\xBF\xBD", 3); i++; }
    }
    v = json_stringn(b.p ? b.p : "", b.n);
    srv_buf_free(&b);
    return v;
}

char *srv_error_json(const char *msg, const char *type, const char *param, const char *code) {
    json_t *e = json_object();
    json_object_set_new(e, "message", srv_json_text(msg, strlen(msg)));
    json_object_set_new(e, "type", json_string(type ? type : "invalid_request_error"));
    json_object_set_new(e, "param", param && *param ? json_string(param) : json_null());
    json_object_set_new(e, "code", code ? json_string(code) : json_null());
    json_t *root = json_pack("{s:o}", "error", e);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

static void rand_id(char *out, size_t cap, const char *prefix) {
    static const char al[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    unsigned char r[24];
    if (port_random(r, sizeof r) != 0) {
        uint64_t x = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)out;
        for (size_t i = 0; i < sizeof r; i++) { x = x * 6364136223846793005ULL + 1442695040888963407ULL; r[i] = (unsigned char)(x >> 56); }
    }
    size_t w = (size_t)snprintf(out, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof r && w + 1 < cap; i++) out[w++] = al[r[i] % (sizeof al - 1)];
    out[w < cap ? w : cap - 1] = 0;
}

/* ---- 2. field checks ----------------------------------------------------------------- */

static int bad(srv_err *e, const char *param, const char *code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int bad(srv_err *e, const char *param, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    e->status = 400;
    e->code = code;
    return -1;
}

/* number in [lo, hi]; absent or null leaves *out */
static int get_num(json_t *root, const char *key, double lo, double hi, double *out, srv_err *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return bad(e, key, "invalid_type", "Invalid type for '%s': expected a number.", key);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi))
        return bad(e, key, "invalid_value", "Invalid value for '%s': %g is not in [%g, %g].", key, x, lo, hi);
    *out = x;
    return 0;
}

static int get_int(json_t *root, const char *key, long long lo, long long hi, long long *out, srv_err *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v)) return bad(e, key, "invalid_type", "Invalid type for '%s': expected an integer.", key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return bad(e, key, "invalid_value", "Invalid value for '%s': %lld is not in [%lld, %lld].", key, x, lo, hi);
    *out = x;
    return 0;
}

static int get_bool(json_t *root, const char *key, int *out, srv_err *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return bad(e, key, "invalid_type", "Invalid type for '%s': expected a boolean.", key);
    *out = json_is_true(v);
    return 0;
}

/* Every key of root must be in `known` (NULL-terminated). */
static int check_keys(json_t *root, const char *const *known, srv_err *e) {
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++) ok = !strcmp(key, known[i]);
        if (!ok) return bad(e, key, "unknown_parameter", "Unrecognized request argument supplied: %s", key);
    }
    return 0;
}

/* The fields both endpoints share: sampling, stop, logit bias, seed, n, stream. */
static int common_fields(json_t *root, srv_job *j, int vocab, srv_err *e) {
    double x;
    long long k;
    x = 1.0;
    if (get_num(root, "temperature", 0, 2, &x, e)) return -1;
    j->sp.temperature = (float)x;
    x = 1.0;
    if (get_num(root, "top_p", 0, 1, &x, e)) return -1;
    j->sp.top_p = (float)x;
    if (json_is_number(json_object_get(root, "top_p")) && x <= 0) return bad(e, "top_p", "invalid_value", "Invalid value for 'top_p': must be > 0.");
    k = 0;
    if (get_int(root, "top_k", -1, 1 << 24, &k, e)) return -1;
    j->sp.top_k = k < 0 ? 0 : (int)k;
    x = 0;
    if (get_num(root, "min_p", 0, 1, &x, e)) return -1;
    j->sp.min_p = (float)x;
    x = 1;
    if (get_num(root, "repetition_penalty", 0.01, 100, &x, e)) return -1;
    j->sp.repetition_penalty = (float)x;
    x = 0;
    if (get_num(root, "presence_penalty", -2, 2, &x, e)) return -1;
    j->sp.presence_penalty = (float)x;
    x = 0;
    if (get_num(root, "frequency_penalty", -2, 2, &x, e)) return -1;
    j->sp.frequency_penalty = (float)x;
    j->sp.penalty_last_n = -1; /* OpenAI's penalties count every generated token */
    json_t *seed = json_object_get(root, "seed");
    if (seed && !json_is_null(seed)) {
        if (!json_is_integer(seed)) return bad(e, "seed", "invalid_type", "Invalid type for 'seed': expected an integer.");
        j->sp.seed = (uint64_t)json_integer_value(seed);
        j->seeded = 1;
    } else {
        uint64_t r;
        if (port_random(&r, sizeof r) != 0) r = (uint64_t)time(NULL) * 2654435761ULL;
        j->sp.seed = r;
    }
    k = 1;
    if (get_int(root, "n", 1, 128, &k, e)) return -1;
    if (k != 1) return bad(e, "n", "unsupported_value", "Unsupported value for 'n': this server generates one choice (n = 1).");
    if (get_bool(root, "stream", &j->stream, e)) return -1;
    if (get_bool(root, "ignore_eos", &j->ignore_eos, e)) return -1;
    json_t *so = json_object_get(root, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) return bad(e, "stream_options", "invalid_type", "Invalid type for 'stream_options': expected an object.");
        if (!j->stream) return bad(e, "stream_options", "invalid_value", "'stream_options' is only allowed when 'stream' is true.");
        static const char *const sok[] = {"include_usage", "include_obfuscation", NULL};
        if (check_keys(so, sok, e)) {
            char kk[96];
            snprintf(kk, sizeof kk, "%.80s", e->param);
            snprintf(e->param, sizeof e->param, "stream_options.%s", kk);
            return -1;
        }
        if (get_bool(so, "include_usage", &j->include_usage, e)) { snprintf(e->param, sizeof e->param, "stream_options.include_usage"); return -1; }
    }
    json_t *stop = json_object_get(root, "stop");
    if (stop && !json_is_null(stop)) {
        if (json_is_string(stop)) {
            if (json_string_length(stop)) j->stop[j->n_stop++] = strdup(json_string_value(stop));
        } else if (json_is_array(stop)) {
            if (json_array_size(stop) > SRV_MAX_STOP) return bad(e, "stop", "invalid_value", "Invalid value for 'stop': at most %d sequences.", SRV_MAX_STOP);
            size_t i;
            json_t *v;
            json_array_foreach(stop, i, v) {
                if (!json_is_string(v)) return bad(e, "stop", "invalid_type", "Invalid type for 'stop[%zu]': expected a string.", i);
                if (json_string_length(v)) j->stop[j->n_stop++] = strdup(json_string_value(v));
            }
        } else return bad(e, "stop", "invalid_type", "Invalid type for 'stop': expected a string or an array of strings.");
    }
    json_t *lb = json_object_get(root, "logit_bias");
    if (lb && !json_is_null(lb)) {
        if (!json_is_object(lb)) return bad(e, "logit_bias", "invalid_type", "Invalid type for 'logit_bias': expected an object of token id -> bias.");
        size_t n = json_object_size(lb);
        j->bias_id = calloc(n ? n : 1, sizeof *j->bias_id);
        j->bias = calloc(n ? n : 1, sizeof *j->bias);
        if (!j->bias_id || !j->bias) { e->status = 500; snprintf(e->msg, sizeof e->msg, "out of memory"); return -1; }
        const char *key;
        json_t *v;
        json_object_foreach(lb, key, v) {
            char *end;
            errno = 0;
            long id = strtol(key, &end, 10);
            if (errno || end == key || *end || id < 0 || id >= vocab)
                return bad(e, "logit_bias", "invalid_value", "Invalid key in 'logit_bias': '%s' is not a token id in [0, %d).", key, vocab);
            if (!json_is_number(v) || json_number_value(v) < -100 || json_number_value(v) > 100)
                return bad(e, "logit_bias", "invalid_value", "Invalid value in 'logit_bias' for token %ld: expected a number in [-100, 100].", id);
            double b = json_number_value(v);
            j->bias_id[j->n_bias] = (int32_t)id;
            j->bias[j->n_bias++] = b <= -100 ? -INFINITY : (float)b; /* -100 bans, as OpenAI documents */
        }
    }
    return 0;
}

/* max_tokens / max_completion_tokens against the ceiling and the context */
static int token_budget(json_t *root, srv_job *j, int ceiling, int ctx, int dflt, srv_err *e) {
    long long mt = 0, mct = 0;
    if (get_int(root, "max_tokens", 1, 1LL << 31, &mt, e)) return -1;
    if (get_int(root, "max_completion_tokens", 1, 1LL << 31, &mct, e)) return -1;
    const char *which = mct ? "max_completion_tokens" : "max_tokens";
    long long want = mct ? mct : mt;
    if (want > ceiling)
        return bad(e, which, "invalid_value", "Invalid value for '%s': %lld is above this server's ceiling of %d tokens.", which, want, ceiling);
    int room = ctx - j->prompt.n;
    if (room <= 0 || (want && want > room))
        return bad(e, j->kind == SRV_CHAT ? "messages" : "prompt", "context_length_exceeded",
                   "This model's maximum context length is %d tokens. However, you requested %lld tokens (%d in the %s, %lld in the completion). Please reduce the length of the %s or completion.",
                   ctx, j->prompt.n + (want ? want : 1), j->prompt.n, j->kind == SRV_CHAT ? "messages" : "prompt", want ? want : 1,
                   j->kind == SRV_CHAT ? "messages" : "prompt");
    if (!want) want = dflt > 0 && dflt < room ? dflt : room;
    if (want > ceiling) want = ceiling;
    j->max_tokens = (int)want;
    return 0;
}

/* ---- 3. chat requests ----------------------------------------------------------------- */

/* content: a string, null, or an array of {"type": "text", "text"} parts */
static int content_text(json_t *c, const char *where, char **out, srv_err *e) {
    *out = NULL;
    if (!c || json_is_null(c)) return 0;
    if (json_is_string(c)) { *out = strdup(json_string_value(c)); return 0; }
    if (!json_is_array(c)) return bad(e, where, "invalid_type", "Invalid type for '%s': expected a string or an array of content parts.", where);
    srv_buf b = {0};
    size_t i;
    json_t *part;
    json_array_foreach(c, i, part) {
        const char *type = json_string_value(json_object_get(part, "type"));
        const char *text = json_string_value(json_object_get(part, "text"));
        if (!type || strcmp(type, "text") || !text) {
            srv_buf_free(&b);
            char p[96];
            snprintf(p, sizeof p, "%s[%zu].type", where, i);
            return bad(e, p, "unsupported_value", "Unsupported content part '%s' in %s[%zu]: this server reads text parts only.",
                       type ? type : "(none)", where, i);
        }
        srv_buf_add(&b, text, strlen(text));
    }
    *out = b.p ? b.p : strdup("");
    return 0;
}

typedef struct {
    df_chat_msg *m;
    char **owned;        /* strings to free */
    int n, n_owned;
} msg_list;

static void msgs_free(msg_list *l) {
    for (int i = 0; i < l->n_owned; i++) free(l->owned[i]);
    free(l->owned);
    free(l->m);
}

static const char *own(msg_list *l, char *s) {
    if (s) l->owned[l->n_owned++] = s;
    return s;
}

static int parse_messages(json_t *arr, msg_list *l, srv_err *e) {
    if (!arr) return bad(e, "messages", "missing_required_parameter", "Missing required parameter: 'messages'.");
    if (!json_is_array(arr)) return bad(e, "messages", "invalid_type", "Invalid type for 'messages': expected an array of message objects.");
    size_t n = json_array_size(arr);
    if (!n) return bad(e, "messages", "invalid_value", "Invalid 'messages': empty array. Expected an array with minimum length 1.");
    l->m = calloc(n, sizeof *l->m);
    l->owned = calloc(n * 6, sizeof *l->owned);
    if (!l->m || !l->owned) { e->status = 500; snprintf(e->msg, sizeof e->msg, "out of memory"); return -1; }
    l->n = (int)n;
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(arr, i);
        char where[64];
        if (!json_is_object(m)) {
            snprintf(where, sizeof where, "messages[%zu]", i);
            return bad(e, where, "invalid_type", "Invalid type for '%s': expected an object.", where);
        }
        const char *role = json_string_value(json_object_get(m, "role"));
        snprintf(where, sizeof where, "messages[%zu].role", i);
        if (!role) return bad(e, where, "invalid_value", "Invalid value for '%s': expected one of system, developer, user, assistant, tool.", where);
        if (!strcmp(role, "developer")) role = "system";
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "tool"))
            return bad(e, where, "invalid_value", "Invalid value for '%s': '%s' (expected system, developer, user, assistant or tool).", where, role);
        df_chat_msg *o = &l->m[i];
        o->role = role;
        char *txt;
        snprintf(where, sizeof where, "messages[%zu].content", i);
        if (content_text(json_object_get(m, "content"), where, &txt, e)) return -1;
        o->content = own(l, txt);
        json_t *nm = json_object_get(m, "name");
        if (nm && !json_is_null(nm)) {
            snprintf(where, sizeof where, "messages[%zu].name", i);
            if (!json_is_string(nm)) return bad(e, where, "invalid_type", "Invalid type for '%s': expected a string.", where);
            o->name = own(l, strdup(json_string_value(nm)));
        }
        json_t *rc = json_object_get(m, "reasoning_content");
        if (json_is_string(rc) && !strcmp(role, "assistant")) o->reasoning = own(l, strdup(json_string_value(rc)));
        json_t *tc = json_object_get(m, "tool_calls");
        if (tc && !json_is_null(tc)) {
            snprintf(where, sizeof where, "messages[%zu].tool_calls", i);
            if (!json_is_array(tc) || strcmp(role, "assistant"))
                return bad(e, where, "invalid_value", "Invalid '%s': expected an array on an assistant message.", where);
            size_t k;
            json_t *call;
            json_array_foreach(tc, k, call) {
                json_t *fn = json_object_get(call, "function");
                if (!json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
                    return bad(e, where, "invalid_value", "Invalid '%s[%zu]': expected {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}.", where, k);
            }
            o->tool_calls = own(l, json_dumps(tc, JSON_COMPACT));
        }
        json_t *tid = json_object_get(m, "tool_call_id");
        if (!strcmp(role, "tool")) {
            snprintf(where, sizeof where, "messages[%zu].tool_call_id", i);
            if (!json_is_string(tid)) return bad(e, where, "missing_required_parameter", "Missing required parameter: '%s'.", where);
            o->tool_call_id = own(l, strdup(json_string_value(tid)));
        }
    }
    return 0;
}

static const char *const chat_keys[] = {
    "model", "messages", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "seed", "stop", "max_tokens", "max_completion_tokens", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "reasoning_effort", "n", "tools",
    "tool_choice", "parallel_tool_calls", "user", "metadata", "store", "service_tier", "prompt_cache_key",
    "safety_identifier", "response_format", "ignore_eos", NULL};

static int chat_request(json_t *root, srv_job *j, const df_tokenizer *tok, int vocab, int ceiling, int ctx, srv_err *e) {
    if (check_keys(root, chat_keys, e)) return -1;
    if (common_fields(root, j, vocab, e)) return -1;
    if (get_bool(root, "logprobs", &j->logprobs, e)) return -1;
    long long tl = 0;
    if (get_int(root, "top_logprobs", 0, 20, &tl, e)) return -1;
    if (tl && !j->logprobs) return bad(e, "top_logprobs", "invalid_value", "'top_logprobs' requires 'logprobs' to be true.");
    j->sp.n_logprobs = (int)tl;
    json_t *rf = json_object_get(root, "response_format");
    if (rf && !json_is_null(rf)) {
        const char *t = json_string_value(json_object_get(rf, "type"));
        if (!t || strcmp(t, "text"))
            return bad(e, "response_format", "unsupported_value", "Unsupported value for 'response_format': only {\"type\": \"text\"} (this server cannot constrain output to JSON).");
    }
    df_chat_opts co;
    df_chat_opts_default(&co);
    json_t *re = json_object_get(root, "reasoning_effort");
    if (re && !json_is_null(re)) {
        const char *r = json_string_value(re);
        if (!r) return bad(e, "reasoning_effort", "invalid_type", "Invalid type for 'reasoning_effort': expected a string.");
        if (!strcmp(r, "none")) co.thinking = 0;
        else if (!strcmp(r, "minimal") || !strcmp(r, "low")) co.reasoning_effort = "low";
        else if (!strcmp(r, "medium") || !strcmp(r, "high") || !strcmp(r, "max")) co.reasoning_effort = r;
        else if (!strcmp(r, "xhigh")) co.reasoning_effort = "max";
        else return bad(e, "reasoning_effort", "invalid_value", "Invalid value for 'reasoning_effort': '%s' (none, minimal, low, medium, high, xhigh, max).", r);
    }
    j->parallel_tool_calls = 1;
    if (get_bool(root, "parallel_tool_calls", &j->parallel_tool_calls, e)) return -1;
    char *tools_js = NULL;
    json_t *tools = json_object_get(root, "tools");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools)) return bad(e, "tools", "invalid_type", "Invalid type for 'tools': expected an array.");
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            const char *ty = json_string_value(json_object_get(t, "type"));
            json_t *fn = json_object_get(t, "function");
            if (!ty || strcmp(ty, "function") || !json_is_string(json_object_get(fn, "name"))) {
                char p[48];
                snprintf(p, sizeof p, "tools[%zu]", i);
                return bad(e, p, "invalid_value", "Invalid '%s': expected {\"type\": \"function\", \"function\": {\"name\", ...}}.", p);
            }
        }
        if (json_array_size(tools)) tools_js = json_dumps(tools, JSON_COMPACT);
    }
    json_t *tc = json_object_get(root, "tool_choice");
    if (tc && !json_is_null(tc)) {
        const char *c = json_string_value(tc);
        if (c && !strcmp(c, "none")) { free(tools_js); tools_js = NULL; } /* the model is not told about tools */
        else if (!c || strcmp(c, "auto")) {
            free(tools_js);
            return bad(e, "tool_choice", "unsupported_value", "Unsupported value for 'tool_choice': only \"auto\" and \"none\" (this server cannot force a tool call).");
        }
    }
    msg_list l = {0};
    if (parse_messages(json_object_get(root, "messages"), &l, e)) { msgs_free(&l); free(tools_js); return -1; }
    co.tools = tools_js;
    j->tools = tools_js != NULL;
    j->thinking = co.thinking;
    char err[DF_ERRMSG];
    df_status st = df_chat_render(tok, l.m, l.n, &co, &j->prompt, NULL, err);
    msgs_free(&l);
    free(tools_js);
    if (st != DF_OK) {
        if (st == DF_ERR_ARG) return bad(e, "messages", "invalid_value", "%s", err);
        e->status = 500;
        snprintf(e->msg, sizeof e->msg, "%s", err);
        return -1;
    }
    return token_budget(root, j, ceiling, ctx, 0, e);
}

/* ---- 4. completion requests ---------------------------------------------------------- */

static const char *const cmp_keys[] = {
    "model", "prompt", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "seed", "stop", "max_tokens", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "echo", "n", "best_of", "suffix", "user", "ignore_eos", NULL};

static int completion_request(json_t *root, srv_job *j, const df_tokenizer *tok, int vocab, int ceiling, int ctx, srv_err *e) {
    if (check_keys(root, cmp_keys, e)) return -1;
    if (common_fields(root, j, vocab, e)) return -1;
    long long lp = -1;
    json_t *lpv = json_object_get(root, "logprobs");
    if (json_is_boolean(lpv)) return bad(e, "logprobs", "invalid_type", "Invalid type for 'logprobs': expected an integer (0-20) on /v1/completions.");
    if (get_int(root, "logprobs", 0, 20, &lp, e)) return -1;
    if (lp >= 0) { j->logprobs = 1; j->sp.n_logprobs = (int)lp; }
    long long bo = 1;
    if (get_int(root, "best_of", 1, 128, &bo, e)) return -1;
    if (bo != 1) return bad(e, "best_of", "unsupported_value", "Unsupported value for 'best_of': this server generates one candidate.");
    json_t *suf = json_object_get(root, "suffix");
    if (suf && !json_is_null(suf) && !(json_is_string(suf) && !json_string_length(suf)))
        return bad(e, "suffix", "unsupported_value", "Unsupported parameter 'suffix': this model has no fill-in-the-middle mode.");
    if (get_bool(root, "echo", &j->echo, e)) return -1;
    json_t *p = json_object_get(root, "prompt");
    if (!p || json_is_null(p)) return bad(e, "prompt", "missing_required_parameter", "Missing required parameter: 'prompt'.");
    /* a one-element list is the same as its element */
    if (json_is_array(p) && json_array_size(p) == 1 && (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0);
    char err[DF_ERRMSG];
    if (json_is_string(p)) {
        if (!json_string_length(p)) return bad(e, "prompt", "invalid_value", "Invalid 'prompt': empty string.");
        j->prompt_text = strdup(json_string_value(p));
        if (df_tokenize(tok, json_string_value(p), json_string_length(p), 0, &j->prompt, err) != DF_OK)
            return bad(e, "prompt", "invalid_value", "%s", err);
    } else if (json_is_array(p) && json_array_size(p)) {
        size_t i;
        json_t *v;
        json_array_foreach(p, i, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= vocab) {
                if (json_is_string(v)) return bad(e, "prompt", "unsupported_value", "Unsupported value for 'prompt': one prompt per request (n = 1).");
                return bad(e, "prompt", "invalid_value", "Invalid 'prompt[%zu]': expected a token id in [0, %d).", i, vocab);
            }
            df_tokens_push(&j->prompt, (int32_t)json_integer_value(v));
        }
        if (j->echo) {
            size_t n;
            if (df_detokenize(tok, j->prompt.ids, j->prompt.n, 1, &j->prompt_text, &n, err) != DF_OK)
                return bad(e, "prompt", "invalid_value", "%s", err);
        }
    } else return bad(e, "prompt", "invalid_type", "Invalid type for 'prompt': expected a string or an array of token ids.");
    return token_budget(root, j, ceiling, ctx, 16, e); /* OpenAI's default max_tokens for completions */
}

/* ---- 5. jobs ---------------------------------------------------------------------------- */

srv_job *srv_job_from_request(int kind, const char *body, size_t n, const df_tokenizer *tok, int vocab,
                              int ceiling, int ctx, const char *model_name, srv_err *e) {
    memset(e, 0, sizeof *e);
    json_error_t je;
    json_t *root = json_loadb(body, n, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        bad(e, NULL, NULL, "We could not parse the JSON body of your request: %s (line %d, column %d).", je.text, je.line, je.column);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        bad(e, NULL, NULL, "The request body must be a JSON object.");
        return NULL;
    }
    srv_job *j = calloc(1, sizeof *j);
    if (!j) { json_decref(root); e->status = 500; snprintf(e->msg, sizeof e->msg, "out of memory"); return NULL; }
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1;
    j->fd = -1;
    j->kind = kind;
    j->http_status = 200;
    df_sampler_params_default(&j->sp);
    j->created = (long long)time(NULL);
    rand_id(j->id, sizeof j->id, kind == SRV_CHAT ? "chatcmpl-" : "cmpl-");
    j->model = strdup(model_name);
    json_t *model = json_object_get(root, "model");
    int rc;
    if (model && !json_is_string(model)) rc = bad(e, "model", "invalid_type", "Invalid type for 'model': expected a string.");
    else rc = kind == SRV_CHAT ? chat_request(root, j, tok, vocab, ceiling, ctx, e)
                               : completion_request(root, j, tok, vocab, ceiling, ctx, e);
    json_decref(root);
    if (rc) { srv_job_free(j); return NULL; }
    return j;
}

void srv_job_free(srv_job *j) {
    if (!j) return;
    df_tokens_free(&j->prompt);
    free(j->bias_id);
    free(j->bias);
    for (int i = 0; i < j->n_stop; i++) free(j->stop[i]);
    free(j->prompt_text);
    free(j->model);
    pthread_cond_destroy(&j->cv);
    srv_buf_free(&j->sse);
    srv_buf_free(&j->content);
    srv_buf_free(&j->reasoning);
    json_decref(j->tool_calls);
    json_decref(j->lp_content);
    json_decref(j->lp_pending);
    json_decref(j->cmp_lp);
    free(j);
}

/* ---- 6. output events ------------------------------------------------------------------- */

static void sse_send(srv_job *j, json_t *obj) {
    char *s = json_dumps(obj, JSON_COMPACT);
    json_decref(obj);
    if (!s) return;
    srv_buf_add(&j->sse, "data: ", 6);
    srv_buf_add(&j->sse, s, strlen(s));
    srv_buf_add(&j->sse, "\n\n", 2);
    free(s);
    pthread_cond_broadcast(&j->cv); /* the connection thread waits for bytes */
}

static json_t *usage_json(const srv_job *j) {
    return json_pack("{s:i, s:i, s:i, s:{s:i}, s:{s:i}}", "prompt_tokens", j->prompt_tokens, "completion_tokens",
                     j->completion_tokens, "total_tokens", j->prompt_tokens + j->completion_tokens,
                     "prompt_tokens_details", "cached_tokens", j->cached_tokens, "completion_tokens_details",
                     "reasoning_tokens", j->reasoning_tokens);
}

/* logprobs of tokens not yet sent (stream), or null */
static json_t *take_logprobs(srv_job *j) {
    if (!j->logprobs) return json_null();
    if (j->kind == SRV_CHAT) {
        json_t *c = j->lp_pending ? j->lp_pending : json_array();
        j->lp_pending = NULL;
        return json_pack("{s:o, s:n}", "content", c, "refusal");
    }
    json_t *o = j->cmp_lp;
    j->cmp_lp = NULL;
    return o ? o : json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

static json_t *chunk(srv_job *j, json_t *choice) {
    json_t *c = json_pack("{s:s, s:s, s:I, s:s, s:s, s:[o]}", "id", j->id, "object",
                          j->kind == SRV_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                          (json_int_t)j->created, "model", j->model, "system_fingerprint", "deltafin", "choices", choice);
    if (j->include_usage) json_object_set_new(c, "usage", json_null());
    return c;
}

/* A stream's first chunk, before any output: chat's role delta; with echo,
 * completions' prompt text (as the whole response's text starts with it). */
static void send_first(srv_job *j) {
    if (j->sent_first) return;
    j->sent_first = 1;
    json_t *choice;
    if (j->kind == SRV_CHAT) {
        choice = json_pack("{s:i, s:{s:s, s:s, s:n}, s:n, s:n}", "index", 0, "delta", "role", "assistant", "content", "",
                           "refusal", "logprobs", "finish_reason");
    } else if (j->echo && j->prompt_text && *j->prompt_text) {
        json_t *lp = j->logprobs ? json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset")
                                 : json_null();
        choice = json_pack("{s:o, s:i, s:o, s:n}", "text", srv_json_text(j->prompt_text, strlen(j->prompt_text)), "index", 0,
                           "logprobs", lp, "finish_reason");
    } else {
        return;
    }
    sse_send(j, chunk(j, choice));
}

void srv_out_text(srv_job *j, int kind, const char *text, size_t n) {
    srv_buf_add(kind == DF_CHAT_REASONING ? &j->reasoning : &j->content, text, n);
    if (!j->stream) return;
    json_t *choice;
    send_first(j);
    if (j->kind == SRV_CHAT) {
        json_t *delta = json_object();
        json_object_set_new(delta, kind == DF_CHAT_REASONING ? "reasoning_content" : "content", srv_json_text(text, n));
        choice = json_pack("{s:i, s:o, s:o, s:n}", "index", 0, "delta", delta, "logprobs", take_logprobs(j), "finish_reason");
    } else {
        choice = json_pack("{s:o, s:i, s:o, s:n}", "text", srv_json_text(text, n), "index", 0, "logprobs", take_logprobs(j),
                           "finish_reason");
    }
    sse_send(j, chunk(j, choice));
}

json_t *srv_tool_call_openai(const char *call_json, size_t n, int index) {
    json_t *c = json_loadb(call_json, n, 0, NULL);
    const char *name = json_string_value(json_object_get(c, "name"));
    json_t *a = json_object_get(c, "arguments");
    char *args = json_is_string(a) ? strdup(json_string_value(a)) : a ? json_dumps(a, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    char id[40];
    rand_id(id, sizeof id, "call_");
    json_t *o = json_pack("{s:i, s:s, s:s, s:{s:s, s:s}}", "index", index, "id", id, "type", "function", "function", "name",
                          name ? name : "", "arguments", args ? args : "{}");
    free(args);
    json_decref(c);
    return o;
}

void srv_out_tool_call(srv_job *j, const char *call_json, size_t n) {
    if (!j->tool_calls) j->tool_calls = json_array();
    json_t *call = srv_tool_call_openai(call_json, n, (int)json_array_size(j->tool_calls));
    if (!call) return;
    json_array_append(j->tool_calls, call);
    if (j->stream) {
        send_first(j);
        json_t *choice = json_pack("{s:i, s:{s:[O]}, s:o, s:n}", "index", 0, "delta", "tool_calls", call, "logprobs",
                                   take_logprobs(j), "finish_reason");
        sse_send(j, chunk(j, choice));
    }
    json_decref(call);
}

static json_t *bytes_of(const char *b, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer((unsigned char)b[i]));
    return a;
}

void srv_out_logprob(srv_job *j, const df_tokenizer *t, const df_sample *s) {
    size_t n;
    const char *b = df_token_bytes(t, s->token, &n);
    if (!b) { b = ""; n = 0; }
    if (j->kind == SRV_CHAT) {
        json_t *top = json_array();
        for (int k = 0; k < s->n_top; k++) {
            size_t tn;
            const char *tb = df_token_bytes(t, s->top_id[k], &tn);
            if (!tb) { tb = ""; tn = 0; }
            json_array_append_new(top, json_pack("{s:o, s:f, s:o}", "token", srv_json_text(tb, tn), "logprob",
                                                 (double)s->top_logprob[k], "bytes", bytes_of(tb, tn)));
        }
        json_t *e = json_pack("{s:o, s:f, s:o, s:o}", "token", srv_json_text(b, n), "logprob", (double)s->logprob,
                              "bytes", bytes_of(b, n), "top_logprobs", top);
        if (!j->lp_content) j->lp_content = json_array();
        json_array_append(j->lp_content, e);
        if (j->stream) {
            if (!j->lp_pending) j->lp_pending = json_array();
            json_array_append(j->lp_pending, e);
        }
        json_decref(e);
        return;
    }
    if (!j->cmp_lp)
        j->cmp_lp = json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
    json_t *top = json_object();
    for (int k = 0; k < s->n_top; k++) {
        size_t tn;
        const char *tb = df_token_bytes(t, s->top_id[k], &tn);
        json_t *key = srv_json_text(tb ? tb : "", tb ? tn : 0);
        json_object_set_new(top, json_string_value(key), json_real(s->top_logprob[k]));
        json_decref(key);
    }
    json_array_append_new(json_object_get(j->cmp_lp, "tokens"), srv_json_text(b, n));
    json_array_append_new(json_object_get(j->cmp_lp, "token_logprobs"), json_real(s->logprob));
    json_array_append_new(json_object_get(j->cmp_lp, "top_logprobs"), top);
    json_array_append_new(json_object_get(j->cmp_lp, "text_offset"),
                          json_integer((json_int_t)(j->content.n + (j->echo && j->prompt_text ? strlen(j->prompt_text) : 0))));
}

void srv_out_finish(srv_job *j) {
    if (!j->stream) return;
    json_t *choice;
    send_first(j);
    if (j->kind == SRV_CHAT) {
        choice = json_pack("{s:i, s:{}, s:o, s:s}", "index", 0, "delta", "logprobs", take_logprobs(j), "finish_reason", j->finish);
    } else {
        choice = json_pack("{s:s, s:i, s:o, s:s}", "text", "", "index", 0, "logprobs", take_logprobs(j), "finish_reason", j->finish);
    }
    sse_send(j, chunk(j, choice));
    if (j->include_usage) {
        json_t *c = chunk(j, json_null());
        json_object_set_new(c, "choices", json_array());
        json_object_set_new(c, "usage", usage_json(j));
        sse_send(j, c);
    }
    srv_buf_add(&j->sse, "data: [DONE]\n\n", 14);
    pthread_cond_broadcast(&j->cv);
}

void srv_out_error(srv_job *j, int status, const char *type, const char *msg) {
    j->http_status = status;
    j->err_type = type;
    snprintf(j->errmsg, sizeof j->errmsg, "%s", msg);
    if (!j->stream) return;
    char *e = srv_error_json(msg, type, NULL, NULL);
    if (!e) return;
    srv_buf_add(&j->sse, "data: ", 6);
    srv_buf_add(&j->sse, e, strlen(e));
    srv_buf_add(&j->sse, "\n\n", 2);
    free(e);
    pthread_cond_broadcast(&j->cv);
}

/* ---- 7. responses ------------------------------------------------------------------------ */

char *srv_response_json(const srv_job *j) {
    json_t *choice;
    if (j->kind == SRV_CHAT) {
        json_t *msg = json_pack("{s:s, s:o, s:n}", "role", "assistant", "content",
                                j->content.n || !j->tool_calls ? srv_json_text(j->content.p ? j->content.p : "", j->content.n) : json_null(),
                                "refusal");
        if (j->thinking) json_object_set_new(msg, "reasoning_content", srv_json_text(j->reasoning.p ? j->reasoning.p : "", j->reasoning.n));
        if (j->tool_calls) json_object_set(msg, "tool_calls", j->tool_calls);
        json_t *lp = j->logprobs ? json_pack("{s:o, s:n}", "content", j->lp_content ? json_incref(j->lp_content) : json_array(), "refusal")
                                 : json_null();
        choice = json_pack("{s:i, s:o, s:o, s:s}", "index", 0, "message", msg, "logprobs", lp, "finish_reason",
                           j->finish ? j->finish : "stop");
    } else {
        srv_buf t = {0};
        if (j->echo && j->prompt_text) srv_buf_add(&t, j->prompt_text, strlen(j->prompt_text));
        if (j->content.n) srv_buf_add(&t, j->content.p, j->content.n);
        json_t *lp = j->logprobs ? (j->cmp_lp ? json_deep_copy(j->cmp_lp)
                                              : json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset"))
                                 : json_null();
        choice = json_pack("{s:o, s:i, s:o, s:s}", "text", srv_json_text(t.p ? t.p : "", t.n), "index", 0, "logprobs", lp,
                           "finish_reason", j->finish ? j->finish : "stop");
        srv_buf_free(&t);
    }
    json_t *root = json_pack("{s:s, s:s, s:I, s:s, s:s, s:[o], s:o}", "id", j->id, "object",
                             j->kind == SRV_CHAT ? "chat.completion" : "text_completion", "created", (json_int_t)j->created,
                             "model", j->model, "system_fingerprint", "deltafin", "choices", choice, "usage", usage_json(j));
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}
