"""The demo's results: one summary row per run, the rich table, ``results.json`` and ``demo.png``."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from truefuse.config import get_config
from truefuse.demo.train import DemoResult, RunResult

MEMORY_NOTE_CUDA = "peak memory: torch.cuda.max_memory_allocated over the training steps (model build excluded)"
MEMORY_NOTE_CPU = "peak memory: n/a on the CPU (no per-run allocator peak there; measured on CUDA only)"


def _mean_step_s(run: RunResult, skip: int) -> float:
    return _mean_after(run.step_s, skip)


def _mean_after(times: list[float], skip: int) -> float:
    times = times[min(skip, len(times) - 1) :]
    return sum(times) / len(times)


def verdict(max_diff: float, tol: float) -> str:
    """ "identical" (every step's loss bitwise equal), "within tol", or "DIFFERS"."""
    if max_diff == 0.0:
        return "identical"
    return "within tol" if max_diff <= tol else "DIFFERS"


def summarize(result: DemoResult) -> list[dict]:
    """One dict per run: final loss, distance to stock along the curve, speed, memory, speedup."""
    cfg = result.config
    stock = result.runs[0]
    stock_step = _mean_step_s(stock, cfg.timing_warmup)
    rows = []
    for run in result.runs:
        diffs = [abs(a - b) for a, b in zip(run.losses, stock.losses, strict=True)]
        max_diff = max(diffs) if diffs else math.nan
        step = _mean_step_s(run, cfg.timing_warmup)
        rows.append(
            {
                "run": run.name,
                "final_loss": run.losses[-1],
                "step0_loss": run.losses[0],
                "step0_diff_vs_stock": diffs[0],
                "max_abs_diff_vs_stock": max_diff,
                "verdict": "reference" if run is stock else verdict(max_diff, cfg.tol),
                "mean_step_s": step,
                "median_step_s": statistics.median(run.step_s[min(cfg.timing_warmup, len(run.step_s) - 1) :]),
                "tokens_per_s": cfg.tokens_per_step / step,
                "peak_mem_bytes": max(run.mem_bytes) if run.mem_bytes else None,
                "speedup_vs_stock": stock_step / step,
                "mean_host_s": _mean_after(run.host_s, cfg.timing_warmup) if run.host_s else None,
                "n_params": run.n_params,
                "setup_s": run.setup_s,
                "patch_report": run.patch_report,
            }
        )
    return rows


def memory_note(result: DemoResult) -> str:
    return MEMORY_NOTE_CUDA if result.config.device.startswith("cuda") else MEMORY_NOTE_CPU


def speed_note(result: DemoResult) -> str:
    """Why the CPU's step times say nothing of truefuse's speed: its Triton kernels run on a GPU;
    on the CPU its ops take their reference path, the unfused PyTorch they replace (or, under
    ``TRITON_INTERPRET=1``, Triton's interpreter, slower still). Empty on CUDA."""
    if result.config.device.startswith("cuda"):
        return ""
    if get_config().triton_interpret:
        return "speed: not the point on the CPU, where truefuse's kernels run in Triton's interpreter; the GPU run is"
    return (
        "speed: not the point on the CPU, where truefuse runs its reference path (the unfused PyTorch it replaces; "
        "its Triton kernels need a GPU): the GPU run is (--size gpu)"
    )


def title(result: DemoResult) -> str:
    c = result.config
    tokens = f"{c.batch}x{c.seq}" if c.world_size == 1 else f"{c.world_size}x{c.batch}x{c.seq}"
    dtype = c.dtype
    if c.world_size > 1:
        dtype += f", policy {c.fsdp_policy}" + (", lm_head its own unit" if c.head_unit else "")
    if c.compile_layers:
        dtype += ", decoder layers compiled"
    if c.cuda_graphs:
        dtype += ", steps CUDA-graphed"
    return (
        f"truefuse demo: Llama {c.layers}x{c.hidden} (heads {c.heads}/{c.kv_heads}, vocab {result.model_config['vocab_size']}), "
        f"{tokens} tokens x {c.steps} steps, {dtype} on {result.environment['device']}"
    )


def fsdp_note(result: DemoResult) -> str:
    """What the columns mean over several ranks (empty on one)."""
    n = result.config.world_size
    if n == 1:
        return ""
    return (
        f"FSDP2 on {n} ranks, each on its own {result.config.batch} sequences: loss = mean of the ranks' losses (the same "
        "value on every rank), step ms = the slowest rank's, tokens/s over all ranks, peak GiB = the largest rank's; "
        "host ms = time until the step's last launch returned (close to step ms with few syncs: the GPU waited on the host)"
    )


def print_table(result: DemoResult, rows: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = result.config
    notes = [f"mean step time leaves out the first {cfg.timing_warmup} steps", memory_note(result), speed_note(result)]
    notes.append(fsdp_note(result))
    notes += [f"{r.name} not CUDA-graphed ({r.extra['not_graphed']})" for r in result.runs if r.extra.get("not_graphed")]
    t = Table(title=title(result), caption="; ".join(n for n in notes if n))
    host = cfg.world_size > 1
    cols = ["run", "final loss", "max |Δloss| vs stock", f"curve (tol {cfg.tol:g})", "step ms"]
    cols += ["host ms"] * host + ["tokens/s", "peak GiB", "speedup"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("run",) or col.startswith("curve") else "right")
    for r in rows:
        peak = "n/a" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**30:.2f}"
        cells = [
            r["run"],
            f"{r['final_loss']:.4f}",
            "-" if r["verdict"] == "reference" else f"{r['max_abs_diff_vs_stock']:.2e}",
            r["verdict"],
            f"{r['mean_step_s'] * 1e3:.1f}",
        ]
        if host:
            cells.append("-" if r["mean_host_s"] is None else f"{r['mean_host_s'] * 1e3:.1f}")
        t.add_row(
            *cells,
            f"{r['tokens_per_s']:,.0f}",
            peak,
            f"{r['speedup_vs_stock']:.2f}x",
        )
    console = console or Console()
    console.width = max(console.width, 140)
    console.print(t)


def to_json(result: DemoResult, rows: list[dict]) -> dict:
    by_name = {r["run"]: r for r in rows}
    return {
        "config": asdict(result.config),
        "data": result.data,
        "environment": result.environment,
        "model_config": {k: v for k, v in result.model_config.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "memory_note": memory_note(result),
        "speed_note": speed_note(result),
        "fsdp_note": fsdp_note(result),
        "runs": [
            {
                **by_name[run.name],
                "losses": run.losses,
                "step_s": run.step_s,
                "host_s": run.host_s,
                "mem_bytes": run.mem_bytes,
                **({"extra": run.extra} if run.extra else {}),
            }
            for run in result.runs
        ],
    }


def plot(result: DemoResult, rows: list[dict], path: Path) -> Path:
    """Two panels: every run's loss curve; memory over the steps on CUDA (step time on the CPU, where
    memory is not measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cuda = result.config.device.startswith("cuda")
    fig, (ax_loss, ax_right) = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = ["-", "--", ":", "-."]
    for i, (run, row) in enumerate(zip(result.runs, rows, strict=True)):
        steps = range(len(run.losses))
        label = run.name if i == 0 else f"{run.name} (max |Δ| {row['max_abs_diff_vs_stock']:.1e})"
        ax_loss.plot(steps, run.losses, styles[i % len(styles)], lw=2.4 if i == 0 else 1.5, label=label)
        if cuda and run.mem_bytes:
            ax_right.plot(
                steps,
                [m / 2**30 for m in run.mem_bytes],
                styles[i % len(styles)],
                label=f"{run.name} (peak {max(run.mem_bytes) / 2**30:.2f} GiB)",
            )
        elif not cuda:
            ax_right.plot(
                steps,
                [s * 1e3 for s in run.step_s],
                styles[i % len(styles)],
                label=f"{run.name} ({row['mean_step_s'] * 1e3:.0f} ms mean)",
            )
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss (same init, same batches)")
    if cuda:
        ax_right.set(xlabel="step", ylabel="GiB", title="peak memory allocated per step (CUDA)")
    else:
        ax_right.set(xlabel="step", ylabel="ms", title="step time (memory: n/a on the CPU)")
    for ax in (ax_loss, ax_right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: DemoResult, rows: list[dict], out_dir: str | Path) -> list[Path]:
    """``results.json`` and ``demo.png`` under ``out_dir`` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "results.json"
    jpath.write_text(json.dumps(to_json(result, rows), indent=1) + "\n")
    return [jpath, plot(result, rows, out / "demo.png")]


def print_syncs(result: DemoResult, n: int = 10) -> None:
    """Each run's GPU kernel time a step under ``--profile`` and its host synchronisations in its
    ``--sync-debug`` step (rank 0's), the ``n`` most frequent call sites first (demo/profile.py)."""
    from truefuse.demo.profile import top_syncs

    for run in result.runs:
        prof = run.extra.get("profile", {})
        if "kernel_ms_per_step" in prof:
            kernels, wall = prof["kernel_ms_per_step"], prof["wall_ms_per_step"]
            print(f"{run.name}: profile: GPU kernels {kernels:.1f} ms of {wall:.1f} ms a step (rank 0, under the profiler)")
        if "syncs" not in run.extra:
            continue
        sites = run.extra["syncs"]
        if sites is None:
            print(f"{run.name}: host syncs n/a (counted on CUDA only)")
            continue
        print(f"{run.name}: {sum(sites.values())} host syncs in one step's training work at {len(sites)} call sites (rank 0)")
        for site, count in top_syncs(sites, n):
            print(f"  {count:5d}  {site}")
