#!/bin/sh
# kn_pair.sh — bench/kn_stream.c on CPUs 0 and 1 at once (two engine threads'
# worth of memory traffic), the two processes' GB/s added up; one line per
# binary and round, binaries alternating so drift hits them alike.
#   bench/kn_pair.sh ROUNDS "TYPE LEVEL ROWS COLS [N [REPS]]" BIN [BIN...]
# e.g. bench/kn_pair.sh 3 "mxfp4 avx512 70000 7168" old/kn_stream build/kn_stream
set -eu
rounds=$1 args=$2
shift 2
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
i=0
while [ "$i" -lt "$rounds" ]; do
    for b in "$@"; do
        # shellcheck disable=SC2086
        taskset -c 0 "$b" $args >"$t/a" &
        # shellcheck disable=SC2086
        taskset -c 1 "$b" $args >"$t/b"
        wait
        printf '%s: ' "$b"
        cat "$t/a" "$t/b" | awk '{for (k = 1; k < NF; k++) if ($(k + 1) == "GB/s") s += $k} END {printf "%.2f GB/s together\n", s}'
    done
    i=$((i + 1))
done
