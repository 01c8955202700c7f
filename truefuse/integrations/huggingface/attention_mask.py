"""The mask function registered for ``attn_implementation="truefuse"``: transformers' ``sdpa_mask``,
except that a plainly causal call with no padding mask returns None (the kernel's own causal flag)
whatever transformers decides while a CUDA graph is being captured.

transformers decides whether a model's mask can be left to SDPA's ``is_causal`` in
``masking_utils._ignore_causal_mask_sdpa``. Some versions (5.17, the GPU machine's) refuse that skip
whenever a CUDA stream is capturing, even with no padding mask to read, and materialize the full
(B, 1, L, L) causal mask instead; later ones (5.25) skip it. With a mask, attention cannot skip the
blocks above the diagonal: a whole training step captured in one CUDA graph (``graph_step``) ran
batch-invariant attention's kernels 2.6-5.8× longer than eager (H100, the demo's model: 71.6 ms a
step against 20.4; docs/benchmarks.md, "A training step in one CUDA graph"). The bits are the same
either way (the masked blocks add exact zeros; the graphed step matched eager bit for bit).

The same decision is what :func:`eager_mask_decisions` gives transformers' ``"sdpa"`` models (stock
and fast mode) while ``graph_step`` captures a step: the captured step then computes what the eager
step computes.

A training forward also asks whether its ``position_ids`` pack several sequences
(``find_packed_sequence_indices``): eagerly that reads a value on the host and answers "no" for the
model's own positions, but while a stream captures transformers (5.17 and 5.25 alike) cannot read
it and keeps the packed-sequence mask, so the full (B, 1, L, L) mask is built whatever the mask
function. Only the caller knows its positions are never packed: :func:`unpacked_positions`
answers "no" for a capture whose caller said so (``graph_step(..., packed_sequences=False)``) and
:func:`packing_seen` records the eager answers of its warm-up steps, so that a warm-up which did see
packed positions refuses the capture.

The skip needs no data: no padding mask, the model's own causal mask function, no sliding or
chunked window, no static cache's tensor offset, and one query or as many queries as keys (the
cases transformers itself skips outside capture), not while exporting (where transformers refuses
it too: an exported graph would keep the flag for other lengths). Every other call is
``sdpa_mask``'s.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask  # imported by register() only

#: transformers' mask function of a plainly causal model (``create_causal_mask`` passes it as is)
_CAUSAL = causal_mask_function


def causal_skip_mask(*args, **kwargs):
    """transformers' ``sdpa_mask(*args, **kwargs)``, or None for a plainly causal, unpadded call
    (module docstring); the same keywords as ``sdpa_mask`` across transformers versions."""
    if not args and _plain_causal(kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


def _plain_causal(kw: dict) -> bool:
    if kw.get("attention_mask") is not None or not kw.get("allow_is_causal_skip", True):
        return False
    if torch.compiler.is_exporting():  # as transformers: an exported graph would bake the causal flag in
        return False
    if kw.get("mask_function", _CAUSAL) is not _CAUSAL:  # packed sequences, bidirectional parts, windows
        return False
    if any(kw.get(k) is not None for k in ("local_size", "sliding_window", "chunk_size")):
        return False
    q_offset = kw.get("q_offset", 0)
    if isinstance(q_offset, torch.Tensor):  # a static cache: its unfilled slots must stay masked
        return False
    if "q_length" in kw:
        q_len = kw["q_length"]
    elif isinstance(kw.get("cache_position"), torch.Tensor):
        q_len = kw["cache_position"].shape[0]
    else:
        return False
    kv_len = kw.get("kv_length")
    return isinstance(q_len, int) and isinstance(kv_len, int) and (q_len == 1 or q_len == kv_len)


@contextlib.contextmanager
def _packing_check(replace):
    """For the ``with`` block: transformers' packed-sequence check is ``replace(real)``; restored on exit."""
    from transformers import masking_utils

    real = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = replace(real)
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = real


def unpacked_positions():
    """For the ``with`` block: transformers' packed-sequence check answers "no packing" (None), as its
    eager step answers for unpacked positions (module docstring)."""
    return _packing_check(lambda real: lambda position_ids: None)


def packing_seen(record: list):
    """For the ``with`` block: each answer of transformers' packed-sequence check appended to
    ``record`` (True where it found packed positions); the answers themselves unchanged."""

    def recorded(real):
        def check(position_ids):
            out = real(position_ids)
            record.append(out is not None)
            return out

        return check

    return _packing_check(recorded)


@contextlib.contextmanager
def eager_mask_decisions():
    """For the ``with`` block: transformers' ``"sdpa"`` mask decided by :func:`causal_skip_mask`, as
    transformers decides it in eager mode (``integrations/cuda_graph.py`` wraps a capture in it). A
    process-wide registration, restored on exit; nothing done where another mask function than
    transformers' own is registered for ``"sdpa"``."""
    from transformers.masking_utils import AttentionMaskInterface

    mapping = getattr(AttentionMaskInterface, "_global_mapping", None)
    if not isinstance(mapping, dict) or mapping.get("sdpa") is not sdpa_mask:
        yield
        return
    mapping["sdpa"] = causal_skip_mask
    try:
        yield
    finally:
        mapping["sdpa"] = sdpa_mask
