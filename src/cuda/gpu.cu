/* gpu.cu — CUDA kernels behind gpu.h (prefix gpu_).
 *
 * Owns: device probing and error text, device weight allocation, the
 * per-type chunk decoders, the warp-per-row matvec/matmul kernel, the fused
 * gate/up + activation kernel, RMSNorm and the router.
 * Refuses: host math (the CPU scalar kernels are the oracle, see
 * tests/cuda/test_cuda.c), placement and caching policy.
 *
 * Work layout of the weight kernels (one warp per row, per 4 rows at n = 1,
 * and from n = 9 per 4 rows x 4 vectors, 2 rows for the 32-value decodes,
 * rows_dot: each row's weights decoded once per 4 vectors and each vector's
 * x read once per row group, which took a 512-vector bf16 product from ~8
 * to ~22 TFLOP/s on an H200):
 *
 *   row r bytes:  | chunk 0 | chunk 1 | ... | chunk 31 | chunk 32 | ...
 *                   lane 0    lane 1          lane 31    lane 0
 *   a chunk is 16 bytes: 8 bf16 | 16 fp8 | 32 int4 or e2m1 codes (one group)
 *
 * Each lane keeps one fp32 accumulator per (row, vector); per chunk it
 * decodes the 16 bytes exactly into registers, sums code*x left to right,
 * multiplies by the chunk's scale and adds. The lane sums meet in a fixed
 * xor butterfly. Nothing depends on how many rows or vectors one warp takes,
 * which is what makes matmul bit-equal to matvec (gpu.h).
 *
 * Decoders (exact; no tables, no divisions):
 *   bf16   f32 bits = bf16 << 16.
 *   fp8    cvt e4m3x2 -> f16x2 (hardware, exact) -> f32.
 *   int4   f16 bits 0x6400 | nib = 1024 + nib; minus 1032 (exact) -> nib - 8.
 *   e2m1   f16 bits (sign << 15) | (exp,man << 9) = value * 2^-14 for every
 *          code (e=0 lands on the f16 subnormals); the chunk sum is multiplied
 *          by 2^14 (exact) before the e8m0 scale.
 *
 * Sections: 1. errors, probe, buffers  2. weights  3. decoders  4. matmul kernels
 *           5. expert  6. rmsnorm  7. router
 */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "gpu.h"
#include "gpu_internal.h"

/* ---- 1. errors, probe ------------------------------------------------------- */

static __thread char last_err[256];

extern "C" const char *gpu_last_error(void) { return last_err; }

static df_status fail(char *err, df_status st, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, DF_ERRMSG, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* Maps a CUDA error to a status, remembering its text (gpu_internal.h). */
df_status gpu_cuda_status(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return DF_OK;
    snprintf(last_err, sizeof last_err, "%s: %s", what, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? DF_ERR_NOMEM : DF_ERR_IO;
}

static df_status cuda_status(cudaError_t e, const char *what) { return gpu_cuda_status(e, what); }
static df_status launched(const char *what) { return cuda_status(cudaGetLastError(), what); }

extern "C" int gpu_probe(char *why, size_t cap) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(why, cap, "no CUDA device: %s",
                 e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
        cudaGetLastError(); /* clear it, so later calls do not report it */
        return 0;
    }
    cudaDeviceProp p;
    if ((e = cudaGetDeviceProperties(&p, 0)) != cudaSuccess) {
        snprintf(why, cap, "no CUDA device: %s", cudaGetErrorString(e));
        return 0;
    }
    if (p.major < 9) {
        snprintf(why, cap, "no usable CUDA device: %s is sm_%d%d, this build needs sm_90+",
                 p.name, p.major, p.minor);
        return 0;
    }
    snprintf(why, cap, "%s (sm_%d%d, %d SMs)", p.name, p.major, p.minor, p.multiProcessorCount);
    return 1;
}

extern "C" void *gpu_malloc(size_t bytes) {
    void *p = NULL;
    if (cuda_status(cudaMalloc(&p, bytes), "cudaMalloc")) return NULL;
    return p;
}
extern "C" void gpu_free(void *p) { cudaFree(p); }
extern "C" df_status gpu_put(void *dst, const void *src, size_t bytes) {
    return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}
extern "C" df_status gpu_get(void *dst, const void *src, size_t bytes) {
    return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}
extern "C" df_status gpu_fill(void *dst, int byte, size_t bytes) {
    return cuda_status(cudaMemset(dst, byte, bytes), "cudaMemset");
}
/* Copies on the SMs, 16 bytes per thread where aligned: activations to and
 * from mapped page-locked memory without the copy engines, which may be
 * busy with weight uploads for milliseconds. */
__global__ void k_copy(uint8_t *dst, const uint8_t *src, size_t bytes) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
    if ((((uintptr_t)dst | (uintptr_t)src) & 15) == 0) {
        size_t n16 = bytes / 16;
        for (size_t k = i; k < n16; k += step) ((uint4 *)dst)[k] = ((const uint4 *)src)[k];
        for (size_t k = n16 * 16 + i; k < bytes; k += step) dst[k] = src[k];
    } else {
        for (size_t k = i; k < bytes; k += step) dst[k] = src[k];
    }
}

extern "C" df_status gpu_copy(void *dst, const void *src, size_t bytes, void *stream) {
    if (!bytes) return DF_OK;
    if (!dst || !src) return DF_ERR_ARG;
    size_t blocks = (bytes / 16 + 255) / 256;
    if (blocks < 1) blocks = 1;
    if (blocks > 256) blocks = 256;
    k_copy<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>((uint8_t *)dst, (const uint8_t *)src, bytes);
    return launched("copy");
}

extern "C" df_status gpu_sync(void) {
    return cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

/* ---- 2. weights ------------------------------------------------------------- */

static const char *type_name(wt_type t) { /* weight.c is not linked into this library */
    static const char *names[] = {"f32", "bf16", "f16", "fp8-block", "int4-g32", "mxfp4", "i8-row"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

static int64_t fp8_nbr(const df_weight *w) { return (w->rows + w->block_rows - 1) / w->block_rows; }
static int64_t fp8_nbc(const df_weight *w) { return (w->cols + w->block_cols - 1) / w->block_cols; }

extern "C" df_status gpu_weight_check(const df_weight *w, char *err) {
    if (!w || w->rows <= 0 || w->cols <= 0) return fail(err, DF_ERR_ARG, "gpu: empty matrix");
    switch (w->type) {
    case WT_BF16:
        if (w->cols % 8) return fail(err, DF_ERR_UNSUPPORTED, "gpu: bf16 needs cols %% 8 == 0 (cols %lld)", (long long)w->cols);
        return DF_OK;
    case WT_FP8_BLOCK:
        if (w->block_rows <= 0 || w->block_cols <= 0 || w->cols % 16 || w->block_cols % 16)
            return fail(err, DF_ERR_UNSUPPORTED, "gpu: fp8 needs cols and block_cols multiples of 16 (cols %lld, block %dx%d)",
                        (long long)w->cols, w->block_rows, w->block_cols);
        return DF_OK;
    case WT_INT4_G32:
        if (w->cols % 32) return fail(err, DF_ERR_UNSUPPORTED, "gpu: int4 needs cols %% 32 == 0");
        if (w->scale_dtype != DT_BF16 && w->scale_dtype != DT_F16 && w->scale_dtype != DT_F32)
            return fail(err, DF_ERR_UNSUPPORTED, "gpu: int4 scales must be bf16, f16 or f32");
        return DF_OK;
    case WT_MXFP4:
        if (w->cols % 32) return fail(err, DF_ERR_UNSUPPORTED, "gpu: mxfp4 needs cols %% 32 == 0");
        return DF_OK;
    case WT_I8_ROW:
        if (w->cols % 16) return fail(err, DF_ERR_UNSUPPORTED, "gpu: row-int8 needs cols %% 16 == 0 (cols %lld)", (long long)w->cols);
        return DF_OK;
    default:
        return fail(err, DF_ERR_UNSUPPORTED, "gpu: no kernel for weight type %s", type_name(w->type));
    }
}

static int64_t scale_elem(st_dtype t) { return t == DT_F32 ? 4 : 2; }

/* Bytes of data and scale for w's type and shape (gpu_weight_check passed). */
static void sizes(const df_weight *w, int64_t *data, int64_t *scale) {
    const int64_t R = w->rows, C = w->cols;
    switch (w->type) {
    case WT_BF16: *data = R * C * 2; *scale = 0; break;
    case WT_FP8_BLOCK: *data = R * C; *scale = fp8_nbr(w) * fp8_nbc(w) * 4; break;
    case WT_INT4_G32: *data = R * C / 2; *scale = R * (C / 32) * scale_elem(w->scale_dtype); break;
    case WT_MXFP4: *data = R * C / 2; *scale = R * (C / 32); break;
    case WT_I8_ROW: *data = R * C; *scale = R * 4; break;
    default: *data = *scale = 0;
    }
}

/* g's type and shape fields from w (its memory and sizes untouched). */
static void take_shape(gpu_weight *g, const df_weight *w) {
    g->type = w->type;
    g->rows = w->rows;
    g->cols = w->cols;
    g->scale_dtype = w->scale_dtype;
    g->block_rows = w->block_rows;
    g->block_cols = w->block_cols;
}

extern "C" df_status gpu_weight_alloc(const df_weight *shape, gpu_weight *g, char *err) {
    memset(g, 0, sizeof *g);
    df_status st = gpu_weight_check(shape, err);
    if (st) return st;
    gpu_weight t;
    memset(&t, 0, sizeof t);
    take_shape(&t, shape);
    sizes(shape, &t.data_bytes, &t.scale_bytes);
    cudaError_t e = cudaMalloc(&t.data, (size_t)t.data_bytes);
    if (e == cudaSuccess && t.scale_bytes) e = cudaMalloc(&t.scale, (size_t)t.scale_bytes);
    if (e != cudaSuccess) {
        st = cuda_status(e, "cudaMalloc");
        cudaFree(t.data);
        return fail(err, st, "gpu: cannot allocate %lld bytes for a %lldx%lld %s matrix: %s",
                    (long long)(t.data_bytes + t.scale_bytes), (long long)t.rows,
                    (long long)t.cols, type_name(t.type), cudaGetErrorString(e));
    }
    *g = t;
    return DF_OK;
}

extern "C" void gpu_weight_free(gpu_weight *g) {
    if (!g) return;
    cudaFree(g->data);
    cudaFree(g->scale);
    cudaFree(g->frag);
    memset(g, 0, sizeof *g);
}

extern "C" int gpu_mx_frag_takes(const df_weight *w) {
    return w && w->type == WT_MXFP4 && w->rows > 0 && w->cols > 0 && w->cols % 32 == 0;
}

extern "C" df_status gpu_weight_alloc_frag(const df_weight *shape, gpu_weight *g, char *err) {
    memset(g, 0, sizeof *g);
    if (!gpu_mx_frag_takes(shape)) return fail(err, DF_ERR_UNSUPPORTED, "gpu: the fragment layout takes MXFP4 with cols %% 32 == 0");
    gpu_weight t;
    memset(&t, 0, sizeof t);
    take_shape(&t, shape);
    t.data_bytes = gpu_mx_frag_bytes(shape->rows, shape->cols);
    cudaError_t e = cudaMalloc(&t.frag, (size_t)t.data_bytes);
    if (e != cudaSuccess)
        return fail(err, cuda_status(e, "cudaMalloc"), "gpu: cannot allocate %lld bytes for a %lldx%lld mxfp4 matrix: %s",
                    (long long)t.data_bytes, (long long)t.rows, (long long)t.cols, cudaGetErrorString(e));
    *g = t;
    return DF_OK;
}

/* w's data bytes, rounded up so its scales start 256-byte aligned in a stage */
static int64_t stage_data_bytes(const df_weight *w) { return (w->rows * (w->cols / 2) + 255) & ~(int64_t)255; }

extern "C" int64_t gpu_mx_frag_stage_bytes(const df_weight *w) {
    return gpu_mx_frag_takes(w) ? stage_data_bytes(w) + w->rows * (w->cols / 32) : 0;
}

extern "C" int gpu_weight_fits(const df_weight *w, const gpu_weight *g) {
    int64_t d, s;
    if (!w || !g || gpu_weight_check(w, NULL) != DF_OK) return 0;
    if (g->frag && !g->data)
        return gpu_mx_frag_takes(w) && gpu_mx_frag_bytes(w->rows, w->cols) == g->data_bytes;
    if (!g->data) return 0;
    sizes(w, &d, &s);
    return d == g->data_bytes && s == g->scale_bytes;
}

extern "C" df_status gpu_weight_refill_frag_async(const df_weight *w, gpu_weight *g, void *stage, void *stream,
                                                  char *err) {
    if (!stage || !g || !g->frag || g->data || !gpu_weight_fits(w, g))
        return fail(err, DF_ERR_ARG, "gpu: fragment refill with a matrix of another size or kind");
    take_shape(g, w);
    cudaStream_t s = (cudaStream_t)stream;
    int64_t d, sc;
    sizes(w, &d, &sc);
    /* a raw view of the stage: the re-layout kernel reads it */
    gpu_weight raw = *g;
    raw.frag = NULL;
    raw.data = stage;
    raw.scale = (uint8_t *)stage + stage_data_bytes(w);
    raw.data_bytes = d;
    raw.scale_bytes = sc;
    cudaError_t e = cudaMemcpyAsync(raw.data, w->data, (size_t)d, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) e = cudaMemcpyAsync(raw.scale, w->scale, (size_t)sc, cudaMemcpyHostToDevice, s);
    if (e != cudaSuccess) return fail(err, cuda_status(e, "cudaMemcpyAsync"), "gpu: upload failed: %s", cudaGetErrorString(e));
    df_status st = gpu_mx_frag_pack(&raw, g->frag, stream);
    if (st) return fail(err, st, "gpu: re-laying an upload failed: %s", gpu_last_error());
    return DF_OK;
}

extern "C" df_status gpu_weight_upload_frag(const df_weight *w, gpu_weight *g, char *err) {
    df_status st = gpu_weight_alloc_frag(w, g, err);
    if (st) return st;
    void *stage = NULL;
    cudaError_t e = cudaMalloc(&stage, (size_t)gpu_mx_frag_stage_bytes(w));
    if (e != cudaSuccess) st = fail(err, cuda_status(e, "cudaMalloc"), "gpu: upload stage: %s", cudaGetErrorString(e));
    if (!st) st = gpu_weight_refill_frag_async(w, g, stage, NULL, err);
    if (!st && (e = cudaStreamSynchronize(NULL)) != cudaSuccess)
        st = fail(err, cuda_status(e, "cudaMemcpy"), "gpu: upload failed: %s", cudaGetErrorString(e));
    cudaFree(stage);
    if (st) gpu_weight_free(g);
    return st;
}

extern "C" df_status gpu_weight_refill_async(const df_weight *w, gpu_weight *g, void *stream, char *err) {
    if (g && g->frag && !g->data) return fail(err, DF_ERR_ARG, "gpu: a fragment-layout matrix refills through a stage");
    if (!gpu_weight_fits(w, g)) return fail(err, DF_ERR_ARG, "gpu: refill with a matrix of another size");
    take_shape(g, w);
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e = cudaMemcpyAsync(g->data, w->data, (size_t)g->data_bytes, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess && g->scale_bytes)
        e = cudaMemcpyAsync(g->scale, w->scale, (size_t)g->scale_bytes, cudaMemcpyHostToDevice, s);
    if (e != cudaSuccess) return fail(err, cuda_status(e, "cudaMemcpyAsync"), "gpu: upload failed: %s", cudaGetErrorString(e));
    return DF_OK;
}

extern "C" df_status gpu_weight_refill(const df_weight *w, gpu_weight *g, char *err) {
    df_status st = gpu_weight_refill_async(w, g, NULL, err);
    if (st) return st;
    cudaError_t e = cudaStreamSynchronize(NULL);
    if (e != cudaSuccess) return fail(err, cuda_status(e, "cudaMemcpy"), "gpu: upload failed: %s", cudaGetErrorString(e));
    return DF_OK;
}

extern "C" df_status gpu_weight_upload(const df_weight *w, gpu_weight *g, char *err) {
    df_status st = gpu_weight_alloc(w, g, err);
    if (st) return st;
    cudaError_t e = cudaMemcpy(g->data, w->data, (size_t)g->data_bytes, cudaMemcpyHostToDevice);
    if (e == cudaSuccess && g->scale_bytes)
        e = cudaMemcpy(g->scale, w->scale, (size_t)g->scale_bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        st = cuda_status(e, "cudaMemcpy");
        gpu_weight_free(g);
        return fail(err, st, "gpu: upload failed: %s", cudaGetErrorString(e));
    }
    return DF_OK;
}

/* ---- 3. decoders ------------------------------------------------------------ */

enum { K_BF16, K_FP8, K_INT4, K_MXFP4, K_I8 };

/* Kernel-side view of one matrix. */
struct kw {
    const uint8_t *data, *scale;
    int64_t row_bytes, nchunk; /* per row: bytes, 16-byte chunks */
    int64_t sstride;           /* scale entries per scale row */
    int br, bc, bc_shift;      /* fp8 blocks; bc_shift = log2(bc) or -1 */
    int sdt;                   /* int4 scale type: 0 bf16, 1 f16, 2 f32 */
};

template <int T> __host__ __device__ constexpr int vals() {
    return T == K_BF16 ? 8 : T == K_FP8 || T == K_I8 ? 16 : 32;
}

static kw make_kw(const gpu_weight *g) {
    kw k;
    memset(&k, 0, sizeof k);
    k.data = (const uint8_t *)g->data;
    k.scale = (const uint8_t *)g->scale;
    k.bc_shift = -1;
    switch (g->type) {
    case WT_BF16: k.row_bytes = g->cols * 2; k.nchunk = g->cols / 8; break;
    case WT_FP8_BLOCK:
        k.row_bytes = g->cols;
        k.nchunk = g->cols / 16;
        k.sstride = (g->cols + g->block_cols - 1) / g->block_cols;
        k.br = g->block_rows;
        k.bc = g->block_cols;
        for (int s = 0; s < 31; s++)
            if ((1 << s) == g->block_cols) k.bc_shift = s;
        break;
    case WT_INT4_G32:
        k.row_bytes = g->cols / 2;
        k.nchunk = g->cols / 32;
        k.sstride = g->cols / 32;
        k.sdt = g->scale_dtype == DT_BF16 ? 0 : g->scale_dtype == DT_F16 ? 1 : 2;
        break;
    case WT_MXFP4: k.row_bytes = g->cols / 2; k.nchunk = g->cols / 32; k.sstride = g->cols / 32; break;
    case WT_I8_ROW: k.row_bytes = g->cols; k.nchunk = g->cols / 16; k.sstride = 1; break;
    default: break;
    }
    return k;
}

static __device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

static __device__ __forceinline__ float2 h2f2(uint32_t bits) {
    __half2_raw raw;
    raw.x = (unsigned short)(bits & 0xffffu);
    raw.y = (unsigned short)(bits >> 16);
    return __half22float2(__half2(raw));
}

/* Exact decode of one 16-byte chunk into w[vals<T>()] (e2m1: value * 2^-14). */
template <int T> static __device__ __forceinline__ void decode(uint4 q, float *w) {
    const uint32_t u4[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t u = u4[i];
        if (T == K_BF16) {
            w[2 * i] = __uint_as_float(u << 16);
            w[2 * i + 1] = __uint_as_float(u & 0xffff0000u);
        } else if (T == K_FP8) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
                    (__nv_fp8x2_storage_t)((u >> (16 * j)) & 0xffffu), __NV_E4M3);
                float2 f = __half22float2(__half2(h));
                w[4 * i + 2 * j] = f.x;
                w[4 * i + 2 * j + 1] = f.y;
            }
        } else if (T == K_I8) {
            /* byte b (signed) -> the float 2^23 + 128 + b, exactly, by
             * placing b + 128 under the exponent of 2^23; minus 2^23 + 128 */
            const uint32_t x = u ^ 0x80808080u;
#pragma unroll
            for (int j = 0; j < 4; j++)
                w[4 * i + j] = __fsub_rn(__uint_as_float(__byte_perm(x, 0x4B000000u, (unsigned)(j | 0x7440))), 8388736.0f);
        } else if (T == K_INT4) {
            const __half2 bias = __float2half2_rn(1032.0f);
#pragma unroll
            for (int j = 0; j < 4; j++) { /* codes j and j+4 of this word */
                uint32_t h = ((u >> (4 * j)) & 0x000f000fu) | 0x64006400u;
                __half2_raw raw;
                raw.x = (unsigned short)(h & 0xffffu);
                raw.y = (unsigned short)(h >> 16);
                float2 f = __half22float2(__hsub2(__half2(raw), bias));
                w[8 * i + j] = f.x;
                w[8 * i + j + 4] = f.y;
            }
        } else { /* K_MXFP4 */
#pragma unroll
            for (int j = 0; j < 4; j++) { /* codes j and j+4, moved to bits 12-15 of each half */
                uint32_t v = u << (12 - 4 * j);
                uint32_t h = (v & 0x80008000u) | ((v >> 3) & 0x0e000e00u);
                float2 f = h2f2(h);
                w[8 * i + j] = f.x;
                w[8 * i + j + 4] = f.y;
            }
        }
    }
}

/* Scale of chunk ch of a row whose scale row starts at entry srow. */
template <int T>
static __device__ __forceinline__ float chunk_scale(const kw &w, int64_t srow, int64_t ch) {
    if (T == K_BF16) return 1.0f;
    if (T == K_I8) return __ldg((const float *)w.scale + srow); /* one per row */
    if (T == K_FP8) {
        int64_t c = ch * 16;
        int64_t b = w.bc_shift >= 0 ? (c >> w.bc_shift) : c / w.bc;
        return __ldg((const float *)w.scale + srow + b);
    }
    if (T == K_INT4) {
        int64_t i = srow + ch;
        if (w.sdt == 0) return __uint_as_float((uint32_t)__ldg((const unsigned short *)w.scale + i) << 16);
        if (w.sdt == 1) {
            __half_raw raw;
            raw.x = __ldg((const unsigned short *)w.scale + i);
            return __half2float(__half(raw));
        }
        return __ldg((const float *)w.scale + i);
    }
    uint32_t s = __ldg(w.scale + srow + ch); /* e8m0 */
    uint32_t bits = s == 0 ? 0x00400000u : s == 255 ? 0x7fc00000u : s << 23;
    return __uint_as_float(bits);
}

template <int T> static __device__ __forceinline__ int64_t scale_row(const kw &w, int64_t r) {
    return T == K_FP8 ? (r / w.br) * w.sstride : r * w.sstride;
}

/* acc + scale * (chunk sum), with the rounding steps spelled out. */
template <int T> static __device__ __forceinline__ float apply(float acc, float p, float s) {
    if (T == K_BF16) return __fadd_rn(acc, p);
    if (T == K_MXFP4) p = __fmul_rn(p, 16384.0f); /* undo the 2^-14 of the e2m1 decode */
    return __fadd_rn(acc, __fmul_rn(p, s));
}

/* ---- 4. matmul kernels ------------------------------------------------------ */

/* Tuning knobs, fixed at build time: GPU_CHAINS independent partial sums
 * per chunk (the order is fixed, so results stay deterministic) and GPU_R1
 * rows per warp at n = 1. Measured on an H200 (bench/cuda_NOTES.md): 2 or 4
 * chains and 8 rows were no faster, int4 much slower; MXFP4/int4 matvec is
 * bound by decode instructions, not by latency. */
#ifndef GPU_CHAINS
#define GPU_CHAINS 1
#endif
#ifndef GPU_R1
#define GPU_R1 4
#endif
/* Products of n > 8 vectors: GPU_MM_R rows x GPU_MM_NB vectors a warp (a
 * split matrix: GPU_MS_R rows a block), fewer rows for the wider decodes
 * (mm_rows). The value of an output never depends on them (rows_dot's
 * order is per row and vector). Measured
 * (`cuda_bench 2 prefill`, K3's 12288 x 7168 at n = 512, TFLOP/s): 1 x 8
 * (the n <= 8 shape) 7.9, 2 x 8 14.2, 4 x 8 14.7, 8 x 4 19.5, 4 x 4 21.8;
 * split 1536 x 7168: 1 row 4.2, 2 rows 6.8, 4 rows 11.8, 8 rows 11.1. */
#ifndef GPU_MM_R
#define GPU_MM_R 4
#endif
#ifndef GPU_MS_R
#define GPU_MS_R 4
#endif
#ifndef GPU_MM_NB
#define GPU_MM_NB 4
#endif
/* Rows a warp (or split block) holds for n > 8: r, or fewer for the wider
 * decodes so that R V stays at most 64 (rows_dot decodes them all); every
 * type's V <= 32 leaves at least 2 (gate + up take pairs). */
template <int T> constexpr int mm_rows(int r) { return vals<T>() * r <= 64 ? r : 64 / vals<T>(); }

/* Sum of w[c] * x[c] over one chunk: GPU_CHAINS interleaved partial sums
 * (chain k takes c = k, k + GPU_CHAINS, ...), each left to right, then added
 * in a fixed tree. dotv: x in registers; dotx: x read from global memory. */
template <int V> static __device__ __forceinline__ float dotv(const float *w, const float *x) {
    float p[GPU_CHAINS];
#pragma unroll
    for (int k = 0; k < GPU_CHAINS; k++) p[k] = 0.0f;
#pragma unroll
    for (int c = 0; c < V; c++) p[c % GPU_CHAINS] = __fmaf_rn(w[c], x[c], p[c % GPU_CHAINS]);
#pragma unroll
    for (int h = GPU_CHAINS / 2; h > 0; h >>= 1)
#pragma unroll
        for (int k = 0; k < h; k++) p[k] = __fadd_rn(p[k], p[k + h]);
    return p[0];
}
template <int V> static __device__ __forceinline__ void ldx(const float *xg, float *x) {
#pragma unroll
    for (int c = 0; c < V; c += 4) *(float4 *)(x + c) = __ldg((const float4 *)(xg + c));
}
template <int V> static __device__ __forceinline__ float dotx(const float *w, const float *xg) {
    float x[V];
    ldx<V>(xg, x);
    return dotv<V>(w, x);
}

/* One warp: R rows (row[r] of matrix wp[r], all with the same cols) times
 * vectors v0 .. v0+NB-1 of X (clamped to n-1), over the row's chunks
 * [c0, c1): lane l takes chunks c0 + l, c0 + l + 32, ... in order, then the
 * lanes' sums are added in a fixed tree. Every lane ends with the sums in acc.
 * With several vectors and few decoded values (R V <= 64) all R rows are
 * decoded first and each vector's x is read once for them; otherwise row by
 * row. Either way each (row, vector) sum takes the same steps. */
template <int T, int R, int NB>
static __device__ __forceinline__ void rows_dot(const kw *const *wp, const int64_t *row,
                                                const float *X, int64_t cols, int n, int v0,
                                                float (&acc)[R][NB], int64_t c0, int64_t c1) {
    constexpr int V = vals<T>();
    const int lane = threadIdx.x & 31;
    const uint4 *base[R];
    int64_t srow[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        base[r] = (const uint4 *)(wp[r]->data + row[r] * wp[r]->row_bytes);
        srow[r] = scale_row<T>(*wp[r], row[r]);
#pragma unroll
        for (int v = 0; v < NB; v++) acc[r][v] = 0.0f;
    }
    const float *xv[NB];
#pragma unroll
    for (int v = 0; v < NB; v++) xv[v] = X + (int64_t)min(v0 + v, n - 1) * cols;
#pragma unroll 2
    for (int64_t ch = c0 + lane; ch < c1; ch += 32) {
        uint4 q[R];
        float s[R];
#pragma unroll
        for (int r = 0; r < R; r++) q[r] = ld_stream(base[r] + ch);
#pragma unroll
        for (int r = 0; r < R; r++) s[r] = chunk_scale<T>(*wp[r], srow[r], ch);
        if (R * V <= 64 && NB > 1) { /* every row decoded, then each vector's x read once */
            float w[R][V];
#pragma unroll
            for (int r = 0; r < R; r++) decode<T>(q[r], w[r]);
#pragma unroll
            for (int v = 0; v < NB; v++) {
                float x[V];
                ldx<V>(xv[v] + ch * V, x);
#pragma unroll
                for (int r = 0; r < R; r++) acc[r][v] = apply<T>(acc[r][v], dotv<V>(w[r], x), s[r]);
            }
        } else {
#pragma unroll
            for (int r = 0; r < R; r++) {
                float w[V];
                decode<T>(q[r], w);
#pragma unroll
                for (int v = 0; v < NB; v++) acc[r][v] = apply<T>(acc[r][v], dotx<V>(w, xv[v] + ch * V), s[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int v = 0; v < NB; v++) {
            float a = acc[r][v];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, o));
            acc[r][v] = a;
        }
}

enum { WARPS = 8 }; /* warps per block */

/* The matmul kernels' rows rb .. rb + R - 1 of w (clamped to row1 - 1), and
 * their outputs Y[v][r - row0] for the rows and vectors that exist. */
template <int R>
static __device__ __forceinline__ void matmul_rows(const kw &w, int64_t rb, int64_t row1, const kw *(&wp)[R],
                                                   int64_t (&row)[R]) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        wp[r] = &w;
        row[r] = min(rb + r, row1 - 1);
    }
}
template <int R, int NB>
static __device__ __forceinline__ void matmul_store(const float (&sum)[R][NB], int64_t rb, int64_t row0, int64_t row1,
                                                    int v0, int n, float *Y, int64_t ldy) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int v = 0; v < NB; v++)
            if (rb + r < row1 && v0 + v < n) Y[(int64_t)(v0 + v) * ldy + (rb + r - row0)] = sum[r][v];
}

/* Block b: vector tile b % ntile (fastest, so tiles of one row block run
 * together and share its weights in L2), row block b / ntile. */
template <int T, int R, int NB>
__global__ void __launch_bounds__(WARPS * 32)
k_matmul(const __grid_constant__ kw w, int64_t cols, const float *__restrict__ X, int n,
         float *__restrict__ Y, int64_t ldy, int64_t row0, int64_t row1, int ntile) {
    const int64_t b = blockIdx.x;
    const int tile = (int)(b % ntile);
    const int64_t warp = (b / ntile) * WARPS + (threadIdx.x >> 5);
    const int64_t rb = row0 + warp * R;
    if (rb >= row1) return; /* whole warp */
    const int v0 = tile * NB;
    const kw *wp[R];
    int64_t row[R];
    matmul_rows<R>(w, rb, row1, wp, row);
    float acc[R][NB];
    rows_dot<T, R, NB>(wp, row, X, cols, n, v0, acc, 0, w.nchunk);
    if ((threadIdx.x & 31) == 0) matmul_store<R, NB>(acc, rb, row0, row1, v0, n, Y, ldy);
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Matrices with few rows (a router, a low-rank projection, q_a, kv_a, a
 * latent down-projection): at R rows per warp they make a handful of
 * blocks whose lanes walk each row's chunks one after another, so the
 * product waits on memory latency (~23 us under ncu for a 32 x 7168 bf16
 * router on the H200; bench/cuda_NOTES.md). A split matrix gives each row a block
 * whose WARPS warps take contiguous slices of the row's chunks (rows_dot
 * over the slice) and adds the warps' sums in warp order. Which order a
 * matrix gets depends on its shape alone (split_rows), never on n, the
 * row range or the kernel (matmul or gate/up), so every product of it
 * gives the same bits. */
enum { SPLIT_MAX_ROWS = 4096, SPLIT_MIN_CHUNKS = 128 };

static bool split_rows(int64_t rows, int64_t nchunk) { return rows < SPLIT_MAX_ROWS && nchunk >= SPLIT_MIN_CHUNKS; }

/* Row r of the P matrices wp (same shape) times vectors v0 .. v0+NB-1,
 * summed over the whole block as above; every thread ends with the sums.
 * part: shared memory of the block. */
template <int T, int P, int NB>
static __device__ __forceinline__ void split_sums(const kw *const *wp, const int64_t *row, const float *X, int64_t cols,
                                                  int n, int v0, float (*part)[P][NB], float (&sum)[P][NB]) {
    const int wi = threadIdx.x >> 5;
    const int64_t nch = wp[0]->nchunk, per = (nch + WARPS - 1) / WARPS;
    const int64_t c0 = min((int64_t)wi * per, nch), c1 = min(c0 + per, nch);
    float acc[P][NB];
    rows_dot<T, P, NB>(wp, row, X, cols, n, v0, acc, c0, c1);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int v = 0; v < NB; v++) part[wi][p][v] = acc[p][v];
    __syncthreads();
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int v = 0; v < NB; v++) {
            float a = part[0][p][v];
#pragma unroll
            for (int k = 1; k < WARPS; k++) a = __fadd_rn(a, part[k][p][v]);
            sum[p][v] = a;
        }
}

/* Block b: vector tile b % ntile, rows row0 + R (b / ntile) .. + R - 1. */
template <int T, int R, int NB>
__global__ void __launch_bounds__(WARPS * 32)
k_matmul_split(const __grid_constant__ kw w, int64_t cols, const float *__restrict__ X, int n,
               float *__restrict__ Y, int64_t ldy, int64_t row0, int64_t row1, int ntile) {
    __shared__ float part[WARPS][R][NB];
    const int64_t b = blockIdx.x;
    const int v0 = (int)(b % ntile) * NB;
    const int64_t rb = row0 + (b / ntile) * R;
    const kw *wp[R];
    int64_t row[R];
    matmul_rows<R>(w, rb, row1, wp, row);
    float sum[R][NB];
    split_sums<T, R, NB>(wp, row, X, cols, n, v0, part, sum);
    if (threadIdx.x == 0) matmul_store<R, NB>(sum, rb, row0, row1, v0, n, Y, ldy);
}

template <int T, int R, int NB>
static df_status launch_split(const kw &k, int64_t cols, const float *X, int n, float *Y, int64_t ldy, int64_t row0,
                              int64_t row1, cudaStream_t s) {
    int ntile = (int)cdiv(n, NB);
    int64_t blocks = cdiv(row1 - row0, R) * ntile;
    if (blocks > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    k_matmul_split<T, R, NB><<<(unsigned)blocks, WARPS * 32, 0, s>>>(k, cols, X, n, Y, ldy, row0, row1, ntile);
    return launched("k_matmul_split");
}

template <int T, int R, int NB>
static df_status launch_matmul(const kw &k, int64_t cols, const float *X, int n, float *Y,
                               int64_t ldy, int64_t row0, int64_t row1, cudaStream_t s) {
    int ntile = (int)cdiv(n, NB);
    int64_t blocks = cdiv(cdiv(row1 - row0, R), WARPS) * ntile;
    if (blocks > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    k_matmul<T, R, NB><<<(unsigned)blocks, WARPS * 32, 0, s>>>(k, cols, X, n, Y, ldy, row0, row1, ntile);
    return launched("k_matmul");
}

template <int T>
static df_status matmul_t(const kw &k, int64_t rows, int64_t cols, const float *X, int n, float *Y,
                          int64_t ldy, int64_t row0, int64_t row1, cudaStream_t s) {
    if (split_rows(rows, k.nchunk)) {
        if (n == 1) return launch_split<T, 1, 1>(k, cols, X, n, Y, ldy, row0, row1, s);
        if (n <= 4) return launch_split<T, 1, 4>(k, cols, X, n, Y, ldy, row0, row1, s);
        if (n <= 8) return launch_split<T, 1, 8>(k, cols, X, n, Y, ldy, row0, row1, s);
        return launch_split<T, mm_rows<T>(GPU_MS_R), GPU_MM_NB>(k, cols, X, n, Y, ldy, row0, row1, s);
    }
    if (n == 1) return launch_matmul<T, GPU_R1, 1>(k, cols, X, n, Y, ldy, row0, row1, s);
    if (n <= 4) return launch_matmul<T, 1, 4>(k, cols, X, n, Y, ldy, row0, row1, s);
    if (n <= 8) return launch_matmul<T, 1, 8>(k, cols, X, n, Y, ldy, row0, row1, s);
    return launch_matmul<T, mm_rows<T>(GPU_MM_R), GPU_MM_NB>(k, cols, X, n, Y, ldy, row0, row1, s);
}

extern "C" df_status gpu_matmul(const gpu_weight *w, const float *X, int n, float *Y, int64_t ldy,
                                int64_t row0, int64_t row1, void *stream) {
    if (w && !w->data && w->frag) return DF_ERR_UNSUPPORTED; /* gpu_matmul_tc reads the fragment layout */
    if (!w || !w->data || !X || !Y || n < 1 || row0 < 0 || row1 > w->rows || row1 <= row0 ||
        ldy < row1 - row0)
        return DF_ERR_ARG;
    kw k = make_kw(w);
    cudaStream_t s = (cudaStream_t)stream;
    switch (w->type) {
    case WT_BF16: return matmul_t<K_BF16>(k, w->rows, w->cols, X, n, Y, ldy, row0, row1, s);
    case WT_FP8_BLOCK: return matmul_t<K_FP8>(k, w->rows, w->cols, X, n, Y, ldy, row0, row1, s);
    case WT_INT4_G32: return matmul_t<K_INT4>(k, w->rows, w->cols, X, n, Y, ldy, row0, row1, s);
    case WT_MXFP4: return matmul_t<K_MXFP4>(k, w->rows, w->cols, X, n, Y, ldy, row0, row1, s);
    case WT_I8_ROW: return matmul_t<K_I8>(k, w->rows, w->cols, X, n, Y, ldy, row0, row1, s);
    default: return DF_ERR_UNSUPPORTED;
    }
}

extern "C" df_status gpu_matvec(const gpu_weight *w, const float *x, float *y, void *stream) {
    if (!w) return DF_ERR_ARG;
    return gpu_matmul(w, x, 1, y, w->rows, 0, w->rows, stream);
}

/* ---- 5. expert -------------------------------------------------------------- */

/* The gate / up kernels' rows: pairs (gate row, up row) for rows rb ..
 * rb + RR - 1 (clamped), and their outputs H[v][r] = act(gate, up). */
template <int RR>
static __device__ __forceinline__ void gateup_rows(const kw &g, const kw &u, int64_t rb, int64_t inter,
                                                   const kw *(&wp)[2 * RR], int64_t (&row)[2 * RR]) {
#pragma unroll
    for (int i = 0; i < RR; i++) {
        wp[2 * i] = &g;
        wp[2 * i + 1] = &u;
        row[2 * i] = row[2 * i + 1] = min(rb + i, inter - 1);
    }
}
template <int RR, int NB>
static __device__ __forceinline__ void gateup_store(const gpu_act &act, const float (&sum)[2 * RR][NB], int64_t rb,
                                                    int v0, int n, int64_t inter, float *H) {
#pragma unroll
    for (int i = 0; i < RR; i++)
#pragma unroll
        for (int v = 0; v < NB; v++)
            if (rb + i < inter && v0 + v < n)
                H[(int64_t)(v0 + v) * inter + rb + i] = gpu_act1(act, sum[2 * i][v], sum[2 * i + 1][v]);
}

/* H[v][r] = act(gate row r . x_v, up row r . x_v) for RR rows r per warp. */
template <int T, int RR, int NB>
__global__ void __launch_bounds__(WARPS * 32)
k_gateup(const __grid_constant__ kw g, const __grid_constant__ kw u, const gpu_act act,
         int64_t cols, const float *__restrict__ X, int n, float *__restrict__ H, int64_t inter,
         int ntile) {
    const int64_t b = blockIdx.x;
    const int tile = (int)(b % ntile);
    const int64_t rb = ((b / ntile) * WARPS + (threadIdx.x >> 5)) * RR;
    if (rb >= inter) return;
    const int v0 = tile * NB;
    const kw *wp[2 * RR];
    int64_t row[2 * RR];
    gateup_rows<RR>(g, u, rb, inter, wp, row);
    float acc[2 * RR][NB];
    rows_dot<T, 2 * RR, NB>(wp, row, X, cols, n, v0, acc, 0, g.nchunk);
    if ((threadIdx.x & 31) == 0) gateup_store<RR, NB>(act, acc, rb, v0, n, inter, H);
}

/* k_gateup for a split gate and up (split_rows): block b is rows RR (b / ntile) .. + RR - 1. */
template <int T, int RR, int NB>
__global__ void __launch_bounds__(WARPS * 32)
k_gateup_split(const __grid_constant__ kw g, const __grid_constant__ kw u, const gpu_act act, int64_t cols,
               const float *__restrict__ X, int n, float *__restrict__ H, int64_t inter, int ntile) {
    __shared__ float part[WARPS][2 * RR][NB];
    const int64_t b = blockIdx.x;
    const int v0 = (int)(b % ntile) * NB;
    const int64_t rb = (b / ntile) * RR;
    const kw *wp[2 * RR];
    int64_t row[2 * RR];
    gateup_rows<RR>(g, u, rb, inter, wp, row);
    float sum[2 * RR][NB];
    split_sums<T, 2 * RR, NB>(wp, row, X, cols, n, v0, part, sum);
    if (threadIdx.x == 0) gateup_store<RR, NB>(act, sum, rb, v0, n, inter, H);
}

template <int T, int RR, int NB>
static df_status launch_gateup_split(const gpu_weight *gate, const gpu_weight *up, const gpu_act *act,
                                     const float *X, int n, float *H, cudaStream_t s) {
    int ntile = (int)cdiv(n, NB);
    int64_t blocks = cdiv(gate->rows, RR) * ntile;
    if (blocks > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    k_gateup_split<T, RR, NB><<<(unsigned)blocks, WARPS * 32, 0, s>>>(make_kw(gate), make_kw(up), *act, gate->cols, X,
                                                                      n, H, gate->rows, ntile);
    return launched("k_gateup_split");
}

template <int T, int RR, int NB>
static df_status launch_gateup(const gpu_weight *gate, const gpu_weight *up, const gpu_act *act,
                               const float *X, int n, float *H, cudaStream_t s) {
    int ntile = (int)cdiv(n, NB);
    int64_t blocks = cdiv(cdiv(gate->rows, RR), WARPS) * ntile;
    if (blocks > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    k_gateup<T, RR, NB><<<(unsigned)blocks, WARPS * 32, 0, s>>>(make_kw(gate), make_kw(up), *act,
                                                               gate->cols, X, n, H, gate->rows, ntile);
    return launched("k_gateup");
}

template <int T>
static df_status gateup_t(const gpu_weight *gate, const gpu_weight *up, const gpu_act *act,
                          const float *X, int n, float *H, cudaStream_t s) {
    if (split_rows(gate->rows, make_kw(gate).nchunk)) {
        if (n == 1) return launch_gateup_split<T, 1, 1>(gate, up, act, X, n, H, s);
        if (n <= 4) return launch_gateup_split<T, 1, 4>(gate, up, act, X, n, H, s);
        if (n <= 8) return launch_gateup_split<T, 1, 8>(gate, up, act, X, n, H, s);
        return launch_gateup_split<T, mm_rows<T>(GPU_MS_R) / 2, GPU_MM_NB>(gate, up, act, X, n, H, s);
    }
    if (n == 1) return launch_gateup<T, 2, 1>(gate, up, act, X, n, H, s);
    if (n <= 4) return launch_gateup<T, 1, 4>(gate, up, act, X, n, H, s);
    if (n <= 8) return launch_gateup<T, 1, 8>(gate, up, act, X, n, H, s);
    return launch_gateup<T, mm_rows<T>(GPU_MM_R) / 2, GPU_MM_NB>(gate, up, act, X, n, H, s);
}

static int same_layout(const gpu_weight *a, const gpu_weight *b) {
    return a->type == b->type && a->rows == b->rows && a->cols == b->cols &&
           a->scale_dtype == b->scale_dtype && a->block_rows == b->block_rows &&
           a->block_cols == b->block_cols;
}

extern "C" df_status gpu_expert(const gpu_weight *gate, const gpu_weight *up,
                                const gpu_weight *down, const gpu_act *act, const float *X, int n,
                                float *H, float *out, void *stream) {
    if (!gate || !up || !down || !act || !X || !H || !out || n < 1) return DF_ERR_ARG;
    if (!gate->data || !up->data || !down->data) /* fragment-layout matrices: gpu_experts */
        return gate->frag || up->frag || down->frag ? DF_ERR_UNSUPPORTED : DF_ERR_ARG;
    if (!same_layout(gate, up) || down->rows != gate->cols || down->cols != gate->rows)
        return DF_ERR_ARG;
    cudaStream_t s = (cudaStream_t)stream;
    df_status st;
    switch (gate->type) {
    case WT_BF16: st = gateup_t<K_BF16>(gate, up, act, X, n, H, s); break;
    case WT_FP8_BLOCK: st = gateup_t<K_FP8>(gate, up, act, X, n, H, s); break;
    case WT_INT4_G32: st = gateup_t<K_INT4>(gate, up, act, X, n, H, s); break;
    case WT_MXFP4: st = gateup_t<K_MXFP4>(gate, up, act, X, n, H, s); break;
    case WT_I8_ROW: st = gateup_t<K_I8>(gate, up, act, X, n, H, s); break;
    default: return DF_ERR_UNSUPPORTED;
    }
    if (st) return st;
    return gpu_matmul(down, H, n, out, down->rows, 0, down->rows, stream);
}

/* ---- 6. rmsnorm ------------------------------------------------------------- */

enum { NORM_THREADS = 256 };

/* One block per vector; the sum of squares in double, reduced in a fixed
 * order (block_sum1), so the result does not depend on timing; a row's
 * result depends on dim only, never on n. out may alias x: each element is
 * read and written by one thread, its write after the reduction.
 * k_rmsnorm4 takes the rows row_fits takes, in registers (gpu_internal.h). */
__global__ void __launch_bounds__(ROW_T) k_rmsnorm4(float *out, const float *x, const float *w, int dim, float eps) {
    __shared__ double buf[33];
    float4 v[ROW_V4];
    row_load(x + (int64_t)blockIdx.x * dim, dim >> 2, v);
    row_rmsnorm(v, dim, w, eps, out + (int64_t)blockIdx.x * dim, buf);
}

/* Any other row: strided, the same reduction. */
__global__ void __launch_bounds__(NORM_THREADS)
k_rmsnorm(float *out, const float *x, const float *w, int dim, float eps) {
    __shared__ double buf[33];
    const float *xr = x + (int64_t)blockIdx.x * dim;
    float *o = out + (int64_t)blockIdx.x * dim;
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += NORM_THREADS) ss += (double)xr[i] * (double)xr[i];
    const float inv = norm_scale(block_sum1(ss, buf), dim, eps);
    for (int i = threadIdx.x; i < dim; i += NORM_THREADS)
        o[i] = w ? __fmul_rn(w[i], __fmul_rn(xr[i], inv)) : __fmul_rn(xr[i], inv);
}

extern "C" df_status gpu_rmsnorm(float *out, const float *x, const float *w, int n, int dim,
                                 float eps, void *stream) {
    if (!out || !x || n < 1 || dim < 1) return DF_ERR_ARG;
    if (row_fits(dim, (uintptr_t)out | (uintptr_t)x | (uintptr_t)w)) k_rmsnorm4<<<n, ROW_T, 0, (cudaStream_t)stream>>>(out, x, w, dim, eps);
    else k_rmsnorm<<<n, NORM_THREADS, 0, (cudaStream_t)stream>>>(out, x, w, dim, eps);
    return launched("k_rmsnorm");
}

__global__ void __launch_bounds__(256) k_sigmoid_mul(float *x, const float *__restrict__ g, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < n; i += (int64_t)gridDim.x * 256)
        x[i] = __fmul_rn(x[i], __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g[i]))));
}

__global__ void __launch_bounds__(256) k_add(float *y, const float *__restrict__ x, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < n; i += (int64_t)gridDim.x * 256)
        y[i] = __fadd_rn(y[i], x[i]);
}

/* Block i copies row idx[i] of src to row i of dst. */
__global__ void __launch_bounds__(256) k_gather(float *dst, const float *__restrict__ src, const int *idx, int64_t width) {
    const float *s = src + (int64_t)idx[blockIdx.x] * width;
    float *d = dst + (int64_t)blockIdx.x * width;
    for (int64_t i = threadIdx.x; i < width; i += 256) d[i] = s[i];
}

extern "C" df_status gpu_gather_rows(float *dst, const float *src, const int *idx, int count, int64_t width,
                                     void *stream) {
    if (!dst || !src || !idx || count < 0 || width < 1) return DF_ERR_ARG;
    if (!count) return DF_OK;
    k_gather<<<(unsigned)count, 256, 0, (cudaStream_t)stream>>>(dst, src, idx, width);
    return launched("k_gather");
}

extern "C" df_status gpu_add(float *y, const float *x, int64_t n, void *stream) {
    if (!y || !x || n < 0) return DF_ERR_ARG;
    if (!n) return DF_OK;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 4096) blocks = 4096;
    k_add<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(y, x, n);
    return launched("k_add");
}

extern "C" df_status gpu_sigmoid_mul(float *x, const float *g, int64_t n, void *stream) {
    if (!x || !g || n < 0) return DF_ERR_ARG;
    if (!n) return DF_OK;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 4096) blocks = 4096;
    k_sigmoid_mul<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(x, g, n);
    return launched("k_sigmoid_mul");
}

/* ---- 7. router -------------------------------------------------------------- */

enum { ROUTE_MAX_E = 1024, ROUTE_MAX_G = 32 };

/* One warp per token; the same steps as moe_route (ffn.c): scores, + bias
 * for choice, group limit, K rounds of argmax (first index among equal
 * maxima), chosen ids ascending, renormalised and scaled weights. */
__global__ void __launch_bounds__(32) k_route(const gpu_router r, const float *logits, int *sel, float *selw) {
    __shared__ float score[ROUTE_MAX_E], choice[ROUTE_MAX_E], gs[ROUTE_MAX_G];
    __shared__ unsigned char taken[ROUTE_MAX_E], keep[ROUTE_MAX_G];
    const int E = r.E, K = r.K, lane = threadIdx.x;
    const float *l = logits + (int64_t)blockIdx.x * E;
    if (r.sigmoid) {
        for (int x = lane; x < E; x += 32) score[x] = 1.0f / (1.0f + expf(-l[x]));
    } else {
        float m = -INFINITY;
        for (int x = lane; x < E; x += 32) m = fmaxf(m, l[x]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        double s = 0.0;
        for (int x = lane; x < E; x += 32) {
            score[x] = expf(l[x] - m);
            s += score[x];
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float inv = (float)(1.0 / s);
        for (int x = lane; x < E; x += 32) score[x] *= inv;
    }
    for (int x = lane; x < E; x += 32) {
        choice[x] = score[x] + (r.bias ? r.bias[x] : 0.0f);
        taken[x] = 0;
    }
    __syncwarp();
    const int G = r.n_group > 0 ? r.n_group : 1, per = E / G;
    if (G > 1 && r.topk_group < G) {
        if (lane < G) { /* group score: sum of its two best */
            float a = -INFINITY, b = -INFINITY;
            for (int x = lane * per; x < (lane + 1) * per; x++) {
                if (choice[x] > a) { b = a; a = choice[x]; }
                else if (choice[x] > b) b = choice[x];
            }
            gs[lane] = per > 1 ? a + b : a;
            keep[lane] = 0;
        }
        __syncwarp();
        if (lane == 0)
            for (int k = 0; k < r.topk_group; k++) {
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
                keep[best] = 1;
            }
        __syncwarp();
        for (int x = lane; x < E; x += 32)
            if (!keep[x / per]) choice[x] = r.group_mask;
        __syncwarp();
    }
    for (int k = 0; k < K; k++) {
        float bv = 0.0f;
        int bi = -1;
        for (int x = lane; x < E; x += 32)
            if (!taken[x] && (bi < 0 || choice[x] > bv)) { bv = choice[x]; bi = x; }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        if (lane == 0) taken[bi] = 1;
        __syncwarp();
    }
    if (lane == 0) {
        int *so = sel + (int64_t)blockIdx.x * K;
        float *wo = selw + (int64_t)blockIdx.x * K, sum = 0.0f;
        for (int x = 0, k = 0; x < E; x++)
            if (taken[x]) { so[k] = x; wo[k] = score[x]; sum += score[x]; k++; }
        for (int k = 0; k < K; k++) {
            if (r.renorm) wo[k] /= (sum + 1e-20f);
            wo[k] *= r.scale;
        }
    }
}

extern "C" df_status gpu_route(const gpu_router *r, const float *logits, int n, int *sel,
                               float *selw, void *stream) {
    if (!r || !logits || !sel || !selw || n < 1 || r->E < 1 || r->E > ROUTE_MAX_E || r->K < 1 ||
        r->K > r->E || r->n_group > ROUTE_MAX_G || (r->n_group > 1 && r->E % r->n_group) ||
        (r->n_group > 1 && r->topk_group < 1))
        return DF_ERR_ARG;
    k_route<<<n, 32, 0, (cudaStream_t)stream>>>(*r, logits, sel, selw);
    return launched("k_route");
}
