/* test_synth.c — `deltafin synth` and src/synth (suite synth_).
 *
 * Oracles: a tiny checkpoint of every family opens, runs and gives finite
 * logits in the engine; a sharded index covers every tensor of every shard,
 * each in the file it names, with the right total_size; sparse files have
 * the right apparent size and almost no blocks; K3's MXFP4 experts lie as in
 * the release (one contiguous 17,547,264-byte span per expert, ordered by the
 * string form of the id, K3.md §1.12 offsets); the same seed gives the same
 * bytes whatever the thread count; --gb lands just under the budget; the
 * decoded weights have std 1/sqrt(fan_in); a failed write leaves no
 * config.json. Everything stays small (sparse for the K3-width checks).
 */
#include "test.h"
#include "deltafin.h"
#include "../src/synth/synth.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const archs[] = {"deepseek_v3", "kimi_k2", "kimi_linear", "kimi_k3"};

/* The JSON header of a safetensors file (NULL on error); *data_start set. */
static json_t *st_header(const char *path, int64_t *data_start) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    uint8_t lb[8];
    json_t *j = NULL;
    if (fread(lb, 1, 8, f) == 8) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = n << 8 | lb[i];
        char *h = n < (1u << 28) ? malloc(n) : NULL;
        if (h && fread(h, 1, n, f) == n) j = json_loadb(h, n, 0, NULL);
        free(h);
        if (data_start) *data_start = 8 + (int64_t)n;
    }
    fclose(f);
    return j;
}

static int64_t jint(json_t *o, const char *k, size_t i) { return json_integer_value(json_array_get(json_object_get(o, k), i)); }

static void rm_rf(const char *dir) { t_sh(NULL, 0, "rm -rf '%s'", dir); }

/* ---- every family: synth tiny -> inspect, run, logits ---- */

TEST(synth_tiny_every_arch_runs) {
    char out[8192];
    for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++) {
        const char *d = t_tmpdir(archs[a]);
        REQUIRE(d);
        int rc = t_sh(out, sizeof out, "%s synth --arch %s --out %s --quiet", t_bin(), archs[a], d);
        CHECK(rc == 0, "%s: synth rc %d: %s", archs[a], rc, out);
        rc = t_sh(out, sizeof out, "%s inspect --model %s", t_bin(), d);
        CHECK(rc == 0, "%s: inspect rc %d: %s", archs[a], rc, out);
        rc = t_sh(out, sizeof out, "%s run --model %s --tokens 1,2,3 --max-new 4 --ids 2>/dev/null", t_bin(), d);
        int ids[4], n = sscanf(out, "%d %d %d %d", &ids[0], &ids[1], &ids[2], &ids[3]);
        CHECK(rc == 0 && n == 4, "%s: run rc %d, %d ids: %s", archs[a], rc, n, out);
        char lg[700];
        snprintf(lg, sizeof lg, "%s/logits.bin", d);
        rc = t_sh(out, sizeof out, "%s logits --model %s --tokens 1,2,3,4,5 --out %s", t_bin(), d, lg);
        CHECK(rc == 0, "%s: logits rc %d: %s", archs[a], rc, out);
        FILE *f = fopen(lg, "rb");
        if (rc == 0 && f) {
            float v[4096];
            size_t got, total = 0, bad = 0;
            double ss = 0;
            while ((got = fread(v, sizeof(float), 4096, f)) > 0)
                for (size_t i = 0; i < got; i++, total++) {
                    if (!isfinite(v[i])) bad++;
                    else ss += (double)v[i] * v[i];
                }
            CHECK(total == 5 * 1024 && bad == 0, "%s: %zu logits, %zu not finite", archs[a], total, bad);
            double rms = total ? sqrt(ss / (double)total) : 0;
            CHECK(rms > 0.5 && rms < 8, "%s: logit rms %g (lm_head gain 2 gives ~2)", archs[a], rms);
        }
        if (f) fclose(f);
        rm_rf(d);
    }
}

/* ---- sharding ---- */

TEST(synth_shards_index_covers_every_tensor) {
    const char *d = t_tmpdir("shards");
    REQUIRE(d);
    char out[8192], p[700];
    int rc = t_sh(out, sizeof out, "%s synth --arch kimi_k2 --out %s --shard-size 60K --quiet", t_bin(), d);
    REQUIRE(rc == 0, "synth rc %d: %s", rc, out);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", d);
    json_t *idx = json_load_file(p, 0, NULL);
    REQUIRE(idx, "no index");
    json_t *wm = json_object_get(idx, "weight_map");
    int64_t total = json_integer_value(json_object_get(json_object_get(idx, "metadata"), "total_size"));
    /* every shard's tensors: in the weight map under that file */
    int n_files = 0;
    size_t seen = 0;
    int64_t bytes = 0;
    for (int i = 1; i < 100; i++) {
        char name[64];
        int nf = 0;
        for (int k = 2; k < 100 && !nf; k++) {
            snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", i, k);
            snprintf(p, sizeof p, "%s/%s", d, name);
            if (access(p, F_OK) == 0) nf = k;
        }
        if (!nf) break;
        n_files = nf;
        json_t *h = st_header(p, NULL);
        REQUIRE(h, "%s: unreadable header", p);
        const char *k;
        json_t *v;
        json_object_foreach(h, k, v) {
            if (!strcmp(k, "__metadata__")) continue;
            seen++;
            bytes += jint(v, "data_offsets", 1) - jint(v, "data_offsets", 0);
            const char *f = json_string_value(json_object_get(wm, k));
            CHECK(f && !strcmp(f, name), "tensor %s: in %s, index says %s", k, name, f ? f : "(absent)");
        }
        json_decref(h);
    }
    CHECK(n_files >= 3, "only %d shards with --shard-size 60K", n_files);
    CHECK(seen == json_object_size(wm), "%zu tensors in the shards, %zu in the weight map", seen, json_object_size(wm));
    CHECK(bytes == total, "tensor bytes %lld, metadata.total_size %lld", (long long)bytes, (long long)total);
    /* a layer's experts stay in one shard */
    for (int l = 1; l < 3; l++) {
        const char *first = NULL;
        const char *k;
        json_t *v;
        char pre[64];
        snprintf(pre, sizeof pre, "model.layers.%d.mlp.experts.", l);
        json_object_foreach(wm, k, v) {
            if (strncmp(k, pre, strlen(pre))) continue;
            if (!first) first = json_string_value(v);
            CHECK(!strcmp(first, json_string_value(v)), "layer %d experts split over %s and %s", l, first,
                  json_string_value(v));
        }
        CHECK(first, "layer %d has no experts in the index", l);
    }
    json_decref(idx);
    rc = t_sh(out, sizeof out, "%s run --model %s --tokens 5,6 --max-new 2 --ids 2>&1", t_bin(), d);
    CHECK(rc == 0, "sharded run rc %d: %s", rc, out);
    rm_rf(d);
}

/* ---- sparse files and K3's MXFP4 expert spans ---- */

static int by_str(const void *a, const void *b) { return strcmp(a, b); }

TEST(synth_sparse_k3_slice_layout) {
    const char *d = t_tmpdir("sparse");
    REQUIRE(d);
    char out[8192], p[700];
    int rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --preset k3-slice --experts 24 --sparse --out %s --quiet",
                  t_bin(), d);
    REQUIRE(rc == 0, "synth rc %d: %s", rc, out);
    /* every shard: apparent size = header + data, almost nothing allocated */
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", d);
    json_t *idx = json_load_file(p, 0, NULL);
    REQUIRE(idx, "no index (the slice is ~10 GB: 5 GB shards)");
    int64_t total = json_integer_value(json_object_get(json_object_get(idx, "metadata"), "total_size"));
    int64_t apparent = 0, allocated = 0, headers = 0, files = 0;
    for (int i = 1; i < 20; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s/model-%05d-of-", d, i);
        rc = t_sh(out, sizeof out, "ls %s*.safetensors 2>/dev/null", name);
        if (rc != 0) break;
        out[strcspn(out, "\n")] = 0;
        int64_t start = 0, end = 0;
        json_t *h = st_header(out, &start);
        REQUIRE(h, "%s: no header", out);
        const char *k;
        json_t *v;
        json_object_foreach(h, k, v) if (strcmp(k, "__metadata__") && jint(v, "data_offsets", 1) > end) end = jint(v, "data_offsets", 1);
        json_decref(h);
        struct stat s;
        REQUIRE(stat(out, &s) == 0);
        CHECK(s.st_size == start + end, "%s: apparent size %lld, header says %lld", out, (long long)s.st_size,
              (long long)(start + end));
        apparent += s.st_size;
        allocated += (int64_t)s.st_blocks * 512;
        headers += start;
        files++;
    }
    CHECK(files >= 2 && apparent - headers == total, "%lld files, %lld data bytes, total_size %lld", (long long)files,
          (long long)(apparent - headers), (long long)total);
    CHECK(total > (int64_t)9e9, "total %lld: not K3 widths?", (long long)total);
    CHECK(allocated < (16 << 20), "%lld bytes allocated for sparse files", (long long)allocated);

    /* the shard holding layer 1's experts */
    const char *f = json_string_value(json_object_get(json_object_get(idx, "weight_map"),
                                      "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"));
    REQUIRE(f, "layer 1 expert 0 not in the index");
    snprintf(p, sizeof p, "%s/%s", d, f);
    json_decref(idx);
    json_t *h = st_header(p, NULL);
    REQUIRE(h, "%s: no header", p);
    /* Layer 1's experts: one span each, back to back, in string-id order
     * ("0", "1", "10", "11", ...), laid out as K3.md §1.12. */
    static const char *const part[6] = {"w1.weight_packed", "w1.weight_scale", "w2.weight_packed",
                                        "w2.weight_scale", "w3.weight_packed", "w3.weight_scale"};
    static const int64_t off[6] = {0, 5505024, 5849088, 11354112, 11698176, 17203200};
    char ids[24][12];
    for (int e = 0; e < 24; e++) snprintf(ids[e], sizeof ids[e], "%d", e);
    qsort(ids, 24, sizeof ids[0], by_str);
    int64_t base = -1;
    for (int r = 0; r < 24; r++)
        for (int j = 0; j < 6; j++) {
            char name[512];
            snprintf(name, sizeof name, "language_model.model.layers.1.block_sparse_moe.experts.%.11s.%s", ids[r],
                     part[j]);
            json_t *t = json_object_get(h, name);
            REQUIRE(t, "%s missing", name);
            if (base < 0) base = jint(t, "data_offsets", 0);
            int64_t want = base + (int64_t)r * 17547264 + off[j];
            CHECK(jint(t, "data_offsets", 0) == want, "%s at %lld, expected %lld", name,
                  (long long)jint(t, "data_offsets", 0), (long long)want);
            CHECK(!strcmp(json_string_value(json_object_get(t, "dtype")), "U8"), "%s not U8", name);
        }
    json_t *w2 = json_object_get(h, "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed");
    CHECK(jint(w2, "shape", 0) == 3584 && jint(w2, "shape", 1) == 1536, "w2 packed shape");
    json_decref(h);
    /* the engine plumbing at true widths (data regions read as zeros) */
    rc = t_sh(out, sizeof out, "%s inspect --model %s", t_bin(), d);
    CHECK(rc == 0, "inspect of the sparse slice rc %d: %s", rc, out);
    rm_rf(d);
}

/* ---- determinism ---- */

TEST(synth_same_seed_same_bytes) {
    char out[8192];
    static const char *const which[] = {"kimi_k2", "kimi_k3"};
    for (int a = 0; a < 2; a++) {
        const char *d1 = t_tmpdir("seed1"), *d2 = t_tmpdir("seed2"), *d3 = t_tmpdir("seed3");
        REQUIRE(d1 && d2 && d3);
        int rc = t_sh(out, sizeof out,
                      "%s synth --arch %s --seed 7 --threads 1 --out %s --quiet && "
                      "%s synth --arch %s --seed 7 --threads 3 --shard-size 200K --out %s --quiet && "
                      "%s synth --arch %s --seed 8 --out %s --quiet",
                      t_bin(), which[a], d1, t_bin(), which[a], d2, t_bin(), which[a], d3);
        REQUIRE(rc == 0, "synth rc %d: %s", rc, out);
        rc = t_sh(out, sizeof out, "cmp %s/model.safetensors %s/model.safetensors", d1, d3);
        CHECK(rc != 0, "%s: seeds 7 and 8 gave the same bytes", which[a]);
        /* Same seed, different thread count and layout: every tensor's bytes
         * agree. Compare the tensors through their headers. */
        char p1[700];
        snprintf(p1, sizeof p1, "%s/model.safetensors", d1);
        int64_t s1;
        json_t *h1 = st_header(p1, &s1);
        REQUIRE(h1);
        const char *k;
        json_t *v;
        int diff = 0, n = 0;
        FILE *f1 = fopen(p1, "rb");
        for (int i = 1; i < 50; i++) {
            char p2[700];
            int nf = 0;
            for (int m = 2; m < 50 && !nf; m++) {
                snprintf(p2, sizeof p2, "%s/model-%05d-of-%05d.safetensors", d2, i, m);
                if (access(p2, F_OK) == 0) nf = m;
            }
            if (!nf) break;
            int64_t s2;
            json_t *h2 = st_header(p2, &s2);
            FILE *f2 = fopen(p2, "rb");
            json_object_foreach(h2, k, v) {
                if (!strcmp(k, "__metadata__")) continue;
                json_t *t1 = json_object_get(h1, k);
                int64_t b1 = jint(t1, "data_offsets", 0), e1 = jint(t1, "data_offsets", 1);
                int64_t b2 = jint(v, "data_offsets", 0), e2 = jint(v, "data_offsets", 1);
                n++;
                if (!t1 || e1 - b1 != e2 - b2) { diff++; continue; }
                char *x = malloc((size_t)(e1 - b1) + 1), *y = malloc((size_t)(e2 - b2) + 1);
                fseek(f1, (long)(s1 + b1), SEEK_SET);
                fseek(f2, (long)(s2 + b2), SEEK_SET);
                if (fread(x, 1, (size_t)(e1 - b1), f1) != (size_t)(e1 - b1) ||
                    fread(y, 1, (size_t)(e2 - b2), f2) != (size_t)(e2 - b2) || memcmp(x, y, (size_t)(e1 - b1)))
                    diff++;
                free(x);
                free(y);
            }
            fclose(f2);
            json_decref(h2);
        }
        fclose(f1);
        CHECK(n + 1 == (int)json_object_size(h1) && diff == 0, "%s: %d of %d tensors differ (%zu in the single file)",
              which[a], diff, n, json_object_size(h1) - 1);
        json_decref(h1);
        rm_rf(d1);
        rm_rf(d2);
        rm_rf(d3);
    }
}

/* ---- options ---- */

TEST(synth_refuses_bad_options_and_existing_dirs) {
    const char *d = t_tmpdir("opts");
    REQUIRE(d);
    char out[8192];
    int rc = t_sh(out, sizeof out, "%s synth --arch deepseek_v3 --preset k3-slice --out %s", t_bin(), d);
    CHECK(rc == 2 && strstr(out, "k3-slice"), "k3-slice for deepseek_v3: rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --preset k3-slice --gb 1 --out %s", t_bin(), d);
    CHECK(rc == 2 && strstr(out, "too small"), "--gb 1: rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --experts 3 --out %s", t_bin(), d);
    CHECK(rc == 2 && strstr(out, "--experts"), "--experts 3 < top-4: rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --shard-size 12Q --out %s", t_bin(), d);
    CHECK(rc == 2, "--shard-size 12Q: rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s synth --arch nope --out %s", t_bin(), d);
    CHECK(rc == 2, "--arch nope: rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s synth --arch deepseek_v3 --out %s --shard-size 50K --quiet", t_bin(), d);
    CHECK(rc == 0, "synth rc %d: %s", rc, out);
    rc = t_sh(out, sizeof out, "%s synth --arch deepseek_v3 --out %s --quiet", t_bin(), d);
    CHECK(rc == 1 && strstr(out, "--force"), "second synth into the same dir: rc %d: %s", rc, out);
    /* --force replaces the sharded checkpoint by a single file: no stale shards */
    rc = t_sh(out, sizeof out, "%s synth --arch deepseek_v3 --out %s --quiet --force && ls %s | wc -l", t_bin(), d, d);
    CHECK(rc == 0 && atoi(out) == 2, "after --force: rc %d, files: %s", rc, out);
    rm_rf(d);
}

TEST(synth_gb_sizes_experts) {
    char err[DF_ERRMSG];
    sy_opts o;
    memset(&o, 0, sizeof o);
    o.arch = SY_KIMI_K3;
    o.preset = SY_K3_SLICE;
    o.gb = 30;
    sy_plan *p;
    REQUIRE(sy_plan_new(&o, &p, err) == DF_OK, "%s", err);
    const sy_summary *s = sy_plan_summary(p);
    int64_t step = s->expert_span * s->n_moe_layers + (int64_t)s->n_moe_layers * (7168 * 2 + 4);
    CHECK(s->total_bytes <= (int64_t)30e9 && s->total_bytes > (int64_t)30e9 - step,
          "total %lld for --gb 30 (step %lld)", (long long)s->total_bytes, (long long)step);
    CHECK(s->d.vocab == 163840 && s->d.inter == 33792, "30 GB needs no shrinking (vocab %d)", s->d.vocab);
    CHECK(s->expert_span == 17547264, "expert span %lld", (long long)s->expert_span);
    sy_plan_free(p);
    /* 4 GB: the real vocab and dense layer alone are ~6 GB -> shrunk, noted */
    o.gb = 4;
    REQUIRE(sy_plan_new(&o, &p, err) == DF_OK, "%s", err);
    s = sy_plan_summary(p);
    CHECK(s->total_bytes <= (int64_t)4e9 && s->d.experts >= 16 && s->d.vocab < 163840 && s->notes[0],
          "--gb 4: %lld bytes, %d experts, vocab %d, notes '%s'", (long long)s->total_bytes, s->d.experts,
          s->d.vocab, s->notes);
    sy_plan_free(p);
    /* the full inventory: K3.md §1.3's tensor count less the 168 vision ones, 96 shards */
    memset(&o, 0, sizeof o);
    o.arch = SY_KIMI_K3;
    o.preset = SY_FULL;
    REQUIRE(sy_plan_new(&o, &p, err) == DF_OK, "%s", err);
    s = sy_plan_summary(p);
    CHECK(s->n_tensors == 497220 - 168 && s->n_shards == 96 && s->d.experts == 896 && s->n_moe_layers == 92,
          "full K3: %lld tensors, %d shards", (long long)s->n_tensors, s->n_shards);
    sy_plan_free(p);
}

/* ---- initialisation ---- */

TEST(synth_weights_have_the_planned_scale) {
    /* MXFP4 [3072, 3584] (w1) and int4 rows decode to std 1/sqrt(fan_in). */
    static const float e2m1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    sy_tensor p = {.name = "x.w1.weight_packed", .dtype = DT_U8, .gen = SY_GEN_BYTES};
    double t2 = (1.0 / 3584) / 8.5625;
    int base = (int)floor(127.0 + 0.5 * log2(t2));
    double q1 = (t2 / pow(4.0, base - 127) - 1.0) / 3.0;
    sy_tensor s = {.name = "x.w1.weight_scale", .dtype = DT_U8, .gen = SY_GEN_E8M0, .i0 = base, .i1 = lround(q1 * 256)};
    enum { R = 64, C = 3584 };
    static uint8_t pk[R * C / 2], sc[R * C / 32];
    sy_fill(&p, 3, 0, pk, sizeof pk);
    sy_fill(&s, 3, 0, sc, sizeof sc);
    double ss = 0;
    for (int i = 0; i < R * C; i++) {
        uint8_t b = pk[i / 2];
        double w = e2m1[i & 1 ? b >> 4 : b & 15] * ldexp(1.0, sc[i / 32] - 127);
        ss += w * w;
    }
    double rms = sqrt(ss / (R * C)), want = 1 / sqrt((double)C);
    CHECK(fabs(rms / want - 1) < 0.05, "mxfp4 rms %g, want %g", rms, want);
    for (size_t i = 0; i < sizeof sc; i++) CHECK(sc[i] == base || sc[i] == base + 1, "scale byte %d", sc[i]);
    /* int4: nibbles q + 8 with q in [-7, 7] */
    sy_tensor q = {.name = "x.weight_packed", .dtype = DT_I32, .gen = SY_GEN_INT4};
    static uint32_t words[4096];
    sy_fill(&q, 3, 0, words, sizeof words);
    int lo = 99, hi = -99;
    double sum = 0;
    for (int i = 0; i < 4096 * 8; i++) {
        int v = (int)((words[i / 8] >> (4 * (i % 8))) & 15) - 8;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        sum += v;
    }
    CHECK(lo == -7 && hi == 7 && fabs(sum / (4096 * 8)) < 0.1, "int4 q in [%d, %d], mean %g", lo, hi, sum / (4096 * 8));
    /* bf16 normal: mean and std as asked */
    sy_tensor n = {.name = "x.weight", .dtype = DT_BF16, .gen = SY_GEN_NORMAL, .a = 1.0f, .b = 0.25f};
    static uint16_t h[1 << 19];
    sy_fill(&n, 3, 0, h, sizeof h);
    double m = 0, v2 = 0;
    for (int i = 0; i < 1 << 19; i++) {
        uint32_t u = (uint32_t)h[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        m += f;
        v2 += (double)f * f;
    }
    m /= 1 << 19;
    double sd = sqrt(v2 / (1 << 19) - m * m);
    CHECK(fabs(m - 1) < 0.01 && fabs(sd - 0.25) < 0.01, "bf16 normal mean %g std %g", m, sd);
}

/* ---- failures ---- */

static int fail_after; /* pwrite calls left before ENOSPC */
static ssize_t failing_pwrite(int fd, const void *buf, size_t n, off_t off) {
    if (fail_after-- <= 0) {
        errno = ENOSPC;
        return -1;
    }
    return pwrite(fd, buf, n, off);
}

static ssize_t short_pwrite(int fd, const void *buf, size_t n, off_t off) {
    if (n > 1000) n = 1000;
    return pwrite(fd, buf, n, off);
}

static int failing_fdatasync(int fd) {
    (void)fd;
    errno = EIO;
    return -1;
}

TEST(synth_write_failure_leaves_no_config) {
    char err[DF_ERRMSG];
    sy_opts o;
    memset(&o, 0, sizeof o);
    o.arch = SY_KIMI_K2;
    o.threads = 2;
    sy_plan *p;
    REQUIRE(sy_plan_new(&o, &p, err) == DF_OK, "%s", err);
    sy_io io = *sy_io_default();
    io.pwrite = failing_pwrite;
    const char *d = t_tmpdir("fail");
    REQUIRE(d);
    fail_after = 40;
    df_status st = sy_write(p, d, &io, NULL, err);
    CHECK(st == DF_ERR_IO && strstr(err, "No space left") && strstr(err, "model.safetensors"),
          "status %d: %s", st, err);
    char c[700];
    snprintf(c, sizeof c, "%s/config.json", d);
    CHECK(access(c, F_OK) != 0, "config.json written after a failed write");
    /* a shard that cannot be made durable fails the same way */
    o.overwrite = 1;
    sy_plan_free(p);
    REQUIRE(sy_plan_new(&o, &p, err) == DF_OK, "%s", err);
    io.pwrite = sy_io_default()->pwrite;
    io.fdatasync = failing_fdatasync;
    st = sy_write(p, d, &io, NULL, err);
    CHECK(st == DF_ERR_IO && strstr(err, "fdatasync") && strstr(err, "model.safetensors"), "status %d: %s", st, err);
    CHECK(access(c, F_OK) != 0, "config.json written after a failed fdatasync");
    io.fdatasync = sy_io_default()->fdatasync;
    /* short writes are retried: the same bytes as plain writes */
    o.overwrite = 1;
    sy_plan_free(p);
    REQUIRE(sy_plan_new(&o, &p, err) == DF_OK, "%s", err);
    io.pwrite = short_pwrite;
    CHECK(sy_write(p, d, &io, NULL, err) == DF_OK, "%s", err);
    CHECK(access(c, F_OK) == 0, "no config.json after a good write");
    const char *d2 = t_tmpdir("fail2");
    REQUIRE(d2);
    CHECK(sy_write(p, d2, NULL, NULL, err) == DF_OK, "%s", err);
    char out[256];
    int rc = t_sh(out, sizeof out, "cmp %s/model.safetensors %s/model.safetensors", d, d2);
    CHECK(rc == 0, "short writes changed the file: %s", out);
    sy_plan_free(p);
    rm_rf(d);
    rm_rf(d2);
}

/* ---- --tokenizer: the text path on a synthetic model ---- */

/* config.json's integer key (root object, else text_config), -1 if absent. */
static int config_int(const char *dir, const char *key) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_t *j = json_load_file(path, 0, NULL);
    json_t *v = json_object_get(j, key);
    if (!v) v = json_object_get(json_object_get(j, "text_config"), key);
    int r = json_is_integer(v) ? (int)json_integer_value(v) : -1;
    json_decref(j);
    return r;
}

/* Loads dir's tokenizer and checks what a synth --tokenizer promises: vocab
 * = config's, the K3 specials at config's bos/eos/pad ids and right after
 * them, every text round-trips with ids below the ordinary ranks. */
static void check_tokenizer(const char *dir, int V, const char *eos_name) {
    char err[DF_ERRMSG];
    df_tokenizer *t;
    df_status st = df_tokenizer_load_dir(dir, &t, err);
    REQUIRE(st == DF_OK, "%s: %s", dir, err);
    CHECK(config_int(dir, "vocab_size") == V, "%s: config vocab %d", dir, config_int(dir, "vocab_size"));
    CHECK(df_tokenizer_vocab_size(t) == V, "%s: tokenizer vocab %d, want %d", dir, df_tokenizer_vocab_size(t), V);
    int R = V - 256, bos = config_int(dir, "bos_token_id"), eos = config_int(dir, "eos_token_id"),
        pad = config_int(dir, "pad_token_id");
    CHECK(df_tokenizer_special(t, "[BOS]") == bos && bos == R, "%s: [BOS] %d, config bos %d", dir,
          df_tokenizer_special(t, "[BOS]"), bos);
    CHECK(df_tokenizer_special(t, eos_name) == eos, "%s: %s %d, config eos %d", dir, eos_name,
          df_tokenizer_special(t, eos_name), eos);
    CHECK(df_tokenizer_special(t, "[PAD]") == pad && pad == V - 1, "%s: [PAD] %d, config pad %d", dir,
          df_tokenizer_special(t, "[PAD]"), pad);
    static const char *const chat[] = {"[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"};
    for (int k = 0; k < 5; k++)
        CHECK(df_tokenizer_special(t, chat[k]) == R + 1 + k, "%s: %s at %d", dir, chat[k], df_tokenizer_special(t, chat[k]));
    for (int32_t id = 0; id < V; id++)
        if (df_tokenizer_is_special(t, id) != (id >= R)) {
            CHECK(0, "%s: id %d special %d", dir, id, df_tokenizer_is_special(t, id));
            break;
        }
    static const char *const texts[] = {
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "def f(x):\n    return x * 2  # tabs\tand   spaces\n\n",
        "\xe4\xbd\xa0\xe5\xa5\xbd\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c \xe3\x81\x93\xe3\x82\x93\xe3\x81\xab\xe3\x81\xa1\xe3\x81\xaf \xf0\x9f\x98\x80\xf0\x9f\x9a\x80",
        "user text spelling <|open|> stays bytes",
    };
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        df_tokens ids = {0};
        st = df_tokenize(t, texts[k], strlen(texts[k]), 0, &ids, err);
        CHECK(st == DF_OK, "%s: tokenize: %s", dir, err);
        int ok = ids.n > 0;
        for (int i = 0; i < ids.n; i++) ok &= ids.ids[i] >= 0 && ids.ids[i] < R;
        CHECK(ok, "%s: text %zu: %d ids, some outside 0..%d", dir, k, ids.n, R - 1);
        char *back = NULL;
        size_t n = 0;
        st = df_detokenize(t, ids.ids, ids.n, 0, &back, &n, err);
        CHECK(st == DF_OK && back && n == strlen(texts[k]) && !memcmp(back, texts[k], n), "%s: text %zu round trip: %s",
              dir, k, back ? back : err);
        free(back);
        df_tokens_free(&ids);
    }
    df_tokenizer_free(t);
}

TEST(synth_tokenizer_k3_text_path) {
    char out[16384], d[256], rf[300];
    const char *td = t_tmpdir("tok-k3");
    REQUIRE(td);
    snprintf(d, sizeof d, "%s/model", td);
    snprintf(rf, sizeof rf, "%s/cl100k.tiktoken", td);
    int rc = t_sh(out, sizeof out, "gzip -dc tests/text/cl100k_base.tiktoken.gz > %s && %s synth --arch kimi_k3 --tokenizer %s --out %s",
                  rf, t_bin(), rf, d);
    REQUIRE(rc == 0, "synth rc %d: %s", rc, out);
    CHECK(strstr(out, "768 ranks") && strstr(out, "eos 770 <|end_of_msg|>"), "describe: %s", out);
    check_tokenizer(d, 1024, "<|end_of_msg|>");
    /* a cl100k source whose bytes are its first 256 ranks: the first 768 ranks, verbatim */
    rc = t_sh(out, sizeof out, "head -n 768 %s | cmp - %s/tiktoken.model && echo same", rf, d);
    CHECK(rc == 0 && strstr(out, "same"), "tiktoken.model is not cl100k's first 768 ranks: %s", out);
    /* text -> XTML template -> tokens -> model -> text */
    rc = t_sh(out, sizeof out, "%s run --model %s --prompt Hello --chat --max-new 16 --ignore-eos --stats 2>&1", t_bin(), d);
    CHECK(rc == 0 && strstr(out, "generated 16 tokens"), "run --chat rc %d: %s", rc, out);
    const char *stats = strstr(out, "prompt ");
    CHECK(stats && stats - out > 8, "run --chat printed no text before the stats: %s", out);
    /* a plain continuation (no template), sampled */
    rc = t_sh(out, sizeof out, "%s run --model %s --prompt Hello --max-new 8 --ignore-eos --temperature 0.8 --seed 3 2>/dev/null | wc -c", t_bin(), d);
    CHECK(rc == 0 && atoi(out) > 0, "run --prompt printed nothing: rc %d: %s", rc, out);
    /* chat through a pipe: one turn, then EOF */
    rc = t_sh(out, sizeof out, "printf 'Hi there\\n' | %s chat --model %s --max-new 8 2>&1", t_bin(), d);
    CHECK(rc == 0, "chat rc %d: %s", rc, out);
    /* --force again with the tokenizer: same files, a stale tokenizer.json removed */
    rc = t_sh(out, sizeof out, "touch %s/tokenizer.json && %s synth --arch kimi_k3 --tokenizer %s --out %s --force --quiet && ls %s",
              d, t_bin(), rf, d, d);
    CHECK(rc == 0 && !strstr(out, "tokenizer.json") && strstr(out, "tiktoken.model"), "after --force: rc %d: %s", rc, out);
    rm_rf(td);
}

TEST(synth_tokenizer_sources_and_families) {
    char out[16384], src[256], json[300], a[300], b[300], c[300];
    const char *td = t_tmpdir("tok-src");
    REQUIRE(td);
    snprintf(src, sizeof src, "%s/o200k.tiktoken", td);
    snprintf(json, sizeof json, "%s/ds.tokenizer.json", td);
    snprintf(a, sizeof a, "%s/linear", td);
    snprintf(b, sizeof b, "%s/k2", td);
    snprintf(c, sizeof c, "%s/k3-from-dir", td);
    int rc = t_sh(out, sizeof out, "gzip -dc tests/text/o200k_base.tiktoken.gz > %s && gzip -dc tests/text/deepseek_v3.tokenizer.json.gz > %s",
                  src, json);
    REQUIRE(rc == 0, "%s", out);
    /* a tokenizer.json source (DeepSeek-V3's: its single bytes are not its first ids) */
    rc = t_sh(out, sizeof out, "%s synth --arch kimi_linear --vocab 2048 --tokenizer %s --out %s --quiet", t_bin(), json, a);
    CHECK(rc == 0, "kimi_linear from tokenizer.json: rc %d: %s", rc, out);
    if (!rc) check_tokenizer(a, 2048, "<|end_of_msg|>");
    /* K2's eos is [EOS] (V - 255); a rank file source */
    rc = t_sh(out, sizeof out, "%s synth --arch kimi_k2 --vocab 1536 --tokenizer %s --out %s --quiet", t_bin(), src, b);
    CHECK(rc == 0, "kimi_k2 from o200k: rc %d: %s", rc, out);
    if (!rc) check_tokenizer(b, 1536, "[EOS]");
    /* a model directory source: the smaller model's ranks are the source's first ones */
    rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --vocab 768 --tokenizer %s --out %s --quiet && head -n 512 %s/tiktoken.model | cmp - %s/tiktoken.model && echo same",
              t_bin(), b, c, b, c);
    CHECK(rc == 0 && strstr(out, "same"), "kimi_k3 from a model dir: rc %d: %s", rc, out);
    if (!rc) check_tokenizer(c, 768, "<|end_of_msg|>");
    rc = t_sh(out, sizeof out, "%s run --model %s --prompt 'Say hi' --chat --max-new 6 --ignore-eos 2>&1", t_bin(), a);
    CHECK(rc == 0, "run --chat on kimi_linear: rc %d: %s", rc, out);
    rm_rf(td);
}

TEST(synth_tokenizer_refusals_write_nothing) {
    char out[8192], d[256], src[300];
    const char *td = t_tmpdir("tok-bad");
    REQUIRE(td);
    snprintf(d, sizeof d, "%s/out", td);
    snprintf(src, sizeof src, "%s/cl100k.tiktoken", td);
    int rc0 = t_sh(out, sizeof out, "gzip -dc tests/text/cl100k_base.tiktoken.gz | head -n 600 > %s", src);
    REQUIRE(rc0 == 0, "%s", out);
    static const struct {
        const char *args, *want;
        int rc;
    } cases[] = {
        {"--arch deepseek_v3 --tokenizer SRC", "Kimi families", 2},
        {"--arch kimi_k3 --vocab 300 --tokenizer SRC", "--vocab 512", 2},
        {"--arch kimi_k3 --vocab 1024 --tokenizer SRC", "use --vocab 856 or less", 2},
        {"--arch kimi_k3 --tokenizer tests/text/cl100k_base.tiktoken.gz", "gzip", 2},
        {"--arch kimi_k3 --tokenizer /nonexistent/tok", "/nonexistent/tok", 1},
        {"--arch kimi_k3 --tokenizer tests/text/corpus.json", "corpus.json", 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char args[512];
        const char *s = strstr(cases[k].args, "SRC");
        if (s) snprintf(args, sizeof args, "%.*s%s", (int)(s - cases[k].args), cases[k].args, src);
        else snprintf(args, sizeof args, "%s", cases[k].args);
        int rc = t_sh(out, sizeof out, "%s synth %s --out %s --quiet; echo rc=$?; ls %s 2>/dev/null | wc -l", t_bin(), args, d, d);
        char want_rc[16];
        snprintf(want_rc, sizeof want_rc, "rc=%d\n0", cases[k].rc);
        CHECK(rc == 0 && strstr(out, cases[k].want) && strstr(out, want_rc), "%s: %s", args, out);
    }
    /* 600 ranks are enough for --vocab 856 */
    int rc = t_sh(out, sizeof out, "%s synth --arch kimi_k3 --vocab 856 --tokenizer %s --out %s --quiet", t_bin(), src, d);
    CHECK(rc == 0, "--vocab 856 from 600 ranks: rc %d: %s", rc, out);
    if (!rc) check_tokenizer(d, 856, "<|end_of_msg|>");
    rm_rf(td);
}
