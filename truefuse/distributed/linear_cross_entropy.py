"""Vocab-parallel linear cross-entropy: ``truefuse.distributed.linear_cross_entropy``.

Each rank holds a contiguous slice of the vocabulary's rows of the LM head (Megatron's layout:
rank r holds [vocab_start_r, vocab_start_r + V_r), the shards in rank order tiling [0, V)) and
the same input and targets. It is ``memory="lean"``'s sliced machinery
(``ops/lm_head/linear_cross_entropy_slices.py``) with one slice per rank:

* pass 1, local: the shard's per-token statistics (max, sum of exponentials, Σ w_c·z_c, first
  argmax, the target's logit where the rank owns the target), over sub-slices of the shard;
* ONE all-gather of the small (N, 6) statistics per call, merged in rank order on every rank
  (``merge_stats``): identical bits everywhere; lse, the loss terms and the accuracy follow;
* pass 2, local (in the backward): the shard's d_logits from the merged lse (over the logits
  pass 1 kept, up to V_r·H·4 bytes with ``memory="default"``, else computed again), d_weight's and
  d_bias's shard rows, and this rank's fp32 partial sum of d_input, summed over the ranks with
  the arithmetic of truefuse's bitwise ``allreduce`` (rank-order fp32 sum, one rounding; fp64
  summed in fp64), as a reduce-scatter then an all-gather of the rounded blocks (``_sum_over_ranks``).

Every eager call first agrees on the arguments across ranks (ONE ``all_gather_object`` of each
rank's verdict, process group, shard size and target range; ``distributed/_agree.py``): bad input
on any rank, a target outside [0, V) included, or ranks that passed different groups, is the same
``ValueError`` on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from truefuse.autograd._autocast import autocast_disabled
from truefuse.autograd._chunked_head import recompute_backward, weight_state
from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.autograd._modes import Modes
from truefuse.autograd._wgrad import WgradState, check_main_grad
from truefuse.distributed._agree import gather_verdicts, problem_of, raise_disagreement, raise_problems
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops.lm_head.chunked_head import HeadGrads
from truefuse.ops.lm_head.linear_cross_entropy import (
    LinearCrossEntropyOptions,
    LinearCrossEntropyOutput,
    check_args,
    reduce_terms,
    reduction_scales,
    token_accuracy,
    upstream_scales,
    valid_count,
)
from truefuse.ops.lm_head.linear_cross_entropy_slices import (
    SliceStats,
    class_weight_sum,
    default_slice_width,
    finish_stats,
    grad_pass,
    merge_stats,
    stats_pass,
)

_OWNER = "distributed.linear_cross_entropy"


def _gather_stats(st: SliceStats, group) -> SliceStats:
    """Every rank's statistics, merged in rank order: one all-gather of an (N, 6) fp64 tensor
    (m, s, wz, zt: fp32 or fp64 values, exact in fp64; arg and has_t: integers < 2⁵³)."""
    wide = st.m.dtype
    packed = torch.stack([st.m.double(), st.s.double(), st.arg.double(), st.wz.double(), st.zt.double(), st.has_t.double()], 1)
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, packed.contiguous(), group=group)
    stats = [
        SliceStats(p[:, 0].to(wide), p[:, 1].to(wide), p[:, 2].long(), p[:, 3].to(wide), p[:, 4].to(wide), p[:, 5] != 0)
        for p in parts
    ]
    return merge_stats(stats)


def _sum_over_ranks(dx: torch.Tensor, group, out_dtype: torch.dtype) -> torch.Tensor:
    """The ranks' partial d_input (N, H), fp32 or fp64, summed in rank order and rounded to
    ``out_dtype`` once, the same bits on every rank (docs/design.md §4's allreduce arithmetic).

    A reduce-scatter by hand, then an all-gather: rank r receives every rank's rows of its block
    (one ``all_to_all_single``), sums them in rank order, rounds, and the rounded blocks are
    gathered. A rank receives one (N, H) fp32 buffer (128 MiB at 8192 × 4096), where an all-gather
    of the partials would take one per rank, and the second collective moves ``out_dtype``."""
    world = dist.get_world_size(group)
    if world == 1:
        return dx.to(out_dtype)
    n, h = dx.shape
    block = -(-n // world)
    if block * world != n:  # equal blocks for the collectives: zero rows, cut off at the end
        dx = torch.cat([dx, dx.new_zeros(block * world - n, h)])
    got = torch.empty_like(dx)
    dist.all_to_all_single(got, dx.contiguous(), group=group)  # got[r·block:(r+1)·block] = rank r's rows of my block
    parts = got.view(world, block, h)
    mine = parts[0].clone()
    for p in parts[1:]:
        mine += p
    mine = mine.to(out_dtype)
    blocks = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(blocks, mine, group=group)
    return torch.cat(blocks)[:n]


class VocabParallelLinearCrossEntropyFunction(torch.autograd.Function):
    """Inputs: x (N, H), this rank's W shard (V_r, H), its bias shard or None, targets (N,),
    the whole vocabulary's class weights (V,) or None, the options, the slice width, the §2 state,
    the group, vocab_start, V and how many bytes of the shard's logits to keep for the backward.
    Backward as ``LinearCrossEntropyLeanFunction`` (over the kept logits where there are), with
    d_input's partial sums reduced over the ranks."""

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, W, b, t, cw, opts: LinearCrossEntropyOptions, width, wstate, group, vocab_start, V, keep_bytes):
        wide = wide_dtype(x)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        deferred = wstate is not None and not wstate.plain and needs[1]
        valid = t != opts.ignore_index
        n = valid_count(valid, wide)
        s_ce, s_z = reduction_scales(opts.reduction, n, t, cw, opts.ignore_index, x)
        w_sum = class_weight_sum(cw, V, opts)
        # the shard's logits kept for the backward up to keep_bytes: a GEMM fewer per kept slice
        ctx.kept = [] if any(needs) and keep_bytes > 0 else None
        ctx.modes = Modes.now()  # the shard's GEMMs, forward and backward (docs/design.md §1)
        local = stats_pass(
            opts,
            x,
            W,
            b,
            t,
            cw,
            width=width,
            v_offset=vocab_start,
            keep=ctx.kept,
            keep_bytes=keep_bytes,
            batch_invariant=ctx.modes.batch_invariant,
        )
        terms = finish_stats(_gather_stats(local, group), t, cw, opts, V, w_sum)
        total, z_part = reduce_terms(terms.ce, terms.zl, opts.reduction, (s_ce, s_z))
        acc = token_accuracy(terms.correct, n).to(wide)
        ctx.opts, ctx.width, ctx.needs, ctx.wstate, ctx.deferred = opts, width, needs, wstate, deferred
        ctx.w_sum, ctx.group, ctx.vocab_start, ctx.V, ctx.b_dtype = w_sum, group, vocab_start, V, None if b is None else b.dtype
        if any(needs):
            ctx.save_for_backward(x, W, b, t, cw, s_ce, s_z, terms.lse)
        ctx.mark_non_differentiable(z_part, acc)
        return total, z_part, acc

    @staticmethod
    @autocast_disabled
    @refuses_double_backward("distributed.linear_cross_entropy", "truefuse.linear_cross_entropy_ref on the gathered weight")
    def backward(ctx, g_loss, g_z, g_acc):
        x, W, b, t, cw, s_ce, s_z, lse = ctx.saved_tensors
        # delayed: copied, since backward_dw() reads it after this backward returned
        delayed = ctx.deferred and ctx.wstate.delay_wgrad_compute
        s_ce, s_z = upstream_scales(ctx.opts.reduction, g_loss, s_ce, s_z, x, delayed)
        opts, group = ctx.opts, ctx.group
        kw = {"V": ctx.V, "w_sum": ctx.w_sum, "width": ctx.width, "v_offset": ctx.vocab_start, "w_dtype": W.dtype}

        def run(want, main_grad=None, accumulate=False):
            dx, dW, db = grad_pass(
                opts,
                x,
                W,
                b,
                t,
                cw,
                lse,
                s_ce,
                s_z,
                want=want,
                main_grad=main_grad,
                accumulate=accumulate,
                kept=ctx.kept,
                batch_invariant=ctx.modes.batch_invariant,
                **kw,
            )
            if dx is not None:  # every rank runs this pass (the ranks agreed on what needs a gradient)
                dx = _sum_over_ranks(dx, group, x.dtype)  # one rounding after the rank-order sum
            return HeadGrads(dx, dW, db, None)

        dx, dW, db = recompute_backward(run, ctx.needs, ctx.wstate, W, ctx.b_dtype)
        return dx, dW, db, None, None, None, None, None, None, None, None, None


def _target_summary(t: torch.Tensor, ignore_index: int) -> tuple[int, tuple[int, int] | None]:
    """(a position-weighted sum of the targets, (min, max) of those not ignored or None): what the
    ranks compare and what the range check needs, read with one host sync."""
    valid = t != ignore_index
    big = torch.iinfo(torch.int64).max
    pos = torch.arange(1, t.numel() + 1, device=t.device)
    lo = torch.where(valid, t, big).amin() if t.numel() else t.new_tensor(big)
    hi = torch.where(valid, t, -big).amax() if t.numel() else t.new_tensor(-big)
    total, lo, hi = torch.stack([(t * pos).sum(), lo, hi]).tolist()
    return total, (None if lo > hi else (lo, hi))


def _vocabulary(everyone: list, ignore_index: int) -> tuple[int, list[int]]:
    """The vocabulary's size and the ranks' first classes from the gathered (V_r, vocab_start,
    target range, class weights' shape), or the same ValueError on every rank: shards that do not
    tile [0, V) in rank order, a target outside it, class weights not of shape (V,)."""
    sizes = [e[0] for _, _, e in everyone]
    given = [e[1] for _, _, e in everyone]
    V = sum(sizes)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]  # the shards tile [0, V) in rank order
    problems: list = [None] * len(everyone)
    for r, (_, _, (_, start, t_range, cw_shape)) in enumerate(everyone):
        if start is None and len(set(sizes)) > 1:
            msg = f"vocab_start is None but the shards differ in size ({sizes}): give each rank's vocab_start"
        elif start is not None and given != starts:
            msg = f"the shards must tile the vocabulary in rank order: vocab_start {given}, sizes {sizes}"
        elif t_range is not None and (t_range[0] < 0 or t_range[1] >= V):
            bad = t_range[1] if t_range[1] >= V else t_range[0]
            msg = f"target holds {bad}, outside [0, {V}) and not ignore_index={ignore_index}"
        elif cw_shape is not None and cw_shape != (V,):
            msg = f"weight must have shape ({V},) (one per class of the whole vocabulary), got {cw_shape}"
        else:
            continue
        problems[r] = ("ValueError", msg)
    raise_problems(_OWNER, problems)
    return V, starts


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight_shard: torch.Tensor,
    target: torch.Tensor,
    *,
    group=None,
    vocab_start: int | None = None,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    memory: str = "default",
    vocab_slice: int | None = None,
    fuse_wgrad_accumulation: bool = False,
    wgrad_state: WgradState | None = None,
):
    """``truefuse.linear_cross_entropy`` with the LM head's vocabulary split over the ranks of ``group``.

    Args:
        input: (..., H) hidden states, the same on every rank (fp16 / bf16 / fp32 / fp64).
        linear_weight_shard: (V_r, H), rows [vocab_start, vocab_start + V_r) of the LM head, the
            input's dtype. The shards tile the vocabulary in rank order (Megatron's layout).
        target: (...) global class indices in [0, V) or ``ignore_index``, the same on every rank
            (checked: targets that differ are the same ``ValueError`` on every rank).
        group: the process group (None: the default group), the same on every rank (another group
            over the same ranks is a ValueError on every rank; docs/design.md §4).
        vocab_start: this rank's first class; default rank · V_r (equal shards, required then).
        linear_bias: (V_r,) this rank's shard of the bias, or None.
        weight: (V,) class weights of the whole vocabulary (the same on every rank), or None.
        reduction, ignore_index, label_smoothing, z_loss, softcap, return_z_loss,
        return_token_accuracy: as :func:`truefuse.linear_cross_entropy`.
        memory: ``"default"``: the forward keeps the shard's logits for the backward, up to the
            V_r·H·4 bytes the one-GPU loss's fp32 weight-gradient accumulator would take (all of
            them at 8192 tokens × 64128 × 4096 in bf16): three GEMMs per rank. ``"lean"``: none
            kept, the backward computes them again (four GEMMs, one slice's logits alive at a
            time). The same bits either way.
        vocab_slice: classes per sub-slice of this rank's shard (default: the largest multiple of
            64 whose logits over all tokens take at most 256 MiB).
        fuse_wgrad_accumulation, wgrad_state: the shard's weight gradient under docs/design.md §2
            (``main_grad`` is the shard's, (V_r, H) fp32).

    Returns:
        What :func:`truefuse.linear_cross_entropy` returns, with the same bits on every rank.
        Differentiable in ``input`` (summed over the ranks: the same d_input everywhere), in the
        weight shard and the bias shard (this rank's rows). Bounded against the single-process
        loss on the gathered weight, not bitwise equal to it (the vocabulary is cut elsewhere).

    Raises:
        TypeError / ValueError naming the argument, on every rank when any rank's input is bad
        (a target outside [0, V) included) or the ranks disagree; never a hang.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"{_OWNER} needs an initialised process group (torch.distributed.init_process_group)")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    opts = LinearCrossEntropyOptions(
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
        memory="lean",
        vocab_slice=vocab_slice,
    )
    V_r = linear_weight_shard.shape[0] if isinstance(linear_weight_shard, torch.Tensor) else -1
    # this rank's own checks, then ONE host all-gather of the verdicts, the shard sizes and what
    # the vocabulary-wide checks need; every rank decides those from the same gathered data
    problem = None
    if memory not in ("default", "lean"):
        problem = ("ValueError", f"memory must be 'default' or 'lean', got {memory!r}")
    problem = problem or problem_of(
        # DTensors refused at the door: the head's GEMMs below do not refuse them again
        lambda: refuse_dtensor(
            "distributed.linear_cross_entropy",
            input=input,
            linear_weight_shard=linear_weight_shard,
            target=target,
            linear_bias=linear_bias,
        ),
        lambda: check_args(input, linear_weight_shard, target, linear_bias, None),
    )
    t, t_sum, t_range = None, None, None
    if problem is None:
        t = target.reshape(-1).to(torch.int64)
        t_sum, t_range = _target_summary(t, opts.ignore_index)
    try:
        wgrad_state = weight_state(fuse_wgrad_accumulation, wgrad_state)
    except ValueError as e:
        problem = problem or ("ValueError", str(e))
    if problem is None and wgrad_state is not None and wgrad_state.fuse_wgrad_accumulation:
        if torch.is_grad_enabled() and linear_weight_shard.requires_grad:
            try:  # here, before any collective of the loss: a missing main_grad on one rank must not hang the others
                check_main_grad(linear_weight_shard, "linear_weight_shard")
            except (RuntimeError, TypeError, ValueError) as e:
                problem = ("ValueError" if isinstance(e, ValueError) else type(e).__name__, str(e))
    needs_x = isinstance(input, torch.Tensor) and torch.is_grad_enabled() and input.requires_grad
    desc = (
        # the targets must be the same on every rank (each owns some classes of every token): a
        # position-weighted sum of them, one int (wrapping in int64: deterministic), compared
        ("targets", t_sum),
        ("input shape", tuple(input.shape) if isinstance(input, torch.Tensor) else None),
        ("input dtype", str(getattr(input, "dtype", None))),
        ("input requires grad", needs_x),
        ("bias", linear_bias is not None),
        ("options", opts),
    )
    cw_shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else (None if weight is None else type(weight).__name__)
    everyone = gather_verdicts(group, _OWNER, problem, desc, (V_r, vocab_start, t_range, cw_shape))
    raise_problems(_OWNER, [p for p, _, _ in everyone])
    V, starts = _vocabulary(everyone, opts.ignore_index)
    raise_disagreement(_OWNER, [d for _, d, _ in everyone])
    start = starts[rank]
    x = input.reshape(-1, input.shape[-1])
    cw = None if weight is None else weight.detach().to(wide_dtype(input))
    width = opts.vocab_slice or default_slice_width(x.shape[0], V_r, x.element_size())
    keep_bytes = V_r * x.shape[1] * 4 if memory == "default" else 0
    loss, z_part, acc = VocabParallelLinearCrossEntropyFunction.apply(
        x, linear_weight_shard, linear_bias, t, cw, opts, width, wgrad_state, group, start, V, keep_bytes
    )
    if opts.reduction == "none":
        loss, z_part = loss.view(target.shape), z_part.view(target.shape)
    if not opts.extras:
        return loss
    return LinearCrossEntropyOutput(loss, z_part if opts.return_z_loss else None, acc if opts.return_token_accuracy else None)
