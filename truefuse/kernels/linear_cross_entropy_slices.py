"""Triton kernels of ``linear_cross_entropy`` over slices of the vocabulary (``memory="lean"``,
and one slice per rank in ``truefuse.distributed.linear_cross_entropy``): one program per token
row of one slice's logits (tokens, Vs), columns [v0, v0 + Vs) of the vocabulary.

``_lce_slice_stats_kernel`` (pass 1) streams the slice's row once with the whole-row kernel's
``ce_row_stats`` (``kernels/_rows.py``: online max and sum of exponentials per lane,
first maximum, Σ w_c·z_c) and writes the slice's statistics: its max ``m``, its sum of
exponentials relative to ``m`` (NaN once a NaN was met), the index of its first maximum (of its
first NaN when the sum is NaN: a second pass over that row only), Σ w_c·z_c (0 without label
smoothing), the target's logit when the target falls in the slice (else 0) and whether it does.
The host merges the slices' statistics in slice order (``ops/lm_head/linear_cross_entropy_slices.py``), as
the whole-row kernel reduces its lanes.

``_lce_slice_grad_kernel`` (pass 2) reads the merged lse of each row and writes the slice's
d_logits over its logits by the whole-row kernel's ``ce_grad_block`` (the target may lie outside the
slice):

    g_j = s_ce·[(1-ε)·w_t·(p_j − δ_jt) + ε/V·(p_j·Σw − w_j)] + s_z·2·z_loss·lse·p_j

times softcap's derivative, rounded once to the logits' dtype. The whole-row kernel's default path
is untouched: both share the jit helpers of ``kernels/_rows.py``.
"""

import triton
import triton.language as tl

from truefuse.kernels._rows import ce_grad_block, ce_row_stats, softcap


@triton.jit(do_not_specialize=["v0"])
def _lce_slice_stats_kernel(
    logits_ptr,
    stride,
    bias_ptr,  # the slice's bias (Vs,), read only with HAS_BIAS
    cw_ptr,  # the slice's class weights (Vs,), read only with HAS_CW and SMOOTH
    t_ptr,
    m_ptr,
    s_ptr,
    arg_ptr,
    wz_ptr,
    zt_ptr,
    has_t_ptr,
    Vs,
    v0,
    cap,
    HAS_BIAS: tl.constexpr,
    HAS_CW: tl.constexpr,
    SMOOTH: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    # the whole-row kernel's pass 1 over the slice (its first NaN when it holds one: torch.argmax's
    # answer when it is the row's first)
    mx, total, best_i, wz_sum = ce_row_stats(base, bias_ptr, cw_ptr, Vs, cap, HAS_BIAS, HAS_CW, SMOOTH, SOFTCAP, BLOCK_V)
    tl.store(m_ptr + row, mx)
    tl.store(s_ptr + row, total)
    tl.store(arg_ptr + row, best_i + v0)
    tl.store(wz_ptr + row, wz_sum)  # 0 without SMOOTH (a sum of zeros)
    # the target's logit, from the slice that holds it (0 in the others), and whether it is here:
    # every output written, so the host allocates them without a zero fill
    t = tl.load(t_ptr + row)
    here = (t >= v0) & (t < v0 + Vs)
    t_loc = tl.where(here, t - v0, 0)
    z_t = tl.load(base + t_loc).to(tl.float32)
    if HAS_BIAS:
        z_t += tl.load(bias_ptr + t_loc).to(tl.float32)
    z_t = softcap(z_t, cap, SOFTCAP)
    tl.store(zt_ptr + row, tl.where(here, z_t, 0.0))
    tl.store(has_t_ptr + row, here)


@triton.jit(do_not_specialize=["ignore_index", "v0"])
def _lce_slice_grad_kernel(
    logits_ptr,
    stride,
    bias_ptr,  # the slice's bias (Vs,), read only with HAS_BIAS
    cw_ptr,  # the whole vocabulary's class weights (V,), read only with HAS_CW
    t_ptr,
    lse_ptr,
    s_ce_ptr,
    s_z_ptr,
    Vs,
    v0,
    V,
    ignore_index,
    w_sum,
    smoothing,
    z_loss,
    cap,
    HAS_BIAS: tl.constexpr,
    HAS_CW: tl.constexpr,
    SMOOTH: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    ok = valid & (t >= 0) & (t < V)
    t_safe = tl.where(ok, t, 0)
    t_loc = tl.where(ok, t - v0, -1)  # outside [0, Vs) when the target is not in this slice
    if HAS_CW:
        w_t = tl.load(cw_ptr + t_safe)
    else:
        w_t = 1.0
    lse = tl.load(lse_ptr + row)
    lse_ce = tl.where(tl.abs(lse) < float("inf"), lse, float("nan"))
    if PER_TOKEN:
        s_ce = tl.load(s_ce_ptr + row)
        s_z = tl.load(s_z_ptr + row)
    else:
        s_ce = tl.load(s_ce_ptr)
        s_z = tl.load(s_z_ptr)
    s_ce = tl.where(valid, s_ce, 0.0)
    s_z = tl.where(valid, s_z, 0.0)
    a = (1.0 - smoothing) * w_t * s_ce
    eps_v = smoothing / V
    cw_slice = cw_ptr + v0
    cols0 = tl.arange(0, BLOCK_V)
    n_full = Vs // BLOCK_V
    for i in range(0, n_full):
        ce_grad_block(
            base,
            bias_ptr,
            cw_slice,
            i * BLOCK_V + cols0,
            Vs,
            t_loc,
            a,
            lse_ce,
            0.0,
            lse_ce,
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
            False,
        )
    if Vs % BLOCK_V != 0:
        ce_grad_block(
            base,
            bias_ptr,
            cw_slice,
            n_full * BLOCK_V + cols0,
            Vs,
            t_loc,
            a,
            lse_ce,
            0.0,
            lse_ce,
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
            True,
        )
