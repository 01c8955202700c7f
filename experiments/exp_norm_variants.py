# ruff: noqa: E501, E731, B023
"""Experiment: the norm kernels' variants that the configuration sweep (exp_norm_sweep.py) could not
reach, at every hidden size of issue #16 item 3 (bf16, M in {8192, 16384}).

* The backward with the row in two column parts (``_norm_bwd_split_kernel``): 2880 = 2048 + 1024,
  5120 = 4096 + 1024 (less padding than 4096 / 8192), 16384 = 8192 + 8192 (when measured, also
  with the second pass reloading x and dy: see the result below).
* Programmatic dependent launch (PDL) on the forward, backward and partial-sum kernels: each grid
  launches while the previous drains (the kernel boundaries are what small sizes lose).

Every run is checked (outputs poisoned first) against an fp32 torch reference (relative L2 < 1e-2),
each backward for batch invariance (the rows of a 37-row and a 1-row call). Then one
configuration per hidden size is chosen (never per row count) and the whole forward + backward +
partial sums is timed, old (the configurations before this experiment: exp_norm_sweep.py), new and
new + PDL, against the copy floor.

Run: ``PYTHONPATH=. python experiments/exp_norm_variants.py [--out DIR] [--quick]``.

Result (2026-11-23, one H200, torch 2.11, triton 3.6; 40 s): the one-pass LayerNorm forward is as
accurate as two passes (bf16, |mean| / std up to 1000 and an outlier column: the same error as
F.layer_norm to 4 digits) but 2-20% slower at every hidden size (a tie at 8192): the second
reduction is not what the LayerNorm forward waits on. Two column parts for 2880 / 5120 / 7168:
1-8% slower than the padded tile. Two halves with the reload at 16384: RMSNorm 65 -> 68% of the
backward's copy rate, LayerNorm 42 -> 44%. PDL: 0.3-2.3 µs per forward + backward (1024 x 8192
RMSNorm: 79.6 -> 82.1% of the floor). ops/norm.py took the last two. The one-pass forward was
measured at commit 7b9ec5b (its kernel code lives there), then removed; the reload likewise at
cbdf501 (ops/norm.py no longer takes it: exp_norm_resweep.py), so the 16384 variants here are the
two halves with and without prefetch.
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
from exp_norm_sweep import HS, MS, bwd_grid, check_bwd, gtime, npow2, open_log, reference, rel, seq_buffers  # noqa: E402

INF = float("inf")
SUM_OLD = {True: (256, 16, 8), False: (128, 16, 4)}  # sum_config: n <= 4096, else


# ---------------------------------------------------------------------------------------------
# configurations


def old_fwd(h):
    from truefuse.ops.norm_config import block_and_warps, fwd_programs_per_sm

    return (block_and_warps(h)[1], fwd_programs_per_sm(h), 0)


def old_bwd(h, kind):
    """ops.norm_config.bwd_config before this experiment (exp_norm_sweep.py's choice): the tile kernel."""
    w, rows, k, pre = (
        (4, 2, 4, True) if h <= 1024 else (8, 2, 2, True) if h <= 2048 else (8, 1, 2, True) if h <= 4096
        else ((32 if kind == "rms" else 16), 1, 1, True) if h <= 8192 else (16, 1, 1, False)
    )  # fmt: skip
    return ("tile", w, rows, k, pre, 0, 0)


def bwd_cfgs(h, kind):
    """("tile", warps, rows, per-SM, prefetch, 0, 0) or ("split", warps, 1, per-SM, prefetch, A, B)."""
    out = [old_bwd(h, kind)]
    parts = {2880: (2048, 1024), 5120: (4096, 1024), 7168: (4096, 4096), 16384: (8192, 8192)}.get(h)
    if parts is None:
        return out
    if h == 16384:
        for w in (16, 32):
            for k in (1, 2):
                for pre in (False, True):
                    out.append(("split", w, 1, k, pre, *parts))
    else:
        ws = (4, 8) if h == 2880 else (8, 16)
        ks = (2, 4) if h == 2880 else (1, 2)
        for w in ws:
            for k in ks:
                out.append(("split", w, 1, k, True, *parts))
    return out


# ---------------------------------------------------------------------------------------------
# launches


def launch_fwd(kind, cfg, x, w, b, y, mean, rstd, sms, pdl=False):
    from truefuse.kernels.norm import _norm_fwd_kernel

    M, N = x.shape
    warps, k, wb = cfg  # wb: the kernel's WB (exp_norm_sums.py), or 0 for its default
    grid = min(M, k * sms) if k else M
    kw = {"launch_pdl": True} if pdl else {}
    _norm_fwd_kernel[(grid,)](
        x, w, b if kind == "ln" else x, y, mean if kind == "ln" else rstd, rstd, x.stride(0), y.stride(0), N, 1e-5,
        IS_RMS=kind == "rms", HAS_W=True, HAS_B=kind == "ln", ZERO_CENTERED=False, BLOCK_N=npow2(N),
        M=M, PERSISTENT=bool(k), PDL=pdl, WB=wb or "reg", num_warps=warps, **kw,
    )  # fmt: skip


def launch_bwd(kind, cfg, dy, x, w, mean, rstd, dx, dw_part, db_part, sms, pdl=False):
    from truefuse.kernels.norm import _norm_bwd_kernel, _norm_bwd_split_kernel

    M, N = x.shape
    which, warps, rows, k, pre, a, b = cfg
    programs, rpp = bwd_grid(M, rows, k, sms)
    kw = {"launch_pdl": True} if pdl else {}
    args = (dy, x, w, mean if kind == "ln" else rstd, rstd, dx, dw_part, db_part if kind == "ln" else rstd,
            dy.stride(0), x.stride(0), dx.stride(0), M, N, rpp)  # fmt: skip
    common = dict(
        IS_RMS=kind == "rms", HAS_W=True, HAS_B=kind == "ln", ZERO_CENTERED=False, PREFETCH=pre, PDL=pdl, num_warps=warps, **kw
    )
    if which == "tile":
        _norm_bwd_kernel[(programs,)](*args, BLOCK_N=npow2(N), ROWS=rows, **common)
    else:
        _norm_bwd_split_kernel[(programs,)](*args, BLOCK_A=a, BLOCK_B=b, **common)
    return programs


def launch_sum(cfg, part, out, P, pdl=False, part2=None, out2=None):
    """out = the column sums of part (and out2 of part2, in the same launch)."""
    from truefuse.kernels.norm import _sum_partials_kernel

    bp, bn, warps = cfg
    N = part.shape[1]
    kw = {"launch_pdl": True} if pdl else {}
    two = part2 is not None
    _sum_partials_kernel[(-(-N // bn),)](
        part, out, part2 if two else part, out2 if two else out, P, N, BLOCK_P=bp, BLOCK_N=bn, TWO=two, PDL=pdl,
        num_warps=warps, **kw,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# compile workers (the same launches as the timed runs: the same cache keys)


def add_jobs(jobs, op, kind, h, cfgs, pdls):
    """Append a compile job per distinct kernel and PDL flag (configurations that differ only in
    programs per SM, a launch argument, share one)."""
    seen = set()
    for c in cfgs:
        key = (c[0], bool(c[1]), c[2]) if op == "fwd" else c[:3] + c[4:]
        if key not in seen:
            seen.add(key)
            jobs.extend((op, kind, h, c, pdl) for pdl in pdls)


def _jobs(hs):
    jobs = []
    for h in hs:
        for kind in ("rms", "ln"):
            add_jobs(jobs, "fwd", kind, h, [old_fwd(h)], (False, True))
            add_jobs(jobs, "bwd", kind, h, bwd_cfgs(h, kind), (False, True))
            for sc in SUM_OLD.values():
                jobs.append(("sum", "-", h, sc, False))
                jobs.append(("sum", "-", h, sc, True))
    return jobs


def _worker(jobs, module="exp_norm_variants"):
    """Compile (by running at 64 rows) each job with ``module``'s launch_fwd / launch_bwd /
    launch_sum (this file's, or another experiment's with the same signatures; a sum job of kind
    "ln" sums two partials in one launch)."""
    import importlib

    mod = importlib.import_module(module)
    dev = torch.device("cuda")
    errs = []
    for op, kind, h, cfg, pdl in jobs:
        try:
            M = 64
            x = torch.randn(M, h, device=dev, dtype=torch.bfloat16)
            w = torch.randn(h, device=dev, dtype=torch.bfloat16)
            f32 = lambda *s: torch.empty(*s, device=dev, dtype=torch.float32)
            if op == "fwd":
                mod.launch_fwd(kind, cfg, x, w, w.clone(), torch.empty_like(x), f32(M), f32(M), 2, pdl)
            elif op == "bwd":
                mod.launch_bwd(kind, cfg, x.clone(), x, w, f32(M).zero_(), f32(M).fill_(1), torch.empty_like(x),
                               f32(64, h), f32(64, h), 2, pdl)  # fmt: skip
            else:
                part, out = f32(64, h).zero_(), torch.empty(h, device=dev, dtype=torch.bfloat16)
                mod.launch_sum(cfg, part, out, 64, pdl, *((part, out.clone()) if kind == "ln" else ()))
        except Exception as e:  # noqa: BLE001  (reported; the main process tries again)
            errs.append(f"{op} {kind} {h} {cfg} pdl={pdl}: {type(e).__name__}: {str(e)[:300]}")
    torch.cuda.synchronize()
    return len(jobs), errs


def precompile(hs, workers, say, jobs=None, module="exp_norm_variants"):
    """Compile ``jobs`` (default: this file's, for ``hs``) in ``workers`` spawned processes."""
    import concurrent.futures as cf
    import functools
    import multiprocessing as mp

    jobs = _jobs(hs) if jobs is None else jobs
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        res = list(ex.map(functools.partial(_worker, module=module), [jobs[i::workers] for i in range(workers)]))
    errs = [e for r in res for e in r[1]]
    say(f"precompiled {len(jobs)} kernels in {time.time() - t0:.1f} s ({len(errs)} errors)")
    for e in errs[:12]:
        say("  compile error: " + e)


# ---------------------------------------------------------------------------------------------


def close_out(say, bad, passed, payload, path, t_start):
    """The run's last lines: the failed checks (or ``passed``: what all checks held), the JSON of
    ``payload`` at ``path``, the total time."""
    say("\n" + ("FAILED CHECKS:\n  " + "\n  ".join(bad) if bad else "all checks passed (" + passed + ")"))
    with open(path, "w") as f:
        json.dump(payload, f, indent=0)
    say(f"total {time.time() - t_start:.0f} s")


def floor_inputs(h, m):
    """x and dy (bf16, (m, h), seeded by the shape), their generator (for w and b), and the floor's
    µs: (copy_ of x, add of x and dy, both in one graph)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(h + m)
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(m, h, device=dev, dtype=torch.bfloat16, generator=g)
    z1, z2 = torch.empty_like(x), torch.empty_like(x)
    tc, ta = gtime(lambda: z1.copy_(x)), gtime(lambda: torch.add(x, dy, out=z2))
    return x, dy, g, (tc, ta, gtime(lambda: (z1.copy_(x), torch.add(x, dy, out=z2))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=min(15, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    t_start = time.time()
    hs, ms = ((1024, 5120, 16384), (8192,)) if args.quick else (HS, MS)
    say = open_log(args.out, "norm_variants.txt")
    old_cfg = {(k, h): (old_fwd(h), old_bwd(h, k), SUM_OLD[h <= 4096]) for h in hs for k in ("rms", "ln")}
    if args.workers > 0:
        precompile(hs, args.workers, say)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf16 = torch.bfloat16
    rows, bad, res, floor = [], [], {}, {}
    for h in hs:
        for m in ms:
            x, dy, g, floor[(h, m)] = floor_inputs(h, m)
            rows.append(dict(op="floor", H=h, M=m, copy_us=floor[(h, m)][0], add_us=floor[(h, m)][1], seq_us=floor[(h, m)][2]))
            for kind in ("rms", "ln"):
                w = (torch.rand(h, device=dev, generator=g) + 0.5).to(bf16)
                b = torch.randn(h, device=dev, generator=g).to(bf16)
                y_ref, dx_ref, dw_ref, db_ref = reference(kind, x, w, b, dy)
                y, mean, rstd = torch.empty_like(x), torch.empty(m, device=dev), torch.empty(m, device=dev)
                bits = {}
                for c in [old_fwd(h)]:
                    y.fill_(float("nan"))
                    try:
                        launch_fwd(kind, c, x, w, b, y, mean, rstd, sms)
                    except Exception as e:  # noqa: BLE001
                        bad.append(f"fwd {kind} H{h} {c}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    err = rel(y, y_ref)
                    same = None
                    if c[1] == 0:
                        bits[(c[0], c[2])] = (y.clone(), rstd.clone(), mean.clone())
                    elif (c[0], c[2]) in bits:
                        o = bits[(c[0], c[2])]
                        same = bool(
                            torch.equal(o[0], y) and torch.equal(o[1], rstd) and (kind == "rms" or torch.equal(o[2], mean))
                        )
                    t = gtime(lambda: launch_fwd(kind, c, x, w, b, y, mean, rstd, sms))
                    res[(kind, h, m, "fwd", c)] = t
                    rows.append(dict(op="fwd", kind=kind, H=h, M=m, cfg=list(c), us=t, err=err, bitwise_vs_grid=same))
                    if err > 1e-2 or same is False:
                        bad.append(f"fwd {kind} H{h} M{m} {c}: err {err:.2e} bitwise {same}")
                launch_fwd(kind, old_fwd(h), x, w, b, y, mean, rstd, sms)  # the statistics for the backward
                dx = torch.empty_like(x)
                for c in bwd_cfgs(h, kind):
                    P, _ = bwd_grid(m, c[2], c[3], sms)
                    dwp, dbp = torch.empty(P, h, device=dev), torch.empty(P, h, device=dev)
                    dx.fill_(float("nan"))
                    try:
                        launch_bwd(kind, c, dy, x, w, mean, rstd, dx, dwp, dbp, sms)
                    except Exception as e:  # noqa: BLE001
                        bad.append(f"bwd {kind} H{h} {c}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    args_ = (dy, x, w, mean, rstd, dx, dwp, dbp)
                    err, inv = check_bwd(launch_bwd, kind, c, args_, sms, (dx_ref, dw_ref, db_ref), m == ms[0])
                    if inv is False:
                        bad.append(f"bwd {kind} H{h} {c}: not batch invariant")
                    t = gtime(lambda: launch_bwd(kind, c, dy, x, w, mean, rstd, dx, dwp, dbp, sms))
                    res[(kind, h, m, "bwd", c)] = t
                    rows.append(dict(op="bwd", kind=kind, H=h, M=m, cfg=list(c), P=P, us=t, err=err, invariant=inv))
                    if err > 1e-2:
                        bad.append(f"bwd {kind} H{h} M{m} {c}: err {err:.2e}")
        for kind in ("rms", "ln"):
            for op, part in (("fwd", 0), ("bwd", 1)):
                cfgs = sorted(
                    {k[4] for k in res if k[:2] == (kind, h) and k[3] == op},
                    key=lambda c: sum(res.get((kind, h, m, op, c), INF) for m in ms),
                )
                say(f"{kind} H{h} {op}: " + "; ".join(
                    f"{c}{'(old)' if c == old_cfg[(kind, h)][part] else ''} " + "/".join(f"{res[(kind, h, m, op, c)]:.1f}" for m in ms)
                    + " (" + "/".join(f"{100 * floor[(h, m)][part] / res[(kind, h, m, op, c)]:.0f}%" for m in ms) + ")"
                    for c in cfgs[:4] + [c for c in cfgs[4:] if c == old_cfg[(kind, h)][part]]
                ))  # fmt: skip

    say("\nwhole forward + backward + partial sums (one graph each, interleaved x3), µs; floor = copy + add in one graph")
    say(
        f"{'kind':4} {'H':>5} {'M':>5} | {'floor':>6} {'old':>6} {'new':>6} {'newPDL':>6} | {'old%':>5} {'new%':>5} {'PDL%':>5} | fwd | bwd | parts fwd+bwd+sum"
    )
    choice = {}
    for kind in ("rms", "ln"):
        for h in hs:
            fcs = {k[4] for k in res if k[:2] == (kind, h) and k[3] == "fwd"}
            bcs = {k[4] for k in res if k[:2] == (kind, h) and k[3] == "bwd"}
            if not fcs or not bcs:
                continue
            fc = min(fcs, key=lambda c: sum(res.get((kind, h, m, "fwd", c), INF) / floor[(h, m)][0] for m in ms))
            bc = min(bcs, key=lambda c: sum(res.get((kind, h, m, "bwd", c), INF) / floor[(h, m)][1] for m in ms))
            choice[(kind, h)] = (fc, bc)
            for m in ms:
                new = (fc, bc, SUM_OLD[h <= 4096])
                t_old, t_new, t_pdl, t_parts = _sequence(kind, h, m, old_cfg[(kind, h)], new, sms)
                fl = floor[(h, m)][2]
                rows.append(dict(op="sequence", kind=kind, H=h, M=m, floor_us=fl, old_us=t_old, new_us=t_new,
                                 pdl_us=t_pdl, parts=t_parts, fwd=list(fc), bwd=list(bc)))  # fmt: skip
                say(
                    f"{kind:4} {h:>5} {m:>5} | {fl:6.1f} {t_old:6.1f} {t_new:6.1f} {t_pdl:6.1f} | {100 * fl / t_old:5.1f} {100 * fl / t_new:5.1f} {100 * fl / t_pdl:5.1f} | {fc} | {bc} | "
                    + "+".join(f"{t:.1f}" for t in t_parts)
                )
    close_out(say, bad, "errors < 1e-2 vs fp32; backward batch invariant",
              {"rows": rows, "choice": {f"{k[0]} {k[1]}": v for k, v in choice.items()}},
              os.path.join(args.out, "norm_variants.json"), t_start)  # fmt: skip


def _sequence(kind, h, m, old, new, sms):
    """µs of forward + backward + partial sums: old, new, new with PDL (interleaved, one graph each),
    and new's parts alone (fwd, bwd, sums)."""
    dev = torch.device("cuda")
    x, dy, w, b, y, dx, mean, rstd, dw, db = seq_buffers(h, m)

    def make(cfgs, pdl, part=None):
        fc, bc, sc = cfgs
        P = bwd_grid(m, bc[2], bc[3], sms)[0]
        dwp, dbp = torch.empty(P, h, device=dev), torch.empty(P, h, device=dev)

        def seq():
            if part in (None, "fwd"):
                launch_fwd(kind, fc, x, w, b, y, mean, rstd, sms, pdl)
            if part in (None, "bwd"):
                launch_bwd(kind, bc, dy, x, w, mean, rstd, dx, dwp, dbp, sms, pdl)
            if part in (None, "sum"):
                launch_sum(sc, dwp, dw, P, pdl)
                if kind == "ln":
                    launch_sum(sc, dbp, db, P, pdl)

        return seq

    fns = [make(old, False), make(new, False), make(new, True)]
    t = [[], [], []]
    for _ in range(3):
        for i, f in enumerate(fns):
            try:
                t[i].append(gtime(f))
            except Exception as e:  # noqa: BLE001  (PDL unsupported: reported as inf)
                print(f"sequence {kind} {h} {i}: {type(e).__name__} {str(e)[:200]}", flush=True)
                t[i].append(INF)
    parts = [gtime(make(new, False, p)) for p in ("fwd", "bwd", "sum")]
    return (*(statistics.median(v) for v in t), parts)


if __name__ == "__main__":
    sys.exit(main())
