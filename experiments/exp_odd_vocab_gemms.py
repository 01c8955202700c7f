"""Which of the linear cross-entropy's three GEMMs slow down at an odd vocabulary (GPT-2's 50257),
and whether padding fixes each: leading dimension padded (ld), sizes padded with zero rows/columns
(size). bf16 on the GPU, triton.testing.do_bench medians; args: N V H (default 8192 50257 4096)."""

import sys

import torch
import triton

N, V, H = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 50257, 4096)
Vp = -(-V // 64) * 64
bf = dict(device="cuda", dtype=torch.bfloat16)
x = torch.randn(N, H, **bf)
W = torch.randn(V, H, **bf)
Wp = torch.zeros(Vp, H, **bf)
Wp[:V] = W
d = torch.randn(N, V, **bf)
dp_full = torch.zeros(N, Vp, **bf)
dp_full[:, :V] = d
dp = dp_full[:, :V]
lo = torch.empty(N, V, **bf)
lp_full = torch.empty(N, Vp, **bf)
lp = lp_full[:, :V]
V8 = V // 64 * 64
cases = {
    "logits  out ld V": lambda: torch.mm(x, W.t(), out=lo),
    "logits  out ld Vp": lambda: torch.mm(x, W.t(), out=lp),
    "logits  Wp (n = Vp)": lambda: torch.mm(x, Wp.t(), out=lp_full),
    "d_input ld V, K = V": lambda: d @ W,
    "d_input ld Vp, K = V": lambda: dp @ W,
    "d_input K = Vp (zero pad)": lambda: dp_full @ Wp,
    "d_input K split 64-multiple + tail": lambda: torch.addmm(dp[:, :V8] @ W[:V8], dp[:, V8:], W[V8:]),
    "d_weight ld V, M = V": lambda: d.t() @ x,
    "d_weight ld Vp, M = V": lambda: dp.t() @ x,
    "d_weight M = Vp": lambda: dp_full.t() @ x,
}
flops = 2.0 * N * V * H
for name, fn in cases.items():
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    print(f"{N}x{V}x{H} {name:>36} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")
