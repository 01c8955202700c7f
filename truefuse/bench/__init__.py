"""Benchmarks: ``python -m truefuse bench <name>``; each ``bench_<name>.py`` builds a Sweep."""

from __future__ import annotations

import importlib
import sys

import torch

#: benchmark name -> module defining ``sweep(quick: bool) -> Sweep`` (and optionally CUDA_GRAPH)
BENCHES = {
    "gemm": "truefuse.bench.bench_gemm",
    "bi_gemm": "truefuse.bench.bench_bi_gemm",
    "linear": "truefuse.bench.bench_linear",
    "norm": "truefuse.bench.bench_norm",
    "grouped": "truefuse.bench.bench_grouped",
    "linear_cross_entropy": "truefuse.bench.bench_linear_cross_entropy",
    "linear_log_probs": "truefuse.bench.bench_linear_log_probs",
    "attention": "truefuse.bench.bench_attention",
    "adamw": "truefuse.bench.bench_adamw",
    "sibling_linears": "truefuse.bench.bench_sibling_linears",
}


#: older names still accepted (docs, scripts/gpu_check.sh): name -> the benchmark it runs
ALIASES = {"rms_norm": "norm"}

#: distributed benchmarks: name -> module defining ``run(world_size, out_dir, quick) -> int``
DISTRIBUTED_BENCHES = {
    "allreduce_add_rmsnorm": "truefuse.bench.bench_allreduce_add_rmsnorm",
    "tp": "truefuse.bench.bench_tp",
    "tp_linear_cross_entropy": "truefuse.bench.bench_tp_linear_cross_entropy",
}


def run_bench(name: str, providers: list[str] | None, out_dir: str, quick: bool, world_size: int = 0) -> int:
    from truefuse.bench.harness import environment

    name = ALIASES.get(name, name)
    if name in DISTRIBUTED_BENCHES:
        if not world_size:
            print(f"bench: {name} runs on several GPUs: pass --world-size N", file=sys.stderr)
            return 2
        return importlib.import_module(DISTRIBUTED_BENCHES[name]).run(world_size, out_dir, quick)
    if name not in BENCHES:
        print(f"bench: unknown benchmark {name!r}; known: {', '.join([*BENCHES, *DISTRIBUTED_BENCHES])}", file=sys.stderr)
        return 2
    mod = importlib.import_module(BENCHES[name])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        print("bench: no GPU here; timings below are a CPU smoke run, not a measurement", file=sys.stderr)
    sw = mod.sweep(quick or device.type == "cpu")
    try:
        sw.run(device, providers, cuda_graph=getattr(mod, "CUDA_GRAPH", False))
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    paths = sw.save(out_dir, environment())
    sw.print()
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
