"""Quick side-by-side at one issue shape (default 8192 x 128256 x 4096), bf16 forward + backward:
the three GEMMs, truefuse.linear_cross_entropy (default) and torch.compile of the plain path, in
interleaved rounds (median ms), for checking one change without the whole sweep.

``CHUNKS="4096 8192"`` adds truefuse at those chunk sizes. When V is not a multiple of 64 it adds
the unpadded logits rows and unsplit GEMMs (``truefuse.config.tuning(align=1)``) and the three GEMMs on padded rows."""

import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

import truefuse
from truefuse.config import tuning

N, V, H = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 128256, 4096)
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(N, H, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
W = (torch.randn(V, H, generator=g, device="cuda", dtype=torch.bfloat16) * H**-0.5).requires_grad_()
t = torch.randint(0, V, (N,), generator=g, device="cuda")
d = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
plain = torch.compile(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c))


def step(fn):
    def run():
        x.grad = W.grad = None
        fn().backward()

    return run


def _unchecked(*args):
    import truefuse.autograd.linear_cross_entropy as lce

    saved, lce.check_targets = lce.check_targets, lambda *a: lambda: None
    try:
        return truefuse.linear_cross_entropy(*args)
    finally:
        lce.check_targets = saved


def _unpadded(run):
    def unpadded():
        with tuning(align=1):  # around the backward too: it reads the knob again when it recomputes chunks
            run()

    return unpadded


providers = {
    "gemms": lambda: (x.detach() @ W.detach().t(), d @ W.detach(), d.t() @ x.detach()),
    "truefuse": step(lambda: truefuse.linear_cross_entropy(x, W, t)),
    "compile_plain": step(lambda: plain(x, W, t)),
    "truefuse_nocheck": step(lambda: _unchecked(x, W, t)),  # without the target check's host sync
}
for c in os.environ.get("CHUNKS", "").split():
    providers[f"truefuse_c{c}"] = step(lambda c=int(c): truefuse.linear_cross_entropy(x, W, t, chunk_size=c))
if V % 64:
    Vp = -(-V // 64) * 64
    dp = torch.randn(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V]
    lp = torch.empty(N, Vp, device="cuda", dtype=torch.bfloat16)[:, :V]
    providers["gemms_padded"] = lambda: (torch.mm(x.detach(), W.detach().t(), out=lp), dp @ W.detach(), dp.t() @ x.detach())
    providers["truefuse_unpadded"] = _unpadded(step(lambda: truefuse.linear_cross_entropy(x, W, t)))
times = {k: [] for k in providers}
for r in range(3):
    for k in providers if r % 2 == 0 else reversed(providers):
        times[k].append(triton.testing.do_bench(providers[k], warmup=50, rep=300, return_mode="median"))
base = statistics.median(times["gemms"])
for k, v in times.items():
    print(f"{N}x{V}x{H} {k:>14} {statistics.median(v):8.2f} ms  ratio {statistics.median(v) / base:.3f}")
