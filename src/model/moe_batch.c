/* moe_batch.c — routed experts run together on the CPU (see ffn.h, moe_batch_*).
 *
 * Owns the batch in moe_scratch: the experts of a layer that are ready at
 * once (their bytes in RAM) and the rows (token, slot pairs) that chose
 * them, gathered into one buffer. A batch runs as one parallel pass over
 * the gate and up rows of every expert, then every down (the activation
 * done by the chunk that computed its columns; a down projection starts
 * when its own expert's rows are done, not when every expert's are: see
 * "one pass" below). One expert at a time needs three dispatches per
 * expert, and with few rows per thread the cores wait on DRAM's ramp more
 * than they stream (16 threads on a 3072-row matrix get 192 rows each).
 * Every output is the same kernel on the same inputs as the one-expert path
 * (kernels.h: a row's value depends only on its weights and x), so the bits
 * do not change.
 *
 * At KN_AMX (three passes: gate and up, the activation, down) the input
 * rows of each expert with KN_AMX_MIN_N or more rows are packed once per
 * pass over the pool (gate and up share them), as mm()
 * does for one product: kn_matmul at KN_AMX packs its x for every chunk of
 * rows a thread claims, and a batch's chunks are ~150 rows of ~18-row
 * experts. Same bits (kn_amx_x_plan / kn_matmul_amx_x are kn_matmul's).
 *
 * Refuses: the device (experts queued there keep their own path), experts
 * with more rows than the batch holds (they run alone).
 */
#include "ffn.h"
#include "../base/err.h"
#include "../base/mem.h"
#include "../base/pool.h"
#include <stdlib.h>
#include <string.h>

enum { BATCH_ROWS = 64 }; /* (token, slot) rows a batch holds; decode needs K */

df_status moe_batch_new(moe_batch *b, int E, int dl, int inter) {
    memset(b, 0, sizeof *b);
    const size_t R = BATCH_ROWS, F = sizeof(float);
    b->cap = BATCH_ROWS;
    b->dl = dl;
    b->inter_cap = inter;
    b->x = malloc((size_t)E * sizeof *b->x);
    b->w = malloc((size_t)E * sizeof *b->w);
    b->off = malloc(((size_t)E + 1) * sizeof *b->off);
    b->tok = malloc(R * sizeof *b->tok);
    b->slot = malloc(R * sizeof *b->slot);
    b->in = mem_big_alloc(R * (size_t)dl * F);
    b->out = mem_big_alloc(R * (size_t)dl * F);
    b->g = mem_big_alloc(R * (size_t)inter * F);
    b->u = mem_big_alloc(R * (size_t)inter * F);
    b->px = calloc((size_t)E, sizeof *b->px);
    b->unit_x = malloc(R * sizeof *b->unit_x);
    b->unit_g = malloc(R * sizeof *b->unit_g);
    const int64_t wide = kn_px_len(dl > inter ? dl : inter);
    b->xp = mem_big_alloc(R * (size_t)wide * F);
    b->xpd = mem_big_alloc(R * (size_t)wide * F);
    b->xpo = malloc((size_t)E * sizeof *b->xpo);
    b->xpdo = malloc((size_t)E * sizeof *b->xpdo);
    b->left = malloc((size_t)E * sizeof *b->left);
    b->ready = malloc((size_t)E * sizeof *b->ready);
    if (!b->x || !b->w || !b->off || !b->tok || !b->slot || !b->in || !b->out || !b->g || !b->u || !b->px ||
        !b->unit_x || !b->unit_g || !b->xp || !b->xpd || !b->xpo || !b->xpdo || !b->left || !b->ready) {
        moe_batch_free(b);
        return DF_ERR_NOMEM;
    }
    b->off[0] = 0;
    return DF_OK;
}

void moe_batch_free(moe_batch *b) {
    if (!b) return;
    free(b->x); free(b->w); free(b->off); free(b->tok); free(b->slot);
    free(b->in); free(b->out); free(b->g); free(b->u);
    free(b->px); free(b->pxb); free(b->unit_x); free(b->unit_g); free(b->xp); free(b->xpo);
    free(b->xpd); free(b->xpdo); free((void *)b->left); free((void *)b->ready);
    memset(b, 0, sizeof *b);
}

int moe_batch_add(moe_scratch *s, const float *xin, int x, const ffn_weights *w) {
    moe_batch *b = &s->batch;
    const int dl = b->dl, cnt = s->pcnt[x], o = s->poff[x];
    if (!b->cap || b->rows + cnt > b->cap || b->n >= BATCH_ROWS) return 0;
    /* one shape per batch, the one the buffers were sized for */
    if (w->gate.cols != dl || w->down.rows != dl || w->gate.rows > b->inter_cap || w->up.rows != w->gate.rows ||
        (b->n && w->gate.rows != b->inter))
        return 0;
    if (b->n && xin != b->src) return 0; /* one input per batch: its rows are gathered when it runs */
    b->inter = w->gate.rows;
    b->src = xin;
    int r = b->rows;
    for (int i = 0; i < cnt; i++, r++) { /* group_pairs' order: by token */
        b->tok[r] = s->ptok[o + i];
        b->slot[r] = s->pslot[o + i];
    }
    b->x[b->n] = x;
    b->w[b->n] = *w;
    b->n++;
    b->off[b->n] = b->rows = r;
    return 1;
}

/* ---- the passes ---- */

typedef struct {
    df_engine *e;
    moe_batch *b;
    const ffn_act *act;
    const float *pin;  /* what the packing reads: b->in or b->g */
    int64_t pld;       /* its row length */
    int down;          /* pin is b->g, the down projections' input */
    float *ys;         /* where the outputs go: moe_scratch's ys, K rows a token */
    int K;
    int own[BATCH_ROWS]; /* px_prepare: the expert whose prepared input expert i reads (i: its own) */
} batch_job;

/* ---- KN_AMX: the inputs packed once per pass ---- */

static void pack_units(void *ctx, int64_t u0, int64_t u1, int tid) {
    (void)tid;
    const batch_job *j = ctx;
    const moe_batch *b = j->b;
    for (int64_t u = u0; u < u1; u++) {
        const int x = b->unit_x[u], g = b->unit_g[u];
        kn_amx_x_pack(&b->px[x], j->pin + (size_t)b->off[x] * (size_t)j->pld, g, g + 1);
    }
}

/* Packs every expert's input for the pass (down: the down projection's,
 * from b->g; else gate's and up's, from b->in). Experts left with
 * px[x].B == NULL (too few rows, other weight types, not KN_AMX, no memory)
 * run kn_matmul. */
static void amx_pack(df_engine *e, moe_batch *b, int down) {
    for (int x = 0; x < b->n; x++) b->px[x].B = NULL;
    if (e->level != KN_AMX) return;
    int64_t total = 0;
    int units = 0;
    for (int x = 0; x < b->n; x++) {
        const df_weight *w = down ? &b->w[x].down : &b->w[x].gate;
        kn_amx_x_plan(&b->px[x], w, b->off[x + 1] - b->off[x]);
        total += (b->px[x].gbytes * b->px[x].groups + 63) / 64 * 64;
    }
    if (!total) return;
    if (total > b->pxb_bytes) {
        free(b->pxb);
        b->pxb_bytes = 0;
        if (!(b->pxb = aligned_alloc(64, (size_t)total))) return;
        b->pxb_bytes = total;
    }
    uint8_t *B = b->pxb;
    for (int x = 0; x < b->n; x++) {
        const int64_t bytes = b->px[x].gbytes * b->px[x].groups;
        if (bytes <= 0) continue;
        b->px[x].B = B;
        B += (bytes + 63) / 64 * 64;
        for (int g = 0; g < b->px[x].groups; g++, units++) b->unit_x[units] = x, b->unit_g[units] = g;
    }
    batch_job j = {.e = e, .b = b, .pin = down ? b->g : b->in, .pld = down ? b->inter : b->dl, .down = down};
    pool_for(e->pool, units, 1, pack_units, &j);
}

/* ---- other levels: the inputs prepared once per pass (kn_px_*) ---- */

/* Where expert x's prepared input lies for gate and up (down 0) or for
 * down; NULL: none (kn_matmul reads the rows as they are). */
static float *px_of(const moe_batch *b, int down, int x) {
    const int64_t o = down ? b->xpdo[x] : b->xpo[x];
    return o < 0 ? NULL : (down ? b->xpd : b->xp) + o;
}

/* Expert x's input prepared for its down projection (down: from b->g into
 * xpd) or for gate and up (from b->in into xp), where px_plan placed it. */
static void prep_expert(df_engine *e, const moe_batch *b, int down, int x) {
    float *xp = px_of(b, down, x);
    if (!xp) return;
    const df_weight *w = down ? &b->w[x].down : &b->w[x].gate;
    const float *in = down ? b->g + (size_t)b->off[x] * b->inter : b->in + (size_t)b->off[x] * b->dl;
    kn_px_prep(e->level, w, in, 0, b->off[x + 1] - b->off[x], xp);
}

static void prep_experts(void *ctx, int64_t x0, int64_t x1, int tid) {
    (void)tid;
    const batch_job *j = ctx;
    for (int64_t x = x0; x < x1; x++)
        if (j->own[x] == x) prep_expert(j->e, j->b, j->down, (int)x);
}

/* Whether experts x and y read the same gathered rows (the same tokens in
 * the same order) in the same prepared form. */
static int same_rows(const moe_batch *b, int x, int y) {
    const int n = b->off[x + 1] - b->off[x];
    if (n != b->off[y + 1] - b->off[y] || b->w[x].gate.type != b->w[y].gate.type ||
        b->w[x].gate.scale_dtype != b->w[y].gate.scale_dtype)
        return 0;
    for (int i = 0; i < n; i++)
        if (b->tok[b->off[x] + i] != b->tok[b->off[y] + i]) return 0;
    return 1;
}

/* Places each expert's prepared input (xpo: gate's and up's; down: xpdo),
 * for the experts the AMX packing left and whose level reads x in a form of
 * its own; the others get -1. Experts that read the same rows share gate's
 * and up's (a decode token's K experts all read that token: one preparation,
 * not K); own[x] is the expert that prepares x's (own may be NULL for
 * down's, which no two experts share). Returns how many preparations there
 * are. */
static int px_plan(df_engine *e, moe_batch *b, int down, int *own) {
    int64_t at = 0, *o = down ? b->xpdo : b->xpo;
    int count = 0;
    for (int x = 0; x < b->n; x++) {
        const df_weight *w = down ? &b->w[x].down : &b->w[x].gate;
        const int64_t f = b->px[x].B ? 0 : kn_px_floats(e->level, w, b->off[x + 1] - b->off[x]);
        int by = x; /* the expert that prepares x's input */
        for (int y = 0; f > 0 && !down && y < x && by == x; y++)
            if (own[y] == y && o[y] >= 0 && same_rows(b, x, y)) by = y;
        if (own) own[x] = by;
        o[x] = f <= 0 ? -1 : by == x ? at : o[by];
        if (f > 0 && by == x) at += f, count++;
    }
    return count;
}

/* Prepares every expert's input that px_plan placed (down: from b->g into
 * xpd, else from b->in into xp), one pass over the pool (none for one). */
static void px_prepare(df_engine *e, moe_batch *b, int down) {
    batch_job j = {.e = e, .b = b, .down = down};
    const int count = px_plan(e, b, down, j.own);
    if (count == 1) prep_experts(&j, 0, b->n, 0);
    else if (count > 1) pool_for(e->pool, b->n, 1, prep_experts, &j);
}

/* Rows [lo, hi) of w for expert x: on its packed or prepared input when
 * there is one. */
static void expert_rows(const batch_job *j, int x, int down, const df_weight *w, const float *X, int n, float *Y,
                        int64_t ldy, int64_t lo, int64_t hi) {
    const kn_amx_x *px = &j->b->px[x];
    const float *xp = px_of(j->b, down, x);
    if (px->B && px->w->type == w->type && px->w->cols == w->cols) {
        kn_amx_x p = *px;
        p.w = w;
        kn_matmul_amx_x(&p, X, Y, ldy, lo, hi);
    } else if (xp) {
        kn_matmul_px(j->e->level, w, xp, n, Y, ldy, lo, hi);
    } else {
        kn_matmul(j->e->level, w, X, n, Y, ldy, lo, hi);
    }
}

/* ---- KN_AMX: three passes (gate and up, the activation, down) ---- */

/* Rows [i0, i1) of the gate+up pass: expert i / (2 I), then gate rows, then up rows. */
static void gateup_rows(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    batch_job *j = ctx;
    moe_batch *b = j->b;
    const int64_t I = b->inter;
    for (int64_t i = i0; i < i1;) {
        const int x = (int)(i / (2 * I));
        const int64_t r = i % (2 * I), mat_end = r < I ? I : 2 * I;
        const int64_t r1 = r + (i1 - i) < mat_end ? r + (i1 - i) : mat_end;
        const int up = r >= I, n = b->off[x + 1] - b->off[x];
        const df_weight *w = up ? &b->w[x].up : &b->w[x].gate;
        float *Y = (up ? b->u : b->g) + (size_t)b->off[x] * I;
        const int64_t lo = r - (up ? I : 0), hi = r1 - (up ? I : 0);
        if (n) expert_rows(j, x, 0, w, b->in + (size_t)b->off[x] * b->dl, n, Y + lo, I, lo, hi);
        i += r1 - r;
    }
}

/* Rows [r0, r1) of expert x's down projection. */
static void down_part(const batch_job *j, int x, int64_t r0, int64_t r1) {
    const moe_batch *b = j->b;
    const int n = b->off[x + 1] - b->off[x];
    if (n)
        expert_rows(j, x, 1, &b->w[x].down, b->g + (size_t)b->off[x] * b->inter, n,
                    b->out + (size_t)b->off[x] * b->dl + r0, b->dl, r0, r1);
}

/* Rows [i0, i1) of the down pass: expert i / dl, row i % dl. */
static void down_rows(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    const batch_job *j = ctx;
    const int64_t D = j->b->dl;
    for (int64_t i = i0; i < i1;) {
        const int64_t r = i % D, r1 = r + (i1 - i) < D ? r + (i1 - i) : D;
        down_part(j, (int)(i / D), r, r1);
        i += r1 - r;
    }
}

/* ---- other levels: one pass ----
 *
 * Indices [0, n I) are row pairs (expert i / I, gate and up row i % I),
 * then [n I, n I + n dl) down rows (expert, row). A chunk of pairs computes
 * its gate and up rows for all the expert's vectors and the activation of
 * those columns; whoever finishes an expert's last pairs prepares its down
 * input and marks it ready. The pool claims chunks in increasing order, so
 * by the time any thread holds a down row every pair has been claimed by a
 * running thread, and waiting for an expert to be ready cannot deadlock.
 * Each value is the same kernel on the same inputs as in the passes above
 * (the activation is elementwise), so the bits are the same; what goes is
 * the barrier between gate / up and down, the activation's pass and the
 * preparation's (a decode MoE layer: five passes -> one, the first
 * preparation included, which px_plan shares across the token's experts). */

static void pairs_part(batch_job *j, int x, int64_t lo, int64_t hi) {
    moe_batch *b = j->b;
    const int64_t I = b->inter;
    const int n = b->off[x + 1] - b->off[x];
    if (n) {
        const float *X = b->in + (size_t)b->off[x] * b->dl;
        float *G = b->g + (size_t)b->off[x] * I, *U = b->u + (size_t)b->off[x] * I;
        expert_rows(j, x, 0, &b->w[x].gate, X, n, G + lo, I, lo, hi);
        expert_rows(j, x, 0, &b->w[x].up, X, n, U + lo, I, lo, hi);
        for (int v = 0; v < n; v++) ffn_act_apply(j->e->level, j->act, G + v * I + lo, U + v * I + lo, hi - lo);
    }
    if (pool_count_done(&b->left[x], hi - lo)) {
        prep_expert(j->e, b, 1, x);
        atomic_store_explicit(&b->ready[x], 1, memory_order_release);
    }
}

static void one_pass_rows(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    batch_job *j = ctx;
    moe_batch *b = j->b;
    const int64_t I = b->inter, P = (int64_t)b->n * I, D = b->dl;
    for (int64_t i = i0; i < i1;) {
        if (i < P) {
            const int64_t end = i1 < P ? i1 : P, r = i % I, r1 = r + (end - i) < I ? r + (end - i) : I;
            pairs_part(j, (int)(i / I), r, r1);
            i += r1 - r;
            continue;
        }
        const int x = (int)((i - P) / D);
        const int64_t r = (i - P) % D, r1 = r + (i1 - i) < D ? r + (i1 - i) : D;
        pool_wait_flag(&b->ready[x]);
        down_part(j, x, r, r1);
        i += r1 - r;
    }
}

/* Rows [r0, r1) of the batch: their tokens' inputs gathered into b->in. */
static void gather_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const moe_batch *b = ((const batch_job *)ctx)->b;
    for (int64_t r = r0; r < r1; r++)
        memcpy(b->in + (size_t)r * b->dl, b->src + (size_t)b->tok[r] * b->dl, (size_t)b->dl * sizeof(float));
}

/* Rows [r0, r1): their outputs into their (token, slot) rows of j->ys. */
static void scatter_rows(void *ctx, int64_t r0, int64_t r1, int tid) {
    (void)tid;
    const batch_job *j = ctx;
    const moe_batch *b = j->b;
    for (int64_t r = r0; r < r1; r++)
        memcpy(j->ys + ((size_t)b->tok[r] * j->K + b->slot[r]) * b->dl, b->out + (size_t)r * b->dl,
               (size_t)b->dl * sizeof(float));
}

void moe_batch_run(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s) {
    moe_batch *b = &s->batch;
    if (!b->n) return;
    batch_job j = {.e = e, .b = b, .act = act, .ys = s->ys, .K = m->K};
    pool_for(e->pool, b->rows, 16, gather_rows, &j); /* (a decode token's K rows: on this thread) */
    /* at KN_AMX chunks of whole 32-row tiles (a partial tile costs a whole one) */
    const int64_t grain = e->level == KN_AMX ? 32 : 16;
    amx_pack(e, b, 0);
    px_prepare(e, b, 0);
    if (e->level != KN_AMX) {
        px_plan(e, b, 1, NULL); /* where down's inputs go; each is prepared when its expert's pairs finish */
        for (int x = 0; x < b->n; x++) {
            atomic_store_explicit(&b->left[x], b->inter, memory_order_relaxed);
            atomic_store_explicit(&b->ready[x], 0, memory_order_relaxed);
        }
        pool_for(e->pool, (int64_t)b->n * (b->inter + b->dl), grain, one_pass_rows, &j);
    } else {
        pool_for(e->pool, (int64_t)b->n * 2 * b->inter, grain, gateup_rows, &j);
        ffn_act_pool(e, act, b->g, b->u, (int64_t)b->rows * b->inter);
        amx_pack(e, b, 1);
        px_prepare(e, b, 1);
        pool_for(e->pool, (int64_t)b->n * b->dl, grain, down_rows, &j);
    }
    pool_for(e->pool, b->rows, 16, scatter_rows, &j);
}

void moe_batch_clear(moe_batch *b) { b->n = b->rows = 0; }
