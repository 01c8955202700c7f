"""What a GEMM backend is: the features it may fuse, the arguments its product receives, and the
:class:`GemmBackend` record each backend module defines as ``BACKEND``.

Nothing here names a backend; the registry (``truefuse.ops.gemm.gemm_backends``) lists them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

#: Every feature a GEMM request may need, in the order a plan lists them.
#:
#: * ``mm``: the product itself with output dtype == input dtype.
#: * ``out_dtype``: a wider output than the inputs (bf16/fp16 in, fp32 out) without upcasting them.
#: * ``accumulate``: add into an existing output (beta=1), e.g. fp32 ``main_grad``.
#: * ``bias`` / ``activation``: forward epilogues ``act(a @ b + bias)``.
#: * ``grad_activation``: the left operand is multiplied by ``act'(pre_activation)`` first.
#: * ``grad_bias``: the sum of the (effective) left operand over the contraction dimension.
#: * ``grouped``: one call over groups given by ``m_splits``.
#: * ``batch_invariant``: each output row's bits independent of the number of rows (M) and of the
#:   other rows: no launch parameter that orders a row's reduction is chosen from M (docs/design.md
#:   §1). Split, it is the product run on fixed-size row blocks (``gemm_exec``).
FEATURES: tuple[str, ...] = (
    "mm",
    "out_dtype",
    "accumulate",
    "bias",
    "activation",
    "grad_activation",
    "grad_bias",
    "grouped",
    "batch_invariant",
)

#: One capability row: (feature, input dtype, output dtype, device type).
Row = tuple[str, torch.dtype, torch.dtype, str]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
#: (input dtype, output dtype) pairs: the output in the inputs' dtype, or widened to fp32.
SAME = ((F16, F16), (BF16, BF16), (F32, F32), (F64, F64))
WIDEN = ((F16, F32), (BF16, F32))


def rows(features: Iterable[str], pairs: Iterable[tuple[torch.dtype, torch.dtype]], devices: Iterable[str]) -> set[Row]:
    """Every ``(feature, in, out, device)`` combination of the given features, dtype pairs and devices."""
    pairs, devices = tuple(pairs), tuple(devices)
    return {(f, i, o, d) for f in features for (i, o) in pairs for d in devices}


@dataclass
class GemmArgs:
    """Validated arguments of one GEMM (or one group of a grouped GEMM): what a product receives."""

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor | None  # written (or accumulated into); None only for a fused grouped call
    out_dtype: torch.dtype
    accumulate: bool
    bias: torch.Tensor | None
    activation: str | None
    pre_out: torch.Tensor | None  # where to keep the pre-activation, when asked for
    grad_activation: str | None
    pre_activation: torch.Tensor | None
    grad_bias_out: torch.Tensor | None  # where the bias-gradient goes, when asked for


#: ``product(args, a, b, fused, target, beta1)``: write ``a @ b`` into ``target`` (added into it
#: when ``beta1``), doing inside the call the features of ``fused`` this backend has (the bias from
#: ``args.bias``, the derivative from ``args.grad_activation``/``args.pre_activation``, the
#: bias-gradient into ``args.grad_bias_out``). ``a``/``b`` are already in the plan's compute dtype.
Product = Callable[[GemmArgs, torch.Tensor, torch.Tensor, tuple[str, ...], torch.Tensor, bool], None]

#: ``grouped_product(args, splits)``: the whole rows-mode grouped GEMM in one call; returns the
#: output (``args.out`` filled, or a new tensor when ``args.out`` is None).
GroupedProduct = Callable[[GemmArgs, list[int]], torch.Tensor]


def _no_scope(device: torch.device) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class GemmBackend:
    """One GEMM backend, as the planner and the executor see it.

    Attributes:
        name: what ``TRUEFUSE_GEMM_BACKENDS``, ``override_capabilities`` and plans call it.
        capabilities: the rows it fuses (:data:`Row`), as data; the planner reads nothing else
            about what a backend can do.
        available: ``available(device_type)``: whether it can run on that device here (hardware,
            ``TRITON_INTERPRET``), before the configuration and overrides are applied.
        product: the call that runs one GEMM (:data:`Product`).
        fuses_only_with: feature -> the features a plan may fuse beside it; when the request needs
            more, the feature is split instead (e.g. a grouped call that takes no bias).
        grouped_product: the fused grouped call (:data:`GroupedProduct`); required exactly when
            ``capabilities`` has ``grouped`` rows.
        scope: ``scope(device)``: a context manager around everything a ``gemm`` call planned on
            this backend runs (e.g. cuBLAS's reduction settings).
    """

    name: str
    capabilities: frozenset[Row]
    available: Callable[[str], bool]
    product: Product
    fuses_only_with: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))
    grouped_product: GroupedProduct | None = None
    scope: Callable[[torch.device], contextlib.AbstractContextManager] = _no_scope

    def __post_init__(self) -> None:
        unknown = sorted({r[0] for r in self.capabilities} - set(FEATURES))
        if unknown:
            raise ValueError(f"GEMM backend {self.name!r}: unknown feature(s) {unknown}; known: {FEATURES}")
        if any(r[0] == "grouped" for r in self.capabilities) != (self.grouped_product is not None):
            raise ValueError(f"GEMM backend {self.name!r}: 'grouped' rows and a grouped_product go together")
