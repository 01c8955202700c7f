"""torch.autocast: every module and the loss, with fp32 parameters (the Hugging Face Trainer's
``bf16=True``), against the torch.nn composition under the same autocast (docs/linear.md, "Autocast").

For each output and gradient: the dtype torch gives, the bounded contract (docs/design.md §1)
against float64 with torch's autocast result as the baseline, and every weight gradient more
accurate than torch's (truefuse accumulates it in fp32 and rounds once; torch rounds the GEMM to
the autocast dtype first). The GEMMs run on the cast operands: a module without a norm equals, bit
for bit, its twin with the parameters cast to the autocast dtype, outside autocast.

A parameter's ``.grad`` is in the parameter's dtype by torch's own rules (autograd casts what a
Function returns to its input's dtype; assigning ``.grad`` of another dtype raises), so no assert
here checks that dtype: one could not fail. A gradient rounded to the autocast dtype on its way
fails the accuracy check instead.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda

import truefuse
from truefuse.testing import assert_bitwise, assert_bounded, bounded_report
from truefuse.verify.cases_linear import MODULES, attach_main_grads, build, tokens

CASES = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=requires_cuda),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=requires_cuda),
]
#: the modules whose GEMMs see the input directly (no norm before them): their autocast run is the
#: parameters-cast-to-the-autocast-dtype module outside autocast, bit for bit
NO_NORM = [n for n in MODULES if n.startswith(("Linear", "Grouped"))]


def _inputs(m, device, dtype, seed=1):
    """x in fp32 (the parameters' dtype) and dy in the autocast dtype (the output's)."""
    g = torch.Generator().manual_seed(seed)
    features = m.gemm_weights()[0][1].shape[-1]
    x = torch.randn(*tokens(device), features, generator=g).to(device)
    with torch.no_grad(), torch.autocast(device, dtype):
        out = m.forward_ref(x)
    out = out[0] if isinstance(out, tuple) else out
    return x, torch.randn(out.shape, generator=g).to(device, out.dtype)


def _run(m, x, dy, *, ref=False, autocast=None, backward_in_autocast=False):
    """Forward (``forward_ref``: the torch.nn composition) under ``autocast`` = (device, dtype),
    backward outside it (inside with ``backward_in_autocast``); out, dx, every ``.grad``."""
    x = x.detach().clone().requires_grad_()
    region = torch.autocast(*autocast) if autocast else torch.autocast(x.device.type, enabled=False)
    with region:
        y = m.forward_ref(x) if ref else m(x)
        ys = y if isinstance(y, tuple) else (y,)
        # a returned norm output (return_layernorm_output) gets its own upstream gradient
        dys = [dy] + [torch.full_like(t, 0.25) for t in ys[1:]]
        if backward_in_autocast:
            torch.autograd.backward(ys, dys)
    if not backward_in_autocast:
        torch.autograd.backward(ys, dys)
    res = {"out": ys[0].detach(), "dx": x.grad}
    if len(ys) > 1:
        res["ln_out"] = ys[1].detach()
    res.update({f"d{n}": p.grad for n, p in m.named_parameters() if p.grad is not None})
    return res


def _to64(m):
    return copy.deepcopy(m).to(device="cpu", dtype=torch.float64)


def _check(name, got, base, ref, wgrads, dtypes=None):
    """dtypes as torch's (or as ``dtypes`` says), bounded against float64 with torch's as the
    baseline, the weight gradients ``wgrads`` more accurate than torch's."""
    assert got.keys() == base.keys() == ref.keys(), (sorted(got), sorted(base))
    for k in got:
        want = (dtypes or {}).get(k, base[k].dtype)
        assert got[k].dtype == want, f"{name} {k}: dtype {got[k].dtype}, torch gives {base[k].dtype}"
        assert_bounded(got[k], ref[k], base[k], f"{name} {k}")
    for k in wgrads:  # rounded once from fp32: below torch's error (rounded to the autocast dtype first)
        rep = bounded_report(got[k], ref[k], base[k])
        assert rep.error < rep.baseline_error or rep.baseline_error == 0, (
            f"{name} {k}: error {rep.error:.3e}, not below torch's {rep.baseline_error:.3e} (ratio {rep.ratio:.3f})"
        )


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("name", list(MODULES))
def test_module_matches_torch_nn_under_autocast(name, device, dtype):
    m = build(name, torch.float32, device)
    x, dy = _inputs(m, device, dtype)
    m64, torch_m = _to64(m), copy.deepcopy(m)
    got = _run(m, x, dy, autocast=(device, dtype))
    base = _run(torch_m, x, dy, ref=True, autocast=(device, dtype))
    ref = _run(m64, x.cpu().double(), dy.cpu().double(), ref=True)
    assert got["out"].dtype == dtype  # what torch.nn.Linear (last in every module) gives
    _check(name, got, base, ref, [f"d{n}" for n, _ in m.gemm_weights()])


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's F.rms_norm, bf16 x
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("name", list(MODULES))
def test_activation_in_autocast_dtype_into_fp32_parameters(name, device, dtype):
    """An input already in the autocast dtype (an earlier layer's output) into fp32 parameters,
    refused outside autocast: as torch.nn under autocast, bounded. The norm's own output stays in
    the input's dtype (torch's on the CPU; CUDA's layer_norm returns fp32, docs/linear.md)."""
    m = build(name, torch.float32, device)
    x, dy = _inputs(m, device, dtype)
    x = x.to(dtype)
    m64, torch_m = _to64(m), copy.deepcopy(m)
    got = _run(m, x, dy, autocast=(device, dtype))
    base = _run(torch_m, x, dy, ref=True, autocast=(device, dtype))
    ref = _run(m64, x.cpu().double(), dy.cpu().double(), ref=True)
    assert got["out"].dtype == dtype
    _check(name, got, base, ref, [], dtypes={"ln_out": dtype})


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("name", NO_NORM)
def test_gemms_run_on_the_cast_operands(name, device, dtype):
    """Under autocast = the module with its parameters cast to the autocast dtype, run on x cast
    to it, outside autocast: the output and the input gradient bit for bit."""
    m = build(name, torch.float32, device)
    x, dy = _inputs(m, device, dtype)
    low = copy.deepcopy(m).to(dtype)
    got = _run(m, x, dy, autocast=(device, dtype))
    twin = _run(low, x.to(dtype), dy)
    assert_bitwise(got["out"], twin["out"], f"{name} out")
    assert_bitwise(got["dx"], twin["dx"].float(), f"{name} dx")  # through the cast, as torch's


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("name", ["Linear", "GroupedMLP/packed_gelu_bias"])
def test_wgrad_contract_under_autocast(name, device, dtype):
    """docs/design.md §2 under autocast: delayed = immediate bit for bit, fp32 main_grad bounded
    (baseline: torch's autocast weight gradient, then an fp32 add), a backward inside the autocast
    region = one outside it, bit for bit."""
    ac = (device, dtype)
    m = build(name, torch.float32, device)
    x, dy = _inputs(m, device, dtype)
    imm = _run(m, x, dy, autocast=ac)
    inside = _run(build(name, torch.float32, device), x, dy, autocast=ac, backward_in_autocast=True)
    delayed = build(name, torch.float32, device, delay_wgrad_compute=True)
    dly = _run(delayed, x, dy, autocast=ac)
    delayed.backward_dw()
    dly.update({f"d{n}": p.grad for n, p in delayed.gemm_weights()})
    assert imm.keys() == dly.keys() == inside.keys()
    for k in imm:
        assert_bitwise(dly[k], imm[k], f"{name} delayed {k}")
        assert_bitwise(inside[k], imm[k], f"{name} backward in autocast {k}")

    fused = build(name, torch.float32, device, fuse_wgrad_accumulation=True)
    start = attach_main_grads(fused)
    _run(fused, x, dy, autocast=ac)
    base = _run(build(name, torch.float32, device), x, dy, ref=True, autocast=ac)
    ref = _run(_to64(fused), x.cpu().double(), dy.cpu().double(), ref=True)
    for n, p in fused.gemm_weights():
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert_bounded(
            p.main_grad, start[n].cpu().double() + ref[f"d{n}"], start[n].to(device) + base[f"d{n}"], f"{name} {n}.main_grad"
        )


def _lce_inputs(device, N=40, H=24, V=50):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, H, generator=g).to(device)
    W = (torch.randn(V, H, generator=g) * 0.3).to(device)
    b = (torch.randn(V, generator=g) * 0.1).to(device)
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -100  # some ignored tokens
    return x, W, b, t.to(device)


def _lce_run(fn, x, W, b, t, autocast=None):
    x, W, b = (v.detach().clone().requires_grad_() for v in (x, W, b))
    region = torch.autocast(*autocast) if autocast else torch.autocast(x.device.type, enabled=False)
    with region:
        loss = fn(x, W, b, t)
    loss.backward()
    return {"loss": loss.detach(), "dx": x.grad, "dW": W.grad, "db": b.grad}, (W, b)


def _torch_lce(x, W, b, t):
    return F.cross_entropy(F.linear(x, W, b).float(), t)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize(
    "chunk_size,fp32_weight_grad", [(None, True), (16, True), (16, False)], ids=["one_chunk", "chunks", "chunks_wdtype"]
)
def test_linear_cross_entropy_matches_torch_under_autocast(chunk_size, fp32_weight_grad, device, dtype):
    x, W, b, t = _lce_inputs(device)

    def ours(x, W, b, t):
        return truefuse.linear_cross_entropy(x, W, t, linear_bias=b, chunk_size=chunk_size, fp32_weight_grad=fp32_weight_grad)

    got, _ = _lce_run(ours, x, W, b, t, autocast=(device, dtype))
    base, _ = _lce_run(_torch_lce, x, W, b, t, autocast=(device, dtype))
    ref, _ = _lce_run(_torch_lce, *(v.cpu().double() for v in (x, W, b)), t.cpu())
    assert got["loss"].dtype == torch.float32  # cross_entropy is an fp32 op under autocast
    _check("linear_cross_entropy", got, base, ref, ["dW"])
    # the GEMMs run on the cast operands: the loss and d_input of the cast inputs outside autocast
    twin, _ = _lce_run(ours, *(v.to(dtype) for v in (x, W, b)), t)
    assert_bitwise(got["loss"], twin["loss"], "loss")
    assert_bitwise(got["dx"], twin["dx"].float(), "dx")


@pytest.mark.parametrize("device,dtype", CASES)
def test_linear_cross_entropy_loss_module_wgrad_under_autocast(device, dtype):
    """LinearCrossEntropyLoss under autocast: delayed = immediate bit for bit; fused fp32 main_grad
    bounded (baseline: torch's autocast weight gradient, then an fp32 add)."""
    x, W, b, t = _lce_inputs(device)
    ac = (device, dtype)
    imm, _ = _lce_run(lambda x, W, b, t: truefuse.LinearCrossEntropyLoss()(x, W, t, b), x, W, b, t, autocast=ac)
    loss_mod = truefuse.LinearCrossEntropyLoss(delay_wgrad_compute=True)
    dly, (Wd, _) = _lce_run(lambda x, W, b, t: loss_mod(x, W, t, b), x, W, b, t, autocast=ac)
    assert dly["dW"] is None
    loss_mod.backward_dw()
    dly["dW"] = Wd.grad
    for k in imm:
        assert_bitwise(dly[k], imm[k], f"delayed {k}")

    Wf = W.clone().requires_grad_()
    Wf.main_grad = torch.randn(W.shape, generator=torch.Generator().manual_seed(9)).to(device)
    start = Wf.main_grad.clone()
    with torch.autocast(device, dtype):
        loss = truefuse.LinearCrossEntropyLoss(fuse_wgrad_accumulation=True)(x, Wf, t, b)
    loss.backward()
    base, _ = _lce_run(_torch_lce, x, W, b, t, autocast=ac)
    ref, _ = _lce_run(_torch_lce, *(v.cpu().double() for v in (x, W, b)), t.cpu())
    assert Wf.grad is None and Wf.main_grad.dtype == torch.float32
    assert_bounded(Wf.main_grad, start.cpu().double() + ref["dW"], start + base["dW"], "linear_weight.main_grad")


def test_outside_autocast_nothing_changes():
    """Outside autocast a bf16 input into fp32 parameters is still refused, and an autocast region
    of another device type casts nothing."""
    m = truefuse.Linear(16, 8)
    with pytest.raises(TypeError, match="input has dtype torch.bfloat16 but the module's parameters are torch.float32$"):
        m(torch.randn(3, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="linear_weight has dtype torch.float32 but input has torch.bfloat16"):
        truefuse.linear_cross_entropy(torch.randn(3, 16, dtype=torch.bfloat16), m.weight, torch.zeros(3, dtype=torch.long))
    with torch.autocast("cpu", torch.bfloat16, enabled=False):
        assert m(torch.randn(3, 16)).dtype == torch.float32
    with torch.autocast("cpu", torch.bfloat16):  # fp64 is not cast by autocast, as torch's
        m64 = truefuse.Linear(16, 8, dtype=torch.float64)
        assert m64(torch.randn(3, 16, dtype=torch.float64)).dtype == torch.float64
        with pytest.raises(TypeError, match="under torch.autocast"):
            m(torch.randn(3, 16, dtype=torch.float64))


@pytest.mark.parametrize("bias", [False, True])
def test_operands_already_in_the_autocast_dtype_take_the_plain_path(bias, monkeypatch):
    """A bf16 model under bf16 autocast (TRL's and the Trainer's default): autocast casts nothing,
    so the call takes the plain paths (no LinearFunction, whose casts and scopes cost host time)
    and gives the bits of the same call outside autocast, forward and every gradient, with and
    without a gradient to record (``generate``)."""
    import truefuse.autograd.linear as lin

    torch.manual_seed(0)
    m = truefuse.Linear(32, 24, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 5, 24, dtype=torch.bfloat16)

    def run():
        y = m(x)
        grads = torch.autograd.grad(y, [x, *m.parameters()], dy)
        with torch.no_grad():
            return [y.detach(), m(x), *grads]

    outside = run()

    def refuse(*a, **k):
        raise AssertionError("LinearFunction ran although autocast casts nothing")

    monkeypatch.setattr(lin.LinearFunction, "apply", refuse)
    with torch.autocast("cpu", torch.bfloat16):
        inside = run()
    for a, b in zip(outside, inside, strict=True):
        assert_bitwise(b, a, "under autocast")
