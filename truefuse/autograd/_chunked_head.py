"""What the chunked LM head's autograd Functions share (``linear_cross_entropy``,
``linear_log_probs``): the gradients in the parameters' dtypes, and the backward that runs the
chunks again under docs/design.md §2 (plain, delayed, or fused into ``main_grad``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from truefuse.autograd._autocast import autocast_dtype, cast
from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.autograd._modes import Modes
from truefuse.autograd._wgrad import WgradState, deliver_weight_grad, main_grad_target, main_grad_written
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops.gemm.bias_grad import split_bias_grad
from truefuse.ops.lm_head.chunked_head import HeadGrads, default_chunk, invariant_chunk
from truefuse.ops.lm_head.chunked_head_gemms import input_grad_gemm, logits_gemm, weight_grad_gemm

#: ``run(want, **head_chunks_keywords) -> HeadGrads``: one pass of a loss over the head's chunks,
#: everything but what to compute and where d_weight goes bound (its ``w_dtype`` included).
HeadRun = Callable[..., HeadGrads]


def in_dtypes(grads: HeadGrads, w_dtype: torch.dtype, b_dtype: torch.dtype | None) -> HeadGrads:
    """dW and db in the parameters' dtypes (each rounded once from its accumulator)."""
    dx, dW, db, d = grads
    return HeadGrads(dx, None if dW is None else dW.to(w_dtype), None if db is None else db.to(b_dtype), d)


def _weight_pass(run: HeadRun, w_dtype: torch.dtype, out: torch.Tensor | None, accumulate: bool):
    """The delayed weight gradient: the chunks again, the weight's GEMMs only (with ``run`` and
    ``w_dtype`` bound, a ``WgradCompute``)."""
    dW = run((False, True, False), main_grad=out, accumulate=accumulate).dW
    return None if dW is None else dW.to(w_dtype)


def recompute_backward(
    run: HeadRun,
    needs: tuple[bool, bool, bool],
    wstate: WgradState | None,
    Wp: torch.Tensor,
    b_dtype: torch.dtype | None,
    name: str = "linear_weight",
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(d_input, what autograd gets for the weight, d_bias) from the chunks run again, the upstream
    gradient already bound into ``run``'s scales.

    ``needs``: which of (input, weight, bias) want a gradient. ``Wp``: the weight parameter (for
    §2; under autocast the GEMMs take its cast copy). Plain: one pass. Delayed: d_input and d_bias
    now, the weight's pass in ``backward_dw()``. Fused: one pass whose d_weight GEMMs add into
    ``main_grad``, d_input and d_bias riding along."""
    gx, gw, gb = needs
    if not gw or wstate is None or wstate.plain:
        dx, dW, db, _ = in_dtypes(run(needs), Wp.dtype, b_dtype)
        return dx, dW, db
    target = None if wstate.delay_wgrad_compute else main_grad_target(Wp, name)
    if target is None:  # delayed, or main_grad the GEMMs cannot write: the weight's own pass
        dx, _, db, _ = in_dtypes(run((gx, False, gb)), Wp.dtype, b_dtype)
        return dx, deliver_weight_grad(Wp, name, functools.partial(_weight_pass, run, Wp.dtype), wstate), db
    main_grad, accumulate = target
    dx, _, db, _ = in_dtypes(run(needs, main_grad=main_grad, accumulate=accumulate), Wp.dtype, b_dtype)
    return dx, main_grad_written(Wp, wstate), db


def weight_state(fuse_wgrad_accumulation: bool, wgrad_state: WgradState | None) -> WgradState | None:
    """The head weight's §2 state from a functional's keywords: ``wgrad_state`` as given, or a fresh
    fused one for ``fuse_wgrad_accumulation`` (None: plain). Both, contradicting: ``ValueError``."""
    if wgrad_state is None:
        return WgradState(fuse_wgrad_accumulation=True) if fuse_wgrad_accumulation else None
    if fuse_wgrad_accumulation and not wgrad_state.fuse_wgrad_accumulation:
        raise ValueError("fuse_wgrad_accumulation=True contradicts wgrad_state (pass one or the other)")
    return wgrad_state


def chunk_for(
    chunk_size: int | None, fp32_weight_grad: bool, x: torch.Tensor, W: torch.Tensor, wstate, batch_invariant: bool
) -> int:
    """Tokens per chunk: ``chunk_size``, else ``default_chunk``. An fp32 weight-gradient accumulator
    (V·H·4 bytes) exists when d_weight is returned and accumulated in fp32: chunks up to its size
    cost no more memory. Into ``main_grad`` there is none, so the chunks stay within ``chunk_bytes``
    (0.53 GB at 8192 x 128256 x 4096, not 2.1) and the backward recomputes their logits (one more
    GEMM; docs/benchmarks.md). In batch-invariant mode (``batch_invariant``, the mode the caller
    read): ``invariant_chunk`` (no token count read)."""
    if chunk_size:
        return chunk_size
    wgrad = torch.is_grad_enabled() and W.requires_grad
    fused = wstate is not None and wstate.fuse_wgrad_accumulation
    acc = wgrad and fp32_weight_grad and not fused
    if batch_invariant:
        return invariant_chunk(W.shape[0], x.shape[1], x.element_size(), acc)
    return default_chunk(x.shape[0], W.shape[0], x.shape[1], x.element_size(), acc)


class HeadLogitsFunction(torch.autograd.Function):
    """``x @ Wᵀ (+ b)`` through the chunked head's logits GEMM (``chunked_head_gemms.logits_gemm``,
    unsplit), differentiable: the logits a model returns in batch-invariant mode, the bits of the
    head's own chunks (docs/design.md §1). x (N, H), W (V, H), b (V,) or None; logits (N, V)."""

    @staticmethod
    def forward(ctx, x, W, b):
        ctx.save_for_backward(x, W)
        ctx.has_b = b is not None
        ctx.modes = Modes.now()  # the backward's GEMMs run in the forward's mode
        return logits_gemm(x, W, b, None, None, ctx.modes.batch_invariant)

    @staticmethod
    @refuses_double_backward("linear_cross_entropy", "torch.nn.functional.linear")  # the head's logits in BI mode
    def backward(ctx, g):
        x, W = ctx.saved_tensors
        g = g.contiguous()
        bi = ctx.modes.batch_invariant
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty(g.shape[0], W.shape[1], dtype=g.dtype, device=g.device)
            input_grad_gemm(g, W, dx, None, bi)
        dW = weight_grad_gemm(g, x, None, False, None, bi) if ctx.needs_input_grad[1] else None
        db = split_bias_grad(g) if ctx.has_b and ctx.needs_input_grad[2] else None
        return dx, dW, db


def head_logits(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The logits (..., V) of hidden states ``x`` (..., H) by the head's GEMM (``HeadLogitsFunction``).
    Under ``torch.autocast`` as ``F.linear`` there (the stock head): the operands cast to its dtype
    (differentiable), the logits in it, the bits of the head's chunks under the same autocast."""
    refuse_dtensor("head_logits", input=x, weight=W, bias=b)  # the head's GEMMs do not refuse them again
    dt = autocast_dtype(x.device)
    scope = contextlib.nullcontext()
    if dt is not None:
        x, W, b = cast(x, dt), cast(W, dt), cast(b, dt)
        scope = torch.autocast(x.device.type, enabled=False)
    with scope:
        return HeadLogitsFunction.apply(x.reshape(-1, x.shape[-1]), W, b).view(*x.shape[:-1], W.shape[0])
