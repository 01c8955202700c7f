"""``truefuse.Linear``: a drop-in ``torch.nn.Linear`` with fp32 main_grad fusion and delayed wgrad."""

from __future__ import annotations

import torch

from truefuse.autograd.linear import linear
from truefuse.nn._base import WgradModule
from truefuse.ops.linear import linear_ref


class Linear(torch.nn.Linear, WgradModule):
    """``y = x @ weightᵀ + bias``, a subclass of ``torch.nn.Linear`` (same parameters, init, repr).

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``.
        fuse_wgrad_accumulation: the weight gradient is accumulated in fp32 into ``weight.main_grad``
            inside the GEMM (beta=1) instead of being returned (docs/design.md §2).
        delay_wgrad_compute: the weight gradient waits for :meth:`backward_dw`.

    Shapes: input (..., in_features) in the parameters' dtype; output (..., out_features).

    Autocast: under ``torch.autocast`` as ``torch.nn.Linear``: input, weight and bias cast to the
    autocast dtype, output in it; gradients in the parameters' dtypes (docs/linear.md, "Autocast").
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_wgrad(fuse_wgrad_accumulation, delay_wgrad_compute)

    def gemm_weights(self):
        return [("weight", self.weight)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features, self.weight)
        return linear(x, self.weight, self.bias, state=self._wgrad)

    def forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        """The unfused composition in plain PyTorch (``ops.linear.linear_ref``) with this module's parameters."""
        return linear_ref(x, self.weight, self.bias)
