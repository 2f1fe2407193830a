/* fuzz_chat_parser.c — libFuzzer harness: the chat output parser
 * (df_chat_parser, src/text/chat.c) on model output, streamed in pieces.
 *
 * Input: one flags byte (bit 0: the prompt opened the think channel), one
 * byte choosing the piece sizes (1..32 bytes, some empty feeds when bit 7
 * is set), then the output text. The text is fed twice: in pieces (partial
 * markers and split UTF-8 sequences at every boundary) and whole. Checks:
 * both give the same reasoning, content and tool calls (a stream may cut
 * the text anywhere, never change it) and the same end state; emitted
 * kinds are the three the API names; when the output is valid UTF-8, every
 * piece of text the streaming parser emits is valid UTF-8 (it holds back
 * split code points).
 */
#include "common.h"
#include "../../src/text/text.h"
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct {
    char *buf[4];        /* by kind: 1 reasoning, 2 content, 3 tool calls (one per line) */
    size_t n[4], cap[4];
    int check_utf8;
} sink;

static void put(sink *s, int k, const char *p, size_t n) {
    if (s->n[k] + n + 2 > s->cap[k]) {
        size_t cap = (s->n[k] + n + 2) * 2;
        char *b = realloc(s->buf[k], cap);
        if (!b) fz_die("out of memory");
        s->buf[k] = b;
        s->cap[k] = cap;
    }
    if (n) memcpy(s->buf[k] + s->n[k], p, n);
    s->n[k] += n;
}

static void on_emit(void *ud, int kind, const char *text, size_t n) {
    sink *s = ud;
    if (kind != DF_CHAT_REASONING && kind != DF_CHAT_CONTENT && kind != DF_CHAT_TOOL_CALL)
        fz_die("emit of kind %d", kind);
    if (n && !text) fz_die("emit of %zu bytes from NULL", n);
    if (s->check_utf8 && kind != DF_CHAT_TOOL_CALL && tok_utf8_check(text, n) != n)
        fz_die("a streamed %s piece of %zu bytes cuts a UTF-8 sequence", kind == 1 ? "reasoning" : "content", n);
    put(s, kind, text, n);
    if (kind == DF_CHAT_TOOL_CALL) put(s, kind, "\n", 1);
}

static void sink_free(sink *s) {
    for (int k = 0; k < 4; k++) free(s->buf[k]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    int thinking = data[0] & 1, pieces = data[1];
    const char *text = (const char *)data + 2;
    size_t n = size - 2;
    sink whole = {0}, streamed = {0};
    streamed.check_utf8 = tok_utf8_check(text, n) == n;
    df_chat_parser *a, *b;
    if (df_chat_parser_new(thinking, on_emit, &whole, &a) != DF_OK) fz_die("parser_new");
    if (df_chat_parser_new(thinking, on_emit, &streamed, &b) != DF_OK) fz_die("parser_new");
    if (df_chat_parser_feed(a, text, n) != DF_OK) fz_die("feed");
    int done_a = df_chat_parser_done(a);
    df_chat_parser_finish(a);
    uint32_t r = 2166136261u ^ (uint32_t)pieces;
    for (size_t at = 0; at < n;) {
        r = r * 1103515245u + 12345u;
        size_t k = 1 + (r >> 16) % (1 + (pieces & 31));
        if ((pieces & 0x80) && (r & 0x300) == 0) k = 0;
        if (k > n - at) k = n - at;
        if (df_chat_parser_feed(b, text + at, k) != DF_OK) fz_die("feed");
        at += k;
    }
    int done_b = df_chat_parser_done(b);
    df_chat_parser_finish(b);
    for (int k = 1; k <= 3; k++)
        if (whole.n[k] != streamed.n[k] || (whole.n[k] && memcmp(whole.buf[k], streamed.buf[k], whole.n[k])))
            fz_die("kind %d: %zu bytes whole, %zu streamed, or different bytes", k, whole.n[k], streamed.n[k]);
    if (done_a != done_b) fz_die("the message closed in one feeding only");
    df_chat_parser_free(a);
    df_chat_parser_free(b);
    sink_free(&whole);
    sink_free(&streamed);
    return 0;
}
