"""``python -m truefuse bench sibling_linears``: a decoder layer's q/k/v and gate/up projections,
forward + backward (input and weight gradients), bf16, under CUDA graphs.

Providers, side by side in one run: ``stock`` (``F.linear`` each, autograd summing the input's
gradient with separate adds: ``sibling_linears_ref``), ``truefuse`` (``truefuse.sibling_linears``:
that sum inside accumulating GEMMs), ``floor`` (the same GEMMs, the input gradient's products into
separate outputs and no sum at all: what the op cannot beat). TFLOP/s counts the GEMMs' FLOPs
(3 GEMMs a projection). Points: the demo's GPU model (8192 tokens, hidden 2048; q 2048, k/v 1024
each; gate/up 5632 each) and an 8B-class layer (hidden 4096; k/v 1024; gate/up 14336).
"""

from __future__ import annotations

import torch

from truefuse.autograd.sibling_linears import sibling_linears
from truefuse.bench.harness import Sweep
from truefuse.ops.gemm.siblings import sibling_linears_ref

CUDA_GRAPH = True
_BF = torch.bfloat16
#: (name, tokens, hidden, output widths)
POINTS = (
    ("demo qkv", 8192, 2048, (2048, 1024, 1024)),
    ("demo gate/up", 8192, 2048, (5632, 5632)),
    ("8b qkv", 8192, 4096, (4096, 1024, 1024)),
    ("8b gate/up", 8192, 4096, (14336, 14336)),
)


def _flops(p: dict) -> float:
    return 6.0 * p["M"] * p["K"] * sum(p["N"])


def _inputs(p, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(p["M"], p["K"], generator=g, device=device, dtype=_BF).requires_grad_()
    ws = [(torch.randn(n, p["K"], generator=g, device=device, dtype=_BF) / p["K"] ** 0.5).requires_grad_() for n in p["N"]]
    dys = [torch.randn(p["M"], n, generator=g, device=device, dtype=_BF) for n in p["N"]]
    return x, ws, dys


def _provider(fn):
    def make(p, device):
        x, ws, dys = _inputs(p, device)
        # autograd.grad: no accumulation into .grad, so nothing but the op is timed
        return lambda: torch.autograd.grad(fn(x, ws), (x, *ws), dys)

    return make


def _floor(p, device):
    x, ws, dys = _inputs(p, device)
    x, ws = x.detach(), [w.detach() for w in ws]

    def fn():
        ys = [x @ w.t() for w in ws]
        return ys, [dy @ w for dy, w in zip(dys, ws, strict=True)], [dy.t() @ x for dy in dys]

    return fn


def sweep(quick: bool) -> Sweep:
    points = [{"shape": "tiny", "M": 64, "K": 32, "N": (32, 16, 16)}]
    if not quick:
        points = [{"shape": name, "M": m, "K": k, "N": ns} for name, m, k, ns in POINTS]
    return Sweep(
        name="sibling_linears",
        points=points,
        providers={
            "floor": _floor,
            "stock": _provider(sibling_linears_ref),
            "truefuse": _provider(sibling_linears),
        },
        reference="stock",
        x="shape",
        flops=_flops,
    )
