"""Triton row helpers the loss kernels share (``linear_cross_entropy``'s whole-row and slice
kernels, ``linear_log_probs``): reading a block of a row's logits (bias in fp32, softcap), and the
cross-entropy's two passes over a row (statistics, then the gradient written over the logits).

One module so that no kernel file imports another's private names (docs/design.md §5); the
helpers are those of ``kernels/linear_cross_entropy.py`` before, moved line for line.
"""

import triton
import triton.language as tl


@triton.jit
def _tanh_of(y, e):
    """tanh(y) from ``e = e^{−2|y|}``, within ~2 ulp in fp32: an odd Taylor polynomial for
    |y| < 0.55 (to y^17; the first term left out is < 6e-9 of tanh there), else
    (1 − e) / (1 + e) with y's sign (once e ≤ 1/3, 1 − e cancels nothing). The old split at 0.1 left
    1 − e cancelling just above it: up to 7.8 ulp off (tests/test_properties.py)."""
    y2 = y * y
    c = 6404582.0 / 10854718875.0
    c = -929569.0 / 638512875.0 + y2 * c
    c = 21844.0 / 6081075.0 + y2 * c
    c = -1382.0 / 155925.0 + y2 * c
    c = 62.0 / 2835.0 + y2 * c
    c = -17.0 / 315.0 + y2 * c
    c = 2.0 / 15.0 + y2 * c
    c = -1.0 / 3.0 + y2 * c
    small = y + y * (y2 * c)
    big = (1.0 - e) / (1.0 + e)
    return tl.where(tl.abs(y) < 0.55, small, tl.where(y < 0, -big, big))


@triton.jit
def softcap_slope(x, cap, SOFTCAP: tl.constexpr):
    """``(softcap(x), d softcap / dx)``: the slope 1 − tanh²(x/cap) as 4e / (1 + e)², e = e^{−2|x/cap|},
    not from the rounded tanh, where 1 − t² cancels as t nears ±1 (a saturated softcap's gradient
    came out twice the plain path's error, tests/test_properties.py). Without a softcap the slope is
    x itself, a placeholder no caller reads (one return: the compiler types both branches alike)."""
    slope = x
    if SOFTCAP:
        y = x / cap
        e = tl.exp(-2.0 * tl.abs(y))
        x = cap * _tanh_of(y, e)
        slope = 4.0 * e / ((1.0 + e) * (1.0 + e))
    return x, slope


@triton.jit
def softcap(x, cap, SOFTCAP: tl.constexpr):
    """``softcap_slope``'s logits alone (the unused slope compiles away)."""
    return softcap_slope(x, cap, SOFTCAP)[0]


@triton.jit
def load_block(base, cols, mask, MASKED: tl.constexpr):
    """A block of a row: unmasked (16-byte vectors) but for a row's last, partial block."""
    if MASKED:
        return tl.load(base + cols, mask=mask, other=0.0)
    return tl.load(base + cols)


@triton.jit
def logits_slope_block(base, bias_ptr, cols, mask, cap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """A block of a row's logits in fp32: plus the bias when the GEMM left it out, then softcap;
    and the softcap's slope at them (``softcap_slope``), for a gradient pass."""
    z = load_block(base, cols, mask, MASKED).to(tl.float32)
    if HAS_BIAS:
        z += load_block(bias_ptr, cols, mask, MASKED).to(tl.float32)
    return softcap_slope(z, cap, SOFTCAP)


@triton.jit
def logits_block(base, bias_ptr, cols, mask, cap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """``logits_slope_block``'s logits alone."""
    return logits_slope_block(base, bias_ptr, cols, mask, cap, HAS_BIAS, SOFTCAP, MASKED)[0]


@triton.jit
def ce_stats_block(base, bias_ptr, cw_ptr, cols, V, cap, m, s, arg, wz, HAS_BIAS, HAS_CW, SMOOTH, SOFTCAP, MASKED: tl.constexpr):
    """Pass 1 over one block of a row: each lane's running max ``m``, sum of exponentials ``s``
    (relative to ``m``), index of its first maximum ``arg`` and Σ w_c·z_c ``wz``. Only the last
    block of a row is ``MASKED``: the others load without a mask, in 16-byte vectors."""
    mask = cols < V
    z = logits_block(base, bias_ptr, cols, mask, cap, HAS_BIAS, SOFTCAP, MASKED)
    if MASKED:
        z = tl.where(mask, z, float("-inf"))
    up = z > m  # strictly greater: a lane keeps its first maximum, as torch.argmax
    e = tl.exp(tl.where(up, m - z, z - m))  # one exp: the sum is rescaled only when the max moves
    # equal infinities would give NaN: e^0 = 1 for z == m (+inf included), e^-inf = 0
    e = tl.where(z == float("-inf"), 0.0, tl.where(z == m, 1.0, e))
    s = tl.where(up, s * e + 1.0, s + e)
    m = tl.where(up, z, m)
    arg = tl.where(up, cols, arg)
    if SMOOTH:
        if HAS_CW:
            zw = z * tl.load(cw_ptr + cols, mask=mask, other=0.0)
        else:
            zw = z
        if MASKED:
            zw = tl.where(mask, zw, 0.0)
        wz += zw
    return m, s, arg, wz


@triton.jit
def ce_row_stats(
    base,
    bias_ptr,
    cw_ptr,
    V,
    cap,
    HAS_BIAS: tl.constexpr,
    HAS_CW: tl.constexpr,
    SMOOTH: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Pass 1 over a row of V logits: (max, Σ e^(z − max), index of the first maximum, Σ w_c·z_c).

    One running state per lane, reduced across lanes once after the loop: no reduction (and so no
    barrier between warps) per block. A lane whose max stayed -inf holds s = 0, or NaN if it met a
    NaN (NaN > m is never true, so a NaN moves no max but makes the lane's sum NaN for good): its s
    is its share as it stands. With a NaN in the row the index is its first NaN (torch.argmax's
    answer), found by a second pass over this row only, off the common path."""
    cols0 = tl.arange(0, BLOCK_V)
    n_full = V // BLOCK_V
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    arg = tl.zeros((BLOCK_V,), tl.int32)
    wz = tl.zeros((BLOCK_V,), tl.float32)
    for i in range(0, n_full):
        m, s, arg, wz = ce_stats_block(
            base, bias_ptr, cw_ptr, i * BLOCK_V + cols0, V, cap, m, s, arg, wz, HAS_BIAS, HAS_CW, SMOOTH, SOFTCAP, False
        )
    if V % BLOCK_V != 0:
        m, s, arg, wz = ce_stats_block(
            base, bias_ptr, cw_ptr, n_full * BLOCK_V + cols0, V, cap, m, s, arg, wz, HAS_BIAS, HAS_CW, SMOOTH, SOFTCAP, True
        )
    mx = tl.max(m, axis=0)
    scaled = tl.where(m == mx, s, tl.where(m == float("-inf"), s, s * tl.exp(m - mx)))
    total = tl.sum(scaled, axis=0)
    best_i = tl.min(tl.where(m == mx, arg, V), axis=0).to(tl.int64)  # the first maximum overall
    if total != total:
        first = tl.zeros((BLOCK_V,), tl.int32) + V
        for i in range(0, tl.cdiv(V, BLOCK_V)):
            cols = i * BLOCK_V + cols0
            mask = cols < V
            z = logits_block(base, bias_ptr, cols, mask, cap, HAS_BIAS, SOFTCAP, True)
            first = tl.minimum(first, tl.where(mask & (z != z), cols, V))
        best_i = tl.min(first, axis=0).to(tl.int64)
    return mx, total, best_i, tl.sum(wz, axis=0)


@triton.jit
def ce_grad_block(
    base,
    bias_ptr,
    cw_ptr,
    cols,
    V,
    t_col,
    a,
    shift,
    log_s,
    lse,
    s_ce,
    s_z,
    w_sum,
    eps_v,
    z_loss,
    cap,
    HAS_BIAS,
    HAS_CW,
    SMOOTH,
    SOFTCAP,
    MASKED: tl.constexpr,
):
    """Pass 2 over one block of a row of V columns (a whole row, or a vocabulary slice): the
    logits' gradient, written over them. p = e^((z − shift) − log S): the whole row passes its max
    and log S, relative to the max as log_softmax (e^(z − lse) has ulp(lse) of error); a slice its
    merged lse and 0. ``t_col``: the target's column, outside [0, V) when it is not in the block's
    row; ``eps_v``: ε / V of the whole vocabulary."""
    mask = cols < V
    z, slope = logits_slope_block(base, bias_ptr, cols, mask, cap, HAS_BIAS, SOFTCAP, MASKED)
    p = tl.exp((z - shift) - log_s)
    g = a * p - tl.where(cols == t_col, a, 0.0)
    if SMOOTH:
        if HAS_CW:
            w_c = load_block(cw_ptr, cols, mask, MASKED).to(tl.float32)
        else:
            w_c = 1.0
        g += eps_v * (p * w_sum - w_c) * s_ce
    g += 2.0 * z_loss * lse * s_z * p
    if SOFTCAP:
        g = g * slope
    g = g.to(base.dtype.element_ty)
    if MASKED:
        tl.store(base + cols, g, mask=mask)
    else:
        tl.store(base + cols, g)
