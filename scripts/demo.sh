#!/bin/sh
# demo.sh — the main job on a small generated model: write a tiny synthetic
# Kimi K3 checkpoint (release layout, MXFP4 experts) with a tokenizer (the
# first ranks of cl100k from tests/text plus K3's special tokens), describe
# it, generate greedily from token ids with experts streamed through the
# expert cache and print tokens/s, then run the whole text path: a chat
# prompt rendered with K3's XTML template, tokenised, generated and decoded
# (random weights: the text is gibberish; the thinking channel goes to
# stderr, the answer to stdout). Also runs a reference fixture checkpoint
# (DeepSeek-V3 family).
set -e
BIN=${1:-build/deltafin}
DIR=${DEMO_DIR:-build/demo-k3}
TOK=$DIR.cl100k.tiktoken
gzip -dc tests/text/cl100k_base.tiktoken.gz > "$TOK"
"$BIN" synth --arch kimi_k3 --preset tiny --tokenizer "$TOK" --out "$DIR" --force --quiet
rm -f "$TOK"
echo "== deltafin inspect --model $DIR"
"$BIN" inspect --model "$DIR"
echo
echo "== deltafin run --model $DIR --tokens 1,2,3,4,5,6,7,8 --max-new 32 --ids --stats --expert-cache 64M"
"$BIN" run --model "$DIR" --tokens 1,2,3,4,5,6,7,8 --max-new 32 --ids --stats --expert-cache 64M
echo
echo "== deltafin run --model $DIR --prompt 'What is an expert cache?' --chat --max-new 32 --stats"
"$BIN" run --model "$DIR" --prompt "What is an expert cache?" --chat --max-new 32 --stats
echo
MODEL=tests/fixtures/dsv3_qlora
echo "== deltafin run --model $MODEL --tokens 11,22,33,44,55,66,77,88 --max-new 32 --ids --stats"
"$BIN" run --model "$MODEL" --tokens 11,22,33,44,55,66,77,88 --max-new 32 --ids --stats 2>&1 | tail -2
