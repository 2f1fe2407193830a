/* place.h — where the expert store's slot tensors lie once placed: each
 * on a PLACE_ALIGN boundary.
 *
 * Why: a checkpoint's tensors lie where its file puts them (safetensors
 * aligns nothing; 8 bytes past a line is common), and a read keeps that
 * offset (an O_DIRECT read moves whole 512-byte blocks). The kernels stream
 * rows that straddle lines ~15-20% slower (4-bit; bench/cpu_NOTES.md,
 * forty-fourth session). A span lands as the file has it; its tensors can
 * then move up to their places: never before where the read put them, in
 * file order, so they move last first without overwriting one not yet
 * moved. Where the file already aligns them nothing moves. (The store moves
 * them when an expert is used again, store.c place_on_reuse. On a device
 * that takes O_DIRECT buffers a few bytes past a block, NVMe's 4, the read
 * itself lands each span's first tensor on its place: store.c
 * plan_expert.)
 *
 * The tensors of one span are given sorted by file offset: offset[i] and
 * nbytes[i], with the span's first byte (file offset `start`) read to buffer
 * position `pos`.
 */
#ifndef DF_EXPERTS_PLACE_H
#define DF_EXPERTS_PLACE_H
#include "../format/safetensors.h"
#include "reader.h"
#include <stdint.h>

enum { PLACE_ALIGN = ST_DATA_ALIGN }; /* two cache lines: the pair a line's neighbour prefetch fetches */

/* Each tensor's place into at[i]; returns how many bytes past
 * pos + span_len the places reach (0: none), the room to leave after the
 * span. */
int64_t place_plan(const int64_t *offset, const int64_t *nbytes, int n, int64_t start, int64_t pos,
                   int64_t span_len, int64_t *at);

/* Whether any tensor's place differs from where the read put it. */
int place_moves(const int64_t *offset, int n, int64_t start, int64_t pos, const int64_t *at);

/* How far past buffer position pos an O_DIRECT read whose first wanted byte
 * lies lead bytes into its first block should land, so that byte starts on
 * PLACE_ALIGN: a multiple of mem_align (at least XR_MEM_ALIGN_MIN, the
 * reader's least), else 0 (a device that wants whole blocks). */
int64_t place_read_shift(int64_t pos, int64_t lead, int mem_align);

/* Moves the tensors from where the read put them (in base) to their places. */
void place_move(uint8_t *base, const int64_t *offset, const int64_t *nbytes, int n, int64_t start, int64_t pos,
                const int64_t *at);

#endif
