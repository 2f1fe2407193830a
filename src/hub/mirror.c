/* mirror.c — local mirrors of hub repositories, full or stream (see hub.h).
 *
 * Owns: the manifest (DIR/.deltafin-hub/manifest.json), the open mirror
 * (per shard: the write descriptor, the present spans and their log, the
 * spans being fetched), `setup` (choose a mode, download), `fill` (complete a
 * stream mirror), `doctor` (offline check), and the stream-mode df_io table
 * of each open stream (df_hub_stream: the table's ctx; descriptors of its
 * shards are recognised by device and inode at open). No process-wide state.
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
 * Cache limit (`--cache-limit`): the fetch that would pass the budget first
 * evicts the least recently used routed experts (section 3b); the span log
 * records them absent before their bytes are punched out.
 *
 * Sections: 1. manifest  2. safetensors headers  3. the open mirror
 *           3b. the cache limit and mirror_ensure  4. setup  5. fill
 *           5b. warm  6. doctor  7. the stream io table and the public calls
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
#include <time.h>
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
    double rate;         /* bytes/s of the last fetch that measured one; 0 = none yet */
    int64_t rate_at;     /* when (unix seconds) */
    int64_t cache_limit; /* stream: disk budget for routed experts, 0 = none */
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
    if (m->rate > 0) {
        json_object_set_new(root, "rate_bytes_per_s", json_real(m->rate));
        json_object_set_new(root, "rate_at", json_integer(m->rate_at));
    }
    if (m->cache_limit > 0) json_object_set_new(root, "cache_limit", json_integer(m->cache_limit));
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
    m->rate = json_number_value(json_object_get(root, "rate_bytes_per_s"));
    m->rate_at = (int64_t)json_integer_value(json_object_get(root, "rate_at"));
    m->cache_limit = (int64_t)json_integer_value(json_object_get(root, "cache_limit"));
    if (m->rate < 0) m->rate = 0;
    if (m->cache_limit < 0) m->cache_limit = 0;
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

typedef struct {
    int64_t a, b;        /* absolute [a, b) */
    int layer;           /* after "layers.", -1 if none */
    int eid;             /* routed expert number, -1 if not a routed expert */
    int unit;            /* index in mshard.u (routed experts), -1 otherwise */
    uint8_t expert;      /* a routed expert tensor */
} tspan;

static int by_offset(const void *x, const void *y) {
    const tspan *a = x, *b = y;
    return a->a < b->a ? -1 : a->a > b->a;
}

/* The number after the routed "experts." of a tensor name, or -1. */
static int expert_number(const char *name) {
    for (const char *p = name; (p = strstr(p, "experts.")) != NULL; p += 8) {
        if (p > name && p[-1] != '.') continue;
        if (p[8] >= '0' && p[8] <= '9') return atoi(p + 8);
    }
    return -1;
}

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
        v[k].eid = v[k].expert ? expert_number(key) : -1;
        v[k].unit = -1;
        v[k].a = a;
        v[k].b = b;
        k++;
    }
    json_decref(root);
    if (st != DF_OK) { free(v); return st; }
    qsort(v, (size_t)k, sizeof *v, by_offset);
    *out = v;
    *nout = k;
    return DF_OK;
}

/* ---- 3. the open mirror ------------------------------------------------------------- */

/* One routed expert of one shard: the unit of eviction and of `warm`. */
typedef struct {
    int layer, eid;
    int t0, nt;          /* its tensors: mshard.ut[t0 .. t0 + nt) */
    uint64_t tick;       /* last use (mirror tick), 0 = never seen */
} munit;

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
    tspan *t;            /* tensors, once the header is local, sorted by offset */
    int nt;
    hub_spans fixed;     /* header + non-expert tensors: never evicted */
    munit *u;            /* routed experts (eviction units) */
    int nu;
    int *ut;             /* tensor indexes grouped by unit: u[i].t0 .. + u[i].nt */
    int64_t bs;          /* file system block size (punching frees whole blocks) */
} mshard;

typedef struct { int sh; int64_t a, b; } mpin;

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
    /* the cache limit (section 3b) */
    int64_t limit;         /* budget for routed expert blocks in effect, 0 = none */
    int64_t pending;       /* blocks (in bytes) claimed by fetches in flight */
    uint64_t tick;         /* use clock of munit.tick */
    mpin *pins;            /* byte ranges being read: never evicted */
    int n_pins, cap_pins;
    int64_t evicted;       /* bytes punched out by this process */
    int evictions;         /* units evicted by this process */
    char evict_err[DF_ERRMSG]; /* why eviction stopped, "" if it did not */
    /* the measured rate */
    int active;            /* fetches in flight */
    double busy_since, busy_s; /* wall time with at least one fetch in flight */
    double saved_at;       /* last access-file save (monotonic seconds) */
} hub_mirror;

static void mirror_close(hub_mirror *m) {
    if (!m) return;
    for (int i = 0; i < m->n_sh; i++) {
        mshard *s = &m->sh[i];
        if (s->wfd >= 0) close(s->wfd);
        hub_log_close(&s->log);
        hub_spans_free(&s->present);
        hub_spans_free(&s->inflight);
        hub_spans_free(&s->fixed);
        free(s->path); free(s->url); free(s->what); free(s->t); free(s->u); free(s->ut);
    }
    free(m->sh);
    free(m->pins);
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

/* ---- 3b. the cache limit: use clock, pins, eviction ----------------------------------------
 *
 * The budget counts file system blocks, as st_blocks does: a block holding
 * any present routed-expert byte and no header or non-expert byte (those are
 * always local) counts whole. Eviction takes the least recently used expert
 * (its tick: the last read through the stream table, or its fetch) that no
 * reader holds (pins) and no fetch is writing, records it absent in the span
 * log (fdatasync'd) and only then punches its bytes out, widened to whole
 * blocks where the rest of the block holds nothing present or in flight:
 *
 *   block:   |....A....|..A..B...|....B....|      evict A (B present):
 *   punched: |<-- hole -->|zeroed|            the shared block stays, zeroed
 *                                             over A's bytes only
 */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int block_fixed(const mshard *s, int64_t blk) {
    return hub_spans_overlaps(&s->fixed, blk * s->bs, (blk + 1) * s->bs);
}

/* Blocks (in bytes) that the present routed-expert bytes of s occupy. */
static int64_t footprint(const mshard *s) {
    if (!s->t || s->bs <= 0) return 0;
    hub_spans ex = {0};
    for (int i = 0; i < s->present.n; i++)
        if (hub_spans_missing(&s->fixed, s->present.v[i].a, s->present.v[i].b, &ex) != 0) break;
    int64_t blocks = 0, prev = -1;
    for (int i = 0; i < ex.n; i++) {
        int64_t f = ex.v[i].a / s->bs, l = (ex.v[i].b - 1) / s->bs;
        int64_t n = l - f + 1;
        if (f == prev || block_fixed(s, f)) n--;
        if (l != f && block_fixed(s, l)) n--;
        blocks += n;
        prev = l;
    }
    hub_spans_free(&ex);
    return blocks * s->bs;
}

static int64_t footprint_all(const hub_mirror *m) {
    int64_t t = 0;
    for (int i = 0; i < m->n_sh; i++) t += footprint(&m->sh[i]);
    return t;
}

/* Blocks (in bytes) that fetching the pieces in miss can add, at most. */
static int64_t need_of(const mshard *s, const hub_spans *miss) {
    if (s->bs <= 0) return 0;
    int64_t n = 0;
    for (int i = 0; i < miss->n; i++) {
        hub_spans ex = {0};
        if (hub_spans_missing(&s->fixed, miss->v[i].a, miss->v[i].b, &ex) == 0)
            for (int k = 0; k < ex.n; k++) n += (ex.v[k].b - 1) / s->bs - ex.v[k].a / s->bs + 1;
        hub_spans_free(&ex);
    }
    return n * s->bs;
}

static int pin_add(hub_mirror *m, int sh, int64_t a, int64_t b) {
    if (m->n_pins == m->cap_pins) {
        int cap = m->cap_pins ? m->cap_pins * 2 : 16;
        mpin *np = realloc(m->pins, (size_t)cap * sizeof *np);
        if (!np) return -1;
        m->pins = np;
        m->cap_pins = cap;
    }
    m->pins[m->n_pins++] = (mpin){sh, a, b};
    return 0;
}

static void pin_drop(hub_mirror *m, int sh, int64_t a, int64_t b) {
    for (int i = 0; i < m->n_pins; i++)
        if (m->pins[i].sh == sh && m->pins[i].a == a && m->pins[i].b == b) {
            m->pins[i] = m->pins[--m->n_pins];
            return;
        }
}

static int unit_overlaps(const mshard *s, const munit *u, int64_t a, int64_t b) {
    for (int k = 0; k < u->nt; k++) {
        const tspan *t = &s->t[s->ut[u->t0 + k]];
        if (t->a < b && a < t->b) return 1;
    }
    return 0;
}

static int unit_present(const mshard *s, const munit *u) {
    for (int k = 0; k < u->nt; k++) {
        const tspan *t = &s->t[s->ut[u->t0 + k]];
        if (hub_spans_overlaps(&s->present, t->a, t->b)) return 1;
    }
    return 0;
}

static int unit_missing(const mshard *s, const munit *u) {
    for (int k = 0; k < u->nt; k++) {
        const tspan *t = &s->t[s->ut[u->t0 + k]];
        if (!hub_spans_covers(&s->present, t->a, t->b)) return 1;
    }
    return 0;
}

/* Marks the experts overlapping [a, b) of shard s used now. */
static void touch(hub_mirror *m, mshard *s, int64_t a, int64_t b) {
    if (!s->t) return;
    int lo = 0, hi = s->nt;
    while (lo < hi) { /* first tensor ending after a */
        int mid = (lo + hi) / 2;
        if (s->t[mid].b <= a) lo = mid + 1; else hi = mid;
    }
    uint64_t tk = ++m->tick;
    for (int i = lo; i < s->nt && s->t[i].a < b; i++)
        if (s->t[i].unit >= 0) s->u[s->t[i].unit].tick = tk;
}

/* Evicts expert u of shard s (m->mu held). On a log error nothing changed;
 * on a punch error the expert is absent (and refetched when used) but its
 * blocks may stay allocated. */
static df_status evict_unit(hub_mirror *m, mshard *s, munit *u, char *err) {
    hub_spans gone = {0};
    df_status st = DF_OK;
    for (int k = 0; k < u->nt && st == DF_OK; k++) { /* its present bytes */
        const tspan *t = &s->t[s->ut[u->t0 + k]];
        hub_spans miss = {0};
        if (hub_spans_missing(&s->present, t->a, t->b, &miss) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
        int64_t at = t->a;
        for (int i = 0; st == DF_OK && i <= miss.n; i++) {
            int64_t e = i < miss.n ? miss.v[i].a : t->b;
            if (e > at && hub_spans_add(&gone, at, e) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
            if (i < miss.n) at = miss.v[i].b;
        }
        hub_spans_free(&miss);
    }
    /* 1. absent in the log, durably; 2. absent in memory; 3. punched */
    for (int i = 0; st == DF_OK && i < gone.n; i++) {
        st = hub_log_remove(&s->log, gone.v[i].a, gone.v[i].b, err);
        if (st == DF_OK) hub_spans_remove(&s->present, gone.v[i].a, gone.v[i].b);
    }
    for (int i = 0; st == DF_OK && i < gone.n; i++) {
        int64_t a = gone.v[i].a, b = gone.v[i].b;
        int64_t fa = a / s->bs * s->bs, fb = (b + s->bs - 1) / s->bs * s->bs;
        if (fb > s->size) fb = s->size;
        if (fa < a && !hub_spans_overlaps(&s->present, fa, a) && !hub_spans_overlaps(&s->inflight, fa, a)) a = fa;
        if (fb > b && !hub_spans_overlaps(&s->present, b, fb) && !hub_spans_overlaps(&s->inflight, b, fb)) b = fb;
        struct timespec ts[2] = {{0, UTIME_OMIT}, s->mtime};
        if (fallocate(s->wfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, a, b - a) != 0)
            st = df_fail(err, DF_ERR_IO, "%s: cannot punch a hole (the file system must support it for --cache-limit): %s",
                         s->path, strerror(errno));
        else
            futimens(s->wfd, ts);
        m->evicted += gone.v[i].b - gone.v[i].a;
    }
    if (st == DF_OK) m->evictions++;
    hub_spans_free(&gone);
    return st;
}

/* Evicts the coldest experts until the present ones plus those in flight
 * plus `need` fit the limit, or nothing evictable is left (m->mu held). A
 * failure turns eviction off for this process (m->evict_err says why). */
static void make_room(hub_mirror *m, int64_t need) {
    if (m->limit <= 0) return;
    int64_t used = footprint_all(m);
    while (used + m->pending + need > m->limit) {
        mshard *bs = NULL;
        munit *bu = NULL;
        for (int i = 0; i < m->n_sh; i++) {
            mshard *s = &m->sh[i];
            for (int k = 0; k < s->nu; k++) {
                munit *u = &s->u[k];
                if (bu && u->tick >= bu->tick) continue;
                if (!unit_present(s, u)) continue;
                int busy = 0;
                for (int p = 0; p < m->n_pins && !busy; p++)
                    busy = m->pins[p].sh == i && unit_overlaps(s, u, m->pins[p].a, m->pins[p].b);
                for (int t = 0; t < u->nt && !busy; t++) {
                    const tspan *x = &s->t[s->ut[u->t0 + t]];
                    busy = hub_spans_overlaps(&s->inflight, x->a, x->b);
                }
                if (busy) continue;
                bs = s;
                bu = u;
            }
        }
        if (!bu) return;
        char err[DF_ERRMSG];
        if (evict_unit(m, bs, bu, err) != DF_OK) {
            snprintf(m->evict_err, sizeof m->evict_err, "%s", err);
            m->limit = 0;
            return;
        }
        used = footprint_all(m);
    }
}

static void busy_begin(hub_mirror *m) {
    if (m->active++ == 0) m->busy_since = now_s();
}
static void busy_end(hub_mirror *m) {
    if (--m->active == 0) m->busy_s += now_s() - m->busy_since;
}

/* The use clock survives the process in DIR/.deltafin-hub/access, a hint
 * (not fsync'd; a missing or foreign file means "all equally cold"):
 *   "DFACCES1" | u32 shards | per shard: u32 units, u64 tick per unit */
static char *access_path(const hub_mirror *m) { return pjoin(m->dir, HUB_DIR "/access"); }

static void access_save(hub_mirror *m) {
    size_t n = 12;
    for (int i = 0; i < m->n_sh; i++) n += 4 + (size_t)m->sh[i].nu * 8;
    uint8_t *p = malloc(n);
    char *path = access_path(m), *tmp = path ? malloc(strlen(path) + 5) : NULL;
    if (!p || !tmp) { free(p); free(path); free(tmp); return; }
    memcpy(p, "DFACCES1", 8);
    size_t at = 8;
    uint32_t ns = (uint32_t)m->n_sh;
    memcpy(p + at, &ns, 4), at += 4;
    for (int i = 0; i < m->n_sh; i++) {
        uint32_t nu = (uint32_t)m->sh[i].nu;
        memcpy(p + at, &nu, 4), at += 4;
        for (int k = 0; k < m->sh[i].nu; k++) memcpy(p + at, &m->sh[i].u[k].tick, 8), at += 8;
    }
    sprintf(tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int ok = fd >= 0 && write_at(fd, p, n, 0) == 0;
    if (fd >= 0) close(fd);
    if (ok) rename(tmp, path); else unlink(tmp);
    free(p); free(path); free(tmp);
}

/* Loads the use clock (every shard's header parsed). */
static void access_load(hub_mirror *m) {
    char *path = access_path(m);
    FILE *f = path ? fopen(path, "rb") : NULL;
    free(path);
    if (!f) return;
    char mg[8];
    uint32_t ns = 0;
    int ok = fread(mg, 1, 8, f) == 8 && !memcmp(mg, "DFACCES1", 8) && fread(&ns, 4, 1, f) == 1 && ns == (uint32_t)m->n_sh;
    for (int i = 0; ok && i < m->n_sh; i++) {
        uint32_t nu = 0;
        ok = fread(&nu, 4, 1, f) == 1 && nu == (uint32_t)m->sh[i].nu;
        for (int k = 0; ok && k < m->sh[i].nu; k++) {
            uint64_t t;
            ok = fread(&t, 8, 1, f) == 1;
            if (ok) {
                m->sh[i].u[k].tick = t;
                if (t > m->tick) m->tick = t;
            }
        }
    }
    fclose(f);
}

/* Records the rate this process measured (bytes over the time a fetch was in
 * flight) in the manifest, for the next start-up estimate. */
static void rate_save(hub_mirror *m) {
    if (m->fetched <= 0 || m->busy_s <= 0) return;
    manifest man;
    if (manifest_load(m->dir, &man, NULL) != DF_OK) return;
    man.rate = (double)m->fetched / m->busy_s;
    man.rate_at = (int64_t)time(NULL);
    manifest_save(m->dir, &man, NULL);
    manifest_free(&man);
}

/* Makes bytes [a, b) of shard s local (see the protocol at the top) and
 * marks the experts there used. keep_pin: on success [a, b) stays pinned
 * (never evicted) until the caller's pin_drop under m->mu. On error nothing
 * that failed is marked present and nothing stays pinned. */
static df_status mirror_ensure_pin(hub_mirror *m, mshard *s, int64_t a, int64_t b, int keep_pin, char *err) {
    if (a < 0) a = 0;
    if (b > s->size) b = s->size;
    if (b <= a) return DF_OK;
    int si = (int)(s - m->sh);
    hub_spans miss = {0};
    pthread_mutex_lock(&m->mu);
    for (;;) {
        if (hub_spans_covers(&s->present, a, b)) {
            touch(m, s, a, b);
            int pe = keep_pin && pin_add(m, si, a, b) != 0;
            pthread_mutex_unlock(&m->mu);
            hub_spans_free(&miss);
            return pe ? df_fail(err, DF_ERR_NOMEM, "out of memory") : DF_OK;
        }
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
    int claimed = 0;
    /* the present parts of [a, b) must survive the eviction this fetch may cause */
    if (pin_add(m, si, a, b) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (; st == DF_OK && claimed < miss.n; claimed++)
        if (hub_spans_add(&s->inflight, miss.v[claimed].a, miss.v[claimed].b) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    int64_t need = st == DF_OK && m->limit > 0 ? need_of(s, &miss) : 0;
    if (st == DF_OK) {
        make_room(m, need);
        m->pending += need;
        busy_begin(m);
    }
    int fetching = st == DF_OK;
    pthread_mutex_unlock(&m->mu);
    uint8_t *ok = calloc((size_t)miss.n + 1, 1);
    if (!ok) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == DF_OK && i < miss.n; i++) {
        st = fetch_piece(m, s, miss.v[i].a, miss.v[i].b, err);
        if (st == DF_OK) ok[i] = 1;
    }
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < claimed; i++) {
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
    if (fetching) {
        m->pending -= need;
        busy_end(m);
    }
    touch(m, s, a, b);
    if (st != DF_OK || !keep_pin) pin_drop(m, si, a, b);
    if (st != DF_OK && err) snprintf(m->last_err, sizeof m->last_err, "%s", err);
    int save = m->limit > 0 && now_s() - m->saved_at > 2.0;
    if (save) {
        m->saved_at = now_s();
        access_save(m);
    }
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    free(ok);
    hub_spans_free(&miss);
    return st;
}

static df_status mirror_ensure(hub_mirror *m, mshard *s, int64_t a, int64_t b, char *err) {
    return mirror_ensure_pin(m, s, a, b, 0, err);
}

/* qsort_r order of tensor indices (into ctx, the shard's tspans) by expert unit */
static int by_unit(const void *x, const void *y, void *ctx) {
    const tspan *t = ctx;
    const tspan *a = &t[*(const int *)x], *b = &t[*(const int *)y];
    if (a->layer != b->layer) return a->layer < b->layer ? -1 : 1;
    if (a->eid != b->eid) return a->eid < b->eid ? -1 : 1;
    return a->a < b->a ? -1 : a->a > b->a;
}

/* After the header is parsed: the never-evicted bytes (header, non-expert
 * tensors), the block size, and one unit per routed expert of the shard. */
static df_status build_units(mshard *s, int64_t header_end, char *err) {
    struct stat sb;
    s->bs = s->wfd >= 0 && fstat(s->wfd, &sb) == 0 && sb.st_blksize > 0 ? (int64_t)sb.st_blksize : 4096;
    if (hub_spans_add(&s->fixed, 0, header_end) != 0) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    int ne = 0;
    for (int i = 0; i < s->nt; i++) {
        if (s->t[i].expert && s->t[i].eid >= 0) { ne++; continue; }
        if (hub_spans_add(&s->fixed, s->t[i].a, s->t[i].b) != 0) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    s->ut = malloc((size_t)(ne ? ne : 1) * sizeof *s->ut);
    s->u = calloc((size_t)(ne ? ne : 1), sizeof *s->u);
    if (!s->ut || !s->u) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    int k = 0;
    for (int i = 0; i < s->nt; i++) if (s->t[i].expert && s->t[i].eid >= 0) s->ut[k++] = i;
    qsort_r(s->ut, (size_t)ne, sizeof *s->ut, by_unit, s->t);
    s->nu = 0;
    for (int i = 0; i < ne; i++) {
        tspan *t = &s->t[s->ut[i]];
        munit *u = s->nu ? &s->u[s->nu - 1] : NULL;
        if (!u || u->layer != t->layer || u->eid != t->eid) {
            u = &s->u[s->nu++];
            u->layer = t->layer;
            u->eid = t->eid;
            u->t0 = i;
        }
        u->nt++;
        t->unit = (int)(u - s->u);
    }
    return DF_OK;
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
    if (st == DF_OK) st = build_units(s, 8 + (int64_t)n, err);
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

/* ---- the worker queue used by setup and the fills ---- */

/* n jobs handed out in order to up to `workers` threads; after the first
 * error no new job starts, and that error is returned. */
typedef struct {
    df_status (*job)(void *ctx, int i, char *err);
    void *ctx;
    int n, next;
    pthread_mutex_t mu;
    df_status st;
    char err[DF_ERRMSG];
} work_queue;

static void *wq_worker(void *arg) {
    work_queue *q = arg;
    for (;;) {
        pthread_mutex_lock(&q->mu);
        int j = q->st == DF_OK && q->next < q->n ? q->next++ : -1;
        pthread_mutex_unlock(&q->mu);
        if (j < 0) return NULL;
        char err[DF_ERRMSG];
        df_status st = q->job(q->ctx, j, err);
        if (st != DF_OK) {
            pthread_mutex_lock(&q->mu);
            if (q->st == DF_OK) { q->st = st; snprintf(q->err, sizeof q->err, "%s", err); }
            pthread_mutex_unlock(&q->mu);
        }
    }
}

static df_status wq_run(df_status (*job)(void *, int, char *), void *ctx, int n, int workers, char *err) {
    work_queue q = {.job = job, .ctx = ctx, .n = n, .st = DF_OK};
    pthread_mutex_init(&q.mu, NULL);
    if (workers < 1) workers = 4;
    if (workers > 32) workers = 32;
    pthread_t th[32];
    int started = 0;
    for (int i = 0; i < workers && i < n; i++)
        if (pthread_create(&th[started], NULL, wq_worker, &q) == 0) started++;
    if (!started && n) wq_worker(&q);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_mutex_destroy(&q.mu);
    return q.st != DF_OK ? df_fail(err, q.st, "%s", q.err) : DF_OK;
}

/* ---- 4. setup ---------------------------------------------------------------------- */

typedef struct {
    const hub_setup_opts *o;
    hub_listing *l;
    hub_mirror *m;       /* stream */
    manifest *man;
    int n_jobs;
    int *jobs;           /* file indexes */
    pthread_mutex_t mu;  /* guards fetched, requests and the manifest */
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

static df_status setup_one(void *ctx, int i, char *err) {
    setup_ctx *x = ctx;
    return setup_job(x, x->jobs[i], err);
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
        man.cache_limit = old.cache_limit;
        man.rate = old.rate;
        man.rate_at = old.rate_at;
        if (!strcmp(old.repo, man.repo) && !strcmp(old.commit, man.commit)) {
            old_mode = old.mode;
            for (int i = 0; i < man.n_files; i++)
                for (int k = 0; k < old.n_files; k++)
                    if (!strcmp(old.files[k].path, man.files[i].path) && old.files[k].size == man.files[i].size)
                        man.verified[i] = old.verified[k];
        }
        manifest_free(&old);
    }
    if (o->cache_limit >= 0) man.cache_limit = o->cache_limit;
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
    double t0 = now_s();
    st = wq_run(setup_one, &x, x.n_jobs, o->workers, err);
    if (st == DF_OK) {
        double dt = now_s() - t0;
        int64_t got = x.fetched + (x.m ? x.m->fetched : 0);
        if (got > 0 && dt > 0) {
            x.man->rate = (double)got / dt;
            x.man->rate_at = (int64_t)time(NULL);
        }
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
        st = hub_fill(o->dir, &o->client, NULL, 0, o->workers, 0, 0, &fr, err);
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
    int n;
} fill_ctx;

static df_status fill_one(void *ctx, int i, char *err) {
    fill_ctx *x = ctx;
    return mirror_ensure(x->m, &x->m->sh[x->p[i].sh], x->p[i].a, x->p[i].b, err);
}

/* Fetches the pieces x->p with `workers` threads; the first error. */
static df_status run_pieces(fill_ctx *x, int workers, char *err) {
    return wq_run(fill_one, x, x->n, workers, err);
}

static int add_piece(fill_ctx *x, int *cap, int sh, int64_t a, int64_t b) {
    if (x->n == *cap) {
        int nc = *cap ? *cap * 2 : 64;
        piece *np = realloc(x->p, (size_t)nc * sizeof *np);
        if (!np) return -1;
        x->p = np;
        *cap = nc;
    }
    x->p[x->n++] = (piece){sh, a, b};
    return 0;
}

df_status hub_fill(const char *dir, const hub_client *c, const uint8_t *layers, int n_layers, int workers,
                   int dry_run, int64_t cache_limit, hub_report *rep, char *err) {
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
                int64_t b = want.v[i].b - a > CHUNK_MAX ? a + CHUNK_MAX : want.v[i].b;
                if (add_piece(&x, &cap, si, a, b) != 0) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); break; }
                rep->total_bytes += b - a; /* bytes to fetch */
            }
        hub_spans_free(&want);
    }
    rep->requests = x.n;
    if (st == DF_OK) {
        access_load(m);
        m->limit = cache_limit < 0 ? m->man.cache_limit : cache_limit;
        /* all the experts must fit: fetching more than the budget would evict what it just fetched */
        int64_t need = 0;
        for (int i = 0; m->limit > 0 && i < x.n; i++) {
            hub_spans one = {0};
            if (hub_spans_add(&one, x.p[i].a, x.p[i].b) == 0) need += need_of(&m->sh[x.p[i].sh], &one);
            hub_spans_free(&one);
        }
        if (m->limit > 0 && need > m->limit)
            st = df_fail(err, DF_ERR_ARG,
                         "%s: fetching these experts needs %.3f MB but the cache limit is %.3f MB: fetch fewer "
                         "layers, or raise the limit (--cache-limit SIZE, 0 = none)",
                         dir, need / 1e6, m->limit / 1e6);
    }
    if (st == DF_OK && !dry_run && x.n) {
        st = run_pieces(&x, workers, err);
        rep->fetched_bytes = m->fetched;
        pthread_mutex_lock(&m->mu);
        access_save(m);
        pthread_mutex_unlock(&m->mu);
        if (m->fetched > 0 && m->busy_s > 0) {
            m->man.rate = (double)m->fetched / m->busy_s;
            m->man.rate_at = (int64_t)time(NULL);
            df_status s2 = manifest_save(dir, &m->man, st == DF_OK ? err : NULL);
            if (st == DF_OK) st = s2;
        }
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
    free(x.p);
    mirror_close(m);
    return st;
}

/* ---- 5b. warm ----------------------------------------------------------------------------- */

typedef struct { int layer, eid, sh, u; } uref; /* an expert's unit in one shard */

static int by_ref(const void *x, const void *y) {
    const uref *a = x, *b = y;
    if (a->layer != b->layer) return a->layer < b->layer ? -1 : 1;
    return a->eid < b->eid ? -1 : a->eid > b->eid;
}

/* Every unit of the mirror sorted by (layer, expert); malloc'd. */
static uref *unit_index(const hub_mirror *m, int *n) {
    int t = 0;
    for (int i = 0; i < m->n_sh; i++) t += m->sh[i].nu;
    uref *v = malloc((size_t)(t ? t : 1) * sizeof *v);
    if (!v) return NULL;
    *n = 0;
    for (int i = 0; i < m->n_sh; i++)
        for (int k = 0; k < m->sh[i].nu; k++) v[(*n)++] = (uref){m->sh[i].u[k].layer, m->sh[i].u[k].eid, i, k};
    qsort(v, (size_t)*n, sizeof *v, by_ref);
    return v;
}

/* The units of (layer, expert): *first and the count. */
static int unit_find(const uref *v, int n, int layer, int eid, int *first) {
    int lo = 0, hi = n;
    uref key = {layer, eid, 0, 0};
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (by_ref(&v[mid], &key) < 0) lo = mid + 1; else hi = mid;
    }
    int k = lo;
    while (k < n && v[k].layer == layer && v[k].eid == eid) k++;
    *first = lo;
    return k - lo;
}

df_status hub_warm(const char *dir, const hub_client *c, const hub_rank *r, int n_rank, int n_fetch, int workers,
                   int dry_run, int64_t cache_limit, hub_report *rep, int *unknown, char *err) {
    memset(rep, 0, sizeof *rep);
    *unknown = 0;
    hub_mirror *m;
    df_status st = mirror_open(dir, c, 0, &m, err);
    if (st != DF_OK) return st;
    rep->mode = m->man.mode;
    if (!m->man.ready) {
        mirror_close(m);
        return df_fail(err, DF_ERR_ARG, "%s: setup did not finish: run `deltafin setup` again first", dir);
    }
    for (int si = 0; st == DF_OK && si < m->n_sh; si++) {
        st = shard_header(m, &m->sh[si], 0, err);
        if (st == DF_OK) expert_bytes(&m->sh[si], &rep->local_expert_bytes, &rep->expert_bytes);
    }
    if (st != DF_OK) { mirror_close(m); return st; }
    access_load(m);
    m->limit = cache_limit < 0 ? m->man.cache_limit : cache_limit;
    /* the chosen experts in rank order: (shard, unit); one expert may span shards */
    typedef struct { int sh, u, rank; } pick;
    pick *pk = malloc((size_t)(n_rank > 0 ? n_rank : 1) * 2 * sizeof *pk);
    int npk = 0, chosen = 0, cap = 0;
    int64_t need = 0;
    fill_ctx x = {0};
    x.m = m;
    int nidx = 0;
    uref *idx = unit_index(m, &nidx);
    if (!pk || !idx) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == DF_OK && i < n_rank && chosen < n_fetch; i++) {
        int missing = 0, f0;
        int64_t add = 0;
        int found = unit_find(idx, nidx, r[i].layer, r[i].expert, &f0);
        for (int q = f0; q < f0 + found; q++) {
            mshard *s = &m->sh[idx[q].sh];
            int k = idx[q].u;
            {
                if (!unit_missing(s, &s->u[k])) continue;
                missing = 1;
                hub_spans miss = {0};
                for (int t = 0; t < s->u[k].nt; t++) {
                    const tspan *ts = &s->t[s->ut[s->u[k].t0 + t]];
                    hub_spans_missing(&s->present, ts->a, ts->b, &miss);
                }
                add += need_of(s, &miss);
                hub_spans_free(&miss);
            }
        }
        if (!found) { (*unknown)++; continue; }
        if (!missing) continue;
        if (m->limit > 0 && need + add > m->limit) break; /* the budget holds no more */
        need += add;
        chosen++;
        for (int q = f0; q < f0 + found; q++) {
            mshard *s = &m->sh[idx[q].sh];
            if (unit_missing(s, &s->u[idx[q].u]) && npk < 2 * n_rank) pk[npk++] = (pick){idx[q].sh, idx[q].u, i};
        }
    }
    /* the missing bytes of the chosen, per shard; adjacent ones coalesce */
    for (int si = 0; st == DF_OK && si < m->n_sh; si++) {
        mshard *s = &m->sh[si];
        hub_spans want = {0};
        for (int p = 0; p < npk; p++) {
            if (pk[p].sh != si) continue;
            munit *u = &s->u[pk[p].u];
            for (int t = 0; t < u->nt; t++) {
                const tspan *ts = &s->t[s->ut[u->t0 + t]];
                if (hub_spans_missing(&s->present, ts->a, ts->b, &want) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
            }
        }
        for (int i = 0; st == DF_OK && i < want.n; i++)
            for (int64_t a = want.v[i].a; a < want.v[i].b; a += CHUNK_MAX) {
                int64_t b = want.v[i].b - a > CHUNK_MAX ? a + CHUNK_MAX : want.v[i].b;
                if (add_piece(&x, &cap, si, a, b) != 0) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); break; }
                rep->total_bytes += b - a;
            }
        hub_spans_free(&want);
    }
    rep->requests = chosen;
    if (st == DF_OK && !dry_run) {
        if (x.n) st = run_pieces(&x, workers, err);
        rep->fetched_bytes = m->fetched;
        /* the ranked local experts used coldest first: the hottest are evicted last */
        pthread_mutex_lock(&m->mu);
        for (int i = n_rank - 1; i >= 0; i--) {
            uint64_t tk = ++m->tick;
            int f0, nf = unit_find(idx, nidx, r[i].layer, r[i].expert, &f0);
            for (int q = f0; q < f0 + nf; q++) {
                munit *u = &m->sh[idx[q].sh].u[idx[q].u];
                if (unit_present(&m->sh[idx[q].sh], u)) u->tick = tk;
            }
        }
        access_save(m);
        pthread_mutex_unlock(&m->mu);
        if (m->fetched > 0 && m->busy_s > 0) {
            m->man.rate = (double)m->fetched / m->busy_s;
            m->man.rate_at = (int64_t)time(NULL);
            df_status s2 = manifest_save(dir, &m->man, st == DF_OK ? err : NULL);
            if (st == DF_OK) st = s2;
        }
        rep->local_expert_bytes = rep->expert_bytes = 0;
        for (int si = 0; si < m->n_sh; si++) expert_bytes(&m->sh[si], &rep->local_expert_bytes, &rep->expert_bytes);
    }
    free(x.p);
    free(pk);
    free(idx);
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
        free(s.t); free(s.u); free(s.ut);
        hub_spans_free(&s.fixed);
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

/* One open stream mirror: its df_io table (ctx = the stream) and which of
 * its shards each descriptor opened through the table reads. */
typedef struct { int ours, sh; } fd_entry;
struct df_hub_stream {
    hub_mirror *m;
    df_io io;
    pthread_mutex_t mu; /* fd, fdcap */
    fd_entry *fd;       /* [fdcap] by descriptor */
    int fdcap;
};

static int find_shard(const hub_mirror *m, dev_t dev, ino_t ino, int *sh) {
    for (int k = 0; k < m->n_sh; k++)
        if (m->sh[k].dev == dev && m->sh[k].ino == ino) { *sh = k; return 1; }
    return 0;
}

static int s_open(void *ctx, const char *path, int flags, int mode) {
    df_hub_stream *hs = ctx;
    struct stat sb;
    int sh = -1;
    int ours = stat(path, &sb) == 0 && find_shard(hs->m, sb.st_dev, sb.st_ino, &sh);
    if (ours && (flags & O_DIRECT)) { errno = EINVAL; return -1; }
    int fd = io_open(df_io_default(), path, flags, mode);
    if (fd < 0 || !ours) return fd;
    pthread_mutex_lock(&hs->mu);
    if (fd >= hs->fdcap) {
        int cap = fd * 2 + 64;
        fd_entry *n = realloc(hs->fd, (size_t)cap * sizeof *n);
        if (!n) { pthread_mutex_unlock(&hs->mu); close(fd); errno = ENOMEM; return -1; }
        memset(n + hs->fdcap, 0, (size_t)(cap - hs->fdcap) * sizeof *n);
        hs->fd = n;
        hs->fdcap = cap;
    }
    hs->fd[fd] = (fd_entry){1, sh};
    pthread_mutex_unlock(&hs->mu);
    return fd;
}

static int s_close(void *ctx, int fd) {
    df_hub_stream *hs = ctx;
    pthread_mutex_lock(&hs->mu);
    if (fd >= 0 && fd < hs->fdcap) hs->fd[fd].ours = 0;
    pthread_mutex_unlock(&hs->mu);
    return io_close(df_io_default(), fd);
}

static ssize_t s_pread(void *ctx, int fd, void *buf, size_t n, off_t off) {
    df_hub_stream *hs = ctx;
    pthread_mutex_lock(&hs->mu);
    fd_entry e = fd >= 0 && fd < hs->fdcap ? hs->fd[fd] : (fd_entry){0, 0};
    pthread_mutex_unlock(&hs->mu);
    if (!e.ours) return io_pread(df_io_default(), fd, buf, n, off);
    /* pinned from the check to the end of the read: an eviction for another
     * fetch cannot punch these bytes out under us */
    char err[DF_ERRMSG];
    hub_mirror *m = hs->m;
    int64_t a = (int64_t)off, b = (int64_t)off + (int64_t)n;
    mshard *s = &m->sh[e.sh];
    if (a < 0) a = 0;
    if (b > s->size) b = s->size;
    if (mirror_ensure_pin(m, s, a, b, 1, err) != DF_OK) {
        errno = EIO;
        return -1;
    }
    ssize_t r = io_pread(df_io_default(), fd, buf, n, off);
    int er = errno;
    if (b > a) {
        pthread_mutex_lock(&m->mu);
        pin_drop(m, e.sh, a, b);
        pthread_mutex_unlock(&m->mu);
    }
    errno = er;
    return r;
}

int df_hub_is_stream(const char *dir) {
    manifest m;
    if (manifest_load(dir, &m, NULL) != DF_OK) return 0;
    int r = m.mode == HUB_STREAM;
    manifest_free(&m);
    return r;
}

df_status df_hub_stream_open(const char *dir, const char *endpoint, const char *token, df_hub_stream **out,
                             char err[DF_ERRMSG]) {
    *out = NULL;
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
    access_load(m);
    m->limit = m->man.cache_limit;
    pthread_mutex_lock(&m->mu);
    make_room(m, 0); /* a budget lowered since the last run */
    pthread_mutex_unlock(&m->mu);
    df_hub_stream *hs = calloc(1, sizeof *hs);
    if (!hs) { mirror_close(m); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    hs->m = m;
    pthread_mutex_init(&hs->mu, NULL);
    hs->io = *df_io_default();
    hs->io.open = s_open;
    hs->io.close = s_close;
    hs->io.pread = s_pread;
    hs->io.ring_open = NULL; hs->io.ring_close = NULL; hs->io.ring_read = NULL;
    hs->io.ring_submit = NULL; hs->io.ring_wait = NULL;
    hs->io.fills_in_place = 1;
    hs->io.ctx = hs;
    *out = hs;
    return DF_OK;
}

const struct df_io *df_hub_stream_io(const df_hub_stream *hs) { return hs ? &hs->io : NULL; }

void df_hub_stream_info(df_hub_stream *hs, df_hub_stream_stats *out) {
    memset(out, 0, sizeof *out);
    if (!hs) return;
    hub_mirror *m = hs->m;
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->n_sh; i++) expert_bytes(&m->sh[i], &out->expert_local, &out->expert_total);
    out->fetched = m->fetched;
    out->requests = m->requests;
    snprintf(out->last_error, sizeof out->last_error, "%s", m->last_err);
    pthread_mutex_unlock(&m->mu);
}

static void flush(hub_mirror *m) {
    pthread_mutex_lock(&m->mu);
    access_save(m);
    pthread_mutex_unlock(&m->mu);
    rate_save(m);
}

void hub_stream_flush(df_hub_stream *hs) {
    if (hs) flush(hs->m);
}

df_status hub_stream_set_limit(df_hub_stream *hs, int64_t limit, char *err) {
    if (!hs) return df_fail(err, DF_ERR_ARG, "not an open stream mirror");
    hub_mirror *m = hs->m;
    df_status st = DF_OK;
    pthread_mutex_lock(&m->mu);
    m->limit = limit < 0 ? m->man.cache_limit : limit;
    make_room(m, 0);
    if (m->evict_err[0]) st = df_fail(err, DF_ERR_IO, "%s", m->evict_err);
    pthread_mutex_unlock(&m->mu);
    return st;
}

void hub_stream_meta(df_hub_stream *hs, hub_meta *out) {
    memset(out, 0, sizeof *out);
    if (!hs) return;
    hub_mirror *m = hs->m;
    pthread_mutex_lock(&m->mu);
    out->rate = m->man.rate;
    out->rate_at = m->man.rate_at;
    out->cache_limit = m->limit;
    out->cache_used = footprint_all(m);
    out->evicted = m->evicted;
    out->evictions = m->evictions;
    snprintf(out->evict_err, sizeof out->evict_err, "%s", m->evict_err);
    pthread_mutex_unlock(&m->mu);
}

void df_hub_stream_close(df_hub_stream *hs) {
    if (!hs) return;
    flush(hs->m);
    mirror_close(hs->m);
    pthread_mutex_destroy(&hs->mu);
    free(hs->fd);
    free(hs);
}
