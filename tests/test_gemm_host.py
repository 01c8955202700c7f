"""``truefuse.gemm``'s host-side shortcuts (docs/benchmarks.md, "Batch-invariant mode"): the plain
call's path (``ops/gemm/gemm_checks.py::validate``) and the planner's cache give what the general path gives,
and step aside wherever the general path has something to check or to say."""

import pytest
import torch

import truefuse
from truefuse.ops.gemm import gemm as G
from truefuse.ops.gemm import gemm_plan
from truefuse.ops.gemm.gemm_checks import validate
from truefuse.ops.gemm.gemm_plan import Capability, override_capabilities

F32, BF16 = torch.float32, torch.bfloat16


def _t(shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _general(a, b, **kw):
    checks = {k: v for k, v in kw.items() if k != "batch_invariant"}  # the entries resolve the mode
    return G._gemm(a, b, validate(a, b, **checks), per_group=False, **kw)  # the general path, checked as they check


CASES = [
    ("plain", {}),
    ("bias", {"bias": _t((24,), seed=3)}),
    ("out_dtype", {"out_dtype": F32}),
    ("bi", {"batch_invariant": True}),
    ("bi bias", {"batch_invariant": True, "bias": _t((24,), seed=3)}),
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_plain_path_is_taken_and_equals_the_general_path(dtype, name, kw, monkeypatch):
    a, w = _t((37, 40), dtype, 1), _t((24, 40), dtype, 2)
    kw = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    want = _general(a, w.t(), **kw)
    monkeypatch.setattr(G, "_gemm", lambda *a, **k: pytest.fail("the plain call took the general path"))
    got = truefuse.gemm(a, w.t(), **kw)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("accumulate", [False, True])
def test_plain_path_into_out(accumulate, monkeypatch):
    dy, x = _t((50, 24), seed=4), _t((50, 40), seed=5)
    start = _t((24, 40), seed=6)
    want = _general(dy.t(), x, out=start.clone(), accumulate=accumulate)
    monkeypatch.setattr(G, "_gemm", lambda *a, **k: pytest.fail("the plain call took the general path"))
    got = truefuse.gemm(dy.t(), x, out=start.clone(), accumulate=accumulate)
    assert torch.equal(got, want)


def test_plain_path_steps_aside_for_the_general_checks():
    """Bad arguments still get the general path's errors, naming the argument."""
    a, w = _t((8, 16)), _t((12, 16))
    with pytest.raises(ValueError, match="a has 16 columns but b has 12 rows"):
        truefuse.gemm(a, w)
    with pytest.raises(TypeError, match="same dtype"):
        truefuse.gemm(a, w.t().to(BF16))
    with pytest.raises(ValueError, match="bias has shape"):
        truefuse.gemm(a, w.t(), bias=_t((5,)))
    with pytest.raises(ValueError, match="out shares memory with a"):
        truefuse.gemm(a, w.t(), out=a.view(-1)[:96].view(8, 12))  # contiguous, a's storage
    with pytest.raises(ValueError, match="accumulate=True adds into an existing output"):
        truefuse.gemm(a, w.t(), accumulate=True)
    with pytest.raises(TypeError, match="batch_invariant must be None"):
        truefuse.gemm(a, w.t(), batch_invariant=1)
    with pytest.raises(TypeError, match="requires grad"):
        truefuse.gemm(a.requires_grad_(), w.t())
    # a padded-rows out is the general path's (it checks the bias rule there): same result
    buf = torch.zeros(8, 20)
    truefuse.gemm(a.detach(), w.t(), out=buf[:, :12])
    assert torch.equal(buf[:, :12], a.detach() @ w.t()) and not buf[:, 12:].any()


def test_plan_cache_follows_overrides_and_backends():
    """A kept plan is reused only under the same overrides: removing the capability that fused a
    feature splits it inside the block and fuses it again after."""
    req = gemm_plan.GemmRequest(device="cpu", in_dtype=F32, out_dtype=F32, bias=True)
    before = gemm_plan.plan(req)
    assert gemm_plan.plan(req) is before and "bias" in before.fused
    with override_capabilities(remove=[Capability("bias")]):
        inside = gemm_plan.plan(req)
        assert "bias" in inside.split
    assert gemm_plan.plan(req) == before
    with override_capabilities(backends=["torch"]):
        assert gemm_plan.plan(req).backend == "torch"
