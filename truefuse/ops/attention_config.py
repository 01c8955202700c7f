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
        chunk: keys per chunk of the forward (a multiple of ``block_n``): each chunk's softmax
            state starts empty and the chunks merge in order, in one program (prefill) or split
            across programs and merged by a second kernel (decode), with the same bits.
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
    chunk: int


# The interpreter runs CI's small fp32 shapes: small tiles keep its per-program cost low; chunks
# of one block so that CI's 18-key sequences merge chunks (and decode splits them).
_INTERPRETED = AttentionConfig(16, 16, 1, 1, 16, 16, 16, 16, 1, 1, 16)


def attention_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> AttentionConfig:
    """The tiles for a head dim padded to ``block_d`` (16..256) in ``dtype`` (fp16/bf16/fp32)."""
    if interpreted:
        return _INTERPRETED
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory of bf16's
        if block_d <= 64:
            return AttentionConfig(64, 32, 4, 2, 32, 64, 64, 32, 4, 2, 512)
        return AttentionConfig(32, 32, 4, 2, 16, 32, 32, 16, 4, 2, 512)
    if block_d <= 128:
        # H100, B=4, 32/8 heads, L=4096, causal (docs/benchmarks.md, Attention): forward 64x64
        # tiles, 4 warps: 2.27 ms (SDPA flash 1.79), decode B=32 1.21 ms (SDPA 1.76); 128x64,
        # 8 warps forwards in 1.96 ms but was not timed at decode under CUDA graphs. Backward
        # 64x64, 8 warps (11.7 ms fwd+bwd, SDPA 6.85): the faster 32x64 (dK/dV), 4 warps (8.4 ms)
        # gave dK that differed between two identical runs in bf16 (1 ulp, 19% of elements), so
        # it is not used until that is understood
        return AttentionConfig(64, 64, 4, 3, 64, 64, 64, 64, 8, 2, 512)
    return AttentionConfig(64, 32, 8, 2, 64, 32, 64, 32, 8, 1, 512)
