/* stream.c — an open stream mirror as a df_io table (df_hub_stream_*,
 * hub_stream_*; see deltafin.h, hub.h).
 *
 * Owns: df_hub_stream (the table's ctx), which descriptors opened through
 * the table read one of its shards (recognised by device and inode at
 * open), and the reads through them: every pread first makes its bytes local
 * (hub_mirror_ensure_pin) and holds them pinned until the read is done, so
 * an eviction for another fetch cannot punch them out under it.
 * Refuses: O_DIRECT (DF_O_DIRECT) opens of a stream shard (EINVAL, so the expert store
 * reads exact spans with buffered reads instead of block-aligned ones that
 * would fetch neighbouring experts); io_uring (the ring entries are NULL:
 * the store falls back to pread); opening a mirror whose setup did not
 * finish.
 *
 * Sections: 1. the io table  2. the public calls
 */
#include "mirror.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- 1. the io table ----------------------------------------------------------------- */

/* One open stream mirror: its df_io table (ctx = the stream) and which of
 * its shards each descriptor opened through the table reads. */
typedef struct { int ours, sh; } fd_entry;
struct df_hub_stream {
    hub_mirror *m;
    df_io io;
    pthread_mutex_t mu; /* fd, fdcap */
    fd_entry *fd;       /* [fdcap] by descriptor */
    int fdcap;
};

static int find_shard(const hub_mirror *m, dev_t dev, ino_t ino, int *sh) {
    for (int k = 0; k < m->n_sh; k++)
        if (m->sh[k].dev == dev && m->sh[k].ino == ino) { *sh = k; return 1; }
    return 0;
}

static int s_open(void *ctx, const char *path, int flags, int mode) {
    df_hub_stream *hs = ctx;
    struct stat sb;
    int sh = -1;
    int ours = stat(path, &sb) == 0 && find_shard(hs->m, sb.st_dev, sb.st_ino, &sh);
    if (ours && (flags & DF_O_DIRECT)) { errno = EINVAL; return -1; }
    int fd = io_open(df_io_default(), path, flags, mode);
    if (fd < 0 || !ours) return fd;
    pthread_mutex_lock(&hs->mu);
    if (fd >= hs->fdcap) {
        int cap = fd * 2 + 64;
        fd_entry *n = realloc(hs->fd, (size_t)cap * sizeof *n);
        if (!n) { pthread_mutex_unlock(&hs->mu); close(fd); errno = ENOMEM; return -1; }
        memset(n + hs->fdcap, 0, (size_t)(cap - hs->fdcap) * sizeof *n);
        hs->fd = n;
        hs->fdcap = cap;
    }
    hs->fd[fd] = (fd_entry){1, sh};
    pthread_mutex_unlock(&hs->mu);
    return fd;
}

static int s_close(void *ctx, int fd) {
    df_hub_stream *hs = ctx;
    pthread_mutex_lock(&hs->mu);
    if (fd >= 0 && fd < hs->fdcap) hs->fd[fd].ours = 0;
    pthread_mutex_unlock(&hs->mu);
    return io_close(df_io_default(), fd);
}

static ssize_t s_pread(void *ctx, int fd, void *buf, size_t n, off_t off) {
    df_hub_stream *hs = ctx;
    pthread_mutex_lock(&hs->mu);
    fd_entry e = fd >= 0 && fd < hs->fdcap ? hs->fd[fd] : (fd_entry){0, 0};
    pthread_mutex_unlock(&hs->mu);
    if (!e.ours) return io_pread(df_io_default(), fd, buf, n, off);
    /* pinned from the check to the end of the read: an eviction for another
     * fetch cannot punch these bytes out under us */
    char err[DF_ERRMSG];
    hub_mirror *m = hs->m;
    int64_t a = (int64_t)off, b = (int64_t)off + (int64_t)n;
    mshard *s = &m->sh[e.sh];
    if (a < 0) a = 0;
    if (b > s->size) b = s->size;
    if (hub_mirror_ensure_pin(m, s, a, b, 1, err) != DF_OK) {
        errno = EIO;
        return -1;
    }
    ssize_t r = io_pread(df_io_default(), fd, buf, n, off);
    int er = errno;
    if (b > a) {
        pthread_mutex_lock(&m->mu);
        hub_cache_unpin(m, e.sh, a, b);
        pthread_mutex_unlock(&m->mu);
    }
    errno = er;
    return r;
}

/* ---- 2. the public calls ------------------------------------------------------------- */

int df_hub_is_stream(const char *dir) {
    hub_manifest m;
    if (hub_manifest_load(dir, &m, NULL) != DF_OK) return 0;
    int r = m.mode == HUB_STREAM;
    hub_manifest_free(&m);
    return r;
}

df_status df_hub_stream_open(const char *dir, const char *endpoint, const char *token, df_hub_stream **out,
                             char err[DF_ERRMSG]) {
    *out = NULL;
    hub_client c = {0};
    c.endpoint = endpoint;
    c.token = token;
    c.retries = 5;
    c.retry_ms = 500;
    c.timeout_s = 60;
    hub_mirror *m;
    df_status st = hub_mirror_open(dir, &c, 0, &m, err);
    if (st != DF_OK) return st;
    if (!m->man.ready) {
        hub_mirror_close(m);
        return df_fail(err, DF_ERR_ARG, "%s: `deltafin setup` did not finish here: run it again", dir);
    }
    for (int i = 0; i < m->n_sh; i++)
        if ((st = hub_shard_header(m, &m->sh[i], 0, err)) != DF_OK) { hub_mirror_close(m); return st; }
    hub_cache_load(m);
    m->limit = m->man.cache_limit;
    pthread_mutex_lock(&m->mu);
    hub_cache_make_room(m, 0); /* a budget lowered since the last run */
    pthread_mutex_unlock(&m->mu);
    df_hub_stream *hs = calloc(1, sizeof *hs);
    if (!hs) { hub_mirror_close(m); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    hs->m = m;
    pthread_mutex_init(&hs->mu, NULL);
    hs->io = *df_io_default();
    hs->io.open = s_open;
    hs->io.close = s_close;
    hs->io.pread = s_pread;
    hs->io.ring_open = NULL; hs->io.ring_close = NULL; hs->io.ring_read = NULL;
    hs->io.ring_submit = NULL; hs->io.ring_wait = NULL;
    hs->io.fills_in_place = 1;
    hs->io.ctx = hs;
    *out = hs;
    return DF_OK;
}

const struct df_io *df_hub_stream_io(const df_hub_stream *hs) { return hs ? &hs->io : NULL; }

void df_hub_stream_info(df_hub_stream *hs, df_hub_stream_stats *out) {
    memset(out, 0, sizeof *out);
    if (!hs) return;
    hub_mirror *m = hs->m;
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->n_sh; i++) hub_expert_bytes(&m->sh[i], &out->expert_local, &out->expert_total);
    out->fetched = m->fetched;
    out->requests = m->requests;
    snprintf(out->last_error, sizeof out->last_error, "%s", m->last_err);
    pthread_mutex_unlock(&m->mu);
}

static void flush(hub_mirror *m) {
    pthread_mutex_lock(&m->mu);
    hub_cache_save(m);
    pthread_mutex_unlock(&m->mu);
    hub_mirror_save_rate(m);
}

void hub_stream_flush(df_hub_stream *hs) {
    if (hs) flush(hs->m);
}

df_status hub_stream_set_limit(df_hub_stream *hs, int64_t limit, char *err) {
    if (!hs) return df_fail(err, DF_ERR_ARG, "not an open stream mirror");
    hub_mirror *m = hs->m;
    df_status st = DF_OK;
    pthread_mutex_lock(&m->mu);
    m->limit = limit < 0 ? m->man.cache_limit : limit;
    hub_cache_make_room(m, 0);
    if (m->evict_err[0]) st = df_fail(err, DF_ERR_IO, "%s", m->evict_err);
    pthread_mutex_unlock(&m->mu);
    return st;
}

void hub_stream_meta(df_hub_stream *hs, hub_meta *out) {
    memset(out, 0, sizeof *out);
    if (!hs) return;
    hub_mirror *m = hs->m;
    pthread_mutex_lock(&m->mu);
    out->rate = m->man.rate;
    out->rate_at = m->man.rate_at;
    out->cache_limit = m->limit;
    out->cache_used = hub_cache_used(m);
    out->evicted = m->evicted;
    out->evictions = m->evictions;
    snprintf(out->evict_err, sizeof out->evict_err, "%s", m->evict_err);
    pthread_mutex_unlock(&m->mu);
}

void df_hub_stream_close(df_hub_stream *hs) {
    if (!hs) return;
    flush(hs->m);
    hub_mirror_close(hs->m);
    pthread_mutex_destroy(&hs->mu);
    free(hs->fd);
    free(hs);
}
