"""The chunked LM head's three GEMMs (logits, d_input, d_weight), with the vocabulary split where cuBLAS needs it.

cuBLAS (H200, bf16) runs a GEMM whose vocabulary dimension V is not a multiple of 8 five to six
times slower: at 8192 x 50257 x 4096 (GPT-2's vocabulary) the logits, d_input and d_weight GEMMs
took 31.0 / 23.9 / 22.7 ms against 4.85 / 4.74 / 4.84 ms with that dimension padded
(``experiments/exp_odd_vocab_gemms.py``). Padding the weight costs a copy of it; splitting does not.
With ``split`` = V rounded down to ``align`` (a tuning knob, ``truefuse.config.Tuning``: 64) the
first ``split`` classes run in aligned GEMMs and the rest (fewer than ``align``) in a small one:

* logits: two column ranges of the output (disjoint: every logit is the same dot product),
  without the bias: into an output with padded rows cuBLAS's aligned kernels add a bias (as
  beta·C) after rounding the product, 1.41x the logits' error of ``F.linear``'s bias epilogue at
  1024 x 50257 x 128 (``experiments/exp_lce_split_accuracy.py``), so the loss adds it in fp32;
* d_weight: two row ranges of the output (disjoint likewise);
* d_input contracts over V: the two parts are summed in fp32 and rounded once, as one GEMM's
  fp32 accumulator is (an fp32 (tokens, H) temporary).

``split`` (:func:`vocab_split`) is None when V is a multiple of ``align`` (or smaller than it), or
when the chunk's logits GEMM is below ``min_macs`` multiply-adds (the tuning knob: 2^32, ~12 us of
GEMM on the H200 at cuBLAS speed, ~60 us unaligned): one GEMM each, into contiguous
logits. There the
slow kernel costs microseconds, and the GEMMs stay the plain path's, bit for bit (a split GEMM,
or one into padded rows, is another cuBLAS kernel: its fp32 sums run in another order).

In batch-invariant mode (``batch_invariant=True``, the mode the op's forward read) ``split`` is
always None: the rule above reads the chunk's token count, and one GEMM per product (the bias in
its epilogue, through ``truefuse.gemm``'s batch-invariant plan) is also what a model's logits path
runs, so a token's logits and log-prob are the same bits in both (docs/design.md §1).
"""

from __future__ import annotations

import torch

from truefuse.config import get_tuning
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops._launch.triton import triton_runs
from truefuse.ops.gemm.gemm import plain_gemm


def vocab_split(x: torch.Tensor, V: int, batch_invariant: bool = False) -> int | None:
    """Where the GEMMs of chunks like ``x`` (rows, H) split the vocabulary: V rounded down to
    the ``align`` tuning knob when V is not a multiple of it (and exceeds it), the Triton loss
    kernel runs and the GEMM reaches ``min_macs`` multiply-adds; else None, one GEMM each into
    contiguous logits. Always None with ``batch_invariant`` (the rule reads the token count)."""
    rows, H = x.shape
    t = get_tuning()
    if batch_invariant or not triton_runs(x) or V % t.align == 0 or V < t.align or rows * V * H < t.min_macs:
        return None
    return V // t.align * t.align


def logits_buffer(rows: int, V: int, like: torch.Tensor) -> torch.Tensor:
    """The logits of a split chunk: a (rows, V rounded up to ``align``) buffer, written as
    ``buf[:, :V]``. With rows of V elements an odd V leaves every row but the first off 16-byte
    alignment: the loss kernel's loads and stores cannot be vectors (nor cuBLAS's tiles TMA
    loads). The padding columns are never read."""
    align = get_tuning().align
    return torch.empty(rows, -(-V // align) * align, dtype=like.dtype, device=like.device)


def logits_gemm(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor | None, split: int | None, bi: bool):
    """The logits ``x @ Wᵀ (+ b)`` (tokens, V): one GEMM with the bias into a new tensor when
    ``split`` is None; else the two column ranges into ``out`` (``buf[:, :V]`` of a
    :func:`logits_buffer`), without a bias (the loss adds it in fp32). Returns the logits.
    ``bi``, here and in the two below: the batch-invariant mode the caller's forward read. The
    GEMMs take ``plain_gemm``, checked once each, without a second DTensor refusal: every entry
    to the head refused DTensor operands at its door."""
    if split is None:
        return plain_gemm(x, W.t(), b, batch_invariant=bi, dtensors_refused=True)
    if b is not None:
        raise ValueError("logits_gemm: a split GEMM takes no bias (cuBLAS would add it after rounding)")
    for cols in (slice(0, split), slice(split, None)):
        plain_gemm(x, W[cols].t(), out=out[:, cols], batch_invariant=bi, dtensors_refused=True)
    return out


def input_grad_gemm(d: torch.Tensor, W: torch.Tensor, out: torch.Tensor, split: int | None, bi: bool) -> None:
    """``out = d @ W``: the input gradient of a chunk, ``d`` (tokens, V), into ``out`` (tokens, H),
    contiguous."""
    if split is None:
        plain_gemm(d, W, out=out, batch_invariant=bi, dtensors_refused=True)  # straight into its rows: no temporary, no copy
        return
    acc = plain_gemm(d[:, split:], W[split:], out_dtype=wide_dtype(d), batch_invariant=bi, dtensors_refused=True)
    plain_gemm(d[:, :split], W[:split], out=acc, accumulate=True, batch_invariant=bi, dtensors_refused=True)
    out.copy_(acc)  # the one rounding to the input dtype


def weight_grad_gemm(d: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None, accumulate: bool, split: int | None, bi: bool):
    """``dᵀ @ x`` (V, H) written, or added with ``accumulate``, into ``out`` (a new tensor in
    ``d``'s dtype when None); returns it."""
    if split is None:
        return plain_gemm(d.t(), x, out=out, accumulate=accumulate, batch_invariant=bi, dtensors_refused=True)
    if out is None:
        out = torch.empty(d.shape[1], x.shape[1], dtype=d.dtype, device=d.device)
    for rows in (slice(0, split), slice(split, None)):
        plain_gemm(d[:, rows].t(), x, out=out[rows], accumulate=accumulate, batch_invariant=bi, dtensors_refused=True)
    return out
