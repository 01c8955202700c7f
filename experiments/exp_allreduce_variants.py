"""Experiment: the allreduce kernel's variants, latency under CUDA graphs and bits against the
reference path: LL 1-stage (no barrier), 1-stage push / pull, 2-stage push / pull; "/1": one program per SM instead of two.

    python experiments/exp_allreduce_variants.py 4     # world size
"""

import sys

import torch
import torch.distributed as dist

from truefuse.bench.harness import graph_us
from truefuse.config import tuning  # the launcher reads its thresholds at each call
from truefuse.distributed import Workspace, allreduce_add_rmsnorm
from truefuse.distributed.launch import run_local

ROWS = (1, 4, 16, 64, 256, 1024, 4096)
VARIANTS = {  # name: (two_stage, push max bytes, LL max bytes, programs per SM); 1 byte: never (knobs are positive)
    "ll": (False, 1 << 62, 1 << 62, 2),
    "1s-push": (False, 1 << 62, 1, 2),
    "1s-pull": (False, 1, 1, 2),
    "1s-pull/1": (False, 1, 1, 1),
    "2s-push": (True, 1 << 62, 1, 2),
    "2s-push/1": (True, 1 << 62, 1, 1),
    "2s-pull": (True, 1, 1, 2),
    "2s-pull/1": (True, 1, 1, 1),
}


def _worker(rank, world_size):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    with tuning(ll_max_bytes=256 * 4096 * 2):  # LL slots sized for up to 256 rows
        ws = Workspace(max_bytes=max(ROWS) * 4096 * 2, validate=False)
    out = []
    for m in ROWS:
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(m, 4096, generator=g, device=dev, dtype=torch.bfloat16)
        res = torch.randn(m, 4096, generator=g, device=dev, dtype=torch.bfloat16)
        w = torch.randn(4096, generator=g, device=dev, dtype=torch.bfloat16)
        ref = allreduce_add_rmsnorm(x, res, w, 1e-6)  # no workspace: the reference path
        for name, (two, push, ll, per_sm) in VARIANTS.items():
            if (name.startswith("ll") and m > 64) or (name.endswith("/1") and m < 256) or (name.startswith("2s") and m < 16):
                continue
            ws.two_stage_bytes = 0 if two else 1 << 62
            with tuning(push_max_bytes=push, ll_max_bytes=ll, programs_per_sm=per_sm):
                got = allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws)
                same = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
                us = graph_us(lambda x=x, res=res, w=w: allreduce_add_rmsnorm(x, res, w, 1e-6, workspace=ws))
            out.append((m, name, us, same))
        dist.barrier()
    ws.close()
    return out


if __name__ == "__main__":
    W = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    rows = run_local(W, _worker, backend="nccl")[0]
    print(f"world size {W}: us per call under CUDA graphs, bf16, hidden 4096")
    print(f"{'rows':>6} {'variant':>10} {'us':>8} bitwise")
    for m, name, us, same in rows:
        print(f"{m:>6} {name:>10} {us:>8.2f} {same}")
