/* tokenizer.c — byte-level BPE tokenizers (prefix tok_): tiktoken rank files
 * and Hugging Face tokenizer.json, pre-tokenisation through PCRE2, special
 * tokens, decoding.
 *
 * Owns: loading a vocabulary (tiktoken `base64(bytes) rank` lines, or a
 * tokenizer.json BPE model with its ByteLevel alphabet, merges and added
 * tokens), special token spellings (built-in, tokenizer_config.json
 * added_tokens_decoder, tokenizer.json added_tokens), the pre-tokenisation
 * regexes (built-in kimi / o200k / cl100k patterns or a caller's PCRE2
 * pattern; the Split steps of a tokenizer.json), the BPE merge loop and
 * df_tokenize / df_detokenize / df_token_bytes.
 * Refuses: invalid UTF-8 input (names the byte offset), normalizers other
 * than none, pre-tokenizers other than Split/ByteLevel, BPE models with
 * dropout, unk tokens or continuing-subword prefixes, rank files with
 * duplicate ranks or bytes or a missing single byte.
 *
 * How one text is encoded:
 *
 *   text ──(DF_TOK_SPECIAL only) split at special spellings──> segments
 *   segment ──(kimi only) slice: 400,000 code points, runs of whitespace or
 *             non-whitespace cut at 25,000 (tokenization_kimi.py)──> slices
 *   slice ──regex steps (find-all; unmatched gaps stay pieces)──> pieces
 *   piece (bytes) ──whole piece a token? (tiktoken, or HF ignore_merges)──>
 *             else BPE: lowest rank first, leftmost on ties──> ids
 *
 * BPE runs on a doubly linked list of symbols with a binary heap of candidate
 * pairs keyed (rank, left offset); stale heap entries are detected with
 * per-symbol version numbers. Each merge pushes at most two pairs, so a piece
 * of n bytes costs O(n log n) whatever its content (a 400 KB run of one
 * emoji included). tiktoken ranks are the merged bytes' own rank; tokenizer.json
 * ranks are the index of the (left id, right id) merge rule.
 *
 * Sections: 1. small helpers (buffers, hashing, base64, UTF-8)
 *           2. vocabulary tables  3. special tokens  4. patterns and regexes
 *           5. tiktoken loading  6. tokenizer.json loading  7. model dirs
 *           8. BPE  9. pre-tokenisation and df_tokenize  10. decoding
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text.h"
#include "../base/err.h"
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

enum { TK_TIKTOKEN = 1, TK_HF = 2 };
enum { MAX_STEPS = 8, MAX_VOCAB = 1 << 24, MAX_TOKEN_BYTES = 1 << 16 };

typedef struct {
    int32_t id;
    uint32_t len;
    char *text;          /* owned, NUL-terminated */
} special_tok;

typedef struct {
    pcre2_code *re;
    int removed;          /* HF behavior "Removed": matches are dropped */
} re_step;

typedef struct {
    uint64_t key;         /* left id << 32 | right id; 0 = empty (ids are never both 0... see pair_key) */
    int32_t rank, id;
} pair_ent;

typedef struct {
    uint32_t idp1;        /* token id + 1; 0 = empty slot */
    uint32_t hash;
} byte_ent;

struct df_tokenizer {
    int kind;
    int n_vocab;              /* largest id + 1 */
    int n_ranks;              /* ordinary (BPE) tokens */
    uint32_t *off, *len;      /* id -> bytes in arena; len UINT32_MAX: hole */
    char *arena;
    size_t arena_n, arena_cap;
    uint8_t *special_id;      /* per id: 1 if special */
    byte_ent *bh;             /* bytes -> id (ordinary tokens) */
    size_t bh_mask;
    pair_ent *ph;             /* HF merges (left,right) -> rank, result */
    size_t ph_mask;
    int32_t byte_id[256];     /* id of each single byte */
    int ignore_merges;        /* HF: whole-word vocabulary hits skip BPE */
    int whole_piece_lookup;   /* tiktoken: a piece that is a token is that token */
    special_tok *spec;        /* sorted by descending length (longest match first) */
    int n_spec;
    uint8_t spec_first[256];  /* first bytes of special spellings */
    re_step steps[MAX_STEPS];
    int n_steps;
    int kimi_slicing;
    char describe[256];
};

/* ---- 1. small helpers --------------------------------------------------------- */

static uint32_t hash_bytes(const void *p, size_t n) {
    /* FNV-1a, 32-bit; tokens are short */
    const unsigned char *s = p;
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 16777619u;
    return h;
}

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static int b64val(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Decodes standard base64 (with '=' padding) into out; returns the length or -1. */
static long b64_decode(const char *s, size_t n, unsigned char *out, size_t cap) {
    if (n == 0 || n % 4) return -1;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4];
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == n && k >= 2) { v[k] = 0; pad++; continue; }
            if (pad) return -1;
            v[k] = b64val((unsigned char)s[i + k]);
            if (v[k] < 0) return -1;
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        unsigned char b[3] = {(unsigned char)(w >> 16), (unsigned char)(w >> 8), (unsigned char)w};
        int nb = 3 - pad;
        if (o + (size_t)nb > cap) return -1;
        memcpy(out + o, b, (size_t)nb);
        o += (size_t)nb;
    }
    return (long)o;
}

int tok_utf8_step(const unsigned char *p, size_t n, uint32_t *cp) {
    unsigned c = p[0];
    if (c < 0x80) { *cp = c; return 1; }
    int need;
    uint32_t v;
    unsigned lo = 0x80, hi = 0xBF;  /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) { need = 1; v = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 2; v = c & 0x0F;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;   /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 3; v = c & 0x07;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return -1;
    for (int k = 1; k <= need; k++) {
        if ((size_t)k >= n) return 0;
        unsigned b = p[k];
        unsigned l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (b < l || b > h) return -k;
        v = v << 6 | (b & 0x3F);
    }
    *cp = v;
    return need + 1;
}

size_t tok_utf8_check(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x80) { i++; continue; }
        uint32_t cp;
        int k = tok_utf8_step((const unsigned char *)s + i, n - i, &cp);
        if (k <= 0) return i;
        i += (size_t)k;
    }
    return n;
}

int tok_utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12); out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18); out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

void df_tokens_free(df_tokens *t) {
    if (!t) return;
    free(t->ids);
    t->ids = NULL;
    t->n = t->cap = 0;
}

static int tokens_reserve(df_tokens *t, int extra) {
    if (extra > INT_MAX - t->n) return -1;
    if (t->n + extra <= t->cap) return 0;
    int cap = t->cap ? t->cap : 64;
    while (cap < t->n + extra) cap = cap > INT_MAX / 2 ? INT_MAX : cap * 2;
    int32_t *v = realloc(t->ids, (size_t)cap * sizeof *v);
    if (!v) return -1;
    t->ids = v;
    t->cap = cap;
    return 0;
}

df_status df_tokens_push(df_tokens *t, int32_t id) {
    if (tokens_reserve(t, 1)) return DF_ERR_NOMEM;
    t->ids[t->n++] = id;
    return DF_OK;
}

static char *xstrndup(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (p) { memcpy(p, s, n); p[n] = 0; }
    return p;
}

/* ---- 2. vocabulary tables ------------------------------------------------------- */

static df_tokenizer *tk_new(int kind, int n_vocab) {
    df_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->kind = kind;
    t->n_vocab = n_vocab;
    t->off = malloc((size_t)n_vocab * sizeof *t->off);
    t->len = malloc((size_t)n_vocab * sizeof *t->len);
    t->special_id = calloc((size_t)n_vocab, 1);
    if (!t->off || !t->len || !t->special_id) { df_tokenizer_free(t); return NULL; }
    for (int i = 0; i < n_vocab; i++) { t->off[i] = 0; t->len[i] = UINT32_MAX; }
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
    return t;
}

/* Grows the id tables to n_vocab ids (new ids are holes). */
static int tk_grow(df_tokenizer *t, int n_vocab) {
    if (n_vocab <= t->n_vocab) return 0;
    uint32_t *o = realloc(t->off, (size_t)n_vocab * sizeof *o);
    if (!o) return -1;
    t->off = o;
    uint32_t *l = realloc(t->len, (size_t)n_vocab * sizeof *l);
    if (!l) return -1;
    t->len = l;
    uint8_t *s = realloc(t->special_id, (size_t)n_vocab);
    if (!s) return -1;
    t->special_id = s;
    for (int i = t->n_vocab; i < n_vocab; i++) { t->off[i] = 0; t->len[i] = UINT32_MAX; t->special_id[i] = 0; }
    t->n_vocab = n_vocab;
    return 0;
}

/* Stores the bytes of token id (replacing earlier bytes). */
static int tk_set_bytes(df_tokenizer *t, int32_t id, const void *b, size_t n) {
    if (n > MAX_TOKEN_BYTES) return -1;
    if (t->arena_n + n > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap : 1 << 16;
        while (cap < t->arena_n + n) cap *= 2;
        if (cap > UINT32_MAX) return -1;
        char *a = realloc(t->arena, cap);
        if (!a) return -1;
        t->arena = a;
        t->arena_cap = cap;
    }
    memcpy(t->arena + t->arena_n, b, n);
    t->off[id] = (uint32_t)t->arena_n;
    t->len[id] = (uint32_t)n;
    t->arena_n += n;
    return 0;
}

static int bh_init(df_tokenizer *t, int n) {
    size_t cap = 1024;
    while (cap < (size_t)n * 2) cap *= 2;
    t->bh = calloc(cap, sizeof *t->bh);
    if (!t->bh) return -1;
    t->bh_mask = cap - 1;
    return 0;
}

/* Id of the ordinary token with these bytes, or -1. */
static int32_t bh_find(const df_tokenizer *t, const void *b, size_t n) {
    uint32_t h = hash_bytes(b, n);
    for (size_t i = h & t->bh_mask;; i = (i + 1) & t->bh_mask) {
        const byte_ent *e = &t->bh[i];
        if (!e->idp1) return -1;
        if (e->hash == h) {
            uint32_t id = e->idp1 - 1;
            if (t->len[id] == n && !memcmp(t->arena + t->off[id], b, n)) return (int32_t)id;
        }
    }
}

/* Adds id under its stored bytes; returns the id already there, or -1 if new. */
static int32_t bh_add(df_tokenizer *t, int32_t id) {
    const char *b = t->arena + t->off[id];
    size_t n = t->len[id];
    uint32_t h = hash_bytes(b, n);
    for (size_t i = h & t->bh_mask;; i = (i + 1) & t->bh_mask) {
        byte_ent *e = &t->bh[i];
        if (!e->idp1) { e->idp1 = (uint32_t)id + 1; e->hash = h; return -1; }
        if (e->hash == h) {
            uint32_t o = e->idp1 - 1;
            if (t->len[o] == n && !memcmp(t->arena + t->off[o], b, n)) return (int32_t)o;
        }
    }
}

/* Pair keys add 1 to each id so that 0 marks an empty slot. */
static uint64_t pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)(a + 1) << 32) | (uint32_t)(b + 1); }

static const pair_ent *ph_find(const df_tokenizer *t, int32_t a, int32_t b) {
    uint64_t k = pair_key(a, b);
    for (size_t i = mix64(k) & t->ph_mask;; i = (i + 1) & t->ph_mask) {
        const pair_ent *e = &t->ph[i];
        if (!e->key) return NULL;
        if (e->key == k) return e;
    }
}

/* ---- 3. special tokens --------------------------------------------------------- */

/* Adds or respells the special token at id (growing the vocabulary). */
static int spec_set(df_tokenizer *t, int32_t id, const char *text, size_t n) {
    if (id < 0 || id >= MAX_VOCAB || n == 0 || n > 1024) return -1;
    if (tk_grow(t, id + 1)) return -1;
    for (int i = 0; i < t->n_spec; i++)
        if (t->spec[i].id == id) {
            char *s = xstrndup(text, n);
            if (!s) return -1;
            free(t->spec[i].text);
            t->spec[i].text = s;
            t->spec[i].len = (uint32_t)n;
            return tk_set_bytes(t, id, text, n);
        }
    special_tok *v = realloc(t->spec, (size_t)(t->n_spec + 1) * sizeof *v);
    if (!v) return -1;
    t->spec = v;
    char *s = xstrndup(text, n);
    if (!s) return -1;
    t->spec[t->n_spec++] = (special_tok){id, (uint32_t)n, s};
    t->special_id[id] = 1;
    return tk_set_bytes(t, id, text, n);
}

static int spec_cmp(const void *a, const void *b) {
    const special_tok *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* Sorts for longest-match scanning and fills the first-byte table. */
static void spec_finish(df_tokenizer *t) {
    if (t->n_spec) qsort(t->spec, (size_t)t->n_spec, sizeof *t->spec, spec_cmp);
    memset(t->spec_first, 0, sizeof t->spec_first);
    for (int i = 0; i < t->n_spec; i++) t->spec_first[(unsigned char)t->spec[i].text[0]] = 1;
}

/* Applies tokenizer_config.json's added_tokens_decoder ({"id": {"content": ...}}). */
static df_status spec_from_config(df_tokenizer *t, const char *path, char *err) {
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) return df_fail(err, DF_ERR_FORMAT, "%s: line %d: %s", path, je.line, je.text);
    df_status st = DF_OK;
    json_t *atd = json_object_get(root, "added_tokens_decoder");
    if (atd && !json_is_object(atd)) {
        st = df_fail(err, DF_ERR_FORMAT, "%s: added_tokens_decoder is not an object", path);
        goto done;
    }
    const char *key;
    json_t *v;
    json_object_foreach(atd, key, v) {
        char *end;
        errno = 0;
        long id = strtol(key, &end, 10);
        json_t *c = json_is_object(v) ? json_object_get(v, "content") : NULL;
        if (errno || end == key || *end || id < 0 || id >= MAX_VOCAB || !json_is_string(c) ||
            json_string_length(c) == 0) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: added_tokens_decoder entry \"%s\" needs a numeric id and a non-empty content",
                         path, key);
            goto done;
        }
        if (id < t->n_ranks) continue; /* an ordinary token listed again: its bytes stay */
        if (spec_set(t, (int32_t)id, json_string_value(c), json_string_length(c))) {
            st = df_fail(err, DF_ERR_NOMEM, "%s: out of memory", path);
            goto done;
        }
    }
done:
    json_decref(root);
    return st;
}

int32_t df_tokenizer_special(const df_tokenizer *t, const char *text) {
    if (!t || !text) return -1;
    size_t n = strlen(text);
    for (int i = 0; i < t->n_spec; i++)
        if (t->spec[i].len == n && !memcmp(t->spec[i].text, text, n)) return t->spec[i].id;
    return -1;
}

int df_tokenizer_is_special(const df_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_vocab && t->special_id[id];
}

/* ---- 4. patterns and regexes ------------------------------------------------------ */

/* Published patterns, as js-tiktoken 1.0.x ships them (capture groups made
 * non-capturing; that changes nothing about what matches). */
static const char pat_cl100k[] =
    "(?:'s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)"
    "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

#define O200K_CONTRACTIONS "(?:'s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)?"
static const char pat_o200k[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+" O200K_CONTRACTIONS
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" O200K_CONTRACTIONS
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* Kimi (tokenization_kimi.py, ../shared/K3.md §2.2). Python's class
 * intersection [X&&[^\p{Han}]] is written (?:(?!\p{Han})[X]): one character
 * of X that is not Han. PCRE2's own lookahead gives \s+(?!\S) the same
 * meaning as Python's regex module. */
#define KIMI_UPPER "(?:(?!\\p{Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])"
#define KIMI_LOWER "(?:(?!\\p{Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])"
#define KIMI_CONTRACTIONS "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
static const char pat_kimi[] =
    "[\\p{Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?" KIMI_UPPER "*" KIMI_LOWER "+" KIMI_CONTRACTIONS
    "|[^\\r\\n\\p{L}\\p{N}]?" KIMI_UPPER "+" KIMI_LOWER "*" KIMI_CONTRACTIONS
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static df_status add_step(df_tokenizer *t, const char *pat, size_t n, int removed, const char *what,
                          char *err) {
    if (t->n_steps == MAX_STEPS)
        return df_fail(err, DF_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizer regexes", what, MAX_STEPS);
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, n, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return df_fail(err, DF_ERR_FORMAT, "%s: pattern does not compile at offset %zu: %s", what,
                       (size_t)eo, (const char *)msg);
    }
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter is the fallback */
    t->steps[t->n_steps++] = (re_step){re, removed};
    return DF_OK;
}

/* ---- 5. tiktoken loading ----------------------------------------------------------- */

static char *read_file(const char *path, size_t *n, size_t limit, char *err, df_status *st) {
    FILE *f = fopen(path, "rb");
    if (!f) { *st = df_fail(err, DF_ERR_IO, "%s: %s", path, strerror(errno)); return NULL; }
    size_t cap = 1 << 20, len = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (!buf) { fclose(f); *st = df_fail(err, DF_ERR_NOMEM, "%s: out of memory", path); return NULL; }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (len < cap) break;
        if (cap >= limit) { free(buf); fclose(f); *st = df_fail(err, DF_ERR_FORMAT, "%s: larger than %zu bytes", path, limit); return NULL; }
        cap *= 2;
        char *nb = realloc(buf, cap + 1);
        if (!nb) free(buf);
        buf = nb;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) { free(buf); *st = df_fail(err, DF_ERR_IO, "%s: read error", path); return NULL; }
    buf[len] = 0;
    *n = len;
    return buf;
}

typedef struct {
    const char *name, *pat;
    int kimi;
    const char *spec[6];
    int spec_id[6];
} builtin_pattern;

static const builtin_pattern builtins[] = {
    {"kimi", pat_kimi, 1, {NULL}, {0}},
    {"o200k", pat_o200k, 0, {"<|endoftext|>", "<|endofprompt|>", NULL}, {199999, 200018}},
    {"cl100k", pat_cl100k, 0,
     {"<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|endofprompt|>", NULL},
     {100257, 100258, 100259, 100260, 100276}},
};

static df_status parse_ranks(df_tokenizer **out, const char *path, char *err) {
    df_status st = DF_OK;
    size_t n;
    char *buf = read_file(path, &n, (size_t)1 << 30, err, &st);
    if (!buf) return st;
    /* count lines to size the tables */
    size_t lines = 0;
    for (size_t i = 0; i < n; i++) lines += buf[i] == '\n';
    if (lines + 1 > (size_t)MAX_VOCAB) { free(buf); return df_fail(err, DF_ERR_FORMAT, "%s: too many lines", path); }
    df_tokenizer *t = tk_new(TK_TIKTOKEN, 1);
    if (!t || bh_init(t, (int)lines + 1)) { free(buf); df_tokenizer_free(t); return df_fail(err, DF_ERR_NOMEM, "%s: out of memory", path); }
    unsigned char tokb[3 * 1024];
    size_t lineno = 0, count = 0;
    char *p = buf, *end = buf + n;
    int max_rank = -1;
    while (p < end) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        char *le = nl ? nl : end;
        lineno++;
        char *q = le;
        if (q > p && q[-1] == '\r') q--;
        if (q == p) { p = le + 1; continue; } /* blank line */
        char *sp = memchr(p, ' ', (size_t)(q - p));
        if (!sp) { st = df_fail(err, DF_ERR_FORMAT, "%s:%zu: expected 'base64 rank'", path, lineno); goto fail; }
        long nb = b64_decode(p, (size_t)(sp - p), tokb, sizeof tokb);
        if (nb <= 0) { st = df_fail(err, DF_ERR_FORMAT, "%s:%zu: bad base64 token", path, lineno); goto fail; }
        char *re;
        errno = 0;
        long r = strtol(sp + 1, &re, 10);
        if (errno || re != q || sp + 1 == q || r < 0 || r >= MAX_VOCAB - 1024) {
            st = df_fail(err, DF_ERR_FORMAT, "%s:%zu: bad rank", path, lineno);
            goto fail;
        }
        if (r >= t->n_vocab && tk_grow(t, (int)(r + 1 > 2 * t->n_vocab ? r + 1 : 2 * t->n_vocab))) {
            st = df_fail(err, DF_ERR_NOMEM, "%s: out of memory", path);
            goto fail;
        }
        if (t->len[r] != UINT32_MAX) { st = df_fail(err, DF_ERR_FORMAT, "%s:%zu: rank %ld appears twice", path, lineno, r); goto fail; }
        if (tk_set_bytes(t, (int32_t)r, tokb, (size_t)nb)) { st = df_fail(err, DF_ERR_NOMEM, "%s: out of memory", path); goto fail; }
        if (bh_add(t, (int32_t)r) >= 0) { st = df_fail(err, DF_ERR_FORMAT, "%s:%zu: token bytes of rank %ld appear twice", path, lineno, r); goto fail; }
        if (nb == 1) t->byte_id[tokb[0]] = (int32_t)r;
        if (r > max_rank) max_rank = (int)r;
        count++;
        p = le + 1;
    }
    if (!count) { st = df_fail(err, DF_ERR_FORMAT, "%s: no ranks", path); goto fail; }
    for (int b = 0; b < 256; b++)
        if (t->byte_id[b] < 0) { st = df_fail(err, DF_ERR_FORMAT, "%s: no rank for the single byte 0x%02x", path, b); goto fail; }
    t->n_vocab = max_rank + 1; /* shrink the logical size; capacity stays */
    t->n_ranks = max_rank + 1;
    free(buf);
    *out = t;
    return DF_OK;
fail:
    free(buf);
    df_tokenizer_free(t);
    return st;
}

df_status df_tokenizer_load_tiktoken(const char *rank_file, const char *pattern, const char *regex,
                                     const char *config_json, df_tokenizer **out, char err[DF_ERRMSG]) {
    *out = NULL;
    if (!rank_file) return df_fail(err, DF_ERR_ARG, "no rank file given");
    const builtin_pattern *bp = NULL;
    if (!regex) {
        const char *name = pattern ? pattern : "kimi";
        for (size_t i = 0; i < sizeof builtins / sizeof *builtins; i++)
            if (!strcmp(builtins[i].name, name)) bp = &builtins[i];
        if (!bp) return df_fail(err, DF_ERR_ARG, "unknown pattern '%s' (built-in: kimi, o200k, cl100k)", name);
    }
    df_tokenizer *t;
    df_status st = parse_ranks(&t, rank_file, err);
    if (st != DF_OK) return st;
    t->whole_piece_lookup = 1;
    st = add_step(t, regex ? regex : bp->pat, PCRE2_ZERO_TERMINATED, 0, regex ? "--pattern-file regex" : bp->name, err);
    if (st != DF_OK) goto fail;
    if (bp && bp->kimi) {
        /* tokenization_kimi.py: 256 reserved specials right after the ranks */
        t->kimi_slicing = 1;
        /* the tables grow once, not once per special (a rank file ending at a
         * large rank made 256 copies of them: a fuzzing timeout) */
        if (tk_grow(t, t->n_ranks + 256)) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto fail; }
        for (int i = 0; i < 256; i++) {
            char name[48];
            int id = t->n_ranks + i;
            int k = snprintf(name, sizeof name, "<|reserved_token_%d|>", id);
            if (spec_set(t, id, name, (size_t)k)) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto fail; }
        }
    } else if (bp) {
        for (int i = 0; bp->spec[i]; i++) {
            if (bp->spec_id[i] < t->n_ranks) continue; /* not this rank file's vocabulary */
            if (spec_set(t, bp->spec_id[i], bp->spec[i], strlen(bp->spec[i]))) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto fail; }
        }
    }
    if (config_json && (st = spec_from_config(t, config_json, err)) != DF_OK) goto fail;
    spec_finish(t);
    snprintf(t->describe, sizeof t->describe, "tiktoken %s, pattern %s, %d ranks, %d special tokens, vocab %d",
             rank_file, regex ? "(custom)" : bp->name, t->n_ranks, t->n_spec, t->n_vocab);
    *out = t;
    return DF_OK;
fail:
    df_tokenizer_free(t);
    return st;
}

/* ---- 6. tokenizer.json loading ------------------------------------------------------ */

/* GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68
 * to U+0100.. in byte order. byte_of_cp inverts it. */
static void bytelevel_tables(uint32_t cp_of_byte[256], int byte_of_cp[512]) {
    int n = 0;
    for (int i = 0; i < 512; i++) byte_of_cp[i] = -1;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        cp_of_byte[b] = keep ? (uint32_t)b : (uint32_t)(256 + n++);
        byte_of_cp[cp_of_byte[b]] = b;
    }
}

/* Converts a ByteLevel vocabulary string to raw bytes; -1 if a character is
 * outside the alphabet. */
static long bytelevel_decode(const char *s, size_t n, const int byte_of_cp[512], unsigned char *out, size_t cap) {
    size_t i = 0, o = 0;
    while (i < n) {
        uint32_t cp;
        int k = tok_utf8_step((const unsigned char *)s + i, n - i, &cp);
        if (k <= 0 || cp >= 512 || byte_of_cp[cp] < 0 || o == cap) return -1;
        out[o++] = (unsigned char)byte_of_cp[cp];
        i += (size_t)k;
    }
    return (long)o;
}

static const char *jstr(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static int jtrue(json_t *o, const char *k) { return json_is_true(json_object_get(o, k)); }

/* One pre_tokenizer entry (not a Sequence). */
static df_status hf_pretok(df_tokenizer *t, json_t *p, const char *path, int *saw_bytelevel, char *err) {
    const char *type = jstr(p, "type");
    if (!type) return df_fail(err, DF_ERR_FORMAT, "%s: pre_tokenizer without a type", path);
    if (!strcmp(type, "ByteLevel")) {
        if (jtrue(p, "add_prefix_space"))
            return df_fail(err, DF_ERR_UNSUPPORTED, "%s: pre_tokenizer ByteLevel with add_prefix_space is not supported", path);
        if (!json_is_false(json_object_get(p, "use_regex"))) {
            /* ByteLevel's own GPT-2 split */
            static const char gpt2[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
            df_status st = add_step(t, gpt2, PCRE2_ZERO_TERMINATED, 0, "ByteLevel use_regex", err);
            if (st != DF_OK) return st;
        }
        *saw_bytelevel = 1;
        return DF_OK;
    }
    if (!strcmp(type, "Split")) {
        json_t *pat = json_object_get(p, "pattern");
        const char *beh = jstr(p, "behavior");
        if (jtrue(p, "invert"))
            return df_fail(err, DF_ERR_UNSUPPORTED, "%s: pre_tokenizer Split with invert=true is not supported", path);
        if (!beh || (strcmp(beh, "Isolated") && strcmp(beh, "Removed")))
            return df_fail(err, DF_ERR_UNSUPPORTED, "%s: pre_tokenizer Split behavior '%s' is not supported (Isolated, Removed are)",
                           path, beh ? beh : "(none)");
        const char *rx = jstr(pat, "Regex"), *lit = jstr(pat, "String");
        if (rx) return add_step(t, rx, PCRE2_ZERO_TERMINATED, !strcmp(beh, "Removed"), path, err);
        if (lit) {
            /* a literal: quote it with \Q...\E (an embedded \E is split out) */
            size_t n = strlen(lit);
            char *q = malloc(n * 6 + 8), *w = q;
            if (!q) return df_fail(err, DF_ERR_NOMEM, "out of memory");
            w += sprintf(w, "\\Q");
            for (size_t i = 0; i < n; i++) {
                if (lit[i] == '\\' && lit[i + 1] == 'E') { w += sprintf(w, "\\E\\\\\\Q"); continue; }
                *w++ = lit[i];
            }
            w += sprintf(w, "\\E");
            df_status st = add_step(t, q, (size_t)(w - q), !strcmp(beh, "Removed"), path, err);
            free(q);
            return st;
        }
        return df_fail(err, DF_ERR_FORMAT, "%s: pre_tokenizer Split without a Regex or String pattern", path);
    }
    return df_fail(err, DF_ERR_UNSUPPORTED, "%s: pre_tokenizer type '%s' is not supported (Sequence, Split, ByteLevel are)", path, type);
}

df_status df_tokenizer_load_hf(const char *path, df_tokenizer **out, char err[DF_ERRMSG]) {
    *out = NULL;
    if (!path) return df_fail(err, DF_ERR_ARG, "no tokenizer.json given");
    json_error_t je;
    size_t flen;
    df_status st = DF_OK;
    char *ftext = read_file(path, &flen, (size_t)1 << 30, err, &st); /* json_loadb: much faster than getc */
    if (!ftext) return st;
    json_t *root = json_loadb(ftext, flen, 0, &je);
    free(ftext);
    if (!root) return df_fail(err, DF_ERR_FORMAT, "%s: line %d: %s", path, je.line, je.text);
    df_tokenizer *t = NULL;
    int32_t *foreign = NULL; /* vocab ids whose strings are not ByteLevel */
    int n_foreign = 0;
    unsigned char tb[4096];
    uint32_t cp_of_byte[256];
    int byte_of_cp[512];
    bytelevel_tables(cp_of_byte, byte_of_cp);

    json_t *model = json_object_get(root, "model");
    const char *mtype = jstr(model, "type");
    if (!json_is_object(model)) { st = df_fail(err, DF_ERR_FORMAT, "%s: no model object", path); goto done; }
    if (mtype && strcmp(mtype, "BPE")) { st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: model type '%s' is not supported (BPE is)", path, mtype); goto done; }
    json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    if (!json_is_object(vocab) || !json_is_array(merges)) { st = df_fail(err, DF_ERR_FORMAT, "%s: model needs vocab (object) and merges (array)", path); goto done; }
    json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout)) { st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: model.dropout is not supported", path); goto done; }
    if (jstr(model, "continuing_subword_prefix") || jstr(model, "end_of_word_suffix")) {
        st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: model.continuing_subword_prefix / end_of_word_suffix are not supported", path);
        goto done;
    }
    if (jtrue(model, "byte_fallback")) { st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: model.byte_fallback is not supported (ByteLevel BPE only)", path); goto done; }

    /* normalizer: none, or a Sequence that is empty */
    json_t *norm = json_object_get(root, "normalizer");
    if (norm && !json_is_null(norm)) {
        const char *nt = jstr(norm, "type");
        json_t *ns = json_object_get(norm, "normalizers");
        if (!nt || strcmp(nt, "Sequence") || !json_is_array(ns) || json_array_size(ns)) {
            const char *which = nt ? nt : "(no type)";
            if (nt && !strcmp(nt, "Sequence") && json_array_size(ns)) which = jstr(json_array_get(ns, 0), "type");
            st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: normalizer '%s' is not supported (only none or an empty Sequence)",
                         path, which ? which : "?");
            goto done;
        }
    }

    /* vocabulary */
    int max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= MAX_VOCAB) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: vocab entry has a bad id", path);
            goto done;
        }
        if (json_integer_value(v) > max_id) max_id = (int)json_integer_value(v);
    }
    if (max_id < 0) { st = df_fail(err, DF_ERR_FORMAT, "%s: empty vocab", path); goto done; }
    t = tk_new(TK_HF, max_id + 1);
    if (!t || bh_init(t, max_id + 1)) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    t->n_ranks = max_id + 1;
    json_object_foreach(vocab, key, v) {
        int id = (int)json_integer_value(v);
        long nb = bytelevel_decode(key, strlen(key), byte_of_cp, tb, sizeof tb);
        if (nb <= 0) {
            /* an added token listed in the vocab too (DeepSeek's <｜begin▁of▁sentence｜>):
             * its bytes come from added_tokens below, which must name it */
            int32_t *nv = realloc(foreign, (size_t)(n_foreign + 1) * sizeof *nv);
            if (!nv) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
            foreign = nv;
            foreign[n_foreign++] = id;
            continue;
        }
        if (t->len[id] != UINT32_MAX) { st = df_fail(err, DF_ERR_FORMAT, "%s: vocab id %d appears twice", path, id); goto done; }
        if (tk_set_bytes(t, id, tb, (size_t)nb)) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
        if (bh_add(t, id) >= 0) { st = df_fail(err, DF_ERR_FORMAT, "%s: vocab entry \"%.40s\" appears twice", path, key); goto done; }
        if (nb == 1) t->byte_id[tb[0]] = id;
    }
    for (int b = 0; b < 256; b++)
        if (t->byte_id[b] < 0) { st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: the vocab lacks the byte 0x%02x (byte-level BPE needs all 256)", path, b); goto done; }
    t->ignore_merges = jtrue(model, "ignore_merges");

    /* merges: "a b" strings or [a, b] pairs; rank = index */
    size_t nm = json_array_size(merges), cap = 1024;
    while (cap < nm * 2 + 2) cap *= 2;
    t->ph = calloc(cap, sizeof *t->ph);
    if (!t->ph) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    t->ph_mask = cap - 1;
    for (size_t i = 0; i < nm; i++) {
        json_t *m = json_array_get(merges, i);
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        if (json_is_string(m)) {
            const char *s = json_string_value(m), *sp = strchr(s, ' ');
            if (sp && !strchr(sp + 1, ' ')) { a = s; la = (size_t)(sp - s); b = sp + 1; lb = strlen(b); }
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0)); la = strlen(a);
            b = json_string_value(json_array_get(m, 1)); lb = strlen(b);
        }
        if (!a || !la || !lb) { st = df_fail(err, DF_ERR_FORMAT, "%s: merges[%zu] is not a pair of tokens", path, i); goto done; }
        long na = bytelevel_decode(a, la, byte_of_cp, tb, sizeof tb / 2);
        long nb2 = na > 0 ? bytelevel_decode(b, lb, byte_of_cp, tb + na, sizeof tb / 2) : -1;
        int32_t ia = na > 0 ? bh_find(t, tb, (size_t)na) : -1;
        int32_t ib = nb2 > 0 ? bh_find(t, tb + na, (size_t)nb2) : -1;
        int32_t ir = nb2 > 0 ? bh_find(t, tb, (size_t)(na + nb2)) : -1;
        if (ia < 0 || ib < 0 || ir < 0) { st = df_fail(err, DF_ERR_FORMAT, "%s: merges[%zu] names a token that is not in the vocab", path, i); goto done; }
        uint64_t k = pair_key(ia, ib);
        for (size_t h = mix64(k) & t->ph_mask;; h = (h + 1) & t->ph_mask) {
            if (!t->ph[h].key) { t->ph[h] = (pair_ent){k, (int32_t)i, ir}; break; }
            if (t->ph[h].key == k) break; /* a repeated rule: the first (lowest) rank wins */
        }
    }

    /* added tokens: specials (matched only under DF_TOK_SPECIAL) */
    json_t *added = json_object_get(root, "added_tokens");
    size_t ai;
    json_array_foreach(added, ai, v) {
        json_t *idv = json_object_get(v, "id");
        const char *c = jstr(v, "content");
        if (!json_is_integer(idv) || !c || !*c || json_integer_value(idv) < 0 || json_integer_value(idv) >= MAX_VOCAB) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: added_tokens[%zu] needs an id and a content", path, ai);
            goto done;
        }
        int id = (int)json_integer_value(idv);
        /* an added token that is also a BPE vocab entry keeps its vocab entry
         * for BPE; its decoded bytes become the added spelling (the same text
         * for every tokenizer.json seen) */
        if (spec_set(t, id, c, strlen(c))) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    }
    spec_finish(t);
    for (int i = 0; i < n_foreign; i++)
        if (!t->special_id[foreign[i]]) {
            const char *k2;
            json_t *v2;
            json_object_foreach(vocab, k2, v2) if (json_integer_value(v2) == foreign[i]) break;
            st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: vocab entry \"%.40s\" is not in the ByteLevel alphabet nor an added token (only ByteLevel BPE is supported)",
                         path, k2 ? k2 : "?");
            goto done;
        }

    /* pre-tokenizer */
    json_t *pre = json_object_get(root, "pre_tokenizer");
    int saw_bl = 0;
    if (!pre || json_is_null(pre)) { st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: no pre_tokenizer (a ByteLevel one is required)", path); goto done; }
    const char *ptype = jstr(pre, "type");
    if (ptype && !strcmp(ptype, "Sequence")) {
        json_t *seq = json_object_get(pre, "pretokenizers");
        size_t k;
        json_t *p;
        json_array_foreach(seq, k, p) {
            if (saw_bl) { st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: pre_tokenizer steps after ByteLevel are not supported", path); goto done; }
            if ((st = hf_pretok(t, p, path, &saw_bl, err)) != DF_OK) goto done;
        }
    } else if ((st = hf_pretok(t, pre, path, &saw_bl, err)) != DF_OK) goto done;
    if (!saw_bl) { st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: pre_tokenizer has no ByteLevel step (only byte-level BPE is supported)", path); goto done; }
    json_t *dec = json_object_get(root, "decoder");
    const char *dtype = jstr(dec, "type");
    if (dec && !json_is_null(dec) && (!dtype || strcmp(dtype, "ByteLevel"))) {
        st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: decoder '%s' is not supported (ByteLevel is)", path, dtype ? dtype : "?");
        goto done;
    }
    snprintf(t->describe, sizeof t->describe, "tokenizer.json %s, byte-level BPE, %d tokens, %zu merges, %d added tokens, %d regex steps",
             path, t->n_ranks, nm, t->n_spec, t->n_steps);
done:
    json_decref(root);
    free(foreign);
    if (st != DF_OK) { df_tokenizer_free(t); return st; }
    *out = t;
    return DF_OK;
}

/* ---- 7. model dirs -------------------------------------------------------------- */

df_status df_tokenizer_load_dir(const char *dir, df_tokenizer **out, char err[DF_ERRMSG]) {
    *out = NULL;
    if (!dir) return df_fail(err, DF_ERR_ARG, "no model directory given");
    char tk[4096], cfg[4096], hf[4096];
    snprintf(tk, sizeof tk, "%s/tiktoken.model", dir);
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    snprintf(hf, sizeof hf, "%s/tokenizer.json", dir);
    FILE *f;
    if ((f = fopen(tk, "rb"))) {
        fclose(f);
        FILE *c = fopen(cfg, "rb");
        if (c) fclose(c);
        return df_tokenizer_load_tiktoken(tk, "kimi", NULL, c ? cfg : NULL, out, err);
    }
    if ((f = fopen(hf, "rb"))) {
        fclose(f);
        return df_tokenizer_load_hf(hf, out, err);
    }
    return df_fail(err, DF_ERR_IO, "%s: no tokenizer (neither tiktoken.model nor tokenizer.json)", dir);
}

void df_tokenizer_free(df_tokenizer *t) {
    if (!t) return;
    for (int i = 0; i < t->n_steps; i++) pcre2_code_free(t->steps[i].re);
    for (int i = 0; i < t->n_spec; i++) free(t->spec[i].text);
    free(t->spec);
    free(t->off);
    free(t->len);
    free(t->special_id);
    free(t->arena);
    free(t->bh);
    free(t->ph);
    free(t);
}

int df_tokenizer_vocab_size(const df_tokenizer *t) { return t ? t->n_vocab : 0; }
const char *df_tokenizer_describe(const df_tokenizer *t) { return t ? t->describe : ""; }

const char *df_token_bytes(const df_tokenizer *t, int32_t id, size_t *len) {
    if (!t || id < 0 || id >= t->n_vocab || t->len[id] == UINT32_MAX) { if (len) *len = 0; return NULL; }
    if (len) *len = t->len[id];
    return t->arena + t->off[id];
}

/* ---- 8. BPE ----------------------------------------------------------------------- */

typedef struct {
    uint64_t key;       /* rank << 32 | left symbol index (leftmost wins ties) */
    int32_t right;
    uint32_t vl, vr;    /* versions of the two symbols when the pair was seen */
    int32_t id;         /* id of the merged token */
} heap_ent;

/* Per-call scratch, grown to the longest piece. */
typedef struct {
    int32_t *id, *prev, *next;
    uint32_t *end, *ver;
    heap_ent *heap;
    size_t cap, heap_cap, heap_n;
} bpe_scratch;

static void scratch_free(bpe_scratch *s) {
    free(s->id); free(s->prev); free(s->next); free(s->end); free(s->ver); free(s->heap);
}

static int scratch_reserve(bpe_scratch *s, size_t n) {
    if (n <= s->cap) return 0;
    size_t cap = s->cap ? s->cap : 256;
    while (cap < n) cap *= 2;
    int32_t *a = realloc(s->id, cap * sizeof *a); if (!a) return -1; s->id = a;
    a = realloc(s->prev, cap * sizeof *a); if (!a) return -1; s->prev = a;
    a = realloc(s->next, cap * sizeof *a); if (!a) return -1; s->next = a;
    uint32_t *u = realloc(s->end, cap * sizeof *u); if (!u) return -1; s->end = u;
    u = realloc(s->ver, cap * sizeof *u); if (!u) return -1; s->ver = u;
    heap_ent *h = realloc(s->heap, 3 * cap * sizeof *h); if (!h) return -1; s->heap = h;
    s->cap = cap;
    s->heap_cap = 3 * cap;
    return 0;
}

static void heap_push(bpe_scratch *s, heap_ent e) {
    size_t i = s->heap_n++;
    ASSERT(s->heap_n <= s->heap_cap);
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (s->heap[p].key <= e.key) break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = e;
}

static heap_ent heap_pop(bpe_scratch *s) {
    heap_ent top = s->heap[0], last = s->heap[--s->heap_n];
    size_t i = 0, n = s->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && s->heap[c + 1].key < s->heap[c].key) c++;
        if (s->heap[c].key >= last.key) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = last;
    return top;
}

/* Rank and merged id of the adjacent symbols l, r of piece p; 0 if none. */
static int pair_rank(const df_tokenizer *t, const bpe_scratch *s, const unsigned char *p, int32_t l, int32_t r,
                     int32_t *rank, int32_t *id) {
    if (t->kind == TK_HF) {
        const pair_ent *e = ph_find(t, s->id[l], s->id[r]);
        if (!e) return 0;
        *rank = e->rank;
        *id = e->id;
        return 1;
    }
    int32_t m = bh_find(t, p + l, s->end[r] - (uint32_t)l);
    if (m < 0) return 0;
    *rank = *id = m;
    return 1;
}

static void push_pair(const df_tokenizer *t, bpe_scratch *s, const unsigned char *p, int32_t l, int32_t r) {
    int32_t rank, id;
    if (l < 0 || r < 0 || !pair_rank(t, s, p, l, r, &rank, &id)) return;
    heap_push(s, (heap_ent){(uint64_t)(uint32_t)rank << 32 | (uint32_t)l, r, s->ver[l], s->ver[r], id});
}

/* Appends the ids of one piece. */
static df_status bpe_piece(const df_tokenizer *t, bpe_scratch *s, const unsigned char *p, size_t n, df_tokens *out) {
    if (n == 0) return DF_OK;
    if (t->whole_piece_lookup || t->ignore_merges) {
        int32_t w = bh_find(t, p, n);
        if (w >= 0) return df_tokens_push(out, w);
    }
    if (n == 1) return df_tokens_push(out, t->byte_id[p[0]]);
    if (n > INT32_MAX / 4 || scratch_reserve(s, n)) return DF_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        s->id[i] = t->byte_id[p[i]];
        s->prev[i] = (int32_t)i - 1;
        s->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
        s->end[i] = (uint32_t)i + 1;
        s->ver[i] = 0;
    }
    s->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++) push_pair(t, s, p, (int32_t)i, (int32_t)i + 1);
    while (s->heap_n) {
        heap_ent e = heap_pop(s);
        int32_t l = (int32_t)(uint32_t)e.key, r = e.right;
        if (s->ver[l] != e.vl || s->ver[r] != e.vr || s->next[l] != r) continue; /* stale */
        /* l absorbs r */
        s->id[l] = e.id;
        s->end[l] = s->end[r];
        s->next[l] = s->next[r];
        if (s->next[r] >= 0) s->prev[s->next[r]] = l;
        s->ver[l]++;
        s->ver[r] = UINT32_MAX; /* dead: no pair will match it again */
        s->next[r] = -2;
        push_pair(t, s, p, s->prev[l], l);
        push_pair(t, s, p, l, s->next[l]);
    }
    size_t cnt = 0;
    for (int32_t i = 0; i >= 0; i = s->next[i]) cnt++;
    if (tokens_reserve(out, (int)cnt)) return DF_ERR_NOMEM;
    for (int32_t i = 0; i >= 0; i = s->next[i]) out->ids[out->n++] = s->id[i];
    return DF_OK;
}

/* ---- 9. pre-tokenisation and df_tokenize ------------------------------------------- */

typedef struct {
    const df_tokenizer *t;
    bpe_scratch bs;
    pcre2_match_data *md;
    pcre2_match_context *mc;
    pcre2_jit_stack *js;
    df_tokens *out;
    char *err;
    void (*piece_cb)(void *, const char *, size_t); /* tok_pieces: pieces instead of BPE */
    void *ud;
} enc_ctx;

/* Splits s[0..n) with regex step k (find-all; matches and the gaps between
 * them become pieces, in order; a "Removed" step drops its matches) and hands
 * each piece to step k+1, or to BPE after the last step. Each piece is its
 * own subject for the next step, so a lookahead never sees past its piece
 * (as in tokenizers' Sequence of Splits). */
static df_status run_steps(enc_ctx *c, const char *s, size_t n, int k) {
    const df_tokenizer *t = c->t;
    if (k == t->n_steps) {
        if (c->piece_cb) { c->piece_cb(c->ud, s, n); return DF_OK; }
        return bpe_piece(t, &c->bs, (const unsigned char *)s, n, c->out);
    }
    const re_step *st = &t->steps[k];
    size_t pos = 0, done = 0; /* everything before done has been handed on */
    df_status r;
    while (pos < n) {
        int rc = pcre2_match(st->re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, c->md, c->mc);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[200];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return df_fail(c->err, DF_ERR_UNSUPPORTED, "pre-tokenisation regex failed on a %zu-byte span: %s", n,
                           (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t a = ov[0], b = ov[1];
        if (b <= a) { /* an empty match: step over one character, which stays in the gap */
            pos = a + 1;
            while (pos < n && ((unsigned char)s[pos] & 0xC0) == 0x80) pos++;
            continue;
        }
        if (a > done && (r = run_steps(c, s + done, a - done, k + 1)) != DF_OK) return r;
        if (!st->removed && (r = run_steps(c, s + a, b - a, k + 1)) != DF_OK) return r;
        done = pos = b;
    }
    if (done < n && (r = run_steps(c, s + done, n - done, k + 1)) != DF_OK) return r;
    return DF_OK;
}

/* Python's str.isspace() */
static int py_isspace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

/* tokenization_kimi.py: 400,000-code-point slices, each cut further so that
 * no piece holds more than 25,000 consecutive whitespace or non-whitespace
 * code points. (It keeps tiktoken's regex and BPE bounded; the cut points are
 * part of the tokenisation, so they are reproduced exactly.) */
enum { KIMI_SLICE = 400000, KIMI_RUN = 25000 };

static df_status encode_segment(enc_ctx *c, const char *s, size_t n) {
    if (!c->t->kimi_slicing) return run_steps(c, s, n, 0);
    size_t i = 0, start = 0;
    long in_slice = 0, run = 0;
    int run_space = 0;
    df_status r;
    while (i < n) {
        uint32_t cp;
        int k = tok_utf8_step((const unsigned char *)s + i, n - i, &cp);
        ASSERT(k > 0); /* validated by df_tokenize */
        if (in_slice == KIMI_SLICE) { /* a new 400k slice restarts the run count */
            if ((r = run_steps(c, s + start, i - start, 0)) != DF_OK) return r;
            start = i;
            in_slice = 0;
        }
        int sp = py_isspace(cp);
        if (in_slice == 0) { run_space = sp; run = 1; }
        else if (sp != run_space) { run_space = sp; run = 1; }
        else if (++run > KIMI_RUN) {
            if ((r = run_steps(c, s + start, i - start, 0)) != DF_OK) return r;
            start = i;
            run = 1;
        }
        in_slice++;
        i += (size_t)k;
    }
    return start < n ? run_steps(c, s + start, n - start, 0) : DF_OK;
}

/* The longest special spelling at s[0..n), or NULL. */
static const special_tok *special_at(const df_tokenizer *t, const char *s, size_t n) {
    if (!t->spec_first[(unsigned char)s[0]]) return NULL;
    for (int i = 0; i < t->n_spec; i++) /* sorted longest first */
        if (t->spec[i].len <= n && !memcmp(t->spec[i].text, s, t->spec[i].len)) return &t->spec[i];
    return NULL;
}

static df_status encode(const df_tokenizer *t, const char *text, size_t len, unsigned flags, df_tokens *out,
                        void (*cb)(void *, const char *, size_t), void *ud, char *err) {
    if (!t || (!out && !cb) || (!text && len)) return df_fail(err, DF_ERR_ARG, "df_tokenize: NULL argument");
    size_t bad = tok_utf8_check(text, len);
    if (bad < len) return df_fail(err, DF_ERR_ARG, "invalid UTF-8 at byte %zu of the text", bad);
    if (len > (size_t)INT32_MAX) return df_fail(err, DF_ERR_ARG, "text longer than 2 GB");
    df_tokens dummy = {0};
    if (!out) out = &dummy;
    enc_ctx c = {.t = t, .out = out, .err = err, .piece_cb = cb, .ud = ud};
    int n0 = out->n;
    df_status st = DF_OK;
    c.md = pcre2_match_data_create(4, NULL);
    c.mc = pcre2_match_context_create(NULL);
    /* Long pieces (a 25,000-character run) need more than PCRE2's default
     * 32 KB JIT stack; the interpreter fallback gets a larger heap limit. */
    c.js = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, NULL);
    if (!c.md || !c.mc) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    if (c.js) pcre2_jit_stack_assign(c.mc, NULL, c.js);
    pcre2_set_heap_limit(c.mc, 256 * 1024); /* KiB */
    size_t seg = 0;
    if (flags & DF_TOK_SPECIAL) {
        for (size_t i = 0; i < len;) {
            const special_tok *sp = special_at(t, text + i, len - i);
            if (!sp) { i++; continue; }
            if (i > seg && (st = encode_segment(&c, text + seg, i - seg)) != DF_OK) goto done;
            if (cb) cb(ud, text + i, sp->len);
            else if ((st = df_tokens_push(out, sp->id)) != DF_OK) goto done;
            i += sp->len;
            seg = i;
        }
    }
    if (len > seg) st = encode_segment(&c, text + seg, len - seg);
done:
    if (st != DF_OK) {
        if (st == DF_ERR_NOMEM) df_fail(err, st, "out of memory while tokenising");
        out->n = n0;
    }
    scratch_free(&c.bs);
    pcre2_match_data_free(c.md);
    pcre2_match_context_free(c.mc);
    pcre2_jit_stack_free(c.js);
    return st;
}

df_status df_tokenize(const df_tokenizer *t, const char *text, size_t len, unsigned flags, df_tokens *out,
                      char err[DF_ERRMSG]) {
    if (!out) return df_fail(err, DF_ERR_ARG, "df_tokenize: NULL output");
    return encode(t, text, len, flags, out, NULL, NULL, err);
}

df_status tok_pieces(const df_tokenizer *t, const char *text, size_t len, unsigned flags,
                     void (*cb)(void *ud, const char *piece, size_t n), void *ud, char err[DF_ERRMSG]) {
    if (!cb) return df_fail(err, DF_ERR_ARG, "tok_pieces: NULL callback");
    return encode(t, text, len, flags, NULL, cb, ud, err);
}

/* ---- 10. decoding ---------------------------------------------------------------- */

/* Appends bytes to a malloc'd buffer. */
typedef struct {
    char *p;
    size_t n, cap;
} sbuf;

static int sb_put(sbuf *b, const void *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) return -1;
        b->p = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

/* Appends s[0..n) with every maximal invalid subpart replaced by U+FFFD;
 * returns how many trailing bytes were an unfinished sequence and were NOT
 * written (only when keep_tail; else they become U+FFFD too), or -1 on OOM. */
static long put_lossy(sbuf *b, const unsigned char *s, size_t n, int keep_tail) {
    if (!n) return 0; /* s may be NULL (nothing was decoded) */
    size_t i = 0, run = 0;
    while (i < n) {
        if (s[i] < 0x80) { i++; continue; }
        uint32_t cp;
        int k = tok_utf8_step(s + i, n - i, &cp);
        if (k > 0) { i += (size_t)k; continue; }
        if (sb_put(b, s + run, i - run)) return -1;
        if (k == 0) {
            if (keep_tail) return (long)(n - i);
            if (sb_put(b, "\xEF\xBF\xBD", 3)) return -1;
            return 0;
        }
        if (sb_put(b, "\xEF\xBF\xBD", 3)) return -1;
        i += (size_t)-k;
        run = i;
    }
    return sb_put(b, s + run, n - run) ? -1 : 0;
}

df_status df_detokenize(const df_tokenizer *t, const int32_t *ids, int n, int skip_special, char **text, size_t *len,
                        char err[DF_ERRMSG]) {
    *text = NULL;
    if (len) *len = 0;
    if (!t || (n && !ids) || n < 0) return df_fail(err, DF_ERR_ARG, "df_detokenize: bad argument");
    sbuf raw = {0}, outb = {0};
    for (int i = 0; i < n; i++) {
        size_t bl;
        const char *b = df_token_bytes(t, ids[i], &bl);
        if (!b) { free(raw.p); return df_fail(err, DF_ERR_ARG, "token id %d is not in the vocabulary (size %d)", (int)ids[i], t->n_vocab); }
        if (skip_special && t->special_id[ids[i]]) continue;
        if (sb_put(&raw, b, bl)) { free(raw.p); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    }
    if (sb_put(&outb, "", 0) || put_lossy(&outb, (const unsigned char *)raw.p, raw.n, 0) < 0) {
        free(raw.p);
        free(outb.p);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    free(raw.p);
    *text = outb.p;
    if (len) *len = outb.n;
    return DF_OK;
}

struct df_detok {
    const df_tokenizer *t;
    int skip_special;
    unsigned char pend[4];  /* an unfinished code point (at most 3 bytes) */
    int npend;
    sbuf out;               /* what the last push/flush returned */
    sbuf tmp;
};

df_status df_detok_new(const df_tokenizer *t, int skip_special, df_detok **out) {
    *out = NULL;
    if (!t) return DF_ERR_ARG;
    df_detok *d = calloc(1, sizeof *d);
    if (!d) return DF_ERR_NOMEM;
    d->t = t;
    d->skip_special = skip_special;
    if (sb_put(&d->out, "", 0) || sb_put(&d->tmp, "", 0)) { df_detok_free(d); return DF_ERR_NOMEM; }
    *out = d;
    return DF_OK;
}

void df_detok_free(df_detok *d) {
    if (!d) return;
    free(d->out.p);
    free(d->tmp.p);
    free(d);
}

void df_detok_reset(df_detok *d) {
    if (!d) return;
    d->npend = 0;
    d->out.n = 0;
    d->out.p[0] = 0;
}

df_status df_detok_push(df_detok *d, int32_t id, const char **text, size_t *len) {
    d->out.n = 0;
    d->out.p[0] = 0;
    *text = d->out.p;
    *len = 0;
    size_t bl;
    const char *b = df_token_bytes(d->t, id, &bl);
    if (!b) return DF_ERR_ARG;
    if (d->skip_special && d->t->special_id[id]) return DF_OK;
    d->tmp.n = 0;
    if (sb_put(&d->tmp, d->pend, (size_t)d->npend) || sb_put(&d->tmp, b, bl)) return DF_ERR_NOMEM;
    long keep = put_lossy(&d->out, (const unsigned char *)d->tmp.p, d->tmp.n, 1);
    if (keep < 0) return DF_ERR_NOMEM;
    ASSERT(keep <= 3);
    memcpy(d->pend, d->tmp.p + d->tmp.n - keep, (size_t)keep);
    d->npend = (int)keep;
    *text = d->out.p;
    *len = d->out.n;
    return DF_OK;
}

void df_detok_flush(df_detok *d, const char **text, size_t *len) {
    d->out.n = 0;
    d->out.p[0] = 0;
    if (d->npend && put_lossy(&d->out, d->pend, (size_t)d->npend, 0) < 0) d->out.n = 0;
    d->npend = 0;
    *text = d->out.p;
    *len = d->out.n;
}
