"""Registering a truefuse ``torch.library`` custom op's backward (docs/design.md §6.7).

A one-kernel op's backward lives on the op: ``register_backward`` registers it on the forward op
and, on each backward op, a stub that refuses double backward. The stub must be registered:
tracing a backward graph (torch.compile, AOT autograd) asks every op in it for its autograd
formula, even though truefuse never differentiates a backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def custom_op(name: str, *, mutates_args) -> Callable:
    """``torch.library.custom_op(name, mutates_args=...)`` that also keeps the undecorated body as
    the op's ``body``, for :func:`launch`."""

    def deco(fn: Callable):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.body = fn
        return op

    return deco


def launch(op, *args):
    """Run a launcher registered with :func:`custom_op`: through the dispatcher while torch.compile
    traces (the graph holds one opaque call), its body directly in eager mode, where the
    dispatcher's handling of a many-argument schema costs tens of µs a call (the 64-expert
    GroupedMLP's fused grouped step: 2.92 ms through the ops against 2.33 ms; docs/log/benchmarks_2026-11.md)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return op.body(*args)


def _no_double_backward_for(what: str) -> Callable:
    def _no_double_backward(ctx, *grads):
        raise RuntimeError(f"truefuse {what} do not support double backward (create_graph=True through the backward)")

    return _no_double_backward


def _no_setup(ctx, inputs, output) -> None:
    return None


def no_double_backward(op, what: str) -> None:
    """Register on ``op`` (a backward op) an autograd formula that raises: never run, but it lets a
    traced backward graph hold the op. ``what`` names the ops in the error ("norms")."""
    op.register_autograd(_no_double_backward_for(what), setup_context=_no_setup)


def register_backward(fwd_op, backward: Callable, setup_context: Callable, *, bwd_ops: Iterable = (), what: str = "ops") -> None:
    """``fwd_op.register_autograd(backward, setup_context=setup_context)`` and
    :func:`no_double_backward` on each of ``bwd_ops`` (the ops ``backward`` calls)."""
    fwd_op.register_autograd(backward, setup_context=setup_context)
    for op in bwd_ops:
        no_double_backward(op, what)
