#!/bin/sh
# throttled.sh — runs a command with the reads of one block device capped at
# a fixed rate, so reads-under-compute runs see the same "disk" every time.
# A cloud VM's disk drifts 2x within minutes (bench/cpu_NOTES.md); with a
# cap the disk probe reads the cap and the ratios repeat to 1%.
#
#   bench/throttled.sh BYTES_PER_S PATH COMMAND [ARGS...]
#
# BYTES_PER_S: the cap (e.g. 600000000); pick one the disk sustains (the
# probe then reads the cap itself). PATH: a file on the device to cap (the
# model's folder). Needs root and the cgroup v1 blkio controller or the v2
# io controller; O_DIRECT and buffered reads are both capped, reads served
# from the page cache are not (warm the spine first, drop nothing).
#
# Example (the 8-layer K3-width slice, 512 MB expert cache):
#   cat /tmp/k8/*.safetensors > /dev/null
#   bench/throttled.sh 600000000 /tmp/k8 build/deltafin bench --decode \
#       --model /tmp/k8 --expert-cache 512M --tokens 10 --prompt-tokens 8
set -eu
[ $# -ge 3 ] || { echo "usage: $0 BYTES_PER_S PATH COMMAND [ARGS...]" >&2; exit 2; }
BPS=$1; P=$2; shift 2
# the whole disk under PATH (a partition's parent holds the queue)
dev=$(stat -c '%d' "$P")
mm="$((dev / 256)):$((dev % 256))"
sys=/sys/dev/block/$mm
[ -e "$sys" ] || { echo "$0: no block device $mm under $P" >&2; exit 1; }
if [ -e "$sys/partition" ]; then mm=$(cat "$sys/../dev"); fi
name=deltafin-throttled-$$
v1=/sys/fs/cgroup/blkio
v2=
for d in /sys/fs/cgroup /sys/fs/cgroup/unified; do
    if [ -e "$d/cgroup.controllers" ] && grep -qw io "$d/cgroup.controllers"; then v2=$d; break; fi
done
if [ -w "$v1" ] && [ -e "$v1/blkio.throttle.read_bps_device" ]; then
    cg=$v1/$name
    mkdir "$cg"
    trap 'rmdir "$cg" 2>/dev/null || true' EXIT
    echo "$mm $BPS" > "$cg/blkio.throttle.read_bps_device"
elif [ -n "$v2" ]; then
    cg=$v2/$name
    grep -qw io "$v2/cgroup.subtree_control" || echo +io > "$v2/cgroup.subtree_control"
    mkdir "$cg"
    trap 'rmdir "$cg" 2>/dev/null || true' EXIT
    echo "$mm rbps=$BPS" > "$cg/io.max"
else
    echo "$0: no blkio (cgroup v1) or io (cgroup v2) controller to cap reads with" >&2
    exit 1
fi
echo "throttled: reads of $mm capped at $BPS bytes/s ($cg)" >&2
# the command runs in a child shell placed in the cgroup, so this shell can
# remove the cgroup once it ends
sh -c 'echo $$ > "$1"/cgroup.procs && shift && exec "$@"' sh "$cg" "$@"
