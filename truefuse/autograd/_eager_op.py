"""Eager mode's way into truefuse's one-kernel custom ops (docs/design.md §6.7).

The ``torch.library`` custom ops are what torch.compile and export trace. Called in eager mode, one
goes through the dispatcher's autograd key, torch.library's Python wrappers and the dispatcher
again to its body, and its backward op the same way: about 200-500 µs of host time (profiled) per
norm backward on an H100 for 20-40 µs of GPU work (``truefuse::norm_bwd`` plus its autograd
wrapper under FSDP2, 2 H100s; docs/benchmarks.md, FSDP2). Where the host is what a step waits for
(FSDP2's hooks, a small model, ``generate``) that host time is the step's.

:func:`call` runs the same registered pieces (the op's body, its ``setup_context``, its backward,
whose backward op runs as its body through ``ops/_launch/custom_op.py::bwd_call``) in one plain autograd
Function, with the double-backward refusal of :func:`refuses_double_backward`. The same Python
bodies and kernels: the same bits. The dispatcher stays wherever it does something: while
torch.compile traces, under a dispatch mode (fake tensors, flop counters), for tensor subclasses
(DTensor).
"""

from __future__ import annotations

import torch
from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers
from torch.utils._python_dispatch import _get_current_dispatch_mode

from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.ops._launch.triton import PLAIN_TENSORS as _PLAIN


def _names(ctx) -> tuple[str, str]:
    return ctx.truefuse_op.eager.names(ctx)


def _backward(ctx, *grads):
    return ctx.truefuse_op.eager.backward(ctx, *grads)


_refusing_backward = refuses_double_backward(_names)(_backward)


class _EagerOp(torch.autograd.Function):
    """``op.body(*args)`` with ``op``'s registered autograd (``op.eager``: ``ops/_launch/custom_op.py``).

    One ``forward(ctx, ...)`` rather than a separate ``setup_context``: with the latter,
    ``Function.apply`` binds the arguments through ``inspect.signature`` on every call (~80 µs
    of a 400 µs norm forward + backward on the CPU box, cProfile; ``experiments/host_time.py eager``)."""

    @staticmethod
    def forward(ctx, op, *args):
        out = op.body(*args)
        ctx.truefuse_op = op  # also tells ops/_launch/custom_op.py::bwd_call to run backward ops' bodies
        op.eager.setup_context(ctx, args, out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        out = _refusing_backward(ctx, *grads)
        return (None, *(out if isinstance(out, tuple) else (out,)))


#: ``Function.apply`` without its Python layer (~9 µs of 38 a call on the CPU box): that layer binds
#: default arguments (not needed: one ``forward``), and routes functorch transforms (to the dispatcher below)
_apply_c = super(torch.autograd.Function, _EagerOp).apply


def call(op, *args):
    """``op(*args)`` (a custom op with a registered backward: ``ops/_launch/custom_op.py::register_backward``)
    without the dispatcher in eager mode; through it while tracing, under a dispatch mode, or for a
    tensor subclass argument."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return op(*args)
    grad = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN:
                return op(*args)
            grad = grad or a.requires_grad
    if not (grad and torch.is_grad_enabled()):
        return op.body(*args)
    if torch._C._are_functorch_transforms_active():  # torch.func needs a setup_context: the dispatcher's
        return op(*args)
    return _apply_c(op, *_unwrap_dead_wrappers(args))
