/* mirror.h — what the mirror's files share (internal to src/hub; prefix hub_).
 *
 * A stream or full mirror of a hub repository is five files; calls run one
 * way, down this list (setup.c and stream.c use the three below them,
 * mirror.c uses cache.c and manifest.c, cache.c uses manifest.c; all of them
 * use spans.c and http.c):
 *
 *   manifest.c  DIR/.deltafin-hub/manifest.json (hub_manifest_*) and the
 *               file helpers the others use (paths, mkdir -p, pwrite loop)
 *   cache.c     the cache limit (--cache-limit): the experts' use clock and
 *               its access file, pins, the blocks in use, LRU eviction by
 *               hole punching (hub_cache_*)
 *   mirror.c    the open mirror (hub_mirror_*): per shard its descriptor,
 *               present spans, span log and spans in flight, the safetensors
 *               header as tensor spans and expert units, the fetch protocol
 *               (hub_mirror_ensure), the measured rate
 *   setup.c     the commands on a mirror: hub_setup, hub_fill, hub_warm,
 *               hub_doctor
 *   stream.c    an open stream mirror as a df_io table (df_hub_stream_*,
 *               hub_stream_*)
 *
 * Locking: hub_mirror.mu guards every shard's present / inflight / log, the
 * use clock, the pins and the counters; functions marked "(m->mu held)" are
 * called with it held, the others take it themselves or run before threads
 * exist.
 */
#ifndef DF_HUB_MIRROR_H
#define DF_HUB_MIRROR_H
#include "hub.h"
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#define HUB_DIR ".deltafin-hub"

/* ---- the manifest (manifest.c) ---- */

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
} hub_manifest;

void hub_manifest_free(hub_manifest *m);
df_status hub_manifest_save(const char *dir, const hub_manifest *m, char *err);
/* DF_ERR_IO with errno ENOENT if dir has no manifest. */
df_status hub_manifest_load(const char *dir, hub_manifest *m, char *err);
const char *hub_mode_name(hub_mode m);
int hub_is_shard(const char *path);       /* a .safetensors file */
int hub_skipped_file(const char *path);   /* another weight format: never fetched */
char *hub_pjoin(const char *a, const char *b); /* "a/b", malloc'd */
int hub_mkdirs(const char *path);         /* mkdir -p; 0 or -1 */
int hub_write_at(int fd, const void *p, size_t n, int64_t off); /* the whole buffer; 0 or -1 */

/* ---- the open mirror (mirror.c) ---- */

typedef struct {
    int64_t a, b;        /* absolute [a, b) */
    int layer;           /* after "layers.", -1 if none */
    int eid;             /* routed expert number, -1 if not a routed expert */
    int unit;            /* index in mshard.u (routed experts), -1 otherwise */
    uint8_t expert;      /* a routed expert tensor */
} tspan;

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
    hub_manifest man;
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
    /* the cache limit (cache.c) */
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

/* Opens the mirror in dir. create: make missing sparse files (setup). */
df_status hub_mirror_open(const char *dir, const hub_client *c, int create, hub_mirror **out, char *err);
void hub_mirror_close(hub_mirror *m); /* NULL-safe */
/* Makes bytes [a, b) of shard s local by the fetch protocol (mirror.c says
 * what it leaves behind); _pin keeps them pinned on success. */
df_status hub_mirror_ensure_pin(hub_mirror *m, mshard *s, int64_t a, int64_t b, int keep_pin, char *err);
df_status hub_mirror_ensure(hub_mirror *m, mshard *s, int64_t a, int64_t b, char *err);
/* Makes the header of shard s local (fetch: else it must be) and parses it
 * into s->t and the expert units. m may be NULL when fetch is 0 (doctor). */
df_status hub_shard_header(hub_mirror *m, mshard *s, int fetch, char *err);
/* Adds the present and total bytes of routed experts in shard s (header local). */
void hub_expert_bytes(const mshard *s, int64_t *local, int64_t *total);
/* Records the rate this process measured in the manifest. */
void hub_mirror_save_rate(hub_mirror *m);
double hub_now(void); /* monotonic seconds */

/* ---- the cache limit (cache.c; m->mu held, but hub_cache_load) ---- */

/* Blocks (in bytes) held by the present routed experts of every shard. */
int64_t hub_cache_used(const hub_mirror *m);
/* Blocks (in bytes) that fetching the pieces in miss can add, at most. */
int64_t hub_cache_need(const mshard *s, const hub_spans *miss);
/* Pins [a, b) of shard sh against eviction (0, or -1: no memory); unpin
 * drops one pin of exactly that range. */
int hub_cache_pin(hub_mirror *m, int sh, int64_t a, int64_t b);
void hub_cache_unpin(hub_mirror *m, int sh, int64_t a, int64_t b);
/* Marks the experts overlapping [a, b) of shard s used now. */
void hub_cache_touch(hub_mirror *m, mshard *s, int64_t a, int64_t b);
/* Evicts the coldest experts until the present ones plus those in flight
 * plus `need` fit the limit, or nothing evictable is left. A failure turns
 * eviction off for this process (m->evict_err says why). */
void hub_cache_make_room(hub_mirror *m, int64_t need);
int hub_cache_unit_present(const mshard *s, const munit *u); /* any byte of it */
int hub_cache_unit_missing(const mshard *s, const munit *u); /* any byte not */
/* The use clock in DIR/.deltafin-hub/access: save (a hint, not fsync'd),
 * load (every shard's header parsed; a missing or foreign file: all cold). */
void hub_cache_save(hub_mirror *m);
void hub_cache_load(hub_mirror *m);
#endif
