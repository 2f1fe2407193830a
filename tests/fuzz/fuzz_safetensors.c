/* fuzz_safetensors.c — libFuzzer harness: the sharded safetensors reader
 * (st_open_dir, src/format/safetensors.c): model.safetensors.index.json and
 * every shard's header, then every tensor's bytes.
 *
 * Input: a flags byte, 3 bytes of data-section size (little-endian, 20
 * bits), then INDEX FZ_SEP SHARD FZ_SEP SHARD ...
 *   bit 0  map the shards (else pread into the set's buffers)
 *   bit 1  no index: the shards are files shard-K.safetensors on tmpfs,
 *          found by listing the directory (the single-file / glob mode)
 *   bit 2  each SHARD part is the header JSON alone: the harness writes the
 *          8-byte length before it and the data-section size of pattern
 *          bytes after it (so mutations of the JSON keep a consistent file)
 * With an index, the shards are served from memory by an in-memory df_io
 * table: the index's distinct file names, sorted, get SHARD parts in order
 * (a name without a part is a missing shard). Checks, beyond ASan, UBSan
 * and the descriptor count: every tensor is found by its name, has a shard
 * path, and its bytes can be read (a mapping is a copy of exactly the file,
 * so a tensor past its end is a heap overflow).
 */
#include "common.h"
#include "../../src/format/safetensors.h"
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_SHARDS = 8 };

static int by_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The index's distinct shard names, sorted (malloc'd copies); their count. */
static int index_names(fz_part index, char **names) {
    json_t *root = json_loadb((const char *)index.p, index.n, 0, NULL);
    json_t *wm = json_object_get(root, "weight_map");
    int n = 0;
    const char *key;
    json_t *v;
    json_object_foreach(wm, key, v) {
        const char *f = json_string_value(v);
        if (!f) continue;
        int dup = 0;
        for (int i = 0; i < n && !dup; i++) dup = !strcmp(names[i], f);
        if (!dup && n < MAX_SHARDS) names[n++] = strdup(f);
    }
    json_decref(root);
    qsort(names, (size_t)n, sizeof *names, by_str);
    return n;
}

static void check_set(st_set *s) {
    char err[DF_ERRMSG];
    int64_t n = st_count(s);
    for (int64_t i = 0; i < n; i++) {
        const st_tensor *t = st_at(s, i);
        if (!t || st_find(s, t->name) != t) fz_die("tensor %lld is not found by its name", (long long)i);
        if (!st_shard_path(s, t->shard)) fz_die("tensor '%s' has no shard", t->name);
        if (t->nbytes < 0 || t->offset < 8) fz_die("tensor '%s' at %lld, %lld bytes", t->name, (long long)t->offset, (long long)t->nbytes);
        const uint8_t *p = st_data(s, t, err);
        if (p && t->nbytes) {
            volatile uint8_t sink = (uint8_t)(p[0] + p[t->nbytes - 1]);
            (void)sink;
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fz_memfs *fs;
    if (!fs) fs = fz_memfs_new("/fz");
    if (size < 4) return 0;
    int flags = data[0];
    size_t data_size = ((size_t)data[1] | (size_t)data[2] << 8 | (size_t)data[3] << 16) & 0xFFFFF;
    fz_part part[1 + MAX_SHARDS];
    int np = fz_split(data + 4, size - 4, part, 1 + MAX_SHARDS);
    /* the shard files' bytes */
    uint8_t *built[MAX_SHARDS] = {0};
    fz_part shard[MAX_SHARDS];
    int ns = np - 1;
    for (int i = 0; i < ns; i++) {
        shard[i] = part[1 + i];
        if (flags & 4) {
            size_t hl = part[1 + i].n, total = 8 + hl + data_size;
            built[i] = malloc(total ? total : 1);
            if (!built[i]) fz_die("out of memory");
            for (int b = 0; b < 8; b++) built[i][b] = (uint8_t)((uint64_t)hl >> (8 * b));
            if (hl) memcpy(built[i] + 8, part[1 + i].p, hl);
            memset(built[i] + 8 + hl, 0x5A, data_size);
            shard[i] = (fz_part){built[i], total};
        }
    }
    st_set *s = NULL;
    char err[DF_ERRMSG];
    df_status st;
    if (flags & 2) {
        char dir[300], name[64];
        snprintf(dir, sizeof dir, "%s/st", fz_dir());
        mkdir(dir, 0700);
        for (int i = 0; i < MAX_SHARDS; i++) {
            snprintf(name, sizeof name, "st/shard-%d.safetensors", i);
            if (i < ns) fz_file(name, shard[i].p, shard[i].n);
            else unlink(fz_file_path(name));
        }
        st = st_open_dir(dir, NULL, flags & 1, &s, err);
    } else {
        char *names[MAX_SHARDS];
        int nn = index_names(part[0], names);
        fz_memfs_add(fs, "model.safetensors.index.json", part[0].p, part[0].n);
        for (int i = 0; i < nn; i++) {
            if (i < ns) fz_memfs_add(fs, names[i], shard[i].p, shard[i].n);
            free(names[i]);
        }
        st = st_open_dir("/fz", fz_memfs_io(fs), flags & 1, &s, err);
    }
    if (st == DF_OK) check_set(s);
    else if (s) fz_die("st_open_dir failed but returned a set");
    else fz_note("%s", err);
    st_close(s);
    fz_memfs_reset(fs);
    for (int i = 0; i < ns; i++) free(built[i]);
    return 0;
}
