"""``torch.autocast`` for truefuse's GEMMs, in one place: what torch's autocast does to ``F.linear``.

Under ``torch.autocast(device_type, dtype)``, with autocast enabled for the tensors' device, torch
casts every floating operand of ``F.linear`` (input, weight, bias) except fp64 ones to the autocast
dtype and runs the GEMM there: the output is in that dtype, and each operand's gradient comes back
through the cast in the operand's own dtype. Every truefuse entry point (the modules,
``truefuse.linear_cross_entropy``) does the same, through these helpers:

* the input is cast at the entry (:func:`cast`, a differentiable ``.to``, as torch's), so its
  gradient returns in the input's dtype;
* the weight and bias are cast inside the autograd Function. ``torch.amp.custom_fwd(cast_inputs=)``
  would cast the parameters before the Function sees them, and docs/design.md §2 needs the
  parameter itself (``main_grad``, a delayed ``.grad``, ``grad_added_to_main_grad``);
* the Function's forward and backward run with autocast off (:func:`autocast_disabled`; as
  ``custom_fwd(cast_inputs=)`` runs its forward, while ``custom_bwd`` would turn autocast back on
  in the backward), so an op inside runs as it does outside autocast, also when the backward runs
  in an autocast region. The GEMMs use ``out=`` forms, which autocast never casts; this keeps
  the other ops (an fp32-list op such as ``exp`` on CUDA, a future plain ``mm``) from being cast;
* the weight gradient is a GEMM of the cast operands accumulated in fp32 and rounded once to the
  parameter's dtype (:func:`wgrad_dtype`): an fp32 parameter gets the fp32 GEMM result. torch's
  autocast backward rounds the product to the autocast dtype first and then upcasts it;
  tests/test_autocast.py measures both against float64 (docs/linear.md, "Autocast").

Cost of the weight cast: torch's autocast caches the cast of a leaf tensor that requires grad for
the rest of its autocast region, so a weight used twice in one region is cast once. truefuse
casts in every forward call: one read of the fp32 weight and one write of its copy, 6 bytes per
element (~100 MB for a 4096 x 4096 weight: ~25 us at an H200's ~4 TB/s, an estimate, not
measured). The copy (2 bytes per element) is kept for the backward's input-gradient GEMM, as
torch's mm keeps its cast operand. A training step that runs each module once per autocast region
(the Hugging Face Trainer) casts each weight once either way; a weight called k times in one
region is cast k times here, once by torch.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype torch's autocast runs ``F.linear`` in on ``device`` now; None when autocast is off
    there (or the device type has no autocast)."""
    try:
        if not torch.is_autocast_enabled(device.type):
            return None
    except RuntimeError:  # e.g. "meta": no autocast for this device type
        return None
    return torch.get_autocast_dtype(device.type)


def cast_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` has after :func:`cast` (fp64 and non-floating tensors are not cast)."""
    if dtype is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t.dtype
    return dtype


def cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """Autocast's cast of one operand of ``F.linear``: ``t.to(dtype)`` (differentiable) unless ``t``
    is None, already ``dtype``, fp64 or not floating, or ``dtype`` is None (autocast off)."""
    if t is None or cast_dtype(t, dtype) == t.dtype:
        return t
    return t.to(dtype)


def as_cast(t, dtype: torch.dtype | None):
    """For argument checks: a stand-in with ``t``'s shape and device and the dtype :func:`cast`
    gives it, without copying ``t`` (one element, expanded); ``t`` itself when nothing is cast or
    it is not a tensor (the checks name it)."""
    if not isinstance(t, torch.Tensor) or cast_dtype(t, dtype) == t.dtype:
        return t
    return torch.empty((), dtype=dtype, device=t.device).expand(t.shape)


_NOTHING = contextlib.nullcontext()  # reusable: one object, not one per call


def _disabled(device_type: str | None):
    """``torch.autocast(device_type, enabled=False)`` where autocast is on there; else nothing."""
    if device_type is None:
        return _NOTHING
    try:
        on = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return _NOTHING
    return torch.autocast(device_type, enabled=False) if on else _NOTHING


def autocast_disabled(method):
    """Decorate an autograd Function's ``forward`` or ``backward``: it runs with autocast off on the
    device of its first tensor argument, so the GEMMs inside run on the operands as given (cast
    once, by the entry point and the Function), never cast again by autocast."""

    @functools.wraps(method)
    def wrapper(ctx, *args, **kwargs):
        # the first argument is a tensor in every Function today: read without a scan (host time)
        tensors = args[:1] if args and isinstance(args[0], torch.Tensor) else args
        device_type = next((a.device.type for a in tensors if isinstance(a, torch.Tensor)), None)
        with _disabled(device_type):
            return method(ctx, *args, **kwargs)

    return wrapper
