/* hub.h — installing models from a Hugging Face-compatible hub (prefix hub_).
 *
 * Three layers:
 *   http.c    the hub client on libcurl: list a repository at a revision
 *             (model info, or the tree API's pages when it gives no sizes),
 *             download a whole file (resume, sha256, atomic rename), read
 *             one byte range; bounded retries with backoff; hub errors
 *             (401, 403 gated, 404) named by repo and file.
 *   spans.c   a set of present byte spans of one file and its crash-safe
 *             log on disk (append-only records, each checked; a torn tail
 *             is ignored), plus sha256.
 *   the mirror: a local mirror of a repository in a model directory, full
 *             or stream mode, in five files (mirror.h, their shared header,
 *             says who owns what):
 *     manifest.c  the manifest (with the cache limit and the last measured
 *                 rate);
 *     mirror.c    an open mirror: shards, their span logs, the fetch
 *                 protocol;
 *     cache.c     the cache limit (LRU eviction by hole punching);
 *     setup.c     setup, filling gaps, warming, the offline check;
 *     stream.c    the stream-mode df_io table that fetches missing spans of
 *                 a shard on first read.
 *   warm.c    ranking experts from router traces or heat statistics.
 *
 * Mirror layout (DIR is an ordinary model directory; the safetensors reader
 * needs nothing else):
 *
 *   DIR/config.json, tokenizer files, *.safetensors.index.json   whole files
 *   DIR/model-0000k-of-0000n.safetensors    full: whole file; stream: a sparse
 *                                           file of the remote size, bytes at
 *                                           the remote offsets, holes elsewhere
 *   DIR/.deltafin-hub/manifest.json         endpoint, repo, commit, mode, files
 *   DIR/.deltafin-hub/spans/NAME.spans      stream: present spans of shard NAME
 *   DIR/.deltafin-hub/access                stream: last use of each routed expert
 *                                           (a hint for --cache-limit eviction)
 *
 * Crash safety of a fetched span: the bytes are written at their offset and
 * fdatasync'd before the span's record is appended to the log (and the log
 * fdatasync'd). A crash at any moment leaves every recorded span on disk; a
 * span written but not recorded is fetched again.
 */
#ifndef DF_HUB_H
#define DF_HUB_H
#include "deltafin.h"
#include "../base/io.h"
#include <nettle/sha1.h>
#include <nettle/sha2.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* ---- sha256 (spans.c) ---- */
typedef struct { struct sha256_ctx ctx; } hub_sha256; /* nettle's state */
void hub_sha256_init(hub_sha256 *c);
void hub_sha256_update(hub_sha256 *c, const void *p, size_t n);
void hub_sha256_hex(hub_sha256 *c, char hex[65]); /* finishes c */
/* sha256 of a file's bytes [0, len) as hex; 0, or -1 with errno. */
int hub_sha256_file(const char *path, int64_t len, char hex[65]);

/* Git's blob id (sha1 of "blob <size>\0" + bytes): the hub's check for files
 * not stored in LFS. */
typedef struct { struct sha1_ctx ctx; } hub_sha1;
void hub_sha1_init(hub_sha1 *c);
void hub_sha1_update(hub_sha1 *c, const void *p, size_t n);
void hub_sha1_hex(hub_sha1 *c, char hex[41]); /* finishes c */
void hub_git_blob_init(hub_sha1 *c, int64_t size); /* sha1 primed with the blob header */

/* ---- span sets and their log (spans.c) ---- */
typedef struct { int64_t a, b; } hub_span; /* [a, b) */

typedef struct {
    hub_span *v;         /* sorted, disjoint, never adjacent (merged) */
    int n, cap;
} hub_spans;

void hub_spans_free(hub_spans *s);
int hub_spans_add(hub_spans *s, int64_t a, int64_t b);          /* 0, or -1 (no memory) */
void hub_spans_remove(hub_spans *s, int64_t a, int64_t b);      /* never allocates more than one */
int hub_spans_covers(const hub_spans *s, int64_t a, int64_t b); /* [a, b) all present */
int hub_spans_overlaps(const hub_spans *s, int64_t a, int64_t b);
/* Appends the parts of [a, b) not in s to out. 0, or -1 (no memory). */
int hub_spans_missing(const hub_spans *s, int64_t a, int64_t b, hub_spans *out);
int64_t hub_spans_bytes(const hub_spans *s);

/* The on-disk log: a 16-byte header ("DFSPANS1" + file size) then 24-byte
 * records {start, end, check}. hub_log_open loads every valid record (a torn
 * or foreign tail ends the log: it is truncated away) and compacts a long log
 * (temp file, fsync, rename). */
typedef struct {
    int fd;
    char *path;
    int64_t file_size;   /* size of the shard it describes */
    int records;
} hub_log;
df_status hub_log_open(const char *path, int64_t file_size, hub_spans *present, hub_log *log,
                       char *err);
/* Appends [a, b) and fdatasyncs the log. The caller made the bytes durable. */
df_status hub_log_append(hub_log *log, int64_t a, int64_t b, char *err);
/* Appends "[a, b) is gone" and fdatasyncs the log: called BEFORE the bytes
 * are punched out, so a crash never leaves a hole recorded present. */
df_status hub_log_remove(hub_log *log, int64_t a, int64_t b, char *err);
void hub_log_close(hub_log *log);
/* Reads the spans recorded in a log without opening it for writing
 * (doctor, tests). A missing log is an empty set. */
df_status hub_log_read(const char *path, hub_spans *present, int64_t *file_size, char *err);

/* ---- the hub client (http.c) ---- */
typedef struct {
    int64_t done, total;  /* bytes of this file */
    double rate;          /* bytes/s since the transfer started */
    const char *file;
    int finished;         /* 1 on the last call for this file */
    int attempt;          /* 1-based */
} hub_progress;
typedef void (*hub_progress_fn)(void *ctx, const hub_progress *p);

typedef struct {
    const char *endpoint; /* e.g. https://huggingface.co (no trailing slash needed) */
    const char *token;    /* NULL: anonymous */
    int retries;          /* further attempts after a failure (default 5) */
    int retry_ms;         /* first backoff, doubled per attempt, capped at 30 s (default 500) */
    int timeout_s;        /* a transfer below 1 byte/s for this long fails (default 60) */
    hub_progress_fn progress;
    void *progress_ctx;
} hub_client;

typedef struct {
    char *path;           /* repo-relative name */
    int64_t size;
    char sha256[65];      /* LFS oid; "" for plain git files */
    char git[41];         /* git blob id of a plain file; "" if unknown */
} hub_file;

typedef struct {
    char *commit;         /* the revision's commit sha */
    hub_file *files;
    int n_files;
} hub_listing;
void hub_listing_free(hub_listing *l);

/* GET {endpoint}/api/models/{repo}/revision/{rev}?blobs=true; when that
 * leaves sizes out, GET {endpoint}/api/models/{repo}/tree/{commit}?recursive=true,
 * following Link: <URL>; rel="next" pages on the endpoint's host. Every file
 * of the result has a size; on error *out is empty. */
df_status hub_list(const hub_client *c, const char *repo, const char *rev, hub_listing *out,
                   char *err);
/* The parsing inside hub_list (tests, fuzzers). hub_parse_info: a model
 * info body into *out (sizes it does not give are -1; names with "..", a
 * leading '/' or listed twice are refused); on error *out holds what was
 * parsed, for hub_listing_free. hub_parse_tree: one tree page (a JSON array
 * of {"type", "path", "size", "oid", "lfs"}) fills the size and checks of
 * the files of l that have no size yet; it adds no files. hub_link_next:
 * the target of the first rel="next" link of a Link header value v[0..n)
 * into out: 1, 0 if none, -1 if it needs more than cap bytes or holds a
 * space or control byte. */
df_status hub_parse_info(const char *body, size_t n, const char *what, hub_listing *out, char *err);
df_status hub_parse_tree(const char *body, size_t n, const char *what, hub_listing *l, char *err);
int hub_link_next(const char *v, size_t n, char *out, size_t cap);
/* {endpoint}/{repo}/resolve/{rev}/{path}, malloc'd. */
char *hub_resolve_url(const hub_client *c, const char *repo, const char *rev, const char *path);

/* Downloads f to dest: bytes go to dest.part (resumed with Range if it
 * exists), are checked against f->sha256 (or the size), fsync'd and renamed
 * onto dest. On error dest is untouched and dest.part keeps what arrived
 * intact (a corrupt download is deleted). *fetched counts bytes received. */
df_status hub_download(const hub_client *c, const char *repo, const char *rev, const hub_file *f,
                       const char *dest, int64_t *fetched, char *err);

/* One connection (a curl easy handle, kept for keep-alive reuse). */
typedef struct hub_conn hub_conn;
hub_conn *hub_conn_new(void);
void hub_conn_free(hub_conn *h);
/* Reads bytes [off, off + len) of url into buf with a Range request; the
 * whole range or an error (retried as above). etag: if non-NULL and the
 * server names the file's sha256 in ETag / X-Linked-Etag, they must match. */
df_status hub_get_range(hub_conn *h, const hub_client *c, const char *url, const char *what,
                        int64_t off, int64_t len, void *buf, const char *etag, char *err);

/* ---- mirrors (setup.c) ---- */
typedef enum { HUB_AUTO = 0, HUB_FULL, HUB_STREAM } hub_mode;

typedef struct {
    hub_client client;
    const char *repo;
    const char *revision;  /* default "main" */
    const char *dir;
    hub_mode mode;
    int dry_run;
    int workers;           /* parallel transfers (default 4) */
    int64_t free_bytes;    /* > 0: use this instead of statvfs (tests) */
    int64_t cache_limit;   /* stream: disk budget for routed experts; < 0 keep the mirror's, 0 none */
    /* One line of news (plan, a file done, a choice made). */
    void (*note)(void *ctx, const char *line);
    void *note_ctx;
} hub_setup_opts;

typedef struct {
    int64_t total_bytes, shard_bytes, expert_bytes;   /* of the repository */
    int64_t local_bytes, local_expert_bytes;          /* present in the mirror */
    int64_t fetched_bytes;                            /* received by this call */
    int requests;                                     /* range requests / files fetched */
    hub_mode mode;                                    /* chosen */
} hub_report;

df_status hub_setup(const hub_setup_opts *o, hub_report *rep, char *err);

/* Fills the missing spans of a stream mirror: every missing span, or only
 * the routed experts of the listed layers (layers: bitmap of n_layers, NULL =
 * everything), coalesced into requests of up to 64 MiB, `workers` at a time.
 * A shard found complete is checked against its sha256; a complete mirror
 * becomes mode full. cache_limit: < 0 the mirror's (set at setup), 0 none;
 * with a limit, a fill that cannot fit in it fails before fetching anything.
 * The rate measured is recorded in the manifest. */
df_status hub_fill(const char *dir, const hub_client *c, const uint8_t *layers, int n_layers,
                   int workers, int dry_run, int64_t cache_limit, hub_report *rep, char *err);

/* `warm`: the routed experts ranked hottest first, (layer, expert) pairs. */
typedef struct { int layer, expert; double score; } hub_rank;
/* Ranks the experts of a router trace (JSON lines {"step","layer","experts",
 * "weights"}: by count of selections, then summed weight) or of heat
 * statistics (deltafin-heat-v1). *out is malloc'd; on error nothing is. */
df_status hub_rank_trace(const char *path, hub_rank **out, int *n, char *err);
df_status hub_rank_heat(const char *path, hub_rank **out, int *n, char *err);
/* Fetches the n_fetch highest-ranked experts that are not local (fewer if
 * the cache limit cannot hold them: rep->requests then says how many were
 * chosen), coalesced, `workers` at a time, and marks the ranked local experts
 * used hottest-last so eviction takes colder ones first. rep: total_bytes =
 * bytes chosen, fetched_bytes, requests = experts chosen; *unknown = ranked
 * pairs the mirror does not have. */
df_status hub_warm(const char *dir, const hub_client *c, const hub_rank *r, int n_rank, int n_fetch,
                   int workers, int dry_run, int64_t cache_limit, hub_report *rep, int *unknown, char *err);

/* Offline check. Writes one line per finding through note; returns DF_OK if
 * the mirror is healthy. hash: also hash complete files against sha256. */
df_status hub_doctor(const char *dir, int hash, void (*note)(void *, const char *), void *ctx,
                     hub_report *rep, char *err);

/* ---- the cache limit and the measured rate of an open stream mirror (stream.c) ---- */
typedef struct {
    double rate;           /* bytes/s measured by the last fetch (manifest), 0 = none yet */
    int64_t rate_at;       /* when, unix seconds */
    int64_t cache_limit;   /* in effect, 0 = none */
    int64_t cache_used;    /* blocks (bytes) held by present routed experts */
    int64_t evicted;       /* bytes evicted by this process */
    int evictions;         /* experts evicted by this process */
    char evict_err[DF_ERRMSG]; /* why eviction stopped, "" */
} hub_meta;
/* After df_hub_stream_open: the limit for this process (limit < 0: the one
 * set at setup, 0: none); evicts at once down to it. DF_OK, or why eviction
 * is impossible (then the limit is off). */
df_status hub_stream_set_limit(df_hub_stream *s, int64_t limit, char *err);
void hub_stream_meta(df_hub_stream *s, hub_meta *out);
/* Saves the use clock and the measured rate (df_hub_stream_close does too). */
void hub_stream_flush(df_hub_stream *s);

/* (mirror.c) 1 if name is a routed expert tensor ("...experts.<n>...", not shared);
 * *layer gets the number after "layers." or -1. */
int hub_is_expert_tensor(const char *name, int *layer);
#endif
