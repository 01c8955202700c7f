"""Steady state of linear_cross_entropy against torch.compile of the plain path: 40 back-to-back
forward + backward steps (after warm-up), profiled; prints the wall time per step, the GPU kernel
time per step, and each kernel's mean. Tells apart slower kernels from idle gaps between them.

    python experiments/profile_lce_steady.py [N V H]
"""

import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import truefuse

N, V, H = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 32000, 4096)
STEPS = 40
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(N, H, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
W = (torch.randn(V, H, generator=g, device="cuda", dtype=torch.bfloat16) * H**-0.5).requires_grad_()
t = torch.randint(0, V, (N,), generator=g, device="cuda")
plain = torch.compile(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c))


def step(fn):
    x.grad = W.grad = None
    fn().backward()


for name, fn in (("truefuse", lambda: truefuse.linear_cross_entropy(x, W, t)), ("compile_plain", lambda: plain(x, W, t))):
    for _ in range(20):
        step(fn)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step(fn)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / STEPS * 1e3
    per = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
            per[e.key[:60]] += e.self_device_time_total / STEPS / 1e3
    busy = sum(per.values())
    print(f"== {name}: wall {wall:.3f} ms/step, GPU kernels {busy:.3f} ms/step, idle {wall - busy:.3f}")
    for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:8]:
        print(f"   {v:8.3f} ms  {k}")
