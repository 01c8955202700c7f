"""Host time of a training step's forward and backward, stock transformers against
``apply_truefuse`` (issue 35: under FSDP2 the small model's step is host time, and truefuse's
forward took ~5 ms more host than stock's on 2 H100s, ``exp_fsdp_profile.py``'s phases).

1. Per op, with a gradient to take (hidden 1024, 2 x 64 tokens, bf16): the host µs of a forward
   alone and of forward + backward, stock's ops against truefuse's (``rms_norm_hf`` against the
   stock module's expression, rope, the gated activation), best of 5 rounds of ``--calls`` calls.
   Few rows, so that each kernel's GPU time stays below its launch's host time; and few calls per
   round: CUDA queues ~1000 launches, and past that a launch waits for the GPU (training-sized
   rows measured the GPU, not the host).
2. The small model of ``exp_fsdp_profile.py`` (Llama 4 x 1024, vocabulary 32000, 4 x 2048 tokens,
   bf16) on one GPU without FSDP: host ms of the forward and of the backward (no synchronisation
   inside; the median of 7 steps), then cProfile's top functions (``--sort``: cumulative or own
   time) over one forward of each run.

Run on a GPU: ``PYTHONPATH=. python experiments/exp_train_host.py [--calls 100] [--rows 30]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from exp_launch_host import host_time_us  # noqa: E402


def _ops(calls: int, cprofile: bool = False, rows: int = 30) -> list[str]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as stock_rope

    from truefuse.autograd.gated_activation import gated_activation
    from truefuse.autograd.norm import rms_norm_hf
    from truefuse.autograd.rope import apply_rotary_pos_emb

    dev, bf = "cuda", torch.bfloat16
    H, B, L = 1024, 2, 64
    x = torch.randn(B, L, H, device=dev, dtype=bf, requires_grad=True)
    norm = LlamaRMSNorm(H).to(dev, bf)
    q = torch.randn(B, 16, L, 64, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(B, 8, L, 64, device=dev, dtype=bf, requires_grad=True)
    cos = torch.randn(B, L, 64, device=dev, dtype=bf)
    sin = torch.randn(B, L, 64, device=dev, dtype=bf)
    g = torch.randn(B * L, 2816, device=dev, dtype=bf, requires_grad=True)
    u = torch.randn(B * L, 2816, device=dev, dtype=bf, requires_grad=True)
    F = torch.nn.functional
    pairs = {
        "rms norm": (lambda: norm(x), lambda: rms_norm_hf(x, norm.weight, norm.variance_epsilon, style="llama")),
        "rope": (lambda: stock_rope(q, k, cos, sin), lambda: apply_rotary_pos_emb(q, k, cos, sin)),
        "silu(g) * u": (lambda: F.silu(g) * u, lambda: gated_activation(g, "swiglu", u)),
    }
    profiles: list[str] = []
    lines = [f"{'op (grad)':<14} {'stock fwd':>10} {'truefuse fwd':>13} {'stock f+b':>10} {'truefuse f+b':>13}  (host us)"]
    for name, (s, t) in pairs.items():

        def fb(f):
            def run():
                out = f()
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

            return run

        row = [host_time_us(f, calls) for f in (s, t)] + [host_time_us(fb(f), calls // 2) for f in (s, t)]
        lines.append(f"{name:<14} {row[0]:>10.1f} {row[1]:>13.1f} {row[2]:>10.1f} {row[3]:>13.1f}")
        if cprofile:
            for who, f in (("stock", s), ("truefuse", t)):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(50):
                    fb(f)()
                pr.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(rows)
                profiles.append(f"==== cProfile, 50 x forward + backward, {name}, {who}\n{buf.getvalue()}")
    return lines + profiles


def _model_runs(rows: int, sort: str) -> list[str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from truefuse.integrations.huggingface import apply_truefuse

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)  # fmt: skip
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    lines, profiles = [], []
    for run in ("stock", "truefuse"):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
        if run == "truefuse":
            apply_truefuse(m)
        fwd, bwd = [], []
        for i in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            m.zero_grad(set_to_none=True)
            if i >= 3:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
        lines.append(f"{run:<9} host forward {sorted(fwd)[3]:6.2f} ms  backward {sorted(bwd)[3]:6.2f} ms (median of 7)")
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(rows)
        profiles.append(f"==== cProfile, one forward, {run}\n{buf.getvalue()}")
        del m, loss
        torch.cuda.empty_cache()
    return lines + profiles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--sort", default="cumulative", help="cProfile's order: cumulative or tottime")
    p.add_argument("--no-ops", dest="ops", action="store_false", help="the model runs only")
    p.add_argument("--no-model", dest="model", action="store_false", help="the ops only")
    p.add_argument("--cprofile-ops", action="store_true", help="cProfile 50 forward + backward calls of each op")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    if args.ops:
        print("\n".join(_ops(args.calls, args.cprofile_ops, args.rows)))
    if args.model:
        print("\n".join(_model_runs(args.rows, args.sort)))


if __name__ == "__main__":
    main()
