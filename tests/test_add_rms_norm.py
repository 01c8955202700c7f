"""``truefuse.add_rms_norm`` and ``truefuse.RMSNorm(x, residual=)``: a residual add and truefuse's own
RMSNorm in one kernel each way. The normed rows are ``truefuse.rms_norm`` of the sum bit for bit;
on the CPU in fp32 (the kernels under the interpreter) the gradients are the unfused composition's
too; on a GPU, in bf16, the forward bit for bit and the gradients bounded (verify's cases)."""

import pytest
import torch

import truefuse
import truefuse.ops.norm.norm as norm_mod
from truefuse.ops.norm.add_norm import add_rms_norm_fwd_op, add_rms_norm_ref
from truefuse.ops.norm.norm import use_kernel
from truefuse.testing import assert_bitwise
from truefuse.verify.registry import all_cases


def _dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _inputs(m=13, n=200, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(m, n, generator=g) * 2 + 0.5).to(device, dtype)
    x = (torch.randn(m, n, generator=g) * 0.5).to(device, dtype)
    w = (torch.randn(n, generator=g) * 0.5 + 1.0).to(device, dtype)
    return r, x, w


def _fwd_bwd(f, tensors, dn, ds):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    normed, summed = f(*leaves)
    grads = torch.autograd.grad((normed, summed), leaves, (dn, ds))
    return normed.detach(), summed.detach(), *grads


def test_registered_cases(device):
    cases = all_cases(["add_rms_norm"], device.type)
    assert len(cases) == 12
    for case in cases:
        for k, rep in case.fn(device).items():
            assert rep.passed, f"{case.name}/{k}: {rep}"


@pytest.mark.parametrize("zc", [False, True], ids=["plain", "zero-centered"])
def test_the_unfused_composition_bit_for_bit(zc, device):
    """``residual + x`` then ``truefuse.rms_norm`` under autograd: the forward bit for bit (on a GPU
    in bf16 too: the same kernel, reading the two inputs instead of the stored sum); in fp32 under
    the interpreter every gradient too (the fused backward adds the stream's gradient before its one
    rounding, autograd after: the same in fp32 without an FMA)."""
    r, x, w = _inputs(dtype=_dtype(device), device=device)
    assert use_kernel(x)
    dn, ds = torch.randn_like(x), torch.randn_like(x)
    got = _fwd_bwd(lambda r, x, w: truefuse.add_rms_norm(r, x, w, 1e-6, zero_centered_gamma=zc), (r, x, w), dn, ds)
    want = _fwd_bwd(
        lambda r, x, w: (lambda s: (truefuse.rms_norm(s, w, 1e-6, zero_centered_gamma=zc), s))(r + x), (r, x, w), dn, ds
    )
    names = ("normed", "summed") if device.type == "cuda" else ("normed", "summed", "d_residual", "d_x", "d_weight")
    for name, a, b in zip(names, got, want, strict=False):
        assert_bitwise(a, b, name)
    assert torch.equal(got[2], got[3]), "residual and x get the sum's gradient"


def test_one_launch(device, monkeypatch):
    """The forward is one launch of the norm kernel (the add inside it), not an add and a norm."""
    launches = []
    real = norm_mod.norm_fwd

    def counting(*a, **k):
        launches.append(k.get("residual") is not None)
        return real(*a, **k)

    monkeypatch.setattr("truefuse.ops.norm.add_norm.norm_fwd", counting)
    r, x, w = _inputs(m=4, n=64, dtype=_dtype(device), device=device)
    add_rms_norm_fwd_op(r, x, w, 1e-6, False)
    assert launches == [True]


def test_without_a_weight_and_the_module(device):
    """No weight (``RMSNorm(elementwise_affine=False)``), and the module's ``residual=`` form against
    the module on the sum, with its gradients (the weight's from both outputs' paths)."""
    dtype = _dtype(device)
    r, x, _ = _inputs(m=6, n=64, dtype=dtype, device=device)
    n0, s0 = truefuse.add_rms_norm(r, x)
    assert_bitwise(n0, truefuse.rms_norm(r + x, None, 1e-6), "no weight")
    m = truefuse.RMSNorm(64, eps=1e-6, device=device, dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(torch.linspace(0.5, 1.5, 64))
    m2 = truefuse.RMSNorm(64, eps=1e-6, device=device, dtype=dtype)
    m2.load_state_dict(m.state_dict())
    r3, x3 = r.view(2, 3, 64).clone().requires_grad_(), x.view(2, 3, 64).clone().requires_grad_()
    normed, summed = m(x3, residual=r3)
    s = r3.detach().clone().requires_grad_() + x3.detach()
    want = m2(s)
    assert normed.shape == summed.shape == (2, 3, 64)
    assert_bitwise(normed.detach(), want.detach(), "module normed")
    (normed.sum() + summed.square().sum()).backward()
    (want.sum() + s.square().sum()).backward()
    tol = 0 if device.type == "cpu" else 2e-2
    torch.testing.assert_close(m.weight.grad, m2.weight.grad, rtol=tol, atol=tol * float(m2.weight.grad.abs().max()))


def test_batch_invariance(device):
    """Row i of an m-row call is a 1-row call on row i bit for bit: outputs and row gradients."""
    r, x, w = _inputs(m=37, dtype=_dtype(device), device=device)
    dn, ds = torch.randn_like(x), torch.randn_like(x)

    def call(rows):
        return _fwd_bwd(lambda r, x, w: truefuse.add_rms_norm(r, x, w), (r[rows], x[rows], w), dn[rows], ds[rows])

    whole = call(slice(None))
    for i in (0, 36):
        one = call(slice(i, i + 1))
        for name, a, b in zip(("normed", "summed", "d_residual", "d_x"), one[:4], whole[:4], strict=True):
            assert_bitwise(a, b[i : i + 1], f"row {i} {name}")


def test_nan_and_inf_as_the_reference(device):
    r, x, w = _inputs(m=6, n=64, dtype=_dtype(device), device=device)
    r[1, 3], x[2, 5] = float("nan"), float("inf")
    r[3, 7], x[3, 7] = float("inf"), float("-inf")
    normed, summed = truefuse.add_rms_norm(r, x, w)
    want_n, want_s = add_rms_norm_ref(r, x, w)
    assert_bitwise(summed, want_s, "summed")
    assert_bitwise(normed, want_n, "normed")
    assert normed[1].isnan().all() and normed[0].isfinite().all()


_BAD = [
    (lambda r, x, w: ("not a tensor", x, w), {}, TypeError, "residual must be a torch.Tensor"),
    (lambda r, x, w: (r, [1.0], w), {}, TypeError, "x must be a torch.Tensor"),
    (lambda r, x, w: (r[:, :-1], x, w), {}, ValueError, "residual has shape"),
    (lambda r, x, w: (r.double(), x, w), {}, TypeError, "residual has dtype"),
    (lambda r, x, w: (r, x, w[:-1]), {}, ValueError, "weight has shape"),
    (lambda r, x, w: (r, x, None), {"zero_centered_gamma": True}, ValueError, "zero_centered_gamma=True needs a weight"),
    (lambda r, x, w: (r, x, w), {"eps": -1.0}, ValueError, "eps must be a non-negative number"),
]


@pytest.mark.parametrize("i", range(len(_BAD)))
def test_errors_name_the_argument_before_any_launch(i, device, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a kernel launched before the error")

    monkeypatch.setattr("truefuse.ops.norm.add_norm.norm_fwd", no_launch)
    make, kw, exc, msg = _BAD[i]
    args = make(*_inputs(m=3, n=16, device=device))
    eps = kw.pop("eps", 1e-6)
    with pytest.raises(exc, match=msg):
        truefuse.add_rms_norm(*args, eps, **kw)


def test_module_refuses_a_residual_of_another_shape():
    m = truefuse.RMSNorm(16)
    with pytest.raises(ValueError, match="residual has shape"):
        m(torch.randn(2, 16), residual=torch.randn(3, 16))
