/* mem.c — how much memory this process can have (prefix mem_).
 *
 * Owns the reading of the kernel's own answer: MemAvailable from
 * /proc/meminfo (free memory plus the page cache and reclaimable slabs the
 * kernel can give back, never MemFree, which a full page cache drives to
 * nearly zero), capped by the cgroup the process runs in (v2 memory.max -
 * memory.current at every level of the hierarchy, or v1's limit - usage).
 * Refuses nothing: when nothing can be read it falls back to sysconf.
 *
 * Sections: parsers (pure, tested on strings); probes (files).
 */
#include "mem.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- parsers ---- */

int64_t mem_parse_meminfo(const char *text, const char *key) {
    size_t kl = strlen(key);
    for (const char *p = text; p && *p;) {
        if (strncmp(p, key, kl) == 0 && p[kl] == ':') {
            char *end;
            long long kb = strtoll(p + kl + 1, &end, 10);
            if (end == p + kl + 1 || kb < 0) return -1;
            return (int64_t)kb * 1024;
        }
        p = strchr(p, '\n');
        if (p) p++;
    }
    return -1;
}

int64_t mem_parse_limit(const char *text) {
    while (*text == ' ' || *text == '\t') text++;
    if (strncmp(text, "max", 3) == 0) return -1;
    char *end;
    long long v = strtoll(text, &end, 10);
    if (end == text || v < 0) return -1;
    /* cgroup v1 says "no limit" with a huge page-rounded number */
    if (v >= (long long)1 << 60) return -1;
    return (int64_t)v;
}

const char *mem_parse_cgroup2_path(const char *text) {
    for (const char *p = text; p && *p;) {
        if (strncmp(p, "0::", 3) == 0) return p + 3;
        p = strchr(p, '\n');
        if (p) p++;
    }
    return NULL;
}

/* ---- probes ---- */

/* Reads a small file into buf (NUL-terminated); 0 on success. */
static int slurp(const char *path, char *buf, size_t cap) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, cap - 1, f);
    fclose(f);
    buf[n] = 0;
    return n > 0 ? 0 : -1;
}

/* Room left under a cgroup directory's limit (-1: no limit there). */
static int64_t cg2_room(const char *dir) {
    char p[4300], b[128];
    snprintf(p, sizeof p, "%s/memory.max", dir);
    if (slurp(p, b, sizeof b)) return -1;
    int64_t max = mem_parse_limit(b);
    if (max < 0) return -1;
    snprintf(p, sizeof p, "%s/memory.current", dir);
    int64_t cur = slurp(p, b, sizeof b) ? 0 : mem_parse_limit(b);
    if (cur < 0) cur = 0;
    return max > cur ? max - cur : 0;
}

int64_t mem_cgroup_room(void) {
    char text[4096], dir[4200];
    int64_t best = -1;
    if (slurp("/proc/self/cgroup", text, sizeof text) == 0) {
        const char *rel = mem_parse_cgroup2_path(text);
        if (rel) {
            size_t n = strcspn(rel, "\n");
            snprintf(dir, sizeof dir, "/sys/fs/cgroup%.*s", (int)(n < 4000 ? n : 4000), rel);
            /* every level up to the root: the tightest limit wins */
            for (;;) {
                int64_t r = cg2_room(dir);
                if (r >= 0 && (best < 0 || r < best)) best = r;
                char *slash = strrchr(dir, '/');
                if (!slash || slash == dir || strcmp(dir, "/sys/fs/cgroup") == 0) break;
                *slash = 0;
            }
        }
    }
    if (best < 0) { /* cgroup v1 */
        char b[128];
        if (slurp("/sys/fs/cgroup/memory/memory.limit_in_bytes", b, sizeof b) == 0) {
            int64_t lim = mem_parse_limit(b);
            int64_t use = slurp("/sys/fs/cgroup/memory/memory.usage_in_bytes", b, sizeof b) ? 0 : mem_parse_limit(b);
            if (lim >= 0) best = lim > use ? lim - (use > 0 ? use : 0) : 0;
        }
    }
    return best;
}

int64_t mem_available(void) {
    char text[8192];
    int64_t avail = -1;
    if (slurp("/proc/meminfo", text, sizeof text) == 0) avail = mem_parse_meminfo(text, "MemAvailable");
    if (avail < 0) {
        long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        avail = pages > 0 && psz > 0 ? (int64_t)pages * psz : (int64_t)4 << 30;
    }
    int64_t cg = mem_cgroup_room();
    return cg >= 0 && cg < avail ? cg : avail;
}
