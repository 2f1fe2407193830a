/* cmd_bench.c — `deltafin bench`: kernel throughput against a DRAM probe. */
#include "cli.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cmd_bench(int argc, char **argv) {
    int kernels = 0, threads = 0;
    double mb = 512, seconds = 1.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: deltafin bench --kernels [--threads N] [--mb SIZE] [--seconds S]\n"
                   "  --kernels     matvec GB/s per weight type on ~SIZE MB matrices (default 512),\n"
                   "                with a DRAM read probe measured in the same process\n");
            return 0;
        }
        if (!strcmp(a, "--kernels")) kernels = 1;
        else if (!strcmp(a, "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(a, "--mb") && i + 1 < argc) mb = atof(argv[++i]);
        else if (!strcmp(a, "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
        else return cli_usage("bench", "unknown or incomplete option");
    }
    if (!kernels) return cli_usage("bench", "say what to measure (--kernels)");
    if (threads <= 0) threads = 2;
    if (mb < 1) mb = 1;
    df_bench_row rows[16];
    double probe = 0;
    int n = df_bench_kernels(threads, mb, seconds, rows, &probe);
    if (n <= 0) { fprintf(stderr, "deltafin: benchmark failed\n"); return CLI_FAIL; }
    printf("threads %d, matrices ~%.0f MB, DRAM read probe %.2f GB/s\n", threads, mb, probe);
    printf("%-8s %10s %10s %12s\n", "type", "GB/s", "% probe", "ms/matvec");
    for (int i = 0; i < n; i++)
        printf("%-8s %10.2f %9.1f%% %12.3f\n", rows[i].name, rows[i].gbps, 100.0 * rows[i].gbps / probe,
               rows[i].ms_per_call);
    return CLI_OK;
}
