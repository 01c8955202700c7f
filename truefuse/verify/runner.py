"""Run registered cases and print the verify table (rich, with progress)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from truefuse.testing import BitwiseReport
from truefuse.verify.registry import Case, Report, all_cases


@dataclass(frozen=True)
class Row:
    op: str
    case: str
    contract: str
    max_diff: float
    frac_nonzero: float
    ratio: float | None
    passed: bool
    error: str = ""


def run_case(case: Case, device: torch.device) -> list[Row]:
    """Run one case; an exception becomes a FAIL row carrying its message (never a crash)."""
    try:
        reports: dict[str, Report] = case.fn(device)
    except Exception as e:  # a crashing case is a failing case, reported, not hidden
        return [Row(case.op, case.name, case.contract, math.nan, math.nan, None, False, f"{type(e).__name__}: {e}")]
    rows = []
    for label, rep in reports.items():
        ratio = None if isinstance(rep, BitwiseReport) else rep.ratio
        name = case.name if label == "" else f"{case.name}/{label}"
        rows.append(Row(case.op, name, case.contract, rep.max_diff, rep.frac_nonzero, ratio, rep.passed))
    return rows


def verify(device: torch.device, ops: list[str] | None = None, quiet: bool = False) -> list[Row]:
    """Run every registered case for ``device`` (restricted to ``ops``), with a progress bar."""
    from rich.progress import Progress

    cases = all_cases(ops, device.type)
    rows: list[Row] = []
    with Progress(transient=True, disable=quiet) as progress:
        task = progress.add_task(f"verify on {device}", total=len(cases))
        for case in cases:
            progress.update(task, description=f"{case.op}/{case.name}")
            rows.extend(run_case(case, device))
            progress.advance(task)
    return rows


def print_table(rows: list[Row], device: torch.device) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"truefuse verify on {device}")
    for col in ("op", "case", "contract", "max_diff", "frac_nonzero", "error ratio", "result"):
        table.add_column(
            col,
            justify="right" if col in ("max_diff", "frac_nonzero", "error ratio") else "left",
            no_wrap=col != "result",
        )
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        result = "[green]PASS[/]" if r.passed else f"[red]FAIL[/] {escape(r.error)}"
        table.add_row(r.op, r.case, r.contract, f"{r.max_diff:.3e}", f"{r.frac_nonzero:.2%}", ratio, result)
    console = Console()
    # a pipe or CI log has no width; never truncate the case names there
    console.width = max(console.width, 150)
    console.print(table)
    n_fail = sum(not r.passed for r in rows)
    console.print(f"{len(rows) - n_fail} passed, {n_fail} failed")
