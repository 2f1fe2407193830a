#!/bin/sh
# lookahead.sh — router lookahead on vs off at one expert-cache size, side by
# side: rounds alternate the two so drift hits both alike; the page cache is
# dropped before each run (root) so every run reads what it needs.
#
#   bench/lookahead.sh MODEL CACHE [TOKENS] [ROUNDS]
#
# Prints one JSON object per run (bench --decode --json) with "case" added:
# s/token, bytes read per token (spine included), hit rate (prefetched
# experts are reads, not hits), lookahead precision / recall, prefetch reads
# per token. OLD_BIN=path adds a third case run with that binary and
# --ram CACHE (the expert-cache flag before --expert-cache existed).
set -eu
MODEL=$1; CACHE=$2; TOKENS=${3:-12}; ROUNDS=${4:-2}
BIN=${DF_BIN:-build/deltafin}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
one() { # case binary args...
    c=$1; b=$2; shift 2
    drop
    "$b" bench --decode --model "$MODEL" --tokens "$TOKENS" --prompt-tokens 8 --json "$@" 2>/dev/null |
        grep "\"s_per_token\"" | sed "s/^{/{\"case\": \"$c\", /"
}
i=0
while [ "$i" -lt "$ROUNDS" ]; do
    one lookahead "$BIN" --expert-cache "$CACHE"
    one no-prefetch "$BIN" --expert-cache "$CACHE" --no-prefetch
    if [ -n "${OLD_BIN:-}" ]; then one old-lookahead "$OLD_BIN" --ram "$CACHE"; fi
    i=$((i + 1))
done
