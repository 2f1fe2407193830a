/* st_cache.h — the parsed-metadata cache of a sharded checkpoint (prefix stc_).
 *
 * Parsing the full-size K3's index (60 MB of JSON, ~500k names) and its 96
 * shard headers (another ~80 MB) takes seconds; the result — every tensor's
 * name, dtype, shape, shard and offset — fits in a ~30 MB binary file that
 * loads in a fraction of that. stc_open keeps one such file per checkpoint
 * under a cache folder, keyed by the checkpoint's real path, and uses it only
 * while the index, config.json and every shard have the size, modification
 * time and inode recorded in it; otherwise (or when the file is corrupt) it
 * parses the checkpoint as st_open_dir does and writes the file again.
 */
#ifndef DF_FORMAT_ST_CACHE_H
#define DF_FORMAT_ST_CACHE_H
#include "safetensors.h"

enum { STC_NOTE = 512 };

/* Opens dir like st_open_dir. cache_dir: the folder for cache files (created
 * if absent); NULL, or a checkpoint without model.safetensors.index.json or
 * with an index below min_index_bytes, or an I/O table other than the POSIX
 * one (its files may not be what stat sees): no cache, st_open_dir alone.
 * note (STC_NOTE bytes, may be NULL) says what happened to the cache: "" when
 * it was used or not wanted, else one line (written, stale and rebuilt,
 * corrupt and rebuilt, could not be written). A cache problem never fails the
 * open: the checkpoint is parsed instead. On error *out is NULL. */
df_status stc_open(const char *dir, const df_io *io, int use_mmap, const char *cache_dir,
                   int64_t min_index_bytes, st_set **out, char *note, char *err);

/* The cache file stc_open uses for dir under cache_dir (malloc'd; NULL when
 * dir has no real path). For tests and messages. */
char *stc_path(const char *dir, const char *cache_dir);

/* Checks a cache file's bytes without touching the checkpoint (the fuzz
 * harness's entry): DF_OK when it decodes in full, else DF_ERR_FORMAT with
 * the reason in err. */
df_status stc_check_bytes(const void *buf, size_t n, char *err);
/* The payload checksum (lets the fuzz harness reach the decoder with bytes
 * of its own). */
uint64_t stc_hash(const void *p, size_t n);
#endif
