/* disk_probe.c — disk read bandwidth through the expert reader (xr_), the
 * numbers `deltafin bench --decode` uses as its floor, as a table.
 *
 *   make && cc -std=c17 -O2 -D_GNU_SOURCE -Iinclude -pthread bench/disk_probe.c \
 *       build/libdeltafin.a -ljansson -luring -lm -lpthread -o build/disk_probe
 *   build/disk_probe FILE [seconds] [reps] [--buffered]
 *
 * For every engine (io_uring, pread pool), chunk (4 MB, 16 MB) and depth
 * (1, 4, 16, 32) it prints O_DIRECT GB/s from xr_probe_bandwidth: random
 * XR_ALIGN-aligned offsets. --buffered adds the same reads on a buffered fd
 * (pread pool), dropping the page cache before each run when allowed, so
 * the page cache cannot serve them. FILE should be several GB.
 */
#include "../src/experts/reader.h"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* GB/s columns are 1e9 bytes/s: median, min and max over the runs. */
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int drop_caches(void) {
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    if (!f) return -1;
    int ok = fputs("3\n", f) >= 0;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* Buffered reads, same pattern as the probe, through the pread pool. */
static double buffered_gbps(const char *path, size_t chunk, int depth, double seconds) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    off_t size = lseek(fd, 0, SEEK_END);
    char *bufs = NULL;
    if (size < (off_t)chunk || posix_memalign((void **)&bufs, XR_ALIGN, chunk * (size_t)depth)) {
        close(fd);
        return -1;
    }
    memset(bufs, 0, chunk * (size_t)depth);
    xs_reader *r = NULL;
    char err[DF_ERRMSG];
    if (xr_open(NULL, XR_PREAD, depth, depth, &r, err) != DF_OK) {
        free(bufs);
        close(fd);
        return -1;
    }
    uint64_t seed = 0x9e3779b97f4a7c15ULL, blocks = (uint64_t)(size - (off_t)chunk) / XR_ALIGN + 1;
    uint64_t bytes = 0;
    int bad = 0;
    double t0 = now_s(), t1 = t0;
    for (int i = 0; i < depth; i++) {
        seed ^= seed >> 12, seed ^= seed << 25, seed ^= seed >> 27;
        int64_t off = (int64_t)((seed * 2685821657736338717ULL) % blocks) * XR_ALIGN;
        bad |= xr_submit(r, fd, 0, bufs + (size_t)i * chunk, chunk, off, (uint64_t)i);
    }
    xr_done d[64];
    int n;
    while ((n = xr_wait(r, d, 64)) > 0) {
        t1 = now_s();
        for (int k = 0; k < n; k++) {
            bad |= d[k].err;
            bytes += chunk;
            if (t1 - t0 >= seconds) continue;
            seed ^= seed >> 12, seed ^= seed << 25, seed ^= seed >> 27;
            int64_t off = (int64_t)((seed * 2685821657736338717ULL) % blocks) * XR_ALIGN;
            bad |= xr_submit(r, fd, 0, bufs + d[k].user * chunk, chunk, off, d[k].user);
        }
    }
    xr_close(r);
    free(bufs);
    close(fd);
    return bad ? -1 : (double)bytes / (t1 - t0) * 1e-9;
}

static int by_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

enum { MAX_REPS = 9, NCELL = 24 };

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [seconds] [reps] [--buffered]\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    double seconds = argc > 2 && argv[2][0] != '-' ? atof(argv[2]) : 2.0;
    int reps = argc > 3 && argv[3][0] != '-' ? atoi(argv[3]) : 3;
    if (reps < 1) reps = 1;
    if (reps > MAX_REPS) reps = MAX_REPS;
    int buffered = strcmp(argv[argc - 1], "--buffered") == 0;
    int dropped = buffered && drop_caches() == 0;
    /* cells: engine (0 io_uring, 1 pool, 2 buffered pool) x chunk x depth */
    const size_t chunks[] = {(size_t)4 << 20, (size_t)16 << 20};
    const int depths[] = {1, 4, 16, 32};
    const xr_kind kinds[] = {XR_URING, XR_PREAD, XR_PREAD};
    const char *names[] = {"io_uring O_DIRECT", "pread pool O_DIRECT", "pread pool buffered"};
    static double g[NCELL][MAX_REPS];
    static char fail[NCELL][DF_ERRMSG];
    int ne = buffered ? 3 : 2;
    /* repetitions interleave the cells so drift (other tenants) spreads over all */
    for (int rep = 0; rep < reps; rep++)
        for (int e = 0; e < ne; e++)
            for (int c = 0; c < 2; c++)
                for (int d = 0; d < 4; d++) {
                    int cell = e * 8 + c * 4 + d;
                    if (e == 2) {
                        if (dropped) drop_caches();
                        g[cell][rep] = buffered_gbps(path, chunks[c], depths[d], seconds);
                        if (g[cell][rep] < 0) snprintf(fail[cell], DF_ERRMSG, "buffered read failed");
                        continue;
                    }
                    if (xr_probe_bandwidth(NULL, path, kinds[e], chunks[c], depths[d], seconds,
                                           &g[cell][rep], fail[cell]) != DF_OK)
                        g[cell][rep] = -1;
                    else
                        fail[cell][0] = 0;
                }
    printf("file %s, %.1f s per run, %d runs per cell (interleaved), random %d-aligned offsets\n",
           path, seconds, reps, XR_ALIGN);
    if (buffered)
        printf("buffered rows: page cache %s before each run\n",
               dropped ? "dropped" : "NOT dropped (no permission)");
    printf("%-22s %6s %6s %9s %9s %9s %10s\n", "engine", "chunk", "depth", "median", "min",
           "max", "MB in fl.");
    for (int e = 0; e < ne; e++)
        for (int c = 0; c < 2; c++)
            for (int d = 0; d < 4; d++) {
                int cell = e * 8 + c * 4 + d;
                if (fail[cell][0]) {
                    printf("%-22s %4zuMB %6d  %s\n", names[e], chunks[c] >> 20, depths[d], fail[cell]);
                    continue;
                }
                double v[MAX_REPS];
                memcpy(v, g[cell], sizeof v);
                qsort(v, (size_t)reps, sizeof v[0], by_double);
                printf("%-22s %4zuMB %6d %9.3f %9.3f %9.3f %10zu\n", names[e], chunks[c] >> 20,
                       depths[d], v[reps / 2], v[0], v[reps - 1], (chunks[c] >> 20) * (size_t)depths[d]);
            }
    return 0;
}
