"""``compile_layers`` (integrations/huggingface/compile.py): each decoder layer of a patched model
compiled on its own trains as the eager patched model does, and the demo's ``--compile-layers``
compiles every run's layers. On the CPU with ``backend="aot_eager"`` (Inductor's C++ build is too
slow for the suite; on a GPU, tests/test_compile.py checks that Inductor launches the kernels)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse, compile_layers  # noqa: E402


def _steps(model, n=3):
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: its norm style and tanh GELU
def test_compiled_layers_train_as_eager(model_type, torch_paths):
    """Dense architectures. The MoE ones compile with graph breaks, not fullgraph: truefuse's experts
    read the routing's group sizes on the host (stock's compile fullgraph; a known gap,
    docs/huggingface.md)."""
    import torch._dynamo.config as dynamo

    torch._dynamo.reset()
    eager = tiny_model(model_type, num_hidden_layers=3)
    apply_truefuse(eager)
    compiled = copy.deepcopy(eager)
    with dynamo.patch(cache_size_limit=2):  # below the layers' need: it must rise
        # fullgraph: a patched layer is one graph (torch 2.11 broke it at the gated MLP's import
        # from transformers' lazy module, modules.py::_activations; torch 2.13 traces that import)
        assert compile_layers(compiled, backend="aot_eager", fullgraph=True) == 3
        assert dynamo.cache_size_limit >= 3 + 8
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    torch._dynamo.reset()
    (le, pe), (lc, pc) = _steps(eager), _steps(compiled)
    torch.testing.assert_close(torch.tensor(lc), torch.tensor(le), rtol=1e-5, atol=0)
    for a, b in zip(pc, pe, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_compile_layers_names_a_model_without_layers():
    with pytest.raises(ValueError, match="compile_layers: Linear has no decoder layers"):
        compile_layers(torch.nn.Linear(2, 2))


def test_demo_compile_layers_compiles_every_run(monkeypatch, tmp_path):
    """The demo's ``compile_layers`` setting: each run's layers compiled after its patch; the curves
    as without it (stock's, and the patched run's within the demo's tolerance of stock)."""
    import truefuse.integrations.huggingface.compile as comp
    from truefuse.demo.train import make_config, run_demo

    calls = []
    real = comp.compile_layers

    def aot_eager(model):
        calls.append(type(model.model.layers[0].mlp).__name__)
        return real(model, backend="aot_eager")

    monkeypatch.setattr(comp, "compile_layers", aot_eager)
    tiny = dict(hidden=32, layers=2, heads=4, kv_heads=2, vocab=300, seq=32, batch=2, steps=3, corpus_bytes=64 << 10)
    peers = {"identity": lambda m: "identity"}
    cache = str(tmp_path / "cache")
    plain = run_demo(make_config("cpu", device="cpu", **tiny), peers, cache_dir=cache, quiet=True)
    cfg = make_config("cpu", device="cpu", compile_layers=True, **tiny)
    result = run_demo(cfg, peers, cache_dir=cache, quiet=True)
    assert calls == ["LlamaMLP", "LlamaMLP"]  # stock and the peer, each once
    for a, b in zip(result.runs, plain.runs, strict=True):
        torch.testing.assert_close(torch.tensor(a.losses), torch.tensor(b.losses), rtol=1e-5, atol=0)


def test_compiled_layer_graph_holds_truefuse_ops(device):
    """What Dynamo captures of a patched decoder layer: truefuse's norm, gated-activation and rope
    ops (Inductor then launches their kernels, design.md §6.7). The rope is reached through a swap
    of the attention module's ``apply_rotary_pos_emb`` for the call (modules.py::_attention_forward):
    torch 2.11's Dynamo does not see that store and traces the stock rope (Inductor fuses it;
    docs/huggingface.md), torch 2.13 sees it.

    On the device the kernels run on: CUDA, or the CPU under the Triton interpreter. On a GPU
    machine's CPU (the interpreter off) every truefuse op takes its PyTorch path, and the graph
    held none of them (an H100: ``ops == set()``). The recording backend gets Dynamo's graph, where
    each op is one call on CUDA too: only AOT autograd, after it, inlines their kernels."""
    from truefuse.ops._launch.triton import triton_runs

    if not triton_runs(torch.empty(0, device=device)):
        pytest.skip("no Triton kernel runs here (CPU without TRITON_INTERPRET=1): truefuse's ops take their PyTorch paths")
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=1).to(device)
    apply_truefuse(model)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model.model.layers[0].compile(backend=record, fullgraph=True)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5)).to(device)
    model(input_ids=ids)  # a training forward: in no_grad mode small norms take the stock chain
    torch._dynamo.reset()
    ops = {
        n.target._overloadpacket._qualified_op_name.split("::")[-1]
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function" and "truefuse" in str(n.target)
    }
    expected = {"rms_norm_hf_fwd", "gated_activation2_fwd"}
    if torch.__version__ >= "2.13":
        expected.add("rope_fwd")
    assert len(graphs) == 1 and expected <= ops, ops


def test_compiled_layer_warns_of_no_lru_cache(monkeypatch):
    """Dynamo warns (``warnings``, once per message and process) of each ``functools.lru_cache``
    wrapper it traces through ("silent incorrectness"): truefuse's launchers read their cached
    config and device properties from plain globals instead, so compiling a patched layer is quiet."""
    import warnings

    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())  # warnings of earlier tests count too
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=1)
    apply_truefuse(model)
    compile_layers(model, backend="eager", fullgraph=True)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids).logits.sum().backward()
    torch._dynamo.reset()
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


def test_batch_invariant_layers_compile_with_inductor(torch_paths):
    """``compile_layers`` with Inductor (its default) on a batch-invariant model, fullgraph: every
    routed ``F.linear`` is a ``truefuse::gemm`` whose optional outputs (pre-activation, bias
    gradient) are None, which Inductor failed to lower ("<built-in function getitem> is not an
    OpOverload", ops/gemm/gemm_op.py::gemm_result_op). One training step: the loss is eager's bits; the
    gradients are bounded, as Inductor compiles the stock ops between truefuse's (and on the CPU,
    the norm's PyTorch expression) into code of its own."""
    torch._dynamo.reset()
    eager = tiny_model("llama", num_hidden_layers=1)
    apply_truefuse(eager, batch_invariant=True)
    compiled = copy.deepcopy(eager)
    compile_layers(compiled, fullgraph=True)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for model in (compiled, eager):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch._dynamo.reset()
    assert torch.equal(*losses), losses
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_compiled_attention_cpu_path_gives_eager_bits(torch_paths):
    """``truefuse.attention``'s PyTorch path under Inductor: one opaque op (ops/attention/attention.py), so
    the output and the gradients are eager's bits (traced, Inductor's own code for its exp and
    sums gave rows 1-ulp differences: a compiled trainer would not match an eager sampler)."""
    import truefuse

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 8, generator=g).requires_grad_() for h in (4, 2, 2))
    outs, grads = [], []
    for fn in (torch.compile(truefuse.attention, fullgraph=True), truefuse.attention):
        out = fn(q, k, v, is_causal=True, enable_gqa=True)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    torch._dynamo.reset()
    assert torch.equal(*outs)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
