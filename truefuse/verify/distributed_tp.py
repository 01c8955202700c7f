"""The tensor-parallel layers' table (docs/tensor_parallel.md), run inside every rank of a process
group: ``python -m truefuse verify --world-size N`` and tests/distributed/test_tp_layers.py.

Every layer configuration is built from one set of unsharded weights (the same on every rank) and
checked per tensor:

* ``fwd_bwd``: outputs, input gradients and this rank's parameter gradients, **bounded** (docs/design.md
  §1) against the single-process layer on float64 CPU copies of the unsharded weights (cut to this
  rank's view), with the baseline the same TP layer as a user writes it in plain PyTorch in the same
  dtype: this rank's shards (cut by this file, not by the layer's helpers), ``F.linear``,
  ``torch.distributed.all_reduce`` / ``all_gather``, PyTorch's add, activation and ``F.rms_norm``.
  Nothing of the layer is shared with the baseline or the reference, so a wrong shard, region or
  layout fails. ``all_ranks``: a replicated tensor (a row-parallel output, a column-parallel
  d_input, the norm weight's gradient) has the same bits on every rank. ``single``: the error of the
  single-process layer in the same dtype, for comparison: TP rounds each rank's partial GEMM before
  the sum, so in bf16 its error can be above the single-process one (a 1.25x ratio at 2 ranks on
  the row-parallel output measured while writing this table).
* ``delayed_vs_immediate_{grad,main_grad}``: ``delay_wgrad_compute`` + ``backward_dw()`` gives the
  immediate backward's bits (docs/design.md §2).
* ``main_grad``: fused fp32 accumulation over 2 micro-batches into a random ``main_grad``, bounded
  against float64 with "weight gradient in the parameter dtype, then an fp32 add" as the baseline.

On CUDA every row runs twice: without a workspace (the all-gather reference) and with a
``Workspace`` (the allreduce kernels), whose tensors must also equal the reference path's bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS, gated_activation_ref, gated_activation_torch
from truefuse.ops.gemm.activation import activation_ref
from truefuse.ops.norm.norm import rms_norm_ref, rms_norm_torch
from truefuse.testing import bitwise_report, bounded_report, rel_error, same_on_all_ranks

#: The layers the table checks; ``verify --world-size N --op NAME`` selects among them.
OPS = ("ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_M = (2, 5)  # leading dimensions of the input: 10 tokens
_K, _N, _FFN = 32, 48, 32  # in / out features of the linears; the MLP's hidden is _K, its ffn _FFN
_EPS = 1e-6


def _rand(shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _block(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


@dataclass
class Spec:
    """One layer configuration: its unsharded fp32 values and how the TP layer and the plain
    PyTorch computations run on them.

    Attributes:
        op: the layer class's name (what ``--op`` selects).
        name: the configuration's name in the table.
        build: ``build(dtype, device, **wgrad) -> module`` from the unsharded values.
        run: ``run(module, leaves) -> {name: tensor}``: forward and backward with the fixed
            upstream gradients; the outputs and the leaves' and parameters' gradients.
        plain: ``plain(dtype, device, tp) -> {name: tensor}``: the same in plain PyTorch, written
            here without the module: with ``tp`` this rank's shards (cut by this file, not by the
            module's helpers) between ``torch.distributed`` collectives (the baseline); without, one
            process on the unsharded weights, every tensor cut to this rank's view (on float64, the
            reference).
        leaves: ``leaves(dtype, device) -> {name: tensor}``: this rank's inputs.
        replicated: the names that must have the same bits on every rank.
        wgrad: whether the weight-gradient rows (delayed, main_grad) run for this configuration:
            one per mechanism is enough (every layer's GEMMs are the same LinearFunction).
    """

    op: str
    name: str
    build: Callable
    run: Callable
    plain: Callable
    leaves: Callable
    replicated: tuple[str, ...]
    wgrad: bool = True


def _grads(named_leaves: dict, params: dict, out: dict) -> dict:
    res = {k: v.detach() for k, v in out.items()}
    res.update({f"d{k}": v.grad for k, v in named_leaves.items() if v.grad is not None})
    res.update({f"d{n}": p.grad for n, p in params.items() if p is not None and p.grad is not None})
    return res


def _param(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """A fresh leaf copy of ``t`` (never ``t`` itself: ``.to`` returns it when nothing changes)."""
    return t.to(device, dtype, copy=True).requires_grad_()


def _leafify(tensors: dict) -> dict:
    return {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}


def specs(rank: int, world: int) -> list[Spec]:
    """Every layer configuration of the table, for this rank of a group of ``world``."""
    from truefuse.distributed._regions import torch_region
    from truefuse.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP

    W, b = _rand((_N, _K), 1, _K**-0.5), _rand((_N,), 2, 0.5)
    x, dy_n = _rand((*_M, _K), 3), _rand((*_M, _N), 4)
    x_par = _rand((*_M, _N), 5)  # a row-parallel layer's unsharded input (K = _N there)
    W_row = _rand((_K, _N), 6, _N**-0.5)
    b_row = _rand((_K,), 7, 0.5)
    res, dy_k, dres = _rand((*_M, _K), 8), _rand((*_M, _K), 9), _rand((*_M, _K), 10)
    norm_w = 1 + 0.25 * _rand((_K,), 11)
    W1, W2 = _rand((2 * _FFN, _K), 12, _K**-0.5), _rand((_K, _FFN), 13, _FFN**-0.5)
    W1_gelu = _rand((_FFN, _K), 14, _K**-0.5)
    out = []

    def cast(dtype, device, **t):
        return {k: v.to(device, dtype) for k, v in t.items()}

    def blk(t, dim):
        return _block(t, dim, rank, world)

    def gated_blk(t):  # [gate; up] -> [gate_r; up_r]
        gate, up = t.chunk(2, 0)
        return torch.cat([blk(gate, 0), blk(up, 0)], 0)

    def shard(tp, t, cut):
        """This rank's shard of ``t`` under TP (``cut`` applied), the whole of it on one process."""
        return cut(t) if tp else t

    def view(tp, t, cut):
        """A gradient as this rank sees it: TP gradients are already this rank's; cut the others."""
        return t if tp else cut(t)

    # ---- column-parallel: x replicated, output sharded (or gathered) -------------------------------
    for gather in (False, True):

        def build(dtype, device, gather=gather, **kw):
            return ColumnParallelLinear.from_linear(W.to(device, dtype), b.to(device, dtype), gather_output=gather, **kw)

        def upstream(y, gather=gather):
            return (dy_n if gather else blk(dy_n, -1)).to(y)

        def run(m, leaves, upstream=upstream):
            y = m(leaves["input"])
            y.backward(upstream(y))
            return _grads(leaves, dict(m.named_parameters()), {"out": y})

        def plain(dtype, device, tp, gather=gather):
            lv = _leafify(cast(dtype, device, input=x))
            p = {
                "weight": _param(shard(tp, W, lambda t: blk(t, 0)), device, dtype),
                "bias": _param(shard(tp, b, lambda t: blk(t, 0)), device, dtype),
            }
            y = F.linear(torch_region(lv["input"], "copy") if tp else lv["input"], p["weight"], p["bias"])
            if tp and gather:
                y = torch_region(y, "gather")
            y.backward((dy_n if gather or not tp else blk(dy_n, -1)).to(y))
            got = _grads(lv, p, {"out": y if tp or gather else blk(y, -1)})
            got["dweight"], got["dbias"] = (view(tp, got[k], lambda t: blk(t, 0)) for k in ("dweight", "dbias"))
            return got

        out.append(
            Spec(
                "ColumnParallelLinear",
                "gather" if gather else "sharded",
                build,
                run,
                plain,
                lambda dtype, device: cast(dtype, device, input=x),
                ("out", "dinput") if gather else ("dinput",),
                wgrad=not gather,
            )
        )

    # ---- row-parallel: input sharded (or scattered), output replicated, bias once ---------------------
    for parallel in (True, False):

        def build(dtype, device, parallel=parallel, **kw):
            bias = b_row.to(device, dtype) if parallel else None
            return RowParallelLinear.from_linear(W_row.to(device, dtype), bias, input_is_parallel=parallel, **kw)

        def run(m, leaves):
            y = m(leaves["input"])
            y.backward(dy_k.to(y))
            return _grads(leaves, dict(m.named_parameters()), {"out": y})

        def plain(dtype, device, tp, parallel=parallel):
            lv = _leafify(cast(dtype, device, input=blk(x_par, -1) if tp and parallel else x_par))
            p = {
                "weight": _param(shard(tp, W_row, lambda t: blk(t, 1)), device, dtype),
                "bias": _param(b_row, device, dtype) if parallel else None,
            }
            inp = torch_region(lv["input"], "scatter") if tp and not parallel else lv["input"]
            y = F.linear(inp, p["weight"])
            if tp:
                y = torch_region(y, "reduce")
            if p["bias"] is not None:
                y = y + p["bias"]
            y.backward(dy_k.to(y))
            got = _grads(lv, p, {"out": y})
            got["dweight"] = view(tp, got["dweight"], lambda t: blk(t, 1))
            if parallel:
                got["dinput"] = view(tp, got["dinput"], lambda t: blk(t, -1))
            return got

        def leaves(dtype, device, parallel=parallel):
            return cast(dtype, device, input=blk(x_par, -1) if parallel else x_par)

        rep = ("out", "dbias") if parallel else ("out", "dinput")
        name = "parallel_in+bias" if parallel else "scatter_in"
        out.append(Spec("RowParallelLinear", name, build, run, plain, leaves, rep, wgrad=parallel))

    # ---- the fused allreduce + residual + RMSNorm tail: shared by the fused row layer and the MLP -------
    def run_pair(m, leaves):
        normed, res_out = m(leaves["input"], leaves["residual"])
        torch.autograd.backward([normed, res_out], [dy_k.to(normed), dres.to(normed)])
        return _grads(leaves, dict(m.named_parameters()), {"normed": normed, "residual_out": res_out})

    def plain_tail(y, tp, residual, nw):
        """``y`` the partial (tp) or whole output: the sum, ``+ residual``, PyTorch's RMSNorm (the
        float64 reference: ``rms_norm_ref``), and the backward."""
        res_out = (torch_region(y, "reduce") if tp else y) + residual
        normed = rms_norm_ref(res_out, nw, _EPS) if y.dtype == torch.float64 else _torch_rms_norm(res_out, nw)
        torch.autograd.backward([normed, res_out], [dy_k.to(normed), dres.to(normed)])
        return {"normed": normed, "residual_out": res_out}

    def build_fused(dtype, device, **kw):
        return RowParallelLinear.from_linear(
            W_row.to(device, dtype), norm_weight=norm_w.to(device, dtype), fuse_residual_rmsnorm=True, eps=_EPS, bias=None, **kw
        )

    def plain_fused(dtype, device, tp):
        lv = _leafify(cast(dtype, device, input=blk(x_par, -1) if tp else x_par, residual=res))
        p = {"weight": _param(shard(tp, W_row, lambda t: blk(t, 1)), device, dtype), "norm_weight": _param(norm_w, device, dtype)}
        got = _grads(lv, p, plain_tail(F.linear(lv["input"], p["weight"]), tp, lv["residual"], p["norm_weight"]))
        got["dweight"] = view(tp, got["dweight"], lambda t: blk(t, 1))
        got["dinput"] = view(tp, got["dinput"], lambda t: blk(t, -1))
        return got

    out.append(
        Spec(
            "RowParallelLinear",
            "fused_residual_rmsnorm",
            build_fused,
            run_pair,
            plain_fused,
            lambda dtype, device: cast(dtype, device, input=blk(x_par, -1), residual=res),
            ("normed", "residual_out", "dresidual", "dnorm_weight"),
        )
    )

    # ---- the MLP: column fc1 (gated layout), activation, row fc2 + fused tail ------------------------------
    for act, w1 in (("swiglu", W1), ("gelu", W1_gelu)):
        gated = act in GATED_ACTIVATIONS
        cut1 = gated_blk if gated else (lambda t: blk(t, 0))

        def build_mlp(dtype, device, act=act, w1=w1, **kw):
            return TensorParallelMLP.from_unsharded(
                w1.to(device, dtype), W2.to(device, dtype), norm_w.to(device, dtype), activation=act, eps=_EPS, **kw
            )

        def plain_mlp(dtype, device, tp, act=act, w1=w1, gated=gated, cut1=cut1):
            lv = _leafify(cast(dtype, device, input=x, residual=res))
            p = {
                "fc1.weight": _param(shard(tp, w1, cut1), device, dtype),
                "fc2.weight": _param(shard(tp, W2, lambda t: blk(t, 1)), device, dtype),
                "fc2.norm_weight": _param(norm_w, device, dtype),
            }
            h = F.linear(torch_region(lv["input"], "copy") if tp else lv["input"], p["fc1.weight"])
            if dtype == torch.float64:  # the reference: truefuse's rule (fp32 math there is fp64 here)
                h = gated_activation_ref(h, act) if gated else activation_ref(h, act)
            else:  # what a user writes: F.silu(gate) * up in the dtype
                h = gated_activation_torch(h, act) if gated else activation_ref(h, act)
            y = F.linear(h, p["fc2.weight"])
            got = _grads(lv, p, plain_tail(y, tp, lv["residual"], p["fc2.norm_weight"]))
            got["dfc1.weight"] = view(tp, got["dfc1.weight"], cut1)
            got["dfc2.weight"] = view(tp, got["dfc2.weight"], lambda t: blk(t, 1))
            return got

        out.append(
            Spec(
                "TensorParallelMLP",
                act,
                build_mlp,
                run_pair,
                plain_mlp,
                lambda dtype, device: cast(dtype, device, input=x, residual=res),
                ("normed", "residual_out", "dinput", "dresidual", "dfc2.norm_weight"),
                wgrad=gated,
            )
        )
    return out


def _torch_rms_norm(x, w):
    return rms_norm_torch(x, w, _EPS)


def _row(spec, dtype_name, path, check, tensor, contract, passed, **info) -> dict:
    return {
        "op": spec.op,
        "case": spec.name,
        "dtype": dtype_name,
        "path": path,
        "check": check,
        "tensor": tensor,
        "contract": contract,
        "passed": bool(passed),
        **info,
    }


def _fwd_bwd_rows(spec: Spec, dtype_name: str, device, workspace, path: str, reference: dict | None, keep: dict) -> list[dict]:
    dtype = DTYPES[dtype_name]
    lv = _leafify(spec.leaves(dtype, device))
    m = spec.build(dtype, device, workspace=workspace)
    got = spec.run(m, lv)
    base = spec.plain(dtype, device, True)
    ref64 = spec.plain(torch.float64, "cpu", False)
    single = spec.plain(dtype, device, False)
    if not set(got) == set(ref64) == set(base):
        raise AssertionError(f"{spec.op}/{spec.name}: tensors {sorted(got)}; the plain computations give {sorted(ref64)}")
    rows = []
    for k in sorted(got):
        rep = bounded_report(got[k], ref64[k], base[k])
        all_ranks = same_on_all_ranks(got[k]) if k in spec.replicated else None
        same_ref = None if reference is None else bitwise_report(got[k], reference[k]).equal
        passed = rep.passed and all_ranks is not False and same_ref is not False
        rows.append(
            _row(
                spec,
                dtype_name,
                path,
                "fwd_bwd",
                k,
                "bounded",
                passed,
                error=rep.error,
                baseline_error=rep.baseline_error,
                ratio=rep.ratio,
                single_error=rel_error(single[k], ref64[k]),
                all_ranks=all_ranks,
                same_as_reference=same_ref,
            )
        )
    keep[(spec.op, spec.name, dtype_name)] = got
    return rows


def _attach_main_grads(m, seed=3, attr=False) -> dict:
    start = {}
    for i, (n, p) in enumerate(m.gemm_weights()):
        p.main_grad = _rand(p.shape, seed + i).to(p.device)
        start[n] = p.main_grad.clone()
        if attr:
            p.grad_added_to_main_grad = False
    return start


def _wgrad_rows(spec: Spec, dtype_name: str, device, workspace, path: str) -> list[dict]:
    dtype = DTYPES[dtype_name]
    rows = []
    for fused in (False, True):
        results = []
        for delay in (False, True):
            m = spec.build(dtype, device, workspace=workspace, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
            if fused:
                _attach_main_grads(m)
            res = spec.run(m, _leafify(spec.leaves(dtype, device)))
            pending = m.pending_wgrad
            m.backward_dw()
            res.update({f"d{n}": p.grad for n, p in m.gemm_weights() if p.grad is not None})
            if fused:
                res.update({f"{n}.main_grad": p.main_grad for n, p in m.gemm_weights()})
            results.append((res, pending))
        (imm, _), (dly, pending) = results
        # one row for every tensor (outputs, input and parameter gradients, main_grads): the names
        # of those that differ, if any, in "detail"
        reps = {k: bitwise_report(dly[k], imm[k]) for k in imm if k in dly}
        differ = sorted(set(imm) ^ set(dly)) + [k for k, r in reps.items() if not r.equal]
        ok = not differ and pending == 1
        detail = ("differ: " + ", ".join(differ) if differ else "") + ("" if pending == 1 else f" pending_wgrad={pending}")
        rows.append(
            _row(
                spec,
                dtype_name,
                path,
                f"delayed_vs_immediate_{'main_grad' if fused else 'grad'}",
                f"all {len(imm)}",
                "bitwise",
                ok,
                max_diff=max((r.max_diff for r in reps.values()), default=0.0),
                detail=detail.strip(),
            )
        )
    # fused fp32 accumulation over 2 micro-batches (the same input twice: the sum of two gradients)
    m = spec.build(dtype, device, workspace=workspace, fuse_wgrad_accumulation=True)
    start = _attach_main_grads(m)
    for _ in range(2):
        spec.run(m, _leafify(spec.leaves(dtype, device)))
    plain = spec.run(spec.build(dtype, device, workspace=workspace), _leafify(spec.leaves(dtype, device)))
    ref64 = spec.plain(torch.float64, "cpu", False)
    for n, p in m.gemm_weights():
        want = start[n].cpu().double() + 2 * ref64[f"d{n}"]
        base = start[n] + plain[f"d{n}"].float() + plain[f"d{n}"].float()
        rep = bounded_report(p.main_grad, want, base)
        ok = rep.passed and p.grad is None  # fused, no grad_added_to_main_grad: nothing returned to autograd
        rows.append(
            _row(
                spec,
                dtype_name,
                path,
                "main_grad_2_microbatches",
                f"{n}.main_grad",
                "bounded",
                ok,
                error=rep.error,
                baseline_error=rep.baseline_error,
                ratio=rep.ratio,
            )
        )
    return rows


def tp_table(
    rank: int, world_size: int, device: str = "cpu", dtypes=tuple(DTYPES), ops=OPS, wgrad: bool = True, skip=()
) -> list[dict]:
    """Every row for this rank (a ``run_local`` target, or called inside one): each layer of ``ops``
    in each of ``dtypes`` (but the ``"op/case"`` names in ``skip``); on CUDA the reference path and
    the Workspace (kernel) path."""
    from truefuse.distributed import Workspace

    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    paths: dict = {"reference": None}
    if dev.type == "cuda":
        paths["symmetric"] = Workspace(max_bytes=2 * 4 * _M[0] * _M[1] * max(_K, _N, 2 * _FFN))
    rows = []
    for spec in specs(dist.get_rank(), dist.get_world_size()):
        if spec.op not in ops or f"{spec.op}/{spec.name}" in skip:
            continue
        for d in dtypes:
            keep: dict = {}
            for path, ws in paths.items():
                reference = keep.get((spec.op, spec.name, d)) if path != "reference" else None
                rows += _fwd_bwd_rows(spec, d, dev, ws, path, reference, keep)
                if wgrad and spec.wgrad:
                    rows += _wgrad_rows(spec, d, dev, ws, path)
    for ws in paths.values():
        if ws is not None:
            ws.close()
    return rows


def _fmt(v, spec=".2e") -> str:
    return "-" if v is None else format(v, spec)


def format_tp_table(rows: list[dict], world_size: int) -> str:
    w = max([20] + [len(r["op"]) for r in rows])
    lines = [
        f"tensor-parallel layers and loss, world size {world_size}",
        f"{'op':<{w}} {'case':<22} {'dtype':>5} {'path':>9} {'check':<30} {'tensor':<22} {'error':>9} {'baseline':>9} "
        f"{'ratio':>6} {'single':>9} {'ranks':>5} result",
    ]
    for r in rows:
        ranks = {None: "-", True: "same", False: "DIFF"}[r.get("all_ranks")]
        err = r.get("error", r.get("max_diff"))
        lines.append(
            f"{r['op']:<{w}} {r['case']:<22} {r['dtype']:>5} {r['path']:>9} {r['check']:<30} {r['tensor']:<22} "
            f"{_fmt(err):>9} {_fmt(r.get('baseline_error')):>9} {_fmt(r.get('ratio'), '.3f'):>6} "
            f"{_fmt(r.get('single_error')):>9} "
            f"{ranks:>5} {'PASS' if r['passed'] else 'FAIL'}{(' ' + r['detail']) if r.get('detail') else ''}"
        )
    return "\n".join(lines)


def tables(rank: int, world_size: int, device: str = "cpu", ops=None) -> list[dict]:
    """What ``verify --world-size N`` runs on each rank (one process group for the three tables): the
    allreduce table (``distributed_table``) when ``ops`` is None or names one of its ops, this
    table's rows for the layers ``ops`` names (all when None), and the vocab-parallel loss's
    (``distributed_vocab``) when ``ops`` is None or names it. The last two's rows carry ``"op"``."""
    from truefuse.verify import distributed_table, distributed_vocab

    rows = []
    if ops is None or any(o in distributed_table.OPS for o in ops):
        rows += distributed_table.table(rank, world_size, device)
    tp_ops = OPS if ops is None else tuple(o for o in ops if o in OPS)
    if tp_ops:
        rows += tp_table(rank, world_size, device, ops=tp_ops)
    if ops is None or distributed_vocab.OP in ops:
        rows += distributed_vocab.vocab_table(rank, world_size, device)
    return rows
