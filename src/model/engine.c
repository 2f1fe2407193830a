/* engine.c — df_engine and df_session: open a model directory, pick the
 * model program for its architecture, run token chunks through it.
 *
 * Sections: options; engine open/close; describe; parallel matmul helper;
 * sessions; small public helpers.
 */
#include "model.h"
#include "../base/cpus.h"
#include "../base/err.h"
#include "../base/mem.h"
#include "../experts/spine.h"
#include "../experts/store.h"
#include "../spine8/spine8.h"
#include "../format/st_cache.h"
#include "ffn.h"
#include "prompt.h"
#include "resident_copy.h"
#include <fcntl.h>
#include <stdarg.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

static df_status copy_resident_spine(df_engine *e, char *err);

/* ---- options ---- */

void df_engine_opts_default(df_engine_opts *o) {
    memset(o, 0, sizeof *o);
    o->use_mmap = 1;
    o->simd_level = -1;
    o->expert_io = DF_EXPERTS_DIRECT;
    o->prefetch = 1;
    o->io_depth = 32;
}

static int64_t spine_bytes(const df_engine *e);
static void plan_spine_on_device(df_engine *e);

/* The spine's matrices: a converted int8 spine (DIR/int8-spine) joins the
 * shard set as "int8:" tensors when asked for, or found in auto. */
static int not_routed_expert(const st_tensor *t, void *ctx) {
    (void)ctx;
    return !(strstr(t->name, ".experts.") && !strstr(t->name, "shared_experts"));
}

static df_status open_spine_dtype(df_engine *e, const char *dir, const df_engine_opts *o, char *err) {
    const char *stored = "bf16";
    for (int64_t i = 0; i < st_count(e->st); i++) { /* the type of the first layer's matrices */
        const st_tensor *t = st_at(e->st, i);
        if (t->ndim == 2 && strstr(t->name, ".layers.0.") && s8_selected(t->name, t)) {
            stored = dtype_name(t->dtype);
            break;
        }
    }
    snprintf(e->spine_dtype, sizeof e->spine_dtype, "%s", stored);
    for (char *c = e->spine_dtype; *c; c++) *c = (char)(*c >= 'A' && *c <= 'Z' ? *c - 'A' + 'a' : *c);
    if (o->spine_dtype == DF_SPINE_DTYPE_CHECKPOINT) return DF_OK;
    char s8[1100];
    snprintf(s8, sizeof s8, "%s/%s", dir, S8_DIR);
    int absent = 0;
    char why[DF_ERRMSG];
    df_status st = s8_check(e->io, dir, s8, &absent, why);
    if (st != DF_OK) {
        if (absent && o->spine_dtype == DF_SPINE_DTYPE_AUTO) return DF_OK;
        return df_fail(err, st, "%s", why);
    }
    if ((st = st_add_dir(e->st, s8, S8_PREFIX, err)) != DF_OK) return st;
    e->int8 = 1;
    snprintf(e->spine_dtype, sizeof e->spine_dtype, "int8");
    return DF_OK;
}

int model_spine_live(const df_engine *e, const st_tensor *t) {
    size_t pl = strlen(S8_PREFIX);
    if (strncmp(t->name, S8_PREFIX, pl) == 0) return e->int8;
    if (!e->int8) return 1;
    char twin[DF_NAME];
    size_t n = strlen(t->name);
    if (n > 17 && strcmp(t->name + n - 17, ".weight_scale_inv") == 0)
        tname(twin, "%s%.*s.weight", S8_PREFIX, (int)(n - 17), t->name);
    else
        tname(twin, "%s%s", S8_PREFIX, t->name);
    return st_find(e->st, twin) == NULL;
}

static int spine_in_use(const st_tensor *t, void *ctx) {
    return not_routed_expert(t, NULL) && model_spine_live(ctx, t);
}

/* The name a spine matrix binds under: its int8 twin when that is in use. */
static const char *bind_name(const df_engine *e, const char *base, char *buf) {
    if (!e->int8) return base;
    tname(buf, "%s%s.weight", S8_PREFIX, base);
    if (!st_find(e->st, buf)) return base;
    tname(buf, "%s%s", S8_PREFIX, base);
    return buf;
}

/* ---- engine open/close ---- */

static const df_program_ops *program_for(const df_config *c) {
    switch (c->arch) {
    case ARCH_DEEPSEEK_V3: return &dsv3_program;
    case ARCH_KIMI_LINEAR:
    case ARCH_KIMI_K3: return &kimi_program;
    default: return NULL;
    }
}

static void uploads_wait_hook(void *acc) { acc_uploads_wait(acc); }

/* The most experts one pass can use: a chunk's tokens each choose K of a
 * layer's E, so at most min(K x chunk, E); pinning leaves room for two. */
static int pass_experts(const df_config *c) {
    int n = c->num_experts_per_tok * DF_CHUNK;
    return n < c->n_routed_experts ? n : c->n_routed_experts;
}

df_status df_engine_open(const char *dir, const df_engine_opts *opts, df_engine **out,
                         char err[DF_ERRMSG]) {
    *out = NULL;
    if (err) err[0] = 0;
    df_engine_opts def;
    if (!opts) { df_engine_opts_default(&def); opts = &def; }
    df_engine *e = calloc(1, sizeof *e);
    if (!e) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    snprintf(e->dir, sizeof e->dir, "%s", dir);
    e->io = opts->io ? opts->io : df_io_default();
    df_status st = cfg_load(dir, e->io, &e->cfg, err);
    if (st != DF_OK) goto fail;
    e->ops = program_for(&e->cfg);
    if (!e->ops) {
        st = df_fail(err, DF_ERR_UNSUPPORTED,
                     "%s/config.json: model_type '%s' is recognised but its model program is "
                     "not built yet",
                     dir, e->cfg.model_type);
        goto fail;
    }
    st = stc_open(dir, e->io, opts->use_mmap, opts->meta_cache_dir, opts->meta_cache_min_bytes, &e->st,
                  e->meta_note, err);
    if (st != DF_OK) goto fail;
    if ((st = open_spine_dtype(e, dir, opts, err)) != DF_OK) goto fail;
    /* the program copies every small non-expert vector (norms, biases, KDA
     * parameters) at bind: start reading them all now (a hint) */
    st_willneed(e->st, (int64_t)1 << 20, not_routed_expert, NULL);
    /* the mapped spine in 2 MB folios (routed experts are read in pieces;
     * an untied embedding gives the advice back in st_random_rows) */
    st_hugepage(e->st, spine_in_use, e);
    int nt = opts->n_threads;
    if (opts->cpus) { /* pinned threads: one CPU each, all of them the process's */
        char why[DF_ERRMSG / 2];
        if (nt <= 0) { st = df_fail(err, DF_ERR_ARG, "a CPU list needs n_threads: one CPU per thread"); goto fail; }
        if (cpus_check(opts->cpus, nt, why, sizeof why)) { st = df_fail(err, DF_ERR_ARG, "%s", why); goto fail; }
    }
    if (nt <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        nt = n > 0 ? (int)n : 1;
    }
    e->pool = pool_new_on(nt, opts->cpus);
    if (!e->pool) { st = df_fail(err, DF_ERR_NOMEM, "cannot start %d threads", nt); goto fail; }
    e->level = kn_detect();
    /* a level this CPU lacks (avx512 on an AVX2 CPU, neon on x86, amx without AMX) keeps the best */
    if (opts->simd_level >= 0 && opts->simd_level <= KN_AMX && kn_level_available((kn_level)opts->simd_level))
        e->level = (kn_level)opts->simd_level;
    e->opts = *opts;
    e->opts.cpus = NULL; /* borrowed for the pool's start only */
    if (opts->prompt_block < 0 || opts->prompt_block > DF_PROMPT_BLOCK_MAX) {
        st = df_fail(err, DF_ERR_ARG, "prompt block of %d positions: give 1 to %d (0: %d)", opts->prompt_block,
                     DF_PROMPT_BLOCK_MAX, DF_PROMPT_BLOCK);
        goto fail;
    }
    if (opts->accel && !(e->acc = acc_new(opts->accel))) {
        st = df_fail(err, DF_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (!e->opts.prompt_block) e->opts.prompt_block = DF_PROMPT_BLOCK;
    /* The memory plan (plan.c): the spine resident when it fits beside the
     * expert cache in the budget, else streamed per layer; decided before
     * the program binds, the cache sized after. */
    e->spine_group = -1;
    if ((st = plan_decide(e, err)) != DF_OK) goto fail;
    int stream = e->plan.stream;
    if (stream && (st = sp_new(e->io, e->st, e->cfg.num_hidden_layers + 1, opts->expert_io != DF_EXPERTS_PREAD,
                               opts->plan_only, &e->spine, err)) != DF_OK)
        goto fail;
    if (opts->expert_io != DF_EXPERTS_MMAP && e->cfg.n_routed_experts > 0) {
        xs_opts xo = {0};
        xo.ram_bytes = e->plan.cache;
        xo.direct = opts->expert_io == DF_EXPERTS_DIRECT;
        xo.reader = XR_AUTO;
        xo.depth = opts->io_depth > 0 ? opts->io_depth : 32;
        xo.io_threads = 8;
        xo.plan_only = opts->plan_only;
        xo.evict = opts->evict_heat ? XS_EVICT_HEAT : XS_EVICT_LRU;
        xo.prefetch_min_precision = XS_PF_MIN_PRECISION;
        st = xs_new(e->io, e->st, e->cfg.num_hidden_layers, e->cfg.n_routed_experts, &xo, &e->store, err);
        if (st != DF_OK) goto fail;
    }
    st = e->ops->open(e, &e->prog, err);
    if (st != DF_OK) goto fail;
    e->spine_group = -1;
    e->spine_cur = -1;
    if (e->spine && (st = sp_finalize(e->spine, err)) != DF_OK) goto fail;
    if (e->store) xs_set_budget(e->store, plan_expert_cache(e));
    if (e->store && (st = xs_finalize(e->store, err)) != DF_OK) goto fail;
    /* uploads of routed experts come from the cache slots: page-locked, they
     * go at the DMA rate (best effort: pageable uploads give the same results) */
    /* a spine that does not fit the device is uploaded again and again:
     * from page-locked memory (its streaming buffers, or its mapped bytes) */
    if (e->acc && e->spine) plan_spine_on_device(e);
    if (e->acc && !opts->plan_only) {
        if (e->spine)
            for (int k = 0; k < 2; k++) acc_pin_range(e->acc, sp_slot(e->spine, k), sp_slot_bytes(e->spine));
        else
            acc_pin_spine(e->acc);
    }
    if (e->store && e->acc) {
        acc_pin_host(e->acc, xs_pool(e->store), xs_pool_bytes(e->store));
        /* uploads run behind the calls that start them: a slot is reused
         * only once none still reads it */
        xs_set_reuse_hook(e->store, uploads_wait_hook, e->acc);
    }
    if (e->store && opts->heat_path && (st = xs_heat_load(e->store, opts->heat_path, err)) != DF_OK) goto fail;
    if (e->store && !opts->plan_only && opts->pin_bytes > 0 &&
        (st = xs_pin_hottest(e->store, opts->pin_bytes, pass_experts(&e->cfg), err)) != DF_OK)
        goto fail;
    if ((st = copy_resident_spine(e, err)) != DF_OK) goto fail;
    if (opts->top_k > 0 && opts->top_k < e->cfg.num_experts_per_tok)
        snprintf(e->lossy, sizeof e->lossy, "LOSSY top-k %d of %d", opts->top_k, e->cfg.num_experts_per_tok);
    if (e->int8) {
        size_t u = strlen(e->lossy);
        snprintf(e->lossy + u, sizeof e->lossy - u, "%sint8 spine", u ? ", " : "LOSSY ");
    }
    *out = e;
    return DF_OK;
fail:
    df_engine_close(e);
    return st;
}

void df_engine_close(df_engine *e) {
    if (!e) return;
    if (e->prog && e->ops) e->ops->close(e->prog);
    rcopy_free(e->rcopy);
    free(e->copy_views);
    free(e->res_views);
    acc_free(e->acc);
    if (e->store && e->opts.heat_path) {
        char err[DF_ERRMSG];
        df_engine_save_heat(e, err); /* best effort at close; df_engine_save_heat reports errors */
    }
    xs_free(e->store);
    sp_free(e->spine);
    pool_free(e->pool);
    st_close(e->st);
    free(e->describe_text);
    free(e->batch_logits);
    free((void *)e->embed_hinted);
    prompt_ws_free(e);
    kn_px_buf_free(&e->px);
    free(e);
}

int df_engine_vocab_size(const df_engine *e) { return e->cfg.vocab_size; }
int df_engine_max_context(const df_engine *e) { return e->cfg.max_position_embeddings; }
int df_engine_n_threads(const df_engine *e) { return pool_size(e->pool); }
int df_engine_prompt_block(const df_engine *e) { return e->opts.prompt_block; }

/* ---- describe ---- */

const char *df_engine_describe(df_engine *e) {
    size_t cap = 8192;
    free(e->describe_text);
    e->describe_text = malloc(cap);
    if (!e->describe_text) return "";
    char *b = e->describe_text;
    const df_config *c = &e->cfg;
    int n = snprintf(b, cap,
                     "model          %s\n"
                     "architecture   %s (model_type %s%s)\n"
                     "layers         %d (hidden %d, heads %d, vocab %d)\n"
                     "tensors        %lld in %d shard%s, %.3f GB\n"
                     "threads        %d, kernels %s\n",
                     e->dir,
                     c->arch == ARCH_KIMI_K3 ? "kimi_k3" : c->arch == ARCH_KIMI_LINEAR ? "kimi_linear" : "deepseek_v3",
                     c->model_type,
                     c->nested_text_config ? ", nested text_config" : "", c->num_hidden_layers,
                     c->hidden_size, c->num_attention_heads, c->vocab_size,
                     (long long)st_count(e->st), st_n_shards(e->st),
                     st_n_shards(e->st) == 1 ? "" : "s", (double)st_total_bytes(e->st) / 1e9,
                     pool_size(e->pool), kn_level_name(e->level));
    if (n < 0 || (size_t)n >= cap) return b;
    e->ops->describe(e, b + n, cap - (size_t)n);
    size_t used = strlen(b);
    if (e->store) {
        xs_stats x;
        xs_get_stats(e->store, &x);
        snprintf(b + used, cap - used,
                 "expert cache   %d slots x %.2f MB = %.3f GB (%s reads, %d in flight, prefetch %s)%s\n",
                 x.slots, x.slot_bytes / 1e6, xs_pool_bytes(e->store) / 1e9,
                 e->opts.expert_io == DF_EXPERTS_DIRECT ? (DF_HAVE_O_DIRECT ? "O_DIRECT" : "nocache") : "buffered", e->opts.io_depth,
                 e->opts.prefetch ? "on" : "off", *e->lossy ? "" : "");
    } else {
        snprintf(b + used, cap - used, "expert cache   none: experts are used in place through mmap\n");
    }
    used = strlen(b);
    if (e->spine) {
        df_accel_stats as;
        acc_get_stats(e->acc, &as);
        snprintf(b + used, cap - used, "spine          %.3f GB %s; 2 x %.3f GB buffers\n", spine_bytes(e) / 1e9,
                 e->plan.why, sp_slot_bytes(e->spine) / 1e9);
        used = strlen(b);
        if (e->acc)
            snprintf(b + used, cap - used,
                     "               %lld of its %d layer groups kept on the device (never read again once\n"
                     "               uploaded); any group whose matrices all have device copies is not read\n",
                     (long long)as.spine_kept_groups, sp_n_groups(e->spine));
    }
    else
        snprintf(b + used, cap - used, "spine          %.3f GB %s\n", spine_bytes(e) / 1e9, e->plan.why);
    used = strlen(b);
    if (e->rcopy) {
        rcopy_stats r;
        rcopy_get_stats(e->rcopy, &r);
        if (!r.done)
            snprintf(b + used, cap - used,
                     "               %.3f GB of it being copied out of the page cache behind the first steps "
                     "(--map-spine: used in place)\n", r.bytes / 1e9);
        else
            snprintf(b + used, cap - used,
                     "               %.3f GB of it copied out of the page cache in %.2f s (--map-spine: used "
                     "in place)\n", r.bytes / 1e9, r.seconds);
        used = strlen(b);
    }
    plan_describe(e, b + used, cap - used);
    used = strlen(b);
    if (e->acc)
        acc_describe(e->acc, b + used, cap - used, e->store ? xs_expert_bytes(e->store) : 0,
                     e->store ? xs_registered(e->store) : 0);
    else if (e->opts.accel)
        snprintf(b + used, cap - used, "device         %s (budget %.3f GB): matrices go to it on first use\n",
                 e->opts.accel->name ? e->opts.accel->name : "accelerator", e->opts.accel->budget / 1e9);
    else
        snprintf(b + used, cap - used, "device         cpu\n");
    used = strlen(b);
    if (*e->lossy) snprintf(b + used, cap - used, "lossy          %s\n", e->lossy);
    return b;
}

/* ---- names ---- */

void tname(char *out, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, DF_NAME, fmt, ap);
    va_end(ap);
}

/* ---- binding helpers ---- */

df_status model_bind(df_engine *e, const char *base, int64_t rows, int64_t cols, df_weight *w, char *err) {
    if (!e->spine || e->spine_group < 0) return model_bind_resident(e, base, rows, cols, w, err);
    char buf[DF_NAME];
    base = bind_name(e, base, buf);
    df_status st = wt_bind_lazy(e->st, base, rows, cols, e->cfg.fp8_block_rows, e->cfg.fp8_block_cols, w, err);
    return st != DF_OK ? st : sp_register(e->spine, e->spine_group, w, err);
}

/* Remembers a resident view for the copy at open (copy_resident_spine). */
static df_status note_resident(df_engine *e, df_weight *w, char *err) {
    if (e->n_res_views == e->cap_res_views) {
        int cap = e->cap_res_views ? e->cap_res_views * 2 : 256;
        df_weight **v = realloc(e->res_views, (size_t)cap * sizeof *v);
        if (!v) return df_fail(err, DF_ERR_NOMEM, "out of memory");
        e->res_views = v;
        e->cap_res_views = cap;
    }
    e->res_views[e->n_res_views++] = w;
    return DF_OK;
}

df_status model_bind_resident(df_engine *e, const char *base, int64_t rows, int64_t cols, df_weight *w,
                              char *err) {
    char buf[DF_NAME];
    base = bind_name(e, base, buf);
    df_status st = wt_bind(e->st, base, rows, cols, e->cfg.fp8_block_rows, e->cfg.fp8_block_cols, w, err);
    if (st != DF_OK) return st;
    e->resident_bound += wt_bytes(w);
    if (e->acc) acc_bind(e->acc, w);
    return note_resident(e, w, err);
}

static df_status settle_copy(df_engine *e, int wait, char *err);

/* The resident spine out of the page cache (resident_copy.h), once every
 * program bound its views: not with a device (its copies serve the
 * products; the host bytes only feed uploads), not the paged embedding
 * (read a row at a time), not with --map-spine. By default a thread of its
 * own copies at idle priority and settle_copy moves the views between
 * steps once it is done, so neither the open nor the steps wait for it
 * (copied at open, the 1.2 GB of a streamed K3's routers had added 1.8-3.8
 * s to a 1.8 s open on a 2-vCPU VM); spine_copy_at_open copies on the pool
 * and waits. Out of memory for the copy keeps the views where they are
 * (same output, slower). */
static df_status copy_resident_spine(df_engine *e, char *err) {
    if (e->acc || e->opts.plan_only || e->opts.map_spine || !e->n_res_views) return DF_OK;
    df_weight **v = malloc((size_t)e->n_res_views * sizeof *v);
    if (!v) return DF_OK;
    int n = 0;
    for (int i = 0; i < e->n_res_views; i++)
        if (!e->paged_embed || e->res_views[i]->t_data != e->paged_embed) v[n++] = e->res_views[i];
    char why[DF_ERRMSG];
    df_status st = rcopy_start(e->st, v, n, e->opts.spine_copy_at_open ? e->pool : NULL, &e->rcopy, why);
    if (st != DF_OK || !e->rcopy) {
        free(v);
        return DF_OK;
    }
    e->copy_views = v;
    e->n_copy_views = n;
    return e->opts.spine_copy_at_open ? settle_copy(e, 1, err) : DF_OK;
}

/* Between steps: a finished copy (or, with wait, a running one once it
 * finishes) moves the views into it. A read that failed leaves them on the
 * mapping, which serves the same bytes (no output changes, only the copy's
 * speed is lost): the reason is kept for df_engine_spine_copy_error, and
 * returned (DF_ERR_IO) only to a caller that waits. */
static df_status settle_copy(df_engine *e, int wait, char *err) {
    if (!e->copy_views || (!wait && !rcopy_done(e->rcopy))) return DF_OK;
    char why[DF_ERRMSG];
    df_status st = rcopy_finish(e->rcopy, e->copy_views, e->n_copy_views, why);
    free(e->copy_views);
    e->copy_views = NULL;
    e->n_copy_views = 0;
    if (st == DF_OK) return DF_OK;
    rcopy_free(e->rcopy);
    e->rcopy = NULL;
    df_fail(e->copy_error, st, "copying the resident spine into memory: %s (%sthe checkpoint's file changed or its "
            "disk failed since open: check it)", why, e->opts.spine_copy_at_open ? "" : "the steps read it from the "
            "page cache; ");
    return wait ? df_fail(err, st, "%s", e->copy_error) : DF_OK;
}

const char *df_engine_spine_copy_error(const df_engine *e) { return e->copy_error; }

df_status df_engine_spine_copy_wait(df_engine *e, char err[DF_ERRMSG]) { return settle_copy(e, 1, err); }

/* A streamed group whose every matrix has a device copy is entered without
 * reading it (its cached copies held until the next group); a product of
 * it that then fails on the device reads it after all (model_host). */
df_status model_enter(df_engine *e, int group, char *err) {
    if (!e->spine) return DF_OK;
    double t = prof_now(e);
    df_weight *const *v = NULL;
    int nv = sp_views(e->spine, group, &v);
    df_status st = DF_OK;
    e->spine_cur = group;
    if (e->acc && acc_hold(e->acc, v, nv)) sp_skip(e->spine, group);
    else st = sp_enter(e->spine, group, err);
    prof_add(e, DF_PROF_SPINE_WAIT, &t);
    return st;
}

int model_host(df_engine *e, const df_weight *w) {
    if (w->data) return 1;
    if (!e->spine || e->spine_cur < 0 || e->spine_fault) return 0;
    double t = prof_now(e);
    df_status st = sp_enter(e->spine, e->spine_cur, e->spine_fault_msg);
    prof_add(e, DF_PROF_SPINE_WAIT, &t);
    if (st != DF_OK) e->spine_fault = st;
    return st == DF_OK && w->data;
}

/* sp_set_needs_hook: a group needs its bytes unless the device holds it. */
static int spine_needs_read(void *ctx, int group) {
    df_engine *e = ctx;
    df_weight *const *v = NULL;
    int nv = sp_views(e->spine, group, &v);
    return !acc_views_on_device(e->acc, v, nv);
}

/* Plans the streamed spine's device copies: whole layer groups, in order,
 * stay on the device while they fit beside the matrices bound resident
 * and one token's experts of one layer (expert copies take the rest). */
static void plan_spine_on_device(df_engine *e) {
    int64_t reserve = 0;
    if (e->store) reserve = (int64_t)e->cfg.num_experts_per_tok * xs_expert_bytes(e->store);
    for (int g = 0; g < sp_n_groups(e->spine); g++) {
        df_weight *const *v = NULL;
        int nv = sp_views(e->spine, g, &v);
        acc_keep_group(e->acc, v, nv, reserve);
    }
    sp_set_needs_hook(e->spine, spine_needs_read, e);
}

/* Bytes of the non-expert weights (what a resident spine keeps mapped). */
static int64_t spine_bytes(const df_engine *e) {
    int64_t n = 0;
    for (int64_t i = 0; i < st_count(e->st); i++) {
        const st_tensor *t = st_at(e->st, i);
        if (!(strstr(t->name, ".experts.") && !strstr(t->name, "shared_experts")) && model_spine_live(e, t))
            n += t->nbytes;
    }
    return n;
}

df_status model_bind_at(df_engine *e, const char *base, const char *leaf, int64_t rows, int64_t cols,
                        df_weight *w, char *err) {
    char name[DF_NAME];
    tname(name, "%s%s", base, leaf);
    return model_bind(e, name, rows, cols, w, err);
}

static float *load_values(df_engine *e, const char *name, int64_t n, int flat, df_status *st, char *err) {
    float *v = malloc((size_t)n * sizeof(float));
    if (!v) { *st = df_fail(err, DF_ERR_NOMEM, "out of memory"); return NULL; }
    e->resident_bound += n * (int64_t)sizeof(float);
    *st = flat ? wt_load_flat(e->st, name, n, v, err) : wt_load_vec(e->st, name, n, v, err);
    if (*st != DF_OK) { free(v); return NULL; }
    return v;
}

float *model_vec(df_engine *e, const char *name, int64_t n, df_status *st, char *err) {
    return load_values(e, name, n, 0, st, err);
}

float *model_vec_flat(df_engine *e, const char *name, int64_t n, df_status *st, char *err) {
    return load_values(e, name, n, 1, st, err);
}

df_status model_bind_ends(df_engine *e, df_weight *embed, df_weight *head, float **final_norm, char *err) {
    const df_config *c = &e->cfg;
    char name[DF_NAME];
    df_status st;
    tname(name, "%sembed_tokens", c->prefix);
    if ((st = model_bind(e, name, c->vocab_size, c->hidden_size, embed, err))) return st;
    /* read a row at a time at random, unless it is the head too (read whole) */
    e->embed_paged = !c->tie_word_embeddings && st_random_rows(e->st, embed->t_data);
    if (e->embed_paged) {
        e->paged_embed = embed->t_data;
        e->embed_hinted = calloc((size_t)c->vocab_size, 1); /* NULL: every row hinted, as before */
    }
    if (c->tie_word_embeddings) {
        *head = *embed; /* resident like the embedding: the copy at open repoints both */
        if ((st = note_resident(e, head, err))) return st;
    }
    else {
        tname(name, "%s", c->lm_head);
        size_t n = strlen(name);
        if (n > 7 && strcmp(name + n - 7, ".weight") == 0) name[n - 7] = 0;
        e->spine_group = c->num_hidden_layers; /* the head is the last streamed group */
        st = model_bind(e, name, c->vocab_size, c->hidden_size, head, err);
        e->spine_group = -1;
        if (st) return st;
    }
    tname(name, "%snorm.weight", c->prefix);
    *final_norm = model_vec(e, name, c->hidden_size, &st, err);
    return *final_norm ? DF_OK : st;
}

df_status model_find_prefix(df_engine *e, char *err) {
    df_config *c = &e->cfg;
    static const char *cands[] = {"model.", "language_model.model."};
    char name[DF_NAME];
    tname(name, "%sembed_tokens.weight", c->prefix);
    if (st_find(e->st, name)) return DF_OK;
    for (size_t i = 0; i < sizeof cands / sizeof cands[0]; i++) {
        tname(name, "%sembed_tokens.weight", cands[i]);
        if (st_find(e->st, name)) {
            snprintf(c->prefix, sizeof c->prefix, "%s", cands[i]);
            snprintf(c->lm_head, sizeof c->lm_head, "%slm_head.weight",
                     strcmp(cands[i], "model.") == 0 ? "" : "language_model.");
            return DF_OK;
        }
    }
    return df_fail(err, DF_ERR_MISMATCH,
                   "%s: tensor '%sembed_tokens.weight' not found (looked for prefixes 'model.' "
                   "and 'language_model.model.')",
                   e->dir, c->prefix);
}

/* ---- parallel matmul helper ---- */

/* Whether the CPU kernels must compute the product: not when the accelerator
 * did, nor when the weight has no host bytes (then the step fails in
 * df_session_eval, and Y is zeros). */
static int cpu_computes(df_engine *e, const df_weight *w, const float *X, int n, float *Y, int64_t ldy) {
    if (e->acc && acc_mm(e->acc, w, X, n, Y, ldy)) return 0;
    if (model_host(e, w)) return 1;
    for (int i = 0; i < n; i++) memset(Y + (size_t)i * ldy, 0, (size_t)w->rows * sizeof(float));
    return 0;
}

void mm(df_engine *e, const df_weight *w, const float *X, int n, float *Y, int64_t ldy) {
    /* x packed or prepared once for all threads (kernels.h) */
    if (cpu_computes(e, w, X, n, Y, ldy)) kn_matmul_pool_kept(e->pool, e->level, w, X, n, Y, ldy, w->rows, &e->px);
}

void mm_host_many(df_engine *e, const mm_req *r, int count) {
    kn_mm_item it[KN_POOL_MANY];
    int k = 0;
    for (int i = 0; i < count; i++) {
        if (!cpu_computes(e, r[i].w, r[i].X, r[i].n, r[i].Y, r[i].ldy)) continue;
        if (k == KN_POOL_MANY) {
            kn_matmul_pool_many_kept(e->pool, e->level, it, k, &e->px);
            k = 0;
        }
        it[k++] = r[i];
    }
    if (k) kn_matmul_pool_many_kept(e->pool, e->level, it, k, &e->px);
}

/* ---- sessions ---- */

df_status df_session_new(df_engine *e, int max_ctx, df_session **out) {
    *out = NULL;
    if (e->opts.plan_only) return DF_ERR_ARG; /* opened to describe only */
    if (max_ctx <= 0) max_ctx = e->cfg.max_position_embeddings < 4096 ? e->cfg.max_position_embeddings : 4096;
    if (max_ctx > e->cfg.max_position_embeddings) max_ctx = e->cfg.max_position_embeddings;
    df_session *s = calloc(1, sizeof *s);
    if (!s) return DF_ERR_NOMEM;
    s->e = e;
    s->max_ctx = max_ctx;
    s->logits = calloc((size_t)e->cfg.vocab_size, sizeof(float));
    if (!s->logits || e->ops->state_new(e, max_ctx, &s->state) != DF_OK) {
        df_session_free(s);
        return DF_ERR_NOMEM;
    }
    *out = s;
    return DF_OK;
}

void df_session_free(df_session *s) {
    if (!s) return;
    if (s->state) s->e->ops->state_free(s->state);
    free(s->logits);
    free(s->rw_tokens);
    free(s);
}

void df_session_reset(df_session *s) {
    s->pos = 0;
    s->rw_n = 0;
    if (s->e->ops->state_reset) s->e->ops->state_reset(s->e, s->state);
}
int df_session_pos(const df_session *s) { return s->pos; }
const char *df_session_error(const df_session *s) { return s->err; }
const float *df_session_logits(const df_session *s) { return s->logits; }

/* Whether a prompt may run layer by layer (forward_prompt): on the CPU
 * path, and with an accelerator where the program takes it (its device
 * pass over blocks of rows; else DF_CHUNK-row passes). A store pass may
 * then ask for more experts than the cache has slots: it reads the rest as
 * the experts it handed out are done (xs_begin), as chunked passes already
 * do when K x DF_CHUNK exceeds the slots. */
static int layer_major_prompt(const df_engine *e, void *state) {
    if (!e->ops->forward_prompt || e->opts.prompt_chunks) return 0;
    if (!e->acc) return 1;
    return e->ops->prompt_takes && e->ops->prompt_takes((df_engine *)e, state);
}

/* A forward's status as df_session_eval returns it: a failed spine read
 * (model_host) is an error; on an error the session, whose recurrent state
 * is half-updated, starts over, and err says so. */
static df_status eval_status(df_session *s, df_status st, int pos) {
    df_engine *e = s->e;
    if (e->spine_fault) { /* a spine read after a device failure failed (model_host) */
        if (st == DF_OK) st = df_fail(s->err, e->spine_fault, "%s", e->spine_fault_msg);
        e->spine_fault = 0;
    }
    if (st != DF_OK) {
        if (!s->err[0]) df_fail(s->err, st, "forward pass failed at position %d", pos);
        if (e->ops->state_reset) {
            e->ops->state_reset(e, s->state);
            s->pos = 0;
            size_t n2 = strlen(s->err);
            snprintf(s->err + n2, sizeof s->err - n2, " (the session was reset: evaluate the prompt again)");
        }
    }
    return st;
}

static df_status session_eval_run(df_session *s, const int32_t *tokens, int n, float *logits);

/* A running copy waits while the engine evaluates (resident_copy.h). */
static void copy_pause(df_engine *e, int paused) {
    if (e->copy_views) rcopy_pause(e->rcopy, paused);
}

df_status df_session_eval(df_session *s, const int32_t *tokens, int n, float *logits) {
    df_engine *e = s->e;
    int V = e->cfg.vocab_size;
    s->err[0] = 0;
    if (n <= 0) return df_fail(s->err, DF_ERR_ARG, "no tokens to evaluate");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return df_fail(s->err, DF_ERR_ARG, "token %d at index %d is outside the vocabulary [0, %d)",
                           tokens[i], i, V);
    if (s->pos + n > s->max_ctx)
        return df_fail(s->err, DF_ERR_CONTEXT,
                       "context full: %d positions used + %d new > limit %d", s->pos, n, s->max_ctx);
    if (e->store) {
        df_status cst = xs_check_files(e->store, s->err);
        if (cst != DF_OK) return cst;
    }
    df_status cst = settle_copy(e, 0, s->err);
    if (cst != DF_OK) return cst;
    copy_pause(e, 1);
    cst = session_eval_run(s, tokens, n, logits);
    copy_pause(e, 0);
    return cst;
}

/* df_session_eval's work once its arguments were checked. */
static df_status session_eval_run(df_session *s, const int32_t *tokens, int n, float *logits) {
    df_engine *e = s->e;
    const int V = e->cfg.vocab_size;
    int pos = s->pos;
    uint64_t passes = (uint64_t)((n + DF_CHUNK - 1) / DF_CHUNK);
    if (n > DF_CHUNK && layer_major_prompt(e, s->state)) {
        df_status st = eval_status(
            s, e->ops->forward_prompt(e, s->state, pos, tokens, n, logits ? logits : s->logits, logits != NULL, s->err),
            pos);
        if (st != DF_OK) return st;
        passes = (uint64_t)((n + e->opts.prompt_block - 1) / e->opts.prompt_block);
        e->bstats.prompt_blocks += passes;
    } else {
        for (int i = 0; i < n; i += DF_CHUNK) {
            int m = n - i < DF_CHUNK ? n - i : DF_CHUNK;
            int last_chunk = i + m == n;
            float *out = logits ? logits + (size_t)i * V : s->logits;
            if (!logits && !last_chunk) out = NULL;
            df_status st = eval_status(
                s, e->ops->forward(e, s->state, pos + i, tokens + i, m, out, logits != NULL, s->err), pos + i);
            if (st != DF_OK) return st;
        }
    }
    if (logits) memcpy(s->logits, logits + (size_t)(n - 1) * V, (size_t)V * sizeof(float));
    s->pos = pos + n;
    s->rw_n = 0;
    e->bstats.passes += passes;
    e->bstats.rows += (uint64_t)n;
    if (s->rw_depth && n <= s->rw_depth) { /* the program kept what a rewind inside it needs */
        memmove(s->rw_tokens, tokens, (size_t)n * sizeof *tokens);
        s->rw_start = pos;
        s->rw_n = n;
    }
    if (e->store) xs_tick(e->store, n);
    return DF_OK;
}

/* ---- embedding rows ---- */

typedef struct {
    const df_weight *embed;
    const int32_t *tokens;
    float *out;
} embed_job;

static void embed_rows(void *ctx, int64_t t0, int64_t t1, int tid) {
    (void)tid;
    const embed_job *j = ctx;
    for (int64_t t = t0; t < t1; t++) kn_dequant_row(j->embed, j->tokens[t], j->out + (size_t)t * j->embed->cols);
}

void model_embed_tokens(df_engine *e, const df_weight *embed, const int32_t *tokens, int n, float *out) {
    /* a mapped embedding's rows requested together before any is touched:
     * one read each, all in flight, instead of a fault per page; a row
     * once (its pages stay mapped: hinting it again is a system call for
     * nothing, ~1 us, 0.6 ms a 512-token prompt on one thread; a row whose
     * pages the kernel reclaimed later faults back in page by page) */
    if (e->embed_paged && embed->data) {
        const int64_t rb = wt_data_row_bytes(embed);
        for (int t = 0; t < n && rb > 0; t++)
            if (tokens[t] >= 0 && tokens[t] < embed->rows &&
                !(e->embed_hinted && tokens[t] < e->cfg.vocab_size &&
                  atomic_exchange_explicit(&e->embed_hinted[tokens[t]], 1, memory_order_relaxed)))
                st_rows_willneed((const char *)embed->data + tokens[t] * rb, rb);
    }
    embed_job j = {embed, tokens, out};
    pool_for(e->pool, n, 16, embed_rows, &j); /* a prompt's rows over the pool; a step's on this thread */
}

/* ---- batched steps ---- */

float *model_batch_logits(df_engine *e) {
    if (!e->batch_logits) e->batch_logits = malloc((size_t)DF_CHUNK * e->cfg.vocab_size * sizeof(float));
    return e->batch_logits;
}

df_status model_batch_head(df_engine *e, int L, const df_weight *head, const float *xn, int rows,
                           const df_fwd_seg *seg, int nseg, char *err) {
    if (!rows) return DF_OK;
    int V = e->cfg.vocab_size;
    df_status hst = model_enter(e, L, err);
    if (hst != DF_OK) return hst;
    double pt = prof_now(e);
    if (nseg == 1) {
        mm(e, head, xn, rows, seg[0].out, V);
    } else {
        float *lg = model_batch_logits(e);
        if (!lg) return df_fail(err, DF_ERR_NOMEM, "out of memory");
        mm(e, head, xn, rows, lg, V);
        model_batch_scatter(seg, nseg, lg, V);
    }
    prof_add(e, DF_PROF_HEAD, &pt);
    return DF_OK;
}

void model_batch_scatter(const df_fwd_seg *seg, int nseg, const float *lg, int V) {
    for (int i = 0, r = 0; i < nseg; i++) {
        if (!seg[i].out) continue;
        int k = seg[i].all_rows ? seg[i].n : 1;
        memcpy(seg[i].out, lg + (size_t)r * V, (size_t)k * V * sizeof(float));
        r += k;
    }
}

void df_engine_batch_stats(const df_engine *e, df_batch_stats *out) { *out = e->bstats; }

static df_status check_item(df_session *s, const int32_t *tokens, int n) {
    int V = s->e->cfg.vocab_size;
    s->err[0] = 0;
    if (n <= 0) return df_fail(s->err, DF_ERR_ARG, "no tokens to evaluate");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return df_fail(s->err, DF_ERR_ARG, "token %d at index %d is outside the vocabulary [0, %d)", tokens[i], i, V);
    if (s->pos + n > s->max_ctx)
        return df_fail(s->err, DF_ERR_CONTEXT, "context full: %d positions used + %d new > limit %d", s->pos, n,
                       s->max_ctx);
    return DF_OK;
}

static df_status batch_eval_run(df_batch_item *it, int count);

df_status df_session_eval_batch(df_batch_item *it, int count) {
    if (count <= 0) return DF_ERR_ARG;
    if (count == 1) return df_session_eval(it[0].s, it[0].tokens, it[0].n, it[0].logits);
    df_engine *e = it[0].s->e;
    for (int i = 0; i < count; i++) {
        if (it[i].s->e != e) return df_fail(it[i].s->err, DF_ERR_ARG, "a batch mixes sessions of two engines");
        for (int j = 0; j < i; j++)
            if (it[j].s == it[i].s) return df_fail(it[i].s->err, DF_ERR_ARG, "a session appears twice in one batch");
        df_status st = check_item(it[i].s, it[i].tokens, it[i].n);
        if (st != DF_OK) return st;
    }
    if (!e->ops->forward_batch) { /* one by one: the same results, no shared reads */
        for (int i = 0; i < count; i++) {
            df_status st = df_session_eval(it[i].s, it[i].tokens, it[i].n, it[i].logits);
            if (st != DF_OK) return st;
        }
        return DF_OK;
    }
    if (e->store) {
        df_status cst = xs_check_files(e->store, it[0].s->err);
        if (cst != DF_OK) return cst;
    }
    df_status cst = settle_copy(e, 0, it[0].s->err);
    if (cst != DF_OK) return cst;
    copy_pause(e, 1);
    cst = batch_eval_run(it, count);
    copy_pause(e, 0);
    return cst;
}

/* df_session_eval_batch's passes once its items were checked. */
static df_status batch_eval_run(df_batch_item *it, int count) {
    df_engine *e = it[0].s->e;
    const int V = e->cfg.vocab_size;
    int done[count], pieces[count], total = 0;
    memset(done, 0, sizeof done);
    memset(pieces, 0, sizeof pieces);
    df_fwd_seg seg[DF_CHUNK];
    for (;;) {
        int nseg = 0, used = 0;
        for (int i = 0; i < count && used < DF_CHUNK; i++) {
            int rem = it[i].n - done[i];
            if (rem <= 0) continue;
            /* an item that fits one pass is not split (its rewind data stays whole): it waits for the next */
            if (rem <= DF_CHUNK && rem > DF_CHUNK - used) continue;
            int take = rem < DF_CHUNK - used ? rem : DF_CHUNK - used;
            df_session *s = it[i].s;
            float *out = it[i].logits ? it[i].logits + (size_t)done[i] * V : done[i] + take == it[i].n ? s->logits : NULL;
            seg[nseg++] = (df_fwd_seg){s->state, s->pos + done[i], it[i].tokens + done[i], take, out, it[i].logits != NULL};
            pieces[i]++;
            done[i] += take;
            used += take;
        }
        if (!nseg) break;
        df_session *s0 = it[0].s;
        df_status st = e->ops->forward_batch(e, seg, nseg, s0->err);
        if (st != DF_OK) {
            char why[DF_ERRMSG];
            snprintf(why, sizeof why, "%s", s0->err[0] ? s0->err : "a batched forward pass failed");
            for (int i = 0; i < count; i++) { /* recurrent states are half-updated: start over */
                df_session *s = it[i].s;
                if (e->ops->state_reset) e->ops->state_reset(e, s->state);
                s->pos = 0;
                s->rw_n = 0;
                snprintf(s->err, sizeof s->err, "%.900s (the session was reset: evaluate the prompt again)", why);
            }
            return st;
        }
        e->bstats.passes++;
        e->bstats.multi_passes += nseg > 1;
        e->bstats.rows += (uint64_t)used;
        total += used;
    }
    for (int i = 0; i < count; i++) {
        df_session *s = it[i].s;
        int n = it[i].n;
        if (it[i].logits) memcpy(s->logits, it[i].logits + (size_t)(n - 1) * V, (size_t)V * sizeof(float));
        s->rw_n = 0;
        if (s->rw_depth && n <= s->rw_depth && pieces[i] == 1) {
            memmove(s->rw_tokens, it[i].tokens, (size_t)n * sizeof *it[i].tokens);
            s->rw_start = s->pos;
            s->rw_n = n;
        }
        s->pos += n;
    }
    if (e->store) xs_tick(e->store, total);
    return DF_OK;
}

/* ---- rewinding ---- */

df_status df_session_set_rewind(df_session *s, int depth, int mode) {
    df_engine *e = s->e;
    if (depth < 0 || depth > DF_REWIND_MAX || depth > DF_CHUNK || (mode != DF_REWIND_TRAIL && mode != DF_REWIND_REPLAY))
        return df_fail(s->err, DF_ERR_ARG, "rewind depth %d (0..%d) or mode %d is not valid", depth, DF_REWIND_MAX, mode);
    if (depth == s->rw_depth && (depth == 0 || mode == s->rw_mode)) return DF_OK; /* already so */
    s->rw_n = 0;
    s->rw_depth = 0;
    free(s->rw_tokens);
    s->rw_tokens = NULL;
    if (e->ops->rewind_setup) {
        df_status st = e->ops->rewind_setup(e, s->state, depth, mode);
        if (st == DF_ERR_UNSUPPORTED)
            return df_fail(s->err, st, "this session's recurrent state lives on the accelerator: it cannot be rewound");
        if (st != DF_OK) { e->ops->rewind_setup(e, s->state, 0, mode); return df_fail(s->err, st, "out of memory"); }
    }
    if (depth == 0) return DF_OK;
    if (!(s->rw_tokens = malloc((size_t)depth * sizeof *s->rw_tokens))) {
        if (e->ops->rewind_setup) e->ops->rewind_setup(e, s->state, 0, mode);
        return df_fail(s->err, DF_ERR_NOMEM, "out of memory");
    }
    s->rw_depth = depth;
    s->rw_mode = mode;
    return DF_OK;
}

df_status df_session_rewind(df_session *s, int pos) {
    df_engine *e = s->e;
    if (pos == s->pos) return DF_OK;
    if (pos < 0 || pos > s->pos)
        return df_fail(s->err, DF_ERR_ARG, "cannot rewind to position %d (the session is at %d)", pos, s->pos);
    if (!e->ops->rewind_to) { /* positions alone define the timeline */
        s->pos = pos;
        s->rw_n = s->rw_n && pos > s->rw_start ? pos - s->rw_start : 0;
        return DF_OK;
    }
    int lo = s->rw_mode == DF_REWIND_REPLAY ? s->rw_start : s->rw_start + 1;
    if (!s->rw_n || pos < lo || pos > s->rw_start + s->rw_n)
        return df_fail(s->err, DF_ERR_ARG,
                       "cannot rewind to position %d: only positions inside the last evaluation of at most %d "
                       "tokens (df_session_set_rewind) can be reached",
                       pos, s->rw_depth);
    if (s->rw_mode == DF_REWIND_TRAIL) {
        e->ops->rewind_to(e, s->state, pos - s->rw_start - 1);
        s->rw_n = pos - s->rw_start;
        s->pos = pos;
        return DF_OK;
    }
    e->ops->rewind_to(e, s->state, -1);
    int keep = pos - s->rw_start;
    s->pos = s->rw_start;
    s->rw_n = 0;
    return keep > 0 ? df_session_eval(s, s->rw_tokens, keep, NULL) : DF_OK;
}

/* ---- profile ---- */

double prof_now(const df_engine *e) {
    if (!e->opts.profile) return 0;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void prof_add(df_engine *e, int part, double *t) {
    if (!e->opts.profile) return;
    double now = prof_now(e);
    e->prof[part] += now - *t;
    *t = now;
}

const char *df_prof_name(int i) {
    static const char *names[DF_PROF_N] = {"embed", "attention KDA", "attention MLA", "norms + residuals",
                                           "router", "shared experts", "routed experts", "dense MLP", "head",
                                           "waiting for spine reads"};
    return i >= 0 && i < DF_PROF_N ? names[i] : "?";
}

void df_engine_profile(const df_engine *e, double out[DF_PROF_N]) {
    memcpy(out, e->prof, sizeof e->prof);
}

/* ---- stats ---- */

void df_engine_stats(const df_engine *e, df_stats *out) {
    memset(out, 0, sizeof *out);
    out->expert_io = e->store ? (e->opts.expert_io == DF_EXPERTS_DIRECT ? "direct" : "pread") : "mmap";
    if (e->spine) out->spine_bytes_read = (uint64_t)(sp_bytes_read(e->spine) - e->spine_read0);
    if (!e->store) return;
    xs_stats x;
    xs_get_stats(e->store, &x);
    out->expert_hits = x.hits;
    out->expert_misses = x.misses;
    out->prefetched = x.prefetched;
    out->prefetch_used = x.prefetch_used;
    out->prefetch_wasted = x.prefetch_wasted;
    out->bytes_read = x.bytes_read;
    out->io_wait_s = x.wait_s;
    out->io_submit_s = x.submit_s;
    out->cache_slots = x.slots;
    out->cache_slots_used = x.slots_used;
    out->slot_bytes = x.slot_bytes;
    out->max_in_flight = x.max_in_flight;
    out->dio_mem_align = x.dio_mem_align;
}

void df_engine_accel_stats(const df_engine *e, df_accel_stats *out) { acc_get_stats(e->acc, out); }

void df_engine_reset_stats(df_engine *e) {
    memset(e->prof, 0, sizeof e->prof);
    memset(&e->bstats, 0, sizeof e->bstats);
    acc_reset_stats(e->acc);
    if (e->store) xs_reset_stats(e->store);
    if (e->spine) e->spine_read0 = sp_bytes_read(e->spine);
}

double df_engine_probe_h2d(df_engine *e) {
    const df_accel *a = e->opts.accel;
    return a && a->h2d_gbps ? a->h2d_gbps(a->ctx) : 0.0;
}

double df_engine_probe_device_read(df_engine *e) {
    const df_accel *a = e->opts.accel;
    return a && a->read_gbps ? a->read_gbps(a->ctx) : 0.0;
}

void df_engine_probe_device_tc(df_engine *e, double *sync_tflops, double *wg_tflops) {
    const df_accel *a = e->opts.accel;
    *sync_tflops = *wg_tflops = 0;
    if (a && a->tc_tflops) a->tc_tflops(a->ctx, sync_tflops, wg_tflops);
}

df_status df_engine_probe_disk(df_engine *e, double seconds, double *gbps, char err[DF_ERRMSG]) {
    int best = 0;
    int64_t best_size = -1;
    for (int i = 0; i < st_n_shards(e->st); i++) {
        int fd = io_open(e->io, st_shard_path(e->st, i), O_RDONLY | O_CLOEXEC, 0);
        int64_t sz = -1;
        if (fd >= 0) { io_fsize(e->io, fd, &sz); io_close(e->io, fd); }
        if (sz > best_size) { best_size = sz; best = i; }
    }
    int64_t chunk = e->store ? xs_expert_bytes(e->store) : 0;
    if (chunk <= 0) chunk = (int64_t)4 << 20;
    if (chunk > best_size / 2) chunk = best_size / 2 / XR_ALIGN * XR_ALIGN;
    if (chunk < XR_ALIGN) return df_fail(err, DF_ERR_ARG, "the model's shards are too small to probe the disk");
    int depth = e->opts.io_depth > 0 ? e->opts.io_depth : 32;
    /* its buffers are outside the memory plan: at most 256 MB of them */
    while (depth > 4 && chunk * depth > ((int64_t)256 << 20)) depth--;
    return xr_probe_bandwidth(e->io, st_shard_path(e->st, best), XR_AUTO, (size_t)chunk, depth, seconds, gbps, err);
}

int64_t df_engine_session_bytes(const df_engine *e, int max_ctx) {
    int64_t fixed = e->ops->state_fixed_bytes ? e->ops->state_fixed_bytes(e) : 0;
    return fixed + (int64_t)max_ctx * e->ops->state_bytes_per_pos(e);
}

int64_t df_engine_recurrent_bytes(const df_engine *e) {
    return e->ops->state_fixed_bytes ? e->ops->state_fixed_bytes(e) : 0;
}

int64_t df_engine_expert_bytes(const df_engine *e) {
    if (e->store) return xs_expert_bytes(e->store);
    /* no cache slots (experts as page-cache views, --io mmap): the mean
     * expert's stored bytes, as the memory plan counts them */
    int64_t n = (int64_t)df_engine_moe_layers(e) * e->cfg.n_routed_experts;
    return n > 0 ? e->plan.routed / n : 0;
}

int df_engine_experts_per_token(const df_engine *e) {
    int k = e->cfg.num_experts_per_tok;
    return e->opts.top_k > 0 && e->opts.top_k < k ? e->opts.top_k : k;
}

const char *df_engine_lossy(const df_engine *e) { return e->lossy; }
const char *df_engine_meta_note(const df_engine *e) { return e->meta_note; }
const char *df_engine_spine_dtype(const df_engine *e) { return e->spine_dtype; }
int df_engine_spine_streamed(const df_engine *e) { return e->spine != NULL; }
const char *df_engine_spine_why(const df_engine *e) { return e->plan.why; }

int df_engine_moe_layers(const df_engine *e) {
    int n = 0;
    for (int l = 0; l < e->cfg.num_hidden_layers; l++) n += cfg_is_moe_layer(&e->cfg, l);
    return n;
}

/* The bytes of tensor t one token's step reads: 0 for a routed expert's or
 * one not in use, one row of an untied embedding, else all of it. */
static int64_t token_bytes(const df_engine *e, const st_tensor *t) {
    if (model_is_routed_expert(t->name) || !model_spine_live(e, t)) return 0;
    if (!e->cfg.tie_word_embeddings && strstr(t->name, "embed_tokens.weight") && t->ndim == 2 && t->shape[0] > 0)
        return t->nbytes / t->shape[0];
    return t->nbytes;
}

int64_t df_engine_spine_bytes_per_token(const df_engine *e) {
    int64_t total = 0;
    for (int64_t i = 0; i < st_count(e->st); i++) total += token_bytes(e, st_at(e->st, i));
    return total;
}

int df_engine_spine_copy(const df_engine *e, int64_t *tensors, int64_t *bytes, double *seconds, int64_t *rss,
                         int64_t *in_2mb) {
    rcopy_stats s;
    rcopy_get_stats(e->rcopy, &s);
    const int failed = s.failed;
    if (failed) memset(&s, 0, sizeof s);
    *tensors = s.tensors;
    *bytes = s.bytes;
    *seconds = s.seconds;
    *rss = *in_2mb = 0;
    if (!e->rcopy || failed) return 0;
    if (mem_range_pages(rcopy_base(e->rcopy), (size_t)rcopy_region_bytes(e->rcopy), rss, in_2mb) != 0)
        *rss = *in_2mb = -1;
    return s.done ? 1 : 2;
}

int df_engine_mapped_weights(const df_engine *e, int64_t *resident, int64_t *in_2mb) {
    *resident = *in_2mb = 0;
    int n = st_n_shards(e->st), k = 0;
    char **paths = calloc((size_t)(n > 0 ? n : 1), sizeof *paths);
    if (!paths) return -1;
    for (int i = 0; i < n; i++) /* as the kernel names them: links resolved (a hub cache's snapshots) */
        if ((paths[k] = realpath(st_shard_path(e->st, i), NULL))) k++;
    int rc = mem_mapped_files((const char *const *)paths, k, resident, in_2mb);
    for (int i = 0; i < k; i++) free(paths[i]);
    free(paths);
    return rc;
}

int64_t df_engine_macs_per_token(const df_engine *e) {
    /* every 2-D matrix of the spine (a lookup embedding is no product;
     * scales and vectors are none), plus K routed experts per MoE layer */
    int64_t total = 0;
    for (int64_t i = 0; i < st_count(e->st); i++) {
        const st_tensor *t = st_at(e->st, i);
        if (model_is_routed_expert(t->name) || !model_spine_live(e, t)) continue;
        if (t->ndim != 2 || strstr(t->name, "scale")) continue;
        if (!e->cfg.tie_word_embeddings && strstr(t->name, "embed_tokens.weight")) continue;
        total += t->shape[0] * t->shape[1];
    }
    const df_config *c = &e->cfg;
    int64_t dl = c->routed_expert_hidden_size > 0 ? c->routed_expert_hidden_size : c->hidden_size;
    total += (int64_t)df_engine_experts_per_token(e) * df_engine_moe_layers(e) * 3 * dl * c->moe_intermediate_size;
    return total;
}

void df_engine_part_bytes(const df_engine *e, double out[DF_PROF_N]) {
    const df_config *c = &e->cfg;
    for (int i = 0; i < DF_PROF_N; i++) out[i] = 0;
    for (int64_t i = 0; i < st_count(e->st); i++) {
        const st_tensor *t = st_at(e->st, i);
        const char *n = t->name;
        const int64_t b = token_bytes(e, t);
        const int l = model_layer_of(n);
        if (!b) continue;
        int part = DF_PROF_NORMS;
        if (strstr(n, "embed_tokens.weight")) part = c->tie_word_embeddings ? DF_PROF_HEAD : DF_PROF_EMBED;
        else if (strstr(n, "lm_head")) part = DF_PROF_HEAD;
        else if (l < 0) part = DF_PROF_NORMS;
        else if (strstr(n, ".self_attn.")) part = l < DF_MAX_LAYERS && c->is_kda[l] ? DF_PROF_KDA : DF_PROF_MLA;
        else if (strstr(n, "shared_experts.")) part = DF_PROF_SHARED;
        else if (strstr(n, "mlp.gate.") || strstr(n, "moe.gate.") || strstr(n, "routed_expert_down_proj"))
            part = DF_PROF_ROUTER;
        else if (strstr(n, "routed_expert_up_proj") || strstr(n, "routed_expert_norm")) part = DF_PROF_ROUTED;
        else if (strstr(n, ".mlp.") || strstr(n, "_moe.")) part = DF_PROF_DENSE;
        out[part] += (double)b;
    }
    out[DF_PROF_ROUTED] +=
        (double)df_engine_expert_bytes(e) * df_engine_experts_per_token(e) * df_engine_moe_layers(e);
}

int64_t df_engine_head_macs(const df_engine *e) { return (int64_t)e->cfg.vocab_size * e->cfg.hidden_size; }

df_status df_engine_save_heat(df_engine *e, char err[DF_ERRMSG]) {
    if (!e->store || !e->opts.heat_path) return DF_OK;
    return xs_heat_save(e->store, e->opts.heat_path, err);
}

/* ---- MoE linking ---- */

void model_link_moe(df_engine *e, struct moe_layer_s *first, size_t stride, int n_layers) {
    moe_layer *prev = NULL;
    for (int l = 0; l < n_layers; l++) {
        moe_layer *m = (moe_layer *)((char *)first + (size_t)l * stride);
        if (m->E == 0) continue;
        m->lookahead = e->opts.prefetch;
        m->trace = e->opts.trace;
        m->trace_ctx = e->opts.trace_ctx;
        m->trace_layer = l;
        if (e->opts.top_k > 0 && e->opts.top_k < m->K) m->K = e->opts.top_k; /* LOSSY */
        if (prev) prev->next = m;
        prev = m;
    }
}

/* ---- small public helpers ---- */

int df_argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (v[i] > v[best]) best = i;
    return best;
}
