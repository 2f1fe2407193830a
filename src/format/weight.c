/* weight.c — binding stored tensors to df_weight views (prefix wt_).
 *
 * Owns: recognising which stored layout a matrix uses (plain f32/bf16/f16,
 * DeepSeek fp8 with block scales, compressed-tensors int4 or mxfp4), checking
 * every shape against the rows x cols the caller derived from the config, and
 * loading small 1-D vectors to f32.
 * Refuses: any shape, dtype or companion tensor that does not match exactly;
 * it never guesses a transpose. Errors name the shard file, the tensor, what
 * was found and what was expected. Views borrow the st_set's memory.
 *
 * Sections: 1. names and sizes  2. shape checks  3. wt_bind  4. vectors
 */
#include "weight.h"
#include "../base/err.h"
#include <stdio.h>
#include <string.h>

/* ---- 1. names and sizes ----------------------------------------------------- */

const char *wt_type_name(wt_type t) {
    switch (t) {
    case WT_F32: return "f32";
    case WT_BF16: return "bf16";
    case WT_F16: return "f16";
    case WT_FP8_BLOCK: return "fp8-block";
    case WT_INT4_G32: return "int4-g32";
    case WT_MXFP4: return "mxfp4";
    case WT_I8_ROW: return "i8-row";
    case WT_NTYPES: break;
    }
    return "?";
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t wt_bytes(const df_weight *w) {
    int64_t n = w->rows * w->cols;
    switch (w->type) {
    case WT_F32: return n * 4;
    case WT_BF16: case WT_F16: return n * 2;
    case WT_FP8_BLOCK:
        return n + cdiv(w->rows, w->block_rows) * cdiv(w->cols, w->block_cols) * 4;
    case WT_INT4_G32: return n / 2 + w->rows * (w->cols / 32) * dtype_size(w->scale_dtype);
    case WT_MXFP4: return n / 2 + w->rows * (w->cols / 32);
    case WT_I8_ROW: return n + w->rows * 4;
    case WT_NTYPES: break;
    }
    return 0;
}

int64_t wt_data_row_bytes(const df_weight *w) {
    switch (w->type) {
    case WT_F32: return w->cols * 4;
    case WT_BF16: case WT_F16: return w->cols * 2;
    case WT_FP8_BLOCK: case WT_I8_ROW: return w->cols;
    case WT_INT4_G32: case WT_MXFP4: return w->cols / 2;
    case WT_NTYPES: break;
    }
    return 0;
}

/* ---- 2. shape checks --------------------------------------------------------- */

static void fmt_shape(char *buf, size_t cap, const int64_t *shape, int ndim) {
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

/* Checks t has exactly the 2-D shape [r, c]; `why` says where r, c came from. */
static df_status need_shape2(const st_set *s, const st_tensor *t, int64_t r, int64_t c,
                             const char *why, char *err) {
    if (t->ndim == 2 && t->shape[0] == r && t->shape[1] == c) return DF_OK;
    char got[128];
    fmt_shape(got, sizeof got, t->shape, t->ndim);
    return df_fail(err, DF_ERR_MISMATCH, "%s: tensor '%s' has shape %s, expected [%lld, %lld] (%s)",
                   st_shard_path(s, t->shard), t->name, got, (long long)r, (long long)c, why);
}

static const st_tensor *find2(const st_set *s, const char *base, const char *suffix, char *name,
                              size_t cap) {
    snprintf(name, cap, "%s%s", base, suffix);
    return st_find(s, name);
}

static df_status missing(const st_set *s, const char *name, const char *why, char *err) {
    return df_fail(err, DF_ERR_MISMATCH, "tensor '%s' not found in %s%s%s", name, st_dir(s),
                   why ? ": " : "", why ? why : "");
}

/* ---- 3. wt_bind ------------------------------------------------------------ */

static df_status bind_fp8(st_set *s, const char *base, const st_tensor *t, int64_t rows,
                          int64_t cols, int br, int bc, df_weight *w, int lazy, char *err) {
    char name[512], why[128];
    if (br <= 0) br = 128;
    if (bc <= 0) bc = 128;
    const st_tensor *sc = find2(s, base, ".weight_scale_inv", name, sizeof name);
    if (!sc) {
        snprintf(why, sizeof why, "'%s' is F8_E4M3 and needs its block scales", t->name);
        return missing(s, name, why, err);
    }
    if (sc->dtype != DT_F32)
        return df_fail(err, DF_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype %s, expected F32",
                       st_shard_path(s, sc->shard), sc->name, dtype_name(sc->dtype));
    snprintf(why, sizeof why, "ceil(%lld/%d), ceil(%lld/%d) blocks", (long long)rows, br,
             (long long)cols, bc);
    df_status st = need_shape2(s, sc, cdiv(rows, br), cdiv(cols, bc), why, err);
    if (st != DF_OK) return st;
    w->t_data = t;
    w->t_scale = sc;
    const void *d = NULL, *scale = NULL;
    if (!lazy) {
        d = st_data(s, t, err);
        scale = d ? st_data(s, sc, err) : NULL;
        if (!d || !scale) return DF_ERR_IO;
    }
    w->type = WT_FP8_BLOCK;
    w->data = d;
    w->scale = scale;
    w->scale_dtype = DT_F32;
    w->block_rows = br;
    w->block_cols = bc;
    return DF_OK;
}

/* compressed-tensors: weight_packed + weight_scale (+ weight_shape). */
static df_status bind_packed(st_set *s, const char *base, const st_tensor *p, int64_t rows,
                             int64_t cols, df_weight *w, int lazy, char *err) {
    char name[512], why[160];
    const char *path = st_shard_path(s, p->shard);
    int int4 = p->dtype == DT_I32;
    if (!int4 && p->dtype != DT_U8)
        return df_fail(err, DF_ERR_UNSUPPORTED,
                       "%s: tensor '%s' has dtype %s (I32 int4 or U8 mxfp4 packing supported)",
                       path, p->name, dtype_name(p->dtype));
    if (cols % 32 != 0)
        return df_fail(err, DF_ERR_MISMATCH,
                       "%s: tensor '%s': %lld columns is not a multiple of the group size 32",
                       path, p->name, (long long)cols);
    snprintf(why, sizeof why, "%s packing of [%lld, %lld]", int4 ? "int4 (8 per I32)" : "mxfp4 (2 per U8)",
             (long long)rows, (long long)cols);
    df_status st = need_shape2(s, p, rows, int4 ? cols / 8 : cols / 2, why, err);
    if (st != DF_OK) return st;

    const st_tensor *sc = find2(s, base, ".weight_scale", name, sizeof name);
    if (!sc) {
        snprintf(why, sizeof why, "'%s' is packed and needs its group scales", p->name);
        return missing(s, name, why, err);
    }
    if (int4 ? !(sc->dtype == DT_BF16 || sc->dtype == DT_F16 || sc->dtype == DT_F32)
             : sc->dtype != DT_U8)
        return df_fail(err, DF_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype %s, expected %s",
                       st_shard_path(s, sc->shard), sc->name, dtype_name(sc->dtype),
                       int4 ? "BF16, F16 or F32" : "U8 (e8m0)");
    snprintf(why, sizeof why, "one scale per 32 of %lld columns", (long long)cols);
    if ((st = need_shape2(s, sc, rows, cols / 32, why, err)) != DF_OK) return st;

    const st_tensor *shp = find2(s, base, ".weight_shape", name, sizeof name);
    if (shp) {
        const char *sp = st_shard_path(s, shp->shard);
        if ((shp->dtype != DT_I32 && shp->dtype != DT_I64) || shp->ndim != 1 || shp->shape[0] != 2)
            return df_fail(err, DF_ERR_MISMATCH,
                           "%s: tensor '%s' must be I32 or I64 of shape [2] (got %s, %d dims)", sp,
                           shp->name, dtype_name(shp->dtype), shp->ndim);
        const void *v = st_data(s, shp, err);
        if (!v) return DF_ERR_IO;
        int64_t r0, c0;
        if (shp->dtype == DT_I32) {
            int32_t x[2];
            memcpy(x, v, sizeof x);
            r0 = x[0];
            c0 = x[1];
        } else {
            int64_t x[2];
            memcpy(x, v, sizeof x);
            r0 = x[0];
            c0 = x[1];
        }
        if (r0 != rows || c0 != cols)
            return df_fail(err, DF_ERR_MISMATCH,
                           "%s: tensor '%s' says [%lld, %lld], expected [%lld, %lld]", sp,
                           shp->name, (long long)r0, (long long)c0, (long long)rows,
                           (long long)cols);
    }
    w->t_data = p;
    w->t_scale = sc;
    const void *d = NULL, *scale = NULL;
    if (!lazy) {
        d = st_data(s, p, err);
        scale = d ? st_data(s, sc, err) : NULL;
        if (!d || !scale) return DF_ERR_IO;
    }
    w->type = int4 ? WT_INT4_G32 : WT_MXFP4;
    w->data = d;
    w->scale = scale;
    w->scale_dtype = sc->dtype;
    return DF_OK;
}

/* Row-int8 (deltafin convert-spine): base.weight I8 [rows, cols] and
 * base.weight_scale F32 with one value per row ([rows] or [rows, 1]). */
static df_status bind_i8(st_set *s, const char *base, const st_tensor *t, int64_t rows, df_weight *w, int lazy,
                         char *err) {
    char name[512];
    const st_tensor *sc = find2(s, base, ".weight_scale", name, sizeof name);
    if (!sc) return missing(s, name, "an I8 weight needs one f32 scale per row", err);
    int64_t n = 1;
    for (int i = 0; i < sc->ndim; i++) n *= sc->shape[i];
    if (sc->dtype != DT_F32 || n != rows || sc->ndim < 1 || sc->ndim > 2 || sc->shape[0] != rows)
        return df_fail(err, DF_ERR_MISMATCH, "%s: tensor '%s' must be F32 [%lld] (one scale per row of '%s')",
                       st_shard_path(s, sc->shard), sc->name, (long long)rows, t->name);
    w->t_data = t;
    w->t_scale = sc;
    if (lazy) return DF_OK;
    w->data = st_data(s, t, err);
    w->scale = w->data ? st_data(s, sc, err) : NULL;
    return w->data && w->scale ? DF_OK : DF_ERR_IO;
}

static df_status bind_any(st_set *s, const char *base, int64_t rows, int64_t cols, int fp8_br,
                          int fp8_bc, df_weight *w, int lazy, char *err) {
    memset(w, 0, sizeof *w);
    w->rows = rows;
    w->cols = cols;
    char name[512];
    if (strlen(base) + 24 > sizeof name)
        return df_fail(err, DF_ERR_ARG, "tensor base name too long: '%.64s...'", base);
    const st_tensor *t = find2(s, base, ".weight", name, sizeof name);
    if (!t) {
        const st_tensor *p = find2(s, base, ".weight_packed", name, sizeof name);
        if (p) return bind_packed(s, base, p, rows, cols, w, lazy, err);
        snprintf(name, sizeof name, "%s.weight", base);
        return missing(s, name, NULL, err);
    }
    const char *path = st_shard_path(s, t->shard);
    switch (t->dtype) {
    case DT_F32: w->type = WT_F32; break;
    case DT_BF16: w->type = WT_BF16; break;
    case DT_F16: w->type = WT_F16; break;
    case DT_F8_E4M3: w->type = WT_FP8_BLOCK; break;
    case DT_I8: w->type = WT_I8_ROW; break;
    default:
        return df_fail(err, DF_ERR_UNSUPPORTED,
                       "%s: tensor '%s' has dtype %s (F32, BF16, F16, F8_E4M3 or I8 supported)", path,
                       t->name, dtype_name(t->dtype));
    }
    df_status st = need_shape2(s, t, rows, cols, "rows x cols from the config", err);
    if (st != DF_OK) return st;
    if (w->type == WT_FP8_BLOCK) return bind_fp8(s, base, t, rows, cols, fp8_br, fp8_bc, w, lazy, err);
    if (w->type == WT_I8_ROW) return bind_i8(s, base, t, rows, w, lazy, err);
    w->t_data = t;
    if (lazy) return DF_OK;
    w->data = st_data(s, t, err);
    return w->data ? DF_OK : DF_ERR_IO;
}

df_status wt_bind(st_set *s, const char *base, int64_t rows, int64_t cols, int fp8_br,
                  int fp8_bc, df_weight *w, char *err) {
    return bind_any(s, base, rows, cols, fp8_br, fp8_bc, w, 0, err);
}

df_status wt_bind_lazy(st_set *s, const char *base, int64_t rows, int64_t cols, int fp8_br,
                       int fp8_bc, df_weight *w, char *err) {
    return bind_any(s, base, rows, cols, fp8_br, fp8_bc, w, 1, err);
}

void wt_point(df_weight *w, const uint8_t *base, int64_t origin) {
    if (w->t_data) w->data = base + (w->t_data->offset - origin);
    if (w->t_scale) w->scale = base + (w->t_scale->offset - origin);
}

int wt_exists(const st_set *s, const char *base) {
    static const char *const sfx[] = {".weight", ".weight_packed", ".weight_scale",
                                      ".weight_scale_inv", ".weight_shape"};
    char name[512];
    for (size_t i = 0; i < sizeof sfx / sizeof sfx[0]; i++)
        if (find2(s, base, sfx[i], name, sizeof name)) return 1;
    return 0;
}

/* ---- 4. vectors -------------------------------------------------------------- */

static df_status load_values(st_set *s, const char *name, int64_t n, float *out, int any_shape,
                             char *err) {
    const st_tensor *t = st_find(s, name);
    if (!t) return missing(s, name, NULL, err);
    const char *path = st_shard_path(s, t->shard);
    if (t->dtype != DT_F32 && t->dtype != DT_BF16 && t->dtype != DT_F16)
        return df_fail(err, DF_ERR_UNSUPPORTED,
                       "%s: tensor '%s' has dtype %s (F32, BF16 or F16 supported)", path, t->name,
                       dtype_name(t->dtype));
    /* [n], or [n] with extra unit dimensions ([1, n], [1, 1, n, 1]). */
    int64_t count = 1;
    int big = 0;
    for (int i = 0; i < t->ndim; i++) {
        count *= t->shape[i];
        if (t->shape[i] != 1) big++;
    }
    if (count != n || (!any_shape && (big > 1 || t->ndim == 0))) {
        char got[128];
        fmt_shape(got, sizeof got, t->shape, t->ndim);
        return df_fail(err, DF_ERR_MISMATCH, "%s: tensor '%s' has shape %s, expected [%lld]", path,
                       t->name, got, (long long)n);
    }
    const void *d = st_data(s, t, err);
    if (!d) return DF_ERR_IO;
    const uint8_t *b = d;
    for (int64_t i = 0; i < n; i++) {
        if (t->dtype == DT_F32) {
            memcpy(&out[i], b + 4 * i, 4);
        } else {
            uint16_t h;
            memcpy(&h, b + 2 * i, 2);
            out[i] = t->dtype == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
    }
    return DF_OK;
}

df_status wt_load_vec(st_set *s, const char *name, int64_t n, float *out, char *err) {
    return load_values(s, name, n, out, 0, err);
}

df_status wt_load_flat(st_set *s, const char *name, int64_t n, float *out, char *err) {
    return load_values(s, name, n, out, 1, err);
}
