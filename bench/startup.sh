#!/bin/sh
# startup.sh — how long a model takes to open: `inspect` and `run` (engine
# open, session, first token) with the page cache dropped (cold) and
# warm, with the parsed-metadata cache (src/format/st_cache.c) and without
# it (--meta-cache off), rounds alternating so drift hits every case alike.
#
#   bench/startup.sh MODEL [ROUNDS] [RUN_ARGS]
#
# MODEL: e.g. the sparse full-size K3 (`deltafin synth --arch kimi_k3
# --preset full --sparse --out /tmp/k3full`: headers only, 130 MB on disk).
# Cold runs need root (drop_caches); without it every run is warm. The
# metadata cache lives in a folder of its own (removed at the end), primed
# by one run before the rounds. RUN_ARGS (default "--ram 8G") go to `run`;
# RUN=0 skips the `run` cases (their first token streams the whole spine:
# ~140 GB of holes on the sparse K3, a minute or more). Prints one line per
# run, then the median of each case:
#   inspect  cold|warm  cache|parse  SECONDS
#   run      cold|warm  cache|parse  open SECONDS  first-token SECONDS
set -eu
MODEL=$1; ROUNDS=${2:-5}; RUN_ARGS=${3:---ram 8G}
BIN=${DF_BIN:-build/deltafin}
MC=$(mktemp -d /tmp/df-startup-meta.XXXXXX)
OUT=$(mktemp /tmp/df-startup.XXXXXX)
trap 'rm -rf "$MC" "$OUT"' EXIT
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
now() { date +%s.%N; }
inspect() { # temp cache-mode
    [ "$1" = cold ] && drop
    mc=$MC; [ "$2" = parse ] && mc=off
    t0=$(now)
    "$BIN" inspect --model "$MODEL" --meta-cache "$mc" >/dev/null
    t1=$(now)
    echo "inspect $1 $2 $(echo "$t1 - $t0" | bc)" | tee -a "$OUT"
}
run() { # temp cache-mode
    [ "$1" = cold ] && drop
    mc=$MC; [ "$2" = parse ] && mc=off
    # shellcheck disable=SC2086
    line=$("$BIN" run --model "$MODEL" --tokens 1 --max-new 1 --ids --stats --meta-cache "$mc" $RUN_ARGS 2>&1 >/dev/null | grep '^open:')
    o=$(echo "$line" | sed 's/^open: \([0-9.]*\) s.*/\1/')
    f=$(echo "$line" | sed 's/.*first token \([0-9.]*\) s.*/\1/')
    echo "run $1 $2 open $o first-token $f" | tee -a "$OUT"
}
"$BIN" inspect --model "$MODEL" --meta-cache "$MC" >/dev/null # prime the cache
i=0
while [ "$i" -lt "$ROUNDS" ]; do
    for c in cache parse; do
        inspect cold $c
        inspect warm $c
        if [ "${RUN:-1}" != 0 ]; then run cold $c; run warm $c; fi
    done
    i=$((i + 1))
done
echo "medians over $ROUNDS rounds (seconds):"
awk '{ k = $1 " " $2 " " $3; v = ($1 == "inspect") ? $4 : $5; n[k]++; a[k, n[k]] = v;
       if ($1 == "run") { f[k, n[k]] = $7 } }
     END { for (k in n) { m = n[k];
             for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[k, j] < a[k, i]) { t = a[k, i]; a[k, i] = a[k, j]; a[k, j] = t }
             med = (m % 2) ? a[k, (m + 1) / 2] : (a[k, m / 2] + a[k, m / 2 + 1]) / 2;
             line = sprintf("  %-22s %s %.3f (min %.3f, max %.3f)", k, (k ~ /^run/) ? "open" : "    ", med, a[k, 1], a[k, m]);
             if (k ~ /^run/) { for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (f[k, j] < f[k, i]) { t = f[k, i]; f[k, i] = f[k, j]; f[k, j] = t }
                               fm = (m % 2) ? f[k, (m + 1) / 2] : (f[k, m / 2] + f[k, m / 2 + 1]) / 2;
                               line = line sprintf("  first token %.3f", fm) }
             print line } }' "$OUT" | sort
