#!/usr/bin/env python3
"""timeline_gaps.py — where the device waited in a GPU_TIMELINE trace.

Reads the file a GPU_TIMELINE build writes with DF_TL_TRACE=FILE (one line
a hook call: hook, host ms at entry and exit, device ms at the call's two
events) and splits it into passes at host pauses of PAUSE ms or more between
calls (a prompt is one pass; bench's prompts are apart by far more). For the
pass given (default: the last of at least MIN calls) it prints the pass's
device span, the device time inside hook calls, the device's idle gaps
between calls (summed by the hook that followed the gap) and the largest
gaps with the host's time before them.

    DF_TL_TRACE=/tmp/tl.txt build/t-deltafin-cuda bench --decode ... --prefill-again 2
    bench/timeline_gaps.py /tmp/tl.txt [--pass N] [--pause 20] [--min 50]
"""
import argparse
import sys
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--pass", dest="pas", type=int, default=None, help="pass index (default: the last large one)")
    ap.add_argument("--pause", type=float, default=20.0, help="host ms between calls that starts a new pass")
    ap.add_argument("--min", type=int, default=50, help="calls a pass needs to count as large")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    calls = []
    with open(a.trace) as f:
        for line in f:
            p = line.split()
            if len(p) != 5:
                continue
            calls.append((p[0], float(p[1]), float(p[2]), float(p[3]), float(p[4])))
    if not calls:
        sys.exit("timeline_gaps: no calls in %s" % a.trace)
    passes, cur = [], [calls[0]]
    for c in calls[1:]:
        if c[1] - cur[-1][2] >= a.pause:
            passes.append(cur)
            cur = []
        cur.append(c)
    passes.append(cur)
    big = [i for i, p in enumerate(passes) if len(p) >= a.min]
    print("%d passes; large (>= %d calls): %s" % (len(passes), a.min, " ".join(
        "%d:%d calls %.2f ms" % (i, len(passes[i]), passes[i][-1][4] - passes[i][0][3]) for i in big)))
    i = a.pas if a.pas is not None else (big[-1] if big else len(passes) - 1)
    if not 0 <= i < len(passes):
        sys.exit("timeline_gaps: no pass %d (the trace has %d)" % (i, len(passes)))
    p = passes[i]
    span = p[-1][4] - p[0][3]
    inside = sum(c[4] - c[3] for c in p)
    by_hook = defaultdict(lambda: [0, 0.0, 0.0])
    gaps = []
    for prev, c in zip(p, p[1:]):
        g = max(0.0, c[3] - prev[4])
        by_hook[c[0]][1] += g
        gaps.append((g, prev[0], c[0], c[1] - prev[2]))
    for c in p:
        by_hook[c[0]][0] += 1
        by_hook[c[0]][2] += c[4] - c[3]
    print("pass %d: %d calls, device span %.3f ms, inside calls %.3f ms, gaps %.3f ms; host %.3f ms first entry to last exit"
          % (i, len(p), span, inside, span - inside, p[-1][2] - p[0][1]))
    print("%-14s %6s %10s %12s" % ("hook", "calls", "inside ms", "gap before"))
    for h, (n, g, t) in sorted(by_hook.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print("%-14s %6d %10.3f %12.3f" % (h, n, t, g))
    print("largest gaps (ms; host ms between the calls):")
    for g, a0, b0, hg in sorted(gaps, reverse=True)[: a.top]:
        print("  %8.3f  %s -> %s  (host %.3f)" % (g, a0, b0, hg))


if __name__ == "__main__":
    main()
