/* opts.c — what every `deltafin` subcommand shares (prefix cli_): the model
 * options (--model, --ram, --io, --spine, --device ...) and their help text,
 * engine options and opening an engine from them, the size and token-list
 * parsers, timing and the usage-error line. main.c only dispatches; the
 * cmd_*.c files use these helpers and nothing of main.c.
 */
#include "cli.h"
#ifdef DF_WITH_CUDA
#include "../cuda/gpu_accel.h"
#endif
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char cli_model_opts_help[] =
    "  --model DIR        model directory (config.json + safetensors)\n"
    "  --threads N        worker threads (default: all CPUs, or as many as --cpus lists)\n"
    "  --cpus LIST        pin worker thread i to the i-th CPU of LIST (taskset -c's form, e.g. 0-7 or\n"
    "                     0,2,4,6; the first --threads of them): keeps the engine off CPUs that other\n"
    "                     work uses (Linux; never changes the output)\n"
    "  --ctx N            context limit of the session (default: min(model, 4096))\n"
    "  --no-mmap          read weights with pread into RAM instead of mapping them\n"
    "  --spine-copy MODE  the resident spine's matrices copied out of the page cache into the\n"
    "                     process's memory on 128-byte lines (decodes faster on some machines):\n"
    "                     idle (default; bench: open): a thread copies while the engine is idle\n"
    "                     and the steps use the copy once it is made; open: the open copies on\n"
    "                     every thread and waits; off: views of the page cache. Same output\n"
    "  --map-spine        --spine-copy off\n"
    "  --simd LEVEL       kernel level: scalar, avx2, avx512, neon (default: the best available;\n"
    "                     never amx), amx: avx512 with the bf16 and MXFP4 products of 8 or more\n"
    "                     vectors (prefill) on Intel AMX tiles, faster, and a row's last bits\n"
    "                     then depend on which side of 8 its pass was (within the same bound)\n"
    "  --io MODE          routed experts: direct (O_DIRECT reads into the expert cache, default),\n"
    "                     pread (buffered reads into the cache), mmap (page cache, for comparison)\n"
    "  --ram SIZE         memory budget of the whole process, e.g. 8G: spine, expert cache, session\n"
    "                     state and metadata are planned inside it, and a budget that cannot hold\n"
    "                     the minimum is refused (default: available memory less a margin)\n"
    "  --expert-cache SIZE  the routed-expert cache alone (default: what the budget leaves)\n"
    "  --io-depth N       expert reads in flight (default 32)\n"
    "  --spine MODE       non-expert weights: auto (default: stream when they do not fit beside the\n"
    "                     expert cache), resident, stream (per layer through a double buffer)\n"
    "  --spine-dtype T    auto (default: the int8 spine when `deltafin convert-spine` made one), bf16\n"
    "                     (the checkpoint's own matrices) or int8 (LOSSY: labelled in every stats line)\n"
    "  --no-prefetch      turn off router-lookahead prefetch (the output never changes)\n"
    "  --prefill MODE     layers (default: a prompt over 32 tokens runs layer by layer in blocks of\n"
    "                     --prefill-block positions, each routed expert read once per layer per\n"
    "                     block) or chunks (32 positions through every layer at a time); the output\n"
    "                     never changes\n"
    "  --prefill-block N  positions per block of a layer-by-layer prompt (default 512):\n"
    "                     larger blocks read each expert fewer times and give the kernels more rows,\n"
    "                     at ~1 MB of buffers per position for K3 widths (kept for the next\n"
    "                     prompt); the output never changes (but see --simd amx)\n"
    "  --evict POLICY     expert cache eviction: lru (default) or heat (lowest decayed use count)\n"
    "  --heat FILE        expert heat statistics: loaded at start if present, saved at exit\n"
    "  --pin SIZE         keep the hottest experts (by --heat) resident, up to SIZE\n"
    "  --trace FILE       router trace: one JSON line per token and MoE layer\n"
    "  --top-k N          LOSSY: route each token to only N experts (labelled in every stats line)\n"
    "  --cache-limit SIZE stream-mode mirror: disk budget for fetched experts, coldest evicted\n"
    "                     (default: the one set at setup; 0 = none)\n"
    "  --meta-cache DIR   parsed index and shard headers of checkpoints with an index of 4 MB or\n"
    "                     more, reused while every shard's size and mtime are unchanged (default:\n"
    "                     $XDG_CACHE_HOME/deltafin/meta or ~/.cache/deltafin/meta; a DIR given here\n"
    "                     caches any indexed checkpoint); off: parse the headers every time\n"
#ifdef DF_WITH_CUDA
    "  --device DEV       auto (default: cuda when a GPU is present), cpu, cuda: matrix products,\n"
    "                     routed experts and KDA / MLA attention (with their session state) on the\n"
    "                     GPU; norms, routing and residual mixing stay on the CPU\n"
    "  --gpu-mem SIZE     device memory for matrices (default: free memory - 2 GiB); routed experts\n"
    "                     beyond it are cached LRU or uploaded per use\n"
    "  --bf16-tc-rows N   bf16 products of N or more rows (prefill) on the tensor cores, x split\n"
    "                     exactly into three bf16 limbs (same error bound); faster prefill, but a\n"
    "                     row's last bits then depend on how many rows shared its pass. 0 (default):\n"
    "                     CUDA cores, every row bit-equal whatever the batch\n"
    "  --bf16-wg MODE     auto (default), on, off: those tensor-core products of many rows on\n"
    "                     Hopper's wgmma blocks (sm_90 only; the same bits as off). auto takes them\n"
    "                     where a product fills the GPU\n"
    "  --mx-wg MODE       auto (default), on, off: the routed MXFP4 experts of a prompt (many rows\n"
    "                     an expert) on Hopper's wgmma, items of up to 48 rows (sm_90 only; the\n"
    "                     same bits as off). auto: the build's default (GPU_FRAG_WG, on)\n"
#else
    "  --device DEV       cpu (this build has no CUDA: build/deltafin-cuda from `make cuda` has cuda)\n"
#endif
    ;

void cli_model_opts_init(cli_model_opts *o) {
    memset(o, 0, sizeof *o);
    o->simd = -1;
    o->cache_limit = -1;
}

static int parse_int(const char *s, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < 0 || v > 1 << 30) return -1;
    *out = (int)v;
    return 0;
}

int64_t cli_parse_size(const char *s) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !(v >= 0)) return -1; /* NaN too */
    double mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'B' || *end == 'b') end++;
    if (*end == 'B') end++;
    if (*end) return -1;
    v *= mul;
    if (!(v < 9223372036854775807.0)) return -1; /* inf, or past int64 (2^63): the cast would be undefined */
    return (int64_t)v;
}

int cli_model_opt(cli_model_opts *o, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    const char *val = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(a, "--no-mmap")) { o->no_mmap = 1; return 1; }
    if (!strcmp(a, "--map-spine")) { o->map_spine = 1; return 1; }
    if (!strcmp(a, "--spine-copy")) {
        if (!val || (strcmp(val, "idle") && strcmp(val, "open") && strcmp(val, "off"))) {
            fprintf(stderr, "deltafin: --spine-copy must be idle, open or off\n");
            return -1;
        }
        if (!strcmp(val, "off")) o->map_spine = 1;
        else o->map_spine = 0, o->spine_copy = !strcmp(val, "open") ? 2 : 1;
        ++*i;
        return 1;
    }
    if (!strcmp(a, "--no-prefetch")) { o->no_prefetch = 1; return 1; }
    if (!strcmp(a, "--prefill")) {
        if (!val || (strcmp(val, "layers") && strcmp(val, "chunks"))) {
            fprintf(stderr, "deltafin: --prefill must be layers or chunks\n");
            return -1;
        }
        (*i)++;
        o->prefill_chunks = !strcmp(val, "chunks");
        return 1;
    }
    if (!strcmp(a, "--prefill-block")) {
        if (!val || parse_int(val, &o->prefill_block) || o->prefill_block < 1 || o->prefill_block > 65536) {
            fprintf(stderr, "deltafin: --prefill-block needs a count of positions, 1 to 65536 (got '%s')\n",
                    val ? val : "nothing");
            return -1;
        }
        (*i)++;
        return 1;
    }
    if (!strcmp(a, "--trace") || !strcmp(a, "--heat") || !strcmp(a, "--pin") || !strcmp(a, "--top-k")) {
        if (!val) { fprintf(stderr, "deltafin: %s needs a value\n", a); return -1; }
        (*i)++;
        if (!strcmp(a, "--trace")) o->trace_path = val;
        else if (!strcmp(a, "--heat")) o->heat_path = val;
        else if (!strcmp(a, "--pin")) {
            if ((o->pin = cli_parse_size(val)) <= 0) {
                fprintf(stderr, "deltafin: bad size for --pin: '%s'\n", val);
                return -1;
            }
        } else if (parse_int(val, &o->top_k) || o->top_k < 1) {
            fprintf(stderr, "deltafin: --top-k needs a positive count (got '%s')\n", val);
            return -1;
        }
        return 1;
    }
    if (!strcmp(a, "--evict")) {
        if (!val || (strcmp(val, "lru") && strcmp(val, "heat"))) {
            fprintf(stderr, "deltafin: --evict must be lru or heat\n");
            return -1;
        }
        (*i)++;
        o->evict_heat = !strcmp(val, "heat");
        return 1;
    }
    if (!strcmp(a, "--device")) {
        if (!val || (strcmp(val, "auto") && strcmp(val, "cpu") && strcmp(val, "cuda"))) {
            fprintf(stderr, "deltafin: --device must be auto, cpu or cuda\n");
            return -1;
        }
        (*i)++;
        o->device = !strcmp(val, "cpu") ? CLI_DEV_CPU : !strcmp(val, "cuda") ? CLI_DEV_CUDA : CLI_DEV_AUTO;
#ifndef DF_WITH_CUDA
        if (o->device == CLI_DEV_CUDA) {
            fprintf(stderr, "deltafin: --device cuda: this build has no CUDA backend; use build/deltafin-cuda "
                            "(make cuda)\n");
            return -1;
        }
#endif
        return 1;
    }
    if (!strcmp(a, "--gpu-mem")) {
        if (!val || (o->gpu_mem = cli_parse_size(val)) <= 0) {
            fprintf(stderr, "deltafin: --gpu-mem needs a size, e.g. 40G\n");
            return -1;
        }
        (*i)++;
        return 1;
    }
    if (!strcmp(a, "--bf16-tc-rows")) {
        char *end = NULL;
        long v = val ? strtol(val, &end, 10) : -1;
        if (!val || *end || v < 0 || v > 1 << 20) {
            fprintf(stderr, "deltafin: --bf16-tc-rows needs a row count, e.g. 9 (0: off)\n");
            return -1;
        }
        o->bf16_tc_rows = (int)v;
        (*i)++;
        return 1;
    }
    if (!strcmp(a, "--bf16-wg")) {
        if (!val || (strcmp(val, "auto") && strcmp(val, "on") && strcmp(val, "off"))) {
            fprintf(stderr, "deltafin: --bf16-wg needs auto, on or off\n");
            return -1;
        }
        o->bf16_wg = !strcmp(val, "on") ? 1 : !strcmp(val, "off") ? -1 : 0;
        (*i)++;
        return 1;
    }
    if (!strcmp(a, "--mx-wg")) {
        if (!val || (strcmp(val, "auto") && strcmp(val, "on") && strcmp(val, "off"))) {
            fprintf(stderr, "deltafin: --mx-wg needs auto, on or off\n");
            return -1;
        }
        o->mx_wg = !strcmp(val, "on") ? 1 : !strcmp(val, "off") ? -1 : 0;
        (*i)++;
        return 1;
    }
    if (!strcmp(a, "--meta-cache")) {
        if (!val || !*val) {
            fprintf(stderr, "deltafin: --meta-cache needs a folder, or off\n");
            return -1;
        }
        (*i)++;
        o->meta_cache = val;
        return 1;
    }
    if (!strcmp(a, "--cache-limit")) {
        if (!val || (o->cache_limit = cli_parse_size(val)) < 0) {
            fprintf(stderr, "deltafin: --cache-limit needs a size, e.g. 200G (0 = none)\n");
            return -1;
        }
        (*i)++;
        return 1;
    }
    if (!strcmp(a, "--spine-dtype")) {
        if (!val) { fprintf(stderr, "deltafin: --spine-dtype needs a value\n"); return -1; }
        (*i)++;
        if (!strcmp(val, "auto")) o->spine_dtype = DF_SPINE_DTYPE_AUTO;
        else if (!strcmp(val, "int8")) o->spine_dtype = DF_SPINE_DTYPE_INT8;
        else if (!strcmp(val, "bf16") || !strcmp(val, "checkpoint")) o->spine_dtype = DF_SPINE_DTYPE_CHECKPOINT;
        else { fprintf(stderr, "deltafin: --spine-dtype must be auto, bf16 (the checkpoint's own) or int8 (got '%s')\n", val); return -1; }
        return 1;
    }
    if (!strcmp(a, "--spine")) {
        if (!val) { fprintf(stderr, "deltafin: --spine needs a value\n"); return -1; }
        (*i)++;
        if (!strcmp(val, "auto")) o->spine = DF_SPINE_AUTO;
        else if (!strcmp(val, "resident")) o->spine = DF_SPINE_RESIDENT;
        else if (!strcmp(val, "stream")) o->spine = DF_SPINE_STREAM;
        else { fprintf(stderr, "deltafin: --spine must be auto, resident or stream (got '%s')\n", val); return -1; }
        return 1;
    }
    if (!strcmp(a, "--io") || !strcmp(a, "--ram") || !strcmp(a, "--expert-cache") || !strcmp(a, "--io-depth")) {
        if (!val) { fprintf(stderr, "deltafin: %s needs a value\n", a); return -1; }
        (*i)++;
        if (!strcmp(a, "--io")) {
            if (!strcmp(val, "direct")) o->expert_io = DF_EXPERTS_DIRECT;
            else if (!strcmp(val, "pread")) o->expert_io = DF_EXPERTS_PREAD;
            else if (!strcmp(val, "mmap")) o->expert_io = DF_EXPERTS_MMAP;
            else { fprintf(stderr, "deltafin: --io must be direct, pread or mmap (got '%s')\n", val); return -1; }
        } else if (!strcmp(a, "--ram") || !strcmp(a, "--expert-cache")) {
            int64_t *dst = !strcmp(a, "--ram") ? &o->ram : &o->expert_cache;
            if ((*dst = cli_parse_size(val)) <= 0) {
                fprintf(stderr, "deltafin: bad size for %s: '%s' (e.g. 8G, 512M)\n", a, val);
                return -1;
            }
        } else if (parse_int(val, &o->io_depth) || o->io_depth < 1) {
            fprintf(stderr, "deltafin: bad value for --io-depth: '%s'\n", val);
            return -1;
        }
        return 1;
    }
    if (!strcmp(a, "--cpus")) {
        char err[DF_ERRMSG];
        if (!val) { fprintf(stderr, "deltafin: --cpus needs a CPU list, e.g. 0-7\n"); return -1; }
        (*i)++;
        if ((o->ncpus = df_cpus_parse(val, o->cpus, CLI_CPUS_MAX, err)) < 0) {
            o->ncpus = 0;
            fprintf(stderr, "deltafin: --cpus: %s\n", err);
            return -1;
        }
        return cli_threads(o) < 0 ? -1 : 1;
    }
    if (!strcmp(a, "--model") || !strcmp(a, "--threads") || !strcmp(a, "--ctx") || !strcmp(a, "--simd")) {
        if (!val) { fprintf(stderr, "deltafin: %s needs a value\n", a); return -1; }
        (*i)++;
        if (!strcmp(a, "--model")) o->model = val;
        else if (!strcmp(a, "--threads")) {
            if (parse_int(val, &o->threads)) goto bad;
            if (cli_threads(o) < 0) return -1; /* more than --cpus lists */
        }
        else if (!strcmp(a, "--ctx")) { if (parse_int(val, &o->ctx)) goto bad; }
        else {
            if (!strcmp(val, "scalar")) o->simd = 0;
            else if (!strcmp(val, "avx2")) o->simd = 1;
            else if (!strcmp(val, "avx512")) o->simd = 2;
            else if (!strcmp(val, "neon")) o->simd = 3;
            else if (!strcmp(val, "amx")) o->simd = 4;
            else goto bad;
        }
        return 1;
    bad:
        fprintf(stderr, "deltafin: bad value for %s: '%s'\n", a, val);
        return -1;
    }
    return 0;
}

/* The router trace: one JSON line per token and MoE layer. The file is the
 * CLI's (opened in cli_open, closed at exit). */
static void trace_line(void *ctx, int pos, int layer, const int *ex, const float *w, int k) {
    FILE *f = ctx;
    fprintf(f, "{\"step\": %d, \"layer\": %d, \"experts\": [", pos, layer);
    for (int i = 0; i < k; i++) fprintf(f, i ? ", %d" : "%d", ex[i]);
    fprintf(f, "], \"weights\": [");
    for (int i = 0; i < k; i++) fprintf(f, i ? ", %.6g" : "%.6g", w[i]);
    fprintf(f, "]}\n");
}

int cli_threads(const cli_model_opts *o) {
    if (!o->ncpus) return o->threads;
    if (o->threads > o->ncpus) {
        fprintf(stderr, "deltafin: --threads %d needs as many CPUs, and --cpus lists %d: list more CPUs or ask for "
                "fewer threads\n", o->threads, o->ncpus);
        return -1;
    }
    return o->threads ? o->threads : o->ncpus;
}

int cli_engine_opts(const cli_model_opts *o, df_engine_opts *eo) {
    df_engine_opts_default(eo);
    if ((eo->n_threads = cli_threads(o)) < 0) return -1;
    eo->cpus = o->ncpus ? o->cpus : NULL;
    eo->use_mmap = !o->no_mmap;
    eo->map_spine = o->map_spine;
    eo->spine_copy_at_open = o->spine_copy == 2;
    eo->simd_level = o->simd;
    eo->expert_io = o->expert_io;
    eo->ram_bytes = o->ram;
    eo->expert_cache_bytes = o->expert_cache;
    eo->spine_dtype = o->spine_dtype;
    eo->plan_ctx = o->ctx;
    eo->prefetch = !o->no_prefetch;
    eo->prompt_chunks = o->prefill_chunks;
    eo->prompt_block = o->prefill_block;
    if (o->io_depth > 0) eo->io_depth = o->io_depth;
    eo->top_k = o->top_k;
    eo->heat_path = o->heat_path;
    eo->pin_bytes = o->pin;
    eo->plan_only = o->plan_only;
    eo->profile = o->profile;
    eo->spine = o->spine;
    eo->evict_heat = o->evict_heat;
    /* the metadata cache: only big checkpoints by default (small ones parse
     * in milliseconds), any indexed one under a folder named here */
    static char meta_dir[4096];
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (o->meta_cache && !strcmp(o->meta_cache, "off")) eo->meta_cache_dir = NULL;
    else if (o->meta_cache) eo->meta_cache_dir = o->meta_cache;
    else if (xdg && *xdg == '/') eo->meta_cache_dir = snprintf(meta_dir, sizeof meta_dir, "%s/deltafin/meta", xdg) < (int)sizeof meta_dir ? meta_dir : NULL;
    else if (home && *home == '/') eo->meta_cache_dir = snprintf(meta_dir, sizeof meta_dir, "%s/.cache/deltafin/meta", home) < (int)sizeof meta_dir ? meta_dir : NULL;
    eo->meta_cache_min_bytes = o->meta_cache ? 0 : (int64_t)4 << 20;
#ifdef DF_WITH_CUDA
    /* one accelerator per process, closed at exit by the C runtime's teardown */
    static const df_accel *accel;
    if (o->device != CLI_DEV_CPU && !accel) {
        char err[DF_ERRMSG];
        accel = gpu_accel_open(0, o->gpu_mem, o->bf16_tc_rows, o->bf16_wg, o->mx_wg, err);
        if (!accel && o->device == CLI_DEV_CUDA) {
            fprintf(stderr, "deltafin: --device cuda: %s\n", err);
            return -1;
        }
        if (!accel) fprintf(stderr, "deltafin: --device auto: no usable GPU (%s); running on the CPU\n", err);
    }
    if (o->device != CLI_DEV_CPU) eo->accel = accel;
#endif
    if (o->trace_path) {
        FILE *f = fopen(o->trace_path, "w");
        if (!f) {
            fprintf(stderr, "deltafin: cannot write the trace file %s\n", o->trace_path);
            return -1;
        }
        eo->trace = trace_line;
        eo->trace_ctx = f; /* flushed and closed by the C runtime at exit */
    }
    return cli_hub_attach(o->model, o->expert_io, o->cache_limit, eo) != 0 ? -1 : 0;
}

df_engine *cli_open(const cli_model_opts *o) {
    df_engine_opts eo;
    if (cli_engine_opts(o, &eo) != 0) return NULL;
    df_engine *e = NULL;
    char err[DF_ERRMSG];
    df_status st = df_engine_open(o->model, &eo, &e, err);
    if (st != DF_OK) {
        fprintf(stderr, "deltafin: cannot open model: %s\n", err);
        return NULL;
    }
    if (*df_engine_meta_note(e)) fprintf(stderr, "deltafin: %s\n", df_engine_meta_note(e));
    if (*df_engine_lossy(e)) fprintf(stderr, "deltafin: %s (quality differs from the model)\n", df_engine_lossy(e));
    return e;
}

int cli_parse_tokens(const char *s, int32_t **out) {
    int cap = 16, n = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    if (!v) return -1;
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == '\t') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX) { free(v); return -1; }
        if (n == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, (size_t)cap * sizeof *v);
            if (!nv) { free(v); return -1; }
            v = nv;
        }
        v[n++] = (int32_t)x;
        p = end;
        while (*p == ' ' || *p == '\t') p++;
        if (*p == ',') p++;
        else if (*p) { free(v); return -1; }
    }
    if (n == 0) { free(v); return -1; }
    *out = v;
    return n;
}

double cli_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int cli_usage(const char *cmd, const char *msg) {
    fprintf(stderr, "deltafin %s: %s (see `deltafin %s --help`)\n", cmd, msg, cmd);
    return CLI_USAGE;
}

/* ---- speculative decoding options (run, chat, serve, bench --decode) ---- */

const char cli_spec_opts_help[] =
    "  --spec MODE          ngram: exact speculative decoding with prompt-lookup drafts (greedy output\n"
    "                       unchanged, sampled output distributed as without); off (default)\n"
    "  --spec-depth K       most drafts per step (1..16, default 8)\n"
    "  --spec-ngram N       longest suffix looked up in the text so far (default 3)\n"
    "  --spec-fixed         always draft K (default: adaptive, off when measured not to pay)\n";

void cli_spec_opts_init(cli_spec_opts *o) {
    memset(o, 0, sizeof *o);
    df_spec_params_default(&o->p);
}

int cli_spec_opt(cli_spec_opts *o, int argc, char **argv, int *i) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(a, "--spec-fixed")) { o->p.adaptive = 0; return 1; }
    int which = !strcmp(a, "--spec") ? 1 : !strcmp(a, "--spec-depth") ? 2 : !strcmp(a, "--spec-ngram") ? 3 : 0;
    if (!which) return 0;
    if (!v) { fprintf(stderr, "deltafin: %s needs a value\n", a); return -1; }
    (*i)++;
    if (which == 1) {
        if (!strcmp(v, "ngram")) o->on = 1;
        else if (!strcmp(v, "off")) o->on = 0;
        else { fprintf(stderr, "deltafin: --spec takes ngram or off, not '%s'\n", v); return -1; }
        return 1;
    }
    int x;
    int hi = which == 2 ? DF_SPEC_MAX : 16;
    if (parse_int(v, &x) || x < 1 || x > hi) {
        fprintf(stderr, "deltafin: %s takes 1..%d, not '%s'\n", a, hi, v);
        return -1;
    }
    if (which == 2) o->p.depth = x;
    else o->p.ngram = x;
    return 1;
}

df_spec *cli_spec_new(const cli_spec_opts *o, df_session *s, df_sampler *smp) {
    df_spec *sp = NULL;
    char err[DF_ERRMSG];
    if (df_spec_new(s, smp, &o->p, &sp, err) != DF_OK) {
        fprintf(stderr, "deltafin: %s; decoding without drafts\n", err);
        return NULL;
    }
    return sp;
}

void cli_spec_print(const df_spec *sp, FILE *f) {
    df_spec_stats st;
    df_spec_get_stats(sp, &st);
    double acc = st.drafted ? 100.0 * (double)st.accepted / (double)st.drafted : 0;
    double per_step = st.steps ? (double)(st.tokens) / (double)st.steps : 0;
    double rows = st.steps ? (double)st.rows / (double)st.steps : 0;
    fprintf(f, "spec ngram: %llu steps, %.2f rows and %.2f tokens per step; drafts accepted %llu/%llu (%.1f%%)",
            (unsigned long long)st.steps, rows, per_step, (unsigned long long)st.accepted,
            (unsigned long long)st.drafted, acc);
    if (st.row1_s > 0 && st.steps)
        fprintf(f, "; 1-row step %.1f ms, +%.2f ms per row; speedup vs no drafts ~%.2fx (estimated from the 1-row step)",
                st.row1_s * 1e3, st.per_row_s * 1e3, (double)st.tokens / st.steps * st.row1_s / (st.step_s / st.steps));
    fprintf(f, "; depth now %d\n", st.depth_now);
}
