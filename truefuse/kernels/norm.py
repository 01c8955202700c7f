"""Triton row-normalization kernels: RMSNorm and LayerNorm, forward and backward.

One program normalizes one row in the forward (the whole row in registers, ``BLOCK_N`` = the next
power of two of the hidden size), so a row's statistics are reduced in the same order whatever the
number of rows (batch invariance, docs/design.md §1). Statistics and the weight-gradient partials are fp32.

The rounding rule (fixed; the fused allreduce + RMSNorm reuses it bit for bit):

    rstd = 1 / sqrt_rn(mean(x²) + eps)          x upcast to fp32, mean = sum / N
    y    = round((x * rstd) * w)                 w upcast to fp32 (w + 1 with zero_centered_gamma)

i.e. one rounding to the output dtype at the end; LayerNorm is the same with ``x - mean`` for ``x``
and ``+ b`` before the rounding.

The backward runs ``grid`` persistent programs; each walks a contiguous block of rows, writes each
row's input gradient and accumulates ``Σ dy·x̂`` (and ``Σ dy`` for LayerNorm's bias) in fp32
registers, stored as one partial row per program. The host sums the partials in fp32.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_row(x, w, N, eps, HAS_W: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """RMSNorm of one fp32 row held in registers, by the rounding rule above (before the final
    rounding). Shared with the fused allreduce + RMSNorm kernel so both give the same bits: the
    caller must launch with the same BLOCK_N and num_warps as ``ops.norm`` chooses. ``w``: the
    weight row in fp32, loaded by the caller (the allreduce kernel once per program, ahead of any
    store: a load after a store that may alias it waits one more round trip); unused without HAS_W."""
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / N + eps)
    y = x * rstd
    if HAS_W:
        if ZERO_CENTERED:
            w = w + 1.0
        y = y * w
    return y, rstd


@triton.jit
def _norm_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    stride_x,
    stride_y,
    N,
    eps,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RSTD_IN: tl.constexpr = False,
    ROUND_NORMED: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = x
    if RSTD_IN:
        # a caller's rstd (a stock module's statistics, for its bits: ops/norm.py::rms_norm_hf_ref);
        # ROUND_NORMED rounds x * rstd to x's dtype before the weight, as Llama's RMSNorm does
        rstd = tl.load(rstd_ptr + row)
        y = xc * rstd
        if ROUND_NORMED:
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_W:
            if ZERO_CENTERED:
                w = w + 1.0
            y = y * w
    else:
        y, rstd = rms_norm_row(xc, w, N, eps, HAS_W, ZERO_CENTERED)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if not RSTD_IN:
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    stride_dy,
    stride_x,
    stride_dx,
    M,
    N,
    rows_per_program,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 bounds: the loop index and offsets are int64
    row_end = tl.minimum(row_start + rows_per_program, M)
    # the next row's loads are issued before this row's math, so two rows are in flight per program
    nxt = cols < tl.where(row_start < row_end, N, 0)  # the mask of a row that exists
    x_nxt = tl.load(x_ptr + row_start * stride_x + cols, mask=nxt, other=0.0)
    dy_nxt = tl.load(dy_ptr + row_start * stride_dy + cols, mask=nxt, other=0.0)
    for row in range(row_start, row_end):
        x = x_nxt.to(tl.float32)
        dy = dy_nxt.to(tl.float32)
        nxt = cols < tl.where(row + 1 < row_end, N, 0)
        x_nxt = tl.load(x_ptr + (row + 1) * stride_x + cols, mask=nxt, other=0.0)
        dy_nxt = tl.load(dy_ptr + (row + 1) * stride_dy + cols, mask=nxt, other=0.0)
        rstd = tl.load(rstd_ptr + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        if HAS_W:
            wdy = dy * w
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    if HAS_W:
        tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=mask)
    if HAS_B:
        tl.store(db_part_ptr + pid * N + cols, db_acc, mask=mask)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[n] = Σ_p part[p, n]`` in fp32, rounded once to out's dtype. Tiles of BLOCK_P partial
    rows are loaded at once (many loads in flight); the order is fixed by P alone (deterministic)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        r = p0 + rows
        mask = (r[:, None] < P) & (cols[None, :] < N)
        acc += tl.load(part_ptr + r[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)
