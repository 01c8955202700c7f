"""``apply_truefuse`` on every architecture: what it replaces (by type and count), the stock bits
of the norms, bounded outputs and gradients of the whole patched model, idempotence, unpatch,
class-level patching (models built after it only, its report and undo), the refusal of unknown
architectures and of an experts backend the device cannot run, and no warning stock does not give."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.config import tuning  # noqa: E402
from truefuse.integrations.huggingface import (  # noqa: E402
    ARCHITECTURES,
    ClassPatch,
    apply_truefuse,
    apply_truefuse_to_llama,
    unpatch_truefuse,
)
from truefuse.testing import bounded_report  # noqa: E402

ALL = sorted(ARCHITECTURES)


def _ids(seed=1, shape=(2, 12)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


#: the fp32 tests that run every kernel under the CPU interpreter: 6 positions a sequence (the rope
#: kernel runs a program per token, the norms per row: 2 x 12 took 3-7 s a model on the CI cores)
KERNEL_IDS = (2, 6)


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
    ids = _ids(shape=KERNEL_IDS).to(device)
    with torch.no_grad(), tuning(hf_norm_stock_numel=1):  # the kernels, not stock's own expression
        a, b = stock(ids, output_hidden_states=True), patched(ids, output_hidden_states=True)
    assert torch.equal(a.logits, b.logits), (a.logits - b.logits).abs().max()
    for ha, hb in zip(a.hidden_states, b.hidden_states, strict=True):
        assert torch.equal(ha, hb)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_patched_norm_runs_its_stock_forward_where_rms_norm_hf_would_run_stock_s_expression(model_type, monkeypatch):
    """A decode-sized call with nothing to differentiate, outside batch-invariant mode, runs the
    stock module's own forward (its bits; stock's host time: no checks around the same
    expression); with a gradient, in batch-invariant mode or above the ``hf_norm_stock_numel``
    knob, truefuse's op. The same bits either way."""
    import truefuse

    stock_model = tiny_model(model_type)
    patched = copy.deepcopy(stock_model)
    apply_truefuse(patched, mlp=False, experts=False, linear_cross_entropy=False)
    norm = patched.model.norm
    stock_cls = type(norm)._truefuse_stock
    calls = []
    original = stock_cls.forward

    def spy(self, x):
        calls.append(tuple(x.shape))
        return original(self, x)

    monkeypatch.setattr(stock_cls, "forward", spy)
    x = torch.randn(2, 1, norm.weight.shape[0])
    with torch.no_grad():
        y = norm(x)
        assert calls == [tuple(x.shape)], "the decode call did not run the stock forward"
        assert torch.equal(y, original(norm, x))
        with truefuse.batch_invariant():
            norm(x)
        with tuning(hf_norm_stock_numel=1):
            norm(x)
    xg = x.clone().requires_grad_()
    norm(xg).sum().backward()
    assert calls == [tuple(x.shape)], "a call that takes truefuse's op ran the stock forward"


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
    labels = _ids(2, KERNEL_IDS)
    labels[0, :3] = -100

    def run(model):
        model.zero_grad()
        out = model(_ids(shape=KERNEL_IDS), labels=labels)
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


@pytest.fixture
def llama_classes(monkeypatch):
    """The Llama classes a class-level patch touches, restored after the test whatever happens."""
    import transformers.models.llama.modeling_llama as ml

    for name in ("LlamaRMSNorm", "LlamaMLP", "LlamaAttention"):
        monkeypatch.setattr(ml, name, getattr(ml, name))
    for name in ("__init__", "forward"):
        monkeypatch.setattr(ml.LlamaForCausalLM, name, ml.LlamaForCausalLM.__dict__[name])
    return ml


def _kinds(model) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def test_class_level_patch_affects_models_built_after(llama_classes, torch_paths):
    """Issue 31: ``apply_truefuse_to_llama()`` patches the models built after it (modules and loss),
    not those built before (it used to replace the class's forward: their loss too), reports what
    it patched, and ``remove()`` undoes it for models built later."""
    ml = llama_classes
    before = tiny_model("llama")
    patch = apply_truefuse_to_llama()
    after = tiny_model("llama")  # the same seed: the same weights
    assert isinstance(patch, ClassPatch) and patch.active and patch.loss
    assert set(patch.replaced) == {"LlamaRMSNorm", "LlamaMLP", "LlamaAttention"}
    assert "LlamaRMSNorm" in str(patch) and "linear_cross_entropy" in str(patch)
    assert {"TruefuseLlamaRMSNorm", "TruefuseLlamaMLP", "TruefuseLlamaAttention"} <= _kinds(after)
    assert not any(k.startswith("Truefuse") for k in _kinds(before))
    assert "forward" in vars(after) and "forward" not in vars(before)
    ids = _ids()
    with torch.no_grad():  # training mode: truefuse's loss builds no logits, stock's does
        a, b = before(ids, labels=ids), after(ids, labels=ids)
    assert a.logits is not None and b.logits is None and torch.allclose(a.loss, b.loss, rtol=1e-5)
    patch.remove()
    patch.remove()  # idempotent
    assert not patch.active and ml.LlamaRMSNorm.__name__ == "LlamaRMSNorm"
    assert ml.LlamaForCausalLM.__init__ is llama_classes.LlamaForCausalLM.__dict__["__init__"]
    fresh = tiny_model("llama")
    assert not any(k.startswith("Truefuse") for k in _kinds(fresh)) and "forward" not in vars(fresh)
    assert "TruefuseLlamaRMSNorm" in _kinds(after)  # built while active: stays patched
    unpatch_truefuse(after)
    assert _kinds(after) == _kinds(fresh) and "forward" not in vars(after)


def test_class_level_patch_as_context_manager(llama_classes, torch_paths):
    with apply_truefuse_to_llama(mlp=False, linear_cross_entropy=False) as patch:
        inside = tiny_model("llama")
        with apply_truefuse_to_llama() as nested:  # what is already patched is not patched twice
            assert "LlamaRMSNorm" not in nested.replaced and nested.loss
            assert set(nested.replaced) == {"LlamaMLP"}
        assert "TruefuseLlamaMLP" not in _kinds(tiny_model("llama"))  # the nested block's undo
    assert patch.left == {"LlamaMLP": "mlp=False", "loss": "linear_cross_entropy=False"}
    assert "TruefuseLlamaRMSNorm" in _kinds(inside) and "TruefuseLlamaMLP" not in _kinds(inside)
    assert not any(k.startswith("Truefuse") for k in _kinds(tiny_model("llama")))


def test_experts_backend_refused_at_patch_time(monkeypatch):
    """Issue 31: ``experts_backend="triton"`` on a CPU model (no interpreter) was reported patched,
    then failed at the first forward naming ``backend=``; now a ValueError naming
    ``experts_backend`` before anything is patched."""
    import dataclasses

    import truefuse.ops.grouped_gemm.grouped_gemm as gg

    real = gg.get_config
    monkeypatch.setattr(gg, "get_config", lambda: dataclasses.replace(real(), triton_interpret=False))
    model = tiny_model("mixtral", num_hidden_layers=1)
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"experts_backend='triton' runs on CUDA.*experts_backend='per_group'.*Nothing"):
        apply_truefuse(model, experts_backend="triton")
    assert [type(m) for m in model.modules()] == before and "forward" not in vars(model)
    report = apply_truefuse(model, experts_backend="per_group")
    assert report.count("MixtralExperts") == 1


def test_no_warning_that_stock_does_not_give(torch_paths):
    """Issue 31: on transformers 5.24 every patched call warned ``past_key_values is deprecated``
    (and, in ``generate``, "Both `past_key_values` and `cache` are set") where stock does not. The
    patched forward takes the installed stock signature; a call and ``generate`` warn as stock
    does, and give stock's result."""
    import inspect
    import logging

    from transformers.utils import logging as hf_logging

    stock = tiny_model("llama", num_hidden_layers=1).eval()
    patched = copy.deepcopy(stock)
    apply_truefuse(patched)
    assert inspect.signature(patched.forward) == inspect.signature(stock.forward)
    ids = _ids(shape=(2, 6))
    mask = torch.ones_like(ids)

    def run(model):
        messages = []
        handler = logging.Handler()
        handler.emit = lambda record: messages.append(record.getMessage())
        hf_logging.get_logger("transformers").addHandler(handler)
        if hasattr(hf_logging, "warning_once") and hasattr(hf_logging.warning_once, "cache_clear"):
            hf_logging.warning_once.cache_clear()  # each run sees its once-only warnings
        try:
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                out = model(ids, attention_mask=mask, labels=ids)
                gen = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        finally:
            hf_logging.get_logger("transformers").removeHandler(handler)
        return out, gen, {str(w.message) for w in caught} | set(messages)

    (out_s, gen_s, said_s), (out_p, gen_p, said_p) = run(stock), run(patched)
    assert said_p <= said_s, said_p - said_s
    assert torch.allclose(out_p.loss, out_s.loss, rtol=1e-5) and torch.allclose(out_p.logits, out_s.logits, atol=1e-5)
    assert torch.equal(gen_p, gen_s)


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
