#!/bin/sh
# demo.sh — the main job on a small model: describe it, then generate greedily
# and print tokens/s. Uses a committed fixture checkpoint.
set -e
BIN=${1:-build/deltafin}
MODEL=${DEMO_MODEL:-tests/fixtures/dsv3_qlora}
PROMPT=${DEMO_PROMPT:-11,22,33,44,55,66,77,88}
echo "== deltafin inspect --model $MODEL"
"$BIN" inspect --model "$MODEL"
echo
echo "== deltafin run --model $MODEL --tokens $PROMPT --max-new 64 --ids --stats"
"$BIN" run --model "$MODEL" --tokens "$PROMPT" --max-new 64 --ids --stats
