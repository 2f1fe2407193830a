/* test_attn_mla.c — the MLA attention kernels (kn_mla_*, attn_mla*.c) equal
 * the scalar reference BIT FOR BIT at every level this CPU runs: the value
 * sums and the absorb against memset + op_axpy in ascending order, the
 * attention against mla_core.h's mla_attend_one query by query, and mla_head
 * against the absorb loop + mla_attend_one it replaced. Shapes include the
 * awkward ones: R not a multiple of 16 (or 4), dr 0 / odd / 64, n 1..33,
 * pos > 0, small scratch (blocks of fewer queries); and the heads-in-lanes
 * decode path (kn_mla_attend_heads, mla_heads) with 1..40 heads, pos 0..300.
 * kn_mla_rowsum_bf16 / _i8 (B read as bf16, or int8 with row scales)
 * against the same reference over B's values, and mla_head / mla_heads over
 * bf16 and int8 kv_b as well as f32. */
#include "test.h"
#include "../src/kernels/kernels.h"
#include "../src/kernels/ops.h"
#include "../src/model/mla.h"
#include "../src/format/dtype.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state;
static float frand(void) { /* values of mixed magnitude and sign, so roundings differ */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t u = (uint32_t)(rng_state >> 32);
    float v = (float)(u & 0xffffff) / (float)0x1000000 - 0.5f;
    return (u >> 24) % 5 == 0 ? v * 37.0f : v;
}
static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static float *rand_vec(size_t n) {
    float *p = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

/* ---- rowsum: absorb (inc 0) and value sums (inc 1) ---- */

static void rowsum_ref(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R,
                       float *Y, int64_t ldy) {
    for (int j = 0; j < m; j++) {
        memset(Y + j * ldy, 0, (size_t)R * sizeof(float));
        for (int k = 0; k < k0 + j * inc; k++) op_axpy(Y + j * ldy, A[j * lda + k], B + k * ldb, R);
    }
}

TEST(mla_kernels_rowsum_bit_identical) {
    static const int Rs[] = {512, 37, 16, 3, 100, 64, 129};
    rng_state = 11;
    int bad = 0, runs = 0;
    for (int lv = KN_SCALAR; lv <= KN_NEON; lv++) {
        if (!kn_level_available((kn_level)lv)) continue;
        for (size_t ri = 0; ri < sizeof Rs / sizeof Rs[0]; ri++)
            for (int m = 1; m <= 33; m += (m < 6 ? 1 : 5))
                for (int inc = 0; inc <= 1; inc++) {
                    int R = Rs[ri], k0 = inc ? 1 + (m * 7 + R) % 300 : 1 + (m + R) % 140;
                    int kmax = k0 + (m - 1) * inc;
                    int64_t lda = kmax + 3, ldb = R + 5, ldy = R + 2;
                    float *A = rand_vec((size_t)m * lda), *B = rand_vec((size_t)kmax * ldb);
                    float *Y = rand_vec((size_t)m * ldy), *Yr = malloc((size_t)m * ldy * sizeof(float));
                    memcpy(Yr, Y, (size_t)m * ldy * sizeof(float)); /* the gaps between rows must stay */
                    rowsum_ref(A, lda, B, ldb, m, k0, inc, R, Yr, ldy);
                    kn_mla_rowsum((kn_level)lv, A, lda, B, ldb, m, k0, inc, R, Y, ldy);
                    if (memcmp(Y, Yr, (size_t)m * ldy * sizeof(float)) && bad++ < 3)
                        CHECK(0, "%s R=%d m=%d k0=%d inc=%d differs", kn_level_name((kn_level)lv), R, m, k0, inc);
                    /* B as bf16 read in place: the bits of B's widened values */
                    uint16_t *B16 = malloc((size_t)kmax * ldb * sizeof *B16);
                    for (size_t i = 0; i < (size_t)kmax * ldb; i++) {
                        B16[i] = (uint16_t)(f32_bits(B[i]) >> 16);
                        B[i] = bf16_to_f32(B16[i]);
                    }
                    rowsum_ref(A, lda, B, ldb, m, k0, inc, R, Yr, ldy);
                    kn_mla_rowsum_bf16((kn_level)lv, A, lda, B16, ldb, m, k0, inc, R, Y, ldy);
                    if (memcmp(Y, Yr, (size_t)m * ldy * sizeof(float)) && bad++ < 3)
                        CHECK(0, "%s bf16 R=%d m=%d k0=%d inc=%d differs", kn_level_name((kn_level)lv), R, m, k0,
                              inc);
                    /* B as int8 rows with a scale each: the bits of (float)q * s */
                    int8_t *B8 = malloc((size_t)kmax * ldb);
                    float *bs = malloc((size_t)kmax * sizeof *bs);
                    for (int k = 0; k < kmax; k++) {
                        bs[k] = 0.001f + 0.01f * frand() * frand();
                        for (int64_t c = 0; c < ldb; c++) {
                            B8[k * ldb + c] = (int8_t)(f32_bits(frand()) % 255 - 127);
                            B[k * ldb + c] = (float)B8[k * ldb + c] * bs[k];
                        }
                    }
                    rowsum_ref(A, lda, B, ldb, m, k0, inc, R, Yr, ldy);
                    kn_mla_rowsum_i8((kn_level)lv, A, lda, B8, ldb, bs, m, k0, inc, R, Y, ldy);
                    if (memcmp(Y, Yr, (size_t)m * ldy * sizeof(float)) && bad++ < 3)
                        CHECK(0, "%s int8 R=%d m=%d k0=%d inc=%d differs", kn_level_name((kn_level)lv), R, m, k0,
                              inc);
                    runs += 3;
                    free(A); free(B); free(B16); free(B8); free(bs); free(Y); free(Yr);
                }
    }
    CHECK(runs > 0 && bad == 0, "%d of %d differ", bad, runs);
}

/* ---- attention against mla_attend_one ---- */

static int attend_case(kn_level lv, int R, int dr, int pos, int n, int qb) {
    mla_shape sh = {0};
    sh.R = R;
    sh.dr = dr;
    sh.softmax_scale = 0.0625f + 0.001f * (float)(R % 7);
    int64_t stride = (int64_t)R + dr, ldqp = dr + 3;
    float *cache = rand_vec((size_t)(pos + n) * stride), *ql = rand_vec((size_t)n * R),
          *qp = rand_vec((size_t)n * ldqp + 1);
    float *O = malloc((size_t)n * R * sizeof(float)), *Or = malloc((size_t)n * R * sizeof(float));
    float *sc = malloc((size_t)(pos + n) * sizeof(float));
    for (int t = 0; t < n; t++)
        mla_attend_one(&sh, cache, ql + (size_t)t * R, qp + (size_t)t * ldqp, pos + t, sc, Or + (size_t)t * R);
    int64_t ns = kn_mla_attend_floats(R, dr, qb, pos + n);
    float *scratch = malloc((size_t)ns * sizeof(float));
    kn_mla_attend(lv, cache, R, dr, sh.softmax_scale, ql, qp, ldqp, pos, n, O, scratch, ns);
    int same = !memcmp(O, Or, (size_t)n * R * sizeof(float));
    free(cache); free(ql); free(qp); free(O); free(Or); free(sc); free(scratch);
    return same;
}

TEST(mla_kernels_attend_bit_identical) {
    static const int shapes[][2] = {{512, 64}, {37, 7}, {16, 0}, {3, 2}, {100, 64}, {48, 5}, {21, 1}};
    static const int poss[] = {0, 5, 130};
    rng_state = 12;
    int bad = 0, runs = 0;
    for (int lv = KN_SCALAR; lv <= KN_NEON; lv++) {
        if (!kn_level_available((kn_level)lv)) continue;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            for (size_t pi = 0; pi < sizeof poss / sizeof poss[0]; pi++)
                for (int n = 1; n <= 33; n += (n < 5 ? 1 : 4)) {
                    int R = shapes[si][0], dr = shapes[si][1], pos = poss[pi];
                    if (R == 512 && n > 1 && n != 17 && n != 33) continue; /* keep the suite fast */
                    int qb = (n + (int)si) % 3 == 0 ? 1 + n % 5 : 16; /* small scratch: short blocks too */
                    if (!attend_case((kn_level)lv, R, dr, pos, n, qb) && bad++ < 3)
                        CHECK(0, "%s R=%d dr=%d pos=%d n=%d qb=%d differs", kn_level_name((kn_level)lv), R, dr, pos,
                              n, qb);
                    runs++;
                }
    }
    CHECK(runs > 0 && bad == 0, "%d of %d differ", bad, runs);
}

/* ---- mla_head against the loops it replaced ---- */

static void head_ref(const mla_shape *sh, const df_weight *kv_b, const float *cache, const float *q, int pos, int n,
                     int h, float *ql, float *ol) {
    float *row = malloc((size_t)sh->R * sizeof(float)), *sc = malloc((size_t)(pos + n) * sizeof(float));
    memset(ql, 0, (size_t)n * sh->R * sizeof(float));
    for (int d = 0; d < sh->dn; d++) {
        kn_dequant_row(kv_b, h * (sh->dn + sh->dv) + d, row);
        for (int t = 0; t < n; t++) op_axpy(ql + (size_t)t * sh->R, q[((size_t)t * sh->nh + h) * sh->dq + d], row, sh->R);
    }
    for (int t = 0; t < n; t++)
        mla_attend_one(sh, cache, ql + (size_t)t * sh->R, q + ((size_t)t * sh->nh + h) * sh->dq + sh->dn, pos + t,
                       sc, ol + (size_t)t * sh->R);
    free(row);
    free(sc);
}

/* A head-test shape from {nh, dn, dr, R}: dv 24, dq = dn + dr, scale 0.09. */
static mla_shape head_shape(const int s[4]) {
    mla_shape sh = {0};
    sh.nh = s[0];
    sh.dn = s[1];
    sh.dr = s[2];
    sh.R = s[3];
    sh.dv = 24;
    sh.dq = sh.dn + sh.dr;
    sh.softmax_scale = 0.09f;
    return sh;
}

TEST(mla_kernels_head_bit_identical) {
    static const int shapes[][4] = {{3, 128, 64, 512}, {2, 16, 8, 37}, {4, 12, 0, 40}}; /* nh, dn, dr, R */
    rng_state = 13;
    int bad = 0, runs = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        mla_shape sh = head_shape(shapes[si]);
        int pos = si == 1 ? 0 : 70, n = si == 0 ? 17 : 33;
        const size_t nw = (size_t)sh.nh * (sh.dn + sh.dv) * sh.R;
        float *wdata = rand_vec(nw);
        uint16_t *w16 = malloc(nw * sizeof *w16); /* a bf16 kv_b: absorb reads it in place */
        for (size_t i = 0; i < nw; i++) w16[i] = (uint16_t)(f32_bits(wdata[i]) >> 16);
        df_weight kv_b = {0};
        kv_b.type = si == 1 ? WT_BF16 : WT_F32;
        kv_b.rows = (int64_t)sh.nh * (sh.dn + sh.dv);
        kv_b.cols = sh.R;
        kv_b.data = si == 1 ? (void *)w16 : (void *)wdata;
        int64_t stride = (int64_t)sh.R + sh.dr;
        float *cache = rand_vec((size_t)(pos + n) * stride), *q = rand_vec((size_t)n * sh.nh * sh.dq);
        size_t lat = (size_t)sh.nh * n * sh.R;
        float *ql = malloc(lat * sizeof(float)), *ol = malloc(lat * sizeof(float));
        float *qlr = malloc((size_t)n * sh.R * sizeof(float)), *olr = malloc((size_t)n * sh.R * sizeof(float));
        float *attn = malloc((size_t)n * sh.nh * sh.dv * sizeof(float));
        float *scratch = malloc((size_t)mla_head_scratch_floats(&sh, pos + n) * sizeof(float));
        for (int lv = KN_SCALAR; lv <= KN_NEON; lv++) {
            if (!kn_level_available((kn_level)lv)) continue;
            for (int h = 0; h < sh.nh; h++) {
                mla_head(&sh, (kn_level)lv, &kv_b, cache, q, pos, n, h, ql, ol, attn, scratch);
                head_ref(&sh, &kv_b, cache, q, pos, n, h, qlr, olr);
                size_t off = (size_t)h * n * sh.R, bytes = (size_t)n * sh.R * sizeof(float);
                if ((memcmp(ql + off, qlr, bytes) || memcmp(ol + off, olr, bytes)) && bad++ < 3)
                    CHECK(0, "%s shape %zu head %d differs", kn_level_name((kn_level)lv), si, h);
                runs++;
            }
        }
        free(wdata); free(w16); free(cache); free(q); free(ql); free(ol); free(qlr); free(olr); free(attn);
        free(scratch);
    }
    CHECK(runs > 0 && bad == 0, "%d of %d differ", bad, runs);
}

/* ---- heads in the lanes (decode) against mla_attend_one per head ---- */

static int heads_case(kn_level lv, int R, int dr, int p, int m, int qb) {
    mla_shape sh = {0};
    sh.R = R;
    sh.dr = dr;
    sh.softmax_scale = 0.0625f + 0.001f * (float)(R % 7);
    int64_t stride = (int64_t)R + dr, ldql = R + 2, ldqp = dr + 5, ldo = R + 1;
    float *cache = rand_vec((size_t)(p + 1) * stride), *ql = rand_vec((size_t)m * ldql),
          *qp = rand_vec((size_t)m * ldqp + 1);
    float *O = rand_vec((size_t)m * ldo), *Or = malloc((size_t)m * ldo * sizeof(float));
    float *sc = malloc((size_t)(p + 1) * sizeof(float));
    memcpy(Or, O, (size_t)m * ldo * sizeof(float)); /* the gaps between rows must stay */
    for (int j = 0; j < m; j++)
        mla_attend_one(&sh, cache, ql + (size_t)j * ldql, qp + (size_t)j * ldqp, p, sc, Or + (size_t)j * ldo);
    int64_t ns = kn_mla_attend_floats(R, dr, qb, p + 1);
    float *scratch = malloc((size_t)ns * sizeof(float));
    kn_mla_attend_heads(lv, cache, R, dr, sh.softmax_scale, ql, ldql, qp, ldqp, p, m, O, ldo, scratch, ns);
    int same = !memcmp(O, Or, (size_t)m * ldo * sizeof(float));
    free(cache); free(ql); free(qp); free(O); free(Or); free(sc); free(scratch);
    return same;
}

TEST(mla_kernels_attend_heads_bit_identical) {
    static const int shapes[][2] = {{512, 64}, {37, 7}, {16, 0}, {3, 2}, {100, 64}, {48, 5}, {21, 1}};
    static const int poss[] = {0, 1, 6, 131, 300};
    rng_state = 14;
    int bad = 0, runs = 0;
    for (int lv = KN_SCALAR; lv <= KN_NEON; lv++) {
        if (!kn_level_available((kn_level)lv)) continue;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            for (size_t pi = 0; pi < sizeof poss / sizeof poss[0]; pi++)
                for (int m = 1; m <= 40; m += (m < 9 ? 1 : 6)) {
                    int R = shapes[si][0], dr = shapes[si][1], p = poss[pi];
                    if (R == 512 && m != 1 && m != 16 && m != 21 && m != 39) continue; /* keep the suite fast */
                    int qb = (m + (int)si + (int)pi) % 3 == 0 ? 1 + m % 7 : 16; /* small scratch: short blocks */
                    if (!heads_case((kn_level)lv, R, dr, p, m, qb) && bad++ < 3)
                        CHECK(0, "%s R=%d dr=%d p=%d m=%d qb=%d differs", kn_level_name((kn_level)lv), R, dr, p, m,
                              qb);
                    runs++;
                }
    }
    CHECK(runs > 0 && bad == 0, "%d of %d differ", bad, runs);
}

/* mla_heads (any split of the heads, n below and above the heads-in-lanes
 * threshold) against mla_head head by head, and the absorb + mla_attend_one
 * reference: q_lat, o_lat and the lifted attn all bit for bit. */
TEST(mla_kernels_heads_bit_identical) {
    static const int shapes[][4] = {{19, 128, 64, 512}, {2, 16, 8, 37}, {33, 12, 0, 40}, {9, 8, 3, 21}};
    rng_state = 15;
    int bad = 0, runs = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        mla_shape sh = head_shape(shapes[si]);
        int pos = (int)si * 97 % 301, nmax = MLA_HEADS_IN_LANES_BELOW + 1;
        const size_t nw = (size_t)sh.nh * (sh.dn + sh.dv) * sh.R;
        float *wdata = rand_vec(nw);
        uint16_t *w16 = malloc(nw * sizeof *w16); /* shapes 0 and 2: a bf16 kv_b, read in place */
        for (size_t i = 0; i < nw; i++) w16[i] = (uint16_t)(f32_bits(wdata[i]) >> 16);
        int8_t *w8 = malloc(nw); /* shape 3: an int8 kv_b with row scales (the int8 spine's) */
        float *ws8 = malloc((size_t)sh.nh * (sh.dn + sh.dv) * sizeof *ws8);
        for (size_t i = 0; i < nw; i++) w8[i] = (int8_t)(f32_bits(wdata[i]) % 255 - 127);
        for (int64_t r = 0; r < (int64_t)sh.nh * (sh.dn + sh.dv); r++) ws8[r] = 0.002f + 0.0001f * (float)(r % 13);
        df_weight kv_b = {0};
        kv_b.type = si % 2 == 0 ? WT_BF16 : si == 3 ? WT_I8_ROW : WT_F32;
        kv_b.rows = (int64_t)sh.nh * (sh.dn + sh.dv);
        kv_b.cols = sh.R;
        kv_b.data = si % 2 == 0 ? (void *)w16 : si == 3 ? (void *)w8 : (void *)wdata;
        kv_b.scale = ws8;
        int64_t stride = (int64_t)sh.R + sh.dr;
        float *cache = rand_vec((size_t)(pos + nmax) * stride), *q = rand_vec((size_t)nmax * sh.nh * sh.dq);
        size_t lat = (size_t)sh.nh * nmax * sh.R, na = (size_t)nmax * sh.nh * sh.dv;
        float *ql = malloc(lat * sizeof(float)), *ol = malloc(lat * sizeof(float)), *attn = malloc(na * sizeof(float));
        float *ql1 = malloc(lat * sizeof(float)), *ol1 = malloc(lat * sizeof(float)), *attn1 = malloc(na * sizeof(float));
        float *qlr = malloc(lat * sizeof(float)), *olr = malloc(lat * sizeof(float));
        float *scratch = malloc((size_t)mla_head_scratch_floats(&sh, pos + nmax) * sizeof(float));
        for (int n = 1; n <= nmax; n++) {
            size_t per = (size_t)n * sh.R, bytes = (size_t)sh.nh * per * sizeof(float);
            for (int h = 0; h < sh.nh; h++) head_ref(&sh, &kv_b, cache, q, pos, n, h, qlr + h * per, olr + h * per);
            for (int lv = KN_SCALAR; lv <= KN_NEON; lv++) {
                if (!kn_level_available((kn_level)lv)) continue;
                for (int h = 0; h < sh.nh; h++) mla_head(&sh, (kn_level)lv, &kv_b, cache, q, pos, n, h, ql1, ol1, attn1, scratch);
                for (int split = 1; split <= 3; split++) { /* whole, halves, uneven thirds */
                    memset(attn, 0xff, na * sizeof(float));
                    for (int s = 0, h0 = 0; s < split; s++) {
                        int h1 = s == split - 1 ? sh.nh : h0 + (sh.nh * (s + 1) + s) / (split + 1);
                        if (h1 > sh.nh) h1 = sh.nh;
                        mla_heads(&sh, (kn_level)lv, &kv_b, cache, q, pos, n, h0, h1, ql, ol, attn, scratch);
                        h0 = h1;
                    }
                    if ((memcmp(ql, qlr, bytes) || memcmp(ol, olr, bytes) || memcmp(ol1, olr, bytes) ||
                         memcmp(attn, attn1, (size_t)n * sh.nh * sh.dv * sizeof(float))) &&
                        bad++ < 3)
                        CHECK(0, "%s shape %zu n=%d split %d differs", kn_level_name((kn_level)lv), si, n, split);
                    runs++;
                }
            }
        }
        free(wdata); free(w16); free(w8); free(ws8); free(cache); free(q); free(ql); free(ol); free(attn); free(ql1);
        free(ol1); free(attn1);
        free(qlr); free(olr); free(scratch);
    }
    CHECK(runs > 0 && bad == 0, "%d of %d differ", bad, runs);
}
