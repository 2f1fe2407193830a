/* mem.h — memory the process can have (prefix mem_): MemAvailable capped by
 * the cgroup limit. The parsers are separate so tests feed them strings. */
#ifndef DF_BASE_MEM_H
#define DF_BASE_MEM_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Bytes the kernel can give this process now: /proc/meminfo MemAvailable
 * (never MemFree), capped by the cgroup's room (limit - usage). */
int64_t mem_available(void);
/* Room under the cgroup limits (v2 at every level, else v1); -1: no limit. */
int64_t mem_cgroup_room(void);

/* Big buffers populated behind the caller's back: a background thread asks
 * the kernel to fault [p, p + n) in (MADV_POPULATE_WRITE, 2 MB at a time;
 * the bytes are never written, so memory already in use keeps its contents;
 * at nice 19, so it takes CPU time the caller does not need),
 * so an engine open does not wait seconds for gigabytes of page clearing.
 * The memory is usable at once: a page touched first is faulted by whoever
 * touches it. mem_fill_stop stops the thread (between chunks) and waits;
 * call it before unmapping. NULL (nothing to stop) when no thread could be
 * started or the kernel lacks MADV_POPULATE_WRITE: pages then fault on use. */
typedef struct mem_fill mem_fill;
mem_fill *mem_fill_start(void *p, size_t n);
void mem_fill_stop(mem_fill *f); /* NULL-safe */

/* This process's mappings of the files paths[0..n) (absolute, links
 * resolved, as the kernel prints them): the bytes resident (Rss) and, of
 * those, the bytes mapped by 2 MB entries (FilePmdMapped). Weights the page
 * cache holds in small folios decode slower (TLB misses). 0, or -1 without
 * /proc/self/smaps. mem_parse_smaps reads an smaps text from f (tests feed
 * fmemopen'd strings). */
int mem_mapped_files(const char *const *paths, int n, int64_t *rss, int64_t *pmd);
void mem_parse_smaps(FILE *f, const char *const *paths, int n, int64_t *rss, int64_t *pmd);
/* n bytes of anonymous memory starting on a 2 MB boundary, advised for 2 MB
 * pages (MADV_HUGEPAGE, where the kernel has them; 4 KB pages work too):
 * large weight copies fault in 512x fewer times (a 4 KB fault cost ~20 us on
 * a VM: 5.6 GB in 4 KB pages took 32 s of system time). NULL when out of
 * memory. mem_huge_free takes the same n. */
void *mem_huge_alloc(size_t n);
void mem_huge_free(void *p, size_t n);
/* A large buffer that is kept and written through (a prompt's block
 * buffers, scratch kept between calls), released with free(): 64-byte
 * aligned; from 2 MB up, rounded up to whole 2 MB pages, on a 2 MB
 * boundary and advised for them, so its first writes fault 512x fewer
 * times (a K3-width prompt block's ~600 MB took ~2 s of a 17 s first
 * prompt in 4 KB faults on a 2-vCPU VM).
 * NULL when out of memory. */
void *mem_big_alloc(size_t n);
/* This process's anonymous mappings inside [p, p + n): the bytes resident
 * (Rss) and, of those, the bytes in 2 MB pages (AnonHugePages). 0, or -1
 * without /proc/self/smaps. mem_parse_smaps_range reads an smaps text. */
int mem_range_pages(const void *p, size_t n, int64_t *rss, int64_t *huge);
void mem_parse_smaps_range(FILE *f, uintptr_t lo, uintptr_t hi, int64_t *rss, int64_t *huge);
/* "Key:  123 kB" lines -> bytes; -1 if key is absent. */
int64_t mem_parse_meminfo(const char *text, const char *key);
/* A cgroup limit or usage file: bytes, or -1 for "max" / no limit. */
int64_t mem_parse_limit(const char *text);
/* The path of a controller's cgroup in a /proc/self/cgroup text ("memory"
 * for v1's "4:memory:/a/b", "" for v2's "0::/a/b"), or NULL. */
const char *mem_parse_cgroup_path(const char *text, const char *controller);
/* "key 123" lines (memory.stat) -> 123; -1 if key is absent. */
int64_t mem_parse_stat(const char *text, const char *key);
#endif
