# ruff: noqa: E501, B023
"""Experiment: when each norm kernel should let the next one's programs launch under programmatic
dependent launch (issue #16 item 3; ``ops/norm/norm_config.py::pdl_trigger``).

Since the backward no longer waits on autograd's zero-fills of mean and rstd (commit c2810a5), the
backward is PDL-launched straight after the forward. With the trigger at the forward's start, the
backward's programs are launched at once and wait in place, holding SM slots while the forward
runs; LayerNorm at 16384 measured 8% slower in the bench after that change, every other size
1-6 µs faster. Variants, timed side by side (interleaved rounds, CUDA graphs as in ``bench
rms_norm``): ``start`` (today: every kernel triggers at its start), ``fwd_exit`` (the forward
lets the backward launch only as its programs exit), ``bwd_exit`` (the same for the backward ->
the sum), and ``chosen`` (``ops.norm_config.pdl_trigger`` as committed). Each variant's dx / dw / db
must be the bits of ``start`` (the trigger moves the schedule, never the math).

Result (2026-11-23, one H200, torch 2.11.0+cu130, triton 3.6.0, 3 interleaved rounds, 27 s; the
three fixed variants): the bits never differ. ``fwd_exit`` gives LayerNorm at 16384 back what the
early launch cost: 606 -> 563 µs at 8192 rows, 1178 -> 1096 µs at 16384 (52 -> 56%, 64 -> 69% of
the floor); elsewhere it is within -0.3 / +0.6 µs of ``start``. ``bwd_exit`` is 0.5-1.4 µs faster
for RMSNorm from 2048 to 8192 (8192 x 2048: 49.1 -> 48.0 µs, 88 -> 90%), mixed (±1 µs) for
LayerNorm. ``pdl_trigger`` takes those two and nothing else.

Run: ``PYTHONPATH=. python experiments/exp_norm_pdl_trigger.py [--out DIR] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exp_norm_breakdown import gtime  # noqa: E402

import truefuse  # noqa: E402
import truefuse.ops.norm.norm as ops_norm  # noqa: E402

HIDDEN = (1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384)
ROWS = (8192, 16384)
CHOSEN = ops_norm.pdl_trigger
VARIANTS = {
    "start": lambda kernel, n, rms: 1,
    "fwd_exit": lambda kernel, n, rms: 2 if kernel == "fwd" else 1,
    "bwd_exit": lambda kernel, n, rms: 2 if kernel == "bwd" else 1,
    "chosen": CHOSEN,
}


def _case(kind, m, h):
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(m + h)
    x = torch.randn(m, h, device=dev, dtype=bf, generator=g).requires_grad_()
    dy = torch.randn(m, h, device=dev, dtype=bf, generator=g)
    w = (torch.rand(h, device=dev, dtype=bf, generator=g) + 0.5).requires_grad_()
    if kind == "rms":
        params = (w,)
        norm = lambda: truefuse.rms_norm(x, w, 1e-5)
    else:
        b = (0.1 * torch.randn(h, device=dev, dtype=bf, generator=g)).requires_grad_()
        params = (w, b)
        norm = lambda: truefuse.layer_norm(x, w, b, 1e-5)
    return lambda: torch.autograd.grad(norm(), (x, *params), dy), (x, dy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    t0 = time.time()
    rows, bad = [], []
    for h in HIDDEN:
        for m in ROWS:
            for kind in ("rms", "ln"):
                fn, (x, dy) = _case(kind, m, h)
                z1, z2 = torch.empty_like(dy), torch.empty_like(dy)
                floor = gtime(lambda: (z1.copy_(x.detach()), torch.add(x.detach(), dy, out=z2)))
                ref, times = None, {v: [] for v in VARIANTS}
                for v, mode in VARIANTS.items():  # compile + bits
                    ops_norm.pdl_trigger = mode
                    got = fn()
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = [t.clone() for t in got]
                    elif not all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)):
                        bad.append((kind, m, h, v))
                for _ in range(args.rounds):
                    for v, mode in VARIANTS.items():
                        ops_norm.pdl_trigger = mode
                        times[v].append(gtime(fn))
                med = {v: statistics.median(t) for v, t in times.items()}
                row = {"kind": kind, "M": m, "H": h, "floor_us": floor, **{f"{v}_us": t for v, t in med.items()}}
                rows.append(row)
                print(f"{kind:3s} {m:5d} x {h:5d} | floor {floor:7.1f} | "
                      + " | ".join(f"{v} {t:7.1f} ({floor / t:4.0%})" for v, t in med.items()), flush=True)  # fmt: skip
    ops_norm.pdl_trigger = CHOSEN
    with open(os.path.join(args.out, "norm_pdl_trigger.json"), "w") as f:
        json.dump({"rows": rows, "bits_differ": bad, "torch": torch.__version__}, f, indent=1)
    print(f"bits differ: {bad or 'none'}; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
