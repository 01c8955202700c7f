"""Accuracy of the logits GEMM variants against float64 (relative error of the bf16 logits): the
plain F.linear, one GEMM into padded rows, and the vocabulary split (head + tail), with and
without bias, in torch/cuBLAS calls (``truefuse.gemm`` refuses a bias with padded rows since this
measurement). Args: N V H (default 1024 50257 128)."""

import sys

import torch
import torch.nn.functional as F

N, V, H = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (1024, 50257, 128)
g = torch.Generator().manual_seed(0)
x = torch.randn(N, H, generator=g).cuda().bfloat16()
W = (torch.randn(V, H, generator=g) * H**-0.5 * 2).cuda().bfloat16()
b = (torch.randn(V, generator=g) * 0.5).cuda().bfloat16()
split = V // 64 * 64
Vp = -(-V // 64) * 64


def err(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


def padded():
    return torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V]


def split_mm(bias, out):
    """The two column ranges, each with its part of ``bias`` (None: no bias)."""
    for cols in (slice(0, split), slice(split, None)):
        if bias is None:
            torch.mm(x, W[cols].t(), out=out[:, cols])
        else:
            torch.addmm(bias[cols], x, W[cols].t(), out=out[:, cols])
    return out


for bias in (None, b):
    ref = F.linear(x.double(), W.double(), None if bias is None else bias.double())
    plain = F.linear(x, W, bias)
    e = {"plain": err(plain, ref)}
    if bias is None:
        sp = split_mm(None, padded())
        e["split"] = err(sp, ref)
        print(
            "no bias:",
            "  ".join(f"{k} {v:.4e}" for k, v in e.items()),
            f"  split != plain {float((sp != plain).float().mean()):.3f}",
        )
        continue
    e["one GEMM into padded rows"] = err(torch.addmm(bias, x, W.t(), out=padded()), ref)
    e["split, bias in each GEMM"] = err(split_mm(bias, padded()), ref)
    t2 = padded()
    t2.copy_(bias.expand_as(t2))
    for cols in (slice(0, split), slice(split, None)):
        torch.addmm(t2[:, cols], x, W[cols].t(), out=t2[:, cols])
    e["split, bias prefilled + beta=1"] = err(t2, ref)
    e["split into contiguous temps"] = err(
        torch.cat([F.linear(x, W[:split], bias[:split]), F.linear(x, W[split:], bias[split:])], 1), ref
    )
    e["split without bias + bias in fp32 (truefuse)"] = err(split_mm(None, padded()).double() + bias.double(), ref)
    print("   bias:", "  ".join(f"{k} {v:.4e}" for k, v in e.items()))
