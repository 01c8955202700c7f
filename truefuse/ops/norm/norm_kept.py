"""``rms_norm_hf``'s kept launches: a Hugging Face decoder layer's norm, whose call repeats exactly
(every decode token; every training step's forward), in one launch from a kept record
(``ops/_launch/prepared.py``; issue 47 item 3).

Two launches are kept, by the mode the call read: in batch-invariant mode the statistics are the
norm kernel's (``norm.py::rms_norm_hf_bi``: y and rstd in one launch), so the stock expression cannot
stand in for it as in fast mode at decode; in fast mode the statistics are torch's
(``norm.py::hf_rstd``, stock's bits) and the kept launch applies them (``rms_norm_hf_fwd_op``'s).
:func:`kept_hf` keeps the launch the path made under a key of everything it read (x's and the
weight's shapes, strides, dtypes, devices and 16-byte alignment, eps, the style, the tuning knobs,
the mode) and :func:`launch_hf` replays it into fresh outputs: the same kernel, arguments and
grid, the same bits (``tests/test_kept_launches.py``).
"""

from __future__ import annotations

import torch

from truefuse.config import get_tuning
from truefuse.ops._launch.prepared import KeptLaunches, ToKeep, launchable, layout, replayable, stream
from truefuse.ops.norm.norm import hf_prepared

#: ``(go, y's dtype)`` by key
_KEPT = KeptLaunches()


def kept_hf(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str, bi: bool):
    """The launch kept for this call's key (an entry for :func:`launch_hf`); else, where the call
    may be kept, the key to hand :func:`keep` after the caller's path ran (a :class:`ToKeep`); else
    None: not plain CUDA tensors, tracing, a dispatch mode or functorch transform. An operand
    requiring grad may be served: the caller records the graph around the launch (``bi``: the mode
    the call read)."""
    if weight is None or not replayable(x, weight, recording=True):
        return None
    if type(eps) not in (float, int) or type(style) is not str:
        return None  # a bad eps or style: the path's checks name it (and a key must hash)
    # the tuning knobs choose the path (max_kernel_n)
    key = (layout(x, x.data_ptr()), layout(weight, weight.data_ptr()), eps, style, get_tuning(), bi)
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        return kept if launchable(kept[0]) else None
    return ToKeep(key, kept) if kept > 0 else None


def launch_hf(entry: tuple, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor | None = None):
    """``(y, rstd)`` by ``entry``'s launch (:func:`kept_hf`'s) into a new y shaped like ``x``: in
    batch-invariant mode (``rstd`` None) the kernel writes the statistics too, in fast mode it
    applies the given (M,) fp32 ``rstd``. None where an output is not aligned as the kept launch's."""
    go, dtype = entry
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    if rstd is None:
        rstd = torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device)
    yp, rp = y.data_ptr(), rstd.data_ptr()
    if (yp | rp) & 15:  # (the caching allocator's blocks are 512-byte aligned)
        return None
    go(stream(go), x.data_ptr(), weight.data_ptr(), yp, rp)
    return y, rstd


def keep(
    pending: ToKeep,
    x: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    y2: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    style: str,
    bi: bool,
) -> None:
    """Keep the launch the caller's path just made from ``x2`` (x's (M, N) rows) into ``y2`` and
    ``rstd`` under :func:`kept_hf`'s ``pending`` (``bi``: ``rms_norm_hf_bi``'s launch, else
    ``rms_norm_hf_fwd_op``'s with ``rstd`` given): where ``x2`` is a view of ``x`` (no copy between)
    and M is not 0."""
    go = None
    if x2.data_ptr() == x.data_ptr() and y2.numel():
        go = hf_prepared(x2, weight, y2, rstd, eps, style, bi)
    _KEPT.keep(pending, go, y2.dtype)


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
