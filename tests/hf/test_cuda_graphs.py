"""A patched model's whole training step (forward, backward, clipping, fused AdamW) captured in one
CUDA graph replays the eager step's bits (issue 47, docs/cuda_graphs.md): 8 graphed steps against 8
eager ones, stock, fast, batch-invariant and the lean loss, Llama, Qwen3 and Qwen3-MoE (experts with
their sizes on the device)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import requires_cuda  # noqa: E402

from truefuse.demo.parity_cli import build  # noqa: E402
from truefuse.integrations.cuda_graph import GraphedStep, graph_step  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse  # noqa: E402

STEPS, B, S = 8, 2, 128


def _trainer(arch: str, mode: str):
    model = build(arch, 2, 256, 32000, torch.bfloat16, torch.device("cuda"), 0).train()
    model.config._attn_implementation = "sdpa"  # HF's default; its eager mask copies a CPU scalar
    if mode != "stock":
        # "lean": the fused loss's low-memory form (vocabulary slices; fast mode only); "... fused":
        # issue 48's opt-in fusions (the residual norms, the sibling groups)
        fused = dict(fuse_residual_norm=True, fuse_sibling_grads=True) if mode.endswith("fused") else {}
        apply_truefuse(model, batch_invariant=mode.startswith("bi"), loss_memory="lean" if mode == "lean" else "default", **fused)
    params = [p for p in model.parameters() if p.requires_grad]
    lr = torch.tensor(1e-3, device="cuda")  # a tensor: a scheduler may change it between replays
    opt = torch.optim.AdamW(params, lr=lr, fused=True, capturable=True)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, step


@requires_cuda
@pytest.mark.parametrize("mode", ["stock", "fast", "bi", "lean", "fast fused", "bi fused"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_graphed_steps_equal_eager_steps(arch, mode):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, 32000, (B, S), generator=g).cuda() for _ in range(STEPS)]
    m_eager, eager = _trainer(arch, mode)
    m_graph, graphed = _trainer(arch, mode)
    graphed = graph_step(graphed, warmup=2)
    for i, ids in enumerate(batches):
        a, b = eager(ids), graphed(ids).clone()
        assert torch.equal(a, b), f"step {i}: eager loss {float(a)} vs graphed {float(b)}"
    assert graphed.graph is not None and graphed.calls == STEPS
    for (name, p), q in zip(m_eager.named_parameters(), m_graph.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs after {STEPS} steps"


def _in_a_process_of_its_own(code: str) -> str:
    """``code`` run by a fresh interpreter: on torch 2.11 a failed capture leaves the CUDA generator
    marked as capturing, and every later CUDA random draw of the process raises ("Offset increment
    outside graph capture"): run in the suite's worker, one failed 81 tests after it on an H100.
    Unbuffered (``-u``): such a process can die at exit, and a pipe's buffer would die with it."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-u", "-c", code], capture_output=True, text=True, timeout=300)
    return run.stdout + run.stderr


_PRELUDE = """
import torch
from truefuse.integrations.cuda_graph import GraphedStep
x = torch.ones(4, device="cuda")
"""


@requires_cuda
def test_a_step_that_reads_the_host_only_in_eager_mode_is_captured():
    """transformers' masks read a value on the host in eager mode and not while a capture runs
    (``is_tracing``); so does truefuse's label check. Such a step captures and replays: a check of
    the warm-up step under torch's sync-debug mode refused it (stock and patched Llama, H100)."""
    out = _in_a_process_of_its_own(
        _PRELUDE
        + """
def step(x):
    if torch.cuda.is_current_stream_capturing() or bool((x > 0).all()):
        return x * 2
    return x
graphed = GraphedStep(step, warmup=2)
got = [graphed(x * i).sum().item() for i in range(1, 5)]
print("GOT", got, graphed.graph is not None)
"""
    )
    assert "GOT [8.0, 16.0, 24.0, 32.0] True" in out, out


@requires_cuda
def test_a_capture_failure_names_its_cause():
    """A step that reads the host only once captured (past the warm-up's check): the error says it
    was the capture and keeps the step's own error."""
    out = _in_a_process_of_its_own(
        _PRELUDE
        + """
calls = []
def step(x):
    calls.append(1)
    return x * float(x.sum()) if len(calls) > 1 else x * 2
graphed = GraphedStep(step, warmup=1)
graphed(x)
try:
    graphed(x)
except RuntimeError as e:
    print("RAISED", e)
"""
    )
    assert "RAISED capturing the step in a CUDA graph failed" in out, out


def test_arguments_checked():
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        GraphedStep(lambda: None, warmup=0)
    with pytest.raises(TypeError, match="step must be callable"):
        GraphedStep(3)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="GraphedStep needs CUDA"):
            GraphedStep(lambda x: x)(torch.ones(2))


class _NoGraph:
    """``torch.cuda.CUDAGraph`` on the CPU: a capture that only runs the step."""

    def replay(self):
        pass


def test_a_captured_step_keeps_the_eager_causal_mask_decision(monkeypatch):
    """While ``GraphedStep`` captures, transformers' SDPA mask is decided as in the eager step: a
    plainly causal, unpadded batch reaches attention with no mask (transformers 5.17 built the full
    causal mask whenever a stream captured: SDPA's kernels 2.8x longer in a graphed demo step on an
    H100); once the capture ends, transformers' own mask function is back. The CPU stands in for
    the capture (the graph object and context stubbed; the stream-capture decision simulated)."""
    import contextlib

    from transformers import masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import truefuse.integrations.cuda_graph as cg
    from tests.hf.tiny import tiny_model

    model = tiny_model("llama", num_hidden_layers=1, attn_implementation="sdpa")
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    seen = []
    real = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping,
        "sdpa",
        lambda m, q, k, v, mask, **kw: seen.append(mask) or real(m, q, k, v, mask, **kw),
    )
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # as 5.17 while capturing
    monkeypatch.setattr(cg.torch.cuda, "CUDAGraph", _NoGraph)
    monkeypatch.setattr(cg.torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())

    def step(x):
        return model(input_ids=x, labels=x).loss

    step(ids)
    assert isinstance(seen.pop(), torch.Tensor)  # what a capture got without the eager decision
    GraphedStep(step, warmup=1)._capture((ids,))
    assert seen == [None]
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is masking_utils.sdpa_mask


def _capturing_stand_in(monkeypatch):
    """The CPU's capture: the graph stubbed, and transformers told a stream captures while the
    context is open (its ``is_tracing`` then answers as on a GPU under ``torch.cuda.graph``)."""
    import contextlib

    from transformers.utils import import_utils

    import truefuse.integrations.cuda_graph as cg

    state = {"on": False}
    real = import_utils.is_cuda_stream_capturing
    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: state["on"] or real())

    @contextlib.contextmanager
    def graph(graph, pool=None):
        state["on"] = True
        try:
            yield
        finally:
            state["on"] = False

    monkeypatch.setattr(cg.torch.cuda, "CUDAGraph", _NoGraph)
    monkeypatch.setattr(cg.torch.cuda, "graph", graph)


@pytest.mark.parametrize("attn", ["sdpa", "truefuse"])
def test_unpacked_capture_keeps_the_causal_skip_and_packed_warmups_refuse(monkeypatch, attn):
    """Under capture transformers cannot read whether position_ids pack sequences and keeps the
    packed-sequence mask: the full mask reaches attention even for a plainly causal batch (H100,
    transformers 5.17: BI attention 5.0 -> 29.0 ms a step graphed). ``packed_sequences=False``
    answers as eager (no mask, the kernel's causal skip); a warm-up whose positions were packed
    refuses the capture."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse

    model = tiny_model("llama", num_hidden_layers=1, attn_implementation="sdpa")
    if attn == "truefuse":
        apply_truefuse(model, batch_invariant=True, linear_cross_entropy=False)
    name = model.config._attn_implementation
    seen = []
    real = ALL_ATTENTION_FUNCTIONS[name]

    def spy(m, q, k, v, mask, **kw):
        seen.append(mask)
        return real(m, q, k, v, mask, **kw)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, spy)
    _capturing_stand_in(monkeypatch)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))

    def step(x, positions=None):
        return model(input_ids=x, position_ids=positions, use_cache=False).logits  # as training: no cache

    GraphedStep(step, warmup=1)._capture((ids,))
    assert isinstance(seen.pop(), torch.Tensor)  # transformers' safe answer while capturing
    graphed = GraphedStep(step, warmup=1, packed_sequences=False)
    graphed._packing.append(False)  # the warm-up's eager answer (its side stream needs CUDA)
    graphed._capture((ids,))
    assert seen.pop() is None
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    from truefuse.integrations.huggingface.attention_mask import packing_seen

    record = []
    with packing_seen(record):
        step(ids, packed)
    assert record == [True]
    refused = GraphedStep(step, warmup=1, packed_sequences=False)
    refused._packing.extend(record)
    with pytest.raises(ValueError, match="packed_sequences=False"):
        refused._capture((ids, packed))
