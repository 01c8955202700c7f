"""Where a demo-style training step leaves the GPU idle: stock vs ``apply_truefuse`` vs Liger-Kernel,
eager or with compiled layers, on the demo's GPU model (``exp_hf_profile.build``).

A demo step starts from an empty queue and ends in ``loss.item()`` (``truefuse/demo/train.py``): the
time between the step's host start and its last kernel's end that no kernel covers is idle. Each
idle gap is charged to the host phase that launched the kernel after it (``forward`` = the model's
forward and loss, ``backward``, ``optimizer``; a gap before the first kernel is ``ramp``). Prints per
run: step ms, kernel ms, idle ms by phase (means over the profiled steps), and the largest gaps
with the kernels around them.

Run: ``PYTHONPATH=. python experiments/exp_step_gaps.py [--runs truefuse,truefuse+compile,liger]
[--steps 3] [--top 8]`` on one GPU (liger_kernel importable for its run; Liger runs last).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(__file__))
from exp_hf_profile import prepared, release, run_names  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


def _step(model, opt, ids):
    with record_function("phase:forward"):
        loss = model(input_ids=ids, labels=ids).loss
    with record_function("phase:backward"):
        loss.backward()
    with record_function("phase:optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def gaps_of(trace: dict):
    """(idle µs by phase, kernel µs, step µs: each a mean over the trace's steps; every gap
    [(µs, phase, kernel before, kernel after)], largest first)."""
    ev = trace["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("name", "").startswith("phase:") and "dur" in e)
    step_marks = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == "demo_step" and "dur" in e)
    launch_ts = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"], e["args"].get("correlation"))
        for e in ev
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )

    def phase_at(t):
        for a, b, name in spans:
            if a <= t <= b:
                return name.split(":")[1]
        return "other"

    idle = collections.Counter()
    busy = 0.0
    total = 0.0
    gaps = []
    for s0, s1 in step_marks:
        ks = [k for k in kernels if s0 <= launch_ts.get(k[3], k[0]) <= s1]
        if not ks:
            continue
        end = max(k[1] for k in ks)
        total += end - s0
        idle["ramp"] += max(0.0, ks[0][0] - s0)
        reach, prev = ks[0][0], None
        for k in ks:
            busy += max(0.0, k[1] - max(k[0], reach))
            if k[0] > reach and prev is not None:
                ph = phase_at(launch_ts.get(k[3], k[0]))
                idle[ph] += k[0] - reach
                gaps.append((k[0] - reach, ph, prev[:50], k[2][:50]))
            if k[1] > reach:
                reach, prev = k[1], k[2]
    n = max(len(step_marks), 1)
    return {k: v / n for k, v in idle.items()}, busy / n, total / n, sorted(gaps, reverse=True)


def run(name: str, steps: int, warmup: int = 4):
    model, opt, ids = prepared(name, fused=True)  # the demo's optimizer
    for _ in range(warmup):
        _step(model, opt, ids).item()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            with record_function("demo_step"):
                _step(model, opt, ids).item()
                torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(f)
    release(model, opt)
    return gaps_of(trace)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="truefuse,truefuse+compile,stock+compile,liger")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    names = run_names(args.runs)
    cols = ("ramp",) + PHASES + ("other",)
    print(f"{'run':<20}{'step ms':>9}{'kernel ms':>10}" + "".join(f"{'idle ' + c:>15}" for c in cols), flush=True)
    tops = {}
    for n in names:
        idle, busy, total, gaps = run(n, args.steps)
        tops[n] = gaps[: args.top]
        row = f"{n:<20}{total / 1e3:>9.2f}{busy / 1e3:>10.2f}" + "".join(f"{idle.get(c, 0.0) / 1e3:>15.2f}" for c in cols)
        print(row, flush=True)
    for n, gaps in tops.items():
        print(f"\n{n}: largest gaps over {args.steps} steps (µs, launching phase, kernel before -> after)")
        for us, ph, a, b in gaps:
            print(f"  {us:8.1f}  {ph:<9} {a} -> {b}")


if __name__ == "__main__":
    main()
