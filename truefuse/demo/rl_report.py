"""``python -m truefuse rl``'s results: one summary row per run, the rich table, ``rl.json`` and
``rl.png`` (docs/rl.md)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from truefuse.demo.rl import RLResult, RunRecord


def _mean_after(values: list[float], skip: int) -> float:
    values = values[min(skip, len(values) - 1) :]
    return sum(values) / len(values)


def first_divergence(run: RunRecord, stock: RunRecord) -> int | None:
    """The first step whose sampled completions differ from stock's (None: none does). The runs
    draw the same random numbers, so they sample the same tokens until their logits part."""
    for i, (a, b) in enumerate(zip(run.samples_sha256, stock.samples_sha256, strict=True)):
        if a != b:
            return i
    return None


def summarize(result: RLResult) -> list[dict]:
    """One dict per run: rewards, the sampler-trainer gap, speed."""
    cfg = result.config
    stock = next((r for r in result.runs if r.name == "stock"), result.runs[0])
    rows = []
    for run in result.runs:
        step = _mean_after(run.step_s, cfg.timing_warmup)
        tokens = _mean_after([float(t) for t in run.tokens], cfg.timing_warmup)
        rows.append(
            {
                "run": run.name,
                "first_reward": run.reward[0],
                "final_reward": run.reward[-1],
                "mean_reward": sum(run.reward) / len(run.reward),
                "max_gap": max(run.gap),
                "steps_with_gap": sum(g != 0 for g in run.gap),
                "tokens_differing": sum(run.differing),
                "tokens": sum(run.tokens),
                "samples_differ_from_step": None if run is stock else first_divergence(run, stock),
                "mean_step_s": step,
                "mean_generate_s": _mean_after(run.generate_s, cfg.timing_warmup),
                "mean_train_s": _mean_after(run.train_s, cfg.timing_warmup),
                "tokens_per_s": tokens / step,
                "params_sha256": run.params_sha256,
                "patch_report": run.patch_report,
            }
        )
    return rows


def title(result: RLResult) -> str:
    c = result.config
    return (
        f"truefuse rl: GRPO, Llama {c.layers}x{c.hidden} (heads {c.heads}/{c.kv_heads}), {c.digits}-digit addition, "
        f"{c.prompts} prompts x {c.group} completions x {c.steps} steps, T={c.temperature:g}, {c.dtype} on "
        f"{result.environment['device']}"
    )


def caption(result: RLResult) -> str:
    c = result.config
    notes = [
        "runs timed one after the other (not interleaved), from the same weights and seeds",
        "gap: max |trainer - sampler| log-prob of the completion tokens before each update "
        "(sampler: token_log_probs of generate's logits; trainer: model_log_probs)",
        f"step ms and tokens/s (completion tokens) leave out the first {c.timing_warmup} steps",
    ]
    if not c.device.startswith("cuda"):
        notes.append("speed: on the CPU truefuse runs its reference path (its Triton kernels need a GPU): --device cuda")
    return "; ".join(notes)


def _gap(value: float) -> str:
    return "0 (bitwise)" if value == 0 else f"{value:.2e}"


def print_table(result: RLResult, rows: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title(result), caption=caption(result))
    cols = ["run", "first reward", "final reward", "mean reward", "max gap", "tokens differing"]
    cols += ["samples = stock's", "step ms", "generate ms", "train ms", "tokens/s"]
    for col in cols:
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        div = r["samples_differ_from_step"]
        same = "-" if r["run"] == "stock" else ("every step" if div is None else f"until step {div}")
        t.add_row(
            r["run"],
            f"{r['first_reward']:.3f}",
            f"{r['final_reward']:.3f}",
            f"{r['mean_reward']:.3f}",
            _gap(r["max_gap"]),
            f"{r['tokens_differing']:,} / {r['tokens']:,}",
            same,
            f"{r['mean_step_s'] * 1e3:.1f}",
            f"{r['mean_generate_s'] * 1e3:.1f}",
            f"{r['mean_train_s'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}",
        )
    console = console or Console()
    console.width = max(console.width, 150)
    console.print(t)


def to_json(result: RLResult, rows: list[dict]) -> dict:
    by_name = {r["run"]: r for r in rows}
    return {
        "config": asdict(result.config),
        "environment": result.environment,
        "model_config": {k: v for k, v in result.model_config.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "caption": caption(result),
        "runs": [{**by_name[run.name], "steps": asdict(run)} for run in result.runs],
    }


def plot(result: RLResult, path: Path) -> Path:
    """Two panels: each run's mean reward per step; each run's sampler-trainer gap per step on a
    symlog axis (so that 0, the batch-invariant run's, sits on the axis next to stock's 1e-7s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_g) = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = ["-", "--", ":", "-."]
    gaps = [g for run in result.runs for g in run.gap if g > 0]
    for i, run in enumerate(result.runs):
        steps = range(len(run.reward))
        ax_r.plot(steps, run.reward, styles[i % 4], lw=2.4 if i == 0 else 1.5, label=run.name)
        ax_g.plot(steps, run.gap, styles[i % 4], marker=".", lw=1.5, label=f"{run.name} (max {_gap(max(run.gap))})")
    ax_r.set(xlabel="step", ylabel="mean reward", title="reward (same weights, prompts and sampling seeds)", ylim=(0, 1))
    # linear within the smallest gap seen (or 1e-8): a run whose gap is 0 on every step reads as 0
    ax_g.set_yscale("symlog", linthresh=min(gaps) if gaps else 1e-8)
    ax_g.set_ylim(0, 10 * max(gaps) if gaps else 1e-6)  # a gap is never negative
    ax_g.set(xlabel="step", ylabel="max |trainer - sampler| log-prob", title="sampler-trainer gap before each update")
    for ax in (ax_r, ax_g):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: RLResult, rows: list[dict], out_dir: str | Path) -> list[Path]:
    """``rl.json`` and ``rl.png`` under ``out_dir`` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "rl.json"
    jpath.write_text(json.dumps(to_json(result, rows), indent=1, allow_nan=False) + "\n")
    return [jpath, plot(result, out / "rl.png")]


def bi_exact(rows: list[dict]) -> bool:
    """Whether the batch-invariant run's sampler and trainer agreed bit for bit on every step."""
    bi = [r for r in rows if r["run"] == "truefuse BI"]
    return bool(bi) and all(r["max_gap"] == 0 for r in bi)
