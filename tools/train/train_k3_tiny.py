#!/usr/bin/env python3
"""Train the tiny Kimi K3 model (models/kimi-k3-tiny) on one GPU, export it
in the K3 release layout, and measure it with Moonshot's reference module.

Owns: the training model (Moonshot's own layer classes with a batched
forward), the training-only fast paths (chunkwise KDA, dense latent MoE with
MXFP4 fake quantisation), the router's load-balancing bias update, the
training loop, and the final reference evaluation of the exported files.
Refuses: to start when a self-check fails (the fast paths must equal the
reference first); to evaluate anything but the exported files.

Sections: 1. setup and data  2. model (reference classes, fast paths)
3. self-checks  4. training  5. export and reference evaluation  6. main

The model is built from Moonshot's modeling_kimi_linear.py (KimiDecoderLayer,
KimiRMSNorm, _apply_attn_res; the fla stand-in of tools/fixtures/gen_kimi.py)
with the sizes of tools/train/export_k3.py (TINY). Two of its pieces cannot
train as written, so training replaces them, in this process only:
  - KimiSparseMoeBlock.forward / KimiMoEGate.forward refuse training
    (`assert not self.training`, NotImplementedError; moe_infer is no_grad).
    moe_forward_train computes the same function with gradients: router
    logits in f32, sigmoid scores, selection by scores + e_score_correction_bias
    (top-k, no groups), weights = the selected scores renormalised times
    routed_scaling_factor, the routed sum in the latent space through every
    expert at once (unselected experts get weight 0), routed_expert_norm,
    routed_expert_up_proj, plus the shared experts; it reuses the block's
    modules and parameters (and the experts' SituAndMul).
  - the stand-in's KDA is a per-token Python loop; kda_chunk.kda_chunked is
    the same recurrence in chunks (checked here against the stand-in before
    training starts).
The router's correction bias is not trained by gradient: after each step it
moves towards balance by DeepSeek-V3's auxiliary-loss-free rule,
bias_e += u * sign(mean load - load_e), with u = --bias-update scaled by the
learning-rate schedule (the router moves fast early; at 150 CPU steps a fixed
3e-3 was still catching up), plus DeepSeek-V3's small sequence-wise balance
loss (--aux-alpha). The last --qat-frac of the steps
fake-quantise w1/w2/w3 of every routed expert to the MXFP4 grid (per 32
inputs: e = floor(log2 max|w|) - 2, values e2m1 * 2^e; straight-through
gradient), so the exported MXFP4 experts are exactly the trained ones.

The final numbers come from the exported files only: they are read back
(bf16 spine, MXFP4 experts decoded, f32 vectors), loaded with strict=True
into Moonshot's modules with the stand-in's per-token KDA (the reference
fixtures' path), and run in float32 with TF32 off, one held-out window at a
time (gen_kimi.moonshot_lm_class). That perplexity is the number
`deltafin eval` must match (eval/ppl.json says how the windows are cut).

Run on the GPU machine (Python 3.12, torch, transformers 5.17, einops, numpy,
safetensors), from the repository root, after make_corpus.py:
    python3 tools/train/train_k3_tiny.py --minutes 5          # the model
    python3 tools/train/train_k3_tiny.py --smoke --out /tmp/k3tiny_smoke   # 1-2 min check
Deterministic: fixed seeds, a fixed data order, deterministic algorithms; the
same --steps on the same software and GPU give the same model (--minutes
picks --steps from the measured step time; the log says which, and
--steps N reproduces it).
"""
import argparse
import functools
import json
import math
import os
import platform
import sys
import time
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS; set before torch loads

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools", "fixtures"))
import export_k3 as ex  # noqa: E402
import gen_kimi as gk  # noqa: E402
import kda_chunk as kc  # noqa: E402
from make_corpus import sha256_file  # noqa: E402

DATA = os.path.join(REPO, ".device-carry", "train")
REF_POSITIONS = [0, 1, 2, 7, 31, 63, 127, 255]     # rows of eval/reference_logits.bin (window 0)


def log(*a):
    print("[%s] " % time.strftime("%H:%M:%S") + " ".join(str(x) for x in a), flush=True)


# --------------------------------------------------------------------------
# 1. setup and data
# --------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DATA, help="make_corpus.py's output (train.bin, val.bin, tokenizer/)")
    ap.add_argument("--moonshot-file", default=None,
                    help="Moonshot's modeling_kimi_linear.py (default: DATA/k3ref/, else .device-carry/k3ref/)")
    ap.add_argument("--out", default=None,
                    help="the exported model (release layout) and eval/ (default: models/kimi-k3-tiny; "
                         "with --smoke /tmp/k3tiny_smoke)")
    ap.add_argument("--work", default=None, help="log, f32 checkpoint (default: DATA/run)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="training-loop budget: after step 30 the step count becomes min(--steps, what fits); "
                         "export and the reference evaluation come after (about 2 min)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--qat-frac", type=float, default=0.2, help="last fraction of steps with MXFP4 fake-quantised experts")
    ap.add_argument("--bias-update", type=float, default=1e-2,
                    help="router correction-bias step at the peak learning rate; it follows the learning-rate "
                         "schedule (1e-3 at the end, DeepSeek-V3's value for its far longer run)")
    ap.add_argument("--aux-alpha", type=float, default=1e-4, help="sequence-wise balance loss weight")
    ap.add_argument("--chunk", type=int, default=32, help="KDA chunk length of the training path")
    ap.add_argument("--tf32", action="store_true",
                    help="TF32 matmuls while training (the step is launch-bound at this size: off by default)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-ctx", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=0, help="reference windows (0: every full window of val.bin)")
    ap.add_argument("--test-windows", type=int, default=128, help="windows saved beside the model for deltafin's test")
    ap.add_argument("--export-only", action="store_true", help="export + evaluate WORK/ckpt_f32.pt (no training)")
    ap.add_argument("--selftest-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="30 steps, 4 reference windows: a pipeline check")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.warmup, a.eval_every, a.eval_windows, a.test_windows = 30, 10, 15, 4, 4
    a.out = a.out or (os.path.join("/tmp", "k3tiny_smoke") if a.smoke else os.path.join(REPO, "models", "kimi-k3-tiny"))
    a.work = a.work or os.path.join(a.data, "run")
    if a.moonshot_file is None:
        for p in (os.path.join(a.data, "k3ref", "modeling_kimi_linear.py"),
                  os.path.join(REPO, ".device-carry", "k3ref", "modeling_kimi_linear.py")):
            if os.path.exists(p):
                a.moonshot_file = p
                break
        else:
            ap.error("Moonshot's modeling_kimi_linear.py not found; pass --moonshot-file")
    assert a.warmup >= 30 or a.smoke, "--minutes decides the step count at step 30: keep --warmup >= 30"
    return a


def load_tokens(path):
    a = np.fromfile(path, dtype="<u2")
    return a.astype(np.int64)


def check_corpus(data):
    """The token files must be the ones the manifest describes."""
    with open(os.path.join(data, "manifest.json")) as f:
        m = json.load(f)
    for fn in ("train.bin", "val.bin", "tokenizer/tiktoken.model", "tokenizer/tokenizer_config.json"):
        got = sha256_file(os.path.join(data, fn))
        if got != m["outputs_sha256"][fn]:
            raise SystemExit("%s: sha256 %s differs from manifest.json" % (fn, got))
    return m


# --------------------------------------------------------------------------
# 2. model: the reference classes, the training paths
# --------------------------------------------------------------------------

class Run:
    """Flags and per-step records shared by the patched MoE blocks."""

    def __init__(self, aux_alpha):
        self.qat = False
        self.collect = False     # training step: keep loads and the balance loss
        self.aux_alpha = aux_alpha
        self.loads = {}          # block -> selections per expert (this step)
        self.aux = []


def make_mxfp4_fake(torch):
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    cache = {}

    def fake(w):
        """w [..., out, in] -> w projected on the MXFP4 grid per 32 inputs, with a
        straight-through gradient. Same values as gen_kimi.mxfp4_quantize: the
        exponent from frexp (floor(log2 amax) - 2; -2 when the group is 0), the
        scale built from its bits (exact), the nearest e2m1 by midpoints with
        ties to the smaller magnitude (bucketize right=False)."""
        dev = w.device
        if dev not in cache:
            cache[dev] = (grid.to(dev), mids.to(dev))
        gr, md = cache[dev]
        shp = w.shape
        g = w.detach().float().reshape(*shp[:-1], shp[-1] // 32, 32)
        amax = g.abs().amax(-1, keepdim=True)
        _, ex_ = torch.frexp(amax)
        e = torch.where(amax > 0, ex_ - 3, torch.full_like(ex_, -2))
        scale = ((e + 127).to(torch.int32) << 23).view(torch.float32)
        inv = ((127 - e).to(torch.int32) << 23).view(torch.float32)
        x = g * inv
        q = torch.sign(x) * gr[torch.bucketize(x.abs(), md, right=False)] * scale
        # q + (w - w) is q bit for bit (w + (q - w) is not): the forward sees exactly the grid
        return q.reshape(shp).to(w.dtype) + (w - w.detach())

    return fake


def moe_forward_train(torch, F, fake, run, blk, hidden_states):
    """KimiSparseMoeBlock.forward + KimiMoEGate.forward with gradients (see the
    module docstring). hidden_states [B, T, hidden] -> [B, T, hidden]."""
    gate = blk.gate
    assert blk.use_latent_moe and gate.moe_router_activation_func == "sigmoid"
    assert not (gate.num_expert_group > 1 and gate.num_expert_group > gate.topk_group), "grouped top-k not implemented"
    Bn, Tn, H = hidden_states.shape
    x = hidden_states.reshape(-1, H)
    logits = F.linear(x.float(), gate.weight.float())
    scores = logits.sigmoid()                                              # [N, E]
    choice = scores.detach() + gate.e_score_correction_bias.detach().float()[None]
    topk_idx = torch.topk(choice, gate.top_k, dim=-1, sorted=False)[1]
    sel = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, topk_idx, True)
    comb = scores * sel                                                    # selected scores, 0 elsewhere
    if gate.top_k > 1 and gate.moe_renormalize:
        comb = comb / (comb.sum(-1, keepdim=True) + 1e-20)
    comb = comb * gate.routed_scaling_factor
    z = blk.routed_expert_down_proj(x)                                     # [N, D]
    W1 = torch.stack([e.w1.weight for e in blk.experts])                  # [E, F, D] gate
    W3 = torch.stack([e.w3.weight for e in blk.experts])                  # [E, F, D] up
    W2 = torch.stack([e.w2.weight for e in blk.experts])                  # [E, D, F] down
    if run.qat:
        W1, W2, W3 = fake(W1), fake(W2), fake(W3)
    E, Fi, D = W1.shape
    h1 = (z @ W1.reshape(E * Fi, D).t()).view(-1, E, Fi)
    h3 = (z @ W3.reshape(E * Fi, D).t()).view(-1, E, Fi)
    act = blk.experts[0].act_fn(torch.cat([h1, h3], -1))                 # SituAndMul -> [N, E, F]
    a = (act * comb[..., None].to(act.dtype)).reshape(-1, E * Fi)
    r = a @ W2.permute(0, 2, 1).reshape(E * Fi, D)                         # sum_e w_e W2_e act_e
    if blk.latent_moe_use_norm:
        r = blk.routed_expert_norm(r)
    y = blk.routed_expert_up_proj(r).view(Bn, Tn, H)
    y = y + blk.shared_experts(hidden_states)
    if run.collect:
        run.loads[blk] = run.loads.get(blk, 0) + sel.sum(0)
        if run.aux_alpha > 0:
            f = sel.view(Bn, Tn, E).float().sum(1) * (E / (gate.top_k * Tn))         # [B, E]
            p = (scores / scores.sum(-1, keepdim=True)).view(Bn, Tn, E).mean(1)     # [B, E]
            run.aux.append(run.aux_alpha * (f * p).sum(-1).mean())
    return y


def make_fast_kda(torch, chunk):
    ops = kc.TorchOps(torch)

    def fast_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                       A_log=None, dt_bias=None, lower_bound=None, transpose_state_layout=False, cu_seqlens=None,
                       **kw):
        """The stand-in's chunk_kda (gen_kimi.install_fla_standin) with the
        per-token loop replaced by kda_chunk.kda_chunked; same preprocessing."""
        assert cu_seqlens is None and initial_state is None
        B, T, H, K = q.shape
        dtype = v.dtype
        q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        if use_gate_in_kernel:
            if dt_bias is not None:
                g = g + dt_bias.float().view(H, -1)
            a = A_log.float().view(H, 1).exp() if A_log is not None else 1.0
            g = lower_bound * torch.sigmoid(a * g) if lower_bound is not None else -a * torch.nn.functional.softplus(g)
        if use_beta_sigmoid_in_kernel:
            beta = beta.sigmoid()
        if scale is None:
            scale = K ** -0.5
        o, S = kc.kda_chunked(torch, ops, q * scale, k, v, g, beta, chunk)
        final = (S.transpose(-1, -2) if transpose_state_layout else S) if output_final_state else None
        return o.to(dtype), final

    return fast_chunk_kda


def build(torch, ml, c):
    """The LM class of gen_kimi.moonshot_lm_class (the reference fixtures' LM:
    model.embed_tokens / layers / norm / output_attn_res_*, lm_head) with a
    batched forward for training."""
    LM = gk.moonshot_lm_class(ml)

    class TrainLM(LM):
        _masks = {}

        def forward_batch(self, idx):
            """idx [B, T] int64 -> logits [B, T, vocab]; the loop of LM.forward
            (and KimiLinearModel.forward) over a batch."""
            m = self.model
            h = m.embed_tokens(idx)
            B, T, H = h.shape
            key = (T, h.device)
            if key not in self._masks:
                self._masks[key] = torch.full((T, T), torch.finfo(torch.float32).min, device=h.device).triu(1)[None, None]
            mask = self._masks[key]
            br = h.new_zeros(B * T, 0, H)
            for layer in m.layers:
                h, br = layer(h, attention_mask=None if layer.is_linear_attn else mask, past_key_values=None,
                              block_residual=br)
            h = ml._apply_attn_res(h.reshape(B * T, H), br, m.output_attn_res_proj,
                                   m.output_attn_res_norm).view(B, T, H)
            return self.lm_head(m.norm(h))

    return LM, TrainLM


def moe_blocks(model):
    return [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]


def patch_moe(torch, F, fake, run, model):
    for blk in moe_blocks(model):
        blk.forward = functools.partial(moe_forward_train, torch, F, fake, run, blk)


def load_numpy_state(torch, model, state):
    sd = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state.items()}
    want = model.state_dict()
    for k, v in sd.items():
        if k in want and tuple(want[k].shape) != tuple(v.shape):
            raise SystemExit("%s: state %s, module %s" % (k, tuple(v.shape), tuple(want[k].shape)))
    model.load_state_dict(sd, strict=True)


# --------------------------------------------------------------------------
# 3. self-checks (before any training: the fast paths equal the reference)
# --------------------------------------------------------------------------

def set_tf32(torch, on):
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def selfcheck(torch, F, ml, naive_kda, fast_kda, LM, TrainLM, c, state, fake, dev):
    res = {}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    set_tf32(torch, False)
    g = torch.Generator(device="cpu").manual_seed(99)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev)

    # a. chunkwise recurrence vs a float64 per-token loop (the stand-in's, in numpy)
    B, T, H, K = 2, 77, 4, 64
    qn = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).double() * K ** -0.5
    kn = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).double()
    v = rnd(B, T, H, K).double()
    gg = (-5.0 * torch.sigmoid(rnd(B, T, H, K, scale=3.0))).double()
    bb = torch.sigmoid(rnd(B, T, H)).double()
    o64, S64 = kc.kda_chunked(torch, kc.TorchOps(torch), qn, kn, v, gg, bb, 32)
    o_np, S_np = kc.naive_np(np, *(t.cpu().numpy() for t in (qn, kn, v, gg, bb)))
    res["kda_chunked_f64_vs_loop"] = max(float(np.abs(o64.cpu().numpy() - o_np).max()),
                                         float(np.abs(S64.cpu().numpy() - S_np).max()))
    # b. the training chunk_kda vs the stand-in, as KimiDeltaAttention calls them (f32)
    kw = dict(A_log=torch.log(torch.rand(H, generator=g) * 15 + 1).to(dev), dt_bias=rnd(H * K, scale=2.0) - 3.0,
              initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, transpose_state_layout=True,
              cu_seqlens=None)
    args = (rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H))
    o_ref, S_ref = naive_kda(*args, **kw)
    o_f, S_f = fast_kda(*args, **kw)
    res["kda_fast_vs_standin_f32_rel"] = max(float((o_f - o_ref).abs().max() / o_ref.abs().max()),
                                             float((S_f - S_ref).abs().max() / S_ref.abs().max()))
    # c. whole model: the training path vs the reference LM, same weights, routing bias non-zero
    st = dict(state)
    rng = np.random.default_rng(5)
    for k in st:
        if k.endswith("e_score_correction_bias"):
            st[k] = rng.normal(0, 0.05, st[k].shape).astype(np.float32)
    ref = LM(c)
    load_numpy_state(torch, ref, st)
    ref = ref.to(dev).eval()
    trn = TrainLM(c)
    load_numpy_state(torch, trn, st)
    trn = trn.to(dev).eval()
    run = Run(0.0)
    patch_moe(torch, F, fake, run, trn)
    ids = [int(x) for x in rng.integers(0, c.vocab_size, size=40)]
    with torch.no_grad():
        ml.chunk_kda = naive_kda
        lr = ref(ids)
        ml.chunk_kda = fast_kda
        lt = trn.forward_batch(torch.tensor([ids], device=dev))[0].float().cpu().numpy()
        lt2 = trn.forward_batch(torch.tensor([ids, ids[::-1]], device=dev))[0].float().cpu().numpy()
    ml.chunk_kda = naive_kda
    scale = float(np.abs(lr).max())
    res["model_train_path_vs_reference_rel"] = float(np.abs(lt - lr).max()) / scale
    res["model_batch_of_2_vs_1_rel"] = float(np.abs(lt2 - lt).max()) / scale
    # d. the fake quantiser vs gen_kimi.mxfp4_quantize (values exactly)
    w = (torch.randn(8, 64, 96, generator=g) * torch.tensor([1e-3, 0.02, 0.5, 3.0]).repeat(2)[:, None, None])
    w[0, 0, :12] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -0.25, -0.75, -2.5, 0.0, 5.0])
    fq = fake(w.to(dev)).cpu().numpy()
    bad = sum(int((fq[i] != gk.mxfp4_quantize(w[i].numpy())[0]).sum()) for i in range(w.shape[0]))
    res["mxfp4_fake_mismatches"] = bad
    set_tf32(torch, prev_tf32)
    ok = (res["kda_chunked_f64_vs_loop"] < 1e-9 and res["kda_fast_vs_standin_f32_rel"] < 1e-4 and
          res["model_train_path_vs_reference_rel"] < 1e-4 and res["model_batch_of_2_vs_1_rel"] < 1e-4 and bad == 0)
    log("self-check %s: %s" % ("ok" if ok else "FAILED", json.dumps(res)))
    if not ok:
        raise SystemExit("self-check failed: the training path does not compute the reference's function")
    return res


# --------------------------------------------------------------------------
# 4. training
# --------------------------------------------------------------------------

def sync(torch, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def lr_at(a, step, total):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    p = (step - a.warmup) / max(1, total - 1 - a.warmup)
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def fast_eval(torch, F, model, val, ctx, nwin, dev, bs=32):
    """Mean NLL over the first nwin windows (ctx tokens each, ctx-1 predictions),
    through the training path (no gradient)."""
    tot, n = 0.0, 0
    was = model.training
    model.eval()
    with torch.no_grad():
        for w0 in range(0, nwin, bs):
            w = np.arange(w0, min(nwin, w0 + bs))
            x = torch.from_numpy(val[(w * ctx)[:, None] + np.arange(ctx)[None]]).to(dev)
            lg = model.forward_batch(x).float()
            nll = F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            tot += float(nll)
            n += len(w) * (ctx - 1)
    model.train(was)
    return tot / n


def train(a, torch, F, ml, model, run, fake, train_tok, val, dev, logf):
    params = [(n, p) for n, p in model.named_parameters()]
    for n, p in params:
        if n.endswith("e_score_correction_bias"):
            p.requires_grad_(False)
    decay = [p for n, p in params if p.requires_grad and p.dim() == 2 and not n.endswith("res_proj.weight")]
    no_decay = [p for n, p in params if p.requires_grad and not (p.dim() == 2 and not n.endswith("res_proj.weight"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    blocks = moe_blocks(model)
    rng = np.random.default_rng(a.seed)
    starts_all = rng.integers(0, len(train_tok) - a.ctx - 1, size=(a.steps, a.batch))
    # the tokens and every step's window starts live on the device: no host copy (and no sync) per step
    tok_dev = torch.from_numpy(train_tok).to(dev)
    starts_dev = torch.from_numpy(starts_all).to(dev)
    span = torch.arange(a.ctx + 1, device=dev)
    total = a.steps
    qat_start = int(round(total * (1 - a.qat_frac)))
    hist, t_start, t_probe = [], time.time(), None
    nval_fast = min(32, len(val) // a.eval_ctx)
    model.train()
    step = 0
    while step < total:
        if step == 10:
            sync(torch, dev)
            t_probe = time.time()
        if step == 30 and total > 30:
            sync(torch, dev)
            per = (time.time() - t_probe) / 20
            if a.minutes > 0:
                budget = a.minutes * 60 - (time.time() - t_start)
                n_evals = max(1, total // a.eval_every)
                fits = 30 + int(budget / (per * (1 + 0.02 * n_evals)))
                if fits < total:
                    total = max(31, fits)
                    qat_start = int(round(total * (1 - a.qat_frac)))
                log("time budget %.1f min: %.3f s/step -> %d steps (rerun with --steps %d to reproduce this run)" % (
                    a.minutes, per, total, total))
            log("%.3f s/step: %d steps take about %.1f min (QAT from step %d)" % (
                per, total, per * total / 60, qat_start))
        run.qat = step >= qat_start
        lr = lr_at(a, step, total)
        for gr in opt.param_groups:
            gr["lr"] = lr
        xy = tok_dev[starts_dev[step][:, None] + span[None]]                  # [B, ctx + 1]
        run.collect, run.loads, run.aux = True, {}, []
        logits = model.forward_batch(xy[:, :-1])
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))
        aux = torch.stack(run.aux).sum() if run.aux else torch.zeros((), device=dev)
        loss = ce + aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], a.clip)
        opt.step()
        run.collect = False
        imb = []
        with torch.no_grad():
            for blk in blocks:
                load = run.loads[blk].float()
                blk.gate.e_score_correction_bias.add_((a.bias_update * lr / a.lr) * torch.sign(load.mean() - load))
                imb.append(load.max() / load.mean())
        step += 1
        if step % 25 == 0 or step == total or step == 1:
            if not math.isfinite(float(ce)):
                raise SystemExit("loss is not finite at step %d" % step)
            rec = {"step": step, "loss": float(ce), "aux": float(aux), "lr": lr, "grad_norm": float(gnorm),
                   "max_load_over_mean": float(torch.stack(imb).mean()), "qat": run.qat,
                   "elapsed_s": round(time.time() - t_start, 1)}
            if step % a.eval_every == 0 or step == total:
                nll = fast_eval(torch, F, model, val, a.eval_ctx, nval_fast, dev)
                rec.update({"val_nll_fast": nll, "val_ppl_fast": math.exp(nll), "val_windows_fast": nval_fast})
            hist.append(rec)
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            log("step %d/%d loss %.4f aux %.2e lr %.2e gnorm %.2f load max/mean %.2f%s%s" % (
                step, total, rec["loss"], rec["aux"], lr, rec["grad_norm"], rec["max_load_over_mean"],
                " qat" if run.qat else "", (" | val ppl %.3f" % rec["val_ppl_fast"]) if "val_ppl_fast" in rec else ""))
    sync(torch, dev)
    return {"steps": total, "qat_start": qat_start, "seconds": round(time.time() - t_start, 1),
            "tokens_seen": total * a.batch * a.ctx, "history": hist}


# --------------------------------------------------------------------------
# 5. export and the reference evaluation
# --------------------------------------------------------------------------

def nll_rows(logits, targets):
    """float64 -log softmax(logits)[target] per row."""
    lg = logits.astype(np.float64)
    m = lg.max(-1)
    lse = m + np.log(np.exp(lg - m[:, None]).sum(-1))
    return lse - lg[np.arange(len(targets)), targets]


def export_and_evaluate(a, torch, F, ml, naive_kda, fast_kda, LM, TrainLM, c, spec, state, fake, val, dev,
                        meta):
    t0 = time.time()
    summ = ex.export(state, spec, a.out, os.path.join(a.data, "tokenizer"))
    shards = summ.pop("shards")
    exported = summ.pop("values")
    log("exported %s: %d shards (largest %d bytes), directory %d bytes" % (
        a.out, len(shards), max(s for _, s in shards), summ["dir_bytes"]))
    # the MXFP4 experts written are exactly the ones the last (QAT) steps trained
    mism, n_exp = 0, 0
    if meta.get("qat_steps", 0) > 0:
        for k, v in state.items():
            if ".experts." in k:
                fq = fake(torch.from_numpy(v)).numpy()
                mism += int((fq != exported[ex.PREFIX + k]).sum())
                n_exp += v.size
    back, _ = ex.read_release(a.out, spec)
    set_tf32(torch, False)
    ml.chunk_kda = naive_kda
    ref = LM(c)
    load_numpy_state(torch, ref, back)           # strict: every exported tensor, nothing else
    ref = ref.to(dev).eval()
    ctx = a.eval_ctx
    nwin_all = len(val) // ctx
    nwin = nwin_all if a.eval_windows <= 0 else min(a.eval_windows, nwin_all)
    sums, win0 = [], None
    with torch.no_grad():
        for w in range(nwin):
            ids = val[w * ctx:(w + 1) * ctx]
            lg = ref([int(x) for x in ids])                       # [ctx, vocab] f32, numpy
            sums.append(float(nll_rows(lg[:-1], ids[1:]).sum()))
            if w == 0:
                win0 = lg
            if w % 100 == 0:
                log("reference window %d/%d (%.0fs)" % (w, nwin, time.time() - t0))
    per = ctx - 1
    mean = sum(sums) / (nwin * per)
    ntest = min(a.test_windows, nwin)
    mean_test = sum(sums[:ntest]) / (ntest * per)
    # the training path on the exported weights, and on the f32 master weights (same windows)
    fastm = TrainLM(c)
    load_numpy_state(torch, fastm, back)
    fastm = fastm.to(dev).eval()
    run = Run(0.0)
    patch_moe(torch, F, fake, run, fastm)
    ml.chunk_kda = fast_kda
    with torch.no_grad():
        lt0 = fastm.forward_batch(torch.from_numpy(val[:ctx]).to(dev)[None])[0].float().cpu().numpy()
    run.collect, run.loads = True, {}
    nll_fast_exported = fast_eval(torch, F, fastm, val, ctx, nwin, dev)
    run.collect = False
    usage = []
    for i, blk in enumerate(moe_blocks(fastm)):
        load = run.loads[blk].double().cpu().numpy()
        usage.append({"moe_layer": i + spec["first_dense"], "unused_experts": int((load == 0).sum()),
                      "max_over_mean": float(load.max() / load.mean()),
                      "min_over_mean": float(load.min() / load.mean())})
    load_numpy_state(torch, fastm, state)
    run.qat = meta.get("qat_steps", 0) > 0
    nll_fast_master = fast_eval(torch, F, fastm, val, ctx, nwin, dev)
    ml.chunk_kda = naive_kda
    del fastm
    # files for deltafin's tests
    ev = os.path.join(a.out, "eval")
    os.makedirs(ev, exist_ok=True)
    val[:ntest * ctx].astype("<u2").tofile(os.path.join(ev, "val_windows.u16"))
    pos = [p for p in REF_POSITIONS if p < ctx]
    rows = np.ascontiguousarray(win0[pos], dtype="<f4")
    rows.tofile(os.path.join(ev, "reference_logits.bin"))
    srt = np.sort(win0[pos], -1)
    ref_json = {
        "tokens": [int(x) for x in val[:ctx]], "positions": pos, "vocab": int(c.vocab_size),
        "logits": "reference_logits.bin: float32 little-endian [len(positions)][vocab]: logits at these positions "
                  "of one forward over tokens (window 0 of eval/val_windows.u16), fresh state, no BOS",
        "top1": [int(x) for x in win0[pos].argmax(-1)],
        "min_top1_top2_gap": float((srt[:, -1] - srt[:, -2]).min()),
        "max_abs_logit": float(np.abs(rows).max()),
        "training_path_vs_reference_window0": {"max_abs_diff": float(np.abs(lt0 - win0).max()),
                                               "rel": float(np.abs(lt0 - win0).max() / np.abs(win0).max())},
        "reference": meta["reference_desc"],
    }
    with open(os.path.join(ev, "reference.json"), "w") as f:
        json.dump(ref_json, f, indent=1)
        f.write("\n")
    ppl = {
        "what": "validation perplexity of the exported model (the files in this directory) by Moonshot's reference "
                "module; `deltafin eval` must match mean_nll / ppl within 1e-4 relative",
        "tokens_file": "val.bin of tools/train/make_corpus.py (uint16 little-endian token ids)",
        "tokens_sha256": meta["val_sha256"], "tokens": int(len(val)),
        "window": {"ctx": ctx, "stride": ctx, "count": nwin,
                   "rule": "window w = tokens[w*ctx : (w+1)*ctx] for w = 0..count-1 (every full window); each is "
                           "evaluated from a fresh state with nothing prepended (no BOS); the logits at positions "
                           "0..ctx-2 predict tokens 1..ctx-1: ctx-1 predictions per window",
                   "nll": "-log softmax(logits)[target], softmax in float64 over float32 logits"},
        "predictions": nwin * per, "mean_nll": mean, "ppl": math.exp(mean),
        "per_window_nll_sum": sums,
        "test_subset": {"windows": ntest, "file": "eval/val_windows.u16 (the first windows' tokens)",
                        "sha256": sha256_file(os.path.join(ev, "val_windows.u16")), "mean_nll": mean_test,
                        "ppl": math.exp(mean_test)},
        "reference": meta["reference_desc"],
        "training_path_same_windows": {
            "exported_weights": {"mean_nll": nll_fast_exported, "ppl": math.exp(nll_fast_exported)},
            "f32_master_weights_mxfp4_experts": {"mean_nll": nll_fast_master, "ppl": math.exp(nll_fast_master)}},
        "mxfp4_experts_equal_to_trained": {"checked_values": n_exp, "mismatches": mism},
        "expert_load_on_these_windows": usage,
        "versions": meta["versions"],
    }
    with open(os.path.join(ev, "ppl.json"), "w") as f:
        json.dump(ppl, f, indent=1)
        f.write("\n")
    set_tf32(torch, a.tf32)
    log("reference eval: %d windows x %d predictions: mean NLL %.6f, ppl %.4f (first %d windows: ppl %.4f); "
        "training path on the exported weights %.4f, on the f32 master %.4f; window 0 rel diff %.2e; "
        "MXFP4 experts vs trained: %d mismatches of %d (%.0fs)" % (
            nwin, per, mean, math.exp(mean), ntest, math.exp(mean_test), math.exp(nll_fast_exported),
            math.exp(nll_fast_master), ref_json["training_path_vs_reference_window0"]["rel"], mism, n_exp,
            time.time() - t0))
    return {"export": dict(summ, shards=shards), "ppl": {k: v for k, v in ppl.items() if k != "per_window_nll_sum"},
            "reference_rows": {k: v for k, v in ref_json.items() if k != "tokens"}}


# --------------------------------------------------------------------------
# 6. main
# --------------------------------------------------------------------------

def main():
    a = parse_args()
    import torch
    import torch.nn.functional as F
    import transformers
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    dev = torch.device(a.device)
    nondet = []
    warnings.simplefilter("default")
    _show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "determinis" in str(message):
            nondet.append(str(message)[:300])
        _show(message, category, filename, lineno, file, line)
    warnings.showwarning = showwarning
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    set_tf32(torch, a.tf32)
    torch.manual_seed(a.seed)
    os.makedirs(a.work, exist_ok=True)

    manifest = check_corpus(a.data)
    spec = ex.tiny_spec(os.path.join(a.data, "tokenizer"))
    cfg = ex.text_config(spec)
    c = gk.MsConfig(cfg)
    train_tok = load_tokens(os.path.join(a.data, "train.bin"))
    val = load_tokens(os.path.join(a.data, "val.bin"))
    assert train_tok.max() < spec["vocab"] and val.max() < spec["vocab"]
    ml = gk.load_moonshot(a.moonshot_file, os.path.join(a.work, "k3ref"))
    naive_kda = ml.chunk_kda
    fast_kda = make_fast_kda(torch, a.chunk)
    fake = make_mxfp4_fake(torch)
    LM, TrainLM = build(torch, ml, c)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
                "python": platform.python_version(),
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "moonshot_file_sha256": sha256_file(a.moonshot_file)}
    log("versions %s" % json.dumps(versions))
    ref_desc = ("Moonshot's K3 modeling_kimi_linear.py (HYGON-AI/one-click-quant copy, sha256 %s) with the pure-"
                "PyTorch fla stand-in of tools/fixtures/gen_kimi.py (per-token KDA loop); LM of "
                "gen_kimi.moonshot_lm_class, state dict read back from the exported files (bf16 spine widened, "
                "MXFP4 experts decoded, A_log's first num_heads values) and loaded strict=True; float32, TF32 off, "
                "use_cache off, %s, torch %s" % (versions["moonshot_file_sha256"][:16], versions["device"],
                                                  torch.__version__))
    init = ex.init_weights(spec, a.seed)
    ck = os.path.join(a.work, "ckpt_f32.pt")
    args = {k: (os.path.relpath(v, REPO) if isinstance(v, str) and v.startswith(REPO) else v)
            for k, v in vars(a).items()}
    report = {"args": args, "versions": versions, "spec": {k: v for k, v in spec.items() if k != "seeds"},
              "corpus": {"manifest_sha256": sha256_file(os.path.join(a.data, "manifest.json")),
                         "stats": manifest["stats"]}}
    report["selfcheck"] = selfcheck(torch, F, ml, naive_kda, fast_kda, LM, TrainLM, c, init, fake, dev)
    if a.selftest_only:
        return
    if a.export_only:
        saved = torch.load(ck, map_location="cpu")
        state = {k: v.numpy() for k, v in saved["state"].items()}
        report["train"] = saved["train"]
    else:
        torch.manual_seed(a.seed)
        model = TrainLM(c)
        load_numpy_state(torch, model, init)
        model = model.to(dev)
        run = Run(a.aux_alpha)
        patch_moe(torch, F, fake, run, model)
        ml.chunk_kda = fast_kda
        with open(os.path.join(a.work, "train_log.jsonl"), "w") as logf:
            tr = train(a, torch, F, ml, model, run, fake, train_tok, val, dev, logf)
        ml.chunk_kda = naive_kda
        tr["qat_steps"] = tr["steps"] - tr["qat_start"]
        bias = {n: float(p.abs().max()) for n, p in model.named_parameters() if n.endswith("e_score_correction_bias")}
        tr["max_abs_correction_bias"] = max(bias.values())
        state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
        torch.save({"state": {k: torch.from_numpy(v) for k, v in state.items()}, "train": tr}, ck)
        report["train"] = tr
        log("trained %d steps in %.0fs (%d tokens); checkpoint %s" % (tr["steps"], tr["seconds"],
                                                                       tr["tokens_seen"], ck))
        del model
    meta = {"qat_steps": report["train"].get("qat_steps", 0), "reference_desc": ref_desc, "versions": versions,
            "val_sha256": sha256_file(os.path.join(a.data, "val.bin"))}
    report["result"] = export_and_evaluate(a, torch, F, ml, naive_kda, fast_kda, LM, TrainLM, c, spec, state,
                                           fake, val, dev, meta)
    report["nondeterministic_op_warnings"] = sorted(set(nondet))
    with open(os.path.join(a.out, "train_report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    log("done: %s" % os.path.join(a.out, "train_report.json"))


if __name__ == "__main__":
    main()
