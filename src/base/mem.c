/* mem.c — how much memory this process can have (prefix mem_).
 *
 * Owns the reading of the kernel's own answer: MemAvailable from
 * /proc/meminfo (free memory plus the page cache and reclaimable slabs the
 * kernel can give back, never MemFree, which a full page cache drives to
 * nearly zero), capped by the cgroup the process runs in (v2 memory.max -
 * memory.current at every level of the hierarchy, or v1's limit - usage).
 * Refuses nothing: when nothing can be read it falls back to sysconf.
 *
 * Also owns mem_fill, the background population of big buffers (mem.h).
 *
 * Sections: parsers (pure, tested on strings); probes (files); filling.
 */
#include "mem.h"
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/mman.h>
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

const char *mem_parse_cgroup_path(const char *text, const char *controller) {
    size_t cl = strlen(controller);
    for (const char *p = text; p && *p;) {
        /* "ID:CONTROLLERS:PATH"; v2 is "0::PATH" (controller "") */
        const char *c1 = strchr(p, ':'), *nl = strchr(p, '\n');
        if (c1 && (!nl || c1 < nl)) {
            const char *list = c1 + 1, *c2 = strchr(list, ':');
            if (c2 && (!nl || c2 < nl)) {
                if (cl == 0 ? c2 == list : 0) return c2 + 1;
                for (const char *q = list; cl && q < c2;) { /* comma-separated controllers */
                    const char *e = memchr(q, ',', (size_t)(c2 - q));
                    if (!e) e = c2;
                    if ((size_t)(e - q) == cl && strncmp(q, controller, cl) == 0) return c2 + 1;
                    q = e + 1;
                }
            }
        }
        p = nl ? nl + 1 : NULL;
    }
    return NULL;
}

int64_t mem_parse_stat(const char *text, const char *key) {
    size_t kl = strlen(key);
    for (const char *p = text; p && *p;) {
        if (strncmp(p, key, kl) == 0 && p[kl] == ' ') {
            char *end;
            long long v = strtoll(p + kl + 1, &end, 10);
            return end == p + kl + 1 || v < 0 ? -1 : (int64_t)v;
        }
        p = strchr(p, '\n');
        if (p) p++;
    }
    return -1;
}

void mem_parse_smaps(FILE *f, const char *const *paths, int n, int64_t *rss, int64_t *pmd) {
    *rss = *pmd = 0;
    char line[4096];
    int mine = 0;
    while (fgets(line, sizeof line, f)) {
        size_t tok = strcspn(line, " \n");
        if (memchr(line, '-', tok) && !memchr(line, ':', tok)) { /* "start-end perms off dev inode path" */
            char *path = strchr(line, '/');
            mine = 0;
            if (path) path[strcspn(path, "\n")] = 0;
            for (int i = 0; path && i < n && !mine; i++) mine = strcmp(path, paths[i]) == 0;
        } else if (mine && strncmp(line, "Rss:", 4) == 0) {
            *rss += (int64_t)strtoll(line + 4, NULL, 10) * 1024;
        } else if (mine && strncmp(line, "FilePmdMapped:", 14) == 0) {
            *pmd += (int64_t)strtoll(line + 14, NULL, 10) * 1024;
        }
    }
}

void mem_parse_smaps_range(FILE *f, uintptr_t lo, uintptr_t hi, int64_t *rss, int64_t *huge) {
    *rss = *huge = 0;
    char line[4096];
    int mine = 0;
    while (fgets(line, sizeof line, f)) {
        size_t tok = strcspn(line, " \n");
        if (memchr(line, '-', tok) && !memchr(line, ':', tok)) { /* "start-end perms ..." */
            unsigned long long a = 0, b = 0;
            mine = sscanf(line, "%llx-%llx", &a, &b) == 2 && a >= lo && b <= hi && a < b;
        } else if (mine && strncmp(line, "Rss:", 4) == 0) {
            *rss += (int64_t)strtoll(line + 4, NULL, 10) * 1024;
        } else if (mine && strncmp(line, "AnonHugePages:", 14) == 0) {
            *huge += (int64_t)strtoll(line + 14, NULL, 10) * 1024;
        }
    }
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

/* Room left under one cgroup directory's limit (-1: no limit there): the
 * limit less what is in use, plus the file pages the kernel can reclaim
 * (usage counts the page cache). v2 names: memory.max / memory.current,
 * inactive_file; v1: memory.limit_in_bytes / memory.usage_in_bytes,
 * total_inactive_file. */
static int64_t cg_room(const char *dir, int v2) {
    char p[4300], b[8192];
    snprintf(p, sizeof p, "%s/%s", dir, v2 ? "memory.max" : "memory.limit_in_bytes");
    if (slurp(p, b, sizeof b)) return -1;
    int64_t max = mem_parse_limit(b);
    if (max < 0) return -1;
    snprintf(p, sizeof p, "%s/%s", dir, v2 ? "memory.current" : "memory.usage_in_bytes");
    int64_t cur = slurp(p, b, sizeof b) ? 0 : mem_parse_limit(b);
    if (cur < 0) cur = 0;
    snprintf(p, sizeof p, "%s/memory.stat", dir);
    int64_t reclaim = slurp(p, b, sizeof b) ? 0 : mem_parse_stat(b, v2 ? "inactive_file" : "total_inactive_file");
    if (reclaim > 0) cur -= reclaim < cur ? reclaim : cur;
    return max > cur ? max - cur : 0;
}

/* The tightest room over a cgroup directory and every level above it up to
 * the controller's mount (root). */
static int64_t cg_walk(const char *root, const char *rel, int v2) {
    char dir[4200];
    size_t n = strcspn(rel, "\n");
    snprintf(dir, sizeof dir, "%s%.*s", root, (int)(n < 4000 ? n : 4000), rel);
    size_t rl = strlen(root);
    int64_t best = -1;
    for (;;) {
        int64_t r = cg_room(dir, v2);
        if (r >= 0 && (best < 0 || r < best)) best = r;
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) < rl) break;
        *slash = 0;
    }
    return best;
}

int64_t mem_cgroup_room(void) {
    char text[4096];
    if (slurp("/proc/self/cgroup", text, sizeof text)) return -1;
    int64_t best = -1;
    const char *v1 = mem_parse_cgroup_path(text, "memory");
    if (v1) best = cg_walk("/sys/fs/cgroup/memory", v1, 0);
    const char *v2 = mem_parse_cgroup_path(text, "");
    if (v2) { /* unified at the root, or beside v1 (hybrid) */
        int64_t r = cg_walk("/sys/fs/cgroup", v2, 1), u = cg_walk("/sys/fs/cgroup/unified", v2, 1);
        if (u >= 0 && (r < 0 || u < r)) r = u;
        if (r >= 0 && (best < 0 || r < best)) best = r;
    }
    return best;
}

int64_t mem_available(void) {
    char text[8192];
    int64_t avail = -1;
    if (slurp("/proc/meminfo", text, sizeof text) == 0) avail = mem_parse_meminfo(text, "MemAvailable");
    if (avail < 0) {
#ifdef _SC_AVPHYS_PAGES
        long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
#else /* macOS: no free-page count in sysconf; half of RAM as a guess */
        long pages = sysconf(_SC_PHYS_PAGES) / 2, psz = sysconf(_SC_PAGESIZE);
#endif
        avail = pages > 0 && psz > 0 ? (int64_t)pages * psz : (int64_t)4 << 30;
    }
    int64_t cg = mem_cgroup_room();
    return cg >= 0 && cg < avail ? cg : avail;
}

void *mem_huge_alloc(size_t n) {
    const size_t huge = (size_t)2 << 20, len = (n + huge - 1) / huge * huge, over = len + huge;
    if (!n || len < n) return NULL;
    char *m = mmap(NULL, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    char *a = (char *)(((uintptr_t)m + huge - 1) & ~(uintptr_t)(huge - 1));
    if (a > m) munmap(m, (size_t)(a - m));
    if (over - (size_t)(a - m) > len) munmap(a + len, over - (size_t)(a - m) - len);
#ifdef MADV_HUGEPAGE
    (void)madvise(a, len, MADV_HUGEPAGE); /* a hint */
#endif
    return a;
}

void *mem_big_alloc(size_t n) {
    const size_t huge = (size_t)2 << 20, line = 64;
    if (n < huge) return aligned_alloc(line, n ? (n + line - 1) / line * line : line);
    const size_t len = (n + huge - 1) / huge * huge;
    if (len < n) return NULL;
    void *p = aligned_alloc(huge, len);
#ifdef MADV_HUGEPAGE
    if (p) (void)madvise(p, len, MADV_HUGEPAGE); /* a hint */
#endif
    return p;
}

void mem_huge_free(void *p, size_t n) {
    const size_t huge = (size_t)2 << 20;
    if (p) munmap(p, (n + huge - 1) / huge * huge);
}

int mem_range_pages(const void *p, size_t n, int64_t *rss, int64_t *huge) {
    *rss = *huge = 0;
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    mem_parse_smaps_range(f, (uintptr_t)p, (uintptr_t)p + n, rss, huge);
    fclose(f);
    return 0;
}

int mem_mapped_files(const char *const *paths, int n, int64_t *rss, int64_t *pmd) {
    *rss = *pmd = 0;
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    mem_parse_smaps(f, paths, n, rss, pmd);
    fclose(f);
    return 0;
}

/* ---- filling ---- */

struct mem_fill {
    pthread_t th;
    char *p;
    size_t n;
    atomic_int stop;
};

static void *fill_main(void *arg) {
    mem_fill *f = arg;
    /* lowest priority: page clearing takes CPU time the open and the first
     * token do not need. Not SCHED_IDLE, and small chunks: the madvise holds
     * the process's mmap lock (read) for a chunk, and a malloc that maps
     * memory (session setup) queues a writer behind it, so a fill thread
     * starved while holding it stalled a session ~3 s */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
    const size_t chunk = (size_t)2 << 20;
    for (size_t off = 0; off < f->n && !atomic_load(&f->stop); off += chunk) {
#ifdef MADV_POPULATE_WRITE
        size_t len = f->n - off < chunk ? f->n - off : chunk;
        if (madvise(f->p + off, len, MADV_POPULATE_WRITE) != 0) break; /* old kernel: fault on use */
#else
        break;
#endif
    }
    return NULL;
}

mem_fill *mem_fill_start(void *p, size_t n) {
#ifndef MADV_POPULATE_WRITE
    (void)p;
    (void)n;
    return NULL;
#else
    mem_fill *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    f->p = p;
    f->n = n;
    atomic_init(&f->stop, 0);
    if (pthread_create(&f->th, NULL, fill_main, f) != 0) {
        free(f);
        return NULL;
    }
    return f;
#endif
}

void mem_fill_stop(mem_fill *f) {
    if (!f) return;
    atomic_store(&f->stop, 1);
    pthread_join(f->th, NULL);
    free(f);
}
