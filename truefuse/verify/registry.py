"""The one registry of contract cases that ``python -m truefuse verify`` runs.

An op's cases live in ``truefuse/verify/cases_<op>.py`` and register themselves with
:func:`register`; adding an op means adding such a module to :data:`CASE_MODULES`, nothing else.
A case function takes the device and returns ``{label: report}``; each report becomes one row.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from truefuse.testing import BitwiseReport, BoundedReport

Report = BitwiseReport | BoundedReport
CaseFn = Callable[[torch.device], dict[str, Report]]

#: Modules whose import registers cases, in the order verify runs them.
CASE_MODULES: tuple[str, ...] = (
    "truefuse.verify.cases_gemm",
    "truefuse.verify.cases_sibling_linears",
    "truefuse.verify.cases_norm",
    "truefuse.verify.cases_add_norm",
    "truefuse.verify.cases_gated_activation",
    "truefuse.verify.cases_linear",
    "truefuse.verify.cases_grouped",
    "truefuse.verify.cases_grouped_gemm",
    "truefuse.verify.cases_linear_cross_entropy",
    "truefuse.verify.cases_linear_log_probs",
    "truefuse.verify.cases_token_log_probs",
    "truefuse.verify.cases_scale",
    "truefuse.verify.cases_adamw",
    "truefuse.verify.cases_rope",
    "truefuse.verify.cases_attention",
)


@dataclass(frozen=True)
class Case:
    """One registered contract case.

    Attributes:
        op: the op's stem (``gemm``, ``rms_norm``, ...), what ``--op`` selects.
        name: the case within the op.
        contract: ``"bitwise"`` or ``"bounded"`` (docs/design.md §1).
        fn: runs the case on a device and returns its reports.
        devices: device types the case applies to.
    """

    op: str
    name: str
    contract: str
    fn: CaseFn
    devices: tuple[str, ...] = ("cpu", "cuda")


_CASES: list[Case] = []


def register(op: str, name: str, contract: str, devices: tuple[str, ...] = ("cpu", "cuda")) -> Callable[[CaseFn], CaseFn]:
    """Decorator: register ``fn`` as the case ``op/name`` under ``contract``."""
    if contract not in ("bitwise", "bounded"):
        raise ValueError(f"contract must be 'bitwise' or 'bounded', got {contract!r}")

    def deco(fn: CaseFn) -> CaseFn:
        if any(c.op == op and c.name == name for c in _CASES):
            raise ValueError(f"case {op}/{name} is registered twice")
        _CASES.append(Case(op, name, contract, fn, devices))
        return fn

    return deco


def unregister(*ops: str) -> None:
    """Remove every registered case of ``ops`` (tests register throwaway ops and drop them after)."""
    _CASES[:] = [c for c in _CASES if c.op not in ops]


def all_cases(ops: list[str] | None = None, device: str | None = None) -> list[Case]:
    """Registered cases, optionally only those of ``ops`` and for ``device``'s type."""
    for mod in CASE_MODULES:
        importlib.import_module(mod)
    known = sorted({c.op for c in _CASES})
    if ops:
        unknown = [o for o in ops if o not in known]
        if unknown:
            raise ValueError(f"--op {unknown[0]!r} is not registered; known ops: {', '.join(known)}")
    return [c for c in _CASES if (not ops or c.op in ops) and (device is None or device in c.devices)]
