"""The batch-invariant GEMM for many rows on Hopper: persistent programs, operands through TMA
tensor descriptors (issue 34: the plain kernel's forward reached 1.17× cuBLAS at 8192 rows).

The descriptors are made on the device from pointers and strides (a 128-byte scratch each,
``ops/gemm/gemm_backends/triton.py::_tma_scratch``): host-made ones cost Triton's launcher ~4× a plain
launch's host time (encoded per call), which a host-bound training step pays twice per Linear
(experiments/host_time.py bi-linear).

``C (M×N) = A (M×K) @ B (K×N)`` with B given as its descriptor's tiles: ``B_NK`` the (N, K) weight
``W`` of ``x Wᵀ`` (the forward, ``"nt"``), else the (K, N) ``W`` of ``dy W`` (the input gradient,
``"nn"``). Each output tile is reduced over K in BLOCK_K steps from k = 0 up, one ``tl.dot`` per
step into an fp32 accumulator, the copy engine filling what lies past the edges with zeros: the
arithmetic of ``kernels/gemm.py::_gemm_tile`` with the same BLOCK_K, so its bits (checked on the
GPU for every table entry that names it: ``bench_bi_gemm``, ``tests/test_batch_invariant.py``).
Which program computes a tile never changes how.
"""

import triton
import triton.language as tl

from truefuse.kernels.gemm import banded_tile


@triton.jit
def _gemm_tma_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bw,
    stride_cm,
    B_NK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WS: tl.constexpr = False,
    IEEE: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = False,
):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_NK:  # the weight as stored, (N, K) or (K, N), stride_bw its row stride
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bw, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bw, 1], block_shape=[BLOCK_K, BLOCK_N])
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    rm_tile = tl.arange(0, BLOCK_M)
    rn_tile = tl.arange(0, BLOCK_N)
    for tile in tl.range(pid, num_m * num_n, nprog, flatten=True, warp_specialize=WS):
        pm, pn = banded_tile(tile, num_m, num_n, GROUP_M)
        m0 = pm * BLOCK_M
        n0 = pn * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([m0, k0])
            if B_NK:
                b = b_desc.load([n0, k0]).T
            else:
                b = b_desc.load([k0, n0])
            if IEEE:  # fp32 as the plain kernel runs it (the interpreter's check: the launcher takes bf16/fp16)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        rm = (m0 + rm_tile).to(tl.int64)
        rn = n0 + rn_tile
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :]
        c_mask = (rm < M)[:, None] & (rn < N)[None, :]
        if ACCUMULATE:  # C += A·B: the plain kernel's epilogue (one rounding of the fp32 sum)
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
