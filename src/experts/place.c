/* place.c — tensors moved to aligned places after their span's read (see
 * place.h). Owns no memory.
 */
#include "place.h"
#include <string.h>

int64_t place_plan(const int64_t *offset, const int64_t *nbytes, int n, int64_t start, int64_t pos,
                   int64_t span_len, int64_t *at) {
    int64_t end = 0, past = 0;
    for (int i = 0; i < n; i++) {
        const int64_t r = pos + (offset[i] - start); /* where the read puts it */
        int64_t f = r > end ? r : end;
        f = (f + PLACE_ALIGN - 1) / PLACE_ALIGN * PLACE_ALIGN;
        at[i] = f;
        end = f + nbytes[i];
        if (end - (pos + span_len) > past) past = end - (pos + span_len);
    }
    return past;
}

int place_moves(const int64_t *offset, int n, int64_t start, int64_t pos, const int64_t *at) {
    for (int i = 0; i < n; i++)
        if (at[i] != pos + (offset[i] - start)) return 1;
    return 0;
}

void place_move(uint8_t *base, const int64_t *offset, const int64_t *nbytes, int n, int64_t start, int64_t pos,
                const int64_t *at) {
    for (int i = n - 1; i >= 0; i--) {
        const int64_t r = pos + (offset[i] - start);
        if (at[i] != r) memmove(base + at[i], base + r, (size_t)nbytes[i]);
    }
}

int64_t place_read_shift(int64_t pos, int64_t lead, int mem_align) {
    const int64_t m = mem_align > XR_MEM_ALIGN_MIN ? mem_align : XR_MEM_ALIGN_MIN;
    const int64_t shift = (PLACE_ALIGN - (pos + lead) % PLACE_ALIGN) % PLACE_ALIGN;
    return shift % m ? 0 : shift;
}
