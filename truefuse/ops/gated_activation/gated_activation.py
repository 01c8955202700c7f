"""Gated activations ``act(gate) * up`` on (M, 2F) inputs split in halves ``[gate, up]``.

``gated_activation_ref`` is truefuse's rule in plain PyTorch (fp32 math, one rounding of the
output), the CPU path and, on float64, the reference. ``gated_activation_torch`` is what a user
writes without us (``F.silu(gate) * up`` in the input dtype: two roundings), the bounded baseline.
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.custom_op import bwd_call, custom_op, register_backward
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops._launch.fast_launch import fast_launch
from truefuse.ops._launch.prepared import prepare
from truefuse.ops._launch.triton import kernel_for, triton_runs
from truefuse.ops.gemm.activation import activation_ref

#: Gated activation name -> the activation applied to the gate half.
GATED_ACTIVATIONS: dict[str, str] = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "reglu": "relu"}


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.chunk(2, dim=-1)


def gated_activation_ref(x: torch.Tensor, name: str) -> torch.Tensor:
    """``act(gate) * up`` with ``gate, up = x.chunk(2, -1)``, computed in fp32 and rounded once.

    Args:
        x: (..., 2F) float tensor.
        name: ``swiglu`` (silu), ``geglu`` (erf gelu), ``geglu_tanh`` (tanh-approximated gelu, Gemma's) or ``reglu`` (relu).

    Returns:
        (..., F) in ``x.dtype``.
    """
    g, u = _halves(x.to(wide_dtype(x)))
    return (activation_ref(g, GATED_ACTIVATIONS[name]) * u).to(x.dtype)


def gated_activation_torch(x: torch.Tensor, name: str) -> torch.Tensor:
    """The same in ``x``'s dtype as eager PyTorch rounds it (the bounded baseline)."""
    g, u = _halves(x)
    return activation_ref(g, GATED_ACTIVATIONS[name]) * u


def use_kernel(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take ``x`` (else the reference runs under autograd)."""
    return triton_runs(x)


def _launch_shape(M: int, F: int) -> tuple[tuple[int, int], int]:
    block = min(1024, max(16, 1 << (F - 1).bit_length()))
    return (M, -(-F // block)), block


def _act(name: str) -> tuple[str, bool]:
    """(the pointwise activation, gated?) of an MLP activation name."""
    return (GATED_ACTIVATIONS[name], True) if name in GATED_ACTIVATIONS else (name, False)


def _gate_up(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gate and up views of a contiguous (M, 2F) gated ``x`` (up None for a plain activation)."""
    if not _act(name)[1]:
        return x, None
    F = x.shape[1] // 2
    return x[:, :F], x[:, F:]


def gated_fwd(x: torch.Tensor, name: str, up: torch.Tensor | None = None) -> torch.Tensor:
    """Forward kernel. ``x``: a contiguous (M, 2F) ``[gate, up]`` for a gated ``name`` (or, with
    ``up`` given, the (M, F) gate, rows strided), (M, F) for a plain activation; returns (M, F) in
    the gate's dtype."""
    g, u = (x, up) if up is not None else _gate_up(x, name)
    M, F = g.shape
    y = torch.empty((M, F), dtype=g.dtype, device=g.device)
    if M and F:
        kernel, grid, args, kwargs = _fwd_launch(g, u, y, name)
        fast_launch(kernel_for(kernel, y), grid, *args, **kwargs)
    return y


def _fwd_launch(g: torch.Tensor, u: torch.Tensor | None, y: torch.Tensor, name: str) -> tuple:
    """The forward kernel, grid, arguments and keywords of :func:`gated_fwd` (and :func:`fwd_prepared`)."""
    from truefuse.kernels.activation import ACT_CODES
    from truefuse.kernels.gated_activation import _gated_activation_fwd_kernel

    act, gated = _act(name)
    M, F = g.shape
    grid, block = _launch_shape(M, F)
    u_ = u if gated else g
    args = (g, u_, y, g.stride(0), u_.stride(0), y.stride(0), F)
    return _gated_activation_fwd_kernel, grid, args, dict(ACT=ACT_CODES[act], GATED=gated, BLOCK=block)


def fwd_prepared(gate: torch.Tensor, up: torch.Tensor, y: torch.Tensor, name: str):
    """The launch :func:`gated_fwd` just made for (M, F) ``gate`` and ``up`` into ``y`` (M, F not 0;
    the rows ``gated2_fwd_op`` flattened), kept whole: ``go(stream, gate, up, y)`` (addresses), or
    None (``ops/_launch/prepared.py``)."""
    kernel, grid, args, kwargs = _fwd_launch(gate, up, y, name)
    return prepare((gate, up, y), kernel, grid, *args, **kwargs)


def gated_bwd(dy: torch.Tensor, x: torch.Tensor, name: str, *, recompute: bool = False, up: torch.Tensor | None = None):
    """Backward kernel: ``dy`` (M, F) contiguous; ``x`` and ``up`` as in :func:`gated_fwd`.

    Returns d``x`` shaped like ``x`` (with ``up``: the pair ``(dgate, dup)``); with ``recompute``
    also the forward's output written again by the same pass (bitwise what :func:`gated_fwd`
    gives), as ``(dx, y)``.
    """
    act, gated = _act(name)
    M, F = dy.shape
    if up is not None:
        g, u = x, up
        dg, du = torch.empty((M, F), dtype=g.dtype, device=g.device), torch.empty((M, F), dtype=u.dtype, device=u.device)
        dx = (dg, du)
    else:
        g, u = _gate_up(x, name)
        dx = torch.empty_like(x)
        dg, du = _gate_up(dx, name)
    u = u if gated else g
    du = du if gated else dg
    y = torch.empty_like(dy) if recompute else None
    if M and F:
        kernel, grid, args, kwargs = _bwd_launch(dy, g, u, dg, du, y if recompute else dg, name, recompute)
        fast_launch(kernel_for(kernel, dg), grid, *args, **kwargs)
    return (dx, y) if recompute else dx


def _bwd_launch(dy, g, u, dg, du, a, name: str, recompute: bool) -> tuple:
    """The backward kernel, grid, arguments and keywords of :func:`gated_bwd` (and
    :func:`bwd_prepared`): ``u``/``du`` the gate's own for a plain activation, ``a`` the output
    written again (``recompute``) or ``dg`` (not written)."""
    from truefuse.kernels.activation import ACT_CODES
    from truefuse.kernels.gated_activation import _gated_activation_bwd_kernel

    act, gated = _act(name)
    M, F = dy.shape
    grid, block = _launch_shape(M, F)
    args = (dy, g, u, dg, du, a, dy.stride(0), g.stride(0), u.stride(0), dg.stride(0), du.stride(0), a.stride(0), F)
    return _gated_activation_bwd_kernel, grid, args, dict(ACT=ACT_CODES[act], GATED=gated, STORE_ACT=recompute, BLOCK=block)


def bwd_prepared(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dg: torch.Tensor, du: torch.Tensor, name: str):
    """The launch :func:`gated_bwd` just made for (M, F) ``dy``, ``gate`` and ``up`` into ``dg`` and
    ``du`` (M, F not 0; the rows ``gated2_bwd_op`` flattened), kept whole:
    ``go(stream, dy, gate, up, dg, du)`` (addresses), or None (``ops/_launch/prepared.py``)."""
    kernel, grid, args, kwargs = _bwd_launch(dy, gate, up, dg, du, dg, name, False)
    return prepare((dy, gate, up, dg, du), kernel, grid, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# torch.library custom ops (docs/design.md §6.7), with fake implementations and the backward on the op.


@custom_op("truefuse::gated_activation_fwd", mutates_args=(), inline=True)
def gated_fwd_op(x: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`gated_fwd` as an op: contiguous (M, 2F) or (M, F) -> (M, F)."""
    return gated_fwd(x, name)


@gated_fwd_op.register_fake
def _(x, name):
    F = x.shape[1] // (2 if name in GATED_ACTIVATIONS else 1)
    return x.new_empty((x.shape[0], F))


@custom_op("truefuse::gated_activation_bwd", mutates_args=(), inline=True)
def gated_bwd_op(dy: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`gated_bwd` as an op: returns the gradient of ``x``."""
    return gated_bwd(dy.contiguous(), x, name)


@gated_bwd_op.register_fake
def _(dy, x, name):
    return torch.empty_like(x)


def _gated_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.name = inputs[1]


def _gated_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return bwd_call(ctx, gated_bwd_op, dy, x, ctx.name), None


_REFUSAL = {
    "name": "gated_activation",
    "ref": "truefuse.ops.gated_activation.gated_activation.gated_activation_ref",
}  # double backward
register_backward(gated_fwd_op, _gated_backward, _gated_setup, bwd_ops=(gated_bwd_op,), **_REFUSAL)


# Two-tensor form (a separate gate and up, as a Hugging Face MLP's two projections give them: no
# concatenation copy): the same kernels with two row-strided inputs.


@custom_op("truefuse::gated_activation2_fwd", mutates_args=(), inline=True)
def gated2_fwd_op(gate: torch.Tensor, up: torch.Tensor, name: str) -> torch.Tensor:
    """``act(gate) * up`` for (..., F) ``gate`` and ``up`` of one shape whose last dimension is
    contiguous. Flattened to rows here, inside the op: a reshape outside it, and the view back,
    were three autograd nodes a forward + backward (~50 µs of an H100 host's ~200;
    docs/benchmarks.md, "Eager host time per op")."""
    F = gate.shape[-1]
    return gated_fwd(gate.reshape(-1, F), name, up.reshape(-1, F)).view(gate.shape)


@gated2_fwd_op.register_fake
def _(gate, up, name):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@custom_op("truefuse::gated_activation2_bwd", mutates_args=(), inline=True)
def gated2_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of (..., F) ``gate`` and ``up`` (rows flattened inside, as the forward's)."""
    F = gate.shape[-1]
    dg, du = gated_bwd(dy.reshape(-1, F).contiguous(), gate.reshape(-1, F), name, up=up.reshape(-1, F))
    return dg.view(gate.shape), du.view(up.shape)


@gated2_bwd_op.register_fake
def _(dy, gate, up, name):
    return torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(
        up, memory_format=torch.contiguous_format
    )


def _gated2_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.name = inputs[2]


def _gated2_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = bwd_call(ctx, gated2_bwd_op, dy, gate, up, ctx.name)
    return dg, du, None


register_backward(gated2_fwd_op, _gated2_backward, _gated2_setup, bwd_ops=(gated2_bwd_op,), **_REFUSAL)
