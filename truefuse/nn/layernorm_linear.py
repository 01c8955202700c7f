"""``truefuse.LayerNormLinear``: LayerNorm or RMSNorm followed by a linear layer."""

from __future__ import annotations

import torch

from truefuse.autograd.linear import linear
from truefuse.autograd.norm import layer_norm, rms_norm
from truefuse.nn._base import WgradModule, init_linear_
from truefuse.ops.linear import NORMALIZATIONS, layernorm_linear_ref


def add_norm(module: torch.nn.Module, hidden: int, normalization: str, eps: float, zero_centered_gamma: bool, fk: dict) -> None:
    """Give ``module`` its norm: the options, ``layer_norm_weight`` and (LayerNorm) ``layer_norm_bias``
    of shape (hidden,); shared by LayerNormLinear and LayerNormMLP (with :func:`reset_norm_`,
    :func:`apply_norm`)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} is not supported; choose one of {NORMALIZATIONS}")
    module.normalization, module.eps, module.zero_centered_gamma = normalization, eps, zero_centered_gamma
    module.layer_norm_weight = torch.nn.Parameter(torch.empty(hidden, **fk))
    module.layer_norm_bias = torch.nn.Parameter(torch.empty(hidden, **fk)) if normalization == "LayerNorm" else None


def reset_norm_(module: torch.nn.Module) -> None:
    """Scale 1 (0 with zero_centered_gamma), shift 0."""
    with torch.no_grad():
        module.layer_norm_weight.fill_(0.0 if module.zero_centered_gamma else 1.0)
        if module.layer_norm_bias is not None:
            module.layer_norm_bias.zero_()


def apply_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's norm (``normalization``, ``layer_norm_weight`` / ``_bias``, ``eps``,
    ``zero_centered_gamma``) on ``x``: shared by LayerNormLinear and LayerNormMLP."""
    zc = module.zero_centered_gamma
    if module.normalization == "RMSNorm":
        return rms_norm(x, module.layer_norm_weight, module.eps, zero_centered_gamma=zc)
    return layer_norm(x, module.layer_norm_weight, module.layer_norm_bias, module.eps, zero_centered_gamma=zc)


class LayerNormLinear(WgradModule):
    """``linear(norm(x))``, optionally returning ``norm(x)`` too.

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``.
        normalization: ``"LayerNorm"`` (weight and bias) or ``"RMSNorm"`` (weight only).
        eps: the norm's epsilon.
        zero_centered_gamma: the norm's scale is ``1 + layer_norm_weight`` (initialised to zeros).
        return_layernorm_output: ``forward`` returns ``(out, norm(x))``; gradients flowing into the
            norm output are added to those from the linear layer.
        fuse_wgrad_accumulation, delay_wgrad_compute: docs/design.md §2, for ``weight`` only (the norm's
            parameters and ``bias`` are always returned to autograd normally).

    Parameters: ``layer_norm_weight`` (in,), ``layer_norm_bias`` (in,) for LayerNorm, ``weight``
    (out, in), ``bias`` (out,). Shapes: input (..., in_features), output (..., out_features).

    Autocast: the norm runs on the input as given (fp32 statistics, output in the input's dtype),
    the linear layer as ``torch.nn.Linear`` under ``torch.autocast``: output in the autocast dtype,
    as ``torch.nn.Sequential(LayerNorm, Linear)`` gives; gradients in the parameters' dtypes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        add_norm(self, in_features, normalization, eps, zero_centered_gamma, fk)
        self.in_features, self.out_features = in_features, out_features
        self.return_layernorm_output = return_layernorm_output
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **fk))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **fk)) if bias else None
        self._init_wgrad(fuse_wgrad_accumulation, delay_wgrad_compute)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_norm_(self)
        init_linear_(self.weight, self.bias)

    def gemm_weights(self):
        return [("weight", self.weight)]

    def forward(self, x: torch.Tensor):
        self._check_input(x, self.in_features, self.weight)
        ln_out = apply_norm(self, x)
        out = linear(ln_out, self.weight, self.bias, state=self._wgrad)
        return (out, ln_out) if self.return_layernorm_output else out

    def forward_ref(self, x: torch.Tensor):
        """The unfused composition (``ops.linear.layernorm_linear_ref``) with this module's parameters."""
        out, ln_out = layernorm_linear_ref(
            x,
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.weight,
            self.bias,
            normalization=self.normalization,
            eps=self.eps,
            zero_centered_gamma=self.zero_centered_gamma,
        )
        return (out, ln_out) if self.return_layernorm_output else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"normalization={self.normalization}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"
        )
