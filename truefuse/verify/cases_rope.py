"""Contract cases of the rotary embedding (bitwise: transformers' own expression, ``rope_ref``,
forward and backward, in the same dtype on the same device; docs/huggingface.md)."""

from __future__ import annotations

import torch

from truefuse.autograd.rope import apply_rotary_pos_emb
from truefuse.ops.rope import rope_ref
from truefuse.testing import bitwise_report
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _case(qdt, cdt):
    def case(device):
        g = torch.Generator().manual_seed(0)
        B, H, T, D = 2, 8, 33, 128
        q = (torch.randn(B, T, H, D, generator=g) * 3).to(device, qdt).transpose(1, 2).requires_grad_()
        ang = torch.randn(B, T, D // 2, generator=g) * 8
        cos, sin = (torch.cat([f(ang)] * 2, -1).to(device, cdt) for f in (torch.cos, torch.sin))
        q2 = q.detach().clone().requires_grad_()
        out, _ = apply_rotary_pos_emb(q, q.detach(), cos, sin)
        ref = rope_ref(q2, cos, sin)
        dy = torch.randn(out.shape, generator=g).to(device, out.dtype)
        out.backward(dy), ref.backward(dy)
        return {"out": bitwise_report(out, ref), "dq": bitwise_report(q.grad, q2.grad)}

    return case


for _dn, _dt in _DTYPES.items():
    register("rope", f"fwd_bwd_{_dn}", "bitwise")(_case(_dt, _dt))
register("rope", "fwd_bwd_bf16_fp32_cos", "bitwise")(_case(torch.bfloat16, torch.float32))
