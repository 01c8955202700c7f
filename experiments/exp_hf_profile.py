"""Where a training step's GPU time goes: stock transformers vs ``apply_truefuse`` vs Liger-Kernel,
on the demo's GPU model (Llama 16 x 2048, vocabulary 128256, 4 x 2048 tokens, bf16, AdamW).

Each run: 4 warm-up steps, then 3 profiled steps (torch.profiler, CUDA kernels only); kernel time is
summed by category from the kernel's name. Prints one table, ms per step per category and run.
``--runs`` picks them (``<run>+compile``: each decoder layer compiled, ``compile_layers``;
``<run>+adamw``: ``truefuse.optim.AdamW`` instead of torch's, issue 48.4; ``+resnorm``: the fused
residual add + norm, 48.1; ``+siblings``: q/k/v and gate/up input gradients summed in the GEMMs, 48.5;
``+bi``: batch-invariant mode, 48.6; Liger runs
last: it patches transformers' Llama module process-wide); ``--fused`` uses torch's fused AdamW (the
demo's).

Run: ``PYTHONPATH=. python experiments/exp_hf_profile.py [--runs stock,truefuse,liger] [--fused]``
on one GPU (liger_kernel importable for its column).
"""

from __future__ import annotations

import collections
import re

import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = [  # first match wins
    ("attention", r"flash|fmha|attention|sdpa"),
    ("lm head + loss", r"cross_entropy|lce|_chunk|log_softmax|nll_loss|softmax"),
    ("gemm", r"gemm|nvjet|cutlass|sm90_xmma|cublas|matmul|splitk|\bmm\b"),
    ("norm", r"norm|rms|_sum_partials"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|swiglu|gated|gelu|act"),
    ("optimizer", r"adam|foreach|multi_tensor"),
    ("copy / cast", r"copy|cast|convert|to_copy|cat"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce"),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def build(patch):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if patch:
        patch(model)
    return model


def prepared(name: str, fused: bool):
    """Run ``name``'s model (``+compile``: its decoder layers compiled; ``+adamw``: stepped with
    ``truefuse.optim.AdamW``, else torch's; ``+resnorm``: the fused residual add + norm), AdamW and
    a batch."""
    model = build(_patch(name))
    if "+compile" in name:
        from truefuse.integrations.huggingface import compile_layers

        compile_layers(model)
    if "+adamw" in name:
        from truefuse.optim import AdamW

        opt = AdamW(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {}))
    ids = torch.randint(0, 128256, (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return model, opt, ids


def release(model, opt) -> None:
    """Free a run's weights and optimizer state before the next run builds its own."""
    model.to("meta")
    opt.state.clear()
    torch.cuda.empty_cache()


def profile_run(name: str, fused: bool, steps: int = 3, warmup: int = 4):
    model, opt, ids = prepared(name, fused)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # as the demo trains (no KV cache grown by cat)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):  # unprofiled: the step's wall time (one run after another, not round-robin)
        step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / steps
    # MFU as exp_graphs.py's: (6 N T + 6 L S d T) / (t * 989.5 TFLOP/s), N less the input embedding
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    mfu = 100 * (6 * n * ids.numel() + 6 * 16 * 2048 * 2048 * ids.numel()) / (wall * 1e-3) / 989.5e12
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per = collections.Counter()
    top = collections.Counter()
    for e in prof.key_averages():
        t = e.device_time_total / 1e3 / steps  # ms per step
        if t <= 0:
            continue
        per[category(e.key)] += t
        top[e.key[:70]] += t
    release(model, opt)
    per["step (wall)"] = wall
    per["MFU %"] = mfu
    return per, top


def _patch(name: str):
    if name.startswith("truefuse"):
        from truefuse.integrations.huggingface import apply_truefuse

        # +resnorm: each layer's post-attention add and norm as one op (issue 48.1, opt-in);
        # +siblings: q/k/v's and gate/up's input gradient summed in the GEMMs (48.5, opt-in)
        # +bi: batch-invariant mode (48.6: its GEMMs against fast mode's, by kind)
        flags = {"fuse_residual_norm": "+resnorm", "fuse_sibling_grads": "+siblings", "batch_invariant": "+bi"}
        kw = {k: tag in name for k, tag in flags.items()}
        return lambda m: apply_truefuse(m, **kw)
    if name.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        return lambda m: apply_liger_kernel_to_llama(model=m)
    return None


def run_names(spec: str) -> list[str]:
    """The comma-separated runs of ``spec``, Liger's dropped where it is not installed and put last
    (it patches transformers' Llama module for the whole process)."""
    import importlib.util

    names = spec.split(",")
    liger = [n for n in names if n.startswith("liger")] if importlib.util.find_spec("liger_kernel") else []
    return [n for n in names if not n.startswith("liger")] + liger


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="stock,truefuse,liger", help="comma-separated; <run>+compile compiles the layers")
    p.add_argument("--fused", action="store_true", help="torch's fused AdamW (the demo's)")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    results = {}
    for n in run_names(args.runs):
        try:
            results[n] = profile_run(n, args.fused)
        except Exception as e:  # one run's failure leaves the others' table
            print(f"{n}: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
    cats = [c for c, _ in CATEGORIES] + ["other"]
    w = max(12, *(len(n) + 2 for n in results))
    print(f"{'ms / step':<16}" + "".join(f"{n:>{w}}" for n in results))
    for c in cats:
        print(f"{c:<16}" + "".join(f"{results[n][0][c]:>{w}.2f}" for n in results))
    total = {n: sum(v for c, v in results[n][0].items() if c not in ("step (wall)", "MFU %")) for n in results}
    print(f"{'total':<16}" + "".join(f"{total[n]:>{w}.2f}" for n in results))
    for row in ("step (wall)", "MFU %"):
        print(f"{row:<16}" + "".join(f"{results[n][0][row]:>{w}.2f}" for n in results))
    for n, (_, top) in results.items():
        print(f"\n{n}: top kernels (ms / step)")
        for k, t in top.most_common(args.top):
            print(f"  {t:8.2f}  {k}")


if __name__ == "__main__":
    main()
