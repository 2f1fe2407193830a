/* mem.h — memory the process can have (prefix mem_): MemAvailable capped by
 * the cgroup limit. The parsers are separate so tests feed them strings. */
#ifndef DF_BASE_MEM_H
#define DF_BASE_MEM_H
#include <stdint.h>

/* Bytes the kernel can give this process now: /proc/meminfo MemAvailable
 * (never MemFree), capped by the cgroup's room (limit - usage). */
int64_t mem_available(void);
/* Room under the cgroup limits (v2 at every level, else v1); -1: no limit. */
int64_t mem_cgroup_room(void);

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
