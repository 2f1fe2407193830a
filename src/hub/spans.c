/* spans.c — present-span sets, their crash-safe log, and sha256 (see hub.h).
 *
 * Owns: hub_spans (a sorted array of disjoint [a, b) byte ranges), the span
 * log file of one stream-mode shard, the download checks (sha256 and git blob
 * ids, computed by nettle).
 * Refuses: a log record whose check does not match (a torn append or a
 * foreign file): the log ends before it and is truncated there, so nothing
 * unverified is ever believed present.
 *
 * Log layout (little-endian):
 *
 *   | "DFSPANS1" | u64 file size | {u64 a, u64 b, u64 check} ... |
 *   check = FNV-1a-64 over (a, b) xor LOG_SALT
 *   a with bit 63 set: [a & ~bit63, b) was evicted (--cache-limit); the
 *   records replay in order, so a later fetch of the same bytes adds it back.
 *   (An older reader sees a > b, takes it for a torn tail and believes less.)
 *
 * Sections: 1. sha256  2. span sets  3. the log
 */
#include "hub.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- 1. sha256 and git blob ids (nettle) ------------------------------------- */

static void to_hex(const uint8_t *d, size_t n, char *hex) {
    for (size_t i = 0; i < n; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
}

void hub_sha256_init(hub_sha256 *c) { sha256_init(&c->ctx); }

void hub_sha256_update(hub_sha256 *c, const void *data, size_t n) {
    sha256_update(&c->ctx, n, data);
}

void hub_sha256_hex(hub_sha256 *c, char hex[65]) {
    uint8_t d[SHA256_DIGEST_SIZE];
    sha256_digest(&c->ctx, sizeof d, d);
    to_hex(d, sizeof d, hex);
}

int hub_sha256_file(const char *path, int64_t len, char hex[65]) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    enum { CH = 1 << 20 };
    uint8_t *buf = malloc(CH);
    if (!buf) { close(fd); errno = ENOMEM; return -1; }
    hub_sha256 c;
    hub_sha256_init(&c);
    int64_t off = 0;
    while (off < len) {
        size_t want = len - off < CH ? (size_t)(len - off) : CH;
        ssize_t r = pread(fd, buf, want, off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { int e = r < 0 ? errno : EIO; free(buf); close(fd); errno = e; return -1; }
        hub_sha256_update(&c, buf, (size_t)r);
        off += r;
    }
    free(buf);
    close(fd);
    hub_sha256_hex(&c, hex);
    return 0;
}

/* sha1, only for git blob ids */

void hub_sha1_init(hub_sha1 *c) { sha1_init(&c->ctx); }

void hub_sha1_update(hub_sha1 *c, const void *data, size_t n) { sha1_update(&c->ctx, n, data); }

void hub_sha1_hex(hub_sha1 *c, char hex[41]) {
    uint8_t d[SHA1_DIGEST_SIZE];
    sha1_digest(&c->ctx, sizeof d, d);
    to_hex(d, sizeof d, hex);
}

void hub_git_blob_init(hub_sha1 *c, int64_t size) {
    char hdr[40];
    int n = snprintf(hdr, sizeof hdr, "blob %lld", (long long)size);
    hub_sha1_init(c);
    hub_sha1_update(c, hdr, (size_t)n + 1); /* with the NUL */
}

/* ---- 2. span sets --------------------------------------------------------- */

void hub_spans_free(hub_spans *s) {
    free(s->v);
    s->v = NULL;
    s->n = s->cap = 0;
}

/* First span with b >= a (the first that can touch or follow a). */
static int lower(const hub_spans *s, int64_t a) {
    int lo = 0, hi = s->n;
    while (lo < hi) {
        int m = (lo + hi) / 2;
        if (s->v[m].b < a) lo = m + 1; else hi = m;
    }
    return lo;
}

int hub_spans_add(hub_spans *s, int64_t a, int64_t b) {
    if (b <= a) return 0;
    int i = lower(s, a), j = i;
    while (j < s->n && s->v[j].a <= b) { /* merge every span touching [a, b] */
        if (s->v[j].a < a) a = s->v[j].a;
        if (s->v[j].b > b) b = s->v[j].b;
        j++;
    }
    if (j == i) { /* insert */
        if (s->n == s->cap) {
            int cap = s->cap ? s->cap * 2 : 16;
            hub_span *nv = realloc(s->v, (size_t)cap * sizeof *nv);
            if (!nv) return -1;
            s->v = nv;
            s->cap = cap;
        }
        memmove(s->v + i + 1, s->v + i, (size_t)(s->n - i) * sizeof *s->v);
        s->n++;
    } else if (j > i + 1) {
        memmove(s->v + i + 1, s->v + j, (size_t)(s->n - j) * sizeof *s->v);
        s->n -= j - i - 1;
    }
    s->v[i].a = a;
    s->v[i].b = b;
    return 0;
}

void hub_spans_remove(hub_spans *s, int64_t a, int64_t b) {
    if (b <= a) return;
    for (int i = lower(s, a + 1); i < s->n && s->v[i].a < b;) {
        hub_span *v = &s->v[i];
        if (v->a < a && v->b > b) { /* split */
            if (s->n == s->cap) {
                int cap = s->cap * 2;
                hub_span *nv = realloc(s->v, (size_t)cap * sizeof *nv);
                if (!nv) { v->b = a; return; } /* keeps the set a subset */
                s->v = nv;
                s->cap = cap;
                v = &s->v[i];
            }
            memmove(s->v + i + 1, s->v + i, (size_t)(s->n - i) * sizeof *s->v);
            s->n++;
            s->v[i].b = a;
            s->v[i + 1].a = b;
            return;
        }
        if (v->a < a) { v->b = a; i++; continue; }
        if (v->b > b) { v->a = b; return; }
        memmove(s->v + i, s->v + i + 1, (size_t)(s->n - i - 1) * sizeof *s->v);
        s->n--;
    }
}

int hub_spans_covers(const hub_spans *s, int64_t a, int64_t b) {
    if (b <= a) return 1;
    int i = lower(s, a + 1);
    return i < s->n && s->v[i].a <= a && s->v[i].b >= b;
}

int hub_spans_overlaps(const hub_spans *s, int64_t a, int64_t b) {
    if (b <= a) return 0;
    int i = lower(s, a + 1);
    return i < s->n && s->v[i].a < b;
}

int hub_spans_missing(const hub_spans *s, int64_t a, int64_t b, hub_spans *out) {
    int64_t at = a;
    for (int i = lower(s, a + 1); i < s->n && s->v[i].a < b && at < b; i++) {
        if (s->v[i].a > at && hub_spans_add(out, at, s->v[i].a) != 0) return -1;
        if (s->v[i].b > at) at = s->v[i].b;
    }
    if (at < b && hub_spans_add(out, at, b) != 0) return -1;
    return 0;
}

int64_t hub_spans_bytes(const hub_spans *s) {
    int64_t t = 0;
    for (int i = 0; i < s->n; i++) t += s->v[i].b - s->v[i].a;
    return t;
}

/* ---- 3. the log ----------------------------------------------------------- */

#define LOG_MAGIC "DFSPANS1"
#define LOG_SALT UINT64_C(0x9e3779b97f4a7c15)
#define LOG_GONE (UINT64_C(1) << 63) /* an eviction record */
enum { LOG_HDR = 16, LOG_REC = 24 };

static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint64_t rec_check(uint64_t a, uint64_t b) {
    uint8_t t[16];
    put64(t, a);
    put64(t + 8, b);
    uint64_t h = UINT64_C(1469598103934665603);
    for (int i = 0; i < 16; i++) { h ^= t[i]; h *= UINT64_C(1099511628211); }
    return h ^ LOG_SALT;
}

static int write_all(int fd, const void *p, size_t n, int64_t off) {
    const uint8_t *q = p;
    while (n) {
        ssize_t w = pwrite(fd, q, n, off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        q += w; n -= (size_t)w; off += w;
    }
    return 0;
}

/* Parses a log's bytes: the valid prefix's spans into present; returns the
 * byte length of that prefix, or -1 if the header is not ours. */
static int64_t parse_log(const uint8_t *p, int64_t n, int64_t *file_size, hub_spans *present,
                         int *records) {
    if (n < LOG_HDR || memcmp(p, LOG_MAGIC, 8) != 0) return -1;
    *file_size = (int64_t)get64(p + 8);
    int64_t at = LOG_HDR;
    *records = 0;
    for (; at + LOG_REC <= n; at += LOG_REC) {
        uint64_t a = get64(p + at), b = get64(p + at + 8), c = get64(p + at + 16);
        uint64_t gone = a & LOG_GONE;
        if (c != rec_check(a, b)) break;
        a &= ~LOG_GONE;
        if (a >= b || (int64_t)b > *file_size) break;
        if (gone) hub_spans_remove(present, (int64_t)a, (int64_t)b);
        else if (hub_spans_add(present, (int64_t)a, (int64_t)b) != 0) return -2;
        (*records)++;
    }
    return at;
}

static uint8_t *slurp(int fd, int64_t *n) {
    int64_t size = lseek(fd, 0, SEEK_END);
    if (size < 0) return NULL;
    uint8_t *p = malloc(size ? (size_t)size : 1);
    if (!p) return NULL;
    int64_t got = 0;
    while (got < size) {
        ssize_t r = pread(fd, p + got, (size_t)(size - got), got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { free(p); return NULL; }
        got += r;
    }
    *n = size;
    return p;
}

df_status hub_log_read(const char *path, hub_spans *present, int64_t *file_size, char *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    *file_size = -1;
    if (fd < 0) {
        if (errno == ENOENT) return DF_OK;
        return df_fail(err, DF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    int64_t n = 0;
    uint8_t *p = slurp(fd, &n);
    close(fd);
    if (!p) return df_fail(err, DF_ERR_IO, "%s: cannot read: %s", path, strerror(errno));
    int recs;
    int64_t ok = parse_log(p, n, file_size, present, &recs);
    free(p);
    if (ok == -2) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    if (ok < 0) return df_fail(err, DF_ERR_FORMAT, "%s: not a deltafin span log", path);
    return DF_OK;
}

static int fsync_dir_of(const char *path) {
    char *d = strdup(path);
    if (!d) return -1;
    char *sl = strrchr(d, '/');
    if (sl) *sl = 0; else strcpy(d, ".");
    int fd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(d);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* Writes a fresh log holding `present` to path (temp, fsync, rename). */
static int rewrite_log(const char *path, int64_t file_size, const hub_spans *present) {
    size_t n = LOG_HDR + (size_t)present->n * LOG_REC;
    uint8_t *p = malloc(n);
    if (!p) return -1;
    memcpy(p, LOG_MAGIC, 8);
    put64(p + 8, (uint64_t)file_size);
    for (int i = 0; i < present->n; i++) {
        uint8_t *r = p + LOG_HDR + (size_t)i * LOG_REC;
        put64(r, (uint64_t)present->v[i].a);
        put64(r + 8, (uint64_t)present->v[i].b);
        put64(r + 16, rec_check((uint64_t)present->v[i].a, (uint64_t)present->v[i].b));
    }
    size_t pl = strlen(path);
    char *tmp = malloc(pl + 5);
    if (!tmp) { free(p); return -1; }
    memcpy(tmp, path, pl);
    memcpy(tmp + pl, ".tmp", 5);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int rc = fd < 0 || write_all(fd, p, n, 0) != 0 || fsync(fd) != 0 ? -1 : 0;
    if (fd >= 0) close(fd);
    if (rc == 0) rc = rename(tmp, path);
    if (rc == 0) rc = fsync_dir_of(path);
    else unlink(tmp);
    free(tmp);
    free(p);
    return rc;
}

df_status hub_log_open(const char *path, int64_t file_size, hub_spans *present, hub_log *log,
                       char *err) {
    memset(log, 0, sizeof *log);
    log->fd = -1;
    log->file_size = file_size;
    log->path = strdup(path);
    if (!log->path) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    int fd = open(path, O_RDWR | O_CLOEXEC);
    int fresh = 0;
    if (fd >= 0) {
        int64_t n = 0, fs = -1;
        uint8_t *p = slurp(fd, &n);
        if (!p) {
            close(fd);
            return df_fail(err, DF_ERR_IO, "%s: cannot read: %s", path, strerror(errno));
        }
        hub_spans got = {0};
        int recs = 0;
        int64_t ok = parse_log(p, n, &fs, &got, &recs);
        free(p);
        if (ok == -2) { close(fd); hub_spans_free(&got); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
        if (ok < 0 || fs != file_size) { /* foreign or for another file: start over */
            hub_spans_free(&got);
            fresh = 1;
        } else {
            for (int i = 0; i < got.n; i++)
                if (hub_spans_add(present, got.v[i].a, got.v[i].b) != 0) {
                    close(fd);
                    hub_spans_free(&got);
                    return df_fail(err, DF_ERR_NOMEM, "out of memory");
                }
            if (recs > 4 * got.n + 64) { /* compact */
                close(fd);
                fd = -1;
                if (rewrite_log(path, file_size, &got) != 0) {
                    hub_spans_free(&got);
                    return df_fail(err, DF_ERR_IO, "%s: cannot compact: %s", path, strerror(errno));
                }
                recs = got.n;
            } else if (ok < n && ftruncate(fd, ok) != 0) { /* drop a torn tail */
                close(fd);
                hub_spans_free(&got);
                return df_fail(err, DF_ERR_IO, "%s: cannot truncate: %s", path, strerror(errno));
            }
            log->records = recs;
            hub_spans_free(&got);
        }
        if (fd >= 0) close(fd);
    } else if (errno == ENOENT) {
        fresh = 1;
    } else {
        return df_fail(err, DF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    if (fresh) {
        hub_spans none = {0};
        if (rewrite_log(path, file_size, &none) != 0)
            return df_fail(err, DF_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        log->records = 0;
    }
    log->fd = open(path, O_RDWR | O_CLOEXEC);
    if (log->fd < 0) return df_fail(err, DF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    return DF_OK;
}

static df_status log_put(hub_log *log, uint64_t a, uint64_t b, char *err) {
    uint8_t r[LOG_REC];
    put64(r, a);
    put64(r + 8, b);
    put64(r + 16, rec_check(a, b));
    int64_t at = LOG_HDR + (int64_t)log->records * LOG_REC;
    if (write_all(log->fd, r, LOG_REC, at) != 0 || fdatasync(log->fd) != 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot append: %s", log->path, strerror(errno));
    log->records++;
    return DF_OK;
}

df_status hub_log_append(hub_log *log, int64_t a, int64_t b, char *err) {
    return log_put(log, (uint64_t)a, (uint64_t)b, err);
}

df_status hub_log_remove(hub_log *log, int64_t a, int64_t b, char *err) {
    return log_put(log, (uint64_t)a | LOG_GONE, (uint64_t)b, err);
}

void hub_log_close(hub_log *log) {
    if (log->fd >= 0) close(log->fd);
    free(log->path);
    log->fd = -1;
    log->path = NULL;
}
