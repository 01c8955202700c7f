# ruff: noqa: E501, E731, B023
"""Experiment: where each norm's forward + backward time goes, kernel by kernel, against the copy
floor of the same bytes (issue #16 item 3: which kernel keeps 2880, 5120 and LayerNorm under 88%).

Per hidden size, rows and norm (bf16, weight, LayerNorm with bias), each timed alone as ``bench``
times (CUDA graphs of back-to-back calls, median of replays, the library's own launchers):

* ``fwd``: ``ops.norm.norm_fwd`` (the forward kernel), against ``copy_`` of x (read x, write y);
* ``bwd``: ``ops.norm.norm_bwd`` (backward kernel + the partials' sum), against ``add(x, dy)``
  (read x and dy, write dx); ``sum``: ``_sum_partials`` alone on partials of the same shape;
* ``fwd+bwd``: autograd through ``truefuse.rms_norm`` / ``layer_norm``, against copy + add (the
  bench's floor), so ``gap`` = fwd+bwd - fwd - bwd is what the sequence adds or hides.

Run: ``PYTHONPATH=. python experiments/exp_norm_breakdown.py [--out DIR] [--hidden 2880 5120]
[--regs]`` (one H200: about a minute; ``--regs`` prints each compiled kernel's registers and spills).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HIDDEN = (1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384)
ROWS = (8192, 16384)


def gtime(fn, n=10, reps=7):
    """Median µs per call: a CUDA graph of n calls, replayed reps times (the other norm experiments
    time with it too)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n)
    del g
    return statistics.median(ts)


def main():
    import truefuse
    import truefuse.ops.norm.norm as N

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN))
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--regs", action="store_true", help="print each compiled norm kernel's registers and spills")
    args = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    rows = []
    print("norm      M x     H | fwd µs (%copy) | bwd µs (%add) [sum µs] | fwd+bwd µs (%floor) gap µs")
    for h in args.hidden:
        for m in args.rows:
            x = torch.randn(m, h, device=dev, dtype=bf)
            dy = torch.randn(m, h, device=dev, dtype=bf)
            z1, z2 = torch.empty_like(x), torch.empty_like(x)
            t_copy = gtime(lambda: z1.copy_(x))
            t_add = gtime(lambda: torch.add(x, dy, out=z2))
            t_floor = gtime(lambda: (z1.copy_(x), torch.add(x, dy, out=z2)))
            for kind in ("rms", "ln"):
                rms = kind == "rms"
                w = (torch.rand(h, device=dev, dtype=bf) + 0.5).requires_grad_()
                b = None if rms else (0.1 * torch.randn(h, device=dev, dtype=bf)).requires_grad_()
                _, mean, rstd = N.norm_fwd(x, w, b, 1e-5, rms=rms, zero_centered_gamma=False)
                t_fwd = gtime(lambda: N.norm_fwd(x, w, b, 1e-5, rms=rms, zero_centered_gamma=False))
                t_bwd = gtime(lambda: N.norm_bwd(dy, x, w, b, mean, rstd, rms=rms, zero_centered_gamma=False))
                cfg = N.bwd_config(h, rms)
                P = max(1, min(m, cfg.per_sm * torch.cuda.get_device_properties(dev).multi_processor_count))
                part = torch.randn(P, h, device=dev)
                part2 = None if rms else torch.randn(P, h, device=dev)
                t_sum = gtime(lambda: N._sum_partials(part, bf, True, part2, None if rms else bf))
                xr = x.detach().requires_grad_()
                f = truefuse.rms_norm if rms else truefuse.layer_norm
                params = (w,) if rms else (w, b)
                t_all = gtime(lambda: torch.autograd.grad(f(xr, *params, eps=1e-5), (xr, *params), dy))
                r = dict(kind=kind, M=m, H=h, copy_us=t_copy, add_us=t_add, floor_us=t_floor, fwd_us=t_fwd,
                         bwd_us=t_bwd, sum_us=t_sum, all_us=t_all, gap_us=t_all - t_fwd - t_bwd)  # fmt: skip
                rows.append(r)
                print(f"{kind:4s} {m:6d} x {h:5d} | {t_fwd:6.1f} ({t_copy / t_fwd:4.0%}) | {t_bwd:6.1f} ({t_add / t_bwd:4.0%}) "
                      f"[{t_sum:4.1f}] | {t_all:6.1f} ({t_floor / t_all:4.0%}) {r['gap_us']:+5.1f}", flush=True)  # fmt: skip
    with open(os.path.join(args.out, "norm_breakdown.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    if args.regs:
        _print_regs()


def _print_regs():
    """num_warps, registers per thread and spilled bytes of every norm kernel compiled so far."""
    from truefuse.kernels import norm as K

    for name in (
        "_norm_fwd_kernel",
        "_ln_fwd_staged_kernel",
        "_norm_bwd_kernel",
        "_norm_bwd_split_kernel",
        "_norm_bwd_staged_kernel",
    ):
        for cache in getattr(getattr(K, name), "device_caches", {}).values():
            for key, k in (cache[0] if isinstance(cache, tuple) else cache).items():
                k._init_handles()
                print(f"{name:26s} warps {k.metadata.num_warps:2d} regs {k.n_regs:3d} spills {k.n_spills:5d} | {str(key)[-220:]}")


if __name__ == "__main__":
    main()
