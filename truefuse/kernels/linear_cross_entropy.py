"""Triton kernel of one chunk of ``linear_cross_entropy``: per token (row of the chunk's logits),
the loss terms, and the gradient of the logits written in place over them.

Pass 1 streams the row in blocks of BLOCK_V: online max and sum of exponentials (fp32) per lane,
the argmax, Σ_c w_c·z_c for label smoothing, reduced across lanes once at the end. Every block but
a row's last loads and stores without a mask (16-byte vectors; a masked access with V unknown
mod 16 cannot be vectorised: 3.3 ms instead of 1.9 at 8192 x 128256 bf16 on the H200). Pass 2
(``WANT_GRAD``) streams it again and writes

    g_j = s_ce·[(1-ε)·w_t·(p_j − δ_jt) + ε/V·(p_j·Σw − w_j)] + s_z·2·z_loss·lse·p_j

times softcap's derivative, rounded once to the logits' dtype. ``s_ce`` / ``s_z`` are the
reduction's scales (or the per-token upstream gradient), read from device memory so that no host
synchronisation is needed. Offsets are int64 (tokens × V passes 2³¹).

Non-finite logits give what ``F.cross_entropy`` / ``torch.logsumexp`` / ``torch.argmax`` give
(``linear_cross_entropy_ref``): a NaN makes its lane's sum NaN for good and the row's lse NaN;
the cross-entropy and p_j use lse where it is finite and NaN where it is ±inf (log_softmax is NaN
on such a row), the z-loss uses torch.logsumexp's ±inf; the argmax is the first maximum, or the
first NaN (found by a second pass over that row alone). Ignored rows: loss terms 0 (selected, never
multiplied by 0), d_logits 0·p_j (torch's 0 − exp(log_softmax)·0: NaN only where that is NaN).

``HAS_BIAS``: the logits were written without the bias and the kernel adds it in fp32 as it reads
them (the vocabulary-split GEMMs of ``ops/lm_head/chunked_head_gemms.py``, where cuBLAS would
add it after rounding the product). ``stride`` may exceed V (rows padded to 16-byte multiples).
The passes over a row are the jit helpers of ``kernels/_rows.py`` (shared with the slice kernels).
"""

import triton
import triton.language as tl

from truefuse.kernels._rows import ce_grad_block, ce_row_stats, softcap


@triton.jit(do_not_specialize=["ignore_index"])
def _linear_cross_entropy_chunk_kernel(
    logits_ptr,
    stride,
    bias_ptr,  # read only with HAS_BIAS: the GEMM wrote the logits without it
    t_ptr,
    cw_ptr,
    ce_ptr,
    zl_ptr,
    ok_ptr,
    pred_ptr,  # written only with WANT_PRED: the row's argmax (return_predicted_tokens)
    s_ce_ptr,
    s_z_ptr,
    V,  # specialized (divisible by 16 or not) like ``stride``: the vector loads need to know
    ignore_index,
    w_sum,
    smoothing,
    z_loss,
    cap,
    HAS_BIAS: tl.constexpr,
    HAS_CW: tl.constexpr,
    SMOOTH: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WANT_GRAD: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    BLOCK_V: tl.constexpr,
    WANT_PRED: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    # a target outside [0, V) reads column 0, not memory outside the row: the host's check of the
    # targets (which raises) may finish after this kernel ran
    t_safe = tl.where(valid & (t >= 0) & (t < V), t, 0)
    cols0 = tl.arange(0, BLOCK_V)
    n_full = V // BLOCK_V
    tail = V % BLOCK_V != 0
    mx, total, best_i, wz_sum = ce_row_stats(base, bias_ptr, cw_ptr, V, cap, HAS_BIAS, HAS_CW, SMOOTH, SOFTCAP, BLOCK_V)
    # torch.logsumexp: +inf with a +inf logit, -inf when every logit is -inf, NaN with a NaN
    log_s = tl.log(total)
    lse = mx + log_s
    # F.cross_entropy's log_softmax is NaN on the whole row when its max is not finite (z - max
    # gives inf - inf) or a logit is NaN: the loss and the gradients use this lse, NaN there
    finite = tl.abs(lse) < float("inf")
    lse_ce = tl.where(finite, lse, float("nan"))
    log_s = tl.where(finite, log_s, float("nan"))
    z_t = tl.load(base + t_safe).to(tl.float32)
    if HAS_BIAS:
        z_t += tl.load(bias_ptr + t_safe).to(tl.float32)
    z_t = softcap(z_t, cap, SOFTCAP)
    if HAS_CW:
        w_t = tl.load(cw_ptr + t_safe)
    else:
        w_t = 1.0
    # (max − z_t) + log S, as log_softmax keeps it: lse − z_t cancels to ulp(lse) for a confident
    # token (fp32 loss 117x the plain path's error at logits (5, 0), tests/test_properties.py)
    ce = w_t * ((mx - z_t) + log_s)
    if SMOOTH:
        ce = (1.0 - smoothing) * ce + smoothing / V * (w_sum * lse_ce - wz_sum)
    # selected, not multiplied by 0: an ignored row's logits are never part of the loss (an
    # inf or NaN there must not make it NaN, as it does not in torch)
    tl.store(ce_ptr + row, tl.where(valid, ce, 0.0))
    tl.store(zl_ptr + row, tl.where(valid, z_loss * lse * lse, 0.0))
    tl.store(ok_ptr + row, (best_i == t) & valid)
    if WANT_PRED:  # every row, ignored or not: torch.argmax of its logits
        tl.store(pred_ptr + row, best_i)

    if WANT_GRAD:
        if PER_TOKEN:
            s_ce = tl.load(s_ce_ptr + row)
            s_z = tl.load(s_z_ptr + row)
        else:
            s_ce = tl.load(s_ce_ptr)
            s_z = tl.load(s_z_ptr)
        # An ignored row's upstream gradient is never read (it may be inf or NaN under ``none``):
        # its scales are 0, so its d_logits are 0·p, as torch's log_softmax backward gives them
        # (0 − exp(out)·0): 0, or NaN on a row whose log_softmax is NaN (lse_ce NaN, p NaN)
        s_ce = tl.where(valid, s_ce, 0.0)
        s_z = tl.where(valid, s_z, 0.0)
        a = (1.0 - smoothing) * w_t * s_ce
        for i in range(0, n_full):
            ce_grad_block(
                base,
                bias_ptr,
                cw_ptr,
                i * BLOCK_V + cols0,
                V,
                t_safe,
                a,
                mx,
                log_s,
                lse_ce,
                s_ce,
                s_z,
                w_sum,
                smoothing / V,
                z_loss,
                cap,
                HAS_BIAS,
                HAS_CW,
                SMOOTH,
                SOFTCAP,
                False,
            )
        if tail:
            ce_grad_block(
                base,
                bias_ptr,
                cw_ptr,
                n_full * BLOCK_V + cols0,
                V,
                t_safe,
                a,
                mx,
                log_s,
                lse_ce,
                s_ce,
                s_z,
                w_sum,
                smoothing / V,
                z_loss,
                cap,
                HAS_BIAS,
                HAS_CW,
                SMOOTH,
                SOFTCAP,
                True,
            )


@triton.jit(do_not_specialize=["N", "ignore_index"])
def _lce_targets_kernel(t_ptr, out_ptr, N, V, ignore_index, BLOCK: tl.constexpr):
    """One program over the N targets, before the chunks: ``out`` = [n, 1/n, 1, bad] in fp32, with n
    the number of targets that count (at least 1: a divisor) and ``bad`` 1 when one of them lies
    outside [0, V). The count is an integer sum (exact in any order), n its rounding to fp32 and 1/n
    an IEEE division: the bits of ``valid.sum().clamp(min=1).float()`` and ``torch.reciprocal``."""
    cols = tl.arange(0, BLOCK)
    cnt = tl.zeros((BLOCK,), tl.int64)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, N, BLOCK):
        offs = start + cols
        inside = offs < N
        t = tl.load(t_ptr + offs, mask=inside, other=ignore_index)
        valid = inside & (t != ignore_index)
        cnt += valid.to(tl.int64)
        bad = tl.maximum(bad, (valid & ((t < 0) | (t >= V))).to(tl.int32))
    n = tl.maximum(tl.sum(cnt, axis=0), 1).to(tl.float32)
    tl.store(out_ptr, n)
    tl.store(out_ptr + 1, tl.math.div_rn(1.0, n))
    tl.store(out_ptr + 2, 1.0)
    tl.store(out_ptr + 3, tl.max(bad, axis=0).to(tl.float32))
