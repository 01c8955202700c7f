"""What does the fused loss's token chunk cost and save in a whole training step (issue 35: peak
memory ≤ Liger's)? At the demo's GPU model the chunk policy (``ops/lm_head/chunked_head.py::
default_chunk``) raises the logits' budget to the fp32 weight-gradient accumulator's size (V·H·4
bytes), which picks 4096-token chunks: one chunk's logits (1.05 GB) and the accumulator (1.05 GB)
live together at the end of the forward, where the step's activations peak.

The demo's GPU model (``exp_bi_speed.py``'s ``demo``: Llama 16 x 2048, vocabulary 128256, 4 x
2048 tokens, bf16, fused AdamW) under ``apply_truefuse``; the chunk forced to each of
``--chunks`` (``autograd/_chunked_head.default_chunk`` replaced for the run). Per chunk: the peak
allocated memory of a step (after the warm-up, the allocator's peak reset), and ms per step timed
round-robin over the chunks (``--rounds`` rounds of one step each; median and best). Each chunk
keeps the weight gradient in the fp32 accumulator, rounded once; the bits differ between chunks
(cuBLAS's kernel for a chunk's rows, the accumulator's grouping of the sum), within the op's bound.

    PYTHONPATH=. python experiments/exp_lce_chunk_peak.py [--chunks 4096,2048,1024] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from exp_bi_speed import CONFIGS, build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", default="4096,2048,1024")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    import truefuse.autograd._chunked_head as ch
    from truefuse.integrations.huggingface import apply_truefuse

    c = CONFIGS["demo"]
    m = build(c).train()
    apply_truefuse(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(1, c["vocab"], (c["batch"], c["seq"]), device="cuda")
    policy = ch.default_chunk
    chunks = [int(s) for s in args.chunks.split(",")]

    def step(chunk: int) -> None:
        ch.default_chunk = lambda N, V, H, itemsize, acc: min(N, chunk)
        try:
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            ch.default_chunk = policy

    for _ in range(3):
        step(chunks[0])
    torch.cuda.synchronize()
    peaks = {}
    for chunk in chunks:  # each chunk's peak on its own (the optimizer's states already allocated)
        torch.cuda.reset_peak_memory_stats()
        step(chunk)
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() / 2**30
    times: dict = {k: [] for k in chunks}
    for _ in range(args.rounds):
        for chunk in chunks:
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(chunk)
            torch.cuda.synchronize()
            times[chunk].append((time.perf_counter() - t) * 1e3)
    print(torch.cuda.get_device_name(), torch.__version__)
    print(f"policy's own chunk here: {policy(c['batch'] * c['seq'], c['vocab'], c['hidden'], 2, True)}")
    print(f"{'chunk':>6} {'peak GiB':>9} {'ms/step median':>15} {'best':>7}")
    for chunk in chunks:
        ts = sorted(times[chunk])
        print(f"{chunk:>6} {peaks[chunk]:>9.2f} {ts[len(ts) // 2]:>15.1f} {ts[0]:>7.1f}")


if __name__ == "__main__":
    main()
