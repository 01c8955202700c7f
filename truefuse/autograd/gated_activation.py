"""``gated_activation(x, name)``: swiglu / geglu / reglu with a fused Triton forward and backward,
through the custom op ``torch.ops.truefuse.gated_activation_fwd`` (its backward registered on it)."""

from __future__ import annotations

import torch

from truefuse.ops.gated_activation import GATED_ACTIVATIONS, gated_activation_ref, gated_fwd_op, use_kernel


def gated_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """``act(gate) * up`` where ``gate, up = x.chunk(2, dim=-1)``.

    Args:
        x: (..., 2F), fp16 / bf16 / fp32 / fp64.
        name: ``swiglu`` (silu), ``geglu`` (erf gelu) or ``reglu`` (relu).

    Returns:
        (..., F) in ``x.dtype``: fp32 math, one rounding (``gated_activation_ref``, bounded contract).
    """
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"gated activation {name!r} is not supported; choose one of {tuple(GATED_ACTIVATIONS)}")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's last dimension must be even (the [gate, up] halves), got shape {tuple(x.shape)}")
    if not use_kernel(x):
        return gated_activation_ref(x, name)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = gated_fwd_op(x2, name)
    return y.view(*x.shape[:-1], x.shape[-1] // 2)
