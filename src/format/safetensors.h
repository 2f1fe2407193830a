/* safetensors.h — sharded safetensors reader (prefix st_).
 *
 * An st_set is every shard of one model directory: the index file's weight
 * map (or the single model.safetensors), each header parsed with jansson and
 * bounds-checked (offsets inside the file, sizes equal to shape x dtype, no
 * overlaps), and a hash table from tensor name to st_tensor. Tensor bytes are
 * reached through mmap (default) or read on demand with pread.
 */
#ifndef DF_FORMAT_SAFETENSORS_H
#define DF_FORMAT_SAFETENSORS_H
#include "deltafin.h"
#include "dtype.h"
#include "../base/io.h"
#include <stddef.h>
#include <stdint.h>

#define ST_MAX_DIMS 8
#define ST_SMALL 16 /* tensors this small may carry their value in the metadata cache */
/* Where the engine puts tensor bytes it lays out itself (a read into memory,
 * an expert slot's places, a converted spine's data): on two cache lines'
 * boundary. A file's own offsets are the writer's (safetensors aligns
 * nothing), and the kernels stream rows that straddle lines slower
 * (src/experts/place.h). */
enum { ST_DATA_ALIGN = 128 };

typedef struct {
    const char *name;      /* owned by the set */
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t nbytes;
    int shard;             /* index into the set's shards */
    int64_t offset;        /* absolute byte offset in the shard file */
} st_tensor;

typedef struct st_set st_set;

/* Opens dir/model.safetensors.index.json if present, else every
 * dir/ *.safetensors (single-file models). use_mmap selects the access path. */
df_status st_open_dir(const char *dir, const df_io *io, int use_mmap, st_set **out, char *err);
void st_close(st_set *s);
/* Adds the shards of another indexed folder (an overlay, e.g. a converted
 * int8 spine) to the set, each tensor name with `prefix` in front. On error
 * the set may hold part of the overlay's shards; close it. */
df_status st_add_dir(st_set *s, const char *subdir, const char *prefix, char *err);

const st_tensor *st_find(const st_set *s, const char *name);   /* NULL if absent */
int64_t st_count(const st_set *s);
const st_tensor *st_at(const st_set *s, int64_t i);             /* iteration */
const char *st_shard_path(const st_set *s, int shard);
int st_n_shards(const st_set *s);
int64_t st_total_bytes(const st_set *s);                        /* sum of tensor bytes */

/* Pointer to the tensor's bytes. With mmap this is the mapping; without, the
 * bytes are read into memory owned by the set on first use. NULL on I/O
 * error (err filled). */
const void *st_data(st_set *s, const st_tensor *t, char *err);
/* Asks the kernel to start reading, all at once, the bytes of every tensor
 * of at most max_bytes for which keep(t, ctx) is true (NULL: every one), so
 * the first touches that follow (norm vectors, biases: hundreds of them,
 * each on its own page somewhere in a shard) do not fault in one by one.
 * A hint (madvise / posix_fadvise WILLNEED): nothing changes but timing;
 * does nothing for I/O tables other than POSIX. */
void st_willneed(st_set *s, int64_t max_bytes, int (*keep)(const st_tensor *t, void *ctx), void *ctx);
/* Asks the kernel to read the kept tensors of a mapped set in 2 MB folios
 * (MADV_HUGEPAGE on each run of adjacent kept tensors of 2 MB or more), and
 * to map them with 2 MB entries where it can. Without it a page fault reads
 * small folios around itself (16 KB and up), worse when threads fault in
 * several places at once, and those folios stay in the page cache for every
 * later process: a spine read that way decoded 1.3x slower on a Zen 5 VM
 * (TLB misses; 4x when write(2) had left it in 4 KB folios), within noise
 * on an Intel host. Pages already cached keep their folios. A hint: nothing
 * changes but timing; nothing for I/O tables other than POSIX. */
int st_hugepage(st_set *s, int (*keep)(const st_tensor *t, void *ctx), void *ctx); /* runs advised */
/* A tensor read a row at a time at random (an untied embedding): its mapped
 * pages get MADV_RANDOM (and lose st_hugepage's advice), so a fault on one
 * row reads that page, not the device's read-ahead window around it
 * (read_ahead_kb: 8 MB on some cloud disks, where a decode token's new
 * embedding row read 8 MB). Returns 1 when t is mapped (then
 * st_rows_willneed is worth calling), else 0. A hint: nothing changes but
 * timing. */
int st_random_rows(st_set *s, const st_tensor *t);
/* Asks the kernel to read bytes [p, p + len) of a mapping now (MADV_WILLNEED
 * on their pages): the rows a step is about to touch, in one request each
 * and all in flight together, instead of a fault per page. */
void st_rows_willneed(const void *p, int64_t len);
/* Copies the tensor's bytes into buf (nbytes of t). */
df_status st_read(st_set *s, const st_tensor *t, void *buf, char *err);
/* 1 when st_data answers t from a shard's mapping (a page-cache view), else 0. */
int st_mapped(const st_set *s, const st_tensor *t);
/* Reads bytes [off, off + len) of t's data into buf from its file with the
 * set's I/O (pread, never the mapping: no page faults on it), or from the
 * kept copy of a tiny tensor. Threads may read at once. DF_ERR_IO names the
 * file, the tensor and the range. */
df_status st_pread(st_set *s, const st_tensor *t, void *buf, int64_t off, int64_t len, char *err);
/* The directory the set was opened from (for messages). */
const char *st_dir(const st_set *s);
/* dir + "/" + name (no doubled slash), malloc'd; NULL when out of memory. */
char *st_join_path(const char *dir, const char *name);
int64_t st_shard_size(const st_set *s, int shard);        /* bytes; -1 if no such shard */
int64_t st_shard_data_start(const st_set *s, int shard);  /* 8 + header length */

/* A set from metadata that was checked when it was first parsed (the
 * parsed-metadata cache, st_cache.c): st_begin, then every shard in order
 * (opened; its size must be the one given), then every tensor (each checked
 * against its shard's bounds, shape x dtype and name uniqueness, but not for
 * overlaps), then st_end (maps the shards). Any error leaves a set to
 * st_close. n_hint: the expected tensor count (sizes the tables once). */
df_status st_begin(const char *dir, const df_io *io, int use_mmap, int64_t n_hint, st_set **out, char *err);
df_status st_push_shard(st_set *s, const char *fname, int64_t size, int64_t data_start, char *err);
df_status st_push_tensor(st_set *s, const char *name, const st_tensor *t, char *err);
/* The bytes of the tensor pushed last (at most ST_SMALL): st_data and st_read
 * then answer from this copy instead of the shard. */
df_status st_push_value(st_set *s, const void *bytes, char *err);
df_status st_end(st_set *s, char *err);
#endif
