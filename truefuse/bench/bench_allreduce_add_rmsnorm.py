"""``python -m truefuse bench allreduce_add_rmsnorm --world-size N``: latency of the end of a
tensor-parallel sublayer, bf16, under CUDA graphs, on N local GPUs (one process each, NCCL).

Providers, measured side by side in one run on every rank:

* ``nccl``: ``dist.all_reduce`` + ``residual`` add + ``F.rms_norm`` (the unfused path);
* ``truefuse_1stage`` / ``truefuse_2stage``: ``allreduce_add_rmsnorm`` on a Workspace forced to
  each kernel;
* ``symm_one_shot``: torch's ``symm_mem.one_shot_all_reduce`` (bf16 sums: not equal to NCCL) + add +
  ``F.rms_norm``, when the op exists.

Each rank captures 10 calls in one CUDA graph and replays it 20 times (fixed counts: every rank runs
the same collectives; ``bench/harness.py::graph_us``); the latency is rank 0's time per call.
Ratios are against ``nccl``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from truefuse.bench.harness import graph_us, launch_ranks, save_rows

ROWS = (1, 4, 16, 64, 256, 1024, 4096)


def _measure(m, hidden, rank, dev, ws, one_shot, symm_buf) -> list[dict]:
    """Every provider at m rows (closures used at once, inside this call)."""
    from truefuse.distributed import allreduce_add_rmsnorm

    eps = 1e-6
    out = []
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(m, hidden, generator=g, device=dev, dtype=torch.bfloat16)
    res = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def nccl():
        y.copy_(x)
        dist.all_reduce(y)
        r = y + res
        return F.rms_norm(r, (hidden,), w, eps), r

    def fused(two_stage: bool):
        def fn():
            ws.two_stage_bytes = 0 if two_stage else 1 << 62
            return allreduce_add_rmsnorm(x, res, w, eps, workspace=ws)

        return fn

    providers = {"nccl": nccl, "truefuse_1stage": fused(False), "truefuse_2stage": fused(True)}
    if symm_buf is not None:
        view = symm_buf[: m * hidden].view(m, hidden)

        def symm():
            view.copy_(x)
            r = one_shot(view, "sum", dist.group.WORLD.group_name) + res
            return F.rms_norm(r, (hidden,), w, eps), r

        providers["symm_one_shot"] = symm
    us = {name: graph_us(fn) for name, fn in providers.items()}
    for name, t in us.items():
        out.append({"rows": m, "hidden": hidden, "bytes": m * hidden * 2, "provider": name, "us": t, "ratio": t / us["nccl"]})
    return out


def _worker(rank: int, world_size: int, shape: dict, device: str) -> list[dict]:
    from truefuse.distributed import Workspace

    hidden, rows = shape["hidden"], shape["rows"]
    torch.cuda.set_device(rank)
    dev = torch.device(device, rank)
    ws = Workspace(max_bytes=max(rows) * hidden * 2, validate=False)
    one_shot = getattr(torch.ops.symm_mem, "one_shot_all_reduce", None)
    symm_buf = None
    if one_shot is not None:
        import torch.distributed._symmetric_memory as symm_mem

        symm_buf = symm_mem.empty(max(rows) * hidden, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(symm_buf, dist.group.WORLD.group_name)
    out = []
    for m in rows:
        out += _measure(m, hidden, rank, dev, ws, one_shot, symm_buf)
    ws.close()
    return out


def run(world_size: int, out_dir: str, quick: bool = False, hidden: int = 4096) -> int:
    shapes = ({"hidden": hidden, "rows": ROWS}, {"hidden": hidden, "rows": (1, 16)}, None)  # GPUs only: CUDA graphs
    launched = launch_ranks(world_size, quick, _worker, shapes)
    if launched is None:
        return 2
    results = launched[0][0]  # rank 0's times
    save_rows(out_dir, f"allreduce_add_rmsnorm_w{world_size}", results, world_size=world_size, cuda_graph=True)
    print(f"allreduce + add + RMSNorm, bf16, hidden {hidden}, {world_size} GPUs, CUDA graphs (us per call; ratio to nccl)")
    print(f"{'rows':>6} {'provider':>16} {'us':>9} {'ratio':>7}")
    for r in results:
        print(f"{r['rows']:>6} {r['provider']:>16} {r['us']:>9.2f} {r['ratio']:>7.3f}")
    return 0
