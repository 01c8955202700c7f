"""Megatron's tensor-parallel "regions" as autograd Functions (docs/tensor_parallel.md).

* :func:`copy_to_tp_region`: identity forward; the gradient is allreduced in the backward (the
  input of a column-parallel layer is replicated, each rank's shard contributes a partial dx).
* :func:`reduce_from_tp_region`: allreduce forward; identity backward (every rank consumes the same
  sum, so each gets the same gradient).
* :func:`gather_from_tp_region`: all-gather of the last dimension forward; this rank's slice of the
  gradient backward.
* :func:`scatter_to_tp_region`: this rank's slice of the last dimension forward; all-gather of the
  gradient backward.

Every sum is truefuse's :func:`~truefuse.distributed.allreduce` (fp32 in rank order, rounded once,
the same bits on every rank; the Triton kernel with a symmetric-memory ``Workspace``, the all-gather
reference otherwise). The gathers move bits only (``torch.distributed.all_gather``): nothing is
summed there.

:func:`torch_region` is the same four regions as a user writes them with ``torch.distributed``
(``all_reduce`` in the tensor's dtype): the layers' ``forward_ref``, the bounded contract's
baseline, shares no code with the regions above.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.config import get_tuning
from truefuse.distributed.allreduce import allreduce
from truefuse.distributed.workspace import Workspace


def _row_width(h: int, limit: int) -> int:
    """The widest divisor of ``h`` that is at most ``limit`` (the allreduce takes rows of at most
    ``max_kernel_n`` elements; the sum is elementwise, so any row width gives the same bits)."""
    if h <= limit:
        return h
    for d in range(limit, 0, -1):
        if h % d == 0:
            return d
    return 1


def allreduce_any_width(x: torch.Tensor, group, workspace: Workspace | None) -> torch.Tensor:
    """``allreduce(x)`` for a contiguous ``x`` of any last dimension: rows wider than the
    ``max_kernel_n`` knob are viewed as several narrower rows (the same elements, the same sums)."""
    x = x.contiguous()
    if x.dim() == 0 or x.numel() == 0:
        return allreduce(x.reshape(-1, 1) if x.dim() == 0 else x, group=group, workspace=workspace).view(x.shape)
    d = _row_width(x.shape[-1], get_tuning().max_kernel_n)
    if d == x.shape[-1]:
        return allreduce(x, group=group, workspace=workspace)
    return allreduce(x.view(-1, d), group=group, workspace=workspace).view(x.shape)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, workspace):
        ctx.group, ctx.workspace = group, workspace
        return x.view_as(x)  # a new tensor object: autograd must not see the input returned as is

    @staticmethod
    def backward(ctx, dy):
        return allreduce_any_width(dy, ctx.group, ctx.workspace), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, workspace):
        with torch.no_grad():
            return allreduce_any_width(x, group, workspace)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None


def _all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x.contiguous()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _my_slice(x: torch.Tensor, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[-1] // world
    return x[..., rank * n : (rank + 1) * n].contiguous()


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _my_slice(dy, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice(x, group)

    @staticmethod
    @refuses_double_backward("distributed.scatter_to_tp_region", "torch.distributed.nn.functional.all_gather")
    def backward(ctx, dy):  # torch.distributed.all_gather is not differentiable
        return _all_gather_last(dy, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group=None, workspace: Workspace | None = None) -> torch.Tensor:
    """Identity forward; backward: ``allreduce`` of the gradient over ``group`` (None: the default
    group). ``x``: any shape, bf16 / fp16 / fp32, the same shape on every rank."""
    return _CopyToTP.apply(x, group if group is not None else dist.group.WORLD, workspace)


def reduce_from_tp_region(x: torch.Tensor, group=None, workspace: Workspace | None = None) -> torch.Tensor:
    """Forward: ``allreduce(x)`` over ``group`` (bitwise the same on every rank); backward: identity.
    ``x``: any shape, bf16 / fp16 / fp32, the same shape on every rank."""
    return _ReduceFromTP.apply(x, group if group is not None else dist.group.WORLD, workspace)


def gather_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: the ranks' ``x`` (..., n) concatenated in rank order along the last dimension,
    (..., world·n); backward: this rank's n columns of the gradient."""
    return _GatherFromTP.apply(x, group if group is not None else dist.group.WORLD)


def scatter_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: this rank's contiguous 1/world of ``x``'s last dimension; backward: the ranks'
    gradients concatenated in rank order (an all-gather)."""
    return _ScatterToTP.apply(x, group if group is not None else dist.group.WORLD)


class _TorchRegion(torch.autograd.Function):
    """The regions in plain ``torch.distributed`` (``all_reduce`` sums in the tensor's dtype)."""

    @staticmethod
    def _reduce(t, group):
        t = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def _gather(t, group):
        parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def _split(t, group):
        return t.tensor_split(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def forward(ctx, x, kind, group):
        ctx.kind, ctx.group = kind, group
        f = {
            "copy": lambda t, g: t.clone(),
            "reduce": _TorchRegion._reduce,
            "gather": _TorchRegion._gather,
            "scatter": _TorchRegion._split,
        }[kind]
        return f(x, group)

    @staticmethod
    def backward(ctx, dy):
        b = {
            "copy": _TorchRegion._reduce,
            "reduce": lambda t, g: t,
            "gather": _TorchRegion._split,
            "scatter": _TorchRegion._gather,
        }[ctx.kind]
        return b(dy, ctx.group), None, None


def torch_region(x: torch.Tensor, kind: str, group=None) -> torch.Tensor:
    """``kind`` in ``copy``, ``reduce``, ``gather``, ``scatter``: the region of that name (the
    functions above) written with ``torch.distributed`` alone, the way a user without truefuse does."""
    return _TorchRegion.apply(x, kind, group if group is not None else dist.group.WORLD)
