"""truefuse in Hugging Face transformers (``pip install truefuse[hf]``; docs/huggingface.md).

    from truefuse.integrations.huggingface import apply_truefuse
    model = AutoModelForCausalLM.from_config(config)   # or from_pretrained
    print(apply_truefuse(model))                         # PatchReport: what runs on truefuse

The norms give the stock module's bits; the loss never builds the logits when ``labels`` are given.
"""

from truefuse.integrations.huggingface import attention as _attention
from truefuse.integrations.huggingface.architectures import ARCHITECTURES
from truefuse.integrations.huggingface.class_patch import ClassPatch
from truefuse.integrations.huggingface.compile import compile_layers
from truefuse.integrations.huggingface.graphed_decode import GraphedDecode, graph_decode
from truefuse.integrations.huggingface.log_probs import generate_log_probs, model_log_probs
from truefuse.integrations.huggingface.patch import (
    apply_truefuse,
    apply_truefuse_to,
    apply_truefuse_to_gemma2,
    apply_truefuse_to_gemma3,
    apply_truefuse_to_llama,
    apply_truefuse_to_mistral,
    apply_truefuse_to_mixtral,
    apply_truefuse_to_qwen2,
    apply_truefuse_to_qwen3,
    apply_truefuse_to_qwen3_moe,
    unpatch_truefuse,
)
from truefuse.integrations.huggingface.report import PatchReport

_attention.register()  # attn_implementation="truefuse" (where transformers is installed)

__all__ = [
    "ARCHITECTURES",
    "ClassPatch",
    "GraphedDecode",
    "PatchReport",
    "apply_truefuse",
    "apply_truefuse_to",
    "apply_truefuse_to_gemma2",
    "apply_truefuse_to_gemma3",
    "apply_truefuse_to_llama",
    "apply_truefuse_to_mistral",
    "apply_truefuse_to_mixtral",
    "apply_truefuse_to_qwen2",
    "apply_truefuse_to_qwen3",
    "apply_truefuse_to_qwen3_moe",
    "compile_layers",
    "generate_log_probs",
    "graph_decode",
    "model_log_probs",
    "unpatch_truefuse",
]
