"""The causal-LM loss of Hugging Face models through ``truefuse.linear_cross_entropy``.

``patch_loss(model_or_class)`` replaces the ``forward`` of a supported ``*ForCausalLM`` (see
``SUPPORTED``) with :func:`causal_lm_forward`, which binds its arguments to the installed
transformers' stock signature (:func:`stock_signature`). With ``labels``, the loss is computed from the last hidden
states and ``lm_head.weight`` in chunks: the (tokens, vocab) logits never exist. Everything else is
the stock forward's: the base model call, ``logits_to_keep``, Gemma's ``final_logit_softcapping``
(the loss's ``softcap``), MoE's router auxiliary loss, the output class and ``return_dict``.

Loss semantics are ``transformers.loss.loss_utils.ForCausalLMLoss``'s: labels shifted left (padded
with ``ignore_index``), or ``shift_labels`` used as given; ``ignore_index`` (default -100);
``num_items_in_batch`` (a tensor or an int) makes it ``sum / num_items_in_batch``, else the mean
over non-ignored tokens (NaN, with zero gradients, when every label is ignored: stock's 0 / 0); the
loss is fp32.

Logits with labels: returned when ``return_logits=True`` (a keyword of the patched forward), not
when ``return_logits=False``; by default (``None``) only when the model is not training
(``model.eval()``: evaluation loops want them), since in training they are what the fusion avoids.
They are then the stock logits (sliced, softcapped), computed by ``lm_head`` beside the fused loss.
Without labels the logits are always computed exactly as stock (generation, evaluation).
Note that ``return_dict=False`` drops ``None`` fields from the tuple, as stock's ``to_tuple``
does: without logits, the tuple's second item is not the logits.

The fused path needs a plain ``nn.Linear`` ``lm_head`` and the stock loss function. Under torch's
data parallelism it stays fused (``head.py``, docs/huggingface.md "Under FSDP2 and DDP"): DDP, the
head inside an FSDP2 unit, and the head as an FSDP2 unit of its own (alone, or grouped with tied
embeddings), whose weight the loss reaches through the head's module call so that FSDP2's own hooks
unshard it and reduce-scatter its gradient. When ``lm_head`` hides its weight (a module class of its
own, e.g. PEFT ``modules_to_save`` or LoRA on the head, quantized layers; hooks that are not FSDP2's,
e.g. offloading; a forward replaced on the instance, as accelerate's hooks do; a tensor-parallel
DTensor weight) or ``model.loss_function`` was replaced, the forward falls back to the stock
computation (logits, then ``model.loss_function``) with a warning naming the reason.

Importable without transformers: it is imported lazily, when a forward runs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
import warnings

import torch
import torch.nn.functional as F

from truefuse.autograd._modes import Modes
from truefuse.integrations.huggingface.batch_invariant import in_mode
from truefuse.ops._launch.capture import host_may_wait

__all__ = [
    "SUPPORTED",
    "causal_lm_forward",
    "patch_loss",
    "stock_signature",
    "supports_loss",
    "unpatch_loss",
]

#: Supported classes (module.qualname of the class whose ``forward`` is the stock one) -> traits.
#: ``softcap``: the config attribute the stock forward applies to its logits (tanh softcapping);
#: ``moe``: the forward adds the router load-balancing loss (``output_router_logits``).
SUPPORTED: dict[str, dict] = {
    "transformers.models.llama.modeling_llama.LlamaForCausalLM": {},
    "transformers.models.mistral.modeling_mistral.MistralForCausalLM": {},
    "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM": {},
    "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM": {},
    "transformers.models.gemma2.modeling_gemma2.Gemma2ForCausalLM": {"softcap": "final_logit_softcapping"},
    "transformers.models.gemma3.modeling_gemma3.Gemma3ForCausalLM": {"softcap": "final_logit_softcapping"},
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeForCausalLM": {"moe": True},
    "transformers.models.mixtral.modeling_mixtral.MixtralForCausalLM": {"moe": True},
}

#: Where patch_loss records what it replaced, in the __dict__ it patched: that dict's own forward,
#: or None when it had none (None, not a sentinel object: the record survives pickling and deepcopy).
_STOCK = "_truefuse_stock_forward"
#: Where ``apply_truefuse(loss_memory="lean")`` keeps the fused loss's ``memory`` on the instance.
_MEMORY = "_truefuse_loss_memory"


# ----------------------------------------------------------------------------------------------
# which class, which traits


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _stock_forward_class(cls: type) -> type | None:
    """The class whose own (unpatched) ``forward`` ``cls`` runs: the first in the MRO defining one,
    looking through a forward that ``patch_loss`` set there without replacing one of that class."""
    for c in cls.__mro__:
        f = c.__dict__.get("forward")
        if f is None:
            continue
        if getattr(f, "_truefuse_loss", False) and _STOCK in c.__dict__ and c.__dict__[_STOCK] is None:
            continue  # patched onto a class that inherited its forward: the stock one is further up
        return c
    return None


def _traits(cls: type) -> dict | None:
    c = _stock_forward_class(cls)
    return None if c is None else SUPPORTED.get(_qualname(c))


def supports_loss(model) -> str | None:
    """None when ``model`` (an instance or a class) runs the stock ``forward`` of a supported
    ``*ForCausalLM`` (``SUPPORTED``; a subclass that does not override ``forward`` counts), else
    a one-line reason."""
    cls = model if isinstance(model, type) else type(model)
    c = _stock_forward_class(cls)
    if c is not None and _qualname(c) in SUPPORTED:
        return None
    names = ", ".join(n.rsplit(".", 1)[1] for n in SUPPORTED)
    if c is not None and any(_qualname(b) in SUPPORTED for b in c.__mro__):
        return f"{cls.__name__}'s forward is overridden by {c.__name__}: truefuse's loss replaces only the stock one of {names}"
    return f"{cls.__name__} is not supported by truefuse's loss (supported: {names})"


# ----------------------------------------------------------------------------------------------
# the forward


def _return_tuple(func):
    """transformers' ``can_return_tuple``, written here so that this module imports without
    transformers: ``return_dict`` (a keyword, else ``config.return_dict``) False gives
    ``output.to_tuple()`` (None fields dropped). ``func`` is told which (``_tuple``)."""

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        return_dict = self.config.return_dict if hasattr(self, "config") else True
        passed = kwargs.pop("return_dict", return_dict)
        if passed is not None:
            return_dict = passed
        out = func(self, *args, _tuple=not return_dict, **kwargs)
        if not return_dict and not isinstance(out, tuple):
            out = out.to_tuple()
        return out

    return wrapper


def _hf(module: str, name: str | None = None):
    """``transformers.<module>`` (or its ``name``), None where this transformers lacks it."""
    import importlib

    try:
        mod = importlib.import_module(f"transformers.{module}")
    except ImportError:
        return None
    return mod if name is None else getattr(mod, name, None)


# transformers' names the patched forward uses, looked up at import: Dynamo (torch 2.11,
# transformers 5.17, fullgraph) cannot trace an import inside the forward ("Bad import result" for
# transformers' lazy modules; a failed ``from ... import`` became an AttributeError ``except
# ImportError`` never saw). tests/hf/test_loss.py::test_the_forward_imports_nothing
#: ``slice_logits_to_keep`` (newer releases: also 2-D index / boolean tensors) or None
_HF_SLICE = _hf("modeling_utils", "slice_logits_to_keep")
_HF_OUTPUTS = _hf("modeling_outputs")
_HF_CAUSAL_LOSS = _hf("loss.loss_utils", "ForCausalLMLoss")


def _slice_to_keep(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The hidden states the stock forward projects: transformers' own slicing where it has one,
    else the older inline slicing."""
    if _HF_SLICE is None:
        idx = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden[:, idx, :]
    return _HF_SLICE(hidden, logits_to_keep)


def _softcap(self, traits: dict) -> float | None:
    name = traits.get("softcap")
    return None if name is None else getattr(self.config, name, None)


def _stock_logits(self, hidden: torch.Tensor, traits: dict, bi: bool) -> torch.Tensor:
    """The logits exactly as the stock forward computes them from the sliced hidden states; in
    batch-invariant mode (``bi``, the mode the model call read) by the chunked head's GEMM
    (``log_probs.bi_logits``, docs/design.md §1)."""
    if bi and _fallback_reason(self) is None:
        from truefuse.integrations.huggingface.log_probs import bi_logits

        logits = bi_logits(self, hidden)
    else:
        logits = self.lm_head(hidden)
    cap = _softcap(self, traits)
    if cap is not None:
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    return logits


def _fallback_reason(self) -> str | None:
    """Why the fused loss cannot stand in for the stock one on this model (None: it can)."""
    from truefuse.integrations.huggingface.head import head_reason

    reason = head_reason(getattr(self, "lm_head", None))
    if reason is not None:
        return reason
    if hasattr(self, "_loss_function"):  # what PreTrainedModel.loss_function's setter sets
        return "model.loss_function was replaced"
    if _HF_CAUSAL_LOSS is None:  # pragma: no cover - transformers 5 has it
        return None
    if getattr(self.loss_function, "__func__", self.loss_function) is not _HF_CAUSAL_LOSS:
        return f"model.loss_function is {getattr(self.loss_function, '__name__', self.loss_function)!r}, not ForCausalLMLoss"
    return None


def _out_of_range(t: torch.Tensor, V: int, ignore_index: int) -> torch.Tensor:
    return (t != ignore_index) & ((t < 0) | (t >= V))


def _first_bad(t: torch.Tensor, V: int, ignore_index: int) -> int | None:
    bad = _out_of_range(t, V, ignore_index)
    return int(t[bad][0]) if bool(bad.any()) else None


def _early_range_check(t: torch.Tensor) -> bool:
    """Check the targets' range here, before the loss runs, where that costs no host sync (off
    CUDA). On CUDA the loss's own check (queued before its first GEMM, waited for after every chunk
    is queued; its kernel reads a bad target as class 0, memory-safe) raises before the loss
    returns, and :func:`_fused_loss` renames its error to the labels."""
    return not t.is_cuda


def _range_message(name: str, V: int, ignore_index: int, value: int | None = None) -> str:
    held = "a value" if value is None else str(value)
    return (
        f"{name} holds {held}, outside [0, vocab_size={V}) and not ignore_index={ignore_index} "
        "(class indices of the next token; -100 marks tokens that do not count)"
    )


def _range_error(name: str, value: int, V: int, ignore_index: int) -> ValueError:
    return ValueError(_range_message(name, V, ignore_index, value))


def _targets(labels, kwargs, tokens_shape, ignore_index: int):
    """The shifted targets, as ForCausalLMLoss builds them, checked against ``tokens_shape`` (the
    leading dims of the projected hidden states): (name, tensor of that shape)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor of class indices, got {type(labels).__name__}")
    shift = kwargs.get("shift_labels")
    name = "labels" if shift is None else "shift_labels"
    src = labels if shift is None else shift
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of class indices, got {type(src).__name__}")
    if src.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold class indices (int64 or int32), got {src.dtype}")
    tokens_shape = tuple(tokens_shape)
    if shift is None:
        if tuple(labels.shape) != tokens_shape:
            raise ValueError(
                f"labels has shape {tuple(labels.shape)} but the model's tokens are {tokens_shape} "
                "(labels are the input ids, shifted inside the model; -100 where a token does not count)"
            )
        t = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        if src.numel() != math.prod(tokens_shape):
            raise ValueError(f"shift_labels has shape {tuple(src.shape)}: one per token expected, tokens are {tokens_shape}")
        t = src.reshape(tokens_shape)
    return name, t


def _tokens_shape(input_ids, inputs_embeds):
    if input_ids is not None:
        return tuple(input_ids.shape)
    if inputs_embeds is not None:
        return tuple(inputs_embeds.shape[:-1])
    return None


def _label_check_ahead(labels: torch.Tensor) -> bool:
    """Start the fused loss's target check before the decoder (CUDA: it is waited for only after
    the loss), rather than in the loss (off CUDA, where :func:`_early_range_check` checks first)."""
    return labels.is_cuda


def _start_label_check(self, labels, kwargs, logits_to_keep):
    """On CUDA, for the fused loss (the caller checked :func:`_fallback_reason`): start the range
    check of the targets (``labels[..., 1:]``, what the shift keeps, or ``shift_labels``) before the
    decoder runs, and return its finish (None where the loss checks them itself). The loss then does
    not wait for a check of its own, queued after the decoder: see
    ``ops/lm_head/linear_cross_entropy.py::targets_checked``."""
    if not isinstance(labels, torch.Tensor) or not host_may_wait(labels) or not _label_check_ahead(labels):
        return None  # traced or captured: the loss checks on the device instead
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return None
    shift = kwargs.get("shift_labels")
    src = labels[..., 1:] if shift is None else shift
    if not isinstance(src, torch.Tensor) or src.device != labels.device or src.dtype not in (torch.int64, torch.int32):
        return None
    from truefuse.ops.lm_head.linear_cross_entropy import check_targets

    return check_targets(src, self.lm_head.weight.shape[0], int(kwargs.get("ignore_index", -100)))


def _fused_loss(self, hidden: torch.Tensor, labels, kwargs, traits: dict, bi: bool, early=None) -> torch.Tensor:
    """ForCausalLMLoss of ``lm_head(hidden)`` (softcapped for Gemma) through the fused op.
    ``bi``: the batch-invariant mode the model call read. ``early``: :func:`_start_label_check`'s
    finish, called after the loss is queued."""
    from truefuse.autograd.linear_cross_entropy import linear_cross_entropy
    from truefuse.integrations.huggingface.head import on_head
    from truefuse.ops.lm_head.linear_cross_entropy import targets_checked

    ignore_index = int(kwargs.get("ignore_index", -100))
    name, t = _targets(labels, kwargs, hidden.shape[:-1], ignore_index)
    t = t.to(device=hidden.device)  # shaped as the tokens: the op flattens both, once
    V = self.lm_head.out_features  # the weight may be an FSDP2 shard until on_head's call
    if not host_may_wait(t):
        # traced (torch.export, torch.compile): reading the labels on the host would be a
        # data-dependent guard (export fails on it, issue 31); captured in a CUDA graph: a host read
        # breaks the capture. The check goes into the program as a device assert instead (a
        # RuntimeError on the CPU, a device-side assert on CUDA)
        torch._assert_async(~_out_of_range(t, V, ignore_index).any(), _range_message(name, V, ignore_index))
    elif _early_range_check(t):
        bad = _first_bad(t, V, ignore_index)
        if bad is not None:
            raise _range_error(name, bad, V, ignore_index)
    num_items = kwargs.get("num_items_in_batch")
    loss_kw = dict(reduction="mean" if num_items is None else "sum", ignore_index=ignore_index, softcap=_softcap(self, traits))
    if not bi:  # lean's slices depend on the token count (apply_truefuse's loss_memory)
        loss_kw["memory"] = self.__dict__.get(_MEMORY, "default")

    def head_loss(x, W, b, t):
        return linear_cross_entropy(x, W, t, linear_bias=b, **loss_kw)

    try:  # under torch.autocast the op casts its operands as F.linear does (autograd/_autocast.py)
        with targets_checked() if early is not None else contextlib.nullcontext():
            loss = on_head(self.lm_head, head_loss, hidden, t)  # an FSDP2 unit's own hooks run around it (head.py)
        if early is not None:
            early()
    except ValueError as e:
        # on CUDA the loss checks the targets without a host sync of its own (memory-safe, raised
        # before it returns): name the labels here
        bad = _first_bad(t, V, ignore_index)
        if bad is None:
            raise
        raise _range_error(name, bad, V, ignore_index) from e
    loss = loss.float()
    if num_items is None:
        # stock's mean over no counted token is 0 / 0 = NaN (its gradients zeros); the op's is 0:
        # give stock's answer, on the device (no host sync)
        loss = torch.where((t != ignore_index).any(), loss, torch.full_like(loss, float("nan")))
    else:
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        loss = loss / num_items
    return loss


def _load_balancing_loss_func(cls: type):
    """The stock module's ``load_balancing_loss_func`` (its implementation differs between releases)."""
    for c in cls.__mro__:
        fn = getattr(sys.modules.get(c.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn
    raise RuntimeError(f"{cls.__name__}: no load_balancing_loss_func in its modeling module")


def _model_arguments(self, args, kwargs):
    """``args`` / ``kwargs`` bound to the stock forward's signature (the installed transformers'
    own: ``cache`` or ``past_key_values``, with or without ``cache_position``):
    ``(given named arguments, **kwargs)``, both dicts, ``self`` left out."""
    sig = stock_signature(type(self))
    try:
        bound = sig.bind(self, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{type(self).__name__}.forward(): {e}") from None
    named = dict(bound.arguments)
    named.pop(next(iter(sig.parameters)))  # self
    extra = {}
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            extra = dict(named.pop(p.name, {}))
    return named, extra


def _output(cls_name: str, cache, **fields):
    """``transformers.modeling_outputs.<cls_name>`` with the cache under the installed version's
    field name (``cache`` from transformers 5.24, ``past_key_values`` before): feature-checked, so
    setting the other name never triggers transformers' deprecation warning."""
    cls = getattr(_HF_OUTPUTS, cls_name)
    fields[_cache_field(cls)] = cache
    return cls(**fields)


def _cache_field(output_cls) -> str:
    return "cache" if "cache" in getattr(output_cls, "__dataclass_fields__", {}) else "past_key_values"


def _training_without_cache(self, model_kwargs: dict, kwargs: dict) -> bool:
    """A training forward (the module in training mode, autograd on) that asked nothing of the cache:
    no ``use_cache`` and no cache given. (The caller keeps the cache for a tuple output: its
    ``to_tuple`` drops a None field, which would move the fields after it.)"""
    if not (self.training and torch.is_grad_enabled()) or model_kwargs.get("use_cache") is not None:
        return False
    return all(model_kwargs.get(k) is None and kwargs.get(k) is None for k in ("past_key_values", "cache"))


def _forward(self, args, kwargs, tuple_out: bool = False):
    traits = _traits(type(self))
    if traits is None:
        raise TypeError(supports_loss(self))
    # once a model call (a batch-invariant model's hooks entered the mode around it): the logits'
    # path and the loss's memory agree
    bi = Modes.now().batch_invariant
    moe = bool(traits.get("moe"))
    return_logits = kwargs.pop("return_logits", None)
    model_kwargs, kwargs = _model_arguments(self, args, kwargs)
    labels = model_kwargs.pop("labels", None)
    logits_to_keep = model_kwargs.pop("logits_to_keep", 0)
    if labels is not None:
        # clear errors on the labels' type and shape before the base model runs
        shape = _tokens_shape(model_kwargs.get("input_ids"), model_kwargs.get("inputs_embeds"))
        if shape is not None and isinstance(logits_to_keep, int) and logits_to_keep == 0:
            _targets(labels, kwargs, shape, int(kwargs.get("ignore_index", -100)))

    output_router_logits = None
    if moe:
        output_router_logits = model_kwargs.get("output_router_logits")
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        model_kwargs["output_router_logits"] = output_router_logits
    reason = None if labels is None else _fallback_reason(self)
    early = None if labels is None or reason is not None else _start_label_check(self, labels, kwargs, logits_to_keep)
    if labels is not None and not tuple_out and _training_without_cache(self, model_kwargs, kwargs):
        # a training step with its loss: the cache stock builds by default (config.use_cache) only
        # copies each layer's keys and values (DynamicCache's first update is a torch.cat) into an
        # object nobody reads; the same keys and values reach attention either way (docs/huggingface.md)
        model_kwargs["use_cache"] = False
    # every other argument goes to the base model as given, as stock passes it (a deprecated
    # name such as ``past_key_values`` on 5.24 included: the base model renames it, with
    # transformers' own warning, as stock's decorator does)
    outputs = self.model(**model_kwargs, **kwargs)

    hidden = _slice_to_keep(outputs.last_hidden_state, logits_to_keep)
    loss = logits = None
    if labels is None:
        logits = _stock_logits(self, hidden, traits, bi)
    else:
        if reason is None:
            loss = _fused_loss(self, hidden, labels, kwargs, traits, bi, early)
            want = return_logits if return_logits is not None else not self.training
            if want:
                logits = _stock_logits(self, hidden, traits, bi)
        else:
            warnings.warn(f"truefuse: {type(self).__name__}: {reason}; computing the stock logits and loss instead", stacklevel=3)
            logits = _stock_logits(self, hidden, traits, bi)
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)

    cache = getattr(outputs, _cache_field(type(outputs)), None)
    common = dict(hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    if not moe:
        return _output("CausalLMOutputWithPast", cache, loss=loss, logits=logits, **common)

    aux_loss = None
    if output_router_logits:
        aux_loss = _load_balancing_loss_func(type(self))(
            outputs.router_logits,
            self.num_experts,
            self.num_experts_per_tok,
            model_kwargs.get("attention_mask"),
        )
        if labels is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return _output(
        "MoeCausalLMOutputWithPast",
        cache,
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        router_logits=outputs.router_logits,
        **common,
    )


@_return_tuple
def causal_lm_forward(self, *args, **kwargs):
    """The stock ``*ForCausalLM.forward`` with the loss through ``truefuse.linear_cross_entropy``.

    Takes the stock forward's own parameters, read from the installed transformers
    (:func:`stock_signature`: ``cache`` on 5.24, ``past_key_values`` and ``cache_position``
    before; MoE classes' ``output_router_logits`` before ``logits_to_keep``), so positional and
    keyword calls bind as they bind to stock. With ``labels`` the (tokens, vocab) logits are not
    materialized; ``logits`` is None unless ``return_logits=True``, or ``return_logits`` is not
    given and the model is not training. Loss keywords as ``ForCausalLMLoss``:
    ``num_items_in_batch``, ``shift_labels``, ``ignore_index``. Everything else (base model
    keywords, ``return_dict``, the router auxiliary loss of MoE models) as stock.

    A batch-invariant model (``apply_truefuse(..., batch_invariant=True)``) enters its mode here
    too, not only in the hooks ``model(...)`` runs: a direct ``model.forward(...)`` ran its final
    norm and head outside it (its decoder layers enter it themselves)."""
    tuple_out = kwargs.pop("_tuple", False)
    return in_mode(self, _forward, args, kwargs, tuple_out)


causal_lm_forward._truefuse_loss = True


def _stock_forward(cls: type):
    """The stock ``forward`` function ``cls`` runs (looking through truefuse's patch)."""
    c = _stock_forward_class(cls)
    if c is None:
        raise TypeError(supports_loss(cls))
    f = c.__dict__["forward"]
    return c.__dict__[_STOCK] if _is_ours(f) else f


@functools.cache
def stock_signature(cls: type) -> inspect.Signature:
    """The signature of the stock forward of ``cls`` (with ``self``), as the installed transformers
    declares it: the patched forward binds its arguments to it and shows it to ``inspect``
    (``Trainer`` keeps the dataset columns it names; ``generate`` checks ``logits_to_keep``)."""
    return inspect.signature(_stock_forward(cls))


class _BoundForward(functools.partial):
    """``causal_lm_forward`` bound to one model: a ``functools.partial`` (it pickles, and
    ``copy.deepcopy`` binds it to the copy; a ``types.MethodType`` would not pickle) whose
    ``inspect.signature`` is the stock forward's without ``self``."""

    _truefuse_loss = True

    @property
    def __signature__(self) -> inspect.Signature:
        params = list(stock_signature(type(self.args[0])).parameters.values())[1:]
        return stock_signature(type(self.args[0])).replace(parameters=params)


def _class_forward(cls: type):
    """``causal_lm_forward`` as ``cls.forward``, showing the stock signature to ``inspect``."""

    def forward(self, *args, **kwargs):
        return causal_lm_forward(self, *args, **kwargs)

    forward.__signature__ = stock_signature(cls)
    forward.__doc__ = causal_lm_forward.__doc__
    forward.__qualname__ = f"{cls.__qualname__}.forward"
    forward._truefuse_loss = True
    return forward


# ----------------------------------------------------------------------------------------------
# patching


def _is_ours(f) -> bool:
    """``f`` is one of this module's forwards: the function, a bound method, or a partial of it."""
    f = getattr(f, "__func__", None) or getattr(f, "func", None) or f
    return getattr(f, "_truefuse_loss", False)


def patch_loss(model_or_class) -> bool:
    """Make ``forward`` compute the loss through ``truefuse.linear_cross_entropy``.

    A class: its ``forward`` is replaced (every instance, existing or new; ``apply_truefuse_to``
    patches only the models built after it instead, :func:`patch_loss_on_init`). An instance: its
    own ``forward`` is set, a ``functools.partial`` of :func:`causal_lm_forward` and the model
    (:class:`_BoundForward`): it pickles (``torch.save`` of the model) and ``copy.deepcopy`` binds
    it to the copy; ``inspect.signature`` gives the stock parameters without ``self``.
    ``nn.DataParallel`` replicas (a shallow copy of ``__dict__``) would call the original's: patch
    the class for that. Idempotent: returns True when it patched, False when already patched. The
    replaced forward is recorded for :func:`unpatch_loss`. Raises ``TypeError`` with
    :func:`supports_loss`'s reason for an unsupported model."""
    reason = supports_loss(model_or_class)
    if reason is not None:
        raise TypeError(reason)
    if isinstance(model_or_class, type):
        cls = model_or_class
        if _is_ours(cls.__dict__.get("forward")):
            return False
        type.__setattr__(cls, _STOCK, cls.__dict__.get("forward"))
        type.__setattr__(cls, "forward", _class_forward(cls))
        return True
    d = model_or_class.__dict__
    if _is_ours(d.get("forward")):
        return False
    d[_STOCK] = d.get("forward")
    d["forward"] = _BoundForward(causal_lm_forward, model_or_class)
    return True


def set_loss_memory(model, memory: str) -> None:
    """The fused loss's ``memory`` for this instance (``"default"`` keeps nothing on it)."""
    if memory == "default":
        model.__dict__.pop(_MEMORY, None)
    else:
        model.__dict__[_MEMORY] = memory


def unpatch_loss(model_or_class) -> bool:
    """Restore what :func:`patch_loss` replaced on this instance or class (the instance's own
    ``forward``, or none so the class's runs again). Returns False when it was not patched there."""
    if isinstance(model_or_class, type):
        cls = model_or_class
        if not _is_ours(cls.__dict__.get("forward")):
            return False
        stock = cls.__dict__.get(_STOCK)
        if stock is None:
            type.__delattr__(cls, "forward")
        else:
            type.__setattr__(cls, "forward", stock)
        if _STOCK in cls.__dict__:
            type.__delattr__(cls, _STOCK)
        return True
    d = model_or_class.__dict__
    if not _is_ours(d.get("forward")):
        return False
    stock = d.pop(_STOCK, None)
    if stock is None:
        del d["forward"]
    else:
        d["forward"] = stock
    d.pop(_MEMORY, None)
    return True
