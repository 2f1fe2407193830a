/* port.c — the portability wrappers of port.h.
 *
 * Owns: port_qsort_r, port_random, port_punch_hole, port_dio_mem_align. On
 * Linux each is the glibc call (qsort_r, getrandom, fallocate PUNCH_HOLE,
 * statx); macOS gets qsort_r's other argument order, getentropy and
 * F_PUNCHHOLE; any other POSIX system getentropy and EOPNOTSUPP for holes;
 * outside Linux the DIO alignment is the caller's fallback.
 * Refuses: state (every call is self-contained).
 */
#include "port.h"
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/random.h>
#include <sys/stat.h>
#elif defined(__APPLE__)
#include <sys/random.h>
#endif

#if defined(__APPLE__)
typedef struct {
    int (*cmp)(const void *, const void *, void *);
    void *ctx;
} thunk;
static int apple_cmp(void *t, const void *a, const void *b) {
    const thunk *k = t;
    return k->cmp(a, b, k->ctx);
}
#endif

void port_qsort_r(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *, void *),
                  void *ctx) {
#if defined(__APPLE__)
    thunk k = {cmp, ctx};
    qsort_r(base, n, size, &k, apple_cmp);
#else
    qsort_r(base, n, size, cmp, ctx);
#endif
}

int port_random(void *buf, size_t n) {
#if defined(__linux__)
    return getrandom(buf, n, 0) == (ssize_t)n ? 0 : -1;
#else
    return getentropy(buf, n);
#endif
}

int port_punch_hole(int fd, int64_t off, int64_t len) {
#if defined(__linux__)
    return fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len);
#elif defined(__APPLE__) && defined(F_PUNCHHOLE)
    struct fpunchhole h = {.fp_flags = 0, .reserved = 0, .fp_offset = (off_t)off, .fp_length = (off_t)len};
    return fcntl(fd, F_PUNCHHOLE, &h);
#else
    (void)fd, (void)off, (void)len;
    errno = EOPNOTSUPP;
    return -1;
#endif
}

int port_dio_mem_align(const char *path, int fallback) {
#if defined(__linux__) && defined(STATX_DIOALIGN)
    struct statx sx;
    if (statx(AT_FDCWD, path, 0, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
        sx.stx_dio_mem_align > 0)
        return (int)sx.stx_dio_mem_align;
#else
    (void)path;
#endif
    return fallback;
}
