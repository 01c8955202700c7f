"""``truefuse.sibling_linears``: projections that read one input, their input gradient summed inside
the GEMMs (``ops/gemm/siblings.py``; docs/sibling_linears.md). Validation, autocast, the Function.

The forward is the stock calls themselves (``F.linear`` each, the same bits); the weight and bias
gradients are torch's linear backward's calls (the same bits); only ``x``'s gradient differs: one
rounding a product (the GEMM adds the running sum in fp32) where autograd rounds each product and
then each sum.
"""

from __future__ import annotations

import torch

from truefuse.autograd._autocast import autocast_disabled, autocast_dtype, cast
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops.gemm.siblings import sibling_linears_ref, summed_input_grad, weight_and_bias_grads


class SiblingLinears(torch.autograd.Function):
    """``(F.linear(x, W_i, b_i))_i`` with ``dx = Σ_i dy_i W_i`` in accumulating GEMMs. Arguments:
    ``x``, then the ``k`` weights, then the ``k`` biases (None where absent), all already in the
    dtype the GEMMs run in (the caller casts, as autocast does). The backward is made of
    differentiable torch ops: a double backward records through it (``create_graph=True``)."""

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, *params):
        k = len(params) // 2
        weights, biases = params[:k], params[k:]
        ctx.set_materialize_grads(False)  # an output nobody used gives None: its products are skipped
        ctx.save_for_backward(x, *weights)
        ctx.biased = tuple(b is not None for b in biases)
        return sibling_linears_ref(x, weights, biases)

    @staticmethod
    @autocast_disabled
    def backward(ctx, *dys):
        x, *weights = ctx.saved_tensors
        k = len(weights)
        x2 = x.reshape(-1, x.shape[-1])
        d2 = [None if dy is None else dy.reshape(-1, dy.shape[-1]) for dy in dys]
        dx = summed_input_grad(d2, weights) if ctx.needs_input_grad[0] else None
        dws, dbs = [None] * k, [None] * k
        for i, d in enumerate(d2):
            if d is not None:
                want_b = ctx.biased[i] and ctx.needs_input_grad[1 + k + i]
                dws[i], dbs[i] = weight_and_bias_grads(d, x2, ctx.needs_input_grad[1 + i], want_b)
        return (None if dx is None else dx.view(x.shape)), *dws, *dbs


def _check(x, weights, biases) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (its last is the projections' input size)")
    if len(weights) == 0:
        raise ValueError("weights must hold at least one (N, K) weight")
    if len(biases) != len(weights):
        raise ValueError(f"biases has {len(biases)} entries; weights has {len(weights)} (one a weight, None for none)")
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"weights[{i}] must be a 2-D (N, K) tensor, got {getattr(w, 'shape', type(w).__name__)}")
        if w.shape[1] != x.shape[-1]:
            raise ValueError(f"weights[{i}] has shape {tuple(w.shape)}; x's last dimension is {x.shape[-1]}")
        if w.device != x.device:
            raise ValueError(f"weights[{i}] is on {w.device} but x is on {x.device}")
        b = biases[i]
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.shape[0],)):
            raise ValueError(f"biases[{i}] must be None or a ({w.shape[0]},) tensor, got {getattr(b, 'shape', b)!r}")
    # a DTensor's accumulating GEMMs would need each product's placements to agree: refused, on every rank
    named = {f"weights[{i}]": w for i, w in enumerate(weights)} | {f"biases[{i}]": b for i, b in enumerate(biases)}
    refuse_dtensor("sibling_linears", x=x, **named)


def sibling_linears(x: torch.Tensor, weights, biases=None) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, W_i, b_i)`` for each weight, with ``x``'s gradient summed inside the GEMMs.

    Args:
        x: (..., K). weights: a sequence of (N_i, K) tensors. biases: None, or one entry a weight
            (a (N_i,) tensor or None).

    Returns:
        A tuple of (..., N_i): bitwise :func:`truefuse.ops.gemm.siblings.sibling_linears_ref`
        (the stock calls). Weight and bias gradients are torch's linear backward's own calls (the
        stock bits); ``x``'s gradient ``Σ dy_i W_i`` is bounded against float64 with one rounding a
        product instead of autograd's two. Under ``torch.autocast`` every operand is cast as
        autocast casts ``F.linear``'s, and each gradient returns through the cast.
    """
    weights = tuple(weights)
    biases = (None,) * len(weights) if biases is None else tuple(biases)
    _check(x, weights, biases)
    return checked_sibling_linears(x, weights, biases)


def checked_sibling_linears(x: torch.Tensor, weights: tuple, biases: tuple) -> tuple[torch.Tensor, ...]:
    """:func:`sibling_linears` on arguments already checked (plain tensors of matching shapes and
    device: the Hugging Face members' call, ``integrations/huggingface/sibling_grads.py``)."""
    dtype = autocast_dtype(x.device)
    if dtype is not None:  # the casts autocast makes for F.linear, differentiable (``_autocast.py``)
        x, weights, biases = cast(x, dtype), tuple(cast(w, dtype) for w in weights), tuple(cast(b, dtype) for b in biases)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return SiblingLinears.apply(x, *weights, *biases)  # Dynamo's and torch.func's entry (the latter refuses)
    return _apply_c(x, *weights, *biases)


#: ``Function.apply`` without its Python layer in plain eager calls (as ``autograd/_eager_op.py``'s)
_apply_c = super(torch.autograd.Function, SiblingLinears).apply
