/* chat.c — Kimi K3 "XTML" chat rendering and output parsing (prefix chat_).
 *
 * Owns: df_chat_render (messages -> token ids, special tokens only at
 * structural places, plus the same rendering as text with the specials
 * spelled out) and df_chat_parser (model output text -> reasoning, content
 * and tool calls, holding back partial control markers while streaming).
 * Follows ../shared/K3.md §2.3-2.4 (Moonshot's encoding_k3.py as read by the
 * Deltafin project). Points the spec leaves open, chosen here and marked [L]
 * where they appear: the `index` attribute counts calls from 0; JSON is
 * written as Python's json.dumps writes it by default (ensure_ascii, so
 * non-ASCII becomes \uXXXX); the tool-declare body ends with the closing
 * fence and no newline.
 * Also renders DeepSeek-V3's chat_template (section 3b), chosen by
 * df_chat_opts.format or by the tokenizer's specials.
 * Refuses: unknown roles, bad reasoning_effort, tool_calls / tools that are
 * not JSON arrays, a tokenizer without <|open|> <|close|> <|sep|>
 * <|end_of_msg|>. Not rendered: tool_choice and response_format system
 * messages, images, and the "## New Tools Available" dynamic declaration.
 *
 * Sections: 1. output buffer (ids + text)  2. JSON as Python writes it
 *           3. messages  3b. DeepSeek-V3  4. df_chat_render  5. output parser
 */
#include "text.h"
#include "../base/err.h"
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

/* ---- 1. output buffer ------------------------------------------------------------- */

typedef struct {
    const df_tokenizer *t;
    df_tokens *ids;         /* may be NULL (text only) */
    char *txt;              /* the rendering, specials spelled */
    size_t n, cap;
    size_t run;             /* txt[run..n) is text not yet tokenised: runs between
                             * specials are tokenised whole, as a tokenizer that
                             * splits the rendered string at its specials would */
    int32_t sp_open, sp_close, sp_sep, sp_eom;
    char *err;
    df_status st;
} rb;

static void rb_text_raw(rb *b, const char *s, size_t n) {
    if (b->st != DF_OK) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->txt, cap);
        if (!p) { b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory"); return; }
        b->txt = p;
        b->cap = cap;
    }
    if (n) memcpy(b->txt + b->n, s, n);
    b->n += n;
    b->txt[b->n] = 0;
}

/* Ordinary text: never special, whatever it spells. */
static void rb_text(rb *b, const char *s) {
    if (b->st != DF_OK || !s || !*s) return;
    rb_text_raw(b, s, strlen(s));
}

/* Tokenises the pending text run. */
static void rb_flush(rb *b) {
    if (b->ids && b->st == DF_OK && b->n > b->run) b->st = df_tokenize(b->t, b->txt + b->run, b->n - b->run, 0, b->ids, b->err);
    b->run = b->n;
}

static void rb_special(rb *b, int32_t id, const char *spelling) {
    rb_flush(b);
    rb_text_raw(b, spelling, strlen(spelling));
    b->run = b->n;
    if (b->ids && b->st == DF_OK && df_tokens_push(b->ids, id) != DF_OK) b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory");
}

/* A special token by its spelling (DeepSeek-V3's names) */
static void rb_sp(rb *b, const char *spelling) {
    if (b->st != DF_OK) return;
    int32_t id = b->t ? df_tokenizer_special(b->t, spelling) : 0;
    if (id < 0) {
        b->st = df_fail(b->err, DF_ERR_UNSUPPORTED, "chat: the tokenizer has no %s special token", spelling);
        return;
    }
    rb_special(b, id, spelling);
}

#define OPEN(b) rb_special(b, (b)->sp_open, "<|open|>")
#define CLOSE(b) rb_special(b, (b)->sp_close, "<|close|>")
#define SEP(b) rb_special(b, (b)->sp_sep, "<|sep|>")
#define EOM(b) rb_special(b, (b)->sp_eom, "<|end_of_msg|>")

/* attribute value with & and " escaped */
static char *attr_escape(const char *v) {
    size_t n = 0;
    for (const char *p = v; *p; p++) n += *p == '&' ? 5 : *p == '"' ? 6 : 1;
    char *o = malloc(n + 1), *w = o;
    if (!o) return NULL;
    for (const char *p = v; *p; p++) {
        if (*p == '&') { memcpy(w, "&amp;", 5); w += 5; }
        else if (*p == '"') { memcpy(w, "&quot;", 6); w += 6; }
        else *w++ = *p;
    }
    *w = 0;
    return o;
}

/* <|open|>NAME key="value" ...<|sep|>; attrs: key, value pairs, NULL value skipped */
static void rb_tag(rb *b, const char *name, const char *const *attrs, int n_attrs) {
    OPEN(b);
    size_t cap = strlen(name) + 1;
    for (int i = 0; i < n_attrs; i++)
        if (attrs[2 * i + 1]) cap += strlen(attrs[2 * i]) + 6 * strlen(attrs[2 * i + 1]) + 4;
    char *s = malloc(cap + 1);
    if (!s) { b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory"); return; }
    size_t w = (size_t)sprintf(s, "%s", name);
    for (int i = 0; i < n_attrs; i++) {
        if (!attrs[2 * i + 1]) continue;
        char *e = attr_escape(attrs[2 * i + 1]);
        if (!e) { free(s); b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory"); return; }
        w += (size_t)sprintf(s + w, " %s=\"%s\"", attrs[2 * i], e);
        free(e);
    }
    rb_text(b, s);
    free(s);
    SEP(b);
}

static void rb_close(rb *b, const char *name) {
    CLOSE(b);
    rb_text(b, name);
    SEP(b);
}

/* ---- 2. JSON as Python writes it ---------------------------------------------------- */

/* json.dumps(v, separators=(",", ":"), sort_keys=True) when compact, else
 * json.dumps(v) (", " and ": "); both ensure_ascii [L]. jansson writes reals
 * with 17 significant digits where Python writes the shortest repr: a known
 * difference for non-integral numbers. */
static char *py_dumps(const json_t *v, int compact) {
    size_t flags = JSON_ENCODE_ANY | JSON_ENSURE_ASCII | JSON_REAL_PRECISION(17);
    flags |= compact ? (JSON_COMPACT | JSON_SORT_KEYS) : 0;
    char *s = json_dumps(v, flags);
    /* Python writes \u00e9, jansson \u00E9 */
    for (char *q = s; q && *q; q++) {
        if (*q != '\\') continue;
        if (q[1] == 'u')
            for (int k = 2; k < 6 && q[k]; k++) if (q[k] >= 'A' && q[k] <= 'F') q[k] = (char)(q[k] - 'A' + 'a');
        if (q[1]) q++; /* skip the escaped character */
    }
    return s;
}

static const char *py_type(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_STRING: return "string";
    case JSON_INTEGER: case JSON_REAL: return "number";
    case JSON_TRUE: case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    }
    return "null";
}

/* ---- 3. messages --------------------------------------------------------------------- */

static const char effort_text[] =
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=";

static void render_tools_decl(rb *b, const char *tools_json) {
    json_error_t je;
    json_t *tools = json_loads(tools_json, 0, &je);
    if (!json_is_array(tools)) {
        json_decref(tools);
        b->st = df_fail(b->err, DF_ERR_ARG, "chat: tools must be a JSON array (%s)", je.text);
        return;
    }
    char *js = py_dumps(tools, 1);
    json_decref(tools);
    if (!js) { b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory"); return; }
    const char *attrs[] = {"role", "system", "type", "tool-declare"};
    rb_tag(b, "message", attrs, 2);
    size_t n = strlen(js) + 128;
    char *body = malloc(n);
    if (body) {
        snprintf(body, n, "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n%s\n```", js);
        rb_text(b, body);
        free(body);
    } else b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory");
    free(js);
    rb_close(b, "message");
    EOM(b);
}

/* One assistant tool call: {"id", "function": {"name", "arguments"}} with
 * arguments a JSON string or an object. */
static void render_call(rb *b, json_t *call, int index) {
    json_t *fn = json_object_get(call, "function");
    if (!json_is_object(fn)) fn = call; /* {"name", "arguments"} directly */
    const char *name = json_string_value(json_object_get(fn, "name"));
    if (!name) { b->st = df_fail(b->err, DF_ERR_ARG, "chat: tool call %d has no function name", index); return; }
    char idx[16];
    snprintf(idx, sizeof idx, "%d", index);
    const char *attrs[] = {"tool", name, "index", idx};
    rb_tag(b, "call", attrs, 2);
    json_t *a = json_object_get(fn, "arguments");
    json_t *obj = NULL;
    const char *raw = NULL;
    if (json_is_string(a)) {
        raw = json_string_value(a);
        obj = json_loads(raw, JSON_DECODE_ANY, NULL);
    } else if (a) {
        obj = json_incref(a);
    }
    if (json_is_object(obj)) {
        const char *key;
        json_t *v;
        json_object_foreach(obj, key, v) { /* insertion order (jansson keeps it) */
            const char *at[] = {"key", key, "type", py_type(v)};
            rb_tag(b, "argument", at, 2);
            if (json_is_string(v)) rb_text(b, json_string_value(v));
            else {
                char *s = py_dumps(v, 0);
                if (!s) b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory");
                rb_text(b, s);
                free(s);
            }
            rb_close(b, "argument");
        }
    } else {
        char *dumped = NULL;
        if (!raw && a) raw = dumped = py_dumps(a, 0);
        const char *at[] = {"type", "object"};
        rb_tag(b, "json", at, 1);
        rb_text(b, raw ? raw : "");
        rb_close(b, "json");
        free(dumped);
    }
    json_decref(obj);
    rb_close(b, "call");
}

static void render_assistant(rb *b, const df_chat_msg *m) {
    const char *attrs[] = {"role", "assistant"};
    rb_tag(b, "message", attrs, 1);
    rb_tag(b, "think", NULL, 0);
    rb_text(b, m->reasoning);
    rb_close(b, "think");
    rb_tag(b, "response", NULL, 0);
    rb_text(b, m->content);
    rb_close(b, "response");
    if (m->tool_calls && *m->tool_calls) {
        json_error_t je;
        json_t *calls = json_loads(m->tool_calls, 0, &je);
        if (!json_is_array(calls)) {
            json_decref(calls);
            b->st = df_fail(b->err, DF_ERR_ARG, "chat: tool_calls must be a JSON array (%s)", je.text);
            return;
        }
        if (json_array_size(calls)) {
            rb_tag(b, "tools", NULL, 0);
            for (size_t i = 0; i < json_array_size(calls) && b->st == DF_OK; i++) render_call(b, json_array_get(calls, i), (int)i);
            rb_close(b, "tools");
        }
        json_decref(calls);
    }
    rb_close(b, "message");
    EOM(b);
}

/* The calls (id, name) of an assistant message, for its tool results. */
typedef struct {
    int n;
    char **id, **name;
} call_list;

static void calls_free(call_list *c) {
    for (int i = 0; i < c->n; i++) { free(c->id[i]); free(c->name[i]); }
    free(c->id);
    free(c->name);
    memset(c, 0, sizeof *c);
}

static void calls_load(call_list *c, const char *json) {
    calls_free(c);
    json_t *a = json ? json_loads(json, 0, NULL) : NULL;
    if (json_is_array(a) && json_array_size(a)) {
        size_t n = json_array_size(a);
        c->id = calloc(n, sizeof *c->id);
        c->name = calloc(n, sizeof *c->name);
        if (c->id && c->name) {
            c->n = (int)n;
            for (size_t i = 0; i < n; i++) {
                json_t *call = json_array_get(a, i), *fn = json_object_get(call, "function");
                const char *id = json_string_value(json_object_get(call, "id"));
                const char *nm = json_string_value(json_object_get(json_is_object(fn) ? fn : call, "name"));
                c->id[i] = id ? strdup(id) : NULL;
                c->name[i] = nm ? strdup(nm) : NULL;
            }
        }
    }
    json_decref(a);
}

/* A run of tool messages m[0..n): reordered to the call order of the
 * previous assistant message (unmatched ones keep their order, after). */
static void render_tool_run(rb *b, const df_chat_msg *m, int n, const call_list *calls) {
    int *order = malloc((size_t)n * sizeof *order), *slot = malloc((size_t)n * sizeof *slot);
    if (!order || !slot) { free(order); free(slot); b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory"); return; }
    for (int i = 0; i < n; i++) {
        slot[i] = -1;
        for (int k = 0; k < calls->n && m[i].tool_call_id; k++)
            if (calls->id[k] && !strcmp(calls->id[k], m[i].tool_call_id)) { slot[i] = k; break; }
    }
    int w = 0;
    for (int k = 0; k < calls->n; k++)
        for (int i = 0; i < n; i++) if (slot[i] == k) order[w++] = i;
    for (int i = 0; i < n; i++) if (slot[i] < 0) order[w++] = i;
    for (int j = 0; j < w && b->st == DF_OK; j++) {
        const df_chat_msg *t = &m[order[j]];
        int k = slot[order[j]] >= 0 ? slot[order[j]] : j; /* by call order when unmatched */
        const char *name = t->name ? t->name : (k < calls->n ? calls->name[k] : NULL);
        char idx[16];
        snprintf(idx, sizeof idx, "%d", k);
        const char *attrs[] = {"role", "tool", "tool", name ? name : "", "index", idx};
        rb_tag(b, "message", attrs, 3);
        rb_text(b, t->content);
        rb_close(b, "message");
        EOM(b);
    }
    free(order);
    free(slot);
}

/* ---- 3b. DeepSeek-V3 ----------------------------------------------------------------
 * The chat_template of DeepSeek-V3's tokenizer_config.json, reproduced
 * statement by statement (tests compare with transformers.js running the
 * jinja itself), including its quirks: system messages are joined with a
 * blank line right after BOS; the first tool call of the conversation opens
 * <｜tool▁calls▁begin｜>, each later call is preceded by "\n" and followed by
 * <｜tool▁calls▁end｜><｜end▁of▁sentence｜> (so a single call is never
 * closed); the "first output" flag is never reset. No other jinja is
 * interpreted: this is the only template besides K3's XTML that renders. */
#define DS(x) "<\xef\xbd\x9c" x "\xef\xbd\x9c>"
#define DS_BOS DS("begin\xe2\x96\x81of\xe2\x96\x81sentence")
#define DS_EOS DS("end\xe2\x96\x81of\xe2\x96\x81sentence")
#define DS_USER DS("User")
#define DS_ASSISTANT DS("Assistant")
#define DS_CALLS_BEGIN DS("tool\xe2\x96\x81" "calls\xe2\x96\x81" "begin")
#define DS_CALLS_END DS("tool\xe2\x96\x81" "calls\xe2\x96\x81" "end")
#define DS_CALL_BEGIN DS("tool\xe2\x96\x81" "call\xe2\x96\x81" "begin")
#define DS_CALL_END DS("tool\xe2\x96\x81" "call\xe2\x96\x81" "end")
#define DS_SEP DS("tool\xe2\x96\x81" "sep")
#define DS_OUTS_BEGIN DS("tool\xe2\x96\x81outputs\xe2\x96\x81" "begin")
#define DS_OUTS_END DS("tool\xe2\x96\x81outputs\xe2\x96\x81" "end")
#define DS_OUT_BEGIN DS("tool\xe2\x96\x81output\xe2\x96\x81" "begin")
#define DS_OUT_END DS("tool\xe2\x96\x81output\xe2\x96\x81" "end")

static void ds_call(rb *b, json_t *call, int later) {
    json_t *fn = json_object_get(call, "function");
    const char *type = json_string_value(json_object_get(call, "type"));
    const char *name = json_string_value(json_object_get(fn, "name"));
    json_t *a = json_object_get(fn, "arguments");
    if (!name) { b->st = df_fail(b->err, DF_ERR_ARG, "chat: a tool call has no function name"); return; }
    char *args = json_is_string(a) ? strdup(json_string_value(a)) : a ? py_dumps(a, 0) : strdup("");
    size_t n = strlen(name) + (args ? strlen(args) : 0) + 32;
    char *body = malloc(n);
    if (!args || !body) { free(args); free(body); b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory"); return; }
    snprintf(body, n, "%s\n```json\n%s\n```", name, args);
    if (later) rb_text(b, "\n");
    else { rb_sp(b, DS_ASSISTANT); rb_sp(b, DS_CALLS_BEGIN); }
    rb_sp(b, DS_CALL_BEGIN);
    rb_text(b, type ? type : "function");
    rb_sp(b, DS_SEP);
    rb_text(b, body);
    rb_sp(b, DS_CALL_END);
    if (later) { rb_sp(b, DS_CALLS_END); rb_sp(b, DS_EOS); }
    free(args);
    free(body);
}

static void render_deepseek(rb *b, const df_chat_msg *m, int n, const df_chat_opts *o) {
    int is_first = 0, is_tool = 0, is_output_first = 1;
    rb_sp(b, DS_BOS);
    int first_sp = 1;
    for (int i = 0; i < n; i++) /* the system prompt, joined with blank lines */
        if (!strcmp(m[i].role, "system")) {
            if (!first_sp) rb_text(b, "\n\n");
            rb_text(b, m[i].content);
            first_sp = 0;
        }
    for (int i = 0; i < n && b->st == DF_OK; i++) {
        const df_chat_msg *x = &m[i];
        if (!strcmp(x->role, "user")) {
            is_tool = 0;
            rb_sp(b, DS_USER);
            rb_text(b, x->content);
        } else if (!strcmp(x->role, "assistant") && !x->content) {
            is_tool = 0;
            json_t *calls = x->tool_calls ? json_loads(x->tool_calls, 0, NULL) : NULL;
            if (x->tool_calls && !json_is_array(calls)) {
                json_decref(calls);
                b->st = df_fail(b->err, DF_ERR_ARG, "chat: tool_calls must be a JSON array");
                return;
            }
            for (size_t k = 0; k < json_array_size(calls) && b->st == DF_OK; k++) {
                ds_call(b, json_array_get(calls, k), is_first);
                is_first = 1;
            }
            json_decref(calls);
        } else if (!strcmp(x->role, "assistant")) {
            if (is_tool) rb_sp(b, DS_OUTS_END);
            else rb_sp(b, DS_ASSISTANT);
            rb_text(b, x->content);
            rb_sp(b, DS_EOS);
            is_tool = 0;
        } else if (!strcmp(x->role, "tool")) {
            is_tool = 1;
            if (is_output_first) {
                rb_sp(b, DS_OUTS_BEGIN);
                is_output_first = 0;
            } else rb_text(b, "\n");
            rb_sp(b, DS_OUT_BEGIN);
            rb_text(b, x->content);
            rb_sp(b, DS_OUT_END);
        }
    }
    if (is_tool) rb_sp(b, DS_OUTS_END);
    if (o->add_generation_prompt && !is_tool) rb_sp(b, DS_ASSISTANT);
}

/* Kimi-K2 (Instruct / Thinking) chat_template, reproduced: im_* role markers,
 * an injected default system message (followed by a newline) when the
 * conversation does not start with one, tools declared first as compact
 * sorted JSON, assistant tool calls in a calls section, tool results as
 * "## Return of ID". Reasoning content is not rendered (the template never
 * reads it). */
static const char K2_DEFAULT_SYSTEM[] = "You are Kimi, an AI assistant created by Moonshot AI.";

static void k2_turn(rb *b, const char *marker, const char *role) {
    rb_sp(b, marker);
    rb_text(b, role);
    rb_sp(b, "<|im_middle|>");
}

static void render_kimi_k2(rb *b, const df_chat_msg *m, int n, const df_chat_opts *o) {
    if (o->tools && *o->tools) {
        json_error_t je;
        json_t *tools = json_loads(o->tools, 0, &je);
        if (!json_is_array(tools)) {
            json_decref(tools);
            b->st = df_fail(b->err, DF_ERR_ARG, "chat: tools must be a JSON array (%s)", je.text);
            return;
        }
        char *js = json_dumps(tools, JSON_COMPACT | JSON_SORT_KEYS | JSON_REAL_PRECISION(17));
        json_decref(tools);
        if (!js) { b->st = df_fail(b->err, DF_ERR_NOMEM, "out of memory"); return; }
        k2_turn(b, "<|im_system|>", "tool_declare");
        rb_text(b, js);
        rb_sp(b, "<|im_end|>");
        free(js);
    }
    if (n == 0 || strcmp(m[0].role, "system")) {
        k2_turn(b, "<|im_system|>", "system");
        rb_text(b, K2_DEFAULT_SYSTEM);
        rb_sp(b, "<|im_end|>");
        rb_text(b, "\n");
    }
    for (int i = 0; i < n && b->st == DF_OK; i++) {
        const df_chat_msg *x = &m[i];
        if (!strcmp(x->role, "system") || !strcmp(x->role, "user")) {
            k2_turn(b, !strcmp(x->role, "user") ? "<|im_user|>" : "<|im_system|>", x->role);
            rb_text(b, x->content);
        } else if (!strcmp(x->role, "assistant")) {
            k2_turn(b, "<|im_assistant|>", "assistant");
            rb_text(b, x->content);
            json_t *calls = x->tool_calls ? json_loads(x->tool_calls, 0, NULL) : NULL;
            if (x->tool_calls && !json_is_array(calls)) {
                json_decref(calls);
                b->st = df_fail(b->err, DF_ERR_ARG, "chat: tool_calls must be a JSON array");
                return;
            }
            if (json_array_size(calls)) {
                rb_sp(b, "<|tool_calls_section_begin|>");
                for (size_t k = 0; k < json_array_size(calls) && b->st == DF_OK; k++) {
                    json_t *c = json_array_get(calls, k);
                    json_t *f = json_object_get(c, "function");
                    json_t *args = json_object_get(f ? f : c, "arguments");
                    rb_sp(b, "<|tool_call_begin|>");
                    rb_text(b, json_string_value(json_object_get(c, "id")));
                    rb_sp(b, "<|tool_call_argument_begin|>");
                    if (json_is_string(args)) rb_text(b, json_string_value(args));
                    else if (args) {
                        char *a = json_dumps(args, JSON_ENCODE_ANY | JSON_REAL_PRECISION(17)); /* ", " and ": " as Python */
                        rb_text(b, a);
                        free(a);
                    }
                    rb_sp(b, "<|tool_call_end|>");
                }
                rb_sp(b, "<|tool_calls_section_end|>");
            }
            json_decref(calls);
        } else { /* tool */
            k2_turn(b, "<|im_system|>", x->name && *x->name ? x->name : "tool");
            rb_text(b, "## Return of ");
            rb_text(b, x->tool_call_id);
            rb_text(b, "\n");
            rb_text(b, x->content);
        }
        rb_sp(b, "<|im_end|>");
    }
    if (o->add_generation_prompt) k2_turn(b, "<|im_assistant|>", "assistant");
}

/* ---- 4. df_chat_render ---------------------------------------------------------------- */

void df_chat_opts_default(df_chat_opts *o) {
    memset(o, 0, sizeof *o);
    o->reasoning_effort = "max";
    o->thinking = 1;
    o->add_generation_prompt = 1;
}

static int32_t need_special(rb *b, const char *s) {
    int32_t id = b->t ? df_tokenizer_special(b->t, s) : 0;
    if (id < 0 && b->st == DF_OK)
        b->st = df_fail(b->err, DF_ERR_UNSUPPORTED, "chat: the tokenizer has no %s special token (not a Kimi K3 tokenizer)", s);
    return id;
}

df_status df_chat_render(const df_tokenizer *t, const df_chat_msg *msgs, int n, const df_chat_opts *opts,
                         df_tokens *out, char **text, char err[DF_ERRMSG]) {
    if (text) *text = NULL;
    if ((!t && out) || (n && !msgs) || n < 0) return df_fail(err, DF_ERR_ARG, "df_chat_render: bad arguments");
    df_chat_opts dflt;
    if (!opts) { df_chat_opts_default(&dflt); opts = &dflt; }
    rb b = {.t = t, .ids = out, .err = err, .st = DF_OK};
    int n0 = out ? out->n : 0;
    const char *fmt = opts->format;
    if (!fmt) {
        int k3 = !t || df_tokenizer_special(t, "<|open|>") >= 0;
        fmt = k3 ? "k3" : df_tokenizer_special(t, "<|im_middle|>") >= 0 ? "kimi_k2"
                 : df_tokenizer_special(t, DS_USER) >= 0 ? "deepseek_v3" : "k3";
    }
    if (!strcmp(fmt, "deepseek_v3") || !strcmp(fmt, "kimi_k2")) {
        for (int i = 0; i < n; i++) {
            const char *r = msgs[i].role;
            if (!r || (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool")))
                return df_fail(err, DF_ERR_ARG, "chat: message %d has role '%s' (system, user, assistant, tool)", i, r ? r : "(none)");
        }
        if (!strcmp(fmt, "kimi_k2")) render_kimi_k2(&b, msgs, n, opts);
        else render_deepseek(&b, msgs, n, opts);
        goto finish;
    }
    if (strcmp(fmt, "k3")) return df_fail(err, DF_ERR_ARG, "chat: unknown format '%s' (k3, kimi_k2, deepseek_v3)", fmt);
    b.sp_open = need_special(&b, "<|open|>");
    b.sp_close = need_special(&b, "<|close|>");
    b.sp_sep = need_special(&b, "<|sep|>");
    b.sp_eom = need_special(&b, "<|end_of_msg|>");
    const char *eff = opts->reasoning_effort;
    if (eff && *eff && strcmp(eff, "low") && strcmp(eff, "medium") && strcmp(eff, "high") && strcmp(eff, "max"))
        b.st = df_fail(err, DF_ERR_ARG, "chat: reasoning_effort must be low, medium, high or max (got '%s')", eff);
    for (int i = 0; i < n && b.st == DF_OK; i++) {
        const char *r = msgs[i].role;
        if (!r || (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool")))
            b.st = df_fail(err, DF_ERR_ARG, "chat: message %d has role '%s' (system, user, assistant, tool)", i, r ? r : "(none)");
    }
    if (b.st == DF_OK && opts->tools && *opts->tools) render_tools_decl(&b, opts->tools);
    if (b.st == DF_OK && opts->thinking && eff && *eff) {
        const char *attrs[] = {"role", "system", "type", "thinking-effort"};
        rb_tag(&b, "message", attrs, 2);
        char body[512];
        snprintf(body, sizeof body, "%s%s`.", effort_text, eff);
        rb_text(&b, body);
        rb_close(&b, "message");
        EOM(&b);
    }
    call_list calls = {0};
    for (int i = 0; i < n && b.st == DF_OK; i++) {
        const df_chat_msg *m = &msgs[i];
        if (!strcmp(m->role, "assistant")) {
            render_assistant(&b, m);
            calls_load(&calls, m->tool_calls);
        } else if (!strcmp(m->role, "tool")) {
            int j = i;
            while (j < n && !strcmp(msgs[j].role, "tool")) j++;
            render_tool_run(&b, m, j - i, &calls);
            i = j - 1;
        } else {
            const char *attrs[] = {"role", m->role, "name", m->name};
            rb_tag(&b, "message", attrs, 2);
            rb_text(&b, m->content);
            rb_close(&b, "message");
            EOM(&b);
        }
    }
    calls_free(&calls);
    if (b.st == DF_OK && opts->add_generation_prompt) {
        const char *attrs[] = {"role", "assistant"};
        rb_tag(&b, "message", attrs, 1);
        rb_tag(&b, opts->thinking ? "think" : "response", NULL, 0);
    }
finish:
    rb_flush(&b);
    if (b.st != DF_OK) {
        free(b.txt);
        if (out) out->n = n0;
        return b.st;
    }
    if (text) *text = b.txt ? b.txt : strdup("");
    else free(b.txt);
    return DF_OK;
}

/* ---- 5. output parser ---------------------------------------------------------------- */

/* States follow §2.4: reasoning until </think>, then (skipping anything up
 * to) <response>, content until </response>, then an optional tools block
 * (parsed whole when it closes), then the end of the message. */
enum { ST_THINK, ST_GAP, ST_RESPONSE, ST_AFTER, ST_TOOLS, ST_DONE };

static const char M_THINK_END[] = "<|close|>think<|sep|>";
static const char M_RESP_BEGIN[] = "<|open|>response<|sep|>";
static const char M_RESP_END[] = "<|close|>response<|sep|>";
static const char M_TOOLS_BEGIN[] = "<|open|>tools<|sep|>";
static const char M_TOOLS_END[] = "<|close|>tools<|sep|>";
static const char M_MSG_END[] = "<|close|>message<|sep|>";
static const char M_EOM[] = "<|end_of_msg|>";

struct df_chat_parser {
    int state;
    char *buf;          /* text not yet emitted / consumed */
    size_t n, cap;
    df_chat_emit emit;
    void *ud;
    int n_calls;
};

df_status df_chat_parser_new(int in_thinking, df_chat_emit emit, void *ud, df_chat_parser **out) {
    *out = NULL;
    if (!emit) return DF_ERR_ARG;
    df_chat_parser *p = calloc(1, sizeof *p);
    if (!p) return DF_ERR_NOMEM;
    p->state = in_thinking ? ST_THINK : ST_RESPONSE;
    p->emit = emit;
    p->ud = ud;
    p->cap = 256; /* never NULL: memmem must not see a null buffer, even before any text */
    p->buf = malloc(p->cap);
    if (!p->buf) { free(p); return DF_ERR_NOMEM; }
    *out = p;
    return DF_OK;
}

void df_chat_parser_free(df_chat_parser *p) {
    if (!p) return;
    free(p->buf);
    free(p);
}

static void consume(df_chat_parser *p, size_t k) {
    memmove(p->buf, p->buf + k, p->n - k);
    p->n -= k;
}

/* Length of the longest suffix of buf that is a proper prefix of marker:
 * held back, it may still become the marker. */
static size_t partial_tail(const char *buf, size_t n, const char *marker) {
    size_t ml = strlen(marker);
    for (size_t k = n < ml - 1 ? n : ml - 1; k > 0; k--)
        if (!memcmp(marker, buf + n - k, k)) return k;
    return 0;
}

/* text up to a marker, or a partial one, goes out as `kind` */
static int emit_until(df_chat_parser *p, int kind, const char *marker, int next) {
    char *hit = memmem(p->buf, p->n, marker, strlen(marker));
    if (hit) {
        size_t k = (size_t)(hit - p->buf);
        if (k) p->emit(p->ud, kind, p->buf, k);
        consume(p, k + strlen(marker));
        p->state = next;
        return 1;
    }
    /* only a proper prefix of the marker is held back, and only whole
     * UTF-8 code points go out: a sequence still unfinished at the end
     * waits for its last bytes (invalid bytes go out; they never finish) */
    size_t keep = partial_tail(p->buf, p->n, marker);
    size_t out = p->n - keep, lead = out;
    while (lead > 0 && out - lead < 3 && ((unsigned char)p->buf[lead - 1] & 0xC0) == 0x80) lead--;
    if (lead > 0 && (unsigned char)p->buf[lead - 1] >= 0xC0) {
        uint32_t cp;
        if (tok_utf8_step((const unsigned char *)p->buf + lead - 1, out - lead + 1, &cp) == 0) out = lead - 1;
    }
    if (out) { p->emit(p->ud, kind, p->buf, out); consume(p, out); }
    return 0;
}

static char *attr_value(const char *tag, size_t tn, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, " %s=\"", key);
    const char *s = memmem(tag, tn, pat, strlen(pat));
    if (!s) return NULL;
    s += strlen(pat);
    const char *e = memchr(s, '"', tn - (size_t)(s - tag));
    if (!e) return NULL;
    char *v = malloc((size_t)(e - s) + 1), *w = v;
    if (!v) return NULL;
    for (const char *q = s; q < e;) {
        if (!strncmp(q, "&quot;", 6)) { *w++ = '"'; q += 6; }
        else if (!strncmp(q, "&amp;", 5)) { *w++ = '&'; q += 5; }
        else *w++ = *q++;
    }
    *w = 0;
    return v;
}

/* Parses <|open|>call tool=".." index=".."<|sep|> ... <|close|>call<|sep|> blocks
 * of a closed tools block into {"name": .., "arguments": {..}} JSON objects. */
static void parse_tools(df_chat_parser *p, const char *s, size_t n) {
    static const char call_open[] = "<|open|>call", call_close[] = "<|close|>call<|sep|>";
    static const char arg_open[] = "<|open|>argument", arg_close[] = "<|close|>argument<|sep|>";
    static const char json_open[] = "<|open|>json", json_close[] = "<|close|>json<|sep|>";
    const char *end = s + n;
    for (;;) {
        const char *c = memmem(s, (size_t)(end - s), call_open, sizeof call_open - 1);
        if (!c) break;
        const char *hdr_end = memmem(c, (size_t)(end - c), "<|sep|>", 7);
        const char *ce = hdr_end ? memmem(hdr_end, (size_t)(end - hdr_end), call_close, sizeof call_close - 1) : NULL;
        if (!ce) break;
        char *name = attr_value(c, (size_t)(hdr_end - c), "tool");
        json_t *args = json_object();
        const char *q = hdr_end + 7;
        for (;;) {
            const char *a = memmem(q, (size_t)(ce - q), arg_open, sizeof arg_open - 1);
            const char *j = memmem(q, (size_t)(ce - q), json_open, sizeof json_open - 1);
            if (!a && !j) break;
            if (j && (!a || j < a)) { /* unparsable arguments kept raw */
                const char *he = memmem(j, (size_t)(ce - j), "<|sep|>", 7);
                const char *je = he ? memmem(he, (size_t)(ce - he), json_close, sizeof json_close - 1) : NULL;
                if (!je) break;
                json_decref(args);
                args = json_stringn(he + 7, (size_t)(je - he - 7));
                q = je + sizeof json_close - 1;
                continue;
            }
            const char *he = memmem(a, (size_t)(ce - a), "<|sep|>", 7);
            const char *ae = he ? memmem(he, (size_t)(ce - he), arg_close, sizeof arg_close - 1) : NULL;
            if (!ae) break;
            char *key = attr_value(a, (size_t)(he - a), "key"), *type = attr_value(a, (size_t)(he - a), "type");
            const char *v = he + 7;
            size_t vn = (size_t)(ae - v);
            json_t *val = NULL;
            if (type && strcmp(type, "string")) val = json_loadb(v, vn, JSON_DECODE_ANY, NULL);
            if (!val) val = json_stringn(v, vn);
            if (key && json_is_object(args)) json_object_set_new(args, key, val);
            else json_decref(val);
            free(key);
            free(type);
            q = ae + sizeof arg_close - 1;
        }
        json_t *call = json_pack("{s:s, s:o}", "name", name ? name : "", "arguments", args ? args : json_null());
        char *js = call ? json_dumps(call, JSON_COMPACT) : NULL;
        if (js) p->emit(p->ud, DF_CHAT_TOOL_CALL, js, strlen(js));
        free(js);
        json_decref(call);
        free(name);
        p->n_calls++;
        s = ce + sizeof call_close - 1;
    }
}

static void step(df_chat_parser *p, int final) {
    for (;;) {
        switch (p->state) {
        case ST_THINK:
            if (!emit_until(p, DF_CHAT_REASONING, M_THINK_END, ST_GAP)) return;
            break;
        case ST_GAP: {
            char *hit = memmem(p->buf, p->n, M_RESP_BEGIN, sizeof M_RESP_BEGIN - 1);
            if (!hit) return;
            consume(p, (size_t)(hit - p->buf) + sizeof M_RESP_BEGIN - 1);
            p->state = ST_RESPONSE;
            break;
        }
        case ST_RESPONSE:
            if (!emit_until(p, DF_CHAT_CONTENT, M_RESP_END, ST_AFTER)) return;
            break;
        case ST_AFTER: {
            char *t = memmem(p->buf, p->n, M_TOOLS_BEGIN, sizeof M_TOOLS_BEGIN - 1);
            char *e = memmem(p->buf, p->n, M_MSG_END, sizeof M_MSG_END - 1);
            char *o = memmem(p->buf, p->n, M_EOM, sizeof M_EOM - 1);
            if (e && (!o || e < o)) o = e;
            if (t && (!o || t < o)) {
                consume(p, (size_t)(t - p->buf) + sizeof M_TOOLS_BEGIN - 1);
                p->state = ST_TOOLS;
            } else if (o) {
                p->state = ST_DONE;
            } else return;
            break;
        }
        case ST_TOOLS: {
            char *e = memmem(p->buf, p->n, M_TOOLS_END, sizeof M_TOOLS_END - 1);
            if (!e) {
                if (final) parse_tools(p, p->buf, p->n); /* cut off: parse what closed */
                return;
            }
            parse_tools(p, p->buf, (size_t)(e - p->buf));
            consume(p, (size_t)(e - p->buf) + sizeof M_TOOLS_END - 1);
            p->state = ST_AFTER;
            break;
        }
        case ST_DONE:
            p->n = 0;
            return;
        }
    }
}

df_status df_chat_parser_feed(df_chat_parser *p, const char *text, size_t n) {
    if (!p || (n && !text)) return DF_ERR_ARG;
    if (p->n + n + 1 > p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 256;
        while (cap < p->n + n + 1) cap *= 2;
        char *b = realloc(p->buf, cap);
        if (!b) return DF_ERR_NOMEM;
        p->buf = b;
        p->cap = cap;
    }
    if (n) memcpy(p->buf + p->n, text, n);
    p->n += n;
    step(p, 0);
    return DF_OK;
}

void df_chat_parser_finish(df_chat_parser *p) {
    if (!p) return;
    step(p, 1);
    /* a held-back partial marker at the end of output is text after all */
    if (p->n && (p->state == ST_THINK || p->state == ST_RESPONSE))
        p->emit(p->ud, p->state == ST_THINK ? DF_CHAT_REASONING : DF_CHAT_CONTENT, p->buf, p->n);
    p->n = 0;
    p->state = ST_DONE;
}

int df_chat_parser_done(const df_chat_parser *p) { return p && p->state == ST_DONE; }
