"""``apply_truefuse`` on every architecture: what it replaces (by type and count), the stock bits
of the norms, bounded outputs and gradients of the whole patched model, idempotence, unpatch,
class-level patching, and the refusal of unknown architectures."""

from __future__ import annotations

import copy
import io

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import ARCHITECTURES, apply_truefuse, apply_truefuse_to_llama, unpatch_truefuse  # noqa: E402
from truefuse.testing import bounded_report  # noqa: E402

ALL = sorted(ARCHITECTURES)


def _ids(seed=1, shape=(2, 12)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _count(model, name: str) -> int:
    return sum(1 for m in model.modules() if any(c.__name__ == name for c in type(m).__mro__))


@pytest.mark.parametrize("model_type", ALL)
def test_report_counts_every_module(model_type):
    model = tiny_model(model_type)
    arch = ARCHITECTURES[model_type]
    report = apply_truefuse(model)
    assert report.count(arch.norm) == _count(model, arch.norm) > 0
    for m in model.modules():
        if isinstance(m, arch.cls(arch.norm)):
            assert type(m).__name__ == "Truefuse" + arch.norm
    if arch.mlp:
        n_mlp = _count(model, arch.mlp)
        left = sum(n for (t, _), n in report.left.items() if t == arch.mlp)
        assert report.count(arch.mlp) + left == n_mlp
        assert left == 0
    assert report.count(arch.attention) == _count(model, arch.attention) == 2
    assert report.loss
    assert str(report).startswith(f"truefuse patch of a {model_type} model")


@pytest.mark.parametrize("model_type", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_give_stock_bits(model_type, dtype, device):
    """With the norms and the rotary embedding patched the whole model's logits are the stock
    model's, bit for bit (CUDA: the kernels in every dtype; CPU: the kernels under the interpreter
    in fp32, the reference paths in bf16 / fp16), and so are the hidden states after every layer.
    (The norms' backward is bounded, so the gradients below a norm are: tests/test_rope.py checks
    the rotary embedding's backward bit for bit.)"""
    stock = tiny_model(model_type, dtype).to(device)
    patched = copy.deepcopy(stock)
    report = apply_truefuse(patched, mlp=False, experts=False, linear_cross_entropy=False)
    assert report.count(ARCHITECTURES[model_type].norm) > 0
    ids = _ids().to(device)
    with torch.no_grad():
        a, b = stock(ids, output_hidden_states=True), patched(ids, output_hidden_states=True)
    assert torch.equal(a.logits, b.logits), (a.logits - b.logits).abs().max()
    for ha, hb in zip(a.hidden_states, b.hidden_states, strict=True):
        assert torch.equal(ha, hb)


@pytest.mark.parametrize("model_type", ALL)
def test_patched_model_bounded(model_type):
    """Everything patched (norms, MLP, experts, loss), fp32: loss and every parameter's gradient
    within the bounded contract against stock, with the float64 stock model as the reference."""
    stock = tiny_model(model_type)
    patched = copy.deepcopy(stock)
    apply_truefuse(patched)
    ref = copy.deepcopy(stock).double()
    if hasattr(ref.config, "_experts_implementation"):
        ref.config._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    labels = _ids(2)
    labels[0, :3] = -100

    def run(model):
        model.zero_grad()
        out = model(_ids(), labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (l_s, g_s), (l_p, g_p), (l_r, g_r) = run(stock), run(patched), run(ref)
    assert bounded_report(l_p, l_r, l_s).passed
    assert g_p.keys() == g_s.keys()
    bad = {n: bounded_report(g_p[n], g_r[n], g_s[n]) for n in g_s if not bounded_report(g_p[n], g_r[n], g_s[n]).passed}
    assert not bad, bad


def test_idempotent_and_unpatch():
    model = tiny_model("llama")
    stock_types = [type(m) for m in model.modules()]
    first, second = apply_truefuse(model), apply_truefuse(model)
    assert first.replaced == second.replaced
    assert [type(m).__name__ for m in model.modules()].count("TruefuseLlamaRMSNorm") == 5
    unpatch_truefuse(model)
    assert [type(m) for m in model.modules()] == stock_types
    assert "forward" not in vars(model)


def test_unknown_architecture_left_untouched():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="'gpt2'.*known: .*llama.*Nothing was patched"):
        apply_truefuse(model)
    assert [type(m) for m in model.modules()] == before
    with pytest.raises(TypeError, match="PreTrainedModel"):
        apply_truefuse(torch.nn.Linear(2, 2))


def test_patched_model_pickles_and_keeps_state_dict():
    stock = tiny_model("qwen3")
    patched = copy.deepcopy(stock)
    apply_truefuse(patched)
    assert {k: v.shape for k, v in patched.state_dict().items()} == {k: v.shape for k, v in stock.state_dict().items()}
    buf = io.BytesIO()
    torch.save(patched, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert type(again.model.norm).__name__ == "TruefuseQwen3RMSNorm"


def test_class_level_patch(monkeypatch):
    import transformers.models.llama.modeling_llama as ml

    for name in ("LlamaRMSNorm", "LlamaMLP", "LlamaAttention"):
        monkeypatch.setattr(ml, name, getattr(ml, name))  # restored after the test
    monkeypatch.setattr(ml.LlamaForCausalLM, "forward", ml.LlamaForCausalLM.forward)
    apply_truefuse_to_llama()
    model = tiny_model("llama")
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"TruefuseLlamaRMSNorm", "TruefuseLlamaMLP", "TruefuseLlamaAttention"} <= kinds
    assert "LlamaRMSNorm" not in kinds
    stock = tiny_model("llama")  # the same seed: the same weights
    unpatch_truefuse(stock)
    with torch.no_grad():
        assert torch.allclose(model(_ids()).logits, stock(_ids()).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_fast_norms_option(model_type):
    """``stock_norm_bits=False``: the norms run ``truefuse.rms_norm`` (one rounding, its own
    reduction order): close to stock, reported as such, and swapped back on a second call."""
    stock = tiny_model(model_type)
    patched = copy.deepcopy(stock)
    report = apply_truefuse(patched, stock_norm_bits=False, mlp=False, rope=False, linear_cross_entropy=False)
    norm = ARCHITECTURES[model_type].norm
    assert any("one rounding" in how for (t, how) in report.replaced if t == norm)
    kinds = {type(m).__name__ for m in patched.modules()}
    assert f"Truefuse{norm}Fast" in kinds and f"Truefuse{norm}" not in kinds
    with torch.no_grad():
        a, b = stock(_ids()).logits, patched(_ids()).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    apply_truefuse(patched, mlp=False, rope=False, linear_cross_entropy=False)
    with torch.no_grad():
        assert torch.equal(stock(_ids()).logits, patched(_ids()).logits)
