"""``truefuse.RMSNorm``: ``torch.nn.RMSNorm`` on truefuse's kernels."""

from __future__ import annotations

import math

import torch

from truefuse.autograd.add_norm import add_rms_norm
from truefuse.autograd.norm import rms_norm


class RMSNorm(torch.nn.RMSNorm):
    """A subclass of ``torch.nn.RMSNorm`` (same arguments, parameter and repr) whose forward is
    :func:`truefuse.rms_norm`: fp32 statistics and one rounding of the output.

    Args:
        normalized_shape, eps, elementwise_affine, device, dtype: as ``torch.nn.RMSNorm``
            (``eps=None`` means ``torch.finfo(x.dtype).eps``, as torch does).
        zero_centered_gamma: the scale is ``1 + weight``, and ``weight`` starts at zeros.

    Shapes: input (..., *normalized_shape), output the same shape and dtype.

    ``forward(x, residual=None)``: with a ``residual`` (x's shape and dtype), a pre-norm block's
    add and norm in one kernel, :func:`truefuse.add_rms_norm`: returns ``(norm(residual + x),
    residual + x)``, the first bit for bit what ``self(residual + x)`` gives.
    """

    def __init__(
        self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *, zero_centered_gamma=False
    ):
        self.zero_centered_gamma = bool(zero_centered_gamma)
        if self.zero_centered_gamma and not elementwise_affine:
            raise ValueError("zero_centered_gamma=True needs elementwise_affine=True (the scale is 1 + weight)")
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None and getattr(self, "zero_centered_gamma", False):
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        k = len(self.normalized_shape)
        if tuple(x.shape[-k:]) != tuple(self.normalized_shape):
            raise ValueError(f"input has shape {tuple(x.shape)}; its last dimensions must be {tuple(self.normalized_shape)}")
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        flat = x.reshape(*x.shape[:-k], math.prod(self.normalized_shape))
        w = self.weight.reshape(-1) if self.weight is not None else None
        if residual is None:
            return rms_norm(flat, w, eps, zero_centered_gamma=self.zero_centered_gamma).view(x.shape)
        if isinstance(residual, torch.Tensor) and residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}; input has {tuple(x.shape)} (the same shape)")
        res = residual.reshape(flat.shape) if isinstance(residual, torch.Tensor) else residual
        normed, summed = add_rms_norm(res, flat, w, eps, zero_centered_gamma=self.zero_centered_gamma)
        return normed.view(x.shape), summed.view(x.shape)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", zero_centered_gamma=True" if self.zero_centered_gamma else "")
