/* matvec_prefetch.h — the software prefetches the x86 tiles share
 * (matvec_avx2.c, matvec_avx512.c): SSE instructions, so one copy serves
 * both levels.
 *
 * Owns: the default distance (KN_PF: AVX2 256 bytes; matvec_avx512.c sets
 * 512, see there), the tile-ahead prefetch at either cache level (kn_pf_next),
 * the within-row stream prefetch (kn_pf) and the
 * head of the next tile's rows (kn_pf_rows, kn_pf_nib_rows), a tile's step
 * over its rows or the next tile's (kn_pf_step). Refuses: any
 * arithmetic on weights. A tile's rows are short streams (3.6 KB for a
 * 7168-column MXFP4 row): the within-row prefetch only runs KN_PF bytes
 * ahead of the tile, so without the next tile's heads every tile began with
 * its rows cold (two cores of a 2-vCPU Zen 5 VM, MXFP4 matvec from DRAM:
 * 23-26 -> 31-33 GB/s, bench/kn_pair.sh).
 */
#ifndef DF_KERNELS_MATVEC_PREFETCH_H
#define DF_KERNELS_MATVEC_PREFETCH_H
#include "../format/weight.h"
#include <stdint.h>
#include <xmmintrin.h>

#ifndef KN_PF
#define KN_PF 256 /* bytes ahead (a level may set its own before including this) */
#endif

#define KN_PF_AI static inline __attribute__((always_inline))

/* The next `bytes` of a row stream at p, KN_PF bytes ahead (one per line). */
KN_PF_AI void kn_pf(const void *p, int bytes) {
    _Pragma("GCC unroll 8") for (int o = 0; o < bytes; o += 64)
        _mm_prefetch((const char *)p + KN_PF + o, _MM_HINT_T0);
}

/* The first KN_PF bytes of rows [r, r + nr) that exist. */
KN_PF_AI void kn_pf_rows(const void *base, int64_t row_bytes, int64_t r, int nr, int64_t rows) {
    _Pragma("GCC unroll 8") for (int j = 0; j < nr; j++) {
        if (r + j >= rows) break;
        const char *p = (const char *)base + (r + j) * row_bytes;
        _Pragma("GCC unroll 8") for (int o = 0; o < KN_PF; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    }
}

/* kn_pf_rows for a 4-bit matrix (cols / 2 bytes a row), and the first line
 * of those rows' group scales (cols / 32 of ssz bytes each). */
KN_PF_AI void kn_pf_nib_rows(const df_weight *w, int64_t r, int nr, int ssz) {
    const int64_t ng = w->cols / 32;
    kn_pf_rows(w->data, w->cols / 2, r, nr, w->rows);
    _Pragma("GCC unroll 8") for (int j = 0; j < nr; j++) {
        if (r + j >= w->rows) break;
        _mm_prefetch((const char *)w->scale + (r + j) * ng * ssz, _MM_HINT_T0);
    }
}
/* The tile-ahead prefetch of one line at p: into L1 (T0) where l1, else
 * into L2 (T1). l1 is a compile-time constant in every tile (a one-vector
 * tile exists in both forms; matvec_driver.h), and the driver picks the form
 * the CPU streams better with (kn_pf_next_l1, matvec.c). */
KN_PF_AI void kn_pf_next(const void *p, int l1) {
    if (l1) _mm_prefetch((const char *)p, _MM_HINT_T0);
    else _mm_prefetch((const char *)p, _MM_HINT_T1);
}

/* One step of a tile's row streams, off bytes into each of its nr rows q:
 * with next (kn_pf_next_tile) the same bytes of the next tile's rows
 * (kn_pf_next at level l1), else KN_PF bytes ahead in its own (64 bytes of
 * each). */
KN_PF_AI void kn_pf_step(const uint8_t *const *q, int nr, int64_t next, int64_t off, int l1) {
    if (next)
        _Pragma("GCC unroll 8") for (int j = 0; j < nr; j++) kn_pf_next(q[j] + next + off, l1);
    else
        _Pragma("GCC unroll 8") for (int j = 0; j < nr; j++) kn_pf(q[j] + off, 64);
}

/* Bytes from a tile's rows to those `ahead` tiles on (the tile-ahead
 * prefetch of one-vector tiles: each step prefetches the columns it reads
 * there), fewer tiles where the matrix ends sooner, or 0 where that does
 * not apply: many vectors, or no whole next tile. */
KN_PF_AI int64_t kn_pf_next_tile(int64_t rows, int64_t r, int nr, int nv, int64_t row_bytes, int ahead) {
    if (nv != 1) return 0;
    while (ahead > 0 && r + (ahead + 1) * (int64_t)nr > rows) ahead--;
    return ahead * nr * row_bytes;
}

#undef KN_PF_AI
#endif
