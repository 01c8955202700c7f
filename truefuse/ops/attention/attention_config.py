"""Launch table of the attention kernels (``kernels/attention.py``).

The key block ``block_n`` and the chunk ``chunk`` are chosen from the head dimension (padded to a
power of two) and the dtype only, never from the batch, the number of heads or the sequence
lengths: they order each query row's reduction, so a shape-dependent choice would give a row
different bits in prefill, in a padded batch and in decode (docs/design.md §1, batch invariance;
docs/attention.md). The forward's query rows per program may follow the number of query rows
(:func:`forward_tile`): a row's reduction order does not depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of the three passes.

    Attributes:
        block_m, fwd_warps, fwd_stages: the forward's query rows per program and launch when there
            are more than ``small_m`` query rows (prefill).
        small_m, small_warps: the forward's rows per program and warps for at most ``small_m``
            query rows (decode); rows per warp group kept at 64 on the GPU, so that each row's
            dots run the same MMA instruction as in prefill.
        block_n: the fixed key block every query row reduces over (prefill and decode alike).
        chunk: keys per chunk of the forward (a multiple of ``block_n``): each chunk's softmax
            state starts empty and the chunks merge in order, in one program (prefill) or split
            across programs and merged by a second kernel (decode), with the same bits.
        dkdv_m, dkdv_n, dkdv_warps, dkdv_stages: the dK/dV pass's query rows per step, keys per
            program and launch.
        dq_m, dq_n, dq_warps, dq_stages: the dQ pass's query rows per program, keys per step and
            launch (``dq_n`` orders dQ's reduction over the keys, so it too depends on the head
            dim and dtype only).
        full_blocks: the forward and dQ run the key blocks every row of the program sees whole
            (below the causal diagonal, inside the keys; no mask tensor, no window) in a loop of
            their own without the mask's compares and selects, then the rest masked, and dK/dV
            takes such a (query block, key block) pair's scores unmasked: the same blocks in the
            same order, so the same bits either way (``kernels/attention.py``, ``_full_end``), as
            the Triton tutorial's causal stages split them.
        state_in_memory: the prefill forward keeps its rows' accumulator in a global-memory tile
            between key chunks instead of in registers beside the chunk's own (one accumulator
            live through the key loop, not two: the same merges, the same bits;
            ``kernels/attention.py::_row_state``); decode's calls keep it in registers. The tiles
            are a transient (B·H·L_q, head dim) fp32 buffer: twice a bf16 q's bytes.
    """

    block_m: int
    fwd_warps: int
    fwd_stages: int
    small_m: int
    small_warps: int
    block_n: int
    chunk: int
    dkdv_m: int
    dkdv_n: int
    dkdv_warps: int
    dkdv_stages: int
    dq_m: int
    dq_n: int
    dq_warps: int
    dq_stages: int
    full_blocks: bool = False
    state_in_memory: bool = False


# The interpreter runs CI's small fp32 shapes: small tiles keep its per-program cost low; chunks
# of two 8-key blocks so that CI's 18-key sequences merge chunks at a chunk's end, not at every
# block's (and decode splits them). Full blocks and the state in memory on: CI runs those paths
# (tests/test_attention.py compares each with the default's bits).
_INTERPRETED = AttentionConfig(16, 1, 1, 16, 1, 8, 16, 16, 16, 1, 1, 16, 16, 1, 1, True, True)


def attention_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> AttentionConfig:
    """The tiles for a head dim padded to ``block_d`` (16..256) in ``dtype`` (fp16/bf16/fp32)."""
    if interpreted:
        return _INTERPRETED
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory of bf16's
        if block_d <= 64:
            return AttentionConfig(64, 4, 2, 64, 4, 32, 512, 32, 64, 4, 2, 64, 32, 4, 2)
        return AttentionConfig(32, 4, 2, 32, 4, 32, 512, 16, 32, 4, 2, 32, 16, 4, 2)
    if block_d <= 128:
        # H100, B=4, 32/8 heads, causal, bf16 (docs/benchmarks.md, Attention): forward 128x64, 8
        # warps at 0.90x SDPA flash (64x64, 4 warps: 0.77x); decode 64 rows, 4 warps. dK/dV
        # 64x64, 4 warps, 2 stages: fwd + bwd 6.81 ms against 7.73 at 3 stages, two runs bitwise
        # equal (L=4096; experiments/exp_attention_configs.py, docs/results/attention/
        # attention_configs_h100_2026-12-08.log); dQ 128x64, 8 warps, 2 stages (dQ at 8 warps with
        # 64 rows cost 2 ms of 10). A 32-row dK/dV tile differed between two identical runs
        # whenever num_stages > 1 (17% of bf16 dK elements at 3 stages)
        return AttentionConfig(128, 8, 3, 64, 4, 64, 512, 64, 64, 4, 2, 128, 64, 8, 2)
    return AttentionConfig(64, 8, 2, 64, 8, 32, 512, 64, 32, 8, 1, 64, 32, 8, 1)


def forward_tile(cfg: AttentionConfig, L_q: int) -> tuple[int, int]:
    """(query rows per program, warps) of the forward for ``L_q`` query rows."""
    return (cfg.small_m, cfg.small_warps) if L_q <= cfg.small_m else (cfg.block_m, cfg.fwd_warps)
