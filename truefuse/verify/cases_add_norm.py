"""Contract cases of ``add_rms_norm_hf`` and ``add_rms_norm`` (docs/add_norm.md): the forward bitwise the stock layer's
two expressions (``add_rms_norm_hf_ref``), also in batch-invariant mode against ``rms_norm_hf`` of
the sum there (on CUDA the one fused launch's statistics against the norm's); forward and every
input gradient bounded against float64 (``rms_norm_ref``'s math on ``residual + h``), the stock
expressions under autograd as the baseline.
"""

from __future__ import annotations

import torch

from truefuse.autograd.add_norm import add_rms_norm, add_rms_norm_hf
from truefuse.autograd.norm import rms_norm, rms_norm_hf
from truefuse.config import batch_invariant, tuning
from truefuse.ops.norm.add_norm import add_rms_norm_hf_ref, add_rms_norm_ref
from truefuse.ops.norm.norm import HF_NORM_STYLES, rms_norm_ref
from truefuse.testing import bitwise_report, fwd_bwd_reports
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_M, _H = 77, 300  # odd on purpose: masked tails
_EPS = 1e-6


def _rand(shape, dtype, device, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(device, dtype)


def _inputs(style: str, dtype, device):
    residual = _rand((_M, _H), dtype, device, 11, 2.0, 0.5)
    h = _rand((_M, _H), dtype, device, 12, 0.5)
    w = _rand((_H,), dtype, device, 13, 0.5, 0.0 if style == "gemma" else 1.0)
    return residual, h, w


def _fwd_case(style: str, dtype):
    """Both outputs bit for bit; the kernel path pinned (nothing requires grad, so a small call would
    otherwise run the stock expressions themselves)."""

    def case(device):
        r, h, w = _inputs(style, dtype, device)
        with tuning(hf_norm_stock_numel=1):
            normed, summed = add_rms_norm_hf(r, h, w, _EPS, style=style)
        want_normed, want_summed = add_rms_norm_hf_ref(r, h, w, _EPS, style=style)
        return {"normed": bitwise_report(normed, want_normed), "summed": bitwise_report(summed, want_summed)}

    return case


def _bi_case(style: str, dtype):
    """In batch-invariant mode, with a gradient (a trainer's call) and without (a sampler's): the
    sum is ``residual + h`` and the normed rows ``rms_norm_hf``'s of it in the same mode. On CUDA
    that is the fused launch's statistics against the norm kernel's (another variant of the same
    kernel, docs/design.md §6.10); on the CPU both are torch's."""

    def case(device):
        r, h, w = _inputs(style, dtype, device)
        want_summed = r + h
        with tuning(hf_norm_stock_numel=1), batch_invariant():
            with torch.no_grad():
                want = rms_norm_hf(want_summed, w, _EPS, style=style)
                sampler, _ = add_rms_norm_hf(r, h, w, _EPS, style=style)
            trainer, summed = add_rms_norm_hf(r.clone().requires_grad_(), h, w, _EPS, style=style)
        return {
            "normed_with_grad": bitwise_report(trainer.detach(), want),
            "normed_no_grad": bitwise_report(sampler, want),
            "summed": bitwise_report(summed.detach(), want_summed),
        }

    return case


def _pack(normed, summed):
    """One output of both (the same dtype here), so one random upstream reaches each."""
    return torch.stack([normed, summed])


def _bwd_case(style: str, dtype):
    def case(device):
        r, h, w = _inputs(style, dtype, device)
        zc = style == "gemma"
        return fwd_bwd_reports(
            lambda r, h, w: _pack(*add_rms_norm_hf(r, h, w, _EPS, style=style)),
            lambda r, h, w: _pack(rms_norm_ref(r + h, w, _EPS, zero_centered_gamma=zc), r + h),
            lambda r, h, w: _pack(*add_rms_norm_hf_ref(r, h, w, _EPS, style=style)),
            {"residual": r, "h": h, "weight": w},
        )

    return case


def _keep_fwd_case(style: str, dtype):
    """``residual=None`` (a layer's first norm) with a gradient to take (the one-node path): normed
    ``rms_norm_hf``'s bits, summed ``h``'s."""

    def case(device):
        _, h, w = _inputs(style, dtype, device)
        hl = h.clone().requires_grad_()
        normed, summed = add_rms_norm_hf(None, hl, w, _EPS, style=style)
        return {
            "normed": bitwise_report(normed.detach(), rms_norm_hf(h, w, _EPS, style=style)),
            "summed": bitwise_report(summed.detach(), h),
        }

    return case


def _keep_bwd_case(style: str, dtype):
    def case(device):
        _, h, w = _inputs(style, dtype, device)
        zc = style == "gemma"
        return fwd_bwd_reports(
            lambda h, w: _pack(*add_rms_norm_hf(None, h, w, _EPS, style=style)),
            lambda h, w: _pack(rms_norm_ref(h, w, _EPS, zero_centered_gamma=zc), h),
            lambda h, w: _pack(*add_rms_norm_hf_ref(None, h, w, _EPS, style=style)),
            {"h": h, "weight": w},
        )

    return case


for _dn, _dt in _DTYPES.items():
    for _style in HF_NORM_STYLES:
        register("add_rms_norm_hf", f"fwd_{_style}_{_dn}", "bitwise")(_fwd_case(_style, _dt))
        register("add_rms_norm_hf", f"fwd_batch_invariant_{_style}_{_dn}", "bitwise")(_bi_case(_style, _dt))
        register("add_rms_norm_hf", f"fwd_bwd_{_style}_{_dn}", "bounded")(_bwd_case(_style, _dt))
        register("add_rms_norm_hf", f"fwd_no_residual_{_style}_{_dn}", "bitwise")(_keep_fwd_case(_style, _dt))
        register("add_rms_norm_hf", f"fwd_bwd_no_residual_{_style}_{_dn}", "bounded")(_keep_bwd_case(_style, _dt))


# truefuse's own rounding: the sum torch's add, the normed rows truefuse.rms_norm's of it, bit for bit
# (on CUDA the fused launch against the norm's launch on the stored sum); gradients bounded against
# float64, the unfused composition under autograd as the baseline


def _own_fwd_case(dtype, zc: bool):
    def case(device):
        r, x, w = _inputs("gemma" if zc else "llama", dtype, device)
        normed, summed = add_rms_norm(r, x, w, _EPS, zero_centered_gamma=zc)
        want_summed = r + x
        return {
            "normed": bitwise_report(normed, rms_norm(want_summed, w, _EPS, zero_centered_gamma=zc)),
            "summed": bitwise_report(summed, want_summed),
        }

    return case


def _own_bwd_case(dtype, zc: bool):
    def case(device):
        r, x, w = _inputs("gemma" if zc else "llama", dtype, device)
        return fwd_bwd_reports(
            lambda r, x, w: _pack(*add_rms_norm(r, x, w, _EPS, zero_centered_gamma=zc)),
            lambda r, x, w: _pack(rms_norm_ref(r + x, w, _EPS, zero_centered_gamma=zc), r + x),
            lambda r, x, w: _pack(*add_rms_norm_ref(r, x, w, _EPS, zero_centered_gamma=zc)),
            {"residual": r, "x": x, "weight": w},
        )

    return case


for _dn, _dt in _DTYPES.items():
    for _zc in (False, True):
        _tag = "zero_centered_" if _zc else ""
        register("add_rms_norm", f"fwd_{_tag}{_dn}", "bitwise")(_own_fwd_case(_dt, _zc))
        register("add_rms_norm", f"fwd_bwd_{_tag}{_dn}", "bounded")(_own_bwd_case(_dt, _zc))
