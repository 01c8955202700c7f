"""Accuracy of the logits GEMM variants against float64 (relative error of the bf16 logits): the
plain F.linear, one GEMM into padded rows, and the vocabulary split (head + tail), with and
without bias. Args: N V H (default 1024 50257 128)."""

import sys

import torch
import torch.nn.functional as F

from truefuse.autograd.linear_cross_entropy_gemms import logits_gemm
from truefuse.ops.gemm import gemm

N, V, H = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (1024, 50257, 128)
g = torch.Generator().manual_seed(0)
x = torch.randn(N, H, generator=g).cuda().bfloat16()
W = (torch.randn(V, H, generator=g) * H**-0.5 * 2).cuda().bfloat16()
b = (torch.randn(V, generator=g) * 0.5).cuda().bfloat16()
split = V // 64 * 64
Vp = -(-V // 64) * 64


def err(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


for bias in (None, b):
    ref = F.linear(x.double(), W.double(), None if bias is None else bias.double())
    plain = F.linear(x, W, bias)
    buf = torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)
    one = gemm(x, W.t(), bias=bias, out=buf[:, :V]).clone()
    sp = logits_gemm(x, W, bias, torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V], split)
    nb = gemm(x, W.t(), out=torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V])
    tag = "bias" if bias is not None else "no bias"
    if bias is not None:  # the alternatives for the bias
        e = {}
        t1 = torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V]
        for cols in (slice(0, split), slice(split, None)):
            gemm(x, W[cols].t(), bias=bias[cols], out=t1[:, cols])
        e["split, bias in each GEMM"] = err(t1, ref)
        t2 = torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V]
        t2.copy_(bias.expand_as(t2))
        for cols in (slice(0, split), slice(split, None)):
            gemm(x, W[cols].t(), out=t2[:, cols], accumulate=True)
        e["split, bias prefilled + beta=1"] = err(t2, ref)
        t3 = torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V]
        t3[:, :split] = gemm(x, W[:split].t(), bias=bias[:split])
        t3[:, split:] = gemm(x, W[split:].t(), bias=bias[split:])
        e["split into contiguous temps"] = err(t3, ref)
        t4 = torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V]
        torch.addmm(bias[:split], x, W[:split].t(), out=t4[:, :split])
        torch.addmm(bias[split:], x, W[split:].t(), out=t4[:, split:])
        e["split, torch.addmm directly"] = err(t4, ref)
        print("   ", "  ".join(f"{k} {v:.4e}" for k, v in e.items()))
    print(f"{tag:>8}: plain {err(plain, ref):.4e}  padded-out {err(one, ref):.4e}  split {err(sp, ref):.4e}", end="")
    if bias is not None:
        print(f"  (no-bias padded + bias in fp32 {err(nb.double() + bias.double(), ref):.4e})", end="")
    print(f"  split==plain {float((sp != plain).float().mean()):.3f} differ")
