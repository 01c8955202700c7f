"""``graph_decode``: ``generate``'s decode steps replayed as CUDA graphs (issue 47.2).

On the CPU the graph engine is a stand-in that keeps a capture's semantics the wrapper relies on
(its outputs are overwritten in place by every later replay; a replay gets its inputs copied into the
captured ones): so these check the wrapper's keys (one capture for a whole ``generate``), its copies
out of the graph's memory, what it leaves eager, and what it sets and restores. On CUDA the real
graphs: the logits are the eager bits, fast and batch-invariant, and the sampler is the trainer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import requires_cuda  # noqa: E402

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse, graph_decode  # noqa: E402

_KW = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def _ids(batch=2, length=5, seed=3):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, **kw):
    with torch.no_grad():
        out = model.generate(ids, **{**_KW, **kw})
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("bi", [False, True])
def test_one_capture_serves_every_decode_step_with_the_eager_bits(fake_cuda, bi):
    """A whole ``generate``: the prefill and one warm-up step eager, one capture, the other decode
    steps replayed; the logits those replays return are the eager ones bit for bit and stay so
    after later replays overwrite the graph's outputs (the wrapper copies them out)."""
    model = tiny_model("llama", num_hidden_layers=2).eval()
    apply_truefuse(model, batch_invariant=bi)
    ids = _ids()
    seq_e, logits_e = _generate(model, ids, cache_implementation="static")
    handle = graph_decode(model)
    seq_g, logits_g = _generate(model, ids)  # graph_decode set the static cache itself
    assert (handle.captures, handle.replays, handle.eager) == (1, 4, 2)  # 6 tokens: prefill, warm-up, capture + 3
    assert torch.equal(seq_e, seq_g) and torch.equal(logits_e, logits_g)
    seq_2, logits_2 = _generate(model, ids)  # the same cache again (generate resets it): no new capture
    assert (handle.captures, len(handle.graphs)) == (1, 1) and handle.replays == 4 + 5
    assert torch.equal(logits_2, logits_e)


def test_a_caches_tensors_are_read_once_and_again_when_rebound(fake_cuda, monkeypatch):
    """Each decode step keys its graph on the cache's tensors and their layout: read once a cache
    (listing every layer's attributes was most of a 16-layer step's host time), read again where a
    tensor was rebound since (a graph's adoption of a new cache does that), so a rebound tensor of
    another shape gets its own graph, never the kept layout's."""
    from truefuse.integrations.huggingface import graphed_decode as gd

    reads = []
    real = gd._cache_tensors
    monkeypatch.setattr(gd, "_cache_tensors", lambda cache: reads.append(cache) or real(cache))
    model = tiny_model("llama", num_hidden_layers=2).eval()
    apply_truefuse(model)
    ids = _ids()
    eager = _generate(model, ids, cache_implementation="static")
    handle = graph_decode(model)
    assert torch.equal(_generate(model, ids)[1], eager[1])
    assert len(reads) == 1, f"the layout was read {len(reads)} times over one generate's 5 decode steps"
    cache = reads[0]
    layer = cache.layers[0]
    keys = layer.keys
    layer.keys = torch.zeros(keys.shape[0], keys.shape[1], keys.shape[2] + 1, keys.shape[3], dtype=keys.dtype)
    step = dict(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, cache_position=torch.tensor([7]))
    with torch.no_grad():
        found = handle._graphable(step)
    assert len(reads) == 2 and found is not None
    assert any(t is layer.keys for _, name, t in found[-1] if name == "keys")  # the rebound tensor, not the one read before
    assert all(found[0] != key for key in handle.graphs), "a rebound tensor of another shape reused a graph's key"
    # a layer object replaced (the same attributes, a longer cache): read again too
    import copy

    layer = cache.layers[1] = copy.copy(cache.layers[1])
    layer.keys = torch.zeros(keys.shape[0], keys.shape[1], keys.shape[2] + 2, keys.shape[3], dtype=keys.dtype)
    with torch.no_grad():
        found = handle._graphable(step)
    assert len(reads) == 3 and any(t is layer.keys for lay, name, t in found[-1] if lay is layer and name == "keys")


def test_a_cache_let_go_of_is_not_kept(fake_cuda):
    """The layout kept across steps holds its cache's tensors only while the cache lives, and none
    after ``remove()``: a cache ``generate`` let go of is freed with it, not kept resident beside the
    next one (transformers 5.25 builds a new one a call)."""
    import gc
    import weakref

    model = tiny_model("llama", num_hidden_layers=2).eval()
    apply_truefuse(model)
    handle = graph_decode(model)
    ids = _ids()
    _generate(model, ids)  # generate's own cache, let go of when it returns
    assert handle._layout is not None
    kept = [weakref.ref(t) for _, _, t in handle._layout.held]
    handle.graphs.clear()  # what an evicted graph leaves: no graph holds the cache's tensors
    gc.collect()
    assert handle._layout is None and all(r() is None for r in kept), "a freed cache's tensors are still held"
    _generate(model, ids)
    assert handle._layout is not None
    handle.remove()
    assert handle._layout is None


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text"])
def test_other_architectures_the_eager_bits(fake_cuda, model_type):
    """Qwen3, the experts of Qwen3-MoE, and sliding-window layers (Mistral, Gemma 2 and 3: a Python
    count of their tokens picks their update's branch, which a replay neither advances nor reads,
    transformers 5.17-5.25): one capture a ``generate``, the second ``generate``'s cache adopted,
    the eager bits, and each window's count what the eager steps leave."""
    model = tiny_model(model_type, num_hidden_layers=2).eval()
    apply_truefuse(model, batch_invariant=True)
    ids = _ids()
    eager = _generate(model, ids, cache_implementation="static", disable_compile=True)
    handle = graph_decode(model)
    for _ in range(2):
        with torch.no_grad():
            out = model.generate(ids, **_KW)
        seq, logits = out.sequences, torch.stack(out.logits, 1)
        assert torch.equal(seq, eager[0]) and torch.equal(logits, eager[1])
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        counts = {getattr(layer, "cumulative_length_int", None) for layer in cache.layers} - {None}
        assert counts <= {5 + 5}, counts  # the prompt and 5 of the 6 new tokens
    assert (handle.captures, handle.replays) == (1, 4 + 5), (handle.captures, handle.replays)


def test_a_full_window_runs_eagerly(fake_cuda):
    """A sliding window that fills during ``generate`` (8 tokens, a prompt of 5, 6 new): its updates
    write in place until then, graphed (the window's count advanced after each replay), and roll the
    window after (uploading a host-made index, not capturable): those steps run eagerly. The eager
    bits throughout."""
    model = tiny_model("mistral", num_hidden_layers=2, sliding_window=8).eval()
    apply_truefuse(model, batch_invariant=True)
    ids = _ids()
    eager = _generate(model, ids, cache_implementation="static", disable_compile=True)
    handle = graph_decode(model)
    seq, logits = _generate(model, ids)
    assert torch.equal(seq, eager[0]) and torch.equal(logits, eager[1])
    # prefill, warm-up (5 -> 6 tokens), capture (-> 7), one replay (-> 8: full), two eager rolls
    assert (handle.captures, handle.replays, handle.eager) == (1, 2, 4), (handle.captures, handle.replays, handle.eager)


def test_a_peft_model_graphs_its_base_model(fake_cuda):
    """A PEFT LoRA model: ``graph_decode`` graphs the transformers model inside (PEFT's ``generate``
    reaches its forward), with the adapters in the graph; the eager bits, one capture."""
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", num_hidden_layers=2).eval()
    apply_truefuse(model, batch_invariant=True)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, lora).eval()
    ids = _ids()
    eager = _generate(model, ids, cache_implementation="static", disable_compile=True)
    handle = graph_decode(model)
    seq, logits = _generate(model, ids)
    assert torch.equal(seq, eager[0]) and torch.equal(logits, eager[1])
    assert (handle.captures, handle.replays) == (1, 4)
    assert handle.model is model.get_base_model()


def test_the_cache_returned_is_this_generates(fake_cuda):
    """A replay's output names the capture's cache object; the wrapper hands back the call's own
    (generate passes the returned cache to the next step and to its caller)."""
    model = tiny_model("llama", num_hidden_layers=1).eval()
    graph_decode(model)
    caches = []
    for _ in range(2):
        with torch.no_grad():
            out = model.generate(_ids(), **_KW)
        caches.append(getattr(out, "past_key_values", None) or getattr(out, "cache", None))
    assert caches[0] is not None and caches[0] is not caches[1]
    assert int(caches[1].get_seq_length()) == 5 + 5  # the prompt and 5 of the 6 new tokens cached


def test_each_batch_size_its_graph_the_least_recent_freed(fake_cuda):
    """Batch 1 (where ``generate`` passes ``logits_to_keep``, read from the forward's signature: the
    wrapper keeps it), batch 3, batch 1 again with room for one graph: three captures, one kept,
    every run the eager bits."""
    model = tiny_model("llama", num_hidden_layers=1).eval()
    eager = {b: _generate(model, _ids(b), cache_implementation="static", disable_compile=True) for b in (1, 3)}
    handle = graph_decode(model, max_graphs=1)
    for b in (1, 3, 1):
        seq, logits = _generate(model, _ids(b))
        assert torch.equal(seq, eager[b][0]) and torch.equal(logits, eager[b][1])
    assert handle.captures == 3 and len(handle.graphs) == 1


def test_graphs_beyond_max_graphs_are_freed(fake_cuda):
    model = tiny_model("llama", num_hidden_layers=1).eval()
    handle = graph_decode(model, max_graphs=2)
    for batch in (1, 2, 3, 3):
        _generate(model, _ids(batch))
    assert handle.captures == 3 and len(handle.graphs) == 2


def test_outputs_returned_are_not_the_graphs_memory(fake_cuda):
    """Direct decode-step calls: a replay rewrites the graph's outputs in place, so each call's
    logits must be a copy, unchanged by the calls after it."""
    from transformers import StaticCache

    model = tiny_model("llama", num_hidden_layers=1).eval()
    graph_decode(model)
    cache = StaticCache(config=model.config, max_cache_len=12)
    ids = _ids(2, 4)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        kept = []
        for _ in range(4):  # warm-up, capture, two replays
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, past_key_values=cache)
            kept.append((out.logits, out.logits.clone()))
    assert all(torch.equal(a, b) for a, b in kept)


def test_autocast_gets_its_own_graph(fake_cuda):
    """A step recorded without autocast replays without its casts: autocast on (accelerate's bf16
    runs TRL's generate so) must capture its own graph. (A bf16 model: an fp32 one under bf16
    autocast has fp32 keys and bf16 values, which transformers 5.17's static cache cannot hold.)
    Autocast itself, not a patched ``torch.is_autocast_enabled``: a patched one leaked into
    transformers' rotary embedding, whose ``torch.autocast(enabled=False)`` block restored autocast
    *on* at its exit, for every later test of the process."""
    model = tiny_model("llama", num_hidden_layers=1).eval().to(torch.bfloat16)
    handle = graph_decode(model)
    _generate(model, _ids())
    with torch.autocast("cpu", torch.bfloat16):
        _generate(model, _ids())
    assert handle.captures == 2 and not torch.is_autocast_enabled("cpu")


def test_what_stays_eager(fake_cuda):
    """A dynamic cache (its shapes grow each step), autograd on, positional arguments: eager."""
    model = tiny_model("llama", num_hidden_layers=1).eval()
    handle = graph_decode(model)
    _generate(model, _ids(), cache_implementation="dynamic")
    assert handle.captures == 0 and handle.replays == 0 and handle.eager == 6
    out = model(_ids())  # a training-style forward: autograd on
    assert out.logits.requires_grad and handle.replays == 0


def test_remove_restores_forward_and_generation_config(fake_cuda):
    model = tiny_model("llama", num_hidden_layers=1).eval()
    gc = model.generation_config
    before = (gc.cache_implementation, gc.disable_compile)
    handle = graph_decode(model)
    assert (gc.cache_implementation, gc.disable_compile) == ("static", True)
    assert "forward" in model.__dict__
    handle.remove()
    assert "forward" not in model.__dict__ and (gc.cache_implementation, gc.disable_compile) == before
    # wrapped since (accelerate's autocast wraps an instance forward): removing leaves the plain forward inside
    handle = graph_decode(model)
    inner = model.forward
    model.forward = lambda *a, **k: inner(*a, **k)
    handle.remove()
    _generate(model, _ids(), cache_implementation="static")
    assert handle.captures == 0 and handle.replays == 0


def test_refusals_name_the_argument():
    model = tiny_model("llama", num_hidden_layers=1).eval()
    with pytest.raises(ValueError, match="model has parameters on cpu"):
        graph_decode(model)  # the real device check: CUDA graphs record GPU kernels
    with pytest.raises(TypeError, match="model must be"):
        graph_decode(torch.nn.Linear(2, 2))
    model.lm_head.to("meta")  # a model spread over devices (device_map="auto" across GPUs)
    with pytest.raises(ValueError, match="model has parameters on 2 devices"):
        graph_decode(model)


def test_bad_arguments_and_a_second_call_refused(fake_cuda):
    model = tiny_model("llama", num_hidden_layers=1).eval()
    for kw, name in (({"warmup": 0}, "warmup"), ({"max_graphs": 0}, "max_graphs"), ({"warmup": True}, "warmup")):
        with pytest.raises(ValueError, match=name):
            graph_decode(model, **kw)
    graph_decode(model)
    with pytest.raises(ValueError, match="already graphed"):
        graph_decode(model)


@requires_cuda
@pytest.mark.parametrize("bi", [False, True])
def test_graphed_generate_is_the_eager_bits_cuda(bi):
    """Real CUDA graphs on a bf16 Llama: the graphed ``generate``'s tokens and logits are the eager
    static-cache run's bits, fast and batch-invariant; in BI mode the sampler's log-probs
    (``generate_log_probs``) are the trainer's (``model_log_probs``) bit for bit."""
    from truefuse.demo.parity_cli import build
    from truefuse.integrations.huggingface.log_probs import generate_log_probs, model_log_probs

    model = build("llama", 2, 256, 32000, torch.bfloat16, torch.device("cuda"), 0)
    model.config._attn_implementation = "sdpa"
    apply_truefuse(model, batch_invariant=bi)
    ids = torch.randint(1, 32000, (3, 16), generator=torch.Generator().manual_seed(2)).cuda()
    kw = {**_KW, "max_new_tokens": 8, "min_new_tokens": 8}
    with torch.no_grad():
        eager = model.generate(ids, cache_implementation="static", disable_compile=True, **kw)
        handle = graph_decode(model)
        graphed = model.generate(ids, **kw)
    assert handle.captures == 1 and handle.replays == 6, (handle.captures, handle.replays)
    assert torch.equal(eager.sequences, graphed.sequences)
    assert torch.equal(torch.stack(eager.logits, 1), torch.stack(graphed.logits, 1))
    if bi:
        sampler = generate_log_probs(model, graphed, ids.shape[1]).log_probs
        with torch.no_grad():
            trainer = model_log_probs(model, graphed.sequences).log_probs[:, ids.shape[1] - 1 :]
        assert torch.equal(sampler, trainer)
    handle.remove()


@requires_cuda
@pytest.mark.parametrize("model_type", ["gemma2", "mistral"])
def test_sliding_window_models_graphed_are_the_eager_bits_cuda(model_type):
    """Real CUDA graphs on sliding-window layers (bf16, batch-invariant): a window that does not fill
    (graphed throughout, its count advanced after each replay) and Mistral's filling mid-generate
    (the rolls eager): the eager static-cache run's tokens and logits."""
    kw = {"sliding_window": 8} if model_type == "mistral" else {}
    model = tiny_model(model_type, num_hidden_layers=2, **kw).to("cuda", torch.bfloat16).eval()
    apply_truefuse(model, batch_invariant=True)
    ids = _ids().cuda()
    eager = _generate(model, ids, cache_implementation="static", disable_compile=True)
    handle = graph_decode(model)
    for _ in range(2):
        seq, logits = _generate(model, ids)
        assert torch.equal(seq, eager[0]) and torch.equal(logits, eager[1])
    assert handle.captures == 1, (handle.captures, handle.replays, handle.eager)
    handle.remove()
