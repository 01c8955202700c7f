"""Batch-invariant mode (docs/design.md §1, "Batch invariance"; issue 34): under
``truefuse.batch_invariant()`` each row's result is bitwise the same whether it runs alone, in a
slice of the batch or in the whole call; the weight gradients are the same bits run to run.

On the CPU: the planner's row-block GEMM (fp32 and bf16), the Triton GEMM's fixed configuration in
fp32 under the interpreter (row prefixes: the interpreter's tl.dot is NumPy's, whose rows change
bits with their place in a tile, so only M is varied there), the Linear family, the norms, rope,
the gated activation, and the Hugging Face integration on tiny models. bf16 on the GPU:
``truefuse/bench/bench_bi_gemm.py``.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import truefuse
from truefuse.ops.gemm import gemm, gemm_plan_for
from truefuse.ops.gemm_plan import Capability, override_capabilities

ROOT = Path(__file__).resolve().parents[1]
F32, BF16 = torch.float32, torch.bfloat16


def _t(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _rows_invariant(fn, x, slices):
    """``fn`` on each slice of ``x``'s rows equals the same rows of ``fn(x)``, bit for bit."""
    full = fn(x)
    for sl in slices:
        got = fn(x[sl])
        assert torch.equal(got, full[sl]), f"rows {sl} differ from the whole call"
    return full


# ---------------------------------------------------------------------------------------------
# the switch


def test_switch_nests_restores_and_checks():
    assert not truefuse.is_batch_invariant()
    with truefuse.batch_invariant():
        assert truefuse.is_batch_invariant()
        with truefuse.batch_invariant(False):
            assert not truefuse.is_batch_invariant()
        assert truefuse.is_batch_invariant()
        with pytest.raises(RuntimeError), truefuse.batch_invariant(False):
            raise RuntimeError("boom")
        assert truefuse.is_batch_invariant()  # restored after the exception
    assert not truefuse.is_batch_invariant()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with truefuse.batch_invariant(1):
            pass


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False)])
def test_switch_from_environment(value, expected):
    # config.py imports the standard library only: run it alone, no torch import (fast)
    code = f"import runpy; print(runpy.run_path({str(ROOT / 'truefuse' / 'config.py')!r})['is_batch_invariant']())"
    env = {"TRUEFUSE_BATCH_INVARIANT": value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(expected)
    assert runpy  # the same loader in-process would re-create the module's classes


# ---------------------------------------------------------------------------------------------
# the GEMM


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gemm_rows_independent_of_m(dtype):
    """The planner's batch-invariant GEMM on the CPU (row blocks): forward (with bias) and the
    input-gradient form, rows for M = 1, 3, 64 and slices anywhere in the batch."""
    x, w, b = _t((100, 48), dtype, 1), _t((40, 48), dtype, 2), _t((40,), dtype, 3)
    slices = [slice(0, 1), slice(0, 3), slice(0, 64), slice(5, 6), slice(7, 27), slice(33, 100)]
    with truefuse.batch_invariant():
        p = gemm_plan_for(x, w.t())
        assert "batch_invariant" in p.split + p.fused, str(p)
        _rows_invariant(lambda t: gemm(t, w.t(), bias=b), x, slices)
        _rows_invariant(lambda t: gemm(t, w), _t((100, 40), dtype, 4), slices)  # dx = dy @ W
        # the explicit argument wins over the switch
        assert "batch_invariant" not in str(gemm_plan_for(x, w.t(), batch_invariant=False))
    assert "batch_invariant" in str(gemm_plan_for(x, w.t(), batch_invariant=True))


def test_plain_cpu_gemm_is_not_row_invariant():
    """Why the mode exists on the CPU: the BLAS picks another kernel for small M (fp32 rows of an
    M = 1 call differ from the same rows in a larger call; measured on the dev machine's MKL)."""
    x, w = _t((100, 48), F32, 1), _t((40, 48), F32, 2)
    full = gemm(x, w.t(), batch_invariant=False)
    assert any(not torch.equal(gemm(x[:m], w.t(), batch_invariant=False), full[:m]) for m in (1, 2, 3))


def test_gemm_bad_batch_invariant_argument():
    with pytest.raises(TypeError, match="batch_invariant must be None"):
        gemm(torch.ones(2, 2), torch.ones(2, 2), batch_invariant=1)


def test_triton_gemm_fixed_configuration_interpreter():
    """The Triton GEMM with batch-invariant mode's one configuration, fp32 in the interpreter:
    rows of M = 1, 3, 64 equal the same rows of M = 70 (tails in every tile dimension)."""
    from truefuse.ops.gemm_plan import backend_available

    if not backend_available("triton", "cpu"):
        pytest.skip("the Triton interpreter is off")
    x, w = _t((70, 40), F32, 5), _t((37, 40), F32, 6)
    row = Capability("batch_invariant", F32, F32, "cpu", backend="triton")
    with override_capabilities(backends=["triton"], add=[row]), truefuse.batch_invariant():
        assert str(gemm_plan_for(x, w.t())) == "triton[float32]: fused mm+batch_invariant"
        _rows_invariant(lambda t: gemm(t, w.t()), x, [slice(0, 1), slice(0, 3), slice(0, 64)])


# ---------------------------------------------------------------------------------------------
# the Linear family: forward and input gradient per row, the mode kept for the backward


@pytest.fixture
def torch_paths(monkeypatch):
    """The norm and activation kernels on their PyTorch paths (the interpreter off): the kernels'
    own row invariance is tested op by op (tests/test_norm.py); here it is the layers' wiring."""
    import dataclasses

    import truefuse.ops._triton as tr

    real = tr.get_config
    monkeypatch.setattr(tr, "get_config", lambda: dataclasses.replace(real(), triton_interpret=False))


def _fwd_bwd(module, x, dy):
    x = x.detach().requires_grad_()
    with truefuse.batch_invariant():
        y = module(x)
    # the backward after the block: it must take the forward's (batch-invariant) path
    (dx,) = torch.autograd.grad(y, x, dy)
    return y.detach(), dx


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_linear_family_rows(kind, torch_paths):
    torch.manual_seed(0)
    if kind == "Linear":
        m = truefuse.Linear(48, 40)
    else:
        m = truefuse.LayerNormMLP(48, 64, normalization="RMSNorm", activation="swiglu")
    x, dy = _t((70, 48), F32, 7), _t((70, m(torch.zeros(1, 48)).shape[-1]), F32, 8)
    y, dx = _fwd_bwd(m, x, dy)
    for sl in (slice(0, 1), slice(0, 3), slice(9, 12), slice(0, 64)):
        ys, dxs = _fwd_bwd(m, x[sl], dy[sl])
        assert torch.equal(ys, y[sl]) and torch.equal(dxs, dx[sl]), f"{kind} rows {sl}"
