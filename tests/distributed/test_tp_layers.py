"""Tensor-parallel layers on gloo with 2 and 4 CPU processes (docs/tensor_parallel.md).

One ``run_local`` spawn per world size runs every check and returns a dict the test asserts on
(a spawn with torch's import costs ~3 s per process on the 2-core CI machine):

* the verify table (``truefuse/verify/distributed_tp.py``): each layer against the single-process
  layer built from the same unsharded weights, bounded (outputs, input gradients, this rank's
  weight / bias / norm-weight gradients), replicated tensors bitwise equal on every rank, delayed
  weight gradients bitwise the immediate ones, fused ``main_grad`` over 2 micro-batches;
* bad input on one rank: the same clear error on every rank, and the group still usable;
* ``register_wgrad_hook``, ``grad_added_to_main_grad``, ``from_linear`` with a ``truefuse.Linear``;
* controls that the checks can fail: a wrongly sharded layer fails the bounded check, a tensor that
  differs between ranks fails the all-ranks check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _interpreter_speedup import run_local

from truefuse.distributed import shard_columns, shard_rows, unshard_columns, unshard_rows
from truefuse.testing import error_on_every_rank


def _bad_inputs(rank: int, world: int) -> dict:
    from truefuse.distributed import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP

    last = world - 1
    col = ColumnParallelLinear(32, 48, dtype=torch.float32)
    row = RowParallelLinear(48, 32, bias=False, fuse_residual_rmsnorm=True)
    mlp = TensorParallelMLP(32, 16 * world, dtype=torch.bfloat16)
    x = torch.randn(3, 32)
    xb, rb = x.to(torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16)
    out = {
        "col_last_dim": error_on_every_rank(lambda: col(torch.randn(3, 31) if rank == 1 else x)),
        "col_tokens": error_on_every_rank(lambda: col(torch.randn(4, 32) if rank == 0 else x)),
        "col_requires_grad": error_on_every_rank(lambda: col(x.clone().requires_grad_(rank == last))),
        "row_input_width": error_on_every_rank(
            lambda: row(torch.randn(3, 48) if rank == 0 else torch.randn(3, 48 // world), torch.randn(3, 32))
        ),
        "row_residual": error_on_every_rank(lambda: row(torch.randn(3, 48 // world), torch.randn(3, 31 if rank == last else 32))),
        "row_no_residual": error_on_every_rank(lambda: row(torch.randn(3, 48 // world))),
        "mlp_dtype": error_on_every_rank(lambda: mlp(x if rank == 0 else xb, rb)),
    }
    fused = TensorParallelMLP(32, 16 * world, dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    fused.fc1.weight.main_grad = torch.zeros(fused.fc1.weight.shape)
    if rank != 1:
        fused.fc2.weight.main_grad = torch.zeros(fused.fc2.weight.shape)
    out["mlp_main_grad"] = error_on_every_rank(lambda: fused(xb, rb))
    # the group is still usable, and nothing ran: no GEMM wrote fc1's main_grad
    out["fc1_main_grad_untouched"] = bool((fused.fc1.weight.main_grad == 0).all())
    good = mlp(xb, rb)[0]
    out["after"] = bool(torch.isfinite(good).all())
    return out


#: kind -> (error class, a part of the message that every rank must show)
BAD = {
    "col_last_dim": (
        "ValueError",
        "ColumnParallelLinear: bad input on rank 1: input has shape (3, 31): its last dimension must be in_features=32",
    ),
    "col_tokens": ("ValueError", "ColumnParallelLinear: ranks disagree on input shape"),
    "col_requires_grad": ("ValueError", "ranks disagree on input requires grad"),
    "row_input_width": (
        "ValueError",
        "RowParallelLinear: bad input on rank 0: input has shape (3, 48): with input_is_parallel=True",
    ),
    "row_residual": ("ValueError", "residual must have shape (3, 32)"),
    "row_no_residual": ("TypeError", "residual must be a torch.Tensor (fuse_residual_rmsnorm=True), got NoneType"),
    "mlp_dtype": ("TypeError", "TensorParallelMLP: bad input on rank 0: input has dtype torch.float32"),
    "mlp_main_grad": (
        "RuntimeError",
        "TensorParallelMLP: bad input on rank 1: fuse_wgrad_accumulation=True but fc2.weight has no main_grad",
    ),
}


def _construction_errors(world: int) -> dict:
    from truefuse.distributed import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP

    cases = {
        "col_out_features": lambda: ColumnParallelLinear(32, 4 * world + 1),
        "row_in_features": lambda: RowParallelLinear(4 * world + 1, 32),
        "mlp_ffn": lambda: TensorParallelMLP(32, 4 * world + 1),
        "row_bias_fused": lambda: RowParallelLinear(8 * world, 32, fuse_residual_rmsnorm=True),
        "mlp_bias": lambda: TensorParallelMLP(32, 8 * world, bias=True),
        "dtype": lambda: ColumnParallelLinear(32, 8 * world, dtype=torch.float64),
        "row_wide_norm": lambda: RowParallelLinear(8 * world, 16385, bias=False, fuse_residual_rmsnorm=True, device="meta"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = str(e)
    return out


def _hooks_and_attrs(rank: int, world: int) -> dict:
    """register_wgrad_hook under plain, fused and delayed; grad_added_to_main_grad; from_linear."""
    import truefuse
    from truefuse.distributed import ColumnParallelLinear, TensorParallelMLP

    out = {}
    x, res = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16)
    for mode in ("plain", "fused", "delayed"):
        m = TensorParallelMLP(
            32, 8 * world, dtype=torch.bfloat16, fuse_wgrad_accumulation=mode == "fused", delay_wgrad_compute=mode == "delayed"
        )
        names = {id(p): n for n, p in m.gemm_weights()}
        if mode == "fused":
            for _, p in m.gemm_weights():
                p.main_grad = torch.zeros(p.shape)
        fired = []
        m.register_wgrad_hook(lambda p, fired=fired, names=names: fired.append(names[id(p)]))
        normed, res_out = m(x.clone().requires_grad_(), res)
        (normed.sum() + res_out.sum()).backward()
        before_dw = list(fired)
        m.backward_dw()
        out[mode] = (before_dw, list(fired), m.pending_wgrad)
    # fused with Megatron's attribute: cached zeros returned, the attribute set
    m = TensorParallelMLP(32, 8 * world, dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    for _, p in m.gemm_weights():
        p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape), False
    normed, _ = m(x, res)
    normed.sum().backward()
    out["attr"] = [
        (p.grad is not None and not p.grad.any().item(), p.grad_added_to_main_grad, bool(p.main_grad.any()))
        for _, p in m.gemm_weights()
    ]
    # from_linear with a truefuse.Linear: this rank's rows of its weight and bias
    torch.manual_seed(0)  # the same unsharded layer on every rank
    lin = truefuse.Linear(32, 8 * world)
    col = ColumnParallelLinear.from_linear(lin)
    out["from_linear"] = torch.equal(col.weight, shard_rows(lin.weight.detach(), rank, world)) and torch.equal(
        col.bias, shard_rows(lin.bias.detach(), rank, world)
    )
    out["parallel_attrs"] = (col.weight.tensor_model_parallel, col.weight.partition_dim, m.fc2.weight.partition_dim)
    return out


def _controls(rank: int, world: int) -> dict:
    """The checks can fail: a layer holding another rank's shard fails the bounded check, and a
    tensor that differs between ranks fails the all-ranks check."""
    from truefuse.distributed import ColumnParallelLinear
    from truefuse.testing import bounded_report, same_on_all_ranks

    g = torch.Generator().manual_seed(0)
    W, x = torch.randn(8 * world, 32, generator=g), torch.randn(5, 32, generator=g)
    good = ColumnParallelLinear.from_linear(W.bfloat16(), bias=None)
    wrong = ColumnParallelLinear.from_linear(W.roll(8, 0).bfloat16(), bias=None)  # another rank's rows
    ref64 = torch.nn.functional.linear(x.double(), W.double())[:, rank * 8 : (rank + 1) * 8]
    base = good.forward_ref(x.bfloat16())
    return {
        "good_passes": bounded_report(good(x.bfloat16()), ref64, base).passed,
        "wrong_shard_fails": not bounded_report(wrong(x.bfloat16()), ref64, base).passed,
        "differing_ranks_fail": not same_on_all_ranks(torch.full((4,), float(rank))),
    }


def _everything(rank: int, world: int, full: bool) -> dict:
    from truefuse.verify.distributed_tp import tp_table

    # time on the 2-core CI machine: fp32 runs the norm and gated kernels in Triton's interpreter
    # (the fused tail and the MLP); bf16 on the CPU runs their PyTorch references
    if full:  # every row in bf16; in fp32 all but the gelu MLP (the swiglu one runs the same tail)
        rows = tp_table(rank, world, dtypes=("bf16",))
        rows += tp_table(rank, world, dtypes=("fp32",), skip=("TensorParallelMLP/gelu",))
    else:  # 4 processes on 2 cores: bf16 forward and backward rows
        rows = tp_table(rank, world, dtypes=("bf16",), wgrad=False)
    return {
        "rows": rows,
        "bad": _bad_inputs(rank, world),
        "construct": _construction_errors(world),
        "hooks": _hooks_and_attrs(rank, world) if full else None,
        "controls": _controls(rank, world),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_layers(world_size):
    full = world_size == 2
    per_rank = run_local(world_size, _everything, full)

    # the table: every row passes on every rank, and it has the rows it should
    from truefuse.verify.distributed_tp import format_tp_table

    print("\n" + format_tp_table(per_rank[0]["rows"], world_size))
    for rank, res in enumerate(per_rank):
        failed = [r for r in res["rows"] if not r["passed"]]
        assert not failed, f"rank {rank}: {failed[:3]}"
    rows = per_rank[0]["rows"]
    fwd = {(r["op"], r["case"], r["dtype"]) for r in rows if r["check"] == "fwd_bwd"}
    assert len(fwd) == (7 + 6 if full else 7), sorted(fwd)
    replicated = [r for r in rows if r.get("all_ranks") is True]
    assert len(replicated) == (21 + 16 if full else 21)  # the all-ranks check ran on every replicated tensor
    if full:
        checks = {r["check"] for r in rows}
        assert {"delayed_vs_immediate_grad", "delayed_vs_immediate_main_grad", "main_grad_2_microbatches"} <= checks
        mg = [r for r in rows if r["check"] == "main_grad_2_microbatches"]
        assert len(mg) == 2 * 5  # column, row, fused row, MLP fc1 + fc2, in bf16 and fp32

    # bad input on one rank: the same error on every rank
    for rank, res in enumerate(per_rank):
        bad = res["bad"]
        for kind, (cls, msg) in BAD.items():
            got = bad[kind]
            assert got is not None and got[0] == cls and msg in got[1], (rank, kind, got)
            assert got == per_rank[0]["bad"][kind], (rank, kind)  # the very same message everywhere
        assert bad["fc1_main_grad_untouched"] and bad["after"], rank

    construct = per_rank[0]["construct"]
    w = world_size
    assert f"out_features={4 * w + 1} is not divisible by the tensor-parallel world size {w}" in construct["col_out_features"]
    assert f"in_features={4 * w + 1} is not divisible" in construct["row_in_features"]
    assert f"ffn_hidden_size={4 * w + 1} is not divisible" in construct["mlp_ffn"]
    assert "bias=True cannot be combined with fuse_residual_rmsnorm=True" in construct["row_bias_fused"]
    assert "bias=True is not supported" in construct["mlp_bias"]
    assert "dtype=torch.float64 is not supported" in construct["dtype"]
    assert "out_features=16385" in construct["row_wide_norm"]

    for rank, res in enumerate(per_rank):
        c = res["controls"]
        assert c["good_passes"] and c["wrong_shard_fails"] and c["differing_ranks_fail"], (rank, c)

    if full:
        for rank, res in enumerate(per_rank):
            h = res["hooks"]
            both = ["fc2.weight", "fc1.weight"]  # backward order
            assert h["plain"] == (both, both, 0), (rank, h["plain"])
            assert h["fused"] == (both, both, 0), (rank, h["fused"])
            assert h["delayed"] == ([], both, 0), (rank, h["delayed"])  # only backward_dw() completes them
            assert h["attr"] == [(True, True, True), (True, True, True)], (rank, h["attr"])
            assert h["from_linear"] and h["parallel_attrs"] == (True, 0, 1), rank


def test_sharding_helpers_round_trip():
    t = torch.arange(24.0).view(8, 3)
    for world in (1, 2, 4):
        assert torch.equal(unshard_rows([shard_rows(t, r, world) for r in range(world)]), t)
        assert torch.equal(unshard_rows([shard_rows(t, r, world, gated=True) for r in range(world)], gated=True), t)
        assert torch.equal(unshard_columns([shard_columns(t.t(), r, 1) for r in range(1)]), t.t())
    # gated: rank 0 of 2 holds gate rows 0-1 and up rows 4-5
    assert shard_rows(t, 0, 2, gated=True)[:, 0].tolist() == [0.0, 3.0, 12.0, 15.0]
    with pytest.raises(ValueError, match="F is not divisible by world_size=4"):
        shard_rows(torch.zeros(12, 2), 0, 4, gated=True)
    with pytest.raises(ValueError, match="not divisible by world_size=5"):
        shard_columns(t, 0, 5)
    with pytest.raises(ValueError, match="rank must be"):
        shard_rows(t, 2, 2)


def test_layers_need_a_process_group():
    from truefuse.distributed import ColumnParallelLinear

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="initialised process group"):
        ColumnParallelLinear(8, 8)
