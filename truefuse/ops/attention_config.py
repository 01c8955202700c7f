"""Launch table of the attention kernels (``kernels/attention.py``).

Every entry is chosen from the head dimension (padded to a power of two) and the dtype only, never
from the batch, the number of heads or the sequence lengths: the key block size orders each query
row's reduction, so a shape-dependent choice would give a row different bits in prefill, in a
padded batch and in decode (docs/design.md §1, batch invariance; docs/attention.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of the three passes.

    Attributes:
        block_m, block_n: the forward's query rows per program and keys per step; ``block_n`` is
            the fixed key block every query row reduces over (prefill and decode alike).
        fwd_warps, fwd_stages: the forward's launch.
        dkdv_m, dkdv_n: the dK/dV pass's query rows per step and keys per program.
        dq_m, dq_n: the dQ pass's query rows per program and keys per step (``dq_n`` orders dQ's
            reduction over the keys, so it too depends on the head dim and dtype only).
        bwd_warps, bwd_stages: both backward passes' launch.
    """

    block_m: int
    block_n: int
    fwd_warps: int
    fwd_stages: int
    dkdv_m: int
    dkdv_n: int
    dq_m: int
    dq_n: int
    bwd_warps: int
    bwd_stages: int


# The interpreter runs CI's small fp32 shapes: small tiles keep its per-program cost low.
_INTERPRETED = AttentionConfig(16, 16, 1, 1, 16, 16, 16, 16, 1, 1)


def attention_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> AttentionConfig:
    """The tiles for a head dim padded to ``block_d`` (16..256) in ``dtype`` (fp16/bf16/fp32)."""
    if interpreted:
        return _INTERPRETED
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory of bf16's
        if block_d <= 64:
            return AttentionConfig(64, 32, 4, 2, 32, 64, 64, 32, 4, 2)
        return AttentionConfig(32, 32, 4, 2, 16, 32, 32, 16, 4, 2)
    if block_d <= 64:
        return AttentionConfig(128, 64, 4, 3, 32, 128, 128, 32, 4, 3)
    if block_d <= 128:
        return AttentionConfig(128, 64, 8, 3, 64, 64, 64, 64, 8, 2)
    return AttentionConfig(64, 32, 8, 2, 32, 32, 32, 32, 8, 1)
