"""Kept launches (``ops/_launch/prepared.py``): the batch-invariant no-grad Linear
(``ops/gemm/gemm_kept.py``), the two-tensor gated activation (``ops/gated_activation/gated_kept.py``)
``rms_norm_hf`` in batch-invariant mode (``ops/norm/norm_kept.py``) and rope (``ops/rope_kept.py``) replay their kept launch
where the call repeats exactly, and only there (issue 47 item 3). The siblings' group launch:
``tests/hf/test_siblings.py``.

On the CPU the launch is a recording stand-in (no kernel handle exists without CUDA): these tests
check the key, that a call differing in anything its path reads takes that path, and that a kept
call launches on the caller's tensors' addresses into a fresh output. On CUDA, the kept launch's
bits against the path with the fast launch off, through ``truefuse``'s Linear, a routed
``F.linear``, ``truefuse.gated_activation``, ``truefuse.rms_norm_hf`` and ``truefuse.apply_rotary_pos_emb``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda

import truefuse.ops.gated_activation.gated_kept as gak
import truefuse.ops.gemm.gemm_kept as gk
import truefuse.ops.norm.norm_kept as nk
import truefuse.ops.rope_kept as rk
from tests._kept import stand_in
from truefuse.autograd._wgrad import WgradState
from truefuse.autograd.gated_activation import gated_activation
from truefuse.autograd.linear import linear
from truefuse.config import batch_invariant, eager_fast_launch
from truefuse.ops.gemm.gemm_plan import Capability, override_capabilities

_STATE = WgradState(owner="test")


@pytest.fixture
def kept(monkeypatch):
    """gemm_kept with the CPU standing in for CUDA (``tests/_kept.py``), the plan the batch-invariant
    Triton product's."""
    made = stand_in(monkeypatch, gk, gk, "_prepared", lambda a, b, out: (a, b, out))
    monkeypatch.setattr(gk, "runs_bi_triton", lambda a, b, has_bias: True)
    yield made
    gk.clear()


def _cuda_randn(seed: int):
    """``randn(*shape)``: bf16 normal samples on CUDA from one generator seeded with ``seed``."""
    g = torch.Generator("cuda").manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)


def _call(x, w, b=None):
    with torch.no_grad(), batch_invariant():
        return linear(x, w, b, state=_STATE)


def test_a_repeated_call_replays_its_kept_launch(kept):
    w = torch.randn(16, 8)
    x = torch.randn(2, 1, 8)
    y = _call(x, w)
    torch.testing.assert_close(y, x @ w.t())
    assert len(kept) == 1 and kept[0].slots == (x.data_ptr(), w.data_ptr(), y.data_ptr())
    x2 = torch.randn(2, 1, 8)
    y2 = _call(x2, w)
    assert kept[0].calls == [(5, x2.data_ptr(), w.data_ptr(), y2.data_ptr())]
    assert y2.shape == (2, 1, 16) and y2.is_contiguous() and y2.data_ptr() not in (y.data_ptr(), x2.data_ptr())
    assert len(kept) == 1


def _changed(name):
    """A call differing from ``(x (2, 1, 8) fp32, w (16, 8))`` in one thing its path reads."""
    w = torch.randn(16, 8)
    if name == "strides":
        return torch.randn(2, 1, 16)[..., ::2], w, {}
    if name == "alignment":
        return torch.randn(2 * 8 + 1)[1:].view(2, 1, 8), w, {}
    if name == "dtype":
        return torch.randn(2, 1, 8, dtype=torch.float64), w.double(), {}
    if name == "rows":
        return torch.randn(3, 1, 8), w, {}
    if name == "weight shape":
        return torch.randn(2, 1, 8), torch.randn(24, 8), {}
    if name == "bias":
        return torch.randn(2, 1, 8), w, {"b": torch.randn(16)}
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["strides", "alignment", "dtype", "rows", "weight shape", "bias"])
def test_a_call_differing_in_what_its_path_reads_does_not_replay_anothers_launch(kept, name):
    w = torch.randn(16, 8)
    _call(torch.randn(2, 1, 8), w)
    x, w2, kw = _changed(name)
    y = _call(x, w2, kw.get("b"))
    assert kept[0].calls == [], f"a call of another {name} replayed the first call's launch"
    ref = x @ w2.t() + (kw["b"] if "b" in kw else 0)
    torch.testing.assert_close(y, ref)


def test_the_overrides_and_the_mode_are_in_the_key(kept):
    w, x = torch.randn(16, 8), torch.randn(2, 1, 8)
    _call(x, w)
    with override_capabilities(remove=[Capability("batch_invariant", backend="triton")]):
        _call(x, w)
    with torch.no_grad():
        y = linear(x, w, None, state=_STATE)  # fast mode: not kept, not replayed
    assert kept[0].calls == [] and len(kept) == 2
    torch.testing.assert_close(y, x @ w.t())


def test_a_call_recording_a_graph_runs_the_function_whose_products_are_kept(kept):
    """With a gradient the Linear Function records the graph; its forward product and its input
    gradient's product are kept launches too (their keys: the operands', not the grad mode)."""
    w, x = torch.randn(16, 8, requires_grad=True), torch.randn(2, 1, 8, requires_grad=True)
    with batch_invariant():
        y = linear(x, w, None, state=_STATE)  # forward kept (made[0])
        assert "PlainLinear" in type(y.grad_fn.next_functions[0][0]).__name__
        dy = torch.randn(2, 1, 16)
        dx, dw = torch.autograd.grad(y, (x, w), dy)  # the input gradient's product kept (made[1])
    torch.testing.assert_close(dx, dy @ w.detach())
    torch.testing.assert_close(dw, dy.reshape(2, 16).t() @ x.detach().reshape(2, 8))
    assert len(kept) == 2 and kept[1].slots[1] == w.data_ptr()
    with batch_invariant():
        y2 = linear(x, w, None, state=_STATE)
        torch.autograd.grad(y2, (x, w), dy)
    assert len(kept[0].calls) == 1 and len(kept[1].calls) == 1, "the second step's products were not replayed"
    assert kept[1].calls[0][1:3] == (dy.data_ptr(), w.data_ptr())


def test_a_kept_launch_not_launchable_now_takes_the_path(kept, monkeypatch):
    w, x = torch.randn(16, 8), torch.randn(2, 1, 8)
    _call(x, w)
    monkeypatch.setattr(gk, "launchable", lambda go: False)
    y = _call(x, w)
    torch.testing.assert_close(y, x @ w.t())
    assert kept[0].calls == [] and len(kept) == 1


def test_a_launch_not_kept_is_tried_again_then_left(monkeypatch):
    tries = []
    stand_in(monkeypatch, gk, gk, "_prepared", lambda a, b, out: ())
    monkeypatch.setattr(gk, "runs_bi_triton", lambda a, b, has_bias: True)
    monkeypatch.setattr(gk, "_prepared", lambda a, b, out: tries.append(1))  # never kept (no handle)
    w, x = torch.randn(16, 8), torch.randn(2, 1, 8)
    for _ in range(5):
        torch.testing.assert_close(_call(x, w), x @ w.t())
    assert len(tries) == gk._KEPT.tries
    gk.clear()


def test_a_launch_not_kept_now_counts_no_try(monkeypatch):
    """``prepare`` says NOT_NOW where the launch went through Triton's path for a passing reason
    (the fast launch off for a while, a profiler's hook): the key is kept once it can be."""
    from truefuse.ops._launch.prepared import NOT_NOW

    answers = [NOT_NOW] * (gk._KEPT.tries + 2)
    made = stand_in(monkeypatch, gk, gk, "_prepared", lambda a, b, out: (a, b, out))
    make = gk._prepared
    monkeypatch.setattr(gk, "_prepared", lambda a, b, out: answers.pop() if answers else make(a, b, out))
    monkeypatch.setattr(gk, "runs_bi_triton", lambda a, b, has_bias: True)
    w, x = torch.randn(16, 8), torch.randn(2, 1, 8)
    for _ in range(gk._KEPT.tries + 3):
        _call(x, w)
    assert len(made) == 1, "the key's tries were spent while the launch could not be kept"
    gk.clear()


def test_a_kept_linear_hit_checks_its_bias_as_the_path(kept):
    w, x = torch.randn(16, 8), torch.randn(2, 1, 8)
    _call(x, w, torch.randn(16))
    for bad in (torch.randn(1), torch.randn(2, 16)):
        with pytest.raises(ValueError, match="bias"):
            _call(x, w, bad)
    assert kept[0].calls == []


def test_a_routed_decode_linear_replays_before_the_routers_checks(kept, monkeypatch):
    """A batch-invariant model's ``F.linear`` at decode takes its kept launch first: no routing
    checks, no ``linear`` call (their host is what the kept launch saves: issue 47.3)."""
    import torch.nn.functional as F

    import truefuse.integrations.huggingface.batch_invariant as bim

    w, x = torch.randn(16, 8), torch.randn(2, 1, 8)
    with torch.no_grad(), bim.running_batch_invariant() as router:
        torch.testing.assert_close(F.linear(x, w), x @ w.t())

        def refused(*a, **k):
            raise AssertionError("a kept call ran the router's path")

        monkeypatch.setattr(bim, "_routable", refused)
        monkeypatch.setattr(bim, "_truefuse_linear", refused)
        x2 = torch.randn(2, 1, 8)
        y2 = F.linear(x2, w)
    assert kept[0].calls == [(5, x2.data_ptr(), w.data_ptr(), y2.data_ptr())]
    assert y2.shape == (2, 1, 16) and y2.is_contiguous() and router.routed == 2


def test_a_routed_linear_under_autocast_does_not_replay_a_launch_kept_without_it(kept):
    import torch.nn.functional as F

    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    w, x = torch.randn(16, 8), torch.randn(2, 1, 8)
    with torch.no_grad(), running_batch_invariant():
        F.linear(x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(x, w)
    assert kept[0].calls == [] and y.dtype is torch.bfloat16


def test_a_linear_whose_rows_are_copied_keeps_no_launch_on_its_input(kept):
    """``x.reshape(-1, K)`` copies a row-strided ``x``: the path's launch read the copy, so a launch
    replayed at ``x``'s own address would read other rows. Nothing is kept; every call is right."""
    w = torch.randn(16, 8)
    for _ in range(4):
        x = torch.randn(3, 2, 8).transpose(0, 1)  # (2, 3, 8), rows not one stride apart
        torch.testing.assert_close(_call(x, w), x @ w.t())
    assert kept == []


@requires_cuda
@pytest.mark.parametrize("rows", [1, 4, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_kept_launch_gives_the_paths_bits_on_cuda(rows, bias):
    import torch.nn.functional as F

    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    gk.clear()
    randn = _cuda_randn(rows)
    w = randn(2048, 1024)
    b = randn(2048) if bias else None
    xs = [randn(rows, 1, 1024) for _ in range(4)]
    with torch.no_grad():
        with batch_invariant(), eager_fast_launch(False):
            ref = [linear(x, w, b, state=_STATE) for x in xs]
        assert not gk._KEPT.entries, "kept with the fast launch off"
        with running_batch_invariant():
            ours = [F.linear(x, w, b) for x in xs] + [F.linear(x, w, b) for x in xs]
    assert any(type(v) is tuple for v in gk._KEPT.entries.values()), "no launch was kept"
    for i, y in enumerate(ours):
        assert torch.equal(y, ref[i % 4]), f"call {i} differs from the path's bits"
    gk.clear()


@requires_cuda
@pytest.mark.parametrize("rows", [4, 300])
def test_kept_products_of_a_training_step_give_the_paths_bits_on_cuda(rows):
    """A routed linear's forward and gradients, step after step: kept launches give the path's bits."""
    import torch.nn.functional as F

    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    gk.clear()
    randn = _cuda_randn(rows)
    w = randn(1024, 512).requires_grad_()
    steps = [(randn(rows, 512).requires_grad_(), randn(rows, 1024)) for _ in range(3)]

    def step(s):
        x, dy = s
        with running_batch_invariant():
            y = F.linear(x, w)
        return (y.detach(), *torch.autograd.grad(y, (x, w), dy))

    _steps_give_the_paths_bits(step, steps, (), gk._KEPT if rows <= 256 else None)
    if rows > 256:  # the last M bucket: the TMA kernel on Hopper, whose launch needs Triton's scratch allocator
        from truefuse.ops._launch.triton import hopper

        assert not (hopper(w) and any(type(v) is tuple for v in gk._KEPT.entries.values())), "a TMA launch was kept"
    gk.clear()


def _steps_give_the_paths_bits(step, steps, tables, kept) -> None:
    """Calls through kept launches (``step`` of each of ``steps``, run twice) against the same calls
    with the fast launch off (no kept launch in any of ``tables``): the same bits, output by output
    (a tensor or a tuple of them), and ``kept`` (unless None) holding a launch."""
    with eager_fast_launch(False):
        ref = [step(s) for s in steps]
    assert not any(t.entries for t in tables), "kept with the fast launch off"
    ours = [step(s) for s in steps * 2]
    if kept is not None:
        assert any(type(v) is tuple for v in kept.entries.values()), "no launch was kept"
    for i, got in enumerate(ours):
        want = ref[i % len(steps)]
        for a, b in zip(*((t,) if isinstance(t, torch.Tensor) else t for t in (got, want)), strict=True):
            assert torch.equal(a, b), f"step {i} differs from the path's bits"


# -- the gated activation ----------------------------------------------------------------------------


@pytest.fixture
def kept_gated(monkeypatch):
    """gated_kept with the CPU standing in for CUDA, as :func:`kept` (the kernel runs in Triton's
    interpreter on the CPU)."""
    yield stand_in(monkeypatch, gak, gak, "fwd_prepared", lambda g, u, y, name: (g, u, y))
    gak.clear()


needs_kernel = pytest.mark.skipif(
    not __import__("truefuse.ops._launch.triton", fromlist=["x"]).triton_runs(torch.zeros(1)),
    reason="the gated kernel does not run on the CPU here (TRITON_INTERPRET unset)",
)


@needs_kernel
def test_a_repeated_gated_call_replays_its_kept_launch(kept_gated):
    g, u = torch.randn(2, 1, 24), torch.randn(2, 1, 24)
    with torch.no_grad():
        y = gated_activation(g, "swiglu", u)
        assert len(kept_gated) == 1 and kept_gated[0].slots == (g.data_ptr(), u.data_ptr(), y.data_ptr())
        g2, u2 = torch.randn(2, 1, 24), torch.randn(2, 1, 24)
        y2 = gated_activation(g2, "swiglu", u2)
    assert kept_gated[0].calls == [(5, g2.data_ptr(), u2.data_ptr(), y2.data_ptr())]
    assert y2.shape == g2.shape and y2.is_contiguous()


@needs_kernel
@pytest.mark.parametrize("change", ["activation", "strides", "alignment", "rows", "dtype"])
def test_a_gated_call_differing_in_what_its_path_reads_does_not_replay_anothers_launch(kept_gated, change):
    from truefuse.ops.gated_activation.gated_activation import gated_activation_ref

    with torch.no_grad():
        gated_activation(torch.randn(2, 1, 24), "swiglu", torch.randn(2, 1, 24))
    name, g, u = "swiglu", torch.randn(2, 1, 24), torch.randn(2, 1, 24)
    if change == "activation":
        name = "geglu"
    elif change == "strides":
        g = torch.randn(2, 1, 48)[..., :24]
    elif change == "alignment":
        u = torch.randn(2 * 24 + 1)[1:].view(2, 1, 24)
    elif change == "rows":
        g, u = torch.randn(3, 1, 24), torch.randn(3, 1, 24)
    elif change == "dtype":
        g, u = g.double(), u.double()
    y = gated_activation(g, name, u)
    assert kept_gated[0].calls == [], f"a call of another {change} replayed the first call's launch"
    ref = gated_activation_ref(torch.cat([g.detach(), u], -1), name)
    torch.testing.assert_close(y.detach(), ref)


@pytest.fixture
def kept_gated_bwd(monkeypatch, kept_gated):
    """:func:`kept_gated` with the backward's kept launches standing in too: (forward's, backward's)."""
    made: list = []

    def make(dy, g, u, dg, du, name):
        from tests._kept import Go

        made.append(Go((dy, g, u, dg, du)))
        return made[-1]

    monkeypatch.setattr(gak, "bwd_prepared", make)
    yield kept_gated, made


def _gated_step(g, u, dy):
    y = gated_activation(g, "swiglu", u)
    return (y, *torch.autograd.grad(y, (g, u), dy))


@needs_kernel
def test_a_repeated_gated_training_call_replays_its_kept_launches_both_ways(kept_gated_bwd):
    """A training step's gated activation, step after step: the first step keeps the forward's
    launch, the second replays it (in the kept Function) and keeps the backward's, the third replays
    both, on that step's tensors into fresh outputs."""
    fwd, bwd = kept_gated_bwd
    steps = [
        (torch.randn(2, 3, 24, requires_grad=True), torch.randn(2, 3, 24, requires_grad=True), torch.randn(2, 3, 24))
        for _ in range(3)
    ]
    outs = [_gated_step(*s) for s in steps]
    assert "KeptGated" not in type(outs[0][0].grad_fn).__name__ and "KeptGated" in type(outs[1][0].grad_fn).__name__
    assert len(fwd) == 1 and len(bwd) == 1
    (g1, u1, _), (g2, u2, dy2) = steps[1:]
    y1, y2 = outs[1][0], outs[2][0]
    assert fwd[0].calls == [(5, g1.data_ptr(), u1.data_ptr(), y1.data_ptr()), (5, g2.data_ptr(), u2.data_ptr(), y2.data_ptr())]
    _, dg2, du2 = outs[2]
    assert bwd[0].calls == [(5, dy2.data_ptr(), g2.data_ptr(), u2.data_ptr(), dg2.data_ptr(), du2.data_ptr())]
    assert dg2.shape == du2.shape == (2, 3, 24) and dg2.is_contiguous()


@needs_kernel
def test_the_kept_functions_gradients_are_the_paths_bits(kept_gated_bwd):
    """The second step's gradients come from the kept Function's backward through the op's own body
    (nothing kept for it yet): the path's bits, each gradient to its own operand."""
    g, u, dy = torch.randn(4, 24, requires_grad=True), torch.randn(4, 24, requires_grad=True), torch.randn(4, 24)
    path = _gated_step(g, u, dy)
    kept = _gated_step(g, u, dy)
    assert "KeptGated" in type(kept[0].grad_fn).__name__
    assert torch.equal(kept[1], path[1]) and torch.equal(kept[2], path[2]) and not torch.equal(path[1], path[2])


@needs_kernel
def test_a_gradient_whose_rows_are_copied_keeps_no_backward_launch(kept_gated_bwd):
    _, bwd = kept_gated_bwd
    """A column-major ``dy`` is copied to rows by the path: a launch kept on it would read ``dy``'s
    own memory as rows. Nothing is kept; every step's gradients are the path's."""
    from truefuse.ops.gated_activation.gated_activation import gated2_bwd_op

    g, u = torch.randn(4, 24, requires_grad=True), torch.randn(4, 24, requires_grad=True)
    for _ in range(4):
        dy = torch.randn(24, 4).t()  # column-major: the path copies it to rows first
        got = torch.autograd.grad(gated_activation(g, "swiglu", u), (g, u), dy)
        want = gated2_bwd_op.body(dy.contiguous(), g.detach(), u.detach(), "swiglu")
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert bwd == []


@needs_kernel
def test_the_kept_function_refuses_double_backward(kept_gated_bwd):
    g, u = torch.randn(4, 24, requires_grad=True), torch.randn(4, 24, requires_grad=True)
    _gated_step(g, u, torch.randn(4, 24))
    y = gated_activation(g, "swiglu", u)
    assert "KeptGated" in type(y.grad_fn).__name__
    (dg,) = torch.autograd.grad(y.sum(), g, create_graph=True)
    with pytest.raises(RuntimeError, match="gated_activation"):
        dg.sum().backward()


@requires_cuda
@pytest.mark.parametrize("rows", [4, 300])
def test_kept_gated_training_launches_give_the_paths_bits_on_cuda(rows):
    """A training step's gated activation, step after step, forward and both gradients: kept
    launches give the path's bits (the fast launch off: no kept launch at all)."""
    gak.clear()
    randn = _cuda_randn(rows)
    steps = [tuple(randn(rows, 2816).requires_grad_(i < 2) for i in range(3)) for _ in range(3)]
    _steps_give_the_paths_bits(lambda s: _gated_step(*s), steps, (gak._KEPT, gak._KEPT_BWD), gak._KEPT_BWD)
    gak.clear()


@requires_cuda
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_kept_gated_launch_gives_the_paths_bits_on_cuda(rows):
    gak.clear()
    randn = _cuda_randn(rows)
    pairs = [(randn(rows, 1, 5632), randn(rows, 1, 5632)) for _ in range(4)]
    with torch.no_grad():
        _steps_give_the_paths_bits(lambda p: gated_activation(p[0], "swiglu", p[1]), pairs, (gak._KEPT,), gak._KEPT)
    gak.clear()


# -- rms_norm_hf in batch-invariant mode ---------------------------------------------------------------


@pytest.fixture
def kept_norm(monkeypatch):
    """norm_kept with the CPU standing in for CUDA, as :func:`kept`: the mode's kernel statistics
    on the CPU too (the interpreter's kernel, fp32)."""
    import truefuse.autograd.norm as autograd_norm

    made = stand_in(monkeypatch, nk, nk, "hf_prepared", lambda x, w, y, rstd, eps, style, bi: (x, w, y, rstd))
    monkeypatch.setattr(autograd_norm, "kernel_statistics", lambda x, bi: bi)
    yield made
    nk.clear()


def _norm(x, w, eps=1e-6, style="llama"):
    from truefuse.autograd.norm import rms_norm_hf

    with torch.no_grad(), batch_invariant():
        return rms_norm_hf(x, w, eps, style=style)


@needs_kernel
def test_a_repeated_bi_norm_call_replays_its_kept_launch(kept_norm):
    from truefuse.ops.norm.norm import rms_norm_hf_ref

    w = torch.randn(32)
    x = torch.randn(2, 1, 32)
    torch.testing.assert_close(_norm(x, w), rms_norm_hf_ref(x, w, 1e-6))
    assert len(kept_norm) == 1 and kept_norm[0].slots[:2] == (x.data_ptr(), w.data_ptr())
    x2 = torch.randn(2, 1, 32)
    y2 = _norm(x2, w)
    (call,) = kept_norm[0].calls
    assert call[:4] == (5, x2.data_ptr(), w.data_ptr(), y2.data_ptr()) and len(call) == 5  # and a fresh rstd
    assert y2.shape == x2.shape and y2.dtype == torch.float32


@needs_kernel
@pytest.mark.parametrize("change", ["eps", "style", "strides", "alignment", "rows", "fast mode"])
def test_a_bi_norm_call_differing_in_what_its_path_reads_does_not_replay_anothers_launch(kept_norm, change):
    from truefuse.autograd.norm import rms_norm_hf

    w = torch.randn(32)
    _norm(torch.randn(2, 1, 32), w)
    x, eps, style = torch.randn(2, 1, 32), 1e-6, "llama"
    if change == "eps":
        eps = 1e-5
    elif change == "style":
        style = "gemma"
    elif change == "strides":
        x = torch.randn(2, 2, 32)[:, :1]
    elif change == "alignment":
        x = torch.randn(2 * 32 + 1)[1:].view(2, 1, 32)
    elif change == "rows":
        x = torch.randn(3, 1, 32)
    if change == "fast mode":
        with torch.no_grad():
            rms_norm_hf(x, w, eps, style=style)
    else:
        with torch.no_grad(), batch_invariant():
            rms_norm_hf(x, w, eps, style=style)
    assert kept_norm[0].calls == [], f"a call of another {change} replayed the first call's launch"


@needs_kernel
def test_a_bad_eps_or_style_raises_the_paths_error_in_bi_mode(kept_norm):
    w, x = torch.randn(32), torch.randn(2, 1, 32)
    _norm(x, w)
    with pytest.raises(ValueError, match="eps"):
        _norm(x, w, eps=[1e-6])
    with pytest.raises(ValueError, match="style"):
        _norm(x, w, style=["llama"])


@pytest.fixture
def kept_norm_both(kept_norm):
    """:func:`kept_norm`, whose stand-in keeps fast mode's launch (the statistics given) too."""
    return kept_norm


def _norm_step(x, w, dy, bi, style="llama"):
    from truefuse.autograd.norm import rms_norm_hf

    with batch_invariant(bi):
        y = rms_norm_hf(x, w, 1e-6, style=style)
    return (y, *torch.autograd.grad(y, (x, w), dy))


@needs_kernel
@pytest.mark.parametrize("bi", [True, False])
def test_a_repeated_norm_training_call_replays_its_kept_launch(kept_norm_both, bi):
    """A training step's ``rms_norm_hf``, step after step: the first keeps its launch (batch
    invariant: the one writing y and the statistics; fast: the op's, applying stock's statistics),
    the next replay it in the kept Function on that step's tensors into fresh outputs."""
    w = torch.randn(32, requires_grad=True)
    steps = [(torch.randn(2, 3, 32, requires_grad=True), torch.randn(2, 3, 32)) for _ in range(3)]
    outs = [_norm_step(x, w, dy, bi) for x, dy in steps]
    assert "KeptNormHF" not in type(outs[0][0].grad_fn).__name__
    assert all("KeptNormHF" in type(o[0].grad_fn).__name__ for o in outs[1:])
    (go,) = kept_norm_both
    assert [c[1:4] for c in go.calls] == [
        (x.data_ptr(), w.data_ptr(), o[0].data_ptr()) for (x, _), o in zip(steps[1:], outs[1:], strict=True)
    ]
    assert all(o[1].shape == (2, 3, 32) and o[2].shape == (32,) for o in outs)


@needs_kernel
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_the_kept_norm_functions_gradients_are_the_paths_bits(kept_norm_both, style):
    """Fast mode: the kept Function's statistics are stock's (torch's, computed in it) and its
    backward the op's: the same gradients as the path's, bit for bit."""
    x, w, dy = torch.randn(4, 32, requires_grad=True), torch.randn(32, requires_grad=True), torch.randn(4, 32)
    path = _norm_step(x, w, dy, False, style)
    kept = _norm_step(x, w, dy, False, style)
    assert "KeptNormHF" in type(kept[0].grad_fn).__name__
    assert torch.equal(kept[1], path[1]) and torch.equal(kept[2], path[2])


@needs_kernel
def test_the_kept_norm_function_refuses_double_backward(kept_norm_both):
    from truefuse.autograd.norm import rms_norm_hf

    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    _norm_step(x, w, torch.randn(4, 32), False)
    y = rms_norm_hf(x, w, 1e-6)
    assert "KeptNormHF" in type(y.grad_fn).__name__
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="rms_norm"):
        dx.sum().backward()


@requires_cuda
@pytest.mark.parametrize("bi", [True, False])
@pytest.mark.parametrize("rows", [4, 300])
def test_kept_norm_training_launches_give_the_paths_bits_on_cuda(rows, bi):
    """A training step's ``rms_norm_hf``, step after step, y and both gradients: kept launches give
    the path's bits (the fast launch off: none kept), in either mode."""
    nk.clear()
    randn = _cuda_randn(rows)
    w = randn(2048).requires_grad_()
    steps = [(randn(rows, 2048).requires_grad_(), randn(rows, 2048)) for _ in range(3)]
    _steps_give_the_paths_bits(lambda s: _norm_step(s[0], w, s[1], bi), steps, (nk._KEPT,), nk._KEPT)
    nk.clear()


@requires_cuda
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_kept_bi_norm_launch_gives_the_paths_bits_on_cuda(rows):
    from truefuse.autograd.norm import rms_norm_hf

    nk.clear()
    randn = _cuda_randn(rows)
    w = randn(2048)
    xs = [randn(rows, 1, 2048) for _ in range(4)]
    with torch.no_grad(), batch_invariant():
        _steps_give_the_paths_bits(lambda x: rms_norm_hf(x, w, 1e-6), xs, (nk._KEPT,), nk._KEPT)
    nk.clear()


# -- rope ----------------------------------------------------------------------------------------------


@pytest.fixture
def kept_rope(monkeypatch):
    """rope_kept with the CPU standing in for CUDA, as :func:`kept` (the interpreter's kernel)."""
    yield stand_in(monkeypatch, rk, rk, "rope_prepared", lambda x, cos, sin, out: (x, cos, sin, out))
    rk.clear()


def _qkcs(B=2, T=1, cos_batch=1, offset=0):
    """Decode-step rope operands: q, k the transposed projections (B, H, T, D), cos and sin (cos_batch, T, D)."""
    q = torch.randn(B, T, 4, 16).transpose(1, 2)
    k = torch.randn(B * T * 2 * 16 + offset)[offset:].view(B, T, 2, 16).transpose(1, 2)
    cos, sin = torch.randn(cos_batch, T, 16), torch.randn(cos_batch, T, 16)
    return q, k, cos, sin


@needs_kernel
def test_a_repeated_rope_call_replays_its_kept_launches(kept_rope):
    from truefuse.autograd.rope import apply_rotary_pos_emb
    from truefuse.ops.rope import rope_ref

    q, k, cos, sin = _qkcs()
    with torch.no_grad():
        qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
        assert torch.equal(qo, rope_ref(q, cos, sin)) and torch.equal(ko, rope_ref(k, cos, sin))
        assert [g.slots for g in kept_rope] == [
            (q.data_ptr(), cos.data_ptr(), sin.data_ptr(), qo.data_ptr()),
            (k.data_ptr(), cos.data_ptr(), sin.data_ptr(), ko.data_ptr()),
        ]
        q2, k2, cos2, sin2 = _qkcs()
        qo2, ko2 = apply_rotary_pos_emb(q2, k2, cos2, sin2)
    assert kept_rope[0].calls == [(5, q2.data_ptr(), cos2.data_ptr(), sin2.data_ptr(), qo2.data_ptr())]
    assert kept_rope[1].calls == [(5, k2.data_ptr(), cos2.data_ptr(), sin2.data_ptr(), ko2.data_ptr())]
    assert qo2.stride() == qo.stride() and ko2.stride() == ko.stride()  # the path's layout (empty_like)


@needs_kernel
@pytest.mark.parametrize("change", ["rows", "cos batch", "alignment", "q strides", "dtype", "grad"])
def test_a_rope_call_differing_in_what_its_path_reads_does_not_replay_anothers_launches(kept_rope, change):
    from truefuse.autograd.rope import apply_rotary_pos_emb
    from truefuse.ops.rope import rope_ref

    with torch.no_grad():
        apply_rotary_pos_emb(*_qkcs())
    q, k, cos, sin = _qkcs(
        B=3 if change == "rows" else 2, cos_batch=2 if change == "cos batch" else 1, offset=1 if change == "alignment" else 0
    )
    if change == "q strides":
        q = torch.randn(q.shape)  # (B, H, 1, D) contiguous: not the projections' transposed layout
    elif change == "dtype":
        q, k, cos, sin = q.double(), k.double(), cos.double(), sin.double()
    elif change == "grad":
        q.requires_grad_()
    with torch.enable_grad() if change == "grad" else torch.no_grad():
        qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
    assert kept_rope[0].calls == [] and kept_rope[1].calls == [], f"a call of another {change} replayed the first call's launches"
    torch.testing.assert_close(ko, rope_ref(k, cos, sin))


@requires_cuda
@pytest.mark.parametrize("batch", [1, 4])
def test_kept_rope_launches_give_the_paths_bits_on_cuda(batch):
    from truefuse.autograd.rope import apply_rotary_pos_emb

    rk.clear()
    randn = _cuda_randn(batch)
    calls = [
        (
            randn(batch, 1, 16, 64).transpose(1, 2),
            randn(batch, 1, 8, 64).transpose(1, 2),
            randn(1, 1, 64),
            randn(1, 1, 64),
        )
        for _ in range(4)
    ]
    with torch.no_grad():
        with eager_fast_launch(False):
            ref = [apply_rotary_pos_emb(*c) for c in calls]
        assert not rk._KEPT.entries, "kept with the fast launch off"
        ours = [apply_rotary_pos_emb(*c) for c in calls * 2]
    assert any(type(v) is tuple for v in rk._KEPT.entries.values()), "no launch was kept"
    for i, (qo, ko) in enumerate(ours):
        assert torch.equal(qo, ref[i % 4][0]) and torch.equal(ko, ref[i % 4][1]), f"call {i} differs from the path's bits"
    rk.clear()


# -- attention at decode ---------------------------------------------------------------------------------


@pytest.fixture
def kept_attention(monkeypatch):
    """attention_kept with the CPU standing in for CUDA: each launch it keeps is a recording
    :class:`tests._kept.Go` (made for the slots' addresses), with what it was made for in ``made``
    (``(kernel name, varying, varying grid, go)``); the kernels run in Triton's interpreter."""
    import truefuse.ops._launch.prepared as prepared
    import truefuse.ops.attention.attention_kept as ak
    from tests._kept import Go

    made: list = []

    def make(slots, kernel, grid, *args, varying=(), varying_grid=(), **kwargs):
        go = Go(slots)
        made.append((kernel.fn.__name__, varying, varying_grid, go))
        return go

    ak.clear()
    monkeypatch.setattr(prepared, "_on_device", lambda x: True)
    monkeypatch.setattr(ak, "prepare", make)
    monkeypatch.setattr(ak, "launchable", lambda go: True)
    monkeypatch.setattr(ak, "stream", lambda go: 5)
    yield made
    ak.clear()


def _decode(B=2, Lk=37, mask=True, **kw):
    """One decode step's attention: q (B, 4, 1, 16), k and v (B, 2, Lk, 16) made as a dynamic
    cache's (contiguous, new each step), a (B, 1, 1, Lk) bool mask with sequence 0 left-padded."""
    import truefuse

    q = torch.randn(B, 4, 1, 16)
    k, v = torch.randn(B, 2, Lk, 16), torch.randn(B, 2, Lk, 16)
    m = None
    if mask:
        m = torch.ones(B, 1, 1, Lk, dtype=torch.bool)
        m[0, ..., :3] = False
    with torch.no_grad():
        return truefuse.attention(q, k, v, m, enable_gqa=True, **kw), (q, k, v, m)


@needs_kernel
@pytest.mark.parametrize("mask", [True, False])
def test_a_decode_attention_call_replays_its_kept_launches_as_the_keys_grow(kept_attention, mask):
    """Key lengths 37, 38, 39 (one key class: none a multiple of 16; split in chunks of 16 under the
    interpreter): the first call keeps the forward and its merge, the next replay them with the new
    tensors' addresses, k's, v's and the mask's strides, the length and the chunks."""
    _decode(Lk=37, mask=mask)
    assert [m[0] for m in kept_attention] == ["_attention_fwd_kernel", "_attention_fwd_merge_kernel"]
    fwd, merge = kept_attention[0][3], kept_attention[1][3]
    for Lk in (38, 39):
        out, (q, k, v, m) = _decode(Lk=Lk, mask=mask)
        strides = (*k.stride()[:3], *v.stride()[:3], *((Lk, 0, Lk, 1) if mask else (0, 0, 0, 0)), Lk, 3)
        call = fwd.calls[-1]
        assert call[1:4] == (q.data_ptr(), k.data_ptr(), v.data_ptr())
        assert call[-len(strides) :] == strides
        assert (call[4] == m.data_ptr()) if mask else (len(call) == 1 + 7 + len(strides))  # no mask slot
        assert out.shape == q.shape and out.data_ptr() in call
        assert merge.calls[-1][-1] == 3 and merge.calls[-1][2] == out.data_ptr()
    assert len(fwd.calls) == len(merge.calls) == 2 and len(kept_attention) == 2


@needs_kernel
@pytest.mark.parametrize("change", ["multiple of 16", "no split", "dtype", "no mask", "causal", "scale", "window", "batch"])
def test_a_decode_attention_call_differing_in_what_its_path_reads_does_not_replay(kept_attention, change):
    _decode(Lk=37)
    kw, B, Lk, mask = {}, 2, 38, True
    if change == "multiple of 16":
        Lk = 48  # Triton compiles L_k (and the strides of its multiples) for % 16 == 0
    elif change == "no split":
        Lk = 15  # one chunk: no merge (the same key class as 37's)
    elif change == "no mask":
        mask = False
    elif change == "causal":
        kw["is_causal"] = True
    elif change == "scale":
        kw["scale"] = 0.5
    elif change == "window":
        kw["window"] = 8
    elif change == "batch":
        B = 3
    if change == "dtype":
        q, k, v = (torch.randn(*s, dtype=torch.float64) for s in ((2, 4, 1, 16), (2, 2, 38, 16), (2, 2, 38, 16)))
        with torch.no_grad():
            import truefuse

            out = truefuse.attention(q, k, v, None, enable_gqa=True)
        ref = attention_reference(q, k, v, None)
    else:
        out, (q, k, v, m) = _decode(B=B, Lk=Lk, mask=mask, **kw)
        ref = attention_reference(q, k, v, m, **kw)
    assert kept_attention[0][3].calls == [], f"a call of another {change} replayed the first call's launch"
    torch.testing.assert_close(out.double(), ref.double(), atol=1e-5, rtol=1e-5)


def attention_reference(q, k, v, m, **kw):
    from truefuse.ops.attention.attention import attention_ref

    q, k, v = q.double(), k.double(), v.double()
    return attention_ref(q, k, v, m, **kw, key_start=None if m is None else _first_key(m))


def _first_key(m):
    from truefuse.ops.attention.attention_mask import first_valid_key

    return first_valid_key(m, m.shape[0], m.shape[-1], m.device)


@requires_cuda
@pytest.mark.parametrize("B", [1, 4, 64])
@pytest.mark.parametrize("mask", [True, False])
def test_kept_attention_launches_give_the_paths_bits_on_cuda(B, mask):
    """``generate``'s decode attention, a dynamic cache growing a key a step across 16-key
    boundaries (the split forward at small batches, one program at 64 sequences x 16 heads): kept
    launches give the path's bits (the fast launch off: none kept)."""
    import truefuse
    import truefuse.ops.attention.attention_kept as ak

    ak.clear()
    randn = _cuda_randn(B)
    k0, v0 = (randn(B, 8, 120, 128) for _ in range(2))
    qs = [randn(B, 32, 1, 128) for _ in range(20)]
    pad = torch.ones(B, 1, 1, 140, device="cuda", dtype=torch.bool)
    pad[0, ..., :7] = False

    def run():
        outs, k, v = [], k0, v0
        for q in qs:
            k, v = torch.cat([k, q[:, :8]], 2), torch.cat([v, q[:, 8:16]], 2)  # a dynamic cache: new tensors
            m = pad[..., : k.shape[2]] if mask else None
            with torch.no_grad():
                outs.append(truefuse.attention(q, k, v, m, enable_gqa=True))
        return outs

    with eager_fast_launch(False):
        ref = run()
    assert not ak._KEPT.entries, "kept with the fast launch off"
    ours = run() + run()
    assert any(type(e) is tuple for e in ak._KEPT.entries.values()), "no launch was kept"
    for i, y in enumerate(ours):
        assert torch.equal(y, ref[i % len(ref)]), f"step {i} differs from the path's bits"
    ak.clear()


def test_the_kept_attention_launches_vary_the_parameters_that_follow_the_key_length():
    """``attention_kept``'s varying positions name the kernels' own parameters (k's, v's and the
    mask's strides, L_k; the merge's chunk count): a kernel whose parameters move fails here, not in
    a replay reading another argument."""
    import inspect

    import truefuse.ops.attention.attention_kept as ak
    from truefuse.kernels.attention import _attention_fwd_kernel, _attention_fwd_merge_kernel

    names = list(inspect.signature(_attention_fwd_kernel.fn).parameters)
    assert [names[i] for i in ak._FWD_VARYING] == ["skb", "skh", "skn", "svb", "svh", "svn", "smb", "smh", "smm", "smn", "L_k"]
    assert list(inspect.signature(_attention_fwd_merge_kernel.fn).parameters)[ak._MERGE_VARYING[0]] == "n_chunks"


@pytest.mark.parametrize("shape", [(3, 1, 1, 37), (3, 4, 1, 37), (1, 1, 37), (1, 37), (37,), (3, 1, 1, 1)])
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "transposed"])
def test_the_kept_attention_mask_strides_are_the_paths_expansion(shape, layout):
    """The strides a kept decode call passes for its mask: those of the path's ``unsqueeze(0)``s and
    ``expand`` to (B, H, L_q, L_k), for masks of every rank and layout (a slice of a longer mask)."""
    from truefuse.ops.attention.attention_kept import _mask_strides

    m = torch.ones(*shape, dtype=torch.bool)
    if layout == "sliced":
        m = torch.ones(*shape[:-1], 2 * shape[-1] + 3, dtype=torch.bool)[..., : shape[-1]]
    elif layout == "transposed" and len(shape) >= 2:
        m = torch.ones(*shape[:-2], shape[-1], shape[-2], dtype=torch.bool).transpose(-1, -2)
    path = m
    while path.dim() < 4:
        path = path.unsqueeze(0)
    assert _mask_strides(m, (3, 4, 1, 37)) == path.expand(3, 4, 1, 37).stride()


@needs_kernel
def test_a_decode_attention_call_with_a_key_start_the_path_copies_keeps_nothing(kept_attention):
    """An int64 ``key_start``: the path launches on its int32 copy, so a launch kept on it would
    read the caller's int64 tensor as int32 in a later call. Nothing is kept."""
    import truefuse

    for Lk in (37, 38, 39):
        q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, Lk, 16), torch.randn(2, 2, Lk, 16)
        with torch.no_grad():
            out = truefuse.attention(q, k, v, None, enable_gqa=True, key_start=torch.tensor([3, 0]))
        ref = attention_reference(q, k, v, None)
        ref[0] = attention_reference(q[:1, :, :, :], k[:1, :, 3:], v[:1, :, 3:], None)[0]
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert kept_attention == []


@needs_kernel
def test_a_zero_dim_mask_takes_the_path(kept_attention):
    """The path broadcasts a 0-d mask; the kept check must not index its last dimension."""
    out, (q, k, v, _) = _decode(Lk=37, mask=False)
    import truefuse

    with torch.no_grad():
        got = truefuse.attention(q, k, v, torch.tensor(True), enable_gqa=True)
    torch.testing.assert_close(got, out, rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("first, bad, error", [
    ({"window": 8}, {"window": 8.0}, ValueError),
    ({"window": 1}, {"window": True}, ValueError),
    ({"scale": 0.25}, {"scale": __import__("fractions").Fraction(1, 4)}, TypeError),
])  # fmt: skip
def test_an_argument_the_path_refuses_is_refused_after_an_equal_one_was_kept(kept_attention, first, bad, error):
    """``8.0 == 8`` and ``True == 1``: the key holds each option's type, so a value the path refuses
    meets the path's check even where an equal value's launch is kept."""
    _decode(Lk=37, **first)
    with pytest.raises(error):
        _decode(Lk=38, **bad)


@needs_kernel
def test_the_merges_chunk_count_is_in_the_key(kept_attention):
    """16 chunks (of 16 keys under the interpreter) and 17: the merge's loop bound is compiled for
    % 16 == 0 or not, as the path's launch is; a call of the other class takes the path."""
    _decode(Lk=250, mask=False)
    merge = kept_attention[1][3]
    _decode(Lk=258, mask=False)
    assert merge.calls == []


def test_the_kept_zero_first_keys_are_not_served_across_modes():
    """The zero first keys kept for mask-less calls: not made in inference mode (a later training
    call saves them for its backward) or under a fake-tensor mode (a later real call gets a fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import truefuse
    import truefuse.autograd.attention as A

    A._NO_MASK.clear()
    q, k, v = (torch.randn(2, 4, 1, 16) for _ in range(3))
    with torch.inference_mode():
        truefuse.attention(q, k, v)
    q2 = torch.randn(2, 4, 1, 16, requires_grad=True)
    truefuse.attention(q2, k, v).sum().backward()
    assert q2.grad is not None
    A._NO_MASK.clear()
    with FakeTensorMode():
        fq, fk, fv = (torch.randn(3, 4, 1, 16) for _ in range(3))
        truefuse.attention(fq, fk, fv)
    assert all(type(t) is torch.Tensor for t in A._NO_MASK.values())
    truefuse.attention(*(torch.randn(3, 4, 1, 16) for _ in range(3)))
    A._NO_MASK.clear()


def test_the_kept_first_keys_are_kept_per_stream(monkeypatch):
    """A kept first-keys tensor (the mask-less calls' zeros, a mask's first valid keys) is served
    only on the stream that filled it: a call on another stream gets its own, so it never reads a
    tensor whose fill, or whose free once the cache drops it, another stream orders. The CPU stands
    in for a CUDA device here (the stream id and the fill stubbed)."""
    import truefuse.autograd.attention as A

    stream = [7]
    monkeypatch.setattr(A, "_raw_stream", lambda index: stream[0])
    monkeypatch.setattr(A, "first_valid_key", lambda mask, B, Lk, device: torch.zeros(B, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(A, "host_may_wait", lambda t: True)
    dev = torch.device("cuda", 0)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    A._NO_MASK.clear()
    zeros, ks = A._no_mask_first_key(2, dev), A._first_valid_key(mask, 2, 5, dev)
    assert A._no_mask_first_key(2, dev) is zeros and A._first_valid_key(mask, 2, 5, dev) is ks  # kept
    stream[0] = 8
    assert A._no_mask_first_key(2, dev) is not zeros and A._first_valid_key(mask, 2, 5, dev) is not ks
    stream[0] = 7
    assert A._no_mask_first_key(2, dev) is zeros
    A._NO_MASK.clear()


@needs_kernel
def test_a_bi_norm_of_a_parameter_subclass_keeps_its_gradient(kept_norm):
    """A weight of a Parameter subclass requiring grad: no kept launch takes it (not a plain
    tensor), and the path records its graph (it took the no-gradient launch for a while)."""
    from truefuse.autograd.norm import rms_norm_hf

    class Weight(torch.nn.Parameter):
        pass

    w, x = Weight(torch.randn(32)), torch.randn(4, 32)
    with batch_invariant():
        y = rms_norm_hf(x, w, 1e-6)
    assert y.grad_fn is not None
    (dw,) = torch.autograd.grad(y.sum(), w)
    assert dw.shape == (32,)


def _leaked(shape):
    """A tensor that outlived the ``torch.func.grad`` that made it (a functorch wrapper of type
    torch.Tensor with no storage, which the ops' path unwraps)."""
    box = {}

    def f(x):
        box["t"] = x * 1
        return x.sum()

    torch.func.grad(f)(torch.randn(*shape))
    return box["t"]


@needs_kernel
def test_a_functorch_wrapper_takes_the_path_not_a_kept_launch(kept_norm_both, kept_gated_bwd):
    from truefuse.autograd.norm import rms_norm_hf

    w = torch.randn(32, requires_grad=True)
    _norm_step(torch.randn(4, 32, requires_grad=True), w, torch.randn(4, 32), False)
    rms_norm_hf(_leaked((4, 32)), w, 1e-6).sum().backward()
    g, u = torch.randn(4, 24, requires_grad=True), torch.randn(4, 24, requires_grad=True)
    _gated_step(g, u, torch.randn(4, 24))
    gated_activation(_leaked((4, 24)), "swiglu", u).sum().backward()
    assert u.grad is not None


@needs_kernel
def test_a_bi_norm_without_a_weight_raises_the_paths_error(kept_norm):
    from truefuse.autograd.norm import rms_norm_hf

    with torch.no_grad(), batch_invariant(), pytest.raises(ValueError, match="weight"):
        rms_norm_hf(torch.randn(4, 32), None, 1e-6)
