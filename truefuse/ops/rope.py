"""Rotary position embedding, transformers' ``apply_rotary_pos_emb``: the reference (the stock
expression itself), the host launcher of ``kernels/rope.py`` and its custom op.

The contract is bitwise: forward and backward give the stock function's bits (the kernel follows
its roundings; docs/huggingface.md).
"""

from __future__ import annotations

import torch

from truefuse.config import get_config
from truefuse.ops._custom_op import bwd_call, custom_op, register_backward
from truefuse.ops._triton import triton_runs


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' expression).

    Args:
        x: (B, H, T, D), any strides. cos, sin: (B, T, D), broadcast over the heads
            (``unsqueeze_dim``: where the heads' dimension goes into cos and sin, as transformers').
    """
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (x * c) + (_rotate_half(x) * s)


def use_kernel(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return triton_runs(x) and cos.device == x.device and x.shape[-1] % 2 == 0


def rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, backward: bool) -> torch.Tensor:
    """The kernel on (B, H, T, D) ``x`` (last dimension contiguous) and (B, T, D) ``cos``/``sin``
    of one layout; returns a tensor of x's strides (as torch's elementwise ops give) in ``out_dtype``."""
    from truefuse.kernels.rope import _rope_kernel

    B, H, T, D = x.shape
    out = torch.empty_like(x, dtype=out_dtype)
    if out.numel() == 0:
        return out
    half = D // 2
    block_d = max(16, 1 << (half - 1).bit_length())
    block_h = max(1, min(1 << (H - 1).bit_length(), max(1, 4096 // block_d)))
    _rope_kernel[(B * T,)](
        x,
        cos,
        sin,
        out,
        T,
        H,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        cos.stride(0),
        cos.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BACKWARD=backward,
        INTERPRETED=get_config().triton_interpret,
        num_warps=4,
    )
    return out


@custom_op("truefuse::rope_fwd", mutates_args=())
def rope_fwd_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rope_ref` through the kernel (bitwise)."""
    return rope_launch(x, cos, sin, torch.result_type(x, cos), backward=False)


@rope_fwd_op.register_fake
def _(x, cos, sin):
    return torch.empty_like(x, dtype=torch.result_type(x, cos))


@custom_op("truefuse::rope_bwd", mutates_args=())
def rope_bwd_op(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """The gradient of ``x`` for the output gradient ``dy``, in x's dtype, with autograd's roundings."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    return rope_launch(dy, cos, sin, x_dtype, backward=True)


@rope_bwd_op.register_fake
def _(dy, cos, sin, x_dtype):
    return torch.empty_like(dy, dtype=x_dtype)


def _setup(ctx, inputs, output):
    x, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.x_dtype = x.dtype


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return bwd_call(ctx, rope_bwd_op, dy, cos, sin, ctx.x_dtype), None, None


register_backward(
    rope_fwd_op, _backward, _setup, bwd_ops=(rope_bwd_op,), name="apply_rotary_pos_emb", ref="truefuse.ops.rope.rope_ref"
)
