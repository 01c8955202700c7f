"""Issue 16, fused ``main_grad``: a warp-specialised weight gradient (Triton's Hopper autoWS) that could
overlap the main_grad epilogue with the next tile's loads.

Run once on an H200 (2026-11-23, triton 3.6.0, the lead's call at cc532a9): the warp-specialisation
pass fails there for every candidate (``PassManager::run failed`` in ``NVGPUWarpSpecialization``); the
control without it is bitwise equal to the committed kernel (host list and device splits) and
1.25-1.71x slower (8 x 2048 fc2 5.149 vs 4.062 ms, 64 x 256 fc1 1.525 vs 0.950, 128 x 128 fc1 1.570
vs 0.918). So on triton 3.6 this route is closed; with triton >= 3.9 it is to be tried.

``PYTHONPATH=. python experiments/exp_grouped_gemm_ws.py --compile`` (no GPU needed): compiles the
kernel for sm_90 and says whether the warp-specialisation pass applied (a ``ttg.warp_specialize``
op in the final TTGIR), the warps, registers, spills and shared memory.
``PYTHONPATH=. python experiments/exp_grouped_gemm_ws.py`` (an H100/H200): the same, then at the
``bench grouped`` shapes each weight-gradient GEMM adding into main_grad: bitwise against the
committed kernel (ragged splits with an empty group; host list and device tensor), and ms against it,
cuBLAS adding into main_grad and ``rw`` (main_grad read and written once).

Why this shape of kernel (a compile-only probe with triton 3.9 for sm_90, 2026-11-23; the H200 image
has triton 3.6, where it is still to be tried):

* the committed kernel (``_grouped_gemm_wgrad_tma_kernel``) is one program per SM at 128×256: its
  epilogue (main_grad read, add, write) runs while no mainloop does; two programs per SM, a bulk L2
  prefetch of main_grad and staggered starts did not help (exp_grouped_gemm_acc.py at d49a912);
* ``tl.range(..., warp_specialize=True)`` left that kernel unspecialised at 8 warps, and at 4
  warps too while the tail chunk was masked with ``tl.where``. It applied (12 warps: a producer and
  two consumer warpgroups splitting the tile's N rows) once (a) the operands' descriptors are made
  in the kernel per tile, bounded at the group's end, so the copy engine zero-fills the tail (no
  masking in registers; the same 64-row chunks from the group's first row and the same zeros, so
  the bits should be the committed kernel's: the GPU run checks it), and (b) the epilogue is written in the two N halves the
  consumers own. 128×128: 168 registers, 209 KiB of shared memory at 3 stages (160 at 2);
  128×256 spills (728 B: 12 warps leave 168 registers a thread) and needs 2 stages to fit.

Under the CPU interpreter (fp16, the test's ragged splits with an empty group) the kernel gives the
committed kernel's main_grad bitwise for the same tile shape, the empty group's slice untouched.

In-kernel descriptors need a global scratch allocator (``triton.set_allocator``): set here, not in
truefuse.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _add_part(c_desc, part, g, n0, k0, BN: tl.constexpr, BK: tl.constexpr):
    part += c_desc.load([g, n0, k0]).reshape(BN, BK)
    c_desc.store([g, n0, k0], part.reshape(1, BN, BK))


@triton.jit
def _wgrad_ws_kernel(
    dy_ptr, x_ptr, c_ptr, off_ptr, G, M, N, K, stride_dym, stride_xm,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, WS: tl.constexpr, KSPLIT: tl.constexpr,
):  # fmt: skip
    """``main_grad[g] += dy[rows of g]ᵀ @ x[rows of g]`` (fp32), one persistent program per SM."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_group = num_n * num_k
    total = G * per_group
    H: tl.constexpr = BLOCK_N // 2
    Q: tl.constexpr = BLOCK_K // KSPLIT
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[G, N, K], strides=[N * K, K, 1], block_shape=[1, H, Q])
    for tile in tl.range(pid, total, nprog, warp_specialize=WS):
        g = tile // per_group
        local = tile % per_group
        n0 = (local // num_k) * BLOCK_N
        k0 = (local % num_k) * BLOCK_K
        start = tl.minimum(tl.maximum(tl.load(off_ptr + g), 0), M).to(tl.int32)
        end = tl.minimum(tl.maximum(tl.load(off_ptr + g + 1), start), M).to(tl.int32)
        # bounded at the group's end: the copy engine zero-fills the tail chunk's rows past it
        rows = tl.maximum(end, 1)
        dy_d = tl.make_tensor_descriptor(dy_ptr, shape=[rows, N], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_N])
        x_d = tl.make_tensor_descriptor(x_ptr, shape=[rows, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m0 in tl.range(start, end, BLOCK_M):
            acc = tl.dot(dy_d.load([m0, n0]).T, x_d.load([m0, k0]), acc)
        if end > start:  # an empty group leaves main_grad untouched
            # the two N halves the consumer warpgroups own, each in KSPLIT (1 or 2) column parts
            a0, a1 = acc.reshape(2, H, BLOCK_K).permute(1, 2, 0).split()
            if KSPLIT == 1:
                _add_part(c_desc, a0, g, n0, k0, H, BLOCK_K)
                _add_part(c_desc, a1, g, n0 + H, k0, H, BLOCK_K)
            else:
                a00, a01 = a0.reshape(H, 2, Q).permute(0, 2, 1).split()
                a10, a11 = a1.reshape(H, 2, Q).permute(0, 2, 1).split()
                _add_part(c_desc, a00, g, n0, k0, H, Q)
                _add_part(c_desc, a01, g, n0, k0 + Q, H, Q)
                _add_part(c_desc, a10, g, n0 + H, k0, H, Q)
                _add_part(c_desc, a11, g, n0 + H, k0 + Q, H, Q)


#: (BLOCK_N, BLOCK_K, BLOCK_M, warps, stages, epilogue column parts): BLOCK_M 64 as the committed
#: kernel (the same chunks).
#: 128×256 is capped at 168 registers a thread (12 warps share the SM's 64 Ki) and spills 728 B.
CONFIGS = [(128, 128, 64, 4, 3, 1), (128, 128, 64, 4, 2, 1), (128, 256, 64, 4, 2, 2)]


def compile_report(ws: bool = True) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {
        "dy_ptr": "*bf16", "x_ptr": "*bf16", "c_ptr": "*fp32", "off_ptr": "*i64",
        "G": "i32", "M": "i32", "N": "i32", "K": "i32", "stride_dym": "i32", "stride_xm": "i32",
        "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "BLOCK_M": "constexpr", "WS": "constexpr", "KSPLIT": "constexpr",
    }  # fmt: skip
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    for bn, bk, bm, warps, stages, ksplit in CONFIGS:
        const = {"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_M": bm, "WS": ws, "KSPLIT": ksplit}
        try:
            k = triton.compile(
                ASTSource(_wgrad_ws_kernel, sig, const),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": warps, "num_stages": stages},
            )
        except Exception as e:  # noqa: BLE001
            err = [line for line in str(e).splitlines() if "error:" in line][:1]
            print(f"{bn}x{bk} w{warps} s{stages} e{ksplit}: compile error {err or str(e)[:200]}")
            continue
        ttgir = k.asm["ttgir"].replace("tt.warp_specialize", "")
        usage = ""
        if os.path.exists(tool):
            path = "/tmp/_wgrad_ws.cubin"
            open(path, "wb").write(k.asm["cubin"])
            out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
            m = re.search(r"REG:\d+ STACK:\d+", out)
            usage = m.group(0) if m else ""
        print(
            f"{bn}x{bk} w{warps} s{stages} e{ksplit}: warp-specialised {'ttg.warp_specialize' in ttgir}, "
            f"{k.metadata.num_warps} warps, {usage}, shared {k.metadata.shared} B"
        )


def launch(dy, x, offsets, main_grad, cfg, ws: bool = True):
    bn, bk, bm, warps, stages, ksplit = cfg
    G, N, K = main_grad.shape
    tiles = G * triton.cdiv(N, bn) * triton.cdiv(K, bk)
    sms = torch.cuda.get_device_properties(dy.device).multi_processor_count if dy.is_cuda else 3
    grid = (min(sms, tiles),)
    _wgrad_ws_kernel[grid](
        dy, x, main_grad, offsets, G, dy.shape[0], N, K, dy.stride(0), x.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=bm, WS=ws, KSPLIT=ksplit, num_warps=warps, num_stages=stages,
    )  # fmt: skip


LARGE = {"8x2048"}  # the cases whose layers are >= 2^24 weights per group (wgrad_large)


def _ragged(E: int, M: int) -> list[int]:
    """E sizes summing to M: odd sizes (64-row tails), group 1 empty, its rows in group 0."""
    g = torch.Generator().manual_seed(E)
    w = torch.rand(E, generator=g) + 0.5
    s = (w / w.sum() * M).floor().long()
    s[-1] += M - int(s.sum())
    s[0] += s[1]
    s[1] = 0
    return [int(v) for v in s]


def gpu_run() -> None:
    import triton.testing

    import truefuse.ops.grouped_gemm.grouped_gemm as gg
    import truefuse.ops.grouped_gemm.grouped_gemm_config as ggc
    from truefuse.ops.gemm.gemm import gemm

    sys.path.insert(0, os.path.dirname(__file__))
    from exp_grouped_gemm_tune import CASES  # noqa: E402

    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median"))

    for name, p in CASES.items():
        E, H, Fd, tok = p["E"], p["H"], p["F"], p["tokens"]
        M = E * tok
        g = torch.Generator(device=dev).manual_seed(0)
        x, a, dy, h = (torch.randn(M, c, generator=g, device=dev, dtype=torch.bfloat16) for c in (H, Fd, H, 2 * Fd))
        s, rag = [tok] * E, _ragged(E, M)
        off, off_r = gg.split_offsets(s, E, M, dev), gg.split_offsets(rag, E, M, dev)
        off_rd = gg.split_offsets(torch.tensor(rag, device=dev), E, M, dev)
        own = ggc.tile_config("wgrad", torch.bfloat16, dev, 1 << 30 if name in LARGE else 1, True)
        for label, A, B in (("fc2", dy, a), ("fc1", h, x)):
            shape = (E, A.shape[1], B.shape[1])
            start = torch.randn(shape, generator=torch.Generator(device=dev).manual_seed(3), device=dev)
            start[1] = -0.0
            want = start.clone()
            gg._launch_wgrad(A, B, off_r, want, True, own)
            mg = torch.zeros(shape, device=dev)
            row = {
                "cublas_acc": bench(lambda: gemm(A.t(), B, m_splits=s, out=mg, accumulate=True)),  # noqa: B023
                "rw": bench(lambda: mg.mul_(1.0)),  # noqa: B023
                "own": bench(lambda: gg._launch_wgrad(A, B, off, mg, True, own)),  # noqa: B023
            }
            # the control: the same kernel, not specialised, 8 warps (the committed kernel's)
            for cfg, ws in [*((c, True) for c in CONFIGS), ((128, 128, 64, 8, 3, 1), False)]:
                key = f"{'ws' if ws else 'no ws'} {cfg}"
                try:
                    got = start.clone()
                    launch(A, B, off_r, got, cfg, ws)
                    same = torch.equal(got, want)
                    got.copy_(start)
                    launch(A, B, off_rd, got, cfg, ws)
                    same_dev = torch.equal(got, want)
                    t = bench(lambda: launch(A, B, off, mg, cfg, ws))  # noqa: B023
                    row[key] = f"{t:.3f} bitwise {same} device splits {same_dev}"
                except Exception as e:  # noqa: BLE001
                    row[key] = repr(e)[:200]
            print(name, label, {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            start = want = mg = None
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 and report, no GPU needed")
    args = ap.parse_args()
    print(f"triton {triton.__version__}", flush=True)
    compile_report()
    if not args.compile:
        gpu_run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
