"""Contract cases of the norms: ``rms_norm``, ``layer_norm`` (bounded) and ``rms_norm_hf``
(bitwise forward, bounded gradients), docs/design.md §1.

The op under test runs on the device; the float64 reference is the op's ``_ref`` on float64 CPU
copies; the baseline is PyTorch's own same-dtype path (``F.rms_norm``, ``F.layer_norm``; the stock
transformers module for ``rms_norm_hf``). Forward output and every input gradient are reported.
"""

from __future__ import annotations

import torch

from truefuse.autograd.norm import layer_norm, rms_norm, rms_norm_hf
from truefuse.config import tuning
from truefuse.ops.norm.norm import HF_NORM_STYLES, layer_norm_ref, layer_norm_torch, rms_norm_hf_ref, rms_norm_ref, rms_norm_torch
from truefuse.testing import bitwise_report, fwd_bwd_reports
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_M, _H = 77, 300  # odd on purpose: masked tails


def _rand(shape, dtype, device, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(device, dtype)


def _norm_case(rms: bool, dtype, zc: bool):
    def case(device):
        x = _rand((_M, _H), dtype, device, 1, 2.0, 0.5)
        w = _rand((_H,), dtype, device, 2, 0.5 if zc else 1.0)
        if rms:
            ins = {"x": x, "weight": w}
            return fwd_bwd_reports(rms_norm, rms_norm_ref, rms_norm_torch, ins, eps=1e-6, zero_centered_gamma=zc)
        ins = {"x": x, "weight": w, "bias": _rand((_H,), dtype, device, 3)}
        return fwd_bwd_reports(layer_norm, layer_norm_ref, layer_norm_torch, ins, eps=1e-5, zero_centered_gamma=zc)

    return case


for _dn, _dt in _DTYPES.items():
    for _zc in (False, True):
        _sfx = f"{_dn}{'_zero_centered' if _zc else ''}"
        register("rms_norm", f"fwd_bwd_{_sfx}", "bounded")(_norm_case(True, _dt, _zc))
        register("layer_norm", f"fwd_bwd_{_sfx}", "bounded")(_norm_case(False, _dt, _zc))


def _hf_norm_inputs(style: str, dtype, device):
    return _rand((_M, _H), dtype, device, 5, 2.0, 0.5), _rand((_H,), dtype, device, 6, 0.5, 0.0 if style == "gemma" else 1.0)


def _hf_fwd_case(style: str, dtype):
    """The stock transformers module's forward, bit for bit (docs/huggingface.md), by the kernel
    (nothing requires grad here, so a small call would otherwise run the stock expression itself)."""

    def case(device):
        x, w = _hf_norm_inputs(style, dtype, device)
        with tuning(hf_norm_stock_numel=1):
            y = rms_norm_hf(x, w, 1e-6, style=style)
        return {"out": bitwise_report(y, rms_norm_hf_ref(x, w, 1e-6, style=style))}

    return case


def _hf_bwd_case(style: str, dtype):
    """Gradients against float64 (the same math: ``rms_norm_ref``), the stock module as the baseline."""

    def case(device):
        x, w = _hf_norm_inputs(style, dtype, device)
        zc = style == "gemma"
        return fwd_bwd_reports(
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
