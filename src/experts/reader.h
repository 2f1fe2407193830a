/* reader.h — asynchronous positional reads for the expert store (prefix xr_).
 *
 * A reader keeps many reads in flight against the model's shard files so the
 * disk sees a deep queue (100-300 MB outstanding). Two engines behind one
 * interface:
 *   XR_URING  io_uring (liburing) on files opened with O_DIRECT;
 *   XR_PREAD  a pool of I/O threads doing pread (O_DIRECT or buffered);
 * XR_AUTO picks io_uring when the kernel allows it, else the pool.
 * Every system call goes through the df_io table (io.h) so tests can inject
 * EINTR, short reads, EIO and slow reads; short reads and EINTR are retried
 * until the request is complete, EOF or an error completes it with an errno.
 *
 * O_DIRECT rules: offset and length must be multiples of XR_ALIGN, the
 * buffer of the device's memory alignment (4 bytes on NVMe, 512 on many
 * virtual disks; the store asks statx); xr_submit refuses (EINVAL) requests
 * that are not, or whose buffer is not on XR_MEM_ALIGN_MIN bytes, and the
 * kernel those whose buffer the device cannot take. The caller (the store)
 * aligns spans itself.
 *
 * One thread submits and reaps (the engine's main thread); the reader may
 * run its own worker threads internally.
 *
 * Memory: xr_open allocates `depth` request slots and a queue for requests
 * beyond depth; the queue doubles when more than its capacity (4 x depth at
 * first) are outstanding, so a steady caller allocates nothing per request.
 *
 * Example (the store's pattern):
 *
 *   xr_open(io, XR_AUTO, 32, 0, &r, err);
 *   for (i = 0; i < n; i++) xr_submit(r, fd, 1, slot[i], span[i].len, span[i].off, i);
 *   while ((k = xr_wait(r, done, 16)) > 0)
 *       for (j = 0; j < k; j++) done[j].err ? drop(done[j].user) : use(done[j].user);
 */
#ifndef DF_EXPERTS_READER_H
#define DF_EXPERTS_READER_H
#include "deltafin.h"
#include "../base/io.h"
#include <stddef.h>
#include <stdint.h>

enum { XR_ALIGN = 4096, XR_MEM_ALIGN_MIN = 4 };
typedef enum { XR_AUTO = 0, XR_URING, XR_PREAD } xr_kind;

typedef struct xs_reader xs_reader;

typedef struct {
    uint64_t user;      /* the caller's tag from xr_submit */
    int err;            /* 0, or an errno (EIO for a read that hit end of file) */
} xr_done;

/* depth: most requests in flight, 1..XR_MAX_DEPTH (submissions beyond it
 * queue inside the reader). threads: I/O threads for XR_PREAD (ignored by
 * io_uring); <= 0 or more than depth means depth, since a pool thread has
 * one read in flight. XR_URING fails with DF_ERR_UNSUPPORTED when the kernel
 * refuses io_uring; XR_AUTO then uses the pool (see xr_note). On error
 * *out is NULL and nothing is left allocated. */
enum { XR_MAX_DEPTH = 4096 };
df_status xr_open(const df_io *io, xr_kind kind, int depth, int threads, xs_reader **out, char *err);
/* Waits for reads the disk has started (their buffers are written when it
 * returns); requests still queued behind depth are dropped unstarted, and no
 * completion of either is reported. NULL-safe. */
void xr_close(xs_reader *r);
xr_kind xr_kind_of(const xs_reader *r);    /* the engine actually in use */
const char *xr_kind_name(xr_kind k);
/* One line on the engine choice, e.g. "io_uring, depth 32" or "pread pool
 * (8 threads, depth 8): io_uring refused: Operation not permitted". */
const char *xr_note(const xs_reader *r);

/* Queues a read of len bytes at off of fd into buf. Returns 0, or an errno
 * (EINVAL for misaligned direct reads). Never blocks on the disk. */
int xr_submit(xs_reader *r, int fd, int direct, void *buf, size_t len, int64_t off, uint64_t user);
/* xr_submit ahead of every request still waiting for a slot (those in
 * flight go on): reads a computation waits for now jump the speculative
 * ones queued earlier (the expert store's prefetch). */
int xr_submit_first(xs_reader *r, int fd, int direct, void *buf, size_t len, int64_t off, uint64_t user);
/* Waits for at least one completion (up to max), returns how many were
 * written to done (0 only if nothing is in flight). A negative errno means
 * the engine itself failed (io_uring_enter refused the queued reads, which
 * stay queued); it never happens with the pool. */
int xr_wait(xs_reader *r, xr_done *done, int max);
/* Like xr_wait but never blocks. */
int xr_poll(xs_reader *r, xr_done *done, int max);
/* Requests submitted and not yet returned by xr_wait/xr_poll. */
int xr_in_flight(const xs_reader *r);

/* Measures the O_DIRECT read bandwidth of the file at path: reads of chunk
 * bytes (rounded up to XR_ALIGN) at random aligned offsets, depth of them in
 * flight, for about `seconds`, through the given engine. *gbps is 1e9 bytes
 * per second, from the first submit to the last completion. Needs a file of
 * at least chunk bytes; allocates depth x chunk bytes of buffers for the run.
 * Fails with DF_ERR_UNSUPPORTED if the file system refuses O_DIRECT. Pages
 * already cached do not help: O_DIRECT reads go to the device. */
df_status xr_probe_bandwidth(const df_io *io, const char *path, xr_kind kind, size_t chunk,
                             int depth, double seconds, double *gbps, char *err);
#endif
