/* fuzz_config.c — libFuzzer harness: config.json -> df_config (cfg_load,
 * src/format/config.c and config_kimi.c), read through an in-memory df_io
 * table.
 *
 * Input: the bytes of config.json. Checks, beyond the sanitizers and the
 * descriptor count: a loaded config names an architecture, has positive
 * sizes, a layer count within DF_MAX_LAYERS and NUL-terminated strings;
 * cfg_is_moe_layer answers for every layer (and out of range) without
 * dividing by zero.
 */
#include "common.h"
#include "../../src/format/config.h"
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fz_memfs *fs;
    if (!fs) fs = fz_memfs_new("/fz");
    fz_memfs_add(fs, "config.json", data, size);
    static df_config c; /* 1 KB of layer flags: not on the stack per run */
    char err[DF_ERRMSG];
    err[0] = 0;
    df_status st = cfg_load("/fz", fz_memfs_io(fs), &c, err);
    fz_memfs_reset(fs);
    if (st != DF_OK) {
        if (!err[0] || !memchr(err, 0, sizeof err)) fz_die("an error without a message");
        fz_note("%s", err);
        return 0;
    }
    if (c.arch < ARCH_DEEPSEEK_V3 || c.arch > ARCH_KIMI_K3) fz_die("arch %d", (int)c.arch);
    if (c.num_hidden_layers < 1 || c.num_hidden_layers > DF_MAX_LAYERS || c.hidden_size < 1 || c.vocab_size < 1)
        fz_die("accepted %d layers, hidden %d, vocab %d", c.num_hidden_layers, c.hidden_size, c.vocab_size);
    if (!memchr(c.model_type, 0, sizeof c.model_type) || !memchr(c.prefix, 0, sizeof c.prefix) ||
        !memchr(c.lm_head, 0, sizeof c.lm_head) || !memchr(c.hidden_act, 0, sizeof c.hidden_act))
        fz_die("a string field is not terminated");
    int moe = 0;
    for (int l = -1; l <= c.num_hidden_layers; l++) moe += cfg_is_moe_layer(&c, l);
    if (moe > c.num_hidden_layers) fz_die("%d MoE layers of %d", moe, c.num_hidden_layers);
    return 0;
}
