/* gen.c — the server's generator thread (prefix srv_).
 *
 * Owns: loading the model (engine, tokenizer, end-of-generation tokens), the
 * bounded FIFO of waiting jobs, the one kept session and the token loop:
 * prefix reuse, sampling, streaming detokenisation, the K3 chat parser, stop
 * strings and tokens, cancellation (a client whose socket closed is noticed
 * before its prompt is evaluated and before every token), and the metrics it
 * counts.
 * Refuses: more than one generation at a time (by design: one session, one
 * timeline), rolling a session back (recurrent KDA state cannot be
 * truncated: a prompt that does not extend the kept tokens starts over).
 *
 * Sections: 1. helpers  2. loading  3. queue  4. the token loop
 *           5. the thread  6. metrics
 */
#include "server.h"
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- 1. helpers: clock, log, stop strings ---------------------------------------- */

double srv_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void srv_log(srv *s, const char *fmt, ...) {
    if (!s->o.log) return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    s->o.log(s->o.log_ud, line);
}

/* Stop strings. The pending text keeps the longest suffix that may still
 * grow into a stop string; everything before it is certain. */
int srv_stop_feed(srv_stopper *st, const char *text, size_t n, srv_buf *out) {
    if (st->hit) return 1;
    if (!st->n_stop) { srv_buf_add(out, text, n); return 0; }
    srv_buf_add(&st->pending, text, n);
    const char *p = st->pending.p;
    size_t pn = st->pending.n;
    size_t first = pn;
    for (int i = 0; i < st->n_stop; i++) {
        const char *h = memmem(p, pn, st->stop[i], strlen(st->stop[i]));
        if (h && (size_t)(h - p) < first) first = (size_t)(h - p);
    }
    if (first < pn) {
        srv_buf_add(out, p, first);
        st->pending.n = 0;
        st->hit = 1;
        return 1;
    }
    size_t keep = 0;
    for (int i = 0; i < st->n_stop; i++) {
        size_t sl = strlen(st->stop[i]);
        for (size_t k = (pn < sl - 1 ? pn : sl - 1); k > keep; k--)
            if (!memcmp(st->stop[i], p + pn - k, k)) { keep = k; break; }
    }
    size_t emit = pn - keep;
    if (emit) {
        srv_buf_add(out, p, emit);
        memmove(st->pending.p, p + emit, keep);
        st->pending.n = keep;
    }
    return 0;
}

void srv_stop_flush(srv_stopper *st, srv_buf *out) {
    if (!st->hit && st->pending.n) srv_buf_add(out, st->pending.p, st->pending.n);
    st->pending.n = 0;
}

/* ---- 2. loading -------------------------------------------------------------------- */

static void add_stop_id(srv *s, int32_t id) {
    if (id < 0 || id >= s->vocab || s->n_stop_ids >= 8) return;
    for (int i = 0; i < s->n_stop_ids; i++) if (s->stop_ids[i] == id) return;
    s->stop_ids[s->n_stop_ids++] = id;
}

/* eos_token_id of config.json (top level or text_config; a number or a list). */
static void config_eos(srv *s) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", s->model_dir);
    json_t *root = json_load_file(path, 0, NULL);
    if (!root) return;
    json_t *v = json_object_get(root, "eos_token_id");
    if (!v) v = json_object_get(json_object_get(root, "text_config"), "eos_token_id");
    if (json_is_integer(v)) add_stop_id(s, (int32_t)json_integer_value(v));
    else if (json_is_array(v)) {
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) if (json_is_integer(x)) add_stop_id(s, (int32_t)json_integer_value(x));
    }
    json_decref(root);
}

static df_status load(srv *s, char err[DF_ERRMSG]) {
    df_status st = df_engine_open(s->model_dir, &s->o.engine, &s->e, err);
    if (st != DF_OK) return st;
    char terr[DF_ERRMSG];
    st = df_tokenizer_load_dir(s->model_dir, &s->tok, terr);
    if (st != DF_OK) {
        snprintf(err, DF_ERRMSG, "the server needs the model's tokenizer: %.900s", terr);
        return st;
    }
    s->vocab = df_engine_vocab_size(s->e);
    if (df_tokenizer_vocab_size(s->tok) > s->vocab) {
        snprintf(err, DF_ERRMSG, "%s: the tokenizer has %d ids but the model's vocabulary is %d", s->model_dir,
                 df_tokenizer_vocab_size(s->tok), s->vocab);
        return DF_ERR_MISMATCH;
    }
    st = df_session_new(s->e, s->o.ctx, &s->sess);
    if (st != DF_OK) {
        snprintf(err, DF_ERRMSG, "cannot allocate a session of %d positions: %s", s->o.ctx, df_status_name(st));
        return st;
    }
    s->ctx = s->o.ctx > 0 ? s->o.ctx : (df_engine_max_context(s->e) < 4096 ? df_engine_max_context(s->e) : 4096);
    config_eos(s);
    static const char *const ends[] = {"<|end_of_msg|>", "[EOS]", "<|im_end|>", "<|endoftext|>", "<|eot_id|>"};
    for (size_t i = 0; i < sizeof ends / sizeof *ends; i++) add_stop_id(s, df_tokenizer_special(s->tok, ends[i]));
    static const char *const markers[4] = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"};
    for (int i = 0; i < 4; i++) s->marker_ids[i] = df_tokenizer_special(s->tok, markers[i]);
    return DF_OK;
}

/* ---- 3. queue ---------------------------------------------------------------------- */

int srv_enqueue(srv *s, srv_job *j) {
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    if (s->stopping || s->loaded != 1) rc = 503;
    else if (s->q_n >= s->o.queue + (s->running ? 0 : 1)) rc = 429;
    if (rc) {
        if (rc == 429) s->rejected++;
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    s->q[(s->q_head + s->q_n) % s->q_cap] = j;
    s->q_n++;
    j->refs++;
    j->state = SRV_QUEUED;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void srv_job_unref(srv *s, srv_job *j) {
    if (!j) return;
    pthread_mutex_lock(&s->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&s->mu);
    if (!left) srv_job_free(j);
}

int srv_retry_after(srv *s) {
    pthread_mutex_lock(&s->mu);
    double per = s->jobs_done ? s->busy_s / (double)s->jobs_done : 1.0;
    int n = s->q_n + 1;
    pthread_mutex_unlock(&s->mu);
    double w = ceil(per * n);
    return w < 1 ? 1 : w > 3600 ? 3600 : (int)w;
}

/* ---- 4. the token loop ------------------------------------------------------------- */

typedef struct {
    srv *s;
    srv_job *j;
    srv_stopper stop[3];         /* per channel: [DF_CHAT_REASONING], [DF_CHAT_CONTENT] */
    srv_buf tmp;
    int stopped;                 /* a stop string matched */
    int n_calls;
} loop_ctx;

/* text of one channel through its stop strings to the job (under mu) */
static void channel_text(loop_ctx *c, int kind, const char *text, size_t n) {
    if (c->stopped) return;
    c->tmp.n = 0;
    if (srv_stop_feed(&c->stop[kind], text, n, &c->tmp)) c->stopped = 1;
    if (c->tmp.n) srv_out_text(c->j, kind, c->tmp.p, c->tmp.n);
}

static void on_chat(void *ud, int kind, const char *text, size_t n) {
    loop_ctx *c = ud;
    if (kind == DF_CHAT_TOOL_CALL) {
        if (c->stopped || (!c->j->parallel_tool_calls && c->n_calls)) return;
        c->n_calls++;
        srv_out_tool_call(c->j, text, n);
        return;
    }
    channel_text(c, kind, text, n);
}

/* The client's socket: closed or reset? (under mu) */
static int client_gone(srv_job *j) {
    if (j->cancel) return 1;
    if (j->fd < 0) return 0;
    struct pollfd p = {.fd = j->fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) j->cancel = 1;
    return j->cancel;
}

static int is_marker(const srv *s, int32_t id) {
    for (int i = 0; i < 4; i++) if (s->marker_ids[i] == id) return 1;
    return 0;
}

static int is_stop_id(const srv *s, int32_t id) {
    for (int i = 0; i < s->n_stop_ids; i++) if (s->stop_ids[i] == id) return 1;
    return 0;
}

/* Brings the session to the job's prompt: continue from the kept tokens when
 * the prompt extends them, else start over. Returns the reused count, or -1
 * (the job holds the error). */
static int prefill(srv *s, srv_job *j) {
    const df_tokens *p = &j->prompt;
    int L = 0;
    while (L < s->kept.n && L < p->n && s->kept.ids[L] == p->ids[L]) L++;
    int reuse = L == s->kept.n && L > 0 && (L < p->n || df_session_pos(s->sess) == L);
    if (!reuse) {
        df_session_reset(s->sess);
        s->kept.n = 0;
        L = 0;
    }
    if (p->n > L) {
        df_status st = df_session_eval(s->sess, p->ids + L, p->n - L, NULL);
        if (st != DF_OK) {
            df_session_reset(s->sess);
            s->kept.n = 0;
            pthread_mutex_lock(&s->mu);
            srv_out_error(j, st == DF_ERR_CONTEXT ? 400 : 500, st == DF_ERR_CONTEXT ? "invalid_request_error" : "server_error",
                          df_session_error(s->sess));
            pthread_mutex_unlock(&s->mu);
            return -1;
        }
        for (int i = L; i < p->n; i++) df_tokens_push(&s->kept, p->ids[i]);
    }
    return L;
}

static void run_job(srv *s, srv_job *j) {
    double t0 = srv_now();
    char err[DF_ERRMSG];
    df_sampler *smp = NULL;
    df_detok *dt = NULL;
    df_chat_parser *cp = NULL;
    loop_ctx c = {.s = s, .j = j};
    for (int k = 1; k <= 2; k++) {
        c.stop[k].stop = (const char *const *)j->stop;
        c.stop[k].n_stop = j->n_stop;
    }
    /* a client that left while its request waited costs no prefill */
    pthread_mutex_lock(&s->mu);
    int left = client_gone(j);
    if (left) {
        s->cancelled++;
        srv_log(s, "%s: cancelled before its prompt of %d tokens was evaluated (the client went away)", j->id, j->prompt.n);
    }
    pthread_mutex_unlock(&s->mu);
    if (left) goto out;
    int reused = prefill(s, j);
    if (reused < 0) goto out;
    double t_prefill = srv_now() - t0;
    if (df_sampler_new(&j->sp, s->vocab, &smp, err) != DF_OK ||
        df_detok_new(s->tok, j->kind == SRV_COMPLETION, &dt) != DF_OK ||
        (j->kind == SRV_CHAT && df_chat_parser_new(j->thinking, on_chat, &c, &cp) != DF_OK)) {
        pthread_mutex_lock(&s->mu);
        srv_out_error(j, 500, "server_error", "out of memory");
        pthread_mutex_unlock(&s->mu);
        goto out;
    }
    /* an empty feed gives the parser its buffer: df_chat_parser_finish on a
     * parser that never saw text passes NULL to memmem (src/text/chat.c) */
    if (cp) df_chat_parser_feed(cp, "", 0);
    for (int i = 0; i < j->n_bias; i++) df_sampler_set_bias(smp, j->bias_id[i], j->bias[i]);
    pthread_mutex_lock(&s->mu);
    j->prompt_tokens = j->prompt.n;
    j->cached_tokens = reused;
    pthread_mutex_unlock(&s->mu);

    const char *finish = "length";
    int limit = j->max_tokens > 0 ? j->max_tokens : s->ctx;
    double t_dec = srv_now();
    for (int i = 0; i < limit; i++) {
        pthread_mutex_lock(&s->mu);
        int gone = client_gone(j);
        pthread_mutex_unlock(&s->mu);
        if (gone) { finish = NULL; break; }
        df_sample info;
        int32_t tok = df_sampler_sample(smp, df_session_logits(s->sess), &info);
        df_sampler_accept(smp, tok);
        pthread_mutex_lock(&s->mu);
        if (i == 0) j->ttft_s = srv_now() - t0;
        j->completion_tokens++;
        if (j->logprobs) srv_out_logprob(j, s->tok, &info);
        pthread_mutex_unlock(&s->mu);
        if (is_stop_id(s, tok)) { finish = "stop"; break; }
        const char *text;
        size_t tn;
        /* chat: a special token that is not a chat marker is not text */
        int hidden = cp && df_tokenizer_is_special(s->tok, tok) && !is_marker(s, tok);
        if (!hidden && df_detok_push(dt, tok, &text, &tn) == DF_OK && tn) {
            pthread_mutex_lock(&s->mu);
            if (cp) {
                if (df_chat_parser_feed(cp, text, tn) != DF_OK) c.stopped = 1;
            } else channel_text(&c, DF_CHAT_CONTENT, text, tn);
            pthread_mutex_unlock(&s->mu);
        }
        if (cp && j->thinking) {
            /* tokens before the reasoning channel closes count as reasoning */
            pthread_mutex_lock(&s->mu);
            if (!j->content.n && !j->tool_calls && !df_chat_parser_done(cp)) j->reasoning_tokens++;
            pthread_mutex_unlock(&s->mu);
        }
        if (c.stopped || (cp && df_chat_parser_done(cp))) { finish = "stop"; break; }
        if (i + 1 == limit) break;
        if (df_session_pos(s->sess) >= s->ctx) break;
        df_status st = df_session_eval(s->sess, &tok, 1, NULL);
        if (st != DF_OK) {
            df_session_reset(s->sess);
            s->kept.n = 0;
            pthread_mutex_lock(&s->mu);
            srv_out_error(j, 500, "server_error", df_session_error(s->sess));
            pthread_mutex_unlock(&s->mu);
            goto out;
        }
        df_tokens_push(&s->kept, tok);
        if (s->o.test_delay_ms > 0) usleep((useconds_t)s->o.test_delay_ms * 1000);
    }
    pthread_mutex_lock(&s->mu);
    if (finish) {
        const char *text;
        size_t tn;
        df_detok_flush(dt, &text, &tn);
        if (cp) {
            if (tn) df_chat_parser_feed(cp, text, tn);
            df_chat_parser_finish(cp);
        } else if (tn) channel_text(&c, DF_CHAT_CONTENT, text, tn);
        for (int k = 1; k <= 2; k++) {
            c.tmp.n = 0;
            srv_stop_flush(&c.stop[k], &c.tmp);
            if (c.tmp.n) srv_out_text(j, k, c.tmp.p, c.tmp.n);
        }
        j->finish = j->tool_calls && strcmp(finish, "length") ? "tool_calls" : finish;
        srv_out_finish(j);
    } else {
        s->cancelled++;
    }
    double now = srv_now();
    srv_log(s, "%s: prompt %d tokens (%d reused), %d generated, first token %.3f s, %.1f tokens/s, %s", j->id, j->prompt.n, reused,
            j->completion_tokens, j->ttft_s, j->completion_tokens > 1 ? (j->completion_tokens - 1) / (now - t_dec + 1e-9) : 0.0,
            j->finish ? j->finish : "cancelled (the client went away)");
    s->prompt_tokens += (uint64_t)(j->prompt.n - reused);
    s->cached_tokens += (uint64_t)reused;
    s->gen_tokens += (uint64_t)j->completion_tokens;
    s->prefill_s += t_prefill;
    s->decode_s += now - t_dec;
    if (j->completion_tokens) {
        s->ttft_sum[reused > 0] += j->ttft_s;
        s->ttft_n[reused > 0]++;
        s->last_s_per_token = (now - t_dec) / j->completion_tokens;
    }
    pthread_mutex_unlock(&s->mu);
out:
    df_chat_parser_free(cp);
    df_detok_free(dt);
    df_sampler_free(smp);
    for (int k = 1; k <= 2; k++) srv_buf_free(&c.stop[k].pending);
    srv_buf_free(&c.tmp);
    pthread_mutex_lock(&s->mu);
    s->busy_s += srv_now() - t0;
    s->jobs_done++;
    df_engine_stats(s->e, &s->stats);
    pthread_mutex_unlock(&s->mu);
}

/* ---- 5. the thread ----------------------------------------------------------------- */

static void *gen_main(void *arg) {
    srv *s = arg;
    char err[DF_ERRMSG];
    double t0 = srv_now();
    df_status st = load(s, err);
    pthread_mutex_lock(&s->mu);
    if (st != DF_OK) {
        snprintf(s->load_err, sizeof s->load_err, "%s", err);
        s->loaded = -1;
    } else {
        snprintf(s->lossy, sizeof s->lossy, "%s", df_engine_lossy(s->e));
        snprintf(s->spine_dtype, sizeof s->spine_dtype, "%s", df_engine_spine_dtype(s->e));
        s->loaded = 1;
        df_engine_stats(s->e, &s->stats);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (st != DF_OK) return NULL;
    srv_log(s, "model loaded in %.2f s: %s", srv_now() - t0, df_tokenizer_describe(s->tok));
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stopping && !s->q_n) pthread_cond_wait(&s->cv, &s->mu);
        if (s->stopping) { pthread_mutex_unlock(&s->mu); break; }
        srv_job *j = s->q[s->q_head];
        s->q_head = (s->q_head + 1) % s->q_cap;
        s->q_n--;
        s->running = j;
        j->state = SRV_RUNNING;
        pthread_mutex_unlock(&s->mu);

        run_job(s, j);

        pthread_mutex_lock(&s->mu);
        j->state = SRV_DONE;
        s->running = NULL;
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&s->mu);
        srv_job_unref(s, j);
    }
    return NULL;
}

df_status srv_gen_start(srv *s, char err[DF_ERRMSG]) {
    s->q_cap = s->o.queue + 2;
    s->q = calloc((size_t)s->q_cap, sizeof *s->q);
    if (!s->q) { snprintf(err, DF_ERRMSG, "out of memory"); return DF_ERR_NOMEM; }
    if (pthread_create(&s->gen, NULL, gen_main, s)) {
        snprintf(err, DF_ERRMSG, "cannot start the generator thread");
        return DF_ERR_NOMEM;
    }
    s->gen_started = 1;
    return DF_OK;
}

void srv_gen_stop(srv *s) {
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    if (s->running) s->running->cancel = 1;
    while (s->q_n) { /* waiting jobs end without output */
        srv_job *j = s->q[s->q_head];
        s->q_head = (s->q_head + 1) % s->q_cap;
        s->q_n--;
        j->cancel = 1;
        srv_out_error(j, 503, "server_error", "the server is shutting down");
        j->state = SRV_DONE;
        pthread_cond_broadcast(&j->cv);
        if (--j->refs == 0) srv_job_free(j);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->gen_started) pthread_join(s->gen, NULL);
    s->gen_started = 0;
}

void srv_gen_free(srv *s) {
    df_session_free(s->sess);
    s->sess = NULL;
    df_tokens_free(&s->kept);
    df_tokenizer_free(s->tok);
    s->tok = NULL;
    df_engine_close(s->e);
    s->e = NULL;
    free(s->q);
    s->q = NULL;
}

/* ---- 6. metrics -------------------------------------------------------------------- */

static void mf(srv_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void mf(srv_buf *b, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0) srv_buf_add(b, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

static void metric(srv_buf *b, const char *name, const char *type, const char *help) {
    mf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

char *srv_metrics_text(srv *s) {
    static const char *const routes[SRV_N_ROUTES] = {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                     "/health", "/metrics", "other"};
    srv_buf b = {0};
    pthread_mutex_lock(&s->mu);
    metric(&b, "deltafin_requests_total", "counter", "HTTP requests answered, by route and status code");
    for (int r = 0; r < SRV_N_ROUTES; r++)
        for (int c = 100; c < 600; c++)
            if (s->req_count[r][c]) mf(&b, "deltafin_requests_total{route=\"%s\",code=\"%d\"} %llu\n", routes[r], c,
                                        (unsigned long long)s->req_count[r][c]);
    metric(&b, "deltafin_prompt_tokens_total", "counter", "prompt tokens evaluated (prefilled)");
    mf(&b, "deltafin_prompt_tokens_total %llu\n", (unsigned long long)s->prompt_tokens);
    metric(&b, "deltafin_prompt_tokens_reused_total", "counter", "prompt tokens served from the kept session (prefix reuse)");
    mf(&b, "deltafin_prompt_tokens_reused_total %llu\n", (unsigned long long)s->cached_tokens);
    metric(&b, "deltafin_generation_tokens_total", "counter", "tokens generated");
    mf(&b, "deltafin_generation_tokens_total %llu\n", (unsigned long long)s->gen_tokens);
    metric(&b, "deltafin_prefill_seconds_total", "counter", "time spent evaluating prompts");
    mf(&b, "deltafin_prefill_seconds_total %.6f\n", s->prefill_s);
    metric(&b, "deltafin_decode_seconds_total", "counter", "time spent generating");
    mf(&b, "deltafin_decode_seconds_total %.6f\n", s->decode_s);
    metric(&b, "deltafin_seconds_per_token", "gauge", "decode seconds per generated token of the last request");
    mf(&b, "deltafin_seconds_per_token %.6f\n", s->last_s_per_token);
    metric(&b, "deltafin_time_to_first_token_seconds", "summary", "time from the start of a generation to its first token");
    for (int k = 0; k < 2; k++) {
        mf(&b, "deltafin_time_to_first_token_seconds_sum{prefix_reused=\"%s\"} %.6f\n", k ? "yes" : "no", s->ttft_sum[k]);
        mf(&b, "deltafin_time_to_first_token_seconds_count{prefix_reused=\"%s\"} %llu\n", k ? "yes" : "no",
           (unsigned long long)s->ttft_n[k]);
    }
    metric(&b, "deltafin_queue_depth", "gauge", "requests waiting for the generator");
    mf(&b, "deltafin_queue_depth %d\n", s->q_n);
    metric(&b, "deltafin_queue_capacity", "gauge", "waiting requests accepted before 429");
    mf(&b, "deltafin_queue_capacity %d\n", s->o.queue);
    metric(&b, "deltafin_generating", "gauge", "1 while a generation runs");
    mf(&b, "deltafin_generating %d\n", s->running ? 1 : 0);
    metric(&b, "deltafin_requests_rejected_total", "counter", "requests refused with 429 (queue full)");
    mf(&b, "deltafin_requests_rejected_total %llu\n", (unsigned long long)s->rejected);
    metric(&b, "deltafin_requests_cancelled_total", "counter", "generations stopped because the client went away");
    mf(&b, "deltafin_requests_cancelled_total %llu\n", (unsigned long long)s->cancelled);
    metric(&b, "deltafin_expert_bytes_read_total", "counter", "routed expert bytes read from disk");
    mf(&b, "deltafin_expert_bytes_read_total %llu\n", (unsigned long long)s->stats.bytes_read);
    metric(&b, "deltafin_spine_bytes_read_total", "counter", "non-expert bytes read from disk by a streamed spine");
    mf(&b, "deltafin_spine_bytes_read_total %llu\n", (unsigned long long)s->stats.spine_bytes_read);
    if (s->loaded == 1) {
        metric(&b, "deltafin_spine_info", "gauge", "the spine's matrices in use (dtype) and the lossy settings (\"\" when exact)");
        mf(&b, "deltafin_spine_info{dtype=\"%s\",lossy=\"%s\"} 1\n", s->spine_dtype, s->lossy);
    }
    /* prefetched experts were read for the step: misses, not hits */
    uint64_t look = s->stats.expert_hits + s->stats.expert_misses + s->stats.prefetch_used;
    metric(&b, "deltafin_expert_cache_hit_ratio", "gauge", "experts found in RAM without a read / experts used");
    mf(&b, "deltafin_expert_cache_hit_ratio %.6f\n", look ? (double)s->stats.expert_hits / (double)look : 0.0);
    metric(&b, "deltafin_expert_io_wait_seconds_total", "counter", "time compute waited for expert reads");
    mf(&b, "deltafin_expert_io_wait_seconds_total %.6f\n", s->stats.io_wait_s);
    metric(&b, "deltafin_model_loaded", "gauge", "1 once the model is loaded");
    mf(&b, "deltafin_model_loaded %d\n", s->loaded == 1);
    pthread_mutex_unlock(&s->mu);
    return b.p ? b.p : strdup("");
}
