"""Can a persistent TMA kernel (``kernels/gemm_tma.py``) bring the batch-invariant GEMM at many rows
within issue 34's goals (forward ≤ 1.10×, input gradient ≤ 1.15× cuBLAS at M = 8192, Llama-8B shapes)
with the plain kernel's bits?

For each candidate (tile, warps, stages, warp specialisation) and layout (``nt`` forward ``x Wᵀ``,
``nn`` input gradient ``dy W``): the bits against the plain kernel's reference tile
(``gemm_backends/triton.py::run_tiles``, 128×128, 8 warps, 4 stages) at M = 8192 and against its
decode tile on the first 16 rows; the time against ``torch.mm`` (cuBLAS) in the same process
(``do_bench`` medians, 3 interleaved rounds). Prints one line per candidate and shape.

Run on an H100: ``python experiments/exp_bi_gemm_tma.py [--m 8192]``.
"""

import argparse
import functools


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8192)
    args = p.parse_args()

    import torch
    from triton.testing import do_bench

    from truefuse.kernels.gemm_tma import _gemm_tma_kernel
    from truefuse.ops.gemm.gemm_backends.triton import run_tiles

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf, M = torch.bfloat16, args.m
    shapes = [(4096, 4096), (4096, 14336), (14336, 4096)]
    cands = [(128, 256, 8, 3, False), (256, 128, 8, 3, False), (128, 128, 8, 4, False)]
    cands += [(128, 256, 8, 3, True), (128, 128, 8, 4, True)]  # warp-specialised
    print(f"{'layout':6s} {'tile':16s} {'ws':3s} " + " ".join(f"{f'{k}x{n}':>14s}" for k, n in shapes) + "  bits")
    for layout in ("nt", "nn"):
        for cand in [None] + cands:
            cells, bits = [], True
            for K, N in shapes:
                g = torch.Generator(device="cuda").manual_seed(K + N)
                w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(bf)
                # forward x (M, K) @ W (N, K)ᵀ; input gradient dy (M, N) @ W (N, K), inner dimension N
                a = torch.randn(M, K if layout == "nt" else N, device="cuda", generator=g).to(bf)
                b = w.t() if layout == "nt" else w
                try:
                    run = _candidate(cand, layout, a, w, b, sms, run_tiles, None, _gemm_tma_kernel)
                    got = run()
                except Exception as e:  # a candidate this Triton cannot compile
                    print(f"# {layout} {cand} {K}x{N}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    cells.append(f"{type(e).__name__:>14s}")
                    continue
                ref = run_tiles(a, b, (128, 128, 8, 4))
                small = run_tiles(a[:16], b, (16, 64, 4, 4))
                ok = torch.equal(got, ref) and torch.equal(got[:16], small)
                bits = bits and ok
                t_ours, t_cublas = [], []
                for r in range(3):
                    pair = [(run, t_ours), (lambda a=a, b=b: torch.mm(a, b), t_cublas)]
                    for fn, acc in pair if r % 2 == 0 else pair[::-1]:
                        acc.append(do_bench(fn, warmup=10, rep=60))
                ratio = sorted(t_ours)[1] / sorted(t_cublas)[1]
                cells.append(f"{ratio:>13.3f}x" if ok else f"{'DIFF ' + format(ratio, '.2f'):>14s}")
            tile = "plain kernel" if cand is None else "{}x{} {}w {}s".format(*cand[:4])
            row = f"{layout:6s} {tile:16s} {'ws' if cand and cand[4] else '-':3s} " + " ".join(cells)
            print(row + f"  {'same' if bits else 'DIFF'}", flush=True)


def _candidate(cand, layout, a, w, b, sms, run_tiles, TensorDescriptor, kernel):
    """A call computing ``a @ b`` and returning its output: the plain kernel at today's table entry
    for many rows (``cand`` None: 256x128 forward, 128x256 input gradient), or the TMA kernel."""
    import torch
    import triton

    from truefuse.ops.gemm.gemm_backends.triton import _tma_scratch

    if cand is None:
        return functools.partial(run_tiles, a, b, (256, 128, 8, 4) if layout == "nt" else (128, 256, 8, 3))
    bm, bn, warps, stages, ws = cand
    M, k_in = a.shape
    n_out = b.shape[1]
    N, K = w.shape
    out = torch.empty(M, n_out, device=a.device, dtype=a.dtype)
    grid = (min(sms, triton.cdiv(M, bm) * triton.cdiv(n_out, bn)),)
    kw = dict(B_NK=layout == "nt", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, WS=ws, num_warps=warps, num_stages=stages)

    def run():  # the descriptors made on the device (kernels/gemm_tma.py)
        with _tma_scratch(a.device):
            kernel[grid](a, w, out, M, n_out, k_in, a.stride(0), w.stride(0), out.stride(0), **kw)
        return out

    return run


if __name__ == "__main__":
    main()
