/* fuzz_spine8_manifest.c — libFuzzer harness: the int8 spine's manifest
 * check (src/spine8/rule.c: s8_check, s8_header_hash), read through an
 * in-memory df_io table, as the engine runs it at every open of a model
 * directory that holds a conversion.
 *
 * Input: parts cut at FZ_SEP: the manifest.json text, the bytes of the
 * checkpoint shard "model.safetensors" (its length prefix and header are
 * hashed), the bytes of the int8 shard "spine-00000.safetensors" (only its
 * size is checked). Checks, beyond the sanitizers and the descriptor count:
 * every refusal carries a NUL-terminated message, and "absent" is set only
 * for a missing manifest.
 */
#include "common.h"
#include "../../src/spine8/spine8.h"
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fz_memfs *fs;
    if (!fs) fs = fz_memfs_new("/fz");
    fz_part part[3];
    int n = fz_split(data, size, part, 3);
    fz_memfs_add(fs, "int8-spine/manifest.json", part[0].p, part[0].n);
    if (n > 1) fz_memfs_add(fs, "model.safetensors", part[1].p, part[1].n);
    if (n > 2) fz_memfs_add(fs, "int8-spine/spine-00000.safetensors", part[2].p, part[2].n);
    char err[DF_ERRMSG];
    err[0] = 0;
    int absent = -1;
    df_status st = s8_check(fz_memfs_io(fs), "/fz", "/fz/int8-spine", &absent, err);
    fz_memfs_reset(fs);
    if (absent) fz_die("the manifest is there but reads as absent (status %d)", (int)st);
    if (st != DF_OK) {
        if (!err[0] || !memchr(err, 0, sizeof err)) fz_die("an error without a message");
        fz_note("%s", err);
    }
    return 0;
}
