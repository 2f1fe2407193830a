/* gpu_accel.cu — the CUDA df_accel; see gpu_accel.h. */
#include "gpu_accel.h"
#include "gpu.h"
#include "gpu_internal.h"
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

namespace {

df_status cerr(char *err, cudaError_t e, const char *what);

/* n floats rounded up to 64 bytes: every buffer carved from a staging area
 * starts 16-byte aligned (the kernels load activations as float4). */
size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

enum {
    SPARE_MAX = 32,
    MLA_PIECE = 32,    /* rows per MLA absorb / attend / lift: gpu_mla_absorb takes <= 32 (a chunked pass's DF_CHUNK) */
    MLA_TC_PIECE = 256 /* the same with kv_b's products on the tensor cores (mla_tc): any n, scratch nh x 256 x R */
};
const int64_t SPARE_BYTES = (int64_t)64 << 20; /* larger copies are freed at once */

/* A device copy handed to the engine: the matrix, the event its upload
 * recorded on the copy stream (products wait on it, on the device), and the
 * event its release recorded on the product stream (a refill of a spare
 * waits on it, on the device, so no queued product reads the new bytes). */
struct handle {
    gpu_weight g;
    cudaEvent_t ready, freed;
    int was_freed;
    int qref;    /* queued experts not yet launched that read it */
    int settled; /* its upload has completed (ready queried): products need not wait for it */
};

/* A queued expert: its copies and activation, its inputs (n rows of hid
 * floats at qhx / qdx + x_off), its outputs (n rows of dim floats at qdy /
 * qhy + y_off), written to out + rows[i] * stride at finish. */
struct pending {
    handle *h[3];
    gpu_act act;
    float *out;
    int64_t stride, dim, hid, x_off, y_off;
    int n, rows_off; /* rows in acc::qrows */
    const float *xdev; /* the input in device memory (dev_alloc), else NULL: staged at x_off */
    int out_dev;       /* out is device memory: rows copied there on the device */
    int in_place;      /* out_dev, written there by the launch itself (queue_launch) */
};

#ifndef GPU_TIMELINE
#define GPU_TIMELINE 0 /* 1: device time per hook, printed at exit (a measurement build; see below) */
#endif
enum { TL_CATS = 17, TL_PAIRS = 4096 }; /* TL_CATS: the hooks timed (tl_name) */
struct acc {
    df_accel pub;
#if GPU_TIMELINE
    cudaEvent_t tl_ev[2 * TL_PAIRS];
    int tl_cat[TL_PAIRS], tl_n;
    double tl_host[2 * TL_PAIRS]; /* host seconds at each event's record (the trace) */
    cudaEvent_t tl_zero;          /* the trace's time origin on the device */
    double tl_host0;
    FILE *tl_trace;               /* DF_TL_TRACE: one line a hook call */
    double tl_ms[TL_CATS];
    long tl_calls[TL_CATS];
#endif
    char name[512];
    int device;
    cudaStream_t stream; /* products */
    cudaStream_t copy;   /* weight uploads, overlapping the products */
    float *hx, *hy;   /* pinned staging */
    float *dx, *dy;   /* device activations */
    size_t cap_x, cap_y; /* floats */
    float *hh, *dh;      /* an expert's hidden activations (device; hh unused) */
    size_t cap_h;
    gpu_ws ws;           /* tensor-core scratch (MXFP4) */
    void *stage;         /* device: MXFP4 uploads land here, then are re-laid into their copy (copy stream) */
    size_t cap_stage;    /* bytes */
    /* released expert-sized copies kept for the next upload of the same
     * size: no cudaMalloc / cudaFree (which synchronises) per expert swap */
    handle *spare[SPARE_MAX];
    int nspare;
    /* the expert queue (expert_queue / expert_finish): per queued expert its
     * inputs and outputs get their own stretch of these buffers, reused
     * after each finish. The inputs' (pinned + device) grow after a finish;
     * the device outputs grow on the stream, without one (queue_room); the
     * pinned outputs exist only once an output goes to host memory */
    float *qhx, *qdx, *qhy, *qdy; /* pinned in / device in / pinned out / device out */
    size_t qcap_x, qcap_y, qx_used, qy_used; /* floats */
    size_t qhy_bytes;                        /* qhy's capacity */
    pending *pend;
    int npend, cap_pend;
    int nlaunched;        /* pend[0 .. nlaunched) are on the stream */
    gpu_expert_job *jobs; /* cap_pend of them: a launch's batch */
    gpu_ws ews;           /* gpu_experts' scratch */
    df_status flush_st;   /* a launch that failed inside acc_release, reported at finish */
    char flush_err[DF_ERRMSG];
    int *qrows;
    int nrows, cap_rows;
    float *kh, *kd; /* KDA staging: a step's inputs and o (pinned / device) */
    size_t cap_k;
    gpu_ws kda_ws;  /* gpu_kda's scan path (prompts) */
    float *th, *td; /* moe_tail staging (pinned) and device: weights, norm, host rows, row tables, sums */
    size_t cap_t;
    const float **tsrc; /* moe_tail: where each row is (grown, never per call) */
    int64_t cap_tsrc;
    float *mh, *md; /* MLA staging (pinned) and device inputs + scratch + attn */
    size_t cap_m;
    gpu_ws mla_ws;  /* gpu_mla_attend's split workspace */
    /* activations kept on the device (dev_alloc): its blocks, so the other
     * hooks know a device pointer from a host one */
    float *dblk[64];
    size_t dlen[64];
    float *sh;         /* dev_stage's buffer (pinned): dev_put reads it in place */
    size_t cap_sh;     /* bytes */
    cudaEvent_t sh_ev; /* sh still read by queued uploads once recorded */
    int sh_busy;
    void *ph;          /* dev_put / dev_get staging (pinned) */
    size_t cap_ph;     /* bytes */
    cudaEvent_t ph_ev, th_ev; /* ph / th still read by queued work once recorded */
    cudaEvent_t mm_ev;        /* matmul_many's outputs copied (queued experts run behind) */
    void *gh;                 /* dev_gather's row indices (pinned, read by the kernel) */
    size_t cap_gh;            /* bytes */
    int gh_busy;
    cudaEvent_t gh_ev;
    int ph_busy, th_busy;
};

/* 1 if p points into a dev_alloc block. */
int is_dev(const acc *a, const void *p) {
    const float *f = (const float *)p;
    for (int i = 0; f && i < 64; i++)
        if (a->dblk[i] && f >= a->dblk[i] && f < a->dblk[i] + a->dlen[i]) return 1;
    return 0;
}

/* Pinned staging that queued work may still read (*busy): the host waits
 * for the event recorded after that work before writing it again. */
void staging_wait(cudaEvent_t ev, int *busy) {
    if (*busy) cudaEventSynchronize(ev);
    *busy = 0;
}

df_status staging_mark(acc *a, cudaEvent_t *ev, int *busy, char *err);

/* One layer's session state on the device, with device copies of the
 * layer's per-channel parameters taken when it was made (so nothing is
 * keyed by host addresses that a later engine may reuse). */
struct dev_state {
    void *d;
    int64_t bytes;
    float *conv[3], *a, *dt_bias, *o_norm; /* KDA */
    float *kv_a_norm, *inv_freq, *q_a_norm; /* MLA */
};

void dev_state_free(dev_state *st) {
    if (!st) return;
    float *all[9] = {st->conv[0], st->conv[1], st->conv[2], st->a, st->dt_bias, st->o_norm, st->kv_a_norm,
                     st->inv_freq, st->q_a_norm};
    for (int j = 0; j < 9; j++) cudaFree(all[j]);
    cudaFree(st->d);
    free(st);
}

/* Device copies of n host floats into *dst (nothing for n == 0). */
cudaError_t dev_copy(float **dst, const float *src, size_t n) {
    if (!n) return cudaSuccess;
    cudaError_t e = cudaMalloc((void **)dst, n * sizeof(float));
    return e == cudaSuccess ? cudaMemcpy(*dst, src, n * sizeof(float), cudaMemcpyHostToDevice) : e;
}

/* The mla_shape of a layer (the host inv_freq is never read on the device). */
mla_shape mla_shape_of(const df_accel_mla *l) {
    mla_shape sh = {0, l->nh, l->dn, l->dr, l->dv, l->dn + l->dr, l->R, 0, l->use_rope, l->rope_interleave,
                    l->inv_freq, l->rope_mscale, l->softmax_scale, l->latent_eps};
    return sh;
}

void handle_free(handle *h) {
    if (!h) return;
    gpu_weight_free(&h->g);
    if (h->ready) cudaEventDestroy(h->ready);
    if (h->freed) cudaEventDestroy(h->freed);
    free(h);
}

void spares_free(acc *a) {
    while (a->nspare) handle_free(a->spare[--a->nspare]);
}

/* Starts the copy of w into h (same sizes) on the copy stream. */
df_status handle_fill(acc *a, handle *h, const df_weight *w, char *err) {
    if (h->was_freed) { /* products queued before its release may still read it */
        cudaError_t e = cudaStreamWaitEvent(a->copy, h->freed, 0);
        if (e != cudaSuccess) return cerr(err, e, "waiting for a released copy");
        h->was_freed = 0;
    }
    df_status st;
    if (h->g.frag && !h->g.data) { /* the fragment layout: staged, then re-laid on the copy stream */
        const size_t need = (size_t)gpu_mx_frag_stage_bytes(w);
        if (a->cap_stage < need) {
            cudaError_t e = cudaStreamSynchronize(a->copy); /* the old stage may still be read */
            cudaFree(a->stage);
            a->stage = NULL;
            a->cap_stage = 0;
            if (e == cudaSuccess) e = cudaMalloc(&a->stage, need);
            if (e != cudaSuccess) {
                a->stage = NULL;
                return cerr(err, e, "upload stage");
            }
            a->cap_stage = need;
        }
        st = gpu_weight_refill_frag_async(w, &h->g, a->stage, a->copy, err);
    } else {
        st = gpu_weight_refill_async(w, &h->g, a->copy, err);
    }
    if (st) return st;
    h->settled = 0;
    cudaError_t e = cudaEventRecord(h->ready, a->copy);
    return e == cudaSuccess ? DF_OK : cerr(err, e, "upload event");
}

/* The products on a->stream wait (on the device) for h's upload; once the
 * upload is seen complete, never again (a resident copy costs no stream
 * wait per product: host time between a sync and the next launch). */
df_status handle_wait(acc *a, const handle *h, char *err) {
    if (h->settled) return DF_OK;
    cudaError_t e = cudaEventQuery(h->ready);
    if (e == cudaSuccess) {
        ((handle *)h)->settled = 1;
        return DF_OK;
    }
    if (e != cudaErrorNotReady) return cerr(err, e, "an upload");
    e = cudaStreamWaitEvent(a->stream, h->ready, 0);
    return e == cudaSuccess ? DF_OK : cerr(err, e, "waiting for an upload");
}

/* Activations between pinned staging and device buffers, on the product
 * stream by a kernel (gpu_copy): they never wait behind weight uploads on
 * the copy engines. */
df_status act_copy(acc *a, float *dst, const float *src, size_t floats, char *err) {
    df_status st = gpu_copy(dst, src, floats * sizeof(float), a->stream);
    if (st != DF_OK && err) snprintf(err, DF_ERRMSG, "cuda: activations: %s", gpu_last_error());
    return st;
}

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
    for (int i = a->nspare - 1; i >= 0; i--) {
        handle *h = a->spare[i];
        if (!gpu_weight_fits(w, &h->g)) continue;
        a->spare[i] = a->spare[--a->nspare];
        if (handle_fill(a, h, w, err) == DF_OK) return h;
        handle_free(h);
        return NULL;
    }
    handle *h = (handle *)calloc(1, sizeof *h);
    if (!h) return NULL;
    cudaError_t e = cudaEventCreateWithFlags(&h->ready, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&h->freed, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        cerr(err, e, "upload event");
        handle_free(h);
        return NULL;
    }
    /* MXFP4 in the fragment layout (gpu.h): the same products, faster */
    df_status (*alloc)(const df_weight *, gpu_weight *, char *) =
        gpu_mx_frag_takes(w) ? gpu_weight_alloc_frag : gpu_weight_alloc;
    st = alloc(w, &h->g, err);
    if (st == DF_ERR_NOMEM && a->nspare) { /* the spares hold the memory: give it back, retry */
        spares_free(a);
        st = alloc(w, &h->g, err);
    }
    if (st == DF_OK) st = handle_fill(a, h, w, err);
    if (st != DF_OK) {
        handle_free(h);
        return NULL;
    }
    return h;
}

df_status queue_launch(acc *a, char *err);

void acc_release(void *ctx, void *hp) {
    acc *a = (acc *)ctx;
    handle *h = (handle *)hp;
    if (!h) return;
    /* queued experts that read it are launched first, so the events below
     * follow them */
    if (h->qref > 0) {
        df_status st = queue_launch(a, a->flush_err);
        if (st != DF_OK && a->flush_st == DF_OK) a->flush_st = st;
    }
    /* queued products may still read h: a spare's next fill waits for them
     * (handle_fill), a copy given back waits here */
    if (a->nspare < SPARE_MAX && h->g.data_bytes + h->g.scale_bytes <= SPARE_BYTES &&
        cudaEventRecord(h->freed, a->stream) == cudaSuccess) {
        h->was_freed = 1;
        a->spare[a->nspare++] = h;
        return;
    }
    cudaStreamSynchronize(a->stream);
    handle_free(h);
}

df_status acc_matmul(void *ctx, void *hp, const float *X, int n, float *Y, int64_t ldy, int64_t row0,
                     int64_t row1, char *err) {
    acc *a = (acc *)ctx;
    const handle *h = (const handle *)hp;
    const gpu_weight *g = &h->g;
    if (handle_wait(a, h, err) != DF_OK) return DF_ERR_IO;
    const int64_t cols = g->cols, rows = row1 - row0;
    if (!grow(&a->hx, &a->dx, &a->cap_x, (size_t)n * cols, err)) return DF_ERR_NOMEM;
    if (!grow(&a->hy, &a->dy, &a->cap_y, (size_t)n * rows, err)) return DF_ERR_NOMEM;
    memcpy(a->hx, X, (size_t)n * cols * sizeof(float));
    if (act_copy(a, a->dx, a->hx, (size_t)n * cols, err) != DF_OK) return DF_ERR_IO;
    df_status st = gpu_matmul_tc(g, a->dx, n, a->dy, rows, row0, row1, &a->ws, a->stream);
    if (st != DF_OK) {
        if (err) snprintf(err, DF_ERRMSG, "cuda: matmul: %s", gpu_last_error());
        return st;
    }
    if (act_copy(a, a->hy, a->dy, (size_t)n * rows, err) != DF_OK) return DF_ERR_IO;
    cudaError_t e = cudaStreamSynchronize(a->stream);
    if (e != cudaSuccess) return cerr(err, e, "matmul");
    for (int i = 0; i < n; i++)
        memcpy(Y + (size_t)i * ldy, a->hy + (size_t)i * rows, (size_t)rows * sizeof(float));
    return DF_OK;
}

/* Several products behind one host wait: each distinct X staged once, all
 * inputs up in one copy, the products (gpu_matmul_tc, as acc_matmul), all
 * outputs back in one copy. */
df_status acc_matmul_many(void *ctx, int count, void *const *hp, const float *const *X, const int *n,
                          float *const *Y, const int64_t *ldy, char *err) {
    acc *a = (acc *)ctx;
    enum { MANY_MAX = 16 };
    if (count < 1 || count > MANY_MAX) return DF_ERR_ARG;
    size_t xoff[MANY_MAX], yoff[MANY_MAX], nx = 0, ny = 0;
    int xd[MANY_MAX], yd[MANY_MAX];
    for (int i = 0; i < count; i++) {
        const handle *h = (const handle *)hp[i];
        if (handle_wait(a, h, err) != DF_OK) return DF_ERR_IO;
        xd[i] = is_dev(a, X[i]); /* device inputs are read and outputs written where they are */
        yd[i] = is_dev(a, Y[i]);
        int same = -1;
        for (int j = 0; j < i && same < 0 && !xd[i]; j++)
            if (!xd[j] && X[j] == X[i] && n[j] == n[i] && ((const handle *)hp[j])->g.cols == h->g.cols) same = j;
        if (xd[i]) xoff[i] = 0;
        else if (same >= 0) xoff[i] = xoff[same];
        else {
            xoff[i] = nx;
            nx += al16((size_t)n[i] * h->g.cols);
        }
        yoff[i] = ny;
        if (!yd[i]) ny += al16((size_t)n[i] * h->g.rows);
    }
    if (!grow(&a->hx, &a->dx, &a->cap_x, nx, err)) return DF_ERR_NOMEM;
    if (!grow(&a->hy, &a->dy, &a->cap_y, ny, err)) return DF_ERR_NOMEM;
    for (int i = 0; i < count; i++) {
        if (xd[i]) continue;
        const int64_t cols = ((const handle *)hp[i])->g.cols;
        int first = 1;
        for (int j = 0; j < i && first; j++) first = xd[j] || xoff[j] != xoff[i];
        if (first) memcpy(a->hx + xoff[i], X[i], (size_t)n[i] * cols * sizeof(float));
    }
    if (nx && act_copy(a, a->dx, a->hx, nx, err) != DF_OK) return DF_ERR_IO;
    for (int i = 0; i < count; i++) {
        const gpu_weight *g = &((const handle *)hp[i])->g;
        const float *x = xd[i] ? X[i] : a->dx + xoff[i];
        df_status st = yd[i] ? gpu_matmul_tc(g, x, n[i], Y[i], ldy[i], 0, g->rows, &a->ws, a->stream)
                             : gpu_matmul_tc(g, x, n[i], a->dy + yoff[i], g->rows, 0, g->rows, &a->ws, a->stream);
        if (st != DF_OK) {
            if (err) snprintf(err, DF_ERRMSG, "cuda: matmul: %s", gpu_last_error());
            return st;
        }
    }
    /* everything on the device, nothing staged: queued, no wait */
    if (!nx && !ny) return DF_OK;
    if (ny && act_copy(a, a->hy, a->dy, ny, err) != DF_OK) return DF_ERR_IO;
    cudaError_t e;
    if (a->nlaunched < a->npend) {
        /* experts queued before these products (a layer's shared experts)
         * run while the host works on the outputs: wait for the outputs
         * alone, then launch them behind */
        if (!a->mm_ev && (e = cudaEventCreateWithFlags(&a->mm_ev, cudaEventDisableTiming)) != cudaSuccess)
            return cerr(err, e, "matmul event");
        if ((e = cudaEventRecord(a->mm_ev, a->stream)) != cudaSuccess) return cerr(err, e, "matmul event");
        df_status qs = queue_launch(a, a->flush_err);
        if (qs != DF_OK && a->flush_st == DF_OK) a->flush_st = qs; /* reported at finish */
        e = cudaEventSynchronize(a->mm_ev);
    } else {
        e = cudaStreamSynchronize(a->stream);
    }
    if (e != cudaSuccess) return cerr(err, e, "matmul");
    for (int i = 0; i < count; i++) {
        if (yd[i]) continue;
        const int64_t rows = ((const handle *)hp[i])->g.rows;
        for (int v = 0; v < n[i]; v++)
            memcpy(Y[i] + (size_t)v * ldy[i], a->hy + yoff[i] + (size_t)v * rows, (size_t)rows * sizeof(float));
    }
    return DF_OK;
}

/* Makes room for one more queued expert: n_x input and n_y output floats,
 * n_h hidden floats, n rows. Growing the staged inputs first finishes the
 * queue; the device outputs grow on the stream (qdy_grow). */
df_status queue_room(acc *a, size_t n_x, size_t n_y, size_t n_h, int n, char *err);
df_status acc_expert_finish(void *ctx, char *err);

/* What a full buffer grows to: twice the demand that did not fit (the
 * queue so far and this expert: a layer's experts, so the next layer's fit
 * without a wait), at least 16 experts like this one. */
static size_t room_for(size_t need, size_t one, size_t cap) {
    if (need <= cap) return cap;
    return 2 * need > 16 * one ? 2 * need : 16 * one;
}

/* The queue's device outputs (qdy) moved to a buffer of cap floats on the
 * product stream: the used part copied there behind the launches that
 * write it, the old buffer freed behind that copy. No host wait, so a
 * layer's first large batch does not finish the queue to make room. */
static df_status qdy_grow(acc *a, size_t cap, char *err) {
    float *d = NULL;
    cudaError_t e = cudaMallocAsync((void **)&d, cap * sizeof(float), a->stream);
    if (e != cudaSuccess) return cerr(err, e, "expert queue outputs");
    if (a->qy_used && (e = cudaMemcpyAsync(d, a->qdy, a->qy_used * sizeof(float), cudaMemcpyDeviceToDevice,
                                           a->stream)) != cudaSuccess) {
        cudaFreeAsync(d, a->stream);
        return cerr(err, e, "expert queue outputs");
    }
    if (a->qdy) cudaFreeAsync(a->qdy, a->stream);
    a->qdy = d;
    a->qcap_y = cap;
    return DF_OK;
}

df_status queue_room(acc *a, size_t n_x, size_t n_y, size_t n_h, int n, char *err) {
    (void)n_h; /* gpu_experts keeps its own scratch */
    const size_t need_x = a->qx_used + n_x, need_y = a->qy_used + n_y;
    const int need_rows = a->nrows + n, jobs_full = a->npend == a->cap_pend;
    if (need_x <= a->qcap_x && need_y <= a->qcap_y && !jobs_full && need_rows <= a->cap_rows) return DF_OK;
    if (need_x > a->qcap_x) { /* staged inputs in use by queued work: finish it first */
        if (a->npend) {
            df_status st = acc_expert_finish(a, err);
            if (st != DF_OK) return st;
        }
        if (!grow(&a->qhx, &a->qdx, &a->qcap_x, room_for(need_x, n_x, a->qcap_x), err)) return DF_ERR_NOMEM;
    }
    if (a->qy_used + n_y > a->qcap_y) {
        df_status st = qdy_grow(a, room_for(a->qy_used + n_y, n_y, a->qcap_y), err);
        if (st != DF_OK) return st;
    }
    /* host tables: launches copy what they read from them */
    if (a->npend == a->cap_pend) {
        int nc = a->cap_pend ? 2 * a->cap_pend : 64;
        pending *p = (pending *)realloc(a->pend, (size_t)nc * sizeof *p);
        if (!p) return DF_ERR_NOMEM;
        a->pend = p;
        gpu_expert_job *j = (gpu_expert_job *)realloc(a->jobs, (size_t)nc * sizeof *j);
        if (!j) return DF_ERR_NOMEM;
        a->jobs = j;
        a->cap_pend = nc;
    }
    if (a->nrows + n > a->cap_rows) {
        int nc = 2 * (a->nrows + n) > 256 ? 2 * (a->nrows + n) : 256;
        int *r = (int *)realloc(a->qrows, (size_t)nc * sizeof *r);
        if (!r) return DF_ERR_NOMEM;
        a->qrows = r;
        a->cap_rows = nc;
    }
    return DF_OK;
}

/* One routed expert queued: its inputs staged in pinned memory and its
 * product stream waits on its uploads; nothing is launched until the batch
 * is (queue_launch: at finish, or when a copy it reads is released). */
df_status acc_expert_queue(void *ctx, void *gate, void *up, void *down, int situ, float beta, float linear_beta,
                           const float *X, int n, float *out, const int *rows, int64_t stride, char *err) {
    acc *a = (acc *)ctx;
    handle *hg = (handle *)gate, *hu = (handle *)up, *hd = (handle *)down;
    const gpu_weight *g = &hg->g, *d = &hd->g;
    const int64_t hid = g->cols, inter = g->rows, dim = d->rows;
    if (n <= 0) return DF_OK;
    const int xd = is_dev(a, X);
    df_status st = queue_room(a, xd ? 0 : (size_t)n * hid, (size_t)n * dim, (size_t)n * inter, n, err);
    if (st != DF_OK) return st;
    if (handle_wait(a, hg, err) || handle_wait(a, hu, err) || handle_wait(a, hd, err)) return DF_ERR_IO;
    if (!xd) memcpy(a->qhx + a->qx_used, X, (size_t)n * hid * sizeof(float));
    pending *p = &a->pend[a->npend++];
    p->xdev = xd ? X : NULL;
    p->out_dev = is_dev(a, out);
    p->in_place = 0; /* queue_launch decides */
    p->h[0] = hg;
    p->h[1] = hu;
    p->h[2] = hd;
    p->act = {situ, beta, linear_beta};
    p->out = out;
    p->stride = stride;
    p->dim = dim;
    p->hid = hid;
    p->x_off = (int64_t)a->qx_used;
    p->y_off = (int64_t)a->qy_used;
    p->n = n;
    p->rows_off = a->nrows;
    for (int i = 0; i < 3; i++) p->h[i]->qref++;
    memcpy(a->qrows + a->nrows, rows, (size_t)n * sizeof(int));
    a->nrows += n;
    if (!xd) a->qx_used += (size_t)n * hid;
    a->qy_used += (size_t)n * dim;
    return DF_OK;
}

/* Where queued expert p's launch writes its output rows on the device:
 * qdy (read from there at finish or copied to device outputs; recomputed
 * at each use, as qdy_grow may move it) or their place (in_place). */
float *pending_rows(const acc *a, const pending *p) {
    return p->in_place ? p->out + (size_t)a->qrows[p->rows_off] * p->stride : a->qdy + p->y_off;
}

/* Whether queued expert p (launched with those from `first`) writes its
 * output rows straight into their place in device memory: rows in order,
 * one after another (the whole MLP of a dense layer over a pass's rows),
 * 16-byte aligned, overlapping no input of the launch (gpu_experts' rule).
 * Else they land in qdy and are copied there. */
int out_in_place(const acc *a, const pending *p, int first) {
    const int *rows = a->qrows + p->rows_off;
    if (!p->out_dev || p->stride != p->dim) return 0;
    for (int r = 1; r < p->n; r++)
        if (rows[r] != rows[r - 1] + 1) return 0;
    const float *y0 = p->out + (size_t)rows[0] * p->stride, *y1 = y0 + (size_t)p->n * p->dim;
    if ((uintptr_t)y0 % 16) return 0;
    for (int i = first; i < a->npend; i++) {
        const pending *q = &a->pend[i];
        const float *x0 = q->xdev ? q->xdev : a->qdx + q->x_off, *x1 = x0 + (size_t)q->n * q->hid;
        if (x0 < y1 && y0 < x1) return 0;
    }
    return 1;
}

/* Launches the queued experts not launched yet: their staged inputs up in
 * one copy, gpu_experts over runs of one activation (a layer's experts: two
 * tensor-core batches), outputs for device memory copied there (those for
 * host memory come back at finish, in one copy). No host wait. */
df_status queue_launch(acc *a, char *err) {
    const int first = a->nlaunched;
    if (first == a->npend) return DF_OK;
    int staged = first; /* the first staged input */
    while (staged < a->npend && a->pend[staged].xdev) staged++;
    df_status st = DF_OK;
    if (staged < a->npend) {
        const int64_t x0 = a->pend[staged].x_off;
        st = act_copy(a, a->qdx + x0, a->qhx + x0, a->qx_used - (size_t)x0, err);
    }
    for (int i = first; i < a->npend; i++) {
        pending *p = &a->pend[i];
        const float *x = p->xdev ? p->xdev : a->qdx + p->x_off;
        p->in_place = out_in_place(a, p, first);
        a->jobs[i] = {&p->h[0]->g, &p->h[1]->g, &p->h[2]->g, x, p->n, pending_rows(a, p)};
    }
    for (int r0 = first; st == DF_OK && r0 < a->npend;) {
        int r1 = r0 + 1;
        const gpu_act &x = a->pend[r0].act;
        while (r1 < a->npend && a->pend[r1].act.situ == x.situ && a->pend[r1].act.beta == x.beta &&
               a->pend[r1].act.linear_beta == x.linear_beta)
            r1++;
        st = gpu_experts(a->jobs + r0, r1 - r0, &x, &a->ews, a->stream);
        if (st != DF_OK && err) snprintf(err, DF_ERRMSG, "cuda: experts: %s", gpu_last_error());
        r0 = r1;
    }
    /* outputs for host memory come back at finish (queue_outputs_back) */
    for (int i = first; st == DF_OK && i < a->npend; i++) { /* outputs for device memory: copied there */
        const pending *p = &a->pend[i];
        const int *rows = a->qrows + p->rows_off;
        for (int r = 0; p->out_dev && !p->in_place && st == DF_OK && r < p->n;) {
            int r1 = r + 1; /* a run of consecutive rows: one copy */
            while (r1 < p->n && p->stride == p->dim && rows[r1] == rows[r1 - 1] + 1) r1++;
            st = act_copy(a, p->out + (size_t)rows[r] * p->stride, a->qdy + p->y_off + (size_t)r * p->dim,
                          (size_t)(r1 - r) * p->dim, err);
            r = r1;
        }
    }
    for (int i = first; i < a->npend; i++)
        for (int k = 0; k < 3; k++) a->pend[i].h[k]->qref--;
    a->nlaunched = a->npend;
    return st;
}

int pinned_room(void **h, size_t *cap, size_t bytes, cudaEvent_t ev, int *busy, char *err);

/* The queue's outputs to pinned staging (qhy) when one of them is for host
 * memory (moe_tail: other than its routed and shared rows, which it takes
 * on the device): one copy behind every launch, before the finishing wait. */
df_status queue_outputs_back(acc *a, int skip_tail, const float *routed, const float *shared, char *err) {
    for (int i = 0; i < a->npend; i++) {
        const pending *p = &a->pend[i];
        if (p->out_dev || (skip_tail && (p->out == routed || (shared && p->out == shared)))) continue;
        int busy = 0; /* no queued work reads qhy: the last queue to was finished */
        if (!pinned_room((void **)&a->qhy, &a->qhy_bytes, a->qcap_y * sizeof(float), NULL, &busy, err))
            return DF_ERR_NOMEM;
        return act_copy(a, a->qhy, a->qdy, a->qy_used, err);
    }
    return DF_OK;
}

/* A queued expert's output (host staging qhy, after the stream's sync) to
 * its rows of p->out. */
static void pending_out(const acc *a, const pending *p) {
    for (int r = 0; !p->out_dev && r < p->n; r++)
        memcpy(p->out + (size_t)a->qrows[p->rows_off + r] * p->stride, a->qhy + p->y_off + (size_t)r * p->dim,
               (size_t)p->dim * sizeof(float));
}

/* The queue emptied once finished (acc_expert_finish, acc_moe_tail). */
static void queue_clear(acc *a) {
    a->npend = 0;
    a->nlaunched = 0;
    a->flush_st = DF_OK;
    a->nrows = 0;
    a->qx_used = a->qy_used = 0;
}

/* Whether the host must wait for the queue's work before it is cleared: an
 * input staged in pinned memory (reused by the next queue) or an output
 * for host memory. Without either, the uploads the queued experts read are
 * waited for instead (their host bytes may be reused once finish returns). */
int queue_needs_wait(const acc *a, int skip_routed, const float *routed, const float *shared) {
    for (int i = 0; i < a->npend; i++) {
        const pending *p = &a->pend[i];
        const int tail_row = skip_routed && (p->out == routed || (shared && p->out == shared));
        if (!p->xdev || (!p->out_dev && !tail_row)) return 1;
    }
    return 0;
}

cudaError_t queue_uploads_wait(const acc *a) {
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < a->npend && e == cudaSuccess; i++)
        for (int k = 0; k < 3 && e == cudaSuccess; k++)
            if (!a->pend[i].h[k]->settled) e = cudaEventSynchronize(a->pend[i].h[k]->ready);
    return e;
}

/* Launches what is queued, waits for the product stream (not for uploads
 * started since: prefetches keep running), then writes every queued output
 * to its rows (outputs for device memory are copied there by the stream,
 * and then the host waits only for the uploads, see queue_needs_wait). */
df_status acc_expert_finish(void *ctx, char *err) {
    acc *a = (acc *)ctx;
    if (!a->npend) return DF_OK;
    df_status st = queue_launch(a, err);
    if (st == DF_OK && a->flush_st != DF_OK) {
        st = a->flush_st;
        if (err) snprintf(err, DF_ERRMSG, "%s", a->flush_err);
    }
    if (st == DF_OK) st = queue_outputs_back(a, 0, NULL, NULL, err);
    cudaError_t e = queue_needs_wait(a, 0, NULL, NULL) ? cudaStreamSynchronize(a->stream) : queue_uploads_wait(a);
    if (st == DF_OK && e != cudaSuccess) st = cerr(err, e, "queued experts");
    for (int i = 0; st == DF_OK && i < a->npend; i++) pending_out(a, &a->pend[i]);
    queue_clear(a);
    return st;
}

/* The end of a latent MoE layer on the device (df_accel.moe_tail): the
 * queued experts are launched, each (token, slot) row and shared row is
 * found on the device (queued outputs) or staged from host memory, then
 * gpu_moe_combine, gpu_rmsnorm, lat_up and the shared add, written into out
 * where that is device memory, else brought back; the queue is finished as
 * in acc_expert_finish. */
df_status acc_moe_tail(void *ctx, int n, int K, const float *selw, const float *routed, int64_t dl,
                       const float *lat_norm, float eps, void *lat_up, const float *shared, float *out, char *err) {
    acc *a = (acc *)ctx;
    const handle *hu = (const handle *)lat_up;
    const gpu_weight *up = &hu->g;
    const int64_t H = up->rows, R = (int64_t)n * K;
    const int out_dev = is_dev(a, out);
    staging_wait(a->th_ev, &a->th_busy); /* the last tail's staging was read by the device */
    df_status st = queue_launch(a, err);
    if (st == DF_OK && a->flush_st != DF_OK) {
        st = a->flush_st;
        if (err) snprintf(err, DF_ERRMSG, "%s", a->flush_err);
    }
    if (st == DF_OK && (up->cols != dl || n < 1 || K < 1)) {
        if (err) snprintf(err, DF_ERRMSG, "cuda: moe tail: lat_up is %lldx%lld for rows of %lld", (long long)up->rows,
                          (long long)up->cols, (long long)dl);
        st = DF_ERR_ARG;
    }
    /* where each row is: a queued output on the device, or host memory */
    if (st == DF_OK && a->cap_tsrc < R + n) {
        const int64_t nc = R + n < 4096 ? 4096 : 2 * (R + n);
        const float **p = (const float **)realloc(a->tsrc, (size_t)nc * sizeof *p);
        if (p) {
            a->tsrc = p;
            a->cap_tsrc = nc;
        } else {
            st = DF_ERR_NOMEM;
        }
    }
    const float **src = a->tsrc;
    if (st == DF_OK) memset(src, 0, (size_t)(R + n) * sizeof *src);
    int64_t nhost = 0;
    for (int i = 0; st == DF_OK && i < a->npend; i++) {
        const pending *p = &a->pend[i];
        const int is_r = p->out == routed && p->dim == dl && p->stride == dl;
        const int is_s = shared && p->out == shared && p->dim == H && p->stride == H;
        const float *y = pending_rows(a, p);
        for (int r = 0; (is_r || is_s) && r < p->n; r++) {
            const int64_t row = a->qrows[p->rows_off + r];
            if (is_r && row >= 0 && row < R) src[row] = y + (size_t)r * p->dim;
            if (is_s && row >= 0 && row < n) src[R + row] = y + (size_t)r * p->dim;
        }
    }
    for (int64_t r = 0; st == DF_OK && r < R + (shared ? n : 0); r++)
        if (!src[r]) nhost += r < R ? dl : H;
    /* staging: selw | ones [n] | lat_norm | host rows | row pointers (R routed, n shared, n of y) |
     * sums [n][dl] | y [n][H] */
    const size_t o_one = al16((size_t)R), o_norm = o_one + al16((size_t)n);
    const size_t o_host = o_norm + al16(lat_norm ? (size_t)dl : 0);
    const size_t o_ptr = o_host + al16((size_t)nhost), o_sum = o_ptr + al16(2 * (size_t)(R + 2 * n) + 2);
    const size_t o_y = o_sum + al16((size_t)n * dl), total = o_y + al16((size_t)n * H);
    if (st == DF_OK && !grow(&a->th, &a->td, &a->cap_t, total, err)) st = DF_ERR_NOMEM;
    if (st == DF_OK) {
        memcpy(a->th, selw, (size_t)R * sizeof(float));
        for (int t = 0; t < n; t++) a->th[o_one + t] = 1.0f;
        if (lat_norm) memcpy(a->th + o_norm, lat_norm, (size_t)dl * sizeof(float));
        const float **ptr = (const float **)(void *)(a->th + o_ptr); /* o_ptr is 64-byte aligned */
        size_t h = o_host;
        for (int64_t r = 0; r < R + (shared ? n : 0); r++) {
            if (src[r]) { ptr[r] = src[r]; continue; }
            const int64_t w = r < R ? dl : H;
            memcpy(a->th + h, r < R ? routed + r * dl : shared + (r - R) * H, (size_t)w * sizeof(float));
            ptr[r] = a->td + h;
            h += (size_t)w;
        }
        /* y straight into out when that is device memory (no copy after) */
        float *dsum = a->td + o_sum, *dy = out_dev ? out : a->td + o_y;
        for (int t = 0; t < n; t++) ptr[R + n + t] = dy + (size_t)t * H;
        const float *const *dptr = (const float *const *)(void *)(a->td + o_ptr);
        st = act_copy(a, a->td, a->th, o_sum, err);
        if (st == DF_OK) st = staging_mark(a, &a->th_ev, &a->th_busy, err);
        if (st == DF_OK) st = gpu_moe_combine(dptr, a->td, n, K, dl, NULL, dsum, a->stream);
        if (st == DF_OK && lat_norm) st = gpu_rmsnorm(dsum, dsum, a->td + o_norm, n, (int)dl, eps, a->stream);
        if (st == DF_OK && (st = handle_wait(a, hu, err)) == DF_OK)
            st = gpu_matmul_tc(up, dsum, n, dy, H, 0, H, &a->ws, a->stream);
        if (st == DF_OK && shared) /* y + shared: y as a combine of one row with weight 1 (exact), in place */
            st = gpu_moe_combine(dptr + R + n, a->td + o_one, n, 1, H, dptr + R, dy, a->stream);
        if (st == DF_OK && !out_dev) st = act_copy(a, a->th + o_y, dy, (size_t)n * H, err);
        if (st != DF_OK && err && !*err) snprintf(err, DF_ERRMSG, "cuda: moe tail: %s", gpu_last_error());
    }
    if (st == DF_OK) st = queue_outputs_back(a, 1, routed, shared, err);
    /* out on the device and nothing else for the host: no wait for the work */
    const int wait = st != DF_OK || !out_dev || queue_needs_wait(a, 1, routed, shared);
    cudaError_t e = wait ? cudaStreamSynchronize(a->stream) : queue_uploads_wait(a);
    if (st == DF_OK && e != cudaSuccess) st = cerr(err, e, "moe tail");
    if (st == DF_OK && !out_dev) memcpy(out, a->th + o_y, (size_t)n * H * sizeof(float));
    /* other queued outputs (none in a MoE layer today) go where finish puts them */
    for (int i = 0; st == DF_OK && i < a->npend; i++) {
        const pending *p = &a->pend[i];
        if (p->out == routed || (shared && p->out == shared)) continue;
        pending_out(a, p);
    }
    queue_clear(a);
    return st;
}

void acc_uploads_wait(void *ctx) {
    acc *a = (acc *)ctx;
    cudaStreamSynchronize(a->copy);
}

/* ---- KDA on the device ---- */

kda_shape kda_shape_of(const df_accel_kda *l) {
    kda_shape sh = {0, l->H, l->D, l->W, 0, l->has_lower_bound, l->lower_bound, l->norm_eps};
    return sh;
}

int kda_supported(const df_accel_kda *l) {
    if (!l || l->H < 1) return 0;
    const kda_shape sh = kda_shape_of(l);
    return gpu_kda_takes(&sh);
}

/* 1 if the MLA kernels take this layer (shapes of gpu_mla_write /
 * gpu_mla_attend, bf16 kv_b for the absorbed products). */
int mla_supported(const df_accel_mla *l) {
    if (!l || !l->kv_b) return 0;
    const mla_shape sh = mla_shape_of(l);
    gpu_weight kv_b = {};
    kv_b.type = ((const df_weight *)l->kv_b)->type;
    return gpu_mla_takes(&sh) && gpu_mla_products_take(&kv_b);
}

void *acc_state_new(void *ctx, const df_accel_kda *layer, const df_accel_mla *mla, int64_t bytes, char *err) {
    acc *a = (acc *)ctx;
    if (layer ? !kda_supported(layer) : !mla_supported(mla)) {
        if (layer) snprintf(err, DF_ERRMSG, "cuda: no KDA kernel for head dim %d, conv %d", layer->D, layer->W);
        else snprintf(err, DF_ERRMSG, "cuda: no MLA kernels for this layer (kv_b_proj must be bf16 or row-int8)");
        return NULL;
    }
    cudaSetDevice(a->device);
    dev_state *st = (dev_state *)calloc(1, sizeof *st);
    if (!st) return NULL;
    cudaError_t e = cudaMalloc(&st->d, (size_t)bytes);
    if (e == cudaSuccess) e = cudaMemset(st->d, 0, (size_t)bytes);
    if (layer) {
        const size_t P = (size_t)layer->H * layer->D, W = (size_t)layer->W;
        if (e == cudaSuccess) e = dev_copy(&st->conv[0], layer->conv[0], P * W);
        if (e == cudaSuccess) e = dev_copy(&st->conv[1], layer->conv[1], P * W);
        if (e == cudaSuccess) e = dev_copy(&st->conv[2], layer->conv[2], P * W);
        if (e == cudaSuccess) e = dev_copy(&st->a, layer->a, P);
        if (e == cudaSuccess) e = dev_copy(&st->dt_bias, layer->dt_bias, P);
        if (e == cudaSuccess) e = dev_copy(&st->o_norm, layer->o_norm, (size_t)layer->D);
    } else {
        if (e == cudaSuccess) e = dev_copy(&st->kv_a_norm, mla->kv_a_norm, (size_t)mla->R);
        if (e == cudaSuccess && mla->use_rope) e = dev_copy(&st->inv_freq, mla->inv_freq, (size_t)mla->dr / 2);
        if (e == cudaSuccess && mla->q_a_norm && mla->qlr > 0)
            e = dev_copy(&st->q_a_norm, mla->q_a_norm, (size_t)mla->qlr);
    }
    if (e != cudaSuccess) {
        cerr(err, e, "session state");
        dev_state_free(st);
        return NULL;
    }
    st->bytes = bytes;
    return st;
}

void acc_state_free(void *ctx, void *state) {
    acc *a = (acc *)ctx;
    dev_state *st = (dev_state *)state;
    if (!st) return;
    cudaSetDevice(a->device);
    cudaStreamSynchronize(a->stream);
    dev_state_free(st);
}

df_status acc_state_zero(void *ctx, void *state, char *err) {
    acc *a = (acc *)ctx;
    dev_state *st = (dev_state *)state;
    cudaError_t e = cudaMemsetAsync(st->d, 0, (size_t)st->bytes, a->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(a->stream);
    return e == cudaSuccess ? DF_OK : cerr(err, e, "clearing a session state");
}

/* One KDA layer step: inputs to the device (one staging copy), gpu_kda on
 * the session's state, o back. */
df_status acc_kda(void *ctx, const df_accel_kda *l, void *state, int n, const float *q, const float *k,
                  const float *v, const float *f, const float *braw, const float *gate, float *o, char *err) {
    acc *a = (acc *)ctx;
    dev_state *st = (dev_state *)state;
    const size_t nP = (size_t)n * l->H * l->D, nH = (size_t)n * l->H, in = 5 * nP + nH;
    if (!grow(&a->kh, &a->kd, &a->cap_k, in + nP, err)) return DF_ERR_NOMEM;
    const float *src[6] = {q, k, v, f, gate, braw};
    const size_t cnt[6] = {nP, nP, nP, nP, nP, nH};
    size_t off = 0;
    for (int i = 0; i < 6; i++) {
        memcpy(a->kh + off, src[i], cnt[i] * sizeof(float));
        off += cnt[i];
    }
    if (act_copy(a, a->kd, a->kh, in, err) != DF_OK) return DF_ERR_IO;
    const kda_shape sh = kda_shape_of(l);
    const kda_params p = {{st->conv[0], st->conv[1], st->conv[2]}, st->a, st->dt_bias, st->o_norm};
    float *d = a->kd;
    df_status rs = gpu_kda(&sh, &p, (float *)st->d, n, d, d + nP, d + 2 * nP, d + 3 * nP, d + 5 * nP, d + 4 * nP,
                           d + in, &a->kda_ws, a->stream);
    if (rs != DF_OK) {
        snprintf(err, DF_ERRMSG, "cuda: kda: %s", rs == DF_ERR_IO ? gpu_last_error() : "refused");
        return rs;
    }
    if (act_copy(a, a->kh + in, a->kd + in, nP, err) != DF_OK) return DF_ERR_IO;
    cudaError_t e = cudaStreamSynchronize(a->stream);
    if (e != cudaSuccess) return cerr(err, e, "kda");
    memcpy(o, a->kh + in, nP * sizeof(float));
    return DF_OK;
}

/* A whole layer's device copies mats[0..n) as handles h (NULL where the
 * layer has none), each waited for (its upload may still be in flight). */
static df_status layer_handles(acc *a, void *const *mats, int n, const handle **h, char *err) {
    for (int i = 0; i < n; i++) {
        h[i] = (const handle *)mats[i];
        if (h[i] && handle_wait(a, h[i], err) != DF_OK) return DF_ERR_IO;
    }
    return DF_OK;
}

/* A whole KDA layer: xn up, the projections into device buffers (the
 * low-rank halves reading their first halves there), gpu_kda, the output
 * projection, out back: one host wait, the same kernels and inputs as the
 * products through acc_matmul and acc_kda (so the same bits). */
df_status acc_kda_layer(void *ctx, const df_accel_kda *l, void *state, int n, void *const *mats, const float *xn,
                        float *out, char *err) {
    acc *a = (acc *)ctx;
    dev_state *st = (dev_state *)state;
    const handle *h[DF_KDA_MATS];
    if (layer_handles(a, mats, DF_KDA_MATS, h, err) != DF_OK) return DF_ERR_IO;
    const int full = h[DF_KDA_G] != NULL;
    if (!h[DF_KDA_Q] || !h[DF_KDA_K] || !h[DF_KDA_V] || !h[DF_KDA_FA] || !h[DF_KDA_FB] || !h[DF_KDA_B] ||
        !h[DF_KDA_O] || (!full && (!h[DF_KDA_GA] || !h[DF_KDA_GB]))) {
        if (err) snprintf(err, DF_ERRMSG, "cuda: kda layer: a projection is missing");
        return DF_ERR_ARG;
    }
    const int64_t hid = h[DF_KDA_Q]->g.cols, D = l->D;
    const size_t nP = (size_t)n * l->H * l->D, nH = (size_t)n * l->H, nx = (size_t)n * hid, nD = (size_t)n * D;
    /* device layout: q k v f gate braw (acc_kda's order) | o | xn | fa | gl | out */
    const size_t aP = al16(nP), in = 5 * aP + al16(nH);
    const size_t total = in + aP + al16(nx) + 2 * al16(nD) + al16(nx);
    if (!grow(&a->kh, &a->kd, &a->cap_k, total, err)) return DF_ERR_NOMEM;
    float *d = a->kd, *q = d, *k = d + aP, *v = d + 2 * aP, *f = d + 3 * aP, *gate = d + 4 * aP, *braw = d + 5 * aP;
    float *o = d + in, *x = o + aP, *fa = x + al16(nx), *gl = fa + al16(nD), *y = gl + al16(nD);
    const int xd = is_dev(a, xn), od = is_dev(a, out); /* read / written where they are */
    if (xd) {
        x = (float *)xn;
    } else {
        memcpy(a->kh + (x - d), xn, nx * sizeof(float));
        if (act_copy(a, x, a->kh + (x - d), nx, err) != DF_OK) return DF_ERR_IO;
    }
    if (od) y = out;
    struct {
        int m;
        const float *X;
        float *Y;
    } steps[8] = {{DF_KDA_Q, x, q}, {DF_KDA_K, x, k}, {DF_KDA_V, x, v}, {DF_KDA_FA, x, fa}, {DF_KDA_FB, fa, f},
                  {DF_KDA_B, x, braw}, {full ? DF_KDA_G : DF_KDA_GA, x, full ? gate : gl}, {DF_KDA_GB, gl, gate}};
    for (int i = 0; i < (full ? 7 : 8); i++) {
        const gpu_weight *g = &h[steps[i].m]->g;
        df_status ps = gpu_matmul_tc(g, steps[i].X, n, steps[i].Y, g->rows, 0, g->rows, &a->ws, a->stream);
        if (ps != DF_OK) {
            if (err) snprintf(err, DF_ERRMSG, "cuda: kda layer: %s", gpu_last_error());
            return ps;
        }
    }
    const kda_shape sh = kda_shape_of(l);
    const kda_params p = {{st->conv[0], st->conv[1], st->conv[2]}, st->a, st->dt_bias, st->o_norm};
    df_status rs = gpu_kda(&sh, &p, (float *)st->d, n, q, k, v, f, braw, gate, o, &a->kda_ws, a->stream);
    if (rs != DF_OK) {
        snprintf(err, DF_ERRMSG, "cuda: kda: %s", rs == DF_ERR_IO ? gpu_last_error() : "refused");
        return rs;
    }
    const gpu_weight *go = &h[DF_KDA_O]->g;
    rs = gpu_matmul_tc(go, o, n, y, go->rows, 0, go->rows, &a->ws, a->stream);
    if (rs != DF_OK) {
        if (err) snprintf(err, DF_ERRMSG, "cuda: kda layer: %s", gpu_last_error());
        return rs;
    }
    if (xd && od) return DF_OK; /* queued; nothing staged, nothing for the host */
    if (od) { /* the staged input must be read before the next call writes it */
        cudaError_t e = cudaStreamSynchronize(a->stream);
        return e == cudaSuccess ? DF_OK : cerr(err, e, "kda layer");
    }
    if (act_copy(a, a->kh + (y - d), y, nx, err) != DF_OK) return DF_ERR_IO;
    cudaError_t e = cudaStreamSynchronize(a->stream);
    if (e != cudaSuccess) return cerr(err, e, "kda layer");
    memcpy(out, a->kh + (y - d), nx * sizeof(float));
    return DF_OK;
}

/* kv_b's absorbed products on the tensor cores (gpu_mla_absorb_tc, _lift_tc)
 * where bf16 products of n rows run there (n >= bf16_tc_rows, as
 * gpu_matmul_tc decides) and kv_b's shape lets them; else the CUDA cores.
 * On the H100 this took the 512-token K3r prompt from 0.0390 to 0.0366 s
 * (bench/cuda_NOTES.md, fifty-third session). */
#ifndef GPU_MLA_TC
#define GPU_MLA_TC 1 /* build flag, for measurements: 0 keeps them on the CUDA cores */
#endif
static bool mla_tc(acc *a, const gpu_weight *kv_b, const mla_shape *sh, int n) {
    return GPU_MLA_TC && a->ws.bf16_tc_rows > 0 && n >= a->ws.bf16_tc_rows && gpu_mla_products_tc_take(kv_b, sh);
}
static df_status mla_absorb(acc *a, const gpu_weight *kv_b, const mla_shape *sh, bool tc, const float *q, int n,
                            float *qlat) {
    return tc ? gpu_mla_absorb_tc(kv_b, sh, q, n, qlat, &a->ws, a->stream)
              : gpu_mla_absorb(kv_b, sh, q, n, qlat, a->stream);
}
static df_status mla_lift(acc *a, const gpu_weight *kv_b, const mla_shape *sh, bool tc, const float *olat, int n,
                          float *attn) {
    return tc ? gpu_mla_lift_tc(kv_b, sh, olat, n, attn, &a->ws, a->stream)
              : gpu_mla_lift(kv_b, sh, olat, n, attn, a->stream);
}

/* A whole MLA layer: xn up, q (through q_a, its norm and q_b, or q), kva,
 * the cache write and attention as in acc_mla, the gate, the output
 * projection, out back: one host wait. */
df_status acc_mla_layer(void *ctx, const df_accel_mla *l, void *kv_b, void *state, int pos, int n, void *const *mats,
                        const float *xn, float *out, char *err) {
    acc *a = (acc *)ctx;
    dev_state *st = (dev_state *)state;
    const handle *h[DF_MLA_MATS];
    if (layer_handles(a, mats, DF_MLA_MATS, h, err) != DF_OK) return DF_ERR_IO;
    if (handle_wait(a, (const handle *)kv_b, err) != DF_OK) return DF_ERR_IO;
    const int lr = h[DF_MLA_QA] != NULL;
    if (!h[DF_MLA_KVA] || !h[DF_MLA_O] || (lr ? !h[DF_MLA_QB] || !st->q_a_norm || l->qlr < 1 : !h[DF_MLA_Q]) ||
        (l->has_gate && !h[DF_MLA_G])) {
        if (err) snprintf(err, DF_ERRMSG, "cuda: mla layer: a projection or q_a's norm is missing");
        return DF_ERR_ARG;
    }
    const gpu_weight *w = &((const handle *)kv_b)->g;
    const mla_shape sh = mla_shape_of(l);
    const int64_t hid = h[DF_MLA_KVA]->g.cols, qlr = lr ? l->qlr : 0;
    const bool tc = mla_tc(a, w, &sh, n);
    const int piece = tc ? MLA_TC_PIECE : MLA_PIECE, pc = n < piece ? n : piece; /* rows per absorb / attend / lift */
    const size_t nq = (size_t)n * l->nh * sh.dq, nkv = (size_t)n * (l->R + l->dr), nlat = (size_t)l->nh * pc * l->R;
    const size_t nat = (size_t)n * l->nh * l->dv, nx = (size_t)n * hid, nqa = (size_t)n * qlr;
    /* device: x | q | kva | qlat | olat (pc rows) | attn | qa | gate | y */
    const size_t total = al16(nx) + al16(nq) + al16(nkv) + 2 * al16(nlat) + al16(nat) + al16(nqa) + al16(nat) + al16(nx);
    if (!grow(&a->mh, &a->md, &a->cap_m, total, err)) return DF_ERR_NOMEM;
    float *x = a->md, *q = x + al16(nx), *kva = q + al16(nq), *qlat = kva + al16(nkv), *olat = qlat + al16(nlat);
    float *att = olat + al16(nlat), *qa = att + al16(nat), *gate = qa + al16(nqa), *y = gate + al16(nat);
    const int xd = is_dev(a, xn), od = is_dev(a, out); /* read / written where they are */
    if (xd) {
        x = (float *)xn;
    } else {
        memcpy(a->mh, xn, nx * sizeof(float));
        if (act_copy(a, x, a->mh, nx, err) != DF_OK) return DF_ERR_IO;
    }
    if (od) y = out;
    df_status rs = DF_OK;
#define MLA_MM(m, X, Y) \
    (rs == DF_OK ? gpu_matmul_tc(&h[m]->g, X, n, Y, h[m]->g.rows, 0, h[m]->g.rows, &a->ws, a->stream) : rs)
    if (lr) {
        rs = MLA_MM(DF_MLA_QA, x, qa);
        if (rs == DF_OK) rs = gpu_rmsnorm(qa, qa, st->q_a_norm, n, (int)qlr, l->latent_eps, a->stream);
        rs = MLA_MM(DF_MLA_QB, qa, q);
    } else {
        rs = MLA_MM(DF_MLA_Q, x, q);
    }
    rs = MLA_MM(DF_MLA_KVA, x, kva);
    float *cache = (float *)st->d;
    if (rs == DF_OK) rs = gpu_mla_write(&sh, st->kv_a_norm, st->inv_freq, kva, cache, pos, n, q, a->stream);
    /* attention in pieces of the rows a chunked pass has (the cache rows of
     * every piece are written; each row attends up to its own position) */
    for (int c0 = 0; rs == DF_OK && c0 < n; c0 += pc) {
        const int cn = n - c0 < pc ? n - c0 : pc;
        const float *qc = q + (size_t)c0 * l->nh * sh.dq;
        rs = mla_absorb(a, w, &sh, tc, qc, cn, qlat);
        if (rs == DF_OK) rs = gpu_mla_attend(&sh, cache, qc, qlat, pos + c0, cn, olat, &a->mla_ws, a->stream);
        if (rs == DF_OK) rs = mla_lift(a, w, &sh, tc, olat, cn, att + (size_t)c0 * l->nh * l->dv);
    }
    if (l->has_gate) {
        rs = MLA_MM(DF_MLA_G, x, gate);
        if (rs == DF_OK) rs = gpu_sigmoid_mul(att, gate, (int64_t)nat, a->stream);
    }
    rs = MLA_MM(DF_MLA_O, att, y);
#undef MLA_MM
    if (rs != DF_OK) {
        snprintf(err, DF_ERRMSG, "cuda: mla layer: %s", rs == DF_ERR_IO ? gpu_last_error() : df_status_name(rs));
        return rs;
    }
    if (xd && od) return DF_OK; /* queued; nothing staged, nothing for the host */
    if (!od && act_copy(a, a->mh, y, nx, err) != DF_OK) return DF_ERR_IO;
    cudaError_t e = cudaStreamSynchronize(a->stream); /* (od: the staged input read before the next call) */
    if (e != cudaSuccess) return cerr(err, e, "mla layer");
    if (!od) memcpy(out, a->mh, nx * sizeof(float));
    return DF_OK;
}

/* One MLA layer step: q and kva to the device (one staging copy), the cache
 * rows + q_pe rotation, absorb, attention over the cache, lift, attn back. */
df_status acc_mla(void *ctx, const df_accel_mla *l, void *kv_b, void *state, int pos, int n, const float *q,
                  const float *kva, float *attn, char *err) {
    acc *a = (acc *)ctx;
    dev_state *st = (dev_state *)state;
    const gpu_weight *w = &((const handle *)kv_b)->g;
    if (handle_wait(a, (const handle *)kv_b, err) != DF_OK) return DF_ERR_IO;
    const mla_shape sh = mla_shape_of(l);
    const size_t nq = (size_t)n * l->nh * sh.dq, nkv = (size_t)n * (l->R + l->dr), nlat = (size_t)l->nh * n * l->R;
    const size_t nat = (size_t)n * l->nh * l->dv, in = nq + nkv;
    if (!grow(&a->mh, &a->md, &a->cap_m, in + 2 * nlat + nat, err)) return DF_ERR_NOMEM;
    memcpy(a->mh, q, nq * sizeof(float));
    memcpy(a->mh + nq, kva, nkv * sizeof(float));
    if (act_copy(a, a->md, a->mh, in, err) != DF_OK) return DF_ERR_IO;
    float *dq = a->md, *dkv = a->md + nq, *qlat = a->md + in, *olat = qlat + nlat, *dat = olat + nlat;
    float *cache = (float *)st->d;
    df_status rs = gpu_mla_write(&sh, st->kv_a_norm, st->inv_freq, dkv, cache, pos, n, dq, a->stream);
    const bool tc = mla_tc(a, w, &sh, n);
    if (rs == DF_OK) rs = mla_absorb(a, w, &sh, tc, dq, n, qlat);
    if (rs == DF_OK) rs = gpu_mla_attend(&sh, cache, dq, qlat, pos, n, olat, &a->mla_ws, a->stream);
    if (rs == DF_OK) rs = mla_lift(a, w, &sh, tc, olat, n, dat);
    if (rs != DF_OK) {
        snprintf(err, DF_ERRMSG, "cuda: mla: %s", rs == DF_ERR_IO ? gpu_last_error() : df_status_name(rs));
        return rs;
    }
    if (act_copy(a, a->mh + in, dat, nat, err) != DF_OK) return DF_ERR_IO;
    cudaError_t e = cudaStreamSynchronize(a->stream);
    if (e != cudaSuccess) return cerr(err, e, "mla");
    memcpy(attn, a->mh + in, nat * sizeof(float));
    return DF_OK;
}

/* ---- activations on the device (df_accel.dev_*) ---- */

df_status staging_mark(acc *a, cudaEvent_t *ev, int *busy, char *err) {
    cudaError_t e = *ev ? cudaSuccess : cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(*ev, a->stream);
    if (e != cudaSuccess) return cerr(err, e, "staging event");
    *busy = 1;
    return DF_OK;
}

float *acc_dev_alloc(void *ctx, int64_t floats, char *err) {
    acc *a = (acc *)ctx;
    int i = 0;
    while (i < 64 && a->dblk[i]) i++;
    if (i == 64 || floats < 1) {
        snprintf(err, DF_ERRMSG, "cuda: no room for another activation block");
        return NULL;
    }
    cudaSetDevice(a->device);
    float *p = NULL;
    cudaError_t e = cudaMalloc((void **)&p, (size_t)floats * sizeof(float));
    if (e == cudaSuccess) e = cudaMemsetAsync(p, 0, (size_t)floats * sizeof(float), a->stream);
    if (e != cudaSuccess) {
        cerr(err, e, "activation block");
        cudaFree(p);
        return NULL;
    }
    a->dblk[i] = p;
    a->dlen[i] = (size_t)floats;
    return p;
}

void acc_dev_free(void *ctx, float *p) {
    acc *a = (acc *)ctx;
    for (int i = 0; p && i < 64; i++) {
        if (a->dblk[i] != p) continue;
        cudaSetDevice(a->device);
        cudaStreamSynchronize(a->stream); /* no queued work may still use it */
        cudaFree(p);
        a->dblk[i] = NULL;
        a->dlen[i] = 0;
    }
}

/* Pinned staging *h of *cap bytes, once queued work no longer reads it
 * (ev, *busy), grown to at least `bytes` (64 KiB at least). 0 with err when
 * it cannot be allocated. */
int pinned_room(void **h, size_t *cap, size_t bytes, cudaEvent_t ev, int *busy, char *err) {
    staging_wait(ev, busy);
    if (bytes <= *cap) return 1;
    const size_t nc = bytes < 65536 ? 65536 : bytes;
    cudaFreeHost(*h);
    *h = NULL;
    *cap = 0;
    cudaError_t e = cudaMallocHost(h, nc);
    if (e != cudaSuccess) {
        cerr(err, e, "staging buffers");
        *h = NULL;
        return 0;
    }
    *cap = nc;
    return 1;
}

/* A dev_ kernel's launch status with its message. */
df_status dev_launched(df_status st, const char *what, char *err) {
    if (st != DF_OK && err) snprintf(err, DF_ERRMSG, "cuda: %s: %s", what, st == DF_ERR_IO ? gpu_last_error() : df_status_name(st));
    return st;
}

float *acc_dev_stage(void *ctx, int64_t floats, char *err) {
    acc *a = (acc *)ctx;
    if (floats <= 0) return NULL;
    return pinned_room((void **)&a->sh, &a->cap_sh, (size_t)floats * sizeof(float), a->sh_ev, &a->sh_busy, err)
               ? a->sh
               : NULL;
}

df_status acc_dev_put(void *ctx, float *dst, const float *src, int64_t floats, char *err) {
    acc *a = (acc *)ctx;
    if (floats <= 0) return DF_OK;
    if (a->sh && src >= a->sh && src + floats <= a->sh + a->cap_sh / sizeof(float)) { /* the stage, in place */
        df_status st = act_copy(a, dst, src, (size_t)floats, err);
        return st == DF_OK ? staging_mark(a, &a->sh_ev, &a->sh_busy, err) : st;
    }
    if (!pinned_room(&a->ph, &a->cap_ph, (size_t)floats * sizeof(float), a->ph_ev, &a->ph_busy, err))
        return DF_ERR_NOMEM;
    memcpy(a->ph, src, (size_t)floats * sizeof(float));
    df_status st = act_copy(a, dst, (const float *)a->ph, (size_t)floats, err);
    return st == DF_OK ? staging_mark(a, &a->ph_ev, &a->ph_busy, err) : st;
}

df_status acc_dev_get(void *ctx, float *dst, const float *src, int64_t floats, char *err) {
    acc *a = (acc *)ctx;
    if (floats <= 0) return DF_OK;
    if (!pinned_room(&a->ph, &a->cap_ph, (size_t)floats * sizeof(float), a->ph_ev, &a->ph_busy, err))
        return DF_ERR_NOMEM;
    df_status st = act_copy(a, (float *)a->ph, src, (size_t)floats, err);
    cudaError_t e = cudaStreamSynchronize(a->stream);
    if (st == DF_OK && e != cudaSuccess) st = cerr(err, e, "activations");
    if (st == DF_OK) memcpy(dst, a->ph, (size_t)floats * sizeof(float));
    return st;
}

df_status acc_dev_rmsnorm(void *ctx, float *out, const float *x, const float *w, int n, int dim, float eps, char *err) {
    acc *a = (acc *)ctx;
    return dev_launched(gpu_rmsnorm(out, x, w, n, dim, eps, a->stream), "rmsnorm", err);
}

df_status acc_dev_attn_res(void *ctx, float *out, const float *anchors, int64_t astride, int na, const float *cur,
                           const float *w, int n, int dim, float eps, char *err) {
    acc *a = (acc *)ctx;
    return dev_launched(gpu_attn_res(anchors, astride, na, cur, w, dim, eps, n, out, a->stream), "attention residual",
                        err);
}

df_status acc_dev_res_norm(void *ctx, float *xn, float *h, const float *d, int restart, float *anc_out,
                           const float *anchors, int64_t astride, int na, const float *probe, const float *nw, int n,
                           int dim, float eps, char *err) {
    acc *a = (acc *)ctx;
    df_status st = gpu_res_norm(xn, h, d, restart, anc_out, anchors, astride, na, probe, nw, dim, eps, n, a->stream);
    return st == DF_ERR_UNSUPPORTED ? st : dev_launched(st, "residual step", err);
}

df_status acc_dev_add(void *ctx, float *y, const float *x, int64_t floats, char *err) {
    acc *a = (acc *)ctx;
    return dev_launched(gpu_add(y, x, floats, a->stream), "add", err);
}

df_status acc_dev_copy(void *ctx, float *dst, const float *src, int64_t floats, char *err) {
    acc *a = (acc *)ctx;
    return dev_launched(gpu_copy(dst, src, (size_t)floats * sizeof(float), a->stream), "copy", err);
}

df_status acc_dev_gather(void *ctx, float *dst, const float *src, const int *idx, int count, int64_t width,
                         char *err) {
    acc *a = (acc *)ctx;
    if (count <= 0) return DF_OK;
    if (!pinned_room(&a->gh, &a->cap_gh, (size_t)count * sizeof(int), a->gh_ev, &a->gh_busy, err))
        return DF_ERR_NOMEM;
    memcpy(a->gh, idx, (size_t)count * sizeof(int));
    df_status st =
        dev_launched(gpu_gather_rows(dst, src, (const int *)a->gh, count, width, a->stream), "gather", err);
    return st == DF_OK ? staging_mark(a, &a->gh_ev, &a->gh_busy, err) : st;
}

df_status acc_pin(void *ctx, void *ptr, size_t bytes, char *err) {
    acc *a = (acc *)ctx;
    cudaSetDevice(a->device);
    cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) { /* read-only mappings (a mapped spine) need the read-only flag */
        cudaGetLastError(); /* not sticky: clear it */
        e = cudaHostRegister(ptr, bytes, cudaHostRegisterReadOnly);
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        return cerr(err, e, "page-locking host memory for uploads");
    }
    return DF_OK;
}

void acc_unpin(void *ctx, void *ptr) {
    acc *a = (acc *)ctx;
    cudaSetDevice(a->device);
    cudaStreamSynchronize(a->copy); /* no upload may still read it */
    cudaHostUnregister(ptr);
    cudaGetLastError();
}

/* t[0..4] in ascending order (insertion sort): t[2] is the median. */
/* GB/s of op moving `bytes` on a->stream (gpu_median_rate). */
template <typename Op> static double median_gbps(acc *a, size_t bytes, Op op) {
    return gpu_median_rate(a->stream, (double)bytes, op) / 1e9;
}

/* Median of 5 timed 256 MiB copies from page-locked memory. */
double acc_h2d_gbps(void *ctx) {
    acc *a = (acc *)ctx;
    cudaSetDevice(a->device);
    const size_t n = (size_t)256 << 20;
    void *h = NULL, *d = NULL;
    double gbps = 0.0;
    if (cudaMallocHost(&h, n) == cudaSuccess && cudaMalloc(&d, n) == cudaSuccess) {
        memset(h, 1, n);
        gbps = median_gbps(a, n, [&] { cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, a->stream); });
    }
    cudaFreeHost(h);
    cudaFree(d);
    cudaGetLastError();
    return gbps;
}

/* Read-only probe: every thread sums 16-byte loads over a grid-stride loop;
 * a result that depends on every byte is written so nothing is elided. */
__global__ void k_read_probe(const uint4 *__restrict__ p, size_t n16, unsigned *out) {
    unsigned acc = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(p + i); /* streaming: do not keep it in L2 */
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc; /* almost never taken; keeps the loads */
}

/* Device read bandwidth: median of 5 timed passes of k_read_probe over a
 * buffer of 1 GiB (halved while it cannot be allocated, down to 256 MiB:
 * still 4x the H200's 60 MB L2) after one warm-up pass; 0 on failure. */
double acc_read_gbps(void *ctx) {
    acc *a = (acc *)ctx;
    cudaSetDevice(a->device);
    size_t n = (size_t)1 << 30;
    void *d = NULL;
    unsigned *o = NULL;
    double gbps = 0.0;
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, a->device);
    while (cudaMalloc(&d, n) != cudaSuccess && n > ((size_t)256 << 20)) {
        cudaGetLastError();
        n /= 2;
    }
    if (d && cudaMalloc((void **)&o, sizeof *o) == cudaSuccess &&
        cudaMemsetAsync(d, 0x5a, n, a->stream) == cudaSuccess)
        gbps = median_gbps(a, n, [&] {
            k_read_probe<<<(unsigned)(sms > 0 ? sms * 8 : 1024), 512, 0, a->stream>>>((const uint4 *)d, n / 16, o);
        });
    cudaFree(d);
    cudaFree(o);
    cudaGetLastError();
    return gbps;
}

/* The tensor cores' bf16 rates (gpu_tc_probe): 0 on failure. */
static void acc_tc_tflops(void *ctx, double *sync, double *wg) {
    acc *a = (acc *)ctx;
    cudaSetDevice(a->device);
    if (gpu_tc_probe(a->stream, sync, wg) != DF_OK) *sync = *wg = 0;
    cudaGetLastError();
}

#if GPU_TIMELINE
/* A measurement build (-DGPU_TIMELINE=1; nsys is not on the device machine):
 * each hook below runs between two events on the product stream, and the
 * time between them (the hook's device work, and any idle gap while the
 * host launched it) is summed per hook and printed to stderr at exit. The
 * events are read back every TL_PAIRS calls (a wait) and at exit. With
 * DF_TL_TRACE=FILE it also writes one line a call: the hook, the host's ms
 * at its entry and exit and the device's ms at its two events, all from the
 * first call, so the device's idle time between calls shows, and the host
 * work before each (bench/timeline_gaps.py sums them). Never in a default
 * build. */
const char *const tl_name[TL_CATS] = {"matmul", "matmul_many", "expert_finish", "moe_tail", "kda", "kda_layer",
                                      "mla_layer", "mla", "dev_put", "dev_get", "dev_rmsnorm", "dev_attn_res",
                                      "dev_add", "dev_copy", "dev_gather", "dev_res_norm", "expert_queue"};
acc *tl_acc; /* the one accelerator of a measurement run, for the exit report */

double tl_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

void tl_flush(acc *a) {
    if (!a->tl_n) return;
    cudaEventSynchronize(a->tl_ev[2 * a->tl_n - 1]);
    for (int i = 0; i < a->tl_n; i++) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, a->tl_ev[2 * i], a->tl_ev[2 * i + 1]) == cudaSuccess) a->tl_ms[a->tl_cat[i]] += ms;
        /* the trace: hook, host ms at entry and exit, device ms at its two
         * events, all from the first call's (an idle device between two
         * calls shows as a gap between one's end and the next's start) */
        float d0 = 0, d1 = 0;
        if (a->tl_trace && cudaEventElapsedTime(&d0, a->tl_zero, a->tl_ev[2 * i]) == cudaSuccess &&
            cudaEventElapsedTime(&d1, a->tl_zero, a->tl_ev[2 * i + 1]) == cudaSuccess)
            fprintf(a->tl_trace, "%s %.4f %.4f %.4f %.4f\n", tl_name[a->tl_cat[i]], 1e3 * (a->tl_host[2 * i] - a->tl_host0),
                    1e3 * (a->tl_host[2 * i + 1] - a->tl_host0), d0, d1);
    }
    cudaGetLastError();
    a->tl_n = 0;
}

void tl_report(void) {
    acc *a = tl_acc;
    if (!a) return;
    cudaSetDevice(a->device);
    tl_flush(a);
    double all = 0;
    for (int c = 0; c < TL_CATS; c++) all += a->tl_ms[c];
    if (a->tl_trace) fclose(a->tl_trace);
    fprintf(stderr, "device timeline (GPU_TIMELINE): %.1f ms in hooks\n", all);
    for (int c = 0; c < TL_CATS; c++)
        if (a->tl_calls[c]) fprintf(stderr, "  %-14s %8ld calls %10.2f ms\n", tl_name[c], a->tl_calls[c], a->tl_ms[c]);
}

template <int CAT, class Sig, Sig *F> struct timed;
template <int CAT, class R, class... A, R (*F)(void *, A...)> struct timed<CAT, R(void *, A...), F> {
    static R call(void *ctx, A... args) {
        acc *a = (acc *)ctx;
        if (a->tl_n == TL_PAIRS) tl_flush(a);
        const int i = a->tl_n;
        if (!a->tl_ev[2 * i]) cudaEventCreate(&a->tl_ev[2 * i]), cudaEventCreate(&a->tl_ev[2 * i + 1]);
        if (!a->tl_zero) {
            const char *f = getenv("DF_TL_TRACE");
            a->tl_trace = f && *f ? fopen(f, "w") : NULL;
            cudaEventCreate(&a->tl_zero);
            cudaEventRecord(a->tl_zero, a->stream);
            a->tl_host0 = tl_now();
        }
        a->tl_host[2 * i] = tl_now();
        cudaEventRecord(a->tl_ev[2 * i], a->stream);
        R r = F(ctx, args...);
        cudaEventRecord(a->tl_ev[2 * i + 1], a->stream);
        a->tl_host[2 * i + 1] = tl_now();
        a->tl_cat[i] = CAT;
        a->tl_calls[CAT]++;
        a->tl_n++;
        return r;
    }
};
#define TL(cat, f) timed<cat, decltype(f), f>::call
#else
#define TL(cat, f) f
#endif

} // namespace

extern "C" const df_accel *gpu_accel_open(int device, int64_t gpu_mem, int bf16_tc_rows, int bf16_wg, int mx_wg,
                                            char *err) {
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
    if ((e = cudaStreamCreateWithFlags(&a->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&a->copy, cudaStreamNonBlocking)) != cudaSuccess) {
        cerr(err, e, "cudaStreamCreate");
        if (a->stream) cudaStreamDestroy(a->stream);
        free(a);
        return NULL;
    }
    int64_t avail = (int64_t)free_b - ((int64_t)2 << 30);
    if (avail < ((int64_t)256 << 20)) avail = (int64_t)256 << 20;
    a->pub.budget = gpu_mem > 0 ? gpu_mem : avail;
    a->ws.bf16_tc_rows = a->ews.bf16_tc_rows = bf16_tc_rows > 0 ? bf16_tc_rows : 0;
    a->ws.bf16_wg = a->ews.bf16_wg = bf16_wg < 0 ? -1 : bf16_wg > 0 ? 1 : 0;
    a->ews.frag_wg = mx_wg < 0 ? -1 : mx_wg > 0 ? 1 : 0;
    snprintf(a->name, sizeof a->name, "cuda:%d %s (sm_%d%d, %d SMs, %.1f GB, %.1f GB free)", device, p.name,
             p.major, p.minor, p.multiProcessorCount, total_b / 1e9, free_b / 1e9);
    a->pub.name = a->name;
    a->pub.ctx = a;
    a->pub.upload = acc_upload;
    a->pub.release = acc_release;
    a->pub.matmul = TL(0, acc_matmul);
#ifndef GPU_NO_MANY /* diagnostics: build without the hook */
    a->pub.matmul_many = TL(1, acc_matmul_many);
#endif
    a->pub.pin = acc_pin;
    a->pub.unpin = acc_unpin;
    a->pub.h2d_gbps = acc_h2d_gbps;
    a->pub.read_gbps = acc_read_gbps;
    a->pub.tc_tflops = acc_tc_tflops;
    a->pub.expert_queue = TL(16, acc_expert_queue);
    a->pub.expert_finish = TL(2, acc_expert_finish);
#ifndef GPU_NO_MOE_TAIL
    a->pub.moe_tail = TL(3, acc_moe_tail);
#endif
    a->pub.uploads_wait = acc_uploads_wait;
    a->pub.state_new = acc_state_new;
    a->pub.state_free = acc_state_free;
    a->pub.state_zero = acc_state_zero;
    a->pub.kda = TL(4, acc_kda);
#ifndef GPU_NO_KDA_LAYER
    a->pub.kda_layer = TL(5, acc_kda_layer);
#endif
#ifndef GPU_NO_MLA_LAYER
    a->pub.mla_layer = TL(6, acc_mla_layer);
#endif
    a->pub.mla = TL(7, acc_mla);
#ifndef GPU_NO_DEV_STEP /* diagnostics: the host-centred step */
    a->pub.dev_alloc = acc_dev_alloc;
    a->pub.dev_free = acc_dev_free;
    a->pub.dev_put = TL(8, acc_dev_put);
    a->pub.dev_stage = acc_dev_stage;
    a->pub.dev_get = TL(9, acc_dev_get);
    a->pub.dev_rmsnorm = TL(10, acc_dev_rmsnorm);
    a->pub.dev_attn_res = TL(11, acc_dev_attn_res);
    a->pub.dev_add = TL(12, acc_dev_add);
    a->pub.dev_copy = TL(13, acc_dev_copy);
    a->pub.dev_gather = TL(14, acc_dev_gather);
    a->pub.dev_res_norm = TL(15, acc_dev_res_norm);
#endif
#if GPU_TIMELINE
    if (!tl_acc) {
        tl_acc = a;
        atexit(tl_report);
    }
#endif
    return &a->pub;
}

extern "C" void gpu_accel_close(const df_accel *pa) {
    if (!pa) return;
    acc *a = (acc *)pa->ctx;
    cudaSetDevice(a->device);
    cudaDeviceSynchronize();
    cudaFreeHost(a->hx);
    cudaFreeHost(a->hy);
    cudaFree(a->dx);
    cudaFree(a->dy);
    cudaFreeHost(a->hh);
    cudaFree(a->dh);
    cudaFreeHost(a->qhx);
    cudaFree(a->qdx);
    cudaFreeHost(a->qhy);
    if (a->qdy) cudaFreeAsync(a->qdy, a->stream); /* stream-ordered (qdy_grow) */
    cudaStreamSynchronize(a->stream);
    free(a->pend);
    free(a->jobs);
    gpu_ws_free(&a->ews);
    free(a->qrows);
    cudaFreeHost(a->kh);
    cudaFree(a->kd);
    cudaFreeHost(a->th);
    cudaFree(a->td);
    free(a->tsrc);
    cudaFreeHost(a->mh);
    cudaFree(a->md);
    cudaFreeHost(a->ph);
    if (a->ph_ev) cudaEventDestroy(a->ph_ev);
    cudaFreeHost(a->sh);
    if (a->sh_ev) cudaEventDestroy(a->sh_ev);
    if (a->th_ev) cudaEventDestroy(a->th_ev);
    if (a->mm_ev) cudaEventDestroy(a->mm_ev);
    if (a->gh_ev) cudaEventDestroy(a->gh_ev);
    cudaFreeHost(a->gh);
    for (int i = 0; i < 64; i++) cudaFree(a->dblk[i]);
    gpu_ws_free(&a->mla_ws);
    gpu_ws_free(&a->kda_ws);
    gpu_ws_free(&a->ws);
    cudaFree(a->stage);
    spares_free(a);
    cudaStreamDestroy(a->copy);
    cudaStreamDestroy(a->stream);
    free(a);
}
