/* io.c — the default POSIX I/O table and the two helpers built on it.
 *
 * Owns: df_io_default (open/close/pread/fstat/mmap/munmap as plain POSIX
 * calls, io_uring through liburing unless built with -DDF_NO_URING),
 * io_pread_full (exact reads: retries EINTR and short reads, EOF is
 * EIO) and io_read_text (a whole small file, NUL-terminated).
 * Refuses: any buffering or caching; any knowledge of file formats. Every
 * caller goes through a df_io table so tests can swap in faulty functions.
 *
 * io_list_dir is the one directory listing (the single-file/glob mode of
 * the safetensors reader); it goes straight to opendir.
 *
 * Portability: plain POSIX but for io_uring (Linux, liburing) and O_DIRECT
 * (emulated where missing: see DF_O_DIRECT in io.h).
 *
 * Sections: 1. default table  2. helpers
 */
#include "io.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#ifndef DF_NO_URING
#include <liburing.h>
#endif

/* ---- 1. default table ---------------------------------------------------- */

static int px_open(void *ctx, const char *path, int flags, int mode) {
    (void)ctx;
#if DF_HAVE_O_DIRECT
    return open(path, flags | O_CLOEXEC, (mode_t)mode);
#else
    int nocache = (flags & DF_O_DIRECT) != 0;
    int fd = open(path, (flags & ~DF_O_DIRECT) | O_CLOEXEC, (mode_t)mode);
    if (fd >= 0 && nocache) {
#if defined(F_NOCACHE)
        (void)fcntl(fd, F_NOCACHE, 1); /* macOS: reads bypass the unified buffer cache */
#elif defined(POSIX_FADV_NOREUSE)
        (void)posix_fadvise(fd, 0, 0, POSIX_FADV_NOREUSE);
#endif
    }
    return fd;
#endif
}

static int px_close(void *ctx, int fd) {
    (void)ctx;
    return close(fd);
}

static ssize_t px_pread(void *ctx, int fd, void *buf, size_t n, off_t off) {
    (void)ctx;
    return pread(fd, buf, n, off);
}

static int px_fsize(void *ctx, int fd, int64_t *size) {
    (void)ctx;
    struct stat sb;
    if (fstat(fd, &sb) != 0) return -1;
    *size = (int64_t)sb.st_size;
    return 0;
}

static void *px_mmap(void *ctx, size_t len, int fd) {
    (void)ctx;
    if (len == 0) {
        errno = EINVAL;
        return NULL;
    }
    void *p = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

static int px_munmap(void *ctx, void *p, size_t len) {
    (void)ctx;
    return munmap(p, len);
}

#ifndef DF_NO_URING
/* df_ring is liburing's struct io_uring, heap-allocated by ring_open. */
struct df_ring {
    struct io_uring u;
};

static int ur_open(unsigned entries, df_ring **out) {
    *out = NULL;
    df_ring *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    int rc = io_uring_queue_init(entries, &r->u, 0);
    if (rc < 0) { /* liburing returns -errno */
        free(r);
        return rc;
    }
    *out = r;
    return 0;
}

static void ur_close(df_ring *r) {
    if (!r) return;
    io_uring_queue_exit(&r->u);
    free(r);
}

static int ur_read(df_ring *r, int fd, void *buf, unsigned n, int64_t off, uint64_t tag) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->u);
    if (!sqe) return -EBUSY;
    io_uring_prep_read(sqe, fd, buf, n, (uint64_t)off);
    io_uring_sqe_set_data64(sqe, tag);
    return 0;
}

static int ur_submit(df_ring *r) { return io_uring_submit(&r->u); }

static int ur_wait(df_ring *r, int block, uint64_t *tag, int *res) {
    struct io_uring_cqe *cqe = NULL;
    int rc = block ? io_uring_wait_cqe(&r->u, &cqe) : io_uring_peek_cqe(&r->u, &cqe);
    if (rc == -EAGAIN && !block) return 0;
    if (rc < 0) return rc;
    *tag = io_uring_cqe_get_data64(cqe);
    *res = cqe->res;
    io_uring_cqe_seen(&r->u, cqe);
    return 1;
}
#endif

static const df_io posix_io = {
    .open = px_open,
    .close = px_close,
    .pread = px_pread,
    .fsize = px_fsize,
    .mmap = px_mmap,
    .munmap = px_munmap,
#ifndef DF_NO_URING
    .ring_open = ur_open,
    .ring_close = ur_close,
    .ring_read = ur_read,
    .ring_submit = ur_submit,
    .ring_wait = ur_wait,
#endif
};

const df_io *df_io_default(void) { return &posix_io; }

/* ---- 2. helpers ------------------------------------------------------------ */

void io_drop_cache(int fd, int64_t off, size_t n) {
#if !DF_HAVE_O_DIRECT && !defined(F_NOCACHE) && defined(POSIX_FADV_DONTNEED)
    (void)posix_fadvise(fd, (off_t)off, (off_t)n, POSIX_FADV_DONTNEED);
#else
    (void)fd, (void)off, (void)n;
#endif
}

void io_drop_written(int fd) {
#ifdef POSIX_FADV_DONTNEED
    (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
#else
    (void)fd;
#endif
}

int io_pread_full(const df_io *io, int fd, void *buf, size_t n, int64_t off) {
    char *p = buf;
    while (n > 0) {
        ssize_t got = io_pread(io, fd, p, n, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) { /* EOF before n bytes: the file is shorter than promised */
            errno = EIO;
            return -1;
        }
        p += got;
        n -= (size_t)got;
        off += got;
    }
    return 0;
}

char *io_read_text(const df_io *io, const char *path, size_t max_bytes, size_t *len) {
    int fd = io_open(io, path, O_RDONLY, 0);
    if (fd < 0) return NULL;
    int64_t size = 0;
    if (io_fsize(io, fd, &size) != 0) {
        int e = errno;
        io_close(io, fd);
        errno = e;
        return NULL;
    }
    if (size < 0 || (uint64_t)size > max_bytes) {
        io_close(io, fd);
        errno = EFBIG;
        return NULL;
    }
    char *buf = malloc((size_t)size + 1);
    if (!buf) {
        io_close(io, fd);
        errno = ENOMEM;
        return NULL;
    }
    if (io_pread_full(io, fd, buf, (size_t)size, 0) != 0) {
        int e = errno;
        free(buf);
        io_close(io, fd);
        errno = e;
        return NULL;
    }
    io_close(io, fd);
    buf[size] = 0;
    if (len) *len = (size_t)size;
    return buf;
}

static int by_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

void io_free_names(char **names, size_t n) {
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
}

int io_list_dir(const char *dir, const char *suffix, char ***names, size_t *n) {
    *names = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return -1;
    char **v = NULL;
    size_t cnt = 0, cap = 0, sl = strlen(suffix);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        size_t l = strlen(de->d_name);
        if (de->d_name[0] == '.' || l < sl || strcmp(de->d_name + l - sl, suffix) != 0) continue;
        if (cnt == cap) {
            cap = cap ? cap * 2 : 16;
            char **nv = realloc(v, cap * sizeof *nv);
            if (!nv) goto nomem;
            v = nv;
        }
        if (!(v[cnt] = strdup(de->d_name))) goto nomem;
        cnt++;
    }
    closedir(d);
    if (cnt) qsort(v, cnt, sizeof *v, by_str);
    *names = v;
    *n = cnt;
    return 0;
nomem:
    closedir(d);
    io_free_names(v, cnt);
    errno = ENOMEM;
    return -1;
}
