#!/usr/bin/env python3
"""The tiny K3 model's sizes, its initial weights, and its export in the
official Kimi K3 release layout (numpy only; no PyTorch).

Owns: the model spec (one place for every size, in tools/fixtures/gen_kimi.py's
spec format so its make_config / gen_weights / np_forward apply); the
initial weights the trainer starts from (numpy RNG, so they do not depend on
the torch version or device); the writer of the release layout; a dry run
that checks the writer here, where no PyTorch is.
Refuses: anything but K3 (kind kimi_k3); a shard that would exceed the limit;
experts that are not MXFP4-representable in-dims (multiples of 32).

Sections: 1. spec  2. initial weights  3. release tensors  4. shards and
files  5. dry run (command line)

Release layout (shared/K3.md section 1): config.json with model_type kimi_k3,
KimiK3ForConditionalGeneration, a nested text_config (model_type
kimi_linear, K3's fields, the release's quantization_config); tensors under
language_model.model.* and language_model.lm_head.weight; bf16 everywhere
except the f32 small vectors (A_log, dt_bias, q/k/v_conv1d, o_norm,
e_score_correction_bias); A_log f32 [head_dim] with the per-head values first
and zeros after; routed experts as compressed-tensors MXFP4 (weight_packed
uint8 [out, in/2], weight_scale uint8 [out, in/32]), each MoE layer's experts
in one shard, back to back, in the string order of their ids ("0", "1",
"10", ...), w1_p w1_s w2_p w2_s w3_p w3_s within an expert; shards of at
most --shard-limit bytes with model.safetensors.index.json; the tokenizer
files (tiktoken.model, tokenizer_config.json) beside them.

Dry run (what can be tested without PyTorch):
    python3 tools/train/export_k3.py --dry-run --out /tmp/k3tiny_dry
  1. gen_kimi.gen_weights draws weights for the spec (release names, MXFP4
     experts on the grid); they are turned into the trainer's layout
     (Moonshot module names, A_log per head, f32) and written by export();
     the files must give back exactly gen_weights' tensors, names and dtypes.
  2. `deltafin logits` on that directory against gen_kimi.np_forward (an
     independent float64 forward written from the architecture).
  3. the trainer's initial weights (init_weights) through the same export:
     `deltafin inspect` and `deltafin run --prompt` open and run it; shard
     sizes and the total are checked against the budget.
  4. the MXFP4 fake quantiser the trainer uses (midpoint form, written here in
     numpy as mxfp4_fake_np) equals gen_kimi.mxfp4_quantize, ties included.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tools", "fixtures"))
import gen_kimi as gk  # noqa: E402

PREFIX = "language_model."
SHARD_LIMIT = 4_000_000          # bytes per shard file, header included
DEFAULT_TOKDIR = os.path.join(REPO, ".device-carry", "train", "tokenizer")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# 1. spec
# --------------------------------------------------------------------------

# Kimi K3's architecture at toy width. Ratios follow the release where they
# can: MLA every 4th layer and the last (KDA 1,2,3,5,6,7 / MLA 4,8, one-based),
# a dense layer 0, latent MoE (latent = hidden / 2 as 3584 / 7168), 2 shared
# experts of moe_inter each, SiTU 4 / 25, sigmoid router with correction bias,
# KDA gate lower bound -5 with the full-rank output gate, MLA NoPE with its
# output gate. The AttnRes block (12 of 93 layers in K3) is 2 of 8 here.
TINY = dict(
    name="kimi-k3-tiny", hidden=256, layers=8, kda_layers=[1, 2, 3, 5, 6, 7], full_layers=[4, 8],
    first_dense=1, inter=512,
    kda_heads=4, kda_dim=64, conv=4,
    mla_heads=4, q_lora=128, kv_lora=64, nope=32, rope=16, v_dim=32,
    experts=64, topk=8, moe_inter=64, latent=128, shared=2, n_group=1, topk_group=1, rsf=1.0,
    beta=4.0, lbeta=25.0, block=2, eps=1e-5,
)


def tiny_spec(tokdir=DEFAULT_TOKDIR, **override):
    """gen_kimi's spec for the tiny model; vocabulary and bos/eos/pad from the
    tokenizer directory make_corpus.py wrote (synth's config.json there)."""
    with open(os.path.join(tokdir, "config.json")) as f:
        sc = json.load(f)
    tc = sc.get("text_config", sc)
    kw = dict(TINY, vocab=tc["vocab_size"], bos=sc["bos_token_id"], eos=sc["eos_token_id"],
              pad=sc["pad_token_id"], expert_format="mxfp4", quant=True, expert_grid=True,
              a_log_shape="padded", shards=1, seeds=[0])
    kw.update(override)
    s = gk._k3(**kw)
    for n in (s["latent"], s["moe_inter"]):
        assert n % 32 == 0, "MXFP4 groups 32 inputs: expert in-dims must be multiples of 32"
    assert s["kda_dim"] > s["kda_heads"], "the release's padded A_log needs head_dim > num_heads"
    return s


def text_config(s):
    return gk.make_config(s)["text_config"]


# --------------------------------------------------------------------------
# 2. initial weights (the trainer's; Moonshot module names, f32)
# --------------------------------------------------------------------------

def is_out_proj(name):
    """Projections that write into the residual stream (scaled down at init)."""
    return name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight", "routed_expert_up_proj.weight"))


def init_weights(s, seed, std=0.02):
    """{name: float32 array} in the trainer's layout: Moonshot's module names
    (model.*, lm_head.weight; no language_model. prefix), A_log [num_heads].

    Linear and embedding weights N(0, std) (Moonshot's initializer_range);
    residual-writing projections N(0, std / sqrt(2 * layers)); norm weights 1;
    the AttnRes probes (res_proj) 0, so every block starts equally weighted;
    router correction bias 0; KDA: A_log = log U(1, 16) (Moonshot's init),
    dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (fla's),
    short convolutions U(-1/2, 1/2) (nn.Conv1d's default for 4 taps)."""
    rng = np.random.default_rng(seed)
    out_std = std / math.sqrt(2 * s["layers"])
    W = {}
    names = release_shapes(s)
    for rname, shape in names.items():
        name = rname[len(PREFIX):]
        if name.endswith("A_log"):
            W[name] = np.log(rng.uniform(1.0, 16.0, size=s["kda_heads"])).astype(np.float32)
        elif name.endswith("dt_bias"):
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), size=shape))
            W[name] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        elif "_conv1d." in name:
            W[name] = rng.uniform(-0.5, 0.5, size=shape).astype(np.float32)
        elif name.endswith("res_proj.weight") or name.endswith("e_score_correction_bias"):
            W[name] = np.zeros(shape, np.float32)
        elif len(shape) == 1:                       # RMSNorm weights
            W[name] = np.ones(shape, np.float32)
        else:
            W[name] = (rng.standard_normal(shape) * (out_std if is_out_proj(name) else std)).astype(np.float32)
    return W


# --------------------------------------------------------------------------
# 3. release tensors
# --------------------------------------------------------------------------

F32_SUFFIXES = ("A_log", "dt_bias", "_conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def release_tag(rname):
    """The release's storage of one tensor: 'MXFP4' (routed experts), 'F32'
    (the small KDA / router vectors), else 'BF16' (shared/K3.md 1.3, 1.13)."""
    if ".block_sparse_moe.experts." in rname:
        return "MXFP4"
    if rname.endswith(F32_SUFFIXES):
        return "F32"
    return "BF16"


def release_shapes(s):
    """{release name: shape as the trainer holds it} in the canonical order:
    embedding, layers in order (spine tensors, then experts by string id),
    final norm and output AttnRes, lm_head. A_log is [num_heads] here."""
    H, V = s["hidden"], s["vocab"]
    nh, kd, P = s["kda_heads"], s["kda_dim"], s["kda_heads"] * s["kda_dim"]
    mh, qd = s["mla_heads"], s["nope"] + s["rope"]
    M = PREFIX + "model."
    out = {M + "embed_tokens.weight": (V, H)}
    for i in range(s["layers"]):
        L = M + "layers.%d." % i
        spine = {L + "input_layernorm.weight": (H,), L + "post_attention_layernorm.weight": (H,),
                 L + "self_attention_res_norm.weight": (H,), L + "self_attention_res_proj.weight": (1, H),
                 L + "mlp_res_norm.weight": (H,), L + "mlp_res_proj.weight": (1, H)}
        A = L + "self_attn."
        if gk.layer_is_kda(s, i):
            spine.update({A + "q_proj.weight": (P, H), A + "k_proj.weight": (P, H), A + "v_proj.weight": (P, H),
                          A + "q_conv1d.weight": (P, 1, s["conv"]), A + "k_conv1d.weight": (P, 1, s["conv"]),
                          A + "v_conv1d.weight": (P, 1, s["conv"]), A + "A_log": (nh,),
                          A + "f_a_proj.weight": (kd, H), A + "f_b_proj.weight": (P, kd), A + "dt_bias": (P,),
                          A + "b_proj.weight": (nh, H), A + "g_proj.weight": (P, H), A + "o_norm.weight": (kd,),
                          A + "o_proj.weight": (H, P)})
        else:
            spine.update({A + "q_a_proj.weight": (s["q_lora"], H), A + "q_a_layernorm.weight": (s["q_lora"],),
                          A + "q_b_proj.weight": (mh * qd, s["q_lora"]),
                          A + "kv_a_proj_with_mqa.weight": (s["kv_lora"] + s["rope"], H),
                          A + "kv_a_layernorm.weight": (s["kv_lora"],),
                          A + "kv_b_proj.weight": (mh * (s["nope"] + s["v_dim"]), s["kv_lora"]),
                          A + "g_proj.weight": (mh * s["v_dim"], H), A + "o_proj.weight": (H, mh * s["v_dim"])})
        experts = {}
        if i < s["first_dense"]:
            spine.update({L + "mlp.gate_proj.weight": (s["inter"], H), L + "mlp.up_proj.weight": (s["inter"], H),
                          L + "mlp.down_proj.weight": (H, s["inter"])})
        else:
            B = L + "block_sparse_moe."
            E, mi, D, si = s["experts"], s["moe_inter"], s["latent"], s["moe_inter"] * s["shared"]
            spine.update({B + "gate.weight": (E, H), B + "gate.e_score_correction_bias": (E,),
                          B + "routed_expert_down_proj.weight": (D, H), B + "routed_expert_norm.weight": (D,),
                          B + "routed_expert_up_proj.weight": (H, D),
                          B + "shared_experts.gate_proj.weight": (si, H), B + "shared_experts.up_proj.weight": (si, H),
                          B + "shared_experts.down_proj.weight": (H, si)})
            for e in sorted(range(E), key=str):
                X = B + "experts.%d." % e
                experts.update({X + "w1.weight": (mi, D), X + "w2.weight": (D, mi), X + "w3.weight": (mi, D)})
        out.update(dict(sorted(spine.items())))
        out.update(experts)
    out.update({M + "norm.weight": (H,), M + "output_attn_res_norm.weight": (H,),
                M + "output_attn_res_proj.weight": (1, H), PREFIX + "lm_head.weight": (V, H)})
    return out


MXFP4_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def mxfp4_fake_np(w):
    """The trainer's MXFP4 projection in numpy (midpoint form, ties to the
    smaller magnitude, exponent from frexp): must equal gen_kimi.mxfp4_quantize."""
    out, n = w.shape
    g = w.astype(np.float32).reshape(out, n // 32, 32)
    amax = np.abs(g).max(-1, keepdims=True)
    _, ex = np.frexp(amax)                           # amax = m 2^ex, m in [0.5, 1)
    e = np.where(amax > 0, ex - 3, -2).astype(np.float64)   # floor(log2 amax) - 2
    x = g / np.exp2(e)
    idx = np.searchsorted(MXFP4_MIDPOINTS, np.abs(x), side="left")
    return (np.sign(x) * gk.E2M1[idx] * np.exp2(e)).reshape(out, n).astype(np.float32)


def release_tensors(state, s):
    """Trainer-layout f32 state -> [(release name, tag, raw array)] in the
    canonical order, and {release name: the value the files hold, as f32}."""
    shapes = release_shapes(s)
    want = {n[len(PREFIX):] for n in shapes}
    if set(state) != want:
        raise ValueError("state names differ from the spec: missing %s, unexpected %s" % (
            sorted(want - set(state))[:8], sorted(set(state) - want)[:8]))
    tensors, values = [], {}
    for rname, shape in shapes.items():
        w = np.asarray(state[rname[len(PREFIX):]], dtype=np.float32)
        if tuple(w.shape) != tuple(shape):
            raise ValueError("%s: shape %s, spec %s" % (rname, tuple(w.shape), tuple(shape)))
        tag = release_tag(rname)
        if tag == "MXFP4":
            vals, codes, scales = gk.mxfp4_quantize(w)
            packed = gk.mxfp4_pack(codes)
            assert np.array_equal(gk.mxfp4_decode(packed, scales), vals), rname
            base = rname[: -len(".weight")]
            tensors.append((base + ".weight_packed", "U8", packed))
            tensors.append((base + ".weight_scale", "U8", scales))
            values[rname] = vals
        elif tag == "F32":
            if rname.endswith("A_log"):
                w = np.asarray(gk.a_log_stored(s, w), dtype=np.float32)
            tensors.append((rname, "F32", w.astype("<f4")))
            values[rname] = w
        else:
            bits = gk.bf16_bits(w)
            tensors.append((rname, "BF16", bits))
            values[rname] = gk.bf16_to_f32(bits)
    return tensors, values


# --------------------------------------------------------------------------
# 4. shards and files
# --------------------------------------------------------------------------

def _nbytes(t):
    return int(np.asarray(t[2]).nbytes)


def _header_bound(group):
    """An upper bound of st_write's header for these tensors (offsets at 12 digits)."""
    h = {"__metadata__": {"format": "pt"}}
    for name, tag, raw in group:
        h[name] = {"dtype": tag, "shape": list(raw.shape), "data_offsets": [10 ** 11, 10 ** 11]}
    return 8 + len(json.dumps(h, separators=(",", ":"))) + 8


def plan_shards(tensors, limit):
    """Greedy packing in canonical order; a layer's routed experts form one unit."""
    units, cur_key = [], None
    for t in tensors:
        key = t[0].split(".experts.")[0] if ".block_sparse_moe.experts." in t[0] else None
        if key is not None and key == cur_key:
            units[-1].append(t)
        else:
            units.append([t])
        cur_key = key
    shards = [[]]
    for u in units:
        if shards[-1] and sum(map(_nbytes, shards[-1] + u)) + _header_bound(shards[-1] + u) > limit:
            shards.append([])
        shards[-1].extend(u)
        if sum(map(_nbytes, shards[-1])) + _header_bound(shards[-1]) > limit:
            raise ValueError("%s alone does not fit a shard of %d bytes" % (u[0][0], limit))
    return shards


def export(state, s, out, tokdir=DEFAULT_TOKDIR, limit=SHARD_LIMIT, clean=True):
    """Writes the release layout of a trainer-layout f32 state to out/.
    Returns a summary (files, sizes, bytes by kind). Files other than the
    ones written here (a README.md, eval/) are left alone unless clean
    removes the old shards."""
    tensors, values = release_tensors(state, s)
    os.makedirs(out, exist_ok=True)
    if clean:
        for f in os.listdir(out):
            if f.endswith(".safetensors") or f in ("model.safetensors.index.json", "config.json"):
                os.remove(os.path.join(out, f))
    shards = plan_shards(tensors, limit)
    n = len(shards)
    wmap, files, total = {}, [], 0
    for k, g in enumerate(shards):
        fn = "model-%05d-of-%05d.safetensors" % (k + 1, n)
        total += gk.st_write(os.path.join(out, fn), g)
        size = os.path.getsize(os.path.join(out, fn))
        if size > limit:
            raise RuntimeError("%s is %d bytes (> %d)" % (fn, size, limit))
        files.append((fn, size))
        for t in g:
            wmap[t[0]] = fn
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(gk.make_config(s), f, indent=2)
        f.write("\n")
    for fn in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tokdir, fn), os.path.join(out, fn))
    kinds = {}
    for name, tag, raw in tensors:
        k = ("embed/head" if ("embed_tokens" in name or "lm_head" in name) else
             "routed experts (MXFP4)" if tag == "U8" else "f32 vectors" if tag == "F32" else "bf16 spine")
        kinds[k] = kinds.get(k, 0) + int(raw.nbytes)
    disk = sum(sz for _, sz in files) + sum(os.path.getsize(os.path.join(out, f)) for f in (
        "model.safetensors.index.json", "config.json", "tiktoken.model", "tokenizer_config.json"))
    return {"shards": files, "tensor_bytes": total, "dir_bytes": disk, "bytes_by_kind": kinds,
            "tensors": len(tensors), "values": values}


def read_release(d, s):
    """The files as the reference loads them: {Moonshot name: f32} (experts
    decoded, bf16 widened, A_log's per-head values; its zero tail checked)."""
    vals, listing = gk.read_dir_tensors(d)
    out = {}
    for k, v in vals.items():
        kk = k[len(PREFIX):] if k.startswith(PREFIX) else k
        if kk.endswith("A_log"):
            v = gk.a_log_per_head(s, v).astype(np.float32)
        out[kk] = v
    return out, listing


# --------------------------------------------------------------------------
# 5. dry run
# --------------------------------------------------------------------------

def _run(cmd, **kw):
    log("$ " + " ".join(cmd))
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def check_fake_quant(seed=7):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((48, 256)) * rng.choice([1e-3, 0.02, 0.5, 3.0], size=(48, 1))).astype(np.float32)
    # exact midpoints and grid points of a group with amax 4 (e = 0): ties must go to the lower magnitude
    w[0, :32] = np.array([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -0.25, -0.75, -2.5, 0.0, 5.0] + [0.1] * 20)
    w[1, :32] = 0.0
    ref = gk.mxfp4_quantize(w)[0]
    got = mxfp4_fake_np(w)
    if not np.array_equal(ref, got):
        bad = np.argwhere(ref != got)[:4]
        raise AssertionError("midpoint MXFP4 projection != gen_kimi.mxfp4_quantize at %s" % bad.tolist())
    return "midpoint MXFP4 projection == gen_kimi.mxfp4_quantize on %d values (ties included)" % w.size


def dry_run(a):
    s = tiny_spec(a.tokenizer)
    report = {"spec": {k: v for k, v in s.items() if k != "seeds"}}
    log("[dry] " + check_fake_quant())

    # 1. gen_weights' tensors through the trainer layout and export()
    t0 = time.time()
    W, D, _ = gk.gen_weights(s, a.seed)
    want_names = set(release_shapes(s))
    if set(W) != want_names:
        raise AssertionError("release_shapes != gen_weights names: %s / %s" % (
            sorted(want_names - set(W))[:5], sorted(set(W) - want_names)[:5]))
    for k in W:
        if release_tag(k) != D[k]:
            raise AssertionError("%s: release_tag %s, gen_weights %s" % (k, release_tag(k), D[k]))
    state = {}
    for k, v in W.items():
        kk = k[len(PREFIX):]
        state[kk] = gk.a_log_per_head(s, v).astype(np.float32) if kk.endswith("A_log") else v
    d1 = os.path.join(a.out, "gen_weights")
    summ = export(state, s, d1, a.tokenizer)
    back, listing = read_release(d1, s)
    for k, v in W.items():
        kk = k[len(PREFIX):]
        ref = gk.a_log_per_head(s, v) if kk.endswith("A_log") else v
        if not np.array_equal(back[kk], np.asarray(ref, np.float32)):
            raise AssertionError("round trip " + k)
    for k, (tag, shape) in listing.items():
        if k.endswith("A_log") and shape != [s["kda_dim"]]:
            raise AssertionError("%s stored %s, the release stores [head_dim]" % (k, shape))
    log("[dry] gen_weights -> trainer layout -> export: %d tensors round-trip bit-exact (%.1fs)" % (
        summ["tensors"], time.time() - t0))

    # 2. deltafin logits vs the independent float64 numpy forward
    rng = np.random.default_rng(a.seed + 1)
    ids = [int(x) for x in rng.integers(0, s["vocab"] - 256, size=12)]
    Wrel = {k: (v if not k.endswith("A_log") else np.asarray(gk.a_log_stored(s, back[k[len(PREFIX):]]), np.float32))
            for k, v in W.items()}
    ref = gk.np_forward(s, Wrel, ids)
    lf = os.path.join(a.out, "logits.f32")
    _run([a.deltafin, "logits", "--model", d1, "--tokens", ",".join(map(str, ids)), "--out", lf])
    got = np.fromfile(lf, dtype="<f4").reshape(len(ids), s["vocab"])
    diff = float(np.abs(got - ref).max())
    scale = float(np.abs(ref).max())
    same_top1 = bool((got.argmax(-1) == ref.argmax(-1)).all())
    report["deltafin_vs_numpy_f64"] = {"tokens": ids, "max_abs_diff": diff, "max_abs_logit": scale,
                                       "rel": diff / scale, "top1_equal": same_top1}
    log("[dry] deltafin logits vs numpy float64 forward: max |d| %.3g of max |logit| %.3g (rel %.2e), top-1 %s" % (
        diff, scale, diff / scale, "equal" if same_top1 else "DIFFERENT"))
    if diff > 1e-3 * scale or not same_top1:
        raise AssertionError("deltafin disagrees with the numpy forward")

    # 3. the trainer's initial weights: budget, inspect, run
    d2 = os.path.join(a.out, "init")
    summ = export(init_weights(s, a.seed), s, d2, a.tokenizer)
    shards = summ["shards"]
    report["export"] = {k: v for k, v in summ.items() if k != "values"}
    log("[dry] init export: %d shards, largest %d bytes, tensors %d bytes, directory %d bytes" % (
        len(shards), max(sz for _, sz in shards), summ["tensor_bytes"], summ["dir_bytes"]))
    for k, v in sorted(summ["bytes_by_kind"].items()):
        log("        %-24s %10d bytes" % (k, v))
    if summ["dir_bytes"] > a.budget:
        raise AssertionError("directory %d bytes > budget %d" % (summ["dir_bytes"], a.budget))
    r = _run([a.deltafin, "inspect", "--model", d2])
    report["inspect"] = r.stdout
    log(r.stdout)
    r = _run([a.deltafin, "run", "--model", d2, "--prompt", "def ", "--max-new", "20", "--stats"])
    report["run"] = {"stdout": r.stdout, "stderr": r.stderr[-2000:]}
    log("[dry] run --prompt 'def ': %r\n%s" % (r.stdout, r.stderr.strip()[-600:]))
    with open(os.path.join(a.out, "dry_run.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    log("[dry] ok: %s" % os.path.join(a.out, "dry_run.json"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", required=True)
    ap.add_argument("--out", default="/tmp/k3tiny_dry")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKDIR, help="make_corpus.py's tokenizer/ directory")
    ap.add_argument("--deltafin", default=os.path.join(REPO, "build", "deltafin"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget", type=int, default=20_000_000, help="bytes for the whole model directory")
    a = ap.parse_args()
    dry_run(a)


if __name__ == "__main__":
    main()
