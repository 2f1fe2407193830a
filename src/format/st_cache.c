/* st_cache.c — the parsed-metadata cache of a sharded checkpoint (prefix stc_).
 *
 * Owns: the cache file's format, its validation against the checkpoint, and
 * writing it (atomically: a temporary file in the same folder, renamed).
 * Refuses: to trust a byte of it. A file is used only when its checksum
 * matches, every field decodes inside its bounds, every tensor lies inside
 * its shard's data section with shape x dtype bytes (st_push_tensor), names
 * are unique, and the index, config.json and every shard still have the size,
 * mtime and inode it recorded. Anything else — truncated, corrupt, another
 * version, another checkpoint, a changed file — and the checkpoint is parsed
 * as st_open_dir does and the file written again; the open never fails
 * because of the cache.
 *
 * Where the file goes: under the cache folder the caller names (the CLI:
 * $XDG_CACHE_HOME/deltafin/meta, else ~/.cache/deltafin/meta), as
 * meta-<64-bit hash of the checkpoint's real path>.bin, never inside the
 * checkpoint folder (often read-only, shared, or a hub mirror whose files are
 * listed by a manifest). The file holds the real path too, so a hash
 * collision is a miss, not a wrong answer.
 *
 * Not cached: checkpoints without an index (single-file models parse in
 * milliseconds), overlays added with st_add_dir (the int8 spine), I/O tables
 * other than POSIX (a stream mirror fills its shards in place, so their
 * mtime changes as it works, and the fault-injection tables of tests).
 *
 * File layout (little-endian, the machine's own: the magic would not match
 * on another byte order):
 *
 *   "DFSTMETA" u32 version u32 0  u64 payload bytes  u64 payload hash
 *   payload:
 *     u32 len, real path of the checkpoint folder
 *     stamp config.json, stamp index          stamp = i64 size, mtime s, ns, ino
 *     u32 shards; per shard: u32 len, name relative to the folder, stamp,
 *                            i64 data start (8 + header length)
 *     u64 tensors; per tensor, in the set's order: u16 bytes shared with the
 *       previous name, u16 bytes added, the added bytes, u8 dtype, u8 rank,
 *       u32 shard, i64 offset, i64 x rank shape, and for a tensor of 1 to
 *       ST_SMALL bytes (int4 weight_shape: 247k of them in K3, each on its
 *       own page of the shard) its bytes
 *
 * Sections: 1. stamps and hashing  2. decoding (check and build)
 *           3. encoding and writing  4. stc_open
 */
#include "st_cache.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define STC_MAGIC "DFSTMETA"
#define STC_VERSION 2u
#define STC_HEAD 32
#define STC_MAX_FILE ((int64_t)4 << 30)
#define STC_MAX_NAME 1023
#define INDEX_NAME "model.safetensors.index.json"

/* ---- 1. stamps and hashing ------------------------------------------------- */

typedef struct { int64_t size, sec, nsec, ino; } stamp;

static int stamp_of(const char *path, stamp *s) {
    struct stat sb;
    if (stat(path, &sb) != 0) return -1;
    *s = (stamp){(int64_t)sb.st_size, (int64_t)sb.st_mtim.tv_sec, (int64_t)sb.st_mtim.tv_nsec,
                 (int64_t)sb.st_ino};
    return 0;
}

static int stamp_eq(const stamp *a, const stamp *b) {
    return a->size == b->size && a->sec == b->sec && a->nsec == b->nsec && a->ino == b->ino;
}

/* Catches torn and flipped bytes (not an adversary: the bounds checks of
 * decoding stand on their own). 8 bytes per step. */
static uint64_t hash64(const uint8_t *p, size_t n) {
    uint64_t h = 0x243F6A8885A308D3ull ^ (uint64_t)n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
    }
    uint64_t w = 0;
    memcpy(&w, p + i, n - i);
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 32);
}

char *stc_path(const char *dir, const char *cache_dir) {
    char real[PATH_MAX];
    if (!cache_dir || !realpath(dir, real)) return NULL;
    char name[64];
    snprintf(name, sizeof name, "meta-%016llx.bin",
             (unsigned long long)hash64((const uint8_t *)real, strlen(real)));
    return st_join_path(cache_dir, name);
}

/* ---- 2. decoding (check and build) ----------------------------------------- */

typedef struct {
    const uint8_t *p, *end;
} cur;

static int take(cur *c, void *dst, size_t n) {
    if ((size_t)(c->end - c->p) < n) return -1;
    memcpy(dst, c->p, n);
    c->p += n;
    return 0;
}

static int take_stamp(cur *c, stamp *s) {
    return take(c, &s->size, 8) || take(c, &s->sec, 8) || take(c, &s->nsec, 8) || take(c, &s->ino, 8);
}

/* What decoding compares with the checkpoint; all NULL for stc_check_bytes. */
typedef struct {
    const char *dir;      /* as the caller spelled it (shard paths, messages) */
    const char *real;     /* its real path */
    const df_io *io;
    int use_mmap;
    char *stale;          /* STC_NOTE bytes: why the file no longer describes the checkpoint */
} target;

/* Decodes a whole cache file. With t->dir set, also compares the stamps with
 * the checkpoint and builds the set into *out. DF_OK: decoded (and built).
 * DF_ERR_FORMAT: the file is not a valid cache (err says why). DF_ERR_MISMATCH:
 * valid but stale (t->stale says which file changed). Other codes: building
 * the set failed (I/O, memory). *out is NULL unless DF_OK. */
static df_status decode(const uint8_t *buf, size_t n, const target *t, st_set **out, char *err) {
    if (out) *out = NULL;
    if (n < STC_HEAD || memcmp(buf, STC_MAGIC, 8) != 0)
        return df_fail(err, DF_ERR_FORMAT, "not a deltafin metadata cache (no magic)");
    uint32_t ver;
    uint64_t plen, phash;
    memcpy(&ver, buf + 8, 4);
    memcpy(&plen, buf + 16, 8);
    memcpy(&phash, buf + 24, 8);
    if (ver != STC_VERSION)
        return df_fail(err, DF_ERR_FORMAT, "cache version %u, this build writes %u", ver, STC_VERSION);
    if (plen != n - STC_HEAD)
        return df_fail(err, DF_ERR_FORMAT, "truncated: %llu payload bytes, header says %llu",
                       (unsigned long long)(n - STC_HEAD), (unsigned long long)plen);
    if (hash64(buf + STC_HEAD, (size_t)plen) != phash)
        return df_fail(err, DF_ERR_FORMAT, "checksum mismatch (corrupt)");
    cur c = {buf + STC_HEAD, buf + n};
    uint32_t len;
    if (take(&c, &len, 4) || len > (uint32_t)(c.end - c.p) || len >= PATH_MAX)
        return df_fail(err, DF_ERR_FORMAT, "bad folder path");
    const char *path = (const char *)c.p;
    c.p += len;
    if (t && t->real && (strlen(t->real) != len || memcmp(path, t->real, len) != 0)) {
        snprintf(t->stale, STC_NOTE, "it describes another folder");
        return DF_ERR_MISMATCH;
    }
    stamp cfg, idx;
    if (take_stamp(&c, &cfg) || take_stamp(&c, &idx)) return df_fail(err, DF_ERR_FORMAT, "truncated stamps");
    if (t && t->dir) {
        static const char *const names[2] = {"config.json", INDEX_NAME};
        const stamp *want[2] = {&cfg, &idx};
        for (int i = 0; i < 2; i++) {
            char *p = st_join_path(t->dir, names[i]);
            stamp now = {-1, 0, 0, 0}; /* an absent config.json is recorded as size -1 */
            int ok = p && (stamp_of(p, &now) == 0 || errno == ENOENT) && stamp_eq(&now, want[i]);
            free(p);
            if (!ok) {
                snprintf(t->stale, STC_NOTE, "%s changed", names[i]);
                return DF_ERR_MISMATCH;
            }
        }
    }
    uint32_t ns;
    if (take(&c, &ns, 4) || ns == 0 || ns > (1u << 20)) return df_fail(err, DF_ERR_FORMAT, "bad shard count");
    /* shard names are read twice: once to compare stamps, once to build */
    const uint8_t *shards_at = c.p;
    for (uint32_t i = 0; i < ns; i++) {
        stamp s;
        int64_t ds;
        if (take(&c, &len, 4) || len == 0 || len > STC_MAX_NAME || len > (uint32_t)(c.end - c.p))
            return df_fail(err, DF_ERR_FORMAT, "bad name of shard %u", i);
        char name[STC_MAX_NAME + 1];
        memcpy(name, c.p, len);
        name[len] = 0;
        c.p += len;
        if (strlen(name) != len) return df_fail(err, DF_ERR_FORMAT, "NUL in the name of shard %u", i);
        if (take_stamp(&c, &s) || take(&c, &ds, 8) || ds < 8 || ds > s.size)
            return df_fail(err, DF_ERR_FORMAT, "bad stamp of shard %u", i);
        if (t && t->dir) {
            char *p = st_join_path(t->dir, name);
            stamp now;
            int ok = p && stamp_of(p, &now) == 0 && stamp_eq(&now, &s);
            free(p);
            if (!ok) {
                snprintf(t->stale, STC_NOTE, "%.300s changed", name);
                return DF_ERR_MISMATCH;
            }
        }
    }
    uint64_t nt;
    if (take(&c, &nt, 8) || nt > (uint64_t)(c.end - c.p) / 8) /* >= 8 bytes per tensor */
        return df_fail(err, DF_ERR_FORMAT, "bad tensor count");
    st_set *s = NULL;
    df_status st = DF_OK;
    if (t && t->dir) {
        if ((st = st_begin(t->dir, t->io, t->use_mmap, (int64_t)nt, &s, err)) != DF_OK) return st;
        cur sc = {shards_at, c.p};
        for (uint32_t i = 0; i < ns && st == DF_OK; i++) {
            stamp sp;
            int64_t ds;
            char name[STC_MAX_NAME + 1];
            take(&sc, &len, 4);
            memcpy(name, sc.p, len);
            name[len] = 0;
            sc.p += len;
            take_stamp(&sc, &sp);
            take(&sc, &ds, 8);
            st = st_push_shard(s, name, sp.size, ds, err);
        }
    }
    char name[STC_MAX_NAME + 1];
    size_t prev = 0;
    for (uint64_t i = 0; i < nt && st == DF_OK; i++) {
        uint16_t keep, add;
        uint8_t dt, rank;
        st_tensor tn;
        memset(&tn, 0, sizeof tn);
        if (take(&c, &keep, 2) || take(&c, &add, 2) || keep > prev || (size_t)keep + add > STC_MAX_NAME ||
            take(&c, name + keep, add)) {
            st = df_fail(err, DF_ERR_FORMAT, "bad name of tensor %llu", (unsigned long long)i);
            break;
        }
        prev = (size_t)keep + add;
        name[prev] = 0;
        uint32_t shard;
        if (strlen(name) != prev || prev == 0 || take(&c, &dt, 1) || take(&c, &rank, 1) ||
            take(&c, &shard, 4) || take(&c, &tn.offset, 8) || rank > ST_MAX_DIMS || shard >= ns ||
            take(&c, tn.shape, (size_t)rank * 8)) {
            st = df_fail(err, DF_ERR_FORMAT, "bad entry of tensor %llu", (unsigned long long)i);
            break;
        }
        tn.dtype = (st_dtype)dt;
        tn.ndim = rank;
        tn.shard = (int)shard;
        int64_t nb = dtype_size(tn.dtype);
        for (int k = 0; k < rank && nb > 0; k++) {
            if (tn.shape[k] < 0 || (tn.shape[k] && nb > (INT64_C(1) << 60) / tn.shape[k])) nb = -1;
            else nb *= tn.shape[k];
        }
        if (nb <= 0 && !(nb == 0 && dtype_size(tn.dtype) > 0)) { /* unknown dtype or absurd shape */
            st = df_fail(err, DF_ERR_FORMAT, "tensor '%s': bad dtype, shape or offset", name);
            break;
        }
        tn.nbytes = nb;
        uint8_t val[ST_SMALL];
        if (nb > 0 && nb <= ST_SMALL && take(&c, val, (size_t)nb)) {
            st = df_fail(err, DF_ERR_FORMAT, "tensor '%s': value truncated", name);
            break;
        }
        if (s) st = st_push_tensor(s, name, &tn, err);
        if (s && st == DF_OK && nb > 0 && nb <= ST_SMALL) st = st_push_value(s, val, err);
    }
    if (st == DF_OK && c.p != c.end) st = df_fail(err, DF_ERR_FORMAT, "trailing bytes");
    if (st == DF_OK && s) st = st_end(s, err);
    if (st != DF_OK) {
        st_close(s);
        return st;
    }
    if (out) *out = s;
    return DF_OK;
}

uint64_t stc_hash(const void *p, size_t n) { return hash64(p, n); }

df_status stc_check_bytes(const void *buf, size_t n, char *err) {
    return decode(buf, n, NULL, NULL, err);
}

/* ---- 3. encoding and writing ------------------------------------------------ */

typedef struct {
    uint8_t *p;
    size_t n, cap;
    int oom;
} wbuf;

static void put(wbuf *b, const void *src, size_t n) {
    if (b->oom) return;
    if (b->cap - b->n < n) {
        size_t cap = b->cap ? b->cap : (size_t)1 << 20;
        while (cap - b->n < n) cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put_stamp(wbuf *b, const stamp *s) {
    put(b, &s->size, 8);
    put(b, &s->sec, 8);
    put(b, &s->nsec, 8);
    put(b, &s->ino, 8);
}

/* mkdir -p; 0 or -1 (errno set). */
static int make_dirs(const char *path) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) { errno = ENAMETOOLONG; return -1; }
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || !*p) {
            char c = *p;
            *p = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
            *p = c;
            if (!c) return 0;
        }
    }
}

/* Encodes s with the stamps taken before it was parsed (cfg, idx) and writes
 * it to file. 0, or -1 with why (a note). */
static int write_cache(const st_set *s, const char *real, const stamp *cfg, const stamp *idx,
                       const char *cache_dir, const char *file, char *why) {
    wbuf b = {0};
    char head[STC_HEAD] = STC_MAGIC;
    put(&b, head, STC_HEAD);
    uint32_t len = (uint32_t)strlen(real);
    put(&b, &len, 4);
    put(&b, real, len);
    put_stamp(&b, cfg);
    put_stamp(&b, idx);
    uint32_t ns = (uint32_t)st_n_shards(s);
    put(&b, &ns, 4);
    const char *dir = st_dir(s);
    size_t dl = strlen(dir);
    for (int i = 0; i < (int)ns; i++) {
        const char *p = st_shard_path(s, i);
        const char *rel = p + dl;
        if (*rel == '/') rel++;
        stamp sp;
        if (strncmp(p, dir, dl) != 0 || stamp_of(p, &sp) != 0 || sp.size != st_shard_size(s, i)) {
            snprintf(why, STC_NOTE, "%.300s changed while it was read", p);
            free(b.p);
            return -1;
        }
        len = (uint32_t)strlen(rel);
        put(&b, &len, 4);
        put(&b, rel, len);
        put_stamp(&b, &sp);
        int64_t ds = st_shard_data_start(s, i);
        put(&b, &ds, 8);
    }
    uint64_t nt = (uint64_t)st_count(s);
    put(&b, &nt, 8);
    const char *prev = "";
    size_t prev_len = 0;
    for (uint64_t i = 0; i < nt; i++) {
        const st_tensor *t = st_at(s, (int64_t)i);
        size_t n = strlen(t->name), k = 0;
        if (n > STC_MAX_NAME) {
            snprintf(why, STC_NOTE, "tensor name longer than %d bytes: not cached", STC_MAX_NAME);
            free(b.p);
            return -1;
        }
        while (k < n && k < prev_len && t->name[k] == prev[k]) k++;
        uint16_t keep = (uint16_t)k, add = (uint16_t)(n - k);
        put(&b, &keep, 2);
        put(&b, &add, 2);
        put(&b, t->name + k, add);
        uint8_t dt = (uint8_t)t->dtype, rank = (uint8_t)t->ndim;
        uint32_t shard = (uint32_t)t->shard;
        put(&b, &dt, 1);
        put(&b, &rank, 1);
        put(&b, &shard, 4);
        put(&b, &t->offset, 8);
        put(&b, t->shape, (size_t)rank * 8);
        if (t->nbytes > 0 && t->nbytes <= ST_SMALL) {
            uint8_t val[ST_SMALL];
            char e2[DF_ERRMSG];
            if (st_read((st_set *)s, t, val, e2) != DF_OK) {
                snprintf(why, STC_NOTE, "%.400s", e2);
                free(b.p);
                return -1;
            }
            put(&b, val, (size_t)t->nbytes);
        }
        prev = t->name;
        prev_len = n;
    }
    if (b.oom) {
        snprintf(why, STC_NOTE, "out of memory while encoding");
        free(b.p);
        return -1;
    }
    uint32_t ver = STC_VERSION;
    uint64_t plen = b.n - STC_HEAD, h = hash64(b.p + STC_HEAD, (size_t)plen);
    memcpy(b.p + 8, &ver, 4);
    memcpy(b.p + 16, &plen, 8);
    memcpy(b.p + 24, &h, 8);
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", file, (long)getpid());
    int fd = -1, rc = -1;
    if (make_dirs(cache_dir) != 0 || (fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) {
        snprintf(why, STC_NOTE, "cannot write %.300s: %s", tmp, strerror(errno));
        free(b.p);
        return -1;
    }
    size_t done = 0;
    while (done < b.n) {
        ssize_t w = write(fd, b.p + done, b.n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        done += (size_t)w;
    }
    if (done == b.n && close(fd) == 0) {
        fd = -1;
        rc = rename(tmp, file);
    }
    if (rc != 0) {
        snprintf(why, STC_NOTE, "cannot write %.300s: %s", file, strerror(errno ? errno : EIO));
        if (fd >= 0) close(fd);
        unlink(tmp);
    }
    free(b.p);
    return rc;
}

/* ---- 4. stc_open ------------------------------------------------------------ */

/* The whole cache file, or NULL (absent, unreadable, or absurdly large). */
static uint8_t *read_file(const df_io *io, const char *path, size_t *n) {
    int fd = io_open(io, path, O_RDONLY, 0);
    if (fd < 0) return NULL;
    int64_t sz;
    uint8_t *buf = NULL;
    if (io_fsize(io, fd, &sz) == 0 && sz >= 0 && sz <= STC_MAX_FILE && (buf = malloc(sz ? (size_t)sz : 1))) {
        if (io_pread_full(io, fd, buf, (size_t)sz, 0) != 0) {
            free(buf);
            buf = NULL;
        }
        *n = (size_t)sz;
    }
    io_close(io, fd);
    return buf;
}

df_status stc_open(const char *dir, const df_io *io, int use_mmap, const char *cache_dir,
                   int64_t min_index_bytes, st_set **out, char *note, char *err) {
    char scratch[STC_NOTE];
    if (!note) note = scratch;
    note[0] = 0;
    *out = NULL;
    const df_io *posix = df_io_default();
    if (!io) io = posix;
    char real[PATH_MAX];
    char *ipath = st_join_path(dir, INDEX_NAME), *cpath = st_join_path(dir, "config.json");
    stamp idx = {0}, cfg = {0};
    int want = cache_dir && io == posix && ipath && cpath && realpath(dir, real) &&
               stamp_of(ipath, &idx) == 0 && idx.size >= min_index_bytes;
    if (want && stamp_of(cpath, &cfg) != 0) cfg = (stamp){-1, 0, 0, 0}; /* absent: recorded as such */
    free(ipath);
    free(cpath);
    if (!want) return st_open_dir(dir, io, use_mmap, out, err);
    char *file = stc_path(dir, cache_dir);
    if (!file) return st_open_dir(dir, io, use_mmap, out, err);

    size_t n = 0;
    uint8_t *buf = read_file(posix, file, &n);
    if (buf) {
        char why[DF_ERRMSG], stale[STC_NOTE] = "";
        target t = {dir, real, io, use_mmap, stale};
        df_status st = decode(buf, n, &t, out, why);
        free(buf);
        if (st == DF_OK) {
            free(file);
            return DF_OK;
        }
        if (st == DF_ERR_MISMATCH)
            snprintf(note, STC_NOTE, "metadata cache %.250s is stale (%.200s): rebuilt", file, stale);
        else
            snprintf(note, STC_NOTE, "metadata cache %.250s ignored (%.200s): rebuilt", file, why);
    }
    df_status st = st_open_dir(dir, io, use_mmap, out, err);
    if (st != DF_OK) {
        free(file);
        return st;
    }
    /* the stamps were taken before the parse: if the index or config changed
     * since, the file would describe a checkpoint that never existed */
    char *ip2 = st_join_path(dir, INDEX_NAME), *cp2 = st_join_path(dir, "config.json");
    stamp idx2, cfg2 = {-1, 0, 0, 0};
    int same = ip2 && cp2 && stamp_of(ip2, &idx2) == 0 && stamp_eq(&idx, &idx2) &&
               (stamp_of(cp2, &cfg2) == 0 || cfg2.size == -1) && stamp_eq(&cfg, &cfg2);
    free(ip2);
    free(cp2);
    char why[STC_NOTE];
    if (!same)
        snprintf(note, STC_NOTE, "metadata cache not written: the checkpoint changed while it was read");
    else if (write_cache(*out, real, &cfg, &idx, cache_dir, file, why) != 0)
        snprintf(note, STC_NOTE, "metadata cache not written: %.400s", why);
    free(file);
    return DF_OK;
}
