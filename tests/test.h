/* test.h — the test runner's registration and check macros.
 *
 * A test is `TEST(suite_name_case) { ... CHECK(cond, "fmt", ...); }` in any
 * tests/test_*.c file; it registers itself at start-up. A test fails if any
 * CHECK fails (the failure prints file:line and the message; the test goes
 * on). SKIP("why") ends a test as skipped. `run_tests [filter]` runs the
 * tests whose name contains filter and ends with "N passed, N failed".
 * Paths are relative to the repository root (make test runs from there);
 * DF_BIN names the CLI binary for CLI-contract tests.
 */
#ifndef DF_TEST_H
#define DF_TEST_H
#include <math.h>
#include <stdio.h>

typedef void (*test_fn)(void);
void t_register(const char *name, test_fn fn);
void t_fail(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void t_skip(const char *why);
int t_skipped(void);
/* Path of the CLI binary (DF_BIN or build/deltafin). */
const char *t_bin(void);
/* Runs a shell command, captures up to cap bytes of stdout+stderr into out,
 * returns the exit status (or -1). */
int t_sh(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Makes a fresh empty temporary directory; returns its path (static storage per call slot). */
const char *t_tmpdir(const char *tag);

#define TEST(name)                                                            \
    static void name(void);                                                   \
    __attribute__((constructor)) static void reg_##name(void) {               \
        t_register(#name, name);                                              \
    }                                                                         \
    static void name(void)

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (!(cond)) t_fail(__FILE__, __LINE__, "CHECK(" #cond ") " __VA_ARGS__); \
    } while (0)
#define REQUIRE(cond, ...)                                                    \
    do {                                                                      \
        if (!(cond)) { t_fail(__FILE__, __LINE__, "REQUIRE(" #cond ") " __VA_ARGS__); return; } \
    } while (0)
#define SKIP(why) do { t_skip(why); return; } while (0)
/* 1 if kernel level lv (the simd_level numbers of deltafin.h) runs as itself
 * on this CPU (test_kernels.c; for files that cannot include kernels.h). */
int t_simd_level_available(int lv);
#endif
