"""linear_cross_entropy against a float64 reference (bounded: no less accurate than F.linear in the
input dtype + cross-entropy in fp32) over every option the issue lists, and its errors."""

import pytest
import torch
from conftest import requires_cuda

import truefuse
from truefuse.config import get_tuning, tuning
from truefuse.ops._launch.triton import triton_runs
from truefuse.ops.lm_head.linear_cross_entropy import linear_cross_entropy_ref
from truefuse.verify.cases_linear_cross_entropy import check_lce, chunked_tokens, make_inputs
from truefuse.verify.registry import all_cases

DTYPES = [torch.bfloat16, torch.float32]


def _tokens_for_7(device) -> int:
    """Tokens of the chunk_size=7 tests: make_inputs' 53 on a GPU; 17 under the CPU interpreter (a
    program per token), which chunk_size=7 still splits into two whole chunks and a tail."""
    return 53 if device.type == "cuda" else 17


def _assert(reports):
    for k, rep in reports.items():
        assert rep.passed, f"{k}: error {rep.error:.3e} vs baseline {rep.baseline_error:.3e}"


def test_registered_cases(device):
    """Every registered case on the GPU; on the CPU (the interpreter is slow) all options at once,
    main_grad and delayed against immediate (tests/test_properties.py draws each option alone)."""
    cases = all_cases(["linear_cross_entropy"], device.type)
    assert len(cases) == 20
    for c in cases:
        if device.type == "cuda" or c.name.startswith(("everything", "fused", "delayed")):
            _assert(c.fn(device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ignore", ["some", "none", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_and_ignore(reduction, ignore, dtype, device):
    x, W, t, b = make_inputs(dtype, device, N=chunked_tokens(device), ignore=ignore, bias=True)  # chunk_size=16
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) if reduction == "none" else None
    reports = check_lce(x, W, t, b, reduction=reduction, upstream=up, chunk_size=16)
    if ignore == "all":  # nothing counts: 0 and zero gradients (mean: never NaN, unlike torch)
        x.requires_grad_()
        W.requires_grad_()
        loss = truefuse.linear_cross_entropy(x, W, t, reduction=reduction)
        loss.sum().backward()
        for v in (loss, x.grad, W.grad):
            assert not torch.isnan(v).any() and not v.any()
    else:
        _assert(reports)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_sizes_and_leading_dims(dtype, device):
    n = 53 if device.type == "cuda" else 13  # the interpreter: a program per token (2 x 3 x 13 still 16 chunks)
    for N, H, V, lead in [(1, 40, 203, ()), (n, 33, 130, (2, 3)), (7, 17, 1, ())]:
        x, W, t, b = make_inputs(dtype, device, N=N, H=H, V=V, lead=lead, ignore="none", bias=True)
        _assert(check_lce(x, W, t, b, chunk_size=5))


@pytest.mark.parametrize("grads", [("input",), ("linear_weight",), ("linear_bias",)])
def test_only_some_inputs_need_grad(grads, device):
    x, W, t, b = make_inputs(torch.float32, device, N=chunked_tokens(device), bias=True)
    _assert(check_lce(x, W, t, b, grads=grads, chunk_size=16, z_loss=1e-3))


def test_gradient_scales_with_grad_output_and_retain_graph(device):
    x, W, t, _ = make_inputs(torch.float32, device, N=chunked_tokens(device))  # chunk_size=16
    x.requires_grad_()
    W.requires_grad_()
    loss = truefuse.linear_cross_entropy(x, W, t, chunk_size=16)
    loss.backward(torch.tensor(1.0, device=device), retain_graph=True)
    g1 = x.grad.clone(), W.grad.clone()
    x.grad = W.grad = None
    (2.5 * loss).backward(retain_graph=True)  # grad_output 2.5 after 1.0 on the same saved gradients
    torch.testing.assert_close(x.grad, 2.5 * g1[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(W.grad, 2.5 * g1[1], rtol=1e-6, atol=0)
    x.grad = W.grad = None
    loss.backward()  # back to 1.0: the same gradients again
    torch.testing.assert_close(x.grad, g1[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(W.grad, g1[1], rtol=1e-6, atol=0)


def test_no_grad_computes_only_the_loss_and_extras(device):
    x, W, t, _ = make_inputs(torch.float64, device)
    t[:20] = (x[:20] @ W.t()).argmax(-1)  # some tokens predicted right, so the accuracy is in (0, 1)
    with torch.no_grad():
        out = truefuse.linear_cross_entropy(x, W, t, z_loss=1e-2, return_z_loss=True, return_token_accuracy=True, chunk_size=7)
    ref = linear_cross_entropy_ref(x, W, t, z_loss=1e-2, return_z_loss=True, return_token_accuracy=True)
    for a, r in zip(out, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    assert 0 < float(out.token_accuracy) < 1
    with torch.no_grad():  # fp32: the Triton chunk kernel where it runs (its argmax, its flags)
        out32 = truefuse.linear_cross_entropy(x.float(), W.float(), t, return_token_accuracy=True, chunk_size=7)
    assert float(out32.token_accuracy) == float(out.token_accuracy)


def test_errors(device):
    x, W, t, _ = make_inputs(torch.float32, device)
    lce = truefuse.linear_cross_entropy
    bad = t.clone()
    bad[3] = W.shape[0]
    with pytest.raises(ValueError, match=r"target holds 203, outside \[0, 203\) and not ignore_index=-100"):
        lce(x, W, bad)
    with pytest.raises(ValueError, match="target holds 203"):  # with class weights indexed by target
        lce(x, W, bad, weight=torch.ones(W.shape[0], device=device), reduction="none")
    bad[3] = -5
    with pytest.raises(ValueError, match="target holds -5"):
        lce(x, W, bad)
    with torch.no_grad(), pytest.raises(ValueError, match="target holds -5"):
        lce(x, W, bad, weight=torch.ones(W.shape[0], device=device))
    with pytest.raises(ValueError, match="linear_weight must be"):
        lce(x, W[:, :-1], t)
    with pytest.raises(ValueError, match="V = 0 classes"):
        lce(x, W[:0], t)
    with pytest.raises(ValueError, match="target has shape"):
        lce(x, W, t[:-1])
    with pytest.raises(TypeError, match="target must hold class indices"):
        lce(x, W, t.float())
    with pytest.raises(TypeError, match="linear_weight has dtype"):
        lce(x, W.double(), t)
    with pytest.raises(ValueError, match="weight must have shape"):
        lce(x, W, t, weight=torch.ones(7, device=device))
    with pytest.raises(ValueError, match="reduction must be one of"):
        lce(x, W, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        lce(x, W, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        lce(x, W, t, softcap=0.0)


@pytest.mark.parametrize("mode", ["one_chunk", "delayed", "chunks", "main_grad_chunks"])
def test_padded_rows_and_split_vocabulary_agree_with_one_gemm(device, monkeypatch, mode):
    """V = 203: the logits rows are padded to 256 (16-byte aligned for the kernel) and each GEMM is
    split at 192 classes (``chunked_head_gemms``). Loss and every gradient agree with the
    unpadded, unsplit run: through one chunk, the one-chunk d_logits kept for a delayed weight
    gradient (sliced back to V columns), several chunks with the fp32 accumulator, and main_grad."""
    import truefuse.ops.lm_head.chunked_head as head_mod
    import truefuse.ops.lm_head.chunked_head_gemms as gemms_mod

    # 21 tokens: chunk_size=16 still runs a whole chunk and a tail (the interpreter: one program per token)
    x, W, t, b = make_inputs(torch.float32, device, N=21, bias=True)
    if not triton_runs(x):
        pytest.skip("the logits are padded for the Triton kernel only")
    splits = []
    real = gemms_mod.vocab_split
    monkeypatch.setattr(head_mod, "vocab_split", lambda *a: splits.append(real(*a)) or splits[-1])
    kw = {"chunk_size": 16} if "chunks" in mode else {}
    fused = mode == "main_grad_chunks"
    out = {}
    for align in (1, 64):
        splits.clear()
        m = truefuse.LinearCrossEntropyLoss(
            z_loss=1e-3, delay_wgrad_compute=mode == "delayed", fuse_wgrad_accumulation=fused, **kw
        )
        xl, Wl, bl = x.clone().requires_grad_(), W.clone().requires_grad_(), b.clone().requires_grad_()
        if fused:
            Wl.main_grad = torch.ones(W.shape, device=device)
        # min_macs=1: small sizes are neither padded nor split by default
        with tuning(min_macs=1, align=align):
            loss = m(xl, Wl, t, bl)
            (loss * 3.0).backward()
            m.backward_dw()
        assert splits and all(s == (None if align == 1 else 192) for s in splits), splits
        out[align] = (loss, xl.grad, Wl.main_grad if fused else Wl.grad, bl.grad)
    for name, a, b_ in zip(("loss", "d_input", "d_weight", "d_bias"), out[1], out[64], strict=True):
        assert a.shape == b_.shape, name
        torch.testing.assert_close(b_, a, rtol=1e-5, atol=1e-6, msg=name)


@requires_cuda
def test_odd_vocabulary_at_scale_is_bounded(monkeypatch):
    """GPT-2's V = 50257 at a size where the GEMMs are split (the ``min_macs`` tuning knob): per-token losses under
    a random upstream gradient and every gradient within the bounded contract, bf16 on the GPU."""
    import truefuse.ops.lm_head.chunked_head as head_mod

    dev = torch.device("cuda")
    x, W, t, b = make_inputs(torch.bfloat16, dev, N=1024, H=128, V=50257, bias=True)
    splits = []
    real = head_mod.vocab_split
    monkeypatch.setattr(head_mod, "vocab_split", lambda *a: splits.append(real(*a)) or splits[-1])
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(4))
    _assert(check_lce(x, W, t, b, reduction="none", upstream=up, z_loss=1e-3))
    assert splits and all(s == 50240 for s in splits), splits


@requires_cuda
def test_one_chunk_of_logits_alive_at_a_time():
    """Peak memory of a chunked forward + backward: the fp32 weight-gradient accumulator, one
    chunk's logits and the returned gradients (plus slack), not two chunks' logits."""
    dev = torch.device("cuda")
    N, V, H, C = 4096, 32768, 512, 1024
    x, W, t, _ = make_inputs(torch.bfloat16, dev, N=N, H=H, V=V, ignore="none")
    x.requires_grad_()
    W.requires_grad_()
    truefuse.linear_cross_entropy(x, W, t, chunk_size=C).backward()  # warm-up: cuBLAS workspace, kernel
    x.grad = W.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    truefuse.linear_cross_entropy(x, W, t, chunk_size=C).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    mib = 1 << 20
    acc, chunk, grads = V * H * 4, C * V * 2, (N * H + V * H) * 2
    two = (acc + 2 * chunk + grads) / mib
    assert peak <= acc + chunk + grads + 16 * mib, f"peak {peak / mib:.0f} MiB; with two chunks alive {two:.0f}"


def test_module_matches_function(device):
    x, W, t, b = make_inputs(torch.float64, device, bias=True)
    cw = torch.rand(W.shape[0], dtype=torch.float64, device=device)
    m = truefuse.LinearCrossEntropyLoss(weight=cw, label_smoothing=0.1, z_loss=1e-3, chunk_size=8)
    got = m(x, W, t, b)
    want = linear_cross_entropy_ref(x, W, t, linear_bias=b, weight=cw, label_smoothing=0.1, z_loss=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert "label_smoothing=0.1" in repr(m)


def test_weight_grad_accumulated_in_the_weight_dtype(device):
    """fp32_weight_grad=False: one rounding per chunk; with a single chunk it is the same GEMM."""
    x, W, t, _ = make_inputs(torch.float32, device, N=21)  # chunk_size=16: a whole chunk and a tail
    grads = []
    for fp32, chunk in ((True, 1000), (False, 1000), (False, 16)):
        Wl = W.clone().requires_grad_()
        truefuse.linear_cross_entropy(x, Wl, t, chunk_size=chunk, fp32_weight_grad=fp32).backward()
        grads.append(Wl.grad)
    assert torch.equal(grads[0], grads[1])
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-5, atol=1e-7)


def test_default_chunk_takes_all_tokens_only_within_the_chunked_memory():
    """One chunk when every token's logits fit in what chunking would hold anyway (the chunk_bytes
    tuning knob, or the fp32 weight-gradient accumulator's V·H·4 bytes when that is wanted), or,
    with the accumulator, when one chunk's peak is at most 1/8 above the chunks'; else the largest
    power of two that fits there."""
    from truefuse.ops.lm_head.chunked_head import default_chunk as _default_chunk

    assert get_tuning().chunk_bytes == 512 << 20
    assert _default_chunk(8192, 128256, 4096, 2, True) == 8192  # 2.10 GB of logits == the fp32 accumulator
    assert _default_chunk(8193, 128256, 4096, 2, True) == 8193  # 3.15 GB in one chunk against 4.20 in chunks
    assert _default_chunk(14336, 128256, 4096, 2, True) == 14336  # 4.73 against 4.20: within 1/8
    assert _default_chunk(14337, 128256, 4096, 2, True) == 8192
    assert _default_chunk(16384, 128256, 4096, 2, True) == 8192  # 5.25 against 4.20
    assert _default_chunk(8192, 152064, 3584, 2, True) == 8192  # 3.58 against 3.43 (linear_log_probs: no recompute)
    assert _default_chunk(8192, 128256, 4096, 2, False) == 2048  # no accumulator to trade for
    assert _default_chunk(4096, 256000, 2304, 2, True) == 4096
    assert _default_chunk(100, 1000, 64, 4, False) == 100  # small: inside chunk_bytes
    assert _default_chunk(0, 1000, 64, 4, True) == 1


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_target_prologue_is_the_torch_ops_bits(reduction, device):
    """One kernel for the count of the valid tokens, mean's scales and the target check (where
    the Triton kernels run): the bits of valid_count / reduction_scales, and the same errors."""
    from truefuse.ops.lm_head.linear_cross_entropy import reduction_scales, target_prologue, valid_count

    x = torch.empty(0, 8, device=device)
    for t in (
        torch.tensor([3, -100, 0, 9, -100], device=device),
        torch.full((3,), -100, device=device),
        torch.arange(200, device=device) % 7,
    ):
        n, s_ce, s_z, finish = target_prologue(t, 10, -100, reduction, None, x)
        finish()
        want_n = valid_count(t != -100, torch.float32)
        assert torch.equal(n, want_n)
        for got, want in zip((s_ce, s_z), reduction_scales(reduction, want_n, t, None, -100, x), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    for bad in (10, -1):
        t = torch.tensor([1, -100, bad, 2], device=device)
        with pytest.raises(ValueError, match=f"target holds {bad}"):
            target_prologue(t, 10, -100, reduction, None, x)[3]()


def test_one_chunk_and_many_chunks_agree(device):
    x, W, t, _ = make_inputs(torch.float32, device)
    grads = []
    for chunk in (None, 7):
        xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
        truefuse.linear_cross_entropy(xl, Wl, t, chunk_size=chunk, z_loss=1e-3).backward()
        grads.append((xl.grad, Wl.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _plain_grads(x, W, t, **kw):
    xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
    (truefuse.linear_cross_entropy(xl, Wl, t, **kw) * kw.pop("_scale", 1.0)).sum().backward()
    return xl.grad, Wl.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_fused_main_grad(device, reduction, chunk):
    """docs/design.md §2 for the loss's weight: the gradient (scaled by grad_output) is added into
    main_grad, autograd gets None; d_input is unchanged. One chunk (d_logits kept for the backward)
    and several (recomputed in the backward), every reduction."""
    x, W, t, _ = make_inputs(torch.float32, device, N=_tokens_for_7(device))
    kw = {"reduction": reduction, "chunk_size": chunk, "z_loss": 1e-3}
    dx_want, dW_want = _plain_grads(x, W, t, **kw)
    xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
    start = torch.randn(W.shape, generator=torch.Generator().manual_seed(5)).to(device)
    Wl.main_grad = start.clone()
    loss = truefuse.linear_cross_entropy(xl, Wl, t, fuse_wgrad_accumulation=True, **kw)
    (loss * 3.0).sum().backward()
    assert Wl.grad is None
    torch.testing.assert_close(xl.grad, 3.0 * dx_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(Wl.main_grad, start + 3.0 * dW_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 7])
def test_fused_main_grad_megatron_attribute_overwrite_and_retain_graph(device, chunk):
    x, W, t, _ = make_inputs(torch.float32, device, N=_tokens_for_7(device))
    _, dW_want = _plain_grads(x, W, t, chunk_size=chunk)
    Wl = W.clone().requires_grad_()
    Wl.main_grad = torch.full(W.shape, 7.0, device=device)
    Wl.grad_added_to_main_grad = False
    Wl.overwrite_main_grad = True
    loss = truefuse.linear_cross_entropy(x, Wl, t, chunk_size=chunk, fuse_wgrad_accumulation=True)
    loss.backward(retain_graph=True)
    assert Wl.grad_added_to_main_grad is True
    assert Wl.grad is not None and not Wl.grad.any()  # the cached zeros: Megatron's hook sees "done"
    torch.testing.assert_close(Wl.main_grad, dW_want, rtol=1e-5, atol=1e-6)  # overwritten, not added
    del Wl.overwrite_main_grad
    loss.backward()  # a second backward adds once more
    torch.testing.assert_close(Wl.main_grad, 2 * dW_want, rtol=1e-5, atol=1e-6)


def test_fused_main_grad_missing_is_a_clear_error(device):
    x, W, t, _ = make_inputs(torch.float32, device)
    with pytest.raises(RuntimeError, match="linear_weight has no main_grad"):
        truefuse.linear_cross_entropy(x, W.clone().requires_grad_(), t, fuse_wgrad_accumulation=True)
    m = truefuse.LinearCrossEntropyLoss(fuse_wgrad_accumulation=True)
    Wl = W.clone().requires_grad_()
    Wl.main_grad = torch.zeros(W.shape, dtype=torch.float64, device=device)
    with pytest.raises(TypeError, match="needs torch.float32"):
        m(x, Wl, t)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_delayed_weight_grad_is_bitwise_the_immediate_one(device, fused, reduction, chunk):
    """docs/design.md §2: with delay_wgrad_compute the backward returns None for the weight and
    backward_dw() adds the same bits into .grad (or main_grad) as the immediate path."""
    x, W, t, _ = make_inputs(torch.float32, device, N=_tokens_for_7(device))
    out = {}
    for delay in (False, True):
        m = truefuse.LinearCrossEntropyLoss(
            reduction=reduction, chunk_size=chunk, z_loss=1e-3, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay
        )
        xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
        if fused:
            Wl.main_grad = torch.ones(W.shape, device=device)
        (m(xl, Wl, t) * 2.0).sum().backward()
        if delay:
            assert Wl.grad is None and (not fused or torch.equal(Wl.main_grad, torch.ones(W.shape, device=device)))
            m.backward_dw()
            m.backward_dw()  # nothing pending: no-op
        out[delay] = (xl.grad, Wl.main_grad if fused else Wl.grad)
    for a, b in zip(out[False], out[True], strict=True):
        assert torch.equal(a, b)


def test_chunk_kernel_ties_and_infinities(device):
    """The loss kernel's per-lane online softmax against ``chunk_math`` on rows built to break it:
    the maximum tied across lanes and blocks (the first one wins, as torch.argmax), -inf logits
    (first in a lane, and a whole row), +inf, every logit equal, and V not a multiple of the block."""
    from truefuse.ops.lm_head.linear_cross_entropy import LinearCrossEntropyOptions
    from truefuse.ops.lm_head.linear_cross_entropy_chunk import CrossEntropyChunks

    if not triton_runs(torch.empty(0, device=device)):
        pytest.skip("the Triton kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    V = 203  # several blocks of 64 on the CPU, a tail of 11
    z = torch.randn(6, V, generator=torch.Generator().manual_seed(5)).to(device)
    z[0, [7, 70, 150]] = 9.0  # tie across blocks and lanes: index 7 must win
    z[1, [133, 69]] = 9.0  # the later lane is seen first in its block order: index 69 must win
    z[2, ::3] = float("-inf")  # -inf in the first position of lanes
    z[3] = 0.5  # all equal: argmax 0, lse = 0.5 + log V
    z[4, [100, 164]] = float("inf")  # lse = +inf, like torch.logsumexp (twice in one lane on the CPU)
    z[5, 200] = 30.0  # the maximum in the tail block
    t = z.argmax(-1)
    assert t[:2].tolist() == [7, 69] and t[3] == 0 and t[5] == 200
    t[4] = 4  # a miss
    opts = LinearCrossEntropyOptions(reduction="sum", z_loss=1e-3)
    one = torch.ones((), device=device)
    got, ref = [], []
    for kernel, out in ((True, got), (False, ref)):
        loss = CrossEntropyChunks(opts, V, t, None, one, one, like=z)
        loss.kernel = kernel  # the Triton kernel, then the same math in PyTorch (chunk_math)
        d = loss.chunk(slice(0, 6), z.clone(), None, True)
        out.extend([loss.ce, loss.zl, loss.correct, d])
    assert got[2].tolist() == ref[2].tolist() == [True, True, True, True, False, True]
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("memory", ["default", "split", "lean"])
def test_each_head_gemm_checks_its_operands_once(monkeypatch, memory):
    """Issue 46: the loss's entry checks ``x`` and refuses DTensors once; each of the head's GEMMs
    (3 chunks x logits, d_input, d_weight; lean: 4 slices x logits twice, d_input, d_weight) then
    checks its operands once (one ``validate``: its first step, and the general checks where that
    step declines, as for the split logits' two GEMMs into padded rows) and refuses no DTensor again."""
    import truefuse.autograd.linear_cross_entropy as lce_mod
    import truefuse.ops.lm_head.chunked_head as head_mod
    from truefuse.ops.gemm import gemm as gemm_mod
    from truefuse.ops.gemm import gemm_checks

    counts = dict.fromkeys(("door", "validate", "plain_step", "gemm_refusal", "general"), 0)

    def counted(key, fn):
        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(lce_mod, "refuse_dtensor", counted("door", lce_mod.refuse_dtensor))
    monkeypatch.setattr(gemm_mod, "validate", counted("validate", gemm_mod.validate))
    monkeypatch.setattr(gemm_checks, "_plain_out_dtype", counted("plain_step", gemm_checks._plain_out_dtype))
    monkeypatch.setattr(gemm_checks, "refuse_dtensor", counted("gemm_refusal", gemm_checks.refuse_dtensor))
    monkeypatch.setattr(gemm_mod, "_gemm", counted("general", gemm_mod._gemm))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 16, dtype=torch.float64, generator=g, requires_grad=True)
    V = 203 if memory == "split" else 256
    W = torch.randn(V, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, V, (2, 12), generator=g)
    kw = {"memory": "lean", "vocab_slice": 64} if memory == "lean" else {"chunk_size": 8}
    if memory == "split":  # the Triton kernel's rule, taken on the CPU: the vocabulary split at 192
        monkeypatch.setattr(head_mod, "vocab_split", lambda *a: 192)
    loss = truefuse.linear_cross_entropy(x, W, t, **kw)
    loss.backward()
    # split: per chunk the logits' 2 GEMMs (general: padded rows), d_input's 2 and d_weight's 2
    gemms, general = {"default": (9, 0), "split": (18, 6), "lean": (16, 0)}[memory]
    assert counts == {"door": 1, "validate": gemms, "plain_step": gemms, "gemm_refusal": 0, "general": general}, counts
    if memory == "split":  # the same loss as one GEMM each
        ref = truefuse.linear_cross_entropy_ref(x.detach(), W.detach(), t)
        torch.testing.assert_close(loss.detach(), ref)
