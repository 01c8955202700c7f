"""``truefuse.add_rms_norm_hf``: a decoder layer's residual add and the RMSNorm after it, stock's
bits forward, one backward kernel (docs/add_norm.md). Validation, flattening, dispatch."""

from __future__ import annotations

import torch

from truefuse.autograd._eager_op import call
from truefuse.autograd._modes import Modes
from truefuse.autograd.norm import _check, _stock_cheaper
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops.norm.add_norm import add_rms_norm_hf_fwd_op, add_rms_norm_hf_ref
from truefuse.ops.norm.norm import HF_NORM_STYLES, kernel_statistics, rms_norm_hf_pytorch_op, use_kernel


def _check_residual(residual, h) -> None:
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.shape != h.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}; h has {tuple(h.shape)} (the same shape, no broadcast)")
    if residual.dtype != h.dtype:
        # torch would promote; the stock layer's residual stream has one dtype, and the sum's is what it keeps
        raise TypeError(f"residual has dtype {residual.dtype}; h has {h.dtype} (the same dtype)")
    if residual.device != h.device:
        raise ValueError(f"residual is on {residual.device} but h is on {h.device}")


def add_rms_norm_hf(
    residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, style: str = "llama"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers decoder layer's ``summed = residual + h`` and ``normed = norm(summed)``, with
    the stock module's bits, and one backward kernel for both.

    ``summed`` is torch's ``residual + h`` (one rounding to the inputs' dtype); ``normed`` is
    :func:`truefuse.rms_norm_hf` of it, bit for bit (its statistics torch's reduction, or in
    batch-invariant mode on CUDA the norm kernel's, there in the same launch as the add). The
    backward is the norm's backward with the residual stream's gradient added before dx's one
    rounding, returned as the gradient of both ``residual`` and ``h`` (the same tensor, as
    autograd's add returns); the weight gradient summed from per-program partials (deterministic).

    Args:
        residual, h: (..., H), fp16 / bf16 / fp32, the same shape, dtype and device.
        weight: (H,), the norm's weight. eps: its ``variance_epsilon`` / ``eps``.
        style: ``llama`` or ``gemma`` (``ops.norm.norm.HF_NORM_STYLES``).

    Returns:
        ``(normed, summed)``: normed (..., H) in ``rms_norm_hf``'s dtype (``promote(h, weight)``
        for llama, h's for gemma), summed (..., H) in h's dtype. Forward bitwise
        :func:`truefuse.ops.norm.add_norm.add_rms_norm_hf_ref`; gradients bounded.
    """
    _check(h, {"weight": weight}, eps, name="h")
    refuse_dtensor("add_rms_norm_hf", residual=residual, h=h, weight=weight)
    _check_residual(residual, h)
    if style not in HF_NORM_STYLES:
        raise ValueError(f"style must be one of {HF_NORM_STYLES}, got {style!r}")
    if weight is None:
        raise ValueError("weight must be a tensor: the stock modules always scale")
    bi = Modes.now().batch_invariant  # read once: which statistics, for the whole call
    if bi and not h.is_cuda and torch.compiler.is_compiling():
        summed = residual + h  # the norm's PyTorch path as one opaque op, as rms_norm_hf's: eager's bits
        return rms_norm_hf_pytorch_op(summed, weight, float(eps), style), summed
    cheaper = _stock_cheaper(h, weight, bi) and not (torch.is_grad_enabled() and residual.requires_grad)
    if not use_kernel(h) or cheaper:
        return add_rms_norm_hf_ref(residual, h, weight, eps, style=style)
    n = h.shape[-1]
    r2, h2 = residual.reshape(-1, n).contiguous(), h.reshape(-1, n).contiguous()
    kernel_stats = kernel_statistics(h, bi)
    normed, summed, _ = call(add_rms_norm_hf_fwd_op, r2, h2, weight, float(eps), style, kernel_stats)
    return normed.view(h.shape), summed.view(h.shape)
