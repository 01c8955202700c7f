"""Batch-invariant mode's launch table for the Triton GEMM (docs/design.md §1 and §3, docs/gemm.md).

In the mode a row's bits must not depend on M. BLOCK_K is fixed per dtype in every entry (64 for
bf16/fp16, 32 for fp32), there is no split-K and no atomic: each output element is one K loop of
BLOCK_K steps in one order, whatever tile computes it. The tile (BLOCK_M, BLOCK_N, warps, stages)
only decides which program computes a row, so it may be chosen from M: on an H100 (triton 3.6)
every tile tried, 16×16 to 256×128, 2 to 8 warps, 3-10 stages, mma and wgmma, gave the same bits
(docs/benchmarks.md, "Batch-invariant GEMM"). That is a measured property, not a guarantee of the
compiler: every entry of this table is checked bitwise against the reference tile on the GPU
(``tests/test_batch_invariant.py::test_bi_table_entries_same_bits_gpu``, ``bench_bi_gemm``'s
``table_same_bits``); an entry that fails there must leave the table.

``TABLE`` maps (dtype group, B layout) to one tile per M bucket (``M_BUCKETS``). The layout:
``"nt"`` when B's K dimension is contiguous (the forward ``x Wᵀ``), ``"nn"`` otherwise (the input
gradient ``dy W``). Chosen by ``experiments/exp_bi_gemm_tiles.py`` (``--write`` rewrites the block
between the markers) from its timings against cuBLAS, bitwise-equal candidates only.
"""

from __future__ import annotations

import torch

#: BLOCK_K per dtype group: never chosen from M, N or K (batch invariance)
BLOCK_K = {"bf16": 64, "fp32": 32}
#: the upper ends of the M buckets (the last one open)
M_BUCKETS = (16, 64, 256, None)
#: the tile of the single-configuration mode before the table (the sweep's bit reference)
REFERENCE = {"bf16": (128, 128, 8, 4), "fp32": (64, 64, 4, 3)}
GROUP_M = 8

# BEGIN TABLE
TABLE = {
    ("bf16", "nt"): ((16, 16, 2, 8), (64, 32, 4, 8), (128, 64, 4, 4), (256, 128, 8, 4)),
    ("bf16", "nn"): ((16, 32, 4, 10), (64, 32, 4, 8), (128, 128, 8, 4), (128, 256, 8, 3)),
    ("fp32", "nt"): ((32, 32, 4, 3), (32, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 3)),
    ("fp32", "nn"): ((32, 32, 4, 3), (32, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 3)),
}
# END TABLE


#: Decode tiles of the input gradient (layout ``"nn"``: B's N contiguous) for an output of at least
#: ``WIDE_N`` columns, per decode bucket (M ≤ 16, M ≤ 64): 64-column tiles read B's rows in 128-byte
#: runs and still give 224+ programs at N = 14336, where the table's 32-column tiles run at 1.24×
#: cuBLAS against 0.93× (H100, CUDA graphs; experiments/exp_bi_gemm_tiles.py --decode). Bitwise the
#: reference tile's like every entry.
WIDE_N = 8192
WIDE = {("bf16", "nn"): ((16, 64, 4, 4), (64, 64, 4, 4))}

#: The persistent TMA kernel's tile (``kernels/gemm_tma.py``; BLOCK_M, BLOCK_N, warps, stages) for
#: the last M bucket on Hopper, bf16/fp16, where the operands suit TMA (else the table's tile): on
#: an H100 at M = 8192, Llama-8B shapes, 0.998-1.047× cuBLAS forward and 0.986-1.019× input gradient
#: against the table tile's 1.143-1.225×, every candidate bitwise the reference tile's
#: (experiments/exp_bi_gemm_tma.py, docs/benchmarks.md "Batch-invariant GEMM")
TMA_TILE = {"nt": (128, 256, 8, 3), "nn": (128, 256, 8, 3)}


def group(dtype: torch.dtype) -> str:
    """The table's dtype group: fp16 takes bf16's tiles."""
    return "fp32" if dtype == torch.float32 else "bf16"


def bucket(M: int) -> int:
    """Index of M's bucket in ``M_BUCKETS``."""
    for i, top in enumerate(M_BUCKETS):
        if top is None or M <= top:
            return i
    raise AssertionError("the last bucket is open")


def layout(b: torch.Tensor) -> str:
    """``"nt"`` when ``b``'s (K, N) has K contiguous (``W.t()``), else ``"nn"``."""
    return "nt" if b.stride(0) == 1 and b.stride(1) != 1 else "nn"


def bi_tiles(dtype: torch.dtype, M: int, form: str, N: int = 0) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for ``M`` rows of an N-column output; BLOCK_K is
    ``BLOCK_K[group(dtype)]``. N (the weight's, never the batch's) picks a ``WIDE`` decode tile."""
    key, b = (group(dtype), form), bucket(M)
    wide = WIDE.get(key, ()) if N >= WIDE_N else ()
    return wide[b] if b < len(wide) else TABLE[key][b]


def entries(g: str) -> list[tuple[int, int, int, int]]:
    """Every distinct tile of dtype group ``g`` in the table (the GPU check's set)."""
    return sorted({t for table in (TABLE, WIDE) for (gg, _), tiles in table.items() if gg == g for t in tiles})
