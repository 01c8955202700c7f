"""``python -m truefuse bench norm`` (also by its older name, ``rms_norm``): RMSNorm and LayerNorm
forward + backward (input, weight and bias gradients), bf16, under CUDA graphs (a ~0.1 ms op:
without graphs the host's launch time is what gets measured).

Providers, side by side in one run: ``floor`` (device copies moving the op's minimal bytes: read x,
write y; read x and dy, write dx), ``truefuse`` (``truefuse.rms_norm``), ``torch``
(``F.rms_norm``), ``compile`` (``torch.compile`` of ``rms_norm_ref``, truefuse's rounding rule in
plain PyTorch); the same three for LayerNorm with a weight and a bias (``truefuse_ln``,
``torch_ln``: ``F.layer_norm``, ``compile_ln``: of ``layer_norm_ref``); ``hf_stock`` (a
transformers Llama RMSNorm's forward) and ``truefuse_hf`` (``truefuse.rms_norm_hf``, that forward's
bits). GB/s counts those minimal bytes (5 × M × H × 2; the weight, bias and their fp32 partials are
left out); the goal is ≥ 88% of ``floor`` at every hidden size.

The compiled references are compiled once per hidden size with the row count dynamic (the norm's
kernels reduce over a static H either way; a compile per (M, H) doubles the compile time of the
full grid, which a short GPU lease cannot spare).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.autograd.norm import layer_norm, rms_norm, rms_norm_hf
from truefuse.bench.harness import Sweep
from truefuse.ops.norm.norm import layer_norm_ref, rms_norm_hf_ref, rms_norm_ref

CUDA_GRAPH = True
_BF = torch.bfloat16
HIDDEN = (1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384)
ROWS = (8192, 16384)
_compiled: dict = {}


def _bytes(p: dict) -> float:
    return 2.0 * p["M"] * p["H"] * 5


def _inputs(p, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(p["M"], p["H"], generator=g, device=device, dtype=_BF)
    dy = torch.randn(p["M"], p["H"], generator=g, device=device, dtype=_BF)
    return x, dy


def _floor(p, device):
    x, dy = _inputs(p, device)
    y, z = torch.empty_like(x), torch.empty_like(x)
    return lambda: (y.copy_(x), torch.add(x, dy, out=z))


def _provider(norm, bias: bool = False):
    def make(p, device):
        x, dy = _inputs(p, device)
        x.requires_grad_()
        w = (torch.rand(p["H"], device=device, dtype=_BF) + 0.5).requires_grad_()
        params = (w, (0.1 * torch.randn(p["H"], device=device, dtype=_BF)).requires_grad_()) if bias else (w,)

        def fn():
            # autograd.grad: no accumulation into .grad, so nothing but the op is timed
            return torch.autograd.grad(norm(x, *params), (x, *params), dy)

        return fn

    return make


def _compiled_norm(name, fn):
    """``torch.compile(fn)``, one per hidden size, the row count marked dynamic (see the module doc)."""

    def norm(x, *params):
        key = (name, x.shape[-1])
        if key not in _compiled:
            _compiled[key] = torch.compile(fn)
        torch._dynamo.mark_dynamic(x, 0)
        return _compiled[key](x, *params)

    return norm


def sweep(quick: bool) -> Sweep:
    points = [{"M": 64, "H": 32}] if quick else [{"M": m, "H": h} for h in HIDDEN for m in ROWS]
    return Sweep(
        name="rms_norm",
        points=points,
        providers={
            "floor": _floor,
            "truefuse": _provider(lambda x, w: rms_norm(x, w, 1e-5)),
            "torch": _provider(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-5)),
            "compile": _provider(_compiled_norm("rms", lambda x, w: rms_norm_ref(x, w, 1e-5))),
            "truefuse_ln": _provider(lambda x, w, b: layer_norm(x, w, b, 1e-5), bias=True),
            "torch_ln": _provider(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), bias=True),
            "compile_ln": _provider(_compiled_norm("ln", lambda x, w, b: layer_norm_ref(x, w, b, 1e-5)), bias=True),
            # a transformers Llama RMSNorm: its own forward, and truefuse.rms_norm_hf (its bits)
            "hf_stock": _provider(lambda x, w: rms_norm_hf_ref(x, w, 1e-5, style="llama")),
            "truefuse_hf": _provider(lambda x, w: rms_norm_hf(x, w, 1e-5, style="llama")),
        },
        reference="floor",
        x="M",
        bytes=_bytes,
        # the full grid (16 points) under a short GPU lease: one round per provider (each is a
        # CUDA-graph median of ~1 s of replays); quick runs keep the harness's interleaved rounds
        rounds=3 if quick else 1,
    )
