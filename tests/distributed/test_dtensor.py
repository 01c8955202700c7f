"""DTensor inputs (issue 35 item 4; docs/design.md §6.9): every public truefuse op refuses a DTensor
with one ``TypeError`` naming itself and the argument, before any kernel; ``apply_truefuse`` refuses
a tensor-parallel model (transformers' ``tp_plan``) at patch time and accepts FSDP2's sharded
parameters. On a 1-rank gloo mesh in one spawned process (a refusal needs no second rank: a
1-rank mesh still makes DTensors, Shard placements included; the spawn costs ~15 s of CPU, most
of it importing torch.distributed.tensor, truefuse and transformers).

Before the check the same calls failed deep inside (``truefuse.norm_fwd.default does not have a
sharding strategy registered``, ``invalid python storage``, ``mixed torch.Tensor and DTensor``) or,
on the CPU reference path, ran on DTensor's own ops; no message named the truefuse op.
"""

from __future__ import annotations

import re

import torch

from truefuse.distributed.launch import run_local


def _op_cases(mesh=None) -> dict:
    """op name -> (argument the message names, call): ``D(t)`` is ``t`` sharded by rows over the
    mesh, ``R(t)`` replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import truefuse
    from truefuse.ops.scale import scale_

    def D(t):
        return distribute_tensor(t, mesh, [Shard(0)])

    def R(t):
        return distribute_tensor(t, mesh, [Replicate()])

    g = torch.Generator().manual_seed(0)
    x, w, W = torch.randn(4, 8, generator=g), torch.randn(8, generator=g), torch.randn(16, 8, generator=g)
    t = torch.randint(0, 16, (4,), generator=g)
    q, cos = torch.randn(2, 2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    return {
        "gemm": ("b", lambda: truefuse.gemm(x, R(W.t()))),
        "rms_norm": ("x", lambda: truefuse.rms_norm(D(x), w)),
        "layer_norm": ("bias", lambda: truefuse.layer_norm(x, w, R(w))),
        "rms_norm_hf": ("weight", lambda: truefuse.rms_norm_hf(x, R(w))),
        "apply_rotary_pos_emb": ("k", lambda: truefuse.apply_rotary_pos_emb(q, D(q), cos, cos)),
        "gated_activation": ("up", lambda: truefuse.gated_activation(x, "swiglu", D(x))),
        "linear_cross_entropy": ("linear_weight", lambda: truefuse.linear_cross_entropy(x, D(W), t)),
        "linear_log_probs": ("input", lambda: truefuse.linear_log_probs(D(x), W, t)),
        "token_log_probs": ("logits", lambda: truefuse.token_log_probs(D(W), torch.zeros(16, dtype=torch.long))),
        "attention": ("value", lambda: truefuse.attention(q, q, D(q), is_causal=True)),
        "ops.scale_": ("tensor", lambda: scale_(D(x.clone()), torch.tensor(2.0))),
        "Linear": ("input", lambda: _colwise(truefuse.Linear(8, 16), mesh, x)),
        "LayerNormLinear": ("input", lambda: truefuse.LayerNormLinear(8, 16)(D(x))),
        "LayerNormMLP": ("input", lambda: truefuse.LayerNormMLP(8, 16)(R(x))),
        "GroupedLinear": ("input", lambda: truefuse.GroupedLinear(2, 8, 16)(R(x), [1, 3])),
        "GroupedMLP": ("input", lambda: truefuse.GroupedMLP(2, 8, 16)(R(x), [1, 3])),
        "RMSNorm": ("input", lambda: truefuse.RMSNorm(8)(D(x))),
        "LinearCrossEntropyLoss": ("linear_weight", lambda: truefuse.LinearCrossEntropyLoss()(x, R(W), t)),
    }


def _colwise(layer, mesh, x):
    """torch's tensor parallelism on a truefuse.Linear (an nn.Linear): weight Shard(0), input Replicate."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(layer, mesh, ColwiseParallel())(x)


def _hf_cases(mesh) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse

    tp = tiny_model("llama")
    # the model's own plan (q/k/v/gate/up colwise, o/down rowwise, lm_head colwise), "*" a layer
    # number; a module's entry installs its hooks, its parameters' entries shard them (as loading does)
    mods = dict(tp.named_modules())
    plan = {n: s for p, s in tp.tp_plan.items() for n in mods if re.fullmatch(re.escape(p).replace(r"\*", r"\d+"), n)}
    plan.update({f"{n}.{k}": s for n, s in list(plan.items()) for k, _ in mods[n].named_parameters(recurse=False)})
    apply_tensor_parallelism(tp, mesh, plan)
    out = {"tp_patch": _error(lambda: apply_truefuse(tp)), "tp_untouched": type(tp.model.norm).__name__}
    fsdp = tiny_model("llama")
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    out["fsdp_patch"] = _error(lambda: apply_truefuse(fsdp))
    out["fsdp_norm"] = type(fsdp.model.norm).__name__
    moe = tiny_model("mixtral")
    apply_truefuse(moe)
    experts = moe.model.layers[0].mlp.experts
    h, idx = torch.randn(3, 32), torch.tensor([[0, 1], [2, 3], [1, 2]])
    out["experts"] = _error(lambda: experts(distribute_tensor(h, mesh, [Replicate()]), idx, torch.full((3, 2), 0.5)))
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
    cases = _op_cases(mesh)
    out = {op: (arg, _error(call)) for op, (arg, call) in cases.items()}
    out.update(_hf_cases(mesh))
    return out


def test_dtensor_inputs_refused_by_name_and_tp_models_at_patch_time():
    results = run_local(1, _run, timeout_s=240)
    for rank, res in enumerate(results):
        for op in _op_cases():
            arg, err = res[op]
            assert err is not None and err[0] == "TypeError", (rank, op, err)
            want = f"truefuse.{op} does not take DTensor inputs ({arg} is a DTensor, placements ("
            assert err[1].startswith(want), (rank, op, err)
            assert "local_map" in err[1], (rank, op, err)
        kind, msg = res["tp_patch"]
        assert kind == "ValueError" and msg.startswith("apply_truefuse does not patch a tensor-parallel model: parameter "), msg
        assert "Nothing was patched" in msg and res["tp_untouched"] == "LlamaRMSNorm", res
        want = "truefuse.GroupedMLP (the patched MixtralExperts) does not take DTensor inputs (hidden_states is a DTensor"
        assert res["experts"][0] == "TypeError" and res["experts"][1].startswith(want), res["experts"]
        assert res["fsdp_patch"] is None and res["fsdp_norm"].startswith("Truefuse"), res  # FSDP2's DTensors are not refused
