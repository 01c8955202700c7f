"""Ranks that pass different process groups (docs/design.md §4, issue 31 item 7), on 2 gloo CPU
processes, every case in one spawn (a spawn costs ~3 s of the 2-core CI machine):

* the same ranks, different group objects (the default group on rank 0 and an equal subgroup on
  rank 1; two ``new_group`` calls over the same ranks), passed to a parallel layer, to the
  vocab-parallel loss and to ``allreduce``: the same ``ValueError`` on every rank, naming
  ``group`` and each rank's group, and the group still usable afterwards. Before the agreement
  ran over :func:`truefuse.distributed._agree.agreement_group`, each rank waited on its own group
  forever: the spawn's timeout turns that into a failure;
* groups of different members (rank 1 alone in its group): the limit that stays. Rank 1 returns,
  since nobody in its group calls it; rank 0 waits for rank 1, which its own group leaves out,
  and goes on only when rank 1 makes the matching call on rank 0's group.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from _interpreter_speedup import run_local

from truefuse.testing import error_on_every_rank


def _cases(rank: int, world: int) -> dict:
    from truefuse.distributed import ColumnParallelLinear, TensorParallelMLP, allreduce
    from truefuse.distributed import linear_cross_entropy as vp_lce
    from truefuse.verify.distributed_vocab import inputs

    sub, sub2, signal = (dist.new_group([0, 1]) for _ in range(3))  # every rank makes every group, in one order
    alone = [dist.new_group([r]) for r in range(world)]
    world_vs_sub = (None, sub)[rank]  # the default group on rank 0, an equal subgroup on rank 1
    two_subs = (sub, sub2)[rank]
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    xl, W, _, t, _, _ = inputs(torch.float64, 8, 16 * world)
    shard = W[rank * 16 : (rank + 1) * 16]
    out = {
        "column_world_vs_sub": error_on_every_rank(lambda: ColumnParallelLinear(32, 8 * world, group=world_vs_sub)(x)),
        "mlp_two_subs": error_on_every_rank(
            lambda: TensorParallelMLP(32, 8 * world, dtype=torch.bfloat16, group=two_subs)(x.bfloat16(), x.bfloat16())
        ),
        "loss_world_vs_sub": error_on_every_rank(lambda: vp_lce(xl, shard, t, group=world_vs_sub)),
        "loss_two_subs": error_on_every_rank(lambda: vp_lce(xl, shard, t, group=two_subs)),
        "allreduce_two_subs": error_on_every_rank(lambda: allreduce(x, group=two_subs)),
    }
    # the groups still work: the same group on every rank passes
    out["names"] = (dist.group.WORLD.group_name, sub.group_name, sub2.group_name)  # torch's names, the same on every rank
    out["after"] = bool(torch.isfinite(vp_lce(xl, shard, t, group=sub)).all()) and torch.equal(allreduce(x, group=sub2), x * 2)

    # different members: rank 1 alone returns; rank 0 (the default group: rank 1 too) waits for it
    layer = ColumnParallelLinear(32, 8 * world, group=alone[1] if rank == 1 else None)
    if rank == 0:
        done: list = []
        waiting = threading.Thread(target=lambda: done.append(layer(x).shape), daemon=True)
        waiting.start()
        waiting.join(2.0)
        out["rank0_waits"] = waiting.is_alive()
        dist.barrier(group=signal)  # another group's collective: rank 0's pending one is untouched
        waiting.join(60.0)  # rank 1's matching call lets it go on
        out["rank0_done"] = done
    else:
        out["rank1_alone"] = tuple(layer(x).shape)
        dist.barrier(group=signal)
        ColumnParallelLinear(32, 8 * world)(x)  # the call rank 0 waits for, on the default group
    dist.barrier()
    return out


#: case -> (rank 0's group, rank 1's group): "world", "sub" or "sub2"
_GROUPS = {
    "column_world_vs_sub": ("world", "sub"),
    "mlp_two_subs": ("sub", "sub2"),
    "loss_world_vs_sub": ("world", "sub"),
    "loss_two_subs": ("sub", "sub2"),
    "allreduce_two_subs": ("sub", "sub2"),
}
_OWNERS = {
    "column": "ColumnParallelLinear",
    "mlp": "TensorParallelMLP",
    "loss": "distributed.linear_cross_entropy",
    "allreduce": "allreduce",
}


def test_mismatched_process_groups_raise_on_every_rank():
    results = run_local(2, _cases, timeout_s=120)  # a hang (each rank on its own group) fails here
    world, sub, sub2 = results[0]["names"]
    shown = {"world": f"{world!r} (the default group)", "sub": repr(sub), "sub2": repr(sub2)}
    for case, groups in _GROUPS.items():
        g0, g1 = (shown[g] for g in groups)
        want = (
            f"{_OWNERS[case.split('_')[0]]}: ranks disagree on group (rank 0: group=process group {g0} over global "
            f"ranks [0, 1]; rank 1: group=process group {g1} over global ranks [0, 1]) (every rank must pass the "
            "same process group)"
        )
        for rank, res in enumerate(results):
            assert res[case] == ("ValueError", want), (rank, case, res[case])
    assert all(res["after"] for res in results)
    # the limit: different members are not an error on the rank alone, and a wait on the other
    assert results[1]["rank1_alone"] == (3, 16)  # the whole layer: a group of one
    assert results[0]["rank0_waits"] and results[0]["rank0_done"] == [(3, 8)]
