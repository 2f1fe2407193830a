/* test_hub.c — the hub client, span logs and mirrors (suite hub_).
 *
 * Unit tests: sha256 vectors, span-set algebra, the span log's torn-tail
 * handling, the listing parsers (model info, tree pages, Link headers). End-to-end tests run `deltafin setup / fetch-experts / doctor /
 * logits` against tests/hub/hub_emu.py (a local hub emulator on loopback)
 * serving a synthetic Kimi K3 (`deltafin synth --preset tiny`), with faults:
 * 500s, dropped connections, short bodies, corrupt bytes, slowness, a
 * process killed mid-download, and a model info without sizes (the tree
 * API's pages give them).
 */
#include "test.h"
#include "../src/format/safetensors.h"
#include "../src/hub/hub.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- unit tests ---- */

static void sha_hex(const void *p, size_t n, char hex[65]) {
    hub_sha256 c;
    hub_sha256_init(&c);
    hub_sha256_update(&c, p, n);
    hub_sha256_hex(&c, hex);
}

TEST(hub_sha256_vectors) {
    char hex[65];
    sha_hex("", 0, hex);
    CHECK(!strcmp(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"), "%s", hex);
    sha_hex("abc", 3, hex);
    CHECK(!strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"), "%s", hex);
    const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    sha_hex(m, strlen(m), hex);
    CHECK(!strcmp(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"), "%s", hex);
    char *a = malloc(1000000);
    REQUIRE(a);
    memset(a, 'a', 1000000);
    hub_sha256 c;
    hub_sha256_init(&c);
    for (size_t off = 0, k = 1; off < 1000000; off += k, k = k * 3 % 997 + 1)
        hub_sha256_update(&c, a + off, off + k > 1000000 ? 1000000 - off : k);
    hub_sha256_hex(&c, hex);
    CHECK(!strcmp(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"), "%s", hex);
    free(a);
    hub_sha1 g;
    char gh[41];
    hub_git_blob_init(&g, 6);
    hub_sha1_update(&g, "hello\n", 6);
    hub_sha1_hex(&g, gh);
    CHECK(!strcmp(gh, "ce013625030ba8dba906f756967f9e9ca394464a"), "git blob id %s", gh);
}

TEST(hub_spans_algebra) {
    hub_spans s = {0}, m = {0};
    CHECK(hub_spans_add(&s, 10, 20) == 0 && hub_spans_add(&s, 30, 40) == 0 && hub_spans_add(&s, 50, 60) == 0);
    CHECK(s.n == 3 && hub_spans_bytes(&s) == 30);
    CHECK(hub_spans_add(&s, 20, 30) == 0 && s.n == 2 && s.v[0].a == 10 && s.v[0].b == 40, "adjacent spans merge");
    CHECK(hub_spans_covers(&s, 12, 38) && !hub_spans_covers(&s, 5, 12) && !hub_spans_covers(&s, 38, 52));
    CHECK(hub_spans_covers(&s, 7, 7), "an empty range is covered");
    CHECK(hub_spans_missing(&s, 0, 70, &m) == 0 && m.n == 3, "missing pieces %d", m.n);
    CHECK(m.v[0].a == 0 && m.v[0].b == 10 && m.v[1].a == 40 && m.v[1].b == 50 && m.v[2].a == 60 && m.v[2].b == 70);
    CHECK(hub_spans_overlaps(&s, 39, 41) && !hub_spans_overlaps(&s, 40, 50));
    hub_spans_remove(&s, 15, 35);
    CHECK(s.n == 3 && s.v[0].b == 15 && s.v[1].a == 35 && s.v[1].b == 40, "remove splits");
    hub_spans_remove(&s, 0, 100);
    CHECK(s.n == 0);
    CHECK(hub_spans_add(&s, 5, 8) == 0 && hub_spans_add(&s, 1, 100) == 0 && s.n == 1 && s.v[0].a == 1 && s.v[0].b == 100);
    hub_spans_free(&s);
    hub_spans_free(&m);
}

TEST(hub_log_torn_tail) {
    const char *d = t_tmpdir("hublog");
    REQUIRE(d);
    char path[512];
    snprintf(path, sizeof path, "%s/x.spans", d);
    hub_spans s = {0};
    hub_log lg;
    char err[DF_ERRMSG];
    REQUIRE(hub_log_open(path, 1000, &s, &lg, err) == DF_OK, "%s", err);
    CHECK(hub_log_append(&lg, 0, 100, err) == DF_OK);
    CHECK(hub_log_append(&lg, 200, 300, err) == DF_OK);
    CHECK(hub_log_append(&lg, 100, 150, err) == DF_OK);
    hub_log_close(&lg);
    /* a torn append: half a record of garbage at the end */
    int fd = open(path, O_WRONLY | O_APPEND);
    REQUIRE(fd >= 0);
    CHECK(write(fd, "\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c", 12) == 12);
    close(fd);
    hub_spans r = {0};
    int64_t fs;
    CHECK(hub_log_read(path, &r, &fs, err) == DF_OK && fs == 1000);
    CHECK(r.n == 2 && r.v[0].a == 0 && r.v[0].b == 150 && r.v[1].a == 200, "spans %d", r.n);
    hub_spans_free(&r);
    REQUIRE(hub_log_open(path, 1000, &s, &lg, err) == DF_OK, "%s", err);
    CHECK(s.n == 2 && hub_spans_bytes(&s) == 250);
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && sb.st_size == 16 + 3 * 24, "torn tail truncated (%lld)", (long long)sb.st_size);
    CHECK(hub_log_append(&lg, 900, 1000, err) == DF_OK);
    hub_log_close(&lg);
    hub_spans_free(&s);
    /* a log describing a file of another size is not believed */
    REQUIRE(hub_log_open(path, 2000, &s, &lg, err) == DF_OK, "%s", err);
    CHECK(s.n == 0, "a log for another size starts empty");
    hub_log_close(&lg);
    hub_spans_free(&s);
}

/* The listing parsers: a model info without sizes, tree pages filling them
 * (directories skipped, files the info does not list ignored), Link headers,
 * and refusals whose message names the file (it once named freed memory). */
TEST(hub_listing_parsers) {
    static const char info[] =
        "{\"sha\": \"0123456789abcdef0123456789abcdef01234567\", \"siblings\": ["
        "{\"rfilename\": \"config.json\"}, {\"rfilename\": \"sub/model-00001-of-00001.safetensors\"},"
        "{\"rfilename\": \"README.md\", \"size\": 5, \"blobId\": \"ce013625030ba8dba906f756967f9e9ca394464a\"}]}";
    static const char page1[] =
        "[{\"type\": \"directory\", \"path\": \"sub\", \"size\": 0, \"oid\": \"0000000000000000000000000000000000000000\"},"
        " {\"type\": \"file\", \"path\": \"config.json\", \"size\": 123, \"oid\": \"ce013625030ba8dba906f756967f9e9ca394464b\"},"
        " {\"type\": \"file\", \"path\": \"extra.bin\", \"size\": 9}]";
    static const char page2[] =
        "[{\"type\": \"file\", \"path\": \"sub/model-00001-of-00001.safetensors\", \"size\": 4000, \"oid\": \"ce013625030ba8dba906f756967f9e9ca394464c\","
        " \"lfs\": {\"oid\": \"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\", \"size\": 4000, \"pointerSize\": 134}}]";
    hub_listing l;
    char err[DF_ERRMSG];
    REQUIRE(hub_parse_info(info, strlen(info), "listing x", &l, err) == DF_OK, "%s", err);
    REQUIRE(l.n_files == 3);
    CHECK(l.files[0].size == -1 && l.files[1].size == -1 && l.files[2].size == 5 && l.files[2].git[0]);
    CHECK(hub_parse_tree(page1, strlen(page1), "listing x", &l, err) == DF_OK, "%s", err);
    CHECK(l.files[0].size == 123 && !strcmp(l.files[0].git, "ce013625030ba8dba906f756967f9e9ca394464b") && l.n_files == 3,
          "config.json from the tree: %lld", (long long)l.files[0].size);
    CHECK(l.files[1].size == -1, "the shard is on the next page");
    CHECK(hub_parse_tree(page2, strlen(page2), "listing x", &l, err) == DF_OK, "%s", err);
    CHECK(l.files[1].size == 4000 && !strcmp(l.files[1].sha256, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855") &&
          !l.files[1].git[0], "an LFS file takes the lfs oid, not the pointer's blob id");
    CHECK(hub_parse_tree("{}", 2, "listing x", &l, err) == DF_ERR_FORMAT && strstr(err, "not a JSON array"), "%s", err);
    hub_listing_free(&l);
    static const char bad_name[] = "{\"sha\": \"0\", \"siblings\": [{\"rfilename\": \"a\", \"size\": 1}, {\"rfilename\": \"../evil-name\"}]}";
    CHECK(hub_parse_info(bad_name, strlen(bad_name), "listing x", &l, err) == DF_ERR_FORMAT && strstr(err, "'../evil-name'"),
          "the refused name is named: %s", err);
    hub_listing_free(&l);
    static const char twice[] = "{\"sha\": \"0\", \"siblings\": [{\"rfilename\": \"model.bin\"}, {\"rfilename\": \"a\"}, {\"rfilename\": \"model.bin\"}]}";
    CHECK(hub_parse_info(twice, strlen(twice), "listing x", &l, err) == DF_ERR_FORMAT && strstr(err, "lists model.bin twice"), "%s", err);
    hub_listing_free(&l);
    /* Link headers */
    char url[64];
    const char *h1 = " <https://h/api/models/r/tree/main?cursor=abc>; rel=\"next\"";
    CHECK(hub_link_next(h1, strlen(h1), url, sizeof url) == 1 && !strcmp(url, "https://h/api/models/r/tree/main?cursor=abc"), "%s", url);
    const char *h2 = "<https://h/a?x=1,2>; rel=\"prev\"; title=\"a, b\", <https://h/b>; REL=\"last next\"";
    CHECK(hub_link_next(h2, strlen(h2), url, sizeof url) == 1 && !strcmp(url, "https://h/b"), "%s", url);
    const char *h5 = "<https://h/d>; rel=next\r\n"; /* unquoted, as the header line ends */
    CHECK(hub_link_next(h5, strlen(h5), url, sizeof url) == 1 && !strcmp(url, "https://h/d"), "%s", url);
    const char *h3 = "<https://h/a>; rel=prev, <https://h/c>; rel=nexts";
    CHECK(hub_link_next(h3, strlen(h3), url, sizeof url) == 0);
    const char *h4 = "<https://h/a-very-long-url-that-does-not-fit-in-sixty-four-bytes-of-buffer>; rel=next";
    CHECK(hub_link_next(h4, strlen(h4), url, sizeof url) == -1);
    CHECK(hub_link_next("<", 1, url, sizeof url) == 0 && hub_link_next("", 0, url, sizeof url) == 0);
    /* a NUL or a control byte in the target is not a URL (found by fuzz_hub_listing: it read as no link) */
    CHECK(hub_link_next("<\0x>; rel=next", 14, url, sizeof url) == -1 && hub_link_next("<a\rb>; rel=next", 15, url, sizeof url) == -1);
}

/* ---- the emulator ---- */

typedef struct {
    char dir[256];   /* its files: port, log.jsonl */
    int pid, port;
} emu;

static const char *src_model(void) {
    static char dir[256];
    static int made;
    if (made) return made > 0 ? dir : NULL;
    const char *d = t_tmpdir("hubsrc");
    made = -1;
    if (!d) return NULL;
    snprintf(dir, sizeof dir, "%s/m", d);
    char out[4096];
    if (t_sh(out, sizeof out, "%s synth --arch kimi_k3 --preset tiny --shard-size 1M --out %s", t_bin(), dir) != 0) {
        fprintf(stderr, "%s", out);
        return NULL;
    }
    made = 1;
    return dir;
}

static int emu_start(emu *e, const char *tag, const char *root, const char *extra) {
    const char *d = t_tmpdir(tag);
    if (!d) return -1;
    snprintf(e->dir, sizeof e->dir, "%s", d);
    char out[256];
    if (t_sh(out, sizeof out,
             "python3 tests/hub/hub_emu.py --root %s --port-file %s/port --log %s/log.jsonl %s "
             ">%s/emu.out 2>&1 & echo $!",
             root, d, d, extra ? extra : "", d) != 0)
        return -1;
    e->pid = atoi(out);
    char pf[300];
    snprintf(pf, sizeof pf, "%s/port", d);
    for (int i = 0; i < 200; i++) {
        FILE *f = fopen(pf, "r");
        if (f) {
            int ok = fscanf(f, "%d", &e->port) == 1;
            fclose(f);
            if (ok) return 0;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return -1;
}

static void emu_stop(emu *e) {
    if (e->pid > 0) kill(e->pid, SIGTERM);
    e->pid = 0;
}

/* Lines in the emulator's request log. */
static int log_lines(const emu *e) {
    char p[300], line[4096];
    snprintf(p, sizeof p, "%s/log.jsonl", e->dir);
    FILE *f = fopen(p, "r");
    if (!f) return 0;
    int n = 0;
    while (fgets(line, sizeof line, f)) n++;
    fclose(f);
    return n;
}

/* Sum of body bytes of requests after line `from` whose path contains `sub`
 * (NULL: any), and their count. */
static int64_t log_bytes(const emu *e, int from, const char *sub, int *count) {
    char p[300], line[4096];
    snprintf(p, sizeof p, "%s/log.jsonl", e->dir);
    FILE *f = fopen(p, "r");
    int64_t t = 0;
    *count = 0;
    if (!f) return 0;
    for (int n = 0; fgets(line, sizeof line, f); n++) {
        if (n < from) continue;
        json_t *j = json_loads(line, 0, NULL);
        if (!j) continue;
        const char *path = json_string_value(json_object_get(j, "path"));
        if (path && (!sub || strstr(path, sub))) {
            t += json_integer_value(json_object_get(j, "bytes"));
            (*count)++;
        }
        json_decref(j);
    }
    fclose(f);
    return t;
}

#define ENV(e) "HF_ENDPOINT=http://127.0.0.1:%d DF_HUB_RETRY_MS=5 ", (e)->port
static char out[16384];

static int files_equal(const char *a, const char *b) {
    return t_sh(NULL, 0, "cmp -s %s %s", a, b) == 0;
}

/* ---- end to end ---- */

TEST(hub_setup_full_with_faults) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    REQUIRE(emu_start(&e, "hubemu1", src, "--faults list500:1,500:1,drop:1,short:1,corrupt:1") == 0, "emulator did not start");
    const char *d = t_tmpdir("hubfull");
    char dir[300];
    snprintf(dir, sizeof dir, "%s/k3", d);
    int rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d DF_HUB_RETRY_MS=5 %s setup deltafin/tiny-k3 --dir %s --workers 2",
                  e.port, t_bin(), dir);
    CHECK(rc == 0, "setup failed: %s", out);
    CHECK(strstr(out, "mode full"), "auto mode picks full when it fits: %s", out);
    const char *names[] = {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                           "model-00002-of-00002.safetensors"};
    for (int i = 0; i < 4; i++) {
        char a[400], b[400];
        snprintf(a, sizeof a, "%s/%s", src, names[i]);
        snprintf(b, sizeof b, "%s/%s", dir, names[i]);
        CHECK(files_equal(a, b), "%s differs after faults", names[i]);
    }
    int parts = t_sh(NULL, 0, "ls %s/*.part", dir);
    CHECK(parts != 0, "no .part file left behind");
    /* again: nothing is downloaded twice */
    int before = log_lines(&e), n;
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/tiny-k3 --dir %s", e.port, t_bin(), dir);
    CHECK(rc == 0, "second setup: %s", out);
    CHECK(log_bytes(&e, before, "/resolve/", &n) == 0 && n == 0, "second setup fetched %d files", n);
    rc = t_sh(out, sizeof out, "%s doctor %s --hash", t_bin(), dir);
    CHECK(rc == 0 && strstr(out, "ok"), "doctor: %s", out);
    /* doctor sees a flipped byte */
    int flip = t_sh(NULL, 0, "printf 'Z' | dd of=%s/model-00002-of-00002.safetensors bs=1 seek=200000 conv=notrunc 2>/dev/null", dir);
    CHECK(flip == 0);
    rc = t_sh(out, sizeof out, "%s doctor %s --hash", t_bin(), dir);
    CHECK(rc == 1 && strstr(out, "CORRUPT model-00002"), "doctor missed the corruption: %s", out);
    emu_stop(&e);
}

TEST(hub_setup_resume_after_kill) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    REQUIRE(emu_start(&e, "hubemu2", src, "--slow-ms 40") == 0, "emulator did not start");
    const char *d = t_tmpdir("hubresume");
    char dir[300];
    snprintf(dir, sizeof dir, "%s/k3", d);
    /* 1 MB at 16 KiB per 40 ms: about 2.5 s; killed after 1 s */
    t_sh(out, sizeof out,
         "HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/tiny-k3 --dir %s --full --workers 4 >/dev/null 2>&1 & "
         "p=$!; sleep 1; kill -9 $p; wait $p",
         e.port, t_bin(), dir);
    struct stat sb;
    char part[400], whole_path[400];
    snprintf(whole_path, sizeof whole_path, "%s/model-00001-of-00002.safetensors", src);
    int64_t whole = stat(whole_path, &sb) == 0 ? (int64_t)sb.st_size : -1;
    snprintf(part, sizeof part, "%s/model-00001-of-00002.safetensors.part", dir);
    int had_part = stat(part, &sb) == 0 && sb.st_size > 0 && sb.st_size < whole;
    CHECK(had_part, "a partial download is kept (%s)", part);
    int64_t kept = had_part ? sb.st_size : 0;
    emu_stop(&e);
    REQUIRE(emu_start(&e, "hubemu2b", src, NULL) == 0);
    int rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/tiny-k3 --dir %s --full", e.port, t_bin(), dir);
    CHECK(rc == 0, "resumed setup: %s", out);
    char a[400], b[400];
    snprintf(a, sizeof a, "%s/model-00001-of-00002.safetensors", src);
    snprintf(b, sizeof b, "%s/model-00001-of-00002.safetensors", dir);
    CHECK(files_equal(a, b), "resumed file differs");
    int n;
    int64_t got = log_bytes(&e, 0, "model-00001", &n);
    CHECK(had_part && got == whole - kept, "resume fetched %lld bytes, expected %lld", (long long)got, (long long)(whole - kept));
    emu_stop(&e);
}

TEST(hub_errors_name_repo_and_file) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    REQUIRE(emu_start(&e, "hubemu3", src, "--token sekrit") == 0);
    const char *d = t_tmpdir("huberr");
    int rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/tiny-k3 --dir %s/a --dry-run", e.port, t_bin(), d);
    CHECK(rc == 1 && strstr(out, "deltafin/tiny-k3") && strstr(out, "HF_TOKEN"), "no token: %s", out);
    rc = t_sh(out, sizeof out, "HF_TOKEN=sekrit HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/tiny-k3 --dir %s/a --dry-run", e.port, t_bin(), d);
    CHECK(rc == 0 && strstr(out, "dry run"), "token honoured: %s", out);
    rc = t_sh(out, sizeof out, "HF_TOKEN=sekrit HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/nope --dir %s/a", e.port, t_bin(), d);
    CHECK(rc == 1 && strstr(out, "deltafin/nope") && strstr(out, "not found"), "unknown repo: %s", out);
    rc = t_sh(out, sizeof out, "HF_TOKEN=sekrit HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/tiny-k3 --revision v9 --dir %s/a", e.port, t_bin(), d);
    CHECK(rc == 1 && strstr(out, "revision"), "unknown revision: %s", out);
    emu_stop(&e);
    REQUIRE(emu_start(&e, "hubemu3b", src, "--gated") == 0);
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d DF_HUB_RETRY_MS=5 %s setup deltafin/tiny-k3 --dir %s/b --workers 1", e.port, t_bin(), d);
    CHECK(rc == 1 && strstr(out, "gated") && strstr(out, "deltafin/tiny-k3/"), "gated: %s", out);
    emu_stop(&e);
}

/* A hub whose model info has no sizes (it ignores ?blobs=true): the tree
 * API's pages give them, Link by Link; the files arrive verified. */
TEST(hub_setup_sizes_from_the_tree) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    REQUIRE(emu_start(&e, "hubemu10", src, "--no-sizes --tree-page 1") == 0, "emulator did not start");
    const char *d = t_tmpdir("hubtree");
    int rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d DF_HUB_RETRY_MS=5 %s setup deltafin/tiny-k3 --dir %s/k3 --full", e.port, t_bin(), d);
    CHECK(rc == 0, "setup: %s", out);
    int n;
    log_bytes(&e, 0, "/tree/", &n);
    CHECK(n == 4, "4 files, one a page: %d tree requests", n);
    log_bytes(&e, 0, "cursor=3", &n);
    CHECK(n == 1, "the last page was reached through the Link header");
    char a[400], b[400];
    snprintf(a, sizeof a, "%s/model-00002-of-00002.safetensors", src);
    snprintf(b, sizeof b, "%s/k3/model-00002-of-00002.safetensors", d);
    CHECK(files_equal(a, b), "shard differs");
    rc = t_sh(out, sizeof out, "%s doctor %s/k3 --hash", t_bin(), d);
    CHECK(rc == 0, "the tree's sha256 and blob ids check the files: %s", out);
    emu_stop(&e);
    /* neither gives sizes: the error names the first such file, not freed memory */
    REQUIRE(emu_start(&e, "hubemu10b", src, "--no-sizes --no-tree-sizes --tree-page 3") == 0);
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d DF_HUB_RETRY_MS=5 %s setup deltafin/tiny-k3 --dir %s/k3b --dry-run", e.port, t_bin(), d);
    CHECK(rc == 1 && strstr(out, "gives no size for config.json (") && strstr(out, "tree API"), "no sizes anywhere: %s", out);
    log_bytes(&e, 0, "/tree/", &n);
    CHECK(n == 2, "both tree pages asked: %d", n);
    emu_stop(&e);
}

/* Bytes of the routed experts a router trace used, from the source shards. */
static int64_t used_expert_bytes(const char *src, const char *trace) {
    static uint8_t used[64][512];
    memset(used, 0, sizeof used);
    FILE *f = fopen(trace, "r");
    if (!f) return -1;
    char line[8192];
    while (fgets(line, sizeof line, f)) {
        json_t *j = json_loads(line, 0, NULL);
        if (!j) continue;
        int L = (int)json_integer_value(json_object_get(j, "layer"));
        json_t *ex = json_object_get(j, "experts");
        for (size_t i = 0; i < json_array_size(ex); i++) {
            int x = (int)json_integer_value(json_array_get(ex, i));
            if (L >= 0 && L < 64 && x >= 0 && x < 512) used[L][x] = 1;
        }
        json_decref(j);
    }
    fclose(f);
    st_set *st;
    char err[DF_ERRMSG];
    if (st_open_dir(src, df_io_default(), 0, &st, err) != DF_OK) return -1;
    int64_t t = 0;
    for (int64_t i = 0; i < st_count(st); i++) {
        const st_tensor *te = st_at(st, i);
        int L;
        if (!hub_is_expert_tensor(te->name, &L)) continue;
        const char *p = strstr(te->name, ".experts.");
        int x = p ? atoi(p + 9) : -1;
        if (L >= 0 && L < 64 && x >= 0 && x < 512 && used[L][x]) t += te->nbytes;
    }
    st_close(st);
    return t;
}

/* A stream mirror of the source in DIR/k3 through a fresh emulator. */
static int stream_setup(emu *e, const char *tag, char *dir, size_t cap) {
    const char *src = src_model();
    if (!src || emu_start(e, tag, src, NULL) != 0) return -1;
    const char *d = t_tmpdir("hubstream");
    snprintf(dir, cap, "%s/k3", d);
    return t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/tiny-k3 --dir %s --stream", e->port,
                t_bin(), dir);
}

static const char *TOKS = "1,7,300,2,99,512,3,1000,42";

TEST(hub_stream_logits_identical) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    char dir[300];
    REQUIRE(stream_setup(&e, "hubemu4", dir, sizeof dir) == 0, "stream setup: %s", out);
    const char *d = t_tmpdir("hubstreamout");
    int n, after_setup = log_lines(&e);
    CHECK(strstr(out, "stream mirror") != NULL, "%s", out);
    int rc = t_sh(out, sizeof out, "%s logits --model %s --tokens %s --out %s/ref.bin", t_bin(), src, TOKS, d);
    REQUIRE(rc == 0, "reference logits: %s", out);
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s logits --model %s --tokens %s --out %s/s1.bin --no-prefetch --trace %s/trace.jsonl",
              e.port, t_bin(), dir, TOKS, d, d);
    CHECK(rc == 0, "stream logits: %s", out);
    char a[400], b[400], tr[400];
    snprintf(a, sizeof a, "%s/ref.bin", d);
    snprintf(b, sizeof b, "%s/s1.bin", d);
    snprintf(tr, sizeof tr, "%s/trace.jsonl", d);
    CHECK(files_equal(a, b), "stream-mode logits differ from the local copy");
    int64_t fetched = log_bytes(&e, after_setup, "/cdn/", &n);
    int64_t used = used_expert_bytes(src, tr);
    CHECK(used > 0 && fetched == used, "fetched %lld bytes in %d requests, the experts used hold %lld (no over-fetching)",
          (long long)fetched, n, (long long)used);
    /* with prefetch and O_DIRECT asked for: same logits */
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s logits --model %s --tokens %s --out %s/s2.bin --io direct",
              e.port, t_bin(), dir, TOKS, d);
    snprintf(b, sizeof b, "%s/s2.bin", d);
    CHECK(rc == 0 && files_equal(a, b), "second stream run: %s", out);
    rc = t_sh(out, sizeof out, "%s doctor %s", t_bin(), dir);
    CHECK(rc == 0, "doctor on a stream mirror: %s", out);
    /* a mirror of which the hub is gone still runs what is local */
    int64_t dry_before = 0;
    rc = t_sh(out, sizeof out, "%s fetch-experts %s --layers 1 --dry-run", t_bin(), dir);
    CHECK(rc == 0 && strstr(out, "would fetch"), "dry run: %s", out);
    (void)dry_before;
    int before = log_lines(&e);
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s fetch-experts %s --workers 3", e.port, t_bin(), dir);
    CHECK(rc == 0 && strstr(out, "mirror is full"), "fetch-experts: %s", out);
    int64_t rest = log_bytes(&e, before, "/cdn/", &n);
    CHECK(rest > 0 && rest + fetched <= 157000 + 1, "fetch-experts fetched %lld bytes only of experts", (long long)rest);
    for (int i = 1; i <= 2; i++) {
        snprintf(a, sizeof a, "%s/model-0000%d-of-00002.safetensors", src, i);
        snprintf(b, sizeof b, "%s/model-0000%d-of-00002.safetensors", dir, i);
        CHECK(files_equal(a, b), "completed shard %d differs", i);
    }
    rc = t_sh(out, sizeof out, "%s doctor %s --hash", t_bin(), dir);
    CHECK(rc == 0 && strstr(out, "mode full"), "doctor on the completed mirror: %s", out);
    emu_stop(&e);
}

TEST(hub_stream_faults) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    char dir[300];
    REQUIRE(stream_setup(&e, "hubemu5", dir, sizeof dir) == 0, "stream setup: %s", out);
    emu_stop(&e);
    REQUIRE(emu_start(&e, "hubemu5b", src, "--faults 500:2,drop:2,short:2") == 0);
    const char *d = t_tmpdir("hubfaultout");
    int rc = t_sh(out, sizeof out, "%s logits --model %s --tokens %s --out %s/ref.bin", t_bin(), src, TOKS, d);
    REQUIRE(rc == 0, "%s", out);
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d DF_HUB_RETRY_MS=5 %s logits --model %s --tokens %s --out %s/s.bin",
              e.port, t_bin(), dir, TOKS, d);
    char a[400], b[400];
    snprintf(a, sizeof a, "%s/ref.bin", d);
    snprintf(b, sizeof b, "%s/s.bin", d);
    CHECK(rc == 0 && files_equal(a, b), "logits through faults: %s", out);
    emu_stop(&e);
    /* the hub gone: a missing expert is a clear I/O error, not wrong numbers */
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:1 DF_HUB_RETRY_MS=1 %s fetch-experts %s", t_bin(), dir);
    CHECK(rc == 1 && strstr(out, "deltafin/tiny-k3/model-0000"), "hub unreachable: %s", out);
}

/* Every span a log records holds the source's bytes. */
static int mirror_consistent(const char *src, const char *dir, int64_t *present) {
    *present = 0;
    for (int i = 1; i <= 2; i++) {
        char lp[400], a[400], b[400];
        snprintf(lp, sizeof lp, "%s/.deltafin-hub/spans/model-0000%d-of-00002.safetensors.spans", dir, i);
        snprintf(a, sizeof a, "%s/model-0000%d-of-00002.safetensors", src, i);
        snprintf(b, sizeof b, "%s/model-0000%d-of-00002.safetensors", dir, i);
        hub_spans s = {0};
        int64_t fs;
        char err[DF_ERRMSG];
        if (hub_log_read(lp, &s, &fs, err) != DF_OK) return -1;
        int fa = open(a, O_RDONLY), fb = open(b, O_RDONLY);
        int bad = fa < 0 || fb < 0;
        for (int k = 0; !bad && k < s.n; k++) {
            int64_t len = s.v[k].b - s.v[k].a;
            char *x = malloc((size_t)len), *y = malloc((size_t)len);
            bad = !x || !y || pread(fa, x, (size_t)len, s.v[k].a) != len || pread(fb, y, (size_t)len, s.v[k].a) != len ||
                  memcmp(x, y, (size_t)len) != 0;
            free(x);
            free(y);
            *present += len;
        }
        if (fa >= 0) close(fa);
        if (fb >= 0) close(fb);
        hub_spans_free(&s);
        if (bad) return -1;
    }
    return 0;
}

TEST(hub_stream_kill_mid_fetch) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    char dir[300];
    REQUIRE(stream_setup(&e, "hubemu6", dir, sizeof dir) == 0, "stream setup: %s", out);
    emu_stop(&e);
    int64_t p0, p1, p2;
    REQUIRE(mirror_consistent(src, dir, &p0) == 0, "after setup");
    REQUIRE(emu_start(&e, "hubemu6b", src, "--slow-ms 150") == 0);
    t_sh(out, sizeof out,
         "HF_ENDPOINT=http://127.0.0.1:%d %s fetch-experts %s --workers 2 >/dev/null 2>&1 & p=$!; sleep 0.5; kill -9 $p; wait $p",
         e.port, t_bin(), dir);
    CHECK(mirror_consistent(src, dir, &p1) == 0, "a span recorded present holds other bytes after kill -9");
    emu_stop(&e);
    REQUIRE(emu_start(&e, "hubemu6c", src, NULL) == 0);
    int rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s fetch-experts %s", e.port, t_bin(), dir);
    CHECK(rc == 0 && strstr(out, "mirror is full"), "fetch after the crash: %s", out);
    CHECK(mirror_consistent(src, dir, &p2) == 0 && p2 > p1 && p1 >= p0, "present %lld -> %lld -> %lld", (long long)p0,
          (long long)p1, (long long)p2);
    emu_stop(&e);
}

TEST(hub_stream_corrupt_span_detected) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    char dir[300];
    REQUIRE(stream_setup(&e, "hubemu7", dir, sizeof dir) == 0, "stream setup: %s", out);
    emu_stop(&e);
    REQUIRE(emu_start(&e, "hubemu7b", src, "--faults corrupt:1") == 0);
    int rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s fetch-experts %s --workers 1", e.port, t_bin(), dir);
    CHECK(rc == 1 && strstr(out, "sha256"), "a corrupt range is caught when the shard completes: %s", out);
    emu_stop(&e);
}

/* ---- the cache limit, warm, the measured rate ---- */

#define EP "HF_ENDPOINT=http://127.0.0.1:%d DF_HUB_RETRY_MS=5 "

/* Bytes of the mirror's two shards' data (SEEK_DATA / SEEK_HOLE ranges,
 * out to 4 KiB blocks): what the budget governs, without the blocks of the
 * file system's extent tree that st_blocks also counts (a punched shard's
 * tree grows with its holes). -1 when a shard cannot be read. */
static int64_t shard_blocks(const char *dir) {
    int64_t t = 0;
    for (int i = 1; i <= 2; i++) {
        char p[400];
        snprintf(p, sizeof p, "%s/model-0000%d-of-00002.safetensors", dir, i);
        int fd = open(p, O_RDONLY);
        if (fd < 0) return -1;
        for (off_t at = 0;;) {
            off_t d = lseek(fd, at, SEEK_DATA);
            if (d < 0) break; /* ENXIO: no data after `at` */
            off_t h = lseek(fd, d, SEEK_HOLE);
            if (h < 0) { close(fd); return -1; }
            t += ((h + 4095) & ~(off_t)4095) - (d & ~(off_t)4095);
            at = h;
        }
        close(fd);
    }
    return t;
}

/* Eviction records (bit 63 of the start) in the two span logs. */
static int log_evictions(const char *dir) {
    int n = 0;
    for (int i = 1; i <= 2; i++) {
        char p[400];
        snprintf(p, sizeof p, "%s/.deltafin-hub/spans/model-0000%d-of-00002.safetensors.spans", dir, i);
        FILE *f = fopen(p, "rb");
        if (!f) return -1;
        uint8_t r[24];
        fseek(f, 16, SEEK_SET);
        while (fread(r, 1, 24, f) == 24) n += (r[7] & 0x80) != 0;
        fclose(f);
    }
    return n;
}

TEST(hub_stream_cache_limit) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    REQUIRE(emu_start(&e, "hubemu8", src, NULL) == 0);
    const char *d = t_tmpdir("hubcache");
    char dir[300];
    snprintf(dir, sizeof dir, "%s/k3", d);
    enum { LIMIT = 40 << 10 }; /* about a third of the experts this prompt uses */
    int rc = t_sh(out, sizeof out, EP "%s setup deltafin/tiny-k3 --dir %s --stream --cache-limit 40K", e.port, t_bin(), dir);
    REQUIRE(rc == 0, "setup: %s", out);
    int64_t base = shard_blocks(dir);
    rc = t_sh(out, sizeof out, "%s logits --model %s --tokens %s --out %s/ref.bin", t_bin(), src, TOKS, d);
    REQUIRE(rc == 0, "reference logits: %s", out);
    char a[400], b[400], tr[400];
    snprintf(a, sizeof a, "%s/ref.bin", d);
    snprintf(tr, sizeof tr, "%s/trace.jsonl", d);
    /* shard_blocks counts data, not the extent tree (an ext4 inode holds 4
     * extents; a punched shard gets tree blocks, more as holes multiply:
     * st_blocks once exceeded four of them here, and five after the
     * lowered limit's evictions in the sixteenth session). Eight blocks of
     * slack stay. */
    const int64_t meta = 8 * 4096;
    for (int run = 0; run < 2; run++) {
        rc = t_sh(out, sizeof out, EP "%s logits --model %s --tokens %s --out %s/s%d.bin --trace %s", e.port, t_bin(), dir,
                  TOKS, d, run, tr);
        snprintf(b, sizeof b, "%s/s%d.bin", d, run);
        CHECK(rc == 0 && files_equal(a, b), "run %d: logits under a cache limit differ: %s", run, out);
        CHECK(strstr(out, "cache limit"), "the start-up line names the limit: %s", out);
        int64_t grown = shard_blocks(dir) - base;
        CHECK(grown <= LIMIT + meta, "run %d: experts hold %lld bytes of disk, limit %d", run, (long long)grown, LIMIT);
        int64_t p;
        CHECK(mirror_consistent(src, dir, &p) == 0, "run %d: a span recorded present holds other bytes", run);
    }
    int64_t used = used_expert_bytes(src, tr);
    CHECK(used > 2 * LIMIT, "the prompt uses %lld bytes of experts: too few to need eviction", (long long)used);
    CHECK(log_evictions(dir) > 0, "no eviction recorded");
    /* the measured rate is kept for the next start-up line */
    rc = t_sh(out, sizeof out, EP "%s logits --model %s --tokens 1 --out %s/one.bin", e.port, t_bin(), dir, d);
    CHECK(rc == 0 && strstr(out, "MB/s last measured"), "start-up estimate: %s", out);
    /* overridden at run: no limit, the mirror grows past it; same logits */
    rc = t_sh(out, sizeof out, EP "%s logits --model %s --tokens %s --out %s/s9.bin --cache-limit 0", e.port, t_bin(), dir, TOKS, d);
    snprintf(b, sizeof b, "%s/s9.bin", d);
    CHECK(rc == 0 && files_equal(a, b) && !strstr(out, "cache limit"), "without the limit: %s", out);
    CHECK(shard_blocks(dir) - base > LIMIT + meta, "--cache-limit 0 lifts the budget");
    /* lowered again at run: evicted down at open */
    rc = t_sh(out, sizeof out, EP "%s logits --model %s --tokens 1 --out %s/one.bin --cache-limit 8K", e.port, t_bin(), dir, d);
    CHECK(rc == 0 && shard_blocks(dir) - base <= 8192 + 8192 + meta, "a lower limit evicts at start: %lld",
          (long long)(shard_blocks(dir) - base));
    /* completing the mirror cannot fit: refused before fetching */
    int before = log_lines(&e), n;
    rc = t_sh(out, sizeof out, EP "%s fetch-experts %s", e.port, t_bin(), dir);
    CHECK(rc == 1 && strstr(out, "cache limit") && log_bytes(&e, before, "/cdn/", &n) == 0, "fill over the limit: %s", out);
    rc = t_sh(out, sizeof out, "%s doctor %s", t_bin(), dir);
    CHECK(rc == 0, "doctor after evictions: %s", out);
    emu_stop(&e);
}

/* The most selected (layer, expert) of a trace, ties by summed weight, then
 * layer, expert: the ranking `warm` promises. */
static int trace_top(const char *trace, int *layer, int *expert) {
    static double cnt[64][512], ws[64][512];
    memset(cnt, 0, sizeof cnt);
    memset(ws, 0, sizeof ws);
    FILE *f = fopen(trace, "r");
    if (!f) return -1;
    char line[8192];
    while (fgets(line, sizeof line, f)) {
        json_t *j = json_loads(line, 0, NULL);
        int L = (int)json_integer_value(json_object_get(j, "layer"));
        json_t *ex = json_object_get(j, "experts"), *w = json_object_get(j, "weights");
        for (size_t i = 0; i < json_array_size(ex); i++) {
            int x = (int)json_integer_value(json_array_get(ex, i));
            if (L >= 0 && L < 64 && x >= 0 && x < 512) {
                cnt[L][x] += 1;
                ws[L][x] += json_number_value(json_array_get(w, i));
            }
        }
        json_decref(j);
    }
    fclose(f);
    *layer = *expert = -1;
    double bc = 0, bw = 0;
    for (int l = 0; l < 64; l++)
        for (int x = 0; x < 512; x++)
            if (cnt[l][x] > bc || (cnt[l][x] == bc && cnt[l][x] > 0 && ws[l][x] > bw)) {
                bc = cnt[l][x];
                bw = ws[l][x];
                *layer = l;
                *expert = x;
            }
    return *layer >= 0 ? 0 : -1;
}

/* 1 if every tensor of (layer, expert) is recorded present in the mirror. */
static int expert_local(const char *src, const char *dir, int layer, int expert) {
    st_set *st;
    char err[DF_ERRMSG];
    if (st_open_dir(src, df_io_default(), 0, &st, err) != DF_OK) return -1;
    int ok = 1, seen = 0;
    for (int64_t i = 0; i < st_count(st); i++) {
        const st_tensor *te = st_at(st, i);
        int L;
        if (!hub_is_expert_tensor(te->name, &L) || L != layer) continue;
        const char *p = strstr(te->name, ".experts.");
        if (!p || atoi(p + 9) != expert) continue;
        seen++;
        const char *sp = st_shard_path(st, te->shard), *base = strrchr(sp, '/') ? strrchr(sp, '/') + 1 : sp;
        char lp[600];
        snprintf(lp, sizeof lp, "%s/.deltafin-hub/spans/%s.spans", dir, base);
        hub_spans s = {0};
        int64_t fs;
        ok &= hub_log_read(lp, &s, &fs, err) == DF_OK && hub_spans_covers(&s, te->offset, te->offset + te->nbytes);
        hub_spans_free(&s);
    }
    st_close(st);
    return seen && ok;
}

TEST(hub_warm_from_trace_and_heat) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    const char *d = t_tmpdir("hubwarm");
    char tr[400], heat[400];
    snprintf(tr, sizeof tr, "%s/trace.jsonl", d);
    snprintf(heat, sizeof heat, "%s/heat.json", d);
    int rc = t_sh(out, sizeof out, "%s logits --model %s --tokens %s --out %s/ref.bin --trace %s --heat %s", t_bin(), src,
                  TOKS, d, tr, heat);
    REQUIRE(rc == 0, "reference run: %s", out);
    int tl, tx;
    REQUIRE(trace_top(tr, &tl, &tx) == 0);
    emu e;
    char dir[300];
    REQUIRE(stream_setup(&e, "hubemu9", dir, sizeof dir) == 0, "stream setup: %s", out);
    int before = log_lines(&e), n;
    rc = t_sh(out, sizeof out, EP "%s warm %s --trace %s --fetch 5 --dry-run", e.port, t_bin(), dir, tr);
    CHECK(rc == 0 && strstr(out, "would fetch 5 experts") && log_bytes(&e, before, "/cdn/", &n) == 0, "dry run: %s", out);
    rc = t_sh(out, sizeof out, EP "%s warm %s --trace %s --fetch 5", e.port, t_bin(), dir, tr);
    CHECK(rc == 0 && strstr(out, "warmed 5 experts"), "warm: %s", out);
    int64_t got = log_bytes(&e, before, "/cdn/", &n);
    CHECK(got == 5 * 3264, "5 experts of 3264 bytes, fetched %lld in %d requests", (long long)got, n);
    CHECK(expert_local(src, dir, tl, tx) == 1, "the most used expert (layer %d, %d) is local", tl, tx);
    /* again: they are local, the next 5 come */
    before = log_lines(&e);
    rc = t_sh(out, sizeof out, EP "%s warm %s --heat %s --fetch 3", e.port, t_bin(), dir, heat);
    got = log_bytes(&e, before, "/cdn/", &n);
    CHECK(rc == 0 && got == 3 * 3264, "warm from heat fetched %lld: %s", (long long)got, out);
    /* under a cache limit only what fits is fetched */
    rc = t_sh(out, sizeof out, EP "%s warm %s --trace %s --fetch 30 --cache-limit 100K --dry-run", e.port, t_bin(), dir, tr);
    CHECK(rc == 0 && strstr(out, "fewer than asked"), "capped by the limit: %s", out);
    /* the warmed mirror still gives the local copy's logits */
    rc = t_sh(out, sizeof out, EP "%s logits --model %s --tokens %s --out %s/w.bin", e.port, t_bin(), dir, TOKS, d);
    char a[400], b[400];
    snprintf(a, sizeof a, "%s/ref.bin", d);
    snprintf(b, sizeof b, "%s/w.bin", d);
    CHECK(rc == 0 && files_equal(a, b), "logits after warm: %s", out);
    rc = t_sh(out, sizeof out, "%s warm %s --trace %s/nope.jsonl --fetch 1", t_bin(), dir, d);
    CHECK(rc == 1 && strstr(out, "nope.jsonl"), "a missing trace is named: %s", out);
    emu_stop(&e);
}

/* The int8 spine of a stream mirror: the converter reads the spine through
 * the mirror's table (local after setup: nothing fetched), and the result
 * equals a conversion of the local copy; setup --int8-spine converts too. */
TEST(hub_stream_int8_spine) {
    const char *src = src_model();
    REQUIRE(src, "synth failed");
    emu e;
    char dir[300];
    REQUIRE(stream_setup(&e, "hubemu8", dir, sizeof dir) == 0, "stream setup: %s", out);
    int n, before = log_lines(&e);
    int rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s convert-spine %s 2>&1", e.port, t_bin(), dir);
    CHECK(rc == 0, "convert-spine on a stream mirror: %s", out);
    CHECK(log_bytes(&e, before, "/cdn/", &n) == 0, "the spine is local: %d requests", n);
    const char *d = t_tmpdir("hubint8");
    rc = t_sh(out, sizeof out, "cp -r %s %s/local && %s convert-spine %s/local --force >/dev/null 2>&1 && "
              "%s logits --model %s/local --tokens %s --out %s/a.bin 2>/dev/null && "
              "HF_ENDPOINT=http://127.0.0.1:%d %s logits --model %s --tokens %s --out %s/b.bin 2>&1 && cmp %s/a.bin %s/b.bin",
              src, d, t_bin(), d, t_bin(), d, TOKS, d, e.port, t_bin(), dir, TOKS, d, d, d);
    CHECK(rc == 0 && strstr(out, "LOSSY int8 spine"), "int8 logits of the mirror = of the local copy: %s", out);
    char full[320];
    snprintf(full, sizeof full, "%s-full", dir);
    rc = t_sh(out, sizeof out, "HF_ENDPOINT=http://127.0.0.1:%d %s setup deltafin/tiny-k3 --dir %s --full --int8-spine 2>&1 && "
              "ls %s/int8-spine/manifest.json", e.port, t_bin(), full, full);
    CHECK(rc == 0, "setup --int8-spine: %s", out);
    emu_stop(&e);
}
