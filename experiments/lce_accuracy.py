"""d_input / d_weight error of linear_cross_entropy and of the plain bf16 path against an fp32
reference, at one issue shape (default 8192 x 128256 x 4096) on the GPU. Prints the ratio."""

import sys

import torch
import torch.nn.functional as F

import truefuse
from truefuse.bench.bench_linear_cross_entropy import peers
from truefuse.testing import rel_error

N, V, H = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 128256, 4096)
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(N, H, generator=g, device="cuda", dtype=torch.bfloat16)
W = torch.randn(V, H, generator=g, device="cuda", dtype=torch.bfloat16) * H**-0.5
t = torch.randint(0, V, (N,), generator=g, device="cuda")


def grads(fn, xx, WW):
    xx, WW = xx.detach().clone().requires_grad_(), WW.detach().clone().requires_grad_()
    fn(xx, WW).backward()
    return xx.grad.float(), WW.grad.float()


ref = grads(lambda a, b: F.cross_entropy(F.linear(a, b), t), x.float(), W.float())
plain = grads(lambda a, b: F.cross_entropy(F.linear(a, b).float(), t), x, W)
for name, fn in peers().items():
    theirs = grads(lambda a, b, fn=fn: fn(a, b, t), x, W)
    for what, i in (("d_input", 0), ("d_weight", 1)):
        e_o, e_p = rel_error(theirs[i], ref[i]), rel_error(plain[i], ref[i])
        print(f"{name} {what}: {e_o:.3e} plain {e_p:.3e} ratio {e_o / e_p:.3f}")
for fp32 in (True, False):
    for chunk in (None, 2048):
        ours = grads(lambda a, b, c=chunk, f=fp32: truefuse.linear_cross_entropy(a, b, t, chunk_size=c, fp32_weight_grad=f), x, W)
        for name, i in (("d_input", 0), ("d_weight", 1)):
            e_o, e_p = rel_error(ours[i], ref[i]), rel_error(plain[i], ref[i])
            print(f"fp32_weight_grad={fp32} chunk={chunk} {name}: truefuse {e_o:.3e} plain {e_p:.3e} ratio {e_o / e_p:.3f}")
