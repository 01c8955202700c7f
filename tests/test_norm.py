"""rms_norm / layer_norm and truefuse.RMSNorm: bounded contract, batch
invariance, the rounding rule, edge shapes and errors. On the CPU the fp32 cases run the Triton
kernels under the interpreter; the others run the reference."""

import pytest
import torch
import triton
import triton.language as tl

import truefuse
from truefuse.config import get_tuning, tuning
from truefuse.kernels.norm import _widen
from truefuse.ops._launch.triton import hopper
from truefuse.ops.norm.norm import bwd_staged, layer_norm_ref, ln_fwd_staged, norm_fwd, rms_norm_ref, rms_norm_torch, use_kernel
from truefuse.ops.norm.norm_config import bwd_config, bwd_staged_config, ln_fwd_config, ln_fwd_staged_config
from truefuse.testing import assert_bitwise, assert_bounded
from truefuse.verify.registry import all_cases


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_registered_cases(op, device):
    cases = all_cases([op], device.type)
    assert len(cases) >= 6
    for case in cases:
        for k, rep in case.fn(device).items():
            assert rep.passed, f"{case.name}/{k}: {rep}"


@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_batch_invariance(fn, device):
    """Row r of an m-row call equals a 1-row call on row r, bit for bit (forward and input gradient)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    f = getattr(truefuse, fn)
    x = torch.randn(37, 200, device=device, dtype=dtype)
    w = torch.randn(200, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    xa = x.clone().requires_grad_()
    f(xa, w).backward(dy)
    for r in (0, 36):
        xr = x[r : r + 1].clone().requires_grad_()
        yr = f(xr, w)
        yr.backward(dy[r : r + 1])
        assert_bitwise(yr, f(x, w)[r : r + 1], f"row {r} forward")
        assert_bitwise(xr.grad, xa.grad[r : r + 1], f"row {r} input gradient")


@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_two_part_backward(fn, device):
    """The hidden size the backward takes in two halves (16384, ops.norm_config.bwd_config): the
    reference's gradients, a row's dx independent of the rows beside it.
    The CPU leaves out the weight and bias (their partials' sum: 1024 interpreted programs, 10 s)."""
    n = 16384
    assert bwd_config(n).parts == bwd_config(n, rms=False).parts == (8192, 8192)
    f, ref = getattr(truefuse, fn), (rms_norm_ref if fn == "rms_norm" else layer_norm_ref)
    x = (torch.randn(3, n, device=device) * 2 + 1).requires_grad_()
    params = []
    if device.type == "cuda":
        params = [torch.rand(n, device=device) + 0.5] + ([torch.randn(n, device=device)] if fn == "layer_norm" else [])
        params = [p.requires_grad_() for p in params]
    dy = torch.randn_like(x)
    got = torch.autograd.grad(f(x, *params), [x, *params], dy)
    inputs64 = [t.detach().double().requires_grad_() for t in (x, *params)]
    want = torch.autograd.grad(ref(*inputs64), inputs64, dy.double())
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r.float(), rtol=1e-4, atol=1e-4)
    x1 = x[1:2].detach().requires_grad_()
    assert_bitwise(torch.autograd.grad(f(x1, *params), x1, dy[1:2])[0], got[0][1:2], "row 1 alone")


@pytest.mark.parametrize("n", [2044, 5116])
def test_layer_norm_forward_narrow_weights(n, device):
    """LayerNorm's pointer forward with w and b held in their own dtype between rows
    (ops.norm_config.ln_fwd_config; one program per row at 2044, persistent at 5116 on the GPU; H % 8 != 0
    keeps bf16 off the TMA-staged kernel): the reference's values, and a row's bits independent of
    the rows beside it."""
    assert ln_fwd_config(n)[2] == "narrow"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = (torch.randn(5, n, device=device) * 2 + 1).to(dtype)
    w, b = (torch.rand(n, device=device) + 0.5).to(dtype), torch.randn(n, device=device).to(dtype)
    y = truefuse.layer_norm(x, w, b)
    want = layer_norm_ref(x.double(), w.double(), b.double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    assert_bitwise(truefuse.layer_norm(x[3:4], w, b), y[3:4], "row 3 alone")


@pytest.mark.parametrize("n", [2880, 5120])
def test_layer_norm_staged_forward(n, device):
    """The TMA-staged LayerNorm forward (ops.norm.ln_fwd_staged; bf16 on a Hopper GPU through
    truefuse.layer_norm, fp32 under the CPU interpreter launched directly): the reference's
    values, and a row's bits independent of the rows beside it."""
    if device.type == "cuda" and not hopper(torch.empty(0, device=device)):
        pytest.skip("TMA needs compute capability 9+")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ln_fwd_staged_config(n, torch.bfloat16)
    assert cfg is not None and ln_fwd_staged_config(n + 4, torch.bfloat16) is None
    x = (torch.randn(5, n, device=device) * 2 + 1).to(dtype)
    w, b = (torch.rand(n, device=device) + 0.5).to(dtype), torch.randn(n, device=device).to(dtype)

    def run(xs):
        y, stats = torch.empty_like(xs), torch.empty(2, xs.shape[0], device=device)
        ln_fwd_staged(xs, w, b, 1e-5, False, y, stats[0], stats[1], cfg)
        return y

    y = run(x)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), layer_norm_ref(x.double(), w.double(), b.double()), rtol=tol, atol=tol)
    assert_bitwise(run(x[3:4]), y[3:4], "row 3 alone")
    if device.type == "cuda":
        assert_bitwise(truefuse.layer_norm(x, w, b), y, "truefuse.layer_norm takes the staged kernel")


@pytest.mark.parametrize(("rms", "n"), [(True, 2880), (True, 5120), (False, 2880), (False, 7168)])
def test_staged_backward(rms, n, device):
    """The TMA-staged backward (ops.norm.bwd_staged; bf16 on a Hopper GPU through the norms'
    autograd, fp32 under the CPU interpreter launched directly, two rows per program, with both of
    ``bwd_math``'s choices on): the float64 reference's dx, dw and db, and a row's dx bits
    independent of the rows beside it; on the GPU the bits of the autograd path, where
    ``bwd_math`` turns them off at these sizes."""
    if device.type == "cuda" and not hopper(torch.empty(0, device=device)):
        pytest.skip("TMA needs compute capability 9+")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = bwd_staged_config(n, torch.bfloat16, rms)
    assert cfg is not None and bwd_staged_config(n + 8, torch.bfloat16, rms) is None  # not whole 64-column chunks
    assert bwd_staged_config(n, torch.float32, rms) is None
    x = (torch.randn(5, n, device=device) * 2 + 1).to(dtype)
    dy = torch.randn(5, n, device=device).to(dtype)
    w = (torch.rand(n, device=device) + 0.5).to(dtype)
    b = None if rms else torch.randn(n, device=device).to(dtype)

    def run(xs, dys):
        m = xs.shape[0]
        programs = -(-m // 2)
        _, mean, rstd = norm_fwd(xs, w, b, 1e-5, rms=rms, zero_centered_gamma=False)
        dx, parts = torch.empty_like(xs), torch.empty(2, programs, n, device=device)
        tail = (w, rstd if rms else mean, rstd, dx, parts[0], rstd if rms else parts[1])
        flags = dict(
            IS_RMS=rms, HAS_W=True, HAS_B=not rms, ZERO_CENTERED=False, PDL=False, num_warps=cfg[0], ONE_REDUCE=True, REMAT=True
        )
        bwd_staged(dys, xs, tail, m, n, 2, programs, cfg, flags)
        return dx, parts[0].sum(0), parts[1].sum(0)

    dx, dw, db = run(x, dy)
    inputs = [t.double().requires_grad_() for t in (x, w) + (() if rms else (b,))]
    ref = rms_norm_ref(*inputs, 1e-5) if rms else layer_norm_ref(*inputs, 1e-5)
    want = torch.autograd.grad(ref, inputs, dy.double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for got, r, what in zip((dx, dw, db), want, ("dx", "dw", "db"), strict=False):
        torch.testing.assert_close(got.double(), r, rtol=tol, atol=tol * r.abs().max().item(), msg=what)
    assert_bitwise(run(x[3:4], dy[3:4])[0], dx[3:4], "row 3 alone")
    if device.type == "cuda":
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        f = truefuse.rms_norm(xa, wa, 1e-5) if rms else truefuse.layer_norm(xa, wa, b, 1e-5)
        assert_bitwise(torch.autograd.grad(f, xa, dy)[0], dx, "the norms' backward takes the staged kernel")


@triton.jit
def _widen_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + c, _widen(tl.load(x_ptr + c), True))


def test_widen_is_exact(device):
    """``kernels/norm.py::_widen``'s shift (the backward's REMAT) is bf16 -> fp32 conversion, bit for
    bit, for all 65536 bf16 patterns (NaN payloads, infinities, -0, subnormals)."""
    if not (device.type == "cuda" or use_kernel(torch.empty(1, 1))):
        pytest.skip("needs Triton (CUDA or the interpreter)")
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)
    y = torch.empty(x.shape, dtype=torch.float32, device=device)
    _widen_kernel[(x.numel() // 4096,)](x, y, BLOCK=4096)
    assert torch.equal(y.view(torch.int32), x.float().view(torch.int32))


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (the CPU interprets these paths in test_staged_backward and test_two_part_backward)",
)
@pytest.mark.parametrize("n", [5120, 16384])
def test_bwd_math_keeps_bits(n, monkeypatch):
    """``ops/norm/norm_config.py::bwd_math``'s schedule choices for LayerNorm where it makes them (one reduction
    for its two row sums; x and dy held in bf16 through them at 16384) give the float64
    reference's dx, dw and db within bf16's bound, bit for bit as without them."""
    from truefuse.ops.norm import norm as ops_norm

    chosen = ops_norm.bwd_math(n, False)
    assert chosen["ONE_REDUCE"] and chosen["REMAT"] == (n > 8192), "the case exercises the choices"
    x = (torch.randn(40, n, device="cuda") * 2 + 1).bfloat16()
    dy = torch.randn(40, n, device="cuda").bfloat16()
    params = [(torch.rand(n, device="cuda") + 0.5).bfloat16(), torch.randn(n, device="cuda").bfloat16()]

    def grads(math):
        monkeypatch.setattr(ops_norm, "bwd_math", lambda _n, _rms: math)
        xs, ps = x.clone().requires_grad_(), [p.clone().requires_grad_() for p in params]
        return torch.autograd.grad(truefuse.layer_norm(xs, *ps, eps=1e-5), [xs, *ps], dy)

    on, off = grads(chosen), grads(dict(ONE_REDUCE=False, REMAT=False))
    inputs = [t.double().requires_grad_() for t in (x, *params)]
    want = torch.autograd.grad(layer_norm_ref(*inputs, 1e-5), inputs, dy.double())
    for a, b, r, what in zip(on, off, want, ("dx", "dw", "db"), strict=True):
        torch.testing.assert_close(a.double(), r, rtol=2e-2, atol=2e-2 * r.abs().max().item(), msg=what)
        assert_bitwise(a, b, what)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [5120, 16384])  # both PDL trigger placements (ops/norm/norm_config.py::pdl_trigger)
@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_chained_launches_read_the_previous_output(fn, n):
    """Each norm kernel starts early under programmatic dependent launch (the previous kernel lets
    it) and must wait before its first load, pipelined TMA loads included: a chain of norms queued
    back to back (each reading the last one's output, forward and backward) gives the bits of the
    same chain with a device sync between the steps."""
    f = getattr(truefuse, fn)
    x = torch.randn(8192, n, device="cuda").bfloat16().requires_grad_()
    w = (torch.rand(n, device="cuda") + 0.5).bfloat16().requires_grad_()

    def queued():  # every launch queued back to back
        h = x
        for _ in range(4):
            h = f(h, w)
        (gx,) = torch.autograd.grad(h, x, torch.ones_like(h))
        return h.detach(), gx

    def stepwise():  # each step's input a leaf, a device sync after every step, forward and backward
        h, steps = x, []
        for _ in range(4):
            inp = h if h is x else h.detach().requires_grad_()
            h = f(inp, w)
            steps.append((inp, h))
            torch.cuda.synchronize()
        g = torch.ones_like(h)
        for inp, out in reversed(steps):
            (g,) = torch.autograd.grad(out, inp, g)
            torch.cuda.synchronize()
        return h.detach(), g

    want = stepwise()
    for _ in range(3):
        for got, ref, name in zip(queued(), want, ("y", "dx"), strict=True):
            assert_bitwise(got, ref, name)


def test_rounding_rule_single_rounding(device):
    """The kernel path and the reference follow one rule: fp32 math, one rounding at the end; the
    result differs from torch's twice-rounded bf16 path (so the test can tell the two apart)."""
    if device.type != "cuda":
        pytest.skip("bf16 kernel numerics are checked on the GPU (the interpreter truncates bf16)")
    x = torch.randn(512, 1000, device=device, dtype=torch.bfloat16) * 3
    w = torch.rand(1000, device=device, dtype=torch.bfloat16) + 0.5
    got, ref = truefuse.rms_norm(x, w), rms_norm_ref(x, w)
    differ = (got != ref).float().mean().item()
    assert differ < 0.01, differ  # only reduction-order ties of the fp32 statistics may flip a bit
    torch_path = torch.nn.functional.rms_norm(x, (1000,), w, 1e-6)
    assert (torch_path != ref).any()


def test_edge_shapes(device):
    for shape in [(0, 64), (1, 1), (3, 5, 7)]:
        x = torch.randn(*shape, device=device, requires_grad=True)
        w = torch.randn(shape[-1], device=device, requires_grad=True)
        y = truefuse.rms_norm(x, w)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
        assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    x = torch.randn(4, 64, device=device)
    assert_bounded(truefuse.rms_norm(x, None), rms_norm_ref(x.cpu().double(), None), rms_norm_torch(x, None), "no weight")
    wide = torch.randn(2, get_tuning().max_kernel_n + 1, device=device)
    assert not use_kernel(wide)
    assert_bitwise(truefuse.rms_norm(wide, None), rms_norm_ref(wide, None), "wider than the kernel: the reference")


def test_zero_rows_give_zero_weight_grad(device):
    x = torch.randn(0, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    b = torch.randn(32, device=device, requires_grad=True)
    truefuse.layer_norm(x, w, b).sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_errors(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\); x's last dimension is 8"):
        truefuse.rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match=r"bias has shape"):
        truefuse.layer_norm(x, torch.ones(8, device=device), torch.ones(9, device=device))
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        truefuse.rms_norm(torch.ones(4, 8, dtype=torch.long, device=device), None)
    with pytest.raises(ValueError, match="eps must be a non-negative"):
        truefuse.rms_norm(x, None, -1.0)
    with pytest.raises(ValueError, match="zero_centered_gamma=True needs a weight"):
        truefuse.rms_norm(x, None, zero_centered_gamma=True)


def test_rmsnorm_module_is_torch_rmsnorm(device):
    m = truefuse.RMSNorm(64, eps=1e-5, device=device)
    assert isinstance(m, torch.nn.RMSNorm)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 9, 64, device=device)
    assert_bitwise(m(x), truefuse.rms_norm(x, m.weight, 1e-5), "module = function")
    ref = torch.nn.RMSNorm(64, eps=1e-5, device=device)
    ref.load_state_dict(m.state_dict())
    assert torch.allclose(m(x), ref(x), rtol=1e-5, atol=1e-5)
    zc = truefuse.RMSNorm((4, 16), zero_centered_gamma=True, device=device)
    assert not zc.weight.any()
    y = zc(x.view(2, 9, 4, 16))
    assert y.shape == (2, 9, 4, 16)
    assert_bitwise(
        y.view(2, 9, 64),
        truefuse.rms_norm(x, torch.zeros(64, device=device), torch.finfo(x.dtype).eps, zero_centered_gamma=True),
        "zc",
    )
    with pytest.raises(ValueError, match=r"last dimensions must be \(4, 16\)"):
        zc(x)
    with pytest.raises(ValueError, match="zero_centered_gamma=True needs elementwise_affine"):
        truefuse.RMSNorm(8, elementwise_affine=False, zero_centered_gamma=True)


class _AtenLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops dispatched at the top level (a custom op's inside runs outside the mode)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["eager", "dispatcher"])
@pytest.mark.parametrize("rms", [True, False])
def test_backward_launches_no_zero_fills(rms, path, device):
    """The norm's backward is the backward kernel and nothing else: autograd must not zero-fill
    gradients for the saved statistics (mean, rstd; non-differentiable outputs). Each fill is one more
    kernel in every backward (a memset of M floats, ~1-2 µs on the GPU beside a 25 µs fwd+bwd at 8192 x 1024)."""
    dt = torch.float32
    x = torch.randn(33, 64, device=device, dtype=dt, requires_grad=True)
    w = torch.rand(64, device=device, dtype=dt, requires_grad=True)
    params = (w,) if rms else (w, torch.rand(64, device=device, dtype=dt, requires_grad=True))
    fn = truefuse.rms_norm if rms else truefuse.layer_norm
    if not use_kernel(x):
        pytest.skip("the reference runs here (no custom op)")
    if path == "eager":  # the public function: autograd/_eager_op.py, the backward op's body directly
        y = fn(x, *params)
    else:  # the op itself, as torch.compile traces it: its backward op through the dispatcher
        from truefuse.ops.norm.norm import norm_fwd_op

        y = norm_fwd_op(x, w, None if rms else params[1], 1e-6 if rms else 1e-5, rms, False)[0]
    dy = torch.randn_like(y)
    with _AtenLog() as log:
        grads = torch.autograd.grad(y, (x, *params), dy)
    assert ("truefuse.norm_bwd" in log.ops) == (path == "dispatcher"), log.ops
    assert not [op for op in log.ops if op.startswith(("aten.zeros", "aten.zero_", "aten.fill", "aten.full"))], log.ops
    ref = torch.autograd.grad((rms_norm_ref if rms else layer_norm_ref)(x, *params), (x, *params), dy)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("fn", "n"), [("rms_norm", 4096), ("layer_norm", 16384)])
def test_pdl_trigger_moves_no_bits(fn, n, monkeypatch):
    """Where a kernel lets the next one launch (its start or its exit) is the schedule only: the
    sizes where ``pdl_trigger`` picks the exit give the bits of every kernel triggering at its start."""
    import truefuse.ops.norm.norm as ops_norm

    x = torch.randn(1000, n, device="cuda").bfloat16().requires_grad_()
    params = [(torch.rand(n, device="cuda") + 0.5).bfloat16().requires_grad_()]
    if fn == "layer_norm":
        params.append(torch.randn(n, device="cuda").bfloat16().requires_grad_())
    dy = torch.randn_like(x)

    def run():
        y = getattr(truefuse, fn)(x, *params)
        return (y, *torch.autograd.grad(y, (x, *params), dy))

    assert 2 in (ops_norm.pdl_trigger("fwd", n, fn == "rms_norm"), ops_norm.pdl_trigger("bwd", n, fn == "rms_norm"))
    chosen = run()
    monkeypatch.setattr(ops_norm, "pdl_trigger", lambda kernel, n, rms: 1)
    for got, ref in zip(run(), chosen, strict=True):
        assert_bitwise(got, ref, "trigger at start")


def test_backward_without_upstream_gradient(device):
    """Grads are not materialized (above): a backward reached with no gradient for y returns none,
    rather than launching the kernel on a missing dy."""
    from truefuse.ops.norm.norm import norm_fwd_op

    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.rand(16, device=device, requires_grad=True)
    if not use_kernel(x):
        pytest.skip("the reference runs here (no custom op)")
    y = norm_fwd_op(x, w, None, 1e-5, True, False)[0]
    assert all(g is None for g in y.grad_fn.apply(None, None, None))
    dx = y.grad_fn.apply(torch.ones_like(y), None, None)[0]
    assert dx is not None and dx.shape == x.shape


def test_rms_norm_hf_small_call_without_grad_runs_stock(device, monkeypatch):
    """A decode-sized ``rms_norm_hf`` with nothing to differentiate runs the stock expression (the
    same bits as the kernel: the contract's bitwise forward) rather than statistics and a launch;
    with a gradient to take, above the knob, or in batch-invariant mode (whose statistics are the
    kernel's on CUDA) the kernel runs. Counted through the reference the op calls."""
    import truefuse.autograd.norm as autograd_norm

    x = torch.randn(4, 64, device=device)
    w = torch.rand(64, device=device) + 0.5
    if not use_kernel(x):
        pytest.skip("the reference runs here (no kernel to skip)")
    calls = []
    real_ref = autograd_norm.rms_norm_hf_ref
    monkeypatch.setattr(autograd_norm, "rms_norm_hf_ref", lambda *a, **k: calls.append(1) or real_ref(*a, **k))
    with torch.no_grad():
        stock_path = truefuse.rms_norm_hf(x, w)
    assert len(calls) == 1
    with tuning(hf_norm_stock_numel=x.numel() - 1), torch.no_grad():
        kernel_path = truefuse.rms_norm_hf(x, w)
    assert_bitwise(stock_path, kernel_path, "stock expression vs kernel")
    truefuse.rms_norm_hf(x.requires_grad_(), w)
    with truefuse.batch_invariant(), torch.no_grad():
        truefuse.rms_norm_hf(x, w)
    assert len(calls) == 1


@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("n", [64, 1000, 5120])
def test_rms_norm_hf_bi_with_and_without_grad_same_bits(style, n, device):
    """Batch-invariant mode's ``rms_norm_hf``: without a gradient one launch (the kernel's
    statistics applied in place), with one the op applying those statistics; the same bits (a
    sampler's forward and a trainer's). Hidden sizes of both schedules, a masked row (1000: the
    statistics kernel compiled without the weight reduced such rows in another order on an H100)."""
    from truefuse.ops.norm.norm import rms_norm_hf_bi, rms_norm_hf_fwd_op

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = (torch.randn(37, n, device=device) * 3).to(dtype)
    w = (torch.rand(n, device=device) + 0.5).to(dtype)
    if not use_kernel(x):
        pytest.skip("the reference runs here")
    y, rstd = rms_norm_hf_bi(x, w, 1e-6, style)
    assert_bitwise(y, rms_norm_hf_fwd_op(x, w, rstd, style), "one launch vs its statistics applied")
    if device == "cuda":  # the public op in the mode, on either path
        with truefuse.batch_invariant():
            with torch.no_grad():
                sampler = truefuse.rms_norm_hf(x, w, 1e-6, style=style)
            trainer = truefuse.rms_norm_hf(x.requires_grad_(), w, 1e-6, style=style)
        assert trainer.grad_fn is not None
        assert_bitwise(sampler, y, "no grad")
        assert_bitwise(trainer.detach(), y, "with grad")


@pytest.mark.parametrize("rms", [True, False])
def test_forward_launch_names_every_parameter(rms, monkeypatch):
    """``norm_fwd``'s launch names every kernel parameter, defaults included: Dynamo traces it
    itself where no op wraps it (batch-invariant ``rms_norm_hf``'s statistics under torch.compile)
    and records only the named ones; Inductor's launcher then takes an unnamed constexpr as a
    positional argument and its call missed the last grid one (issue 47: "launcher() missing 1
    required positional argument: '_grid_2'" in a graphed generate on an H100)."""
    import inspect

    import truefuse.ops.norm.norm as norm_mod
    from truefuse.kernels.norm import _norm_fwd_kernel

    params = list(inspect.signature(_norm_fwd_kernel.fn).parameters)  # a JIT or an interpreted kernel
    named = []

    class Recorder:
        def __init__(self, kernel):
            assert kernel is _norm_fwd_kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                named.append(params[: len(args)] + list(kwargs))

            return run

    monkeypatch.setattr(norm_mod, "kernel_for", lambda kernel, t: Recorder(kernel))
    x, w = torch.randn(3, 64), torch.rand(64)
    if rms:
        norm_fwd(x, w, None, 1e-6, rms=True, zero_centered_gamma=False, round_normed=True, hf_stats=True)
        norm_fwd(x, w, None, 1e-6, rms=True, zero_centered_gamma=False, rstd=torch.ones(3))
    else:
        norm_fwd(x, w, torch.rand(64), 1e-5, rms=False, zero_centered_gamma=False)
    assert named
    for names in named:
        assert set(params) <= set(names), f"left to their defaults: {sorted(set(params) - set(names))}"


@pytest.mark.parametrize("shape", [(6, 64), (2, 3, 64)])
def test_rms_norm_hf_graph_is_one_node(shape):
    """``rms_norm_hf`` with a gradient records one autograd node on x and the weight themselves: the
    rows flattened inside its op, not by a reshape and a view around it (host time each layer's norm
    pays; docs/benchmarks.md). Gradients as the stock expression's."""
    from truefuse.ops.norm.norm import rms_norm_hf_ref

    x, w = torch.randn(*shape, requires_grad=True), torch.randn(shape[-1], requires_grad=True)
    if not use_kernel(x):
        pytest.skip("the reference path (no kernel here)")
    y = truefuse.rms_norm_hf(x, w, 1e-6)
    inputs = sorted(type(n).__name__ for n, _ in y.grad_fn.next_functions if n is not None)
    assert inputs == ["AccumulateGrad", "AccumulateGrad"], f"{type(y.grad_fn).__name__} <- {inputs}"
    dy = torch.randn(shape)
    got = torch.autograd.grad(y, (x, w), dy)
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    want = torch.autograd.grad(rms_norm_hf_ref(x2, w2, 1e-6), (x2, w2), dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 1000), (5, 4096), (3, 64), (0, 64), (8192 // 64, 2048)])
def test_the_squares_kernel_gives_the_stock_statistics(dtype, shape):
    """``rms_norm_hf``'s fast-mode statistics from one squaring pass and torch's mean
    (``hf_rstd_squared``) are stock's ``rsqrt(x.float().pow(2).mean(-1) + eps)``, bit for bit."""
    from truefuse.ops.norm.norm import hf_rstd, hf_rstd_squared

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 3).to(dev, dtype)
    if not use_kernel(x.float()):
        pytest.skip("the kernels do not run here")
    assert_bitwise(hf_rstd_squared(x, 1e-6), hf_rstd(x, 1e-6), "statistics")


def test_fast_mode_statistics_take_one_squaring_pass_for_two_byte_rows(monkeypatch):
    """Where the kernels run, a 2-byte ``x``'s statistics (``hf_statistics`` outside
    batch-invariant mode, the residual add's too) come from the squares kernel, saving stock's cast
    pass; fp32 rows (whose cast is no copy) and traced ones keep stock's expression."""
    import truefuse.ops.norm.norm as norm

    calls = []
    real = norm.hf_rstd_squared
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors reach no kernel on a GPU box
    if not norm.use_kernel(torch.ones(1, device=dev)):
        pytest.skip("the kernels do not run here")
    monkeypatch.setattr(norm, "use_kernel", lambda x: True)
    monkeypatch.setattr(norm, "hf_rstd_squared", lambda x, eps: calls.append(x.dtype) or real(x, eps))
    w = torch.ones(64, device=dev)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4, 64).to(dev, dtype)
        assert_bitwise(norm.hf_statistics(x, w, 1e-6, "llama", False), norm.hf_rstd(x, 1e-6), "statistics")
    assert calls == [torch.bfloat16]
