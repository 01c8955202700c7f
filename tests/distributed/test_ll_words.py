"""The LL word format of the allreduce kernel (kernels/allreduce.py): each int64 word carries 32
data bits (two 16-bit or one 32-bit element, little-endian, as the row's memory holds them) and the
call's flag in its high half; reading them back (once the flag is there) gives the row bit for
bit. Runs in Triton's interpreter on the CPU (bit moves only: right there for fp16 too) and on the
GPU in bf16 as well."""

import pytest
import torch
import triton
import triton.language as tl

from truefuse.kernels.allreduce import _ll_pack, _ll_unpack, _ll_wait_words


@triton.jit
def _roundtrip(x_ptr, y_ptr, w_ptr, N, flag, BLOCK_N: tl.constexpr):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    EPW: tl.constexpr = 32 // DT.primitive_bitwidth
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    words = _ll_pack(tl.load(x_ptr + cols, mask=mask, other=0.0), EPW, BLOCK_N) | (flag.to(tl.int64) << 32)
    tl.store(w_ptr + tl.arange(0, BLOCK_N // EPW), words)
    tl.debug_barrier()
    idx = tl.arange(0, BLOCK_N // EPW)
    v = _ll_unpack(_ll_wait_words(w_ptr, idx, idx < (N + EPW - 1) // EPW, flag), DT, EPW, BLOCK_N)
    tl.store(y_ptr + cols, v, mask=mask)  # element i of v is element i of the row, whatever its layout


def _dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])


@pytest.mark.parametrize("n", [1, 7, 64, 1001])
def test_ll_words_roundtrip(device, n):
    for dtype in _dtypes(device):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device, dtype)
        x[0] = -0.0  # sign bits and the top bit of each half must survive
        block = max(16, triton.next_power_of_2(n))
        per_word = 4 // x.element_size()
        y = torch.empty_like(x)
        words = torch.empty(block // per_word, dtype=torch.int64, device=device)
        _roundtrip[(1,)](x, y, words, n, 12345, BLOCK_N=block)
        assert torch.equal(
            y.view(torch.int16 if per_word == 2 else torch.int32),
            x.view(y.dtype).view(torch.int16 if per_word == 2 else torch.int32),
        ), dtype
        assert torch.all((words >> 32) == 12345), dtype
        padded = torch.zeros(block, dtype=dtype, device=device)
        padded[:n] = x
        assert torch.equal(words & 0xFFFFFFFF, padded.view(torch.int32).to(torch.int64) & 0xFFFFFFFF), dtype


@triton.jit
def _vector_roundtrip(x_ptr, y_ptr, w_ptr, N, flag, BLOCK_N: tl.constexpr):
    """The kernel's 16-bit reader: vector loads of the words, unpack, store at the columns of the
    unpacked layout, then read the row back in the layout of ``cols``."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    EPW: tl.constexpr = 32 // DT.primitive_bitwidth
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    words = tl.arange(0, BLOCK_N // EPW)
    tl.store(w_ptr + words, _ll_pack(tl.load(x_ptr + cols, mask=mask, other=0.0), EPW, BLOCK_N) | (flag.to(tl.int64) << 32))
    tl.debug_barrier()
    v = _ll_unpack(_ll_wait_words(w_ptr, words, words < (N + EPW - 1) // EPW, flag), DT, EPW, BLOCK_N)
    joined = tl.reshape(tl.join(2 * words, 2 * words + 1), (BLOCK_N,))
    tl.store(y_ptr + joined, v, mask=joined < N)


@pytest.mark.parametrize("n", [1, 7, 64, 1001])
def test_ll_vector_reader_roundtrip(device, n):
    for dtype in [torch.float16] + ([torch.bfloat16] if device.type == "cuda" else []):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device, dtype)
        x[0] = -0.0
        block = max(16, triton.next_power_of_2(n))
        y = torch.full_like(x, 5.0)
        words = torch.empty(block // 2, dtype=torch.int64, device=device)
        _vector_roundtrip[(1,)](x, y, words, n, 77, BLOCK_N=block)
        assert torch.equal(y.view(torch.int16), x.view(torch.int16)), dtype
