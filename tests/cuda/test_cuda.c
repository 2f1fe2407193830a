/* test_cuda.c — the CUDA kernels (src/cuda, gpu_) against the CPU oracles.
 *
 * Built by `make cuda` into build/run_cuda_tests with the shared runner
 * (tests/test_main.c); every test skips, saying why, when no usable GPU is
 * present, so CI machines with nvcc but no GPU pass.
 *
 * Oracles and bounds (fresh random data each test; outputs poisoned with NaN
 * bytes before every launch, so an unwritten element fails):
 *  - matvec / matmul (n = 1..64), per weight type: against the float64 dot of
 *    kn_dequant_row with x, |y - exact| <= (cols + 2) * 2^-24 * sum_c |w x|
 *    (the bound kn_matvec itself meets); against kn_matmul at KN_SCALAR,
 *    twice that. Row i of gpu_matmul bit-equal to gpu_matvec of vector i, a
 *    sub-range of rows bit-equal to the full range, and one-hot vectors
 *    reproduce kn_dequant_row bit for bit (edge scales included).
 *  - the tensor-core MXFP4 and bf16 paths (gpu_matmul_tc, ws->bf16_tc_rows
 *    1): the same checks with their own bound, (cols + 64) 2^-24 sum|w x| +
 *    2^-21 sum|w x| + 2^-38 max|x| sum|w| (x split into f16 hi + lo, or three
 *    bf16 limbs), also for x spanning 1e-30 .. 1e4; with bf16_tc_rows 9, n = 8
 *    gives gpu_matmul's bits and n = 9 the tensor cores'.
 *  - fused expert vs kn_matmul (scalar) + the ffn.c activation on the CPU:
 *    ||gpu - cpu|| / ||cpu|| <= 1e-5 per token vector; the same for expert
 *    batches (gpu_experts), each expert bit-equal alone, per vector, and
 *    (non-MXFP4) to gpu_expert.
 *  - RMSNorm vs op_rmsnorm: |d| <= 2^-22 |ref| per element.
 *  - router vs a copy of moe_route (ffn.c): identical ids, weights within
 *    1e-5 relative (CUDA's expf differs from glibc's by an ulp or two).
 * Each test prints the largest error it saw, as a fraction of its bound.
 */
#include "../test.h"
#include "cuda_test_util.h"
#include "../../src/cuda/gpu.h"
#include "../../src/kernels/kernels.h"
#include "../../src/kernels/ops.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ------------------------------------------------------------------ */

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static uint16_t f16_bits(float f) { /* normal-range values, truncating */
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
} hmat;

static void hmat_free(hmat *m) { free(m->data); free(m->scale); }

/* Random matrix; scales kept in a range where no product under- or overflows. */
static void hmat_make(hmat *m, wt_type t, int64_t rows, int64_t cols, st_dtype sdt, uint64_t seed) {
    uint64_t s = seed;
    memset(m, 0, sizeof *m);
    m->w.type = t;
    m->w.rows = rows;
    m->w.cols = cols;
    size_t n = (size_t)(rows * cols);
    switch (t) {
    case WT_BF16: {
        uint16_t *d = malloc(n * 2);
        for (size_t i = 0; i < n; i++) d[i] = (uint16_t)(f32_bits(frand(&s)) >> 16);
        m->data = d;
        break;
    }
    case WT_FP8_BLOCK: {
        m->w.block_rows = 128;
        m->w.block_cols = 128;
        int64_t nbr = (rows + 127) / 128, nbc = (cols + 127) / 128;
        uint8_t *d = malloc(n);
        for (size_t i = 0; i < n; i++) {
            uint8_t b = (uint8_t)rng_next(&s);
            d[i] = (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b; /* no NaN codes */
        }
        float *sc = malloc((size_t)(nbr * nbc) * 4);
        for (int64_t i = 0; i < nbr * nbc; i++) sc[i] = ldexpf(1.0f + 0.5f * frand(&s), -8);
        m->data = d;
        m->scale = sc;
        break;
    }
    case WT_I8_ROW: { /* the int8 spine: q in [-127, 127], an f32 scale per row */
        int8_t *d = malloc(n);
        for (size_t i = 0; i < n; i++) d[i] = (int8_t)((int)(rng_next(&s) % 255) - 127);
        float *sc = malloc((size_t)rows * 4);
        for (int64_t i = 0; i < rows; i++) sc[i] = ldexpf(1.0f + 0.5f * frand(&s), -7);
        m->data = d;
        m->scale = sc;
        break;
    }
    case WT_INT4_G32:
    case WT_MXFP4: {
        uint8_t *d = malloc(n / 2);
        for (size_t i = 0; i < n / 2; i++) d[i] = (uint8_t)rng_next(&s);
        size_t ns = (size_t)(rows * (cols / 32));
        m->data = d;
        if (t == WT_MXFP4) {
            uint8_t *sc = malloc(ns);
            for (size_t i = 0; i < ns; i++) sc[i] = (uint8_t)(118 + rng_next(&s) % 12);
            m->scale = sc;
        } else {
            m->w.scale_dtype = sdt;
            if (sdt == DT_F32) {
                float *sc = malloc(ns * 4);
                for (size_t i = 0; i < ns; i++) sc[i] = 0.01f + 0.05f * (frand(&s) + 1.0f);
                m->scale = sc;
            } else {
                uint16_t *sc = malloc(ns * 2);
                for (size_t i = 0; i < ns; i++) {
                    float v = 0.01f + 0.05f * (frand(&s) + 1.0f);
                    sc[i] = sdt == DT_BF16 ? (uint16_t)(f32_bits(v) >> 16) : f16_bits(v);
                }
                m->scale = sc;
            }
        }
        break;
    }
    default: break;
    }
    m->w.data = m->data;
    m->w.scale = m->scale;
}

/* ---- matvec / matmul ---------------------------------------------------------- */

enum { NMAX = 64 };

/* The product under test: gpu_matmul, or gpu_matmul_tc when ws is set. */
static df_status mm(gpu_ws *ws, const gpu_weight *g, const float *dX, int n, float *dY, int64_t ldy,
                    int64_t r0, int64_t r1) {
    return ws ? gpu_matmul_tc(g, dX, n, dY, ldy, r0, r1, ws, NULL) : gpu_matmul(g, dX, n, dY, ldy, r0, r1, NULL);
}

/* tc: 0 gpu_matmul, 1 gpu_matmul_tc, 2 gpu_matmul_tc on the fragment layout
 * (gpu_weight_upload_frag; its rows also bit-equal to 1's) */
static void check_kernel(wt_type t, st_dtype sdt, int64_t rows, int64_t cols, const char *tag, int tc) {
    if (!need_gpu()) return;
    gpu_ws wsv = {0}, *ws = tc ? &wsv : NULL;
    wsv.bf16_tc_rows = 1; /* bf16 on the tensor cores at every n (gpu_bf16_tc_takes shapes) */
    uint64_t s = seed_of(tag);
    hmat m;
    hmat_make(&m, t, rows, cols, sdt, s);
    const df_weight *w = &m.w;
    gpu_weight g;
    char err[DF_ERRMSG] = "";
    df_status st = tc == 2 ? gpu_weight_upload_frag(w, &g, err) : gpu_weight_upload(w, &g, err);
    REQUIRE(st == DF_OK, "upload: %s", err);
    if (tc == 2) REQUIRE(g.frag && !g.data && !g.scale, "%s: a fragment-layout weight holds only that", tag);

    float *deq = malloc((size_t)(rows * cols) * 4);
    float *X = malloc((size_t)(NMAX * cols) * 4);
    float *Y = malloc((size_t)(NMAX * rows) * 4), *Yv = malloc((size_t)(NMAX * rows) * 4);
    float *Ys = malloc((size_t)(NMAX * rows) * 4);
    float *dX = gpu_malloc((size_t)(NMAX * cols) * 4), *dY = gpu_malloc((size_t)(NMAX * rows) * 4);
    REQUIRE(deq && X && Y && Yv && Ys && dX && dY);
    for (int64_t r = 0; r < rows; r++) kn_dequant_row(w, r, deq + r * cols);
    for (int64_t i = 0; i < NMAX * cols; i++) X[i] = frand(&s);
    REQUIRE(gpu_put(dX, X, (size_t)(NMAX * cols) * 4) == DF_OK);

    /* reference matvec of every vector, one launch each */
    for (int i = 0; i < NMAX; i++) {
        REQUIRE(gpu_fill(dY, 0xff, (size_t)rows * 4) == DF_OK);
        REQUIRE(mm(ws, &g, dX + i * cols, 1, dY, rows, 0, rows) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Yv + i * rows, dY, (size_t)rows * 4) == DF_OK, "%s", gpu_last_error());
    }
    kn_matmul(KN_SCALAR, w, X, NMAX, Ys, rows, 0, rows);
    if (tc == 2) { /* the staged layout's bits, vector by vector and all at once */
        gpu_weight raw;
        REQUIRE(gpu_weight_upload(w, &raw, err) == DF_OK, "%s", err);
        for (int i = 0; i < NMAX; i++) {
            REQUIRE(mm(ws, &raw, dX + i * cols, 1, dY, rows, 0, rows) == DF_OK, "%s", gpu_last_error());
            REQUIRE(gpu_get(Y, dY, (size_t)rows * 4) == DF_OK);
            CHECK(memcmp(Y, Yv + i * rows, (size_t)rows * 4) == 0, "%s vec %d: fragment layout != staged", tag, i);
        }
        REQUIRE(mm(ws, &raw, dX, NMAX, dY, rows, 0, rows) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Y, dY, (size_t)(NMAX * rows) * 4) == DF_OK);
        CHECK(memcmp(Y, Yv, (size_t)(NMAX * rows) * 4) == 0, "%s: staged n=%d != fragment matvecs", tag, NMAX);
        gpu_weight_free(&raw);
    }

    double worst_exact = 0, worst_scalar = 0;
    int bad = 0;
    for (int i = 0; i < NMAX && bad < 5; i++)
        for (int64_t r = 0; r < rows && bad < 5; r++) {
            double ex = 0, mag = 0, wsum = 0, xmax = 0;
            for (int64_t c = 0; c < cols; c++) {
                double p = (double)deq[r * cols + c] * X[i * cols + c];
                ex += p;
                mag += fabs(p);
                wsum += fabs(deq[r * cols + c]);
                if (fabs(X[i * cols + c]) > xmax) xmax = fabs(X[i * cols + c]);
            }
            double bound = (double)(cols + 2) * 0x1p-24 * mag;
            if (tc) bound = (double)(cols + 64) * 0x1p-24 * mag + 0x1p-21 * mag + 0x1p-38 * xmax * wsum;
            double y = Yv[i * rows + r];
            double e1 = fabs(y - ex), e2 = fabs(y - Ys[i * rows + r]);
            if (!(e1 <= bound) || !(e2 <= 2 * bound)) {
                bad++;
                CHECK(0, "%s n=1 vec %d row %lld: gpu %.9g exact %.9g scalar %.9g bound %.3g", tag, i,
                      (long long)r, y, ex, Ys[i * rows + r], bound);
            }
            if (bound > 0) {
                if (e1 / bound > worst_exact) worst_exact = e1 / bound;
                if (e2 / bound > worst_scalar) worst_scalar = e2 / bound;
            }
        }

    /* matmul for several n: bit-equal to the per-vector matvec */
    static const int ns[] = {2, 3, 4, 5, 8, 17, 64};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        int n = ns[k];
        REQUIRE(gpu_fill(dY, 0xff, (size_t)(n * rows) * 4) == DF_OK);
        REQUIRE(mm(ws, &g, dX, n, dY, rows, 0, rows) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Y, dY, (size_t)(n * rows) * 4) == DF_OK, "%s", gpu_last_error());
        CHECK(memcmp(Y, Yv, (size_t)(n * rows) * 4) == 0, "%s: matmul n=%d differs from matvec", tag, n);
    }
    /* a sub-range of rows with a wider ldy (n = 17: the many-vector blocks, whose rows start mid-block) */
    for (int n = 3; n <= 17; n += 14) {
        int64_t r0 = rows / 7, r1 = rows - rows / 5, ldy = rows + 3;
        REQUIRE(gpu_fill(dY, 0xff, (size_t)(n * ldy) * 4) == DF_OK);
        REQUIRE(mm(ws, &g, dX, n, dY, ldy, r0, r1) == DF_OK);
        REQUIRE(gpu_get(Y, dY, (size_t)(n * ldy) * 4) == DF_OK);
        for (int i = 0; i < n; i++)
            CHECK(memcmp(Y + i * ldy, Yv + i * rows + r0, (size_t)(r1 - r0) * 4) == 0,
                  "%s: n=%d rows [%lld,%lld) vec %d differ from the full range", tag, n, (long long)r0, (long long)r1,
                  i);
    }
    /* one-hot vectors decode the weights exactly */
    {
        int n = NMAX;
        int cidx[NMAX];
        memset(X, 0, (size_t)(n * cols) * 4);
        for (int i = 0; i < n; i++) {
            int64_t c = i == 0 ? 0 : i == 1 ? cols - 1 : i == 2 ? 31 % cols : (int64_t)(rng_next(&s) % (uint64_t)cols);
            cidx[i] = (int)c;
            X[i * cols + c] = 1.0f;
        }
        REQUIRE(gpu_put(dX, X, (size_t)(n * cols) * 4) == DF_OK);
        REQUIRE(gpu_fill(dY, 0xff, (size_t)(n * rows) * 4) == DF_OK);
        REQUIRE(mm(ws, &g, dX, n, dY, rows, 0, rows) == DF_OK);
        REQUIRE(gpu_get(Y, dY, (size_t)(n * rows) * 4) == DF_OK);
        int wrong = 0;
        for (int i = 0; i < n; i++)
            for (int64_t r = 0; r < rows; r++) {
                float a = Y[i * rows + r], b = deq[r * cols + cidx[i]];
                if (f32_bits(a) != f32_bits(b) && !(a == 0 && b == 0) && wrong++ < 3)
                    CHECK(0, "%s one-hot col %d row %lld: gpu %a, dequant %a", tag, cidx[i], (long long)r, a, b);
            }
        CHECK(wrong == 0, "%s: %d one-hot mismatches", tag, wrong);
    }
    fprintf(stderr, "[%s %lldx%lld: worst error %.3f of the bound vs exact, %.3f vs scalar] ", tag,
            (long long)rows, (long long)cols, worst_exact, worst_scalar);
    gpu_free(dX);
    gpu_free(dY);
    free(deq); free(X); free(Y); free(Yv); free(Ys);
    gpu_weight_free(&g);
    gpu_ws_free(ws);
    hmat_free(&m);
}

static void check_type(wt_type t, st_dtype sdt, int64_t rows, int64_t cols, const char *tag) {
    check_kernel(t, sdt, rows, cols, tag, 0);
}

TEST(cuda_matvec_bf16) { check_type(WT_BF16, DT_UNKNOWN, 301, 1000, "bf16"); }
TEST(cuda_matvec_fp8_block) { check_type(WT_FP8_BLOCK, DT_UNKNOWN, 300, 2064, "fp8"); }
TEST(cuda_matvec_int4_bf16) { check_type(WT_INT4_G32, DT_BF16, 259, 2144, "int4-bf16"); }
TEST(cuda_matvec_int4_f16) { check_type(WT_INT4_G32, DT_F16, 130, 1024, "int4-f16"); }
TEST(cuda_matvec_int4_f32) { check_type(WT_INT4_G32, DT_F32, 77, 7168, "int4-f32"); }
TEST(cuda_matvec_mxfp4) { check_type(WT_MXFP4, DT_UNKNOWN, 263, 2144, "mxfp4"); }
TEST(cuda_matvec_i8) { check_type(WT_I8_ROW, DT_UNKNOWN, 301, 1008, "i8-row"); }
TEST(cuda_matvec_i8_wide) { check_type(WT_I8_ROW, DT_UNKNOWN, 67, 7168, "i8-row-7168"); }
TEST(cuda_matvec_tall_i8) { check_type(WT_I8_ROW, DT_UNKNOWN, 16411, 64, "i8-row-tall"); }
TEST(cuda_matvec_mxfp4_wide) { check_type(WT_MXFP4, DT_UNKNOWN, 67, 7168, "mxfp4-7168"); }
/* row counts that are not a multiple of the rows-per-warp of the n = 1 path */
/* few rows, long rows: the split products (gpu.cu split_rows) */
TEST(cuda_matvec_split_bf16) { check_type(WT_BF16, DT_UNKNOWN, 97, 4096, "bf16-split"); }
TEST(cuda_matvec_split_fp8) { check_type(WT_FP8_BLOCK, DT_UNKNOWN, 130, 4096, "fp8-split"); }
TEST(cuda_matvec_split_int4) { check_type(WT_INT4_G32, DT_BF16, 40, 8192, "int4-split"); }
TEST(cuda_matvec_split_mxfp4) { check_type(WT_MXFP4, DT_UNKNOWN, 33, 8224, "mxfp4-split"); }
TEST(cuda_matvec_tall_bf16) { check_type(WT_BF16, DT_UNKNOWN, 16411, 64, "bf16-tall"); }
TEST(cuda_matvec_tall_fp8) { check_type(WT_FP8_BLOCK, DT_UNKNOWN, 16395, 160, "fp8-tall"); }
TEST(cuda_matvec_tall_int4) { check_type(WT_INT4_G32, DT_BF16, 16397, 96, "int4-tall"); }
TEST(cuda_matvec_tall_mxfp4) { check_type(WT_MXFP4, DT_UNKNOWN, 16389, 128, "mxfp4-tall"); }

/* the tensor-core MXFP4 path: same checks, its own bound (gpu.h) */
TEST(cuda_tc_mxfp4) { check_kernel(WT_MXFP4, DT_UNKNOWN, 263, 2144, "tc-mxfp4", 1); }
TEST(cuda_tc_mxfp4_wide) { check_kernel(WT_MXFP4, DT_UNKNOWN, 67, 7168, "tc-mxfp4-7168", 1); }
TEST(cuda_tc_mxfp4_tall) { check_kernel(WT_MXFP4, DT_UNKNOWN, 16389, 128, "tc-mxfp4-tall", 1); }
TEST(cuda_tc_mxfp4_narrow) { check_kernel(WT_MXFP4, DT_UNKNOWN, 40, 32, "tc-mxfp4-32", 1); }
/* other types pass through gpu_matmul_tc to gpu_matmul unchanged */
TEST(cuda_frag_mxfp4) { check_kernel(WT_MXFP4, DT_UNKNOWN, 263, 2144, "frag-mxfp4", 2); }
TEST(cuda_frag_mxfp4_wide) { check_kernel(WT_MXFP4, DT_UNKNOWN, 67, 7168, "frag-mxfp4-7168", 2); }
TEST(cuda_frag_mxfp4_tall) { check_kernel(WT_MXFP4, DT_UNKNOWN, 16389, 128, "frag-mxfp4-tall", 2); }
TEST(cuda_frag_mxfp4_narrow) { check_kernel(WT_MXFP4, DT_UNKNOWN, 40, 32, "frag-mxfp4-32", 2); }
TEST(cuda_frag_mxfp4_odd_blocks) { check_kernel(WT_MXFP4, DT_UNKNOWN, 45, 160, "frag-mxfp4-160", 2); }
TEST(cuda_tc_passthrough_bf16) { check_kernel(WT_BF16, DT_UNKNOWN, 301, 1000, "tc-bf16", 1); }
/* bf16 with cols % 64 == 0 on the tensor cores (gpu_bf16_tc.cu): the one-
 * vector kernel for n <= 8, the tiled one above (n = 17, 64), several
 * slices per row (few rows), one chunk per row (tall) */
TEST(cuda_tc_bf16) {
    if (!need_gpu()) return;
    gpu_weight probe = {.type = WT_BF16, .rows = 1, .cols = 1024, .data = (void *)(uintptr_t)256};
    CHECK(gpu_bf16_tc_takes(&probe), "1024 columns should take the bf16 tensor-core path");
    probe.cols = 1000;
    CHECK(!gpu_bf16_tc_takes(&probe), "1000 columns should not");
    check_kernel(WT_BF16, DT_UNKNOWN, 301, 1024, "tc-bf16-1024", 1);
}
TEST(cuda_tc_bf16_split) { check_kernel(WT_BF16, DT_UNKNOWN, 97, 4096, "tc-bf16-split", 1); }
TEST(cuda_tc_bf16_wide) { check_kernel(WT_BF16, DT_UNKNOWN, 67, 7168, "tc-bf16-7168", 1); }
TEST(cuda_tc_bf16_tall) { check_kernel(WT_BF16, DT_UNKNOWN, 16411, 64, "tc-bf16-tall", 1); }

/* Many vectors (several 64-vector tiles of the tiled kernel, a row range
 * that starts mid-tile): each bit-equal to its vector alone; x spanning
 * 1e-30 .. 1e4 within the bound. */
TEST(cuda_tc_bf16_many) {
    if (!need_gpu()) return;
    enum { R = 203, C = 1536, N = 150 };
    uint64_t s = seed_of("tc-bf16-many");
    hmat m;
    hmat_make(&m, WT_BF16, R, C, DT_UNKNOWN, s);
    gpu_weight g;
    char err[DF_ERRMSG] = "";
    REQUIRE(gpu_weight_upload(&m.w, &g, err) == DF_OK, "%s", err);
    float *X = malloc((size_t)N * C * 4), *Y = malloc((size_t)N * R * 4), *Y1 = malloc((size_t)N * R * 4);
    float *deq = malloc((size_t)R * C * 4);
    REQUIRE(X && Y && Y1 && deq);
    for (int64_t r = 0; r < R; r++) kn_dequant_row(&m.w, r, deq + r * C);
    for (int64_t i = 0; i < (int64_t)N * C; i++) {
        double e = (double)(rng_next(&s) % 35) - 30.0;
        X[i] = i % 13 == 0 ? 0.0f : (float)(frand(&s) * pow(10.0, e));
    }
    float *dX = gpu_malloc((size_t)N * C * 4), *dY = gpu_malloc((size_t)N * R * 4);
    gpu_ws ws = {0};
    ws.bf16_tc_rows = 1;
    REQUIRE(dX && dY && gpu_put(dX, X, (size_t)N * C * 4) == DF_OK);
    for (int i = 0; i < N; i++)
        REQUIRE(gpu_matmul_tc(&g, dX + (int64_t)i * C, 1, dY + (int64_t)i * R, R, 0, R, &ws, NULL) == DF_OK, "%s",
                gpu_last_error());
    REQUIRE(gpu_get(Y1, dY, (size_t)N * R * 4) == DF_OK);
    REQUIRE(gpu_fill(dY, 0xff, (size_t)N * R * 4) == DF_OK);
    const int64_t r0 = 37, r1 = R - 5;
    REQUIRE(gpu_matmul_tc(&g, dX, N, dY, R, r0, r1, &ws, NULL) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(Y, dY, (size_t)N * R * 4) == DF_OK);
    int diff = 0;
    double worst = 0;
    for (int i = 0; i < N; i++)
        for (int64_t r = r0; r < r1; r++) {
            if (f32_bits(Y[(int64_t)i * R + r - r0]) != f32_bits(Y1[(int64_t)i * R + r]) && diff++ < 3)
                CHECK(0, "vec %d row %lld: n=%d %a, alone %a", i, (long long)r, N, Y[(int64_t)i * R + r - r0],
                      Y1[(int64_t)i * R + r]);
            double ex = 0, mag = 0;
            for (int64_t c = 0; c < C; c++) {
                double p = (double)deq[r * C + c] * X[(int64_t)i * C + c];
                ex += p;
                mag += fabs(p);
            }
            const double bound = (double)(C + 64) * 0x1p-24 * mag + 0x1p-21 * mag + 0x1p-140;
            const double e = fabs(Y1[(int64_t)i * R + r] - ex);
            if (!(e <= bound) && diff++ < 3)
                CHECK(0, "vec %d row %lld: %.9g vs exact %.9g", i, (long long)r, Y1[(int64_t)i * R + r], ex);
            if (bound > 0 && e / bound > worst) worst = e / bound;
        }
    CHECK(diff == 0, "%d outputs differ", diff);
    /* bf16_tc_rows 9: n = 8 on the CUDA cores (gpu_matmul's bits), n = 9 on the tensor cores */
    gpu_ws w9 = {0};
    w9.bf16_tc_rows = 9;
    float *Yc = malloc((size_t)9 * R * 4);
    REQUIRE(Yc);
    for (int n = 8; n <= 9; n++) {
        REQUIRE(gpu_matmul_tc(&g, dX, n, dY, R, 0, R, &w9, NULL) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Y, dY, (size_t)n * R * 4) == DF_OK);
        if (n == 8) REQUIRE(gpu_matmul(&g, dX, n, dY, R, 0, R, NULL) == DF_OK);
        REQUIRE(gpu_get(Yc, dY, (size_t)n * R * 4) == DF_OK);
        const float *want = n == 8 ? Yc : Y1;
        CHECK(memcmp(Y, want, (size_t)n * R * 4) == 0, "bf16_tc_rows 9, n = %d: not the %s bits", n,
              n == 8 ? "CUDA cores'" : "tensor cores'");
    }
    gpu_ws_free(&w9);
    free(Yc);
    fprintf(stderr, "[worst %.3f of the bound] ", worst);
    gpu_free(dX); gpu_free(dY);
    gpu_ws_free(&ws);
    gpu_weight_free(&g);
    hmat_free(&m);
    free(X); free(Y); free(Y1); free(deq);
}

/* Every block shape of the tiled bf16 kernel gives the same bits. On an
 * H200 (132 SMs) the shape model picks 128 x 128 blocks for n = 256 over
 * 8411 rows, 64 x 64 for a 1000-row range of it and for n = 70 and 40,
 * 64 x 32 for n = 20; each vector alone takes the one-vector kernel. Then
 * gate + up (a bf16 expert, gpu_experts) at n = 130 against its vectors
 * alone. */
TEST(cuda_tc_bf16_block_shapes) {
    if (!need_gpu()) return;
    enum { R = 8411, C = 256, N = 256 };
    uint64_t s = seed_of("tc-bf16-shapes");
    hmat m;
    hmat_make(&m, WT_BF16, R, C, DT_UNKNOWN, s);
    gpu_weight g;
    char err[DF_ERRMSG] = "";
    REQUIRE(gpu_weight_upload(&m.w, &g, err) == DF_OK, "%s", err);
    float *X = malloc((size_t)N * C * 4), *Y = malloc((size_t)N * R * 4), *Z = malloc((size_t)N * R * 4);
    REQUIRE(X && Y && Z);
    for (int64_t i = 0; i < (int64_t)N * C; i++) X[i] = 4.0f * frand(&s) - 2.0f;
    float *dX = gpu_malloc((size_t)N * C * 4), *dY = gpu_malloc((size_t)N * R * 4);
    REQUIRE(dX && dY && gpu_put(dX, X, (size_t)N * C * 4) == DF_OK);
    gpu_ws ws = {0};
    ws.bf16_tc_rows = 1;
    REQUIRE(gpu_matmul_tc(&g, dX, N, dY, R, 0, R, &ws, NULL) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(Y, dY, (size_t)N * R * 4) == DF_OK);
    struct { int n; int64_t r0, r1; const char *what; } runs[] = {
        {N, 37, 1037, "a 1000-row range"}, {70, 0, R, "n = 70"}, {40, 0, R, "n = 40"}, {20, 0, R, "n = 20"}};
    for (int k = 0; k < 4; k++) {
        const int64_t span = runs[k].r1 - runs[k].r0;
        REQUIRE(gpu_fill(dY, 0xff, (size_t)N * R * 4) == DF_OK);
        REQUIRE(gpu_matmul_tc(&g, dX, runs[k].n, dY, span, runs[k].r0, runs[k].r1, &ws, NULL) == DF_OK, "%s",
                gpu_last_error());
        REQUIRE(gpu_get(Z, dY, (size_t)runs[k].n * span * 4) == DF_OK);
        int diff = 0;
        for (int i = 0; i < runs[k].n; i++)
            for (int64_t r = 0; r < span; r++)
                diff += f32_bits(Z[i * span + r]) != f32_bits(Y[(int64_t)i * R + runs[k].r0 + r]);
        CHECK(diff == 0, "%s: %d outputs differ from n = %d over all rows", runs[k].what, diff, N);
    }
    const int alone[] = {0, 63, 64, 129, 255};
    for (int k = 0; k < 5; k++) {
        const int i = alone[k];
        REQUIRE(gpu_matmul_tc(&g, dX + (int64_t)i * C, 1, dY, R, 0, R, &ws, NULL) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Z, dY, (size_t)R * 4) == DF_OK);
        CHECK(memcmp(Z, Y + (int64_t)i * R, (size_t)R * 4) == 0, "vector %d alone differs from its row of n = %d", i, N);
    }
    /* within the bound, a few rows */
    for (int64_t r = 0; r < R; r += 997) {
        float w[C];
        kn_dequant_row(&m.w, r, w);
        for (int i = 0; i < N; i += 43) {
            double ex = 0, mag = 0;
            for (int c = 0; c < C; c++) {
                ex += (double)w[c] * X[(int64_t)i * C + c];
                mag += fabs((double)w[c] * X[(int64_t)i * C + c]);
            }
            const double bound = (double)(C + 64) * 0x1p-24 * mag + 0x1p-21 * mag;
            CHECK(fabs(Y[(int64_t)i * R + r] - ex) <= bound, "row %lld vector %d: %.9g vs exact %.9g", (long long)r, i,
                  Y[(int64_t)i * R + r], ex);
        }
    }
    gpu_free(dY);
    gpu_weight_free(&g);
    hmat_free(&m);
    /* gate + up (+ down) of a bf16 expert at n = 130, then each vector alone */
    enum { HID = 256, I = 384 };
    hmat e[3];
    gpu_weight ge[3];
    hmat_make(&e[0], WT_BF16, I, HID, DT_UNKNOWN, s + 1);
    hmat_make(&e[1], WT_BF16, I, HID, DT_UNKNOWN, s + 2);
    hmat_make(&e[2], WT_BF16, HID, I, DT_UNKNOWN, s + 3);
    for (int k = 0; k < 3; k++) REQUIRE(gpu_weight_upload(&e[k].w, &ge[k], err) == DF_OK, "%s", err);
    float *dO = gpu_malloc((size_t)N * HID * 4);
    REQUIRE(dO);
    const gpu_act act = {1, 3.0f, 2.0f};
    gpu_expert_job job = {&ge[0], &ge[1], &ge[2], dX, 130, dO};
    REQUIRE(gpu_experts(&job, 1, &act, &ws, NULL) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(Y, dO, (size_t)130 * HID * 4) == DF_OK);
    for (int k = 0; k < 4; k++) {
        gpu_expert_job v1 = job;
        v1.X = dX + (size_t)alone[k] * C;
        v1.n = 1;
        REQUIRE(gpu_experts(&v1, 1, &act, &ws, NULL) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Z, dO, HID * 4) == DF_OK);
        CHECK(memcmp(Z, Y + (size_t)alone[k] * HID, HID * 4) == 0, "expert: vector %d alone differs from n = 130",
              alone[k]);
    }
    gpu_free(dO);
    for (int k = 0; k < 3; k++) {
        gpu_weight_free(&ge[k]);
        hmat_free(&e[k]);
    }
    gpu_free(dX);
    gpu_ws_free(&ws);
    free(X); free(Y); free(Z);
}

/* bench's tensor-core probe: a rate from mma.sync, and from wgmma exactly
 * where the wgmma blocks run (magnitudes only: 1 TFLOP/s to 100 PFLOP/s). */
TEST(cuda_tc_probe_rates) {
    if (!need_gpu()) return;
    double sync = -1, wg = -1;
    REQUIRE(gpu_tc_probe(NULL, &sync, &wg) == DF_OK, "%s", gpu_last_error());
    CHECK(sync > 1 && sync < 1e5, "mma.sync %.1f TFLOP/s", sync);
    gpu_ws on = {0};
    on.bf16_wg = 1;
    if (gpu_ws_wg(&on) > 0) CHECK(wg > 1 && wg < 1e5, "wgmma %.1f TFLOP/s", wg);
    else CHECK(wg == 0, "wgmma %.1f TFLOP/s without the wgmma blocks", wg);
}

/* The wgmma blocks (gpu_ws.bf16_wg = 1, Hopper only) against the mma.sync
 * blocks (-1), bit for bit: rows in several slices (1024 and 832 columns:
 * 4 and 3 slices, the last one shorter), tail rows and vectors, a row range,
 * each vector alone (the one-vector kernel), and a bf16 expert's gate + up
 * (the act after two products) and down. */
TEST(cuda_tc_bf16_wg) {
    if (!need_gpu()) return;
    gpu_ws on = {0}, off = {0};
    on.bf16_tc_rows = off.bf16_tc_rows = 1;
    on.bf16_wg = 1;
    off.bf16_wg = -1;
    if (gpu_ws_wg(&on) <= 0) SKIP("no wgmma blocks on this device or build (sm_90a only)");
    enum { R = 1000, N = 130, HID = 1024, I = 384 }; /* HID >= R: Y and Z hold the expert's outputs too */
    uint64_t s = seed_of("tc-bf16-wg");
    const int64_t cols[2] = {1024, 832};
    char err[DF_ERRMSG] = "";
    float *X = malloc((size_t)N * 1024 * 4), *Y = malloc((size_t)N * HID * 4), *Z = malloc((size_t)N * HID * 4);
    REQUIRE(X && Y && Z);
    for (int64_t i = 0; i < (int64_t)N * 1024; i++) X[i] = 4.0f * frand(&s) - 2.0f;
    float *dX = gpu_malloc((size_t)N * 1024 * 4), *dY = gpu_malloc((size_t)N * R * 4);
    REQUIRE(dX && dY && gpu_put(dX, X, (size_t)N * 1024 * 4) == DF_OK);
    for (int k = 0; k < 2; k++) {
        const int64_t C = cols[k];
        hmat m;
        hmat_make(&m, WT_BF16, R, C, DT_UNKNOWN, s + k);
        gpu_weight g;
        REQUIRE(gpu_weight_upload(&m.w, &g, err) == DF_OK, "%s", err);
        REQUIRE(gpu_matmul_tc(&g, dX, N, dY, R, 0, R, &off, NULL) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Y, dY, (size_t)N * R * 4) == DF_OK);
        REQUIRE(gpu_fill(dY, 0xff, (size_t)N * R * 4) == DF_OK);
        REQUIRE(gpu_matmul_tc(&g, dX, N, dY, R, 0, R, &on, NULL) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Z, dY, (size_t)N * R * 4) == DF_OK);
        int diff = 0;
        for (int64_t i = 0; i < (int64_t)N * R; i++) diff += f32_bits(Z[i]) != f32_bits(Y[i]);
        CHECK(diff == 0, "%lld columns: %d of %d outputs differ between the wgmma and mma.sync blocks",
              (long long)C, diff, N * R);
        /* rows 37 .. 900 of 70 vectors, Y rows at span */
        REQUIRE(gpu_fill(dY, 0xff, (size_t)N * R * 4) == DF_OK);
        REQUIRE(gpu_matmul_tc(&g, dX, 70, dY, 864, 37, 901, &on, NULL) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_get(Z, dY, (size_t)70 * 864 * 4) == DF_OK);
        diff = 0;
        for (int i = 0; i < 70; i++)
            for (int r = 0; r < 864; r++) diff += f32_bits(Z[i * 864 + r]) != f32_bits(Y[(int64_t)i * R + 37 + r]);
        CHECK(diff == 0, "%lld columns, rows 37 .. 900: %d outputs differ", (long long)C, diff);
        const int alone[] = {0, 63, 64, 129};
        for (int a = 0; a < 4; a++) {
            REQUIRE(gpu_matmul_tc(&g, dX + (int64_t)alone[a] * C, 1, dY, R, 0, R, &on, NULL) == DF_OK, "%s",
                    gpu_last_error());
            REQUIRE(gpu_get(Z, dY, (size_t)R * 4) == DF_OK);
            CHECK(memcmp(Z, Y + (int64_t)alone[a] * R, (size_t)R * 4) == 0, "%lld columns: vector %d alone differs",
                  (long long)C, alone[a]);
        }
        gpu_weight_free(&g);
        hmat_free(&m);
    }
    hmat e[3];
    gpu_weight ge[3];
    hmat_make(&e[0], WT_BF16, I, HID, DT_UNKNOWN, s + 5);
    hmat_make(&e[1], WT_BF16, I, HID, DT_UNKNOWN, s + 6);
    hmat_make(&e[2], WT_BF16, HID, I, DT_UNKNOWN, s + 7);
    for (int k = 0; k < 3; k++) REQUIRE(gpu_weight_upload(&e[k].w, &ge[k], err) == DF_OK, "%s", err);
    float *dO = gpu_malloc((size_t)N * HID * 4);
    REQUIRE(dO);
    const gpu_act act = {1, 3.0f, 2.0f};
    gpu_expert_job job = {&ge[0], &ge[1], &ge[2], dX, N, dO};
    REQUIRE(gpu_experts(&job, 1, &act, &off, NULL) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(Y, dO, (size_t)N * HID * 4) == DF_OK);
    REQUIRE(gpu_fill(dO, 0xff, (size_t)N * HID * 4) == DF_OK);
    REQUIRE(gpu_experts(&job, 1, &act, &on, NULL) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(Z, dO, (size_t)N * HID * 4) == DF_OK);
    CHECK(memcmp(Z, Y, (size_t)N * HID * 4) == 0, "expert gate + up + down: the wgmma blocks differ");
    gpu_free(dO);
    for (int k = 0; k < 3; k++) {
        gpu_weight_free(&ge[k]);
        hmat_free(&e[k]);
    }
    gpu_free(dX);
    gpu_free(dY);
    gpu_ws_free(&on);
    gpu_ws_free(&off);
    free(X); free(Y); free(Z);
}

/* x with a huge dynamic range (1e-30 .. 1e4, and exact zeros): the split's
 * per-vector scale keeps the tensor-core path within its bound. */
TEST(cuda_tc_mxfp4_range) {
    if (!need_gpu()) return;
    enum { R = 97, C = 4096 };
    uint64_t s = seed_of("tc-range");
    hmat m;
    hmat_make(&m, WT_MXFP4, R, C, DT_UNKNOWN, s);
    gpu_weight g;
    char err[DF_ERRMSG] = "";
    REQUIRE(gpu_weight_upload(&m.w, &g, err) == DF_OK, "%s", err);
    static float x[C], deq[C], y[R];
    for (int c = 0; c < C; c++) {
        double e = (double)(rng_next(&s) % 34) - 30.0; /* 1e-30 .. 1e3 */
        x[c] = c % 17 == 0 ? 0.0f : (float)(frand(&s) * pow(10.0, e));
    }
    x[5] = 12345.0f;
    float *dX = gpu_malloc(sizeof x), *dY = gpu_malloc(sizeof y);
    gpu_ws ws = {0};
    REQUIRE(dX && dY && gpu_put(dX, x, sizeof x) == DF_OK);
    REQUIRE(gpu_matmul_tc(&g, dX, 1, dY, R, 0, R, &ws, NULL) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(y, dY, sizeof y) == DF_OK);
    double worst = 0;
    for (int r = 0; r < R; r++) {
        kn_dequant_row(&m.w, r, deq);
        double ex = 0, mag = 0, wsum = 0;
        for (int c = 0; c < C; c++) {
            ex += (double)deq[c] * x[c];
            mag += fabs((double)deq[c] * x[c]);
            wsum += fabs(deq[c]);
        }
        double bound = (C + 64) * 0x1p-24 * mag + 0x1p-21 * mag + 0x1p-38 * 12345.0 * wsum;
        CHECK(fabs(y[r] - ex) <= bound, "row %d: tc %.9g exact %.9g bound %.3g", r, y[r], ex, bound);
        if (bound > 0 && fabs(y[r] - ex) / bound > worst) worst = fabs(y[r] - ex) / bound;
    }
    fprintf(stderr, "[worst %.3f of the bound] ", worst);
    gpu_ws_free(&ws);
    gpu_free(dX);
    gpu_free(dY);
    gpu_weight_free(&g);
    hmat_free(&m);
}

/* e8m0 edges (2^-127, 2^-126, 2^0, 2^127) and every e2m1 code, one-hot
 * decoded; then a NaN scale (255) makes its whole row NaN, as kn_matvec.
 * Both the CUDA-core and the tensor-core paths. */
static void check_edge_scales(int tc, int C) { /* tc as check_kernel's; C 64 or 128 */
    if (!need_gpu()) return;
    gpu_ws wsv = {0}, *ws = tc ? &wsv : NULL;
    df_status (*upload)(const df_weight *, gpu_weight *, char *) = tc == 2 ? gpu_weight_upload_frag : gpu_weight_upload;
    enum { R = 4, CMAX = 128 };
    uint8_t data[R * CMAX / 2], sc[R * CMAX / 32];
    for (int i = 0; i < R * C / 2; i++) data[i] = (uint8_t)(i * 37 + 11);
    static const uint8_t edge[] = {0, 127, 254, 1, 128, 200, 60, 2};
    for (int i = 0; i < R * C / 32; i++) sc[i] = edge[i % 8];
    df_weight w = {.type = WT_MXFP4, .rows = R, .cols = C, .data = data, .scale = sc};
    gpu_weight g;
    char err[DF_ERRMSG] = "";
    REQUIRE(upload(&w, &g, err) == DF_OK, "%s", err);
    static float X[CMAX * CMAX], Y[CMAX * R];
    float deq[CMAX];
    memset(X, 0, sizeof X);
    for (int i = 0; i < C; i++) X[i * C + i] = 1.0f;
    float *dX = gpu_malloc(sizeof X), *dY = gpu_malloc(sizeof Y);
    REQUIRE(dX && dY);
    REQUIRE(gpu_put(dX, X, sizeof X) == DF_OK);
    REQUIRE(mm(ws, &g, dX, C, dY, R, 0, R) == DF_OK);
    REQUIRE(gpu_get(Y, dY, sizeof Y) == DF_OK);
    for (int r = 0; r < R; r++) {
        kn_dequant_row(&w, r, deq);
        for (int c = 0; c < C; c++) {
            float a = Y[c * R + r], b = deq[c];
            int same = f32_bits(a) == f32_bits(b) || (a == 0 && b == 0);
            CHECK(same, "row %d col %d scale %d: gpu %a dequant %a", r, c, sc[r * (C / 32) + c / 32], a, b);
        }
    }
    /* NaN scale in row 1 */
    gpu_weight_free(&g);
    sc[C / 32] = 255; /* row 1, block 0 */
    REQUIRE(upload(&w, &g, err) == DF_OK, "%s", err);
    float x[CMAX], ys[R];
    for (int c = 0; c < C; c++) x[c] = 0.25f * (float)(c % 7) - 0.5f;
    REQUIRE(gpu_put(dX, x, (size_t)C * sizeof(float)) == DF_OK);
    REQUIRE(mm(ws, &g, dX, 1, dY, R, 0, R) == DF_OK);
    REQUIRE(gpu_get(Y, dY, R * sizeof(float)) == DF_OK);
    kn_matvec(KN_SCALAR, &w, x, ys, 0, R);
    for (int r = 0; r < R; r++)
        CHECK(isnan(Y[r]) == isnan(ys[r]) && (r == 1) == !!isnan(Y[r]), "row %d: gpu %g scalar %g", r, Y[r], ys[r]);
    gpu_free(dX);
    gpu_free(dY);
    gpu_weight_free(&g);
    gpu_ws_free(ws);
}
/* 128 columns: four blocks a row, so the tensor-core kernels take a row's
 * scales as one word, and rows of one tile differ in whether a 0 or 255
 * byte is among them (a warp must not split around its mma there) */
TEST(cuda_mxfp4_edge_scales) { check_edge_scales(0, 64); check_edge_scales(0, 128); }
TEST(cuda_tc_mxfp4_edge_scales) { check_edge_scales(1, 64); check_edge_scales(1, 128); }
TEST(cuda_frag_mxfp4_edge_scales) { check_edge_scales(2, 64); check_edge_scales(2, 128); }

/* The fragment layout's contract: refills through a stage, sizes, and the
 * CUDA-core entry points refusing it (they read data + scale). */
TEST(cuda_frag_refill_refused) {
    if (!need_gpu()) return;
    hmat a, b, c;
    hmat_make(&a, WT_MXFP4, 50, 288, DT_UNKNOWN, seed_of("frag-refill-a"));
    hmat_make(&b, WT_MXFP4, 50, 288, DT_UNKNOWN, seed_of("frag-refill-b"));
    hmat_make(&c, WT_MXFP4, 48, 288, DT_UNKNOWN, seed_of("frag-refill-c"));
    gpu_weight ga, gb, graw;
    char err[DF_ERRMSG] = "";
    REQUIRE(gpu_weight_upload_frag(&a.w, &ga, err) == DF_OK && gpu_weight_upload_frag(&b.w, &gb, err) == DF_OK &&
                gpu_weight_upload(&a.w, &graw, err) == DF_OK,
            "%s", err);
    CHECK(ga.data_bytes == gpu_mx_frag_bytes(50, 288) && ga.scale_bytes == 0);
    CHECK(gpu_weight_fits(&b.w, &ga) && !gpu_weight_fits(&c.w, &ga), "fits: same shape only");
    CHECK(gpu_weight_fits(&a.w, &graw) && gpu_weight_fits(&a.w, &gb), "raw fits raw, fragment fits fragment");
    CHECK(gpu_weight_refill_async(&b.w, &ga, NULL, err) == DF_ERR_ARG && strstr(err, "stage"), "%s", err);
    void *stage = gpu_malloc((size_t)gpu_mx_frag_stage_bytes(&b.w));
    REQUIRE(stage);
    CHECK(gpu_weight_refill_frag_async(&c.w, &ga, stage, NULL, err) == DF_ERR_ARG, "another shape refused");
    CHECK(gpu_weight_refill_frag_async(&b.w, &graw, stage, NULL, err) == DF_ERR_ARG, "a raw weight refused");
    REQUIRE(gpu_weight_refill_frag_async(&b.w, &ga, stage, NULL, err) == DF_OK, "%s", err);
    static float x[288], y1[50], y2[50];
    uint64_t s = seed_of("frag-refill-x");
    for (int i = 0; i < 288; i++) x[i] = frand(&s);
    float *dX = gpu_malloc(sizeof x), *dY = gpu_malloc(2 * sizeof y1), *dH = gpu_malloc(50 * 4);
    REQUIRE(dX && dY && dH && gpu_put(dX, x, sizeof x) == DF_OK);
    gpu_ws ws = {0};
    REQUIRE(gpu_matmul_tc(&ga, dX, 1, dY, 50, 0, 50, &ws, NULL) == DF_OK && gpu_matmul_tc(&gb, dX, 1, dY + 50, 50, 0, 50, &ws, NULL) == DF_OK);
    REQUIRE(gpu_get(y1, dY, sizeof y1) == DF_OK && gpu_get(y2, dY + 50, sizeof y2) == DF_OK);
    CHECK(memcmp(y1, y2, sizeof y1) == 0, "refilled fragment copy differs from a fresh upload");
    CHECK(gpu_matmul(&ga, dX, 1, dY, 50, 0, 50, NULL) == DF_ERR_UNSUPPORTED, "gpu_matmul refuses the fragment layout");
    CHECK(gpu_matvec(&ga, dX, dY, NULL) == DF_ERR_UNSUPPORTED);
    const gpu_act act = {0, 0, 0};
    CHECK(gpu_expert(&ga, &ga, &ga, &act, dX, 1, dH, dY, NULL) == DF_ERR_UNSUPPORTED, "gpu_expert refuses it");
    df_weight bad = a.w;
    bad.cols = 48;
    gpu_weight gz;
    CHECK(gpu_weight_alloc_frag(&bad, &gz, err) == DF_ERR_UNSUPPORTED && !gz.frag, "%s", err);
    bad = a.w;
    bad.type = WT_INT4_G32;
    CHECK(!gpu_mx_frag_takes(&bad) && gpu_mx_frag_stage_bytes(&bad) == 0);
    gpu_ws_free(&ws);
    gpu_free(stage);
    gpu_free(dX);
    gpu_free(dY);
    gpu_free(dH);
    gpu_weight_free(&ga);
    gpu_weight_free(&gb);
    gpu_weight_free(&graw);
    hmat_free(&a);
    hmat_free(&b);
    hmat_free(&c);
}

/* A device copy refilled with another matrix of the same size computes
 * exactly what a fresh upload of that matrix does; other sizes are refused. */
TEST(cuda_weight_refill) {
    if (!need_gpu()) return;
    hmat a, b, c;
    hmat_make(&a, WT_MXFP4, 96, 256, DT_UNKNOWN, seed_of("refill-a"));
    hmat_make(&b, WT_MXFP4, 96, 256, DT_UNKNOWN, seed_of("refill-b"));
    hmat_make(&c, WT_MXFP4, 64, 256, DT_UNKNOWN, seed_of("refill-c"));
    gpu_weight ga, gb;
    char err[DF_ERRMSG] = "";
    REQUIRE(gpu_weight_upload(&a.w, &ga, err) == DF_OK && gpu_weight_upload(&b.w, &gb, err) == DF_OK, "%s", err);
    CHECK(gpu_weight_fits(&b.w, &ga) && !gpu_weight_fits(&c.w, &ga));
    CHECK(gpu_weight_refill(&c.w, &ga, err) == DF_ERR_ARG);
    REQUIRE(gpu_weight_refill(&b.w, &ga, err) == DF_OK, "%s", err);
    static float x[256], y1[96], y2[96];
    uint64_t s = seed_of("refill-x");
    for (int i = 0; i < 256; i++) x[i] = frand(&s);
    float *dX = gpu_malloc(sizeof x), *dY = gpu_malloc(2 * sizeof y1);
    REQUIRE(dX && dY && gpu_put(dX, x, sizeof x) == DF_OK);
    REQUIRE(gpu_matvec(&ga, dX, dY, NULL) == DF_OK && gpu_matvec(&gb, dX, dY + 96, NULL) == DF_OK);
    REQUIRE(gpu_get(y1, dY, sizeof y1) == DF_OK && gpu_get(y2, dY + 96, sizeof y2) == DF_OK);
    CHECK(memcmp(y1, y2, sizeof y1) == 0, "refilled copy differs from a fresh upload");
    gpu_free(dX);
    gpu_free(dY);
    gpu_weight_free(&ga);
    gpu_weight_free(&gb);
    hmat_free(&a);
    hmat_free(&b);
    hmat_free(&c);
}

TEST(cuda_weight_refused) {
    char err[DF_ERRMSG] = "";
    df_weight w = {.type = WT_F16, .rows = 4, .cols = 64};
    CHECK(gpu_weight_check(&w, err) == DF_ERR_UNSUPPORTED && strstr(err, "f16"), "%s", err);
    w.type = WT_MXFP4;
    w.cols = 48;
    CHECK(gpu_weight_check(&w, err) == DF_ERR_UNSUPPORTED, "%s", err);
    w.type = WT_BF16;
    w.cols = 12;
    CHECK(gpu_weight_check(&w, err) == DF_ERR_UNSUPPORTED, "%s", err);
    gpu_weight g;
    memset(&g, 0x5a, sizeof g);
    CHECK(gpu_weight_alloc(&w, &g, err) == DF_ERR_UNSUPPORTED && g.data == NULL,
          "a refused alloc leaves the view zeroed");
    gpu_weight_free(NULL);
}

/* ---- fused expert ------------------------------------------------------------- */

static void act_cpu(const gpu_act *a, float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) { /* ffn.c act_apply */
        if (!a->situ) { g[i] = op_silu(g[i]) * u[i]; continue; }
        float b = a->beta, lb = a->linear_beta;
        float s = b * tanhf(g[i] / b) * op_sigmoid(g[i]);
        float up = lb > 0 ? lb * tanhf(u[i] / lb) : u[i];
        g[i] = s * up;
    }
}

static void check_expert(wt_type t, st_dtype sdt, const char *tag) {
    if (!need_gpu()) return;
    enum { HID = 1024, INTER = 384, N = 9 };
    uint64_t s = seed_of(tag);
    hmat mg, mu, md;
    hmat_make(&mg, t, INTER, HID, sdt, s + 1);
    hmat_make(&mu, t, INTER, HID, sdt, s + 2);
    hmat_make(&md, t, HID, INTER, sdt, s + 3);
    gpu_weight gg, gu, gd;
    char err[DF_ERRMSG] = "";
    REQUIRE(gpu_weight_upload(&mg.w, &gg, err) == DF_OK, "%s", err);
    REQUIRE(gpu_weight_upload(&mu.w, &gu, err) == DF_OK, "%s", err);
    REQUIRE(gpu_weight_upload(&md.w, &gd, err) == DF_OK, "%s", err);
    static float X[N * HID], G[N * INTER], U[N * INTER], ref[N * HID], out[N * HID];
    for (int i = 0; i < N * HID; i++) X[i] = 2.0f * frand(&s);
    float *dX = gpu_malloc(sizeof X), *dH = gpu_malloc(sizeof G), *dO = gpu_malloc(sizeof out);
    REQUIRE(dX && dH && dO);
    REQUIRE(gpu_put(dX, X, sizeof X) == DF_OK);
    const gpu_act acts[2] = {{0, 0, 0}, {1, 3.0f, 2.0f}};
    static const int ns[] = {1, 3, N};
    double worst = 0;
    for (int a = 0; a < 2; a++)
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            int n = ns[k];
            kn_matmul(KN_SCALAR, &mg.w, X, n, G, INTER, 0, INTER);
            kn_matmul(KN_SCALAR, &mu.w, X, n, U, INTER, 0, INTER);
            act_cpu(&acts[a], G, U, (int64_t)n * INTER);
            kn_matmul(KN_SCALAR, &md.w, G, n, ref, HID, 0, HID);
            REQUIRE(gpu_fill(dO, 0xff, sizeof out) == DF_OK);
            REQUIRE(gpu_expert(&gg, &gu, &gd, &acts[a], dX, n, dH, dO, NULL) == DF_OK, "%s", gpu_last_error());
            REQUIRE(gpu_get(out, dO, sizeof out) == DF_OK, "%s", gpu_last_error());
            for (int i = 0; i < n; i++) {
                double d2 = 0, r2 = 0;
                for (int j = 0; j < HID; j++) {
                    double d = (double)out[i * HID + j] - ref[i * HID + j];
                    d2 += d * d;
                    r2 += (double)ref[i * HID + j] * ref[i * HID + j];
                }
                double rel = sqrt(d2 / r2);
                if (!(rel <= 1e-5))
                    CHECK(0, "%s %s n=%d token %d: relative error %.3g > 1e-5", tag,
                          acts[a].situ ? "situ" : "silu", n, i, rel);
                if (rel > worst) worst = rel;
            }
        }
    fprintf(stderr, "[%s: worst normwise relative error %.2e, bound 1e-5] ", tag, worst);
    gpu_free(dX); gpu_free(dH); gpu_free(dO);
    gpu_weight_free(&gg); gpu_weight_free(&gu); gpu_weight_free(&gd);
    hmat_free(&mg); hmat_free(&mu); hmat_free(&md);
}

/* gpu_expert over many vectors: each vector's output bit-equal to that
 * vector alone (the gate / up kernel holds several rows and vectors a warp
 * from n > 8), for split gates / ups (384 x 1024) of each type the CUDA
 * cores run and a plain one (bf16 104 x 512). */
TEST(cuda_expert_bits) {
    if (!need_gpu()) return;
    enum { N = 13, NC = 5 };
    static const struct { wt_type t; st_dtype sdt; int64_t hid, inter; } cs[NC] = {
        {WT_BF16, DT_UNKNOWN, 1024, 384}, {WT_BF16, DT_UNKNOWN, 512, 104}, {WT_FP8_BLOCK, DT_UNKNOWN, 1024, 384},
        {WT_INT4_G32, DT_BF16, 1024, 384}, {WT_I8_ROW, DT_UNKNOWN, 1024, 384}};
    const gpu_act acts[2] = {{0, 0, 0}, {1, 3.0f, 2.0f}};
    for (int k = 0; k < NC; k++) {
        const int64_t HID = cs[k].hid, INTER = cs[k].inter;
        uint64_t s = seed_of("expert-bits") + (uint64_t)k;
        hmat m[3];
        gpu_weight g[3];
        char err[DF_ERRMSG] = "";
        hmat_make(&m[0], cs[k].t, INTER, HID, cs[k].sdt, s + 1);
        hmat_make(&m[1], cs[k].t, INTER, HID, cs[k].sdt, s + 2);
        hmat_make(&m[2], cs[k].t, HID, INTER, cs[k].sdt, s + 3);
        for (int j = 0; j < 3; j++) REQUIRE(gpu_weight_upload(&m[j].w, &g[j], err) == DF_OK, "%s", err);
        float *X = malloc((size_t)N * HID * 4), *all = malloc((size_t)N * HID * 4), *one = malloc((size_t)HID * 4);
        REQUIRE(X && all && one);
        for (int64_t i = 0; i < N * HID; i++) X[i] = 2.0f * frand(&s) - 1.0f;
        float *dX = gpu_malloc((size_t)N * HID * 4), *dH = gpu_malloc((size_t)N * INTER * 4),
              *dO = gpu_malloc((size_t)N * HID * 4);
        REQUIRE(dX && dH && dO && gpu_put(dX, X, (size_t)N * HID * 4) == DF_OK);
        for (int a = 0; a < 2; a++) {
            REQUIRE(gpu_expert(&g[0], &g[1], &g[2], &acts[a], dX, N, dH, dO, NULL) == DF_OK, "%s", gpu_last_error());
            REQUIRE(gpu_get(all, dO, (size_t)N * HID * 4) == DF_OK);
            int diff = 0;
            for (int i = 0; i < N; i++) {
                REQUIRE(gpu_expert(&g[0], &g[1], &g[2], &acts[a], dX + i * HID, 1, dH, dO, NULL) == DF_OK, "%s",
                        gpu_last_error());
                REQUIRE(gpu_get(one, dO, (size_t)HID * 4) == DF_OK);
                diff += memcmp(one, all + i * HID, (size_t)HID * 4) != 0;
            }
            CHECK(diff == 0, "case %d, %lld x %lld, act %d: %d of %d vectors differ from the vector alone", k,
                  (long long)INTER, (long long)HID, a, diff, N);
        }
        gpu_free(dX); gpu_free(dH); gpu_free(dO);
        for (int j = 0; j < 3; j++) {
            gpu_weight_free(&g[j]);
            hmat_free(&m[j]);
        }
        free(X); free(all); free(one);
    }
}

TEST(cuda_expert_mxfp4) { check_expert(WT_MXFP4, DT_UNKNOWN, "expert-mxfp4"); }
TEST(cuda_expert_int4) { check_expert(WT_INT4_G32, DT_BF16, "expert-int4"); }
TEST(cuda_expert_fp8) { check_expert(WT_FP8_BLOCK, DT_UNKNOWN, "expert-fp8"); }
TEST(cuda_expert_bf16) { check_expert(WT_BF16, DT_UNKNOWN, "expert-bf16"); }

/* ---- expert batches (gpu_experts) --------------------------------------------- */

/* A layer-like batch: MXFP4 experts of two shapes, runs broken by an int4
 * expert, n from 1 to 9. Every output against the CPU (kn_matmul scalar +
 * the ffn.c activation, normwise 1e-5 as above), and bit-equal to the same
 * expert alone in a batch, to each of its vectors alone (n = 1), and (int4)
 * to gpu_expert. Two bf16 jobs (gpu_bf16_tc: n = 9 on the tiled kernel). */
TEST(cuda_experts_batch) {
    if (!need_gpu()) return;
    enum { HID = 512, NJ = 10, NMX = 9 };
    static const int inter_of[NJ] = {256, 256, 256, 256, 128, 128, 256, 256, 256, 128};
    static const int n_of[NJ] = {1, 3, 4, 9, 2, 1, 5, 4, 9, 2};
    static const wt_type type_of[NJ] = {WT_MXFP4, WT_MXFP4, WT_INT4_G32, WT_MXFP4, WT_MXFP4,
                                        WT_MXFP4, WT_MXFP4, WT_MXFP4,    WT_BF16,  WT_BF16};
    uint64_t s = seed_of("experts-batch");
    hmat m[NJ][3];
    gpu_weight g[NJ][3];
    gpu_expert_job jobs[NJ];
    float *X[NJ], *dX[NJ], *dO[NJ], *ref[NJ], *out[NJ], *one[NJ];
    char err[DF_ERRMSG] = "";
    const gpu_act acts[2] = {{0, 0, 0}, {1, 3.0f, 2.0f}};
    for (int j = 0; j < NJ; j++) {
        const int I = inter_of[j], n = n_of[j];
        hmat_make(&m[j][0], type_of[j], I, HID, DT_BF16, s + 10 * j + 1);
        hmat_make(&m[j][1], type_of[j], I, HID, DT_BF16, s + 10 * j + 2);
        hmat_make(&m[j][2], type_of[j], HID, I, DT_BF16, s + 10 * j + 3);
        for (int k = 0; k < 3; k++) REQUIRE(gpu_weight_upload(&m[j][k].w, &g[j][k], err) == DF_OK, "%s", err);
        X[j] = malloc((size_t)n * HID * sizeof(float));
        ref[j] = malloc((size_t)n * HID * sizeof(float));
        out[j] = malloc((size_t)n * HID * sizeof(float));
        one[j] = malloc((size_t)n * HID * sizeof(float));
        for (int i = 0; i < n * HID; i++) X[j][i] = 2.0f * frand(&s);
        dX[j] = gpu_malloc((size_t)n * HID * sizeof(float));
        dO[j] = gpu_malloc((size_t)n * HID * sizeof(float));
        REQUIRE(dX[j] && dO[j]);
        REQUIRE(gpu_put(dX[j], X[j], (size_t)n * HID * sizeof(float)) == DF_OK);
        jobs[j] = (gpu_expert_job){&g[j][0], &g[j][1], &g[j][2], dX[j], n, dO[j]};
    }
    float *G = malloc((size_t)NMX * 256 * sizeof(float)), *U = malloc((size_t)NMX * 256 * sizeof(float));
    float *dH = gpu_malloc((size_t)NMX * 256 * sizeof(float));
    REQUIRE(G && U && dH);
    gpu_ws ws = {0};
    ws.bf16_tc_rows = 1; /* the bf16 jobs on the tensor cores */
    double worst = 0;
    for (int a = 0; a < 2; a++) {
        for (int j = 0; j < NJ; j++) REQUIRE(gpu_fill(dO[j], 0xff, (size_t)n_of[j] * HID * sizeof(float)) == DF_OK);
        REQUIRE(gpu_experts(jobs, NJ, &acts[a], &ws, NULL) == DF_OK, "%s", gpu_last_error());
        REQUIRE(gpu_sync() == DF_OK, "%s", gpu_last_error());
        for (int j = 0; j < NJ; j++) {
            const int I = inter_of[j], n = n_of[j];
            REQUIRE(gpu_get(out[j], dO[j], (size_t)n * HID * sizeof(float)) == DF_OK);
            kn_matmul(KN_SCALAR, &m[j][0].w, X[j], n, G, I, 0, I);
            kn_matmul(KN_SCALAR, &m[j][1].w, X[j], n, U, I, 0, I);
            act_cpu(&acts[a], G, U, (int64_t)n * I);
            kn_matmul(KN_SCALAR, &m[j][2].w, G, n, ref[j], HID, 0, HID);
            for (int i = 0; i < n; i++) {
                double d2 = 0, r2 = 0;
                for (int c = 0; c < HID; c++) {
                    double d = (double)out[j][i * HID + c] - ref[j][i * HID + c];
                    d2 += d * d;
                    r2 += (double)ref[j][i * HID + c] * ref[j][i * HID + c];
                }
                double rel = sqrt(d2 / r2);
                if (!(rel <= 1e-5)) CHECK(0, "job %d n=%d vector %d act %d: relative error %.3g > 1e-5", j, n, i, a, rel);
                if (rel > worst) worst = rel;
            }
            /* alone in a batch; then each vector alone */
            REQUIRE(gpu_fill(dO[j], 0xff, (size_t)n * HID * sizeof(float)) == DF_OK);
            REQUIRE(gpu_experts(&jobs[j], 1, &acts[a], &ws, NULL) == DF_OK, "%s", gpu_last_error());
            REQUIRE(gpu_get(one[j], dO[j], (size_t)n * HID * sizeof(float)) == DF_OK);
            CHECK(memcmp(one[j], out[j], (size_t)n * HID * sizeof(float)) == 0, "job %d act %d: alone != in the batch", j, a);
            for (int i = 0; i < n; i++) {
                gpu_expert_job v1 = jobs[j];
                v1.X = dX[j] + (size_t)i * HID;
                v1.n = 1;
                REQUIRE(gpu_experts(&v1, 1, &acts[a], &ws, NULL) == DF_OK, "%s", gpu_last_error());
                REQUIRE(gpu_get(one[j], dO[j], HID * sizeof(float)) == DF_OK);
                CHECK(memcmp(one[j], out[j] + (size_t)i * HID, HID * sizeof(float)) == 0,
                      "job %d vector %d act %d: n = 1 != row of n = %d", j, i, a, n);
            }
            if (type_of[j] != WT_MXFP4 && type_of[j] != WT_BF16) { /* bf16: tensor cores, not gpu_expert's */
                REQUIRE(gpu_expert(&g[j][0], &g[j][1], &g[j][2], &acts[a], dX[j], n, dH, dO[j], NULL) == DF_OK);
                REQUIRE(gpu_get(one[j], dO[j], (size_t)n * HID * sizeof(float)) == DF_OK);
                CHECK(memcmp(one[j], out[j], (size_t)n * HID * sizeof(float)) == 0, "job %d: != gpu_expert", j);
            }
        }
    }
    /* the MXFP4 experts in the fragment layout: all of them, then every
     * other one (batches of both layouts in one launch): the same bits */
    gpu_weight gf[NJ][3];
    memset(gf, 0, sizeof gf);
    for (int j = 0; j < NJ; j++)
        for (int k = 0; k < 3 && type_of[j] == WT_MXFP4; k++)
            REQUIRE(gpu_weight_upload_frag(&m[j][k].w, &gf[j][k], err) == DF_OK, "%s", err);
    for (int mix = 0; mix < 2; mix++) {
        gpu_expert_job fj[NJ];
        for (int j = 0; j < NJ; j++) {
            fj[j] = jobs[j];
            if (type_of[j] == WT_MXFP4 && (!mix || j % 2)) fj[j] = (gpu_expert_job){&gf[j][0], &gf[j][1], &gf[j][2], dX[j], n_of[j], dO[j]};
            REQUIRE(gpu_fill(dO[j], 0xff, (size_t)n_of[j] * HID * sizeof(float)) == DF_OK);
        }
        REQUIRE(gpu_experts(fj, NJ, &acts[1], &ws, NULL) == DF_OK, "%s", gpu_last_error());
        for (int j = 0; j < NJ; j++) {
            REQUIRE(gpu_get(one[j], dO[j], (size_t)n_of[j] * HID * sizeof(float)) == DF_OK);
            CHECK(memcmp(one[j], out[j], (size_t)n_of[j] * HID * sizeof(float)) == 0, "job %d mix %d: fragment layout != staged", j, mix);
        }
    }
    for (int j = 0; j < NJ; j++)
        for (int k = 0; k < 3; k++) gpu_weight_free(&gf[j][k]);
    gpu_expert_job bad = jobs[0];
    bad.down = &g[4][2]; /* down of another shape */
    CHECK(gpu_experts(&bad, 1, &acts[0], &ws, NULL) == DF_ERR_ARG, "mismatched shapes refused");
    fprintf(stderr, "[experts-batch: worst normwise relative error %.2e, bound 1e-5] ", worst);
    gpu_ws_free(&ws);
    gpu_free(dH);
    free(G);
    free(U);
    for (int j = 0; j < NJ; j++) {
        for (int k = 0; k < 3; k++) {
            gpu_weight_free(&g[j][k]);
            hmat_free(&m[j][k]);
        }
        gpu_free(dX[j]);
        gpu_free(dO[j]);
        free(X[j]);
        free(ref[j]);
        free(out[j]);
        free(one[j]);
    }
}

/* The fragment layout's many-vector batches, all three kernels
 * (gpu_ws.frag_xs: the k split, and x staged in shared memory with the k
 * split's classes walked in order, one tile a warp; gpu_ws.frag_wg: wgmma,
 * where the device and build have it), on shapes the layer batch above does
 * not reach: more than 2048 columns (eight
 * classes), a last group of fewer than four blocks, row blocks cut by the
 * matrix's end, classes with no group (down: 7 blocks, four classes), jobs
 * past 16 vectors (two items each) and past 48 (two wgmma items, its widest
 * form), an item in each of wgmma's vector classes, a few 2^-127 scales (the packed-scale
 * form). Bit-equal to the staged layout's batches and to each vector alone;
 * against the CPU as above. */
TEST(cuda_frag_batch_shapes) {
    if (!need_gpu()) return;
    enum { H = 2336, I = 224, NJ = 7, NBIG = 53 };
    /* wgmma's vector classes of 8 (NBIG: items of 48 and 5) */
    static const int n_of[NJ] = {21, 6, 17, NBIG, 13, 30, 38};
    uint64_t s = seed_of("frag-batch-shapes");
    hmat m[NJ][3];
    gpu_weight g[NJ][3], gf[NJ][3];
    gpu_expert_job js[NJ], jf[NJ];
    float *X[NJ], *dX[NJ], *dO[NJ], *a[NJ], *b[NJ];
    char err[DF_ERRMSG] = "";
    const gpu_act act = {0, 0, 0};
    for (int j = 0; j < NJ; j++) {
        const int n = n_of[j];
        hmat_make(&m[j][0], WT_MXFP4, I, H, DT_UNKNOWN, s + 10 * j + 1);
        hmat_make(&m[j][1], WT_MXFP4, I, H, DT_UNKNOWN, s + 10 * j + 2);
        hmat_make(&m[j][2], WT_MXFP4, H, I, DT_UNKNOWN, s + 10 * j + 3);
        for (int k = 0; k < 3; k++) {
            uint8_t *sc = m[j][k].scale;
            for (int64_t i = 7 * k + j; i < m[j][k].w.rows * (m[j][k].w.cols / 32); i += 97) sc[i] = 0;
            REQUIRE(gpu_weight_upload(&m[j][k].w, &g[j][k], err) == DF_OK, "%s", err);
            REQUIRE(gpu_weight_upload_frag(&m[j][k].w, &gf[j][k], err) == DF_OK, "%s", err);
        }
        X[j] = malloc((size_t)n * H * sizeof(float));
        a[j] = malloc((size_t)n * H * sizeof(float));
        b[j] = malloc((size_t)n * H * sizeof(float));
        REQUIRE(X[j] && a[j] && b[j]);
        for (int i = 0; i < n * H; i++) X[j][i] = 2.0f * frand(&s);
        dX[j] = gpu_malloc((size_t)n * H * sizeof(float));
        dO[j] = gpu_malloc((size_t)n * H * sizeof(float));
        REQUIRE(dX[j] && dO[j]);
        REQUIRE(gpu_put(dX[j], X[j], (size_t)n * H * sizeof(float)) == DF_OK);
        js[j] = (gpu_expert_job){&g[j][0], &g[j][1], &g[j][2], dX[j], n, dO[j]};
        jf[j] = (gpu_expert_job){&gf[j][0], &gf[j][1], &gf[j][2], dX[j], n, dO[j]};
    }
    gpu_ws ws = {0};
    REQUIRE(gpu_experts(js, NJ, &act, &ws, NULL) == DF_OK, "%s", gpu_last_error());
    for (int j = 0; j < NJ; j++) REQUIRE(gpu_get(a[j], dO[j], (size_t)n_of[j] * H * sizeof(float)) == DF_OK);
    /* the many-vector kernels of the fragment layout: the k split, x staged, wgmma */
    static const char *const kname[3] = {"k split", "x staged", "wgmma"};
    for (int kind = 0; kind < 3; kind++) {
        ws.frag_xs = kind ? 1 : -1;
        ws.frag_wg = kind == 2 ? 1 : -1;
        for (int j = 0; j < NJ; j++) REQUIRE(gpu_fill(dO[j], 0xff, (size_t)n_of[j] * H * sizeof(float)) == DF_OK);
        REQUIRE(gpu_experts(jf, NJ, &act, &ws, NULL) == DF_OK, "%s", gpu_last_error());
        for (int j = 0; j < NJ; j++) {
            REQUIRE(gpu_get(b[j], dO[j], (size_t)n_of[j] * H * sizeof(float)) == DF_OK);
            CHECK(memcmp(a[j], b[j], (size_t)n_of[j] * H * sizeof(float)) == 0,
                  "job %d n=%d %s: fragment layout != staged", j, n_of[j], kname[kind]);
        }
    }
    fprintf(stderr, "[wgmma %s] ", gpu_ws_wg_present(&ws) ? "ran" : "absent: x staged twice");
    float *G = malloc((size_t)NBIG * I * sizeof(float)), *U = malloc((size_t)NBIG * I * sizeof(float));
    float *ref = malloc((size_t)NBIG * H * sizeof(float));
    REQUIRE(G && U && ref);
    double worst = 0;
    for (int j = 0; j < NJ; j++) {
        const int n = n_of[j];
        kn_matmul(KN_SCALAR, &m[j][0].w, X[j], n, G, I, 0, I);
        kn_matmul(KN_SCALAR, &m[j][1].w, X[j], n, U, I, 0, I);
        act_cpu(&act, G, U, (int64_t)n * I);
        kn_matmul(KN_SCALAR, &m[j][2].w, G, n, ref, H, 0, H);
        for (int i = 0; i < n; i++) {
            double d2 = 0, r2 = 0;
            for (int c = 0; c < H; c++) {
                double d = (double)b[j][i * H + c] - ref[i * H + c];
                d2 += d * d;
                r2 += (double)ref[i * H + c] * ref[i * H + c];
            }
            const double rel = sqrt(d2 / r2);
            if (!(rel <= 1e-5)) CHECK(0, "job %d vector %d: relative error %.3g > 1e-5", j, i, rel);
            if (rel > worst) worst = rel;
        }
        for (int i = 0; i < n; i += 5) { /* n = 1 runs the one-vector kernels */
            gpu_expert_job v1 = jf[j];
            v1.X = dX[j] + (size_t)i * H;
            v1.n = 1;
            REQUIRE(gpu_experts(&v1, 1, &act, &ws, NULL) == DF_OK, "%s", gpu_last_error());
            REQUIRE(gpu_get(a[j], dO[j], H * sizeof(float)) == DF_OK);
            CHECK(memcmp(a[j], b[j] + (size_t)i * H, H * sizeof(float)) == 0, "job %d vector %d: n = 1 != row of n = %d",
                  j, i, n);
        }
    }
    fprintf(stderr, "[frag-batch-shapes: worst normwise relative error %.2e, bound 1e-5] ", worst);
    gpu_ws_free(&ws);
    free(G);
    free(U);
    free(ref);
    for (int j = 0; j < NJ; j++) {
        for (int k = 0; k < 3; k++) {
            gpu_weight_free(&g[j][k]);
            gpu_weight_free(&gf[j][k]);
            hmat_free(&m[j][k]);
        }
        gpu_free(dX[j]);
        gpu_free(dO[j]);
        free(X[j]);
        free(a[j]);
        free(b[j]);
    }
}

/* gpu_sigmoid_mul (MLA's output gate on the device) against x * op_sigmoid(g):
 * within 8 ulp per element (CUDA's expf is within 2 ulp of glibc's, and for
 * large |g| the relative error of exp passes through the add and divide). */
TEST(cuda_sigmoid_mul) {
    if (!need_gpu()) return;
    enum { N = 5000 };
    static float x[N], g[N], ref[N], out[N];
    uint64_t s = seed_of("sigmoid-mul");
    for (int i = 0; i < N; i++) {
        x[i] = 4.0f * frand(&s);
        g[i] = 30.0f * frand(&s);
        ref[i] = x[i] * op_sigmoid(g[i]);
    }
    float *dx = gpu_malloc(sizeof x), *dg = gpu_malloc(sizeof g);
    REQUIRE(dx && dg);
    REQUIRE(gpu_put(dx, x, sizeof x) == DF_OK && gpu_put(dg, g, sizeof g) == DF_OK);
    REQUIRE(gpu_sigmoid_mul(dx, dg, N, NULL) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(out, dx, sizeof out) == DF_OK, "%s", gpu_last_error());
    double worst = 0;
    for (int i = 0; i < N; i++) {
        double b = 8 * 0x1p-24 * fabs(ref[i]) + 1e-37, d = fabs((double)out[i] - ref[i]);
        if (!(d <= b)) CHECK(0, "element %d: %.9g vs %.9g", i, out[i], ref[i]);
        if (d / b > worst) worst = d / b;
    }
    CHECK(gpu_sigmoid_mul(NULL, dg, 1, NULL) == DF_ERR_ARG, "NULL refused");
    fprintf(stderr, "[worst %.3f of 8 ulp] ", worst);
    gpu_free(dx);
    gpu_free(dg);
}

/* gpu_moe_combine (a latent MoE layer's weighted sum on the device) against
 * ffn.c's op_axpy from zero plus the add: within K 2^-24 sum |w y| + |add|
 * 2^-24 per element (usually bit-equal: the same roundings). */
TEST(cuda_moe_combine) {
    if (!need_gpu()) return;
    enum { N = 3, K = 5, DIM = 1000 };
    static float rows[N * K][DIM], add[N][DIM], w[N * K], ref[N][DIM], out[N][DIM];
    uint64_t s = seed_of("moe-combine");
    for (int r = 0; r < N * K; r++) {
        w[r] = frand(&s);
        for (int c = 0; c < DIM; c++) rows[r][c] = 3.0f * frand(&s);
    }
    for (int t = 0; t < N; t++)
        for (int c = 0; c < DIM; c++) add[t][c] = frand(&s);
    float *drows = gpu_malloc(sizeof rows), *dadd = gpu_malloc(sizeof add), *dw = gpu_malloc(sizeof w);
    float *dout = gpu_malloc(sizeof out);
    const float **tab = gpu_malloc((N * K + N) * sizeof(float *));
    REQUIRE(drows && dadd && dw && dout && tab);
    const float *htab[N * K + N];
    for (int r = 0; r < N * K; r++) htab[(r % N) * K + r / N] = drows + (size_t)r * DIM; /* rows in any order */
    for (int t = 0; t < N; t++) htab[N * K + t] = dadd + (size_t)t * DIM;
    REQUIRE(gpu_put(drows, rows, sizeof rows) == DF_OK && gpu_put(dadd, add, sizeof add) == DF_OK);
    REQUIRE(gpu_put(dw, w, sizeof w) == DF_OK && gpu_put(tab, htab, sizeof htab) == DF_OK);
    for (int with_add = 0; with_add < 2; with_add++) {
        REQUIRE(gpu_fill(dout, 0xff, sizeof out) == DF_OK);
        REQUIRE(gpu_moe_combine(tab, dw, N, K, DIM, with_add ? tab + N * K : NULL, dout, NULL) == DF_OK, "%s",
                gpu_last_error());
        REQUIRE(gpu_get(out, dout, sizeof out) == DF_OK, "%s", gpu_last_error());
        int equal = 0;
        double worst = 0;
        for (int t = 0; t < N; t++) {
            memset(ref[t], 0, sizeof ref[t]);
            double mag[DIM] = {0};
            for (int k = 0; k < K; k++) {
                /* htab[t K + k] points at rows[src] with src = k N + t */
                const float *y = rows[k * N + t];
                op_axpy(ref[t], w[t * K + k], y, DIM);
                for (int c = 0; c < DIM; c++) mag[c] += fabs((double)w[t * K + k] * y[c]);
            }
            for (int c = 0; c < DIM; c++) {
                if (with_add) { ref[t][c] += add[t][c]; mag[c] += fabs(add[t][c]); }
                double b = (K + 1) * 0x1p-24 * mag[c] + 1e-30, d = fabs((double)out[t][c] - ref[t][c]);
                if (!(d <= b)) CHECK(0, "token %d column %d add %d: %.9g vs %.9g", t, c, with_add, out[t][c], ref[t][c]);
                if (d / b > worst) worst = d / b;
                equal += out[t][c] == ref[t][c];
            }
        }
        fprintf(stderr, "[add %d: worst %.3f of the bound, %d of %d bit-equal] ", with_add, worst, equal, N * DIM);
    }
    CHECK(gpu_moe_combine(tab, dw, 0, K, DIM, NULL, dout, NULL) == DF_ERR_ARG, "n = 0 refused");
    gpu_free(drows);
    gpu_free(dadd);
    gpu_free(dw);
    gpu_free(dout);
    gpu_free((void *)tab);
}

/* ---- rmsnorm ------------------------------------------------------------------ */

TEST(cuda_rmsnorm) {
    if (!need_gpu()) return;
    static const int dims[] = {7168, 1000, 5};
    enum { N = 3, DMAX = 7168 };
    static float x[N * DMAX], w[DMAX], ref[N * DMAX], out[N * DMAX];
    uint64_t s = seed_of("rmsnorm");
    float *dx = gpu_malloc(sizeof x), *dw = gpu_malloc(sizeof w), *dout = gpu_malloc(sizeof out);
    REQUIRE(dx && dw && dout);
    int exact = 0, total = 0;
    for (size_t k = 0; k < 3; k++)
        for (int withw = 0; withw < 2; withw++)
            for (int inplace = 0; inplace < 2; inplace++) {
                int d = dims[k];
                for (int i = 0; i < N * d; i++) x[i] = 3.0f * frand(&s);
                for (int i = 0; i < d; i++) w[i] = 1.0f + 0.5f * frand(&s);
                for (int i = 0; i < N; i++) op_rmsnorm(ref + i * d, x + i * d, withw ? w : NULL, d, 1e-6f);
                REQUIRE(gpu_put(dx, x, (size_t)(N * d) * 4) == DF_OK);
                REQUIRE(gpu_put(dw, w, (size_t)d * 4) == DF_OK);
                float *dst = inplace ? dx : dout;
                if (!inplace) REQUIRE(gpu_fill(dout, 0xff, (size_t)(N * d) * 4) == DF_OK);
                REQUIRE(gpu_rmsnorm(dst, dx, withw ? dw : NULL, N, d, 1e-6f, NULL) == DF_OK);
                REQUIRE(gpu_get(out, dst, (size_t)(N * d) * 4) == DF_OK, "%s", gpu_last_error());
                for (int i = 0; i < N * d; i++) {
                    total++;
                    exact += out[i] == ref[i];
                    if (!(fabsf(out[i] - ref[i]) <= 0x1p-22f * fabsf(ref[i])))
                        CHECK(0, "dim %d elem %d: gpu %.9g cpu %.9g", d, i, out[i], ref[i]);
                }
            }
    fprintf(stderr, "[%d of %d elements bit-equal to op_rmsnorm] ", exact, total);
    gpu_free(dx); gpu_free(dw); gpu_free(dout);
}

/* ---- router ------------------------------------------------------------------- */

/* moe_route (src/model/ffn.c), copied: the model library is not linked here. */
static void route_cpu(const gpu_router *m, const float *bias, const float *logit, int *sel, float *selw) {
    int E = m->E, K = m->K, G = m->n_group > 0 ? m->n_group : 1, per = E / G;
    float score[1024], choice[1024];
    if (m->sigmoid) {
        for (int x = 0; x < E; x++) score[x] = op_sigmoid(logit[x]);
    } else {
        memcpy(score, logit, sizeof(float) * (size_t)E);
        op_softmax(score, E);
    }
    for (int x = 0; x < E; x++) choice[x] = score[x] + (bias ? bias[x] : 0.0f);
    if (G > 1 && m->topk_group < G) {
        float gs[32];
        int keep[32];
        for (int g = 0; g < G; g++) {
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
    int taken[1024] = {0};
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int x = 0; x < E; x++)
            if (!taken[x] && (best < 0 || choice[x] > choice[best])) best = x;
        taken[best] = 1;
    }
    float sum = 0.0f;
    for (int x = 0, k = 0; x < E; x++)
        if (taken[x]) { sel[k] = x; selw[k] = score[x]; sum += score[x]; k++; }
    for (int k = 0; k < K; k++) {
        if (m->renorm) selw[k] /= (sum + 1e-20f);
        selw[k] *= m->scale;
    }
}

static void check_route(gpu_router r, int with_bias, const char *tag) {
    if (!need_gpu()) return;
    enum { N = 64 };
    uint64_t s = seed_of(tag);
    static float logit[N * 1024], bias[1024], selw[N * 32], rw[32];
    static int sel[N * 32], rs[32];
    for (int i = 0; i < N * r.E; i++) logit[i] = 4.0f * frand(&s);
    for (int i = 0; i < r.E; i++) bias[i] = 0.1f * frand(&s);
    float *dl = gpu_malloc(sizeof logit), *db = gpu_malloc(sizeof bias), *dw = gpu_malloc(sizeof selw);
    int *ds = gpu_malloc(sizeof sel);
    REQUIRE(dl && db && dw && ds);
    REQUIRE(gpu_put(dl, logit, sizeof logit) == DF_OK);
    REQUIRE(gpu_put(db, bias, sizeof bias) == DF_OK);
    r.bias = with_bias ? db : NULL;
    REQUIRE(gpu_fill(ds, 0xff, sizeof sel) == DF_OK);
    REQUIRE(gpu_route(&r, dl, N, ds, dw, NULL) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(sel, ds, sizeof sel) == DF_OK, "%s", gpu_last_error());
    REQUIRE(gpu_get(selw, dw, sizeof selw) == DF_OK);
    double worst = 0;
    int bad = 0;
    for (int t = 0; t < N; t++) {
        route_cpu(&r, with_bias ? bias : NULL, logit + t * r.E, rs, rw);
        for (int k = 0; k < r.K; k++) {
            if (sel[t * r.K + k] != rs[k] && bad++ < 3)
                CHECK(0, "%s token %d slot %d: gpu expert %d, cpu %d", tag, t, k, sel[t * r.K + k], rs[k]);
            double rel = fabs((double)selw[t * r.K + k] - rw[k]) / fabs(rw[k]);
            if (!(rel <= 1e-5) && bad++ < 3) CHECK(0, "%s token %d slot %d: weight %.9g vs %.9g", tag, t, k, selw[t * r.K + k], rw[k]);
            if (rel > worst) worst = rel;
        }
    }
    CHECK(bad == 0, "%s: %d mismatches", tag, bad);
    fprintf(stderr, "[%s: worst weight relative error %.2e, bound 1e-5] ", tag, worst);
    gpu_free(dl); gpu_free(db); gpu_free(dw); gpu_free(ds);
}

TEST(cuda_route_k2_grouped) { /* DeepSeek-V3 / Kimi-K2 shape */
    gpu_router r = {.E = 384, .K = 8, .n_group = 8, .topk_group = 4, .sigmoid = 1,
                    .group_mask = 0.0f, .renorm = 1, .scale = 2.827f};
    check_route(r, 1, "route-k2");
}
TEST(cuda_route_k3) { /* 896 experts, top-16, sigmoid */
    gpu_router r = {.E = 896, .K = 16, .n_group = 1, .topk_group = 1, .sigmoid = 1,
                    .group_mask = -INFINITY, .renorm = 1, .scale = 1.5f};
    check_route(r, 1, "route-k3");
}
TEST(cuda_route_softmax_masked) {
    gpu_router r = {.E = 64, .K = 6, .n_group = 8, .topk_group = 3, .sigmoid = 0,
                    .group_mask = -INFINITY, .renorm = 0, .scale = 1.0f};
    check_route(r, 0, "route-softmax");
}
