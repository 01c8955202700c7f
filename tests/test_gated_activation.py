"""gated_activation (swiglu / geglu / geglu_tanh / reglu): the bounded contract of its registered
cases, the two-tensor form and errors. On the CPU the fp32 cases run the Triton kernel under the
interpreter; the others run the reference."""

import pytest
import torch

import truefuse
from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS
from truefuse.verify.registry import all_cases


def test_registered_cases(device):
    cases = all_cases(["gated_activation"], device.type)
    assert len(cases) == 3 * len(GATED_ACTIVATIONS)  # fp16 / bf16 / fp32 per activation
    for case in cases:
        for k, rep in case.fn(device).items():
            assert rep.passed, f"{case.name}/{k}: {rep}"


def test_errors(device):
    with pytest.raises(ValueError, match="last dimension must be even"):
        truefuse.gated_activation(torch.randn(4, 7, device=device), "swiglu")
    with pytest.raises(ValueError, match="gated activation 'swish'"):
        truefuse.gated_activation(torch.randn(4, 8, device=device), "swish")


@pytest.mark.parametrize("name", ["swiglu", "geglu", "geglu_tanh", "reglu"])
def test_two_tensors_same_bits(name, device):
    """``gated_activation(gate, name, up)`` is the kernel of the (M, 2F) form on two tensors: the
    same bits forward and backward, without the concatenation (non-contiguous rows included)."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 2 * 48, generator=g).to(device, dtype)
    gate, up = x[..., :48].clone(), x[..., 48:]  # up: a strided view
    gate.requires_grad_(), up.requires_grad_()
    xx = x.clone().requires_grad_()
    y1, y2 = truefuse.gated_activation(gate, name, up), truefuse.gated_activation(xx, name)
    assert torch.equal(y1, y2)
    dy = torch.randn(y1.shape, generator=g).to(device, dtype)
    y1.backward(dy), y2.backward(dy)
    assert torch.equal(torch.cat([gate.grad, up.grad], -1), xx.grad)
    with pytest.raises(ValueError, match="up must be a tensor of gate's shape"):
        truefuse.gated_activation(gate, name, up[..., :5])


@pytest.mark.parametrize("shape", [(6, 64), (2, 3, 64)])
def test_two_tensor_graph_is_one_node(shape):
    """The two-tensor form records one autograd node whose inputs are gate's and up's own: its
    rows flattened inside the op, not by a reshape and a view around it (two and one more nodes to
    run a backward, host time a Hugging Face MLP pays every layer; docs/benchmarks.md). Gradients
    as the reference's."""
    from truefuse.ops.gated_activation.gated_activation import use_kernel

    g, u = torch.randn(*shape, requires_grad=True), torch.randn(*shape, requires_grad=True)
    if not use_kernel(g):
        pytest.skip("the reference path (no kernel here)")
    y = truefuse.gated_activation(g, "swiglu", u)
    inputs = [type(n).__name__ for n, _ in y.grad_fn.next_functions]
    assert inputs == ["AccumulateGrad", "AccumulateGrad"], f"{type(y.grad_fn).__name__} <- {inputs}"
    dy = torch.randn(shape)
    gr = torch.autograd.grad(y, (g, u), dy)
    g2, u2 = g.detach().requires_grad_(), u.detach().requires_grad_()
    ref = torch.nn.functional.silu(g2.double()) * u2.double()
    want = torch.autograd.grad(ref, (g2, u2), dy.double())
    for a, b in zip(gr, want, strict=True):
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-5)
