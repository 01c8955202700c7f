"""Dtype rules shared by the ops."""

from __future__ import annotations

import torch


def wide_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of sums over ``t``: at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def wgrad_dtype(in_dtype: torch.dtype, param_dtype: torch.dtype) -> torch.dtype:
    """What a weight-gradient GEMM over ``in_dtype`` operands writes for a ``param_dtype`` weight:
    the parameter's dtype where a GEMM can write it (``in_dtype`` or fp32, accumulated in fp32 and
    rounded once), else fp32, rounded to the parameter's dtype afterwards (fp16 operands of a bf16
    weight under fp16 autocast, and the reverse)."""
    return param_dtype if param_dtype in (in_dtype, torch.float32) else torch.float32
