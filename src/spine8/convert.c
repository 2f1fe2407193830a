/* convert.c — `deltafin convert-spine`: the checkpoint's spine matrices to
 * row-wise int8, beside the checkpoint (see spine8.h for the layout).
 *
 * Owns: the plan (selected matrices grouped per layer, one output shard per
 * group), the writing of one shard (rows read, dequantised and quantised a
 * block at a time: memory stays a few row blocks plus one shard's scales),
 * resume and publication. Reads go through a df_io table, so a stream-mode
 * mirror fetches only the spine's spans.
 *
 * Crash safety: a shard is written to NAME.tmp, fsynced, read back for its
 * sha256, renamed, and only then listed in progress.json (itself replaced
 * atomically); a rerun skips the shards listed there whose files have the
 * listed size, as long as the plan (tensors, shapes and the source headers)
 * is the same. manifest.json is written last, so the engine never sees an
 * unfinished conversion. kill -9 at any point loses at most the shard being
 * written.
 *
 * Sections: plan; reading rows; one shard; progress and manifest files;
 * verify; convert.
 */
#include "spine8.h"
#include "../base/err.h"
#include "../base/pool.h"
#include "../format/config.h"
#include "../format/dtype.h"
#include "../hub/hub.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { BLOCK_BYTES = 8 << 20 }; /* source bytes per row block */

/* ---- plan ---- */

typedef struct {
    const st_tensor *t;      /* X.weight */
    const st_tensor *scale;  /* fp8: X.weight_scale_inv */
    char base[384];          /* X */
    int group;
} item;

typedef struct {
    item *items;
    int n;
    int n_groups;            /* layers + the head group */
    int br, bc;              /* fp8 block */
} plan;

static int layer_of(const char *name) {
    const char *p = strstr(name, ".layers.");
    return p ? atoi(p + 8) : -1;
}

static int by_group_name(const void *a, const void *b) {
    const item *x = a, *y = b;
    if (x->group != y->group) return x->group < y->group ? -1 : 1;
    return strcmp(x->t->name, y->t->name);
}

static df_status make_plan(st_set *st, const df_config *c, plan *p, char *err) {
    memset(p, 0, sizeof *p);
    int L = c->num_hidden_layers;
    p->n_groups = L + 1;
    p->br = c->fp8_block_rows > 0 ? c->fp8_block_rows : 128;
    p->bc = c->fp8_block_cols > 0 ? c->fp8_block_cols : 128;
    p->items = calloc((size_t)st_count(st) + 1, sizeof *p->items);
    if (!p->items) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < st_count(st); i++) {
        const st_tensor *t = st_at(st, i);
        if (!s8_selected(t->name, t)) continue;
        item *it = &p->items[p->n];
        size_t bl = strlen(t->name) - 7;
        if (bl >= sizeof it->base) continue;
        memcpy(it->base, t->name, bl);
        it->base[bl] = 0;
        it->t = t;
        if (t->dtype == DT_F8_E4M3) {
            char sn[420];
            snprintf(sn, sizeof sn, "%s.weight_scale_inv", it->base);
            it->scale = st_find(st, sn);
            int64_t sr = (t->shape[0] + p->br - 1) / p->br, sc = (t->shape[1] + p->bc - 1) / p->bc;
            if (!it->scale || it->scale->dtype != DT_F32 || it->scale->ndim != 2 || it->scale->shape[0] != sr ||
                it->scale->shape[1] != sc)
                return df_fail(err, DF_ERR_MISMATCH, "%s: fp8 tensor '%s' needs an F32 [%lld, %lld] '%s'", st_dir(st),
                               t->name, (long long)sr, (long long)sc, sn);
        }
        int l = layer_of(t->name);
        it->group = l >= 0 && l < L ? l : L;
        p->n++;
    }
    qsort(p->items, (size_t)p->n, sizeof *p->items, by_group_name);
    return DF_OK;
}

/* ---- reading rows ---- */

typedef struct {
    const df_io *io;
    st_set *st;
    int *fds;                /* per source shard, opened on first use */
} reader;

static int shard_fd(reader *r, int shard, char *err) {
    if (r->fds[shard] < 0) {
        r->fds[shard] = io_open(r->io, st_shard_path(r->st, shard), O_RDONLY | O_CLOEXEC, 0);
        if (r->fds[shard] < 0)
            df_fail(err, DF_ERR_IO, "%s: cannot open: %s", st_shard_path(r->st, shard), strerror(errno));
    }
    return r->fds[shard];
}

/* The raw bytes of rows [r0, r0+n) into raw; asks the kernel to read the
 * next block ahead while this one is quantised. */
static df_status read_rows(reader *rd, const item *it, int64_t r0, int64_t n, int64_t next_n, void *raw, char *err) {
    const st_tensor *t = it->t;
    int64_t cols = t->shape[1], es = dtype_size(t->dtype);
    int fd = shard_fd(rd, t->shard, err);
    if (fd < 0) return DF_ERR_IO;
    if (next_n > 0)
        posix_fadvise(fd, t->offset + (r0 + n) * cols * es, next_n * cols * es, POSIX_FADV_WILLNEED);
    if (io_pread_full(rd->io, fd, raw, (size_t)(n * cols * es), t->offset + r0 * cols * es) != 0)
        return df_fail(err, DF_ERR_IO, "%s: reading '%s' rows %lld..%lld failed: %s", st_shard_path(rd->st, t->shard),
                       t->name, (long long)r0, (long long)(r0 + n), strerror(errno));
    return DF_OK;
}

/* fp8: the block-scale rows covering rows [r0, r0+n) into sc. */
static df_status read_fp8_scales(reader *rd, const plan *p, const item *it, int64_t r0, int64_t n, float *sc, char *err) {
    const st_tensor *s = it->scale;
    int64_t b0 = r0 / p->br, b1 = (r0 + n - 1) / p->br, w = s->shape[1];
    int fd = shard_fd(rd, s->shard, err);
    if (fd < 0) return DF_ERR_IO;
    if (io_pread_full(rd->io, fd, sc, (size_t)((b1 - b0 + 1) * w * 4), s->offset + b0 * w * 4) != 0)
        return df_fail(err, DF_ERR_IO, "%s: reading '%s' failed: %s", st_shard_path(rd->st, s->shard), s->name,
                       strerror(errno));
    return DF_OK;
}

/* ---- one shard ---- */

/* One row block: decode each row to f32 in the thread's scratch, quantise. */
typedef struct {
    const uint8_t *raw;      /* the block's rows as stored */
    st_dtype dt;
    int64_t cols, r0;        /* r0: the block's first row in the matrix */
    const float *fp8;        /* fp8: block-scale rows from block row r0 / br */
    int br, bc;
    int64_t fp8_w;
    float *scratch;          /* [threads][cols] */
    int8_t *q;
    float *scale;
} quant_job;

static void quant_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    quant_job *j = ctx;
    int64_t C = j->cols;
    float *w = j->scratch + (int64_t)tid * C;
    for (int64_t r = r0; r < r1; r++) {
        switch (j->dt) {
        case DT_BF16: {
            const uint16_t *h = (const uint16_t *)j->raw + r * C;
            for (int64_t c = 0; c < C; c++) w[c] = bf16_to_f32(h[c]);
            break;
        }
        case DT_F16: {
            const uint16_t *h = (const uint16_t *)j->raw + r * C;
            for (int64_t c = 0; c < C; c++) w[c] = f16_to_f32(h[c]);
            break;
        }
        case DT_F32: memcpy(w, j->raw + r * C * 4, (size_t)C * 4); break;
        default: { /* fp8 e4m3 with block scales */
            const uint8_t *b = j->raw + r * C;
            const float *sr = j->fp8 + ((j->r0 + r) / j->br - j->r0 / j->br) * j->fp8_w;
            for (int64_t c = 0; c < C; c++) w[c] = fp8_e4m3_to_f32(b[c]) * sr[c / j->bc];
            break;
        }
        }
        j->scale[r] = s8_quantize_row(w, C, j->q + r * C);
    }
}

static df_status write_all(int fd, const void *b, size_t n, int64_t off, const char *path, char *err) {
    const uint8_t *p = b;
    while (n) {
        ssize_t k = pwrite(fd, p, n, off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return df_fail(err, DF_ERR_IO, "%s: write failed: %s", path, k < 0 ? strerror(errno) : "no space");
        p += k;
        n -= (size_t)k;
        off += k;
    }
    return DF_OK;
}

/* sha256 of a whole file of `size` bytes (hub_sha256_file, src/hub/spans.c). */
static df_status file_sha256(const char *path, int64_t size, char hex[65], char *err) {
    if (hub_sha256_file(path, size, hex) != 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot read back: %s", path, strerror(errno));
    return DF_OK;
}

typedef struct {
    reader *rd;
    const plan *p;
    df_pool *pool;
    const s8_opts *o;
    int64_t done, total;     /* source bytes, for progress */
    int shard_no, n_shards;
} ctx_t;

/* Writes the shard of items [a, b) to path (via path.tmp); *size and hex. */
static df_status write_shard(ctx_t *x, int a, int b, const char *path, int64_t *size, char hex[65], char *err) {
    const plan *p = x->p;
    /* header: every scale first (F32 [rows]), then every int8 matrix */
    json_t *h = json_object();
    int64_t off = 0, scale_total = 0;
    for (int i = a; i < b; i++) scale_total += p->items[i].t->shape[0] * 4;
    int64_t data_off = scale_total;
    for (int i = a; i < b; i++) {
        const st_tensor *t = p->items[i].t;
        char nm[420];
        int64_t rows = t->shape[0], cols = t->shape[1];
        snprintf(nm, sizeof nm, "%s.weight_scale", p->items[i].base);
        json_object_set_new(h, nm, json_pack("{s:s, s:[I], s:[I,I]}", "dtype", "F32", "shape", (json_int_t)rows,
                                             "data_offsets", (json_int_t)off, (json_int_t)(off + rows * 4)));
        off += rows * 4;
        snprintf(nm, sizeof nm, "%s.weight", p->items[i].base);
        json_object_set_new(h, nm, json_pack("{s:s, s:[I,I], s:[I,I]}", "dtype", "I8", "shape", (json_int_t)rows,
                                             (json_int_t)cols, "data_offsets", (json_int_t)data_off,
                                             (json_int_t)(data_off + rows * cols)));
        data_off += rows * cols;
    }
    json_object_set_new(h, "__metadata__", json_pack("{s:s, s:s}", "format", "pt", "deltafin", "int8-spine v1"));
    char *ht = json_dumps(h, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(h);
    if (!ht) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    /* the header padded with spaces so the data begins on ST_DATA_ALIGN:
     * the scales (rows x 4 bytes) and the int8 matrices then lie on lines
     * wherever rows and columns are multiples of 32 and 128 */
    size_t hl = strlen(ht), pad = (ST_DATA_ALIGN - (8 + hl) % ST_DATA_ALIGN) % ST_DATA_ALIGN;
    char tmp[4500];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        free(ht);
        return df_fail(err, DF_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    }
    uint8_t lb[8];
    uint64_t hn = hl + pad;
    for (int i = 0; i < 8; i++) lb[i] = (uint8_t)(hn >> (8 * i));
    char *hb = malloc(hn);
    df_status st = hb ? DF_OK : df_fail(err, DF_ERR_NOMEM, "out of memory");
    if (st == DF_OK) {
        memcpy(hb, ht, hl);
        memset(hb + hl, ' ', pad);
        st = write_all(fd, lb, 8, 0, tmp, err);
        if (st == DF_OK) st = write_all(fd, hb, hn, 8, tmp, err);
    }
    free(hb);
    free(ht);
    int64_t base = 8 + (int64_t)hn;
    /* matrices: row blocks read, dequantised and quantised; scales written
     * once a matrix is done */
    void *raw = NULL;
    float *w = NULL, *sc = NULL, *f8 = NULL;
    int8_t *q = NULL;
    int64_t soff = 0, doff = scale_total, T = pool_size(x->pool);
    for (int i = a; i < b && st == DF_OK; i++) {
        const item *it = &p->items[i];
        int64_t rows = it->t->shape[0], cols = it->t->shape[1], es = dtype_size(it->t->dtype);
        int64_t blk = BLOCK_BYTES / (cols * es);
        if (blk < 1) blk = 1;
        if (blk > rows) blk = rows;
        free(raw); free(w); free(q); free(sc); free(f8);
        raw = malloc((size_t)(blk * cols * es));
        w = malloc((size_t)(T * cols) * sizeof(float));
        q = malloc((size_t)(blk * cols));
        sc = malloc((size_t)rows * sizeof(float));
        f8 = it->scale ? malloc((size_t)((blk / p->br + 2) * it->scale->shape[1]) * sizeof(float)) : NULL;
        if (!raw || !w || !q || !sc || (it->scale && !f8)) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); break; }
        for (int64_t r0 = 0; r0 < rows && st == DF_OK; r0 += blk) {
            int64_t n = rows - r0 < blk ? rows - r0 : blk, next = rows - r0 - n < blk ? rows - r0 - n : blk;
            if ((st = read_rows(x->rd, it, r0, n, next, raw, err)) != DF_OK) break;
            if (it->scale && (st = read_fp8_scales(x->rd, p, it, r0, n, f8, err)) != DF_OK) break;
            quant_job j = {raw, it->t->dtype, cols, r0, f8, p->br, p->bc, it->scale ? it->scale->shape[1] : 0, w, q, sc + r0};
            pool_for(x->pool, n, 4, quant_rows, &j);
            st = write_all(fd, q, (size_t)(n * cols), base + doff + r0 * cols, tmp, err);
            x->done += n * cols * es;
            if (x->o->progress) x->o->progress(x->o->progress_ctx, x->done, x->total, x->shard_no, x->n_shards);
        }
        if (st == DF_OK) st = write_all(fd, sc, (size_t)rows * 4, base + soff, tmp, err);
        soff += rows * 4;
        doff += rows * cols;
    }
    free(raw); free(w); free(q); free(sc); free(f8);
    if (st == DF_OK && fsync(fd) != 0) st = df_fail(err, DF_ERR_IO, "%s: fsync: %s", tmp, strerror(errno));
    if (st == DF_OK) io_drop_written(fd);
    close(fd);
    *size = base + doff;
    /* Read back from the disk; the spine then sits in the page cache in the
     * large folios a read makes, not the small ones the writes left. */
    if (st == DF_OK) st = file_sha256(tmp, *size, hex, err);
    if (st == DF_OK && rename(tmp, path) != 0) st = df_fail(err, DF_ERR_IO, "%s: rename: %s", path, strerror(errno));
    if (st != DF_OK) unlink(tmp);
    return st;
}

/* ---- progress and manifest files ---- */

/* Writes j to dir/name through a temporary file, fsynced, renamed. */
static df_status put_json(const char *dir, const char *name, json_t *j, char *err) {
    char p[4300], tmp[4400];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", p);
    if (json_dump_file(j, tmp, JSON_INDENT(1) | JSON_SORT_KEYS) != 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot write: %s", tmp, strerror(errno));
    int fd = open(tmp, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) { fsync(fd); close(fd); }
    if (rename(tmp, p) != 0) return df_fail(err, DF_ERR_IO, "%s: rename: %s", p, strerror(errno));
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) { fsync(fd); close(fd); }
    return DF_OK;
}

/* The plan's identity: tensor names, shapes, dtypes and the source headers. */
static void plan_id(const plan *p, json_t *source, char hex[65]) {
    hub_sha256 c;
    hub_sha256_init(&c);
    for (int i = 0; i < p->n; i++) {
        char line[600];
        int n = snprintf(line, sizeof line, "%s %d %lld %lld %d\n", p->items[i].t->name, (int)p->items[i].t->dtype,
                         (long long)p->items[i].t->shape[0], (long long)p->items[i].t->shape[1], p->items[i].group);
        hub_sha256_update(&c, line, (size_t)n);
    }
    char *s = json_dumps(source, JSON_COMPACT | JSON_SORT_KEYS);
    if (s) hub_sha256_update(&c, s, strlen(s));
    free(s);
    hub_sha256_hex(&c, hex);
}

/* ---- verify ---- */

static df_status verify(const char *out, s8_report *r, char *err) {
    char p[4300];
    snprintf(p, sizeof p, "%s/%s", out, S8_MANIFEST);
    json_t *m = json_load_file(p, 0, NULL);
    if (!m) return df_fail(err, DF_ERR_IO, "%s: no manifest: the spine was not converted (or not completely)", p);
    df_status st = DF_OK;
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(m, "shards"), i, v) {
        const char *f = json_string_value(json_object_get(v, "file")), *want = json_string_value(json_object_get(v, "sha256"));
        if (!f || !want || strchr(f, '/')) { st = df_fail(err, DF_ERR_FORMAT, "%s: shard entry %zu is malformed", p, i); break; }
        char path[4400], hex[65] = "";
        snprintf(path, sizeof path, "%s/%s", out, f);
        struct stat sb;
        if (stat(path, &sb) != 0) { st = df_fail(err, DF_ERR_IO, "%s: %s", path, strerror(errno)); break; }
        if ((st = file_sha256(path, (int64_t)sb.st_size, hex, err)) != DF_OK) break;
        if (strcmp(hex, want) != 0) {
            st = df_fail(err, DF_ERR_MISMATCH, "%s: sha256 %s, the manifest says %s: the file is damaged; convert again (--force)",
                         path, hex, want);
            break;
        }
        r->n_shards++;
    }
    json_decref(m);
    return st;
}

/* ---- convert ---- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

df_status s8_convert(const char *model_dir, const s8_opts *o, s8_report *r, char *err) {
    memset(r, 0, sizeof *r);
    double t0 = now_s();
    char out[4096];
    snprintf(out, sizeof out, "%s", o->out && *o->out ? o->out : "");
    if (!*out) snprintf(out, sizeof out, "%s/%s", model_dir, S8_DIR);
    if (o->verify) return verify(out, r, err);
    const df_io *io = o->io ? o->io : df_io_default();
    df_config c;
    df_status st = cfg_load(model_dir, io, &c, err);
    if (st != DF_OK) return st;
    st_set *set = NULL;
    if ((st = st_open_dir(model_dir, io, 0, &set, err)) != DF_OK) return st;
    plan p;
    memset(&p, 0, sizeof p);
    int *groups = NULL, ng = 0;
    df_pool *pool = NULL;
    char id[65], mp[4300], pp[4300];
    struct stat sb;
    json_t *done_map = NULL;
    reader rd = {io, set, NULL};
    json_t *source = json_array(), *progress = NULL, *shards = json_array(), *wmap = json_object();
    if ((st = make_plan(set, &c, &p, err)) != DF_OK) goto done;
    r->n_tensors = p.n;
    if (p.n == 0) { st = df_fail(err, DF_ERR_UNSUPPORTED, "%s: no spine matrix to convert", model_dir); goto done; }
    for (int s = 0; s < st_n_shards(set); s++) {
        int64_t size = 0;
        char hex[65] = "";
        const char *path = st_shard_path(set, s), *slash = strrchr(path, '/');
        if ((st = s8_header_hash(io, path, &size, hex, err)) != DF_OK) goto done;
        json_array_append_new(source, json_pack("{s:s, s:I, s:s}", "file", slash ? slash + 1 : path, "size",
                                                (json_int_t)size, "header_sha256", hex));
    }
    /* shards: one per group that has matrices */
    groups = malloc((size_t)(p.n + 1) * sizeof(int));
    if (!groups) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    for (int i = 0; i < p.n; i++) {
        r->in_bytes += p.items[i].t->nbytes;
        r->out_bytes += p.items[i].t->shape[0] * (p.items[i].t->shape[1] + 4);
        if (i == 0 || p.items[i].group != p.items[i - 1].group) groups[ng++] = i;
    }
    r->n_shards = ng;
    if (o->dry_run) goto done;
    plan_id(&p, source, id);
    snprintf(mp, sizeof mp, "%s/%s", out, S8_MANIFEST);
    if (stat(mp, &sb) == 0 && !o->force) {
        json_t *m = json_load_file(mp, 0, NULL);
        const char *old = m ? json_string_value(json_object_get(m, "plan_sha256")) : NULL;
        int same = old && strcmp(old, id) == 0;
        json_decref(m);
        if (same) { r->shards_skipped = ng; goto done; } /* already converted */
        st = df_fail(err, DF_ERR_ARG, "%s: a conversion of another checkpoint state is there; use --force to replace it", out);
        goto done;
    }
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        st = df_fail(err, DF_ERR_IO, "%s: cannot create: %s", out, strerror(errno));
        goto done;
    }
    if (o->force) unlink(mp);
    /* resume: shards a previous run finished with the same plan */
    snprintf(pp, sizeof pp, "%s/progress.json", out);
    progress = json_load_file(pp, 0, NULL);
    const char *pid = progress ? json_string_value(json_object_get(progress, "plan_sha256")) : NULL;
    if (!pid || strcmp(pid, id) != 0 || o->force) {
        json_decref(progress);
        progress = json_pack("{s:s, s:{}}", "plan_sha256", id, "done");
    }
    done_map = json_object_get(progress, "done");
    rd.fds = malloc((size_t)st_n_shards(set) * sizeof(int));
    pool = pool_new(o->threads > 0 ? o->threads : (int)(sysconf(_SC_NPROCESSORS_ONLN) > 0 ? sysconf(_SC_NPROCESSORS_ONLN) : 1));
    if (!rd.fds || !pool) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); goto done; }
    for (int s = 0; s < st_n_shards(set); s++) rd.fds[s] = -1;
    ctx_t x = {&rd, &p, pool, o, 0, r->in_bytes, 0, ng};
    json_t *idx, *m;
    for (int g = 0; g < ng; g++) {
        int a = groups[g], b = g + 1 < ng ? groups[g + 1] : p.n;
        char file[64], path[4400], hex[65] = "";
        snprintf(file, sizeof file, "spine-%05d.safetensors", p.items[a].group);
        snprintf(path, sizeof path, "%s/%s", out, file);
        int64_t size = 0;
        json_t *d = json_object_get(done_map, file);
        x.shard_no = g;
        if (d && stat(path, &sb) == 0 && (int64_t)sb.st_size == json_integer_value(json_object_get(d, "size"))) {
            size = (int64_t)sb.st_size;
            snprintf(hex, sizeof hex, "%s", json_string_value(json_object_get(d, "sha256")));
            r->shards_skipped++;
            for (int i = a; i < b; i++) x.done += p.items[i].t->nbytes;
        } else {
            if ((st = write_shard(&x, a, b, path, &size, hex, err)) != DF_OK) goto done;
            json_object_set_new(done_map, file, json_pack("{s:I, s:s}", "size", (json_int_t)size, "sha256", hex));
            if ((st = put_json(out, "progress.json", progress, err)) != DF_OK) goto done;
        }
        json_array_append_new(shards, json_pack("{s:s, s:I, s:s, s:i}", "file", file, "size", (json_int_t)size,
                                                "sha256", hex, "tensors", 2 * (b - a)));
        for (int i = a; i < b; i++) {
            char nm[420];
            snprintf(nm, sizeof nm, "%s.weight", p.items[i].base);
            json_object_set_new(wmap, nm, json_string(file));
            snprintf(nm, sizeof nm, "%s.weight_scale", p.items[i].base);
            json_object_set_new(wmap, nm, json_string(file));
        }
        if (o->progress) o->progress(o->progress_ctx, x.done, x.total, g + 1, ng);
    }
    /* publish: the index, then the manifest (last) */
    idx = json_pack("{s:{s:I}, s:O}", "metadata", "total_size", (json_int_t)r->out_bytes, "weight_map", wmap);
    st = put_json(out, "model.safetensors.index.json", idx, err);
    json_decref(idx);
    if (st != DF_OK) goto done;
    m = json_pack("{s:s, s:i, s:s, s:s, s:O, s:O, s:i, s:I, s:I}", "format", "deltafin-int8-spine", "version", 1,
                          "scheme", "row-wise symmetric int8, f32 scale per row (scale = max|row| / 127)",
                          "plan_sha256", id, "source", source, "shards", shards, "tensors", p.n, "in_bytes",
                          (json_int_t)r->in_bytes, "out_bytes", (json_int_t)r->out_bytes);
    st = put_json(out, S8_MANIFEST, m, err);
    json_decref(m);
    if (st == DF_OK) unlink(pp);
done:
    r->seconds = now_s() - t0;
    if (rd.fds)
        for (int s = 0; s < st_n_shards(set); s++)
            if (rd.fds[s] >= 0) io_close(io, rd.fds[s]);
    free(rd.fds);
    pool_free(pool);
    free(p.items);
    free(groups);
    json_decref(source);
    json_decref(progress);
    json_decref(shards);
    json_decref(wmap);
    st_close(set);
    return st;
}
