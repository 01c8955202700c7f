"""The one timing harness (docs/design.md §7). Every single-process benchmark measures through
:func:`measure` (a :class:`Sweep`); the distributed ones (``bench tp``, ``tp_linear_cross_entropy``,
``allreduce_add_rmsnorm``) start their ranks with :func:`launch_ranks` and time with
:func:`measure_ranks` (fixed step counts, interleaved rounds) or :func:`graph_us` (CUDA-graph
replays), writing JSON with :func:`save_rows`.

* time: ``triton.testing.do_bench`` median after warm-up on CUDA, optionally over a CUDA graph
  replay (``do_bench_cudagraph``) for microsecond ops; on the CPU a wall-clock median (a smoke
  run: speed is only reported from the GPU machine);
* memory: peak ``torch.cuda.max_memory_allocated`` during one call, above a baseline taken after
  the inputs exist;
* results: one JSON row per (point, provider), a PNG per sweep, and a table with each provider's
  ratio to the sweep's reference provider measured in the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Measurement:
    ms: float
    peak_mb: float | None


def measure(
    fn: Callable[[], object], device: torch.device, *, cuda_graph: bool = False, warmup_ms: int = 25, rep_ms: int = 100
) -> Measurement:
    """Median time of ``fn()`` and its peak memory above what was allocated before it ran."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return Measurement(statistics.median(times), None)

    import triton.testing

    torch.cuda.synchronize()
    fn()  # compile / autotune outside the memory and time measurements
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    if cuda_graph:
        with torch.cuda.stream(torch.cuda.Stream()):
            ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    else:
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return Measurement(float(ms), peak)


@dataclass
class Sweep:
    """A benchmark: points (dicts of parameters) × providers, one reference provider for ratios.

    Attributes:
        name: file stem of the results (``<name>.json``, ``<name>.png``).
        points: the parameter dicts, e.g. ``{"M": 8192, "N": 4096, "K": 4096}``.
        providers: name -> ``make(point, device) -> fn``; ``make`` builds the inputs (outside the
            timing and memory baseline) and returns the zero-argument call to time.
        reference: the provider every ratio is taken against.
        x: the point key plotted on the x axis.
        flops: optional ``point -> FLOPs`` to report TFLOP/s.
        bytes: optional ``point -> bytes moved`` (the op's minimal traffic) to report GB/s.
        rounds: interleaved measurement rounds per point on a GPU (the median is kept).
        accuracy: optional ``(point, provider, device) -> {column: value}``, called once per point
            and provider after the timing (outside it): error columns for the row, named
            ``err_*`` (printed), e.g. against a float64 reference; ``{}`` where it does not apply.
    """

    name: str
    points: Sequence[dict]
    providers: dict[str, Callable[[dict, torch.device], Callable[[], object]]]
    reference: str
    x: str
    flops: Callable[[dict], float] | None = None
    bytes: Callable[[dict], float] | None = None
    rounds: int = 3
    accuracy: Callable[[dict, str, torch.device], dict] | None = None
    rows: list[dict] = field(default_factory=list)

    def run(self, device: torch.device, providers: Sequence[str] | None = None, cuda_graph: bool = False) -> list[dict]:
        names = list(self.providers) if not providers else list(providers)
        unknown = [p for p in names if p not in self.providers]
        if unknown:
            raise ValueError(f"--providers: unknown {unknown}; known: {list(self.providers)}")
        if self.reference not in names:
            names.insert(0, self.reference)
        from rich.progress import track

        for point in track(self.points, description=self.name, transient=True):
            # Providers are measured in interleaved rounds, the order reversed every other round,
            # and each keeps the median of its rounds: clock and thermal drift within a run
            # (seen on the H200: the same bf16 GEMM 340 then 381 us minutes apart) then hits
            # every provider alike instead of whichever ran last.
            per: dict[str, list[Measurement]] = {p: [] for p in names}
            for r in range(self.rounds if device.type == "cuda" else 1):
                for prov in names if r % 2 == 0 else names[::-1]:
                    fn = self.providers[prov](point, device)
                    per[prov].append(measure(fn, device, cuda_graph=cuda_graph))
                    del fn
            ref_ms = statistics.median(m.ms for m in per[self.reference])
            for prov in names:
                ms = statistics.median(m.ms for m in per[prov])
                peak = per[prov][0].peak_mb
                row = {
                    **point,
                    "provider": prov,
                    "ms": ms,
                    "peak_mb": peak,
                    "ratio": ms / ref_ms,
                    "rounds_ms": [m.ms for m in per[prov]],
                }
                if self.flops is not None and self.flops(point):
                    row["tflops"] = self.flops(point) / (ms * 1e-3) / 1e12
                if self.bytes is not None and self.bytes(point):
                    row["gbps"] = self.bytes(point) / (ms * 1e-3) / 1e9
                if self.accuracy is not None:
                    row.update(self.accuracy(point, prov, device))
                self.rows.append(row)
        return self.rows

    def save(self, out_dir: str | Path, meta: dict) -> list[Path]:
        """Write ``<name>.json`` (meta + rows) and ``<name>.png`` (time and memory per provider)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        jpath = out / f"{self.name}.json"
        jpath.write_text(json.dumps({"meta": meta, "rows": self.rows}, indent=1))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for prov in dict.fromkeys(r["provider"] for r in self.rows):
            rs = [r for r in self.rows if r["provider"] == prov]
            xs = [r[self.x] for r in rs]
            axes[0].plot(xs, [r["ms"] for r in rs], marker="o", label=prov)
            if all(r["peak_mb"] is not None for r in rs):
                axes[1].plot(xs, [r["peak_mb"] for r in rs], marker="o", label=prov)
        axes[0].set(xlabel=self.x, ylabel="median ms", title=f"{self.name}: time")
        axes[1].set(xlabel=self.x, ylabel="peak MiB above inputs", title=f"{self.name}: memory")
        for ax in axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        ppath = out / f"{self.name}.png"
        fig.savefig(ppath, dpi=110)
        plt.close(fig)
        return [jpath, ppath]

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table

        keys = list(dict.fromkeys(k for p in self.points for k in p))
        extra = list(dict.fromkeys(k for r in self.rows for k in r if k.startswith("err_")))  # accuracy's columns
        t = Table(title=f"{self.name} (ratio: time / {self.reference}, same run)")
        for k in [*keys, "provider", "ms", "ratio", "peak MiB", "TFLOP/s", "GB/s", *extra]:
            t.add_column(k, justify="right")
        for r in self.rows:
            t.add_row(
                *[str(r.get(k, "")) for k in keys],
                r["provider"],
                f"{r['ms']:.4f}",
                "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
                "-" if r["peak_mb"] is None else f"{r['peak_mb']:.1f}",
                f"{r['tflops']:.0f}" if "tflops" in r else "-",
                f"{r['gbps']:.0f}" if "gbps" in r else "-",
                *[f"{r[k]:.3g}" if r.get(k) is not None else "-" for k in extra],
            )
        console = Console()
        console.width = max(console.width, 150)
        console.print(t)


def environment() -> dict:
    """Versions and device of this run, stored with every result file."""
    import datetime

    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    meta["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return meta


# --- across ranks: ``bench tp``, ``bench tp_linear_cross_entropy``, ``bench allreduce_add_rmsnorm`` ---

#: fixed counts on every rank (each call has collectives: no adaptive repetition): warm-up steps,
#: interleaved rounds, steps per round
RANK_WARMUP, RANK_ROUNDS, RANK_STEPS = 3, 5, 10
#: CUDA-graph timing of microsecond collectives: calls captured in one graph, replays per timing
GRAPH_CALLS, GRAPH_REPLAYS = 10, 20


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_steps(step: Callable[[], object], dev: torch.device, n: int) -> float:
    """ms per step over ``n`` steps, after a barrier (every rank starts together)."""
    import torch.distributed as dist

    dist.barrier()
    _sync(dev)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - t0) * 1e3 / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def measure_ranks(steps: dict, dev: torch.device, clear: Callable[[], None] | None = None) -> tuple[dict, dict]:
    """Every rank times ``steps`` (name -> step) the same way: warm-up, then interleaved rounds with
    the order reversed every other round; and one step's peak memory above what was allocated
    before it (after ``clear()``, which frees what a previous step left, e.g. returned gradients).
    Returns ({name: ms per step of each round}, {name: peak MiB or None off CUDA})."""
    import torch.distributed as dist

    for step in steps.values():
        for _ in range(RANK_WARMUP):
            step()
    names = list(steps)
    rounds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(RANK_ROUNDS):
        for n in names if r % 2 == 0 else reversed(names):
            rounds[n].append(time_steps(steps[n], dev, RANK_STEPS))
    peak: dict = {}
    for n, step in steps.items():
        peak[n] = None
        if dev.type == "cuda":
            if clear is not None:
                clear()
            _sync(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            step()
            _sync(dev)
            peak[n] = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
        dist.barrier()
    return rounds, peak


def graph_us(fn: Callable[[], object]) -> float:
    """µs per call of ``fn`` on this rank: ``GRAPH_CALLS`` calls captured in one CUDA graph (after 3
    eager ones), replayed ``GRAPH_REPLAYS`` times after a barrier, the median of 5 such timings.
    Every rank runs the same collectives."""
    import torch.distributed as dist

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    times = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(GRAPH_REPLAYS):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (GRAPH_CALLS * GRAPH_REPLAYS))
    return statistics.median(times)


def launch_ranks(world_size: int, quick: bool, worker, shapes: tuple[dict, dict, dict | None]) -> tuple | None:
    """``worker(rank, world_size, shape, device)`` on ``world_size`` local processes: NCCL on as many
    GPUs; without them, with ``quick`` and a CPU shape, a gloo smoke run on the CPU. ``shapes``:
    (full, quick, CPU smoke or None: GPUs only). Returns (every rank's result in rank order, the
    shape, whether on GPUs), or None after printing why not (fewer GPUs than ranks)."""
    import os

    from truefuse.distributed.launch import run_local

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # docs/design.md §8: never NVLink multicast
    on_gpu = torch.cuda.device_count() >= world_size
    full, small, cpu = shapes
    if not on_gpu and (not quick or cpu is None):
        hint = "" if cpu is None else " (--quick runs a CPU smoke run over gloo)"
        print(f"bench: --world-size {world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}{hint}")
        return None
    shape = (small if quick else full) if on_gpu else cpu
    if not on_gpu:
        print("bench: no GPUs here; a CPU smoke run over gloo, not a measurement")
    per_rank = run_local(world_size, worker, shape, "cuda" if on_gpu else "cpu", backend="nccl" if on_gpu else "gloo")
    return per_rank, shape, on_gpu


def slowest_rank(per_rank: list[list[dict]], rank0_only=()) -> list[dict]:
    """Rank 0's rows, each with ``ms`` the slowest rank's (a step is as slow as its slowest rank;
    rank 0's for the providers in ``rank0_only``) and ``ms_rank0``."""
    rows = per_rank[0]
    for i, r in enumerate(rows):
        r["ms_rank0"] = r["ms"]
        if r["provider"] not in rank0_only:
            r["ms"] = max(pr[i]["ms"] for pr in per_rank)
    return rows


def save_rows(out_dir: str, stem: str, rows: list[dict], **meta) -> Path:
    """``<out_dir>/<stem>.json``: the environment, ``meta`` and the rows."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    out = path / f"{stem}.json"
    out.write_text(json.dumps({"meta": {**environment(), **meta}, "rows": rows}, indent=1))
    return out
