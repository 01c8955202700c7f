"""``apply_truefuse(model, batch_invariant=True)``: a Hugging Face model whose every token's result
is bitwise independent of the batch it runs in (docs/design.md §1, "Batch invariance"; issue 34).

While the model's forward runs (a forward pre-hook and an always-called forward hook on the model):

* ``truefuse.batch_invariant()`` is on, so every truefuse op in it (the norms, the gated MLP, rope,
  the experts' grouped GEMMs, the loss) takes its batch-invariant path and keeps it for its
  backward;
* ``F.linear`` runs on ``truefuse``'s Linear Function, whose GEMMs are the planner's
  batch-invariant GEMM (forward and input gradient; the weight gradient on the plain plan, the same
  bits run to run). Routed by swapping ``torch.nn.functional.linear`` for the forward
  (:class:`BatchInvariantLinear`), not by changing any module's class: the
  q/k/v/o/gate/up/down ``nn.Linear`` stay ``nn.Linear``, and a LoRA/PEFT wrapper on top (which
  calls its base layer and its adapters' ``F.linear``) runs batch-invariant as a whole;
* the mixture-of-experts routers (:data:`ROUTER_CLASSES`) compute their logits in fp32 and break
  top-k ties at the lowest expert index (``moe.patch_router``).

Attention stays the model's ``attn_implementation`` (its batch invariance is issue 33).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from truefuse.autograd._wgrad import WgradState
from truefuse.autograd.linear import linear as _truefuse_linear
from truefuse.config import batch_invariant
from truefuse.integrations.huggingface.siblings import Siblings, find_groups, fused_call
from truefuse.ops._triton import PLAIN_TENSORS as _PLAIN_TYPES
from truefuse.ops.gemm import _FLOATS as _GEMM_DTYPES

#: What F.linear's weight gradient goes through: the plain configuration (autograd's ``.grad``).
_PLAIN = WgradState(owner="F.linear (batch-invariant)")


def _routable(x, weight, bias) -> bool:
    """Whether truefuse's Linear computes this ``F.linear`` (plain dense tensors it takes); anything
    else (tensor subclasses, quantized weights, other devices) runs stock."""
    plain = type(x) in _PLAIN_TYPES and type(weight) in _PLAIN_TYPES and (bias is None or type(bias) in _PLAIN_TYPES)
    return (
        plain
        and weight.dim() == 2
        and x.dim() >= 1
        and weight.dtype in _GEMM_DTYPES
        and x.device.type in ("cpu", "cuda")
        and x.device == weight.device
    )


#: ``torch.nn.functional.linear`` as torch defines it (a C function): what a call that is not
#: routed runs, and what :func:`_uninstall` puts back
_STOCK_LINEAR = F.linear
_LOCAL = threading.local()  # .routers: the routers entered on this thread, innermost last
_LOCK = threading.Lock()
_ENTERED = [0]  # routers entered on every thread: F.linear is patched while it is > 0


def _routed_linear(input, weight, bias=None):
    """``torch.nn.functional.linear`` while a :class:`BatchInvariantLinear` is entered: on a thread
    that entered one, a routable call runs truefuse's Linear and truefuse's own calls inside it run
    stock (a None on the stack); every other call, and every call on another thread, runs stock."""
    routers = getattr(_LOCAL, "routers", None)
    if routers:
        router = routers[-1]
        if router is not None:
            if _routable(input, weight, bias):
                router.routed += 1
                if router.siblings is not None:
                    y = fused_call(router.siblings, input, weight, bias)
                    if y is not None:
                        return y
                routers.append(None)
                try:
                    return _truefuse_linear(input, weight, bias, state=_PLAIN)
                finally:
                    routers.pop()
            router.left += 1
    return _STOCK_LINEAR(input, weight, bias)


class BatchInvariantLinear:
    """Routes ``F.linear(x, weight, bias)`` on the entering thread to truefuse's Linear (its GEMMs
    batch-invariant under the switch); every other function runs as called. Counts what it routed
    and what it left.

    While one is entered anywhere, ``torch.nn.functional.linear`` is :func:`_routed_linear`, which
    nn.Linear, LoRA adapters and the experts call through the module attribute; the last exit puts
    torch's function back. It was a ``TorchFunctionMode``, which put every torch call of the
    forward through Python: 274 calls a decoder layer per decode step of a tiny Llama (most of them
    ``.shape``/``.dtype`` reads), ~3.5 µs each on the 2-core CI box (experiments/exp_bi_host_time.py,
    docs/benchmarks.md "Batch-invariant mode"). Unlike the mode, ``torch._C._nn.linear`` called
    directly is not routed, and a tensor subclass comparing ``func`` with the module attribute at
    call time sees the wrapper."""

    def __init__(self, groups=None) -> None:
        self.routed = 0
        self.left = 0
        # sibling projections in one launch (siblings.py), for the model whose forward entered it
        self.siblings = Siblings(groups) if groups else None

    def __enter__(self) -> BatchInvariantLinear:
        routers = getattr(_LOCAL, "routers", None)
        if routers is None:
            routers = _LOCAL.routers = []
        with _LOCK:
            if _ENTERED[0] == 0:
                F.linear = _routed_linear
            _ENTERED[0] += 1
        routers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        routers = _LOCAL.routers
        # the innermost entry of this router (exits may come out of order through the model hooks)
        del routers[len(routers) - 1 - routers[::-1].index(self)]
        with _LOCK:
            _ENTERED[0] -= 1
            if _ENTERED[0] == 0 and F.linear is _routed_linear:
                F.linear = _STOCK_LINEAR


@contextlib.contextmanager
def running_batch_invariant(groups=None):
    """The mode and the routing of ``F.linear`` for a block (what the model's hooks enter), with
    ``groups`` of sibling projections (``siblings.find_groups``) computed in one launch each."""
    with batch_invariant(), BatchInvariantLinear(groups) as mode:
        yield mode


def _pre_hook(module, args):
    stack = contextlib.ExitStack()
    stack.enter_context(running_batch_invariant(module._truefuse_bi_groups))
    module._truefuse_bi_stacks.append(stack)


def _post_hook(module, args, output):
    # always called (also when the forward raised), so the mode never leaks out of the model
    stacks = module._truefuse_bi_stacks
    if stacks:
        stacks.pop().close()


def enable(model: torch.nn.Module) -> None:
    """Hook ``model``'s forward to run batch-invariant (idempotent: a second call adds nothing)."""
    if getattr(model, "_truefuse_bi_handles", None):
        return
    model._truefuse_bi_stacks = []
    model._truefuse_bi_groups = find_groups(model)
    model._truefuse_bi_handles = (
        model.register_forward_pre_hook(_pre_hook),
        model.register_forward_hook(_post_hook, always_call=True),
    )


def disable(model: torch.nn.Module) -> None:
    """Remove :func:`enable`'s hooks (no-op on a model without them)."""
    for h in getattr(model, "_truefuse_bi_handles", None) or ():
        h.remove()
    for name in ("_truefuse_bi_handles", "_truefuse_bi_stacks", "_truefuse_bi_groups"):
        if name in vars(model):
            delattr(model, name)


def is_enabled(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_truefuse_bi_handles", None))


def count_linears(model: torch.nn.Module) -> dict[str, int]:
    """``{leaf name: count}`` of the ``nn.Linear`` modules whose GEMMs run batch-invariant (``q_proj``,
    ``gate_proj``, ``lm_head``, a LoRA adapter's ``lora_A``...), for the PatchReport."""
    counts: dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1] or type(m).__name__
            counts[leaf] = counts.get(leaf, 0) + 1
    return counts


def patcher(model: torch.nn.Module, report):
    """Fill ``report.batch_invariant`` with what will run batch-invariant and return the patch
    (``apply_truefuse`` calls it after its other patches): the routers and the model's hooks."""
    from truefuse.integrations.huggingface import moe

    for leaf, n in sorted(count_linears(model).items()):
        report.batch_invariant[(f"nn.Linear {leaf}", "truefuse Linear on the batch-invariant GEMM")] += n
    routers = moe.find_routers(model)
    for r in routers:
        name = getattr(type(r), "_truefuse_stock", type(r)).__name__
        report.batch_invariant[(name, "fp32 logits, ties to the lowest expert")] += 1
    for (stock, how), n in report.replaced.items():
        report.batch_invariant[(stock, how)] += n  # every truefuse op reads the switch

    def patch() -> None:
        for r in routers:
            moe.patch_router(r)
        enable(model)

    return patch
