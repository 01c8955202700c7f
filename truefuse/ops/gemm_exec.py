"""Carrying out a :class:`~truefuse.ops.gemm_plan.GemmPlan`: the backends' calls and the split steps.

Only :func:`run` is used from outside; ``truefuse.ops.gemm`` validates before calling it, so nothing
here checks user input.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace

import torch

from truefuse.config import get_config
from truefuse.ops.activation import activation_grad_ref, activation_ref
from truefuse.ops.gemm_plan import GemmPlan


def wide_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of sums over ``t``: at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def split_bias_grad(grad_output: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """DESIGN §3's split bias-gradient: ``grad_output`` (tokens, N) summed over tokens in at least
    fp32, rounded once to ``dtype`` (default ``grad_output``'s). The one formula every path uses."""
    return torch.sum(grad_output, dim=0, dtype=wide_dtype(grad_output)).to(dtype or grad_output.dtype)


@dataclass
class GemmArgs:
    """Validated arguments of one GEMM (or one group of a grouped GEMM)."""

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor | None  # written (or accumulated into); None only for a fused grouped call
    out_dtype: torch.dtype
    accumulate: bool
    bias: torch.Tensor | None
    activation: str | None
    pre_out: torch.Tensor | None  # where to keep the pre-activation, when asked for
    grad_activation: str | None
    pre_activation: torch.Tensor | None
    grad_bias_out: torch.Tensor | None  # where the bias-gradient goes, when asked for


# ---------------------------------------------------------------------------------------------
# backends: one product each, with the features the plan fused


def _torch_product(
    args: GemmArgs, a: torch.Tensor, b: torch.Tensor, fused: tuple[str, ...], target: torch.Tensor, beta1: bool
) -> None:
    widen = a.dtype != target.dtype
    kw = {"out_dtype": target.dtype} if widen else {}
    if beta1:
        torch.addmm(target, a, b, out=target, **kw)
    elif args.bias is not None and "bias" in fused:
        torch.addmm(args.bias.to(target.dtype), a, b, out=target, **kw)
    else:
        torch.mm(a, b, out=target, **kw)


def _triton_configs(dtype: torch.dtype):
    import triton

    block_k = 32 if dtype == torch.float32 else 64  # fixed per dtype: batch invariance
    if get_config().triton_interpret:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4})]
    shapes = [(128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4)]
    if dtype == torch.float32:
        shapes = [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]


_TUNED: dict = {}


def _triton_kernel(dtype: torch.dtype):
    """The Triton GEMM, autotuned over tile shapes only (BLOCK_K fixed per dtype)."""
    if dtype not in _TUNED:
        import triton

        from truefuse.kernels.gemm import _gemm_fwd_kernel

        _TUNED[dtype] = triton.autotune(
            configs=_triton_configs(dtype),
            key=["M", "N", "K", "ACCUMULATE", "GRAD_ACT", "GRAD_BIAS"],
            # tuning runs the kernel several times: an accumulated output must be restored
            restore_value=["c_ptr"],
        )(_gemm_fwd_kernel)
    return _TUNED[dtype]


def _triton_product(
    args: GemmArgs, a: torch.Tensor, b: torch.Tensor, fused: tuple[str, ...], target: torch.Tensor, beta1: bool
) -> None:
    import triton

    from truefuse.kernels.activation import ACT_CODES

    M, K = a.shape
    N = b.shape[1]
    grad_act = args.grad_activation if "grad_activation" in fused else None
    pre = args.pre_activation if grad_act else a
    gb = args.grad_bias_out if "grad_bias" in fused else None
    if M == 0 or N == 0:
        if gb is not None:
            gb.zero_()
        return
    gb_target = gb
    if gb is not None and gb.dtype != torch.float32 and get_config().triton_interpret:
        # the interpreter's narrowing casts truncate (DESIGN §8): round on the host instead
        gb_target = torch.empty(gb.shape, dtype=torch.float32, device=gb.device)
    kernel = _triton_kernel(a.dtype)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](
        a,
        b,
        target,
        pre,
        gb_target if gb is not None else target,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        target.stride(0),
        target.stride(1),
        pre.stride(0),
        pre.stride(1),
        ACCUMULATE=beta1,
        GRAD_ACT=ACT_CODES[grad_act],
        GRAD_BIAS=gb is not None,
        IEEE=a.dtype == torch.float32,
    )
    if gb_target is not gb:
        gb.copy_(gb_target)


_PRODUCTS = {"torch": _torch_product, "triton": _triton_product}


# ---------------------------------------------------------------------------------------------
# one GEMM: split prologue, fused product, split epilogue


def _run_one(plan: GemmPlan, args: GemmArgs) -> None:
    fused, split = plan.fused, plan.split
    a = args.a
    if args.grad_activation is not None and "grad_activation" in split:
        a = activation_grad_ref(a, args.pre_activation, args.grad_activation)
    if args.grad_bias_out is not None and "grad_bias" in split:
        # DESIGN §3: the split bias-gradient is grad_output.float().sum(0) cast to the input dtype
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
    _PRODUCTS[plan.backend](args, a, b, fused, target, beta1)

    if args.bias is not None and "bias" in split:
        target.add_(args.bias.to(target.dtype))
    if args.activation is not None:
        out.copy_(activation_ref(target, args.activation))
    if args.accumulate and "accumulate" in split:
        out.add_(target)


# ---------------------------------------------------------------------------------------------
# grouped


def _run_grouped_fused(args: GemmArgs, splits: list[int]) -> torch.Tensor:
    import torch.nn.functional as F

    offs = torch.tensor(list(itertools.accumulate(splits)), dtype=torch.int32, device=args.a.device)
    res = F.grouped_mm(args.a, args.b, offs=offs, out_dtype=args.out_dtype)
    # grouped_mm has no out=: copy only when the caller gave an output to fill
    return res if args.out is None else args.out.copy_(res)


def _plain_product(plan: GemmPlan, args: GemmArgs) -> bool:
    """Whether each group is just the torch product (no prologue, epilogue or upcast to split)."""
    return (
        plan.backend == "torch"
        and plan.compute_dtype == args.a.dtype
        and args.bias is None
        and args.activation is None
        and args.grad_activation is None
        and args.grad_bias_out is None
        and not (args.accumulate and "accumulate" in plan.split)
    )


@contextlib.contextmanager
def _fp32_reductions(device: torch.device):
    """cuBLAS may reduce split-K partials in bf16/fp16 (PyTorch's default allows it): on small-M
    GEMMs that lost accuracy (measured on the H200: 16-token chunks of the linear cross-entropy's
    logits GEMM, loss error 1.6x the plain path's), so every truefuse GEMM forbids it."""
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    old = m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = old


def run(plan: GemmPlan, args: GemmArgs, splits: list[int] | None, rows_mode: bool) -> torch.Tensor:
    """Execute ``plan`` on validated ``args``; ``splits`` set for grouped GEMMs. Returns the output.

    ``args.out`` may be None only when the plan fuses ``grouped`` (the backend allocates it);
    every other plan writes into a given ``out``.

    Rows mode: ``a`` (M, K) split by rows, ``b`` (G, K, N), ``out`` (M, N), bias (G, N).
    Contraction mode: ``a`` (N, M) and ``b`` (M, K) split along M, ``out`` (G, N, K),
    pre_activation like ``a``, grad_bias_out (G, N).
    """
    with _fp32_reductions(args.a.device):
        return _run(plan, args, splits, rows_mode)


def _run(plan: GemmPlan, args: GemmArgs, splits: list[int] | None, rows_mode: bool) -> torch.Tensor:
    if splits is not None and "grouped" in plan.fused:
        return _run_grouped_fused(args, splits)
    if splits is None:
        _run_one(plan, args)
        return args.out
    # Each group runs the very call ``_run_one`` would make. When that call is the bare torch
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
            _torch_product(args, a, b, plan.fused, out, args.accumulate)
        else:
            _run_one(one, replace(args, a=a, b=b, out=out, **extra))
        start = end
    return args.out
