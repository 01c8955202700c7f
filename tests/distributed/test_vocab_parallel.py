"""Vocab-parallel linear cross-entropy (``truefuse.distributed.linear_cross_entropy``) on gloo with
2 and 4 CPU processes: one ``run_local`` spawn per world size runs every check and returns what
the test asserts on.

* every option against the single-process loss on the gathered weight (fp64: the PyTorch path;
  fp32: the slice kernels under the interpreter), bounded against the float64 reference with
  the single-process loss as the baseline: loss, z-loss, accuracy, d_input, this rank's d_weight
  and d_bias rows;
* the loss and d_input bitwise the same on every rank;
* delayed weight gradient bitwise the immediate one; main_grad;
* uneven shards with explicit ``vocab_start``;
* a target outside the whole vocabulary on one rank, shards that do not tile the vocabulary, a
  missing main_grad on one rank: the same clear error on every rank, and the group still usable.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from truefuse.distributed.launch import run_local

OPTIONS = {
    "mean": {},
    "sum_zloss": {"reduction": "sum", "z_loss": 1e-3},
    "none_everything": {"reduction": "none", "label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "weight": True},
    "everything_bias": {"label_smoothing": 0.1, "softcap": 4.0, "weight": True, "bias": True},
    "all_ignored": {"ignore": "all"},
}


def _inputs(dtype, N, V, H, ignore="some", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64) * H**-0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, V, (N,), generator=g)
    if ignore == "some":
        t[::4] = -100
    else:
        t.fill_(-100)
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    up = torch.randn(N, generator=g, dtype=torch.float64)
    return x.to(dtype), W.to(dtype), b.to(dtype), t, cw, up


def _run(fn, x, W, t, b, up, reduction, **kw):
    xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
    bl = None if b is None else b.clone().requires_grad_()
    out = fn(xl, Wl, t, linear_bias=bl, reduction=reduction, return_z_loss=True, return_token_accuracy=True, **kw)
    out.loss.backward(up.to(out.loss.dtype) if reduction == "none" else None)
    return {
        "loss": out.loss.detach(),
        "z_loss": out.z_loss,
        "acc": out.token_accuracy,
        "dx": xl.grad,
        "dW": Wl.grad,
        "db": None if bl is None else bl.grad,
    }


def _error(fn):
    try:
        fn()
        err = None
    except (TypeError, ValueError, RuntimeError) as e:
        err = (type(e).__name__, str(e))
    dist.barrier()
    return err


def _worker(rank: int, world: int) -> dict:
    import truefuse
    from truefuse.distributed import linear_cross_entropy as vp_lce
    from truefuse.ops.linear_cross_entropy import linear_cross_entropy_ref
    from truefuse.testing import bitwise_report, bounded_report

    res: dict = {"bounded": {}, "same": {}, "bitwise": {}, "errors": {}}
    V, H = 40 * world, 16
    runs = [(torch.float64, 24, list(OPTIONS))]
    if world == 2:  # the slice kernels under the interpreter: one program per token and slice, slow
        runs.append((torch.float32, 8, ["none_everything"]))
    for dtype, N, names in runs:
        for name in names:
            spec = dict(OPTIONS[name])
            x, W, b, t, cw, up = _inputs(dtype, N, V, H, ignore=spec.pop("ignore", "some"))
            kw = {k: v for k, v in spec.items() if k not in ("weight", "bias")}
            if spec.get("weight"):
                kw["weight"] = cw
            bias = b if spec.get("bias") else None
            reduction = kw.pop("reduction", "mean")
            rows = slice(rank * 40, (rank + 1) * 40)
            got = _run(vp_lce, x, W[rows], t, None if bias is None else bias[rows], up, reduction, vocab_slice=16, **kw)
            base = _run(truefuse.linear_cross_entropy, x, W, t, bias, up, reduction, **kw)
            ref = _run(
                linear_cross_entropy_ref, x.double(), W.double(), t, None if bias is None else bias.double(), up, reduction, **kw
            )
            for k in ("dW", "db"):
                if base[k] is not None:
                    base[k], ref[k] = base[k][rows], ref[k][rows]
            for k, v in got.items():
                if v is None:
                    continue
                tag = f"{dtype}/{name}/{k}"
                res["bounded"][tag] = bounded_report(v, ref[k], base[k]).passed
            for k in ("loss", "z_loss", "acc", "dx"):
                res["same"][f"{dtype}/{name}/{k}"] = got[k].clone()

    # delayed == immediate (fp64), into .grad and into main_grad (fp32)
    x, W, b, t, cw, up = _inputs(torch.float32, 8, V, H)
    rows = slice(rank * 40, (rank + 1) * 40)
    for fused in (False, True):
        grads = {}
        for delay in (False, True):
            state = truefuse.autograd._wgrad.WgradState(fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
            Wl = W[rows].clone().requires_grad_()
            if fused:
                Wl.main_grad = torch.zeros(Wl.shape)
            xl = x.clone().requires_grad_()
            vp_lce(xl, Wl, t, reduction="none", z_loss=1e-3, vocab_slice=16, wgrad_state=state).backward(up.float())
            if delay:
                with torch.no_grad():  # as a module's backward_dw() runs it
                    truefuse.autograd._wgrad.run_pending(state)
            grads[delay] = (xl.grad, Wl.main_grad if fused else Wl.grad)
        res["bitwise"][f"delayed_fused{fused}_dx"] = bitwise_report(grads[True][0], grads[False][0]).equal
        res["bitwise"][f"delayed_fused{fused}_dW"] = bitwise_report(grads[True][1], grads[False][1]).equal

    # uneven shards, explicit vocab_start: rank r holds 30 + 10 r classes
    sizes = [30 + 10 * r for r in range(world)]
    start = sum(sizes[:rank])
    Vu = sum(sizes)
    x, W, b, t, cw, up = _inputs(torch.float64, 12, Vu, H)
    got = _run(vp_lce, x, W[start : start + sizes[rank]], t, None, up, "mean", vocab_start=start, vocab_slice=16)
    ref = _run(linear_cross_entropy_ref, x, W, t, None, up, "mean")
    res["uneven_close"] = all(
        torch.allclose(got[k], ref[k][start : start + sizes[rank]] if k == "dW" else ref[k], rtol=1e-10, atol=1e-12)
        for k in ("loss", "dx", "dW")
    )

    # errors: the same on every rank, no hang
    x, W, b, t, cw, up = _inputs(torch.float64, 8, V, H)
    Ws = W[rows]
    bad = t.clone()
    if rank == world - 1:
        bad[3] = V
    res["errors"]["target"] = _error(lambda: vp_lce(x, Ws, bad))
    res["errors"]["tiling"] = _error(lambda: vp_lce(x, Ws, t, vocab_start=0))
    other = t.clone()
    if rank == 0:
        other[5] = (int(other[5]) + 1) % V  # a valid class, but not the other ranks' target
    res["errors"]["targets_differ"] = _error(lambda: vp_lce(x, Ws, other))
    Wm = Ws.float().clone().requires_grad_()
    if rank != 0:
        Wm.main_grad = torch.zeros(Wm.shape)
    res["errors"]["main_grad"] = _error(lambda: vp_lce(x.float(), Wm, t, fuse_wgrad_accumulation=True))
    res["after"] = bool(torch.isfinite(vp_lce(x, Ws, t)).all())
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_linear_cross_entropy(world):
    results = run_local(world, _worker)
    for r, res in enumerate(results):
        failed = [k for k, ok in res["bounded"].items() if not ok]
        assert not failed, f"rank {r}: not bounded: {failed}"
        assert all(res["bitwise"].values()), f"rank {r}: {res['bitwise']}"
        assert res["uneven_close"], f"rank {r}: uneven shards"
        assert res["after"]
        err = res["errors"]
        assert (
            err["target"] == ("ValueError", err["target"][1])
            and f"rank {world - 1}: target holds {40 * world}" in err["target"][1]
        )
        assert err["tiling"][0] == "ValueError" and "tile the vocabulary" in err["tiling"][1]
        assert err["targets_differ"][0] == "ValueError" and "disagree on targets" in err["targets_differ"][1]
        assert err["main_grad"][0] == "RuntimeError" and "rank 0" in err["main_grad"][1] and "no main_grad" in err["main_grad"][1]
    for k in results[0]["errors"]:  # the same error on every rank
        assert len({res["errors"][k] for res in results}) == 1, k
    for k, v in results[0]["same"].items():  # identical bits on every rank
        for r, res in enumerate(results[1:], 1):
            assert torch.equal(res["same"][k].view(-1), v.view(-1)) or (
                v.isnan().any() and torch.equal(res["same"][k].isnan(), v.isnan())
            ), f"{k} differs on rank {r}"
