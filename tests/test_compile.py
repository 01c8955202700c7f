"""docs/design.md §6.7: the Triton-backed ops are torch.library custom ops (opcheck: schema, fake
implementation, autograd registration), and torch.compile(fullgraph=True) traces the public
functions through them. On the CPU the kernels run in fp32 under Triton's interpreter."""

import pytest
import torch

import truefuse
from truefuse.ops.gated_activation import gated_bwd_op, gated_fwd_op, use_kernel
from truefuse.ops.norm import norm_bwd_op, norm_fwd_op


def _dev(device):
    x = torch.randn(2, device=device)
    if not use_kernel(x):
        pytest.skip("the Triton ops run on CUDA, or on the CPU only under TRITON_INTERPRET=1")
    return device


@pytest.mark.parametrize("rms", [True, False])
def test_opcheck_norm(rms, device):
    _dev(device)
    x = torch.randn(9, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    b = None if rms else torch.randn(40, device=device, requires_grad=True)
    torch.library.opcheck(norm_fwd_op, (x, w, b, 1e-5, rms, False))
    y, mean, rstd = norm_fwd_op(x, w, b, 1e-5, rms, False)
    torch.library.opcheck(
        norm_bwd_op, (torch.randn_like(y), x.detach(), w.detach(), None if b is None else b.detach(), mean, rstd, rms, False)
    )


@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_opcheck_gated(name, device):
    _dev(device)
    width = 48 if name == "swiglu" else 24
    x = torch.randn(7, width, device=device, requires_grad=True)
    torch.library.opcheck(gated_fwd_op, (x, name))
    torch.library.opcheck(gated_bwd_op, (torch.randn(7, 24, device=device), x.detach(), name))


def test_compile_fullgraph_matches_eager(device):
    _dev(device)

    def block(x, w, b, wg):
        h = truefuse.layer_norm(truefuse.rms_norm(x, w, 1e-6), w, b)
        return truefuse.gated_activation(torch.cat([h, h * wg], dim=-1), "swiglu")

    x = torch.randn(3, 5, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    b = torch.randn(32, device=device, requires_grad=True)
    wg = torch.randn(32, device=device)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    y_c = compiled(x, w, b, wg)
    y_e = block(x, w, b, wg)
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    g_c = torch.autograd.grad(y_c.square().sum(), (x, w, b))
    g_e = torch.autograd.grad(y_e.square().sum(), (x, w, b))
    for a, e in zip(g_c, g_e, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
