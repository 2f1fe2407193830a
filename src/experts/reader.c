/* reader.c — asynchronous positional reads for the expert store (xr_).
 *
 * Owns: the two read engines behind reader.h (io_uring through the df_io
 * ring_* entries; a pool of pread threads), the request bookkeeping they
 * share (retry of short reads and EINTR, EOF -> EIO), and the O_DIRECT
 * bandwidth probe the decode bench uses as its floor.
 * Refuses: opening or closing the caller's files, knowing what the bytes
 * are, caching, printing. Every system call goes through df_io.
 *
 * A request is (fd, buf, len, off, user). It waits in the pending FIFO until
 * one of `depth` slots is free, is in flight until every byte has arrived or
 * an error ended it, then waits in the done FIFO until xr_wait/xr_poll hands
 * it back:
 *
 *   xr_submit -> pending -> slot (in flight; retried here) -> done -> xr_wait
 *
 * Both FIFOs hold at most `outstanding` entries (submitted, not reaped), so
 * they share one capacity that doubles only when outstanding reaches it.
 *
 * Sections: 1. requests and queues  2. pread pool  3. io_uring
 *           4. public API  5. bandwidth probe
 */
#include "reader.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* One system call reads at most this much (Linux caps a read near 2 GiB). */
#define XR_MAX_IO ((size_t)1 << 30)
/* io_uring: bytes of reads handed to the kernel at once, adapted to the
 * device. The submitting call (io_uring_enter, on the caller's thread) may
 * issue O_DIRECT reads inline and sleep until the device drains: 16 expert
 * reads of 17.5 MB blocked the token loop ~150 ms per K3-width layer on a
 * virtio disk, so the shared experts and the next layer's router, meant to
 * run under the reads, ran after them. Yet a fixed small cap starves fast
 * storage of parallel reads. So the cap starts at XR_CAP_START, halves
 * (down to XR_CAP_MIN) whenever one submit call takes over XR_SLOW_SUBMIT,
 * and grows by a quarter (up to XR_CAP_MAX) after a fast submit that the cap
 * held back; reads beyond it wait in the pending FIFO. */
#define XR_CAP_START ((int64_t)128 << 20)
#define XR_CAP_MIN ((int64_t)32 << 20)
#define XR_CAP_MAX ((int64_t)1 << 30)
#define XR_SLOW_SUBMIT 0.004 /* seconds */
/* Direct short reads that make no aligned progress this many times in a row
 * are end of file inside the last block. */
enum { XR_MAX_STALLS = 3 };

/* ---- 1. requests and queues ---------------------------------------------- */

typedef struct {
    int fd;
    int direct;          /* O_DIRECT fd: retries must stay XR_ALIGN-aligned */
    char *buf;
    size_t len;
    int64_t off;
    uint64_t user;
    size_t got;          /* bytes already in buf */
    int stalls;          /* consecutive direct short reads with no aligned progress */
    size_t issued;       /* io_uring: bytes of the read now in the ring (counted in active_bytes) */
} xreq;

typedef struct {
    xreq *q;             /* pending ring buffer, cap entries */
    xr_done *d;          /* done ring buffer, cap entries */
    size_t cap, qhead, qn, dhead, dn;
} xfifo;

struct xs_reader {
    const df_io *io;
    xr_kind kind;
    int depth;
    int outstanding;     /* submitted, not yet handed back; caller's thread only */
    xfifo f;             /* under mu for the pool */
    char note[160];
    /* pread pool */
    pthread_mutex_t mu;
    pthread_cond_t work; /* pending became non-empty, or stop */
    pthread_cond_t fin;  /* done became non-empty */
    pthread_t *th;
    int nthreads;
    int stop;
    int sync_ok;         /* mu/work/fin initialised */
    /* io_uring */
    df_ring *ring;
    xreq *slot;          /* depth slots; the ring tag is the slot index */
    int *free_slots;     /* stack of free slot indices */
    int nfree;
    int active;          /* slots with a read queued or in the kernel */
    int64_t active_bytes; /* bytes those reads ask for (at most cap_bytes but one read) */
    int64_t cap_bytes;   /* adaptive (XR_CAP_*) */
    int held_back;       /* ur_pump left reads pending because of cap_bytes */
    int unsubmitted;     /* reads queued in the ring, not yet taken by the kernel */
};

static int fifo_init(xfifo *f, size_t cap) {
    memset(f, 0, sizeof *f);
    f->q = malloc(cap * sizeof *f->q);
    f->d = malloc(cap * sizeof *f->d);
    if (!f->q || !f->d) {
        free(f->q);
        free(f->d);
        f->q = NULL;
        f->d = NULL;
        return ENOMEM;
    }
    f->cap = cap;
    return 0;
}

static void fifo_free(xfifo *f) {
    free(f->q);
    free(f->d);
    memset(f, 0, sizeof *f);
}

/* Doubles both rings, keeping their order. On failure nothing changes. */
static int fifo_grow(xfifo *f) {
    size_t nc = f->cap * 2;
    xreq *q = malloc(nc * sizeof *q);
    xr_done *d = malloc(nc * sizeof *d);
    if (!q || !d) {
        free(q);
        free(d);
        return ENOMEM;
    }
    for (size_t i = 0; i < f->qn; i++) q[i] = f->q[(f->qhead + i) % f->cap];
    for (size_t i = 0; i < f->dn; i++) d[i] = f->d[(f->dhead + i) % f->cap];
    free(f->q);
    free(f->d);
    f->q = q;
    f->d = d;
    f->cap = nc;
    f->qhead = f->dhead = 0;
    return 0;
}

static void push_req(xfifo *f, const xreq *q) {
    ASSERT(f->qn < f->cap);
    f->q[(f->qhead + f->qn++) % f->cap] = *q;
}

/* Ahead of every pending request (still behind those in flight). */
static void push_req_front(xfifo *f, const xreq *q) {
    ASSERT(f->qn < f->cap);
    f->qhead = (f->qhead + f->cap - 1) % f->cap;
    f->q[f->qhead] = *q;
    f->qn++;
}

static xreq pop_req(xfifo *f) {
    ASSERT(f->qn > 0);
    xreq q = f->q[f->qhead];
    f->qhead = (f->qhead + 1) % f->cap;
    f->qn--;
    return q;
}

static void push_done(xfifo *f, uint64_t user, int e) {
    ASSERT(f->dn < f->cap);
    xr_done *d = &f->d[(f->dhead + f->dn++) % f->cap];
    d->user = user;
    d->err = e;
}

static int pop_done(xfifo *f, xr_done *out, int max) {
    int n = 0;
    while (n < max && f->dn > 0) {
        out[n++] = f->d[f->dhead];
        f->dhead = (f->dhead + 1) % f->cap;
        f->dn--;
    }
    return n;
}

/* Bytes the next read of q asks for. */
static size_t next_len(const xreq *q) {
    size_t want = q->len - q->got;
    return want > XR_MAX_IO ? XR_MAX_IO : want;
}

/* Accounts one read result of q (bytes, or -errno). Returns -1 when more
 * must be read (the remainder; after EINTR/EAGAIN the same range again), 0
 * when q is complete, or the errno that ends it (EIO at end of file).
 * A direct fd advances only by whole XR_ALIGN blocks so the retry stays
 * aligned; the bytes past the block are read again. */
static int account(xreq *q, int64_t res) {
    if (res < 0) {
        int e = (int)-res;
        return e == EINTR || e == EAGAIN ? -1 : e;
    }
    if (res == 0) return EIO; /* end of file before len bytes */
    size_t want = next_len(q);
    size_t adv = (uint64_t)res > want ? want : (size_t)res;
    if (q->direct && adv < q->len - q->got) {
        adv &= ~(size_t)(XR_ALIGN - 1);
        if (adv == 0) return ++q->stalls >= XR_MAX_STALLS ? EIO : -1;
    }
    q->stalls = 0;
    q->got += adv;
    return q->got == q->len ? 0 : -1;
}

/* ---- 2. pread pool ---------------------------------------------------------- */

/* Reads all of q with retries; 0 or an errno. */
static int pool_read(const df_io *io, xreq *q) {
    for (;;) {
        ssize_t n = io_pread(io, q->fd, q->buf + q->got, next_len(q), (off_t)(q->off + (int64_t)q->got));
        int e = account(q, n < 0 ? -(int64_t)errno : (int64_t)n);
        if (e == 0 && q->direct) io_drop_cache(q->fd, q->off, q->len); /* emulated O_DIRECT only */
        if (e >= 0) return e;
    }
}

static void *pool_main(void *arg) {
    xs_reader *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && r->f.qn == 0) pthread_cond_wait(&r->work, &r->mu);
        if (r->stop) break;
        xreq q = pop_req(&r->f);
        pthread_mutex_unlock(&r->mu);
        int e = pool_read(r->io, &q);
        pthread_mutex_lock(&r->mu);
        push_done(&r->f, q.user, e);
        pthread_cond_signal(&r->fin);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static int pool_start(xs_reader *r, int threads) {
    if (pthread_mutex_init(&r->mu, NULL) != 0) return EAGAIN;
    if (pthread_cond_init(&r->work, NULL) != 0) {
        pthread_mutex_destroy(&r->mu);
        return EAGAIN;
    }
    if (pthread_cond_init(&r->fin, NULL) != 0) {
        pthread_cond_destroy(&r->work);
        pthread_mutex_destroy(&r->mu);
        return EAGAIN;
    }
    r->sync_ok = 1;
    r->th = calloc((size_t)threads, sizeof *r->th);
    if (!r->th) return ENOMEM;
    for (int i = 0; i < threads; i++) {
        int rc = pthread_create(&r->th[i], NULL, pool_main, r);
        if (rc != 0) return rc;
        r->nthreads++;
    }
    return 0;
}

/* Stops the threads after their current read; queued requests are dropped. */
static void pool_stop(xs_reader *r) {
    if (!r->sync_ok) return;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->work);
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < r->nthreads; i++) pthread_join(r->th[i], NULL);
    free(r->th);
    r->th = NULL;
    r->nthreads = 0;
    pthread_cond_destroy(&r->fin);
    pthread_cond_destroy(&r->work);
    pthread_mutex_destroy(&r->mu);
    r->sync_ok = 0;
}

/* ---- 3. io_uring -------------------------------------------------------------- */

static void slot_release(xs_reader *r, int s) {
    r->free_slots[r->nfree++] = s;
    r->active--;
}

/* Queues the next read of slot s in the ring. If the ring refuses, the
 * request completes with that error. */
static void ur_issue(xs_reader *r, int s) {
    xreq *q = &r->slot[s];
    q->issued = next_len(q);
    int rc = r->io->ring_read(r->ring, q->fd, q->buf + q->got, (unsigned)q->issued,
                              q->off + (int64_t)q->got, (uint64_t)s);
    if (rc >= 0) r->active_bytes += (int64_t)q->issued;
    if (rc < 0) {
        push_done(&r->f, q->user, -rc);
        slot_release(r, s);
        return;
    }
    r->unsubmitted++;
}

/* Moves pending requests into free slots while the bytes in the kernel stay
 * under cap_bytes (one read always goes, however large). */
static void ur_pump(xs_reader *r) {
    while (r->nfree > 0 && r->f.qn > 0) {
        const xreq *head = &r->f.q[r->f.qhead];
        if (r->active > 0 && r->active_bytes + (int64_t)next_len(head) > r->cap_bytes) {
            r->held_back = 1;
            break;
        }
        int s = r->free_slots[--r->nfree];
        r->slot[s] = pop_req(&r->f);
        r->active++;
        ur_issue(r, s);
    }
}

/* Hands queued reads to the kernel. 0, or a negative errno the caller must
 * see (EINTR/EAGAIN/EBUSY are transient: 0, and the reads stay queued). */
static double ur_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int ur_flush(xs_reader *r) {
    while (r->unsubmitted > 0) {
        double t0 = ur_now();
        int rc = r->io->ring_submit(r->ring);
        double dt = ur_now() - t0;
        if (dt > XR_SLOW_SUBMIT) {
            r->cap_bytes = r->cap_bytes / 2 > XR_CAP_MIN ? r->cap_bytes / 2 : XR_CAP_MIN;
        } else if (r->held_back) {
            r->cap_bytes = r->cap_bytes + r->cap_bytes / 4 < XR_CAP_MAX ? r->cap_bytes + r->cap_bytes / 4 : XR_CAP_MAX;
        }
        r->held_back = 0;
        if (rc < 0) return rc == -EINTR || rc == -EAGAIN || rc == -EBUSY ? 0 : rc;
        if (rc == 0) return 0;
        r->unsubmitted -= rc > r->unsubmitted ? r->unsubmitted : rc;
    }
    return 0;
}

/* One completion of slot s: finish it or queue the remainder. */
static void ur_complete(xs_reader *r, uint64_t tag, int res) {
    ASSERT(tag < (uint64_t)r->depth);
    int s = (int)tag;
    xreq *q = &r->slot[s];
    r->active_bytes -= (int64_t)q->issued;
    q->issued = 0;
    int e = account(q, res);
    if (e < 0) {
        ur_issue(r, s);
        return;
    }
    push_done(&r->f, q->user, e);
    slot_release(r, s);
}

/* Reaps every ready completion; with block, waits for the first one. 0 or a
 * negative errno from the ring. */
static int ur_reap(xs_reader *r, int block) {
    for (;;) {
        uint64_t tag = 0;
        int res = 0;
        int rc = r->io->ring_wait(r->ring, block, &tag, &res);
        if (rc == -EINTR || rc == -EAGAIN) continue;
        if (rc < 0) return rc;
        if (rc == 0) return 0;
        ur_complete(r, tag, res);
        block = 0;
    }
}

/* Progress without blocking: reap what is ready, refill, submit. */
static int ur_step(xs_reader *r, int block) {
    int rc = ur_flush(r);
    if (rc < 0) return rc;
    /* Block only when the kernel holds every queued read: a read still in
     * the submission queue would never complete. */
    rc = ur_reap(r, block && r->unsubmitted == 0 && r->active > 0);
    if (rc < 0) return rc;
    ur_pump(r);
    return ur_flush(r);
}

/* Waits until the kernel is done with every read it has taken. */
static void ur_drain(xs_reader *r) {
    for (int tries = 0; r->unsubmitted > 0 && tries < 100; tries++)
        if (ur_flush(r) < 0) break;
    while (r->active > r->unsubmitted) {
        uint64_t tag = 0;
        int res = 0;
        int rc = r->io->ring_wait(r->ring, 1, &tag, &res);
        if (rc == -EINTR || rc == -EAGAIN) continue;
        if (rc <= 0) break;
        if (tag < (uint64_t)r->depth) slot_release(r, (int)tag);
    }
}

static int ur_start(xs_reader *r) {
    int rc = r->io->ring_open((unsigned)r->depth, &r->ring);
    if (rc < 0) {
        r->ring = NULL;
        return -rc;
    }
    r->slot = calloc((size_t)r->depth, sizeof *r->slot);
    r->free_slots = calloc((size_t)r->depth, sizeof *r->free_slots);
    if (!r->slot || !r->free_slots) return ENOMEM;
    for (int i = 0; i < r->depth; i++) r->free_slots[i] = r->depth - 1 - i;
    r->nfree = r->depth;
    r->cap_bytes = XR_CAP_START;
    return 0;
}

static void ur_stop(xs_reader *r) {
    if (r->ring) {
        ur_drain(r);
        r->io->ring_close(r->ring);
        r->ring = NULL;
    }
    free(r->slot);
    free(r->free_slots);
    r->slot = NULL;
    r->free_slots = NULL;
}

/* ---- 4. public API ---------------------------------------------------------- */

const char *xr_kind_name(xr_kind k) {
    switch (k) {
    case XR_AUTO: return "auto";
    case XR_URING: return "io_uring";
    case XR_PREAD: return "pread pool";
    }
    return "unknown";
}

xr_kind xr_kind_of(const xs_reader *r) { return r ? r->kind : XR_AUTO; }
const char *xr_note(const xs_reader *r) { return r ? r->note : ""; }
int xr_in_flight(const xs_reader *r) { return r ? r->outstanding : 0; }

void xr_close(xs_reader *r) {
    if (!r) return;
    if (r->kind == XR_PREAD) pool_stop(r);
    else ur_stop(r);
    fifo_free(&r->f);
    free(r);
}

df_status xr_open(const df_io *io, xr_kind kind, int depth, int threads, xs_reader **out,
                  char *err) {
    *out = NULL;
    if (!io) io = df_io_default();
    if (depth < 1 || depth > XR_MAX_DEPTH)
        return df_fail(err, DF_ERR_ARG, "reader: depth %d outside 1..%d", depth, XR_MAX_DEPTH);
    if (kind != XR_AUTO && kind != XR_URING && kind != XR_PREAD)
        return df_fail(err, DF_ERR_ARG, "reader: unknown engine %d", (int)kind);
    if (threads <= 0 || threads > depth) threads = depth;
    xs_reader *r = calloc(1, sizeof *r);
    if (!r || fifo_init(&r->f, (size_t)depth * 4) != 0) {
        free(r);
        return df_fail(err, DF_ERR_NOMEM, "reader: out of memory for %d request slots", depth);
    }
    r->io = io;
    r->depth = depth;
    char why[96] = "";
    if (kind != XR_PREAD) {
        int e = ENOSYS;
        if (io->ring_open && io->ring_close && io->ring_read && io->ring_submit && io->ring_wait) {
            r->kind = XR_URING; /* so xr_close tears down what ur_start built */
            e = ur_start(r);
        }
        if (e == 0) {
            snprintf(r->note, sizeof r->note, "io_uring, depth %d", depth);
            *out = r;
            return DF_OK;
        }
        ur_stop(r);
        if (e == ENOMEM) {
            xr_close(r);
            return df_fail(err, DF_ERR_NOMEM, "reader: out of memory for %d request slots", depth);
        }
        if (kind == XR_URING) {
            fifo_free(&r->f);
            free(r);
            return df_fail(err, DF_ERR_UNSUPPORTED, "reader: io_uring unavailable: %s", strerror(e));
        }
        snprintf(why, sizeof why, ": io_uring unavailable: %s", strerror(e));
    }
    r->kind = XR_PREAD;
    int e = pool_start(r, threads);
    if (e != 0) {
        xr_close(r);
        return df_fail(err, e == ENOMEM ? DF_ERR_NOMEM : DF_ERR_IO,
                       "reader: cannot start %d I/O threads: %s", threads, strerror(e));
    }
    snprintf(r->note, sizeof r->note, "pread pool (%d threads, depth %d)%s", threads, depth, why);
    *out = r;
    return DF_OK;
}

static int submit(xs_reader *r, int fd, int direct, void *buf, size_t len, int64_t off, uint64_t user, int first) {
    if (!r || fd < 0 || off < 0 || (len > 0 && !buf)) return EINVAL;
    if (len > (size_t)INT64_MAX - (size_t)off) return EINVAL;
    if (direct && (((len | (uint64_t)off) & (XR_ALIGN - 1)) || ((uintptr_t)buf & (XR_MEM_ALIGN_MIN - 1))))
        return EINVAL;
    xreq q = {.fd = fd, .direct = direct != 0, .buf = buf, .len = len, .off = off, .user = user};
    if (r->kind == XR_PREAD) pthread_mutex_lock(&r->mu);
    int e = 0;
    if ((size_t)r->outstanding == r->f.cap) e = fifo_grow(&r->f);
    if (e == 0) {
        r->outstanding++;
        if (len == 0) push_done(&r->f, user, 0);
        else if (first) push_req_front(&r->f, &q);
        else push_req(&r->f, &q);
    }
    if (r->kind == XR_PREAD) {
        if (e == 0) pthread_cond_signal(len == 0 ? &r->fin : &r->work);
        pthread_mutex_unlock(&r->mu);
        return e;
    }
    if (e == 0) {
        ur_pump(r);
        ur_flush(r); /* a hard error resurfaces in xr_wait; the read stays queued */
    }
    return e;
}

int xr_submit(xs_reader *r, int fd, int direct, void *buf, size_t len, int64_t off, uint64_t user) {
    return submit(r, fd, direct, buf, len, off, user, 0);
}

int xr_submit_first(xs_reader *r, int fd, int direct, void *buf, size_t len, int64_t off, uint64_t user) {
    return submit(r, fd, direct, buf, len, off, user, 1);
}

static int reap(xs_reader *r, xr_done *done, int max, int block) {
    if (!r || max <= 0 || r->outstanding == 0) return 0;
    int n = 0;
    if (r->kind == XR_PREAD) {
        pthread_mutex_lock(&r->mu);
        while (block && r->f.dn == 0) pthread_cond_wait(&r->fin, &r->mu);
        n = pop_done(&r->f, done, max);
        pthread_mutex_unlock(&r->mu);
    } else {
        for (;;) {
            int rc = ur_step(r, block && r->f.dn == 0);
            if (rc < 0 && r->f.dn == 0) return rc;
            if (r->f.dn > 0 || !block) break;
        }
        n = pop_done(&r->f, done, max);
    }
    r->outstanding -= n;
    return n;
}

int xr_wait(xs_reader *r, xr_done *done, int max) { return reap(r, done, max, 1); }
int xr_poll(xs_reader *r, xr_done *done, int max) { return reap(r, done, max, 0); }

/* ---- 5. bandwidth probe ------------------------------------------------------ */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* xorshift64*: deterministic offsets, so runs are comparable. */
static uint64_t rnd(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ULL;
}

df_status xr_probe_bandwidth(const df_io *io, const char *path, xr_kind kind, size_t chunk,
                             int depth, double seconds, double *gbps, char *err) {
    *gbps = 0;
    if (!io) io = df_io_default();
    if (chunk == 0 || depth < 1 || depth > XR_MAX_DEPTH)
        return df_fail(err, DF_ERR_ARG, "disk probe: chunk %zu, depth %d", chunk, depth);
    chunk = (chunk + XR_ALIGN - 1) & ~(size_t)(XR_ALIGN - 1);
    int fd = io_open(io, path, O_RDONLY | DF_O_DIRECT, 0);
    if (fd < 0) {
        int e = errno;
        if (e == EINVAL)
            return df_fail(err, DF_ERR_UNSUPPORTED, "disk probe: %s: O_DIRECT refused by the file system", path);
        return df_fail(err, DF_ERR_IO, "disk probe: %s: %s", path, strerror(e));
    }
    int64_t size = 0;
    if (io_fsize(io, fd, &size) != 0 || size < (int64_t)chunk) {
        io_close(io, fd);
        return df_fail(err, DF_ERR_IO, "disk probe: %s: %lld bytes, need at least %zu", path,
                       (long long)size, chunk);
    }
    char *bufs = NULL;
    if (posix_memalign((void **)&bufs, XR_ALIGN, chunk * (size_t)depth) != 0) {
        io_close(io, fd);
        return df_fail(err, DF_ERR_NOMEM, "disk probe: %d x %zu bytes of buffers", depth, chunk);
    }
    memset(bufs, 0, chunk * (size_t)depth); /* fault the pages in before timing */
    xs_reader *r = NULL;
    df_status st = xr_open(io, kind, depth, depth, &r, err);
    if (st != DF_OK) {
        free(bufs);
        io_close(io, fd);
        return st;
    }
    uint64_t seed = 0x9e3779b97f4a7c15ULL;
    uint64_t blocks = (uint64_t)(size - (int64_t)chunk) / XR_ALIGN + 1;
    uint64_t bytes = 0;
    int failed = 0;
    double t0 = now_s(), t1 = t0;
    for (int i = 0; i < depth; i++) {
        int64_t off = (int64_t)(rnd(&seed) % blocks) * XR_ALIGN;
        failed = xr_submit(r, fd, 1, bufs + (size_t)i * chunk, chunk, off, (uint64_t)i);
        if (failed) break;
    }
    xr_done done[64];
    while (xr_in_flight(r) > 0) {
        int n = xr_wait(r, done, 64);
        if (n < 0) {
            failed = -n;
            break;
        }
        t1 = now_s();
        for (int k = 0; k < n; k++) {
            if (done[k].err) {
                failed = done[k].err;
                continue;
            }
            bytes += chunk;
            if (failed || t1 - t0 >= seconds) continue;
            int64_t off = (int64_t)(rnd(&seed) % blocks) * XR_ALIGN;
            failed = xr_submit(r, fd, 1, bufs + done[k].user * chunk, chunk, off, done[k].user);
        }
    }
    xr_close(r);
    free(bufs);
    io_close(io, fd);
    if (failed)
        return df_fail(err, DF_ERR_IO, "disk probe: %s: read failed: %s", path, strerror(failed));
    *gbps = t1 > t0 ? (double)bytes / (t1 - t0) * 1e-9 : 0;
    return DF_OK;
}
