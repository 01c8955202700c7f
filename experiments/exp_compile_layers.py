"""Does a patched model run with each decoder layer ``torch.compile``-d (TorchTitan's recipe,
the usual pairing with FSDP2), and how fast against stock compiled the same way? (issue 35: under
FSDP2 truefuse's eager step is its host time; compiling the layers is one way to a step whose host
time is under its kernels'.)

The demo's GPU model (``exp_bi_speed.py``'s ``demo``: Llama 16 x 2048, vocabulary 128256, 4 x 2048
tokens, bf16, fused AdamW), one GPU, no FSDP: stock and ``apply_truefuse``, each eager and with
``layer.compile()`` on every decoder layer (the embedding, final norm and loss stay eager). After
``--warmup`` steps (the compilation), the runs are timed round-robin (``--rounds`` rounds of one
step each): ms per step (median, best), host ms of the median step, the step's own peak (GiB above
what was allocated before it: the four models stay resident), and the first timed step's loss
(bounded against stock eager's: inductor reorders the stock ops it fuses). ``compile_layers``
raises Dynamo's cache limit: each layer guards on its own index, so 16 layers recompile 16 times,
past the default 8 (after which the rest run eager).

``--runs`` picks the runs; a name with ``lean`` computes the loss with
``linear_cross_entropy(memory="lean")`` (slices of the vocabulary: no fp32 weight-gradient
accumulator, a fourth GEMM), the lever issue 35 names for the single-GPU peak.

    PYTHONPATH=. python experiments/exp_compile_layers.py [--rounds 7] [--warmup 3] [--runs stock,truefuse lean]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from exp_bi_speed import CONFIGS, build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", default="stock,stock compiled,truefuse,truefuse compiled", help="comma-separated")
    args = p.parse_args()
    import functools

    import truefuse.autograd.linear_cross_entropy as lce
    from truefuse.integrations.huggingface import apply_truefuse, compile_layers

    default_lce, lean = lce.linear_cross_entropy, {"on": False}

    @functools.wraps(default_lce)
    def switched(*a, **kw):  # the HF loss imports the function at each call: the step's own choice
        return default_lce(*a, **kw, **({"memory": "lean"} if lean["on"] else {}))

    lce.linear_cross_entropy = switched

    c = CONFIGS["demo"]
    base = build(c).train()
    ids = torch.randint(1, c["vocab"], (c["batch"], c["seq"]), device="cuda")
    runs, peaks, compile_s = {}, {}, {}
    for name in args.runs.split(","):
        m = copy.deepcopy(base)
        if name.startswith("truefuse"):
            apply_truefuse(m)
        if name.endswith("compiled"):
            compile_layers(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

        def step(m=m, opt=opt, is_lean="lean" in name):
            lean["on"] = is_lean
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        compile_s[name] = time.perf_counter() - t
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**30
        runs[name] = step
    times: dict = {n: [] for n in runs}
    hosts: dict = {n: [] for n in runs}
    losses: dict = {}
    for r in range(args.rounds):
        for n, step in runs.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = step()
            hosts[n].append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            times[n].append((time.perf_counter() - t) * 1e3)
            if r == 0:
                losses[n] = loss.item()
    print(torch.cuda.get_device_name(), torch.__version__)
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])  # each reason once per frame that broke (both compiled models)
    print(f"graph breaks: {sum(breaks.values())}" + "".join(f"\n  {n} x {r[:200]}" for r, n in breaks.items()))
    head = f"{'run':<18} {'ms/step':>8} {'best':>7} {'host ms':>8} {'x stock':>8} {'x stock comp.':>13}"
    print(head + f" {'step GiB':>9} {'warm-up s':>9}  loss")
    med = {n: sorted(ts)[len(ts) // 2] for n, ts in times.items()}
    for n in runs:
        mid = sorted(range(len(times[n])), key=times[n].__getitem__)[len(times[n]) // 2]
        print(f"{n:<18} {med[n]:>8.1f} {min(times[n]):>7.1f} {hosts[n][mid]:>8.1f} {med['stock'] / med[n]:>8.3f}"
              f" {med['stock compiled'] / med[n]:>13.3f} {peaks[n]:>9.2f} {compile_s[n]:>9.1f}  {losses[n]:.5f}")  # fmt: skip


if __name__ == "__main__":
    main()
