"""Batch-invariant mode across an autograd Function (docs/design.md §1, "Batch invariance").

The switch (``truefuse.batch_invariant()``) is read in the forward; the backward runs in the mode
the forward ran in, even when autograd calls it after the ``with`` block (or, on CUDA, on its own
thread), so a row's input gradient takes the same path as its output.
"""

from __future__ import annotations

import functools

from truefuse.config import batch_invariant, is_batch_invariant


def record(ctx) -> bool:
    """Keep the current mode on ``ctx`` (call in the forward); returns it."""
    ctx.batch_invariant = is_batch_invariant()
    return ctx.batch_invariant


def in_forward_mode(backward):
    """Decorate a Function's ``backward(ctx, *grads)`` to run in the mode :func:`record` kept."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        mode = getattr(ctx, "batch_invariant", False)
        if mode == is_batch_invariant():
            return backward(ctx, *grads)  # already in it: no context to enter (host time a call)
        with batch_invariant(mode):
            return backward(ctx, *grads)

    return wrapped
