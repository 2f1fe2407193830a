/* mirror.c — an open mirror of a hub repository, full or stream (see mirror.h).
 *
 * Owns: the open mirror (per shard: the write descriptor, the present spans
 * and their log, the spans being fetched, the safetensors header as tensor
 * spans and the routed experts as units), the pool of hub connections, the
 * fetch protocol (hub_mirror_ensure) and the rate it measures. No
 * process-wide state.
 * Refuses: a shard whose size is not the hub's; a header longer than 100 MiB
 * or outside its file; to print.
 *
 * Fetch protocol of one span (hub_mirror_ensure), any number of threads:
 *   lock: missing = wanted - present; wait while any of it is in flight;
 *         claim it (inflight += missing)
 *   unlock: one Range request per missing piece; pwrite; restore the
 *         shard's mtime (the expert store treats a new mtime as a changed
 *         file); fdatasync
 *   lock: present += piece; append it to the log (fdatasync'd);
 *         inflight -= missing; wake waiters
 *
 * Sections: 1. safetensors headers  2. open and close  3. fetching
 *           4. expert units
 */
#include "mirror.h"
#include "../base/port.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ST_MAX_HEADER ((int64_t)100 << 20)

/* ---- 1. safetensors headers ---------------------------------------------------------- */

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

/* ---- 2. open and close --------------------------------------------------------------- */

void hub_mirror_close(hub_mirror *m) {
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
    hub_manifest_free(&m->man);
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
df_status hub_mirror_open(const char *dir, const hub_client *c, int create, hub_mirror **out, char *err) {
    *out = NULL;
    hub_mirror *m = calloc(1, sizeof *m);
    if (!m) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    m->dir = strdup(dir);
    df_status st = hub_manifest_load(dir, &m->man, err);
    if (st != DF_OK || !m->dir) { hub_mirror_close(m); return st != DF_OK ? st : df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    m->c = *c;
    m->endpoint = strdup(c->endpoint && *c->endpoint ? c->endpoint : m->man.endpoint);
    m->token = c->token ? strdup(c->token) : NULL;
    m->c.endpoint = m->endpoint;
    m->c.token = m->token;
    m->c.progress = NULL;
    m->sh = calloc((size_t)m->man.n_files + 1, sizeof *m->sh);
    if (!m->sh || !m->endpoint) { hub_mirror_close(m); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    for (int i = 0; i < m->man.n_files; i++) {
        const hub_file *f = &m->man.files[i];
        if (!hub_is_shard(f->path) || hub_skipped_file(f->path)) continue;
        mshard *s = &m->sh[m->n_sh++];
        s->wfd = -1;
        s->log.fd = -1;
        s->file = i;
        s->size = f->size;
        s->path = hub_pjoin(dir, f->path);
        s->url = hub_resolve_url(&m->c, m->man.repo, m->man.commit, f->path);
        size_t wl = strlen(m->man.repo) + strlen(f->path) + 2;
        s->what = malloc(wl);
        char *logp = NULL, *ld = hub_pjoin(dir, HUB_DIR "/spans");
        const char *base = strrchr(f->path, '/') ? strrchr(f->path, '/') + 1 : f->path;
        char lname[512];
        snprintf(lname, sizeof lname, "%s.spans", base);
        if (ld) logp = hub_pjoin(ld, lname);
        if (!s->path || !s->url || !s->what || !logp) {
            free(ld); free(logp);
            hub_mirror_close(m);
            return df_fail(err, DF_ERR_NOMEM, "out of memory");
        }
        snprintf(s->what, wl, "%s/%s", m->man.repo, f->path);
        if (create) {
            if (hub_mkdirs(ld) != 0) st = df_fail(err, DF_ERR_IO, "%s: cannot create: %s", ld, strerror(errno));
            else st = prepare_sparse(s->path, logp, s->size, err);
        }
        if (st == DF_OK) st = hub_log_open(logp, s->size, &s->present, &s->log, err);
        free(ld);
        free(logp);
        if (st != DF_OK) { hub_mirror_close(m); return st; }
        struct stat sb;
        s->wfd = open(s->path, O_RDWR | O_CLOEXEC);
        if (s->wfd < 0 || fstat(s->wfd, &sb) != 0) {
            st = df_fail(err, DF_ERR_IO, "%s: cannot open: %s", s->path, strerror(errno));
            hub_mirror_close(m);
            return st;
        }
        if (sb.st_size != s->size) {
            st = df_fail(err, DF_ERR_IO, "%s: %lld bytes, the hub's file has %lld: run `deltafin setup` again",
                         s->path, (long long)sb.st_size, (long long)s->size);
            hub_mirror_close(m);
            return st;
        }
        s->dev = sb.st_dev;
        s->ino = sb.st_ino;
        s->mtime = PORT_ST_MTIM(sb);
    }
    *out = m;
    return DF_OK;
}

/* ---- 3. fetching --------------------------------------------------------------------- */

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
        if (hub_write_at(s->wfd, buf, (size_t)(b - a), a) != 0 || futimens(s->wfd, ts) != 0 || fdatasync(s->wfd) != 0)
            st = df_fail(err, DF_ERR_IO, "%s: cannot write fetched bytes %lld-%lld: %s", s->path, (long long)a,
                         (long long)b, strerror(errno));
    }
    free(buf);
    return st;
}

double hub_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void busy_begin(hub_mirror *m) {
    if (m->active++ == 0) m->busy_since = hub_now();
}
static void busy_end(hub_mirror *m) {
    if (--m->active == 0) m->busy_s += hub_now() - m->busy_since;
}

/* Records the rate this process measured (bytes over the time a fetch was in
 * flight) in the manifest, for the next start-up estimate. */
void hub_mirror_save_rate(hub_mirror *m) {
    if (m->fetched <= 0 || m->busy_s <= 0) return;
    hub_manifest man;
    if (hub_manifest_load(m->dir, &man, NULL) != DF_OK) return;
    man.rate = (double)m->fetched / m->busy_s;
    man.rate_at = (int64_t)time(NULL);
    hub_manifest_save(m->dir, &man, NULL);
    hub_manifest_free(&man);
}

/* Makes bytes [a, b) of shard s local (see the protocol at the top) and
 * marks the experts there used. keep_pin: on success [a, b) stays pinned
 * (never evicted) until the caller's hub_cache_unpin under m->mu. On error nothing
 * that failed is marked present and nothing stays pinned. */
df_status hub_mirror_ensure_pin(hub_mirror *m, mshard *s, int64_t a, int64_t b, int keep_pin, char *err) {
    if (a < 0) a = 0;
    if (b > s->size) b = s->size;
    if (b <= a) return DF_OK;
    int si = (int)(s - m->sh);
    hub_spans miss = {0};
    pthread_mutex_lock(&m->mu);
    for (;;) {
        if (hub_spans_covers(&s->present, a, b)) {
            hub_cache_touch(m, s, a, b);
            int pe = keep_pin && hub_cache_pin(m, si, a, b) != 0;
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
    if (hub_cache_pin(m, si, a, b) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (; st == DF_OK && claimed < miss.n; claimed++)
        if (hub_spans_add(&s->inflight, miss.v[claimed].a, miss.v[claimed].b) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    int64_t need = st == DF_OK && m->limit > 0 ? hub_cache_need(s, &miss) : 0;
    if (st == DF_OK) {
        hub_cache_make_room(m, need);
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
    hub_cache_touch(m, s, a, b);
    if (st != DF_OK || !keep_pin) hub_cache_unpin(m, si, a, b);
    if (st != DF_OK && err) snprintf(m->last_err, sizeof m->last_err, "%s", err);
    int save = m->limit > 0 && hub_now() - m->saved_at > 2.0;
    if (save) {
        m->saved_at = hub_now();
        hub_cache_save(m);
    }
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    free(ok);
    hub_spans_free(&miss);
    return st;
}

df_status hub_mirror_ensure(hub_mirror *m, mshard *s, int64_t a, int64_t b, char *err) {
    return hub_mirror_ensure_pin(m, s, a, b, 0, err);
}

/* ---- 4. expert units ----------------------------------------------------------------- */

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
    port_qsort_r(s->ut, (size_t)ne, sizeof *s->ut, by_unit, s->t);
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
df_status hub_shard_header(hub_mirror *m, mshard *s, int fetch, char *err) {
    if (s->t) return DF_OK;
    if (s->size < 8) return df_fail(err, DF_ERR_FORMAT, "%s: %lld bytes, too short for safetensors", s->path, (long long)s->size);
    df_status st = fetch ? hub_mirror_ensure(m, s, 0, 8, err) : DF_OK;
    if (st != DF_OK) return st;
    if (!hub_spans_covers(&s->present, 0, 8)) return df_fail(err, DF_ERR_IO, "%s: header not local", s->path);
    uint8_t lb[8];
    if (pread(s->wfd, lb, 8, 0) != 8) return df_fail(err, DF_ERR_IO, "%s: cannot read: %s", s->path, strerror(errno));
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | lb[i];
    if (n > (uint64_t)ST_MAX_HEADER || 8 + (int64_t)n > s->size)
        return df_fail(err, DF_ERR_FORMAT, "%s: header length %llu is impossible", s->path, (unsigned long long)n);
    if (fetch && (st = hub_mirror_ensure(m, s, 8, 8 + (int64_t)n, err)) != DF_OK) return st;
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
void hub_expert_bytes(const mshard *s, int64_t *local, int64_t *total) {
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
