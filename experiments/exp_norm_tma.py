# ruff: noqa: E501, E731, B023
"""Experiment: the norm's row loops with the rows brought in by TMA (Hopper tensor descriptors) and
software-pipelined (``tl.range(..., num_stages=S)``): S rows in flight per program in shared memory
instead of one prefetched row in registers (issue #16 item 3, lead 3). The kernels live here, not in
truefuse: nothing selects them until they measure faster.

* The backward (RMSNorm and LayerNorm): RMSNorm's backward is at 77-78% of its copy part at 2880 /
  5120 and 68% at 16384 (registers cap it at two programs of one prefetched row per SM).
* The forward (LayerNorm: 58-86% of its copy part; RMSNorm for comparison).

The descriptor block is (1, BLOCK_N), BLOCK_N the next power of two: the columns past H read as
zero (no padding traffic). Each variant is checked against an fp32 torch reference (relative L2 <
1e-2) and for batch invariance (the rows of a 37-row and a 1-row call are the full call's bits),
then timed alone against the current kernel (ops/norm.py's configuration) and the copy parts.

Run: ``PYTHONPATH=. python experiments/exp_norm_tma.py [--out DIR] [--budget S]``.

Result (2026-11-23, one H200, torch 2.11, triton 3.6; 23 s after a 9 s compile; M = 8192; µs alone,
% of the copy part; (warps, programs per SM, stages)):

* LayerNorm forward: three stages win at every size tried; two stages lose everywhere (the loop
  then waits on each row). 1024: 9.0 -> 8.4 µs (66 -> 72%; 2, 16, 3); 2880: 37.4 -> 28.0 (66 ->
  88%; 4, 4, 3); 5120: 73.1 -> 56.4 (57 -> 74%; 16, 2, 3); 8192: 87.9 -> 76.7 (76 -> 87%; 16, 2,
  3); 16384: 174.9 -> 140.1 (74 -> 93%; 16, 1, 3). Four stages were not tried (they fit at 1 or 2
  programs per SM).
* RMSNorm forward: a tie at 1024-5120, 8192 slower (71.2 -> 75.5), 16384 faster (149.5 -> 143.5);
  its per-row code and layout are the fused allreduce's (bit-coupled): not a candidate as is.
* Backward: slower than today's kernels except RMSNorm at 2880 (45.0 -> 42.3 µs, 77 -> 82%; 2
  programs per SM, 3 stages) and a tie for LayerNorm at 2880; 16384 (two stages only: the shared
  memory) 21-26% slower; dx stored by TMA: slower everywhere.
* Every variant: errors < 1e-2 against fp32 and batch invariant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exp_norm_sums import cur_bwd, cur_fwd  # noqa: E402
from exp_norm_sweep import bwd_grid, check_bwd, gtime, npow2, open_log, reference, rel  # noqa: E402
from exp_norm_variants import close_out, floor_inputs, precompile  # noqa: E402
from exp_norm_variants import launch_bwd as launch_bwd_cur  # noqa: E402
from exp_norm_variants import launch_fwd as launch_fwd_cur  # noqa: E402

HS = (1024, 2880, 5120, 8192, 16384)
M0 = 8192
SMEM = 160 * 1024  # shared memory per SM the staged rows may take


@triton.jit(do_not_specialize=["M"])
def _fwd_tma_kernel(x_desc, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, stride_y, M, N, eps,
                    IS_RMS: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0)
    for row in tl.range(pid, M, P, num_stages=STAGES):
        x = x_desc.load([row, 0]).to(tl.float32)
        r1 = row + tl.arange(0, 1)
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(cmask, x - mean[:, None], 0.0)
            tl.store(mean_ptr + r1, mean)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, axis=1) / N + eps)
        y = xc * rstd[:, None] * w.to(tl.float32)
        if HAS_B:
            y = y + b.to(tl.float32)
        tl.store(y_ptr + tl.cast(row, tl.int64) * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cmask)
        tl.store(rstd_ptr + r1, rstd)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _bwd_tma_kernel(dy_desc, x_desc, dx_desc, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, stride_dx,
                    M, N, rows_per_program, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                    DX_TMA: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    dw = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in tl.range(row_start, row_end, num_stages=STAGES):
        x = x_desc.load([row, 0]).to(tl.float32)
        dy = dy_desc.load([row, 0]).to(tl.float32)
        r1 = row + tl.arange(0, 1)
        rstd = tl.load(rstd_ptr + r1)[:, None]
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(mean_ptr + r1)[:, None]
            xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
        wdy = dy * w.to(tl.float32)
        c1 = (tl.sum(xhat * wdy, axis=1) / N)[:, None]
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = (tl.sum(wdy, axis=1) / N)[:, None]
            dx = (wdy - (xhat * c1 + c2)) * rstd
        if DX_TMA:
            dx_desc.store([row, 0], dx.to(dx_ptr.dtype.element_ty))
        else:
            tl.store(dx_ptr + tl.cast(row, tl.int64) * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
        dw += dy * xhat
        db += dy
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)
    if not IS_RMS:
        tl.store(db_part_ptr + pid * N + cols, db, mask=cmask)


def _desc(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [1, block])


def launch_fwd(kind, cfg, x, w, b, y, mean, rstd, sms, pdl=False):
    """cfg: ("tma", warps, programs per SM, stages), else the current kernel's (warps, per-SM, WB)."""
    if cfg[0] != "tma":
        return launch_fwd_cur(kind, cfg, x, w, b, y, mean, rstd, sms, pdl)
    _, warps, k, stages = cfg
    M, N = x.shape
    block = npow2(N)
    _fwd_tma_kernel[(min(M, k * sms),)](
        _desc(x, block), w, b if kind == "ln" else w, y, mean if kind == "ln" else rstd, rstd, y.stride(0), M, N, 1e-5,
        IS_RMS=kind == "rms", HAS_B=kind == "ln", BLOCK_N=block, STAGES=stages, num_warps=warps,
    )  # fmt: skip


def launch_bwd(kind, cfg, dy, x, w, mean, rstd, dx, dw_part, db_part, sms, pdl=False):
    """cfg: ("tma", warps, 1, programs per SM, stages, dx by TMA), else exp_norm_variants' tuple."""
    if cfg[0] != "tma":
        return launch_bwd_cur(kind, cfg, dy, x, w, mean, rstd, dx, dw_part, db_part, sms, pdl)
    _, warps, _, k, stages, dx_tma = cfg
    M, N = x.shape
    block = npow2(N)
    programs, rpp = bwd_grid(M, 1, k, sms)
    _bwd_tma_kernel[(programs,)](
        _desc(dy, block), _desc(x, block), _desc(dx, block), w, mean if kind == "ln" else rstd, rstd, dx, dw_part,
        db_part if kind == "ln" else dw_part, dx.stride(0), M, N, rpp,
        IS_RMS=kind == "rms", BLOCK_N=block, STAGES=stages, DX_TMA=dx_tma, num_warps=warps,
    )  # fmt: skip
    return programs


def launch_sum(*a, **k):  # the compile worker's interface; no sum jobs here
    raise NotImplementedError


def fwd_cfgs(h, kind):
    block = npow2(h)
    warps = cur_fwd(h, kind)[0]
    out = [cur_fwd(h, kind)]
    for k in (8, 16) if h <= 1024 else (1, 2, 4):
        for s in (2, 3):
            if k * s * block * 2 <= SMEM:
                out.append(("tma", warps, k, s))
    return out


def bwd_cfgs(h, kind):
    block = npow2(h)
    cur = cur_bwd(h, kind)
    out = [cur]
    for k in (2, 4) if h <= 1024 else (1, 2):
        for s in (2, 3):
            if k * s * 2 * block * 2 <= SMEM:
                out.append(("tma", cur[1], 1, k, s, False))
    if len(out) > 1:
        out.append(out[1][:5] + (True,))
    return out


def _jobs(hs):
    jobs = []
    for h in hs:
        for kind in ("rms", "ln"):
            jobs += [("fwd", kind, h, c, False) for c in fwd_cfgs(h, kind)[1:]]
            jobs += [("bwd", kind, h, c, False) for c in bwd_cfgs(h, kind)[1:]]
    return jobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workers", type=int, default=min(15, (os.cpu_count() or 2) - 1))
    ap.add_argument("--budget", type=float, default=60.0, help="seconds; later sizes skipped past it")
    args = ap.parse_args()
    t_start = time.time()
    say = open_log(args.out, "norm_tma.txt")
    if args.workers > 0:
        precompile(HS, args.workers, say, _jobs(HS), "exp_norm_tma")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf16 = torch.bfloat16
    rows, bad = [], []
    say(f"M = {M0}; µs alone (CUDA graph of 10), % of the copy part (fwd: copy_, bwd: add); (cur) = ops/norm.py today")
    for h in HS:
        if time.time() - t_start > args.budget:
            say(f"budget: H >= {h} skipped")
            break
        x, dy, g, fl = floor_inputs(h, M0)
        for kind in ("rms", "ln"):
            w = (torch.rand(h, device=dev, generator=g) + 0.5).to(bf16)
            b = torch.randn(h, device=dev, generator=g).to(bf16)
            y_ref, dx_ref, dw_ref, db_ref = reference(kind, x, w, b, dy)
            y, mean, rstd = torch.empty_like(x), torch.empty(M0, device=dev), torch.empty(M0, device=dev)
            line = []
            for c in fwd_cfgs(h, kind):
                y.fill_(float("nan"))
                try:
                    launch_fwd(kind, c, x, w, b, y, mean, rstd, sms)
                    inv = True
                    for lo, hi in ((0, 37), (5, 6)):
                        ys = torch.full_like(y[lo:hi], float("nan"))
                        f32 = torch.empty(hi - lo, device=dev)
                        launch_fwd(kind, c, x[lo:hi], w, b, ys, f32, f32.clone(), sms)
                        inv = inv and bool(torch.equal(ys, y[lo:hi]))
                    err = rel(y, y_ref)
                    t = gtime(lambda: launch_fwd(kind, c, x, w, b, y, mean, rstd, sms))
                except Exception as e:  # noqa: BLE001
                    bad.append(f"fwd {kind} H{h} {c}: {type(e).__name__} {str(e)[:300]}")
                    continue
                if err > 1e-2 or not inv:
                    bad.append(f"fwd {kind} H{h} {c}: err {err:.2e} invariant {inv}")
                rows.append(dict(op="fwd", kind=kind, H=h, M=M0, cfg=list(c), us=t, err=err, invariant=inv))
                line.append(f"{c}{'(cur)' if c == fwd_cfgs(h, kind)[0] else ''} {t:.1f} ({100 * fl[0] / t:.0f}%)")
            say(f"{kind} H{h} fwd: " + "; ".join(line))
            launch_fwd_cur(kind, cur_fwd(h, kind), x, w, b, y, mean, rstd, sms)  # the statistics
            dx = torch.empty_like(x)
            line = []
            for c in bwd_cfgs(h, kind):
                P, _ = bwd_grid(M0, c[2], c[3], sms)
                dwp, dbp = torch.empty(P, h, device=dev), torch.empty(P, h, device=dev)
                dx.fill_(float("nan"))
                try:
                    launch_bwd(kind, c, dy, x, w, mean, rstd, dx, dwp, dbp, sms)
                    err, inv = check_bwd(
                        launch_bwd, kind, c, (dy, x, w, mean, rstd, dx, dwp, dbp), sms, (dx_ref, dw_ref, db_ref), True
                    )
                    t = gtime(lambda: launch_bwd(kind, c, dy, x, w, mean, rstd, dx, dwp, dbp, sms))
                except Exception as e:  # noqa: BLE001
                    bad.append(f"bwd {kind} H{h} {c}: {type(e).__name__} {str(e)[:300]}")
                    continue
                if err > 1e-2 or not inv:
                    bad.append(f"bwd {kind} H{h} {c}: err {err:.2e} invariant {inv}")
                rows.append(dict(op="bwd", kind=kind, H=h, M=M0, cfg=list(c), us=t, err=err, invariant=inv))
                line.append(f"{c}{'(cur)' if c == bwd_cfgs(h, kind)[0] else ''} {t:.1f} ({100 * fl[1] / t:.0f}%)")
            say(f"{kind} H{h} bwd: " + "; ".join(line))
    close_out(
        say, bad, "errors < 1e-2 vs fp32; batch invariant", {"rows": rows}, os.path.join(args.out, "norm_tma.json"), t_start
    )


if __name__ == "__main__":
    sys.exit(main())
