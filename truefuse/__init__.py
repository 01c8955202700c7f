"""truefuse: fused kernels and modules for training and serving LLMs, numerically faithful.

Public API (see README.md and docs/design.md):

* :func:`gemm` / :func:`gemm_ref`, :func:`gemm_plan_for`, :func:`override_capabilities`,
  :class:`Capability`: the one GEMM entry point (docs/design.md §3).
* :func:`rms_norm`, :func:`layer_norm`, :func:`gated_activation` and :class:`RMSNorm`: fused
  norms and gated activations (references in ``truefuse.ops``); :func:`add_rms_norm` (and
  ``RMSNorm(x, residual=)``) a residual add and the norm after it in one kernel.
* :func:`linear_cross_entropy` / :func:`linear_cross_entropy_ref`: the LM head's loss in chunks.
* :func:`linear_log_probs` / :func:`linear_log_probs_ref`: per-token log-probabilities and entropy
  from the LM head (what RL trainers compute), on the same chunked head; :func:`token_log_probs`
  the same from given logits (the sampler's side), :class:`LogProbs` what both return.
* :func:`attention`: ``scaled_dot_product_attention``, batch-invariant (a row's bits alone, in a
  padded batch and in decode are the same), deterministic backward (docs/attention.md).
* :func:`rms_norm_hf`, :func:`apply_rotary_pos_emb`: transformers' RMSNorm and rotary embedding,
  bit for bit, fused (``truefuse.integrations.huggingface`` patches models with them);
  :func:`add_rms_norm_hf` a decoder layer's residual add and the norm after it (docs/add_norm.md).
* :func:`sibling_linears` / :func:`sibling_linears_ref`: projections that read one input (q/k/v,
  gate/up), their input gradient summed inside the GEMMs (docs/sibling_linears.md).
* :class:`Linear`, :class:`LayerNormLinear`, :class:`LayerNormMLP`, :class:`GroupedLinear`,
  :class:`GroupedMLP`: modules with fp32 ``main_grad``
  accumulation and delayed weight gradients under one weight-gradient contract (docs/design.md §2).
"""

from truefuse.autograd.add_norm import add_rms_norm, add_rms_norm_hf
from truefuse.autograd.attention import attention
from truefuse.autograd.gated_activation import gated_activation
from truefuse.autograd.linear_cross_entropy import linear_cross_entropy
from truefuse.autograd.linear_log_probs import linear_log_probs
from truefuse.autograd.norm import layer_norm, rms_norm, rms_norm_hf
from truefuse.autograd.rope import apply_rotary_pos_emb
from truefuse.autograd.sibling_linears import sibling_linears
from truefuse.autograd.token_log_probs import token_log_probs
from truefuse.config import batch_invariant, is_batch_invariant
from truefuse.nn.grouped import GroupedLinear, GroupedMLP
from truefuse.nn.layernorm_linear import LayerNormLinear
from truefuse.nn.layernorm_mlp import LayerNormMLP
from truefuse.nn.linear import Linear
from truefuse.nn.linear_cross_entropy import LinearCrossEntropyLoss
from truefuse.nn.norm import RMSNorm
from truefuse.ops.gated_activation.gated_activation import gated_activation_ref
from truefuse.ops.gemm.gemm import GemmOutput, gemm, gemm_plan_for, gemm_ref
from truefuse.ops.gemm.gemm_plan import Capability, GemmPlan, override_capabilities
from truefuse.ops.gemm.siblings import sibling_linears_ref
from truefuse.ops.linear import layernorm_linear_ref, layernorm_mlp_ref, linear_ref
from truefuse.ops.lm_head.linear_cross_entropy import LinearCrossEntropyOutput, linear_cross_entropy_ref
from truefuse.ops.lm_head.linear_log_probs import LinearLogProbsOutput, linear_log_probs_ref
from truefuse.ops.lm_head.token_log_probs import LogProbs, token_log_probs_ref
from truefuse.ops.norm.add_norm import add_rms_norm_ref
from truefuse.ops.norm.norm import layer_norm_ref, rms_norm_ref

__version__ = "0.2.0"

__all__ = [
    "add_rms_norm",
    "add_rms_norm_ref",
    "add_rms_norm_hf",
    "apply_rotary_pos_emb",
    "attention",
    "batch_invariant",
    "is_batch_invariant",
    "rms_norm_hf",
    "Capability",
    "GemmOutput",
    "GemmPlan",
    "GroupedLinear",
    "GroupedMLP",
    "LayerNormLinear",
    "LinearCrossEntropyLoss",
    "LinearCrossEntropyOutput",
    "LinearLogProbsOutput",
    "LogProbs",
    "LayerNormMLP",
    "Linear",
    "RMSNorm",
    "__version__",
    "gated_activation",
    "gated_activation_ref",
    "gemm",
    "gemm_plan_for",
    "gemm_ref",
    "layer_norm",
    "layer_norm_ref",
    "layernorm_linear_ref",
    "layernorm_mlp_ref",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "linear_log_probs",
    "linear_log_probs_ref",
    "linear_ref",
    "override_capabilities",
    "rms_norm",
    "rms_norm_ref",
    "sibling_linears",
    "sibling_linears_ref",
    "token_log_probs",
    "token_log_probs_ref",
]
