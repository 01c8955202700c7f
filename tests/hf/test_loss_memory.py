"""``apply_truefuse(loss_memory="lean")``: the patched forward computes its loss with
``linear_cross_entropy(memory="lean")`` (the vocabulary-slice passes, no fp32 weight-gradient
accumulator), gives the default path's loss and gradients within fp32 rounding, says so in its
report, keeps the default inside ``truefuse.batch_invariant()`` (lean is not batch invariant), and
refuses an unknown mode or lean with ``batch_invariant=True`` before patching anything."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import truefuse.autograd.linear_cross_entropy as lce  # noqa: E402
from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.config import batch_invariant  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse, unpatch_truefuse  # noqa: E402


@pytest.fixture
def stats_calls(monkeypatch):
    """How many times lean's first pass (``stats_pass``) ran."""
    calls = []
    real = lce.stats_pass

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(lce, "stats_pass", counted)
    return calls


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: the softcapped loss
def test_lean_loss_matches_the_default(model_type, stats_calls):
    base = tiny_model(model_type)
    default, lean = copy.deepcopy(base), copy.deepcopy(base)
    apply_truefuse(default, rms_norm=False, mlp=False, rope=False)
    report = apply_truefuse(lean, rms_norm=False, mlp=False, rope=False, loss_memory="lean")
    assert "memory='lean'" in str(report)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    l0, g0 = _step(default, ids)
    assert stats_calls == []
    l1, g1 = _step(lean, ids)
    assert len(stats_calls) == 1  # the lean path ran, once
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_lean_is_kept_per_instance_and_undone(stats_calls):
    model = tiny_model("llama")
    apply_truefuse(model, rms_norm=False, mlp=False, rope=False, loss_memory="lean")
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    with batch_invariant():  # lean's slices depend on the token count: the default path runs
        model(input_ids=ids, labels=ids)
    assert stats_calls == []
    apply_truefuse(model, rms_norm=False, mlp=False, rope=False)  # patching again with the default resets it
    model(input_ids=ids, labels=ids)
    assert stats_calls == []
    apply_truefuse(model, rms_norm=False, mlp=False, rope=False, loss_memory="lean")
    unpatch_truefuse(model)
    assert not any("truefuse" in k for k in model.__dict__)


def test_loss_memory_refusals():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="loss_memory must be one of .*'small'"):
        apply_truefuse(model, loss_memory="small")
    with pytest.raises(ValueError, match="loss_memory='lean' is not batch invariant"):
        apply_truefuse(model, loss_memory="lean", batch_invariant=True)
    assert not any("truefuse" in type(m).__name__.lower() for m in model.modules())  # nothing patched
    assert "forward" not in model.__dict__
