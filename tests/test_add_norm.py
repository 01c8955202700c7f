"""``truefuse.add_rms_norm_hf``: the contract, the fused kernels against the unfused composition
(``residual + h`` then ``rms_norm_hf``), batch invariance, edge cases and errors. On the CPU the
fp32 cases run the Triton kernels under the interpreter (tests/conftest.py), which is right for
fp32 and wrong for bf16: the kernels' bf16 bits and their speed are the GPU's to check (verify)."""

import pytest
import torch

import truefuse
import truefuse.ops.norm.norm as norm_mod
from truefuse.config import batch_invariant, tuning
from truefuse.ops.norm.add_norm import add_rms_norm_bwd_op, add_rms_norm_hf_fwd_op, add_rms_norm_hf_ref
from truefuse.ops.norm.norm import rms_norm_hf_bi, rms_norm_ref, use_kernel
from truefuse.testing import assert_bitwise, assert_bounded
from truefuse.verify.registry import all_cases

STYLES = ("llama", "gemma")


def _inputs(m=13, n=200, dtype=torch.float32, device="cpu", style="llama", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(m, n, generator=g) * 2 + 0.5).to(device, dtype)
    h = (torch.randn(m, n, generator=g) * 0.5).to(device, dtype)
    w = (torch.randn(n, generator=g) * 0.5 + (0.0 if style == "gemma" else 1.0)).to(device, dtype)
    return r, h, w


def _kernel_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def test_registered_cases(device):
    cases = all_cases(["add_rms_norm_hf"], device.type)
    assert len(cases) == 30
    for case in cases:
        for k, rep in case.fn(device).items():
            assert rep.passed, f"{case.name}/{k}: {rep}"


def _unfused(r, h, w, style):
    """What a patched model runs without the fusion: torch's add, then ``rms_norm_hf``."""
    summed = r + h
    return truefuse.rms_norm_hf(summed, w, 1e-6, style=style), summed


def _fwd_bwd(f, r, h, w, dn, ds):
    leaves = [t.detach().clone().requires_grad_() for t in (r, h, w)]
    normed, summed = f(*leaves)
    grads = torch.autograd.grad((normed, summed), leaves, (dn, ds))
    return normed.detach(), summed.detach(), *grads


@pytest.mark.parametrize("style", STYLES)
def test_kernels_are_the_unfused_composition_bit_for_bit(style, device):
    """Forward and every gradient: the fused op against ``residual + h`` and ``rms_norm_hf`` under
    autograd, which rounds the norm's dx and then adds the residual stream's gradient. In fp32 that
    add rounds the same (no FMA in the interpreter). On a GPU, in bf16 (a model's dtype): the forward
    bit for bit; the gradients, which the fused backward rounds once where autograd rounds twice,
    are bounded (``test_gradients_bounded_by_each_output``)."""
    r, h, w = _inputs(style=style, dtype=_kernel_dtype(device), device=device)
    assert use_kernel(h)
    dn, ds = torch.randn_like(h), torch.randn_like(h)
    got = _fwd_bwd(lambda r, h, w: truefuse.add_rms_norm_hf(r, h, w, 1e-6, style=style), r, h, w, dn, ds)
    want = _fwd_bwd(lambda r, h, w: _unfused(r, h, w, style), r, h, w, dn, ds)
    names = ("normed", "summed") if device.type == "cuda" else ("normed", "summed", "d_residual", "d_h", "d_weight")
    for name, a, b in zip(names, got, want, strict=False):
        assert_bitwise(a, b, name)


@pytest.mark.parametrize("style", STYLES)
def test_one_launch_path_is_the_batch_invariant_norm(style, device):
    """The path batch-invariant mode takes on CUDA (``kernel_stats``: the add, the statistics and
    the norm in one launch of ``_norm_fwd_kernel`` with HAS_RES) against ``rms_norm_hf_bi`` on the
    sum (the norm's own one launch there), called directly so that the CPU interpreter runs it too."""
    dtype = _kernel_dtype(device)
    r, h, w = _inputs(dtype=dtype, device=device, style=style)
    normed, summed, rstd = add_rms_norm_hf_fwd_op(r, h, w, 1e-6, style, True)
    want_y, want_rstd = rms_norm_hf_bi(r + h, w, 1e-6, style)
    assert_bitwise(summed, r + h, "summed")
    assert_bitwise(rstd, want_rstd, "rstd")
    assert_bitwise(normed, want_y, "normed")


@pytest.mark.parametrize("style", STYLES)
def test_gradients_bounded_by_each_output(style, device):
    """Each output alone and both: residual, h and weight gradients bounded against float64
    (``rms_norm_ref`` of the sum), the stock expressions under autograd the baseline."""
    dtype = _kernel_dtype(device)
    r, h, w = _inputs(dtype=dtype, device=device, style=style)
    zc = style == "gemma"
    for use in ("normed", "summed", "both"):
        wants = {"normed": (1, 0), "summed": (0, 1), "both": (1, 1)}[use]

        def run(f, tensors, wants=wants):
            leaves = [t.detach().clone().requires_grad_() for t in tensors]
            normed, summed = f(*leaves)
            g = torch.Generator().manual_seed(1)
            dn, ds = (torch.randn(normed.shape, generator=g).to(normed) for _ in range(2))
            # an output left out of the loss sends no gradient at all (None in the backward)
            loss = sum(((normed * dn).sum(),)[: wants[0]] + ((summed * ds).sum(),)[: wants[1]])
            return torch.autograd.grad(loss, leaves, allow_unused=True)

        got = run(lambda r, h, w: truefuse.add_rms_norm_hf(r, h, w, 1e-6, style=style), (r, h, w))
        base = run(lambda r, h, w: add_rms_norm_hf_ref(r, h, w, 1e-6, style=style), (r, h, w))
        ref = run(
            lambda r, h, w: (rms_norm_ref(r + h, w, 1e-6, zero_centered_gamma=zc), r + h), [t.double().cpu() for t in (r, h, w)]
        )
        for name, a, b, c in zip(("d_residual", "d_h", "d_weight"), got, base, ref, strict=True):
            if use == "summed" and name == "d_weight":
                assert a is None or not a.any(), "the weight has no gradient through the sum alone"
                continue
            assert_bounded(a, c.to(a.device), b, f"{use}: {name}")
        assert torch.equal(got[0], got[1]), "residual and h get the sum's gradient"


def test_nan_and_inf_as_the_reference(device):
    """A NaN, an inf, and +inf + -inf in rows of their own: every output the reference's bits."""
    dtype = _kernel_dtype(device)
    r, h, w = _inputs(m=6, n=64, dtype=dtype, device=device)
    r[1, 3], h[2, 5] = float("nan"), float("inf")
    r[3, 7], h[3, 7] = float("inf"), float("-inf")
    for style in STYLES:
        with tuning(hf_norm_stock_numel=1):
            normed, summed = truefuse.add_rms_norm_hf(r, h, w, 1e-6, style=style)
        want_n, want_s = add_rms_norm_hf_ref(r, h, w, 1e-6, style=style)
        assert_bitwise(summed, want_s, f"{style} summed")
        assert_bitwise(normed, want_n, f"{style} normed")
        assert normed[1].isnan().all() and normed[0].isfinite().all()


def test_batch_invariance(device):
    """Row r of an m-row call equals a 1-row call on row r, bit for bit: both outputs and every row
    gradient (the weight's is a sum over the rows)."""
    dtype = _kernel_dtype(device)
    r, h, w = _inputs(m=37, dtype=dtype, device=device)
    dn, ds = torch.randn_like(h), torch.randn_like(h)

    def call(rows):
        return _fwd_bwd(lambda r, h, w: truefuse.add_rms_norm_hf(r, h, w, 1e-6), r[rows], h[rows], w, dn[rows], ds[rows])

    whole = call(slice(None))
    for i in (0, 36):
        one = call(slice(i, i + 1))
        for name, a, b in zip(("normed", "summed", "d_residual", "d_h"), one[:4], whole[:4], strict=True):
            assert_bitwise(a, b[i : i + 1], f"row {i} {name}")


def test_shapes_views_and_empty(device):
    """(..., H) inputs, non-contiguous ones, zero rows: the reference's values, its shapes."""
    dtype = _kernel_dtype(device)
    r, h, w = _inputs(m=12, n=48, dtype=dtype, device=device)
    r3, h3 = r.view(2, 6, 48), h.t().contiguous().t().view(2, 6, 48)  # a view and a transposed copy
    n3, s3 = truefuse.add_rms_norm_hf(r3.requires_grad_(), h3, w)
    want_n, want_s = add_rms_norm_hf_ref(r3.detach(), h3, w)
    assert n3.shape == s3.shape == (2, 6, 48)
    assert_bitwise(n3.detach(), want_n, "normed")
    assert_bitwise(s3.detach(), want_s, "summed")
    e = torch.empty(0, 48, dtype=dtype, device=device, requires_grad=True)
    w2 = w.clone().requires_grad_()
    n0, s0 = truefuse.add_rms_norm_hf(e, e.detach(), w2)
    (n0.sum() + s0.sum()).backward()
    assert n0.shape == s0.shape == (0, 48) and e.grad.shape == (0, 48)
    assert w2.grad is not None and not w2.grad.any()


def test_backward_op_without_the_streams_gradient(device):
    """``add_rms_norm_bwd`` with no residual gradient is the norm's own backward (d_summed None)."""
    dtype = _kernel_dtype(device)
    r, h, w = _inputs(m=5, n=40, dtype=dtype, device=device)
    s = r + h
    rstd = torch.rsqrt(s.float().pow(2).mean(-1) + 1e-6)
    dn = torch.randn_like(s)
    d, dw = add_rms_norm_bwd_op(dn, None, s, w, rstd, False)
    d0, dw0, _ = norm_mod.norm_bwd_op(dn, s, w, None, rstd.new_empty(0), rstd, True, False)
    assert_bitwise(d, d0, "d")
    assert_bitwise(dw, dw0, "dweight")


_BAD = [
    (lambda r, h, w: ("not a tensor", h, w), {}, TypeError, "residual must be a torch.Tensor"),
    (lambda r, h, w: (r, [1.0], w), {}, TypeError, "h must be a torch.Tensor"),
    (lambda r, h, w: (r[:, :-1], h, w), {}, ValueError, "residual has shape"),
    (lambda r, h, w: (r.double(), h, w), {}, TypeError, "residual has dtype"),
    (lambda r, h, w: (r, h, w[:-1]), {}, ValueError, "weight has shape"),
    (lambda r, h, w: (r, h.int(), w), {}, TypeError, "h has dtype"),
    (lambda r, h, w: (r, h, None), {}, ValueError, "weight must be a tensor"),
    (lambda r, h, w: (r, h, w), {"style": "olmo"}, ValueError, "style must be one of"),
    (lambda r, h, w: (r, h, w), {"eps": -1.0}, ValueError, "eps must be a non-negative number"),
]


@pytest.mark.parametrize("i", range(len(_BAD)))
def test_errors_name_the_argument_before_any_launch(i, device, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a kernel launched before the error")

    monkeypatch.setattr(norm_mod, "norm_fwd", no_launch)
    monkeypatch.setattr("truefuse.ops.norm.add_norm.norm_fwd", no_launch)
    make, kw, exc, msg = _BAD[i]
    args = make(*_inputs(m=3, n=16, device=device))
    eps = kw.pop("eps", 1e-6)
    with pytest.raises(exc, match=msg):
        truefuse.add_rms_norm_hf(*args, eps, **kw)


def test_batch_invariant_mode_keeps_the_norms_bits(device):
    """Inside ``truefuse.batch_invariant()`` the normed rows are ``rms_norm_hf``'s in that mode (the
    fused launch's statistics on CUDA), with a gradient and without."""
    dtype = _kernel_dtype(device)
    r, h, w = _inputs(dtype=dtype, device=device)
    with tuning(hf_norm_stock_numel=1), batch_invariant():
        with torch.no_grad():
            want = truefuse.rms_norm_hf(r + h, w)
            sampler, _ = truefuse.add_rms_norm_hf(r, h, w)
        trainer, summed = truefuse.add_rms_norm_hf(r.clone().requires_grad_(), h, w)
    assert trainer.grad_fn is not None
    assert_bitwise(sampler, want, "no grad")
    assert_bitwise(trainer.detach(), want, "with grad")
    assert_bitwise(summed.detach(), r + h, "summed")


# ``residual=None``: a layer's first norm, the residual stream passing through the norm's node


class _Adds(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, shape):
        super().__init__()
        self.shape, self.n = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("add", "add_") and tuple(args[0].shape) == self.shape:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("style", STYLES)
def test_no_residual_is_the_norm_and_the_stream_through_one_node(style, device):
    """The forward: ``rms_norm_hf``'s bits and ``h`` itself (a view of it); the backward: the
    stream's gradient added inside the norm's kernel (no add over h's shape, autograd's unfused
    path runs one), the gradients bounded against float64 with the stock expression the baseline."""
    dtype = _kernel_dtype(device)
    _, h, w = _inputs(dtype=dtype, device=device, style=style)
    zc = style == "gemma"
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    normed, summed = truefuse.add_rms_norm_hf(None, hl, wl, 1e-6, style=style)
    assert_bitwise(normed, truefuse.rms_norm_hf(h, w, 1e-6, style=style), "normed")
    assert summed._base is hl and torch.equal(summed, hl)
    g = torch.Generator().manual_seed(2)
    dn, ds = (torch.randn(h.shape, generator=g).to(device, dtype) for _ in range(2))
    counts = []
    for f in (
        lambda h, w: truefuse.add_rms_norm_hf(None, h, w, 1e-6, style=style),
        lambda h, w: (truefuse.rms_norm_hf(h, w, 1e-6, style=style), h),
    ):
        leaves = [t.clone().requires_grad_() for t in (h, w)]
        outs = f(*leaves)
        with _Adds(h.shape) as mode:
            got = torch.autograd.grad(outs, leaves, (dn, ds))
        counts.append(mode.n)
    assert counts == [0, 1], counts
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    base = torch.autograd.grad(add_rms_norm_hf_ref(None, *leaves, 1e-6, style=style), leaves, (dn, ds))
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in (h, w)]
    ref = torch.autograd.grad(
        (rms_norm_ref(leaves64[0], leaves64[1], 1e-6, zero_centered_gamma=zc), leaves64[0]),
        leaves64,
        (dn.cpu().double(), ds.cpu().double()),
    )
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    got = torch.autograd.grad(truefuse.add_rms_norm_hf(None, *leaves, 1e-6, style=style), leaves, (dn, ds))
    for name, a, b, c in zip(("d_h", "d_weight"), got, base, ref, strict=True):
        assert_bounded(a, c.to(a.device), b, name)


def test_no_residual_with_only_the_stream_used_and_twice_differentiated(device):
    dtype = _kernel_dtype(device)
    _, h, w = _inputs(dtype=dtype, device=device)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    _, summed = truefuse.add_rms_norm_hf(None, hl, wl, 1e-6)
    dh, dw = torch.autograd.grad(summed.sum(), (hl, wl), allow_unused=True)
    assert torch.equal(dh, torch.ones_like(h)) and dw is None
    normed, _ = truefuse.add_rms_norm_hf(None, hl, wl, 1e-6)
    (g,) = torch.autograd.grad(normed.square().sum(), hl, create_graph=True)
    with pytest.raises(RuntimeError, match="add_rms_norm_hf"):
        g.sum().backward()
