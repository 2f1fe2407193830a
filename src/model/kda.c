/* kda.c — Kimi Delta Attention (see kda.h for the math and the state).
 *
 * Sections: binding (A_log: one value per head, the release's padding checked); scratch; pool jobs (the
 * short convolution per channel range and the recurrence per head, whose math
 * is kda_core.c's, run by kda_fast.c at the engine's kernel level with the
 * same bits); forward.
 */
#include "kda.h"
#include "kda_fast.h"
#include "../base/err.h"
#include "../base/mem.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- binding ---- */

void kda_a_mode_text(const kda_layer *k, int H, char *out, size_t cap) {
    if (k->a_mode == KDA_A_PER_HEAD_PADDED)
        snprintf(out, cap, "per head (first %d of %d values, rest zero: the K3 release layout)", H, k->a_stored);
    else
        snprintf(out, cap, "per head");
}

static int64_t numel(const st_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

df_status kda_bind(df_engine *e, const kda_shape *sh, const char *base, kda_layer *k, char *err) {
    memset(k, 0, sizeof *k);
    df_status st;
    int64_t P = (int64_t)sh->H * sh->D;
    if ((st = model_bind_at(e, base, "q_proj", P, sh->hidden, &k->q, err))) return st;
    if ((st = model_bind_at(e, base, "k_proj", P, sh->hidden, &k->k, err))) return st;
    if ((st = model_bind_at(e, base, "v_proj", P, sh->hidden, &k->v, err))) return st;
    if ((st = model_bind_at(e, base, "f_a_proj", sh->D, sh->hidden, &k->fa, err))) return st;
    if ((st = model_bind_at(e, base, "f_b_proj", P, sh->D, &k->fb, err))) return st;
    if ((st = model_bind_at(e, base, "b_proj", sh->H, sh->hidden, &k->b, err))) return st;
    if (sh->full_rank_gate) {
        if ((st = model_bind_at(e, base, "g_proj", P, sh->hidden, &k->g, err))) return st;
    } else {
        if ((st = model_bind_at(e, base, "g_a_proj", sh->D, sh->hidden, &k->ga, err))) return st;
        if ((st = model_bind_at(e, base, "g_b_proj", P, sh->D, &k->gb, err))) return st;
    }
    if ((st = model_bind_at(e, base, "o_proj", sh->hidden, P, &k->o, err))) return st;
    char name[DF_NAME];
    static const char *convs[3] = {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"};
    for (int i = 0; i < 3; i++) {
        tname(name, "%s%s", base, convs[i]);
        const st_tensor *t = st_find(e->st, name);
        if (t && numel(t) != P * sh->W)
            return df_fail(err, DF_ERR_MISMATCH, "tensor '%s' has %lld values, expected [%lld, 1, %d]",
                           name, (long long)numel(t), (long long)P, sh->W);
        if (!(k->conv[i] = model_vec_flat(e, name, P * sh->W, &st, err))) return st;
    }
    tname(name, "%sdt_bias", base);
    if (!(k->dt_bias = model_vec_flat(e, name, P, &st, err))) return st;
    tname(name, "%so_norm.weight", base);
    if (!(k->o_norm = model_vec_flat(e, name, sh->D, &st, err))) return st;
    /* A_log: one value per head. Stored as [H] / [1,1,H,1], or (the K3
     * release) as a longer vector whose first H values are the heads' and
     * whose tail is zero. Anything else is refused: a [D] vector with a
     * non-zero tail could be meant per key channel, and no reference reads
     * it so. */
    tname(name, "%sA_log", base);
    const st_tensor *t = st_find(e->st, name);
    if (!t) return df_fail(err, DF_ERR_MISMATCH, "tensor '%s' not found in %s", name, e->dir);
    int64_t n = numel(t);
    int non1 = 0;
    for (int i = 0; i < t->ndim; i++) non1 += t->shape[i] != 1;
    if (n < sh->H || (n > sh->H && non1 > 1) || n > ((int64_t)1 << 20))
        return df_fail(err, DF_ERR_MISMATCH,
                       "tensor '%s' has %lld values; expected one per head (%d, stored as [%d], [1, 1, %d, 1] "
                       "or, as the K3 release does, padded with zeros to a longer vector)",
                       name, (long long)n, sh->H, sh->H, sh->H);
    float *raw = model_vec_flat(e, name, n, &st, err);
    if (!raw) return st;
    k->a_mode = n == sh->H ? KDA_A_PER_HEAD : KDA_A_PER_HEAD_PADDED;
    k->a_stored = (int)n;
    for (int64_t i = sh->H; i < n; i++)
        if (raw[i] != 0.0f) {
            df_status bad = df_fail(err, DF_ERR_MISMATCH,
                                    "tensor '%s' has %lld values for %d heads and value %lld (%g) past the "
                                    "first %d is not zero: ambiguous (one per head padded, as the K3 release "
                                    "stores it, needs a zero tail; one per key channel is not how Moonshot's "
                                    "KimiDeltaAttention reads A_log). Store [%d] per-head values",
                                    name, (long long)n, sh->H, (long long)i, raw[i], sh->H, sh->H);
            free(raw);
            return bad;
        }
    k->a = malloc((size_t)P * sizeof(float));
    if (!k->a) { free(raw); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    for (int h = 0; h < sh->H; h++)
        for (int d = 0; d < sh->D; d++) k->a[h * sh->D + d] = expf(raw[h]);
    free(raw);
    k->dev = (df_accel_kda){sh->H, sh->D, sh->W, sh->has_lower_bound, sh->lower_bound, sh->norm_eps,
                            {k->conv[0], k->conv[1], k->conv[2]}, k->a, k->dt_bias, k->o_norm};
    return DF_OK;
}

void kda_free(kda_layer *k) {
    if (!k) return;
    for (int i = 0; i < 3; i++) free(k->conv[i]);
    free(k->a);
    free(k->dt_bias);
    free(k->o_norm);
    memset(k, 0, sizeof *k);
}

/* ---- scratch ---- */

df_status kda_scratch_new(const kda_shape *sh, int rows, kda_scratch *s) {
    memset(s, 0, sizeof *s);
    s->rows = rows;
    size_t C = (size_t)rows, F = sizeof(float), P = (size_t)sh->H * sh->D;
    s->qr = mem_big_alloc(C * P * F);
    s->kr = mem_big_alloc(C * P * F);
    s->vr = mem_big_alloc(C * P * F);
    s->f = mem_big_alloc(C * P * F);
    s->fa = mem_big_alloc(C * sh->D * F);
    s->gate = mem_big_alloc(C * P * F);
    s->gl = mem_big_alloc(C * sh->D * F);
    s->braw = mem_big_alloc(C * sh->H * F);
    s->o = mem_big_alloc(C * P * F);
    s->decay = mem_big_alloc(C * P * F);
    if (!s->qr || !s->kr || !s->vr || !s->f || !s->fa || !s->gate || !s->gl || !s->braw || !s->o || !s->decay) {
        kda_scratch_free(s);
        return DF_ERR_NOMEM;
    }
    return DF_OK;
}

void kda_scratch_free(kda_scratch *s) {
    if (!s) return;
    free(s->qr); free(s->kr); free(s->vr); free(s->f); free(s->fa); free(s->gate);
    free(s->gl); free(s->braw); free(s->o); free(s->decay);
    memset(s, 0, sizeof *s);
}

/* ---- pool jobs (the math is in kda_core.c) ---- */

enum { KDA_FOLD_MAX_N = 4 }; /* rows whose low-rank second halves run in the heads' pass */

typedef struct {
    const kda_shape *sh;
    const kda_params *p;
    float *state;
    const kda_io *io;
    int n;
    kn_level lv;                /* the engine's kernel level (the recurrence's bits do not depend on it) */
    float *decay;               /* [n][P] scratch of kda_recur_head_fast */
    /* the low-rank second halves, when this pass computes them (NULL:
     * io's f and gate are already there): the head's rows of fb on fa into
     * f (io->f), of gb on gl into gate (io->gate; gb NULL: a full-rank gate) */
    const df_weight *fb, *gb;
    const float *fa, *gl;
    float *f, *gate;
} job;

/* One head per index, in one pass over the pool: the head's q, k and v
 * channels through the short convolution (kda_conv_channel's bits, several
 * channels side by side), then its n tokens in order through S
 * (kda_recur_head's bits, on the kernel level's vectors). A head reads only
 * its own channels, so no pass between the two. */
static void conv_recur_heads(void *ctx, int64_t h0, int64_t h1, int tid) {
    (void)tid;
    job *j = ctx;
    const int D = j->sh->D;
    const int64_t P = (int64_t)j->sh->H * D;
    if (j->fb) { /* rows of one head depend on that head's rows alone: kn_matmul's bits for any split */
        kn_matmul(j->lv, j->fb, j->fa, j->n, j->f + h0 * D, P, h0 * D, h1 * D);
        if (j->gb) kn_matmul(j->lv, j->gb, j->gl, j->n, j->gate + h0 * D, P, h0 * D, h1 * D);
    }
    for (int which = 0; which < 3; which++)
        kda_conv_fast(j->lv, j->sh, j->p, j->state, which, (int)h0 * D, (int)h1 * D, j->n, j->io);
    for (int64_t h = h0; h < h1; h++)
        kda_recur_head_fast(j->lv, j->sh, j->p, j->state, (int)h, j->n, j->io, j->decay);
}

/* ---- forward ---- */

int kda_layer_on_device(df_engine *e, const kda_shape *sh, const kda_layer *k, void *dev_state, int n,
                        const float *xn, float *out, char *err) {
    const int full = sh->full_rank_gate;
    const df_weight *w[DF_KDA_MATS] = {&k->q, &k->k, &k->v, &k->fa, &k->fb, &k->b, full ? &k->g : NULL,
                                       full ? NULL : &k->ga, full ? NULL : &k->gb, &k->o};
    return acc_kda_layer(e->acc, &k->dev, dev_state, n, w, xn, out, err);
}

df_status kda_forward_batch(df_engine *e, const kda_shape *sh, const kda_layer *k, const kda_seg *seg, int nseg,
                            kda_scratch *s, const float *xn, float *out, char *err) {
    int64_t P = (int64_t)sh->H * sh->D;
    int n = 0;
    for (int i = 0; i < nseg; i++) n += seg[i].n;
    ASSERT(n <= s->rows);
    if (nseg == 1 && seg[0].dev_state) { /* the whole layer on the device, one host wait */
        int r = kda_layer_on_device(e, sh, k, seg[0].dev_state, n, xn, out, err);
        if (r < 0) return DF_ERR_IO;
        if (r > 0) return DF_OK;
    }
    /* the projections: every row of every segment in one product per matrix;
     * those of xn, then the two low-rank second halves (two host waits on
     * an accelerator instead of eight) */
    const mm_req first[6] = {{&k->q, xn, n, s->qr, P},          {&k->k, xn, n, s->kr, P},
                             {&k->v, xn, n, s->vr, P},          {&k->fa, xn, n, s->fa, sh->D},
                             {&k->b, xn, n, s->braw, sh->H},
                             sh->full_rank_gate ? (mm_req){&k->g, xn, n, s->gate, P} : (mm_req){&k->ga, xn, n, s->gl, sh->D}};
    mm_many(e, first, 6);
    /* a decode step's second halves in the heads' pass (one pass less);
     * else a pass of their own (a prompt's rows: x prepared once for all) */
    const int fold = n <= KDA_FOLD_MAX_N && !e->acc && model_host(e, &k->fb) &&
                     (sh->full_rank_gate || model_host(e, &k->gb));
    const mm_req second[2] = {{&k->fb, s->fa, n, s->f, P}, {&k->gb, s->gl, n, s->gate, P}};
    if (!fold) mm_many(e, second, sh->full_rank_gate ? 1 : 2);
    /* the conv + recurrence: each segment on its own state, its rows in order */
    for (int i = 0, off = 0; i < nseg; off += seg[i].n, i++) {
        size_t o = (size_t)off * P;
        if (seg[i].dev_state) {
            df_status st = acc_kda(e->acc, &k->dev, seg[i].dev_state, seg[i].n, s->qr + o, s->kr + o, s->vr + o,
                                   s->f + o, s->braw + (size_t)off * sh->H, s->gate + o, s->o + o, err);
            if (st != DF_OK) return st;
        } else {
            kda_params p = {{k->conv[0], k->conv[1], k->conv[2]}, k->a, k->dt_bias, k->o_norm};
            kda_io io = {s->qr + o, s->kr + o, s->vr + o, s->f + o, s->braw + (size_t)off * sh->H, s->gate + o,
                         s->o + o, seg[i].trail};
            job j = {sh, &p, seg[i].state, &io, seg[i].n, e->level, s->decay + o, NULL, NULL, NULL, NULL, NULL, NULL};
            if (fold) {
                j.fb = &k->fb, j.fa = s->fa + (size_t)off * sh->D, j.f = s->f + o, j.gate = s->gate + o;
                if (!sh->full_rank_gate) j.gb = &k->gb, j.gl = s->gl + (size_t)off * sh->D;
            }
            pool_for(e->pool, sh->H, 1, conv_recur_heads, &j);
        }
    }
    mm(e, &k->o, s->o, n, out, sh->hidden);
    return DF_OK;
}

df_status kda_forward_block(df_engine *e, const kda_shape *sh, const kda_layer *k, float *state, kda_scratch *blk,
                            kda_scratch *s, int n, const float *xn, float *out, char *err) {
    const int piece = blk && blk->rows >= n ? n : DF_CHUNK;
    for (int c0 = 0; c0 < n; c0 += piece) {
        const int cn = n - c0 < piece ? n - c0 : piece;
        df_status st = kda_forward(e, sh, k, state, NULL, NULL, piece > DF_CHUNK ? blk : s, cn,
                                   xn + (size_t)c0 * sh->hidden, out + (size_t)c0 * sh->hidden, err);
        if (st != DF_OK) return st;
    }
    return DF_OK;
}

df_status kda_forward(df_engine *e, const kda_shape *sh, const kda_layer *k, float *state, void *dev_state,
                      float *trail, kda_scratch *s, int n, const float *xn, float *out, char *err) {
    kda_seg seg = {state, dev_state, trail, n};
    return kda_forward_batch(e, sh, k, &seg, 1, s, xn, out, err);
}
