/* gen.c — the server's generator thread (prefix srv_).
 *
 * Owns: loading the model (engine, tokenizer, end-of-generation tokens), the
 * bounded FIFO of waiting jobs, the pool of kept sessions and the step loop:
 * up to srv_opts.parallel generations (slots) advance together, each step
 * one df_session_eval_batch over every slot's rows (a prompt piece of at
 * most PREFILL_STEP tokens, the pending token, or the pending token and its
 * drafts with --spec), so a new request's prefill interleaves with the
 * others' decoding; jobs join and leave at step boundaries. Per slot:
 * prefix reuse, sampling, streaming detokenisation, the K3 chat parser, stop
 * strings and tokens, cancellation (a client whose socket closed is noticed
 * before its prompt is evaluated and before every step), and the metrics.
 * Every generation's tokens and logprobs are those of running it alone
 * (the engine's batch is bit-identical per session; each slot has its own
 * session and sampler).
 * Kept sessions: a finished generation's session keeps its timeline; a new
 * prompt takes the idle session it extends the furthest, else a new one
 * (up to srv_opts.retain, within retain_bytes), else the least recently
 * used one, reset.
 * Refuses: rolling a kept session back to a shorter prefix (recurrent KDA
 * state cannot be truncated outside a speculative step: a prompt that does
 * not extend a kept timeline starts over).
 *
 * Sections: 1. helpers  2. loading  3. queue  4. the token loop (4b. kept
 *           sessions, 4c. slots)  5. the thread  6. metrics
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

/* A session of the pool: generations borrow one; between them it keeps its
 * timeline so that a prompt extending it skips that prefill. */
typedef struct srv_sess {
    df_session *s;
    df_tokens kept;              /* exactly the tokens evaluated in s */
    int logits_ok;               /* df_session_logits belongs to kept's last token (no rewind since) */
    int busy;
    uint64_t used;               /* LRU clock at its last release */
} srv_sess;

static int pool_size(srv *s);

/* Prompt rows a generation evaluates per step: what one engine pass (32
 * rows) leaves beside the decoding rows, at least PREFILL_MIN, so a new
 * request's prefill interleaves with the others' decoding. */
enum { PREFILL_STEP = 32, PREFILL_MIN = 8 };

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
    s->ctx = s->o.ctx > 0 ? s->o.ctx : (df_engine_max_context(s->e) < 4096 ? df_engine_max_context(s->e) : 4096);
    if (s->ctx > df_engine_max_context(s->e)) s->ctx = df_engine_max_context(s->e);
    s->expert_bytes = df_engine_expert_bytes(s->e);
    s->pool_cap = pool_size(s);
    s->pool = calloc((size_t)s->pool_cap, sizeof *s->pool);
    if (!s->pool) { snprintf(err, DF_ERRMSG, "out of memory"); return DF_ERR_NOMEM; }
    st = df_session_new(s->e, s->ctx, &s->pool[0].s); /* the first now: a context that does not fit fails here */
    if (st != DF_OK) {
        snprintf(err, DF_ERRMSG, "cannot allocate a session of %d positions: %s", s->ctx, df_status_name(st));
        return st;
    }
    s->n_pool = 1;
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
    else if (s->q_n >= s->o.queue + ((s->o.parallel > 0 ? s->o.parallel : 1) - s->n_running)) rc = 429;
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
    int n = (s->q_n + 1 + (s->o.parallel > 1 ? s->o.parallel - 1 : 0)) / (s->o.parallel > 0 ? s->o.parallel : 1);
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

/* ---- 4b. sessions kept for reuse ---------------------------------------------------- */


static int common_prefix(const df_tokens *a, const df_tokens *b) {
    int L = 0;
    while (L < a->n && L < b->n && a->ids[L] == b->ids[L]) L++;
    return L;
}

/* The idle session whose kept tokens the prompt extends the furthest; else
 * a new one while the pool has room; else the least recently used idle one,
 * reset. *reuse: tokens of the prompt already in it. NULL: out of memory. */
static srv_sess *pick_session(srv *s, const df_tokens *p, int *reuse) {
    srv_sess *best = NULL, *lru = NULL;
    int bestL = 0;
    for (int i = 0; i < s->n_pool; i++) {
        srv_sess *x = &s->pool[i];
        if (x->busy) continue;
        int L = common_prefix(&x->kept, p);
        int ok = L == x->kept.n && L > 0 && (L < p->n || (df_session_pos(x->s) == L && x->logits_ok));
        if (ok && L > bestL) { best = x; bestL = L; }
        if (!lru || x->used < lru->used) lru = x;
    }
    if (best) { *reuse = bestL; return best; }
    *reuse = 0;
    if (s->n_pool < s->pool_cap) {
        srv_sess *x = &s->pool[s->n_pool];
        memset(x, 0, sizeof *x);
        if (df_session_new(s->e, s->ctx, &x->s) != DF_OK) return lru ? (df_session_reset(lru->s), lru->kept.n = 0, lru) : NULL;
        pthread_mutex_lock(&s->mu); /* /metrics reads the pool's size */
        s->n_pool++;
        pthread_mutex_unlock(&s->mu);
        return x;
    }
    if (lru) { df_session_reset(lru->s); lru->kept.n = 0; }
    return lru;
}

/* ---- 4c. one generation: its slot ----------------------------------------------------- */

typedef struct {
    srv_job *j;
    srv_sess *ss;
    df_sampler *smp;
    df_detok *dt;
    df_chat_parser *cp;
    df_spec *spec;               /* speculative decoding (srv_opts.spec), NULL: one token per step */
    loop_ctx c;
    int prefilled;               /* prompt tokens in the session */
    int reused;
    int decoding;                /* the prompt is in: tokens are generated */
    int32_t pending;             /* plain decoding: the last token sampled, evaluated next step */
    int has_pending;
    int limit;
    df_tokens gen;               /* tokens returned so far (spec: what the session settles to) */
    int spec_drop;               /* spec: returned tokens past the end (settled away) */
    const char *finish;          /* "stop" / "length" once ended normally */
    int ended;
    double t0, t_prefill, t_dec;
    int take;                    /* this step's prompt rows (prefill) */
} slot;

static void slot_error(srv *s, slot *q, int status, const char *type, const char *msg) {
    pthread_mutex_lock(&s->mu);
    srv_out_error(q->j, status, type, msg);
    pthread_mutex_unlock(&s->mu);
    q->ended = 1;
    q->finish = NULL;
}

/* A job taken from the queue: a session, its prefix reuse, the sampler and
 * the decoders. 0 when it ended already (cancelled, out of memory). */
static int slot_start(srv *s, slot *q) {
    srv_job *j = q->j;
    char err[DF_ERRMSG];
    q->t0 = srv_now();
    for (int k = 1; k <= 2; k++) {
        q->c.stop[k].stop = (const char *const *)j->stop;
        q->c.stop[k].n_stop = j->n_stop;
    }
    q->c.s = s;
    q->c.j = j;
    /* a client that left while its request waited costs no prefill */
    pthread_mutex_lock(&s->mu);
    int left = client_gone(j);
    if (left)
        srv_log(s, "%s: cancelled before its prompt of %d tokens was evaluated (the client went away)", j->id, j->prompt.n);
    pthread_mutex_unlock(&s->mu);
    if (left) { q->ended = 1; return 0; }
    int reuse = 0;
    q->ss = pick_session(s, &j->prompt, &reuse);
    if (!q->ss) { slot_error(s, q, 500, "server_error", "out of memory (no session)"); return 0; }
    q->ss->busy = 1;
    q->prefilled = q->reused = reuse;
    if (df_sampler_new(&j->sp, s->vocab, &q->smp, err) != DF_OK ||
        df_detok_new(s->tok, j->kind == SRV_COMPLETION, &q->dt) != DF_OK ||
        (j->kind == SRV_CHAT && df_chat_parser_new(j->thinking, on_chat, &q->c, &q->cp) != DF_OK)) {
        slot_error(s, q, 500, "server_error", "out of memory");
        return 0;
    }
    /* an empty feed gives the parser its buffer: df_chat_parser_finish on a
     * parser that never saw text passes NULL to memmem (src/text/chat.c) */
    if (q->cp) df_chat_parser_feed(q->cp, "", 0);
    for (int i = 0; i < j->n_bias; i++) df_sampler_set_bias(q->smp, j->bias_id[i], j->bias[i]);
    if (s->o.spec && !s->spec_off && df_spec_new(q->ss->s, q->smp, &s->o.spec_params, &q->spec, err) != DF_OK) {
        s->spec_off = 1;
        srv_log(s, "speculative decoding is off: %s", err);
    }
    pthread_mutex_lock(&s->mu);
    j->prompt_tokens = j->prompt.n;
    j->cached_tokens = reuse;
    pthread_mutex_unlock(&s->mu);
    q->limit = j->max_tokens > 0 ? j->max_tokens : s->ctx;
    return 1;
}

/* One generated token through the stop tokens, the decoder, the chat parser
 * and the stop strings to the job. 1 when the generation ends with it. */
static int slot_token(srv *s, slot *q, int32_t tok, const df_sample *info) {
    srv_job *j = q->j;
    pthread_mutex_lock(&s->mu);
    if (!j->completion_tokens) j->ttft_s = srv_now() - q->t0;
    j->completion_tokens++;
    if (j->logprobs) srv_out_logprob(j, s->tok, info);
    pthread_mutex_unlock(&s->mu);
    /* ignore_eos: an end token neither ends the reply nor shows as text */
    int end = is_stop_id(s, tok);
    if (end && !j->ignore_eos) { q->finish = "stop"; return 1; }
    const char *text;
    size_t tn;
    /* chat: a special token that is not a chat marker is not text */
    int hidden = end || (q->cp && df_tokenizer_is_special(s->tok, tok) && !is_marker(s, tok));
    if (!hidden && df_detok_push(q->dt, tok, &text, &tn) == DF_OK && tn) {
        pthread_mutex_lock(&s->mu);
        if (q->cp) {
            if (df_chat_parser_feed(q->cp, text, tn) != DF_OK) q->c.stopped = 1;
        } else channel_text(&q->c, DF_CHAT_CONTENT, text, tn);
        pthread_mutex_unlock(&s->mu);
    }
    if (q->cp && j->thinking) {
        /* tokens before the reasoning channel closes count as reasoning */
        pthread_mutex_lock(&s->mu);
        if (!j->content.n && !j->tool_calls && !df_chat_parser_done(q->cp)) j->reasoning_tokens++;
        pthread_mutex_unlock(&s->mu);
    }
    /* ignore_eos: a closed chat message takes no more text, and generation runs on to the limit */
    if (q->c.stopped || (q->cp && !j->ignore_eos && df_chat_parser_done(q->cp))) { q->finish = "stop"; return 1; }
    if (j->completion_tokens >= q->limit) { q->finish = "length"; return 1; }
    return 0;
}

/* Tokens a step returned (spec: several; plain: one), in order. */
static void slot_tokens(srv *s, slot *q, const int32_t *toks, const df_sample *info, int k) {
    for (int i = 0; i < k; i++) {
        df_tokens_push(&q->gen, toks[i]);
        if (slot_token(s, q, toks[i], info + i)) {
            q->ended = 1;
            q->spec_drop = k - i; /* this one (never evaluated when plain) and those after it */
            return;
        }
    }
    if (!q->spec) { q->pending = toks[k - 1]; q->has_pending = 1; }
}

/* This step's rows for the slot (prefill piece, pending token, or the
 * pending token + drafts); 0 rows with *ready = 1: sample without one. */
static int slot_item(srv *s, slot *q, df_batch_item *it, int *ready, int room) {
    *ready = 0;
    const df_tokens *p = &q->j->prompt;
    if (!q->decoding && q->prefilled < p->n) {
        int step = room > PREFILL_MIN ? room : PREFILL_MIN; /* what the decoders' pass leaves */
        q->take = p->n - q->prefilled < step ? p->n - q->prefilled : step;
        *it = (df_batch_item){q->ss->s, p->ids + q->prefilled, q->take, NULL};
        return 1;
    }
    if (!q->decoding) { /* the whole prompt was kept: the first token comes from the kept logits */
        q->decoding = 1;
        q->t_prefill = srv_now() - q->t0;
        q->t_dec = srv_now();
        if (q->spec) { df_spec_reset(q->spec); df_spec_context(q->spec, p->ids, p->n); }
    }
    pthread_mutex_lock(&s->mu);
    int gone = client_gone(q->j);
    pthread_mutex_unlock(&s->mu);
    if (gone) { q->ended = 1; q->finish = NULL; q->spec_drop = q->gen.n > 0; return 0; }
    if (q->spec) {
        const int32_t *toks;
        float *rows;
        int n;
        df_status st = df_spec_begin(q->spec, q->limit - q->j->completion_tokens, &toks, &n, &rows);
        if (st == DF_ERR_CONTEXT) { q->ended = 1; q->finish = "length"; q->spec_drop = q->gen.n > 0; return 0; }
        if (st != DF_OK) { q->spec_drop = q->gen.n > 0; slot_error(s, q, 500, "server_error", df_session_error(q->ss->s)); return 0; }
        if (!n) { *ready = 1; return 0; }
        *it = (df_batch_item){q->ss->s, toks, n, rows};
        return 1;
    }
    if (!q->has_pending) { *ready = 1; return 0; }
    if (df_session_pos(q->ss->s) >= s->ctx) { q->ended = 1; q->finish = "length"; return 0; }
    *it = (df_batch_item){q->ss->s, &q->pending, 1, NULL};
    return 1;
}

/* After the step's evaluation (or without one when ready): the new tokens. */
static void slot_after(srv *s, slot *q, int evaluated) {
    const df_tokens *p = &q->j->prompt;
    if (!q->decoding) {
        for (int i = q->prefilled; i < q->prefilled + q->take; i++) df_tokens_push(&q->ss->kept, p->ids[i]);
        q->prefilled += q->take;
        q->ss->logits_ok = 1;
        if (q->prefilled < p->n) return;
        q->decoding = 1;
        q->t_prefill = srv_now() - q->t0;
        q->t_dec = srv_now();
        if (q->spec) { df_spec_reset(q->spec); df_spec_context(q->spec, p->ids, p->n); }
        /* the first token now, from the prompt's last logits */
        if (q->spec) {
            const int32_t *toks;
            float *rows;
            int n;
            df_spec_begin(q->spec, 1, &toks, &n, &rows); /* the first step needs no evaluation */
        }
        evaluated = 0;
    }
    df_sample info[DF_SPEC_MAX + 1];
    int32_t toks[DF_SPEC_MAX + 1];
    if (q->spec) {
        int k;
        df_status st = df_spec_end(q->spec, toks, info, &k);
        if (st != DF_OK) { q->spec_drop = 0; slot_error(s, q, 500, "server_error", df_session_error(q->ss->s)); return; }
        slot_tokens(s, q, toks, info, k);
        return;
    }
    if (evaluated) { df_tokens_push(&q->ss->kept, q->pending); q->has_pending = 0; q->ss->logits_ok = 1; }
    toks[0] = df_sampler_sample(q->smp, df_session_logits(q->ss->s), &info[0]);
    df_sampler_accept(q->smp, toks[0]);
    slot_tokens(s, q, toks, info, 1);
}

/* The generation is over: the last output, the metrics, the session back to
 * the pool holding exactly its kept tokens. */
static void slot_end(srv *s, slot *q, int idx) {
    srv_job *j = q->j;
    if (q->spec && q->ss) {
        /* the session holds the prompt and what was shown, less the last token (as without drafts) */
        int drop = q->spec_drop;
        df_spec_stats st;
        df_spec_get_stats(q->spec, &st);
        if (q->decoding && df_spec_settle(q->spec, drop) == DF_OK) {
            int pos = df_session_pos(q->ss->s);
            q->ss->kept.n = j->prompt.n;
            for (int i = 0; i < pos - j->prompt.n && i < q->gen.n; i++) df_tokens_push(&q->ss->kept, q->gen.ids[i]);
            if (q->ss->kept.n != pos) { df_session_reset(q->ss->s); q->ss->kept.n = 0; }
        } else if (q->decoding) {
            df_session_reset(q->ss->s);
            q->ss->kept.n = 0;
        }
        q->ss->logits_ok = 0; /* a rewind leaves the logits of a later position */
        pthread_mutex_lock(&s->mu);
        s->spec_steps += st.steps;
        s->spec_rows += st.rows;
        s->spec_drafted += st.drafted;
        s->spec_accepted += st.accepted;
        pthread_mutex_unlock(&s->mu);
    }
    if (q->ss && q->ss->kept.n != df_session_pos(q->ss->s)) { /* an error reset it */
        df_session_reset(q->ss->s);
        q->ss->kept.n = 0;
    }
    pthread_mutex_lock(&s->mu);
    int cancelled = !q->finish && !j->errmsg[0];
    if (q->finish) {
        const char *text;
        size_t tn;
        df_detok_flush(q->dt, &text, &tn);
        if (q->cp) {
            if (tn) df_chat_parser_feed(q->cp, text, tn);
            df_chat_parser_finish(q->cp);
        } else if (tn) channel_text(&q->c, DF_CHAT_CONTENT, text, tn);
        for (int k = 1; k <= 2; k++) {
            q->c.tmp.n = 0;
            srv_stop_flush(&q->c.stop[k], &q->c.tmp);
            if (q->c.tmp.n) srv_out_text(j, k, q->c.tmp.p, q->c.tmp.n);
        }
        j->finish = j->tool_calls && strcmp(q->finish, "length") ? "tool_calls" : q->finish;
        srv_out_finish(j);
    } else if (cancelled) {
        s->cancelled++;
    }
    double now = srv_now();
    if (q->ss) {
        srv_log(s, "%s: prompt %d tokens (%d reused), %d generated, first token %.3f s, %.1f tokens/s, %s", j->id,
                j->prompt.n, q->reused, j->completion_tokens, j->ttft_s,
                j->completion_tokens > 1 ? (j->completion_tokens - 1) / (now - q->t_dec + 1e-9) : 0.0,
                j->finish ? j->finish : cancelled ? "cancelled (the client went away)" : j->errmsg);
        s->prompt_tokens += (uint64_t)(j->prompt.n - q->reused);
        s->cached_tokens += (uint64_t)q->reused;
        s->gen_tokens += (uint64_t)j->completion_tokens;
        s->prefill_s += q->t_prefill;
        if (q->decoding) s->decode_s += now - q->t_dec;
        if (j->completion_tokens) {
            s->ttft_sum[q->reused > 0] += j->ttft_s;
            s->ttft_n[q->reused > 0]++;
            s->last_s_per_token = (now - q->t_dec) / j->completion_tokens;
        }
    } else if (cancelled) {
        /* counted above */
    }
    s->busy_s += now - q->t0;
    s->jobs_done++;
    /* leaves the running set in the same step as its counters change */
    j->state = SRV_DONE;
    s->running[idx] = NULL;
    s->n_running--;
    df_engine_stats(s->e, &s->stats);
    df_engine_batch_stats(s->e, &s->bstats);
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&s->mu);
    df_spec_free(q->spec);
    df_chat_parser_free(q->cp);
    df_detok_free(q->dt);
    df_sampler_free(q->smp);
    df_tokens_free(&q->gen);
    for (int k = 1; k <= 2; k++) srv_buf_free(&q->c.stop[k].pending);
    srv_buf_free(&q->c.tmp);
    if (q->ss) {
        q->ss->busy = 0;
        q->ss->used = ++s->clock;
    }
}

/* ---- 5. the thread ----------------------------------------------------------------- */

/* Retained sessions: at least `parallel`, at most `retain`, and their state
 * within retain_bytes when that is set. */
static int pool_size(srv *s) {
    int par = s->o.parallel > 0 ? s->o.parallel : 1;
    int cap = s->o.retain > par ? s->o.retain : par;
    if (s->o.retain_bytes > 0) {
        int64_t one = df_engine_session_bytes(s->e, s->ctx);
        int64_t fit = one > 0 ? s->o.retain_bytes / one : cap;
        if (fit < cap) cap = fit < par ? par : (int)fit;
    }
    return cap;
}

static void *gen_main(void *arg) {
    srv *s = arg;
    char err[DF_ERRMSG];
    double t0 = srv_now();
    df_status st = load(s, err);
    int par = s->o.parallel > 0 ? s->o.parallel : 1;
    slot *sl = NULL;
    df_batch_item *items = NULL;
    int *who = NULL;
    if (st == DF_OK) {
        sl = calloc((size_t)par, sizeof *sl);
        items = calloc((size_t)par, sizeof *items);
        who = calloc((size_t)par, sizeof *who);
        if (!sl || !items || !who) { st = DF_ERR_NOMEM; snprintf(err, DF_ERRMSG, "out of memory"); }
    }
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
    if (st != DF_OK) { free(sl); free(items); free(who); return NULL; }
    srv_log(s, "model loaded in %.2f s: %s; %d generation%s at once, %d session%s kept%s", srv_now() - t0,
            df_tokenizer_describe(s->tok), par, par == 1 ? "" : "s", s->pool_cap, s->pool_cap == 1 ? "" : "s",
            s->o.spec ? ", speculative decoding (n-gram)" : "");
    for (;;) {
        /* admit waiting jobs into free slots */
        int fresh[par > 0 ? par : 1], nfresh = 0;
        pthread_mutex_lock(&s->mu);
        while (!s->stopping && !s->q_n && !s->n_running) pthread_cond_wait(&s->cv, &s->mu);
        int stopping = s->stopping;
        while (!stopping && s->q_n && s->n_running < par) {
            srv_job *j = s->q[s->q_head];
            s->q_head = (s->q_head + 1) % s->q_cap;
            s->q_n--;
            int k = 0;
            while (s->running[k]) k++;
            s->running[k] = j;
            s->n_running++;
            j->state = SRV_RUNNING;
            memset(&sl[k], 0, sizeof sl[k]);
            sl[k].j = j;
            fresh[nfresh++] = k;
        }
        if (stopping)
            for (int k = 0; k < par; k++)
                if (s->running[k]) s->running[k]->cancel = 1;
        pthread_mutex_unlock(&s->mu);
        for (int f = 0; f < nfresh; f++) slot_start(s, &sl[fresh[f]]);
        /* one step: every running generation's rows together */
        int n = 0, ready[par > 0 ? par : 1], decoded = 0;
        int used = 0;
        for (int pass = 0; pass < 2; pass++) /* decoding rows first; prompt pieces fill the room left */
            for (int k = 0; k < par; k++) {
                if (!pass) ready[k] = 0;
                if (!sl[k].j || sl[k].ended) continue;
                int prefill = !sl[k].decoding && sl[k].prefilled < sl[k].j->prompt.n;
                if (prefill != pass) continue;
                if (stopping) { sl[k].ended = 1; sl[k].spec_drop = sl[k].gen.n > 0; continue; }
                if (slot_item(s, &sl[k], &items[n], &ready[k], PREFILL_STEP - used)) {
                    used += items[n].n;
                    who[n++] = k;
                }
            }
        if (n) {
            df_status est = df_session_eval_batch(items, n);
            if (est != DF_OK) {
                for (int i = 0; i < n; i++) {
                    slot *q = &sl[who[i]];
                    q->ss->kept.n = df_session_pos(q->ss->s) ? q->ss->kept.n : 0;
                    q->spec_drop = 0;
                    slot_error(s, q, est == DF_ERR_CONTEXT ? 400 : 500,
                               est == DF_ERR_CONTEXT ? "invalid_request_error" : "server_error",
                               df_session_error(items[i].s));
                }
            } else {
                int rows = 0;
                for (int i = 0; i < n; i++) {
                    rows += items[i].n;
                    decoded |= sl[who[i]].decoding;
                    slot_after(s, &sl[who[i]], 1);
                }
                pthread_mutex_lock(&s->mu);
                s->steps++;
                s->step_rows += (uint64_t)rows;
                pthread_mutex_unlock(&s->mu);
            }
        }
        for (int k = 0; k < par; k++)
            if (ready[k] && !sl[k].ended) { slot_after(s, &sl[k], 0); decoded = 1; }
        /* finished generations leave; their slots take new jobs next step */
        for (int k = 0; k < par; k++) {
            if (!sl[k].j || !sl[k].ended) continue;
            srv_job *j = sl[k].j;
            slot_end(s, &sl[k], k);
            srv_job_unref(s, j);
            memset(&sl[k], 0, sizeof sl[k]);
        }
        pthread_mutex_lock(&s->mu);
        df_engine_batch_stats(s->e, &s->bstats);
        int idle = stopping && !s->n_running;
        pthread_mutex_unlock(&s->mu);
        if (idle) break;
        if (decoded && s->o.test_delay_ms > 0) usleep((useconds_t)s->o.test_delay_ms * 1000);
    }
    free(sl);
    free(items);
    free(who);
    return NULL;
}

df_status srv_gen_start(srv *s, char err[DF_ERRMSG]) {
    int par = s->o.parallel > 0 ? s->o.parallel : 1;
    s->q_cap = s->o.queue + par + 1;
    s->q = calloc((size_t)s->q_cap, sizeof *s->q);
    s->running = calloc((size_t)par, sizeof *s->running);
    if (!s->q || !s->running) { snprintf(err, DF_ERRMSG, "out of memory"); return DF_ERR_NOMEM; }
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
    int par = s->o.parallel > 0 ? s->o.parallel : 1;
    for (int k = 0; s->running && k < par; k++)
        if (s->running[k]) s->running[k]->cancel = 1;
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
    for (int i = 0; i < s->n_pool; i++) {
        df_session_free(s->pool[i].s);
        df_tokens_free(&s->pool[i].kept);
    }
    free(s->pool);
    s->pool = NULL;
    s->n_pool = 0;
    df_tokenizer_free(s->tok);
    s->tok = NULL;
    df_engine_close(s->e);
    s->e = NULL;
    free(s->q);
    s->q = NULL;
    free(s->running);
    s->running = NULL;
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

/* A metric with one sample: metric's lines, then "name value" (an integer,
 * a count, or a number with prec decimals). */
static void metric_d(srv_buf *b, const char *name, const char *type, const char *help, int v) {
    metric(b, name, type, help);
    mf(b, "%s %d\n", name, v);
}

static void metric_u(srv_buf *b, const char *name, const char *type, const char *help, unsigned long long v) {
    metric(b, name, type, help);
    mf(b, "%s %llu\n", name, v);
}

static void metric_f(srv_buf *b, const char *name, const char *type, const char *help, int prec, double v) {
    metric(b, name, type, help);
    mf(b, "%s %.*f\n", name, prec, v);
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
    metric_u(&b, "deltafin_prompt_tokens_total", "counter", "prompt tokens evaluated (prefilled)",
             (unsigned long long)s->prompt_tokens);
    metric_u(&b, "deltafin_prompt_tokens_reused_total", "counter",
             "prompt tokens served from the kept session (prefix reuse)", (unsigned long long)s->cached_tokens);
    metric_u(&b, "deltafin_generation_tokens_total", "counter", "tokens generated", (unsigned long long)s->gen_tokens);
    metric_f(&b, "deltafin_prefill_seconds_total", "counter", "time spent evaluating prompts", 6, s->prefill_s);
    metric_f(&b, "deltafin_decode_seconds_total", "counter", "time spent generating", 6, s->decode_s);
    metric_f(&b, "deltafin_seconds_per_token", "gauge", "decode seconds per generated token of the last request", 6,
             s->last_s_per_token);
    metric(&b, "deltafin_time_to_first_token_seconds", "summary", "time from the start of a generation to its first token");
    for (int k = 0; k < 2; k++) {
        mf(&b, "deltafin_time_to_first_token_seconds_sum{prefix_reused=\"%s\"} %.6f\n", k ? "yes" : "no", s->ttft_sum[k]);
        mf(&b, "deltafin_time_to_first_token_seconds_count{prefix_reused=\"%s\"} %llu\n", k ? "yes" : "no",
           (unsigned long long)s->ttft_n[k]);
    }
    metric_d(&b, "deltafin_queue_depth", "gauge", "requests waiting for the generator", s->q_n);
    metric_d(&b, "deltafin_queue_capacity", "gauge", "waiting requests accepted before 429", s->o.queue);
    metric_d(&b, "deltafin_generating", "gauge", "generations running now (at most --parallel)", s->n_running);
    metric_d(&b, "deltafin_parallel", "gauge", "generations decoded together at most (--parallel)",
             s->o.parallel > 0 ? s->o.parallel : 1);
    metric_u(&b, "deltafin_steps_total", "counter",
             "generator steps (one batched evaluation of every running generation's rows)",
             (unsigned long long)s->steps);
    metric_u(&b, "deltafin_step_rows_total", "counter", "rows those steps evaluated (prompt pieces, tokens, drafts)",
             (unsigned long long)s->step_rows);
    metric_f(&b, "deltafin_rows_per_step", "gauge", "rows per generator step, on average", 4,
             s->steps ? (double)s->step_rows / (double)s->steps : 0.0);
    metric_u(&b, "deltafin_passes_total", "counter", "engine forward passes (at most 32 rows each)",
             (unsigned long long)s->bstats.passes);
    metric_u(&b, "deltafin_passes_shared_total", "counter", "passes with rows of more than one generation",
             (unsigned long long)s->bstats.multi_passes);
    metric_u(&b, "deltafin_expert_union_total", "counter",
             "routed experts the passes ran (the union of their rows' choices), summed over MoE layers",
             (unsigned long long)s->bstats.union_experts);
    metric_u(&b, "deltafin_expert_solo_total", "counter",
             "routed experts the generations would have run each alone, summed",
             (unsigned long long)s->bstats.solo_experts);
    metric_f(&b, "deltafin_expert_union_per_pass", "gauge", "routed experts per pass and MoE layer, on average", 4,
             s->bstats.passes && s->e ? (double)s->bstats.union_experts / (double)s->bstats.passes / (double)(df_engine_moe_layers(s->e) ? df_engine_moe_layers(s->e) : 1) : 0.0);
    metric_u(&b, "deltafin_expert_bytes_saved_total", "counter",
             "expert bytes shared steps did not read or stream again (solo - union) x expert size",
             (unsigned long long)((s->bstats.solo_experts - s->bstats.union_experts) * (uint64_t)(s->expert_bytes > 0 ? s->expert_bytes : 0)));
    metric_d(&b, "deltafin_sessions_kept", "gauge", "sessions in the pool (prefix reuse), and its capacity", s->n_pool);
    mf(&b, "deltafin_sessions_capacity %d\n", s->pool_cap);
    if (s->o.spec) {
        metric_u(&b, "deltafin_spec_drafted_total", "counter", "speculative draft tokens proposed (finished requests)",
                 (unsigned long long)s->spec_drafted);
        metric_u(&b, "deltafin_spec_accepted_total", "counter", "draft tokens accepted",
                 (unsigned long long)s->spec_accepted);
        metric_f(&b, "deltafin_spec_rows_per_step", "gauge", "rows per speculative step (1 + drafts)", 4,
                 s->spec_steps ? (double)s->spec_rows / (double)s->spec_steps : 0.0);
    }
    metric_u(&b, "deltafin_requests_rejected_total", "counter", "requests refused with 429 (queue full)",
             (unsigned long long)s->rejected);
    metric_u(&b, "deltafin_requests_cancelled_total", "counter", "generations stopped because the client went away",
             (unsigned long long)s->cancelled);
    metric_u(&b, "deltafin_expert_bytes_read_total", "counter", "routed expert bytes read from disk",
             (unsigned long long)s->stats.bytes_read);
    metric_u(&b, "deltafin_spine_bytes_read_total", "counter", "non-expert bytes read from disk by a streamed spine",
             (unsigned long long)s->stats.spine_bytes_read);
    if (s->loaded == 1) {
        metric(&b, "deltafin_spine_info", "gauge", "the spine's matrices in use (dtype) and the lossy settings (\"\" when exact)");
        mf(&b, "deltafin_spine_info{dtype=\"%s\",lossy=\"%s\"} 1\n", s->spine_dtype, s->lossy);
    }
    /* prefetched experts were read for the step: misses, not hits */
    uint64_t look = s->stats.expert_hits + s->stats.expert_misses + s->stats.prefetch_used;
    metric_f(&b, "deltafin_expert_cache_hit_ratio", "gauge", "experts found in RAM without a read / experts used", 6,
             look ? (double)s->stats.expert_hits / (double)look : 0.0);
    metric_f(&b, "deltafin_expert_io_wait_seconds_total", "counter", "time compute waited for expert reads", 6,
             s->stats.io_wait_s);
    metric_d(&b, "deltafin_model_loaded", "gauge", "1 once the model is loaded", s->loaded == 1);
    pthread_mutex_unlock(&s->mu);
    return b.p ? b.p : strdup("");
}
