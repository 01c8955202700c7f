"""``truefuse.LayerNormMLP``: norm, fc1, activation, fc2."""

from __future__ import annotations

import torch

from truefuse.autograd.gated_activation import gated_activation
from truefuse.autograd.linear import linear
from truefuse.nn._base import WgradModule, init_linear_
from truefuse.nn.layernorm_linear import add_norm, apply_norm, reset_norm_
from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS
from truefuse.ops.linear import MLP_ACTIVATIONS, layernorm_mlp_ref


class LayerNormMLP(WgradModule):
    """``fc2(act(fc1(norm(x))))``.

    Args:
        hidden_size, ffn_hidden_size: the model and feed-forward widths.
        bias, device, dtype: as ``torch.nn.Linear`` (bias for both fc1 and fc2).
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``; eps, zero_centered_gamma: the norm's.
        activation: ``gelu``, ``gelu_tanh``, ``relu``, ``silu`` (in fc1's GEMM epilogue where the GEMM
            backend fuses it; the backward takes fc1's bias-gradient after the activation's
            derivative), or gated ``swiglu``, ``geglu``, ``geglu_tanh``, ``reglu``: fc1's output is twice
            ``ffn_hidden_size`` wide, split in halves [gate, up], and ``swiglu = silu(gate) * up``
            (one fused Triton kernel forward and backward).
        fuse_wgrad_accumulation, delay_wgrad_compute: docs/design.md §2 for ``fc1_weight`` and ``fc2_weight``.

    Parameters: ``layer_norm_weight`` / ``layer_norm_bias`` (hidden,), ``fc1_weight``
    (ffn or 2·ffn, hidden), ``fc1_bias``, ``fc2_weight`` (hidden, ffn), ``fc2_bias`` (hidden,).
    Shapes: input and output (..., hidden_size).

    Autocast: the norm runs on the input as given, fc1 and fc2 as ``torch.nn.Linear`` under
    ``torch.autocast`` (the activation in between in the autocast dtype): output in the autocast
    dtype, as the torch.nn composition gives; gradients in the parameters' dtypes.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None:
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; choose one of {MLP_ACTIVATIONS}")
        fk = {"device": device, "dtype": dtype}
        add_norm(self, hidden_size, normalization, eps, zero_centered_gamma, fk)
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        fc1_out = 2 * ffn_hidden_size if activation in GATED_ACTIVATIONS else ffn_hidden_size
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, hidden_size, **fk))
        self.fc1_bias = torch.nn.Parameter(torch.empty(fc1_out, **fk)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **fk))
        self.fc2_bias = torch.nn.Parameter(torch.empty(hidden_size, **fk)) if bias else None
        self._init_wgrad(fuse_wgrad_accumulation, delay_wgrad_compute)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_norm_(self)
        init_linear_(self.fc1_weight, self.fc1_bias)
        init_linear_(self.fc2_weight, self.fc2_bias)

    def gemm_weights(self):
        return [("fc1_weight", self.fc1_weight), ("fc2_weight", self.fc2_weight)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.hidden_size, self.fc1_weight)
        h = apply_norm(self, x)
        if self.activation in GATED_ACTIVATIONS:
            h = linear(h, self.fc1_weight, self.fc1_bias, state=self._wgrad, weight_name="fc1_weight")
            h = gated_activation(h, self.activation)
        else:
            h = linear(h, self.fc1_weight, self.fc1_bias, activation=self.activation, state=self._wgrad, weight_name="fc1_weight")
        return linear(h, self.fc2_weight, self.fc2_bias, state=self._wgrad, weight_name="fc2_weight")

    def forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        """The unfused composition (``ops.linear.layernorm_mlp_ref``) with this module's parameters."""
        return layernorm_mlp_ref(
            x,
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.fc1_weight,
            self.fc1_bias,
            self.fc2_weight,
            self.fc2_bias,
            normalization=self.normalization,
            activation=self.activation,
            eps=self.eps,
            zero_centered_gamma=self.zero_centered_gamma,
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, bias={self.fc1_bias is not None}, "
            f"normalization={self.normalization}, activation={self.activation}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}"
        )
