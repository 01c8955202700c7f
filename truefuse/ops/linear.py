"""References of the linear-family modules: the unfused compositions in plain PyTorch.

On float64 copies of a module's parameters they are the float64 reference of the bounded contract;
in the module's own dtype they are the same-dtype baseline (what ``torch.nn.Linear`` +
``F.rms_norm`` + ``F.silu(gate) * up`` compute). Autograd differentiates them for the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS, gated_activation_torch
from truefuse.ops.gemm.activation import ACTIVATIONS, activation_ref
from truefuse.ops.norm.norm import layer_norm_torch, rms_norm_torch

#: Normalizations of LayerNormLinear / LayerNormMLP.
NORMALIZATIONS: tuple[str, ...] = ("LayerNorm", "RMSNorm")
#: Activations of LayerNormMLP: plain ones go into fc1's GEMM epilogue, gated ones double fc1's width.
MLP_ACTIVATIONS: tuple[str, ...] = (*ACTIVATIONS, *GATED_ACTIVATIONS)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None):
    """``activation(F.linear(x, weight, bias))``: x (..., K), weight (N, K), bias (N,) -> (..., N)."""
    y = F.linear(x, weight, bias)
    return y if activation is None else activation_ref(y, activation)


def norm_ref(x, weight, bias, *, normalization: str, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """PyTorch's own LayerNorm / RMSNorm over the last dimension (``bias`` unused for RMSNorm)."""
    if normalization == "RMSNorm":
        return rms_norm_torch(x, weight, eps, zero_centered_gamma=zero_centered_gamma)
    return layer_norm_torch(x, weight, bias, eps, zero_centered_gamma=zero_centered_gamma)


def layernorm_linear_ref(x, ln_weight, ln_bias, weight, bias, *, normalization, eps, zero_centered_gamma):
    """``(F.linear(norm(x), weight, bias), norm(x))``: x (..., H), weight (N, H)."""
    ln_out = norm_ref(x, ln_weight, ln_bias, normalization=normalization, eps=eps, zero_centered_gamma=zero_centered_gamma)
    return F.linear(ln_out, weight, bias), ln_out


def layernorm_mlp_ref(
    x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *, normalization, activation, eps, zero_centered_gamma
):
    """``fc2(act(fc1(norm(x))))``; gated activations split fc1's output in halves [gate, up]."""
    h = norm_ref(x, ln_weight, ln_bias, normalization=normalization, eps=eps, zero_centered_gamma=zero_centered_gamma)
    h = F.linear(h, fc1_weight, fc1_bias)
    h = gated_activation_torch(h, activation) if activation in GATED_ACTIVATIONS else activation_ref(h, activation)
    return F.linear(h, fc2_weight, fc2_bias)
