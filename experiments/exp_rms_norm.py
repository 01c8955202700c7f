# ruff: noqa: E501, B023, E402, E731
"""Experiment: where RMSNorm forward+backward time goes at 8192x4096 bf16 (kernel variants)."""

import torch
import triton.testing as tt

from truefuse.kernels.norm import _norm_bwd_kernel, _norm_fwd_kernel
from truefuse.ops.norm import norm_bwd, norm_fwd

M, N = 8192, 4096
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
GB = 2 * M * N / 1e9
bench = lambda f: tt.do_bench(f, warmup=25, rep=200, return_mode="median")  # noqa: E731
y, mean, rstd = norm_fwd(x, w, None, 1e-5, rms=True, zero_centered_gamma=False)
print(
    f"fwd host fn: {bench(lambda: norm_fwd(x, w, None, 1e-5, rms=True, zero_centered_gamma=False)) * 1e3:.1f} us (floor {2 * GB / 4.3e3 * 1e6:.1f})"
)
print(
    f"bwd host fn: {bench(lambda: norm_bwd(dy, x, w, None, None, rstd, rms=True, zero_centered_gamma=False)) * 1e3:.1f} us (floor {3 * GB / 4.3e3 * 1e6:.1f})"
)
for warps in (4, 8, 16):
    yy = torch.empty_like(x)
    f = lambda: _norm_fwd_kernel[(M,)](
        x,
        w,
        w,
        yy,
        rstd,
        rstd,
        N,
        N,
        N,
        1e-5,
        IS_RMS=True,
        HAS_W=True,
        HAS_B=False,
        ZERO_CENTERED=False,
        BLOCK_N=4096,
        num_warps=warps,
    )  # noqa: E731
    print(f"fwd warps={warps}: {bench(f) * 1e3:.1f} us")
dx = torch.empty_like(x)
for progs in (132, 264, 396, 528):
    for warps in (4, 8, 16):
        part = torch.empty(progs, N, device="cuda")
        rpp = -(-M // progs)
        f = lambda: _norm_bwd_kernel[(progs,)](
            dy,
            x,
            w,
            rstd,
            rstd,
            dx,
            part,
            part,
            N,
            N,
            N,
            M,
            N,
            rpp,
            IS_RMS=True,
            HAS_W=True,
            HAS_B=False,
            ZERO_CENTERED=False,
            BLOCK_N=4096,
            num_warps=warps,
        )  # noqa: E731
        print(f"bwd programs={progs} warps={warps}: {bench(f) * 1e3:.1f} us")
from truefuse.ops.norm import _sum_partials

part = torch.empty(264, N, device="cuda")
print(
    f"partial sum torch: {bench(lambda: part.sum(0)) * 1e3:.1f} us, triton: {bench(lambda: _sum_partials(part, torch.bfloat16)) * 1e3:.1f} us"
)
xr = x.clone().requires_grad_()
import truefuse

print(f"autograd fwd+bwd: {bench(lambda: truefuse.rms_norm(xr, w, 1e-5).backward(dy)) * 1e3:.1f} us")
print(f"torch fwd+bwd: {bench(lambda: torch.nn.functional.rms_norm(xr, (N,), w, 1e-5).backward(dy)) * 1e3:.1f} us")
