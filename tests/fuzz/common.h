/* common.h — what the libFuzzer harnesses of tests/fuzz share (prefix fz_).
 *
 * Each harness (tests/fuzz/fuzz_NAME.c, built by `make fuzz` into
 * build-fuzz/fuzz/NAME) feeds one parser of outside bytes. They need:
 *
 *   fz_split     an input cut into parts at FZ_SEP, so one input can carry
 *                several files (an index and its shards, a rank file and its
 *                tokenizer_config.json and a text to encode)
 *   fz_memfs     a df_io table serving named in-memory files, for parsers
 *                that read through df_io (safetensors, config.json): no disk
 *                at all; it also counts descriptors, so a parser that leaks
 *                one on an error path aborts the run
 *   fz_file      a file on tmpfs (per-process directory under /dev/shm, else
 *                /tmp; removed at exit) for parsers that open paths
 *                themselves (tokenizer files, the span log)
 *   fz_tokenizer_check  what every loaded tokenizer must do: encode and
 *                decode back, stream-decode as it decodes whole
 *   fz_die       abort with a message: a broken invariant is a finding
 *   fz_note      say why an input was refused, with FZ_VERBOSE=1 (checking seeds)
 *
 * Nothing here is part of the library; the harnesses call library internals
 * directly (the fuzz build links the library's objects).
 */
#ifndef DF_FUZZ_COMMON_H
#define DF_FUZZ_COMMON_H
#include "../../src/base/io.h"
#include <stddef.h>
#include <stdint.h>

/* Separates the parts of one input (kept in each harness's dictionary). */
#define FZ_SEP "\n--8<--\n"

typedef struct {
    const uint8_t *p;
    size_t n;
} fz_part;

/* Cuts data at each FZ_SEP into at most max parts (the last keeps the
 * rest); returns the count (>= 1). */
int fz_split(const uint8_t *data, size_t n, fz_part *parts, int max);
/* A malloc'd NUL-terminated copy of a part (aborts when out of memory). */
char *fz_strdup(fz_part p);

/* ---- in-memory files behind a df_io table ---- */
enum { FZ_MAX_FILES = 16, FZ_MAX_FDS = 64 };
typedef struct fz_memfs fz_memfs;
/* Files are named by their path relative to root ("/fz" gives "/fz/NAME"). */
fz_memfs *fz_memfs_new(const char *root);
/* Adds (or replaces) NAME with a borrowed byte range. */
void fz_memfs_add(fz_memfs *fs, const char *name, const void *p, size_t n);
const df_io *fz_memfs_io(fz_memfs *fs);
/* Aborts if a descriptor or a mapping is still open; then forgets every
 * file (the fs can be reused for the next input). */
void fz_memfs_reset(fz_memfs *fs);

/* ---- files on tmpfs ---- */
/* The per-process directory (created on first use). */
const char *fz_dir(void);
/* Writes p[0..n) to fz_dir()/name and returns its path (static storage per
 * name slot: at most 8 names live at once). */
const char *fz_file(const char *name, const void *p, size_t n);
/* The path fz_file would write (same storage rule). */
const char *fz_file_path(const char *name);

/* ---- tokenizers ---- */
struct df_tokenizer;
/* Encodes text (flags: DF_TOK_SPECIAL or 0); when that succeeds and no
 * special id comes out, the ids' bytes must be the text again and
 * df_detokenize must give it back. Then decodes the ids taken from idb (2
 * bytes each, modulo the vocabulary) whole and one by one through df_detok:
 * both must give the same text, and only valid UTF-8. */
void fz_tokenizer_check(const struct df_tokenizer *t, const char *text, size_t n, unsigned flags,
                        const uint8_t *idb, size_t nidb, int skip_special);

void fz_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* A line on stderr when FZ_VERBOSE is set (why a seed was refused). */
void fz_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#endif
