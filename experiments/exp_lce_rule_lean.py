"""The chunk rule at linear_log_probs' 8192 x 152064 x 3584, and memory="lean"'s slice width
at 8192|16384 x 128256 x 4096 (issue #17). bf16, forward + backward; ms (do_bench median, rep
400 ms, interleaved rounds, the median kept) and peak MiB above the inputs as the benchmark
harness measures it (the previous call's gradients freed by the call).

    python experiments/exp_lce_rule_lean.py [rule] [lean]
"""

import statistics
import sys
from collections import defaultdict

import torch

import truefuse
from truefuse.bench import harness

BF = torch.bfloat16
ROUNDS = 3


def inputs(N, V, H):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, generator=g, device="cuda", dtype=BF).requires_grad_()
    W = (torch.randn(V, H, generator=g, device="cuda", dtype=BF) * H**-0.5).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g, device="cuda")
    return x, W, t


def measure(fn):
    m = harness.measure(fn, torch.device("cuda"), rep_ms=400)
    return m.ms, m.peak_mb


def run(shape, providers):
    N, V, H = shape
    x, W, t = inputs(N, V, H)
    xd, Wd = x.detach(), W.detach()
    d = torch.randn(N, V, device="cuda", dtype=BF)
    fns = {"gemms": lambda: (xd @ Wd.t(), d @ Wd, d.t() @ xd)}
    for name, loss in providers.items():

        def fn(loss=loss):
            x.grad = W.grad = None
            out = loss(x, W, t)
            if isinstance(out, tuple):
                torch.autograd.backward(out, (a_up, c_up))
            else:
                out.backward()

        fns[name] = fn
    a_up = torch.randn(N, device="cuda")
    c_up = torch.randn(N, device="cuda")
    res = defaultdict(list)
    peaks = {}
    for r in range(ROUNDS):
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            ms, peak = measure(fns[name])
            res[name].append(ms)
            peaks.setdefault(name, peak)
    ref = statistics.median(res["gemms"])
    base = statistics.median(res[list(providers)[0]])
    print(f"== {N} x {V} x {H}")
    for name in fns:
        m = statistics.median(res[name])
        rounds = [round(v, 2) for v in res[name]]
        first = list(providers)[0]
        print(
            f"   {name:22s} {m:8.3f} ms  {m / ref:6.3f}x gemms  {m / base:6.3f}x {first}  {peaks[name]:7.0f} MiB  rounds {rounds}"
        )


what = sys.argv[1:] or ["rule", "lean"]
if "rule" in what:
    lp = truefuse.linear_log_probs
    run((8192, 152064, 3584), {
        "lp_default": lambda x, W, t: tuple(lp(x, W, t)),
        "lp_c4096": lambda x, W, t: tuple(lp(x, W, t, chunk_size=4096)),
    })  # fmt: skip
if "lean" in what:
    lce = truefuse.linear_cross_entropy
    for N, widths in ((8192, (16384, 16064, 14272, 21376, 25664)), (16384, (8192, 8064, 10688, 12864))):
        provs = {"default": lambda x, W, t: lce(x, W, t)}
        for w in widths:
            provs[f"lean_w{w}"] = lambda x, W, t, w=w: lce(x, W, t, memory="lean", vocab_slice=w)
        run((N, 128256, 4096), provs)
        torch.cuda.empty_cache()
