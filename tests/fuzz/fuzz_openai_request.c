/* fuzz_openai_request.c — libFuzzer harness: OpenAI request bodies
 * (srv_job_from_request, src/server/api.c: /v1/chat/completions and
 * /v1/completions, every field, the chat rendering of the messages), then
 * the response side with hostile text (srv_out_text, srv_out_tool_call,
 * srv_out_finish, srv_response_json).
 *
 * Input: a flags byte, then BODY FZ_SEP OUTPUT_TEXT FZ_SEP TOOL_CALL.
 *   bit 0     completions (else chat)
 *   bits 1-2  tokenizer: K3 (XTML), Kimi-K2, DeepSeek-V3, K3 (each a 256-byte
 *             rank file plus that format's special tokens, built once)
 *   bit 3     a 24-token context and a ceiling of 8 (else 4096 and 4096)
 * Checks: a refused request has status 400 or 500 and a message; an
 * accepted one has a prompt of ids inside the vocabulary and a token budget
 * that fits the context and the ceiling; the response JSON is produced.
 */
#include "common.h"
#include "../../src/server/server.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const k3_sp[] = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", NULL};
static const char *const k2_sp[] = {"<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
                                    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                    "<|tool_call_argument_begin|>", "<|tool_call_end|>", NULL};
#define DS(x) "<\xef\xbd\x9c" x "\xef\xbd\x9c>"
static const char *const ds_sp[] = {DS("begin\xe2\x96\x81of\xe2\x96\x81sentence"), DS("end\xe2\x96\x81of\xe2\x96\x81sentence"),
                                    DS("User"), DS("Assistant"), DS("tool\xe2\x96\x81" "calls\xe2\x96\x81" "begin"),
                                    DS("tool\xe2\x96\x81" "calls\xe2\x96\x81" "end"), DS("tool\xe2\x96\x81" "call\xe2\x96\x81" "begin"),
                                    DS("tool\xe2\x96\x81" "call\xe2\x96\x81" "end"), DS("tool\xe2\x96\x81" "sep"),
                                    DS("tool\xe2\x96\x81outputs\xe2\x96\x81" "begin"), DS("tool\xe2\x96\x81outputs\xe2\x96\x81" "end"),
                                    DS("tool\xe2\x96\x81output\xe2\x96\x81" "begin"), DS("tool\xe2\x96\x81output\xe2\x96\x81" "end"), NULL};

/* 256 single-byte ranks, the kimi pattern, the specials after them. */
static df_tokenizer *make_tokenizer(const char *const *sp) {
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char ranks[256 * 12], *w = ranks;
    for (int b = 0; b < 256; b++)
        w += sprintf(w, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    char cfg[4096];
    int k = sprintf(cfg, "{\"added_tokens_decoder\": {");
    for (int i = 0; sp[i]; i++) k += sprintf(cfg + k, "%s\"%d\": {\"content\": \"%s\"}", i ? ", " : "", 256 + i, sp[i]);
    sprintf(cfg + k, "}}");
    const char *rp = fz_file("ranks.tiktoken", ranks, (size_t)(w - ranks));
    const char *cp = fz_file("tokenizer_config.json", cfg, strlen(cfg));
    df_tokenizer *t;
    char err[DF_ERRMSG];
    if (df_tokenizer_load_tiktoken(rp, "kimi", NULL, cp, &t, err) != DF_OK) fz_die("harness tokenizer: %s", err);
    return t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static df_tokenizer *tok[3];
    if (!tok[0]) {
        tok[0] = make_tokenizer(k3_sp);
        tok[1] = make_tokenizer(k2_sp);
        tok[2] = make_tokenizer(ds_sp);
    }
    if (size < 1) return 0;
    int flags = data[0];
    fz_part p[3] = {{0}};
    int np = fz_split(data + 1, size - 1, p, 3);
    const df_tokenizer *t = tok[((flags >> 1) & 3) % 3];
    int vocab = df_tokenizer_vocab_size(t), small = flags & 8;
    int ceiling = small ? 8 : 4096, ctx = small ? 24 : 4096;
    srv_err e;
    srv_job *j = srv_job_from_request(flags & 1 ? SRV_COMPLETION : SRV_CHAT, (const char *)p[0].p, p[0].n, t, vocab,
                                      ceiling, ctx, "fuzz", &e);
    if (!j) {
        if ((e.status != 400 && e.status != 500) || !e.msg[0]) fz_die("refused with status %d, message '%s'", e.status, e.msg);
        fz_note("%d %s: %s", e.status, e.param, e.msg);
        return 0;
    }
    if (j->prompt.n < 1 || j->max_tokens < 1 || j->max_tokens > ceiling || j->prompt.n + j->max_tokens > ctx)
        fz_die("accepted a prompt of %d tokens with a budget of %d (context %d, ceiling %d)", j->prompt.n, j->max_tokens,
               ctx, ceiling);
    for (int i = 0; i < j->prompt.n; i++)
        if (j->prompt.ids[i] < 0 || j->prompt.ids[i] >= vocab) fz_die("prompt id %d", j->prompt.ids[i]);
    for (int i = 0; i < j->n_bias; i++)
        if (j->bias_id[i] < 0 || j->bias_id[i] >= vocab) fz_die("logit_bias id %d", j->bias_id[i]);
    if (np > 1) srv_out_text(j, DF_CHAT_CONTENT, (const char *)p[1].p, p[1].n);
    if (np > 2) srv_out_tool_call(j, (const char *)p[2].p, p[2].n);
    j->finish = "stop";
    srv_out_finish(j);
    char *r = srv_response_json(j);
    if (!r) fz_die("no response JSON");
    free(r);
    srv_job_free(j);
    return 0;
}
