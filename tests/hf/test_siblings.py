"""Batch-invariant mode's sibling projections in one launch (``integrations/huggingface/siblings.py``):
q/k/v and gate/up computed by one segmented launch give each call's own bits, and any call that does
not fit (another input, a weight written since, a gradient, no Triton plan) runs as alone. On the CPU
with the Triton backend's batch-invariant row added (the plan CUDA's forward gets), fp32 under the
interpreter; on CUDA in bf16."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import truefuse.ops.gemm.gemm_backends.triton as triton_backend  # noqa: E402
from tests._kept import stand_in  # noqa: E402
from tests.hf.tiny import tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse  # noqa: E402
from truefuse.integrations.huggingface import siblings as S  # noqa: E402
from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant  # noqa: E402
from truefuse.ops.gemm.gemm_plan import Capability, backend_available, override_capabilities  # noqa: E402

F32 = torch.float32


@pytest.fixture
def plan(device):
    """The batch-invariant Triton plan on this device (on the CPU: added under the interpreter)."""
    if device.type == "cpu":
        if not backend_available("triton", "cpu"):
            pytest.skip("the Triton interpreter is off")
        with override_capabilities(add=[Capability("batch_invariant", F32, F32, "cpu", backend="triton")]):
            yield F32
    else:
        yield torch.bfloat16


@pytest.fixture
def launches(monkeypatch):
    n = [0]
    real = triton_backend.bi_launch_segments

    def counted(*a):
        n[0] += 1
        return real(*a)

    real_replay = S._replay

    def replayed(*a):  # a kept launch replayed (docs/design.md §6.10) is the group's launch too
        outs = real_replay(*a)
        n[0] += outs is not None
        return outs

    monkeypatch.setattr(triton_backend, "bi_launch_segments", counted)
    monkeypatch.setattr(S, "_replay", replayed)
    return n


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_patched_model_same_bits_with_and_without_siblings(model_type, device, plan, launches):
    """A BI model's forward (and on CUDA Llama's greedy ``generate``, decode-sized calls through a KV
    cache): the same logits and tokens with the sibling launches as without them (qwen2: q/k/v
    carry biases), one launch per group and forward."""
    model = tiny_model(model_type, plan).to(device).eval()
    apply_truefuse(model, batch_invariant=True)
    alone = copy.deepcopy(model)
    alone._truefuse_bi_groups = []  # every projection its own call
    assert len(model._truefuse_bi_groups) == 2 * model.config.num_hidden_layers
    ids = torch.randint(1, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        a, b = model(ids).logits, alone(ids).logits
        assert launches[0] == len(model._truefuse_bi_groups)
        if model_type == "llama" and device.type == "cuda":  # the CPU: the forward (decode sizes: below)
            kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
            assert torch.equal(model.generate(ids, **kw), alone.generate(ids, **kw))
    assert torch.equal(a, b)


def _attention_like(dtype, device, bias=False):
    m = torch.nn.Module()
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        lin = torch.nn.Linear(32, 16 if i else 48, bias=bias).to(device, dtype)
        setattr(m, name, lin)
    return m


def test_calls_that_do_not_fit_run_alone(device, plan, launches):
    """Kept outputs are used only for the same input tensor and an unwritten weight; out of order,
    another input, a weight written in place between, or a gradient to take: each call its own."""
    m = _attention_like(plan, device)
    x = torch.randn(5, 32, device=device).to(plan)
    with torch.no_grad(), running_batch_invariant():  # no groups: each call alone
        want = {n: getattr(m, n)(x) for n in ("q_proj", "k_proj", "v_proj")}
    groups = S.find_groups(m)
    assert len(groups) == 1
    with torch.no_grad():
        with running_batch_invariant(groups):  # in order: one launch
            got = {n: getattr(m, n)(x) for n in ("q_proj", "k_proj", "v_proj")}
        assert launches[0] == 1 and all(torch.equal(got[n], want[n]) for n in got)
        with running_batch_invariant(groups):  # k first: k alone, then q's launch keeps k and v
            assert torch.equal(m.k_proj(x), want["k_proj"]) and launches[0] == 1
            m.q_proj(x)
            m.v_proj.weight.mul_(2)  # written after the launch: v recomputed (2x: exact in binary)
            assert torch.equal(m.v_proj(x), want["v_proj"] * 2)
            assert torch.equal(m.k_proj(x * 2), want["k_proj"] * 2)  # another input: alone
            m.q_proj(x)
            x.mul_(2)  # the input written after the launch: k recomputed from it
            assert torch.equal(m.k_proj(x), want["k_proj"] * 2)
            x.div_(2)
        assert launches[0] == 3
        with running_batch_invariant(groups):  # many rows (the last M bucket): GPU time, each alone
            m.q_proj(torch.randn(300, 32, device=device).to(plan))
        assert launches[0] == 3
        with torch.inference_mode(), running_batch_invariant(groups):  # no version counter: alone
            m.q_proj(torch.randn(5, 32, device=device).to(plan))
        assert launches[0] == 3
    x.requires_grad_()
    with running_batch_invariant(groups):
        m.q_proj(x)
    assert launches[0] == 3


def test_find_groups_leaves_wrapped_projections():
    m = _attention_like(F32, "cpu")
    m.k_proj = torch.nn.Sequential(m.k_proj)
    assert S.find_groups(m) == []


@pytest.mark.parametrize("M", [1, 40, 200, 300])
def test_segments_launch_same_bits_as_each_launch(M, device, plan):
    """``bi_launch_segments`` against ``bi_launch`` per weight, in every M bucket of the tile table
    (and both segment counts), for the forward's layout (``x Wᵀ``)."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 64, generator=g).to(device, plan)
    ws = [torch.randn(n, 64, generator=g).to(device, plan) for n in (96, 32, 40)]
    for members in (ws, ws[:2]):
        outs = [torch.empty(M, w.shape[0], device=device, dtype=plan) for w in members]
        triton_backend.bi_launch_segments(x, [w.t() for w in members], outs)
        for w, got in zip(members, outs, strict=True):
            want = torch.empty_like(got)
            triton_backend.bi_launch(x, w.t(), want)
            assert torch.equal(got, want), (M, w.shape)


def test_plan_check_follows_the_plan_context(launches):
    """The plan check follows what the plan depends on (the kept runners' key): the same group fuses
    under the Triton row's override and runs each call alone (the CPU's own plan) outside it."""
    if not backend_available("triton", "cpu"):
        pytest.skip("the Triton interpreter is off")
    m = _attention_like(F32, "cpu")
    x = torch.randn(3, 32)
    groups = S.find_groups(m)

    def triton_row():
        return override_capabilities(add=[Capability("batch_invariant", F32, F32, "cpu", backend="triton")])

    with torch.no_grad():
        with triton_row(), running_batch_invariant(groups):
            m.q_proj(x)
        assert launches[0] == 1
        with running_batch_invariant(groups):  # the CPU's own plan: each call alone
            m.q_proj(x)
        assert launches[0] == 1
        with triton_row(), running_batch_invariant(groups):
            m.q_proj(x)
        assert launches[0] == 2


@pytest.fixture
def kept(monkeypatch):
    """Kept group launches with the CPU standing in for CUDA (``tests/_kept.py``), under the Triton
    row's override (the plan CUDA's decode gets)."""
    if not backend_available("triton", "cpu"):
        pytest.skip("the Triton interpreter is off")
    made = stand_in(monkeypatch, S, triton_backend, "bi_segments_prepared", lambda a, bs, outs: (a, *bs, *outs))
    with override_capabilities(add=[Capability("batch_invariant", F32, F32, "cpu", backend="triton")]):
        yield made
    S._KEPT.clear()


def test_a_repeated_group_call_replays_its_kept_launch(kept):
    """The second decode step's group: one replay of the first step's launch on this step's input,
    the weights and fresh outputs; k and v then get their outputs from it."""
    m = _attention_like(F32, "cpu")
    groups = S.find_groups(m)
    ws = [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]
    with torch.no_grad():
        x = torch.randn(2, 1, 32)
        with running_batch_invariant(groups):
            q = m.q_proj(x)
            m.k_proj(x), m.v_proj(x)
        assert len(kept) == 1 and kept[0].slots[0] == x.data_ptr() and kept[0].slots[4] == q.data_ptr()
        x2 = torch.randn(2, 1, 32)
        with running_batch_invariant(groups):
            q2, k2, v2 = m.q_proj(x2), m.k_proj(x2), m.v_proj(x2)
    outs = (q2.data_ptr(), k2.data_ptr(), v2.data_ptr())
    assert kept[0].calls == [(5, x2.data_ptr(), *[w.data_ptr() for w in ws], *outs)]
    assert (q2.shape, k2.shape, v2.shape) == ((2, 1, 48), (2, 1, 16), (2, 1, 16))


@pytest.mark.parametrize("change", ["input strides", "weight strides", "rows", "overrides", "grad"])
def test_a_group_call_differing_in_what_it_reads_does_not_replay_anothers_launch(kept, change):
    m = _attention_like(F32, "cpu")
    groups = S.find_groups(m)
    with torch.no_grad(), running_batch_invariant(groups):
        m.q_proj(torch.randn(2, 1, 32))
    x = torch.randn(2, 1, 32)
    if change == "input strides":
        x = torch.randn(2, 1, 64)[..., ::2]
    elif change == "weight strides":
        m.k_proj.weight.data = m.k_proj.weight.data.t().contiguous().t()
    elif change == "rows":
        x = torch.randn(3, 1, 32)
    elif change == "grad":
        m.q_proj.weight.requires_grad_()
    block = override_capabilities(remove=[Capability("batch_invariant", backend="torch")]) if change == "overrides" else None
    with torch.no_grad() if change != "grad" else torch.enable_grad(), running_batch_invariant(groups):
        if block is not None:
            with block:
                m.q_proj(x)
        else:
            m.q_proj(x)
    assert kept[0].calls == [], f"a group call of another {change} replayed the first call's launch"


def test_a_groups_calls_go_to_its_launch_before_their_own_kept_launches(kept, monkeypatch):
    """A routed call's kept launch is tried before the router's checks (``linear_kept``), but not for
    a group's members: the first member's call makes the group's launch, whose outputs the others
    take, even where each member's own launch was kept by calls made without the groups."""
    import truefuse.ops.gemm.gemm_kept as gk

    alone = stand_in(monkeypatch, gk, gk, "_prepared", lambda a, b, out: (a, b, out))
    monkeypatch.setattr(gk, "runs_bi_triton", lambda a, b, has_bias: True)
    m = _attention_like(F32, "cpu")
    groups = S.find_groups(m)
    names = ("q_proj", "k_proj", "v_proj")
    try:
        with torch.no_grad():
            with running_batch_invariant():  # no groups: each call alone, each launch kept
                for n in names:
                    getattr(m, n)(torch.randn(2, 1, 32))
            assert len(alone) == 2  # k and v: one layout, one key (v's call replayed k's)
            before = [len(go.calls) for go in alone]
            x = torch.randn(2, 1, 32)
            with running_batch_invariant(groups):
                got = [getattr(m, n)(x) for n in names]
        assert [len(go.calls) for go in alone] == before, "a group member took its own kept launch"
        assert len(kept) == 1 and kept[0].slots[0] == x.data_ptr()
        assert [t.shape for t in got] == [(2, 1, 48), (2, 1, 16), (2, 1, 16)]
    finally:
        gk.clear()
