"""``apply_truefuse(model, fuse_residual_norm=True)``: each decoder layer's post-attention add and
norm as one ``truefuse.add_rms_norm_hf``. On the CPU in fp32 (the kernels under the interpreter)
the fused model's logits and every gradient are the unfused patched model's bit for bit; layers
that cannot take it are reported, and the option is off by default."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.config import tuning  # noqa: E402
from truefuse.integrations.huggingface import (  # noqa: E402
    apply_truefuse,
    residual_norm,  # noqa: E402
    unpatch_truefuse,
)

FUSED = "truefuse.add_rms_norm_hf (post-attention add + norm: stock bits)"
KERNEL_IDS = (2, 6)  # tests/hf/test_patch.py's: the interpreter runs a program per row


def _ids(seed=1, shape=KERNEL_IDS):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _pair(model_type, **kw):
    """The patched model without the fusion and with it (the same weights)."""
    unfused = tiny_model(model_type)
    fused = copy.deepcopy(unfused)
    apply_truefuse(unfused, **kw)
    report = apply_truefuse(fused, fuse_residual_norm=True, **kw)
    return unfused, fused, report


def _step(model, ids, labels):
    model.zero_grad()
    out = model(ids, labels=labels) if labels is not None else model(ids)
    loss = out.loss if labels is not None else out.logits.square().mean()
    loss.backward()
    logits = None if out.logits is None else out.logits.detach()  # the fused loss builds none
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_fused_model_is_the_unfused_patched_model_bit_for_bit(model_type):
    """Logits (no loss patch, so they are built) and every parameter's gradient, fp32 on the CPU."""
    if torch.cuda.is_available():
        pytest.skip("the GPU's fused backward rounds once where autograd rounds twice: bounded there")
    unfused, fused, report = _pair(model_type, linear_cross_entropy=False)
    assert sum(n for (_, how), n in report.replaced.items() if how == FUSED) == 2
    assert all(type(layer).__name__.endswith("FusedAddNorm") for layer in fused.model.layers)
    ids = _ids()
    with tuning(hf_norm_stock_numel=1):
        (la, _, ga), (lb, _, gb) = _step(unfused, ids, None), _step(fused, ids, None)
    assert torch.equal(la, lb), (la - lb).abs().max()
    assert ga.keys() == gb.keys()
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def test_fused_model_with_the_loss_and_checkpointing():
    """With the fused loss and gradient checkpointing (each layer run again in the backward): the
    loss and gradients of the unfused patched model under the same checkpointing, bit for bit."""
    unfused, fused, _ = _pair("llama")
    runs = []
    for m in (unfused, fused):
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        enable()
        m.train()
        calls = []
        m.model.layers[0].self_attn.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        labels = _ids(2)
        labels[0, :2] = -100
        runs.append(_step(m, _ids(), labels)[1:])
        assert len(calls) == 2  # the layer ran again in the backward: checkpointed
    (la, ga), (lb, gb) = runs
    assert torch.equal(la, lb)
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def test_off_by_default_and_unpatch():
    model = tiny_model("llama")
    report = apply_truefuse(model)
    assert FUSED not in {how for _, how in report.replaced}
    assert not any(type(layer).__name__.endswith("FusedAddNorm") for layer in model.model.layers)
    apply_truefuse(model, fuse_residual_norm=True)  # a second call adds it
    assert all(type(layer).__name__.endswith("FusedAddNorm") for layer in model.model.layers)
    unpatch_truefuse(model)
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)


def test_gemma_layers_are_left_with_the_reason():
    """Gemma norms the attention output before its add: no such statements in its layer."""
    report = apply_truefuse(tiny_model("gemma2"), fuse_residual_norm=True)
    left = {why for (_, why), n in report.left.items() if why.startswith("fuse_residual_norm")}
    assert left and all("norm style 'gemma'" in why for why in left), report.left


def test_needs_the_stock_bits_norms():
    with pytest.raises(ValueError, match="fuse_residual_norm=True needs rms_norm=True and stock_norm_bits=True"):
        apply_truefuse(tiny_model("llama"), fuse_residual_norm=True, stock_norm_bits=False)


def test_a_forward_without_the_statements_is_refused():
    """A layer class whose forward does not hold the three statements once is not recompiled."""

    class Other(torch.nn.Module):
        def forward(self, hidden_states):
            residual = hidden_states
            hidden_states = residual + hidden_states
            return self.post_attention_layernorm(hidden_states)

    assert "0 times" in residual_norm.fused_forward(Other)


def test_batch_invariant_mode_is_entered_by_the_fused_layers():
    """With ``batch_invariant=True`` too, the fused layers enter the model's mode themselves (the
    class swap of ``batch_invariant.py`` is theirs): a layer called alone runs in it."""
    import truefuse

    model = tiny_model("llama")
    apply_truefuse(model, fuse_residual_norm=True, batch_invariant=True, linear_cross_entropy=False)
    layer = model.model.layers[0]
    assert type(layer).__name__.endswith("FusedAddNorm") and "_truefuse_bi_mode" in layer.__dict__
    seen = []
    layer.mlp.register_forward_pre_hook(lambda *a: seen.append(truefuse.is_batch_invariant()))
    with torch.no_grad():
        model(_ids(shape=(1, 3)))
        h = torch.randn(1, 3, 32)
        pos = torch.arange(3)[None]
        layer(h, position_embeddings=model.model.rotary_emb(h, pos), position_ids=pos)
    assert seen == [True, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_model_forward_is_the_unfused_bits_cuda():
    """bf16 on the GPU (the Triton kernel, not the interpreter): the fused model's logits are the
    unfused patched model's bit for bit (the forward is the bf16 sum, then the norm of that sum);
    its gradients, rounded once where autograd rounds twice, within 2% of the largest."""
    from truefuse.demo.parity_cli import build

    unfused = build("llama", 2, 256, 32000, torch.bfloat16, torch.device("cuda"), 0)
    fused = copy.deepcopy(unfused)
    apply_truefuse(unfused, linear_cross_entropy=False)
    apply_truefuse(fused, fuse_residual_norm=True, linear_cross_entropy=False)
    ids = _ids(shape=(2, 128)).cuda()
    (la, _, ga), (lb, _, gb) = _step(unfused, ids, None), _step(fused, ids, None)
    assert torch.equal(la, lb), (la - lb).abs().max()
    for name in ga:
        scale = ga[name].abs().max().float()
        assert (ga[name].float() - gb[name].float()).abs().max() <= 0.02 * scale, name


class _Adds(torch.utils._python_dispatch.TorchDispatchMode):
    """Adds over a (batch, seq, hidden) tensor."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden, self.n = hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        a = args[0] if args else None
        if func.__name__.split(".")[0] in ("add", "add_") and isinstance(a, torch.Tensor) and a.dim() == 3:
            self.n += a.shape[-1] == self.hidden
        return func(*args, **(kwargs or {}))


def test_each_layer_runs_three_adds_fewer_and_hooked_norms_still_run():
    """Three of the unfused step's adds over the hidden states a layer: the post-attention add
    (forward) and both norms' residual-gradient adds (backward; the first norm's through
    ``add_rms_norm_hf(None, ...)``). A hook on a norm module keeps its module call (and the unfused
    statements)."""
    from truefuse.ops.norm.norm import use_kernel

    if not use_kernel(torch.empty(1, 32)):  # a GPU machine runs this CPU model without the interpreter
        pytest.skip("the norm kernels do not run on the CPU here (TRITON_INTERPRET unset): the reference path fuses nothing")
    unfused, fused, _ = _pair("llama", linear_cross_entropy=False)
    counts = []
    for m in (unfused, fused):
        mode = _Adds(m.config.hidden_size)
        with tuning(hf_norm_stock_numel=1), mode:
            _step(m, _ids(), None)
        counts.append(mode.n)
    layers = len(fused.model.layers)
    assert counts[0] - counts[1] == 3 * layers, counts  # forward: 1 a layer; backward: 2
    calls = []
    fused.model.layers[1].input_layernorm.register_forward_hook(lambda *a: calls.append("input"))
    fused.model.layers[1].post_attention_layernorm.register_forward_pre_hook(lambda *a: calls.append("post"))
    with tuning(hf_norm_stock_numel=1):
        la, lb = _step(unfused, _ids(), None)[0], _step(fused, _ids(), None)[0]
    assert calls == ["input", "post"]
    assert torch.equal(la, lb)
