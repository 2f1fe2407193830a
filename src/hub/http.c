/* http.c — the hub client on libcurl (see hub.h).
 *
 * Owns: every HTTP exchange with a Hugging Face-compatible hub: the listing
 * of a repository at a revision, whole-file downloads into DIR/NAME.part
 * (resumed with Range, verified, renamed), single byte ranges into memory.
 * Redirects are followed (the hub sends LFS files to a file host with a 302;
 * libcurl keeps the Range header and drops Authorization on the new host).
 * Refuses: to retry what cannot get better (4xx other than 408/429, a file
 * whose bytes disagree with the commit's sha256 after a full re-download is
 * still retried within the bound, a changed ETag is not); to print.
 *
 * Retries: connection failures, resets, timeouts, truncated bodies, 5xx,
 * 408 and 429 are retried up to client.retries times, sleeping retry_ms,
 * 2 x retry_ms, ... (capped at 30 s). A download resumes from the bytes it
 * has; a range read asks only for the bytes it still lacks.
 *
 * Sections: 1. transfers (curl setup, headers, errors)  2. listing
 *           3. whole-file download  4. range reads
 */
#include "hub.h"
#include "../base/err.h"
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- 1. transfers ----------------------------------------------------------- */

struct hub_conn { CURL *h; };

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init_once(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

hub_conn *hub_conn_new(void) {
    pthread_once(&curl_once, curl_init_once);
    hub_conn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->h = curl_easy_init();
    if (!c->h) { free(c); return NULL; }
    return c;
}

void hub_conn_free(hub_conn *c) {
    if (!c) return;
    curl_easy_cleanup(c->h);
    free(c);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void backoff(const hub_client *c, int attempt) {
    double ms = c->retry_ms > 0 ? c->retry_ms : 500;
    for (int i = 0; i < attempt && ms < 30000; i++) ms *= 2;
    if (ms > 30000) ms = 30000;
    struct timespec ts = {(time_t)(ms / 1000), (long)((ms - (double)(time_t)(ms / 1000) * 1000) * 1e6)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* What one transfer saw, across its redirects. */
typedef struct {
    char err_code[64];    /* X-Error-Code of the last response */
    char err_msg[256];    /* X-Error-Message */
    char etag[128];       /* ETag of the last response, unquoted */
    char linked_etag[128];/* X-Linked-Etag of any response (the hub's redirect) */
    char body[512];       /* start of an error response's body */
    size_t nbody;
} xfer_info;

static void header_value(char *dst, size_t cap, const char *v, size_t n) {
    while (n && (*v == ' ' || *v == '\t')) { v++; n--; }
    while (n && (v[n - 1] == '\r' || v[n - 1] == '\n' || v[n - 1] == ' ')) n--;
    if (n >= 2 && v[0] == 'W' && v[1] == '/') { v += 2; n -= 2; }
    if (n >= 2 && v[0] == '"' && v[n - 1] == '"') { v++; n -= 2; }
    if (n >= cap) n = cap - 1;
    memcpy(dst, v, n);
    dst[n] = 0;
}

static size_t on_header(char *p, size_t sz, size_t nm, void *ud) {
    xfer_info *x = ud;
    size_t n = sz * nm;
    if (n >= 5 && !strncmp(p, "HTTP/", 5)) { /* a new response (after a redirect) */
        x->err_code[0] = x->err_msg[0] = x->etag[0] = 0;
        x->nbody = 0;
        return n;
    }
    const char *colon = memchr(p, ':', n);
    if (!colon) return n;
    size_t k = (size_t)(colon - p), vn = n - k - 1;
    if (k == 12 && !strncasecmp(p, "x-error-code", 12)) header_value(x->err_code, sizeof x->err_code, colon + 1, vn);
    else if (k == 15 && !strncasecmp(p, "x-error-message", 15)) header_value(x->err_msg, sizeof x->err_msg, colon + 1, vn);
    else if (k == 4 && !strncasecmp(p, "etag", 4)) header_value(x->etag, sizeof x->etag, colon + 1, vn);
    else if (k == 13 && !strncasecmp(p, "x-linked-etag", 13)) header_value(x->linked_etag, sizeof x->linked_etag, colon + 1, vn);
    return n;
}

static void keep_body(xfer_info *x, const char *p, size_t n) {
    size_t room = sizeof x->body - 1 - x->nbody;
    if (n > room) n = room;
    memcpy(x->body + x->nbody, p, n);
    x->nbody += n;
    x->body[x->nbody] = 0;
}

/* Percent-encodes s keeping unreserved characters (and '/' if keep_slash). */
static void url_append(char **p, size_t *n, size_t *cap, const char *s, int keep_slash) {
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        int plain = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
                    ch == '-' || ch == '_' || ch == '.' || ch == '~' || (keep_slash && ch == '/');
        if (*n + 4 >= *cap) {
            size_t nc = *cap * 2 + 64;
            char *q = realloc(*p, nc);
            if (!q) { free(*p); *p = NULL; return; }
            *p = q;
            *cap = nc;
        }
        if (plain) (*p)[(*n)++] = (char)ch;
        else *n += (size_t)snprintf(*p + *n, 4, "%%%02X", ch);
        (*p)[*n] = 0;
    }
}

static char *make_url(const hub_client *c, const char *a, const char *repo, const char *b,
                      const char *rev, const char *c2, const char *path) {
    size_t n = 0, cap = 256;
    char *p = malloc(cap);
    if (!p) return NULL;
    p[0] = 0;
    const char *ep = c->endpoint && *c->endpoint ? c->endpoint : "https://huggingface.co";
    size_t el = strlen(ep);
    while (el && ep[el - 1] == '/') el--;
    const char *parts[6] = {a, repo, b, rev, c2, path};
    int kind[6] = {2, 1, 2, 0, 2, 1}; /* 2 verbatim, 1 keep '/', 0 encode all */
    if (el + 1 >= cap) { cap = el + 256; char *q = realloc(p, cap); if (!q) { free(p); return NULL; } p = q; }
    memcpy(p, ep, el);
    n = el;
    p[n] = 0;
    for (int i = 0; i < 6 && p; i++) {
        if (!parts[i]) continue;
        if (kind[i] == 2) {
            size_t l = strlen(parts[i]);
            if (n + l + 1 >= cap) {
                cap = n + l + 256;
                char *q = realloc(p, cap);
                if (!q) { free(p); return NULL; }
                p = q;
            }
            memcpy(p + n, parts[i], l + 1);
            n += l;
        } else {
            url_append(&p, &n, &cap, parts[i], kind[i]);
        }
    }
    return p;
}

char *hub_resolve_url(const hub_client *c, const char *repo, const char *rev, const char *path) {
    return make_url(c, "/", repo, "/resolve/", rev, "/", path);
}

/* Options every request shares. */
static struct curl_slist *setup(CURL *h, const hub_client *c, const char *url, xfer_info *x) {
    curl_easy_reset(h); /* keeps the connection cache */
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(h, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, 30L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, (long)(c->timeout_s > 0 ? c->timeout_s : 60));
    curl_easy_setopt(h, CURLOPT_USERAGENT, "deltafin/0.1 (hf_hub-compatible)");
    curl_easy_setopt(h, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_2TLS);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, x);
    struct curl_slist *hd = NULL;
    if (c->token && *c->token) {
        char auth[1100];
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", c->token);
        hd = curl_slist_append(hd, auth);
    }
    if (hd) curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
    return hd;
}

static int retryable_curl(CURLcode rc) {
    switch (rc) {
    case CURLE_COULDNT_CONNECT: case CURLE_OPERATION_TIMEDOUT: case CURLE_PARTIAL_FILE:
    case CURLE_RECV_ERROR: case CURLE_SEND_ERROR: case CURLE_GOT_NOTHING: case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM: case CURLE_SSL_CONNECT_ERROR: case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_WRITE_ERROR:
        return 1;
    default:
        return 0;
    }
}
static int retryable_http(long code) { return code >= 500 || code == 408 || code == 429; }

/* One line for a hub error response; `what` names repo and file. */
static df_status http_error(char *err, long code, const xfer_info *x, const char *what,
                            const char *repo) {
    const char *ec = x->err_code, *em = x->err_msg[0] ? x->err_msg : x->body;
    if (!strcmp(ec, "GatedRepo") || (code == 403 && strstr(em, "gated")))
        return df_fail(err, DF_ERR_IO,
                       "%s: repository %s is gated: accept its conditions on the hub page and use a "
                       "token with access (HF_TOKEN)%s%s",
                       what, repo, *em ? ": " : "", em);
    if (!strcmp(ec, "RepoNotFound"))
        return df_fail(err, DF_ERR_IO,
                       "%s: repository %s not found (HTTP %ld); a private repository needs a token "
                       "(HF_TOKEN)",
                       what, repo, code);
    if (!strcmp(ec, "RevisionNotFound"))
        return df_fail(err, DF_ERR_IO, "%s: revision not found in repository %s (HTTP %ld)", what, repo, code);
    if (!strcmp(ec, "EntryNotFound") || code == 404)
        return df_fail(err, DF_ERR_IO, "%s: not found in repository %s (HTTP %ld)%s%s", what, repo, code,
                       *em ? ": " : "", em);
    if (code == 401)
        return df_fail(err, DF_ERR_IO,
                       "%s: HTTP 401 Unauthorized for repository %s: set HF_TOKEN to a token with "
                       "access%s%s",
                       what, repo, *em ? ": " : "", em);
    if (code == 403)
        return df_fail(err, DF_ERR_IO, "%s: HTTP 403 Forbidden for repository %s%s%s", what, repo,
                       *em ? ": " : "", em);
    return df_fail(err, DF_ERR_IO, "%s: HTTP %ld from the hub%s%s", what, code, *em ? ": " : "", em);
}

/* ---- 2. listing --------------------------------------------------------------- */

typedef struct { char *p; size_t n, cap, max; xfer_info *x; CURL *h; } membuf;

static size_t on_mem(char *p, size_t sz, size_t nm, void *ud) {
    membuf *m = ud;
    size_t n = sz * nm;
    if (m->n + n + 1 > m->max) return 0;
    if (m->n + n + 1 > m->cap) {
        size_t cap = (m->n + n + 1) * 2;
        char *q = realloc(m->p, cap);
        if (!q) return 0;
        m->p = q;
        m->cap = cap;
    }
    memcpy(m->p + m->n, p, n);
    m->n += n;
    m->p[m->n] = 0;
    return n;
}

void hub_listing_free(hub_listing *l) {
    if (!l) return;
    for (int i = 0; i < l->n_files; i++) free(l->files[i].path);
    free(l->files);
    free(l->commit);
    memset(l, 0, sizeof *l);
}

static df_status parse_listing(const char *body, size_t n, const char *what, hub_listing *out, char *err) {
    json_error_t je;
    json_t *root = json_loadb(body, n, 0, &je);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return df_fail(err, DF_ERR_FORMAT, "%s: the hub's answer is not a JSON object", what);
    }
    json_t *sha = json_object_get(root, "sha"), *sib = json_object_get(root, "siblings");
    if (!json_is_string(sha) || !json_is_array(sib)) {
        json_decref(root);
        return df_fail(err, DF_ERR_FORMAT, "%s: the hub's answer lacks 'sha' or 'siblings'", what);
    }
    out->commit = strdup(json_string_value(sha));
    size_t nf = json_array_size(sib);
    out->files = calloc(nf ? nf : 1, sizeof *out->files);
    if (!out->commit || !out->files) { json_decref(root); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    for (size_t i = 0; i < nf; i++) {
        json_t *f = json_array_get(sib, i);
        json_t *name = json_object_get(f, "rfilename"), *size = json_object_get(f, "size");
        json_t *lfs = json_object_get(f, "lfs");
        if (!json_is_string(name)) continue;
        const char *nm = json_string_value(name);
        if (strstr(nm, "..") || nm[0] == '/') {
            json_decref(root);
            return df_fail(err, DF_ERR_FORMAT, "%s: refusing file name '%s'", what, nm);
        }
        hub_file *hf = &out->files[out->n_files];
        hf->path = strdup(nm);
        if (!hf->path) { json_decref(root); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
        hf->size = json_is_integer(size) ? (int64_t)json_integer_value(size) : -1;
        if (json_is_object(lfs)) {
            json_t *s = json_object_get(lfs, "sha256");
            if (!json_is_string(s)) s = json_object_get(lfs, "oid");
            json_t *ls = json_object_get(lfs, "size");
            if (json_is_string(s) && strlen(json_string_value(s)) == 64) snprintf(hf->sha256, sizeof hf->sha256, "%s", json_string_value(s));
            if (json_is_integer(ls)) hf->size = (int64_t)json_integer_value(ls);
        } else {
            json_t *b = json_object_get(f, "blobId");
            if (json_is_string(b) && strlen(json_string_value(b)) == 40) snprintf(hf->git, sizeof hf->git, "%s", json_string_value(b));
        }
        out->n_files++;
        if (hf->size < 0) {
            json_decref(root);
            return df_fail(err, DF_ERR_FORMAT, "%s: the hub gives no size for %s (need ?blobs=true)", what, nm);
        }
    }
    json_decref(root);
    return DF_OK;
}

df_status hub_list(const hub_client *c, const char *repo, const char *rev, hub_listing *out, char *err) {
    memset(out, 0, sizeof *out);
    char *url = make_url(c, "/api/models/", repo, "/revision/", rev ? rev : "main", "?blobs=true", NULL);
    hub_conn *hc = hub_conn_new();
    if (!url || !hc) { free(url); hub_conn_free(hc); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    char what[600];
    snprintf(what, sizeof what, "listing %s at %s", repo, rev ? rev : "main");
    df_status st = DF_ERR_IO;
    for (int attempt = 0;; attempt++) {
        xfer_info x = {0};
        membuf m = {NULL, 0, 0, (size_t)64 << 20, &x, hc->h};
        struct curl_slist *hd = setup(hc->h, c, url, &x);
        curl_easy_setopt(hc->h, CURLOPT_WRITEFUNCTION, on_mem);
        curl_easy_setopt(hc->h, CURLOPT_WRITEDATA, &m);
        CURLcode rc = curl_easy_perform(hc->h);
        long code = 0;
        curl_easy_getinfo(hc->h, CURLINFO_RESPONSE_CODE, &code);
        curl_slist_free_all(hd);
        if (rc == CURLE_OK && code == 200) {
            st = parse_listing(m.p ? m.p : "", m.n, what, out, err);
            free(m.p);
            if (st != DF_OK) hub_listing_free(out);
            break;
        }
        if (m.p) keep_body(&x, m.p, m.n);
        free(m.p);
        int again = rc != CURLE_OK ? retryable_curl(rc) : retryable_http(code);
        if (!again || attempt >= c->retries) {
            if (rc != CURLE_OK)
                st = df_fail(err, DF_ERR_IO, "%s: %s (%s)", what, curl_easy_strerror(rc), url);
            else
                st = http_error(err, code, &x, what, repo);
            break;
        }
        backoff(c, attempt);
    }
    free(url);
    hub_conn_free(hc);
    return st;
}

/* ---- 3. whole-file download ----------------------------------------------------- */

typedef struct {
    CURL *h;
    int fd;
    int64_t have, size;   /* bytes in the part file, expected total */
    int64_t start;        /* `have` when this request began */
    hub_sha256 sha;
    hub_sha1 git;         /* plain files: their git blob id */
    int restarted;        /* the server ignored Range: the part was reset */
    int io_error;
    xfer_info *x;
    const hub_client *c;
    const char *name;
    double t0, last;
    int attempt;
    int64_t received;     /* bytes received, all attempts */
} dl_state;

static void report(dl_state *d, int finished) {
    if (!d->c->progress) return;
    double t = now_s();
    if (!finished && t - d->last < 0.5) return;
    d->last = t;
    hub_progress p = {d->have, d->size, d->received / (t - d->t0 + 1e-9), d->name, finished, d->attempt};
    d->c->progress(d->c->progress_ctx, &p);
}

static size_t on_file(char *p, size_t sz, size_t nm, void *ud) {
    dl_state *d = ud;
    size_t n = sz * nm;
    long code = 0;
    curl_easy_getinfo(d->h, CURLINFO_RESPONSE_CODE, &code);
    if (code != 200 && code != 206) { keep_body(d->x, p, n); return n; }
    if (code == 200 && d->start > 0 && !d->restarted) { /* Range ignored: start over */
        d->restarted = 1;
        d->have = 0;
        hub_sha256_init(&d->sha);
        hub_git_blob_init(&d->git, d->size);
        if (ftruncate(d->fd, 0) != 0) { d->io_error = errno; return 0; }
    }
    if (d->have + (int64_t)n > d->size) return 0; /* longer than the listing says */
    const char *q = p;
    size_t left = n;
    while (left) {
        ssize_t w = pwrite(d->fd, q, left, d->have);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) { d->io_error = w < 0 ? errno : EIO; return 0; }
        hub_sha256_update(&d->sha, q, (size_t)w);
        hub_sha1_update(&d->git, q, (size_t)w);
        d->have += w;
        q += w;
        left -= (size_t)w;
    }
    d->received += (int64_t)n;
    report(d, 0);
    return n;
}

/* Hashes the first `have` bytes already in the part file into d->sha. */
static int hash_existing(dl_state *d) {
    enum { CH = 1 << 20 };
    uint8_t *buf = malloc(CH);
    if (!buf) return -1;
    for (int64_t off = 0; off < d->have;) {
        size_t want = d->have - off < CH ? (size_t)(d->have - off) : CH;
        ssize_t r = pread(d->fd, buf, want, off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { free(buf); return -1; }
        hub_sha256_update(&d->sha, buf, (size_t)r);
        hub_sha1_update(&d->git, buf, (size_t)r);
        off += r;
    }
    free(buf);
    return 0;
}

static int fsync_parent(const char *path) {
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

df_status hub_download(const hub_client *c, const char *repo, const char *rev, const hub_file *f,
                       const char *dest, int64_t *fetched, char *err) {
    char what[900];
    snprintf(what, sizeof what, "%s/%s", repo, f->path);
    size_t dl = strlen(dest);
    char *part = malloc(dl + 6);
    char *url = hub_resolve_url(c, repo, rev, f->path);
    hub_conn *hc = hub_conn_new();
    if (!part || !url || !hc) {
        free(part); free(url); hub_conn_free(hc);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    memcpy(part, dest, dl);
    memcpy(part + dl, ".part", 6);
    df_status st = DF_OK;
    xfer_info x = {0};
    dl_state d = {0};
    d.h = hc->h;
    d.size = f->size;
    d.x = &x;
    d.c = c;
    d.name = f->path;
    d.t0 = d.last = now_s();
    d.fd = open(part, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (d.fd < 0) { st = df_fail(err, DF_ERR_IO, "%s: cannot create: %s", part, strerror(errno)); goto out; }
    struct stat sb;
    if (fstat(d.fd, &sb) != 0) { st = df_fail(err, DF_ERR_IO, "%s: %s", part, strerror(errno)); goto out; }
    d.have = sb.st_size;
    if (d.have > d.size) {
        if (ftruncate(d.fd, 0) != 0) { st = df_fail(err, DF_ERR_IO, "%s: %s", part, strerror(errno)); goto out; }
        d.have = 0;
    }
    hub_sha256_init(&d.sha);
    hub_git_blob_init(&d.git, d.size);
    if (d.have > 0 && hash_existing(&d) != 0) {
        st = df_fail(err, DF_ERR_IO, "%s: cannot read back: %s", part, strerror(errno));
        goto out;
    }
    for (int attempt = 0;; attempt++) {
        d.attempt = attempt + 1;
        long code = 206;
        CURLcode rc = CURLE_OK;
        if (d.have < d.size) {
            memset(&x, 0, sizeof x);
            struct curl_slist *hd = setup(hc->h, c, url, &x);
            curl_easy_setopt(hc->h, CURLOPT_WRITEFUNCTION, on_file);
            curl_easy_setopt(hc->h, CURLOPT_WRITEDATA, &d);
            char range[64];
            if (d.have > 0) {
                snprintf(range, sizeof range, "%lld-", (long long)d.have);
                curl_easy_setopt(hc->h, CURLOPT_RANGE, range);
            }
            d.start = d.have;
            d.restarted = 0;
            rc = curl_easy_perform(hc->h);
            curl_easy_getinfo(hc->h, CURLINFO_RESPONSE_CODE, &code);
            curl_slist_free_all(hd);
            if (d.io_error) { st = df_fail(err, DF_ERR_IO, "%s: cannot write: %s", part, strerror(d.io_error)); goto out; }
        }
        int again;
        if (rc == CURLE_OK && (code == 200 || code == 206 || code == 416) && d.have == d.size) {
            char hex[65];
            const char *want = f->sha256[0] ? f->sha256 : f->git;
            if (!want[0]) break; /* size checked */
            if (f->sha256[0]) hub_sha256_hex(&d.sha, hex);
            else hub_sha1_hex(&d.git, hex);
            if (!strcmp(hex, want)) break;
            /* corrupt: throw everything away and fetch again */
            if (ftruncate(d.fd, 0) != 0) { st = df_fail(err, DF_ERR_IO, "%s: %s", part, strerror(errno)); goto out; }
            d.have = 0;
            hub_sha256_init(&d.sha);
            hub_git_blob_init(&d.git, d.size);
            again = 1;
            snprintf(x.body, sizeof x.body, "%s %s differs from the commit's %s", f->sha256[0] ? "sha256" : "git blob id",
                     hex, want);
            code = 0;
            rc = CURLE_OK;
        } else if (rc == CURLE_OK && code == 416) { /* part file disagrees with the server */
            if (ftruncate(d.fd, 0) != 0) { st = df_fail(err, DF_ERR_IO, "%s: %s", part, strerror(errno)); goto out; }
            d.have = 0;
            hub_sha256_init(&d.sha);
            hub_git_blob_init(&d.git, d.size);
            again = 1;
        } else if (rc == CURLE_OK && (code == 200 || code == 206)) {
            again = 1; /* a short body without a transport error */
            snprintf(x.body, sizeof x.body, "body ended at %lld of %lld bytes", (long long)d.have, (long long)d.size);
            code = 0;
        } else {
            again = rc != CURLE_OK ? retryable_curl(rc) : retryable_http(code);
        }
        if (!again || attempt >= c->retries) {
            if (rc != CURLE_OK)
                st = df_fail(err, DF_ERR_IO, "%s: %s after %d attempts (%lld of %lld bytes kept in %s)", what,
                             curl_easy_strerror(rc), attempt + 1, (long long)d.have, (long long)d.size, part);
            else if (code == 0)
                st = df_fail(err, DF_ERR_IO, "%s: %s after %d attempts", what, x.body, attempt + 1);
            else
                st = http_error(err, code, &x, what, repo);
            goto out;
        }
        backoff(c, attempt);
    }
    if (fsync(d.fd) != 0) { st = df_fail(err, DF_ERR_IO, "%s: fsync: %s", part, strerror(errno)); goto out; }
    close(d.fd);
    d.fd = -1;
    if (rename(part, dest) != 0 || fsync_parent(dest) != 0) {
        st = df_fail(err, DF_ERR_IO, "%s: cannot rename into place: %s", dest, strerror(errno));
        goto out;
    }
    report(&d, 1);
out:
    if (d.fd >= 0) close(d.fd);
    if (fetched) *fetched += d.received;
    free(part);
    free(url);
    hub_conn_free(hc);
    return st;
}

/* ---- 4. range reads --------------------------------------------------------------- */

typedef struct {
    CURL *h;
    uint8_t *buf;
    int64_t want;         /* bytes of the whole range */
    int64_t got;          /* bytes in buf */
    int64_t skip;         /* a 200 answer: bytes to drop before buf[got] */
    int64_t req_off;      /* file offset this request started at */
    xfer_info *x;
} rg_state;

static size_t on_range(char *p, size_t sz, size_t nm, void *ud) {
    rg_state *r = ud;
    size_t n = sz * nm;
    long code = 0;
    curl_easy_getinfo(r->h, CURLINFO_RESPONSE_CODE, &code);
    if (code != 206 && code != 200) { keep_body(r->x, p, n); return n; }
    const char *q = p;
    size_t left = n;
    if (code == 200 && r->skip > 0) { /* the server sent the whole file */
        size_t k = (int64_t)left < r->skip ? left : (size_t)r->skip;
        r->skip -= (int64_t)k;
        q += k;
        left -= k;
    }
    if (r->got + (int64_t)left > r->want) {
        if (code == 200) left = (size_t)(r->want - r->got); /* enough: stop after this */
        else return 0;
    }
    memcpy(r->buf + r->got, q, left);
    r->got += (int64_t)left;
    if (code == 200 && r->got == r->want) return 0; /* abort the rest of the file */
    return n;
}

df_status hub_get_range(hub_conn *hc, const hub_client *c, const char *url, const char *what,
                        int64_t off, int64_t len, void *buf, const char *etag, char *err) {
    rg_state r = {hc->h, buf, len, 0, 0, 0, NULL};
    for (int attempt = 0;; attempt++) {
        xfer_info x = {0};
        r.x = &x;
        struct curl_slist *hd = setup(hc->h, c, url, &x);
        curl_easy_setopt(hc->h, CURLOPT_WRITEFUNCTION, on_range);
        curl_easy_setopt(hc->h, CURLOPT_WRITEDATA, &r);
        char range[64];
        snprintf(range, sizeof range, "%lld-%lld", (long long)(off + r.got), (long long)(off + len - 1));
        curl_easy_setopt(hc->h, CURLOPT_RANGE, range);
        r.req_off = off + r.got;
        r.skip = off + r.got;
        CURLcode rc = curl_easy_perform(hc->h);
        long code = 0;
        curl_easy_getinfo(hc->h, CURLINFO_RESPONSE_CODE, &code);
        curl_slist_free_all(hd);
        if (code == 200 && rc == CURLE_WRITE_ERROR && r.got == r.want) rc = CURLE_OK;
        if ((code == 200 || code == 206) && etag) {
            const char *seen = x.linked_etag[0] ? x.linked_etag : x.etag;
            if (strlen(seen) == 64 && strcmp(seen, etag) != 0)
                return df_fail(err, DF_ERR_IO, "%s: the hub now serves different bytes (sha256 %s, expected %s): "
                               "the mirror's revision is gone; run setup again", what, seen, etag);
        }
        if (rc == CURLE_OK && (code == 200 || code == 206) && r.got == r.want) return DF_OK;
        int again;
        if (rc == CURLE_OK && (code == 200 || code == 206)) {
            again = 1;
            snprintf(x.body, sizeof x.body, "body ended at %lld of %lld bytes", (long long)r.got, (long long)r.want);
            code = 0;
        } else {
            again = rc != CURLE_OK ? retryable_curl(rc) : retryable_http(code);
        }
        if (!again || attempt >= c->retries) {
            if (rc != CURLE_OK)
                return df_fail(err, DF_ERR_IO, "%s: bytes %lld-%lld: %s after %d attempts", what, (long long)off,
                               (long long)(off + len - 1), curl_easy_strerror(rc), attempt + 1);
            if (code == 0)
                return df_fail(err, DF_ERR_IO, "%s: bytes %lld-%lld: %s after %d attempts", what, (long long)off,
                               (long long)(off + len - 1), x.body, attempt + 1);
            char repo[300]; /* what is "owner/name/file": the repository is its first two parts */
            snprintf(repo, sizeof repo, "%s", what);
            char *sl = strchr(repo, '/');
            if (sl && (sl = strchr(sl + 1, '/'))) *sl = 0;
            return http_error(err, code, &x, what, repo);
        }
        backoff(c, attempt);
    }
}
