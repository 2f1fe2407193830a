#!/usr/bin/env python3
"""Cross-check deltafin against Moonshot's K3 modeling code at K3's real widths.

Tiny fixtures cannot catch a layout that only exists at real sizes (the
release's A_log is [128] for 96 heads; a 3-head fixture cannot tell "per
head, padded" from "per key channel"). This script takes a checkpoint in the
release layout at real widths, e.g.

    deltafin synth --arch kimi_k3 --preset k3-slice --experts 64 --out /data/k3w

(hidden 7168, KDA 96 x 128, MLA 96 heads q_lora 1536 / kv_lora 512, latent
MoE 3584 -> 3072 MXFP4 experts, vocabulary 163840, A_log f32 [128] with the
96 per-head values first and zeros after), builds the layer stack from
Moonshot's modeling_kimi_linear.py (the classes tools/fixtures/gen_kimi.py
uses for the K3 fixtures, with its pure-PyTorch fla stand-in), loads every
tensor with strict=True (MXFP4 experts decoded here, A_log read as the
release is: the first num_heads values, the tail checked to be zero), and
compares greedy ids and every position's logits with `deltafin logits`.

Runs where PyTorch is (a GPU is used when present, float32, TF32 off).
Prints one JSON object; exit 0 when greedy ids agree and the logits are
within --tol x max|logit|.

    python3 tools/crosscheck/k3_real_width.py --model DIR \\
        --moonshot-file .device-carry/k3ref/modeling_kimi_linear.py \\
        --deltafin build/deltafin --tokens 285,341,397,453,509,565,621,677 --max-new 8
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
import gen_kimi as gk  # noqa: E402  (Moonshot loader, fla stand-in, MsConfig)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def mxfp4_to_float(torch, packed, scale):
    """compressed-tensors mxfp4-pack-quantized -> float32 [out, in]: low nibble
    = even column, bit 3 = sign, e8m0 scale per 32 inputs = 2^(s - 127)."""
    lut = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float32, device=packed.device)
    p = packed.to(torch.int64)
    codes = torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)
    vals = lut[codes]
    s = torch.exp2(scale.to(torch.float32) - 127.0)
    return (vals.reshape(vals.shape[0], -1, 32) * s[..., None]).reshape(vals.shape[0], -1)


def load_state_dict(torch, d, cfg, dev):
    from safetensors import safe_open
    nh = cfg["linear_attn_config"]["num_heads"]
    idx = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    raw = {}
    for f in files:
        with safe_open(os.path.join(d, f), framework="pt", device=str(dev)) as h:
            for k in h.keys():
                raw[k] = h.get_tensor(k)
    sd, notes = {}, []
    for k, t in raw.items():
        kk = k[len("language_model."):] if k.startswith("language_model.") else k
        if kk.endswith(".weight_scale"):
            continue
        if kk.endswith(".weight_packed"):
            base = kk[: -len(".weight_packed")]
            sd[base + ".weight"] = mxfp4_to_float(torch, t, raw[k[: -len("_packed")] + "_scale"])
            continue
        if kk.endswith("A_log") and t.numel() > nh:
            tail = t.reshape(-1)[nh:]
            if bool((tail != 0).any()):
                raise SystemExit("%s: tail beyond num_heads is not zero" % k)
            notes.append("%s %s -> first %d values" % (kk, tuple(t.shape), nh))
            t = t.reshape(-1)[:nh].contiguous()
        sd[kk] = t.float()
    return sd, notes


def deltafin_logits(bin_, model, tokens, vocab, extra):
    out = "/tmp/k3w_logits_%d.f32" % os.getpid()
    cmd = [bin_, "logits", "--model", model, "--tokens", ",".join(map(str, tokens)), "--out", out] + extra
    t = time.time()
    subprocess.run(cmd, check=True)
    a = np.fromfile(out, dtype="<f4").reshape(len(tokens), vocab)
    os.unlink(out)
    return a, time.time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--moonshot-file", required=True)
    ap.add_argument("--deltafin", default="build/deltafin")
    ap.add_argument("--deltafin-args", default="", help="extra options, e.g. '--device cuda'")
    ap.add_argument("--tokens", default="285,341,397,453,509,565,621,677")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--work", default="/tmp/k3w_work")
    a = ap.parse_args()
    import torch
    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cj = json.load(open(os.path.join(a.model, "config.json")))
    tc = cj.get("text_config", cj)
    ml = gk.load_moonshot(a.moonshot_file, a.work)
    LM = gk.moonshot_lm_class(ml)
    t0 = time.time()
    with torch.device(dev):
        model = LM(gk.MsConfig(tc)).eval()
    sd, notes = load_state_dict(torch, a.model, tc, dev)
    model.load_state_dict(sd, strict=True)
    del sd
    log("[k3w] built and loaded in %.1fs on %s: %s" % (time.time() - t0, dev, notes[:1]))
    prompt = [int(x) for x in a.tokens.split(",")]
    ids = list(prompt)
    for _ in range(a.max_new):
        ids.append(int(np.argmax(model(ids)[-1])))
    ref = model(ids)
    greedy_ref = ids[len(prompt):]
    extra = a.deltafin_args.split() if a.deltafin_args else []
    got = subprocess.run([a.deltafin, "run", "--model", a.model, "--tokens", a.tokens, "--max-new", str(a.max_new),
                          "--ids"] + extra, check=True, capture_output=True, text=True).stdout.split()
    greedy_df = [int(x) for x in got]
    logits, secs = deltafin_logits(a.deltafin, a.model, ids, tc["vocab_size"], extra)
    diff = float(np.abs(logits.astype(np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    res = {"model": a.model, "widths": {k: tc.get(k) for k in ("hidden_size", "vocab_size", "num_attention_heads",
                                                               "q_lora_rank", "kv_lora_rank",
                                                               "routed_expert_hidden_size", "moe_intermediate_size",
                                                               "num_experts", "num_experts_per_token")},
           "kda": {k: tc["linear_attn_config"].get(k) for k in ("num_heads", "head_dim")},
           "a_log_reading": notes[:1], "prompt": prompt, "moonshot_greedy": greedy_ref, "deltafin_greedy": greedy_df,
           "greedy_equal": greedy_ref == greedy_df, "max_abs_logit_diff": diff, "max_abs_logit": scale,
           "rel": diff / scale if scale else None, "tol": a.tol, "deltafin_args": a.deltafin_args,
           "deltafin_logits_s": secs, "reference_device": str(dev), "torch": torch.__version__}
    print(json.dumps(res))
    sys.exit(0 if res["greedy_equal"] and diff <= a.tol * scale else 1)


if __name__ == "__main__":
    main()
