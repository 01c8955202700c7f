"""The cross-entropy over slices of the VOCABULARY (not of the tokens): ``memory="lean"`` of
``linear_cross_entropy``, and the per-rank pass of ``truefuse.distributed.linear_cross_entropy``
(each rank one contiguous slice).

Two passes, every token at once, one vocabulary slice [v0, v1) at a time:

* pass 1 (:func:`stats_pass`): per slice the logits ``x @ W[v0:v1]ᵀ`` (one GEMM into a reused
  (tokens, Vs) buffer), then per token the slice's statistics (:class:`SliceStats`): its max, its
  sum of exponentials relative to that max, Σ w_c·z_c (label smoothing), its first argmax (or
  first NaN), and the target's logit when the target falls in the slice. :func:`merge_stats`
  merges statistics in a fixed order (slice order; rank order across ranks): small (N,) tensors,
  in PyTorch, the same operations as the whole-row kernel's reduction across its lanes.
  :func:`finish_stats` turns the merged statistics into lse, the per-token loss terms and the
  argmax test: the semantics of ``linear_cross_entropy_ref`` (softcap, bias, class weights,
  z-loss, label smoothing, ignore_index, NaN / ±inf as ``ops/linear_cross_entropy.py`` says).
* pass 2 (:func:`grad_pass`): per slice the logits again, d_logits given the merged lse and the
  per-token scales (written over the logits, in their dtype), then d_weight's rows [v0, v1) by ONE
  GEMM over all tokens (fp32 inside, written once in the weight's dtype, or added into an fp32
  ``main_grad``), d_bias's slice (an fp32 sum), and d_input accumulated across slices inside the
  GEMMs (beta=1) into an fp32 (tokens, H) buffer, which the caller rounds once (or all-reduces).

Each slice's logits are one GEMM with the bias in its epilogue, into a contiguous (tokens, Vs)
tensor (``F.linear``'s rounding: the plain path's logits). Slices are multiples of ``ALIGN`` = 64
classes but for a last one of fewer than 64 (an odd vocabulary's remainder: the other GEMMs stay
on cuBLAS's aligned kernels).

Where the slice kernels run (``kernels/linear_cross_entropy_slices.py``: CUDA, fp32 under the CPU
interpreter), they compute the statistics and d_logits; elsewhere (fp64, bf16 on the CPU) the
same math in PyTorch (:func:`slice_stats_math`, :func:`slice_grad_math`).

Memory above the returned gradients: one slice's logits (the ``slice_bytes`` tuning knob, 256 MiB)
plus the fp32 (tokens, H) d_input buffer plus O(tokens) statistics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from truefuse.config import get_tuning
from truefuse.ops._custom_op import custom_op, launch
from truefuse.ops._dtypes import wgrad_dtype, wide_dtype
from truefuse.ops._triton import triton_runs
from truefuse.ops.gemm import gemm
from truefuse.ops.linear_cross_entropy import LinearCrossEntropyOptions

#: Slices are multiples of this many classes (but for an odd vocabulary's last < ALIGN classes).
ALIGN = 64


def default_slice_width(N: int, V: int, itemsize: int, budget: int | None = None) -> int:
    """Classes per vocabulary slice when the caller gives none: the largest multiple of
    :data:`ALIGN` whose (N, width) logits fit in ``budget`` bytes (default: the ``slice_bytes``
    tuning knob, 256 MiB: 16384 classes of 8192 bf16 tokens), at least ALIGN, at most V
    rounded up to ALIGN. It depends on N: lean does not promise batch invariance (the slices'
    partial sums, and so the bits, depend on where the vocabulary is cut)."""
    budget = get_tuning().slice_bytes if budget is None else budget
    fit = budget // (max(N, 1) * itemsize) // ALIGN * ALIGN
    return max(ALIGN, min(fit, -(-V // ALIGN) * ALIGN))


def slice_bounds(V: int, width: int) -> list[tuple[int, int]]:
    """The slices [v0, v1) of a vocabulary of V classes: ``width`` each over V rounded down to
    :data:`ALIGN` (the last of those may be narrower), then the < ALIGN remaining classes."""
    if width < 1:
        raise ValueError(f"vocabulary slice width must be positive, got {width}")
    aligned = V // ALIGN * ALIGN if V > ALIGN else V
    bounds = [(v0, min(v0 + width, aligned)) for v0 in range(0, aligned, width)]
    if aligned < V:
        bounds.append((aligned, V))
    return bounds


class SliceStats(NamedTuple):
    """Per-token statistics of a slice of the vocabulary (or of several, merged), each (N,).

    Attributes:
        m: the max of the slice's logits (after bias and softcap), NaN never counted (-inf when
            none is above -inf), wide dtype.
        s: Σ exp(z − m) over the slice (exp(−inf) = 0, and a +inf maximum counts 1); NaN once
            the slice holds a NaN.
        arg: int64 global index of the slice's first maximum; of its first NaN when ``s`` is NaN.
        wz: Σ w_c·z_c (label smoothing; zeros without it).
        zt: the target's logit (after bias and softcap) where ``has_t``; 0 elsewhere.
        has_t: bool, whether the target falls in the slice(s).
    """

    m: torch.Tensor
    s: torch.Tensor
    arg: torch.Tensor
    wz: torch.Tensor
    zt: torch.Tensor
    has_t: torch.Tensor


def merge_stats(parts: list[SliceStats]) -> SliceStats:
    """Merge slices' statistics in the order given (slice order; across ranks, rank order):
    the whole-row kernel's reduction across its lanes, with slices for lanes. Σ s_i·e^(m_i − M)
    and Σ wz_i run left to right, so every caller merging the same parts gets the same bits."""
    if len(parts) == 1:
        return parts[0]
    M = parts[0].m
    for p in parts[1:]:
        M = torch.maximum(M, p.m)  # m is never NaN: exact, in any order
    total = wz = zt = None
    has_t = torch.zeros_like(parts[0].has_t)
    best = torch.full_like(parts[0].arg, -1)
    for p in parts:
        # a part whose max stayed -inf keeps its sum (0, or NaN after a NaN), as the kernel's lanes
        scaled = torch.where((p.m == M) | (p.m == float("-inf")), p.s, p.s * torch.exp(p.m - M))
        total = scaled if total is None else total + scaled
        wz = p.wz if wz is None else wz + p.wz
        zt = torch.where(p.has_t, p.zt, 0.0 if zt is None else zt)
        has_t = has_t | p.has_t
        best = torch.where((best < 0) & (p.m == M), p.arg, best)  # the first part holding the max
    first_nan = torch.full_like(best, -1)
    for p in parts:
        first_nan = torch.where((first_nan < 0) & p.s.isnan(), p.arg, first_nan)
    best = torch.where(first_nan >= 0, first_nan, best)  # torch.argmax: the first NaN
    return SliceStats(M, total, best, wz, zt, has_t)


class Terms(NamedTuple):
    """Per-token results of the merged statistics: ``ce``, ``zl`` (wide), ``correct`` (bool) and
    ``lse`` (torch.logsumexp's: ±inf with a ±inf max, NaN with a NaN), each (N,)."""

    ce: torch.Tensor
    zl: torch.Tensor
    correct: torch.Tensor
    lse: torch.Tensor


def finish_stats(st: SliceStats, t, cw, opts: LinearCrossEntropyOptions, V: int, w_sum: float) -> Terms:
    """lse and the per-token loss terms from the whole vocabulary's merged statistics, as the
    whole-row kernel computes them (``kernels/linear_cross_entropy.py``)."""
    log_s = torch.log(st.s)
    lse = st.m + log_s
    # F.cross_entropy's log_softmax is NaN on a row whose max is ±inf or that holds a NaN
    lse_ce = torch.where(lse.isfinite(), lse, torch.nan)
    valid = t != opts.ignore_index
    w_t = cw[torch.where(valid & (t >= 0) & (t < V), t, 0)] if cw is not None else 1.0
    # (max − z_t) + log S, as log_softmax: lse − z_t cancels to ulp(lse) for a confident token
    ce = w_t * torch.where(lse.isfinite(), (st.m - st.zt) + log_s, torch.nan)
    eps = opts.label_smoothing
    if eps > 0:
        ce = (1.0 - eps) * ce + eps / V * (w_sum * lse_ce - st.wz)
    # selected, not multiplied by 0: an ignored row's inf / NaN logits must not reach the loss
    ce = torch.where(valid, ce, 0.0)
    zl = torch.where(valid, opts.z_loss * lse * lse, 0.0)
    return Terms(ce, zl, (st.arg == t) & valid, lse)


def class_weight_sum(cw: torch.Tensor | None, V: int, opts: LinearCrossEntropyOptions) -> float:
    """Σ w_c over the vocabulary, read with label smoothing only (a host sync, before the passes,
    only when class weights and label smoothing are both asked for); V without class weights."""
    return float(cw.sum()) if cw is not None and opts.label_smoothing > 0 else float(V)


def _slice_logits(x, W, b, v0, v1):
    """The slice's logits ``x @ W[v0:v1]ᵀ + b[v0:v1]`` (N, v1 - v0): one GEMM, the bias in its
    epilogue (``F.linear``'s rounding: once, after the bias), into a new contiguous tensor. The
    caller drops a slice's logits before the next's are made: one slice alive at a time."""
    return gemm(x, W[v0:v1].t(), bias=None if b is None else b[v0:v1])


def stats_pass(
    opts: LinearCrossEntropyOptions,
    x: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None,
    t: torch.Tensor,
    cw: torch.Tensor | None,
    *,
    width: int,
    v_offset: int = 0,
    check=None,
) -> SliceStats:
    """Pass 1 over the slices of ``W`` (Vw, H): their statistics, merged in slice order.

    Args:
        x: (N, H) input. W: (Vw, H) the weight (a rank's shard of the vocabulary, rows
            [v_offset, v_offset + Vw) of it). b: (Vw,) or None. t: (N,) int64 global targets.
        cw: the whole vocabulary's (V,) class weights in the wide dtype, or None.
        width: classes per slice (:func:`default_slice_width`).
        check: ``check_targets``' finish: called after the kernels are queued, before the
            PyTorch path indexes with the targets.
    """
    N, Vw = x.shape[0], W.shape[0]
    wide = wide_dtype(x)
    kernel = triton_runs(x)
    if not kernel and check is not None:
        check()
    smooth = opts.label_smoothing > 0
    parts = []
    logits = None
    for v0, v1 in slice_bounds(Vw, width):
        logits = None  # the previous slice's logits go before this slice's are made
        logits = _slice_logits(x, W, b, v0, v1)
        g0 = v_offset + v0
        cws = None if cw is None else cw[g0 : g0 + v1 - v0]
        if kernel:
            parts.append(slice_stats_kernel(logits, None, cws if smooth else None, t, g0, opts))
        else:
            z = logits.to(wide)
            if opts.softcap is not None:
                z = opts.softcap * torch.tanh(z / opts.softcap)
            parts.append(slice_stats_math(z, t, cws, g0, smooth))
    if kernel and check is not None:
        check()
    if not parts:  # no slice: only an empty vocabulary shard (a rank holding no class)
        ninf = torch.full((N,), float("-inf"), dtype=wide, device=x.device)
        zeros = torch.zeros(N, dtype=wide, device=x.device)
        arg = torch.full((N,), v_offset, dtype=torch.int64, device=x.device)
        return SliceStats(ninf, zeros, arg, zeros, zeros, torch.zeros(N, dtype=torch.bool, device=x.device))
    return merge_stats(parts)


def slice_stats_math(z: torch.Tensor, t: torch.Tensor, cw: torch.Tensor | None, v0: int, smooth: bool) -> SliceStats:
    """The statistics of one slice in PyTorch, from its (N, Vs) wide logits after bias and
    softcap (columns [v0, v0 + Vs) of the vocabulary; ``cw`` the slice's class weights)."""
    N, Vs = z.shape
    m = torch.where(z.isnan(), float("-inf"), z).amax(-1)
    e = torch.exp(z - m[:, None])
    # e^-inf = 0 (also when m is -inf), e^0 = 1 for z == m (+inf included); NaN stays NaN
    e = torch.where(z == float("-inf"), 0.0, torch.where(z == m[:, None], 1.0, e))
    s = e.sum(-1)
    arg = z.argmax(-1) + v0  # torch.argmax: the first NaN, else the first maximum
    if smooth:
        wz = z @ cw.to(z.dtype) if cw is not None else z.sum(-1)
    else:
        wz = torch.zeros(N, dtype=z.dtype, device=z.device)
    has_t = (t >= v0) & (t < v0 + Vs)
    zt = z.gather(1, torch.where(has_t, t - v0, 0)[:, None]).squeeze(1)
    return SliceStats(m, s, arg, wz, torch.where(has_t, zt, 0.0), has_t)


def slice_stats_kernel(logits, bias, cw, t, v0: int, opts: LinearCrossEntropyOptions) -> SliceStats:
    """:func:`slice_stats_math` for one slice in one Triton kernel, from its (N, Vs) logits in
    the input dtype (rows of ``logits.stride(0)`` elements; bias (Vs,) added in fp32 by the
    kernel; ``cw`` the slice's fp32 class weights, read with label smoothing only)."""
    N, Vs = logits.shape
    wide = wide_dtype(logits)
    m = torch.empty(N, dtype=wide, device=logits.device)
    s = torch.empty(N, dtype=wide, device=logits.device)
    arg = torch.empty(N, dtype=torch.int64, device=logits.device)
    wz = torch.zeros(N, dtype=wide, device=logits.device)
    zt = torch.zeros(N, dtype=wide, device=logits.device)
    smooth = opts.label_smoothing > 0
    launch(lce_slice_stats_op, logits, bias, cw, t, m, s, arg, wz, zt, v0, opts.softcap, smooth)
    return SliceStats(m, s, arg, wz, zt, (t >= v0) & (t < v0 + Vs))


def _block_v(logits: torch.Tensor) -> int:
    return 2048 if logits.is_cuda else 64


@custom_op("truefuse::lce_slice_stats", mutates_args=("m", "s", "arg", "wz", "zt"))
def lce_slice_stats_op(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    cw: torch.Tensor | None,
    t: torch.Tensor,
    m: torch.Tensor,
    s: torch.Tensor,
    arg: torch.Tensor,
    wz: torch.Tensor,
    zt: torch.Tensor,
    v0: int,
    softcap: float | None,
    smooth: bool,
) -> None:
    """The launch of :func:`slice_stats_kernel` as a custom op (docs/design.md §6.7): writes the
    slice's ``m``, ``s``, ``arg``, ``wz`` (with ``smooth``) and ``zt`` where the target is in it."""
    from truefuse.kernels.linear_cross_entropy_slices import _lce_slice_stats_kernel

    N, Vs = logits.shape
    if N == 0 or Vs == 0:
        return
    _lce_slice_stats_kernel[(N,)](
        logits, logits.stride(0), bias if bias is not None else logits, cw if cw is not None else m, t, m, s, arg, wz,
        zt, Vs, v0, softcap or 1.0, HAS_BIAS=bias is not None, HAS_CW=cw is not None, SMOOTH=smooth,
        SOFTCAP=softcap is not None, BLOCK_V=_block_v(logits), num_warps=8,
    )  # fmt: skip


@lce_slice_stats_op.register_fake
def _(logits, bias, cw, t, m, s, arg, wz, zt, v0, softcap, smooth):
    return None


class Grads(NamedTuple):
    """What :func:`grad_pass` returns (None where not asked for).

    Attributes:
        dx: (N, H) wide (fp32, fp64 for fp64): the sum over this call's slices, not rounded (the
            caller rounds it once, or all-reduces it first).
        dW: (Vw, H) in ``wgrad_dtype`` (the weight's where a GEMM writes it), or None when it
            went to ``main_grad``.
        db: (Vw,) wide.
    """

    dx: torch.Tensor | None
    dW: torch.Tensor | None
    db: torch.Tensor | None


def grad_pass(
    opts: LinearCrossEntropyOptions,
    x: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None,
    t: torch.Tensor,
    cw: torch.Tensor | None,
    lse: torch.Tensor,
    s_ce: torch.Tensor,
    s_z: torch.Tensor,
    *,
    V: int,
    w_sum: float,
    width: int,
    want: tuple[bool, bool, bool],
    v_offset: int = 0,
    w_dtype: torch.dtype | None = None,
    main_grad: torch.Tensor | None = None,
    accumulate: bool = False,
) -> Grads:
    """Pass 2 over the slices of ``W`` (Vw, H): d_logits from the merged ``lse`` (N,), then the
    gradients asked for in ``want`` (d_input, d_weight, d_bias).

    Args:
        V: the whole vocabulary's size (label smoothing's ε/V, the targets' range).
        s_ce, s_z: 0-dim or (N,) scales of the cross-entropy and z-loss gradients (the
            reduction's, times the upstream gradient), device tensors.
        w_dtype: the weight parameter's dtype (default ``W``'s; under autocast ``W`` is its cast
            copy): d_weight's GEMMs write ``wgrad_dtype(x.dtype, w_dtype)``.
        main_grad: add (``accumulate``; else write) d_weight's rows into this fp32 (Vw, H) tensor
            instead of returning it.
    Other arguments as :func:`stats_pass`.
    """
    N, H = x.shape
    Vw = W.shape[0]
    wide = wide_dtype(x)
    gx, gw, gb = want
    kernel = triton_runs(x)
    w_dtype = W.dtype if w_dtype is None else w_dtype
    dx = torch.zeros(N, H, dtype=wide, device=x.device) if gx else None  # zeros: a shard may hold no class
    dW = None
    if gw and main_grad is None:
        dW = torch.empty(Vw, H, dtype=wgrad_dtype(x.dtype, w_dtype), device=x.device)
    db = torch.zeros(Vw, dtype=wide, device=x.device) if gb else None
    if not (gx or gw or gb):
        return Grads(None, None, None)
    if N == 0:  # no tokens: zero gradients; main_grad gets nothing (written with zeros when overwritten)
        if dW is not None:
            dW.zero_()
        elif gw and not accumulate:
            main_grad.zero_()
        return Grads(dx, dW, db)
    d = logits = None
    for i, (v0, v1) in enumerate(slice_bounds(Vw, width)):
        d = logits = None  # the previous slice's go before this slice's are made
        logits = _slice_logits(x, W, b, v0, v1)
        g0 = v_offset + v0
        if kernel:
            d = slice_grad_kernel(logits, None, cw, t, lse, s_ce, s_z, g0, V, w_sum, opts)
        else:
            z = logits.to(wide)
            if opts.softcap is not None:
                z = opts.softcap * torch.tanh(z / opts.softcap)
            cws = None if cw is None else cw[g0 : g0 + v1 - v0]
            g = slice_grad_math(z, t, cw, cws, lse, s_ce, s_z, g0, V, w_sum, opts)
            d = logits.copy_(g)  # rounded once to the logits' dtype, as the kernel writes them
        if gb:
            db[v0:v1] = torch.sum(d, dim=0, dtype=wide)
        if gx:
            gemm(d, W[v0:v1], out=dx, accumulate=i > 0)  # fp32 inside and across slices (beta=1)
        if gw:
            out = main_grad[v0:v1] if main_grad is not None else dW[v0:v1]
            gemm(d.t(), x, out=out, accumulate=main_grad is not None and accumulate)
    return Grads(dx, dW, db)


def slice_grad_math(z, t, cw, cw_slice, lse, s_ce, s_z, v0: int, V: int, w_sum: float, opts):
    """The d_logits of one slice in PyTorch (wide), from its (N, Vs) wide logits after bias and
    softcap and the merged ``lse``; the whole-row ``chunk_math``'s gradient, the target possibly
    outside the slice. ``cw``: the whole vocabulary's class weights, ``cw_slice`` the slice's."""
    N, Vs = z.shape
    valid = t != opts.ignore_index
    ok = valid & (t >= 0) & (t < V)
    lse_ce = torch.where(lse.isfinite(), lse, torch.nan)
    w_t = cw[torch.where(ok, t, 0)] if cw is not None else torch.ones_like(lse)
    eps = opts.label_smoothing
    p = torch.exp(z - lse_ce[:, None])
    a = (1 - eps) * w_t
    g = p * a[:, None]
    here = ok & (t >= v0) & (t < v0 + Vs)
    # -a at the target's column, only where the target is in the slice (adding -0.0 elsewhere)
    g.scatter_add_(1, torch.where(here, t - v0, 0)[:, None], torch.where(here, -a, -0.0)[:, None])
    if eps > 0:
        g += eps / V * (p * w_sum - (cw_slice[None, :] if cw_slice is not None else 1.0))
    # s_ce, s_z: 0-dim or (N,); an ignored row's are 0 whatever its upstream (inf, NaN): 0·p
    g *= torch.where(valid, s_ce, 0.0)[:, None]
    if opts.z_loss:
        g += (2 * opts.z_loss * lse_ce * torch.where(valid, s_z, 0.0))[:, None] * p
    if opts.softcap is not None:
        g *= 1 - (z / opts.softcap).square()
    return g


def slice_grad_kernel(logits, bias, cw, t, lse, s_ce, s_z, v0: int, V: int, w_sum: float, opts):
    """:func:`slice_grad_math` in one Triton kernel, written over ``logits`` (N, Vs) in their
    dtype; returns them. ``cw``: the whole vocabulary's fp32 class weights, or None."""
    launch(
        lce_slice_grad_op, logits, bias, cw, t, lse, s_ce, s_z, v0, V, opts.ignore_index, float(w_sum),
        opts.label_smoothing, opts.z_loss, opts.softcap,
    )  # fmt: skip
    return logits


@custom_op("truefuse::lce_slice_grad", mutates_args=("logits",))
def lce_slice_grad_op(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    cw: torch.Tensor | None,
    t: torch.Tensor,
    lse: torch.Tensor,
    s_ce: torch.Tensor,
    s_z: torch.Tensor,
    v0: int,
    V: int,
    ignore_index: int,
    w_sum: float,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
) -> None:
    """The launch of :func:`slice_grad_kernel` as a custom op (docs/design.md §6.7): the slice's
    d_logits written over ``logits``."""
    from truefuse.kernels.linear_cross_entropy_slices import _lce_slice_grad_kernel

    N, Vs = logits.shape
    if N == 0 or Vs == 0:
        return
    _lce_slice_grad_kernel[(N,)](
        logits, logits.stride(0), bias if bias is not None else logits, cw if cw is not None else lse, t, lse,
        s_ce.contiguous(), s_z.contiguous(), Vs, v0, V, ignore_index, w_sum, label_smoothing, z_loss, softcap or 1.0,
        HAS_BIAS=bias is not None, HAS_CW=cw is not None, SMOOTH=label_smoothing > 0, SOFTCAP=softcap is not None,
        PER_TOKEN=s_ce.dim() == 1, BLOCK_V=_block_v(logits), num_warps=8,
    )  # fmt: skip


@lce_slice_grad_op.register_fake
def _(logits, bias, cw, t, lse, s_ce, s_z, v0, V, ignore_index, w_sum, label_smoothing, z_loss, softcap):
    return None
