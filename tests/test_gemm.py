"""truefuse.gemm against gemm_ref: every capability row, the split fallbacks, grouped, errors."""

import pytest
import torch
from conftest import requires_cuda

from truefuse import Capability, gemm, gemm_plan_for, gemm_ref, override_capabilities
from truefuse.ops.gemm.activation import ACTIVATIONS, activation_grad_ref
from truefuse.ops.gemm.gemm_backends.torch import CAPABILITIES as TORCH_CAPABILITIES
from truefuse.ops.gemm.gemm_backends.triton import CAPABILITIES as TRITON_CAPABILITIES
from truefuse.ops.gemm.gemm_plan import FEATURES, backend_available
from truefuse.testing import assert_bitwise, assert_bounded, bounded_report
from truefuse.verify.cases_gemm import check_gemm

M, K, N = 70, 40, 37  # tokens, in, out: tails in every tile dimension


def _t(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _d64(v):
    return v.detach().cpu().double() if isinstance(v, torch.Tensor) else v


def _check(a, b, **kw):
    """Run gemm and assert the bounded contract for every output (the verify helper); return the result."""
    reports, got = check_gemm(a, b, return_result=True, **kw)
    assert not torch.isnan(got.out).any()
    for name, rep in reports.items():
        assert rep.passed, f"{name}: {rep}"
    return got


def _call_for(feature, i, o, device):
    """Arguments of a gemm call that needs ``feature`` with input dtype i and output dtype o."""
    x, w = _t((M, K), i, device, 1), _t((N, K), i, device, 2, K**-0.5)
    dy, pre = _t((M, N), i, device, 3), _t((M, N), i, device, 4)
    od = None if o == i else o
    if feature in ("mm", "out_dtype"):
        return (x, w.t()), {"out_dtype": od}
    if feature == "accumulate":
        return (dy.t(), x), {"out": _t((N, K), o, device, 5), "accumulate": True}
    if feature == "bias":
        return (x, w.t()), {"bias": _t((N,), i, device, 6), "out_dtype": od}
    if feature == "activation":
        return (x, w.t()), {"activation": "gelu", "return_pre_activation": True, "out_dtype": od}
    if feature == "grad_activation":
        return (dy.t(), x), {"grad_activation": "gelu", "pre_activation": pre.t(), "out_dtype": od}
    if feature == "grad_bias":
        return (dy.t(), x), {"grad_bias": True, "out_dtype": od}
    if feature == "grouped":
        splits = [16, 0, 1, 53]
        return (_t((M, 48), i, device, 7), _t((4, 48, 40), i, device, 8, 48**-0.5)), {"m_splits": splits, "out_dtype": od}
    if feature == "batch_invariant":
        return (x, w.t()), {"out_dtype": od, "batch_invariant": True}
    raise AssertionError(feature)


_ROWS = sorted(
    [("torch", *r) for r in TORCH_CAPABILITIES] + [("triton", *r) for r in TRITON_CAPABILITIES],
    key=str,
)


@pytest.mark.parametrize("backend,feature,in_dtype,out_dtype,dev", _ROWS, ids=lambda v: str(v).removeprefix("torch."))
def test_every_capability_row_against_ref(backend, feature, in_dtype, out_dtype, dev):
    """Each (feature, dtypes, device) a backend claims to fuse is fused there and bounded by gemm_ref."""
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA row")
    if not backend_available(backend, dev):
        pytest.skip(f"{backend} not available on {dev} here")
    device = torch.device(dev)
    (a, b), kw = _call_for(feature, in_dtype, out_dtype, device)
    with override_capabilities(backends=[backend]):
        p = gemm_plan_for(a, b, **kw)
        assert p.backend == backend and feature in p.fused, str(p)
        _check(a, b, **kw)


def _wgrad_call(dtype, device, act):
    dy, x, pre = _t((M, N), dtype, device, 11), _t((M, K), dtype, device, 12), _t((M, N), dtype, device, 13)
    kw = {"out": _t((N, K), torch.float32, device, 14), "accumulate": True, "grad_bias": True}
    if act:
        kw.update(grad_activation=act, pre_activation=pre.t())
    return dy, x, pre, kw


_NO_FUSED_BGRAD_FP32 = [Capability("grad_bias", out_dtype=torch.float32), Capability("grad_activation", out_dtype=torch.float32)]


@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_platform_without_fused_bgrad_for_fp32_out(dtype, act, device):
    """A platform without a fused bias-gradient for fp32 output (ROCm hipBLASLt today): the planner
    splits it, the weight gradient and bias gradient stay right, and the bias-gradient is the one
    split formula (fp32 sum, after the activation's derivative, cast to the input dtype)."""
    dy, x, pre, kw = _wgrad_call(dtype, device, act)
    with override_capabilities(remove=_NO_FUSED_BGRAD_FP32):
        p = gemm_plan_for(dy.t(), x, **kw)
        assert "grad_bias" in p.split, str(p)
        got = _check(dy.t(), x, **kw)
    # the derivative is taken in the operand's (transposed) layout: CPU ATen's vectorized and scalar
    # erf differ in the last bit, so the layout is part of the formula
    d = dy if act is None else activation_grad_ref(dy.t(), pre.t(), act).t()
    assert_bitwise(got.grad_bias, d.float().sum(0).to(dtype), "split bias-gradient formula")


def test_preference_order_decides_the_backend():
    dy, x, _, kw = _wgrad_call(torch.float32, torch.device("cpu"), None)
    with override_capabilities(backends=["torch", "triton"]):
        assert gemm_plan_for(dy.t(), x, **kw).backend == "torch"
    if backend_available("triton", "cpu"):
        with override_capabilities(backends=["triton", "torch"]):
            assert gemm_plan_for(dy.t(), x, **kw).backend == "triton"
        # a preferred backend that cannot run the product (no mm row) hands over to the next
        with override_capabilities(backends=["triton", "torch"], remove=[Capability("mm", backend="triton")]):
            assert gemm_plan_for(dy.t(), x, **kw).backend == "torch"


@pytest.mark.parametrize("act", [None, "gelu", "silu"])
def test_fused_bgrad_chosen_and_agrees_with_split(act, device):
    """Where the preferred backend fuses the bias-gradient (Triton; on the CPU in fp32 under the
    interpreter), the plan fuses it, and the fused result agrees with the split one within the contract."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not backend_available("triton", device.type):
        pytest.skip("no Triton backend here")
    dy, x, pre, kw = _wgrad_call(dtype, device, act)
    with override_capabilities(backends=["triton", "torch"]):
        p = gemm_plan_for(dy.t(), x, **kw)
        assert p.backend == "triton" and not p.split and "grad_bias" in p.fused, str(p)
        fused = gemm(dy.t(), x, **{**kw, "out": kw["out"].clone()})
    with override_capabilities(remove=_NO_FUSED_BGRAD_FP32):
        split = gemm(dy.t(), x, **{**kw, "out": kw["out"].clone()})
    kw64 = {k: _d64(v) for k, v in kw.items()}
    ref = gemm_ref(_d64(dy).t(), _d64(x), **kw64)
    for name in ("out", "grad_bias"):
        rep = bounded_report(getattr(fused, name), getattr(ref, name), getattr(split, name))
        assert rep.passed, (name, rep)


_ALL_OFF = [Capability(f) for f in FEATURES if f != "mm"]


@pytest.mark.parametrize("removed", [[c] for c in _ALL_OFF] + [_ALL_OFF], ids=lambda r: "+".join(c.feature for c in r))
def test_no_configuration_raises(removed, device):
    """Take fused features away (one at a time, then all): every request still runs, right."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dy, x, pre, kw = _wgrad_call(dtype, device, "gelu")
    w = _t((N, K), dtype, device, 20, K**-0.5)
    with override_capabilities(remove=removed):
        _check(dy.t(), x, **kw)
        _check(x, w.t(), bias=_t((N,), dtype, device, 21), activation="silu", return_pre_activation=True)
        _check(x, w.t(), out_dtype=torch.float32)
        _check(_t((M, 48), dtype, device, 22), _t((3, 48, 40), dtype, device, 23, 0.2), m_splits=[30, 0, 40])


def test_cpu_accumulate_into_fp32_is_planned_as_upcast():
    """CPU PyTorch has no addmm(out_dtype=fp32) for bf16: the plan upcasts and accumulates in fp32."""
    dy, x, _, kw = _wgrad_call(torch.bfloat16, torch.device("cpu"), None)
    kw["grad_bias"] = False
    with override_capabilities(backends=["torch"]):
        p = gemm_plan_for(dy.t(), x, **kw)
        assert p.compute_dtype == torch.float32 and "out_dtype" in p.split and "accumulate" in p.fused
        got = _check(dy.t(), x, **kw)
    expect = kw["out"] + dy.float().t() @ x.float()  # exact bf16 products, fp32 sums
    assert_bounded(got.out, (_d64(kw["out"]) + _d64(dy).t() @ _d64(x)), expect)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_forward_epilogues(act, device):
    x, w, bias = _t((M, K), torch.float32, device, 30), _t((N, K), torch.float32, device, 31), _t((N,), torch.float32, device, 32)
    r = _check(x, w.t(), bias=bias, activation=act, return_pre_activation=True)
    assert_bitwise(r.pre_activation, torch.addmm(bias, x, w.t()), "pre-activation")


def test_out_is_written_in_place_and_ref_reads_only(device):
    x, w = _t((M, K), torch.float32, device, 40), _t((K, N), torch.float32, device, 41)
    out = torch.full((M, N), float("nan"), device=device)
    res = gemm(x, w, out=out)
    assert res.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    acc = _t((M, N), torch.float32, device, 42)
    before = acc.clone()
    gemm_ref(x, w, out=acc, accumulate=True)
    assert_bitwise(acc, before, "gemm_ref must not write into out")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_out_with_padded_rows_is_written_in_place(backend, accumulate, device):
    """``out = buf[:, :N]`` of a wider ``buf`` (the linear cross-entropy pads the logits' rows to
    16-byte multiples): written in place, bit for bit as into a contiguous ``out``, and the
    padding columns left as they were."""
    if not backend_available(backend, device.type):
        pytest.skip(f"no {backend} backend here")
    x, w = _t((M, K), torch.float32, device, 43), _t((K, N), torch.float32, device, 44)
    buf = torch.full((M, N + 11), -7.0, device=device)
    start = _t((M, N), torch.float32, device, 45)
    buf[:, :N] = start
    out = buf[:, :N]
    with override_capabilities(backends=[backend]):
        res = gemm(x, w, out=out, accumulate=accumulate)
        want = gemm(x, w, out=start.clone(), accumulate=accumulate)
    assert res.data_ptr() == buf.data_ptr()
    assert_bitwise(buf[:, :N], want, "padded-row out")
    assert (buf[:, N:] == -7.0).all(), "the padding columns were written"


@pytest.mark.parametrize("splits", [[16, 0, 1, 53], [0, 0, 70, 0], [70]])
def test_grouped_rows_equals_per_group_gemm(splits, device):
    dtype = torch.float32
    x, w = _t((70, 48), dtype, device, 50), _t((len(splits), 48, 40), dtype, device, 51)
    bias = _t((len(splits), 40), dtype, device, 52)
    res = gemm(x, w, m_splits=splits, bias=bias)
    start = 0
    for g, m in enumerate(splits):
        assert_bitwise(res[start : start + m], gemm(x[start : start + m], w[g], bias=bias[g]), f"group {g}")
        start += m


def test_grouped_wgrad_per_group(device):
    splits = [16, 0, 1, 53]
    dtype = torch.float32
    dy, x = _t((70, N), dtype, device, 60), _t((70, K), dtype, device, 61)
    mg = _t((4, N, K), torch.float32, device, 62)
    res = gemm(dy.t(), x, out=mg.clone(), accumulate=True, grad_bias=True, m_splits=torch.tensor(splits))
    assert res.out.shape == (4, N, K) and res.grad_bias.shape == (4, N)
    assert_bitwise(res.out[1], mg[1], "an empty group adds nothing")
    assert_bitwise(res.grad_bias[1], torch.zeros(N, device=device), "an empty group's bias-gradient")
    start = 0
    for g, m in enumerate(splits):
        one = gemm(dy[start : start + m].t(), x[start : start + m], out=mg[g].clone(), accumulate=True, grad_bias=True)
        assert_bitwise(res.out[g], one.out, f"group {g}")
        assert_bitwise(res.grad_bias[g], one.grad_bias, f"group {g} bias")
        start += m


def test_per_group_request_loops_where_a_backend_fuses_grouped():
    """GroupedLinear's one-GEMM-per-group is said in the request (``gemm_groups(per_group=True)``),
    not by removing capabilities: the plan loops even where the first backend fuses ``grouped``,
    and each group is the very call a 2-D gemm on its slice makes."""
    from dataclasses import replace

    from truefuse.ops.gemm.gemm import gemm_groups
    from truefuse.ops.gemm.gemm_plan import GemmRequest, plan

    row = Capability("grouped", torch.float32, torch.float32, "cpu", "torch")
    req = GemmRequest("cpu", torch.float32, torch.float32, grouped=True)
    splits = [16, 0, 1, 53]
    x, w = _t((70, 48), torch.float32, "cpu", 53), _t((4, 48, 40), torch.float32, "cpu", 54)
    with override_capabilities(add=[row], backends=["torch"]):
        assert plan(req).fused == ("mm", "grouped")
        assert plan(replace(req, per_group=True)) == plan(replace(req, aligned=False))
        assert str(plan(replace(req, per_group=True))) == "torch[float32]: fused mm; split grouped"
        res = gemm_groups(x, w, m_splits=splits, per_group=True, batch_invariant=False)
    start = 0
    for g, m in enumerate(splits):
        assert_bitwise(res[start : start + m], gemm(x[start : start + m], w[g]), f"group {g}")
        start += m


def test_plan_is_readable():
    x, w = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(8, 3, dtype=torch.bfloat16)
    with override_capabilities(backends=["torch"]):
        p = gemm_plan_for(x, w, bias=torch.empty(3, dtype=torch.bfloat16), activation="gelu")
    assert str(p) == "torch[bfloat16]: fused mm+bias; split activation"


def test_override_nests_and_restores():
    dy, x, _, kw = _wgrad_call(torch.float32, torch.device("cpu"), None)
    before = gemm_plan_for(dy.t(), x, **kw)
    with override_capabilities(remove=[Capability("accumulate")]):
        with override_capabilities(remove=[Capability("mm", backend="triton")]):
            inner = gemm_plan_for(dy.t(), x, **kw)
            assert inner.backend == "torch" and "accumulate" in inner.split
    assert gemm_plan_for(dy.t(), x, **kw) == before
    with pytest.raises(ValueError, match="unknown feature"):
        with override_capabilities(remove=[Capability("nope")]):
            pass


# --- errors: each names the argument, before anything runs ---------------------------------------

_A = torch.randn(8, 4)
_B = torch.randn(4, 3)


@pytest.mark.parametrize(
    "args,kw,exc,match",
    [
        ((_A, torch.randn(5, 3)), {}, ValueError, "a has 4 columns but b has 5 rows"),
        ((_A, _B.double()), {}, TypeError, "same dtype"),
        ((_A.int(), _B.int()), {}, TypeError, "a has dtype torch.int32"),
        ((_A[0], _B), {}, ValueError, "a must be 2-D"),
        ((_A, torch.randn(2, 4, 3)), {}, ValueError, "needs m_splits"),
        ((_A, _B), {"out": torch.empty(8, 4)}, ValueError, r"out has shape \(8, 4\), expected \(8, 3\)"),
        ((_A, _B), {"out": torch.empty(8, 3, dtype=torch.float16)}, TypeError, "out has dtype"),
        ((_A, _B), {"out": torch.empty(3, 8).t()}, ValueError, "out must be contiguous, or row-major"),
        ((_A, _B), {"accumulate": True}, ValueError, "pass out="),
        ((_A, _B), {"out": torch.empty(8, 5)[:, :3], "bias": torch.zeros(3)}, ValueError, "bias with an out of padded rows"),
        ((_A, _B), {"out": torch.empty(8, 3), "accumulate": True, "bias": torch.zeros(3)}, ValueError, "takes no bias"),
        ((_A, _B), {"activation": "swish"}, ValueError, "activation='swish'"),
        ((_A, _B), {"grad_activation": "gelu"}, ValueError, "pre_activation go together"),
        ((_A, _B), {"grad_activation": "gelu", "pre_activation": torch.randn(4, 8)}, ValueError, "pre_activation has shape"),
        ((_A, _B), {"bias": torch.zeros(4)}, ValueError, r"bias has shape \(4,\), expected \(3,\)"),
        ((_A, _B), {"return_pre_activation": True}, ValueError, "needs an activation"),
        ((_A, _B), {"out_dtype": torch.float16}, TypeError, "out_dtype=torch.float16"),
        ((_A, torch.randn(2, 4, 3)), {"m_splits": [3, 4]}, ValueError, "m_splits sums to 7 but a.shape"),
        ((_A, torch.randn(2, 4, 3)), {"m_splits": [9, -1]}, ValueError, "negative"),
        ((_A, torch.randn(2, 4, 3)), {"m_splits": [8]}, ValueError, "m_splits has 1 groups but there are 2"),
        ((_A, torch.randn(2, 4, 3)), {"m_splits": [4.0, 4.0]}, TypeError, "m_splits must be"),
        ((_A, torch.randn(2, 4, 3)), {"m_splits": [4, 4], "grad_bias": True}, ValueError, "weight-gradient GEMM"),
    ],
)
def test_bad_input_is_named(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        gemm(*args, **kw)


def test_splits_fast_path_copies_and_keeps_the_checks():
    """A list of Python ints takes one pass and comes back as a copy (a caller reusing its list
    cannot change what a backward saved); a bool, a NumPy or a tensor entry still goes through the
    full checks and their errors."""
    from truefuse.ops.gemm.gemm_checks import check_splits

    splits = [3, 0, 5]
    out = check_splits(splits, 3, 8, "rows")
    splits[0] = 99
    assert out == [3, 0, 5]
    assert check_splits([torch.tensor(2), 6], 2, 8, "rows") == [2, 6]
    with pytest.raises(TypeError, match=r"m_splits\[0\] is True"):
        check_splits([True, 7], 2, 8, "rows")
    with pytest.raises(ValueError, match="sums to 9 but rows is 8"):
        check_splits([4, 5], 2, 8, "rows")


def test_out_aliasing_an_input_is_refused():
    buf = torch.randn(8, 8)
    with pytest.raises(ValueError, match="out shares memory with a"):
        gemm(buf[:, :4], torch.randn(4, 8), out=buf)


@requires_cuda
def test_device_mismatch_is_named():
    with pytest.raises(ValueError, match="a is on cpu but b is on cuda"):
        gemm(_A, _B.cuda())


@requires_cuda
def test_grouped_fused_fills_a_given_out_or_allocates():
    """The fused grouped path (grouped_mm) returns its own output, or fills the ``out`` given."""
    dev = torch.device("cuda")
    x, w = _t((64, 48), torch.bfloat16, dev, 70), _t((3, 48, 40), torch.bfloat16, dev, 71, 0.2)
    splits = [16, 0, 48]
    assert "grouped" in gemm_plan_for(x, w, m_splits=splits).fused
    fresh = gemm(x, w, m_splits=splits)
    out = torch.full((64, 40), float("nan"), device=dev, dtype=torch.bfloat16)
    given = gemm(x, w, m_splits=splits, out=out)
    assert given.data_ptr() == out.data_ptr()
    assert_bitwise(given, fresh, "given out vs allocated")


# --- gemm is not differentiable: an operand that requires grad is refused up front ----------------


@pytest.mark.parametrize("operand", ["a", "b", "bias", "out"])
def test_gemm_refuses_operand_that_requires_grad(operand):
    """``truefuse.gemm(x, layer.weight.t())`` with a Parameter used to fail deep inside PyTorch
    ("functions with out=... arguments don't support automatic differentiation"): now a TypeError
    naming the operand and pointing at truefuse.Linear / torch.no_grad() / .detach()."""
    x, w, bias, out = torch.randn(5, 4), torch.nn.Parameter(torch.randn(3, 4)), torch.randn(3), torch.empty(5, 3)
    kw = {"bias": bias}
    if operand == "a":
        x.requires_grad_()
    elif operand == "b":
        pass  # the Parameter
    elif operand == "bias":
        kw["bias"] = torch.nn.Parameter(bias)
    else:
        kw["out"] = out.requires_grad_()
    b = w.t() if operand == "b" else w.detach().t()
    msg = rf"{operand} requires grad.*not differentiable.*truefuse\.Linear.*torch\.no_grad\(\).*\.detach\(\)"
    with pytest.raises(TypeError, match=msg):
        gemm(x, b, **kw)
    with pytest.raises(TypeError, match=msg):
        gemm_plan_for(x, b, **kw)
    with torch.no_grad():  # the raw GEMM on such tensors: fine without grad mode
        got = gemm(x, b, **kw)
    assert_bitwise(got, torch.addmm(kw["bias"].detach(), x.detach(), b.detach()), "gemm under no_grad")


def test_gemm_requires_grad_on_a_triton_plan_is_refused_not_silently_graphless():
    """With a Triton plan the old code returned a result with no grad_fn: the gradient was lost
    without a word. Now the same TypeError as on the torch plan."""
    if not backend_available("triton", "cpu"):
        pytest.skip("no Triton backend on the CPU here")
    x, w = torch.randn(5, 4, requires_grad=True), torch.randn(4, 3)
    with override_capabilities(backends=["triton"]), pytest.raises(TypeError, match="a requires grad"):
        gemm(x, w)


def test_gemm_requires_grad_names_every_operand_and_the_weight_gradient_form():
    dy, x = torch.randn(6, 3, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    pre = torch.randn(6, 3, requires_grad=True)
    with pytest.raises(TypeError, match="a and b and pre_activation require grad"):
        gemm(dy.t(), x, grad_activation="gelu", pre_activation=pre.t())
    g = gemm(dy.detach().t(), x.detach(), grad_activation="gelu", pre_activation=pre.detach().t())
    assert g.shape == (3, 4) and not g.requires_grad


# --- m_splits: integral scalars of any kind, nothing else ---------------------------------------


def test_gemm_m_splits_accepts_numpy_ints_and_0dim_tensors():
    np = pytest.importorskip("numpy")
    x, w = _t((8, 6), torch.float32, torch.device("cpu"), 80), _t((2, 6, 5), torch.float32, torch.device("cpu"), 81)
    want = gemm(x, w, m_splits=[3, 5])
    for splits in (
        [np.int64(3), np.int64(5)],
        list(np.array([3, 5])),
        np.array([3, 5], dtype=np.int32),
        (np.uint8(3), 5),
        [torch.tensor(3), torch.tensor(5)],
        torch.tensor([3, 5]),
    ):
        assert_bitwise(gemm(x, w, m_splits=splits), want, f"m_splits={splits!r}")
        assert_bitwise(gemm_ref(x, w, m_splits=splits), gemm_ref(x, w, m_splits=[3, 5]), f"ref m_splits={splits!r}")
    dy, xx = torch.randn(8, 4), torch.randn(8, 3)
    assert_bitwise(gemm(dy.t(), xx, m_splits=[np.int64(3), np.int64(5)]), gemm(dy.t(), xx, m_splits=[3, 5]), "contraction")


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        ("floats", TypeError, r"m_splits must be a list of ints.*m_splits\[0\] is 4\.0"),
        ("numpy_floats", TypeError, r"m_splits must be a list of ints.*m_splits\[1\]"),
        ("numpy_float_array", TypeError, "m_splits must be a list of ints.*NumPy array of dtype float64"),
        ("bools", TypeError, r"m_splits\[0\] is True"),
        ("float_0dim_tensor", TypeError, r"m_splits\[0\]"),
        ("numpy_negative", ValueError, "m_splits has a negative group size"),
        ("string", TypeError, "m_splits must be a list of ints.*got str"),
    ],
)
def test_gemm_m_splits_rejects_non_integral_and_negative(bad, exc, match):
    np = pytest.importorskip("numpy")
    splits = {
        "floats": [4.0, 4.0],
        "numpy_floats": [4, np.float64(4.0)],
        "numpy_float_array": np.array([4.0, 4.0]),
        "bools": [True, 7],
        "float_0dim_tensor": [torch.tensor(4.0), 4],
        "numpy_negative": [np.int64(9), np.int64(-1)],
        "string": "44",
    }[bad]
    with pytest.raises(exc, match=match):
        gemm(_A, torch.randn(2, 4, 3), m_splits=splits)


def test_gemm_ref_m_splits_float_is_refused_not_truncated():
    """The oracle used int(v): [3.7, 4.3] silently became [3, 4]."""
    with pytest.raises(TypeError, match="m_splits must be"):
        gemm_ref(torch.randn(7, 4), torch.randn(2, 4, 3), m_splits=[3.7, 4.3])


# --- messages that misled -----------------------------------------------------------------------


def test_bias_dtype_error_lists_each_allowed_dtype_once():
    with pytest.raises(TypeError, match=r"bias has dtype torch\.float64, expected torch\.float32$"):
        gemm(_A, _B, bias=torch.zeros(3, dtype=torch.float64))


def test_out_dtype_must_be_a_dtype():
    with pytest.raises(TypeError, match="out_dtype must be a torch.dtype.*'float32'"):
        gemm(_A, _B, out_dtype="float32")
    with pytest.raises(
        TypeError, match=r"out_dtype=torch\.float16 is not supported for torch\.float32 inputs; use torch\.float32$"
    ):
        gemm(_A, _B, out_dtype=torch.float16)


def test_override_capabilities_refuses_unknown_backends():
    """An unknown (or misspelt) backend used to be dropped silently: every plan then failed with
    "no GEMM backend is enabled", or the override did nothing."""
    with pytest.raises(ValueError, match=r"unknown backend\(s\) \['cublas'\]"):
        with override_capabilities(backends=["cublas"]):
            pass
    with pytest.raises(TypeError, match="got the string 'triton'"):
        with override_capabilities(backends="triton"):
            pass
    with pytest.raises(ValueError, match="remove: unknown backend 'trion'"):
        with override_capabilities(remove=[Capability("grad_bias", backend="trion")]):
            pass


# --- TRUEFUSE_GEMM_BACKENDS is validated where it is read -----------------------------------------


@pytest.fixture
def fresh_config(monkeypatch):
    """get_config() re-read from a monkeypatched environment, and re-read again afterwards."""
    from truefuse.config import get_config

    get_config.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    get_config.cache_clear()


@pytest.mark.parametrize(
    "value,match",
    [
        ("cublas9000", r"TRUEFUSE_GEMM_BACKENDS='cublas9000': unknown GEMM backend 'cublas9000'; known backends: torch, triton"),
        ("torch,cublas", r"TRUEFUSE_GEMM_BACKENDS='torch,cublas': unknown GEMM backend 'cublas'; known backends: torch, triton"),
        ("", r"TRUEFUSE_GEMM_BACKENDS='' names no GEMM backend; known backends: torch, triton"),
        (" , ", r"TRUEFUSE_GEMM_BACKENDS=' , ' names no GEMM backend"),
        ("torch,triton,torch", r"names 'torch' more than once"),
    ],
)
def test_gemm_backends_env_bad_value_is_a_clear_error(fresh_config, value, match):
    from truefuse.config import ConfigError, get_config

    fresh_config.setenv("TRUEFUSE_GEMM_BACKENDS", value)
    with pytest.raises(ValueError, match=match) as info:
        get_config()
    assert isinstance(info.value, ConfigError)
    with pytest.raises(ValueError, match=match):  # not cached: the next call says it again
        get_config()


def test_gemm_backends_env_good_values(fresh_config):
    from truefuse.config import get_config

    fresh_config.setenv("TRUEFUSE_GEMM_BACKENDS", " triton , torch ")
    assert get_config().gemm_backends == ("triton", "torch")
    get_config.cache_clear()
    fresh_config.delenv("TRUEFUSE_GEMM_BACKENDS")
    assert get_config().gemm_backends == ("torch", "triton")


def test_print_info_raises_config_error_before_printing(fresh_config, capsys):
    """``python -m truefuse info`` with a bogus TRUEFUSE_GEMM_BACKENDS: print_info raises the
    ValueError (the CLI prints it and exits 2) before printing half a report."""
    from truefuse.info import print_info

    fresh_config.setenv("TRUEFUSE_GEMM_BACKENDS", "cublas9000")
    with pytest.raises(ValueError, match="TRUEFUSE_GEMM_BACKENDS='cublas9000'.*known backends: torch, triton"):
        print_info()
    assert capsys.readouterr().out == ""


def test_info_main_cases_without_a_usable_backend_say_so(fresh_config):
    """A valid order that enables nothing on this device (triton alone, no interpreter) shows
    "no plan" in the table instead of a traceback."""
    from truefuse.info import main_cases

    fresh_config.setenv("TRUEFUSE_GEMM_BACKENDS", "triton")
    fresh_config.delenv("TRITON_INTERPRET", raising=False)
    plans = main_cases("cpu")
    assert plans and all(str(p).startswith("no plan: no GEMM backend is enabled") for p in plans.values())


def test_known_backends_match_the_capability_tables():
    from truefuse.config import KNOWN_GEMM_BACKENDS
    from truefuse.ops.gemm.gemm_backends import BACKENDS as _BASE_TABLES

    assert tuple(_BASE_TABLES) == KNOWN_GEMM_BACKENDS
