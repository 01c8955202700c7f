"""``truefuse.apply_rotary_pos_emb``: transformers' rotary embedding, bitwise forward and backward."""

from __future__ import annotations

import pytest
import torch

from truefuse.autograd.rope import apply_rotary_pos_emb
from truefuse.ops.rope import rope_ref

CASES = [  # (q dtype, cos dtype): same dtype, and autocast's bf16 query with fp32 cos/sin
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
]


def _inputs(device, qdt, cdt, B=2, H=4, Hk=2, T=7, D=32, cos_batch=None):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(B, T, H, D, generator=g) * 3).to(device, qdt).transpose(1, 2)  # the attention's layout
    k = (torch.randn(B, T, Hk, D, generator=g) * 3).to(device, qdt).transpose(1, 2)
    cb = cos_batch or B
    ang = torch.randn(cb, T, D // 2, generator=g) * 4
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(device, cdt), torch.cat([ang.sin()] * 2, -1).to(device, cdt)
    return q, k, cos, sin


@pytest.mark.parametrize(("qdt", "cdt"), CASES)
@pytest.mark.parametrize("cos_batch", [None, 1])
def test_bitwise_forward_and_backward(qdt, cdt, cos_batch, device):
    if device.type == "cpu" and qdt != torch.float32:
        pytest.skip("bf16 / fp16 kernels are checked on the GPU (the interpreter truncates bf16)")
    q, k, cos, sin = _inputs(device, qdt, cdt, cos_batch=cos_batch)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, q, k)]
    qo, ko = apply_rotary_pos_emb(leaves[0], leaves[1], cos, sin)
    qr, kr = rope_ref(leaves[2], cos, sin), rope_ref(leaves[3], cos, sin)
    assert qo.dtype == qr.dtype == torch.result_type(q, cos)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    assert qo.stride() == qr.stride()
    g = torch.Generator().manual_seed(1)
    dq, dk = (torch.randn(t.shape, generator=g).to(device, t.dtype) for t in (qo, ko))
    torch.autograd.backward([qo, ko, qr, kr], [dq, dk, dq, dk])
    assert leaves[0].grad.dtype == qdt
    assert torch.equal(leaves[0].grad, leaves[2].grad) and torch.equal(leaves[1].grad, leaves[3].grad)


@pytest.mark.parametrize("used", ["q", "k"])
def test_one_output_used_leaves_the_other_grad_none(used, device):
    """q and k run as one op; an output the loss does not use gives its input no gradient (None, as
    the stock expression), and the used one's gradient is stock's bits."""
    q, k, cos, sin = _inputs(device, torch.float32, torch.float32)
    ours = [t.detach().clone().requires_grad_() for t in (q, k)]
    ref = [t.detach().clone().requires_grad_() for t in (q, k)]
    i = "qk".index(used)
    apply_rotary_pos_emb(*ours, cos, sin)[i].square().sum().backward()
    rope_ref(ref[i], cos, sin).square().sum().backward()
    assert ours[1 - i].grad is None
    assert torch.equal(ours[i].grad, ref[i].grad)


def test_only_q_differentiable(device):
    """k without requires_grad (a frozen or detached key): q's gradient alone, stock's bits."""
    q, k, cos, sin = _inputs(device, torch.float32, torch.float32)
    q1, q2 = (q.detach().clone().requires_grad_() for _ in range(2))
    qo, ko = apply_rotary_pos_emb(q1, k.detach(), cos, sin)
    assert not ko.requires_grad
    qo.sum().backward()
    rope_ref(q2, cos, sin).sum().backward()
    assert torch.equal(q1.grad, q2.grad)


def test_differs_from_a_wrong_rotation(device):
    """The bitwise check above can fail: the opposite rotation differs."""
    q, k, cos, sin = _inputs(device, torch.float32, torch.float32)
    qo, _ = apply_rotary_pos_emb(q, k, cos, sin)
    wrong = rope_ref(q, cos, -sin)
    assert not torch.equal(qo, wrong)


def test_bad_input_names_the_argument():
    q, k, cos, sin = _inputs("cpu", torch.float32, torch.float32)
    with pytest.raises(ValueError, match="q must be a \\(batch, heads, seq, head_dim\\)"):
        apply_rotary_pos_emb(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        apply_rotary_pos_emb(q[..., :31], k[..., :31], cos[..., :31], sin[..., :31])
    with pytest.raises(ValueError, match="cos and sin must be"):
        apply_rotary_pos_emb(q, k, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match="sin has shape"):
        apply_rotary_pos_emb(q, k, cos, sin[:1])
