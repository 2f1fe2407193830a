#!/bin/sh
# cpu_scaling.sh — the CPU at its floor (issue 14): kernel throughput at each
# SIMD level, decode s/token by thread count with everything in RAM, and a
# long prefill against its compute and byte floors. Medians and floors are
# the ones `deltafin bench` prints; every line quotes its own probe.
#
#   bench/cpu_scaling.sh MODEL [THREADS...] [BIN]
#
# MODEL: e.g. `deltafin synth --arch kimi_k3 --preset k3-slice --out M`
# (24.9 GB; the page cache must hold it for the in-RAM lines). THREADS
# defaults to "1 2 4 8 16" capped at the CPU count; BIN to build/deltafin.
# In RAM means --io mmap: routed experts are views of the page cache, so no
# expert is read or copied during the step (hit rate 1.0).
set -eu
M=$1
shift
BIN=${BIN:-build/deltafin}
N=$(nproc)
TH=${*:-"1 2 4 8 16"}
echo "== kernels (bench --kernels), all CPUs and 2 threads, each level"
for t in "$N" 2; do
    for s in avx512 avx2; do
        echo "-- threads $t, $s"
        "$BIN" bench --kernels --threads "$t" --simd "$s" --seconds 0.4 | grep -E "probe|^(bf16|f16|int8|fp8|int4|mxfp4) "
    done
done
echo "== decode, experts in RAM (--io mmap): s/token, ratio to the DRAM floor"
echo "   (after WARMUP tokens, default 24, outside the figures: a short run otherwise"
echo "   measures each expert's first use; WARMUP=0 for the old runs)"
for t in $TH; do
    [ "$t" -le "$N" ] || continue
    "$BIN" bench --decode --model "$M" --threads "$t" --io mmap --tokens 8 --prompt-tokens 8 \
        --warmup "${WARMUP:-24}" 2>/dev/null |
        grep -E "decode median|memory floor|^  [a-zA-Z]" | sed "s/^/t=$t  /"
done
echo "== prefill 512 tokens, experts in RAM, all CPUs (then again with the pages touched: --prefill-again)"
"$BIN" bench --decode --model "$M" --io mmap --tokens 2 --prompt-tokens 512 --prefill-again 2>/dev/null |
    sed -n '/^prefill/,/^time per decode/p' | grep -v "^time per decode"
