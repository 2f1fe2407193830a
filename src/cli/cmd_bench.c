/* cmd_bench.c — `deltafin bench`: kernel throughput against a DRAM probe
 * (--kernels) and decode speed against the disk floor (--decode).
 *
 * --decode: opens the model with the given expert I/O and cache budget,
 * measures the disk's O_DIRECT bandwidth (expert-sized reads at the
 * engine's queue depth) in the same run, prefills a prompt, decodes N
 * greedy tokens and reports the median s/token of steady tokens (the first
 * decode token is excluded), bytes read per token, hit rate, and the ratio
 * measured / floor where floor = bytes read per token / disk GB/s.
 */
#include "cli.h"
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int bench_kernels(int threads, const int *cpus, int simd, double mb, double seconds) {
    if (threads <= 0) threads = 2;
    if (mb < 1) mb = 1;
    df_bench_row rows[16];
    double probe = 0, flops = 0;
    int n = df_bench_kernels(threads, cpus, simd, mb, seconds, rows, &probe, &flops);
    if (n <= 0) { fprintf(stderr, "deltafin: benchmark failed\n"); return CLI_FAIL; }
    const char *lv = df_simd_level_desc(simd); /* the level that ran */
    printf("threads %d%s, simd %s, matrices ~%.0f MB, DRAM read probe %.2f GB/s, fp32 FMA probe %.1f GFLOP/s\n",
           threads, cpus ? " (pinned)" : "", lv, mb, probe, flops);
    printf("%-8s %10s %10s %12s %14s %10s\n", "type", "GB/s", "% probe", "ms/matvec", "gemm GFLOP/s",
           "% FMA");
    for (int i = 0; i < n; i++)
        printf("%-8s %10.2f %9.1f%% %12.3f %14.1f %9.1f%%\n", rows[i].name, rows[i].gbps,
               100.0 * rows[i].gbps / probe, rows[i].ms_per_call, rows[i].gemm_gflops,
               flops > 0 ? 100.0 * rows[i].gemm_gflops / flops : 0.0);
    printf("gemm: %d vectors per matmul (prefill); matvec: 1 vector (decode)\n", DF_BENCH_GEMM_N);
    return CLI_OK;
}

/* MoE layers of the model: expert reads per token = K x this. */
static int nmoe_layers(df_engine *e) { return df_engine_moe_layers(e); }

/* --spec: the same greedy decode with drafts, once per rewind mode (trail:
 * a copy of the KDA state per token; replay: one copy + a forward pass of
 * the kept tokens per rejection); the tokens must be the plain ones. */
typedef struct {
    double s;                     /* decode seconds */
    df_spec_stats st;
    int same;                     /* tokens equal the plain decode's */
} spec_run;

static int bench_spec_run(df_engine *e, const cli_spec_opts *so, int mode, const int32_t *prompt, int nprompt,
                          const int32_t *plain, int ntok, spec_run *r) {
    df_session *s = NULL;
    df_sampler *smp = NULL;
    df_spec *sp = NULL;
    char err[DF_ERRMSG];
    df_sampler_params p;
    df_sampler_params_default(&p);
    p.temperature = 0;
    int rc = -1, made = 0;
    memset(r, 0, sizeof *r);
    r->same = 1;
    if (df_session_new(e, nprompt + ntok + DF_SPEC_MAX + 2, &s) != DF_OK ||
        df_sampler_new(&p, df_engine_vocab_size(e), &smp, err) != DF_OK)
        goto done;
    if (df_spec_new(s, smp, &so->p, &sp, err) != DF_OK) { fprintf(stderr, "deltafin: %s\n", err); goto done; }
    if (df_session_set_rewind(s, so->p.depth + 1, mode) != DF_OK) { fprintf(stderr, "deltafin: %s\n", df_session_error(s)); goto done; }
    if (df_session_eval(s, prompt, nprompt, NULL) != DF_OK || df_spec_context(sp, prompt, nprompt) != DF_OK) goto done;
    double t0 = cli_now();
    while (made < ntok + 1) { /* the plain decode's first token comes from the prompt; it then made ntok more */
        int32_t out[DF_SPEC_MAX + 1];
        int k;
        if (df_spec_step(sp, ntok + 1 - made, out, NULL, &k) != DF_OK) {
            fprintf(stderr, "deltafin: %s\n", df_session_error(s));
            goto done;
        }
        for (int i = 0; i < k; i++) r->same &= out[i] == plain[made + i];
        made += k;
    }
    r->s = cli_now() - t0;
    df_spec_get_stats(sp, &r->st);
    rc = 0;
done:
    df_spec_free(sp);
    df_sampler_free(smp);
    df_session_free(s);
    return rc;
}

/* The parts of a prefill profile that took time: seconds and share. */
static void print_parts(const double part[DF_PROF_N]) {
    double sum = 0;
    for (int i = 0; i < DF_PROF_N; i++) sum += part[i];
    for (int i = 0; i < DF_PROF_N; i++)
        if (part[i] > 0) printf("  %-22s %8.3f s   %5.1f%%\n", df_prof_name(i), part[i], sum > 0 ? 100 * part[i] / sum : 0);
}

/* --prefill-again [N]: the prompt N more times, each in a new session of
 * the same engine, its weights now in place (caches, device copies), so
 * the time is the compute, not the first reads and uploads. Returns the
 * median of the N times (0 on failure), each time in runs[], the parts
 * summed over the N runs in part[], and the device counters over them in
 * *dev; *same: every run's greedy next token is the first prefill's. */
enum { AGAIN_MAX = 32 };
static double bench_prefill_again(df_engine *e, const int32_t *prompt, int nprompt, int32_t first_tok, int nrun,
                                  double runs[AGAIN_MAX], int *same, double part[DF_PROF_N], df_accel_stats *dev) {
    *same = 1;
    double p0[DF_PROF_N];
    df_accel_stats d0;
    df_engine_profile(e, p0);
    df_engine_accel_stats(e, &d0);
    for (int r = 0; r < nrun; r++) {
        df_session *s = NULL;
        if (df_session_new(e, nprompt + 1, &s) != DF_OK) return 0;
        double t0 = cli_now();
        df_status st = df_session_eval(s, prompt, nprompt, NULL);
        runs[r] = cli_now() - t0;
        if (st != DF_OK) fprintf(stderr, "deltafin: prefill again: %s\n", df_session_error(s));
        else *same &= df_argmax(df_session_logits(s), df_engine_vocab_size(e)) == first_tok;
        df_session_free(s);
        if (st != DF_OK) return 0;
    }
    df_engine_profile(e, part);
    for (int i = 0; i < DF_PROF_N; i++) part[i] -= p0[i];
    df_engine_accel_stats(e, dev);
    dev->calls -= d0.calls;
    dev->cpu_calls -= d0.cpu_calls;
    dev->cache_hits -= d0.cache_hits;
    dev->cache_uploads -= d0.cache_uploads;
    dev->cache_evictions -= d0.cache_evictions;
    dev->tier_hits -= d0.tier_hits;
    dev->upload_bytes -= d0.upload_bytes;
    dev->macs_mxfp4 -= d0.macs_mxfp4;
    dev->macs_bf16 -= d0.macs_bf16;
    dev->macs_other -= d0.macs_other;
    dev->device_read_bytes -= d0.device_read_bytes;
    double sorted[AGAIN_MAX];
    memcpy(sorted, runs, (size_t)nrun * sizeof *sorted);
    qsort(sorted, (size_t)nrun, sizeof *sorted, cmp_double);
    return nrun % 2 ? sorted[nrun / 2] : 0.5 * (sorted[nrun / 2 - 1] + sorted[nrun / 2]);
}

static int bench_decode(cli_model_opts *mo, int ntok, int nprompt, int warmup, double probe_s, int json,
                        const cli_spec_opts *so, const char *prompt_file, int again) {
    mo->profile = 1;
    /* the DRAM floor's probe before the engine takes its memory (its buffer
     * is outside the plan, which may fill a memory limit) */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    const int want = cli_threads(mo); /* cmd_bench refused a bad --threads / --cpus pair already */
    const int nthr = want > 0 ? want : (ncpu > 0 ? (int)ncpu : 1);
    const int *cpus = mo->ncpus ? mo->cpus : NULL; /* the probes on the engine's CPUs */
    double dram = df_dram_probe(nthr, cpus, df_probe_default_mb(), 0.5);
    /* prefill's compute ceiling: the kernels' fp32 FMA rate on as many threads */
    double fma = df_fma_probe(nthr, cpus, 0.2);
    /* the spine's copy ends before any timing: by the open, on its threads
     * (--spine-copy idle: a thread beside the steps, ending when it may) */
    cli_model_opts mo_bench = *mo;
    if (!mo_bench.spine_copy) mo_bench.spine_copy = 2;
    df_engine *e = cli_open(&mo_bench);
    if (!e) return CLI_FAIL;
    int rc = CLI_FAIL, V = df_engine_vocab_size(e);
    df_session *s = NULL;
    double *dt = calloc((size_t)ntok * 2 + 1, sizeof(double));
    uint64_t *bytes = calloc((size_t)ntok + 1, sizeof(uint64_t));
    int32_t *prompt = NULL, *plain = malloc(((size_t)ntok + 1) * sizeof(int32_t));
    char err[DF_ERRMSG];
    double disk = 0;
    df_tokens ptoks = {0};
    if (prompt_file) { /* a text prompt (repetitive text is where drafts pay) */
        df_tokenizer *tk = NULL;
        FILE *f = fopen(prompt_file, "rb");
        char *text = malloc(1 << 20);
        size_t tn = f && text ? fread(text, 1, (1 << 20) - 1, f) : 0;
        if (f) fclose(f);
        if (!tn || df_tokenizer_load_dir(mo->model, &tk, err) != DF_OK ||
            df_tokenize(tk, text, tn, 0, &ptoks, err) != DF_OK || ptoks.n < 1) {
            fprintf(stderr, "deltafin: --prompt-file %s: %s\n", prompt_file, tn ? err : "cannot read it (or it is empty)");
            df_tokenizer_free(tk);
            free(text);
            goto done;
        }
        df_tokenizer_free(tk);
        free(text);
        nprompt = ptoks.n;
        prompt = ptoks.ids;
    } else {
        prompt = malloc((size_t)nprompt * sizeof(int32_t));
    }
    if (!dt || !bytes || !prompt || !plain) goto done;
    if (df_engine_probe_disk(e, probe_s, &disk, err) != DF_OK) {
        fprintf(stderr, "deltafin: disk probe failed: %s\n", err);
        goto done;
    }
    if (!prompt_file)
        for (int i = 0; i < nprompt; i++) prompt[i] = (int32_t)((i * 7919 + 13) % V);
    if (df_session_new(e, nprompt + warmup + ntok + 1, &s) != DF_OK) goto done;
    df_stats a, b, steady0; /* steady0: counters once the first decode token is done */
    df_engine_reset_stats(e);
    double pre0[DF_PROF_N], pre1[DF_PROF_N];
    df_engine_profile(e, pre0);
    df_batch_stats bs0, bs1;
    df_engine_batch_stats(e, &bs0);
    double t0 = cli_now();
    if (df_session_eval(s, prompt, nprompt, NULL) != DF_OK) {
        fprintf(stderr, "deltafin: %s\n", df_session_error(s));
        goto done;
    }
    double prefill_s = cli_now() - t0;
    df_engine_batch_stats(e, &bs1);
    const uint64_t prefill_blocks = bs1.prompt_blocks - bs0.prompt_blocks, prefill_passes = bs1.passes - bs0.passes;
    df_engine_stats(e, &b);
    uint64_t prefill_bytes = b.bytes_read + b.spine_bytes_read;
    double prof0[DF_PROF_N], prof1[DF_PROF_N];
    df_engine_profile(e, prof0);
    for (int i = 0; i < DF_PROF_N; i++) pre1[i] = prof0[i] - pre0[i];
    /* --warmup: greedy tokens decoded before the measured ones, outside every
     * figure below (a short run otherwise measures the first use of its
     * experts and buffers, not the steady state) */
    const int32_t first_tok = df_argmax(df_session_logits(s), V);
    for (int i = 0; i < warmup; i++) {
        int32_t tok = df_argmax(df_session_logits(s), V);
        if (df_session_eval(s, &tok, 1, NULL) != DF_OK) {
            fprintf(stderr, "deltafin: %s\n", df_session_error(s));
            goto done;
        }
    }
    if (warmup) {
        df_engine_stats(e, &b);
        df_engine_profile(e, prof0);
    }
    uint64_t hits = 0, all = 0;
    df_stats dec0 = b; /* counters at the start of decode */
    steady0 = b;
    df_accel_stats ac0, ac;
    df_engine_accel_stats(e, &ac0);
    for (int i = 0; i < ntok; i++) {
        int32_t tok = df_argmax(df_session_logits(s), V);
        plain[i] = tok;
        a = b;
        double t = cli_now();
        if (df_session_eval(s, &tok, 1, NULL) != DF_OK) {
            fprintf(stderr, "deltafin: %s\n", df_session_error(s));
            goto done;
        }
        dt[i] = cli_now() - t;
        df_engine_stats(e, &b);
        if (i == 0 && ntok > 1) steady0 = b;
        bytes[i] = (b.bytes_read - a.bytes_read) + (b.spine_bytes_read - a.spine_bytes_read);
        if (i > 0) { /* a prefetched expert was read for this token: not a hit */
            uint64_t h = b.expert_hits - a.expert_hits;
            hits += h;
            all += h + (b.expert_misses - a.expert_misses) + (b.prefetch_used - a.prefetch_used);
        }
        if (!json)
            fprintf(stderr, "token %d: %.3f s, %.1f MB read (spine %.1f MB)\n", i + 1, dt[i], bytes[i] / 1e6,
                    (b.spine_bytes_read - a.spine_bytes_read) / 1e6);
    }
    plain[ntok] = df_argmax(df_session_logits(s), V);
    df_engine_profile(e, prof1);
    df_engine_accel_stats(e, &ac);
    /* the device's floor: the decode's weight uploads at the measured
     * page-locked host-to-device rate */
    double up_tok = ntok ? (double)(ac.upload_bytes - ac0.upload_bytes) / ntok : 0;
    double h2d = ac.calls ? df_engine_probe_h2d(e) : 0;
    double h2d_floor = h2d > 0 ? up_tok / (h2d * 1e9) : 0;
    /* and the HBM floor: the bytes device work read per token (weights of
     * the products run there, KDA states, MLA cache rows) at the device's
     * read bandwidth, measured by a read probe kernel in this run */
    double dev_tok = ntok ? (double)(ac.device_read_bytes - ac0.device_read_bytes) / ntok : 0;
    double hbm = ac.calls ? df_engine_probe_device_read(e) : 0;
    double hbm_floor = hbm > 0 ? dev_tok / (hbm * 1e9) : 0;
    /* lookahead quality over the decode: precision = of the prefetches whose
     * outcome is known, the share their pass used; recall = share of the
     * experts a pass would have missed that the prefetch had read */
    uint64_t pf = b.prefetched - dec0.prefetched, pu = b.prefetch_used - dec0.prefetch_used;
    uint64_t pw = b.prefetch_wasted - dec0.prefetch_wasted;
    uint64_t miss = b.expert_misses - dec0.expert_misses;
    double pf_precision = pu + pw ? (double)pu / (pu + pw) : 0, pf_recall = pu + miss ? (double)pu / (pu + miss) : 0;
    int steady = ntok > 1 ? ntok - 1 : ntok, first = ntok > 1 ? 1 : 0;
    double *sorted = dt + ntok, mean_bytes = 0; /* the spare tail of dt */
    for (int i = 0; i < steady; i++) {
        sorted[i] = dt[first + i];
        mean_bytes += (double)bytes[first + i];
    }
    mean_bytes /= steady;
    /* the spine's share of the bytes read per token (streamed spines only) */
    double spine_read_tok = (double)(b.spine_bytes_read - dec0.spine_bytes_read) / ntok;
    qsort(sorted, (size_t)steady, sizeof(double), cmp_double);
    double med = steady % 2 ? sorted[steady / 2] : 0.5 * (sorted[steady / 2 - 1] + sorted[steady / 2]);
    double floor_s = mean_bytes / (disk * 1e9);
    /* reads hidden under compute: of the time the disk needs for a steady
     * token's bytes (floor_s), the share the token loop did not spend
     * waiting for expert reads or blocked handing them to the kernel */
    double wait_tok = (b.io_wait_s - steady0.io_wait_s) / steady, sub_tok = (b.io_submit_s - steady0.io_submit_s) / steady;
    double hidden = floor_s > 0 ? 1.0 - (wait_tok + sub_tok) / floor_s : 1.0;
    if (hidden < 0) hidden = 0;
    double ratio = floor_s > 0 ? med / floor_s : 0;
    int again_same = 0;
    double again_part[DF_PROF_N] = {0}, again_runs[AGAIN_MAX] = {0};
    df_accel_stats again_dev = {0};
    const double again_s =
        again ? bench_prefill_again(e, prompt, nprompt, first_tok, again, again_runs, &again_same, again_part, &again_dev)
              : 0;
    if (again && again_s <= 0) goto done;
    /* a warm prompt against the tensor cores' measured bf16 rate: the
     * device's products as the model counts them, and as the exact forms
     * run them (x in limbs: MXFP4 two f16, bf16 three bf16, other types
     * once), at the faster of mma.sync and wgmma */
    double tc_sync = 0, tc_wg = 0;
    if (again && again_dev.calls) df_engine_probe_device_tc(e, &tc_sync, &tc_wg);
    const double tc_rate = (tc_sync > tc_wg ? tc_sync : tc_wg) * 1e12;
    const double dev_mx = again ? (double)again_dev.macs_mxfp4 / again : 0,
                 dev_bf = again ? (double)again_dev.macs_bf16 / again : 0,
                 dev_ot = again ? (double)again_dev.macs_other / again : 0;
    const double dev_flops = 2 * (dev_mx + dev_bf + dev_ot), limb_flops = 2 * (2 * dev_mx + 3 * dev_bf + dev_ot);
    const double tc_floor = tc_rate > 0 ? dev_flops / tc_rate : 0, tc_limb_floor = tc_rate > 0 ? limb_flops / tc_rate : 0;
    /* the DRAM probe again now that the measured work is done, and the
     * floors at the better reading (as bench --kernels does): a shared
     * machine's bandwidth moves from one moment to the next (a 2-vCPU VM's
     * probe read ~33 or ~47 GB/s), and a low first reading flatters every
     * ratio, down to parts "below" their floor */
    const double dram_first = dram, dram_after = df_dram_probe(nthr, cpus, df_probe_default_mb(), 0.5);
    if (dram_after > dram) dram = dram_after;
    /* the FMA probe again after a prompt, the better reading kept for the
     * same reason: on the 16-vCPU host two readings in one hour were 1.44
     * and 2.52 TFLOP/s, so a slow first reading halved the compute floor */
    const double fma_first = fma, fma_after = nprompt > 0 ? df_fma_probe(nthr, cpus, 0.2) : 0;
    if (fma_after > fma) fma = fma_after;
    /* the mapped weights and how the page cache holds them (small folios read slower) */
    int64_t mapped = 0, mapped_2mb = 0;
    if (df_engine_mapped_weights(e, &mapped, &mapped_2mb) != 0) mapped = mapped_2mb = -1;
    /* the resident spine copied out of the page cache (--map-spine: not) */
    int64_t cp_tensors = 0, cp_bytes = 0, cp_rss = 0, cp_2mb = 0;
    double cp_s = 0;
    const int copied = df_engine_spine_copy(e, &cp_tensors, &cp_bytes, &cp_s, &cp_rss, &cp_2mb);
    /* the other floor: every weight byte of a step read once from RAM */
    int64_t spine = df_engine_spine_bytes_per_token(e);
    double touched = (double)spine + (double)df_engine_expert_bytes(e) * df_engine_experts_per_token(e) * nmoe_layers(e);
    double mem_floor = dram > 0 ? touched / (dram * 1e9) : 0;
    /* each part's own floor: its weight bytes per token at the rate of the
     * memory they are read from: the device's read probe when every decode
     * product ran there, else the DRAM probe */
    const int parts_on_device = hbm > 0 && ac.calls > ac0.calls && ac.cpu_calls == ac0.cpu_calls;
    const double part_rate = parts_on_device ? hbm : dram;
    double part_floor[DF_PROF_N];
    df_engine_part_bytes(e, part_floor);
    for (int i = 0; i < DF_PROF_N; i++) part_floor[i] = part_rate > 0 ? part_floor[i] / (part_rate * 1e9) : 0;
    /* and against the device's memory: what its work read (each product's
     * weights once, KDA states, MLA cache rows) at the read probe's rate;
     * the larger of the two floors bounds the prompt from below */
    const double dev_rd = again ? (double)again_dev.device_read_bytes / again : 0;
    const double hbm_pfloor = hbm > 0 ? dev_rd / (hbm * 1e9) : 0;
    const double dev_pfloor = hbm_pfloor > tc_limb_floor ? hbm_pfloor : tc_limb_floor;
    double best_floor = mem_floor > floor_s ? mem_floor : floor_s;
    /* prefill reads each needed expert once per chunk: its own floor is the
     * larger of its reads at the disk rate and one pass over the weights */
    double prefill_floor = (double)prefill_bytes / (disk * 1e9);
    if (mem_floor > prefill_floor) prefill_floor = mem_floor;
    /* and its compute floor: every product's FMAs at the measured rate (the
     * head only for the last position: the prompt's other logits are not made) */
    double head_macs = (double)df_engine_head_macs(e);
    double prefill_flops = 2.0 * (((double)df_engine_macs_per_token(e) - head_macs) * nprompt + head_macs);
    double prefill_compute = fma > 0 ? prefill_flops / (fma * 1e9) : 0;
    double prefill_best = prefill_compute > prefill_floor ? prefill_compute : prefill_floor;
    /* experts run from device copies (the GPU tier) count as hits: they were
     * not read (an estimate over steady tokens: the decode's share of them) */
    uint64_t tier = (ac.tier_hits - ac0.tier_hits) * (uint64_t)steady / (uint64_t)(ntok ? ntok : 1);
    double hit = all + tier ? (double)(hits + tier) / (all + tier) : 1.0;
    if (json) {
        /* one object: the contract of --json (the profile nested in it) */
        json_t *o = json_object(), *prof = json_object();
        json_object_set_new(o, "model", json_string(mo->model));
        json_object_set_new(o, "expert_io", json_string(b.expert_io));
        json_object_set_new(o, "expert_dio_mem_align", json_integer(b.dio_mem_align));
        json_object_set_new(o, "ram_bytes", json_integer(mo->ram));
        json_object_set_new(o, "expert_cache_bytes", json_integer(b.cache_slots * b.slot_bytes));
        json_object_set_new(o, "spine", json_string(df_engine_spine_streamed(e) ? "stream" : "resident"));
        json_object_set_new(o, "spine_plan", json_string(df_engine_spine_why(e)));
        json_object_set_new(o, "threads", json_integer(df_engine_n_threads(e)));
        json_t *pin = json_array(); /* the CPUs of threads 0, 1, ... (--cpus); empty: unpinned */
        for (int i = 0; mo->ncpus && i < df_engine_n_threads(e); i++) json_array_append_new(pin, json_integer(mo->cpus[i]));
        json_object_set_new(o, "cpus", pin);
        json_object_set_new(o, "prompt_tokens", json_integer(nprompt));
        json_object_set_new(o, "decode_tokens", json_integer(ntok));
        json_object_set_new(o, "decode_warmup_tokens", json_integer(warmup));
        json_object_set_new(o, "prefill_s", json_real(prefill_s));
        json_object_set_new(o, "prefill_bytes", json_integer((json_int_t)prefill_bytes));
        json_object_set_new(o, "s_per_token", json_real(med));
        json_object_set_new(o, "tokens_per_s", json_real(med > 0 ? 1.0 / med : 0.0));
        json_object_set_new(o, "bytes_read_per_token", json_real(mean_bytes));
        json_object_set_new(o, "spine_bytes_read_per_token", json_real(spine_read_tok));
        json_object_set_new(o, "expert_bytes_read_per_token", json_real(mean_bytes - spine_read_tok));
        json_object_set_new(o, "hit_rate", json_real(hit));
        json_object_set_new(o, "disk_gbps", json_real(disk));
        json_object_set_new(o, "floor_s_per_token", json_real(floor_s));
        json_object_set_new(o, "ratio", json_real(ratio));
        json_object_set_new(o, "read_hidden", json_real(hidden));
        json_object_set_new(o, "io_wait_s_per_token", json_real(wait_tok));
        json_object_set_new(o, "io_submit_s_per_token", json_real(sub_tok));
        json_object_set_new(o, "cache_slots", json_integer(b.cache_slots));
        json_object_set_new(o, "max_in_flight", json_integer(b.max_in_flight));
        json_object_set_new(o, "prefetch", json_boolean(!mo->no_prefetch));
        json_object_set_new(o, "lossy", json_string(df_engine_lossy(e)));
        json_object_set_new(o, "spine_bytes_per_token", json_integer(spine));
        json_object_set_new(o, "dram_gbps", json_real(dram));
        json_t *probes = json_array();
        json_array_append_new(probes, json_real(dram_first));
        json_array_append_new(probes, json_real(dram_after));
        json_object_set_new(o, "dram_gbps_probes", probes);
        json_object_set_new(o, "memory_floor_s_per_token", json_real(mem_floor));
        json_object_set_new(o, "ratio_to_larger_floor", json_real(best_floor > 0 ? med / best_floor : 0));
        json_object_set_new(o, "mapped_weight_bytes", json_integer(mapped));
        json_object_set_new(o, "mapped_weight_bytes_2mb", json_integer(mapped_2mb));
        json_object_set_new(o, "spine_copy", json_string(mo_bench.map_spine || mo_bench.no_mmap ? "off"
                                                          : mo_bench.spine_copy == 2 ? "open" : "idle"));
        json_object_set_new(o, "spine_copied_bytes", json_integer(cp_bytes));
        json_object_set_new(o, "spine_copied_seconds", json_real(cp_s));
        json_object_set_new(o, "spine_copied_bytes_2mb", json_integer(cp_2mb));
        json_object_set_new(o, "prefetch_issued_per_token", json_real((double)pf / ntok));
        json_object_set_new(o, "prefetch_precision", json_real(pf_precision));
        json_object_set_new(o, "prefetch_recall", json_real(pf_recall));
        json_object_set_new(o, "prefill_floor_s", json_real(prefill_floor));
        json_object_set_new(o, "prefill_ratio", json_real(prefill_floor > 0 ? prefill_s / prefill_floor : 0));
        json_object_set_new(o, "prefill_tokens_per_s", json_real(prefill_s > 0 ? nprompt / prefill_s : 0));
        json_object_set_new(o, "prefill_passes", json_integer((json_int_t)prefill_passes));
        json_object_set_new(o, "prefill_layer_major_blocks", json_integer((json_int_t)prefill_blocks));
        json_object_set_new(o, "prefill_block_positions", json_integer(df_engine_prompt_block(e)));
        json_object_set_new(o, "fma_gflops", json_real(fma));
        json_t *fprobes = json_array(); /* before the engine opened, after the prompt (0: none run) */
        json_array_append_new(fprobes, json_real(fma_first));
        json_array_append_new(fprobes, json_real(fma_after));
        json_object_set_new(o, "fma_gflops_probes", fprobes);
        json_object_set_new(o, "prefill_gflop", json_real(prefill_flops / 1e9));
        json_object_set_new(o, "prefill_compute_floor_s", json_real(prefill_compute));
        json_object_set_new(o, "prefill_ratio_to_larger_floor", json_real(prefill_best > 0 ? prefill_s / prefill_best : 0));
        if (again) {
            json_object_set_new(o, "prefill_again_s", json_real(again_s));
            json_object_set_new(o, "prefill_again_tokens_per_s", json_real(nprompt / again_s));
            json_object_set_new(o, "prefill_again_same_token", json_boolean(again_same));
            json_t *runs = json_array();
            for (int r = 0; r < again; r++) json_array_append_new(runs, json_real(again_runs[r]));
            json_object_set_new(o, "prefill_again_runs_s", runs);
            if (again_dev.calls || again_dev.cpu_calls) {
                json_object_set_new(o, "prefill_again_device_products", json_integer((json_int_t)again_dev.calls));
                json_object_set_new(o, "prefill_again_cpu_products", json_integer((json_int_t)again_dev.cpu_calls));
                json_object_set_new(o, "prefill_again_routed_from_device", json_integer((json_int_t)again_dev.tier_hits));
                json_object_set_new(o, "prefill_again_device_uploads", json_integer((json_int_t)again_dev.cache_uploads));
            }
        }
        json_object_set_new(o, "device_upload_bytes_per_token", json_real(up_tok));
        json_object_set_new(o, "spine_groups_kept_on_device", json_integer((json_int_t)ac.spine_kept_groups));
        json_object_set_new(o, "spine_groups_from_device_per_token",
                            json_real((double)(ac.spine_groups_on_device - ac0.spine_groups_on_device) / ntok));
        json_object_set_new(o, "h2d_gbps", json_real(h2d));
        json_object_set_new(o, "upload_floor_s_per_token", json_real(h2d_floor));
        json_object_set_new(o, "device_read_bytes_per_token", json_real(dev_tok));
        json_object_set_new(o, "device_read_gbps", json_real(hbm));
        json_object_set_new(o, "bf16_tc_rows", json_integer(mo->bf16_tc_rows));
        json_object_set_new(o, "bf16_wg", json_string(mo->bf16_wg > 0 ? "on" : mo->bf16_wg < 0 ? "off" : "auto"));
        json_object_set_new(o, "mx_wg", json_string(mo->mx_wg > 0 ? "on" : mo->mx_wg < 0 ? "off" : "auto"));
        json_object_set_new(o, "hbm_floor_s_per_token", json_real(hbm_floor));
        if (tc_rate > 0) {
            json_object_set_new(o, "device_tc_tflops_mma_sync", json_real(tc_sync));
            json_object_set_new(o, "device_tc_tflops_wgmma", json_real(tc_wg));
            json_object_set_new(o, "prefill_again_device_gflop", json_real(dev_flops / 1e9));
            json_object_set_new(o, "prefill_again_device_gflop_mxfp4", json_real(2 * dev_mx / 1e9));
            json_object_set_new(o, "prefill_again_device_gflop_bf16", json_real(2 * dev_bf / 1e9));
            json_object_set_new(o, "prefill_again_device_tflops", json_real(dev_flops / again_s / 1e12));
            json_object_set_new(o, "prefill_tc_floor_s", json_real(tc_floor));
            json_object_set_new(o, "prefill_tc_limb_floor_s", json_real(tc_limb_floor));
            json_object_set_new(o, "prefill_tc_share", json_real(tc_floor / again_s));
            json_object_set_new(o, "prefill_tc_limb_share", json_real(tc_limb_floor / again_s));
            json_object_set_new(o, "prefill_again_device_read_gb", json_real(dev_rd / 1e9));
            json_object_set_new(o, "prefill_hbm_floor_s", json_real(hbm_pfloor));
            json_object_set_new(o, "prefill_hbm_share", json_real(hbm_pfloor / again_s));
            json_object_set_new(o, "prefill_device_floor_s", json_real(dev_pfloor));
            json_object_set_new(o, "prefill_device_floor_share", json_real(dev_pfloor / again_s));
        }
        json_object_set_new(o, "hbm_ratio", json_real(hbm_floor > 0 ? med / hbm_floor : 0));
        json_object_set_new(o, "device_waits_per_token", json_real((double)(ac.sync_calls - ac0.sync_calls) / ntok));
        json_object_set_new(o, "device_passes_per_token",
                            json_real((double)(ac.device_passes - ac0.device_passes) / ntok));
        json_object_set_new(o, "device_wait_s_per_token", json_real((ac.sync_s - ac0.sync_s) / ntok));
        json_object_set_new(o, "expert_cache_pinned", json_boolean(ac.pinned_bytes != 0));
        json_t *pfl = json_object();
        for (int i = 0; i < DF_PROF_N; i++) {
            json_object_set_new(prof, df_prof_name(i), json_real((prof1[i] - prof0[i]) / ntok));
            if (i != DF_PROF_SPINE_WAIT) json_object_set_new(pfl, df_prof_name(i), json_real(part_floor[i]));
        }
        json_object_set_new(o, "profile_s_per_token", prof);
        json_object_set_new(o, "part_floor_s_per_token", pfl);
        json_object_set_new(o, "part_floor_basis", json_string(parts_on_device ? "device" : "dram"));
        json_t *pprof = json_object();
        for (int i = 0; i < DF_PROF_N; i++) json_object_set_new(pprof, df_prof_name(i), json_real(pre1[i]));
        json_object_set_new(o, "prefill_profile_s", pprof);
        char *txt = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(8));
        if (txt) printf("%s\n", txt);
        free(txt);
        json_decref(o);
    } else {
        if (*df_engine_lossy(e)) printf("%s\n", df_engine_lossy(e));
        printf("experts via %s, %d cache slots of %.1f MB, threads %d%s\n", b.expert_io, b.cache_slots,
               b.slot_bytes / 1e6, df_engine_n_threads(e), mo->ncpus ? " (pinned: --cpus)" : "");
        /* (a read shifts by a multiple of the alignment to put its first
         * tensor on a 128-byte line: always possible up to 8, safetensors'
         * own alignment) */
        if (b.dio_mem_align > 0)
            printf("expert reads land on        %d-byte buffers: %s\n", b.dio_mem_align,
                   b.dio_mem_align <= 8     ? "each read's first tensor on a 128-byte line"
                   : b.dio_mem_align <= 128 ? "a read's first tensor on a 128-byte line where its offset allows"
                                            : "tensors keep the file's offsets until their second use");
        printf("disk (O_DIRECT, same run)   %.3f GB/s\n", disk);
        printf("prefill %d tokens           %.3f s, %.1f MB read; floor %.3f s (reads at the disk rate, or\n"
               "                            every weight byte once from RAM, the larger), ratio %.2f\n",
               nprompt, prefill_s, prefill_bytes / 1e6, prefill_floor, prefill_floor > 0 ? prefill_s / prefill_floor : 0);
        printf("prefill compute             %.1f tokens/s, %.1f GFLOP; compute floor %.3f s at the FMA probe's\n"
               "                            %.1f GFLOP/s (the better of %.1f before and %.1f after); ratio to\n"
               "                            the larger floor %.2f\n",
               prefill_s > 0 ? nprompt / prefill_s : 0, prefill_flops / 1e9, prefill_compute, fma, fma_first,
               fma_after, prefill_best > 0 ? prefill_s / prefill_best : 0);
        if (prefill_blocks)
            printf("prefill passes              %llu, layer by layer (blocks of up to %d positions)\n",
                   (unsigned long long)prefill_passes, df_engine_prompt_block(e));
        else
            printf("prefill passes              %llu of up to 32 positions\n", (unsigned long long)prefill_passes);
        if (again) {
            printf("prefill again (warm)        %.3f s, %.1f tokens/s (the same prompt in a new session, weights\n"
                   "                            in place; same next token: %s)", again_s, nprompt / again_s,
                   again_same ? "yes" : "NO");
            if (again > 1) {
                printf(";\n                            median of %d runs:", again);
                for (int r = 0; r < again; r++) printf(" %.3f", again_runs[r]);
            }
            printf("\n");
            if (again_dev.calls || again_dev.cpu_calls)
                printf("prefill again on the device %.0f products there, %.0f on the CPU, %.0f routed experts run\n"
                       "                            from device copies, %.0f uploads (per warm prompt)\n",
                       (double)again_dev.calls / again, (double)again_dev.cpu_calls / again,
                       (double)again_dev.tier_hits / again, (double)again_dev.cache_uploads / again);
            if (tc_rate > 0)
                printf("prefill again, tensor cores %.1f TFLOP/s of the device's products (%.1f GFLOP: MXFP4 %.1f,\n"
                       "                            bf16 %.1f, other %.1f); tensor-core probe (bf16, fp32 sums, same\n"
                       "                            run) %.0f TFLOP/s mma.sync, %.0f wgmma: the prompt runs at %.1f%% of\n"
                       "                            the faster counting the model's FLOPs, %.1f%% counting the exact\n"
                       "                            forms' limbs (x as 2 f16 limbs for MXFP4, 3 bf16 for bf16)\n",
                       dev_flops / again_s / 1e12, dev_flops / 1e9, 2 * dev_mx / 1e9, 2 * dev_bf / 1e9,
                       2 * dev_ot / 1e9, tc_sync, tc_wg, 100 * tc_floor / again_s, 100 * tc_limb_floor / again_s);
            if (tc_rate > 0 && hbm > 0)
                printf("prefill again, device reads %.2f GB (each product's weights once, KDA states, MLA cache\n"
                       "                            rows): %.4f s at the read probe's %.0f GB/s, %.1f%% of the prompt;\n"
                       "                            the larger floor (limbs or reads) %.4f s, %.1f%%\n",
                       dev_rd / 1e9, hbm_pfloor, hbm, 100 * hbm_pfloor / again_s, dev_pfloor, 100 * dev_pfloor / again_s);
        }
        printf("decode median               %.4f s/token (%.2f tokens/s)\n", med, med > 0 ? 1 / med : 0);
        printf("spine                       %s\n", df_engine_spine_why(e));
        printf("bytes read per token        %.1f MB (experts %.1f + spine %.1f), hit rate %.1f%% (prefetched\n"
               "                            experts count as reads, not hits)\n",
               mean_bytes / 1e6, (mean_bytes - spine_read_tok) / 1e6, spine_read_tok / 1e6, hit * 100);
        printf("router lookahead            %.1f reads per token, precision %.1f%%, recall %.1f%% (of would-be misses)\n",
               (double)pf / ntok, pf_precision * 100, pf_recall * 100);
        printf("disk floor                  %.4f s/token (every byte read per token, spine included), ratio %.3f\n",
               floor_s, ratio);
        printf("reads hidden under compute  %.0f%% of the %.1f ms the disk needs per token (the token loop waited\n"
               "                            %.1f ms for reads and %.1f ms handing them to the kernel)\n",
               hidden * 100, floor_s * 1e3, wait_tok * 1e3, sub_tok * 1e3);
        printf("memory floor                %.4f s/token (%.2f GB of weights per step at %.1f GB/s DRAM: the\n"
               "                            better of the probes before and after, %.1f and %.1f)\n",
               mem_floor, touched / 1e9, dram, dram_first, dram_after);
        printf("ratio to the larger floor   %.3f\n", best_floor > 0 ? med / best_floor : 0);
        if (copied)
            printf("spine copied                %.2f %s (%lld tensors) out of the page cache%s in %.2f s;\n"
                   "                            %.0f%% of it in 2 MB pages (--spine-copy off: used in place)\n",
                   cp_bytes >= 1e9 ? cp_bytes / 1e9 : cp_bytes / 1e6, cp_bytes >= 1e9 ? "GB" : "MB",
                   (long long)cp_tensors, copied == 2 ? " (still running)" : mo_bench.spine_copy == 2 ? " at open" : "",
                   cp_s, cp_rss > 0 ? 100.0 * (double)cp_2mb / (double)cp_rss : 0);
        if (mapped > 0)
            printf("weights mapped              %.2f GB in memory, %.0f%% of it by 2 MB pages%s\n", mapped / 1e9,
                   100.0 * (double)mapped_2mb / (double)mapped,
                   !copied && mapped_2mb < mapped / 2 ? "\n                            (the page cache holds them in small folios, "
                                             "as writing a file\n                            leaves it: see README, "
                                             "bench/spine_pass.sh)" : "");
        if (ac.calls || ac.resident_mats || ac.cpu_calls) {
            printf("device uploads per token    %.1f MB (decode mean); host-to-device %.1f GB/s page-locked\n"
                   "                            (same run), expert cache %s; upload floor %.4f s/token, ratio %.3f\n",
                   up_tok / 1e6, h2d, ac.pinned_bytes ? "page-locked" : "pageable", h2d_floor,
                   h2d_floor > 0 ? med / h2d_floor : 0);
            printf("device reads per token      %.1f MB (decode mean: weights of the products run there, KDA\n"
                   "                            states, MLA cache rows); device read probe %.1f GB/s (same run);\n"
                   "                            HBM floor %.4f s/token, ratio %.3f\n",
                   dev_tok / 1e6, hbm, hbm_floor, hbm_floor > 0 ? med / hbm_floor : 0);
            printf("device (prefill + decode)   %llu products on the device, %llu on the CPU; %lld matrices\n"
                   "                            resident (%.3f GB), cache %.3f GB: %llu hits, %llu uploads,\n"
                   "                            %llu evictions, %llu transient; %.3f GB weights uploaded;\n"
                   "                            %llu routed experts run from device copies, not read\n",
                   (unsigned long long)ac.calls, (unsigned long long)ac.cpu_calls, (long long)ac.resident_mats,
                   ac.resident_bytes / 1e9, ac.cached_bytes / 1e9, (unsigned long long)ac.cache_hits,
                   (unsigned long long)ac.cache_uploads, (unsigned long long)ac.cache_evictions,
                   (unsigned long long)ac.transient_uploads, ac.upload_bytes / 1e9,
                   (unsigned long long)ac.tier_hits);
            if (mo->bf16_tc_rows > 0)
                printf("bf16 on the tensor cores    products of %d rows or more (--bf16-tc-rows)\n", mo->bf16_tc_rows);
            if (df_engine_spine_streamed(e))
                printf("streamed spine on device    %lld layer groups kept there; %.1f groups per token entered\n"
                       "                            without reading them (every matrix had a device copy)\n",
                       (long long)ac.spine_kept_groups,
                       (double)(ac.spine_groups_on_device - ac0.spine_groups_on_device) / ntok);
            if (ac.spine_pinned_bytes)
                printf("spine page-locked           %.3f GB (it does not fit the device: uploaded per use)\n",
                       ac.spine_pinned_bytes / 1e9);
            printf("host waits on the device    %.1f per token, %.2f ms per token inside them (decode)\n",
                   (double)(ac.sync_calls - ac0.sync_calls) / ntok, (ac.sync_s - ac0.sync_s) / ntok * 1e3);
            if (ac.kda_calls || ac.mla_calls)
                printf("attention on the device     %.1f KDA + %.1f MLA layer steps per token (states there)\n",
                       (double)(ac.kda_calls - ac0.kda_calls) / ntok, (double)(ac.mla_calls - ac0.mla_calls) / ntok);
            if (ac.device_passes > ac0.device_passes)
                printf("activations on the device   %.1f passes per token (residual stream, norms and mixes there;\n"
                       "                            the parts below are host time, and the device's work shows\n"
                       "                            where the host waits for it: the router, the head)\n",
                       (double)(ac.device_passes - ac0.device_passes) / ntok);
        }
        printf("prefill by part (%d tokens, s; the parts' own time, the rest is chunking and logits):\n", nprompt);
        print_parts(pre1);
        if (again) {
            printf("prefill again by part (s, summed over the %d run%s; host time: on the device, the parts\n"
                   "where the host waits for it, or all of them under CUDA_LAUNCH_BLOCKING=1):\n",
                   again, again > 1 ? "s" : "");
            print_parts(again_part);
        }
        if (warmup) printf("decode warm-up               %d tokens before the measured ones (--warmup)\n", warmup);
        printf("time per decode token by part (mean over %d tokens; routed includes waiting for reads;\n"
               "floor: the part's weight bytes per token at the %s rate):\n", ntok,
               parts_on_device ? "device read probe's" : "DRAM probe's");
        double sum = 0;
        for (int i = 0; i < DF_PROF_N; i++) sum += prof1[i] - prof0[i];
        for (int i = 0; i < DF_PROF_N; i++) {
            double ms = (prof1[i] - prof0[i]) / ntok * 1e3;
            printf("  %-22s %8.1f ms  %5.1f%%", df_prof_name(i), ms, sum > 0 ? 100 * (prof1[i] - prof0[i]) / sum : 0);
            if (part_floor[i] * 1e3 >= 0.05)
                printf("   floor %7.1f ms  ratio %5.2f", part_floor[i] * 1e3, ms / (part_floor[i] * 1e3));
            printf("\n");
        }
    }
    if (so && so->on) {
        /* what a verify step costs per row in this regime, and a rewind in
         * each mode: k rows evaluated with logits, then rewound to keep one
         * (medians of 3) — the numbers the adaptive depth learns online */
        float *vrows = malloc((size_t)(DF_SPEC_MAX + 1) * V * sizeof(float));
        df_session *c = NULL;
        int np = nprompt < 8 ? nprompt : 8; /* a short prompt: each repeat goes on one position */
        if (vrows && df_session_new(e, np + 64, &c) == DF_OK && df_session_eval(c, prompt, np, NULL) == DF_OK) {
            static const int ks[] = {1, 2, 4, 8, 16};
            for (int m = 0; m < 2; m++) {
                if (df_session_set_rewind(c, DF_SPEC_MAX + 1, m ? DF_REWIND_REPLAY : DF_REWIND_TRAIL) != DF_OK) break;
                printf("verify cost (%s rewind)  ", m ? "replay" : "trail");
                for (size_t q = 0; q < sizeof ks / sizeof ks[0] && ks[q] <= so->p.depth + 1; q++) {
                    double te[3], tr[3];
                    int32_t t8[DF_SPEC_MAX + 1];
                    for (int i = 0; i < ks[q]; i++) t8[i] = plain[i % (ntok + 1)];
                    for (int rep = 0; rep < 3; rep++) {
                        int at = df_session_pos(c);
                        double ta = cli_now();
                        if (df_session_eval(c, t8, ks[q], vrows) != DF_OK) break;
                        double tb = cli_now();
                        if (df_session_rewind(c, at + 1) != DF_OK) break;
                        te[rep] = tb - ta;
                        tr[rep] = cli_now() - tb;
                    }
                    qsort(te, 3, sizeof(double), cmp_double);
                    qsort(tr, 3, sizeof(double), cmp_double);
                    printf("%s%d rows %.1f ms + rewind %.2f ms", q ? ", " : "", ks[q], te[1] * 1e3, tr[1] * 1e3);
                }
                printf("\n");
            }
        }
        df_session_free(c);
        free(vrows);
        double plain_s = 0;
        for (int i = 0; i < ntok; i++) plain_s += dt[i];
        static const char *const modes[2] = {"trail", "replay"};
        spec_run r[2];
        for (int m = 0; m < 2; m++) {
            if (bench_spec_run(e, so, m == 0 ? DF_REWIND_TRAIL : DF_REWIND_REPLAY, prompt, nprompt, plain, ntok, &r[m]))
                goto done;
            double acc = r[m].st.drafted ? (double)r[m].st.accepted / r[m].st.drafted : 0;
            double rows = r[m].st.steps ? (double)r[m].st.rows / r[m].st.steps : 0;
            double per = r[m].st.steps ? (double)r[m].st.tokens / r[m].st.steps : 0;
            /* both made ntok tokens after the first (which comes from the prompt) */
            double speedup = r[m].s > 0 ? plain_s / r[m].s : 0;
            if (json)
                printf("{\"spec\":\"ngram\",\"rewind\":\"%s\",\"depth\":%d,\"adaptive\":%d,\"acceptance\":%.4f,"
                       "\"rows_per_step\":%.3f,\"tokens_per_step\":%.3f,\"decode_s\":%.4f,\"plain_decode_s\":%.4f,"
                       "\"speedup\":%.3f,\"row1_s\":%.5f,\"per_row_s\":%.5f,\"identical\":%s}\n",
                       modes[m], so->p.depth, so->p.adaptive, acc, rows, per, r[m].s, plain_s, speedup,
                       r[m].st.row1_s, r[m].st.per_row_s,
                       r[m].same ? "true" : "false");
            else
                printf("spec ngram (%s rewind)     %d tokens in %.3f s vs %.3f s without drafts: speedup %.2fx;\n"
                       "                            drafts accepted %llu/%llu (%.1f%%), %.2f rows and %.2f tokens per step,\n"
                       "                            depth %d%s (drafts in the last step %d); measured cost: a 1-row\n"
                       "                            step %.1f ms, +%.1f ms per further row; output %s\n",
                       modes[m], ntok, r[m].s, plain_s, speedup, (unsigned long long)r[m].st.accepted,
                       (unsigned long long)r[m].st.drafted, acc * 100, rows, per, so->p.depth,
                       so->p.adaptive ? " adaptive" : " fixed", r[m].st.depth_now, r[m].st.row1_s * 1e3,
                       r[m].st.per_row_s * 1e3,
                       r[m].same ? "identical to plain greedy" : "DIFFERS from plain greedy (a bug)");
            if (!r[m].same) goto done;
        }
    }
    rc = CLI_OK;
done:
    df_tokens_free(&ptoks);
    if (!prompt_file) free(prompt);
    free(plain);
    df_session_free(s);
    df_engine_close(e);
    free(dt);
    free(bytes);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    int kernels = 0, decode = 0, threads = 0, ntok = 8, nprompt = 8, warmup = 0, json = 0, again = 0;
    const char *prompt_file = NULL;
    cli_spec_opts so;
    cli_spec_opts_init(&so);
    double mb = df_probe_default_mb(), seconds = 1.0, probe_s = 2.0;
    cli_model_opts mo;
    cli_model_opts_init(&mo);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: deltafin bench --kernels [--threads N] [--cpus LIST] [--mb SIZE] [--seconds S]\n"
                   "       deltafin bench --decode --model DIR [--ram SIZE] [--tokens N] [--prompt-tokens N] [--warmup N]\n"
                   "                      [--probe-seconds S] [--json] [model options]\n"
                   "  --kernels     matvec GB/s per weight type on ~SIZE MB matrices (default 512, or\n"
                   "                8x the last-level cache when larger, within 1/32 of RAM),\n"
                   "                with a DRAM read probe measured in the same process, and the\n"
                   "                GFLOP/s of a %d-vector matmul (prefill); --simd picks the level\n"
                   "  --decode      greedy decode of N tokens (default 8) after a prompt (default 8 tokens):\n"
                   "                median s/token of steady tokens, bytes read, hit rate, the disk's O_DIRECT\n"
                   "                bandwidth measured in the same run, floor and ratio; --json prints one object\n"
                   "  --warmup N    N greedy tokens decoded after the prompt and before the measured ones,\n"
                   "                outside every figure (default 0): the steady state, not the first use of\n"
                   "                each expert and buffer\n"
                   "  --prompt-file F  the prompt: F's text through the model's tokenizer (default: N\n"
                   "                pseudo-random ids)\n"
                   "  --prefill-again [N]  after the decode, the prompt N more times (default 1, at most 32),\n"
                   "                each in a new session with the weights in place (caches warm, device\n"
                   "                copies made): the median time and tokens/s apart from the first\n"
                   "                prefill's reads and uploads, each run's time, and on a device what the\n"
                   "                warm prompts ran there\n"
                   "  --spec ngram  then the same decode with drafts, once per rewind mode (trail, replay):\n"
                   "                acceptance, rows and tokens per step, speedup vs the decode without drafts\n"
                   "                (output checked identical); --spec-depth, --spec-fixed as in run\n\n%s",
                   DF_BENCH_GEMM_N, cli_model_opts_help);
            return 0;
        }
        int r = cli_model_opt(&mo, argc, argv, &i);
        if (r < 0) return CLI_USAGE;
        if (r) continue;
        if ((r = cli_spec_opt(&so, argc, argv, &i)) < 0) return CLI_USAGE;
        if (r) continue;
        if (!strcmp(a, "--kernels")) kernels = 1;
        else if (!strcmp(a, "--prompt-file") && i + 1 < argc) prompt_file = argv[++i];
        else if (!strcmp(a, "--decode")) decode = 1;
        else if (!strcmp(a, "--prefill-again")) {
            again = 1;
            if (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9') { /* an optional count */
                char *end;
                long v = strtol(argv[++i], &end, 10);
                if (*end || v < 1 || v > AGAIN_MAX) {
                    fprintf(stderr, "deltafin: bench: --prefill-again takes 1 to %d runs (got '%s')\n", AGAIN_MAX,
                            argv[i]);
                    return CLI_USAGE;
                }
                again = (int)v;
            }
        }
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--mb") && i + 1 < argc) mb = atof(argv[++i]);
        else if (!strcmp(a, "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
        else if (!strcmp(a, "--probe-seconds") && i + 1 < argc) probe_s = atof(argv[++i]);
        else if (!strcmp(a, "--tokens") && i + 1 < argc) ntok = atoi(argv[++i]);
        else if (!strcmp(a, "--prompt-tokens") && i + 1 < argc) nprompt = atoi(argv[++i]);
        else if (!strcmp(a, "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else return cli_usage("bench", "unknown or incomplete option");
    }
    if ((threads = cli_threads(&mo)) < 0) return CLI_USAGE;
    if (kernels) return bench_kernels(threads, mo.ncpus ? mo.cpus : NULL, mo.simd, mb, seconds);
    if (decode) {
        if (!mo.model) return cli_usage("bench", "--decode needs --model");
        if (ntok < 1 || nprompt < 1) return cli_usage("bench", "--tokens and --prompt-tokens must be positive");
        if (warmup < 0) return cli_usage("bench", "--warmup must be 0 or more");
        if (warmup && so.on)
            return cli_usage("bench", "--warmup and --spec: the drafted decode is checked against the plain one "
                                      "from the prompt on; use one of them");
        return bench_decode(&mo, ntok, nprompt, warmup, probe_s, json, &so, prompt_file, again);
    }
    return cli_usage("bench", "say what to measure (--kernels or --decode)");
}
