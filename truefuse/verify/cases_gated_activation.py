"""Contract cases of the gated activations (bounded, docs/design.md §1): swiglu, geglu,
geglu_tanh and reglu on the (M, 2F) form, forward and input gradient.

The op under test runs on the device; the float64 reference is ``gated_activation_ref`` on float64
CPU copies; the baseline is PyTorch's own same-dtype path (``gated_activation_torch``, e.g.
``F.silu(gate) * up``).
"""

from __future__ import annotations

import torch

from truefuse.autograd.gated_activation import gated_activation
from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS, gated_activation_ref, gated_activation_torch
from truefuse.testing import fwd_bwd_reports
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_M, _F = 77, 300  # odd on purpose: masked tails


def _case(name: str, dtype):
    def case(device):
        g = torch.Generator().manual_seed(4)
        x = (torch.randn(_M, 2 * _F, generator=g) * 2.0).to(device, dtype)
        return fwd_bwd_reports(gated_activation, gated_activation_ref, gated_activation_torch, {"x": x}, name=name)

    return case


for _dn, _dt in _DTYPES.items():
    for _name in GATED_ACTIVATIONS:
        register("gated_activation", f"{_name}_{_dn}", "bounded")(_case(_name, _dt))
