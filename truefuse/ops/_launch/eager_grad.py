"""Autograd's gradients of an eager PyTorch expression, taken inside a custom op's body: the
backward of an op that keeps a PyTorch path opaque under ``torch.compile`` (traced into the graph,
Inductor compiles the expression's math into other roundings; opaque, its forward and backward are
eager's bits).

An op's body runs with autograd's dispatch keys excluded (thread-local state that ``enable_grad``
does not lift), so :func:`eager_grads` puts them back for its own graph, in the calling thread. Not
in a thread of its own: on CUDA the op's backward runs on autograd's device thread, and a gradient
asked for from another thread queues its CUDA work on that same, busy, device thread and waits for
it for ever (``opcheck`` of ``rms_norm_hf`` and ``attention`` hung on an H100 until cut at 250 s). A
nested ``torch.autograd.grad`` on the device thread runs its graph in place."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_DK = torch._C.DispatchKey
#: what a custom op's body excludes of autograd (the functionality bit, and the two keys it shows as)
_AUTOGRAD_KEYS = (_DK.AutogradFunctionality, _DK.AutogradOther, _DK.AutogradNestedTensor)


def eager_grads(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], grad_out: torch.Tensor) -> tuple:
    """``torch.autograd.grad(fn(*inputs), inputs, grad_out)`` on detached copies of ``inputs``,
    each gradient contiguous; autocast off, as in the op's body; inference mode off (a backward run
    under it still differentiates the expression, as a fresh thread did)."""
    with torch.inference_mode(False):  # first: it sets dispatch keys of its own
        excluded = torch._C._dispatch_tls_local_exclude_set()
        for key in _AUTOGRAD_KEYS:
            excluded = excluded.remove(key)
        force = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)
        with force, torch.enable_grad(), torch.autocast(grad_out.device.type, enabled=False):
            leaves = [t.detach().requires_grad_() for t in inputs]
            out = fn(*leaves)
            return tuple(g.contiguous() for g in torch.autograd.grad(out, leaves, grad_out))

