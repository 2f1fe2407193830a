/* deltafin.h — the one public C API of deltafin.
 *
 * Ownership, in one paragraph: a df_engine owns everything read from a model
 * directory (the safetensors shards, the parsed config, the weight views, the
 * thread pool). A df_session borrows its engine (the engine must outlive every
 * session made from it) and owns one timeline: the per-layer attention caches
 * and a logits buffer. Strings returned by the library are owned by the
 * object they came from and stay valid until that object is freed. Every
 * _open/_new has a NULL-safe _close/_free.
 *
 * Errors: every fallible call returns a df_status. Loading errors come with
 * one human message (file, tensor, what was expected) written into the
 * caller's buffer; session errors are kept in the session (df_session_error).
 * Nothing in the library prints, exits or reads the environment.
 */
#ifndef DELTAFIN_H
#define DELTAFIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    DF_OK = 0,
    DF_ERR_IO,          /* a file could not be opened or read */
    DF_ERR_FORMAT,      /* a weight file is malformed (header, offsets, dtype) */
    DF_ERR_CONFIG,      /* config.json missing, malformed or absurd */
    DF_ERR_MISMATCH,    /* a tensor is missing or disagrees with the config */
    DF_ERR_UNSUPPORTED, /* valid input this build cannot run */
    DF_ERR_NOMEM,
    DF_ERR_ARG,         /* the caller passed something invalid */
    DF_ERR_CONTEXT      /* the session's context limit is reached */
} df_status;

const char *df_status_name(df_status st);

enum { DF_ERRMSG = 1024 }; /* size of the error buffers the API fills */

typedef struct df_engine df_engine;
typedef struct df_session df_session;

typedef struct {
    int n_threads;   /* 0: one per online CPU */
    int use_mmap;    /* 1: map shards (default); 0: read tensors into RAM with pread */
    int simd_level;  /* -1: best available; 0 scalar, 1 AVX2, 2 AVX-512 (capped to the CPU) */
} df_engine_opts;

void df_engine_opts_default(df_engine_opts *o);

/* Opens a model directory (config.json + safetensors, single or sharded).
 * On error *out is NULL and err holds one line naming file/tensor/field. */
df_status df_engine_open(const char *dir, const df_engine_opts *opts, df_engine **out,
                         char err[DF_ERRMSG]);
void df_engine_close(df_engine *e);

int df_engine_vocab_size(const df_engine *e);
int df_engine_max_context(const df_engine *e);
int df_engine_n_threads(const df_engine *e);
/* Human-readable description (architecture, tensor and byte totals, experts,
 * per-token bytes, memory per context token). Owned by the engine. */
const char *df_engine_describe(df_engine *e);

/* A session with room for max_ctx positions (0: the model's limit, capped at 4096). */
df_status df_session_new(df_engine *e, int max_ctx, df_session **out);
void df_session_free(df_session *s);
/* Forgets every position (the caches are kept allocated). */
void df_session_reset(df_session *s);
int df_session_pos(const df_session *s);
const char *df_session_error(const df_session *s);

/* Appends n tokens to the timeline. If logits is non-NULL it receives one row
 * of vocab_size floats per token (row i = next-token logits after token i);
 * otherwise only the last row is computed and df_session_logits returns it.
 * On error the session is unchanged (its position does not move). */
df_status df_session_eval(df_session *s, const int32_t *tokens, int n, float *logits);
/* Logits of the last evaluated position (vocab_size floats), owned by the session. */
const float *df_session_logits(const df_session *s);

/* Index of the largest value; ties go to the lowest index. */
int df_argmax(const float *v, int n);

/* ---- kernel benchmark (deltafin bench --kernels) ---- */
typedef struct {
    char name[32];      /* weight type, e.g. "bf16" */
    double gbps;        /* weight bytes streamed per second, GB/s */
    double ms_per_call; /* one full matvec */
    double weight_mb;   /* size of the matrix in MB */
} df_bench_row;

/* Measures a DRAM read probe and a matvec per weight type on matrices of
 * about `mb` MB each, with n_threads threads. rows must hold 16 entries;
 * returns the number filled; probe_gbps receives the probe's bandwidth. */
int df_bench_kernels(int n_threads, double mb, double seconds, df_bench_row *rows,
                     double *probe_gbps);

#ifdef __cplusplus
}
#endif
#endif
