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
from truefuse.autograd.linear import linear_kept
from truefuse.config import batch_invariant, is_batch_invariant
from truefuse.integrations.huggingface import modules
from truefuse.integrations.huggingface.rotary_op import register as register_rotary
from truefuse.integrations.huggingface.rotary_op import rotary_cos_sin
from truefuse.integrations.huggingface.siblings import Siblings, find_groups, fused_call
from truefuse.ops._launch.triton import PLAIN_TENSORS as _PLAIN_TYPES
from truefuse.ops.gemm.gemm_checks import FLOATS as _GEMM_DTYPES

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
            if router.siblings is None or not router.siblings.claims(weight):
                y = linear_kept(input, weight, bias)  # decode: the kept launch, before the checks below
                if y is not None:
                    router.routed += 1
                    return y
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
    ``.shape``/``.dtype`` reads), ~3.5 µs each on the 2-core CI box (experiments/host_time.py bi-stubbed,
    docs/benchmarks.md "Batch-invariant mode"). Unlike the mode, ``torch._C._nn.linear`` called
    directly is not routed, and a tensor subclass comparing ``func`` with the module attribute at
    call time sees the wrapper."""

    def __init__(self, groups=None, owner=None) -> None:
        self.owner = owner  # the ModelMode that entered it (None: a block of running_batch_invariant)
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
    """The mode and the routing of ``F.linear`` for a block (what a :class:`ModelMode` enters), with
    ``groups`` of sibling projections (``siblings.find_groups``) computed in one launch each."""
    with batch_invariant(), BatchInvariantLinear(groups) as mode:
        yield mode


class ModelMode:
    """A batch-invariant model's mode, entered wherever the model's code can run: the model's forward
    (hooks: ``model(...)``, ``generate``, PEFT's wrappers), each decoder layer's forward (gradient
    checkpointing recomputes a layer in the backward, outside the model's hooks: transformers >= 5.2x
    checkpoints the layer's ``forward``, so only the layer itself can enter it there), and
    :func:`model_mode` (``model_log_probs``, the TRL head: code that calls ``model.base_model``).
    Entering it where it is already the innermost mode costs one check and changes nothing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model  # its _truefuse_bi_groups are read at each entry (a test clears them)
        self._stacks: dict[int, list] = {}  # thread id -> what each open entry has to close

    def active(self) -> bool:
        """Whether this model's mode is the innermost on this thread."""
        routers = getattr(_LOCAL, "routers", None)
        return bool(routers) and routers[-1] is not None and routers[-1].owner is self and is_batch_invariant()

    @contextlib.contextmanager
    def entered(self):
        if self.active():
            yield
            return
        with batch_invariant(), BatchInvariantLinear(self.model._truefuse_bi_groups, owner=self):
            yield

    def push(self) -> None:
        cm = self.entered()
        cm.__enter__()
        self._stacks.setdefault(threading.get_ident(), []).append(cm)

    def pop(self) -> None:
        stack = self._stacks.get(threading.get_ident())
        if stack:
            stack.pop().__exit__(None, None, None)


def _pre_hook(module, args):
    module._truefuse_bi_mode.push()


def _post_hook(module, args, output):
    # always called (also when the forward raised), so the mode never leaks out of the model
    module._truefuse_bi_mode.pop()


def in_mode(module: torch.nn.Module, forward, *args, **kwargs):
    """``forward(module, *args, **kwargs)`` inside ``module``'s batch-invariant mode, where
    :func:`enable` gave it one (its ``_truefuse_bi_mode``) and it is not already the innermost; not
    while torch.compile traces (the hooks around a compiled call enter it). The one rule of the
    forwards that enter the mode themselves: a decoder layer's (gradient checkpointing recomputes it
    outside the model's hooks), the fused add + norm layer's, the patched causal-LM forward's (a
    direct ``model.forward`` call skips the hooks)."""
    mode = module.__dict__.get("_truefuse_bi_mode")
    if mode is None or torch.compiler.is_compiling() or mode.active():
        return forward(module, *args, **kwargs)
    with mode.entered():
        return forward(module, *args, **kwargs)


def _layer_forward(self, *args, **kwargs):
    """A decoder layer's forward in its model's mode (:class:`ModelMode`): the stock forward (the
    class's checkpointing wrapper, which runs it directly for a subclass) inside the mode."""
    return in_mode(self, self._truefuse_stock.forward, *args, **kwargs)


def _rotary_forward(self, x, position_ids, *args, **kwargs):
    """A rotary embedding's stock forward; while torch.compile traces, as one opaque op
    (``rotary_op.py``: Inductor computes ``cos`` to other roundings than eager, and a
    batch-invariant model's compiled logits must be its eager ones)."""
    stock = self._truefuse_stock.forward
    if args or kwargs or not torch.compiler.is_compiling():
        return stock(self, x, position_ids, *args, **kwargs)
    return rotary_cos_sin(self.__dict__["_truefuse_rotary_key"], x, position_ids)


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' rotary embeddings (``*RotaryEmbedding`` with its ``inv_freq``), not yet patched."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq") and not modules.is_patched(m)
    ]


def _checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules gradient checkpointing may recompute: transformers' ``GradientCheckpointingLayer``s."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # no such base class: checkpointing calls the layer's __call__ (hooks)
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable(model: torch.nn.Module) -> None:
    """Make ``model`` run batch-invariant (idempotent: a second call adds nothing)."""
    if getattr(model, "_truefuse_bi_handles", None):
        return
    mode = ModelMode(model)
    model._truefuse_bi_mode = mode
    model._truefuse_bi_groups = find_groups(model)
    model._truefuse_bi_handles = (
        model.register_forward_pre_hook(_pre_hook),
        model.register_forward_hook(_post_hook, always_call=True),
    )
    for layer in _checkpointed_layers(model):
        layer.__dict__["_truefuse_bi_mode"] = mode
        if not modules.is_patched(layer):  # a patched layer's forward enters the mode itself (residual_norm.py)
            layer.__class__ = modules.truefuse_subclass(type(layer), "batch_invariant_layer", _layer_forward)
    for rotary in _rotary_modules(model):
        rotary.__dict__["_truefuse_rotary_key"] = register_rotary(rotary)
        rotary.__class__ = modules.truefuse_subclass(type(rotary), "batch_invariant_rotary", _rotary_forward)


def disable(model: torch.nn.Module) -> None:
    """Undo :func:`enable` (no-op on a model without it)."""
    for h in getattr(model, "_truefuse_bi_handles", None) or ():
        h.remove()
    for m in model.modules():  # the layers (unpatch_truefuse may have given them their class back)
        if getattr(type(m), "_truefuse_kind", None) in ("batch_invariant_layer", "batch_invariant_rotary"):
            modules.unpatch(m)
        if m is not model:
            m.__dict__.pop("_truefuse_bi_mode", None)
            m.__dict__.pop("_truefuse_rotary_key", None)
    for name in ("_truefuse_bi_handles", "_truefuse_bi_mode", "_truefuse_bi_groups"):
        if name in vars(model):
            delattr(model, name)


def is_enabled(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_truefuse_bi_handles", None))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (``get_base_model()``), or ``model`` itself."""
    # read on the type: a PEFT model forwards unknown attributes to the model it wraps
    return model.get_base_model() if callable(getattr(type(model), "get_base_model", None)) else model


def model_mode(model: torch.nn.Module):
    """A context in which code that calls into ``model`` past its forward (``model.base_model``, its
    ``lm_head``) runs in the model's mode: batch-invariant where ``apply_truefuse(model,
    batch_invariant=True)`` made it so (also inside a PEFT wrapper), nothing otherwise."""
    mode = getattr(unwrap(model), "_truefuse_bi_mode", None)
    return mode.entered() if mode is not None else contextlib.nullcontext()


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
