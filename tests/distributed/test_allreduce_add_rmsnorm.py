"""allreduce / allreduce_add_rmsnorm on gloo with 2 and 4 CPU processes: the bitwise table of
DESIGN §4 (printed), and bad input as the same clear error on every rank (no hang)."""

import pytest
import torch
import torch.distributed as dist

from truefuse.distributed import Workspace, allreduce, allreduce_add_rmsnorm
from truefuse.distributed.check import format_table, table
from truefuse.distributed.launch import run_local


@pytest.mark.parametrize("world_size", [2, 4])
def test_bitwise_table(world_size):
    per_rank = run_local(world_size, table)
    print("\n" + format_table(per_rank[0], world_size))
    for rank, rows in enumerate(per_rank):
        failed = [r for r in rows if not r["passed"]]
        assert not failed, f"rank {rank}: {failed[:3]}"
    assert len(per_rank[0]) == 9 * 2 * 3


def _bad_input(rank, world_size, kind):
    x = torch.randn(4, 64)
    ws = None
    if kind == "shape" and rank == 1:
        x = torch.randn(5, 64)
    if kind == "dtype" and rank == 0:
        x = x.to(torch.bfloat16)
    if kind == "noncontiguous" and rank == world_size - 1:
        x = torch.randn(64, 4).t()
    if kind == "workspace":
        ws = Workspace(max_bytes=512)
    try:
        if kind == "residual":
            allreduce_add_rmsnorm(x, torch.randn(4, 63), torch.ones(64))
        else:
            allreduce(x, workspace=ws)
    except ValueError as e:
        dist.barrier()  # every rank got here: nobody hangs in the collective
        return str(e)
    return None


BAD = {
    "shape": "ranks disagree on the input's shape or dtype",
    "dtype": "ranks disagree on the input's shape or dtype",
    "noncontiguous": "rank 1: x is not contiguous",
    "workspace": "x is 1024 bytes but the workspace holds 512",
    "residual": "residual must match x",
}


def _all_bad_inputs(rank, world_size):
    return {kind: _bad_input(rank, world_size, kind) for kind in BAD}


def test_bad_input_is_an_error_on_every_rank():
    """One process group runs every bad case in turn: each raises on every rank, and the group is
    still usable afterwards (the next case's collectives go through)."""
    for errors in run_local(2, _all_bad_inputs):
        for kind, msg in BAD.items():
            assert errors[kind] is not None and msg in errors[kind], (kind, errors[kind])


def _grad(rank, world_size):
    torch.manual_seed(rank)
    x = torch.randn(3, 16, requires_grad=True)
    res = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    normed, res_out = allreduce_add_rmsnorm(x, res, w, 1e-6)
    (normed.sum() + 2 * res_out.sum()).backward()
    return x.grad, res.grad, w.grad


def test_backward_needs_no_collective():
    """The allreduce's backward is the identity: x and residual get the same gradient."""
    for gx, gres, gw in run_local(2, _grad):
        assert torch.equal(gx, gres) and gw.shape == (16,) and torch.isfinite(gx).all()
