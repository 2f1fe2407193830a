/* mla.c — absorbed Multi-head Latent Attention over the compact cache.
 *
 * Sections: binding; scratch; the three parallel stages (absorb queries,
 * attend, lift values); forward. See mla.h for the cache layout; the
 * attention and cache-row math are mla_core.c's.
 */
#include "mla.h"
#include "../base/err.h"
#include "../base/mem.h"
#include "../kernels/ops.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- binding ---- */

static float *vec(df_engine *e, const char *base, const char *leaf, int64_t n, df_status *st, char *err) {
    char name[DF_NAME];
    tname(name, "%s%s", base, leaf);
    return model_vec(e, name, n, st, err);
}

df_status mla_bind(df_engine *e, const mla_shape *sh, const char *base, int gate, mla_layer *a,
                   char *err) {
    df_status st = DF_OK;
    memset(a, 0, sizeof *a);
    int64_t qdim = (int64_t)sh->nh * sh->dq;
    if (sh->qlr > 0) {
        if ((st = model_bind_at(e, base, "q_a_proj", sh->qlr, sh->hidden, &a->q_a, err))) return st;
        if (!(a->q_a_norm = vec(e, base, "q_a_layernorm.weight", sh->qlr, &st, err))) return st;
        if ((st = model_bind_at(e, base, "q_b_proj", qdim, sh->qlr, &a->q_b, err))) return st;
    } else if ((st = model_bind_at(e, base, "q_proj", qdim, sh->hidden, &a->q, err))) return st;
    if ((st = model_bind_at(e, base, "kv_a_proj_with_mqa", sh->R + sh->dr, sh->hidden, &a->kv_a, err))) return st;
    if (!(a->kv_a_norm = vec(e, base, "kv_a_layernorm.weight", sh->R, &st, err))) return st;
    if ((st = model_bind_at(e, base, "kv_b_proj", (int64_t)sh->nh * (sh->dn + sh->dv), sh->R, &a->kv_b, err))) return st;
    if ((st = model_bind_at(e, base, "o_proj", sh->hidden, (int64_t)sh->nh * sh->dv, &a->o, err))) return st;
    if (gate) {
        a->has_gate = 1;
        if ((st = model_bind_at(e, base, "g_proj", (int64_t)sh->nh * sh->dv, sh->hidden, &a->g, err))) return st;
    }
    a->dev = (df_accel_mla){sh->nh, sh->dn, sh->dr, sh->dv, sh->R, sh->use_rope, sh->rope_interleave, sh->inv_freq,
                            sh->rope_mscale, sh->softmax_scale, sh->latent_eps, a->kv_a_norm, &a->kv_b,
                            sh->qlr > 0 ? a->q_a_norm : NULL, sh->qlr > 0 ? sh->qlr : 0, a->has_gate};
    return DF_OK;
}

void mla_free(mla_layer *a) {
    if (!a) return;
    free(a->q_a_norm);
    free(a->kv_a_norm);
    a->q_a_norm = a->kv_a_norm = NULL;
}

/* ---- scratch ---- */

df_status mla_scratch_new(const mla_shape *sh, int threads, int max_ctx, int rows, mla_scratch *s) {
    const size_t C = (size_t)rows, P = rows < DF_CHUNK ? (size_t)rows : DF_CHUNK, F = sizeof(float);
    memset(s, 0, sizeof *s);
    s->rows = rows;
    s->tstride = mla_head_scratch_floats(sh, max_ctx);
    s->qa = mem_big_alloc(C * (sh->qlr ? sh->qlr : 1) * F);
    s->q = mem_big_alloc(C * sh->nh * sh->dq * F);
    s->kva = mem_big_alloc(C * (sh->R + sh->dr) * F);
    s->qlat = mem_big_alloc(P * sh->nh * sh->R * F);
    s->olat = mem_big_alloc(P * sh->nh * sh->R * F);
    s->attn = mem_big_alloc(C * sh->nh * sh->dv * F);
    s->gate = mem_big_alloc(C * sh->nh * sh->dv * F);
    s->tscratch = threads > 0 ? mem_big_alloc((size_t)threads * s->tstride * F) : NULL;
    if (!s->qa || !s->q || !s->kva || !s->qlat || !s->olat || !s->attn || !s->gate || (threads > 0 && !s->tscratch)) {
        mla_scratch_free(s);
        return DF_ERR_NOMEM;
    }
    return DF_OK;
}

void mla_scratch_free(mla_scratch *s) {
    if (!s) return;
    free(s->qa); free(s->q); free(s->kva); free(s->qlat); free(s->olat); free(s->attn);
    free(s->gate); free(s->tscratch);
    memset(s, 0, sizeof *s);
}

/* ---- parallel stages ---- */

int64_t mla_head_scratch_floats(const mla_shape *sh, int ctx) {
    /* W_UK[h] decoded for the absorb, then the attention's blocks: 16
     * queries' score rows up to 8192 positions, fewer per block beyond */
    int64_t f = (int64_t)sh->dn * sh->R, a = kn_mla_attend_floats(sh->R, sh->dr, 16, ctx < 8192 ? ctx : 8192),
            b = kn_mla_attend_floats(sh->R, sh->dr, 1, ctx);
    if (a > f) f = a;
    if (b > f) f = b;
    return f > sh->R ? f : sh->R;
}

/* q_lat[h][t] = W_UK[h]^T q_nope[t][h]: sum over d ascending of q_nope[d] * W_UK[h][d].
 * A bf16 or row-int8 kv_b is read where it lies (decoding its rows into
 * scratch first cost two thirds of a decode step's heads); other types are
 * decoded. */
static void absorb(const mla_shape *sh, kn_level lv, const df_weight *kv_b, const float *q, int n, int h,
                   float *qlat, float *scratch) {
    const int64_t ldq = (int64_t)sh->nh * sh->dq, row0 = (int64_t)h * (sh->dn + sh->dv);
    const float *qh = q + (size_t)h * sh->dq;
    float *y = qlat + (size_t)h * n * sh->R;
    if (kv_b->type == WT_BF16 && kv_b->cols == sh->R) {
        kn_mla_rowsum_bf16(lv, qh, ldq, (const uint16_t *)kv_b->data + row0 * sh->R, sh->R, n, sh->dn, 0, sh->R, y,
                           sh->R);
        return;
    }
    if (kv_b->type == WT_I8_ROW && kv_b->cols == sh->R) { /* the int8 spine's */
        kn_mla_rowsum_i8(lv, qh, ldq, (const int8_t *)kv_b->data + row0 * sh->R, sh->R,
                         (const float *)kv_b->scale + row0, n, sh->dn, 0, sh->R, y, sh->R);
        return;
    }
    for (int d = 0; d < sh->dn; d++) kn_dequant_row(kv_b, row0 + d, scratch + (size_t)d * sh->R);
    kn_mla_rowsum(lv, qh, ldq, scratch, sh->R, n, sh->dn, 0, sh->R, y, sh->R);
}

/* attn[t][h*dv..] = W_UV[h] o_lat[h][t] */
static void lift(const mla_shape *sh, kn_level lv, const df_weight *kv_b, int n, int h, const float *olat,
                 float *attn) {
    int64_t r0 = (int64_t)h * (sh->dn + sh->dv) + sh->dn;
    kn_matmul(lv, kv_b, olat + (size_t)h * n * sh->R, n, attn + (size_t)h * sh->dv, (int64_t)sh->nh * sh->dv, r0,
              r0 + sh->dv);
}

void mla_head(const mla_shape *sh, kn_level lv, const df_weight *kv_b, const float *cache, const float *q, int pos,
              int n, int h, float *qlat, float *olat, float *attn, float *scratch) {
    const int64_t ldq = (int64_t)sh->nh * sh->dq;
    absorb(sh, lv, kv_b, q, n, h, qlat, scratch);
    /* softmax attention over the cached latents (mla_attend_one per token, bit for bit) */
    kn_mla_attend(lv, cache, sh->R, sh->dr, sh->softmax_scale, qlat + (size_t)h * n * sh->R,
                  q + (size_t)h * sh->dq + sh->dn, ldq, pos, n, olat + (size_t)h * n * sh->R, scratch,
                  mla_head_scratch_floats(sh, pos + n));
    lift(sh, lv, kv_b, n, h, olat, attn);
}

void mla_heads(const mla_shape *sh, kn_level lv, const df_weight *kv_b, const float *cache, const float *q, int pos,
               int n, int h0, int h1, float *qlat, float *olat, float *attn, float *scratch) {
    if (n >= MLA_HEADS_IN_LANES_BELOW) { /* queries in the lanes, head by head */
        for (int h = h0; h < h1; h++) mla_head(sh, lv, kv_b, cache, q, pos, n, h, qlat, olat, attn, scratch);
        return;
    }
    const int64_t ldq = (int64_t)sh->nh * sh->dq, ldl = (int64_t)n * sh->R;
    for (int h = h0; h < h1; h++) absorb(sh, lv, kv_b, q, n, h, qlat, scratch);
    /* per token, the heads h0..h1-1 in the lanes (mla_attend_one per (head, token), bit for bit) */
    for (int t = 0; t < n; t++)
        kn_mla_attend_heads(lv, cache, sh->R, sh->dr, sh->softmax_scale, qlat + (size_t)h0 * ldl + (size_t)t * sh->R,
                            ldl, q + (size_t)t * ldq + (size_t)h0 * sh->dq + sh->dn, sh->dq, pos + t, h1 - h0,
                            olat + (size_t)h0 * ldl + (size_t)t * sh->R, ldl, scratch,
                            mla_head_scratch_floats(sh, pos + n));
    for (int h = h0; h < h1; h++) lift(sh, lv, kv_b, n, h, olat, attn);
}

typedef struct {
    df_engine *e;
    const mla_shape *sh;
    const mla_layer *a;
    const float *cache;
    mla_scratch *s;
    int pos, n;
    const float *q;              /* this segment's rows of s->q */
    float *attn;                 /* ... of s->attn */
    const float *gate;           /* ... of s->gate, or NULL: no output gate */
    float *tscratch;             /* [threads][tstride] of the segment's session */
    int64_t tstride;
} job;

/* attn[i] *= sigmoid(gate[i]) (the output gate), elementwise */
static void gate_apply(float *attn, const float *gate, int64_t n) {
    for (int64_t i = 0; i < n; i++) attn[i] *= op_sigmoid(gate[i]);
}

/* Heads [h0, h1) of the piece, then the output gate of their columns (the
 * heads' own pass, not one of its own: the same values, elementwise). */
static void heads(void *ctx, int64_t h0, int64_t h1, int tid) {
    job *j = ctx;
    mla_heads(j->sh, j->e->level, &j->a->kv_b, j->cache, j->q, j->pos, j->n, (int)h0, (int)h1, j->s->qlat,
              j->s->olat, j->attn, j->tscratch + (size_t)tid * j->tstride);
    if (!j->gate) return;
    const int64_t vdim = (int64_t)j->sh->nh * j->sh->dv, a = h0 * j->sh->dv, len = (h1 - h0) * j->sh->dv;
    for (int t = 0; t < j->n; t++) gate_apply(j->attn + t * vdim + a, j->gate + t * vdim + a, len);
}

typedef struct {
    float *attn;
    const float *gate;
} gate_job;

static void gate_part(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    const gate_job *g = ctx;
    gate_apply(g->attn + i0, g->gate + i0, i1 - i0);
}

/* ---- forward ---- */

int mla_layer_on_device(df_engine *e, const mla_shape *sh, const mla_layer *a, void *dev_cache, int pos, int n,
                        const float *xn, float *out, char *err) {
    const int lr = sh->qlr > 0;
    const df_weight *w[DF_MLA_MATS] = {lr ? &a->q_a : NULL, lr ? &a->q_b : NULL, lr ? NULL : &a->q, &a->kv_a,
                                       a->has_gate ? &a->g : NULL, &a->o};
    return acc_mla_layer(e->acc, &a->dev, dev_cache, pos, n, w, xn, out, err);
}

df_status mla_forward_batch(df_engine *e, const mla_shape *sh, const mla_layer *a, const mla_seg *seg, int nseg,
                            mla_scratch *s, const float *xn, float *out, char *err) {
    int qdim = sh->nh * sh->dq, vdim = sh->nh * sh->dv;
    int64_t stride = sh->R + sh->dr;
    int n = 0;
    for (int i = 0; i < nseg; i++) n += seg[i].n;
    ASSERT(n <= s->rows);
    if (nseg == 1 && seg[0].dev_cache) { /* the whole layer on the device, one host wait */
        int r = mla_layer_on_device(e, sh, a, seg[0].dev_cache, seg[0].pos, n, xn, out, err);
        if (r < 0) return DF_ERR_IO;
        if (r > 0) return DF_OK;
    }
    /* the products of xn at once (one host wait on an accelerator) */
    mm_req first[3] = {sh->qlr > 0 ? (mm_req){&a->q_a, xn, n, s->qa, sh->qlr} : (mm_req){&a->q, xn, n, s->q, qdim},
                       {&a->kv_a, xn, n, s->kva, stride}, {&a->g, xn, n, s->gate, vdim}};
    mm_many(e, first, a->has_gate ? 3 : 2);
    if (sh->qlr > 0) {
        for (int t = 0; t < n; t++)
            op_rmsnorm(s->qa + (size_t)t * sh->qlr, s->qa + (size_t)t * sh->qlr, a->q_a_norm, sh->qlr, sh->latent_eps);
        mm(e, &a->q_b, s->qa, n, s->q, qdim);
    }
    for (int i = 0, off = 0; i < nseg; off += seg[i].n, i++) {
        const mla_seg *g = &seg[i];
        float *q = s->q + (size_t)off * qdim, *kva = s->kva + (size_t)off * stride, *attn = s->attn + (size_t)off * vdim;
        if (g->dev_cache) {
            df_status st = acc_mla(e->acc, &a->dev, g->dev_cache, g->pos, g->n, q, kva, attn, err);
            if (st != DF_OK) return st;
            if (a->has_gate) { /* the host segments' rows are gated in their heads' pass */
                gate_job gj = {attn, s->gate + (size_t)off * vdim};
                pool_for(e->pool, (int64_t)g->n * vdim, 4096, gate_part, &gj);
            }
        } else {
            if (!model_host(e, &a->kv_b)) /* streamed, served by the device until a product failed */
                return df_fail(err, e->spine_fault ? e->spine_fault : DF_ERR_IO, "%s", e->spine_fault_msg);
            for (int t = 0; t < g->n; t++)
                mla_write_row(sh, a->kv_a_norm, kva + (size_t)t * stride, g->pos + t,
                              g->cache + (size_t)(g->pos + t) * stride, q + (size_t)t * sh->nh * sh->dq);
            const mla_scratch *ts = g->scratch ? g->scratch : s;
            ASSERT(ts->tscratch);
            /* the heads over pieces of up to DF_CHUNK rows (qlat / olat hold
             * that many; every row's bits are the same in any piece) */
            for (int p0 = 0; p0 < g->n; p0 += DF_CHUNK) {
                const int pn = g->n - p0 < DF_CHUNK ? g->n - p0 : DF_CHUNK;
                job j = {e, sh, a, g->cache, s, g->pos + p0, pn, q + (size_t)p0 * qdim, attn + (size_t)p0 * vdim,
                         a->has_gate ? s->gate + (size_t)(off + p0) * vdim : NULL, ts->tscratch, ts->tstride};
                /* decode: blocks of up to 16 heads (the lanes) per item, a share per thread */
                int grain = (sh->nh + pool_size(e->pool) - 1) / pool_size(e->pool);
                if (pn >= MLA_HEADS_IN_LANES_BELOW) grain = 1;
                pool_for(e->pool, sh->nh, grain < 16 ? grain : 16, heads, &j);
            }
        }
    }
    mm(e, &a->o, s->attn, n, out, sh->hidden);
    return DF_OK;
}

df_status mla_forward_block(df_engine *e, const mla_shape *sh, const mla_layer *a, float *cache, mla_scratch *blk,
                            mla_scratch *s, int pos, int n, const float *xn, float *out, char *err) {
    const int piece = blk && blk->rows >= n ? n : DF_CHUNK;
    for (int c0 = 0; c0 < n; c0 += piece) {
        const int cn = n - c0 < piece ? n - c0 : piece;
        mla_seg seg = {cache, NULL, s, pos + c0, cn}; /* s lends the per-thread attention rows */
        df_status st = mla_forward_batch(e, sh, a, &seg, 1, piece > DF_CHUNK ? blk : s, xn + (size_t)c0 * sh->hidden,
                                         out + (size_t)c0 * sh->hidden, err);
        if (st != DF_OK) return st;
    }
    return DF_OK;
}

df_status mla_forward(df_engine *e, const mla_shape *sh, const mla_layer *a, float *cache, void *dev_cache,
                      mla_scratch *s, int pos, int n, const float *xn, float *out, char *err) {
    mla_seg seg = {cache, dev_cache, NULL, pos, n};
    return mla_forward_batch(e, sh, a, &seg, 1, s, xn, out, err);
}
