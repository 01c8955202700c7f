"""Run registered cases and print the verify table (rich on a terminal, plain rows in a pipe)."""

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


_COLUMNS = ("op", "case", "contract", "max_diff", "frac_nonzero", "error ratio", "result")
_RIGHT = ("max_diff", "frac_nonzero", "error ratio")


def _cells(r: Row) -> tuple[str, ...]:
    """A row's cells before the result column, as both layouts print them."""
    ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
    return (r.op, r.case, r.contract, f"{r.max_diff:.3e}", f"{r.frac_nonzero:.2%}", ratio)


def _summary(rows: list[Row]) -> str:
    n_fail = sum(not r.passed for r in rows)
    return f"{len(rows) - n_fail} passed, {n_fail} failed"


def format_plain(rows: list[Row], device: torch.device) -> list[str]:
    """The table as plain aligned lines (pipes, logs, narrow terminals): one line per row whose
    result column is never cut, a failure's message whole after its FAIL (continuation lines of a
    multi-line message indented), the summary last."""
    cells = [_cells(r) for r in rows]
    widths = [max([len(col)] + [len(c[i]) for c in cells]) for i, col in enumerate(_COLUMNS[:-1])]

    def line(values: tuple[str, ...], result: str) -> str:
        parts = [v.rjust(w) if col in _RIGHT else v.ljust(w) for v, w, col in zip(values, widths, _COLUMNS, strict=False)]
        return "  ".join([*parts, result])

    lines = [f"truefuse verify on {device}", line(_COLUMNS[:-1], _COLUMNS[-1])]
    for r, c in zip(rows, cells, strict=True):
        if r.passed:
            lines.append(line(c, "PASS"))
            continue
        first, *rest = (r.error or "").splitlines() or [""]
        lines.append(line(c, f"FAIL  {first}".rstrip()))
        lines.extend("    " + ln for ln in rest)
    lines.append(_summary(rows))
    return lines


def print_table(rows: list[Row], device: torch.device, console=None) -> None:
    """Print the verify table and the summary line ("N passed, M failed", always the last line).

    Not on a terminal (a pipe, a CI log), or on a terminal narrower than the table: plain aligned
    rows (:func:`format_plain`), never cut. On a terminal wide enough: a rich table whose columns
    are never wrapped, then each failure's message in full, then the summary.
    """
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    if console.is_terminal:
        table = Table(title=f"truefuse verify on {device}")
        for col in _COLUMNS:
            table.add_column(col, justify="right" if col in _RIGHT else "left", no_wrap=True, min_width=len(col))
        for r in rows:
            result = Text("PASS", style="green") if r.passed else Text("FAIL", style="red")
            table.add_row(*_cells(r), result)
        needed = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
        if needed <= console.width:
            console.print(table)
            for r in rows:
                if not r.passed and r.error:
                    console.print(Text(f"FAIL {r.op}/{r.case}: {r.error}", style="red"), soft_wrap=True)
            console.print(_summary(rows), highlight=False)
            return
    # plain text: no markup, no highlighting, no wrapping at the console's width
    console.out("\n".join(format_plain(rows, device)), highlight=False)
