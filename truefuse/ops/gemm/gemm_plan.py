"""The GEMM planner: policy only. Which backend runs a request, and what it fuses or splits.

A request names the features it needs (see :data:`FEATURES`). Each backend registered in
``truefuse.ops.gemm.gemm_backends`` states, as a set of ``(feature, input dtype, output dtype, device
type)`` rows, what it can fuse into one call. The planner takes the first backend in preference
order that can run the product for these dtypes on this device; it fuses what that backend can, and
every feature it lacks is *split*: done as the same math in separate PyTorch steps. The preference
order is data too (``TRUEFUSE_GEMM_BACKENDS``, default the registry's order, or
``override_capabilities(backends=...)``). The planner never refuses a valid request (the failure
docs/design.md §3 exists to prevent is "Unable to find any suitable algorithms" for bf16 in, fp32 out,
fused bias-gradient), and never names a backend: it asks the registry.

:func:`override_capabilities` changes the tables for a block of code, so a test on any machine can
play a platform that lacks a fused path.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from truefuse.config import get_config
from truefuse.ops.gemm.gemm_backends import BACKENDS, backend_names
from truefuse.ops.gemm.gemm_backends._base import FEATURES, Row


@dataclass(frozen=True)
class Capability:
    """One row of a capability table, or with ``None`` fields a pattern matching many rows.

    Attributes:
        feature: one of :data:`FEATURES`.
        in_dtype: dtype of ``a`` and ``b``.
        out_dtype: dtype of the output.
        device: device type, ``"cpu"`` or ``"cuda"``.
        backend: backend name; only meaningful in patterns given to :func:`override_capabilities`.
    """

    feature: str | None = None
    in_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    device: str | None = None
    backend: str | None = None

    def matches(self, backend: str, row: Row) -> bool:
        f, i, o, d = row
        return (
            (self.backend is None or self.backend == backend)
            and (self.feature is None or self.feature == f)
            and (self.in_dtype is None or self.in_dtype == i)
            and (self.out_dtype is None or self.out_dtype == o)
            and (self.device is None or self.device == d)
        )


@dataclass(frozen=True)
class _Override:
    remove: tuple[Capability, ...] = ()
    add: tuple[Capability, ...] = ()
    backends: tuple[str, ...] | None = None


_OVERRIDES: contextvars.ContextVar[tuple[_Override, ...]] = contextvars.ContextVar("truefuse_gemm_overrides", default=())


@contextlib.contextmanager
def override_capabilities(
    *,
    remove: Iterable[Capability] = (),
    add: Iterable[Capability] = (),
    backends: Iterable[str] | None = None,
) -> Iterator[None]:
    """Change the capability tables for the duration of a ``with`` block.

    Args:
        remove: patterns (``None`` fields match anything) of rows to take out, e.g.
            ``Capability("grad_bias", out_dtype=torch.float32)`` plays a platform whose fused
            bias-gradient fails for fp32 outputs (ROCm hipBLASLt today).
        add: fully specified rows to add (``backend`` must be set), e.g. to test a plan.
        backends: if given, only these backends are planned inside the block, in this order of
            preference (e.g. ``["triton", "torch"]`` prefers the fused Triton weight-gradient GEMM).

    Overrides nest; inner blocks apply after outer ones. This is a tool for tests and for playing a
    platform; library code says what it wants in its request instead (e.g. the grouped layers'
    ``gemm_groups(..., per_group=True)``).
    """
    add, remove = tuple(add), tuple(remove)
    for cap in add:
        if None in (cap.feature, cap.in_dtype, cap.out_dtype, cap.device, cap.backend):
            raise ValueError(f"add: {cap} must name feature, in_dtype, out_dtype, device and backend")
        if cap.feature not in FEATURES:
            raise ValueError(f"add: unknown feature {cap.feature!r}; known: {FEATURES}")
        if cap.backend in BACKENDS and cap.feature == "grouped" and BACKENDS[cap.backend].grouped_product is None:
            raise ValueError(f"add: backend {cap.backend!r} has no grouped product to fuse 'grouped' with")
    for what, caps in (("add", add), ("remove", remove)):
        for cap in caps:
            if cap.backend is not None and cap.backend not in BACKENDS:
                raise ValueError(f"{what}: unknown backend {cap.backend!r}; known: {backend_names()}")
    for cap in remove:
        if cap.feature is not None and cap.feature not in FEATURES:
            raise ValueError(f"remove: unknown feature {cap.feature!r}; known: {FEATURES}")
    if backends is not None:
        if isinstance(backends, str):  # "triton" would iterate as letters and match nothing
            raise TypeError(f"backends must be a list of backend names, got the string {backends!r}")
        backends = tuple(backends)
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"backends: unknown backend(s) {unknown}; known: {backend_names()}")
    ov = _Override(remove, add, backends)
    token = _OVERRIDES.set(_OVERRIDES.get() + (ov,))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def capability_table(backend: str) -> frozenset[Row]:
    """The effective capability rows of ``backend``, overrides applied."""
    rows = set(BACKENDS[backend].capabilities)
    for ov in _OVERRIDES.get():
        rows = {r for r in rows if not any(p.matches(backend, r) for p in ov.remove)}
        rows |= {(c.feature, c.in_dtype, c.out_dtype, c.device) for c in ov.add if c.backend == backend}
    return frozenset(rows)


def backend_available(backend: str, device: str) -> bool:
    """Whether ``backend`` is enabled (configuration, ``override_capabilities(backends=...)``) and
    can run on ``device`` here (the backend's own check), before capability overrides."""
    if backend not in BACKENDS or backend not in get_config().gemm_backends:
        return False
    for ov in _OVERRIDES.get():
        if ov.backends is not None and backend not in ov.backends:
            return False
    return BACKENDS[backend].available(device)


def backends_in_order(device: str) -> list[str]:
    """Backends available on ``device``, in preference order (the innermost override's, if any)."""
    order = list(get_config().gemm_backends)
    for ov in _OVERRIDES.get():
        if ov.backends is not None:
            order = [b for b in ov.backends if b in order]
    return [b for b in order if backend_available(b, device)]


@dataclass(frozen=True)
class GemmRequest:
    """What one ``truefuse.gemm`` call needs, reduced to what planning depends on."""

    device: str
    in_dtype: torch.dtype
    out_dtype: torch.dtype
    accumulate: bool = False
    bias: bool = False
    activation: bool = False
    grad_activation: bool = False
    grad_bias: bool = False
    grouped: bool = False
    #: every stride and base address of the grouped operands is a multiple of 16 bytes, which
    #: grouped GEMM kernels require; an unaligned grouped request is planned as a loop
    aligned: bool = True
    #: the caller asks for one GEMM per group (a loop in which each group runs exactly the call a
    #: plain ``gemm`` on its slice makes), never a fused grouped product, which may round differently
    per_group: bool = False
    #: the caller needs each output row bitwise independent of M (batch-invariant mode,
    #: docs/design.md §1): only a backend with a ``batch_invariant`` row for these dtypes fuses it
    batch_invariant: bool = False

    def features(self) -> tuple[str, ...]:
        flags = {
            "mm": True,
            "out_dtype": self.out_dtype != self.in_dtype,
            "accumulate": self.accumulate,
            "bias": self.bias,
            "activation": self.activation,
            "grad_activation": self.grad_activation,
            "grad_bias": self.grad_bias,
            "grouped": self.grouped,
            "batch_invariant": self.batch_invariant,
        }
        return tuple(f for f in FEATURES if flags[f])


def _aligned16(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 and all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride()) for t in ts)


def request(
    a, b, odt, accumulate, bias, activation, grad_activation, grad_bias, grouped, per_group, batch_invariant=False
) -> GemmRequest:
    """What the planner is asked (reads the operands' addresses: run on real tensors, not traced)."""
    return GemmRequest(
        device=a.device.type,
        in_dtype=a.dtype,
        out_dtype=odt,
        accumulate=bool(accumulate),
        bias=bias is not None,
        activation=activation is not None,
        grad_activation=grad_activation is not None,
        grad_bias=bool(grad_bias),
        grouped=grouped,
        aligned=(not grouped) or _aligned16(a, b),
        per_group=grouped and bool(per_group),
        batch_invariant=bool(batch_invariant),
    )


@dataclass(frozen=True)
class GemmPlan:
    """How a request is carried out.

    Attributes:
        backend: the backend that runs the product.
        compute_dtype: dtype ``a`` and ``b`` have when they reach the backend (the input dtype, or
            the output dtype when ``out_dtype`` is split by upcasting).
        fused: features done inside the backend's call.
        split: features done as separate PyTorch steps, with the same math.
    """

    backend: str
    compute_dtype: torch.dtype
    fused: tuple[str, ...]
    split: tuple[str, ...]

    def __str__(self) -> str:
        dt = str(self.compute_dtype).removeprefix("torch.")
        s = f"{self.backend}[{dt}]: fused {'+'.join(self.fused)}"
        return s + (f"; split {'+'.join(self.split)}" if self.split else "")


def _coverage(backend: str, table, feats: tuple[str, ...], request: GemmRequest, in_dt) -> tuple[str, ...]:
    fused = [f for f in feats if (f, in_dt, request.out_dtype, request.device) in table]
    if "grouped" in fused and (request.per_group or not request.aligned):
        fused.remove("grouped")
    if "grad_bias" in feats and "grad_bias" not in fused and "grad_activation" in fused:
        # a split bias-gradient is summed from the operand after the derivative: the derivative
        # must then be a split step too, or the sum would see the raw output-gradient
        fused.remove("grad_activation")
    for f in list(fused):
        allowed = BACKENDS[backend].fuses_only_with.get(f)
        if allowed is not None and not set(fused) <= allowed:
            fused.remove(f)
    return tuple(fused)


#: Plans made, by everything planning reads: the request, the overrides in force, the configuration
#: and which backends are available on the request's device. A batch-invariant model plans every
#: ``F.linear`` (and each backward GEMM): ~25 µs of host time a call before this cache, on the
#: 2-core CI box (experiments/exp_bi_speed.py, docs/benchmarks.md "Batch-invariant mode").
_PLANS: dict[tuple, GemmPlan] = {}
_MAX_PLANS = 4096  # distinct requests are few (dtypes x flags x devices); overrides add some in tests


def plan_context(device: str) -> tuple:
    """Everything a plan depends on beside its request: the overrides in force, the configuration
    and which backends are available on ``device`` (the key of :data:`_PLANS`, and of the plain
    call's runners in ``ops/gemm/gemm_runners.py``)."""
    return (*plan_settings(), tuple([b.available(device) for b in BACKENDS.values()]))


def plan_settings() -> tuple:
    """:func:`plan_context` less the backends' availability, which on CUDA is the process's (a
    kept launch's key, ``ops/gemm/gemm_kept.py``: the availability's check costs ~1 µs a call)."""
    return _OVERRIDES.get(), get_config()


def plan(request: GemmRequest) -> GemmPlan:
    """Choose the plan for ``request``: the first backend in preference order that runs the product.

    A backend that cannot write ``out_dtype`` from narrower inputs is still usable: the inputs are
    upcast to ``out_dtype`` first (the same products, fp32 accumulation) and ``out_dtype`` is split.
    The same inputs give the same plan, so plans are kept (:data:`_PLANS`).
    """
    key = (request, *plan_context(request.device))
    chosen = _PLANS.get(key)
    if chosen is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        chosen = _PLANS[key] = _plan(request)
    return chosen


def _plan(request: GemmRequest) -> GemmPlan:
    feats = request.features()
    names = backends_in_order(request.device)
    if request.batch_invariant:
        # a backend that keeps rows invariant itself comes first; with none, the first backend runs
        # the product on fixed-size row blocks (the split path of ``batch_invariant``)
        def keeps_rows(name: str) -> bool:
            table = capability_table(name)
            dev, odt = request.device, request.out_dtype
            return any(("batch_invariant", c, odt, dev) in table for c in (request.in_dtype, odt))

        names.sort(key=lambda n: not keeps_rows(n))  # stable: the preference order within each kind
    for name in names:
        table = capability_table(name)
        # try the inputs as they are, then upcast to the output dtype
        for compute in dict.fromkeys((request.in_dtype, request.out_dtype)):
            if ("mm", compute, request.out_dtype, request.device) not in table:
                continue
            wanted = feats if compute == request.in_dtype else tuple(f for f in feats if f != "out_dtype")
            fused = _coverage(name, table, wanted, request, compute)
            split = tuple(f for f in feats if f not in fused)
            return GemmPlan(name, compute, fused, split)
    runnable = [n for n, b in BACKENDS.items() if b.available(request.device)]
    hint = f"enable {' or '.join(map(repr, runnable))}" if runnable else "no registered backend runs there"
    raise RuntimeError(
        f"no GEMM backend is enabled for device {request.device!r} "
        f"(TRUEFUSE_GEMM_BACKENDS={','.join(get_config().gemm_backends)!r}); {hint}"
    )
