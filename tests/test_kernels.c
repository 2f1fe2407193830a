/* test_kernels.c — kn_ kernels against their oracles.
 *
 * For every weight type and every level this CPU has (scalar, AVX2, AVX-512
 * on x86; scalar, NEON on AArch64, run here under qemu by `make test-arm64`):
 *  - kn_matvec against a float64 dot of kn_dequant_row with x, on awkward
 *    shapes (tails, partial fp8 blocks, rows not a multiple of the tile);
 *  - each SIMD level against the scalar level;
 *  - decode exactness: with x = a one-hot vector the result must equal the
 *    dequantised weight exactly, at every level, for every column;
 *  - kn_matmul row i bit-equal to kn_matvec on vector i (any row range, ldy,
 *    and in blocks of vectors over wide rows);
 *  - row-range independence: any split of [0, rows) gives bit-equal outputs.
 * Plus known encodings through kn_dequant_row and NaN propagation for fp8.
 *
 * Error bound for a dot product of n fp32 terms summed in any order (each
 * product rounded once, plus one rounding for a folded scale):
 *   |y - exact| <= (n + 2) * 2^-24 * sum_c |w_c x_c|   (gamma_{n+2} bound),
 * which for the sizes here is between 1e-7 and 6e-5 of sum|w x|; one wrong
 * weight would be off by a whole |w_c x_c|, far above it.
 */
#include "test.h"
#include "../src/kernels/kernels.h"
#include "../src/kernels/ops.h"
#include "../src/base/pool.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- random matrices --------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}
static float frand(uint64_t *s) { /* uniform [-1, 1) */
    return (float)((double)(rng_next(s) >> 11) * 0x1p-52 - 1.0);
}
static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* f32 -> f16 bits for normal-range values (truncating; exactness is irrelevant here) */
static uint16_t f16_bits(float f) {
    uint32_t u = f32_bits(f);
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    if (e <= 0) return sign;
    if (e >= 31) e = 30;
    return (uint16_t)(sign | (e << 10) | ((u >> 13) & 0x3ff));
}

typedef struct {
    df_weight w;
    void *data, *scale;
} tmat;

static void tmat_free(tmat *m) { free(m->data); free(m->scale); }

static void tmat_make(tmat *m, wt_type t, int64_t rows, int64_t cols, st_dtype sdt, int br,
                      int bc, uint64_t seed) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 12345;
    memset(m, 0, sizeof *m);
    m->w.type = t;
    m->w.rows = rows;
    m->w.cols = cols;
    m->w.scale_dtype = sdt;
    m->w.block_rows = br;
    m->w.block_cols = bc;
    int64_t n = rows * cols, nsc = 0;
    size_t dbytes = 0, sbytes = 0;
    switch (t) {
    case WT_F32: dbytes = (size_t)n * 4; break;
    case WT_BF16: case WT_F16: dbytes = (size_t)n * 2; break;
    case WT_FP8_BLOCK:
        dbytes = (size_t)n;
        nsc = ((rows + br - 1) / br) * ((cols + bc - 1) / bc);
        sbytes = (size_t)nsc * 4;
        break;
    case WT_INT4_G32:
        dbytes = (size_t)n / 2;
        nsc = n / 32;
        sbytes = (size_t)nsc * (sdt == DT_F32 ? 4 : 2);
        break;
    case WT_MXFP4: dbytes = (size_t)n / 2; nsc = n / 32; sbytes = (size_t)nsc; break;
    case WT_I8_ROW: dbytes = (size_t)n; nsc = rows; sbytes = (size_t)rows * 4; break;
    default: break;
    }
    m->data = malloc(dbytes ? dbytes : 1);
    m->scale = sbytes ? malloc(sbytes) : NULL;
    uint8_t *b = m->data;
    for (size_t i = 0; i < dbytes; i++) b[i] = (uint8_t)rng_next(&s);
    switch (t) {
    case WT_F32:
        for (int64_t i = 0; i < n; i++) ((float *)m->data)[i] = 2.0f * frand(&s);
        break;
    case WT_BF16:
        for (int64_t i = 0; i < n; i++) ((uint16_t *)m->data)[i] = (uint16_t)(f32_bits(frand(&s)) >> 16);
        break;
    case WT_F16: /* any finite f16, subnormals included */
        for (int64_t i = 0; i < n; i++) {
            uint16_t *h = (uint16_t *)m->data + i;
            if (((*h >> 10) & 31) == 31) *h &= (uint16_t)~0x4000;
        }
        break;
    case WT_FP8_BLOCK: /* any e4m3 but the NaN codes */
        for (int64_t i = 0; i < n; i++)
            if ((b[i] & 0x7f) == 0x7f) b[i] ^= 1;
        for (int64_t i = 0; i < nsc; i++) ((float *)m->scale)[i] = 0.01f * frand(&s);
        break;
    case WT_INT4_G32:
        for (int64_t i = 0; i < nsc; i++) {
            float f = 0.1f * frand(&s);
            if (sdt == DT_F32) ((float *)m->scale)[i] = f;
            else if (sdt == DT_BF16) ((uint16_t *)m->scale)[i] = (uint16_t)(f32_bits(f) >> 16);
            else ((uint16_t *)m->scale)[i] = f16_bits(f);
        }
        break;
    case WT_MXFP4:
        for (int64_t i = 0; i < nsc; i++) ((uint8_t *)m->scale)[i] = (uint8_t)(115 + rng_next(&s) % 20);
        break;
    case WT_I8_ROW:
        for (int64_t i = 0; i < nsc; i++) ((float *)m->scale)[i] = 0.05f * frand(&s);
        break;
    default: break;
    }
    m->w.data = m->data;
    m->w.scale = m->scale;
}

static float *rand_vec(int64_t n, uint64_t seed) {
    uint64_t s = seed * 0x2545f4914f6cdd1dull + 99;
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = frand(&s);
    return v;
}

/* n vectors of cols into X: vector i is rand_vec(cols, seed0 + i * step). */
static void rand_vecs(float *X, int n, int64_t cols, uint64_t seed0, uint64_t step) {
    for (int i = 0; i < n; i++) {
        float *xi = rand_vec(cols, seed0 + (uint64_t)i * step);
        memcpy(X + (size_t)i * cols, xi, (size_t)cols * sizeof *xi);
        free(xi);
    }
}

/* ---- one matrix, every check, every level ------------------------------------ */

static int same_bits(float a, float b) { return f32_bits(a) == f32_bits(b); }

/* What vector i of an n-vector kn_matmul at level lv must equal bit for
 * bit (rows r0 .. r1 - 1 into y): kn_matvec's output, except at KN_AMX,
 * where a bf16 or MXFP4 product of KN_AMX_MIN_N or more vectors runs on the
 * tile unit (kernels.h): there, the same vector in another such product (a
 * window of KN_AMX_MIN_N vectors around it). */
static void one_vector_ref(kn_level lv, const df_weight *w, const float *X, int n, int i, float *y, int64_t r0,
                           int64_t r1) {
    if (lv != KN_AMX || n < KN_AMX_MIN_N) {
        kn_matvec(lv, w, X + (int64_t)i * w->cols, y, r0, r1);
        return;
    }
    const int64_t nr = r1 - r0;
    float *Z = malloc((size_t)KN_AMX_MIN_N * (size_t)nr * sizeof *Z);
    if (!Z) {
        for (int64_t r = 0; r < nr; r++) y[r] = NAN; /* shows as a difference */
        return;
    }
    const int i0 = i < n - KN_AMX_MIN_N ? i : n - KN_AMX_MIN_N;
    kn_matmul(lv, w, X + (int64_t)i0 * w->cols, KN_AMX_MIN_N, Z, nr, r0, r1);
    memcpy(y, Z + (size_t)(i - i0) * (size_t)nr, (size_t)nr * sizeof *y);
    free(Z);
}

static void check_matrix(const tmat *m, uint64_t seed) {
    const df_weight *w = &m->w;
    const int64_t rows = w->rows, cols = w->cols;
    float *x = rand_vec(cols, seed);
    float *deq = malloc((size_t)cols * sizeof *deq);
    double *ref = malloc((size_t)rows * sizeof *ref), *mag = malloc((size_t)rows * sizeof *mag);
    for (int64_t r = 0; r < rows; r++) {
        kn_dequant_row(w, r, deq);
        double acc = 0, am = 0;
        for (int64_t c = 0; c < cols; c++) {
            acc += (double)deq[c] * x[c];
            am += fabs((double)deq[c] * x[c]);
        }
        ref[r] = acc;
        mag[r] = am;
    }
    const double rel = (double)(cols + 2) * 0x1p-24;
    float *ys = malloc((size_t)rows * sizeof *ys), *y = malloc((size_t)rows * sizeof *y);
    float *yp = malloc((size_t)rows * sizeof *yp);
    kn_matvec(KN_SCALAR, w, x, ys, 0, rows);
    const char *tn = wt_type_name(w->type);
    for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
        if (!kn_level_available((kn_level)lv)) continue;
        const char *ln = kn_level_name((kn_level)lv);
        kn_matvec((kn_level)lv, w, x, y, 0, rows);
#if defined(__aarch64__)
        /* the NEON level has a kernel of its own for every type (no silent
         * fallback to scalar), bit-equal to what the dispatch returned */
        if (lv == KN_NEON) {
            CHECK(kn_matmul_neon(w, x, 1, yp, rows, 0, rows) == 1, "%s: no NEON kernel", wt_type_name(w->type));
            CHECK(memcmp(yp, y, (size_t)rows * sizeof *y) == 0, "%s: NEON differs from its dispatch", wt_type_name(w->type));
        }
#endif
        int bad = 0;
        for (int64_t r = 0; r < rows && bad < 3; r++) {
            double tol = rel * mag[r] + 1e-35;
            if (!(fabs(y[r] - ref[r]) <= tol)) {
                bad++;
                CHECK(0, "%s %s %lldx%lld row %lld: %.9g vs ref %.9g (tol %.3g)", tn, ln,
                      (long long)rows, (long long)cols, (long long)r, y[r], ref[r], tol);
            }
            if (!(fabs(y[r] - ys[r]) <= 2 * tol)) {
                bad++;
                CHECK(0, "%s %s vs scalar %lldx%lld row %lld: %.9g vs %.9g", tn, ln,
                      (long long)rows, (long long)cols, (long long)r, y[r], ys[r]);
            }
        }
        /* row-range independence: a few random splits of [0, rows) */
        uint64_t s = seed + 7;
        for (int trial = 0; trial < 3; trial++) {
            for (int64_t a = 0; a < rows;) {
                int64_t len = 1 + (int64_t)(rng_next(&s) % 9), b = a + len > rows ? rows : a + len;
                kn_matvec((kn_level)lv, w, x, yp + a, a, b);
                a = b;
            }
            int diff = 0;
            for (int64_t r = 0; r < rows; r++) diff += !same_bits(yp[r], y[r]);
            CHECK(diff == 0, "%s %s %lldx%lld: %d rows differ when computed in pieces", tn, ln,
                  (long long)rows, (long long)cols, diff);
        }
        /* matmul: n vectors, a sub-range, padded ldy; row i bit-equal to matvec */
        {
            const int n = 7; /* several prefill tile groups plus leftover vectors */
            int64_t r0 = rows > 2 ? 1 : 0, r1 = rows, ldy = (r1 - r0) + 5;
            float *X = malloc((size_t)n * cols * sizeof *X);
            float *Y = malloc((size_t)n * ldy * sizeof *Y), *yv = malloc((size_t)rows * sizeof *yv);
            rand_vecs(X, n, cols, seed * 31, 1);
            kn_matmul((kn_level)lv, w, X, n, Y, ldy, r0, r1);
            int diff = 0;
            for (int i = 0; i < n; i++) {
                kn_matvec((kn_level)lv, w, X + i * cols, yv, r0, r1);
                for (int64_t r = 0; r < r1 - r0; r++) diff += !same_bits(Y[i * ldy + r], yv[r]);
            }
            CHECK(diff == 0, "%s %s %lldx%lld: matmul differs from matvec in %d outputs", tn, ln,
                  (long long)rows, (long long)cols, diff);
            free(X), free(Y), free(yv);
        }
        /* decode exactness: one-hot x gives the dequantised weight itself */
        if (cols <= 240) {
            float *e = calloc((size_t)cols, sizeof *e), *col = malloc((size_t)rows * sizeof *col);
            int diff = 0;
            for (int64_t c = 0; c < cols; c++) {
                e[c] = 1.0f;
                kn_matvec((kn_level)lv, w, e, col, 0, rows);
                e[c] = 0.0f;
                for (int64_t r = 0; r < rows; r++) {
                    kn_dequant_row(w, r, deq);
                    if (!(col[r] == deq[c])) {
                        if (diff++ < 3)
                            CHECK(0, "%s %s %lldx%lld: W[%lld][%lld] decodes to %.9g, dequant %.9g",
                                  tn, ln, (long long)rows, (long long)cols, (long long)r,
                                  (long long)c, col[r], deq[c]);
                    }
                }
            }
            free(e), free(col);
        }
    }
    free(x), free(deq), free(ref), free(mag), free(ys), free(y), free(yp);
}

static const int64_t ROWS[] = {1, 2, 3, 4, 5, 7, 9, 67};
static const int64_t COLS_DENSE[] = {1, 7, 8, 15, 16, 17, 33, 70, 160, 200, 1000, 1056};
static const int64_t COLS_NIB[] = {32, 64, 96, 160, 224, 1024};
#define N(a) (int)(sizeof(a) / sizeof(a)[0])

static void suite(wt_type t, st_dtype sdt, int br, int bc) {
    int nib = t == WT_INT4_G32 || t == WT_MXFP4;
    const int64_t *cl = nib ? COLS_NIB : COLS_DENSE;
    int nc = nib ? N(COLS_NIB) : N(COLS_DENSE);
    uint64_t seed = 1;
    for (int i = 0; i < N(ROWS); i++)
        for (int k = 0; k < nc; k++) {
            tmat m;
            tmat_make(&m, t, ROWS[i], cl[k], sdt, br, bc, seed);
            check_matrix(&m, seed++);
            tmat_free(&m);
        }
}

int t_simd_level_available(int lv) {
    return lv >= KN_SCALAR && lv <= KN_AMX && kn_level_available((kn_level)lv);
}

/* ---- the tests --------------------------------------------------------------- */

TEST(kn_detect_level) {
    kn_level l = kn_detect();
    CHECK(l >= KN_SCALAR && l <= KN_AMX, "level %d", (int)l);
    CHECK(kn_level_available(l) && kn_level_available(KN_SCALAR));
    CHECK(strcmp(kn_level_name(KN_SCALAR), "scalar") == 0);
    CHECK(strcmp(kn_level_name(KN_AVX2), "avx2") == 0);
    CHECK(strcmp(kn_level_name(KN_AVX512), "avx512") == 0);
    CHECK(strcmp(kn_level_name(KN_NEON), "neon") == 0);
    CHECK(strcmp(kn_level_name(KN_AMX), "amx") == 0);
    /* what bench --kernels prints: the level that runs */
    CHECK(strcmp(df_simd_level_name(-1), kn_level_name(l)) == 0);
    CHECK(strcmp(df_simd_level_name(KN_SCALAR), "scalar") == 0);
    for (int lv = KN_AVX2; lv <= KN_AMX; lv++) {
        CHECK(strcmp(df_simd_level_name(lv), kn_level_name(kn_level_available((kn_level)lv) ? (kn_level)lv : l)) == 0,
              "level %d", lv);
        /* the description begins with the name */
        CHECK(strncmp(df_simd_level_desc(lv), df_simd_level_name(lv), strlen(df_simd_level_name(lv))) == 0,
              "%s", df_simd_level_desc(lv));
    }
    CHECK(strstr(df_simd_level_desc(KN_AVX2), "avx-vnni") ? kn_avxvnni_usable() && kn_level_available(KN_AVX2)
                                                         : !kn_avxvnni_usable() || !kn_level_available(KN_AVX2));
    /* the decode tiles' prefetch level is named where it is L1 (x86 levels only) */
    const int x86_level = l == KN_AVX2 || l == KN_AVX512;
    CHECK(!!strstr(df_simd_level_desc(-1), "into L1") == (x86_level && kn_pf_next_l1()), "%s", df_simd_level_desc(-1));
#if defined(__aarch64__)
    /* every AArch64 CPU has Advanced SIMD; the x86 levels never exist here */
    CHECK(l == KN_NEON, "level %s", kn_level_name(l));
    CHECK(!kn_level_available(KN_AVX2) && !kn_level_available(KN_AVX512) && !kn_level_available(KN_AMX));
#elif defined(__x86_64__)
    CHECK(!kn_level_available(KN_NEON));
#endif
}

TEST(kn_matvec_f32) { suite(WT_F32, DT_UNKNOWN, 0, 0); }
TEST(kn_matvec_bf16) { suite(WT_BF16, DT_UNKNOWN, 0, 0); }
TEST(kn_matvec_f16) { suite(WT_F16, DT_UNKNOWN, 0, 0); }
TEST(kn_matvec_i8_row) { suite(WT_I8_ROW, DT_UNKNOWN, 0, 0); }
/* Rows wide enough that the driver walks the prefill tiles by panels and
 * column blocks (many_part, where a level has it: x of the tile's vectors
 * past 24 KB), with a 16-column step and a masked tail: matmul stays
 * bit-equal to matvec (check_matrix: 7 vectors). Then 41 vectors over 139
 * rows (two panels of 16 tiles and rows past the last tile) and a sub-range
 * of rows, at every level, each output bit-equal to matvec's. */
TEST(kn_matmul_wide_dense_rows) {
    static const wt_type T[] = {WT_F32, WT_BF16, WT_F16, WT_I8_ROW};
    static const int64_t R[] = {9, 67}, C[] = {4160, 5017, 6160};
    uint64_t seed = 91;
    for (int t = 0; t < N(T); t++)
        for (int i = 0; i < N(R); i++)
            for (int k = 0; k < N(C); k++) {
                tmat m;
                tmat_make(&m, T[t], R[i], C[k], DT_UNKNOWN, 0, 0, seed);
                check_matrix(&m, seed++);
                tmat_free(&m);
            }
    const int n = 41;
    const int64_t rows = 139, cols = 4176, r0 = 3, r1 = 137, ldy = r1 - r0 + 2;
    float *X = malloc((size_t)n * cols * sizeof *X), *Y = malloc((size_t)n * ldy * sizeof *Y);
    float *y = malloc((size_t)rows * sizeof *y);
    REQUIRE(X && Y && y);
    rand_vecs(X, n, cols, 17, 1);
    for (int t = 0; t < N(T); t++) {
        tmat m;
        tmat_make(&m, T[t], rows, cols, DT_UNKNOWN, 0, 0, seed++);
        for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
            if (!kn_level_available((kn_level)lv)) continue;
            kn_matmul((kn_level)lv, &m.w, X, n, Y, ldy, r0, r1);
            int diff = 0;
            for (int i = 0; i < n; i++) {
                kn_matvec((kn_level)lv, &m.w, X + (int64_t)i * cols, y, r0, r1);
                for (int64_t r = 0; r < r1 - r0; r++) diff += !same_bits(Y[i * ldy + r], y[r]);
            }
            CHECK(diff == 0, "%s %s %lldx%lld, %d vectors: matmul differs from matvec in %d outputs",
                  wt_type_name(T[t]), kn_level_name((kn_level)lv), (long long)rows, (long long)cols, n, diff);
        }
        tmat_free(&m);
    }
    free(X), free(Y), free(y);
}

/* Enough vectors for a level's lanes (the dense kinds' prefill with the rows
 * in the SIMD lanes, KN_LANES_MIN_N): 72 and 67 vectors over rows 3..199 of
 * 203 (four 48-row tiles, two panels, rows past them), with columns that
 * end in a whole step, a 16-column step, a masked tail, both, or have no
 * whole step, and more than one column block: every output bit-equal to
 * matvec's at every level (at KN_AMX to the same vector in another tile-unit
 * product: one_vector_ref); the bf16 ones also through kn_matmul_px with x
 * prepared once (the engine's form), rows in pieces. */
TEST(kn_matmul_lanes_same_bits) {
    static const wt_type T[] = {WT_F32, WT_BF16, WT_F16, WT_I8_ROW};
    static const int64_t C[] = {1024, 1075, 1041, 1039, 2112 + 17, 40, 7};
    static const int NS[] = {72, 67};
    const int64_t rows = 203, r0 = 3, r1 = 199, ldy = r1 - r0 + 1;
    uint64_t seed = 301, rs = 5;
    for (int k = 0; k < N(C); k++)
        for (int t = 0; t < N(T); t++) {
            const int64_t cols = C[k];
            const int n = NS[(k + t) % N(NS)];
            float *X = malloc((size_t)n * cols * sizeof *X), *Y = malloc((size_t)n * ldy * sizeof *Y);
            float *Z = malloc((size_t)n * ldy * sizeof *Z), *y = malloc((size_t)rows * sizeof *y);
            REQUIRE(X && Y && Z && y);
            rand_vecs(X, n, cols, seed, 3);
            tmat m;
            tmat_make(&m, T[t], rows, cols, DT_UNKNOWN, 0, 0, seed++);
            for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
                if (!kn_level_available((kn_level)lv)) continue;
                const char *ln = kn_level_name((kn_level)lv), *tn = wt_type_name(T[t]);
                kn_matmul((kn_level)lv, &m.w, X, n, Y, ldy, r0, r1);
                int diff = 0;
                for (int i = 0; i < n; i++) {
                    one_vector_ref((kn_level)lv, &m.w, X, n, i, y, r0, r1);
                    for (int64_t r = 0; r < r1 - r0; r++) diff += !same_bits(Y[i * ldy + r], y[r]);
                }
                CHECK(diff == 0, "%s %s %lldx%lld, %d vectors: matmul differs from matvec in %d outputs", tn, ln,
                      (long long)rows, (long long)cols, n, diff);
                const int64_t pf = kn_px_floats((kn_level)lv, &m.w, n);
                if (pf <= 0) continue;
                float *Xp = aligned_alloc(64, (size_t)pf * sizeof *Xp);
                REQUIRE(Xp);
                kn_px_prep((kn_level)lv, &m.w, X, 0, n, Xp);
                for (int64_t a = r0; a < r1;) {
                    const int64_t len = 40 + (int64_t)(rng_next(&rs) % 90), b = a + len < r1 ? a + len : r1;
                    kn_matmul_px((kn_level)lv, &m.w, Xp, n, Z + (a - r0), ldy, a, b);
                    a = b;
                }
                diff = 0;
                for (int i = 0; i < n; i++)
                    for (int64_t r = 0; r < r1 - r0; r++) diff += !same_bits(Z[i * ldy + r], Y[i * ldy + r]);
                CHECK(diff == 0, "%s %s %lldx%lld, %d vectors: kn_matmul_px differs from kn_matmul in %d outputs", tn,
                      ln, (long long)rows, (long long)cols, n, diff);
                free(Xp);
            }
            tmat_free(&m);
            free(X), free(Y), free(Z), free(y);
        }
}

TEST(kn_matvec_fp8_block) {
    static const int blk[][2] = {{128, 128}, {3, 5}, {16, 16}, {1, 7}, {7, 48}, {2, 1000}};
    for (int i = 0; i < N(blk); i++) suite(WT_FP8_BLOCK, DT_UNKNOWN, blk[i][0], blk[i][1]);
}
TEST(kn_matvec_int4_bf16) { suite(WT_INT4_G32, DT_BF16, 0, 0); }
TEST(kn_matvec_int4_f16) { suite(WT_INT4_G32, DT_F16, 0, 0); }
TEST(kn_matvec_int4_f32) { suite(WT_INT4_G32, DT_F32, 0, 0); }
TEST(kn_matvec_mxfp4) { suite(WT_MXFP4, DT_UNKNOWN, 0, 0); }

/* MXFP4 scale bytes 0 (2^-127), 1, 254 and 255 (NaN) at every place of the
 * 8- and 16-group blocks the x86 tiles read their scales in, the tail block
 * included: every level within the fp32 bound of a float64 reference (the
 * AVX2 tiles take such blocks apart from the plain ones), NaN where a row
 * has a 255, and many vectors bit-equal to one. */
TEST(kn_mxfp4_edge_scales_every_level) {
    const int64_t rows = 40, cols = 1024 + 96, ng = cols / 32;
    tmat m;
    tmat_make(&m, WT_MXFP4, rows, cols, DT_UNKNOWN, 0, 0, 123);
    uint8_t *sc = m.scale;
    static const uint8_t edge[] = {0, 255, 1, 254};
    uint8_t *codes = m.data;
    for (int64_t r = 0; r < 36; r++) { /* one edge byte a row, at group (5 r) mod ng; rows 36.. none */
        const int64_t g = (5 * r) % ng;
        sc[r * ng + g] = edge[r % 4];
        if (edge[r % 4] == 254) { /* one code of 0.5 there: 2^126, no overflow */
            memset(codes + r * (cols / 2) + g * 16, 0, 16);
            codes[r * (cols / 2) + g * 16] = 0x01;
        }
    }
    const int n = 5;
    float *X = malloc((size_t)n * cols * sizeof *X), *Y = malloc((size_t)n * rows * sizeof *Y);
    float *y = malloc((size_t)rows * sizeof *y), *deq = malloc((size_t)cols * sizeof *deq);
    REQUIRE(X && Y && y && deq);
    rand_vecs(X, n, cols, 99, 3);
    for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
        if (!kn_level_available((kn_level)lv)) continue;
        const char *ln = kn_level_name((kn_level)lv);
        kn_matmul((kn_level)lv, &m.w, X, n, Y, rows, 0, rows);
        int bad = 0, diff = 0;
        for (int i = 0; i < n; i++) {
            kn_matvec((kn_level)lv, &m.w, X + i * cols, y, 0, rows);
            for (int64_t r = 0; r < rows; r++) {
                diff += !same_bits(Y[i * rows + r], y[r]);
                kn_dequant_row(&m.w, r, deq);
                double acc = 0, mag = 0;
                for (int64_t c = 0; c < cols; c++) {
                    acc += (double)deq[c] * X[i * cols + c];
                    mag += fabs((double)deq[c] * X[i * cols + c]);
                }
                const int want_nan = r < 36 && edge[r % 4] == 255;
                const int ok = want_nan ? isnan(y[r]) : fabs(y[r] - acc) <= (double)(cols + 2) * 0x1p-24 * mag + 1e-35;
                if (!ok && bad++ < 3) CHECK(0, "%s row %lld vector %d: %.9g vs ref %.9g", ln, (long long)r, i, y[r], acc);
            }
        }
        CHECK(bad == 0, "%s: %d outputs off", ln, bad);
        CHECK(diff == 0, "%s: %d outputs of many vectors differ from one", ln, diff);
    }
    free(X), free(Y), free(y), free(deq);
    tmat_free(&m);
}

/* 4-bit weights against x with a wide range inside its 32-column groups
 * (values 2^0 .. 2^-40 apart, zero groups, a subnormal group), a tail
 * chunk, and a NaN: every level within the fp32 bound plus kernels.h's
 * 2^-23 max|x_g| sum_g |w| term for the AVX-512 fixed point (the others
 * meet the plain fp32 bound), and NaN in x gives NaN in every row. */
TEST(kn_nib_wide_x_within_bound) {
    const wt_type types[] = {WT_MXFP4, WT_INT4_G32};
    const int64_t rows = 9, cols = 1024 + 96;
    for (int ti = 0; ti < 2; ti++) {
        tmat m;
        tmat_make(&m, types[ti], rows, cols, types[ti] == WT_INT4_G32 ? DT_BF16 : DT_UNKNOWN, 0, 0, 91 + ti);
        float *x = malloc((size_t)cols * sizeof *x), *deq = malloc((size_t)cols * sizeof *deq);
        float *y = malloc((size_t)rows * sizeof *y);
        uint64_t s = 4242 + ti;
        for (int64_t c = 0; c < cols; c++) {
            const int g = (int)(c / 32);
            double v = (1.0 + (double)(rng_next(&s) % 1000) / 1000.0) * ldexp(1.0, -(int)(rng_next(&s) % 41));
            if (rng_next(&s) & 1) v = -v;
            if (g == 3) v = 0.0;            /* a zero group */
            if (g == 5) v *= 0x1p-130;      /* a group of subnormals */
            x[c] = (float)v;
        }
        for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
            if (!kn_level_available((kn_level)lv)) continue;
            kn_matvec((kn_level)lv, &m.w, x, y, 0, rows);
            for (int64_t r = 0; r < rows; r++) {
                kn_dequant_row(&m.w, r, deq);
                double ref = 0, mag = 0, fix = 0;
                for (int64_t g = 0; g < cols / 32; g++) {
                    double mx = 0, sw = 0;
                    for (int64_t c = g * 32; c < g * 32 + 32; c++) {
                        ref += (double)deq[c] * x[c];
                        mag += fabs((double)deq[c] * x[c]);
                        mx = fmax(mx, fabs((double)x[c]));
                        sw += fabs((double)deq[c]);
                    }
                    fix += mx * sw;
                }
                const double tol = (double)(cols + 2) * 0x1p-24 * mag + 0x1p-23 * fix + 1e-37;
                CHECK(fabs(y[r] - ref) <= tol, "%s %s row %lld: %.9g vs ref %.9g (tol %.3g)", wt_type_name(m.w.type),
                      kn_level_name((kn_level)lv), (long long)r, y[r], ref, tol);
            }
            const float keep = x[37];
            x[37] = __builtin_nanf("");
            kn_matvec((kn_level)lv, &m.w, x, y, 0, rows);
            x[37] = keep;
            for (int64_t r = 0; r < rows; r++)
                CHECK(isnan(y[r]), "%s %s row %lld: %.9g with a NaN in x", wt_type_name(m.w.type),
                      kn_level_name((kn_level)lv), (long long)r, y[r]);
        }
        free(x), free(deq), free(y);
        tmat_free(&m);
    }
}

TEST(kn_dequant_known) {
    float out[64];
    { /* mxfp4: byte 0x21 -> 0.5 (even col, low nibble), 1.0 (odd col); e8m0 scales */
        uint8_t d[16] = {0x21, 0x9f, 0x70}, s[1] = {127};
        df_weight w = {.type = WT_MXFP4, .rows = 1, .cols = 32, .data = d, .scale = s};
        kn_dequant_row(&w, 0, out);
        CHECK(out[0] == 0.5f && out[1] == 1.0f, "%g %g", out[0], out[1]);
        CHECK(out[2] == -6.0f && out[3] == -0.5f, "0x9f: %g %g", out[2], out[3]);
        CHECK(out[4] == 0.0f && out[5] == 6.0f, "0x70: %g %g", out[4], out[5]);
        s[0] = 128;
        kn_dequant_row(&w, 0, out);
        CHECK(out[0] == 1.0f && out[1] == 2.0f, "s=128: %g %g", out[0], out[1]);
        s[0] = 0;
        kn_dequant_row(&w, 0, out);
        CHECK(out[1] == 0x1p-127f, "s=0: %g", out[1]);
        s[0] = 255;
        kn_dequant_row(&w, 0, out);
        CHECK(isnan(out[1]), "s=255: %g", out[1]);
        CHECK(e8m0_to_f32(127) == 1.0f);
    }
    { /* int4: element j of a word at bits 4j holds q+8: nibble 8 -> 0, 15 -> 7, 0 -> -8 */
        uint32_t d[4] = {0};
        uint32_t nibs[8] = {8, 15, 0, 9, 7, 1, 14, 8};
        for (int j = 0; j < 8; j++) d[0] |= nibs[j] << (4 * j);
        uint16_t sb[1] = {0x3f80}; /* bf16 1.0 */
        df_weight w = {.type = WT_INT4_G32, .rows = 1, .cols = 32, .data = d, .scale = sb,
                       .scale_dtype = DT_BF16};
        kn_dequant_row(&w, 0, out);
        for (int j = 0; j < 8; j++) CHECK(out[j] == (float)((int)nibs[j] - 8), "nib %u: %g", nibs[j], out[j]);
        CHECK(out[8] == -8.0f, "zero word: %g", out[8]);
        sb[0] = 0x3f00; /* bf16 0.5 */
        kn_dequant_row(&w, 0, out);
        CHECK(out[1] == 3.5f && out[2] == -4.0f, "%g %g", out[1], out[2]);
        uint16_t sh[1] = {0x3c00}; /* f16 1.0 */
        w.scale = sh, w.scale_dtype = DT_F16;
        kn_dequant_row(&w, 0, out);
        CHECK(out[1] == 7.0f && out[2] == -8.0f, "%g %g", out[1], out[2]);
        float sf[1] = {0.25f};
        w.scale = sf, w.scale_dtype = DT_F32;
        kn_dequant_row(&w, 0, out);
        CHECK(out[1] == 1.75f && out[2] == -2.0f, "%g %g", out[1], out[2]);
    }
    { /* fp8 e4m3 with 2x2 blocks of 2x2 */
        uint8_t d[8] = {0x38, 0xb8, 0x7e, 0x01, 0x00, 0x80, 0x7f, 0x40};
        float s[4] = {1.0f, 2.0f, 4.0f, 8.0f};
        df_weight w = {.type = WT_FP8_BLOCK, .rows = 2, .cols = 4, .data = d, .scale = s,
                       .block_rows = 1, .block_cols = 2};
        kn_dequant_row(&w, 0, out);
        CHECK(out[0] == 1.0f && out[1] == -1.0f, "%g %g", out[0], out[1]);
        CHECK(out[2] == 448.0f * 2 && out[3] == 0x1p-9f * 2, "%g %g", out[2], out[3]);
        kn_dequant_row(&w, 1, out);
        CHECK(out[0] == 0.0f && out[1] == 0.0f && signbit(out[1]), "%g %g", out[0], out[1]);
        CHECK(isnan(out[2]) && out[3] == 2.0f * 8, "%g %g", out[2], out[3]);
    }
    { /* bf16, f16, i8 */
        uint16_t b[2] = {0x3f80, 0xc040};
        df_weight w = {.type = WT_BF16, .rows = 1, .cols = 2, .data = b};
        kn_dequant_row(&w, 0, out);
        CHECK(out[0] == 1.0f && out[1] == -3.0f, "%g %g", out[0], out[1]);
        uint16_t h[3] = {0x3c00, 0x0001, 0xfbff};
        df_weight wh = {.type = WT_F16, .rows = 1, .cols = 3, .data = h};
        kn_dequant_row(&wh, 0, out);
        CHECK(out[0] == 1.0f && out[1] == 0x1p-24f && out[2] == -65504.0f, "%g %g %g", out[0], out[1], out[2]);
        int8_t q[2] = {-128, 127};
        float s[1] = {0.5f};
        df_weight wi = {.type = WT_I8_ROW, .rows = 1, .cols = 2, .data = q, .scale = s};
        kn_dequant_row(&wi, 0, out);
        CHECK(out[0] == -64.0f && out[1] == 63.5f, "%g %g", out[0], out[1]);
    }
}

TEST(kn_fp8_nan_propagates) {
    /* a NaN code anywhere in a row makes that row's output NaN at every level */
    uint8_t d[2 * 40];
    memset(d, 0x38, sizeof d);
    d[37] = 0x7f;
    float s[1] = {1.0f}, x[40], y[2];
    for (int i = 0; i < 40; i++) x[i] = 1.0f;
    df_weight w = {.type = WT_FP8_BLOCK, .rows = 2, .cols = 40, .data = d, .scale = s,
                   .block_rows = 128, .block_cols = 128};
    for (int lv = KN_SCALAR; lv <= (int)kn_detect(); lv++) {
        if (!kn_level_available((kn_level)lv)) continue;
        kn_matvec((kn_level)lv, &w, x, y, 0, 2);
        CHECK(isnan(y[0]) && y[1] == 40.0f, "%s: %g %g", kn_level_name((kn_level)lv), y[0], y[1]);
    }
}

/* Many vectors over wide rows: kn_matmul runs them in blocks of vectors
 * (the driver's x budget, 4 MB: 40 x 32768 floats is two blocks); every
 * output stays bit-equal to kn_matvec (KN_AMX: one_vector_ref), at every
 * level this CPU runs. */
TEST(kn_matmul_vector_blocks) {
    const wt_type types[] = {WT_BF16, WT_MXFP4};
    const int64_t rows = 9, cols = 32768;
    const int n = 40;
    float *X = malloc((size_t)n * cols * sizeof *X), *Y = malloc((size_t)n * rows * sizeof *Y);
    float yv[9];
    REQUIRE(X && Y);
    rand_vecs(X, n, cols, 900, 1);
    for (int k = 0; k < 2; k++) {
        tmat m;
        tmat_make(&m, types[k], rows, cols, DT_UNKNOWN, 0, 0, 11 + (uint64_t)k);
        for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
            if (!kn_level_available((kn_level)lv)) continue;
            kn_matmul((kn_level)lv, &m.w, X, n, Y, rows, 0, rows);
            int diff = 0;
            for (int i = 0; i < n; i++) {
                one_vector_ref((kn_level)lv, &m.w, X, n, i, yv, 0, rows);
                for (int64_t r = 0; r < rows; r++) diff += !same_bits(Y[(size_t)i * rows + r], yv[r]);
            }
            CHECK(diff == 0, "%s %s: %d of %d outputs of a %d-vector matmul differ from matvec",
                  wt_type_name(types[k]), kn_level_name((kn_level)lv), diff, (int)(n * rows), n);
        }
        tmat_free(&m);
    }
    free(X);
    free(Y);
}

/* x prepared once (kn_px_*) and products over a pool (kn_matmul_pool): the
 * same bits as kn_matmul for every type and level, any split of the
 * vectors' preparation and of the rows, tails included (bf16's even / odd
 * columns come in 32- / 16-column steps, the 4-bit tiles' in 128). */
TEST(kn_px_and_pool_same_bits_as_matmul) {
    static const struct { wt_type t; st_dtype s; int br, bc; } types[] = {
        {WT_F32, DT_UNKNOWN, 0, 0}, {WT_BF16, DT_UNKNOWN, 0, 0}, {WT_F16, DT_UNKNOWN, 0, 0},
        {WT_I8_ROW, DT_UNKNOWN, 0, 0}, {WT_FP8_BLOCK, DT_UNKNOWN, 128, 128}, {WT_INT4_G32, DT_BF16, 0, 0},
        {WT_MXFP4, DT_UNKNOWN, 0, 0}};
    static const int64_t shapes[][2] = {{37, 7168}, {5, 1000}, {19, 224}, {3, 48}, {67, 3584}};
    static const int ns[] = {1, 3, 18};
    df_pool *pool = pool_new(3);
    REQUIRE(pool);
    uint64_t rs = 77;
    int prepped = 0;
    for (int ti = 0; ti < N(types); ti++)
        for (int si = 0; si < N(shapes); si++) {
            const int nib = types[ti].t == WT_INT4_G32 || types[ti].t == WT_MXFP4;
            const int64_t rows = shapes[si][0], cols = shapes[si][1];
            if (nib && cols % 32) continue;
            tmat m;
            tmat_make(&m, types[ti].t, rows, cols, types[ti].s, types[ti].br, types[ti].bc, 300 + (uint64_t)si);
            for (int ni = 0; ni < N(ns); ni++) {
                const int n = ns[ni];
                float *X = malloc((size_t)n * cols * sizeof *X), *Y = malloc((size_t)n * rows * sizeof *Y);
                float *Z = malloc((size_t)n * rows * sizeof *Z);
                REQUIRE(X && Y && Z);
                rand_vecs(X, n, cols, 50 + (uint64_t)si, 7);
                for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
                    if (!kn_level_available((kn_level)lv)) continue;
                    const char *ln = kn_level_name((kn_level)lv), *tn = wt_type_name(types[ti].t);
                    kn_matmul((kn_level)lv, &m.w, X, n, Y, rows, 0, rows);
                    const int64_t pf = kn_px_floats((kn_level)lv, &m.w, n);
                    CHECK(pf == 0 || (pf > 0 && pf <= n * kn_px_len(cols)), "%s %s: %lld floats", tn, ln, (long long)pf);
                    if (pf > 0) {
                        prepped++;
                        float *Xp = aligned_alloc(64, (size_t)pf * sizeof *Xp);
                        REQUIRE(Xp);
                        const int h = n / 2; /* the vectors prepared in two parts */
                        kn_px_prep((kn_level)lv, &m.w, X, h, n, Xp);
                        kn_px_prep((kn_level)lv, &m.w, X, 0, h, Xp);
                        for (int64_t a = 0; a < rows;) { /* rows in random pieces */
                            const int64_t len = 1 + (int64_t)(rng_next(&rs) % 17), b = a + len < rows ? a + len : rows;
                            kn_matmul_px((kn_level)lv, &m.w, Xp, n, Z + a, rows, a, b);
                            a = b;
                        }
                        int diff = 0;
                        for (int64_t i = 0; i < (int64_t)n * rows; i++) diff += !same_bits(Z[i], Y[i]);
                        CHECK(diff == 0, "%s %s %lldx%lld n=%d: %d outputs of kn_matmul_px differ from kn_matmul", tn, ln,
                              (long long)rows, (long long)cols, n, diff);
                        free(Xp);
                    }
                    memset(Z, 0, (size_t)n * rows * sizeof *Z);
                    kn_matmul_pool(pool, (kn_level)lv, &m.w, X, n, Z, rows, rows);
                    int diff = 0;
                    for (int64_t i = 0; i < (int64_t)n * rows; i++) diff += !same_bits(Z[i], Y[i]);
                    CHECK(diff == 0, "%s %s %lldx%lld n=%d: %d outputs of kn_matmul_pool differ from kn_matmul", tn, ln,
                          (long long)rows, (long long)cols, n, diff);
                }
                free(X), free(Y), free(Z);
            }
            tmat_free(&m);
        }
    /* at an x86 SIMD level, bf16 and the 4-bit types prepare x */
    if (kn_level_available(KN_AVX2)) CHECK(prepped > 0);
    pool_free(pool);
}

/* Several products in one pass (kn_matmul_pool_many, the engine's mm_many
 * on the CPU): each output bit-equal to kn_matmul, with products that share
 * their x (one preparation), ones that do not, a product of no vectors,
 * several vector counts and types, at every level this CPU runs. */
TEST(kn_pool_many_same_bits_as_matmul) {
    static const struct { wt_type t; st_dtype s; int64_t rows, cols; } mats[] = {
        {WT_BF16, DT_UNKNOWN, 37, 224}, {WT_BF16, DT_UNKNOWN, 5, 224}, {WT_MXFP4, DT_UNKNOWN, 67, 224},
        {WT_INT4_G32, DT_BF16, 19, 224}, {WT_F32, DT_UNKNOWN, 3, 224}, {WT_MXFP4, DT_UNKNOWN, 9, 96},
        {WT_I8_ROW, DT_UNKNOWN, 11, 224}};
    enum { NM = 7 };
    /* 80 and 40: prepared x past the stack's, in a kept buffer (grown for 80,
     * larger than needed for 40) as well as a pass's own */
    static const int ns[] = {1, 4, 11, 80, 40};
    kn_px_buf kept = {0};
    int64_t past_stack = 0; /* the most prepared floats a pass needed at a level that prepares x */
    df_pool *pool = pool_new(3);
    REQUIRE(pool);
    tmat m[NM];
    for (int i = 0; i < NM; i++) tmat_make(&m[i], mats[i].t, mats[i].rows, mats[i].cols, mats[i].s, 0, 0, 40 + (uint64_t)i);
    for (int ni = 0; ni < N(ns); ni++) {
        const int n = ns[ni];
        /* two inputs of 224 columns (products 0-4 and 6 read xa, except 3 reads
         * xb) and one of 96 */
        float *xa = malloc((size_t)n * 224 * sizeof(float)), *xb = malloc((size_t)n * 224 * sizeof(float));
        float *xc = malloc((size_t)n * 96 * sizeof(float));
        REQUIRE(xa && xb && xc);
        rand_vecs(xa, n, 224, 10, 1);
        rand_vecs(xb, n, 224, 30, 1);
        rand_vecs(xc, n, 96, 50, 1);
        const float *xs[NM] = {xa, xa, xa, xb, xa, xc, xa};
        for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
            if (!kn_level_available((kn_level)lv)) continue;
            kn_mm_item it[NM + 1], ik[NM + 1];
            float *Y[NM + 1], *K[NM], *Z[NM];
            for (int i = 0; i < NM; i++) {
                const int64_t ldy = mats[i].rows + 2; /* a stride past the rows */
                Y[i] = calloc((size_t)n * ldy, sizeof(float));
                K[i] = calloc((size_t)n * ldy, sizeof(float));
                Z[i] = calloc((size_t)n * ldy, sizeof(float));
                REQUIRE(Y[i] && K[i] && Z[i]);
                it[i] = (kn_mm_item){&m[i].w, xs[i], n, Y[i], ldy};
                ik[i] = (kn_mm_item){&m[i].w, xs[i], n, K[i], ldy};
                kn_matmul((kn_level)lv, &m[i].w, xs[i], n, Z[i], ldy, 0, mats[i].rows);
            }
            it[NM] = ik[NM] = (kn_mm_item){&m[0].w, xa, 0, NULL, 0}; /* no vectors: nothing */
            kn_matmul_pool_many(pool, (kn_level)lv, it, NM + 1);
            kn_matmul_pool_many_kept(pool, (kn_level)lv, ik, NM + 1, &kept);
            int64_t need = 0; /* (an upper bound: shared preparations counted once each item) */
            for (int i = 0; i < NM; i++) need += kn_px_floats((kn_level)lv, &m[i].w, n);
            if (lv != KN_AMX && need > past_stack) past_stack = need;
            for (int i = 0; i < NM; i++) {
                int diff = 0, diffk = 0;
                for (int v = 0; v < n; v++)
                    for (int64_t r = 0; r < mats[i].rows + 2; r++) {
                        const size_t o = (size_t)v * (mats[i].rows + 2) + r;
                        diff += !same_bits(Y[i][o], Z[i][o]);
                        diffk += !same_bits(K[i][o], Z[i][o]);
                    }
                CHECK(diff == 0, "%s product %d (%s) n=%d: %d outputs differ from kn_matmul", kn_level_name((kn_level)lv), i,
                      wt_type_name(mats[i].t), n, diff);
                CHECK(diffk == 0, "%s product %d (%s) n=%d: %d outputs on a kept buffer differ from kn_matmul",
                      kn_level_name((kn_level)lv), i, wt_type_name(mats[i].t), n, diffk);
                free(Y[i]), free(K[i]), free(Z[i]);
            }
        }
        free(xa), free(xb), free(xc);
    }
    /* levels that read x as given (NEON) never prepare it */
    CHECK(past_stack < 16384 || kept.cap > 0, "the kept buffer was never used (%lld prepared floats a pass)",
          (long long)past_stack);
    kn_px_buf_free(&kept);
    for (int i = 0; i < NM; i++) tmat_free(&m[i]);
    pool_free(pool);
}

/* The AVX2 level's AVX-VNNI build (matvec_avxvnni.c): every int4 and MXFP4
 * output bit-equal to the plain AVX2 tiles' (the same integer per lane), for
 * one and many vectors, prepared or not, tails and a NaN group included. */
TEST(kn_avxvnni_same_bits_as_avx2) {
#if defined(__x86_64__)
    if (!kn_avxvnni_usable()) SKIP("this CPU has no AVX-VNNI");
    static const struct { wt_type t; st_dtype s; } types[] = {
        {WT_INT4_G32, DT_BF16}, {WT_INT4_G32, DT_F16}, {WT_INT4_G32, DT_F32}, {WT_MXFP4, DT_UNKNOWN}};
    static const int64_t shapes[][2] = {{37, 7168}, {19, 224}, {67, 3584}, {3, 96}, {5, 32}};
    static const int ns[] = {1, 2, 5, 18};
    for (int ti = 0; ti < N(types); ti++)
        for (int si = 0; si < N(shapes); si++) {
            const int64_t rows = shapes[si][0], cols = shapes[si][1];
            tmat m;
            tmat_make(&m, types[ti].t, rows, cols, types[ti].s, 0, 0, 500 + (uint64_t)si);
            for (int ni = 0; ni < N(ns); ni++) {
                const int n = ns[ni];
                float *X = malloc((size_t)n * cols * sizeof *X), *Y = malloc((size_t)n * rows * sizeof *Y);
                float *Z = malloc((size_t)n * rows * sizeof *Z);
                float *Xp = aligned_alloc(64, (size_t)n * kn_px_len(cols) * sizeof *Xp);
                REQUIRE(X && Y && Z && Xp);
                rand_vecs(X, n, cols, 70 + (uint64_t)si, 5);
                if (n > 1) X[cols + 3] = NAN;               /* vector 1's first group gives NaN */
                if (n > 2) X[2 * cols + cols - 1] = 1e30f;   /* a wide range within vector 2's last group */
                const char *tn = wt_type_name(types[ti].t);
                REQUIRE(kn_matmul_avx2(&m.w, X, n, Y, rows, 0, rows));
                REQUIRE(kn_matmul_avxvnni(&m.w, X, n, Z, rows, 0, rows));
                int diff = 0;
                for (int64_t i = 0; i < (int64_t)n * rows; i++) diff += !same_bits(Z[i], Y[i]);
                CHECK(diff == 0, "%s %lldx%lld n=%d: %d outputs differ", tn, (long long)rows, (long long)cols, n, diff);
                REQUIRE(kn_matmul_avxvnni_prep(&m.w, X, 0, n, Xp));
                memset(Z, 0, (size_t)n * rows * sizeof *Z);
                REQUIRE(kn_matmul_avxvnni_px(&m.w, Xp, n, Z, rows, 0, rows));
                diff = 0;
                for (int64_t i = 0; i < (int64_t)n * rows; i++) diff += !same_bits(Z[i], Y[i]);
                CHECK(diff == 0, "%s %lldx%lld n=%d prepared: %d outputs differ", tn, (long long)rows, (long long)cols,
                      n, diff);
                free(X), free(Y), free(Z), free(Xp);
            }
            tmat_free(&m);
        }
#else
    SKIP("not an x86 build");
#endif
}

/* ---- the AMX level's layouts (matvec_amx.c) ----------------------------------
 * kn_matmul_amx_emu runs the AMX level's walk, limb packing and MXFP4 decode
 * over a plain-C model of the tile unit, so these checks run on any AVX-512
 * CPU; on a CPU with AMX the real tiles get them too. For bf16 and MXFP4:
 * within the bound of a float64 reference; row i of n vectors (groups of 10,
 * blocks of groups, leftovers) bit-equal to vector i alone; any split of the
 * rows the same bits; one-hot x exact; MXFP4 rows whose scales leave bf16's
 * normal range equal to the AVX-512 level (which computes them). */
typedef int (*amx_fn)(const df_weight *, const float *, int, float *, int64_t, int64_t, int64_t);
typedef struct {
    int64_t (*init)(kn_amx_x *, const df_weight *, int);
    void (*pack)(const kn_amx_x *, const float *, int, int);
    void (*rows)(const kn_amx_x *, const float *, float *, int64_t, int64_t, int64_t);
} amx_parts;

/* x packed once (its groups in two calls), rows in pieces: the bits of run */
static void amx_parts_check(const char *ln, const amx_parts *p, const df_weight *w, const float *X, int n,
                            const float *Y, int64_t ldy, int64_t r0) {
    kn_amx_x px;
    const int64_t bytes = p->init(&px, w, n);
    CHECK(bytes > 0);
    if (bytes <= 0) return;
    px.B = aligned_alloc(64, (size_t)bytes);
    p->pack(&px, X, px.groups / 2, px.groups);
    p->pack(&px, X, 0, px.groups / 2);
    float *Z = malloc((size_t)n * ldy * sizeof *Z);
    for (int64_t a = r0; a < w->rows; a += 37) {
        const int64_t b = a + 37 < w->rows ? a + 37 : w->rows;
        p->rows(&px, X, Z + (a - r0), ldy, a, b);
    }
    int diff = 0;
    for (int i = 0; i < n; i++)
        for (int64_t r = r0; r < w->rows; r++) {
            const size_t o = (size_t)i * ldy + (size_t)(r - r0);
            diff += !same_bits(Z[o], Y[o]);
        }
    CHECK(diff == 0, "%s %s %lldx%lld: x packed once differs in %d outputs", wt_type_name(w->type), ln,
          (long long)w->rows, (long long)w->cols, diff);
    free(Z);
    free(px.B);
}

static void amx_check(const char *ln, amx_fn run, const amx_parts *parts, const tmat *m, int n, uint64_t seed) {
    const df_weight *w = &m->w;
    const int64_t rows = w->rows, cols = w->cols, r0 = rows > 2 ? 1 : 0, ldy = rows + 3;
    const char *tn = wt_type_name(w->type);
    float *X = malloc((size_t)n * cols * sizeof *X), *Y = malloc((size_t)n * ldy * sizeof *Y);
    float *y1 = malloc((size_t)rows * sizeof *y1), *deq = malloc((size_t)cols * sizeof *deq);
    rand_vecs(X, n, cols, seed * 131, 1);
    CHECK(run(w, X, n, Y, ldy, r0, rows) == 1, "%s %s: declined", tn, ln);
    int diff = 0, bad = 0;
    for (int i = 0; i < n; i++) {
        const float *x = X + (size_t)i * cols;
        CHECK(run(w, x, 1, y1, rows, r0, rows) == 1);
        for (int64_t r = r0; r < rows; r++) {
            diff += !same_bits(Y[(size_t)i * ldy + (r - r0)], y1[r - r0]);
            kn_dequant_row(w, r, deq);
            double acc = 0, mag = 0;
            for (int64_t c = 0; c < cols; c++) acc += (double)deq[c] * x[c], mag += fabs((double)deq[c] * x[c]);
            const double tol = (double)(cols + 2) * 0x1p-24 * mag + 1e-35, got = y1[r - r0];
            if (!(fabs(got - acc) <= tol) && bad++ < 3)
                CHECK(0, "%s %s %lldx%lld row %lld vector %d: %.9g vs ref %.9g (tol %.3g)", tn, ln, (long long)rows,
                      (long long)cols, (long long)r, i, got, acc, tol);
        }
    }
    CHECK(diff == 0, "%s %s %lldx%lld: %d outputs of %d vectors differ from one vector at a time", tn, ln,
          (long long)rows, (long long)cols, diff, n);
    amx_parts_check(ln, parts, w, X, n, Y, ldy, r0);
    /* rows cut anywhere: the same bits */
    uint64_t s = seed;
    for (int64_t a = r0; a < rows;) {
        const int64_t len = 1 + (int64_t)(rng_next(&s) % 40), b = a + len > rows ? rows : a + len;
        CHECK(run(w, X, n, Y + (a - r0), ldy, a, b) == 1);
        a = b;
    }
    for (int64_t r = r0; r < rows; r++) {
        CHECK(run(w, X + (size_t)(n - 1) * cols, 1, y1, 1, r, r + 1) == 1);
        diff += !same_bits(Y[(size_t)(n - 1) * ldy + (r - r0)], y1[0]);
    }
    CHECK(diff == 0, "%s %s %lldx%lld: %d outputs differ when the rows are cut", tn, ln, (long long)rows,
          (long long)cols, diff);
    if (cols <= 96) { /* one-hot x: the weight itself */
        float *e = calloc((size_t)cols, sizeof *e);
        int wrong = 0;
        for (int64_t c = 0; c < cols; c++) {
            e[c] = 1.0f;
            run(w, e, 1, y1, rows, 0, rows);
            e[c] = 0.0f;
            for (int64_t r = 0; r < rows; r++) {
                kn_dequant_row(w, r, deq);
                wrong += !(y1[r] == deq[c]);
            }
        }
        CHECK(wrong == 0, "%s %s %lldx%lld: %d one-hot outputs are not the weight", tn, ln, (long long)rows,
              (long long)cols, wrong);
        free(e);
    }
    free(X), free(Y), free(y1), free(deq);
}

TEST(kn_amx_layouts) {
    amx_fn runs[2] = {NULL, NULL};
    const char *names[2] = {"amx-model", "amx"};
    amx_parts parts[2];
    memset(parts, 0, sizeof parts);
#if defined(__x86_64__)
    if (kn_level_available(KN_AVX512)) {
        runs[0] = kn_matmul_amx_emu;
        parts[0] = (amx_parts){kn_amx_x_init_emu, kn_amx_x_pack_emu, kn_matmul_amx_x_emu};
    }
    if (kn_level_available(KN_AMX)) {
        runs[1] = kn_matmul_amx;
        parts[1] = (amx_parts){kn_amx_x_init, kn_amx_x_pack, kn_matmul_amx_x};
    }
#endif
    if (!runs[0] && !runs[1]) SKIP("no AVX-512 here");
    static const int64_t rows[] = {1, 5, 16, 31, 32, 33, 67};
    static const int64_t cols[] = {32, 64, 96, 1024};
    static const int ns[] = {1, 3, 10, 23};
    const wt_type types[] = {WT_BF16, WT_MXFP4};
    uint64_t seed = 1;
    for (int k = 0; k < 2; k++)
        for (int f = 0; f < 2; f++) {
            if (!runs[f]) continue;
            for (int i = 0; i < N(rows); i++)
                for (int j = 0; j < N(cols); j++) {
                    tmat m;
                    tmat_make(&m, types[k], rows[i], cols[j], DT_UNKNOWN, 0, 0, seed);
                    amx_check(names[f], runs[f], &parts[f], &m, ns[(i + j) % N(ns)], seed++);
                    tmat_free(&m);
                }
            /* wide rows (several column chunks), many rows (several panels
             * of 8 tiles), many vectors (several blocks of groups) */
            static const int64_t big[][3] = {{33, 17472, 23}, {300, 64, 23}, {40, 64, 200}};
            for (int b = 0; b < N(big); b++) {
                tmat m;
                tmat_make(&m, types[k], big[b][0], big[b][1], DT_UNKNOWN, 0, 0, seed);
                amx_check(names[f], runs[f], &parts[f], &m, (int)big[b][2], seed++);
                tmat_free(&m);
            }
        }
    /* on a pool (the engine's products): the bits of one call */
    if (runs[1]) {
        df_pool *pool = pool_new(3);
        for (int k = 0; k < 2 && pool; k++) {
            tmat m;
            tmat_make(&m, types[k], 97, 1024, DT_UNKNOWN, 0, 0, 90 + (uint64_t)k);
            const int n = 23;
            float *X = malloc((size_t)n * 1024 * sizeof *X), *Y = malloc((size_t)n * 97 * sizeof *Y);
            float *Z = malloc((size_t)n * 97 * sizeof *Z);
            for (int i = 0; i < n * 1024; i++) X[i] = 0.001f * (float)((i * 53) % 997) - 0.5f;
            /* rows [0, 60) of 97: the rest of Y untouched */
            for (int i = 0; i < n * 97; i++) Y[i] = Z[i] = -7.0f;
            CHECK(kn_matmul_amx_pool(pool, &m.w, X, n, Y, 97, 60, NULL) == 1);
            kn_matmul(KN_AMX, &m.w, X, n, Z, 97, 0, 60);
            CHECK(memcmp(Y, Z, (size_t)n * 97 * sizeof *Y) == 0, "%s: the pool's product differs",
                  wt_type_name(types[k]));
            /* x packed into a kept buffer, twice (the second time reused) */
            kn_px_buf kept = {0};
            for (int t = 0; t < 2; t++) {
                for (int i = 0; i < n * 97; i++) Y[i] = -7.0f;
                CHECK(kn_matmul_amx_pool(pool, &m.w, X, n, Y, 97, 60, &kept) == 1 && kept.cap > 0);
                CHECK(memcmp(Y, Z, (size_t)n * 97 * sizeof *Y) == 0, "%s: the pool's product on a kept buffer differs",
                      wt_type_name(types[k]));
            }
            kn_px_buf_free(&kept);
            free(X), free(Y), free(Z);
            tmat_free(&m);
        }
        pool_free(pool);
    }
    /* MXFP4 rows with scales outside bf16's range go to the AVX-512 tiles */
    for (int f = 0; f < 2; f++) {
        if (!runs[f]) continue;
        tmat m;
        tmat_make(&m, WT_MXFP4, 40, 128, DT_UNKNOWN, 0, 0, 77);
        uint8_t *sc = m.scale;
        sc[1 * 4 + 0] = 0, sc[2 * 4 + 3] = 1, sc[17 * 4 + 2] = 253, sc[33 * 4 + 1] = 255;
        const int n = 12;
        float *X = malloc((size_t)n * 128 * sizeof *X), *Y = malloc((size_t)n * 40 * sizeof *Y);
        float *Z = malloc((size_t)n * 40 * sizeof *Z);
        for (int i = 0; i < n * 128; i++) X[i] = 0.01f * (float)((i * 37) % 101) - 0.5f;
        CHECK(runs[f](&m.w, X, n, Y, 40, 0, 40) == 1);
#if defined(__x86_64__)
        kn_matmul(KN_AVX512, &m.w, X, n, Z, 40, 0, 40);
#endif
        static const int odd[] = {1, 2, 17, 33};
        int diff = 0;
        for (int i = 0; i < n; i++)
            for (int q = 0; q < 4; q++) diff += memcmp(&Y[i * 40 + odd[q]], &Z[i * 40 + odd[q]], 4) != 0;
        CHECK(diff == 0, "%s: %d outputs of out-of-range rows differ from AVX-512", names[f], diff);
        free(X), free(Y), free(Z);
        tmat_free(&m);
    }
}

TEST(kn_level_capped_to_cpu) {
    /* asking for more than the CPU has must not crash and equals the best level */
    tmat m;
    tmat_make(&m, WT_BF16, 5, 70, DT_UNKNOWN, 0, 0, 3);
    float *x = rand_vec(70, 4), y1[5], y2[5];
    kn_matvec(KN_AVX512, &m.w, x, y1, 0, 5);
    kn_matvec(kn_detect(), &m.w, x, y2, 0, 5);
    CHECK(memcmp(y1, y2, sizeof y1) == 0);
    /* a level of the other architecture likewise runs as the best one */
    kn_matvec(kn_level_available(KN_NEON) ? KN_AVX2 : KN_NEON, &m.w, x, y1, 0, 5);
    CHECK(memcmp(y1, y2, sizeof y1) == 0);
    free(x);
    tmat_free(&m);
}

TEST(kn_op_axpy_same_bits_as_plain_c) {
    /* op_axpy runs as a NEON loop on AArch64 (ops_neon.c): every length
     * (vector body and tails) and the in-place form give the plain loop's bits */
    for (int n = 0; n <= 67; n++) {
        float *x = rand_vec(n + 1, 100 + n), *y = rand_vec(n + 1, 200 + n), *y2 = malloc((size_t)(n + 1) * sizeof *y2);
        const float a = 0.37f * x[0] - 1.1f;
        memcpy(y2, y, (size_t)(n + 1) * sizeof *y2);
        op_axpy(y, a, x, n);
        for (int i = 0; i < n; i++) y2[i] += a * x[i];
        CHECK(memcmp(y, y2, (size_t)(n + 1) * sizeof *y) == 0, "n %d", n);
        memcpy(y2, x, (size_t)(n + 1) * sizeof *y2);
        op_axpy(x, a, x, n);
        for (int i = 0; i < n; i++) y2[i] += a * y2[i];
        CHECK(memcmp(x, y2, (size_t)(n + 1) * sizeof *x) == 0, "in place, n %d", n);
        free(x), free(y), free(y2);
    }
}

/* ---- gated activations (act.c) ---- */

/* Inputs of every kind an MLP can hand the activation: ordinary values,
 * large and tiny magnitudes, signed zeros, a subnormal, exp's overflow edge,
 * infinities and NaN. */
static float act_input(uint64_t *s, int i) {
    static const float special[] = {0.0f, -0.0f, 1e-42f, -1e-42f, 88.5f, -88.5f, 104.0f, -104.0f, 1e30f, -1e30f,
                                    INFINITY, -INFINITY, NAN, 9.0f, -9.0f, 0.0625f};
    const int ns = (int)(sizeof special / sizeof special[0]);
    if (i % 13 == 5) return special[(i / 13) % ns];
    const float mag[] = {1e-30f, 1e-6f, 0.01f, 0.5f, 1.0f, 3.0f, 12.0f, 60.0f, 300.0f};
    return frand(s) * mag[rng_next(s) % (sizeof mag / sizeof mag[0])];
}

static int act_close(float v, float r) {
    if (isnan(r) || isnan(v)) return isnan(r) && isnan(v);
    if (isinf(r) || isinf(v)) return v == r;
    return fabsf(v - r) <= 16.0f * 0x1p-23f * fabsf(r) + 1e-30f;
}

/* kind 0 SiLU, 1 SiTU (beta 4, linear beta 25), 2 SiTU without the up tanh */
static void act_run(kn_level lv, int kind, float *g, const float *u, int64_t n) {
    if (kind == 0) kn_act_silu_mul(lv, g, u, n);
    else kn_act_situ_mul(lv, g, u, n, 4.0f, kind == 1 ? 25.0f : 0.0f);
}

TEST(kn_act_levels_within_bound_any_split) {
    /* each SIMD level within kernels.h's bound of libm's scalar values, and
     * an array computed in pieces (vector bodies and masked ends anywhere)
     * bit-equal to the whole */
    static const int lens[] = {1, 7, 8, 15, 16, 17, 31, 100, 1000, 4099};
    uint64_t s = 77;
    int bad = 0, runs = 0;
    for (int kind = 0; kind < 3; kind++)
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            const int n = lens[li];
            float *g = malloc((size_t)n * sizeof *g), *u = malloc((size_t)n * sizeof *u);
            float *ref = malloc((size_t)n * sizeof *ref), *y = malloc((size_t)n * sizeof *y),
                  *yp = malloc((size_t)n * sizeof *yp);
            for (int i = 0; i < n; i++) g[i] = act_input(&s, i), u[i] = act_input(&s, i + 7);
            memcpy(ref, g, (size_t)n * sizeof *g);
            act_run(KN_SCALAR, kind, ref, u, n);
            for (int lv = KN_SCALAR; lv <= KN_AMX; lv++) {
                if (!kn_level_available((kn_level)lv)) continue;
                memcpy(y, g, (size_t)n * sizeof *g);
                act_run((kn_level)lv, kind, y, u, n);
                for (int i = 0; i < n; i++)
                    if (!act_close(y[i], ref[i]) && bad++ < 4)
                        CHECK(0, "%s kind %d n %d: element %d (g %g u %g) %.9g vs scalar %.9g",
                              kn_level_name((kn_level)lv), kind, n, i, g[i], u[i], y[i], ref[i]);
                memcpy(yp, g, (size_t)n * sizeof *g);
                for (int i0 = 0; i0 < n;) {
                    int len = 1 + (int)(rng_next(&s) % 40);
                    if (len > n - i0) len = n - i0;
                    act_run((kn_level)lv, kind, yp + i0, u + i0, len);
                    i0 += len;
                }
                if (memcmp(y, yp, (size_t)n * sizeof *y) && bad++ < 4)
                    CHECK(0, "%s kind %d n %d: pieces differ from the whole", kn_level_name((kn_level)lv), kind, n);
                runs++;
            }
            free(g), free(u), free(ref), free(y), free(yp);
        }
    CHECK(runs > 0 && bad == 0, "%d of %d runs wrong", bad, runs);
}
