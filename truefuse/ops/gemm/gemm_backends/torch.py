"""The ``torch`` GEMM backend: cuBLAS/cuBLASLt (CUDA) or the CPU BLAS, through PyTorch ops.

Capabilities: CPU PyTorch has no ``mm``/``addmm`` with ``out_dtype`` (CUDA has, torch >= 2.9), so
widening is CUDA-only. PyTorch exposes no bias-gradient epilogue and no activation-derivative
prologue, and we keep forward activations out of cuBLASLt (its GELU is the tanh form only).
``grouped`` is ``torch.nn.functional.grouped_mm``, documented for bf16 on CUDA; it has no beta=1
and no per-group bias, so it fuses only with the product itself.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from truefuse.ops.gemm.gemm_backends._base import BF16, SAME, WIDEN, GemmArgs, GemmBackend, rows

CAPABILITIES = frozenset(
    rows(["mm", "accumulate", "bias"], SAME, ["cpu", "cuda"])
    | rows(["mm", "out_dtype", "accumulate"], WIDEN, ["cuda"])
    | rows(["grouped"], [(BF16, BF16)], ["cuda"])  # torch 2.11: "output dtype must match mat_a"
)

#: grouped_mm takes no beta=1 and no bias: with anything more the groups run as a loop, each
#: group's GEMM still fusing the rest.
FUSES_ONLY_WITH = {"grouped": frozenset({"mm", "out_dtype", "grouped"})}


def available(device: str) -> bool:
    return device in ("cpu", "cuda")


def product(args: GemmArgs, a: torch.Tensor, b: torch.Tensor, fused: tuple[str, ...], target: torch.Tensor, beta1: bool) -> None:
    widen = a.dtype != target.dtype
    kw = {"out_dtype": target.dtype} if widen else {}
    if beta1:
        torch.addmm(target, a, b, out=target, **kw)
    elif args.bias is not None and "bias" in fused:
        torch.addmm(args.bias.to(target.dtype), a, b, out=target, **kw)
    else:
        torch.mm(a, b, out=target, **kw)


def grouped_product(args: GemmArgs, splits: list[int]) -> torch.Tensor:
    import torch.nn.functional as F

    offs = torch.tensor(list(itertools.accumulate(splits)), dtype=torch.int32, device=args.a.device)
    res = F.grouped_mm(args.a, args.b, offs=offs, out_dtype=args.out_dtype)
    # grouped_mm has no out=: copy only when the caller gave an output to fill
    return res if args.out is None else args.out.copy_(res)


@contextlib.contextmanager
def fp32_reductions(device: torch.device):
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


BACKEND = GemmBackend(
    name="torch",
    capabilities=CAPABILITIES,
    available=available,
    product=product,
    fuses_only_with=FUSES_ONLY_WITH,
    grouped_product=grouped_product,
    scope=fp32_reductions,
)
