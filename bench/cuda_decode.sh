#!/bin/sh
# cuda_decode.sh — the engine's decode benchmark on CUDA, in the regimes of
# issue 8, side by side with the CPU in one run (medians of steady tokens;
# each line quotes its floor and ratio as `deltafin bench --decode` prints).
#
#   bench/cuda_decode.sh MODEL [GPU_MEM] [BIN]
#
# MODEL: e.g. `deltafin synth --arch kimi_k3 --preset k3-slice --gb 16 --out M`.
# GPU_MEM (default 8G) bounds the device copies so the experts do not all
# fit: the host-RAM case then uploads experts every token. BIN defaults to
# build/deltafin-cuda. Cases:
#   ram     experts from the RAM cache, device cache bounded (--gpu-mem)
#   ram-no-lookahead  the same without router lookahead (no early uploads)
#   gpu     everything fits the device (after the prompt)
#   disk    RAM cache of 2 GB (experts from disk, the GPU tier over it)
#   cpu-*   the same ram / disk cases on the CPU
set -eu
M=$1
GM=${2:-8G}
BIN=${3:-build/deltafin-cuda}
run() {
    name=$1
    shift
    echo "== $name: $BIN bench --decode --model $M --tokens 12 --spine resident $*"
    "$BIN" bench --decode --model "$M" --tokens 12 --spine resident "$@" |
        grep -E "decode median|floor|device|ratio|resident|evictions|routed experts run|^  [a-z]" || true
}
run ram --device cuda --prompt-tokens 64 --gpu-mem "$GM"
run ram-no-lookahead --device cuda --prompt-tokens 64 --gpu-mem "$GM" --no-prefetch
run gpu --device cuda --prompt-tokens 64
run disk --device cuda --expert-cache 2G
run cpu-ram --device cpu --prompt-tokens 64
run cpu-disk --device cpu --expert-cache 2G
