"""The persistent TMA batch-invariant GEMM (``kernels/gemm_tma.py``), the last M bucket's kernel on
Hopper: the plain kernel's bits (its reference tile, and the decode tile on a row slice), both B
layouts. On the CPU its logic under the interpreter in fp32 against the plain kernel; on an H100 in
bf16 through ``bi_launch``, which must take it."""

from __future__ import annotations

import pytest
import torch

from truefuse.ops._launch.triton import hopper
from truefuse.ops.gemm.gemm_backends import triton as T


def _operands(M, K, N, layout, dtype, device):
    g = torch.Generator().manual_seed(M + K + N)
    w = (torch.randn(N, K, generator=g) * 0.05).to(device, dtype)
    a = torch.randn(M, K if layout == "nt" else N, generator=g).to(device, dtype)
    return a, w, (w.t() if layout == "nt" else w)


@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_tma_kernel_same_bits_as_the_plain_kernel_interpreted(layout):
    from truefuse.config import get_config

    if not get_config().triton_interpret:
        pytest.skip("the Triton interpreter is off")
    from truefuse.kernels.gemm_tma import _gemm_tma_kernel

    a, w, b = _operands(70, 96, 80, layout, torch.float32, "cpu")
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty(M, N)
    with T._tma_scratch("cpu"):
        _gemm_tma_kernel[(3,)](
            a, w, out, M, N, K, K, w.shape[1], N, B_NK=layout == "nt", BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, IEEE=True
        )
    # the same tile: the interpreter's dot of another block shape rounds otherwise (numpy's BLAS).
    # On some CPUs numpy's BLAS also rounds a transposed block otherwise than a contiguous one (the
    # "nt" case here: the TMA kernel transposes w's tile, the plain kernel loads w.t()'s), so the
    # interpreter checks the tiles' logic to fp32's rounding; the bits are the GPU test's below
    want = T.run_tiles(a, b, (32, 32, 4, 3))
    torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6)
    if layout == "nn":
        assert torch.equal(out, want)
    # accumulated (C += A·B, one rounding of the fp32 sum): the plain kernel's epilogue
    c = torch.randn(M, N, generator=torch.Generator().manual_seed(3))
    acc = c.clone()
    with T._tma_scratch("cpu"):
        _gemm_tma_kernel[(3,)](
            a, w, acc, M, N, K, K, w.shape[1], N, B_NK=layout == "nt", BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, IEEE=True,
            ACCUMULATE=True,
        )  # fmt: skip
    torch.testing.assert_close(acc, out + c, rtol=2e-6, atol=4e-6)
    if layout == "nn":
        assert torch.equal(acc, out + c)  # fp32: the epilogue's one addition


@pytest.mark.skipif(not torch.cuda.is_available() or not hopper(torch.empty(0, device="cuda")), reason="needs a Hopper GPU")
@pytest.mark.parametrize("layout", ["nt", "nn"])
@pytest.mark.parametrize("M", [300, 4100])
def test_bi_launch_takes_tma_same_bits_gpu(layout, M):
    a, w, b = _operands(M, 512, 768, layout, torch.bfloat16, "cuda")
    out = torch.empty(M, b.shape[1], device="cuda", dtype=torch.bfloat16)
    assert T._tma_fits(a, b, out, layout)
    T.bi_launch(a, b, out)
    assert torch.equal(out, T.run_tiles(a, b, (128, 128, 8, 4)))
    assert torch.equal(out[:16], T.run_tiles(a[:16], b, (16, 64, 4, 4)))
    # accumulated (the batch-invariant siblings' input gradient): the plain kernel's epilogue's bits
    c = torch.randn(M, b.shape[1], device="cuda").to(torch.bfloat16)
    tma, plain = c.clone(), c.clone()
    T.bi_launch(a, b, tma, accumulate=True)
    meta = T._bi_meta(a.dtype, M, layout, b.shape[1])
    from truefuse.kernels.activation import ACT_CODES
    from truefuse.kernels.gemm import _gemm_kernel

    T._launch(_gemm_kernel, T._bi_grid(M, b.shape[1], meta), a, b, plain, a, plain, True, ACT_CODES[None], False, meta)
    assert torch.equal(tma, plain)
    # a row slice off TMA's alignment takes the plain kernel: the same rows' bits
    part = torch.empty(M - 1, b.shape[1], device="cuda", dtype=torch.bfloat16)
    T.bi_launch(a[1:], b, part)
    assert torch.equal(part, out[1:])
