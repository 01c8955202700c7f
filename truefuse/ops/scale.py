"""``scale_``: ``tensor *= factor`` for a 0-dim device factor, with no pass when it is 1 and no host sync."""

from __future__ import annotations

import torch

from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.triton import sm_count, triton_runs


def scale_ref(tensor: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``tensor * factor`` out of place, as PyTorch computes it (fp32 math for a 0-dim fp32 factor,
    one rounding to ``tensor.dtype``): what :func:`scale_` must equal bit for bit."""
    return tensor.clone().mul_(factor)


def scale_(tensor: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Multiply the contiguous ``tensor`` in place by the 0-dim fp32 ``factor``; returns ``tensor``.

    On CUDA (and for fp32 under the CPU interpreter) a Triton kernel reads the factor on the device
    and touches nothing when it is exactly 1 (``kernels/scale.py``); the result is bitwise
    ``tensor.mul_(factor)``. Elsewhere, or for another factor dtype, it is ``tensor.mul_(factor)``.
    The launch is the custom op ``truefuse::scale_`` (mutates ``tensor``; docs/design.md §6.7).
    """
    refuse_dtensor("ops.scale_", tensor=tensor, factor=factor)
    launch(scale_op, tensor, factor)
    return tensor


@custom_op("truefuse::scale_", mutates_args=("tensor",))
def scale_op(tensor: torch.Tensor, factor: torch.Tensor) -> None:
    """:func:`scale_` as an op: ``tensor *= factor`` in place, returning nothing (an op's output
    may not alias its input)."""
    if tensor.numel() == 0:
        return
    if not (triton_runs(tensor) and tensor.is_contiguous() and factor.dtype == torch.float32 and factor.numel() == 1):
        tensor.mul_(factor)
        return
    from truefuse.kernels.scale import _scale_inplace_kernel

    block = 4096 if tensor.is_cuda else 64
    programs = 4 * sm_count(tensor.device.index or 0) if tensor.is_cuda else 4
    grid = (max(1, min(programs, -(-tensor.numel() // block))),)
    warps = 8 if tensor.is_cuda else 1
    _scale_inplace_kernel[grid](tensor, tensor.numel(), factor.to(tensor.device), BLOCK=block, num_warps=warps)


@scale_op.register_fake
def _(tensor, factor):
    return None
