"""Residual add + RMSNorm: with stock transformers' rounding (``truefuse.add_rms_norm_hf``) and with
truefuse's own (``truefuse.add_rms_norm``, ``truefuse.RMSNorm(x, residual=)``): the references and
the custom ops (docs/add_norm.md).

The stock decoder layer writes ``h = residual + h; residual = h; h = norm(h)``: one rounding of
the sum to the stream's dtype, then the norm of that rounded sum. These ops keep both: ``summed``
is torch's ``residual + h``, ``normed`` is ``rms_norm_hf(summed)``'s bits. Where the statistics are
torch's (stock's reduction order, every mode but batch-invariant on CUDA) they need the sum first,
so the forward is torch's add, torch's statistics and the norm kernel applying them, as
``rms_norm_hf``; where they are the kernel's own (batch-invariant mode on CUDA, ``kernel_stats``),
one launch reads residual and h and writes the sum, the normed rows and rstd. The backward is one
kernel either way: the norm's backward with the residual stream's gradient added to dx before its
one rounding (autograd would round dx, then add).
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.custom_op import bwd_call, custom_op, register_backward
from truefuse.ops.norm.norm import (
    _bwd_staged,
    _hf_out_dtype,
    hf_rstd_rows,
    norm_bwd,
    norm_fwd,
    rms_norm_hf_ref,
    rms_norm_ref,
)

#: where a gradient penalty goes instead (the double-backward refusal names it)
REF = "truefuse.ops.norm.add_norm.add_rms_norm_hf_ref"


def add_rms_norm_hf_ref(
    residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, style: str = "llama"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock decoder layer's two expressions: ``summed = residual + h`` (torch's add in the
    inputs' dtype) and ``normed = rms_norm_hf_ref(summed, weight, eps, style=style)``.

    Args:
        residual, h: (..., H), the same shape and dtype; ``residual`` None for a layer's first
            norm, whose input is the residual stream itself (``summed`` is then ``h``).
        weight: (H,). style: ``llama`` / ``gemma``.

    Returns:
        ``(normed, summed)``: normed in ``rms_norm_hf_ref``'s dtype, summed in the inputs'.
    """
    summed = h if residual is None else residual + h
    return rms_norm_hf_ref(summed, weight, eps, style=style), summed


def _fwd_inline(residual, h, weight, eps, style, kernel_stats) -> bool:
    """Inline (``custom_op``) only the one-launch path: the torch-statistics path stays one opaque op
    in a compiled graph, so its statistics keep torch's eager reduction (stock's bits) rather than
    Inductor's code for them."""
    return bool(kernel_stats)


@custom_op("truefuse::add_rms_norm_hf_fwd", mutates_args=(), inline=_fwd_inline)
def add_rms_norm_hf_fwd_op(
    residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, style: str, kernel_stats: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(normed, summed, rstd)`` of contiguous (M, N) ``residual`` and ``h``: rstd (M,) fp32, the
    statistics applied. ``kernel_stats``: the norm kernel's own (batch-invariant mode on CUDA: the
    statistics ``rms_norm_hf_bi`` computes, here in the same launch as the add); else torch's
    (``hf_rstd_rows``: stock's expression's bits)."""
    zc, rn, out_dtype = style == "gemma", style == "llama", _hf_out_dtype(h, weight, style)
    if kernel_stats:
        summed = torch.empty_like(h)
        normed, _, rstd = norm_fwd(
            h,
            weight,
            None,
            eps,
            rms=True,
            zero_centered_gamma=zc,
            round_normed=rn,
            out_dtype=out_dtype,
            hf_stats=True,
            residual=residual,
            summed=summed,
        )
        return normed, summed, rstd
    summed = residual + h
    rstd = hf_rstd_rows(summed, eps)
    normed, _, _ = norm_fwd(
        summed, weight, None, 0.0, rms=True, zero_centered_gamma=zc, rstd=rstd, round_normed=rn, out_dtype=out_dtype
    )
    return normed, summed, rstd


@add_rms_norm_hf_fwd_op.register_fake
def _(residual, h, weight, eps, style, kernel_stats):
    out = torch.empty_like(h, dtype=_hf_out_dtype(h, weight, style))
    return out, torch.empty_like(h), h.new_empty((h.shape[0],), dtype=torch.float32)


def _bwd_inline(d_normed, d_summed, summed, weight, rstd, zero_centered_gamma) -> bool:
    """As ``norm_bwd``'s: not the TMA-staged backward (its host descriptor is not traced)."""
    return _bwd_staged(d_normed, summed, True) is None


@custom_op("truefuse::add_rms_norm_bwd", mutates_args=(), inline=_bwd_inline)
def add_rms_norm_bwd_op(
    d_normed: torch.Tensor,
    d_summed: torch.Tensor | None,
    summed: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_sum, dweight)``: the norm's backward at the saved ``summed`` and ``rstd`` plus the residual
    stream's own gradient ``d_summed`` (or none), in one kernel; dweight summed from the
    backward's per-program partials (deterministic, no atomics)."""
    dres = None if d_summed is None else d_summed.contiguous()
    d, dw, _ = norm_bwd(
        d_normed.contiguous(), summed, weight, None, None, rstd, rms=True, zero_centered_gamma=zero_centered_gamma, dres=dres
    )
    return d, (summed.new_empty(0) if dw is None else dw)  # an op's outputs are tensors: empty for no weight


@add_rms_norm_bwd_op.register_fake
def _(d_normed, d_summed, summed, weight, rstd, zero_centered_gamma):
    return torch.empty_like(summed), (summed.new_empty(0) if weight is None else torch.empty_like(weight))


def _setup(ctx, inputs, output):
    _residual, _h, weight, _eps, style, _kernel_stats = inputs
    _, summed, rstd = output
    ctx.mark_non_differentiable(rstd)
    # no zero-filled gradient for an output nothing used (rstd; normed or summed): -0 stays -0
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(summed, weight, rstd)
    ctx.zero_centered_gamma = style == "gemma"


def _grads(ctx, d_normed, d_summed):
    """``(d_sum, dweight)`` of both ops' backward (``dweight`` None where nothing reached ``normed``
    or there is no weight)."""
    summed, weight, rstd = ctx.saved_tensors
    if d_normed is None:  # only the residual stream was used: its gradient is the sum's
        return d_summed, None
    d, dw = bwd_call(ctx, add_rms_norm_bwd_op, d_normed, d_summed, summed, weight, rstd, ctx.zero_centered_gamma)
    return d, (None if weight is None else dw)


def _backward(ctx, d_normed, d_summed, _drstd):
    d, dw = _grads(ctx, d_normed, d_summed)
    # the same tensor for residual and h, as autograd's own add returns: nothing writes into it
    return d, d, dw, None, None, None


register_backward(add_rms_norm_hf_fwd_op, _backward, _setup, bwd_ops=(add_rms_norm_bwd_op,), name="add_rms_norm_hf", ref=REF)


# truefuse's own rounding (``truefuse.rms_norm``'s: fp32 statistics of the sum, one rounding): the
# sum, its statistics and the normed rows in one launch in every mode (a row's reduction is the
# norm kernel's, the same for every row count), the shared backward above.

#: where a gradient penalty goes instead
OWN_REF = "truefuse.ops.norm.add_norm.add_rms_norm_ref"


def add_rms_norm_ref(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    zero_centered_gamma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = residual + x`` (torch's add in the inputs' dtype) and
    ``normed = rms_norm_ref(summed, weight, eps)``: ``(normed, summed)``, both in x's dtype."""
    summed = residual + x
    return rms_norm_ref(summed, weight, eps, zero_centered_gamma=zero_centered_gamma), summed


@custom_op("truefuse::add_rms_norm_fwd", mutates_args=(), inline=True)
def add_rms_norm_fwd_op(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, zero_centered_gamma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(normed, summed, rstd)`` of contiguous (M, N) ``residual`` and ``x``: one launch of the norm
    kernel with ``HAS_RES`` (the launch ``rms_norm`` makes on the stored sum, which reads the same
    rounded values: its bits)."""
    summed = torch.empty_like(x)
    normed, _, rstd = norm_fwd(
        x, weight, None, eps, rms=True, zero_centered_gamma=zero_centered_gamma, residual=residual, summed=summed
    )
    return normed, summed, rstd


@add_rms_norm_fwd_op.register_fake
def _(residual, x, weight, eps, zero_centered_gamma):
    return torch.empty_like(x), torch.empty_like(x), x.new_empty((x.shape[0],), dtype=torch.float32)


def _own_setup(ctx, inputs, output):
    _residual, _x, weight, _eps, zero_centered_gamma = inputs
    _, summed, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for an unused output: -0 stays -0
    ctx.save_for_backward(summed, weight, rstd)
    ctx.zero_centered_gamma = zero_centered_gamma


def _own_backward(ctx, d_normed, d_summed, _drstd):
    d, dw = _grads(ctx, d_normed, d_summed)
    return d, d, dw, None, None


# the shared backward op's refusal names add_rms_norm_hf (as norm_bwd's names rms_norm for rms_norm_hf);
# the eager path names this op
register_backward(add_rms_norm_fwd_op, _own_backward, _own_setup, eager_names=lambda ctx: ("add_rms_norm", OWN_REF))
