"""The forwards that replace stock transformers modules' forwards, in place.

A stock module keeps its identity, parameters and state_dict keys: its class is swapped for a
subclass whose ``forward`` runs truefuse (``isinstance`` against the stock class still holds, and
``unpatch`` swaps it back). Each replacement reproduces the stock module's rounding where truefuse
can (the norms: bit for bit; docs/huggingface.md).
"""

from __future__ import annotations

import sys

import torch

from truefuse.autograd.gated_activation import gated_activation
from truefuse.autograd.norm import rms_norm, rms_norm_hf, stock_cheaper
from truefuse.autograd.rope import apply_rotary_pos_emb

#: ``config.hidden_act`` -> truefuse's gated activation of an MLP ``act(gate) * up``.
GATED_FOR_ACT = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "relu": "reglu"}

_SUBCLASSES: dict[tuple[type, str], type] = {}


def truefuse_subclass(stock: type, kind: str, forward, suffix: str = "") -> type:
    """The truefuse subclass of ``stock`` (one per stock class and kind), registered in this module
    under a stable name so that a patched model still pickles."""
    key = (stock, kind)
    if key not in _SUBCLASSES:
        name = f"Truefuse{stock.__name__}{suffix}"
        sub = type(name, (stock,), {"forward": forward, "_truefuse_stock": stock, "_truefuse_kind": kind})
        sub.__module__ = __name__
        setattr(sys.modules[__name__], name, sub)
        _SUBCLASSES[key] = sub
    return _SUBCLASSES[key]


def is_patched(module: torch.nn.Module) -> bool:
    return hasattr(type(module), "_truefuse_stock")


def unpatch(module: torch.nn.Module) -> None:
    """Give ``module`` its stock class back (no-op on a stock module)."""
    stock = getattr(type(module), "_truefuse_stock", None)
    if stock is not None:
        module.__class__ = stock


def _llama_norm_forward(self, hidden_states):
    if stock_cheaper(hidden_states, self.weight):  # decode, no gradient: the stock forward, its own bits
        return self._truefuse_stock.forward(self, hidden_states)
    return rms_norm_hf(hidden_states, self.weight, self.variance_epsilon, style="llama")


def _gemma_norm_forward(self, x):
    if stock_cheaper(x, self.weight):
        return self._truefuse_stock.forward(self, x)
    return rms_norm_hf(x, self.weight, self.eps, style="gemma")


def _llama_norm_fast_forward(self, hidden_states):
    w = self.weight
    if w.dtype != hidden_states.dtype:  # stock's output dtype is the promotion: keep its path
        return rms_norm_hf(hidden_states, w, self.variance_epsilon, style="llama")
    return rms_norm(hidden_states, w, self.variance_epsilon)


def _gemma_norm_fast_forward(self, x):
    return rms_norm(x, self.weight, self.eps, zero_centered_gamma=True)


_NORM_FORWARDS = {
    ("llama", True): _llama_norm_forward,
    ("gemma", True): _gemma_norm_forward,
    ("llama", False): _llama_norm_fast_forward,
    ("gemma", False): _gemma_norm_fast_forward,
}


def norm_class(stock: type, style: str, stock_bits: bool = True) -> type:
    """The truefuse subclass of a stock RMSNorm class of ``style`` (``llama`` / ``gemma``).

    ``stock_bits``: ``truefuse.rms_norm_hf`` (the stock forward's bits; its statistics are torch's
    own ops). False: ``truefuse.rms_norm``, one kernel with its own reduction order and one rounding
    (more accurate, not stock's bits; measured ~3 ms less per step on the demo's 1.3B model,
    docs/benchmarks.md)."""
    kind = f"rms_norm_{style}" + ("" if stock_bits else "_fast")
    return truefuse_subclass(stock, kind, _NORM_FORWARDS[(style, stock_bits)], "" if stock_bits else "Fast")


def _activations():
    """``transformers.activations``, read from ``sys.modules`` where a model's modeling file has
    imported it: this runs in every gated MLP's forward, and an ``import`` from transformers'
    lazy top-level module there is a graph break under torch.compile (torch 2.11, "Bad import
    result ... _LazyModule"): two a decoder layer on the GPU, each compiled layer three graphs
    (docs/benchmarks.md, FSDP2)."""
    mod = sys.modules.get("transformers.activations")
    if mod is None:
        import transformers.activations as mod
    return mod


def gated_for(act_fn) -> str | None:
    """truefuse's gated activation computing what the stock ``act_fn`` module computes, or None."""
    activations = _activations()

    if isinstance(act_fn, (torch.nn.SiLU, activations.SiLUActivation)):
        return "swiglu"
    if type(act_fn) is activations.GELUActivation and act_fn.act is torch.nn.functional.gelu:
        return "geglu"  # erf GELU
    tanh_gelu = tuple(getattr(activations, n) for n in ("GELUTanh", "PytorchGELUTanh") if hasattr(activations, n))
    if isinstance(act_fn, tanh_gelu):
        return "geglu_tanh"  # Gemma's
    if isinstance(act_fn, torch.nn.ReLU):
        return "reglu"
    return None


def _gated_mlp_forward(self, x):
    gated = gated_for(self.act_fn)
    if gated is None:  # a class-level patch met an activation truefuse does not have
        return self._truefuse_stock.forward(self, x)
    return self.down_proj(gated_activation(self.gate_proj(x), gated, self.up_proj(x)))


def mlp_class(stock: type) -> type:
    """The truefuse subclass of a stock gated MLP (``down(act(gate(x)) * up(x))``): the activation
    and the product are one kernel that saves gate and up only (stock also keeps act(gate)) and
    rounds once (stock: twice)."""
    return truefuse_subclass(stock, "mlp_gated", _gated_mlp_forward)


def _attention_forward(self, *args, **kwargs):
    # The stock forward calls its module's ``apply_rotary_pos_emb`` by name: that name points to
    # truefuse's (the same bits, one kernel each way) while this module's forward runs, so stock
    # models in the same process keep theirs. Not thread-safe across threads running one
    # architecture's attention at once with and without truefuse.
    stock = self._truefuse_stock
    mod = sys.modules[stock.__module__]
    saved = mod.apply_rotary_pos_emb
    mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    try:
        return stock.forward(self, *args, **kwargs)
    finally:
        mod.apply_rotary_pos_emb = saved


def attention_class(stock: type) -> type:
    """The truefuse subclass of a stock attention class: its rotary embedding runs
    ``truefuse.apply_rotary_pos_emb`` (attention itself stays the model's ``attn_implementation``)."""
    return truefuse_subclass(stock, "attention_rope", _attention_forward)
