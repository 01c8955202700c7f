"""Twenty AdamW steps of a patched tiny model follow stock's loss curve (fp32) within 1e-4 relative
(truefuse's PyTorch paths on the CPU: the integration's logic; the kernels are tested op by op)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse  # noqa: E402


def _curve(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids, labels in batches:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe"])
def test_twenty_steps_follow_stock(model_type, torch_paths):
    g = torch.Generator().manual_seed(5)
    # a learnable stream (a repeating pattern with noise) so the loss falls and the curves mean something
    base = torch.arange(16) * 7 % VOCAB
    batches = []
    for _ in range(20):
        ids = (base.repeat(2, 1) + torch.randint(0, 3, (2, 16), generator=g)) % VOCAB
        labels = ids.clone()
        labels[:, :2] = -100
        batches.append((ids, labels))
    stock = tiny_model(model_type)
    patched = copy.deepcopy(stock)
    report = apply_truefuse(patched)
    assert report.loss and sum(report.replaced.values()) > 0
    a, b = _curve(stock, batches), _curve(patched, batches)
    assert a[-1] < 0.9 * a[0]  # it learned
    rel = ((a - b).abs() / a.abs()).max().item()
    assert rel <= 1e-4, (rel, a.tolist(), b.tolist())
