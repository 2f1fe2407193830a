/* io.h — the I/O indirection table (SQLite's aSyscall idea).
 *
 * Every file access of the library goes through a df_io table so tests can
 * inject short reads, EINTR, EIO and truncated files, and a stream mirror can
 * fetch what it lacks (its state is the table's ctx, passed to every file
 * call). df_io_default() returns the plain POSIX table. io_pread_full
 * retries short reads and EINTR.
 *
 * The ring_* entries wrap io_uring (liburing) behind an opaque df_ring so
 * this header does not pull in <liburing.h>; they are NULL in a table (or a
 * build, -DDF_NO_URING) without io_uring, and callers then use pread. A tag
 * given to ring_read comes back with that read's completion; a completion's
 * res is the byte count or a negative errno, as the kernel reports it.
 */
#ifndef DF_BASE_IO_H
#define DF_BASE_IO_H
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* DF_O_DIRECT: the open flag for reads that bypass the page cache (the
 * expert store's and the disk probe's). Where the system has O_DIRECT (Linux)
 * it is O_DIRECT. Elsewhere (macOS; or a Linux build with -DDF_NO_ODIRECT,
 * `make PORTABLE=1`) it is a private bit that the default table removes
 * before open(2), marking the descriptor uncached instead (F_NOCACHE on
 * macOS) and dropping each read's pages after it (io_drop_cache,
 * posix_fadvise DONTNEED). The O_DIRECT alignment rules still apply to such
 * descriptors (harmless, and the same code paths run). A table that calls
 * open(2) itself must strip DF_O_DIRECT when DF_HAVE_O_DIRECT is 0. */
#if defined(O_DIRECT) && !defined(DF_NO_ODIRECT)
#define DF_HAVE_O_DIRECT 1
#define DF_O_DIRECT O_DIRECT
#else
#define DF_HAVE_O_DIRECT 0
#define DF_O_DIRECT 0x40000000
#endif

typedef struct df_ring df_ring; /* an io_uring instance (opaque) */

typedef struct df_io {
    /* The file calls get the table's ctx first (a stream mirror's state; NULL
     * for the POSIX table). Callers use the io_* wrappers below. */
    int (*open)(void *ctx, const char *path, int flags, int mode);
    int (*close)(void *ctx, int fd);
    ssize_t (*pread)(void *ctx, int fd, void *buf, size_t n, off_t off);
    int (*fsize)(void *ctx, int fd, int64_t *size); /* 0 ok, -1 error (errno set) */
    void *(*mmap)(void *ctx, size_t len, int fd);   /* read-only shared map; NULL on failure */
    int (*munmap)(void *ctx, void *p, size_t len);
    /* io_uring. Every int return is 0 (or a count) on success, else a
     * negative errno; none of them sets errno. */
    int (*ring_open)(unsigned entries, df_ring **ring); /* -EPERM/-ENOSYS under seccomp */
    void (*ring_close)(df_ring *ring);                  /* NULL-safe */
    /* Queues one read (not yet visible to the kernel); -EBUSY if the
     * submission queue is full. */
    int (*ring_read)(df_ring *ring, int fd, void *buf, unsigned n, int64_t off, uint64_t tag);
    int (*ring_submit)(df_ring *ring);                  /* reads handed to the kernel */
    /* One completion: 1 with *tag and *res, 0 if none is ready and block is
     * 0, or a negative errno (-EINTR: call again). */
    int (*ring_wait)(df_ring *ring, int block, uint64_t *tag, int *res);
    /* 1 when the table itself writes into the files it serves (a stream-mode
     * mirror filling holes): their modification time says nothing about a
     * change from outside. */
    int fills_in_place;
    void *ctx;
} df_io;

static inline int io_open(const df_io *io, const char *path, int flags, int mode) {
    return io->open(io->ctx, path, flags, mode);
}
static inline int io_close(const df_io *io, int fd) { return io->close(io->ctx, fd); }
static inline ssize_t io_pread(const df_io *io, int fd, void *buf, size_t n, off_t off) {
    return io->pread(io->ctx, fd, buf, n, off);
}
static inline int io_fsize(const df_io *io, int fd, int64_t *size) { return io->fsize(io->ctx, fd, size); }
static inline void *io_mmap(const df_io *io, size_t len, int fd) { return io->mmap(io->ctx, len, fd); }
static inline int io_munmap(const df_io *io, void *p, size_t len) { return io->munmap(io->ctx, p, len); }

const df_io *df_io_default(void);
/* After a read of [off, off + n) through a DF_O_DIRECT descriptor: where
 * DF_O_DIRECT is emulated, asks the kernel to drop those pages (so the
 * expert cache's bytes are not held twice); a no-op with real O_DIRECT.
 * Advice only: errors are ignored. */
void io_drop_cache(int fd, int64_t off, size_t n);
/* After a weight file was written and fsync'd (its pages clean): drops them
 * from the page cache (posix_fadvise DONTNEED; nothing where the system has
 * no such advice). write(2) leaves small (4 KB) folios behind, and a spine
 * mapped from them decoded up to 4x slower on a Zen 5 VM (TLB misses) than
 * one the kernel reads back, which it does in large (2 MB) folios. Advice
 * only: errors are ignored. */
void io_drop_written(int fd);
/* Reads exactly n bytes at off; returns 0, or -1 with errno set (EIO on EOF). */
int io_pread_full(const df_io *io, int fd, void *buf, size_t n, int64_t off);
/* Reads a whole small file into a NUL-terminated malloc'd buffer. NULL on error. */
char *io_read_text(const df_io *io, const char *path, size_t max_bytes, size_t *len);
/* Names of the entries of dir ending in suffix (hidden files skipped), sorted
 * with strcmp, in a malloc'd array of malloc'd strings (*names may be NULL if
 * *n is 0). 0, or -1 with errno set. Free with io_free_names. Kept here
 * because <dirent.h> clashes with dtype.h's DT_UNKNOWN. */
int io_list_dir(const char *dir, const char *suffix, char ***names, size_t *n);
void io_free_names(char **names, size_t n);
#endif
