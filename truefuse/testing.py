"""Numerics helpers of the contract (docs/design.md §1), shared by the tests and ``truefuse verify``.

Two checks exist and nothing else decides PASS/FAIL:

* :func:`bitwise_report` for the **bitwise** contract: equal bit for bit, with the largest
  difference and the fraction of differing elements when not.
* :func:`bounded_report` for the **bounded** contract: the relative error
  ``‖out − ref‖ / ‖ref‖`` against a float64 reference must be at most ``ratio`` (1.25) times the
  error of the same-dtype unfused PyTorch path, plus a tiny floor. Tolerances come from that
  baseline, never from a hand-picked atol.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Allowed error ratio against the same-dtype baseline (docs/design.md §1).
BOUNDED_RATIO = 1.25
#: Relative-error floor: below this, both paths are at fp32 rounding level and the ratio is noise.
BOUNDED_FLOOR = 1e-6


@dataclass(frozen=True)
class BitwiseReport:
    """Outcome of a bitwise comparison.

    Attributes:
        equal: every element has the same bits (NaN payloads compared as bits too).
        max_diff: largest ``|a - b|`` in float64 (0.0 when equal; inf when a NaN meets a number).
        frac_nonzero: fraction of elements whose bits differ.
    """

    equal: bool
    max_diff: float
    frac_nonzero: float

    @property
    def passed(self) -> bool:
        return self.equal


def _same_layout(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise ValueError(f"dtype mismatch: actual {actual.dtype} vs expected {expected.dtype}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(view)


def bitwise_report(actual: torch.Tensor, expected: torch.Tensor) -> BitwiseReport:
    """Compare two tensors of the same shape and dtype bit for bit."""
    _same_layout(actual, expected)
    if actual.numel() == 0:
        return BitwiseReport(True, 0.0, 0.0)
    a, e = actual.detach().cpu(), expected.detach().cpu()
    differ = _bits(a) != _bits(e)
    n_diff = int(differ.sum())
    if n_diff == 0:
        return BitwiseReport(True, 0.0, 0.0)
    diff = (a.double() - e.double()).abs()
    # a NaN on one side only is an infinite difference, not a silent NaN in the report
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    both_nan = torch.isnan(a) & torch.isnan(e)
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    return BitwiseReport(False, float(diff.max()), n_diff / a.numel())


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 on the CPU; inf if ``out`` has a NaN/inf where ``ref`` is finite.

    With ``‖ref‖ == 0`` the absolute norm ``‖out‖`` is returned instead.
    """
    o = out.detach().cpu().double()
    r = ref.detach().cpu().double()
    if o.shape != r.shape:
        raise ValueError(f"shape mismatch: out {tuple(o.shape)} vs ref {tuple(r.shape)}")
    if not torch.isfinite(o[torch.isfinite(r)]).all():
        return float("inf")
    denom = float(torch.linalg.vector_norm(r))
    num = float(torch.linalg.vector_norm(o - r))
    return num / denom if denom > 0 else num


@dataclass(frozen=True)
class BoundedReport:
    """Outcome of a bounded-error check.

    Attributes:
        error: relative error of the op under test against the float64 reference.
        baseline_error: relative error of the same-dtype unfused PyTorch path.
        ratio: ``error / baseline_error`` (0 when both are 0, inf when only the baseline is 0).
        max_diff: largest ``|out − ref|`` against the float64 reference.
        frac_nonzero: fraction of elements of ``out`` that differ from the baseline's bits.
        passed: ``error <= BOUNDED_RATIO * baseline_error + BOUNDED_FLOOR``.
    """

    error: float
    baseline_error: float
    ratio: float
    max_diff: float
    frac_nonzero: float
    passed: bool


def bounded_report(
    out: torch.Tensor,
    ref64: torch.Tensor,
    baseline: torch.Tensor,
    *,
    ratio: float = BOUNDED_RATIO,
    floor: float = BOUNDED_FLOOR,
) -> BoundedReport:
    """Check ``out`` against a float64 reference with the tolerance set by ``baseline``.

    Args:
        out: result of the op under test, any float dtype.
        ref64: the same quantity computed in float64 (usually ``<op>_ref`` on upcast CPU inputs).
        baseline: the same-dtype unfused PyTorch path's result (usually ``<op>_ref`` on the same
            inputs), whose error against ``ref64`` sets the tolerance.
        ratio: allowed error ratio (docs/design.md §1: 1.25).
        floor: relative-error floor added to the bound.
    """
    err = rel_error(out, ref64)
    base = rel_error(baseline, ref64)
    if base > 0:
        r = err / base
    else:
        r = 0.0 if err == 0 else float("inf")
    o = out.detach().cpu().double()
    max_diff = float((o - ref64.detach().cpu().double()).abs().max()) if o.numel() else 0.0
    frac = 0.0
    if baseline.dtype == out.dtype and baseline.shape == out.shape and out.numel():
        frac = float((_bits(out.cpu()) != _bits(baseline.cpu())).float().mean())
    passed = err <= ratio * base + floor
    return BoundedReport(err, base, r, max_diff, frac, passed)


def fwd_bwd_reports(fn, ref, base, inputs: dict[str, torch.Tensor], seed: int = 0, **kw) -> dict[str, BoundedReport]:
    """Bounded reports for ``fn`` forward and backward: ``out`` and ``d<name>`` for each float input.

    ``fn``, ``ref`` and ``base`` are called as ``f(*inputs.values(), **kw)`` and backpropagate one
    random upstream gradient (seeded by ``seed + 1``). ``fn`` and ``base`` (the same-dtype baseline)
    run on ``inputs`` as given; ``ref`` runs on float64 CPU copies and is the reference.
    """

    def run(f, tensors):
        leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
        y = f(*leaves.values(), **kw)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1)).to(y)
        y.backward(dy)
        return {"out": y.detach(), **{f"d{k}": v.grad for k, v in leaves.items() if v.grad is not None}}

    got = run(fn, inputs)
    baseline = run(base, inputs)
    ref64 = run(ref, {k: v.detach().cpu().double() for k, v in inputs.items()})
    return {k: bounded_report(got[k], ref64[k], baseline[k]) for k in got}


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Assert bitwise equality with a message that carries the report."""
    rep = bitwise_report(actual, expected)
    assert rep.equal, f"{what}: not bitwise equal (max_diff={rep.max_diff:.3e}, frac_nonzero={rep.frac_nonzero:.3%})"


def assert_bounded(out: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor, what: str = "tensor") -> BoundedReport:
    """Assert the bounded contract, with the report in the message; returns the report."""
    rep = bounded_report(out, ref64, baseline)
    assert rep.passed, (
        f"{what}: error {rep.error:.3e} > {BOUNDED_RATIO} x baseline {rep.baseline_error:.3e} + {BOUNDED_FLOOR:g} "
        f"(ratio {rep.ratio:.3f})"
    )
    return rep


def same_on_all_ranks(t: torch.Tensor, group=None) -> bool:
    """``t`` has the same bits on every rank of ``group`` (None: the default group); call it on every rank."""
    import torch.distributed as dist

    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, t.contiguous(), group=group)
    return all(bitwise_report(e, everyone[0]).equal for e in everyone)


def error_on_every_rank(fn) -> tuple[str, str] | None:
    """(class name, message) of the TypeError / ValueError / RuntimeError ``fn()`` raised, or None;
    then a barrier of the default group, so a rank that hung in a collective fails the caller's run
    instead of returning. Call it on every rank."""
    import torch.distributed as dist

    try:
        fn()
        err = None
    except (TypeError, ValueError, RuntimeError) as e:
        err = (type(e).__name__, str(e))
    dist.barrier()
    return err
