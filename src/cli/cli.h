/* cli.h — shared pieces of the `deltafin` subcommands (prefix cli_).
 * Only the CLI prints, exits and reads the environment. */
#ifndef DF_CLI_H
#define DF_CLI_H
#include "deltafin.h"
#include <stdint.h>
#include <stdio.h>

enum { CLI_CPUS_MAX = 1024 };

typedef struct {
    const char *model;
    int threads;
    int ncpus;              /* --cpus: compute thread i on cpus[i]; 0 = unpinned */
    int cpus[CLI_CPUS_MAX];
    int no_mmap;
    int map_spine;  /* --map-spine, --spine-copy off */
    int spine_copy; /* --spine-copy: 0 not given (idle), 1 idle, 2 open */
    int simd;       /* -1 best */
    int ctx;
    int expert_io;  /* df_expert_io */
    int64_t ram;    /* --ram: the process's memory budget, 0 = default */
    int64_t expert_cache; /* --expert-cache: the expert cache alone, 0 = what the budget leaves */
    int no_prefetch;
    int prefill_chunks; /* --prefill chunks */
    int prefill_block;  /* --prefill-block: positions per layer-major block, 0 = the engine's */
    int io_depth;
    int top_k;              /* LOSSY override, 0 = the model's */
    const char *trace_path; /* router trace, JSON lines */
    const char *heat_path;
    int64_t pin;
    int plan_only;          /* inspect: plan, allocate nothing */
    int profile;            /* time the parts of a step */
    int spine;              /* df_spine_mode */
    int spine_dtype;        /* df_spine_dtype */
    int evict_heat;
    int64_t cache_limit;    /* stream mirrors: expert disk budget; -1 = the mirror's, 0 = none */
    int device;             /* CLI_DEV_*: --device auto|cpu|cuda */
    int64_t gpu_mem;        /* --gpu-mem: device memory for matrices, 0 = free memory - 2 GiB */
    int bf16_tc_rows;       /* --bf16-tc-rows: bf16 products of this many rows on the tensor cores, 0 = never */
    int bf16_wg;            /* --bf16-wg: 0 auto, 1 on, -1 off (gpu_ws.bf16_wg) */
    int mx_wg;              /* --mx-wg: 0 auto, 1 on, -1 off (gpu_ws.frag_wg) */
    const char *meta_cache; /* --meta-cache DIR|off; NULL = the user cache folder */
} cli_model_opts;

enum { CLI_DEV_AUTO = 0, CLI_DEV_CPU, CLI_DEV_CUDA };

/* Exit codes: 0 success, 1 the work failed (bad model, I/O), 2 usage error. */
enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2 };

/* If argv[*i] is one of the shared model options, consumes it (and its
 * value) and returns 1; returns -1 on a bad value, 0 if not ours. */
int cli_model_opt(cli_model_opts *o, int argc, char **argv, int *i);
extern const char cli_model_opts_help[];
void cli_model_opts_init(cli_model_opts *o);
/* The compute threads: --threads, else --cpus's count, else 0 (all CPUs);
 * -1 after printing why when --threads asks for more than --cpus lists. */
int cli_threads(const cli_model_opts *o);
/* Engine options from the shared model options (trace file, stream-mode hub
 * table included); -1 after printing why not. */
int cli_engine_opts(const cli_model_opts *o, df_engine_opts *eo);
/* Opens the engine, printing the error and returning NULL on failure. */
df_engine *cli_open(const cli_model_opts *o);
/* Parses a size like 512M, 12G, 1.5T or a byte count; -1 on error. */
int64_t cli_parse_size(const char *s);
/* Parses "1,2,3" (spaces allowed) into a malloc'd array; -1 on error. */
int cli_parse_tokens(const char *s, int32_t **out);
double cli_now(void);
int cli_usage(const char *cmd, const char *msg);

/* --spec ngram, --spec-depth K, --spec-ngram N, --spec-fixed (opts.c). */
typedef struct {
    int on;
    df_spec_params p;
} cli_spec_opts;
extern const char cli_spec_opts_help[];
void cli_spec_opts_init(cli_spec_opts *o);
/* 1 consumed, 0 not ours, -1 bad (printed) */
int cli_spec_opt(cli_spec_opts *o, int argc, char **argv, int *i);
/* NULL after printing why (a session that cannot be rewound: the caller
 * decodes without drafts). */
df_spec *cli_spec_new(const cli_spec_opts *o, df_session *s, df_sampler *smp);
/* One stats line: acceptance, rows and tokens per step, the cost model. */
void cli_spec_print(const df_spec *sp, FILE *f);

int cmd_logits(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_synth(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_detokenize(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_setup(int argc, char **argv);
int cmd_fetch_experts(int argc, char **argv);
int cmd_doctor(int argc, char **argv);
int cmd_warm(int argc, char **argv);
int cmd_convert_spine(int argc, char **argv);
int cmd_eval(int argc, char **argv);
/* If model is a stream-mode hub mirror, opens it and sets eo->io (printing
 * what is local); cache_limit as cli_model_opts; 0, or -1 after printing why
 * not (cmd_hub.c). */
int cli_hub_attach(const char *model, int expert_io, int64_t cache_limit, df_engine_opts *eo);
/* `run --prompt` (text) goes to cmd_run_text, `run --tokens` to cmd_run. */
int cmd_run_wants_text(int argc, char **argv);
int cmd_run_text(int argc, char **argv);
int cmd_chat(int argc, char **argv);
/* `bench --tokenizer` goes to cmd_bench_tokenizer (cmd_text.c). */
int cmd_bench_wants_tokenizer(int argc, char **argv);
int cmd_bench_tokenizer(int argc, char **argv);
#endif
