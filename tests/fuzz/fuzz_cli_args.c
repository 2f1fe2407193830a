/* fuzz_cli_args.c — libFuzzer harness: the CLI's value parsers,
 * cli_parse_size ("512M", "1.5T", "4096"), cli_parse_tokens ("1, 2,3") and
 * df_cpus_parse (--cpus: "0-3,8").
 *
 * Input: SIZE FZ_SEP TOKENS FZ_SEP CPUS (any may be absent). Checks what the
 * parsers promise: a size is a non-negative byte count or -1; a token list
 * is a non-empty array of ids in [0, INT32_MAX] or -1 with nothing
 * allocated, and printing the ids back and parsing them again gives the
 * same list; a CPU list is -1 with a message, or 1 .. cap distinct CPU
 * numbers that parse back to the same list.
 */
#include "common.h"
#include "../../src/cli/cli.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_tokens(fz_part part) {
    char *t = fz_strdup(part);
    int32_t *ids = NULL;
    int n = cli_parse_tokens(t, &ids);
    free(t);
    if (n == -1) {
        if (ids) fz_die("cli_parse_tokens failed but set its output");
        return;
    }
    if (n < 1 || !ids) fz_die("cli_parse_tokens returned %d", n);
    char *back = malloc((size_t)n * 12 + 1), *w = back;
    if (!back) fz_die("out of memory");
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0) fz_die("token %d is %d", i, ids[i]);
        w += sprintf(w, "%s%d", i ? "," : "", ids[i]);
    }
    int32_t *again = NULL;
    int m = cli_parse_tokens(back, &again);
    if (m != n || memcmp(again, ids, (size_t)n * sizeof *ids)) fz_die("'%s' parses to another list", back);
    free(again);
    free(back);
    free(ids);
}

static void check_cpus(fz_part part) {
    enum { CAP = 64 };
    char *t = fz_strdup(part), err[DF_ERRMSG] = "";
    int cpus[CAP], again[CAP];
    int n = df_cpus_parse(t, cpus, CAP, err);
    free(t);
    if (n == -1) {
        if (!err[0]) fz_die("df_cpus_parse failed without a message");
        return;
    }
    if (n < 1 || n > CAP) fz_die("df_cpus_parse returned %d", n);
    char back[CAP * 12 + 1], *w = back;
    for (int i = 0; i < n; i++) {
        if (cpus[i] < 0) fz_die("CPU %d is %d", i, cpus[i]);
        for (int j = 0; j < i; j++)
            if (cpus[j] == cpus[i]) fz_die("CPU %d listed twice", cpus[i]);
        w += sprintf(w, "%s%d", i ? "," : "", cpus[i]);
    }
    int m = df_cpus_parse(back, again, CAP, err);
    if (m != n || memcmp(again, cpus, (size_t)n * sizeof *cpus)) fz_die("'%s' parses to another list", back);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz_part p[3];
    int np = fz_split(data, size, p, 3);
    char *s = fz_strdup(p[0]);
    int64_t v = cli_parse_size(s);
    if (v < -1) fz_die("cli_parse_size(\"%s\") = %lld", s, (long long)v);
    free(s);
    if (np >= 2) check_tokens(p[1]);
    if (np >= 3) check_cpus(p[2]);
    return 0;
}
