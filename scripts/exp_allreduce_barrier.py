"""Experiment: the allreduce kernel's barrier flavours (release/acquire per flag vs one system fence
per side), 1-stage and 2-stage, latency under CUDA graphs and bits against the reference.

    python scripts/exp_allreduce_barrier.py 4     # world size
"""

import sys

import torch
import torch.distributed as dist

from truefuse.bench.bench_allreduce_add_rmsnorm import _graph_us
from truefuse.distributed import Workspace, allreduce_add_rmsnorm, symm
from truefuse.distributed.launch import run_local

ROWS = (1, 16, 256, 4096)


def _worker(rank, world_size):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    ws = Workspace(max_bytes=max(ROWS) * 4096 * 2, validate=False)
    out = []
    for m in ROWS:
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(m, 4096, generator=g, device=dev, dtype=torch.bfloat16)
        res = torch.randn(m, 4096, generator=g, device=dev, dtype=torch.bfloat16)
        w = torch.randn(4096, generator=g, device=dev, dtype=torch.bfloat16)
        ws.two_stage_bytes = 1 << 62
        ws_ref = allreduce_add_rmsnorm(x, res, w, 1e-6)  # no workspace: the reference path
        for fence in (False, True):
            symm.ONE_FENCE = fence
            for two in (False, True):
                ws.two_stage_bytes = 0 if two else 1 << 62
                got = allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws)
                same = all(torch.equal(a, b) for a, b in zip(got, ws_ref, strict=True))
                us = _graph_us(lambda x=x, res=res, w=w: allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws))
                out.append((m, "fence" if fence else "acq/rel", "2-stage" if two else "1-stage", us, same))
        dist.barrier()
    ws.close()
    return out


if __name__ == "__main__":
    W = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    rows = run_local(W, _worker, backend="nccl")[0]
    print(f"world size {W}: us per call under CUDA graphs, bf16, hidden 4096")
    print(f"{'rows':>6} {'barrier':>8} {'kernel':>8} {'us':>8} bitwise")
    for m, b, k, us, same in rows:
        print(f"{m:>6} {b:>8} {k:>8} {us:>8.2f} {same}")
