/* kda_fast.h — the CPU engine's KDA recurrence of one head and short
 * convolution (prefix kda_): kda_recur_head's and kda_conv_channel's results
 * bit for bit, on the kernel level's vectors.
 *
 * kda_core.c stays the oracle (and the CUDA backend's); this is the same
 * contract, reorganised for speed: the per-token preparation (l2norm of q
 * and k, the gates) runs for all n tokens first, several tokens side by side,
 * then kn_kda_recur (kernels.h) runs the state through them, then the gated
 * RMSNorm of every output. Every value is computed by the same operations in
 * the same order as kda_core.c, so the state, the outputs, q and k (written
 * back normalised) and the trail are bit-identical at every level.
 */
#ifndef DF_MODEL_KDA_FAST_H
#define DF_MODEL_KDA_FAST_H
#include "kda_core.h"
#include "../kernels/kernels.h"

/* kda_recur_head(sh, p, state, h, n, io) at kernel level lv. decay is
 * scratch of [n][H * D] floats (token stride H * D; head h uses its D
 * columns only, so all heads of a call can share one buffer). */
void kda_recur_head_fast(kn_level lv, const kda_shape *sh, const kda_params *p, float *state, int h, int n,
                         const kda_io *io, float *decay);
/* kda_conv_channel(sh, p, state, which, c, n, io) for every c in [c0, c1),
 * at kernel level lv (several channels side by side). */
void kda_conv_fast(kn_level lv, const kda_shape *sh, const kda_params *p, float *state, int which, int c0, int c1,
                   int n, const kda_io *io);
#endif
