/* fuzz_tokenizer_json.c — libFuzzer harness: Hugging Face tokenizer.json
 * (df_tokenizer_load_hf, src/text/tokenizer.c: byte-level BPE vocabulary,
 * merges, added tokens, pre-tokenizer regexes), then encoding and decoding
 * with what loaded.
 *
 * Input: a flags byte, then TOKENIZER_JSON FZ_SEP TEXT FZ_SEP IDS.
 *   bit 0  encode TEXT with DF_TOK_SPECIAL
 *   bit 1  decode IDS skipping specials
 * The file is written to tmpfs. A loaded tokenizer must pass
 * fz_tokenizer_check (common.h), except that a Split step with behavior
 * "Removed" drops text, so the exact round trip is not asked of inputs
 * that spell "Removed".
 */
#include "common.h"
#include "deltafin.h"
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int flags = data[0];
    fz_part p[3] = {{0}};
    int np = fz_split(data + 1, size - 1, p, 3);
    const char *path = fz_file("tokenizer.json", p[0].p, p[0].n);
    df_tokenizer *t = NULL;
    char err[DF_ERRMSG];
    if (df_tokenizer_load_hf(path, &t, err) != DF_OK) {
        if (t) fz_die("a failed load returned a tokenizer");
        fz_note("%s", err);
        return 0;
    }
    int removes = memmem(p[0].p, p[0].n, "Removed", 7) != NULL;
    fz_tokenizer_check(t, np > 1 && !removes ? (const char *)p[1].p : "", np > 1 && !removes ? p[1].n : 0,
                       flags & 1 ? DF_TOK_SPECIAL : 0, np > 2 ? p[2].p : NULL, np > 2 ? p[2].n : 0, (flags >> 1) & 1);
    df_tokenizer_free(t);
    return 0;
}
