"""A row-invariant GEMM for tests of batch-invariant callers: ``truefuse.gemm`` one row of ``a`` at
a time, so every row is the same (1, K) x (K, N) call whatever the batch. It stands in for the
planner's batch-invariant GEMM (docs/design.md §1) where a test checks the logic above the GEMM."""

from __future__ import annotations

import torch

from truefuse.ops.gemm import gemm


def row_gemm(a, b, *, out=None, accumulate=False, bias=None, out_dtype=None, **kw):
    """``truefuse.gemm(a, b, ...)`` computed row by row of ``a`` (2-D forms only)."""
    if kw:
        raise NotImplementedError(f"row_gemm: {sorted(kw)}")
    if out is None:
        dtype = out_dtype or a.dtype
        out = torch.empty(a.shape[0], b.shape[1], dtype=dtype, device=a.device)
        accumulate = False
    for i in range(a.shape[0]):
        gemm(a[i : i + 1], b, out=out[i : i + 1], accumulate=accumulate, bias=bias)
    return out


def force_row_gemm(monkeypatch, *modules) -> None:
    """Make ``modules`` (each importing ``gemm`` by name) call :func:`row_gemm`."""
    for m in modules:
        monkeypatch.setattr(m, "gemm", row_gemm)
