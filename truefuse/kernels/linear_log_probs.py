"""Triton kernel of one chunk of ``linear_log_probs``: per token (row of the chunk's logits), the
log-probability of its target and the entropy of its distribution, and the gradient of the logits
written in place over them.

With ``u = softcap(z) / temperature``, ``lse = logsumexp(u)``, ``p = softmax(u)``:
``log_prob = u_t − lse`` and ``entropy = lse − Σ_j p_j·u_j``. Pass 1 streams the row in blocks of
BLOCK_V keeping per lane the running max, Σ e^(u−max) and Σ e^(u−max)·(u−max) (rescaled when the
max moves), reduced across lanes once at the end: entropy = log S − R/S. Pass 2 (``WANT_GRAD``) streams it again and
writes, for upstream gradients a (log-prob) and c (entropy),

    g_j = [a·(δ_jt − p_j) − c·p_j·(log p_j + entropy)] / temperature

times softcap's derivative, rounded once to the logits' dtype. Offsets are int64.

Non-finite logits give what the reference's expressions give (``linear_log_probs_ref``:
``log_softmax`` and ``logsumexp − Σ softmax·u`` with 0·log 0 = 0): a NaN or a +inf makes the row's
log-prob, entropy and gradients NaN; a -inf logit (masked) adds 0 to Σ p·u and to the gradient's
entropy term (finite entropy and gradients; a −inf target's log-prob is −inf). Ignored rows: both
outputs 0 (selected, never multiplied by 0), d_logits 0·(...) (NaN only where that is NaN, as
torch's backward through the selection gives).
"""

import triton
import triton.language as tl

from truefuse.kernels._rows import logits_block, logits_slope_block


@triton.jit
def _stats_block(base, bias_ptr, cols, V, cap, temp, m, s, r, HAS_BIAS, SOFTCAP, MASKED: tl.constexpr):
    """Pass 1 over one block of a row: each lane's running max ``m`` of u, Σ e^(u−m) ``s`` and
    Σ e^(u−m)·(u−m) ``r`` (relative to the max: the entropy is log S − R/S, no cancellation
    against |max|). Only a row's last block is ``MASKED`` (its lanes past V add nothing)."""
    mask = cols < V
    u = logits_block(base, bias_ptr, cols, mask, cap, HAS_BIAS, SOFTCAP, MASKED) / temp
    if MASKED:
        u = tl.where(mask, u, float("-inf"))
    up = u > m
    d = tl.where(up, m - u, u - m)
    e = tl.exp(d)  # one exp: the sums are rescaled only when the max moves
    e = tl.where(u == float("-inf"), 0.0, tl.where(u == m, 1.0, e))
    # 0·log 0 = 0 (the reference's, as Categorical's entropy): a −inf logit adds nothing, not
    # 0·(−inf) = NaN; a NaN logit still makes d, e and so the row NaN
    ed = tl.where(u == float("-inf"), 0.0, e * d)
    if MASKED:
        ed = tl.where(mask, ed, 0.0)
    # the max moves to u: the old terms scale by e and their offsets grow by d = m − u
    # (s = 0 before a lane's first finite u: nothing to move, and 0·(−inf) would be NaN)
    r = tl.where(up, e * r + tl.where(s == 0.0, 0.0, s * ed), r + ed)
    s = tl.where(up, s * e + 1.0, s + e)
    m = tl.where(up, u, m)
    return m, s, r


@triton.jit
def _grad_block(base, bias_ptr, cols, V, t_safe, a, c, mx, log_s, ent, cap, temp, HAS_BIAS, SOFTCAP, MASKED: tl.constexpr):
    """Pass 2 over one block of a row: the logits' gradient, written over them."""
    mask = cols < V
    zc, slope = logits_slope_block(base, bias_ptr, cols, mask, cap, HAS_BIAS, SOFTCAP, MASKED)
    lp = (zc / temp - mx) - log_s  # divided, as the reference: no rounding of 1/temperature
    p = tl.exp(lp)
    # p·log p = 0 at a −inf logit (p = 0, lp = −inf): its gradient is a·δ_jt, never NaN
    g = tl.where(cols == t_safe, a, 0.0) - a * p - tl.where(lp == float("-inf"), 0.0, c * p * (lp + ent))
    g = g / temp
    if SOFTCAP:
        g = g * slope
    g = g.to(base.dtype.element_ty)
    if MASKED:
        tl.store(base + cols, g, mask=mask)
    else:
        tl.store(base + cols, g)


@triton.jit(do_not_specialize=["ignore_index"])
def _linear_log_probs_chunk_kernel(
    logits_ptr,
    stride,
    bias_ptr,  # read only with HAS_BIAS: the GEMM wrote the logits without it
    t_ptr,
    lp_ptr,
    ent_ptr,
    a_ptr,  # (C,) upstream gradient of the log-probs, read with WANT_GRAD
    c_ptr,  # (C,) upstream gradient of the entropies, read with WANT_GRAD
    V,
    ignore_index,
    temp,
    cap,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WANT_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
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

    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    r = tl.zeros((BLOCK_V,), tl.float32)
    for i in range(0, n_full):
        m, s, r = _stats_block(base, bias_ptr, i * BLOCK_V + cols0, V, cap, temp, m, s, r, HAS_BIAS, SOFTCAP, False)
    if tail:
        m, s, r = _stats_block(base, bias_ptr, n_full * BLOCK_V + cols0, V, cap, temp, m, s, r, HAS_BIAS, SOFTCAP, True)
    mx = tl.max(m, axis=0)
    # a lane whose max stayed -inf holds s = r = 0 (or NaN after a NaN): as it stands
    keep = (m == mx) | (m == float("-inf"))
    f = tl.where(keep, 1.0, tl.exp(m - mx))
    S = tl.sum(s * f, axis=0)
    R = tl.sum(f * (r + tl.where(keep, 0.0, s * (m - mx))), axis=0)
    # relative to the max throughout, as torch's log_softmax: (u − max) − log S, no cancellation
    # against |max|. log_softmax is NaN on the whole row when its max is not finite (inf − inf)
    # or a logit is NaN: log S carries that NaN into every output.
    log_s = tl.log(S)
    lse = mx + log_s
    log_s = tl.where(tl.abs(lse) < float("inf"), log_s, float("nan"))
    ent = log_s - R / S
    z_t = logits_block(base + t_safe, bias_ptr + t_safe, 0, True, cap, HAS_BIAS, SOFTCAP, False)
    lp = (z_t / temp - mx) - log_s
    # selected, not multiplied by 0: an ignored row never reaches the outputs
    tl.store(lp_ptr + row, tl.where(valid, lp, 0.0))
    tl.store(ent_ptr + row, tl.where(valid, ent, 0.0))

    if WANT_GRAD:
        # an ignored row's upstream gradients are never read (they may be inf or NaN): 0
        a = tl.where(valid, tl.load(a_ptr + row), 0.0)
        c = tl.where(valid, tl.load(c_ptr + row), 0.0)
        for i in range(0, n_full):
            _grad_block(base, bias_ptr, i * BLOCK_V + cols0, V, t_safe, a, c, mx, log_s, ent, cap, temp, HAS_BIAS, SOFTCAP, False)
        if tail:
            _grad_block(
                base, bias_ptr, n_full * BLOCK_V + cols0, V, t_safe, a, c, mx, log_s, ent, cap, temp, HAS_BIAS, SOFTCAP, True
            )
