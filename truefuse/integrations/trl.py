"""truefuse's LM head in TRL's trainers (``pip install truefuse[rl]``; docs/trl.md).

TRL (>= 1.16) computes every trainer's log-probs and loss through
``trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)``: it
replaces ``model.forward`` so that ``model(..., labels=..., fused_lm_head=True)`` runs the backbone
and TRL's own chunked head, returning a ``FusedCausalLMOutput``. A model patched by
``apply_truefuse`` therefore never ran truefuse's head under TRL. One line before building the
trainer changes that::

    import truefuse.integrations.trl as tf_trl
    switch = tf_trl.use_truefuse_head()     # GRPO, RLOO, SFT, DPO, KTO trainers built after this
    trainer = GRPOTrainer(model=model, ...)
    print(tf_trl.trl_head(trainer.model))   # which head ran, how many calls, every fallback's reason

:func:`use_truefuse_head` replaces ``add_fused_lm_head`` where TRL's modules bound it (undoable:
``switch.undo()`` or ``with use_truefuse_head():``; idempotent). The replacement first lets TRL
patch the model as it would (TRL's head stays the fallback), then puts :func:`fused_forward` in
front of it: with ``fused_lm_head=True`` the log-probs and entropies come from
``truefuse.linear_log_probs`` (temperature and Gemma's softcap applied by it), called as
``model_log_probs`` calls it, so in batch-invariant mode (``apply_truefuse(model,
batch_invariant=True)``) the trainer's log-probs are the bits of ``model_log_probs`` and of
``truefuse.token_log_probs`` over ``generate``'s logits (docs/batch_invariance.md). The output is
TRL's: same fields, zeros where the label is -100, ``shift_labels``, ``num_items_in_batch``, the
MoE load-balancing loss, ``cast_lm_head_to_fp32``. ``is_top1``, ``mean_logits`` and
``log_sum_sq_probs`` (metrics, no gradient) come from one extra no-grad logits GEMM over the scored
tokens, in slices of tokens.

A call truefuse's head cannot take runs TRL's head, counted with its reason in :class:`TrlHead` and
warned: a logit scale other than 1 (Cohere, Granite: ``linear_log_probs`` has no scale), an
``lm_head`` that is not a plain ``nn.Linear`` truefuse can read (PEFT ``modules_to_save`` or LoRA on
the head, hooks other than FSDP2's, a tensor-parallel DTensor), a device other than the CPU or CUDA.

Importable without TRL; TRL is imported when the switch is turned on.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from truefuse.autograd.linear_log_probs import linear_log_probs

__all__ = ["TRAINER_MODULES", "TrlHead", "TrlHeadSwitch", "fused_forward", "trl_head", "use_truefuse_head"]

#: The TRL modules whose trainers call ``add_fused_lm_head`` (imported by the switch so that the
#: name they bound is replaced even when they load later); any other loaded ``trl`` module that
#: bound the same function is replaced too.
TRAINER_MODULES = (
    "trl.trainer.utils",
    "trl.trainer.grpo_trainer",
    "trl.trainer.rloo_trainer",
    "trl.trainer.sft_trainer",
    "trl.trainer.dpo_trainer",
    "trl.trainer.kto_trainer",
)
#: What the patched model's record is stored as (on the transformers model TRL patched).
_RECORD = "_truefuse_trl_head"
TRUEFUSE = "truefuse.linear_log_probs"
_EXTRAS = ("log_sum_sq_probs", "mean_logits", "is_top1")
#: Logits an extras slice may hold (fp32): 64 Mi values, 256 MiB.
_EXTRAS_ELEMS = 1 << 26


@dataclass
class TrlHead:
    """What ``model(..., fused_lm_head=True)`` runs on one model TRL patched.

    Attributes:
        model: the model's class name.
        temperature, cast_lm_head_to_fp32, outputs: ``add_fused_lm_head``'s arguments.
        fallback: why every call runs TRL's head ("": truefuse's head takes the calls it can).
        calls: ``{head: count}`` of the fused calls so far: ``"truefuse.linear_log_probs"``, or
            ``"trl (<reason>)"`` for a call that fell back.
    """

    model: str
    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: tuple[str, ...]
    fallback: str = ""
    calls: Counter = field(default_factory=Counter)
    last: str = ""

    @property
    def head(self) -> str:
        """The head the latest fused call ran (before any call: the one it will try)."""
        return self.last or (f"trl ({self.fallback})" if self.fallback else TRUEFUSE)

    def __str__(self) -> str:
        lines = [
            f"TRL fused_lm_head of {self.model}: {TRUEFUSE if not self.fallback else 'trl (' + self.fallback + ')'}"
            f" (temperature={self.temperature}, outputs={self.outputs}, cast_lm_head_to_fp32={self.cast_lm_head_to_fp32})"
        ]
        for head, n in sorted(self.calls.items()):
            lines.append(f"  {n:6d} calls -> {head}")
        return "\n".join(lines)


def trl_head(model) -> TrlHead | None:
    """The :class:`TrlHead` of ``model`` (a trainer's model; PEFT and DDP-style wrappers are looked
    through), or None when the switch did not patch it."""
    for _ in range(4):
        rec = getattr(model, "__dict__", {}).get(_RECORD)
        if rec is not None:
            return rec
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module"):
            model = model.module
        else:
            return None
    return None


# ----------------------------------------------------------------------------------------------
# the model's forward


def _logit_scale(text_config) -> float:
    """The multiplier of the logits before the softcap, read from the same config attributes TRL
    reads (1.0 when the model does not scale them)."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        s = text_config.logits_scaling
        scale = s if getattr(text_config, "model_type", None) == "hyperclovax" else 1 / s
    return 1.0 if scale is None else float(scale)


def _static_fallback(model) -> str:
    """Why no call of ``model`` can take truefuse's head ("" when calls may)."""
    text_config = model.config.get_text_config()
    scale = _logit_scale(text_config)
    if scale != 1.0:
        return f"logit scale {scale} (truefuse.linear_log_probs takes none)"
    if text_config is not model.config:
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) < Version("5.0.0"):
            return "a vision-language model on transformers < 5 (its backbone is not base_model)"
    return ""


def _call_fallback(head) -> str:
    """Why this call cannot take truefuse's head ("" when it can): what ``lm_head`` is now (PEFT
    or FSDP may have replaced it since the model was patched)."""
    from truefuse.integrations.huggingface.head import head_reason

    reason = head_reason(head)
    if reason:
        return reason
    if head.weight.device.type not in ("cpu", "cuda"):
        return f"lm_head on device {head.weight.device.type} (truefuse's head runs on the CPU and CUDA)"
    return ""


def _compute_dtype(x: torch.Tensor, cast_fp32: bool) -> torch.dtype:
    if cast_fp32:
        return torch.float32
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


@torch.no_grad()
def _extras(x, W, b, t, temperature, softcap, want, dtype) -> dict[str, torch.Tensor]:
    """``log_sum_sq_probs``, ``mean_logits``, ``is_top1`` (those in ``want``) of the N rows of
    ``x`` (N, H) against ``t`` (N,): the logits' GEMM in ``dtype`` as the head's, the rest in fp32,
    in slices of rows so that at most ``_EXTRAS_ELEMS`` logits exist at once."""
    N, V = x.shape[0], W.shape[0]
    out = {name: torch.empty(N, device=x.device, dtype=torch.bool if name == "is_top1" else torch.float32) for name in want}
    Wc = W.to(dtype)
    bc = None if b is None else b.to(dtype)
    step = max(1, _EXTRAS_ELEMS // max(V, 1))
    for s in range(0, N, step):
        rows = slice(s, min(s + step, N))
        z = torch.nn.functional.linear(x[rows].to(dtype), Wc, bc).float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        if "mean_logits" in want:
            out["mean_logits"][rows] = z.mean(-1)
        if "log_sum_sq_probs" in want:
            # log sum_v p_v^2 = logsumexp(2 z) - 2 logsumexp(z)
            out["log_sum_sq_probs"][rows] = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
        if "is_top1" in want:
            # argmax takes the first of tied maxima: the label counts only as that first one (TRL's rule)
            out["is_top1"][rows] = z.argmax(-1) == t[rows]
    return out


def _head_outputs(x, W, b, t, temperature, softcap, outputs, cast_fp32):
    """The per-token fields over the scored rows ``x`` (N, H): ``linear_log_probs`` as
    ``model_log_probs`` calls it, then the no-grad extras. Runs as ``lm_head``'s forward under
    FSDP2 (``head.on_head``), so ``W`` is the weight that forward sees."""
    dtype = _compute_dtype(x, cast_fp32)
    if cast_fp32:
        # TRL's cast_lm_head_to_fp32: the projection in fp32, outside autocast
        ctx = torch.autocast(x.device.type, enabled=False)
        x, W, b = x.float(), W.float(), None if b is None else b.float()
    else:
        ctx = nullcontext()
        if not torch.is_autocast_enabled(x.device.type) and W.dtype != x.dtype:
            W, b = W.to(x.dtype), None if b is None else b.to(x.dtype)  # TRL casts the head to the input's dtype
    want = tuple(n for n in _EXTRAS if n in outputs)
    with ctx:
        lp, ent = linear_log_probs(x, W, t, linear_bias=b, temperature=temperature, softcap=softcap)
        extras = _extras(x, W, b, t, temperature, softcap, want, dtype) if want else {}
    return lp, ent, extras


def _aux_loss(self, text_config, backbone_outputs, attention_mask):
    """The MoE load-balancing loss as the stock forward computes it (Mixtral's function, which the
    MoE families share)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    n = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
    if n is None:
        n = self.num_experts
    k = getattr(text_config, "num_experts_per_tok", None) or self.num_experts_per_tok
    return load_balancing_loss_func(backbone_outputs.router_logits, n, k, attention_mask)


def fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
    """``model.forward`` after :func:`use_truefuse_head`'s ``add_fused_lm_head``: TRL's contract
    (``trl.trainer.utils.FusedCausalLMOutput``) on truefuse's head. Without ``fused_lm_head`` (or
    on a fallback) the call goes to TRL's forward, which keeps the model's own for generation."""
    rec: TrlHead = self.__dict__[_RECORD]
    trl_forward = self.__dict__["_truefuse_trl_forward"]
    passed = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
    if not fused_lm_head:
        return trl_forward(*args, **{k: v for k, v in passed.items() if v is not None}, **kwargs)
    if rec.fallback:
        return _fallback(self, rec, rec.fallback, trl_forward, args, passed, kwargs)

    text_config = self.config.get_text_config()
    backbone_kwargs = dict(kwargs, use_cache=False)
    if getattr(text_config, "output_router_logits", False):
        backbone_kwargs.setdefault("output_router_logits", True)
    head = self.get_output_embeddings()
    reason = _call_fallback(head)
    if reason:
        return _fallback(self, rec, reason, trl_forward, args, passed, kwargs)
    from truefuse.integrations.huggingface.batch_invariant import model_mode
    from truefuse.integrations.huggingface.log_probs import positions

    mask_in = backbone_kwargs.get("attention_mask")
    if backbone_kwargs.get("position_ids") is None and isinstance(mask_in, torch.Tensor) and mask_in.dim() == 2:
        # positions over attended tokens, as generate numbers them: a left-padded prompt then gets
        # the sampler's positions (stock numbers them from the padding: rope is relative, so the same
        # values, other bits); the same as arange where nothing is left-padded
        backbone_kwargs["position_ids"] = positions(mask_in)
    # looked up on each call: PEFT and FSDP replace the backbone and the head after patching; in the
    # model's mode (batch-invariant where patched so) also when called past its forward's hooks
    with model_mode(self):
        return _fused_head(self, rec, text_config, head, args, backbone_kwargs, kwargs, labels, shift_labels, num_items_in_batch)


def _fused_head(self, rec, text_config, head, args, backbone_kwargs, kwargs, labels, shift_labels, num_items_in_batch):
    """The backbone, then truefuse's head over the scored positions, as TRL's output."""
    from trl.trainer.utils import FusedCausalLMOutput

    out = self.base_model(*args, **backbone_kwargs)
    if shift_labels is None:
        hidden, target = out.last_hidden_state[:, :-1], labels[:, 1:]
    else:
        hidden, target = out.last_hidden_state, shift_labels
    # the backbone can end on another device than the head (device_map)
    hidden, target = hidden.to(head.weight.device), target.to(head.weight.device)
    mask = target != -100
    softcap = getattr(text_config, "final_logit_softcapping", None)
    from truefuse.integrations.huggingface.head import on_head

    # only the scored positions go through the head; each row's result is its own (the same bits in
    # batch-invariant mode), and masked_scatter keeps an all-masked call connected to the graph
    lp, ent, extras = on_head(
        head,
        lambda x, W, b, t: _head_outputs(x, W, b, t, rec.temperature, softcap, rec.outputs, rec.cast_lm_head_to_fp32),
        hidden[mask],
        target[mask],
    )
    rec.calls[TRUEFUSE] += 1
    rec.last = TRUEFUSE

    def spread(v, fill=0):
        return torch.full(mask.shape, fill, device=v.device, dtype=v.dtype).masked_scatter(mask, v)

    log_probs = spread(lp)
    entropy = spread(ent) if "entropy" in rec.outputs else None
    fields = {name: spread(v) for name, v in extras.items()}
    denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / denom
    aux_loss = None
    if backbone_kwargs.get("output_router_logits"):
        aux_loss = _aux_loss(self, text_config, out, kwargs.get("attention_mask"))
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(
        loss=loss,
        log_probs=log_probs,
        entropy=entropy,
        log_sum_sq_probs=fields.get("log_sum_sq_probs"),
        mean_logits=fields.get("mean_logits"),
        is_top1=fields.get("is_top1"),
        label_mask=mask,
        aux_loss=aux_loss,
    )


def _fallback(self, rec: TrlHead, reason: str, trl_forward, args, passed, kwargs):
    key = f"trl ({reason})"
    if not rec.calls[key]:
        warnings.warn(
            f"truefuse.integrations.trl: {rec.model}'s fused_lm_head call runs TRL's head, not truefuse's: {reason}",
            stacklevel=3,
        )
    rec.calls[key] += 1
    rec.last = key
    return trl_forward(*args, fused_lm_head=True, **{k: v for k, v in passed.items() if v is not None}, **kwargs)


# ----------------------------------------------------------------------------------------------
# the switch


def _add_fused_lm_head(original):
    """truefuse's ``add_fused_lm_head``, in front of TRL's ``original``."""

    @functools.wraps(original)
    def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False, outputs=("log_probs",)):
        original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
        trl_forward = model.forward  # TRL's, bound; it calls the model's own without fused_lm_head
        rec = TrlHead(type(model).__name__, temperature, cast_lm_head_to_fp32, tuple(outputs), _static_fallback(model))
        model.__dict__["_truefuse_trl_forward"] = trl_forward
        model.__dict__[_RECORD] = rec

        # the class's signature, as TRL keeps it: generate validates its model kwargs against it
        @functools.wraps(type(model).forward)
        def forward(self, *args, **kwargs):
            return fused_forward(self, *args, **kwargs)

        model.forward = types.MethodType(forward, model)
        if _SWITCH is not None:
            _SWITCH.heads.append(rec)

    add_fused_lm_head._truefuse = True
    return add_fused_lm_head


class TrlHeadSwitch:
    """The state of :func:`use_truefuse_head`: where TRL's ``add_fused_lm_head`` was replaced
    (``modules``), the :class:`TrlHead` of every model patched since (``heads``). ``undo()`` (or
    leaving it as a context manager) puts TRL's function back; models already patched keep
    truefuse's head."""

    def __init__(self, original, replacement, modules: list[str], trl_version: str) -> None:
        self.original, self.replacement = original, replacement
        self.modules = modules
        self.trl_version = trl_version
        self.heads: list[TrlHead] = []
        self.active = True

    def undo(self) -> None:
        global _SWITCH
        for name in self.modules:
            mod = sys.modules.get(name)
            if mod is not None and mod.__dict__.get("add_fused_lm_head") is self.replacement:
                mod.add_fused_lm_head = self.original
        self.active = False
        if _SWITCH is self:
            _SWITCH = None

    def __enter__(self) -> TrlHeadSwitch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __str__(self) -> str:
        state = "on" if self.active else "off"
        lines = [f"truefuse head for TRL {self.trl_version}: {state}, add_fused_lm_head replaced in {', '.join(self.modules)}"]
        lines += [str(h) for h in self.heads]
        return "\n".join(lines)


_SWITCH: TrlHeadSwitch | None = None


def use_truefuse_head() -> TrlHeadSwitch:
    """Make the TRL trainers built from now on compute ``fused_lm_head=True`` with truefuse's head.

    Replaces ``add_fused_lm_head`` in ``trl.trainer.utils``, the trainer modules
    (:data:`TRAINER_MODULES`, imported here) and any other loaded ``trl`` module that bound it.
    Calling it again while on returns the same switch.

    Returns:
        :class:`TrlHeadSwitch`: ``undo()``, ``modules``, and ``heads`` (a :class:`TrlHead` per
        model patched: which head its calls ran).

    Raises:
        ImportError when TRL is not installed; RuntimeError when the installed TRL has no
        ``trl.trainer.utils.add_fused_lm_head`` (its trainers compute log-probs another way).
    """
    global _SWITCH
    if _SWITCH is not None:
        return _SWITCH
    try:
        import trl
        import trl.trainer.utils as tu
    except ImportError as e:
        raise ImportError("truefuse.integrations.trl needs TRL: pip install 'truefuse[rl]'") from e
    original = getattr(tu, "add_fused_lm_head", None)
    if original is None:
        raise RuntimeError(
            f"TRL {trl.__version__} has no trl.trainer.utils.add_fused_lm_head: its trainers do not compute "
            "log-probs through a fused head that truefuse can replace (TRL 1.16 has it)"
        )
    replacement = _add_fused_lm_head(original)
    for name in TRAINER_MODULES:
        try:
            __import__(name)
        except ImportError:  # a trainer whose optional dependency is missing: nothing to replace there
            continue
    modules = []
    for name, mod in list(sys.modules.items()):
        if (name == "trl" or name.startswith("trl.")) and getattr(mod, "__dict__", {}).get("add_fused_lm_head") is original:
            mod.add_fused_lm_head = replacement
            modules.append(name)
    _SWITCH = TrlHeadSwitch(original, replacement, sorted(modules), trl.__version__)
    return _SWITCH
