/* spine.c — the double-buffered layer streamer (see spine.h).
 *
 * Owns: the registered view list per group, the per-group read spans, two
 * slots, the shard descriptors and its own reader (so its completions never
 * mix with the expert store's).
 *
 * Sections: registration; finalize (spans, slots); reading; enter (and
 * skip: a group served from device copies, read only if a product fails).
 */
#include "spine.h"
#include "place.h"
#include "../base/port.h"
#include "../base/err.h"
#include "../base/mem.h"
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct {
    int shard;
    int direct;
    int64_t start, len;   /* tensor range covered (file offsets) */
    int64_t pos;          /* where `start` lands in the slot */
} sp_span;

typedef struct {
    df_weight **views;
    int nv, capv;
    sp_span *spans;
    int ns;
    int64_t bytes;        /* slot bytes this group needs */
} sp_group;

struct sp_store {
    const df_io *io;
    st_set *st;
    int n_groups, direct, plan_only;
    sp_group *g;
    int n_shards;
    int *fd_direct, *fd_buf;
    int64_t *fsize;
    int *mem_align;       /* [n_shards] memory alignment of the shard's O_DIRECT reads; 0 none */
    int dio_mem_align;    /* sp_set_dio_mem_align's; 0: asked per shard */
    xs_reader *rd;
    uint8_t *slot[2];
    struct mem_fill *fill[2]; /* populating each buffer in the background (mem.h) */
    int64_t slot_bytes;
    int held[2];          /* group in each slot, -1 none */
    int loading[2];       /* reads outstanding per slot */
    int failed[2];
    int64_t bytes_read;
    int (*needs)(void *ctx, int group); /* read-ahead hook (NULL: every group is read) */
    void *needs_ctx;
};

/* ---- registration ---- */

df_status sp_new(const df_io *io, st_set *st, int n_groups, int direct, int plan_only, sp_store **out,
                 char *err) {
    *out = NULL;
    sp_store *s = calloc(1, sizeof *s);
    if (!s) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    s->io = io;
    s->st = st;
    s->n_groups = n_groups;
    s->direct = direct;
    s->plan_only = plan_only;
    s->g = calloc((size_t)n_groups, sizeof(sp_group));
    s->held[0] = s->held[1] = -1;
    if (!s->g) { free(s); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    *out = s;
    return DF_OK;
}

void sp_free(sp_store *s) {
    if (!s) return;
    xr_close(s->rd);
    for (int i = 0; s->fd_buf && i < s->n_shards; i++) {
        if (s->fd_buf[i] >= 0) io_close(s->io, s->fd_buf[i]);
        if (s->fd_direct[i] >= 0) io_close(s->io, s->fd_direct[i]);
    }
    for (int k = 0; k < 2; k++) {
        mem_fill_stop(s->fill[k]);
        if (s->slot[k]) munmap(s->slot[k], (size_t)s->slot_bytes);
    }
    for (int i = 0; i < s->n_groups; i++) { free(s->g[i].views); free(s->g[i].spans); }
    free(s->g); free(s->fd_direct); free(s->fd_buf); free(s->fsize); free(s->mem_align);
    free(s);
}

df_status sp_register(sp_store *s, int group, df_weight *w, char *err) {
    if (group < 0 || group >= s->n_groups) return df_fail(err, DF_ERR_ARG, "spine group %d out of range", group);
    sp_group *g = &s->g[group];
    if (g->nv == g->capv) {
        int cap = g->capv ? g->capv * 2 : 16;
        df_weight **nv = realloc(g->views, (size_t)cap * sizeof *nv);
        if (!nv) return df_fail(err, DF_ERR_NOMEM, "out of memory");
        g->views = nv;
        g->capv = cap;
    }
    g->views[g->nv++] = w;
    return DF_OK;
}

/* ---- finalize ---- */

static int64_t align_down(int64_t v) { return v / XR_ALIGN * XR_ALIGN; }
static int64_t align_up(int64_t v) { return (v + XR_ALIGN - 1) / XR_ALIGN * XR_ALIGN; }

static int cmp_t(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Merges a group's tensors into spans (neighbours within 4 MiB in one shard)
 * and lays them out in a slot. A direct read lands at the shard's memory
 * alignment, shifted where that puts its span's first tensor on a
 * PLACE_ALIGN line (and the next ones with it where their sizes keep them
 * there: every tensor of the K3 layouts); a device that wants whole blocks
 * leaves the file's offsets. */
static df_status plan_group(sp_store *s, sp_group *g, char *err) {
    const st_tensor **t = malloc((size_t)(2 * g->nv + 1) * sizeof *t);
    if (!t) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    int nt = 0;
    for (int i = 0; i < g->nv; i++) {
        if (g->views[i]->t_data) t[nt++] = g->views[i]->t_data;
        if (g->views[i]->t_scale) t[nt++] = g->views[i]->t_scale;
    }
    qsort(t, (size_t)nt, sizeof *t, cmp_t);
    g->spans = calloc((size_t)(nt ? nt : 1), sizeof(sp_span));
    if (!g->spans) { free(t); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    for (int i = 0; i < nt; i++) {
        sp_span *p = g->ns ? &g->spans[g->ns - 1] : NULL;
        if (p && p->shard == t[i]->shard && t[i]->offset - (p->start + p->len) <= ((int64_t)4 << 20)) {
            int64_t end = t[i]->offset + t[i]->nbytes;
            if (end > p->start + p->len) p->len = end - p->start;
        } else {
            p = &g->spans[g->ns++];
            p->shard = t[i]->shard;
            p->start = t[i]->offset;
            p->len = t[i]->nbytes;
        }
    }
    free(t);
    int64_t pos = 0;
    for (int i = 0; i < g->ns; i++) {
        sp_span *p = &g->spans[i];
        int64_t a = align_down(p->start), b = align_up(p->start + p->len);
        p->direct = s->fd_direct[p->shard] >= 0 && b <= s->fsize[p->shard];
        if (p->direct) {
            const int64_t lead = p->start - a, shift = place_read_shift(pos, lead, s->mem_align[p->shard]);
            p->pos = pos + shift + lead;
            pos = align_up(pos + shift + (b - a));
        } else {
            p->pos = pos;
            pos = align_up(pos + p->len);
        }
    }
    g->bytes = align_up(pos);
    return DF_OK;
}

df_status sp_finalize(sp_store *s, char *err) {
    s->n_shards = st_n_shards(s->st);
    s->fd_direct = malloc((size_t)s->n_shards * sizeof(int));
    s->fd_buf = malloc((size_t)s->n_shards * sizeof(int));
    s->fsize = calloc((size_t)s->n_shards, sizeof(int64_t));
    s->mem_align = calloc((size_t)s->n_shards, sizeof(int));
    if (!s->fd_direct || !s->fd_buf || !s->fsize || !s->mem_align) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int i = 0; i < s->n_shards; i++) s->fd_direct[i] = s->fd_buf[i] = -1;
    for (int i = 0; i < s->n_shards; i++) {
        const char *p = st_shard_path(s->st, i);
        s->fd_buf[i] = io_open(s->io, p, O_RDONLY | O_CLOEXEC, 0);
        if (s->fd_buf[i] < 0 || io_fsize(s->io, s->fd_buf[i], &s->fsize[i]) != 0)
            return df_fail(err, DF_ERR_IO, "%s: cannot open for streaming: %s", p, strerror(errno));
        if (s->direct) s->fd_direct[i] = io_open(s->io, p, O_RDONLY | O_CLOEXEC | DF_O_DIRECT, 0);
        if (s->fd_direct[i] >= 0)
            s->mem_align[i] = s->dio_mem_align > 0 ? s->dio_mem_align : port_dio_mem_align(p, XR_ALIGN);
    }
    df_status st;
    s->slot_bytes = XR_ALIGN;
    for (int i = 0; i < s->n_groups; i++) {
        if ((st = plan_group(s, &s->g[i], err))) return st;
        if (s->g[i].bytes > s->slot_bytes) s->slot_bytes = s->g[i].bytes;
    }
    if (s->plan_only) return DF_OK;
    for (int k = 0; k < 2; k++) {
        /* populated in the background, not at open (mem.h) */
        void *p = mmap(NULL, (size_t)s->slot_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return df_fail(err, DF_ERR_NOMEM, "cannot allocate the spine buffers (2 x %.1f MB)", s->slot_bytes / 1e6);
        s->slot[k] = p;
        s->fill[k] = mem_fill_start(p, (size_t)s->slot_bytes);
    }
    return xr_open(s->io, XR_AUTO, 32, 8, &s->rd, err);
}

int64_t sp_slot_bytes(const sp_store *s) { return s->slot_bytes; }
int sp_n_groups(const sp_store *s) { return s->n_groups; }
int sp_views(const sp_store *s, int group, df_weight *const **views) {
    if (group < 0 || group >= s->n_groups) { *views = NULL; return 0; }
    *views = s->g[group].views;
    return s->g[group].nv;
}
void sp_set_dio_mem_align(sp_store *s, int align) { s->dio_mem_align = align; }
void sp_set_needs_hook(sp_store *s, int (*needs)(void *ctx, int group), void *ctx) {
    s->needs = needs;
    s->needs_ctx = ctx;
}
void *sp_slot(const sp_store *s, int k) { return k == 0 || k == 1 ? s->slot[k] : NULL; }
int64_t sp_bytes_read(const sp_store *s) { return s->bytes_read; }

/* ---- reading ---- */

static void reap(sp_store *s, int block) {
    xr_done d[32];
    int n = block ? xr_wait(s->rd, d, 32) : xr_poll(s->rd, d, 32);
    for (int i = 0; i < n; i++) {
        int k = (int)d[i].user;
        s->loading[k]--;
        if (d[i].err) s->failed[k] = d[i].err;
    }
}

/* Submits group g's reads into slot k (which must be idle). */
static void start(sp_store *s, int k, int g) {
    sp_group *gr = &s->g[g];
    s->held[k] = g;
    s->failed[k] = 0;
    for (int i = 0; i < gr->ns; i++) {
        const sp_span *p = &gr->spans[i];
        int64_t a = p->direct ? align_down(p->start) : p->start;
        int64_t len = p->direct ? align_up(p->start + p->len) - a : p->len;
        uint8_t *dst = s->slot[k] + (p->pos - (p->start - a));
        int rc = xr_submit(s->rd, p->direct ? s->fd_direct[p->shard] : s->fd_buf[p->shard], p->direct, dst,
                           (size_t)len, a, (uint64_t)k);
        if (rc) { s->failed[k] = rc; break; }
        s->loading[k]++;
        s->bytes_read += len;
    }
}

/* ---- enter ---- */

/* How far the read-ahead looks past groups served from the device: each
 * look asks the hook (a check of every matrix of the group), so a spine
 * held wholly on the device costs a few checks per group, not all of them. */
enum { SP_LOOK = 4 };

/* The first group after `group` (wrapping, never `group` itself, at most
 * SP_LOOK on) that the hook says needs its bytes; -1 if none. */
static int next_needed(const sp_store *s, int group) {
    for (int i = 1; i < s->n_groups && i <= SP_LOOK; i++) {
        int g = (group + i) % s->n_groups;
        if (!s->needs || s->needs(s->needs_ctx, g)) return g;
    }
    return -1;
}

/* Starts reading the next needed group after `group` unless a slot already
 * holds it; never into slot `busy` (the group being computed, -1: none). */
static void read_ahead(sp_store *s, int group, int busy) {
    int next = next_needed(s, group);
    if (next < 0 || s->held[0] == next || s->held[1] == next) return;
    int o = busy >= 0 ? 1 - busy : s->held[0] < 0 ? 0 : s->held[1] < 0 ? 1 : s->loading[0] ? 1 : 0;
    while (s->loading[o] > 0) reap(s, 1);
    start(s, o, next);
}

df_status sp_enter(sp_store *s, int group, char *err) {
    int k = s->held[0] == group ? 0 : s->held[1] == group ? 1 : -1;
    if (k < 0) {
        /* not read ahead: a slot that holds nothing, else one that does
         * not hold the next group's read-ahead */
        int ahead = next_needed(s, group);
        k = s->held[0] < 0 ? 0 : s->held[1] < 0 ? 1 : s->held[0] == ahead ? 1 : 0;
        while (s->loading[k] > 0) reap(s, 1);
        start(s, k, group);
    }
    while (s->loading[k] > 0) reap(s, 1);
    if (s->failed[k]) {
        int e = s->failed[k];
        s->held[k] = -1;
        s->failed[k] = 0;
        return df_fail(err, DF_ERR_IO, "reading the weights of layer group %d failed: %s", group, strerror(e));
    }
    sp_group *g = &s->g[group];
    for (int i = 0; i < g->nv; i++) {
        df_weight *w = g->views[i];
        const st_tensor *ts[2] = {w->t_data, w->t_scale};
        for (int j = 0; j < 2; j++) {
            if (!ts[j]) continue;
            for (int q = 0; q < g->ns; q++) {
                const sp_span *p = &g->spans[q];
                if (p->shard == ts[j]->shard && ts[j]->offset >= p->start &&
                    ts[j]->offset + ts[j]->nbytes <= p->start + p->len) {
                    const void *ptr = s->slot[k] + p->pos + (ts[j]->offset - p->start);
                    if (j == 0) w->data = ptr;
                    else w->scale = ptr;
                    break;
                }
            }
        }
    }
    read_ahead(s, group, k); /* the next group into the other slot */
    return DF_OK;
}

void sp_skip(sp_store *s, int group) {
    if (group < 0 || group >= s->n_groups) return;
    sp_group *g = &s->g[group];
    for (int i = 0; i < g->nv; i++) {
        g->views[i]->data = NULL; /* no host bytes: an earlier read's slot is not this group's any more */
        if (g->views[i]->t_scale) g->views[i]->scale = NULL;
    }
    read_ahead(s, group, -1);
}
