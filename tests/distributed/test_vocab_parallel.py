"""Vocab-parallel linear cross-entropy (``truefuse.distributed.linear_cross_entropy``) on gloo with
2 and 4 CPU processes: one ``run_local`` spawn per world size runs every check and returns what
the test asserts on.

* the verify table (``truefuse/verify/distributed_vocab.py``): every option against the float64
  reference on the gathered weight, bounded with the single-process loss as the baseline (fp64:
  the PyTorch path; fp32 at 2 ranks: the slice kernels under the interpreter): loss, z-loss,
  accuracy, d_input, this rank's d_weight and d_bias rows; the replicated ones bitwise the same on
  every rank; delayed weight gradient bitwise the immediate one; main_grad over 2 micro-batches;
* a control: a rank holding another rank's rows fails the bounded check;
* uneven shards with explicit ``vocab_start``;
* a target outside the whole vocabulary on one rank, shards that do not tile the vocabulary, a
  missing main_grad on one rank: the same clear error on every rank, and the group still usable.
"""

from __future__ import annotations

import pytest
import torch
from _interpreter_speedup import run_local

from truefuse.testing import error_on_every_rank


def _worker(rank: int, world: int) -> dict:
    from truefuse.distributed import linear_cross_entropy as vp_lce
    from truefuse.ops.lm_head.linear_cross_entropy import linear_cross_entropy_ref
    from truefuse.testing import bounded_report
    from truefuse.verify.distributed_vocab import inputs, run_loss, vocab_table

    # fp32 (the interpreter's kernels) and the §2 rows at 2 ranks only: 4 processes share 2 cores
    res: dict = {"rows": vocab_table(rank, world, dtypes=("fp64", "fp32") if world == 2 else ("fp64",)), "errors": {}}
    V, H = 40 * world, 16
    rows = slice(rank * 40, (rank + 1) * 40)

    # control: this rank holding the next rank's rows (the vocabulary order broken) is not bounded
    x, W, b, t, cw, up = inputs(torch.float64, 12, V)
    other = slice(((rank + 1) % world) * 40, ((rank + 1) % world + 1) * 40)
    wrong = run_loss(vp_lce, x, W[other], t, None, up, "mean", vocab_slice=16)
    ref = run_loss(linear_cross_entropy_ref, x, W, t, None, up, "mean")
    res["control_fails"] = not bounded_report(wrong["loss"], ref["loss"], ref["loss"]).passed

    # memory="default" keeps pass 1's logits for the backward, "lean" computes them again: the same
    # bits (fp64: the PyTorch path; fp32 at 2 ranks: the slice kernels); a second backward runs the
    # GEMMs again (the kept logits were consumed) and gives the first one's bits (the delayed weight
    # gradient, which also runs them again, is the table's delayed_vs_immediate rows)
    res["kept_vs_lean"] = {}
    for dtype in (torch.float64, torch.float32) if world == 2 else (torch.float64,):
        x, W, b, t, cw, up = inputs(dtype, 8, V)
        kw = {"reduction": "none", "label_smoothing": 0.1, "z_loss": 1e-3, "vocab_slice": 16}
        runs = {m: run_loss(vp_lce, x, W[rows], t, b[rows], up, memory=m, **kw) for m in ("default", "lean")}
        res["kept_vs_lean"][str(dtype)] = all(
            torch.equal(runs["default"][k], runs["lean"][k]) for k in ("loss", "dx", "dW", "db")
        )
        xl = x.clone().requires_grad_()
        loss = vp_lce(xl, W[rows], t, memory="default", **kw)
        loss.backward(up.to(loss.dtype), retain_graph=True)
        first = xl.grad.clone()
        xl.grad = None
        loss.backward(up.to(loss.dtype))
        res["kept_vs_lean"][f"{dtype}/second_backward"] = torch.equal(xl.grad, first)
    res["errors"]["memory"] = error_on_every_rank(lambda: vp_lce(x, W[rows], t, memory="lean" if rank else "fast"))

    # d_input's sum over the ranks: the allreduce's arithmetic (rank order, one rounding), bitwise,
    # also for a token count the ranks do not divide
    from truefuse.distributed.allreduce import ordered_sum
    from truefuse.distributed.linear_cross_entropy import _sum_over_ranks

    parts = [torch.randn(7, 5, generator=torch.Generator().manual_seed(r)) * 10 ** (r % 3) for r in range(world)]
    res["sum_bf16"] = torch.equal(_sum_over_ranks(parts[rank], None, torch.bfloat16), ordered_sum(parts).bfloat16())
    parts64 = [p.double() for p in parts]
    res["sum_fp64"] = torch.equal(_sum_over_ranks(parts64[rank], None, torch.float64), sum(parts64[1:], parts64[0].clone()))

    # uneven shards, explicit vocab_start: rank r holds 30 + 10 r classes
    sizes = [30 + 10 * r for r in range(world)]
    start = sum(sizes[:rank])
    Vu = sum(sizes)
    x, W, b, t, cw, up = inputs(torch.float64, 12, Vu, H)
    got = run_loss(vp_lce, x, W[start : start + sizes[rank]], t, None, up, "mean", vocab_start=start, vocab_slice=16)
    ref = run_loss(linear_cross_entropy_ref, x, W, t, None, up, "mean")
    res["uneven_close"] = all(
        torch.allclose(got[k], ref[k][start : start + sizes[rank]] if k == "dW" else ref[k], rtol=1e-10, atol=1e-12)
        for k in ("loss", "dx", "dW")
    )

    # errors: the same on every rank, no hang
    x, W, b, t, cw, up = inputs(torch.float64, 8, V, H)
    Ws = W[rows]
    bad = t.clone()
    if rank == world - 1:
        bad[3] = V
    res["errors"]["target"] = error_on_every_rank(lambda: vp_lce(x, Ws, bad))
    res["errors"]["tiling"] = error_on_every_rank(lambda: vp_lce(x, Ws, t, vocab_start=0))
    other = t.clone()
    if rank == 0:
        other[5] = (int(other[5]) + 1) % V  # a valid class, but not the other ranks' target
    res["errors"]["targets_differ"] = error_on_every_rank(lambda: vp_lce(x, Ws, other))
    Wm = Ws.float().clone().requires_grad_()
    if rank != 0:
        Wm.main_grad = torch.zeros(Wm.shape)
    res["errors"]["main_grad"] = error_on_every_rank(lambda: vp_lce(x.float(), Wm, t, fuse_wgrad_accumulation=True))
    res["after"] = bool(torch.isfinite(vp_lce(x, Ws, t)).all())
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_linear_cross_entropy(world):
    results = run_local(world, _worker)
    from truefuse.verify.distributed_vocab import OPTIONS

    for r, res in enumerate(results):
        failed = [(x["case"], x["dtype"], x["check"], x["tensor"]) for x in res["rows"] if not x["passed"]]
        assert not failed, f"rank {r}: {failed}"
        cases = {(x["case"], x["dtype"]) for x in res["rows"] if x["check"] == "fwd_bwd"}
        assert {(c, "fp64") for c in OPTIONS} <= cases, cases  # every option ran
        replicated = [x for x in res["rows"] if x["tensor"] in ("loss", "dx")]
        assert replicated and all(x["all_ranks"] for x in replicated)
        if world == 2:
            checks = {x["check"] for x in res["rows"]}
            assert {"delayed_vs_immediate_grad", "delayed_vs_immediate_main_grad", "main_grad_2_microbatches"} <= checks
        assert all(res["kept_vs_lean"].values()), f"rank {r}: {res['kept_vs_lean']}"
        assert res["sum_bf16"] and res["sum_fp64"], f"rank {r}: d_input's sum is not the rank-order sum"
        assert res["control_fails"], f"rank {r}: a wrong shard passed the bounded check"
        assert res["uneven_close"], f"rank {r}: uneven shards"
        assert res["after"]
        err = res["errors"]
        assert (
            err["target"] == ("ValueError", err["target"][1])
            and f"rank {world - 1}: target holds {40 * world}" in err["target"][1]
        )
        assert err["tiling"][0] == "ValueError" and "tile the vocabulary" in err["tiling"][1]
        assert err["memory"][0] == "ValueError" and "rank 0: memory must be" in err["memory"][1]
        assert err["targets_differ"][0] == "ValueError" and "disagree on targets" in err["targets_differ"][1]
        assert err["main_grad"][0] == "RuntimeError" and "rank 0" in err["main_grad"][1] and "no main_grad" in err["main_grad"][1]
    for k in results[0]["errors"]:  # the same error on every rank
        assert len({res["errors"][k] for res in results}) == 1, k
