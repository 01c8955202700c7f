"""``truefuse.linear_cross_entropy``: the LM head and its cross-entropy without materializing the
(tokens, V) logits: the autograd Function and the functional API.

The work runs on the chunked LM head (``ops/lm_head/chunked_head.py``) with the cross-entropy as its
per-chunk loss (``ops/lm_head/linear_cross_entropy_chunk.py``). For ``mean`` and ``sum`` the gradients are
computed in the forward (when grad is enabled) and the first backward scales them in place by
``grad_output`` and hands them over (a later backward, under ``retain_graph``, recomputes them
from the saved inputs); ``none`` (a per-token upstream gradient) recomputes the chunks in the
backward instead.
"""

from __future__ import annotations

import functools

import torch

from truefuse.autograd._autocast import as_cast, autocast_disabled, autocast_dtype, cast
from truefuse.autograd._chunked_head import chunk_for, in_dtypes, recompute_backward, weight_state
from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.autograd._modes import Modes
from truefuse.autograd._wgrad import WgradState, check_main_grad, deliver_weight_grad
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops.lm_head.chunked_head import HeadGrads, head_chunks, kept_weight_grad
from truefuse.ops.lm_head.linear_cross_entropy import (
    LinearCrossEntropyOptions,
    LinearCrossEntropyOutput,
    check_args,
    chunk_size_from,
    reduce_terms,
    target_prologue,
    token_accuracy,
    upstream_scales,
)
from truefuse.ops.lm_head.linear_cross_entropy_chunk import CrossEntropyChunks
from truefuse.ops.lm_head.linear_cross_entropy_slices import (
    class_weight_sum,
    default_slice_width,
    finish_stats,
    grad_pass,
    stats_pass,
)
from truefuse.ops.scale import scale_


def _run(opts, chunk, x, W, b, t, cw, s_ce, s_z, want, *, check=None, **head) -> tuple[CrossEntropyChunks, HeadGrads]:
    """One pass of the cross-entropy over the head's chunks: (its per-token outputs, the gradients)."""
    loss = CrossEntropyChunks(opts, W.shape[0], t, cw, s_ce, s_z, like=x, check=check)
    return loss, head_chunks(loss, x, W, b, chunk=chunk, want=want, fp32_weight_grad=opts.fp32_weight_grad, **head)


def _outputs(opts, ce, zl, correct, n, s_ce, s_z, wide):
    """The Function's outputs (loss, z part, accuracy) from the per-token terms. The z part and the
    accuracy are computed only when asked for (the z part also with a z-loss, which the loss
    holds): otherwise ``n`` stands in for them, never returned to the caller."""
    total, z_part = reduce_terms(ce, zl, opts.reduction, (s_ce, s_z), with_z=opts.z_loss > 0 or opts.return_z_loss)
    acc = token_accuracy(correct, n).to(wide) if opts.return_token_accuracy else n  # the chunks mark valid tokens only
    return total, n.view(()) if z_part is None else z_part, acc


def _predicted(opts, pred: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """The Function's predicted-tokens output: each token's argmax when asked for, else an empty
    stand-in (an output must be a tensor; never returned to the caller)."""
    return pred if opts.return_predicted_tokens else t.new_empty(0)


def _upstream(g_loss, reduction: str, x: torch.Tensor) -> torch.Tensor:
    """The loss's upstream gradient, or zeros where autograd passed None (the Functions do not
    materialize gradients, for the z part's and the accuracy's sake: None means nothing flowed
    into the loss)."""
    if g_loss is not None:
        return g_loss
    return torch.zeros(x.shape[0] if reduction == "none" else (), dtype=wide_dtype(x), device=x.device)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Inputs: x (N, H), W (V, H), bias (V,) or None, target (N,), class weight (V,) wide or None,
    the options, the chunk size, the weight's docs/design.md §2 state (None: plain), the autocast
    dtype (None outside autocast) and the call's :class:`Modes` (read once by the functional, which
    chose the chunk size by it; kept on ``ctx.modes`` for the backward's GEMMs). Under autocast x
    arrives cast, the GEMMs take W and the bias cast likewise (``_autocast``), and their gradients
    come back in the parameters' dtypes, the weight's accumulated in fp32 and rounded once.

    Under fused ``main_grad`` accumulation or a delayed weight gradient (docs/design.md §2) the
    weight gradient is left to the backward, where ``grad_output`` is known (``main_grad`` holds
    other contributions: it can only be added to once, already scaled). With one chunk the forward
    keeps the chunk's d_logits for it: the backward scales them and the one GEMM runs then (or in
    ``backward_dw()``). With several chunks, or with ``none``, the chunks are recomputed: in the
    backward's pass (fused) or in ``backward_dw()`` (delayed, after the backward's pass for
    d_input and d_bias).

    Repeated backward (``retain_graph``): a returned gradient is never written by this function
    afterwards (autograd may have made it a leaf's ``.grad``). The forward's gradients serve the
    first backward only; every later one recomputes them from the saved inputs (x, W, bias,
    targets, class weights, scales), the same bits, scaled by its own ``grad_output``. Saving x
    keeps the input alive until the graph is freed (N·H elements, where nothing else holds it)."""

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, W, b, t, cw, opts: LinearCrossEntropyOptions, chunk: int, wstate: WgradState | None, dtype, modes: Modes):
        wide = wide_dtype(x)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        deferred = wstate is not None and not wstate.plain and needs[1]  # fused and/or delayed
        if deferred and wstate.fuse_wgrad_accumulation:
            check_main_grad(W, "linear_weight")  # a clear error now, not in the backward
        # the parameter (for §2 and the gradients' dtypes); the GEMMs take W and b cast under autocast
        Wp, ctx.b_dtype = W, None if b is None else b.dtype
        W, b = cast(W, dtype), cast(b, dtype)
        # Few small kernels around the loop (each is a launch between the GEMMs; torch.compile
        # fuses its own): the count of the valid tokens, mean's scales and the target check in one
        # kernel (target_prologue; its check is finished by the loss), no z-loss sum without a
        # z-loss, no accuracy unless asked for.
        n, s_ce, s_z, checked = target_prologue(t, W.shape[0], opts.ignore_index, opts.reduction, cw, x)
        # one chunk: its d_logits serve the weight's GEMM (no tokens: no chunk, nothing to keep)
        keep_d = deferred and 0 < x.shape[0] <= chunk
        now = opts.reduction != "none" and any(needs) and (not deferred or keep_d)
        want = (needs[0], needs[1] and not deferred, needs[2]) if now else (False, False, False)
        ctx.modes = modes  # the backward takes the forward's path (docs/design.md §1)
        head = {"keep_d": keep_d and now, "w_dtype": Wp.dtype, "batch_invariant": modes.batch_invariant}
        loss, grads = _run(opts, chunk, x, W, b, t, cw, s_ce, s_z, want, check=checked, **head)
        total, z_part, acc = _outputs(opts, loss.ce, loss.zl, loss.correct, n, s_ce, s_z, wide)
        pred = _predicted(opts, loss.pred, t)
        ctx.opts, ctx.chunk, ctx.needs, ctx.now, ctx.wstate, ctx.deferred = opts, chunk, needs, now, wstate, deferred
        ctx.want, ctx.keep_d, ctx.grads = want, keep_d, None
        if now:
            # Plain attributes, not saved tensors: the first backward scales them in place and
            # hands them to autograd (dx may become the leaf's .grad, the same storage), which may
            # then write them; ctx forgets them there, so nothing here reads them again and no
            # saved-tensor version check trips on that write.
            ctx.grads = in_dtypes(grads, Wp.dtype, ctx.b_dtype)
        if any(needs):
            # what a later backward (retain_graph) recomputes from; references, not copies (W and
            # Wp are one tensor outside autocast)
            ctx.save_for_backward(x, W, b, t, cw, s_ce, s_z, Wp)
        ctx.mark_non_differentiable(z_part, acc, pred)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for the z part and the accuracy
        return total, z_part, acc, pred

    @staticmethod
    @autocast_disabled
    @refuses_double_backward("linear_cross_entropy", "truefuse.linear_cross_entropy_ref")
    def backward(ctx, g_loss, g_z, g_acc, g_pred):
        g_loss = _upstream(g_loss, ctx.opts.reduction, ctx.saved_tensors[0])
        dx, dW, db = _backward_kept(ctx, g_loss) if ctx.now else _backward_recompute(ctx, g_loss)
        return dx, dW, db, None, None, None, None, None, None, None


def _backward_kept(ctx, g_loss):
    """The gradients the forward computed, scaled in place by ``grad_output``.

    A factor of 1 (the usual grad_output) costs no pass over them and no host sync (ops/scale.py;
    the pass took 2.2 ms of 44 at 8192 x 128256 x 4096 on the H200). The first backward takes the
    forward's and ctx lets go of them: autograd owns what it gets (a leaf's .grad may be dx
    itself, which later accumulations write in place), and the delayed weight GEMM holds d alone.
    A later backward (retain_graph) recomputes them from the saved inputs as the forward did (the
    same bits), then scales them by its own grad_output likewise."""
    x, W, b, t, cw, s_ce, s_z, Wp = ctx.saved_tensors
    if ctx.grads is not None:
        grads, ctx.grads = ctx.grads, None
    else:
        head = {"keep_d": ctx.keep_d, "w_dtype": Wp.dtype, "batch_invariant": ctx.modes.batch_invariant}
        grads = in_dtypes(_run(ctx.opts, ctx.chunk, x, W, b, t, cw, s_ce, s_z, ctx.want, **head)[1], Wp.dtype, ctx.b_dtype)
    g = g_loss.to(wide_dtype(g_loss))
    for tensor in grads:
        if tensor is not None:
            scale_(tensor, g)
    dx, dW, db, d = grads
    if ctx.deferred:  # one chunk kept its d_logits: the weight's one GEMM, now or in backward_dw()
        compute = functools.partial(kept_weight_grad, d, x, Wp.shape[0], Wp.dtype, batch_invariant=ctx.modes.batch_invariant)
        dW = deliver_weight_grad(Wp, "linear_weight", compute, ctx.wstate)
    return dx, dW, db


def _backward_recompute(ctx, g_loss):
    """The chunks again, scaled by ``grad_output``: for ``none`` (a per-token upstream), and for a
    fused or delayed weight gradient over several chunks (``_chunked_head.recompute_backward``)."""
    x, W, b, t, cw, s_ce, s_z, Wp = ctx.saved_tensors
    # delayed: copied, since backward_dw() reads it after this backward returned
    delayed = ctx.deferred and ctx.wstate.delay_wgrad_compute
    s_ce, s_z = upstream_scales(ctx.opts.reduction, g_loss, s_ce, s_z, x, delayed)

    bi = ctx.modes.batch_invariant

    def run(want, **head):
        return _run(ctx.opts, ctx.chunk, x, W, b, t, cw, s_ce, s_z, want, w_dtype=Wp.dtype, batch_invariant=bi, **head)[1]

    return recompute_backward(run, ctx.needs, ctx.wstate, Wp, ctx.b_dtype)


class LinearCrossEntropyLeanFunction(torch.autograd.Function):
    """``memory="lean"``: two passes over slices of the vocabulary (``ops/lm_head/linear_cross_entropy_slices.py``),
    exact gradients without the V×H fp32 accumulator. Inputs as :class:`LinearCrossEntropyFunction`,
    with the slice width in place of the chunk size (its GEMMs take ``modes`` as that one's do).

    The forward is pass 1 (the statistics of every slice, merged: the loss, lse per token). Every
    backward is pass 2, scaled by its ``grad_output`` (0-dim, or per token for ``none``): the
    slices' logits again (the fourth GEMM), d_logits from the saved lse, d_weight's rows by one
    GEMM per slice over all tokens, d_input accumulated in fp32 across slices and rounded once.
    Nothing is computed in the forward for the backward, so a repeated backward (``retain_graph``)
    runs the same pass again with its own scale. Fused ``main_grad``: the slices' weight GEMMs add
    into its rows; delayed: the backward computes d_input and d_bias, ``backward_dw()`` runs the
    slices again for the weight's GEMMs (the same d_logits, so the same bits as immediate)."""

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, W, b, t, cw, opts: LinearCrossEntropyOptions, width: int, wstate: WgradState | None, dtype, modes: Modes):
        wide = wide_dtype(x)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        deferred = wstate is not None and not wstate.plain and needs[1]
        if deferred and wstate.fuse_wgrad_accumulation:
            check_main_grad(W, "linear_weight")  # a clear error now, not in the backward
        Wp, ctx.b_dtype = W, None if b is None else b.dtype
        W, b = cast(W, dtype), cast(b, dtype)
        V = W.shape[0]
        n, s_ce, s_z, checked = target_prologue(t, V, opts.ignore_index, opts.reduction, cw, x)  # checked after pass 1 is queued
        w_sum = class_weight_sum(cw, V, opts)
        ctx.modes = modes
        stats = stats_pass(opts, x, W, b, t, cw, width=width, check=checked, batch_invariant=modes.batch_invariant)
        terms = finish_stats(stats, t, cw, opts, V, w_sum)
        total, z_part, acc = _outputs(opts, terms.ce, terms.zl, terms.correct, n, s_ce, s_z, wide)
        pred = _predicted(opts, stats.arg, t)  # the merged slices' first argmax
        ctx.opts, ctx.width, ctx.needs, ctx.wstate, ctx.deferred, ctx.w_sum = opts, width, needs, wstate, deferred, w_sum
        if any(needs):
            ctx.save_for_backward(x, W, b, t, cw, s_ce, s_z, terms.lse, Wp)
        ctx.mark_non_differentiable(z_part, acc, pred)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for the z part and the accuracy
        return total, z_part, acc, pred

    @staticmethod
    @autocast_disabled
    @refuses_double_backward("linear_cross_entropy", "truefuse.linear_cross_entropy_ref")
    def backward(ctx, g_loss, g_z, g_acc, g_pred):
        x, W, b, t, cw, s_ce, s_z, lse, Wp = ctx.saved_tensors
        g_loss = _upstream(g_loss, ctx.opts.reduction, x)
        # delayed: copied, since backward_dw() reads it after this backward returned
        delayed = ctx.deferred and ctx.wstate.delay_wgrad_compute
        s_ce, s_z = upstream_scales(ctx.opts.reduction, g_loss, s_ce, s_z, x, delayed)
        opts, V, w_sum, width = ctx.opts, W.shape[0], ctx.w_sum, ctx.width

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
                V=V,
                w_sum=w_sum,
                width=width,
                want=want,
                w_dtype=Wp.dtype,
                main_grad=main_grad,
                accumulate=accumulate,
                batch_invariant=ctx.modes.batch_invariant,
            )
            return HeadGrads(None if dx is None else dx.to(x.dtype), dW, db, None)  # d_input rounded once

        dx, dW, db = recompute_backward(run, ctx.needs, ctx.wstate, Wp, ctx.b_dtype)
        return dx, dW, db, None, None, None, None, None, None, None


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options=None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = True,
    fuse_wgrad_accumulation: bool = False,
    wgrad_state: WgradState | None = None,
    memory: str = "default",
    vocab_slice: int | None = None,
):
    """Cross-entropy of ``input @ linear_weightᵀ + linear_bias`` against ``target``, in chunks of tokens.

    Args:
        input: (..., H) hidden states, fp16 / bf16 / fp32 / fp64.
        linear_weight: (V, H), the input's dtype. linear_bias: (V,) or None.
        target: (...) int64/int32 class indices; ``ignore_index`` marks tokens that do not count.
        weight: (V,) per-class weights (any float dtype; used in fp32), or None.
        reduction: ``mean`` | ``sum`` | ``none`` (per token, shaped like ``target``).
        ignore_index: the target that does not count; None (torch's default) means -100, as in
            ``torch.nn.functional.linear_cross_entropy``.
        options: torch's ``torch.nn.LinearCrossEntropyOptions`` or None, accepted for torch's
            signature: its ``batch_chunk_size`` is ``chunk_size``; its other fields pick how
            torch's own chunked path runs and change nothing here
            (``ops/lm_head/linear_cross_entropy.py::chunk_size_from``).
        label_smoothing, z_loss, softcap: as in :func:`truefuse.ops.lm_head.linear_cross_entropy.linear_cross_entropy_ref`.
        return_z_loss, return_token_accuracy: also return those (not differentiable).
        return_predicted_tokens: also return each token's argmax logit (after softcap), int64
            shaped like ``target``, from the loss kernel's own pass over the logits (no logits
            kept): ``torch.argmax``'s answer (lowest index among ties, first NaN), ignored tokens
            included; for accuracy metrics (Liger-Kernel's ``return_predicted_tokens``).
        chunk_size: tokens per chunk. Default: all tokens in one chunk when their logits take no
            more memory than chunking would (the ``chunk_bytes`` tuning knob, 512 MiB, or the fp32 weight-gradient
            accumulator's V·H·4 bytes when there is one, i.e. the weight gradient is returned: 8192
            tokens at V = 128256, H = 4096 in bf16), or, with the accumulator, when one chunk's
            peak (its logits and the weight gradient) is at most 1/8 above the chunks' (a chunk's
            logits and the accumulator); else the largest power of two of tokens whose logits
            fit in that budget (``chunked_head.default_chunk``). Into ``main_grad`` there is no
            accumulator: 512 MiB.
        fp32_weight_grad: accumulate the weight gradient across chunks in fp32 and round once
            (default: as accurate as the plain path; V·H·4 bytes of memory), or in the weight's
            dtype (no extra memory, one rounding per chunk; measured in docs/log/benchmarks_2026-11.md). A
            single chunk needs neither: its one GEMM accumulates in fp32 and rounds once.
        fuse_wgrad_accumulation: the weight gradient goes to ``linear_weight.main_grad`` (fp32,
            Megatron's convention) inside the GEMMs, per docs/design.md §2 (what autograd gets: None, or
            a cached zero tensor when the weight has ``grad_added_to_main_grad``; with
            ``overwrite_main_grad`` it is written, not added). No V×H buffer of the loss's own:
            the peak above the returned gradients is one chunk's logits (0.53 GB at 8192 x 128256
            x 4096, bf16). With one chunk the forward keeps its d_logits for the backward's GEMM;
            with several (the default rule above beyond 512 MiB of logits) or with ``none`` the
            backward recomputes them (one more logits GEMM; a larger ``chunk_size`` trades that
            memory back for the time).
        memory: ``"default"`` (chunks of tokens, as above) or ``"lean"``: two passes over slices of
            the vocabulary, all tokens at once, exact gradients without the V×H fp32 accumulator.
            The forward computes the loss (pass 1: per slice its logits and per-token
            statistics, merged in slice order); every backward recomputes the slices' logits
            (one more GEMM than the default: 4 instead of 3), writes d_weight's rows by one GEMM
            per slice over all tokens (fp32 inside, rounded once, or added into ``main_grad``)
            and accumulates d_input in an fp32 (tokens, H) buffer rounded once. Peak above the
            returned gradients: one slice's logits plus that buffer, less the d_input returned
            (by default within 560 MiB: 465 / 530 MiB at 8192 / 16384 x 128256 x 4096 in bf16,
            5 / 10 slices). Lean and default are each bounded against the
            float64 reference, not bitwise equal to each other (the sums over V run in another
            order). ``chunk_size`` and ``fp32_weight_grad`` do not
            apply to it. docs/linear_cross_entropy.md, "Memory".
        vocab_slice: classes per slice under ``lean`` (default: as few slices as fit that peak,
            evened out, multiples of 64, ``linear_cross_entropy_slices.default_slice_width``; it
            depends on the number of tokens, so lean is not batch invariant).
        wgrad_state: the weight's docs/design.md §2 state (``LinearCrossEntropyLoss`` passes its own: it
            holds ``delay_wgrad_compute`` and the queue ``backward_dw()`` runs); default: a fresh
            one from ``fuse_wgrad_accumulation``.

    Returns:
        The loss, or a :class:`LinearCrossEntropyOutput` when an extra is asked for. Differentiable
        in ``input``, ``linear_weight`` and ``linear_bias``; the weight gradient is accumulated in
        fp32 across chunks and rounded once. When every target is ignored, ``mean`` is 0; with no
        tokens at all the loss is 0 (``none``: empty) and the gradients are zeros. Backward may
        run several times (``retain_graph``): each adds its own gradient, as the reference's does.

    Autocast: as ``F.cross_entropy(F.linear(input, W, b).float(), target)`` under ``torch.autocast``:
    the GEMMs on input, weight and bias cast to the autocast dtype, the loss in fp32; gradients in
    the input's and parameters' dtypes (docs/linear.md, "Autocast").

    Non-finite values give what the reference gives (``F.cross_entropy``): a NaN logit makes its
    token's loss, z-loss and d_logits NaN and its argmax is the first NaN (``torch.argmax``); a
    +inf logit, or a row of -inf, makes the token's cross-entropy and d_logits NaN (its
    log_softmax is), its z-loss term z_loss·lse² +inf (NaN for z_loss = 0, 0·inf, as in the
    reference); a -inf logit elsewhere just has probability 0. An ignored
    token never reaches the loss: an inf or NaN hidden state there leaves it finite. Its d_logits
    are 0, except NaN where its log_softmax is NaN (a ±inf / NaN logit, no softcap), as torch's
    backward gives (0 − exp(NaN)·0): then its d_input row and all of d_weight and d_bias are NaN,
    exactly as the reference's. With softcap its logits are finite: d_input's row is 0 and
    d_weight is NaN only in the columns where the hidden state is inf (0·inf in the weight GEMM,
    as in ``F.linear``'s backward).

    Raises:
        TypeError / ValueError naming the argument; ``ValueError`` for a target outside [0, V)
        other than ``ignore_index`` (the host waits for that check only, not for the stream).
    """
    chunk_size = chunk_size_from(options, chunk_size)
    opts = LinearCrossEntropyOptions(
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
        chunk_size=chunk_size,
        fp32_weight_grad=fp32_weight_grad,
        memory=memory,
        vocab_slice=vocab_slice,
    )
    return linear_cross_entropy_with(
        opts,
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        weight=weight,
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        wgrad_state=wgrad_state,
    )


def linear_cross_entropy_with(
    opts: LinearCrossEntropyOptions,
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    fuse_wgrad_accumulation: bool = False,
    wgrad_state: WgradState | None = None,
):
    """:func:`linear_cross_entropy` with its options held in ``opts`` (``LinearCrossEntropyLoss``
    keeps one)."""
    refuse_dtensor(
        "linear_cross_entropy", input=input, linear_weight=linear_weight, target=target, linear_bias=linear_bias, weight=weight
    )
    # under torch.autocast F.linear's operands are cast to its dtype (the input here, differentiably;
    # the weight and bias inside the Function, which needs the parameters): checked as cast
    dtype = autocast_dtype(input.device) if isinstance(input, torch.Tensor) else None
    input = cast(input, dtype)
    check_args(input, as_cast(linear_weight, dtype), target, as_cast(linear_bias, dtype), weight)
    V = linear_weight.shape[0]
    t = target.reshape(-1).to(torch.int64)  # checked against V in the forward (check_targets)
    x = input.reshape(-1, input.shape[-1])
    cw = None if weight is None else weight.detach().to(wide_dtype(input))
    wgrad_state = weight_state(fuse_wgrad_accumulation, wgrad_state)
    modes = Modes.now()  # once a call: the chunk size and the GEMMs, forward and backward (docs/design.md §1)
    if opts.memory == "lean":
        width = opts.vocab_slice or default_slice_width(x.shape[0], V, x.element_size(), H=x.shape[1])
        loss, z_part, acc, pred = LinearCrossEntropyLeanFunction.apply(
            x, linear_weight, linear_bias, t, cw, opts, width, wgrad_state, dtype, modes
        )
    else:
        chunk = chunk_for(opts.chunk_size, opts.fp32_weight_grad, x, linear_weight, wgrad_state, modes.batch_invariant)
        loss, z_part, acc, pred = LinearCrossEntropyFunction.apply(
            x, linear_weight, linear_bias, t, cw, opts, chunk, wgrad_state, dtype, modes
        )
    if opts.reduction == "none":
        loss, z_part = loss.view(target.shape), z_part.view(target.shape) if opts.return_z_loss else None
    if not opts.extras:
        return loss
    return LinearCrossEntropyOutput(
        loss,
        z_part if opts.return_z_loss else None,
        acc if opts.return_token_accuracy else None,
        pred.view(target.shape) if opts.return_predicted_tokens else None,
    )
