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
  z-loss, label smoothing, ignore_index, NaN / ±inf as ``ops/lm_head/linear_cross_entropy.py`` says).
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

Memory above the returned gradients: one slice's logits plus the fp32 (tokens, H) d_input buffer
(less the d_input returned) plus O(tokens) statistics: within :data:`LEAN_PEAK` (560 MiB) by
default (:func:`default_slice_width`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from truefuse.config import get_tuning
from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops._launch.dtypes import wgrad_dtype, wide_dtype
from truefuse.ops._launch.triton import triton_runs
from truefuse.ops.gemm.gemm import plain_gemm
from truefuse.ops.lm_head.linear_cross_entropy import LinearCrossEntropyOptions

#: Slices are multiples of this many classes (but for an odd vocabulary's last < ALIGN classes).
ALIGN = 64


#: memory="lean"'s peak beyond its returned gradients when the caller gives H: one slice's logits
#: plus the fp32 (N, H) d_input buffer less the d_input it returns (N·H in the input dtype), 0.6
#: GB (572 MiB, the issue's goal) less 12 MiB for the O(N) statistics and GEMM workspaces.
LEAN_PEAK = 560 << 20


def default_slice_width(N: int, V: int, itemsize: int, budget: int | None = None, H: int = 0) -> int:
    """Classes per vocabulary slice when the caller gives none: the largest multiple of
    :data:`ALIGN` whose (N, width) logits fit in ``budget`` bytes (default: the ``slice_bytes``
    tuning knob, 256 MiB: 16384 classes of 8192 bf16 tokens), at least ALIGN, at most V
    rounded up to ALIGN. It depends on N: lean does not promise batch invariance (the slices'
    partial sums, and so the bits, depend on where the vocabulary is cut).

    With ``H`` (lean's own call; the vocabulary-parallel loss passes none) the budget is what
    :data:`LEAN_PEAK` leaves beside the d_input buffer when that is more, and the slices are
    evened out (as few, each as wide): every slice adds a pass over the fp32 d_input buffer in
    its d_input GEMM (beta=1, 2·N·H·4 bytes), so fewer slices cost less time. H200, bf16, forward +
    backward against the default (``experiments/exp_lce_rule_lean.py`` at d49a912, docs/log/benchmarks_2026-11.md):
    8192 x 128256 x 4096 in 8 slices of 16384 1.353x, in 5 of 25664 1.343x (465 MiB); 16384 x
    128256 x 4096 in 16 of 8192 1.352x, in 10 of 12864 1.337x (530 MiB)."""
    budget = get_tuning().slice_bytes if budget is None else budget
    if H:
        budget = max(budget, LEAN_PEAK - N * H * (4 - itemsize))
    fit = budget // (max(N, 1) * itemsize) // ALIGN * ALIGN
    width = max(ALIGN, min(fit, -(-V // ALIGN) * ALIGN))
    if H and V > ALIGN:
        aligned = V // ALIGN * ALIGN
        n = -(-aligned // width)  # slices of the aligned classes; then ceil(aligned / n) up to ALIGN
        width = -(-aligned // (n * ALIGN)) * ALIGN
    return width


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
    return merge_stacked(SliceStats(*(torch.stack(f) for f in zip(*parts, strict=True))))


def merge_stacked(st: SliceStats, smooth: bool = True) -> SliceStats:
    """:func:`merge_stats` of P parts stacked: each field (P, N), part i in row i. The same bits
    in a few kernels over (P, N) instead of a dozen per part: the max is exact in any order, the
    two sums run over the rows left to right, and the first part holding the max (the target, the
    first NaN) is an argmax over the rows. ``smooth=False``: every ``wz`` is 0 (not summed)."""
    if st.m.shape[0] == 1:
        return SliceStats(*(f[0] for f in st))
    M = st.m.amax(0)  # m is never NaN: exact
    # a part whose max stayed -inf keeps its sum (0, or NaN after a NaN), as the kernel's lanes
    scaled = torch.where((st.m == M) | (st.m == float("-inf")), st.s, st.s * torch.exp(st.m - M))
    total, wz = scaled[0], st.wz[0]
    for i in range(1, scaled.shape[0]):
        total = total + scaled[i]
        if smooth:
            wz = wz + st.wz[i]

    def first(mask: torch.Tensor) -> torch.Tensor:  # per token, the first part where mask holds (0: none)
        return mask.to(torch.uint8).argmax(0, keepdim=True)

    # the target falls in one part at most (the parts are disjoint); none: 0
    has_t = st.has_t.any(0)
    zt = torch.where(has_t, st.zt.gather(0, first(st.has_t)).squeeze(0), 0.0)
    best = st.arg.gather(0, first(st.m == M)).squeeze(0)  # the first part holding the max
    nan = st.s.isnan()
    best = torch.where(nan.any(0), st.arg.gather(0, first(nan)).squeeze(0), best)  # torch.argmax: the first NaN
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


def _slice_logits(x, W, b, v0, v1, bi: bool):
    """The slice's logits ``x @ W[v0:v1]ᵀ + b[v0:v1]`` (N, v1 - v0): one GEMM, the bias in its
    epilogue (``F.linear``'s rounding: once, after the bias), into a new contiguous tensor. The
    caller drops a slice's logits before the next's are made: one slice alive at a time."""
    return plain_gemm(x, W[v0:v1].t(), None if b is None else b[v0:v1], batch_invariant=bi, dtensors_refused=True)


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
    keep: list | None = None,
    keep_bytes: int = 0,
    batch_invariant: bool,
) -> SliceStats:
    """Pass 1 over the slices of ``W`` (Vw, H): their statistics, merged in slice order.

    Args:
        x: (N, H) input. W: (Vw, H) the weight (a rank's shard of the vocabulary, rows
            [v_offset, v_offset + Vw) of it). b: (Vw,) or None. t: (N,) int64 global targets.
        cw: the whole vocabulary's (V,) class weights in the wide dtype, or None.
        width: classes per slice (:func:`default_slice_width`).
        check: ``check_targets``' finish: called after the kernels are queued, before the
            PyTorch path indexes with the targets.
        keep, keep_bytes: with a list, slice i's logits are appended to it while the kept ones
            take at most ``keep_bytes`` (else None is appended): :func:`grad_pass` then uses
            them instead of a GEMM (the same GEMM's bits), one GEMM fewer per kept slice.
        batch_invariant: the mode the caller's forward read, for every GEMM of the pass.
    """
    N, Vw = x.shape[0], W.shape[0]
    wide = wide_dtype(x)
    kernel = triton_runs(x)
    if not kernel and check is not None:
        check()
    smooth = opts.label_smoothing > 0
    bounds = slice_bounds(Vw, width)
    if not bounds:  # no slice: only an empty vocabulary shard (a rank holding no class)
        ninf = torch.full((N,), float("-inf"), dtype=wide, device=x.device)
        zeros = torch.zeros(N, dtype=wide, device=x.device)
        arg = torch.full((N,), v_offset, dtype=torch.int64, device=x.device)
        return SliceStats(ninf, zeros, arg, zeros, zeros, torch.zeros(N, dtype=torch.bool, device=x.device))
    # the kernels write each slice's statistics into row i of (P, N) buffers: no allocation, zero
    # fill or mask per slice, and a merge over stacked rows (merge_stacked)
    stacked = _stats_buffers((len(bounds), N), wide, x.device)
    logits = None
    for i, (v0, v1) in enumerate(bounds):
        logits = None  # the previous slice's logits go before this slice's are made
        logits = _slice_logits(x, W, b, v0, v1, batch_invariant)
        if keep is not None:
            fits = logits.numel() * logits.element_size() <= keep_bytes
            keep.append(logits if fits else None)
            keep_bytes -= logits.numel() * logits.element_size() if fits else 0
        g0 = v_offset + v0
        cws = None if cw is None else cw[g0 : g0 + v1 - v0]
        if kernel:
            slice_stats_kernel(logits, None, cws if smooth else None, t, g0, opts, into=SliceStats(*(f[i] for f in stacked)))
        else:
            z = logits.to(wide)
            if opts.softcap is not None:
                z = opts.softcap * torch.tanh(z / opts.softcap)
            for f, v in zip(stacked, slice_stats_math(z, t, cws, g0, smooth), strict=True):
                f[i] = v
    if kernel and check is not None:
        check()
    return merge_stacked(stacked, smooth)


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


def _stats_buffers(shape: tuple[int, ...], wide: torch.dtype, device) -> SliceStats:
    """Uninitialised :class:`SliceStats` of ``shape`` for the kernel to write (it writes every element)."""
    dtypes = (wide, wide, torch.int64, wide, wide, torch.bool)
    return SliceStats(*(torch.empty(shape, dtype=d, device=device) for d in dtypes))


def slice_stats_kernel(
    logits, bias, cw, t, v0: int, opts: LinearCrossEntropyOptions, into: SliceStats | None = None
) -> SliceStats:
    """:func:`slice_stats_math` for one slice in one Triton kernel, from its (N, Vs) logits in
    the input dtype (rows of ``logits.stride(0)`` elements; bias (Vs,) added in fp32 by the
    kernel; ``cw`` the slice's fp32 class weights, read with label smoothing only). ``into``: the
    (N,) tensors to write (every element is written), else new ones."""
    N = logits.shape[0]
    wide = wide_dtype(logits)
    if into is None:
        into = _stats_buffers((N,), wide, logits.device)
    launch(lce_slice_stats_op, logits, bias, cw, t, *into, v0, opts.softcap, opts.label_smoothing > 0)
    return into


def _block_v(logits: torch.Tensor) -> int:
    return 2048 if logits.is_cuda else 64


@custom_op("truefuse::lce_slice_stats", mutates_args=("m", "s", "arg", "wz", "zt", "has_t"))
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
    has_t: torch.Tensor,
    v0: int,
    softcap: float | None,
    smooth: bool,
) -> None:
    """The launch of :func:`slice_stats_kernel` as a custom op (docs/design.md §6.7): writes the
    slice's ``m``, ``s``, ``arg``, ``wz`` (0 without ``smooth``), ``zt`` (0 where the target is
    not in it) and ``has_t``."""
    from truefuse.kernels.linear_cross_entropy_slices import _lce_slice_stats_kernel

    N, Vs = logits.shape
    if N == 0:
        return
    if Vs == 0:  # no class: nothing above -inf
        m.fill_(float("-inf")), s.zero_(), arg.fill_(v0), wz.zero_(), zt.zero_(), has_t.zero_()
        return
    _lce_slice_stats_kernel[(N,)](
        logits,
        logits.stride(0),
        bias if bias is not None else logits,
        cw if cw is not None else m,
        t,
        m,
        s,
        arg,
        wz,
        zt,
        has_t,
        Vs,
        v0,
        softcap or 1.0,
        HAS_BIAS=bias is not None,
        HAS_CW=cw is not None,
        SMOOTH=smooth,
        SOFTCAP=softcap is not None,
        BLOCK_V=_block_v(logits),
        num_warps=8,
    )


@lce_slice_stats_op.register_fake
def _(logits, bias, cw, t, m, s, arg, wz, zt, has_t, v0, softcap, smooth):
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
    kept: list | None = None,
    batch_invariant: bool,
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
        kept: :func:`stats_pass`'s ``keep`` list: a slice's kept logits take the place of its
            GEMM and are consumed (d_logits are written over them; the entry becomes None, so a
            second pass, delayed or repeated, runs the GEMM again: the same bits).
    Other arguments as :func:`stats_pass`.
    """
    N, H = x.shape
    Vw = W.shape[0]
    wide = wide_dtype(x)
    gx, gw, gb = want
    kernel = triton_runs(x)
    w_dtype = W.dtype if w_dtype is None else w_dtype
    bounds = slice_bounds(Vw, width)
    # the first slice's GEMM writes it (beta=0); zeros only for a shard holding no class
    dx = (torch.empty if bounds else torch.zeros)(N, H, dtype=wide, device=x.device) if gx else None
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
    for i, (v0, v1) in enumerate(bounds):
        d = logits = None  # the previous slice's go before this slice's are made
        if kept is not None and i < len(kept) and kept[i] is not None:
            logits, kept[i] = kept[i], None
        else:
            logits = _slice_logits(x, W, b, v0, v1, batch_invariant)
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
            # fp32 inside and across slices (beta=1)
            plain_gemm(d, W[v0:v1], out=dx, accumulate=i > 0, batch_invariant=batch_invariant, dtensors_refused=True)
        if gw:
            out = main_grad[v0:v1] if main_grad is not None else dW[v0:v1]
            plain_gemm(
                d.t(), x, out=out, accumulate=main_grad is not None and accumulate, batch_invariant=batch_invariant,
                dtensors_refused=True,
            )  # fmt: skip
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
        lce_slice_grad_op,
        logits,
        bias,
        cw,
        t,
        lse,
        s_ce,
        s_z,
        v0,
        V,
        opts.ignore_index,
        float(w_sum),
        opts.label_smoothing,
        opts.z_loss,
        opts.softcap,
    )
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
        logits,
        logits.stride(0),
        bias if bias is not None else logits,
        cw if cw is not None else lse,
        t,
        lse,
        s_ce.contiguous(),
        s_z.contiguous(),
        Vs,
        v0,
        V,
        ignore_index,
        w_sum,
        label_smoothing,
        z_loss,
        softcap or 1.0,
        HAS_BIAS=bias is not None,
        HAS_CW=cw is not None,
        SMOOTH=label_smoothing > 0,
        SOFTCAP=softcap is not None,
        PER_TOKEN=s_ce.dim() == 1,
        BLOCK_V=_block_v(logits),
        num_warps=8,
    )


@lce_slice_grad_op.register_fake
def _(logits, bias, cw, t, lse, s_ce, s_z, v0, V, ignore_index, w_sum, label_smoothing, z_loss, softcap):
    return None
