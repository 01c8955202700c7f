"""How the patched forward reaches ``lm_head``'s weight for the fused loss (and batch-invariant logits).

A plain ``nn.Linear`` head, alone, under DDP, or inside an FSDP2 unit that holds more than the head
(``fully_shard(model)``: the weight is unsharded for the unit's whole forward): the weight is read
where it is. A head that is an FSDP2 unit of its own (``fully_shard(model.lm_head)``, or grouped
with tied embeddings, ``fully_shard([embed_tokens, lm_head])``): the weight is sharded outside the
unit's forward, so the fused computation runs *as* the head's forward, through the module call
(:func:`on_head`), and FSDP2's own hooks do what they do for ``lm_head(hidden)``: unshard the weight
(cast by the ``MixedPrecisionPolicy``), reshard it after the forward, unshard it again in the
backward and reduce-scatter its gradient right after the head's backward. (``head.unshard()`` and a
direct call also reach the right gradient, through the root's end-of-backward callback, but keep
the weight unsharded from the forward to the end of the backward and reduce it last: measured on 2
gloo ranks, tests/distributed/test_fsdp.py checks the reshard between forward and backward.)

:func:`head_reason` says why neither works (the patched forward then falls back to the stock logits
with a warning): another module class (PEFT, quantized layers), a forward replaced on the instance
(accelerate's hooks), forward hooks that are not FSDP2's own (offloading, adapters), module backward
hooks, a meta weight, or a DTensor weight that is not FSDP2's shard (tensor parallelism).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def _loaded(name: str, attr: str):
    """``name.attr`` if the module ``name`` is imported, else None: an FSDP2 unit or a DTensor exists
    only once its module is (importing torch.distributed.fsdp took 5 s on the 2-core dev machine)."""
    mod = sys.modules.get(name)
    return None if mod is None else getattr(mod, attr, None)


def _fsdp_module_class():
    return _loaded("torch.distributed.fsdp", "FSDPModule")


def is_fsdp_unit(head) -> bool:
    """``head`` is an FSDP2 unit itself (``fully_shard(head)``), not merely inside one."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(head, cls)


def _fsdp_state(head):
    """The FSDP2 state whose hooks ``fully_shard(head)`` registered; None if this torch hides it."""
    try:
        return head._get_fsdp_state()  # private, stable since torch 2.4 (FSDPModule.unshard uses it)
    except (AttributeError, AssertionError):
        return None


def _is_state_hook(hook, state) -> bool:
    """``hook`` is a method of ``state``, or wraps one (``functools.wraps``: a grouped
    ``fully_shard([embed_tokens, lm_head])`` registers wrappers of its state's hooks)."""
    for _ in range(4):  # the grouped wrapper under torch's dynamo-disable wrapper: 2 levels
        if hook is None:
            return False
        if getattr(hook, "__self__", None) is state:
            return True
        hook = getattr(hook, "__wrapped__", None)
    return False


def _foreign_hooks(head) -> bool:
    """Forward hooks other than the ones FSDP2 registered for this unit."""
    hooks = [*head._forward_pre_hooks.values(), *head._forward_hooks.values()]
    if not hooks:
        return False
    state = _fsdp_state(head) if is_fsdp_unit(head) else None
    return state is None or not all(_is_state_hook(h, state) for h in hooks)


def _dtensor_reason(head) -> str | None:
    W, dtensor = head.weight, _loaded("torch.distributed.tensor", "DTensor")
    if dtensor is None or not isinstance(W, dtensor):
        return None
    sharded = [p for p in W.placements if not p.is_replicate()]
    if is_fsdp_unit(head) and len(sharded) <= 1:
        return None  # FSDP2's (or HSDP's) shard of a plain weight: the unit's forward unshards it
    return f"lm_head.weight is a DTensor with placements {tuple(W.placements)} (tensor parallelism)"


def head_reason(head) -> str | None:
    """Why the fused loss cannot use ``head`` (None: it can, through :func:`on_head`)."""
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return f"lm_head is {type(head).__name__}, not a plain torch.nn.Linear"
    if "forward" in head.__dict__:
        return "lm_head's forward is replaced on the instance (e.g. accelerate's hooks)"
    if _foreign_hooks(head):
        return "lm_head has forward hooks other than FSDP2's own (e.g. offloading, adapters)"
    if head._backward_hooks or head._backward_pre_hooks:  # module backward hooks need lm_head(x)'s graph
        return "lm_head has module backward hooks"
    if head.weight.device.type == "meta":
        return "lm_head.weight is on the meta device"
    return _dtensor_reason(head)


def on_head(head, fn: Callable[..., torch.Tensor], x: torch.Tensor, *args):
    """``fn(x, head.weight, head.bias, *args)`` with the weight ``head``'s forward would see.

    For an FSDP2 unit, ``fn`` runs as ``head``'s forward for this one call (an instance attribute that
    shadows ``nn.Linear.forward``, removed after), so the unit's hooks unshard around it, see ``x``
    (and any tensor in ``args``) as the forward's inputs and the result as its output: the weight's
    gradient reaches FSDP2's reduce-scatter as ``lm_head(x)``'s would. Otherwise a direct call.
    """
    if not is_fsdp_unit(head):
        return fn(x, head.weight, head.bias, *args)

    def forward(x, *args):
        return fn(x, head.weight, head.bias, *args)

    head.forward = forward
    try:
        return head(x, *args)
    finally:
        del head.forward
