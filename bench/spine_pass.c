/* spine_pass.c — a decode step's spine stream without the engine: a
 * checkpoint's bf16 matrices (listed on stdin by bench/spine_pass.sh) read
 * in file order by kn_matmul_pool at one vector, as the step reads them,
 * from the shards' own mapping (the page cache, as `--io mmap` reads it) or,
 * with `anon`, from a copy in fresh anonymous memory (as `--no-mmap` holds
 * it). Separates the tiles' streaming rate from the engine's other costs,
 * and the page cache's layout from both (bench/cpu_NOTES.md, thirty-fifth
 * session: a freshly written page cache of 4 KB folios read ~1.5x slower).
 *
 *   bench/spine_pass.sh MODEL [THREADS [PASSES [anon]]]
 *
 * stdin: lines "SHARD_PATH DATA_OFFSET ROWS COLS NAME". Prints the mean,
 * median and best GB/s of PASSES passes over all of them (after one unmeasured).
 */
#include "../src/kernels/kernels.h"
#include "../src/base/pool.h"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench_util.h"

enum { MAX_MATS = 4096, MAX_SHARDS = 256 };

typedef struct {
    char path[4096];
    const char *base;
} shard_map;

static const char *map_shard(shard_map *sh, int *nsh, const char *path) {
    for (int i = 0; i < *nsh; i++)
        if (!strcmp(sh[i].path, path)) return sh[i].base;
    if (*nsh == MAX_SHARDS) return NULL;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return NULL;
    off_t n = lseek(fd, 0, SEEK_END);
    void *m = n > 0 ? mmap(NULL, (size_t)n, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (m == MAP_FAILED) return NULL;
    snprintf(sh[*nsh].path, sizeof sh[*nsh].path, "%s", path);
    sh[*nsh].base = m;
    return sh[(*nsh)++].base;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2, passes = argc > 2 ? atoi(argv[2]) : 8;
    const int anon = argc > 3 && !strcmp(argv[3], "anon");
    if (threads < 1 || passes < 1 || passes > 1000) {
        fprintf(stderr, "usage: spine_pass [THREADS [PASSES [anon]]] < list\n");
        return 2;
    }
    static shard_map sh[MAX_SHARDS];
    static df_weight w[MAX_MATS];
    int nsh = 0, nw = 0;
    int64_t maxc = 0, maxr = 0;
    double bytes = 0;
    char path[4096], name[512];
    long long off, rows, cols;
    while (nw < MAX_MATS && scanf("%4095s %lld %lld %lld %511s", path, &off, &rows, &cols, name) == 5) {
        const char *b = map_shard(sh, &nsh, path);
        if (!b) {
            fprintf(stderr, "spine_pass: cannot map %s\n", path);
            return 1;
        }
        memset(&w[nw], 0, sizeof w[nw]);
        w[nw].type = WT_BF16, w[nw].rows = rows, w[nw].cols = cols, w[nw].data = b + off;
        if (cols > maxc) maxc = cols;
        if (rows > maxr) maxr = rows;
        bytes += (double)rows * (double)cols * 2;
        nw++;
    }
    if (!nw) {
        fprintf(stderr, "spine_pass: no matrices on stdin\n");
        return 2;
    }
    if (anon) { /* every matrix copied into one fresh anonymous mapping, page-aligned each */
        size_t total = 0;
        for (int i = 0; i < nw; i++) total += ((size_t)w[i].rows * (size_t)w[i].cols * 2 + 4095) & ~(size_t)4095;
        char *a = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (a == MAP_FAILED) {
            fprintf(stderr, "spine_pass: no memory for the copy\n");
            return 1;
        }
        for (int i = 0; i < nw; i++) {
            const size_t n = (size_t)w[i].rows * (size_t)w[i].cols * 2;
            memcpy(a, w[i].data, n);
            w[i].data = a;
            a += (n + 4095) & ~(size_t)4095;
        }
    }
    float *x = malloc((size_t)maxc * sizeof *x), *y = malloc((size_t)maxr * sizeof *y);
    double *t = malloc((size_t)passes * sizeof *t);
    df_pool *pool = threads > 1 ? pool_new(threads) : NULL;
    if (!x || !y || !t || (threads > 1 && !pool)) {
        fprintf(stderr, "spine_pass: out of memory or threads\n");
        return 1;
    }
    for (int64_t i = 0; i < maxc; i++) x[i] = (float)((rnd() & 1023) - 512) * 0x1p-10f;
    const kn_level lv = kn_detect();
    double sum = 0;
    for (int p = -1; p < passes; p++) {
        const double t0 = now();
        for (int i = 0; i < nw; i++) kn_matmul_pool(pool, lv, &w[i], x, 1, y, w[i].rows, w[i].rows);
        if (p >= 0) sum += t[p] = now() - t0;
    }
    qsort(t, (size_t)passes, sizeof *t, cmp_double);
    printf("%d matrices, %.2f GB, %s, %d threads, %s: mean %.1f GB/s, median %.1f, best %.1f\n", nw, bytes / 1e9,
           anon ? "anonymous copy" : "mapped shards", threads, kn_level_name(lv), bytes * passes / sum / 1e9,
           bytes / t[passes / 2] / 1e9, bytes / t[0] / 1e9);
    pool_free(pool);
    free(x), free(y), free(t);
    return 0;
}
