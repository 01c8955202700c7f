"""docs/design.md §3's split bias-gradient: the one formula every path that does not fuse it uses.

``truefuse.gemm``'s split step and ``gemm_ref``, ``LinearFunction`` and the grouped layers all call
:func:`split_bias_grad`; the Triton GEMM's fused epilogue sums the same rounded operand in fp32.
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.dtypes import wide_dtype


def split_bias_grad(grad_output: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``grad_output`` (tokens, N) summed over tokens in at least fp32, rounded once to ``dtype``
    (default ``grad_output``'s)."""
    return torch.sum(grad_output, dim=0, dtype=wide_dtype(grad_output)).to(dtype or grad_output.dtype)
