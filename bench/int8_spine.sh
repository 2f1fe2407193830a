#!/bin/sh
# int8_spine.sh — decode with the checkpoint's spine vs the int8 spine, side
# by side (rounds alternate), page cache dropped before each run (root):
#   1. everything the plan wants in RAM (the default budget);
#   2. the process in a cgroup of LIMIT_GIB (v1 or v2 memory controller),
#      where the bf16 spine cannot stay resident and the int8 one can.
#
#   bench/int8_spine.sh MODEL [LIMIT_GIB] [TOKENS] [ROUNDS]
#
# MODEL must hold a conversion (deltafin convert-spine MODEL). One JSON
# object per run (bench --decode --json) with "case" added.
set -eu
MODEL=$1; LIMIT=${2:-8}; TOKENS=${3:-8}; ROUNDS=${4:-2}
BIN=${DF_BIN:-build/deltafin}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
if [ -d /sys/fs/cgroup/memory ]; then
    CG=/sys/fs/cgroup/memory/deltafin-int8-$$; mkdir "$CG"
    echo $((LIMIT * 1024 * 1024 * 1024)) > "$CG/memory.limit_in_bytes"
else
    CG=/sys/fs/cgroup/deltafin-int8-$$; mkdir "$CG"
    echo $((LIMIT * 1024 * 1024 * 1024)) > "$CG/memory.max"
fi
trap 'rmdir "$CG" 2>/dev/null || true' EXIT
one() { # case cgroup(0/1) args...
    c=$1; g=$2; shift 2
    drop
    if [ "$g" = 1 ]; then
        sh -c "echo \$\$ > $CG/cgroup.procs 2>/dev/null || echo \$\$ > $CG/tasks; exec $BIN bench --decode --model $MODEL --tokens $TOKENS --json $*"
    else
        "$BIN" bench --decode --model "$MODEL" --tokens "$TOKENS" --json "$@"
    fi 2>/dev/null | grep '"s_per_token"' | sed "s/^{/{\"case\": \"$c\", /"
}
i=0
while [ "$i" -lt "$ROUNDS" ]; do
    one ram-bf16 0 --spine-dtype bf16
    one ram-int8 0 --spine-dtype int8
    one limit${LIMIT}g-bf16 1 --spine-dtype bf16
    one limit${LIMIT}g-int8 1 --spine-dtype int8
    i=$((i + 1))
done
