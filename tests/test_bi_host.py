"""Batch-invariant mode's host-time shortcuts (experiments/host_time.py bi-stubbed) give the bits of the
paths they shortcut, and a kept runner or plan is never reused for a call it does not fit: another
shape, dtype, device, flag or override gets its own (``ops/gemm/gemm_runners.py::_runner``, the no-grad
``linear``)."""

import pytest
import torch
from conftest import requires_cuda

import truefuse
from truefuse.autograd._wgrad import WgradState
from truefuse.autograd.linear import LinearFunction, linear
from truefuse.ops.gemm import gemm as G
from truefuse.ops.gemm import gemm_runners
from truefuse.ops.gemm.gemm_checks import validate
from truefuse.ops.gemm.gemm_plan import Capability, backend_available, override_capabilities

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
_STATE = WgradState(owner="test")


def _t(shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _general(a, b, **kw):
    checks = {k: v for k, v in kw.items() if k != "batch_invariant"}  # the entries resolve the mode
    return G._gemm(a, b, validate(a, b, **checks), per_group=False, **kw)  # the general path, checked as they check


def _triton_bi():
    """The Triton backend with a batch-invariant row on the CPU: the plan CUDA's forward gets."""
    if not backend_available("triton", "cpu"):
        pytest.skip("the Triton interpreter is off")
    return override_capabilities(add=[Capability("batch_invariant", F32, F32, "cpu", backend="triton")])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 3, 17, 70])
def test_triton_bi_runner_launches_without_the_executor_same_bits(M, bias, monkeypatch):
    """The runner of the batch-invariant Triton plan launches the product itself (the executor is
    not called) and gives the general path's bits, for both B layouts (forward ``x Wᵀ``, input
    gradient ``dy W``) and every M bucket."""
    x, w = _t((M, 40), seed=1), _t((24, 40), seed=2)
    dy = _t((M, 24), seed=3)
    bv = _t((24,), seed=4) if bias else None
    with _triton_bi():
        want_f = _general(x, w.t(), bias=bv, batch_invariant=True)
        want_b = _general(dy, w, batch_invariant=True)
        monkeypatch.setattr(gemm_runners, "run", lambda *a, **k: pytest.fail("the Triton runner went through the executor"))
        got_f = truefuse.gemm(x, w.t(), bias=bv, batch_invariant=True)
        got_b = truefuse.gemm(dy, w, batch_invariant=True)
    assert torch.equal(got_f, want_f) and torch.equal(got_b, want_b)


def test_runner_cache_keys_flags_dtypes_and_overrides():
    """Calls alternating what the runner is keyed on each get their own plan's result: the same
    call in and out of the override (Triton BI / the CPU's row blocks), batch_invariant on and off,
    fp32 and fp64, with and without a bias, another N and M, and out_dtype."""
    x, w, bv = _t((37, 40), seed=5), _t((24, 40), seed=6), _t((24,), seed=7)
    calls = [
        (x, w.t(), {"batch_invariant": True}),
        (x, w.t(), {"batch_invariant": False}),
        (x, w.t(), {"batch_invariant": True, "bias": bv}),
        (x.double(), w.t().double(), {"batch_invariant": True}),
        (x[:5], w[:7].t(), {"batch_invariant": True}),
        (x.to(BF16), w.t().to(BF16), {"batch_invariant": True, "out_dtype": F32}),
    ]
    for _ in range(2):  # the second round reads the runners the first one kept
        for inside in (True, False, True):
            ctx = _triton_bi() if inside else override_capabilities()
            with ctx:
                for a, b, kw in calls:
                    want = _general(a, b, **kw)
                    got = truefuse.gemm(a, b, **kw)
                    assert got.dtype == want.dtype and torch.equal(got, want), (inside, a.dtype, kw.keys())


def test_runner_follows_the_switch():
    """``batch_invariant=None`` reads the switch at each call: a kept runner is not the other mode's."""
    x, w = _t((37, 40), seed=8), _t((24, 40), seed=9)
    with _triton_bi():
        off = truefuse.gemm(x, w.t())
        with truefuse.batch_invariant():
            on = truefuse.gemm(x, w.t())
        assert torch.equal(off, _general(x, w.t(), batch_invariant=False))
        assert torch.equal(on, _general(x, w.t(), batch_invariant=True))


@pytest.mark.parametrize("bi", [False, True])
@pytest.mark.parametrize("shape", [(1, 40), (5, 40), (2, 3, 40)])
def test_no_grad_linear_equals_the_function(shape, bi, monkeypatch):
    """``linear`` without a graph to record runs the Function's forward GEMM without the Function:
    the same bits as the Function's forward (which runs when a weight requires grad)."""
    x, w, bv = _t(shape, seed=10), _t((24, 40), seed=11), _t((24,), seed=12)
    wg = w.clone().requires_grad_()
    with _triton_bi(), truefuse.batch_invariant(bi):
        want = linear(x, wg, bv, state=_STATE).detach()
        with torch.no_grad():
            monkeypatch.setattr(LinearFunction, "apply", lambda *a: pytest.fail("no-grad linear built a Function"))
            got_nograd = linear(x, wg, bv, state=_STATE)
        got_frozen = linear(x, w, bv, state=_STATE)  # grad mode on, nothing requires grad
    assert torch.equal(got_nograd, want) and torch.equal(got_frozen, want)
    assert not got_nograd.requires_grad and got_nograd.shape == (*shape[:-1], 24)


def test_linear_keeps_the_function_for_activation_and_autocast(monkeypatch):
    """The no-grad shortcut is only for the plain product: an activation or autocast takes the Function."""
    x, w = _t((5, 40), seed=13), _t((24, 40), seed=14)
    seen = []
    real = LinearFunction.apply
    monkeypatch.setattr(LinearFunction, "apply", lambda *a: seen.append(a[3]) or real(*a))
    with torch.no_grad():
        linear(x, w, None, activation="gelu", state=_STATE)
        with torch.autocast("cpu", dtype=BF16):
            linear(x, w, None, state=_STATE)
    assert seen == ["gelu", None]


def _first_valid_key_before(attn_mask, B):
    """``first_valid_key`` as it was (eleven ops), the oracle of the five-op form."""
    from truefuse.ops.attention.attention_mask import masked_out

    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    seen = (~masked_out(m)).any(dim=2).any(dim=1)
    first = torch.where(seen.any(-1), seen.to(torch.int8).argmax(-1), 0)
    return first.to(torch.int32).expand(B).contiguous()


@pytest.mark.parametrize("shape", [(3, 1, 1, 9), (3, 2, 4, 9), (1, 1, 4, 9), (4, 9), (9,)])
@pytest.mark.parametrize("kind", ["bool", "inf", "finfo"])
def test_first_valid_key_same_as_before(shape, kind):
    from truefuse.ops.attention.attention_mask import first_valid_key

    g = torch.Generator().manual_seed(len(shape))
    keep = torch.rand(shape, generator=g) > 0.6
    keep[..., :2] = False  # a left pad
    if len(shape) == 4 and shape[0] == 3:
        keep[1] = False  # a sequence that sees no key
    mask = (
        keep
        if kind == "bool"
        else torch.zeros(shape).masked_fill(~keep, float("-inf") if kind == "inf" else torch.finfo(F32).min)
    )
    got = first_valid_key(mask, 3, 9, mask.device)
    want = _first_valid_key_before(mask, 3)
    assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got, want)


def test_first_valid_key_kept_on_the_mask_until_written(monkeypatch):
    """A decoder's layers share one mask: the key start is computed once for it, and again for a
    mask written in place since (its version), another batch size, or another mask."""
    import truefuse.autograd.attention as A

    calls = []
    real = A.first_valid_key
    monkeypatch.setattr(A, "first_valid_key", lambda *a: calls.append(1) or real(*a))
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., :3] = False
    first = A._first_valid_key(mask, 2, 9, mask.device)
    assert torch.equal(A._first_valid_key(mask, 2, 9, mask.device), first) and len(calls) == 1
    mask[0, ..., :5] = False  # written in place: recomputed
    again = A._first_valid_key(mask, 2, 9, mask.device)
    assert len(calls) == 2 and again.tolist() == [5, 3]
    A._first_valid_key(mask, 2, 9, mask.device)
    A._first_valid_key(mask.clone(), 2, 9, mask.device)
    assert len(calls) == 3


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_attention_eager_path_same_bits_as_the_dispatcher(dtype, device, monkeypatch):
    """``truefuse.attention`` in eager mode runs the op's body and registered backward without the
    dispatcher (``autograd/_eager_op.py``): the dispatcher's forward and gradients, bitwise."""
    from truefuse.ops._launch.triton import triton_runs
    from truefuse.ops.attention import attention as A

    q = _t((2, 4, 18, 16), dtype, seed=20).to(device)
    if not triton_runs(q):
        pytest.skip("no Triton kernel for this dtype here (the interpreter: fp32 only)")
    k, v = _t((2, 2, 18, 16), dtype, seed=21).to(device), _t((2, 2, 18, 16), dtype, seed=22).to(device)
    do = _t((2, 4, 18, 16), dtype, seed=23).to(device)
    mask = torch.ones(2, 1, 18, 18, dtype=torch.bool, device=device).tril()
    mask[1, ..., :3] = False

    def run(use_dispatcher):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        if use_dispatcher:
            ks = torch.tensor([0, 3], dtype=torch.int32, device=device)
            out = A.attention_fwd_op(*ts, mask.expand(2, 4, 18, 18), ks, 0.25, False, 0, 0.0)[0]
        else:
            out = truefuse.attention(*ts, attn_mask=mask, scale=0.25, enable_gqa=True)
        out.backward(do)
        return [out.detach(), *(t.grad for t in ts)]

    want = run(True)
    calls = []
    body = A.attention_bwd_op.body
    monkeypatch.setattr(A.attention_bwd_op, "body", lambda *a: calls.append(1) or body(*a))
    got = run(False)
    assert calls == [1]  # the backward op ran as its body
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_routing_swaps_f_linear_for_the_block_and_this_thread_only(monkeypatch):
    """``running_batch_invariant()`` routes ``F.linear`` on its own thread only, runs truefuse's own
    ``F.linear`` calls inside a routed call stock, and puts torch's function back when the last
    block exits (nested, out of order, or by an exception)."""
    import threading

    import torch.nn.functional as F

    from truefuse.integrations.huggingface import batch_invariant as bim

    stock = torch._C._nn.linear
    assert F.linear is stock
    x, w = _t((5, 40), seed=30), _t((24, 40), seed=31)
    with bim.running_batch_invariant() as mode:
        y = F.linear(x, w)
        seen = {}

        def other():  # stock's reference in the same thread: a new thread's BLAS may split otherwise
            seen["y"], seen["stock"] = F.linear(x, w), stock(x, w)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert mode.routed == 1 and torch.equal(seen["y"], seen["stock"])  # the other thread: stock
        inner = bim._truefuse_linear

        def nested(*a, **k):  # a truefuse layer calling F.linear inside the routed call: stock
            assert F.linear(x, w) is not None
            return inner(*a, **k)

        monkeypatch.setattr(bim, "_truefuse_linear", nested)
        F.linear(x, w)
        assert mode.routed == 2 and mode.left == 0
    assert F.linear is stock
    with truefuse.batch_invariant():
        assert torch.equal(y, linear(x, w, None, state=_STATE))

    a, b = bim.BatchInvariantLinear(), bim.BatchInvariantLinear()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # out of order, as two models' hooks may exit
    F.linear(x, w)
    assert (a.routed, b.routed) == (0, 1) and F.linear is not stock
    b.__exit__(None, None, None)
    assert F.linear is stock
    with pytest.raises(RuntimeError, match="boom"), bim.running_batch_invariant():
        raise RuntimeError("boom")
    assert F.linear is stock and not truefuse.is_batch_invariant()


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_torch_mm_runner_skips_the_executor_same_bits(dtype, monkeypatch):
    """A bare product planned on ``torch`` (the weight gradient's GEMM) runs the backend's product
    in its scope without the executor: the general path's bits."""
    dy, x = _t((50, 24), dtype, seed=40), _t((50, 40), dtype, seed=41)
    want = _general(dy.t(), x, batch_invariant=False)
    monkeypatch.setattr(gemm_runners, "run", lambda *a, **k: pytest.fail("the torch runner went through the executor"))
    got = G.plain_gemm(dy.t(), x, batch_invariant=False)
    assert got.dtype == want.dtype and torch.equal(got, want)


@requires_cuda
@pytest.mark.parametrize("dtype", [BF16, torch.float16, F32])
def test_runners_same_bits_gpu(dtype, monkeypatch):
    """On CUDA: the batch-invariant Triton runner (forward ``x Wᵀ`` with a bias, input gradient
    ``dy W``, every M bucket) and the torch runner (the weight gradient, bf16/fp16 -> fp32 too)
    give the general path's bits, without the executor; the no-grad linear the Function's."""
    dev = "cuda"
    w, bv = _t((320, 256), dtype, 50).to(dev), _t((320,), dtype, 51).to(dev)
    for M in (1, 16, 17, 64, 65, 300):
        x, dy = _t((M, 256), dtype, 52).to(dev), _t((M, 320), dtype, 53).to(dev)
        want = [
            _general(x, w.t(), bias=bv, batch_invariant=True),
            _general(dy, w, batch_invariant=True),
            _general(dy.t(), x, batch_invariant=False),
            _general(dy.t(), x, out_dtype=F32, batch_invariant=False),
        ]
        with monkeypatch.context() as m:
            m.setattr(gemm_runners, "run", lambda *a, **k: pytest.fail("a runner went through the executor"))
            got = [
                truefuse.gemm(x, w.t(), bias=bv, batch_invariant=True),
                G.plain_gemm(dy, w, batch_invariant=True),
                G.plain_gemm(dy.t(), x, batch_invariant=False),
                G.plain_gemm(dy.t(), x, out_dtype=F32, batch_invariant=False),
            ]
        for i, (g, wnt) in enumerate(zip(got, want, strict=True)):
            assert g.dtype == wnt.dtype and torch.equal(g, wnt), (M, i)
        with truefuse.batch_invariant():
            wg = w.clone().requires_grad_()
            fn = linear(x, wg, bv, state=_STATE).detach()
            with torch.no_grad():
                assert torch.equal(linear(x, wg, bv, state=_STATE), fn), M


def _node(y) -> str:
    """The Function node under ``linear``'s output view."""
    fn = y.grad_fn
    while type(fn).__name__ == "ViewBackward0":
        fn = fn.next_functions[0][0]
    return type(fn).__name__


@pytest.mark.parametrize("wgrad", ["plain", "delayed", "main_grad"])
@pytest.mark.parametrize("bi", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 40), (5, 40), (2, 3, 40)])
def test_plain_linear_function_same_bits_as_linear_function(shape, bias, bi, wgrad, monkeypatch):
    """The plain call's Function (no activation, no autocast) gives LinearFunction's bits for the
    output and every gradient, in and out of batch-invariant mode, under each §2 configuration
    (the weight gradient returned, queued until ``run_pending``, added into fp32 ``main_grad``)."""
    import truefuse.autograd.linear as L
    from truefuse.autograd._wgrad import run_pending

    def run():
        x = _t(shape, seed=20).requires_grad_()
        w = _t((24, 40), seed=21).requires_grad_()
        bv = _t((24,), seed=22).requires_grad_() if bias else None
        state = WgradState(delay_wgrad_compute=wgrad == "delayed", fuse_wgrad_accumulation=wgrad == "main_grad")
        if wgrad == "main_grad":
            w.main_grad = _t((24, 40), seed=24)
        with _triton_bi(), truefuse.batch_invariant(bi):
            y = linear(x, w, bv, state=state)
        y.backward(_t(y.shape, seed=23))
        run_pending(state)
        wg = w.main_grad if wgrad == "main_grad" else w.grad
        return [y.detach(), x.grad, wg] + ([bv.grad] if bias else []), _node(y)

    got, fn = run()
    assert fn == "_PlainLinearFunctionBackward"
    monkeypatch.setattr(L, "_plain_call", lambda *a: False)
    want, fn = run()
    assert fn == "LinearFunctionBackward"
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_plain_linear_function_only_for_the_plain_call():
    """An activation, autocast or a bias of another dtype (its error) take LinearFunction, any §2
    configuration the plain call's Function; the double backward is refused as LinearFunction's is."""
    x, w = _t((5, 40), seed=24).requires_grad_(), _t((24, 40), seed=25).requires_grad_()

    def fn_name(**kw):
        kw.setdefault("state", _STATE)
        xx, ww, bb = kw.pop("x", x), kw.pop("w", w), kw.pop("b", None)
        return _node(linear(xx, ww, bb, **kw))

    assert fn_name() == "_PlainLinearFunctionBackward"
    assert fn_name(activation="gelu") == "LinearFunctionBackward"
    assert fn_name(state=WgradState(delay_wgrad_compute=True)) == "_PlainLinearFunctionBackward"
    with pytest.raises(TypeError, match="bias has dtype"):  # not taken: the general path's error
        fn_name(b=_t((24,), F64, seed=26))
    with torch.autocast("cpu", dtype=BF16):
        assert _node(linear(x, w, None, state=_STATE)) == "LinearFunctionBackward"
    y = linear(x, w, None, state=_STATE)
    (gx,) = torch.autograd.grad(y.square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        gx.sum().backward()
