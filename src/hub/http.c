/* http.c — the hub client on libcurl (see hub.h).
 *
 * Owns: every HTTP exchange with a Hugging Face-compatible hub: the listing
 * of a repository at a revision (model info with ?blobs=true; when that
 * gives no sizes, the tree API, its pages followed through the Link
 * header), whole-file downloads into DIR/NAME.part
 * (resumed with Range, verified, renamed), single byte ranges into memory.
 * Redirects are followed (the hub sends LFS files to a file host with a 302;
 * libcurl keeps the Range header and drops Authorization on the new host).
 * Refuses: a next-page link to another host (the token would go with it);
 * more than HUB_MAX_PAGES tree pages; to retry what cannot get better
 * (4xx other than 408/429, a file
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

#define HUB_MAX_PAGES 1000 /* tree pages followed for one listing */
#define HUB_MAX_LINK 2048  /* bytes of a next-page URL */

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
    char next[HUB_MAX_LINK]; /* Link: <URL>; rel="next" of the last response, "" */
    int next_long;        /* that URL did not fit in next, or was not a URL */
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
        x->err_code[0] = x->err_msg[0] = x->etag[0] = x->next[0] = 0;
        x->nbody = 0;
        x->next_long = 0;
        return n;
    }
    const char *colon = memchr(p, ':', n);
    if (!colon) return n;
    size_t k = (size_t)(colon - p), vn = n - k - 1;
    if (k == 12 && !strncasecmp(p, "x-error-code", 12)) header_value(x->err_code, sizeof x->err_code, colon + 1, vn);
    else if (k == 15 && !strncasecmp(p, "x-error-message", 15)) header_value(x->err_msg, sizeof x->err_msg, colon + 1, vn);
    else if (k == 4 && !strncasecmp(p, "etag", 4)) header_value(x->etag, sizeof x->etag, colon + 1, vn);
    else if (k == 13 && !strncasecmp(p, "x-linked-etag", 13)) header_value(x->linked_etag, sizeof x->linked_etag, colon + 1, vn);
    else if (k == 4 && !strncasecmp(p, "link", 4) && !x->next[0] && !x->next_long) {
        int r = hub_link_next(colon + 1, vn, x->next, sizeof x->next);
        if (r < 0) x->next_long = 1;
    }
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

typedef struct { char *p; size_t n, cap, max; } membuf;

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

static int lws(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

/* 1 if one of the space-separated relation types of a link's parameters
 * (p[0..n), "; rel=\"next last\"; type=...") is "next". */
static int rel_is_next(const char *p, size_t n) {
    for (size_t i = 0; i < n;) {
        while (i < n && (p[i] == ';' || lws(p[i]))) i++;
        size_t k = i;
        while (k < n && p[k] != '=' && p[k] != ';') k++;
        size_t kn = k;
        while (kn > i && lws(p[kn - 1])) kn--;
        int rel = kn - i == 3 && !strncasecmp(p + i, "rel", 3);
        if (k >= n || p[k] == ';') { i = k; continue; } /* a parameter without a value */
        k++;
        while (k < n && lws(p[k])) k++;
        size_t a = k, b;
        if (k < n && p[k] == '"') {
            a = ++k;
            while (k < n && p[k] != '"') k++;
            b = k;
            if (k < n) k++;
        } else {
            while (k < n && p[k] != ';') k++;
            b = k;
        }
        if (rel)
            for (size_t t = a; t < b;) {
                while (t < b && lws(p[t])) t++;
                size_t e = t;
                while (e < b && !lws(p[e])) e++;
                if (e - t == 4 && !strncasecmp(p + t, "next", 4)) return 1;
                t = e;
            }
        while (k < n && p[k] != ';') k++;
        i = k;
    }
    return 0;
}

int hub_link_next(const char *v, size_t n, char *out, size_t cap) {
    for (size_t i = 0; i < n;) {
        const char *lt = memchr(v + i, '<', n - i);
        if (!lt) return 0;
        size_t a = (size_t)(lt - v) + 1;
        const char *gt = memchr(v + a, '>', n - a);
        if (!gt) return 0;
        size_t b = (size_t)(gt - v), e = b + 1;
        int quoted = 0; /* the link's parameters end at a comma outside quotes */
        while (e < n && (quoted || v[e] != ',')) {
            if (v[e] == '"') quoted = !quoted;
            e++;
        }
        if (b > a && rel_is_next(v + b + 1, e - b - 1)) {
            if (b - a >= cap) return -1;
            for (size_t k = a; k < b; k++)
                if ((unsigned char)v[k] <= ' ' || v[k] == 0x7f) return -1; /* not a URL (a NUL would cut it short) */
            memcpy(out, v + a, b - a);
            out[b - a] = 0;
            return 1;
        }
        i = e + 1;
    }
    return 0;
}

/* The size and checks of f from a siblings or tree entry: an LFS object's
 * sha256 and size, or a plain file's git blob id and size. Keeps what the
 * entry does not say. */
static void take_entry(hub_file *f, json_t *size, json_t *lfs, json_t *blob) {
    if (json_is_integer(size) && json_integer_value(size) >= 0) f->size = (int64_t)json_integer_value(size);
    if (json_is_object(lfs)) {
        json_t *s = json_object_get(lfs, "sha256");
        if (!json_is_string(s)) s = json_object_get(lfs, "oid");
        json_t *ls = json_object_get(lfs, "size");
        if (json_is_string(s) && json_string_length(s) == 64) snprintf(f->sha256, sizeof f->sha256, "%s", json_string_value(s));
        if (json_is_integer(ls) && json_integer_value(ls) >= 0) f->size = (int64_t)json_integer_value(ls);
    } else if (json_is_string(blob) && json_string_length(blob) == 40) {
        snprintf(f->git, sizeof f->git, "%s", json_string_value(blob));
    }
}

static int by_path(const void *a, const void *b) {
    return strcmp((*(hub_file *const *)a)->path, (*(hub_file *const *)b)->path);
}

/* The listing's files sorted by path, malloc'd; NULL if out of memory. */
static hub_file **sorted_files(hub_listing *l) {
    hub_file **v = malloc((size_t)(l->n_files ? l->n_files : 1) * sizeof *v);
    if (!v) return NULL;
    for (int i = 0; i < l->n_files; i++) v[i] = &l->files[i];
    qsort(v, (size_t)l->n_files, sizeof *v, by_path);
    return v;
}

df_status hub_parse_info(const char *body, size_t n, const char *what, hub_listing *out, char *err) {
    memset(out, 0, sizeof *out);
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
    df_status st = DF_OK;
    out->commit = strdup(json_string_value(sha));
    size_t nf = json_array_size(sib);
    out->files = calloc(nf ? nf : 1, sizeof *out->files);
    if (!out->commit || !out->files) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    for (size_t i = 0; i < nf; i++) {
        json_t *f = json_array_get(sib, i);
        json_t *name = json_object_get(f, "rfilename");
        if (!json_is_string(name)) continue;
        const char *nm = json_string_value(name);
        /* the message is made while root (which owns nm) is alive */
        if (strstr(nm, "..") || nm[0] == '/' || !nm[0]) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: refusing file name '%s'", what, nm);
            goto done;
        }
        hub_file *hf = &out->files[out->n_files];
        hf->path = strdup(nm);
        if (!hf->path) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
        hf->size = -1;
        take_entry(hf, json_object_get(f, "size"), json_object_get(f, "lfs"), json_object_get(f, "blobId"));
        out->n_files++;
    }
    hub_file **v = sorted_files(out); /* one name twice would be two writers of one file */
    if (!v) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    for (int i = 1; i < out->n_files && st == DF_OK; i++)
        if (!strcmp(v[i - 1]->path, v[i]->path)) st = df_fail(err, DF_ERR_FORMAT, "%s: the hub lists %s twice", what, v[i]->path);
    free(v);
done:
    json_decref(root);
    return st;
}

df_status hub_parse_tree(const char *body, size_t n, const char *what, hub_listing *l, char *err) {
    json_error_t je;
    json_t *root = json_loadb(body, n, 0, &je);
    if (!json_is_array(root)) {
        json_decref(root);
        return df_fail(err, DF_ERR_FORMAT, "%s: the hub's tree page is not a JSON array", what);
    }
    hub_file **v = sorted_files(l);
    if (!v) { json_decref(root); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    size_t i;
    json_t *e;
    json_array_foreach(root, i, e) {
        json_t *path = json_object_get(e, "path");
        const char *type = json_string_value(json_object_get(e, "type"));
        if (!json_is_string(path) || !type || strcmp(type, "file")) continue; /* directories */
        hub_file key = {.path = (char *)json_string_value(path)}, *kp = &key;
        hub_file **hit = bsearch(&kp, v, (size_t)l->n_files, sizeof *v, by_path);
        if (hit && (*hit)->size < 0)
            take_entry(*hit, json_object_get(e, "size"), json_object_get(e, "lfs"), json_object_get(e, "oid"));
    }
    free(v);
    json_decref(root);
    return DF_OK;
}

/* GETs url into a malloc'd NUL-terminated *body (retried as section 1 says);
 * next (HUB_MAX_LINK bytes, may be NULL) receives the response's rel="next"
 * link, "" if none. */
static df_status get_body(hub_conn *hc, const hub_client *c, const char *url, const char *what, const char *repo,
                          char **body, size_t *n, char *next, char *err) {
    *body = NULL;
    *n = 0;
    for (int attempt = 0;; attempt++) {
        xfer_info x = {0};
        membuf m = {NULL, 0, 0, (size_t)64 << 20};
        struct curl_slist *hd = setup(hc->h, c, url, &x);
        curl_easy_setopt(hc->h, CURLOPT_WRITEFUNCTION, on_mem);
        curl_easy_setopt(hc->h, CURLOPT_WRITEDATA, &m);
        CURLcode rc = curl_easy_perform(hc->h);
        long code = 0;
        curl_easy_getinfo(hc->h, CURLINFO_RESPONSE_CODE, &code);
        curl_slist_free_all(hd);
        if (rc == CURLE_OK && code == 200) {
            if (x.next_long) {
                free(m.p);
                return df_fail(err, DF_ERR_FORMAT, "%s: the hub's next-page link is not a URL of at most %zu bytes",
                               what, sizeof x.next - 1);
            }
            if (next) snprintf(next, sizeof x.next, "%s", x.next);
            *body = m.p ? m.p : strdup("");
            *n = m.n;
            return *body ? DF_OK : df_fail(err, DF_ERR_NOMEM, "out of memory");
        }
        if (m.p) keep_body(&x, m.p, m.n);
        free(m.p);
        int again = rc != CURLE_OK ? retryable_curl(rc) : retryable_http(code);
        if (!again || attempt >= c->retries) {
            if (rc != CURLE_OK) return df_fail(err, DF_ERR_IO, "%s: %s (%s)", what, curl_easy_strerror(rc), url);
            return http_error(err, code, &x, what, repo);
        }
        backoff(c, attempt);
    }
}

/* The next page's URL from a Link target: a path on the endpoint's host, or
 * an absolute URL on that same host (anything else would carry the token
 * elsewhere). *url is malloc'd. */
static df_status next_page_url(const hub_client *c, const char *link, const char *what, char **url, char *err) {
    const char *ep = c->endpoint && *c->endpoint ? c->endpoint : "https://huggingface.co";
    const char *host = strstr(ep, "://");
    host = host ? host + 3 : ep;
    size_t on = (size_t)(host + strcspn(host, "/") - ep); /* scheme://host[:port] */
    size_t ln = strlen(link);
    char *u;
    if (link[0] == '/' && link[1] != '/') {
        u = malloc(on + ln + 1);
        if (u) { memcpy(u, ep, on); memcpy(u + on, link, ln + 1); }
    } else if (ln > on && !strncasecmp(link, ep, on) && link[on] == '/') {
        u = strdup(link);
    } else {
        return df_fail(err, DF_ERR_FORMAT, "%s: refusing the hub's next-page link to another host: %.300s", what, link);
    }
    *url = u;
    return u ? DF_OK : df_fail(err, DF_ERR_NOMEM, "out of memory");
}

static int missing_sizes(const hub_listing *l) {
    for (int i = 0; i < l->n_files; i++)
        if (l->files[i].size < 0) return 1;
    return 0;
}

/* Fills the sizes (and checks) the model info left out from the tree of the
 * listed commit, page by page, until none is missing or the pages end. */
static df_status list_tree(hub_conn *hc, const hub_client *c, const char *repo, const char *what, hub_listing *l,
                           char *err) {
    char *url = make_url(c, "/api/models/", repo, "/tree/", l->commit, "?recursive=true", NULL);
    char *next = malloc(HUB_MAX_LINK);
    df_status st = url && next ? DF_OK : df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int page = 0; st == DF_OK && missing_sizes(l); page++) {
        if (page == HUB_MAX_PAGES) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: the hub's tree has more than %d pages", what, HUB_MAX_PAGES);
            break;
        }
        char *body;
        size_t n;
        st = get_body(hc, c, url, what, repo, &body, &n, next, err);
        if (st != DF_OK) break;
        st = hub_parse_tree(body, n, what, l, err);
        free(body);
        if (st != DF_OK || !next[0]) break;
        free(url);
        url = NULL;
        st = next_page_url(c, next, what, &url, err);
    }
    free(url);
    free(next);
    return st;
}

df_status hub_list(const hub_client *c, const char *repo, const char *rev, hub_listing *out, char *err) {
    memset(out, 0, sizeof *out);
    char *url = make_url(c, "/api/models/", repo, "/revision/", rev ? rev : "main", "?blobs=true", NULL);
    hub_conn *hc = hub_conn_new();
    if (!url || !hc) { free(url); hub_conn_free(hc); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    char what[600];
    snprintf(what, sizeof what, "listing %s at %s", repo, rev ? rev : "main");
    char *body;
    size_t n;
    df_status st = get_body(hc, c, url, what, repo, &body, &n, NULL, err);
    if (st == DF_OK) {
        st = hub_parse_info(body, n, what, out, err);
        free(body);
    }
    /* a hub that ignores ?blobs=true: the tree API has the sizes */
    if (st == DF_OK && missing_sizes(out)) st = list_tree(hc, c, repo, what, out, err);
    for (int i = 0; st == DF_OK && i < out->n_files; i++)
        if (out->files[i].size < 0)
            st = df_fail(err, DF_ERR_FORMAT, "%s: the hub gives no size for %s (neither in the model info with "
                         "?blobs=true nor in the tree API)", what, out->files[i].path);
    if (st != DF_OK) hub_listing_free(out);
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
    io_drop_written(d.fd); /* read back later in large folios */
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
