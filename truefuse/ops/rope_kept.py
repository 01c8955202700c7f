"""Rope's kept launches: ``apply_rotary_pos_emb`` of a decode step (the same call every token, no
gradient: q's and k's launches) from kept records (``ops/_launch/prepared.py``; issue 47 item 3).

:func:`kept_rope` keeps the two launches ``rope_fwd_op`` made under a key of everything its path
read (q's, k's, cos's and sin's shapes, strides, dtypes, devices and 16-byte alignment) and
replays them into fresh outputs of the path's layout: the same kernel, arguments and grids, the
same bits (``tests/test_kept_launches.py``).
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.prepared import NOT_NOW, KeptLaunches, ToKeep, launchable, layout, replayable, stream
from truefuse.ops.rope import rope_prepared

#: ``(go_q, go_k, q's output dtype, k's)`` by key
_KEPT = KeptLaunches()


def kept_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``apply_rotary_pos_emb(q, k, cos, sin)`` through the launches kept for this call's key (the
    pair of new tensors); else, where the call may be kept, the key to hand :func:`keep` after the
    caller's path ran (a :class:`ToKeep`); else None: not plain CUDA tensors, an
    operand requiring grad with grad mode on, tracing, a dispatch mode or functorch transform."""
    if not replayable(q, k, cos, sin):
        return None
    ts = (q, k, cos, sin)
    ptrs = [t.data_ptr() for t in ts]
    key = tuple(layout(t, p) for t, p in zip(ts, ptrs, strict=True))
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        go_q, go_k, qdt, kdt = kept
        if launchable(go_q):
            qo, ko = torch.empty_like(q, dtype=qdt), torch.empty_like(k, dtype=kdt)
            qp, kp = qo.data_ptr(), ko.data_ptr()
            if not (qp | kp) & 15:  # as kept (the caching allocator's blocks are 512-byte aligned)
                s = stream(go_q)
                go_q(s, ptrs[0], ptrs[2], ptrs[3], qp)
                go_k(s, ptrs[1], ptrs[2], ptrs[3], kp)
                return qo, ko
        return None
    return ToKeep(key, kept) if kept > 0 else None


def keep(pending: ToKeep, q, k, cos, sin, cos_run, sin_run, qo, ko) -> None:
    """Keep the two launches the caller's path just made (on ``cos_run``/``sin_run``, the cos and
    sin it launched with) into ``qo`` and ``ko``, under :func:`kept_rope`'s ``pending``: where those
    are views of ``cos`` and ``sin`` (no copy between) and neither output is empty."""
    go_q = go_k = None
    if cos_run.data_ptr() == cos.data_ptr() and sin_run.data_ptr() == sin.data_ptr() and qo.numel() and ko.numel():
        go_q, go_k = rope_prepared(q, cos_run, sin_run, qo), rope_prepared(k, cos_run, sin_run, ko)
    if go_q is NOT_NOW or go_k is NOT_NOW:
        return
    _KEPT.keep(pending, go_q if go_k is not None else None, go_k, qo.dtype, ko.dtype)


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
