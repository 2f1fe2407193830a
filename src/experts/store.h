/* store.h — the expert store: routed experts read on demand into a
 * RAM-budgeted cache (prefix xs_).
 *
 * At open each routed expert's tensors are located in the shards (byte
 * ranges from the safetensors index) and merged into as few spans as
 * possible (one per expert in the K3 release layout). The cache is a pool of
 * equal slots allocated and pre-faulted once; each slot holds one expert.
 *
 * A pass over a layer's experts (xs_begin / xs_next / xs_done / xs_end)
 * pins what is cached, submits reads for the misses all at once (as many as
 * free slots allow; the rest as slots are released), and hands experts back
 * in the order they become ready, so compute overlaps the reads. Prefetch
 * hints (xs_prefetch) read predicted experts ahead of their pass; they never
 * change which experts run.
 *
 * What a caller sees never depends on the cache: the bytes of an expert are
 * the file's bytes. A read error drops the slot (nothing half-read stays
 * cached) and fails the pass with DF_ERR_IO; the store stays usable.
 *
 * Slot layout (each span starts at an XR_ALIGN boundary inside the slot):
 *
 *   slot: | span 0 (aligned file range) | pad | span 1 ... |
 *   a tensor's bytes = slot + span_pos + (tensor.offset - span.aligned_start)
 */
#ifndef DF_EXPERTS_STORE_H
#define DF_EXPERTS_STORE_H
#include "deltafin.h"
#include "reader.h"
#include "../format/safetensors.h"
#include "../format/weight.h"

enum { XS_MATS = 3 };                 /* gate, up, down */

typedef struct xs_store xs_store;

typedef struct {
    int64_t ram_bytes;                /* cache budget; the pool gets at most this */
    int direct;                       /* O_DIRECT reads (fall back to buffered if refused) */
    xr_kind reader;
    int depth;                        /* reads in flight */
    int io_threads;                   /* for the pread pool */
    int plan_only;                    /* size the cache but allocate nothing (inspect) */
    int evict;                        /* XS_EVICT_LRU or XS_EVICT_HEAT */
    float prefetch_min_precision;     /* a hint rank is read while its measured precision reaches this */
    int dio_mem_align;                /* memory alignment an O_DIRECT read needs: 0 asks each shard's file
                                       * system (statx STATX_DIOALIGN; XR_ALIGN where it cannot say) */
} xs_opts;

/* Prefetch policy: outcomes are kept per confidence rank of a hint (the
 * order xs_prefetch gets them in: most confident first), as counts decayed
 * by XS_PF_DECAY per outcome. Ranks are read down to a depth: a rank whose
 * precision falls below the floor cuts the depth there, the rank at the
 * depth is probed every XS_PF_PROBE-th hint and extends it when it reaches
 * the floor.
 * The floor (0.75) is where a wasted read, which costs a whole expert's
 * bytes when reads are the bottleneck, is outweighed by the latency the
 * used ones hide (measured on the K3-width slice: bench/lookahead.sh). */
enum { XS_PF_RANKS = 64, XS_PF_PROBE = 32 };
#define XS_PF_DECAY 0.97f
#define XS_PF_MIN_PRECISION 0.75f

enum { XS_EVICT_LRU = 0, XS_EVICT_HEAT };

typedef struct {
    uint64_t hits, misses;            /* experts found cached / read */
    uint64_t prefetched, prefetch_used; /* prefetch reads issued / used by the pass they were read for */
    uint64_t prefetch_wasted;         /* prefetched experts that pass did not use, or evicted unused */
    uint64_t bytes_read;
    double wait_s;                    /* time xs_next spent waiting for reads */
    double submit_s;                  /* time handing reads to the reader / kernel and reaping
                                       * without waiting (a kernel that reads inline blocks here) */
    int slots, slots_used;
    int64_t slot_bytes;
    int max_in_flight;
    int pinned;                       /* slots held for good (xs_pin_hottest) */
    int dio_mem_align;                /* the largest memory alignment the O_DIRECT reads land at (0: none
                                       * direct); at most PLACE_ALIGN, their first tensors land on lines */
} xs_stats;

df_status xs_new(const df_io *io, st_set *st, int n_layers, int n_experts, const xs_opts *o,
                 xs_store **out, char *err);
void xs_free(xs_store *x);
/* Records expert (layer, e) from its lazily bound views (wt_bind_lazy). */
df_status xs_register(xs_store *x, int layer, int e, const df_weight w[XS_MATS], char *err);
/* Replaces the cache budget given to xs_new (before xs_finalize). */
void xs_set_budget(xs_store *x, int64_t ram_bytes);
/* Sizes the slots from the registered experts, allocates and pre-faults the
 * pool, opens the shard files. */
df_status xs_finalize(xs_store *x, char *err);

/* Starts a pass over `n` distinct experts of `layer`. */
df_status xs_begin(xs_store *x, int layer, const int *experts, int n, char *err);
/* Next ready expert of the pass: *e and its views. DF_OK with *e = -1 when
 * every expert was handed out; DF_ERR_IO if a read failed. */
df_status xs_next(xs_store *x, int *e, df_weight w[XS_MATS], char *err);
/* The caller is done computing with expert e of the current pass. */
void xs_done(xs_store *x, int e);
/* xs_next without waiting: *e = -1 when no expert of the pass is ready now
 * (errors are left for xs_next to report). */
df_status xs_next_ready(xs_store *x, int *e, df_weight w[XS_MATS], char *err);
/* Ends the pass (also after an error): unpins everything of it. */
void xs_end(xs_store *x);
/* Views of expert e of `layer` if it is cached and ready now (1), else 0.
 * They stay valid only until the store next reuses a slot (any call that
 * reads); see xs_set_reuse_hook for readers that outlive that. */
int xs_peek(xs_store *x, int layer, int e, df_weight w[XS_MATS]);
/* fn(ctx) runs before a slot holding a cached expert is given to another
 * (e.g. an accelerator waits there for uploads still reading the slot). */
void xs_set_reuse_hook(xs_store *x, void (*fn)(void *ctx), void *ctx);
/* Hint: read these experts of `layer`, most confident first, while free
 * slots allow (never the slots the current pass still needs) and while
 * each confidence rank's measured precision pays (store.c). */
void xs_prefetch(xs_store *x, int layer, const int *experts, int n);
/* Waits for outstanding prefetch reads (before timing-sensitive code). */
void xs_drain(xs_store *x);

/* Heat: per (layer, expert) a use count decayed by XS_HEAT_DECAY per token
 * step (xs_tick), updated by every pass. Persisted as JSON. */
#define XS_HEAT_DECAY 0.999
void xs_tick(xs_store *x, int steps);
df_status xs_heat_load(xs_store *x, const char *path, char *err); /* a missing file is fine */
df_status xs_heat_save(const xs_store *x, const char *path, char *err);
/* Reads the hottest experts now and keeps them resident for good, up to
 * `bytes` (never more than the cache minus room for two passes). */
df_status xs_pin_hottest(xs_store *x, int64_t bytes, int per_pass, char *err);

/* Checks that no shard changed size or modification time since open;
 * DF_ERR_IO naming the file otherwise. */
df_status xs_check_files(const xs_store *x, char *err);
/* Bytes of the slot pool (the expert cache as allocated). */
int64_t xs_pool_bytes(const xs_store *x);
void *xs_pool(const xs_store *x);
/* Expert e of layer's registered matrices: shapes and tensors (the keys of
 * device copies), data and scale NULL. */
void xs_templates(const xs_store *x, int layer, int e, df_weight w[XS_MATS]); /* the cache slots' memory; NULL before xs_finalize or when planning */

void xs_get_stats(const xs_store *x, xs_stats *s);
void xs_reset_stats(xs_store *x);
/* Bytes of the largest expert as stored (all its tensors). */
int64_t xs_expert_bytes(const xs_store *x);
int xs_registered(const xs_store *x); /* experts registered (the model's routed experts) */
#endif
