/* test_accel.c — the engine's accelerator plumbing (df_engine_opts.accel,
 * src/model/accel.c) with a CPU stand-in (suite model_accel_).
 *
 * The stand-in copies each uploaded matrix's bytes (as a device would) and
 * computes with kn_matmul at the engine's level, so every product must be
 * bit-identical to the plain CPU path whatever the placement: resident,
 * cached with evictions, transient, refused (f32 matrices stay on the CPU).
 * This checks keys (tied head, expert views over reused RAM slots), the LRU
 * budget, the device tier (experts with device copies are never read into
 * RAM again), the expert queue (outputs only at finish, RAM slots held until
 * then), KDA states and MLA caches on the "device" (kda_core.h / mla_head on
 * the stand-in's memory; a failing step resets the session), the page-locked
 * spine when it does not fit, and the fallbacks without a GPU; tests/cuda
 * checks the real one.
 */
#include "test.h"
#include "../src/format/weight.h"
#include "../src/kernels/kernels.h"
#include "../src/model/model.h"
#include "../src/kernels/ops.h"
#include "../src/model/kda_core.h"
#include "../src/model/mla.h"
#include "../src/model/ffn.h"
#include <math.h>
#include "deltafin.h"
#include <stdlib.h>
#include <string.h>

typedef struct {
    df_weight w;
    void *data, *scale;
} fake_h;

static int fake_live; /* handles not released */

static void *fake_upload(void *ctx, const void *weight, int *refused, char *err) {
    (void)ctx;
    const df_weight *w = weight;
    *refused = 0;
    if (w->type == WT_F32 || !w->t_data) {
        *refused = 1;
        snprintf(err, DF_ERRMSG, "fake: refused");
        return NULL;
    }
    fake_h *h = calloc(1, sizeof *h);
    h->w = *w;
    h->data = malloc((size_t)w->t_data->nbytes);
    memcpy(h->data, w->data, (size_t)w->t_data->nbytes);
    h->w.data = h->data;
    if (w->t_scale && w->scale) {
        h->scale = malloc((size_t)w->t_scale->nbytes);
        memcpy(h->scale, w->scale, (size_t)w->t_scale->nbytes);
        h->w.scale = h->scale;
    }
    fake_live++;
    return h;
}

static void fake_release(void *ctx, void *handle) {
    (void)ctx;
    fake_h *h = handle;
    /* poison, so a stale handle would show */
    memset(h->data, 0x7f, (size_t)h->w.t_data->nbytes);
    free(h->data);
    free(h->scale);
    free(h);
    fake_live--;
}

/* multiply-adds the stand-in ran (df_accel_stats.macs_* must sum to it) */
static uint64_t fake_macs;
static df_status fake_matmul(void *ctx, void *handle, const float *X, int n, float *Y, int64_t ldy, int64_t row0,
                             int64_t row1, char *err) {
    (void)err;
    fake_h *h = handle;
    kn_matmul(*(kn_level *)ctx, &h->w, X, n, Y, ldy, row0, row1);
    fake_macs += (uint64_t)(row1 - row0) * (uint64_t)h->w.cols * (uint64_t)n;
    return DF_OK;
}

/* matmul_many on the stand-in: each product as fake_matmul, counted. */
static int fake_many_calls;
static df_status fake_matmul_many(void *ctx, int count, void *const *handles, const float *const *X, const int *n,
                                  float *const *Y, const int64_t *ldy, char *err) {
    fake_many_calls++;
    for (int i = 0; i < count; i++) {
        const fake_h *h = handles[i];
        df_status st = fake_matmul(ctx, handles[i], X[i], n[i], Y[i], ldy[i], 0, h->w.rows, err);
        if (st != DF_OK) return st;
    }
    return DF_OK;
}

/* kda_layer on the stand-in: the products (fake_matmul) and fake_kda in the
 * engine's order, so the logits stay bit-identical. */
static int fake_kda_layer_calls;
static df_status fake_kda(void *ctx, const df_accel_kda *l, void *state, int n, const float *q, const float *k,
                          const float *v, const float *f, const float *braw, const float *gate, float *o, char *err);
static df_status fake_kda_layer(void *ctx, const df_accel_kda *l, void *state, int n, void *const *mats,
                                const float *xn, float *out, char *err) {
    fake_kda_layer_calls++;
    const int64_t P = (int64_t)l->H * l->D;
    const fake_h *h[DF_KDA_MATS];
    for (int i = 0; i < DF_KDA_MATS; i++) h[i] = mats[i];
    float *buf = malloc((size_t)n * (7 * P + l->H + 2 * l->D) * sizeof(float));
    float *q = buf, *k = q + n * P, *v = k + n * P, *f = v + n * P, *gate = f + n * P, *o = gate + n * P;
    float *braw = o + n * P, *fa = braw + n * l->H, *gl = fa + n * l->D;
    const int full = h[DF_KDA_G] != NULL;
    fake_matmul(ctx, mats[DF_KDA_Q], xn, n, q, P, 0, P, err);
    fake_matmul(ctx, mats[DF_KDA_K], xn, n, k, P, 0, P, err);
    fake_matmul(ctx, mats[DF_KDA_V], xn, n, v, P, 0, P, err);
    fake_matmul(ctx, mats[DF_KDA_FA], xn, n, fa, l->D, 0, l->D, err);
    fake_matmul(ctx, mats[DF_KDA_FB], fa, n, f, P, 0, P, err);
    fake_matmul(ctx, mats[DF_KDA_B], xn, n, braw, l->H, 0, l->H, err);
    if (full) fake_matmul(ctx, mats[DF_KDA_G], xn, n, gate, P, 0, P, err);
    else {
        fake_matmul(ctx, mats[DF_KDA_GA], xn, n, gl, l->D, 0, l->D, err);
        fake_matmul(ctx, mats[DF_KDA_GB], gl, n, gate, P, 0, P, err);
    }
    df_status st = fake_kda(ctx, l, state, n, q, k, v, f, braw, gate, o, err);
    if (st == DF_OK) fake_matmul(ctx, mats[DF_KDA_O], o, n, out, h[DF_KDA_O]->w.rows, 0, h[DF_KDA_O]->w.rows, err);
    free(buf);
    return st;
}

/* mla_layer on the stand-in: the engine's order of products, norm, fake_mla
 * and gate (the CPU's op_rmsnorm / op_sigmoid), so bit-identical. */
static int fake_mla_layer_calls;
static df_status fake_mla(void *ctx, const df_accel_mla *l, void *kv_b, void *state, int pos, int n, const float *q,
                          const float *kva, float *attn, char *err);
static df_status fake_mla_layer(void *ctx, const df_accel_mla *l, void *kv_b, void *state, int pos, int n,
                                void *const *mats, const float *xn, float *out, char *err) {
    fake_mla_layer_calls++;
    const int64_t dq = l->dn + l->dr, nq = (int64_t)l->nh * dq, nat = (int64_t)l->nh * l->dv, kv = l->R + l->dr;
    const int64_t qlr = l->qlr > 0 ? l->qlr : 1;
    float *buf = malloc((size_t)n * (nq + kv + 2 * nat + qlr) * sizeof(float));
    float *q = buf, *kva = q + n * nq, *attn = kva + n * kv, *gate = attn + n * nat, *qa = gate + n * nat;
    if (mats[DF_MLA_QA]) {
        fake_matmul(ctx, mats[DF_MLA_QA], xn, n, qa, l->qlr, 0, l->qlr, err);
        for (int t = 0; t < n; t++) op_rmsnorm(qa + (size_t)t * l->qlr, qa + (size_t)t * l->qlr, l->q_a_norm, l->qlr, l->latent_eps);
        fake_matmul(ctx, mats[DF_MLA_QB], qa, n, q, nq, 0, nq, err);
    } else {
        fake_matmul(ctx, mats[DF_MLA_Q], xn, n, q, nq, 0, nq, err);
    }
    fake_matmul(ctx, mats[DF_MLA_KVA], xn, n, kva, kv, 0, kv, err);
    df_status st = fake_mla(ctx, l, kv_b, state, pos, n, q, kva, attn, err);
    if (st == DF_OK && mats[DF_MLA_G]) {
        fake_matmul(ctx, mats[DF_MLA_G], xn, n, gate, nat, 0, nat, err);
        for (int64_t i = 0; i < n * nat; i++) attn[i] *= op_sigmoid(gate[i]);
    }
    const fake_h *o = mats[DF_MLA_O];
    if (st == DF_OK) fake_matmul(ctx, mats[DF_MLA_O], attn, n, out, o->w.rows, 0, o->w.rows, err);
    free(buf);
    return st;
}

/* The expert queue on the stand-in: the CPU's own math (kn_matmul at the
 * same level, ffn.c's activations), so the logits stay bit-identical with
 * it. Like a device, it writes the outputs only at finish. */
typedef struct {
    float *y;          /* [n][rows] computed at queue time */
    float *out;
    int *rows, n;
    int64_t dim, stride;
} fake_pending;
static fake_pending fake_q[64];
static int fake_nq, fake_expert_calls, fake_finishes;
static df_status fake_queue(void *ctx, void *gate, void *up, void *down, int situ, float beta, float linear_beta,
                            const float *X, int n, float *out, const int *rows, int64_t stride, char *err) {
    if (fake_nq == 64) { snprintf(err, DF_ERRMSG, "fake queue full"); return DF_ERR_ARG; }
    fake_expert_calls++;
    const fake_h *g = gate, *u = up, *d = down;
    int64_t I = g->w.rows;
    float *G = malloc((size_t)(n * I) * sizeof(float)), *U = malloc((size_t)(n * I) * sizeof(float));
    kn_matmul(*(kn_level *)ctx, &g->w, X, n, G, I, 0, I);
    kn_matmul(*(kn_level *)ctx, &u->w, X, n, U, I, 0, I);
    const ffn_act act = {situ, beta, linear_beta};
    ffn_act_apply(*(kn_level *)ctx, &act, G, U, n * I);
    fake_pending *p = &fake_q[fake_nq++];
    p->y = malloc((size_t)n * d->w.rows * sizeof(float));
    p->rows = malloc((size_t)n * sizeof(int));
    memcpy(p->rows, rows, (size_t)n * sizeof(int));
    p->n = n;
    p->out = out;
    p->dim = d->w.rows;
    p->stride = stride;
    kn_matmul(*(kn_level *)ctx, &d->w, G, n, p->y, d->w.rows, 0, d->w.rows);
    fake_macs += (uint64_t)n * (uint64_t)(2 * I * g->w.cols + d->w.rows * d->w.cols);
    free(G);
    free(U);
    return DF_OK;
}

static df_status fake_finish(void *ctx, char *err) {
    (void)ctx;
    (void)err;
    fake_finishes++;
    for (int i = 0; i < fake_nq; i++) {
        fake_pending *p = &fake_q[i];
        for (int r = 0; r < p->n; r++)
            memcpy(p->out + (size_t)p->rows[r] * p->stride, p->y + (size_t)r * p->dim, (size_t)p->dim * sizeof(float));
        free(p->y);
        free(p->rows);
    }
    fake_nq = 0;
    return DF_OK;
}

/* moe_tail on the stand-in: finish, then the host's combine, norm, lat_up
 * and shared add in ffn.c's order, so bit-identical. */
static int fake_tail_calls;
static df_status fake_moe_tail(void *ctx, int n, int K, const float *selw, const float *routed, int64_t dl,
                               const float *lat_norm, float eps, void *lat_up, const float *shared, float *out,
                               char *err) {
    fake_tail_calls++;
    df_status st = fake_finish(ctx, err);
    if (st != DF_OK) return st;
    const fake_h *up = lat_up;
    float *acc = calloc((size_t)n * dl, sizeof(float));
    for (int t = 0; t < n; t++) {
        for (int k = 0; k < K; k++) op_axpy(acc + t * dl, selw[t * K + k], routed + ((size_t)t * K + k) * dl, (int)dl);
        if (lat_norm) op_rmsnorm(acc + t * dl, acc + t * dl, lat_norm, (int)dl, eps);
    }
    st = fake_matmul(ctx, lat_up, acc, n, out, up->w.rows, 0, up->w.rows, err);
    if (shared)
        for (size_t i = 0; i < (size_t)n * up->w.rows; i++) out[i] += shared[i];
    free(acc);
    return st;
}

/* The kda hooks on the stand-in: "device" state in malloc'ed memory (its
 * size in front, for state_zero), kda_core.h's functions on it, so logits
 * stay bit-identical to the CPU path. fake_kda_fail makes the next call fail. */
static int fake_kda_calls, fake_kda_fail, fake_states;
static void *fake_state_new(void *ctx, const df_accel_kda *kda, const df_accel_mla *mla, int64_t bytes, char *err) {
    (void)ctx;
    (void)err;
    if (kda ? kda->H < 1 : !mla || mla->nh < 1) return NULL;
    int64_t *p = calloc(1, (size_t)bytes + 16);
    if (!p) return NULL;
    p[0] = bytes;
    fake_states++;
    return p + 2;
}
static void fake_state_free(void *ctx, void *st) {
    (void)ctx;
    if (!st) return;
    fake_states--;
    free((int64_t *)st - 2);
}
static df_status fake_state_zero(void *ctx, void *st, char *err) {
    (void)ctx;
    (void)err;
    memset(st, 0, (size_t)((int64_t *)st)[-2]);
    return DF_OK;
}
static df_status fake_kda(void *ctx, const df_accel_kda *l, void *state, int n, const float *q, const float *k,
                          const float *v, const float *f, const float *braw, const float *gate, float *o, char *err) {
    (void)ctx;
    if (fake_kda_fail) {
        fake_kda_fail = 0;
        snprintf(err, DF_ERRMSG, "fake: kda failed");
        return DF_ERR_IO;
    }
    fake_kda_calls++;
    const size_t P = (size_t)l->H * l->D, bytes = (size_t)n * P * sizeof(float);
    float *qc = malloc(bytes), *kc = malloc(bytes), *vc = malloc(bytes); /* the hook's inputs are read only */
    memcpy(qc, q, bytes);
    memcpy(kc, k, bytes);
    memcpy(vc, v, bytes);
    kda_shape sh = {0, l->H, l->D, l->W, 0, l->has_lower_bound, l->lower_bound, l->norm_eps};
    kda_params p = {{l->conv[0], l->conv[1], l->conv[2]}, l->a, l->dt_bias, l->o_norm};
    kda_io io = {qc, kc, vc, f, braw, gate, o, NULL};
    for (int which = 0; which < 3; which++)
        for (int c = 0; c < (int)P; c++) kda_conv_channel(&sh, &p, state, which, c, n, &io);
    for (int h = 0; h < l->H; h++) kda_recur_head(&sh, &p, state, h, n, &io);
    free(qc);
    free(kc);
    free(vc);
    return DF_OK;
}

/* The mla hook on the stand-in: mla_core.h's row write and mla.h's
 * mla_head over the stand-in's copy of kv_b, on the "device" cache. */
static int fake_mla_calls;
static df_status fake_mla(void *ctx, const df_accel_mla *l, void *kv_b, void *state, int pos, int n, const float *q,
                          const float *kva, float *attn, char *err) {
    (void)err;
    fake_mla_calls++;
    const fake_h *kb = kv_b;
    fake_macs += (uint64_t)kb->w.rows * (uint64_t)kb->w.cols * (uint64_t)n; /* the absorb and the lift: kv_b's rows */
    const int dq = l->dn + l->dr;
    mla_shape sh = {0, l->nh, l->dn, l->dr, l->dv, dq, l->R, 0, l->use_rope, l->rope_interleave, l->inv_freq,
                    l->rope_mscale, l->softmax_scale, l->latent_eps};
    float *cache = state, *qc = malloc((size_t)n * l->nh * dq * sizeof(float));
    memcpy(qc, q, (size_t)n * l->nh * dq * sizeof(float)); /* q is read only: rotate a copy */
    for (int t = 0; t < n; t++)
        mla_write_row(&sh, l->kv_a_norm, kva + (size_t)t * (l->R + l->dr), pos + t,
                      cache + (size_t)(pos + t) * (l->R + l->dr), qc + (size_t)t * l->nh * dq);
    size_t lat = (size_t)l->nh * n * l->R;
    float *qlat = malloc(lat * sizeof(float)), *olat = malloc(lat * sizeof(float));
    float *scratch = malloc((size_t)mla_head_scratch_floats(&sh, pos + n) * sizeof(float));
    for (int h = 0; h < l->nh; h++)
        mla_head(&sh, *(kn_level *)ctx, &kb->w, cache, qc, pos, n, h, qlat, olat, attn, scratch);
    free(qc);
    free(qlat);
    free(olat);
    free(scratch);
    return DF_OK;
}

static int read_tokens(const char *dir, int32_t *out, int cap) {
    char p[600];
    snprintf(p, sizeof p, "%s/reference.json", dir);
    FILE *f = fopen(p, "rb");
    if (!f) return 0;
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *s = strstr(buf, "\"tokens\"");
    if (!s || !(s = strchr(s, '['))) return 0;
    int cnt = 0;
    for (s++; *s && *s != ']' && cnt < cap;) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s) { s++; continue; }
        out[cnt++] = (int32_t)v;
        s = end;
    }
    return cnt;
}

/* An engine over a fixture's tokens and a session, for the logits runs
 * below (logits_with, stream_logits). */
typedef struct {
    int32_t tok[64];
    int n, V;
    df_engine *e;
    df_session *s;
    int ok;    /* the session was made */
    float *lg; /* [n][V] (owned until fx_end) */
} fx_run;

/* Reads dir's tokens and opens it (3 threads, accelerator a, ram bytes of
 * expert cache, the spine as given) with a session; 0 when there are no
 * tokens or the engine does not open (its message on stderr). */
static int fx_open(fx_run *r, const char *dir, const df_accel *a, int64_t ram, df_spine_mode spine) {
    r->n = read_tokens(dir, r->tok, 64);
    if (r->n <= 0) return 0;
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = 3;
    o.accel = a;
    o.expert_cache_bytes = ram;
    o.spine = spine;
    r->e = NULL;
    char err[DF_ERRMSG];
    if (df_engine_open(dir, &o, &r->e, err) != DF_OK) { fprintf(stderr, "%s\n", err); return 0; }
    r->V = df_engine_vocab_size(r->e);
    r->lg = malloc((size_t)r->n * r->V * sizeof(float));
    r->s = NULL;
    r->ok = df_session_new(r->e, 0, &r->s) == DF_OK;
    return 1;
}

/* Evaluates tokens from .. to-1 one at a time into their logits rows while ok; the new ok. */
static int fx_steps(fx_run *r, int from, int to, int ok) {
    for (int i = from; ok && i < to; i++)
        ok = df_session_eval(r->s, r->tok + i, 1, r->lg + (size_t)i * r->V) == DF_OK;
    return ok;
}

/* Closes the session and the engine: the logits when ok, else NULL. */
static float *fx_end(fx_run *r, int ok) {
    df_session_free(r->s);
    df_engine_close(r->e);
    if (!ok) { free(r->lg); return NULL; }
    return r->lg;
}

/* All logits over the fixture's tokens; NULL on failure. */
static float *logits_with(const char *dir, const df_accel *a, int64_t ram, df_accel_stats *st,
                          uint64_t *bytes_read) {
    fx_run r;
    /* a resident spine: what the device budgets test must not depend on free host memory */
    if (!fx_open(&r, dir, a, ram, DF_SPINE_RESIDENT)) return NULL;
    /* prefill the first half as one chunk, then one token at a time */
    int half = r.n / 2;
    int ok = r.ok && df_session_eval(r.s, r.tok, half, r.lg) == DF_OK;
    ok = fx_steps(&r, half, r.n, ok);
    if (st) df_engine_accel_stats(r.e, st);
    if (bytes_read) {
        df_stats ds;
        df_engine_stats(r.e, &ds);
        *bytes_read = ds.bytes_read;
    }
    return fx_end(&r, ok);
}

/* Bytes of n rows of dir's logits (0 when it does not open). */
static size_t logits_bytes(const char *dir, int n) {
    df_engine_opts o;
    df_engine_opts_default(&o);
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    if (df_engine_open(dir, &o, &e, err) != DF_OK) return 0;
    size_t bytes = (size_t)n * 4 * (size_t)df_engine_vocab_size(e);
    df_engine_close(e);
    return bytes;
}

TEST(model_accel_bit_identical_any_budget) {
    static const char *fx[] = {"tests/fixtures/kimi_k3_mxfp4", "tests/fixtures/dsv3_fp8_yarn",
                               "tests/fixtures/kimi_k2_int4", "tests/fixtures/kimi_linear_a"};
    kn_level lv = kn_detect();
    for (size_t i = 0; i < sizeof fx / sizeof fx[0]; i++) {
        int32_t tok[64];
        int n = read_tokens(fx[i], tok, 64);
        if (n <= 0) SKIP("fixtures missing");
        uint64_t ref_read = 0, read = 0;
        float *ref = logits_with(fx[i], NULL, 1, NULL, &ref_read);
        REQUIRE(ref != NULL, "%s cpu", fx[i]);
        /* the expert RAM cache is kept at its minimum (two slots) so slots are
         * reused under the views and experts are read again and again */
        /* everything fits; resident + 24 KB of cache (evictions); 1 byte (all transient) */
        int64_t budgets[] = {(int64_t)1 << 40, 0, 1, (int64_t)1 << 40, 0, 1};
        for (int b = 0; b < 6; b++) {
            /* the last three with the expert queue and the attention state hooks */
            df_accel a = {"fake", &lv, budgets[b], fake_upload, fake_release, fake_matmul, NULL, NULL, NULL,
                          b >= 3 ? fake_queue : NULL, b >= 3 ? fake_finish : NULL, NULL,
                          b >= 3 ? fake_state_new : NULL, fake_state_free, fake_state_zero, fake_kda, fake_mla, NULL,
                          b >= 3 ? fake_matmul_many : NULL, b >= 4 ? fake_kda_layer : NULL,
                          b >= 4 ? fake_mla_layer : NULL, b >= 4 ? fake_moe_tail : NULL,
                  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL}; /* no dev_ hooks, no tc probe */
            df_accel_stats st;
            fake_expert_calls = 0;
            fake_many_calls = 0;
            fake_kda_layer_calls = 0;
            fake_mla_layer_calls = 0;
            fake_tail_calls = 0;
            fake_macs = 0;
            float *lg = logits_with(fx[i], &a, 1, &st, &read);
            /* every product the stand-in ran, counted once by its weight type */
            CHECK(st.macs_mxfp4 + st.macs_bf16 + st.macs_other == fake_macs && fake_macs > 0,
                  "%s budget %d: %llu + %llu + %llu multiply-adds counted, %llu run", fx[i], b,
                  (unsigned long long)st.macs_mxfp4, (unsigned long long)st.macs_bf16,
                  (unsigned long long)st.macs_other, (unsigned long long)fake_macs);
            CHECK((st.macs_mxfp4 > 0) == (strstr(fx[i], "mxfp4") != NULL),
                  "%s budget %d: %llu MXFP4 multiply-adds", fx[i], b, (unsigned long long)st.macs_mxfp4);
            CHECK((fake_expert_calls > 0) == (b >= 3), "%s budget %d: %d expert calls", fx[i], b, fake_expert_calls);
            CHECK(fake_nq == 0, "%s budget %d: %d queued experts never finished", fx[i], b, fake_nq);
            CHECK((fake_many_calls > 0) == (b >= 3), "%s budget %d: %d matmul_many calls", fx[i], b, fake_many_calls);
            CHECK((fake_kda_layer_calls > 0) == (b >= 4 && (strstr(fx[i], "kimi_k3") || strstr(fx[i], "kimi_linear"))),
                  "%s budget %d: %d kda_layer calls", fx[i], b, fake_kda_layer_calls);
            CHECK((fake_mla_layer_calls > 0) == (b >= 4), "%s budget %d: %d mla_layer calls", fx[i], b,
                  fake_mla_layer_calls);
            CHECK((fake_tail_calls > 0) == (b >= 4 && strstr(fx[i], "kimi_k3") != NULL), "%s budget %d: %d moe_tail calls",
                  fx[i], b, fake_tail_calls);
            REQUIRE(lg != NULL, "%s budget %lld", fx[i], (long long)budgets[b]);
            const size_t bytes = logits_bytes(fx[i], n);
            CHECK(bytes > 0 && memcmp(lg, ref, bytes) == 0, "%s: logits differ with budget %lld", fx[i], (long long)budgets[b]);
            CHECK(st.calls > 0, "%s: nothing ran on the accelerator", fx[i]);
            CHECK(st.device_read_bytes > 0, "%s: no device reads counted", fx[i]);
            if (b % 3 == 0) CHECK(st.cache_evictions == 0 && st.transient_uploads == 0, "%s: evicted with room", fx[i]);
            /* the device tier: experts with device copies are not read again */
            if (b % 3 == 0)
                CHECK(st.tier_hits > 0 && read < ref_read, "%s: %llu experts from the device, read %llu vs %llu B",
                      fx[i], (unsigned long long)st.tier_hits, (unsigned long long)read,
                      (unsigned long long)ref_read);
            if (b % 3 == 2) CHECK(st.tier_hits == 0, "%s: device tier with no budget", fx[i]);
            if (b % 3 == 1) CHECK(st.cache_evictions > 0, "%s: no evictions with 24 KB of cache", fx[i]);
            if (b % 3 == 2) CHECK(st.transient_uploads > 0 && st.resident_mats == 0, "%s: budget 1 byte", fx[i]);
            CHECK(fake_live == 0, "%s: %d handles leaked", fx[i], fake_live);
            CHECK(fake_states == 0, "%s: %d device states leaked", fx[i], fake_states);
            int kimi = strstr(fx[i], "kimi_k3") || strstr(fx[i], "kimi_linear");
            CHECK((st.kda_calls > 0) == (b >= 3 && kimi), "%s budget %d: %llu KDA steps on the device", fx[i], b,
                  (unsigned long long)st.kda_calls);
            CHECK((st.mla_calls > 0) == (b >= 3), "%s budget %d: %llu MLA steps on the device", fx[i], b,
                  (unsigned long long)st.mla_calls);
            if (b % 3 == 0) budgets[b + 1] = st.resident_bytes + (24 << 10);
            free(lg);
        }
        free(ref);
    }
}

TEST(model_accel_cli_refuses_cuda) {
    char out[2048];
    int rc = t_sh(out, sizeof out, "%s run --model tests/fixtures/kimi_k3_a --tokens 1,2 --max-new 1 --ids --device cuda",
                  t_bin());
    if (strstr(out, "no CUDA backend")) {
        CHECK(rc == 2, "usage error expected, got %d", rc);
    } else {
        CHECK(0, "plain build must refuse --device cuda: %s", out);
    }
    rc = t_sh(out, sizeof out, "%s run --model tests/fixtures/kimi_k3_a --tokens 1,2 --max-new 1 --ids --device cpu", t_bin());
    CHECK(rc == 0, "--device cpu runs: %s", out);
    rc = t_sh(out, sizeof out, "%s inspect --model tests/fixtures/kimi_k3_a", t_bin());
    CHECK(rc == 0 && strstr(out, "device         cpu"), "inspect shows the device: %s", out);
}

/* The device-copy cache evicts the least recently used copy (a hit renews
 * it), and the pin hook page-locks the host range once and unpins it at
 * close. Driven through the engine's table (src/model/accel.c) directly. */
typedef struct {
    const void *released[8];
    int nrel;
    void *pinned;
    size_t pinned_bytes;
    int unpins;
} lru_log;

static void *lru_upload(void *ctx, const void *weight, int *refused, char *err) {
    (void)ctx, (void)err;
    *refused = 0;
    return (void *)((const df_weight *)weight)->data; /* the handle names the matrix */
}
static void lru_release(void *ctx, void *handle) {
    lru_log *l = ctx;
    if (l->nrel < 8) l->released[l->nrel++] = handle;
}
static df_status lru_matmul(void *ctx, void *handle, const float *X, int n, float *Y, int64_t ldy, int64_t row0,
                            int64_t row1, char *err) {
    (void)ctx, (void)handle, (void)X, (void)err;
    for (int i = 0; i < n; i++)
        for (int64_t r = row0; r < row1; r++) Y[i * ldy + r - row0] = 0;
    return DF_OK;
}
static df_status lru_pin(void *ctx, void *p, size_t bytes, char *err) {
    (void)err;
    lru_log *l = ctx;
    l->pinned = p;
    l->pinned_bytes = bytes;
    return DF_OK;
}
static void lru_unpin(void *ctx, void *p) {
    lru_log *l = ctx;
    l->unpins += p == l->pinned;
}

TEST(model_accel_lru_order_and_pin) {
    static uint16_t bytes[4][64]; /* four bf16 8x8 matrices: 128 bytes each */
    df_weight w[4];
    for (int i = 0; i < 4; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].type = WT_BF16;
        w[i].rows = w[i].cols = 8;
        w[i].data = bytes[i];
    }
    lru_log log = {0};
    df_accel a = {.name = "lru", .ctx = &log, .budget = 2 * 128, .upload = lru_upload, .release = lru_release,
                  .matmul = lru_matmul, .pin = lru_pin, .unpin = lru_unpin};
    acc_table *t = acc_new(&a);
    REQUIRE(t);
    static char pool[4096];
    CHECK(acc_pin_host(t, pool, sizeof pool) == 1 && log.pinned == pool && log.pinned_bytes == sizeof pool);
    CHECK(acc_pin_host(t, pool, sizeof pool) == 0, "pinned twice");
    float x[8] = {0}, y[8];
    /* A B A C: C evicts B (A was renewed); then D evicts A */
    const int order[] = {0, 1, 0, 2, 3};
    for (int i = 0; i < 5; i++) CHECK(acc_mm(t, &w[order[i]], x, 1, y, 8) == 1);
    CHECK(log.nrel == 2 && log.released[0] == bytes[1] && log.released[1] == bytes[0],
          "evicted %d: %p %p (B=%p A=%p)", log.nrel, log.released[0], log.released[1], (void *)bytes[1],
          (void *)bytes[0]);
    df_accel_stats st;
    acc_get_stats(t, &st);
    CHECK(st.cache_hits == 1 && st.cache_uploads == 4 && st.cache_evictions == 2 && st.pinned_bytes == sizeof pool);
    acc_free(t);
    CHECK(log.unpins == 1 && log.nrel == 4, "unpins %d, released %d", log.unpins, log.nrel);
}

/* inspect's placement with an accelerator: the budget, the tiers and the
 * routed-expert plan (how many fit beside the resident matrices). */
TEST(model_accel_describe_plan) {
    kn_level lv = kn_detect();
    const char *dir = "tests/fixtures/kimi_k3_mxfp4";
    for (int b = 0; b < 2; b++) {
        df_accel a = {.name = "fake", .ctx = &lv, .budget = b ? 1 : (int64_t)1 << 40, .upload = fake_upload,
                      .release = fake_release, .matmul = fake_matmul, .expert_queue = fake_queue,
                      .expert_finish = fake_finish};
        df_engine_opts o;
        df_engine_opts_default(&o);
        o.n_threads = 2;
        o.accel = &a;
        o.expert_cache_bytes = (int64_t)1 << 20;
        df_engine *e = NULL;
        char err[DF_ERRMSG];
        REQUIRE(df_engine_open(dir, &o, &e, err) == DF_OK, "%s", err);
        const char *d = df_engine_describe(e);
        CHECK(strstr(d, "gpu placement") && strstr(d, "tiers: device copies") && strstr(d, "queued on the device"),
              "%s", d);
        const char *p = strstr(d, "device plan");
        REQUIRE(p != NULL, "%s", d);
        long long fit = -1;
        int n = 0;
        const char *h = strstr(p, "holds ");
        int got = h ? sscanf(h, "holds %lld of the %d routed experts", &fit, &n) : 0;
        CHECK(got == 2, "%s", p);
        CHECK(n > 0 && (b ? fit == 0 : fit == n), "budget %d: %lld of %d experts fit", b, fit, n);
        df_engine_close(e);
    }
}

/* The fixture's tokens (at most 64; *n = 0 when missing) and the CPU's
 * logits over them. */
static float *cpu_logits(const char *dir, int32_t tok[64], int *n) {
    *n = read_tokens(dir, tok, 64);
    return *n > 0 ? logits_with(dir, NULL, 1, NULL, NULL) : NULL;
}

/* A KDA step that fails on the device fails the eval with the hook's message
 * and resets the session (its state is undefined); evaluating the prompt
 * again gives the CPU's logits exactly. */
TEST(model_accel_kda_failure_resets) {
    kn_level lv = kn_detect();
    const char *dir = "tests/fixtures/kimi_k3_mxfp4";
    int32_t tok[64];
    int n = 0;
    float *ref = cpu_logits(dir, tok, &n);
    if (!n) SKIP("fixtures missing");
    REQUIRE(ref != NULL, "cpu logits");
    df_accel a = {"fake", &lv, (int64_t)1 << 40, fake_upload, fake_release, fake_matmul, NULL, NULL, NULL,
                  fake_queue, fake_finish, NULL, fake_state_new, fake_state_free, fake_state_zero, fake_kda, fake_mla, NULL, NULL, NULL, NULL, NULL,
                  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL}; /* no dev_ hooks, no tc probe */
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = 3;
    o.accel = &a;
    o.expert_cache_bytes = 1;
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    REQUIRE(df_engine_open(dir, &o, &e, err) == DF_OK, "%s", err);
    int V = df_engine_vocab_size(e);
    df_session *s = NULL;
    REQUIRE(df_session_new(e, 0, &s) == DF_OK, "session");
    float *lg = malloc((size_t)n * V * sizeof(float));
    CHECK(df_session_eval(s, tok, 3, NULL) == DF_OK, "first eval");
    fake_kda_fail = 1;
    CHECK(df_session_eval(s, tok + 3, 1, NULL) != DF_OK, "the failing step must fail");
    CHECK(strstr(df_session_error(s), "fake: kda failed") && strstr(df_session_error(s), "reset"), "error: %s",
          df_session_error(s));
    CHECK(df_session_pos(s) == 0, "position after the failure: %d", df_session_pos(s));
    CHECK(df_session_eval(s, tok, n, lg) == DF_OK, "eval after the reset");
    CHECK(memcmp(lg, ref, (size_t)n * V * sizeof(float)) == 0, "logits after the reset differ from the CPU's");
    df_session_free(s);
    df_engine_close(e);
    CHECK(fake_states == 0 && fake_live == 0, "leaks: %d states, %d handles", fake_states, fake_live);
    free(lg);
    free(ref);
}

/* Activations "on the device" for the stand-in: malloc'ed blocks, the
 * host's own ops on them (op_rmsnorm, op_attn_res, fp32 adds), so a decode
 * pass through km_forward_dev stays bit-identical to the CPU's. */
static int fake_dev_live, fake_dev_ops;
static int fake_res_max; /* > 0: dev_attn_res refuses more anchors (as the CUDA kernel does past 64) */
static float *fake_dev_alloc(void *ctx, int64_t floats, char *err) {
    (void)ctx;
    (void)err;
    fake_dev_live++;
    float *p = malloc((size_t)floats * sizeof(float));
    for (int64_t i = 0; p && i < floats; i++) p[i] = NAN; /* unwritten rows would show */
    return p;
}
static void fake_dev_free(void *ctx, float *p) {
    (void)ctx;
    if (p) fake_dev_live--;
    free(p);
}
static df_status fake_dev_put(void *ctx, float *dst, const float *src, int64_t floats, char *err) {
    (void)ctx;
    (void)err;
    memcpy(dst, src, (size_t)floats * sizeof(float));
    return DF_OK;
}
/* dev_stage: one buffer, grown (its rows must come out as if put from the
 * caller's memory) */
static float *fake_stage;
static int64_t fake_stage_cap;
static int fake_stage_calls;
static float *fake_dev_stage(void *ctx, int64_t floats, char *err) {
    (void)ctx;
    (void)err;
    fake_stage_calls++;
    if (floats > fake_stage_cap) {
        free(fake_stage);
        fake_stage = malloc((size_t)floats * sizeof(float));
        fake_stage_cap = fake_stage ? floats : 0;
    }
    for (int64_t i = 0; i < fake_stage_cap; i++) fake_stage[i] = NAN; /* stale rows would show */
    return fake_stage;
}
static void fake_stage_free(void) {
    free(fake_stage);
    fake_stage = NULL;
    fake_stage_cap = 0;
}
static df_status fake_dev_rmsnorm(void *ctx, float *out, const float *x, const float *w, int n, int dim, float eps,
                                  char *err) {
    (void)ctx;
    (void)err;
    fake_dev_ops++;
    for (int t = 0; t < n; t++) op_rmsnorm(out + (size_t)t * dim, x + (size_t)t * dim, w, dim, eps);
    return DF_OK;
}
static df_status fake_dev_attn_res(void *ctx, float *out, const float *anchors, int64_t astride, int na,
                                   const float *cur, const float *w, int n, int dim, float eps, char *err) {
    (void)ctx;
    (void)err;
    if (fake_res_max > 0 && na > fake_res_max) return DF_ERR_UNSUPPORTED;
    fake_dev_ops++;
    for (int t = 0; t < n; t++)
        op_attn_res(anchors + (size_t)t * astride, na, cur + (size_t)t * dim, w, dim, eps, out + (size_t)t * dim);
    return DF_OK;
}
static df_status fake_dev_add(void *ctx, float *y, const float *x, int64_t floats, char *err) {
    (void)ctx;
    (void)err;
    for (int64_t i = 0; i < floats; i++) y[i] += x[i];
    return DF_OK;
}
static df_status fake_dev_copy(void *ctx, float *dst, const float *src, int64_t floats, char *err) {
    (void)ctx;
    (void)err;
    memmove(dst, src, (size_t)floats * sizeof(float));
    return DF_OK;
}

/* dev_res_norm as its steps in turn (the host ops again); refuses as
 * dev_attn_res does. */
static int fake_fused_ops;
static df_status fake_dev_res_norm(void *ctx, float *xn, float *h, const float *d, int restart, float *anc_out,
                                   const float *anchors, int64_t astride, int na, const float *probe, const float *nw,
                                   int n, int dim, float eps, char *err) {
    (void)ctx;
    (void)err;
    if (fake_res_max > 0 && na > fake_res_max) return DF_ERR_UNSUPPORTED;
    fake_dev_ops++;
    fake_fused_ops++;
    for (int t = 0; t < n; t++) {
        float *ht = h + (size_t)t * dim, *xt = xn + (size_t)t * dim;
        for (int i = 0; d && i < dim; i++) ht[i] = restart ? d[(size_t)t * dim + i] : ht[i] + d[(size_t)t * dim + i];
        if (anc_out) memcpy(anc_out + (size_t)t * astride, ht, (size_t)dim * sizeof(float));
        if (na > 0) op_attn_res(anchors + (size_t)t * astride, na, ht, probe, dim, eps, xt);
        op_rmsnorm(xt, na > 0 ? xt : ht, nw, dim, eps);
    }
    return DF_OK;
}

static df_status fake_dev_gather(void *ctx, float *dst, const float *src, const int *idx, int count, int64_t width,
                                 char *err) {
    (void)ctx;
    (void)err;
    fake_dev_ops++;
    for (int i = 0; i < count; i++)
        memcpy(dst + (size_t)i * width, src + (size_t)idx[i] * width, (size_t)width * sizeof(float));
    return DF_OK;
}

/* The decode step with its activations on the "device" (km_forward_dev,
 * ffn_block_dev): on the Kimi fixtures, with every budget (resident, LRU
 * evictions, transient; the spine's f32 matrices are refused and run on the
 * host over rows brought back), with the residual steps one hook at a time
 * and in one (dev_res_norm), the logits are bit-identical to the CPU's;
 * the device ops ran, the host waited fewer times than the host-centred
 * step, and no device block leaked. DeepSeek-V3 keeps the host-centred step. */
TEST(model_accel_device_step) {
    static const char *fx[] = {"tests/fixtures/kimi_k3_mxfp4", "tests/fixtures/kimi_linear_a",
                               "tests/fixtures/dsv3_fp8_yarn"};
    kn_level lv = kn_detect();
    for (size_t i = 0; i < sizeof fx / sizeof fx[0]; i++) {
        int32_t tok[64];
        int n = read_tokens(fx[i], tok, 64);
        if (n <= 0) SKIP("fixtures missing");
        float *ref = logits_with(fx[i], NULL, 1, NULL, NULL);
        REQUIRE(ref != NULL, "%s cpu", fx[i]);
        const int kimi = strstr(fx[i], "kimi") != NULL;
        uint64_t waits_host = 0;
        /* the last: the device's attention residual takes one anchor at most
         * (the rest of the mixes run on the host) */
        const int64_t budgets[] = {(int64_t)1 << 40, (int64_t)1 << 40, 24 << 10, 1, (int64_t)1 << 40,
                                   (int64_t)1 << 40};
        for (int b = 0; b < 6; b++) {
            fake_res_max = b == 4 || b == 5 ? 1 : 0;
            /* dev_res_norm with the evicting budgets, and at the last (refusing > 1 anchor, as the fifth) */
            const int fused = b == 2 || b == 3 || b == 5;
            const int dev = b > 0; /* the first: the host-centred step, for the wait count */
            df_accel a = {.name = "fake", .ctx = &lv, .budget = budgets[b], .upload = fake_upload,
                          .release = fake_release, .matmul = fake_matmul, .expert_queue = fake_queue,
                          .expert_finish = fake_finish, .state_new = fake_state_new, .state_free = fake_state_free,
                          .state_zero = fake_state_zero, .kda = fake_kda, .mla = fake_mla,
                          .matmul_many = fake_matmul_many, .kda_layer = fake_kda_layer, .mla_layer = fake_mla_layer,
                          .moe_tail = fake_moe_tail};
            if (dev) {
                a.dev_alloc = fake_dev_alloc;
                a.dev_free = fake_dev_free;
                a.dev_put = fake_dev_put;
                a.dev_get = fake_dev_put; /* memcpy either way */
                a.dev_rmsnorm = fake_dev_rmsnorm;
                a.dev_attn_res = fake_dev_attn_res;
                a.dev_add = fake_dev_add;
                a.dev_copy = fake_dev_copy;
                a.dev_gather = fake_dev_gather;
                if (fused) a.dev_res_norm = fake_dev_res_norm;
                if (fused) a.dev_stage = fake_dev_stage; /* the embedding written in place, in pieces */
            }
            df_accel_stats st;
            fake_stage_calls = 0;
            fake_dev_ops = 0;
            fake_fused_ops = 0;
            float *lg = logits_with(fx[i], &a, 1, &st, NULL);
            REQUIRE(lg != NULL, "%s budget %d", fx[i], b);
            const size_t bytes = logits_bytes(fx[i], n);
            CHECK(bytes > 0 && memcmp(lg, ref, bytes) == 0, "%s: logits differ with budget %d", fx[i], b);
            CHECK((fake_dev_ops > 0) == (dev && kimi), "%s budget %d: %d device ops", fx[i], b, fake_dev_ops);
            CHECK((fake_fused_ops > 0) == (fused && kimi), "%s budget %d: %d fused steps", fx[i], b, fake_fused_ops);
            CHECK((fake_stage_calls > 0) == (fused && kimi), "%s budget %d: %d stages", fx[i], b, fake_stage_calls);
            CHECK((st.device_passes > 0) == (dev && kimi), "%s budget %d: %llu device passes counted", fx[i], b,
                  (unsigned long long)st.device_passes);
            if (!dev) waits_host = st.sync_calls;
            if (b == 1 && kimi)
                CHECK(st.sync_calls < waits_host, "%s: %llu host waits on the device step, %llu without", fx[i],
                      (unsigned long long)st.sync_calls, (unsigned long long)waits_host);
            CHECK(fake_dev_live == 0 && fake_live == 0 && fake_states == 0 && fake_nq == 0,
                  "%s budget %d: leaks: %d device blocks, %d handles, %d states, %d queued", fx[i], b, fake_dev_live,
                  fake_live, fake_states, fake_nq);
            free(lg);
        }
        fake_res_max = 0;
        free(ref);
    }
    fake_stage_free();
}

/* Batched passes with activations on the "device": two sessions' prompts
 * in one pass, then single-token steps of both in one pass (km_forward_dev
 * with segments, the gathered expert rows): every row bit-identical to the
 * CPU running each session alone. */
TEST(model_accel_device_step_batched) {
    const char *dir = "tests/fixtures/kimi_k3_mxfp4";
    int32_t tok[64];
    int n = read_tokens(dir, tok, 64);
    if (n < 16) SKIP("fixtures missing");
    kn_level lv = kn_detect();
    df_accel a = {.name = "fake", .ctx = &lv, .budget = (int64_t)1 << 40, .upload = fake_upload,
                  .release = fake_release, .matmul = fake_matmul, .expert_queue = fake_queue,
                  .expert_finish = fake_finish, .state_new = fake_state_new, .state_free = fake_state_free,
                  .state_zero = fake_state_zero, .kda = fake_kda, .mla = fake_mla, .matmul_many = fake_matmul_many,
                  .kda_layer = fake_kda_layer, .mla_layer = fake_mla_layer, .moe_tail = fake_moe_tail,
                  .dev_alloc = fake_dev_alloc, .dev_free = fake_dev_free, .dev_put = fake_dev_put,
                  .dev_get = fake_dev_put, .dev_rmsnorm = fake_dev_rmsnorm, .dev_attn_res = fake_dev_attn_res,
                  .dev_add = fake_dev_add, .dev_copy = fake_dev_copy, .dev_gather = fake_dev_gather,
                  .dev_res_norm = fake_dev_res_norm, .dev_stage = fake_dev_stage};
    enum { P0 = 7, P1 = 9, STEPS = 3 };
    const int32_t *t0 = tok, *t1 = tok + 4; /* two streams of P + STEPS tokens */
    df_engine *ed = NULL, *ec = NULL;
    char err[DF_ERRMSG];
    df_engine_opts o;
    df_engine_opts_default(&o);
    o.n_threads = 2;
    o.expert_cache_bytes = 1;
    REQUIRE(df_engine_open(dir, &o, &ec, err) == DF_OK, "%s", err);
    o.accel = &a;
    REQUIRE(df_engine_open(dir, &o, &ed, err) == DF_OK, "%s", err);
    const int V = df_engine_vocab_size(ed);
    float *lb[2], *la[2];
    df_session *b[2], *c[2];
    for (int i = 0; i < 2; i++) {
        lb[i] = calloc((size_t)(P1 + STEPS) * V, sizeof(float));
        la[i] = calloc((size_t)(P1 + STEPS) * V, sizeof(float));
        REQUIRE(df_session_new(ed, 64, &b[i]) == DF_OK && df_session_new(ec, 64, &c[i]) == DF_OK, "sessions");
    }
    fake_dev_ops = 0;
    df_batch_item it[2] = {{b[0], t0, P0, lb[0]}, {b[1], t1, P1, lb[1]}};
    CHECK(df_session_eval_batch(it, 2) == DF_OK, "%s", df_session_error(b[0]));
    for (int st = 0; st < STEPS; st++) {
        it[0] = (df_batch_item){b[0], t0 + P0 + st, 1, lb[0] + (size_t)(P0 + st) * V};
        it[1] = (df_batch_item){b[1], t1 + P1 + st, 1, lb[1] + (size_t)(P1 + st) * V};
        CHECK(df_session_eval_batch(it, 2) == DF_OK, "%s", df_session_error(b[0]));
    }
    CHECK(fake_dev_ops > 0, "the batched passes did not run on the device path");
    /* alone, on the CPU */
    CHECK(df_session_eval(c[0], t0, P0 + STEPS, la[0]) == DF_OK, "solo 0");
    CHECK(df_session_eval(c[1], t1, P1 + STEPS, la[1]) == DF_OK, "solo 1");
    CHECK(!memcmp(lb[0], la[0], (size_t)(P0 + STEPS) * V * sizeof(float)), "session 0: batched rows differ");
    CHECK(!memcmp(lb[1], la[1], (size_t)(P1 + STEPS) * V * sizeof(float)), "session 1: batched rows differ");
    for (int i = 0; i < 2; i++) {
        df_session_free(b[i]);
        df_session_free(c[i]);
        free(lb[i]);
        free(la[i]);
    }
    df_engine_close(ed);
    df_engine_close(ec);
    fake_stage_free();
    CHECK(fake_dev_live == 0 && fake_live == 0 && fake_states == 0, "leaks: %d blocks, %d handles, %d states",
          fake_dev_live, fake_live, fake_states);
}

/* A spine that does not fit the device budget is page-locked (its mapped
 * bytes, page-aligned ranges, none overlapping) so its repeated uploads run
 * at the DMA rate; one that fits is not. Logits stay the CPU's. */
typedef struct {
    uintptr_t a[4096];
    size_t len[4096];
    int n, unpins;
} pin_log;
static pin_log pins;
static df_status log_pin(void *ctx, void *p, size_t bytes, char *err) {
    (void)ctx;
    (void)err;
    if (pins.n < 4096) {
        pins.a[pins.n] = (uintptr_t)p;
        pins.len[pins.n++] = bytes;
    }
    return DF_OK;
}
static void log_unpin(void *ctx, void *p) {
    (void)ctx;
    (void)p;
    pins.unpins++;
}

TEST(model_accel_pins_a_spine_that_does_not_fit) {
    kn_level lv = kn_detect();
    const char *dir = "tests/fixtures/kimi_k3_mxfp4";
    int32_t tok[64];
    int n = 0;
    float *ref = cpu_logits(dir, tok, &n);
    if (!n) SKIP("fixtures missing");
    REQUIRE(ref != NULL, "cpu logits");
    for (int b = 0; b < 2; b++) {
        memset(&pins, 0, sizeof pins);
        df_accel a = {.name = "pins", .ctx = &lv, .budget = b ? (int64_t)1 << 40 : 4096, .upload = fake_upload,
                      .release = fake_release, .matmul = fake_matmul, .pin = log_pin, .unpin = log_unpin};
        df_accel_stats st;
        float *lg = logits_with(dir, &a, 1, &st, NULL);
        REQUIRE(lg != NULL, "logits with budget %lld", (long long)a.budget);
        df_engine_opts o;
        df_engine_opts_default(&o);
        df_engine *e = NULL;
        char err[DF_ERRMSG];
        size_t bytes = (size_t)n * 4;
        if (df_engine_open(dir, &o, &e, err) == DF_OK) {
            bytes *= (size_t)df_engine_vocab_size(e);
            df_engine_close(e);
        }
        CHECK(memcmp(lg, ref, bytes) == 0, "budget %lld: logits differ", (long long)a.budget);
        /* the expert cache is always one pin; the spine adds more only when it does not fit */
        CHECK(b ? pins.n == 1 : pins.n > 1, "budget %lld: %d ranges page-locked", (long long)a.budget, pins.n);
        CHECK(b ? st.spine_pinned_bytes == 0 : st.spine_pinned_bytes > 0, "budget %lld: %lld spine bytes pinned",
              (long long)a.budget, (long long)st.spine_pinned_bytes);
        CHECK(pins.unpins == pins.n, "%d pins, %d unpins", pins.n, pins.unpins);
        for (int i = 1; i < pins.n; i++) {
            CHECK((pins.a[i] & 4095) == 0 && (pins.len[i] & 4095) == 0, "range %d not page-aligned", i);
            for (int j = 1; j < i; j++)
                CHECK(pins.a[i] >= pins.a[j] + pins.len[j] || pins.a[j] >= pins.a[i] + pins.len[i],
                      "ranges %d and %d overlap", i, j);
        }
        free(lg);
    }
    free(ref);
}

/* ---- a streamed spine served from device copies ---- */

/* The stand-in's products that fail every fake_fail_every-th call once
 * armed (a device failure: the engine must run that product on the CPU). */
static int fake_fail_every, fake_fail_count, fake_failures;
static int fake_flaky(char *err) {
    if (!fake_fail_every || ++fake_fail_count % fake_fail_every) return 0;
    fake_failures++;
    snprintf(err, DF_ERRMSG, "fake: injected device failure");
    return 1;
}
static df_status flaky_matmul(void *ctx, void *handle, const float *X, int n, float *Y, int64_t ldy, int64_t row0,
                              int64_t row1, char *err) {
    if (fake_flaky(err)) return DF_ERR_IO;
    return fake_matmul(ctx, handle, X, n, Y, ldy, row0, row1, err);
}
static df_status flaky_matmul_many(void *ctx, int count, void *const *handles, const float *const *X, const int *n,
                                   float *const *Y, const int64_t *ldy, char *err) {
    if (fake_flaky(err)) return DF_ERR_IO;
    return fake_matmul_many(ctx, count, handles, X, n, Y, ldy, err);
}

static int stream_described; /* inspect's text named the groups kept on the device */

/* Logits over the fixture's tokens with the spine streamed (first half as
 * one chunk, then a token at a time); *later_read: spine bytes read after
 * the first eval. fail_every arms fake_flaky after the first eval. */
static float *stream_logits(const char *dir, const df_accel *a, int fail_every, df_accel_stats *st,
                            uint64_t *later_read) {
    fx_run r;
    if (!fx_open(&r, dir, a, 1, DF_SPINE_STREAM)) return NULL;
    stream_described = strstr(df_engine_describe(r.e), "layer groups kept on the device") != NULL;
    int half = r.n / 2;
    int ok = r.ok && df_session_eval(r.s, r.tok, half, r.lg) == DF_OK;
    df_engine_reset_stats(r.e);
    fake_fail_every = fail_every;
    fake_fail_count = fake_failures = 0;
    ok = fx_steps(&r, half, r.n, ok);
    if (!ok) fprintf(stderr, "%s\n", r.s ? df_session_error(r.s) : "no session");
    fake_fail_every = 0;
    df_stats ds;
    df_engine_stats(r.e, &ds);
    *later_read = ds.spine_bytes_read;
    df_engine_accel_stats(r.e, st);
    return fx_end(&r, ok);
}

/* Opens dir (default options) for the bytes of n tokens' logits and, when
 * reserve is set, of one token's routed experts (the room accel.c keeps
 * for them). 0 when it does not open (err says why). */
static int engine_sizes(const char *dir, int n, size_t *bytes, int64_t *reserve, char *err) {
    df_engine *e = NULL;
    df_engine_opts o;
    df_engine_opts_default(&o);
    if (df_engine_open(dir, &o, &e, err) != DF_OK) return 0;
    *bytes = (size_t)n * df_engine_vocab_size(e) * sizeof(float);
    if (reserve) *reserve = df_engine_expert_bytes(e) * df_engine_experts_per_token(e);
    df_engine_close(e);
    return 1;
}

/* --spine stream with an accelerator: once every matrix of a layer group has
 * a device copy (the whole spine fits here: kept resident from the first
 * step), the group is never read from disk again, and the logits are the
 * CPU's bit for bit. With no room on the device every group is read each
 * step, same logits. */
TEST(model_accel_stream_spine_not_reread) {
    static const char *fx[] = {"tests/fixtures/kimi_k3_mxfp4", "tests/fixtures/dsv3_fp8_yarn",
                               "tests/fixtures/kimi_linear_a"};
    kn_level lv = kn_detect();
    for (size_t i = 0; i < sizeof fx / sizeof fx[0]; i++) {
        int32_t tok[64];
        int n = 0;
        float *ref = cpu_logits(fx[i], tok, &n);
        if (!n) SKIP("fixtures missing");
        REQUIRE(ref != NULL, "%s cpu", fx[i]);
        size_t bytes = 0;
        int64_t spine = 0, reserve = 0;
        char err[DF_ERRMSG];
        REQUIRE(engine_sizes(fx[i], n, &bytes, &reserve, err), "%s", err);
        uint64_t none_read = 0; /* spine bytes read after the first step with no room (variant 2) */
        for (int b = 0; b < 4; b++) {
            /* 0, 1: everything fits (1: whole-layer hooks); 2: no room;
             * 3: room for all but the last group (kept groups and a cached one) */
            int64_t budget = b == 2 ? 1 : b == 3 ? spine : (int64_t)1 << 40;
            df_accel a = {"fake", &lv, budget, fake_upload, fake_release, fake_matmul, NULL,
                          NULL, NULL, fake_queue, fake_finish, NULL, fake_state_new, fake_state_free,
                          fake_state_zero, fake_kda, fake_mla, NULL, fake_matmul_many,
                          b == 1 ? fake_kda_layer : NULL, b == 1 ? fake_mla_layer : NULL,
                          b == 1 ? fake_moe_tail : NULL,
                  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL}; /* no dev_ hooks, no tc probe */
            df_accel_stats st;
            uint64_t later = 0;
            float *lg = stream_logits(fx[i], &a, 0, &st, &later);
            REQUIRE(lg != NULL, "%s variant %d", fx[i], b);
            if (b == 0) spine = st.resident_bytes + reserve - 1; /* variant 3: all but the last group fit */
            CHECK(stream_described, "%s variant %d: describe does not say which groups stay on the device", fx[i], b);
            CHECK(memcmp(lg, ref, bytes) == 0, "%s variant %d: logits differ from the CPU's", fx[i], b);
            if (b < 2) {
                CHECK(later == 0, "%s variant %d: %llu spine bytes read after the first step", fx[i], b,
                      (unsigned long long)later);
                CHECK(st.spine_groups_on_device > 0 && st.spine_kept_groups > 0, "%s variant %d: %llu groups, %lld kept",
                      fx[i], b, (unsigned long long)st.spine_groups_on_device, (long long)st.spine_kept_groups);
            } else if (b == 2) {
                CHECK(later > 0 && st.spine_groups_on_device == 0 && st.spine_kept_groups == 0,
                      "%s no room: %llu bytes read, %llu groups from the device", fx[i], (unsigned long long)later,
                      (unsigned long long)st.spine_groups_on_device);
                none_read = later;
            } else {
                /* the group not kept stays cached beside them (held while it runs) or is read again */
                CHECK(st.spine_kept_groups > 0 && st.spine_groups_on_device > 0 && later < none_read,
                      "%s room for all but one group: %lld groups kept, %llu entered from the device, %llu of %llu bytes "
                      "read", fx[i], (long long)st.spine_kept_groups, (unsigned long long)st.spine_groups_on_device,
                      (unsigned long long)later, (unsigned long long)none_read);
            }
            CHECK(fake_live == 0 && fake_states == 0, "%s: leaks %d handles, %d states", fx[i], fake_live, fake_states);
            free(lg);
        }
        free(ref);
    }
}

/* A product of a group entered without its bytes that fails on the device
 * reads the group then and runs on the CPU: same logits bit for bit. */
TEST(model_accel_stream_spine_device_failure) {
    static const char *fx[] = {"tests/fixtures/kimi_k3_mxfp4", "tests/fixtures/dsv3_fp8_yarn"};
    kn_level lv = kn_detect();
    for (size_t i = 0; i < sizeof fx / sizeof fx[0]; i++) {
        int32_t tok[64];
        int n = 0;
        float *ref = cpu_logits(fx[i], tok, &n);
        if (!n) SKIP("fixtures missing");
        REQUIRE(ref != NULL, "%s cpu", fx[i]);
        size_t bytes = 0;
        char err[DF_ERRMSG];
        REQUIRE(engine_sizes(fx[i], n, &bytes, NULL, err), "%s", err);
        for (int b = 0; b < 2; b++) {
            /* 0: products one by one (KDA / MLA states on the "device");
             * 1: with the whole-layer hooks (their products do not fail) */
            df_accel a = {"fake", &lv, (int64_t)1 << 40, fake_upload, fake_release, flaky_matmul, NULL, NULL, NULL,
                          fake_queue, fake_finish, NULL, fake_state_new, fake_state_free, fake_state_zero, fake_kda,
                          fake_mla, NULL, flaky_matmul_many, b ? fake_kda_layer : NULL, b ? fake_mla_layer : NULL,
                          b ? fake_moe_tail : NULL,
                  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL}; /* no dev_ hooks, no tc probe */
            df_accel_stats st;
            uint64_t later = 0;
            float *lg = stream_logits(fx[i], &a, b ? 1 : 2, &st, &later);
            REQUIRE(lg != NULL, "%s variant %d", fx[i], b);
            CHECK(fake_failures > 0 && st.spine_groups_on_device > 0, "%s variant %d: %d failures, %llu groups", fx[i],
                  b, fake_failures, (unsigned long long)st.spine_groups_on_device);
            /* with the layer hooks, dsv3's spine has no product outside them (tied head) */
            if (b == 0 || strstr(fx[i], "kimi_k3"))
                CHECK(later > 0, "%s variant %d: failed products read no spine bytes", fx[i], b);
            CHECK(memcmp(lg, ref, bytes) == 0, "%s variant %d: logits differ after device failures", fx[i], b);
            CHECK(fake_live == 0 && fake_states == 0, "%s: leaks %d handles, %d states", fx[i], fake_live, fake_states);
            free(lg);
        }
        free(ref);
    }
}

/* moe_route's choice against the K rounds of "the first untaken maximum" it
 * is defined by, on scores with many ties (values on a coarse grid, a bias
 * that cancels some), dropped groups (0 or -inf), and NaNs. */
static void route_ref(const float *choice, int E, int K, int *taken) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int x = 0; x < E; x++)
            if (!taken[x] && (best < 0 || choice[x] > choice[best])) best = x;
        taken[best] = 1;
    }
}

TEST(moe_route_top_k_matches_rounds_with_ties) {
    enum { E = 96 };
    float bias[E];
    uint32_t r = 12345;
    int bad = 0, cases = 0;
    for (int c = 0; c < 400; c++) {
        moe_layer m;
        memset(&m, 0, sizeof m);
        m.E = E;
        m.K = 1 + c % 17;
        m.n_group = (c / 17) % 3 == 0 ? 1 : 8;
        m.topk_group = m.n_group > 1 ? 1 + c % 7 : 1;
        m.sigmoid = c % 2;
        m.group_mask = (c / 3) % 2 ? 0.0f : -INFINITY;
        m.renorm = 1;
        m.scale = 1.0f;
        m.bias = bias;
        float logit[E];
        for (int x = 0; x < E; x++) {
            r = r * 1664525u + 1013904223u;
            logit[x] = (float)((int)(r >> 28) - 8) * 0.5f; /* 16 values: many ties */
            bias[x] = (c % 5 == 0) ? 0.0f : (float)((int)(r >> 20 & 3)) * 0.25f;
        }
        if (c % 37 == 0) logit[(c * 7) % E] = NAN;
        /* the choice moe_route ranks: the scores plus the bias, dropped groups masked */
        float score[E], choice[E];
        if (m.sigmoid) {
            for (int x = 0; x < E; x++) score[x] = op_sigmoid(logit[x]);
        } else {
            memcpy(score, logit, sizeof score);
            op_softmax(score, E);
        }
        for (int x = 0; x < E; x++) choice[x] = score[x] + bias[x];
        const int G = m.n_group, per = E / G;
        if (G > 1 && m.topk_group < G) {
            float gs[8];
            int keep[8] = {0};
            for (int g = 0; g < G; g++) {
                float a = -INFINITY, b = -INFINITY;
                for (int x = g * per; x < (g + 1) * per; x++) {
                    if (choice[x] > a) { b = a; a = choice[x]; }
                    else if (choice[x] > b) b = choice[x];
                }
                gs[g] = a + b;
            }
            for (int k = 0; k < m.topk_group; k++) {
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
                keep[best] = 1;
            }
            for (int x = 0; x < E; x++)
                if (!keep[x / per]) choice[x] = m.group_mask;
        }
        int taken[E] = {0}, sel[32];
        float selw[32];
        route_ref(choice, E, m.K, taken);
        moe_route(&m, logit, sel, selw, NULL);
        int k = 0;
        for (int x = 0; x < E; x++)
            if (taken[x]) bad += k >= m.K || sel[k++] != x;
        bad += k != m.K;
        cases++;
    }
    CHECK(bad == 0, "%d selections differ over %d cases", bad, cases);
}
