/* safetensors.c — sharded safetensors reader (prefix st_).
 *
 * Owns: the st_set of one model directory — its shard files (descriptors and,
 * with use_mmap, read-only shared mappings), every tensor's description, the
 * name arena, the name -> tensor hash table, and (without mmap) the per-tensor
 * buffers st_data reads on first use.
 * Refuses: anything that is not provably inside its shard. Each header is
 * checked in full before a byte of data is trusted: header length inside the
 * file and below 100 MB, known dtypes, non-negative shapes, offsets inside the
 * data section, sizes equal to shape x dtype, no two tensors sharing bytes,
 * no tensor name in two shards, and (with an index) every shard present and
 * every tensor where the index says it is. It never converts or interprets
 * tensor bytes (weight.c does that).
 *
 * Memory, for K3's ~500k tensors: one st_tensor each (~100 B), the names
 * packed in an arena of 1 MB chunks (~35 MB), and an open-addressing table of
 * uint64 slots (hash and index) at load <= 1/2 (8 MB) plus one 32-bit hash
 * per tensor.
 *
 *   st_set
 *   ├── shards[]   path, fd, size, map (or NULL)
 *   ├── tensors[]  st_tensor {name -> arena, dtype, shape, shard, offset}
 *   ├── hashes[]   FNV-1a of each name (speeds probing and rehashing)
 *   ├── slots[]    0 = empty, else hash << 32 | (tensor index + 1)
 *   └── cache[]    pread mode only: malloc'd bytes per tensor, NULL until read
 *
 * Thread safety: after st_open_dir returns, st_find/st_at/st_count are safe
 * from any thread; st_data in pread mode fills a cache and must be called
 * from one thread at a time.
 *
 * Sections: 1. set, arena and hash table  2. one shard's header
 *           3. opening a directory (index or glob)  3b. a set from metadata
 *           checked before (st_begin..st_end, for st_cache.c)  4. data access
 *           5. queries
 */
#include "safetensors.h"
#include "../base/err.h"
#include "../base/mem.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define ST_MAX_HEADER ((int64_t)100 << 20)  /* a larger header is refused */
#define ST_MAX_INDEX ((size_t)512 << 20)    /* model.safetensors.index.json */
#define ARENA_CHUNK ((size_t)1 << 20)
#define INDEX_NAME "model.safetensors.index.json"

/* ---- 1. set, arena and hash table ---------------------------------------- */

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    char data[];
} arena_chunk;

typedef struct {
    char *path;      /* dir/file */
    int fd;          /* -1 when closed */
    int64_t size;    /* file size in bytes */
    int64_t data_start; /* 8 + header length: where tensor offsets may begin */
    void *map;       /* whole file, read-only; NULL without mmap */
} st_shard;

struct st_set {
    const df_io *io;
    int use_mmap;
    char *dir;
    st_shard *shards;
    int n_shards, cap_shards;
    st_tensor *tensors;
    uint32_t *hashes;   /* per tensor */
    int64_t n_tensors, cap_tensors;
    uint64_t *slots;    /* open addressing; 0 = empty, else hash << 32 | (index + 1) */
    uint64_t n_slots;   /* power of two */
    void **cache;       /* pread mode: per-tensor buffers */
    /* values of tiny tensors (<= ST_SMALL bytes, e.g. int4 weight_shape)
     * that the metadata cache carries, so binding reads no page of the
     * shard for them: small[i] indexes small_vals, -1 none; NULL: none */
    int32_t *small;
    uint8_t (*small_vals)[ST_SMALL];
    int64_t *small_of;  /* while pushing: the tensor of each value */
    int64_t n_small_idx; /* entries of small[]: tensors added later (st_add_dir) have none */
    int64_t n_small, cap_small;
    arena_chunk *arena;
    int64_t total_bytes;
    /* while st_add_dir reads an overlay: the folder its shards are in and
     * the prefix its tensor names get (NULL / "" otherwise) */
    const char *shard_dir;
    const char *prefix;
};

static uint32_t fnv1a(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) {
        h ^= (uint8_t)*s;
        h *= 16777619u;
    }
    return h;
}

static const char *arena_strdup(st_set *s, const char *str) {
    size_t n = strlen(str) + 1;
    arena_chunk *c = s->arena;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > ARENA_CHUNK ? n : ARENA_CHUNK;
        c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->next = s->arena;
        c->used = 0;
        c->cap = cap;
        s->arena = c;
    }
    char *p = c->data + c->used;
    memcpy(p, str, n);
    c->used += n;
    return p;
}

/* The table indexes by FNV-1a's low bits unmixed: names that differ in one
 * digit ("...experts.17.w1" / "...experts.18.w1") land near each other, so
 * the lookups of one layer's experts, made in order, walk a few cache lines
 * of slots instead of one random line each (mixing the bits, e.g. with
 * murmur3's finaliser, made opening the full-size K3 twice as slow). Each
 * slot holds the hash beside the index, so a probe reads no tensor but the
 * one whose hash matches. */
#define SLOT_OF(h) (h)
static int64_t lookup(const st_set *s, const char *name, uint32_t h) {
    if (!s->n_slots) return -1;
    uint64_t mask = s->n_slots - 1;
    for (uint64_t i = SLOT_OF(h) & mask;; i = (i + 1) & mask) {
        uint64_t v = s->slots[i];
        if (!v) return -1;
        if ((uint32_t)(v >> 32) != h) continue;
        int64_t t = (int64_t)(uint32_t)v - 1;
        if (strcmp(s->tensors[t].name, name) == 0) return t;
    }
}

static void slot_put(uint64_t *slots, uint64_t n_slots, uint32_t h, int64_t idx) {
    uint64_t mask = n_slots - 1;
    uint64_t i = SLOT_OF(h) & mask;
    while (slots[i]) i = (i + 1) & mask;
    slots[i] = (uint64_t)h << 32 | (uint32_t)(idx + 1);
}

/* Keeps the load factor at or below 1/2 for n tensors. 0 or -1 (no memory). */
static int table_reserve(st_set *s, int64_t n) {
    if ((uint64_t)n * 2 <= s->n_slots) return 0;
    uint64_t ns = s->n_slots ? s->n_slots : 1024;
    while ((uint64_t)n * 2 > ns) ns *= 2;
    uint64_t *slots = calloc(ns, sizeof *slots);
    if (!slots) return -1;
    for (int64_t t = 0; t < s->n_tensors; t++) slot_put(slots, ns, s->hashes[t], t);
    free(s->slots);
    s->slots = slots;
    s->n_slots = ns;
    return 0;
}

static void close_shard(const df_io *io, st_shard *sh) {
    if (sh->map) io_munmap(io, sh->map, (size_t)sh->size);
    if (sh->fd >= 0) io_close(io, sh->fd);
    free(sh->path);
    sh->map = NULL;
    sh->fd = -1;
    sh->path = NULL;
}

/* A tensor read into memory (no mmap) gets a buffer of 2 MB pages from this
 * size on (mem_huge_alloc), else aligned_alloc's. */
static int huge_buffer(const st_tensor *t) { return t->nbytes >= ((int64_t)2 << 20); }

/* The buffer's bytes: the tensor's, up to a whole ST_DATA_ALIGN. */
static size_t buffer_bytes(const st_tensor *t) {
    return ((size_t)t->nbytes + ST_DATA_ALIGN - 1) / ST_DATA_ALIGN * ST_DATA_ALIGN;
}

static void free_buffer(const st_tensor *t, void *buf) {
    if (!buf) return;
    if (huge_buffer(t)) mem_huge_free(buf, buffer_bytes(t));
    else free(buf);
}

void st_close(st_set *s) {
    if (!s) return;
    for (int i = 0; i < s->n_shards; i++) close_shard(s->io, &s->shards[i]);
    free(s->shards);
    if (s->cache)
        for (int64_t t = 0; t < s->n_tensors; t++) free_buffer(&s->tensors[t], s->cache[t]);
    free(s->cache);
    free(s->tensors);
    free(s->hashes);
    free(s->slots);
    free(s->small);
    free(s->small_vals);
    free(s->small_of);
    while (s->arena) {
        arena_chunk *next = s->arena->next;
        free(s->arena);
        s->arena = next;
    }
    free(s->dir);
    free(s);
}

char *st_join_path(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t k = a;
    if (a && dir[a - 1] != '/') p[k++] = '/';
    memcpy(p + k, name, b + 1);
    return p;
}

/* ---- 2. one shard's header ------------------------------------------------ */

/* Names the safetensors format defines but this build cannot read: such a
 * tensor is valid input we refuse (UNSUPPORTED), unlike a made-up dtype. */
static int spec_dtype(const char *d) {
    static const char *const names[] = {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "U16", "U32",
                                        "U64", "C64", "F8_E4M3FNUZ", "F8_E5M2FNUZ"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(d, names[i]) == 0) return 1;
    return 0;
}

typedef struct { int64_t begin, end; int64_t idx; } span;

static int by_begin(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

static const char *jtype(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

/* Parses one tensor entry of a shard header into t (name not set). */
static df_status parse_entry(const char *path, const char *name, json_t *v, int64_t data_size,
                             int64_t data_start, st_tensor *t, char *err) {
    if (!json_is_object(v))
        return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s': header entry is %s, expected an object",
                       path, name, jtype(v));
    json_t *jd = json_object_get(v, "dtype");
    json_t *js = json_object_get(v, "shape");
    json_t *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd))
        return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s': 'dtype' missing or not a string", path,
                       name);
    const char *dn = json_string_value(jd);
    t->dtype = dtype_from_name(dn);
    if (t->dtype == DT_UNKNOWN) {
        if (spec_dtype(dn))
            return df_fail(err, DF_ERR_UNSUPPORTED,
                           "%s: tensor '%s' has dtype %s, which this build does not read", path,
                           name, dn);
        return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s' has unknown dtype '%s'", path, name,
                       dn);
    }
    if (!json_is_array(js))
        return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s': 'shape' missing or not an array", path,
                       name);
    size_t nd = json_array_size(js);
    if (nd > ST_MAX_DIMS)
        return df_fail(err, DF_ERR_UNSUPPORTED, "%s: tensor '%s' has %zu dimensions (at most %d)",
                       path, name, nd, ST_MAX_DIMS);
    t->ndim = (int)nd;
    int64_t nelem = 1;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(js, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return df_fail(err, DF_ERR_FORMAT,
                           "%s: tensor '%s': shape[%zu] must be a non-negative integer", path, name,
                           i);
        int64_t x = (int64_t)json_integer_value(d);
        t->shape[i] = x;
        if (x && nelem > (INT64_C(1) << 60) / x)
            return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s': shape is absurdly large", path,
                           name);
        nelem *= x;
    }
    for (size_t i = nd; i < ST_MAX_DIMS; i++) t->shape[i] = 0;
    if (!json_is_array(jo) || json_array_size(jo) != 2 ||
        !json_is_integer(json_array_get(jo, 0)) || !json_is_integer(json_array_get(jo, 1)))
        return df_fail(err, DF_ERR_FORMAT,
                       "%s: tensor '%s': 'data_offsets' must be an array of two integers", path,
                       name);
    int64_t b = (int64_t)json_integer_value(json_array_get(jo, 0));
    int64_t e = (int64_t)json_integer_value(json_array_get(jo, 1));
    if (b < 0 || e < b)
        return df_fail(err, DF_ERR_FORMAT,
                       "%s: tensor '%s' data_offsets [%lld, %lld] must satisfy 0 <= begin <= end",
                       path, name, (long long)b, (long long)e);
    if (e > data_size)
        return df_fail(err, DF_ERR_FORMAT,
                       "%s: tensor '%s' data_offsets [%lld, %lld] end past the data section "
                       "(%lld bytes)",
                       path, name, (long long)b, (long long)e, (long long)data_size);
    int64_t want = nelem * dtype_size(t->dtype);
    if (e - b != want) {
        char sh[160];
        int k = snprintf(sh, sizeof sh, "[");
        for (int i = 0; i < t->ndim && k < (int)sizeof sh - 24; i++)
            k += snprintf(sh + k, sizeof sh - (size_t)k, "%s%lld", i ? ", " : "",
                          (long long)t->shape[i]);
        snprintf(sh + k, sizeof sh - (size_t)k, "]");
        return df_fail(err, DF_ERR_FORMAT,
                       "%s: tensor '%s' data_offsets [%lld, %lld] hold %lld bytes, expected %lld "
                       "(shape %s x %s)",
                       path, name, (long long)b, (long long)e, (long long)(e - b),
                       (long long)want, sh, dtype_name(t->dtype));
    }
    t->nbytes = want;
    t->offset = data_start + b;
    return DF_OK;
}

static df_status add_tensor(st_set *s, const char *name, const st_tensor *t, char *err) {
    char full[1024];
    if (s->prefix && *s->prefix) {
        if ((size_t)snprintf(full, sizeof full, "%s%s", s->prefix, name) >= sizeof full)
            return df_fail(err, DF_ERR_FORMAT, "%s: tensor name too long: '%.64s...'", s->shards[t->shard].path, name);
        name = full;
    }
    uint32_t h = fnv1a(name);
    int64_t prev = lookup(s, name, h);
    if (prev >= 0)
        return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s' is also in %s",
                       s->shards[t->shard].path, name, s->shards[s->tensors[prev].shard].path);
    if (s->n_tensors == s->cap_tensors) {
        int64_t cap = s->cap_tensors ? s->cap_tensors * 2 : 1024;
        st_tensor *nt = realloc(s->tensors, (size_t)cap * sizeof *nt);
        if (!nt) return df_fail(err, DF_ERR_NOMEM, "out of memory for %lld tensors", (long long)cap);
        s->tensors = nt;
        uint32_t *nh = realloc(s->hashes, (size_t)cap * sizeof *nh);
        if (!nh) return df_fail(err, DF_ERR_NOMEM, "out of memory for %lld tensors", (long long)cap);
        s->hashes = nh;
        s->cap_tensors = cap;
    }
    if (s->n_tensors >= (int64_t)UINT32_MAX - 1)
        return df_fail(err, DF_ERR_UNSUPPORTED, "more than 4 billion tensors");
    if (table_reserve(s, s->n_tensors + 1) != 0)
        return df_fail(err, DF_ERR_NOMEM, "out of memory for the tensor table");
    const char *nm = arena_strdup(s, name);
    if (!nm) return df_fail(err, DF_ERR_NOMEM, "out of memory for tensor names");
    int64_t idx = s->n_tensors++;
    s->tensors[idx] = *t;
    s->tensors[idx].name = nm;
    s->hashes[idx] = h;
    slot_put(s->slots, s->n_slots, h, idx);
    s->total_bytes += t->nbytes;
    return DF_OK;
}

/* Opens dir/fname as shard number s->n_shards, checks its header and adds its
 * tensors. On error the shard is still recorded (st_close releases it). */
/* What reading one shard's header yields; made by read_header, possibly on
 * another thread (it touches nothing shared but the I/O table), then folded
 * into the set in shard order by open_shard. */
typedef struct {
    const char *fname;
    char *path;
    int fd;
    int64_t size, hlen;
    json_t *root;
    df_status st;
    char err[DF_ERRMSG];
} pre_shard;

static df_status read_header(const st_set *s, pre_shard *p) {
    char *err = p->err;
    const char *path = p->path;
    p->fd = io_open(s->io, path, O_RDONLY, 0);
    if (p->fd < 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (io_fsize(s->io, p->fd, &p->size) != 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    if (p->size < 8)
        return df_fail(err, DF_ERR_FORMAT,
                       "%s: file is %lld bytes, too short for the 8-byte header length", path,
                       (long long)p->size);
    uint8_t lb[8];
    if (io_pread_full(s->io, p->fd, lb, 8, 0) != 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot read the header length: %s", path,
                       strerror(errno));
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | lb[i];
    if (n > (uint64_t)ST_MAX_HEADER)
        return df_fail(err, DF_ERR_FORMAT, "%s: header length %llu exceeds the %lld-byte limit",
                       path, (unsigned long long)n, (long long)ST_MAX_HEADER);
    if (8 + (int64_t)n > p->size)
        return df_fail(err, DF_ERR_FORMAT,
                       "%s: header length %llu runs past the end of the file (%lld bytes): "
                       "truncated?",
                       path, (unsigned long long)n, (long long)p->size);
    char *hdr = malloc((size_t)n + 1);
    if (!hdr) return df_fail(err, DF_ERR_NOMEM, "%s: out of memory for the header", path);
    if (io_pread_full(s->io, p->fd, hdr, (size_t)n, 8) != 0) {
        int e = errno;
        free(hdr);
        return df_fail(err, DF_ERR_IO, "%s: cannot read the %llu-byte header: %s", path,
                       (unsigned long long)n, strerror(e));
    }
    hdr[n] = 0;
    json_error_t je;
    p->root = json_loadb(hdr, (size_t)n, JSON_REJECT_DUPLICATES, &je);
    free(hdr);
    if (!p->root)
        return df_fail(err, DF_ERR_FORMAT, "%s: header is not valid JSON (line %d, column %d: %s)",
                       path, je.line, je.column, je.text);
    if (!json_is_object(p->root))
        return df_fail(err, DF_ERR_FORMAT, "%s: header is %s, expected a JSON object", path,
                       jtype(p->root));
    p->hlen = (int64_t)n;
    return DF_OK;
}

/* Folds a read header into the set as the next shard (which then owns the
 * path and descriptor). On error the shard is still recorded, with fd -1
 * when the file could not be opened. */
static df_status open_shard(st_set *s, pre_shard *p, char *err) {
    if (s->n_shards == s->cap_shards) {
        int cap = s->cap_shards ? s->cap_shards * 2 : 16;
        st_shard *ns = realloc(s->shards, (size_t)cap * sizeof *ns);
        if (!ns) return df_fail(err, DF_ERR_NOMEM, "out of memory");
        s->shards = ns;
        s->cap_shards = cap;
    }
    int si = s->n_shards;
    st_shard *sh = &s->shards[si];
    sh->path = p->path;
    sh->fd = p->fd;
    sh->map = NULL;
    sh->size = p->size;
    sh->data_start = 8 + p->hlen;
    p->path = NULL;
    p->fd = -1;
    if (!sh->path) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    s->n_shards++;
    const char *path = sh->path;
    if (p->st != DF_OK) return df_fail(err, p->st, "%s", p->err);
    json_t *root = p->root;
    p->root = NULL;
    int64_t n = p->hlen;
    int64_t data_start = 8 + (int64_t)n, data_size = sh->size - data_start;
    int64_t first = s->n_tensors;
    df_status st = DF_OK;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) continue;
        st_tensor t;
        memset(&t, 0, sizeof t);
        t.shard = si;
        st = parse_entry(path, key, v, data_size, data_start, &t, err);
        if (st == DF_OK) st = add_tensor(s, key, &t, err);
        if (st != DF_OK) break;
    }
    json_decref(root);
    if (st != DF_OK) return st;

    /* No two tensors may share bytes: sort by begin, each must start at or
     * after the previous end (empty tensors overlap nothing). */
    int64_t cnt = s->n_tensors - first;
    if (cnt > 1) {
        span *sp = malloc((size_t)cnt * sizeof *sp);
        if (!sp) return df_fail(err, DF_ERR_NOMEM, "%s: out of memory", path);
        int64_t m = 0;
        for (int64_t i = 0; i < cnt; i++) {
            const st_tensor *t = &s->tensors[first + i];
            if (t->nbytes == 0) continue;
            sp[m++] = (span){t->offset - data_start, t->offset - data_start + t->nbytes, first + i};
        }
        qsort(sp, (size_t)m, sizeof *sp, by_begin);
        for (int64_t i = 1; i < m; i++) {
            if (sp[i].begin < sp[i - 1].end) {
                st = df_fail(err, DF_ERR_FORMAT,
                             "%s: tensors '%s' [%lld, %lld] and '%s' [%lld, %lld] overlap", path,
                             s->tensors[sp[i - 1].idx].name, (long long)sp[i - 1].begin,
                             (long long)sp[i - 1].end, s->tensors[sp[i].idx].name,
                             (long long)sp[i].begin, (long long)sp[i].end);
                break;
            }
        }
        free(sp);
        if (st != DF_OK) return st;
    }

    if (s->use_mmap) {
        sh->map = io_mmap(s->io, (size_t)sh->size, sh->fd);
        if (!sh->map) return df_fail(err, DF_ERR_IO, "%s: cannot mmap: %s", path, strerror(errno));
    }
    return DF_OK;
}

/* ---- 3. opening a directory (index or glob) ------------------------------- */

static int by_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A shard name from an index must stay inside the directory. */
static int safe_relpath(const char *f) {
    if (!*f || f[0] == '/') return 0;
    for (const char *p = f; *p;) {
        const char *q = strchr(p, '/');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') return 0;
        if (!q) break;
        p = q + 1;
    }
    return 1;
}

typedef struct {
    const st_set *s;
    pre_shard *pre;
    size_t n, stride, first;
} header_job;

static void *header_worker(void *arg) {
    header_job *j = arg;
    for (size_t i = j->first; i < j->n; i += j->stride) {
        pre_shard *p = &j->pre[i];
        if (p->path) p->st = read_header(j->s, p);
    }
    return NULL;
}

/* Opens the named shards: headers are read and parsed on up to one thread per
 * CPU (jansson parses separate documents safely once its hash seed is set),
 * then folded into the set in order, so errors and shard numbers do not
 * depend on the threads. *failed (if given) receives the index of a shard
 * that failed. */
static df_status open_shards(st_set *s, const char *const *names, size_t n, size_t *failed, char *err) {
    pre_shard *pre = calloc(n, sizeof *pre);
    if (!pre) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        pre[i].fname = names[i];
        pre[i].path = st_join_path(s->shard_dir ? s->shard_dir : s->dir, names[i]);
        pre[i].fd = -1;
        pre[i].st = pre[i].path ? DF_OK : df_fail(pre[i].err, DF_ERR_NOMEM, "out of memory");
    }
    json_object_seed(0);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t T = cpus > 1 ? (size_t)cpus : 1;
    if (T > 8) T = 8;
    if (T > n) T = n;
    header_job jobs[8];
    pthread_t th[8];
    int running[8] = {0};
    for (size_t t = 0; t < T; t++) jobs[t] = (header_job){s, pre, n, T, t};
    for (size_t t = 1; t < T; t++) running[t] = pthread_create(&th[t], NULL, header_worker, &jobs[t]) == 0;
    header_worker(&jobs[0]);
    for (size_t t = 1; t < T; t++) {
        if (running[t]) pthread_join(th[t], NULL);
        else header_worker(&jobs[t]); /* no thread: do its share here */
    }
    df_status st = DF_OK;
    size_t i = 0;
    for (; i < n && st == DF_OK; i++) st = open_shard(s, &pre[i], err);
    if (st != DF_OK && failed) *failed = i - 1;
    for (size_t k = 0; k < n; k++) { /* what was not folded in */
        if (pre[k].fd >= 0) io_close(s->io, pre[k].fd);
        free(pre[k].path);
        if (pre[k].root) json_decref(pre[k].root);
    }
    free(pre);
    return st;
}

static df_status open_indexed(st_set *s, const char *ipath, char *err) {
    size_t len = 0;
    char *text = io_read_text(s->io, ipath, ST_MAX_INDEX, &len);
    if (!text) return df_fail(err, DF_ERR_IO, "%s: cannot read: %s", ipath, strerror(errno));
    json_error_t je;
    json_t *root = json_loadb(text, len, 0, &je);
    free(text);
    if (!root)
        return df_fail(err, DF_ERR_FORMAT, "%s: not valid JSON (line %d, column %d: %s)", ipath,
                       je.line, je.column, je.text);
    df_status st = DF_OK;
    const char **files = NULL;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        st = df_fail(err, DF_ERR_FORMAT, "%s: 'weight_map' missing or not an object", ipath);
        goto done;
    }
    size_t nw = json_object_size(wm);
    if (nw == 0) {
        st = df_fail(err, DF_ERR_FORMAT, "%s: 'weight_map' is empty", ipath);
        goto done;
    }
    /* The distinct shard names, sorted. */
    files = malloc(nw * sizeof *files);
    if (!files) {
        st = df_fail(err, DF_ERR_NOMEM, "%s: out of memory", ipath);
        goto done;
    }
    size_t nf = 0;
    const char *key;
    json_t *v;
    json_object_foreach(wm, key, v) {
        if (!json_is_string(v)) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: weight_map['%s'] is %s, expected a file name",
                         ipath, key, jtype(v));
            goto done;
        }
        const char *f = json_string_value(v);
        if (!safe_relpath(f)) {
            st = df_fail(err, DF_ERR_FORMAT,
                         "%s: weight_map['%s'] names '%s', which is outside the model directory",
                         ipath, key, f);
            goto done;
        }
        files[nf++] = f;
    }
    qsort(files, nf, sizeof *files, by_str);
    size_t nu = 0;
    for (size_t i = 0; i < nf; i++)
        if (nu == 0 || strcmp(files[nu - 1], files[i]) != 0) files[nu++] = files[i];
    size_t bad = 0;
    st = open_shards(s, files, nu, &bad, err);
    {
        size_t i = bad;
        if (st != DF_OK) {
            if (st == DF_ERR_IO && s->n_shards > 0 && s->shards[s->n_shards - 1].fd < 0) {
                /* the shard itself is absent: say which index entry wanted it */
                const char *who = "?";
                json_object_foreach(wm, key, v) {
                    if (strcmp(json_string_value(v), files[i]) == 0) { who = key; break; }
                }
                char inner[DF_ERRMSG];
                snprintf(inner, sizeof inner, "%s", err ? err : "");
                st = df_fail(err, DF_ERR_IO, "%s: shard '%s' (holding tensor '%s') is missing: %s",
                             ipath, files[i], who, inner);
            }
            goto done;
        }
    }
    /* Every tensor must be where the index says. */
    json_object_foreach(wm, key, v) {
        const char *f = json_string_value(v);
        char full[1024];
        snprintf(full, sizeof full, "%s%s", s->prefix ? s->prefix : "", key);
        const st_tensor *t = st_find(s, full);
        if (!t) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s' is listed in shard '%s', which has no such tensor",
                         ipath, key, f);
            goto done;
        }
        const char *p = s->shards[t->shard].path;
        size_t pl = strlen(p), fl = strlen(f);
        if (pl < fl || strcmp(p + pl - fl, f) != 0 || (pl > fl && p[pl - fl - 1] != '/')) {
            st = df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s' is listed in shard '%s' but found in %s",
                         ipath, key, f, p);
            goto done;
        }
    }
done:
    free(files);
    json_decref(root);
    return st;
}

static df_status open_glob(st_set *s, char *err) {
    char **names;
    size_t n;
    if (io_list_dir(s->dir, ".safetensors", &names, &n) != 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot list the directory: %s", s->dir,
                       strerror(errno));
    df_status st = DF_OK;
    if (n == 0)
        st = df_fail(err, DF_ERR_IO, "%s: no %s and no *.safetensors files", s->dir, INDEX_NAME);
    else
        st = open_shards(s, (const char *const *)names, n, NULL, err);
    io_free_names(names, n);
    return st;
}

df_status st_open_dir(const char *dir, const df_io *io, int use_mmap, st_set **out, char *err) {
    *out = NULL;
    if (!dir || !*dir) return df_fail(err, DF_ERR_ARG, "st_open_dir: empty directory name");
    st_set *s = calloc(1, sizeof *s);
    if (!s) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    s->io = io ? io : df_io_default();
    s->use_mmap = use_mmap;
    s->dir = strdup(dir);
    if (!s->dir) {
        free(s);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    char *ipath = st_join_path(dir, INDEX_NAME);
    if (!ipath) {
        st_close(s);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    /* The index decides the mode; any error other than "absent" is reported. */
    df_status st;
    int fd = io_open(s->io, ipath, O_RDONLY, 0);
    if (fd >= 0) {
        io_close(s->io, fd);
        st = open_indexed(s, ipath, err);
    } else if (errno == ENOENT) {
        st = open_glob(s, err);
    } else {
        st = df_fail(err, DF_ERR_IO, "%s: cannot open: %s", ipath, strerror(errno));
    }
    free(ipath);
    if (st == DF_OK && !use_mmap && s->n_tensors) {
        s->cache = calloc((size_t)s->n_tensors, sizeof *s->cache);
        if (!s->cache) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    if (st != DF_OK) {
        st_close(s);
        return st;
    }
    *out = s;
    return DF_OK;
}

df_status st_add_dir(st_set *s, const char *subdir, const char *prefix, char *err) {
    char *ipath = st_join_path(subdir, INDEX_NAME);
    if (!ipath) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    int64_t before = s->n_tensors;
    s->shard_dir = subdir;
    s->prefix = prefix;
    df_status st = open_indexed(s, ipath, err);
    s->shard_dir = NULL;
    s->prefix = NULL;
    free(ipath);
    if (st == DF_OK && s->cache && s->n_tensors > before) { /* pread mode: room for the new tensors */
        void **nc = realloc(s->cache, (size_t)s->n_tensors * sizeof *nc);
        if (!nc) return df_fail(err, DF_ERR_NOMEM, "out of memory");
        memset(nc + before, 0, (size_t)(s->n_tensors - before) * sizeof *nc);
        s->cache = nc;
    }
    return st;
}

/* ---- 3b. a set from metadata checked before (st_cache.c) ------------------- */

df_status st_begin(const char *dir, const df_io *io, int use_mmap, int64_t n_hint, st_set **out, char *err) {
    *out = NULL;
    st_set *s = calloc(1, sizeof *s);
    if (!s) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    s->io = io ? io : df_io_default();
    s->use_mmap = use_mmap;
    s->dir = strdup(dir);
    int64_t cap = n_hint > 0 ? n_hint : 1024;
    s->tensors = s->dir ? malloc((size_t)cap * sizeof *s->tensors) : NULL;
    s->hashes = s->tensors ? malloc((size_t)cap * sizeof *s->hashes) : NULL;
    if (!s->hashes || table_reserve(s, cap) != 0) {
        st_close(s);
        return df_fail(err, DF_ERR_NOMEM, "out of memory for %lld tensors", (long long)cap);
    }
    s->cap_tensors = cap;
    *out = s;
    return DF_OK;
}

df_status st_push_shard(st_set *s, const char *fname, int64_t size, int64_t data_start, char *err) {
    if (!safe_relpath(fname))
        return df_fail(err, DF_ERR_FORMAT, "shard name '%s' is outside the model directory", fname);
    pre_shard p = {.fname = fname, .fd = -1, .st = DF_OK};
    p.path = st_join_path(s->dir, fname);
    if (!p.path) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    if (s->n_shards == s->cap_shards) {
        int cap = s->cap_shards ? s->cap_shards * 2 : 16;
        st_shard *ns = realloc(s->shards, (size_t)cap * sizeof *ns);
        if (!ns) { free(p.path); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
        s->shards = ns;
        s->cap_shards = cap;
    }
    st_shard *sh = &s->shards[s->n_shards++];
    *sh = (st_shard){.path = p.path, .fd = -1, .size = size, .data_start = data_start};
    sh->fd = io_open(s->io, sh->path, O_RDONLY, 0);
    if (sh->fd < 0) return df_fail(err, DF_ERR_IO, "%s: cannot open: %s", sh->path, strerror(errno));
    int64_t now;
    if (io_fsize(s->io, sh->fd, &now) != 0)
        return df_fail(err, DF_ERR_IO, "%s: cannot stat: %s", sh->path, strerror(errno));
    if (now != size || data_start < 8 || data_start > size)
        return df_fail(err, DF_ERR_FORMAT, "%s: %lld bytes, expected %lld (header end %lld)", sh->path,
                       (long long)now, (long long)size, (long long)data_start);
    return DF_OK;
}

df_status st_push_tensor(st_set *s, const char *name, const st_tensor *t, char *err) {
    if (t->shard < 0 || t->shard >= s->n_shards || !*name)
        return df_fail(err, DF_ERR_FORMAT, "tensor '%s': shard %d of %d", name, t->shard, s->n_shards);
    const st_shard *sh = &s->shards[t->shard];
    int64_t want = dtype_size(t->dtype);
    if (t->dtype == DT_UNKNOWN || want <= 0 || t->ndim < 0 || t->ndim > ST_MAX_DIMS)
        return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s': bad dtype or rank", sh->path, name);
    for (int i = 0; i < t->ndim; i++) {
        int64_t x = t->shape[i];
        if (x < 0 || (x && want > (INT64_C(1) << 60) / x))
            return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s': bad shape", sh->path, name);
        want *= x;
    }
    if (t->nbytes != want || t->offset < sh->data_start || t->offset > sh->size - want)
        return df_fail(err, DF_ERR_FORMAT, "%s: tensor '%s': %lld bytes at %lld are outside the data section",
                       sh->path, name, (long long)t->nbytes, (long long)t->offset);
    return add_tensor(s, name, t, err);
}

df_status st_push_value(st_set *s, const void *bytes, char *err) {
    if (!s->n_tensors || s->tensors[s->n_tensors - 1].nbytes > ST_SMALL)
        return df_fail(err, DF_ERR_ARG, "st_push_value: no tiny tensor to give a value to");
    if (s->n_small == s->cap_small) {
        int64_t cap = s->cap_small ? s->cap_small * 2 : 4096;
        uint8_t(*nv)[ST_SMALL] = realloc(s->small_vals, (size_t)cap * ST_SMALL);
        if (nv) s->small_vals = nv;
        int64_t *no = nv ? realloc(s->small_of, (size_t)cap * sizeof *no) : NULL;
        if (!no) return df_fail(err, DF_ERR_NOMEM, "out of memory");
        s->small_of = no;
        s->cap_small = cap;
    }
    memset(s->small_vals[s->n_small], 0, ST_SMALL);
    memcpy(s->small_vals[s->n_small], bytes, (size_t)s->tensors[s->n_tensors - 1].nbytes);
    s->small_of[s->n_small++] = s->n_tensors - 1;
    return DF_OK;
}

df_status st_end(st_set *s, char *err) {
    if (s->n_small) {
        if (!(s->small = malloc((size_t)s->n_tensors * sizeof *s->small)))
            return df_fail(err, DF_ERR_NOMEM, "out of memory");
        for (int64_t i = 0; i < s->n_tensors; i++) s->small[i] = -1;
        s->n_small_idx = s->n_tensors;
        for (int64_t k = 0; k < s->n_small; k++) s->small[s->small_of[k]] = (int32_t)k;
        free(s->small_of);
        s->small_of = NULL;
    }
    for (int i = 0; i < s->n_shards && s->use_mmap; i++) {
        st_shard *sh = &s->shards[i];
        sh->map = io_mmap(s->io, (size_t)sh->size, sh->fd);
        if (!sh->map) return df_fail(err, DF_ERR_IO, "%s: cannot mmap: %s", sh->path, strerror(errno));
    }
    if (!s->use_mmap && s->n_tensors && !(s->cache = calloc((size_t)s->n_tensors, sizeof *s->cache)))
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    return DF_OK;
}

/* The value index of tensor i, or -1. */
static int64_t small_at(const st_set *s, int64_t i) {
    return s->small && i < s->n_small_idx ? s->small[i] : -1;
}

/* ---- 4. data access -------------------------------------------------------- */

static int64_t tensor_index(const st_set *s, const st_tensor *t) {
    int64_t i = t - s->tensors;
    ASSERT(i >= 0 && i < s->n_tensors);
    return i;
}

const void *st_data(st_set *s, const st_tensor *t, char *err) {
    const st_shard *sh = &s->shards[t->shard];
    int64_t i = tensor_index(s, t);
    if (small_at(s, i) >= 0) return s->small_vals[s->small[i]];
    if (sh->map) return (const char *)sh->map + t->offset;
    if (s->cache[i]) return s->cache[i];
    /* on ST_DATA_ALIGN (malloc's large blocks start 16 bytes past a page);
     * large ones in 2 MB pages */
    const size_t cap = buffer_bytes(t);
    void *buf = huge_buffer(t) ? mem_huge_alloc(cap) : aligned_alloc(ST_DATA_ALIGN, cap ? cap : ST_DATA_ALIGN);
    if (!buf) {
        df_fail(err, DF_ERR_NOMEM, "%s: tensor '%s': out of memory for %lld bytes", sh->path,
                t->name, (long long)t->nbytes);
        return NULL;
    }
    if (io_pread_full(s->io, sh->fd, buf, (size_t)t->nbytes, t->offset) != 0) {
        int e = errno;
        free_buffer(t, buf);
        df_fail(err, DF_ERR_IO, "%s: tensor '%s': read of %lld bytes at offset %lld failed: %s",
                sh->path, t->name, (long long)t->nbytes, (long long)t->offset, strerror(e));
        return NULL;
    }
    s->cache[i] = buf;
    return buf;
}

void st_willneed(st_set *s, int64_t max_bytes, int (*keep)(const st_tensor *t, void *ctx), void *ctx) {
    if (s->io != df_io_default()) return;
    const int64_t page = 4096;
    for (int64_t i = 0; i < s->n_tensors; i++) {
        const st_tensor *t = &s->tensors[i];
        if (t->nbytes <= 0 || t->nbytes > max_bytes || small_at(s, i) >= 0) continue;
        if (keep && !keep(t, ctx)) continue;
        const st_shard *sh = &s->shards[t->shard];
        int64_t a = t->offset / page * page, len = t->offset + t->nbytes - a;
        if (sh->map) madvise((char *)sh->map + a, (size_t)len, MADV_WILLNEED);
        else if (sh->fd >= 0) posix_fadvise(sh->fd, a, len, POSIX_FADV_WILLNEED);
    }
}

typedef struct { int shard; int64_t begin, end; } run;

static int by_shard_begin(const void *a, const void *b) {
    const run *x = a, *y = b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

int st_hugepage(st_set *s, int (*keep)(const st_tensor *t, void *ctx), void *ctx) {
#ifdef MADV_HUGEPAGE
    /* each advised run splits a mapping (vm.max_map_count is ~65530) */
    enum { MAX_RUNS = 4096 };
    const int64_t page = 4096, huge = (int64_t)2 << 20;
    if (s->io != df_io_default() || !s->use_mmap || s->n_tensors <= 0) return 0;
    run *r = malloc((size_t)s->n_tensors * sizeof *r);
    if (!r) return 0;
    int64_t n = 0;
    for (int64_t i = 0; i < s->n_tensors; i++) {
        const st_tensor *t = &s->tensors[i];
        if (t->nbytes <= 0 || !s->shards[t->shard].map || (keep && !keep(t, ctx))) continue;
        r[n++] = (run){t->shard, t->offset, t->offset + t->nbytes};
    }
    qsort(r, (size_t)n, sizeof *r, by_shard_begin);
    int advised = 0;
    for (int64_t i = 0; i < n && advised < MAX_RUNS;) {
        run u = r[i++];
        while (i < n && r[i].shard == u.shard && r[i].begin <= u.end) { /* adjacent: one run */
            if (r[i].end > u.end) u.end = r[i].end;
            i++;
        }
        if (u.end - u.begin < huge) continue;
        int64_t a = u.begin / page * page;
        if (madvise((char *)s->shards[u.shard].map + a, (size_t)(u.end - a), MADV_HUGEPAGE) == 0) advised++;
    }
    free(r);
    return advised;
#else
    (void)s, (void)keep, (void)ctx;
    return 0;
#endif
}

int st_random_rows(st_set *s, const st_tensor *t) {
    if (!t || s->io != df_io_default() || small_at(s, tensor_index(s, t)) >= 0) return 0;
    const st_shard *sh = &s->shards[t->shard];
    if (!sh->map || t->nbytes <= 0) return 0;
    const int64_t page = 4096, a = t->offset / page * page;
#ifdef MADV_NOHUGEPAGE
    (void)madvise((char *)sh->map + a, (size_t)(t->offset + t->nbytes - a), MADV_NOHUGEPAGE);
#endif
    return madvise((char *)sh->map + a, (size_t)(t->offset + t->nbytes - a), MADV_RANDOM) == 0;
}

void st_rows_willneed(const void *p, int64_t len) {
    const uintptr_t page = 4096, a = (uintptr_t)p / page * page;
    if (len > 0) madvise((void *)a, (size_t)((uintptr_t)p + (uintptr_t)len - a), MADV_WILLNEED);
}

df_status st_read(st_set *s, const st_tensor *t, void *buf, char *err) {
    const st_shard *sh = &s->shards[t->shard];
    int64_t i = tensor_index(s, t);
    if (small_at(s, i) >= 0) {
        memcpy(buf, s->small_vals[s->small[i]], (size_t)t->nbytes);
        return DF_OK;
    }
    if (sh->map || (s->cache && s->cache[i])) {
        memcpy(buf, sh->map ? (const char *)sh->map + t->offset : (const char *)s->cache[i],
               (size_t)t->nbytes);
        return DF_OK;
    }
    return st_pread(s, t, buf, 0, t->nbytes, err);
}

/* ---- 5. queries ------------------------------------------------------------ */

const st_tensor *st_find(const st_set *s, const char *name) {
    if (!s || !name) return NULL;
    int64_t i = lookup(s, name, fnv1a(name));
    return i < 0 ? NULL : &s->tensors[i];
}

int64_t st_count(const st_set *s) { return s ? s->n_tensors : 0; }

const st_tensor *st_at(const st_set *s, int64_t i) {
    return s && i >= 0 && i < s->n_tensors ? &s->tensors[i] : NULL;
}

const char *st_shard_path(const st_set *s, int shard) {
    return s && shard >= 0 && shard < s->n_shards ? s->shards[shard].path : NULL;
}

int st_n_shards(const st_set *s) { return s ? s->n_shards : 0; }

int64_t st_total_bytes(const st_set *s) { return s ? s->total_bytes : 0; }

int st_mapped(const st_set *s, const st_tensor *t) {
    return s->shards[t->shard].map && small_at(s, tensor_index(s, t)) < 0 && t->nbytes > 0;
}

df_status st_pread(st_set *s, const st_tensor *t, void *buf, int64_t off, int64_t len, char *err) {
    const st_shard *sh = &s->shards[t->shard];
    int64_t i = tensor_index(s, t);
    if (off < 0 || len < 0 || off > t->nbytes - len)
        return df_fail(err, DF_ERR_ARG, "%s: tensor '%s': bytes %lld..%lld are outside its %lld", sh->path,
                       t->name, (long long)off, (long long)(off + len), (long long)t->nbytes);
    if (small_at(s, i) >= 0) {
        memcpy(buf, s->small_vals[s->small[i]] + off, (size_t)len);
        return DF_OK;
    }
    if (len && io_pread_full(s->io, sh->fd, buf, (size_t)len, t->offset + off) != 0)
        return df_fail(err, DF_ERR_IO, "%s: tensor '%s': read of %lld bytes at offset %lld failed: %s",
                       sh->path, t->name, (long long)len, (long long)(t->offset + off), strerror(errno));
    return DF_OK;
}

const char *st_dir(const st_set *s) { return s ? s->dir : NULL; }

int64_t st_shard_size(const st_set *s, int shard) {
    return s && shard >= 0 && shard < s->n_shards ? s->shards[shard].size : -1;
}

int64_t st_shard_data_start(const st_set *s, int shard) {
    return s && shard >= 0 && shard < s->n_shards ? s->shards[shard].data_start : -1;
}
