"""Carrying out a :class:`~truefuse.ops.gemm.gemm_plan.GemmPlan`: the split steps around the product of
the plan's backend (``truefuse.ops.gemm.gemm_backends``), and the loop over groups.

Only :func:`run` (and :class:`GemmArgs`, its argument) is used from outside; ``truefuse.ops.gemm.gemm``
validates before calling it, so nothing here checks user input.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from truefuse.ops.gemm.activation import activation_grad_ref, activation_ref
from truefuse.ops.gemm.bias_grad import split_bias_grad
from truefuse.ops.gemm.gemm_backends import get_backend
from truefuse.ops.gemm.gemm_backends._base import GemmArgs
from truefuse.ops.gemm.gemm_plan import GemmPlan

# ---------------------------------------------------------------------------------------------
# one GEMM: split prologue, fused product, split epilogue


def _run_one(plan: GemmPlan, args: GemmArgs) -> None:
    fused, split = plan.fused, plan.split
    a = args.a
    if args.grad_activation is not None and "grad_activation" in split:
        a = activation_grad_ref(a, args.pre_activation, args.grad_activation)
    if args.grad_bias_out is not None and "grad_bias" in split:
        # docs/design.md §3: the split bias-gradient is grad_output.float().sum(0) cast to the input dtype
        # (a = grad_output.t(), so a.t() is the gradient in its own layout)
        args.grad_bias_out.copy_(split_bias_grad(a.t()))
    b = args.b
    if plan.compute_dtype != a.dtype:  # ``out_dtype`` split: upcast, then the product in out's dtype
        a, b = a.to(plan.compute_dtype), b.to(plan.compute_dtype)

    out = args.out
    if args.accumulate and "accumulate" in split:
        target, beta1 = torch.empty_like(out), False
    elif args.activation is not None:  # the product is the pre-activation; out gets act(it)
        target, beta1 = (args.pre_out if args.pre_out is not None else torch.empty_like(out)), False
    else:
        target, beta1 = out, args.accumulate
    product = get_backend(plan.backend).product
    if "batch_invariant" in split:
        _row_blocks(product, args, a, b, fused, target, beta1)
    else:
        product(args, a, b, fused, target, beta1)

    if args.bias is not None and "bias" in split:
        target.add_(args.bias.to(target.dtype))
    if args.activation is not None:
        out.copy_(activation_ref(target, args.activation))
    if args.accumulate and "accumulate" in split:
        out.add_(target)


#: Rows per call of the split ``batch_invariant`` path. A BLAS picks its kernel from the shape (on
#: the CPU, MKL's fp32 rows differ between M = 1, 2, 3, 7 and M >= 16; cuBLAS likewise), so every
#: row goes through a call of exactly this many rows (the last block zero-padded): the same kernel,
#: and in a fixed-shape call a row's bits do not depend on its position (tests/test_batch_invariant.py).
BI_ROWS = 16


def _padded(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s rows followed by zero rows up to :data:`BI_ROWS` (a new tensor)."""
    return None if t is None else torch.cat([t, t.new_zeros(BI_ROWS - t.shape[0], *t.shape[1:])])


def _row_blocks(product, args: GemmArgs, a, b, fused, target, beta1: bool) -> None:
    """``product`` on blocks of :data:`BI_ROWS` rows of ``a`` (docs/design.md §1, batch invariance),
    each block the same shape. The row-wise operands (the pre-activation, the bias-gradient's rows)
    are sliced with ``a``; the last block runs on zero-padded copies and only its rows are kept."""
    M = a.shape[0]
    for start in range(0, M, BI_ROWS):
        n = min(BI_ROWS, M - start)
        sl = slice(start, start + n)
        pre = None if args.pre_activation is None else args.pre_activation[sl]
        gb = None if args.grad_bias_out is None else args.grad_bias_out[sl]
        if n == BI_ROWS:
            product(replace(args, pre_activation=pre, grad_bias_out=gb), a[sl], b, fused, target[sl], beta1)
            continue
        tgt, gbp = _padded(target[sl]), _padded(gb)
        product(replace(args, pre_activation=_padded(pre), grad_bias_out=gbp), _padded(a[sl]), b, fused, tgt, beta1)
        target[sl].copy_(tgt[:n])
        if gb is not None:
            gb.copy_(gbp[:n])


# ---------------------------------------------------------------------------------------------
# grouped


def _plain_product(plan: GemmPlan, args: GemmArgs) -> bool:
    """Whether each group is just the backend's product (no prologue, epilogue or upcast to split)."""
    return (
        plan.compute_dtype == args.a.dtype
        and args.bias is None
        and args.activation is None
        and args.grad_activation is None
        and args.grad_bias_out is None
        and not (args.accumulate and "accumulate" in plan.split)
        and "batch_invariant" not in plan.split
    )


def run(plan: GemmPlan, args: GemmArgs, splits: list[int] | None, rows_mode: bool) -> torch.Tensor:
    """Execute ``plan`` on validated ``args``; ``splits`` set for grouped GEMMs. Returns the output.

    ``args.out`` may be None only when the plan fuses ``grouped`` (the backend allocates it);
    every other plan writes into a given ``out``.

    Rows mode: ``a`` (M, K) split by rows, ``b`` (G, K, N), ``out`` (M, N), bias (G, N).
    Contraction mode: ``a`` (N, M) and ``b`` (M, K) split along M, ``out`` (G, N, K),
    pre_activation like ``a``, grad_bias_out (G, N).
    """
    with get_backend(plan.backend).scope(args.a.device):
        return _run(plan, args, splits, rows_mode)


def _run(plan: GemmPlan, args: GemmArgs, splits: list[int] | None, rows_mode: bool) -> torch.Tensor:
    backend = get_backend(plan.backend)
    if splits is not None and "grouped" in plan.fused:
        return backend.grouped_product(args, splits)
    if splits is None:
        _run_one(plan, args)
        return args.out
    # Each group runs the very call ``_run_one`` would make. When that call is the backend's bare
    # product, make it directly: many small groups (64 experts x 256 tokens) were host-bound at
    # ~28 us per group through ``_run_one``'s bookkeeping; the bits are the same.
    plain = _plain_product(plan, args)
    one = replace(plan, split=tuple(f for f in plan.split if f != "grouped"))
    start = 0
    for g, m in enumerate(splits):
        end = start + m
        if rows_mode:
            a, b, out = args.a[start:end], args.b[g], args.out[start:end]
            extra = {
                "bias": None if args.bias is None else args.bias[g],
                "pre_out": None if args.pre_out is None else args.pre_out[start:end],
            }
        else:
            a, b, out = args.a[:, start:end], args.b[start:end], args.out[g]
            extra = {
                "pre_activation": None if args.pre_activation is None else args.pre_activation[:, start:end],
                "grad_bias_out": None if args.grad_bias_out is None else args.grad_bias_out[g],
            }
        if plain:
            backend.product(args, a, b, plan.fused, out, args.accumulate)
        else:
            _run_one(one, replace(args, a=a, b=b, out=out, **extra))
        start = end
    return args.out
