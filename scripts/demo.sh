#!/bin/sh
# demo.sh — the main job on a small generated model: write a tiny synthetic
# Kimi K3 checkpoint (release layout, MXFP4 experts), describe it, then
# generate greedily with experts streamed through the expert cache and print
# tokens/s. Also runs a reference fixture checkpoint (DeepSeek-V3 family).
set -e
BIN=${1:-build/deltafin}
DIR=${DEMO_DIR:-build/demo-k3}
"$BIN" synth --arch kimi_k3 --preset tiny --out "$DIR" --force --quiet
echo "== deltafin inspect --model $DIR"
"$BIN" inspect --model "$DIR"
echo
echo "== deltafin run --model $DIR --tokens 1,2,3,4,5,6,7,8 --max-new 32 --ids --stats --ram 64M"
"$BIN" run --model "$DIR" --tokens 1,2,3,4,5,6,7,8 --max-new 32 --ids --stats --ram 64M
echo
MODEL=tests/fixtures/dsv3_qlora
echo "== deltafin run --model $MODEL --tokens 11,22,33,44,55,66,77,88 --max-new 32 --ids --stats"
"$BIN" run --model "$MODEL" --tokens 11,22,33,44,55,66,77,88 --max-new 32 --ids --stats 2>&1 | tail -2
