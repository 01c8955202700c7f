"""Sibling projections in one launch: batch-invariant mode's ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` without a gradient (docs/design.md §6.10).

A decode step of a patched model is host time: each routed ``F.linear`` costs ~70 µs of host on an
H100 host for ~10 µs of kernel (docs/benchmarks.md, "Batch-invariant mode"), seven a decoder layer.
The attention's q, k and v projections read the same input, as do the MLP's gate and up. When the
first of such a group is called, :func:`fused_call` computes every member's product in one launch
(``gemm_backends/triton.py::bi_launch_segments``: each output has the bits of its own call) and
keeps the others' outputs for their calls, which follow with the same input tensor. A call that
does not match (another input, an input or weight written since, a gradient to take, autocast, an
inference tensor, a plan other than the batch-invariant Triton GEMM) runs as it would alone. The outputs are what each call would
return: a new contiguous (..., N) tensor, its split bias added the same way.
"""

from __future__ import annotations

import torch

from truefuse.autograd._autocast import autocast_dtype
from truefuse.ops._launch.prepared import KeptLaunches, launchable, layout, replayable, stream
from truefuse.ops._launch.triton import PLAIN_TENSORS
from truefuse.ops.gemm.gemm_bi_config import M_BUCKETS, bucket
from truefuse.ops.gemm.gemm_plan import plan_settings
from truefuse.ops.gemm.gemm_runners import runs_bi_triton

#: Attribute names of the sibling ``nn.Linear`` children that read one input, per module kind.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def find_groups(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, ...]]:
    """The sibling groups of ``model``: plain ``nn.Linear`` children named as in :data:`GROUPS` of
    one module (a wrapped one, e.g. a LoRA layer, is left out: its forward is more than the product;
    truefuse's own member class, ``sibling_grads.py``'s, counts as plain)."""
    return [g for _, g in find_groups_in(model)]


def find_groups_in(model: torch.nn.Module) -> list[tuple[torch.nn.Module, tuple[torch.nn.Linear, ...]]]:
    """:func:`find_groups` with each group's parent module: ``(parent, group)``."""
    groups = []
    for module in model.modules():
        for names in GROUPS:
            members = tuple(getattr(module, n, None) for n in names)
            if all(type(m) is torch.nn.Linear or getattr(type(m), "_truefuse_stock", None) is torch.nn.Linear for m in members):
                groups.append((module, members))
    return groups


class Siblings:
    """One forward's sibling state: the groups by their first member's weight, and the outputs kept
    for the calls to come (each with the input it was computed from and its weight's version)."""

    __slots__ = ("firsts", "kept")

    def __init__(self, groups) -> None:
        self.firsts = {id(g[0].weight): g for g in groups}
        self.kept: dict[int, tuple] = {}

    def claims(self, weight) -> bool:
        """Whether a call on ``weight`` goes to :func:`fused_call` first: a group's first member, or
        a member whose output a group launch kept."""
        return id(weight) in self.firsts or id(weight) in self.kept


def fused_call(state: Siblings, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` in batch-invariant mode from the group's one launch, or None
    (nothing done: the caller runs it as always)."""
    kept = state.kept.pop(id(weight), None) if state.kept else None
    if kept is not None:
        kx, versions, y = kept
        if kx is x and versions == (x._version, weight._version):
            return _finish(y, x, bias)
    group = state.firsts.get(id(weight))
    if group is None:
        return None
    weights = [m.weight for m in group]
    if weights[0] is not weight:
        return None
    key = _key(x, weights)
    kept = _KEPT.get(key) if key is not None else 0
    if kept.__class__ is tuple:
        outs = _replay(kept, x, weights)
        if outs is not None:
            return _share(state, x, weights, outs, bias)
        kept = 0
    if not _fusable(x, weights, [m.bias is not None for m in group]):
        return None
    from truefuse.ops.gemm.gemm_backends.triton import bi_launch_segments, bi_segments_prepared

    x2 = x.reshape(-1, x.shape[-1])
    outs = [torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    wts = [w.t() for w in weights]
    bi_launch_segments(x2, wts, outs)
    if kept > 0:
        go = bi_segments_prepared(x2, wts, outs) if x2.data_ptr() == x.data_ptr() else None
        _KEPT.put(key, kept, go, [o.shape for o in outs])
    return _share(state, x, weights, outs, bias)


def _share(state: Siblings, x: torch.Tensor, weights, outs, bias) -> torch.Tensor:
    """Keep the other members' outputs for their calls; the first member's, finished."""
    for w, y in zip(weights[1:], outs[1:], strict=True):
        state.kept[id(w)] = (x, (x._version, w._version), y)
    return _finish(outs[0], x, bias)


#: A group's kept launch (``ops/_launch/prepared.py``: ``(go, the outputs' shapes)``) by :func:`_key`:
#: at decode the same group call every token, whose checks and launch cost host time the launch
#: replayed does not (docs/design.md §6.10, kept launches)
_KEPT = KeptLaunches()


def _key(x: torch.Tensor, weights) -> tuple | None:
    """Everything :func:`_fusable` and the launch read that a decode step can change (the input's
    and each weight's layout, ``prepared.layout``; autocast; an inference input; the plan's
    settings, for ``runs_bi_triton``), or None where no kept launch may serve the call
    (``prepared.replayable``)."""
    if not replayable(x, *weights):
        return None
    ws = tuple(layout(w, w.data_ptr()) for w in weights)
    return layout(x, x.data_ptr()), x.is_inference(), autocast_dtype(x.device), ws, plan_settings()


def _replay(kept: tuple, x: torch.Tensor, weights) -> list[torch.Tensor] | None:
    """The group's outputs from its kept launch, or None where it may not launch now."""
    go, shapes = kept
    if not launchable(go):
        return None
    outs = [torch.empty(shape, dtype=x.dtype, device=x.device) for shape in shapes]
    if any(o.data_ptr() & 15 for o in outs):  # as kept (the caching allocator's blocks are 512-byte aligned)
        return None
    go(stream(go), x.data_ptr(), *[w.data_ptr() for w in weights], *[o.data_ptr() for o in outs])
    return outs


def _finish(y: torch.Tensor, x: torch.Tensor, bias) -> torch.Tensor:
    if bias is not None:  # as the plain call's runner adds a split bias (ops/gemm/gemm_runners.py::_runner)
        y.add_(bias.to(y.dtype))
    return y.view(*x.shape[:-1], y.shape[-1])


def _fusable(x: torch.Tensor, weights: list[torch.Tensor], biased: list[bool]) -> bool:
    """Whether each member's call would run the plain batch-invariant Triton product on ``x``, a
    decode-sized one (the launch's host time is what the group saves)."""
    if torch.compiler.is_compiling() or autocast_dtype(x.device) is not None or x.is_inference():
        return False  # (an inference tensor keeps no version counter to tell a write after the launch)
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    K, dev = x.shape[-1], x.device
    for w in weights:
        if type(w) not in PLAIN_TENSORS or w.dtype is not x.dtype or w.device != dev:
            return False
        if w.dim() != 2 or w.shape[1] != K or w.shape[0] == 0 or not w.is_contiguous():
            return False
    rows = x.numel() // K
    if rows == 0 or bucket(rows) == len(M_BUCKETS) - 1:
        return False  # many rows are GPU time, not host time: each on its own kernel (TMA on Hopper)
    x2 = x.reshape(-1, K)
    return all(runs_bi_triton(x2, weights[0].t(), b) for b in set(biased))
