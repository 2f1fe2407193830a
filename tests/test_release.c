/* test_release.c — issue-12 regressions: the K3 release's layouts and the
 * memory plan (suite rel_).
 *
 * Oracles: synth writes A_log as the release does ([head_dim] f32, the
 * per-head values first, zeros after) and inspect names that reading; a
 * non-zero tail is refused as ambiguous; a flat K3 text config (model_type
 * kimi_linear with K3's fields, as Moonshot's code saves the text model)
 * gives the nested checkpoint's logits bit for bit; the MemAvailable /
 * cgroup parsers read what the kernel writes; --ram is the process's budget
 * (refused when too small, naming the parts; the spine stays resident when
 * it fits and says why it streams when not; peak RSS stays inside it).
 * Reference logits for the release layouts are checked by the model_ suite
 * on tests/fixtures/kimi_k3_flat.
 */
#include "test.h"
#include "deltafin.h"
#include "../src/base/io.h"
#include "../src/base/mem.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static char out[16384];

/* Shard file and absolute byte offset of a tensor of a synth checkpoint
 * (sharded with an index, or one model.safetensors); -1 if not found. */
static int64_t tensor_at(const char *dir, const char *name, char *file, size_t cap, json_t **shape) {
    char p[800];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    json_t *idx = json_load_file(p, 0, NULL);
    const char *shard = idx ? json_string_value(json_object_get(json_object_get(idx, "weight_map"), name)) : NULL;
    snprintf(file, cap, "%s/%s", dir, shard ? shard : "model.safetensors");
    json_decref(idx);
    FILE *f = fopen(file, "rb");
    if (!f) return -1;
    uint8_t lb[8];
    int64_t at = -1;
    if (fread(lb, 1, 8, f) == 8) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = n << 8 | lb[i];
        char *h = n < (1u << 28) ? malloc(n) : NULL;
        json_t *j = h && fread(h, 1, n, f) == n ? json_loadb(h, n, 0, NULL) : NULL;
        json_t *t = json_object_get(j, name);
        if (t) {
            at = 8 + (int64_t)n + json_integer_value(json_array_get(json_object_get(t, "data_offsets"), 0));
            if (shape) *shape = json_incref(json_object_get(t, "shape"));
        }
        json_decref(j);
        free(h);
    }
    fclose(f);
    return at;
}

static int put_f32(const char *file, int64_t at, float v) {
    int fd = open(file, O_WRONLY);
    if (fd < 0) return -1;
    int ok = pwrite(fd, &v, 4, at) == 4;
    close(fd);
    return ok ? 0 : -1;
}

static const char *synth_k3(const char *tag) {
    const char *d = t_tmpdir(tag);
    if (!d || t_sh(out, sizeof out, "%s synth --arch kimi_k3 --out %s --quiet", t_bin(), d) != 0) return NULL;
    return d;
}

/* ---- A_log in the release layout ---- */

TEST(rel_k3_a_log_release_layout) {
    const char *d = synth_k3("rel_alog");
    REQUIRE(d, "synth failed: %s", out);
    char file[900];
    json_t *shape = NULL;
    const char *name = "language_model.model.layers.0.self_attn.A_log";
    int64_t at = tensor_at(d, name, file, sizeof file, &shape);
    REQUIRE(at > 0 && shape, "A_log not found in %s", d);
    /* tiny K3: 3 heads of 32 channels -> [32], first 3 values drawn, the rest zero */
    CHECK(json_array_size(shape) == 1 && json_integer_value(json_array_get(shape, 0)) == 32,
          "A_log is stored [head_dim] as in the release");
    json_decref(shape);
    float v[32];
    FILE *f = fopen(file, "rb");
    REQUIRE(f);
    CHECK(fseek(f, at, SEEK_SET) == 0 && fread(v, 4, 32, f) == 32);
    fclose(f);
    int zero_tail = 1;
    for (int i = 3; i < 32; i++) zero_tail &= v[i] == 0.0f;
    CHECK(v[0] != 0 && v[1] != 0 && v[2] != 0 && zero_tail, "per-head values first, zeros after");
    int rc = t_sh(out, sizeof out, "%s inspect --model %s", t_bin(), d);
    CHECK(rc == 0 && strstr(out, "A_log per head (first 3 of 32 values, rest zero: the K3 release layout)"),
          "inspect names the reading: %s", out);
    char base[8192];
    rc = t_sh(base, sizeof base, "%s run --model %s --tokens 5,6,7 --max-new 4 --ids 2>&1", t_bin(), d);
    CHECK(rc == 0, "%s", base);
    /* a tail that is not zero is ambiguous: refused, naming the tensor */
    REQUIRE(put_f32(file, at + 4 * 7, 0.25f) == 0);
    rc = t_sh(out, sizeof out, "%s run --model %s --tokens 5,6,7 --max-new 4 --ids 2>&1", t_bin(), d);
    CHECK(rc == 1 && strstr(out, name) && strstr(out, "ambiguous") && strstr(out, "value 7"),
          "rc %d: %s", rc, out);
    REQUIRE(put_f32(file, at + 4 * 7, 0.0f) == 0);
    rc = t_sh(out, sizeof out, "%s run --model %s --tokens 5,6,7 --max-new 4 --ids 2>&1", t_bin(), d);
    CHECK(rc == 0 && !strcmp(out, base), "restored: %s vs %s", out, base);
}

/* ---- a flat K3 text config ---- */

TEST(rel_k3_flat_text_config_same_logits) {
    const char *d = synth_k3("rel_nested");
    REQUIRE(d, "synth failed: %s", out);
    const char *flat = t_tmpdir("rel_flat");
    REQUIRE(flat);
    /* the text model saved on its own: text_config becomes the root */
    char p[800];
    snprintf(p, sizeof p, "%s/config.json", d);
    json_t *root = json_load_file(p, 0, NULL);
    REQUIRE(root);
    json_t *tc = json_incref(json_object_get(root, "text_config"));
    REQUIRE(tc && !strcmp(json_string_value(json_object_get(tc, "model_type")), "kimi_linear"));
    int cp = t_sh(out, sizeof out, "cp %s/*.safetensors %s/ && (cp %s/*.index.json %s/ 2>/dev/null; true)", d, flat,
                  d, flat);
    REQUIRE(cp == 0, "%s", out);
    snprintf(p, sizeof p, "%s/config.json", flat);
    REQUIRE(json_dump_file(tc, p, JSON_INDENT(2)) == 0);
    json_decref(tc);
    json_decref(root);
    int rc = t_sh(out, sizeof out, "%s inspect --model %s", t_bin(), flat);
    CHECK(rc == 0 && strstr(out, "architecture   kimi_k3 (model_type kimi_linear)") && strstr(out, "SiTU"),
          "the fields make it K3: %s", out);
    rc = t_sh(out, sizeof out,
              "%s logits --model %s --tokens 3,1,4,1,5,9 --out %s/a.f32 && %s logits --model %s --tokens "
              "3,1,4,1,5,9 --out %s/b.f32 && cmp %s/a.f32 %s/b.f32",
              t_bin(), d, flat, t_bin(), flat, flat, flat, flat);
    CHECK(rc == 0, "flat and nested logits differ: %s", out);
}

/* ---- memory the kernel can give ---- */

TEST(rel_mem_parsers) {
    const char *mi = "MemTotal:       24000000 kB\nMemFree:          100000 kB\nMemAvailable:   20000000 kB\n"
                     "Buffers:            1000 kB\n";
    CHECK(mem_parse_meminfo(mi, "MemAvailable") == (int64_t)20000000 * 1024);
    CHECK(mem_parse_meminfo(mi, "MemFree") == (int64_t)100000 * 1024);
    CHECK(mem_parse_meminfo(mi, "SwapTotal") == -1);
    CHECK(mem_parse_meminfo("MemAvailableX: 5 kB\n", "MemAvailable") == -1, "whole key only");
    CHECK(mem_parse_limit("max\n") == -1 && mem_parse_limit("8589934592\n") == 8589934592LL);
    CHECK(mem_parse_limit("9223372036854771712\n") == -1, "cgroup v1's no-limit value");
    CHECK(mem_parse_limit("") == -1 && mem_parse_limit("garbage") == -1);
    const char *cg = "12:cpu,memory:/x/y\n4:pids:/\n0::/user.slice/app.scope\n";
    const char *path = mem_parse_cgroup_path(cg, "");
    CHECK(path && !strncmp(path, "/user.slice/app.scope\n", 22), "v2 path");
    path = mem_parse_cgroup_path(cg, "memory");
    CHECK(path && !strncmp(path, "/x/y\n", 5), "v1 path in a controller list");
    CHECK(mem_parse_cgroup_path("1:name=systemd:/\n", "") == NULL && mem_parse_cgroup_path(cg, "mem") == NULL);
    const char *st = "cache 10\ninactive_file 4096\ntotal_inactive_file 8192\n";
    CHECK(mem_parse_stat(st, "inactive_file") == 4096 && mem_parse_stat(st, "total_inactive_file") == 8192);
    CHECK(mem_parse_stat(st, "active_file") == -1);
    int64_t a = mem_available();
    CHECK(a > 0, "mem_available %lld", (long long)a);
    /* smaps: the mappings of the files named, not of their namesakes elsewhere */
    static const char sm[] =
        "7f0000000000-7f0000400000 r--s 00000000 fd:00 11 /m/K 8/model-1.safetensors\n"
        "Size:               4096 kB\nRss:                4096 kB\nFilePmdMapped:      2048 kB\nVmFlags: rd sh hg\n"
        "7f0000400000-7f0000500000 r--s 00400000 fd:00 11 /m/K 8/model-1.safetensors\n"
        "Rss:                 512 kB\nFilePmdMapped:         0 kB\n"
        "7f0000500000-7f0000600000 r--s 00000000 fd:00 12 /m/K 8b/model-1.safetensors\n"
        "Rss:                1024 kB\nFilePmdMapped:      1024 kB\n"
        "7f0000600000-7f0000700000 rw-p 00000000 00:00 0 \nRss:                1024 kB\n";
    FILE *f = fmemopen((void *)sm, sizeof sm - 1, "r");
    REQUIRE(f);
    int64_t rss = -1, pmd = -1;
    const char *files[] = {"/m/K 8/model-0.safetensors", "/m/K 8/model-1.safetensors"};
    mem_parse_smaps(f, files, 2, &rss, &pmd);
    fclose(f);
    CHECK(rss == 4608 * 1024 && pmd == 2048 * 1024, "rss %lld pmd %lld", (long long)rss, (long long)pmd);
    /* an address range: the anonymous mappings inside it, whole */
    static const char an[] =
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \nRss:                4096 kB\nAnonHugePages:      4096 kB\n"
        "7f0000400000-7f0000600000 rw-p 00000000 00:00 0 \nRss:                1024 kB\nAnonHugePages:         0 kB\n"
        "7f0000600000-7f0000a00000 rw-p 00000000 00:00 0 \nRss:                4096 kB\nAnonHugePages:      2048 kB\n";
    f = fmemopen((void *)an, sizeof an - 1, "r");
    REQUIRE(f);
    int64_t huge = -1;
    mem_parse_smaps_range(f, 0x7f0000000000ULL, 0x7f0000600000ULL, &rss, &huge);
    fclose(f);
    CHECK(rss == 5120 * 1024 && huge == 4096 * 1024, "range: rss %lld huge %lld", (long long)rss, (long long)huge);
}

/* The VmFlags line of the mapping of /proc/self/smaps that holds p, into
 * flags; 0 when found. */
static int vma_flags_of(const void *p, char *flags, size_t cap) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[480];
    int in = 0, rc = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long long lo, hi;
        if (sscanf(line, "%llx-%llx ", &lo, &hi) == 2) { /* a mapping's first line */
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        } else if (in && !strncmp(line, "VmFlags:", 8)) {
            snprintf(flags, cap, "%s", line + 8);
            rc = 0;
            break;
        }
    }
    fclose(f);
    return rc;
}

TEST(rel_big_buffers_on_huge_page_boundaries_and_advised) {
    /* under 2 MB: a 64-byte line, as the kernels want */
    char *small = mem_big_alloc(1000);
    REQUIRE(small);
    const uintptr_t off_line = (uintptr_t)small & 63;
    CHECK(off_line == 0, "small buffer on a line: %p", (void *)small);
    memset(small, 1, 1000);
    free(small);
    /* from 2 MB up: on a 2 MB boundary, written whole, freed with free(),
     * and advised (VmFlags "hg") where this environment keeps the advice at
     * all (qemu-user drops it: a probe mapping tells) */
    int advice_kept = 0;
#ifdef MADV_HUGEPAGE
    {
        const size_t len = (size_t)4 << 20;
        void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        char fl[512] = "";
        if (m != MAP_FAILED) {
            advice_kept = madvise(m, len, MADV_HUGEPAGE) == 0 && vma_flags_of(m, fl, sizeof fl) == 0 &&
                          strstr(fl, " hg") != NULL;
            munmap(m, len);
        }
    }
#endif
    const size_t sizes[] = {(size_t)2 << 20, (size_t)3 << 20, (size_t)70 << 20};
    for (int i = 0; i < 3; i++) {
        char *p = mem_big_alloc(sizes[i]);
        REQUIRE(p, "mem_big_alloc(%zu)", sizes[i]);
        const uintptr_t off_huge = (uintptr_t)p & (((uintptr_t)2 << 20) - 1);
        CHECK(off_huge == 0, "%zu bytes on a 2 MB boundary: %p", sizes[i], (void *)p);
        memset(p, 7, sizes[i]);
        char flags[512] = "";
        if (advice_kept && vma_flags_of(p, flags, sizeof flags) == 0)
            CHECK(strstr(flags, " hg"), "%zu bytes advised for huge pages: VmFlags%s", sizes[i], flags);
        CHECK(p[sizes[i] - 1] == 7);
        free(p);
    }
}

/* ---- --ram is the process's budget ---- */

TEST(rel_ram_budget_plans_spine_and_refuses) {
    /* a sparse K3-width slice: 9.1 GB of spine (2.3 of it an embedding a session
     * touches a row at a time), 2 x 300 experts (10.5 GB), planned without
     * allocating. Sizes: 14G = 15.03 GB. */
    const char *d = t_tmpdir("rel_plan");
    REQUIRE(d);
    int rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --preset k3-slice --experts 300 --sparse --out %s --quiet",
                  t_bin(), d);
    REQUIRE(rc == 0, "%s", out);
    char file[900];
    json_t *shape = NULL;
    CHECK(tensor_at(d, "language_model.model.layers.0.self_attn.A_log", file, sizeof file, &shape) > 0 && shape &&
              json_integer_value(json_array_get(shape, 0)) == 128 && json_array_size(shape) == 1,
          "k3-slice A_log is f32 [128] as in the release");
    json_decref(shape);
    rc = t_sh(out, sizeof out, "%s inspect --model %s --ram 14G", t_bin(), d);
    CHECK(rc == 0 && strstr(out, "resident: it fits beside the expert cache in the 15.03 GB budget (--ram)"),
          "14G keeps the spine resident: %s", out);
    CHECK(strstr(out, "of a 15.032 GB budget (--ram)"), "%s", out);
    rc = t_sh(out, sizeof out, "%s inspect --model %s --ram 14G --expert-cache 8G", t_bin(), d);
    CHECK(rc == 0 && strstr(out, "streamed per layer: the spine") && strstr(out, "beside a 8.59 GB expert cache"),
          "an 8G cache leaves no room: the spine streams and says why: %s", out);
    rc = t_sh(out, sizeof out, "%s inspect --model %s --ram 6G", t_bin(), d);
    CHECK(rc == 0 && strstr(out, "streamed per layer: the spine"), "%s", out);
    rc = t_sh(out, sizeof out, "%s inspect --model %s --ram 6G | grep 'memory plan'", t_bin(), d);
    double plan = -1, budget = -1;
    const char *m = strstr(out, "memory plan");
    if (m) sscanf(m, "memory plan %lf GB of a %lf GB", &plan, &budget);
    CHECK(plan > 0 && plan <= budget + 1e-9, "the plan fits the budget: %s", out);
    rc = t_sh(out, sizeof out, "%s inspect --model %s --ram 1G 2>&1", t_bin(), d);
    CHECK(rc == 1 && strstr(out, "--ram 1.07 GB cannot hold this model") && strstr(out, "expert cache") &&
              strstr(out, "session state"),
          "too small a budget is refused naming the parts: rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s inspect --model %s --ram 4G --spine resident 2>&1", t_bin(), d);
    CHECK(rc == 1 && strstr(out, "cannot hold this model") && strstr(out, "spine resident"), "rc %d: %s", rc, out);
}

TEST(rel_ram_budget_bounds_peak_rss) {
    const char *d = synth_k3("rel_rss");
    REQUIRE(d, "synth failed: %s", out);
    int rc = t_sh(out, sizeof out, "%s run --model %s --ram 160M --ctx 256 --tokens 1,2,3,4 --max-new 8 --ids --stats 2>&1",
                  t_bin(), d);
    REQUIRE(rc == 0, "%s", out);
    const char *m = strstr(out, "peak RSS");
    double peak = -1;
    if (m) sscanf(m, "peak RSS %lf MB", &peak);
    CHECK(peak > 0 && peak * 1048576.0 <= 160.0 * 1048576.0, "peak RSS %.1f MB within --ram 160M: %s", peak, out);
}

/* ---- the resident spine copied out of the page cache ---- */

#include "../src/model/model.h"
#include "../src/model/resident_copy.h"

/* Logits of tokens 3 1 4 1 5 9 2 6 in a new session of e ([8][vocab],
 * malloc'd), or NULL. */
static float *rc_eval(df_engine *e) {
    df_session *s = NULL;
    const int32_t tok[8] = {3, 1, 4, 1, 5, 9, 2, 6};
    if (df_session_new(e, 0, &s) != DF_OK) return NULL;
    float *lg = malloc((size_t)8 * df_engine_vocab_size(e) * sizeof *lg);
    if (lg && df_session_eval(s, tok, 8, lg) != DF_OK) {
        free(lg);
        lg = NULL;
    }
    df_session_free(s);
    return lg;
}

/* rc_eval of an engine opened with these options, or NULL; *e_out keeps
 * the engine. */
static float *rc_logits(const char *d, int use_mmap, int map_spine, df_engine **e_out) {
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = 2;
    o.use_mmap = use_mmap;
    o.map_spine = map_spine;
    char err[DF_ERRMSG];
    *e_out = NULL;
    if (df_engine_open(d, &o, e_out, err) != DF_OK) return NULL;
    return rc_eval(*e_out);
}

/* Of an engine's resident views: those moved into the copy on a 128-byte
 * line, those left at the file's place (the paged embedding), and others. */
typedef struct { int copied, in_file, other; } rc_tally;

static rc_tally rc_where(df_engine *e) {
    rc_tally t = {0, 0, 0};
    const char *lo = rcopy_base(e->rcopy), *hi = lo + rcopy_region_bytes(e->rcopy);
    for (int i = 0; i < e->n_res_views; i++) {
        const df_weight *w = e->res_views[i];
        const char *p = w->data;
        char err[DF_ERRMSG];
        if (lo && p >= lo && p < hi && (uintptr_t)p % ST_DATA_ALIGN == 0) t.copied++;
        else if (w->t_data && p == st_data(e->st, w->t_data, err)) t.in_file++;
        else t.other++;
    }
    return t;
}

/* Reads of 64 KB or more from any thread but the one that opened the
 * engine fail while rc_fail_big is set: with experts mapped, only the
 * spine's copy reads that way. */
static pthread_t rc_opener;
static _Atomic int rc_fail_big;
static ssize_t rc_pread(void *ctx, int fd, void *buf, size_t n, off_t off) {
    (void)ctx;
    if (atomic_load(&rc_fail_big) && n >= 65536 && !pthread_equal(pthread_self(), rc_opener)) {
        errno = EIO;
        return -1;
    }
    return pread(fd, buf, n, off);
}

/* The copy runs behind the open: no view moves in the open, and a copy
 * whose reads fail moves no view either: the evaluations read the mapping,
 * with the same bits, and the reason is kept. */
TEST(rel_resident_spine_copy_behind_open) {
    const char *d = synth_k3("rel_rcopy_bg");
    REQUIRE(d, "synth failed: %s", out);
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = 2;
    o.expert_io = DF_EXPERTS_MMAP;
    char err[DF_ERRMSG];
    df_engine *em = NULL, *e = NULL;
    o.map_spine = 1;
    REQUIRE(df_engine_open(d, &o, &em, err) == DF_OK, "%s", err);
    float *m = rc_eval(em);
    REQUIRE(m);
    o.map_spine = 0;
    REQUIRE(df_engine_open(d, &o, &e, err) == DF_OK, "%s", err);
    rc_tally t = rc_where(e);
    CHECK(t.copied == 0 && t.other == 0 && t.in_file > 10, "after open: %d copied, %d in the file, %d elsewhere",
          t.copied, t.in_file, t.other);
    REQUIRE(df_engine_spine_copy_wait(e, err) == DF_OK, "%s", err);
    t = rc_where(e);
    CHECK(t.copied > 10 && t.in_file == 1 && t.other == 0, "after the wait: %d / %d / %d", t.copied, t.in_file,
          t.other);
    df_engine_close(e);
    /* copied by the open itself */
    o.spine_copy_at_open = 1;
    REQUIRE(df_engine_open(d, &o, &e, err) == DF_OK, "%s", err);
    rc_tally t2 = rc_where(e);
    CHECK(t2.copied == t.copied && t2.in_file == 1 && t2.other == 0, "copied at open: %d / %d / %d", t2.copied,
          t2.in_file, t2.other);
    df_engine_close(e);
    o.spine_copy_at_open = 0;
    /* a copy whose reads fail */
    df_io io = *df_io_default();
    io.pread = rc_pread;
    o.io = &io;
    rc_opener = pthread_self();
    atomic_store(&rc_fail_big, 1);
    REQUIRE(df_engine_open(d, &o, &e, err) == DF_OK, "%s", err);
    int64_t nt, bytes, rss, huge;
    double secs;
    while (df_engine_spine_copy(e, &nt, &bytes, &secs, &rss, &huge) == 2) usleep(1000);
    df_session *s = NULL;
    REQUIRE(df_session_new(e, 0, &s) == DF_OK);
    const int32_t tok[8] = {3, 1, 4, 1, 5, 9, 2, 6};
    float *lg = malloc((size_t)8 * df_engine_vocab_size(e) * sizeof *lg);
    REQUIRE(lg);
    atomic_store(&rc_fail_big, 0);
    df_status st = df_session_eval(s, tok, 8, lg);
    CHECK(st == DF_OK && !memcmp(lg, m, (size_t)8 * df_engine_vocab_size(e) * sizeof *lg),
          "%d: the evaluation after a failed copy reads the mapping, same bits: %s", st, df_session_error(s));
    t = rc_where(e);
    CHECK(t.copied == 0 && t.other == 0, "no view moved: %d / %d / %d", t.copied, t.in_file, t.other);
    CHECK(df_engine_spine_copy(e, &nt, &bytes, &secs, &rss, &huge) == 0, "a failed copy reports none");
    const char *why = df_engine_spine_copy_error(e);
    CHECK(strstr(why, "safetensors") && strstr(why, "copying") && strstr(why, "page cache"), "reason: %s", why);
    free(lg);
    free(m);
    df_session_free(s);
    df_engine_close(e);
    df_engine_close(em);
}

TEST(rel_resident_spine_copied_same_bits) {
    const char *d = synth_k3("rel_rcopy");
    REQUIRE(d, "synth failed: %s", out);
    for (int tied = 0; tied < 2; tied++) {
        if (tied) { /* the head is the embedding: read whole, so copied, and both views move */
            char p[800];
            snprintf(p, sizeof p, "%s/config.json", d);
            json_t *root = json_load_file(p, 0, NULL);
            REQUIRE(root);
            json_object_set_new(root, "tie_word_embeddings", json_true());
            json_t *tc = json_object_get(root, "text_config");
            if (tc) json_object_set_new(tc, "tie_word_embeddings", json_true());
            REQUIRE(json_dump_file(root, p, JSON_INDENT(2)) == 0);
            json_decref(root);
        }
        df_engine *ec = NULL, *em = NULL, *ep = NULL;
        /* c: while the copy may still run (views on the mapping, or moved
         * between the steps); c2: once it was waited for */
        float *c = rc_logits(d, 1, 0, &ec), *m = rc_logits(d, 1, 1, &em), *r = rc_logits(d, 0, 0, &ep);
        char err[DF_ERRMSG];
        REQUIRE(c && m && r, "tied %d: an engine failed", tied);
        REQUIRE(df_engine_spine_copy_wait(ec, err) == DF_OK, "%s", err);
        float *c2 = rc_eval(ec);
        REQUIRE(c2);
        size_t n = (size_t)8 * df_engine_vocab_size(ec) * sizeof *c;
        CHECK(!memcmp(c, m, n) && !memcmp(c2, m, n) && !memcmp(c, r, n),
              "tied %d: the copied spine (during and after the copy), the mapped one and --no-mmap agree", tied);
        free(c2);
        int64_t nt = 0, bytes = 0, rss = 0, huge = 0;
        double secs = 0;
        CHECK(df_engine_spine_copy(ec, &nt, &bytes, &secs, &rss, &huge) == 1 && nt > 10 && bytes > 0 && rss > 0,
              "tied %d: %lld tensors, %lld bytes, rss %lld", tied, (long long)nt, (long long)bytes, (long long)rss);
        CHECK(df_engine_spine_copy(em, &nt, &bytes, &secs, &rss, &huge) == 0 && bytes == 0, "--map-spine copies nothing");
        CHECK(df_engine_spine_copy(ep, &nt, &bytes, &secs, &rss, &huge) == 0 && bytes == 0, "--no-mmap copies nothing");
        rc_tally tc = rc_where(ec), tm = rc_where(em);
        CHECK(tc.copied > 10 && tc.in_file == (tied ? 0 : 1) && tc.other == 0,
              "tied %d: %d views copied, %d in the file (the paged embedding), %d elsewhere", tied, tc.copied,
              tc.in_file, tc.other);
        CHECK(tm.copied == 0 && tm.other == 0 && tm.in_file == tc.copied + tc.in_file, "--map-spine: %d / %d / %d",
              tm.copied, tm.in_file, tm.other);
        free(c);
        free(m);
        free(r);
        df_engine_close(ec);
        df_engine_close(em);
        df_engine_close(ep);
    }
}

/* ---- router lookahead: precision turns it down ---- */

#include "../src/experts/store.h"
#include "../src/experts/spine.h"
#include "../src/experts/place.h"
#include "../src/format/weight.h"

/* Registers kimi_k3_mxfp4's 10 experts of layer 1 (MXFP4) with x and
 * finalises it; NULL on failure. */
static xs_store *register_layer1(st_set *st, xs_store *x) {
    char err[DF_ERRMSG];
    static const char *mats[3] = {"w1", "w3", "w2"};
    static const int shape[3][2] = {{96, 64}, {96, 64}, {64, 96}};
    for (int e = 0; e < 10; e++) {
        df_weight w[3];
        for (int k = 0; k < 3; k++) {
            char b[200];
            snprintf(b, sizeof b, "language_model.model.layers.1.block_sparse_moe.experts.%d.%s", e, mats[k]);
            if (wt_bind_lazy(st, b, shape[k][0], shape[k][1], 0, 0, &w[k], err) != DF_OK) return NULL;
        }
        if (xs_register(x, 1, e, w, err) != DF_OK) return NULL;
    }
    return xs_finalize(x, err) == DF_OK ? x : NULL;
}

/* Those experts in a store of `slots` slots, prefetch floor 0.75, read
 * through io (O_DIRECT where direct, landing at dio_mem_align bytes). */
static xs_store *fixture_store_io(st_set **st, int slots, const df_io *io, int direct, int dio_mem_align) {
    char err[DF_ERRMSG];
    if (st_open_dir("tests/fixtures/kimi_k3_mxfp4", df_io_default(), 1, st, err) != DF_OK) return NULL;
    xs_opts o = {0};
    o.ram_bytes = 1; /* two slots: just to learn the slot size */
    o.direct = direct;
    o.dio_mem_align = dio_mem_align;
    o.reader = XR_AUTO;
    o.depth = 8;
    o.io_threads = 2;
    o.prefetch_min_precision = XS_PF_MIN_PRECISION;
    xs_store *x = NULL;
    if (xs_new(io, *st, 5, 10, &o, &x, err) != DF_OK || !register_layer1(*st, x)) { xs_free(x); return NULL; }
    o.ram_bytes = xs_expert_bytes(x) * slots;
    xs_free(x);
    x = NULL;
    if (xs_new(io, *st, 5, 10, &o, &x, err) != DF_OK || !register_layer1(*st, x)) { xs_free(x); return NULL; }
    return x;
}

static xs_store *fixture_store(st_set **st, int slots) { return fixture_store_io(st, slots, df_io_default(), 0, 0); }

static void run_pass(xs_store *x, const int *ex, int n) {
    char err[DF_ERRMSG];
    if (xs_begin(x, 1, ex, n, err) != DF_OK) return;
    int e;
    df_weight w[3];
    while (xs_next(x, &e, w, err) == DF_OK && e >= 0) xs_done(x, e);
    xs_end(x);
}

TEST(rel_lookahead_precision_turns_ranks_down) {
    st_set *st = NULL;
    xs_store *x = fixture_store(&st, 8);
    REQUIRE(x, "store");
    /* each round: hints ranked [a, b, c, d], the pass uses a and b only (ranks
     * 2 and 3 always mispredict); a, b rotate so nothing is a cache hit */
    xs_stats s0, s1;
    uint64_t early = 0, late = 0;
    for (int round = 0; round < 200; round++) {
        int a = (round * 4) % 10, hints[4] = {a, (a + 1) % 10, (a + 2) % 10, (a + 3) % 10};
        xs_get_stats(x, &s0);
        xs_prefetch(x, 1, hints, 4);
        xs_drain(x);
        xs_get_stats(x, &s1);
        if (round < 4) early += s1.prefetched - s0.prefetched;
        if (round >= 100) late += s1.prefetched - s0.prefetched;
        int used[2] = {hints[0] < hints[1] ? hints[0] : hints[1], hints[0] < hints[1] ? hints[1] : hints[0]};
        run_pass(x, used, 2);
    }
    xs_get_stats(x, &s1);
    CHECK(early >= 12, "all four ranks read at first (%llu reads in 4 rounds)", (unsigned long long)early);
    /* later: ranks 0 and 1 always, rank 2 probed every 32nd hint, rank 3 never */
    CHECK(late >= 200 && late <= 200 + 8, "%llu reads in 100 rounds", (unsigned long long)late);
    CHECK(s1.prefetch_used + s1.prefetch_wasted <= s1.prefetched && s1.prefetch_wasted < s1.prefetch_used / 4,
          "used %llu wasted %llu", (unsigned long long)s1.prefetch_used, (unsigned long long)s1.prefetch_wasted);
    xs_free(x);
    st_close(st);
}

/* ---- expert tensors on aligned places in their slots ---- */

/* Tallies of tensors seen in a slot: how many, how many lie off a
 * PLACE_ALIGN line in the file, off it in the slot, and with other bytes
 * than the file's. */
typedef struct { int checked, off_in_file, off_in_slot, bad_bytes; } placed_tally;

/* Checks tensor t seen at p against its file; 0 when the file cannot be read. */
static int tally_placed(st_set *st, const st_tensor *t, const void *p, placed_tally *n) {
    FILE *f = fopen(st_shard_path(st, t->shard), "rb");
    uint8_t *b = malloc((size_t)t->nbytes);
    const int ok =
        f && b && fseeko(f, t->offset, SEEK_SET) == 0 && fread(b, 1, (size_t)t->nbytes, f) == (size_t)t->nbytes;
    if (f) fclose(f);
    if (ok) {
        n->checked++;
        n->off_in_file += t->offset % PLACE_ALIGN != 0;
        n->off_in_slot += (uintptr_t)p % PLACE_ALIGN != 0;
        n->bad_bytes += memcmp(p, b, (size_t)t->nbytes) != 0;
    }
    free(b);
    return ok;
}

/* The fixture's expert tensors lie 12-104 bytes past a 128-byte line in its
 * files (its header and tensor sizes put them there, as a release's may).
 * An expert handed out for the first time since its read keeps the file's
 * offsets; handed out again from the same slot, each tensor starts on
 * PLACE_ALIGN. Every hand-out has the file's bytes, read buffered or with
 * O_DIRECT, in four slots that later rounds reuse for other experts. */
static void pass_tally(st_set *st, xs_store *x, const int *ex, int n, placed_tally *t) {
    char err[DF_ERRMSG];
    REQUIRE(xs_begin(x, 1, ex, n, err) == DF_OK, "%s", err);
    int e;
    df_weight w[3];
    while (xs_next(x, &e, w, err) == DF_OK && e >= 0) {
        for (int k = 0; k < 3; k++) {
            REQUIRE(tally_placed(st, w[k].t_data, w[k].data, t), "reading the shard");
            if (w[k].t_scale) REQUIRE(tally_placed(st, w[k].t_scale, w[k].scale, t), "reading the shard");
        }
        xs_done(x, e);
    }
    xs_end(x);
}

TEST(rel_expert_tensors_aligned_in_slots) {
    for (int direct = 0; direct < 2; direct++) {
        st_set *st = NULL;
        /* reads land on whole blocks (a device that cannot take a buffer
         * off one), so the first use keeps the file's offsets */
        xs_store *x = fixture_store_io(&st, 4, df_io_default(), direct, XR_ALIGN);
        REQUIRE(x, "store");
        placed_tally first = {0}, again = {0};
        for (int round = 0; round < 3; round++) {
            const int ex[3] = {round * 3, round * 3 + 1, round * 3 + 2}; /* new experts each round */
            pass_tally(st, x, ex, 3, &first);
            pass_tally(st, x, ex, 3, &again);
            pass_tally(st, x, ex, 3, &again);
        }
        CHECK(first.checked == 3 * 3 * 3 * 2 && first.off_in_file > 0 && first.off_in_slot > 0,
              "direct %d, first use: %d tensors, %d off the line in the file, %d in the slot", direct, first.checked,
              first.off_in_file, first.off_in_slot);
        CHECK(again.checked == 2 * first.checked && again.off_in_slot == 0,
              "direct %d, used again: %d tensors, %d off PLACE_ALIGN", direct, again.checked, again.off_in_slot);
        CHECK(first.bad_bytes == 0 && again.bad_bytes == 0, "direct %d: %d and %d tensors with other bytes", direct,
              first.bad_bytes, again.bad_bytes);
        xs_free(x);
        st_close(st);
    }
}

/* O_DIRECT with the flag taken off: any buffer alignment reads, as on a
 * device whose DIO memory alignment is a few bytes (NVMe: 4). */
static int open_buffered(void *ctx, const char *path, int flags, int mode) {
    (void)ctx;
    return open(path, flags & ~DF_O_DIRECT, mode);
}

/* Where the device takes a buffer a few bytes past a block, each direct
 * read lands with its span's first tensor on PLACE_ALIGN: fewer tensors off
 * the line at their first use than when reads land on whole blocks, all of
 * them on it at the next, and the file's bytes everywhere. */
TEST(rel_expert_reads_land_on_lines) {
    df_io io = *df_io_default();
    io.open = open_buffered;
    placed_tally first[3] = {{0}}, again[3] = {{0}};
    const int align[3] = {XR_ALIGN, 4, 1}; /* 1: as 4, the reader's least */
    for (int a = 0; a < 3; a++) {
        st_set *st = NULL;
        xs_store *x = fixture_store_io(&st, 4, &io, 1, align[a]);
        REQUIRE(x, "store");
        for (int round = 0; round < 3; round++) {
            const int ex[3] = {round * 3, round * 3 + 1, round * 3 + 2};
            pass_tally(st, x, ex, 3, &first[a]);
            pass_tally(st, x, ex, 3, &again[a]);
        }
        CHECK(first[a].checked == 3 * 3 * 3 * 2 && again[a].checked == first[a].checked, "align %d: %d, %d tensors",
              align[a], first[a].checked, again[a].checked);
        CHECK(again[a].off_in_slot == 0, "align %d, used again: %d tensors off the line", align[a],
              again[a].off_in_slot);
        CHECK(first[a].bad_bytes == 0 && again[a].bad_bytes == 0, "align %d: %d and %d tensors with other bytes",
              align[a], first[a].bad_bytes, again[a].bad_bytes);
        xs_free(x);
        st_close(st);
    }
    CHECK(first[0].off_in_slot > 0 && first[1].off_in_slot < first[0].off_in_slot &&
              first[2].off_in_slot == first[1].off_in_slot,
          "first use off the line: %d reading whole blocks, %d and %d landing on lines", first[0].off_in_slot,
          first[1].off_in_slot, first[2].off_in_slot);
}

/* The streamed spine's reads likewise: the fixture's non-expert tensors of
 * layers 0 and 1 (one group each) read through the table without the flag,
 * landing on whole blocks and on 4 bytes. On 4 bytes every span's first
 * tensor is on PLACE_ALIGN, so fewer tensors are off the line; both ways
 * every view has the file's bytes. */
TEST(rel_spine_reads_land_on_lines) {
    df_io io = *df_io_default();
    io.open = open_buffered;
    placed_tally seen[2] = {{0}};
    int first_on_line[2] = {0}, spans[2] = {0};
    const int align[2] = {XR_ALIGN, 4};
    for (int a = 0; a < 2; a++) {
        char err[DF_ERRMSG];
        st_set *st = NULL;
        REQUIRE(st_open_dir("tests/fixtures/kimi_k3_mxfp4", df_io_default(), 1, &st, err) == DF_OK, "%s", err);
        sp_store *sp = NULL;
        REQUIRE(sp_new(&io, st, 2, 1, 0, &sp, err) == DF_OK, "%s", err);
        sp_set_dio_mem_align(sp, align[a]);
        df_weight w[256];
        int nw = 0;
        for (int64_t i = 0; i < st_count(st) && nw < 256; i++) {
            const st_tensor *t = st_at(st, i);
            const int g = strstr(t->name, "layers.0.") ? 0 : strstr(t->name, "layers.1.") ? 1 : -1;
            if (g < 0 || strstr(t->name, ".experts.")) continue;
            memset(&w[nw], 0, sizeof w[nw]);
            w[nw].t_data = t;
            REQUIRE(sp_register(sp, g, &w[nw], err) == DF_OK, "%s", err);
            nw++;
        }
        REQUIRE(nw > 8 && sp_finalize(sp, err) == DF_OK, "%d views: %s", nw, err);
        for (int g = 0; g < 2; g++) {
            REQUIRE(sp_enter(sp, g, err) == DF_OK, "%s", err);
            df_weight *const *v;
            const int n = sp_views(sp, g, &v);
            /* each view, and whether the lowest-offset tensor of each shard's
             * run lies on the line (a span's first) */
            const st_tensor *lowest = NULL;
            const void *lowest_at = NULL;
            for (int i = 0; i < n; i++) {
                REQUIRE(tally_placed(st, v[i]->t_data, v[i]->data, &seen[a]), "reading the shard");
                if (!lowest || v[i]->t_data->offset < lowest->offset) lowest = v[i]->t_data, lowest_at = v[i]->data;
            }
            spans[a]++;
            first_on_line[a] += (uintptr_t)lowest_at % PLACE_ALIGN == 0;
        }
        sp_free(sp);
        st_close(st);
        CHECK(seen[a].bad_bytes == 0, "align %d: %d of %d tensors with other bytes", align[a], seen[a].bad_bytes,
              seen[a].checked);
    }
    CHECK(seen[0].checked == seen[1].checked && seen[0].off_in_file > 0, "%d, %d tensors (%d off the line in the file)",
          seen[0].checked, seen[1].checked, seen[0].off_in_file);
    CHECK(first_on_line[1] == spans[1] && seen[1].off_in_slot < seen[0].off_in_slot,
          "landing on 4 bytes: %d of %d groups' first tensors on the line, %d tensors off it against %d on blocks",
          first_on_line[1], spans[1], seen[1].off_in_slot, seen[0].off_in_slot);
}
