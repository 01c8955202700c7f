"""DTensor inputs (issue 35 item 4; docs/design.md §6.9), on 2 gloo CPU processes, every case in
one spawn (~30 s of CPU, most of it importing torch.distributed.tensor, truefuse and transformers
on each rank):

* the row-wise ops (``rms_norm``, ``layer_norm``, ``rms_norm_hf``, ``gated_activation``, and
  ``RMSNorm`` under torch's ``SequenceParallel``) on rows sharded over the ranks (or replicated)
  with replicated parameters: the output and the rows' gradients are bit for bit the op's on the
  whole tensor, the parameters' gradients bit for bit the sum of each rank's rows' (what DTensor
  adds up); any other layout is a ``TypeError`` naming the argument;
* every other public op and module refuses a DTensor with one ``TypeError`` naming itself and the
  argument, before any kernel;
* ``apply_truefuse`` refuses a tensor-parallel model (transformers' ``tp_plan``) at patch time,
  accepts FSDP2's sharded parameters, and the patched experts refuse a DTensor by name.

Before, the same calls failed deep inside (``truefuse.norm_fwd.default does not have a sharding
strategy registered``, ``invalid python storage``, ``mixed torch.Tensor and DTensor``) or, on the
CPU reference path, ran on DTensor's own ops; no message named the truefuse op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import torch
from _interpreter_speedup import run_local


def _op_cases(mesh=None) -> dict:
    """Refused ops: name -> (argument the message names, call). ``D(t)``: ``t`` sharded by rows
    over the mesh; ``R(t)``: replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import truefuse
    from truefuse.ops.adamw import adamw_
    from truefuse.ops.scale import scale_

    def D(t):
        return distribute_tensor(t, mesh, [Shard(0)])

    def R(t):
        return distribute_tensor(t, mesh, [Replicate()])

    g = torch.Generator().manual_seed(0)
    x, W = torch.randn(4, 8, generator=g), torch.randn(16, 8, generator=g)
    t = torch.randint(0, 16, (4,), generator=g)
    q, cos = torch.randn(2, 2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    return {
        "gemm": ("b", lambda: truefuse.gemm(x, R(W.t()))),
        "apply_rotary_pos_emb": ("k", lambda: truefuse.apply_rotary_pos_emb(q, D(q), cos, cos)),
        "linear_cross_entropy": ("linear_weight", lambda: truefuse.linear_cross_entropy(x, D(W), t)),
        "linear_log_probs": ("input", lambda: truefuse.linear_log_probs(D(x), W, t)),
        "token_log_probs": ("logits", lambda: truefuse.token_log_probs(D(W), torch.zeros(16, dtype=torch.long))),
        "attention": ("value", lambda: truefuse.attention(q, q, D(q), is_causal=True)),
        "add_rms_norm_hf": ("h", lambda: truefuse.add_rms_norm_hf(x, D(x), x[0])),
        "add_rms_norm": ("residual", lambda: truefuse.add_rms_norm(D(x), x, x[0])),
        "sibling_linears": ("weights[1]", lambda: truefuse.sibling_linears(x, [W, R(W)])),
        "ops.scale_": ("tensor", lambda: scale_(D(x.clone()), torch.tensor(2.0))),
        "ops.adamw_": (
            "params[0]",
            lambda: adamw_(
                [D(x.clone())], [x], [x * 0], [x * 0], [torch.zeros(())], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
            ),
        ),
        "Linear": ("input", lambda: _colwise(truefuse.Linear(8, 16), mesh, x)),
        "LayerNormLinear": ("input", lambda: truefuse.LayerNormLinear(8, 16)(D(x))),
        "LayerNormMLP": ("input", lambda: truefuse.LayerNormMLP(8, 16)(R(x))),
        "GroupedLinear": ("input", lambda: truefuse.GroupedLinear(2, 8, 16)(R(x), [1, 3])),
        "GroupedMLP": ("input", lambda: truefuse.GroupedMLP(2, 8, 16)(R(x), [1, 3])),
        "LinearCrossEntropyLoss": ("linear_weight", lambda: truefuse.LinearCrossEntropyLoss()(x, R(W), t)),
    }


def _row_refusals(mesh=None) -> dict:
    """Row-wise ops given a layout they cannot run row by row: name -> (argument, call)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import truefuse

    x, w = torch.randn(4, 8), torch.randn(8)
    return {
        "rms_norm": (
            "x",
            lambda: truefuse.rms_norm(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Replicate()])),
        ),
        "layer_norm": ("weight", lambda: truefuse.layer_norm(distribute_tensor(x, mesh, [Shard(0)]), w)),
        "rms_norm_hf": (
            "x",
            lambda: truefuse.rms_norm_hf(DTensor.from_local(x, mesh, [Partial()]), distribute_tensor(w, mesh, [Replicate()])),
        ),
        "gated_activation": ("x", lambda: truefuse.gated_activation(x, "swiglu", distribute_tensor(x, mesh, [Shard(0)]))),
    }


#: the row-wise calls :func:`_rows_exact` checks, each declared row-local op's among them
ROWS_EXACT = ("rms_norm", "layer_norm", "rms_norm_hf", "rms_norm_hf_gemma", "gated_activation", "gated_activation_up")
_KERNEL_CASES = {("rms_norm", "Shard(dim=1)"), ("gated_activation_up", "Shard(dim=0)")}


def _grads(fn, x, params, g):
    """``fn(x, *params)`` on fresh leaves: (output, dx, [d param]) under the upstream ``g``."""
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() for p in params]
    y = fn(x, *params)
    y.backward(g)
    return [y.detach(), x.grad, *(p.grad for p in params)]


def _gathered(ts) -> list:
    return [t.full_tensor() if hasattr(t, "full_tensor") else t for t in ts]  # a Partial gradient: summed


@contextlib.contextmanager
def _torch_paths():
    """Every op on its PyTorch path (the interpreter off), as tests/hf's ``torch_paths`` fixture."""
    import truefuse.ops._launch.triton as tr

    real = tr.get_config
    tr.get_config = lambda: dataclasses.replace(real(), triton_interpret=False)
    try:
        yield
    finally:
        tr.get_config = real


def _rows_exact(mesh, rank: int, world: int) -> dict:
    """Each row-wise op on x sharded over the ranks (its rows, dim 0, and the sequence, dim 1, of 5:
    uneven shards of 3 and 2) and
    replicated, the parameters replicated: the output and dx bitwise the op's on the whole x; a
    parameter's gradient bitwise the sum, rank 0's plus rank 1's, of the op's on each rank's rows
    (a replicated x: the op's own)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    import truefuse

    gen = torch.Generator().manual_seed(1)
    H = 16
    x, up, gy = (torch.randn(2, 5, H, generator=gen) for _ in range(3))
    w, b, gh = torch.randn(H, generator=gen), torch.randn(H, generator=gen), torch.randn(2, 5, H // 2, generator=gen)
    ops = {  # name -> (fn, row operands after x, parameters, upstream gradient): ROWS_EXACT
        "rms_norm": (lambda x, w: truefuse.rms_norm(x, w, 1e-5), [], [w], gy),
        "layer_norm": (lambda x, w, b: truefuse.layer_norm(x, w, b), [], [w, b], gy),
        "rms_norm_hf": (lambda x, w: truefuse.rms_norm_hf(x, w, 1e-6), [], [w], gy),
        "rms_norm_hf_gemma": (lambda x, w: truefuse.rms_norm_hf(x, w, 1e-6, style="gemma"), [], [w], gy),
        "gated_activation": (lambda x: truefuse.gated_activation(x, "swiglu"), [], [], gh),
        "gated_activation_up": (lambda x, u: truefuse.gated_activation(x, "geglu", u), [up], [], gy),
    }
    assert tuple(ops) == ROWS_EXACT
    out = {}
    for place, name in [(p, n) for p in (Shard(0), Shard(1), Replicate()) for n in ops]:
        fn, rows, params, g = ops[name]
        # the kernels (the Triton interpreter, ~0.3 s a call) for two cases, PyTorch's paths for the rest
        with contextlib.nullcontext() if (name, str(place)) in _KERNEL_CASES else _torch_paths():
            want = _grads(fn, x, rows + params, g)
            if place.is_shard() and params:
                parts = [
                    _grads(fn, shard[0], shard[1:] + params, gs)
                    for *shard, gs in zip(
                        *([c.contiguous() for c in t.chunk(world, place.dim)] for t in [x, *rows, g]), strict=True
                    )
                ]
                want = want[: 2 + len(rows)] + [
                    parts[0][2 + len(rows) + i] + parts[1][2 + len(rows) + i] for i in range(len(params))
                ]
            got = _gathered(
                _grads(
                    fn,
                    distribute_tensor(x, mesh, [place]),
                    [distribute_tensor(r, mesh, [place]) for r in rows]
                    + [distribute_tensor(p, mesh, [Replicate()]) for p in params],
                    distribute_tensor(g, mesh, [place]),
                )
            )
            out[f"{name} {place}"] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # torch's sequence parallelism on truefuse.RMSNorm: each rank's sequence chunk in, Shard(1) out
    # (an even sequence: SequenceParallel's from_local takes every chunk to be the same length)
    x, gy = x[:, :4], gy[:, :4]
    with _torch_paths():
        norm = truefuse.RMSNorm(H, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(w)
        want = _grads(lambda x, w: truefuse.rms_norm(x, w, 1e-5), x, [w], gy)
        parts = [
            _grads(lambda x, w: truefuse.rms_norm(x, w, 1e-5), xs.contiguous(), [w], gs.contiguous())
            for xs, gs in zip(x.chunk(world, 1), gy.chunk(world, 1), strict=True)  # as DTensor's local shards: contiguous
        ]
        sp = parallelize_module(norm, mesh, SequenceParallel())
        xl = x.chunk(world, 1)[rank].contiguous().requires_grad_()
        y = sp(xl)
        y.backward(distribute_tensor(gy, mesh, [Shard(1)]))
        got = [y.full_tensor(), xl.grad, norm.weight.grad.full_tensor()]
        want = [want[0], want[1].chunk(world, 1)[rank], parts[0][2] + parts[1][2]]
        out["RMSNorm SequenceParallel"] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    return out


def _colwise(layer, mesh, x):
    """torch's tensor parallelism on a truefuse.Linear (an nn.Linear): weight Shard(0), input Replicate."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(layer, mesh, ColwiseParallel())(x)


def _tensor_parallel(model, mesh) -> None:
    """transformers' own tensor parallelism of ``model`` by its ``tp_plan`` (q/k/v/gate/up colwise,
    o/down rowwise, lm_head colwise; ``*`` a layer number), as ``from_pretrained(tp_plan=...)``
    applies it: hooks installed and parameters sharded into DTensors. Its entry point moved across
    transformers 5 (read in 5.0, 5.17 and 5.25): 5.25's ``apply_tensor_parallelism(model, mesh,
    plan)`` takes the plan with one entry per module and parameter; 5.17's ``(model, mesh)`` reads
    ``model.tp_plan`` itself; 5.0 has neither: ``distribute_model`` installs the hooks and the
    loader shards each parameter (``shard_and_distribute_module``)."""
    import inspect

    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        apply_tensor_parallelism = None
    if apply_tensor_parallelism is None:  # 5.0: as its loader (core_model_loading.py) shards a parameter
        import tempfile

        import transformers.integrations.tensor_parallel as hf_tp
        from safetensors import safe_open
        from safetensors.torch import save_file

        hf_tp.distribute_model(model, None, None, mesh, mesh.size())
        params = dict(model.named_parameters())
        with tempfile.TemporaryDirectory() as tmp:  # the loader shards safetensors slices (get_shape)
            save_file({n: p.detach().contiguous() for n, p in params.items()}, f"{tmp}/w.safetensors")
            with safe_open(f"{tmp}/w.safetensors", framework="pt") as f:
                for name, p in params.items():
                    style = hf_tp._get_parameter_tp_plan(name, model.tp_plan)
                    if style is not None:
                        cls = type(hf_tp.ALL_PARALLEL_STYLES[style])
                        layer = cls(device_mesh=mesh, rank=mesh.get_local_rank(), empty_param=p)
                        owner, _, leaf = name.rpartition(".")
                        setattr(model.get_submodule(owner), leaf, layer.partition_tensor(f.get_slice(name), p.dtype, True))
    elif "tp_plan" not in inspect.signature(apply_tensor_parallelism).parameters:
        apply_tensor_parallelism(model, mesh)
    else:
        mods = dict(model.named_modules())
        plan = {n: s for p, s in model.tp_plan.items() for n in mods if re.fullmatch(re.escape(p).replace(r"\*", r"\d+"), n)}
        plan.update({f"{n}.{k}": s for n, s in list(plan.items()) for k, _ in mods[n].named_parameters(recurse=False)})
        apply_tensor_parallelism(model, mesh, plan)


def _hf_cases(mesh) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse, graph_decode

    tp = tiny_model("llama")
    _tensor_parallel(tp, mesh)
    out = {"tp_patch": _error(lambda: apply_truefuse(tp)), "tp_untouched": type(tp.model.norm).__name__}
    fsdp = tiny_model("llama")
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    out["fsdp_patch"] = _error(lambda: apply_truefuse(fsdp))
    out["fsdp_graph_decode"] = _error(lambda: graph_decode(fsdp))
    out["fsdp_norm"] = type(fsdp.model.norm).__name__
    moe = tiny_model("mixtral")
    apply_truefuse(moe)
    experts = moe.model.layers[0].mlp.experts
    h, idx = torch.randn(3, 32), torch.tensor([[0, 1], [2, 3], [1, 2]])
    out["experts"] = _error(
        lambda: experts(distribute_tensor(h, mesh, [Replicate()], src_data_rank=None), idx, torch.full((3, 2), 0.5))
    )
    return out


def _error(fn):
    try:
        fn()
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:
        return (type(e).__name__, str(e))
    return None


def _run(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {op: (arg, _error(call)) for op, (arg, call) in _op_cases(mesh).items()}
    out["rows_refused"] = {op: (arg, _error(call)) for op, (arg, call) in _row_refusals(mesh).items()}
    out["rows_exact"] = _rows_exact(mesh, rank, world)
    if rank == 0:  # no collective in them (src_data_rank=None): rank 1 skips importing transformers
        out.update(_hf_cases(mesh))
    return out


def test_every_declared_rule_has_its_case():
    """The cases above against each op's declared DTensor rule (truefuse/verify/op_table.py): an op
    declared ``refused`` (and its modules) has a case in ``_op_cases``, one declared ``row-local`` in
    ``_row_refusals`` and the exact-rows table, and no case names an undeclared op. Without a spawn."""
    from truefuse.verify.op_table import OPS

    def names(rule):
        return {n for d in OPS if d.dtensor == rule for n in (d.name, *d.modules)}

    assert set(_op_cases()) == names("refused")
    row_local = names("row-local") - {"RMSNorm"}  # the module: under SequenceParallel in _rows_exact
    assert set(_row_refusals()) == row_local
    assert row_local <= set(ROWS_EXACT)


def test_dtensor_inputs_refused_by_name_and_tp_models_at_patch_time():
    results = run_local(2, _run, timeout_s=300)
    for rank, res in enumerate(results):
        for op in _op_cases():
            arg, err = res[op]
            assert err is not None and err[0] == "TypeError", (rank, op, err)
            want = f"truefuse.{op} does not take DTensor inputs ({arg} is a DTensor, placements ("
            assert err[1].startswith(want), (rank, op, err)
            assert "local_map" in err[1], (rank, op, err)
        for op, (arg, err) in res["rows_refused"].items():
            want = f"truefuse.{op} runs on a DTensor only row by row (each rank's rows, exact): {arg} "
            assert err is not None and err[0] == "TypeError" and err[1].startswith(want), (rank, op, err)
        assert res["rows_exact"] and all(res["rows_exact"].values()), (rank, res["rows_exact"])
        if rank:
            continue
        kind, msg = res["tp_patch"]
        assert kind == "ValueError" and msg.startswith("apply_truefuse does not patch a tensor-parallel model: parameter "), msg
        assert "Nothing was patched" in msg and res["tp_untouched"] == "LlamaRMSNorm", res
        want = "truefuse.GroupedMLP (the patched MixtralExperts) does not take DTensor inputs (hidden_states is a DTensor"
        assert res["experts"][0] == "TypeError" and res["experts"][1].startswith(want), res["experts"]
        assert res["fsdp_patch"] is None and res["fsdp_norm"].startswith("Truefuse"), res  # FSDP2's DTensors are not refused
        kind, msg = res["fsdp_graph_decode"]  # its gathered parameters move: a graph cannot follow them
        assert kind == "ValueError" and msg.startswith("model is sharded by FSDP2 (its root module is a unit)"), msg
