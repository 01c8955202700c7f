"""The small kernels around linear_cross_entropy's chunk loop, and a fair GEMM floor (issue #17).

At one shape (default 8192 x 32000 x 4096, bf16, mean, forward + backward): every GPU kernel of a
step, counted and timed per step (torch.profiler over STEPS steps, each after an L2 flush as
triton's do_bench runs them), for truefuse and torch.compile of the plain path; then times (the
harness's do_bench median, interleaved rounds) of

* ``gemms``: the three cuBLAS GEMMs on random operands (the benchmark's reference),
* ``gemms_soft``: the same GEMMs with the d_logits a loss really makes (softmax minus the one-hot
  target, over the tokens: mostly tiny values, one large negative per row),
* ``truefuse``, ``compile_plain``.

    python experiments/exp_lce_overhead.py [N V H] [--no-compile]
"""

import statistics
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton.testing
from torch.profiler import ProfilerActivity, profile

import truefuse

args = [a for a in sys.argv[1:] if not a.startswith("--")]
N, V, H = (int(a) for a in args[:3]) if len(args) >= 3 else (8192, 32000, 4096)
COMPILE = "--no-compile" not in sys.argv
STEPS, ROUNDS = 20, 3
BF = torch.bfloat16
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(N, H, generator=g, device="cuda", dtype=BF).requires_grad_()
W = (torch.randn(V, H, generator=g, device="cuda", dtype=BF) * H**-0.5).requires_grad_()
t = torch.randint(0, V, (N,), generator=g, device="cuda")
xd, Wd = x.detach(), W.detach()
d_rand = torch.randn(N, V, generator=g, device="cuda", dtype=BF)
with torch.no_grad():
    p = torch.softmax((xd @ Wd.t()).float(), -1)
    p[torch.arange(N, device="cuda"), t] -= 1
    d_soft = (p / N).to(BF)
    del p
plain = torch.compile(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c), dynamic=False)


def step(loss_fn):
    def fn():
        x.grad = W.grad = None
        loss_fn().backward()

    return fn


providers = {
    "gemms": lambda: (xd @ Wd.t(), d_rand @ Wd, d_rand.t() @ xd),
    "gemms_soft": lambda: (xd @ Wd.t(), d_soft @ Wd, d_soft.t() @ xd),
    "truefuse": step(lambda: truefuse.linear_cross_entropy(x, W, t)),
}
if COMPILE:
    providers["compile_plain"] = step(lambda: plain(x, W, t))
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

for name in ("truefuse", "compile_plain"):
    if name not in providers:
        continue
    fn = providers[name]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    per, cnt = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = e.name[:70]
            per[k] += e.device_time_total / STEPS
            cnt[k] += 1
    flush_k = [k for k in per if "fill" in k.lower() or "zero" in k.lower()]
    print(f"== {name} at {N} x {V} x {H}: kernels per step (the L2 flush's fill included once)")
    small = 0.0
    n_small = 0
    for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
        c = cnt[k] / STEPS
        print(f"   {v:9.1f} us  x{c:4.1f}  {k}")
        if v / c < 100:
            small += v
            n_small += c
    print(f"   kernels under 100 us each: {n_small:.1f} a step, {small:.1f} us a step (the flush's fill counts 1)")

times = defaultdict(list)
for r in range(ROUNDS):
    for name in list(providers) if r % 2 == 0 else list(providers)[::-1]:
        times[name].append(triton.testing.do_bench(providers[name], warmup=25, rep=300, return_mode="median"))
ref = statistics.median(times["gemms"])
print(f"== times at {N} x {V} x {H} (median of {ROUNDS} interleaved rounds, do_bench median each)")
for name, ts in times.items():
    m, soft = statistics.median(ts), statistics.median(times["gemms_soft"])
    rounds = [round(v, 3) for v in ts]
    print(f"   {name:14s} {m:8.3f} ms  {m / ref:6.3f}x gemms  {m / soft:6.3f}x gemms_soft  rounds {rounds}")
