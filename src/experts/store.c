/* store.c — the expert store and its slot cache (see store.h).
 *
 * Owns: the per-expert span table, the slot pool (one allocation, populated
 * in the background from finalize on), the shard file descriptors (direct and buffered), the reader.
 * Refuses: experts larger than a slot (cannot happen: slots are sized from
 * the largest registered expert), partial slots (a slot becomes READY only
 * when every span of its expert completed without error).
 *
 * Sections: types; registration (spans); finalize; slots and eviction;
 * completions; passes; prefetch; stats.
 */
#include "store.h"
#include "place.h"
#include "../base/port.h"
#include "../base/err.h"
#include "../base/mem.h"
#include <jansson.h>
#include <math.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- types ---- */

static double mono_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}


enum { MAX_PIECES = 2 * XS_MATS, MAX_SPANS = MAX_PIECES, MERGE_GAP = 1 << 20 };

typedef struct {
    int shard;
    int direct;           /* read through the O_DIRECT descriptor */
    int64_t start;        /* file offset of the first byte read */
    int64_t len;          /* bytes read */
    int64_t pos;          /* where those bytes land in the slot */
} span_t;

typedef struct {
    df_weight w[XS_MATS]; /* lazy views: t_data / t_scale set, pointers NULL */
    span_t span[MAX_SPANS];
    int8_t piece_span[MAX_PIECES]; /* span of w[i] data (2i) and scale (2i+1); -1 none */
    int64_t piece_pos[MAX_PIECES]; /* where that tensor lies in the slot once placed (place_pieces) */
    uint8_t nspan, reg, moves;     /* moves: some tensor lies elsewhere than its span's read put it */
} xs_expert;

enum { SLOT_EMPTY = 0, SLOT_LOADING, SLOT_READY };
enum { P_WAIT = 0, P_LOADING, P_QUEUED, P_HANDED, P_DONE };

typedef struct {
    int32_t key;          /* layer * E + expert, -1 when empty */
    uint8_t state;
    uint8_t failed;       /* a span read failed: drop when the last completes */
    int16_t pins;
    int16_t pending;      /* span reads outstanding */
    uint8_t prefetch;     /* loaded by a hint and not used by a pass yet */
    uint8_t pf_rank;      /* the hint's confidence rank (0 = most confident) */
    uint8_t pinned;       /* held for good (hottest experts) */
    uint8_t used;         /* handed out since its read */
    uint8_t placed;       /* its tensors moved to their places (place_pieces) */
    uint64_t last;        /* tick of last use (LRU) */
} slot_t;

struct xs_store {
    const df_io *io;
    st_set *st;
    xs_opts o;
    int L, E;
    xs_expert *ex;        /* [L*E] */
    int32_t *slot_of;     /* [L*E] slot index or -1 */
    int n_shards;
    int *fd_direct, *fd_buf;
    int *mem_align;       /* [n_shards] memory alignment of the shard's O_DIRECT reads; 0 none */
    int64_t *fsize;
    struct timespec *mtime; /* [n_shards] at open */
    xs_reader *rd;
    uint8_t *pool;
    struct mem_fill *fill; /* populating the pool in the background (mem.h) */
    int64_t slot_bytes, pool_bytes;
    int n_slots;
    slot_t *slots;
    uint64_t tick;
    int in_flight;        /* span reads submitted, not completed */
    float *heat;          /* [L*E] decayed use counts as of heat_at */
    uint32_t *heat_at;    /* [L*E] step of the last update */
    uint32_t step;        /* token steps so far */
    /* the current pass */
    int pass_layer, pass_n, pass_handed, pass_err;
    int *pass_list;       /* [E] */
    int *pass_idx;        /* [E] index in pass_list, -1 if not in the pass */
    uint8_t *pass_st;     /* [E] P_* by pass index */
    int *readyq;          /* [E] */
    int rq_head, rq_tail;
    xs_stats stats;
    /* lookahead outcomes per confidence rank, decayed counts (prefetch policy) */
    float pf_used[XS_PF_RANKS], pf_wasted[XS_PF_RANKS];
    int pf_depth;         /* hints at ranks below this are read; the rank at it is probed */
    int pf_since_probe;   /* hints at rank pf_depth skipped since the last probe */
    int pf_outstanding;   /* slots read by a hint whose outcome is not known yet */
    void (*reuse_hook)(void *ctx); /* called before a cached expert's slot is reused */
    void *reuse_ctx;
};

/* ---- registration (spans) ---- */

static int cmp_piece(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

df_status xs_register(xs_store *x, int layer, int e, const df_weight w[XS_MATS], char *err) {
    if (layer < 0 || layer >= x->L || e < 0 || e >= x->E)
        return df_fail(err, DF_ERR_ARG, "expert (%d, %d) outside the store", layer, e);
    xs_expert *ex = &x->ex[(size_t)layer * x->E + e];
    memset(ex, 0, sizeof *ex);
    const st_tensor *pieces[MAX_PIECES];
    int np = 0;
    for (int i = 0; i < XS_MATS; i++) {
        ex->w[i] = w[i];
        ex->w[i].data = ex->w[i].scale = NULL;
        if (!w[i].t_data) return df_fail(err, DF_ERR_ARG, "expert (%d, %d) matrix %d has no tensor", layer, e, i);
        pieces[np++] = w[i].t_data;
        if (w[i].t_scale) pieces[np++] = w[i].t_scale;
    }
    qsort(pieces, (size_t)np, sizeof pieces[0], cmp_piece);
    /* merge neighbours in one shard into spans */
    for (int i = 0; i < np; i++) {
        const st_tensor *t = pieces[i];
        span_t *s = ex->nspan ? &ex->span[ex->nspan - 1] : NULL;
        if (s && s->shard == t->shard && t->offset - (s->start + s->len) <= MERGE_GAP) {
            int64_t end = t->offset + t->nbytes;
            if (end > s->start + s->len) s->len = end - s->start;
        } else {
            s = &ex->span[ex->nspan++];
            s->shard = t->shard;
            s->start = t->offset;
            s->len = t->nbytes;
        }
    }
    for (int i = 0; i < MAX_PIECES; i++) ex->piece_span[i] = -1;
    for (int i = 0; i < XS_MATS; i++)
        for (int k = 0; k < 2; k++) {
            const st_tensor *t = k ? w[i].t_scale : w[i].t_data;
            if (!t) continue;
            for (int s = 0; s < ex->nspan; s++)
                if (ex->span[s].shard == t->shard && t->offset >= ex->span[s].start &&
                    t->offset + t->nbytes <= ex->span[s].start + ex->span[s].len)
                    ex->piece_span[2 * i + k] = (int8_t)s;
        }
    ex->reg = 1;
    return DF_OK;
}

/* ---- finalize ---- */

static int64_t align_down(int64_t v) { return v / XR_ALIGN * XR_ALIGN; }
static int64_t align_up(int64_t v) { return (v + XR_ALIGN - 1) / XR_ALIGN * XR_ALIGN; }

/* The tensor of piece i (w[i / 2] data, or its scale for odd i), or NULL. */
static const st_tensor *piece_tensor(const xs_expert *ex, int i) {
    return i % 2 ? ex->w[i / 2].t_scale : ex->w[i / 2].t_data;
}

/* Span s's pieces (indices into piece_span) by file offset, with their
 * offsets and sizes; returns how many. */
static int span_pieces(const xs_expert *ex, int s, int idx[MAX_PIECES], int64_t off[MAX_PIECES],
                       int64_t len[MAX_PIECES]) {
    int n = 0;
    for (int i = 0; i < MAX_PIECES; i++)
        if (ex->piece_span[i] == s) idx[n++] = i;
    for (int i = 1; i < n; i++)
        for (int k = i; k > 0 && piece_tensor(ex, idx[k - 1])->offset > piece_tensor(ex, idx[k])->offset; k--) {
            const int t = idx[k];
            idx[k] = idx[k - 1], idx[k - 1] = t;
        }
    for (int k = 0; k < n; k++) off[k] = piece_tensor(ex, idx[k])->offset, len[k] = piece_tensor(ex, idx[k])->nbytes;
    return n;
}

/* Span s's tensors' places in the slot (place.h); returns the room they
 * take past the span's read. */
static int64_t place_span(xs_expert *ex, int s) {
    const span_t *sp = &ex->span[s];
    int idx[MAX_PIECES];
    int64_t off[MAX_PIECES], len[MAX_PIECES], at[MAX_PIECES];
    const int n = span_pieces(ex, s, idx, off, len);
    const int64_t past = place_plan(off, len, n, sp->start, sp->pos, sp->len, at);
    if (place_moves(off, n, sp->start, sp->pos, at)) ex->moves = 1;
    for (int k = 0; k < n; k++) ex->piece_pos[idx[k]] = at[k];
    return past;
}

/* Turns each span into what is actually read: aligned ranges on the direct
 * descriptor, or the exact range on the buffered one where the aligned range
 * would pass the end of the file. Lays the spans out in the slot, each
 * followed by the room its tensors' placing takes (place_span); a direct
 * read lands at the shard's memory alignment (mem_align), shifted when that
 * puts the span's first tensor on a line. */
static int64_t plan_expert(xs_store *x, xs_expert *ex) {
    int64_t pos = 0;
    ex->moves = 0;
    for (int s = 0; s < ex->nspan; s++) {
        span_t *sp = &ex->span[s];
        int64_t a = align_down(sp->start), b = align_up(sp->start + sp->len);
        int direct = x->fd_direct[sp->shard] >= 0 && b <= x->fsize[sp->shard];
        /* `start` keeps the tensor origin: the read lands it at pos */
        sp->direct = direct;
        if (direct) {
            /* where the device takes a buffer a few bytes past a block, the
             * read lands its span's first tensor on a PLACE_ALIGN line (and
             * the next ones where their sizes keep them there): less to move
             * at the second use, and the first use reads whole lines. Never
             * below the reader's XR_MEM_ALIGN_MIN */
            const int64_t lead = sp->start - a, shift = place_read_shift(pos, lead, x->mem_align[sp->shard]);
            sp->pos = pos + shift + lead;
            pos += shift + (b - a);
        } else {
            sp->pos = pos;
            pos += sp->len;
        }
        pos = align_up(pos + place_span(ex, s));
    }
    return align_up(pos);
}

/* Moves a loaded slot's tensors from where the reads put them to their
 * places (place_span). */
static void place_pieces(const xs_expert *ex, uint8_t *base) {
    if (!ex->moves) return;
    for (int s = 0; s < ex->nspan; s++) {
        int idx[MAX_PIECES];
        int64_t off[MAX_PIECES], len[MAX_PIECES], at[MAX_PIECES];
        const int n = span_pieces(ex, s, idx, off, len);
        for (int k = 0; k < n; k++) at[k] = ex->piece_pos[idx[k]];
        place_move(base, off, len, n, ex->span[s].start, ex->span[s].pos, at);
    }
}

df_status xs_finalize(xs_store *x, char *err) {
    x->n_shards = st_n_shards(x->st);
    x->fd_direct = malloc((size_t)x->n_shards * sizeof(int));
    x->fd_buf = malloc((size_t)x->n_shards * sizeof(int));
    x->fsize = calloc((size_t)x->n_shards, sizeof(int64_t));
    x->mtime = calloc((size_t)x->n_shards, sizeof(struct timespec));
    x->mem_align = calloc((size_t)x->n_shards, sizeof(int));
    if (!x->fd_direct || !x->fd_buf || !x->fsize || !x->mtime || !x->mem_align)
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < x->n_shards; i++) x->fd_direct[i] = x->fd_buf[i] = -1;
    for (int i = 0; i < x->n_shards; i++) {
        const char *p = st_shard_path(x->st, i);
        x->fd_buf[i] = io_open(x->io, p, O_RDONLY | O_CLOEXEC, 0);
        if (x->fd_buf[i] < 0 || io_fsize(x->io, x->fd_buf[i], &x->fsize[i]) != 0)
            return df_fail(err, DF_ERR_IO, "%s: cannot open for expert reads: %s", p, strerror(errno));
        if (x->o.direct) x->fd_direct[i] = io_open(x->io, p, O_RDONLY | O_CLOEXEC | DF_O_DIRECT, 0);
        if (x->fd_direct[i] >= 0) /* (statx only for the shards read direct: inspect opens 96 of K3's) */
            x->mem_align[i] = x->o.dio_mem_align > 0 ? x->o.dio_mem_align : port_dio_mem_align(p, XR_ALIGN);
        struct stat sb;
        if (fstat(x->fd_buf[i], &sb) == 0) x->mtime[i] = PORT_ST_MTIM(sb);
    }
    int64_t slot = XR_ALIGN;
    int n_reg = 0;
    for (int64_t k = 0; k < (int64_t)x->L * x->E; k++) {
        if (!x->ex[k].reg) continue;
        n_reg++;
        int64_t need = plan_expert(x, &x->ex[k]);
        if (need > slot) slot = need;
    }
    x->slot_bytes = slot;
    int64_t n = x->o.ram_bytes / slot;
    if (n > n_reg) n = n_reg;
    if (n < 2) n = 2;
    x->n_slots = (int)n;
    x->pool_bytes = n * slot;
    x->stats.slots = x->n_slots;
    x->stats.slot_bytes = slot;
    x->slots = calloc((size_t)x->n_slots, sizeof(slot_t));
    if (!x->slots) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < x->n_slots; i++) x->slots[i].key = -1;
    if (x->o.plan_only) return DF_OK;
    /* one anonymous mapping, populated by a background thread (MAP_POPULATE
     * here made opening wait seconds for gigabytes of page clearing): the
     * first token's reads may still fault pages in, later ones do not */
    void *p = mmap(NULL, (size_t)x->pool_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return df_fail(err, DF_ERR_NOMEM, "cannot allocate the expert cache (%d slots of %.1f MB)",
                       x->n_slots, slot / 1e6);
    x->pool = p;
    x->fill = mem_fill_start(p, (size_t)x->pool_bytes);
    int depth = x->o.depth > 0 ? x->o.depth : 32;
    df_status st = xr_open(x->io, x->o.reader, depth, x->o.io_threads > 0 ? x->o.io_threads : 8, &x->rd, err);
    if (st != DF_OK) return st;
    return DF_OK;
}

void xs_set_budget(xs_store *x, int64_t ram_bytes) { x->o.ram_bytes = ram_bytes; }

df_status xs_new(const df_io *io, st_set *st, int n_layers, int n_experts, const xs_opts *o,
                 xs_store **out, char *err) {
    *out = NULL;
    xs_store *x = calloc(1, sizeof *x);
    if (!x) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    x->io = io;
    x->st = st;
    x->o = *o;
    x->pf_depth = XS_PF_RANKS;
    x->L = n_layers;
    x->E = n_experts;
    size_t n = (size_t)n_layers * n_experts;
    x->ex = calloc(n ? n : 1, sizeof *x->ex);
    x->slot_of = malloc((n ? n : 1) * sizeof(int32_t));
    x->heat = calloc(n ? n : 1, sizeof(float));
    x->heat_at = calloc(n ? n : 1, sizeof(uint32_t));
    x->pass_list = malloc((size_t)(n_experts ? n_experts : 1) * sizeof(int));
    x->pass_idx = malloc((size_t)(n_experts ? n_experts : 1) * sizeof(int));
    x->pass_st = calloc((size_t)(n_experts ? n_experts : 1), 1);
    x->readyq = malloc((size_t)(n_experts ? n_experts : 1) * sizeof(int));
    if (!x->ex || !x->slot_of || !x->heat || !x->heat_at || !x->pass_list || !x->pass_idx || !x->pass_st || !x->readyq) {
        xs_free(x);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for the expert table");
    }
    for (size_t i = 0; i < n; i++) x->slot_of[i] = -1;
    for (int i = 0; i < n_experts; i++) x->pass_idx[i] = -1;
    x->pass_layer = -1;
    *out = x;
    return DF_OK;
}

void xs_free(xs_store *x) {
    if (!x) return;
    xr_close(x->rd);
    for (int i = 0; x->fd_buf && i < x->n_shards; i++) {
        if (x->fd_buf[i] >= 0) io_close(x->io, x->fd_buf[i]);
        if (x->fd_direct[i] >= 0) io_close(x->io, x->fd_direct[i]);
    }
    free(x->fd_direct); free(x->fd_buf); free(x->fsize); free(x->mtime); free(x->mem_align);
    mem_fill_stop(x->fill);
    if (x->pool) munmap(x->pool, (size_t)x->pool_bytes);
    free(x->slots); free(x->ex); free(x->slot_of); free(x->heat); free(x->heat_at);
    free(x->pass_list); free(x->pass_idx); free(x->pass_st); free(x->readyq);
    free(x);
}

int64_t xs_expert_bytes(const xs_store *x) { return x->slot_bytes; }

/* ---- slots and eviction ---- */

/* A free slot, or the least recently used unpinned ready one; -1 if none. */
static float heat_now(const xs_store *x, int64_t k);

/* Eviction order: LRU evicts the least recently used; HEAT the expert with
 * the lowest decayed use count (ties to the least recent). */
static int colder(const xs_store *x, const slot_t *a, const slot_t *b) {
    if (x->o.evict == XS_EVICT_HEAT) {
        float ha = heat_now(x, a->key), hb = heat_now(x, b->key);
        if (ha != hb) return ha < hb;
    }
    return a->last < b->last;
}

/* Measured precision of hints at rank r: decayed counts with an optimistic
 * prior of three uses (one early miss does not turn a rank down). */
static float pf_precision(const xs_store *x, int r) {
    return (x->pf_used[r] + 3.0f) / (x->pf_used[r] + x->pf_wasted[r] + 3.0f);
}

/* A prefetched slot's outcome: used by the pass it was read for, or not.
 * The depth follows the ranks' precision (which falls with the rank): a
 * rank read whose precision falls below the floor cuts the depth there; a
 * probed rank (the one at the depth) that reaches it extends the depth. */
static void pf_outcome(xs_store *x, slot_t *s, int used) {
    int r = s->pf_rank < XS_PF_RANKS ? s->pf_rank : XS_PF_RANKS - 1;
    x->pf_used[r] = x->pf_used[r] * XS_PF_DECAY + (float)used;
    x->pf_wasted[r] = x->pf_wasted[r] * XS_PF_DECAY + (float)!used;
    if (used) x->stats.prefetch_used++;
    else x->stats.prefetch_wasted++;
    s->prefetch = 0;
    x->pf_outstanding--;
    float floor = x->o.prefetch_min_precision;
    if (r < x->pf_depth && pf_precision(x, r) < floor) x->pf_depth = r;
    else if (r == x->pf_depth && r < XS_PF_RANKS - 1 && pf_precision(x, r) >= floor) x->pf_depth = r + 1;
}

static int take_slot(xs_store *x) {
    int best = -1;
    for (int i = 0; i < x->n_slots; i++) {
        slot_t *s = &x->slots[i];
        if (s->state == SLOT_EMPTY) return i;
        if (s->state == SLOT_READY && s->pins == 0 && (best < 0 || colder(x, s, &x->slots[best]))) best = i;
    }
    if (best >= 0) {
        slot_t *s = &x->slots[best];
        if (s->prefetch) pf_outcome(x, s, 0); /* read ahead and evicted unused */
        if (x->reuse_hook) x->reuse_hook(x->reuse_ctx); /* nothing may still read it */
        x->slot_of[s->key] = -1;
        s->key = -1;
        s->state = SLOT_EMPTY;
    }
    return best;
}

/* Submits the reads of expert key into a slot. Returns the slot, -1 if no
 * slot is free, -2 if a submit failed (the slot is released). */
static int start_load(xs_store *x, int key, int prefetch) {
    int si = take_slot(x);
    if (si < 0) return -1;
    const xs_expert *ex = &x->ex[key];
    slot_t *s = &x->slots[si];
    uint8_t *base = x->pool + (size_t)si * x->slot_bytes;
    s->key = key;
    s->state = SLOT_LOADING;
    s->failed = 0;
    s->pins = 0;
    s->prefetch = (uint8_t)prefetch;
    s->used = s->placed = 0;
    s->pending = 0;
    s->last = ++x->tick;
    x->slot_of[key] = si;
    for (int k = 0; k < ex->nspan; k++) {
        const span_t *sp = &ex->span[k];
        int64_t a = sp->direct ? align_down(sp->start) : sp->start;
        int64_t len = sp->direct ? align_up(sp->start + sp->len) - a : sp->len;
        uint8_t *dst = base + (sp->pos - (sp->start - a));
        int fd = sp->direct ? x->fd_direct[sp->shard] : x->fd_buf[sp->shard];
        double t0 = mono_s();
        /* a pass's reads go ahead of queued prefetches (they are waited for now) */
        int rc = prefetch ? xr_submit(x->rd, fd, sp->direct, dst, (size_t)len, a, (uint64_t)si)
                          : xr_submit_first(x->rd, fd, sp->direct, dst, (size_t)len, a, (uint64_t)si);
        x->stats.submit_s += mono_s() - t0;
        if (rc != 0) {
            s->failed = 1;
            if (s->pending == 0) {
                x->slot_of[key] = -1;
                s->key = -1;
                s->state = SLOT_EMPTY;
                return -2;
            }
            break;
        }
        s->pending++;
        x->in_flight++;
        x->stats.bytes_read += (uint64_t)len;
    }
    if (x->in_flight > x->stats.max_in_flight) x->stats.max_in_flight = x->in_flight;
    return si;
}

/* ---- completions ---- */

static void pass_push_ready(xs_store *x, int pi) {
    x->pass_st[pi] = P_QUEUED;
    x->readyq[x->rq_tail++] = pi;
}

static void complete(xs_store *x, const xr_done *d) {
    int si = (int)d->user;
    slot_t *s = &x->slots[si];
    x->in_flight--;
    if (d->err) s->failed = 1;
    if (--s->pending > 0) return;
    int key = s->key, layer = key / x->E, e = key % x->E;
    int in_pass = layer == x->pass_layer && x->pass_idx[e] >= 0;
    if (s->failed) {
        if (s->prefetch) { s->prefetch = 0; x->pf_outstanding--; } /* a failed hint has no outcome */
        x->slot_of[key] = -1;
        s->key = -1;
        s->state = SLOT_EMPTY;
        s->pins = 0;
        if (in_pass) x->pass_err = d->err ? d->err : EIO;
        return;
    }
    s->state = SLOT_READY;
    if (in_pass && x->pass_st[x->pass_idx[e]] == P_LOADING) pass_push_ready(x, x->pass_idx[e]);
}

static void reap(xs_store *x, int block) {
    xr_done d[64];
    double t0 = block ? 0 : mono_s();
    int n = block ? xr_wait(x->rd, d, 64) : xr_poll(x->rd, d, 64);
    if (!block) x->stats.submit_s += mono_s() - t0;
    for (int i = 0; i < n; i++) complete(x, &d[i]);
}

/* ---- passes ---- */

/* Submits reads for pass experts still waiting, while slots allow. */
static void submit_waiting(xs_store *x) {
    for (int i = 0; i < x->pass_n; i++) {
        if (x->pass_st[i] != P_WAIT) continue;
        int key = x->pass_layer * x->E + x->pass_list[i];
        int si = start_load(x, key, 0);
        if (si == -1) return;
        if (si == -2) { x->pass_err = EIO; return; }
        x->slots[si].pins++;
        x->pass_st[i] = P_LOADING;
    }
}

df_status xs_begin(xs_store *x, int layer, const int *experts, int n, char *err) {
    if (x->pass_layer >= 0) xs_end(x);
    x->pass_layer = layer;
    x->pass_n = n;
    x->pass_handed = 0;
    x->pass_err = 0;
    x->rq_head = x->rq_tail = 0;
    for (int i = 0; i < n; i++) {
        int e = experts[i], key = layer * x->E + e;
        if (!x->ex[key].reg) {
            x->pass_n = i;
            xs_end(x);
            return df_fail(err, DF_ERR_ARG, "expert %d of layer %d is not in the store", e, layer);
        }
        x->pass_list[i] = e;
        x->pass_idx[e] = i;
        x->heat[key] = x->heat[key] * (float)pow(XS_HEAT_DECAY, (double)(x->step - x->heat_at[key])) + 1.0f;
        x->heat_at[key] = x->step;
        x->pass_st[i] = P_WAIT;
        int si = x->slot_of[key];
        if (si < 0) { x->stats.misses++; continue; }
        slot_t *s = &x->slots[si];
        s->pins++;
        s->last = ++x->tick;
        if (s->prefetch) pf_outcome(x, s, 1);
        else if (s->state == SLOT_READY) x->stats.hits++;
        if (s->state == SLOT_READY) pass_push_ready(x, i);
        else x->pass_st[i] = P_LOADING;
    }
    /* hints for this layer that the pass did not use were mispredictions
     * (the expert stays cached: a later use counts as a hit) */
    for (int i = 0; x->pf_outstanding > 0 && i < x->n_slots; i++) {
        slot_t *s = &x->slots[i];
        if (s->prefetch && s->key >= 0 && s->key / x->E == layer && x->pass_idx[s->key % x->E] < 0)
            pf_outcome(x, s, 0);
    }
    submit_waiting(x);
    return DF_OK;
}

/* Where piece i of expert ex lies in its slot: its place once the slot's
 * tensors are placed, else where its span's read put it. */
static int64_t piece_at(const xs_expert *ex, int i, int placed) {
    const span_t *sp = &ex->span[ex->piece_span[i]];
    return placed ? ex->piece_pos[i] : sp->pos + (piece_tensor(ex, i)->offset - sp->start);
}

/* The views of expert key over its slot. */
static void views_of(const xs_store *x, int key, df_weight w[XS_MATS]) {
    const xs_expert *ex = &x->ex[key];
    const int si = x->slot_of[key], placed = x->slots[si].placed;
    uint8_t *base = x->pool + (size_t)si * x->slot_bytes;
    for (int i = 0; i < XS_MATS; i++) {
        w[i] = ex->w[i];
        if (ex->piece_span[2 * i] >= 0) w[i].data = base + piece_at(ex, 2 * i, placed);
        if (ex->piece_span[2 * i + 1] >= 0) w[i].scale = base + piece_at(ex, 2 * i + 1, placed);
    }
}

/* An expert handed out again from its slot: its tensors go to their places
 * first (place_span). Not at the read: a move costs about twice what one use
 * of the expert gains (a 17.6 MB expert: memmove ~0.7 ms on this VM against
 * ~0.07 ms of a 2-thread matvec), so a slot read for one use (a small cache,
 * K8g at a 6% hit rate: +12% a token) keeps the file's offsets, and one that
 * is used again pays once for every later use. Device uploads may still
 * read the slot where it was (the reuse hook waits for them). */
static void place_on_reuse(xs_store *x, int key) {
    slot_t *s = &x->slots[x->slot_of[key]];
    const xs_expert *ex = &x->ex[key];
    if (s->used && !s->placed) {
        if (ex->moves) {
            if (x->reuse_hook) x->reuse_hook(x->reuse_ctx);
            place_pieces(ex, x->pool + (size_t)x->slot_of[key] * x->slot_bytes);
        }
        s->placed = 1;
    }
    s->used = 1;
}

df_status xs_next(xs_store *x, int *e, df_weight w[XS_MATS], char *err) {
    *e = -1;
    for (;;) {
        if (x->pass_err)
            return df_fail(err, DF_ERR_IO, "reading expert weights of layer %d failed: %s", x->pass_layer,
                           strerror(x->pass_err));
        if (x->rq_head < x->rq_tail) {
            int pi = x->readyq[x->rq_head++];
            int ex_id = x->pass_list[pi], key = x->pass_layer * x->E + ex_id;
            place_on_reuse(x, key);
            views_of(x, key, w);
            x->pass_st[pi] = P_HANDED;
            x->pass_handed++;
            *e = ex_id;
            return DF_OK;
        }
        if (x->pass_handed == x->pass_n) return DF_OK;
        submit_waiting(x);
        if (x->pass_err) continue;
        if (x->in_flight == 0)
            return df_fail(err, DF_ERR_NOMEM,
                           "expert cache too small: %d slots cannot hold the experts one layer needs at once",
                           x->n_slots);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        reap(x, 1);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        x->stats.wait_s += (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    }
}

df_status xs_next_ready(xs_store *x, int *e, df_weight w[XS_MATS], char *err) {
    *e = -1;
    if (x->pass_err || x->rq_head >= x->rq_tail) {
        reap(x, 0); /* completions that are already in */
        if (x->pass_err || x->rq_head >= x->rq_tail) return DF_OK; /* xs_next reports errors */
    }
    return xs_next(x, e, w, err);
}

void xs_done(xs_store *x, int e) {
    int pi = x->pass_idx[e];
    if (pi < 0 || x->pass_st[pi] != P_HANDED) return;
    x->pass_st[pi] = P_DONE;
    int si = x->slot_of[x->pass_layer * x->E + e];
    if (si >= 0 && x->slots[si].pins > 0) x->slots[si].pins--;
    submit_waiting(x);
}

void xs_end(xs_store *x) {
    if (x->pass_layer < 0) return;
    for (int i = 0; i < x->pass_n; i++) {
        int e = x->pass_list[i];
        int si = x->slot_of[x->pass_layer * x->E + e];
        if (x->pass_st[i] != P_WAIT && x->pass_st[i] != P_DONE && si >= 0 && x->slots[si].pins > 0)
            x->slots[si].pins--;
        x->pass_idx[e] = -1;
    }
    x->pass_layer = -1;
    x->pass_n = 0;
    x->pass_err = 0;
    reap(x, 0);
}

/* ---- prefetch ---- */

int xs_peek(xs_store *x, int layer, int e, df_weight w[XS_MATS]) {
    if (layer < 0 || layer >= x->L || e < 0 || e >= x->E) return 0;
    int key = layer * x->E + e, si = x->slot_of[key];
    if (si < 0 || x->slots[si].state != SLOT_READY || x->slots[si].failed) return 0;
    views_of(x, key, w);
    return 1;
}

void xs_set_reuse_hook(xs_store *x, void (*fn)(void *ctx), void *ctx) {
    x->reuse_hook = fn;
    x->reuse_ctx = ctx;
}

/* Whether a hint at confidence rank r is read: every rank above the depth
 * is; the rank at the depth is probed every XS_PF_PROBE-th hint, so the
 * depth can grow back when routing becomes predictable. */
static int pf_rank_pays(xs_store *x, int r) {
    if (r < x->pf_depth) return 1;
    if (r > x->pf_depth) return 0;
    if (++x->pf_since_probe < XS_PF_PROBE) return 0;
    x->pf_since_probe = 0;
    return 1;
}

void xs_prefetch(xs_store *x, int layer, const int *experts, int n) {
    if (layer < 0 || layer >= x->L) return;
    reap(x, 0);
    /* the budget: slots the current pass does not need, so a hint is not
     * evicted by the pass's own reads before its layer runs */
    int pinned = 0;
    for (int i = 0; i < x->n_slots; i++) pinned += x->slots[i].pinned || x->slots[i].pins > 0;
    int pass_left = 0;
    for (int i = 0; i < x->pass_n; i++) pass_left += x->pass_st[i] == P_WAIT;
    int room = x->n_slots - pinned - pass_left - 1;
    for (int i = 0; i < n && room > 0; i++) {
        int key = layer * x->E + experts[i];
        if (!x->ex[key].reg || x->slot_of[key] >= 0) continue;
        if (x->in_flight >= x->n_slots / 2) break; /* leave room for the pass itself */
        if (!pf_rank_pays(x, i)) continue;
        int si = start_load(x, key, 1);
        if (si < 0) break;
        x->slots[si].pf_rank = (uint8_t)(i < 255 ? i : 255);
        x->stats.prefetched++;
        x->pf_outstanding++;
        room--;
    }
}

void xs_drain(xs_store *x) {
    while (x->in_flight > 0) reap(x, 1);
}

/* ---- heat and pinning ---- */

void xs_tick(xs_store *x, int steps) { x->step += (uint32_t)steps; }

static float heat_now(const xs_store *x, int64_t k) {
    return x->heat[k] * (float)pow(XS_HEAT_DECAY, (double)(x->step - x->heat_at[k]));
}

df_status xs_heat_save(const xs_store *x, const char *path, char *err) {
    json_t *rows = json_array();
    for (int l = 0; l < x->L; l++) {
        json_t *r = json_array();
        for (int e = 0; e < x->E; e++) json_array_append_new(r, json_real(heat_now(x, (int64_t)l * x->E + e)));
        json_array_append_new(rows, r);
    }
    json_t *o = json_pack("{s:s, s:i, s:i, s:f, s:o}", "format", "deltafin-heat-v1", "layers", x->L, "experts",
                          x->E, "decay_per_token", XS_HEAT_DECAY, "heat", rows);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int rc = o ? json_dump_file(o, tmp, JSON_COMPACT) : -1;
    json_decref(o);
    if (rc != 0 || rename(tmp, path) != 0) {
        remove(tmp);
        return df_fail(err, DF_ERR_IO, "%s: cannot write the heat statistics", path);
    }
    return DF_OK;
}

df_status xs_heat_load(xs_store *x, const char *path, char *err) {
    if (access(path, F_OK) != 0) return DF_OK;
    json_error_t je;
    json_t *o = json_load_file(path, 0, &je);
    if (!o) return df_fail(err, DF_ERR_FORMAT, "%s: not valid JSON (line %d: %s)", path, je.line, je.text);
    json_t *rows = json_object_get(o, "heat");
    df_status st = DF_OK;
    if ((int)json_integer_value(json_object_get(o, "layers")) != x->L ||
        (int)json_integer_value(json_object_get(o, "experts")) != x->E || !json_is_array(rows) ||
        (int)json_array_size(rows) != x->L) {
        st = df_fail(err, DF_ERR_MISMATCH, "%s: heat statistics are for another model (%d layers x %d experts expected)",
                     path, x->L, x->E);
    } else {
        for (int l = 0; l < x->L; l++) {
            json_t *r = json_array_get(rows, (size_t)l);
            for (int e = 0; e < x->E && e < (int)json_array_size(r); e++) {
                x->heat[(int64_t)l * x->E + e] = (float)json_number_value(json_array_get(r, (size_t)e));
                x->heat_at[(int64_t)l * x->E + e] = x->step;
            }
        }
    }
    json_decref(o);
    return st;
}

typedef struct { float heat; int32_t key; } heat_key;

static int by_heat(const void *a, const void *b) {
    const heat_key *x = a, *y = b;
    if (x->heat != y->heat) return x->heat > y->heat ? -1 : 1;
    return x->key < y->key ? -1 : x->key > y->key;
}

df_status xs_pin_hottest(xs_store *x, int64_t bytes, int per_pass, char *err) {
    int64_t n = (int64_t)x->L * x->E, cand = 0;
    heat_key *keys = malloc((size_t)(n ? n : 1) * sizeof *keys);
    if (!keys) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int64_t k = 0; k < n; k++)
        if (x->ex[k].reg && x->heat[k] > 0) keys[cand++] = (heat_key){heat_now(x, k), (int32_t)k};
    qsort(keys, (size_t)cand, sizeof keys[0], by_heat);
    int room = x->n_slots - 2 * (per_pass > 0 ? per_pass : 1);
    int64_t want = bytes / x->slot_bytes;
    if (want > room) want = room;
    int pinned = 0;
    for (int64_t i = 0; i < cand && pinned < want; i++) {
        int si = start_load(x, keys[i].key, 0);
        if (si < 0) break;
        x->slots[si].pins = 1;
        x->slots[si].pinned = 1;
        pinned++;
    }
    free(keys);
    xs_drain(x);
    x->stats.pinned = 0;
    for (int i = 0; i < x->n_slots; i++) x->stats.pinned += x->slots[i].pinned && x->slots[i].state == SLOT_READY;
    return DF_OK;
}

/* ---- file checks ---- */

df_status xs_check_files(const xs_store *x, char *err) {
    for (int i = 0; i < x->n_shards; i++) {
        int64_t sz = -1;
        struct stat sb;
        int changed = io_fsize(x->io, x->fd_buf[i], &sz) != 0 || sz != x->fsize[i];
        /* a table that fills holes in place (a stream mirror) changes the
         * modification time itself: then only the size is checked */
        if (!changed && !x->io->fills_in_place && fstat(x->fd_buf[i], &sb) == 0)
            changed = PORT_ST_MTIM(sb).tv_sec != x->mtime[i].tv_sec || PORT_ST_MTIM(sb).tv_nsec != x->mtime[i].tv_nsec;
        if (changed)
            return df_fail(err, DF_ERR_IO,
                           "%s changed while the model was open (size %lld -> %lld bytes or a new "
                           "modification time): reopen the model",
                           st_shard_path(x->st, i), (long long)x->fsize[i], (long long)sz);
    }
    return DF_OK;
}

int64_t xs_pool_bytes(const xs_store *x) { return x->pool_bytes; }
void *xs_pool(const xs_store *x) { return x->pool; }
int xs_registered(const xs_store *x) {
    int n = 0;
    for (int64_t k = 0; k < (int64_t)x->L * x->E; k++) n += x->ex[k].reg != 0;
    return n;
}
void xs_templates(const xs_store *x, int layer, int e, df_weight w[XS_MATS]) {
    memcpy(w, x->ex[(size_t)layer * x->E + e].w, sizeof(df_weight) * XS_MATS);
}

/* ---- stats ---- */

void xs_get_stats(const xs_store *x, xs_stats *s) {
    *s = x->stats;
    int used = 0;
    for (int i = 0; i < x->n_slots; i++) used += x->slots[i].state != SLOT_EMPTY;
    s->slots_used = used;
    s->dio_mem_align = 0;
    for (int i = 0; i < x->n_shards; i++)
        if (x->mem_align[i] > s->dio_mem_align) s->dio_mem_align = x->mem_align[i];
}

void xs_reset_stats(xs_store *x) {
    int slots = x->stats.slots, pinned = x->stats.pinned;
    int64_t sb = x->stats.slot_bytes;
    memset(&x->stats, 0, sizeof x->stats);
    x->stats.slots = slots;
    x->stats.slot_bytes = sb;
    x->stats.pinned = pinned;
}
