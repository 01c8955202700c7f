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
from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.autograd._modes import Modes
from truefuse.autograd._wgrad import WgradState, deliver_weight_grad
from truefuse.autograd.linear import _checked_product, _wgrad_compute, linear
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.triton import PLAIN_TENSORS
from truefuse.ops.gemm.bias_grad import split_bias_grad
from truefuse.ops.gemm.gemm_kept import kept_product
from truefuse.ops.gemm.siblings import sibling_linears_ref, summed_input_grad, summed_input_grad_bi, weight_and_bias_grads

#: the batch-invariant group's weight gradients: the plain configuration (autograd's ``.grad``), as
#: the routed ``F.linear``'s (``integrations/huggingface/batch_invariant.py``)
_BI_PLAIN = WgradState(owner="sibling_linears (batch-invariant)")


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


class BatchInvariantSiblingLinears(torch.autograd.Function):
    """Batch-invariant mode's group (``apply_truefuse(model, batch_invariant=True,
    fuse_sibling_grads=True)``): each output and each weight and bias gradient is what the routed
    ``F.linear`` computes for that projection alone (``autograd/linear.py::_PlainLinearFunction``:
    the batch-invariant GEMM forward, the plain weight-gradient GEMM, the split bias sum), the same
    bits; ``x``'s gradient is ``summed_input_grad_bi`` (accumulating batch-invariant GEMMs, where
    autograd adds the separate products in bf16), so each row's bits stay its own. Arguments as
    :class:`SiblingLinears`'s, x, weights and biases of one dtype (nothing for autocast to cast).
    Its backward is not differentiable: a double backward is refused, as the routed Linear's."""

    @staticmethod
    def forward(ctx, x, *params):
        k = len(params) // 2
        weights, biases = params[:k], params[k:]
        ctx.set_materialize_grads(False)
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, *weights)
        ctx.x_shape = x.shape
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in biases)
        lead = x.shape[:-1]
        return tuple(kept_product(x2, w.t(), b, True).view(*lead, w.shape[0]) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    @autocast_disabled  # as the routed Linear's: the weight-gradient GEMM not autocast
    @refuses_double_backward("sibling_linears in batch-invariant mode", "truefuse.sibling_linears_ref")
    def backward(ctx, *dys):
        x2, *weights = ctx.saved_tensors
        k = len(weights)
        d2 = [None if dy is None else dy.reshape(-1, dy.shape[-1]) for dy in dys]
        dx = summed_input_grad_bi(d2, weights) if ctx.needs_input_grad[0] else None
        dws, dbs = [None] * k, [None] * k
        for i, d in enumerate(d2):
            if d is None:
                continue
            if ctx.bias_dtypes[i] is not None and ctx.needs_input_grad[1 + k + i]:
                dbs[i] = split_bias_grad(d, ctx.bias_dtypes[i])
            if ctx.needs_input_grad[1 + i]:
                compute = _wgrad_compute(d, x2, weights[i], _checked_product)
                dws[i] = deliver_weight_grad(weights[i], "weight", compute, _BI_PLAIN)
        return (None if dx is None else dx.view(ctx.x_shape)), *dws, *dbs


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
        autocast casts ``F.linear``'s, and each gradient returns through the cast. In
        batch-invariant mode (``truefuse.batch_invariant()``) each output and each weight and bias
        gradient is a batch-invariant model's ``F.linear``'s, and every row of ``x``'s gradient
        keeps its bits at any number of rows (:class:`BatchInvariantSiblingLinears`).
    """
    weights = tuple(weights)
    biases = (None,) * len(weights) if biases is None else tuple(biases)
    _check(x, weights, biases)
    return checked_sibling_linears(x, weights, biases, Modes.now().batch_invariant)


def checked_sibling_linears(x: torch.Tensor, weights: tuple, biases: tuple, bi: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`sibling_linears` on arguments already checked (matching shapes and device: the Hugging
    Face members' call, ``integrations/huggingface/sibling_grads.py``), in batch-invariant mode if
    ``bi`` (the caller read the mode): :class:`BatchInvariantSiblingLinears`, or where it cannot
    run each projection through the routed Linear."""
    dtype = autocast_dtype(x.device)
    if bi:
        if _bi_fusable(x, weights, biases, dtype):
            return _apply_bi(x, *weights, *biases)
        # traced, cast by autocast or of mixed dtypes: each projection the routed Linear (its
        # batch-invariant GEMMs; autograd sums x's gradient), as a batch-invariant model's F.linear
        return tuple(linear(x, w, b, state=_BI_PLAIN) for w, b in zip(weights, biases, strict=True))
    if dtype is not None:  # the casts autocast makes for F.linear, differentiable (``_autocast.py``)
        x, weights, biases = cast(x, dtype), tuple(cast(w, dtype) for w in weights), tuple(cast(b, dtype) for b in biases)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return SiblingLinears.apply(x, *weights, *biases)  # Dynamo's and torch.func's entry (the latter refuses)
    return _apply_c(x, *weights, *biases)


def _bi_fusable(x, weights, biases, cast_to) -> bool:
    """Whether :class:`BatchInvariantSiblingLinears` computes a batch-invariant call: eager, plain
    tensors of one dtype that autocast does not cast."""
    dt = x.dtype
    if cast_to is not None and cast_to is not dt:
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if type(x) not in PLAIN_TENSORS or any(type(w) not in PLAIN_TENSORS or w.dtype is not dt for w in weights):
        return False
    return all(b is None or (type(b) in PLAIN_TENSORS and b.dtype is dt) for b in biases)


#: ``Function.apply`` without its Python layer in plain eager calls (as ``autograd/_eager_op.py``'s)
_apply_c = super(torch.autograd.Function, SiblingLinears).apply
_apply_bi = super(torch.autograd.Function, BatchInvariantSiblingLinears).apply


def checked_bi_sibling_linears(x: torch.Tensor, weights: tuple, biases: tuple) -> tuple[torch.Tensor, ...]:
    """:class:`BatchInvariantSiblingLinears` on arguments whose caller checked what it asks (eager,
    plain tensors of one dtype that autocast does not cast: the Hugging Face members' call)."""
    return _apply_bi(x, *weights, *biases)
