# ruff: noqa: E501, B023
"""Experiment: the norms' backward launches and LayerNorm's TMA-staged forward re-measured at every
hidden size in the library's own forward + backward (issue #16 item 3).

Why: the configurations in ``ops/norm/norm_config.py`` (``bwd_config``, ``ln_fwd_staged_config``) were chosen
from kernel-alone sweeps (exp_norm_sweep.py, exp_norm_tma.py; in history at d49a912) made while every backward still
waited on autograd's zero-fills and every kernel triggered its dependents at its start. Two
families: ``--what pointer``, the pointer backward's warps / rows per tile / programs per SM /
prefetch and the two-part kernel where the row pads (2880 = 2048 + 1024, 5120 = 4096 + 1024), plus
LayerNorm's staged forward (warps, programs per SM, stages); ``--what staged`` (default), the
TMA-staged backward (``_norm_bwd_staged_kernel``: warps, programs per SM, stages) against the
pointer kernels. Each is timed as ``bench rms_norm`` times it (autograd, CUDA graphs, interleaved
rounds; the floor is copy + add in one graph) and checked against float64 (dx, dw, db relative L2
< 1e-2); kernels are compiled first in parallel processes.

Run: ``PYTHONPATH=. python experiments/exp_norm_resweep.py [--out DIR] [--what staged|pointer]
[--hidden 2880 5120] [--rounds 3]`` (one H200: under a minute each).

Results (2026-11-23, one H200, torch 2.11.0+cu130, triton 3.6.0):

* 16384 (``pointer``, at b394420 as ``exp_norm_bwd_16k.py``; in history at cbdf501): the two halves
  at 16 warps with x and dy held through the reductions beat every other variant by 12-14%
  (RMSNorm 407 -> 351 µs at 8192 rows, LayerNorm 563 -> 502 µs); ``bwd_config`` took it.
* 1024-8192 (``pointer``, at fc610c8): no backward variant beats ``bwd_config`` by more than noise;
  LayerNorm's staged forward at 8 warps instead of 16 is 3.6-3.9% faster at 5120 (0.2-0.8% at
  7168 and 8192): ``ln_fwd_staged_config`` took it.
* ``staged``: see ``STAGED`` below; ``bwd_staged_config`` took the winners.
* 16384 again (``pointer``, with ``bwd_math``'s one reduction and bf16 x / dy, 2026-11-23):
  LayerNorm's halves at 8 warps, one program per SM, 8.6-9.2% faster than today's 16 warps (469.9
  -> 429.4 µs at 8192 rows, 923.9 -> 839.1 at 16384; 255 registers, 2 spilled); 2-4 programs per
  SM -2 to -7%, 4 warps or prefetching far slower; RMSNorm's 16 warps stay the fastest.
  ``bwd_config`` took it. Raw: docs/results/norms/norm_resweep_16k_h200_2026-11-23.json.
* ``pair`` (at 5c7a792 only): ``_norm_bwd_pair_kernel``, two programs per block of rows, each
  owning half of every row's columns (dx, dw, db) and reading the partner's half for the row's
  sums, so each holds half the accumulators. 1.10-1.70x slower than today's at every size (best:
  RMSNorm 4096 1.10x, LayerNorm 16384 1.14x, LayerNorm elsewhere 1.36-1.70x): the partner's half
  read again costs more than the registers give back. Raw: docs/results/norms/norm_pair_h200_2026-11-23_run{1,2}.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HIDDEN = (1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384)
ROWS = (8192, 16384)


def _bwd_variants(h: int, rms: bool) -> dict:
    """name -> BwdConfig (None: today's), for hidden size ``h``."""
    from truefuse.ops.norm.norm_config import BwdConfig as B

    wide = 32 if rms else 16
    table = {
        1024: [B(4, 4, 4, True), B(4, 1, 8, True), B(8, 2, 4, True), B(4, 2, 8, True), B(4, 2, 2, True), B(4, 2, 4, False)],
        2048: [B(8, 1, 4, True), B(4, 1, 4, True), B(8, 2, 4, True), B(16, 2, 1, True), B(8, 2, 2, False)],
        2880: [
            B(8, 1, 2, True, (2048, 1024)),
            B(8, 1, 2, False, (2048, 1024)),
            B(16, 1, 1, False, (2048, 1024)),
            B(16, 1, 1, True),
            B(4, 1, 4, True),
            B(8, 1, 2, False),
        ],
        4096: [B(16, 1, 1, True), B(8, 1, 1, True), B(4, 1, 4, True), B(8, 1, 2, False), B(16, 1, 2, True)],
        5120: [
            B(16, 1, 1, False, (4096, 1024)),
            B(32, 1, 1, False, (4096, 1024)),
            B(16, 1, 1, True, (4096, 1024)),
            B(16, 1, 2, True),
            B(wide, 1, 1, False),
            B(16 if rms else 32, 1, 1, True),
        ],
        7168: [B(16, 1, 1, False, (4096, 4096)), B(16, 1, 1, True), B(wide, 1, 1, False), B(16, 1, 2, True)],
        8192: [B(16, 1, 1, False, (4096, 4096)), B(16 if rms else 32, 1, 1, True), B(wide, 1, 1, False), B(16, 1, 2, True)],
        16384: [
            B(32, 1, 1, True, (8192, 8192)),
            B(16, 1, 1, True, (8192, 8192)),
            B(16, 1, 2, False, (8192, 8192)),
            B(8, 1, 2, False, (8192, 8192)),
            B(32, 1, 1, False, (8192, 8192)),
            B(32, 1, 1, False),
            B(8, 1, 1, False, (8192, 8192)),
            B(8, 1, 3, False, (8192, 8192)),
            B(8, 1, 4, False, (8192, 8192)),
            B(4, 1, 4, False, (8192, 8192)),
            B(8, 1, 2, True, (8192, 8192)),
        ],
    }
    out = {"today": None}
    for c in table.get(h, []):
        name = f"w{c.warps}r{c.rows}x{c.per_sm}{'p' if c.prefetch else ''}" + (f"_split{c.parts[0]}" if c.parts else "")
        out[name] = c
    return out


def _lnfwd_variants(h: int) -> dict:
    """name -> (num_warps, programs per SM, stages) of the staged LayerNorm forward (None: today's)."""
    from truefuse.ops.norm.norm_config import ln_fwd_staged_config

    w, k, s = ln_fwd_staged_config(h, torch.bfloat16)
    out = {"today": None}
    for c in {(max(1, w // 2), k, s), (min(32, 2 * w), k, s), (w, max(1, k // 2), s), (w, min(32, 2 * k), s), (w, k, 4)}:
        if c != (w, k, s):
            out[f"fwd_w{c[0]}x{c[1]}s{c[2]}"] = c
    return out


#: the TMA-staged backward's candidates per BLOCK_N: (num_warps, programs per SM, stages), at most
#: ~192 KB of staged x and dy rows per SM. Run 1 (2026-11-23, one H200, (1, 1, BLOCK_N) boxes):
#: 2880 -3 to -5%, 7168 -1%, ties at 2048-8192, the pointer kernels ahead at 1024 (5-9%), 5120 at
#: 16384 rows and 16384 (40%). Run 2 added (1, BLOCK_N // 64, 64) boxes: as fast or faster (RMSNorm
#: 5120 w16x1s4 -7%, LayerNorm 7168 w16x1s4 -5%), now the only form (ops/norm/norm_config.py::STAGED_INNER);
#: raw: docs/results/norms/norm_staged_bwd_h200_2026-11-23.json. Run 3 (``TF_STAGED_CANDS``, 2880 and
#: 5120): four stages at fewer warps, RMSNorm 5120 (8, 1, 4) -2%, LayerNorm 2880 (4, 2, 4) -4.8%,
#: LayerNorm 5120 (8, 1, 4) -3.5 to -4.1% against the pointer kernel (``norm_staged_bwd_h200_2026-11-23_run3.json``). Run 4
#: (4096, 7168, 8192; four to six stages, three programs per SM): nothing better than the choice
#: by more than 1% (``norm_staged_bwd_h200_2026-11-23_run4.json``).
#: ops/norm/norm_config.py::bwd_staged_config took the winners.
STAGED = {
    1024: [(4, 8, 3), (2, 16, 3)],
    2048: [(8, 4, 3), (4, 4, 3)],
    4096: [(4, 2, 3), (8, 2, 4), (8, 2, 3), (4, 4, 2)],
    8192: [(8, 1, 3), (16, 1, 4), (16, 1, 3), (8, 2, 2)],
    16384: [(16, 1, 2), (32, 1, 2)],
}


#: ``ops/norm/norm_config.py::bwd_math``'s choices (``--what math``; "today": its choice for the size):
#: LayerNorm's two row sums in one ``tl.reduce``, x and dy held in bf16 through the sums. Runs
#: 2026-11-23 (one H200; raw docs/results/norms/norm_math_h200_2026-11-23_run{1,2}.json): ONE_REDUCE
#: -2 to -3.5% at LayerNorm 5120, a tie or up to +1.7% elsewhere; at 16384 both -4.6 to -5.7%
#: (REMAT alone +4%, ONE_REDUCE alone +27-30%). Every variant gave today's dx bits. Also tried
#: (run 1's "fma_dx"; its code not kept): dx as two fused multiply-adds, +19% at 4096, at best
#: -0.9% elsewhere.
MATH = {
    "none": dict(ONE_REDUCE=False, REMAT=False),
    "one_reduce": dict(ONE_REDUCE=True, REMAT=False),
    "remat": dict(ONE_REDUCE=False, REMAT=True),
    "one_remat": dict(ONE_REDUCE=True, REMAT=True),
}
#: Also tried at 16384 (session 9; its code not kept; raw docs/results/norms/norm_even_h200_2026-11-23.json, where
#: "today" is the tried kernel and "masked" / "one_remat_masked" the library's): the two-part kernel
#: with no column masks where N fills the parts (no zero-fill before the loads, no select of x̂: 11% fewer
#: instructions, the same bits). Slower: LayerNorm +4.5% / +6.7% at 8192 / 16384 rows (spills 10 -> 22),
#: RMSNorm +0.8-1.3%.


#: ``--what lnfwd``: LayerNorm's staged forward, today's choice against the winners of the forward
#: alone (``exp_norm_tma.py --fwd-only``, in history at d49a912; (num_warps, programs per SM, stages)). Run 1 (2026-11-23,
#: session 10, one H200, 5 rounds; raw docs/results/norms/norm_lnfwd_h200_2026-11-23_run1.json): the
#: forward alone's wins do not carry at 4096 and 8192 (four stages: +6-10% forward + backward) nor
#: 2048 / 2880 / 7168 (±0.5%); 5120 (4, 2, 4) -2.4% / -1.3% at 8192 / 16384 rows, which
#: ``ln_fwd_staged_config`` took; 5120's entry is now the choice before it (run 2, 7 rounds: -2.3% at
#: both row counts). Run 3 (the forward alone's three-stage runners-up at 4096 and 8192): 4096
#: (4, 4, 3) -1.1% / -0.7%, 8192 (4, 2, 3) -0.2%: within two runs' spread of today, not taken.
LNFWD = {
    2048: [(2, 8, 3)],
    2880: [(2, 4, 3)],
    4096: [(4, 2, 4), (2, 2, 4), (8, 2, 4), (4, 4, 3), (2, 4, 3)],
    5120: [(8, 2, 3), (8, 2, 4)],
    7168: [(4, 2, 3), (8, 2, 4)],
    8192: [(8, 1, 4), (4, 1, 4), (4, 2, 3), (16, 2, 3)],
}


def _staged_variants(h: int) -> dict:
    """name -> (num_warps, programs per SM, stages) of the staged backward ("pointer": the pointer
    kernels of bwd_config; None: today's choice); ``TF_STAGED_CANDS`` ("w,k,s w,k,s ...")
    replaces ``STAGED``'s candidates (the compile workers read it too)."""
    out = {"today": None, "pointer": "pointer"}
    env = os.environ.get("TF_STAGED_CANDS")
    cands = [tuple(int(v) for v in c.split(",")) for c in env.split()] if env else STAGED[1 << (h - 1).bit_length()]
    for c in cands:
        out[f"tma_w{c[0]}x{c[1]}s{c[2]}"] = c
    return out


def _use(h: int, target: str, cfg) -> None:
    """Patch ``ops.norm`` so hidden size ``h`` runs ``cfg`` for ``target`` ("bwd", "staged",
    "lnfwd" or "math"); ``cfg`` None restores today's."""
    import truefuse.ops.norm.norm as ops_norm

    if not hasattr(ops_norm, "_resweep_orig"):
        ops_norm._resweep_orig = (ops_norm.bwd_config, ops_norm.ln_fwd_staged_config, ops_norm.pdl_trigger,
                                  ops_norm.bwd_staged_config)  # fmt: skip
        ops_norm._resweep_math = ops_norm.bwd_math
    bwd, lnfwd, trig, staged = ops_norm._resweep_orig
    ops_norm.bwd_config, ops_norm.ln_fwd_staged_config, ops_norm.pdl_trigger = bwd, lnfwd, trig
    ops_norm.bwd_staged_config = staged
    ops_norm.bwd_math = math = ops_norm._resweep_math
    if cfg is None:
        return
    if target == "math":
        ops_norm.bwd_math = lambda n, rms: dict(cfg) if n == h else math(n, rms)
        return
    if target == "staged":
        pick = None if cfg == "pointer" else cfg
        ops_norm.bwd_staged_config = lambda n, dtype, rms=True: pick if n == h else staged(n, dtype, rms)
        return
    # the PDL trigger stays today's choice for the size, whatever the variant (it reads bwd_config)
    today = {(k, r): trig(k, h, r) for k in ("fwd", "bwd") for r in (True, False)}
    ops_norm.pdl_trigger = lambda kernel, n, rms: today[(kernel, rms)] if n == h else trig(kernel, n, rms)
    if target == "bwd":
        ops_norm.bwd_config = lambda n, rms=True: cfg if n == h else bwd(n, rms)
    else:
        ops_norm.ln_fwd_staged_config = lambda n, dtype: cfg if n == h else lnfwd(n, dtype)


def _case(kind: str, m: int, h: int):
    import truefuse
    import truefuse.ops.norm.norm as ops_norm

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(m + h)
    x = torch.randn(m, h, device=dev, dtype=bf, generator=g).requires_grad_()
    dy = torch.randn(m, h, device=dev, dtype=bf, generator=g)
    params = [(torch.rand(h, device=dev, dtype=bf, generator=g) + 0.5).requires_grad_()]
    if kind == "ln":
        params.append((0.1 * torch.randn(h, device=dev, dtype=bf, generator=g)).requires_grad_())
    f = truefuse.rms_norm if kind == "rms" else truefuse.layer_norm
    fn = lambda: torch.autograd.grad(f(x, *params, eps=1e-5), (x, *params), dy)
    ref_fn = ops_norm.rms_norm_ref if kind == "rms" else ops_norm.layer_norm_ref
    return fn, ref_fn, x, dy, params


def _variants(h: int, kind: str, what: str) -> list:
    """(target, name, cfg) to time at hidden size ``h``: the staged backward's candidates
    (``what`` "staged"), or the pointer backward's and LayerNorm's staged forward's ("pointer")."""
    if what == "staged":
        return [("staged", n, c) for n, c in _staged_variants(h).items()]
    if what == "lnfwd":
        cands = LNFWD.get(h, []) if kind == "ln" else []
        return [("lnfwd", "today", None)] + [("lnfwd", f"fwd_w{c[0]}x{c[1]}s{c[2]}", c) for c in cands] if cands else []
    if what == "math":  # ops/norm/norm_config.py::bwd_math: today's kernels, their schedule choices
        return [("math", "today", None)] + [("math", n, c) for n, c in MATH.items() if kind == "ln" or not c["ONE_REDUCE"]]
    out = [("bwd", n, c) for n, c in _bwd_variants(h, kind == "rms").items()]
    if kind == "ln":
        out += [("lnfwd", n, c) for n, c in _lnfwd_variants(h).items() if c is not None]
    return out


def _jobs(hs, what):
    return [(h, kind, *v) for h in hs for kind in ("rms", "ln") for v in _variants(h, kind, what)]


def _compile_worker(jobs):
    errs = []
    for h, kind, target, name, cfg in jobs:
        try:
            _use(h, target, cfg)
            fn = _case(kind, 256, h)[0]
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # reported, the variant is skipped later
            errs.append(f"{kind} {h} {name}: {type(e).__name__}: {str(e)[:160]}")
    return errs


def main():
    from exp_norm_breakdown import gtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=min(12, (os.cpu_count() or 2) - 1))
    ap.add_argument("--what", choices=("staged", "pointer", "math", "lnfwd"), default="staged")
    ap.add_argument("--regs", action="store_true", help="print the compiled kernels' registers and spills at the end")
    args = ap.parse_args()
    t0 = time.time()
    jobs = _jobs(args.hidden, args.what)
    with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as ex:
        errs = [e for r in ex.map(_compile_worker, [jobs[i :: args.workers] for i in range(args.workers)]) for e in r]
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s; errors: {errs or 'none'}", flush=True)
    rows = []
    for h in args.hidden:
        for m in ROWS:
            for kind in ("rms", "ln"):
                if not _variants(h, kind, args.what):
                    continue
                fn, ref_fn, x, dy, params = _case(kind, m, h)
                xd = x.detach().double().requires_grad_()
                pd = [p.detach().double().requires_grad_() for p in params]
                ref = torch.autograd.grad(ref_fn(xd, *pd, 1e-5), (xd, *pd), dy.double())
                z1, z2 = torch.empty_like(dy), torch.empty_like(dy)
                floor = gtime(lambda: (z1.copy_(x.detach()), torch.add(x.detach(), dy, out=z2)))
                variants = _variants(h, kind, args.what)
                errs, times, same_dx, dx_first = {}, {}, {}, None
                for target, name, cfg in variants:
                    _use(h, target, cfg)
                    try:
                        got = fn()
                        errs[name] = max(((a.double() - r).norm() / r.norm()).item() for a, r in zip(got, ref, strict=True))
                        dx_first = got[0] if dx_first is None else dx_first  # "today" runs first
                        same_dx[name] = torch.equal(got[0], dx_first)
                        times[name] = (target, cfg, [])
                    except Exception as e:
                        print(f"{kind} {m} x {h} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                for _ in range(args.rounds):
                    for target, cfg, ts in times.values():
                        _use(h, target, cfg)
                        ts.append(gtime(fn))
                _use(h, "bwd", None)
                med = {n: statistics.median(ts) for n, (_, _, ts) in times.items()}
                rows.append({"kind": kind, "M": m, "H": h, "floor_us": floor, "us": med, "rel_err": errs, "dx_bits_as_today": same_dx,
                             "configs": {n: (t, c if c is None or isinstance(c, str) else list(c)) for n, (t, c, _) in times.items()}})  # fmt: skip
                print(f"{kind:3s} {m:5d} x {h:5d} | floor {floor:6.1f} | today {med['today']:6.1f} ({floor / med['today']:.0%}) | "
                      + "".join(f"{n} {med[n]:6.1f} ({floor / med[n]:.0%}) | " for n in ("pointer",) if n in med)
                      + " ".join(f"{n} {med[n]:.1f}" for n in sorted(med, key=med.get)[:3])
                      + "".join(f" | BAD {n} {e:.1e}" for n, e in errs.items() if e >= 1e-2)
                      + " | dx bits as today: " + " ".join(n for n, v in same_dx.items() if v and n != "today"), flush=True)  # fmt: skip
    with open(os.path.join(args.out, f"norm_resweep_{args.what}.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(f"{time.time() - t0:.0f} s")
    if args.regs:
        from exp_norm_breakdown import _print_regs

        _print_regs()


if __name__ == "__main__":
    main()
