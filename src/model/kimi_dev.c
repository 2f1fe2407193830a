/* kimi_dev.c — the Kimi program's forward pass with its activations on the
 * device (prefix km_ / dev_).
 *
 * Owns: a pass's device rows (km_dev: a session's DF_CHUNK rows, or a
 * layer-major prompt block's, km_dev_floats / km_dev_place), a session's
 * device pass set-up (km_step_on_device: the rows and the layers' norm and
 * residual vectors there), and the pass itself (km_pass_dev): the residual
 * stream, K3's anchors, the norms and every product's input and output on
 * the device, attention per segment on its session's device state, the
 * host waiting only to route each MoE layer and for the logits. The layer
 * weights, the host pass and the program table are kimi.c's.
 */
#include "kimi_internal.h"
#include "../base/err.h"
#include "../kernels/ops.h"
#include <string.h>

#define AL16(x) (((int64_t)(x) + 15) & ~(int64_t)15)
/* Floats of a km_dev of `rows` rows. */
int64_t km_dev_floats(const km_model *m, int64_t rows, int dl, int K) {
    const int64_t A = m->max_anchors ? m->max_anchors : 1;
    return 4 * AL16(rows * m->H) + AL16(rows * dl) + AL16(rows * (K > 0 ? K : 1) * dl) + AL16(rows * A * m->H);
}

/* Points d's buffers into the device floats at p (km_dev_floats of them). */
void km_dev_place(km_dev *d, const km_model *m, float *p, int rows, int dl, int K) {
    const int64_t r = AL16((int64_t)rows * m->H);
    d->rows = rows;
    d->dh = p;
    d->dxin = p + r;
    d->dxn = p + 2 * r;
    d->dy = p + 3 * r;
    d->dxl = p + 4 * r;
    d->dxg = d->dxl + AL16((int64_t)rows * dl);
    d->danc = d->dxg + AL16((int64_t)rows * (K > 0 ? K : 1) * dl);
}

/* The device pass's buffers and the layers' norm and residual vectors on
 * the device, when the accelerator keeps activations there and every
 * attention state is on the device too; else s->dv stays NULL (passes then
 * run the host-centred way). */
void km_step_on_device(df_engine *e, const km_model *m, km_state *s, int dl, int K) {
    if (!acc_has_dev(e->acc) || s->n_dev != m->n_kda || s->n_mla_dev != m->n_mla) return;
    const int64_t H = m->H, HA = AL16(H), L = m->L, rows = km_dev_floats(m, DF_CHUNK, dl, K);
    float *d = acc_dev_alloc(e->acc, rows + (4 * L + 2) * HA);
    if (!d) return;
    s->acc = e->acc;
    s->dv = d;
    s->HA = HA;
    km_dev_place(&s->dev, m, d, DF_CHUNK, dl, K);
    s->dnorm = d + rows;
    char err[DF_ERRMSG];
    df_status st = DF_OK;
    for (int64_t l = 0; st == DF_OK && l < L; l++) {
        const km_layer *y = &m->layers[l];
        const float *v[4] = {y->attn_norm, y->ffn_norm, y->res_attn, y->res_mlp};
        for (int k = 0; st == DF_OK && k < 4; k++)
            if (v[k]) st = acc_dev_put(e->acc, s->dnorm + (4 * l + k) * HA, v[k], H, err);
    }
    if (st == DF_OK) st = acc_dev_put(e->acc, s->dnorm + 4 * L * HA, m->final_norm, H, err);
    if (st == DF_OK && m->res_out) st = acc_dev_put(e->acc, s->dnorm + (4 * L + 1) * HA, m->res_out, H, err);
    if (st != DF_OK) {
        acc_dev_free(e->acc, d);
        s->dv = NULL;
    }
}
#undef AL16


/* K3's attention residual of the n rows cur over their first na anchors
 * into the device rows d->dxin (probe w: its device copy wd), or cur itself
 * without attention residuals: the input the next norm reads. */
static const float *dev_res(df_engine *e, const km_model *m, const km_pass *p, const float *cur, const float *wd,
                            const float *w, int na, int n, df_status *st, char *err) {
    if (m->block <= 0 || na == 0 || *st != DF_OK) return cur;
    const int H = m->H, A = m->max_anchors;
    const km_dev *d = p->d;
    *st = acc_dev_attn_res(e->acc, d->dxin, d->danc, (int64_t)A * H, na, cur, wd, n, H, m->eps, err);
    if (*st != DF_ERR_UNSUPPORTED) return d->dxin;
    /* more anchors than the device's kernel takes: this mix on the host
     * (the anchors and rows brought over, the result put back) */
    *st = acc_dev_get(e->acc, p->anchors, d->danc, (int64_t)n * A * H, err);
    if (*st == DF_OK) *st = acc_dev_get(e->acc, p->y, cur, (int64_t)n * H, err);
    for (int t = 0; *st == DF_OK && t < n; t++)
        op_attn_res(p->anchors + (size_t)t * A * H, na, p->y + (size_t)t * H, w, H, m->eps, p->xin + (size_t)t * H);
    if (*st == DF_OK) *st = acc_dev_put(e->acc, d->dxin, p->xin, (int64_t)n * H, err);
    return d->dxin;
}

/* The residual stream's step before a norm, for the n device rows d->dh:
 * h = x (restart) or h + x when x is set; h kept as anchor na when anchor
 * is set; K3's attention residual over the na anchors before it (probe pd
 * on the device, pw on the host); then the RMSNorm with nw into d->dxn.
 * One device call where the accelerator takes it (dev_res_norm), else the
 * steps one by one: the same bits either way. */
static df_status dev_step(df_engine *e, const km_model *m, const km_pass *p, const float *x, int restart, int anchor,
                          int na, const float *pd, const float *pw, const float *nw, int n, char *err) {
    const int H = m->H, A = m->max_anchors;
    const int64_t nh = (int64_t)n * H;
    const km_dev *d = p->d;
    acc_table *t = e->acc;
    float *ao = anchor ? d->danc + (int64_t)na * H : NULL;
    df_status st = acc_dev_res_norm(t, d->dxn, d->dh, x, restart, ao, d->danc, (int64_t)A * H,
                                    m->block > 0 ? na : 0, pd, nw, n, H, m->eps, err);
    if (st != DF_ERR_UNSUPPORTED) return st;
    st = DF_OK;
    if (x) st = restart ? acc_dev_copy(t, d->dh, x, nh, err) : acc_dev_add(t, d->dh, x, nh, err);
    const float *xin = dev_res(e, m, p, d->dh, pd, pw, na, n, &st, err);
    for (int r = 0; anchor && st == DF_OK && r < n; r++) /* each row's anchor */
        st = acc_dev_copy(t, d->danc + ((int64_t)r * A + na) * H, d->dh + (int64_t)r * H, H, err);
    if (st == DF_OK) st = acc_dev_rmsnorm(t, d->dxn, xin, nw, n, H, m->eps, err);
    return st;
}

/* One layer's attention for the device rows d->dxn into d->dy, segment by
 * segment on its session's state: the whole layer on the device, else (a
 * matrix the device does not take) on the host over rows brought there
 * and back, DF_CHUNK rows at a time (the session's attention scratch). */
static df_status dev_attention(df_engine *e, const km_model *m, const km_pass *p, const km_layer *y,
                               const df_fwd_seg *seg, int nseg, char *err) {
    const int H = m->H;
    km_state *s = p->s;
    for (int i = 0, off = 0; i < nseg; off += seg[i].n, i++) {
        km_state *si = seg[i].state;
        const int n = seg[i].n;
        const float *x = p->d->dxn + (size_t)off * H;
        float *o = p->d->dy + (size_t)off * H;
        int r = y->kda ? kda_layer_on_device(e, &m->kda, &y->k, si->kda_dev[y->slot], n, x, o, err)
                       : mla_layer_on_device(e, &m->mla, &y->a, si->mla_dev[y->slot], seg[i].pos, n, x, o, err);
        if (r < 0) return DF_ERR_IO;
        if (r > 0) continue;
        for (int c0 = 0; c0 < n; c0 += DF_CHUNK) {
            const int cn = n - c0 < DF_CHUNK ? n - c0 : DF_CHUNK;
            df_status st = acc_dev_get(e->acc, p->xn, x + (size_t)c0 * H, (int64_t)cn * H, err);
            if (st != DF_OK) return st;
            if (y->kda) {
                kda_seg ks = {si->kda_state + y->slot * kda_state_floats(&m->kda), si->kda_dev[y->slot], NULL, cn};
                st = kda_forward_batch(e, &m->kda, &y->k, &ks, 1, &s->kda, p->xn, p->y, err);
            } else {
                int64_t cstride = (int64_t)si->max_ctx * mla_cache_floats_per_pos(&m->mla);
                mla_seg ms = {si->mla_cache + y->slot * cstride, si->mla_dev[y->slot], &si->mla, seg[i].pos + c0, cn};
                st = mla_forward_batch(e, &m->mla, &y->a, &ms, 1, &s->mla, p->xn, p->y, err);
            }
            if (st == DF_OK) st = acc_dev_put(e->acc, o + (size_t)c0 * H, p->y, (int64_t)cn * H, err);
            if (st != DF_OK) return st;
        }
    }
    return DF_OK;
}

/* The head over the n device rows d->dh (plus x, the last layer's output):
 * the output attention residual and the final norm of every row, then the
 * product for the rows the segments want (each one's last, or all of its
 * rows; moved together into d->dxin first when they are not all the rows)
 * into their outputs. */
static df_status dev_head(df_engine *e, const km_model *m, const km_pass *p, const df_fwd_seg *seg, int nseg, int n,
                          const float *x, int na, char *err) {
    const int H = m->H, V = e->cfg.vocab_size;
    const km_dev *d = p->d;
    const int64_t HA = p->s->HA, L = m->L;
    const float *nv = p->s->dnorm;
    df_status st = dev_step(e, m, p, x, 0, 0, na, nv + (4 * L + 1) * HA, m->res_out, nv + 4 * L * HA, n, err);
    int rows = 0;
    for (int i = 0; i < nseg; i++)
        if (seg[i].out) rows += seg[i].all_rows ? seg[i].n : 1;
    if (st != DF_OK || !rows) return st;
    const float *hx = d->dxn;
    if (rows < n) { /* the wanted rows together, in order */
        hx = d->dxin;
        for (int i = 0, off = 0, r = 0; st == DF_OK && i < nseg; off += seg[i].n, i++) {
            if (!seg[i].out) continue;
            for (int t = seg[i].all_rows ? 0 : seg[i].n - 1; st == DF_OK && t < seg[i].n; t++, r++)
                st = acc_dev_copy(e->acc, d->dxin + (size_t)r * H, d->dxn + (size_t)(off + t) * H, H, err);
        }
    }
    if (st == DF_OK) st = model_enter(e, m->L, err);
    if (st != DF_OK) return st;
    double pt = prof_now(e);
    float *lg = nseg == 1 ? seg[0].out : model_batch_logits(e);
    if (!lg) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    const mm_req head = {&m->head, hx, rows, lg, V};
    st = mm_many_dev(e, &head, 1, err);
    if (st == DF_OK && nseg > 1) model_batch_scatter(seg, nseg, lg, V);
    prof_add(e, DF_PROF_HEAD, &pt);
    return st;
}

/* The pass's embedding rows into the device rows d->dh (*h: where the host
 * wrote them). Into the accelerator's stage when it offers one (page-locked
 * on CUDA: its upload needs no copy into staging first), a prompt's rows in
 * up to four pieces, each put as soon as it is written so that its upload
 * runs while the next is embedded; else into p->h, put at once. The same
 * rows either way (model_embed_tokens per row). */
static df_status dev_embed(df_engine *e, const km_model *m, const km_pass *p, const df_fwd_seg *seg, int nseg, int n,
                           int *rpos, int *rseg, const float **h, char *err) {
    const int H = m->H;
    acc_table *t = e->acc;
    float *stage = acc_dev_stage(t, (int64_t)n * H);
    float *hb = stage ? stage : p->h;
    *h = hb;
    if (!stage || nseg > 1) {
        for (int i = 0, off = 0; i < nseg; off += seg[i].n, i++)
            km_embed_rows(e, m, hb, &seg[i], i, off, nseg > 1 ? rpos : NULL, nseg > 1 ? rseg : NULL);
        return acc_dev_put(t, p->d->dh, hb, (int64_t)n * H, err);
    }
    const int piece = ((n + 3) / 4 + 15) / 16 * 16; /* rows, a multiple of the pool's grain */
    df_status st = DF_OK;
    for (int r0 = 0; st == DF_OK && r0 < n; r0 += piece) {
        const int cn = n - r0 < piece ? n - r0 : piece;
        model_embed_tokens(e, &m->embed, seg[0].tokens + r0, cn, hb + (size_t)r0 * H);
        st = acc_dev_put(t, p->d->dh + (size_t)r0 * H, hb + (size_t)r0 * H, (int64_t)cn * H, err);
    }
    return st;
}

/* A forward pass with its activations on the device (p's rows: n <=
 * p->d->rows; several sessions' rows of km_forward_batch, or one block of
 * a layer-major prompt): the same layers with the residual stream, K3's
 * anchors, the norms and every product's input and output kept there,
 * attention per segment on its session's device state; the host waits to
 * route each MoE layer (its router logits come back) and for the logits.
 * Each row's values are those of the same row alone (per-row operations,
 * products whose rows do not depend on their neighbours), within the
 * device kernels' bounds of the host-centred pass (norms and residual
 * mixes run on the device). */
df_status km_pass_dev(df_engine *e, const km_pass *p, const df_fwd_seg *seg, int nseg, int n, char *err) {
    km_model *m = e->prog;
    const km_dev *d = p->d;
    acc_table *t = e->acc;
    const int64_t HA = p->s->HA;
    if (n > d->rows || (nseg > 1 && n > DF_CHUNK)) return DF_ERR_ARG;
    int rpos[DF_CHUNK], rseg[DF_CHUNK];
    acc_count_device_pass(t);
    double pt = prof_now(e);
    const float *h = NULL;
    df_status st = dev_embed(e, m, p, seg, nseg, n, rpos, rseg, &h, err);
    p->moe->rpos = nseg > 1 ? rpos : NULL;
    p->moe->rseg = nseg > 1 ? rseg : NULL;
    if (st == DF_OK) km_early_lookahead(e, m, p->moe, h, p->xn, n);
    prof_add(e, DF_PROF_EMBED, &pt);
    int na = 0;
    const float *ffn_out = NULL; /* the last layer's MLP output, added to h by the next step */
    for (int l = 0; st == DF_OK && l < m->L; l++) {
        const km_layer *y = &m->layers[l];
        const float *nv = p->s->dnorm + (int64_t)l * 4 * HA; /* attn_norm, ffn_norm, res_attn, res_mlp */
        if ((st = model_enter(e, l, err)) != DF_OK) break;
        pt = prof_now(e);
        const int restart = m->block > 0 && l % m->block == 0;
        st = dev_step(e, m, p, ffn_out, 0, restart, na, nv + 2 * HA, y->res_attn, nv, n, err);
        na += restart;
        prof_add(e, DF_PROF_NORMS, &pt);
        if (st == DF_OK) st = dev_attention(e, m, p, y, seg, nseg, err);
        prof_add(e, y->kda ? DF_PROF_KDA : DF_PROF_MLA, &pt);
        if (st == DF_OK) st = dev_step(e, m, p, d->dy, restart, 0, na, nv + 3 * HA, y->res_mlp, nv + HA, n, err);
        prof_add(e, DF_PROF_NORMS, &pt);
        if (st != DF_OK) break;
        const moe_layer *next = l + 1 < m->L && m->layers[l + 1].moe ? &m->layers[l + 1].experts : NULL;
        moe_dev dv = {n, d->dxn, d->dxl, d->dy, d->dxg, NULL, 0, DF_OK};
        st = ffn_block_dev(e, y->moe ? &y->experts : NULL, &y->mlp, next, &m->act, p->moe, &dv, p->xn, seg[0].pos,
                           p->y, &pt, err);
        ffn_out = d->dy;
    }
    p->moe->rpos = NULL;
    p->moe->rseg = NULL;
    return st == DF_OK ? dev_head(e, m, p, seg, nseg, n, ffn_out, na, err) : st;
}

