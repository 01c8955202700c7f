"""``truefuse.GroupedLinear`` and ``truefuse.GroupedMLP``: mixture-of-experts layers over rows
ordered by expert, under the docs/design.md §2 weight-gradient contract."""

from __future__ import annotations

import torch

from truefuse.autograd._autocast import autocast_dtype, cast
from truefuse.autograd._wgrad import DEFAULT_MAX_PENDING_WGRAD
from truefuse.autograd.grouped import GroupedLinearFunction, GroupedMLPFunction, GroupSpec
from truefuse.nn._base import WgradModule, init_linear_
from truefuse.ops.activation import activation_ref
from truefuse.ops.gated_activation import GATED_ACTIVATIONS, gated_activation_torch
from truefuse.ops.gemm import check_splits
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

    def spec(self, splits, fused_grouped_gemm: bool, dtype: torch.dtype | None) -> GroupSpec:
        return GroupSpec(tuple(splits), self.packed, self.bias, tuple(self.weight_names()), fused_grouped_gemm, dtype)

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


def _check_grouped(module: WgradModule, x: torch.Tensor, features: int, groups: int, m_splits):
    """The grouped forward's input checks; returns ``m_splits`` as a list, the autocast dtype
    (None outside autocast) and ``x`` cast to it (differentiably, as ``F.linear``'s input)."""
    module._check_input(x, features, module.gemm_weights()[0][1])
    if x.dim() != 2:
        raise ValueError(f"input must be 2-D (tokens, {features}) with rows ordered by group, got shape {tuple(x.shape)}")
    dtype = autocast_dtype(x.device)
    return _splits(m_splits, groups, x), dtype, cast(x, dtype)


class GroupedLinear(WgradModule):
    """``num_gemms`` linear layers over the rows of ``x`` split by ``m_splits``.

    Args:
        num_gemms, in_features, out_features, bias, device, dtype: the groups and each one's shape.
        single_grouped_weight: one parameter ``weight`` (G, out, in) (and ``bias`` (G, out)) instead
            of ``weight0`` ... ``weight{G-1}`` (out, in) and ``bias0`` ... (out,).
        fused_grouped_gemm: with packed weights, let ``truefuse.gemm`` use one fused grouped GEMM
            (cuBLAS ``grouped_mm``: bf16, 16-byte aligned) instead of one GEMM per group. Faster
            for many small groups, but not bitwise equal to one ``Linear`` per group (measured on
            the H200), so off by default.
        fuse_wgrad_accumulation, delay_wgrad_compute: docs/design.md §2, for the weights (packed or per
            group); biases are always returned to autograd normally.
        max_pending_wgrad: warn once when more than this many backward passes wait for
            ``backward_dw()`` (``pending_wgrad``; default 16, None: never).

    ``forward(x, m_splits)``: x (M, in_features), rows ordered by group; ``m_splits`` a list of
    integral scalars (Python or NumPy ints), a 1-D NumPy integer array or a 1-D integer tensor (one
    host sync on a GPU) of ``num_gemms`` sizes summing to M, zeros allowed; floats are refused.
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
        fused_grouped_gemm: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        super().__init__()
        self.fused_grouped_gemm = bool(fused_grouped_gemm)
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
        splits, dtype, x = _check_grouped(self, x, self.in_features, self.num_gemms, m_splits)
        spec = self._w.spec(splits, self.fused_grouped_gemm, dtype)
        return GroupedLinearFunction.apply(x, spec, self._wgrad, *self._w.params(self))

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
            f"bias={self._w.bias}, single_grouped_weight={self.single_grouped_weight}"
        )


class GroupedMLP(WgradModule):
    """Experts' MLPs: grouped fc1, activation, grouped fc2, over rows ordered by expert.

    Args:
        num_experts, hidden_size, ffn_hidden_size, bias, device, dtype: the experts and their widths.
        activation: ``swiglu`` (default), ``geglu``, ``geglu_tanh``, ``reglu`` (fc1 twice ``ffn_hidden_size`` wide,
            halves [gate, up]) or ``gelu``, ``gelu_tanh``, ``relu``, ``silu``. Its backward is one
            Triton pass that also recomputes the activation's output, so nothing but x and fc1's
            output is kept for the backward.
        single_grouped_weight: ``fc1_weight`` (E, fc1_out, hidden) and ``fc2_weight`` (E, hidden,
            ffn) instead of ``fc1_weight0`` ... and ``fc2_weight0`` ...
        fused_grouped_gemm: as in :class:`GroupedLinear` (packed weights only; off by default).
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
        fused_grouped_gemm: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        super().__init__()
        self.fused_grouped_gemm = bool(fused_grouped_gemm)
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
        splits, dtype, x = _check_grouped(self, x, self.hidden_size, self.num_experts, m_splits)
        return GroupedMLPFunction.apply(
            x, self._fc1.spec(splits, self.fused_grouped_gemm, dtype), self._fc2.spec(splits, self.fused_grouped_gemm, dtype),
            self.activation, self._wgrad,
            *self._fc1.params(self), *self._fc2.params(self),
        )  # fmt: skip

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
            f"activation={self.activation}, single_grouped_weight={self.single_grouped_weight}"
        )
