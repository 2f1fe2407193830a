/* spec.c — exact speculative decoding with prompt-lookup drafts (prefix
 * spec_; public df_spec_*).
 *
 * Owns: the token history of one session (the lookup's text), the n-gram
 * drafter, the verify step (one multi-row df_session_eval, df_sampler_sample
 * per row, df_session_rewind past the first rejection), the adaptive depth
 * and the counters. Borrows the session and the sampler (they must outlive
 * it). Refuses: anything lossy — greedy output is the plain greedy output
 * token for token (the verify rows are bit-identical to single steps: the
 * engine's chunking rule), and so is seeded sampled output: each row is
 * sampled exactly as plain decoding samples it (one draw per token, in
 * order) and a draft is accepted when the sample equals it. For a
 * deterministic proposal this is the standard speculative rule (accept d
 * with probability p(d), else draw from p without d, renormalised), with
 * the draws coupled to those of the run without drafts.
 *
 * One step, with x the token sampled last (pending: shown, not evaluated):
 *
 *   history ... a b c x  ── lookup "b c x" earlier ──> drafts d1 .. dK
 *   eval [x d1 .. dK]  (K + 1 rows)  ──> row i verifies d(i+1)
 *   accepted d1 .. dj, then y (the residual draw, or the bonus row's sample)
 *   rewind to after dj; y is the new pending token
 *
 * Adaptive depth: the time of a step is measured per row count (EWMA per
 * count, a least-squares line through them) and the acceptance rate per
 * draft (EWMA); the depth maximising expected tokens per second is used,
 * 0 when drafting does not pay (experts streamed from disk: each row's
 * experts cost reads). With 0, a probe step every PROBE_EVERY steps keeps
 * the estimates fresh.
 *
 * Sections: lifecycle; history and drafts; cost model; the step; settle.
 */
#include "model.h"
#include "../base/err.h"
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { PROBE_EVERY = 16, HIST_MIN = 256 };

struct df_spec {
    df_session *s;
    df_sampler *smp;
    df_spec_params p;
    int32_t *hist;                /* every token of the session's timeline, then the pending one */
    int n, cap;
    int pending;                  /* hist[n - 1] is sampled but not evaluated */
    float *rows;                  /* [DF_SPEC_MAX + 1][V] verify logits */
    int V;
    double t_rows[DF_SPEC_MAX + 2]; /* EWMA seconds of a step by its row count */
    int n_rows[DF_SPEC_MAX + 2];    /* steps measured at each count (capped) */
    double alpha;                 /* EWMA acceptance of one draft (given the ones before it held) */
    int alpha_n;
    int since_probe;
    int32_t toks[DF_SPEC_MAX + 1]; /* the step being verified: x, then its drafts */
    int nd;                       /* its drafts; -1: no step begun with an evaluation */
    int start;                    /* the session's position before it */
    double t0;
    df_spec_stats st;
};

/* ---- lifecycle ---- */

void df_spec_params_default(df_spec_params *p) {
    memset(p, 0, sizeof *p);
    p->depth = 8;
    p->ngram = 3;
    p->adaptive = 1;
}

df_status df_spec_new(df_session *s, df_sampler *smp, const df_spec_params *p, df_spec **out, char err[DF_ERRMSG]) {
    *out = NULL;
    df_spec_params def;
    if (!p) { df_spec_params_default(&def); p = &def; }
    if (p->depth < 1 || p->depth > DF_SPEC_MAX || p->ngram < 1 || p->ngram > 16)
        return df_fail(err, DF_ERR_ARG, "speculative decoding: depth %d must be 1..%d and n-gram %d 1..16", p->depth,
                       DF_SPEC_MAX, p->ngram);
    df_spec *sp = calloc(1, sizeof *sp);
    if (!sp) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    sp->s = s;
    sp->smp = smp;
    sp->p = *p;
    sp->V = df_engine_vocab_size(s->e);
    sp->cap = HIST_MIN;
    sp->hist = malloc((size_t)sp->cap * sizeof *sp->hist);
    sp->rows = malloc((size_t)(DF_SPEC_MAX + 1) * sp->V * sizeof(float));
    if (!sp->hist || !sp->rows) { df_spec_free(sp); return df_fail(err, DF_ERR_NOMEM, "out of memory"); }
    /* a trail costs (depth + 1) recurrent states (Kimi K3: 0.44 GB each),
     * a replay one state and a forward pass of the kept tokens per rejection */
    int trail = (int64_t)(p->depth + 1) * df_engine_recurrent_bytes(s->e) <= DF_SPEC_TRAIL_BYTES;
    df_status st = df_session_set_rewind(s, p->depth + 1, trail ? DF_REWIND_TRAIL : DF_REWIND_REPLAY);
    if (st != DF_OK) {
        df_fail(err, st, "speculative decoding: %s", df_session_error(s));
        df_spec_free(sp);
        return st;
    }
    sp->alpha = 0.5;
    sp->nd = -1;
    sp->st.depth_now = p->depth;
    *out = sp;
    return DF_OK;
}

void df_spec_free(df_spec *sp) {
    if (!sp) return;
    free(sp->hist);
    free(sp->rows);
    free(sp);
}

/* ---- history and drafts ---- */

static df_status push(df_spec *sp, int32_t id) {
    if (sp->n == sp->cap) {
        int cap = sp->cap * 2;
        int32_t *h = realloc(sp->hist, (size_t)cap * sizeof *h);
        if (!h) return DF_ERR_NOMEM;
        sp->hist = h;
        sp->cap = cap;
    }
    sp->hist[sp->n++] = id;
    return DF_OK;
}

df_status df_spec_context(df_spec *sp, const int32_t *ids, int n) {
    if (sp->pending) return DF_ERR_ARG; /* settle first: the pending token is not in the session */
    for (int i = 0; i < n; i++)
        if (push(sp, ids[i]) != DF_OK) return DF_ERR_NOMEM;
    return DF_OK;
}

void df_spec_reset(df_spec *sp) {
    sp->n = 0;
    sp->pending = 0;
}

/* Prompt lookup: the latest earlier place where the last g tokens occur
 * (g from the n-gram length down to 1), and what followed it there. */
static int draft(const df_spec *sp, int k, int32_t *out) {
    const int32_t *h = sp->hist;
    int n = sp->n;
    for (int g = sp->p.ngram < n ? sp->p.ngram : n - 1; g >= 1; g--) {
        for (int j = n - 2; j >= g - 1; j--) { /* h[j-g+1 .. j] against h[n-g .. n-1] */
            int q = 0;
            while (q < g && h[j - q] == h[n - 1 - q]) q++;
            if (q < g) continue;
            int m = 0;
            while (m < k && j + 1 + m < n) { out[m] = h[j + 1 + m]; m++; }
            if (m > 0) return m;
        }
    }
    return 0;
}

/* ---- cost model ---- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void measure(df_spec *sp, int rows, double secs) {
    if (rows < 1 || rows > DF_SPEC_MAX + 1) return;
    if (sp->n_rows[rows] == 0) sp->t_rows[rows] = secs;
    else sp->t_rows[rows] += 0.2 * (secs - sp->t_rows[rows]);
    if (sp->n_rows[rows] < 1000) sp->n_rows[rows]++;
}

/* Seconds of a step of r rows: a least-squares line through the measured
 * counts (each count weighted by its measurements, capped); -1 when fewer
 * than two counts are measured. */
static double cost(const df_spec *sp, int r, double *a_out, double *b_out) {
    double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    int counts = 0;
    for (int i = 1; i <= DF_SPEC_MAX + 1; i++) {
        if (!sp->n_rows[i]) continue;
        double w = sp->n_rows[i] < 8 ? sp->n_rows[i] : 8;
        sw += w; sx += w * i; sy += w * sp->t_rows[i]; sxx += w * i * i; sxy += w * i * sp->t_rows[i];
        counts++;
    }
    if (counts < 2) return -1;
    double den = sw * sxx - sx * sx;
    double b = den > 0 ? (sw * sxy - sx * sy) / den : 0;
    if (b < 0) b = 0;
    double a = (sy - b * sx) / sw;
    if (a_out) *a_out = a + b; /* one row */
    if (b_out) *b_out = b;
    return a + b * r;
}

/* The depth to use now: argmax over k of E[tokens | k] / cost(k + 1). */
static int choose_depth(df_spec *sp) {
    int K = sp->p.depth;
    if (!sp->p.adaptive) return K;
    if (sp->n_rows[1] < 2) return 0;               /* measure one-row steps first (they cost nothing extra) */
    if (cost(sp, 1, NULL, NULL) < 0) return K;     /* then a deep one */
    double al = sp->alpha, best = 0;
    int bk = 0;
    for (int k = 0; k <= K; k++) {
        double e = 0, pw = 1;
        for (int i = 0; i <= k; i++) { e += pw; pw *= al; } /* 1 + a + ... + a^k */
        double c = cost(sp, k + 1, NULL, NULL);
        if (c <= 0) return K;
        double rate = e / c;
        if (rate > best * 1.02) { best = rate; bk = k; } /* prefer shallower on near ties */
    }
    if (bk == 0 && ++sp->since_probe >= PROBE_EVERY) { sp->since_probe = 0; return K < 2 ? K : 2; }
    return bk;
}

/* ---- the step ---- */

df_status df_spec_begin(df_spec *sp, int max, const int32_t **toks, int *n, float **rows) {
    df_session *s = sp->s;
    *n = 0;
    *toks = sp->toks;
    *rows = sp->rows;
    if (max < 1) return DF_ERR_ARG;
    sp->nd = -1;
    if (!sp->pending) return DF_OK; /* the first token of a turn: from the logits the context left */
    int room = s->max_ctx - s->pos; /* rows this step can evaluate */
    if (room < 1) return df_fail(s->err, DF_ERR_CONTEXT, "context full: %d positions used", s->pos);
    int k = choose_depth(sp);
    if (k > max - 1) k = max - 1;
    if (k > room - 1) k = room - 1;
    sp->toks[0] = sp->hist[sp->n - 1];
    sp->nd = k > 0 ? draft(sp, k, sp->toks + 1) : 0;
    sp->start = s->pos;
    sp->t0 = now_s();
    *n = sp->nd + 1;
    return DF_OK;
}

df_status df_spec_end(df_spec *sp, int32_t *out, df_sample *info, int *n_out) {
    df_session *s = sp->s;
    *n_out = 0;
    if (sp->nd < 0) {
        int32_t t = df_sampler_sample(sp->smp, df_session_logits(s), info);
        df_sampler_accept(sp->smp, t);
        if (push(sp, t) != DF_OK) return DF_ERR_NOMEM;
        sp->pending = 1;
        out[0] = t;
        *n_out = 1;
        sp->st.tokens++;
        return DF_OK;
    }
    int nd = sp->nd, start = sp->start;
    const int32_t *toks = sp->toks;
    sp->nd = -1;
    if (s->pos != start + nd + 1) return df_fail(s->err, DF_ERR_ARG, "df_spec_end: the step's tokens were not evaluated");
    /* verify: row i predicts the token after toks[i] */
    int j = 0, got = 0;
    int32_t y = -1;
    for (; j < nd; j++) {
        y = df_sampler_sample(sp->smp, sp->rows + (size_t)j * sp->V, info ? info + got : NULL);
        df_sampler_accept(sp->smp, y);
        out[got++] = y;
        if (y != toks[1 + j]) break;
    }
    if (j == nd) { /* every draft held: the last row gives one more */
        y = df_sampler_sample(sp->smp, sp->rows + (size_t)nd * sp->V, info ? info + got : NULL);
        df_sampler_accept(sp->smp, y);
        out[got++] = y;
    }
    /* the session keeps x and the accepted drafts; y is pending */
    df_status st;
    if (start + 1 + j < s->pos && (st = df_session_rewind(s, start + 1 + j)) != DF_OK) return st;
    measure(sp, nd + 1, sp->p.step_cost ? sp->p.step_cost(sp->p.step_cost_ctx, nd + 1) : now_s() - sp->t0);
    for (int i = 0; i < nd; i++) { /* acceptance of each draft given the ones before it held */
        if (i > j) break;
        double hit = i < j ? 1.0 : 0.0;
        sp->alpha += (sp->alpha_n < 20 ? 1.0 / (sp->alpha_n + 1) : 0.05) * (hit - sp->alpha);
        sp->alpha_n++;
    }
    for (int i = 0; i < got; i++)
        if (push(sp, out[i]) != DF_OK) return DF_ERR_NOMEM;
    sp->st.steps++;
    sp->st.rows += (uint64_t)(nd + 1);
    sp->st.drafted += (uint64_t)nd;
    sp->st.accepted += (uint64_t)j;
    sp->st.tokens += (uint64_t)got;
    sp->st.step_s += now_s() - sp->t0;
    sp->st.depth_now = nd;
    *n_out = got;
    return DF_OK;
}

df_status df_spec_step(df_spec *sp, int max, int32_t *out, df_sample *info, int *n_out) {
    const int32_t *toks;
    float *rows;
    int n;
    *n_out = 0;
    df_status st = df_spec_begin(sp, max, &toks, &n, &rows);
    if (st != DF_OK) return st;
    if (n > 0 && (st = df_session_eval(sp->s, toks, n, rows)) != DF_OK) return st;
    return df_spec_end(sp, out, info, n_out);
}

/* ---- settle ---- */

df_status df_spec_settle(df_spec *sp, int n_drop) {
    df_session *s = sp->s;
    if (n_drop < 0 || n_drop > sp->n) return DF_ERR_ARG;
    int target = sp->n - n_drop; /* tokens the session must hold */
    df_status st = DF_OK;
    if (target < s->pos) st = df_session_rewind(s, target);
    else if (target > s->pos) st = df_session_eval(s, sp->hist + s->pos, target - s->pos, NULL);
    if (st != DF_OK) return st;
    sp->n = target;
    sp->pending = 0;
    return DF_OK;
}

void df_spec_get_stats(const df_spec *sp, df_spec_stats *out) {
    *out = sp->st;
    out->alpha = sp->alpha;
    double a, b;
    if (cost(sp, 1, &a, &b) >= 0) { out->row1_s = a; out->per_row_s = b; }
    else { out->row1_s = sp->n_rows[1] ? sp->t_rows[1] : 0; out->per_row_s = 0; }
}

void df_spec_reset_stats(df_spec *sp) {
    int d = sp->st.depth_now;
    memset(&sp->st, 0, sizeof sp->st);
    sp->st.depth_now = d;
}
