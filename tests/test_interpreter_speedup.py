"""tests/_interpreter_speedup.py's reduce along an axis gives Triton's own element-by-element fold's
bits (the kernels' tests rely on it wherever a combine function of its own runs on the CPU)."""

import pytest
import torch
import triton
import triton.language as tl

from truefuse.kernels.norm import _add2

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's reduce")


@triton.jit
def _pair(a0, b0, a1, b1):
    return a0 * 0.75 + a1, tl.maximum(b0, b1) - b1 * 0.5  # neither associative nor commutative: the order shows


@triton.jit
def _reduce_kernel(p_ptr, q_ptr, s_ptr, t_ptr, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr, SUM: tl.constexpr):
    idx = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    if SUM:  # LayerNorm backward's two sums (numpy's running sum in fp32)
        s, t = tl.reduce((tl.load(p_ptr + idx), tl.load(q_ptr + idx)), AXIS, _add2, keep_dims=True)
    else:
        s, t = tl.reduce((tl.load(p_ptr + idx), tl.load(q_ptr + idx)), AXIS, _pair, keep_dims=True)
    if AXIS == 1:
        out = tl.arange(0, R)[:, None]
    else:
        out = tl.arange(0, C)[None, :]
    tl.store(s_ptr + out, s)
    tl.store(t_ptr + out, t)


def _run(p, q, axis, add2):
    s = torch.empty(p.shape[1 - axis], dtype=p.dtype)
    t = torch.empty_like(s)
    _reduce_kernel[(1,)](p, q, s, t, R=p.shape[0], C=p.shape[1], AXIS=axis, SUM=add2)
    return s, t


@pytest.mark.parametrize("add2", [False, True], ids=["pair", "add2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("axis", [0, 1])
def test_axis_reduce_is_the_element_fold(axis, dtype, add2, monkeypatch):
    import triton.runtime.interpreter as interp

    if not hasattr(interp.ReduceOps, "_truefuse_element_reduce"):
        pytest.skip("a Triton whose interpreter runs unpatched")
    g = torch.Generator().manual_seed(axis)
    p, q = (torch.randn(8, 16, generator=g).to(dtype) * 100 for _ in range(2))
    fast = _run(p, q, axis, add2)
    monkeypatch.setattr(interp.ReduceOps, "generic_reduce", interp.ReduceOps._truefuse_element_reduce)
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    for got, want in zip(fast, _run(p, q, axis, add2), strict=True):
        assert torch.equal(got.view(bits), want.view(bits))
