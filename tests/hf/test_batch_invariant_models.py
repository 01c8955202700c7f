"""Tiny Llama, Qwen3 and Qwen3-MoE under ``apply_truefuse(batch_invariant=True)`` with
``truefuse.attention`` (docs/batch_invariance.md): a sequence alone and inside right- and
left-padded batches give the same logits bit for bit; so do ``generate``'s steps (KV cache) and
one full forward; ``model_log_probs`` over a batch equals ``token_log_probs`` of each sequence's
own logits; two training runs are identical, their loss within 1e-4 relative of stock's (fp32).
On truefuse's PyTorch paths (``torch_paths``: the interpreter would take minutes); stock fails the
same checks (``test_stock_differs``), so they can fail."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import truefuse  # noqa: E402
from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.demo import parity  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse, model_log_probs  # noqa: E402

G = torch.Generator().manual_seed(0)
SEQS = [torch.randint(1, VOCAB, (n,), generator=G) for n in (7, 3, 5)]
BATCHES = [torch.randint(1, VOCAB, (2, 6), generator=G) for _ in range(2)]
ONE_LAYER = {"num_hidden_layers": 1}  # what a second layer adds, the first already has: time is short
# hidden 128: this CPU's fp32 GEMMs give a row the same bits at any row count at hidden 32, not at
# 64 and up (test_stock_differs: the checks must be able to fail on the machine that runs them)
WIDE = {**ONE_LAYER, "hidden_size": 128, "intermediate_size": 256}


def _bi(model):
    m = copy.deepcopy(model)
    apply_truefuse(m, batch_invariant=True)  # the attention on truefuse.attention too
    return m.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_a_sequence_gets_its_bits_anywhere(model_type, dtype, torch_paths):
    model = _bi(tiny_model(model_type, dtype, **WIDE))
    for side in ("right", "left"):
        d = parity.alone_vs_batch(model, SEQS, side)
        assert d.rows == 12 and d.differing == 0, (side, d)
    d = parity.generate_vs_forward(model, [s[:3] for s in SEQS[:2]], 2)
    assert d.rows == 4 and d.differing == 0, d
    ids, mask = parity.pad(SEQS, "left")
    with torch.no_grad():
        got = model_log_probs(model, ids, mask)
        for i, s in enumerate(SEQS):
            alone = truefuse.token_log_probs(model(s[None]).logits[:, :-1], s[None, 1:])
            rows = slice(ids.shape[1] - len(s), None)
            assert torch.equal(got.log_probs[i, rows.start :], alone.log_probs[0])
            assert torch.equal(got.entropy[i, rows.start :], alone.entropy[0])


def test_training_runs_repeat_and_follow_stock(torch_paths):
    """Qwen3-MoE: dense attention and the experts (Llama's layers are a subset)."""
    model = tiny_model("qwen3_moe", **ONE_LAYER)
    bi = _bi(model)
    runs = [parity.training_runs(bi, BATCHES, lr=3e-3) for _ in range(2)]
    assert runs[0] == runs[1]
    stock = torch.tensor(parity.training_runs(model, BATCHES, lr=3e-3), dtype=torch.float64)
    assert torch.allclose(torch.tensor(runs[0], dtype=torch.float64), stock, rtol=1e-4, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU machine's CPU BLAS gave these tiny rows the same bits")
def test_stock_differs(torch_paths):
    """The checks above can fail: stock transformers on the CPU gives some sequence other bits in a batch."""
    model = tiny_model("llama", **WIDE).eval()
    assert max(parity.alone_vs_batch(model, SEQS, side).differing for side in ("right", "left")) > 0


def test_logits_come_from_the_heads_gemm(torch_paths, monkeypatch):
    """Under the switch alone (F.linear not routed), the patched forward's logits are the head's
    GEMM's: ``token_log_probs`` of them equals ``model_log_probs`` row for row. (The CPU's GEMM
    rows agree at these sizes whatever the path; cuBLAS's do not: the call itself is checked.)"""
    import truefuse.autograd._chunked_head as head

    rows = []
    real = head.logits_gemm
    monkeypatch.setattr(head, "logits_gemm", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    model = tiny_model("llama", **ONE_LAYER).eval()
    apply_truefuse(model)
    ids, mask = parity.pad(SEQS, "right")
    with torch.no_grad(), truefuse.batch_invariant():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=parity.positions(mask)).logits
        assert rows == [ids.numel()]
        target = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
        mine = truefuse.token_log_probs(logits[:, :-1], target)
        theirs = model_log_probs(model, ids, mask)
    assert torch.equal(mine.log_probs, theirs.log_probs) and torch.equal(mine.entropy, theirs.entropy)


def test_a_direct_forward_call_runs_in_the_mode():
    """``model.forward(...)`` (what a compile recipe or a wrapper library may call, past the hooks
    ``model(...)`` runs): the final norm and the head run in batch-invariant mode too, as under
    ``model(...)`` (they ran outside it: only the decoder layers enter it themselves)."""
    model = _bi(tiny_model("llama", **ONE_LAYER))
    seen = []
    for m in (model.model.norm, model.lm_head):
        m.register_forward_pre_hook(lambda mod, args: seen.append(truefuse.is_batch_invariant()))
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids)
        called = seen[:]
        seen.clear()
        model.forward(ids)
    assert called == [True, True] and seen == [True, True], (called, seen)
    assert not truefuse.is_batch_invariant()  # nothing leaks out of the call
