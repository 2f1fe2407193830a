/* test_st_cache.c — the parsed-metadata cache (src/format/st_cache.c), suite
 * fmt_stc_: a set opened from the cache equals the parsed one (every tensor,
 * the tiny values it carries); a corrupt, truncated, foreign or stale file is
 * noticed, never trusted, and rebuilt; a folder that cannot be written costs
 * the cache only; the CLI's inspect reads the same with and without it.
 */
#include "test.h"
#include "../src/format/st_cache.h"
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

/* A small int4 checkpoint (kimi_k2: weight_shape tensors) in several shards. */
static const char *model_dir(void) {
    static char dir[512];
    if (dir[0]) return dir;
    const char *d = t_tmpdir("stc_model");
    char out[4096];
    if (!d || t_sh(out, sizeof out, "%s synth --arch kimi_k2 --shard-size 1M --out %s --force --quiet",
                   t_bin(), d) != 0)
        return NULL;
    snprintf(dir, sizeof dir, "%s", d);
    return dir;
}

/* Every tensor of a equals b's of the same index, and the tiny ones read the same. */
static int same_set(st_set *a, st_set *b) {
    if (st_count(a) != st_count(b) || st_n_shards(a) != st_n_shards(b)) return 0;
    char err[DF_ERRMSG];
    for (int64_t i = 0; i < st_count(a); i++) {
        const st_tensor *x = st_at(a, i), *y = st_at(b, i);
        if (strcmp(x->name, y->name) || x->dtype != y->dtype || x->ndim != y->ndim || x->nbytes != y->nbytes ||
            x->shard != y->shard || x->offset != y->offset || memcmp(x->shape, y->shape, sizeof x->shape))
            return 0;
        if (st_find(b, x->name) != y) return 0;
        if (x->nbytes > 0 && x->nbytes <= 64) {
            const void *p = st_data(a, x, err), *q = st_data(b, y, err);
            if (!p || !q || memcmp(p, q, (size_t)x->nbytes)) return 0;
        }
    }
    for (int s = 0; s < st_n_shards(a); s++)
        if (strcmp(st_shard_path(a, s), st_shard_path(b, s)) || st_shard_size(a, s) != st_shard_size(b, s)) return 0;
    return 1;
}

/* Opens through the cache; returns the set (NULL on failure) and the note. */
static st_set *open_cached(const char *dir, const char *cache, int mmap, char *note) {
    st_set *s = NULL;
    char err[DF_ERRMSG];
    df_status st = stc_open(dir, NULL, mmap, cache, 0, &s, note, err);
    if (st != DF_OK) fprintf(stderr, "stc_open: %s\n", err);
    return st == DF_OK ? s : NULL;
}

TEST(fmt_stc_roundtrip) {
    const char *d = model_dir();
    REQUIRE(d, "synth failed");
    const char *cache = t_tmpdir("stc_cache");
    char note[STC_NOTE], err[DF_ERRMSG];
    st_set *ref = NULL;
    REQUIRE(st_open_dir(d, NULL, 1, &ref, err) == DF_OK, "%s", err);
    REQUIRE(st_n_shards(ref) >= 2, "want several shards, got %d", st_n_shards(ref));
    int small = 0;
    for (int64_t i = 0; i < st_count(ref); i++) small += st_at(ref, i)->nbytes <= ST_SMALL;
    CHECK(small > 0, "the model has no tiny tensors to carry");
    for (int mm = 0; mm < 2; mm++) {
        st_set *a = open_cached(d, cache, mm, note); /* first: parses, writes */
        REQUIRE(a, "first open");
        CHECK(note[0] == 0, "note '%s'", note);
        char *f = stc_path(d, cache);
        struct stat sb;
        CHECK(f && stat(f, &sb) == 0 && sb.st_size > 32, "no cache file %s", f ? f : "?");
        st_set *b = open_cached(d, cache, mm, note); /* second: from the file */
        REQUIRE(b, "second open");
        CHECK(note[0] == 0, "note '%s'", note);
        CHECK(same_set(ref, a), "parsed set differs (mmap %d)", mm);
        CHECK(same_set(ref, b), "cached set differs (mmap %d)", mm);
        st_close(a);
        st_close(b);
        free(f);
    }
    st_close(ref);
}

/* Rewrites the cache file with fn applied; the next open must notice. */
static void damaged(const char *tag, void (*fn)(unsigned char *, size_t *), const char *want_note) {
    const char *d = model_dir();
    REQUIRE(d, "synth failed");
    const char *cache = t_tmpdir(tag);
    char note[STC_NOTE], err[DF_ERRMSG];
    st_set *ref = NULL, *s = open_cached(d, cache, 1, note);
    REQUIRE(s, "first open");
    st_close(s);
    REQUIRE(st_open_dir(d, NULL, 1, &ref, err) == DF_OK, "%s", err);
    char *f = stc_path(d, cache);
    REQUIRE(f, "path");
    FILE *fp = fopen(f, "rb");
    REQUIRE(fp, "open %s", f);
    size_t cap = 64 << 20, n;
    unsigned char *buf = malloc(cap);
    n = fread(buf, 1, cap, fp);
    fclose(fp);
    fn(buf, &n);
    fp = fopen(f, "wb");
    REQUIRE(fp && fwrite(buf, 1, n, fp) == n && fclose(fp) == 0, "rewrite %s", f);
    s = open_cached(d, cache, 1, note);
    CHECK(s && same_set(ref, s), "damaged cache changed the set");
    CHECK(strstr(note, want_note) != NULL, "note '%s' lacks '%s'", note, want_note);
    st_close(s);
    s = open_cached(d, cache, 1, note); /* rebuilt: clean again */
    CHECK(s && same_set(ref, s) && note[0] == 0, "after the rebuild: note '%s'", note);
    st_close(s);
    st_close(ref);
    free(buf);
    free(f);
}

static void flip_payload(unsigned char *b, size_t *n) { b[*n / 2] ^= 0x40; }
static void truncate_half(unsigned char *b, size_t *n) { (void)b; *n /= 2; }
static void old_version(unsigned char *b, size_t *n) { (void)n; b[8] = 1; }
static void empty_file(unsigned char *b, size_t *n) { (void)b; *n = 0; }
static void garbage(unsigned char *b, size_t *n) {
    for (size_t i = 0; i < *n; i++) b[i] = (unsigned char)(i * 131 + 7);
}

TEST(fmt_stc_corrupt) { damaged("stc_corrupt", flip_payload, "checksum"); }
TEST(fmt_stc_truncated) { damaged("stc_trunc", truncate_half, "truncated"); }
TEST(fmt_stc_version) { damaged("stc_version", old_version, "version"); }
TEST(fmt_stc_empty) { damaged("stc_empty", empty_file, "no magic"); }
TEST(fmt_stc_garbage) { damaged("stc_garbage", garbage, "no magic"); }

/* Bounds: a file whose checksum is right but whose fields lie is refused
 * by decoding itself (the fuzz harness tries many more). */
TEST(fmt_stc_check_bytes) {
    const char *d = model_dir();
    REQUIRE(d, "synth failed");
    const char *cache = t_tmpdir("stc_check");
    char note[STC_NOTE], err[DF_ERRMSG];
    st_set *s = open_cached(d, cache, 1, note);
    REQUIRE(s, "open");
    st_close(s);
    char *f = stc_path(d, cache);
    FILE *fp = fopen(f, "rb");
    REQUIRE(fp, "open %s", f);
    unsigned char *buf = malloc(64 << 20);
    size_t n = fread(buf, 1, 64 << 20, fp);
    fclose(fp);
    CHECK(stc_check_bytes(buf, n, err) == DF_OK, "%s", err);
    for (size_t cut = 0; cut < n; cut += n / 97 + 1)
        CHECK(stc_check_bytes(buf, cut, err) == DF_ERR_FORMAT, "a %zu-byte prefix passed", cut);
    free(buf);
    free(f);
}

TEST(fmt_stc_stale) {
    const char *d = model_dir();
    REQUIRE(d, "synth failed");
    const char *cache = t_tmpdir("stc_stale");
    char note[STC_NOTE], err[DF_ERRMSG], path[1024];
    st_set *ref = NULL, *s = open_cached(d, cache, 1, note);
    REQUIRE(s, "first open");
    snprintf(path, sizeof path, "%s", st_shard_path(s, st_n_shards(s) - 1));
    st_close(s);
    /* a shard's mtime moves (its bytes rewritten in place) */
    struct timeval tv[2] = {{1000000000, 0}, {1000000000, 0}};
    REQUIRE(utimes(path, tv) == 0, "utimes %s: %s", path, strerror(errno));
    REQUIRE(st_open_dir(d, NULL, 1, &ref, err) == DF_OK, "%s", err);
    s = open_cached(d, cache, 1, note);
    CHECK(s && same_set(ref, s), "stale open differs");
    CHECK(strstr(note, "stale") && strstr(note, "changed"), "note '%s'", note);
    st_close(s);
    s = open_cached(d, cache, 1, note);
    CHECK(s && note[0] == 0, "not rebuilt: '%s'", note);
    st_close(s);
    /* config.json changes too */
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/config.json", d);
    REQUIRE(utimes(cfg, tv) == 0, "utimes %s", cfg);
    s = open_cached(d, cache, 1, note);
    CHECK(s && strstr(note, "config.json changed"), "note '%s'", note);
    st_close(s);
    st_close(ref);
}

TEST(fmt_stc_unwritable) {
    const char *d = model_dir();
    REQUIRE(d, "synth failed");
    const char *t = t_tmpdir("stc_unwritable");
    char cache[1024], note[STC_NOTE], err[DF_ERRMSG];
    snprintf(cache, sizeof cache, "%s/file", t);
    FILE *fp = fopen(cache, "w"); /* a file where the folder should be */
    REQUIRE(fp, "create");
    fclose(fp);
    st_set *ref = NULL, *s = open_cached(d, cache, 1, note);
    REQUIRE(st_open_dir(d, NULL, 1, &ref, err) == DF_OK, "%s", err);
    CHECK(s && same_set(ref, s), "open without a cache differs");
    CHECK(strstr(note, "not written"), "note '%s'", note);
    st_close(s);
    st_close(ref);
    /* below the size threshold: no file, no note */
    const char *c2 = t_tmpdir("stc_small");
    s = NULL;
    CHECK(stc_open(d, NULL, 1, c2, (int64_t)1 << 40, &s, note, err) == DF_OK && s && note[0] == 0, "%s", note);
    char *f = stc_path(d, c2);
    struct stat sb;
    CHECK(f && stat(f, &sb) != 0, "a cache was written below the threshold");
    free(f);
    st_close(s);
}

TEST(fmt_stc_cli_inspect) {
    const char *d = model_dir();
    REQUIRE(d, "synth failed");
    const char *cache = t_tmpdir("stc_cli");
    char a[8192], b[8192], c[8192];
    int ra = t_sh(a, sizeof a, "%s inspect --model %s --ram 4G --meta-cache off | grep -v 'kernel can give'", t_bin(), d);
    int rb = t_sh(b, sizeof b, "%s inspect --model %s --ram 4G --meta-cache %s | grep -v 'kernel can give'", t_bin(), d, cache);
    int rc = t_sh(c, sizeof c, "%s inspect --model %s --ram 4G --meta-cache %s | grep -v 'kernel can give'", t_bin(), d, cache);
    REQUIRE(ra == 0 && rb == 0 && rc == 0, "inspect failed:\n%s\n%s\n%s", a, b, c);
    CHECK(strcmp(a, b) == 0 && strcmp(a, c) == 0, "inspect differs with the cache:\n%s\n---\n%s", a, c);
}

/* The engine over a cached set: logits byte-identical to a parsed one, also
 * with the int8 spine overlay added after the cached set (st_add_dir: its
 * tensors come after those carrying tiny values). */
TEST(fmt_stc_engine_logits) {
    const char *d = t_tmpdir("stc_engine");
    REQUIRE(d, "tmpdir");
    char dir[512], cache[600], o[8192];
    snprintf(dir, sizeof dir, "%s/m", d);
    snprintf(cache, sizeof cache, "%s/cache", d);
    int rc = t_sh(o, sizeof o, "%s synth --arch kimi_k2 --shard-size 1M --out %s --quiet && %s convert-spine %s",
                  t_bin(), dir, t_bin(), dir);
    REQUIRE(rc == 0, "%s", o);
    const char *dt[2] = {"bf16", "int8"};
    for (int k = 0; k < 2; k++) {
        rc = t_sh(o, sizeof o,
                  "B=%s; M=%s; i=0; for c in off %s %s; do i=$((i+1)); $B logits --model $M --tokens 5,6,7 "
                  "--spine-dtype %s --meta-cache $c --out %s/lg.$i 2>/dev/null || exit 1; done; "
                  "cmp %s/lg.1 %s/lg.3 && cmp %s/lg.1 %s/lg.2 && ls %s | grep -q meta- && echo same",
                  t_bin(), dir, cache, cache, dt[k], d, d, d, d, d, cache);
        CHECK(rc == 0 && strstr(o, "same"), "%s spine: %s", dt[k], o);
    }
}
