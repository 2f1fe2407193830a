/* mirror.c — local mirrors of hub repositories, full or stream (see hub.h).
 *
 * Owns: the manifest (DIR/.deltafin-hub/manifest.json), the open mirror
 * (per shard: the write descriptor, the present spans and their log, the
 * spans being fetched), `setup` (choose a mode, download), `fill` (complete a
 * stream mirror), `doctor` (offline check), and the stream-mode df_io table
 * with its process-wide registry of mirrors (df_io has no context pointer:
 * descriptors of mirrored shards are recognised by device and inode at open).
 * Refuses: O_DIRECT opens of a stream shard (EINVAL, so the expert store
 * reads exact spans with buffered reads instead of block-aligned ones that
 * would fetch neighbouring experts); opening a mirror whose setup did not
 * finish; to print (news goes through callbacks).
 *
 * Fetch protocol of one span (mirror_ensure), any number of threads:
 *   lock: missing = wanted - present; wait while any of it is in flight;
 *         claim it (inflight += missing)
 *   unlock: one Range request per missing piece; pwrite; restore the
 *         shard's mtime (the expert store treats a new mtime as a changed
 *         file); fdatasync
 *   lock: present += piece; append it to the log (fdatasync'd);
 *         inflight -= missing; wake waiters
 *
 * Sections: 1. manifest  2. safetensors headers  3. the open mirror and
 *           mirror_ensure  4. setup  5. fill  6. doctor  7. the stream io
 *           table and the public df_hub_* calls
 */
#include "hub.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define HUB_DIR ".deltafin-hub"
#define CHUNK_MAX ((int64_t)64 << 20)   /* largest fill request */
#define ST_MAX_HEADER ((int64_t)100 << 20)

/* ---- 1. manifest ------------------------------------------------------------ */

typedef struct {
    char *endpoint, *repo, *revision, *commit;
    hub_mode mode;
    int ready;           /* setup finished: every non-expert byte is local */
    hub_file *files;
    uint8_t *verified;   /* [n_files] whole file checked against sha256 / size */
    int n_files;
} manifest;

static int is_shard(const char *p) {
    size_t n = strlen(p);
    return n > 12 && !strcmp(p + n - 12, ".safetensors");
}

/* Files deltafin never reads (other weight formats). */
static int skipped_file(const char *p) {
    static const char *const ext[] = {".bin", ".pth", ".pt", ".gguf", ".msgpack", ".h5", ".onnx", ".ckpt", ".ot"};
    size_t n = strlen(p);
    for (size_t i = 0; i < sizeof ext / sizeof ext[0]; i++) {
        size_t k = strlen(ext[i]);
        if (n > k && !strcmp(p + n - k, ext[i])) return 1;
    }
    return 0;
}

static char *pjoin(const char *a, const char *b) {
    size_t x = strlen(a), y = strlen(b);
    char *p = malloc(x + y + 2);
    if (!p) return NULL;
    memcpy(p, a, x);
    p[x] = '/';
    memcpy(p + x + 1, b, y + 1);
    return p;
}

static void manifest_free(manifest *m) {
    free(m->endpoint); free(m->repo); free(m->revision); free(m->commit);
    for (int i = 0; i < m->n_files; i++) free(m->files[i].path);
    free(m->files);
    free(m->verified);
    memset(m, 0, sizeof *m);
}

static const char *mode_name(hub_mode m) { return m == HUB_STREAM ? "stream" : m == HUB_FULL ? "full" : "auto"; }

static int mkdirs(const char *path) {
    char *p = strdup(path);
    if (!p) return -1;
    for (char *q = p + 1; *q; q++) {
        if (*q != '/') continue;
        *q = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) { free(p); return -1; }
        *q = '/';
    }
    int rc = mkdir(p, 0755) != 0 && errno != EEXIST ? -1 : 0;
    free(p);
    return rc;
}

static df_status manifest_save(const char *dir, const manifest *m, char *err) {
    json_t *root = json_object(), *files = json_array();
    json_object_set_new(root, "format", json_integer(1));
    json_object_set_new(root, "endpoint", json_string(m->endpoint));
    json_object_set_new(root, "repo", json_string(m->repo));
    json_object_set_new(root, "revision", json_string(m->revision));
    json_object_set_new(root, "commit", json_string(m->commit));
    json_object_set_new(root, "mode", json_string(mode_name(m->mode)));
    json_object_set_new(root, "ready", json_boolean(m->ready));
    for (int i = 0; i < m->n_files; i++) {
        json_t *f = json_object();
        json_object_set_new(f, "path", json_string(m->files[i].path));
        json_object_set_new(f, "size", json_integer(m->files[i].size));
        json_object_set_new(f, "sha256", json_string(m->files[i].sha256));
        json_object_set_new(f, "git", json_string(m->files[i].git));
        json_object_set_new(f, "verified", json_boolean(m->verified[i]));
        json_array_append_new(files, f);
    }
    json_object_set_new(root, "files", files);
    char *hd = pjoin(dir, HUB_DIR), *path = hd ? pjoin(hd, "manifest.json") : NULL;
    char *tmp = path ? pjoin(hd, "manifest.json.tmp") : NULL;
    df_status st = DF_OK;
    if (!tmp) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    else if (mkdirs(hd) != 0) st = df_fail(err, DF_ERR_IO, "%s: cannot create: %s", hd, strerror(errno));
    else {
        char *text = json_dumps(root, JSON_INDENT(1));
        FILE *f = fopen(tmp, "w");
        int ok = text && f && fputs(text, f) >= 0 && fflush(f) == 0 && fsync(fileno(f)) == 0;
        if (f && fclose(f) != 0) ok = 0;
        free(text);
        if (!ok || rename(tmp, path) != 0)
            st = df_fail(err, DF_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
        else {
            int dfd = open(hd, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd >= 0) { fsync(dfd); close(dfd); }
        }
    }
    json_decref(root);
    free(hd); free(path); free(tmp);
    return st;
}

static char *jstrdup(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return strdup(json_is_string(v) ? json_string_value(v) : "");
}

/* DF_ERR_IO with errno ENOENT if dir has no manifest. */
static df_status manifest_load(const char *dir, manifest *m, char *err) {
    memset(m, 0, sizeof *m);
    char *path = pjoin(dir, HUB_DIR "/manifest.json");
    if (!path) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) {
        int missing = access(path, F_OK) != 0;
        df_status st = df_fail(err, DF_ERR_IO, "%s: %s", path, missing ? "no hub mirror here (made by `deltafin setup`)" : je.text);
        free(path);
        errno = missing ? ENOENT : EINVAL;
        return st;
    }
    json_t *files = json_object_get(root, "files");
    const char *mode = json_string_value(json_object_get(root, "mode"));
    if (!json_is_array(files) || !mode) {
        json_decref(root);
        df_status st = df_fail(err, DF_ERR_FORMAT, "%s: 'files' or 'mode' missing", path);
        free(path);
        return st;
    }
    m->endpoint = jstrdup(root, "endpoint");
    m->repo = jstrdup(root, "repo");
    m->revision = jstrdup(root, "revision");
    m->commit = jstrdup(root, "commit");
    m->mode = !strcmp(mode, "stream") ? HUB_STREAM : HUB_FULL;
    m->ready = json_is_true(json_object_get(root, "ready"));
    size_t n = json_array_size(files);
    m->files = calloc(n ? n : 1, sizeof *m->files);
    m->verified = calloc(n ? n : 1, 1);
    df_status st = DF_OK;
    if (!m->files || !m->verified || !m->endpoint || !m->repo || !m->revision || !m->commit)
        st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; st == DF_OK && i < n; i++) {
        json_t *f = json_array_get(files, i);
        const char *p = json_string_value(json_object_get(f, "path"));
        const char *s = json_string_value(json_object_get(f, "sha256"));
        if (!p || strstr(p, "..") || p[0] == '/') { st = df_fail(err, DF_ERR_FORMAT, "%s: bad file entry %zu", path, i); break; }
        m->files[i].path = strdup(p);
        m->files[i].size = (int64_t)json_integer_value(json_object_get(f, "size"));
        snprintf(m->files[i].sha256, sizeof m->files[i].sha256, "%s", s ? s : "");
        const char *g = json_string_value(json_object_get(f, "git"));
        snprintf(m->files[i].git, sizeof m->files[i].git, "%s", g ? g : "");
        m->verified[i] = json_is_true(json_object_get(f, "verified"));
        m->n_files++;
        if (!m->files[i].path) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    json_decref(root);
    free(path);
    if (st != DF_OK) manifest_free(m);
    return st;
}

/* ---- 2. safetensors headers ----------------------------------------------------- */

typedef struct { int64_t a, b; int layer; uint8_t expert; } tspan; /* absolute [a, b) */

int hub_is_expert_tensor(const char *name, int *layer) {
    *layer = -1;
    const char *l = strstr(name, "layers.");
    if (l) *layer = atoi(l + 7);
    for (const char *p = name; (p = strstr(p, "experts.")) != NULL; p += 8) {
        if (p > name && p[-1] != '.') continue; /* shared_experts. */
        if (p[8] >= '0' && p[8] <= '9') return 1;
    }
    return 0;
}

/* Parses a shard header (JSON of n bytes that followed the 8-byte length)
 * into tensor spans, sorted by offset. */
static df_status parse_header(const char *path, const char *hdr, int64_t n, int64_t file_size,
                              tspan **out, int *nout, char *err) {
    *out = NULL;
    *nout = 0;
    json_error_t je;
    json_t *root = json_loadb(hdr, (size_t)n, 0, &je);
    if (!json_is_object(root)) {
        json_decref(root);
        return df_fail(err, DF_ERR_FORMAT, "%s: header is not a JSON object", path);
    }
    tspan *v = malloc((json_object_size(root) + 1) * sizeof *v);
    if (!v) { json_decref(root); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    int k = 0;
    const char *key;
    json_t *e;
    int64_t base = 8 + n;
    df_status st = DF_OK;
    json_object_foreach(root, key, e) {
        if (!strcmp(key, "__metadata__")) continue;
        json_t *o = json_object_get(e, "data_offsets");
        if (!json_is_array(o) || json_array_size(o) != 2) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s' has no data_offsets", path, key);
            break;
        }
        int64_t a = base + (int64_t)json_integer_value(json_array_get(o, 0));
        int64_t b = base + (int64_t)json_integer_value(json_array_get(o, 1));
        if (a < base || b < a || b > file_size) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s' lies outside the file", path, key);
            break;
        }
        int layer;
        v[k].expert = (uint8_t)hub_is_expert_tensor(key, &layer);
        v[k].layer = layer;
        v[k].a = a;
        v[k].b = b;
        k++;
    }
    json_decref(root);
    if (st != DF_OK) { free(v); return st; }
    *out = v;
    *nout = k;
    return DF_OK;
}

/* ---- 3. the open mirror ------------------------------------------------------------- */

typedef struct {
    int file;            /* index in the manifest */
    char *path, *url, *what;
    int64_t size;
    dev_t dev;
    ino_t ino;
    struct timespec mtime; /* kept constant across fetches */
    int wfd;
    hub_spans present, inflight;
    hub_log log;
    tspan *t;            /* tensors, once the header is local */
    int nt;
} mshard;

typedef struct hub_mirror {
    char *dir;
    manifest man;
    hub_client c;
    char *endpoint, *token; /* owned copies for c */
    mshard *sh;
    int n_sh;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    hub_conn *idle[16];
    int n_idle;
    int64_t fetched;
    int requests;
    char last_err[DF_ERRMSG];
} hub_mirror;

static void mirror_close(hub_mirror *m) {
    if (!m) return;
    for (int i = 0; i < m->n_sh; i++) {
        mshard *s = &m->sh[i];
        if (s->wfd >= 0) close(s->wfd);
        hub_log_close(&s->log);
        hub_spans_free(&s->present);
        hub_spans_free(&s->inflight);
        free(s->path); free(s->url); free(s->what); free(s->t);
    }
    free(m->sh);
    for (int i = 0; i < m->n_idle; i++) hub_conn_free(m->idle[i]);
    manifest_free(&m->man);
    free(m->dir); free(m->endpoint); free(m->token);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    free(m);
}

static hub_conn *conn_get(hub_mirror *m) {
    pthread_mutex_lock(&m->mu);
    hub_conn *c = m->n_idle ? m->idle[--m->n_idle] : NULL;
    pthread_mutex_unlock(&m->mu);
    return c ? c : hub_conn_new();
}

static void conn_put(hub_mirror *m, hub_conn *c) {
    if (!c) return;
    pthread_mutex_lock(&m->mu);
    if (m->n_idle < 16) { m->idle[m->n_idle++] = c; c = NULL; }
    pthread_mutex_unlock(&m->mu);
    hub_conn_free(c);
}

/* Creates (or keeps, if it has the right size) the sparse file of a shard. */
static df_status prepare_sparse(const char *path, const char *logpath, int64_t size, char *err) {
    struct stat sb;
    if (stat(path, &sb) == 0 && sb.st_size == size) return DF_OK;
    unlink(logpath); /* whatever it recorded is not in this file */
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return df_fail(err, DF_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    int rc = ftruncate(fd, size) == 0 && fsync(fd) == 0 ? 0 : -1;
    int e = errno;
    close(fd);
    if (rc != 0) return df_fail(err, DF_ERR_IO, "%s: cannot size to %lld bytes: %s", path, (long long)size, strerror(e));
    return DF_OK;
}

/* Opens the mirror in dir. create: make missing sparse files (setup). */
static df_status mirror_open(const char *dir, const hub_client *c, int create, hub_mirror **out, char *err) {
    *out = NULL;
    hub_mirror *m = calloc(1, sizeof *m);
    if (!m) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    m->dir = strdup(dir);
    df_status st = manifest_load(dir, &m->man, err);
    if (st != DF_OK || !m->dir) { mirror_close(m); return st != DF_OK ? st : df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    m->c = *c;
    m->endpoint = strdup(c->endpoint && *c->endpoint ? c->endpoint : m->man.endpoint);
    m->token = c->token ? strdup(c->token) : NULL;
    m->c.endpoint = m->endpoint;
    m->c.token = m->token;
    m->c.progress = NULL;
    m->sh = calloc((size_t)m->man.n_files + 1, sizeof *m->sh);
    if (!m->sh || !m->endpoint) { mirror_close(m); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    for (int i = 0; i < m->man.n_files; i++) {
        const hub_file *f = &m->man.files[i];
        if (!is_shard(f->path) || skipped_file(f->path)) continue;
        mshard *s = &m->sh[m->n_sh++];
        s->wfd = -1;
        s->log.fd = -1;
        s->file = i;
        s->size = f->size;
        s->path = pjoin(dir, f->path);
        s->url = hub_resolve_url(&m->c, m->man.repo, m->man.commit, f->path);
        size_t wl = strlen(m->man.repo) + strlen(f->path) + 2;
        s->what = malloc(wl);
        char *logp = NULL, *ld = pjoin(dir, HUB_DIR "/spans");
        const char *base = strrchr(f->path, '/') ? strrchr(f->path, '/') + 1 : f->path;
        char lname[512];
        snprintf(lname, sizeof lname, "%s.spans", base);
        if (ld) logp = pjoin(ld, lname);
        if (!s->path || !s->url || !s->what || !logp) {
            free(ld); free(logp);
            mirror_close(m);
            return df_fail(err, DF_ERR_NOMEM, "out of memory");
        }
        snprintf(s->what, wl, "%s/%s", m->man.repo, f->path);
        if (create) {
            if (mkdirs(ld) != 0) st = df_fail(err, DF_ERR_IO, "%s: cannot create: %s", ld, strerror(errno));
            else st = prepare_sparse(s->path, logp, s->size, err);
        }
        if (st == DF_OK) st = hub_log_open(logp, s->size, &s->present, &s->log, err);
        free(ld);
        free(logp);
        if (st != DF_OK) { mirror_close(m); return st; }
        struct stat sb;
        s->wfd = open(s->path, O_RDWR | O_CLOEXEC);
        if (s->wfd < 0 || fstat(s->wfd, &sb) != 0) {
            st = df_fail(err, DF_ERR_IO, "%s: cannot open: %s", s->path, strerror(errno));
            mirror_close(m);
            return st;
        }
        if (sb.st_size != s->size) {
            st = df_fail(err, DF_ERR_IO, "%s: %lld bytes, the hub's file has %lld: run `deltafin setup` again",
                         s->path, (long long)sb.st_size, (long long)s->size);
            mirror_close(m);
            return st;
        }
        s->dev = sb.st_dev;
        s->ino = sb.st_ino;
        s->mtime = sb.st_mtim;
    }
    *out = m;
    return DF_OK;
}

static int write_at(int fd, const void *p, size_t n, int64_t off) {
    const uint8_t *q = p;
    while (n) {
        ssize_t w = pwrite(fd, q, n, off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        q += w; n -= (size_t)w; off += w;
    }
    return 0;
}

/* Fetches one missing piece [a, b) of shard s and makes it durable (not yet
 * recorded). */
static df_status fetch_piece(hub_mirror *m, mshard *s, int64_t a, int64_t b, char *err) {
    const hub_file *f = &m->man.files[s->file];
    hub_conn *hc = conn_get(m);
    uint8_t *buf = malloc((size_t)(b - a));
    if (!hc || !buf) { free(buf); hub_conn_free(hc); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    df_status st = hub_get_range(hc, &m->c, s->url, s->what, a, b - a, buf, f->sha256[0] ? f->sha256 : NULL, err);
    conn_put(m, hc);
    if (st == DF_OK) {
        struct timespec ts[2] = {{0, UTIME_OMIT}, s->mtime};
        if (write_at(s->wfd, buf, (size_t)(b - a), a) != 0 || futimens(s->wfd, ts) != 0 || fdatasync(s->wfd) != 0)
            st = df_fail(err, DF_ERR_IO, "%s: cannot write fetched bytes %lld-%lld: %s", s->path, (long long)a,
                         (long long)b, strerror(errno));
    }
    free(buf);
    return st;
}

/* Makes bytes [a, b) of shard s local (see the protocol at the top). On
 * error nothing that failed is marked present. */
static df_status mirror_ensure(hub_mirror *m, mshard *s, int64_t a, int64_t b, char *err) {
    if (a < 0) a = 0;
    if (b > s->size) b = s->size;
    if (b <= a) return DF_OK;
    hub_spans miss = {0};
    pthread_mutex_lock(&m->mu);
    for (;;) {
        if (hub_spans_covers(&s->present, a, b)) { pthread_mutex_unlock(&m->mu); return DF_OK; }
        miss.n = 0;
        if (hub_spans_missing(&s->present, a, b, &miss) != 0) {
            pthread_mutex_unlock(&m->mu);
            hub_spans_free(&miss);
            return df_fail(err, DF_ERR_NOMEM, "out of memory");
        }
        int busy = 0;
        for (int i = 0; i < miss.n && !busy; i++) busy = hub_spans_overlaps(&s->inflight, miss.v[i].a, miss.v[i].b);
        if (!busy) break;
        pthread_cond_wait(&m->cv, &m->mu);
    }
    df_status st = DF_OK;
    for (int i = 0; i < miss.n; i++)
        if (hub_spans_add(&s->inflight, miss.v[i].a, miss.v[i].b) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    pthread_mutex_unlock(&m->mu);
    uint8_t *ok = calloc((size_t)miss.n + 1, 1);
    if (!ok) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == DF_OK && i < miss.n; i++) {
        st = fetch_piece(m, s, miss.v[i].a, miss.v[i].b, err);
        if (st == DF_OK) ok[i] = 1;
    }
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < miss.n; i++) {
        if (ok && ok[i]) {
            df_status ls = hub_log_append(&s->log, miss.v[i].a, miss.v[i].b, st == DF_OK ? err : NULL);
            if (ls == DF_OK) {
                if (hub_spans_add(&s->present, miss.v[i].a, miss.v[i].b) != 0 && st == DF_OK)
                    st = df_fail(err, DF_ERR_NOMEM, "out of memory");
                m->fetched += miss.v[i].b - miss.v[i].a;
                m->requests++;
            } else if (st == DF_OK) {
                st = ls;
            }
        }
        hub_spans_remove(&s->inflight, miss.v[i].a, miss.v[i].b);
    }
    if (st != DF_OK && err) snprintf(m->last_err, sizeof m->last_err, "%s", err);
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    free(ok);
    hub_spans_free(&miss);
    return st;
}

/* Makes the header of shard s local and parses it into s->t. */
static df_status shard_header(hub_mirror *m, mshard *s, int fetch, char *err) {
    if (s->t) return DF_OK;
    if (s->size < 8) return df_fail(err, DF_ERR_FORMAT, "%s: %lld bytes, too short for safetensors", s->path, (long long)s->size);
    df_status st = fetch ? mirror_ensure(m, s, 0, 8, err) : DF_OK;
    if (st != DF_OK) return st;
    if (!hub_spans_covers(&s->present, 0, 8)) return df_fail(err, DF_ERR_IO, "%s: header not local", s->path);
    uint8_t lb[8];
    if (pread(s->wfd, lb, 8, 0) != 8) return df_fail(err, DF_ERR_IO, "%s: cannot read: %s", s->path, strerror(errno));
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | lb[i];
    if (n > (uint64_t)ST_MAX_HEADER || 8 + (int64_t)n > s->size)
        return df_fail(err, DF_ERR_FORMAT, "%s: header length %llu is impossible", s->path, (unsigned long long)n);
    if (fetch && (st = mirror_ensure(m, s, 8, 8 + (int64_t)n, err)) != DF_OK) return st;
    if (!hub_spans_covers(&s->present, 8, 8 + (int64_t)n)) return df_fail(err, DF_ERR_IO, "%s: header not local", s->path);
    char *h = malloc((size_t)n + 1);
    if (!h) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    int64_t got = 0;
    while (got < (int64_t)n) {
        ssize_t r = pread(s->wfd, h + got, (size_t)n - (size_t)got, 8 + got);
        if (r <= 0) { free(h); return df_fail(err, DF_ERR_IO, "%s: cannot read the header", s->path); }
        got += r;
    }
    st = parse_header(s->path, h, (int64_t)n, s->size, &s->t, &s->nt, err);
    free(h);
    return st;
}

/* Present and total bytes of routed experts in shard s (header local). */
static void expert_bytes(const mshard *s, int64_t *local, int64_t *total) {
    for (int i = 0; i < s->nt; i++) {
        if (!s->t[i].expert) continue;
        int64_t len = s->t[i].b - s->t[i].a, miss = 0;
        hub_spans ms = {0};
        if (hub_spans_missing(&s->present, s->t[i].a, s->t[i].b, &ms) == 0) miss = hub_spans_bytes(&ms);
        hub_spans_free(&ms);
        *total += len;
        *local += len - miss;
    }
}

/* ---- 4. setup ---------------------------------------------------------------------- */

typedef struct {
    const hub_setup_opts *o;
    hub_listing *l;
    hub_mirror *m;       /* stream */
    manifest *man;
    int next;            /* next job */
    int n_jobs;
    int *jobs;           /* file indexes */
    pthread_mutex_t mu;
    df_status st;
    char err[DF_ERRMSG];
    int64_t fetched;
    int requests;
} setup_ctx;

static void note(const hub_setup_opts *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(const hub_setup_opts *o, const char *fmt, ...) {
    if (!o->note) return;
    char line[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    o->note(o->note_ctx, line);
}

/* 1 if the file at path has f's size and hash (sha256, else git blob id). */
static int file_matches(const hub_file *f, const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0 || sb.st_size != f->size) return 0;
    char hex[65];
    if (f->sha256[0]) return hub_sha256_file(path, f->size, hex) == 0 && !strcmp(hex, f->sha256);
    if (!f->git[0]) return 1;
    FILE *fp = fopen(path, "rb");
    if (!fp) return 0;
    hub_sha1 c;
    hub_git_blob_init(&c, f->size);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, fp)) > 0) hub_sha1_update(&c, buf, n);
    fclose(fp);
    hub_sha1_hex(&c, hex);
    return !strcmp(hex, f->git);
}

/* One job: a whole file (full mode, or a non-shard file), or a stream shard's
 * header and non-expert tensors. */
static df_status setup_job(setup_ctx *x, int fi, char *err) {
    const hub_setup_opts *o = x->o;
    hub_file *f = &x->man->files[fi];
    if (x->man->verified[fi]) return DF_OK;
    char *dest = pjoin(o->dir, f->path);
    if (!dest) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    df_status st = DF_OK;
    if (x->m && is_shard(f->path)) {
        mshard *s = NULL;
        for (int i = 0; i < x->m->n_sh; i++) if (x->m->sh[i].file == fi) s = &x->m->sh[i];
        if (!s) { free(dest); return df_fail(err, DF_ERR_ARG, "%s: not an open shard", f->path); }
        st = shard_header(x->m, s, 1, err);
        /* non-expert tensors, adjacent ones merged into one request */
        hub_spans ne = {0};
        for (int i = 0; st == DF_OK && i < s->nt; i++)
            if (!s->t[i].expert && hub_spans_add(&ne, s->t[i].a, s->t[i].b) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
        for (int i = 0; st == DF_OK && i < ne.n; i++) st = mirror_ensure(x->m, s, ne.v[i].a, ne.v[i].b, err);
        if (st == DF_OK) {
            int64_t loc = 0, tot = 0;
            expert_bytes(s, &loc, &tot);
            note(o, "%s: header and %.3f MB of non-expert tensors local; routed experts %.3f of %.3f MB local",
                 f->path, hub_spans_bytes(&ne) / 1e6, loc / 1e6, tot / 1e6);
        }
        hub_spans_free(&ne);
    } else {
        int ok = 0;
        char *d2 = strdup(dest), *sl = d2 ? strrchr(d2, '/') : NULL;
        if (sl) { *sl = 0; mkdirs(d2); }
        free(d2);
        ok = file_matches(f, dest);
        if (ok) note(o, "%s: already here, verified", f->path);
        else {
            int64_t got = 0;
            st = hub_download(&o->client, o->repo, x->man->commit, f, dest, &got, err);
            pthread_mutex_lock(&x->mu);
            x->fetched += got;
            x->requests++;
            pthread_mutex_unlock(&x->mu);
        }
        if (st == DF_OK) {
            pthread_mutex_lock(&x->mu);
            x->man->verified[fi] = 1;
            st = manifest_save(o->dir, x->man, err); /* a finished file is never fetched again */
            pthread_mutex_unlock(&x->mu);
        }
    }
    free(dest);
    return st;
}

static void *setup_worker(void *arg) {
    setup_ctx *x = arg;
    for (;;) {
        pthread_mutex_lock(&x->mu);
        int j = x->st == DF_OK && x->next < x->n_jobs ? x->jobs[x->next++] : -1;
        pthread_mutex_unlock(&x->mu);
        if (j < 0) return NULL;
        char err[DF_ERRMSG];
        df_status st = setup_job(x, j, err);
        if (st != DF_OK) {
            pthread_mutex_lock(&x->mu);
            if (x->st == DF_OK) { x->st = st; snprintf(x->err, sizeof x->err, "%s", err); }
            pthread_mutex_unlock(&x->mu);
        }
    }
}

static df_status run_jobs(setup_ctx *x, int workers, char *err) {
    if (workers < 1) workers = 4;
    if (workers > 32) workers = 32;
    pthread_t th[32];
    int started = 0;
    for (int i = 0; i < workers && i < x->n_jobs; i++)
        if (pthread_create(&th[i], NULL, setup_worker, x) == 0) started++;
    if (!started && x->n_jobs) setup_worker(x);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (x->st != DF_OK) return df_fail(err, x->st, "%s", x->err);
    return DF_OK;
}

static int64_t free_disk(const char *dir, int64_t override) {
    if (override > 0) return override;
    char *p = strdup(dir);
    while (p && *p) {
        struct statvfs v;
        if (statvfs(p, &v) == 0) { free(p); return (int64_t)v.f_bavail * (int64_t)v.f_frsize; }
        char *sl = strrchr(p, '/');
        if (!sl) { strcpy(p, "."); continue; }
        if (sl == p) sl[1] = 0; else *sl = 0;
    }
    free(p);
    return -1;
}

df_status hub_setup(const hub_setup_opts *o, hub_report *rep, char *err) {
    memset(rep, 0, sizeof *rep);
    const char *rev = o->revision && *o->revision ? o->revision : "main";
    hub_listing l;
    df_status st = hub_list(&o->client, o->repo, rev, &l, err);
    if (st != DF_OK) return st;
    manifest man = {0};
    man.files = calloc((size_t)l.n_files + 1, sizeof *man.files);
    man.verified = calloc((size_t)l.n_files + 1, 1);
    man.endpoint = strdup(o->client.endpoint && *o->client.endpoint ? o->client.endpoint : "https://huggingface.co");
    man.repo = strdup(o->repo);
    man.revision = strdup(rev);
    man.commit = strdup(l.commit);
    if (!man.files || !man.verified || !man.endpoint || !man.repo || !man.revision || !man.commit) {
        hub_listing_free(&l);
        manifest_free(&man);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    int has_weights = 0;
    for (int i = 0; i < l.n_files; i++) {
        if (skipped_file(l.files[i].path)) continue;
        man.files[man.n_files] = l.files[i];
        l.files[i].path = NULL;
        int64_t sz = man.files[man.n_files].size;
        rep->total_bytes += sz;
        if (is_shard(man.files[man.n_files].path)) { rep->shard_bytes += sz; has_weights = 1; }
        man.n_files++;
    }
    hub_listing_free(&l);
    if (!has_weights) {
        manifest_free(&man);
        return df_fail(err, DF_ERR_FORMAT, "%s at %s has no .safetensors files: nothing deltafin can run", o->repo, rev);
    }
    /* an earlier setup of the same commit: keep what it verified */
    manifest old;
    char oerr[DF_ERRMSG];
    hub_mode old_mode = HUB_AUTO;
    if (manifest_load(o->dir, &old, oerr) == DF_OK) {
        if (!strcmp(old.repo, man.repo) && !strcmp(old.commit, man.commit)) {
            old_mode = old.mode;
            for (int i = 0; i < man.n_files; i++)
                for (int k = 0; k < old.n_files; k++)
                    if (!strcmp(old.files[k].path, man.files[i].path) && old.files[k].size == man.files[i].size)
                        man.verified[i] = old.verified[k];
        }
        manifest_free(&old);
    }
    int64_t have = 0;
    for (int i = 0; i < man.n_files; i++) if (man.verified[i]) have += man.files[i].size;
    int64_t freeb = free_disk(o->dir, o->free_bytes);
    int64_t need = rep->total_bytes - have;
    int64_t margin = rep->total_bytes / 20 > ((int64_t)2 << 30) ? rep->total_bytes / 20 : ((int64_t)2 << 30);
    if (o->free_bytes > 0) margin = rep->total_bytes / 20; /* tests size the disk themselves */
    hub_mode mode = o->mode;
    if (mode == HUB_AUTO) mode = old_mode == HUB_STREAM ? HUB_STREAM : (freeb < 0 || need + margin <= freeb) ? HUB_FULL : HUB_STREAM;
    rep->mode = mode;
    note(o, "%s at %s (commit %.12s): %d files, %.3f GB (%.3f GB in safetensors); %.3f GB free in %s%s",
         o->repo, rev, man.commit, man.n_files, rep->total_bytes / 1e9, rep->shard_bytes / 1e9,
         freeb / 1e9, o->dir, have ? "" : "");
    if (o->mode == HUB_AUTO)
        note(o, "mode %s: %s", mode_name(mode),
             mode == HUB_FULL ? "the whole repository fits with a 5% margin"
                              : "the repository does not fit: stream mode downloads metadata and "
                                "non-expert tensors now and fetches routed experts on first use");
    if (mode == HUB_FULL && freeb >= 0 && need > freeb) {
        manifest_free(&man);
        return df_fail(err, DF_ERR_IO, "%s: %.3f GB still to download but only %.3f GB free: use --stream",
                       o->dir, need / 1e9, freeb / 1e9);
    }
    if (o->dry_run) {
        note(o, "dry run: would download %.3f GB%s", need / 1e9,
             mode == HUB_STREAM ? " at most (stream: experts only when used)" : "");
        manifest_free(&man);
        return DF_OK;
    }
    if (mkdirs(o->dir) != 0) {
        manifest_free(&man);
        return df_fail(err, DF_ERR_IO, "%s: cannot create: %s", o->dir, strerror(errno));
    }
    setup_ctx x = {0};
    x.o = o;
    x.man = &man;
    pthread_mutex_init(&x.mu, NULL);
    x.jobs = malloc((size_t)man.n_files * sizeof(int) + 1);
    if (!x.jobs) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    /* a stream mirror asked to become full: fill its gaps instead */
    int upgrade = mode == HUB_FULL && old_mode == HUB_STREAM;
    man.mode = mode == HUB_STREAM || upgrade ? HUB_STREAM : HUB_FULL;
    man.ready = 0;
    if ((st = manifest_save(o->dir, &man, err)) != DF_OK) goto done;
    if (man.mode == HUB_STREAM) {
        st = mirror_open(o->dir, &o->client, 1, &x.m, err);
        if (st != DF_OK) goto done;
        /* the mirror loaded its own copy of the manifest: keep them one */
        manifest_free(&x.m->man);
        x.m->man = man;
        x.man = &x.m->man;
        memset(&man, 0, sizeof man);
    }
    for (int i = 0; i < x.man->n_files; i++) x.jobs[x.n_jobs++] = i;
    st = run_jobs(&x, o->workers, err);
    if (st == DF_OK) {
        x.man->ready = 1;
        st = manifest_save(o->dir, x.man, err);
    }
    if (x.m) {
        rep->fetched_bytes = x.fetched + x.m->fetched;
        rep->requests = x.requests + x.m->requests;
        for (int i = 0; i < x.m->n_sh; i++) expert_bytes(&x.m->sh[i], &rep->local_expert_bytes, &rep->expert_bytes);
    } else {
        rep->fetched_bytes = x.fetched;
        rep->requests = x.requests;
    }
    if (x.m) { mirror_close(x.m); x.m = NULL; }
    if (st == DF_OK && upgrade) {
        hub_report fr;
        st = hub_fill(o->dir, &o->client, NULL, 0, o->workers, 0, &fr, err);
        rep->fetched_bytes += fr.fetched_bytes;
        rep->requests += fr.requests;
        rep->mode = HUB_FULL;
    }
done:
    free(x.jobs);
    pthread_mutex_destroy(&x.mu);
    manifest_free(&man);
    return st;
}

/* ---- 5. fill ----------------------------------------------------------------------------- */

typedef struct { int sh; int64_t a, b; } piece;

typedef struct {
    hub_mirror *m;
    piece *p;
    int n, next;
    pthread_mutex_t mu;
    df_status st;
    char err[DF_ERRMSG];
} fill_ctx;

static void *fill_worker(void *arg) {
    fill_ctx *x = arg;
    for (;;) {
        pthread_mutex_lock(&x->mu);
        int j = x->st == DF_OK && x->next < x->n ? x->next++ : -1;
        pthread_mutex_unlock(&x->mu);
        if (j < 0) return NULL;
        char err[DF_ERRMSG];
        df_status st = mirror_ensure(x->m, &x->m->sh[x->p[j].sh], x->p[j].a, x->p[j].b, err);
        if (st != DF_OK) {
            pthread_mutex_lock(&x->mu);
            if (x->st == DF_OK) { x->st = st; snprintf(x->err, sizeof x->err, "%s", err); }
            pthread_mutex_unlock(&x->mu);
        }
    }
}

df_status hub_fill(const char *dir, const hub_client *c, const uint8_t *layers, int n_layers, int workers,
                   int dry_run, hub_report *rep, char *err) {
    memset(rep, 0, sizeof *rep);
    hub_mirror *m;
    df_status st = mirror_open(dir, c, 0, &m, err);
    if (st != DF_OK) return st;
    rep->mode = m->man.mode;
    if (!m->man.ready) {
        mirror_close(m);
        return df_fail(err, DF_ERR_ARG, "%s: setup did not finish: run `deltafin setup` again first", dir);
    }
    fill_ctx x = {0};
    x.m = m;
    pthread_mutex_init(&x.mu, NULL);
    int cap = 0;
    for (int si = 0; st == DF_OK && si < m->n_sh; si++) {
        mshard *s = &m->sh[si];
        if ((st = shard_header(m, s, 0, err)) != DF_OK) break;
        expert_bytes(s, &rep->local_expert_bytes, &rep->expert_bytes);
        rep->shard_bytes += s->size;
        rep->local_bytes += hub_spans_bytes(&s->present);
        hub_spans want = {0};
        if (!layers) {
            if (hub_spans_missing(&s->present, 0, s->size, &want) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
        } else {
            for (int i = 0; st == DF_OK && i < s->nt; i++) {
                int L = s->t[i].layer;
                if (!s->t[i].expert || L < 0 || L >= n_layers || !layers[L]) continue;
                if (hub_spans_missing(&s->present, s->t[i].a, s->t[i].b, &want) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
            }
        }
        /* adjacent pieces merged by the set; split into requests of <= CHUNK_MAX */
        for (int i = 0; st == DF_OK && i < want.n; i++)
            for (int64_t a = want.v[i].a; a < want.v[i].b; a += CHUNK_MAX) {
                if (x.n == cap) {
                    cap = cap ? cap * 2 : 64;
                    piece *np = realloc(x.p, (size_t)cap * sizeof *np);
                    if (!np) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); break; }
                    x.p = np;
                }
                int64_t b = want.v[i].b - a > CHUNK_MAX ? a + CHUNK_MAX : want.v[i].b;
                x.p[x.n++] = (piece){si, a, b};
                rep->total_bytes += b - a; /* bytes to fetch */
            }
        hub_spans_free(&want);
    }
    rep->requests = x.n;
    if (st == DF_OK && !dry_run && x.n) {
        if (workers < 1) workers = 4;
        if (workers > 32) workers = 32;
        pthread_t th[32];
        int started = 0;
        for (int i = 0; i < workers && i < x.n; i++)
            if (pthread_create(&th[i], NULL, fill_worker, &x) == 0) started++;
        if (!started) fill_worker(&x);
        for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
        if (x.st != DF_OK) st = df_fail(err, x.st, "%s", x.err);
        rep->fetched_bytes = m->fetched;
    }
    /* complete shards: check the whole file; a complete mirror becomes full */
    if (st == DF_OK && !dry_run) {
        int all = 1, changed = 0;
        for (int si = 0; st == DF_OK && si < m->n_sh; si++) {
            mshard *s = &m->sh[si];
            hub_file *f = &m->man.files[s->file];
            if (!hub_spans_covers(&s->present, 0, s->size)) { all = 0; continue; }
            if (m->man.verified[s->file]) continue;
            if (f->sha256[0]) {
                char hex[65];
                if (hub_sha256_file(s->path, s->size, hex) != 0)
                    st = df_fail(err, DF_ERR_IO, "%s: cannot read back: %s", s->path, strerror(errno));
                else if (strcmp(hex, f->sha256) != 0)
                    st = df_fail(err, DF_ERR_FORMAT,
                                 "%s: every span is local but the file's sha256 is %s, not the commit's %s: "
                                 "a fetched span is corrupt (delete the file and its log in %s/spans, then setup again)",
                                 s->path, hex, f->sha256, HUB_DIR);
            }
            if (st == DF_OK) { m->man.verified[s->file] = 1; changed = 1; }
        }
        if (st == DF_OK && all && m->man.mode == HUB_STREAM) { m->man.mode = HUB_FULL; changed = 1; }
        if (st == DF_OK && changed) st = manifest_save(dir, &m->man, err);
        rep->mode = m->man.mode;
    }
    pthread_mutex_destroy(&x.mu);
    free(x.p);
    mirror_close(m);
    return st;
}

/* ---- 6. doctor ---------------------------------------------------------------------------- */

static void dnote(void (*fn)(void *, const char *), void *ctx, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void dnote(void (*fn)(void *, const char *), void *ctx, const char *fmt, ...) {
    if (!fn) return;
    char line[1400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fn(ctx, line);
}

df_status hub_doctor(const char *dir, int hash, void (*fn)(void *, const char *), void *ctx, hub_report *rep,
                     char *err) {
    memset(rep, 0, sizeof *rep);
    manifest man;
    df_status st = manifest_load(dir, &man, err);
    if (st != DF_OK) return st;
    int bad = 0;
    rep->mode = man.mode;
    dnote(fn, ctx, "mirror of %s at %s (commit %.12s), mode %s%s", man.repo, man.revision, man.commit,
          mode_name(man.mode), man.ready ? "" : ", setup NOT finished");
    if (!man.ready) bad++;
    for (int i = 0; i < man.n_files; i++) {
        const hub_file *f = &man.files[i];
        char *p = pjoin(dir, f->path);
        struct stat sb;
        rep->total_bytes += f->size;
        if (!p || stat(p, &sb) != 0) {
            if (man.mode == HUB_FULL || man.verified[i]) { dnote(fn, ctx, "MISSING %s", f->path); bad++; }
            free(p);
            continue;
        }
        if (sb.st_size != f->size) {
            dnote(fn, ctx, "SIZE %s: %lld bytes, expected %lld", f->path, (long long)sb.st_size, (long long)f->size);
            bad++;
            free(p);
            continue;
        }
        int stream_shard = man.mode == HUB_STREAM && is_shard(f->path) && !man.verified[i];
        if (!stream_shard) {
            rep->local_bytes += f->size;
            if (hash && !file_matches(f, p)) {
                dnote(fn, ctx, "CORRUPT %s: %s differs from the commit's", f->path, f->sha256[0] ? "sha256" : "git blob id");
                bad++;
            }
            free(p);
            continue;
        }
        /* a stream shard: its log, its header, its non-expert tensors */
        const char *base = strrchr(f->path, '/') ? strrchr(f->path, '/') + 1 : f->path;
        char lp[4096];
        snprintf(lp, sizeof lp, "%s/" HUB_DIR "/spans/%s.spans", dir, base);
        hub_spans pr = {0};
        int64_t fs = -1;
        char e2[DF_ERRMSG];
        if (hub_log_read(lp, &pr, &fs, e2) != DF_OK || fs != f->size) {
            dnote(fn, ctx, "LOG %s: %s", f->path, fs != f->size ? "span log missing or for another file" : e2);
            bad++;
            hub_spans_free(&pr);
            free(p);
            continue;
        }
        mshard s = {0};
        s.path = p;
        s.size = f->size;
        s.present = pr;
        s.wfd = open(p, O_RDONLY | O_CLOEXEC);
        if (s.wfd < 0 || shard_header(NULL, &s, 0, e2) != DF_OK) {
            dnote(fn, ctx, "HEADER %s: %s", f->path, s.wfd < 0 ? strerror(errno) : e2);
            bad++;
        } else {
            int64_t loc = 0, tot = 0, miss_ne = 0;
            for (int k = 0; k < s.nt; k++) {
                if (s.t[k].expert) continue;
                hub_spans ms = {0};
                if (hub_spans_missing(&s.present, s.t[k].a, s.t[k].b, &ms) == 0) miss_ne += hub_spans_bytes(&ms);
                hub_spans_free(&ms);
            }
            expert_bytes(&s, &loc, &tot);
            rep->expert_bytes += tot;
            rep->local_expert_bytes += loc;
            rep->local_bytes += hub_spans_bytes(&s.present);
            if (miss_ne) { dnote(fn, ctx, "INCOMPLETE %s: %lld bytes of non-expert tensors missing", f->path, (long long)miss_ne); bad++; }
            dnote(fn, ctx, "%s: %d spans, routed experts %.3f of %.3f MB local", f->path, s.present.n, loc / 1e6, tot / 1e6);
        }
        if (s.wfd >= 0) close(s.wfd);
        free(s.t);
        hub_spans_free(&s.present);
        free(p);
    }
    int64_t freeb = free_disk(dir, 0);
    dnote(fn, ctx, "local %.3f of %.3f GB; %.3f GB free", rep->local_bytes / 1e9, rep->total_bytes / 1e9, freeb / 1e9);
    if (man.mode == HUB_STREAM && rep->expert_bytes > rep->local_expert_bytes && freeb >= 0 &&
        rep->expert_bytes - rep->local_expert_bytes > freeb) {
        dnote(fn, ctx, "NOTE completing the mirror needs %.3f GB, more than is free",
              (rep->expert_bytes - rep->local_expert_bytes) / 1e9);
    }
    manifest_free(&man);
    if (bad) return df_fail(err, DF_ERR_IO, "%s: %d problem%s found", dir, bad, bad == 1 ? "" : "s");
    return DF_OK;
}

/* ---- 7. the stream io table and the public calls ------------------------------------------- */

enum { MAX_MIRRORS = 8 };
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static hub_mirror *g_mirrors[MAX_MIRRORS];
typedef struct { hub_mirror *m; int sh; } fd_entry;
static fd_entry *g_fd;     /* [g_fdcap] by descriptor */
static int g_fdcap;
static df_io g_io;

static int find_shard(dev_t dev, ino_t ino, hub_mirror **m, int *sh) {
    for (int i = 0; i < MAX_MIRRORS; i++) {
        hub_mirror *x = g_mirrors[i];
        for (int k = 0; x && k < x->n_sh; k++)
            if (x->sh[k].dev == dev && x->sh[k].ino == ino) { *m = x; *sh = k; return 1; }
    }
    return 0;
}

static int s_open(const char *path, int flags, int mode) {
    struct stat sb;
    hub_mirror *m = NULL;
    int sh = -1;
    pthread_mutex_lock(&g_mu);
    int ours = stat(path, &sb) == 0 && find_shard(sb.st_dev, sb.st_ino, &m, &sh);
    pthread_mutex_unlock(&g_mu);
    if (ours && (flags & O_DIRECT)) { errno = EINVAL; return -1; }
    int fd = df_io_default()->open(path, flags, mode);
    if (fd < 0 || !ours) return fd;
    pthread_mutex_lock(&g_mu);
    if (fd >= g_fdcap) {
        int cap = fd * 2 + 64;
        fd_entry *n = realloc(g_fd, (size_t)cap * sizeof *n);
        if (!n) { pthread_mutex_unlock(&g_mu); close(fd); errno = ENOMEM; return -1; }
        memset(n + g_fdcap, 0, (size_t)(cap - g_fdcap) * sizeof *n);
        g_fd = n;
        g_fdcap = cap;
    }
    g_fd[fd] = (fd_entry){m, sh};
    pthread_mutex_unlock(&g_mu);
    return fd;
}

static int s_close(int fd) {
    pthread_mutex_lock(&g_mu);
    if (fd >= 0 && fd < g_fdcap) g_fd[fd].m = NULL;
    pthread_mutex_unlock(&g_mu);
    return df_io_default()->close(fd);
}

static ssize_t s_pread(int fd, void *buf, size_t n, off_t off) {
    pthread_mutex_lock(&g_mu);
    fd_entry e = fd >= 0 && fd < g_fdcap ? g_fd[fd] : (fd_entry){NULL, 0};
    pthread_mutex_unlock(&g_mu);
    if (e.m) {
        char err[DF_ERRMSG];
        if (mirror_ensure(e.m, &e.m->sh[e.sh], (int64_t)off, (int64_t)off + (int64_t)n, err) != DF_OK) {
            errno = EIO;
            return -1;
        }
    }
    return df_io_default()->pread(fd, buf, n, off);
}

int df_hub_is_stream(const char *dir) {
    manifest m;
    if (manifest_load(dir, &m, NULL) != DF_OK) return 0;
    int r = m.mode == HUB_STREAM;
    manifest_free(&m);
    return r;
}

df_status df_hub_stream_open(const char *dir, const char *endpoint, const char *token, const struct df_io **io,
                             char err[DF_ERRMSG]) {
    *io = NULL;
    hub_client c = {0};
    c.endpoint = endpoint;
    c.token = token;
    c.retries = 5;
    c.retry_ms = 500;
    c.timeout_s = 60;
    hub_mirror *m;
    df_status st = mirror_open(dir, &c, 0, &m, err);
    if (st != DF_OK) return st;
    if (!m->man.ready) {
        mirror_close(m);
        return df_fail(err, DF_ERR_ARG, "%s: `deltafin setup` did not finish here: run it again", dir);
    }
    for (int i = 0; i < m->n_sh; i++)
        if ((st = shard_header(m, &m->sh[i], 0, err)) != DF_OK) { mirror_close(m); return st; }
    pthread_mutex_lock(&g_mu);
    int slot = -1;
    for (int i = 0; i < MAX_MIRRORS; i++) if (!g_mirrors[i]) { slot = i; break; }
    if (slot >= 0) {
        g_mirrors[slot] = m;
        g_io = *df_io_default();
        g_io.open = s_open;
        g_io.close = s_close;
        g_io.pread = s_pread;
        g_io.ring_open = NULL; g_io.ring_close = NULL; g_io.ring_read = NULL;
        g_io.ring_submit = NULL; g_io.ring_wait = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    if (slot < 0) { mirror_close(m); return df_fail(err, DF_ERR_ARG, "more than %d stream mirrors open", MAX_MIRRORS); }
    *io = &g_io;
    return DF_OK;
}

static hub_mirror *registered(const char *dir) {
    for (int i = 0; i < MAX_MIRRORS; i++)
        if (g_mirrors[i] && !strcmp(g_mirrors[i]->dir, dir)) return g_mirrors[i];
    return NULL;
}

void df_hub_stream_info(const char *dir, df_hub_stream_stats *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&g_mu);
    hub_mirror *m = registered(dir);
    if (m) {
        pthread_mutex_lock(&m->mu);
        for (int i = 0; i < m->n_sh; i++) expert_bytes(&m->sh[i], &out->expert_local, &out->expert_total);
        out->fetched = m->fetched;
        out->requests = m->requests;
        snprintf(out->last_error, sizeof out->last_error, "%s", m->last_err);
        pthread_mutex_unlock(&m->mu);
    }
    pthread_mutex_unlock(&g_mu);
}

void df_hub_stream_close(const char *dir) {
    pthread_mutex_lock(&g_mu);
    hub_mirror *m = registered(dir);
    for (int i = 0; m && i < MAX_MIRRORS; i++) if (g_mirrors[i] == m) g_mirrors[i] = NULL;
    for (int i = 0; m && i < g_fdcap; i++) if (g_fd[i].m == m) g_fd[i].m = NULL;
    int any = 0;
    for (int i = 0; i < MAX_MIRRORS; i++) any |= g_mirrors[i] != NULL;
    if (!any) { free(g_fd); g_fd = NULL; g_fdcap = 0; }
    pthread_mutex_unlock(&g_mu);
    mirror_close(m);
}
