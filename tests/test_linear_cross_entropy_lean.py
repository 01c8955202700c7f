"""linear_cross_entropy(memory="lean"): two passes over slices of the vocabulary, against the
float64 reference (bounded) over every option, no less accurate than the default, main_grad over
micro-batches, delayed == immediate bitwise, non-finite rows as the reference, the same errors.

On the CPU fp32 runs the slice kernels under the interpreter (small shapes: one program per token
and slice), fp64 and bf16 the same math in PyTorch. 64-class slices (``vocab_slice=64``) cut
V = 203 into 4 slices (3 aligned, then the 11 remaining classes)."""

import pytest
import torch
from conftest import requires_cuda

import truefuse
from truefuse.ops._launch.triton import triton_runs
from truefuse.ops.lm_head.linear_cross_entropy import LinearCrossEntropyOptions, _from_logits, linear_cross_entropy_ref
from truefuse.ops.lm_head.linear_cross_entropy_slices import (
    default_slice_width,
    finish_stats,
    merge_stats,
    slice_bounds,
    slice_grad_kernel,
    slice_grad_math,
    slice_stats_kernel,
    slice_stats_math,
)
from truefuse.testing import BOUNDED_FLOOR, assert_bitwise
from truefuse.verify.cases_linear_cross_entropy import check_lce, make_inputs
from truefuse.verify.registry import all_cases

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow|divide by zero) encountered:RuntimeWarning")

LEAN = {"memory": "lean", "vocab_slice": 64}
OPTIONS = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 4.0},
    "class_weight": {"weight": "w"},
    "bias": {"bias": True},
    "everything": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "weight": "w", "bias": True},
    "everything_none": {"reduction": "none", "label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "weight": "w"},
}


def _assert(reports):
    for k, rep in reports.items():
        assert rep.passed, f"{k}: error {rep.error:.3e} vs baseline {rep.baseline_error:.3e}"


def _run_option(dtype, device, spec, N=24, ignore="some", **extra):
    spec = dict(spec)
    bias = spec.pop("bias", False)
    x, W, t, b = make_inputs(dtype, device, N=N, bias=bias, ignore=ignore)
    if spec.get("weight") == "w":
        spec["weight"] = torch.rand(W.shape[0], generator=torch.Generator().manual_seed(9)).to(device) + 0.5
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) if spec.get("reduction") == "none" else None
    return check_lce(x, W, t, b, upstream=up, **spec, **extra)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_bounded_and_no_worse_than_default(name, dtype, device):
    """The PyTorch path (fp64, and bf16 on the CPU): bounded against the float64 reference, and
    each error within 1.05x the default path's (+ the contract's floor)."""
    lean = _run_option(dtype, device, OPTIONS[name], **LEAN)
    _assert(lean)
    default = _run_option(dtype, device, OPTIONS[name], chunk_size=16)
    for k, rep in lean.items():
        assert rep.error <= 1.05 * default[k].error + BOUNDED_FLOOR, f"{k}: {rep.error:.3e} vs default {default[k].error:.3e}"


@pytest.mark.parametrize("name", ["mean", "everything", "everything_none"])
def test_kernel_path_every_option(name, device):
    """fp32: the slice kernels (under the interpreter on the CPU), every option at once."""
    lean = _run_option(torch.float32, device, OPTIONS[name], N=16, **LEAN)
    _assert(lean)
    default = _run_option(torch.float32, device, OPTIONS[name], N=16, chunk_size=16)
    for k, rep in lean.items():
        assert rep.error <= 1.05 * default[k].error + BOUNDED_FLOOR, k


def test_registered_cases(device):
    cases = all_cases(["linear_cross_entropy_lean"], device.type)
    assert len(cases) == 10
    for c in cases:
        if "bf16" in c.name or c.name.startswith("lean_delayed"):  # the fp32 ones run in test_cli's verify
            _assert({k: r for k, r in c.fn(device).items() if hasattr(r, "error")})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero(reduction, dtype, device):
    x, W, t, _ = make_inputs(dtype, device, N=8, ignore="all")
    x.requires_grad_()
    W.requires_grad_()
    out = truefuse.linear_cross_entropy(x, W, t, reduction=reduction, return_token_accuracy=True, **LEAN)
    out.loss.sum().backward()
    for v in (out.loss, out.token_accuracy, x.grad, W.grad):
        assert not torch.isnan(v).any() and not v.any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_extras_and_no_grad_match_the_reference(dtype, device):
    x, W, t, b = make_inputs(dtype, device, N=16, bias=True)
    t[:6] = (x[:6] @ W.t() + b).argmax(-1)  # some right, so the accuracy is in (0, 1)
    kw = {"z_loss": 1e-2, "label_smoothing": 0.1, "return_z_loss": True, "return_token_accuracy": True}
    with torch.no_grad():
        out = truefuse.linear_cross_entropy(x, W, t, linear_bias=b, **kw, **LEAN)
    ref = linear_cross_entropy_ref(x, W, t, linear_bias=b, **kw)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for a, r in zip(out, ref, strict=True):
        if a is None or r is None:  # predicted_tokens: not asked for, None on both
            assert a is None and r is None
            continue
        torch.testing.assert_close(a, r.to(a.dtype), **tol)
    assert 0 < float(out.token_accuracy) < 1


def test_main_grad_over_micro_batches(device):
    """4 micro-batches (plus Megatron's attribute and overwrite): fp32 against the reference sum."""
    W = make_inputs(torch.float32, device, N=8)[1]
    Wl = W.clone().requires_grad_()
    Wl.main_grad = torch.zeros(W.shape, dtype=torch.float32, device=device)
    ref = torch.zeros(W.shape, dtype=torch.float64)
    for step in range(4):
        x, _, t, _ = make_inputs(torch.float32, device, N=8, seed=10 + step)
        loss = truefuse.linear_cross_entropy(x, Wl, t, reduction="sum", fuse_wgrad_accumulation=True, **LEAN)
        loss.backward(torch.tensor(0.5 + step, device=device))
        assert Wl.grad is None
        Wr = W.cpu().double().requires_grad_()
        (linear_cross_entropy_ref(x.cpu().double(), Wr, t.cpu(), reduction="sum") * (0.5 + step)).backward()
        ref += Wr.grad
    torch.testing.assert_close(Wl.main_grad.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    Wl.grad_added_to_main_grad = False
    Wl.overwrite_main_grad = True
    loss = truefuse.linear_cross_entropy(x, Wl, t, fuse_wgrad_accumulation=True, **LEAN)
    loss.backward()
    assert Wl.grad_added_to_main_grad and not Wl.grad.any()  # the cached zeros
    Wr = W.cpu().double().requires_grad_()
    linear_cross_entropy_ref(x.cpu().double(), Wr, t.cpu()).backward()
    torch.testing.assert_close(Wl.main_grad.cpu().double(), Wr.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("fused", "dtype"), [(False, torch.float64), (False, torch.float32), (True, torch.float32)], ids=str
)  # main_grad is fp32: fp64 GEMMs cannot write it
def test_delayed_is_bitwise_immediate(fused, dtype, device):
    N = 8 if dtype == torch.float32 else 24
    x, W, t, b = make_inputs(dtype, device, N=N, bias=True)
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    got = {}
    for delay in (False, True):
        m = truefuse.LinearCrossEntropyLoss(
            reduction="none", z_loss=1e-3, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay, **LEAN
        )
        xl, Wl, bl = (v.clone().requires_grad_() for v in (x, W, b))
        if fused:
            Wl.main_grad = torch.zeros(W.shape, dtype=torch.float32, device=device)
        m(xl, Wl, t, bl).backward(up)
        if delay:
            assert m.pending_wgrad == 1 and Wl.grad is None
        m.backward_dw()
        got[delay] = (xl.grad, Wl.main_grad if fused else Wl.grad, bl.grad)
    for a, e, what in zip(got[True], got[False], ("dx", "dW", "db"), strict=True):
        assert_bitwise(a, e, what)


def test_repeated_backward_and_grad_output(device):
    x, W, t, _ = make_inputs(torch.float64, device, N=16)
    xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
    loss = truefuse.linear_cross_entropy(xl, Wl, t, **LEAN)
    loss.backward(retain_graph=True)
    g1 = xl.grad.clone(), Wl.grad.clone()
    (2.5 * loss).backward()
    torch.testing.assert_close(xl.grad, 3.5 * g1[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(Wl.grad, 3.5 * g1[1], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_odd_sizes_empty_batch_and_one_slice(dtype, device):
    for N, H, V, lead, vs in [(1, 8, 203, (), 64), (5, 9, 130, (2,), 128), (3, 8, 1, (), 64), (4, 8, 70, (), 4096)]:
        x, W, t, b = make_inputs(dtype, device, N=N, H=H, V=V, lead=lead, ignore="none", bias=True)
        _assert(check_lce(x, W, t, b, memory="lean", vocab_slice=vs))
    x, W, t, _ = make_inputs(dtype, device, N=0, H=8, V=70)
    xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
    loss = truefuse.linear_cross_entropy(xl, Wl, t, **LEAN)
    loss.backward()
    assert float(loss.detach()) == 0 and xl.grad.shape == (0, 8) and not Wl.grad.any()


def test_errors_are_the_default_errors(device):
    x, W, t, _ = make_inputs(torch.float32, device, N=8)
    bad = t.clone()
    bad[3] = W.shape[0]
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"target holds 203, outside \[0, 203\)"):
            truefuse.linear_cross_entropy(x.requires_grad_(grad), W, bad, **LEAN)
    bad[3] = -5
    with pytest.raises(ValueError, match="target holds -5"):
        truefuse.linear_cross_entropy(x.double(), W.double(), bad, weight=torch.ones(203, device=device), **LEAN)
    with pytest.raises(ValueError, match="memory must be one of"):
        truefuse.linear_cross_entropy(x, W, t, memory="small")
    with pytest.raises(ValueError, match="vocab_slice must be a positive int"):
        truefuse.linear_cross_entropy(x, W, t, memory="lean", vocab_slice=0)
    with pytest.raises(ValueError, match="memory must be one of"):
        truefuse.LinearCrossEntropyLoss(memory="auto")


def test_module_and_options():
    m = truefuse.LinearCrossEntropyLoss(memory="lean", vocab_slice=128)
    assert m.memory == "lean" and m.vocab_slice == 128 and "memory=lean" in repr(m)
    m.memory = "default"
    assert m.options.memory == "default"
    assert LinearCrossEntropyOptions().memory == "default"


def test_slice_width_and_bounds():
    # 8192 tokens x 128256 classes in bf16: 16384-class slices (256 MiB of logits), 8 of them
    assert default_slice_width(8192, 128256, 2) == 16384
    assert len(slice_bounds(128256, 16384)) == 8
    assert default_slice_width(16384, 128256, 2) == 8192  # depends on N: lean is not batch invariant
    # lean's own (with H): what 560 MiB leaves beside the d_input buffer, evened out: 5 / 10 slices
    assert default_slice_width(8192, 128256, 2, H=4096) == 25664 and len(slice_bounds(128256, 25664)) == 5
    assert default_slice_width(16384, 128256, 2, H=4096) == 12864 and len(slice_bounds(128256, 12864)) == 10
    assert default_slice_width(8, 100, 4, H=8) == 64 and slice_bounds(100, 64) == slice_bounds(100, 128)
    assert default_slice_width(8, 100, 4) == 128 and default_slice_width(1 << 30, 100, 4) == 64
    assert slice_bounds(203, 64) == [(0, 64), (64, 128), (128, 192), (192, 203)]
    assert slice_bounds(50257, 16384) == [(0, 16384), (16384, 32768), (32768, 49152), (49152, 50240), (50240, 50257)]
    assert slice_bounds(40, 64) == [(0, 40)]


# Non-finite logits: the edge rows of tests/test_linear_cross_entropy_edges.py cut into slices,
# their statistics merged, against the reference's loss, z-loss, accuracy and d_logits.


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["", "softcap"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["", "smoothing"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_nonfinite_rows_match_the_reference(path, smoothing, softcap, device):
    from test_linear_cross_entropy_edges import _close, _nonfinite_rows

    if path == "kernel" and not triton_runs(torch.empty(0, device=device)):
        pytest.skip("the Triton kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1")
    dtype = torch.float32 if path == "kernel" else torch.float64
    V = 200
    z64, t = _nonfinite_rows(V, 64)
    z, t = z64.to(device, dtype), t.to(device)
    cw = (torch.rand(V, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5).to(device, dtype)
    cw[[3, V // 2 + 1, V - 2]] = 0.0
    up = torch.randn(z.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(device, dtype)
    opts = LinearCrossEntropyOptions(reduction="none", label_smoothing=smoothing, z_loss=1e-3, softcap=softcap)
    w_sum = float(cw.sum())
    bounds = slice_bounds(V, 64)
    parts = []
    for v0, v1 in bounds:
        zs = z[:, v0:v1].contiguous()
        if path == "kernel":
            parts.append(slice_stats_kernel(zs, None, cw[v0:v1] if smoothing else None, t, v0, opts))
        else:
            zc = zs if softcap is None else softcap * torch.tanh(zs / softcap)
            parts.append(slice_stats_math(zc, t, cw[v0:v1], v0, smoothing > 0))
    terms = finish_stats(merge_stats(parts), t, cw, opts, V, w_sum)
    d = []
    for v0, v1 in bounds:
        zs = z[:, v0:v1].contiguous()
        if path == "kernel":
            d.append(slice_grad_kernel(zs, None, cw, t, terms.lse, up, up, v0, V, w_sum, opts))
        else:
            zc = zs if softcap is None else softcap * torch.tanh(zs / softcap)
            d.append(slice_grad_math(zc, t, cw, cw[v0:v1], terms.lse, up, up, v0, V, w_sum, opts))
    d = torch.cat(d, 1)
    kw = {"label_smoothing": smoothing, "z_loss": 1e-3, "softcap": softcap}
    zr = z.clone().requires_grad_()
    out = _from_logits(
        zr, t, weight=cw, reduction="none", ignore_index=-100, return_z_loss=True, return_token_accuracy=False, **kw
    )
    (dz,) = torch.autograd.grad(out.loss, zr, up)
    zs = z if softcap is None else softcap * torch.tanh(z / softcap)
    _close(terms.ce + terms.zl, out.loss, dtype, "loss")
    _close(terms.zl, out.z_loss, dtype, "z_loss")
    assert terms.correct.tolist() == ((zs.argmax(-1) == t) & (t != -100)).tolist(), "token accuracy"
    _close(d, dz, dtype, "d_logits")


@pytest.mark.parametrize("what", ["nan_weight_row", "inf_weight_row", "nan_bias", "inf_hidden_ignored"])
def test_nonfinite_end_to_end(what, device):
    from test_linear_cross_entropy_edges import _end_to_end, _inputs

    x, W, t, b = _inputs(torch.float64, device, V=50)
    if what == "nan_weight_row":
        W[7, 3] = float("nan")
    elif what == "inf_weight_row":
        W[7, 3] = float("inf")
    elif what == "nan_bias":
        b[30] = float("nan")
    else:
        x[4, 2] = float("inf")
    got = _end_to_end(x, W, t, b, torch.float64, reduction="sum", z_loss=1e-3, memory="lean", vocab_slice=16)
    if what == "nan_weight_row":
        assert got[0].isnan()
    if what == "inf_hidden_ignored":
        assert torch.isfinite(got[0])


@requires_cuda
def test_lean_peak_memory_cuda():
    """Above the returned gradients: one slice's logits plus the fp32 (N, H) d_input buffer."""
    N, V, H = 4096, 32000, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    W = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) * H**-0.5).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    width = 4096  # 32 MiB of logits
    truefuse.linear_cross_entropy(x, W, t, memory="lean", vocab_slice=width).backward()
    x.grad = W.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    truefuse.linear_cross_entropy(x, W, t, memory="lean", vocab_slice=width).backward()
    peak = torch.cuda.max_memory_allocated() - base
    returned = x.numel() * 2 + W.numel() * 2
    above = N * width * 2 + N * H * 4 + (16 << 20)  # + O(N) statistics and GEMM workspaces
    assert peak - returned <= above, (peak - returned) / 2**20
