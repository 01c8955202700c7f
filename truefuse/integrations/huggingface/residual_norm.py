"""``apply_truefuse(model, fuse_residual_norm=True)``: each decoder layer's post-attention residual
add and ``post_attention_layernorm`` as one ``truefuse.add_rms_norm_hf`` (docs/add_norm.md). Opt-in:
the fused kernels' bf16 bits and speed on a GPU are not measured yet.

The layer's forward is the stock forward itself, recompiled from its own source with one change:
the three statements

    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)

become ``hidden_states, residual = <add_rms_norm_hf of residual and hidden_states>``, and the
layer's first two

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)

become ``hidden_states, residual = <add_rms_norm_hf(None, hidden_states)>``: the residual stream
passes through the norm's node, so its gradient is added in the norm's backward kernel rather than
by autograd's add (no forward add there). Everything else (the signature, decorators such as
transformers' keyword renames, the attention call and its arguments) is the stock code as it is, so
no argument handling is copied here. A layer whose forward does not hold the post-attention
statements exactly once (Gemma's, which norms the attention output before its add; a transformers
version that writes the layer otherwise) is left stock, with the reason in the report. The add at
a layer's end stays torch's: it and the next layer's ``input_layernorm`` meet in the model's loop,
which this does not rewrite.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap

import torch
from torch.nn.modules import module as _nn_module

from truefuse.autograd.add_norm import add_rms_norm_hf
from truefuse.integrations.huggingface import modules
from truefuse.integrations.huggingface.batch_invariant import in_mode

KIND = "fused_residual_norm"
_FUSED: dict[type, object] = {}  # stock layer class -> its recompiled forward
#: the fused call in the recompiled source: a method of the truefuse subclass, not a global (the
#: forward runs over a copy of the modeling module's globals, and Dynamo guards a global by reading
#: it from that module again: a name only the copy held failed under torch.compile)
_METHOD = "_truefuse_add_norm"
_KEEP_METHOD = "_truefuse_norm_keep"


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs hooks (its own or global ones) that the fused call would skip."""
    own = module._forward_hooks or module._forward_pre_hooks
    return bool(own or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)


def _add_norm(layer, residual, h):
    """``(normed, summed)`` of the layer's post-attention add and norm (a llama-style RMSNorm); the
    stock statements where the norm module has hooks to run."""
    norm = layer.post_attention_layernorm
    if _hooked(norm):
        summed = residual + h
        return norm(summed), summed
    return add_rms_norm_hf(residual, h, norm.weight, norm.variance_epsilon, style="llama")


def _norm_keep(layer, h):
    """``(normed, h)`` of the layer's first norm, the residual stream passing through its node (its
    gradient added in the norm's backward kernel: ``add_rms_norm_hf(None, ...)``); the stock call
    where the norm module has hooks to run."""
    norm = layer.input_layernorm
    if _hooked(norm):
        return norm(h), h
    return add_rms_norm_hf(None, h, norm.weight, norm.variance_epsilon, style="llama")


def _stmts(*src: str) -> list[str]:
    return [ast.dump(ast.parse(s).body[0]) for s in src]


#: (the stock statements, their replacement, the method it calls); the first must occur once
_PATTERNS = (
    (
        _stmts(
            "hidden_states = residual + hidden_states",
            "residual = hidden_states",
            "hidden_states = self.post_attention_layernorm(hidden_states)",
        ),
        f"hidden_states, residual = self.{_METHOD}(residual, hidden_states)",
    ),
    (
        _stmts("residual = hidden_states", "hidden_states = self.input_layernorm(hidden_states)"),
        f"hidden_states, residual = self.{_KEEP_METHOD}(hidden_states)",
    ),
)


class _Fuse(ast.NodeTransformer):
    """Replaces each run of a pattern's statements (in any statement list) with its fused call."""

    def __init__(self) -> None:
        self.counts = [0] * len(_PATTERNS)

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list) or not stmts or not isinstance(stmts[0], ast.stmt):
                continue
            out, i = [], 0
            while i < len(stmts):
                for k, (want, replacement) in enumerate(_PATTERNS):
                    if [ast.dump(s) for s in stmts[i : i + len(want)]] == want:
                        out.append(ast.copy_location(ast.parse(replacement).body[0], stmts[i]))
                        self.counts[k] += 1
                        i += len(want)
                        break
                else:
                    out.append(stmts[i])
                    i += 1
            setattr(node, field, out)
        return node


def fused_forward(stock: type):
    """The stock decoder layer class's forward with its post-attention add and norm fused, or a
    string saying why it cannot be (cached per class)."""
    if stock in _FUSED:
        return _FUSED[stock]
    try:
        source = textwrap.dedent(inspect.getsource(stock.forward))
    except (OSError, TypeError) as e:
        return f"its forward's source is not readable ({e})"
    tree = ast.parse(source)
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef) or fn.name != "forward":
        return "its forward is not a plain function"
    fuse = _Fuse()
    fuse.visit(fn)
    if fuse.counts[0] != 1:
        return f"its forward holds the post-attention add and norm {fuse.counts[0]} times, not once"
    if fuse.counts[1] > 1:
        return f"its forward holds the input norm {fuse.counts[1]} times, not once"
    module = sys.modules[stock.__module__]
    # the stock module's globals (its decorators, Cache, ...): a copy, so the modeling module
    # itself gains no name (the recompiled ``forward``)
    scope = dict(vars(module))
    code = compile(ast.fix_missing_locations(tree), f"<truefuse: {stock.__qualname__}.forward, add and norm fused>", "exec")
    exec(code, scope)  # noqa: S102 -- the stock source, transformed above
    _FUSED[stock] = scope["forward"]
    return _FUSED[stock]


def _forward(self, *args, **kwargs):
    """The fused forward, in the model's batch-invariant mode where it has one (as
    ``batch_invariant.py::_layer_forward`` enters it: gradient checkpointing recomputes a layer
    outside the model's hooks)."""
    return in_mode(self, _FUSED[self._truefuse_stock], *args, **kwargs)


def unsupported_reason(layer: torch.nn.Module, norm_cls: type, norm_style: str) -> str | None:
    """Why ``layer`` (a decoder layer) cannot take the fusion, or None."""
    if norm_style != "llama":
        return f"norm style {norm_style!r}: the layer norms the attention output before its add"
    post = getattr(layer, "post_attention_layernorm", None)
    if not isinstance(post, norm_cls):
        return "no post_attention_layernorm of the architecture's RMSNorm class"
    if not isinstance(getattr(layer, "input_layernorm", None), norm_cls):
        return "no input_layernorm of the architecture's RMSNorm class"
    stock = getattr(type(layer), "_truefuse_stock", type(layer))
    if modules.is_patched(layer) and type(layer)._truefuse_kind not in (KIND, "batch_invariant_layer"):
        return f"already patched as {type(layer)._truefuse_kind}"
    fused = fused_forward(stock)
    return fused if isinstance(fused, str) else None


def layer_class(stock: type) -> type:
    """The truefuse subclass of a stock decoder layer whose forward fuses the post-attention add and norm."""
    cls = modules.truefuse_subclass(stock, KIND, _forward, "FusedAddNorm")
    setattr(cls, _METHOD, _add_norm)
    setattr(cls, _KEEP_METHOD, _norm_keep)
    return cls
