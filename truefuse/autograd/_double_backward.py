"""The double-backward refusal of truefuse's autograd Functions (docs/design.md §6.5).

A Function whose backward is not itself differentiable must not hand back, under
``create_graph=True``, gradients that look like constants: a gradient penalty through it would
silently lose its second-order term (``linear_cross_entropy`` did: 0.40 off in norm, issue 31).
:func:`refuses_double_backward` runs the backward under ``no_grad`` and, when autograd records a
graph (``create_graph=True``), returns its gradients through torch's ``DelayedError`` node, as
``torch.autograd.function.once_differentiable`` does: the first-order values are unchanged (the
same storage) and a plain ``create_graph=True`` backward works, but differentiating one of them
raises :func:`~truefuse.ops._launch.custom_op.double_backward_message`. Unlike ``once_differentiable``
the gradients are wrapped even when no incoming gradient requires grad, and the error node also
takes the saved inputs that require grad (x, W): the second-order term through them is what
would go missing, and without an edge to them ``torch.autograd.grad(penalty, [x, W])`` prunes
the node and returns no error.

The custom ops refuse with the same message from a stub on their backward ops
(``ops/_launch/custom_op.py::no_double_backward``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from truefuse.ops._launch.custom_op import double_backward_message


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _anchors(ctx, grads) -> list[torch.Tensor]:
    """What the first-order gradients depend on and autograd can reach: the incoming gradients and
    the saved tensors that require grad (x, W). The refusal node takes them as inputs too: a node
    with no path to ``torch.autograd.grad``'s ``inputs`` is pruned, and its error never fires
    (``grad(penalty, [x, W], allow_unused=True)`` returned None for both)."""
    try:
        saved = ctx.saved_tensors
    except RuntimeError:  # freed: nothing saved, or a second backward after a free
        saved = ()
    return [t for t in (*grads, *saved) if isinstance(t, torch.Tensor) and t.requires_grad]


def delay_error(grads, message: str, anchors=()):
    """``grads`` (a backward's return: a tensor or a tuple with None and non-tensors) with each
    float tensor replaced by an alias (the same storage) whose ``grad_fn`` raises
    ``RuntimeError(message)``; the node's other inputs are ``anchors`` (see :func:`_anchors`)."""
    single = not isinstance(grads, tuple)
    items = (grads,) if single else grads
    where = [i for i, g in enumerate(items) if _differentiable(g)]
    if not where:
        return grads
    err = torch._C._functions.DelayedError(message, len(where) + len(anchors))
    wrapped = err(*[items[i].detach().requires_grad_() for i in where], *anchors)
    wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
    out = list(items)
    for i, w in zip(where, wrapped[: len(where)], strict=True):
        out[i] = w
    return out[0] if single else tuple(out)


#: the modules whose Functions (``LinearFunction``, the grouped ones) name them through their §2
#: state's ``owner``; any other owner is a patched third-party module (the Hugging Face experts)
_MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "GroupedMLP")
_DISTRIBUTED_MODULES = ("ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP")


def module_names(owner: str, default: str) -> tuple[str, str]:
    """``(op, ref)`` for a module Function whose §2 state belongs to ``owner`` (a class name);
    ``default``: the truefuse module the Function implements, named when ``owner`` is not one."""
    if owner in _DISTRIBUTED_MODULES:
        return f"distributed.{owner}", f"truefuse.distributed.{owner}.forward_ref"
    if owner in _MODULES:
        return owner, f"truefuse.{owner}.forward_ref"
    return f"{default} (in {owner})", f"truefuse.{default}.forward_ref or the unpatched {owner}"


def refuses_double_backward(op: str | Callable, ref: str = "") -> Callable:
    """Decorate an autograd Function's ``backward`` (under ``@staticmethod``): it runs under
    ``no_grad`` and, when called with ``create_graph=True``, its gradients refuse to be
    differentiated again with :func:`double_backward_message` (``op``: the public name,
    ``"linear_cross_entropy"``, or ``f(ctx) -> (op, ref)`` for a Function several modules share;
    ``ref``: its differentiable reference). Not while torch.compile traces: AOT autograd refuses
    double backward of a compiled graph itself."""

    def deco(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return backward(ctx, *grads)
            with torch.no_grad():
                out = backward(ctx, *grads)
            message = double_backward_message(*(op(ctx) if callable(op) else (op, ref)))
            return delay_error(out, message, _anchors(ctx, grads))

        return wrapper

    return deco
