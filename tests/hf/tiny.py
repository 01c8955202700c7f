"""Tiny random models of every architecture ``apply_truefuse`` knows (CPU, a fraction of a second each)."""

from __future__ import annotations

import torch

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_model(model_type: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A ``*ForCausalLM`` of ``model_type`` with random weights (seeded)."""
    import transformers as tf

    kw = dict(_COMMON, **overrides)
    if model_type == "llama":
        cfg, cls = tf.LlamaConfig(**kw), tf.LlamaForCausalLM
    elif model_type == "mistral":
        cfg, cls = tf.MistralConfig(**kw), tf.MistralForCausalLM
    elif model_type == "qwen2":
        cfg, cls = tf.Qwen2Config(**kw), tf.Qwen2ForCausalLM
    elif model_type == "qwen3":
        cfg, cls = tf.Qwen3Config(head_dim=8, **kw), tf.Qwen3ForCausalLM
    elif model_type == "gemma2":
        cfg, cls = tf.Gemma2Config(head_dim=8, final_logit_softcapping=30.0, **kw), tf.Gemma2ForCausalLM
    elif model_type == "gemma3_text":
        cfg, cls = tf.Gemma3TextConfig(head_dim=8, **kw), tf.Gemma3ForCausalLM
    elif model_type == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **kw)
        cls = tf.Qwen3MoeForCausalLM
    elif model_type == "mixtral":
        cfg, cls = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kw), tf.MixtralForCausalLM
    else:
        raise ValueError(model_type)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():  # stock inits norms to 1 (Gemma: 0): random scales exercise the weight's rounding
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.5 + (0.0 if "gemma" in model_type else 1.0))
    return model
