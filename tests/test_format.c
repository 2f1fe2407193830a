/* test_format.c — suites fmt_*: the safetensors reader, config.json parsing,
 * weight binding and the I/O helpers, on small files written here.
 *
 * Each bad-input test checks the status and that the one-line message names
 * the file and the tensor (or field). Sections: 1. writers and fault-injecting
 * I/O  2. I/O helpers  3. safetensors good  4. safetensors bad  5. config
 * 6. weights
 */
#include "test.h"
#include "../src/base/err.h"
#include "../src/base/io.h"
#include "../src/format/config.h"
#include "../src/format/safetensors.h"
#include "../src/format/weight.h"
#include "../src/base/pool.h"
#include "../src/model/resident_copy.h"
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <unistd.h>

/* ---- 1. writers and fault-injecting I/O ------------------------------------- */

typedef struct {
    const char *name, *dtype;
    int ndim;
    int64_t shape[4];
    const void *data; /* NULL: a byte pattern */
} tspec;

static int write_file(const char *dir, const char *fname, const void *p, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, fname);
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = n ? fwrite(p, 1, n, f) : 0;
    fclose(f);
    return w == n ? 0 : -1;
}

static int write_text(const char *dir, const char *fname, const char *text) {
    return write_file(dir, fname, text, strlen(text));
}

/* Writes an 8-byte length (hdr_len, or the real length if < 0), header, data. */
static int write_raw(const char *dir, const char *fname, const char *header, const void *data,
                     size_t n, int64_t hdr_len) {
    size_t hl = strlen(header);
    uint64_t L = hdr_len < 0 ? hl : (uint64_t)hdr_len;
    size_t tot = 8 + hl + n;
    uint8_t *buf = malloc(tot);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(L >> (8 * i));
    memcpy(buf + 8, header, hl);
    if (n) memcpy(buf + 8 + hl, data, n);
    int r = write_file(dir, fname, buf, tot);
    free(buf);
    return r;
}

static int dsize(const char *d) {
    if (!strcmp(d, "F32") || !strcmp(d, "I32")) return 4;
    if (!strcmp(d, "BF16") || !strcmp(d, "F16")) return 2;
    if (!strcmp(d, "I64") || !strcmp(d, "F64")) return 8;
    return 1;
}

static uint8_t pattern(int k, int64_t i) { return (uint8_t)(k * 37 + i * 31 + (i >> 8)); }

/* Writes a well-formed shard holding the tensors back to back. */
static int write_st(const char *dir, const char *fname, const tspec *t, int n) {
    size_t cap = 256 + (size_t)n * 256, k = 0;
    char *h = malloc(cap);
    k += (size_t)snprintf(h + k, cap - k, "{\"__metadata__\":{\"format\":\"pt\"}");
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        int64_t ne = 1;
        for (int d = 0; d < t[i].ndim; d++) ne *= t[i].shape[d];
        int64_t nb = ne * dsize(t[i].dtype);
        k += (size_t)snprintf(h + k, cap - k, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t[i].name,
                              t[i].dtype);
        for (int d = 0; d < t[i].ndim; d++)
            k += (size_t)snprintf(h + k, cap - k, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        k += (size_t)snprintf(h + k, cap - k, "],\"data_offsets\":[%lld,%lld]}", (long long)off,
                              (long long)(off + nb));
        off += nb;
    }
    snprintf(h + k, cap - k, "}");
    uint8_t *data = malloc(off ? (size_t)off : 1);
    off = 0;
    for (int i = 0; i < n; i++) {
        int64_t ne = 1;
        for (int d = 0; d < t[i].ndim; d++) ne *= t[i].shape[d];
        int64_t nb = ne * dsize(t[i].dtype);
        for (int64_t j = 0; j < nb; j++)
            data[off + j] = t[i].data ? ((const uint8_t *)t[i].data)[j] : pattern(i, j);
        off += nb;
    }
    int r = write_raw(dir, fname, h, data, (size_t)off, -1);
    free(h);
    free(data);
    return r;
}

static int has(const char *msg, const char *s) { return strstr(msg, s) != NULL; }

/* Short reads (at most 3 bytes) and an EINTR on every other call. */
static int flaky_calls;
static ssize_t flaky_pread(void *ctx, int fd, void *buf, size_t n, off_t off) {
    (void)ctx;
    if (flaky_calls++ % 2 == 0) {
        errno = EINTR;
        return -1;
    }
    return pread(fd, buf, n > 3 ? 3 : n, off);
}

/* Fails every read after the first `eio_after` calls. */
static int eio_left;
static ssize_t eio_pread(void *ctx, int fd, void *buf, size_t n, off_t off) {
    (void)ctx;
    if (eio_left-- <= 0) {
        errno = EIO;
        return -1;
    }
    return pread(fd, buf, n, off);
}

static df_io io_with_pread(ssize_t (*fn)(void *, int, void *, size_t, off_t)) {
    df_io io = *df_io_default();
    io.pread = fn;
    return io;
}

/* ---- 2. I/O helpers ---------------------------------------------------------- */

TEST(fmt_io_pread_full) {
    const char *d = t_tmpdir("fmt_io");
    REQUIRE(d && write_text(d, "f.txt", "hello, world") == 0);
    char path[512];
    snprintf(path, sizeof path, "%s/f.txt", d);
    const df_io *io = df_io_default();
    int fd = io_open(io, path, O_RDONLY, 0);
    REQUIRE(fd >= 0);
    char buf[16] = {0};
    CHECK(io_pread_full(io, fd, buf, 5, 7) == 0 && memcmp(buf, "world", 5) == 0);
    errno = 0;
    CHECK(io_pread_full(io, fd, buf, 8, 7) == -1 && errno == EIO, "EOF must be EIO");
    df_io fl = io_with_pread(flaky_pread);
    flaky_calls = 0;
    memset(buf, 0, sizeof buf);
    CHECK(io_pread_full(&fl, fd, buf, 12, 0) == 0 && memcmp(buf, "hello, world", 12) == 0);
    io_close(io, fd);
    size_t len = 0;
    char *t = io_read_text(&fl, path, 100, &len);
    CHECK(t && len == 12 && strcmp(t, "hello, world") == 0);
    free(t);
    CHECK(io_read_text(io, path, 4, &len) == NULL, "max_bytes must be enforced");
    snprintf(path, sizeof path, "%s/absent", d);
    errno = 0;
    CHECK(io_read_text(io, path, 100, &len) == NULL && errno == ENOENT);
}

/* ---- 3. safetensors good ------------------------------------------------------ */

static const tspec three[] = {
    {"a.weight", "F32", 2, {2, 3}, NULL},
    {"b.bias", "BF16", 1, {4}, NULL},
    {"c.idx", "I32", 1, {2}, NULL},
    {"d.empty", "F32", 2, {0, 5}, NULL},
};

TEST(fmt_st_single_file) {
    const char *d = t_tmpdir("fmt_single");
    REQUIRE(d && write_st(d, "model.safetensors", three, 4) == 0);
    for (int mm = 0; mm <= 1; mm++) {
        st_set *s = NULL;
        char err[DF_ERRMSG] = "";
        df_status st = st_open_dir(d, NULL, mm, &s, err);
        REQUIRE(st == DF_OK, "mmap=%d: %s", mm, err);
        CHECK(st_count(s) == 4 && st_n_shards(s) == 1);
        CHECK(st_total_bytes(s) == 24 + 8 + 8);
        CHECK(st_find(s, "__metadata__") == NULL);
        CHECK(st_find(s, "nope") == NULL);
        const st_tensor *t = st_find(s, "b.bias");
        REQUIRE(t && t->dtype == DT_BF16 && t->ndim == 1 && t->shape[0] == 4 && t->nbytes == 8);
        const uint8_t *p = st_data(s, t, err);
        REQUIRE(p, "%s", err);
        for (int j = 0; j < 8; j++) CHECK(p[j] == pattern(1, j), "byte %d", j);
        const st_tensor *e = st_find(s, "d.empty");
        CHECK(e && e->nbytes == 0 && st_data(s, e, err) != NULL);
        uint8_t buf[24];
        CHECK(st_read(s, st_find(s, "a.weight"), buf, err) == DF_OK && buf[5] == pattern(0, 5));
        CHECK(has(st_shard_path(s, 0), "model.safetensors"));
        int seen = 0;
        for (int64_t i = 0; i < st_count(s); i++) seen += st_at(s, i) != NULL;
        CHECK(seen == 4 && st_at(s, 4) == NULL && st_at(s, -1) == NULL);
        st_close(s);
    }
    st_close(NULL);
}

TEST(fmt_st_sharded_index) {
    const char *d = t_tmpdir("fmt_sharded");
    tspec s1[] = {{"model.embed.weight", "BF16", 2, {3, 4}, NULL},
                  {"model.layers.0.w", "F32", 1, {5}, NULL}};
    tspec s2[] = {{"model.layers.1.w", "F32", 1, {5}, NULL},
                  {"lm_head.weight", "BF16", 2, {3, 4}, NULL}};
    REQUIRE(write_st(d, "model-00001-of-00002.safetensors", s1, 2) == 0);
    REQUIRE(write_st(d, "model-00002-of-00002.safetensors", s2, 2) == 0);
    REQUIRE(write_st(d, "stray.safetensors", s1, 1) == 0); /* not in the index: ignored */
    REQUIRE(write_text(d, "model.safetensors.index.json",
                       "{\"metadata\":{\"total_size\":64},\"weight_map\":{"
                       "\"model.embed.weight\":\"model-00001-of-00002.safetensors\","
                       "\"model.layers.0.w\":\"model-00001-of-00002.safetensors\","
                       "\"model.layers.1.w\":\"model-00002-of-00002.safetensors\","
                       "\"lm_head.weight\":\"model-00002-of-00002.safetensors\"}}") == 0);
    st_set *s = NULL;
    char err[DF_ERRMSG] = "";
    REQUIRE(st_open_dir(d, NULL, 1, &s, err) == DF_OK, "%s", err);
    CHECK(st_n_shards(s) == 2 && st_count(s) == 4);
    const st_tensor *t = st_find(s, "lm_head.weight");
    REQUIRE(t);
    CHECK(has(st_shard_path(s, t->shard), "model-00002-of-00002"));
    const uint8_t *p = st_data(s, t, err);
    CHECK(p && p[3] == pattern(1, 3));
    st_close(s);
}

TEST(fmt_st_glob_sorted) {
    const char *d = t_tmpdir("fmt_glob");
    tspec a[] = {{"x", "U8", 1, {3}, NULL}};
    tspec b[] = {{"y", "U8", 1, {3}, NULL}};
    REQUIRE(write_st(d, "b.safetensors", b, 1) == 0 && write_st(d, "a.safetensors", a, 1) == 0);
    REQUIRE(write_text(d, "notes.txt", "ignored") == 0);
    st_set *s = NULL;
    char err[DF_ERRMSG] = "";
    REQUIRE(st_open_dir(d, NULL, 0, &s, err) == DF_OK, "%s", err);
    CHECK(st_n_shards(s) == 2 && has(st_shard_path(s, 0), "/a.safetensors"));
    CHECK(st_find(s, "y") && st_find(s, "y")->shard == 1);
    st_close(s);
}

TEST(fmt_st_mmap_vs_pread) {
    const char *d = t_tmpdir("fmt_mvp");
    tspec t[] = {{"big", "BF16", 2, {64, 1000}, NULL},
                 {"mid", "F32", 1, {12345}, NULL},
                 {"odd", "U8", 1, {7}, NULL}};
    REQUIRE(write_st(d, "model.safetensors", t, 3) == 0);
    st_set *a = NULL, *b = NULL, *c = NULL;
    char err[DF_ERRMSG] = "";
    df_io fl = io_with_pread(flaky_pread);
    REQUIRE(st_open_dir(d, NULL, 1, &a, err) == DF_OK, "%s", err);
    REQUIRE(st_open_dir(d, NULL, 0, &b, err) == DF_OK, "%s", err);
    REQUIRE(st_open_dir(d, &fl, 0, &c, err) == DF_OK, "%s", err);
    for (int64_t i = 0; i < st_count(a); i++) {
        const st_tensor *ta = st_at(a, i);
        const st_tensor *tb = st_find(b, ta->name), *tc = st_find(c, ta->name);
        REQUIRE(tb && tc);
        const void *pa = st_data(a, ta, err), *pb = st_data(b, tb, err), *pc = st_data(c, tc, err);
        REQUIRE(pa && pb && pc, "%s", err);
        CHECK(memcmp(pa, pb, (size_t)ta->nbytes) == 0, "%s differs (mmap vs pread)", ta->name);
        CHECK(memcmp(pa, pc, (size_t)ta->nbytes) == 0, "%s differs (mmap vs flaky pread)", ta->name);
        CHECK(st_data(b, tb, err) == pb, "pread mode must cache");
        void *buf = malloc((size_t)ta->nbytes);
        CHECK(st_read(c, tc, buf, err) == DF_OK && memcmp(buf, pa, (size_t)ta->nbytes) == 0);
        free(buf);
    }
    st_close(a);
    st_close(b);
    st_close(c);
}

/* st_random_rows: 1 for a mapped tensor (its pages get MADV_RANDOM), 0 when
 * the set reads into memory; neither hint changes a byte, and a row hint
 * at any alignment is harmless. */
TEST(fmt_st_random_rows_hint) {
    const char *d = t_tmpdir("fmt_rand");
    tspec t[] = {{"embed", "BF16", 2, {300, 1000}, NULL}};
    REQUIRE(write_st(d, "model.safetensors", t, 1) == 0);
    st_set *a = NULL, *b = NULL;
    char err[DF_ERRMSG] = "";
    REQUIRE(st_open_dir(d, NULL, 1, &a, err) == DF_OK && st_open_dir(d, NULL, 0, &b, err) == DF_OK, "%s", err);
    const st_tensor *ta = st_find(a, "embed"), *tb = st_find(b, "embed");
    REQUIRE(ta && tb);
    CHECK(st_random_rows(a, ta) == 1, "a mapped tensor takes the hint");
    CHECK(st_random_rows(b, tb) == 0, "a tensor read into memory does not");
    const uint8_t *pa = st_data(a, ta, err), *pb = st_data(b, tb, err);
    REQUIRE(pa && pb, "%s", err);
    for (int r = 0; r < 300; r += 37) st_rows_willneed(pa + r * 2000 + 3, 2000);
    st_rows_willneed(pb + 1, 10);
    CHECK(memcmp(pa, pb, (size_t)ta->nbytes) == 0, "hinted pages read the same bytes");
    const int on_line = (uintptr_t)pb % 128 == 0;
    CHECK(on_line, "a tensor read into memory lies on a 128-byte line (%p)", (const void *)pb);
    st_close(a);
    st_close(b);
}

static int on_line(const void *p) { return (uintptr_t)p % 128 == 0; }
static int on_2mb(const void *p) { return (uintptr_t)p % (2u << 20) == 0; }

/* Views of tensors a, big, c (+ scale cs) and a again, bound by hand. */
static void rc_views(st_set *s, df_weight v[4], char *err) {
    const char *names[4] = {"a", "big", "c", "a"};
    for (int i = 0; i < 4; i++) {
        memset(&v[i], 0, sizeof v[i]);
        v[i].t_data = st_find(s, names[i]);
        v[i].data = v[i].t_data ? st_data(s, v[i].t_data, err) : NULL;
    }
    v[2].t_scale = st_find(s, "cs");
    v[2].scale = v[2].t_scale ? st_data(s, v[2].t_scale, err) : NULL;
}

TEST(fmt_resident_copy_aligned_same_bytes) {
    const char *d = t_tmpdir("fmt_rcopy");
    /* odd sizes leave every tensor after the first off a 128-byte line;
     * big spans three of the copy's 4 MB pieces */
    tspec t[] = {{"a", "BF16", 2, {1000, 1001}, NULL},
                 {"big", "BF16", 2, {3001, 1700}, NULL},
                 {"c", "I8", 2, {33, 65}, NULL},
                 {"cs", "F32", 1, {33}, NULL}};
    REQUIRE(write_st(d, "model.safetensors", t, 4) == 0);
    char err[DF_ERRMSG] = "", path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    st_set *m = NULL, *r = NULL;
    REQUIRE(st_open_dir(d, NULL, 1, &m, err) == DF_OK && st_open_dir(d, NULL, 0, &r, err) == DF_OK, "%s", err);
    df_pool *pool = pool_new(3);
    REQUIRE(pool);
    df_weight v[4], w[4], before[4];
    rc_views(m, v, err);
    rc_views(r, w, err);
    REQUIRE(v[0].data && v[1].data && v[2].data && v[2].scale && w[1].data, "%s", err);
    CHECK(!on_line(v[1].data), "the test needs big off a line in the file");
    memcpy(before, v, sizeof v);
    df_weight *pv[4] = {&v[0], &v[1], &v[2], &v[3]};
    rcopy *c = NULL;
    /* started: the views stay on the mapping until rcopy_finish, even once
     * the thread is done; freed while it runs: it stops, nothing moved */
    REQUIRE(rcopy_start(m, pv, 4, NULL, &c, err) == DF_OK && c, "%s", err);
    rcopy_free(c);
    CHECK(memcmp(v, before, sizeof v) == 0, "no view moved by a copy freed while it ran");
    REQUIRE(rcopy_start(m, pv, 4, NULL, &c, err) == DF_OK && c, "%s", err);
    for (int i = 0; i < 20000 && !rcopy_done(c); i++) usleep(1000);
    CHECK(rcopy_done(c) && memcmp(v, before, sizeof v) == 0, "a finished copy moves no view by itself");
    REQUIRE(rcopy_finish(c, pv, 4, err) == DF_OK, "%s", err);
    rcopy_free(c);
    memcpy(v, before, sizeof v);
    c = NULL;
    REQUIRE(rcopy_make(m, pv, 4, pool, &c, err) == DF_OK && c, "%s", err);
    rcopy_stats cs;
    rcopy_get_stats(c, &cs);
    CHECK(cs.tensors == 4 && cs.bytes == 2002000 + 10203400 + 33 * 65 + 33 * 4, "%lld tensors, %lld bytes",
          (long long)cs.tensors, (long long)cs.bytes);
    for (int i = 0; i < 4; i++) {
        CHECK(v[i].data != before[i].data && on_line(v[i].data), "view %d at %p", i, v[i].data);
        CHECK(memcmp(v[i].data, before[i].data, (size_t)v[i].t_data->nbytes) == 0, "view %d: the file's bytes", i);
    }
    CHECK(v[0].data == v[3].data, "views of one tensor share its copy");
    CHECK(v[2].scale != before[2].scale && on_line(v[2].scale) &&
          memcmp(v[2].scale, before[2].scale, 33 * 4) == 0, "the scales are copied too");
    const char *lo = rcopy_base(c);
    CHECK((const char *)v[1].data >= lo && (const char *)v[1].data < lo + rcopy_region_bytes(c));
    /* read into memory (no mmap): a tensor of 2 MB or more in 2 MB pages, the file's bytes */
    CHECK(on_2mb(w[1].data) && on_line(w[2].data) && memcmp(w[1].data, before[1].data, 10203400) == 0,
          "buffers %p %p", w[1].data, w[2].data);
    /* a set read into memory has nothing mapped: nothing moves */
    df_weight *pw[4] = {&w[0], &w[1], &w[2], &w[3]};
    const void *w1 = w[1].data;
    rcopy *none = (rcopy *)1;
    CHECK(rcopy_make(r, pw, 4, pool, &none, err) == DF_OK && none == NULL && w[1].data == w1, "%s", err);
    rcopy_free(c);
    /* a read that fails: an error naming the file, no view moved */
    df_io eio = io_with_pread(eio_pread);
    st_set *f = NULL;
    eio_left = 1000;
    REQUIRE(st_open_dir(d, &eio, 1, &f, err) == DF_OK, "%s", err);
    rc_views(f, v, err);
    memcpy(before, v, sizeof v);
    eio_left = 1;
    c = (rcopy *)1;
    df_status st = rcopy_make(f, pv, 4, pool, &c, err);
    CHECK(st == DF_ERR_IO && c == NULL && has(err, "model.safetensors") && has(err, "failed"), "%d: %s", st, err);
    CHECK(memcmp(v, before, sizeof v) == 0, "no view moved after a failed copy");
    st_close(f);
    /* the file cut short after the set was opened: the same (on the copy's own thread) */
    st_set *g = NULL;
    REQUIRE(st_open_dir(d, NULL, 1, &g, err) == DF_OK, "%s", err);
    rc_views(g, v, err);
    memcpy(before, v, sizeof v);
    REQUIRE(truncate(path, 3000000) == 0);
    c = (rcopy *)1;
    st = rcopy_make(g, pv, 4, NULL, &c, err);
    CHECK(st == DF_ERR_IO && c == NULL && has(err, "'big'"), "%d: %s", st, err);
    CHECK(memcmp(v, before, sizeof v) == 0, "no view moved after a short file");
    st_close(g);
    pool_free(pool);
    st_close(m);
    st_close(r);
}

#ifdef MADV_HUGEPAGE
/* VMAs of the mapped file `path` whose VmFlags hold `flag` (/proc/self/smaps). */
static int vmas_flagged(const char *path, const char *flag) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[4096], want[8];
    snprintf(want, sizeof want, " %s", flag);
    int mine = 0, n = 0;
    size_t pl = strlen(path);
    while (fgets(line, sizeof line, f)) {
        size_t l = strcspn(line, "\n"), tok = strcspn(line, " ");
        line[l] = 0;
        if (strncmp(line, "VmFlags:", 8) == 0) n += mine && strstr(line + 8, want) != NULL;
        else if (memchr(line, '-', tok) && !memchr(line, ':', tok)) /* "start-end perms ... path" */
            mine = l >= pl && strcmp(line + l - pl, path) == 0;
    }
    fclose(f);
    return n;
}

static int not_x(const st_tensor *t, void *ctx) { (void)ctx; return strcmp(t->name, "x") != 0; }
#endif

TEST(fmt_st_hugepage_hint) {
    const char *d = t_tmpdir("fmt_huge");
    /* a (4 MB) | x (1 MB, not kept) | b (3 MB) | n (16 bytes): two runs of 2 MB or more */
    tspec t[] = {{"a", "BF16", 2, {2048, 1024}, NULL},
                 {"x", "BF16", 2, {512, 1024}, NULL},
                 {"b", "BF16", 2, {1536, 1024}, NULL},
                 {"n", "F32", 1, {4}, NULL}};
    REQUIRE(write_st(d, "model.safetensors", t, 4) == 0);
    st_set *a = NULL, *b = NULL;
    char err[DF_ERRMSG] = "";
    REQUIRE(st_open_dir(d, NULL, 1, &a, err) == DF_OK && st_open_dir(d, NULL, 0, &b, err) == DF_OK, "%s", err);
    CHECK(st_hugepage(b, NULL, NULL) == 0, "a set read into memory has no mapping to advise");
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", d);
#ifdef MADV_HUGEPAGE
    if (access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0) {
        int runs = st_hugepage(a, not_x, NULL);
        CHECK(runs == 2, "runs advised: %d", runs);
        int hg = vmas_flagged(path, "hg");
        /* a random-rows tensor gives the advice back */
        CHECK(st_random_rows(a, st_find(a, "a")) == 1);
        int hg2 = vmas_flagged(path, "hg"), rr = vmas_flagged(path, "rr"), nh = vmas_flagged(path, "nh");
        /* qemu-user answers madvise without passing it on: no flag at all
         * shows then, MADV_RANDOM's neither; where the kernel saw it, check */
        if (hg || rr) {
            CHECK(hg == 2, "VMAs with VM_HUGEPAGE: %d", hg);
            CHECK(hg2 == 1 && rr == 1 && nh == 1, "hg %d rr %d nh %d", hg2, rr, nh);
        }
    }
#endif
    /* the bytes read the same either way */
    for (int i = 0; i < 4; i++) {
        const st_tensor *ta = st_find(a, t[i].name), *tb = st_find(b, t[i].name);
        const uint8_t *pa = st_data(a, ta, err), *pb = st_data(b, tb, err);
        REQUIRE(pa && pb, "%s", err);
        CHECK(memcmp(pa, pb, (size_t)ta->nbytes) == 0, "tensor %s", t[i].name);
    }
    st_close(a);
    st_close(b);
}

TEST(fmt_st_read_error) {
    const char *d = t_tmpdir("fmt_eio");
    REQUIRE(write_st(d, "model.safetensors", three, 3) == 0);
    df_io io = io_with_pread(eio_pread);
    eio_left = 2; /* header length + header succeed, tensor reads fail */
    st_set *s = NULL;
    char err[DF_ERRMSG] = "";
    REQUIRE(st_open_dir(d, &io, 0, &s, err) == DF_OK, "%s", err);
    const st_tensor *t = st_find(s, "a.weight");
    CHECK(st_data(s, t, err) == NULL);
    CHECK(has(err, "model.safetensors") && has(err, "a.weight"), "%s", err);
    uint8_t buf[24];
    CHECK(st_read(s, t, buf, err) == DF_ERR_IO);
    st_close(s);
}

TEST(fmt_st_many_tensors) {
    const char *d = t_tmpdir("fmt_many");
    enum { N = 60000 };
    tspec *t = calloc(N, sizeof *t);
    char *names = malloc((size_t)N * 48);
    for (int i = 0; i < N; i++) {
        char *nm = names + (size_t)i * 48;
        snprintf(nm, 48, "model.layers.%d.mlp.experts.%d.w%d", i / 600, (i / 3) % 200, i % 3);
        t[i] = (tspec){nm, "U8", 1, {2}, NULL};
    }
    REQUIRE(write_st(d, "model.safetensors", t, N) == 0);
    st_set *s = NULL;
    char err[DF_ERRMSG] = "";
    REQUIRE(st_open_dir(d, NULL, 1, &s, err) == DF_OK, "%s", err);
    CHECK(st_count(s) == N);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        const st_tensor *x = st_find(s, t[i].name);
        if (!x || strcmp(x->name, t[i].name) != 0 || x->nbytes != 2) bad++;
    }
    CHECK(bad == 0, "%d lookups failed", bad);
    CHECK(st_find(s, "model.layers.0.mlp.experts.0.w9") == NULL);
    st_close(s);
    free(names);
    free(t);
}

/* ---- 4. safetensors bad -------------------------------------------------------- */

/* Opens d (mmap) expecting status `want` and every string of `needles` in the message. */
static void expect_fail(const char *d, df_status want, const char *n1, const char *n2) {
    st_set *s = (st_set *)1;
    char err[DF_ERRMSG] = "";
    df_status st = st_open_dir(d, NULL, 1, &s, err);
    CHECK(st == want, "got %s, want %s: %s", df_status_name(st), df_status_name(want), err);
    CHECK(s == NULL);
    if (n1) CHECK(has(err, n1), "message lacks '%s': %s", n1, err);
    if (n2) CHECK(has(err, n2), "message lacks '%s': %s", n2, err);
}

TEST(fmt_st_bad_too_short) {
    const char *d = t_tmpdir("fmt_short");
    REQUIRE(write_file(d, "model.safetensors", "\x05\x00\x00", 3) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "too short");
}

TEST(fmt_st_bad_truncated_data) {
    const char *d = t_tmpdir("fmt_trunc");
    const char *h = "{\"model.layers.1.mlp.gate.weight\":{\"dtype\":\"F32\",\"shape\":[1250],"
                    "\"data_offsets\":[0,5000]}}";
    uint8_t data[4096] = {0};
    REQUIRE(write_raw(d, "model-00002-of-00002.safetensors", h, data, sizeof data, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model-00002-of-00002.safetensors",
                "tensor 'model.layers.1.mlp.gate.weight' data_offsets [0, 5000] end past the data "
                "section (4096 bytes)");
}

TEST(fmt_st_bad_header_len) {
    const char *d = t_tmpdir("fmt_hlen");
    const char *h = "{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "z", 1, 1000) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "past the end of the file");
    REQUIRE(write_raw(d, "model.safetensors", h, "z", 1, (int64_t)1 << 40) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "limit");
}

TEST(fmt_st_bad_header_json) {
    const char *d = t_tmpdir("fmt_json");
    REQUIRE(write_raw(d, "model.safetensors", "{\"x\": [1, 2", NULL, 0, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "not valid JSON");
    REQUIRE(write_raw(d, "model.safetensors", "[1, 2]", NULL, 0, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "expected a JSON object");
    REQUIRE(write_raw(d, "model.safetensors", "{\"w\": 3}", NULL, 0, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "'w'");
}

TEST(fmt_st_bad_offsets) {
    const char *d = t_tmpdir("fmt_offs");
    const char *h = "{\"blk.w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[6,10]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "01234567", 8, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "tensor 'blk.w' data_offsets [6, 10]");
    h = "{\"blk.w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[5,4]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "01234567", 8, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "'blk.w'");
    h = "{\"blk.w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "01234567", 8, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "'blk.w'");
}

TEST(fmt_st_bad_overlap) {
    const char *d = t_tmpdir("fmt_overlap");
    const char *h = "{\"first\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                    "\"second\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[3,7]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "01234567", 8, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "overlap");
    st_set *s = NULL;
    char err[DF_ERRMSG] = "";
    st_open_dir(d, NULL, 0, &s, err);
    CHECK(has(err, "'first'") && has(err, "'second'"), "%s", err);
}

TEST(fmt_st_bad_size) {
    const char *d = t_tmpdir("fmt_size");
    const char *h = "{\"m.w\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,6]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "01234567", 8, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "tensor 'm.w'");
    st_set *s = NULL;
    char err[DF_ERRMSG] = "";
    st_open_dir(d, NULL, 1, &s, err);
    CHECK(has(err, "expected 8") && has(err, "[2, 2]"), "%s", err);
}

TEST(fmt_st_bad_dtype_and_shape) {
    const char *d = t_tmpdir("fmt_dtype");
    const char *h = "{\"m.w\":{\"dtype\":\"Q9\",\"shape\":[2],\"data_offsets\":[0,2]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "01", 2, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "tensor 'm.w' has unknown dtype 'Q9'");
    h = "{\"m.w\":{\"dtype\":\"U16\",\"shape\":[1],\"data_offsets\":[0,2]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "01", 2, -1) == 0);
    expect_fail(d, DF_ERR_UNSUPPORTED, "model.safetensors", "'m.w'");
    h = "{\"m.w\":{\"dtype\":\"U8\",\"shape\":[-2],\"data_offsets\":[0,2]}}";
    REQUIRE(write_raw(d, "model.safetensors", h, "01", 2, -1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "model.safetensors", "'m.w'");
}

TEST(fmt_st_bad_duplicate) {
    const char *d = t_tmpdir("fmt_dup");
    tspec a[] = {{"same.name", "U8", 1, {3}, NULL}};
    REQUIRE(write_st(d, "a.safetensors", a, 1) == 0 && write_st(d, "b.safetensors", a, 1) == 0);
    expect_fail(d, DF_ERR_FORMAT, "b.safetensors", "'same.name'");
}

TEST(fmt_st_bad_empty_dir) {
    const char *d = t_tmpdir("fmt_empty");
    expect_fail(d, DF_ERR_IO, d, "safetensors");
}

TEST(fmt_st_bad_index_missing_shard) {
    const char *d = t_tmpdir("fmt_idx_miss");
    tspec a[] = {{"x.w", "U8", 1, {3}, NULL}};
    REQUIRE(write_st(d, "model-00001-of-00002.safetensors", a, 1) == 0);
    REQUIRE(write_text(d, "model.safetensors.index.json",
                       "{\"weight_map\":{\"x.w\":\"model-00001-of-00002.safetensors\","
                       "\"y.w\":\"model-00002-of-00002.safetensors\"}}") == 0);
    expect_fail(d, DF_ERR_IO, "model-00002-of-00002.safetensors", "'y.w'");
}

TEST(fmt_st_bad_index_absent_tensor) {
    const char *d = t_tmpdir("fmt_idx_absent");
    tspec a[] = {{"x.w", "U8", 1, {3}, NULL}};
    tspec b[] = {{"z.w", "U8", 1, {3}, NULL}};
    REQUIRE(write_st(d, "s1.safetensors", a, 1) == 0 && write_st(d, "s2.safetensors", b, 1) == 0);
    REQUIRE(write_text(d, "model.safetensors.index.json",
                       "{\"weight_map\":{\"x.w\":\"s1.safetensors\",\"y.w\":\"s1.safetensors\","
                       "\"z.w\":\"s2.safetensors\"}}") == 0);
    expect_fail(d, DF_ERR_FORMAT, "s1.safetensors", "'y.w'");
    /* present, but in another shard than the index says */
    REQUIRE(write_text(d, "model.safetensors.index.json",
                       "{\"weight_map\":{\"x.w\":\"s1.safetensors\",\"z.w\":\"s1.safetensors\","
                       "\"q\":\"s2.safetensors\"}}") == 0);
    expect_fail(d, DF_ERR_FORMAT, "s1.safetensors", "'z.w'");
    REQUIRE(write_text(d, "model.safetensors.index.json",
                       "{\"weight_map\":{\"x.w\":\"../s1.safetensors\"}}") == 0);
    expect_fail(d, DF_ERR_FORMAT, "index.json", "outside");
    REQUIRE(write_text(d, "model.safetensors.index.json", "{\"weight_map\": 3}") == 0);
    expect_fail(d, DF_ERR_FORMAT, "index.json", "weight_map");
}

/* ---- 5. config ------------------------------------------------------------------ */

static df_status load_cfg(const char *tag, const char *json, df_config *c, char *err) {
    const char *d = t_tmpdir(tag);
    if (!d || write_text(d, "config.json", json) != 0) return DF_ERR_IO;
    return cfg_load(d, NULL, c, err);
}

#define MIN_DSV3 "\"model_type\":\"deepseek_v3\",\"hidden_size\":64,\"num_hidden_layers\":4," \
                 "\"num_attention_heads\":4,\"vocab_size\":1000"

TEST(fmt_cfg_defaults) {
    df_config c;
    char err[DF_ERRMSG] = "";
    REQUIRE(load_cfg("fmt_cfg_def", "{" MIN_DSV3 "}", &c, err) == DF_OK, "%s", err);
    CHECK(c.arch == ARCH_DEEPSEEK_V3 && !c.nested_text_config);
    CHECK(!strcmp(c.model_type, "deepseek_v3"));
    CHECK(c.hidden_size == 64 && c.num_hidden_layers == 4 && c.vocab_size == 1000);
    CHECK(c.num_attention_heads == 4 && c.num_key_value_heads == 4, "kv heads default to heads");
    CHECK(c.intermediate_size == 18432 && c.moe_intermediate_size == 2048);
    CHECK(c.n_shared_experts == 1 && c.n_routed_experts == 256 && c.num_experts_per_tok == 8);
    CHECK(c.n_group == 8 && c.topk_group == 4 && c.first_k_dense_replace == 3);
    CHECK(c.moe_layer_freq == 1 && c.norm_topk_prob == 1 && c.scoring_sigmoid == 1);
    CHECK(c.routed_scaling_factor == 2.5);
    CHECK(c.q_lora_rank == 1536 && c.kv_lora_rank == 512);
    CHECK(c.qk_nope_head_dim == 128 && c.qk_rope_head_dim == 64 && c.v_head_dim == 128);
    CHECK(c.rms_norm_eps == 1e-6 && c.max_position_embeddings == 4096);
    CHECK(c.bos_token_id == 0 && c.eos_token_id == 1 && c.pad_token_id == -1);
    CHECK(c.tie_word_embeddings == 0 && !strcmp(c.hidden_act, "silu"));
    CHECK(c.rope_type == ROPE_DEFAULT && c.rope_theta == 10000.0 && c.rope_interleave == 1);
    CHECK(c.quant == QUANT_NONE);
    CHECK(!strcmp(c.prefix, "model.") && !strcmp(c.lm_head, "lm_head.weight"));
    CHECK(!cfg_is_moe_layer(&c, 2) && cfg_is_moe_layer(&c, 3) && !cfg_is_moe_layer(&c, 4));
}

TEST(fmt_cfg_kimi_k2) {
    df_config c;
    char err[DF_ERRMSG] = "";
    df_status st = load_cfg(
        "fmt_cfg_k2",
        "{\"architectures\":[\"DeepseekV3ForCausalLM\"],\"model_type\":\"kimi_k2\","
        "\"hidden_size\":7168,\"num_hidden_layers\":61,\"num_attention_heads\":64,"
        "\"num_key_value_heads\":64,\"vocab_size\":163840,\"n_routed_experts\":384,"
        "\"n_group\":1,\"topk_group\":1,\"first_k_dense_replace\":1,\"q_lora_rank\":null,"
        "\"routed_scaling_factor\":2.827,\"rope_theta\":50000.0,\"eos_token_id\":[163585,163586],"
        "\"bos_token_id\":163584,\"scoring_func\":\"sigmoid\",\"topk_method\":\"noaux_tc\","
        "\"rope_scaling\":{\"type\":\"yarn\",\"factor\":32.0,\"beta_fast\":1.0,\"beta_slow\":1.0,"
        "\"mscale\":1.0,\"mscale_all_dim\":1.0,\"original_max_position_embeddings\":4096},"
        "\"max_position_embeddings\":131072,\"moe_layer_freq\":1,"
        "\"quantization_config\":{\"activation_scheme\":\"dynamic\",\"fmt\":\"e4m3\","
        "\"quant_method\":\"fp8\",\"weight_block_size\":[128,128]}}",
        &c, err);
    REQUIRE(st == DF_OK, "%s", err);
    CHECK(c.arch == ARCH_DEEPSEEK_V3 && c.n_routed_experts == 384 && c.q_lora_rank == 0);
    CHECK(c.eos_token_id == 163585 && c.bos_token_id == 163584);
    CHECK(c.rope_type == ROPE_YARN && c.yarn_factor == 32.0 && c.yarn_beta_fast == 1.0);
    CHECK(c.yarn_mscale_all_dim == 1.0 && c.yarn_original_max_pos == 4096 && c.rope_theta == 50000.0);
    CHECK(c.quant == QUANT_FP8_BLOCK && c.fp8_block_rows == 128 && c.fp8_block_cols == 128);
    CHECK(cfg_is_moe_layer(&c, 1) && !cfg_is_moe_layer(&c, 0) && !cfg_is_moe_layer(&c, 61));
}

TEST(fmt_cfg_rope_parameters) {
    df_config c;
    char err[DF_ERRMSG] = "";
    REQUIRE(load_cfg("fmt_cfg_rp",
                     "{" MIN_DSV3 ",\"max_position_embeddings\":8192,\"rope_parameters\":"
                     "{\"rope_type\":\"yarn\",\"rope_theta\":20000,\"factor\":4}}",
                     &c, err) == DF_OK,
            "%s", err);
    CHECK(c.rope_type == ROPE_YARN && c.rope_theta == 20000.0 && c.yarn_factor == 4.0);
    CHECK(c.yarn_beta_fast == 32.0 && c.yarn_beta_slow == 1.0 && c.yarn_mscale == 1.0);
    CHECK(c.yarn_mscale_all_dim == 0.0 && c.yarn_original_max_pos == 8192);
    CHECK(load_cfg("fmt_cfg_rp2", "{" MIN_DSV3 ",\"rope_scaling\":{\"type\":\"linear\",\"factor\":2}}",
                   &c, err) == DF_ERR_UNSUPPORTED && has(err, "linear"), "%s", err);
    CHECK(load_cfg("fmt_cfg_rp3", "{" MIN_DSV3 ",\"rope_scaling\":{\"type\":\"yarn\"}}", &c, err) ==
              DF_ERR_CONFIG && has(err, "factor"), "%s", err);
}

TEST(fmt_cfg_nested_text_config) {
    df_config c;
    char err[DF_ERRMSG] = "";
    df_status st = load_cfg(
        "fmt_cfg_nest",
        "{\"model_type\":\"kimi_k25\",\"architectures\":[\"KimiK25ForConditionalGeneration\"],"
        "\"tie_word_embeddings\":true,\"text_config\":{\"model_type\":\"deepseek_v3\","
        "\"hidden_size\":128,\"num_hidden_layers\":3,\"num_attention_heads\":2,"
        "\"vocab_size\":500,\"n_routed_experts\":8,\"n_group\":1,\"topk_group\":1,"
        "\"num_experts_per_tok\":2,\"first_k_dense_replace\":1,\"eos_token_id\":7},"
        "\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
        "\"format\":\"pack-quantized\",\"config_groups\":{\"group_0\":{\"weights\":"
        "{\"num_bits\":4,\"group_size\":32}}}}}",
        &c, err);
    REQUIRE(st == DF_OK, "%s", err);
    CHECK(c.nested_text_config == 1 && c.arch == ARCH_DEEPSEEK_V3);
    CHECK(!strcmp(c.model_type, "deepseek_v3") && c.hidden_size == 128 && c.eos_token_id == 7);
    CHECK(c.tie_word_embeddings == 1, "falls back to the root");
    CHECK(c.quant == QUANT_CT_INT4);
    CHECK(!strcmp(c.prefix, "language_model.model.") &&
          !strcmp(c.lm_head, "language_model.lm_head.weight"));
    /* errors inside text_config are named with their path */
    st = load_cfg("fmt_cfg_nest2",
                  "{\"model_type\":\"kimi_k25\",\"text_config\":{\"model_type\":\"kimi_k2\","
                  "\"hidden_size\":0,\"num_hidden_layers\":3,\"num_attention_heads\":2,"
                  "\"vocab_size\":500}}",
                  &c, err);
    CHECK(st == DF_ERR_CONFIG && has(err, "text_config.hidden_size") && has(err, "config.json"),
          "%s", err);
}

TEST(fmt_cfg_kimi_k3) {
    df_config c;
    char err[DF_ERRMSG] = "";
    df_status st = load_cfg(
        "fmt_cfg_k3",
        "{\"model_type\":\"kimi_k3\",\"bos_token_id\":163584,\"eos_token_id\":163586,"
        "\"text_config\":{\"model_type\":\"kimi_linear\",\"hidden_act\":\"situ\","
        "\"hidden_size\":7168,\"vocab_size\":163840,\"num_hidden_layers\":5,"
        "\"num_attention_heads\":96,\"num_key_value_heads\":96,\"first_k_dense_replace\":1,"
        "\"moe_layer_freq\":1,\"intermediate_size\":33792,\"moe_intermediate_size\":3072,"
        "\"num_experts\":896,\"num_experts_per_token\":16,\"num_shared_experts\":2,"
        "\"moe_router_activation_func\":\"sigmoid\",\"num_expert_group\":1,\"topk_group\":1,"
        "\"moe_renormalize\":true,\"routed_scaling_factor\":1.0,\"q_lora_rank\":1536,"
        "\"kv_lora_rank\":512,\"qk_nope_head_dim\":128,\"qk_rope_head_dim\":64,"
        "\"v_head_dim\":128,\"rms_norm_eps\":1e-5,\"max_position_embeddings\":1048576,"
        "\"linear_attn_config\":{\"head_dim\":128,\"num_heads\":96,\"kda_layers\":[1,2,3],"
        "\"full_attn_layers\":[4,5]},"
        "\"activation_situ_beta\":4.0,\"attn_res_block_size\":12,"
        "\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
        "\"format\":\"mxfp4-pack-quantized\",\"config_groups\":{\"group_0\":{\"weights\":"
        "{\"group_size\":32,\"num_bits\":4,\"type\":\"float\"}}}}}}",
        &c, err);
    REQUIRE(st == DF_OK, "%s", err);
    CHECK(c.arch == ARCH_KIMI_K3 && c.nested_text_config && !strcmp(c.model_type, "kimi_linear"));
    CHECK(c.n_routed_experts == 896 && c.num_experts_per_tok == 16 && c.n_shared_experts == 2);
    CHECK(c.n_group == 1 && c.norm_topk_prob == 1 && c.routed_scaling_factor == 1.0);
    CHECK(c.bos_token_id == 163584 && c.eos_token_id == 163586 && !strcmp(c.hidden_act, "situ"));
    CHECK(c.quant == QUANT_CT_MXFP4 && c.rms_norm_eps == 1e-5);
    CHECK(!strcmp(c.prefix, "language_model.model."));
    CHECK(c.is_kda[0] == 1 && c.is_kda[2] == 1 && c.is_kda[3] == 0, "cfg_load_kimi ran");
    CHECK(load_cfg("fmt_cfg_kl", "{\"model_type\":\"kimi_linear\",\"hidden_size\":64,"
                   "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"vocab_size\":1000,"
                   "\"num_experts\":4,\"num_experts_per_token\":2,\"linear_attn_config\":{\"head_dim\":16,"
                   "\"kda_layers\":[1,2,3],\"full_attn_layers\":[4]}}", &c, err) == DF_OK, "%s", err);
    CHECK(c.arch == ARCH_KIMI_LINEAR && c.n_routed_experts == 4);
}

TEST(fmt_cfg_missing) {
    const char *d = t_tmpdir("fmt_cfg_none");
    df_config c;
    char err[DF_ERRMSG] = "";
    CHECK(cfg_load(d, NULL, &c, err) == DF_ERR_CONFIG);
    CHECK(has(err, "config.json: not found") && has(err, d), "%s", err);
    CHECK(load_cfg("fmt_cfg_req", "{\"model_type\":\"deepseek_v3\",\"hidden_size\":64,"
                   "\"num_hidden_layers\":4,\"num_attention_heads\":4}", &c, err) == DF_ERR_CONFIG);
    CHECK(has(err, "'vocab_size'") && has(err, "missing"), "%s", err);
    CHECK(load_cfg("fmt_cfg_notjson", "{\"model_type\": ", &c, err) == DF_ERR_CONFIG);
    CHECK(has(err, "config.json") && has(err, "JSON"), "%s", err);
}

TEST(fmt_cfg_absurd_fields) {
    df_config c;
    char err[DF_ERRMSG] = "";
    CHECK(load_cfg("fmt_cfg_neg", "{\"model_type\":\"deepseek_v3\",\"hidden_size\":-4,"
                   "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"vocab_size\":1000}",
                   &c, err) == DF_ERR_CONFIG);
    CHECK(has(err, "config.json: field 'hidden_size' must be a positive integer") &&
          has(err, "(got -4)"), "%s", err);
    CHECK(load_cfg("fmt_cfg_type", "{" MIN_DSV3 ",\"n_routed_experts\":\"many\"}", &c, err) ==
          DF_ERR_CONFIG);
    CHECK(has(err, "'n_routed_experts'") && has(err, "integer") && has(err, "many"), "%s", err);
    CHECK(load_cfg("fmt_cfg_type2", "{" MIN_DSV3 ",\"rms_norm_eps\":\"small\"}", &c, err) ==
          DF_ERR_CONFIG && has(err, "'rms_norm_eps'"), "%s", err);
    CHECK(load_cfg("fmt_cfg_type3", "{" MIN_DSV3 ",\"norm_topk_prob\":\"yes\"}", &c, err) ==
          DF_ERR_CONFIG && has(err, "'norm_topk_prob'"), "%s", err);
    CHECK(load_cfg("fmt_cfg_group", "{" MIN_DSV3 ",\"n_routed_experts\":10,\"n_group\":3,"
                   "\"topk_group\":1}", &c, err) == DF_ERR_CONFIG);
    CHECK(has(err, "'n_group'") && has(err, "n_routed_experts"), "%s", err);
    CHECK(load_cfg("fmt_cfg_topk", "{" MIN_DSV3 ",\"n_routed_experts\":8,\"n_group\":1,"
                   "\"topk_group\":1,\"num_experts_per_tok\":9}", &c, err) == DF_ERR_CONFIG &&
          has(err, "'num_experts_per_tok'"), "%s", err);
    CHECK(load_cfg("fmt_cfg_dense", "{" MIN_DSV3 ",\"first_k_dense_replace\":5}", &c, err) ==
          DF_ERR_CONFIG && has(err, "'first_k_dense_replace'"), "%s", err);
    CHECK(load_cfg("fmt_cfg_layers", "{\"model_type\":\"deepseek_v3\",\"hidden_size\":64,"
                   "\"num_hidden_layers\":100000,\"num_attention_heads\":4,\"vocab_size\":1000}",
                   &c, err) == DF_ERR_CONFIG && has(err, "'num_hidden_layers'"), "%s", err);
    CHECK(load_cfg("fmt_cfg_act", "{" MIN_DSV3 ",\"hidden_act\":\"situ\"}", &c, err) ==
          DF_ERR_UNSUPPORTED && has(err, "'hidden_act'"), "%s", err);
    CHECK(load_cfg("fmt_cfg_act2", "{" MIN_DSV3 ",\"hidden_act\":\"gelu\"}", &c, err) ==
          DF_ERR_UNSUPPORTED && has(err, "gelu"), "%s", err);
}

TEST(fmt_cfg_unsupported) {
    df_config c;
    char err[DF_ERRMSG] = "";
    CHECK(load_cfg("fmt_cfg_q", "{" MIN_DSV3 ",\"quantization_config\":{\"quant_method\":\"awq\"}}",
                   &c, err) == DF_ERR_UNSUPPORTED);
    CHECK(has(err, "quant_method") && has(err, "awq"), "%s", err);
    CHECK(load_cfg("fmt_cfg_q2", "{" MIN_DSV3 ",\"quantization_config\":{\"quant_method\":"
                   "\"compressed-tensors\",\"format\":\"float-quantized\"}}", &c, err) ==
          DF_ERR_UNSUPPORTED && has(err, "float-quantized"), "%s", err);
    CHECK(load_cfg("fmt_cfg_v2", "{\"model_type\":\"deepseek_v2\",\"hidden_size\":64,"
                   "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"vocab_size\":1000}",
                   &c, err) == DF_ERR_UNSUPPORTED && has(err, "deepseek_v2"), "%s", err);
    CHECK(load_cfg("fmt_cfg_llama", "{\"model_type\":\"llama\",\"hidden_size\":64,"
                   "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"vocab_size\":1000}",
                   &c, err) == DF_ERR_UNSUPPORTED && has(err, "llama"), "%s", err);
    CHECK(load_cfg("fmt_cfg_arch", "{\"model_type\":\"custom\",\"architectures\":"
                   "[\"DeepseekV3ForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":4,"
                   "\"num_attention_heads\":4,\"vocab_size\":1000}", &c, err) == DF_OK, "%s", err);
    CHECK(c.arch == ARCH_DEEPSEEK_V3);
}

/* ---- 6. weights ------------------------------------------------------------------ */

TEST(fmt_wt_bind_types) {
    const char *d = t_tmpdir("fmt_wt");
    int32_t shp[2] = {4, 64};
    uint16_t vec[3] = {0x3f80, 0x4000, 0xc040}; /* bf16 1, 2, -3 */
    tspec t[] = {
        {"m.a.weight", "BF16", 2, {4, 6}, NULL},
        {"m.f.weight", "F8_E4M3", 2, {200, 130}, NULL},
        {"m.f.weight_scale_inv", "F32", 2, {2, 2}, NULL},
        {"m.q.weight_packed", "I32", 2, {4, 8}, NULL},
        {"m.q.weight_scale", "BF16", 2, {4, 2}, NULL},
        {"m.q.weight_shape", "I32", 1, {2}, shp},
        {"m.x.weight_packed", "U8", 2, {4, 32}, NULL},
        {"m.x.weight_scale", "U8", 2, {4, 2}, NULL},
        {"m.norm.weight", "BF16", 1, {3}, vec},
    };
    REQUIRE(write_st(d, "model.safetensors", t, 9) == 0);
    for (int mm = 0; mm <= 1; mm++) {
        st_set *s = NULL;
        char err[DF_ERRMSG] = "";
        REQUIRE(st_open_dir(d, NULL, mm, &s, err) == DF_OK, "%s", err);
        df_weight w;
        CHECK(wt_bind(s, "m.a", 4, 6, 0, 0, &w, err) == DF_OK && w.type == WT_BF16 && w.data,
              "%s", err);
        CHECK(wt_bytes(&w) == 48 && !strcmp(wt_type_name(w.type), "bf16"));
        CHECK(wt_bind(s, "m.f", 200, 130, 128, 128, &w, err) == DF_OK && w.type == WT_FP8_BLOCK,
              "%s", err);
        CHECK(w.block_rows == 128 && w.block_cols == 128 && w.scale && wt_bytes(&w) == 26000 + 16);
        CHECK(wt_bind(s, "m.f", 200, 130, 0, 0, &w, err) == DF_OK, "block default 128: %s", err);
        CHECK(wt_bind(s, "m.q", 4, 64, 0, 0, &w, err) == DF_OK && w.type == WT_INT4_G32, "%s", err);
        CHECK(w.scale_dtype == DT_BF16 && wt_bytes(&w) == 128 + 16);
        CHECK(wt_bind(s, "m.x", 4, 64, 0, 0, &w, err) == DF_OK && w.type == WT_MXFP4, "%s", err);
        CHECK(wt_bytes(&w) == 128 + 8);
        CHECK(wt_exists(s, "m.q") && wt_exists(s, "m.a") && !wt_exists(s, "m.zz"));
        float v[3];
        CHECK(wt_load_vec(s, "m.norm.weight", 3, v, err) == DF_OK && v[0] == 1.0f && v[1] == 2.0f &&
              v[2] == -3.0f, "%s", err);
        CHECK(wt_load_vec(s, "m.norm.weight", 4, v, err) == DF_ERR_MISMATCH &&
              has(err, "'m.norm.weight'") && has(err, "[3]") && has(err, "[4]"), "%s", err);
        st_close(s);
    }
}

TEST(fmt_wt_bind_errors) {
    const char *d = t_tmpdir("fmt_wt_err");
    int64_t shp[2] = {4, 96};
    tspec t[] = {
        {"model.layers.0.mlp.gate_proj.weight", "BF16", 2, {16, 8}, NULL},
        {"m.f.weight", "F8_E4M3", 2, {4, 4}, NULL},
        {"m.g.weight", "F8_E4M3", 2, {256, 256}, NULL},
        {"m.g.weight_scale_inv", "F32", 2, {1, 2}, NULL},
        {"m.q.weight_packed", "I32", 2, {4, 8}, NULL},
        {"m.q.weight_scale", "BF16", 2, {4, 2}, NULL},
        {"m.q.weight_shape", "I64", 1, {2}, shp},
        {"m.i8.weight", "I8", 2, {2, 2}, NULL},
    };
    REQUIRE(write_st(d, "model-00001-of-00001.safetensors", t, 8) == 0);
    st_set *s = NULL;
    char err[DF_ERRMSG] = "";
    REQUIRE(st_open_dir(d, NULL, 1, &s, err) == DF_OK, "%s", err);
    df_weight w;
    CHECK(wt_bind(s, "model.layers.0.mlp.gate_proj", 8, 16, 0, 0, &w, err) == DF_ERR_MISMATCH);
    CHECK(has(err, "model-00001-of-00001.safetensors") &&
          has(err, "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [16, 8], expected [8, 16]"),
          "%s", err);
    CHECK(wt_bind(s, "model.layers.0.mlp.up_proj", 8, 16, 0, 0, &w, err) == DF_ERR_MISMATCH);
    CHECK(has(err, "tensor 'model.layers.0.mlp.up_proj.weight' not found in") && has(err, d), "%s",
          err);
    CHECK(wt_bind(s, "m.f", 4, 4, 0, 0, &w, err) == DF_ERR_MISMATCH &&
          has(err, "m.f.weight_scale_inv"), "%s", err);
    CHECK(wt_bind(s, "m.g", 256, 256, 128, 128, &w, err) == DF_ERR_MISMATCH &&
          has(err, "'m.g.weight_scale_inv' has shape [1, 2], expected [2, 2]"), "%s", err);
    CHECK(wt_bind(s, "m.q", 4, 64, 0, 0, &w, err) == DF_ERR_MISMATCH &&
          has(err, "m.q.weight_shape") && has(err, "[4, 96]"), "%s", err);
    CHECK(wt_bind(s, "m.q", 4, 32, 0, 0, &w, err) == DF_ERR_MISMATCH &&
          has(err, "'m.q.weight_packed'"), "%s", err);
    /* an I8 weight (the int8 spine's row-int8) needs its f32 scale per row */
    CHECK(wt_bind(s, "m.i8", 2, 2, 0, 0, &w, err) == DF_ERR_MISMATCH &&
          has(err, "'m.i8.weight_scale'") && has(err, "one f32 scale per row"), "%s", err);
    CHECK(wt_load_vec(s, "m.none", 3, NULL, err) == DF_ERR_MISMATCH && has(err, "'m.none'"), "%s",
          err);
    st_close(s);
}
