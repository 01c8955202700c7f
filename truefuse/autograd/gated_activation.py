"""``gated_activation(x, name)``: swiglu / geglu / reglu with a fused Triton forward and backward,
through the custom op ``torch.ops.truefuse.gated_activation_fwd`` (its backward registered on it)."""

from __future__ import annotations

import torch

from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.autograd._eager_op import call
from truefuse.ops._launch.dtensor import on_local_rows
from truefuse.ops._launch.prepared import ToKeep
from truefuse.ops.gated_activation.gated_activation import (
    GATED_ACTIVATIONS,
    gated2_fwd_op,
    gated_activation_ref,
    gated_fwd_op,
    use_kernel,
)
from truefuse.ops.gated_activation.gated_kept import keep, kept_gated, kept_grads, launch


def gated_activation(x: torch.Tensor, name: str, up: torch.Tensor | None = None) -> torch.Tensor:
    """``act(gate) * up`` where ``gate, up = x.chunk(2, dim=-1)``, or ``act(x) * up`` with ``up`` given.

    Args:
        x: (..., 2F), fp16 / bf16 / fp32 / fp64; or, with ``up``, the (..., F) gate.
        name: ``swiglu`` (silu), ``geglu`` (erf gelu), ``geglu_tanh`` (tanh gelu) or ``reglu`` (relu).
        up: (..., F) like ``x``, or None. Two tensors (a Hugging Face MLP's two projections) save
            the (..., 2F) concatenation's copy; the backward returns a gradient to each.

    Returns:
        (..., F) in ``x.dtype``: fp32 math, one rounding (``gated_activation_ref``, bounded contract).
    """
    # a repeated call (decode, a training step): one kept launch each way (ops/gated_activation/gated_kept.py)
    kept = None if up is None else kept_gated(x, up, name, recording=True)
    if kept is not None and type(kept) is not ToKeep:
        if torch.is_grad_enabled() and (x.requires_grad or up.requires_grad):
            return _apply_kept(x, up, kept, name)
        y = launch(kept[0], x, up)
        if y is not None:
            return y
        kept = None
    rows = {"x": x} if up is None else {"x": x, "up": up}
    width = (x.shape[-1] if up is not None else x.shape[-1] // 2) if isinstance(x, torch.Tensor) and x.dim() else None
    y = on_local_rows("gated_activation", lambda *t: gated_activation(t[0], name, *t[1:]), rows, {}, width)
    if y is not None:
        return y
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"gated activation {name!r} is not supported; choose one of {tuple(GATED_ACTIVATIONS)}")
    if up is not None:
        return _gated_two(x, up, name, kept)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's last dimension must be even (the [gate, up] halves), got shape {tuple(x.shape)}")
    if not use_kernel(x):
        return gated_activation_ref(x, name)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = call(gated_fwd_op, x2, name)
    return y.view(*x.shape[:-1], x.shape[-1] // 2)


def _gated_two(gate: torch.Tensor, up: torch.Tensor, name: str, pending: ToKeep | None = None) -> torch.Tensor:
    """``pending``: ``kept_gated``'s, to keep this call's launch under (no graph recorded)."""
    if not isinstance(up, torch.Tensor) or up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        got = (tuple(up.shape), up.dtype, up.device) if isinstance(up, torch.Tensor) else type(up).__name__
        raise ValueError(
            f"up must be a tensor of gate's shape, dtype and device {(tuple(gate.shape), gate.dtype, gate.device)}, got {got}"
        )
    if gate.dim() == 0:
        raise ValueError("gate must have at least one dimension")
    if not use_kernel(gate):
        return gated_activation_ref(torch.cat([gate, up], -1), name)
    g = gate if gate.stride(-1) == 1 else gate.contiguous()
    u = up if up.stride(-1) == 1 else up.contiguous()
    y = call(gated2_fwd_op, g, u, name)  # flattened to rows inside: no view nodes in the graph
    if pending is not None:
        keep(pending, gate, up, g, u, y, name)
    return y


class _KeptGated(torch.autograd.Function):
    """The two-tensor form where its launches are kept (``ops/gated_activation/gated_kept.py``): the
    kept forward launch, and the backward's kept launch or ``gated2_bwd_op``'s body, in a Function
    of its own rather than the custom op's registered autograd (``autograd/_eager_op.py``), whose
    checks, wrappers and ``fast_launch`` keys were ~80 of a 123 µs forward + backward on the CPU
    box (launches stubbed). The same kernels and arguments: the same bits."""

    @staticmethod
    def forward(ctx, gate, up, kept, name):
        go, ctx.key = kept  # the forward's key: the backward's is the incoming gradient's layout and it
        y = launch(go, gate, up)
        if y is None:  # an output not aligned as the kept launch's: the op's own launch
            y = gated2_fwd_op.body(gate, up, name)
        ctx.save_for_backward(gate, up)
        ctx.name = name
        return y

    @staticmethod
    @refuses_double_backward("gated_activation", "truefuse.ops.gated_activation.gated_activation.gated_activation_ref")
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = kept_grads(dy, gate, up, ctx.name, ctx.key)
        return dg, du, None, None


#: ``Function.apply`` without its Python layer (as ``autograd/_eager_op.py``'s: one ``forward``)
_apply_kept = super(torch.autograd.Function, _KeptGated).apply
