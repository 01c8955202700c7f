"""``python -m truefuse bench linear``: forward + backward of the linear-family layers, bf16.

Points (8192 tokens): ``Linear`` 4096→4096 and 4096→14336 and ``LayerNormMLP`` (RMSNorm, swiglu,
4096→14336), all without bias and with fused fp32 ``main_grad`` accumulation. Providers, measured
side by side in one run:

* ``floor``: the layer's cuBLAS GEMMs alone (bf16 ``torch.mm``: forward, input gradient and weight
  gradient per weight).
* ``truefuse``: the module.
* ``torch``: ``torch.nn.Linear`` (+ ``torch.nn.RMSNorm`` + ``F.silu(gate) * up``) and a separate
  ``main_grad.add_(weight.grad)`` per weight, as a framework without fused accumulation does.

The LayerNormMLP goal adds the bandwidth floor of its elementwise work to the GEMMs: see
:func:`elementwise_bytes` (reported as ``floor_elementwise_ms`` in the JSON at 4.3 TB/s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.bench.harness import Sweep
from truefuse.nn.layernorm_mlp import LayerNormMLP
from truefuse.nn.linear import Linear

COPY_BW = 4.3e12  # bytes/s, the H200's measured device copy bandwidth (docs/design.md §8)
_BF = torch.bfloat16


def elementwise_bytes(p: dict) -> float:
    """Minimal bytes of the MLP's non-GEMM work, bf16: RMSNorm fwd (read x, write) + bwd (read x,
    dy; write dx), swiglu fwd (read 2F, write F) + bwd (read dF, 2F; write 2F)."""
    M, H = p["M"], p["H"]
    if p["layer"] == "mlp":
        return 2.0 * M * (5 * H + 8 * p["F"])
    return 0.0


def _flops(p: dict) -> float:
    M, H = p["M"], p["H"]
    if p["layer"] == "linear":
        return 6.0 * M * H * p["N"]
    if p["layer"] == "mlp":
        return 6.0 * M * H * 3 * p["F"]  # fc1 (H -> 2F) + fc2 (F -> H)
    return 0.0


def _rand(*shape, device, seed):
    return torch.randn(*shape, generator=torch.Generator(device=device).manual_seed(seed), device=device, dtype=_BF)


def _gemm_shapes(p: dict) -> list[tuple[int, int, int]]:
    """(M, K, N) of every forward GEMM of the layer; its backward has the two transposed ones."""
    if p["layer"] == "linear":
        return [(p["M"], p["H"], p["N"])]
    return [(p["M"], p["H"], 2 * p["F"]), (p["M"], p["F"], p["H"])]


def _floor(p, device):
    ops = []
    for i, (M, K, N) in enumerate(_gemm_shapes(p)):
        x, w, dy = (
            _rand(M, K, device=device, seed=i),
            _rand(N, K, device=device, seed=10 + i),
            _rand(M, N, device=device, seed=20 + i),
        )
        ops.append((x, w, dy))

    def fn():
        for x, w, dy in ops:
            torch.mm(x, w.t()), torch.mm(dy, w), torch.mm(dy.t(), x)

    return fn


def _step(module, x, dy, params, add_to_main_grad: bool):
    def fn():
        x.grad = None
        module(x).backward(dy)
        if add_to_main_grad:
            for q in params:
                q.main_grad.add_(q.grad)
                q.grad = None

    return fn


class _TorchMLP(torch.nn.Module):
    def __init__(self, H, Fd, device):
        super().__init__()
        self.norm = torch.nn.RMSNorm(H, eps=1e-5, device=device, dtype=_BF)
        self.fc1 = torch.nn.Linear(H, 2 * Fd, bias=False, device=device, dtype=_BF)
        self.fc2 = torch.nn.Linear(Fd, H, bias=False, device=device, dtype=_BF)

    def forward(self, x):
        gate, up = self.fc1(self.norm(x)).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


def _module(which: str):
    def make(p, device):
        M, H = p["M"], p["H"]
        x = _rand(M, H, device=device, seed=0).requires_grad_()
        if p["layer"] == "linear":
            cls = Linear if which == "truefuse" else torch.nn.Linear
            kw = {"fuse_wgrad_accumulation": True} if which == "truefuse" else {}
            m = cls(H, p["N"], bias=False, device=device, dtype=_BF, **kw)
            params = [m.weight]
        elif which == "truefuse":
            m = LayerNormMLP(
                H,
                p["F"],
                bias=False,
                device=device,
                dtype=_BF,
                normalization="RMSNorm",
                activation="swiglu",
                fuse_wgrad_accumulation=True,
            )
            params = [m.fc1_weight, m.fc2_weight]
        else:
            m = _TorchMLP(H, p["F"], device)
            params = [m.fc1.weight, m.fc2.weight]
        for q in params:
            q.main_grad = torch.zeros(q.shape, device=device, dtype=torch.float32)
        dy = _rand(M, p.get("N", H), device=device, seed=1)
        return _step(m, x, dy, params, add_to_main_grad=which == "torch")

    return make


def sweep(quick: bool) -> Sweep:
    if quick:
        points = [
            {"case": "linear", "layer": "linear", "M": 64, "H": 32, "N": 48},
            {"case": "mlp", "layer": "mlp", "M": 64, "H": 32, "F": 40},
        ]
    else:
        points = [
            {"case": "linear 4096->4096", "layer": "linear", "M": 8192, "H": 4096, "N": 4096},
            {"case": "linear 4096->14336", "layer": "linear", "M": 8192, "H": 4096, "N": 14336},
            {"case": "mlp rms swiglu 4096->14336", "layer": "mlp", "M": 8192, "H": 4096, "F": 14336},
        ]
    for p in points:
        p["floor_elementwise_ms"] = round(elementwise_bytes(p) / COPY_BW * 1e3, 4)
    return Sweep(
        name="linear",
        points=points,
        providers={"floor": _floor, "truefuse": _module("truefuse"), "torch": _module("torch")},
        reference="floor",
        x="case",
        flops=_flops,
    )
