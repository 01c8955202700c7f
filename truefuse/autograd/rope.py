"""``truefuse.apply_rotary_pos_emb``: transformers' rotary embedding, bit for bit, in one kernel.

The stock function runs six elementwise ops per tensor (two products, a negation, a concatenation,
a sum), most on the strided (transposed) query and key, forward and backward again; here one kernel
each way, with the same roundings (``kernels/rope.py``).
"""

from __future__ import annotations

import torch

from truefuse.autograd._eager_op import call
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.prepared import ToKeep
from truefuse.ops.rope import rope_fwd_op, rope_ref, use_kernel
from truefuse.ops.rope_kept import keep as keep_rope
from truefuse.ops.rope_kept import kept_rope


def _check(name: str, x, cos) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a (batch, heads, seq, head_dim) tensor, got {got}")
    if x.shape[-1] % 2:
        raise ValueError(f"{name}'s head_dim must be even (rotate_half), got {x.shape[-1]}")
    want = (x.shape[0], x.shape[2], x.shape[3])
    if cos.dim() != 3 or (cos.shape[1], cos.shape[2]) != want[1:] or cos.shape[0] not in (1, want[0]):
        raise ValueError(f"cos and sin must be (batch or 1, seq, head_dim) = {want}, got {tuple(cos.shape)} for {name}")


def _kernel_ready(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return use_kernel(x, cos) and x.stride(-1) == 1


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """transformers' ``apply_rotary_pos_emb``: ``(q * cos + rotate_half(q) * sin, the same for k)``.

    Args:
        q: (B, Hq, T, D), k: (B, Hk, T, D) in any strides with a contiguous last dimension (the
            attention's transposed projections); fp16 / bf16 / fp32.
        cos, sin: (B or 1, T, D), broadcast over the heads (``unsqueeze_dim=1``, the only layout
            taken; another falls back to the stock expression).

    Returns:
        The rotated q and k, bitwise the stock function's in the forward and the backward; dtype
        torch's promotion of q's and cos's (as stock).
    """
    kept = kept_rope(q, k, cos, sin) if unsqueeze_dim == 1 else None  # decode: kept launches (ops/rope_kept.py)
    if kept is not None and type(kept) is not ToKeep:
        return kept
    refuse_dtensor("apply_rotary_pos_emb", q=q, k=k, cos=cos, sin=sin)
    if unsqueeze_dim != 1:
        return rope_ref(q, cos, sin, unsqueeze_dim), rope_ref(k, cos, sin, unsqueeze_dim)
    _check("q", q, cos)
    _check("k", k, cos)
    if sin.shape != cos.shape:
        raise ValueError(f"sin has shape {tuple(sin.shape)}, cos {tuple(cos.shape)}: they must match")
    if not (_kernel_ready(q, cos) and _kernel_ready(k, cos)) or q.shape[0] != k.shape[0]:
        return rope_ref(q, cos, sin), rope_ref(k, cos, sin)
    cos_run, sin_run = cos, sin
    if cos_run.shape[0] != q.shape[0]:
        cos_run, sin_run = cos_run.expand(q.shape[0], -1, -1), sin_run.expand(q.shape[0], -1, -1)
    if cos_run.stride(-1) != 1 or cos_run.stride() != sin_run.stride():
        cos_run, sin_run = cos_run.contiguous(), sin_run.contiguous()
    qo, ko = call(rope_fwd_op, q, k, cos_run, sin_run)
    if kept is not None:
        keep_rope(kept, q, k, cos, sin, cos_run, sin_run, qo, ko)
    return qo, ko
