/* mla_head_bench.c — times mla_head (absorb, attention, lift of one MLA head)
 * at each kernel level on K3's MLA shape (R 512, dr 64, dn 128, dv 128,
 * f32 kv_b of made-up values), one thread, no model needed.
 *
 *   make -j2 && gcc -O2 -std=c17 -D_GNU_SOURCE -Iinclude bench/mla_head_bench.c build/libdeltafin.a \
 *       -lmicrohttpd -lpcre2-8 -ljansson -luring -lcurl -lnettle -lm -lpthread -o build/mla_head_bench
 *   build/mla_head_bench [heads=16] [prompt=512] [n=32] [level: 0 scalar, 1 avx2, 2 avx512; all] [path]
 *
 * n >= 4: a prompt of `prompt` tokens in chunks of n (prefill); n < 4: 100
 * steps of n tokens at position prompt - n (decode, n = 1). Prints seconds,
 * and scaled to 96 heads (one K3 MLA layer). path: "head" runs mla_head head
 * by head (queries in the lanes; before the heads-in-lanes path), "heads"
 * (default) runs mla_heads over all the heads at once, as the engine does
 * on one thread (heads in the lanes for n < MLA_HEADS_IN_LANES_BELOW).
 * Decode of one K3 layer, 96 heads at context 4096, both paths:
 *   build/mla_head_bench 96 4096 1 2 head; build/mla_head_bench 96 4096 1 2 heads
 */
#include "../src/kernels/kernels.h"
#include "../src/model/mla.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static float *filled(size_t n, unsigned mul) {
    float *p = malloc(n * sizeof(float));
    if (!p) exit(1);
    for (size_t i = 0; i < n; i++) p[i] = (float)((i * mul) % 1000u) / 1000.0f - 0.5f;
    return p;
}

int main(int argc, char **argv) {
    int nh = argc > 1 ? atoi(argv[1]) : 16, P = argc > 2 ? atoi(argv[2]) : 512, N = argc > 3 ? atoi(argv[3]) : 32;
    int l0 = argc > 4 ? atoi(argv[4]) : KN_SCALAR, l1 = argc > 4 ? l0 : KN_AVX512;
    int all = argc > 5 ? !strcmp(argv[5], "heads") : 1;
    if (nh < 1 || P < 1 || N < 1 || N > DF_CHUNK || N > P || (argc > 5 && !all && strcmp(argv[5], "head"))) {
        fprintf(stderr, "usage: mla_head_bench [heads>=1] [prompt>=n] [n 1..%d] [level 0..2] [head|heads]\n",
                DF_CHUNK);
        return 2;
    }
    mla_shape sh = {0};
    sh.nh = nh;
    sh.dn = 128;
    sh.dr = 64;
    sh.dv = 128;
    sh.R = 512;
    sh.dq = sh.dn + sh.dr;
    sh.softmax_scale = 0.07f;
    float *cache = filled((size_t)P * (sh.R + sh.dr), 2654435761u), *w = filled((size_t)nh * 256 * 512, 40503u),
          *q = filled((size_t)N * nh * sh.dq, 97u);
    df_weight kv = {0};
    kv.type = WT_F32;
    kv.rows = (int64_t)nh * (sh.dn + sh.dv);
    kv.cols = sh.R;
    kv.data = w;
    float *ql = filled((size_t)nh * N * sh.R, 1u), *ol = filled((size_t)nh * N * sh.R, 1u),
          *attn = filled((size_t)N * nh * sh.dv, 1u), *scr = filled((size_t)mla_head_scratch_floats(&sh, P), 1u);
    for (int lv = l0; lv <= l1; lv++) {
        if (!kn_level_available((kn_level)lv)) continue;
        double t0 = now();
        int dec = N < 4;
        for (int rep = 0; rep < (dec ? 100 : 1); rep++)
            for (int pos = dec ? P - N : 0; pos + N <= P; pos += N) {
                if (all) mla_heads(&sh, (kn_level)lv, &kv, cache, q, pos, N, 0, nh, ql, ol, attn, scr);
                else
                    for (int h = 0; h < nh; h++) mla_head(&sh, (kn_level)lv, &kv, cache, q, pos, N, h, ql, ol, attn, scr);
            }
        double s = now() - t0;
        printf("%-7s %-5s %.3f s for %d heads, prompt %d, n=%d%s (96 heads: %.3f s)\n", kn_level_name((kn_level)lv),
               all ? "heads" : "head", s, nh, P, N, dec ? ", 100 steps" : "", s * 96 / nh);
    }
    free(cache); free(w); free(q); free(ql); free(ol); free(attn); free(scr);
    return 0;
}
