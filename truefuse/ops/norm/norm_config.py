"""The norm kernels' launch tables: block sizes, warps, programs per SM, stages and schedule
choices, each from the hidden size (and dtype, norm) only, never the row count (batch invariance,
docs/design.md §1). Data and pure functions; the launchers in ``ops/norm/norm.py`` read them.

Each choice names the experiment that measured it (experiments/, docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def block_and_warps(n: int) -> tuple[int, int]:
    """BLOCK_N and num_warps, from the hidden size only (never the row count: batch invariance).

    The one choice for every kernel that norms rows with ``kernels/norm.py::rms_norm_row``: the norm
    forward here and the fused allreduce's (``ops/allreduce.py``), whose normed rows and rstd must
    be the bits of ``truefuse.rms_norm`` (the row's sum reduces in an order set by both)."""
    block = max(16, 1 << (n - 1).bit_length())
    return block, max(1, min(16, block // 512))


def fwd_programs_per_sm(n: int) -> int:
    """Persistent forward programs per SM (0: one program per row), from the hidden size only.
    Either schedule norms each row with the same code and layout (BLOCK_N and num_warps of
    :func:`block_and_warps`): the same bits. Measured on an H200 (experiments/exp_norm_sweep.py at d49a912,
    docs/log/benchmarks_2026-11.md): persistent is 1.1-1.35x faster from 5120 up and at 1024 and 2880; at 1024
    32 programs per SM beat 16 by 0.6 µs of the 8192-row forward + backward (exp_norm_sums.py at d49a912)."""
    if n <= 1024:
        return 32
    if n <= 2048 or 2880 < n <= 4096:
        return 0
    if n <= 4096:
        return 4
    return 2 if n < 8192 else 4


def ln_fwd_config(n: int) -> tuple[int, int, str]:
    """LayerNorm forward's (num_warps, programs per SM (0: one per row), WB: where the weight and
    bias rows live between rows, ``kernels/norm.py::_norm_fwd_kernel``), from the hidden size only.
    Not coupled to the allreduce (only RMSNorm's forward is): its own choice. Measured on an H200
    (experiments/exp_norm_sums.py at d49a912): w and b held in bf16 ("narrow") are 3-7% faster than in fp32 at
    2048, 2880, 7168 and 16384, a tie elsewhere; loading them per row from L1 is never faster."""
    if n <= 1024:
        return block_and_warps(n)[1], 16, "reg"
    if n <= 2880:
        return 4, 0, "narrow"
    if n <= 4096:
        return 8, 0, "reg"
    return 16, (2 if n < 16384 else 4), "narrow"


def ln_fwd_staged_config(n: int, dtype: torch.dtype) -> tuple[int, int, int] | None:
    """The TMA-staged LayerNorm forward's (num_warps, programs per SM, stages), or None where the
    pointer kernel runs: from the hidden size and dtype only (a row's bits are each kernel's own).
    2-byte dtypes whose rows are whole 16-byte units (H % 8 == 0: a TMA row stride). Three rows in
    flight per program and 96 KB of staged rows per SM (16384 // BLOCK_N programs): measured on an
    H200 at 1024, 2880, 5120, 8192 and 16384 (experiments/exp_norm_tma.py at d49a912; two stages measured
    1.1-3x slower). 8 warps from 5120 to 8192 (not ``ln_fwd_config``'s 16): 3.6% of the forward +
    backward at 5120 (experiments/exp_norm_resweep.py). Where the row pads most (5120 of 8192
    lanes), 4 warps and four rows in flight (128 KB per SM): 1.3-2.4% of the forward + backward
    (``--what lnfwd``); four stages at 4096 and 8192, faster alone, cost the forward + backward
    6-10% there."""
    if dtype.itemsize != 2 or n % 8:
        return None
    per_sm = max(1, min(32, 16384 // block_and_warps(n)[0]))
    if 4096 < n <= 6144:
        return 4, per_sm, 4
    return (8 if 4096 < n <= 8192 else ln_fwd_config(n)[0]), per_sm, 3


class BwdConfig(NamedTuple):
    """The backward's launch, from the hidden size only (see :func:`bwd_config`)."""

    warps: int
    rows: int  # rows per tile (the tile kernel; 1 with parts)
    per_sm: int  # programs per SM
    prefetch: bool  # the next tile's loads issued before this tile's math
    parts: tuple[int, int] | None = None  # (BLOCK_A, BLOCK_B): ``_norm_bwd_split_kernel``


def bwd_config(n: int, rms: bool = True) -> BwdConfig:
    """The backward's configuration, from the hidden size only (never the row count: a row's dx
    reduces in an order set by the blocks, the tile and num_warps alone). Measured on an H200
    (experiments/exp_norm_sweep.py, exp_norm_variants.py at d49a912): two-row tiles and more programs for
    small rows (1024: 1.8x), one program per SM and 16-32 warps for wide rows. Above 8192 the row in
    two halves (``_norm_bwd_split_kernel``) at 16 warps, x and dy held through the reductions: in
    the library's forward + backward at 16384 that beat the halves reloaded at 32 warps (RMSNorm)
    or 16 (LayerNorm) by 12-14% (8192 rows: 407 -> 351 µs, 563 -> 502 µs; exp_norm_resweep.py).
    Two parts with less padding (2880 = 2048 + 1024, 5120 = 4096 + 1024) measured 1-4% slower.
    LayerNorm's halves at 8 warps (with ``bwd_math``'s choices): 8.6-9.2% faster than at 16, the
    fastest of 8-32 warps and 1-4 programs per SM (16384: 469 -> 429 µs at 8192 rows)."""
    if n <= 1024:
        return BwdConfig(4, 2, 4, True)
    if n <= 2048:
        return BwdConfig(8, 2, 2, True)
    if n <= 4096:
        return BwdConfig(8, 1, 2, True)
    if n <= 8192:
        return BwdConfig(32 if rms else 16, 1, 1, True)
    return BwdConfig(16 if rms else 8, 1, 1, False, (8192, 8192))


#: the TMA boxes' row chunk of the staged backward (``kernels/norm.py::_norm_bwd_staged_kernel``):
#: (1, BLOCK_N // 64, 64) boxes measured 0-7% faster than (1, 1, BLOCK_N) ones, never slower by more than 1%
STAGED_INNER = 64

#: (lo, hi, (num_warps, programs per SM, stages)) for lo < H <= hi; elsewhere the pointer kernels
_BWD_STAGED_RMS = ((2048, 3072, (8, 2, 4)), (4096, 6144, (8, 1, 4)))
_BWD_STAGED_LN = (
    (1024, 2048, (4, 4, 3)), (2048, 3072, (4, 2, 4)), (4096, 6144, (8, 1, 4)), (6144, 7680, (16, 1, 4)), (7680, 8192, (8, 1, 3)),
)  # fmt: skip


def bwd_staged_config(n: int, dtype: torch.dtype, rms: bool = True) -> tuple[int, int, int] | None:
    """The TMA-staged backward's (num_warps, programs per SM, stages), or None where the pointer
    kernels of :func:`bwd_config` run: from the hidden size, dtype and norm only (a row's dx bits are
    each kernel's own). 2-byte x and dy whose rows are whole 64-column chunks (the kernel's
    ``STAGED_INNER``-wide TMA boxes). Measured on an H200 in the library's forward + backward
    (experiments/exp_norm_resweep.py, 2026-11-23): where the row pads most (2880 of 4096, 5120 of
    8192) RMSNorm gains 6-9%, LayerNorm 4-8%; LayerNorm 5.5% at 7168, 1-2% at 2048 and 8192; the
    pointer kernels stay ahead at 1024 (5-9%) and 16384 (40%), a tie at 4096."""
    if dtype.itemsize != 2 or n % STAGED_INNER:
        return None
    table = _BWD_STAGED_RMS if rms else _BWD_STAGED_LN
    return next((cfg for lo, hi, cfg in table if lo < n <= hi), None)


def pdl_trigger(kernel: str, n: int, rms: bool) -> int:
    """When the norm's ``kernel`` (``"fwd"``, ``"bwd"``) lets the next kernel's programs launch
    under PDL (``kernels/norm.py::_pdl_enter``): 1 at its start (they wait in place, holding SM
    slots), 2 as its programs exit. From the hidden size only; the schedule, never the bits.
    Measured on an H200 at 8192 and 16384 rows (experiments/exp_norm_pdl_trigger.py): LayerNorm's
    two-part backward (> 8192) launched beside its forward costs 43-83 µs of 0.56-1.1 ms at 16384;
    RMSNorm's sum launched as the backward exits gains 0.5-1.4 µs from 2048 to 8192; every other
    choice within ±0.6 µs. The sum (last of the three) triggers at its start."""
    if kernel == "fwd":
        return 2 if not rms and bwd_config(n, rms).parts is not None else 1
    return 2 if kernel == "bwd" and rms and 2048 <= n <= 8192 else 1


def sum_config(n: int, two: bool = False) -> tuple[int, int, int]:
    """``_sum_partials_kernel``'s (BLOCK_P, BLOCK_N, num_warps): tall thin tiles, few serial loads;
    up to 4096 the backward's 264-528 partial rows in one round where that measured faster (1024,
    and LayerNorm's two sums in one launch: 4.5 -> 3.2 µs at 1024; experiments/exp_norm_sums.py at d49a912)."""
    if n <= 4096:
        return (512 if n <= 1024 or two else 256), 16, 8
    return 128, 16, 4


def bwd_math(n: int, rms: bool) -> dict:
    """Two schedule choices of the staged and two-part backward kernels that leave every bit as it
    is (dx, dw and db checked equal on an H200), from the hidden size and norm only. ONE_REDUCE:
    LayerNorm's two row sums in one ``tl.reduce`` (one cross-warp exchange per row). REMAT: x and
    dy held in bf16 through the row's sums and widened again after (``kernels/norm.py::_widen``),
    not held in fp32. Measured in the library's forward + backward (experiments/exp_norm_resweep.py
    --what math, two runs): LayerNorm 5120 -2 to -3.5% with ONE_REDUCE (a tie or up to +1.7%
    elsewhere); LayerNorm 16384 -4.6 to -5.7% with both (38 -> 14 spilled registers), +4% with
    REMAT alone, +27-30% with ONE_REDUCE alone; REMAT costs RMSNorm 2% at 16384 and 45% in the
    staged kernel at 5120."""
    ln = not rms
    return {"ONE_REDUCE": ln and (4096 < n <= 6144 or n > 8192), "REMAT": ln and n > 8192}
