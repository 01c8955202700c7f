"""``ops/_launch/eager_grad.py``: the gradients an opaque PyTorch-path op's backward takes of its
eager expression, inside the op's body."""

from __future__ import annotations

import threading

import torch

from truefuse.ops._launch.eager_grad import eager_grads
from truefuse.ops.norm.norm import rms_norm_hf_pytorch_op, rms_norm_hf_ref


def test_the_gradients_are_autograds_of_the_expression_in_the_calling_thread(monkeypatch):
    """Through the op (its backward op's body, where autograd's keys are excluded), the gradients are
    autograd's of the stock expression, bit for bit, and are taken in the thread that runs the
    backward: on CUDA that is autograd's device thread, which a gradient asked for from any other
    thread would wait on for ever (the GPU suite's opcheck of rms_norm_hf and attention hung so)."""
    import truefuse.ops.norm.norm as norm

    threads = []

    def recording(fn, inputs, grad_out):
        def fn_seen(*a):
            threads.append(threading.current_thread())
            return fn(*a)

        return eager_grads(fn_seen, inputs, grad_out)

    monkeypatch.setattr(norm, "eager_grads", recording)
    torch.manual_seed(0)
    x, w = torch.randn(6, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    dy = torch.randn(6, 32)
    caller = []

    def hook(g):
        caller.append(threading.current_thread())
        return g

    y = rms_norm_hf_pytorch_op(x, w, 1e-6, "llama")
    y.register_hook(hook)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    ex, ew = torch.autograd.grad(rms_norm_hf_ref(x2, w2, 1e-6), (x2, w2), dy)
    assert torch.equal(gx, ex) and torch.equal(gw, ew)
    assert threads and threads == caller, f"gradients taken in {threads}, the backward ran in {caller}"


def test_autocast_stays_off_inside():
    """As in the op's body (and as in a fresh thread): an autocast region around the backward does
    not reach the expression, whose matmul would otherwise run in bf16."""
    torch.manual_seed(0)
    x, w, dy, m = torch.randn(4, 16), torch.randn(16), torch.randn(4, 16), torch.randn(16, 16)

    def expr(a, b):
        return rms_norm_hf_ref(a, b, 1e-6) @ m

    plain = eager_grads(expr, (x, w), dy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = eager_grads(expr, (x, w), dy)
    assert all(torch.equal(a, b) for a, b in zip(plain, under, strict=True))


def test_a_backward_under_inference_mode_still_differentiates():
    """A backward run inside ``torch.inference_mode()`` (the graph recorded outside it): the op's
    gradients are still autograd's of the expression, as without the mode."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    dy = torch.randn(6, 32)
    y = rms_norm_hf_pytorch_op(x, w, 1e-6, "llama")
    want = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    with torch.inference_mode():
        got = torch.autograd.grad(y, (x, w), dy)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
