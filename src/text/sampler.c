/* sampler.c — next-token choice from a logits row (prefix smp_ for helpers;
 * public df_sampler_*).
 *
 * Owns: logit bias, repetition / presence / frequency penalties over a window
 * of accepted tokens, top-n logprobs, greedy, temperature, top-k, top-p,
 * min-p, and the draw, with a PRNG state per sampler (xoshiro256**, seeded
 * through splitmix64), so two samplers with one seed give one sequence and
 * nothing is shared between samplers.
 * Refuses: nothing at run time; bad parameters fail df_sampler_new.
 * Allocates: everything at df_sampler_new (vocab-sized scratch, the penalty
 * window); df_sampler_sample and df_sampler_accept allocate nothing.
 *
 * One step, on a private copy of the row:
 *
 *   bias ──> penalties ──> [top-n logprobs, T = 1] ──> T <= 0 ? argmax
 *        : /T ──> top-k ──> softmax ──> top-p ──> min-p ──> draw u in [0, mass)
 *
 * Candidates are found without sorting the whole vocabulary: a quickselect
 * partition brings the k best to the front (k doubles until top-p's mass is
 * covered), then only those are sorted. Without any truncation the draw walks
 * the vocabulary in id order.
 *
 * Sections: 1. PRNG  2. selection helpers  3. lifecycle and history  4. sample
 */
#include "text.h"
#include "../base/err.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct df_sampler {
    df_sampler_params p;
    int V;
    float *work;          /* adjusted logits (kept for the logprobs) */
    float *prob;          /* exp(work/T - max): unnormalised probabilities */
    int32_t *idx;         /* candidate ids, best first after selection */
    float *bias;          /* per id, 0 unless set */
    int has_bias;
    int32_t *count;       /* occurrences of each id in the penalty window */
    int32_t *ring;        /* the window (penalty_last_n > 0) */
    int ring_n, ring_pos;
    uint64_t rng[4];
};

/* ---- 1. PRNG -------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro(uint64_t s[4]) {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

static void seed_rng(df_sampler *s) {
    uint64_t x = s->p.seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&x);
}

/* uniform in [0, 1) with 53 random bits */
static double uniform(df_sampler *s) { return (double)(xoshiro(s->rng) >> 11) * 0x1.0p-53; }

/* exp(x) for x <= 0 (arguments here are logit - max), relative error about
 * 2e-7 (float rounding): x = n ln2 + r, |r| <= ln2/2, a degree-6 Taylor
 * polynomial for e^r, 2^n put into the exponent. Below -87 it returns 0.
 * Written out because libm's expf costs ~40 ns a call on some machines and a
 * step takes one per vocabulary entry; this loop vectorises. */
static inline float exp_neg(float x) {
    if (!(x > -87.0f)) return 0.0f; /* also -inf and NaN */
    float n = __builtin_roundf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    union { float f; int32_t i; } u = {.f = p};
    u.i += (int32_t)n * (1 << 23);
    return u.f;
}

/* ---- 2. selection helpers ---------------------------------------------------------- */

/* Better candidate first: larger value, then lower id (deterministic). */
static int better(const float *v, int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); }

/* Rearranges idx[0..n) so that its k best (by v) come first, in any order. */
static void select_top(const float *v, int32_t *idx, int n, int k) {
    int lo = 0, hi = n - 1;
    uint32_t r = 0x9e3779b9u;
    while (lo < hi) {
        r = r * 1664525u + 1013904223u; /* pivot choice; any order gives the same set */
        int32_t piv = idx[lo + (int)(r % (uint32_t)(hi - lo + 1))];
        int i = lo, j = hi;
        while (i <= j) {
            while (better(v, idx[i], piv)) i++;
            while (better(v, piv, idx[j])) j--;
            if (i <= j) { int32_t t = idx[i]; idx[i] = idx[j]; idx[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* Sorts idx[0..n) best first: heapsort with the values passed along (no
 * file-scope key for qsort, so samplers on different threads share nothing). */
static void sift_down(const float *v, int32_t *idx, int root, int n) {
    for (;;) {
        int c = 2 * root + 1;
        if (c >= n) return;
        /* a min-heap by "better": the worst candidate sits at the root */
        if (c + 1 < n && better(v, idx[c], idx[c + 1])) c++;
        if (!better(v, idx[root], idx[c])) return;
        int32_t t = idx[root]; idx[root] = idx[c]; idx[c] = t;
        root = c;
    }
}

static void sort_top(const float *v, int32_t *idx, int n) {
    for (int i = n / 2 - 1; i >= 0; i--) sift_down(v, idx, i, n);
    for (int end = n - 1; end > 0; end--) {
        int32_t t = idx[0]; idx[0] = idx[end]; idx[end] = t; /* the worst goes last */
        sift_down(v, idx, 0, end);
    }
}

/* ---- 3. lifecycle and history --------------------------------------------------- */

void df_sampler_params_default(df_sampler_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
    p->penalty_last_n = 64;
    p->seed = 0x5eed;
}

df_status df_sampler_new(const df_sampler_params *p, int vocab_size, df_sampler **out, char err[DF_ERRMSG]) {
    *out = NULL;
    if (!p || vocab_size <= 0) return df_fail(err, DF_ERR_ARG, "sampler: no parameters or an empty vocabulary");
    if (!(p->temperature >= 0 || p->temperature < 0) || p->top_k < 0 || !(p->top_p > 0) || !(p->min_p >= 0 && p->min_p <= 1) ||
        !(p->repetition_penalty > 0) || !isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty) ||
        p->penalty_last_n < -1 || p->n_logprobs < 0 || p->n_logprobs > 20)
        return df_fail(err, DF_ERR_ARG,
                       "sampler: bad parameters (need top_k >= 0, top_p > 0, 0 <= min_p <= 1, repetition_penalty > 0, "
                       "penalty_last_n >= -1, 0 <= n_logprobs <= 20)");
    df_sampler *s = calloc(1, sizeof *s);
    if (!s) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    s->p = *p;
    s->V = vocab_size;
    s->work = malloc((size_t)vocab_size * sizeof *s->work);
    s->idx = malloc((size_t)vocab_size * sizeof *s->idx);
    s->prob = malloc((size_t)vocab_size * sizeof *s->prob);
    s->bias = calloc((size_t)vocab_size, sizeof *s->bias);
    s->count = calloc((size_t)vocab_size, sizeof *s->count);
    s->ring_n = p->penalty_last_n > 0 ? p->penalty_last_n : 0;
    s->ring = s->ring_n ? malloc((size_t)s->ring_n * sizeof *s->ring) : NULL;
    if (!s->work || !s->idx || !s->prob || !s->bias || !s->count || (s->ring_n && !s->ring)) {
        df_sampler_free(s);
        return df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    df_sampler_reset(s);
    *out = s;
    return DF_OK;
}

void df_sampler_free(df_sampler *s) {
    if (!s) return;
    free(s->work);
    free(s->idx);
    free(s->prob);
    free(s->bias);
    free(s->count);
    free(s->ring);
    free(s);
}

df_status df_sampler_set_bias(df_sampler *s, int32_t id, float bias) {
    if (!s || id < 0 || id >= s->V || isnan(bias)) return DF_ERR_ARG;
    s->bias[id] = bias;
    s->has_bias = 1;
    return DF_OK;
}

void df_sampler_reset(df_sampler *s) {
    if (!s) return;
    memset(s->count, 0, (size_t)s->V * sizeof *s->count);
    if (s->ring) for (int i = 0; i < s->ring_n; i++) s->ring[i] = -1;
    s->ring_pos = 0;
    seed_rng(s);
}

void df_sampler_accept(df_sampler *s, int32_t id) {
    if (!s || id < 0 || id >= s->V || s->p.penalty_last_n == 0) return;
    if (s->ring_n) {
        int32_t old = s->ring[s->ring_pos];
        if (old >= 0) s->count[old]--;
        s->ring[s->ring_pos] = id;
        s->ring_pos = (s->ring_pos + 1) % s->ring_n;
    }
    s->count[id]++;
}

/* ---- 4. sample ----------------------------------------------------------------- */

/* log-softmax top-n of v (T = 1) into info, and the chosen token's logprob. */
static void fill_logprobs(df_sampler *s, const float *v, int32_t chosen, df_sample *info) {
    int V = s->V;
    float mx = -INFINITY;
    for (int i = 0; i < V; i++) if (v[i] > mx) mx = v[i];
    double sum = 0;
    if (mx > -INFINITY) for (int i = 0; i < V; i++) sum += exp_neg(v[i] - mx);
    double lse = mx > -INFINITY ? mx + log(sum) : 0;
    info->logprob = (float)((double)v[chosen] - lse);
    int n = s->p.n_logprobs;
    info->n_top = 0;
    for (int i = 0; i < V && n; i++) {
        /* insertion into a short sorted list */
        int k = info->n_top;
        if (k == n && !better(v, i, info->top_id[k - 1])) continue;
        if (k < n) info->n_top++;
        else k--;
        while (k > 0 && better(v, i, info->top_id[k - 1])) { info->top_id[k] = info->top_id[k - 1]; k--; }
        info->top_id[k] = i;
    }
    for (int k = 0; k < info->n_top; k++) info->top_logprob[k] = (float)((double)v[info->top_id[k]] - lse);
}

int32_t df_sampler_sample(df_sampler *s, const float *logits, df_sample *info) {
    int V = s->V;
    float *w = s->work;
    const df_sampler_params *p = &s->p;
    for (int i = 0; i < V; i++) w[i] = isnan(logits[i]) ? -INFINITY : logits[i];
    if (s->has_bias) for (int i = 0; i < V; i++) w[i] += s->bias[i];
    if (p->penalty_last_n != 0 && (p->repetition_penalty != 1.0f || p->presence_penalty != 0 || p->frequency_penalty != 0)) {
        for (int i = 0; i < V; i++) {
            int c = s->count[i];
            if (!c) continue;
            if (p->repetition_penalty != 1.0f) w[i] = w[i] > 0 ? w[i] / p->repetition_penalty : w[i] * p->repetition_penalty;
            w[i] -= p->presence_penalty + (float)c * p->frequency_penalty;
        }
    }
    /* greedy, and the best id as the fallback when nothing can be drawn */
    int32_t best = 0;
    for (int i = 1; i < V; i++) if (w[i] > w[best]) best = i;
    int32_t chosen = best;
    if (p->temperature > 0 && w[best] > -INFINITY) {
        float inv_t = 1.0f / p->temperature, mx = w[best] * inv_t;
        float *q = s->prob;
        for (int i = 0; i < V; i++) q[i] = exp_neg(w[i] * inv_t - mx); /* q[best] = 1 */
        int n = V, m;
        for (int i = 0; i < V; i++) s->idx[i] = i;
        if (p->top_k > 0 && p->top_k < V) {
            select_top(q, s->idx, V, p->top_k);
            n = p->top_k;
        }
        if (p->top_p < 1.0f) {
            /* the smallest best-first prefix holding top_p of the (top-k) mass:
             * sort a prefix of k candidates, k growing 4x until it suffices */
            double total = 0;
            for (int i = 0; i < n; i++) total += q[s->idx[i]];
            int k = n < 64 ? n : 64;
            for (;;) {
                if (k < n) select_top(q, s->idx, n, k);
                sort_top(q, s->idx, k);
                double acc = 0;
                int cut = -1;
                for (int i = 0; i < k; i++) {
                    acc += q[s->idx[i]];
                    if (acc >= p->top_p * total) { cut = i + 1; break; }
                }
                if (cut > 0 || k == n) { m = cut > 0 ? cut : k; break; }
                k = k * 4 < n ? k * 4 : n;
            }
        } else {
            if (p->min_p > 0) { /* keep only what min-p keeps, then sort those few */
                int k = 0;
                for (int i = 0; i < n; i++)
                    if (q[s->idx[i]] >= p->min_p) s->idx[k++] = s->idx[i];
                n = k;
            }
            /* sorting is only for determinism of the walk when truncated;
             * the full vocabulary is walked in id order */
            if (n < V) sort_top(q, s->idx, n);
            m = n;
        }
        /* min-p: q >= min_p * q_max, and q_max = 1 */
        if (p->min_p > 0) {
            int keep = 1;
            while (keep < m && q[s->idx[keep]] >= p->min_p) keep++;
            m = keep;
        }
        double mass = 0;
        for (int i = 0; i < m; i++) mass += q[s->idx[i]];
        double u = uniform(s) * mass, acc = 0;
        for (int i = 0; i < m; i++) {
            int32_t id = s->idx[i];
            if (q[id] == 0) continue;
            acc += q[id];
            chosen = id;
            if (u < acc) break;
        }
    }
    if (info) {
        memset(info, 0, sizeof *info);
        info->token = chosen;
        fill_logprobs(s, w, chosen, info);
    }
    return chosen;
}
