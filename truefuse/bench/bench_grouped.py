"""``python -m truefuse bench grouped``: GroupedMLP (swiglu, no bias, packed weights) forward +
backward, bf16.

Points: 8 experts × 2048 tokens, hidden 4096, ffn 14336 (the issue's "≤ 1.10× its grouped GEMMs"
goal), 64 experts × 256 tokens at a fine-grained-expert size, hidden 2048, ffn 1408 (the "≥ 2×
a loop of per-expert torch.nn.Linear" goal), and 128 experts × 128 tokens, hidden 2048, ffn 768.
Providers, side by side in one run:

* ``floor``: the six grouped GEMMs alone through ``truefuse.gemm``'s default plan (fc1 and fc2
  forward, input gradients, weight gradients in bf16; cuBLAS ``grouped_mm`` where aligned).
* ``floor_main_grad``: the same, the two weight gradients added into fp32 ``main_grad`` buffers
  (``gemm(..., out=main_grad, accumulate=True)``): the floor of the ``*_main_grad`` rows, which read
  and write 4-byte gradients where the plain floor writes 2-byte ones.
* ``truefuse``: ``GroupedMLP`` (plain configuration: bf16 weight gradients), default backend:
  ``triton``, the batch-invariant grouped GEMM (docs/design.md §1 "Grouped GEMM").
* ``truefuse_device_splits``: the same with ``m_splits`` a CUDA tensor (no host read).
* ``truefuse_per_group``: ``backend="per_group"``, one GEMM per expert inside each ``truefuse.gemm``
  call (bitwise equal to per-expert Linear layers).
* ``truefuse_fused_grouped``: ``backend="cublas_grouped"`` (cuBLAS grouped_mm).
* ``truefuse_main_grad``, ``truefuse_per_group_main_grad``: fused fp32 ``main_grad`` accumulation,
  default and per-group backends.
* ``torch_loop``: per expert ``torch.nn.Linear`` fc1, ``F.silu(gate) * up``, ``torch.nn.Linear`` fc2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.bench.harness import Sweep
from truefuse.nn.grouped import GroupedMLP
from truefuse.ops.gemm.gemm import gemm

_BF = torch.bfloat16


def _rand(*shape, device, seed):
    return torch.randn(*shape, generator=torch.Generator(device=device).manual_seed(seed), device=device, dtype=_BF) * 0.02


def _splits(p):
    return [p["tokens"]] * p["E"]


def _floor(p, device, main_grad: bool = False):
    E, H, Fd, M = p["E"], p["H"], p["F"], p["E"] * p["tokens"]
    s = _splits(p)
    x, w1, w2 = (
        _rand(M, H, device=device, seed=0),
        _rand(E, 2 * Fd, H, device=device, seed=1),
        _rand(E, H, Fd, device=device, seed=2),
    )
    h, a, dy = _rand(M, 2 * Fd, device=device, seed=3), _rand(M, Fd, device=device, seed=4), _rand(M, H, device=device, seed=5)
    mg1, mg2 = (torch.zeros(w.shape, device=device) for w in (w1, w2)) if main_grad else (None, None)

    def fn():
        gemm(x, w1.transpose(1, 2), m_splits=s), gemm(a, w2.transpose(1, 2), m_splits=s)  # forward
        gemm(dy, w2, m_splits=s), gemm(h, w1, m_splits=s)  # input gradients
        if main_grad:  # weight gradients added into fp32 main_grad (beta=1)
            gemm(dy.t(), a, m_splits=s, out=mg2, accumulate=True), gemm(h.t(), x, m_splits=s, out=mg1, accumulate=True)
        else:
            gemm(dy.t(), a, m_splits=s), gemm(h.t(), x, m_splits=s)  # weight gradients

    return fn


def _floor_main_grad(p, device):
    return _floor(p, device, main_grad=True)


def _truefuse(fused: bool, backend: str | None = None, device_splits: bool = False):
    def make(p, device):
        m = GroupedMLP(
            p["E"],
            p["H"],
            p["F"],
            device=device,
            dtype=_BF,
            single_grouped_weight=True,
            fuse_wgrad_accumulation=fused,
            backend=backend,
        )
        if fused:
            for _, q in m.gemm_weights():
                q.main_grad = torch.zeros(q.shape, device=device)
        x = _rand(p["E"] * p["tokens"], p["H"], device=device, seed=0).requires_grad_()
        dy = _rand(p["E"] * p["tokens"], p["H"], device=device, seed=5)
        s = torch.tensor(_splits(p), device=device) if device_splits else _splits(p)

        def fn():
            x.grad = None
            for q in m.parameters():
                q.grad = None
            m(x, s).backward(dy)

        return fn

    return make


def _torch_loop(p, device):
    E, H, Fd = p["E"], p["H"], p["F"]
    fc1 = [torch.nn.Linear(H, 2 * Fd, bias=False, device=device, dtype=_BF) for _ in range(E)]
    fc2 = [torch.nn.Linear(Fd, H, bias=False, device=device, dtype=_BF) for _ in range(E)]
    x = _rand(E * p["tokens"], H, device=device, seed=0).requires_grad_()
    dy = _rand(E * p["tokens"], H, device=device, seed=5)
    s = _splits(p)

    def fn():
        x.grad = None
        for lin in (*fc1, *fc2):
            lin.weight.grad = None
        outs = []
        for e, xe in enumerate(torch.split(x, s)):
            gate, up = fc1[e](xe).chunk(2, dim=-1)
            outs.append(fc2[e](F.silu(gate) * up))
        torch.cat(outs).backward(dy)

    return fn


def sweep(quick: bool) -> Sweep:
    if quick:
        points = [{"case": "small", "E": 4, "tokens": 16, "H": 32, "F": 24}]
    else:
        points = [
            {"case": "8x2048 h4096 f14336", "E": 8, "tokens": 2048, "H": 4096, "F": 14336},
            {"case": "64x256 h2048 f1408", "E": 64, "tokens": 256, "H": 2048, "F": 1408},
            {"case": "128x128 h2048 f768", "E": 128, "tokens": 128, "H": 2048, "F": 768},
        ]
    return Sweep(
        name="grouped_mlp",
        points=points,
        providers={
            "floor": _floor,
            "floor_main_grad": _floor_main_grad,
            "truefuse": _truefuse(False),
            "truefuse_device_splits": _truefuse(False, device_splits=True),
            "truefuse_per_group": _truefuse(False, "per_group"),
            "truefuse_fused_grouped": _truefuse(False, "cublas_grouped"),
            "truefuse_main_grad": _truefuse(True),
            "truefuse_per_group_main_grad": _truefuse(True, "per_group"),
            "torch_loop": _torch_loop,
        },
        reference="floor",
        x="case",
        flops=lambda p: 6.0 * p["E"] * p["tokens"] * p["H"] * 3 * p["F"],
    )
