/* vocab.c — a tokenizer for a synthetic checkpoint (sy_plan_tokenizer).
 *
 * Owns: choosing the ordinary tokens of a source tokenizer that fit the
 * plan's vocabulary, the tiktoken.model text they become, and the
 * tokenizer_config.json that names Kimi K3's special tokens at the ids the
 * plan's config.json uses. The texts live in the plan; sy_write writes both
 * files (before config.json, which is always last). With them `deltafin run
 * --chat` and `deltafin chat` render K3's XTML template (src/text/chat.c
 * picks it because the tokenizer has <|open|>) on a random-weight model.
 *
 * Layout (the Kimi one, K3.md §2.1): vocab V = R ordinary ranks + 256
 * special ids, the specials where config.json's token ids point:
 *
 *   id  0 ........ R-1 | R      R+1    R+2             R+3      ... V-2    V-1
 *       ordinary ranks | [BOS]  [EOS]  <|end_of_msg|>  <|open|> ... [UNK]  [PAD]
 *                        bos           eos (K3, Kimi-Linear; K2's eos is [EOS]) pad
 *
 * Which ordinary tokens: all 256 single bytes (byte-level BPE needs every
 * one), then the multi-byte tokens of lowest source id, R in all, renumbered
 * in source id order. For a tiktoken source whose single bytes are its first
 * 256 ranks (cl100k, o200k, Kimi) that is exactly its first R ranks. A
 * tokenizer.json source becomes a rank file too, ranked by its ids (byte-level
 * BPE vocabularies number tokens in merge order, so tiktoken's "merge the
 * lowest-ranked pair" follows the source's merges closely; decoding is exact
 * whatever the order). The pre-tokenisation is the Kimi pattern, as for every
 * tiktoken.model in a model directory.
 *
 * Refuses (messages name the option): deepseek_v3 (its bos/eos are ids 0 and
 * 1, inside the ordinary ranks), a vocabulary below 512, a source with fewer
 * than V - 256 ordinary tokens, a gzip-compressed source (decompress it
 * first), anything df_tokenizer_load_* refuses.
 *
 * Sections: 1. source  2. ranks  3. tokenizer_config.json  4. sy_plan_tokenizer
 */
#include "synth.h"
#include "../base/err.h"
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- 1. source ---------------------------------------------------------------- */

/* A model directory, a tokenizer.json (*.json), or a tiktoken rank file. */
static df_status load_source(const char *src, df_tokenizer **t, char *err) {
    struct stat sb;
    if (stat(src, &sb) != 0) return df_fail(err, DF_ERR_IO, "--tokenizer %s: no such file or directory", src);
    if (S_ISDIR(sb.st_mode)) return df_tokenizer_load_dir(src, t, err);
    FILE *f = fopen(src, "rb");
    if (!f) return df_fail(err, DF_ERR_IO, "--tokenizer %s: cannot open", src);
    unsigned char magic[2] = {0, 0};
    size_t got = fread(magic, 1, 2, f);
    fclose(f);
    if (got == 2 && magic[0] == 0x1f && magic[1] == 0x8b)
        return df_fail(err, DF_ERR_ARG, "--tokenizer %s is gzip-compressed; decompress it first (gzip -dc %s > FILE)",
                       src, src);
    size_t n = strlen(src);
    if (n >= 5 && !strcmp(src + n - 5, ".json")) return df_tokenizer_load_hf(src, t, err);
    return df_tokenizer_load_tiktoken(src, "kimi", NULL, NULL, t, err);
}

/* ---- 2. ranks ------------------------------------------------------------------- */

typedef struct {
    char *s;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1 << 16;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void sb_base64(sbuf *b, const unsigned char *p, size_t n) {
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char q[4];
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
        q[0] = tab[v >> 18];
        q[1] = tab[(v >> 12) & 63];
        q[2] = i + 1 < n ? tab[(v >> 6) & 63] : '=';
        q[3] = i + 2 < n ? tab[v & 63] : '=';
        sb_put(b, q, 4);
    }
}

/* The R ordinary tokens (every single byte, then the lowest multi-byte ids)
 * as tiktoken.model text: `base64(bytes) rank`, ranks 0..R-1 in source id
 * order. On error nothing is allocated. */
static df_status rank_text(const df_tokenizer *t, const char *src, int R, char **out, size_t *out_n, char *err) {
    int nv = df_tokenizer_vocab_size(t), singles = 0, multi = 0;
    for (int32_t id = 0; id < nv; id++) {
        size_t len;
        if (df_tokenizer_is_special(t, id) || !df_token_bytes(t, id, &len) || !len) continue;
        if (len == 1) singles++;
        else multi++;
    }
    if (singles != 256) /* the loaders guarantee every byte; a byte listed twice would show here */
        return df_fail(err, DF_ERR_FORMAT, "--tokenizer %s: %d single-byte tokens, expected 256", src, singles);
    if (singles + multi < R)
        return df_fail(err, DF_ERR_ARG,
                       "--tokenizer %s has %d ordinary tokens; a vocabulary of %d needs %d (and 256 specials): "
                       "use --vocab %d or less",
                       src, singles + multi, R + 256, R, singles + multi + 256);
    sbuf b = {0};
    int rank = 0, multi_left = R - 256;
    char num[24];
    for (int32_t id = 0; id < nv && rank < R; id++) {
        size_t len;
        const char *p;
        if (df_tokenizer_is_special(t, id) || !(p = df_token_bytes(t, id, &len)) || !len) continue;
        if (len > 1 && multi_left-- <= 0) continue;
        sb_base64(&b, (const unsigned char *)p, len);
        sb_put(&b, num, (size_t)snprintf(num, sizeof num, " %d\n", rank++));
    }
    if (b.oom) {
        free(b.s);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for tiktoken.model");
    }
    *out = b.s;
    *out_n = b.n;
    return DF_OK;
}

/* ---- 3. tokenizer_config.json ---------------------------------------------------- */

/* K3's audited special ids as offsets from the first special (K3.md §2.1);
 * the rest are <|reserved_token_ID|> as tokenization_kimi.py names them. */
static const struct {
    int off;
    const char *text;
} k3_specials[] = {
    {0, "[BOS]"}, {1, "[EOS]"}, {2, "<|end_of_msg|>"}, {3, "<|open|>"}, {4, "<|close|>"}, {5, "<|sep|>"},
    {6, "[start_header_id]"}, {7, "[end_header_id]"}, {9, "[EOT]"}, {18, "<|media_begin|>"},
    {19, "<|media_content|>"}, {20, "<|media_end|>"}, {21, "<|media_pad|>"}, {65, "<osagent_mode>"},
    {254, "[UNK]"}, {255, "[PAD]"},
};

static const char *special_name(int off, int id, char *tmp, size_t cap) {
    for (size_t i = 0; i < sizeof k3_specials / sizeof k3_specials[0]; i++)
        if (k3_specials[i].off == off) return k3_specials[i].text;
    snprintf(tmp, cap, "<|reserved_token_%d|>", id);
    return tmp;
}

/* config.json's bos/eos/pad ids (the root object; K3 repeats them in text_config). */
static df_status config_ids(const sy_plan *p, int ids[3], char *err) {
    json_t *root = json_loads(p->config, 0, NULL);
    static const char *const keys[3] = {"bos_token_id", "eos_token_id", "pad_token_id"};
    df_status st = DF_OK;
    for (int k = 0; k < 3 && st == DF_OK; k++) {
        json_t *v = json_object_get(root, keys[k]);
        if (!json_is_integer(v)) st = df_fail(err, DF_ERR_ARG, "config.json has no %s", keys[k]);
        else ids[k] = (int)json_integer_value(v);
    }
    if (!root) st = df_fail(err, DF_ERR_NOMEM, "out of memory reading config.json back");
    json_decref(root);
    return st;
}

/* The 256 specials from id R, in the spelling transformers writes. */
static char *config_text(const sy_plan *p, int R, const int ids[3]) {
    json_t *root = json_object(), *atd = json_object();
    char key[16], tmp[48];
    for (int off = 0; off < 256; off++) {
        json_t *e = json_object();
        json_object_set_new(e, "content", json_string(special_name(off, R + off, tmp, sizeof tmp)));
        json_object_set_new(e, "lstrip", json_false());
        json_object_set_new(e, "normalized", json_false());
        json_object_set_new(e, "rstrip", json_false());
        json_object_set_new(e, "single_word", json_false());
        json_object_set_new(e, "special", json_true());
        snprintf(key, sizeof key, "%d", R + off);
        json_object_set_new(atd, key, e);
    }
    json_object_set_new(root, "added_tokens_decoder", atd);
    static const char *const names[3] = {"bos_token", "eos_token", "pad_token"};
    for (int k = 0; k < 3; k++)
        json_object_set_new(root, names[k], json_string(special_name(ids[k] - R, ids[k], tmp, sizeof tmp)));
    json_object_set_new(root, "unk_token", json_string("[UNK]"));
    json_object_set_new(root, "clean_up_tokenization_spaces", json_false());
    json_object_set_new(root, "model_max_length", json_integer(p->s.d.max_pos));
    json_object_set_new(root, "tokenizer_class", json_string("TikTokenTokenizer"));
    char *s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_ENSURE_ASCII);
    json_decref(root);
    if (!s) return NULL;
    size_t n = strlen(s);
    char *r = realloc(s, n + 2); /* a final newline, as the other files have */
    if (!r) {
        free(s);
        return NULL;
    }
    r[n] = '\n';
    r[n + 1] = 0;
    return r;
}

/* ---- 4. sy_plan_tokenizer ----------------------------------------------------------- */

df_status sy_plan_tokenizer(sy_plan *p, const char *src, char *err) {
    if (!p || !src || !*src) return df_fail(err, DF_ERR_ARG, "--tokenizer needs a file or directory");
    if (p->o.arch == SY_DEEPSEEK_V3)
        return df_fail(err, DF_ERR_ARG,
                       "--tokenizer is for the Kimi families (kimi_k2, kimi_linear, kimi_k3): deepseek_v3's "
                       "bos/eos ids 0 and 1 fall inside a rank file's ordinary tokens");
    int V = p->s.d.vocab, R = V - 256, ids[3];
    if (V < 512)
        return df_fail(err, DF_ERR_ARG, "--tokenizer needs --vocab 512 or more (256 single bytes + 256 specials; got %d)", V);
    df_status st = config_ids(p, ids, err);
    if (st != DF_OK) return st;
    for (int k = 0; k < 3; k++)
        if (ids[k] < R || ids[k] >= V)
            return df_fail(err, DF_ERR_ARG, "config.json token id %d is not among the specials %d..%d", ids[k], R, V - 1);
    df_tokenizer *t;
    if ((st = load_source(src, &t, err)) != DF_OK) return st;
    char *ranks = NULL, *cfg = NULL;
    size_t nr = 0;
    st = rank_text(t, src, R, &ranks, &nr, err);
    df_tokenizer_free(t);
    if (st != DF_OK) return st;
    if (!(cfg = config_text(p, R, ids))) {
        free(ranks);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for tokenizer_config.json");
    }
    free(p->tok_ranks);
    free(p->tok_config);
    p->tok_ranks = ranks;
    p->tok_ranks_n = nr;
    p->tok_config = cfg;
    char t0[48], t1[48], t2[48];
    snprintf(p->tok_note, sizeof p->tok_note, "%d ranks from %.200s + 256 specials: bos %d %s, eos %d %s, pad %d %s", R, src,
             ids[0], special_name(ids[0] - R, ids[0], t0, sizeof t0), ids[1],
             special_name(ids[1] - R, ids[1], t1, sizeof t1), ids[2], special_name(ids[2] - R, ids[2], t2, sizeof t2));
    return DF_OK;
}
