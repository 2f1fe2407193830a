/* rule.c — the int8 spine's selection rule, its row quantiser and the
 * check of a converted folder against its checkpoint (see spine8.h).
 *
 * Refuses (s8_check): a folder without manifest.json (an unfinished
 * conversion is never used), a manifest of another format or version, a
 * source shard whose size or safetensors header changed since the
 * conversion, an int8 shard of the wrong size. Hashes of the int8 shards are
 * checked by `convert-spine --verify` (reading 57 GB at every open would
 * defeat the point); their sizes at every open.
 *
 * Sections: selection; quantiser; header hash; check.
 */
#include "spine8.h"
#include "../base/err.h"
#include "../hub/hub.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- selection ---- */

int s8_selected(const char *name, const st_tensor *t) {
    static const char *const never[] = {"conv1d", "norm", "A_log", "dt_bias", "res_proj", "e_score_correction_bias",
                                        "embed_tokens", "vision", "mm_projector"};
    size_t n = strlen(name);
    if (n < 7 || strcmp(name + n - 7, ".weight") != 0) return 0;
    if (strstr(name, ".experts.") && !strstr(name, "shared_experts")) return 0;
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++)
        if (strstr(name, never[i])) return 0;
    if (t->ndim != 2 || t->shape[0] < 1 || t->shape[1] < 1) return 0;
    return t->dtype == DT_BF16 || t->dtype == DT_F16 || t->dtype == DT_F32 || t->dtype == DT_F8_E4M3;
}

/* ---- quantiser ---- */

float s8_quantize_row(const float *w, int64_t n, int8_t *q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(w[i]);
        if (a > amax) amax = a;
    }
    float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    /* round half to even by adding and removing 1.5 * 2^23 (exact for
     * |v| < 2^22, and |v| <= 127 here): the same as rintf in the default
     * rounding mode, without a libm call per element */
    const volatile float magic_v = 12582912.0f;
    const float magic = magic_v;
    for (int64_t i = 0; i < n; i++) {
        float v = (w[i] / scale + magic) - magic;
        q[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : (int)v);
    }
    return scale;
}

/* ---- header hash ---- */

/* sha256 (hex) of a safetensors file's 8-byte length and JSON header. */
df_status s8_header_hash(const df_io *io, const char *path, int64_t *size, char hex[65], char *err) {
    int fd = io_open(io, path, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) return df_fail(err, DF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    df_status st = DF_OK;
    uint8_t lb[8];
    char *h = NULL;
    if (io_fsize(io, fd, size) != 0 || io_pread_full(io, fd, lb, 8, 0) != 0) {
        st = df_fail(err, DF_ERR_IO, "%s: cannot read its header: %s", path, strerror(errno));
        goto done;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | lb[i];
    if (n > ((uint64_t)100 << 20) || (int64_t)(8 + n) > *size) {
        st = df_fail(err, DF_ERR_FORMAT, "%s: header length %llu is not plausible", path, (unsigned long long)n);
        goto done;
    }
    h = malloc(n ? n : 1);
    if (!h || io_pread_full(io, fd, h, n, 8) != 0) {
        st = df_fail(err, DF_ERR_IO, "%s: cannot read its header", path);
        goto done;
    }
    hub_sha256 c;
    hub_sha256_init(&c);
    hub_sha256_update(&c, lb, 8);
    hub_sha256_update(&c, h, n);
    hub_sha256_hex(&c, hex);
done:
    free(h);
    io_close(io, fd);
    return st;
}

/* ---- check ---- */

df_status s8_check(const df_io *io, const char *model_dir, const char *s8_dir, int *absent, char *err) {
    char p[4200];
    *absent = 0;
    snprintf(p, sizeof p, "%s/%s", s8_dir, S8_MANIFEST);
    size_t len = 0;
    char *text = io_read_text(io, p, (size_t)64 << 20, &len);
    if (!text) {
        if (errno == ENOENT) { *absent = 1; return df_fail(err, DF_ERR_IO, "%s: no converted int8 spine (run `deltafin convert-spine %s`)", p, model_dir); }
        return df_fail(err, DF_ERR_IO, "%s: cannot read: %s", p, strerror(errno));
    }
    json_error_t je;
    json_t *m = json_loadb(text, len, 0, &je);
    free(text);
    if (!m) return df_fail(err, DF_ERR_FORMAT, "%s: not valid JSON (line %d: %s)", p, je.line, je.text);
    df_status st = DF_OK;
    const char *fmt = json_string_value(json_object_get(m, "format"));
    if (!fmt || strcmp(fmt, "deltafin-int8-spine") || json_integer_value(json_object_get(m, "version")) != 1) {
        st = df_fail(err, DF_ERR_FORMAT, "%s: not a deltafin int8 spine manifest (format deltafin-int8-spine, version 1)", p);
        goto done;
    }
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(m, "source"), i, v) {
        const char *f = json_string_value(json_object_get(v, "file"));
        const char *want = json_string_value(json_object_get(v, "header_sha256"));
        int64_t size = json_integer_value(json_object_get(v, "size")), got = -1;
        if (!f || !want || strchr(f, '/')) { st = df_fail(err, DF_ERR_FORMAT, "%s: source entry %zu is malformed", p, i); goto done; }
        char path[4200], hex[65] = "";
        snprintf(path, sizeof path, "%s/%s", model_dir, f);
        if ((st = s8_header_hash(io, path, &got, hex, err)) != DF_OK) goto done;
        if (got != size || strcmp(hex, want) != 0) {
            st = df_fail(err, DF_ERR_MISMATCH,
                         "%s: the checkpoint changed since its spine was converted (%s: %s); convert again "
                         "(`deltafin convert-spine %s --force`) or use --spine-dtype bf16",
                         s8_dir, f, got != size ? "size differs" : "header differs", model_dir);
            goto done;
        }
    }
    json_array_foreach(json_object_get(m, "shards"), i, v) {
        const char *f = json_string_value(json_object_get(v, "file"));
        int64_t size = json_integer_value(json_object_get(v, "size")), got = -1;
        if (!f || strchr(f, '/')) { st = df_fail(err, DF_ERR_FORMAT, "%s: shard entry %zu is malformed", p, i); goto done; }
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", s8_dir, f);
        int fd = io_open(io, path, O_RDONLY | O_CLOEXEC, 0);
        if (fd < 0 || io_fsize(io, fd, &got) != 0) got = -1;
        if (fd >= 0) io_close(io, fd);
        if (got != size) {
            st = df_fail(err, DF_ERR_MISMATCH, "%s: %s is %lld bytes, the manifest says %lld; convert again (--force)",
                         s8_dir, f, (long long)got, (long long)size);
            goto done;
        }
    }
done:
    json_decref(m);
    return st;
}
