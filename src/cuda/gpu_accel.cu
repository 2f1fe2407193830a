/* gpu_accel.cu — the CUDA df_accel; see gpu_accel.h. */
#include "gpu_accel.h"
#include "gpu.h"
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace {

struct acc {
    df_accel pub;
    char name[512];
    int device;
    cudaStream_t stream;
    float *hx, *hy;   /* pinned staging */
    float *dx, *dy;   /* device activations */
    size_t cap_x, cap_y; /* floats */
};

df_status cerr(char *err, cudaError_t e, const char *what) {
    if (err) snprintf(err, DF_ERRMSG, "cuda: %s: %s", what, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? DF_ERR_NOMEM : DF_ERR_IO;
}

int grow(float **h, float **d, size_t *cap, size_t need, char *err) {
    if (need <= *cap) return 1;
    size_t nc = need < 65536 ? 65536 : need + need / 2;
    cudaFreeHost(*h);
    cudaFree(*d);
    *h = NULL;
    *d = NULL;
    *cap = 0;
    cudaError_t e = cudaMallocHost((void **)h, nc * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc((void **)d, nc * sizeof(float));
    if (e != cudaSuccess) {
        cerr(err, e, "staging buffers");
        cudaFreeHost(*h);
        cudaFree(*d);
        *h = NULL;
        *d = NULL;
        return 0;
    }
    *cap = nc;
    return 1;
}

void *acc_upload(void *ctx, const void *weight, int *refused, char *err) {
    acc *a = (acc *)ctx;
    const df_weight *w = (const df_weight *)weight;
    *refused = 0;
    cudaSetDevice(a->device);
    df_status st = gpu_weight_check(w, err);
    if (st != DF_OK) {
        *refused = st == DF_ERR_UNSUPPORTED;
        return NULL;
    }
    gpu_weight *g = (gpu_weight *)calloc(1, sizeof *g);
    if (!g) return NULL;
    if (gpu_weight_upload(w, g, err) != DF_OK) {
        free(g);
        return NULL;
    }
    return g;
}

void acc_release(void *ctx, void *handle) {
    (void)ctx;
    gpu_weight *g = (gpu_weight *)handle;
    if (!g) return;
    gpu_weight_free(g);
    free(g);
}

df_status acc_matmul(void *ctx, void *handle, const float *X, int n, float *Y, int64_t ldy, int64_t row0,
                     int64_t row1, char *err) {
    acc *a = (acc *)ctx;
    const gpu_weight *g = (const gpu_weight *)handle;
    const int64_t cols = g->cols, rows = row1 - row0;
    if (!grow(&a->hx, &a->dx, &a->cap_x, (size_t)n * cols, err)) return DF_ERR_NOMEM;
    if (!grow(&a->hy, &a->dy, &a->cap_y, (size_t)n * rows, err)) return DF_ERR_NOMEM;
    memcpy(a->hx, X, (size_t)n * cols * sizeof(float));
    cudaError_t e = cudaMemcpyAsync(a->dx, a->hx, (size_t)n * cols * sizeof(float), cudaMemcpyHostToDevice, a->stream);
    if (e != cudaSuccess) return cerr(err, e, "activations to the device");
    df_status st = gpu_matmul(g, a->dx, n, a->dy, rows, row0, row1, a->stream);
    if (st != DF_OK) {
        if (err) snprintf(err, DF_ERRMSG, "cuda: matmul: %s", gpu_last_error());
        return st;
    }
    e = cudaMemcpyAsync(a->hy, a->dy, (size_t)n * rows * sizeof(float), cudaMemcpyDeviceToHost, a->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(a->stream);
    if (e != cudaSuccess) return cerr(err, e, "matmul");
    for (int i = 0; i < n; i++)
        memcpy(Y + (size_t)i * ldy, a->hy + (size_t)i * rows, (size_t)rows * sizeof(float));
    return DF_OK;
}

} // namespace

extern "C" const df_accel *gpu_accel_open(int device, int64_t gpu_mem, char *err) {
    char why[256];
    if (!gpu_probe(why, sizeof why)) {
        snprintf(err, DF_ERRMSG, "%s", why);
        return NULL;
    }
    int count = 0;
    cudaGetDeviceCount(&count);
    if (device < 0 || device >= count) {
        snprintf(err, DF_ERRMSG, "cuda: no device %d (%d present)", device, count);
        return NULL;
    }
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) { cerr(err, e, "cudaSetDevice"); return NULL; }
    cudaDeviceProp p;
    if ((e = cudaGetDeviceProperties(&p, device)) != cudaSuccess) { cerr(err, e, "device properties"); return NULL; }
    size_t free_b = 0, total_b = 0;
    if ((e = cudaMemGetInfo(&free_b, &total_b)) != cudaSuccess) { cerr(err, e, "cudaMemGetInfo"); return NULL; }
    acc *a = (acc *)calloc(1, sizeof *a);
    if (!a) { snprintf(err, DF_ERRMSG, "out of memory"); return NULL; }
    a->device = device;
    if ((e = cudaStreamCreateWithFlags(&a->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        cerr(err, e, "cudaStreamCreate");
        free(a);
        return NULL;
    }
    int64_t avail = (int64_t)free_b - ((int64_t)2 << 30);
    if (avail < ((int64_t)256 << 20)) avail = (int64_t)256 << 20;
    a->pub.budget = gpu_mem > 0 ? gpu_mem : avail;
    snprintf(a->name, sizeof a->name, "cuda:%d %s (sm_%d%d, %d SMs, %.1f GB, %.1f GB free)", device, p.name,
             p.major, p.minor, p.multiProcessorCount, total_b / 1e9, free_b / 1e9);
    a->pub.name = a->name;
    a->pub.ctx = a;
    a->pub.upload = acc_upload;
    a->pub.release = acc_release;
    a->pub.matmul = acc_matmul;
    return &a->pub;
}

extern "C" void gpu_accel_close(const df_accel *pa) {
    if (!pa) return;
    acc *a = (acc *)pa->ctx;
    cudaSetDevice(a->device);
    cudaFreeHost(a->hx);
    cudaFreeHost(a->hy);
    cudaFree(a->dx);
    cudaFree(a->dy);
    cudaStreamDestroy(a->stream);
    free(a);
}
