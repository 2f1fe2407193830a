/* test_main.c — the one test runner: runs every registered TEST in name
 * order and prints "N passed, N failed".
 *
 *   run_tests [FILTER...]   FILTER: a substring a test's name must contain
 *                           (any of them), or -SUBSTRING: skip names with it.
 *   e.g. run_tests xr_ xs_ (the reader and store suites), run_tests -srv_ */
#include "test.h"
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { MAX_TESTS = 1024 };
static struct { const char *name; test_fn fn; } tests[MAX_TESTS];
static int n_tests, cur_failed, cur_skipped;

void t_register(const char *name, test_fn fn) {
    if (n_tests < MAX_TESTS) { tests[n_tests].name = name; tests[n_tests].fn = fn; n_tests++; }
}

void t_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "    %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    cur_failed = 1;
}

void t_skip(const char *why) { cur_skipped = 1; fprintf(stderr, "    skipped: %s\n", why); }
int t_skipped(void) { return cur_skipped; }

const char *t_bin(void) {
    const char *b = getenv("DF_BIN");
    return b && *b ? b : "build/deltafin";
}

int t_sh(char *out, size_t cap, const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[8300];
    snprintf(full, sizeof full, "( %s ) 2>&1", cmd);
    FILE *f = popen(full, "r");
    if (!f) return -1;
    size_t n = 0;
    char tmp[4096];
    size_t got;
    while ((got = fread(tmp, 1, sizeof tmp, f)) > 0) {
        if (out && n + 1 < cap) {
            size_t k = got < cap - 1 - n ? got : cap - 1 - n;
            memcpy(out + n, tmp, k);
            n += k;
        }
    }
    if (out && cap) out[n] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

const char *t_tmpdir(const char *tag) {
    static char slots[8][256];
    static int next;
    char *p = slots[next++ % 8];
    snprintf(p, 256, "/tmp/df-test-%d-%s", (int)getpid(), tag);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", p, p);
    if (system(cmd) != 0) return NULL;
    return p;
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* 1 if the name passes the command line's filters (see the file comment). */
static int selected(const char *name, int argc, char **argv) {
    int any_inc = 0, inc = 0;
    for (int a = 1; a < argc; a++) {
        if (argv[a][0] == '-' && argv[a][1]) {
            if (strstr(name, argv[a] + 1)) return 0;
        } else {
            any_inc = 1;
            if (strstr(name, argv[a])) inc = 1;
        }
    }
    return !any_inc || inc;
}

int main(int argc, char **argv) {
    /* stable, name-ordered run */
    const char *names[MAX_TESTS];
    for (int i = 0; i < n_tests; i++) names[i] = tests[i].name;
    qsort(names, (size_t)n_tests, sizeof names[0], by_name);
    int passed = 0, failed = 0, skipped = 0;
    for (int k = 0; k < n_tests; k++) {
        int i = 0;
        while (tests[i].name != names[k]) i++;
        if (!selected(tests[i].name, argc, argv)) continue;
        cur_failed = cur_skipped = 0;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        fprintf(stderr, "  %-52s ", tests[i].name);
        fflush(stderr);
        tests[i].fn();
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
        if (cur_failed) { failed++; fprintf(stderr, "  FAIL (%.2fs)\n", s); }
        else if (cur_skipped) { skipped++; fprintf(stderr, "  skip\n"); }
        else { passed++; fprintf(stderr, "ok (%.2fs)\n", s); }
    }
    fflush(stderr);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf /tmp/df-test-%d-*", (int)getpid());
    if (system(cmd) != 0) fprintf(stderr, "could not remove temporary directories\n");
    if (skipped) printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    else printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
