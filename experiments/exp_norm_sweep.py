# ruff: noqa: E501, E731, B023
"""Experiment: RMSNorm / LayerNorm forward + backward kernel configurations at every hidden size (bf16).

For each hidden size H in {1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384} and rows M in {8192,
16384}, times (CUDA graphs of back-to-back launches, median of replays) every configuration of

* the forward (``_norm_fwd_kernel``): num_warps × schedule (one program per row, or persistent
  with k programs per SM and the next row prefetched), plus evict_first on the x load;
* the backward (``_norm_bwd_kernel``): num_warps × rows per tile × programs per SM × prefetch,
  plus evict_first;
* the weight-gradient partials' sum (``_sum_partials_kernel``): (BLOCK_P, BLOCK_N, num_warps);

checks every run (outputs poisoned first) against an fp32 torch reference (relative L2 error <
1e-2) and each persistent forward bitwise against the one-program-per-row forward of the same
num_warps (the same bits: the fused allreduce's coupling only fixes BLOCK_N and num_warps); then
picks one configuration per hidden size (never per row count: batch invariance), and times the
whole forward + backward sequence of the chosen and of the old configuration against the copy
floor (device copies of the same bytes: read x write y, read x and dy write dx).

Kernels are compiled first by worker processes (into Triton's disk cache) to fit a short lease.
Run: ``PYTHONPATH=. python experiments/exp_norm_sweep.py [--out DIR] [--quick]``; full results in
``DIR/norm_sweep.json`` and ``DIR/norm_sweep.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HS = (1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384)
MS = (8192, 16384)
KINDS = ("rms", "ln")
SUMS = ((32, 64, 4), (64, 32, 4), (128, 16, 4), (128, 32, 8), (256, 16, 8), (512, 8, 8))
OLD_SUM = (32, 64, 4)
EF = "evict_first"
INF = float("inf")


def npow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def old_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def warps_for(block: int, rows: int = 1) -> list[int]:
    """num_warps giving 8, 16 or 32 elements per thread of a (rows, block) tile (1..32 warps)."""
    return sorted({w for ept in (8, 16, 32) for w in [rows * block // (32 * ept)] if 1 <= w <= 32})


def fwd_configs(block: int) -> list[tuple]:
    """(warps, programs per SM (0: one per row), evict)."""
    out = []
    for w in warps_for(block):
        out.append((w, 0, ""))
        for k in sorted({max(1, min(32, 32 // w)), max(1, min(32, 64 // w))}):
            out.append((w, k, ""))
    out.append((old_warps(block), 0, EF))
    return out


def bwd_configs(block: int) -> list[tuple]:
    """(warps, rows per tile, programs per SM, prefetch, evict)."""
    rows_opts = (1, 2, 4) if block <= 2048 else (1, 2) if block <= 4096 else (1,)
    out = []
    for rows in rows_opts:
        for w in warps_for(block, rows):
            for pre in (True, False) if block >= 8192 else (True,):
                for k in (1, 2, 4):
                    out.append((w, rows, k, pre, ""))
    out.append((old_warps(block), 1, 2, True, EF))
    return out


OLD_FWD = lambda block: (old_warps(block), 0, "")
OLD_BWD = lambda block: (old_warps(block), 1, 2, True, "")


# ---------------------------------------------------------------------------------------------
# launches (the same calls in the compile workers and the timed runs: the same kernel cache keys)


def launch_fwd(kind, cfg, x, w, b, y, mean, rstd, sms):
    from truefuse.kernels.norm import _norm_fwd_kernel

    M, N = x.shape
    warps, k, evict = cfg
    grid = min(M, k * sms) if k else M
    _norm_fwd_kernel[(grid,)](
        x, w, b if kind == "ln" else x, y, mean if kind == "ln" else rstd, rstd, x.stride(0), y.stride(0), N, 1e-5,
        IS_RMS=kind == "rms", HAS_W=True, HAS_B=kind == "ln", ZERO_CENTERED=False, BLOCK_N=npow2(N),
        M=M, PERSISTENT=bool(k), EVICT=evict, num_warps=warps,
    )  # fmt: skip


def bwd_grid(M, rows, k, sms):
    programs = max(1, min(M, k * sms))
    per = -(M // -programs)
    rpp = -(per // -rows) * rows
    return -(-M // rpp), rpp


def launch_bwd(kind, cfg, dy, x, w, mean, rstd, dx, dw_part, db_part, sms):
    from truefuse.kernels.norm import _norm_bwd_kernel

    M, N = x.shape
    warps, rows, k, pre, evict = cfg
    programs, rpp = bwd_grid(M, rows, k, sms)
    _norm_bwd_kernel[(programs,)](
        dy, x, w, mean if kind == "ln" else rstd, rstd, dx, dw_part, db_part if kind == "ln" else rstd,
        dy.stride(0), x.stride(0), dx.stride(0), M, N, rpp,
        IS_RMS=kind == "rms", HAS_W=True, HAS_B=kind == "ln", ZERO_CENTERED=False, BLOCK_N=npow2(N),
        ROWS=rows, PREFETCH=pre, EVICT=evict, num_warps=warps,
    )  # fmt: skip
    return programs


def launch_sum(cfg, part, out, P):
    from truefuse.kernels.norm import _sum_partials_kernel

    bp, bn, warps = cfg
    N = part.shape[1]
    _sum_partials_kernel[(-(-N // bn),)](part, out, part, out, P, N, BLOCK_P=bp, BLOCK_N=bn, num_warps=warps)


# ---------------------------------------------------------------------------------------------
# compile workers


def _compile_jobs(hs):
    jobs = set()
    for h in hs:
        block = npow2(h)
        for kind in KINDS:
            jobs.update(("fwd", kind, block, c) for c in fwd_configs(block))
            jobs.update(("bwd", kind, block, c) for c in bwd_configs(block))
            jobs.add(("fwd", kind, block, OLD_FWD(block)))
            jobs.add(("bwd", kind, block, OLD_BWD(block)))
        jobs.update(("sum", "-", block, c) for c in SUMS)
    # one compile per distinct kernel: the programs per SM only change the grid
    seen, out = set(), []
    for j in sorted(jobs, key=str):
        op, kind, block, c = j
        key = (op, kind, block, (c[0], bool(c[1]), c[2]) if op == "fwd" else (c[0], c[1], c[3], c[4]) if op == "bwd" else c)
        if key not in seen:
            seen.add(key)
            out.append(j)
    return out


def _compile_worker(jobs):
    t0 = time.time()
    dev = torch.device("cuda")
    n_ok, errs = 0, []
    for op, kind, block, cfg in jobs:
        try:
            N = block if block > 16 else 16
            M = 64
            x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, device=dev, dtype=torch.bfloat16)
            f32 = lambda *s: torch.empty(*s, device=dev, dtype=torch.float32)
            if op == "fwd":
                launch_fwd(kind, cfg, x, w, w.clone(), torch.empty_like(x), f32(M), f32(M), 2)
            elif op == "bwd":
                launch_bwd(
                    kind, cfg, x.clone(), x, w, f32(M).zero_(), f32(M).fill_(1), torch.empty_like(x), f32(64, N), f32(64, N), 2
                )
            else:
                launch_sum(cfg, f32(64, N).zero_(), torch.empty(N, device=dev, dtype=torch.bfloat16), 64)
            n_ok += 1
        except Exception as e:  # noqa: BLE001  (reported; the main process compiles it again)
            errs.append(f"{op} {kind} {block} {cfg}: {type(e).__name__}: {str(e)[:300]}")
    torch.cuda.synchronize()
    return n_ok, errs, time.time() - t0


def precompile(hs, workers):
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = _compile_jobs(hs)
    chunks = [jobs[i::workers] for i in range(workers)]
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        res = list(ex.map(_compile_worker, chunks))
    errs = [e for r in res for e in r[1]]
    print(
        f"precompiled {sum(r[0] for r in res)}/{len(jobs)} kernels in {time.time() - t0:.1f} s with {workers} workers", flush=True
    )
    for e in errs[:10]:
        print("  compile error:", e, flush=True)
    return errs


# ---------------------------------------------------------------------------------------------
# timing and checks


def open_log(out: str, name: str):
    """``say(line)``: print and append to ``out/name``; the first line names the versions and the GPU."""
    import triton

    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, name), "w")

    def say(s=""):
        print(s, flush=True)
        log.write(s + "\n")
        log.flush()

    say(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}")
    return say


def gtime(fn, n=10, reps=7):
    """Median µs per call: a CUDA graph of n calls, replayed reps times."""
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


def rel(a, r):
    a = a.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - r).norm() / r.norm()).item()


def reference(kind, x, w, b, dy):
    f32 = lambda t: t.to(torch.float32, copy=True)
    xf, wf, dyf, bf = f32(x).requires_grad_(), f32(w).requires_grad_(), f32(dy), f32(b).requires_grad_()
    if kind == "rms":
        xh = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        y = xh * wf
    else:
        xc = xf - xf.mean(-1, keepdim=True)
        xh = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-5)
        y = xh * wf + bf
    y.backward(dyf)
    return y.detach(), xf.grad, wf.grad, bf.grad


def check_bwd(launch, kind, c, args, sms, refs, invariance):
    """(relative error of one backward run's dx, dw and db against the fp32 reference, and with
    ``invariance`` whether the rows of a 37-row and a 1-row call are the full call's bits, else
    None). ``args``: (dy, x, w, mean, rstd, dx, dw_part, db_part) as ``launch`` takes them."""
    dy, x, w, mean, rstd, dx, dwp, dbp = args
    dx_ref, dw_ref, db_ref = refs
    err = max(rel(dx, dx_ref), rel(dwp.sum(0), dw_ref), rel(dbp.sum(0), db_ref) if kind == "ln" else 0.0)
    if not invariance:
        return err, None
    inv = True
    for lo, hi in ((0, 37), (5, 6)):
        dxs = torch.full_like(dx[lo:hi], float("nan"))
        launch(kind, c, dy[lo:hi], x[lo:hi], w, mean[lo:hi], rstd[lo:hi], dxs, dwp, dbp, sms)
        inv = inv and bool(torch.equal(dxs, dx[lo:hi]))
    return err, inv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="two hidden sizes, M 8192 only")
    ap.add_argument("--workers", type=int, default=min(14, (os.cpu_count() or 2) - 1))
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; later sizes are skipped past it")
    args = ap.parse_args()
    t_start = time.time()
    hs, ms = ((1024, 7168), (8192,)) if args.quick else (HS, MS)
    say = open_log(args.out, "norm_sweep.txt")
    if args.workers > 0:
        precompile(hs, args.workers)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []  # every measurement
    bf16 = torch.bfloat16

    def record(**kw):
        rows.append(kw)
        return kw

    # the partials' sum: per hidden size and partial-row count (no dependence on the kind or M)
    sum_us = {}
    for h in hs:
        for P in sorted({bwd_grid(m, r, k, sms)[0] for m in ms for k in (1, 2, 4) for r in (1, 2, 4)}):
            part = torch.randn(P, h, device=dev)
            ref = part.sum(0)
            out = torch.empty(h, device=dev, dtype=bf16)
            for c in SUMS:
                out.fill_(float("nan"))
                try:
                    launch_sum(c, part, out, P)
                except Exception as e:  # noqa: BLE001
                    print(f"sum {c}: {type(e).__name__} {str(e)[:200]}", flush=True)
                    sum_us[(h, P, c)] = float("inf")
                    continue
                err = rel(out, ref)
                t = gtime(lambda: launch_sum(c, part, out, P))
                sum_us[(h, P, c)] = t
                record(op="sum", H=h, P=P, cfg=list(c), us=t, err=err)
    best_sum = {}
    for h in hs:
        for P in {k[1] for k in sum_us if k[0] == h}:
            c = min(SUMS, key=lambda c: sum_us[(h, P, c)])
            best_sum[(h, P)] = (c, sum_us[(h, P, c)])
    say("sum of partials, µs (old cfg → best cfg) per H, P:")
    for h in hs:
        say(
            f"  H {h}: "
            + ", ".join(
                f"P{P} {sum_us[(h, P, OLD_SUM)]:.1f}→{best_sum[(h, P)][1]:.1f} {best_sum[(h, P)][0]}"
                for P in sorted({k[1] for k in sum_us if k[0] == h})
            )
        )

    floor = {}
    res = {}  # (kind, h, m, op, cfg) -> us
    bad = []
    for h in hs:
        if time.time() - t_start > args.budget:
            say(f"budget spent: skipping H >= {h}")
            break
        block = npow2(h)
        for m in ms:
            g = torch.Generator(device=dev).manual_seed(h + m)
            x = torch.randn(m, h, device=dev, dtype=bf16, generator=g)
            dy = torch.randn(m, h, device=dev, dtype=bf16, generator=g)
            z1, z2 = torch.empty_like(x), torch.empty_like(x)
            tc = gtime(lambda: z1.copy_(x))
            ta = gtime(lambda: torch.add(x, dy, out=z2))
            floor[(h, m)] = (tc, ta)
            record(op="floor", H=h, M=m, copy_us=tc, add_us=ta, gbps=5 * m * h * 2 / (tc + ta) / 1e3)
            for kind in KINDS:
                w = (torch.rand(h, device=dev, generator=g) + 0.5).to(bf16)
                b = torch.randn(h, device=dev, generator=g).to(bf16)
                y_ref, dx_ref, dw_ref, db_ref = reference(kind, x, w, b, dy)
                y = torch.empty_like(x)
                mean = torch.empty(m, device=dev)
                rstd = torch.empty(m, device=dev)
                bits = {}
                for c in fwd_configs(block) + [OLD_FWD(block)]:
                    if (kind, h, m, "fwd", c) in res:
                        continue
                    y.fill_(float("nan"))
                    rstd.fill_(float("nan"))
                    try:
                        launch_fwd(kind, c, x, w, b, y, mean, rstd, sms)
                    except Exception as e:  # noqa: BLE001  (a configuration that does not compile is skipped)
                        bad.append(f"fwd {kind} H{h} {c}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    err = rel(y, y_ref)
                    same = None
                    if c[1] == 0 and not c[2]:
                        bits[c[0]] = (y.clone(), rstd.clone())
                    elif c[0] in bits:
                        same = bool(torch.equal(bits[c[0]][0], y) and torch.equal(bits[c[0]][1], rstd))
                    t = gtime(lambda: launch_fwd(kind, c, x, w, b, y, mean, rstd, sms))
                    res[(kind, h, m, "fwd", c)] = t
                    record(op="fwd", kind=kind, H=h, M=m, cfg=list(c), us=t, err=err, bitwise_vs_grid=same)
                    if err > 1e-2 or same is False:
                        bad.append(f"fwd {kind} H{h} M{m} {c}: err {err:.2e} bitwise {same}")
                # the statistics of the old configuration for the backward
                launch_fwd(kind, OLD_FWD(block), x, w, b, y, mean, rstd, sms)
                dx = torch.empty_like(x)
                for c in bwd_configs(block) + [OLD_BWD(block)]:
                    if (kind, h, m, "bwd", c) in res:
                        continue
                    P, _ = bwd_grid(m, c[1], c[2], sms)
                    dw_part = torch.empty(P, h, device=dev)
                    db_part = torch.empty(P, h, device=dev)
                    dx.fill_(float("nan"))
                    try:
                        launch_bwd(kind, c, dy, x, w, mean, rstd, dx, dw_part, db_part, sms)
                    except Exception as e:  # noqa: BLE001
                        bad.append(f"bwd {kind} H{h} {c}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    err, inv = check_bwd(launch_bwd, kind, c, (dy, x, w, mean, rstd, dx, dw_part, db_part), sms,
                                         (dx_ref, dw_ref, db_ref), m == ms[0])  # fmt: skip
                    if inv is False:
                        bad.append(f"bwd {kind} H{h} {c}: not batch invariant")
                    t = gtime(lambda: launch_bwd(kind, c, dy, x, w, mean, rstd, dx, dw_part, db_part, sms))
                    res[(kind, h, m, "bwd", c)] = t
                    record(op="bwd", kind=kind, H=h, M=m, cfg=list(c), P=P, us=t, err=err, invariant=inv)
                    if err > 1e-2:
                        bad.append(f"bwd {kind} H{h} M{m} {c}: err {err:.2e}")
                del y_ref, dx_ref
        _report_h(say, h, ms, floor, res, sum_us, best_sum, sms)

    # one configuration per hidden size, then the whole sequence timed in one graph
    say("\nchosen per H (fwd: warps, per-SM (0: a row a program), evict | bwd: warps, rows, per-SM, prefetch, evict | sum):")
    say(
        f"{'kind':4} {'H':>5} {'M':>5} | {'floor':>6} {'old':>6} {'new':>6} µs | {'old%':>5} {'new%':>5} | fwd cfg | bwd cfg | sum cfg"
    )
    choice = {}
    for kind in KINDS:
        for h in hs:
            if not all((kind, h, m, "bwd", OLD_BWD(npow2(h))) in res for m in ms):
                continue
            block = npow2(h)
            fc = min(fwd_configs(block), key=lambda c: sum(res.get((kind, h, m, "fwd", c), INF) / sum(floor[(h, m)]) for m in ms))

            def bwd_cost(c):
                tot = 0.0
                for m in ms:
                    P = bwd_grid(m, c[1], c[2], sms)[0]
                    tot += (res.get((kind, h, m, "bwd", c), INF) + (1 if kind == "rms" else 2) * best_sum[(h, P)][1]) / sum(
                        floor[(h, m)]
                    )
                return tot

            bc = min(bwd_configs(block), key=bwd_cost)
            # one sum config for every P this H sees: the best total over the P's of the chosen backward
            Ps = [bwd_grid(m, bc[1], bc[2], sms)[0] for m in ms]
            sc = min(SUMS, key=lambda c: sum(sum_us[(h, P, c)] for P in Ps))
            choice[(kind, h)] = (fc, bc, sc)
            for m in ms:
                t_new, t_old = _sequence(kind, h, m, (fc, bc, sc), (OLD_FWD(block), OLD_BWD(block), OLD_SUM), sms)
                fl = sum(floor[(h, m)])
                record(
                    op="sequence",
                    kind=kind,
                    H=h,
                    M=m,
                    new_us=t_new,
                    old_us=t_old,
                    floor_us=fl,
                    fwd=list(fc),
                    bwd=list(bc),
                    sum=list(sc),
                )
                say(
                    f"{kind:4} {h:>5} {m:>5} | {fl:6.1f} {t_old:6.1f} {t_new:6.1f} µs | {100 * fl / t_old:5.1f} {100 * fl / t_new:5.1f} | {fc} | {bc} | {sc}"
                )
    if bad:
        say("\nFAILED CHECKS:")
        for s in bad:
            say("  " + s)
    else:
        say("\nall checks passed (errors < 1e-2 vs fp32; persistent forwards bitwise equal to one-row-per-program)")
    json.dump(
        {"rows": rows, "choice": {f"{k[0]} {k[1]}": v for k, v in choice.items()}},
        open(os.path.join(args.out, "norm_sweep.json"), "w"),
        indent=0,
    )
    say(f"total {time.time() - t_start:.0f} s")


def _report_h(say, h, ms, floor, res, sum_us, best_sum, sms):
    """Top configurations of each kind for one hidden size: µs at each M and % of its copy part."""
    for kind in KINDS:
        for op, part in (("fwd", 0), ("bwd", 1)):
            cfgs = {k[4] for k in res if k[0] == kind and k[1] == h and k[3] == op}
            cost = lambda c: sum(res.get((kind, h, m, op, c), INF) / floor[(h, m)][part] for m in ms)
            ranked = sorted(cfgs, key=cost)
            block = npow2(h)
            old = OLD_FWD(block) if op == "fwd" else OLD_BWD(block)
            show = ranked[:3] + ([old] if old not in ranked[:3] and old in cfgs else [])
            line = f"{kind} H{h} {op}: " + "; ".join(
                f"{c}{'(old)' if c == old else ''} " + "/".join(f"{res[(kind, h, m, op, c)]:.1f}" for m in ms)
                + " (" + "/".join(f"{100 * floor[(h, m)][part] / res[(kind, h, m, op, c)]:.0f}%" for m in ms) + ")"
                for c in show
            )  # fmt: skip
            say(line)


def seq_buffers(h, m):
    """x, dy, w, b, y, dx, mean, rstd, dw, db of one (m, h) bf16 forward + backward."""
    dev = torch.device("cuda")
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = (torch.rand(h, device=dev) + 0.5).to(torch.bfloat16)
    b = torch.randn(h, device=dev).to(torch.bfloat16)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    mean, rstd = torch.empty(m, device=dev), torch.empty(m, device=dev)
    dw, db = torch.empty(h, device=dev, dtype=torch.bfloat16), torch.empty(h, device=dev, dtype=torch.bfloat16)
    return x, dy, w, b, y, dx, mean, rstd, dw, db


def _sequence(kind, h, m, new, old, sms):
    """µs of forward + backward + partial sums, new and old configurations, interleaved in one graph each."""
    dev = torch.device("cuda")
    x, dy, w, b, y, dx, mean, rstd, dw, db = seq_buffers(h, m)
    out = []
    for fc, bc, sc in (new, old):
        P = bwd_grid(m, bc[1], bc[2], sms)[0]
        dwp, dbp = torch.empty(P, h, device=dev), torch.empty(P, h, device=dev)

        def seq(fc=fc, bc=bc, sc=sc, P=P, dwp=dwp, dbp=dbp):  # bound now (a closure would see the last loop's)
            launch_fwd(kind, fc, x, w, b, y, mean, rstd, sms)
            launch_bwd(kind, bc, dy, x, w, mean, rstd, dx, dwp, dbp, sms)
            launch_sum(sc, dwp, dw, P)
            if kind == "ln":
                launch_sum(sc, dbp, db, P)

        out.append(seq)
    t = [[], []]
    for _ in range(3):  # interleaved
        for i in (0, 1):
            t[i].append(gtime(out[i]))
    return statistics.median(t[0]), statistics.median(t[1])


if __name__ == "__main__":
    sys.exit(main())
