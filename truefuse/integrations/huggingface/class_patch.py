"""``apply_truefuse_to``: patch an architecture's classes for the models built after the call.

For ``from_pretrained`` of a checkpoint too large to build stock first. The modeling module's
norm, MLP and attention names point to truefuse's subclasses (a model built later instantiates
them), and the ``*ForCausalLM``'s ``__init__`` patches each new instance's loss
(``loss.patch_loss(instance)``). Models built before the call keep their stock modules and loss
(issue 31: the class's ``forward`` used to be replaced, which changed every existing model's loss
too). The call returns a :class:`ClassPatch`: what was patched, and ``remove()`` (or a ``with``
block) to undo it. Models built while it was active stay patched after ``remove()``;
``unpatch_truefuse(model)`` gives one of them the stock code back.
"""

from __future__ import annotations

import functools
import importlib

from truefuse.integrations.huggingface import modules
from truefuse.integrations.huggingface.architectures import architecture_of

#: What ``ClassPatch`` sets on a wrapped ``__init__``: the ``__init__`` it wraps.
_WRAPPED_INIT = "_truefuse_stock_init"


def _init_patching_loss(cls: type):
    """``cls.__init__`` followed by ``loss.patch_loss(self)`` (where the new model's class runs the
    stock forward: a subclass overriding ``forward`` is left alone, as ``apply_truefuse`` leaves it)."""
    from truefuse.integrations.huggingface import loss

    stock_init = cls.__init__

    @functools.wraps(stock_init)
    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        if loss.supports_loss(self) is None:
            loss.patch_loss(self)

    setattr(__init__, _WRAPPED_INIT, stock_init)
    return __init__


class ClassPatch:
    """What one ``apply_truefuse_to`` call patched, and its undo.

    Attributes:
        architecture: the architecture key (``llama``, ``mixtral``, ...).
        replaced: ``{stock class name: truefuse path}`` of the classes the models built from now
            on get (a name absent here was asked off, or was already patched by an active call).
        loss: whether new ``*ForCausalLM`` instances compute ``truefuse.linear_cross_entropy``.
        left: ``{what: why}`` of what stays stock.
        active: until :meth:`remove`.

    ``remove()`` (idempotent) restores what this call set, where it is still in place; also on
    leaving a ``with apply_truefuse_to_llama():`` block.
    """

    def __init__(self, architecture: str):
        self.architecture = architecture
        self.replaced: dict[str, str] = {}
        self.left: dict[str, str] = {}
        self.loss = False
        self.active = True
        self._undo: list[tuple[object, str, object, object]] = []  # (owner, name, ours, previous)

    def _set(self, owner, name: str, value) -> None:
        previous = owner.__dict__.get(name)
        setattr(owner, name, value)
        self._undo.append((owner, name, value, previous))

    def remove(self) -> None:
        """Give the classes back what they had before this call (models already built keep theirs)."""
        for owner, name, ours, previous in reversed(self._undo):
            if owner.__dict__.get(name) is not ours:
                continue  # replaced since by someone else: theirs stays
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._undo.clear()
        self.active = False

    def __enter__(self) -> ClassPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __str__(self) -> str:
        state = "active" if self.active else "removed"
        lines = [f"truefuse class patch of {self.architecture} ({state}; models built from now on)"]
        lines += [f"  {name:<24} -> {how}" for name, how in sorted(self.replaced.items())]
        lines.append("  loss: " + ("truefuse.linear_cross_entropy" if self.loss else f"stock ({self.left.get('loss', '')})"))
        lines += [f"  left {what:<19} ({why})" for what, why in sorted(self.left.items()) if what != "loss"]
        return "\n".join(lines)

    __repr__ = __str__


def apply_truefuse_to(
    model_type: str,
    *,
    rms_norm: bool = True,
    mlp: bool = True,
    rope: bool = True,
    linear_cross_entropy: bool = True,
) -> ClassPatch:
    """Patch the architecture's classes for the models built after this call (``from_pretrained``).

    The modeling module's norm, MLP and attention classes become truefuse's subclasses (as
    ``apply_truefuse`` gives instances: stock norm bits, the fused gated activation, truefuse's
    rope) and each new ``*ForCausalLM`` computes truefuse's loss. Models built before are not
    changed. Experts are patched on instances only (``apply_truefuse(model)``).

    Returns:
        A :class:`ClassPatch`: the report, and ``remove()`` / ``with`` to undo.

    Raises:
        ValueError for an unknown ``model_type`` (nothing patched).
    """
    arch = architecture_of(model_type)
    mod = importlib.import_module(arch.module)
    patch = ClassPatch(model_type)

    def swap(flag: bool, option: str, name: str | None, make, how: str) -> None:
        if name is None:
            return
        if not flag:
            patch.left[name] = f"{option}=False"
        elif hasattr(getattr(mod, name), "_truefuse_stock"):
            patch.left[name] = "already patched by an active apply_truefuse_to"
        else:
            patch._set(mod, name, make(arch.cls(name)))
            patch.replaced[name] = how

    norm_how = f"truefuse.rms_norm_hf (style {arch.norm_style}: stock bits)"
    swap(rms_norm, "rms_norm", arch.norm, lambda c: modules.norm_class(c, arch.norm_style), norm_how)
    swap(mlp, "mlp", arch.mlp, modules.mlp_class, "truefuse.gated_activation (one rounding)")
    swap(rope, "rope", arch.attention, modules.attention_class, "truefuse.apply_rotary_pos_emb (stock bits)")
    if arch.experts:
        patch.left[arch.experts] = "experts are patched on instances only: apply_truefuse(model)"

    lm = arch.cls(arch.causal_lm)
    if not linear_cross_entropy:
        patch.left["loss"] = "linear_cross_entropy=False"
    elif hasattr(lm.__init__, _WRAPPED_INIT):
        patch.left["loss"] = "already patched by an active apply_truefuse_to"
    else:
        patch._set(lm, "__init__", _init_patching_loss(lm))
        patch.loss = True
    return patch
