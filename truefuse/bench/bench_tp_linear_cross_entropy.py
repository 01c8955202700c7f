"""``python -m truefuse bench tp_linear_cross_entropy --world-size N`` (also run by ``bench tp``): the
vocab-parallel LM-head loss, forward + backward, bf16, 8192 tokens, vocabulary 128256, hidden 4096,
on N local GPUs (one process each, NCCL); rank r holds rows [r·V/N, (r+1)·V/N) of the head.

Providers, side by side in one run on the same inputs (mean reduction, input and weight gradients):

* ``truefuse``: :func:`truefuse.distributed.linear_cross_entropy` on this rank's shard (the
  default: the shard's logits kept for the backward, three GEMMs); ``truefuse_lean``: with
  ``memory="lean"`` (the backward computes the logits again: four GEMMs, less memory);
* ``megatron``: Megatron's unfused pattern written with PyTorch: the shard's logits (``F.linear``,
  bf16, then fp32), the vocab-parallel cross-entropy as an autograd Function (the row max, the
  target's logit and the sum of exponentials each one ``all_reduce``; the softmax kept for the
  backward), d_input summed by an ``all_reduce`` in bf16 (the ``copy`` region);
* ``single``: :func:`truefuse.linear_cross_entropy` on the whole head, on rank 0 alone (the other
  ranks wait): the one-GPU loss the issue compares against;
* ``gemms``: this rank's three GEMMs on its shard (logits, d_input, d_weight), the floor.

Timing as ``bench tp``: fixed counts on every rank, interleaved rounds, the median round; a step's
time is the slowest rank's (``single``: rank 0's). Peak memory: one step's ``max_memory_allocated``
above what the inputs hold, returned gradients included (rank 0's).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from truefuse.bench.harness import launch_ranks, measure_ranks, save_rows, slowest_rank

FULL = {"tokens": 8192, "vocab": 128256, "hidden": 4096}
QUICK = {"tokens": 1024, "vocab": 32000, "hidden": 1024}
CPU_SMOKE = {"tokens": 32, "vocab": 256, "hidden": 32}


class _MegatronCrossEntropy(torch.autograd.Function):
    """Vocab-parallel cross-entropy on fp32 logits (N, V_r), per token, the way Megatron-LM computes
    it (written here from the math): three all-reduces, the softmax kept for the backward."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        logits = logits - m.unsqueeze(-1)
        V_r = logits.shape[-1]
        own = (target >= vocab_start) & (target < vocab_start + V_r)
        idx = (target - vocab_start).clamp(0, V_r - 1)
        pred = logits.gather(1, idx.unsqueeze(1)).squeeze(1) * own
        dist.all_reduce(pred, group=group)
        e = logits.exp_()
        s = e.sum(dim=-1)
        dist.all_reduce(s, group=group)
        e.div_(s.unsqueeze(-1))
        ctx.save_for_backward(e, own, idx)
        return s.log() - pred

    @staticmethod
    def backward(ctx, g):
        p, own, idx = ctx.saved_tensors
        grad = p.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, idx] -= own.to(grad.dtype)
        return grad * g.unsqueeze(-1), None, None, None


def _steps(shape: dict, rank: int, world: int, dev: torch.device) -> tuple[dict, dict, object]:
    """name -> step, one step's (loss, d_input) of truefuse and megatron (a sanity check), and a
    function that frees every provider's weight gradient."""
    import truefuse
    from truefuse.distributed import linear_cross_entropy as vocab_parallel
    from truefuse.distributed._regions import torch_region
    from truefuse.ops.gemm.gemm import gemm

    N, V, H = shape["tokens"], shape["vocab"], shape["hidden"]
    shards = shape.get("shards", world)  # > world: one rank's work of a wider group (its compute alone)
    if V % shards:
        raise ValueError(f"vocab {V} must be divisible by the number of shards {shards}")
    V_r, start = V // shards, rank * (V // shards)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(1234)  # the same inputs on every rank
    x = torch.randn(N, H, generator=g, device=dev).to(dt)
    W = (torch.randn(V, H, generator=g, device=dev) * H**-0.5).to(dt)
    t = torch.randint(0, V_r * world, (N,), generator=g, device=dev)  # V unless emulating
    Wr = W[start : start + V_r].clone().requires_grad_()
    Wt, Wm, Wl = (Wr.detach().clone().requires_grad_() for _ in range(3))
    Wfull = W.requires_grad_() if rank == 0 else None
    group = dist.group.WORLD

    def truefuse_step():
        Wt.grad = None
        xi = x.detach().requires_grad_()
        loss = vocab_parallel(xi, Wt, t)
        loss.backward()
        return loss.detach(), xi.grad

    def lean_step():
        Wl.grad = None
        vocab_parallel(x.detach().requires_grad_(), Wl, t, memory="lean").backward()

    def megatron_step():
        Wm.grad = None
        xi = x.detach().requires_grad_()
        logits = F.linear(torch_region(xi, "copy"), Wm).float()
        loss = _MegatronCrossEntropy.apply(logits, t, start, group).mean()
        loss.backward()
        return loss.detach(), xi.grad

    def single_step():
        if Wfull is not None:
            Wfull.grad = None
            truefuse.linear_cross_entropy(x.detach().requires_grad_(), Wfull, t).backward()

    d = torch.randn(N, V_r, generator=g, device=dev).to(dt)
    wd = Wr.detach()

    def gemms_step():
        gemm(x, wd.t())  # logits
        gemm(d, wd)  # d_input
        gemm(d.t(), x)  # d_weight

    def clear():
        for w in (Wt, Wl, Wm, Wfull):
            if w is not None:
                w.grad = None

    checks = {"truefuse": truefuse_step(), "megatron": megatron_step()}
    clear()
    steps = {"truefuse": truefuse_step, "truefuse_lean": lean_step, "megatron": megatron_step, "single": single_step}
    return {**steps, "gemms": gemms_step}, checks, clear


def _worker(rank: int, world: int, shape: dict, device: str) -> list[dict]:
    from truefuse.testing import rel_error

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    steps, checks, clear = _steps(shape, rank, world, dev)
    agree = {k: rel_error(a, b) for k, a, b in zip(("loss", "d_input"), checks["truefuse"], checks["megatron"], strict=True)}
    rounds, peak = measure_ranks(steps, dev, clear)  # the returned gradients are in the peak, not in its base
    return [
        {
            "provider": n,
            "ms": statistics.median(rounds[n]),
            "rounds_ms": rounds[n],
            "peak_mb": peak[n],
            **shape,
            "rel_diff_vs_megatron": agree if n == "truefuse" else None,
        }
        for n in steps
    ]


def run(world_size: int, out_dir: str, quick: bool = False, shards: int | None = None) -> int:
    """The table; ``shards`` > ``world_size`` runs one rank's share of a ``shards``-way split on each
    of ``world_size`` ranks (with 1: a rank's compute and memory on one GPU, no communication)."""
    n = shards or world_size
    shapes = tuple(dict(s, shards=n) for s in (FULL, QUICK, CPU_SMOKE))
    launched = launch_ranks(world_size, quick, _worker, shapes)
    if launched is None:
        return 2
    per_rank, s, on_gpu = launched
    rows = slowest_rank(per_rank, rank0_only=("single",))  # single: rank 0 alone
    single = next(r for r in rows if r["provider"] == "single")
    for r in rows:
        r["ratio_to_single"] = r["ms"] / single["ms"]
        r["peak_ratio_to_single"] = None if r["peak_mb"] is None or not single["peak_mb"] else r["peak_mb"] / single["peak_mb"]
    stem = f"tp_linear_cross_entropy_w{world_size}" + (f"_of{n}" if n != world_size else "")
    out = save_rows(out_dir, stem, rows, world_size=world_size, dtype="bfloat16" if on_gpu else "float32", on_gpu=on_gpu)
    print(
        f"vocab-parallel linear cross-entropy fwd+bwd, {s['tokens']} tokens, vocab {s['vocab']}, hidden {s['hidden']}, "
        f"{world_size} {'GPUs (NCCL)' if on_gpu else 'CPU processes (gloo)'}"
        + (f", each rank one of {n} shards (its compute alone)" if n != world_size else "")
        + "; ms per step, ratio to single"
    )
    print(f"{'provider':>13} {'ms':>9} {'rank0 ms':>9} {'ratio':>7} {'peak MiB':>9} {'peak ratio':>10}")
    for r in rows:
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        pr = "-" if r["peak_ratio_to_single"] is None else f"{r['peak_ratio_to_single']:.3f}"
        print(f"{r['provider']:>13} {r['ms']:>9.3f} {r['ms_rank0']:>9.3f} {r['ratio_to_single']:>7.3f} {peak:>9} {pr:>10}")
    diff = next(r["rel_diff_vs_megatron"] for r in rows if r["provider"] == "truefuse")
    print("truefuse vs megatron, relative difference: " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))
    print(f"wrote {out}")
    return 0
