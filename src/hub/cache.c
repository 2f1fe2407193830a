/* cache.c — the cache limit of a stream mirror (--cache-limit; see mirror.h).
 *
 * Owns: the routed experts' use clock (munit.tick) and its file
 * DIR/.deltafin-hub/access, the pins of byte ranges being read, the blocks
 * the present experts hold, and eviction: the fetch that would pass the
 * budget first evicts the least recently used experts; the span log records
 * them absent before their bytes are punched out.
 * Refuses: to evict an expert that is pinned or being fetched, header bytes
 * or non-expert tensors; after a failed eviction, to evict again in this
 * process (the limit is turned off and m->evict_err says why).
 * Every function runs with m->mu held, but hub_cache_load, which runs
 * before any thread shares the mirror.
 *
 * The budget counts file system blocks, as st_blocks does: a block holding
 * any present routed-expert byte and no header or non-expert byte (those are
 * always local) counts whole. Eviction takes the least recently used expert
 * (its tick: the last read through the stream table, or its fetch) that no
 * reader holds (pins) and no fetch is writing, records it absent in the span
 * log (fdatasync'd) and only then punches its bytes out, widened to whole
 * blocks where the rest of the block holds nothing present or in flight:
 *
 *   block:   |....A....|..A..B...|....B....|      evict A (B present):
 *   punched: |<-- hole -->|zeroed|            the shared block stays, zeroed
 *                                             over A's bytes only
 *
 * Sections: 1. blocks and pins  2. use and eviction  3. the access file
 */
#include "mirror.h"
#include "../base/port.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- 1. blocks and pins -------------------------------------------------------------- */

static int block_fixed(const mshard *s, int64_t blk) {
    return hub_spans_overlaps(&s->fixed, blk * s->bs, (blk + 1) * s->bs);
}

/* Blocks (in bytes) that the present routed-expert bytes of s occupy. */
static int64_t footprint(const mshard *s) {
    if (!s->t || s->bs <= 0) return 0;
    hub_spans ex = {0};
    for (int i = 0; i < s->present.n; i++)
        if (hub_spans_missing(&s->fixed, s->present.v[i].a, s->present.v[i].b, &ex) != 0) break;
    int64_t blocks = 0, prev = -1;
    for (int i = 0; i < ex.n; i++) {
        int64_t f = ex.v[i].a / s->bs, l = (ex.v[i].b - 1) / s->bs;
        int64_t n = l - f + 1;
        if (f == prev || block_fixed(s, f)) n--;
        if (l != f && block_fixed(s, l)) n--;
        blocks += n;
        prev = l;
    }
    hub_spans_free(&ex);
    return blocks * s->bs;
}

int64_t hub_cache_used(const hub_mirror *m) {
    int64_t t = 0;
    for (int i = 0; i < m->n_sh; i++) t += footprint(&m->sh[i]);
    return t;
}

/* Blocks (in bytes) that fetching the pieces in miss can add, at most. */
int64_t hub_cache_need(const mshard *s, const hub_spans *miss) {
    if (s->bs <= 0) return 0;
    int64_t n = 0;
    for (int i = 0; i < miss->n; i++) {
        hub_spans ex = {0};
        if (hub_spans_missing(&s->fixed, miss->v[i].a, miss->v[i].b, &ex) == 0)
            for (int k = 0; k < ex.n; k++) n += (ex.v[k].b - 1) / s->bs - ex.v[k].a / s->bs + 1;
        hub_spans_free(&ex);
    }
    return n * s->bs;
}

int hub_cache_pin(hub_mirror *m, int sh, int64_t a, int64_t b) {
    if (m->n_pins == m->cap_pins) {
        int cap = m->cap_pins ? m->cap_pins * 2 : 16;
        mpin *np = realloc(m->pins, (size_t)cap * sizeof *np);
        if (!np) return -1;
        m->pins = np;
        m->cap_pins = cap;
    }
    m->pins[m->n_pins++] = (mpin){sh, a, b};
    return 0;
}

void hub_cache_unpin(hub_mirror *m, int sh, int64_t a, int64_t b) {
    for (int i = 0; i < m->n_pins; i++)
        if (m->pins[i].sh == sh && m->pins[i].a == a && m->pins[i].b == b) {
            m->pins[i] = m->pins[--m->n_pins];
            return;
        }
}

/* ---- 2. use and eviction ------------------------------------------------------------- */

static int unit_overlaps(const mshard *s, const munit *u, int64_t a, int64_t b) {
    for (int k = 0; k < u->nt; k++) {
        const tspan *t = &s->t[s->ut[u->t0 + k]];
        if (t->a < b && a < t->b) return 1;
    }
    return 0;
}

int hub_cache_unit_present(const mshard *s, const munit *u) {
    for (int k = 0; k < u->nt; k++) {
        const tspan *t = &s->t[s->ut[u->t0 + k]];
        if (hub_spans_overlaps(&s->present, t->a, t->b)) return 1;
    }
    return 0;
}

int hub_cache_unit_missing(const mshard *s, const munit *u) {
    for (int k = 0; k < u->nt; k++) {
        const tspan *t = &s->t[s->ut[u->t0 + k]];
        if (!hub_spans_covers(&s->present, t->a, t->b)) return 1;
    }
    return 0;
}

/* Marks the experts overlapping [a, b) of shard s used now. */
void hub_cache_touch(hub_mirror *m, mshard *s, int64_t a, int64_t b) {
    if (!s->t) return;
    int lo = 0, hi = s->nt;
    while (lo < hi) { /* first tensor ending after a */
        int mid = (lo + hi) / 2;
        if (s->t[mid].b <= a) lo = mid + 1; else hi = mid;
    }
    uint64_t tk = ++m->tick;
    for (int i = lo; i < s->nt && s->t[i].a < b; i++)
        if (s->t[i].unit >= 0) s->u[s->t[i].unit].tick = tk;
}

/* Evicts expert u of shard s (m->mu held). On a log error nothing changed;
 * on a punch error the expert is absent (and refetched when used) but its
 * blocks may stay allocated. */
static df_status evict_unit(hub_mirror *m, mshard *s, munit *u, char *err) {
    hub_spans gone = {0};
    df_status st = DF_OK;
    for (int k = 0; k < u->nt && st == DF_OK; k++) { /* its present bytes */
        const tspan *t = &s->t[s->ut[u->t0 + k]];
        hub_spans miss = {0};
        if (hub_spans_missing(&s->present, t->a, t->b, &miss) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
        int64_t at = t->a;
        for (int i = 0; st == DF_OK && i <= miss.n; i++) {
            int64_t e = i < miss.n ? miss.v[i].a : t->b;
            if (e > at && hub_spans_add(&gone, at, e) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
            if (i < miss.n) at = miss.v[i].b;
        }
        hub_spans_free(&miss);
    }
    /* 1. absent in the log, durably; 2. absent in memory; 3. punched */
    for (int i = 0; st == DF_OK && i < gone.n; i++) {
        st = hub_log_remove(&s->log, gone.v[i].a, gone.v[i].b, err);
        if (st == DF_OK) hub_spans_remove(&s->present, gone.v[i].a, gone.v[i].b);
    }
    for (int i = 0; st == DF_OK && i < gone.n; i++) {
        int64_t a = gone.v[i].a, b = gone.v[i].b;
        int64_t fa = a / s->bs * s->bs, fb = (b + s->bs - 1) / s->bs * s->bs;
        if (fb > s->size) fb = s->size;
        if (fa < a && !hub_spans_overlaps(&s->present, fa, a) && !hub_spans_overlaps(&s->inflight, fa, a)) a = fa;
        if (fb > b && !hub_spans_overlaps(&s->present, b, fb) && !hub_spans_overlaps(&s->inflight, b, fb)) b = fb;
        struct timespec ts[2] = {{0, UTIME_OMIT}, s->mtime};
        if (port_punch_hole(s->wfd, a, b - a) != 0)
            st = df_fail(err, DF_ERR_IO, "%s: cannot punch a hole (the file system must support it for --cache-limit): %s",
                         s->path, strerror(errno));
        else
            futimens(s->wfd, ts);
        m->evicted += gone.v[i].b - gone.v[i].a;
    }
    if (st == DF_OK) m->evictions++;
    hub_spans_free(&gone);
    return st;
}

/* Evicts the coldest experts until the present ones plus those in flight
 * plus `need` fit the limit, or nothing evictable is left (m->mu held). A
 * failure turns eviction off for this process (m->evict_err says why). */
void hub_cache_make_room(hub_mirror *m, int64_t need) {
    if (m->limit <= 0) return;
    int64_t used = hub_cache_used(m);
    while (used + m->pending + need > m->limit) {
        mshard *bs = NULL;
        munit *bu = NULL;
        for (int i = 0; i < m->n_sh; i++) {
            mshard *s = &m->sh[i];
            for (int k = 0; k < s->nu; k++) {
                munit *u = &s->u[k];
                if (bu && u->tick >= bu->tick) continue;
                if (!hub_cache_unit_present(s, u)) continue;
                int busy = 0;
                for (int p = 0; p < m->n_pins && !busy; p++)
                    busy = m->pins[p].sh == i && unit_overlaps(s, u, m->pins[p].a, m->pins[p].b);
                for (int t = 0; t < u->nt && !busy; t++) {
                    const tspan *x = &s->t[s->ut[u->t0 + t]];
                    busy = hub_spans_overlaps(&s->inflight, x->a, x->b);
                }
                if (busy) continue;
                bs = s;
                bu = u;
            }
        }
        if (!bu) return;
        char err[DF_ERRMSG];
        if (evict_unit(m, bs, bu, err) != DF_OK) {
            snprintf(m->evict_err, sizeof m->evict_err, "%s", err);
            m->limit = 0;
            return;
        }
        used = hub_cache_used(m);
    }
}

/* ---- 3. the access file -------------------------------------------------------------- */

/* The use clock survives the process in DIR/.deltafin-hub/access, a hint
 * (not fsync'd; a missing or foreign file means "all equally cold"):
 *   "DFACCES1" | u32 shards | per shard: u32 units, u64 tick per unit */
static char *access_path(const hub_mirror *m) { return hub_pjoin(m->dir, HUB_DIR "/access"); }

void hub_cache_save(hub_mirror *m) {
    size_t n = 12;
    for (int i = 0; i < m->n_sh; i++) n += 4 + (size_t)m->sh[i].nu * 8;
    uint8_t *p = malloc(n);
    char *path = access_path(m), *tmp = path ? malloc(strlen(path) + 5) : NULL;
    if (!p || !tmp) { free(p); free(path); free(tmp); return; }
    memcpy(p, "DFACCES1", 8);
    size_t at = 8;
    uint32_t ns = (uint32_t)m->n_sh;
    memcpy(p + at, &ns, 4), at += 4;
    for (int i = 0; i < m->n_sh; i++) {
        uint32_t nu = (uint32_t)m->sh[i].nu;
        memcpy(p + at, &nu, 4), at += 4;
        for (int k = 0; k < m->sh[i].nu; k++) memcpy(p + at, &m->sh[i].u[k].tick, 8), at += 8;
    }
    sprintf(tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int ok = fd >= 0 && hub_write_at(fd, p, n, 0) == 0;
    if (fd >= 0) close(fd);
    if (ok) rename(tmp, path); else unlink(tmp);
    free(p); free(path); free(tmp);
}

/* Loads the use clock (every shard's header parsed). */
void hub_cache_load(hub_mirror *m) {
    char *path = access_path(m);
    FILE *f = path ? fopen(path, "rb") : NULL;
    free(path);
    if (!f) return;
    char mg[8];
    uint32_t ns = 0;
    int ok = fread(mg, 1, 8, f) == 8 && !memcmp(mg, "DFACCES1", 8) && fread(&ns, 4, 1, f) == 1 && ns == (uint32_t)m->n_sh;
    for (int i = 0; ok && i < m->n_sh; i++) {
        uint32_t nu = 0;
        ok = fread(&nu, 4, 1, f) == 1 && nu == (uint32_t)m->sh[i].nu;
        for (int k = 0; ok && k < m->sh[i].nu; k++) {
            uint64_t t;
            ok = fread(&t, 8, 1, f) == 1;
            if (ok) {
                m->sh[i].u[k].tick = t;
                if (t > m->tick) m->tick = t;
            }
        }
    }
    fclose(f);
}
