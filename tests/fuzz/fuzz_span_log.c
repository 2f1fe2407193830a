/* fuzz_span_log.c — libFuzzer harness: the stream mirror's span log and
 * span sets (src/hub/spans.c: hub_log_read, hub_log_open with its torn-tail
 * truncation and compaction, hub_log_append / hub_log_remove, hub_spans_*).
 *
 * Input: a flags byte, two bytes of shard size F (1..4096), then
 *   bit 0 clear (raw): the bytes of a log file. It is read, then opened
 *         for F (or, bit 1, for the size its header names), appended to and
 *         read again.
 *   bit 0 set (ops): 5-byte operations {op, a, b} (a, b: 2 bytes, taken
 *         modulo F + 1) on a fresh log: fetched [a, b), evicted [a, b),
 *         close and reopen; what is left of the input (less than a record
 *         of it) is then appended to the file as a torn tail.
 * The log lives on tmpfs. Checks: every span set is sorted, disjoint, not
 * adjacent, inside [0, F); in ops mode the spans agree after every step
 * with a byte map of what was fetched and evicted, and every reopen or
 * read gives back exactly the spans recorded, torn tail or not.
 */
#include "common.h"
#include "../../src/hub/hub.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_F = 4096 };

static void check_spans(const hub_spans *s, int64_t f, const char *what) {
    for (int i = 0; i < s->n; i++) {
        if (s->v[i].a >= s->v[i].b || s->v[i].a < 0 || (f >= 0 && s->v[i].b > f))
            fz_die("%s: span %d is [%lld, %lld) in a file of %lld", what, i, (long long)s->v[i].a, (long long)s->v[i].b,
                   (long long)f);
        if (i && s->v[i].a <= s->v[i - 1].b) fz_die("%s: spans %d and %d touch or overlap", what, i - 1, i);
    }
}

static void same_spans(const hub_spans *x, const hub_spans *y, const char *what) {
    if (x->n != y->n || (x->n && memcmp(x->v, y->v, (size_t)x->n * sizeof *x->v)))
        fz_die("%s: %d spans, expected %d (or other spans)", what, x->n, y->n);
}

static void against_map(const hub_spans *s, const uint8_t *map, int f) {
    hub_spans m = {0};
    for (int i = 0; i < f;) {
        if (!map[i]) { i++; continue; }
        int j = i;
        while (j < f && map[j]) j++;
        if (hub_spans_add(&m, i, j)) fz_die("out of memory");
        i = j;
    }
    same_spans(s, &m, "span set against the byte map");
    int64_t bytes = 0;
    for (int i = 0; i < f; i++) bytes += map[i];
    if (hub_spans_bytes(s) != bytes) fz_die("hub_spans_bytes %lld, map %lld", (long long)hub_spans_bytes(s), (long long)bytes);
    hub_spans_free(&m);
}

static void ops(const uint8_t *p, size_t n, int f, const char *path) {
    static uint8_t map[MAX_F];
    memset(map, 0, sizeof map);
    char err[DF_ERRMSG];
    hub_spans present = {0};
    hub_log log;
    unlink(path);
    if (hub_log_open(path, f, &present, &log, err) != DF_OK) fz_die("a fresh log: %s", err);
    size_t at = 0;
    for (; at + 5 <= n; at += 5) {
        int op = p[at] % 4;
        int a = (p[at + 1] | p[at + 2] << 8) % (f + 1), b = (p[at + 3] | p[at + 4] << 8) % (f + 1);
        if (a > b) { int t = a; a = b; b = t; }
        if (op == 3) break; /* the rest is a torn tail */
        if (op == 2) {
            hub_log_close(&log);
            hub_spans again = {0};
            if (hub_log_open(path, f, &again, &log, err) != DF_OK) fz_die("reopen: %s", err);
            same_spans(&again, &present, "reopened log");
            hub_spans_free(&again);
            continue;
        }
        if (a == b) continue;
        if (op == 0) {
            if (hub_log_append(&log, a, b, err) != DF_OK) fz_die("append: %s", err);
            if (hub_spans_add(&present, a, b)) fz_die("out of memory");
            memset(map + a, 1, (size_t)(b - a));
        } else {
            if (hub_log_remove(&log, a, b, err) != DF_OK) fz_die("remove: %s", err);
            hub_spans_remove(&present, a, b);
            memset(map + a, 0, (size_t)(b - a));
        }
        check_spans(&present, f, "present");
        against_map(&present, map, f);
    }
    hub_log_close(&log);
    if (at < n) { /* part of a record after the last one: a torn append (whole records could be valid ones) */
        FILE *fp = fopen(path, "ab");
        if (!fp) fz_die("cannot append to %s", path);
        fwrite(p + at, 1, (n - at) % 24, fp);
        fclose(fp);
    }
    hub_spans r = {0};
    int64_t fs;
    if (hub_log_read(path, &r, &fs, err) != DF_OK || fs != f) fz_die("read back: %s", err);
    same_spans(&r, &present, "read back after a torn tail");
    hub_spans_free(&r);
    hub_spans again = {0};
    if (hub_log_open(path, f, &again, &log, err) != DF_OK) fz_die("reopen after a torn tail: %s", err);
    same_spans(&again, &present, "reopened after a torn tail");
    hub_log_close(&log);
    hub_spans_free(&again);
    hub_spans_free(&present);
}

static void raw(const uint8_t *p, size_t n, int f, int own_size) {
    const char *path = fz_file("x.spans", p, n);
    char err[DF_ERRMSG];
    hub_spans r = {0};
    int64_t fs = -1;
    int read_ok = hub_log_read(path, &r, &fs, err) == DF_OK;
    if (read_ok) check_spans(&r, fs, "read");
    else fz_note("%s", err);
    int64_t want = own_size && fs >= 0 ? fs : f;
    hub_spans present = {0};
    hub_log log;
    if (hub_log_open(path, want, &present, &log, err) == DF_OK) {
        check_spans(&present, want, "opened");
        if (read_ok && fs == want) same_spans(&present, &r, "opened against read");
        else if (present.n) fz_die("a log for another size was believed");
        if (want > 1) {
            if (hub_log_append(&log, 0, 1, err) != DF_OK) fz_die("append: %s", err);
            if (hub_spans_add(&present, 0, 1)) fz_die("out of memory");
        }
        hub_log_close(&log);
        hub_spans back = {0};
        int64_t fs2;
        if (hub_log_read(path, &back, &fs2, err) != DF_OK || fs2 != want) fz_die("read after open: %s", err);
        same_spans(&back, &present, "read after open and append");
        hub_spans_free(&back);
    } else {
        fz_note("%s", err);
        hub_log_close(&log);
    }
    hub_spans_free(&present);
    hub_spans_free(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    int f = 1 + (data[1] | data[2] << 8) % MAX_F;
    if (data[0] & 1) ops(data + 3, size - 3, f, fz_file_path("ops.spans"));
    else raw(data + 3, size - 3, f, data[0] & 2);
    return 0;
}
