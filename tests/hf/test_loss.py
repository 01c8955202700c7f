"""truefuse.integrations.huggingface.loss: the patched *ForCausalLM forward against the stock one.

Tiny random models in fp32 (same weights: the stock model deep-copied, then patched): the loss, every
parameter's gradient, MoE's auxiliary loss, the logits without labels, gradient accumulation with
``num_items_in_batch``, tied embeddings, a frozen lm_head, gradient checkpointing, bad labels.
"""

import copy
import dataclasses
import functools
import warnings

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from truefuse.integrations.huggingface import loss as hf_loss  # noqa: E402
from truefuse.integrations.huggingface.loss import (  # noqa: E402
    causal_lm_forward,
    patch_loss,
    stock_signature,
    supports_loss,
    unpatch_loss,
)

V, H, B, T = 256, 32, 2, 12
COMMON = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="eager",
)


@pytest.fixture(autouse=True)
def _torch_loss_path(request, monkeypatch):
    """On the CPU the loss runs its PyTorch chunk math (``chunk_math``), not the Triton kernel in
    the interpreter (~2 s a call here): the kernel's numerics are tests/test_linear_cross_entropy*'s
    business. Tests asking for the ``kernel_path`` fixture keep the kernel (the interpreter, under
    TRITON_INTERPRET=1). The interpreter off for truefuse's ops, as tests/hf's ``torch_paths`` does
    (the loss is the only truefuse op these models run; the loss's modules read ``triton_runs``)."""
    if "kernel_path" not in request.fixturenames:
        import truefuse.ops._launch.triton as tr

        real = tr.get_config
        monkeypatch.setattr(tr, "get_config", lambda: dataclasses.replace(real(), triton_interpret=False))


def _config(name, **over):
    T_ = transformers
    if name == "llama":
        return T_.LlamaConfig(**COMMON, **over)
    if name == "mistral":
        return T_.MistralConfig(**COMMON, **over)
    if name == "qwen2":
        return T_.Qwen2Config(**COMMON, **over)
    if name == "qwen3":
        return T_.Qwen3Config(**COMMON, head_dim=8, **over)
    if name == "gemma2":
        return T_.Gemma2Config(**COMMON, head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=30.0, **over)
    if name == "gemma3":
        return T_.Gemma3TextConfig(**COMMON, head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=20.0, **over)
    if name == "qwen3_moe":
        kw = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
        kw.update(output_router_logits=True, router_aux_loss_coef=0.1)
        return T_.Qwen3MoeConfig(**COMMON, **{**kw, **over})
    if name == "mixtral":
        kw = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
        return T_.MixtralConfig(**COMMON, **{**kw, **over})
    raise KeyError(name)


CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MOE = ("qwen3_moe", "mixtral")


def _models(name, seed=0, **over):
    """(stock, patched): the same weights, fp32, training mode."""
    torch.manual_seed(seed)
    stock = getattr(transformers, CLASSES[name])(_config(name, **over)).float().train()
    patched = copy.deepcopy(stock)
    assert patch_loss(patched) is True
    return stock, patched


def _batch(seed=1, b=B, t=T):
    """input_ids, attention_mask (the second row right-padded), labels (-100 at the padding and at
    a prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    if b > 1:
        mask[1, -4:] = 0
        labels[1, -4:] = -100  # padding
    return ids, mask, labels


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def _assert_grads_close(got, ref, rtol=1e-4, skip=()):
    assert got.keys() == ref.keys()
    checked = 0
    for n in ref:
        if n in skip:
            continue
        g, r = got[n], ref[n]
        assert (g is None) == (r is None), f"{n}: grad {g is None=} but stock {r is None=}"
        if r is None:
            continue
        err = (g - r).norm().item()
        assert err <= rtol * r.norm().item() + 1e-9, f"{n}: |diff| {err:.3g} against |stock| {r.norm().item():.3g}"
        checked += 1
    assert checked > 0


def _rel(a, b):
    return abs(a.item() - b.item()) / abs(b.item())


# ------------------------------------------------------------------------------------------------
# loss, gradients, MoE aux loss: every class


@pytest.mark.parametrize("name", list(CLASSES))
def test_loss_and_grads_match_stock(name):
    stock, patched = _models(name)
    ids, mask, labels = _batch()
    ref = stock(input_ids=ids, attention_mask=mask, labels=labels)
    out = patched(input_ids=ids, attention_mask=mask, labels=labels)
    assert type(out) is type(ref)
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert out.logits is None  # training, labels given: no (tokens, vocab) logits
    assert _rel(out.loss, ref.loss) <= 1e-5, (out.loss.item(), ref.loss.item())
    if name in MOE:
        assert ref.aux_loss is not None and out.aux_loss is not None
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=0)
        assert len(out.router_logits) == len(ref.router_logits) == 2
        # the aux loss is in the loss, as stock adds it: the cross-entropy alone is not the loss
        ce = patched(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False).loss
        coef = patched.router_aux_loss_coef
        assert _rel(ce + coef * out.aux_loss, out.loss) <= 1e-6 and abs(out.loss.item() - ce.item()) > 1e-4
    ref.loss.backward()
    out.loss.backward()
    _assert_grads_close(_grads(patched), _grads(stock))


@pytest.fixture
def kernel_path():
    """The loss on the Triton kernel where it runs (see ``_torch_loss_path``)."""


def test_loss_and_grads_on_the_kernel(kernel_path):
    """One class with the loss on the Triton kernel (the interpreter on the CPU)."""
    test_loss_and_grads_match_stock("gemma2")


@pytest.mark.parametrize("name", list(CLASSES))
def test_logits_without_labels_match_stock(name):
    stock, patched = _models(name)
    stock.eval(), patched.eval()
    ids, mask, labels = _batch()
    with torch.no_grad():
        for keep in (0, 1):
            ref = stock(input_ids=ids, attention_mask=mask, logits_to_keep=keep)
            out = patched(input_ids=ids, attention_mask=mask, logits_to_keep=keep)
            assert out.loss is None and out.logits.shape == ref.logits.shape
            torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        # eval with labels: the loss, and the logits by default (evaluation loops use them)
        ref = stock(input_ids=ids, attention_mask=mask, labels=labels)
        out = patched(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        assert _rel(out.loss, ref.loss) <= 1e-5
        assert patched(input_ids=ids, labels=labels, return_logits=False).logits is None


def test_softcap_reaches_the_loss():
    """Gemma2's final_logit_softcapping is in the fused loss: without it the loss differs."""
    stock, patched = _models("gemma2")
    ids, mask, labels = _batch()
    with torch.no_grad():
        for m in (stock, patched):  # large logits, so that a cap of 30 bites
            m.lm_head.weight.mul_(40.0)
        ref = stock(input_ids=ids, labels=labels).loss
        out = patched(input_ids=ids, labels=labels).loss
        assert _rel(out, ref) <= 1e-5
        patched.config.final_logit_softcapping = None
        stock.config.final_logit_softcapping = None
        uncapped = stock(input_ids=ids, labels=labels).loss
        assert _rel(patched(input_ids=ids, labels=labels).loss, uncapped) <= 1e-5
        assert _rel(uncapped, ref) > 1e-3


# ------------------------------------------------------------------------------------------------
# gradient accumulation: num_items_in_batch


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_num_items_in_batch_accumulation(name):
    stock, patched = _models(name)
    big = copy.deepcopy(patched)
    ids, _, labels = _batch(seed=3, b=4)
    labels[2, 5:9] = -100
    n_items = int((labels[..., 1:] != -100).sum())
    big_out = big(input_ids=ids, labels=labels)
    big_out.loss.backward()
    total = 0.0
    for sl, n in ((slice(0, 2), torch.tensor(n_items)), (slice(2, 4), n_items)):  # a tensor, then an int
        out = patched(input_ids=ids[sl], labels=labels[sl], num_items_in_batch=n)
        ref = stock(input_ids=ids[sl], labels=labels[sl], num_items_in_batch=n)
        assert _rel(out.loss, ref.loss) <= 1e-5
        out.loss.backward()
        ref.loss.backward()
        total += out.loss.item()
    assert abs(total - big_out.loss.item()) <= 1e-5 * big_out.loss.item()
    _assert_grads_close(_grads(patched), _grads(big))
    _assert_grads_close(_grads(patched), _grads(stock))


def test_shift_labels_and_ignore_index():
    stock, patched = _models("llama")
    ids, _, labels = _batch()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    shift[1, :2] = -100
    ref = stock(input_ids=ids, labels=labels, shift_labels=shift).loss
    out = patched(input_ids=ids, labels=labels, shift_labels=shift).loss
    assert _rel(out, ref) <= 1e-5
    assert _rel(out, patched(input_ids=ids, labels=labels).loss) > 1e-4  # shift_labels is used
    # another ignore_index, for the padding and the ignored tokens alike
    lab7 = torch.where(labels == -100, 7, labels)
    ref = stock(input_ids=ids, labels=lab7, ignore_index=7).loss
    out = patched(input_ids=ids, labels=lab7, ignore_index=7).loss
    assert _rel(out, ref) <= 1e-5


def test_all_labels_ignored_gives_stock_nan():
    """Stock's mean over no counted token is 0 / 0 = NaN with zero gradients; so is the patched one's
    (the op alone gives 0)."""
    stock, patched = _models("llama")
    ids, _, labels = _batch()
    labels[:] = -100
    ref = stock(input_ids=ids, labels=labels).loss
    assert torch.isnan(ref)
    out = patched(input_ids=ids, labels=labels).loss
    assert torch.isnan(out)
    ref.backward(), out.backward()
    assert all(p.grad is None or not p.grad.any() for p in patched.parameters())
    assert any(p.grad is not None for p in patched.parameters())


# ------------------------------------------------------------------------------------------------
# tied embeddings, frozen lm_head, gradient checkpointing, autocast


def test_tied_embeddings():
    stock, patched = _models("llama", tie_word_embeddings=True)
    assert patched.lm_head.weight is patched.model.embed_tokens.weight
    ids, mask, labels = _batch()
    ref = stock(input_ids=ids, attention_mask=mask, labels=labels)
    out = patched(input_ids=ids, attention_mask=mask, labels=labels)
    assert _rel(out.loss, ref.loss) <= 1e-5
    ref.loss.backward()
    out.loss.backward()
    got, want = _grads(patched), _grads(stock)
    assert "lm_head.weight" not in want  # one parameter, named once
    _assert_grads_close(got, want)


def test_frozen_lm_head():
    stock, patched = _models("qwen2")
    for m in (stock, patched):
        m.lm_head.weight.requires_grad_(False)
    ids, mask, labels = _batch()
    ref = stock(input_ids=ids, attention_mask=mask, labels=labels)
    out = patched(input_ids=ids, attention_mask=mask, labels=labels)
    assert _rel(out.loss, ref.loss) <= 1e-5
    ref.loss.backward()
    out.loss.backward()
    assert patched.lm_head.weight.grad is None
    _assert_grads_close(_grads(patched), _grads(stock))


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_gradient_checkpointing(name):
    stock, patched = _models(name)
    # activation_checkpointing_enable: the newer name (transformers 5.2x), gradient_checkpointing_enable before
    enable = getattr(patched, "activation_checkpointing_enable", None) or patched.gradient_checkpointing_enable
    enable()
    calls = []
    patched.model.layers[0].post_attention_layernorm.register_forward_hook(lambda *a: calls.append(1))
    ids, mask, labels = _batch()
    ref = stock(input_ids=ids, attention_mask=mask, labels=labels)
    out = patched(input_ids=ids, attention_mask=mask, labels=labels)
    assert _rel(out.loss, ref.loss) <= 1e-5
    ref.loss.backward()
    out.loss.backward()
    assert len(calls) == 2  # the layer ran again in the backward: checkpointed
    _assert_grads_close(_grads(patched), _grads(stock))


def test_autocast_bf16():
    """Under autocast the head's GEMMs run in bf16, as F.linear's do (the loss in fp32): the loss
    equals stock's, not the fp32 one."""
    stock, patched = _models("llama")
    with torch.no_grad():
        for m in (stock, patched):  # logits of order 1, so that bf16 rounding shows in the loss
            m.lm_head.weight.mul_(50.0)
    ids, mask, labels = _batch()
    fp32 = patched(input_ids=ids, attention_mask=mask, labels=labels).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = stock(input_ids=ids, attention_mask=mask, labels=labels)
        out = patched(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.loss.dtype == torch.float32
    assert _rel(out.loss, ref.loss) <= 1e-5 and _rel(fp32, ref.loss) > 3e-5
    out.loss.backward()
    ref.loss.backward()
    g, r = patched.lm_head.weight.grad, stock.lm_head.weight.grad
    assert g.dtype == torch.float32
    # stock rounds the weight gradient to bf16 before its fp32 cast; the op rounds once (docs/linear.md)
    assert (g - r).norm() <= 5e-3 * r.norm()
    _assert_grads_close(_grads(patched), _grads(stock), rtol=1e-3, skip=("lm_head.weight",))


# ------------------------------------------------------------------------------------------------
# outputs: return_dict, return_logits, generate


def test_return_dict_false_and_return_logits():
    stock, patched = _models("mixtral")
    ids, mask, labels = _batch()
    ref = stock(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    out = patched(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and _rel(out[0], ref[0]) <= 1e-5
    # (loss, aux_loss, router_logits): stock's to_tuple drops the None logits
    assert len(out) == len(ref) - 1
    out = patched(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True)
    torch.testing.assert_close(out.logits, ref[2], rtol=0, atol=0)
    assert _rel(out.loss, ref[0]) <= 1e-5
    # no labels: (aux_loss, logits, past_key_values, router_logits), as stock
    ref = stock(input_ids=ids, attention_mask=mask, return_dict=False)
    out = patched(input_ids=ids, attention_mask=mask, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(ref) == 4
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)


def test_generate_matches_stock():
    stock, patched = _models("gemma2")
    stock.eval(), patched.eval()
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(ids, **kw), stock.generate(ids, **kw))


# ------------------------------------------------------------------------------------------------
# bad labels


def _count_base_calls(model):
    calls = []
    model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def test_bad_labels(monkeypatch):
    _, patched = _models("llama")
    ids, _, labels = _batch()
    calls = _count_base_calls(patched)
    with pytest.raises(ValueError, match=r"labels has shape \(2, 11\) but the model's tokens are \(2, 12\)"):
        patched(input_ids=ids, labels=labels[:, 1:])
    with pytest.raises(TypeError, match="labels must hold class indices"):
        patched(input_ids=ids, labels=labels.float())
    with pytest.raises(ValueError, match="shift_labels has shape"):
        patched(input_ids=ids, labels=labels, shift_labels=labels[:, :5])
    assert not calls  # before the base model ran
    import truefuse.autograd.linear_cross_entropy as lce

    seen = []
    with monkeypatch.context() as mp:
        mp.setattr(lce, "linear_cross_entropy", lambda *a, **k: seen.append(1))
        for bad in (V, V + 7, -5):
            lab = labels.clone()
            lab[1, 4] = bad
            with pytest.raises(ValueError, match=rf"labels holds {bad}, outside \[0, vocab_size={V}\)"):
                patched(input_ids=ids, labels=lab)
    assert not seen  # off CUDA: checked before the loss runs
    lab = labels.clone()
    lab[1, 0] = V  # the first label is shifted away: never a target, as stock
    patched(input_ids=ids, labels=lab)


def test_bad_labels_from_the_loss_check(monkeypatch):
    """On CUDA there is no early range check (it would sync the host): the loss's own check raises
    and the error is renamed to the labels. Played on the CPU by skipping the early check."""
    import truefuse.autograd.linear_cross_entropy as lce

    _, patched = _models("llama")
    ids, _, labels = _batch()
    seen = []
    real = lce.linear_cross_entropy

    def spy(*a, **k):
        seen.append(1)
        return real(*a, **k)

    monkeypatch.setattr(lce, "linear_cross_entropy", spy)
    monkeypatch.setattr(hf_loss, "_early_range_check", lambda t: False)
    labels[0, 7] = V + 3
    with pytest.raises(ValueError, match=rf"labels holds {V + 3}, outside \[0, vocab_size={V}\)") as e:
        patched(input_ids=ids, labels=labels)
    assert seen and "target holds" in str(e.value.__cause__)


# ------------------------------------------------------------------------------------------------
# patching


def test_patch_unpatch_instance():
    stock, patched = _models("llama")
    assert patch_loss(patched) is False  # idempotent
    assert patched.forward.func is causal_lm_forward
    ids, _, labels = _batch()
    assert patched(input_ids=ids, labels=labels).logits is None
    assert type(patched).forward is type(stock).forward  # the class is untouched
    assert stock(input_ids=ids, labels=labels).logits is not None
    assert unpatch_loss(patched) is True and unpatch_loss(patched) is False
    assert "forward" not in patched.__dict__
    assert patched(input_ids=ids, labels=labels).logits is not None  # stock again
    _, moe = _models("qwen3_moe")
    assert moe.forward.func is causal_lm_forward
    # positional, as the installed stock MoE signature: output_router_logits before logits_to_keep
    # (transformers 5.0 also has cache_position between them)
    names = list(stock_signature(type(moe)).parameters)[1:]
    args = [None] * names.index("logits_to_keep") + [1]
    args[names.index("output_router_logits")] = False
    out = moe(ids, *args[1:])
    assert out.aux_loss is None and out.logits.shape == (B, 1, V)


def test_patched_instance_pickles_and_copies():
    """torch.save / load and deepcopy keep the patched forward, bound to the new model."""
    import inspect
    import io

    _, patched = _models("mixtral")
    params = list(inspect.signature(patched.forward).parameters)
    assert params[:2] == ["input_ids", "attention_mask"] and "output_router_logits" in params and "self" not in params
    buf = io.BytesIO()
    torch.save(patched, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(patched)
    ids, _, labels = _batch()
    ref = patched(input_ids=ids, labels=labels)
    for m in (again, twin):
        assert m.forward.args[0] is m and patch_loss(m) is False
        out = m(input_ids=ids, labels=labels)
        assert out.logits is None and torch.equal(out.loss, ref.loss)
        assert unpatch_loss(m) is True and m(input_ids=ids, labels=labels).logits is not None


def test_patch_unpatch_class():
    class Sub(transformers.LlamaForCausalLM):
        pass

    torch.manual_seed(0)
    m = Sub(_config("llama")).train()
    ids, _, labels = _batch()
    stock_loss = m(input_ids=ids, labels=labels).loss
    assert patch_loss(Sub) is True and patch_loss(Sub) is False
    assert transformers.LlamaForCausalLM.forward is not Sub.forward
    assert supports_loss(Sub) is None and supports_loss(m) is None
    out = m(input_ids=ids, labels=labels)
    assert out.logits is None and _rel(out.loss, stock_loss) <= 1e-5
    assert unpatch_loss(Sub) is True and unpatch_loss(Sub) is False
    assert "forward" not in Sub.__dict__ and m(input_ids=ids, labels=labels).logits is not None


def test_supports_loss():
    for name, cls in CLASSES.items():
        assert supports_loss(getattr(transformers, cls)) is None, name
    assert "not supported" in supports_loss(transformers.GPT2LMHeadModel)

    class Custom(transformers.LlamaForCausalLM):
        def forward(self, *a, **k):
            return super().forward(*a, **k)

    assert "overridden by Custom" in supports_loss(Custom)
    with pytest.raises(TypeError, match="overridden"):
        patch_loss(Custom)


def test_fallback_to_stock_loss_function():
    """A replaced model.loss_function is honoured (stock path, with a warning)."""
    stock, patched = _models("llama")
    ids, _, labels = _batch()
    patched.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().square().mean()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = patched(input_ids=ids, labels=labels)
    assert any("loss_function was replaced" in str(x.message) for x in w)
    ref = stock(input_ids=ids).logits.float().square().mean()
    assert _rel(out.loss, ref) <= 1e-6 and out.logits is not None


def test_fallback_for_a_head_that_hides_its_weight():
    """A head with a forward hook that is not FSDP2's own, a module backward hook, or a forward
    replaced on the instance (as accelerate's hooks do; the last two once unseen): the stock path,
    with the warning (integrations/huggingface/head.py).
    FSDP2's own hooks take the fused path: tests/distributed/test_fsdp.py."""
    stock, patched = _models("llama")
    ids, _, labels = _batch()
    ref = stock(input_ids=ids, labels=labels).loss
    head = patched.lm_head
    handle = head.register_forward_hook(lambda *a: None)
    head_forward = functools.partial(torch.nn.Linear.forward, head)
    cases = (
        (None, "forward hooks other than FSDP2's own"),
        ("backward", "module backward hooks"),
        ("forward", "forward is replaced on the instance"),
    )
    for hide, says in cases:
        if hide == "backward":
            handle.remove()
            handle = head.register_full_backward_hook(lambda *a: None)
        if hide == "forward":
            handle.remove()
            head.forward = head_forward
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = patched(input_ids=ids, labels=labels)
        assert [says in str(x.message) for x in w] == [True], [str(x.message) for x in w]
        assert _rel(out.loss, ref) <= 1e-6 and out.logits is not None


def test_forward_keeps_no_targets_alive(monkeypatch):
    """The shifted targets die with the step: the early range check once cached its answer per
    tensor (``functools.cache``), keeping every step's targets alive for the life of the process."""
    import gc
    import weakref

    _, patched = _models("llama")
    ids, _, labels = _batch()
    refs = []
    real = hf_loss._early_range_check

    def spy(t):
        refs.append(weakref.ref(t))
        return real(t)

    monkeypatch.setattr(hf_loss, "_early_range_check", spy)
    patched(input_ids=ids, labels=labels).loss.backward()
    gc.collect()
    assert refs and all(r() is None for r in refs)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_bad_labels_from_the_check_ahead_of_the_decoder(monkeypatch, path, kernel_path):  # torch: turned off below
    """On CUDA the labels' range check starts before the decoder and is waited for after the loss,
    which then skips its own wait (``targets_checked``: the host keeps its lead over the GPU). Played
    on the CPU: the check ahead must be what raises, the loss's own check being skipped, on the
    kernel path and on the torch path (which indexed the bad label before the check could raise)."""
    import truefuse.ops._launch.triton as tr
    import truefuse.ops.lm_head.linear_cross_entropy as ops_lce

    if path == "torch":  # the interpreter off: the loss's chunks run their PyTorch math
        real_config = tr.get_config
        monkeypatch.setattr(tr, "get_config", lambda: dataclasses.replace(real_config(), triton_interpret=False))

    _, patched = _models("llama")
    ids, _, labels = _batch()
    monkeypatch.setattr(hf_loss, "_early_range_check", lambda t: False)
    monkeypatch.setattr(hf_loss, "_label_check_ahead", lambda labels: True)
    started = []
    real = ops_lce.check_targets

    def spy(t, *a, **k):
        if not ops_lce._CHECKED_BY_CALLER.get():  # a check that runs (the loss's own returns at once under it)
            started.append(tuple(t.shape))
        return real(t, *a, **k)

    monkeypatch.setattr(ops_lce, "check_targets", spy)
    good = patched(input_ids=ids, labels=labels).loss
    assert started == [tuple(labels[..., 1:].shape)]  # the one check, on what the shift keeps
    torch.testing.assert_close(good, _models("llama")[0](input_ids=ids, labels=labels).loss, rtol=1e-5, atol=0)
    labels[0, 7] = V + 3
    with pytest.raises(ValueError, match=rf"labels holds {V + 3}, outside \[0, vocab_size={V}\)"):
        patched(input_ids=ids, labels=labels)
    # the check ahead is the only one: without it no range error of truefuse's (the kernel path, under
    # the CPU interpreter here, reads the bad label as class 0; the torch path fails its own indexing)
    monkeypatch.setattr(ops_lce, "check_targets", lambda *a, **k: lambda: None)
    try:
        patched(input_ids=ids, labels=labels)
    except RuntimeError as err:
        assert "vocab_size" not in str(err), err


@pytest.mark.parametrize("bi", [False, True])
def test_the_forward_imports_nothing(monkeypatch, bi):
    """truefuse's code in a patched forward (with labels: the fused loss; without: the logits)
    imports no transformers module while it runs: Dynamo (torch 2.11, transformers 5.17,
    ``fullgraph=True``) traced a failed ``from transformers... import`` into an AttributeError the
    code's ``except ImportError`` never caught, and could not import a transformers lazy module at
    all ("Bad import result", the output class's module)."""
    import builtins
    import importlib
    import sys

    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse

    model = tiny_model("llama", num_hidden_layers=1)
    apply_truefuse(model, batch_invariant=bi)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids)  # transformers' own lazy imports, once, before the guard
    model.eval()(input_ids=ids)
    seen = []
    real_import, real_module = builtins.__import__, importlib.import_module

    def from_truefuse(name):
        caller = sys._getframe(2).f_code.co_filename
        if name.startswith("transformers") and "/truefuse/" in caller:
            seen.append((name, caller))

    def guard(name, *args, **kwargs):
        from_truefuse(name)
        return real_import(name, *args, **kwargs)

    def guard_module(name, *args, **kwargs):
        from_truefuse(name)
        return real_module(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guard)
    monkeypatch.setattr(importlib, "import_module", guard_module)
    model.train()(input_ids=ids, labels=ids).loss.backward()
    model.eval()(input_ids=ids)
    assert seen == []
    h = torch.randn(2, 5, 3)
    assert torch.equal(hf_loss._slice_to_keep(h, 2), h[:, -2:, :])


@pytest.mark.parametrize("bi", [False, True])
def test_a_training_step_builds_no_cache(bi):
    """A training forward with labels that asks nothing of the cache builds none: stock's default
    (config.use_cache) copies every layer's keys and values into a DynamicCache nobody reads (48.5).
    The loss and every gradient are the bits of the same step with the cache built; asked for
    (``use_cache=True``), out of training, without autograd, or for a tuple output (whose positions a
    dropped field would move), the cache is stock's."""
    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse

    model = tiny_model("llama", num_hidden_layers=2)
    apply_truefuse(model, batch_invariant=bi)
    model.train()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))

    def step(**kw):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, **kw)
        out.loss.backward()
        return out, [p.grad.clone() for p in model.parameters()]

    plain, grads = step()
    cached, grads_cached = step(use_cache=True)
    assert hf_loss._cache_field(type(plain)) and getattr(plain, hf_loss._cache_field(type(plain))) is None
    assert getattr(cached, hf_loss._cache_field(type(cached))) is not None
    assert torch.equal(plain.loss, cached.loss) and all(torch.equal(a, b) for a, b in zip(grads, grads_cached, strict=True))
    with torch.no_grad():
        assert getattr(model(input_ids=ids, labels=ids), hf_loss._cache_field(type(plain))) is not None
    loss, cache = model(input_ids=ids, labels=ids, return_dict=False)  # a tuple keeps stock's fields (training: no logits)
    assert torch.equal(loss, plain.loss) and cache is not None
    model.eval()
    assert getattr(model(input_ids=ids, labels=ids), hf_loss._cache_field(type(plain))) is not None
