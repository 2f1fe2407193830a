#!/bin/sh
# spine_pass.sh — build bench/spine_pass.c and feed it MODEL's bf16 spine
# matrices (2-D, 16 rows or more, columns a multiple of 32; routed experts
# and the embedding left out), in shard and offset order.
#
#   bench/spine_pass.sh MODEL [THREADS [PASSES [anon]]]
#
# Needs `make` first (build/libdeltafin.a) and python3.
set -eu
[ $# -ge 1 ] || { echo "usage: $0 MODEL [THREADS [PASSES [anon]]]" >&2; exit 2; }
M=$1; shift
cc -std=c17 -O2 -D_GNU_SOURCE -Iinclude -pthread bench/spine_pass.c build/libdeltafin.a -lm -lpthread -o build/spine_pass
python3 - "$M" <<'PY' | build/spine_pass "$@"
import json, os, struct, sys
m = sys.argv[1]
shards = sorted(f for f in os.listdir(m) if f.endswith(".safetensors"))
for f in shards:
    p = os.path.join(m, f)
    with open(p, "rb") as b:
        n = struct.unpack("<Q", b.read(8))[0]
        h = json.loads(b.read(n))
    rows = []
    for k, v in h.items():
        if k == "__metadata__" or v["dtype"] != "BF16" or len(v["shape"]) != 2:
            continue
        if (".experts." in k and "shared" not in k) or "embed" in k:
            continue
        r, c = v["shape"]
        if r >= 16 and c % 32 == 0:
            rows.append((v["data_offsets"][0] + 8 + n, r, c, k))
    for off, r, c, k in sorted(rows):
        print(p, off, r, c, k)
PY
