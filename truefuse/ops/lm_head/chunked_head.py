"""The chunked LM head: ``logits = x @ Wᵀ (+ b)`` over chunks of tokens, never all (tokens, V) of
them at once, with the loss over each chunk's logits as a parameter (:class:`ChunkLoss`).

Per chunk: the logits GEMM, the loss's :meth:`ChunkLoss.chunk` (its per-token terms into its own
outputs and, when gradients are asked for, d_logits in the logits' dtype, written over them), then
d_input by a GEMM into the chunk's rows, d_bias summed in fp32, and d_weight accumulated across
chunks inside the GEMM (beta=1): in fp32, in the weight's dtype, or straight into an fp32
``main_grad``. The GEMMs split the vocabulary where cuBLAS needs it (``chunked_head_gemms.py``).
The losses over it: ``linear_cross_entropy`` (``ops/lm_head/linear_cross_entropy_chunk.py``) and
``linear_log_probs`` (``ops/lm_head/linear_log_probs.py``). :func:`default_chunk` is the chunk-size policy.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from truefuse.config import get_tuning
from truefuse.ops._launch.dtypes import wgrad_dtype, wide_dtype
from truefuse.ops.lm_head.chunked_head_gemms import input_grad_gemm, logits_buffer, logits_gemm, vocab_split, weight_grad_gemm


class ChunkLoss(Protocol):
    """The per-chunk loss math the head runs (one object per pass over the chunks)."""

    def chunk(self, rows: slice, logits: torch.Tensor, bias: torch.Tensor | None, want_grad: bool) -> torch.Tensor | None:
        """The loss terms of the tokens ``rows`` into the loss's own outputs, from ``logits``
        (len(rows), ≥ V) in the input dtype (rows may be padded: the logits are the first V
        columns). ``bias``: (V,) to add to the logits in fp32 first (None: the GEMM added it).
        Returns d_logits (the loss's gradient, in the logits' dtype, written over ``logits`` or
        a new tensor) when ``want_grad``, else None."""

    def finish(self) -> None:
        """Called once after the last chunk (also when there was none)."""


class HeadGrads(NamedTuple):
    """What :func:`head_chunks` returns: the gradients asked for, else None.

    Attributes:
        dx: (N, H) in the input's dtype. dW: (V, H) in the weight's dtype, or in fp32 (the
            accumulator) for the caller to round once; None when it went to ``main_grad``.
        db: (V,) fp32 sum. d: the one chunk's d_logits when ``keep_d``, as the (N, ≥ V) buffer
            they were written in; its logits when ``keep_logits``.
    """

    dx: torch.Tensor | None
    dW: torch.Tensor | None
    db: torch.Tensor | None
    d: torch.Tensor | None


def head_chunks(
    loss: ChunkLoss,
    x: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None,
    *,
    chunk: int,
    want: tuple[bool, bool, bool],
    fp32_weight_grad: bool = True,
    w_dtype: torch.dtype | None = None,
    main_grad: torch.Tensor | None = None,
    accumulate: bool = False,
    keep_d: bool = False,
    keep_logits: bool = False,
    logits: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> HeadGrads:
    """Run ``loss`` over every chunk of ``chunk`` tokens of ``x`` (N, H) against ``W`` (V, H).

    Args:
        want: which of (d_input, d_weight, d_bias) to compute.
        fp32_weight_grad: accumulate d_weight across chunks in fp32 (rounded once by the caller;
            V·H·4 bytes) rather than in the weight's dtype (one rounding per chunk).
        w_dtype: the weight parameter's dtype (default ``W``'s; under autocast ``W`` is its cast
            copy): a returned d_weight ends in a dtype the caller rounds to it once.
        main_grad: write (with ``accumulate``, add) d_weight into this fp32 tensor, chunk after
            chunk inside the GEMMs, instead of returning it.
        keep_d: return the d_logits of a single chunk (for a weight GEMM run later).
        keep_logits: return the logits of a single chunk, no gradient asked (for a backward
            whose upstream the forward does not know: it then skips the logits GEMM).
        logits: that buffer, from an earlier pass over the same ``x`` and ``W``: used instead of
            the logits GEMM (one chunk); the loss may write its d_logits over it.
        batch_invariant: the forward's mode (docs/design.md §1): the GEMMs' batch-invariant plan and
            no vocabulary split, whatever the chunk's token count (``chunked_head_gemms.vocab_split``).
    """
    N = x.shape[0]
    V = W.shape[0]
    wide = wide_dtype(x)
    gx, gw, gb = want
    any_grad = gx or gw or gb or keep_d
    if (keep_logits and any_grad) or ((keep_logits or logits is not None) and N > chunk):
        raise ValueError("head_chunks: keep_logits asks for no gradient, and it and logits= take one chunk")
    given, kept = logits, None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if gx else None  # contiguous: chunks' GEMMs write rows of it
    # d_weight accumulates across chunks inside the GEMM (beta=1): in fp32 (one rounding at the
    # end, as accurate as one GEMM over all tokens; V*H*4 bytes more) or in the weight's dtype
    # (no extra memory; one rounding per chunk). One chunk needs no accumulator: its GEMM writes
    # d_weight in the weight's dtype, accumulating in fp32 inside (the plain path's GEMM).
    # Under autocast (an fp32 weight, operands cast to bf16) "the weight's dtype" is the parameter's:
    # its one GEMM writes fp32, and without fp32_weight_grad the chunks accumulate in fp32 too.
    w_dtype = W.dtype if w_dtype is None else w_dtype
    one_chunk = N <= chunk
    acc_dtype = wide if fp32_weight_grad and not one_chunk else wgrad_dtype(x.dtype, w_dtype)
    direct = one_chunk and acc_dtype == x.dtype  # the one GEMM returns the gradient in its dtype
    dW = torch.empty(W.shape, dtype=acc_dtype, device=x.device) if gw and not direct and main_grad is None else None
    db = torch.zeros(V, dtype=wide, device=x.device) if gb else None
    d = full = None
    for i, start in enumerate(range(0, N, chunk)):
        # the previous chunk's logits go before this chunk's are allocated, not after: one
        # chunk of logits alive at a time (2.1 GB less peak at 16384 x 128256 x 4096 in 8192s)
        logits = d = full = None
        rows = slice(start, min(start + chunk, N))
        xc = x[rows]
        split = vocab_split(xc, V, batch_invariant)
        # a split GEMM would get the bias from cuBLAS after the product's rounding (1.41x the
        # logits' error, measured): the loss adds it in fp32 instead
        loss_bias = b if split is not None else None
        if given is not None:  # the one chunk's logits, kept by an earlier pass (the same GEMM's bits)
            full, logits = (given if given.shape[1] != V else None), given[:, :V]
        else:
            full = None if split is None else logits_buffer(xc.shape[0], V, xc)
            logits = logits_gemm(
                xc, W, None if split is not None else b, None if full is None else full[:, :V], split, batch_invariant
            )
        if keep_logits:
            kept = logits if full is None else full
        d = loss.chunk(rows, logits, loss_bias, any_grad)
        if d is None:
            continue
        if gb:
            db += torch.sum(d, dim=0, dtype=wide)
        if gx:
            input_grad_gemm(d, W, dx[rows], split, batch_invariant)
        if gw and main_grad is not None:
            weight_grad_gemm(d, xc, main_grad, accumulate or i > 0, split, batch_invariant)
        elif gw and direct:
            dW = weight_grad_gemm(d, xc, None, False, split, batch_invariant)
        elif gw:
            weight_grad_gemm(d, xc, dW, i > 0, split, batch_invariant)
    loss.finish()
    if N == 0 and gw:  # no tokens, no chunk ran: the weight gradient is zero, as torch's
        if main_grad is None:
            dW = torch.zeros(W.shape, dtype=w_dtype, device=W.device)
        elif not accumulate:  # written (overwrite_main_grad), not added to
            main_grad.zero_()
    # kept whole (padding included): contiguous, so a later scale_ is one in-place pass
    return HeadGrads(dx, dW, db, kept if keep_logits else (d if full is None else full) if keep_d else None)


def kept_weight_grad(
    d: torch.Tensor,
    x: torch.Tensor,
    V: int,
    w_dtype: torch.dtype,
    out: torch.Tensor | None,
    accumulate: bool,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The weight gradient ``dᵀ @ x`` (V, H) from a one-chunk :attr:`HeadGrads.d` (its first V
    columns): into ``out`` (``main_grad``; added with ``accumulate``), or a new tensor in
    ``w_dtype``, accumulated in fp32 inside the GEMM and rounded once. With ``d``, ``x``, ``V`` and
    ``w_dtype`` bound it is a ``WgradCompute`` (``autograd/_wgrad.py``); ``batch_invariant``: as
    :func:`head_chunks`' (the forward's mode, so the split matches the chunk's)."""
    split = vocab_split(x, V, batch_invariant)
    if out is not None:
        return weight_grad_gemm(d[:, :V], x, out, accumulate, split, batch_invariant)
    odt = wgrad_dtype(x.dtype, w_dtype)  # autocast: fp32 out of the cast operands
    new = None if odt == d.dtype else torch.empty(V, x.shape[1], dtype=odt, device=x.device)
    return weight_grad_gemm(d[:, :V], x, new, False, split, batch_invariant).to(w_dtype)


def default_chunk(N: int, V: int, H: int, itemsize: int, fp32_accumulator: bool) -> int:
    """Tokens per chunk when the caller gives no chunk size.

    The logits' budget is the ``chunk_bytes`` tuning knob (``truefuse.config.Tuning``, 512 MiB: on
    the H200 at 8192 x 128256 x 4096 it picks 2048-token chunks, 47.3 ms against 45.4 for 4096 with
    1 GiB more peak; docs/benchmarks.md), or with an fp32 weight-gradient accumulator its V·H·4
    bytes when that is more: memory chunking holds anyway. All N when every token's logits fit (the
    three GEMMs of the plain path and one loss pass, nothing re-read per chunk), else the largest
    power of two of tokens that fits (at least 1). Each chunk re-reads and re-writes the fp32
    accumulator (8·V·H bytes) beside a weight-gradient GEMM of 2·chunk·V·H flops, so larger chunks
    cost less time: at 16384 x 128256 x 4096 (H200, bf16) chunks of 2048 / 4096 / 8192 took
    1.120 / 1.059 / 1.054x the three GEMMs, torch.compile of the plain path 1.065x (8192 is chosen
    there, the accumulator's budget; docs/log/benchmarks_2026-11.md).

    With the accumulator, one chunk is also taken when its peak (all the logits, and the weight
    gradient its one GEMM writes in the input's dtype beside them) is at most 1/8 above the
    chunks' (one chunk's logits and the accumulator): one chunk needs no accumulator, and a loss
    whose backward needs the logits again (``linear_log_probs``, ``reduction="none"``) keeps them
    instead of a fourth GEMM. At 8192 x 152064 x 3584 (bf16) that is 3.58 against 3.43 GB (+4.5%)
    for 3 GEMMs instead of 4 (linear_log_probs 1.50x the GEMMs in two chunks); at 16384 x 128256 x
    4096 5.25 against 4.20 GB (+25%) keeps the 8192-token chunks (one chunk was no faster there:
    1.070 against 1.054x; docs/log/benchmarks_2026-11.md)."""
    chunk_bytes = get_tuning().chunk_bytes
    acc = V * H * 4 if fp32_accumulator else 0
    budget = max(chunk_bytes, acc)
    if N * V * itemsize <= budget:
        return max(1, N)
    fit = max(1, budget // (itemsize * max(V, 1)))
    chunk = max(1, min(N, 1 << (fit.bit_length() - 1)))
    one, several = (N * V + V * H) * itemsize, chunk * V * itemsize + acc
    return N if acc and 8 * one <= 9 * several else chunk


def invariant_chunk(V: int, H: int, itemsize: int, fp32_accumulator: bool) -> int:
    """Tokens per chunk in batch-invariant mode (docs/design.md §1): :func:`default_chunk`'s budget
    without its reading of the token count, the largest power of two of tokens whose logits fit
    ``chunk_bytes`` (or the fp32 accumulator's V·H·4 bytes when more; at least 1). A call with
    fewer tokens is one chunk. With the GEMMs batch-invariant a token's bits do not depend on its
    chunk either; this keeps the head's schedule (and its memory) a function of the shapes alone."""
    budget = max(get_tuning().chunk_bytes, V * H * 4 if fp32_accumulator else 0)
    fit = max(1, budget // (itemsize * max(V, 1)))
    return 1 << (fit.bit_length() - 1)
