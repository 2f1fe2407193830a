#!/bin/sh
# bench/tokenizer.sh [BIN] [MB] — tokenizer throughput, deltafin vs js-tiktoken,
# on the same texts and machine, with the o200k_base and cl100k_base rank files:
#   corpus  tests/text/corpus.json repeated to about MB megabytes (default 1):
#           multilingual, emoji runs, whitespace runs (js-tiktoken's BPE is
#           quadratic in a piece's length, which this text exposes)
#   source  this repository's C sources and docs, repeated to about MB megabytes
# js-tiktoken runs only when node and tools/tokref/node_modules are there
# (cd tools/tokref && npm ci --ignore-scripts). One line per run.
set -e
BIN=${1:-build/deltafin}
MB=${2:-1}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 - "$T" "$MB" <<'PY'
import glob, json, sys
d, mb = sys.argv[1], float(sys.argv[2])
c = "\n".join(json.load(open("tests/text/corpus.json", encoding="utf-8"))) + "\n"
s = "".join(open(f, encoding="utf-8").read() for f in sorted(glob.glob("src/**/*.[ch]", recursive=True) + glob.glob("docs/*.md")))
for name, t in (("corpus", c), ("source", s)):
    n = int(mb * 1e6 / len(t.encode())) + 1
    open(f"{d}/{name}.txt", "w", encoding="utf-8").write(t * n)
PY
for enc in o200k cl100k; do
    gzip -dc tests/text/${enc}_base.tiktoken.gz > "$T/$enc.tiktoken"
    for text in corpus source; do
        "$BIN" tokenize --tokenizer "$T/$enc.tiktoken" --pattern $enc --text-file "$T/$text.txt" --time 2>&1 >/dev/null |
            sed "s/^tokenize:/deltafin    $enc $text:/; s/ (tiktoken.*//"
        if command -v node >/dev/null && [ -d tools/tokref/node_modules/js-tiktoken ]; then
            node tools/tokref/bench.js "$T/$text.txt" ${enc}_base | sed "s/^js-tiktoken ${enc}_base:/js-tiktoken $enc $text:/"
        fi
    done
done
"$BIN" tokenize --tokenizer "$T/cl100k.tiktoken" --pattern kimi --text-file "$T/source.txt" --time 2>&1 >/dev/null |
    sed "s/^tokenize:/deltafin    kimi pattern, cl100k ranks, source:/; s/ (tiktoken.*//"
