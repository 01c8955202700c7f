"""Gated activations ``act(gate) * up`` on (M, 2F) inputs split in halves ``[gate, up]``.

``gated_activation_ref`` is truefuse's rule in plain PyTorch (fp32 math, one rounding of the
output), the CPU path and, on float64, the reference. ``gated_activation_torch`` is what a user
writes without us (``F.silu(gate) * up`` in the input dtype: two roundings), the bounded baseline.
"""

from __future__ import annotations

import torch

from truefuse.ops._dtypes import wide_dtype
from truefuse.ops._triton import triton_runs
from truefuse.ops.activation import activation_ref

#: Gated activation name -> the activation applied to the gate half.
GATED_ACTIVATIONS: dict[str, str] = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.chunk(2, dim=-1)


def gated_activation_ref(x: torch.Tensor, name: str) -> torch.Tensor:
    """``act(gate) * up`` with ``gate, up = x.chunk(2, -1)``, computed in fp32 and rounded once.

    Args:
        x: (..., 2F) float tensor.
        name: ``swiglu`` (silu), ``geglu`` (erf gelu) or ``reglu`` (relu).

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


def gated_fwd(x: torch.Tensor, name: str) -> torch.Tensor:
    """Forward kernel on a contiguous ``x``: (M, 2F) for a gated ``name``, (M, F) for a plain
    activation; returns (M, F) in ``x.dtype``."""
    from truefuse.kernels.activation import ACT_CODES
    from truefuse.kernels.gated_activation import _gated_activation_fwd_kernel

    act, gated = _act(name)
    M, F = x.shape[0], x.shape[1] // (2 if gated else 1)
    y = torch.empty((M, F), dtype=x.dtype, device=x.device)
    if M and F:
        grid, block = _launch_shape(M, F)
        _gated_activation_fwd_kernel[grid](x, y, x.stride(0), y.stride(0), F, ACT=ACT_CODES[act], GATED=gated, BLOCK=block)
    return y


def gated_bwd(dy: torch.Tensor, x: torch.Tensor, name: str, *, recompute: bool = False):
    """Backward kernel: ``dy`` (M, F) and ``x`` (M, 2F) or (M, F), contiguous.

    Returns d``x`` shaped like ``x``; with ``recompute`` returns ``(dx, y)`` where ``y`` is the
    forward's output written again by the same pass (bitwise what :func:`gated_fwd` gives).
    """
    from truefuse.kernels.activation import ACT_CODES
    from truefuse.kernels.gated_activation import _gated_activation_bwd_kernel

    act, gated = _act(name)
    M, F = dy.shape
    dx = torch.empty_like(x)
    y = torch.empty_like(dy) if recompute else None
    if M and F:
        grid, block = _launch_shape(M, F)
        _gated_activation_bwd_kernel[grid](
            dy, x, dx, y if recompute else dx, dy.stride(0), x.stride(0), dx.stride(0), y.stride(0) if recompute else 0, F,
            ACT=ACT_CODES[act], GATED=gated, STORE_ACT=recompute, BLOCK=block,
        )  # fmt: skip
    return (dx, y) if recompute else dx


# ---------------------------------------------------------------------------------------------
# torch.library custom ops (docs/design.md §6.7), with fake implementations and the backward on the op.


@torch.library.custom_op("truefuse::gated_activation_fwd", mutates_args=())
def gated_fwd_op(x: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`gated_fwd` as an op: contiguous (M, 2F) or (M, F) -> (M, F)."""
    return gated_fwd(x, name)


@gated_fwd_op.register_fake
def _(x, name):
    F = x.shape[1] // (2 if name in GATED_ACTIVATIONS else 1)
    return x.new_empty((x.shape[0], F))


@torch.library.custom_op("truefuse::gated_activation_bwd", mutates_args=())
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
    return gated_bwd_op(dy, x, ctx.name), None


gated_fwd_op.register_autograd(_gated_backward, setup_context=_gated_setup)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("truefuse gated activations do not support double backward")


# registered so that tracing a backward graph (torch.compile, AOT) accepts the op; never run
gated_bwd_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)
