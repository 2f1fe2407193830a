#!/bin/sh
# demo.sh — the main job on a small model: models/kimi-k3-tiny, a Kimi K3
# architecture model (KDA + gated NoPE MLA, attention residuals, SiTU, a
# latent MoE of 64 MXFP4 experts top-8) trained on the Python standard
# library's sources (tools/train, the model card beside it). Describes it,
# then streams a chat prompt rendered with K3's XTML template and a code
# prompt, with tokens/s (--stats); then the lossy int8 spine beside the
# exact one on a held-out window (deltafin eval: perplexity, KL, top-1).
# The model stays read-only: the conversion goes to a copy in build/.
set -e
BIN=${1:-build/deltafin}
MODEL=models/kimi-k3-tiny
echo "== deltafin inspect --model $MODEL"
"$BIN" inspect --model "$MODEL" --spine-dtype bf16
echo
echo "== deltafin run --model $MODEL --chat --prompt 'How do I read a file line by line?' --stats"
"$BIN" run --model "$MODEL" --spine-dtype bf16 --chat --prompt "How do I read a file line by line?" --max-new 96 --stats
echo
echo "== deltafin run --model $MODEL --prompt 'import os ... def walk(' --stats"
"$BIN" run --model "$MODEL" --spine-dtype bf16 --max-new 96 --stats --prompt 'import os
import sys


def walk(top, onerror=None):
    """'
echo
COPY=${DEMO_DIR:-build/demo-k3-tiny}
rm -rf "$COPY"
cp -r "$MODEL" "$COPY"
echo "== deltafin convert-spine $COPY; deltafin eval (held-out windows) bf16 vs int8"
"$BIN" convert-spine "$COPY" 2>/dev/null
"$BIN" eval --model "$COPY" --tokens-file "$MODEL/eval/val_windows.u16" --ctx 256 --windows 4 --spine-dtype bf16 \
    --save-logits "$COPY/base.lg" 2>/dev/null
"$BIN" eval --model "$COPY" --tokens-file "$MODEL/eval/val_windows.u16" --ctx 256 --windows 4 --spine-dtype int8 \
    --base-logits "$COPY/base.lg" 2>/dev/null
