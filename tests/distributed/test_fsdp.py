"""truefuse under torch's data parallelism: FSDP2 (``fully_shard``) and DDP, 2 gloo ranks on the CPU
(docs/huggingface.md "Under FSDP2 and DDP", docs/linear.md).

One ``run_local`` spawn runs every case and returns what the tests assert on:

* a patched tiny Llama under each common wrapping (the head inside the root unit, untied and tied;
  the head as its own unit, also with ``set_requires_gradient_sync(False)`` accumulation; tied
  embeddings and head as one grouped unit; DDP, also with ``no_sync``) against stock under DDP
  (the same micro-batches; every wrapping computes the ranks' mean gradient): no fallback
  warning, truefuse's loss op ran once per forward, the loss within 1e-5 relative of stock's over
  3 AdamW steps, the head's gradient after the first step (FSDP2's reduce-scattered shards,
  gathered) within 1e-5 relative of stock's, and a head unit resharded between forward and backward;
* a head with a hook that is not FSDP2's own still falls back (the warning, stock's loss);
* ``truefuse.Linear``, ``LayerNormMLP`` and ``GroupedMLP`` as an FSDP2 unit, inside one, and under
  DDP: plain ``.grad`` equals the single-process gradient of the ranks' mean loss;
  ``fuse_wgrad_accumulation`` and ``delay_wgrad_compute`` are refused naming the option.

On the CPU the patched model takes truefuse's reference paths (the entry points CI tests; the
Triton interpreter would take minutes here), as tests/hf's ``torch_paths`` fixture does.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import warnings

import pytest
import torch
from _interpreter_speedup import run_local

# find_spec, not importorskip: only the ranks need transformers (its import is 3 s of this test's CPU)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

#: wrapping -> (tied embeddings, micro-batches a step)
HF_CASES = {
    "fsdp_root": (False, 1),
    "fsdp_root_tied": (True, 1),
    "fsdp_head": (False, 1),
    "fsdp_head_accum": (False, 2),
    "fsdp_group_tied": (True, 1),
    "ddp": (False, 1),
    "ddp_accum": (False, 2),
}
STEPS = 3


def _torch_paths():
    import truefuse.ops._launch.triton as tr

    real = tr.get_config
    tr.get_config = lambda: dataclasses.replace(real(), triton_interpret=False)


def _count_loss_calls() -> list:
    """Count calls of truefuse's loss op (the patched forward imports it from this module per call)."""
    import truefuse.autograd.linear_cross_entropy as lce

    calls, real = [], lce.linear_cross_entropy

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    lce.linear_cross_entropy = counted
    return calls


def _wrap(model, case: str, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if case.startswith("ddp"):
        return DistributedDataParallel(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if case.startswith("fsdp_head"):
        fully_shard(model.lm_head, mesh=mesh)
    elif case == "fsdp_group_tied":  # FSDP2 refuses a tied head alone: one unit with the embedding
        fully_shard([model.model.embed_tokens, model.lm_head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _head_grad(model) -> torch.Tensor:
    """The head's whole gradient after the step's reduction (FSDP2's shards gathered)."""
    g = getattr(model, "module", model).lm_head.weight.grad
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()


def _step(model, ids, micro: int):
    """One step's forward and backward in ``micro`` micro-batches, the gradient reduced only after
    the last (``no_sync`` / ``set_requires_gradient_sync(False)`` before)."""
    import contextlib

    total, sharded = 0.0, []
    for i, part in enumerate(ids.chunk(micro)):
        last = i == micro - 1
        sync = contextlib.nullcontext()
        if hasattr(model, "no_sync"):
            sync = contextlib.nullcontext() if last else model.no_sync()
        else:
            model.set_requires_gradient_sync(last)
        with sync:
            loss = model(input_ids=part, labels=part).loss / micro
            # between forward and backward a head unit is resharded, as stock's (its hooks ran)
            sharded.append(hasattr(getattr(model, "module", model).lm_head.weight, "placements"))
            loss.backward()
        total += loss.item()
    return total, all(sharded)


def _train(model, batches, micro: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grad, sharded = [], None, True
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for ids in batches:
            loss, resharded = _step(model, ids, micro)
            losses.append(loss)
            sharded &= resharded
            grad = _head_grad(model) if grad is None else grad
            opt.step()
            opt.zero_grad()
    return losses, grad, [str(x.message) for x in w if "truefuse" in str(x.message)], sharded


def _hf(rank: int, world: int, mesh, calls: list) -> dict:
    from tests.hf.tiny import VOCAB, tiny_model
    from truefuse.integrations.huggingface import apply_truefuse

    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    batches = [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(STEPS)]
    out, refs = {}, {}
    for case, (tied, micro) in HF_CASES.items():
        if (tied, micro) not in refs:  # stock under DDP: the wrappings all compute its mean gradient
            refs[tied, micro] = _train(_wrap(tiny_model("llama", tie_word_embeddings=tied), "ddp", mesh), batches, micro)
        a = refs[tied, micro]
        patched = tiny_model("llama", tie_word_embeddings=tied)
        apply_truefuse(patched)
        before = len(calls)
        b = _train(_wrap(patched, case, mesh), batches, micro)
        out[case] = {
            "loss_rel": max(abs(x - y) / abs(x) for x, y in zip(a[0], b[0], strict=True)),
            "grad_rel": float((a[1] - b[1]).norm() / a[1].norm()),
            "calls": len(calls) - before,
            "warnings": a[2] + b[2],
            "resharded_after_forward": b[3],
        }
    # model_log_probs calls model.base_model outside the root unit's hooks: refused by name
    from truefuse.integrations.huggingface import model_log_probs

    for case in ("fsdp_root", "fsdp_head"):
        try:
            model_log_probs(_wrap(tiny_model("llama"), case, mesh), batches[0])
            out[f"log_probs_{case}"] = "ran"
        except TypeError as e:
            out[f"log_probs_{case}"] = str(e)
    # a hook that is not FSDP2's own: the stock path, with the warning
    stock = tiny_model("llama")
    patched = copy.deepcopy(stock)
    apply_truefuse(patched)
    with torch.no_grad():
        ref = _wrap(stock, "fsdp_head", mesh)(input_ids=batches[0], labels=batches[0]).loss.item()
    model = _wrap(patched, "fsdp_head", mesh)
    model.lm_head.register_forward_hook(lambda m, i, o: None)
    before = len(calls)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        loss = model(input_ids=batches[0], labels=batches[0]).loss
    loss.backward()
    out["foreign_hook"] = {
        "loss_rel": abs(loss.item() - ref) / abs(ref),
        "calls": len(calls) - before,
        "warnings": [str(x.message) for x in w if "truefuse" in str(x.message)],
    }
    return out


def _module(kind: str, **options):
    import truefuse

    torch.manual_seed(0)
    if kind == "Linear":
        return truefuse.Linear(16, 24, **options), lambda m, x: m(x)
    if kind == "LayerNormMLP":
        m = truefuse.LayerNormMLP(16, 32, normalization="RMSNorm", activation="swiglu", **options)
        return m, lambda m, x: m(x)
    return truefuse.GroupedMLP(4, 16, 8, **options), lambda m, x: m(x, [3, 0, 2, 3])


def _loss(call, m, x):
    return call(m, x).square().sum()


class _Outer(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)


def _wrap_module(m, how: str, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if how == "ddp":
        return DistributedDataParallel(m), m
    if how == "fsdp_inside":  # a unit holding the module: FSDP2's hooks are on the container
        outer = _Outer(m)
        fully_shard(outer, mesh=mesh)
        return outer, m
    fully_shard(m, mesh=mesh)
    return m, m


def _modules(rank: int, world: int, mesh) -> dict:
    """Plain gradients against one process's gradient of the mean loss; the §2 options refused."""
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    out = {}
    for kind in ("Linear", "LayerNormMLP", "GroupedMLP"):
        for how in ("fsdp", "fsdp_inside", "ddp"):
            ref, call = _module(kind)
            model, inner = _wrap_module(copy.deepcopy(ref), how, mesh)
            _loss(call, model, xs[rank]).backward()
            (sum(_loss(call, ref, x) for x in xs) / world).backward()
            errs = []
            for p, q in zip(inner.parameters(), ref.parameters(), strict=True):
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                errs.append(float((g - q.grad).norm() / q.grad.norm().clamp_min(1e-30)))
            out[f"{kind}/{how}/plain"] = max(errs)
            for option in ("fuse_wgrad_accumulation", "delay_wgrad_compute"):
                m, call = _module(kind, **{option: True})
                for _, p in m.gemm_weights():
                    p.main_grad = torch.zeros_like(p)
                model, _ = _wrap_module(m, how, mesh)
                try:
                    _loss(call, model, xs[rank]).backward()
                    out[f"{kind}/{how}/{option}"] = "no error"
                except RuntimeError as e:
                    out[f"{kind}/{how}/{option}"] = str(e)
    # the loss module's own §2 options: its weight comes with each forward (a head DDP reduces)
    import truefuse

    head = torch.nn.Linear(16, 32, bias=False)
    for option in ("fuse_wgrad_accumulation", "delay_wgrad_compute"):
        loss = truefuse.LinearCrossEntropyLoss(**{option: True})
        head.weight.main_grad = torch.zeros_like(head.weight)
        model = torch.nn.parallel.DistributedDataParallel(_HeadLoss(head, loss))
        try:
            model(xs[rank], torch.arange(8) % 32).backward()
            out[f"LinearCrossEntropyLoss/ddp/{option}"] = "no error"
        except RuntimeError as e:
            out[f"LinearCrossEntropyLoss/ddp/{option}"] = str(e)
    return out


class _HeadLoss(torch.nn.Module):
    def __init__(self, head, loss):
        super().__init__()
        self.head, self.loss = head, loss

    def forward(self, x, target):
        return self.loss(x, self.head.weight, target)


def _everything(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two ranks on two cores: more threads made a step 4x slower here
    _torch_paths()
    calls = _count_loss_calls()
    mesh = init_device_mesh("cpu", (world,))
    return {"hf": _hf(rank, world, mesh, calls), "modules": _modules(rank, world, mesh)}


@pytest.fixture(scope="module")
def per_rank():
    return run_local(2, _everything)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_patched_llama_follows_stock(per_rank, case):
    micro = HF_CASES[case][1]
    for rank, res in enumerate(per_rank):
        r = res["hf"][case]
        assert r["warnings"] == [], (rank, r["warnings"])  # no fallback
        assert r["calls"] == STEPS * micro, (rank, r["calls"])  # truefuse's loss ran every forward
        assert r["loss_rel"] <= 1e-5, (rank, r)
        assert r["grad_rel"] <= 1e-5, (rank, r)  # the head's (reduce-scattered) gradient
        # a head unit's weight is freed between forward and backward (its FSDP2 hooks resharded
        # it): not left unsharded until the end of the backward
        assert r["resharded_after_forward"] == (case in ("fsdp_head", "fsdp_head_accum", "fsdp_group_tied")), (rank, r)


def test_model_log_probs_refuses_fsdp2(per_rank):
    """Not a DTensor error from deep inside the embedding: a refusal naming the function."""
    for res in per_rank:
        for case in ("fsdp_root", "fsdp_head"):
            assert res["hf"][f"log_probs_{case}"].startswith("model_log_probs does not take an FSDP2"), case


def test_foreign_head_hook_falls_back(per_rank):
    for res in per_rank:
        r = res["hf"]["foreign_hook"]
        assert r["calls"] == 0 and r["loss_rel"] <= 1e-6, r
        assert len(r["warnings"]) == 1 and "forward hooks other than FSDP2's own" in r["warnings"][0], r


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "GroupedMLP"])
@pytest.mark.parametrize("how", ["fsdp", "fsdp_inside", "ddp"])
def test_modules_plain_grad_and_refusals(per_rank, kind, how):
    wrapper = "DistributedDataParallel" if how == "ddp" else "FSDP2 (fully_shard)"
    for res in per_rank:
        r = res["modules"]
        assert r[f"{kind}/{how}/plain"] <= 1e-5, r
        for option in ("fuse_wgrad_accumulation", "delay_wgrad_compute"):
            msg = r[f"{kind}/{how}/{option}"]
            assert msg.startswith(f"{kind} under {wrapper}: {option}=True"), msg
            assert f"construct the module with {option}=False" in msg, msg


@pytest.mark.parametrize("option", ["fuse_wgrad_accumulation", "delay_wgrad_compute"])
def test_loss_module_refuses_its_wgrad_options_under_ddp(per_rank, option):
    for res in per_rank:
        got = res["modules"][f"LinearCrossEntropyLoss/ddp/{option}"]
        assert got.startswith("LinearCrossEntropyLoss under DistributedDataParallel") and option in got, got
