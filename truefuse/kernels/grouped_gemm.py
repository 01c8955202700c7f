"""Batch-invariant persistent grouped GEMMs over rows ordered by group (mixture of experts).

The groups are given on the device by ``offsets`` (int64, G + 1 entries, the cumulative sum of the
group sizes): the host knows only the total number of rows, so the sizes may live in a CUDA tensor
with no host sync (and the launch may be captured in a CUDA graph).

* ``_grouped_gemm_rows_kernel`` ("rows" mode, forward and input gradient):
  ``C[rows of g] = A[rows of g] @ B_g (+ bias_g)``, ``B`` (G, K, N) with any strides (a packed
  weight (G, N, K) transposed for the forward, itself for the input gradient). The work items
  (group, m-tile, n-tile) are enumerated on the device: every program walks the groups in order,
  reads their offsets, and takes every ``num_programs``-th tile.
* ``_grouped_gemm_wgrad_kernel`` ("contraction" mode, weight gradient):
  ``C_g = DYᵀ[:, rows of g] @ X[rows of g]`` (G, N, K), fp32 accumulation over the group's rows in
  BLOCK_M steps from its first row, masked at its end; written in the output's dtype, or added
  (``ACCUMULATE``, beta=1) into it (an fp32 ``main_grad``). An empty group writes zeros (leaves the
  output untouched when accumulating).
* ``_grouped_gemm_rows_tma_kernel``, ``_grouped_gemm_wgrad_tma_kernel``: the same two on Hopper
  (fp16/bf16), operands through TMA tensor descriptors; the same contract (see their section below).
* ``_grouped_gemm_bgrad_kernel``: the bias gradient ``Σ_{rows of g} DY`` per group, fp32, in BLOCK_M
  steps from the group's first row (a fixed-order segment sum, no atomics).

Batch invariance (docs/design.md §1, "Grouped GEMM"): the tile shapes are one constexpr
configuration per dtype and problem kind chosen by the launcher (never from the token count or the
group sizes), a tile's reduction runs over K (or over the group's rows) in a fixed order starting at
the group's first row, and masked rows load zeros: so each output element depends only on its own
group's rows, never on which program computes it, on the other groups' sizes, their order or the
batch. No split-K, no atomics. Offsets are clamped to ``[0, M]`` so that sizes which do not sum to
M (a device tensor cannot be checked without a sync) never read or write out of bounds.
"""

import triton
import triton.language as tl


@triton.jit
def _group_rows(off_ptr, g, M):
    """(start, end) of group ``g``'s rows, int64, clamped to [0, M] and end >= start."""
    start = tl.load(off_ptr + g).to(tl.int64)
    end = tl.load(off_ptr + g + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), M)
    end = tl.minimum(tl.maximum(end, start), M)
    return start, end


@triton.jit
def _grouped_gemm_rows_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    off_ptr,
    G,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bg,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_biasg,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    num_n = tl.cdiv(N, BLOCK_N).to(tl.int64)
    rm_tile = tl.arange(0, BLOCK_M).to(tl.int64)
    rn_tile = tl.arange(0, BLOCK_N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    tile = pid  # the next global tile index this program takes
    first = pid * 0  # global index of the current group's first tile
    for g_ in range(0, G):
        g = pid * 0 + g_  # int64 (the interpreter's loop variable is a Python int)
        start, end = _group_rows(off_ptr, g, M)
        tiles = tl.cdiv(end - start, BLOCK_M) * num_n
        num_m = tl.cdiv(end - start, BLOCK_M)
        while tile < first + tiles:
            # the group's tiles in GROUP_M-row bands (consecutive programs share B columns in L2);
            # the order only says which program computes a tile, never how
            local = tile - first
            band = local // (GROUP_M * num_n)
            first_m = band * GROUP_M
            size_m = tl.minimum(num_m - first_m, GROUP_M)
            pm = first_m + (local % (GROUP_M * num_n)) % size_m
            pn = (local % (GROUP_M * num_n)) // size_m
            rm = start + pm * BLOCK_M + rm_tile
            rn = pn * BLOCK_N + rn_tile
            mask_m = rm < end
            mask_n = rn < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            b_base = b_ptr + g * stride_bg
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                mask_k = kk < K
                a = tl.load(
                    a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0,
                )
                b = tl.load(
                    b_base + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0,
                )
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + g * stride_biasg + rn, mask=mask_n, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
            tile += nprog
        first += tiles


@triton.jit
def _epilogue_ptr(c_ptr, acc, g, rn, rk, start, end, N, K, stride_cg, stride_cn, stride_ck, ACCUMULATE: tl.constexpr):
    """dW_g's (rn, rk) tile written, or added into main_grad (``ACCUMULATE``, one fp32 add), through
    masked int64 addresses."""
    c_ptrs = c_ptr + g.to(tl.int64) * stride_cg + rn[:, None].to(tl.int64) * stride_cn + rk[None, :] * stride_ck
    mask_k = rk < K
    if ACCUMULATE:
        # an empty group leaves main_grad untouched (not even -0.0 + 0.0)
        mask_k = rk < tl.where(end > start, K, 0)
    c_mask = (rn < N)[:, None] & mask_k[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _grouped_gemm_wgrad_kernel(
    dy_ptr,
    x_ptr,
    c_ptr,
    off_ptr,
    G,
    M,
    N,
    K,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_cg,
    stride_cn,
    stride_ck,
    ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    num_n = tl.cdiv(N, BLOCK_N).to(tl.int64)
    num_k = tl.cdiv(K, BLOCK_K).to(tl.int64)
    per_group = num_n * num_k
    total = G * per_group
    rm_tile = tl.arange(0, BLOCK_M).to(tl.int64)
    rn_tile = tl.arange(0, BLOCK_N).to(tl.int64)
    rk_tile = tl.arange(0, BLOCK_K).to(tl.int64)
    tile = pid
    while tile < total:
        g = tile // per_group
        local = tile % per_group
        pn = local // num_k
        pk = local % num_k
        start, end = _group_rows(off_ptr, g, M)
        rn = pn * BLOCK_N + rn_tile
        rk = pk * BLOCK_K + rk_tile
        mask_n = rn < N
        mask_k = rk < K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        m0 = start
        while m0 < end:  # the group's rows in fixed BLOCK_M steps from its first row
            rm = m0 + rm_tile
            mask_m = rm < end
            a = tl.load(
                dy_ptr + rn[:, None] * stride_dyn + rm[None, :] * stride_dym,
                mask=mask_n[:, None] & mask_m[None, :],
                other=0.0,
            )
            b = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            m0 += BLOCK_M
        _epilogue_ptr(c_ptr, acc, g, rn, rk, start, end, N, K, stride_cg, stride_cn, stride_ck, ACCUMULATE)
        tile += nprog


@triton.jit
def _grouped_gemm_bgrad_kernel(
    dy_ptr,
    out_ptr,
    off_ptr,
    M,
    N,
    stride_dym,
    stride_dyn,
    stride_og,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    pn = tl.program_id(1).to(tl.int64)
    start, end = _group_rows(off_ptr, g, M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = rn < N
    rm_tile = tl.arange(0, BLOCK_M).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    m0 = start
    while m0 < end:
        rm = m0 + rm_tile
        t = tl.load(
            dy_ptr + rm[:, None] * stride_dym + rn[None, :] * stride_dyn,
            mask=(rm < end)[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += t.to(tl.float32)
        m0 += BLOCK_M
    tl.store(out_ptr + g * stride_og + rn, tl.sum(acc, axis=0), mask=mask_n)


# ---------------------------------------------------------------------------------------------
# Hopper (sm_90+) variants: operands through TMA tensor descriptors (host-made, passed by value),
# the same math in the same order as the pointer kernels above (so the same contract), fp16/bf16.
#
# Rows mode reads the A tile of a group's last m-tile past the group's end (the next group's rows,
# or zeros past M): those rows only feed output rows that the masked store drops, since an output
# row depends on its own A row alone. The weight descriptor is 3-D (G, ., .) so a K tail never reads
# the next group's weights (the copy engine zero-fills past each dimension's bound). Wgrad reduces
# over the group's rows: full BLOCK_M chunks load unmasked, the one tail chunk is zeroed past the
# group's end (both operands, so that no other group's value, inf or NaN, reaches dW_g). Its output
# may go through a 3-D (G, N, K) descriptor too (``TMA_EPI``: the copy engine clips N and K tails at
# the output's bounds, an empty group's main_grad is skipped), in EPI_SPLIT column parts: the same
# fp32 values, the same one add into main_grad, so the same bits as the pointer epilogue.


@triton.jit
def _grouped_gemm_rows_tma_kernel(
    a_desc,
    b_desc,
    c_ptr,
    bias_ptr,
    off_ptr,
    G,
    M,
    N,
    K,
    stride_cm,
    stride_cn,
    stride_biasg,
    HAS_BIAS: tl.constexpr,
    B_NK: tl.constexpr,  # b_desc's blocks are (1, BLOCK_N, BLOCK_K) (a packed (G, N, K) weight) else (1, BLOCK_K, BLOCK_N)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GCHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_n = tl.cdiv(N, BLOCK_N)
    gidx = tl.arange(0, GCHUNK)
    rm_tile = tl.arange(0, BLOCK_M)
    rn_tile = tl.arange(0, BLOCK_N)
    tile = pid  # the next global tile index this program takes
    first = pid * 0  # global index of the current chunk's first tile
    for c0 in range(0, G, GCHUNK):
        # GCHUNK groups' offsets at once: tile counts and their prefix sums in registers
        gi = c0 + gidx
        valid = gi < G
        s = tl.load(off_ptr + gi, mask=valid, other=0)
        e = tl.load(off_ptr + gi + 1, mask=valid, other=0)
        s = tl.minimum(tl.maximum(s, 0), M)
        e = tl.minimum(tl.maximum(e, s), M)
        nm = ((e - s + BLOCK_M - 1) // BLOCK_M).to(tl.int32)
        nt = nm * num_n
        cum = tl.cumsum(nt, 0)  # inclusive
        total = tl.sum(nt, 0)
        while tile < first + total:
            local = tile - first
            gl = tl.sum((cum <= local).to(tl.int32), 0)  # the group (in the chunk) holding the tile
            sel = gidx == gl
            start = tl.sum(tl.where(sel, s, 0), 0)
            end = tl.sum(tl.where(sel, e, 0), 0)
            num_m = tl.sum(tl.where(sel, nm, 0), 0)
            local -= tl.sum(tl.where(sel, cum - nt, 0), 0)
            g = c0 + gl
            # the group's tiles in GROUP_M-row bands (consecutive programs share B columns in L2);
            # the order only says which program computes a tile, never how
            band = local // (GROUP_M * num_n)
            first_m = band * GROUP_M
            size_m = tl.minimum(num_m - first_m, GROUP_M)
            pm = first_m + (local % (GROUP_M * num_n)) % size_m
            pn = (local % (GROUP_M * num_n)) // size_m
            row0 = start.to(tl.int32) + pm * BLOCK_M
            n0 = pn * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([row0, k0])
                if B_NK:
                    b = b_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = b_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
                acc = tl.dot(a, b, acc)
            rn = n0 + rn_tile
            mask_n = rn < N
            if HAS_BIAS:
                bias = tl.load(bias_ptr + g.to(tl.int64) * stride_biasg + rn, mask=mask_n, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            rm = start + (pm * BLOCK_M + rm_tile).to(tl.int64)
            c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < end)[:, None] & mask_n[None, :])
            tile += nprog
        first += total


@triton.jit
def _halves(t, BN: tl.constexpr, BK: tl.constexpr):
    """(BN, BK) -> its column halves [0, BK/2) and [BK/2, BK), each (BN, BK/2)."""
    return t.reshape(BN, 2, BK // 2).permute(0, 2, 1).split()


@triton.jit
def _epilogue_tma_part(
    c_desc, part, g, n0, k0, BN: tl.constexpr, BK: tl.constexpr, ACCUMULATE: tl.constexpr, OUT_TY: tl.constexpr
):
    """One (BN, BK) part of a dW tile through the output's 3-D descriptor: ``main_grad += part``
    (one fp32 add, ``ACCUMULATE``) or ``out = part``; the copy engine drops what lies past (G, N, K)."""
    if ACCUMULATE:
        part += c_desc.load([g, n0, k0]).reshape(BN, BK).to(tl.float32)
    c_desc.store([g, n0, k0], part.to(OUT_TY).reshape(1, BN, BK))


@triton.jit
def _epilogue_tma(
    c_desc,
    acc,
    g,
    n0,
    k0,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    OUT_TY: tl.constexpr,
):
    """The dW tile in SPLIT (1, 2 or 4) column parts: fewer registers and a smaller shared buffer
    live at once than the whole tile (the 128×256 fp32 ``main_grad`` tile spilled 424 bytes through
    pointers); the same values, the same one add per element."""
    if SPLIT == 1:
        _epilogue_tma_part(c_desc, acc, g, n0, k0, BN, BK, ACCUMULATE, OUT_TY)
    elif SPLIT == 2:
        a0, a1 = _halves(acc, BN, BK)
        _epilogue_tma_part(c_desc, a0, g, n0, k0, BN, BK // 2, ACCUMULATE, OUT_TY)
        _epilogue_tma_part(c_desc, a1, g, n0, k0 + BK // 2, BN, BK // 2, ACCUMULATE, OUT_TY)
    else:
        tl.static_assert(SPLIT == 4)
        a0, a1 = _halves(acc, BN, BK)
        a00, a01 = _halves(a0, BN, BK // 2)
        a10, a11 = _halves(a1, BN, BK // 2)
        Q: tl.constexpr = BK // 4
        _epilogue_tma_part(c_desc, a00, g, n0, k0, BN, Q, ACCUMULATE, OUT_TY)
        _epilogue_tma_part(c_desc, a01, g, n0, k0 + Q, BN, Q, ACCUMULATE, OUT_TY)
        _epilogue_tma_part(c_desc, a10, g, n0, k0 + 2 * Q, BN, Q, ACCUMULATE, OUT_TY)
        _epilogue_tma_part(c_desc, a11, g, n0, k0 + 3 * Q, BN, Q, ACCUMULATE, OUT_TY)


@triton.jit
def _grouped_gemm_wgrad_tma_kernel(
    dy_desc,
    x_desc,
    c_desc,  # the output's (G, N, K) descriptor, blocks (1, BLOCK_N, BLOCK_K // EPI_SPLIT), or None
    c_ptr,
    off_ptr,
    G,
    M,
    N,
    K,
    stride_cg,
    stride_cn,
    stride_ck,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TMA_EPI: tl.constexpr,  # the epilogue through c_desc (else masked pointer loads/stores)
    EPI_SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_group = num_n * num_k
    total = G * per_group
    rm_tile = tl.arange(0, BLOCK_M)
    rn_tile = tl.arange(0, BLOCK_N)
    rk_tile = tl.arange(0, BLOCK_K)
    tile = pid
    while tile < total:
        g = tile // per_group
        local = tile % per_group
        pn = local // num_k
        pk = local % num_k
        start64, end64 = _group_rows(off_ptr, g.to(tl.int64), M)
        start = start64.to(tl.int32)
        end = end64.to(tl.int32)
        n0 = pn * BLOCK_N
        k0 = pk * BLOCK_K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        full_end = start + ((end - start) // BLOCK_M) * BLOCK_M
        for m0 in range(start, full_end, BLOCK_M):  # the group's rows in fixed BLOCK_M steps from its first row
            a = dy_desc.load([m0, n0])
            b = x_desc.load([m0, k0])
            acc = tl.dot(a.T, b, acc)
        if full_end < end:  # the tail chunk, zeroed past the group's end
            mask_m = (full_end + rm_tile) < end
            a = dy_desc.load([full_end, n0])
            b = x_desc.load([full_end, k0])
            a = tl.where(mask_m[:, None], a, tl.zeros_like(a))
            b = tl.where(mask_m[:, None], b, tl.zeros_like(b))
            acc = tl.dot(a.T, b, acc)
        if TMA_EPI:
            if ACCUMULATE:
                if end > start:  # an empty group leaves main_grad untouched (not even -0.0 + 0.0)
                    _epilogue_tma(c_desc, acc, g, n0, k0, BLOCK_N, BLOCK_K, EPI_SPLIT, True, c_ptr.dtype.element_ty)
            else:
                _epilogue_tma(c_desc, acc, g, n0, k0, BLOCK_N, BLOCK_K, EPI_SPLIT, False, c_ptr.dtype.element_ty)
        else:
            # the epilogue's int64 addresses are made here, after the reduction: made before it they
            # stay live across the loop (bf16 128×128 tiles, 8 warps: 174 registers instead of 123),
            # two programs no longer share an SM, and dW ran 1.3-1.6× slower at 64 × 256 and
            # 128 × 128 (H200)
            rn, rk = n0 + rn_tile, k0 + rk_tile
            _epilogue_ptr(c_ptr, acc, g, rn, rk, start, end, N, K, stride_cg, stride_cn, stride_ck, ACCUMULATE)
        tile += nprog
