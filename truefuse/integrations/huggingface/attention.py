"""``attn_implementation="truefuse"``: transformers' attention modules on ``truefuse.attention``.

:func:`register` (run when ``truefuse.integrations.huggingface`` is imported with transformers
installed) adds ``"truefuse"`` to transformers' ``AttentionInterface`` (the function below) and to
its ``AttentionMaskInterface`` (transformers' own ``sdpa_mask``: a bool mask, True = attend, or
None where the model is plainly causal, as SDPA gets it, also while a CUDA graph is captured:
``attention_mask.py``). A model then takes
``from_pretrained(..., attn_implementation="truefuse")``, ``model.set_attn_implementation("truefuse")``
or ``apply_truefuse(model, attention=True)``.

:func:`attention_forward` is transformers' ``sdpa_attention_forward`` on ``truefuse.attention``
(SDPA's signature; docs/attention.md): the same mask, causal flag, scale and GQA, plus Gemma 2's
``softcap`` (which SDPA refuses). Bounded against SDPA, not its bits: the kernel's own reduction
order, batch-invariant. Refused with a clear error: ``output_attentions=True`` (the kernel never
forms the weights; ``eager`` returns them), a ``position_bias``, and dropout (``truefuse.attention``
refuses ``dropout_p > 0``: set ``attention_dropout=0`` or use ``model.eval()``).
"""

from __future__ import annotations

import torch

from truefuse.autograd.attention import attention

#: The ``attn_implementation`` name.
NAME = "truefuse"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One attention call of a transformers attention module.

    Args:
        query: (B, Hq, Lq, D); key, value: (B, Hk, Lk, D), Hq a multiple of Hk (GQA).
        attention_mask: None, or bool (True = attend) / additive float broadcastable to (B, Hq, Lq, Lk).
        dropout: must be 0 (see the module docstring).
        scaling: the softmax scale (default 1/√D).
        is_causal: as SDPA's, used only without a mask and with more than one query.

    Returns:
        ``(output (B, Lq, Hq, D), None)``: no attention weights.
    """
    if kwargs.get("output_attentions"):
        raise ValueError(
            f"attn_implementation={NAME!r} does not return attention weights (output_attentions=True): "
            "the kernel never forms them; use attn_implementation='eager' for them"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"attn_implementation={NAME!r} takes no position_bias; use 'sdpa' or 'eager'")
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and q_len > 1 and attention_mask is None
    if causal and kv_len > q_len:
        # as sdpa_attention_forward: a prefill into an empty static cache, the keys past the queries unused
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        softcap=kwargs.get("softcap"),
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> bool:
    """Register ``"truefuse"`` in transformers' attention and mask interfaces; False (nothing done)
    where transformers is not installed."""
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return False
    from truefuse.integrations.huggingface.attention_mask import causal_skip_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, causal_skip_mask)
    return True
