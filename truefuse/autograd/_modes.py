"""The modes one call runs in, read once at its entry (docs/design.md §1, "Batch invariance").

A functional or an autograd Function's forward takes ``Modes.now()`` once, passes
``modes.batch_invariant`` to every op it runs (``ops/`` and ``kernels/`` never read the switch:
``tests/test_layers.py``) and keeps the record on ``ctx.modes``; the backward passes it again. So
a backward run after the ``with truefuse.batch_invariant()`` block, or on autograd's own thread,
takes the forward's path without the switch being entered around it.
"""

from __future__ import annotations

from dataclasses import dataclass

from truefuse.config import is_batch_invariant


@dataclass(frozen=True, slots=True)
class Modes:
    """What a call reads of the process-wide switches, once.

    Attributes:
        batch_invariant: ``truefuse.batch_invariant()`` was on: each row's results bitwise
            independent of the other rows of the call.
    """

    batch_invariant: bool = False

    @staticmethod
    def now() -> Modes:
        """The switches as they are now: one of two kept records (no allocation; a call's host
        time matters where a decode-sized kernel takes ~15 µs)."""
        # a branch, not a tuple indexed by the switch: torch 2.11's Dynamo refuses a bool as a tuple index (the
        # compiled layers' norms call this; tests/hf/test_compile_layers.py on the GPU)
        return _ON if is_batch_invariant() else _OFF


_OFF, _ON = Modes(False), Modes(True)
