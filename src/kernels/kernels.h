/* kernels.h — CPU compute kernels (prefix kn_): one dispatch point.
 *
 * Every weight type has a plain C reference (KN_SCALAR) that is the test
 * oracle; AVX2 and AVX-512 (x86) or NEON (AArch64) variants override it. The
 * level is chosen by the caller (the engine picks kn_detect() once, tests
 * force each level).
 *
 * Determinism contract (the model's exactness rests on it):
 *  - at a given level, the value of output element r depends only on row r of
 *    W and on x: not on row0/row1, not on how many vectors kn_matmul is given,
 *    not on the thread that computes it. kn_matmul(X, n) row i is bit-equal
 *    to kn_matvec(X + i*cols).
 *  - activations are fp32; products and sums are fp32 (SIMD variants sum in
 *    a fixed lane order, so they differ from scalar only by rounding).
 *  - exception, 4-bit weights (int4, MXFP4) at KN_AVX2 and KN_AVX512: x enters as 24-bit
 *    fixed point per 32-column group (its largest |x| to 23 bits, three
 *    signed bytes; integer products summed exactly, then fp32), which adds
 *    at most 2^-23 max|x_g| sum_{c in g} |w_c| per group g to the fp32
 *    bound (matvec_avx512.c, matvec_avx2.c). A NaN or infinite x in a group
 *    gives NaN.
 *  - exception, KN_AMX: a bf16 or MXFP4 product of at least KN_AMX_MIN_N
 *    vectors runs on the AMX tile unit, whose sums round differently from
 *    the AVX-512 tiles that run smaller products. Row i of such a product is
 *    bit-equal to vector i in any other product of at least KN_AMX_MIN_N
 *    vectors (any n, row range or thread), and within the same bound of
 *    kn_matvec's value. So at KN_AMX a row's last bits depend on which side
 *    of KN_AMX_MIN_N its pass was (as the GPU's --bf16-tc-rows); the level is
 *    asked for, never the default.
 */
#ifndef DF_KERNELS_H
#define DF_KERNELS_H
#include "../format/weight.h"
#include <stdint.h>

/* KN_NEON (AArch64 Advanced SIMD) is not above the x86 levels: a level this
 * CPU lacks (kn_level_available 0) runs as kn_detect()'s level instead.
 * KN_AMX (x86) is KN_AVX512 with the bf16 and MXFP4 products of at least
 * KN_AMX_MIN_N vectors on Intel AMX tiles (matvec_amx.c): every other
 * product and kernel runs as KN_AVX512; kn_detect() never picks it. */
typedef enum { KN_SCALAR = 0, KN_AVX2 = 1, KN_AVX512 = 2, KN_NEON = 3, KN_AMX = 4 } kn_level;
enum { KN_AMX_MIN_N = 8 }; /* vectors from which KN_AMX runs a product on the tiles */

kn_level kn_detect(void);              /* best level this CPU supports */
const char *kn_level_name(kn_level l);
int kn_level_available(kn_level l);    /* 1 if this CPU runs level l as itself */

/* y[r - row0] = sum_c W[r][c] * x[c], for r in [row0, row1). */
void kn_matvec(kn_level lv, const df_weight *w, const float *x, float *y, int64_t row0,
               int64_t row1);
/* For i in [0, n): Y[i*ldy + (r - row0)] = sum_c W[r][c] * X[i*cols + c]. */
void kn_matmul(kn_level lv, const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
               int64_t row0, int64_t row1);
/* Decodes row r of W into out[cols] (exact values, scalar). */
void kn_dequant_row(const df_weight *w, int64_t r, float *out);

/* x prepared once for a product whose rows are split over threads. Some
 * tiles read x in a form of their own (the 4-bit tiles' fixed point, bf16's
 * even / odd columns), and kn_matmul prepares it in every call: once per
 * chunk of rows a thread claims. Here it is prepared once: kn_px_floats
 * says how many floats the n vectors take there (0: lv reads w's x as
 * given, or would run the product on the AMX tiles; call kn_matmul),
 * kn_px_prep writes vectors [v0, v1) into them (any split), and
 * kn_matmul_px computes any row range from them, bit-equal to kn_matmul. */
int64_t kn_px_floats(kn_level lv, const df_weight *w, int n);
/* The most floats one prepared vector of cols columns takes (kn_px_floats
 * is at most n times this): cols rounded up to 128, and 16 more, so that
 * vectors are never a multiple of 4 KB apart (K3's 7168, 12288 and 33792
 * columns are): the AVX-512 prefill reads a column block of 8 vectors in
 * place, which on a multiple of 4 KB would fall in the same L1 sets. */
static inline int64_t kn_px_len(int64_t cols) { return (cols + 127) / 128 * 128 + 16; }
void kn_px_prep(kn_level lv, const df_weight *w, const float *X, int v0, int v1, float *Xp);
void kn_matmul_px(kn_level lv, const df_weight *w, const float *Xp, int n, float *Y, int64_t ldy,
                  int64_t row0, int64_t row1);

/* Level variants behind kn_matmul (matvec_avx2.c, matvec_avx512.c); call
 * kn_matvec/kn_matmul instead. Same contract as kn_matmul; each returns 0
 * without writing Y when it has no kernel for w->type (the dispatcher then
 * falls back one level). The caller guarantees the CPU supports the level. */
int kn_matmul_avx2(const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                   int64_t row0, int64_t row1);
int kn_matmul_avx512(const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                     int64_t row0, int64_t row1);
/* Their halves for kn_px_* (the same tables): _prep writes vectors [v0, v1)
 * of X in the level's form (0: it reads w's x as given, nothing written);
 * _px runs on x so prepared. */
int kn_matmul_avx2_prep(const df_weight *w, const float *X, int v0, int v1, float *out);
int kn_matmul_avx2_px(const df_weight *w, const float *Xp, int n, float *Y, int64_t ldy, int64_t row0,
                      int64_t row1);
/* The AVX2 level's build for CPUs with AVX-VNNI (matvec_avxvnni.c; its
 * 4-bit tiles by vpdpbusd, bit-equal to the _avx2 ones): kn_matmul and
 * kn_px_* use it at KN_AVX2 when kn_avxvnni_usable() (x86; 0 elsewhere). */
int kn_avxvnni_usable(void);
int kn_matmul_avxvnni(const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                      int64_t row0, int64_t row1);
int kn_matmul_avxvnni_prep(const df_weight *w, const float *X, int v0, int v1, float *out);
int kn_matmul_avxvnni_px(const df_weight *w, const float *Xp, int n, float *Y, int64_t ldy, int64_t row0,
                         int64_t row1);
/* 1 where one-vector products (decode) stream better with the tile-ahead
 * prefetch into L1 than into L2, measured per CPU family (matvec.c: AMD and
 * Hygon; never changes a value): the driver then runs the tiles' L1 forms
 * (at AVX-512 tiles of 8 rows, NR_L1, instead of 4). */
int kn_pf_next_l1(void);
int kn_matmul_avx512_prep(const df_weight *w, const float *X, int v0, int v1, float *out);
int kn_matmul_avx512_px(const df_weight *w, const float *Xp, int n, float *Y, int64_t ldy, int64_t row0,
                        int64_t row1);
/* bf16 and MXFP4 only (matvec_amx.c; the caller guarantees AMX). _emu: the
 * same code over a plain-C model of the tile unit (needs AVX-512 only), for
 * the tests of its layouts on machines without AMX. */
int kn_matmul_amx(const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                  int64_t row0, int64_t row1);
int kn_matmul_amx_emu(const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                      int64_t row0, int64_t row1);
/* The same in parts, so a product packs x once and its threads share it
 * (engine.c's mm): init says how many bytes B needs (0: w is not for the
 * tiles) and fills the sizes; the caller allocates B (64-byte aligned) and
 * packs groups [0, groups), in any split; then kn_matmul_amx_x computes any
 * row range. Values bit-equal to kn_matmul_amx's. x86 only (elsewhere init
 * returns 0). */
typedef struct {
    const df_weight *w;
    int n, nv, groups, nc0, nc1; /* vectors, per group, groups, B tile columns */
    int64_t gbytes;              /* packed bytes per group */
    uint8_t *B;                  /* groups x gbytes; the caller's */
} kn_amx_x;
int64_t kn_amx_x_init(kn_amx_x *px, const df_weight *w, int n);
void kn_amx_x_pack(const kn_amx_x *px, const float *X, int g0, int g1);
void kn_matmul_amx_x(const kn_amx_x *px, const float *X, float *Y, int64_t ldy, int64_t row0, int64_t row1);
/* kn_amx_x_init where the product would run on the tiles at KN_AMX (n >=
 * KN_AMX_MIN_N, AMX here, w bf16 or MXFP4), else 0 with *px zeroed
 * (amx_pool.c). A packed x also serves another weight of the same type and
 * cols: copy px and set w. */
int64_t kn_amx_x_plan(kn_amx_x *px, const df_weight *w, int n);
/* Rows [0, rows) of a product on a pool (amx_pool.c): x packed once (into
 * kept when given, see kn_px_buf), then the rows; 0 (nothing written) when
 * w is not for the tiles, n < KN_AMX_MIN_N, this CPU has no AMX or memory
 * is short (the caller then runs kn_matmul). */
struct df_pool;
typedef struct kn_px_buf kn_px_buf;
int kn_matmul_amx_pool(struct df_pool *pool, const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                       int64_t rows, kn_px_buf *kept);
/* Rows [0, rows) of a product at level lv split over a pool, as the engine
 * runs its products (matmul_pool.c): x packed or prepared once for all
 * threads where the level reads it in a form of its own (AMX, kn_px_*);
 * values bit-equal to kn_matmul's. */
void kn_matmul_pool(struct df_pool *pool, kn_level lv, const df_weight *w, const float *X, int n, float *Y,
                    int64_t ldy, int64_t rows);
/* One product of kn_matmul_pool_many: all w->rows rows of w times n vectors
 * of X into Y (vector i at Y + i * ldy). */
typedef struct {
    const df_weight *w;
    const float *X;
    int n;
    float *Y;
    int64_t ldy;
} kn_mm_item;
/* kn_matmul_pool for several products in one pass over the pool: their rows
 * split over the threads together (one wake and one tail for all, instead
 * of one a product), x prepared once for the products that read the same
 * vectors in the same form. Values bit-equal to kn_matmul's. Products that
 * go to the AMX tiles (and more than KN_POOL_MANY) run one by one. */
enum { KN_POOL_MANY = 16 };
void kn_matmul_pool_many(struct df_pool *pool, kn_level lv, const kn_mm_item *items, int count);
/* A buffer for prepared x that a caller keeps between products (the
 * engine): a prompt's products prepare up to n x cols floats (69 MB for
 * 512 vectors of K3's 33792-wide MLP input), and fresh pages for them in
 * every pass cost a fault a 4 KB page. Grown as needed; kn_px_buf_free
 * frees it. The _kept forms use it instead of allocating; the same values. */
struct kn_px_buf {
    float *p;
    int64_t cap; /* floats */
};
void kn_matmul_pool_kept(struct df_pool *pool, kn_level lv, const df_weight *w, const float *X, int n, float *Y,
                         int64_t ldy, int64_t rows, kn_px_buf *kept);
void kn_matmul_pool_many_kept(struct df_pool *pool, kn_level lv, const kn_mm_item *items, int count,
                              kn_px_buf *kept);
/* The kept buffer holding at least floats (grown: the old one freed first,
 * so the two are never held at once); NULL when out of memory (the callers
 * then do as with no buffer). */
float *kn_px_buf_get(kn_px_buf *b, int64_t floats);
void kn_px_buf_free(kn_px_buf *b);
int64_t kn_amx_x_init_emu(kn_amx_x *px, const df_weight *w, int n);
void kn_amx_x_pack_emu(const kn_amx_x *px, const float *X, int g0, int g1);
void kn_matmul_amx_x_emu(const kn_amx_x *px, const float *X, float *Y, int64_t ldy, int64_t row0, int64_t row1);

/* fp32 FMA throughput probe at level lv (the compute ceiling prefill is
 * measured against): `iters` rounds of independent FMA chains; returns the
 * flops done, with a result in *sink. */
double kn_fma_loop(kn_level lv, int64_t iters, float *sink);
double kn_fma_loop_avx2(int64_t iters, float *sink);
double kn_fma_loop_avx512(int64_t iters, float *sink);
double kn_fma_loop_neon(int64_t iters, float *sink);
/* AArch64 (matvec_neon.c, only compiled there): same contract. */
int kn_matmul_neon(const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
                   int64_t row0, int64_t row1);
int kn_matmul_neon_prep(const df_weight *w, const float *X, int v0, int v1, float *out);
int kn_matmul_neon_px(const df_weight *w, const float *Xp, int n, float *Y, int64_t ldy, int64_t row0,
                      int64_t row1);

/* Kernel benchmark behind df_bench_kernels (see deltafin.h). */
struct df_pool;
int kn_bench(struct df_pool *pool, kn_level lv, double mb, double seconds, df_bench_row *rows,
             double *probe_gbps, double *fma_gflops);

/* ---- MLA attention (attn_mla.c, attn_mla_avx2.c, attn_mla_avx512.c) ----
 * The absorbed MLA attention of one head over the compact latent cache
 * (rows | c_kv (R) | k_pe (dr) |, stride R + dr), for a block of queries.
 * Bit-identical at EVERY level to the plain C of mla_core.c's
 * mla_attend_one and of the absorb loop it replaces (op_dot's four partial
 * sums, op_softmax, op_axpy's multiply-then-add in ascending order): the
 * SIMD variants vectorise across queries or rows, never along a sum. */

/* Gated activations over n elements, in place (act.c): g[i] = silu(g[i]) *
 * u[i], or SiTU: beta * tanh(g/beta) * sigmoid(g) * (linear_beta * tanh(u /
 * linear_beta), or u when linear_beta <= 0). KN_SCALAR is libm's expf and
 * tanhf; the x86 levels use libmvec's vector forms (in builds that link it:
 * the Makefile's MVEC, else they run the scalar level), within 16 ulp (relative
 * to the result, plus 1e-30 absolute) of the scalar level (tests). Each
 * element's value depends on its g and u alone, at a given level. */
void kn_act_silu_mul(kn_level lv, float *g, const float *u, int64_t n);
void kn_act_situ_mul(kn_level lv, float *g, const float *u, int64_t n, float beta, float linear_beta);
void kn_act_silu_mul_avx2(float *g, const float *u, int64_t n);
void kn_act_silu_mul_avx512(float *g, const float *u, int64_t n);
void kn_act_situ_mul_avx2(float *g, const float *u, int64_t n, float beta, float linear_beta);
void kn_act_situ_mul_avx512(float *g, const float *u, int64_t n, float beta, float linear_beta);
/* Weighted row sums in ascending order (MLA's absorb and its value sum):
 * for j < m, r < R, with cnt_j = k0 + j * inc (inc 0 or 1, k0 >= 0),
 *   Y[j*ldy + r] = sum_{k < cnt_j} A[j*lda + k] * B[k*ldb + r],
 * summed from +0 in ascending k, each term a multiply then an add (what
 * memset + op_axpy per k gives). */
void kn_mla_rowsum(kn_level lv, const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc,
                   int R, float *Y, int64_t ldy);
/* The same with B in bf16, widened as it is read (exact): bit-equal to
 * kn_mla_rowsum over B's fp32 values, without writing them out (MLA's absorb
 * reads W_UK straight from a bf16 kv_b). */
void kn_mla_rowsum_bf16(kn_level lv, const float *A, int64_t lda, const uint16_t *B, int64_t ldb, int m, int k0,
                        int inc, int R, float *Y, int64_t ldy);
/* ... and with B int8, row k's values (float)B[k][r] * bs[k] (kn_dequant_row's
 * of a WT_I8_ROW row: the int8 spine's kv_b). */
void kn_mla_rowsum_i8(kn_level lv, const float *A, int64_t lda, const int8_t *B, int64_t ldb, const float *bs, int m,
                      int k0, int inc, int R, float *Y, int64_t ldy);
/* Scratch floats kn_mla_attend needs to run blocks of qb (1..16) queries
 * whose last position is ctx - 1 (kn_mla_attend_heads: qb heads). */
int64_t kn_mla_attend_floats(int R, int dr, int qb, int ctx);
/* For t < n, query t at position p = pos + t over cache rows 0..p:
 *   s_k = (op_dot(ql_t, c_k, R) + op_dot(qp_t, c_k + R, dr)) * scale,
 *   O[t*R ..] = sum_k softmax(s)_k c_k[0..R)      (= mla_attend_one)
 * ql [n][R], qp rows at stride ldqp, scratch of nscratch >=
 * kn_mla_attend_floats(R, dr, 1, pos + n) floats (more: larger blocks). */
void kn_mla_attend(kn_level lv, const float *cache, int R, int dr, float scale, const float *ql, const float *qp,
                   int64_t ldqp, int pos, int n, float *O, float *scratch, int64_t nscratch);
/* The same for m heads at ONE position p (decode), heads in the lanes: for
 * j < m, head j's query (ql rows at stride ldql, qp rows at stride ldqp)
 * over cache rows 0..p into O[j*ldo ..] (= mla_attend_one per head), each
 * cache row loaded once per block of heads. Scratch of nscratch >=
 * kn_mla_attend_floats(R, dr, 1, p + 1) floats (blocks of qb heads need
 * kn_mla_attend_floats(R, dr, qb, p + 1)); any block size, same bits. */
void kn_mla_attend_heads(kn_level lv, const float *cache, int R, int dr, float scale, const float *ql, int64_t ldql,
                         const float *qp, int64_t ldqp, int p, int m, float *O, int64_t ldo, float *scratch,
                         int64_t nscratch);
/* Level variants behind those two (x86: attn_mla_avx2.c, attn_mla_avx512.c);
 * the caller guarantees the CPU's level.
 * rowsum: as kn_mla_rowsum. scores: sc[j*ldsc + k] for j < m, k < kend from
 * qT [R + dr][lanes] (query j in lane j; lanes 8 for AVX2, 16 for AVX-512),
 * entries past a query's own position are left undefined. scores1: one
 * query, sc[k] for k < kend. */
void kn_mla_rowsum_avx2(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R,
                        float *Y, int64_t ldy);
void kn_mla_rowsum_avx512(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R,
                          float *Y, int64_t ldy);
void kn_mla_rowsum_bf16_avx2(const float *A, int64_t lda, const uint16_t *B, int64_t ldb, int m, int k0, int inc,
                             int R, float *Y, int64_t ldy);
void kn_mla_rowsum_bf16_avx512(const float *A, int64_t lda, const uint16_t *B, int64_t ldb, int m, int k0, int inc,
                               int R, float *Y, int64_t ldy);
void kn_mla_rowsum_i8_avx2(const float *A, int64_t lda, const int8_t *B, int64_t ldb, const float *bs, int m, int k0,
                           int inc, int R, float *Y, int64_t ldy);
void kn_mla_rowsum_i8_avx512(const float *A, int64_t lda, const int8_t *B, int64_t ldb, const float *bs, int m,
                             int k0, int inc, int R, float *Y, int64_t ldy);
void kn_mla_scores_avx2(const float *cache, int R, int dr, float scale, const float *qT, int m, int kend, float *sc,
                        int64_t ldsc);
void kn_mla_scores_avx512(const float *cache, int R, int dr, float scale, const float *qT, int m, int kend,
                          float *sc, int64_t ldsc);
void kn_mla_scores1_avx2(const float *cache, int R, int dr, float scale, const float *ql, const float *qp, int kend,
                         float *sc);
/* AArch64 (attn_mla_neon.c, only compiled there): same contracts. */
void kn_mla_rowsum_neon(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R,
                        float *Y, int64_t ldy);
void kn_mla_rowsum_bf16_neon(const float *A, int64_t lda, const uint16_t *B, int64_t ldb, int m, int k0, int inc,
                             int R, float *Y, int64_t ldy);
void kn_mla_rowsum_i8_neon(const float *A, int64_t lda, const int8_t *B, int64_t ldb, const float *bs, int m, int k0,
                           int inc, int R, float *Y, int64_t ldy);
void kn_mla_scores1_neon(const float *cache, int R, int dr, float scale, const float *ql, const float *qp, int kend,
                         float *sc);
/* qT [R + dr][4]: 4 lanes. */
void kn_mla_scores_neon(const float *cache, int R, int dr, float scale, const float *qT, int m, int kend, float *sc,
                        int64_t ldsc);


/* ---- KDA: the delta-rule recurrence of one head (attn_kda.c dispatches;
 * attn_kda_avx2.c, attn_kda_avx512.c, attn_kda_neon.c are its SIMD forms) ----
 *
 * For t < n, with S [D][D] (S[k][v], row-major, updated in place):
 *   S = diag(decay_t) S;  u = v_t - S^T k_t;  S += beta_t k_t u^T;  o_t = S^T q_t
 * Per element that is exactly kda_recur_head's sequence (kda_core.c): row d
 * of S times decay_t[d]; u[e] = v[e], then u[e] += (-k[d]) * S[d][e] for d in
 * order; S[d][e] += (beta_t * k[d]) * u[e]; o[e] = 0, then o[e] += q[d] *
 * S[d][e] for d in order. Every product is rounded before its add (never
 * fused) and no sum is reordered, so EVERY LEVEL GIVES THE SAME BITS; the
 * SIMD forms only run columns e side by side. */
typedef struct {
    int D, n;                   /* head dim, tokens */
    float *S;                   /* [D][D] state, in place */
    const float *q, *k, *v;     /* token t at + t * ld, D floats each (q, k already normalised) */
    const float *decay;         /* token t at + t * ld: D per-row factors */
    int64_t ld;                 /* token stride of q, k, v, decay and o */
    const float *beta;          /* [n] */
    float *o;                   /* out: token t at + t * ld, D floats */
    float *trail;               /* NULL, or S after token t is copied to trail + t * trail_ld */
    int64_t trail_ld;
} kn_kda_head;

void kn_kda_recur(kn_level lv, const kn_kda_head *a);
/* The level forms behind kn_kda_recur (call it instead; the caller
 * guarantees the CPU has the level). */
void kn_kda_recur_avx2(const kn_kda_head *a);
void kn_kda_recur_avx512(const kn_kda_head *a);
void kn_kda_recur_neon(const kn_kda_head *a);

/* The KDA short convolution + SiLU of nc channels over n tokens, channel c
 * exactly kda_conv_channel's (kda_core.c) per-channel math: for t < n in
 * order, with win = [the W-1 inputs in st | x_t], acc = 0, then acc +=
 * w[q] * win[q] for q < W in order, x_t = acc / (1 + expf(-acc)) (op_silu);
 * st then holds the last W-1 raw inputs. The SIMD forms run channels side by
 * side (expf stays libm's, one call per value), so every level gives the
 * same bits. */
typedef struct {
    int W, nc, n;               /* kernel width (1..16), channels, tokens */
    float *x;                   /* token t, channel c at x[t * ld + c]: raw in, SiLU(conv) out */
    int64_t ld;
    const float *w;             /* [nc][W] */
    float *st;                  /* [nc][W-1], oldest first: read, then updated */
    float *trail;               /* NULL, or st after token t is written to trail + t * trail_ld */
    int64_t trail_ld;
} kn_kda_conv_args;

void kn_kda_conv(kn_level lv, const kn_kda_conv_args *a);
/* The level forms: each does the first channels it can (a multiple of its
 * vector width; 0 for a W it has no form for) and returns how many; the
 * dispatcher runs the rest in plain C. */
int kn_kda_conv_avx2(const kn_kda_conv_args *a);
int kn_kda_conv_avx512(const kn_kda_conv_args *a);
#endif
