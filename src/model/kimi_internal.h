/* kimi_internal.h — what kimi.c (the Kimi program) and kimi_dev.c (its
 * pass with the activations on the device) share: the model, layer and
 * session types, the device rows of a pass, and the few functions each
 * calls in the other. Not for other programs.
 */
#ifndef DF_MODEL_KIMI_INTERNAL_H
#define DF_MODEL_KIMI_INTERNAL_H
#include "ffn.h"
#include "kda.h"
#include "mla.h"

typedef struct {
    float *attn_norm, *ffn_norm;  /* owned */
    int kda;                      /* KDA layer (else MLA) */
    int slot;                     /* index among the KDA or the MLA layers */
    kda_layer k;
    mla_layer a;
    int moe;
    ffn_weights mlp;
    moe_layer experts;
    float *res_attn, *res_mlp;    /* AttnRes probes res_norm * res_proj [H], owned; NULL without */
} km_layer;

typedef struct {
    int H, V, L, inter, block, max_anchors;
    int n_kda, n_mla, n_moe;
    float eps;
    mla_shape mla;
    kda_shape kda;
    ffn_act act;
    df_weight embed, head;
    float *final_norm, *res_out;  /* owned */
    km_layer *layers;
    int64_t expert_bytes, expert_bytes_total;
} km_model;

/* Device rows of a pass whose activations stay on the device: a session's
 * (DF_CHUNK rows) or a layer-major prompt block's (df_engine_opts.prompt_block). */
typedef struct {
    int rows;                    /* capacity */
    float *dh, *dxin, *dxn, *dy; /* [rows][H] */
    float *dxl, *dxg;            /* [rows][dl], [rows K][dl] (routed experts' gathered inputs) */
    float *danc;                 /* [rows][max_anchors][H] */
} km_dev;

typedef struct {
    int max_ctx;
    float *mla_cache;            /* [n_mla][max_ctx][R+dr] */
    float *kda_state;            /* [n_kda][kda_state_floats] */
    void **kda_dev;              /* [n_kda] the same on the device (acc_has_kda), else NULL */
    int n_dev;
    void **mla_dev;              /* [n_mla] the caches on the device (acc_has_mla), else NULL */
    int n_mla_dev;
    acc_table *acc;              /* owner of kda_dev */
    int rw_depth, rw_mode;       /* rewind_setup: forwards of <= rw_depth tokens keep rw_keep */
    float *rw_keep;              /* trail: [n_kda][rw_depth][kda_state_floats]; replay: [n_kda][floats] */
    float *h, *xin, *xn, *y;     /* [C][H] */
    float *anchors;              /* [C][max_anchors][H] */
    /* the forward pass on the device (km_pass_dev): rows of a chunk
     * (DF_CHUNK) in dev; dv NULL without a device pass */
    float *dv;                   /* dev's block, then dnorm (acc_dev_alloc) */
    km_dev dev;
    float *dnorm;                /* per layer: attn_norm, ffn_norm, res_attn, res_mlp; then final_norm, res_out */
    int64_t HA;                  /* H rounded up to 16 floats: dnorm's stride */
    mla_scratch mla;
    kda_scratch kda;
    moe_scratch moe;
} km_state;

/* What a pass on the device works with: its device rows, host buffers of
 * as many rows (the embedding, and parts the device does not take), the
 * MoE scratch, and the session that lends the norm vectors and the
 * attention scratch (DF_CHUNK rows). */
typedef struct {
    km_state *s;
    const km_dev *d;
    float *h, *xin, *xn, *y, *anchors; /* [rows][H]; anchors [rows][max_anchors][H] */
    moe_scratch *moe;
} km_pass;

/* kimi.c: the first MoE layer's router on the embedding rows h (its own
 * norm into xn), so its likely experts are read while the layers before it
 * compute; segment i's embedding rows into h from row off (with each
 * row's position and segment when rpos / rseg are set). */
void km_early_lookahead(df_engine *e, const km_model *m, moe_scratch *ms, const float *h, float *xn, int n);
void km_embed_rows(df_engine *e, const km_model *m, float *h, const df_fwd_seg *sg, int i, int off, int *rpos,
                   int *rseg);

/* kimi_dev.c: the floats of a km_dev of `rows` rows, and d's buffers
 * placed in such a block at p; a session's device pass set up (s->dv, its
 * DF_CHUNK rows and the norm vectors on the device; s->dv stays NULL when
 * the accelerator or the session's states do not allow one); one forward
 * pass over p's rows (n <= p->d->rows; several sessions' only within
 * DF_CHUNK rows). */
int64_t km_dev_floats(const km_model *m, int64_t rows, int dl, int K);
void km_dev_place(km_dev *d, const km_model *m, float *p, int rows, int dl, int K);
void km_step_on_device(df_engine *e, const km_model *m, km_state *s, int dl, int K);
df_status km_pass_dev(df_engine *e, const km_pass *p, const df_fwd_seg *seg, int nseg, int n, char *err);
#endif
