/* matvec.c — CPU detection, level dispatch and the scalar reference kernels.
 *
 * Owns: kn_detect / kn_level_name, kn_dequant_row (the exact decode every
 * other kernel is measured against), the plain C matvec per weight type (the
 * KN_SCALAR level and the oracle of the SIMD variants), and the dispatch that
 * sends kn_matvec / kn_matmul to matvec_amx.c, matvec_avx512.c or matvec_avx2.c
 * (matvec_avxvnni.c on CPUs with AVX-VNNI) (x86) or
 * matvec_neon.c (AArch64), falling back one level whenever a variant declines
 * a type.
 * Refuses: any ISA-specific code (this file is compiled without -m flags) and
 * any allocation.
 *
 * Value computed (fp32 throughout; x is never rounded to a narrower type):
 *   f32/bf16/f16:   y[r] = sum_c W[r][c] * x[c] (weights decode exactly);
 *   scaled types:   y[r] = sum_blocks scale_b * (sum_{c in b} code_c * x[c]):
 *                   the code values (fp8, int4 q-8, e2m1) are exact in fp32,
 *                   each group/block partial sum is multiplied by its scale
 *                   (fp8 block, int4/mxfp4 group of 32, i8 the whole row).
 *   Exception: the AVX-512 int4/mxfp4 kernels fold the scale into the code
 *   table (exactly kn_dequant_row's value) instead of scaling the partial.
 * Every form has the same error bound, (cols + 2) * 2^-24 * sum_c |w x|, and
 * a one-hot x reproduces kn_dequant_row bit-exactly at every level. The
 * levels differ only in summation order (scalar: one accumulator per group,
 * left to right; SIMD: fixed lanes, one or two accumulators per row by
 * level and type, fixed tree).
 *
 * Sections: 1. detection  2. dequant  3. scalar dot per type  4. dispatch
 */
#include "kernels.h"
#include "matvec_driver.h"
#include "../base/err.h"
#include <math.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#define KN_X86 1
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__aarch64__)
#define KN_ARM64 1
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#endif

/* ---- 1. detection ---------------------------------------------------------- */

#if KN_X86

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24, 22), the tile state enabled
 * (XCR0 bits 17, 18) and, on Linux, the process's permission to use the
 * tile data (arch_prctl ARCH_REQ_XCOMP_PERM, which every thread inherits). */
static int amx_usable(void) {
    unsigned a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((d >> 24) & 1) || !((d >> 22) & 1)) return 0;
    if (((xcr0() >> 17) & 3) != 3) return 0;
#if defined(__linux__) && defined(SYS_arch_prctl)
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* CPUID + XGETBV rather than __builtin_cpu_supports: clang 14 does not know
 * "avx512bf16", and the OS must have enabled the register state. The AVX-512
 * level needs every feature its file is compiled with (Makefile AVX512_FLAGS),
 * since the compiler may use any of them anywhere in that file. */
static kn_level detect_once(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return KN_SCALAR;
    int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx || !fma || !f16c) return KN_SCALAR;
    uint64_t xcr = xcr0();
    if ((xcr & 0x6) != 0x6) return KN_SCALAR; /* SSE + AVX state */
    if (__get_cpuid_max(0, NULL) < 7) return KN_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    int avx2 = (b >> 5) & 1;
    if (!avx2) return KN_SCALAR;
    int f512 = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    int vnni = (c >> 11) & 1, vbmi = (c >> 1) & 1;
    unsigned max_sub = a;
    int bf16 = 0;
    if (max_sub >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        bf16 = (a >> 5) & 1;
    }
    int zmm_state = (xcr & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
    if (!(f512 && dq && bw && vl && vnni && vbmi && bf16 && zmm_state)) return KN_AVX2;
    return amx_usable() ? KN_AMX : KN_AVX512;
}
#elif KN_ARM64
/* AArch64: Advanced SIMD is architectural (every AArch64 CPU has it; macOS
 * guarantees it), but Linux still reports it in AT_HWCAP, and a kernel
 * could in principle run with it disabled. matvec_neon.c uses base ASIMD
 * only (see its file comment on dotprod / i8mm / bf16). */
static kn_level detect_once(void) {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMD) ? KN_NEON : KN_SCALAR;
#else
    return KN_NEON;
#endif
}
#else
static kn_level detect_once(void) { return KN_SCALAR; }
#endif

#if KN_X86
/* AVX-VNNI (CPUID 7.1 EAX bit 4): the AVX2 level's 4-bit tiles then run as
 * matvec_avxvnni.c (the same bits). -DKN_NO_AVXVNNI turns it off (to measure
 * the plain AVX2 tiles on such a CPU). */
static int avxvnni_once(void) {
#ifdef KN_NO_AVXVNNI
    return 0;
#else
    unsigned a, b, c, d;
    if (!kn_level_available(KN_AVX2)) return 0; /* leaf 7 and the AVX state checked there */
    __cpuid_count(7, 0, a, b, c, d);
    if (a < 1) return 0; /* no subleaf 1 */
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 4) & 1;
#endif
}
#endif

/* probe()'s value (>= 0), computed at the first call and kept in *cache
 * (-1 until then; a benign race: every thread computes the same value). */
static int cached_probe(int *cache, int (*probe)(void)) {
    int v = __atomic_load_n(cache, __ATOMIC_RELAXED);
    if (v < 0) {
        v = probe();
        __atomic_store_n(cache, v, __ATOMIC_RELAXED);
    }
    return v;
}

int kn_avxvnni_usable(void) {
#if KN_X86
    static int cached = -1;
    return cached_probe(&cached, avxvnni_once);
#else
    return 0;
#endif
}

/* The decode tiles' form (matvec_driver.h): the tile-ahead prefetch into
 * L1 (kn_pf_next, matvec_prefetch.h; at AVX-512 with 8-row tiles, NR_L1) on
 * AMD (and Hygon) CPUs, into L2 with 4 rows elsewhere. Measured both ways,
 * two threads streaming 176 MB (`kn_stream T avx512 49152 7168 1 5 2`,
 * bench/kn_stream.c, alternating, medians of 5, GFLOP/s; both libraries
 * built with 64-byte aligned functions and loops, since code layout alone
 * moved these kernels by ~25%). A 2-vCPU Zen 5 VM, L2 / 4 rows -> L1 / 8
 * rows: mxfp4 112 -> 163, bf16 35.2 -> 41.1, int4 121 -> 129 (forty-first
 * session; bench/cpu_NOTES.md has the rest, and K8g's decode 0.176-0.183 ->
 * 0.159-0.168 s/token). The GPU machine's 16-core Xeon, 16 threads, GB/s:
 * mxfp4 173-177 -> 150-155, bf16 139 -> 109-136 (and in the thirty-fifth
 * session, L1 with 4 rows: `bench --kernels` mxfp4 97.5 -> 91% of the probe,
 * int4 99.5 -> 95): L2 there. A build sets -DKN_PF_NEXT_L1=0 or 1 to
 * measure either anywhere. */
#if KN_X86 && !defined(KN_PF_NEXT_L1)
static int pf_next_l1_once(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    char v[13];
    memcpy(v, &b, 4), memcpy(v + 4, &d, 4), memcpy(v + 8, &c, 4), v[12] = 0;
    return !strcmp(v, "AuthenticAMD") || !strcmp(v, "HygonGenuine");
}
#endif

int kn_pf_next_l1(void) {
#if defined(KN_PF_NEXT_L1)
    return KN_PF_NEXT_L1;
#elif KN_X86
    static int cached = -1;
    return cached_probe(&cached, pf_next_l1_once);
#else
    return 0;
#endif
}

static int detect_once_int(void) { return (int)detect_once(); }

/* The best level this CPU runs (KN_AMX included). */
static kn_level best_level(void) {
    static int cached = -1;
    return (kn_level)cached_probe(&cached, detect_once_int);
}

/* A CPU with AMX defaults to KN_AVX512: KN_AMX trades the bit-equality of
 * passes of different sizes for prefill speed (kernels.h), so it is asked for. */
kn_level kn_detect(void) {
    const kn_level b = best_level();
    return b == KN_AMX ? KN_AVX512 : b;
}

const char *kn_level_name(kn_level l) {
    switch (l) {
    case KN_SCALAR: return "scalar";
    case KN_AVX2: return "avx2";
    case KN_AVX512: return "avx512";
    case KN_NEON: return "neon";
    case KN_AMX: return "amx";
    }
    return "unknown";
}

/* Levels are per architecture: the x86 ones are ordered (AVX-512 implies
 * AVX2), KN_NEON exists only on AArch64. */
int kn_level_available(kn_level l) {
    if (l == KN_SCALAR) return 1;
    kn_level best = best_level();
    if (l == KN_NEON || best == KN_NEON) return l == best;
    return (int)l <= (int)best;
}

/* ---- 2. dequant ------------------------------------------------------------ */

static float int4_scale(const df_weight *w, int64_t idx) {
    switch (w->scale_dtype) {
    case DT_BF16: return bf16_to_f32(((const uint16_t *)w->scale)[idx]);
    case DT_F16: return f16_to_f32(((const uint16_t *)w->scale)[idx]);
    default: return ((const float *)w->scale)[idx];
    }
}

static int64_t fp8_nbc(const df_weight *w) { return (w->cols + w->block_cols - 1) / w->block_cols; }

void kn_dequant_row(const df_weight *w, int64_t r, float *out) {
    const int64_t cols = w->cols;
    switch (w->type) {
    case WT_F32: memcpy(out, (const float *)w->data + r * cols, (size_t)cols * sizeof *out); break;
    case WT_BF16: {
        const uint16_t *q = (const uint16_t *)w->data + r * cols;
        for (int64_t c = 0; c < cols; c++) out[c] = bf16_to_f32(q[c]);
        break;
    }
    case WT_F16: {
        const uint16_t *q = (const uint16_t *)w->data + r * cols;
        for (int64_t c = 0; c < cols; c++) out[c] = f16_to_f32(q[c]);
        break;
    }
    case WT_FP8_BLOCK: {
        const uint8_t *q = (const uint8_t *)w->data + r * cols;
        const float *s = (const float *)w->scale + (r / w->block_rows) * fp8_nbc(w);
        for (int64_t c = 0; c < cols; c++) out[c] = fp8_e4m3_to_f32(q[c]) * s[c / w->block_cols];
        break;
    }
    case WT_INT4_G32: {
        const uint8_t *q = (const uint8_t *)w->data + r * (cols / 2); /* = int32 [cols/8], LE */
        for (int64_t c = 0; c < cols; c++) {
            int nib = (q[c / 2] >> (4 * (c & 1))) & 15;
            out[c] = (float)(nib - 8) * int4_scale(w, r * (cols / 32) + c / 32);
        }
        break;
    }
    case WT_MXFP4: {
        const uint8_t *q = (const uint8_t *)w->data + r * (cols / 2);
        const uint8_t *s = (const uint8_t *)w->scale + r * (cols / 32);
        for (int64_t c = 0; c < cols; c++) {
            int nib = (q[c / 2] >> (4 * (c & 1))) & 15;
            out[c] = df_e2m1_table[nib] * e8m0_to_f32(s[c / 32]);
        }
        break;
    }
    case WT_I8_ROW: {
        const int8_t *q = (const int8_t *)w->data + r * cols;
        float s = ((const float *)w->scale)[r];
        for (int64_t c = 0; c < cols; c++) out[c] = (float)q[c] * s;
        break;
    }
    default: ASSERT(!"kn_dequant_row: unknown weight type");
    }
}

/* ---- 3. scalar dot per type ------------------------------------------------ */

/* One accumulator per group/block, columns left to right (see the file comment). */
static float dot_scalar(const df_weight *w, int64_t r, const float *x) {
    const int64_t cols = w->cols;
    float acc = 0.0f;
    switch (w->type) {
    case WT_F32: {
        const float *q = (const float *)w->data + r * cols;
        for (int64_t c = 0; c < cols; c++) acc += q[c] * x[c];
        return acc;
    }
    case WT_BF16: {
        const uint16_t *q = (const uint16_t *)w->data + r * cols;
        for (int64_t c = 0; c < cols; c++) acc += bf16_to_f32(q[c]) * x[c];
        return acc;
    }
    case WT_F16: {
        const uint16_t *q = (const uint16_t *)w->data + r * cols;
        for (int64_t c = 0; c < cols; c++) acc += f16_to_f32(q[c]) * x[c];
        return acc;
    }
    case WT_FP8_BLOCK: {
        const uint8_t *q = (const uint8_t *)w->data + r * cols;
        const float *s = (const float *)w->scale + (r / w->block_rows) * fp8_nbc(w);
        for (int64_t c0 = 0, b = 0; c0 < cols; c0 += w->block_cols, b++) {
            int64_t c1 = c0 + w->block_cols < cols ? c0 + w->block_cols : cols;
            float part = 0.0f;
            for (int64_t c = c0; c < c1; c++) part += fp8_e4m3_to_f32(q[c]) * x[c];
            acc += part * s[b];
        }
        return acc;
    }
    case WT_INT4_G32: {
        const uint8_t *q = (const uint8_t *)w->data + r * (cols / 2);
        for (int64_t g = 0; g < cols / 32; g++) {
            float part = 0.0f;
            for (int k = 0; k < 32; k++) {
                int64_t c = g * 32 + k;
                int nib = (q[c / 2] >> (4 * (c & 1))) & 15;
                part += (float)(nib - 8) * x[c];
            }
            acc += part * int4_scale(w, r * (cols / 32) + g);
        }
        return acc;
    }
    case WT_MXFP4: {
        const uint8_t *q = (const uint8_t *)w->data + r * (cols / 2);
        const uint8_t *sc = (const uint8_t *)w->scale + r * (cols / 32);
        for (int64_t g = 0; g < cols / 32; g++) {
            float part = 0.0f;
            for (int k = 0; k < 32; k++) {
                int64_t c = g * 32 + k;
                part += df_e2m1_table[(q[c / 2] >> (4 * (c & 1))) & 15] * x[c];
            }
            acc += part * e8m0_to_f32(sc[g]);
        }
        return acc;
    }
    case WT_I8_ROW: {
        const int8_t *q = (const int8_t *)w->data + r * cols;
        for (int64_t c = 0; c < cols; c++) acc += (float)q[c] * x[c];
        return acc * ((const float *)w->scale)[r];
    }
    default: ASSERT(!"kn_matvec: unknown weight type");
    }
    return 0.0f;
}

/* ---- 4. dispatch ----------------------------------------------------------- */

static void check_shape(const df_weight *w) {
    ASSERT(w->cols > 0 && w->rows > 0);
    if (w->type == WT_INT4_G32 || w->type == WT_MXFP4) ASSERT(w->cols % 32 == 0);
    if (w->type == WT_FP8_BLOCK) ASSERT(w->block_rows > 0 && w->block_cols > 0);
}

#if KN_X86
/* The AVX2 level: its AVX-VNNI build where the CPU has it (same bits). */
static int avx2_matmul(const df_weight *w, const float *X, int n, float *Y, int64_t ldy, int64_t row0,
                       int64_t row1) {
    return kn_avxvnni_usable() ? kn_matmul_avxvnni(w, X, n, Y, ldy, row0, row1)
                               : kn_matmul_avx2(w, X, n, Y, ldy, row0, row1);
}
static int avx2_prep(const df_weight *w, const float *X, int v0, int v1, float *Xp) {
    return kn_avxvnni_usable() ? kn_matmul_avxvnni_prep(w, X, v0, v1, Xp) : kn_matmul_avx2_prep(w, X, v0, v1, Xp);
}
static int avx2_px(const df_weight *w, const float *Xp, int n, float *Y, int64_t ldy, int64_t row0, int64_t row1) {
    return kn_avxvnni_usable() ? kn_matmul_avxvnni_px(w, Xp, n, Y, ldy, row0, row1)
                               : kn_matmul_avx2_px(w, Xp, n, Y, ldy, row0, row1);
}
#endif

void kn_matmul(kn_level lv, const df_weight *w, const float *X, int n, float *Y, int64_t ldy,
               int64_t row0, int64_t row1) {
    if (n <= 0 || row1 <= row0) return;
    check_shape(w);
    ASSERT(row0 >= 0 && row1 <= w->rows);
    if (!kn_level_available(lv)) lv = kn_detect(); /* never run instructions the CPU lacks */
#if KN_X86
    if (lv == KN_AMX && n >= KN_AMX_MIN_N && kn_matmul_amx(w, X, n, Y, ldy, row0, row1)) return;
    if (lv >= KN_AVX512 && kn_matmul_avx512(w, X, n, Y, ldy, row0, row1)) return;
    if (lv >= KN_AVX2 && avx2_matmul(w, X, n, Y, ldy, row0, row1)) return;
#elif KN_ARM64
    if (lv == KN_NEON && kn_matmul_neon(w, X, n, Y, ldy, row0, row1)) return;
#endif
    for (int i = 0; i < n; i++)
        for (int64_t r = row0; r < row1; r++)
            Y[(int64_t)i * ldy + (r - row0)] = dot_scalar(w, r, X + (int64_t)i * w->cols);
}

/* The level kn_matmul runs an n-vector product at for kn_px_*: lv where
 * this CPU has it; KN_SCALAR (no prepared x) where it would go to the AMX
 * tiles. */
static kn_level px_level(kn_level lv, int n) {
    if (!kn_level_available(lv)) lv = kn_detect();
    return lv == KN_AMX && n >= KN_AMX_MIN_N ? KN_SCALAR : lv;
}

/* The level's prep of vectors [v0, v1) (v0 == v1: whether it has one). */
static int px_prep(kn_level lv, const df_weight *w, const float *X, int v0, int v1, float *Xp) {
#if KN_X86
    if (lv >= KN_AVX512) return kn_matmul_avx512_prep(w, X, v0, v1, Xp);
    if (lv >= KN_AVX2) return avx2_prep(w, X, v0, v1, Xp);
#elif KN_ARM64
    if (lv == KN_NEON) return kn_matmul_neon_prep(w, X, v0, v1, Xp);
#endif
    (void)lv, (void)w, (void)X, (void)v0, (void)v1, (void)Xp;
    return 0;
}

int64_t kn_px_floats(kn_level lv, const df_weight *w, int n) {
    if (n <= 0) return 0;
    lv = px_level(lv, n);
    return px_prep(lv, w, NULL, 0, 0, NULL) ? (int64_t)n * kn_px_len(w->cols) : 0;
}

void kn_px_prep(kn_level lv, const df_weight *w, const float *X, int v0, int v1, float *Xp) {
    if (v1 > v0) px_prep(px_level(lv, v1), w, X, v0, v1, Xp);
}

void kn_matmul_px(kn_level lv, const df_weight *w, const float *Xp, int n, float *Y, int64_t ldy,
                  int64_t row0, int64_t row1) {
    if (n <= 0 || row1 <= row0) return;
    check_shape(w);
    ASSERT(row0 >= 0 && row1 <= w->rows);
    lv = px_level(lv, n);
    int done = 0;
#if KN_X86
    if (lv >= KN_AVX512) done = kn_matmul_avx512_px(w, Xp, n, Y, ldy, row0, row1);
    else if (lv >= KN_AVX2) done = avx2_px(w, Xp, n, Y, ldy, row0, row1);
#elif KN_ARM64
    if (lv == KN_NEON) done = kn_matmul_neon_px(w, Xp, n, Y, ldy, row0, row1);
#endif
    ASSERT(done); /* kn_px_floats said this level prepares w's x */
}

void kn_matvec(kn_level lv, const df_weight *w, const float *x, float *y, int64_t row0,
               int64_t row1) {
    kn_matmul(lv, w, x, 1, y, row1 - row0, row0, row1);
}

double kn_fma_loop(kn_level lv, int64_t iters, float *sink) {
    if (!kn_level_available(lv)) lv = kn_detect();
#if KN_X86
    if (lv >= KN_AVX512) return kn_fma_loop_avx512(iters, sink);
    if (lv >= KN_AVX2) return kn_fma_loop_avx2(iters, sink);
#elif KN_ARM64
    if (lv == KN_NEON) return kn_fma_loop_neon(iters, sink);
#endif
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, t = 0;
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 8; i++) a[i] = fmaf(a[i], 0.999999f, 1e-7f);
    for (int i = 0; i < 8; i++) t += a[i];
    *sink = t;
    return 16.0 * (double)iters;
}

#if !KN_X86
/* AMX exists only on x86: no product is ever for the tiles here. */
int64_t kn_amx_x_init(kn_amx_x *px, const df_weight *w, int n) {
    (void)w, (void)n;
    memset(px, 0, sizeof *px);
    return 0;
}
void kn_amx_x_pack(const kn_amx_x *px, const float *X, int g0, int g1) { (void)px, (void)X, (void)g0, (void)g1; }
void kn_matmul_amx_x(const kn_amx_x *px, const float *X, float *Y, int64_t ldy, int64_t row0, int64_t row1) {
    (void)px, (void)X, (void)Y, (void)ldy, (void)row0, (void)row1;
}
#endif
