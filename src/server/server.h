/* server.h — the OpenAI-compatible HTTP server behind `deltafin serve`
 * (prefix srv_; internal to the library, used by src/cli/cmd_serve.c and
 * tests/test_server.c).
 *
 * Three files, one direction of calls (http.c -> gen.c -> api.c, and
 * http.c -> api.c; api.c calls neither of the others):
 *
 *   http.c  libmicrohttpd glue: listening socket, routes, request bodies
 *           (size limit), API key, the SSE response callback, disconnect
 *           tracking, /health, /metrics, /v1/models, error objects.
 *   gen.c   the generator thread: loads the engine, the bounded FIFO queue,
 *           the kept sessions (prefix reuse, LRU), the step loop that decodes
 *           up to `parallel` generations together (sampler,
 *           streaming detokeniser, chat parser, stop strings, cancellation),
 *           metrics; the clock and the log line (srv_now, srv_log).
 *   api.c   the byte buffer srv_buf; OpenAI request JSON -> srv_job (every
 *           field validated or refused by name) and srv_job events -> OpenAI
 *           JSON (chunks, responses).
 *
 * Threads: libmicrohttpd runs one thread per connection; one generator
 * thread owns the engine, the session, the tokenizer's use for decoding and
 * the sampler. They meet in srv_job under the server mutex: a connection
 * thread builds a job and queues it; the generator fills its output (SSE
 * bytes for streams, accumulated text otherwise) and signals the job's
 * condition variable. Nothing here prints: log lines go to opts.log.
 */
#ifndef DF_SERVER_H
#define DF_SERVER_H
#include "deltafin.h"
#include <jansson.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *model_dir;
    df_engine_opts engine;       /* copied; opened by the generator thread */
    const char *host;            /* default 127.0.0.1 */
    int port;                    /* 0: any free port (srv_port tells which) */
    int queue;                   /* waiting requests beyond the running one; past it 429 */
    int64_t max_request_bytes;   /* request bodies above it get 413 */
    int max_tokens;              /* ceiling on a request's max_tokens */
    int ctx;                     /* session context limit (0: min(model, 4096)) */
    const char *api_key;         /* NULL: no auth; else Authorization: Bearer KEY */
    const char *model_name;      /* id in /v1/models (NULL: the directory's base name) */
    int max_connections;         /* libmicrohttpd connection limit (threads) */
    int test_delay_ms;           /* testing aid: sleep after each generated token */
    int parallel;                /* generations decoded together in one step (default 1) */
    int retain;                  /* sessions kept for prefix reuse (LRU), at least parallel (0: parallel) */
    int64_t retain_bytes;        /* cap on the kept sessions' state bytes (0: no cap; parallel always fit) */
    int spec;                    /* 1: speculative decoding with spec_params */
    df_spec_params spec_params;
    void (*log)(void *ud, const char *line);
    void *log_ud;
} srv_opts;
void srv_opts_default(srv_opts *o);

typedef struct srv srv;

/* Binds the listening socket and starts the HTTP daemon and the generator
 * thread, which loads the model (/health says "loading" until then). On
 * error nothing is left running and err names the address or the cause. */
df_status srv_start(const srv_opts *o, srv **out, char err[DF_ERRMSG]);
int srv_port(const srv *s);
/* Blocks until the model is loaded (DF_OK) or failed (err says why). */
df_status srv_wait_loaded(srv *s, char err[DF_ERRMSG]);
/* Stops accepting, cancels queued and running requests, joins every
 * thread, frees everything. NULL-safe. */
void srv_stop(srv *s);

/* ---- internals shared by http.c, api.c, gen.c ---- */

enum { SRV_CHAT = 1, SRV_COMPLETION = 2 };
enum { SRV_MAX_STOP = 4 };

/* A growable byte buffer (always NUL-terminated when non-empty); api.c. */
typedef struct {
    char *p;
    size_t n, cap;
} srv_buf;
int srv_buf_add(srv_buf *b, const char *s, size_t n); /* 0 ok, -1 out of memory */
void srv_buf_free(srv_buf *b);

/* Stop strings (gen.c): text goes in, text that cannot be the start of a stop
 * string comes out; a match ends the stream (the stop string is dropped). */
typedef struct {
    const char *const *stop; /* borrowed */
    int n_stop;
    srv_buf pending;
    int hit;                 /* a stop string matched */
} srv_stopper;
/* Appends text; writes what is certain into out. Returns 1 on a match. */
int srv_stop_feed(srv_stopper *st, const char *text, size_t n, srv_buf *out);
/* End of stream: pending text is certain after all. */
void srv_stop_flush(srv_stopper *st, srv_buf *out);

typedef struct srv_job {
    /* ---- the request (api.c fills, read-only afterwards) ---- */
    int kind;                    /* SRV_CHAT, SRV_COMPLETION */
    int stream, include_usage;
    df_tokens prompt;
    df_sampler_params sp;
    int seeded;                  /* the request gave a seed */
    int ignore_eos;              /* ignore_eos (vLLM, llama.cpp): end tokens do not end the reply */
    int n_bias;
    int32_t *bias_id;
    float *bias;
    int max_tokens;              /* 0: until the context is full */
    char *stop[SRV_MAX_STOP];
    int n_stop;
    int logprobs;                /* report logprobs */
    int thinking;                /* chat: the prompt opened the think channel */
    int tools;                   /* chat: tools were declared */
    int parallel_tool_calls;     /* 0: keep only the first call */
    int echo;                    /* completions: prepend the prompt text */
    char *prompt_text;           /* completions: for echo */
    char id[48];
    char *model;
    long long created;

    /* ---- shared state (under the server mutex) ---- */
    pthread_cond_t cv;
    int refs;
    int state;                   /* SRV_QUEUED, SRV_RUNNING, SRV_DONE */
    int cancel;                  /* the client went away or the server stops */
    int fd;                      /* the client's socket, -1 once it is closed */
    srv_buf sse;                 /* stream: bytes for the client */
    size_t sse_sent;
    int http_status;             /* != 200: the job failed before any output */
    char errmsg[DF_ERRMSG];
    const char *err_type, *err_code;

    /* ---- output (written by the generator thread) ---- */
    srv_buf content, reasoning;
    json_t *tool_calls;          /* OpenAI tool_calls array */
    json_t *lp_content;          /* chat logprobs.content entries */
    json_t *lp_pending;          /* stream: entries not yet sent */
    json_t *cmp_lp;              /* completions logprobs object */
    int sent_first;              /* stream: the first chunk went out (chat: the role; completions: echo) */
    const char *finish;          /* "stop", "length", "tool_calls" */
    int prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens;
    double ttft_s;
} srv_job;

enum { SRV_QUEUED = 0, SRV_RUNNING, SRV_DONE };

/* api.c */
/* Parses and validates a request body into a new job (refs = 1). On error
 * returns NULL with *status (400/500), a message, the offending parameter
 * (may be NULL) and an error code (may be NULL). tok: the tokenizer; vocab:
 * the model's vocabulary; ceiling: the max_tokens ceiling. */
typedef struct {
    int status;
    char msg[DF_ERRMSG];
    char param[128];
    const char *code;
} srv_err;
srv_job *srv_job_from_request(int kind, const char *body, size_t n, const df_tokenizer *tok, int vocab,
                              int ceiling, int ctx, const char *model_name, srv_err *e);
void srv_job_free(srv_job *j);
/* {"error": {"message", "type", "param", "code"}} as a malloc'd string. */
char *srv_error_json(const char *msg, const char *type, const char *param, const char *code);
/* Output events (generator thread, under the server mutex). kind:
 * DF_CHAT_REASONING / DF_CHAT_CONTENT. */
void srv_out_text(srv_job *j, int kind, const char *text, size_t n);
/* call: {"name", "arguments"} from df_chat_parser. */
void srv_out_tool_call(srv_job *j, const char *call_json, size_t n);
/* One logprobs entry for a generated token. */
void srv_out_logprob(srv_job *j, const df_tokenizer *t, const df_sample *s);
void srv_out_finish(srv_job *j);
/* A failure after the stream began: an error event; before: http_status. */
void srv_out_error(srv_job *j, int status, const char *type, const char *msg);
/* The non-streaming response body (malloc'd). */
char *srv_response_json(const srv_job *j);
/* Converts a parser tool call {"name", "arguments"} into an OpenAI one with
 * the given index (arguments as a JSON string). New reference. */
json_t *srv_tool_call_openai(const char *call_json, size_t n, int index);
/* Text as a JSON string value even when it is not valid UTF-8 (bad bytes
 * become U+FFFD). */
json_t *srv_json_text(const char *s, size_t n);

/* ---- the server (http.c owns the daemon, gen.c the generator) ---- */

enum { SRV_R_CHAT, SRV_R_COMPLETIONS, SRV_R_MODELS, SRV_R_HEALTH, SRV_R_METRICS, SRV_R_OTHER, SRV_N_ROUTES };

struct MHD_Daemon;
struct srv {
    srv_opts o;                  /* strings below are the server's copies */
    char *host, *api_key, *model_name, *model_dir;
    int listen_fd, port;
    struct MHD_Daemon *d;
    pthread_mutex_t mu;          /* guards everything below except "generator-owned" */
    pthread_cond_t cv;           /* generator: work or stop; waiters: loaded */
    pthread_t gen;
    int gen_started;
    int loaded;                  /* 0 loading, 1 ready, -1 failed (load_err) */
    char lossy[64];              /* the engine's LOSSY label ("" when exact), set before loaded = 1 */
    char spine_dtype[16];        /* "int8" or the checkpoint's type, set before loaded = 1 */
    char load_err[DF_ERRMSG];
    int stopping;
    srv_job **q;                 /* FIFO ring of waiting jobs */
    int q_head, q_n, q_cap;
    srv_job **running;           /* [parallel] generations in progress (NULL: free) */
    int n_running;

    /* generator-owned (set before loaded = 1, read-only for others after) */
    df_engine *e;
    df_tokenizer *tok;
    int vocab, ctx;
    struct srv_sess *pool;       /* [pool_cap] sessions, made on first use; kept for prefix reuse */
    int n_pool, pool_cap;        /* n_pool grows under mu (/metrics reads it) */
    uint64_t clock;              /* LRU clock of the pool */
    int64_t expert_bytes;        /* one routed expert (the bytes-saved metric) */
    int32_t stop_ids[8];         /* end-of-generation tokens */
    int n_stop_ids;
    int32_t marker_ids[4];       /* K3 chat markers (-1 if absent): the only specials chat output keeps */

    /* metrics (under mu) */
    uint64_t req_count[SRV_N_ROUTES][600];
    uint64_t prompt_tokens, gen_tokens, cached_tokens, rejected, cancelled, jobs_done;
    double prefill_s, decode_s, busy_s;
    double ttft_sum[2];          /* [0] fresh prefill, [1] reused prefix */
    uint64_t ttft_n[2];
    double last_s_per_token;
    df_stats stats;              /* engine counters, copied by the generator */
    df_batch_stats bstats;       /* batched passes, copied by the generator */
    uint64_t steps, step_rows;   /* generator steps and the rows they evaluated */
    uint64_t spec_steps, spec_rows, spec_drafted, spec_accepted; /* finished requests' speculative counters */
    int spec_off;                /* speculative decoding refused by the session (say so once) */
};

/* gen.c */
df_status srv_gen_start(srv *s, char err[DF_ERRMSG]);
/* Queues a job (takes a reference). Returns 0, or 429 (queue full) / 503
 * (loading or stopping). */
int srv_enqueue(srv *s, srv_job *j);
void srv_job_unref(srv *s, srv_job *j);  /* under no lock; frees at zero */
/* Cancels every job and joins the generator thread. */
void srv_gen_stop(srv *s);
/* Frees the model, session and queue (after srv_gen_stop and once no
 * connection thread can use the tokenizer). */
void srv_gen_free(srv *s);
/* Seconds a queued request should wait before retrying (>= 1). */
int srv_retry_after(srv *s);
/* Prometheus text (malloc'd). */
char *srv_metrics_text(srv *s);
double srv_now(void);
void srv_log(srv *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#endif
