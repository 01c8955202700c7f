# ruff: noqa: E501, B023
"""Experiment: LayerNorm's backward with its dw / db accumulators in shared memory (a Gluon kernel,
``_ln_bwd_smem_kernel`` below) against the library's Triton backward (issue #16 item 3).

Why: at hidden 16384 the Triton backward holds two fp32 accumulator rows in registers (255 per
thread at 8 warps, spilling) and cannot prefetch the next row: 63-65% of an add's rate, where
RMSNorm (one accumulator) reaches 85-87%. With the accumulators in shared memory the registers hold
the row, and the next row can come in (cp.async into shared memory, or registers) during this one's math.

Each variant is the backward kernel + the partials' sum, timed in a CUDA graph beside today's
``ops/norm.py::norm_bwd`` on the same inputs, checked against the fp32 reference (dx, dw, db
relative L2) and for batch invariance (rows of a 37-row and a 1-row call equal to the full call's).

Run: ``PYTHONPATH=. python experiments/exp_norm_smem.py [--hidden 16384 5120] [--rows 8192] [--out DIR]``
(one H200; under a minute). ``--compile-only`` (no GPU; triton 3.6's wheel unpacked first on
PYTHONPATH gives the device's compiler) prints each variant's registers, spills and shared memory for sm_90.

Results (2026-11-23, one H200, torch 2.11.0+cu130, triton 3.6.0; backward + partials' sum, µs;
raw docs/results/norm_smem_h200_2026-11-23_run{1,2,3}.json). Not kept:

* 16384 × 8192 rows: the best, the next row by cp.async at 16 warps with the terms kept (no
  rematerialisation), 263.3 against today's 295.1 (0.89×; 70% of an add's rate against 63%); at
  32 warps 268-280 (0.91-0.95×). Every variant batch-invariant and within 1.7e-3 of fp32 (today's too).
  End to end that would take LayerNorm 16384 from 73% to about 78% of the floor: short of 88%.
* Everywhere else slower: 8192 1.39-1.9×, 7168 / 5120 / 4096 / 2880 1.3-3× (first sweep, before
  the conflict-free layout and the unmasked path; 8192 after them). One CTA per SM with one row in
  flight: each row's two block reductions and the shared-memory barriers (7 ``bar.sync`` per row)
  serialise the CTA, where the Triton kernels overlap rows.
* Under Nsight Compute at 16384 both kernels issue an instruction on about half the cycles
  (0.49 vs 0.55 per scheduler) at about half the DRAM rate: about 33 instructions per element,
  the row's math and its fp32 accumulators, not bandwidth, bound the wide LayerNorm backward.
* Shared-memory layout matters: unsplit, each thread's 8 fp32 accumulators (32-byte strides)
  conflict two-way; split into 16-byte halves (``_acc_layout``) 16384 went 329 -> 268 µs.
* The next row in registers (255 registers, spilling at 8 warps) or not ahead at all: 1.07-1.8×.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@gluon.jit
def _widen(v, REMAT: gl.constexpr):
    """``v`` in fp32; with REMAT and bf16 ``v`` by an exact integer shift, which the compiler does
    not merge with an earlier widening (``kernels/norm.py::_widen``)."""
    if REMAT and v.dtype == gl.bfloat16:
        return (v.to(gl.uint16, bitcast=True).to(gl.uint32) << 16).to(gl.float32, bitcast=True)
    return v.to(gl.float32)


@gluon.jit
def _terms(x, dy, w, mean, rstd, cmask, HAS_W: gl.constexpr, ZERO_CENTERED: gl.constexpr, REMAT: gl.constexpr,
           EVEN: gl.constexpr):  # fmt: skip
    """x̂ (0 past N unless EVEN), w·dy and dy in fp32 from the row's x, dy and weight as loaded."""
    xhat = (_widen(x, REMAT) - mean) * rstd
    if not EVEN:
        xhat = gl.where(cmask, xhat, 0.0)
    dyf = _widen(dy, REMAT)
    if HAS_W:
        w = _widen(w, REMAT)
        if ZERO_CENTERED:
            w = w + 1.0
        wdy = dyf * w
    else:
        wdy = dyf
    return xhat, wdy, dyf


@gluon.constexpr_function
def _acc_layout(block_n, vec):
    """The accumulators' shared layout: each thread's ``vec`` fp32 split into 16-byte halves
    ``block_n / 2`` apart, so a quarter-warp's 16-byte accesses are 128 contiguous bytes (no bank
    conflict; unsplit, 32-byte strides conflict two-way). Plain where ``vec`` <= 4."""
    if vec <= 4:
        return gl.SwizzledSharedLayout(1, 1, 1, [0])
    bits = block_n.bit_length() - 1
    bases = [[1], [2]] + [[1 << b] for b in range(3, bits)] + [[4]]
    return gl.SharedLinearLayout(bases)


@gluon.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@gluon.jit
def _fetch(x_s, dy_s, x_ptr, dy_ptr, row, stride_x, stride_dy, cols, lim, STAGE: gl.constexpr, EVEN: gl.constexpr):
    """Row ``row``'s x and dy (columns < lim; all with EVEN): with STAGE == "async" copied into
    ``x_s`` / ``dy_s`` (cp.async, one commit group; returns placeholders), else loaded into registers."""
    x_p = x_ptr + row * stride_x + cols
    dy_p = dy_ptr + row * stride_dy + cols
    if STAGE == "async":
        if EVEN:
            async_copy.async_copy_global_to_shared(x_s, x_p)
            async_copy.async_copy_global_to_shared(dy_s, dy_p)
        else:
            async_copy.async_copy_global_to_shared(x_s, x_p, mask=cols < lim)
            async_copy.async_copy_global_to_shared(dy_s, dy_p, mask=cols < lim)
        async_copy.commit_group()
        return 0.0, 0.0
    elif EVEN:
        return gl.load(x_p), gl.load(dy_p)
    else:
        return gl.load(x_p, mask=cols < lim, other=0.0), gl.load(dy_p, mask=cols < lim, other=0.0)


# M, rows_per_program: not specialised (one kernel for every row count)
@gluon.jit(do_not_specialize=["M", "rows_per_program"])
def _ln_bwd_smem_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    stride_dy, stride_x, stride_dx, M, N, rows_per_program,
    HAS_W: gl.constexpr, HAS_B: gl.constexpr, ZERO_CENTERED: gl.constexpr,
    BLOCK_N: gl.constexpr, VEC: gl.constexpr, WARPS: gl.constexpr, REMAT: gl.constexpr = True,
    STAGE: gl.constexpr = "async", ONE_REDUCE: gl.constexpr = False, EVEN: gl.constexpr = False,
):  # fmt: skip
    """Program p: rows [p·rows_per_program, min((p+1)·rows_per_program, M)); dx per row, and one
    fp32 partial row of dw (and db) per program in ``dw_part_ptr[p]`` (``db_part_ptr[p]``). STAGE:
    how the next row's x and dy come in while this row is worked on: "async" copied into shared
    memory (cp.async), "regs" loaded into registers, "none" not ahead of time."""
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [WARPS], [0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    acc: gl.constexpr = _acc_layout(BLOCK_N, VEC)
    pid = gl.program_id(0)
    cols = gl.arange(0, BLOCK_N, layout=layout)
    cmask = cols < N
    zero = gl.zeros([BLOCK_N], gl.float32, layout)
    dw_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N], acc, zero)
    db_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N], acc, zero)
    x_s = dw_s  # placeholders where nothing is staged
    dy_s = db_s
    if STAGE == "async":
        x_s = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_N], flat)
        dy_s = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [BLOCK_N], flat)
    row_start = pid.to(gl.int64) * rows_per_program
    row_end = gl.minimum(row_start + rows_per_program, M)
    if STAGE != "none":
        x_n, dy_n = _fetch(x_s, dy_s, x_ptr, dy_ptr, row_start, stride_x, stride_dy, cols, N, STAGE, EVEN)
    for row in range(row_start, row_end):
        if STAGE == "async":
            async_copy.wait_group(0)
            x = x_s.load(layout)
            dy = dy_s.load(layout)
            if row + 1 < row_end:
                _fetch(x_s, dy_s, x_ptr, dy_ptr, row + 1, stride_x, stride_dy, cols, N, STAGE, EVEN)
        elif STAGE == "regs":
            x = x_n
            dy = dy_n
            x_n, dy_n = _fetch(x_s, dy_s, x_ptr, dy_ptr, gl.minimum(row + 1, row_end - 1), stride_x, stride_dy, cols,
                               N, STAGE, EVEN)  # fmt: skip
        else:
            x, dy = _fetch(x_s, dy_s, x_ptr, dy_ptr, row, stride_x, stride_dy, cols, N, STAGE, EVEN)
        mean = gl.load(mean_ptr + row)
        rstd = gl.load(rstd_ptr + row)
        if HAS_W:
            if EVEN:
                w = gl.load(w_ptr + cols)
            else:
                w = gl.load(w_ptr + cols, mask=cmask, other=0.0)
        else:
            w = 1.0
        # the row's terms twice: plainly widened for the sums, by the shift after them (REMAT:
        # not merged with the first, so only the 2-byte x, dy and w stay live through the sums)
        xhat, wdy, _ = _terms(x, dy, w, mean, rstd, cmask, HAS_W, ZERO_CENTERED, False, EVEN)
        if ONE_REDUCE:
            s1, s2 = gl.reduce((xhat * wdy, wdy), 0, _add2)
        else:
            s1 = gl.sum(xhat * wdy, axis=0)
            s2 = gl.sum(wdy, axis=0)
        c1 = s1 / N
        c2 = s2 / N
        xhat, wdy, dyf = _terms(x, dy, w, mean, rstd, cmask, HAS_W, ZERO_CENTERED, REMAT, EVEN)
        dx = (wdy - (xhat * c1 + c2)) * rstd
        if EVEN:
            gl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty))
        else:
            gl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
        if HAS_W:
            dw_s.store(dw_s.load(layout) + dyf * xhat)
        if HAS_B:
            db_s.store(db_s.load(layout) + dyf)
    if STAGE == "async":
        async_copy.wait_group(0)
    if HAS_W:
        gl.store(dw_part_ptr + pid * N + cols, dw_s.load(layout), mask=cmask)
    if HAS_B:
        gl.store(db_part_ptr + pid * N + cols, db_s.load(layout), mask=cmask)


HIDDEN = (16384, 8192, 7168, 5120, 4096, 2880, 2048, 1024)
ROWS = (8192, 16384)


def variants(h: int) -> dict:
    """name -> (STAGE, warps, VEC, programs per SM, REMAT, ONE_REDUCE) for hidden size ``h``
    (the row fits one block)."""
    block = 1 << (h - 1).bit_length()
    out = {}
    for stage, warps, vec, per_sm in (("async", 32, 8, 1), ("async", 16, 8, 1), ("async", 32, 4, 1), ("none", 32, 8, 1)):
        if vec * 32 * warps > block or per_sm * (block * 8 + (block * 4 if stage == "async" else 0)) > 200 * 1024:
            continue
        for remat in (True, False):
            for one in (False, True):
                out[f"{stage}_w{warps}_v{vec}_p{per_sm}_{'remat' if remat else 'keep'}{'_one' if one else ''}"] = (
                    stage,
                    warps,
                    vec,
                    per_sm,
                    remat,
                    one,
                )
    return out


def launch(cfg, dy, x, w, b, mean, rstd, dx, programs):
    """The smem kernel + the partials' sum; returns (dw, db)."""
    from truefuse.ops.norm import _sum_partials

    stage, warps, vec, _, remat, one = cfg
    M, N = x.shape
    rpp = -(-M // programs)
    programs = max(1, -(-M // rpp))
    dwp = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    dbp = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    _ln_bwd_smem_kernel[(programs,)](
        dy, x, w, mean, rstd, dx, dwp, dbp, dy.stride(0), x.stride(0), dx.stride(0), M, N, rpp,
        HAS_W=True, HAS_B=True, ZERO_CENTERED=False, BLOCK_N=1 << (N - 1).bit_length(), VEC=vec, WARPS=warps,
        STAGE=stage, REMAT=remat, ONE_REDUCE=one, EVEN=N == 1 << (N - 1).bit_length(), num_warps=warps,
    )  # fmt: skip
    return _sum_partials(dwp, w.dtype, False, dbp, b.dtype)


def compile_only(hs):
    """Registers / spills / shared memory per variant for sm_90, without a GPU."""
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    k = _ln_bwd_smem_kernel

    ptr = ("dy_ptr", "x_ptr", "w_ptr", "dx_ptr")
    f32 = ("mean_ptr", "rstd_ptr", "dw_part_ptr", "db_part_ptr")
    ints = ("stride_dy", "stride_x", "stride_dx", "M", "N", "rows_per_program")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for h in hs:
        for name, (stage, warps, vec, _, remat, one) in variants(h).items():
            sig = {a: "*bf16" for a in ptr} | {a: "*fp32" for a in f32} | {a: "i32" for a in ints}
            block = 1 << (h - 1).bit_length()
            const = dict(HAS_W=True, HAS_B=True, ZERO_CENTERED=False, BLOCK_N=block, VEC=vec, WARPS=warps, REMAT=remat,
                         STAGE=stage, ONE_REDUCE=one, EVEN=h == block)  # fmt: skip
            sig = {a: sig.get(a, "constexpr") for a in k.arg_names}
            div = {(k.arg_names.index(a),): [["tt.divisibility", 16]] for a in (*ptr, *f32, *ints[:3], "N")}
            c = triton.compile(GluonASTSource(k, sig, const, div), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            path = f"/tmp/_smem_{os.getpid()}.cubin"
            with open(path, "wb") as f:
                f.write(c.asm["cubin"])
            res = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+) STACK:(\d+)", res)
            print(f"{h:6d} {name:30s} regs {m.group(1)} stack {m.group(2)} B, shared {c.metadata.shared} B")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--hidden", type=int, nargs="*", default=list(HIDDEN))
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args.hidden)

    from exp_norm_sweep import gtime, reference, rel
    from exp_norm_variants import floor_inputs

    from truefuse.ops._triton import sm_count
    from truefuse.ops.norm import norm_bwd, norm_fwd

    sms = sm_count(0)
    rows = []
    for h in args.hidden:
        for m in args.rows:
            x, dy, g, (tc, ta, _) = floor_inputs(h, m)
            w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(torch.bfloat16)
            b = (0.1 * torch.randn(h, device="cuda", generator=g)).to(torch.bfloat16)
            _, mean, rstd = norm_fwd(x, w, b, 1e-5, rms=False, zero_centered_gamma=False)
            _, dx_ref, dw_ref, db_ref = reference("ln", x, w, b, dy)

            def today():
                return norm_bwd(dy, x, w, b, mean, rstd, rms=False, zero_centered_gamma=False)

            dx0, dw0, db0 = today()
            t0 = gtime(today)
            err0 = max(rel(dx0, dx_ref), rel(dw0, dw_ref), rel(db0, db_ref))
            line = dict(hidden=h, rows=m, add_us=ta, copy_us=tc, today_us=t0, today_err=err0, variants={})
            print(f"H {h} M {m}: add {ta:.1f} µs, today {t0:.1f} µs ({100 * ta / t0:.0f}% of add), err {err0:.1e}", flush=True)
            for name, cfg in variants(h).items():
                dx = torch.empty_like(x)
                programs = cfg[3] * sms
                try:
                    dw, db = launch(cfg, dy, x, w, b, mean, rstd, dx, programs)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a variant that does not build is a result
                    print(f"  {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    line["variants"][name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                    continue
                err = max(rel(dx, dx_ref), rel(dw, dw_ref), rel(db, db_ref))
                inv = True
                for lo, hi in ((0, 37), (5, 6)):
                    dxs = torch.full_like(dx[lo:hi], float("nan"))
                    launch(cfg, dy[lo:hi], x[lo:hi], w, b, mean[lo:hi], rstd[lo:hi], dxs, programs)
                    inv = inv and bool(torch.equal(dxs, dx[lo:hi]))
                t = gtime(lambda: launch(cfg, dy, x, w, b, mean, rstd, dx, programs))
                line["variants"][name] = dict(us=t, err=err, invariant=inv)
                print(
                    f"  {name:30s} {t:8.1f} µs  x{t / t0:.3f} of today  {100 * ta / t:.0f}% of add  err {err:.1e}  invariant {inv}",
                    flush=True,
                )
            rows.append(line)
    with open(os.path.join(args.out, "norm_smem.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
