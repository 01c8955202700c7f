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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.autograd.linear_cross_entropy import linear_cross_entropy
from truefuse.bench.harness import Sweep
from truefuse.ops.linear_cross_entropy import linear_cross_entropy_ref

_BF = torch.bfloat16


def _inputs(p, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(p["N"], p["H"], generator=g, device=device, dtype=_BF)).requires_grad_()
    W = (torch.randn(p["V"], p["H"], generator=g, device=device, dtype=_BF) * p["H"] ** -0.5).requires_grad_()
    t = torch.randint(0, p["V"], (p["N"],), generator=g, device=device)
    return x, W, t


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
        ]
    providers = {
        "gemms": _gemms,
        "truefuse": _step(linear_cross_entropy),
        "plain": _step(_plain),
        "compile_plain": _step(_compiled_step("plain", _plain)),
        "compile_ref": _step(_compiled_step("ref", linear_cross_entropy_ref)),
        **{name: _step(fn) for name, fn in peers().items()},
    }
    for c in (2048, 4096, 8192):
        providers[f"truefuse_c{c}"] = _step(lambda x, W, t, c=c: linear_cross_entropy(x, W, t, chunk_size=c))
    # weight gradient accumulated in bf16: no fp32 accumulator
    providers["truefuse_bf16acc_c4096"] = _step(
        lambda x, W, t: linear_cross_entropy(x, W, t, chunk_size=4096, fp32_weight_grad=False)
    )
    providers["truefuse_main_grad"] = _step(
        lambda x, W, t: linear_cross_entropy(x, W, t, fuse_wgrad_accumulation=True), main_grad=True
    )
    providers["truefuse_main_grad_c8192"] = _step(
        lambda x, W, t: linear_cross_entropy(x, W, t, chunk_size=8192, fuse_wgrad_accumulation=True), main_grad=True
    )
    providers["truefuse_lean"] = _step(lambda x, W, t: linear_cross_entropy(x, W, t, memory="lean"))
    providers["truefuse_lean_main_grad"] = _step(
        lambda x, W, t: linear_cross_entropy(x, W, t, memory="lean", fuse_wgrad_accumulation=True), main_grad=True
    )
    return Sweep(
        name="linear_cross_entropy",
        points=points,
        providers=providers,
        reference="gemms",
        x="N",
        flops=lambda p: 6.0 * p["N"] * p["V"] * p["H"],
        rounds=2,
    )
