/* warm.c — ranking routed experts for `deltafin warm` (see hub.h).
 *
 * Owns: reading a router trace (the JSON lines `--trace FILE` writes:
 * {"step", "layer", "experts": [...], "weights": [...]}) or heat statistics
 * (`--heat FILE`: {"format": "deltafin-heat-v1", "layers", "experts",
 * "heat": [[...]]}) into (layer, expert) pairs, hottest first. Ties are
 * broken by summed router weight, then by layer and expert, so the ranking
 * is a function of the file alone.
 * Refuses: files that are neither (the error names the file and the line);
 * layer or expert numbers beyond 1<<16 (not a model deltafin runs).
 * Fetching the ranked experts is mirror.c's (hub_warm).
 *
 * Sections: 1. the ranking table  2. traces  3. heat
 */
#include "hub.h"
#include "../base/err.h"
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_IDX = 1 << 16 };

/* ---- 1. the ranking table ---- */

typedef struct {
    int L, E;            /* allocated layers x experts */
    double *count, *wsum;
} table;

static int table_grow(table *t, int layer, int expert) {
    if (layer < t->L && expert < t->E) return 0;
    int L = layer >= t->L ? layer + 1 : t->L, E = expert >= t->E ? expert + 1 : t->E;
    double *c = calloc((size_t)L * (size_t)E, sizeof *c), *w = calloc((size_t)L * (size_t)E, sizeof *w);
    if (!c || !w) { free(c); free(w); return -1; }
    for (int l = 0; l < t->L; l++)
        for (int e = 0; e < t->E; e++) {
            c[(size_t)l * E + e] = t->count[(size_t)l * t->E + e];
            w[(size_t)l * E + e] = t->wsum[(size_t)l * t->E + e];
        }
    free(t->count);
    free(t->wsum);
    t->count = c;
    t->wsum = w;
    t->L = L;
    t->E = E;
    return 0;
}

static const table *g_rank_t; /* qsort has no context pointer; ranking is not hot */

static int by_rank(const void *x, const void *y) {
    const hub_rank *a = x, *b = y;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    const table *t = g_rank_t;
    double wa = t->wsum[(size_t)a->layer * t->E + a->expert], wb = t->wsum[(size_t)b->layer * t->E + b->expert];
    if (wa != wb) return wa > wb ? -1 : 1;
    if (a->layer != b->layer) return a->layer < b->layer ? -1 : 1;
    return a->expert < b->expert ? -1 : a->expert > b->expert;
}

/* Every entry with a positive count, ranked; frees the table. */
static df_status table_rank(table *t, hub_rank **out, int *n, char *err) {
    int k = 0;
    for (size_t i = 0; i < (size_t)t->L * (size_t)t->E; i++) k += t->count[i] > 0;
    hub_rank *v = malloc((size_t)(k ? k : 1) * sizeof *v);
    if (!v) { free(t->count); free(t->wsum); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    k = 0;
    for (int l = 0; l < t->L; l++)
        for (int e = 0; e < t->E; e++)
            if (t->count[(size_t)l * t->E + e] > 0) v[k++] = (hub_rank){l, e, t->count[(size_t)l * t->E + e]};
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&mu);
    g_rank_t = t;
    qsort(v, (size_t)k, sizeof *v, by_rank);
    pthread_mutex_unlock(&mu);
    free(t->count);
    free(t->wsum);
    *out = v;
    *n = k;
    return DF_OK;
}

/* ---- 2. traces ---- */

df_status hub_rank_trace(const char *path, hub_rank **out, int *n, char *err) {
    *out = NULL;
    *n = 0;
    FILE *f = fopen(path, "r");
    if (!f) return df_fail(err, DF_ERR_IO, "%s: cannot open the trace", path);
    table t = {0};
    df_status st = DF_OK;
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0;
    while (st == DF_OK && getline(&line, &cap, f) >= 0) {
        lineno++;
        if (strspn(line, " \t\r\n") == strlen(line)) continue;
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        json_t *ex = json_object_get(o, "experts"), *w = json_object_get(o, "weights"), *ly = json_object_get(o, "layer");
        if (!json_is_integer(ly) || !json_is_array(ex)) {
            st = df_fail(err, DF_ERR_FORMAT, "%s:%d: not a router trace line (want {\"layer\": N, \"experts\": [...]})",
                         path, lineno);
            json_decref(o);
            break;
        }
        int layer = (int)json_integer_value(ly);
        for (size_t i = 0; st == DF_OK && i < json_array_size(ex); i++) {
            json_int_t e = json_integer_value(json_array_get(ex, i));
            if (layer < 0 || layer >= MAX_IDX || e < 0 || e >= MAX_IDX) {
                st = df_fail(err, DF_ERR_FORMAT, "%s:%d: layer %d / expert %lld out of range", path, lineno, layer, (long long)e);
                break;
            }
            if (table_grow(&t, layer, (int)e) != 0) { st = df_fail(err, DF_ERR_NOMEM, "out of memory"); break; }
            t.count[(size_t)layer * t.E + (size_t)e] += 1;
            t.wsum[(size_t)layer * t.E + (size_t)e] += json_number_value(json_array_get(w, i)); /* 0 if absent */
        }
        json_decref(o);
    }
    free(line);
    fclose(f);
    if (st != DF_OK) { free(t.count); free(t.wsum); return st; }
    if (!t.L) return df_fail(err, DF_ERR_FORMAT, "%s: the trace selects no experts", path);
    return table_rank(&t, out, n, err);
}

/* ---- 3. heat ---- */

df_status hub_rank_heat(const char *path, hub_rank **out, int *n, char *err) {
    *out = NULL;
    *n = 0;
    json_error_t je;
    json_t *o = json_load_file(path, 0, &je);
    if (!o) return df_fail(err, DF_ERR_FORMAT, "%s: %s", path, je.text);
    const char *fmt = json_string_value(json_object_get(o, "format"));
    json_t *rows = json_object_get(o, "heat");
    int L = (int)json_integer_value(json_object_get(o, "layers")), E = (int)json_integer_value(json_object_get(o, "experts"));
    if (!fmt || strcmp(fmt, "deltafin-heat-v1") || !json_is_array(rows) || L <= 0 || E <= 0 || L >= MAX_IDX ||
        E >= MAX_IDX || (int)json_array_size(rows) != L) {
        json_decref(o);
        return df_fail(err, DF_ERR_FORMAT, "%s: not deltafin heat statistics (format deltafin-heat-v1, heat [layers][experts])", path);
    }
    table t = {0};
    if (table_grow(&t, L - 1, E - 1) != 0) { json_decref(o); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    for (int l = 0; l < L; l++) {
        json_t *r = json_array_get(rows, (size_t)l);
        for (int e = 0; e < E && e < (int)json_array_size(r); e++) {
            double h = json_number_value(json_array_get(r, (size_t)e));
            if (h > 0) t.count[(size_t)l * E + e] = h;
        }
    }
    json_decref(o);
    return table_rank(&t, out, n, err);
}
