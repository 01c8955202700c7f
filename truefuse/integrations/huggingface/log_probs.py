"""What a GRPO / PPO trainer asks of a causal LM: each next token's log-probability and the entropy
of the distribution it was drawn from, without the (tokens, vocab) logits (docs/batch_invariance.md).

``model_log_probs(model, input_ids, attention_mask)`` runs the model's body, then
``truefuse.linear_log_probs`` over its last hidden states and ``lm_head``. In batch-invariant mode
(``truefuse.batch_invariant()``) a patched model's logits (eval, ``generate``, ``return_logits=True``)
come from the same head GEMM (:func:`bi_logits`), so for a sequence alone and the same sequence in
any padded batch, ``truefuse.token_log_probs(model(ids).logits[:, :-1], ids[:, 1:])`` and
``model_log_probs`` agree bit for bit (docs/design.md §1). Importable without transformers.
"""

from __future__ import annotations

import torch

from truefuse.autograd._chunked_head import head_logits
from truefuse.autograd.linear_log_probs import linear_log_probs
from truefuse.ops.lm_head.linear_log_probs import LinearLogProbsOutput

__all__ = ["bi_logits", "generate_log_probs", "logits_dtype", "model_log_probs", "positions"]


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, L) counting only attended tokens (0 on the left padding), as ``generate``
    makes them: a left-padded sequence gets the positions it has alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def model_log_probs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, temperature: float = 1.0
) -> LinearLogProbsOutput:
    """Log-probability of each next token and entropy of each prediction of a ``*ForCausalLM``.

    Args:
        model: a transformers causal LM with a plain ``nn.Linear`` ``lm_head`` (patched by
            ``apply_truefuse`` or not; Gemma's final-logit softcap is applied), or a PEFT model
            wrapping one (its adapters run). A model patched with ``batch_invariant=True`` runs in
            batch-invariant mode here as in its forward.
        input_ids: (B, L) int64 token ids. attention_mask: (B, L) 1 for tokens, 0 for padding
            (left or right), or None (all tokens). Positions count attended tokens only.
        temperature: > 0, the sampling temperature.

    Returns:
        :class:`truefuse.LogProbs` ``(log_probs, entropy)``, each (B, L-1) fp32: position i is the
        prediction of token i+1 from tokens ≤ i; 0 where token i+1 is padding. Differentiable in
        the model's parameters (the trainer's backward).

    Raises:
        TypeError / ValueError naming the argument before the model runs.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("input_ids must be a (B, L) int64/int32 tensor of token ids")
    if input_ids.shape[1] < 2:
        raise ValueError(f"input_ids has {input_ids.shape[1]} tokens a row: at least 2 are needed for a next-token log-prob")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; input_ids {tuple(input_ids.shape)}")
    from truefuse.integrations.huggingface.batch_invariant import model_mode, unwrap
    from truefuse.integrations.huggingface.head import is_fsdp_unit

    wrapper, model = model, unwrap(model)
    if is_fsdp_unit(model) or is_fsdp_unit(getattr(model, "lm_head", None)):
        raise TypeError(
            "model_log_probs does not take an FSDP2-sharded model: it calls model.base_model and reads "
            "lm_head.weight directly, outside the root unit's hooks that unshard them; compute "
            "truefuse.linear_log_probs inside the model's forward instead"
        )
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"model.lm_head is {type(head).__name__}, not a torch.nn.Linear")
    kw = {"input_ids": input_ids}
    if attention_mask is not None:
        kw.update(attention_mask=attention_mask, position_ids=positions(attention_mask))
    target = input_ids[:, 1:].to(torch.int64)
    if attention_mask is not None:
        target = torch.where(attention_mask[:, 1:].bool(), target, -100)
    cap = getattr(model.config, "final_logit_softcapping", None)
    # the body and the head in the model's mode (batch-invariant when patched so), as its forward
    # runs them: this calls past the forward's hooks (PEFT's adapters stay in the layers)
    with model_mode(wrapper):
        hidden = model.base_model(**kw, use_cache=False).last_hidden_state
        out = linear_log_probs(hidden[:, :-1], head.weight, target, linear_bias=head.bias, temperature=temperature, softcap=cap)
    return LinearLogProbsOutput(*out)


def logits_dtype(model) -> torch.dtype:
    """The dtype ``model``'s forward gives its logits in here: the autocast dtype under
    ``torch.autocast`` on the head's device (its GEMM is cast as ``F.linear``'s), else the head's."""
    from truefuse.integrations.huggingface.batch_invariant import unwrap

    weight = unwrap(model).lm_head.weight
    if torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return weight.dtype


def generate_log_probs(model, output, prompt_length: int, *, temperature: float = 1.0) -> LinearLogProbsOutput:
    """The sampler's half of docs/batch_invariance.md's recipe: each generated token's log-prob and
    entropy from the logits ``model.generate(..., output_logits=True, return_dict_in_generate=True)``
    sampled it from, (B, new) each.

    ``generate`` hands back its logits upcast to fp32; they are cast back to :func:`logits_dtype`
    (exact: the values are the model's) before ``token_log_probs``, so the per-row kernel reads them
    in the dtype the trainer's head reads its own. On an H100 the same values loaded as fp32 gave
    1 ulp other log-probs in 1 of 96 tokens (the kernel's vector width follows the dtype:
    docs/benchmarks.md, "RL in the client users run"). Call it in the autocast state ``generate``
    ran in. ``prompt_length``: the prompts' padded length (``input_ids.shape[1]``)."""
    from truefuse.autograd.token_log_probs import token_log_probs

    steps = torch.stack(tuple(output.logits), 1).to(logits_dtype(model))
    return token_log_probs(steps, output.sequences[:, prompt_length:], temperature=temperature)


def bi_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """``model.lm_head(hidden)`` by the head's own GEMM (the bits of ``model_log_probs``' chunks in
    batch-invariant mode): what the patched forward returns as logits in that mode. Through
    ``head.on_head``: an FSDP2 unit's hooks unshard the weight as for ``lm_head(hidden)``."""
    from truefuse.integrations.huggingface.head import on_head

    return on_head(model.lm_head, head_logits, hidden)
