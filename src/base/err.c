/* err.c — df_fail and the status names. */
#include "err.h"
#include <stdarg.h>

df_status df_fail(char *err, df_status st, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, DF_ERRMSG, fmt, ap);
        va_end(ap);
    }
    return st;
}

const char *df_status_name(df_status st) {
    switch (st) {
    case DF_OK: return "ok";
    case DF_ERR_IO: return "i/o error";
    case DF_ERR_FORMAT: return "bad weight file";
    case DF_ERR_CONFIG: return "bad config";
    case DF_ERR_MISMATCH: return "tensor mismatch";
    case DF_ERR_UNSUPPORTED: return "unsupported";
    case DF_ERR_NOMEM: return "out of memory";
    case DF_ERR_ARG: return "invalid argument";
    case DF_ERR_CONTEXT: return "context full";
    }
    return "unknown";
}
