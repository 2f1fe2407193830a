/* setup.c — the commands on a mirror: setup, fill, warm, doctor (see hub.h,
 * mirror.h).
 *
 * Owns: `setup` (list the revision, choose full or stream by free disk,
 * download whole files or a stream shard's header and non-expert tensors,
 * keep what an earlier setup of the same commit verified), `fill` (complete
 * a stream mirror, or only some layers' experts; a complete shard is hashed,
 * a complete mirror becomes full), `warm` (fetch the highest-ranked missing
 * experts within the cache limit, order the local ones' use by rank),
 * `doctor` (the offline check), and the worker queue they share.
 * Refuses: fill or warm on a mirror whose setup did not finish; a fill that
 * cannot fit the cache limit (before fetching anything); a full setup
 * without the disk for it; to print (news goes through callbacks).
 *
 * Sections: 1. the worker queue  2. setup  3. fill  4. warm  5. doctor
 */
#include "mirror.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define CHUNK_MAX ((int64_t)64 << 20)   /* largest fill request */

/* ---- 1. the worker queue ------------------------------------------------------------- */

/* n jobs handed out in order to up to `workers` threads; after the first
 * error no new job starts, and that error is returned. */
typedef struct {
    df_status (*job)(void *ctx, int i, char *err);
    void *ctx;
    int n, next;
    pthread_mutex_t mu;
    df_status st;
    char err[DF_ERRMSG];
} work_queue;

static void *wq_worker(void *arg) {
    work_queue *q = arg;
    for (;;) {
        pthread_mutex_lock(&q->mu);
        int j = q->st == DF_OK && q->next < q->n ? q->next++ : -1;
        pthread_mutex_unlock(&q->mu);
        if (j < 0) return NULL;
        char err[DF_ERRMSG];
        df_status st = q->job(q->ctx, j, err);
        if (st != DF_OK) {
            pthread_mutex_lock(&q->mu);
            if (q->st == DF_OK) { q->st = st; snprintf(q->err, sizeof q->err, "%s", err); }
            pthread_mutex_unlock(&q->mu);
        }
    }
}

static df_status wq_run(df_status (*job)(void *, int, char *), void *ctx, int n, int workers, char *err) {
    work_queue q = {.job = job, .ctx = ctx, .n = n, .st = DF_OK};
    pthread_mutex_init(&q.mu, NULL);
    if (workers < 1) workers = 4;
    if (workers > 32) workers = 32;
    pthread_t th[32];
    int started = 0;
    for (int i = 0; i < workers && i < n; i++)
        if (pthread_create(&th[started], NULL, wq_worker, &q) == 0) started++;
    if (!started && n) wq_worker(&q);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_mutex_destroy(&q.mu);
    return q.st != DF_OK ? df_fail(err, q.st, "%s", q.err) : DF_OK;
}

/* ---- 2. setup ------------------------------------------------------------------------ */

typedef struct {
    const hub_setup_opts *o;
    hub_listing *l;
    hub_mirror *m;       /* stream */
    hub_manifest *man;
    int n_jobs;
    int *jobs;           /* file indexes */
    pthread_mutex_t mu;  /* guards fetched, requests and the manifest */
    int64_t fetched;
    int requests;
} setup_ctx;

static void note(const hub_setup_opts *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(const hub_setup_opts *o, const char *fmt, ...) {
    if (!o->note) return;
    char line[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    o->note(o->note_ctx, line);
}

/* 1 if the file at path has f's size and hash (sha256, else git blob id). */
static int file_matches(const hub_file *f, const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0 || sb.st_size != f->size) return 0;
    char hex[65];
    if (f->sha256[0]) return hub_sha256_file(path, f->size, hex) == 0 && !strcmp(hex, f->sha256);
    if (!f->git[0]) return 1;
    FILE *fp = fopen(path, "rb");
    if (!fp) return 0;
    hub_sha1 c;
    hub_git_blob_init(&c, f->size);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, fp)) > 0) hub_sha1_update(&c, buf, n);
    fclose(fp);
    hub_sha1_hex(&c, hex);
    return !strcmp(hex, f->git);
}

/* One job: a whole file (full mode, or a non-shard file), or a stream shard's
 * header and non-expert tensors. */
static df_status setup_job(setup_ctx *x, int fi, char *err) {
    const hub_setup_opts *o = x->o;
    hub_file *f = &x->man->files[fi];
    if (x->man->verified[fi]) return DF_OK;
    char *dest = hub_pjoin(o->dir, f->path);
    if (!dest) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    df_status st = DF_OK;
    if (x->m && hub_is_shard(f->path)) {
        mshard *s = NULL;
        for (int i = 0; i < x->m->n_sh; i++) if (x->m->sh[i].file == fi) s = &x->m->sh[i];
        if (!s) { free(dest); return df_fail(err, DF_ERR_ARG, "%s: not an open shard", f->path); }
        st = hub_shard_header(x->m, s, 1, err);
        /* non-expert tensors, adjacent ones merged into one request */
        hub_spans ne = {0};
        for (int i = 0; st == DF_OK && i < s->nt; i++)
            if (!s->t[i].expert && hub_spans_add(&ne, s->t[i].a, s->t[i].b) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
        for (int i = 0; st == DF_OK && i < ne.n; i++) st = hub_mirror_ensure(x->m, s, ne.v[i].a, ne.v[i].b, err);
        if (st == DF_OK) {
            int64_t loc = 0, tot = 0;
            hub_expert_bytes(s, &loc, &tot);
            note(o, "%s: header and %.3f MB of non-expert tensors local; routed experts %.3f of %.3f MB local",
                 f->path, hub_spans_bytes(&ne) / 1e6, loc / 1e6, tot / 1e6);
        }
        hub_spans_free(&ne);
    } else {
        int ok = 0;
        char *d2 = strdup(dest), *sl = d2 ? strrchr(d2, '/') : NULL;
        if (sl) { *sl = 0; hub_mkdirs(d2); }
        free(d2);
        ok = file_matches(f, dest);
        if (ok) note(o, "%s: already here, verified", f->path);
        else {
            int64_t got = 0;
            st = hub_download(&o->client, o->repo, x->man->commit, f, dest, &got, err);
            pthread_mutex_lock(&x->mu);
            x->fetched += got;
            x->requests++;
            pthread_mutex_unlock(&x->mu);
        }
        if (st == DF_OK) {
            pthread_mutex_lock(&x->mu);
            x->man->verified[fi] = 1;
            st = hub_manifest_save(o->dir, x->man, err); /* a finished file is never fetched again */
            pthread_mutex_unlock(&x->mu);
        }
    }
    free(dest);
    return st;
}

static df_status setup_one(void *ctx, int i, char *err) {
    setup_ctx *x = ctx;
    return setup_job(x, x->jobs[i], err);
}

static int64_t free_disk(const char *dir, int64_t override) {
    if (override > 0) return override;
    char *p = strdup(dir);
    while (p && *p) {
        struct statvfs v;
        if (statvfs(p, &v) == 0) { free(p); return (int64_t)v.f_bavail * (int64_t)v.f_frsize; }
        char *sl = strrchr(p, '/');
        if (!sl) { strcpy(p, "."); continue; }
        if (sl == p) sl[1] = 0; else *sl = 0;
    }
    free(p);
    return -1;
}

df_status hub_setup(const hub_setup_opts *o, hub_report *rep, char *err) {
    memset(rep, 0, sizeof *rep);
    const char *rev = o->revision && *o->revision ? o->revision : "main";
    hub_listing l;
    df_status st = hub_list(&o->client, o->repo, rev, &l, err);
    if (st != DF_OK) return st;
    hub_manifest man = {0};
    man.files = calloc((size_t)l.n_files + 1, sizeof *man.files);
    man.verified = calloc((size_t)l.n_files + 1, 1);
    man.endpoint = strdup(o->client.endpoint && *o->client.endpoint ? o->client.endpoint : "https://huggingface.co");
    man.repo = strdup(o->repo);
    man.revision = strdup(rev);
    man.commit = strdup(l.commit);
    if (!man.files || !man.verified || !man.endpoint || !man.repo || !man.revision || !man.commit) {
        hub_listing_free(&l);
        hub_manifest_free(&man);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    int has_weights = 0;
    for (int i = 0; i < l.n_files; i++) {
        if (hub_skipped_file(l.files[i].path)) continue;
        man.files[man.n_files] = l.files[i];
        l.files[i].path = NULL;
        int64_t sz = man.files[man.n_files].size;
        rep->total_bytes += sz;
        if (hub_is_shard(man.files[man.n_files].path)) { rep->shard_bytes += sz; has_weights = 1; }
        man.n_files++;
    }
    hub_listing_free(&l);
    if (!has_weights) {
        hub_manifest_free(&man);
        return df_fail(err, DF_ERR_FORMAT, "%s at %s has no .safetensors files: nothing deltafin can run", o->repo, rev);
    }
    /* an earlier setup of the same commit: keep what it verified */
    hub_manifest old;
    char oerr[DF_ERRMSG];
    hub_mode old_mode = HUB_AUTO;
    if (hub_manifest_load(o->dir, &old, oerr) == DF_OK) {
        man.cache_limit = old.cache_limit;
        man.rate = old.rate;
        man.rate_at = old.rate_at;
        if (!strcmp(old.repo, man.repo) && !strcmp(old.commit, man.commit)) {
            old_mode = old.mode;
            for (int i = 0; i < man.n_files; i++)
                for (int k = 0; k < old.n_files; k++)
                    if (!strcmp(old.files[k].path, man.files[i].path) && old.files[k].size == man.files[i].size)
                        man.verified[i] = old.verified[k];
        }
        hub_manifest_free(&old);
    }
    if (o->cache_limit >= 0) man.cache_limit = o->cache_limit;
    int64_t have = 0;
    for (int i = 0; i < man.n_files; i++) if (man.verified[i]) have += man.files[i].size;
    int64_t freeb = free_disk(o->dir, o->free_bytes);
    int64_t need = rep->total_bytes - have;
    int64_t margin = rep->total_bytes / 20 > ((int64_t)2 << 30) ? rep->total_bytes / 20 : ((int64_t)2 << 30);
    if (o->free_bytes > 0) margin = rep->total_bytes / 20; /* tests size the disk themselves */
    hub_mode mode = o->mode;
    if (mode == HUB_AUTO) mode = old_mode == HUB_STREAM ? HUB_STREAM : (freeb < 0 || need + margin <= freeb) ? HUB_FULL : HUB_STREAM;
    rep->mode = mode;
    note(o, "%s at %s (commit %.12s): %d files, %.3f GB (%.3f GB in safetensors); %.3f GB free in %s%s",
         o->repo, rev, man.commit, man.n_files, rep->total_bytes / 1e9, rep->shard_bytes / 1e9,
         freeb / 1e9, o->dir, have ? "" : "");
    if (o->mode == HUB_AUTO)
        note(o, "mode %s: %s", hub_mode_name(mode),
             mode == HUB_FULL ? "the whole repository fits with a 5% margin"
                              : "the repository does not fit: stream mode downloads metadata and "
                                "non-expert tensors now and fetches routed experts on first use");
    if (mode == HUB_FULL && freeb >= 0 && need > freeb) {
        hub_manifest_free(&man);
        return df_fail(err, DF_ERR_IO, "%s: %.3f GB still to download but only %.3f GB free: use --stream",
                       o->dir, need / 1e9, freeb / 1e9);
    }
    if (o->dry_run) {
        note(o, "dry run: would download %.3f GB%s", need / 1e9,
             mode == HUB_STREAM ? " at most (stream: experts only when used)" : "");
        hub_manifest_free(&man);
        return DF_OK;
    }
    if (hub_mkdirs(o->dir) != 0) {
        hub_manifest_free(&man);
        return df_fail(err, DF_ERR_IO, "%s: cannot create: %s", o->dir, strerror(errno));
    }
    setup_ctx x = {0};
    x.o = o;
    x.man = &man;
    pthread_mutex_init(&x.mu, NULL);
    x.jobs = malloc((size_t)man.n_files * sizeof(int) + 1);
    if (!x.jobs) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    /* a stream mirror asked to become full: fill its gaps instead */
    int upgrade = mode == HUB_FULL && old_mode == HUB_STREAM;
    man.mode = mode == HUB_STREAM || upgrade ? HUB_STREAM : HUB_FULL;
    man.ready = 0;
    if ((st = hub_manifest_save(o->dir, &man, err)) != DF_OK) goto done;
    if (man.mode == HUB_STREAM) {
        st = hub_mirror_open(o->dir, &o->client, 1, &x.m, err);
        if (st != DF_OK) goto done;
        /* the mirror loaded its own copy of the manifest: keep them one */
        hub_manifest_free(&x.m->man);
        x.m->man = man;
        x.man = &x.m->man;
        memset(&man, 0, sizeof man);
    }
    for (int i = 0; i < x.man->n_files; i++) x.jobs[x.n_jobs++] = i;
    double t0 = hub_now();
    st = wq_run(setup_one, &x, x.n_jobs, o->workers, err);
    if (st == DF_OK) {
        double dt = hub_now() - t0;
        int64_t got = x.fetched + (x.m ? x.m->fetched : 0);
        if (got > 0 && dt > 0) {
            x.man->rate = (double)got / dt;
            x.man->rate_at = (int64_t)time(NULL);
        }
        x.man->ready = 1;
        st = hub_manifest_save(o->dir, x.man, err);
    }
    if (x.m) {
        rep->fetched_bytes = x.fetched + x.m->fetched;
        rep->requests = x.requests + x.m->requests;
        for (int i = 0; i < x.m->n_sh; i++) hub_expert_bytes(&x.m->sh[i], &rep->local_expert_bytes, &rep->expert_bytes);
    } else {
        rep->fetched_bytes = x.fetched;
        rep->requests = x.requests;
    }
    if (x.m) { hub_mirror_close(x.m); x.m = NULL; }
    if (st == DF_OK && upgrade) {
        hub_report fr;
        st = hub_fill(o->dir, &o->client, NULL, 0, o->workers, 0, 0, &fr, err);
        rep->fetched_bytes += fr.fetched_bytes;
        rep->requests += fr.requests;
        rep->mode = HUB_FULL;
    }
done:
    free(x.jobs);
    pthread_mutex_destroy(&x.mu);
    hub_manifest_free(&man);
    return st;
}

/* ---- 3. fill ------------------------------------------------------------------------- */

typedef struct { int sh; int64_t a, b; } piece;

typedef struct {
    hub_mirror *m;
    piece *p;
    int n;
} fill_ctx;

static df_status fill_one(void *ctx, int i, char *err) {
    fill_ctx *x = ctx;
    return hub_mirror_ensure(x->m, &x->m->sh[x->p[i].sh], x->p[i].a, x->p[i].b, err);
}

/* Fetches the pieces x->p with `workers` threads; the first error. */
static df_status run_pieces(fill_ctx *x, int workers, char *err) {
    return wq_run(fill_one, x, x->n, workers, err);
}

static int add_piece(fill_ctx *x, int *cap, int sh, int64_t a, int64_t b) {
    if (x->n == *cap) {
        int nc = *cap ? *cap * 2 : 64;
        piece *np = realloc(x->p, (size_t)nc * sizeof *np);
        if (!np) return -1;
        x->p = np;
        *cap = nc;
    }
    x->p[x->n++] = (piece){sh, a, b};
    return 0;
}

df_status hub_fill(const char *dir, const hub_client *c, const uint8_t *layers, int n_layers, int workers,
                   int dry_run, int64_t cache_limit, hub_report *rep, char *err) {
    memset(rep, 0, sizeof *rep);
    hub_mirror *m;
    df_status st = hub_mirror_open(dir, c, 0, &m, err);
    if (st != DF_OK) return st;
    rep->mode = m->man.mode;
    if (!m->man.ready) {
        hub_mirror_close(m);
        return df_fail(err, DF_ERR_ARG, "%s: setup did not finish: run `deltafin setup` again first", dir);
    }
    fill_ctx x = {0};
    x.m = m;
    int cap = 0;
    for (int si = 0; st == DF_OK && si < m->n_sh; si++) {
        mshard *s = &m->sh[si];
        if ((st = hub_shard_header(m, s, 0, err)) != DF_OK) break;
        hub_expert_bytes(s, &rep->local_expert_bytes, &rep->expert_bytes);
        rep->shard_bytes += s->size;
        rep->local_bytes += hub_spans_bytes(&s->present);
        hub_spans want = {0};
        if (!layers) {
            if (hub_spans_missing(&s->present, 0, s->size, &want) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
        } else {
            for (int i = 0; st == DF_OK && i < s->nt; i++) {
                int L = s->t[i].layer;
                if (!s->t[i].expert || L < 0 || L >= n_layers || !layers[L]) continue;
                if (hub_spans_missing(&s->present, s->t[i].a, s->t[i].b, &want) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
            }
        }
        /* adjacent pieces merged by the set; split into requests of <= CHUNK_MAX */
        for (int i = 0; st == DF_OK && i < want.n; i++)
            for (int64_t a = want.v[i].a; a < want.v[i].b; a += CHUNK_MAX) {
                int64_t b = want.v[i].b - a > CHUNK_MAX ? a + CHUNK_MAX : want.v[i].b;
                if (add_piece(&x, &cap, si, a, b) != 0) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); break; }
                rep->total_bytes += b - a; /* bytes to fetch */
            }
        hub_spans_free(&want);
    }
    rep->requests = x.n;
    if (st == DF_OK) {
        hub_cache_load(m);
        m->limit = cache_limit < 0 ? m->man.cache_limit : cache_limit;
        /* all the experts must fit: fetching more than the budget would evict what it just fetched */
        int64_t need = 0;
        for (int i = 0; m->limit > 0 && i < x.n; i++) {
            hub_spans one = {0};
            if (hub_spans_add(&one, x.p[i].a, x.p[i].b) == 0) need += hub_cache_need(&m->sh[x.p[i].sh], &one);
            hub_spans_free(&one);
        }
        if (m->limit > 0 && need > m->limit)
            st = df_fail(err, DF_ERR_ARG,
                         "%s: fetching these experts needs %.3f MB but the cache limit is %.3f MB: fetch fewer "
                         "layers, or raise the limit (--cache-limit SIZE, 0 = none)",
                         dir, need / 1e6, m->limit / 1e6);
    }
    if (st == DF_OK && !dry_run && x.n) {
        st = run_pieces(&x, workers, err);
        rep->fetched_bytes = m->fetched;
        pthread_mutex_lock(&m->mu);
        hub_cache_save(m);
        pthread_mutex_unlock(&m->mu);
        if (m->fetched > 0 && m->busy_s > 0) {
            m->man.rate = (double)m->fetched / m->busy_s;
            m->man.rate_at = (int64_t)time(NULL);
            df_status s2 = hub_manifest_save(dir, &m->man, st == DF_OK ? err : NULL);
            if (st == DF_OK) st = s2;
        }
    }
    /* complete shards: check the whole file; a complete mirror becomes full */
    if (st == DF_OK && !dry_run) {
        int all = 1, changed = 0;
        for (int si = 0; st == DF_OK && si < m->n_sh; si++) {
            mshard *s = &m->sh[si];
            hub_file *f = &m->man.files[s->file];
            if (!hub_spans_covers(&s->present, 0, s->size)) { all = 0; continue; }
            if (m->man.verified[s->file]) continue;
            if (f->sha256[0]) {
                char hex[65];
                if (hub_sha256_file(s->path, s->size, hex) != 0)
                    st = df_fail(err, DF_ERR_IO, "%s: cannot read back: %s", s->path, strerror(errno));
                else if (strcmp(hex, f->sha256) != 0)
                    st = df_fail(err, DF_ERR_FORMAT,
                                 "%s: every span is local but the file's sha256 is %s, not the commit's %s: "
                                 "a fetched span is corrupt (delete the file and its log in %s/spans, then setup again)",
                                 s->path, hex, f->sha256, HUB_DIR);
            }
            if (st == DF_OK) { m->man.verified[s->file] = 1; changed = 1; }
        }
        if (st == DF_OK && all && m->man.mode == HUB_STREAM) { m->man.mode = HUB_FULL; changed = 1; }
        if (st == DF_OK && changed) st = hub_manifest_save(dir, &m->man, err);
        rep->mode = m->man.mode;
    }
    free(x.p);
    hub_mirror_close(m);
    return st;
}

/* ---- 4. warm ------------------------------------------------------------------------- */

typedef struct { int layer, eid, sh, u; } uref; /* an expert's unit in one shard */

static int by_ref(const void *x, const void *y) {
    const uref *a = x, *b = y;
    if (a->layer != b->layer) return a->layer < b->layer ? -1 : 1;
    return a->eid < b->eid ? -1 : a->eid > b->eid;
}

/* Every unit of the mirror sorted by (layer, expert); malloc'd. */
static uref *unit_index(const hub_mirror *m, int *n) {
    int t = 0;
    for (int i = 0; i < m->n_sh; i++) t += m->sh[i].nu;
    uref *v = malloc((size_t)(t ? t : 1) * sizeof *v);
    if (!v) return NULL;
    *n = 0;
    for (int i = 0; i < m->n_sh; i++)
        for (int k = 0; k < m->sh[i].nu; k++) v[(*n)++] = (uref){m->sh[i].u[k].layer, m->sh[i].u[k].eid, i, k};
    qsort(v, (size_t)*n, sizeof *v, by_ref);
    return v;
}

/* The units of (layer, expert): *first and the count. */
static int unit_find(const uref *v, int n, int layer, int eid, int *first) {
    int lo = 0, hi = n;
    uref key = {layer, eid, 0, 0};
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (by_ref(&v[mid], &key) < 0) lo = mid + 1; else hi = mid;
    }
    int k = lo;
    while (k < n && v[k].layer == layer && v[k].eid == eid) k++;
    *first = lo;
    return k - lo;
}

df_status hub_warm(const char *dir, const hub_client *c, const hub_rank *r, int n_rank, int n_fetch, int workers,
                   int dry_run, int64_t cache_limit, hub_report *rep, int *unknown, char *err) {
    memset(rep, 0, sizeof *rep);
    *unknown = 0;
    hub_mirror *m;
    df_status st = hub_mirror_open(dir, c, 0, &m, err);
    if (st != DF_OK) return st;
    rep->mode = m->man.mode;
    if (!m->man.ready) {
        hub_mirror_close(m);
        return df_fail(err, DF_ERR_ARG, "%s: setup did not finish: run `deltafin setup` again first", dir);
    }
    for (int si = 0; st == DF_OK && si < m->n_sh; si++) {
        st = hub_shard_header(m, &m->sh[si], 0, err);
        if (st == DF_OK) hub_expert_bytes(&m->sh[si], &rep->local_expert_bytes, &rep->expert_bytes);
    }
    if (st != DF_OK) { hub_mirror_close(m); return st; }
    hub_cache_load(m);
    m->limit = cache_limit < 0 ? m->man.cache_limit : cache_limit;
    /* the chosen experts in rank order: (shard, unit); one expert may span shards */
    typedef struct { int sh, u, rank; } pick;
    pick *pk = malloc((size_t)(n_rank > 0 ? n_rank : 1) * 2 * sizeof *pk);
    int npk = 0, chosen = 0, cap = 0;
    int64_t need = 0;
    fill_ctx x = {0};
    x.m = m;
    int nidx = 0;
    uref *idx = unit_index(m, &nidx);
    if (!pk || !idx) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int i = 0; st == DF_OK && i < n_rank && chosen < n_fetch; i++) {
        int missing = 0, f0;
        int64_t add = 0;
        int found = unit_find(idx, nidx, r[i].layer, r[i].expert, &f0);
        for (int q = f0; q < f0 + found; q++) {
            mshard *s = &m->sh[idx[q].sh];
            int k = idx[q].u;
            {
                if (!hub_cache_unit_missing(s, &s->u[k])) continue;
                missing = 1;
                hub_spans miss = {0};
                for (int t = 0; t < s->u[k].nt; t++) {
                    const tspan *ts = &s->t[s->ut[s->u[k].t0 + t]];
                    hub_spans_missing(&s->present, ts->a, ts->b, &miss);
                }
                add += hub_cache_need(s, &miss);
                hub_spans_free(&miss);
            }
        }
        if (!found) { (*unknown)++; continue; }
        if (!missing) continue;
        if (m->limit > 0 && need + add > m->limit) break; /* the budget holds no more */
        need += add;
        chosen++;
        for (int q = f0; q < f0 + found; q++) {
            mshard *s = &m->sh[idx[q].sh];
            if (hub_cache_unit_missing(s, &s->u[idx[q].u]) && npk < 2 * n_rank) pk[npk++] = (pick){idx[q].sh, idx[q].u, i};
        }
    }
    /* the missing bytes of the chosen, per shard; adjacent ones coalesce */
    for (int si = 0; st == DF_OK && si < m->n_sh; si++) {
        mshard *s = &m->sh[si];
        hub_spans want = {0};
        for (int p = 0; p < npk; p++) {
            if (pk[p].sh != si) continue;
            munit *u = &s->u[pk[p].u];
            for (int t = 0; t < u->nt; t++) {
                const tspan *ts = &s->t[s->ut[u->t0 + t]];
                if (hub_spans_missing(&s->present, ts->a, ts->b, &want) != 0) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
            }
        }
        for (int i = 0; st == DF_OK && i < want.n; i++)
            for (int64_t a = want.v[i].a; a < want.v[i].b; a += CHUNK_MAX) {
                int64_t b = want.v[i].b - a > CHUNK_MAX ? a + CHUNK_MAX : want.v[i].b;
                if (add_piece(&x, &cap, si, a, b) != 0) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); break; }
                rep->total_bytes += b - a;
            }
        hub_spans_free(&want);
    }
    rep->requests = chosen;
    if (st == DF_OK && !dry_run) {
        if (x.n) st = run_pieces(&x, workers, err);
        rep->fetched_bytes = m->fetched;
        /* the ranked local experts used coldest first: the hottest are evicted last */
        pthread_mutex_lock(&m->mu);
        for (int i = n_rank - 1; i >= 0; i--) {
            uint64_t tk = ++m->tick;
            int f0, nf = unit_find(idx, nidx, r[i].layer, r[i].expert, &f0);
            for (int q = f0; q < f0 + nf; q++) {
                munit *u = &m->sh[idx[q].sh].u[idx[q].u];
                if (hub_cache_unit_present(&m->sh[idx[q].sh], u)) u->tick = tk;
            }
        }
        hub_cache_save(m);
        pthread_mutex_unlock(&m->mu);
        if (m->fetched > 0 && m->busy_s > 0) {
            m->man.rate = (double)m->fetched / m->busy_s;
            m->man.rate_at = (int64_t)time(NULL);
            df_status s2 = hub_manifest_save(dir, &m->man, st == DF_OK ? err : NULL);
            if (st == DF_OK) st = s2;
        }
        rep->local_expert_bytes = rep->expert_bytes = 0;
        for (int si = 0; si < m->n_sh; si++) hub_expert_bytes(&m->sh[si], &rep->local_expert_bytes, &rep->expert_bytes);
    }
    free(x.p);
    free(pk);
    free(idx);
    hub_mirror_close(m);
    return st;
}

/* ---- 5. doctor ----------------------------------------------------------------------- */

static void dnote(void (*fn)(void *, const char *), void *ctx, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void dnote(void (*fn)(void *, const char *), void *ctx, const char *fmt, ...) {
    if (!fn) return;
    char line[1400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fn(ctx, line);
}

df_status hub_doctor(const char *dir, int hash, void (*fn)(void *, const char *), void *ctx, hub_report *rep,
                     char *err) {
    memset(rep, 0, sizeof *rep);
    hub_manifest man;
    df_status st = hub_manifest_load(dir, &man, err);
    if (st != DF_OK) return st;
    int bad = 0;
    rep->mode = man.mode;
    dnote(fn, ctx, "mirror of %s at %s (commit %.12s), mode %s%s", man.repo, man.revision, man.commit,
          hub_mode_name(man.mode), man.ready ? "" : ", setup NOT finished");
    if (!man.ready) bad++;
    for (int i = 0; i < man.n_files; i++) {
        const hub_file *f = &man.files[i];
        char *p = hub_pjoin(dir, f->path);
        struct stat sb;
        rep->total_bytes += f->size;
        if (!p || stat(p, &sb) != 0) {
            if (man.mode == HUB_FULL || man.verified[i]) { dnote(fn, ctx, "MISSING %s", f->path); bad++; }
            free(p);
            continue;
        }
        if (sb.st_size != f->size) {
            dnote(fn, ctx, "SIZE %s: %lld bytes, expected %lld", f->path, (long long)sb.st_size, (long long)f->size);
            bad++;
            free(p);
            continue;
        }
        int stream_shard = man.mode == HUB_STREAM && hub_is_shard(f->path) && !man.verified[i];
        if (!stream_shard) {
            rep->local_bytes += f->size;
            if (hash && !file_matches(f, p)) {
                dnote(fn, ctx, "CORRUPT %s: %s differs from the commit's", f->path, f->sha256[0] ? "sha256" : "git blob id");
                bad++;
            }
            free(p);
            continue;
        }
        /* a stream shard: its log, its header, its non-expert tensors */
        const char *base = strrchr(f->path, '/') ? strrchr(f->path, '/') + 1 : f->path;
        char lp[4096];
        snprintf(lp, sizeof lp, "%s/" HUB_DIR "/spans/%s.spans", dir, base);
        hub_spans pr = {0};
        int64_t fs = -1;
        char e2[DF_ERRMSG];
        if (hub_log_read(lp, &pr, &fs, e2) != DF_OK || fs != f->size) {
            dnote(fn, ctx, "LOG %s: %s", f->path, fs != f->size ? "span log missing or for another file" : e2);
            bad++;
            hub_spans_free(&pr);
            free(p);
            continue;
        }
        mshard s = {0};
        s.path = p;
        s.size = f->size;
        s.present = pr;
        s.wfd = open(p, O_RDONLY | O_CLOEXEC);
        if (s.wfd < 0 || hub_shard_header(NULL, &s, 0, e2) != DF_OK) {
            dnote(fn, ctx, "HEADER %s: %s", f->path, s.wfd < 0 ? strerror(errno) : e2);
            bad++;
        } else {
            int64_t loc = 0, tot = 0, miss_ne = 0;
            for (int k = 0; k < s.nt; k++) {
                if (s.t[k].expert) continue;
                hub_spans ms = {0};
                if (hub_spans_missing(&s.present, s.t[k].a, s.t[k].b, &ms) == 0) miss_ne += hub_spans_bytes(&ms);
                hub_spans_free(&ms);
            }
            hub_expert_bytes(&s, &loc, &tot);
            rep->expert_bytes += tot;
            rep->local_expert_bytes += loc;
            rep->local_bytes += hub_spans_bytes(&s.present);
            if (miss_ne) { dnote(fn, ctx, "INCOMPLETE %s: %lld bytes of non-expert tensors missing", f->path, (long long)miss_ne); bad++; }
            dnote(fn, ctx, "%s: %d spans, routed experts %.3f of %.3f MB local", f->path, s.present.n, loc / 1e6, tot / 1e6);
        }
        if (s.wfd >= 0) close(s.wfd);
        free(s.t); free(s.u); free(s.ut);
        hub_spans_free(&s.fixed);
        hub_spans_free(&s.present);
        free(p);
    }
    int64_t freeb = free_disk(dir, 0);
    dnote(fn, ctx, "local %.3f of %.3f GB; %.3f GB free", rep->local_bytes / 1e9, rep->total_bytes / 1e9, freeb / 1e9);
    if (man.mode == HUB_STREAM && rep->expert_bytes > rep->local_expert_bytes && freeb >= 0 &&
        rep->expert_bytes - rep->local_expert_bytes > freeb) {
        dnote(fn, ctx, "NOTE completing the mirror needs %.3f GB, more than is free",
              (rep->expert_bytes - rep->local_expert_bytes) / 1e9);
    }
    hub_manifest_free(&man);
    if (bad) return df_fail(err, DF_ERR_IO, "%s: %d problem%s found", dir, bad, bad == 1 ? "" : "s");
    return DF_OK;
}
