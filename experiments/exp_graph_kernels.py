"""Which kernels does a training step captured in one CUDA graph run longer than the same step
eager? Per kernel, GPU ms a step over two eager steps and two replays of ``graph_step`` under
torch's profiler, the demo's model, one variant at a time (issue 47: a graphed demo step ran slower
than eager; docs/benchmarks.md, "A training step in one CUDA graph").

Run from the repository root, one GPU: ``PYTHONPATH=. python experiments/exp_graph_kernels.py
"truefuse BI,truefuse" [--config demo] [--top 22]`` (variants and config as ``exp_graphs.py``'s)."""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exp_bi_speed as bis  # noqa: E402
import exp_graphs as eg  # noqa: E402
from exp_hf_profile import category  # noqa: E402  (the kinds of docs/benchmarks.md's profile tables)

from truefuse.integrations.cuda_graph import graph_step  # noqa: E402


class _Ctx:  # what exp_graphs.make_step reads
    cuda, device = True, "cuda"


def kernel_ms(fn, ids) -> tuple[collections.Counter, collections.Counter, float]:
    """(GPU ms a step by kernel name, launches a step by name, ms a step by CUDA events)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(ids), fn(ids)
    b.record()
    b.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(ids), fn(ids)
        torch.cuda.synchronize()
    ms, n = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms[e.name[:70]] += e.device_time / 2e3
            n[e.name[:70]] += 0.5
    return ms, n, a.elapsed_time(b) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", help="comma-separated, of exp_graphs.TRAIN_VARIANTS (Liger's reads the host)")
    p.add_argument("--config", default="demo", choices=list(bis.CONFIGS))
    p.add_argument("--top", type=int, default=22)
    args = p.parse_args()
    c = bis.CONFIGS[args.config]
    base = bis.build(c)
    ids = torch.randint(1, c["vocab"], (c["batch"], c["seq"]), generator=torch.Generator().manual_seed(1)).cuda()
    print(f"== {torch.cuda.get_device_name()}, torch {torch.__version__}, config {args.config}")
    for name in args.variants.split(","):
        model, scope = eg.make_model(base, name)
        model.train()
        step, _ = eg.make_step(model, _Ctx)
        graphed = graph_step(step, warmup=2, packed_sequences=False)  # no position_ids fed: never packed
        with scope():
            for _ in range(3):
                step(ids)
            for _ in range(4):
                graphed(ids)
            (te, ne, me), (tg, ng, mg) = kernel_ms(step, ids), kernel_ms(graphed, ids)
        kernels = f"kernels {sum(te.values()):.2f} / {sum(tg.values()):.2f}"
        print(f"-- {name}: eager {me:.2f} ms/step, graphed {mg:.2f} ({kernels})")
        print(f"  {'eager':>8} {'graphed':>8} {'diff':>8}  launches  kernel")
        for k in sorted(set(te) | set(tg), key=lambda k: -abs(tg[k] - te[k]))[: args.top]:
            print(f"  {te[k]:8.2f} {tg[k]:8.2f} {tg[k] - te[k]:+8.2f}  {ne[k]:4.0f}/{ng[k]:<4.0f} {k}")
        ke, kg = collections.Counter(), collections.Counter()
        for src, dst in ((te, ke), (tg, kg)):
            for k, ms in src.items():
                dst[category(k)] += ms
        print(f"  {'eager':>8} {'graphed':>8}  by kind")
        for kind in sorted(set(ke) | set(kg), key=lambda k: -max(ke[k], kg[k])):
            print(f"  {ke[kind]:8.2f} {kg[kind]:8.2f}  {kind}")
        del model, step, graphed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
