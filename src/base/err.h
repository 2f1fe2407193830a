/* err.h — error text helpers shared by every module.
 *
 * Library code reports failures as a df_status plus one line of text in a
 * caller-owned buffer of DF_ERRMSG bytes. ASSERT guards internal invariants
 * (programming errors), reporting file:line before aborting; it is never used
 * for bad input.
 */
#ifndef DF_BASE_ERR_H
#define DF_BASE_ERR_H

#include "deltafin.h"
#include <stdio.h>
#include <stdlib.h>

/* Writes a formatted message into err (if non-NULL) and returns st. */
df_status df_fail(char *err, df_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define ASSERT(c)                                                               \
    do {                                                                        \
        if (!(c)) {                                                             \
            fprintf(stderr, "deltafin: internal error at %s:%d: %s\n", __FILE__, \
                    __LINE__, #c);                                              \
            abort();                                                            \
        }                                                                       \
    } while (0)

#endif
