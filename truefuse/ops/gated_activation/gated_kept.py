"""The gated activation's kept launch: ``act(gate) * up`` of a Hugging Face MLP at decode (the same
call every token, no gradient) in one launch from a kept record (``ops/_launch/prepared.py``;
issue 47 item 3).

Its path (``autograd/gated_activation.py``: the checks, the reshapes, the kernel's launch shape and
``fast_launch``'s key) cost 31.4 µs of host a decode call on an H100 host against 14.3 for stock's
``silu(g) * u`` (docs/benchmarks.md, "Eager host time per op"). :func:`kept_gated` keeps the
launch that path made under a key of everything it read (both operands' shapes, strides, dtypes,
devices and 16-byte alignment, the activation) and replays it into a fresh output: the same
kernel, arguments and grid, the same bits (``tests/test_gated_activation.py``).
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.prepared import KeptLaunches, ToKeep, launchable, layout, replayable, stream
from truefuse.ops.gated_activation.gated_activation import fwd_prepared

#: ``(go,)`` by key
_KEPT = KeptLaunches()


def kept_gated(gate: torch.Tensor, up: torch.Tensor, name: str):
    """``act(gate) * up`` through the launch kept for this call's key (a new tensor shaped like
    ``gate``); else, where the call may be kept, the key to hand :func:`keep` after the caller's
    path ran (a tuple); else None: not plain CUDA tensors, an operand requiring grad with grad mode
    on, tracing, a dispatch mode or functorch transform."""
    if not replayable(gate, up) or type(name) is not str:  # a bad name: the path names it (and a key must hash)
        return None
    gp, upp = gate.data_ptr(), up.data_ptr()
    key = (layout(gate, gp), layout(up, upp), name)
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        (go,) = kept
        if launchable(go):
            y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
            yp = y.data_ptr()
            if not yp & 15:  # as kept (the caching allocator's blocks are 512-byte aligned)
                go(stream(go), gp, upp, yp)
                return y
        return None
    return ToKeep(key, kept) if kept > 0 else None


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
    _KEPT.keep(pending, go)


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
