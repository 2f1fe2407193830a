#!/bin/sh
# cuda_prompt.sh — a warm prompt on the GPU (issue 15's prefill), its bf16
# products three ways, rounds alternating so drift hits every case alike:
#   default  bf16 on the CUDA cores (prompt bits = token-by-token decode's)
#   mma      --bf16-tc-rows 9 --bf16-wg off (tensor cores, mma.sync blocks)
#   wgmma    --bf16-tc-rows 9 (tensor cores, Hopper's wgmma blocks where a
#            product fills the GPU; the same bits as mma)
# Each line: the median of PASSES warm prompts of TOKENS tokens (`bench
# --decode --prefill-again`), tokens/s, and TFLOP/s over the prompt's FLOPs
# as bench counts them; then the median of each case over the rounds.
#
#   bench/cuda_prompt.sh MODEL [TOKENS] [ROUNDS] [BIN]
#
# MODEL: e.g. `deltafin synth --arch kimi_k3 --preset k3-slice --gb 16 --out M`
# (3 layers) or `--layers 8 --gb 19` (8). TOKENS default 512, ROUNDS 2, BIN
# build/deltafin-cuda. Needs python3 (the JSON).
set -eu
M=$1; T=${2:-512}; ROUNDS=${3:-2}; BIN=${4:-build/deltafin-cuda}
PASSES=3
out=$(mktemp)
trap 'rm -f "$out"' EXIT
one() {
    case=$1; shift
    "$BIN" bench --decode --model "$M" --device cuda --spine resident --tokens 2 --prompt-tokens "$T" \
        --prefill-again "$PASSES" --json "$@" 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
s = d["prefill_again_s"]
print("%-8s %8.4f s  %7.0f tokens/s  %6.1f TFLOP/s" % (sys.argv[1], s, int(sys.argv[2]) / s, d["prefill_gflop"] / s / 1e3))
' "$case" "$T" | tee -a "$out"
}
r=1
while [ "$r" -le "$ROUNDS" ]; do
    one default
    one mma --bf16-tc-rows 9 --bf16-wg off
    one wgmma --bf16-tc-rows 9
    r=$((r + 1))
done
echo "== medians over $ROUNDS rounds"
python3 - "$out" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    f = line.split()
    runs.setdefault(f[0], []).append(float(f[1]))
for k, v in runs.items():
    print("%-8s %8.4f s" % (k, statistics.median(v)))
PY
