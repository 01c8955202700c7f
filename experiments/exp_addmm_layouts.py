"""Experiment (GPU): which layout of the bf16 -> fp32 beta=1 weight-gradient GEMM does cuBLAS run
fastest? dW (N×K) += dYᵀ X, written row-major, or the transposed problem Xᵀ dY into dWᵀ.
Prints medians; used to decide the torch backend's call (docs/benchmarks.md)."""

import torch
import triton.testing as tt

M, N, K = 8192, 4096, 4096
g = torch.Generator(device="cuda").manual_seed(0)
dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
mg = torch.randn(N, K, device="cuda", generator=g)
f32 = torch.float32
variants = {
    "bf16 mm (floor)": lambda: torch.mm(dy.t(), x),
    "addmm dYt@X -> mg": lambda: torch.addmm(mg, dy.t(), x, out_dtype=f32, out=mg),
    "addmm Xt@dY -> mg.t()": lambda: torch.addmm(mg.t(), x.t(), dy, out_dtype=f32, out=mg.t()),
    "mm out_dtype (no beta)": lambda: torch.mm(dy.t(), x, out_dtype=f32),
    "bf16 mm again": lambda: torch.mm(dy.t(), x),
}
for shape in [(8192, 4096, 4096), (16384, 4096, 4096), (8192, 14336, 4096)]:
    M, N, K = shape
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    mg = torch.randn(N, K, device="cuda", generator=g)
    base = None
    for name, fn in variants.items():
        try:
            ms = tt.do_bench(fn, warmup=50, rep=300, return_mode="median")
        except Exception as e:  # a layout cuBLAS refuses is a result too
            print(f"{shape} {name:28s} error {type(e).__name__}: {str(e)[:80]}")
            continue
        base = base or ms
        print(f"{shape} {name:28s} {ms * 1e3:8.1f} us  x{ms / base:.3f}")
