"""docs/design.md §2, the weight-gradient contract: every module × the six configurations, the same assertions.

After backward, and again after backward_dw where delayed, it checks what ``param.grad`` holds (the
gradient, None or zeros), what ``main_grad`` holds (its random start plus the gradient, untouched
before backward_dw, or the gradient alone under ``overwrite_main_grad``), what a post-accumulate-grad
hook on each weight sees, and that ``register_wgrad_hook`` fires once per weight.
"""

import pytest
import torch

from truefuse.testing import assert_bitwise, assert_bounded
from truefuse.verify.cases_linear import MODULES, attach_main_grads, build, inputs_for, run_module, to_float64

DTYPE = torch.bfloat16

# name: (fuse_wgrad_accumulation, delay_wgrad_compute, grad_added_to_main_grad attribute present)
CONFIGS = {
    "plain": (False, False, False),
    "delayed": (False, True, False),
    "fused": (True, False, False),
    "fused_attr": (True, False, True),
    "delayed_fused": (True, True, False),
    "delayed_fused_attr": (True, True, True),
}


def _returns(fused: bool, delayed: bool, attr: bool) -> str:
    """What the table says backward returns to autograd: 'grad', 'none' or 'zeros'."""
    if not fused:
        return "none" if delayed else "grad"
    return "zeros" if attr else "none"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(MODULES))
def test_contract_table(name, config, device):
    fused, delayed, attr = CONFIGS[config]
    m = build(name, DTYPE, device, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delayed)
    plain = build(name, DTYPE, device)  # same parameters, plain configuration: the expected gradients
    weights = dict(m.gemm_weights())
    others = {n: p for n, p in m.named_parameters() if n not in weights}
    start = attach_main_grads(m, attr=attr) if fused else {}
    other_mg = {}
    if fused:  # biases and norm weights may carry a main_grad too: it must never be touched
        for n, p in others.items():
            p.main_grad = torch.full(p.shape, 7.0, device=p.device)
            other_mg[n] = p.main_grad.clone()
    seen = {n: [] for n in weights}
    for n, p in weights.items():
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen[n].append(p.grad is not None))
    fired = {n: 0 for n in weights}
    ids = {id(p): n for n, p in weights.items()}

    def on_wgrad(p):
        fired[ids[id(p)]] += 1

    handle = m.register_wgrad_hook(on_wgrad)

    x, dy = inputs_for(m, DTYPE, device)
    got = run_module(m, x, dy)
    want = run_module(plain, x, dy)
    ref = run_module(to_float64(m), x.cpu().double(), dy.cpu().double(), ref=True)
    returns = _returns(fused, delayed, attr)

    for k in ("out", "dx", *(f"d{n}" for n in others)):  # everything but GEMM weights: always as plain
        assert_bitwise(got[k], want[k], k)
    for n, p in others.items():
        if fused:
            assert_bitwise(p.main_grad, other_mg[n], f"{n}.main_grad")

    def check_main_grad(n, p):
        if getattr(p, "overwrite_main_grad", False):
            expect64, base = ref[f"d{n}"], want[f"d{n}"].float()
        else:
            expect64, base = start[n].cpu().double() + ref[f"d{n}"], start[n] + want[f"d{n}"].float()
        assert_bounded(p.main_grad, expect64, base, f"{n}.main_grad")

    for n, p in weights.items():
        # the post-accumulate-grad hook fires once; it finds .grad exactly where a tensor was returned
        assert seen[n] == [returns != "none"], (n, seen[n])
        if returns == "grad":
            assert_bitwise(p.grad, want[f"d{n}"], f"{n}.grad")
        elif returns == "zeros":
            assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.shape == p.shape and not p.grad.any()
            assert p.grad_added_to_main_grad is (not delayed)
        else:
            assert p.grad is None, n
        if fused and delayed:
            assert_bitwise(p.main_grad, start[n], f"{n}.main_grad before backward_dw")
        elif fused:
            check_main_grad(n, p)
        assert fired[n] == (0 if delayed else 1), (n, fired)

    m.backward_dw()
    for n, p in weights.items():
        assert fired[n] == 1, (n, fired)
        if delayed and not fused:
            assert_bitwise(p.grad, want[f"d{n}"], f"{n}.grad after backward_dw")
        if fused:
            check_main_grad(n, p)
            if attr:
                assert p.grad_added_to_main_grad is True
    handle.remove()
    m.backward_dw()  # nothing pending: a no-op
    assert all(v == 1 for v in fired.values())


@pytest.mark.parametrize("name", list(MODULES))
def test_overwrite_main_grad(name, device):
    for delayed in (False, True):
        m = build(name, DTYPE, device, fuse_wgrad_accumulation=True, delay_wgrad_compute=delayed)
        attach_main_grads(m)
        for _, p in m.gemm_weights():
            p.overwrite_main_grad = True
        x, dy = inputs_for(m, DTYPE, device)
        run_module(m, x, dy)
        m.backward_dw()
        want = run_module(build(name, DTYPE, device), x, dy)
        ref = run_module(to_float64(m), x.cpu().double(), dy.cpu().double(), ref=True)
        for n, p in m.gemm_weights():
            assert_bounded(p.main_grad, ref[f"d{n}"], want[f"d{n}"].float(), f"{n}.main_grad")


@pytest.mark.parametrize("name", list(MODULES))
def test_four_micro_batches_into_main_grad(name, device):
    """Four backward passes accumulate into main_grad: the sum of four plain gradients, within the
    contract (no less accurate than bf16 gradients added in fp32)."""
    m = build(name, DTYPE, device, fuse_wgrad_accumulation=True)
    plain = build(name, DTYPE, device)
    start = attach_main_grads(m)
    total64 = {n: s.cpu().double() for n, s in start.items()}
    base = {n: s.clone() for n, s in start.items()}
    for mb in range(4):
        x, dy = inputs_for(m, DTYPE, device, seed=10 + mb)
        run_module(m, x, dy)
        plain.zero_grad(set_to_none=True)
        want = run_module(plain, x, dy)
        ref = run_module(to_float64(m), x.cpu().double(), dy.cpu().double(), ref=True)
        for n in start:
            total64[n] += ref[f"d{n}"]
            base[n] += want[f"d{n}"].float()
    for n, p in m.gemm_weights():
        assert_bounded(p.main_grad, total64[n], base[n], f"{n}.main_grad after 4 micro-batches")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_tied_weight_sums_both_contributions(config, device):
    """One weight shared by two Linear modules gets both contributions in every configuration."""
    from truefuse import Linear

    fused, delayed, attr = CONFIGS[config]
    kw = {"fuse_wgrad_accumulation": fused, "delay_wgrad_compute": delayed}
    torch.manual_seed(0)
    a = Linear(48, 48, device=device, dtype=DTYPE, **kw)
    b = Linear(48, 48, device=device, dtype=DTYPE, **kw)
    b.weight = a.weight
    w = a.weight
    if fused:
        w.main_grad = torch.randn(w.shape, device=device)
        if attr:
            w.grad_added_to_main_grad = False
    start = w.main_grad.clone() if fused else None
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 48, generator=g).to(device, DTYPE)
    dy = torch.randn(37, 48, generator=g).to(device, DTYPE)
    b(a(x)).backward(dy)
    a.backward_dw()
    b.backward_dw()

    w64 = w.detach().cpu().double().requires_grad_()
    ba, bb = a.bias.detach().cpu().double(), b.bias.detach().cpu().double()
    x64 = x.cpu().double()
    torch.nn.functional.linear(torch.nn.functional.linear(x64, w64, ba), w64, bb).backward(dy.cpu().double())
    wb = w.detach().clone().requires_grad_()
    torch.nn.functional.linear(torch.nn.functional.linear(x, wb, a.bias.detach()), wb, b.bias.detach()).backward(dy)
    if fused:
        assert_bounded(w.main_grad, start.cpu().double() + w64.grad, start + wb.grad.float(), "tied main_grad")
    else:
        assert_bounded(w.grad, w64.grad, wb.grad, "tied grad")


# --- the delayed queue: its length, and a warning when backward_dw() is forgotten -----------------


def _small_delayed(kind: str, **kw):
    """(module, one forward + backward) of a small module with delay_wgrad_compute=True."""
    import truefuse

    torch.manual_seed(0)
    if kind == "Linear":
        m = truefuse.Linear(8, 6, delay_wgrad_compute=True, **kw)
        return m, lambda: m(torch.randn(3, 8)).sum().backward()
    if kind == "GroupedMLP/per_group":  # several weights: one pending step per backward, not per weight
        m = truefuse.GroupedMLP(3, 8, 6, delay_wgrad_compute=True, **kw)
        return m, lambda: m(torch.randn(5, 8), [2, 0, 3]).sum().backward()
    if kind == "LinearCrossEntropyLoss":
        m = truefuse.LinearCrossEntropyLoss(delay_wgrad_compute=True, **kw)
        W = torch.nn.Parameter(torch.randn(16, 8))
        return m, lambda: m(torch.randn(4, 8), W, torch.randint(0, 16, (4,))).backward()
    raise AssertionError(kind)


def _steps(step, n):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            step()
    return [w for w in caught if "backward_dw()" in str(w.message)]


@pytest.mark.parametrize("kind", ["Linear", "GroupedMLP/per_group", "LinearCrossEntropyLoss"])
def test_pending_wgrad_counts_and_warns_once_past_the_bound(kind):
    m, step = _small_delayed(kind)
    assert m.pending_wgrad == 0 and m.max_pending_wgrad == 16
    m.max_pending_wgrad = 2
    assert _steps(step, 2) == [] and m.pending_wgrad == 2
    warned = _steps(step, 3)  # 3, 4, 5 pending: one warning, when the count first passes 2
    assert m.pending_wgrad == 5
    assert len(warned) == 1 and warned[0].category is UserWarning
    text = str(warned[0].message)
    assert text.startswith(f"{type(m).__name__}: 3 backward passes") and "max_pending_wgrad=2" in text
    m.backward_dw()
    assert m.pending_wgrad == 0
    assert _steps(step, 2) == [] and m.pending_wgrad == 2  # re-armed by backward_dw, quiet up to the bound
    assert len(_steps(step, 1)) == 1
    m.backward_dw()


@pytest.mark.parametrize("kind", ["Linear", "LinearCrossEntropyLoss"])
def test_pending_wgrad_warning_disabled_by_none(kind):
    m, step = _small_delayed(kind, **({"max_pending_wgrad": None} if kind == "LinearCrossEntropyLoss" else {}))
    if kind == "Linear":
        m.max_pending_wgrad = None
    assert _steps(step, 20) == [] and m.pending_wgrad == 20
    m.backward_dw()
    assert m.pending_wgrad == 0


def test_pending_wgrad_zero_without_delay_and_bound_validated():
    import truefuse

    m = truefuse.Linear(8, 6)
    m(torch.randn(3, 8)).sum().backward()
    assert m.pending_wgrad == 0
    g = truefuse.GroupedLinear(2, 8, 6, delay_wgrad_compute=True, max_pending_wgrad=0)
    assert len(_steps(lambda: g(torch.randn(4, 8), [1, 3]).sum().backward(), 1)) == 1
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_pending_wgrad must be None .* or an int >= 0"):
            m.max_pending_wgrad = bad
    with pytest.raises(ValueError, match="max_pending_wgrad"):
        truefuse.LinearCrossEntropyLoss(max_pending_wgrad=-3)
