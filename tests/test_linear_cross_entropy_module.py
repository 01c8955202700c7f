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


def test_main_grad_chunks_stay_within_chunk_bytes(monkeypatch):
    """Into main_grad there is no fp32 accumulator to match: the default chunks stay within the
    chunk_bytes budget, where a returned weight gradient takes chunks up to the accumulator's
    V·H·4 bytes (64 KiB here against a 16 KiB budget). Both give the plain gradient, bounded."""
    import truefuse.ops.lm_head.chunked_head as head_mod
    from truefuse.config import tuning
    from truefuse.ops.lm_head.chunked_head_gemms import vocab_split

    rows = []
    monkeypatch.setattr(head_mod, "vocab_split", lambda xc, v, *bi: rows.append(xc.shape[0]) or vocab_split(xc, v, *bi))
    g = torch.Generator().manual_seed(0)
    x, W = torch.randn(64, 64, generator=g), torch.randn(256, 64, generator=g) * 0.1
    t = torch.randint(0, 256, (64,), generator=g)
    grads = {}
    with tuning(chunk_bytes=16 << 10):
        for fused in (False, True):
            rows.clear()
            Wl = W.clone().requires_grad_()
            if fused:
                Wl.main_grad = torch.zeros(W.shape)
            linear_cross_entropy(x, Wl, t, fuse_wgrad_accumulation=fused).backward()
            grads[fused] = (list(rows), Wl.main_grad if fused else Wl.grad)
    assert grads[False][0] == [64]  # one chunk: the accumulator's budget
    assert grads[True][0] == [16] * 8  # forward, then the backward's recompute: 16 KiB each
    torch.testing.assert_close(grads[True][1], grads[False][1], rtol=1e-5, atol=1e-6)
