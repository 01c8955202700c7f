"""The gated activation's kept launches: ``act(gate) * up`` of a Hugging Face MLP, whose call
repeats exactly (every decode token; every training step's forward and backward), in one launch
from a kept record (``ops/_launch/prepared.py``; issue 47 item 3).

Its path (``autograd/gated_activation.py``: the checks, the reshapes, the kernel's launch shape and
``fast_launch``'s key) cost 31.4 µs of host a decode call on an H100 host against 14.3 for stock's
``silu(g) * u``, and a forward + backward 204 µs against stock's 114 (docs/benchmarks.md, "Eager
host time per op"). :func:`kept_gated` keeps the forward launch that path made under a key of
everything it read (both operands' shapes, strides, dtypes, devices and 16-byte alignment, the
activation), :func:`kept_grads` the backward's (the same of the incoming gradient too), and each
replays into fresh outputs: the same kernel, arguments and grid, the same bits
(``tests/test_kept_launches.py``).
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.prepared import KeptLaunches, ToKeep, launchable, layout, replayable, stream
from truefuse.ops.gated_activation.gated_activation import bwd_prepared, fwd_prepared, gated2_bwd_op

#: the forward's ``(go,)`` by key
_KEPT = KeptLaunches()
#: the backward's ``(go,)`` by key
_KEPT_BWD = KeptLaunches()


def kept_gated(gate: torch.Tensor, up: torch.Tensor, name: str, *, recording: bool = False):
    """The forward launch kept for this call's key (``(go, key)``: :func:`launch` ``go``, hand
    ``key`` to :func:`kept_grads`); else,
    where the call may be kept, the key to hand :func:`keep` after the caller's path ran (a
    :class:`ToKeep`); else None: not plain CUDA tensors, an operand requiring grad with grad mode on
    (unless ``recording``: the caller records the graph around :func:`launch` and
    :func:`kept_grads`), tracing, a dispatch mode or functorch transform."""
    # a bad name: the path names it (and a key must hash)
    if not replayable(gate, up, recording=recording) or type(name) is not str:
        return None
    key = (layout(gate, gate.data_ptr()), layout(up, up.data_ptr()), name)
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        return kept if launchable(kept[0]) else None
    return ToKeep(key, kept) if kept > 0 else None


def launch(go, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``act(gate) * up`` by ``go`` (:func:`kept_gated`'s) into a new tensor shaped like ``gate``, or
    None where the output's address is not aligned as the kept launch's was."""
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    yp = y.data_ptr()
    if yp & 15:  # (the caching allocator's blocks are 512-byte aligned)
        return None
    go(stream(go), gate.data_ptr(), up.data_ptr(), yp)
    return y


def keep(
    pending: ToKeep, gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor, u: torch.Tensor, y: torch.Tensor, name: str
) -> None:
    """Keep the launch the caller's path just made (``gated2_fwd_op`` on ``g``/``u``, the operands
    or their row-contiguous copies, into ``y``) under :func:`kept_gated`'s ``pending``: where no copy
    came between, and the rows are not empty. The launch's (M, F) rows are those the op flattened
    (the same reshapes, so the same strides and addresses)."""
    go = None
    F = gate.shape[-1]
    g2, u2, y2 = g.reshape(-1, F), u.reshape(-1, F), y.view(-1, F)
    same = g2.data_ptr() == gate.data_ptr() and u2.data_ptr() == up.data_ptr() and g is gate and u is up
    if same and y2.numel():
        go = fwd_prepared(g2, u2, y2, name)
    _KEPT.keep(pending, go, pending.key)  # the key again: the backward's key holds it (kept_grads)


def kept_grads(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, name: str, fwd_key: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``gate`` and ``up`` (the forward's operands, row-contiguous as
    :func:`kept_gated` keeps them) for the output's gradient ``dy``: ``gated2_bwd_op``'s, through the
    launch kept for this call's key, else through that op's body, keeping its launch where it may.
    ``fwd_key``: the forward's (:func:`kept_gated`'s: the operands' layouts and the name, read then)."""
    key = None
    if type(dy) is torch.Tensor and dy.dtype is gate.dtype and dy.shape == gate.shape:
        key = (layout(dy, dy.data_ptr()), fwd_key)
    kept = _KEPT_BWD.get(key) if key is not None else 0
    if kept.__class__ is tuple:
        (go,) = kept
        if launchable(go):
            dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
            du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
            dgp, dup = dg.data_ptr(), du.data_ptr()
            if not (dgp | dup) & 15:  # as kept
                go(stream(go), dy.data_ptr(), gate.data_ptr(), up.data_ptr(), dgp, dup)
                return dg, du
        kept = 0
    dg, du = gated2_bwd_op.body(dy, gate, up, name)
    if kept > 0:
        F = gate.shape[-1]
        dy2, g2, u2 = dy.reshape(-1, F), gate.reshape(-1, F), up.reshape(-1, F)
        views = dy2.data_ptr() == dy.data_ptr() and dy2.is_contiguous() and g2.data_ptr() == gate.data_ptr()
        fits = views and u2.data_ptr() == up.data_ptr() and dg.numel() > 0
        _KEPT_BWD.put(key, kept, bwd_prepared(dy2, g2, u2, dg.view(-1, F), du.view(-1, F), name) if fits else None)
    return dg, du


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
    _KEPT_BWD.clear()
