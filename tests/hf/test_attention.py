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


def _as_while_capturing(monkeypatch):
    """transformers' skip decision as some versions (5.17) take it while a CUDA stream captures:
    never skip the causal mask, even with no padding mask to read."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *a, **k: False)


def test_truefuse_mask_leaves_a_plain_causal_call_to_the_kernel_while_capturing(monkeypatch):
    """The mask registered for ``"truefuse"`` returns None for a causal, unpadded call whatever
    transformers decides (a whole step captured in a CUDA graph materialized the causal mask and
    ran attention 2.6-5.8x longer on an H100), and transformers' own ``sdpa_mask`` everywhere the
    mask holds data: padding, a static cache's tensor offset, a window, fewer queries than keys."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask

    _as_while_capturing(monkeypatch)
    ours = ALL_MASK_ATTENTION_FUNCTIONS["truefuse"]
    base = dict(batch_size=2, q_length=5, kv_length=5, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                attention_mask=None, allow_is_causal_skip=True, use_vmap=False, device="cpu")  # fmt: skip
    assert isinstance(sdpa_mask(**base), torch.Tensor)  # what the capture got
    assert ours(**base) is None
    assert ours(**{**base, "q_length": 1, "kv_length": 9, "q_offset": 8}) is None  # a decode step, no padding
    padded = torch.ones(2, 5, dtype=torch.bool)
    padded[1, :2] = False
    for change in (
        {"attention_mask": padded},
        {"q_offset": torch.tensor(0)},
        {"local_size": 3},
        {"q_length": 3, "kv_length": 5},
        {"allow_is_causal_skip": False},
        {"mask_function": lambda b, h, q, kv: kv <= q},
    ):
        want, got = sdpa_mask(**{**base, **change}), ours(**{**base, **change})
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), change
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)  # an export keeps transformers' choice
    assert isinstance(ours(**base), torch.Tensor)


def test_truefuse_model_gets_no_causal_mask_while_capturing(monkeypatch, torch_paths):
    """Through a model: a tiny Llama on ``"truefuse"`` hands its attention no mask for an unpadded
    batch where transformers would have built one, and the logits are the same bits."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import truefuse.integrations.huggingface.attention as hf_attention

    model = tiny_model("llama", num_hidden_layers=2, attn_implementation="truefuse").eval()
    ids = _batch()[0]
    with torch.no_grad():
        want = model(ids).logits
    seen = []
    real = hf_attention.attention_forward
    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping,
        "truefuse",
        lambda m, q, k, v, mask, **kw: seen.append(mask) or real(m, q, k, v, mask, **kw),
    )
    _as_while_capturing(monkeypatch)
    with torch.no_grad():
        got = model(ids).logits
    assert seen and all(m is None for m in seen)
    assert torch.equal(got, want)
