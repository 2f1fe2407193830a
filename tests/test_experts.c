/* test_experts.c — the expert store under faults (suite xs_).
 *
 * An I/O table wraps POSIX pread (io_uring is switched off so every expert
 * read goes through pread) and injects EINTR, short reads, slow reads and
 * EIO. Oracles: with transient faults the logits are bit-identical to the
 * mmap path; with EIO the step fails with a clear error, the session stays
 * usable, and once the fault is gone the output is again exact (so nothing
 * half-read stayed in the cache). A shard that changes under a running
 * engine is reported.
 */
#include "test.h"
#include "deltafin.h"
#include "../src/base/io.h"
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MODEL "tests/fixtures/kimi_k3_mxfp4"
static const int32_t toks[] = {5, 77, 300, 12, 901, 44, 3, 250, 17};
enum { NT = sizeof toks / sizeof toks[0] };

/* fault switches, read by the wrapper from the I/O threads */
static atomic_int f_eintr, f_short, f_slow, f_eio, f_calls;

static ssize_t faulty_pread(void *ctx, int fd, void *buf, size_t n, off_t off) {
    (void)ctx;
    int c = atomic_fetch_add(&f_calls, 1);
    if (atomic_load(&f_eio)) { errno = EIO; return -1; }
    if (atomic_load(&f_eintr) && c % 2 == 0) { errno = EINTR; return -1; }
    if (atomic_load(&f_slow)) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (atomic_load(&f_short) && n > 4096) { /* about half, kept 4 KiB aligned for O_DIRECT */
        size_t h = n / 2 / 4096 * 4096;
        n = h ? h : 4096;
    }
    return io_pread(df_io_default(), fd, buf, n, off);
}

static df_io faulty;

static df_engine *open_faulty(int io) {
    faulty = *df_io_default();
    faulty.pread = faulty_pread;
    faulty.ring_open = NULL; /* force the pread pool: every read passes the wrapper */
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = 2;
    o.expert_io = io;
    o.expert_cache_bytes = 1; /* two slots: constant eviction and re-reading */
    o.io = &faulty;
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    if (df_engine_open(MODEL, &o, &e, err) != DF_OK) fprintf(stderr, "    %s\n", err);
    return e;
}

static float *logits_of(df_engine *e, df_session *s) {
    int V = df_engine_vocab_size(e);
    float *lg = malloc((size_t)NT * V * sizeof(float));
    df_session_reset(s);
    if (df_session_eval(s, toks, NT, lg) != DF_OK) {
        free(lg);
        return NULL;
    }
    return lg;
}

static float *reference(void) {
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.expert_io = DF_EXPERTS_MMAP;
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    if (df_engine_open(MODEL, &o, &e, err) != DF_OK) return NULL;
    df_session *s;
    float *lg = NULL;
    if (df_session_new(e, 64, &s) == DF_OK) lg = logits_of(e, s);
    df_session_free(s);
    df_engine_close(e);
    return lg;
}

static void reset_faults(void) {
    atomic_store(&f_eintr, 0);
    atomic_store(&f_short, 0);
    atomic_store(&f_slow, 0);
    atomic_store(&f_eio, 0);
}

TEST(xs_transient_faults_are_invisible) {
    float *ref = reference();
    REQUIRE(ref != NULL, "reference");
    for (int io = DF_EXPERTS_DIRECT; io <= DF_EXPERTS_PREAD; io++) {
        df_engine *e = open_faulty(io);
        REQUIRE(e != NULL, "open");
        size_t bytes = (size_t)NT * df_engine_vocab_size(e) * sizeof(float);
        df_session *s;
        REQUIRE(df_session_new(e, 64, &s) == DF_OK);
        const char *what[] = {"EINTR", "short reads", "slow reads"};
        atomic_int *sw[] = {&f_eintr, &f_short, &f_slow};
        for (int k = 0; k < 3; k++) {
            reset_faults();
            atomic_store(sw[k], 1);
            float *lg = logits_of(e, s);
            CHECK(lg && memcmp(lg, ref, bytes) == 0, "%s (io %d): logits differ or eval failed: %s", what[k], io,
                  df_session_error(s));
            free(lg);
        }
        reset_faults();
        df_session_free(s);
        df_engine_close(e);
    }
    free(ref);
}

TEST(xs_eio_fails_cleanly_and_recovers) {
    float *ref = reference();
    REQUIRE(ref != NULL, "reference");
    df_engine *e = open_faulty(DF_EXPERTS_PREAD);
    REQUIRE(e != NULL, "open");
    size_t bytes = (size_t)NT * df_engine_vocab_size(e) * sizeof(float);
    df_session *s;
    REQUIRE(df_session_new(e, 64, &s) == DF_OK);
    float *lg = malloc(bytes);
    reset_faults();
    atomic_store(&f_eio, 1);
    df_status st = df_session_eval(s, toks, NT, lg);
    CHECK(st == DF_ERR_IO, "EIO gave status %d", st);
    CHECK(strstr(df_session_error(s), "expert") && strstr(df_session_error(s), "layer"),
          "message: %s", df_session_error(s));
    CHECK(df_session_pos(s) == 0, "position moved on error");
    atomic_store(&f_eio, 0);
    float *again = logits_of(e, s);
    CHECK(again && memcmp(again, ref, bytes) == 0, "after the fault: logits differ (a partial expert was kept?)");
    free(again);
    free(lg);
    df_session_free(s);
    df_engine_close(e);
    free(ref);
}

TEST(xs_shard_changed_under_engine) {
    const char *d = t_tmpdir("changed");
    char out[1024];
    int rc = t_sh(out, sizeof out, "cp -r " MODEL "/. %s/", d);
    REQUIRE(rc == 0, "copy: %s", out);
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.expert_io = DF_EXPERTS_PREAD;
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    REQUIRE(df_engine_open(d, &o, &e, err) == DF_OK, "%s", err);
    df_session *s;
    REQUIRE(df_session_new(e, 64, &s) == DF_OK);
    CHECK(df_session_eval(s, toks, 2, NULL) == DF_OK, "eval before the change");
    /* append a byte: the size check must notice (the data region is untouched) */
    rc = t_sh(out, sizeof out, "printf x >> %s/model-00002-of-00002.safetensors", d);
    REQUIRE(rc == 0, "append: %s", out);
    df_status st = df_session_eval(s, toks + 2, 1, NULL);
    CHECK(st == DF_ERR_IO && strstr(df_session_error(s), "changed"), "status %d: %s", st, df_session_error(s));
    df_session_free(s);
    df_engine_close(e);
}

/* The process never holds more than the memory plan it printed: a model
 * whose experts are several times the cache budget, decoded with the cache
 * evicting all the time. */
#if defined(__SANITIZE_ADDRESS__)
#define DF_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DF_ASAN 1
#endif
#endif

TEST(xs_peak_rss_within_plan) {
#ifdef DF_ASAN
    SKIP("built with AddressSanitizer: its shadow memory makes RSS incomparable with the plan");
#endif
    const char *d = t_tmpdir("rss");
    char out[16384];
    int rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --preset tiny --experts 3000 --layers 4 --out %s --force --quiet",
                  t_bin(), d);
    REQUIRE(rc == 0, "synth: %s", out);
    rc = t_sh(out, sizeof out,
              "%s run --model %s --expert-cache 4M --tokens 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20 "
              "--max-new 24 --ids --stats",
              t_bin(), d);
    REQUIRE(rc == 0, "run: %s", out);
    const char *m = strstr(out, "peak RSS");
    REQUIRE(m != NULL, "no memory line: %s", out);
    double rss = 0, plan = 0;
    int got = sscanf(m, "peak RSS %lf MB, plan %lf MB", &rss, &plan);
    CHECK(got == 2, "parse: %s", m);
    CHECK(rss > 0 && rss <= plan, "peak RSS %.1f MB above the plan %.1f MB", rss, plan);
}

/* ---- tensors moved to aligned places after a read (place.h) ---- */

#include "../src/experts/place.h"

/* A read's landing shift: the wanted byte on PLACE_ALIGN, in steps of the
 * device's memory alignment (at least 4), else none. */
TEST(xs_place_read_shift_puts_the_first_byte_on_a_line) {
    CHECK(place_read_shift(0, 8, 4) == 120 && place_read_shift(4096, 56, 4) == 72, "4-byte devices");
    CHECK(place_read_shift(0, 8, 1) == 120 && place_read_shift(0, 6, 1) == 0, "at least the reader's 4 bytes");
    CHECK(place_read_shift(0, 8, 512) == 0 && place_read_shift(0, 8, 4096) == 0, "devices that want whole blocks");
    CHECK(place_read_shift(0, 0, 4) == 0 && place_read_shift(0, 128, 4) == 0, "already on a line");
    CHECK(place_read_shift(0, 64, 64) == 64 && place_read_shift(0, 32, 64) == 0, "64-byte devices");
    for (int64_t lead = 0; lead < 4096; lead += 8) {
        const int64_t sh = place_read_shift(8192, lead, 8);
        const int64_t at = 8192 + sh + lead;
        const int on_line = sh >= 0 && sh < PLACE_ALIGN && sh / 8 * 8 == sh && at / PLACE_ALIGN * PLACE_ALIGN == at;
        CHECK(on_line, "lead %lld: %lld", (long long)lead, (long long)sh);
    }
}

/* Random spans of 1-9 tensors (sizes 1 byte to 3000, gaps up to 300, some
 * tensors already on the line), read to a random position: after
 * place_move every tensor starts on PLACE_ALIGN with its own bytes, no
 * earlier than where the read put it, within the room place_plan asked
 * for, and a span whose tensors all lie on the line moves nothing. */
TEST(xs_place_moves_tensors_to_aligned_places) {
    uint32_t r = 12345;
#define RND() (r = r * 1664525u + 1013904223u, r >> 8)
    int bad = 0, moved_none_when_aligned = 1;
    for (int trial = 0; trial < 400; trial++) {
        const int n = 1 + (int)(RND() % 9), aligned = trial % 7 == 0;
        int64_t off[9], len[9], at[9];
        int64_t o = 1000 + (int64_t)(RND() % 4096);
        if (aligned) o = o / PLACE_ALIGN * PLACE_ALIGN;
        for (int i = 0; i < n; i++) {
            off[i] = o;
            len[i] = aligned ? PLACE_ALIGN * (1 + (int64_t)(RND() % 20)) : 1 + (int64_t)(RND() % 3000);
            o += len[i] + (aligned ? PLACE_ALIGN * (int64_t)(RND() % 3) : (int64_t)(RND() % 300));
        }
        const int64_t start = off[0], span_len = off[n - 1] + len[n - 1] - start;
        const int64_t pos = aligned ? 512 : 512 + (int64_t)(RND() % 512); /* where the read puts `start` */
        const int64_t past = place_plan(off, len, n, start, pos, span_len, at);
        const size_t cap = (size_t)(pos + span_len + past);
        uint8_t *buf = malloc(cap), *file = malloc((size_t)(span_len));
        REQUIRE(buf && file, "memory");
        for (int64_t i = 0; i < span_len; i++) file[i] = (uint8_t)RND();
        memset(buf, 0xee, cap);
        memcpy(buf + pos, file, (size_t)span_len); /* the read */
        if (aligned && place_moves(off, n, start, pos, at)) moved_none_when_aligned = 0;
        place_move(buf, off, len, n, start, pos, at);
        for (int i = 0; i < n; i++) {
            const int64_t was = pos + (off[i] - start);
            if (at[i] % PLACE_ALIGN || at[i] < was || at[i] + len[i] > (int64_t)cap ||
                (i && at[i] < at[i - 1] + len[i - 1]) || memcmp(buf + at[i], file + (off[i] - start), (size_t)len[i]))
                bad++;
        }
        free(buf);
        free(file);
    }
#undef RND
    CHECK(bad == 0, "%d tensors misplaced or changed", bad);
    CHECK(moved_none_when_aligned, "an aligned span moved");
}
