#!/usr/bin/env python3
"""Checks deltafin against the reference numbers that train_k3_tiny.py wrote
beside the exported model (numpy and build/deltafin only; no PyTorch).

  1. eval/reference.json + reference_logits.bin: `deltafin logits` over the
     same tokens; the rows at the saved positions must be within --tol x
     max|logit| of Moonshot's reference module, with the same top-1 ids.
  2. eval/ppl.json + eval/val_windows.u16: the perplexity over the test
     windows, by the window rule ppl.json states (fresh state per window, no
     BOS, ctx-1 predictions per window, float64 log-softmax of float32
     logits), from `deltafin logits`; it must be within --ppl-tol (relative)
     of the reference's per-window NLL over the same windows.

    /usr/bin/python3 tools/train/check_deltafin.py --model models/kimi-k3-tiny
Prints one JSON object; exit 0 when both hold.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def deltafin_logits(binary, model, ids, vocab, extra):
    with tempfile.NamedTemporaryFile(suffix=".f32") as f:
        subprocess.run([binary, "logits", "--model", model, "--tokens", ",".join(map(str, ids)), "--out", f.name]
                       + extra, check=True, capture_output=True)
        return np.fromfile(f.name, dtype="<f4").reshape(len(ids), vocab)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO, "models", "kimi-k3-tiny"))
    ap.add_argument("--deltafin", default=os.path.join(REPO, "build", "deltafin"))
    ap.add_argument("--deltafin-args", default="", help="extra options for deltafin logits, e.g. '--threads 2'")
    ap.add_argument("--windows", type=int, default=0, help="test windows to evaluate (0: all in val_windows.u16)")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--ppl-tol", type=float, default=1e-4)
    a = ap.parse_args()
    ev = os.path.join(a.model, "eval")
    extra = a.deltafin_args.split()
    with open(os.path.join(ev, "reference.json")) as f:
        ref = json.load(f)
    with open(os.path.join(ev, "ppl.json")) as f:
        ppl = json.load(f)
    V, pos = ref["vocab"], ref["positions"]
    rows = np.fromfile(os.path.join(ev, "reference_logits.bin"), dtype="<f4").reshape(len(pos), V)
    got = deltafin_logits(a.deltafin, a.model, ref["tokens"], V, extra)[pos]
    diff = float(np.abs(got.astype(np.float64) - rows).max())
    scale = float(np.abs(rows).max())
    top1 = bool((got.argmax(-1) == rows.argmax(-1)).all())

    ctx = ppl["window"]["ctx"]
    toks = np.fromfile(os.path.join(ev, "val_windows.u16"), dtype="<u2").astype(np.int64)
    n = len(toks) // ctx if a.windows <= 0 else min(a.windows, len(toks) // ctx)
    tot = 0.0
    for w in range(n):
        ids = toks[w * ctx:(w + 1) * ctx]
        lg = deltafin_logits(a.deltafin, a.model, [int(x) for x in ids], V, extra)[:-1].astype(np.float64)
        m = lg.max(-1)
        lse = m + np.log(np.exp(lg - m[:, None]).sum(-1))
        tot += float((lse - lg[np.arange(ctx - 1), ids[1:]]).sum())
    mean = tot / (n * (ctx - 1))
    ref_mean = sum(ppl["per_window_nll_sum"][:n]) / (n * (ctx - 1))
    rel = abs(math.exp(mean) / math.exp(ref_mean) - 1)
    res = {"model": a.model, "rows": {"positions": pos, "max_abs_diff": diff, "max_abs_logit": scale,
                                      "rel": diff / scale, "top1_equal": top1, "tol": a.tol},
           "ppl": {"windows": n, "predictions": n * (ctx - 1), "deltafin": math.exp(mean),
                   "reference": math.exp(ref_mean), "rel": rel, "tol": a.ppl_tol},
           "reference": ppl.get("reference")}
    print(json.dumps(res, indent=1))
    sys.exit(0 if (diff <= a.tol * scale and top1 and rel <= a.ppl_tol) else 1)


if __name__ == "__main__":
    main()
