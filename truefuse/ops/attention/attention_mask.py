"""Which (query, key) pairs attention sees: the rules the reference, the PyTorch path and the
kernels share (docs/attention.md), and each sequence's first valid key derived from a mask."""

from __future__ import annotations

import torch


def score_mask(
    rows: torch.Tensor, cols: torch.Tensor, in_k: torch.Tensor, Lq: int, Lk: int, is_causal: bool, window: int
) -> torch.Tensor:
    """(B, Lq, N) bool: key ``cols[b, n]`` is seen by query ``rows[i]``.

    ``in_k`` (B, N) marks the columns inside [key_start[b], Lk); ``is_causal`` is SDPA's top-left
    diagonal (key ≤ row); ``window`` > 0 keeps row + Lk − Lq − key < window (the query's position
    counted from the end of the keys, as a KV cache places it).
    """
    valid = in_k[:, None, :].expand(-1, rows.numel(), -1)
    if is_causal:
        valid = valid & (cols[:, None, :] <= rows[None, :, None])
    if window:
        valid = valid & ((rows[None, :, None] + (Lk - Lq) - cols[:, None, :]) < window)
    return valid


def masked_out(mask: torch.Tensor) -> torch.Tensor:
    """Where an attention mask removes a key: False in a bool mask; −inf, or the dtype's lowest
    value (what transformers' additive masks hold), in a float one."""
    if mask.dtype == torch.bool:
        return ~mask
    return mask <= torch.finfo(mask.dtype).min


def first_valid_key(attn_mask: torch.Tensor | None, B: int, Lk: int, device: torch.device) -> torch.Tensor:
    """(B,) int32: per sequence, the first key any query of any head attends to by ``attn_mask``
    (broadcastable to (B, H, Lq, Lk)); 0 without a mask or where no key is attended. Computed on
    the device (no host sync)."""
    if attn_mask is None:
        return torch.zeros(B, dtype=torch.int32, device=device)
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    # a bool mask is its own "seen"; argmax gives the first maximum, so 0 where no key is seen.
    # Five small ops where there were eleven: each is host time in a decode step
    # (experiments/host_time.py bi-stubbed)
    seen = (m if m.dtype == torch.bool else ~masked_out(m)).any(dim=(1, 2))  # (B or 1, Lk)
    first = seen.to(torch.int8).argmax(-1).to(torch.int32)
    return first if first.shape[0] == B else first.expand(B).contiguous()
