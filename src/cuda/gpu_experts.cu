/* gpu_experts.cu — many experts in few launches (gpu_experts, gpu.h).
 *
 * Owns: the weighted sum of a layer's expert outputs (gpu_moe_combine) and
 * the batching of a layer's experts: for MXFP4 the gate and up
 * products of every expert in one tensor-core batch (gpu_tc_batch), the
 * activation over all their hidden rows in one kernel, the down products in
 * a second batch; bf16 experts (the shared ones) of at least
 * ws->bf16_tc_rows vectors run on the tensor cores one by one (gpu_bf16_tc:
 * gate, up and activation in one kernel, then down); other types run
 * gpu_expert per expert.
 * Refuses: placement and queueing policy (gpu_accel.cu decides what runs),
 * host math.
 *
 * Why: one expert's 1536-row projections make 96 row tiles, far too few to
 * fill 132 SMs, and two launches per expert cost more host time than the
 * products; a layer's experts together make thousands of tiles.
 *
 * Exactness: each gate / up / down row is bit-equal to gpu_matmul_tc on
 * that matrix (the same kernel body), and the activation is gpu_expert's
 * (gpu_act1), so an expert's output depends neither on the batch around it
 * nor on n (row i of n vectors is the output for vector i alone). A bf16
 * expert's rows are bit-equal to gpu_matmul_tc on its matrices, and its
 * activation is gpu_expert's; gpu_expert itself runs bf16 on the CUDA cores.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu.h"
#include "gpu_internal.h"

namespace {

/* H[i] = act(G[i], U[i]) for i < count (in place in G). */
__global__ void __launch_bounds__(256) k_act(float *G, const float *__restrict__ U, int64_t count, const gpu_act a) {
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < count; i += (int64_t)gridDim.x * 256)
        G[i] = gpu_act1(a, G[i], U[i]);
}

int same_shape(const gpu_weight *a, const gpu_weight *b) {
    return a->type == b->type && a->rows == b->rows && a->cols == b->cols && a->scale_dtype == b->scale_dtype &&
           a->block_rows == b->block_rows && a->block_cols == b->block_cols;
}

int batchable(const gpu_expert_job *j) {
#ifdef GPU_NO_EXPERT_BATCH /* diagnostics: every expert through gpu_expert */
    return 0;
#endif
    return gpu_matmul_tc_takes(j->gate) && gpu_matmul_tc_takes(j->up) && gpu_matmul_tc_takes(j->down) &&
           same_shape(j->gate, j->up) && j->down->rows == j->gate->cols && j->down->cols == j->gate->rows;
}

/* A bf16 expert on the tensor cores (gpu_bf16_tc): gate and up in one
 * pass with the activation, then down. */
int bf16_job(const gpu_expert_job *j, int min_rows) {
    return min_rows > 0 && j->n >= min_rows && gpu_bf16_tc_takes(j->gate) && gpu_bf16_tc_takes(j->up) &&
           gpu_bf16_tc_takes(j->down) && same_shape(j->gate, j->up) && ((uintptr_t)j->X & 15) == 0;
}
/* bytes before the limbs in a bf16 expert's scratch: its hidden rows */
size_t bf16_hidden_bytes(const gpu_expert_job *j) {
    return ((size_t)j->n * (size_t)j->gate->rows * sizeof(float) + 255) & ~(size_t)255;
}
/* Jobs [j0, j1) form a run: batchable, one shape. */
int run_end(const gpu_expert_job *jobs, int njobs, int j0) {
    if (!batchable(&jobs[j0])) return j0 + 1;
    int j = j0 + 1;
    while (j < njobs && batchable(&jobs[j]) && same_shape(jobs[j].gate, jobs[j0].gate) &&
           same_shape(jobs[j].down, jobs[j0].down))
        j++;
    return j;
}

enum { RUN_MAX = 256 }; /* jobs per batch (host tables on the stack) */

/* Scratch bytes of the run [j0, j1): G and U (all its vectors' hidden rows),
 * then the tensor-core splits of the larger of its two stages. */
size_t run_bytes(const gpu_expert_job *jobs, int j0, int j1, int64_t *nvec, const gpu_ws *ws) {
    int64_t nv = 0;
    for (int j = j0; j < j1; j++) nv += jobs[j].n;
    *nvec = nv;
    const int64_t inter = jobs[j0].gate->rows;
    if (bf16_job(&jobs[j0], ws->bf16_tc_rows)) {
        const int64_t wide = inter > jobs[j0].gate->cols ? inter : jobs[j0].gate->cols;
        return bf16_hidden_bytes(&jobs[j0]) + gpu_bf16_tc_bytes(jobs[j0].n, inter, wide, 2);
    }
    if (!batchable(&jobs[j0])) return (size_t)(nv * inter) * sizeof(float);
    gpu_tc_job a[RUN_MAX], b[RUN_MAX];
    for (int j = j0; j < j1; j++) {
        a[j - j0] = {jobs[j].gate, jobs[j].up, jobs[j].X, jobs[j].n, NULL, NULL, inter};
        b[j - j0] = {jobs[j].down, NULL, NULL, jobs[j].n, NULL, NULL, jobs[j].gate->cols};
    }
    size_t ta = gpu_tc_batch_bytes(a, j1 - j0), tb = gpu_tc_batch_bytes(b, j1 - j0);
    return 2 * (size_t)(nv * inter) * sizeof(float) + (ta > tb ? ta : tb) + 256;
}

/* Block b: token b / nb, columns of block b % nb (nb blocks of COMBINE_T per
 * token); thread c sums column c of its token over the K rows, k ascending.
 * (One block per token left a decode token's combine on one SM: 50-80 us
 * per MoE layer under ncu.) */
enum { COMBINE_T = 128 };
__global__ void __launch_bounds__(COMBINE_T) k_combine(const float *const *rows, const float *__restrict__ w, int K,
                                                       int64_t dim, int64_t nb, const float *const *add,
                                                       float *out) {
    const int64_t t = blockIdx.x / nb;
    const int64_t c = (blockIdx.x % nb) * COMBINE_T + threadIdx.x;
    if (c >= dim) return;
    const float *const *r = rows + (int64_t)t * K;
    const float *wt = w + (int64_t)t * K;
    float a = 0.0f;
    for (int k = 0; k < K; k++) a = __fadd_rn(a, __fmul_rn(wt[k], r[k][c]));
    if (add) a = __fadd_rn(a, add[t][c]);
    out[(int64_t)t * dim + c] = a;
}

} // namespace

extern "C" df_status gpu_moe_combine(const float *const *rows, const float *w, int n, int K, int64_t dim,
                                     const float *const *add, float *out, void *stream) {
    if (!rows || !w || !out || n < 1 || K < 1 || dim < 1) return DF_ERR_ARG;
    const int64_t nb = (dim + COMBINE_T - 1) / COMBINE_T;
    if (nb * n > 0x7fffffff) return DF_ERR_UNSUPPORTED;
    k_combine<<<(unsigned)(nb * n), COMBINE_T, 0, (cudaStream_t)stream>>>(rows, w, K, dim, nb, add, out);
    return gpu_cuda_status(cudaGetLastError(), "k_combine");
}

extern "C" df_status gpu_experts(const gpu_expert_job *jobs, int njobs, const gpu_act *act, gpu_ws *ws,
                                 void *stream) {
    if (njobs < 1) return DF_OK;
    if (!jobs || !act || !ws) return DF_ERR_ARG;
    for (int j = 0; j < njobs; j++) {
        const gpu_expert_job *x = &jobs[j];
        if (!x->gate || !x->up || !x->down || !x->X || !x->out || x->n < 1) return DF_ERR_ARG;
        if (!same_shape(x->gate, x->up) || x->down->rows != x->gate->cols || x->down->cols != x->gate->rows)
            return DF_ERR_ARG;
    }
    /* the scratch for the largest run, grown once before anything is queued */
    size_t need = 0;
    for (int j0 = 0; j0 < njobs;) {
        int j1 = run_end(jobs, njobs, j0);
        if (j1 - j0 > RUN_MAX) j1 = j0 + RUN_MAX;
        int64_t nv;
        size_t b = run_bytes(jobs, j0, j1, &nv, ws);
        if (b > need) need = b;
        j0 = j1;
    }
    if (ws->cap < need) {
        /* earlier batches on the stream may still read the old scratch */
        df_status sst = gpu_cuda_status(cudaStreamSynchronize((cudaStream_t)stream), "gpu_experts");
        if (sst) return sst;
        gpu_ws_free(ws);
        df_status st = gpu_cuda_status(cudaMalloc(&ws->buf, need), "gpu_experts scratch");
        if (st) {
            ws->buf = NULL;
            return st;
        }
        ws->cap = need;
    }
    cudaStream_t s = (cudaStream_t)stream;
    for (int j0 = 0; j0 < njobs;) {
        int j1 = run_end(jobs, njobs, j0);
        if (j1 - j0 > RUN_MAX) j1 = j0 + RUN_MAX;
        const int64_t inter = jobs[j0].gate->rows, hid = jobs[j0].gate->cols;
        float *G = (float *)ws->buf;
        df_status st;
        if (bf16_job(&jobs[j0], ws->bf16_tc_rows)) {
            const gpu_expert_job &x = jobs[j0];
            void *limbs = (char *)ws->buf + bf16_hidden_bytes(&x); /* after G */
            const int wg = gpu_ws_wg(ws);
            if ((st = gpu_bf16_tc(x.gate, x.up, act, x.X, x.n, G, inter, 0, inter, limbs, wg, s))) return st;
            if ((st = gpu_bf16_tc(x.down, NULL, NULL, G, x.n, x.out, hid, 0, hid, limbs, wg, s))) return st;
            j0 = j1;
            continue;
        }
        if (!batchable(&jobs[j0])) {
            st = gpu_expert(jobs[j0].gate, jobs[j0].up, jobs[j0].down, act, jobs[j0].X, jobs[j0].n, G, jobs[j0].out,
                            stream);
            if (st) return st;
            j0 = j1;
            continue;
        }
        int64_t nv;
        run_bytes(jobs, j0, j1, &nv, ws);
        float *U = G + nv * inter;
        void *tcs = (void *)(((uintptr_t)(U + nv * inter) + 255) & ~(uintptr_t)255);
        gpu_tc_job a[RUN_MAX], b[RUN_MAX];
        int64_t off = 0;
        for (int j = j0; j < j1; j++) {
            a[j - j0] = {jobs[j].gate, jobs[j].up, jobs[j].X, jobs[j].n, G + off * inter, U + off * inter, inter};
            b[j - j0] = {jobs[j].down, NULL, G + off * inter, jobs[j].n, jobs[j].out, NULL, hid};
            off += jobs[j].n;
        }
        const int wg = ws->frag_wg >= 0 && gpu_ws_wg_present(ws) ? ws->frag_wg : -1;
        if ((st = gpu_tc_batch(a, j1 - j0, tcs, ws->frag_xs, wg, s))) return st;
        const int64_t count = nv * inter;
        int64_t blocks = (count + 255) / 256;
        if (blocks > 4096) blocks = 4096;
        k_act<<<(unsigned)blocks, 256, 0, s>>>(G, U, count, *act);
        if ((st = gpu_cuda_status(cudaGetLastError(), "k_act"))) return st;
        if ((st = gpu_tc_batch(b, j1 - j0, tcs, ws->frag_xs, wg, s))) return st;
        j0 = j1;
    }
    return DF_OK;
}
