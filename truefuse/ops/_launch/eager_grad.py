"""Autograd's gradients of an eager PyTorch expression, taken inside a custom op's body: the
backward of an op that keeps a PyTorch path opaque under ``torch.compile`` (traced into the graph,
Inductor compiles the expression's math into other roundings; opaque, its forward and backward are
eager's bits). An op's body runs with autograd's dispatch keys excluded (thread-local state that
``enable_grad`` does not lift), so the gradients are taken in a thread of its own: one worker, made
at the first call and kept."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

import torch

_GRAD_THREAD: concurrent.futures.ThreadPoolExecutor | None = None


def eager_grads(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], grad_out: torch.Tensor) -> tuple:
    """``torch.autograd.grad(fn(*inputs), inputs, grad_out)`` on detached copies of ``inputs``,
    each gradient contiguous."""

    def grads():
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in inputs]
            out = fn(*leaves)
            return tuple(g.contiguous() for g in torch.autograd.grad(out, leaves, grad_out))

    global _GRAD_THREAD
    if _GRAD_THREAD is None:
        _GRAD_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="truefuse-eager-grad")
    return _GRAD_THREAD.submit(grads).result()
