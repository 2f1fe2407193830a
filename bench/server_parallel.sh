#!/bin/sh
# server_parallel.sh — `deltafin serve --parallel` under 1, 2, 4 and 8
# concurrent clients: aggregate generated tokens/s and per-request latency
# (median, max), in RAM and with routed experts streamed from disk (a small
# expert cache, O_DIRECT reads). Every client sends REQS requests one after
# the other (a distinct prompt of 16 ids each, greedy, TOKENS tokens with the
# end-of-sequence id banned so every request makes all of them). After each
# run the server's /metrics give rows per step, the routed experts a pass
# ran (summed over MoE layers), solo / union (how many times more expert
# passes the requests would have made alone) and the bytes that saved.
#
#   sh bench/server_parallel.sh BIN MODEL [TOKENS] [REQS] [DISK_CACHE] [EXTRA]
#
# MODEL needs a tokenizer (e.g. `deltafin synth --arch kimi_k3 --preset
# k3-slice --gb 6 --tokenizer RANKS --out M`). TOKENS default 16, REQS 2,
# DISK_CACHE (the --expert-cache of the disk regime) 600M; EXTRA: more serve
# options (e.g. "--threads 2"); REGIMES="ram" (environment) runs one regime.
# CLIENTS="1 8" (environment) picks the client counts. Quote the medians of a
# few runs: timings on a shared machine are noisy.
set -eu
BIN=${1:?usage: server_parallel.sh BIN MODEL [TOKENS] [REQS] [DISK_CACHE] [EXTRA]}
MODEL=${2:?usage: server_parallel.sh BIN MODEL [TOKENS] [REQS] [DISK_CACHE] [EXTRA]}
T=${3:-16}
R=${4:-2}
DC=${5:-600M}
EXTRA=${6:-}
TMP=$(mktemp -d)
PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
EOS=$(python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c=c.get('text_config',c); e=c.get('eos_token_id',0); print(e[0] if isinstance(e,list) else e)" "$MODEL/config.json")

serve() { # regime name, extra serve options
    "$BIN" serve --model "$MODEL" --port 0 --parallel 8 --queue 64 --ctx 512 $EXTRA $2 > "$TMP/out" 2> "$TMP/err" &
    PID=$!
    i=0
    until grep -q ready "$TMP/out" 2>/dev/null; do
        i=$((i + 1)); [ $i -lt 1200 ] || { cat "$TMP/err"; exit 1; }
        sleep 0.1
    done
    PORT=$(sed -n 's/.*127.0.0.1:\([0-9]*\).*/\1/p' "$TMP/out")
    # warm-up: the spine's pages and the expert cache
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\": [1,2,3,4], \"max_tokens\": 4, \"temperature\": 0}" > /dev/null
    for C in ${CLIENTS:-1 2 4 8}; do
        python3 - "$PORT" "$C" "$R" "$T" "$EOS" "$1" <<'PY'
import json, statistics, sys, threading, time, urllib.request
port, C, R, T, eos, regime = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
url = "http://127.0.0.1:%d" % port
def metrics():
    out = {}
    for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out
lat, toks, lock = [], [0], threading.Lock()
def client(c):
    for r in range(R):
        ids = [((c * 131 + r * 17 + i) * 7919) % 500 + 1 for i in range(16)]
        body = json.dumps({"prompt": ids, "max_tokens": T, "temperature": 0, "logit_bias": {str(eos): -100}}).encode()
        t = time.time()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        resp = json.loads(urllib.request.urlopen(req, timeout=3600).read())
        with lock:
            lat.append(time.time() - t)
            toks[0] += resp["usage"]["completion_tokens"]
m0 = metrics()
t0 = time.time()
th = [threading.Thread(target=client, args=(c,)) for c in range(C)]
for t in th: t.start()
for t in th: t.join()
wall = time.time() - t0
m1 = metrics()
d = lambda k: m1.get(k, 0) - m0.get(k, 0)
steps = d("deltafin_steps_total")
passes = d("deltafin_passes_total")
print(json.dumps({"regime": regime, "clients": C, "requests": C * R, "tokens": toks[0], "wall_s": round(wall, 3),
                  "tokens_per_s": round(toks[0] / wall, 3),
                  "latency_median_s": round(statistics.median(lat), 3), "latency_max_s": round(max(lat), 3),
                  "rows_per_step": round(d("deltafin_step_rows_total") / steps, 2) if steps else 0,
                  "expert_union_per_pass": round(d("deltafin_expert_union_total") / passes, 2) if passes else 0,
                  "expert_solo_over_union": round(d("deltafin_expert_solo_total") / d("deltafin_expert_union_total"), 3) if d("deltafin_expert_union_total") else 0,
                  "expert_gb_saved": round(d("deltafin_expert_bytes_saved_total") / 1e9, 3),
                  "expert_gb_read": round(d("deltafin_expert_bytes_read_total") / 1e9, 3)}))
PY
    done
    kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
}
for r in ${REGIMES:-ram disk}; do
    case $r in
    ram) serve ram "" ;;
    disk) serve disk "--expert-cache $DC" ;;
    esac
done
