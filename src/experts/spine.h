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
 *           (a span's reads land with its first tensor on a 128-byte line
 *           where the device takes O_DIRECT buffers off a block)
 *   slot 1: | group g+1                           |   <- reading
 *
 * The bytes a view sees are the file's bytes, so streaming never changes
 * the output.
 *
 * With an accelerator that holds device copies of every matrix of a group,
 * the engine enters that group with sp_skip instead: nothing is read, the
 * group's views get no host bytes (data and scale NULL, so only the device
 * copies can serve them), and the read-ahead goes to the next group the
 * engine's hook says still needs its bytes. If a device product fails
 * later, sp_enter reads the group after all (the CPU then runs it).
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
/* Enters group g without reading it: its views' data and scale become NULL
 * (the caller serves them from device copies); starts reading the next
 * group that needs its bytes. */
void sp_skip(sp_store *s, int group);
/* The read-ahead asks needs(ctx, g) which later group to read next: 0 means
 * g will be served without its bytes (sp_skip). Without a hook every group
 * is read. A wrong guess costs time, never correctness: sp_enter reads a
 * group that was not read ahead. */
void sp_set_needs_hook(sp_store *s, int (*needs)(void *ctx, int group), void *ctx);
/* Before sp_finalize: the memory alignment O_DIRECT reads land at (0, the
 * default: each shard's file system says, statx STATX_DIOALIGN). */
void sp_set_dio_mem_align(sp_store *s, int align);
/* Group g's registered views (*views, borrowed); returns their count. */
int sp_views(const sp_store *s, int group, df_weight *const **views);
int sp_n_groups(const sp_store *s);
int64_t sp_slot_bytes(const sp_store *s);
/* Slot k (0 or 1) of the double buffer; NULL before sp_finalize. */
void *sp_slot(const sp_store *s, int k);
int64_t sp_bytes_read(const sp_store *s);
#endif
