/* spine.h — non-expert weights streamed layer by layer through a double
 * buffer (prefix sp_), for models whose spine does not fit in RAM.
 *
 * Each layer's matrices (attention, dense MLP, shared experts, latent
 * projections; group L is the head) are bound lazily and registered here
 * with their group. Two slots, each as large as the largest group, alternate:
 * while the program computes group g from one slot, group g+1 is read into
 * the other with O_DIRECT. sp_enter(g) waits for g's bytes and points every
 * registered view of g into its slot. Routers, norms and the embedding stay
 * resident (they are small, or touched a row at a time).
 *
 *   slot 0: | group g   (spans, XR_ALIGN aligned) |   <- computing
 *   slot 1: | group g+1                           |   <- reading
 *
 * The bytes a view sees are the file's bytes, so streaming never changes
 * the output.
 */
#ifndef DF_EXPERTS_SPINE_H
#define DF_EXPERTS_SPINE_H
#include "deltafin.h"
#include "reader.h"
#include "../format/safetensors.h"
#include "../format/weight.h"

typedef struct sp_store sp_store;

/* plan_only: size the buffers at finalize but allocate and open nothing. */
df_status sp_new(const df_io *io, st_set *st, int n_groups, int direct, int plan_only, sp_store **out,
                 char *err);
void sp_free(sp_store *s);
/* Registers a lazily bound view (its address must stay valid) with a group. */
df_status sp_register(sp_store *s, int group, df_weight *w, char *err);
/* Plans spans, allocates the two slots, opens the files. */
df_status sp_finalize(sp_store *s, char *err);
/* Makes group g resident and its views valid; starts reading the next group
 * (g+1, wrapping to 0 after the last). DF_ERR_IO if a read failed. */
df_status sp_enter(sp_store *s, int group, char *err);
int64_t sp_slot_bytes(const sp_store *s);
/* Slot k (0 or 1) of the double buffer; NULL before sp_finalize. */
void *sp_slot(const sp_store *s, int k);
int64_t sp_bytes_read(const sp_store *s);
#endif
