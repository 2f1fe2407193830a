/* attn_mla_simd.h — the MLA attention kernels' rowsum and scores, written
 * once for the x86 levels.
 *
 * Owns: nothing by itself; attn_mla_avx2.c and attn_mla_avx512.c define the
 * vector type and operations below, then include this file, which defines
 * MLA_ROWSUM (kn_mla_rowsum's level form), MLA_ROWSUM_BF16 and
 * MLA_ROWSUM_I8 (the same over bf16 rows of B, or int8 rows with a scale
 * each: kn_mla_rowsum_bf16 / _i8) and MLA_SCORES (kn_mla_scores's).
 *   MV, MMASK     vector of ML floats, a lane mask for the ragged end of R
 *   M_RS_V        vectors per rowsum tile (4 queries x M_RS_V vectors)
 *   M_SC_G        cache rows scored side by side
 *   M_ZERO M_SET1 M_ADD M_MUL M_LOADU M_STOREU M_MASKLOAD M_MASKSTORE
 *   M_MASK_ALL M_MASK_TAIL(n)
 *   M_LOADU_BF16(p) M_LOADN_BF16(p, n)   ML (or n < ML) bf16 widened to fp32
 *   M_LOADU_I8(p) M_LOADN_I8(p, n)       ML (or n < ML) int8 as fp32
 * Refuses anything that changes a bit against the scalar level: no FMA (a
 * multiply, then an add), no reassociation; each lane runs one scalar
 * sequence of op_dot / op_axpy.
 *
 * rowsum: a tile of J rows of A (queries) x V vectors of ML columns stays in
 * registers while k runs over a block of KB rows of B (kept in L2), so a B
 * row is loaded once per J queries and Y is read back once per block; the
 * block's first tile asks for its whole rows a few rows ahead (rs_prefetch_row).
 * scores: ML queries in the lanes (qT), G cache rows at a time, four partial
 * sums each; the cache element is broadcast.
 *
 * Sections: rowsum; scores.
 */
enum { KB = 128 }; /* B rows per block: 128 x (512 + 64) floats = 288 KiB, in L2 */
enum { B_F32, B_BF16, B_I8 }; /* what B holds */

/* ---- rowsum ---- */

/* A tile walks its columns of B down the rows, a line or two of each: the
 * first column tile of a block asks for whole rows RS_PF_ROWS ahead, so the
 * block comes in row by row while it is read and the later column tiles
 * find it in cache. Decode's absorb reads one head's 128 x 512 bf16 W_UK
 * this way; without it each row's lines came at DRAM latency (a 2-vCPU Zen
 * 5 VM, K8g decode at 2 threads, timers around MLA's stages, three
 * alternating rounds: the heads' stage 1.02 / 0.89 / 0.85 -> 0.87 / 0.77 /
 * 0.80 ms a token). Prefetches only: no value changes. */
enum { RS_PF_ROWS = 8 };
/* len bytes of row k of B (rows `stride` bytes apart), if k < ke */
AI void rs_prefetch_row(const void *B, int64_t stride, int64_t len, int k, int ke) {
    if (k >= ke) return;
    const char *p = (const char *)B + (int64_t)k * stride;
    for (int64_t o = 0; o < len; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Y rows 0..J-1 (at stride ldy), columns [0, ML V), terms
 * k in [kb, ke); query jj takes k < cnt0 + jj * inc. B holds fp32 (bt
 * B_F32), bf16 (B_BF16: widened exactly as it is loaded) or int8 rows with a
 * scale each (B_I8: (float)q * bs[k], one rounding, as kn_dequant_row):
 * the same terms as fp32 B of those values. The last vector holds `tailn`
 * columns (mask `tail`) when `masked` (the ragged end of R). */
AI void rs_tile(const float *A, int64_t lda, const void *B, int64_t ldb, const float *bs, float *Y, int64_t ldy,
                int kb, int ke, int cnt0, int inc, const int J, const int V, const int masked, MMASK tail, int tailn,
                const int bt, int64_t pf_len) {
    const size_t esz = bt == B_BF16 ? sizeof(uint16_t) : bt == B_I8 ? 1 : sizeof(float);
#define LD(p) (masked && v == V - 1 ? M_MASKLOAD((p), tail) : M_LOADU(p))
#define LDB(i)                                                                                                     \
    (bt == B_BF16 ? (masked && v == V - 1 ? M_LOADN_BF16((const uint16_t *)B + (i), tailn)                          \
                                          : M_LOADU_BF16((const uint16_t *)B + (i)))                                \
     : bt == B_I8 ? M_MUL(masked && v == V - 1 ? M_LOADN_I8((const int8_t *)B + (i), tailn)                        \
                                               : M_LOADU_I8((const int8_t *)B + (i)),                              \
                          M_SET1(bs[k]))                                                                            \
                  : LD((const float *)B + (i)))
    MV acc[4][4];
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++)
            acc[jj][v] = LD(Y + jj * ldy + ML * v);
    int kfull = cnt0 < ke ? cnt0 : ke, kmax = cnt0 + (J - 1) * inc;
    if (kmax > ke) kmax = ke;
    int k = kb;
    for (; k < kfull; k++) { /* every query of the tile takes row k */
        if (pf_len) rs_prefetch_row(B, ldb * (int64_t)esz, pf_len, k + RS_PF_ROWS, ke);
        MV bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++)
            bv[v] = LDB(k * ldb + ML * v);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            MV a = M_SET1(A[jj * lda + k]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[jj][v] = M_ADD(acc[jj][v], M_MUL(a, bv[v]));
        }
    }
    for (; k < kmax; k++) { /* the causal edge: query jj stops at cnt0 + jj */
        if (pf_len) rs_prefetch_row(B, ldb * (int64_t)esz, pf_len, k + RS_PF_ROWS, ke);
        MV bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++)
            bv[v] = LDB(k * ldb + ML * v);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            if (k >= cnt0 + jj * inc) continue;
            MV a = M_SET1(A[jj * lda + k]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[jj][v] = M_ADD(acc[jj][v], M_MUL(a, bv[v]));
        }
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) {
            if (masked && v == V - 1) M_MASKSTORE(Y + jj * ldy + ML * v, tail, acc[jj][v]);
            else M_STOREU(Y + jj * ldy + ML * v, acc[jj][v]);
        }
#undef LDB
#undef LD
}

/* One tile of J queries over all columns, k in [kb, ke). */
AI void rs_rows(const float *A, int64_t lda, const void *B, int64_t ldb, const float *bs, float *Y, int64_t ldy,
                int kb, int ke, int cnt0, int inc, int R, const int J, const int bt, int first) {
    const size_t esz = bt == B_BF16 ? sizeof(uint16_t) : bt == B_I8 ? 1 : sizeof(float);
    const char *b = B;
    /* the block's first queries: their first tile (at column 0) asks for
     * the block's whole rows, R columns each */
    int64_t pf = first ? R * (int64_t)esz : 0;
    for (int k = kb; pf && k < kb + RS_PF_ROWS; k++) rs_prefetch_row(b, ldb * (int64_t)esz, pf, k, ke);
    int r = 0;
    for (; r + ML * M_RS_V <= R; r += ML * M_RS_V, pf = 0)
        rs_tile(A, lda, b + r * esz, ldb, bs, Y + r, ldy, kb, ke, cnt0, inc, J, M_RS_V, 0, M_MASK_ALL, 0, bt, pf);
    for (; r + ML <= R; r += ML, pf = 0)
        rs_tile(A, lda, b + r * esz, ldb, bs, Y + r, ldy, kb, ke, cnt0, inc, J, 1, 0, M_MASK_ALL, 0, bt, pf);
    if (r < R)
        rs_tile(A, lda, b + r * esz, ldb, bs, Y + r, ldy, kb, ke, cnt0, inc, J, 1, 1, M_MASK_TAIL(R - r), R - r, bt, pf);
}

AI void rowsum_body(const float *A, int64_t lda, const void *B, int64_t ldb, const float *bs, int m, int k0, int inc,
                    int R, float *Y, int64_t ldy, const int bt) {
    for (int j = 0; j < m; j++)
        for (int r = 0; r < R; r++) Y[(int64_t)j * ldy + r] = 0.0f;
    int kend = k0 + (m - 1) * inc;
    for (int kb = 0; kb < kend; kb += KB) {
        int ke = kb + KB < kend ? kb + KB : kend;
        int j = 0;
        for (; j + 4 <= m; j += 4)
            rs_rows(A + (int64_t)j * lda, lda, B, ldb, bs, Y + (int64_t)j * ldy, ldy, kb, ke, k0 + j * inc, inc, R, 4,
                    bt, j == 0);
        for (; j < m; j++)
            rs_rows(A + (int64_t)j * lda, lda, B, ldb, bs, Y + (int64_t)j * ldy, ldy, kb, ke, k0 + j * inc, inc, R, 1,
                    bt, j == 0);
    }
}

void MLA_ROWSUM(const float *A, int64_t lda, const float *B, int64_t ldb, int m, int k0, int inc, int R, float *Y,
                int64_t ldy) {
    rowsum_body(A, lda, B, ldb, NULL, m, k0, inc, R, Y, ldy, B_F32);
}

void MLA_ROWSUM_BF16(const float *A, int64_t lda, const uint16_t *B, int64_t ldb, int m, int k0, int inc, int R,
                     float *Y, int64_t ldy) {
    rowsum_body(A, lda, B, ldb, NULL, m, k0, inc, R, Y, ldy, B_BF16);
}

void MLA_ROWSUM_I8(const float *A, int64_t lda, const int8_t *B, int64_t ldb, const float *bs, int m, int k0, int inc,
                   int R, float *Y, int64_t ldy) {
    rowsum_body(A, lda, B, ldb, bs, m, k0, inc, R, Y, ldy, B_I8);
}

/* ---- scores ---- */

/* op_dot(q_j, c_g, n) for the ML queries j of qT (row stride ML) and G rows
 * c_g: four partial sums over i mod 4, the tail into s0, (s0+s1)+(s2+s3). */
AI void dot_g(const float *qT, const float *const *c, int off, int n, const int G, MV *out) {
    MV s[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) s[g][p] = M_ZERO();
    int i = 0;
    for (; i + 4 <= n; i += 4) {
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            MV q = M_LOADU(qT + (int64_t)(i + p) * ML);
#pragma GCC unroll 4
            for (int g = 0; g < G; g++)
                s[g][p] = M_ADD(s[g][p], M_MUL(q, M_SET1(c[g][off + i + p])));
        }
    }
    for (; i < n; i++) {
        MV q = M_LOADU(qT + (int64_t)i * ML);
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) s[g][0] = M_ADD(s[g][0], M_MUL(q, M_SET1(c[g][off + i])));
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
        out[g] = M_ADD(M_ADD(s[g][0], s[g][1]), M_ADD(s[g][2], s[g][3]));
}

AI void scores_g(const float *cache, int R, int dr, MV scale, const float *qT, int m, int k, float *sc,
                 int64_t ldsc, const int G) {
    const float *c[4];
    int64_t stride = (int64_t)R + dr;
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) c[g] = cache + (int64_t)(k + g) * stride;
    MV nope[4], rope[4];
    dot_g(qT, c, 0, R, G, nope);
    dot_g(qT + (int64_t)R * ML, c, R, dr, G, rope);
    float tmp[4][ML];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) M_STOREU(tmp[g], M_MUL(M_ADD(nope[g], rope[g]), scale));
    for (int j = 0; j < m; j++)
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) sc[j * ldsc + k + g] = tmp[g][j];
}

void MLA_SCORES(const float *cache, int R, int dr, float scale, const float *qT, int m, int kend, float *sc,
                int64_t ldsc) {
    MV vs = M_SET1(scale);
    int k = 0;
    for (; k + M_SC_G <= kend; k += M_SC_G) scores_g(cache, R, dr, vs, qT, m, k, sc, ldsc, M_SC_G);
    for (; k < kend; k++) scores_g(cache, R, dr, vs, qT, m, k, sc, ldsc, 1);
}
