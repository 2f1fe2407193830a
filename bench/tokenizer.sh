#!/bin/sh
# bench/tokenizer.sh [BIN] [MB] — tokenizer throughput, deltafin vs js-tiktoken,
# on the same text (tests/text/corpus.json repeated to about MB megabytes,
# default 1) with the o200k_base and cl100k_base rank files. js-tiktoken runs
# only when node and tools/tokref/node_modules are there
# (cd tools/tokref && npm ci --ignore-scripts). Prints one line per run.
set -e
BIN=${1:-build/deltafin}
MB=${2:-1}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 - "$T/text.txt" "$MB" <<'PY'
import json, sys
c = "\n".join(json.load(open("tests/text/corpus.json", encoding="utf-8"))) + "\n"
n = int(float(sys.argv[2]) * 1e6 / len(c.encode())) + 1
open(sys.argv[1], "w", encoding="utf-8").write(c * n)
PY
for enc in o200k cl100k; do
    gzip -dc tests/text/${enc}_base.tiktoken.gz > "$T/$enc.tiktoken"
    "$BIN" tokenize --tokenizer "$T/$enc.tiktoken" --pattern $enc --text-file "$T/text.txt" --time 2>&1 >/dev/null |
        sed "s/^tokenize:/deltafin $enc:/; s/ (tiktoken.*//"
    if command -v node >/dev/null && [ -d tools/tokref/node_modules/js-tiktoken ]; then
        node tools/tokref/bench.js "$T/text.txt" ${enc}_base
    fi
done
"$BIN" tokenize --tokenizer "$T/cl100k.tiktoken" --pattern kimi --text-file "$T/text.txt" --time 2>&1 >/dev/null |
    sed "s/^tokenize:/deltafin kimi pattern (cl100k ranks):/; s/ (tiktoken.*//"
