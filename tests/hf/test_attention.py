"""``attn_implementation="truefuse"`` (issue 33): registered when ``truefuse.integrations.huggingface``
is imported; a tiny Llama on it against the same model on ``"sdpa"`` (bounded, the float64 model as
the reference), ``generate``, ``output_attentions`` refused, ``apply_truefuse(attention=True)`` and
its undo. CPU fp32 on the PyTorch paths (``torch_paths``): the kernel is tests/test_attention.py's."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse, unpatch_truefuse  # noqa: E402
from truefuse.testing import bounded_report  # noqa: E402


def _batch():
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    return ids, mask


def test_truefuse_attention_matches_sdpa_and_generates(torch_paths):
    sdpa = tiny_model("llama", num_hidden_layers=1, attn_implementation="sdpa").eval()
    ours = tiny_model("llama", num_hidden_layers=1, attn_implementation="truefuse").eval()
    ref = copy.deepcopy(sdpa).double()
    ids, mask = _batch()
    with torch.no_grad():
        got, base, want = (m(ids, attention_mask=mask).logits for m in (ours, sdpa, ref))
    keep = mask.bool()  # padded queries see no key: their rows are not compared
    assert bounded_report(got[keep], want[keep], base[keep]).passed
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), sdpa.generate(ids, **kw))
    with pytest.raises(ValueError, match="output_attentions=True.*'eager'"):
        ours(ids, output_attentions=True)


def test_apply_truefuse_attention_and_unpatch(torch_paths):
    model = tiny_model("llama", num_hidden_layers=1, attn_implementation="sdpa")
    assert apply_truefuse(model).attention == ""  # off by default
    assert model.config._attn_implementation == "sdpa"
    report = apply_truefuse(model, attention=True)
    assert model.config._attn_implementation == "truefuse" and "'sdpa' -> 'truefuse'" in str(report)
    unpatch_truefuse(model)
    assert model.config._attn_implementation == "sdpa"


def test_report_names_the_sliding_window_limit(torch_paths):
    """A sliding-window model on truefuse.attention: the window comes in transformers' mask (the
    answer is right), but its rolling cache moves decode's key blocks, so the report says that
    decode is not bitwise the prefill (docs/batch_invariance.md)."""
    plain = apply_truefuse(tiny_model("mistral", num_hidden_layers=1, sliding_window=None), attention=True)
    assert "sliding" not in plain.attention
    windowed = apply_truefuse(tiny_model("mistral", num_hidden_layers=1, sliding_window=4), attention=True)
    assert "sliding_window=4" in windowed.attention and "not bitwise" in str(windowed)


def test_static_cache_and_gradient_checkpointing(torch_paths):
    """Issue 33's integration points: ``generate`` with a static cache gives the dynamic cache's
    tokens, and gradient checkpointing (the attention recomputed in the backward) gives the same
    gradients as without it, bit for bit."""
    model = tiny_model("llama", num_hidden_layers=2, attn_implementation="truefuse").eval()
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    dynamic = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(static, dynamic)

    def grads(checkpointing: bool):
        m = tiny_model("llama", num_hidden_layers=2, attn_implementation="truefuse").train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m(ids, attention_mask=mask, labels=ids).loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys() and all(torch.equal(plain[n], ckpt[n]) for n in plain)
