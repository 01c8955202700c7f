"""Rotary position embedding, transformers' ``apply_rotary_pos_emb``: the reference (the stock
expression itself), the host launcher of ``kernels/rope.py`` and its custom op.

The contract is bitwise: forward and backward give the stock function's bits (the kernel follows
its roundings; docs/huggingface.md).
"""

from __future__ import annotations

import torch

from truefuse.config import get_config
from truefuse.ops._launch.custom_op import bwd_call, custom_op, register_backward
from truefuse.ops._launch.fast_launch import fast_launch
from truefuse.ops._launch.prepared import prepare
from truefuse.ops._launch.triton import kernel_for, triton_runs


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
    out = torch.empty_like(x, dtype=out_dtype)
    if out.numel() == 0:
        return out
    kernel, grid, args, kwargs = _launch_args(x, cos, sin, out, backward)
    fast_launch(kernel_for(kernel, out), grid, *args, **kwargs)
    return out


def rope_prepared(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor):
    """The forward launch :func:`rope_launch` just made into ``out`` (not empty), kept whole:
    ``go(stream, x, cos, sin, out)`` (addresses), or None (``ops/_launch/prepared.py``)."""
    kernel, grid, args, kwargs = _launch_args(x, cos, sin, out, False)
    return prepare((x, cos, sin, out), kernel, grid, *args, **kwargs)


def _launch_args(x, cos, sin, out, backward: bool) -> tuple:
    """The kernel, grid, arguments and keywords of :func:`rope_launch`."""
    from truefuse.kernels.rope import _rope_kernel

    B, H, T, D = x.shape
    half = D // 2
    block_d = max(16, 1 << (half - 1).bit_length())
    block_h = max(1, min(1 << (H - 1).bit_length(), max(1, 4096 // block_d)))
    args = (
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
    )
    kwargs = dict(
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, BACKWARD=backward, INTERPRETED=get_config().triton_interpret, num_warps=4
    )
    return _rope_kernel, (B * T,), args, kwargs


@custom_op("truefuse::rope_fwd", mutates_args=(), inline=True)
def rope_fwd_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_ref` of ``q`` and of ``k`` through the kernel (bitwise): one op for the pair, so a
    decoder layer pays one op's host time each way, not two (docs/design.md §6.7)."""
    return (
        rope_launch(q, cos, sin, torch.result_type(q, cos), backward=False),
        rope_launch(k, cos, sin, torch.result_type(k, cos), backward=False),
    )


@rope_fwd_op.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q, dtype=torch.result_type(q, cos)), torch.empty_like(k, dtype=torch.result_type(k, cos))


def _rope_bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    return rope_launch(dy, cos, sin, x_dtype, backward=True)


@custom_op("truefuse::rope_bwd", mutates_args=(), inline=True)
def rope_bwd_op(
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The gradients of ``q`` and ``k`` for the output gradients ``dq`` / ``dk``, in their dtypes, with
    autograd's roundings: one per gradient given (a custom op returns no None), in that order."""
    return [_rope_bwd(dy, cos, sin, dt) for dy, dt in ((dq, q_dtype), (dk, k_dtype)) if dy is not None]


@rope_bwd_op.register_fake
def _(dq, dk, cos, sin, q_dtype, k_dtype):
    return [torch.empty_like(dy, dtype=dt) for dy, dt in ((dq, q_dtype), (dk, k_dtype)) if dy is not None]


def _setup(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = (q.dtype, k.dtype)
    ctx.wants = (q.requires_grad, k.requires_grad)  # not needs_input_grad: the eager path's has one more input
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: its input's .grad too, as stock
    ctx.mark_non_differentiable(*(out for out, x in zip(output, (q, k), strict=True) if not x.requires_grad))


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = (g if want else None for g, want in zip((dq, dk), ctx.wants, strict=True))
    grads = iter(bwd_call(ctx, rope_bwd_op, dq, dk, cos, sin, *ctx.dtypes))
    return (None if dq is None else next(grads)), (None if dk is None else next(grads)), None, None


register_backward(
    rope_fwd_op, _backward, _setup, bwd_ops=(rope_bwd_op,), name="apply_rotary_pos_emb", ref="truefuse.ops.rope.rope_ref"
)
