"""``python -m truefuse bench rms_norm``: RMSNorm forward + backward (input and weight gradients),
bf16, under CUDA graphs (a ~0.1 ms op: without graphs the host's launch time is what gets measured).

Providers, side by side in one run: ``floor`` (device copies moving the op's minimal bytes: read x,
write y; read x and dy, write dx), ``truefuse`` (``truefuse.rms_norm``), ``torch``
(``F.rms_norm``), ``hf_stock`` (a transformers Llama RMSNorm's forward) and ``truefuse_hf``
(``truefuse.rms_norm_hf``, that forward's bits). GB/s counts those minimal bytes; the goal is
≥ 80% of the 4.3 TB/s copy bandwidth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.autograd.norm import rms_norm, rms_norm_hf
from truefuse.bench.harness import Sweep
from truefuse.ops.norm import rms_norm_hf_ref

CUDA_GRAPH = True
_BF = torch.bfloat16


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


def _provider(norm):
    def make(p, device):
        x, dy = _inputs(p, device)
        x.requires_grad_()
        w = (torch.rand(p["H"], device=device, dtype=_BF) + 0.5).requires_grad_()

        def fn():
            # autograd.grad: no accumulation into .grad, so nothing but the op is timed
            return torch.autograd.grad(norm(x, w), (x, w), dy)

        return fn

    return make


def sweep(quick: bool) -> Sweep:
    points = (
        [{"M": 64, "H": 32}]
        if quick
        else [{"M": m, "H": h} for m, h in ((8192, 4096), (16384, 4096), (8192, 8192), (4096, 7168))]
    )
    return Sweep(
        name="rms_norm",
        points=points,
        providers={
            "floor": _floor,
            "truefuse": _provider(lambda x, w: rms_norm(x, w, 1e-5)),
            "torch": _provider(lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-5)),
            # a transformers Llama RMSNorm: its own forward, and truefuse.rms_norm_hf (its bits)
            "hf_stock": _provider(lambda x, w: rms_norm_hf_ref(x, w, 1e-5, style="llama")),
            "truefuse_hf": _provider(lambda x, w: rms_norm_hf(x, w, 1e-5, style="llama")),
        },
        reference="floor",
        x="M",
        bytes=_bytes,
    )
