"""``python -m truefuse bench tp --world-size N``: a tensor-parallel MLP's forward + backward on N
local GPUs (one process each, NCCL), bf16, 8192 tokens, hidden 4096, ffn 14336 (swiglu).

Providers, measured side by side in one run on every rank, on the same shards and inputs:

* ``torch``: the layer as a user writes it with PyTorch: ``F.linear`` on the shards, ``F.silu(gate)
  * up``, ``F.linear``, ``torch.distributed.all_reduce`` (the output forward, d_input backward),
  ``+ residual``, ``F.rms_norm`` (``truefuse.distributed._regions.torch_region``);
* ``truefuse``: :class:`~truefuse.distributed.TensorParallelMLP` with a ``Workspace`` (the
  allreduce kernels; ``validate=False``, as a training loop that knows its shapes runs it): the fused
  swiglu, the fused allreduce + residual + RMSNorm, d_input's allreduce on the kernel too;
* ``gemms``: the six GEMMs of one rank (fc1 / fc2 forward, d_input, d_weight) alone, the floor.

Each step is forward + backward with fixed upstream gradients (parameter gradients cleared, not
accumulated). Every rank runs the same fixed counts (no adaptive repetition: each call has
collectives; ``bench/harness.py::measure_ranks``): 3 warm-up steps, then 5 rounds of 10 steps per
provider, providers interleaved and their order reversed every other round; a provider's time is
the median round's per step, and the step time is the slowest rank's. Ratios are against ``torch``. Peak memory: one step's
``max_memory_allocated`` above what the inputs and parameters hold.

Without GPUs (or fewer than N) ``--quick`` runs a small CPU smoke run over gloo (no measurement).
Then the vocab-parallel loss's table (``bench_tp_linear_cross_entropy``) in the same call.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from truefuse.bench import bench_tp_linear_cross_entropy
from truefuse.bench.harness import launch_ranks, measure_ranks, save_rows, slowest_rank

FULL = {"tokens": 8192, "hidden": 4096, "ffn": 14336}
QUICK = {"tokens": 1024, "hidden": 1024, "ffn": 2048}
CPU_SMOKE = {"tokens": 64, "hidden": 64, "ffn": 128}


def _providers(shape: dict, rank: int, world: int, dev: torch.device, ws) -> tuple[dict, dict]:
    """name -> step function, and the outputs of one step of torch and truefuse (for a sanity check)."""
    from truefuse.distributed import TensorParallelMLP
    from truefuse.distributed._regions import torch_region
    from truefuse.ops.gemm.gemm import gemm

    M, H, Fw = shape["tokens"], shape["hidden"], shape["ffn"]
    f = Fw // world
    dt, eps = torch.bfloat16, 1e-6
    g = torch.Generator(device=dev).manual_seed(1234)  # the same replicated inputs on every rank

    def rand(*s, scale=1.0, gen=g):
        return (torch.randn(*s, generator=gen, device=dev, dtype=torch.float32) * scale).to(dt)

    x, res, dn, dr = rand(M, H), rand(M, H), rand(M, H), rand(M, H)
    mlp = TensorParallelMLP(H, Fw, device=dev, dtype=dt, activation="swiglu", eps=eps, workspace=ws)
    gs = torch.Generator(device=dev).manual_seed(99 + rank)  # shards differ by rank
    with torch.no_grad():
        mlp.fc1.weight.copy_(rand(2 * f, H, scale=H**-0.5, gen=gs))
        mlp.fc2.weight.copy_(rand(H, f, scale=Fw**-0.5, gen=gs))
    w1, w2, nw = (p.detach().clone().requires_grad_() for p in (mlp.fc1.weight, mlp.fc2.weight, mlp.norm_weight))
    params = {"truefuse": list(mlp.parameters()), "torch": [w1, w2, nw]}

    def clear(ps):
        for p in ps:
            p.grad = None

    def truefuse_step():
        clear(params["truefuse"])
        xi = x.detach().requires_grad_()
        normed, res_out = mlp(xi, res)
        torch.autograd.backward([normed, res_out], [dn, dr])
        return normed, res_out, xi

    def torch_step():
        clear(params["torch"])
        xi = x.detach().requires_grad_()
        h = F.linear(torch_region(xi, "copy"), w1)
        gate, up = h.chunk(2, dim=-1)
        y = torch_region(F.linear(F.silu(gate) * up, w2), "reduce")
        res_out = y + res
        normed = F.rms_norm(res_out, (H,), nw, eps)
        torch.autograd.backward([normed, res_out], [dn, dr])
        return normed, res_out, xi

    # the floor: one rank's six GEMMs on operands of the right shapes, nothing else
    a1, a2 = rand(M, 2 * f), rand(M, f)
    o1, o2 = torch.empty(M, 2 * f, device=dev, dtype=dt), torch.empty(M, H, device=dev, dtype=dt)
    wd = w1.detach(), w2.detach()

    def gemms_step():
        gemm(x, wd[0].t(), out=o1)  # fc1 forward
        gemm(a2, wd[1].t(), out=o2)  # fc2 forward
        gemm(o2, wd[1])  # fc2 d_input
        gemm(o2.t(), a2)  # fc2 d_weight
        gemm(a1, wd[0])  # fc1 d_input
        gemm(a1.t(), x)  # fc1 d_weight

    outputs = {}
    for name, step in (("torch", torch_step), ("truefuse", truefuse_step)):
        normed, res_out, xi = step()
        outputs[name] = (normed.detach(), res_out.detach(), xi.grad)
    return {"torch": torch_step, "truefuse": truefuse_step, "gemms": gemms_step}, outputs


def _worker(rank: int, world: int, shape: dict, device: str) -> list[dict]:
    from truefuse.distributed import Workspace
    from truefuse.testing import rel_error

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ws = Workspace(max_bytes=shape["tokens"] * shape["hidden"] * 2, validate=False)
    steps, outs = _providers(shape, rank, world, dev, ws)
    # sanity: the two layers agree to bf16 rounding (not a contract check: verify --world-size is)
    agree = {
        k: rel_error(a, b) for k, a, b in zip(("normed", "residual_out", "d_input"), outs["truefuse"], outs["torch"], strict=True)
    }
    rounds, peak = measure_ranks(steps, dev)
    dist.barrier()
    ws.close()
    return [
        {
            "provider": n,
            "ms": statistics.median(rounds[n]),
            "rounds_ms": rounds[n],
            "peak_mb": peak[n],
            **shape,
            "rel_diff_vs_torch": agree if n == "truefuse" else None,
        }
        for n in steps
    ]


def run(world_size: int, out_dir: str, quick: bool = False) -> int:
    launched = launch_ranks(world_size, quick, _worker, (FULL, QUICK, CPU_SMOKE))
    if launched is None:
        return 2
    per_rank, shape, on_gpu = launched
    rows = slowest_rank(per_rank)
    ref = next(r["ms"] for r in rows if r["provider"] == "torch")
    for r in rows:
        r["ratio"] = r["ms"] / ref
    out = save_rows(
        out_dir, f"tp_mlp_w{world_size}", rows, world_size=world_size, dtype="bfloat16", activation="swiglu", on_gpu=on_gpu
    )
    s = shape
    print(
        f"TensorParallelMLP fwd+bwd, bf16, {s['tokens']} tokens, hidden {s['hidden']}, ffn {s['ffn']}, "
        f"{world_size} {'GPUs (NCCL)' if on_gpu else 'CPU processes (gloo)'}; "
        "ms per step (slowest rank), ratio to torch"
    )
    print(f"{'provider':>10} {'ms':>9} {'rank0 ms':>9} {'ratio':>7} {'peak MiB':>9}")
    for r in rows:
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        print(f"{r['provider']:>10} {r['ms']:>9.3f} {r['ms_rank0']:>9.3f} {r['ratio']:>7.3f} {peak:>9}")
    diff = next(r["rel_diff_vs_torch"] for r in rows if r["provider"] == "truefuse")
    print("truefuse vs torch, relative difference: " + ", ".join(f"{k} {v:.2e}" for k, v in diff.items()))
    print(f"wrote {out}")
    return bench_tp_linear_cross_entropy.run(world_size, out_dir, quick)  # the parallel loss's table after the layer's
