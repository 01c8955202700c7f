"""``truefuse.rms_norm`` / ``truefuse.layer_norm``: validation, flattening, dispatch.

The Triton kernels run where ``ops.norm.use_kernel`` says (CUDA; fp32 under the CPU interpreter),
through the custom op ``torch.ops.truefuse.norm_fwd`` whose backward is registered on it (so
``torch.compile`` sees one opaque op); elsewhere the reference itself runs and autograd
differentiates it. Both follow one rounding rule
(``truefuse/kernels/norm.py``): fp32 statistics, one rounding of the output.
"""

from __future__ import annotations

import torch

from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.autograd._eager_op import call
from truefuse.autograd._modes import Modes
from truefuse.config import get_tuning
from truefuse.ops._launch.dtensor import on_local_rows
from truefuse.ops._launch.prepared import ToKeep
from truefuse.ops._launch.triton import PLAIN_TENSORS
from truefuse.ops.norm.norm import (
    HF_NORM_STYLES,
    hf_rstd_rows,
    hf_statistics,
    kernel_statistics,
    layer_norm_ref,
    norm_bwd_op,
    norm_fwd_op,
    rms_norm_hf_bi,
    rms_norm_hf_fwd_op,
    rms_norm_hf_pytorch_op,
    rms_norm_hf_ref,
    rms_norm_ref,
    use_kernel,
)
from truefuse.ops.norm.norm_kept import keep as keep_hf
from truefuse.ops.norm.norm_kept import kept_hf, launch_hf

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(x, params: dict[str, torch.Tensor | None], eps, name: str = "x") -> bool:
    """Each argument checked once, in one pass: a clear error naming it (``name``: x's), else whether
    any is a tensor subclass (a DTensor, for ``on_local_rows``; plain tensors skip that check)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} has dtype {x.dtype}; expected a float dtype")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (the hidden size is its last)")
    subclass = type(x) not in PLAIN_TENSORS
    for pname, p in params.items():
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{pname} must be a torch.Tensor or None, got {type(p).__name__}")
        if tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"{pname} has shape {tuple(p.shape)}; {name}'s last dimension is {x.shape[-1]}")
        if p.dtype not in _FLOATS:
            raise TypeError(f"{pname} has dtype {p.dtype}; expected a float dtype")
        if p.device != x.device:
            raise ValueError(f"{pname} is on {p.device} but {name} is on {x.device}")
        subclass = subclass or type(p) not in PLAIN_TENSORS
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    return subclass


def _run(x, weight, bias, eps, rms: bool, zero_centered_gamma: bool):
    if zero_centered_gamma and weight is None:
        raise ValueError("zero_centered_gamma=True needs a weight")
    if not use_kernel(x):
        if rms:
            return rms_norm_ref(x, weight, eps, zero_centered_gamma=zero_centered_gamma)
        return layer_norm_ref(x, weight, bias, eps, zero_centered_gamma=zero_centered_gamma)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = call(norm_fwd_op, x2, weight, bias, float(eps), rms, zero_centered_gamma)[0]
    return y.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dimension with fp32 statistics and one rounding (the rule in ``kernels/norm.py``).

    Args:
        x: (..., H), fp16 / bf16 / fp32 / fp64. The output has ``x``'s shape and dtype.
        weight: (H,) any float dtype (commonly ``x``'s or fp32), or None for no scale.
        eps: added to the mean square before the square root.
        zero_centered_gamma: the scale is ``1 + weight`` (weight initialised to zeros).

    Differentiable in ``x`` and ``weight``; the weight gradient is summed in fp32 and rounded once to
    ``weight.dtype``. Matches :func:`truefuse.ops.norm.norm.rms_norm_ref` (bounded contract).
    """
    if _check(x, {"weight": weight}, eps):  # a tensor subclass: a DTensor runs on each rank's rows
        y = on_local_rows(
            "rms_norm", lambda x, w: rms_norm(x, w, eps, zero_centered_gamma=zero_centered_gamma), {"x": x}, {"weight": weight}
        )
        if y is not None:
            return y
    return _run(x, weight, None, eps, True, zero_centered_gamma)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    """LayerNorm over the last dimension (biased variance), fp32 statistics, one rounding.

    Args:
        x: (..., H), fp16 / bf16 / fp32 / fp64.
        weight, bias: (H,) any float dtype, or None.
        eps: added to the variance.
        zero_centered_gamma: the scale is ``1 + weight``.

    Matches :func:`truefuse.ops.norm.norm.layer_norm_ref` (bounded contract).
    """
    if _check(x, {"weight": weight, "bias": bias}, eps):  # a tensor subclass: a DTensor runs on each rank's rows
        y = on_local_rows(
            "layer_norm",
            lambda x, w, b: layer_norm(x, w, b, eps, zero_centered_gamma=zero_centered_gamma),
            {"x": x},
            {"weight": weight, "bias": bias},
        )
        if y is not None:
            return y
    return _run(x, weight, bias, eps, False, zero_centered_gamma)


def _differentiated(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def _stock_cheaper(x: torch.Tensor, weight: torch.Tensor, bi: bool) -> bool:
    """Whether ``rms_norm_hf`` runs the stock expression itself: nothing to differentiate, a
    decode-sized ``x`` (the ``hf_norm_stock_numel`` knob), outside batch-invariant mode (whose
    statistics are the kernel's). The stock bits either way; fewer host µs here than two launches."""
    if _differentiated(x, weight):
        return False
    return x.numel() <= get_tuning().hf_norm_stock_numel and not bi


def stock_cheaper(x, weight) -> bool:
    """Whether a patched Hugging Face RMSNorm runs its stock forward itself
    (``integrations/huggingface/modules.py``): where ``rms_norm_hf`` would compute the stock
    expression anyway (``_stock_cheaper``: nothing to differentiate, a decode-sized ``x``, outside
    batch-invariant mode), the stock module's own forward gives those bits by definition with
    stock's host time: ``rms_norm_hf``'s checks and calls around the same expression cost ~9 µs of an
    H100 host's ~99 (docs/benchmarks.md, "Eager host time per op")."""
    return type(x) in PLAIN_TENSORS and _stock_cheaper(x, weight, Modes.now().batch_invariant)


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, style: str = "llama") -> torch.Tensor:
    """A transformers RMSNorm's forward, bit for bit, with truefuse's fused backward.

    The statistics are the stock module's own expression (``hf_rstd``: torch reduces, so the bits
    are torch's; in batch-invariant mode on CUDA the norm kernel's, ``hf_statistics``); the kernel
    applies them and the weight with the stock rounding of ``style``
    (``llama``: weight × round(x·rstd); ``gemma``: round(x·rstd·(1 + weight)); see
    ``ops.norm.HF_NORM_STYLES``), and the backward is one kernel from the saved rstd instead of
    autograd's chain of eight ops and their saved fp32 copies.

    Args:
        x: (..., H) fp16 / bf16 / fp32. weight: (H,).
        eps: the module's ``variance_epsilon`` / ``eps``.
        style: ``llama`` or ``gemma``.

    Returns:
        (..., H): ``promote(x.dtype, weight.dtype)`` for ``llama``, x's dtype for ``gemma`` (as stock).
        Forward bitwise equal to :func:`truefuse.ops.norm.norm.rms_norm_hf_ref`; gradients bounded.
    """
    bi = Modes.now().batch_invariant  # read once: the statistics below and the path to them agree
    grad = type(x) in PLAIN_TENSORS and type(weight) in PLAIN_TENSORS and _differentiated(x, weight)
    # a repeated call (batch-invariant decode; a training step): one kept launch (ops/norm/norm_kept.py)
    kept = kept_hf(x, weight, eps, style, bi) if bi or grad else None
    if kept is not None and type(kept) is not ToKeep:
        if grad:
            return _apply_kept(x, weight, kept, eps, style, bi)
        out = launch_hf(kept, x, weight)
        if out is not None:
            return out[0]
        kept = None
    if _check(x, {"weight": weight}, eps):  # a tensor subclass: a DTensor runs on each rank's rows
        y = on_local_rows("rms_norm_hf", lambda x, w: rms_norm_hf(x, w, eps, style=style), {"x": x}, {"weight": weight})
        if y is not None:
            return y
    if style not in HF_NORM_STYLES:
        raise ValueError(f"style must be one of {HF_NORM_STYLES}, got {style!r}")
    if weight is None:
        raise ValueError("weight must be a tensor: the stock modules always scale")
    if bi and not x.is_cuda and torch.compiler.is_compiling():
        return rms_norm_hf_pytorch_op(x, weight, eps, style)  # opaque: eager's bits (ops/norm/norm.py)
    if _stock_cheaper(x, weight, bi) or not use_kernel(x):  # the first, a decode step's, asks less
        return rms_norm_hf_ref(x, weight, eps, style=style)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    recorded = _differentiated(x, weight)  # any tensor type (``grad`` above: the plain ones a kept launch takes)
    if kernel_statistics(x, bi) and not torch.compiler.is_compiling() and (kept is not None or not recorded):
        with torch.no_grad():
            y2, rstd = rms_norm_hf_bi(x2, weight, eps, style)  # one launch
        if kept is not None:
            keep_hf(kept, x, x2, weight, y2, rstd, eps, style, bi)
        if not recorded:
            return y2.view(x.shape)
        kept = None  # kept for the next call; this one's graph records the op below
    else:
        with torch.no_grad():  # the op's backward differentiates through the statistics itself
            rstd = hf_statistics(x2, weight, eps, style, bi)
    # x whole (contiguous): the op flattens it to rows inside, with no view nodes in the graph
    y = call(rms_norm_hf_fwd_op, x if x.is_contiguous() else x.contiguous(), weight, rstd, style)
    if kept is not None:  # fast mode with a gradient: the op's own launch, applying rstd
        keep_hf(kept, x, x2, weight, y.view(x2.shape), rstd, eps, style, bi)
    return y


class _KeptNormHF(torch.autograd.Function):
    """``rms_norm_hf`` with a gradient where its launch is kept (``ops/norm/norm_kept.py``): in
    batch-invariant mode the one launch that writes y and the statistics (the path launches it for
    the statistics and then ``rms_norm_hf_fwd_op`` to apply them, the same y: tests/test_norm.py);
    in fast mode stock's statistics (``hf_rstd_rows``, torch's mean) and the op's launch applying them. The
    backward is the op's (``norm_bwd_op``'s body), in a Function of its own rather than the custom
    op's registered autograd (``autograd/_eager_op.py``): the same kernels, the same bits."""

    @staticmethod
    def forward(ctx, x, weight, entry, eps, style, bi):
        x2 = x.view(-1, x.shape[-1])  # kept only where the path's rows were a view of x
        rstd = None if bi else hf_rstd_rows(x2, eps)
        out = launch_hf(entry, x2, weight, rstd)
        if out is None:  # an output not aligned as the kept launch's: the path's launches
            rstd = hf_statistics(x2, weight, eps, style, bi) if rstd is None else rstd
            y2 = rms_norm_hf_fwd_op.body(x2, weight, rstd, style)
        else:
            y2, rstd = out
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_gamma = style == "gemma"
        return y2.view(x.shape)

    @staticmethod
    @refuses_double_backward("rms_norm", "truefuse.ops.norm.norm.rms_norm_ref")
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        N = x.shape[-1]
        dx, dw, _ = norm_bwd_op.body(
            dy.reshape(-1, N), x.view(-1, N), weight, None, rstd.new_empty(0), rstd, True, ctx.zero_centered_gamma
        )
        return dx.view(x.shape), dw, None, None, None, None


#: ``Function.apply`` without its Python layer (as ``autograd/_eager_op.py``'s: one ``forward``)
_apply_kept = super(torch.autograd.Function, _KeptNormHF).apply
