"""Dtype rules shared by the ops."""

from __future__ import annotations

import torch


def wide_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of sums over ``t``: at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)
