"""``allreduce`` and ``allreduce_add_rmsnorm``: validation agreed by every rank, the reference
composition, and the autograd Function.

The contract (docs/design.md §1, §4): the allreduce is an fp32 sum in rank order 0..N-1 rounded once to the
input dtype, bitwise identical on every rank; ``residual_out = allreduce(x) + residual`` as PyTorch
adds in the input dtype; ``normed = truefuse.rms_norm(residual_out, weight, eps)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.autograd.norm import rms_norm
from truefuse.config import get_tuning
from truefuse.distributed._agree import agree, validating
from truefuse.distributed.workspace import Workspace
from truefuse.ops._launch.custom_op import launch
from truefuse.ops.allreduce import allreduce_add_rmsnorm_fwd
from truefuse.ops.norm.norm import norm_bwd_op, norm_fwd_op, use_kernel

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what truefuse.rms_norm takes


def _group(group):
    if not dist.is_initialized():
        raise RuntimeError("allreduce needs an initialised process group (torch.distributed.init_process_group)")
    return group if group is not None else dist.group.WORLD


def _local_problem(x, residual, weight, workspace, eps=None) -> str | None:
    """What is wrong with this rank's arguments (None when nothing is)."""
    if not isinstance(x, torch.Tensor):
        return f"x must be a torch.Tensor, got {type(x).__name__}"
    if x.dtype not in _DTYPES:
        return f"x has dtype {x.dtype}; allreduce takes bfloat16, float16 or float32"
    max_n = get_tuning().max_kernel_n  # the norm kernels' limit (a row lives in registers)
    if x.dim() < 1 or x.shape[-1] > max_n:
        return f"x has shape {tuple(x.shape)}: it needs a last (hidden) dimension of at most {max_n}"
    if not x.is_contiguous():
        return "x is not contiguous"
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape or residual.dtype != x.dtype:
            got = (tuple(residual.shape), residual.dtype) if isinstance(residual, torch.Tensor) else type(residual).__name__
            return f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {got}"
        if residual.device != x.device or not residual.is_contiguous():
            return "residual must be contiguous and on x's device"
    if weight is not None and (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (x.shape[-1],)):
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        return f"weight must have shape ({x.shape[-1]},), got {got}"
    if weight is not None and (weight.dtype not in _WEIGHT_DTYPES or weight.device != x.device):
        return f"weight must be a float tensor on x's device ({x.device}), got {weight.dtype} on {weight.device}"
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0):
        return f"eps must be a non-negative number, got {eps!r}"
    if workspace is not None:
        if workspace.closed:
            return "the workspace is closed"
        nbytes = x.numel() * x.element_size()
        if nbytes > workspace.max_bytes:
            return f"x is {nbytes} bytes but the workspace holds {workspace.max_bytes} (Workspace(max_bytes=...))"
    return None


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The allreduce's arithmetic: an fp32 sum of ``parts`` (one per rank) in rank order, rounded
    once to their dtype. ``parts`` are not modified (the sum starts from a copy, also for fp32)."""
    acc = parts[0].to(torch.float32, copy=True)
    for p in parts[1:]:
        acc += p.float()
    return acc.to(parts[0].dtype)


def allreduce_ref(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """All-gather, then an fp32 sum in rank order 0..N-1, then one rounding to ``x.dtype``.

    Args:
        x: any shape, bf16 / fp16 / fp32, the same shape and dtype on every rank. Not modified.
    """
    group = _group(group)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return ordered_sum(parts)


def allreduce_add_rmsnorm_ref(x, residual, weight, eps: float = 1e-6, *, group=None):
    """``(rms_norm(allreduce_ref(x) + residual, weight, eps), allreduce_ref(x) + residual)``."""
    residual_out = allreduce_ref(x, group=group) + residual
    return rms_norm(residual_out, weight, eps), residual_out


def _kernel_path(x, workspace: Workspace | None, group) -> bool:
    if workspace is None or workspace.symmetric is None or not x.is_cuda:
        return False
    if workspace.group != group:
        raise ValueError("the workspace belongs to another process group than group=")
    return True


def _check(group, x, residual, weight, workspace, eps=None) -> None:
    """Every rank checks its arguments and learns the others' verdicts and groups (``_agree.py``),
    so bad input is the same clear ``ValueError`` on every rank instead of a hang in the collective;
    local checks only under CUDA-graph capture or ``Workspace(validate=False)``."""
    problem = _local_problem(x, residual, weight, workspace, eps)
    desc = None if problem is not None else (("the input's shape or dtype", f"{tuple(x.shape)} {x.dtype} on {x.device.type}"),)
    agree(group, "allreduce", None if problem is None else ("ValueError", problem), desc, validating(x, workspace))


class FusedAllreduceAddRMSNorm(torch.autograd.Function):
    """``(normed, residual_out)``: on a workspace's symmetric memory the fused kernel, else the
    reference allreduce, the add and the norm's own forward op (``torch.ops.truefuse.norm_fwd``).
    Either way each row's fp32 rstd is saved when a gradient is wanted: the kernel writes it (the
    same ``rms_norm_row``, BLOCK_N and num_warps as ``truefuse.rms_norm``: the same bits), or the
    norm's forward op returns it. Backward: the norm's own backward (``torch.ops.truefuse.norm_bwd``)
    on the saved rstd, plus the residual path; the identity through the allreduce. Without a
    weight (the plain ``allreduce`` on the kernel path) it is the allreduce (and add) alone."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, group, workspace, want_rstd):
        ctx.set_materialize_grads(False)  # an unused output sends None: no zeros added (-0 stays -0)
        x2 = x.reshape(-1, x.shape[-1])
        res2 = None if residual is None else residual.reshape(-1, x.shape[-1])
        if workspace is not None:
            normed, out, rstd = allreduce_add_rmsnorm_fwd(
                workspace.symmetric, x2, res2, weight, eps, workspace.two_stage_bytes, want_rstd=want_rstd
            )
        else:  # the reference: exactly truefuse.rms_norm(allreduce_ref(x) + residual, weight, eps)
            out = allreduce_ref(x2, group=group)
            if res2 is not None:
                out = out + res2
            normed, _, rstd = launch(norm_fwd_op, out, weight, None, eps, True, False)
        ctx.save_for_backward(out, weight, rstd if want_rstd else None)
        ctx.x_shape, ctx.has_res, ctx.has_norm = x.shape, residual is not None, normed is not None
        out = out.view(x.shape)
        # a plain allreduce has no normed output: an empty placeholder, never the same tensor twice
        return (normed.view(x.shape) if normed is not None else out.new_empty(0)), out

    @staticmethod
    @refuses_double_backward("distributed.allreduce_add_rmsnorm", "truefuse.distributed.allreduce_add_rmsnorm_ref")
    def backward(ctx, d_normed, d_out):
        out, weight, rstd = ctx.saved_tensors
        d = None if d_out is None else d_out.reshape(out.shape)
        dw = None
        if ctx.has_norm and d_normed is not None:
            if out.numel() == 0:  # nothing to launch: the gradients of no elements
                dx, dw = torch.zeros_like(out), (None if weight is None else torch.zeros_like(weight))
            else:  # the call truefuse.rms_norm's registered backward makes, on the same saved rstd
                dx, dw, _ = launch(
                    norm_bwd_op, d_normed.reshape(out.shape), out, weight, None, rstd.new_empty(0), rstd, True, False
                )
                dw = None if weight is None else dw
            d = dx if d is None else d + dx
        if d is not None:
            d = d.view(ctx.x_shape)
        return d, (d if ctx.has_res else None), dw, None, None, None, None


class AllreduceFunction(torch.autograd.Function):
    """Tensor-parallel allreduce: forward sums over ranks; backward is the identity, since every
    rank consumes the same output (the norm after it needs no collective in its backward)."""

    @staticmethod
    def forward(ctx, x, group):
        return allreduce_ref(x, group=group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def allreduce(x: torch.Tensor, *, group=None, workspace: Workspace | None = None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group`` (None: the default group), docs/design.md §4's contract:
    an fp32 sum in rank order rounded once, bitwise identical on every rank. ``x`` is not modified.

    Args:
        x: (..., H), bf16 / fp16 / fp32, contiguous, H ≤ 16384, the same shape and dtype on every rank.
        workspace: the group's :class:`Workspace` (limits the message size).

    Raises:
        ValueError on every rank when any rank's input is bad or the ranks disagree.
    """
    group = _group(group)
    _check(group, x, None, None, workspace)
    if _kernel_path(x, workspace, group):
        return FusedAllreduceAddRMSNorm.apply(x, None, None, 0.0, group, workspace, False)[1]
    return AllreduceFunction.apply(x, group)


def allreduce_add_rmsnorm(x, residual, weight, eps: float = 1e-6, *, group=None, workspace: Workspace | None = None):
    """The end of a tensor-parallel sublayer: ``residual_out = allreduce(x) + residual`` and
    ``normed = truefuse.rms_norm(residual_out, weight, eps)``.

    Args:
        x, residual: (..., H), bf16 / fp16 / fp32, same shape and dtype, contiguous. Not modified.
        weight: (H,) the norm's scale.
        eps: the norm's epsilon.

    Returns:
        ``(normed, residual_out)``, both shaped like ``x``. Differentiable in x, residual and weight.
    """
    group = _group(group)
    _check(group, x, residual, weight, workspace, eps)
    kernel = _kernel_path(x, workspace, group)
    if kernel or use_kernel(x):  # the norm's kernels run: its backward takes the saved rstd
        want_rstd = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight))
        return FusedAllreduceAddRMSNorm.apply(x, residual, weight, float(eps), group, workspace if kernel else None, want_rstd)
    # the norm's reference (e.g. bf16 on the CPU): autograd differentiates it
    residual_out = AllreduceFunction.apply(x, group)
    if residual is not None:
        residual_out = residual_out + residual
    return rms_norm(residual_out, weight, eps), residual_out
