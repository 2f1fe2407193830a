/* fuzz_tiktoken.c — libFuzzer harness: tiktoken rank files and
 * tokenizer_config.json's special tokens (df_tokenizer_load_tiktoken,
 * src/text/tokenizer.c), then encoding and decoding with what loaded.
 *
 * Input: a flags byte, then RANKS FZ_SEP CONFIG FZ_SEP TEXT FZ_SEP IDS.
 *   bits 0-1  pattern: kimi, o200k, cl100k, kimi
 *   bit 2     load CONFIG as tokenizer_config.json (else none)
 *   bit 3     encode TEXT with DF_TOK_SPECIAL
 *   bit 4     decode IDS skipping specials
 * The files are written to tmpfs (the loader opens paths). What a loaded
 * tokenizer must do is fz_tokenizer_check's (common.h): encode TEXT and
 * decode it back exactly, decode IDS whole and streamed alike.
 */
#include "common.h"
#include "deltafin.h"
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int flags = data[0];
    fz_part p[4] = {{0}};
    int np = fz_split(data + 1, size - 1, p, 4);
    static const char *const patterns[] = {"kimi", "o200k", "cl100k", "kimi"};
    const char *ranks = fz_file("ranks.tiktoken", p[0].p, p[0].n);
    const char *cfg = np > 1 && (flags & 4) ? fz_file("tokenizer_config.json", p[1].p, p[1].n) : NULL;
    df_tokenizer *t = NULL;
    char err[DF_ERRMSG];
    if (df_tokenizer_load_tiktoken(ranks, patterns[flags & 3], NULL, cfg, &t, err) != DF_OK) {
        if (t) fz_die("a failed load returned a tokenizer");
        fz_note("%s", err);
        return 0;
    }
    fz_tokenizer_check(t, np > 2 ? (const char *)p[2].p : "", np > 2 ? p[2].n : 0, flags & 8 ? DF_TOK_SPECIAL : 0,
                       np > 3 ? p[3].p : NULL, np > 3 ? p[3].n : 0, (flags >> 4) & 1);
    df_tokenizer_free(t);
    return 0;
}
