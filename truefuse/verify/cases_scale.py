"""Contract cases of ``scale_`` (bitwise, docs/design.md §1): the in-place device-factor scaling the loss
functions' backward uses equals ``scale_ref`` (PyTorch's ``mul_``) bit for bit, for a factor of 1
(the kernel then writes nothing) and another, on an odd size (masked tail)."""

from __future__ import annotations

import torch

from truefuse.ops.scale import scale_, scale_ref
from truefuse.testing import bitwise_report
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _case(dtype, f: float):
    def case(device):
        x = torch.randn(10007, generator=torch.Generator().manual_seed(11)).to(device, dtype)
        factor = torch.tensor(f, dtype=torch.float32, device=device)
        return {"out": bitwise_report(scale_(x.clone(), factor), scale_ref(x, factor))}

    return case


for _dn, _dt in _DTYPES.items():
    for _f, _fn in ((1.0, "one"), (-0.3125, "other")):
        register("scale", f"factor_{_fn}_{_dn}", "bitwise")(_case(_dt, _f))
