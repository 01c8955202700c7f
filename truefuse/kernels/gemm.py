"""Triton GEMM with the weight-gradient prologue and epilogue PyTorch does not expose.

``C (M×N) = A' (M×K) @ B (K×N)``, with ``A' = A * act'(P)`` when ``GRAD_ACT`` is set (the gradient
through an activation, P the pre-activation), ``C += ...`` when ``ACCUMULATE`` (beta=1 into a wider
output, e.g. fp32 ``main_grad``), and ``GB[m] = Σ_k A'[m, k]`` when ``GRAD_BIAS``: for the
weight-gradient GEMM ``dW = dYᵀ X`` (A = dYᵀ, K = tokens) that is the bias gradient, summed from the
same rounded operand that enters the product.

Batch invariance: BLOCK_K is fixed per input dtype (never tuned, never split-K), so each output
element is reduced over K in the same order whatever M and N are; only BLOCK_M/BLOCK_N/warps/stages
are tuned (batch-invariant mode: chosen from M by ``ops/gemm/gemm_bi_config.py``, checked bitwise on the GPU).
"""

import triton
import triton.language as tl

from truefuse.kernels.activation import act_derivative


@triton.jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    p_ptr,
    gb_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_pm,
    stride_pk,
    ACCUMULATE: tl.constexpr,
    GRAD_ACT: tl.constexpr,
    GRAD_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = banded_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    _gemm_tile(
        a_ptr, b_ptr, c_ptr, p_ptr, gb_ptr, pid_m, pid_n, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm, stride_pk,
        ACCUMULATE, GRAD_ACT, GRAD_BIAS, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


@triton.jit
def banded_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile ``tile`` in GROUP_M-row bands: consecutive tiles share
    B's columns in L2. Which program computes a tile, never how."""
    band = tile // (GROUP_M * num_n)
    first_m = band * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % (GROUP_M * num_n)) % size_m, (tile % (GROUP_M * num_n)) // size_m


@triton.jit
def _gemm_segments_kernel(
    a_ptr,
    b0_ptr,
    c0_ptr,
    b1_ptr,
    c1_ptr,
    b2_ptr,
    c2_ptr,
    M,
    N0,
    N1,
    N2,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``C_s = A @ B_s`` for up to three B_s (K×N_s, one layout) sharing A (the sibling projections
    q/k/v or gate/up of one input): each tile lies in one segment and runs :func:`_gemm_tile`, the
    plain kernel's tile, so each C_s has the bits of its own ``_gemm_kernel`` call with the same
    tiles (``ops/gemm/gemm_backends/triton.py::bi_launch_segments``). C_s is contiguous (M×N_s). Unused
    segments have N_s = 0."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    t = pid // num_m
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    # the segment's operands chosen first, so the tile's loop (and its shared memory) is compiled once
    if t < t0:
        b_ptr, c_ptr, N, pid_n = b0_ptr, c0_ptr, N0, t
    elif t < t0 + t1:
        b_ptr, c_ptr, N, pid_n = b1_ptr, c1_ptr, N1, t - t0
    else:
        b_ptr, c_ptr, N, pid_n = b2_ptr, c2_ptr, N2, t - t0 - t1
    _gemm_tile(
        a_ptr, b_ptr, c_ptr, a_ptr, c_ptr, pid_m, pid_n, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, N, 1, 0, 0,
        False, 0, False, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


@triton.jit
def _gemm_tile(a_ptr, b_ptr, c_ptr, p_ptr, gb_ptr, pid_m, pid_n, M, N, K,
               stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm, stride_pk,
               ACCUMULATE: tl.constexpr, GRAD_ACT: tl.constexpr, GRAD_BIAS: tl.constexpr, IEEE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One (BLOCK_M × BLOCK_N) output tile: the K loop in BLOCK_K steps, then the epilogue."""
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = rm < M
    mask_n = rn < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gb = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask_k = kk < K
        a_mask = mask_m[:, None] & mask_k[None, :]
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak, mask=a_mask, other=0.0)
        if GRAD_ACT != 0:
            p = tl.load(p_ptr + rm[:, None] * stride_pm + kk[None, :] * stride_pk, mask=a_mask, other=0.0)
            # one rounding to the operand dtype, as ATen's backward does before the next GEMM
            a = (a.to(tl.float32) * act_derivative(p.to(tl.float32), GRAD_ACT)).to(a.dtype)
        if GRAD_BIAS:
            if pid_n == 0:  # only the first column-tile writes the sums; the others skip the work
                gb += tl.sum(a.to(tl.float32), axis=1)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)

    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    c_mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    if GRAD_BIAS:
        if pid_n == 0:
            tl.store(gb_ptr + rm, gb.to(gb_ptr.dtype.element_ty), mask=mask_m)
