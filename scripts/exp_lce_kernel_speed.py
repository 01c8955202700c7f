"""The linear cross-entropy's loss kernel alone (kernels/cross_entropy.py) over (tokens, V) bf16
logits with gradients, across launch configurations (BLOCK_V, num_warps), for each issue shape's
vocabulary; ms and the effective bandwidth of its 3 passes over the logits (read, read, write).
Usage: python scripts/exp_lce_kernel_speed.py [tokens]"""

import sys

import torch
import triton

from truefuse.kernels.cross_entropy import _lce_chunk_kernel

try:  # the previous kernel, when a copy of it sits beside this script (for a side-by-side)
    from _old_ce_kernel import _lce_chunk_kernel as _old
except ImportError:
    _old = None

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
CONFIGS = [(1024, 1), (1024, 2), (1024, 4), (2048, 2), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 16), (16384, 32)]
g = torch.Generator(device="cuda").manual_seed(0)


def sweep(V):
    src = torch.randn(N, V, generator=g, device="cuda", dtype=torch.bfloat16) * 3
    logits = src.clone()
    t = torch.randint(0, V, (N,), generator=g, device="cuda")
    ce, zl = torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    ok = torch.empty(N, dtype=torch.bool, device="cuda")
    one = torch.ones((), device="cuda")

    def run(bv, nw, kernel=_lce_chunk_kernel):
        kernel[(N,)](
            logits, logits.stride(0), t, ce, ce, zl, ok, one, one, V, -100, float(V), 0.0, 0.0, 1.0,
            HAS_CW=False, SMOOTH=False, SOFTCAP=False, WANT_GRAD=True, PER_TOKEN=False, BLOCK_V=bv, num_warps=nw,
        )  # fmt: skip

    ref_ce = None
    for bv, nw in CONFIGS:
        logits.copy_(src)
        run(bv, nw)
        ref_ce = ce.clone() if ref_ce is None else ref_ce
        dev = (ce - ref_ce).abs().max().item()
        ms = triton.testing.do_bench(lambda bv=bv, nw=nw: run(bv, nw), warmup=10, rep=200, return_mode="median")
        gbs = 3 * N * V * 2 / ms / 1e6
        print(f"V={V:7d} BLOCK_V={bv:6d} warps={nw:3d}  {ms:7.3f} ms  {gbs:7.0f} GB/s  max|ce-ce0|={dev:.1e}", flush=True)
    if _old is not None:
        ms = triton.testing.do_bench(lambda: run(4096, 8, _old), warmup=10, rep=200, return_mode="median")
        print(f"V={V:7d} previous kernel 4096/8  {ms:7.3f} ms  {3 * N * V * 2 / ms / 1e6:7.0f} GB/s", flush=True)


for V in (128256, 32000, 256000):
    sweep(V)
