"""``python -m truefuse bench gemm``: the weight-gradient GEMM into fp32 ``main_grad``.

``dW (N×K) = dYᵀ X`` over M tokens, bf16 inputs. Providers (ratios against ``bf16_gemm``, the
plain cuBLAS GEMM of the same shape writing bf16: the floor):

* ``bf16_gemm_then_fp32_add``: what a framework without beta=1 into fp32 does;
* ``fp32_accumulate``: ``truefuse.gemm(..., out=main_grad, accumulate=True)`` (default plan);
* ``..._bgrad``: plus the bias-gradient (default plan, and ``_split`` with every fused
  bias-gradient capability removed);
* ``..._dgelu_bgrad``: the same after GELU's derivative;
* ``triton_...``: the Triton backend preferred, whose GEMM fuses the derivative and bias-gradient.
"""

from __future__ import annotations

import contextlib

import torch

from truefuse.bench.harness import Sweep
from truefuse.ops.gemm.gemm import gemm
from truefuse.ops.gemm.gemm_plan import Capability, override_capabilities

_NO_FUSED_BGRAD = [Capability("grad_bias"), Capability("grad_activation")]


def _inputs(p: dict, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    dy = torch.randn(p["M"], p["N"], generator=g, **bf)
    x = torch.randn(p["M"], p["K"], generator=g, **bf)
    pre = torch.randn(p["M"], p["N"], generator=g, **bf)
    mg = torch.randn(p["N"], p["K"], generator=g, device=device)
    return dy, x, pre, mg


def _truefuse(bgrad: bool, dgelu: bool, ctx=contextlib.nullcontext):
    def make(p, device):
        dy, x, pre, mg = _inputs(p, device)
        kw = {"grad_bias": bgrad}
        if dgelu:
            kw.update(grad_activation="gelu", pre_activation=pre.t())

        def fn():
            with ctx():
                return gemm(dy.t(), x, out=mg, accumulate=True, **kw)

        return fn

    return make


def _bf16_gemm(p, device):
    dy, x, _, _ = _inputs(p, device)
    return lambda: torch.mm(dy.t(), x)


def _bf16_then_add(p, device):
    dy, x, _, mg = _inputs(p, device)
    return lambda: mg.add_(torch.mm(dy.t(), x))


def sweep(quick: bool) -> Sweep:
    points = (
        [{"M": 256, "N": 128, "K": 192}]
        if quick
        else [{"M": 8192, "N": 4096, "K": 4096}, {"M": 16384, "N": 4096, "K": 4096}, {"M": 8192, "N": 14336, "K": 4096}]
    )
    split = lambda: override_capabilities(remove=_NO_FUSED_BGRAD)  # noqa: E731
    triton = lambda: override_capabilities(backends=["triton", "torch"])  # noqa: E731
    providers = {
        "bf16_gemm": _bf16_gemm,
        "bf16_gemm_then_fp32_add": _bf16_then_add,
        "fp32_accumulate": _truefuse(False, False),
        "fp32_accumulate_bgrad": _truefuse(True, False),
        "fp32_accumulate_bgrad_split": _truefuse(True, False, split),
        "fp32_accumulate_dgelu_bgrad": _truefuse(True, True),
        "fp32_accumulate_dgelu_bgrad_split": _truefuse(True, True, split),
    }
    if torch.cuda.is_available():
        providers["triton_fp32_accumulate"] = _truefuse(False, False, triton)
        providers["triton_fp32_accumulate_bgrad"] = _truefuse(True, False, triton)
        providers["triton_fp32_accumulate_dgelu_bgrad"] = _truefuse(True, True, triton)
    return Sweep(
        name="gemm_wgrad",
        points=points,
        providers=providers,
        reference="bf16_gemm",
        x="M",
        flops=lambda p: 2.0 * p["M"] * p["N"] * p["K"],
    )
