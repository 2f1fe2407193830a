#!/usr/bin/env python3
"""Runs tools/train/train_k3_tiny.py on a CPU machine that has PyTorch but
neither transformers nor einops (a Debian 12 developer machine:
`apt-get install --no-install-recommends python3-torch` gives torch 1.13),
to check the script's plumbing before the GPU run.

Moonshot's modeling file imports names from transformers that its layer
classes never call (ACT2FN is written to, PreTrainedModel is subclassed,
the rest are annotations, decorators and the cache / mask / output classes
of the full model). This puts minimal stand-ins for exactly those names in
sys.modules when the real packages are missing, and an einops.rearrange for
the four patterns the file uses; nothing numerical is replaced. The real
packages are used when they are installed.

    /usr/bin/python3 tools/train/check_local.py --smoke --device cpu --batch 4 --ctx 64 \\
        --out /tmp/k3tiny_local --work /tmp/k3tiny_local_work

Arguments are passed to train_k3_tiny.py unchanged.
"""
import importlib.machinery
import importlib.util
import os
import sys
import types
import typing

HERE = os.path.dirname(os.path.abspath(__file__))


def _mod(name, **attrs):
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__path__ = []
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def install_einops():
    if importlib.util.find_spec("einops") is not None:
        return False

    def rearrange(x, pattern, **kw):
        p = " ".join(pattern.split())
        if p == "... (h d) -> ... h d":
            d = kw["d"]
            return x.reshape(*x.shape[:-1], x.shape[-1] // d, d)
        if p == "b t h d -> b t (h d)":
            return x.reshape(*x.shape[:2], -1)
        if p == "b s ... -> (b s) ...":
            return x.reshape(-1, *x.shape[2:])
        if p == "b (n c) h ... -> b h n c ...":
            c = kw["c"]
            y = x.reshape(x.shape[0], x.shape[1] // c, c, *x.shape[2:])
            return y.permute(0, 3, 1, 2, *range(4, y.dim()))
        raise NotImplementedError("einops stand-in: pattern %r" % pattern)

    _mod("einops", rearrange=rearrange)
    return True


def install_transformers():
    if importlib.util.find_spec("transformers") is not None:
        return False

    def ident(*a, **k):
        if a and callable(a[0]) and not k:
            return a[0]
        return lambda f: f

    class _Any:
        def __init__(self, *a, **k):
            pass

    class PreTrainedModel:                # subclassed by KimiPreTrainedModel (class attributes only)
        pass

    class _Logging:
        @staticmethod
        def get_logger(name):
            import logging
            return logging.getLogger(name)

    tf = _mod("transformers", __version__="5.17.0+check.local.stand.in")
    subs = {
        "activations": dict(ACT2FN={}),
        "cache_utils": dict(Cache=type("Cache", (), {})),
        "generation": dict(GenerationMixin=type("GenerationMixin", (), {})),
        "masking_utils": dict(create_causal_mask=lambda *a, **k: None),
        "modeling_flash_attention_utils": dict(FlashAttentionKwargs=dict),
        "modeling_outputs": dict(BaseModelOutputWithPast=_Any, CausalLMOutputWithPast=_Any),
        "modeling_utils": dict(ALL_ATTENTION_FUNCTIONS={}, PreTrainedModel=PreTrainedModel),
        "processing_utils": dict(Unpack=typing.Unpack),
        "pytorch_utils": dict(ALL_LAYERNORM_LAYERS=[]),
        "utils": dict(TransformersKwargs=dict, auto_docstring=ident, can_return_tuple=ident, logging=_Logging),
    }
    for k, v in subs.items():
        setattr(tf, k, _mod("transformers." + k, **v))
    gen = _mod("transformers.utils.generic", OutputRecorder=_Any, check_model_inputs=ident)
    tf.utils.generic = gen
    return True


def main():
    stubs = [n for n, f in (("einops", install_einops), ("transformers", install_transformers)) if f()]
    if stubs:
        print("[check_local] stand-ins for: %s (the real packages are not installed)" % ", ".join(stubs), flush=True)
    sys.path.insert(0, HERE)
    import train_k3_tiny
    train_k3_tiny.main()


if __name__ == "__main__":
    main()
