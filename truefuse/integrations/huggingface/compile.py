"""``compile_layers``: each decoder layer of a Hugging Face model ``torch.compile``-d on its own
(TorchTitan's recipe; docs/huggingface.md, "With torch.compile").

On a GPU, Inductor then launches truefuse's norm, rope and gated-activation kernels from its own
code (docs/design.md §6.7), and fuses the stock ops between them; the embedding, the final norm and
the fused loss stay eager. Under FSDP2, compile before ``fully_shard`` (FSDP2's hooks then run
outside the compiled graphs, as Dynamo skips them).
"""

from __future__ import annotations

import torch

#: layers compiled by :func:`compile_layers` in this process (Dynamo's cache holds an entry for each)
_compiled = 0


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ``ModuleList`` of ``model``'s decoder layers: ``model.model.layers`` for a
    ``*ForCausalLM``, ``model.layers`` for a bare decoder. A ``ValueError`` naming the model's class
    where there is none."""
    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return layers
    raise ValueError(
        f"compile_layers: {type(model).__name__} has no decoder layers at .model.layers or .layers "
        "(a transformers *ForCausalLM or its decoder is expected)"
    )


def compile_layers(model: torch.nn.Module, **compile_kwargs) -> int:
    """``layer.compile(**compile_kwargs)`` on each decoder layer of ``model`` (in place), after
    ``apply_truefuse`` and before any ``fully_shard``. Returns the number of layers compiled.

    Each layer compiles on its own (transformers' layers guard on their ``layer_idx``), and the
    entries of every compiled layer share one cache in Dynamo: its ``cache_size_limit`` (and
    ``accumulated_cache_size_limit``) are raised to the number of layers ``compile_layers`` has
    compiled in this process + 8, where they are lower (global settings; never lowered). At
    Dynamo's default of 8, a 16-layer model ran its later layers eager (one H100: stock compiled
    140 ms a step against 120; docs/benchmarks.md).

    Args:
        model: a transformers ``*ForCausalLM`` (or its decoder), patched or not.
        compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ...).
    """
    global _compiled
    layers = decoder_layers(model)
    _compiled += len(layers)
    cfg = torch._dynamo.config
    need = _compiled + 8
    cfg.cache_size_limit = max(cfg.cache_size_limit, need)
    cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4 * need)
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)
