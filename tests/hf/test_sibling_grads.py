"""``apply_truefuse(model, fuse_sibling_grads=True)``: each attention's q/k/v and each MLP's gate/up
as one ``truefuse.sibling_linears`` call while training. The loss is the unfused patched model's
bit for bit, weight gradients close, and the backward runs three adds over the hidden states fewer
a decoder layer; no-grad calls, gradient checkpointing, a LoRA model and a mismatched call keep
the stock path's answer. In batch-invariant mode the group keeps the routed linears' outputs and
each row's gradient its own."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import truefuse  # noqa: E402
from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse, sibling_grads, unpatch_truefuse  # noqa: E402

HIDDEN = 32


def _ids(seed=1, shape=(2, 6)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _pair(model_type="llama", **kw):
    plain = tiny_model(model_type)
    fused = copy.deepcopy(plain)
    apply_truefuse(plain, **kw)
    report = apply_truefuse(fused, fuse_sibling_grads=True, **kw)
    return plain, fused, report


class _Adds(TorchDispatchMode):
    """Adds (out of place or in place) over a (batch, seq, hidden) tensor."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.n = collections.Counter()
        self.hidden = hidden

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        t = args[0] if args else None
        if name in ("add", "add_") and isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == self.hidden:
            self.n[name] += 1
        return func(*args, **(kwargs or {}))


def _step(model, ids, count=False):
    model.zero_grad(set_to_none=True)
    mode = _Adds()
    with mode if count else torch.enable_grad():
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, sum(mode.n.values())


def _close(ga, gb):
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_loss_bitwise_gradients_close_and_three_adds_fewer_a_layer(model_type):
    plain, fused, report = _pair(model_type)
    layers = len(fused.model.layers)
    how = [(k, n) for k, n in report.replaced.items() if k[1].startswith("truefuse.sibling_linears")]
    assert sorted(n for _, n in how) == [layers, layers], report
    la, ga, adds_a = _step(plain, _ids(), count=True)
    lb, gb, adds_b = _step(fused, _ids(), count=True)
    assert torch.equal(la, lb)
    assert adds_a - adds_b == 3 * layers, (adds_a, adds_b)
    _close(ga, gb)
    if model_type == "qwen2":  # q/k/v biases: their gradients are torch's own sums of the same output gradients
        attn = fused.model.layers[-1].self_attn
        assert attn.q_proj.bias is not None and gb["model.layers.1.self_attn.q_proj.bias"] is not None


def test_no_grad_calls_run_f_linear_and_keep_nothing():
    plain, fused, _ = _pair()
    with torch.no_grad():
        a = plain(_ids()).logits
        b = fused(_ids()).logits
    assert torch.equal(a, b)
    members = [m for m in fused.modules() if type(m) is sibling_grads.member_class()]
    assert members and not any(sibling_grads._KEPT in m.__dict__ for m in members)


def test_a_call_that_does_not_match_the_kept_output_runs_its_own_product():
    _, fused, _ = _pair()
    attn = fused.model.layers[0].self_attn
    x = torch.randn(2, 3, HIDDEN, requires_grad=True)
    q = attn.q_proj(x)  # keeps k and v for x
    other = torch.randn(2, 3, HIDDEN, requires_grad=True)
    k = attn.k_proj(other)
    torch.testing.assert_close(k, torch.nn.functional.linear(other, attn.k_proj.weight), rtol=0, atol=0)
    with torch.no_grad():
        x.mul_(2)  # a write since the group's call: v's kept output is stale
    v = attn.v_proj(x)
    assert torch.equal(v, torch.nn.functional.linear(x, attn.v_proj.weight))
    assert q.shape[-1] == attn.q_proj.out_features


# hidden 128: this CPU's fp32 GEMMs give a row other bits at other row counts from hidden 64 up
# (tests/hf/test_batch_invariant_models.py), so a sum that is not batch-invariant shows
WIDE = {"num_hidden_layers": 1, "hidden_size": 128, "intermediate_size": 256}


def _bi_pair():
    plain = tiny_model("llama", **WIDE)
    fused = copy.deepcopy(plain)
    apply_truefuse(plain, batch_invariant=True, linear_cross_entropy=False)
    apply_truefuse(fused, batch_invariant=True, linear_cross_entropy=False, fuse_sibling_grads=True)
    return plain, fused


def test_batch_invariant_mode_sums_in_its_gemms(torch_paths):
    """Batch-invariant mode's group: the loss and every output the routed linears' bits, the MLP's
    weight gradients of the last layer too (their output gradients and inputs are the same
    tensors), three adds fewer a layer, the other gradients close."""
    plain, fused = _bi_pair()
    with torch.no_grad():
        assert torch.equal(plain(_ids()).logits, fused(_ids()).logits)
    adds = {}
    for name, model in (("plain", plain), ("fused", fused)):
        model.zero_grad(set_to_none=True)
        mode = _Adds(WIDE["hidden_size"])
        with mode:
            loss = model(_ids(), labels=_ids(), use_cache=False).loss
            loss.backward()
        adds[name] = (loss.detach(), sum(mode.n.values()))
    assert torch.equal(adds["plain"][0], adds["fused"][0])
    assert adds["plain"][1] - adds["fused"][1] == 3 * WIDE["num_hidden_layers"], adds
    mlp_a, mlp_b = plain.model.layers[-1].mlp, fused.model.layers[-1].mlp
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(mlp_a, proj).weight.grad, getattr(mlp_b, proj).weight.grad), proj
    ga = {n: p.grad for n, p in plain.named_parameters()}
    gb = {n: p.grad for n, p in fused.named_parameters()}
    _close(ga, gb)
    with truefuse.batch_invariant():
        y = fused.model.layers[0].self_attn.q_proj(torch.randn(1, 2, WIDE["hidden_size"], requires_grad=True))
    assert type(y.grad_fn).__name__ == "BatchInvariantSiblingLinearsBackward"


def test_batch_invariant_mode_keeps_a_sequence_gradient_its_own(torch_paths):
    """The input gradient summed in batch-invariant GEMMs keeps each row's bits: a sequence's
    embedding gradient alone and inside a batch of eight are equal bit for bit. One-token
    sequences: this CPU's BLAS gives a one-row product other bits than the same row among 4 or
    more (a vector product); with torch's ``mm``/``addmm_`` sum (fast mode's) the check fails."""
    _, fused = _bi_pair()
    emb = fused.get_input_embeddings()
    ids = torch.randint(0, VOCAB, (8, 1), generator=torch.Generator().manual_seed(3))
    g = torch.randn(8, 1, VOCAB, generator=torch.Generator().manual_seed(4))

    def embeds_grad(rows):
        x = emb(ids[rows]).detach().requires_grad_()
        (fused(inputs_embeds=x, use_cache=False).logits * g[rows]).sum().backward()
        return x.grad

    batch = embeds_grad(slice(0, 8))
    for i in range(3):
        assert torch.equal(embeds_grad(slice(i, i + 1))[0], batch[i]), i


@pytest.mark.parametrize("mode", ["fast", "bi"])
def test_gradient_checkpointing_gives_the_same_gradients(mode, request):
    """TRL's default: the recomputed layer's group runs again as it ran (batch-invariant: the mode
    read per call), so the gradients are those without checkpointing, bit for bit."""
    if mode == "bi":
        request.getfixturevalue("torch_paths")
    fused = _pair()[1] if mode == "fast" else _bi_pair()[1]
    ref = copy.deepcopy(fused)
    fused.gradient_checkpointing_enable()
    fused.train()
    ref.train()
    la, ga, _ = _step(ref, _ids())
    lb, gb, _ = _step(fused, _ids())
    assert torch.equal(la, lb)
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


def test_lora_after_the_patch_still_fuses_its_base_layers():
    peft = pytest.importorskip("peft")
    plain, fused, _ = _pair()
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    plain = peft.get_peft_model(plain, peft.LoraConfig(**cfg))
    fused = peft.get_peft_model(fused, peft.LoraConfig(**cfg))
    fused.load_state_dict(plain.state_dict())
    la, ga, adds_a = _step(plain, _ids(), count=True)
    lb, gb, adds_b = _step(fused, _ids(), count=True)
    assert torch.equal(la, lb)
    # the first layer's q/k/v input needs no gradient (frozen embedding and norm): nothing to sum there
    assert adds_a - adds_b == 3 * len(plain.base_model.model.model.layers) - 2, (adds_a, adds_b)
    _close(ga, gb)


def test_batch_invariant_lora_fuses_its_base_layers(torch_paths):
    """TRL's RL recipe: a batch-invariant model, then PEFT's LoRA on q/v/up. The base layers' group
    runs batch-invariant (the loss the unfused BI model's bits), the adapters' F.linear stay
    routed, the adapters' gradients close to the unfused run's."""
    peft = pytest.importorskip("peft")
    plain, fused = _bi_pair()
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    plain = peft.get_peft_model(plain, peft.LoraConfig(**cfg))
    fused = peft.get_peft_model(fused, peft.LoraConfig(**cfg))
    fused.load_state_dict(plain.state_dict())
    la, ga, _ = _step(plain, _ids())
    lb, gb, _ = _step(fused, _ids())
    assert torch.equal(la, lb)
    assert ga and ga.keys() == gb.keys() and all("lora_" in n for n in gb)
    _close(ga, gb)
    seen = []
    base = fused.base_model.model.model.layers[0].mlp.up_proj.base_layer
    handle = base.register_forward_hook(lambda m, a, out: seen.append(type(out.grad_fn).__name__))
    try:
        _step(fused, _ids())
    finally:
        handle.remove()
    assert seen == ["BatchInvariantSiblingLinearsBackward"], seen


def test_unpatch_gives_the_stock_linear_back():
    _, fused, _ = _pair()
    unpatch_truefuse(fused)
    proj = fused.model.layers[0].self_attn.q_proj
    assert type(proj) is torch.nn.Linear and sibling_grads._GROUP not in proj.__dict__


def test_a_second_patch_keeps_one_group_a_module():
    _, fused, _ = _pair()
    report = apply_truefuse(fused, fuse_sibling_grads=True)
    assert sum(n for k, n in report.replaced.items() if k[1].startswith("truefuse.sibling_linears")) == 4
    _step(fused, _ids())


def test_compiled_backward_sums_in_the_gemm_and_keeps_nothing():
    """Under torch.compile (fullgraph, AOT autograd): the MLP's backward graph has an ``addmm``
    where the unfused one has an ``add``, the gradients are eager's, and no output stays kept."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    ops = {}
    for fuse in (False, True):
        model = tiny_model("llama")
        apply_truefuse(model, fuse_sibling_grads=fuse)
        mlp = model.model.layers[0].mlp
        x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3), requires_grad=True)
        eager = torch.autograd.grad(mlp(x).square().sum(), [x, mlp.gate_proj.weight])
        graphs.clear()
        torch._dynamo.reset()
        y = torch.compile(mlp, backend=backend, fullgraph=True)(x)
        got = torch.autograd.grad(y.square().sum(), [x, mlp.gate_proj.weight])
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        ops[fuse] = collections.Counter(str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function")
        assert getattr(mlp.up_proj, sibling_grads._KEPT, None) is None
    assert ops[False]["aten.add.Tensor"] == 1 and ops[False]["aten.addmm.default"] == 0, ops[False]
    assert ops[True]["aten.add.Tensor"] == 0 and ops[True]["aten.addmm.default"] == 1, ops[True]
