"""``apply_truefuse(model, fuse_sibling_grads=True)``: each attention's ``q_proj``/``k_proj``/``v_proj``
and each MLP's ``gate_proj``/``up_proj`` as one ``truefuse.sibling_linears`` call while training, so
their input gradient is summed inside the GEMMs instead of by autograd's adds
(docs/sibling_linears.md; issue 48.5).

Each member ``nn.Linear`` keeps its identity and parameters; its class becomes a subclass whose
forward, when the group may fuse (a gradient to take, plain tensors, eager or traced), computes
every member's output in one :func:`truefuse.sibling_linears` call and keeps the others' for their
own calls, which follow with the same input tensor (the stock attention and MLP forwards call
their members on one ``hidden_states`` / ``x``). A call that does not match the kept output (another
input, an input or weight written since, another grad, autocast or batch-invariant mode) runs
``F.linear`` as always, as does every call without a gradient (batch-invariant mode's decode
siblings are ``siblings.py``'s). The forward outputs are the stock calls' bits; so are the weight
and bias gradients.

In batch-invariant mode the group is ``BatchInvariantSiblingLinears``: each output, weight and bias
gradient the routed ``F.linear``'s bits, ``x``'s gradient summed in batch-invariant GEMMs (eager,
nothing for autocast to cast; otherwise the routed calls as before). Under ``torch.compile``
(``compile_layers``) Dynamo traces fast mode's group call: the compiled backward holds an ``addmm``
where autograd's graph held an ``add`` (tests/hf/test_sibling_grads.py). A member wrapped later (a
PEFT LoRA layer whose ``base_layer`` it becomes) still fuses: the wrapper calls it with its input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.autograd._autocast import autocast_dtype
from truefuse.autograd._modes import Modes
from truefuse.autograd.sibling_linears import checked_bi_sibling_linears, checked_sibling_linears
from truefuse.integrations.huggingface import modules
from truefuse.ops._launch.triton import PLAIN_TENSORS

KIND = "sibling_grads"
#: a member's group (a tuple of the member modules, itself included) and its kept output
_GROUP, _KEPT = "_truefuse_siblings", "_truefuse_sibling_kept"


def _stamp(x: torch.Tensor, member: torch.nn.Module, compiling: bool) -> tuple | None:
    """What a kept output was computed under, beside its input tensor: eagerly the versions (a write
    since) and the modes (grad, autocast's dtype, batch invariance); None while Dynamo traces, where the output is a
    traced tensor put and taken within one trace (the identity is the check)."""
    if compiling:
        return None
    return x._version, member.weight._version, torch.is_grad_enabled(), autocast_dtype(x.device), Modes.now().batch_invariant


def _member_forward(self, input):
    # eagerly the kept output lives in the module's dict (no nn.Module.__setattr__ a call); while
    # Dynamo traces, in attributes it follows (None again once the graph has run)
    compiling = torch.compiler.is_compiling()
    if compiling:
        kept = getattr(self, _KEPT, None)
        if kept is not None:
            setattr(self, _KEPT, None)
    else:
        kept = self.__dict__.pop(_KEPT, None)
    if kept is not None and kept[0] is input and kept[1] == _stamp(input, self, compiling):
        return kept[2]
    group = getattr(self, _GROUP, None)
    mode = None if group is None else _fusable(input, group, compiling)
    if mode is None:
        return F.linear(input, self.weight, self.bias)
    weights, biases = tuple(m.weight for m in group), tuple(m.bias for m in group)
    # batch-invariant: _fusable checked what its Function asks (no second look at the modes)
    outs = checked_bi_sibling_linears(input, weights, biases) if mode else checked_sibling_linears(input, weights, biases)
    for m, y in zip(group, outs, strict=True):
        if m is not self:
            entry = (input, _stamp(input, m, compiling), y)
            if compiling:
                setattr(m, _KEPT, entry)
            else:
                m.__dict__[_KEPT] = entry
    return outs[group.index(self)]


def member_class() -> type:
    """The truefuse subclass of ``nn.Linear`` a group's members get."""
    return modules.truefuse_subclass(torch.nn.Linear, KIND, _member_forward, "Sibling")


def _fusable(x: torch.Tensor, group: tuple, compiling: bool) -> bool | None:
    """Whether the group's call takes a gradient this fusion changes, and in which mode: None where
    it does not (grad mode off or nothing to differentiate, tensors that are not plain or not of
    one device, a functorch transform in eager, whose calls must see each ``F.linear``); False in
    fast mode (one dtype after autocast's cast); True in batch-invariant mode, eager only and of one
    dtype with nothing for autocast to cast (the routed ``F.linear``'s plain case: a traced or cast
    call is routed as before). Each member's call runs it: one pass over the members, no list built
    (host time: docs/sibling_linears.md)."""
    if not torch.is_grad_enabled() or type(x) not in PLAIN_TENSORS:
        return None
    bi = Modes.now().batch_invariant
    if bi and compiling:
        return None
    if not compiling and torch._C._are_functorch_transforms_active():
        return None
    cls, k, dev = _MEMBER, x.shape[-1], x.device
    cast_to = autocast_dtype(dev)
    if bi and cast_to is not None and cast_to is not x.dtype:
        return None
    same_dtype = cast_to is None or bi
    grad = x.requires_grad
    for m in group:
        w, b = m.weight, m.bias
        if type(m) is not cls or type(w) not in PLAIN_TENSORS or w.dim() != 2 or w.shape[1] != k or w.device != dev:
            return None
        if same_dtype and w.dtype != x.dtype:
            return None
        grad = grad or w.requires_grad
        if b is not None:
            if type(b) not in PLAIN_TENSORS or b.device != dev or (same_dtype and b.dtype != x.dtype):
                return None
            grad = grad or b.requires_grad
    return bi if grad else None


#: the member class, made once (``_fusable`` reads it every call)
_MEMBER = member_class()


def plan(model: torch.nn.Module, report) -> list:
    """A ``patch()`` that gives every sibling group's members of ``model`` (``siblings.find_groups_in``:
    plain ``nn.Linear`` members) the member class and their group; the report counts each group
    under its parent's class."""
    from truefuse.integrations.huggingface.siblings import find_groups_in

    cls = member_class()
    found = find_groups_in(model)
    groups = [g for _, g in found]
    for parent, g in found:
        name = getattr(type(parent), "_truefuse_stock", type(parent)).__name__
        report.replaced[(name, f"truefuse.sibling_linears ({len(g)} projections: x's gradient summed in the GEMMs)")] += 1

    def patch():
        for g in groups:
            for m in g:
                m.__class__ = cls
                m.__dict__[_GROUP] = g

    return patch


def unpatch(module: torch.nn.Module) -> None:
    """Drop a member's group and kept output (its class is ``modules.unpatch``'s)."""
    module.__dict__.pop(_GROUP, None)
    module.__dict__.pop(_KEPT, None)
