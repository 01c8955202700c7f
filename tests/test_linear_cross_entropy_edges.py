"""linear_cross_entropy at its edges, against ``linear_cross_entropy_ref`` (and so torch): repeated
backward with retain_graph, NaN / ±inf logits, ignored tokens with non-finite hidden states,
an empty batch, and non-finite options. Values are compared with ``assert_close(equal_nan=True)``:
NaN exactly where the reference has NaN, the same infinities, close finite values.

On the CPU the Triton loss kernel runs for fp32 under the interpreter (BLOCK_V 64) and the PyTorch
chunk math for fp64 and bf16; the ``requires_cuda`` tests run the CUDA kernel (BLOCK_V 2048) in
bf16 and fp32, below and above one block."""

import pytest
import torch
from conftest import requires_cuda

import truefuse
from truefuse.ops._launch.triton import triton_runs
from truefuse.ops.lm_head.linear_cross_entropy import _from_logits, linear_cross_entropy_ref

NAN, INF = float("nan"), float("inf")

# NumPy's warnings from the interpreter running the kernel on inf - inf and the like
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow|divide by zero) encountered:RuntimeWarning")


def _tol(dtype):
    return {
        torch.float64: {"rtol": 1e-10, "atol": 1e-12},
        torch.float32: {"rtol": 1e-5, "atol": 1e-6},
        torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    }[dtype]


def _close(got, want, dtype, what):
    assert got is not None and want is not None, what
    assert got.shape == want.shape, what
    torch.testing.assert_close(got.double(), want.double(), equal_nan=True, msg=what, **_tol(dtype))


def _inputs(dtype, device, N=13, H=16, V=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64) * H**-0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[::4] = -100
    return x.to(device, dtype), W.to(device, dtype), t.to(device), b.to(device, dtype)


def _leaves(*ts):
    return [None if v is None else v.detach().clone().requires_grad_() for v in ts]


# ---------------------------------------------------------------------------------------------
# 1. Repeated backward (retain_graph): every backward adds its own gradient, scaled by its own
#    grad_output, and a returned gradient is never written afterwards by the op.


def _upstream(loss, factor, seed=1):
    if loss.dim() == 0:
        return torch.tensor(factor, dtype=loss.dtype, device=loss.device)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(loss.shape, generator=g, dtype=torch.float64) * factor).to(loss.device, loss.dtype)


def _repeated(fn, x, W, t, b, factors, **kw):
    """Backward ``len(factors)`` times through one graph; the leaves' grads after each."""
    xl, Wl, bl = _leaves(x, W, b)
    loss = fn(xl, Wl, t, linear_bias=bl, **kw)
    seen = []
    for i, f in enumerate(factors):
        loss.backward(_upstream(loss, f), retain_graph=i + 1 < len(factors))
        seen.append(tuple(v.grad.clone() for v in (xl, Wl, bl)))
    return seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("chunk", [None, 5], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_repeated_backward_accumulates_like_the_reference(reduction, chunk, dtype, device):
    """loss.backward(3, retain_graph) then backward(1) then backward(2): the leaves' .grad hold
    3g, 4g, 6g (they held 3g, 2g and then raised 'modified by an inplace operation'); and 1
    then 3 (the first backward's factor is 1: the pass-free fast path) gives g, 4g (was 6g)."""
    x, W, t, b = _inputs(dtype, device, N=9)
    kw = {"reduction": reduction, "z_loss": 1e-3}
    for factors in ((3.0, 1.0, 2.0), (1.0, 3.0)):
        got = _repeated(truefuse.linear_cross_entropy, x, W, t, b, factors, chunk_size=chunk, **kw)
        want = _repeated(linear_cross_entropy_ref, x, W, t, b, factors, **kw)
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            for name, a, r in zip(("d_input", "d_weight", "d_bias"), g, w, strict=True):
                _close(a, r, dtype, f"{factors} backward {k + 1}: {name}")


def _ref_grads_sum(x, W, t, b, factors, **kw):
    return _repeated(linear_cross_entropy_ref, x, W, t, b, factors, **kw)


@pytest.mark.parametrize("chunk", [None, 5], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_repeated_backward_fused_main_grad_adds_each_backward_once(reduction, chunk, device):
    """fuse_wgrad_accumulation: each backward adds its own scaled contribution into main_grad
    (one chunk kept its d_logits, which the old second backward rescaled in place)."""
    dtype = torch.float32  # main_grad is fp32, the GEMM into it takes fp32 / bf16 operands
    x, W, t, b = _inputs(dtype, device, N=9)
    factors = (3.0, 1.0, 2.0)
    want = _ref_grads_sum(x, W, t, b, factors, reduction=reduction)
    xl, Wl, bl = _leaves(x, W, b)
    Wl.main_grad = torch.zeros(W.shape, dtype=torch.float32, device=device)
    loss = truefuse.linear_cross_entropy(
        xl, Wl, t, linear_bias=bl, reduction=reduction, chunk_size=chunk, fuse_wgrad_accumulation=True
    )
    for i, f in enumerate(factors):
        loss.backward(_upstream(loss, f), retain_graph=i + 1 < len(factors))
        assert Wl.grad is None
        _close(xl.grad, want[i][0], dtype, f"backward {i + 1}: d_input")
        _close(bl.grad, want[i][2], dtype, f"backward {i + 1}: d_bias")
        _close(Wl.main_grad, want[i][1], torch.float32, f"backward {i + 1}: main_grad")


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_repeated_backward_delayed_wgrad_sees_each_backward_once(reduction, chunk, fused, device):
    """delay_wgrad_compute: backward_dw() adds every queued backward's own contribution, whatever
    backward ran after it was queued (the old second backward rescaled the first one's kept
    d_logits in place before backward_dw() read them)."""
    dtype = torch.float32
    x, W, t, b = _inputs(dtype, device, N=9)
    factors = (3.0, 1.0, 2.0)
    want = _ref_grads_sum(x, W, t, b, factors, reduction=reduction)
    m = truefuse.LinearCrossEntropyLoss(
        reduction=reduction, chunk_size=chunk, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused
    )
    xl, Wl, bl = _leaves(x, W, b)
    if fused:
        Wl.main_grad = torch.zeros(W.shape, device=device)
    loss = m(xl, Wl, t, bl)
    for i, f in enumerate(factors):
        loss.backward(_upstream(loss, f), retain_graph=i + 1 < len(factors))
        _close(xl.grad, want[i][0], dtype, f"backward {i + 1}: d_input")
        _close(bl.grad, want[i][2], dtype, f"backward {i + 1}: d_bias")
        if i == 0:
            m.backward_dw()  # the first one now, the other two queued together
            _close(Wl.main_grad if fused else Wl.grad, want[0][1], dtype, "backward_dw 1")
    m.backward_dw()
    _close(Wl.main_grad if fused else Wl.grad, want[-1][1], dtype, "backward_dw 2")


# ---------------------------------------------------------------------------------------------
# 2. NaN and ±inf logits: the chunk (Triton kernel, or the PyTorch chunk math) against the
#    reference's own composition on the same logits (``_from_logits``: softcap, F.cross_entropy,
#    z-loss, torch.argmax), per token, with the per-token upstream gradient as the chunk's scales.


def _nonfinite_rows(V, block, seed=0):
    """(logits, targets): one scenario a row, non-finite values in the first, a middle and the
    last block of a row (V > block), or anywhere in the one block (V < block). A NaN is also put
    in a lane whose other logits are all -inf (the lane whose lost NaN gave 16.08 for NaN)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(22, V, generator=g, dtype=torch.float64) * 2
    t = torch.randint(0, V, (22,), generator=g)
    first, mid, last = 3, V // 2 + 1, V - 2  # first block, a middle one (V > 2 blocks), the tail
    rows = []

    def row(i, target=None):
        rows.append(i)
        if target is not None:
            t[i] = target

    z[0, first] = NAN
    row(0)
    z[1, mid] = NAN
    row(1)
    z[2, last] = NAN
    row(2)
    lane = torch.arange(mid % block, V, block)  # the NaN's lane, the rest of it -inf
    z[3, lane] = -INF
    z[3, mid] = NAN
    row(3)
    z[4, [first, last]] = NAN  # two NaNs, the target the first: torch.argmax says correct
    row(4, first)
    z[5, mid] = NAN  # the target the finite maximum: torch.argmax says NaN's index, a miss
    z[5, first] = 50.0
    row(5, first)
    z[6, first] = INF
    row(6)
    z[7, mid] = INF
    row(7, mid)  # the target is the +inf itself
    z[8, last] = INF
    z[8, first] = INF  # twice: the first is the argmax
    row(8, first)
    z[9, first] = -INF
    row(9, first)  # -inf at the target: +inf cross-entropy
    z[10, mid] = -INF
    z[10, last] = -INF
    row(10)
    z[11] = -INF  # the whole row
    row(11)
    z[12, ::3] = -INF
    z[12, mid] = INF
    row(12)
    z[13, mid] = NAN
    z[13, first] = INF
    row(13)
    z[14, last] = NAN
    z[14, first] = -INF
    row(14)
    # ignored rows: nothing of theirs may reach the loss
    for i, (col, val) in zip((15, 16, 17, 18), ((first, NAN), (mid, INF), (last, -INF), (None, -INF)), strict=True):
        if col is None:
            z[i] = val
        else:
            z[i, col] = val
        row(i, -100)
    z[19, first] = 1e30  # finite but huge: softcap saturates it
    row(19, first)
    z[20, mid] = -1e30
    row(20)
    row(21)  # all finite
    assert rows == list(range(22))
    return z, t


def _chunk_vs_reference(dtype, device, V, block, softcap, smoothing, class_weight, path):
    from truefuse.ops.lm_head.linear_cross_entropy import LinearCrossEntropyOptions
    from truefuse.ops.lm_head.linear_cross_entropy_chunk import CrossEntropyChunks

    z64, t = _nonfinite_rows(V, block)
    z, t = z64.to(device, dtype), t.to(device)
    C = z.shape[0]
    cw = None
    if class_weight:
        cw = torch.rand(V, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
        cw[[3, V // 2 + 1, V - 2]] = 0.0  # zero weight on classes holding -inf / NaN logits
        cw = cw.to(device, torch.float64 if dtype == torch.float64 else torch.float32)
    up = torch.randn(C, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    up = up.to(device, wide)
    kw = {"label_smoothing": smoothing, "z_loss": 1e-3, "softcap": softcap}
    loss = CrossEntropyChunks(LinearCrossEntropyOptions(reduction="none", **kw), V, t, cw, up, up, like=z)
    loss.kernel = path == "kernel"  # the Triton kernel, or the same math in PyTorch (chunk_math)
    d = loss.chunk(slice(0, C), z.clone(), None, True)
    ce, zl, ok = loss.ce, loss.zl, loss.correct

    zr = z.to(wide).requires_grad_()
    out = _from_logits(
        zr, t, weight=cw, reduction="none", ignore_index=-100, return_z_loss=True, return_token_accuracy=False, **kw
    )
    (dz,) = torch.autograd.grad(out.loss, zr, up)
    zs = zr.detach() if softcap is None else softcap * torch.tanh(zr.detach() / softcap)
    correct = (zs.argmax(-1) == t) & (t != -100)
    tol = dtype if dtype != torch.bfloat16 else torch.float32  # the loss terms are fp32 from bf16 logits
    _close(ce + zl, out.loss, tol, "loss")
    _close(zl, out.z_loss, tol, "z_loss")
    assert ok.tolist() == correct.tolist(), "token accuracy"
    _close(d, dz, dtype, "d_logits")
    # the rows built to show each behaviour do show it (the reference is what it is said to be)
    assert out.loss[[0, 1, 2, 3]].isnan().all() and out.loss[15:19].eq(0).all()
    if softcap is None:  # a +inf, a whole row of -inf: log_softmax is NaN (softcap makes them ±cap)
        assert out.loss[[6, 11]].isnan().all()
        # -inf at the target: +inf, or NaN with its class weight 0 (0·inf, as torch's nll_loss)
        assert bool(out.loss[9].isnan()) == class_weight and (class_weight or out.loss[9] == INF)
    assert correct[4] and not correct[5]


@pytest.mark.parametrize("class_weight", [False, True], ids=["", "class_weight"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["", "smoothing"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["", "softcap"])
@pytest.mark.parametrize("V", [50, 200], ids=["V50_one_block", "V200_four_blocks"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_nan_inf_logits_match_the_reference(path, V, softcap, smoothing, class_weight, device):
    """NaN, +inf, -inf logits (one, two, a whole row of -inf; targets on them; ignored rows) give
    the reference's loss, z-loss, token accuracy and d_logits: the Triton kernel (fp32 under the
    interpreter, 64-wide blocks) lost a NaN in a lane whose maximum stayed -inf (16.08 for NaN),
    ignored NaN in its argmax, and gave +inf where log_softmax gives NaN (a +inf logit)."""
    if path == "kernel" and not triton_runs(torch.empty(0, device=device)):
        pytest.skip("the Triton kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    dtype = torch.float32 if path == "kernel" else torch.float64
    _chunk_vs_reference(dtype, device, V, 64, softcap, smoothing, class_weight, path)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("V", [1000, 5000], ids=["below_block", "three_blocks"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["", "softcap"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["", "smoothing"])
def test_nan_inf_logits_match_the_reference_cuda(dtype, V, softcap, smoothing):
    """The same rows through the CUDA kernel (BLOCK_V 2048): V below one block and over three."""
    for cw in (False, True):
        _chunk_vs_reference(dtype, torch.device("cuda"), V, 2048, softcap, smoothing, cw, "kernel")


# End to end: non-finite values in the weight, the bias or a hidden state, through
# truefuse.linear_cross_entropy against linear_cross_entropy_ref (every reduction).


def _end_to_end(x, W, t, b, dtype, reduction="mean", check_finite_loss=False, **kw):
    up = None
    got, want = [], []
    for fn, out in ((truefuse.linear_cross_entropy, got), (linear_cross_entropy_ref, want)):
        xl, Wl, bl = _leaves(x, W, b)
        res = fn(xl, Wl, t, linear_bias=bl, reduction=reduction, return_z_loss=True, return_token_accuracy=True, **kw)
        if up is None:
            up = _upstream(res.loss, 1.0)
        res.loss.backward(up)
        out.extend([res.loss.detach(), res.z_loss, res.token_accuracy, xl.grad, Wl.grad, bl.grad])
    for name, a, r in zip(("loss", "z_loss", "accuracy", "d_input", "d_weight", "d_bias"), got, want, strict=True):
        _close(a, r, dtype, name)
    if check_finite_loss:
        assert torch.isfinite(got[0]).all()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("what", ["nan_weight_row", "inf_weight_row", "nan_bias", "neg_inf_bias"])
def test_nan_logit_in_the_weight_or_bias_gives_the_reference(what, dtype, device):
    """One NaN in a weight row at V = 50 (one interpreter block of 64): the loss was 16.08 where
    torch gives NaN. Also an inf weight row (a +inf and a -inf logit on every row), a NaN bias
    and a -inf bias. fp32 runs the kernel, fp64 and bf16 (on the CPU) the PyTorch chunk."""
    if dtype == torch.bfloat16 and device.type == "cuda":
        pytest.skip("bf16 on CUDA: test_nonfinite_end_to_end_cuda")
    x, W, t, b = _inputs(dtype, device, V=50)
    if what == "nan_weight_row":
        W[7, 3] = NAN
    elif what == "inf_weight_row":
        W[7, 3] = INF
    elif what == "nan_bias":
        b[30] = NAN
    else:
        b[30] = -INF  # finite loss (unless the target is class 30): exp(-inf) = 0
        t[t == 30] = 31
    got = _end_to_end(x, W, t, b, dtype)
    if what == "nan_weight_row":
        assert got[0].isnan()
    if what == "neg_inf_bias":
        assert torch.isfinite(got[0]) and torch.isfinite(got[3]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["", "softcap"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_token_with_inf_hidden_state_keeps_the_loss_finite(reduction, softcap, dtype, device):
    """An ignored token whose hidden state is inf (its logits ±inf): the loss is the reference's,
    finite (it was NaN: ce·0 = NaN·0; the reference's own z-loss term had the same fault). The
    gradients are the reference's too: without softcap the ignored row's log_softmax is NaN and
    torch's backward gives it 0 − exp(NaN)·0 = NaN (d_input's row NaN, d_weight and d_bias all
    NaN); with softcap the row's logits are finite, d_input's row is 0 and d_weight is NaN only in
    the column of the inf (0·inf in F.linear's backward). The other rows of d_input stay finite."""
    x, W, t, b = _inputs(dtype, device)
    x[4, 2] = INF
    assert t[4] == -100
    got = _end_to_end(x, W, t, b, dtype, reduction=reduction, check_finite_loss=True, softcap=softcap, z_loss=1e-3)
    dx, dW = got[3], got[4]
    assert torch.isfinite(dx[torch.arange(len(t)) != 4]).all()
    if softcap is None:
        assert dx[4].isnan().all() and dW.isnan().all()
    else:
        assert not dx[4].any() and dW[:, 2].isnan().all() and torch.isfinite(dW[:, [0, 1, 3]]).all()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_ignored_token_upstream_nan_is_not_read(path, device):
    """reduction='none' with a NaN / inf upstream gradient on ignored tokens: torch never reads it
    (their gradient is 0); the chunk multiplied it by 0 (NaN·0: NaN rows in d_input, NaN d_weight)."""
    dtype = torch.float32 if path == "kernel" else torch.float64
    if path == "kernel" and not triton_runs(torch.empty(0, device=device, dtype=dtype)):
        pytest.skip("the Triton kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    x, W, t, b = _inputs(dtype, device)
    up = _upstream(torch.empty(len(t), dtype=dtype, device=device), 1.0)
    up[0], up[4] = NAN, INF  # both ignored
    assert (t[[0, 4]] == -100).all()
    grads = []
    for fn in (truefuse.linear_cross_entropy, linear_cross_entropy_ref):
        xl, Wl, bl = _leaves(x, W, b)
        fn(xl, Wl, t, linear_bias=bl, reduction="none", z_loss=1e-3, label_smoothing=0.1).backward(up)
        grads.append((xl.grad, Wl.grad, bl.grad))
    for name, a, r in zip(("d_input", "d_weight", "d_bias"), *grads, strict=True):
        assert torch.isfinite(r).all()
        _close(a, r, dtype, name)


# ---------------------------------------------------------------------------------------------
# 4. An empty batch: zero gradients, like torch and the all-ignored case.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_gives_zero_gradients(reduction, dtype, device):
    x, W, t, b = _inputs(dtype, device, N=0)
    for fn in (truefuse.linear_cross_entropy, linear_cross_entropy_ref):
        xl, Wl, bl = _leaves(x, W, b)
        loss = fn(xl, Wl, t, linear_bias=bl, reduction=reduction)
        loss.sum().backward()
        assert xl.grad is not None and xl.grad.shape == (0, W.shape[1]), fn.__name__
        for v in (Wl, bl):
            assert v.grad is not None and v.grad.shape == v.shape and not v.grad.any(), fn.__name__
        assert not loss.any()


@pytest.mark.parametrize("mode", ["fused", "fused_overwrite", "delayed", "delayed_fused"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_empty_batch_main_grad_and_delayed_wgrad(reduction, mode, device):
    """Fused main_grad: nothing added (written as zeros under overwrite_main_grad); delayed:
    backward_dw() puts zeros in .grad (or adds nothing to main_grad)."""
    x, W, t, b = _inputs(torch.float32, device, N=0)
    fused, delayed = "fused" in mode, "delayed" in mode
    m = truefuse.LinearCrossEntropyLoss(reduction=reduction, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delayed)
    xl, Wl, bl = _leaves(x, W, b)
    start = torch.full(W.shape, 2.0, device=device)
    if fused:
        Wl.main_grad = start.clone()
    if mode == "fused_overwrite":
        Wl.overwrite_main_grad = True
    m(xl, Wl, t, bl).sum().backward()
    m.backward_dw()
    assert xl.grad.shape == x.shape and bl.grad is not None and not bl.grad.any()
    if fused:
        assert Wl.grad is None
        want = torch.zeros_like(start) if mode == "fused_overwrite" else start
        assert torch.equal(Wl.main_grad, want)
    else:
        assert Wl.grad is not None and Wl.grad.shape == W.shape and not Wl.grad.any()


# ---------------------------------------------------------------------------------------------
# 5. Non-finite options are refused, naming the argument.


@pytest.mark.parametrize(
    "name,value",
    [
        ("z_loss", NAN),
        ("z_loss", INF),
        ("label_smoothing", NAN),
        ("label_smoothing", INF),
        ("softcap", NAN),
        ("softcap", INF),
    ],
)
def test_nan_and_inf_options_are_refused(name, value, device):
    x, W, t, _ = _inputs(torch.float64, device)
    with pytest.raises(ValueError, match=name):
        truefuse.linear_cross_entropy(x, W, t, **{name: value})


# ---------------------------------------------------------------------------------------------
# The CUDA kernel path, bf16 and fp32, below one 2048-wide block and over several.


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("V", [1000, 5000], ids=["below_block", "three_blocks"])
@pytest.mark.parametrize("chunk", [None, 16], ids=["one_chunk", "chunks"])
def test_repeated_backward_cuda(dtype, V, chunk):
    dev = torch.device("cuda")
    x, W, t, b = _inputs(dtype, dev, N=37, H=64, V=V)
    for reduction in ("mean", "none"):
        got = _repeated(truefuse.linear_cross_entropy, x, W, t, b, (3.0, 1.0, 2.0), chunk_size=chunk, reduction=reduction)
        # the same op's single backwards, 3, 1 and 2 times: the sums must follow (bf16 rounding
        # is the op's own; the reference's would differ by the bounded contract's error)
        single = [
            _repeated(truefuse.linear_cross_entropy, x, W, t, b, (f,), chunk_size=chunk, reduction=reduction)[0]
            for f in (3.0, 1.0, 2.0)
        ]
        acc = [single[0]]
        for s in single[1:]:
            acc.append(tuple(a.double() + c.double() for a, c in zip(acc[-1], s, strict=True)))
        for k, (g, w) in enumerate(zip(got, acc, strict=True)):
            for name, a, r in zip(("d_input", "d_weight", "d_bias"), g, w, strict=True):
                _close(a, r.to(a.dtype), dtype, f"{reduction} backward {k + 1}: {name}")
        if dtype == torch.float32:
            want = _repeated(linear_cross_entropy_ref, x, W, t, b, (3.0, 1.0, 2.0), reduction=reduction)
            for k, (g, w) in enumerate(zip(got, want, strict=True)):
                for name, a, r in zip(("d_input", "d_weight", "d_bias"), g, w, strict=True):
                    torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5, msg=f"{reduction} {k + 1}: {name}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("V", [1000, 5000], ids=["below_block", "three_blocks"])
def test_nonfinite_end_to_end_cuda(dtype, V):
    """A NaN weight row (the lost-NaN case: any V below 2048), a +inf weight row, and an ignored
    token with an inf hidden state, through the CUDA kernel: NaN and inf where the reference has
    them, finite elsewhere."""
    dev = torch.device("cuda")
    for what in ("nan_weight_row", "inf_weight_row", "ignored_inf_hidden"):
        x, W, t, b = _inputs(dtype, dev, N=37, H=64, V=V)
        if what == "nan_weight_row":
            W[7, 3] = NAN
        elif what == "inf_weight_row":
            W[7, 3] = INF
        else:
            x[4, 2] = INF
        got = _end_to_end(x, W, t, b, dtype, check_finite_loss=what == "ignored_inf_hidden", z_loss=1e-3)
        if what == "nan_weight_row":
            assert got[0].isnan()
