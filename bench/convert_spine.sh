#!/bin/sh
# convert_spine.sh — `deltafin convert-spine` throughput beside the disk's
# sequential read and write bandwidth measured in the same run (O_DIRECT
# dd of 2 GiB each), page cache dropped first (root).
#
#   bench/convert_spine.sh MODEL
#
# Prints the conversion's bytes and seconds, both disk rates, the floor
# (source bytes at the read rate + int8 bytes at the write rate, as if
# reads and writes did not overlap) and the ratio measured / floor.
set -eu
MODEL=$1
BIN=${DF_BIN:-build/deltafin}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
big=$(ls -S "$MODEL"/*.safetensors | head -1)
drop
rd=$(dd if="$big" of=/dev/null bs=16M count=128 iflag=direct 2>&1 | awk '/copied/ {print $(NF-1), $NF}')
wr=$(dd if=/dev/zero of="$MODEL/.ddprobe" bs=16M count=128 oflag=direct 2>&1 | awk '/copied/ {print $(NF-1), $NF}')
rm -f "$MODEL/.ddprobe"
drop
t0=$(date +%s.%N)
"$BIN" convert-spine "$MODEL" --force > /tmp/convert_spine.out 2>/dev/null
t1=$(date +%s.%N)
cat /tmp/convert_spine.out
python3 - "$rd" "$wr" "$t0" "$t1" "$MODEL" <<'PY'
import json, sys
def gbps(s):
    v, u = s.split()
    return float(v) * {"GB/s": 1, "MB/s": 1e-3, "kB/s": 1e-6}[u]
rd, wr, t0, t1, model = gbps(sys.argv[1]), gbps(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
m = json.load(open(model + "/int8-spine/manifest.json"))
floor = m["in_bytes"] / 1e9 / rd + m["out_bytes"] / 1e9 / wr
print(json.dumps({"in_gb": m["in_bytes"] / 1e9, "out_gb": m["out_bytes"] / 1e9, "seconds": t1 - t0,
                  "disk_read_gbps": rd, "disk_write_gbps": wr, "floor_s": floor, "ratio": (t1 - t0) / floor}))
PY
