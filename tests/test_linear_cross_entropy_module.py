"""``LinearCrossEntropyLoss`` as a module: every option of the function reaches it (``fp32_weight_grad``
did not), and ``register_wgrad_hook`` reports the LM head weight's completed gradient in the plain,
fused (main_grad) and delayed configurations, as the Linear modules do."""

from __future__ import annotations

import pytest
import torch

from truefuse import LinearCrossEntropyLoss, linear_cross_entropy


def _inputs(seed=0, N=24, H=16, V=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, requires_grad=True)
    W = torch.nn.Parameter(torch.randn(V, H, generator=g) * 0.3)
    t = torch.randint(0, V, (N,), generator=g)
    return x, W, t


@pytest.mark.parametrize("fp32_weight_grad", [True, False])
def test_fp32_weight_grad_reaches_the_module(fp32_weight_grad, monkeypatch):
    import truefuse.nn.linear_cross_entropy as mod

    seen = {}
    real = mod.linear_cross_entropy_with

    def spy(opts, *a, **k):
        seen["fp32_weight_grad"] = opts.fp32_weight_grad
        return real(opts, *a, **k)

    monkeypatch.setattr(mod, "linear_cross_entropy_with", spy)
    x, W, t = _inputs()
    loss = LinearCrossEntropyLoss(chunk_size=8, fp32_weight_grad=fp32_weight_grad)(x, W, t)
    assert seen["fp32_weight_grad"] is fp32_weight_grad
    loss.backward()
    x2, W2, t2 = _inputs()
    linear_cross_entropy(x2, W2, t2, chunk_size=8, fp32_weight_grad=fp32_weight_grad).backward()
    assert torch.equal(W.grad, W2.grad)


@pytest.mark.parametrize("config", ["plain", "fused", "delayed"])
def test_register_wgrad_hook_reports_the_weight(config):
    x, W, t = _inputs()
    fused, delayed = config == "fused", config == "delayed"
    if fused:
        W.main_grad = torch.zeros(W.shape)
    loss_fn = LinearCrossEntropyLoss(fuse_wgrad_accumulation=fused, delay_wgrad_compute=delayed)
    calls = []

    def hook(p):  # the gradient must be complete when the hook runs
        calls.append((p, (p.main_grad if fused else p.grad).clone()))

    handle = loss_fn.register_wgrad_hook(hook)
    loss_fn(x, W, t).backward()
    if delayed:
        assert calls == []
        loss_fn.backward_dw()
    assert len(calls) == 1 and calls[0][0] is W
    x2, W2, t2 = _inputs()
    linear_cross_entropy(x2, W2, t2).backward()
    torch.testing.assert_close(calls[0][1], W2.grad.float() if fused else W2.grad)
    handle.remove()
    loss_fn(x, W, t).backward()
    loss_fn.backward_dw()
    assert len(calls) == 1
    with pytest.raises(TypeError, match="callable"):
        loss_fn.register_wgrad_hook(3)
