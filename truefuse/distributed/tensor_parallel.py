"""Tensor-parallel linear layers (Megatron's layout; docs/tensor_parallel.md, issue 18).

* :class:`ColumnParallelLinear`: each rank holds a contiguous block of the weight's rows (output
  features); the input is replicated, the output sharded (or all-gathered).
* :class:`RowParallelLinear`: each rank holds a contiguous block of the weight's columns (input
  features); the partial outputs are summed by truefuse's ``allreduce`` (fp32 in rank order, one
  rounding, the same bits on every rank), optionally ending in ``allreduce_add_rmsnorm``.
* :class:`TensorParallelMLP`: column fc1 (gated layout below), truefuse's activation, row fc2
  with the fused allreduce + residual + RMSNorm tail.

All three follow docs/design.md §2 (``main_grad`` fusion, ``delay_wgrad_compute`` +
``backward_dw()``, ``register_wgrad_hook``): their GEMMs are ``truefuse.autograd.linear``'s
``LinearFunction``, the one every linear-family module runs.

Sequence parallelism is out of scope: activations outside the layers are replicated over the
group, never split along the sequence. As in Megatron, the rest of the model is replicated: the
gradient arriving at a replicated output (a row-parallel output, a gathered column-parallel one)
must be the same on every rank.

Gated layout: fc1 of a gated MLP is ``[gate; up]`` (2·ffn, hidden) unsharded, as
``truefuse.LayerNormMLP``. Rank r's shard is ``[gate[r·f:(r+1)·f]; up[r·f:(r+1)·f]]`` with f =
ffn / world: both halves of each rank's shard belong to the same ffn columns, so the activation is
local. :func:`shard_rows` with ``gated=True`` cuts a full weight (or bias) that way.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from truefuse.autograd._autocast import autocast_dtype, cast, cast_dtype
from truefuse.autograd._wgrad import DEFAULT_MAX_PENDING_WGRAD, check_main_grad
from truefuse.autograd.gated_activation import gated_activation
from truefuse.autograd.linear import linear
from truefuse.config import get_tuning
from truefuse.distributed._agree import agree, problem_of, validating
from truefuse.distributed._regions import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    torch_region,
)
from truefuse.distributed.allreduce import allreduce_add_rmsnorm
from truefuse.distributed.sharding import shard_columns, shard_rows
from truefuse.distributed.workspace import Workspace
from truefuse.nn._base import WgradModule
from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS, gated_activation_torch
from truefuse.ops.gemm.activation import activation_ref
from truefuse.ops.gemm.bias_grad import split_bias_grad
from truefuse.ops.linear import MLP_ACTIVATIONS
from truefuse.ops.norm.norm import rms_norm_torch

#: dtypes of the layers' parameters and activations: what ``allreduce`` sums.
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --- shared pieces ------------------------------------------------------------------------------------


def _group_of(group):
    if not dist.is_initialized():
        raise RuntimeError("tensor-parallel layers need an initialised process group (torch.distributed.init_process_group)")
    return group if group is not None else dist.group.WORLD


def _param_dtype(dtype) -> torch.dtype:
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype} is not supported: the allreduce takes bfloat16, float16 or float32")
    return dtype


def _divisible(value: int, name: str, world: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value % world:
        raise ValueError(f"{name}={value} is not divisible by the tensor-parallel world size {world}")
    return value // world


def _check_workspace(workspace, group) -> None:
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a truefuse.distributed.Workspace or None, got {type(workspace).__name__}")
    if workspace is not None and workspace.group != group:
        raise ValueError("workspace belongs to another process group than group=")


def _mark_parallel(p: torch.nn.Parameter, dim: int) -> None:
    """Megatron's attributes of a sharded parameter (its optimizer and gradient-norm code read them)."""
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


def _init_uniform_(t: torch.Tensor, fan_in: int) -> None:
    """torch.nn.Linear's weight distribution for the unsharded layer: kaiming-uniform(a=√5) is
    uniform(±1/√fan_in) with fan_in the full layer's."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    torch.nn.init.uniform_(t, -bound, bound)


def _weight_and_bias(src, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a ``torch.nn.Linear`` (``truefuse.Linear`` included) or a weight tensor."""
    if isinstance(src, torch.nn.Linear):
        return src.weight, src.bias
    if isinstance(src, torch.Tensor):
        return src, None
    raise TypeError(f"{what} must be a torch.nn.Linear (truefuse.Linear) or a weight tensor, got {type(src).__name__}")


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the layer's output: the autocast dtype if autocast casts here, else the weight's."""
    return cast_dtype(weight, autocast_dtype(x.device))


class _BiasAdd(torch.autograd.Function):
    """``y + bias`` (bias cast to y's dtype, one rounding); backward: the bias-gradient with
    docs/design.md §3's formula (``split_bias_grad``: fp32 sum over tokens, rounded once), as a
    ``truefuse.Linear`` bias gets it."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.bias_dtype = bias.dtype
        return y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx, dy):
        db = split_bias_grad(dy.reshape(-1, dy.shape[-1]), ctx.bias_dtype) if ctx.needs_input_grad[1] else None
        return dy, db


# --- ColumnParallelLinear -------------------------------------------------------------------------------


class ColumnParallelLinear(WgradModule):
    """``y = x @ Wᵀ + b`` with W's rows (output features) split over the ranks of ``group``.

    Args:
        in_features, out_features: the unsharded layer's sizes; ``out_features`` must be divisible
            by the group's size (a ``ValueError`` naming it otherwise).
        bias, device, dtype: as ``torch.nn.Linear`` (dtype bf16 / fp16 / fp32).
        group: the tensor-parallel process group (None: the default group), the same on every rank
            (another group over the same ranks is a ValueError on every rank; docs/design.md §4).
        gather_output: all-gather the output shards (output replicated, (..., out_features));
            default False: each rank keeps its (..., out_features / world) block.
        workspace: a :class:`~truefuse.distributed.Workspace` of ``group`` for the allreduce kernel
            (the backward's d_input sum); its ``max_bytes`` must hold tokens × in_features elements.
            None: the all-gather reference (the same bits).
        fuse_wgrad_accumulation, delay_wgrad_compute, max_pending_wgrad: docs/design.md §2 for
            ``weight``.

    Parameters: ``weight`` (out_features / world, in_features), rank r holding rows
    [r·n, (r+1)·n) of the unsharded weight (Megatron's layout); ``bias`` (out_features / world,).
    Both carry Megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes. Initialised as
    the unsharded ``torch.nn.Linear`` weight would be (uniform ±1/√in_features, each rank from its
    own generator state); biases start at zero, as Megatron's. :meth:`from_linear` copies an
    unsharded layer's shard instead.

    Shapes: input (..., in_features), the same on every rank (replicated; its gradient is
    allreduced in the backward); output (..., out_features / world), or (..., out_features) with
    ``gather_output``. Sequence parallelism is not supported.

    Bad input (shape, dtype, device, ``main_grad``), or ranks that disagree on the input's shape,
    dtype, whether it needs a gradient or the process group, is the same error on every rank before
    any GEMM runs.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        group=None,
        gather_output: bool = False,
        workspace: Workspace | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        super().__init__()
        self.group = _group_of(group)
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_rank = _divisible(out_features, "out_features", self.world_size)
        _check_workspace(workspace, self.group)
        self.gather_output, self.workspace = bool(gather_output), workspace
        fk = {"device": device, "dtype": _param_dtype(dtype)}
        self.weight = torch.nn.Parameter(torch.empty(self.out_features_per_rank, in_features, **fk))
        self.bias = torch.nn.Parameter(torch.empty(self.out_features_per_rank, **fk)) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                _mark_parallel(p, 0)
        self._weight_name = "weight"
        self._init_wgrad(fuse_wgrad_accumulation, delay_wgrad_compute, max_pending_wgrad)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_uniform_(self.weight.data, self.in_features)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    @classmethod
    def from_linear(cls, linear_or_weight, bias: torch.Tensor | None = None, *, group=None, gated: bool = False, **kwargs):
        """This rank's shard of an unsharded layer: a ``torch.nn.Linear`` / ``truefuse.Linear`` or a
        weight (out_features, in_features) and optional ``bias`` (out_features,). ``gated=True``:
        the weight is ``[gate; up]`` and each rank gets ``[gate_r; up_r]`` (:func:`shard_rows`).
        Device and dtype are the weight's; ``kwargs`` go to the constructor. Every rank passes the
        same unsharded values."""
        weight, lin_bias = _weight_and_bias(linear_or_weight, "linear_or_weight")
        bias = lin_bias if bias is None else bias
        g = _group_of(group)
        m = cls(weight.shape[1], weight.shape[0], bias is not None, weight.device, weight.dtype, group=g, **kwargs)
        if gated:
            _divisible(weight.shape[0] // 2, "out_features / 2 (gated: the ffn width)", m.world_size)
        with torch.no_grad():
            m.weight.copy_(shard_rows(weight.detach(), m.rank, m.world_size, gated=gated))
            if bias is not None:
                m.bias.copy_(shard_rows(bias.detach(), m.rank, m.world_size, gated=gated))
        return m

    def gemm_weights(self):
        return [(self._weight_name, self.weight)]

    # the check, without collectives: (error class, message) or None
    def _localproblem_of(self, x) -> tuple[str, str] | None:
        def dtype_ok():
            if _compute_dtype(x, self.weight) not in _DTYPES:
                raise TypeError(f"input runs in {_compute_dtype(x, self.weight)}; the allreduce takes bf16, fp16 or fp32")

        return problem_of(lambda: self._check_input(x, self.in_features, self.weight), dtype_ok)

    def _desc(self, x) -> tuple:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
        grad = isinstance(x, torch.Tensor) and torch.is_grad_enabled() and x.requires_grad
        return (
            ("input shape", shape),
            ("input dtype", str(getattr(x, "dtype", None))),
            ("input requires grad", grad),
            ("layer", (self.in_features, self.out_features, self.gather_output)),
        )

    def _run(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        x = cast(x, autocast_dtype(x.device))  # autocast's cast first: the backward's allreduce runs in that dtype
        x = copy_to_tp_region(x, self.group, self.workspace)
        y = linear(x, self.weight, self.bias, activation=activation, state=self._wgrad, weight_name=self._weight_name)
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features), the same on every rank -> (..., out_features / world), or
        (..., out_features) with ``gather_output``; in the parameters' dtype (autocast: its dtype)."""
        agree(self.group, type(self).__name__, self._localproblem_of(x), self._desc(x), validating(x, self.workspace))
        return self._run(x)

    def forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer in plain PyTorch (the bounded contract's same-dtype baseline): ``F.linear``
        on the shard, ``torch.distributed.all_reduce`` of the input's gradient (and ``all_gather``)."""
        y = F.linear(torch_region(x, "copy", self.group), self.weight, self.bias)
        return torch_region(y, "gather", self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, world_size={self.world_size}, "
            f"rank={self.rank}, bias={self.bias is not None}, gather_output={self.gather_output}"
        )


# --- RowParallelLinear ----------------------------------------------------------------------------------


class RowParallelLinear(WgradModule):
    """``y = allreduce(x_r @ W_rᵀ) + b`` with W's columns (input features) split over the ranks.

    Args:
        in_features, out_features: the unsharded layer's sizes; ``in_features`` must be divisible
            by the group's size (a ``ValueError`` naming it otherwise).
        bias, device, dtype: as ``torch.nn.Linear`` (dtype bf16 / fp16 / fp32). The bias is
            replicated and added once, after the sum. ``bias=True`` with
            ``fuse_residual_rmsnorm=True`` is refused (see below).
        group: the tensor-parallel process group (None: the default group), the same on every rank
            (another group over the same ranks is a ValueError on every rank; docs/design.md §4).
        input_is_parallel: the input is already this rank's (..., in_features / world) block (the
            output of a :class:`ColumnParallelLinear`); False: the input is the full (...,
            in_features), replicated, and each rank takes its block (the gradient is all-gathered).
        fuse_residual_rmsnorm: end in ``allreduce_add_rmsnorm``: ``forward(x, residual)`` returns
            ``(normed, residual_out)`` with ``residual_out = allreduce(partial) + residual`` and
            ``normed = truefuse.rms_norm(residual_out, norm_weight, eps)``; needs out_features ≤
            the ``max_kernel_n`` knob (16384).
        eps: the norm's epsilon.
        workspace: a :class:`~truefuse.distributed.Workspace` of ``group`` for the allreduce kernel
            (max_bytes ≥ tokens × out_features elements); None: the all-gather reference (same bits).
        fuse_wgrad_accumulation, delay_wgrad_compute, max_pending_wgrad: docs/design.md §2 for ``weight``.

    Parameters: ``weight`` (out_features, in_features / world), rank r holding columns
    [r·k, (r+1)·k) of the unsharded weight (Megatron's layout; ``tensor_model_parallel``,
    ``partition_dim=1``); ``bias`` (out_features,) replicated, initialised to zero (every rank must
    hold the same bias); ``norm_weight`` (out_features,) replicated, ones, with
    ``fuse_residual_rmsnorm``. The replicated parameters get the same gradient on every rank.

    Why no bias with the fused tail: the unfused layer computes ``round(round(sum) + b)`` and then
    adds the residual; ``allreduce_add_rmsnorm`` adds one tensor to the rounded sum, so the bias
    could only go into the residual first (``round(sum) + round(residual + b)``), which is another
    result. Refusing keeps the fused layer exactly the unfused composition.

    Shapes: input (..., in_features / world) (or (..., in_features)); output (..., out_features),
    the same bits on every rank. ``residual`` (..., out_features) in the output's dtype.
    Sequence parallelism is not supported.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        group=None,
        input_is_parallel: bool = True,
        fuse_residual_rmsnorm: bool = False,
        eps: float = 1e-6,
        workspace: Workspace | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        super().__init__()
        self.group = _group_of(group)
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.in_features_per_rank = _divisible(in_features, "in_features", self.world_size)
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features <= 0:
            raise ValueError(f"out_features must be a positive int, got {out_features!r}")
        self.in_features, self.out_features = in_features, out_features
        self.fuse_residual_rmsnorm = bool(fuse_residual_rmsnorm)
        if self.fuse_residual_rmsnorm:
            if bias:
                raise ValueError(
                    "bias=True cannot be combined with fuse_residual_rmsnorm=True: allreduce_add_rmsnorm adds the "
                    "residual to the rounded sum, and a bias could only join the residual first, which rounds "
                    "differently from the unfused layer (pass bias=False)"
                )
            if out_features > get_tuning().max_kernel_n:
                raise ValueError(
                    f"out_features={out_features}: fuse_residual_rmsnorm needs at most {get_tuning().max_kernel_n} "
                    "(the norm's row lives in registers)"
                )
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        _check_workspace(workspace, self.group)
        self.input_is_parallel, self.eps, self.workspace = bool(input_is_parallel), float(eps), workspace
        fk = {"device": device, "dtype": _param_dtype(dtype)}
        self.weight = torch.nn.Parameter(torch.empty(out_features, self.in_features_per_rank, **fk))
        _mark_parallel(self.weight, 1)
        self.bias = torch.nn.Parameter(torch.empty(out_features, **fk)) if bias else None
        self.norm_weight = torch.nn.Parameter(torch.empty(out_features, **fk)) if self.fuse_residual_rmsnorm else None
        self._weight_name = "weight"
        self._init_wgrad(fuse_wgrad_accumulation, delay_wgrad_compute, max_pending_wgrad)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_uniform_(self.weight.data, self.in_features)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)  # replicated: every rank the same values
        if self.norm_weight is not None:
            torch.nn.init.ones_(self.norm_weight)

    @classmethod
    def from_linear(cls, linear_or_weight, bias: torch.Tensor | None = None, *, group=None, norm_weight=None, **kwargs):
        """This rank's shard of an unsharded layer (a ``torch.nn.Linear`` / ``truefuse.Linear`` or a
        weight (out_features, in_features) and optional ``bias``); ``norm_weight`` (out_features,)
        with ``fuse_residual_rmsnorm=True``. Device and dtype are the weight's; ``kwargs`` go to the
        constructor. Every rank passes the same unsharded values."""
        weight, lin_bias = _weight_and_bias(linear_or_weight, "linear_or_weight")
        bias = lin_bias if bias is None else bias
        g = _group_of(group)
        m = cls(weight.shape[1], weight.shape[0], bias is not None, weight.device, weight.dtype, group=g, **kwargs)
        with torch.no_grad():
            m.weight.copy_(shard_columns(weight.detach(), m.rank, m.world_size))
            if bias is not None:
                m.bias.copy_(bias.detach())
            if norm_weight is not None:
                if m.norm_weight is None:
                    raise ValueError("norm_weight is given but fuse_residual_rmsnorm is False")
                m.norm_weight.copy_(norm_weight.detach())
        return m

    def gemm_weights(self):
        return [(self._weight_name, self.weight)]

    def _features(self) -> int:
        return self.in_features_per_rank if self.input_is_parallel else self.in_features

    def _residual_check(self, x, residual) -> None:
        if not self.fuse_residual_rmsnorm:
            if residual is not None:
                raise ValueError("residual is only taken with fuse_residual_rmsnorm=True")
            return
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor (fuse_residual_rmsnorm=True), got {type(residual).__name__}")
        want = (*x.shape[:-1], self.out_features)
        dtype = _compute_dtype(x, self.weight)
        if tuple(residual.shape) != want or residual.dtype != dtype or residual.device != x.device:
            raise ValueError(
                f"residual must have shape {want}, dtype {dtype} and device {x.device} (the output's), got "
                f"{tuple(residual.shape)}, {residual.dtype}, {residual.device}"
            )

    def _localproblem_of(self, x, residual) -> tuple[str, str] | None:
        def dtype_ok():
            if _compute_dtype(x, self.weight) not in _DTYPES:
                raise TypeError(f"input runs in {_compute_dtype(x, self.weight)}; the allreduce takes bf16, fp16 or fp32")

        def width_ok():  # named here: _check_input would call the per-rank width in_features
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] != self._features() and self.input_is_parallel:
                raise ValueError(
                    f"input has shape {tuple(x.shape)}: with input_is_parallel=True its last dimension must be "
                    f"in_features / world = {self._features()}"
                )

        return problem_of(
            width_ok,
            lambda: self._check_input(x, self._features(), self.weight),
            dtype_ok,
            lambda: self._residual_check(x, residual),
        )

    def _desc(self, x, residual) -> tuple:
        t = isinstance(x, torch.Tensor)
        grad = t and torch.is_grad_enabled() and x.requires_grad
        return (
            ("input shape", tuple(x.shape) if t else None),
            ("input dtype", str(getattr(x, "dtype", None))),
            ("input requires grad", grad),
            ("residual shape", tuple(residual.shape) if isinstance(residual, torch.Tensor) else None),
            ("layer", (self.in_features, self.out_features, self.input_is_parallel, self.fuse_residual_rmsnorm)),
        )

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        partial = linear(x, self.weight, None, state=self._wgrad, weight_name=self._weight_name)
        if self.fuse_residual_rmsnorm:
            return allreduce_add_rmsnorm(
                partial, residual.contiguous(), self.norm_weight, self.eps, group=self.group, workspace=self.workspace
            )
        y = reduce_from_tp_region(partial, self.group, self.workspace)
        return y if self.bias is None else _BiasAdd.apply(y, self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x (..., in_features / world) (or (..., in_features) when not ``input_is_parallel``) ->
        (..., out_features), the same bits on every rank; with ``fuse_residual_rmsnorm``,
        ``forward(x, residual)`` -> ``(normed, residual_out)``, both (..., out_features)."""
        problem = self._localproblem_of(x, residual)
        agree(self.group, type(self).__name__, problem, self._desc(x, residual), validating(x, self.workspace))
        return self._run(x, residual)

    def forward_ref(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The same layer in plain PyTorch (the bounded contract's same-dtype baseline): ``F.linear``
        on the shard, ``torch.distributed.all_reduce``, ``+ bias`` or ``+ residual`` and ``F.rms_norm``."""
        if not self.input_is_parallel:
            x = torch_region(x, "scatter", self.group)
        y = torch_region(F.linear(x, self.weight), "reduce", self.group)
        if self.fuse_residual_rmsnorm:
            residual_out = y + residual
            return rms_norm_torch(residual_out, self.norm_weight, self.eps), residual_out
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, world_size={self.world_size}, "
            f"rank={self.rank}, bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"fuse_residual_rmsnorm={self.fuse_residual_rmsnorm}"
        )


# --- TensorParallelMLP ------------------------------------------------------------------------------------


class TensorParallelMLP(WgradModule):
    """``fc2(act(fc1(x)))`` over a tensor-parallel group, ending in allreduce + residual + RMSNorm.

    ``forward(x, residual)`` returns ``(normed, residual_out)``: ``residual_out = residual +
    allreduce(fc2_r(act(fc1_r(x))))`` and ``normed = truefuse.rms_norm(residual_out, norm_weight,
    eps)``, the next sublayer's input, with the same bits on every rank.

    Args:
        hidden_size, ffn_hidden_size: the model and feed-forward widths; ``ffn_hidden_size`` must be
            divisible by the group's size, ``hidden_size`` at most 16384 (the norm).
        bias: must be False (the fused tail takes no bias: :class:`RowParallelLinear`).
        device, dtype: the parameters' (bf16 / fp16 / fp32).
        group: the tensor-parallel process group (None: the default group), the same on every rank
            (another group over the same ranks is a ValueError on every rank; docs/design.md §4).
        activation: a gated one (``swiglu``, ``geglu``, ``geglu_tanh``, ``reglu``: fc1 is twice
            ffn wide, each rank's shard ``[gate_r; up_r]``, the module docstring's gated layout) or
            ``gelu``, ``gelu_tanh``, ``relu``, ``silu`` (in fc1's GEMM epilogue).
        eps: the norm's epsilon.
        workspace: a :class:`~truefuse.distributed.Workspace` of ``group`` (max_bytes ≥ tokens ×
            hidden_size elements) for the allreduce kernels; None: the reference (same bits).
        fuse_wgrad_accumulation, delay_wgrad_compute, max_pending_wgrad: docs/design.md §2 for
            ``fc1.weight`` and ``fc2.weight``. fc1 and fc2 share this module's state: one
            ``backward_dw()`` (of the MLP, or of either) runs both in backward order.

    Submodules: ``fc1`` (:class:`ColumnParallelLinear`, weight (fc1_width / world, hidden)),
    ``fc2`` (:class:`RowParallelLinear`, weight (hidden, ffn / world), ``norm_weight`` (hidden,)).
    :meth:`from_unsharded` builds them from unsharded weights.

    Shapes: x and residual (..., hidden_size), the same on every rank, x in the parameters' dtype
    (or autocast's), residual in the output's. Sequence parallelism is not supported.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = False,
        device=None,
        dtype=None,
        *,
        group=None,
        activation: str = "swiglu",
        eps: float = 1e-6,
        workspace: Workspace | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; choose one of {MLP_ACTIVATIONS}")
        if bias:
            raise ValueError(
                "bias=True is not supported: fc2 ends in the fused allreduce + residual + RMSNorm, which takes no "
                "bias (RowParallelLinear's docstring says why)"
            )
        g = _group_of(group)
        _divisible(ffn_hidden_size, "ffn_hidden_size", dist.get_world_size(g))
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        self.gated = activation in GATED_ACTIVATIONS
        fc1_out = 2 * ffn_hidden_size if self.gated else ffn_hidden_size
        common = {"device": device, "dtype": dtype, "group": g, "workspace": workspace}
        self.fc1 = ColumnParallelLinear(hidden_size, fc1_out, False, **common)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, False, fuse_residual_rmsnorm=True, eps=eps, **common)
        self._init_wgrad(fuse_wgrad_accumulation, delay_wgrad_compute, max_pending_wgrad)
        # one state: one queue in backward order, one set of hooks, one configuration
        self.fc1._wgrad = self.fc2._wgrad = self._wgrad
        self.fc1._weight_name, self.fc2._weight_name = "fc1.weight", "fc2.weight"
        self.group, self.world_size, self.rank = g, self.fc1.world_size, self.fc1.rank

    @property
    def workspace(self) -> Workspace | None:
        return self.fc2.workspace

    @workspace.setter
    def workspace(self, ws: Workspace | None) -> None:
        _check_workspace(ws, self.group)
        self.fc1.workspace = self.fc2.workspace = ws

    @property
    def norm_weight(self) -> torch.nn.Parameter:
        return self.fc2.norm_weight

    @property
    def eps(self) -> float:
        return self.fc2.eps

    @classmethod
    def from_unsharded(
        cls, fc1, fc2, norm_weight: torch.Tensor | None = None, *, group=None, activation: str = "swiglu", **kwargs
    ):
        """This rank's shards of an unsharded MLP. ``fc1``: a ``torch.nn.Linear`` / ``truefuse.Linear``
        (no bias) or weight (fc1_width, hidden), gated as ``[gate; up]``; ``fc2``: one of
        (hidden, ffn); ``norm_weight`` (hidden,) (None: ones). Device and dtype are fc1's weight's."""
        w1, b1 = _weight_and_bias(fc1, "fc1")
        w2, b2 = _weight_and_bias(fc2, "fc2")
        if b1 is not None or b2 is not None:
            raise ValueError("fc1 and fc2 must have no bias (TensorParallelMLP takes none)")
        gated = activation in GATED_ACTIVATIONS
        ffn = w1.shape[0] // 2 if gated else w1.shape[0]
        if tuple(w2.shape) != (w1.shape[1], ffn):
            raise ValueError(f"fc2's weight has shape {tuple(w2.shape)}; fc1's {tuple(w1.shape)} needs {(w1.shape[1], ffn)}")
        m = cls(w1.shape[1], ffn, False, w1.device, w1.dtype, group=group, activation=activation, **kwargs)
        with torch.no_grad():
            m.fc1.weight.copy_(shard_rows(w1.detach(), m.rank, m.world_size, gated=gated))
            m.fc2.weight.copy_(shard_columns(w2.detach(), m.rank, m.world_size))
            if norm_weight is not None:
                m.fc2.norm_weight.copy_(norm_weight.detach())
        return m

    def gemm_weights(self):
        return [("fc1.weight", self.fc1.weight), ("fc2.weight", self.fc2.weight)]

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        return gated_activation(h, self.activation) if self.gated else h

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        """x, residual (..., hidden_size), the same on every rank -> ``(normed, residual_out)``,
        (..., hidden_size) each, the same bits on every rank."""
        fc2 = self.fc2

        def residual_ok():
            if isinstance(x, torch.Tensor):
                fc2._residual_check(x, residual)

        def fc2_main_grad_ok():  # fc1's is checked with x
            if self.fuse_wgrad_accumulation and torch.is_grad_enabled() and fc2.weight.requires_grad:
                check_main_grad(fc2.weight, "fc2.weight")

        problem = self.fc1._localproblem_of(x) or problem_of(residual_ok, fc2_main_grad_ok)
        desc = (*self.fc1._desc(x), ("residual shape", tuple(residual.shape) if isinstance(residual, torch.Tensor) else None))
        agree(self.group, type(self).__name__, problem, desc, validating(x, self.workspace))
        h = self.fc1._run(x, activation=None if self.gated else self.activation)
        return fc2._run(self._act(h), residual)

    def forward_ref(self, x: torch.Tensor, residual: torch.Tensor):
        """The same MLP in plain PyTorch (the bounded baseline): ``F.linear``, ``F.silu(gate) * up``
        (or the activation), ``F.linear``, ``torch.distributed.all_reduce``, ``+ residual``, ``F.rms_norm``."""
        h = F.linear(torch_region(x, "copy", self.group), self.fc1.weight)
        h = gated_activation_torch(h, self.activation) if self.gated else activation_ref(h, self.activation)
        return self.fc2.forward_ref(h, residual)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation}, "
            f"world_size={self.world_size}, rank={self.rank}, eps={self.eps}"
        )
