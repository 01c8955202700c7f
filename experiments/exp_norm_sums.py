# ruff: noqa: E501, E731, B023
"""Experiment: what the norm's forward + backward loses beside its two copy-rate kernels (issue #16
item 3), at every hidden size (bf16, M in {8192, 16384}), PDL on as in ops/norm.py.

* The weight-gradient (and bias-gradient) partials' sum (``_sum_partials_kernel``): every
  (BLOCK_P, BLOCK_N, num_warps) of SUMS alone, with LayerNorm's two sums in one launch (TWO); then
  the whole sequence with today's sum, the best sum, and no sum at all (the most a sum fused into
  the backward could give).
* Fewer backward programs at 1024 / 2048 (fewer partial rows to sum), timed alone and in the sequence.
* RMSNorm's persistent forward at other programs per SM at 1024 / 2048 (the same bits), and the
  backward launched without PDL (its programs launched early may take the forward's SM slots).
* The LayerNorm forward (not bit-coupled to anything): num_warps x programs per SM x where the weight
  and bias rows live between rows (WB: fp32 registers, registers in bf16, or loaded per row).

Every run is checked: forwards and backwards against an fp32 torch reference (relative L2 < 1e-2),
each forward and backward for batch invariance (the rows of a 37-row and a 1-row call are the
full call's bits), each sum against the partials' float64 sum.

Run: ``PYTHONPATH=. python experiments/exp_norm_sums.py [--out DIR] [--quick]``.

Result (2026-11-23, one H200, torch 2.11, triton 3.6; 39 s after a 10 s compile):

* The sums cost ~3 µs of every forward + backward (RMSNorm; LayerNorm's two 5.6 µs at 1024), whatever
  the size: without them RMSNorm would be at 92 / 95% at 1024, 95% at 8192 x 2048, 92% at
  8192 x 4096; 2880, 5120 and 8192 x 16384 would stay below 88% (84, 82, 77%).
* LayerNorm's two sums in one launch with BLOCK_P = 512 (one round of the 264-528 partial rows up to
  4096): 4.5 -> 3.2 µs at 1024, 1-2 µs at every size (68 -> 73% of the floor at 8192 x 1024).
  RMSNorm's sum: within 0.3 µs of today's configuration everywhere.
* Fewer backward programs (fewer partial rows): 3-30% slower in the sequence at 1024 and 2048.
* RMSNorm's forward at 32 programs per SM at 1024: 0.3-0.6 µs faster than 16 (the same bits).
* The backward launched without PDL: within noise.
* The LayerNorm forward: w and b in bf16 registers 3-7% faster at 2048, 2880, 7168 and 16384 (one
  program per row at 4 warps at 2048 / 2880), a tie elsewhere; loaded per row: never faster. It
  stays 1.3-1.5x slower than RMSNorm's forward at 2880-8192: registers are not the main cause.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exp_norm_sweep import HS, MS, bwd_grid, check_bwd, gtime, npow2, open_log, reference, rel, seq_buffers  # noqa: E402
from exp_norm_variants import add_jobs, close_out, floor_inputs, launch_bwd, launch_fwd, launch_sum, precompile  # noqa: E402

INF = float("inf")
SUMS = [(256, 16, 8), (128, 16, 4), (512, 16, 8), (1024, 16, 16), (512, 8, 4), (1024, 8, 8), (256, 32, 8),
        (128, 32, 4), (64, 64, 4), (32, 64, 4)]  # fmt: skip
# fewer backward programs (warps, rows, per-SM) at small rows
BWD_FEW = {
    1024: [(4, 2, 2), (8, 4, 2), (8, 4, 1), (16, 8, 1), (8, 2, 2), (4, 4, 2)],
    2048: [(8, 2, 1), (16, 4, 1), (8, 4, 1), (4, 1, 2)],
}
RMS_FWD_K = {1024: (8, 24, 32), 2048: (8, 16)}


def cur_fwd(h, kind):
    from truefuse.ops.norm_config import block_and_warps, fwd_programs_per_sm, ln_fwd_config

    return (block_and_warps(h)[1], fwd_programs_per_sm(h), "reg") if kind == "rms" else ln_fwd_config(h)


def cur_bwd(h, kind):
    from truefuse.ops.norm_config import bwd_config

    c = bwd_config(h, kind == "rms")
    if c.parts is None:
        return ("tile", c.warps, c.rows, c.per_sm, c.prefetch, 0, 0)
    return ("split", c.warps, 1, c.per_sm, c.prefetch, *c.parts)


def cur_sum(h):
    from truefuse.ops.norm_config import sum_config

    return sum_config(h)


def ln_fwd_cfgs(h):
    block = npow2(h)
    out = [cur_fwd(h, "ln")]
    w0 = cur_fwd(h, "rms")[0]
    for w in sorted({max(1, w0 // 2), w0, min(32, 2 * w0)}):
        if not 4 <= block // (32 * w) <= 64:
            continue
        for k in sorted({0, max(1, 32 // w), max(1, 64 // w)}):
            for wb in ("reg", "narrow"):  # ("row", reloading w and b per row, measured never faster: gone)
                if (w, k, wb) not in out:
                    out.append((w, k, wb))
    return out


def bwd_cfgs(h, kind):
    out = [cur_bwd(h, kind)]
    for w, r, k in BWD_FEW.get(h, []):
        out.append(("tile", w, r, k, True, 0, 0))
    return out


# ---------------------------------------------------------------------------------------------
# compile workers: the same launches as the timed runs (the same kernel cache keys)


def _jobs(hs):
    jobs = []
    for h in hs:
        for kind in ("rms", "ln"):
            fcs = (
                ln_fwd_cfgs(h)
                if kind == "ln"
                else [cur_fwd(h, "rms")] + [(cur_fwd(h, "rms")[0], k, "reg") for k in RMS_FWD_K.get(h, ())]
            )
            add_jobs(jobs, "fwd", kind, h, fcs, (True,))
            add_jobs(jobs, "bwd", kind, h, bwd_cfgs(h, kind), (True, False))
        for sc in SUMS if h == hs[0] else ():  # one compile for every hidden size (N % 16 == 0)
            for two in (False, True):
                jobs.append(("sum", "ln" if two else "rms", h, sc, True))
    return jobs


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=min(15, (os.cpu_count() or 2) - 1))
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; later sizes skipped past it")
    args = ap.parse_args()
    t_start = time.time()
    hs, ms = ((1024, 5120), (8192,)) if args.quick else (HS, MS)
    say = open_log(args.out, "norm_sums.txt")
    if args.workers > 0:
        precompile(hs, args.workers, say, _jobs(hs), "exp_norm_sums")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf16 = torch.bfloat16
    rows, bad, res, floor = [], [], {}, {}
    best_sum = {}
    seq_lines = []
    for h in hs:
        if time.time() - t_start > args.budget:
            say(f"budget: H >= {h} skipped")
            break
        for m in ms:
            x, dy, g, floor[(h, m)] = floor_inputs(h, m)
            rows.append(dict(op="floor", H=h, M=m, copy_us=floor[(h, m)][0], add_us=floor[(h, m)][1], seq_us=floor[(h, m)][2]))
            for kind in ("rms", "ln"):
                w = (torch.rand(h, device=dev, generator=g) + 0.5).to(bf16)
                b = torch.randn(h, device=dev, generator=g).to(bf16)
                y_ref, dx_ref, dw_ref, db_ref = reference(kind, x, w, b, dy)
                y, mean, rstd = torch.empty_like(x), torch.empty(m, device=dev), torch.empty(m, device=dev)
                fcs = (
                    ln_fwd_cfgs(h)
                    if kind == "ln"
                    else [cur_fwd(h, "rms")] + [(cur_fwd(h, "rms")[0], k, "reg") for k in RMS_FWD_K.get(h, ())]
                )
                for c in fcs:
                    y.fill_(float("nan"))
                    try:
                        launch_fwd(kind, c, x, w, b, y, mean, rstd, sms, True)
                    except Exception as e:  # noqa: BLE001
                        bad.append(f"fwd {kind} H{h} {c}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    err = rel(y, y_ref)
                    inv = True
                    if m == ms[0]:
                        for lo, hi in ((0, 37), (5, 6)):
                            ys = torch.full_like(y[lo:hi], float("nan"))
                            launch_fwd(
                                kind,
                                c,
                                x[lo:hi],
                                w,
                                b,
                                ys,
                                torch.empty(hi - lo, device=dev),
                                torch.empty(hi - lo, device=dev),
                                sms,
                                True,
                            )
                            inv = inv and bool(torch.equal(ys, y[lo:hi]))
                    t = gtime(lambda: launch_fwd(kind, c, x, w, b, y, mean, rstd, sms, True))
                    res[(kind, h, m, "fwd", c)] = t
                    rows.append(dict(op="fwd", kind=kind, H=h, M=m, cfg=list(c), us=t, err=err, invariant=inv))
                    if err > 1e-2 or not inv:
                        bad.append(f"fwd {kind} H{h} M{m} {c}: err {err:.2e} invariant {inv}")
                launch_fwd(kind, cur_fwd(h, kind), x, w, b, y, mean, rstd, sms, True)  # the statistics for the backward
                dx = torch.empty_like(x)
                for c in bwd_cfgs(h, kind):
                    P, _ = bwd_grid(m, c[2], c[3], sms)
                    dwp, dbp = torch.empty(P, h, device=dev), torch.empty(P, h, device=dev)
                    dx.fill_(float("nan"))
                    try:
                        launch_bwd(kind, c, dy, x, w, mean, rstd, dx, dwp, dbp, sms, True)
                    except Exception as e:  # noqa: BLE001
                        bad.append(f"bwd {kind} H{h} {c}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    err, inv = check_bwd(
                        launch_bwd, kind, c, (dy, x, w, mean, rstd, dx, dwp, dbp), sms, (dx_ref, dw_ref, db_ref), m == ms[0]
                    )
                    if inv is False or err > 1e-2:
                        bad.append(f"bwd {kind} H{h} M{m} {c}: err {err:.2e} invariant {inv}")
                    t = gtime(lambda: launch_bwd(kind, c, dy, x, w, mean, rstd, dx, dwp, dbp, sms, True))
                    res[(kind, h, m, "bwd", c)] = t
                    rows.append(dict(op="bwd", kind=kind, H=h, M=m, cfg=list(c), P=P, us=t, err=err, invariant=inv))
                # the sums, alone, on the current backward's partials
                P, _ = bwd_grid(m, cur_bwd(h, kind)[2], cur_bwd(h, kind)[3], sms)
                dwp = torch.randn(P, h, device=dev)
                dbp = torch.randn(P, h, device=dev)
                ref_w, ref_b = dwp.double().sum(0), dbp.double().sum(0)
                ow, ob = torch.empty(h, device=dev, dtype=bf16), torch.empty(h, device=dev, dtype=bf16)
                extra = (dbp, ob) if kind == "ln" else ()
                for sc in SUMS:
                    ow.fill_(float("nan"))
                    ob.fill_(float("nan"))
                    try:
                        launch_sum(sc, dwp, ow, P, True, *extra)
                    except Exception as e:  # noqa: BLE001
                        bad.append(f"sum {kind} H{h} {sc}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    err = max(rel(ow, ref_w.float()), rel(ob, ref_b.float()) if kind == "ln" else 0.0)
                    if err > 1e-2:
                        bad.append(f"sum {kind} H{h} M{m} {sc}: err {err:.2e}")
                    t = gtime(lambda: launch_sum(sc, dwp, ow, P, True, *extra))
                    res[(kind, h, m, "sum", sc)] = t
                    rows.append(dict(op="sum", kind=kind, H=h, M=m, cfg=list(sc), P=P, us=t, err=err))
                if kind == "ln":  # today's: two launches
                    t = gtime(lambda: (launch_sum(cur_sum(h), dwp, ow, P, True), launch_sum(cur_sum(h), dbp, ob, P, True)))
                    res[(kind, h, m, "sum2", cur_sum(h))] = t
                    rows.append(dict(op="sum_two_launches", kind=kind, H=h, M=m, cfg=list(cur_sum(h)), P=P, us=t))
        # per (kind, h): report the kernels alone, then the sequences
        for kind in ("rms", "ln"):
            for op in ("fwd", "bwd", "sum"):
                cfgs = sorted(
                    {k[4] for k in res if k[:2] == (kind, h) and k[3] == op},
                    key=lambda c: sum(res.get((kind, h, m, op, c), INF) for m in ms),
                )
                cur = {"fwd": cur_fwd(h, kind), "bwd": cur_bwd(h, kind), "sum": cur_sum(h)}[op]
                shown = cfgs[:5] + [c for c in cfgs[5:] if c == cur]
                say(
                    f"{kind} H{h} {op}: "
                    + "; ".join(
                        f"{c}{'(cur)' if c == cur else ''} " + "/".join(f"{res.get((kind, h, m, op, c), INF):.1f}" for m in ms)
                        for c in shown
                    )
                )
                if kind == "ln" and op == "sum":
                    say(
                        f"{kind} H{h} sum, today's two launches {cur}: "
                        + "/".join(f"{res.get((kind, h, m, 'sum2', cur), INF):.1f}" for m in ms)
                    )
            sc_best = min(SUMS, key=lambda c: sum(res.get((kind, h, m, "sum", c), INF) for m in ms))
            fc_best = min(
                {k[4] for k in res if k[:2] == (kind, h) and k[3] == "fwd"},
                key=lambda c: sum(res.get((kind, h, m, "fwd", c), INF) for m in ms),
            )
            best_sum[(kind, h)] = sc_best
            for m in ms:
                line, t = _sequences(kind, h, m, sms, sc_best, fc_best, floor[(h, m)][2])
                rows.append(
                    dict(
                        op="sequence",
                        kind=kind,
                        H=h,
                        M=m,
                        floor_us=floor[(h, m)][2],
                        times=t,
                        sum_best=list(sc_best),
                        fwd_best=list(fc_best),
                    )
                )
                seq_lines.append(line)
                say(line)
    say("\nsequences (fwd + bwd + sums, PDL; µs and % of the floor = copy + add in one graph):")
    for line in seq_lines:
        say(line)
    close_out(say, bad, "errors < 1e-2 vs fp32; forward and backward batch invariant",
              {"rows": rows, "best_sum": {f"{k[0]} {k[1]}": v for k, v in best_sum.items()}},
              os.path.join(args.out, "norm_sums.json"), t_start)  # fmt: skip


def _sequences(kind, h, m, sms, sc_best, fc_best, fl):
    """The whole forward + backward + sums, in variants (interleaved x3, one graph each)."""
    dev = torch.device("cuda")
    x, dy, w, b, y, dx, mean, rstd, dw, db = seq_buffers(h, m)
    fc0, bc0, sc0 = cur_fwd(h, kind), cur_bwd(h, kind), cur_sum(h)

    def make(fc, bc, sc, two=False, bwd_pdl=True):
        P = bwd_grid(m, bc[2], bc[3], sms)[0]
        dwp, dbp = torch.empty(P, h, device=dev), torch.empty(P, h, device=dev)

        def seq():
            launch_fwd(kind, fc, x, w, b, y, mean, rstd, sms, True)
            launch_bwd(kind, bc, dy, x, w, mean, rstd, dx, dwp, dbp, sms, bwd_pdl)
            if sc is None:
                return
            if kind == "ln" and two:
                launch_sum(sc, dwp, dw, P, True, dbp, db)
            else:
                launch_sum(sc, dwp, dw, P, True)
                if kind == "ln":
                    launch_sum(sc, dbp, db, P, True)

        return seq

    two = kind == "ln"
    variants = {"cur": make(fc0, bc0, sc0), "sum*": make(fc0, bc0, sc_best, two), "nosum": make(fc0, bc0, None)}
    if kind == "ln":
        variants["sum1"] = make(fc0, bc0, sc0, True)
        variants["fwd*+sum*"] = make(fc_best, bc0, sc_best, True)
    for k in RMS_FWD_K.get(h, ()) if kind == "rms" else ():
        variants[f"fwd k{k}+sum*"] = make((fc0[0], k, "reg"), bc0, sc_best)
    for c in bwd_cfgs(h, kind)[1:]:
        variants[f"bwd{c[1:4]}+sum*"] = make(fc0, c, sc_best, two)
    if h <= 2048:
        variants["bwd noPDL+sum*"] = make(fc0, bc0, sc_best, two, False)
    t = {k: [] for k in variants}
    for _ in range(3):
        for k, f in variants.items():
            try:
                t[k].append(gtime(f))
            except Exception as e:  # noqa: BLE001
                print(f"sequence {kind} {h} {k}: {type(e).__name__} {str(e)[:200]}", flush=True)
                t[k].append(INF)
    t = {k: statistics.median(v) for k, v in t.items()}
    line = f"{kind:3} {h:>5} {m:>5} floor {fl:6.1f} | " + "; ".join(f"{k} {v:.1f} ({100 * fl / v:.0f}%)" for k, v in t.items())
    return line, t


if __name__ == "__main__":
    sys.exit(main())
