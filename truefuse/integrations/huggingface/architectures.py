"""The architectures ``apply_truefuse`` knows: where each one's modules live and how each is patched.

One row per ``config.model_type``. Every name is a class in the architecture's transformers
modeling module; patching finds modules by these types, so a loaded model cannot keep a stock one
unseen (``PatchReport`` counts them).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One transformers architecture.

    Attributes:
        module: its modeling module (``transformers.models.llama.modeling_llama``).
        causal_lm: the ``*ForCausalLM`` class whose forward the loss patch replaces.
        norm: the RMSNorm class; ``norm_style``: its stock rounding (``ops.norm.HF_NORM_STYLES``).
        mlp: the dense gated MLP class (``gate_proj``/``up_proj``/``down_proj``/``act_fn``), or None.
        experts: the mixture-of-experts experts class (3-D expert weights), or None.
        attention: the attention class, whose forward calls the module's ``apply_rotary_pos_emb``.
    """

    module: str
    causal_lm: str
    norm: str
    norm_style: str
    mlp: str | None
    experts: str | None = None
    attention: str | None = None

    def cls(self, name: str) -> type:
        """The stock class ``name`` (also after ``apply_truefuse_to`` put a subclass in its place)."""
        cls = getattr(importlib.import_module(self.module), name)
        return getattr(cls, "_truefuse_stock", cls)


def _arch(key: str, prefix: str, style: str = "llama", *, mlp: bool = True, experts: bool = False, lm: str | None = None):
    return Architecture(
        module=f"transformers.models.{key}.modeling_{key}",
        causal_lm=lm or f"{prefix}ForCausalLM",
        norm=f"{prefix}RMSNorm",
        norm_style=style,
        mlp=f"{prefix}MLP" if mlp else None,
        experts=f"{prefix}Experts" if experts else None,
        attention=f"{prefix}Attention",
    )


ARCHITECTURES: dict[str, Architecture] = {
    "llama": _arch("llama", "Llama"),
    "mistral": _arch("mistral", "Mistral"),
    "qwen2": _arch("qwen2", "Qwen2"),
    "qwen3": _arch("qwen3", "Qwen3"),
    "gemma2": _arch("gemma2", "Gemma2", "gemma"),
    "gemma3_text": Architecture(
        "transformers.models.gemma3.modeling_gemma3",
        "Gemma3ForCausalLM",
        "Gemma3RMSNorm",
        "gemma",
        "Gemma3MLP",
        attention="Gemma3Attention",
    ),
    "qwen3_moe": _arch("qwen3_moe", "Qwen3Moe", experts=True),
    "mixtral": _arch("mixtral", "Mixtral", mlp=False, experts=True),
}


def architecture_of(model_type: str) -> Architecture:
    """The row of ``model_type``; a ValueError naming the known ones otherwise."""
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"apply_truefuse does not know the architecture {model_type!r}; known: {', '.join(sorted(ARCHITECTURES))}. "
            "Nothing was patched."
        )
    return ARCHITECTURES[model_type]
