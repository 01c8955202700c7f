"""A batch-invariant model's rotary embedding as one opaque op under ``torch.compile``.

Traced into the graph, the embedding's ``cos``/``sin`` are Inductor's to compile, into other
roundings than eager's (1 ulp at some positions on the CPU, torch 2.13), and a batch-invariant
model's compiled logits must be its eager ones (a graphed ``generate`` that still equals the
trainer: tests/hf/test_bi_compile.py). The op runs the module's own stock forward; the module is
found by a key the patch registers (an op takes tensors and scalars, not modules). No graph break,
so ``fullgraph=True`` still compiles. Eager calls skip the op (batch_invariant.py)."""

from __future__ import annotations

import weakref

import torch

_MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()


def register(module: torch.nn.Module) -> int:
    """``module``'s key for :func:`rotary_cos_sin` (kept while the module lives)."""
    key = id(module)
    _MODULES[key] = module
    return key


def _module(key: int) -> torch.nn.Module:
    module = _MODULES.get(key)
    if module is None:
        raise RuntimeError(f"truefuse::hf_rotary_cos_sin: no rotary embedding registered under key {key}")
    return module


@torch.library.custom_op("truefuse::hf_rotary_cos_sin", mutates_args=())
def rotary_cos_sin(key: int, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered module's stock ``forward(x, position_ids)``: (cos, sin), each
    (*position_ids.shape, rotary dim) in x's dtype, contiguous."""
    module = _module(key)
    cos, sin = module._truefuse_stock.forward(module, x, position_ids)
    return cos.contiguous(), sin.contiguous()


@rotary_cos_sin.register_fake
def _(key, x, position_ids):
    # the stock embeddings of the patched architectures: cat(freqs, freqs) over inv_freq's entries
    shape = (*position_ids.shape, 2 * _module(key).inv_freq.numel())
    return x.new_empty(shape), x.new_empty(shape)
