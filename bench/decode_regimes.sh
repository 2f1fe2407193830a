#!/bin/sh
# decode_regimes.sh — `deltafin bench --decode` under a memory limit, expert
# I/O direct vs mmap, side by side, page cache dropped before each run.
#
#   bench/decode_regimes.sh MODEL LIMIT_GIB RAM [TOKENS] [ROUNDS]
#
# LIMIT_GIB caps the whole process (page cache included) with a cgroup v1
# memory controller (needs root and /sys/fs/cgroup/memory); RAM is the
# --expert-cache budget of the direct runs. Prints one JSON object per
# run (rounds alternate direct / mmap so drift hits both alike).
set -eu
MODEL=$1; LIMIT=$2; RAM=$3; TOKENS=${4:-8}; ROUNDS=${5:-2}
BIN=${DF_BIN:-build/deltafin}
CG=/sys/fs/cgroup/memory/deltafin-bench-$$
mkdir "$CG"
trap 'rmdir "$CG" 2>/dev/null || true' EXIT
echo $((LIMIT * 1024 * 1024 * 1024)) > "$CG/memory.limit_in_bytes"
run() {
    sync; echo 3 > /proc/sys/vm/drop_caches
    sh -c "echo \$\$ > $CG/tasks; exec $BIN bench --decode --model $MODEL --tokens $TOKENS --json $*"
}
i=0
while [ $i -lt "$ROUNDS" ]; do
    run --io direct --expert-cache "$RAM"
    run --io mmap
    i=$((i + 1))
done
