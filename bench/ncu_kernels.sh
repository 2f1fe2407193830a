#!/bin/sh
# ncu_kernels.sh — device time by kernel under Nsight Compute: every launch
# of a command (or those whose name matches KERNELS, a regex) timed alone
# by ncu (gpu__time_duration.sum), summed by kernel name, largest first,
# with launch counts and the total. ncu runs each kernel with cold caches,
# so the sums sit above the same work in a warm run: compare builds with
# each other, not with bench's seconds.
#
#   KERNELS=k_mla bench/ncu_kernels.sh build/deltafin-cuda bench --decode \
#       --model M --device cuda --spine resident --tokens 1 --prompt-tokens 512
#
# Needs ncu (Nsight Compute) on PATH and python3. The command's own output
# is dropped (ncu's CSV shares stdout with it).
set -eu
NCU=${NCU:-ncu}
if [ -n "${KERNELS:-}" ]; then
    set -- --kernel-name "regex:$KERNELS" "$@"
fi
"$NCU" --csv --page raw --metrics gpu__time_duration.sum "$@" 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
hdr = next((i for i, r in enumerate(rows) if "gpu__time_duration.sum" in r and "Kernel Name" in r), None)
if hdr is None:
    sys.exit("ncu_kernels: no ncu CSV header in the output (did the command launch any kernel?)")
h = rows[hdr]
ti, ki = h.index("gpu__time_duration.sum"), h.index("Kernel Name")
unit = rows[hdr + 1][ti] if hdr + 1 < len(rows) and len(rows[hdr + 1]) > ti else ""
scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3}.get(unit)
if scale is None:
    sys.exit("ncu_kernels: unknown time unit %r" % unit)
tot = {}
for r in rows[hdr + 2:]:
    if len(r) != len(h):
        continue  # the command'"'"'s own lines, ncu notices
    try:
        ms = float(r[ti].replace(",", "")) * scale
    except ValueError:
        continue
    name = r[ki].replace("(anonymous namespace)::", "")
    name = name[5:] if name.startswith("void ") else name
    name = name.split("(")[0].strip()
    n, t = tot.get(name, (0, 0.0))
    tot[name] = (n + 1, t + ms)
for name, (n, t) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
    print("%10.3f ms %6d  %s" % (t, n, name))
print("%10.3f ms %6d  total" % (sum(t for _, t in tot.values()), sum(n for n, _ in tot.values())))
'
