/* ffn.c — gated MLPs (SiLU, SiTU) and the MoE block; see ffn.h.
 *
 * Sections: activation; dense MLP; scratch; router; MoE forward.
 */
#include "ffn.h"
#include "../base/err.h"
#include "../base/mem.h"
#include "../base/pool.h"
#include "../kernels/ops.h"
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- activation ---- */

void ffn_act_apply(kn_level lv, const ffn_act *act, float *g, const float *u, int64_t n) {
    if (act->situ) kn_act_situ_mul(lv, g, u, n, act->beta, act->linear_beta);
    else kn_act_silu_mul(lv, g, u, n);
}

/* The same over the pool: elementwise, so the bits do not depend on the
 * split. A prompt's SiTU (two tanhf and a sigmoid per value) over 256 rows of
 * a dense MLP is millions of values, which one thread took a large part of
 * the prefill's dense MLP time to do. */
typedef struct {
    kn_level lv;
    const ffn_act *act;
    float *g;
    const float *u;
} act_job;

static void act_part(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    const act_job *j = ctx;
    ffn_act_apply(j->lv, j->act, j->g + i0, j->u + i0, i1 - i0);
}

void ffn_act_pool(df_engine *e, const ffn_act *act, float *g, const float *u, int64_t n) {
    act_job j = {e->level, act, g, u};
    pool_for(e->pool, n, 1024, act_part, &j);
}

/* ---- dense MLP ---- */

df_status ffn_bind(df_engine *e, const char *base, const char *const names[3], int64_t inter,
                   int64_t hidden, ffn_weights *w, char *err) {
    char b[DF_NAME];
    df_status st;
    tname(b, "%s%s", base, names[0]);
    if ((st = model_bind(e, b, inter, hidden, &w->gate, err))) return st;
    tname(b, "%s%s", base, names[1]);
    if ((st = model_bind(e, b, inter, hidden, &w->up, err))) return st;
    tname(b, "%s%s", base, names[2]);
    return model_bind(e, b, hidden, inter, &w->down, err);
}

/* An MLP queued on the device as one call (out [n][down rows] written when
 * the queue is finished); 1 if queued. */
static int queue_mlp(df_engine *e, const ffn_weights *w, const ffn_act *act, const float *X, int n, float *out) {
    if (!e->acc) return 0;
    int rows[n > 0 ? n : 1];
    for (int t = 0; t < n; t++) rows[t] = t;
    const df_weight three[3] = {w->gate, w->up, w->down};
    return acc_expert_queue(e->acc, three, act->situ, act->beta, act->linear_beta, X, n, out, rows, w->down.rows);
}

/* The whole MLP as one queued device call and one wait (instead of a wait
 * per product); 1 if the device computed out. */
static int ffn_on_device(df_engine *e, const ffn_weights *w, const ffn_act *act, const float *X, int n,
                         float *out) {
    return queue_mlp(e, w, act, X, n, out) && acc_expert_finish(e->acc, NULL) == DF_OK;
}

/* A decode step's MLP in one pass over the pool (moe_batch.c's schedule for
 * one expert): indices [0, I) are row pairs, whose chunk computes its gate
 * and up rows and the activation of those columns; whoever finishes the
 * last pairs prepares down's input and marks it ready; indices [I, I + H)
 * are down rows, which wait for that (the pool claims in order, so every
 * pair is held by a running thread first). The same kernels on the same
 * inputs as the three passes below: the same bits. For few vectors, whose
 * prepared inputs fit on the stack (a prompt's would need one thread to
 * prepare all of down's input while the others wait). */
enum { MLP_ONE_PASS_MAX_N = 4, MLP_ONE_PASS_STACK = 16384 /* floats */ };

typedef struct {
    df_engine *e;
    const ffn_weights *w;
    const ffn_act *act;
    int n;
    float *g, *u, *out;
    const float *xp;   /* X prepared for gate and up */
    float *gp;         /* g prepared for down */
    _Atomic int64_t left;
    _Atomic int ready;
} mlp_pass;

static void mlp_pass_rows(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    mlp_pass *j = ctx;
    const kn_level lv = j->e->level;
    const int64_t I = j->w->gate.rows;
    const int n = j->n;
    if (i0 < I) {
        const int64_t lo = i0, hi = i1 < I ? i1 : I;
        kn_matmul_px(lv, &j->w->gate, j->xp, n, j->g + lo, I, lo, hi);
        kn_matmul_px(lv, &j->w->up, j->xp, n, j->u + lo, I, lo, hi);
        for (int v = 0; v < n; v++) ffn_act_apply(lv, j->act, j->g + v * I + lo, j->u + v * I + lo, hi - lo);
        if (pool_count_done(&j->left, hi - lo)) {
            kn_px_prep(lv, &j->w->down, j->g, 0, n, j->gp);
            atomic_store_explicit(&j->ready, 1, memory_order_release);
        }
        i0 = hi;
    }
    if (i0 >= i1) return;
    pool_wait_flag(&j->ready);
    const int64_t H = j->w->down.rows;
    kn_matmul_px(lv, &j->w->down, j->gp, n, j->out + (i0 - I), H, i0 - I, i1 - I);
}

/* 1 when the MLP ran in one pass; 0 (nothing written) when it does not
 * qualify: more vectors, the AMX level, an accelerator, weights not on the
 * host, inputs the level reads as given, or prepared inputs too large. */
static int mlp_one_pass(df_engine *e, const ffn_weights *w, const ffn_act *act, const float *X, int n, float *out,
                        float *g, float *u) {
    if (n > MLP_ONE_PASS_MAX_N || e->acc || e->level == KN_AMX) return 0;
    const int64_t fx = kn_px_floats(e->level, &w->gate, n), fg = kn_px_floats(e->level, &w->down, n);
    if (fx <= 0 || fg <= 0 || fx + fg > MLP_ONE_PASS_STACK || kn_px_floats(e->level, &w->up, n) != fx ||
        w->up.type != w->gate.type || w->up.scale_dtype != w->gate.scale_dtype)
        return 0;
    if (!model_host(e, &w->gate) || !model_host(e, &w->up) || !model_host(e, &w->down)) return 0;
    _Alignas(64) float buf[MLP_ONE_PASS_STACK];
    kn_px_prep(e->level, &w->gate, X, 0, n, buf);
    mlp_pass j = {.e = e, .w = w, .act = act, .n = n, .g = g, .u = u, .out = out, .xp = buf, .gp = buf + fx};
    atomic_init(&j.left, w->gate.rows);
    atomic_init(&j.ready, 0);
    pool_for(e->pool, w->gate.rows + w->down.rows, 16, mlp_pass_rows, &j);
    return 1;
}

void ffn_forward(df_engine *e, const ffn_weights *w, const ffn_act *act, const float *X, int n,
                 float *out, float *g, float *u) {
    if (ffn_on_device(e, w, act, X, n, out)) return;
    if (mlp_one_pass(e, w, act, X, n, out, g, u)) return;
    int64_t I = w->gate.rows;
    const mm_req gu[2] = {{&w->gate, X, n, g, I}, {&w->up, X, n, u, I}}; /* one pass, x prepared once */
    mm_many(e, gu, 2);
    ffn_act_pool(e, act, g, u, I * n);
    mm(e, &w->down, g, n, out, w->down.rows);
}

/* ---- scratch ---- */

df_status moe_scratch_new(int chunk, int hidden, int inter, int E, int K, int dl, moe_scratch *s) {
    memset(s, 0, sizeof *s);
    const size_t C = (size_t)chunk, F = sizeof(float);
    if (E < 1) E = 1;
    if (K < 1) K = 1;
    if (dl < 1) dl = hidden;
    int wide = dl > hidden ? dl : hidden;
    s->chunk = chunk; s->hidden = hidden; s->inter = inter; s->E = E; s->K = K; s->dl = dl;
    s->g = mem_big_alloc(C * inter * F);
    s->u = mem_big_alloc(C * inter * F);
    s->rlog = mem_big_alloc(C * E * F);
    s->sel = mem_big_alloc(C * K * sizeof(int));
    s->selw = mem_big_alloc(C * K * F);
    s->ys = mem_big_alloc(C * K * dl * F);
    s->etok = mem_big_alloc(C * K * sizeof(int));
    s->eslot = mem_big_alloc(C * K * sizeof(int));
    s->xl = mem_big_alloc(C * dl * F);
    s->xe = mem_big_alloc(C * wide * F);
    s->ye = mem_big_alloc(C * wide * F);
    s->acc = mem_big_alloc(C * wide * F);
    s->sh = mem_big_alloc(C * hidden * F);
    s->uni = malloc((size_t)E * sizeof(int));
    s->ptok = mem_big_alloc(C * K * sizeof(int));
    s->pslot = mem_big_alloc(C * K * sizeof(int));
    s->poff = malloc((size_t)E * sizeof(int));
    s->pcnt = calloc((size_t)E, sizeof(int));
    s->nlog = mem_big_alloc(C * E * F);
    s->mark = calloc((size_t)E, 1);
    s->ahead = malloc((size_t)E * sizeof(int));
    s->held = malloc((size_t)E * sizeof(int));
    s->conf = malloc((size_t)E * sizeof(float));
    if (moe_batch_new(&s->batch, E, dl, inter) != DF_OK) {
        moe_scratch_free(s);
        return DF_ERR_NOMEM;
    }
    if (!s->ahead || !s->held || !s->conf || !s->g || !s->u || !s->rlog || !s->sel || !s->selw || !s->ys || !s->etok || !s->eslot ||
        !s->xl || !s->xe || !s->ye || !s->acc || !s->sh || !s->uni || !s->ptok || !s->pslot || !s->poff || !s->pcnt || !s->nlog || !s->mark) {
        moe_scratch_free(s);
        return DF_ERR_NOMEM;
    }
    return DF_OK;
}

void moe_scratch_free(moe_scratch *s) {
    if (!s) return;
    free(s->g); free(s->u); free(s->rlog); free(s->sel); free(s->selw); free(s->ys);
    free(s->etok); free(s->eslot); free(s->xl); free(s->xe); free(s->ye); free(s->acc);
    free(s->sh); free(s->uni); free(s->ptok); free(s->pslot); free(s->poff); free(s->pcnt); free(s->nlog); free(s->mark); free(s->ahead); free(s->held);
    moe_batch_free(&s->batch);
    free(s->conf);
    memset(s, 0, sizeof *s);
}

void moe_layer_free(moe_layer *m) {
    if (!m) return;
    free(m->bias);
    free(m->experts);
    free(m->lat_norm);
    m->bias = NULL; m->experts = NULL; m->lat_norm = NULL;
}

/* ---- router ---- */

/* The K rounds of "the first untaken maximum": taken[x] = 1 for the K
 * largest choice[x], the lower index first among equal values. */
static void pick_rounds(const float *choice, int E, int K, int *taken) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int x = 0; x < E; x++)
            if (!taken[x] && (best < 0 || choice[x] > choice[best])) best = x;
        taken[best] = 1;
    }
}

/* pick_rounds' choice in one pass: the K best so far, in order (a later x
 * enters only when strictly above the K-th, so equal values keep the lower
 * index). NaNs make the rounds' outcome order-dependent: with any, the
 * rounds themselves. */
static void pick_top(const float *choice, int E, int K, int *taken) {
    float tv[64];
    int ti[64], nt = 0, nan = K > 64;
    for (int x = 0; x < E && !nan; x++) {
        const float v = choice[x];
        nan = v != v;
        if (nt == K && !(v > tv[K - 1])) continue;
        int j = nt < K ? nt++ : K - 1; /* the slot it may take: the end, or the K-th's */
        while (j > 0 && v > tv[j - 1]) {
            tv[j] = tv[j - 1];
            ti[j] = ti[j - 1];
            j--;
        }
        tv[j] = v;
        ti[j] = x;
    }
    if (nan) pick_rounds(choice, E, K, taken);
    else
        for (int k = 0; k < nt; k++) taken[ti[k]] = 1;
}

void moe_route(const moe_layer *m, const float *logit, int *sel, float *selw, float *margin) {
    int E = m->E, K = m->K, G = m->n_group > 0 ? m->n_group : 1, per = E / G;
    float score[E], choice[E];
    if (m->sigmoid) {
        for (int x = 0; x < E; x++) score[x] = op_sigmoid(logit[x]);
    } else {
        memcpy(score, logit, sizeof score);
        op_softmax(score, E);
    }
    for (int x = 0; x < E; x++) choice[x] = score[x] + m->bias[x];
    if (G > 1 && m->topk_group < G) {
        float gs[G];
        int keep[G];
        for (int g = 0; g < G; g++) { /* group score: sum of its two best */
            float a = -INFINITY, b = -INFINITY;
            for (int x = g * per; x < (g + 1) * per; x++) {
                if (choice[x] > a) { b = a; a = choice[x]; }
                else if (choice[x] > b) b = choice[x];
            }
            gs[g] = per > 1 ? a + b : a;
            keep[g] = 0;
        }
        for (int k = 0; k < m->topk_group; k++) {
            int best = -1;
            for (int g = 0; g < G; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        for (int x = 0; x < E; x++)
            if (!keep[x / per]) choice[x] = m->group_mask;
    }
    int taken[E];
    memset(taken, 0, sizeof taken);
    pick_top(choice, E, K, taken);
    float sum = 0.0f, next_best = -INFINITY; /* the best expert left out */
    if (margin)
        for (int x = 0; x < E; x++)
            if (!taken[x] && choice[x] > next_best) next_best = choice[x];
    for (int x = 0, k = 0; x < E; x++)
        if (taken[x]) {
            sel[k] = x;
            selw[k] = score[x];
            if (margin) margin[k] = choice[x] - next_best;
            sum += score[x];
            k++;
        }
    for (int k = 0; k < K; k++) {
        if (m->renorm) selw[k] /= (sum + 1e-20f);
        selw[k] *= m->scale;
    }
}

/* ---- binding ---- */

df_status moe_bind_expert(df_engine *e, moe_layer *m, int layer, int i, const char *base,
                          const char *const names[3], int64_t inter, int64_t hidden, char *err) {
    ffn_weights *w = &m->experts[i];
    df_status st;
    if (!e->store) {
        int g = e->spine_group; /* mapped experts are not part of the streamed spine */
        e->spine_group = -1;
        st = ffn_bind(e, base, names, inter, hidden, w, err);
        e->spine_group = g;
        if (st) return st;
    } else {
        char b[DF_NAME];
        int64_t shape[3][2] = {{inter, hidden}, {inter, hidden}, {hidden, inter}};
        df_weight *v[3] = {&w->gate, &w->up, &w->down};
        for (int k = 0; k < 3; k++) {
            tname(b, "%s%s", base, names[k]);
            if ((st = wt_bind_lazy(e->st, b, shape[k][0], shape[k][1], e->cfg.fp8_block_rows,
                                   e->cfg.fp8_block_cols, v[k], err)))
                return st;
        }
        df_weight three[3] = {w->gate, w->up, w->down};
        if ((st = xs_register(e->store, layer, i, three, err))) return st;
        m->store = e->store;
        m->layer = layer;
    }
    m->expert_bytes = wt_bytes(&w->gate) + wt_bytes(&w->up) + wt_bytes(&w->down);
    return DF_OK;
}

df_status moe_bind(df_engine *e, int layer, const char *base, const moe_flavour *f, moe_layer *x,
                   int64_t *expert_bytes_total, char *err) {
    const df_config *c = &e->cfg;
    char b[DF_NAME];
    df_status st;
    int H = c->hidden_size;
    int dl = c->routed_expert_hidden_size > 0 ? c->routed_expert_hidden_size : H;
    x->E = c->n_routed_experts;
    x->K = c->num_experts_per_tok;
    x->n_group = c->n_group;
    x->topk_group = c->topk_group;
    x->sigmoid = c->scoring_sigmoid;
    x->group_mask = f->group_mask;
    x->renorm = c->norm_topk_prob && (x->K > 1 || f->renorm_single);
    x->scale = (float)c->routed_scaling_factor;
    tname(b, "%sgate", base);
    if ((st = model_bind_resident(e, b, x->E, H, &x->router, err))) return st;
    x->bias = calloc((size_t)x->E, sizeof(float));
    x->experts = calloc((size_t)x->E, sizeof(ffn_weights));
    if (!x->bias || !x->experts) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    tname(b, "%sgate.e_score_correction_bias", base);
    if (st_find(e->st, b) && (st = wt_load_vec(e->st, b, x->E, x->bias, err))) return st;
    if (c->n_shared_experts > 0) {
        x->has_shared = 1;
        tname(b, "%sshared_experts.", base);
        if ((st = ffn_bind(e, b, f->shared_names, (int64_t)c->moe_intermediate_size * c->n_shared_experts, H,
                           &x->shared, err)))
            return st;
    }
    if (c->routed_expert_hidden_size > 0) {
        x->latent = 1;
        tname(b, "%srouted_expert_down_proj", base);
        if ((st = model_bind(e, b, dl, H, &x->lat_down, err))) {
            size_t n = strlen(err);
            snprintf(err + n, DF_ERRMSG - n, "; config.json field 'routed_expert_hidden_size' is %d", dl);
            return st;
        }
        tname(b, "%srouted_expert_up_proj", base);
        if ((st = model_bind(e, b, H, dl, &x->lat_up, err))) return st;
        if (c->latent_moe_use_norm) {
            tname(b, "%srouted_expert_norm.weight", base);
            if (!(x->lat_norm = model_vec(e, b, dl, &st, err))) return st;
        }
        x->lat_eps = (float)c->rms_norm_eps;
    }
    for (int i = 0; i < x->E; i++) {
        tname(b, "%sexperts.%d.", base, i);
        if ((st = moe_bind_expert(e, x, layer, i, b, f->expert_names, c->moe_intermediate_size, dl, err)))
            return st;
        *expert_bytes_total += x->expert_bytes;
    }
    return DF_OK;
}

/* ---- MoE forward ---- */

/* Groups the pass's (token, slot) pairs by expert (s->ptok / s->pslot,
 * s->poff / s->pcnt), its nu experts s->uni ascending, each expert's pairs
 * by token: one pass over the routing instead of one per expert. */
static void group_pairs(const moe_layer *m, moe_scratch *s, int n, int nu) {
    const int K = m->K;
    for (int i = 0; i < nu; i++) s->pcnt[s->uni[i]] = 0;
    for (int i = 0; i < n * K; i++) s->pcnt[s->sel[i]]++;
    for (int i = 0, o = 0; i < nu; i++) {
        s->poff[s->uni[i]] = o;
        o += s->pcnt[s->uni[i]];
        s->pcnt[s->uni[i]] = 0; /* a cursor while filling, the count after */
    }
    for (int t = 0; t < n; t++)
        for (int k = 0; k < K; k++) {
            const int x = s->sel[t * K + k], j = s->poff[x] + s->pcnt[x]++;
            s->ptok[j] = t;
            s->pslot[j] = k;
        }
}

/* The (token, slot) pairs that chose expert x into s->etok / s->eslot,
 * and with copy their rows of xin into s->xe; returns how many. */
static int gather_tokens(moe_scratch *s, const float *xin, int x, int dl, int copy) {
    const int cnt = s->pcnt[x], o = s->poff[x];
    memcpy(s->etok, s->ptok + o, (size_t)cnt * sizeof(int));
    memcpy(s->eslot, s->pslot + o, (size_t)cnt * sizeof(int));
    for (int i = 0; copy && i < cnt; i++)
        memcpy(s->xe + (size_t)i * dl, xin + (size_t)s->etok[i] * dl, (size_t)dl * sizeof(float));
    return cnt;
}

/* Stores the expert outputs s->ye in their (token, slot) rows of s->ys. */
static void scatter_tokens(const moe_layer *m, moe_scratch *s, int cnt, int dl) {
    for (int i = 0; i < cnt; i++)
        memcpy(s->ys + ((size_t)s->etok[i] * m->K + s->eslot[i]) * dl, s->ye + (size_t)i * dl,
               (size_t)dl * sizeof(float));
}

/* Queues expert x (views w) on the device for the cnt tokens gathered in
 * s->xe (with device rows, s->dv: their rows there); its outputs land in
 * their (token, slot) rows of s->ys when acc_expert_finish returns. 1 if
 * queued. */
static int queue_expert(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s, int cnt,
                        const df_weight w[XS_MATS], int dl, int x) {
    if (!e->acc) return 0;
    int rows[cnt > 0 ? cnt : 1];
    for (int i = 0; i < cnt; i++) rows[i] = s->etok[i] * m->K + s->eslot[i];
    /* device rows: one token's input as it stands there, or expert x's
     * rows as moe_forward gathered them */
    const moe_dev *dv = s->dv;
    const float *X = !dv ? s->xe : dv->n == 1 ? dv->xin : dv->xg + (size_t)s->poff[x] * dl;
    return acc_expert_queue(e->acc, w, act->situ, act->beta, act->linear_beta, X, cnt, s->ys, rows, dl);
}

/* With device rows (s->dv, n > 1): every routed expert's input rows of the
 * pass gathered on the device into dv->xg in group_pairs' order (expert
 * x's from row s->poff[x]), so each queued expert reads its rows in one
 * block as on the host. */
static df_status gather_on_device(df_engine *e, const moe_layer *m, moe_scratch *s, int dl, char *err) {
    return acc_dev_gather(e->acc, s->dv->xg, s->dv->xin, s->ptok, s->dv->n * m->K, dl, err);
}

/* With device rows (s->dv): brings xn (into s->xn_host) and, for a latent
 * layer, xl (into s->xl) to the host, once, for a part the device did not
 * take. 1 when they are there. */
static int dv_fetch(df_engine *e, moe_scratch *s, int latent) {
    moe_dev *dv = s->dv;
    if (!dv || dv->fetched) return 1;
    char err[DF_ERRMSG];
    dv->st = acc_dev_get(e->acc, s->xn_host, dv->xn, (int64_t)dv->n * s->hidden, err);
    if (dv->st == DF_OK && latent) dv->st = acc_dev_get(e->acc, s->xl, dv->xl, (int64_t)dv->n * s->dl, err);
    dv->fetched = dv->st == DF_OK;
    return dv->fetched;
}

/* Runs expert x (views w) over the chunk tokens that chose it, storing each
 * output in its (token, slot) row of s->ys: queued on the device (1; w's
 * bytes must then stay until acc_expert_finish), else now on the CPU (0). */
static int run_expert(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s,
                      const float *xin, int x, const ffn_weights *w, int dl) {
    int cnt = gather_tokens(s, xin, x, dl, !s->dv); /* device rows: gathered there */
    const df_weight three[XS_MATS] = {w->gate, w->up, w->down};
    if (queue_expert(e, m, act, s, cnt, three, dl, x)) return 1;
    if (s->dv) { /* the host's copy of the device rows, gathered here */
        if (!dv_fetch(e, s, m->latent)) return 0;
        cnt = gather_tokens(s, xin, x, dl, 1);
    }
    ffn_forward(e, w, act, s->xe, cnt, s->ye, s->g, s->u);
    scatter_tokens(m, s, cnt, dl);
    return 0;
}

/* The GPU tier over the RAM cache: expert x of the layer runs from its
 * device copies alone when all three are on the device now; its bytes are
 * then never read into RAM. 0 (nothing written) when it cannot. */
static int expert_on_device(df_engine *e, const moe_layer *m, int x) {
    if (!e->acc || !m->store) return 0;
    df_weight w[XS_MATS];
    xs_templates(m->store, m->layer, x, w);
    for (int i = 0; i < XS_MATS; i++)
        if (!acc_on_device(e->acc, &w[i])) return 0;
    return 1;
}

/* run_expert for an expert on the device (expert_on_device): 1 if the device
 * took it (queued, or computed now without the queue hooks), 0 after a
 * device failure (then the caller reads it). */
static int run_expert_device(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s,
                             const float *xin, int x, int dl) {
    df_weight w[XS_MATS];
    xs_templates(m->store, m->layer, x, w);
    int cnt = gather_tokens(s, xin, x, dl, !s->dv); /* device rows: gathered there */
    const int64_t I = w[0].rows;
    if (!queue_expert(e, m, act, s, cnt, w, dl, x)) {
        /* the same device path as every other expert, or none; device
         * rows have no host copy here (run_expert fetches them) */
        if (e->opts.accel->expert_queue || s->dv) return 0;
        if (!acc_mm(e->acc, &w[0], s->xe, cnt, s->g, I) || !acc_mm(e->acc, &w[1], s->xe, cnt, s->u, I)) return 0;
        ffn_act_pool(e, act, s->g, s->u, I * cnt);
        if (!acc_mm(e->acc, &w[2], s->g, cnt, s->ye, w[2].rows)) return 0;
        scatter_tokens(m, s, cnt, dl);
    }
    acc_count_tier_hit(e->acc);
    return 1;
}

/* Waits for the experts queued on the device, then gives their RAM slots
 * back to the store (an upload may read a slot until then). */
static df_status finish_held(df_engine *e, const moe_layer *m, moe_scratch *s, int *nheld, char *err) {
    df_status st = acc_expert_finish(e->acc, err);
    for (int i = 0; i < *nheld; i++) xs_done(m->store, s->held[i]);
    *nheld = 0;
    return st;
}

/* Runs the CPU batch (if run) and gives its experts' slots back to the store. */
static void flush_batch(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s, int run) {
    if (run) moe_batch_run(e, m, act, s);
    for (int i = 0; i < s->batch.n; i++)
        if (m->store) xs_done(m->store, s->batch.x[i]);
    moe_batch_clear(&s->batch);
}

/* Expert x (views w) on the CPU without the device: into the batch, which
 * runs first when x does not fit beside it; alone when x's rows do not fit
 * even an empty batch. Returns 1 when x waits in the batch (its slot is
 * given back by flush_batch), 0 when it ran now. */
static int cpu_expert(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s, const float *xin,
                      int x, const ffn_weights *w, int dl) {
    if (moe_batch_add(s, xin, x, w)) return 1;
    flush_batch(e, m, act, s, 1);
    if (moe_batch_add(s, xin, x, w)) return 1;
    run_expert(e, m, act, s, xin, x, w, dl);
    return 0;
}

/* Runs the store pass's experts as they arrive. Experts queued on the
 * device keep their slots until the queue is finished, and experts in the
 * CPU batch until it runs: both happen whenever no further expert is ready
 * (so nothing is held while waiting for a read) and at the end of the pass. */
static df_status run_from_store(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s,
                                const float *xin, int dl, char *err) {
    df_status st = DF_OK;
    int nheld = 0;
    for (;;) {
        int x;
        df_weight w[XS_MATS];
        if ((st = xs_next_ready(m->store, &x, w, err)) != DF_OK) break;
        if (x < 0) {
            if (nheld && (st = finish_held(e, m, s, &nheld, err)) != DF_OK) break;
            if (s->batch.n) flush_batch(e, m, act, s, 1);
            if ((st = xs_next(m->store, &x, w, err)) != DF_OK || x < 0) break;
        }
        ffn_weights fw = {w[0], w[1], w[2]};
        if (!e->acc) {
            if (!cpu_expert(e, m, act, s, xin, x, &fw, dl)) xs_done(m->store, x);
        } else if (run_expert(e, m, act, s, xin, x, &fw, dl)) {
            s->held[nheld++] = x;
        } else {
            xs_done(m->store, x);
        }
    }
    flush_batch(e, m, act, s, st == DF_OK);
    if (nheld) {
        df_status fst = finish_held(e, m, s, &nheld, err);
        if (st == DF_OK) st = fst;
    }
    xs_end(m->store);
    return st;
}

/* Offers the next layer's predicted experts (moe_lookahead) that sit in the
 * RAM cache to the device: their uploads start now and run behind this
 * layer's work and the next layer's attention. Never changes results. */
static void device_prefetch(df_engine *e, const moe_layer *nx, moe_scratch *s) {
    if (!e->acc || !nx || !nx->store || !s->n_ahead) return;
    for (int i = 0; i < s->n_ahead; i++) {
        df_weight w[XS_MATS];
        if (xs_peek(nx->store, nx->layer, s->ahead[i], w)) acc_prefetch(e->acc, w, XS_MATS);
    }
    s->n_ahead = 0;
}

/* Router lookahead: the next MoE layer's router on this layer's input
 * predicts most of its experts; their reads start now, most confident
 * first (confidence: how far an expert's biased score is above the best
 * one left out; for a chunk, its best margin over the tokens), so the
 * store's policy can drop the ranks whose precision does not pay. Never
 * changes which experts run. */
static int lookahead_on(const df_engine *e, const moe_layer *nx) {
    return nx && nx->store && nx->lookahead && !moe_all_on_device(e, nx);
}

int moe_all_on_device(const df_engine *e, const moe_layer *m) {
    return m->layer >= 0 && m->layer < 256 && (e->moe_on_dev[m->layer >> 6] >> (m->layer & 63) & 1);
}

/* Notes whether every expert of m's last pass ran from device copies. */
static void note_on_device(df_engine *e, const moe_layer *m, int all) {
    if (m->layer < 0 || m->layer >= 256) return;
    const uint64_t bit = (uint64_t)1 << (m->layer & 63);
    if (all) e->moe_on_dev[m->layer >> 6] |= bit;
    else e->moe_on_dev[m->layer >> 6] &= ~bit;
}

/* moe_lookahead with the next router's logits already in s->nlog. */
static void lookahead_from(df_engine *e, const moe_layer *nx, moe_scratch *s, int n) {
    int K = nx->K, E = nx->E;
    int *sel = s->etok; /* free until run_expert */
    float *conf = s->conf;
    int nu = 0;
    for (int t = 0; t < n; t++) {
        float wt[K], mg[K];
        moe_route(nx, s->nlog + (size_t)t * E, sel, wt, mg);
        for (int k = 0; k < K; k++) {
            int x = sel[k];
            if (!s->mark[x]) { s->mark[x] = 1; s->uni[nu++] = x; conf[x] = mg[k]; }
            else if (mg[k] > conf[x]) conf[x] = mg[k];
        }
    }
    for (int i = 0; i < nu; i++) s->mark[s->uni[i]] = 0;
    int keep = 0; /* experts already on the device need no read */
    for (int i = 0; i < nu; i++)
        if (!expert_on_device(e, nx, s->uni[i])) s->uni[keep++] = s->uni[i];
    /* most confident first (insertion sort: keep <= chunk x K, ties by id) */
    for (int i = 1; i < keep; i++) {
        int x = s->uni[i], j = i;
        while (j > 0 && (conf[s->uni[j - 1]] < conf[x] || (conf[s->uni[j - 1]] == conf[x] && s->uni[j - 1] > x))) {
            s->uni[j] = s->uni[j - 1];
            j--;
        }
        s->uni[j] = x;
    }
    xs_prefetch(nx->store, nx->layer, s->uni, keep);
    if (e->acc) {
        memcpy(s->ahead, s->uni, (size_t)keep * sizeof(int));
        s->n_ahead = keep;
    }
}

void moe_lookahead(df_engine *e, const moe_layer *nx, moe_scratch *s, const float *xn, int n) {
    if (!lookahead_on(e, nx)) return;
    mm(e, &nx->router, xn, n, s->nlog, nx->E);
    lookahead_from(e, nx, s, n);
}

/* Batched passes: the experts each session would have used alone (summed)
 * against the union the pass uses once (df_engine_batch_stats). */
static void union_stats(df_engine *e, moe_scratch *s, int n, int K, int nu) {
    e->bstats.union_experts += (uint64_t)nu;
    if (!s->rseg) { e->bstats.solo_experts += (uint64_t)nu; return; }
    for (int t0 = 0; t0 < n;) {
        int t1 = t0;
        while (t1 < n && s->rseg[t1] == s->rseg[t0]) t1++;
        for (int i = t0 * K; i < t1 * K; i++) {
            if (!s->mark[s->sel[i]]) e->bstats.solo_experts++;
            s->mark[s->sel[i]] = 1;
        }
        for (int i = t0 * K; i < t1 * K; i++) s->mark[s->sel[i]] = 0;
        t0 = t1;
    }
}

typedef struct {
    const moe_layer *m;
    const float *rlog;
    int *sel;
    float *selw;
} route_job;

/* moe_route over rows [t0, t1) (each row's choice depends on that row alone) */
static void route_rows(void *ctx, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const route_job *j = ctx;
    const int E = j->m->E, K = j->m->K;
    for (int64_t t = t0; t < t1; t++) moe_route(j->m, j->rlog + (size_t)t * E, j->sel + t * K, j->selw + t * K, NULL);
}

/* The host's end of a MoE layer, per token (each row's values depend on
 * that row alone, so any split gives the same bits). */
typedef struct {
    const moe_layer *m;
    const moe_scratch *s;
    float *acc, *out;
    int dl, H;
} tail_job;

/* Rows [t0, t1): the weighted sum of the token's K expert outputs (k
 * ascending) into acc, then a latent layer's RMSNorm of it. */
static void combine_rows(void *ctx, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const tail_job *j = ctx;
    const int K = j->m->K, dl = j->dl;
    for (int64_t t = t0; t < t1; t++) {
        float *o = j->acc + (size_t)t * dl;
        memset(o, 0, (size_t)dl * sizeof(float));
        for (int k = 0; k < K; k++) op_axpy(o, j->s->selw[t * K + k], j->s->ys + ((size_t)t * K + k) * dl, dl);
        if (j->m->latent && j->m->lat_norm) op_rmsnorm(o, o, j->m->lat_norm, dl, j->m->lat_eps);
    }
}

/* Rows [t0, t1): out += the shared experts' output. */
static void add_shared_rows(void *ctx, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const tail_job *j = ctx;
    for (size_t i = (size_t)t0 * j->H; i < (size_t)t1 * j->H; i++) j->out[i] += j->s->sh[i];
}

df_status moe_forward(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s,
                      const float *xn, int n, int pos, float *out, char *err) {
    int H = (int)m->router.cols, K = m->K;
    int dl = m->latent ? (int)m->lat_down.rows : H;
    double pt = prof_now(e);
    /* the products of xn that do not wait for the routing: this router, the
     * next layer's (lookahead) and the latent down-projection, in one
     * accelerator call (one host wait) */
    const int ahead = m->store && lookahead_on(e, m->next);
    moe_dev *dv = s->dv; /* rows on the device: their inputs and output there */
    const float *xd = dv ? dv->xn : xn;
    /* the shared experts queued like a routed one, first: the device runs
     * them while the host routes (matmul_many launches the queue behind
     * the products it waits for); s->sh is written when the layer's queue
     * is finished (one wait for the layer, not three) */
    const int shared_queued = m->has_shared && queue_mlp(e, &m->shared, act, xd, n, s->sh);
    mm_req pre[3];
    int npre = 0;
    pre[npre++] = (mm_req){&m->router, xd, n, s->rlog, m->E};
    if (ahead) pre[npre++] = (mm_req){&m->next->router, xd, n, s->nlog, m->next->E};
    if (m->latent) pre[npre++] = (mm_req){&m->lat_down, xd, n, dv ? dv->xl : s->xl, dl};
    df_status pst = mm_many_dev(e, pre, npre, err); /* fails only over device rows */
    if (pst != DF_OK) return pst;
    if (dv) dv->xin = m->latent ? dv->xl : dv->xn;
    route_job rj = {m, s->rlog, s->sel, s->selw};
    pool_for(e->pool, n, 16, route_rows, &rj); /* a prompt's rows over the pool (the device waits for them) */
    if (m->trace)
        for (int t = 0; t < n; t++)
            m->trace(m->trace_ctx, s->rpos ? s->rpos[t] : pos + t, m->trace_layer, s->sel + t * K, s->selw + t * K,
                     K);
    /* the union of the chunk's experts, ascending */
    int nu = 0;
    for (int i = 0; i < n * K; i++) s->mark[s->sel[i]] = 1;
    for (int x = 0; x < m->E; x++)
        if (s->mark[x]) { s->uni[nu++] = x; s->mark[x] = 0; }
    union_stats(e, s, n, K, nu);
    df_status st = DF_OK;
    group_pairs(m, s, n, nu);
    if (dv && n > 1 && (st = gather_on_device(e, m, s, dl, err)) != DF_OK) return st;
    /* experts with device copies run from them (dev, ascending); only the
     * rest are read (s->uni keeps them, ascending) */
    int ndev = 0, nread = 0;
    int dev[nu > 0 ? nu : 1];
    for (int i = 0; i < nu; i++) {
        if (m->store && e->acc && expert_on_device(e, m, s->uni[i])) dev[ndev++] = s->uni[i];
        else s->uni[nread++] = s->uni[i];
    }
    if (m->store && e->acc) note_on_device(e, m, nu > 0 && nread == 0);
    prof_add(e, DF_PROF_ROUTER, &pt);
    /* handing the reads (this layer's and the lookahead's) to the kernel,
     * which may block on a full queue, counts with the routed experts, as
     * the waiting for them does */
    if (m->store && (st = xs_begin(m->store, m->layer, s->uni, nread, err))) return st;
    if (ahead) lookahead_from(e, m->next, s, n);
    prof_add(e, DF_PROF_ROUTED, &pt);
    /* work that overlaps the reads */
    const float *xin = xn;
    if (m->has_shared && !shared_queued) {
        if (!dv_fetch(e, s, m->latent)) return df_fail(err, dv->st, "fetching activations from the device");
        ffn_forward(e, &m->shared, act, xn, n, s->sh, s->g, s->u);
    }
    prof_add(e, DF_PROF_SHARED, &pt);
    if (m->latent) xin = s->xl; /* computed above */
    /* each expert used by the chunk runs once over all its tokens, as it arrives */
    if (!m->store) {
        for (int i = 0; i < nu; i++) {
            if (e->acc) run_expert(e, m, act, s, xin, s->uni[i], &m->experts[s->uni[i]], dl);
            else cpu_expert(e, m, act, s, xin, s->uni[i], &m->experts[s->uni[i]], dl);
        }
        flush_batch(e, m, act, s, 1);
    } else {
        /* the device's experts while the reads are in flight; any it fails
         * on are read afterwards in a second pass */
        int nfail = 0;
        for (int i = 0; i < ndev; i++)
            if (!run_expert_device(e, m, act, s, xin, dev[i], dl)) dev[nfail++] = dev[i];
        if ((st = run_from_store(e, m, act, s, xin, dl, err)) != DF_OK) return st;
        if (nfail) {
            if ((st = xs_begin(m->store, m->layer, dev, nfail, err)) != DF_OK) return st;
            if ((st = run_from_store(e, m, act, s, xin, dl, err)) != DF_OK) return st;
        }
        device_prefetch(e, m->next, s);
    }
    /* a latent layer's end on the device when it offers it (the experts'
     * outputs never come back to the host), else here */
    if (dv && dv->st != DF_OK) return df_fail(err, dv->st, "fetching activations from the device");
    if (m->latent) {
        int r = acc_moe_tail(e->acc, n, K, s->selw, s->ys, dl, m->lat_norm, m->lat_eps, &m->lat_up,
                             m->has_shared ? s->sh : NULL, dv ? dv->out : out, err);
        if (r < 0) return DF_ERR_IO;
        if (r > 0) {
            prof_add(e, DF_PROF_ROUTED, &pt);
            return DF_OK;
        }
    }
    if ((st = acc_expert_finish(e->acc, err)) != DF_OK) return st;
    float *acc = m->latent ? s->acc : out;
    tail_job tj = {m, s, acc, out, dl, H};
    pool_for(e->pool, n, 4, combine_rows, &tj); /* a prompt's rows over the pool */
    if (m->latent) mm(e, &m->lat_up, acc, n, out, H);
    if (m->has_shared) pool_for(e->pool, n, 4, add_shared_rows, &tj);
    if (dv && (st = acc_dev_put(e->acc, dv->out, out, (int64_t)n * H, err)) != DF_OK) return st;
    prof_add(e, DF_PROF_ROUTED, &pt);
    return DF_OK;
}

df_status ffn_block(df_engine *e, const moe_layer *moe, const ffn_weights *mlp, const moe_layer *next,
                    const ffn_act *act, moe_scratch *s, const float *xn, int n, int pos, float *y, double *pt,
                    char *err) {
    if (moe) {
        df_status st = moe_forward(e, moe, act, s, xn, n, pos, y, err);
        if (st != DF_OK) return st;
        *pt = prof_now(e);
        return DF_OK;
    }
    if (next) {
        moe_lookahead(e, next, s, xn, n);
        device_prefetch(e, next, s);
    }
    ffn_forward(e, mlp, act, xn, n, y, s->g, s->u);
    prof_add(e, DF_PROF_DENSE, pt);
    return DF_OK;
}

df_status ffn_block_dev(df_engine *e, const moe_layer *moe, const ffn_weights *mlp, const moe_layer *next,
                        const ffn_act *act, moe_scratch *s, moe_dev *dv, float *xn_host, int pos, float *y_host,
                        double *pt, char *err) {
    const int n = dv->n;
    dv->fetched = 0;
    dv->st = DF_OK;
    dv->xin = dv->xn;
    s->dv = dv;
    s->xn_host = xn_host;
    df_status st = DF_OK;
    if (moe) {
        st = moe_forward(e, moe, act, s, xn_host, n, pos, y_host, err);
        *pt = prof_now(e);
    } else {
        /* the whole MLP queued on its device rows (first: it runs while the
         * host takes the lookahead's logits); else on the host */
        const int queued = queue_mlp(e, mlp, act, dv->xn, n, dv->out);
        if (lookahead_on(e, next)) {
            const mm_req r = {&next->router, dv->xn, n, s->nlog, next->E};
            if ((st = mm_many_dev(e, &r, 1, err)) == DF_OK) lookahead_from(e, next, s, n);
        }
        if (st == DF_OK) device_prefetch(e, next, s);
        if (st != DF_OK && queued) acc_expert_finish(e->acc, NULL); /* drained: the step fails */
        if (st == DF_OK && !(queued && acc_expert_finish(e->acc, NULL) == DF_OK)) {
            if (!dv_fetch(e, s, 0)) st = df_fail(err, dv->st, "fetching activations from the device");
            if (st == DF_OK) {
                ffn_forward(e, mlp, act, xn_host, n, y_host, s->g, s->u);
                st = acc_dev_put(e->acc, dv->out, y_host, (int64_t)n * s->hidden, err);
            }
        }
        prof_add(e, DF_PROF_DENSE, pt);
    }
    s->dv = NULL;
    return st;
}
