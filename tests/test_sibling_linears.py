"""``truefuse.sibling_linears``: the stock calls' outputs and weight / bias gradients bit for bit, the
input gradient summed inside the GEMMs (no add kernel), a correct double backward, autocast's
casts, and clear errors naming the argument."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import truefuse
from truefuse import sibling_linears, sibling_linears_ref


def _inputs(dtype=torch.float32, ns=(24, 8, 8), k=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, k, generator=g).to(dtype).requires_grad_()
    ws = [torch.randn(n, k, generator=g).to(dtype).requires_grad_() for n in ns]
    bs = [torch.randn(ns[0], generator=g).to(dtype).requires_grad_(), None, None]
    dys = [torch.randn(2, 5, n, generator=g).to(dtype) for n in ns]
    return x, ws, bs, dys


def _grads(fn, x, ws, bs, dys):
    outs = fn(x, ws, bs)
    return outs, torch.autograd.grad(outs, [x, *ws, bs[0]], dys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_parameter_gradients_are_the_stock_bits(dtype):
    x, ws, bs, dys = _inputs(dtype)
    outs, (dx, *dp) = _grads(sibling_linears, x, ws, bs, dys)
    want, (want_dx, *want_dp) = _grads(sibling_linears_ref, x, ws, bs, dys)
    for o, w in zip(outs, want, strict=True):
        assert torch.equal(o, w)
    for g, w in zip(dp, want_dp, strict=True):
        assert torch.equal(g, w)
    bf16 = dtype is torch.bfloat16
    torch.testing.assert_close(dx, want_dx, rtol=4e-2 if bf16 else 1e-5, atol=6e-2 if bf16 else 1e-5)  # bits: verify's bound


class _Ops(TorchDispatchMode):
    def __init__(self, shape):
        super().__init__()
        self.shape, self.seen = shape, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor) and tuple(args[0].shape) in self.shape:
            self.seen[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_input_gradient_is_summed_in_the_gemms_not_by_adds():
    """Autograd's sum over three projections is two adds over x's shape; sibling_linears runs
    none: one mm and two accumulating addmm_ on the running sum."""
    counts = {}
    for name, fn in (("stock", sibling_linears_ref), ("fused", sibling_linears)):
        x, ws, bs, dys = _inputs()
        outs = fn(x, ws, bs)
        with _Ops({(10, 16), (2, 5, 16)}) as mode:
            torch.autograd.backward(outs, dys)
        counts[name] = mode.seen
    assert counts["stock"]["add"] + counts["stock"]["add_"] == 2, counts
    assert counts["fused"]["add"] + counts["fused"]["add_"] == 0 and counts["fused"]["addmm_"] == 2, counts


def test_double_backward_is_autograds():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    a, b = (torch.randn(n, 5, dtype=torch.float64, generator=g, requires_grad=True) for n in (4, 3))
    c = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, a, b, c: sibling_linears(x, [a, b], [c, None]), (x, a, b, c))


def test_an_unused_output_contributes_nothing():
    x, ws, bs, dys = _inputs()
    q, k, v = sibling_linears(x, ws, bs)
    gx, gk = torch.autograd.grad((q * dys[0]).sum() + (v * dys[2]).sum(), [x, ws[1]], allow_unused=True)
    q2, _, v2 = sibling_linears_ref(x, ws, bs)
    want = torch.autograd.grad((q2 * dys[0]).sum() + (v2 * dys[2]).sum(), [x])[0]
    torch.testing.assert_close(gx, want)
    assert gk is None


def test_autocast_casts_as_f_linear_and_gradients_return_in_the_parameters_dtype():
    x, ws, bs, dys = _inputs()
    with torch.autocast("cpu", torch.bfloat16):
        outs = sibling_linears(x, ws, bs)
        want = sibling_linears_ref(x, ws, bs)
    assert all(o.dtype is torch.bfloat16 and torch.equal(o, w) for o, w in zip(outs, want, strict=True))
    got = torch.autograd.grad(outs, [x, *ws, bs[0]], [d.bfloat16() for d in dys])
    ref = torch.autograd.grad(want, [x, *ws, bs[0]], [d.bfloat16() for d in dys])
    assert all(g.dtype is torch.float32 for g in got)
    assert all(torch.equal(g, r) for g, r in zip(got[1:], ref[1:], strict=True))  # the parameters' through the same casts
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)


def test_nan_and_inf_propagate_as_in_the_reference():
    x, ws, bs, dys = _inputs()
    with torch.no_grad():
        x[0, 1, 3] = float("nan")
        ws[2][1, 0] = float("inf")
    dys[1][1, 2, 0] = float("nan")
    (outs, grads), (want, want_grads) = _grads(sibling_linears, x, ws, bs, dys), _grads(sibling_linears_ref, x, ws, bs, dys)
    for a, b in zip([*outs, *grads], [*want, *want_grads], strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x, w: sibling_linears(x, [w, w[:, :3]]), r"weights\[1\] has shape \(24, 3\); x's last dimension is 16"),
        (lambda x, w: sibling_linears(x, [w], [None, None]), "biases has 2 entries; weights has 1"),
        (lambda x, w: sibling_linears(x, [w], [torch.zeros(3)]), r"biases\[0\] must be None or a \(24,\) tensor"),
        (lambda x, w: sibling_linears(x, []), "weights must hold at least one"),
        (lambda x, w: sibling_linears("x", [w]), "x must be a torch.Tensor"),
    ],
)
def test_bad_arguments_are_named(call, match):
    x, ws, _, _ = _inputs()
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, ws[0])


def test_public_names():
    assert truefuse.sibling_linears is sibling_linears and truefuse.sibling_linears_ref is sibling_linears_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_input_gradient_keeps_each_row_its_own(device, dtype):
    """``summed_input_grad_bi`` (batch-invariant mode's group): a row's sum alone and among 64
    rows is the same bits, through every product (the first and each accumulated one), and
    within one rounding a product of the float64 sum. bf16 where the kernels run it (the GPU)."""
    from truefuse.ops.gemm.siblings import summed_input_grad_bi

    if dtype is torch.bfloat16 and device.type != "cuda":
        pytest.skip("bf16 batch-invariant GEMMs are checked on the GPU")
    g = torch.Generator().manual_seed(5)
    K, ns = 256, (256, 128, 128)
    weights = [(torch.randn(n, K, generator=g) / 16).to(device, dtype) for n in ns]
    dys = [torch.randn(64, n, generator=g).to(device, dtype) for n in ns]
    full = summed_input_grad_bi(dys, weights)
    for i in (0, 17, 63):
        alone = summed_input_grad_bi([d[i : i + 1] for d in dys], weights)
        assert torch.equal(alone[0], full[i]), i
    ref = sum(d.double() @ w.double() for d, w in zip(dys, weights, strict=True))
    tol = 3 * len(ns) * torch.finfo(dtype).eps
    torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert summed_input_grad_bi([None, dys[1], None], weights).equal(summed_input_grad_bi([dys[1]], weights[1:2]))


def test_batch_invariant_mode_refuses_double_backward_by_name():
    """The batch-invariant group's backward is GEMM launches, not autograd ops: differentiating its
    gradient raises an error naming it (fast mode's is autograd's own, above)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 8, generator=g, requires_grad=True)
    ws = [torch.randn(4, 8, generator=g, requires_grad=True) for _ in range(2)]
    with truefuse.batch_invariant():
        outs = sibling_linears(x, ws)
    (dx,) = torch.autograd.grad(sum(o.square().sum() for o in outs), x, create_graph=True)
    with pytest.raises(RuntimeError, match="sibling_linears"):
        dx.sum().backward()
