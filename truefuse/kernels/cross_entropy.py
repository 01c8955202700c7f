"""Triton kernel of one chunk of ``linear_cross_entropy``: per token (row of the chunk's logits),
the loss terms, and the gradient of the logits written in place over them.

Pass 1 streams the row in blocks of BLOCK_V: online max and sum of exponentials (fp32), the
argmax, Σ_c w_c·z_c for label smoothing. Pass 2 (``WANT_GRAD``) streams it again and writes

    g_j = s_ce·[(1-ε)·w_t·(p_j − δ_jt) + ε/V·(p_j·Σw − w_j)] + s_z·2·z_loss·lse·p_j

times softcap's derivative, rounded once to the logits' dtype (zero on ignored rows). ``s_ce`` /
``s_z`` are the reduction's scales (or the per-token upstream gradient), read from device memory
so that no host synchronisation is needed. Offsets are int64 (tokens × V passes 2³¹).
"""

import triton
import triton.language as tl


@triton.jit
def _tanh(y):
    """tanh in fp32 without the cancellation of 2σ(2y) − 1 near 0: an odd Taylor polynomial for
    |y| < 0.1 (truncation < 1e-10), (1 − e^{−2|y|}) / (1 + e^{−2|y|}) with the sign above."""
    a = tl.abs(y)
    y2 = y * y
    small = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.1, small, tl.where(y < 0, -big, big))


@triton.jit
def _softcap(x, cap, SOFTCAP: tl.constexpr):
    if SOFTCAP:
        x = cap * _tanh(x / cap)
    return x


@triton.jit(do_not_specialize=["V", "ignore_index"])
def _lce_chunk_kernel(
    logits_ptr,
    stride,
    t_ptr,
    cw_ptr,
    ce_ptr,
    zl_ptr,
    ok_ptr,
    s_ce_ptr,
    s_z_ptr,
    V,
    ignore_index,
    w_sum,
    smoothing,
    z_loss,
    cap,
    HAS_CW: tl.constexpr,
    SMOOTH: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WANT_GRAD: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    t_safe = tl.where(valid, t, 0)
    cols0 = tl.arange(0, BLOCK_V)

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    wz = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        mask = cols < V
        z = _softcap(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), cap, SOFTCAP)
        z = tl.where(mask, z, float("-inf"))
        blk_max = tl.max(z, axis=0)
        new_m = tl.maximum(m, blk_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), axis=0)
        m = new_m
        blk_i = tl.argmax(z, axis=0)
        if blk_max > best:  # strictly greater: the first maximum wins, as torch.argmax
            best = blk_max
            best_i = v0 + blk_i.to(tl.int64)
        if SMOOTH:
            if HAS_CW:
                wz += tl.sum(tl.where(mask, z * tl.load(cw_ptr + cols, mask=mask, other=0.0), 0.0), axis=0)
            else:
                wz += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(s)
    z_t = _softcap(tl.load(base + t_safe).to(tl.float32), cap, SOFTCAP)
    if HAS_CW:
        w_t = tl.load(cw_ptr + t_safe)
    else:
        w_t = 1.0
    ce = w_t * (lse - z_t)
    if SMOOTH:
        ce = (1.0 - smoothing) * ce + smoothing / V * (w_sum * lse - wz)
    vf = tl.where(valid, 1.0, 0.0)
    tl.store(ce_ptr + row, ce * vf)
    tl.store(zl_ptr + row, z_loss * lse * lse * vf)
    tl.store(ok_ptr + row, (best_i == t) & valid)

    if WANT_GRAD:
        if PER_TOKEN:
            s_ce = tl.load(s_ce_ptr + row) * vf
            s_z = tl.load(s_z_ptr + row) * vf
        else:
            s_ce = tl.load(s_ce_ptr) * vf
            s_z = tl.load(s_z_ptr) * vf
        a = (1.0 - smoothing) * w_t * s_ce
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + cols0
            mask = cols < V
            z = _softcap(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), cap, SOFTCAP)
            p = tl.exp(z - lse)
            g = a * p - tl.where(cols == t_safe, a, 0.0)
            if SMOOTH:
                if HAS_CW:
                    w_c = tl.load(cw_ptr + cols, mask=mask, other=0.0)
                else:
                    w_c = 1.0
                g += smoothing / V * (p * w_sum - w_c) * s_ce
            g += 2.0 * z_loss * lse * s_z * p
            if SOFTCAP:
                g = g * (1.0 - (z / cap) * (z / cap))
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)
