"""Sibling projections that read one input (a layer's q/k/v, an MLP's gate/up): the reference, and
their input gradient summed inside the GEMMs (issue 48.5; docs/sibling_linears.md).

Autograd sums the input gradient of ``k`` linears that read one ``x`` with ``k - 1`` separate add
kernels over ``x``'s shape (each a read of two and a write of one (M, K) tensor): on the demo's
GPU model (8192 × 2048 bf16) ~34 µs each, 3 a decoder layer (q/k/v: 2, gate/up: 1), part of the
~3.5 ms of bf16 adds in docs/results/hf/hf_profile_compile_h100_2026-12-07.txt.
:func:`summed_input_grad` computes the first product with ``mm`` and adds each next one inside its
GEMM (``addmm_``, beta = 1: cuBLAS adds the running sum in fp32 in its epilogue, one rounding a
product instead of two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.ops.gemm.gemm import plain_gemm
from truefuse.ops.gemm.gemm_kept import kept_product


def sibling_linears_ref(x: torch.Tensor, weights, biases=None) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w, b))``: the stock calls, one a projection (autograd then sums ``x``'s
    gradient with separate adds)."""
    biases = (None,) * len(weights) if biases is None else tuple(biases)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))


def summed_input_grad(dys, weights) -> torch.Tensor | None:
    """``Σ_i dy_i @ W_i`` over the (M, N_i) output gradients that are not None, as (M, K): the first
    product by ``mm`` (torch's linear backward's own call for one projection: ``dy.mm(W)``), each
    next one accumulated into it by ``addmm_`` (the running sum read by the GEMM, no add kernel).
    None where every ``dy`` is None."""
    dx = None
    for dy, w in zip(dys, weights, strict=True):
        if dy is None:
            continue
        dx = dy.mm(w) if dx is None else dx.addmm_(dy, w)
    return dx


def summed_input_grad_bi(dys, weights) -> torch.Tensor | None:
    """:func:`summed_input_grad` in batch-invariant mode: the first product the routed Linear's own
    input-gradient GEMM (``kept_product``, batch-invariant), each next one accumulated into it by
    the batch-invariant GEMM (``accumulate``: the running sum read in fp32 in its epilogue on CUDA,
    one rounding a product). Every GEMM keeps a row's bits independent of the other rows, so the
    sum does too (docs/design.md §1)."""
    dx = None
    for dy, w in zip(dys, weights, strict=True):
        if dy is None:
            continue
        if dx is None:
            dx = kept_product(dy, w, None, True)
        else:
            plain_gemm(dy, w, out=dx, accumulate=True, batch_invariant=True)
    return dx


def weight_and_bias_grads(dy: torch.Tensor, x2: torch.Tensor, want_w: bool, want_b: bool):
    """One projection's ``(dW, db)`` from its (M, N) output gradient and (M, K) input, by the calls
    torch's linear backward makes (``dy.t().mm(x)``, the bias's ``dy.sum(0)``): the stock bits."""
    dw = dy.t().mm(x2) if want_w else None
    db = dy.sum(0) if want_b else None
    return dw, db
