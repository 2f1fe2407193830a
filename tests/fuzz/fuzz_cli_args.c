/* fuzz_cli_args.c — libFuzzer harness: the CLI's value parsers,
 * cli_parse_size ("512M", "1.5T", "4096") and cli_parse_tokens ("1, 2,3").
 *
 * Input: SIZE FZ_SEP TOKENS (either may be absent). Checks what the parsers
 * promise: a size is a non-negative byte count or -1; a token list is a
 * non-empty array of ids in [0, INT32_MAX] or -1 with nothing allocated,
 * and printing the ids back and parsing them again gives the same list.
 */
#include "common.h"
#include "../../src/cli/cli.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz_part p[2];
    int np = fz_split(data, size, p, 2);
    char *s = fz_strdup(p[0]);
    int64_t v = cli_parse_size(s);
    if (v < -1) fz_die("cli_parse_size(\"%s\") = %lld", s, (long long)v);
    free(s);
    if (np < 2) return 0;
    char *t = fz_strdup(p[1]);
    int32_t *ids = NULL;
    int n = cli_parse_tokens(t, &ids);
    free(t);
    if (n == -1) {
        if (ids) fz_die("cli_parse_tokens failed but set its output");
        return 0;
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
    return 0;
}
