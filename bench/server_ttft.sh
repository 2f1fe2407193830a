#!/bin/sh
# server_ttft.sh — time to first token of `deltafin serve` with and without
# prefix reuse. A long prompt is sent once (fresh prefill), then again
# extended by the generated tokens plus a follow-up (the kept session goes
# on from where it stopped), then a different prompt of the same length
# (fresh again). Prints each request's prompt / reused tokens and the first
# token time from the server's log line.
#
#   sh bench/server_ttft.sh build/deltafin MODEL_DIR [PROMPT_TOKENS]
#
# MODEL_DIR needs a tokenizer; PROMPT_TOKENS (default 1000) token ids in
# [1, 500] are used as the prompt so no tokenizer round trip is involved.
set -eu
BIN=${1:?usage: server_ttft.sh BIN MODEL_DIR [PROMPT_TOKENS]}
MODEL=${2:?usage: server_ttft.sh BIN MODEL_DIR [PROMPT_TOKENS]}
N=${3:-1000}
TMP=$(mktemp -d)
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$TMP"' EXIT
"$BIN" serve --model "$MODEL" --port 0 --ctx $((N + 200)) > "$TMP/out" 2> "$TMP/err" &
PID=$!
i=0
until grep -q ready "$TMP/out" 2>/dev/null; do
    i=$((i + 1)); [ $i -lt 600 ] || { cat "$TMP/err"; exit 1; }
    sleep 0.1
done
PORT=$(sed -n 's/.*127.0.0.1:\([0-9]*\).*/\1/p' "$TMP/out")
ids() { seq "$1" "$2" | awk '{ if (NR > 1) printf ","; printf "%d", ($1 * 7919) % 500 + 1 }'; }
ask() { # prompt ids, max_tokens
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\": [$1], \"max_tokens\": $2, \"temperature\": 0, \"logit_bias\": {\"87\": 100}}" > "$TMP/resp"
    tail -n 1 "$TMP/err" | sed 's/^deltafin serve: [^:]*: /  /'
}
P=$(ids 1 "$N")
echo "fresh prefill:"
ask "$P" 8
echo "same conversation, extended (prefix reuse):"
ask "$P,87,87,87,87,87,87,87,87,13" 8
Q=$(ids 2 "$((N + 1))")
echo "different prompt of the same length (fresh prefill):"
ask "$Q" 8
