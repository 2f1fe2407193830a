/* fuzz_meta_cache.c — libFuzzer harness: the parsed-metadata cache file
 * (src/format/st_cache.c: stc_check_bytes, the decoder stc_open trusts
 * nothing past).
 *
 * Input: one flag byte, then bytes. Flag bit 0 set: the bytes are a whole
 * cache file as found on disk (header, checksum, payload). Clear: the bytes
 * are a payload, given a header with the right length and checksum, so the
 * decoder's own bounds checks are what stands between them and memory.
 * Checks, beyond the sanitizers: every refusal carries a NUL-terminated
 * message.
 */
#include "common.h"
#include "../../src/format/st_cache.h"
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int whole = data[0] & 1;
    data++;
    size--;
    uint8_t *buf = malloc(size + 32);
    if (!buf) fz_die("out of memory");
    size_t n = size;
    if (whole) memcpy(buf, data, size);
    else {
        uint32_t ver = 2, zero = 0;
        uint64_t plen = size, h = stc_hash(data, size);
        memcpy(buf, "DFSTMETA", 8);
        memcpy(buf + 8, &ver, 4);
        memcpy(buf + 12, &zero, 4);
        memcpy(buf + 16, &plen, 8);
        memcpy(buf + 24, &h, 8);
        memcpy(buf + 32, data, size);
        n = size + 32;
    }
    char err[DF_ERRMSG];
    err[0] = 0;
    df_status st = stc_check_bytes(buf, n, err);
    free(buf);
    if (st != DF_OK) {
        if (!err[0] || !memchr(err, 0, sizeof err)) fz_die("an error without a message");
        fz_note("%s", err);
    }
    return 0;
}
