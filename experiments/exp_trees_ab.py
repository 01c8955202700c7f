"""Is a refactor within noise of the tree before it, family by family, on one GPU? And how fast is
``add_rms_norm_hf`` against its unfused compositions (issues 46 and 48.1)?

One representative shape per family, bf16 forward + backward (``torch.autograd.grad``: nothing
accumulates between calls), fast and batch-invariant mode, each timed by
``triton.testing.do_bench`` (median ms). Each tree runs in its own process (the package name is
the same), the trees alternated round by round (hosts and clocks drift), then one table: the
median over rounds of each tree and their ratio, with the extreme per-round ratios.

    git worktree add /tmp/before <commit>     # or any checkout of the old tree
    PYTHONPATH= python experiments/exp_trees_ab.py --before /tmp/before --after . --rounds 5 [--out ab.jsonl]

``--one TREE LABEL`` is what each process runs (one JSON line per row). Rows whose names start
with ``+`` exist only where the tree has ``add_rms_norm_hf``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys


def one(tree: str, label: str) -> None:
    sys.path.insert(0, os.path.abspath(tree))
    import torch
    import triton

    import truefuse

    torch.manual_seed(0)
    d, bf = "cuda", torch.bfloat16

    def r(*s, g=False):
        return torch.randn(*s, device=d, dtype=bf).requires_grad_(g)

    x, w = r(16384, 4096, g=True), (torch.rand(4096, device=d, dtype=bf) + 0.5).requires_grad_()
    b, res = r(4096, g=True), r(16384, 4096, g=True)
    a4, b4 = r(4096, 4096), r(4096, 4096)
    h, lw = r(8192, 2048, g=True), (r(128256, 2048) * 0.02).requires_grad_()
    t = torch.randint(0, 128256, (8192,), device=d)
    ga = r(16384, 2 * 8192, g=True)
    q, k, v = (r(4, 16, 2048, 128, g=True) for _ in range(3))
    cos, sin = r(1, 2048, 128), r(1, 2048, 128)

    def fb(f, *inputs):
        """``f``'s forward + backward into ``inputs`` alone, its output gradients made once (a new
        128 MB ``ones_like`` a call, and gradients for every leaf of every case, made the memory-bound
        rows swing 0.6-1.4x between rounds of the same kernels)."""
        ys = f()
        ys = ys if isinstance(ys, tuple) else (ys,)
        grads = [torch.ones_like(y) for y in ys]

        def go():
            ys = f()
            torch.autograd.grad(ys if isinstance(ys, tuple) else (ys,), inputs, grads)

        return go

    def stock_add_norm():  # transformers' Llama: residual + h, then LlamaRMSNorm's ops
        s = res + x
        var = s.float().pow(2).mean(-1, keepdim=True)
        return w * (s.float() * torch.rsqrt(var + 1e-6)).to(bf), s

    cases = {
        "rms_norm": fb(lambda: truefuse.rms_norm(x, w, 1e-6), x, w),
        "rms_norm_hf": fb(lambda: truefuse.rms_norm_hf(x, w, 1e-6), x, w),
        "layer_norm": fb(lambda: truefuse.layer_norm(x, w, b, 1e-5), x, w, b),
        "gemm 4096^3 (fwd)": lambda: truefuse.gemm(a4, b4),
        "linear_cross_entropy": fb(lambda: truefuse.linear_cross_entropy(h, lw, t), h, lw),
        "attention": fb(lambda: truefuse.attention(q, k, v, is_causal=True), q, k, v),
        "gated swiglu": fb(lambda: truefuse.gated_activation(ga, "swiglu"), ga),
        "rope": fb(lambda: truefuse.apply_rotary_pos_emb(q, k, cos, sin), q, k),
    }
    if hasattr(truefuse, "add_rms_norm_hf"):
        cases["+add_rms_norm_hf"] = fb(lambda: truefuse.add_rms_norm_hf(res, x, w, 1e-6), res, x, w)
        cases["+add then rms_norm_hf"] = fb(lambda: (lambda s: (truefuse.rms_norm_hf(s, w, 1e-6), s))(res + x), res, x, w)
        cases["+stock add + norm ops"] = fb(stock_add_norm, res, x, w)
    for bi in (False, True):
        for name, f in cases.items():
            if bi and name.startswith(("rope", "gated", "+")):
                continue
            with truefuse.batch_invariant(bi):
                # the fastest of three: one process's clock or neighbour can slow one sample
                ms = min(triton.testing.do_bench(f, warmup=100, rep=300) for _ in range(3))
            print(json.dumps({"tree": label, "op": ("BI " if bi else "") + name, "ms": ms}), flush=True)


def table(lines) -> None:
    ms = collections.defaultdict(list)
    for line in lines:
        if line.startswith("{"):
            row = json.loads(line)
            ms[(row["op"], row["tree"])].append(row["ms"])
    ops = list(dict.fromkeys(op for op, _ in ms))
    print(f"{'row (fwd+bwd, bf16)':28} {'before ms':>10} {'after ms':>10} {'after/before':>12}  per-round ratio range")
    for op in ops:
        bef, aft = ms.get((op, "before"), []), ms.get((op, "after"), [])
        if bef and aft:
            ratios = [a / b_ for a, b_ in zip(aft, bef, strict=False)]
            mb, ma = statistics.median(bef), statistics.median(aft)
            print(f"{op:28} {mb:10.4f} {ma:10.4f} {ma / mb:12.3f}  {min(ratios):.3f}-{max(ratios):.3f} ({len(ratios)} rounds)")
        elif aft:
            print(f"{op:28} {'':10} {statistics.median(aft):10.4f}  (after only, {len(aft)} rounds)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="checkout of the old tree")
    p.add_argument("--after", default=".", help="checkout of the new tree (default: here)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="also write the JSON lines here")
    p.add_argument("--one", nargs=2, metavar=("TREE", "LABEL"), help="(internal) time one tree")
    args = p.parse_args()
    if args.one:
        return one(*args.one)
    trees = [("after", args.after)] if args.before is None else [("before", args.before), ("after", args.after)]
    lines: list[str] = []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tree comes from --one
    for rnd in range(args.rounds):
        for label, tree in trees:
            run = subprocess.run(
                [sys.executable, __file__, "--one", tree, label], capture_output=True, text=True, env=env, timeout=300
            )
            if run.returncode:
                print(f"round {rnd} {label}: rc {run.returncode}: {run.stderr[-400:]}", file=sys.stderr)
            lines += run.stdout.splitlines()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    table(lines)


if __name__ == "__main__":
    main()
