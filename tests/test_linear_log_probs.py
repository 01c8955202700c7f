"""linear_log_probs (per-token log-probabilities and entropy on the chunked LM head) against its
float64 reference for every option, its gradients under any upstream, the weight-gradient
contract, non-finite rows, bad input; and the chunked head as a mechanism any loss can use."""

import pytest
import torch

import truefuse
from truefuse.ops._launch.triton import triton_runs
from truefuse.ops.lm_head.chunked_head import head_chunks
from truefuse.ops.lm_head.linear_log_probs import LinearLogProbsOptions, LogProbChunks, linear_log_probs_ref
from truefuse.testing import bounded_report
from truefuse.verify.cases_linear_cross_entropy import make_inputs
from truefuse.verify.cases_linear_log_probs import check_log_probs, run_log_probs
from truefuse.verify.registry import all_cases


def _assert(reports):
    for k, rep in reports.items():
        assert rep.passed, f"{k}: error {rep.error:.3e} vs baseline {rep.baseline_error:.3e}"


def test_registered_cases(device):
    """Every registered case on the GPU; on the CPU (the Triton interpreter is slow) the ones no
    other test here covers: all options at once, main_grad, delayed against immediate."""
    cases = all_cases(["linear_log_probs"], device.type)
    assert len(cases) == 18
    for c in cases:
        if device.type == "cuda" or c.name.startswith(("everything", "fused", "delayed")):
            _assert(c.fn(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_size", [None, 7])
@pytest.mark.parametrize("ignore", ["some", "none", "all"])
def test_options_against_reference(dtype, chunk_size, ignore, device):
    # 2 x 11 tokens: chunk_size=7 still runs three whole chunks and a 1-token tail
    x, W, t, b = make_inputs(dtype, device, N=11, ignore=ignore, bias=True, lead=(2,))
    _assert(check_log_probs(x, W, t, b, chunk_size=chunk_size, temperature=0.8, softcap=6.0))


def test_fp64_is_the_reference():
    """fp64 runs the same math in PyTorch: equal to the reference to fp64 rounding, gradients too."""
    x, W, t, b = make_inputs(torch.float64, torch.device("cpu"), bias=True)
    up = (torch.randn(t.shape, dtype=torch.float64), torch.randn(t.shape, dtype=torch.float64))
    kw = {"temperature": 0.6, "softcap": 5.0}
    got = run_log_probs(truefuse.linear_log_probs, x, W, t, b, upstream=up, chunk_size=8, **kw)
    ref = run_log_probs(linear_log_probs_ref, x, W, t, b, upstream=up, **kw)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12, msg=k)


def test_ignored_tokens_give_zero_and_no_gradient(device):
    x, W, t, _ = make_inputs(torch.float32, device)
    x.requires_grad_()
    out = truefuse.linear_log_probs(x, W, t, chunk_size=16)
    ignored = t == -100
    assert ignored.any() and (~ignored).any()
    assert (out.log_probs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
    assert (out.log_probs[~ignored] < 0).all() and (out.entropy[~ignored] > 0).all()
    # an inf / NaN upstream on an ignored token is never read
    a = torch.where(ignored, torch.nan, 1.0)
    (out.log_probs * a.nan_to_num(0.0) + out.entropy).sum().backward()
    assert (x.grad[ignored] == 0).all() and x.grad[~ignored].abs().sum() > 0


def test_entropy_is_log_v_for_uniform_logits(device):
    """Equal logits: log-prob −log V and entropy log V, whatever the shift (no cancellation
    against a large common value)."""
    V, H = 203, 8
    x = torch.zeros(3, H, device=device)
    W = torch.zeros(V, H, device=device)
    b = torch.full((V,), 1000.0, device=device)
    out = truefuse.linear_log_probs(x, W, torch.tensor([0, 5, 202], device=device), linear_bias=b)
    logv = torch.log(torch.tensor(float(V)))
    torch.testing.assert_close(out.log_probs.cpu(), -logv.expand(3), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.entropy.cpu(), logv.expand(3), rtol=1e-6, atol=0)


def test_non_finite_rows_follow_the_reference(device):
    """NaN where the reference's expressions give NaN (a NaN or +inf hidden state), finite
    elsewhere (a -inf logit: 0·log 0 = 0 in the entropy), kernel and PyTorch paths alike."""
    x, W, t, _ = make_inputs(torch.float32, device, N=8, ignore="none")
    x[1, 0] = torch.nan
    W[5] = 0.0
    x[2] = 0.0
    b = torch.zeros(W.shape[0], device=device)
    b[5] = -torch.inf  # a -inf logit on every row
    got = truefuse.linear_log_probs(x, W, t, linear_bias=b)
    ref = linear_log_probs_ref(x.double().cpu(), W.double().cpu(), t.cpu(), linear_bias=b.double().cpu())
    for name in ("log_probs", "entropy"):
        g, r = getattr(got, name).cpu(), getattr(ref, name)
        assert torch.equal(g.isnan(), r.isnan()), (name, g, r)
        torch.testing.assert_close(g[~r.isnan()].double(), r[~r.isnan()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_masked_logits_give_finite_gradients(dtype, softcap, device):
    """A −inf bias (banned tokens), on the kernel (fp32) and the PyTorch path (fp64): with the
    log-probs' upstream alone and with both, every gradient finite and the reference's (0 in
    the masked bias), at a temperature, with and without a softcap."""
    x, W, t, b = make_inputs(dtype, device, N=8, bias=True)
    b[1::3] = -torch.inf
    t = torch.where((t >= 0) & (t % 3 == 1), t - 1, t)
    for up in (
        (torch.ones(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)),
        (torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3,) * 2,
    ):
        kw = {"temperature": 0.7, "softcap": softcap, "upstream": up}
        got = run_log_probs(truefuse.linear_log_probs, x, W, t, b, **kw)
        ref = run_log_probs(linear_log_probs_ref, x.double().cpu(), W.double().cpu(), t.cpu(), b.double().cpu(), **kw)
        for k in ref:
            assert got[k].isfinite().all(), k
            torch.testing.assert_close(got[k].cpu().double(), ref[k], rtol=1e-4, atol=1e-5, msg=k)
        assert (got["dlinear_bias"][1::3] == 0).all()


@pytest.mark.parametrize("config", ["plain", "fused", "delayed", "delayed_fused"])
def test_main_grad_over_four_micro_batches(config, device):
    """d_weight accumulated over four micro-batches (into main_grad, or .grad) against the float64
    sum of the four reference gradients, bounded by the plain path's summed error."""
    fused, delayed = "fused" in config, "delayed" in config
    W = make_inputs(torch.float32, device, N=12)[1]
    Wl = W.clone().requires_grad_()
    if fused:
        Wl.main_grad = torch.zeros(W.shape, device=device)
    state = truefuse.autograd.linear_log_probs.WgradState(fuse_wgrad_accumulation=fused, delay_wgrad_compute=delayed)
    ref = torch.zeros(W.shape, dtype=torch.float64)
    base = torch.zeros(W.shape, device=device)
    for seed in range(4):
        x, _, t, _ = make_inputs(torch.float32, device, N=12, seed=seed + 1)
        up = (torch.randn(t.shape, dtype=torch.float64), torch.randn(t.shape, dtype=torch.float64))
        out = truefuse.linear_log_probs(x, Wl, t, chunk_size=5, wgrad_state=state)
        (out.log_probs * up[0].to(device).float() + out.entropy * up[1].to(device).float()).sum().backward()
        ref += run_log_probs(linear_log_probs_ref, x.double().cpu(), W.double().cpu(), t.cpu(), upstream=up)["dlinear_weight"]
        base += run_log_probs(truefuse.ops.lm_head.linear_log_probs.linear_log_probs_plain, x, W, t, upstream=up)[
            "dlinear_weight"
        ]
    if delayed:
        assert (Wl.main_grad if fused else Wl.grad) is None or not (Wl.main_grad if fused else Wl.grad).any()
        with torch.no_grad():
            truefuse.autograd._wgrad.run_pending(state)
    got = Wl.main_grad if fused else Wl.grad
    assert bounded_report(got, ref, base).passed


def test_retain_graph_adds_each_backward(device):
    x, W, t, _ = make_inputs(torch.float32, device)
    Wl = W.clone().requires_grad_()
    out = truefuse.linear_log_probs(x, Wl, t, chunk_size=16)
    loss = (out.log_probs + 0.5 * out.entropy).sum()
    loss.backward(retain_graph=True)
    once = Wl.grad.clone()
    loss.backward()
    torch.testing.assert_close(Wl.grad, 2 * once, rtol=0, atol=0)


def test_bad_input_names_the_argument(device):
    x, W, t, _ = make_inputs(torch.float32, device)
    with pytest.raises(ValueError, match="temperature"):
        truefuse.linear_log_probs(x, W, t, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        truefuse.linear_log_probs(x, W, t, temperature=float("nan"))
    with pytest.raises(ValueError, match="softcap"):
        truefuse.linear_log_probs(x, W, t, softcap=-1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        truefuse.linear_log_probs(x, W, t, chunk_size=0)
    with pytest.raises(TypeError, match="linear_weight"):
        truefuse.linear_log_probs(x, W.double(), t)
    bad = t.clone()
    bad[3] = W.shape[0]
    with pytest.raises(ValueError, match=f"target holds {W.shape[0]}"):
        truefuse.linear_log_probs(x, W, bad)


class _SumOfLogits:
    """A toy per-chunk loss, Σ logits · w per token: the head must serve any loss, not only the
    cross-entropy (its d_logits are w, whatever the logits)."""

    def __init__(self, w, N):
        self.w, self.out, self.finished = w, torch.empty(N, dtype=torch.float64), 0

    def chunk(self, rows, logits, bias, want_grad):
        z = logits[:, : self.w.shape[0]].double() + (0 if bias is None else bias.double())
        self.out[rows] = z @ self.w
        return self.w.to(logits.dtype).expand(logits.shape[0], -1).clone() if want_grad else None

    def finish(self):
        self.finished += 1


@pytest.mark.parametrize("chunk", [5, 64])
def test_chunked_head_runs_any_loss(chunk):
    """head_chunks with a toy loss against autograd through the materialized logits (fp64):
    per-token outputs, d_input, d_weight and d_bias; the loss's finish runs once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 6, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, generator=g, dtype=torch.float64)
    loss = _SumOfLogits(w, 23)
    grads = head_chunks(loss, x.detach(), W.detach(), b.detach(), chunk=chunk, want=(True, True, True))
    ref = torch.nn.functional.linear(x, W, b) @ w
    ref.sum().backward()
    assert loss.finished == 1
    torch.testing.assert_close(loss.out, ref.detach())
    for got, want in ((grads.dx, x.grad), (grads.dW, W.grad), (grads.db, b.grad)):
        torch.testing.assert_close(got.double(), want)


def test_log_prob_chunks_kernel_matches_torch_math(device):
    """The Triton kernel against the same math in PyTorch on one chunk, gradients included."""
    x, W, t, b = make_inputs(torch.float32, device, N=9, bias=True)
    if not triton_runs(x):
        pytest.skip("the Triton kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    z = torch.nn.functional.linear(x, W)
    a, c = torch.randn(9, device=device), torch.randn(9, device=device)
    opts = LinearLogProbsOptions(temperature=0.9, softcap=4.0)
    out = []
    for kernel in (True, False):
        loss = LogProbChunks(opts, W.shape[0], t, a, c, like=x)
        loss.kernel = kernel
        d = loss.chunk(slice(0, 9), z.clone(), b, True)
        out.append((loss.log_probs, loss.entropy, d))
    for got, want in zip(*out, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", ["plain", "delayed_fused"])
def test_one_chunk_keeps_its_logits(config, monkeypatch, device):
    """With one chunk the backward reuses the forward's logits (no second logits GEMM), delayed and
    fused included; a second backward (retain_graph) recomputes them and gives the same bits."""
    import truefuse.ops.lm_head.chunked_head as head_mod

    calls = []
    real = head_mod.logits_gemm
    monkeypatch.setattr(head_mod, "logits_gemm", lambda *a: calls.append(1) or real(*a))
    x, W, t, b = make_inputs(torch.float32, device, N=12, bias=True)
    xl, Wl, bl = x.clone().requires_grad_(), W.clone().requires_grad_(), b.clone().requires_grad_()
    state = None
    if config == "delayed_fused":
        state = truefuse.autograd.linear_log_probs.WgradState(fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    grads = []
    Wl.main_grad = torch.zeros(W.shape, device=device)
    out = truefuse.linear_log_probs(xl, Wl, t, linear_bias=bl, wgrad_state=state)
    assert len(calls) == 1
    loss = (out.log_probs * torch.linspace(-1, 1, 12, device=device) + 0.3 * out.entropy).sum()
    # a recompute under delay runs the chunks twice: d_input now, the weight's pass in backward_dw()
    for n_gemms in (1, 2) if state is None else (1, 3):
        Wl.main_grad = torch.zeros(W.shape, device=device)  # a fresh one: the first is compared
        loss.backward(retain_graph=True)
        if state is not None:
            with torch.no_grad():  # as backward_dw() runs it
                truefuse.autograd._wgrad.run_pending(state)
        assert len(calls) == n_gemms  # the kept logits first, then a recompute
        grads.append((xl.grad, bl.grad, Wl.main_grad if state else Wl.grad))
        xl.grad = bl.grad = Wl.grad = None
    for a, b_ in zip(*grads, strict=True):
        assert torch.equal(a, b_)
