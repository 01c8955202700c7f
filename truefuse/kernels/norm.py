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

Residual add + RMSNorm (``ops/norm/add_norm.py``) is these kernels with one more input each way:
the forward's HAS_RES reads the residual, stores ``residual + x`` and norms that; the backward's
HAS_DRES adds the residual stream's gradient to dx before its one rounding.
"""

import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper+); the kernels use it only where ops.norm asks
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """Programmatic dependent launch (``launch_pdl=True``): this grid may start while the previous
    kernel drains; wait here, before any load (any input may be that kernel's output). PDL: 0 off;
    1 then lets the next kernel's programs launch at once (they wait in place, holding their SM
    slots); 2 lets them launch only as this kernel's programs exit (``ops/norm/norm_config.py::pdl_trigger``)."""
    if PDL:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()


@triton.jit
def rms_rstd(x, N, eps):
    """1 / sqrt(mean(x²) + eps) of one fp32 row in registers, correctly rounded square root. ``eps``
    is rounded to fp32 here: Triton's launcher passes a Python float as fp32, Inductor's as fp64
    (a compiled graph's launch, docs/design.md §6.7), and both must add the same fp32 eps."""
    return 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / N + tl.cast(eps, tl.float32))


@triton.jit
def rms_norm_row(x, w, N, eps, HAS_W: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """RMSNorm of one fp32 row held in registers, by the rounding rule above (before the final
    rounding). Shared with the fused allreduce + RMSNorm kernel so both give the same bits: the
    caller must launch with the same BLOCK_N and num_warps as ``ops.norm`` chooses. ``w``: the
    weight row in fp32, loaded by the caller (the allreduce kernel once per program, ahead of any
    store: a load after a store that may alias it waits one more round trip); unused without HAS_W."""
    rstd = rms_rstd(x, N, eps)
    y = x * rstd
    if HAS_W:
        if ZERO_CENTERED:
            w = w + 1.0
        y = y * w
    return y, rstd


@triton.jit
def _fwd_wb(w_ptr, b_ptr, cols, mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr, FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward's weight and bias rows (fp32 with FP32, else their own dtype); zeros (a
    placeholder) where there is none."""
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    else:
        w = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=mask, other=0.0)
    else:
        b = tl.zeros((BLOCK_N,), dtype=w.dtype)
    if FP32:
        w = w.to(tl.float32)
        b = b.to(tl.float32)
    return w, b


@triton.jit
def _res_add(x, r, s_ptr, row, stride_s, cols, mask, HAS_RES: tl.constexpr):
    """The row the forward norms, in fp32: ``x`` itself, or with HAS_RES the residual sum
    ``r + x`` rounded once to the sum's dtype and stored (what torch's ``residual + h`` gives:
    fp32 math, one rounding; docs/add_norm.md), then normed from those rounded values, as stock
    norms the stored sum."""
    if HAS_RES:
        s = (r.to(tl.float32) + x.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, s, mask=mask)
        return s.to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _fwd_row(
    x,
    w,
    b,
    row,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    stride_y,
    cols,
    mask,
    N,
    eps,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    RSTD_IN: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
    DT: tl.constexpr,
    HF_STATS: tl.constexpr = False,
):
    """One row of the forward: ``x`` the row in fp32 (masked lanes 0), ``w`` / ``b`` the weight and
    bias rows in fp32 or their own dtype (upcast here: the same values; placeholders without HAS_W /
    HAS_B), ``row`` int64. LayerNorm's two reductions (mean, then variance) stay two: one pass
    (Chan's combine) measured 2-20% slower (experiments/exp_norm_variants.py at d49a912)."""
    w = w.to(tl.float32)
    b = b.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    if RSTD_IN or HF_STATS:
        # a caller's rstd (a stock module's statistics, for its bits: ops/norm/norm.py::rms_norm_hf_ref),
        # or, HF_STATS, this kernel's own (batch-invariant mode's rms_norm_hf in one launch);
        # ROUND_NORMED rounds x * rstd to x's dtype before the weight, as Llama's RMSNorm does
        if RSTD_IN:
            rstd = tl.load(rstd_ptr + row)
        else:
            rstd = rms_rstd(xc, N, eps)
        y = xc * rstd
        if ROUND_NORMED:
            y = y.to(DT).to(tl.float32)
        if HAS_W:
            if ZERO_CENTERED:
                w = w + 1.0
            y = y * w
    else:
        y, rstd = rms_norm_row(xc, w, N, eps, HAS_W, ZERO_CENTERED)
    if HAS_B:
        y = y + b
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if not RSTD_IN:
        tl.store(rstd_ptr + row, rstd)


# M: not specialised (a persistent launch's loop bound; one kernel for every row count)
@triton.jit(do_not_specialize=["M"])
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
    M=0,
    PERSISTENT: tl.constexpr = False,
    EVICT: tl.constexpr = "",
    PDL: tl.constexpr = False,
    WB: tl.constexpr = "reg",
    HF_STATS: tl.constexpr = False,
    r_ptr=None,
    s_ptr=None,
    stride_r=0,
    stride_s=0,
    HAS_RES: tl.constexpr = False,
):
    """PERSISTENT: ``num_programs`` programs, program p norms rows p, p + P, ... (M rows), the next
    row's load issued before this row's math; else one program per row. Each row is normed by the
    same code in the same layout either way (same bits: only the schedule differs). WB: where the
    weight and bias rows live between rows: "reg" in fp32 registers, "narrow" in registers in their
    own dtype (half the registers; upcast per row: the same values, the same bits). Reloading them
    per row from L1 was never faster (experiments/exp_norm_sums.py at d49a912). HAS_RES: the
    normed row is ``r + x`` (``r_ptr``, strided ``stride_r``), stored to ``s_ptr`` first
    (``_res_add``: the residual add + RMSNorm of ``ops/norm/add_norm.py``); off, the kernel's
    code is what it was (the unused pointers are placeholders)."""
    _pdl_enter(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w, b = _fwd_wb(w_ptr, b_ptr, cols, mask, HAS_W, HAS_B, WB == "reg", BLOCK_N)
    if PERSISTENT:
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        first = pid.to(tl.int64)
        x_nxt = tl.load(x_ptr + first * stride_x + cols, mask=cols < tl.where(first < M, N, 0), other=0.0, eviction_policy=EVICT)
        r_nxt = x_nxt
        if HAS_RES:
            r_nxt = tl.load(
                r_ptr + first * stride_r + cols, mask=cols < tl.where(first < M, N, 0), other=0.0, eviction_policy=EVICT
            )
        for r in range(pid, M, P):
            row = tl.cast(r, tl.int64)
            x = _res_add(x_nxt, r_nxt, s_ptr, row, stride_s, cols, mask, HAS_RES)
            nxt = row + P
            x_nxt = tl.load(x_ptr + nxt * stride_x + cols, mask=cols < tl.where(nxt < M, N, 0), other=0.0, eviction_policy=EVICT)
            if HAS_RES:
                r_nxt = tl.load(
                    r_ptr + nxt * stride_r + cols, mask=cols < tl.where(nxt < M, N, 0), other=0.0, eviction_policy=EVICT
                )
            _fwd_row(
                x,
                w,
                b,
                row,
                y_ptr,
                mean_ptr,
                rstd_ptr,
                stride_y,
                cols,
                mask,
                N,
                eps,
                IS_RMS,
                HAS_W,
                HAS_B,
                ZERO_CENTERED,
                RSTD_IN,
                ROUND_NORMED,
                DT,
                HF_STATS,
            )
    else:
        row = tl.program_id(0).to(tl.int64)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0, eviction_policy=EVICT)
        r_row = x
        if HAS_RES:
            r_row = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0, eviction_policy=EVICT)
        x = _res_add(x, r_row, s_ptr, row, stride_s, cols, mask, HAS_RES)
        _fwd_row(
            x,
            w,
            b,
            row,
            y_ptr,
            mean_ptr,
            rstd_ptr,
            stride_y,
            cols,
            mask,
            N,
            eps,
            IS_RMS,
            HAS_W,
            HAS_B,
            ZERO_CENTERED,
            RSTD_IN,
            ROUND_NORMED,
            DT,
            HF_STATS,
        )


# M: not specialised (a persistent launch's loop bound; one kernel for every row count)
@triton.jit(do_not_specialize=["M"])
def _ln_fwd_staged_kernel(
    x_desc,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    stride_y,
    M,
    N,
    eps,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """LayerNorm's forward with its rows brought in by TMA (``x_desc``: a (1, BLOCK_N) block of
    the (M, N) x; columns past N read as zeros) through a software-pipelined loop: STAGES rows in
    flight per program in shared memory, where ``_norm_fwd_kernel`` holds one prefetched row in
    registers (an H200, M = 8192: 66-76% -> 72-93% of the copy rate from 1024 to 16384,
    experiments/exp_norm_tma.py at d49a912). Persistent: program p norms rows p, p + P, ... The same rounding
    rule as ``_fwd_row``'s LayerNorm, written for the (1, BLOCK_N) block the descriptor gives:
    reshaped to 1-D and handed to ``_fwd_row``, the 4096-wide forward + backward lost 6-7 points of
    the copy floor (likely a layout conversion; H200, 2026-11-23). Each row reduced in an order fixed by
    BLOCK_N and num_warps alone (batch invariance). Not for RMSNorm: its forward's layout is the
    fused allreduce's."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    cmask = cols < N
    w, b = _fwd_wb(w_ptr, b_ptr, cols, cmask, HAS_W, HAS_B, False, BLOCK_N)
    for row in tl.range(pid, M, tl.num_programs(0), num_stages=STAGES):
        x = x_desc.load([row, 0]).to(tl.float32)
        r1 = row + tl.arange(0, 1)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(cmask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, axis=1) / N + tl.cast(eps, tl.float32))  # fp32 eps: rms_rstd
        y = xc * rstd[:, None]
        if HAS_W:
            wf = w.to(tl.float32)
            if ZERO_CENTERED:
                wf = wf + 1.0
            y = y * wf
        if HAS_B:
            y = y + b.to(tl.float32)
        tl.store(y_ptr + tl.cast(row, tl.int64) * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cmask)
        tl.store(mean_ptr + r1, mean)
        tl.store(rstd_ptr + r1, rstd)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _ln_sums(p, q, axis: tl.constexpr, ONE: tl.constexpr):
    """Σ p and Σ q along ``axis``: LayerNorm backward's two row sums; with ONE in one reduction
    (one cross-warp exchange and barrier for both)."""
    if ONE:
        s1, s2 = tl.reduce((p, q), axis, _add2)
    else:
        s1 = tl.sum(p, axis=axis)
        s2 = tl.sum(q, axis=axis)
    return s1, s2


@triton.jit
def _widen(v, REMAT: tl.constexpr):
    """``v`` in fp32. With REMAT and bf16 ``v``, by an integer shift (the same value): an op the
    compiler does not merge with an earlier ``v.to(fp32)``, so the 2-byte ``v`` stays live through
    the row's reductions in place of an fp32 copy (half the registers)."""
    if REMAT and v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _row_terms(x, dy, w, mean, rstd, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, REMAT: tl.constexpr):
    """x̂, w·dy and dy in fp32 from a row's x and dy as loaded and its fp32 weight (mean unused for
    RMSNorm); REMAT: widened by ``_widen``'s shift."""
    x = _widen(x, REMAT)
    dy = _widen(dy, REMAT)
    if IS_RMS:
        xhat = x * rstd
    else:
        xhat = (x - mean) * rstd
    if HAS_W:
        wdy = dy * w
    else:
        wdy = dy
    return xhat, wdy, dy


# M, rows_per_program: not specialised (one kernel for every row count)
@triton.jit(do_not_specialize=["M", "rows_per_program"])
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
    ROWS: tl.constexpr = 1,
    PREFETCH: tl.constexpr = True,
    EVICT: tl.constexpr = "",
    PDL: tl.constexpr = False,
    dres_ptr=None,
    stride_dres=0,
    HAS_DRES: tl.constexpr = False,
):
    """Program p takes rows [p·rows_per_program, (p+1)·rows_per_program) ∩ [0, M) in tiles of ROWS
    rows (a (ROWS, BLOCK_N) block; each row reduced alone along its columns, in an order fixed by
    BLOCK_N, ROWS and num_warps: the same for every row whatever its place in the tile). PREFETCH:
    the next tile's loads are issued before this tile's math (two tiles in flight per program)."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    rr = tl.arange(0, ROWS)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        w = w[None, :]
    else:
        w = 0.0
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 bounds: the loop index and offsets are int64
    row_end = tl.minimum(row_start + rows_per_program, M)
    if PREFETCH:
        rows = row_start + rr
        m2 = (rows < row_end)[:, None] & cmask[None, :]
        x_nxt = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m2, other=0.0, eviction_policy=EVICT)
        dy_nxt = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=m2, other=0.0, eviction_policy=EVICT)
    for r0 in range(row_start, row_end, ROWS):
        rows = r0 + rr
        valid = rows < row_end
        m2 = valid[:, None] & cmask[None, :]
        if PREFETCH:
            x = x_nxt.to(tl.float32)
            dy = dy_nxt.to(tl.float32)
            nrows = rows + ROWS
            nm2 = (nrows < row_end)[:, None] & cmask[None, :]
            x_nxt = tl.load(x_ptr + nrows[:, None] * stride_x + cols[None, :], mask=nm2, other=0.0, eviction_policy=EVICT)
            dy_nxt = tl.load(dy_ptr + nrows[:, None] * stride_dy + cols[None, :], mask=nm2, other=0.0, eviction_policy=EVICT)
        else:
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m2, other=0.0, eviction_policy=EVICT)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=m2, other=0.0, eviction_policy=EVICT)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=valid, other=0.0)[:, None]
        if IS_RMS:
            mean = 0.0
        else:
            mean = tl.load(mean_ptr + rows, mask=valid, other=0.0)[:, None]
        xhat, wdy, dy = _row_terms(x, dy, w, mean, rstd, IS_RMS, HAS_W, False)
        if not IS_RMS:
            xhat = tl.where(m2, xhat, 0.0)
        c1 = (tl.sum(xhat * wdy, axis=1) / N)[:, None]
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = (tl.sum(wdy, axis=1) / N)[:, None]
            dx = (wdy - (xhat * c1 + c2)) * rstd
        dx = _plus_dres(dx, dres_ptr, rows[:, None] * stride_dres + cols[None, :], m2, HAS_DRES)
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)
        dw_acc += dy * xhat
        db_acc += dy
    if HAS_W:
        tl.store(dw_part_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_B:
        tl.store(db_part_ptr + pid * N + cols, tl.sum(db_acc, axis=0), mask=cmask)


# M, rows_per_program: not specialised (one kernel for every row count)
@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _norm_bwd_staged_kernel(
    x_desc,
    dy_desc,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    stride_dx,
    M,
    N,
    rows_per_program,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    INNER: tl.constexpr,
    PDL: tl.constexpr = False,
    ONE_REDUCE: tl.constexpr = False,
    REMAT: tl.constexpr = False,
    dres_ptr=None,
    stride_dres=0,
    HAS_DRES: tl.constexpr = False,
):
    """``_norm_bwd_kernel``'s rows (program p: rows [p·rows_per_program, ...) ∩ [0, M), one at a
    time) with x and dy brought in by TMA through a software-pipelined loop: STAGES rows of both in
    flight per program in shared memory, where the pointer kernel holds one prefetched row in
    registers (2880 and 5120, whose rows pad most, ran at 74-76% of the copy rate there,
    experiments/exp_norm_breakdown.py). ``x_desc`` / ``dy_desc``: (M, N // INNER, INNER) views in
    (1, BLOCK_N // INNER, INNER) blocks (chunks past the row read as zeros). Each row reduced in an
    order fixed by BLOCK_N, INNER and num_warps alone (batch invariance); the same formulas as
    ``_norm_bwd_kernel``."""
    _pdl_enter(PDL)
    R: tl.constexpr = BLOCK_N // INNER
    pid = tl.program_id(0)
    cols = (tl.arange(0, R)[:, None] * INNER + tl.arange(0, INNER)[None, :])[None, :, :]
    cmask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
    else:
        w = 0.0
    dw_acc = tl.zeros((1, R, INNER), dtype=tl.float32)
    db_acc = tl.zeros((1, R, INNER), dtype=tl.float32)
    row_start = pid * rows_per_program  # int32: TMA coordinates (M < 2**31 rows)
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in tl.range(row_start, row_end, num_stages=STAGES):
        x_in = x_desc.load([row, 0, 0])
        dy_in = dy_desc.load([row, 0, 0])
        r1 = row + tl.arange(0, 1)
        rstd = tl.load(rstd_ptr + r1)[:, None, None]
        if IS_RMS:
            mean = 0.0
        else:
            mean = tl.load(mean_ptr + r1)[:, None, None]
        # x̂ is not zeroed past N (the pointer kernels zero it): dy is zero there, so those
        # columns add ±0 to every sum and their dx is not stored; 2-3% of LayerNorm's 5120 backward
        xhat, wdy, dy = _row_terms(x_in, dy_in, w, mean, rstd, IS_RMS, HAS_W, False)
        if IS_RMS:
            c1 = (tl.sum(tl.sum(xhat * wdy, axis=2), axis=1) / N)[:, None, None]
            c2 = 0.0
        else:
            s1, s2 = _ln_sums(xhat * wdy, wdy, 2, ONE_REDUCE)
            s1, s2 = _ln_sums(s1, s2, 1, ONE_REDUCE)
            c1 = (s1 / N)[:, None, None]
            c2 = (s2 / N)[:, None, None]
        if REMAT:
            xhat, wdy, dy = _row_terms(x_in, dy_in, w, mean, rstd, IS_RMS, HAS_W, True)
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - (xhat * c1 + c2)) * rstd
        dx = _plus_dres(dx, dres_ptr, tl.cast(row, tl.int64) * stride_dres + cols, cmask, HAS_DRES)
        tl.store(dx_ptr + tl.cast(row, tl.int64) * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
        dw_acc += dy * xhat
        db_acc += dy
    if HAS_W:
        tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=cmask)
    if HAS_B:
        tl.store(db_part_ptr + pid * N + cols, db_acc, mask=cmask)


@triton.jit
def _plus_dres(dx, dres_ptr, offs, mask, HAS_DRES: tl.constexpr):
    """``dx`` (fp32) plus, with HAS_DRES, the residual stream's own gradient at ``offs``: the sum's
    total gradient in one rounding where autograd would round dx, then add (the same bits in
    fp32 where no FMA contracts the add; ``ops/norm/add_norm.py``)."""
    if HAS_DRES:
        dx = dx + tl.load(dres_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return dx


@triton.jit
def _bwd_part_load(x_ptr, dy_ptr, row, stride_x, stride_dy, c, lim, EVICT: tl.constexpr):
    """x and dy at columns ``c < lim`` of ``row`` (lim: N, or 0 past the program's last row)."""
    m = c < lim
    x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0, eviction_policy=EVICT)
    dy = tl.load(dy_ptr + row * stride_dy + c, mask=m, other=0.0, eviction_policy=EVICT)
    return x, dy


@triton.jit
def _bwd_part_math(
    x,
    dy,
    w_ptr,
    c,
    m,
    mean,
    rstd,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    REMAT: tl.constexpr = False,
):
    """``_row_terms`` of one column part of a row, x̂ zeroed past N (LayerNorm); w loaded here (an
    L1 hit after the first row)."""
    w = 0.0
    if HAS_W:
        w = _widen(tl.load(w_ptr + c, mask=m, other=0.0), REMAT)
        if ZERO_CENTERED:
            w = w + 1.0
    xhat, wdy, dy = _row_terms(x, dy, w, mean, rstd, IS_RMS, HAS_W, REMAT)
    if not IS_RMS:
        xhat = tl.where(m, xhat, 0.0)
    return xhat, wdy, dy


@triton.jit
def _bwd_part_dx(
    x,
    dy,
    w_ptr,
    dx_ptr,
    row,
    stride_dx,
    c,
    m,
    mean,
    rstd,
    c1,
    c2,
    dw,
    db,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    REMAT: tl.constexpr = False,
    dres_ptr=None,
    stride_dres=0,
    HAS_DRES: tl.constexpr = False,
):
    """One column part's dx (stored) and weight / bias-gradient terms (added to dw / db), from the
    row's c1, c2 and the first pass's x and dy (its x̂ and w·dy recomputed from them: the same
    values, merged by the compiler)."""
    xhat, wdy, dy = _bwd_part_math(x, dy, w_ptr, c, m, mean, rstd, IS_RMS, HAS_W, ZERO_CENTERED, REMAT)
    dx = _plus_dres((wdy - (xhat * c1 + c2)) * rstd, dres_ptr, row * stride_dres + c, m, HAS_DRES)
    tl.store(dx_ptr + row * stride_dx + c, dx.to(dx_ptr.dtype.element_ty), mask=m)
    dw += dy * xhat
    if HAS_B:
        db += dy
    return dw, db


# M, rows_per_program: not specialised (one kernel for every row count)
@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _norm_bwd_split_kernel(
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
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PREFETCH: tl.constexpr = True,
    PDL: tl.constexpr = False,
    ONE_REDUCE: tl.constexpr = False,
    REMAT: tl.constexpr = False,
    dres_ptr=None,
    stride_dres=0,
    HAS_DRES: tl.constexpr = False,
):
    """The backward of ``_norm_bwd_kernel`` (one row at a time) with the row in two column parts,
    A = [0, BLOCK_A) and B = [BLOCK_A, BLOCK_A + BLOCK_B): the rows above 8192 (``ops/norm/norm.py::
    bwd_config``), and a hidden size that is not a power of two pads less (5120 = 4096 + 1024
    instead of 8192). Each row reduced in an order fixed by the blocks and num_warps (batch
    invariance). A second pass that loaded x and dy again instead of holding them through the
    reductions measured 12-14% slower at 16384 (commit cbdf501 has it; exp_norm_resweep.py)."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    ca = tl.arange(0, BLOCK_A)
    cb = BLOCK_A + tl.arange(0, BLOCK_B)
    ma = ca < N
    mb = cb < N
    dwa = tl.zeros((BLOCK_A,), dtype=tl.float32)
    dwb = tl.zeros((BLOCK_B,), dtype=tl.float32)
    dba = tl.zeros((BLOCK_A,), dtype=tl.float32)
    dbb = tl.zeros((BLOCK_B,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    if PREFETCH:
        lim = tl.where(row_start < row_end, N, 0)
        xa_n, dya_n = _bwd_part_load(x_ptr, dy_ptr, row_start, stride_x, stride_dy, ca, lim, "")
        xb_n, dyb_n = _bwd_part_load(x_ptr, dy_ptr, row_start, stride_x, stride_dy, cb, lim, "")
    for row in range(row_start, row_end):
        if PREFETCH:
            xa, dya, xb, dyb = xa_n, dya_n, xb_n, dyb_n
            lim = tl.where(row + 1 < row_end, N, 0)
            xa_n, dya_n = _bwd_part_load(x_ptr, dy_ptr, row + 1, stride_x, stride_dy, ca, lim, "")
            xb_n, dyb_n = _bwd_part_load(x_ptr, dy_ptr, row + 1, stride_x, stride_dy, cb, lim, "")
        else:
            xa, dya = _bwd_part_load(x_ptr, dy_ptr, row, stride_x, stride_dy, ca, N, "evict_last")
            xb, dyb = _bwd_part_load(x_ptr, dy_ptr, row, stride_x, stride_dy, cb, N, "evict_last")
        rstd = tl.load(rstd_ptr + row)
        if IS_RMS:
            mean = 0.0
        else:
            mean = tl.load(mean_ptr + row)
        xha, wdya, _ = _bwd_part_math(xa, dya, w_ptr, ca, ma, mean, rstd, IS_RMS, HAS_W, ZERO_CENTERED)
        xhb, wdyb, _ = _bwd_part_math(xb, dyb, w_ptr, cb, mb, mean, rstd, IS_RMS, HAS_W, ZERO_CENTERED)
        if IS_RMS:
            c1 = (tl.sum(xha * wdya, axis=0) + tl.sum(xhb * wdyb, axis=0)) / N
            c2 = 0.0
        else:
            s1a, s2a = _ln_sums(xha * wdya, wdya, 0, ONE_REDUCE)
            s1b, s2b = _ln_sums(xhb * wdyb, wdyb, 0, ONE_REDUCE)
            c1 = (s1a + s1b) / N
            c2 = (s2a + s2b) / N
        dwa, dba = _bwd_part_dx(
            xa,
            dya,
            w_ptr,
            dx_ptr,
            row,
            stride_dx,
            ca,
            ma,
            mean,
            rstd,
            c1,
            c2,
            dwa,
            dba,
            IS_RMS,
            HAS_W,
            HAS_B,
            ZERO_CENTERED,
            REMAT,
            dres_ptr,
            stride_dres,
            HAS_DRES,
        )
        dwb, dbb = _bwd_part_dx(
            xb,
            dyb,
            w_ptr,
            dx_ptr,
            row,
            stride_dx,
            cb,
            mb,
            mean,
            rstd,
            c1,
            c2,
            dwb,
            dbb,
            IS_RMS,
            HAS_W,
            HAS_B,
            ZERO_CENTERED,
            REMAT,
            dres_ptr,
            stride_dres,
            HAS_DRES,
        )
    if HAS_W:
        tl.store(dw_part_ptr + pid * N + ca, dwa, mask=ma)
        tl.store(dw_part_ptr + pid * N + cb, dwb, mask=mb)
    if HAS_B:
        tl.store(db_part_ptr + pid * N + ca, dba, mask=ma)
        tl.store(db_part_ptr + pid * N + cb, dbb, mask=mb)


@triton.jit(do_not_specialize=["P"])
def _sum_partials_kernel(
    part_ptr,
    out_ptr,
    part2_ptr,
    out2_ptr,
    P,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TWO: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """``out[n] = Σ_p part[p, n]`` in fp32, rounded once to out's dtype (and with TWO the same of
    ``part2`` into ``out2``: LayerNorm's weight and bias gradients in one launch). Tiles of BLOCK_P
    partial rows are loaded at once (many loads in flight); the order is fixed by P alone (deterministic)."""
    _pdl_enter(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        r = p0 + rows
        mask = (r[:, None] < P) & (cols[None, :] < N)
        acc += tl.load(part_ptr + r[:, None] * N + cols[None, :], mask=mask, other=0.0)
        if TWO:
            acc2 += tl.load(part2_ptr + r[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)
    if TWO:
        tl.store(out2_ptr + cols, tl.sum(acc2, axis=0).to(out2_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _squares_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out = fp32(x)²`` over ``n`` contiguous elements: the statistics' first two steps of a
    transformers RMSNorm (``x.to(float32).pow(2)``; torch's fp32 ``pow(2)`` is ``x * x``) in one
    pass, for torch's own mean to reduce (``ops/norm/norm.py::hf_rstd_squared``). Elementwise: no
    reduction order to keep."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, x * x, mask=m)
