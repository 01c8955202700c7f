"""The batch-invariant grouped GEMM's launch tables: ONE tile configuration per (problem kind,
dtype, GPU), part of the bits, never chosen from the token count or the group sizes
(docs/design.md §1, "Grouped GEMM"). Data and :func:`tile_config`; the launchers in
``ops/grouped_gemm/grouped_gemm.py`` read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from truefuse.ops._launch.triton import capability


@dataclass(frozen=True)
class TileConfig:
    """One grouped GEMM launch configuration.

    Attributes:
        block_m: rows of a tile (``rows``), or the rows reduced per step (``wgrad``, ``bgrad``).
        block_n, block_k: the output tile's columns (``rows``: N tile and K step; ``wgrad``: the
            (N, K) tile of dW_g; ``bgrad``: N tile, block_k unused).
        num_warps, num_stages: Triton launch parameters (do not change the bits).
        programs_per_sm: persistent programs per SM (grid = SMs × this, at most the tile count);
            0: one program per tile (the grid is the tile bound).
        tma: fp16/bf16 operands through TMA tensor descriptors (sm_90+; the Hopper kernels of
            ``kernels/grouped_gemm.py``) where the weight's shape allows (16-byte rows), else the
            pointer kernels. Chosen by the configuration and the weight shape, never by the batch.
        tma_epilogue: (``wgrad`` with ``tma``) dW written, or added into ``main_grad``, through a
            descriptor of the output (where its rows are 16-byte aligned; else pointers), in
            ``epilogue_split`` column parts (1, 2 or 4) of the tile. Neither changes the bits.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1
    tma: bool = False
    tma_epilogue: bool = False
    epilogue_split: int = 1


HALF = (torch.float16, torch.bfloat16)

#: CUDA configurations, one per (kind, dtype), the pointer kernels (GPUs without a tuned entry below):
#: 128×128 output tiles, 64-deep K steps (rows) or 64-row reduction steps (wgrad).
_CUDA_CONFIGS: dict[tuple[str, torch.dtype], TileConfig] = {
    **{("rows", dt): TileConfig(128, 128, 64, num_warps=8, num_stages=3, programs_per_sm=2) for dt in HALF},
    **{("wgrad", dt): TileConfig(64, 128, 128, num_warps=8, num_stages=3, programs_per_sm=1) for dt in HALF},
    ("rows", torch.float32): TileConfig(64, 64, 32, num_warps=4, num_stages=3, programs_per_sm=2),
    ("wgrad", torch.float32): TileConfig(32, 64, 64, num_warps=4, num_stages=3, programs_per_sm=2),
    **{("bgrad", dt): TileConfig(32, 128, 0, num_warps=4, num_stages=1) for dt in (*HALF, torch.float32)},
}

# >>> TUNED CONFIGURATIONS GO HERE <<<
# A measured per-GPU configuration (e.g. a TMA / warp-specialised variant on sm_90) replaces an entry
# above, keyed by (kind, dtype, torch.cuda.get_device_capability()). It must stay ONE entry per key:
# never chosen from M or the group sizes, or batch invariance is lost. Changing an entry changes the
# bits (not the contract), so record it in docs/design.md's "Grouped GEMM" subsection.
_TUNED_CONFIGS: dict[tuple[str, torch.dtype, tuple[int, int]], TileConfig] = {
    # Hopper (H100/H200), measured on an H200 (experiments/exp_grouped_gemm_tune.py, docs/design.md
    # "Grouped GEMM"): the TMA kernels. Forward/dgrad: 128×256 tiles, 64-deep K steps, 4 stages.
    **{("rows", dt, (9, 0)): TileConfig(128, 256, 64, num_warps=8, num_stages=4, programs_per_sm=1, tma=True) for dt in HALF},
    # wgrad: 128×128 dW tiles in 64-row steps, two programs per SM (123 registers, 96 KiB of shared
    # memory on triton 3.6: both resident; a triton 3.9 compile for sm_90 keeps a separate epilogue
    # buffer, 160 KiB: one per SM, so recheck on an upgrade),
    # written (or added into main_grad) through a TMA descriptor: the same bits, main_grad 0.77× /
    # 0.83× the pointer epilogue's layer time at 128 × 128 / 64 × 256 (H200, docs/log/benchmarks_2026-11.md);
    # "wgrad_large" (a layer of >= _LARGE_LAYER weights per group): 128×256 tiles, one program per SM.
    **{
        ("wgrad", dt, (9, 0)): TileConfig(64, 128, 128, num_warps=8, num_stages=3, programs_per_sm=2, tma=True, tma_epilogue=True)
        for dt in HALF
    },
    **{
        ("wgrad_large", dt, (9, 0)): TileConfig(64, 128, 256, num_warps=8, num_stages=3, programs_per_sm=1, tma=True)
        for dt in HALF
    },
    # ... adding into an fp32 main_grad: the same tiles, the epilogue through a TMA descriptor in two
    # 128×128 parts; through pointers the whole 128×256 fp32 tile spilled 424 bytes of stack. H200,
    # 8 × 2048 layer with main_grad: 29.9 ms against 31.8 (four parts: 30.4). An _acc entry must keep
    # the plain entry's fp32 sums (test_main_grad_accumulation: main_grad += dW is start + the plain
    # fp32 dW, bitwise): other N×K tiles, warps, stages or programs per SM with the same 64-row steps
    # did (exp_grouped_gemm_acc.py at d49a912, every candidate bitwise), but none was faster (docs/log/benchmarks_2026-11.md)
    **{
        ("wgrad_large_acc", dt, (9, 0)): TileConfig(
            64, 128, 256, num_warps=8, num_stages=3, programs_per_sm=1, tma=True, tma_epilogue=True, epilogue_split=2
        )
        for dt in HALF
    },
}

#: Weights per group (N × K) from which a GEMM takes its kind's ``<kind>_large`` configuration
#: where one exists: a property of the layer's shape, never of the batch (2^24: 4096 × 4096).
_LARGE_LAYER = 1 << 24

#: Under the CPU interpreter (fp32 only): small tiles, chosen by the device, never by the sizes.
_INTERPRETER_CONFIG = TileConfig(16, 16, 16, num_warps=1, num_stages=1)
INTERPRETER_PROGRAMS = 3


def tile_config(
    kind: str, dtype: torch.dtype, device: torch.device, weights_per_group: int = 0, accumulate: bool = False
) -> TileConfig:
    """The configuration of problem ``kind`` (``rows``, ``wgrad``, ``bgrad``) for ``dtype`` on ``device``;
    ``rows`` and ``wgrad`` also by the layer's weights per group (N × K, fixed per layer; never the
    batch: a ``<kind>_large`` entry from 2^24) and ``wgrad`` by whether it adds into ``main_grad``
    (a ``<kind>_acc`` entry where one exists: the option, never the batch)."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    cap = capability(device.index if device.index is not None else torch.cuda.current_device())
    if kind in ("rows", "wgrad"):
        size = f"{kind}_large" if weights_per_group >= _LARGE_LAYER else kind
        for key in (f"{size}_acc", size) if accumulate else (size,):
            if (key, dtype, cap) in _TUNED_CONFIGS:
                return _TUNED_CONFIGS[(key, dtype, cap)]
    return _TUNED_CONFIGS.get((kind, dtype, cap)) or _CUDA_CONFIGS[(kind, dtype)]
