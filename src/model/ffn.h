/* ffn.h — gated MLPs and the MoE block (prefixes ffn_, moe_).
 *
 * ffn_forward: out = down(act(gate x, up x)) with act SiLU(g)*u or K3's
 * SiTU(g, u) = beta*tanh(g/beta)*sigmoid(g) * lb*tanh(u/lb).
 *
 * moe_forward: router (sigmoid or softmax scores, correction bias for
 * selection only, optional group limit, top-k, renormalisation, scaling),
 * routed experts (optionally in a latent space: down-proj -> experts ->
 * weighted sum -> RMSNorm -> up-proj) plus shared experts. Every expert
 * used by a chunk runs once over all its tokens; per token the expert
 * outputs are summed in ascending expert id, so results do not depend on
 * the chunk.
 */
#ifndef DF_MODEL_FFN_H
#define DF_MODEL_FFN_H
#include <stdatomic.h>
#include "model.h"
#include "../experts/store.h"

typedef struct {
    int situ;                   /* 0 SiLU, 1 SiTU */
    float beta;                 /* SiTU gate beta */
    float linear_beta;          /* SiTU up beta; 0 = up unchanged */
} ffn_act;

typedef struct { df_weight gate, up, down; } ffn_weights;

typedef struct moe_layer_s {
    int E, K, n_group, topk_group;
    int sigmoid;                /* 1 sigmoid scores, 0 softmax */
    float group_mask;           /* value given to experts of dropped groups (0 or -inf) */
    int renorm;                 /* divide by the sum of chosen scores (+1e-20) */
    float scale;                /* routed_scaling_factor */
    df_weight router;           /* [E, hidden] */
    float *bias;                /* [E] owned; zeros when the checkpoint has none */
    ffn_weights *experts;       /* [E] owned array of views */
    int has_shared;
    ffn_weights shared;
    int latent;                 /* latent MoE (K3) */
    df_weight lat_down, lat_up; /* [Dl, hidden], [hidden, Dl] */
    float *lat_norm;            /* [Dl] owned, NULL: no norm */
    float lat_eps;
    int64_t expert_bytes;       /* one expert, as stored */
    xs_store *store;            /* experts come from the store (views lazily bound); NULL: mmap */
    int layer;                  /* this layer's index in the store */
    const struct moe_layer_s *next; /* the next MoE layer, for router lookahead; NULL at the end */
    int lookahead;              /* prefetch the next layer's predicted experts */
    void (*trace)(void *ctx, int pos, int layer, const int *experts, const float *weights, int k);
    void *trace_ctx;
    int trace_layer;            /* model layer index reported to the trace */
} moe_layer;

/* Routed experts gathered to run together on the CPU (moe_batch.c). */
typedef struct {
    int cap, dl, inter_cap;     /* rows the buffers hold; widths they hold */
    int64_t inter;              /* the batch's experts' intermediate size */
    int n, rows;                /* experts and rows in the batch now */
    int *x;                     /* [E] expert ids, in the order added */
    ffn_weights *w;             /* [E] their views */
    int *off;                   /* [E + 1] first row of each expert */
    int *tok, *slot;            /* [cap] each row's (token, slot) */
    const float *src;           /* the rows the batch's inputs are gathered from (moe_batch_add's xin) */
    float *in, *out;            /* [cap][dl] gathered inputs (when the batch runs), outputs */
    float *g, *u;               /* [cap][inter] */
    /* KN_AMX: each expert's input packed once for the batch's threads */
    kn_amx_x *px;               /* [E]; px[i].B NULL: expert i runs kn_matmul */
    uint8_t *pxb;               /* the packed inputs, pxb_bytes */
    int64_t pxb_bytes;
    int *unit_x, *unit_g;       /* [cap] the (expert, group) of each packing unit */
    /* other levels: each expert's input as the tiles read it, prepared once
     * per pass (kn_px_*), not once per chunk of rows a thread claims */
    float *xp, *xpd;            /* [cap][kn_px_len(max(dl, inter_cap))]: gate's and up's input, down's */
    int64_t *xpo, *xpdo;        /* [E] where expert i's rows start in xp / xpd; -1: none (kn_matmul) */
    /* the one-pass schedule (moe_batch_run): per expert, gate / up rows
     * still to do, and whether its down projection may start */
    _Atomic int64_t *left;      /* [E] */
    _Atomic int *ready;         /* [E] */
} moe_batch;

/* One row of a decode step whose activations stay on the device
 * (ffn_block_dev): device pointers, and whether the inputs were brought to
 * the host for a part the device did not take. */
typedef struct {
    int n;                      /* rows */
    float *xn, *xl, *out;       /* the normed input [n][hidden], the latent input [n][dl], the output [n][hidden] */
    float *xg;                  /* [n K][dl]: routed experts' input rows gathered per expert (n > 1) */
    const float *xin;           /* what routed experts read: xl (latent layers) or xn */
    int fetched;                /* xn and xl are in host memory too (dv_fetch) */
    df_status st;               /* a failed fetch (then the block fails) */
} moe_dev;

typedef struct {
    int chunk, hidden, inter, E, K, dl;
    float *g, *u;               /* [chunk][inter] */
    float *rlog;                /* [chunk][E] */
    int *sel;                   /* [chunk][K] ascending expert ids */
    float *selw;                /* [chunk][K] */
    float *ys;                  /* [chunk][K][dl] per-slot expert outputs */
    int *etok, *eslot;          /* [chunk*K] */
    float *xl;                  /* [chunk][dl] latent inputs */
    float *xe, *ye;             /* [chunk][max(dl,hidden)] gathered in/out */
    float *acc;                 /* [chunk][dl] */
    float *sh;                  /* [chunk][hidden] shared-expert output */
    int *uni;                   /* [E] experts used by the chunk, ascending */
    int *ptok, *pslot;          /* [chunk*K] the pass's (token, slot) pairs grouped by expert in
                                   ascending ids, each expert's by token (moe_forward) */
    int *poff, *pcnt;           /* [E] expert x's first pair and pair count (the pass's experts);
                                   with a device row set of n > 1, poff is also x's first row in dv->xg */
    float *nlog;                /* [chunk][E] next layer's router logits (lookahead) */
    uint8_t *mark;              /* [E] */
    int *ahead;                 /* [E] the next layer's predicted experts (lookahead) */
    float *conf;                /* [E] their router margins (lookahead order) */
    int n_ahead;                /* how many; 0 after they were offered to the device */
    int *held;                  /* [E] experts of a store pass queued on the device, not yet done */
    moe_batch batch;            /* CPU batch of ready experts */
    /* batched passes (several sessions' rows, km_forward_batch); NULL otherwise */
    const int *rpos;            /* [chunk] each row's position (the trace); NULL: pos + t */
    const int *rseg;            /* [chunk] each row's segment (the union statistics) */
    moe_dev *dv;                /* ffn_block_dev's row on the device; NULL otherwise */
    float *xn_host;             /* with dv: where xn is brought when a part runs on the host */
} moe_scratch;

/* Binds <base><names[0..2]> as gate, up, down ([inter, hidden] x2, [hidden, inter]). */
df_status ffn_bind(df_engine *e, const char *base, const char *const names[3], int64_t inter,
                   int64_t hidden, ffn_weights *w, char *err);
void ffn_forward(df_engine *e, const ffn_weights *w, const ffn_act *act, const float *X, int n,
                 float *out, float *g, float *u);
/* g = act(g, u) elementwise over n values (SiLU or SiTU gate times up) at
 * kernel level lv (kn_act_*_mul). */
void ffn_act_apply(kn_level lv, const ffn_act *act, float *g, const float *u, int64_t n);
/* ffn_act_apply split over the engine's pool (the same bits). */
void ffn_act_pool(df_engine *e, const ffn_act *act, float *g, const float *u, int64_t n);
/* The CPU batch (moe_batch.c): moe_batch_add takes the rows (the (token,
 * slot) pairs of the pass that chose expert x, as moe_forward grouped them:
 * ptok / pslot, poff / pcnt) of xin, 0 when they do not fit beside the
 * rows already there or come from another xin (run the batch first, or run
 * x alone); xin must stay until the batch runs. moe_batch_run gathers the
 * rows, computes every expert of the batch and stores each row's output in
 * s->ys; moe_batch_clear empties it. */
df_status moe_batch_new(moe_batch *b, int E, int dl, int inter);
void moe_batch_free(moe_batch *b);
int moe_batch_add(moe_scratch *s, const float *xin, int x, const ffn_weights *w);
void moe_batch_run(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s);
void moe_batch_clear(moe_batch *b);
df_status moe_scratch_new(int chunk, int hidden, int inter, int E, int K, int dl, moe_scratch *s);
void moe_scratch_free(moe_scratch *s);
void moe_layer_free(moe_layer *m);
/* out[n][hidden] = MoE(xn). Fails only when expert reads fail (DF_ERR_IO,
 * message in err); out is then undefined. */
df_status moe_forward(df_engine *e, const moe_layer *m, const ffn_act *act, moe_scratch *s,
                      const float *xn, int n, int pos, float *out, char *err);
/* What differs between the families that share this MoE block. */
typedef struct {
    const char *const *shared_names;  /* gate, up, down leaf names of the shared experts */
    const char *const *expert_names;  /* ... of the routed experts (w1, w3, w2 for Kimi) */
    float group_mask;                 /* value for experts of dropped groups */
    int renorm_single;                /* renormalise also when top-k is 1 */
} moe_flavour;

/* Binds the MoE block at `base` (e.g. "model.layers.3.mlp."): router
 * (resident), correction bias, shared experts, latent projections when
 * routed_expert_hidden_size is set, and every routed expert. Adds the
 * experts' bytes to *expert_bytes_total. */
df_status moe_bind(df_engine *e, int layer, const char *base, const moe_flavour *f, moe_layer *x,
                   int64_t *expert_bytes_total, char *err);
/* Binds expert `i` of a MoE layer: directly (mmap views) or lazily + registered
 * with the engine's store. Updates m->expert_bytes. */
df_status moe_bind_expert(df_engine *e, moe_layer *m, int layer, int i, const char *base,
                          const char *const names[3], int64_t inter, int64_t hidden, char *err);
/* Router lookahead: applies `next`'s router to this layer's input and starts
 * reads of the predicted experts (no-op without a store or with prefetch
 * off). Never changes which experts run. */
void moe_lookahead(df_engine *e, const moe_layer *next, moe_scratch *s, const float *xn, int n);
/* 1 when every expert m's last pass used ran from device copies (bit per
 * layer in e->moe_on_dev; the engine's, so a new session's first pass knows
 * it too): a lookahead for m would read nothing, so none runs. */
int moe_all_on_device(const df_engine *e, const moe_layer *m);

/* A layer's feed-forward block on the normed input xn into y: the MoE layer
 * moe, or (moe NULL) the dense MLP mlp, which first starts the lookahead of
 * next (the following layer's MoE, NULL if none). Profiles into *pt. */
df_status ffn_block(df_engine *e, const moe_layer *moe, const ffn_weights *mlp, const moe_layer *next,
                    const ffn_act *act, moe_scratch *s, const float *xn, int n, int pos, float *y, double *pt,
                    char *err);
/* ffn_block for dv->n rows whose normed input dv->xn is in device memory
 * (acc_dev_alloc), their output into dv->out there (dv->xl and dv->xg: the
 * latent input's and the gathered expert inputs' device buffers): the same
 * products, routing and expert reads, with the activations kept on the
 * device; any part the accelerator does not take runs on the host over
 * xn_host / y_host (n x hidden floats each) and its result is put back.
 * Errors as ffn_block's, and device failures. */
df_status ffn_block_dev(df_engine *e, const moe_layer *moe, const ffn_weights *mlp, const moe_layer *next,
                        const ffn_act *act, moe_scratch *s, moe_dev *dv, float *xn_host, int pos, float *y_host,
                        double *pt, char *err);
/* The router alone (exposed for tests): sel/selw of one token. */
/* margin (NULL, or [K]): how far each chosen expert's biased score is above
 * the best expert left out (the router's confidence in it). */
void moe_route(const moe_layer *m, const float *logit, int *sel, float *selw, float *margin);
#endif
