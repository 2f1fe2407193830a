#!/usr/bin/env python3
"""Routing, caches and lossy knobs measured on the trained tiny K3 beside the
same architecture with random weights (issue 17).

    python3 bench/trained_routing.py [--random DIR] [--windows 4] [--bin build/deltafin]

Every figure comes from `deltafin eval` on held-out windows of
models/kimi-k3-tiny/eval/val_windows.u16, routed token by token (--chunk 1,
as decode does):

  * expert cache hit rate and bytes read by cache size, with router
    lookahead and without, and the lookahead's precision and recall;
  * heat pinning: heat learnt on windows 0..W-1, then windows W..2W-1 with
    a small cache, LRU alone vs --heat --pin;
  * lossy knobs against the exact run's logits (KL mean / max, top-1,
    perplexity): --top-k 6 and 4 of 8, the int8 spine.

--random: a random-weight model of the same architecture (default: made by
tools/train/export_k3.py --dry-run, whose 'init' export has the trained
model's shapes). Prints markdown tables.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TRAINED = os.path.join(REPO, "models", "kimi-k3-tiny")
WINDOWS = os.path.join(TRAINED, "eval", "val_windows.u16")
CTX = 256


def run_eval(bin_, model, tokens, windows, *extra):
    cmd = [bin_, "eval", "--model", model, "--tokens-file", tokens, "--ctx", str(CTX), "--windows", str(windows),
           "--json"] + list(extra)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("failed: %s\n%s" % (" ".join(cmd), r.stderr[-2000:]))
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", default=None)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "deltafin"))
    ap.add_argument("--only", default="cache,heat,lossy", help="which tables")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="df-routing-")
    rand = a.random
    if not rand:
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "train", "export_k3.py"), "--dry-run", "--out",
                        os.path.join(work, "rand")], check=True, capture_output=True)
        rand = os.path.join(work, "rand", "init")
    W = a.windows
    data = open(WINDOWS, "rb").read()
    first = os.path.join(work, "first.u16")
    later = os.path.join(work, "later.u16")
    open(first, "wb").write(data[: W * CTX * 2])
    open(later, "wb").write(data[W * CTX * 2: 2 * W * CTX * 2])
    models = [("trained", TRAINED), ("random", rand)]
    # all experts: 7 MoE layers x 64; a slot holds one expert (~20 KB with alignment)
    caches = ["256K", "512K", "1M", "2M", "4M", "16M"]
    if "cache" not in a.only:
        caches = []
    print("## Expert cache by size (token by token, %d windows of %d; 56 experts per token)\n" % (W, CTX))
    print("| model | cache | slots | hit rate (lookahead) | MB read (lookahead) | precision / recall | hit rate (none) | MB read (none) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, m in models:
        for c in caches:
            on = run_eval(a.bin, m, first, W, "--chunk", "1", "--expert-cache", c, "--spine-dtype", "bf16")
            off = run_eval(a.bin, m, first, W, "--chunk", "1", "--expert-cache", c, "--no-prefetch", "--spine-dtype", "bf16")
            print("| %s | %s | %d | %.1f%% | %.1f | %.0f%% / %.0f%% | %.1f%% | %.1f |" % (
                name, c, on["cache_slots"], 100 * on["expert_hit_rate"], on["expert_bytes_read"] / 1e6,
                100 * on["prefetch_precision"], 100 * on["prefetch_recall"], 100 * off["expert_hit_rate"],
                off["expert_bytes_read"] / 1e6), flush=True)
    print("\n## Heat pinning (heat from windows 0..%d, measured on windows %d..%d, 4M cache, no lookahead)\n" % (
        W - 1, W, 2 * W - 1))
    print("| model | LRU hit rate | --pin 1M hit rate | LRU MB read | pinned MB read |")
    print("| --- | --- | --- | --- | --- |")
    for name, m in models if "heat" in a.only else []:
        heat = os.path.join(work, name + ".heat.json")
        run_eval(a.bin, m, first, W, "--chunk", "1", "--heat", heat, "--no-prefetch", "--spine-dtype", "bf16")
        lru = run_eval(a.bin, m, later, W, "--chunk", "1", "--expert-cache", "4M", "--no-prefetch", "--spine-dtype", "bf16")
        pin = run_eval(a.bin, m, later, W, "--chunk", "1", "--expert-cache", "4M", "--no-prefetch", "--heat", heat,
                       "--pin", "1M", "--spine-dtype", "bf16")
        print("| %s | %.1f%% | %.1f%% | %.1f | %.1f |" % (name, 100 * lru["expert_hit_rate"], 100 * pin["expert_hit_rate"],
                                                     lru["expert_bytes_read"] / 1e6, pin["expert_bytes_read"] / 1e6),
              flush=True)
    print("\n## Lossy knobs against the exact logits (%d windows)\n" % W)
    print("| model | setting | perplexity | base perplexity | KL mean | KL max | top-1 agreement |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, m in models if "lossy" in a.only else []:
        copy = os.path.join(work, name + "-copy")
        shutil.copytree(m, copy)
        base = os.path.join(work, name + ".lg")
        run_eval(a.bin, copy, first, W, "--spine-dtype", "bf16", "--save-logits", base)
        subprocess.run([a.bin, "convert-spine", copy], check=True, capture_output=True)
        for label, extra in (("--top-k 6 of 8", ["--top-k", "6", "--spine-dtype", "bf16"]),
                             ("--top-k 4 of 8", ["--top-k", "4", "--spine-dtype", "bf16"]),
                             ("int8 spine", ["--spine-dtype", "int8"]),
                             ("int8 spine + --top-k 6", ["--spine-dtype", "int8", "--top-k", "6"])):
            r = run_eval(a.bin, copy, first, W, "--base-logits", base, *extra)
            print("| %s | %s | %.4f | %.4f | %.5f | %.4f | %.2f%% |" % (name, label, r["ppl"], r["base_ppl"], r["kl_mean"],
                                                                    r["kl_max"], 100 * r["top1_agreement"]), flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
