"""Registering a truefuse ``torch.library`` custom op's backward (docs/design.md §6.7).

A one-kernel op's backward lives on the op: ``register_backward`` registers it on the forward op
and, on each backward op, a stub that refuses double backward with :func:`double_backward_message`
(docs/design.md §6.5). The stub must be registered: tracing a backward graph (torch.compile, AOT
autograd) asks every op in it for its autograd formula. In eager mode it fires only when a
gradient taken with ``create_graph=True`` is differentiated again; a plain ``create_graph=True``
backward works. (Autograd Functions refuse the same way: ``autograd/_double_backward.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from truefuse.config import get_config


def custom_op(name: str, *, mutates_args, inline: bool | Callable = False) -> Callable:
    """``torch.library.custom_op(name, mutates_args=...)`` that also keeps the undecorated body as
    the op's ``body``, for :func:`launch`.

    ``inline``: the body launches its kernels through ``ops/_launch/triton.py::kernel_for`` and nothing
    else it does depends on data, so where Triton compiles (not its CPU interpreter, whose kernels
    cannot be traced), torch.compile's AOT graph takes the body instead of one opaque call: the
    graph holds the kernels and Inductor launches them from its generated code, without the op's
    Python around each launch (as ``torch.library.triton_op`` does; docs/design.md §6.7). Dynamo
    still reads the op's registered fake. Export keeps the op whole. A callable ``inline(*args)``
    decides per call: False keeps that call opaque (a kernel launched with a host-side TMA
    descriptor, which torch 2.11 cannot trace outside Dynamo)."""

    def deco(fn: Callable):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.body = fn
        # kept even where it is not applied (the interpreter): truefuse/verify/op_table.py's
        # declaration of each op says whether it inlines, and tests compare the two
        op.inline = inline
        if inline and not get_config().triton_interpret:
            _inline_when_traced(op, fn, inline if callable(inline) else None)
        return op

    return deco


def _inline_when_traced(op, fn: Callable, when: Callable | None) -> None:
    """Run ``fn`` itself under torch's functional tracing mode (AOT autograd, Inductor's input),
    so that its ``wrap_triton`` launches become graph nodes; anything else (export, which keeps
    the op to serialize it; a tensor subclass) goes on to the op's usual path."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    known = (torch.Tensor, FakeTensor, FunctionalTensor)

    def decompose(mode, _op, types, args, kwargs):
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if any(t not in known for t in types):
            return NotImplemented
        if custom_triton_ops_decomposition_disabled() or (when is not None and not when(*args, **kwargs)):
            return mode.__torch_dispatch__(_op, types, args, kwargs)
        with mode:
            return fn(*args, **kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, decompose)


def launch(op, *args):
    """Run a launcher registered with :func:`custom_op`: through the dispatcher while torch.compile
    traces (the graph holds one opaque call), its body directly in eager mode, where the
    dispatcher's handling of a many-argument schema costs tens of µs a call (the 64-expert
    GroupedMLP's fused grouped step: 2.92 ms through the ops against 2.33 ms; docs/log/benchmarks_2026-11.md)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return op.body(*args)


def double_backward_message(op: str, ref: str) -> str:
    """The one error of every truefuse op that refuses double backward (docs/design.md §6.5):
    ``op`` is its public name (``"rms_norm"``), ``ref`` where its differentiable reference lives."""
    return (
        f"truefuse.{op} does not support double backward (differentiating a gradient taken with "
        f"create_graph=True, e.g. a gradient penalty); compute the gradient penalty through the "
        f"unfused reference {ref}"
    )


def no_double_backward(op, name: str | Callable, ref: str = "") -> None:
    """Register on ``op`` (a backward op) an autograd formula that raises
    :func:`double_backward_message`: it fires when a gradient the op computed under
    ``create_graph=True`` is differentiated, and lets a traced backward graph hold the op.
    ``name``: the public op's name, or ``f(inputs) -> (name, ref)`` where ops share the backward
    op (the norms)."""

    def _setup(ctx, inputs, output) -> None:
        ctx.names = name(inputs) if callable(name) else (name, ref)  # strings only: no tensor kept

    def _no_double_backward(ctx, *grads):
        raise RuntimeError(double_backward_message(*ctx.names))

    op.register_autograd(_no_double_backward, setup_context=_setup)


class EagerSpec(NamedTuple):
    """What ``autograd/_eager_op.py`` needs to run a forward op in eager mode without the
    dispatcher: the op's ``setup_context`` and ``backward`` (the ones registered on it) and
    ``names(ctx) -> (op, ref)`` for its double-backward refusal."""

    setup_context: Callable
    backward: Callable
    names: Callable


def register_backward(
    fwd_op,
    backward: Callable,
    setup_context: Callable,
    *,
    bwd_ops: Iterable = (),
    name: str | Callable = "",
    ref: str = "",
    eager_names: Callable | None = None,
) -> None:
    """``fwd_op.register_autograd(backward, setup_context=setup_context)`` and
    :func:`no_double_backward` (``name``, ``ref``) on each of ``bwd_ops`` (the ops ``backward`` calls).

    ``fwd_op`` (made with :func:`custom_op`, so it has a ``body``) also gets ``eager``, an
    :class:`EagerSpec`, for ``autograd/_eager_op.py::call``; ``eager_names(ctx) -> (op, ref)`` names
    the op in its refusal where ``name`` reads the backward op's inputs (the norms)."""
    fwd_op.register_autograd(backward, setup_context=setup_context)
    for op in bwd_ops:
        no_double_backward(op, name, ref)
    if eager_names is None:
        if callable(name):  # it reads the backward op's inputs, which the eager path never builds
            raise TypeError(f"register_backward({fwd_op}): a callable name needs eager_names(ctx) too")
        eager_names = _static_names(name, ref)
    fwd_op.eager = EagerSpec(setup_context, backward, eager_names)


def _static_names(name, ref) -> Callable:
    def names(ctx) -> tuple[str, str]:
        return name, ref

    return names


def bwd_call(ctx, op, *args):
    """A registered backward's call of its backward op ``op`` (made with :func:`custom_op`): its
    body directly under ``autograd/_eager_op.py`` (which refuses double backward itself, the
    dispatcher's round trips being what it saves), else through the dispatcher (torch.compile's
    traced backward, and the op's own autograd path with its double-backward stub)."""
    if getattr(ctx, "truefuse_op", None) is not None:  # set by autograd/_eager_op.py's Function
        return op.body(*args)
    return op(*args)
