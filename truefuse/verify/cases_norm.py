"""Contract cases of the norms and gated activations (bounded, docs/design.md §1).

The op under test runs on the device; the float64 reference is the op's ``_ref`` on float64 CPU
copies; the baseline is PyTorch's own same-dtype path (``F.rms_norm``, ``F.layer_norm``,
``F.silu(gate) * up``). Forward output and every input gradient are reported.
"""

from __future__ import annotations

import torch

from truefuse.autograd.gated_activation import gated_activation
from truefuse.autograd.norm import layer_norm, rms_norm, rms_norm_hf
from truefuse.ops.gated_activation import GATED_ACTIVATIONS, gated_activation_ref, gated_activation_torch
from truefuse.ops.norm import HF_NORM_STYLES, layer_norm_ref, layer_norm_torch, rms_norm_hf_ref, rms_norm_ref, rms_norm_torch
from truefuse.testing import bitwise_report, bounded_report
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_M, _H = 77, 300  # odd on purpose: masked tails


def check_fn(fn, ref, base, inputs: dict[str, torch.Tensor], seed: int = 0, **kw):
    """Reports for ``fn(*inputs, **kw)`` and the gradients of its float inputs against ``ref`` on
    float64 copies, with ``base`` (same dtype) as the baseline; a random upstream gradient."""

    def run(f, tensors):
        leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
        y = f(*leaves.values(), **kw)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1)).to(y)
        y.backward(dy)
        return {"out": y.detach(), **{f"d{k}": v.grad for k, v in leaves.items() if v.grad is not None}}

    got = run(fn, inputs)
    baseline = run(base, inputs)
    ref64 = run(ref, {k: v.detach().cpu().double() for k, v in inputs.items()})
    return {k: bounded_report(got[k], ref64[k], baseline[k]) for k in got}


def _rand(shape, dtype, device, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(device, dtype)


def _norm_case(rms: bool, dtype, zc: bool):
    def case(device):
        x = _rand((_M, _H), dtype, device, 1, 2.0, 0.5)
        w = _rand((_H,), dtype, device, 2, 0.5 if zc else 1.0)
        if rms:
            ins = {"x": x, "weight": w}
            return check_fn(rms_norm, rms_norm_ref, rms_norm_torch, ins, eps=1e-6, zero_centered_gamma=zc)
        ins = {"x": x, "weight": w, "bias": _rand((_H,), dtype, device, 3)}
        return check_fn(layer_norm, layer_norm_ref, layer_norm_torch, ins, eps=1e-5, zero_centered_gamma=zc)

    return case


for _dn, _dt in _DTYPES.items():
    for _zc in (False, True):
        _sfx = f"{_dn}{'_zero_centered' if _zc else ''}"
        register("rms_norm", f"fwd_bwd_{_sfx}", "bounded")(_norm_case(True, _dt, _zc))
        register("layer_norm", f"fwd_bwd_{_sfx}", "bounded")(_norm_case(False, _dt, _zc))


def _gated_case(name: str, dtype):
    def case(device):
        ins = {"x": _rand((_M, 2 * _H), dtype, device, 4, 2.0)}
        return check_fn(gated_activation, gated_activation_ref, gated_activation_torch, ins, name=name)

    return case


for _dn, _dt in _DTYPES.items():
    for _name in GATED_ACTIVATIONS:
        register("gated_activation", f"{_name}_{_dn}", "bounded")(_gated_case(_name, _dt))


def _hf_norm_inputs(style: str, dtype, device):
    return _rand((_M, _H), dtype, device, 5, 2.0, 0.5), _rand((_H,), dtype, device, 6, 0.5, 0.0 if style == "gemma" else 1.0)


def _hf_fwd_case(style: str, dtype):
    """The stock transformers module's forward, bit for bit (docs/huggingface.md)."""

    def case(device):
        x, w = _hf_norm_inputs(style, dtype, device)
        return {"out": bitwise_report(rms_norm_hf(x, w, 1e-6, style=style), rms_norm_hf_ref(x, w, 1e-6, style=style))}

    return case


def _hf_bwd_case(style: str, dtype):
    """Gradients against float64 (the same math: ``rms_norm_ref``), the stock module as the baseline."""

    def case(device):
        x, w = _hf_norm_inputs(style, dtype, device)
        zc = style == "gemma"
        return check_fn(
            lambda x, w: rms_norm_hf(x, w, 1e-6, style=style),
            lambda x, w: rms_norm_ref(x, w, 1e-6, zero_centered_gamma=zc),
            lambda x, w: rms_norm_hf_ref(x, w, 1e-6, style=style),
            {"x": x, "weight": w},
        )

    return case


for _dn, _dt in _DTYPES.items():
    for _style in HF_NORM_STYLES:
        register("rms_norm_hf", f"fwd_{_style}_{_dn}", "bitwise")(_hf_fwd_case(_style, _dt))
        register("rms_norm_hf", f"fwd_bwd_{_style}_{_dn}", "bounded")(_hf_bwd_case(_style, _dt))
