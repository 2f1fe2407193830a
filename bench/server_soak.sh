#!/bin/sh
# server_soak.sh — `deltafin serve` under hostile load for MINUTES on a tiny
# model: concurrent streaming clients (the official `openai` npm client)
# with random disconnects, malformed and oversized requests, socket-level
# abuse and bursts past the FIFO, interleaved. Every valid request is
# deterministic (temperature 0 or a seed) and its full answer is computed
# once alone first, so each concurrent answer, streamed or whole, must be
# exactly that: nothing lost, nothing mixed up. The server's RSS
# (/proc/PID/status VmRSS), open descriptors (/proc/PID/fd) and threads are
# printed as a table over time, then the counts by kind and one verdict line.
#
#   sh bench/server_soak.sh MINUTES [BIN]      (BIN default build/deltafin)
#
# Exits non-zero on any wrong or lost answer, a server crash, RSS or
# descriptor growth, descriptors or threads not back to the idle baseline,
# or a server exit status other than 0 at SIGTERM (an ASan build's leak
# report included: `make SAN=1 build-san/deltafin`, then BIN=build-san/deltafin;
# under ASan RSS is printed but not judged, its quarantine grows by design).
# Needs node and `npm ci --prefix tests/server`. Knobs (environment):
#   SOAK_CLIENTS (10)  SOAK_QUEUE (4)  SOAK_DELAY_MS (2, --test-delay-ms)
#   SOAK_SAMPLE_S (MINUTES*60/90, within 5..20)  SOAK_RSS_TOL_PCT (10)
#   SOAK_RSS_TOL_MB (2)  SOAK_KEEP (1: keep the work directory)
#   SOAK_ARENAS (2: the server's MALLOC_ARENA_MAX, so RSS follows live memory
#     rather than how many of glibc's per-thread arenas (up to 8 per core)
#     have seen a peak yet, which takes minutes of thread-per-connection
#     traffic to level off; empty: glibc's default)
set -eu
MINUTES=${1:?usage: server_soak.sh MINUTES [BIN]}
BIN=${2:-build/deltafin}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
command -v node > /dev/null || { echo "server_soak: node is not installed" >&2; exit 2; }
[ -f "$ROOT/tests/server/node_modules/openai/package.json" ] ||
    { echo "server_soak: run npm ci --prefix tests/server --no-audit --no-fund first" >&2; exit 2; }
[ -x "$BIN" ] || { echo "server_soak: $BIN is not built" >&2; exit 2; }

SECONDS_TOTAL=$(awk -v m="$MINUTES" 'BEGIN { s = int(m * 60 + 0.5); print (s < 10 ? 10 : s) }')
SAMPLE=${SOAK_SAMPLE_S:-$(awk -v s="$SECONDS_TOTAL" 'BEGIN { x = int(s / 90); print (x < 5 ? 5 : (x > 20 ? 20 : x)) }')}
QUEUE=${SOAK_QUEUE:-4}
CTX=256
CEILING=64
MAX_BODY=65536
KEY=soak-key
NAME=soak-tiny
RSS_JUDGE=1
if ldd "$BIN" 2> /dev/null | grep -q libasan; then
    RSS_JUDGE=0
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1}
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/deltafin-soak.XXXXXX")
PID=
cleanup() {
    [ -n "$PID" ] && kill -9 "$PID" 2> /dev/null || true
    if [ "${SOAK_KEEP:-0}" = 1 ]; then echo "server_soak: work directory kept: $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# the tiny K3 model with a tokenizer, as tests/test_server.c makes it
gzip -dc "$ROOT/tests/text/cl100k_base.tiktoken.gz" > "$TMP/cl100k"
"$BIN" synth --arch kimi_k3 --vocab 1280 --tokenizer "$TMP/cl100k" --out "$TMP/model" --force --quiet
rm -f "$TMP/cl100k"

MALLOC_ARENA_MAX=${SOAK_ARENAS-2} "$BIN" serve --model "$TMP/model" --port 0 --threads 1 --ctx $CTX --max-tokens $CEILING \
    --max-request-bytes $MAX_BODY --queue "$QUEUE" --api-key $KEY --name $NAME \
    --test-delay-ms "${SOAK_DELAY_MS:-2}" > "$TMP/out" 2> "$TMP/err" < /dev/null &
PID=$!
i=0
until grep -q ready "$TMP/out" 2> /dev/null; do
    i=$((i + 1))
    if [ $i -ge 600 ] || ! kill -0 "$PID" 2> /dev/null; then
        echo "server_soak: the server did not start:" >&2
        cat "$TMP/out" "$TMP/err" >&2
        exit 1
    fi
    sleep 0.1
done
PORT=$(sed -n 's/.*127\.0\.0\.1:\([0-9]*\).*/\1/p' "$TMP/out" | head -n 1)
echo "# server_soak: $BIN, $MINUTES min, pid $PID, port $PORT, work directory $TMP"

rc=0
DF_URL="http://127.0.0.1:$PORT" DF_KEY=$KEY DF_PID=$PID DF_NAME=$NAME DF_QUEUE=$QUEUE DF_MAX_BODY=$MAX_BODY \
DF_CTX=$CTX DF_CEILING=$CEILING SOAK_SECONDS=$SECONDS_TOTAL SOAK_SAMPLE_S=$SAMPLE SOAK_CLIENTS=${SOAK_CLIENTS:-10} \
SOAK_RSS_JUDGE=$RSS_JUDGE SOAK_RSS_TOL_PCT=${SOAK_RSS_TOL_PCT:-10} SOAK_RSS_TOL_MB=${SOAK_RSS_TOL_MB:-2} \
    node "$ROOT/bench/server_soak.mjs" || rc=$?

# a clean stop: SIGTERM, exit status 0 (ASan: no leak report)
if kill -0 "$PID" 2> /dev/null; then
    kill -TERM "$PID"
    st=0
    i=0
    while kill -0 "$PID" 2> /dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
    wait "$PID" || st=$?
    PID=
    if grep -q 'Sanitizer\|runtime error' "$TMP/err"; then
        echo "server_soak: FAIL a sanitizer report in the server's log:"
        grep -A 30 'Sanitizer\|runtime error' "$TMP/err" | head -n 60
        rc=1
    fi
    if [ "$st" -ne 0 ]; then
        echo "server_soak: FAIL the server exited with status $st at SIGTERM; the end of its log:"
        grep -v '^deltafin serve: \(chatcmpl\|cmpl\)-' "$TMP/err" | tail -n 60
        rc=1
    else
        echo "# server exited 0 at SIGTERM"
    fi
else
    echo "server_soak: FAIL the server is gone; the end of its log:"
    tail -n 60 "$TMP/err"
    PID=
    rc=1
fi
exit $rc
