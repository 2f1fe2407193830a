/* attn_mla.c — the MLA attention kernels' dispatch point and scalar level.
 *
 * Owns: kn_mla_rowsum (the absorb W_UK^T q and the value sum P C, one
 * form; kn_mla_rowsum_bf16 / _i8 the same over bf16 rows of B or int8 rows
 * with a scale each), kn_mla_attend (scores, softmax, value sum for a block of queries of
 * one head), kn_mla_attend_heads (the same for a block of heads at one
 * position: decode) and kn_mla_attend_floats (their scratch). The scalar level is the
 * plain C of mla_core.c's mla_attend_one and of mla.c's former absorb loop
 * (op_dot, op_softmax, op_axpy), so every level is bit-identical to it.
 * Refuses: ISA-specific code (attn_mla_avx2.c / attn_mla_avx512.c / attn_mla_neon.c have it;
 * this file is compiled without -m flags), allocation, threads.
 *
 * Why SIMD can be exact here: op_dot keeps four partial sums s0..s3 (i mod
 * 4) and op_axpy is elementwise, so the variants put QUERIES (or rows) in
 * the lanes, each lane running one query's scalar sequence unchanged, and
 * share every cache row load across a block of queries:
 *
 *   scores  lane j = query j:  s_{i%4}[j] += qT[i][j] * c_k[i]  (broadcast)
 *   values  lane = r:          o_j[r] += p_j[k] * c_k[r]        (ascending k)
 *
 * HEADS at one position fill the lanes the same way (decode: one query per
 * head, every head over the same cache rows), so the cache is read once per
 * block of heads instead of once per head. A query's scores past its own
 * position are computed for the block and never read. Softmax stays scalar (expf, a double sum).
 *
 * NEON has four lanes, which op_dot's partial sums fill already: its
 * queries' scores run one query at a time, eight cache rows side by side;
 * its heads' scores put 4 heads in the lanes (one cache row load per 4
 * heads, the same multiply-adds).
 *
 * Sections: scalar level; scratch and dispatch.
 */
#include "kernels.h"
#include "ops.h"
#include "../format/dtype.h"
#include "../base/err.h"
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#define KN_X86 1
#elif defined(__aarch64__)
#define KN_ARM64 1
#endif

enum { QB_MAX = 16 }; /* queries per block (scores rows kept in scratch) */

/* ---- scalar level ---- */

static void rowsum_scalar(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R,
                          float *Y, int64_t ldy) {
    for (int j = 0; j < m; j++) {
        float *y = Y + (int64_t)j * ldy;
        memset(y, 0, (size_t)R * sizeof(float));
        for (int k = 0; k < k0 + j * inc; k++) op_axpy(y, A[(int64_t)j * lda + k], B + (int64_t)k * ldb, R);
    }
}

static void rowsum_bf16_scalar(const float *A, int64_t lda, const uint16_t *B, int64_t ldb, int m, int k0, int inc,
                               int R, float *Y, int64_t ldy) {
    for (int j = 0; j < m; j++) {
        float *y = Y + (int64_t)j * ldy;
        memset(y, 0, (size_t)R * sizeof(float));
        for (int k = 0; k < k0 + j * inc; k++) {
            const float a = A[(int64_t)j * lda + k];
            const uint16_t *b = B + (int64_t)k * ldb;
            for (int r = 0; r < R; r++) y[r] += a * bf16_to_f32(b[r]); /* op_axpy's step */
        }
    }
}

static void rowsum_i8_scalar(const float *A, int64_t lda, const int8_t *B, int64_t ldb, const float *bs, int m, int k0,
                             int inc, int R, float *Y, int64_t ldy) {
    for (int j = 0; j < m; j++) {
        float *y = Y + (int64_t)j * ldy;
        memset(y, 0, (size_t)R * sizeof(float));
        for (int k = 0; k < k0 + j * inc; k++) {
            const float a = A[(int64_t)j * lda + k], s = bs[k];
            const int8_t *b = B + (int64_t)k * ldb;
            for (int r = 0; r < R; r++) y[r] += a * ((float)b[r] * s); /* kn_dequant_row's value, op_axpy's step */
        }
    }
}

/* mla_attend_one's arithmetic, query by query. */
static void attend_scalar(const float *cache, int R, int dr, float scale, const float *ql, const float *qp,
                          int64_t ldqp, int pos, int n, float *O, float *sc) {
    int64_t stride = (int64_t)R + dr;
    for (int t = 0; t < n; t++) {
        const float *q = ql + (int64_t)t * R, *qr = qp + (int64_t)t * ldqp;
        int p = pos + t;
        for (int k = 0; k <= p; k++) {
            const float *c = cache + (int64_t)k * stride;
            sc[k] = (op_dot(q, c, R) + op_dot(qr, c + R, dr)) * scale;
        }
        op_softmax(sc, p + 1);
        rowsum_scalar(sc, 0, cache, stride, 1, p + 1, 0, R, O + (int64_t)t * R, R);
    }
}

/* ---- scratch and dispatch ---- */

static int64_t score_ld(int ctx) { return ((int64_t)ctx + 15) / 16 * 16; }

int64_t kn_mla_attend_floats(int R, int dr, int qb, int ctx) {
    return ((int64_t)R + dr) * QB_MAX + (int64_t)qb * score_ld(ctx);
}

/* The level a rowsum runs at (*lv capped to this CPU; AMX changes the
 * weight products only), 0 when there is nothing to sum. */
static int rowsum_level(kn_level *lv, int m, int k0, int inc, int R) {
    if (m <= 0 || R <= 0) return 0;
    ASSERT(k0 >= 0 && (inc == 0 || inc == 1));
    if (!kn_level_available(*lv)) *lv = kn_detect(); /* never run instructions the CPU lacks */
    if (*lv == KN_AMX) *lv = KN_AVX512;
    return 1;
}

void kn_mla_rowsum(kn_level lv, const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc,
                   int R, float *Y, int64_t ldy) {
    if (!rowsum_level(&lv, m, k0, inc, R)) return;
#if KN_X86
    if (lv == KN_AVX512) { kn_mla_rowsum_avx512(A, lda, B, ldb, m, k0, inc, R, Y, ldy); return; }
    if (lv == KN_AVX2) { kn_mla_rowsum_avx2(A, lda, B, ldb, m, k0, inc, R, Y, ldy); return; }
#elif KN_ARM64
    if (lv == KN_NEON) { kn_mla_rowsum_neon(A, lda, B, ldb, m, k0, inc, R, Y, ldy); return; }
#endif
    rowsum_scalar(A, lda, B, ldb, m, k0, inc, R, Y, ldy);
}

void kn_mla_rowsum_bf16(kn_level lv, const float *A, int64_t lda, const uint16_t *B, int64_t ldb, int m, int k0,
                        int inc, int R, float *Y, int64_t ldy) {
    if (!rowsum_level(&lv, m, k0, inc, R)) return;
#if KN_X86
    if (lv == KN_AVX512) { kn_mla_rowsum_bf16_avx512(A, lda, B, ldb, m, k0, inc, R, Y, ldy); return; }
    if (lv == KN_AVX2) { kn_mla_rowsum_bf16_avx2(A, lda, B, ldb, m, k0, inc, R, Y, ldy); return; }
#elif KN_ARM64
    if (lv == KN_NEON) { kn_mla_rowsum_bf16_neon(A, lda, B, ldb, m, k0, inc, R, Y, ldy); return; }
#endif
    rowsum_bf16_scalar(A, lda, B, ldb, m, k0, inc, R, Y, ldy);
}

void kn_mla_rowsum_i8(kn_level lv, const float *A, int64_t lda, const int8_t *B, int64_t ldb, const float *bs, int m,
                      int k0, int inc, int R, float *Y, int64_t ldy) {
    if (!rowsum_level(&lv, m, k0, inc, R)) return;
#if KN_X86
    if (lv == KN_AVX512) { kn_mla_rowsum_i8_avx512(A, lda, B, ldb, bs, m, k0, inc, R, Y, ldy); return; }
    if (lv == KN_AVX2) { kn_mla_rowsum_i8_avx2(A, lda, B, ldb, bs, m, k0, inc, R, Y, ldy); return; }
#elif KN_ARM64
    if (lv == KN_NEON) { kn_mla_rowsum_i8_neon(A, lda, B, ldb, bs, m, k0, inc, R, Y, ldy); return; }
#endif
    rowsum_i8_scalar(A, lda, B, ldb, bs, m, k0, inc, R, Y, ldy);
}

#if KN_X86 || KN_ARM64
/* qT[i][j] = query (or head) j's element i (ql rows at stride ldql, then
 * qp rows at stride ldqp), lanes past m zero. */
static inline void transpose_block(const float *ql, int64_t ldql, const float *qp, int64_t ldqp, int R, int dr, int m,
                                   int lanes, float *qT) {
    memset(qT, 0, ((size_t)R + dr) * lanes * sizeof(float));
    for (int j = 0; j < m; j++) {
        const float *a = ql + (int64_t)j * ldql, *b = qp + (int64_t)j * ldqp;
        for (int i = 0; i < R; i++) qT[(int64_t)i * lanes + j] = a[i];
        for (int i = 0; i < dr; i++) qT[((int64_t)R + i) * lanes + j] = b[i];
    }
}

/* One level's kernels: scores of a block of queries or heads in the lanes
 * (qlanes 0: queries take scores1 one at a time; hlanes: heads per call),
 * one query's scores, the row sums. */
typedef struct {
    int qlanes, hlanes;
    void (*scores)(const float *cache, int R, int dr, float scale, const float *qT, int m, int kend, float *sc,
                   int64_t ldsc);
    void (*scores1)(const float *cache, int R, int dr, float scale, const float *ql, const float *qp, int kend,
                    float *sc);
    void (*rowsum)(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R, float *Y,
                   int64_t ldy);
} level_kernels;

#if KN_X86
static const level_kernels k512 = {16, 16, kn_mla_scores_avx512, kn_mla_scores1_avx2, kn_mla_rowsum_avx512},
                           k2 = {8, 8, kn_mla_scores_avx2, kn_mla_scores1_avx2, kn_mla_rowsum_avx2};
#else
static const level_kernels kneon = {0, 4, kn_mla_scores_neon, kn_mla_scores1_neon, kn_mla_rowsum_neon};
#endif

/* Blocks of up to qb queries: scores (queries in the lanes when at least 4
 * fill them, else one query at a time), softmax per query, value sums. */
static void attend_simd(const level_kernels *kk, const float *cache, int R, int dr, float scale, const float *ql,
                        const float *qp, int64_t ldqp, int pos, int n, float *O, float *scratch, int64_t nscratch) {
    const int64_t ld = score_ld(pos + n), stride = (int64_t)R + dr;
    float *qT = scratch, *sc = scratch + ((int64_t)R + dr) * QB_MAX;
    int64_t qb = (nscratch - ((int64_t)R + dr) * QB_MAX) / ld;
    if (qb > QB_MAX) qb = QB_MAX;
    for (int t0 = 0; t0 < n; t0 += (int)qb) {
        int m = n - t0 < qb ? n - t0 : (int)qb;
        for (int s0 = 0; s0 < m;) {
            int t = t0 + s0, ms = kk->qlanes && m - s0 >= 4 ? (m - s0 < kk->qlanes ? m - s0 : kk->qlanes) : 1;
            if (ms >= 4) {
                transpose_block(ql + (int64_t)t * R, R, qp + (int64_t)t * ldqp, ldqp, R, dr, ms, kk->qlanes, qT);
                kk->scores(cache, R, dr, scale, qT, ms, pos + t + ms, sc + s0 * ld, ld);
            } else {
                kk->scores1(cache, R, dr, scale, ql + (int64_t)t * R, qp + (int64_t)t * ldqp, pos + t + 1, sc + s0 * ld);
            }
            s0 += ms;
        }
        for (int j = 0; j < m; j++) op_softmax(sc + j * ld, pos + t0 + j + 1);
        kk->rowsum(sc, ld, cache, stride, m, pos + t0 + 1, 1, R, O + (int64_t)t0 * R, R);
    }
}

/* Blocks of up to qb heads at one position p: scores (heads in the lanes
 * when at least 4 fill them, else one head at a time), softmax per head,
 * value sums of the block sharing each cache row load (rowsum, inc 0). */
static void heads_simd(const level_kernels *kk, const float *cache, int R, int dr, float scale, const float *ql,
                       int64_t ldql, const float *qp, int64_t ldqp, int p, int m, float *O, int64_t ldo,
                       float *scratch, int64_t nscratch) {
    const int64_t ld = score_ld(p + 1), stride = (int64_t)R + dr;
    float *qT = scratch, *sc = scratch + ((int64_t)R + dr) * QB_MAX;
    int64_t qb = (nscratch - ((int64_t)R + dr) * QB_MAX) / ld;
    if (qb > QB_MAX) qb = QB_MAX;
    for (int j0 = 0; j0 < m; j0 += (int)qb) {
        int mb = m - j0 < qb ? m - j0 : (int)qb;
        for (int s0 = 0; s0 < mb;) {
            int j = j0 + s0, ms = mb - s0 >= 4 ? (mb - s0 < kk->hlanes ? mb - s0 : kk->hlanes) : 1;
            if (ms >= 4) {
                transpose_block(ql + (int64_t)j * ldql, ldql, qp + (int64_t)j * ldqp, ldqp, R, dr, ms, kk->hlanes, qT);
                kk->scores(cache, R, dr, scale, qT, ms, p + 1, sc + s0 * ld, ld);
            } else {
                kk->scores1(cache, R, dr, scale, ql + (int64_t)j * ldql, qp + (int64_t)j * ldqp, p + 1, sc + s0 * ld);
            }
            s0 += ms;
        }
        for (int j = 0; j < mb; j++) op_softmax(sc + j * ld, p + 1);
        kk->rowsum(sc, ld, cache, stride, mb, p + 1, 0, R, O + (int64_t)j0 * ldo, ldo);
    }
}
#endif

void kn_mla_attend(kn_level lv, const float *cache, int R, int dr, float scale, const float *ql, const float *qp,
                   int64_t ldqp, int pos, int n, float *O, float *scratch, int64_t nscratch) {
    if (n <= 0) return;
    ASSERT(R > 0 && dr >= 0 && pos >= 0 && nscratch >= kn_mla_attend_floats(R, dr, 1, pos + n));
    if (!kn_level_available(lv)) lv = kn_detect(); /* never run instructions the CPU lacks */
    if (lv == KN_AMX) lv = KN_AVX512;               /* AMX changes the weight products only */
#if KN_X86
    if (lv == KN_AVX512 || lv == KN_AVX2) {
        attend_simd(lv == KN_AVX512 ? &k512 : &k2, cache, R, dr, scale, ql, qp, ldqp, pos, n, O, scratch, nscratch);
        return;
    }
#elif KN_ARM64
    if (lv == KN_NEON) {
        attend_simd(&kneon, cache, R, dr, scale, ql, qp, ldqp, pos, n, O, scratch, nscratch);
        return;
    }
#endif
    attend_scalar(cache, R, dr, scale, ql, qp, ldqp, pos, n, O, scratch);
}

void kn_mla_attend_heads(kn_level lv, const float *cache, int R, int dr, float scale, const float *ql, int64_t ldql,
                         const float *qp, int64_t ldqp, int p, int m, float *O, int64_t ldo, float *scratch,
                         int64_t nscratch) {
    if (m <= 0) return;
    ASSERT(R > 0 && dr >= 0 && p >= 0 && nscratch >= kn_mla_attend_floats(R, dr, 1, p + 1));
    if (!kn_level_available(lv)) lv = kn_detect(); /* never run instructions the CPU lacks */
    if (lv == KN_AMX) lv = KN_AVX512;               /* AMX changes the weight products only */
#if KN_X86
    if (lv == KN_AVX512 || lv == KN_AVX2) {
        heads_simd(lv == KN_AVX512 ? &k512 : &k2, cache, R, dr, scale, ql, ldql, qp, ldqp, p, m, O, ldo, scratch,
                   nscratch);
        return;
    }
#elif KN_ARM64
    if (lv == KN_NEON) {
        heads_simd(&kneon, cache, R, dr, scale, ql, ldql, qp, ldqp, p, m, O, ldo, scratch, nscratch);
        return;
    }
#endif
    for (int j = 0; j < m; j++) /* mla_attend_one's arithmetic, head by head */
        attend_scalar(cache, R, dr, scale, ql + (int64_t)j * ldql, qp + (int64_t)j * ldqp, 0, p, 1,
                      O + (int64_t)j * ldo, scratch);
}
