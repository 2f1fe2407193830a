/* write.c — streaming a synthetic checkpoint to disk (sy_write, sy_fill).
 *
 * Owns: the random streams (splitmix64 seeding one xoshiro256** stream per
 * 4 MiB chunk of a tensor), the value generators, the output directory, the
 * shard files, the index and config.json.
 *
 * How a shard is written: the file is created and sized with ftruncate
 * (header + data), the 8-byte length and the header go in first, then the
 * data chunks are generated and pwritten by a pool of threads pulling chunk
 * jobs from a shared counter. Each thread owns one chunk buffer, so memory
 * stays at threads x 4 MiB whatever the model size. With sparse nothing but
 * the headers (and int4 weight_shape vectors) is written and the data
 * regions stay holes (zeros on read).
 * A plan with a tokenizer (vocab.c) adds tiktoken.model and
 * tokenizer_config.json after the shards and the index.
 * config.json is written last: a failed or interrupted write leaves a
 * directory the engine refuses to open.
 *
 *   shard file:  [u64 n][header JSON, n bytes, space-padded to 8][data ...]
 *                                                   tensor t at 8 + n + t->offset
 *
 * Refuses: a directory that already holds a checkpoint unless overwrite.
 * Every I/O call goes through an sy_io table (tests inject failures).
 *
 * Sections: 1. random numbers  2. generators  3. I/O table  4. directory
 *           5. shards  6. index, tokenizer and config  7. sy_write
 */
#include "synth.h"
#include "../base/port.h"
#include "../base/err.h"
#include "../base/io.h"
#include "../base/pool.h"
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- 1. random numbers ------------------------------------------------------ */

static inline uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct { uint64_t s[4]; } rng;

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256** (Blackman & Vigna). */
static inline uint64_t next(rng *r) {
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

static uint64_t fnv1a64(const char *s) {
    uint64_t h = 14695981039346656037ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static void rng_seed(rng *r, uint64_t seed, const char *name, int64_t chunk) {
    uint64_t x = seed ^ fnv1a64(name);
    x ^= splitmix64(&x) + (uint64_t)chunk * 0xD1B54A32D192ED03ull;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static void random_bytes(rng *r, uint8_t *o, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x = next(r);
        memcpy(o + i, &x, 8);
    }
    if (i < n) {
        uint64_t x = next(r);
        memcpy(o + i, &x, (size_t)(n - i));
    }
}

/* Standard normal quantiles at (i + 0.5) / 65536: a 16-bit random index
 * gives an N(0,1) draw (tails cut at 4.3 sigma). int4_lut maps 16 random
 * bits to two int4 nibbles q + 8, q uniform in [-7, 7] (from 8 bits each). */
static float normal_lut[65536];
static uint8_t int4_lut[65536];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

/* Inverse normal CDF (P. J. Acklam's rational approximation, rel. error
 * 1.15e-9, plenty for weights stored in bf16). */
static double inv_norm(double p) {
    static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                               1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00};
    static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                               6.680131188771972e+01, -1.328068155288572e+01};
    static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                               -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00};
    static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                               3.754408661907416e+00};
    double q, r;
    if (p < 0.02425) {
        q = sqrt(-2 * log(p));
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
               ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
    }
    if (p > 1 - 0.02425) return -inv_norm(1 - p);
    q = p - 0.5;
    r = q * q;
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
           (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}

static void tables_init(void) {
    for (int i = 0; i < 65536; i++) {
        normal_lut[i] = (float)inv_norm((i + 0.5) / 65536.0);
        int lo = 1 + (((i & 0xFF) * 15) >> 8), hi = 1 + (((i >> 8) * 15) >> 8);
        int4_lut[i] = (uint8_t)(lo | hi << 4);
    }
}

/* ---- 2. generators ---------------------------------------------------------- */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (values are finite) */
    return (uint16_t)(u >> 16);
}

static inline float unit24(uint64_t r) { return (float)(r >> 40) * (1.0f / 16777216.0f); }

/* Writes v as element i of a BF16 or F32 array. */
static inline void put(void *out, st_dtype dt, int64_t i, float v) {
    if (dt == DT_BF16) {
        uint16_t h = f32_to_bf16(v);
        memcpy((uint8_t *)out + 2 * i, &h, 2);
    } else {
        memcpy((uint8_t *)out + 4 * i, &v, 4);
    }
}

void sy_fill(const sy_tensor *t, uint64_t seed, int64_t chunk, void *out, int64_t nbytes) {
    rng r;
    rng_seed(&r, seed, t->name, chunk);
    uint8_t *o = out;
    int es = dtype_size(t->dtype);
    int64_t n = nbytes / (es ? es : 1);
    switch ((sy_gen)t->gen) {
    case SY_GEN_NORMAL: {
        pthread_once(&tables_once, tables_init);
        float a = t->a, b = t->b;
        int64_t i = 0;
        if (t->dtype == DT_BF16 && n >= (1 << 18)) {
            /* Big chunks: the 65536 possible bf16 values once, then lookups
             * (the same values as the loop below). */
            uint16_t lut[65536];
            for (int k = 0; k < 65536; k++) lut[k] = f32_to_bf16(a + b * normal_lut[k]);
            uint16_t *h = out; /* chunk buffers come from malloc */
            for (; i + 4 <= n; i += 4) {
                uint64_t x = next(&r);
                h[i] = lut[x & 0xFFFF];
                h[i + 1] = lut[(x >> 16) & 0xFFFF];
                h[i + 2] = lut[(x >> 32) & 0xFFFF];
                h[i + 3] = lut[x >> 48];
            }
        }
        for (; i + 4 <= n; i += 4) {
            uint64_t x = next(&r);
            for (int k = 0; k < 4; k++) put(out, t->dtype, i + k, a + b * normal_lut[(x >> (16 * k)) & 0xFFFF]);
        }
        for (; i < n; i++) put(out, t->dtype, i, a + b * normal_lut[next(&r) >> 48]);
        break;
    }
    case SY_GEN_LOGUNIF: {
        int64_t keep = t->i0 > 0 && chunk == 0 ? t->i0 : t->i0 > 0 ? 0 : n;
        for (int64_t i = 0; i < n; i++) put(out, t->dtype, i, i < keep ? logf(t->a + (t->b - t->a) * unit24(next(&r))) : 0.0f);
        break;
    }
    case SY_GEN_BYTES:
        random_bytes(&r, o, nbytes);
        break;
    case SY_GEN_E8M0:
    {
        unsigned thr = (unsigned)t->i1;
        uint8_t base = (uint8_t)t->i0;
        random_bytes(&r, o, nbytes);
        for (int64_t i = 0; i < nbytes; i++) o[i] = (uint8_t)(base + (o[i] < thr));
        break;
    }
    case SY_GEN_INT4:
        pthread_once(&tables_once, tables_init);
        for (int64_t i = 0; i < n; i++) {
            uint64_t x = next(&r);
            uint32_t w = (uint32_t)int4_lut[x & 0xFFFF] | (uint32_t)int4_lut[(x >> 16) & 0xFFFF] << 8 |
                         (uint32_t)int4_lut[(x >> 32) & 0xFFFF] << 16 | (uint32_t)int4_lut[x >> 48] << 24;
            memcpy(o + 4 * i, &w, 4);
        }
        break;
    case SY_GEN_INT4_SCALE:
        for (int64_t i = 0; i < n; i++) put(out, DT_BF16, i, t->a * (0.75f + 0.5f * unit24(next(&r))));
        break;
    case SY_GEN_SHAPE: {
        int64_t v[2] = {t->i0, t->i1};
        memcpy(o, v, (size_t)(nbytes < 16 ? nbytes : 16));
        break;
    }
    default:
        memset(out, 0, (size_t)nbytes);
    }
}

/* ---- 3. I/O table ----------------------------------------------------------- */

static int px_open(const char *path, int flags, int mode) { return open(path, flags, mode); }
static ssize_t px_pwrite(int fd, const void *buf, size_t n, off_t off) { return pwrite(fd, buf, n, off); }
static int px_ftruncate(int fd, off_t len) { return ftruncate(fd, len); }
static int px_mkdir(const char *path, int mode) { return mkdir(path, (mode_t)mode); }

static const sy_io posix_io = {px_open, close, px_pwrite, px_ftruncate, px_mkdir, unlink, fdatasync};

const sy_io *sy_io_default(void) { return &posix_io; }

/* Writes exactly n bytes at off (retries short writes and EINTR). 0 or -1. */
static int pwrite_full(const sy_io *io, int fd, const void *buf, size_t n, int64_t off) {
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = io->pwrite(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (k == 0) errno = EIO;
            return -1;
        }
        p += k;
        n -= (size_t)k;
        off += k;
    }
    return 0;
}

/* ---- 4. directory ----------------------------------------------------------- */

static int join(char *out, size_t cap, const char *dir, const char *name) {
    size_t k = strlen(dir);
    return (size_t)snprintf(out, cap, "%s%s%s", dir, k && dir[k - 1] == '/' ? "" : "/", name) < cap ? 0 : -1;
}

/* mkdir -p. */
static df_status make_dir(const sy_io *io, const char *dir, char *err) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path)
        return df_fail(err, DF_ERR_ARG, "%s: directory name too long", dir);
    for (char *s = path + 1;; s++) {
        if (*s == '/' || *s == 0) {
            char c = *s;
            *s = 0;
            if (io->mkdir(path, 0755) != 0 && errno != EEXIST)
                return df_fail(err, DF_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
            *s = c;
            if (!c) break;
        }
    }
    struct stat stt;
    if (stat(dir, &stt) != 0 || !S_ISDIR(stt.st_mode))
        return df_fail(err, DF_ERR_IO, "%s: not a directory", dir);
    return DF_OK;
}

/* Refuses (or, with overwrite, removes) an existing checkpoint. */
static df_status clear_dir(const sy_io *io, const char *dir, int overwrite, char *err) {
    char **names = NULL;
    size_t n = 0;
    if (io_list_dir(dir, ".safetensors", &names, &n) != 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot list: %s", dir, strerror(errno));
    static const char *const extra[] = {"config.json", "model.safetensors.index.json"};
    char path[4096];
    int found = (int)n;
    for (size_t i = 0; i < 2; i++)
        if (join(path, sizeof path, dir, extra[i]) == 0 && access(path, F_OK) == 0) found++;
    df_status st = DF_OK;
    if (found && !overwrite) {
        st = df_fail(err, DF_ERR_ARG, "%s already holds a checkpoint (%zu .safetensors file%s%s); --force replaces it",
                     dir, n, n == 1 ? "" : "s", found > (int)n ? ", config.json or index" : "");
    } else if (found) {
        for (size_t i = 0; i < n + 2 && st == DF_OK; i++) {
            const char *f = i < n ? names[i] : extra[i - n];
            if (join(path, sizeof path, dir, f) != 0) continue;
            if (io->unlink(path) != 0 && errno != ENOENT)
                st = df_fail(err, DF_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
        }
    }
    io_free_names(names, n);
    return st;
}

/* Writes a whole small file. */
static df_status write_file(const sy_io *io, const char *dir, const char *name, const char *text, size_t n,
                            char *err) {
    char path[4096];
    if (join(path, sizeof path, dir, name)) return df_fail(err, DF_ERR_ARG, "%s: path too long", dir);
    int fd = io->open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return df_fail(err, DF_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    if (pwrite_full(io, fd, text, n, 0) != 0) {
        int e = errno;
        io->close(fd);
        return df_fail(err, DF_ERR_IO, "%s: write failed: %s", path, strerror(e));
    }
    if (io->close(fd) != 0) return df_fail(err, DF_ERR_IO, "%s: close failed: %s", path, strerror(errno));
    return DF_OK;
}

/* ---- 5. shards -------------------------------------------------------------- */

typedef struct {
    int64_t tensor, chunk;
} job;

typedef struct {
    const sy_plan *p;
    const sy_io *io;
    const char *dir;
    int *fds;
    int64_t *data_start;     /* per shard: 8 + header length */
    job *jobs;
    int64_t n_jobs;
    atomic_llong next;
    atomic_llong written;
    atomic_int failed;
    pthread_mutex_t mu;
    df_status st;
    char err[DF_ERRMSG];
} writer;

static void fail_once(writer *w, df_status st, const char *msg) {
    pthread_mutex_lock(&w->mu);
    if (!atomic_load(&w->failed)) {
        snprintf(w->err, sizeof w->err, "%s", msg);
        w->st = st;
        atomic_store(&w->failed, 1);
    }
    pthread_mutex_unlock(&w->mu);
}

/* One per thread: pulls chunk jobs until none are left or one failed. */
static void write_worker(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)i0; (void)i1; (void)tid;
    writer *w = ctx;
    const sy_plan *p = w->p;
    uint8_t *buf = malloc(SY_CHUNK);
    if (!buf) {
        fail_once(w, DF_ERR_NOMEM, "out of memory for a chunk buffer");
        return;
    }
    while (!atomic_load(&w->failed)) {
        int64_t j = atomic_fetch_add(&w->next, 1);
        if (j >= w->n_jobs) break;
        const sy_tensor *t = &p->t[w->jobs[j].tensor];
        int64_t off = w->jobs[j].chunk * SY_CHUNK, n = t->nbytes - off;
        if (n > SY_CHUNK) n = SY_CHUNK;
        sy_fill(t, p->o.seed, w->jobs[j].chunk, buf, n);
        if (pwrite_full(w->io, w->fds[t->shard], buf, (size_t)n, w->data_start[t->shard] + t->offset + off) != 0) {
            char msg[DF_ERRMSG];
            snprintf(msg, sizeof msg, "%.400s/%s: write of tensor '%.300s' failed: %s", w->dir,
                     p->shards[t->shard].file, t->name, strerror(errno));
            fail_once(w, DF_ERR_IO, msg);
            break;
        }
        atomic_fetch_add(&w->written, n);
    }
    free(buf);
}

/* Creates every shard, sized, with its header in place. */
static df_status open_shards(writer *w, char *err) {
    const sy_plan *p = w->p;
    for (int i = 0; i < p->s.n_shards; i++) {
        char path[4096];
        if (join(path, sizeof path, w->dir, p->shards[i].file)) return df_fail(err, DF_ERR_ARG, "%s: path too long", w->dir);
        size_t hl;
        char *h = sy_header(p, i, &hl);
        if (!h) return df_fail(err, DF_ERR_NOMEM, "out of memory for the header of %s", path);
        int fd = w->io->open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) {
            free(h);
            return df_fail(err, DF_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        }
        w->fds[i] = fd;
        w->data_start[i] = 8 + (int64_t)hl;
        uint8_t len[8];
        for (int k = 0; k < 8; k++) len[k] = (uint8_t)((uint64_t)hl >> (8 * k));
        int bad = w->io->ftruncate(fd, (off_t)(w->data_start[i] + p->shards[i].data_bytes)) != 0 ||
                  pwrite_full(w->io, fd, len, 8, 0) != 0 || pwrite_full(w->io, fd, h, hl, 8) != 0;
        free(h);
        if (bad) return df_fail(err, DF_ERR_IO, "%s: cannot write the header: %s", path, strerror(errno));
    }
    return DF_OK;
}

static df_status write_data(writer *w, char *err) {
    const sy_plan *p = w->p;
    int64_t n = 0;
    for (int64_t k = 0; k < p->n; k++) n += (p->t[p->order[k]].nbytes + SY_CHUNK - 1) / SY_CHUNK;
    w->jobs = malloc((size_t)(n ? n : 1) * sizeof *w->jobs);
    if (!w->jobs) return df_fail(err, DF_ERR_NOMEM, "out of memory for %lld chunk jobs", (long long)n);
    /* Shard by shard, in file order: each thread's writes stay mostly
     * sequential. Sparse: only the compressed-tensors weight_shape vectors,
     * which are metadata the loader checks ([0, 0] would be refused). */
    for (int64_t k = 0; k < p->n; k++) {
        int64_t ti = p->order[k], c = (p->t[ti].nbytes + SY_CHUNK - 1) / SY_CHUNK;
        if (p->o.sparse && p->t[ti].gen != SY_GEN_SHAPE) continue;
        for (int64_t i = 0; i < c; i++) w->jobs[w->n_jobs++] = (job){ti, i};
    }
    int threads = p->o.threads;
    if (threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        threads = c > 0 ? (int)c : 1;
    }
    if (threads > w->n_jobs) threads = w->n_jobs > 0 ? (int)w->n_jobs : 1;
    df_pool *pool = pool_new(threads);
    if (!pool) return df_fail(err, DF_ERR_NOMEM, "cannot start %d writer threads", threads);
    pool_for(pool, threads, 1, write_worker, w);
    pool_free(pool);
    if (atomic_load(&w->failed)) return df_fail(err, w->st, "%s", w->err);
    return DF_OK;
}

/* ---- 6. index, tokenizer and config ------------------------------------------- */

static int by_name(const void *a, const void *b, void *ctx) {
    const sy_plan *p = ctx;
    return strcmp(p->t[*(const int64_t *)a].name, p->t[*(const int64_t *)b].name);
}

/* model.safetensors.index.json: metadata.total_size and the weight_map,
 * sorted by name as transformers writes it. */
static df_status write_index(const sy_plan *p, const sy_io *io, const char *dir, char *err) {
    int64_t *idx = malloc((size_t)p->n * sizeof *idx);
    size_t cap = 128, n = 0;
    for (int64_t i = 0; i < p->n; i++) cap += strlen(p->t[i].name) + 48 + 16;
    char *s = malloc(cap);
    if (!idx || !s) {
        free(idx);
        free(s);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for the index");
    }
    for (int64_t i = 0; i < p->n; i++) idx[i] = i;
    port_qsort_r(idx, (size_t)p->n, sizeof *idx, by_name, (void *)p);
    n += (size_t)snprintf(s, cap, "{\n  \"metadata\": {\n    \"total_size\": %lld\n  },\n  \"weight_map\": {",
                          (long long)p->s.total_bytes);
    for (int64_t i = 0; i < p->n; i++) {
        const sy_tensor *t = &p->t[idx[i]];
        n += (size_t)snprintf(s + n, cap - n, "%s\n    \"%s\": \"%s\"", i ? "," : "", t->name, p->shards[t->shard].file);
    }
    n += (size_t)snprintf(s + n, cap - n, "\n  }\n}\n");
    free(idx);
    df_status st = write_file(io, dir, "model.safetensors.index.json", s, n, err);
    free(s);
    return st;
}

/* ---- 7. sy_write -------------------------------------------------------------- */

df_status sy_write(const sy_plan *p, const char *dir, const sy_io *io, int64_t *data_bytes, char *err) {
    if (data_bytes) *data_bytes = 0;
    if (!io) io = sy_io_default();
    if (!dir || !*dir) return df_fail(err, DF_ERR_ARG, "an output directory is required");
    df_status st;
    if ((st = make_dir(io, dir, err)) || (st = clear_dir(io, dir, p->o.overwrite, err))) return st;
    writer w;
    memset(&w, 0, sizeof w);
    w.p = p;
    w.io = io;
    w.dir = dir;
    int ns = p->s.n_shards;
    w.fds = malloc((size_t)(ns ? ns : 1) * sizeof *w.fds);
    w.data_start = malloc((size_t)(ns ? ns : 1) * sizeof *w.data_start);
    if (!w.fds || !w.data_start) {
        free(w.fds);
        free(w.data_start);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < ns; i++) w.fds[i] = -1;
    pthread_mutex_init(&w.mu, NULL);
    atomic_init(&w.next, 0);
    atomic_init(&w.written, 0);
    atomic_init(&w.failed, 0);
    st = open_shards(&w, err);
    if (st == DF_OK) st = write_data(&w, err);
    for (int i = 0; i < ns; i++) {
        if (w.fds[i] < 0) continue;
        /* On disk, then out of the page cache: read back, a shard sits in the
         * large folios a read makes, not the small ones the writes left
         * (io_drop_written). */
        if (st == DF_OK && io->fdatasync(w.fds[i]) != 0)
            st = df_fail(err, DF_ERR_IO, "%s/%s: fdatasync failed: %s", dir, p->shards[i].file, strerror(errno));
        if (st == DF_OK) io_drop_written(w.fds[i]);
        if (io->close(w.fds[i]) != 0 && st == DF_OK)
            st = df_fail(err, DF_ERR_IO, "%s/%s: close failed: %s", dir, p->shards[i].file, strerror(errno));
    }
    if (data_bytes) *data_bytes = atomic_load(&w.written);
    free(w.fds);
    free(w.data_start);
    free(w.jobs);
    pthread_mutex_destroy(&w.mu);
    if (st == DF_OK && ns > 1) st = write_index(p, io, dir, err);
    if (st == DF_OK && p->tok_ranks) {
        /* a tokenizer.json left from before would contradict the new files */
        char path[4096];
        if (p->o.overwrite && join(path, sizeof path, dir, "tokenizer.json") == 0 && io->unlink(path) != 0 && errno != ENOENT)
            st = df_fail(err, DF_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
        if (st == DF_OK) st = write_file(io, dir, "tiktoken.model", p->tok_ranks, p->tok_ranks_n, err);
        if (st == DF_OK)
            st = write_file(io, dir, "tokenizer_config.json", p->tok_config, strlen(p->tok_config), err);
    }
    if (st == DF_OK) st = write_file(io, dir, "config.json", p->config, strlen(p->config), err);
    return st;
}
