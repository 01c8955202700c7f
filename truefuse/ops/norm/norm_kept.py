"""``rms_norm_hf``'s kept launch in batch-invariant mode at decode: the norm of a Hugging Face
decoder layer, the same call every token and no gradient, in one launch from a kept record
(``ops/_launch/prepared.py``; issue 47 item 3). The mode's statistics are the norm kernel's
(``norm.py::rms_norm_hf_bi``), so the stock expression cannot stand in for it as in fast mode.

:func:`kept_hf_bi` keeps the launch ``rms_norm_hf_bi`` made under a key of everything its path
read (x's and the weight's shapes, strides, dtypes, devices and 16-byte alignment, eps, the
style) and replays it into a fresh output and statistics: the same kernel, arguments and grid,
the same bits (``tests/test_kept_launches.py``).
"""

from __future__ import annotations

import torch

from truefuse.config import get_tuning
from truefuse.ops._launch.prepared import KeptLaunches, ToKeep, launchable, layout, replayable, stream
from truefuse.ops.norm.norm import hf_bi_prepared

#: ``(go, y's dtype)`` by key
_KEPT = KeptLaunches()


def kept_hf_bi(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str):
    """``rms_norm_hf(x, weight, eps, style=style)`` in batch-invariant mode through the launch kept
    for this call's key (a new tensor shaped like ``x``); else, where the call may be kept, the key
    to hand :func:`keep` after the caller's path ran (a :class:`ToKeep`); else None: not plain CUDA tensors,
    an operand requiring grad with grad mode on, tracing, a dispatch mode or functorch transform."""
    if not replayable(x, weight) or type(eps) not in (float, int) or type(style) is not str:
        return None  # a bad eps or style: the path's checks name it (and a key must hash)
    xp, wp = x.data_ptr(), weight.data_ptr()
    key = (layout(x, xp), layout(weight, wp), eps, style, get_tuning())  # the tuning knobs choose the path (max_kernel_n)
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        go, dtype = kept
        if launchable(go):
            y = torch.empty(x.shape, dtype=dtype, device=x.device)
            rstd = torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device)
            yp, rp = y.data_ptr(), rstd.data_ptr()
            if not (yp | rp) & 15:  # as kept (the caching allocator's blocks are 512-byte aligned)
                go(stream(go), xp, wp, yp, rp)
                return y
        return None
    return ToKeep(key, kept) if kept > 0 else None


def keep(
    pending: ToKeep,
    x: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    y2: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    style: str,
) -> None:
    """Keep the launch the caller's path just made from ``x2`` (x's (M, N) rows) into ``y2`` and
    ``rstd`` under :func:`kept_hf_bi`'s ``pending``: where ``x2`` is a view of ``x`` (no copy between)
    and M is not 0."""
    go = None
    if x2.data_ptr() == x.data_ptr() and y2.numel():
        go = hf_bi_prepared(x2, weight, y2, rstd, eps, style)
    _KEPT.keep(pending, go, y2.dtype)


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
