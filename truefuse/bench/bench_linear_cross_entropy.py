"""``python -m truefuse bench linear_cross_entropy``: LM-head loss forward + backward, bf16.

Shapes (tokens, V, H) from the issue, and 8192 x 50257 x 4096: an odd vocabulary (GPT-2's), where
cuBLAS's GEMMs on unaligned operands run 5-6x slower (so ``gemms`` is no floor there; truefuse
splits them, torch.compile pads them). Providers, side by side in one run (ratios against
``gemms``, the shape's three cuBLAS GEMMs: logits, input gradient, weight gradient):

* ``truefuse`` (default chunk) and ``truefuse_c{N}`` (chunk of N tokens): the chunk sweep;
  ``truefuse_bf16acc_c{N}``: the weight gradient accumulated in bf16 (``fp32_weight_grad=False``);
  ``truefuse_main_grad``: the weight gradient added into an fp32 ``main_grad``
  (``fuse_wgrad_accumulation``, default chunk; ``main_grad`` is an input, so not in the peak, and
  no weight gradient is returned), ``truefuse_main_grad_c8192`` with one 8192-token chunk;
* ``truefuse_lean``: ``memory="lean"`` (two passes over vocabulary slices, no V x H fp32
  accumulator, 4 GEMMs), and ``truefuse_lean_main_grad`` with the weight gradient into
  ``main_grad``;
* ``plain``: ``F.linear`` in bf16, ``F.cross_entropy`` on the fp32 logits (what users write), and
  ``compile_plain``: ``torch.compile`` of it (compiled per shape, static shapes);
* ``compile_ref``: ``torch.compile`` of ``linear_cross_entropy_ref`` (fp32 ``F.linear``);
* ``liger``: liger-kernel's ``LigerFusedLinearCrossEntropyLoss``; ``cce``: Apple's
  cut-cross-entropy ``linear_cross_entropy`` (default "cce" implementation), when installed.

``peak MiB`` is above the inputs; the returned gradients (input + weight, bf16) are part of it.
``err_dx`` / ``err_dW``: d_input's and d_weight's relative error against a float64 reference on
the same bf16 inputs (``main_grad`` providers: the fp32 ``main_grad`` after one step from zeros),
and ``err_*_ratio`` that error over the ``plain`` path's (the issue's goal: at most 1.05).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.autograd.linear_cross_entropy import linear_cross_entropy
from truefuse.bench.harness import Sweep
from truefuse.ops.lm_head.linear_cross_entropy import linear_cross_entropy_ref

#: provider -> (loss(x, W, t), weight gradient into main_grad): what the accuracy columns run
_LOSSES: dict = {}

_BF = torch.bfloat16


def _inputs(p, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(p["N"], p["H"], generator=g, device=device, dtype=_BF)).requires_grad_()
    W = (torch.randn(p["V"], p["H"], generator=g, device=device, dtype=_BF) * p["H"] ** -0.5).requires_grad_()
    t = torch.randint(0, p["V"], (p["N"],), generator=g, device=device)
    return x, W, t


def _grads(loss_fn, main_grad: bool, p: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """d_input and d_weight of one forward + backward on the bench's inputs."""
    x, W, t = _inputs(p, device)
    if main_grad:
        W.main_grad = torch.zeros(W.shape, dtype=torch.float32, device=device)
    loss_fn(x, W, t).backward()
    return x.grad, W.main_grad if main_grad else W.grad


def _reference(p: dict, device, rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy's d_input and d_weight in float64 on the bench's bf16 inputs, ``rows``
    tokens at a time: ``linear_cross_entropy_ref`` under autograd would hold the whole float64
    logits and their gradient (80 GB at 32768 x 152064)."""
    x, W, t = _inputs(p, device)
    x64, W64 = x.detach().double(), W.detach().double()
    N = x64.shape[0]
    dx, dW = torch.empty_like(x64), torch.zeros_like(W64)
    for c in range(0, N, rows):
        pr = torch.softmax(x64[c : c + rows] @ W64.t(), dim=-1)
        pr[torch.arange(pr.shape[0], device=device), t[c : c + rows]] -= 1
        pr /= N
        dx[c : c + rows] = pr @ W64
        dW.addmm_(pr.t(), x64[c : c + rows])
    return dx, dW


def _rel_error(out: torch.Tensor, ref: torch.Tensor, rows: int = 8192) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 on the device, ``rows`` rows at a time: ``testing.rel_error``
    copies both to the CPU in float64 (12 GB and minutes for a 152064 × 5120 d_weight)."""
    num = sum(
        float(torch.linalg.vector_norm(out[i : i + rows].double() - ref[i : i + rows]) ** 2) for i in range(0, len(ref), rows)
    )
    return (num / float(torch.linalg.vector_norm(ref) ** 2)) ** 0.5


class _Accuracy:
    """The sweep's ``accuracy`` columns: each loss provider's errors, and their ratio to ``plain``'s
    (the float64 reference and plain's errors computed once per point)."""

    def __init__(self) -> None:
        self.point: dict | None = None

    def __call__(self, p: dict, provider: str, device) -> dict:
        if provider not in _LOSSES or device.type != "cuda":
            return {}
        if self.point != p:
            self.point, self.ref = dict(p), _reference(p, device)
            self.plain = [_rel_error(g, r) for g, r in zip(_grads(_plain, False, p, device), self.ref, strict=True)]
        errs = [_rel_error(g, r) for g, r in zip(_grads(*_LOSSES[provider], p, device), self.ref, strict=True)]
        ratios = [e / b for e, b in zip(errs, self.plain, strict=True)]
        return {"err_dx": errs[0], "err_dW": errs[1], "err_dx_ratio": ratios[0], "err_dW_ratio": ratios[1]}


def _step(loss_fn, main_grad=False):
    def make(p, device):
        x, W, t = _inputs(p, device)
        if main_grad:
            W.main_grad = torch.zeros(W.shape, dtype=torch.float32, device=device)

        def fn():
            x.grad = W.grad = None
            loss_fn(x, W, t).backward()

        return fn

    return make


def _gemms(p, device):
    x, W, _ = _inputs(p, device)
    x, W = x.detach(), W.detach()
    d = torch.randn(p["N"], p["V"], device=device, dtype=_BF)
    return lambda: (x @ W.t(), d @ W, d.t() @ x)


def _plain(x, W, t):
    return F.cross_entropy(F.linear(x, W).float(), t)


_compiled: dict = {}


def _compiled_step(name, fn):
    """``torch.compile(fn)`` compiled afresh for each shape, with static shapes: what a user's
    model (one shape) gets. A compile reused across the sweep's shapes turns dynamic, and with
    symbolic sizes Inductor cannot pad the GEMMs of an odd vocabulary (measured 79.5 against
    16.9 ms at 8192 x 50257 x 4096)."""

    def loss(x, W, t):
        key = (name, tuple(x.shape), tuple(W.shape))
        if key not in _compiled:
            _compiled[key] = torch.compile(fn, dynamic=False)
        return _compiled[key](x, W, t)

    return loss


def peers() -> dict:
    """The peers' fused losses that import here, as ``loss(x, W, t)`` callables."""
    out = {}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda x, W, t: liger(W, x, t)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        out["cce"] = lambda x, W, t: cce(x, W, t)
    except ImportError:
        pass
    return out


def sweep(quick: bool) -> Sweep:
    if quick:
        points = [{"N": 64, "V": 500, "H": 32}]
    else:
        points = [
            {"N": 8192, "V": 128256, "H": 4096},
            {"N": 16384, "V": 128256, "H": 4096},
            {"N": 8192, "V": 32000, "H": 4096},
            {"N": 4096, "V": 256000, "H": 2304},
            {"N": 8192, "V": 50257, "H": 4096},  # an odd vocabulary (GPT-2's): cuBLAS's slow case
            {"N": 32768, "V": 152064, "H": 5120},  # Qwen's vocabulary, a long sequence: 10 GB of bf16 logits
        ]
    losses = {
        "truefuse": (linear_cross_entropy, False),
        "plain": (_plain, False),
        "compile_plain": (_compiled_step("plain", _plain), False),
        "compile_ref": (_compiled_step("ref", linear_cross_entropy_ref), False),
        **{name: (fn, False) for name, fn in peers().items()},
    }
    for c in (2048, 4096, 8192):
        losses[f"truefuse_c{c}"] = (lambda x, W, t, c=c: linear_cross_entropy(x, W, t, chunk_size=c), False)
    # weight gradient accumulated in bf16: no fp32 accumulator
    losses["truefuse_bf16acc_c4096"] = (
        lambda x, W, t: linear_cross_entropy(x, W, t, chunk_size=4096, fp32_weight_grad=False),
        False,
    )
    losses["truefuse_main_grad"] = (lambda x, W, t: linear_cross_entropy(x, W, t, fuse_wgrad_accumulation=True), True)
    losses["truefuse_main_grad_c8192"] = (
        lambda x, W, t: linear_cross_entropy(x, W, t, chunk_size=8192, fuse_wgrad_accumulation=True),
        True,
    )
    losses["truefuse_lean"] = (lambda x, W, t: linear_cross_entropy(x, W, t, memory="lean"), False)
    losses["truefuse_lean_main_grad"] = (
        lambda x, W, t: linear_cross_entropy(x, W, t, memory="lean", fuse_wgrad_accumulation=True),
        True,
    )
    _LOSSES.clear()
    _LOSSES.update(losses)
    providers = {"gemms": _gemms, **{name: _step(fn, mg) for name, (fn, mg) in losses.items()}}
    return Sweep(
        name="linear_cross_entropy",
        points=points,
        providers=providers,
        reference="gemms",
        x="N",
        flops=lambda p: 6.0 * p["N"] * p["V"] * p["H"],
        rounds=2,
        accuracy=_Accuracy(),
    )
