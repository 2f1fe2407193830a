/* accel.c — the engine's side of an optional accelerator (df_engine_opts.accel).
 *
 * Owns a table of device copies keyed by the tensor behind a matrix
 * (df_weight.t_data, else its data pointer), so copies of a view (a tied
 * head, the expert store's per-pass views over RAM slots) find the same
 * entry. States:
 *   PENDING   bound resident at open; uploaded on first use, then RESIDENT
 *             (kept; the embedding of an untied model is never uploaded)
 *   RESIDENT  device copy kept until close
 *   CACHED    device copy in the LRU cache (routed experts, streamed spine,
 *             resident matrices that did not fit the budget)
 *   ABSENT    known, no device copy now (evicted, or never fitted)
 *   CPU       the accelerator refused it (type or shape): CPU kernels
 * A streamed spine (--spine stream) is planned at open (acc_keep_group): its
 * layer groups, in order, are bound PENDING (kept resident, ahead of expert
 * copies) while they fit beside the resident matrices and one layer's
 * experts; the rest go through the LRU. A group whose every matrix has a
 * copy is served without reading it (acc_hold: its cached copies are held,
 * never evicted, until the next group is entered).
 * Also the device activation blocks sessions take (acc_dev_alloc, at most
 * 64), so a pointer into one is known for what it is (acc_is_dev), and
 * mm_many_dev (products of device rows; what the device does not take runs
 * on the CPU over rows brought back).
 * Budget: resident + cached bytes <= accel->budget; a matrix that cannot fit
 * even after evicting every cached copy is uploaded for the call and
 * released after it (transient). Any device failure falls back to the CPU
 * kernels for that call, so a failure never changes the result's meaning.
 */
#include "model.h"
#include "../base/err.h"
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <time.h>

enum { A_PENDING = 0, A_RESIDENT, A_CACHED, A_ABSENT, A_CPU };

typedef struct {
    const void *key;
    void *h;
    int64_t bytes;
    int32_t prev, next; /* LRU list of CACHED entries (indices, -1 = none) */
    int state;
    int busy; /* being handed to acc_expert_queue: not evicted */
    int hold; /* a streamed spine group served from its copies (acc_hold): not evicted */
    const void *src[2];  /* host bytes of a matrix bound resident (data, scale; NULL: lazily bound) */
    int64_t src_bytes[2];
} acc_ent;

/* Entries live in a growing array (indices stay valid); an open-addressing
 * index (power-of-two capacity, no deletions) finds them by key. The CACHED
 * ones form a list, least recently used first, so an eviction is O(1). */
struct acc_table {
    const df_accel *a;
    acc_ent *ent;
    size_t n, ent_cap;
    int32_t *index; /* entry + 1; 0 = empty */
    size_t cap;
    int32_t lru_head, lru_tail;
    int64_t planned_bytes; /* PENDING + RESIDENT */
    void **pins;           /* host ranges page-locked through a->pin (unpinned in acc_free) */
    int npins, cap_pins;
    int experts_pinned;    /* the expert cache is among them */
    int spine_pin_tried;   /* pin_spine_ranges ran (once at most) */
    int32_t *held;         /* entries with hold set (acc_hold) */
    int nheld, cap_held;
    df_accel_stats st;
    float *dev_blk[64];    /* device activation blocks (acc_dev_alloc: a session each), for acc_is_dev */
    int64_t dev_len[64];   /* their floats */
    int dev_used;          /* slots ever used: acc_is_dev looks no further (0 without blocks) */
    int queued_host;       /* an expert queued since the last finish reads or writes host memory */
    char err[DF_ERRMSG];
    char last_err[DF_ERRMSG];
};

static const void *key_of(const df_weight *w) { return w->t_data ? (const void *)w->t_data : w->data; }

static size_t slot_of(const void *k, size_t cap) {
    uint64_t x = (uint64_t)(uintptr_t)k;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (size_t)x & (cap - 1);
}

static acc_ent *find(acc_table *t, const void *k) {
    for (size_t i = slot_of(k, t->cap);; i = (i + 1) & (t->cap - 1)) {
        if (!t->index[i]) return NULL;
        if (t->ent[t->index[i] - 1].key == k) return &t->ent[t->index[i] - 1];
    }
}

static void index_put(int32_t *index, size_t cap, const void *k, int32_t id) {
    size_t i = slot_of(k, cap);
    while (index[i]) i = (i + 1) & (cap - 1);
    index[i] = id + 1;
}

static acc_ent *insert(acc_table *t, const void *k, int64_t bytes, int state) {
    if (t->n >= 0x7ffffffe) return NULL;
    if ((t->n + 1) * 2 > t->cap) {
        size_t nc = t->cap * 2;
        int32_t *ni = calloc(nc, sizeof *ni);
        if (!ni) return NULL;
        for (size_t i = 0; i < t->n; i++) index_put(ni, nc, t->ent[i].key, (int32_t)i);
        free(t->index);
        t->index = ni;
        t->cap = nc;
    }
    if (t->n == t->ent_cap) {
        size_t nc = t->ent_cap * 2;
        acc_ent *ne = realloc(t->ent, nc * sizeof *ne);
        if (!ne) return NULL;
        t->ent = ne;
        t->ent_cap = nc;
    }
    acc_ent *e = &t->ent[t->n];
    memset(e, 0, sizeof *e);
    e->key = k;
    e->bytes = bytes;
    e->state = state;
    e->prev = e->next = -1;
    index_put(t->index, t->cap, k, (int32_t)t->n);
    t->n++;
    return e;
}

static void lru_unlink(acc_table *t, acc_ent *e) {
    if (e->prev >= 0) t->ent[e->prev].next = e->next; else t->lru_head = e->next;
    if (e->next >= 0) t->ent[e->next].prev = e->prev; else t->lru_tail = e->prev;
    e->prev = e->next = -1;
}

static void lru_push(acc_table *t, acc_ent *e) { /* as most recently used */
    int32_t id = (int32_t)(e - t->ent);
    e->prev = t->lru_tail;
    e->next = -1;
    if (t->lru_tail >= 0) t->ent[t->lru_tail].next = id; else t->lru_head = id;
    t->lru_tail = id;
}

acc_table *acc_new(const df_accel *a) {
    acc_table *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->a = a;
    t->cap = 1024;
    t->ent_cap = 512;
    t->lru_head = t->lru_tail = -1;
    t->index = calloc(t->cap, sizeof *t->index);
    t->ent = malloc(t->ent_cap * sizeof *t->ent);
    if (!t->index || !t->ent) {
        free(t->index);
        free(t->ent);
        free(t);
        return NULL;
    }
    return t;
}

void acc_free(acc_table *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n; i++)
        if (t->ent[i].h) t->a->release(t->a->ctx, t->ent[i].h);
    for (int i = 0; i < t->npins && t->a->unpin; i++) t->a->unpin(t->a->ctx, t->pins[i]);
    free(t->pins);
    free(t->held);
    free(t->ent);
    free(t->index);
    free(t);
}

int acc_pin_range(acc_table *t, void *p, int64_t bytes) {
    if (!t || !p || bytes <= 0 || !t->a->pin) return 0;
    if (t->npins == t->cap_pins) {
        int nc = t->cap_pins ? 2 * t->cap_pins : 8;
        void **np = realloc(t->pins, (size_t)nc * sizeof *np);
        if (!np) return 0;
        t->pins = np;
        t->cap_pins = nc;
    }
    if (t->a->pin(t->a->ctx, p, (size_t)bytes, t->err) != DF_OK) {
        snprintf(t->last_err, sizeof t->last_err, "%s", t->err);
        return 0;
    }
    t->pins[t->npins++] = p;
    t->st.spine_pinned_bytes += bytes;
    return 1;
}

int acc_pin_host(acc_table *t, void *p, int64_t bytes) {
    if (!t || t->experts_pinned || !acc_pin_range(t, p, bytes)) return 0;
    t->st.spine_pinned_bytes -= bytes; /* counted as the expert cache's */
    t->st.pinned_bytes = bytes;
    t->experts_pinned = 1;
    return 1;
}

typedef struct {
    uintptr_t a, b;
} range;

static int by_start(const void *x, const void *y) {
    const range *p = x, *q = y;
    return p->a < q->a ? -1 : p->a > q->a;
}

/* Page-locks the host bytes of every matrix bound resident, once. */
static int64_t pin_spine_ranges(acc_table *t) {
    if (!t->a->pin || t->spine_pin_tried) return 0;
    t->spine_pin_tried = 1;
    const uintptr_t page = 4096;
    range *r = malloc(2 * t->n * sizeof *r + 1);
    if (!r) return 0;
    size_t nr = 0;
    for (size_t i = 0; i < t->n; i++)
        for (int k = 0; k < 2; k++) {
            const acc_ent *e = &t->ent[i];
            if (!e->src[k] || e->src_bytes[k] <= 0 || e->state == A_CPU) continue;
            uintptr_t a = (uintptr_t)e->src[k];
            r[nr++] = (range){a / page * page, (a + (uintptr_t)e->src_bytes[k] + page - 1) / page * page};
        }
    qsort(r, nr, sizeof *r, by_start);
    int64_t done = 0;
    for (size_t i = 0; i < nr;) {
        range m = r[i++];
        while (i < nr && r[i].a <= m.b) { /* overlapping or adjacent pages: one range */
            if (r[i].b > m.b) m.b = r[i].b;
            i++;
        }
        if (acc_pin_range(t, (void *)m.a, (int64_t)(m.b - m.a))) done += (int64_t)(m.b - m.a);
    }
    free(r);
    return done;
}

int64_t acc_pin_spine(acc_table *t) {
    if (!t || t->planned_bytes <= t->a->budget) return 0;
    return pin_spine_ranges(t);
}

void acc_bind(acc_table *t, const df_weight *w) {
    const void *k = key_of(w);
    if (!t || !k || find(t, k)) return;
    acc_ent *e = insert(t, k, wt_bytes(w), A_PENDING);
    if (!e) return;
    t->planned_bytes += wt_bytes(w);
    if (w->data && w->t_data) {
        e->src[0] = w->data;
        e->src_bytes[0] = w->t_data->nbytes;
    }
    if (w->scale && w->t_scale) {
        e->src[1] = w->scale;
        e->src_bytes[1] = w->t_scale->nbytes;
    }
}

static int64_t used_bytes(const acc_table *t) { return t->st.resident_bytes + t->st.cached_bytes; }

/* Evicts least recently used cached copies until `need` more bytes fit. */
static int make_room(acc_table *t, int64_t need) {
    if (need > t->a->budget - t->st.resident_bytes) return 0;
    while (used_bytes(t) + need > t->a->budget) {
        int32_t i = t->lru_head;
        while (i >= 0 && (t->ent[i].busy || t->ent[i].hold)) i = t->ent[i].next;
        if (i < 0) return 0;
        acc_ent *v = &t->ent[i];
        lru_unlink(t, v);
        t->a->release(t->a->ctx, v->h);
        v->h = NULL;
        v->state = A_ABSENT;
        t->st.cached_bytes -= v->bytes;
        t->st.cache_evictions++;
    }
    return 1;
}

/* Uploads w for entry e (state decides resident or cached). 1 if e->h is set. */
static int upload(acc_table *t, acc_ent *e, const df_weight *w, int resident) {
    if (!make_room(t, e->bytes)) return 0;
    int refused = 0;
    void *h = t->a->upload(t->a->ctx, w, &refused, t->err);
    if (!h) {
        if (refused) {
            if (e->state == A_PENDING) t->planned_bytes -= e->bytes;
            e->state = A_CPU;
            t->st.cpu_mats++;
        } else {
            snprintf(t->last_err, sizeof t->last_err, "%s", t->err);
        }
        return 0;
    }
    e->h = h;
    t->st.upload_bytes += (uint64_t)e->bytes;
    if (resident) {
        e->state = A_RESIDENT;
        t->st.resident_mats++;
        t->st.resident_bytes += e->bytes;
    } else {
        e->state = A_CACHED;
        lru_push(t, e);
        t->st.cached_bytes += e->bytes;
        t->st.cache_uploads++;
    }
    return 1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* After a host wait on the device that began at t0. */
static void sync_done(acc_table *t, double t0) {
    t->st.sync_s += now_s() - t0;
    t->st.sync_calls++;
}

/* A failed device call: its message (t->err) kept as the last error and
 * copied into err (when not NULL); returns st. */
static df_status call_failed(acc_table *t, df_status st, char *err) {
    snprintf(t->last_err, sizeof t->last_err, "%s", t->err);
    return df_fail(err, st, "%s", t->err);
}

/* First use of a matrix bound resident: uploaded to stay; if it does not
 * fit, it is cached from now on, and (the first time this happens) every
 * matrix bound resident is page-locked, since such matrices are uploaded
 * again and again. */
static void upload_pending(acc_table *t, acc_ent *e, const df_weight *w) {
    if (upload(t, e, w, 1) || e->state != A_PENDING) return;
    t->planned_bytes -= e->bytes;
    e->state = A_ABSENT;
    pin_spine_ranges(t);
}

/* The multiply-adds of w times n vectors, by weight type (bench's
 * tensor-core floor: df_accel_stats.macs_*). */
static void count_macs(acc_table *t, const df_weight *w, int n) {
    if (!w || n < 1) return;
    const uint64_t m = (uint64_t)w->rows * (uint64_t)w->cols * (uint64_t)n;
    if (w->type == WT_MXFP4) t->st.macs_mxfp4 += m;
    else if (w->type == WT_BF16 || w->type == WT_F16) t->st.macs_bf16 += m;
    else t->st.macs_other += m;
}

static int run(acc_table *t, void *h, const df_weight *w, const float *X, int n, float *Y, int64_t ldy) {
    double t0 = now_s();
    df_status st = t->a->matmul(t->a->ctx, h, X, n, Y, ldy, 0, w->rows, t->err);
    sync_done(t, t0);
    if (st != DF_OK) {
        call_failed(t, st, NULL);
        return 0;
    }
    t->st.calls++;
    t->st.device_read_bytes += (uint64_t)wt_bytes(w);
    count_macs(t, w, n);
    return 1;
}

int acc_on_device(acc_table *t, const df_weight *w) {
    const void *k = key_of(w);
    acc_ent *e = k ? find(t, k) : NULL;
    return e && e->h && (e->state == A_RESIDENT || e->state == A_CACHED);
}

void acc_count_tier_hit(acc_table *t) { t->st.tier_hits++; }

/* ---- a streamed spine's device copies ---- */

int acc_keep_group(acc_table *t, df_weight *const *v, int n, int64_t reserve) {
    if (!t || n < 1) return 0;
    int64_t bytes = 0;
    for (int i = 0; i < n; i++) {
        const void *k = key_of(v[i]);
        if (!k) return 0;
        if (!find(t, k)) bytes += wt_bytes(v[i]);
    }
    if (t->planned_bytes + bytes > t->a->budget - reserve) return 0;
    for (int i = 0; i < n; i++) {
        const void *k = key_of(v[i]);
        if (find(t, k)) continue;
        if (!insert(t, k, wt_bytes(v[i]), A_PENDING)) return 0;
        t->planned_bytes += wt_bytes(v[i]);
    }
    t->st.spine_kept_groups++;
    return 1;
}

int acc_views_on_device(acc_table *t, df_weight *const *v, int n) {
    if (!t || n < 1) return 0;
    for (int i = 0; i < n; i++)
        if (!acc_on_device(t, v[i])) return 0;
    return 1;
}

void acc_unhold(acc_table *t) {
    if (!t) return;
    for (int i = 0; i < t->nheld; i++) t->ent[t->held[i]].hold = 0;
    t->nheld = 0;
}

int acc_hold(acc_table *t, df_weight *const *v, int n) {
    acc_unhold(t);
    if (!acc_views_on_device(t, v, n)) return 0;
    if (t->cap_held < n) {
        int32_t *nh = realloc(t->held, (size_t)n * sizeof *nh);
        if (!nh) return 0;
        t->held = nh;
        t->cap_held = n;
    }
    for (int i = 0; i < n; i++) {
        acc_ent *e = find(t, key_of(v[i]));
        if (e->state != A_CACHED || e->hold) continue;
        e->hold = 1;
        t->held[t->nheld++] = (int32_t)(e - t->ent);
    }
    t->st.spine_groups_on_device++;
    return 1;
}

int acc_mm(acc_table *t, const df_weight *w, const float *X, int n, float *Y, int64_t ldy) {
    const void *k = key_of(w);
    if (!k) return 0;
    acc_ent *e = find(t, k);
    if (!w->data) { /* no host bytes: only a device copy can serve it */
        if (!e || !e->h || (e->state != A_RESIDENT && e->state != A_CACHED)) return 0;
        if (e->state == A_CACHED) {
            t->st.cache_hits++;
            lru_unlink(t, e);
            lru_push(t, e);
        }
        return run(t, e->h, w, X, n, Y, ldy);
    }
    if (!e && !(e = insert(t, k, wt_bytes(w), A_ABSENT))) return 0;
    if (e->state == A_CPU) { t->st.cpu_calls++; return 0; }
    if (e->state == A_PENDING) {
        upload_pending(t, e, w);
    } else if (e->state == A_ABSENT) {
        upload(t, e, w, 0);
    } else if (e->state == A_CACHED) {
        t->st.cache_hits++;
        lru_unlink(t, e);
        lru_push(t, e);
    }
    if (e->state == A_CPU) { t->st.cpu_calls++; return 0; }
    if (e->h) {
        if (run(t, e->h, w, X, n, Y, ldy)) return 1;
        t->st.cpu_calls++;
        return 0;
    }
    /* no room: upload for this call only */
    int refused = 0;
    void *h = t->a->upload(t->a->ctx, w, &refused, t->err);
    if (!h) {
        if (refused) { e->state = A_CPU; t->st.cpu_mats++; }
        t->st.cpu_calls++;
        return 0;
    }
    t->st.transient_uploads++;
    t->st.upload_bytes += (uint64_t)e->bytes;
    int ok = run(t, h, w, X, n, Y, ldy);
    t->a->release(t->a->ctx, h);
    if (!ok) t->st.cpu_calls++;
    return ok;
}

/* A device handle for w for one acc_expert_queue call: its cached or resident
 * copy (marked busy), else a fresh cached upload, else a transient one
 * (*transient = 1: the caller releases it). NULL when w stays on the CPU. */
static void *expert_handle(acc_table *t, const df_weight *w, acc_ent **ent, int *transient) {
    *ent = NULL;
    *transient = 0;
    const void *k = key_of(w);
    if (!k) return NULL;
    acc_ent *e = find(t, k);
    if (!e) {
        if (!w->data || !(e = insert(t, k, wt_bytes(w), A_ABSENT))) return NULL;
    }
    if (e->state == A_CPU) return NULL;
    if (e->h && (e->state == A_RESIDENT || e->state == A_CACHED)) {
        if (e->state == A_CACHED) {
            t->st.cache_hits++;
            lru_unlink(t, e);
            lru_push(t, e);
        }
    } else if (w->data && e->state == A_PENDING) {
        upload_pending(t, e, w);
        if (e->state == A_ABSENT) upload(t, e, w, 0);
    } else if (w->data && e->state == A_ABSENT) {
        upload(t, e, w, 0);
    }
    if (e->h) {
        e->busy = 1;
        *ent = e;
        return e->h;
    }
    if (!w->data || e->state == A_CPU) return NULL;
    int refused = 0;
    void *h = t->a->upload(t->a->ctx, w, &refused, t->err);
    if (!h) {
        if (refused) { e->state = A_CPU; t->st.cpu_mats++; }
        return NULL;
    }
    t->st.transient_uploads++;
    t->st.upload_bytes += (uint64_t)e->bytes;
    *transient = 1;
    return h;
}

/* Device handles for one accelerator call over a list of matrices. */
enum { HANDLES_MAX = DF_KDA_MATS }; /* the longest list: a KDA layer's */
_Static_assert(DF_MLA_MATS + 1 <= HANDLES_MAX, "an MLA layer's products and kv_b fit acc_handles");
typedef struct {
    void *h[HANDLES_MAX];   /* in the order of the list; NULL for a NULL matrix (or after a failure) */
    int32_t id[HANDLES_MAX]; /* entry marked busy (an index: expert_handle may move t->ent), -1 = none */
    int tr[HANDLES_MAX];    /* transient upload: released after the call */
    int n;                  /* the list's length */
    int count;              /* non-NULL matrices asked for */
    int64_t bytes;          /* their bytes */
} acc_handles;

/* Handles (through expert_handle, so each entry is busy and the next upload
 * does not evict it) for w[0..n), skipping NULL matrices. Returns 1 when
 * every one got a handle, else 0 (stopping at the first without one). The
 * caller calls release_handles either way. */
static int acquire_handles(acc_table *t, const df_weight *const *w, int n, acc_handles *hs) {
    int ok = 1;
    hs->n = n;
    hs->count = 0;
    hs->bytes = 0;
    for (int i = 0; i < n; i++) {
        hs->h[i] = NULL;
        hs->id[i] = -1;
        hs->tr[i] = 0;
        if (!w[i] || !ok) continue;
        acc_ent *ent = NULL;
        hs->h[i] = expert_handle(t, w[i], &ent, &hs->tr[i]);
        if (ent) hs->id[i] = (int32_t)(ent - t->ent);
        ok = hs->h[i] != NULL;
        hs->bytes += wt_bytes(w[i]);
        hs->count++;
    }
    return ok;
}

/* Ends acquire_handles: entries no longer busy, transient uploads released. */
static void release_handles(acc_table *t, const acc_handles *hs) {
    for (int i = 0; i < hs->n; i++) {
        if (hs->id[i] >= 0) t->ent[hs->id[i]].busy = 0;
        if (hs->tr[i]) t->a->release(t->a->ctx, hs->h[i]);
    }
}

/* Ends a device call over hs, made when ok and then returning st: releases
 * the handles; 0 when it was not made (every handle not had), -1 when it
 * failed (call_failed: err set), else 1. */
static int call_end(acc_table *t, const acc_handles *hs, int ok, df_status st, char *err) {
    release_handles(t, hs);
    if (!ok) return 0;
    if (st != DF_OK) {
        call_failed(t, st, err);
        return -1;
    }
    return 1;
}

/* The products of r the accelerator takes, in one matmul_many call (one
 * host wait, none when every input and output is on the device); done[i] =
 * 1 for each it computed. Needs two or more, or one on device memory. */
static void acc_mm_many(acc_table *t, const mm_req *r, int count, int *done) {
    enum { MANY_MAX = 16 };
    int on_dev = 0, all_dev = 1;
    for (int i = 0; t && i < count; i++) {
        int d = acc_is_dev(t, r[i].X) + acc_is_dev(t, r[i].Y);
        on_dev |= d > 0;
        all_dev &= d == 2;
    }
    if (!t || !t->a->matmul_many || count < (on_dev ? 1 : 2) || count > MANY_MAX) return;
    void *h[MANY_MAX];
    int32_t id[MANY_MAX];
    int tr[MANY_MAX], pick[MANY_MAX], np = 0;
    const float *X[MANY_MAX];
    float *Y[MANY_MAX];
    int n[MANY_MAX];
    int64_t ldy[MANY_MAX], bytes = 0;
    for (int i = 0; i < count; i++) {
        acc_ent *ent = NULL;
        int transient = 0;
        void *hi = expert_handle(t, r[i].w, &ent, &transient); /* marks ent busy: not evicted by the next */
        if (!hi) continue;
        h[np] = hi;
        id[np] = ent ? (int32_t)(ent - t->ent) : -1;
        tr[np] = transient;
        X[np] = r[i].X;
        Y[np] = r[i].Y;
        n[np] = r[i].n;
        ldy[np] = r[i].ldy;
        pick[np++] = i;
        bytes += wt_bytes(r[i].w);
    }
    df_status st = DF_OK;
    if (np) {
        double t0 = now_s();
        st = t->a->matmul_many(t->a->ctx, np, h, X, n, Y, ldy, t->err);
        if (!all_dev) sync_done(t, t0);
        if (st != DF_OK) call_failed(t, st, NULL);
    }
    for (int k = 0; k < np; k++) {
        if (id[k] >= 0) t->ent[id[k]].busy = 0;
        if (tr[k]) t->a->release(t->a->ctx, h[k]);
        if (st == DF_OK) done[pick[k]] = 1;
    }
    if (np && st == DF_OK) {
        t->st.calls += (uint64_t)np;
        t->st.device_read_bytes += (uint64_t)bytes;
        for (int k = 0; k < np; k++) count_macs(t, r[pick[k]].w, n[k]);
    }
}

/* One product the accelerator did not take, on the CPU, with X or Y in
 * device memory brought over (Y on the device needs ldy == w's rows). */
static df_status mm_via_host(df_engine *e, const mm_req *r, char *err) {
    const int dx = acc_is_dev(e->acc, r->X), dy = acc_is_dev(e->acc, r->Y);
    const size_t nx = (size_t)r->n * (size_t)r->w->cols, ny = (size_t)r->n * (size_t)r->w->rows;
    if (dy && r->ldy != r->w->rows) return df_fail(err, DF_ERR_ARG, "device output with a row stride");
    float *hx = dx ? malloc(nx * sizeof(float)) : NULL, *hy = dy ? malloc(ny * sizeof(float)) : NULL;
    df_status st = (dx && !hx) || (dy && !hy) ? df_fail(err, DF_ERR_NOMEM, "out of memory") : DF_OK;
    if (st == DF_OK && dx) st = acc_dev_get(e->acc, hx, r->X, (int64_t)nx, err);
    if (st == DF_OK) {
        mm(e, r->w, dx ? hx : r->X, r->n, dy ? hy : r->Y, r->ldy);
        if (dy) st = acc_dev_put(e->acc, r->Y, hy, (int64_t)ny, err);
    }
    free(hx);
    free(hy);
    return st;
}

df_status mm_many_dev(df_engine *e, const mm_req *r, int count, char *err) {
    int done[16] = {0};
    if (count <= 16) acc_mm_many(e->acc, r, count, done);
    mm_req host[16]; /* host operands: on the CPU in one pass */
    int nh = 0;
    for (int i = 0; i < count; i++) {
        if (i < 16 && done[i]) continue;
        if (nh < 16 && !acc_is_dev(e->acc, r[i].X) && !acc_is_dev(e->acc, r[i].Y)) {
            host[nh++] = r[i];
            continue;
        }
        df_status st = mm_via_host(e, &r[i], err);
        if (st != DF_OK) return st;
    }
    mm_host_many(e, host, nh);
    return DF_OK;
}

/* Host X and Y: mm_via_host is then mm, which cannot fail. */
void mm_many(df_engine *e, const mm_req *r, int count) { (void)mm_many_dev(e, r, count, NULL); }

void acc_prefetch(acc_table *t, const df_weight *w, int n) {
    for (int i = 0; t && i < n; i++) {
        const void *k = key_of(&w[i]);
        if (!k || !w[i].data) continue;
        acc_ent *e = find(t, k);
        if (!e && !(e = insert(t, k, wt_bytes(&w[i]), A_ABSENT))) return;
        if (e->state == A_ABSENT) upload(t, e, &w[i], 0);
    }
}

int acc_expert_queue(acc_table *t, const df_weight w[3], int situ, float beta, float linear_beta, const float *X,
                     int n, float *out, const int *rows, int64_t out_stride) {
    if (!t || !t->a->expert_queue || !t->a->expert_finish) return 0;
    const df_weight *const mats[3] = {&w[0], &w[1], &w[2]};
    acc_handles hs;
    int ok = acquire_handles(t, mats, 3, &hs);
    if (ok) {
        df_status st = t->a->expert_queue(t->a->ctx, hs.h[0], hs.h[1], hs.h[2], situ, beta, linear_beta, X, n, out,
                                          rows, out_stride, t->err);
        if (!acc_is_dev(t, X) || !acc_is_dev(t, out)) t->queued_host = 1;
        if (st != DF_OK) {
            call_failed(t, st, NULL);
            ok = 0;
        }
    }
    release_handles(t, &hs);
    if (ok) {
        t->st.calls += 3;
        t->st.device_read_bytes += (uint64_t)hs.bytes;
        for (int k = 0; k < 3; k++) count_macs(t, mats[k], n);
    }
    return ok;
}

df_status acc_expert_finish(acc_table *t, char *err) {
    if (!t || !t->a->expert_finish) return DF_OK;
    double t0 = now_s();
    df_status st = t->a->expert_finish(t->a->ctx, t->err);
    if (t->queued_host) sync_done(t, t0); /* else only device outputs: no wait */
    t->queued_host = 0;
    if (st != DF_OK) return call_failed(t, st, err);
    return DF_OK;
}

void acc_uploads_wait(acc_table *t) {
    if (t && t->a->uploads_wait) t->a->uploads_wait(t->a->ctx);
}

/* ---- session state on the device (KDA) ---- */

static int has_states(const acc_table *t) {
    return t && t->a->state_new && t->a->state_free && t->a->state_zero;
}
int acc_has_kda(const acc_table *t) { return has_states(t) && t->a->kda; }
int acc_has_mla(const acc_table *t) { return has_states(t) && t->a->mla; }

void *acc_state_new(acc_table *t, const df_accel_kda *kda, const df_accel_mla *mla, int64_t bytes) {
    if (kda ? !acc_has_kda(t) : !acc_has_mla(t)) return NULL;
    void *st = t->a->state_new(t->a->ctx, kda, mla, bytes, t->err);
    if (!st) snprintf(t->last_err, sizeof t->last_err, "%s", t->err);
    return st;
}

void acc_state_free(acc_table *t, void *state) {
    if (t && state) t->a->state_free(t->a->ctx, state);
}

void **acc_states_new(acc_table *t, int count, const df_accel_kda *const *kda, const df_accel_mla *const *mla,
                      int64_t bytes) {
    if (count < 1 || (kda ? !acc_has_kda(t) : !acc_has_mla(t))) return NULL;
    void **st = calloc((size_t)count, sizeof *st);
    if (!st) return NULL;
    for (int i = 0; i < count; i++)
        if (!(st[i] = acc_state_new(t, kda ? kda[i] : NULL, kda ? NULL : mla[i], bytes))) {
            acc_states_free(t, st, i);
            return NULL;
        }
    return st;
}

void acc_states_free(acc_table *t, void **st, int count) {
    if (!st) return;
    for (int i = 0; i < count; i++) acc_state_free(t, st[i]);
    free(st);
}

df_status acc_state_zero(acc_table *t, void *state, char *err) {
    df_status st = t->a->state_zero(t->a->ctx, state, t->err);
    if (st != DF_OK) return df_fail(err, st, "%s", t->err);
    return DF_OK;
}

df_status acc_kda(acc_table *t, const df_accel_kda *layer, void *state, int n, const float *q, const float *k,
                  const float *v, const float *f, const float *braw, const float *gate, float *o, char *err) {
    double t0 = now_s();
    df_status st = t->a->kda(t->a->ctx, layer, state, n, q, k, v, f, braw, gate, o, t->err);
    sync_done(t, t0);
    if (st != DF_OK) return call_failed(t, st, err);
    t->st.kda_calls++;
    /* the recurrent state S [H][D][D] is read once per launch */
    t->st.device_read_bytes += (uint64_t)layer->H * layer->D * layer->D * sizeof(float);
    return DF_OK;
}

int acc_moe_tail(acc_table *t, int n, int K, const float *selw, const float *routed, int64_t dl,
                 const float *lat_norm, float eps, const df_weight *lat_up, const float *shared, float *out,
                 char *err) {
    if (!t || !t->a->moe_tail || !t->a->expert_queue) return 0;
    acc_handles hs;
    if (!acquire_handles(t, &lat_up, 1, &hs)) return 0;
    double t0 = now_s();
    df_status st = t->a->moe_tail(t->a->ctx, n, K, selw, routed, dl, lat_norm, eps, hs.h[0], shared, out, t->err);
    if (!acc_is_dev(t, out)) sync_done(t, t0);
    t->queued_host = 0;
    int r = call_end(t, &hs, 1, st, err);
    if (r != 1) return r;
    t->st.calls++;
    t->st.device_read_bytes += (uint64_t)wt_bytes(lat_up);
    count_macs(t, lat_up, n);
    return 1;
}

int acc_kda_layer(acc_table *t, const df_accel_kda *layer, void *state, int n, const df_weight *const *w,
                  const float *xn, float *out, char *err) {
    if (!acc_has_kda(t) || !t->a->kda_layer) return 0;
    acc_handles hs;
    int ok = acquire_handles(t, w, DF_KDA_MATS, &hs);
    df_status st = DF_OK;
    if (ok) {
        double t0 = now_s();
        st = t->a->kda_layer(t->a->ctx, layer, state, n, hs.h, xn, out, t->err);
        if (!acc_is_dev(t, out)) sync_done(t, t0);
    }
    int r = call_end(t, &hs, ok, st, err);
    if (r != 1) return r;
    t->st.calls += (uint64_t)hs.count;
    t->st.kda_calls++;
    for (int k = 0; k < DF_KDA_MATS; k++) count_macs(t, w[k], n);
    t->st.device_read_bytes += (uint64_t)hs.bytes + (uint64_t)layer->H * layer->D * layer->D * sizeof(float);
    return 1;
}

int acc_mla_layer(acc_table *t, const df_accel_mla *layer, void *state, int pos, int n, const df_weight *const *w,
                  const float *xn, float *out, char *err) {
    if (!acc_has_mla(t) || !t->a->mla_layer) return 0;
    enum { NM = DF_MLA_MATS + 1 }; /* the products, then kv_b */
    const df_weight *all[NM];
    for (int i = 0; i < DF_MLA_MATS; i++) all[i] = w[i];
    all[DF_MLA_MATS] = layer->kv_b;
    acc_handles hs;
    int ok = acquire_handles(t, all, NM, &hs);
    df_status st = DF_OK;
    if (ok) {
        double t0 = now_s();
        st = t->a->mla_layer(t->a->ctx, layer, hs.h[DF_MLA_MATS], state, pos, n, hs.h, xn, out, t->err);
        if (!acc_is_dev(t, out)) sync_done(t, t0);
    }
    int r = call_end(t, &hs, ok, st, err);
    if (r != 1) return r;
    t->st.calls += (uint64_t)hs.count - 1;
    t->st.mla_calls++;
    for (int k = 0; k < DF_MLA_MATS; k++) count_macs(t, w[k], n);
    count_macs(t, layer->kv_b, n); /* the absorb (W_UK rows) and the lift (W_UV rows) between them */
    t->st.device_read_bytes += (uint64_t)hs.bytes + (uint64_t)(pos + n) * (layer->R + layer->dr) * sizeof(float);
    return 1;
}

df_status acc_mla(acc_table *t, const df_accel_mla *layer, void *state, int pos, int n, const float *q,
                  const float *kva, float *attn, char *err) {
    const df_weight *kv_b = layer->kv_b;
    acc_handles hs;
    if (!acquire_handles(t, &kv_b, 1, &hs))
        return df_fail(err, DF_ERR_IO, "accelerator: no device copy of an MLA kv_b_proj: %s", t->last_err);
    double t0 = now_s();
    df_status st = t->a->mla(t->a->ctx, layer, hs.h[0], state, pos, n, q, kva, attn, t->err);
    sync_done(t, t0);
    release_handles(t, &hs);
    if (st != DF_OK) return call_failed(t, st, err);
    t->st.mla_calls++;
    count_macs(t, kv_b, n); /* the absorb (W_UK rows) and the lift (W_UV rows) between them */
    /* kv_b for the absorbed products, the latent cache rows 0 .. pos+n-1 */
    t->st.device_read_bytes += (uint64_t)wt_bytes(kv_b) + (uint64_t)(pos + n) * (layer->R + layer->dr) * sizeof(float);
    return DF_OK;
}

void acc_get_stats(const acc_table *t, df_accel_stats *out) {
    if (!t) { memset(out, 0, sizeof *out); return; }
    *out = t->st;
}

void acc_reset_stats(acc_table *t) {
    if (!t) return;
    t->st.calls = t->st.cpu_calls = t->st.cache_hits = t->st.cache_uploads = 0;
    t->st.cache_evictions = t->st.transient_uploads = t->st.upload_bytes = 0;
    t->st.tier_hits = 0;
    t->st.spine_groups_on_device = 0;
    t->st.sync_s = 0;
    t->st.sync_calls = 0;
    t->st.kda_calls = t->st.mla_calls = 0;
    t->st.device_read_bytes = 0;
    t->st.device_passes = 0;
    t->st.macs_mxfp4 = t->st.macs_bf16 = t->st.macs_other = 0;
}

void acc_describe(const acc_table *t, char *b, size_t cap, int64_t expert_bytes, int n_experts) {
    if (!t) return;
    const df_accel_stats *s = &t->st;
    char plan[256] = "";
    if (expert_bytes > 0 && n_experts > 0) {
        int64_t room = t->a->budget - (t->planned_bytes < t->a->budget ? t->planned_bytes : t->a->budget);
        int64_t fit = room / expert_bytes;
        if (fit > n_experts) fit = n_experts;
        snprintf(plan, sizeof plan,
                 "device plan    %.3f GB left beside the resident matrices holds %lld of the %d routed experts\n"
                 "               (%.1f MB each, %.1f%% of their bytes) as device copies\n",
                 room / 1e9, (long long)fit, n_experts, expert_bytes / 1e6, 100.0 * (double)fit / n_experts);
    }
    snprintf(b, cap,
             "device         %s\n"
             "gpu placement  budget %.3f GB: non-expert matrices resident on first use (%.3f GB bound%s),\n"
             "               the rest (routed experts, streamed spine) in an LRU cache of device copies;\n"
             "               now %lld resident (%.3f GB), %.3f GB cached, %lld matrices on the CPU (no kernel);\n"
             "               tiers: device copies, then the RAM expert cache (%s), then disk; an expert\n"
             "               with device copies is not read again%s;\n"
             "               %s\n%s",
             t->a->name ? t->a->name : "accelerator", t->a->budget / 1e9, t->planned_bytes / 1e9,
             t->planned_bytes > t->a->budget ? ", more than the budget: the excess is cached" : "",
             (long long)s->resident_mats, s->resident_bytes / 1e9, s->cached_bytes / 1e9, (long long)s->cpu_mats,
             t->experts_pinned ? "page-locked for uploads" : "pageable",
             t->a->expert_queue ? "; routed experts are queued on the device, uploads overlapping" : "",
             acc_has_kda(t) ? (t->a->kda_layer ? "KDA and MLA layers on the device (states there, one host wait a layer); norms,\n"
                                                 "               routing and residual mixing on the CPU"
                                               : "KDA and MLA states and attention on the device; norms, routing and residual\n"
                                                 "               mixing on the CPU")
                            : "attention, norms, routing and the absorbed MLA products run on the CPU",
             plan);
}

const char *acc_last_error(const acc_table *t) { return t ? t->last_err : ""; }

/* ---- activations on the device (df_accel.dev_*) ---- */

void acc_count_device_pass(acc_table *t) { t->st.device_passes++; }

int acc_has_dev(const acc_table *t) {
    const df_accel *a = t ? t->a : NULL;
    return a && a->dev_alloc && a->dev_free && a->dev_put && a->dev_get && a->dev_rmsnorm && a->dev_attn_res &&
           a->dev_add && a->dev_copy && a->dev_gather && a->matmul_many && a->expert_queue && a->expert_finish;
}

int acc_is_dev(const acc_table *t, const void *p) {
    const float *f = p;
    for (int i = 0; t && f && i < t->dev_used; i++)
        if (t->dev_blk[i] && f >= t->dev_blk[i] && f < t->dev_blk[i] + t->dev_len[i]) return 1;
    return 0;
}

float *acc_dev_alloc(acc_table *t, int64_t floats) {
    int i = 0;
    while (i < 64 && t->dev_blk[i]) i++;
    if (i == 64 || !acc_has_dev(t) || floats < 1) return NULL;
    float *p = t->a->dev_alloc(t->a->ctx, floats, t->err);
    if (!p) { snprintf(t->last_err, sizeof t->last_err, "%s", t->err); return NULL; }
    t->dev_blk[i] = p;
    t->dev_len[i] = floats;
    if (i >= t->dev_used) t->dev_used = i + 1;
    return p;
}

void acc_dev_free(acc_table *t, float *p) {
    for (int i = 0; t && p && i < 64; i++)
        if (t->dev_blk[i] == p) {
            t->a->dev_free(t->a->ctx, p);
            t->dev_blk[i] = NULL;
            t->dev_len[i] = 0;
        }
}

/* A dev_ hook's status: DF_OK, or its message as the last error and in err. */
static df_status dev_done(acc_table *t, df_status st, char *err) { return st == DF_OK ? DF_OK : call_failed(t, st, err); }

df_status acc_dev_put(acc_table *t, float *dst, const float *src, int64_t floats, char *err) {
    return dev_done(t, t->a->dev_put(t->a->ctx, dst, src, floats, t->err), err);
}

float *acc_dev_stage(acc_table *t, int64_t floats) {
    return acc_has_dev(t) && t->a->dev_stage ? t->a->dev_stage(t->a->ctx, floats, t->err) : NULL;
}

df_status acc_dev_get(acc_table *t, float *dst, const float *src, int64_t floats, char *err) {
    double t0 = now_s();
    df_status st = t->a->dev_get(t->a->ctx, dst, src, floats, t->err);
    sync_done(t, t0);
    return dev_done(t, st, err);
}

df_status acc_dev_rmsnorm(acc_table *t, float *out, const float *x, const float *w, int n, int dim, float eps,
                          char *err) {
    return dev_done(t, t->a->dev_rmsnorm(t->a->ctx, out, x, w, n, dim, eps, t->err), err);
}

df_status acc_dev_attn_res(acc_table *t, float *out, const float *anchors, int64_t astride, int na, const float *cur,
                           const float *w, int n, int dim, float eps, char *err) {
    return dev_done(t, t->a->dev_attn_res(t->a->ctx, out, anchors, astride, na, cur, w, n, dim, eps, t->err), err);
}

df_status acc_dev_add(acc_table *t, float *y, const float *x, int64_t floats, char *err) {
    return dev_done(t, t->a->dev_add(t->a->ctx, y, x, floats, t->err), err);
}

df_status acc_dev_copy(acc_table *t, float *dst, const float *src, int64_t floats, char *err) {
    return dev_done(t, t->a->dev_copy(t->a->ctx, dst, src, floats, t->err), err);
}

df_status acc_dev_gather(acc_table *t, float *dst, const float *src, const int *idx, int count, int64_t width,
                         char *err) {
    return dev_done(t, t->a->dev_gather(t->a->ctx, dst, src, idx, count, width, t->err), err);
}

df_status acc_dev_res_norm(acc_table *t, float *xn, float *h, const float *d, int restart, float *anc_out,
                           const float *anchors, int64_t astride, int na, const float *probe, const float *nw, int n,
                           int dim, float eps, char *err) {
    if (!t->a->dev_res_norm) return DF_ERR_UNSUPPORTED;
    df_status st = t->a->dev_res_norm(t->a->ctx, xn, h, d, restart, anc_out, anchors, astride, na, probe, nw, n, dim,
                                      eps, t->err);
    return st == DF_ERR_UNSUPPORTED ? st : dev_done(t, st, err);
}
