"""``truefuse.add_rms_norm_hf`` and ``truefuse.add_rms_norm``: a decoder layer's residual add and
the RMSNorm after it, with stock transformers' bits or truefuse's own rounding, one kernel each way
(docs/add_norm.md). Validation, flattening, dispatch."""

from __future__ import annotations

import torch

from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.autograd._eager_op import call
from truefuse.autograd._modes import Modes
from truefuse.autograd.norm import _check, _differentiated, _stock_cheaper, rms_norm_hf
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.triton import PLAIN_TENSORS
from truefuse.ops.norm.add_norm import (
    REF,
    add_rms_norm_bwd_op,
    add_rms_norm_fwd_op,
    add_rms_norm_hf_fwd_op,
    add_rms_norm_hf_ref,
    add_rms_norm_ref,
)
from truefuse.ops.norm.norm import (
    HF_NORM_STYLES,
    hf_rstd_rows,
    kernel_statistics,
    rms_norm_hf_bi,
    rms_norm_hf_fwd_op,
    rms_norm_hf_pytorch_op,
    use_kernel,
)


def _check_residual(residual, h, name: str = "h") -> None:
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.shape != h.shape:
        raise ValueError(
            f"residual has shape {tuple(residual.shape)}; {name} has {tuple(h.shape)} (the same shape, no broadcast)"
        )
    if residual.dtype != h.dtype:
        # torch would promote; the stock layer's residual stream has one dtype, and the sum's is what it keeps
        raise TypeError(f"residual has dtype {residual.dtype}; {name} has {h.dtype} (the same dtype)")
    if residual.device != h.device:
        raise ValueError(f"residual is on {residual.device} but {name} is on {h.device}")


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

    ``residual=None`` is a layer's first norm (``residual = h; h = norm(h)``): ``summed`` is ``h``
    itself, returned through the norm's node, so the residual stream's gradient is added inside the
    norm's backward kernel rather than by autograd's add (the forward is ``rms_norm_hf``'s).

    Args:
        residual, h: (..., H), fp16 / bf16 / fp32, the same shape, dtype and device; ``residual``
            may be None (above).
        weight: (H,), the norm's weight. eps: its ``variance_epsilon`` / ``eps``.
        style: ``llama`` or ``gemma`` (``ops.norm.norm.HF_NORM_STYLES``).

    Returns:
        ``(normed, summed)``: normed (..., H) in ``rms_norm_hf``'s dtype (``promote(h, weight)``
        for llama, h's for gemma), summed (..., H) in h's dtype. Forward bitwise
        :func:`truefuse.ops.norm.add_norm.add_rms_norm_hf_ref`; gradients bounded.
    """
    _check(h, {"weight": weight}, eps, name="h")
    refuse_dtensor("add_rms_norm_hf", residual=residual, h=h, weight=weight)
    if residual is not None:
        _check_residual(residual, h)
    if style not in HF_NORM_STYLES:
        raise ValueError(f"style must be one of {HF_NORM_STYLES}, got {style!r}")
    if weight is None:
        raise ValueError("weight must be a tensor: the stock modules always scale")
    bi = Modes.now().batch_invariant  # read once: which statistics, for the whole call
    if residual is None:
        return _norm_keeping(h, weight, eps, style, bi)
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


def _norm_keeping(h, weight, eps, style: str, bi: bool):
    """``add_rms_norm_hf(None, h, ...)``: the norm's node returns ``h`` too where a kernel backward
    can take its gradient (eager, plain tensors, a gradient to take); else ``rms_norm_hf`` and ``h``
    (autograd adds the two gradients, Inductor fuses that add under torch.compile)."""
    plain = type(h) in PLAIN_TENSORS and type(weight) in PLAIN_TENSORS
    if not (plain and _differentiated(h, weight) and use_kernel(h)) or torch.compiler.is_compiling():
        return rms_norm_hf(h, weight, eps, style=style), h
    return _NormKeeping.apply(h, weight, float(eps), style, bi)


class _NormKeeping(torch.autograd.Function):
    """``(rms_norm_hf(h), h)`` with one backward kernel for both: ``add_rms_norm_bwd``'s, the
    residual stream's gradient added to dx before its one rounding. The forward is
    ``rms_norm_hf``'s launches (the same bits)."""

    @staticmethod
    def forward(ctx, h, weight, eps, style, bi):
        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        if kernel_statistics(h2, bi):  # batch-invariant on CUDA: one launch writes y and its statistics
            normed, rstd = rms_norm_hf_bi(h2, weight, eps, style)  # y as applying them would (tests/test_norm.py)
        else:
            rstd = hf_rstd_rows(h2, eps)  # stock's statistics (torch's reduction), then the kernel applies them
            normed = rms_norm_hf_fwd_op.body(h2, weight, rstd, style)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for an output nothing used
        ctx.save_for_backward(h2, weight, rstd)
        ctx.zero_centered_gamma = style == "gemma"
        return normed.view(*h.shape[:-1], normed.shape[-1]), h  # h itself: autograd makes it this node's view

    @staticmethod
    @refuses_double_backward("add_rms_norm_hf", REF)
    def backward(ctx, d_normed, d_summed):
        h2, weight, rstd = ctx.saved_tensors
        if d_normed is None:  # only the residual stream was used
            return d_summed, None, None, None, None
        shape = d_normed.shape
        d_res = None if d_summed is None else d_summed.reshape(h2.shape)
        d, dw = add_rms_norm_bwd_op.body(d_normed.reshape(h2.shape), d_res, h2, weight, rstd, ctx.zero_centered_gamma)
        return d.view(shape), dw, None, None, None


def add_rms_norm(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    zero_centered_gamma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = residual + x`` and ``normed = truefuse.rms_norm(summed, weight, eps)`` in one kernel
    each way: a pre-norm block's residual add and the norm after it (``truefuse.RMSNorm(x,
    residual=...)``; vLLM's and TransformerEngine's fused add + norm take the same pair).

    ``summed`` is torch's ``residual + x`` (one rounding to the inputs' dtype); ``normed`` is
    :func:`truefuse.rms_norm` of it bit for bit (the same kernel, which here reads the two inputs
    and stores their rounded sum before norming it). The backward is the norm's with the residual
    stream's gradient added before dx's one rounding, returned for both ``residual`` and ``x`` (the
    same tensor, as autograd's add returns); the weight gradient from per-program partials
    (deterministic). A row's bits never depend on the other rows (every mode).

    Args:
        residual, x: (..., H), fp16 / bf16 / fp32 / fp64, the same shape, dtype and device.
        weight: (H,) or None. eps: added to the mean square.
        zero_centered_gamma: the scale is ``1 + weight``.

    Returns:
        ``(normed, summed)``, both (..., H) in x's dtype. Forward bitwise
        :func:`truefuse.ops.norm.add_norm.add_rms_norm_ref`; gradients bounded.
    """
    _check(x, {"weight": weight}, eps)
    refuse_dtensor("add_rms_norm", residual=residual, x=x, weight=weight)
    _check_residual(residual, x, name="x")
    if zero_centered_gamma and weight is None:
        raise ValueError("zero_centered_gamma=True needs a weight")
    if not use_kernel(x):
        return add_rms_norm_ref(residual, x, weight, eps, zero_centered_gamma=zero_centered_gamma)
    n = x.shape[-1]
    r2, x2 = residual.reshape(-1, n).contiguous(), x.reshape(-1, n).contiguous()
    normed, summed, _ = call(add_rms_norm_fwd_op, r2, x2, weight, float(eps), bool(zero_centered_gamma))
    return normed.view(x.shape), summed.view(x.shape)
