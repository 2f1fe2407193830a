#!/bin/sh
# cuda_builds_ab.sh — several builds of deltafin-cuda side by side on one
# device (a default build against bench/cuda_variant.sh's variants, or an
# earlier commit's build): for each build the md5 of the model's logits
# over the ids in IDS_FILE (equal md5: the same bits; the largest logit
# difference from the first build is printed too), then ROUNDS rounds of
# the warm prompt (`bench --decode --prompt-tokens TOKENS --prefill-again
# 3`), the builds alternating within each round so drift hits them alike,
# and each build's median over the rounds.
#
#   bench/cuda_builds_ab.sh MODEL IDS_FILE BIN [BIN ...]
#
# IDS_FILE: token ids separated by commas or white space (e.g. 200 of them,
# enough that a prompt takes the tensor-core paths). Environment: TOKENS
# (512), ROUNDS (2), ARGS (`--spine resident --bf16-tc-rows 9`), DEVICE
# (cuda). Needs python3 (the JSON and the logits' comparison).
set -eu
[ $# -ge 3 ] || { echo "usage: $0 MODEL IDS_FILE BIN [BIN ...]" >&2; exit 2; }
M=$1; IDS=$2; shift 2
T=${TOKENS:-512}; ROUNDS=${ROUNDS:-2}; DEV=${DEVICE:-cuda}
ARGS=${ARGS:---spine resident --bf16-tc-rows 9}
ids=$(tr -s ', \n\t' ',,,,' < "$IDS" | sed 's/^,//; s/,$//')
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
echo "== logits over $(echo "$ids" | tr ',' '\n' | wc -l) ids"
i=0
for b in "$@"; do
    # shellcheck disable=SC2086
    if "$b" logits --model "$M" --device "$DEV" $ARGS --tokens "$ids" --out "$d/lg$i" >/dev/null 2>"$d/err"; then
        echo "$(md5sum < "$d/lg$i" | cut -c1-32)  $b"
    else
        echo "logits failed: $b: $(tail -1 "$d/err")"
    fi
    i=$((i + 1))
done
python3 - "$d" "$#" <<'PY'
import array, os, sys
d, n = sys.argv[1], int(sys.argv[2])
def load(i):
    p = os.path.join(d, "lg%d" % i)
    if not os.path.exists(p):
        return None
    a = array.array("f")
    a.frombytes(open(p, "rb").read())
    return a
ref = load(0)
for i in range(1, n):
    x = load(i)
    if ref is None or x is None or len(x) != len(ref):
        continue
    top = max(abs(v) for v in ref) or 1.0
    m = max(abs(a - b) for a, b in zip(ref, x))
    print("build %d vs build 0: max |difference| %.3g (%.3g of the largest logit)" % (i, m, m / top))
PY
echo "== prompt of $T tokens again, $ROUNDS rounds"
r=1
while [ "$r" -le "$ROUNDS" ]; do
    for b in "$@"; do
        # shellcheck disable=SC2086
        "$b" bench --decode --model "$M" --device "$DEV" $ARGS --tokens 2 --prompt-tokens "$T" --prefill-again 3 \
            --json 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
r = d["prefill_again_runs_s"]
print("%s %.4f  runs %s  share %s" % (sys.argv[1], min(r), " ".join("%.4f" % x for x in r),
      "%.3f" % d["prefill_tc_limb_share"] if "prefill_tc_limb_share" in d else "-"))
' "$b" | tee -a "$d/runs" || echo "bench failed: $b"
    done
    r=$((r + 1))
done
echo "== medians over the rounds (each round's fastest run)"
python3 - "$d/runs" "$@" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    f = line.split()
    runs.setdefault(f[0], []).append(float(f[1]))
for b in sys.argv[2:]:
    if b in runs:
        print("%8.4f s  %s" % (statistics.median(runs[b]), b))
PY
