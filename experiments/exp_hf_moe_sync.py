"""Issue 16: the Hugging Face experts patch with the per-expert counts on the device (no host sync)
against the same patch taking them to the host (one ``.tolist()`` per forward, the path of modules
marked expert-parallel), and stock transformers (``grouped_mm`` implementation), one MoE layer's
router + experts forward + backward, bf16, Qwen3-30B-A3B's expert shapes.

Run on a GPU: ``PYTHONPATH=. python experiments/exp_hf_moe_sync.py [--tokens 4096] [--out DIR]``.

Per provider: the median GPU-bound time (``do_bench``: launches queued back to back, so a host sync
stalls the queue), the host time of one call without a final sync (Python, launches, and any wait on
the GPU inside the call), and for the providers that capture (no host sync), the CUDA-graph replay.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

from truefuse.bench.harness import environment, measure
from truefuse.integrations.huggingface.moe import patch_experts


def _layer(tokens: int, seed: int = 0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    experts = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    experts = experts.cuda().bfloat16()
    router = torch.nn.Linear(2048, 128, bias=False).cuda().bfloat16()
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    return experts, router, x, dy, cfg.num_experts_per_tok


def _step(experts, router, x, dy, top_k):
    def fn():
        probs = torch.softmax(router(x).float(), dim=-1)
        w, idx = torch.topk(probs, top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        experts(x, idx, w).backward(dy)

    return fn


def _host_ms(fn, n: int = 20) -> float:
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stock, router, x, dy, top_k = _layer(args.tokens)
    device_splits = copy.deepcopy(stock)
    assert patch_experts(device_splits)
    host_splits = copy.deepcopy(device_splits)
    host_splits._is_expert_parallel = True  # the host-count path (no sentinels here)
    rows = []
    for name, m, graphable in (("stock_grouped_mm", stock, True), ("truefuse_device_splits", device_splits, True),
                               ("truefuse_host_splits", host_splits, False)):  # fmt: skip
        fn = _step(m, router, x, dy, top_k)
        row = {"provider": name, "ms": measure(fn, x.device).ms, "host_ms": _host_ms(fn)}
        if graphable:
            row["graph_ms"] = measure(fn, x.device, cuda_graph=True).ms
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'provider':<24} {'ms':>8} {'host ms':>8} {'graph ms':>9}   (tokens {args.tokens}, E 128, top-8, H 2048, F 768)")
    for r in rows:
        g = f"{r['graph_ms']:.3f}" if "graph_ms" in r else "-"
        print(f"{r['provider']:<24} {r['ms']:8.3f} {r['host_ms']:8.3f} {g:>9}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "exp_hf_moe_sync.json"), "w") as f:
            json.dump({"env": environment(), "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
