"""``truefuse.linear_log_probs``: per-token log-probabilities of the targets and entropies from the
LM head, without materializing the (tokens, V) logits: the autograd Function and the functional
API. The work runs on the chunked LM head (``ops/lm_head/chunked_head.py``) with ``LogProbChunks`` as its
per-chunk math (``ops/lm_head/linear_log_probs.py``). The forward computes the two outputs only: the
backward's upstream gradients are per token and unknown until then. With one chunk the forward
keeps its logits for the backward (the backward's own chunk would take the same memory, so the
peak is unchanged): three GEMMs in all. With several, the backward runs the chunks again (one more
logits GEMM, as ``linear_cross_entropy`` with ``reduction="none"``). The default takes one chunk
also where its peak is at most 1/8 above the chunks' (``chunked_head.default_chunk``): at 8192 x
152064 x 3584 (bf16, H200) 43.8 ms (1.10x the GEMMs) and 2376 MiB against 59.5 ms (1.50x) and
2227 MiB in two chunks (``experiments/exp_lce_rule_lean.py`` at d49a912).
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
from truefuse.ops.lm_head.chunked_head import head_chunks, kept_weight_grad
from truefuse.ops.lm_head.linear_cross_entropy import check_args, target_prologue
from truefuse.ops.lm_head.linear_log_probs import LinearLogProbsOptions, LinearLogProbsOutput, LogProbChunks


class LinearLogProbsFunction(torch.autograd.Function):
    """Inputs: x (N, H), W (V, H), bias (V,) or None, target (N,) int64, the options, the chunk
    size, the weight's docs/design.md §2 state (None: plain), the autocast dtype (None outside
    autocast) and the call's ``Modes`` (as ``LinearCrossEntropyFunction``). Outputs: (N,) log-probs and (N,) entropies, wide.

    Backward runs the chunks again with both upstream gradients (a copy of them when the weight
    gradient is delayed, which reads them in ``backward_dw()``), per docs/design.md §2 for the
    weight (``_chunked_head.recompute_backward``). Backward may run several times (``retain_graph``)."""

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, W, b, t, opts: LinearLogProbsOptions, chunk: int, wstate: WgradState | None, dtype, modes: Modes):
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        if wstate is not None and wstate.fuse_wgrad_accumulation and needs[1]:
            check_main_grad(W, "linear_weight")  # a clear error now, not in the backward
        Wp, ctx.b_dtype = W, None if b is None else b.dtype
        W, b = cast(W, dtype), cast(b, dtype)
        check = target_prologue(t, W.shape[0], opts.ignore_index, "sum", None, x)[3]  # one kernel where it can
        loss = LogProbChunks(opts, W.shape[0], t, None, None, like=x, check=check)
        keep = any(needs) and 0 < x.shape[0] <= chunk
        ctx.modes = modes  # the backward takes the forward's path (docs/design.md §1)
        head = {"keep_logits": keep, "batch_invariant": modes.batch_invariant}
        kept = head_chunks(loss, x, W, b, chunk=chunk, want=(False, False, False), **head).d
        ctx.opts, ctx.chunk, ctx.needs, ctx.wstate = opts, chunk, needs, wstate
        # a plain attribute, not a saved tensor: the first backward writes d_logits over it
        ctx.kept = kept
        if any(needs):
            ctx.save_for_backward(x, W, b, t, Wp)
        return loss.log_probs, loss.entropy

    @staticmethod
    @autocast_disabled
    @refuses_double_backward("linear_log_probs", "truefuse.ops.lm_head.linear_log_probs.linear_log_probs_ref")
    def backward(ctx, g_lp, g_ent):
        x, W, b, t, Wp = ctx.saved_tensors
        wide = wide_dtype(x)
        logits, ctx.kept = ctx.kept, None  # the first backward's; a later one (retain_graph) recomputes
        if logits is not None:
            dx, dW, db = _backward_kept(ctx, logits, g_lp.to(wide), g_ent.to(wide))
            return dx, dW, db, None, None, None, None, None, None
        # delayed: copies (N values each), since backward_dw() reads them after this backward
        # returned, when the caller may have written its upstream tensors
        delayed = ctx.wstate is not None and ctx.wstate.delay_wgrad_compute and ctx.needs[1]
        a, c = g_lp.to(wide, copy=delayed), g_ent.to(wide, copy=delayed)

        def run(want, **head):
            loss = LogProbChunks(ctx.opts, W.shape[0], t, a, c, like=x)
            return head_chunks(
                loss,
                x,
                W,
                b,
                chunk=ctx.chunk,
                want=want,
                fp32_weight_grad=ctx.opts.fp32_weight_grad,
                w_dtype=Wp.dtype,
                batch_invariant=ctx.modes.batch_invariant,
                **head,
            )

        dx, dW, db = recompute_backward(run, ctx.needs, ctx.wstate, Wp, ctx.b_dtype)
        return dx, dW, db, None, None, None, None, None, None


def _backward_kept(ctx, logits, a, c):
    """One chunk whose logits the forward kept: the loss's gradient over them, then the GEMMs (the
    weight's under docs/design.md §2, from the kept d_logits when fused or delayed)."""
    x, W, b, t, Wp = ctx.saved_tensors
    gx, gw, gb = ctx.needs
    deferred = gw and ctx.wstate is not None and not ctx.wstate.plain
    loss = LogProbChunks(ctx.opts, W.shape[0], t, a, c, like=x)
    grads = head_chunks(
        loss,
        x,
        W,
        b,
        chunk=ctx.chunk,
        want=(gx, gw and not deferred, gb),
        fp32_weight_grad=ctx.opts.fp32_weight_grad,
        w_dtype=Wp.dtype,
        logits=logits,
        keep_d=deferred,
        batch_invariant=ctx.modes.batch_invariant,
    )
    dx, dW, db, d = in_dtypes(grads, Wp.dtype, ctx.b_dtype)
    if deferred:
        compute = functools.partial(kept_weight_grad, d, x, W.shape[0], Wp.dtype, batch_invariant=ctx.modes.batch_invariant)
        dW = deliver_weight_grad(Wp, "linear_weight", compute, ctx.wstate)
    return dx, dW, db


def linear_log_probs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = True,
    fuse_wgrad_accumulation: bool = False,
    wgrad_state: WgradState | None = None,
) -> LinearLogProbsOutput:
    """Log-probability of each target and entropy of each token's distribution under
    ``softmax(softcap(input @ linear_weightᵀ + linear_bias) / temperature)``, in chunks of tokens.

    Args:
        input: (..., H) hidden states, fp16 / bf16 / fp32 / fp64.
        linear_weight: (V, H), the input's dtype. linear_bias: (V,) or None.
        target: (...) int64/int32 token ids; ``ignore_index`` marks tokens whose outputs are 0.
        temperature: > 0, the sampling temperature the logits are divided by (after the softcap).
        softcap: Gemma-style ``softcap * tanh(logits / softcap)``, or None.
        chunk_size: tokens per chunk (default: ``linear_cross_entropy``'s rule).
        fp32_weight_grad, fuse_wgrad_accumulation, wgrad_state: as :func:`truefuse.linear_cross_entropy`
            (the weight gradient under docs/design.md §2).

    Returns:
        :class:`LinearLogProbsOutput` ``(log_probs, entropy)``, each shaped like ``target``, fp32
        (fp64 on fp64 inputs), both differentiable in ``input``, ``linear_weight`` and
        ``linear_bias`` (any per-token upstream gradients; the backward runs the chunks again).
        Semantics and non-finite values: ``truefuse.ops.lm_head.linear_log_probs.linear_log_probs_ref``.

    Autocast: as ``F.linear`` under ``torch.autocast``: the GEMMs in its dtype, the rest in fp32.

    Raises:
        TypeError / ValueError naming the argument; ``ValueError`` for a target outside [0, V)
        other than ``ignore_index``.
    """
    refuse_dtensor("linear_log_probs", input=input, linear_weight=linear_weight, target=target, linear_bias=linear_bias)
    opts = LinearLogProbsOptions(temperature, softcap, ignore_index, chunk_size, fp32_weight_grad)
    dtype = autocast_dtype(input.device) if isinstance(input, torch.Tensor) else None
    input = cast(input, dtype)
    check_args(input, as_cast(linear_weight, dtype), target, as_cast(linear_bias, dtype), None)
    t = target.reshape(-1).to(torch.int64)
    x = input.reshape(-1, input.shape[-1])
    wgrad_state = weight_state(fuse_wgrad_accumulation, wgrad_state)
    modes = Modes.now()  # once a call: the chunk size and the GEMMs, forward and backward (docs/design.md §1)
    chunk = chunk_for(opts.chunk_size, opts.fp32_weight_grad, x, linear_weight, wgrad_state, modes.batch_invariant)
    lp, ent = LinearLogProbsFunction.apply(x, linear_weight, linear_bias, t, opts, chunk, wgrad_state, dtype, modes)
    return LinearLogProbsOutput(lp.view(target.shape), ent.view(target.shape))
