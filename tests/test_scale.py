"""scale_: bitwise ``mul_`` by a 0-dim fp32 device factor, and no write at all when the factor is 1
(Triton under the CPU interpreter for fp32; on the GPU in fp16 / bf16 too)."""

import pytest
import torch

from truefuse.ops.scale import scale_


def _dtypes(device):
    return [torch.float32] + ([torch.float16, torch.bfloat16] if device.type == "cuda" else [])


@pytest.mark.parametrize("n", [1, 63, 64, 1000, 4097])
@pytest.mark.parametrize("f", [1.0, 2.5, -0.375, 0.0])
def test_scale_matches_mul(device, n, f):
    for dtype in _dtypes(device):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device, dtype)
        x[0] = float("nan") if n > 1 else x[0]
        factor = torch.tensor(f, dtype=torch.float32, device=device)
        want = x.clone().mul_(factor)
        got = scale_(x, factor)
        assert got is x
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (dtype, f)
        assert torch.equal(torch.signbit(got), torch.signbit(want)), (dtype, f)


def test_factor_one_writes_nothing(device):
    """With a factor of 1 the kernel must not even rewrite the tensor: a signalling NaN, which any
    multiplication would quiet (0x7F800001 -> 0x7FC00001), keeps its bits."""
    x = torch.tensor([0.0, -0.0, 1.5, -2.0] * 50, device=device)
    x.view(torch.int32)[0::4] = 0x7F800001
    bits = x.view(torch.int32).clone()
    scale_(x, torch.tensor(1.0, device=device))
    assert torch.equal(x.view(torch.int32), bits)
