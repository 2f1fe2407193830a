/* http.c — the server's HTTP side on libmicrohttpd (prefix srv_).
 *
 * Why libmicrohttpd: GNU's small embeddable HTTP/1.1 server library, in
 * Debian for two decades (libmicrohttpd-dev), C with no other dependencies,
 * a full request parser (chunked bodies, 100-continue, keep-alive, pipelining)
 * and a content-reader callback that makes server-sent events a plain loop.
 * Its thread-per-connection mode lets a connection thread block while its
 * job waits in the queue or streams, so /health, /metrics and /v1/models
 * answer from their own threads while a generation runs.
 *
 * Owns: the listening socket, routing, request bodies (--max-request-bytes:
 * 413 from the Content-Length or as the body grows), the API key (401),
 * /health, /metrics, /v1/models, queueing a job (429 + Retry-After when the
 * queue is full), waiting for it (non-streaming) or streaming it (SSE), the
 * client's socket for disconnect detection, and srv_start / srv_stop.
 * Refuses: unknown routes (404) and wrong methods (405 with Allow), all
 * with an OpenAI error object.
 *
 * Sections: 1. responses  2. routes  3. the access handler  4. start / stop
 */
#include "server.h"
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* per-request state (libmicrohttpd's con_cls) */
typedef struct {
    int route;
    srv_buf body;
    int too_big;
    int answered;                /* a response was queued early */
    srv_job *job;                /* the request's job, while it may still run */
    double t0;
} req;

/* ---- 1. responses -------------------------------------------------------------------- */

static void count(srv *s, int route, int status) {
    if (status < 100 || status > 599) return;
    pthread_mutex_lock(&s->mu);
    s->req_count[route][status]++;
    pthread_mutex_unlock(&s->mu);
}

/* 1 when the loaded engine runs a lossy setting (s->lossy is written once,
 * before loaded = 1, under the lock). */
static int lossy_label(srv *s) {
    pthread_mutex_lock(&s->mu);
    int on = s->loaded == 1 && s->lossy[0];
    pthread_mutex_unlock(&s->mu);
    return on;
}

static enum MHD_Result send_text(srv *s, struct MHD_Connection *c, int route, int status, const char *ctype, char *body) {
    if (!body) { body = strdup("{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}"); status = 500; }
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) { free(body); return MHD_NO; }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (lossy_label(s)) MHD_add_response_header(r, "X-Deltafin-Lossy", s->lossy);
    if (status == 405) {
        const char *allow = route == SRV_R_CHAT || route == SRV_R_COMPLETIONS ? "POST" : "GET";
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    }
    if (status == 401) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (status == 429) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d", srv_retry_after(s));
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    count(s, route, status);
    return rc;
}

static enum MHD_Result send_json(srv *s, struct MHD_Connection *c, int route, int status, char *body) {
    return send_text(s, c, route, status, "application/json", body);
}

static enum MHD_Result send_error(srv *s, struct MHD_Connection *c, int route, int status, const char *msg,
                                  const char *type, const char *param, const char *code) {
    if (!type) type = status >= 500 ? "server_error" : status == 401 ? "invalid_request_error"
                    : status == 429 ? "rate_limit_error" : "invalid_request_error";
    return send_json(s, c, route, status, srv_error_json(msg, type, param, code));
}

/* ---- 2. routes ----------------------------------------------------------------------- */

static int route_of(const char *url, int *get_only) {
    *get_only = 1;
    if (!strcmp(url, "/v1/chat/completions")) { *get_only = 0; return SRV_R_CHAT; }
    if (!strcmp(url, "/v1/completions")) { *get_only = 0; return SRV_R_COMPLETIONS; }
    if (!strcmp(url, "/v1/models") || !strncmp(url, "/v1/models/", 11)) return SRV_R_MODELS;
    if (!strcmp(url, "/health")) return SRV_R_HEALTH;
    if (!strcmp(url, "/metrics")) return SRV_R_METRICS;
    return SRV_R_OTHER;
}

static json_t *model_obj(srv *s) {
    /* beside OpenAI's fields: which spine runs, and any lossy setting (both
     * written once before loaded = 1, which is read under the lock) */
    pthread_mutex_lock(&s->mu);
    int ready = s->loaded == 1;
    pthread_mutex_unlock(&s->mu);
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:s}", "id", s->model_name, "object", "model", "created",
                     (json_int_t)time(NULL), "owned_by", "deltafin", "spine_dtype", ready ? s->spine_dtype : "",
                     "lossy", ready ? s->lossy : "");
}

static enum MHD_Result do_models(srv *s, struct MHD_Connection *c, const char *url) {
    json_t *root;
    if (url[10] == '/') {
        if (strcmp(url + 11, s->model_name)) {
            char msg[512];
            snprintf(msg, sizeof msg, "The model '%.400s' does not exist", url + 11);
            return send_error(s, c, SRV_R_MODELS, 404, msg, "invalid_request_error", "model", "model_not_found");
        }
        root = model_obj(s);
    } else {
        root = json_pack("{s:s, s:[o]}", "object", "list", "data", model_obj(s));
    }
    char *body = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return send_json(s, c, SRV_R_MODELS, 200, body);
}

static enum MHD_Result do_health(srv *s, struct MHD_Connection *c) {
    pthread_mutex_lock(&s->mu);
    int st = s->loaded;
    json_t *root = st == 1 ? json_pack("{s:s}", "status", "ok")
                 : st == 0 ? json_pack("{s:s}", "status", "loading")
                           : json_pack("{s:s, s:s}", "status", "error", "message", s->load_err);
    pthread_mutex_unlock(&s->mu);
    char *body = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return send_json(s, c, SRV_R_HEALTH, st == 1 ? 200 : 503, body);
}

/* SSE: the connection thread waits here for the generator's bytes */
typedef struct {
    srv *s;
    srv_job *j;
} stream_ctx;

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_ctx *sc = cls;
    srv *s = sc->s;
    srv_job *j = sc->j;
    pthread_mutex_lock(&s->mu);
    while (j->sse.n == j->sse_sent && j->state != SRV_DONE) pthread_cond_wait(&j->cv, &s->mu);
    size_t avail = j->sse.n - j->sse_sent;
    if (avail) {
        size_t k = avail < max ? avail : max;
        memcpy(buf, j->sse.p + j->sse_sent, k);
        j->sse_sent += k;
        pthread_mutex_unlock(&s->mu);
        return (ssize_t)k;
    }
    int clean = j->finish != NULL || j->http_status != 200;
    pthread_mutex_unlock(&s->mu);
    return clean ? MHD_CONTENT_READER_END_OF_STREAM : MHD_CONTENT_READER_END_WITH_ERROR;
}

static void sse_free(void *cls) {
    stream_ctx *sc = cls;
    srv_job_unref(sc->s, sc->j);
    free(sc);
}

static int client_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

static enum MHD_Result do_generate(srv *s, struct MHD_Connection *c, req *r) {
    pthread_mutex_lock(&s->mu);
    int loaded = s->loaded, stopping = s->stopping;
    pthread_mutex_unlock(&s->mu);
    if (loaded != 1 || stopping)
        return send_error(s, c, r->route, 503, loaded == 0 ? "The model is still loading; retry shortly." : "The server is not serving.",
                          "server_error", NULL, NULL);
    srv_err e;
    srv_job *j = srv_job_from_request(r->route == SRV_R_CHAT ? SRV_CHAT : SRV_COMPLETION, r->body.p ? r->body.p : "",
                                      r->body.n, s->tok, s->vocab, s->o.max_tokens, s->ctx, s->model_name, &e);
    if (!j) return send_error(s, c, r->route, e.status, e.msg, NULL, e.param, e.code);
    j->fd = client_fd(c);
    int q = srv_enqueue(s, j);
    if (q) {
        srv_job_unref(s, j);
        if (q == 429) {
            char msg[160];
            snprintf(msg, sizeof msg, "The server is busy: %d requests are already waiting. Retry after the time in Retry-After.", s->o.queue);
            return send_error(s, c, r->route, 429, msg, "rate_limit_error", NULL, "queue_full");
        }
        return send_error(s, c, r->route, 503, "The server is not serving.", "server_error", NULL, NULL);
    }
    pthread_mutex_lock(&s->mu);
    r->job = j; /* a reference for the completion callback, which cancels it if the client went away */
    j->refs++;
    pthread_mutex_unlock(&s->mu);
    if (j->stream) {
        stream_ctx *sc = malloc(sizeof *sc);
        struct MHD_Response *resp = sc ? MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_read, sc, sse_free) : NULL;
        if (!resp) {
            free(sc);
            pthread_mutex_lock(&s->mu);
            j->cancel = 1;
            pthread_mutex_unlock(&s->mu);
            srv_job_unref(s, j);
            return MHD_NO;
        }
        sc->s = s;
        sc->j = j; /* the reference this function held goes to the response */
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream; charset=utf-8");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        if (lossy_label(s)) MHD_add_response_header(resp, "X-Deltafin-Lossy", s->lossy);
        enum MHD_Result rc = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        count(s, r->route, 200);
        return rc;
    }
    pthread_mutex_lock(&s->mu);
    while (j->state != SRV_DONE) pthread_cond_wait(&j->cv, &s->mu);
    int status = j->http_status, finished = j->finish != NULL;
    pthread_mutex_unlock(&s->mu);
    enum MHD_Result rc;
    if (status != 200) rc = send_error(s, c, r->route, status, j->errmsg, j->err_type, NULL, NULL);
    else if (!finished) rc = MHD_NO; /* cancelled: the client is gone */
    else rc = send_json(s, c, r->route, 200, srv_response_json(j));
    srv_job_unref(s, j);
    return rc;
}

/* ---- 3. the access handler ------------------------------------------------------------- */

static int authorized(srv *s, struct MHD_Connection *c) {
    if (!s->api_key) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7)) return 0;
    h += 7;
    while (*h == ' ') h++;
    size_t n = strlen(h), k = strlen(s->api_key);
    unsigned diff = (unsigned)(n ^ k);
    for (size_t i = 0; i < k; i++) diff |= (unsigned char)s->api_key[i] ^ (unsigned char)(i < n ? h[i] : 0);
    return diff == 0;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    srv *s = cls;
    req *r = *con_cls;
    if (!r) {
        r = calloc(1, sizeof *r);
        if (!r) return MHD_NO;
        int get_only;
        r->route = route_of(url, &get_only);
        r->t0 = srv_now();
        *con_cls = r;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoll(cl, NULL, 10) > s->o.max_request_bytes) {
            r->answered = 1;
            char msg[160];
            snprintf(msg, sizeof msg, "Request body of %s bytes is above this server's limit of %lld bytes.", cl,
                     (long long)s->o.max_request_bytes);
            return send_error(s, c, r->route, 413, msg, "invalid_request_error", NULL, "request_too_large");
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (!r->answered && !r->too_big) {
            if (r->body.n + *upload_size > (size_t)s->o.max_request_bytes) {
                r->too_big = 1;
                srv_buf_free(&r->body);
            } else if (srv_buf_add(&r->body, upload, *upload_size)) {
                r->too_big = 1;
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (r->answered) return MHD_YES;
    r->answered = 1;
    int get_only;
    route_of(url, &get_only);
    int is_get = !strcmp(method, "GET"), is_post = !strcmp(method, "POST");
    if (r->route == SRV_R_OTHER) {
        char msg[600];
        snprintf(msg, sizeof msg, "Unknown request URL: %.16s %.500s.", method, url);
        return send_error(s, c, r->route, 404, msg, "invalid_request_error", NULL, "unknown_url");
    }
    if ((get_only && !is_get) || (!get_only && !is_post)) {
        char msg[600];
        snprintf(msg, sizeof msg, "Method %.16s is not allowed on %.500s (use %s).", method, url, get_only ? "GET" : "POST");
        return send_error(s, c, r->route, 405, msg, "invalid_request_error", NULL, "method_not_allowed");
    }
    if (r->route == SRV_R_HEALTH) return do_health(s, c);
    if (r->route == SRV_R_METRICS) return send_text(s, c, r->route, 200, "text/plain; version=0.0.4; charset=utf-8", srv_metrics_text(s));
    if (!authorized(s, c))
        return send_error(s, c, r->route, 401, "Incorrect API key provided. Send it as 'Authorization: Bearer KEY'.",
                          "invalid_request_error", NULL, "invalid_api_key");
    if (r->route == SRV_R_MODELS) return do_models(s, c, url);
    if (r->too_big) {
        char msg[160];
        snprintf(msg, sizeof msg, "Request body is above this server's limit of %lld bytes.", (long long)s->o.max_request_bytes);
        return send_error(s, c, r->route, 413, msg, "invalid_request_error", NULL, "request_too_large");
    }
    return do_generate(s, c, r);
}

/* The request is over (sent, failed or the client went away). */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)c;
    srv *s = cls;
    req *r = *con_cls;
    if (!r) return;
    if (r->job) {
        pthread_mutex_lock(&s->mu);
        r->job->fd = -1; /* the socket is about to close: never poll it again */
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) r->job->cancel = 1;
        pthread_mutex_unlock(&s->mu);
        srv_job_unref(s, r->job);
    }
    srv_buf_free(&r->body);
    free(r);
    *con_cls = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    srv *s = cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n') line[--n] = 0;
    srv_log(s, "http: %s", line);
}

/* ---- 4. start / stop ------------------------------------------------------------------- */

void srv_opts_default(srv_opts *o) {
    memset(o, 0, sizeof *o);
    df_engine_opts_default(&o->engine);
    o->host = "127.0.0.1";
    o->port = 8000;
    o->queue = 8;
    o->max_request_bytes = 1 << 20;
    o->max_tokens = 4096;
    o->max_connections = 128;
    o->parallel = 1;
    df_spec_params_default(&o->spec_params);
}

static int listen_on(const char *host, int port, int *bound, char err[DF_ERRMSG]) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int gai = getaddrinfo(host, ps, &hints, &res);
    if (gai) {
        snprintf(err, DF_ERRMSG, "cannot resolve --host %s: %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1, e = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        #ifdef SOCK_CLOEXEC
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
#else /* macOS */
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd >= 0) (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
#endif
        if (fd < 0) { e = errno; continue; }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, 128)) {
            e = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) {
        snprintf(err, DF_ERRMSG, "cannot listen on %s:%d: %s", host, port, strerror(e));
        return -1;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    *bound = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port) : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}

static const char *base_name(const char *dir) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    const char *p = dir + n;
    while (p > dir && p[-1] != '/') p--;
    return p;
}

static void srv_free(srv *s) {
    free(s->host);
    free(s->api_key);
    free(s->model_name);
    free(s->model_dir);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

df_status srv_start(const srv_opts *o, srv **out, char err[DF_ERRMSG]) {
    *out = NULL;
    if (!o->model_dir || o->queue < 0 || o->max_request_bytes <= 0 || o->max_tokens <= 0) {
        snprintf(err, DF_ERRMSG, "srv_start: bad options");
        return DF_ERR_ARG;
    }
    srv *s = calloc(1, sizeof *s);
    if (!s) { snprintf(err, DF_ERRMSG, "out of memory"); return DF_ERR_NOMEM; }
    s->o = *o;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->listen_fd = -1;
    s->host = strdup(o->host ? o->host : "127.0.0.1");
    s->api_key = o->api_key ? strdup(o->api_key) : NULL;
    s->model_dir = strdup(o->model_dir);
    char name[256];
    snprintf(name, sizeof name, "%s", o->model_name ? o->model_name : base_name(o->model_dir));
    s->model_name = strdup(name[0] ? name : "deltafin");
    s->o.host = s->host;
    s->o.api_key = s->api_key;
    s->o.model_dir = s->model_dir;
    s->o.model_name = s->model_name;
    if (!s->host || !s->model_dir || !s->model_name || (o->api_key && !s->api_key)) {
        srv_free(s);
        snprintf(err, DF_ERRMSG, "out of memory");
        return DF_ERR_NOMEM;
    }
    s->listen_fd = listen_on(s->host, o->port, &s->port, err);
    if (s->listen_fd < 0) { srv_free(s); return DF_ERR_IO; }
    if (srv_gen_start(s, err) != DF_OK) {
        close(s->listen_fd);
        srv_free(s);
        return DF_ERR_NOMEM;
    }
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_ERROR_LOG;
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s,
                            MHD_OPTION_LISTEN_SOCKET, s->listen_fd,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)(o->max_connections > 0 ? o->max_connections : 128),
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_END);
    if (!s->d) {
        snprintf(err, DF_ERRMSG, "cannot start the HTTP daemon on %s:%d", s->host, s->port);
        srv_gen_stop(s);
        srv_gen_free(s);
        close(s->listen_fd);
        srv_free(s);
        return DF_ERR_IO;
    }
    *out = s;
    return DF_OK;
}

int srv_port(const srv *s) { return s->port; }

df_status srv_wait_loaded(srv *s, char err[DF_ERRMSG]) {
    pthread_mutex_lock(&s->mu);
    while (s->loaded == 0) pthread_cond_wait(&s->cv, &s->mu);
    df_status st = s->loaded == 1 ? DF_OK : DF_ERR_IO;
    if (st != DF_OK) snprintf(err, DF_ERRMSG, "%s", s->load_err);
    pthread_mutex_unlock(&s->mu);
    return st;
}

void srv_stop(srv *s) {
    if (!s) return;
    srv_gen_stop(s);          /* cancels every job: connection threads wake and finish */
    MHD_stop_daemon(s->d);    /* joins the connection threads */
    srv_gen_free(s);          /* the model, once no connection thread can use it */
    if (s->listen_fd >= 0) close(s->listen_fd);
    srv_free(s);
}
