/* resident_copy.h — the resident spine's matrices copied out of the page
 * cache into the process's own memory (prefix rcopy_).
 *
 * A mapped checkpoint hands the resident spine to the kernels as views of the
 * page cache, at the file's offsets: safetensors aligns nothing, so a
 * release's rows start 8-56 bytes past a cache line, and the page cache's
 * pages decoded slower than anonymous memory on a Zen 5 VM even aligned.
 * rcopy_start reads (pread, in pieces) every mapped tensor behind the views,
 * data and scales, into one anonymous region advised for 2 MB pages, each
 * tensor on ST_DATA_ALIGN: on a pool's threads while the caller waits, or
 * on a thread of its own at idle priority, paused while the engine
 * evaluates, while the views keep serving from the mapping; rcopy_finish
 * then points the views there. The bytes
 * are the file's bytes, so the output never changes; the cost is the copy
 * (5.6 GB from a warm page cache: 0.2 s on 16 threads, 0.5-0.8 s on 2,
 * seconds more where the kernel must first reclaim memory) and the page
 * cache's own copy, which the kernel may drop (it is clean). Measured: K8g
 * decode -12% on a Zen 5 VM, no change on an Intel host.
 *
 *   views ─┬─> tensor A ──> region + 0      (A on a 128-byte line)
 *          └─> tensor B ──> region + 128k   (views of one tensor share it)
 */
#ifndef DF_MODEL_RESIDENT_COPY_H
#define DF_MODEL_RESIDENT_COPY_H
#include "deltafin.h"
#include "../base/pool.h"
#include "../format/safetensors.h"
#include "../format/weight.h"

typedef struct rcopy rcopy;

typedef struct {
    int64_t tensors, bytes; /* tensors copied (or being copied), their bytes */
    double seconds;         /* the copy's wall time, once done */
    int done, failed;       /* 1 once the thread has finished; 1 when a read failed */
} rcopy_stats;

/* Starts copying the mapped tensors behind views[0..n) (t_data and
 * t_scale; those st_mapped denies are left as they are): with a pool, on
 * its threads, done at return; without, on a thread of its own at idle
 * priority (SCHED_IDLE), running on. No view moves yet. *out NULL and DF_OK
 * when nothing was mapped; DF_ERR_NOMEM (no region, no thread) with *out
 * NULL. st must outlive c. */
df_status rcopy_start(st_set *st, df_weight *const *views, int n, df_pool *pool, rcopy **out, char *err);
/* 1 once the copy's thread has finished (a cheap check between steps). */
int rcopy_done(const rcopy *c);
/* 1: the thread stops before its next piece until 0 again (the engine
 * pauses it for each evaluation). NULL-safe. */
void rcopy_pause(rcopy *c, int paused);
/* Waits for the thread, then points each view's data and scale at the
 * copies (the same views as rcopy_start's, none of them in use). A failed
 * read: DF_ERR_IO naming the file and range, no view moved (free c). Once. */
df_status rcopy_finish(rcopy *c, df_weight *const *views, int n, char *err);
/* rcopy_start then rcopy_finish: on an error *out is NULL. */
df_status rcopy_make(st_set *st, df_weight *const *views, int n, df_pool *pool, rcopy **out, char *err);
/* Stops and joins a running copy, unmaps the region: views pointing there
 * are dangling after. NULL-safe. */
void rcopy_free(rcopy *c);
void rcopy_get_stats(const rcopy *c, rcopy_stats *s); /* zeros for NULL */
/* The region (for the 2 MB pages' share: mem_range_pages). */
const void *rcopy_base(const rcopy *c);
int64_t rcopy_region_bytes(const rcopy *c);
#endif
