/* port.h — where POSIX systems differ, in one place (prefix port_).
 *
 * The library is POSIX C17 plus, on Linux, io_uring (io.c, behind
 * DF_NO_URING) and O_DIRECT (io.h's DF_O_DIRECT). Everything else that is
 * not the same on Linux (glibc), macOS and the BSDs is wrapped here so the
 * rest of the code needs no #ifdef: file times, qsort with a context,
 * random bytes, populated anonymous maps, hole punching.
 * Refuses: any behaviour change on Linux (every wrapper is the call the code
 * made before on glibc).
 */
#ifndef DF_BASE_PORT_H
#define DF_BASE_PORT_H
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>

/* Linux pre-faults an anonymous map with MAP_POPULATE; elsewhere its pages
 * fault in on first use (same contents, the first pass is slower). */
#ifndef MAP_POPULATE
#define MAP_POPULATE 0
#endif

/* A struct stat's modification time as a struct timespec. */
#if defined(__APPLE__)
#define PORT_ST_MTIM(sb) ((sb).st_mtimespec)
#else
#define PORT_ST_MTIM(sb) ((sb).st_mtim)
#endif

/* qsort with a context in the glibc / POSIX-2024 argument order
 * (cmp(a, b, ctx)); macOS's qsort_r takes them the other way round. */
void port_qsort_r(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *, void *),
                  void *ctx);
/* n bytes (n <= 256) from the kernel's random source: 0, or -1 with errno set. */
int port_random(void *buf, size_t n);
/* Deallocates [off, off + len) of fd's file, keeping its size (a sparse
 * hole): 0, or -1 with errno set (EOPNOTSUPP where the system cannot). */
int port_punch_hole(int fd, int64_t off, int64_t len);
/* The memory alignment an O_DIRECT read of path needs (Linux 6.1+: statx
 * STATX_DIOALIGN; NVMe says 4, virtio disks 512), or fallback where the
 * system cannot say. */
int port_dio_mem_align(const char *path, int fallback);
#endif
