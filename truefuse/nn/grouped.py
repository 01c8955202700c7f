"""``truefuse.GroupedLinear`` and ``truefuse.GroupedMLP``: mixture-of-experts layers over rows
ordered by expert, under the docs/design.md §2 weight-gradient contract."""

from __future__ import annotations

import torch

from truefuse.autograd._autocast import autocast_dtype, cast
from truefuse.autograd._wgrad import DEFAULT_MAX_PENDING_WGRAD
from truefuse.autograd.grouped import GROUPED_PATHS, GroupedLinearFunction, GroupedMLPFunction, GroupSpec
from truefuse.nn._base import WgradModule, init_linear_
from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS, gated_activation_torch
from truefuse.ops.gemm.activation import activation_ref
from truefuse.ops.gemm.gemm_checks import check_splits
from truefuse.ops.grouped_gemm.grouped_gemm import check_split_tensor, grouped_gemm_available, split_offsets
from truefuse.ops.linear import MLP_ACTIVATIONS


class _GroupedWeights:
    """Creates and lists one layer's weights and biases, packed or per group."""

    def __init__(self, module, prefix: str, groups: int, out_f: int, in_f: int, bias: bool, packed: bool, fk: dict):
        self.prefix, self.groups, self.packed, self.bias = prefix, groups, packed, bias
        if packed:
            module.register_parameter(f"{prefix}weight", torch.nn.Parameter(torch.empty(groups, out_f, in_f, **fk)))
            if bias:
                module.register_parameter(f"{prefix}bias", torch.nn.Parameter(torch.empty(groups, out_f, **fk)))
        else:
            for g in range(groups):
                module.register_parameter(f"{prefix}weight{g}", torch.nn.Parameter(torch.empty(out_f, in_f, **fk)))
            for g in range(groups if bias else 0):
                module.register_parameter(f"{prefix}bias{g}", torch.nn.Parameter(torch.empty(out_f, **fk)))

    def weight_names(self) -> list[str]:
        return [f"{self.prefix}weight"] if self.packed else [f"{self.prefix}weight{g}" for g in range(self.groups)]

    def bias_names(self) -> list[str]:
        if not self.bias:
            return []
        return [f"{self.prefix}bias"] if self.packed else [f"{self.prefix}bias{g}" for g in range(self.groups)]

    def params(self, module) -> list[torch.nn.Parameter]:
        return [getattr(module, n) for n in (*self.weight_names(), *self.bias_names())]

    def spec(self, splits, path: str, dtype: torch.dtype | None) -> GroupSpec:
        splits = None if splits is None else tuple(splits)
        fused = path == "cublas_grouped"
        return GroupSpec(splits, self.packed, self.bias, tuple(self.weight_names()), fused, dtype, path)

    def group(self, module, g: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of group ``g`` (views into the packed parameters)."""
        if self.packed:
            return getattr(module, f"{self.prefix}weight")[g], getattr(module, f"{self.prefix}bias")[g] if self.bias else None
        return getattr(module, f"{self.prefix}weight{g}"), getattr(module, f"{self.prefix}bias{g}") if self.bias else None

    def reset(self, module) -> None:
        """torch.nn.Linear's initialisation, per group."""
        ws = [getattr(module, n) for n in self.weight_names()]
        bs = [getattr(module, n) for n in self.bias_names()] or [None] * len(ws)
        for w, b in zip(ws, bs, strict=True):
            if self.packed:
                for g in range(self.groups):
                    init_linear_(w[g], None if b is None else b[g])
            else:
                init_linear_(w, b)


def _splits(m_splits, groups: int, x: torch.Tensor) -> list[int]:
    return check_splits(m_splits, groups, x.shape[0], "the number of rows of x")


def check_grouped_path(path, fused_grouped_gemm: bool, packed: bool, *, arg: str = "backend") -> str | None:
    """The grouped path a module's ``backend=`` argument (named ``arg`` in the errors) asks for,
    checked against ``fused_grouped_gemm`` (its older spelling); None: the default."""
    if path is not None and path not in GROUPED_PATHS:
        raise ValueError(f"{arg}={path!r} is not supported; choose one of {GROUPED_PATHS} (or None: the default)")
    if fused_grouped_gemm:
        if path not in (None, "cublas_grouped"):
            raise ValueError(f"fused_grouped_gemm=True means {arg}='cublas_grouped'; it conflicts with {arg}={path!r}")
        path = "cublas_grouped"
    if path == "triton" and not packed:
        raise ValueError(f"{arg}='triton' needs packed weights: pass single_grouped_weight=True")
    return path


def resolve_grouped_path(
    path: str | None, device: torch.device, dtype: torch.dtype, packed: bool, *, arg: str = "backend"
) -> str:
    """The grouped path a forward runs: the one asked for, else ``triton`` where it runs by default
    (packed weights on CUDA, fp16/bf16/fp32), else ``per_group``."""
    if path == "triton":
        if not grouped_gemm_available(device, dtype):
            raise ValueError(
                f"{arg}='triton' runs on CUDA (fp16/bf16/fp32) or, under TRITON_INTERPRET=1, on the CPU for "
                f"float32; got {dtype} on {device}. Pass {arg}='per_group' there"
            )
        return "triton"
    if path is not None:
        return path
    if packed and device.type == "cuda" and grouped_gemm_available(device, dtype):
        return "triton"
    return "per_group"


class _GroupedPath:
    """``backend`` (the grouped path, docs/design.md §3) and its alias ``fused_grouped_gemm`` on the
    grouped modules."""

    backend: str | None

    @property
    def fused_grouped_gemm(self) -> bool:
        """``backend == 'cublas_grouped'`` (the option's older spelling; settable)."""
        return self.backend == "cublas_grouped"

    @fused_grouped_gemm.setter
    def fused_grouped_gemm(self, value: bool) -> None:
        if value:
            self.backend = "cublas_grouped"
        elif self.backend == "cublas_grouped":
            self.backend = None

    def _resolve_path(self, device: torch.device, dtype: torch.dtype, packed: bool) -> str:
        """:func:`resolve_grouped_path` of this module's ``backend``."""
        return resolve_grouped_path(self.backend, device, dtype, packed)


def _check_grouped(module, x: torch.Tensor, features: int, groups: int, m_splits, packed: bool):
    """The grouped forward's input checks; returns (the grouped path, ``m_splits`` as a list or None when
    they stay on the device, the device offsets or None, the autocast dtype (None outside autocast),
    ``x`` cast to it (differentiably, as ``F.linear``'s input)).

    The ``triton`` path takes a device tensor of sizes as it is (no host sync: its sum is asserted
    on the device, ``ops.grouped_gemm.split_offsets``); the others read the sizes on the host."""
    module._check_input(x, features, module.gemm_weights()[0][1])
    if x.dim() != 2:
        raise ValueError(f"input must be 2-D (tokens, {features}) with rows ordered by group, got shape {tuple(x.shape)}")
    dtype = autocast_dtype(x.device)
    path = module._resolve_path(x.device, dtype or x.dtype, packed)
    if path == "triton":
        if isinstance(m_splits, torch.Tensor):
            check_split_tensor(m_splits, groups)
            splits = None
        else:
            splits = _splits(m_splits, groups, x)
        # a list was checked just above: split_offsets does not check it again (check=False)
        offsets = split_offsets(m_splits if splits is None else splits, groups, x.shape[0], x.device, check=splits is None)
        return path, splits, offsets, dtype, cast(x, dtype)
    return path, _splits(m_splits, groups, x), None, dtype, cast(x, dtype)


class GroupedLinear(_GroupedPath, WgradModule):
    """``num_gemms`` linear layers over the rows of ``x`` split by ``m_splits``.

    Args:
        num_gemms, in_features, out_features, bias, device, dtype: the groups and each one's shape.
        single_grouped_weight: one parameter ``weight`` (G, out, in) (and ``bias`` (G, out)) instead
            of ``weight0`` ... ``weight{G-1}`` (out, in) and ``bias0`` ... (out,).
        backend: the grouped path: how packed weights run (docs/design.md §1, "Grouped GEMM"; not a
            GEMM planner backend, §3); per-group weights
            always run one GEMM per group (``per_group``).

            * ``"triton"``: truefuse's batch-invariant grouped GEMM, one persistent launch per GEMM:
              each group's output and gradients are bitwise independent of the other groups' sizes,
              their order and the batch, and bounded against one ``F.linear`` per group.
              ``m_splits`` may be a CUDA tensor: no host sync in forward or backward (CUDA graphs).
              CUDA fp16/bf16/fp32; on the CPU only under ``TRITON_INTERPRET=1`` for fp32.
            * ``"per_group"``: one ``truefuse.gemm`` per group: bits equal to one
              ``truefuse.Linear`` per group (a tensor ``m_splits`` is read on the host).
            * ``"cublas_grouped"``: cuBLAS ``grouped_mm`` where it runs (bf16, 16-byte aligned), else
              per group; neither of the two promises above.
            * None (default): ``"triton"`` for packed weights on CUDA, ``"per_group"`` otherwise.
        fused_grouped_gemm: the older spelling of ``backend="cublas_grouped"`` (kept; settable).
        fuse_wgrad_accumulation, delay_wgrad_compute: docs/design.md §2, for the weights (packed or per
            group); biases are always returned to autograd normally.
        max_pending_wgrad: warn once when more than this many backward passes wait for
            ``backward_dw()`` (``pending_wgrad``; default 16, None: never).

    ``forward(x, m_splits)``: x (M, in_features), rows ordered by group; ``m_splits`` a list of
    integral scalars (Python or NumPy ints), a 1-D NumPy integer array or a 1-D integer tensor (one
    host sync on a GPU unless the path is ``triton``, which checks its sum on the device) of
    ``num_gemms`` sizes summing to M, zeros allowed; floats are refused.
    Returns (M, out_features).

    Autocast: each group as ``torch.nn.Linear`` under ``torch.autocast``: operands cast to the
    autocast dtype, output in it; gradients in the parameters' dtypes (docs/linear.md, "Autocast").
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        single_grouped_weight: bool = False,
        backend: str | None = None,
        fused_grouped_gemm: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        super().__init__()
        self.backend = check_grouped_path(backend, bool(fused_grouped_gemm), single_grouped_weight)
        if num_gemms < 1:
            raise ValueError(f"num_gemms must be at least 1, got {num_gemms}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.single_grouped_weight = single_grouped_weight
        fk = {"device": device, "dtype": dtype}
        self._w = _GroupedWeights(self, "", num_gemms, out_features, in_features, bias, single_grouped_weight, fk)
        self._init_wgrad(fuse_wgrad_accumulation, delay_wgrad_compute, max_pending_wgrad)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self._w.reset(self)

    def gemm_weights(self):
        return [(n, getattr(self, n)) for n in self._w.weight_names()]

    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        path, splits, offsets, dtype, x = _check_grouped(self, x, self.in_features, self.num_gemms, m_splits, self._w.packed)
        spec = self._w.spec(splits, path, dtype)
        extra = () if offsets is None else (offsets,)
        return GroupedLinearFunction.apply(x, spec, self._wgrad, *self._w.params(self), *extra)

    def forward_ref(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        """A loop of ``F.linear`` per group (the reference)."""
        splits = _splits(m_splits, self.num_gemms, x)
        outs, start = [], 0
        for g, m in enumerate(splits):
            outs.append(torch.nn.functional.linear(x[start : start + m], *self._w.group(self, g)))
            start += m
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self._w.bias}, single_grouped_weight={self.single_grouped_weight}, backend={self.backend}"
        )


class GroupedMLP(_GroupedPath, WgradModule):
    """Experts' MLPs: grouped fc1, activation, grouped fc2, over rows ordered by expert.

    Args:
        num_experts, hidden_size, ffn_hidden_size, bias, device, dtype: the experts and their widths.
        activation: ``swiglu`` (default), ``geglu``, ``geglu_tanh``, ``reglu`` (fc1 twice ``ffn_hidden_size`` wide,
            halves [gate, up]) or ``gelu``, ``gelu_tanh``, ``relu``, ``silu``. Its backward is one
            Triton pass that also recomputes the activation's output, so nothing but x and fc1's
            output is kept for the backward.
        single_grouped_weight: ``fc1_weight`` (E, fc1_out, hidden) and ``fc2_weight`` (E, hidden,
            ffn) instead of ``fc1_weight0`` ... and ``fc2_weight0`` ...
        backend: as in :class:`GroupedLinear` (default ``"triton"`` for packed weights on CUDA; the
            activation between fc1 and fc2 is elementwise, so the invariance carries through).
        fused_grouped_gemm: as in :class:`GroupedLinear` (``backend="cublas_grouped"``).
        fuse_wgrad_accumulation, delay_wgrad_compute: docs/design.md §2 for every expert weight.
        max_pending_wgrad: as in :class:`GroupedLinear`.

    ``forward(x, m_splits)``: x (M, hidden_size) ordered by expert; returns (M, hidden_size).

    Autocast: fc1 and fc2 of each expert as ``torch.nn.Linear`` under ``torch.autocast``, the
    activation in the autocast dtype: output in it; gradients in the parameters' dtypes.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = False,
        device=None,
        dtype=None,
        *,
        activation: str = "swiglu",
        single_grouped_weight: bool = False,
        backend: str | None = None,
        fused_grouped_gemm: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        super().__init__()
        self.backend = check_grouped_path(backend, bool(fused_grouped_gemm), single_grouped_weight)
        if num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {num_experts}")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; choose one of {MLP_ACTIVATIONS}")
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.activation, self.single_grouped_weight = activation, single_grouped_weight
        fk = {"device": device, "dtype": dtype}
        fc1_out = 2 * ffn_hidden_size if activation in GATED_ACTIVATIONS else ffn_hidden_size
        self._fc1 = _GroupedWeights(self, "fc1_", num_experts, fc1_out, hidden_size, bias, single_grouped_weight, fk)
        self._fc2 = _GroupedWeights(self, "fc2_", num_experts, hidden_size, ffn_hidden_size, bias, single_grouped_weight, fk)
        self._init_wgrad(fuse_wgrad_accumulation, delay_wgrad_compute, max_pending_wgrad)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self._fc1.reset(self)
        self._fc2.reset(self)

    def gemm_weights(self):
        return [(n, getattr(self, n)) for n in (*self._fc1.weight_names(), *self._fc2.weight_names())]

    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        path, splits, offsets, dtype, x = _check_grouped(self, x, self.hidden_size, self.num_experts, m_splits, self._fc1.packed)
        extra = () if offsets is None else (offsets,)
        return GroupedMLPFunction.apply(
            x,
            self._fc1.spec(splits, path, dtype),
            self._fc2.spec(splits, path, dtype),
            self.activation,
            self._wgrad,
            *self._fc1.params(self),
            *self._fc2.params(self),
            *extra,
        )

    def forward_ref(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        """A loop over experts of ``F.linear``, the activation in the input dtype, ``F.linear``."""
        splits = _splits(m_splits, self.num_experts, x)
        gated = self.activation in GATED_ACTIVATIONS
        outs, start = [], 0
        for e, m in enumerate(splits):
            h = torch.nn.functional.linear(x[start : start + m], *self._fc1.group(self, e))
            h = gated_activation_torch(h, self.activation) if gated else activation_ref(h, self.activation)
            outs.append(torch.nn.functional.linear(h, *self._fc2.group(self, e)))
            start += m
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation}, single_grouped_weight={self.single_grouped_weight}, backend={self.backend}"
        )
