"""``torch.export`` of patched models (issue 31, item 3): a patched Llama called with ``labels`` and a
patched Mixtral export where stock does, and the exported program gives the patched eager model's
bits (the same ops run: the label check becomes a device assert, the experts' host-sizes GEMMs one
opaque op, ``integrations/huggingface/experts_op.py``). CPU, fp32, one layer; the ops on their
PyTorch paths (``torch_paths``): export traces their custom ops' fakes either way."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse  # noqa: E402


class _Call(torch.nn.Module):
    """The model called as a user would, returning tensors only."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels=None):
        out = self.model(ids, labels=labels, use_cache=False, return_logits=True)
        return out.logits if labels is None else (out.loss, out.logits)


def _ids(seed=1):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def test_export_llama_with_labels(torch_paths):
    """Failed before: the labels' range check read them on the host (a data-dependent guard)."""
    model = tiny_model("llama", num_hidden_layers=1).eval()
    apply_truefuse(model)
    ids, labels = _ids(), _ids(2)
    program = torch.export.export(_Call(model), (ids,), {"labels": labels}).module()
    loss, logits = program(ids, labels=labels)
    with torch.no_grad():
        ref_loss, ref_logits = _Call(model)(ids, labels=labels)
    assert torch.equal(loss, ref_loss) and torch.equal(logits, ref_logits)
    labels[1, 3] = VOCAB + 5  # the check is in the program, on the device
    with pytest.raises(RuntimeError, match=r"labels holds a value, outside \[0, vocab_size=128\)"):
        program(ids, labels=labels)


def test_export_mixtral(torch_paths):
    """Failed before: the experts took their per-expert counts to the host as Python ints. The
    experts' parameter gradients through the program are the eager ones too (the op's backward)."""
    model = tiny_model("mixtral", num_hidden_layers=1)
    stock = copy.deepcopy(model)
    apply_truefuse(model)
    ids = _ids()
    program = torch.export.export(_Call(model), (ids,)).module()
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    out = program(ids)
    grads = torch.autograd.grad(out.square().sum(), experts)
    ref = _Call(model)(ids)
    assert torch.equal(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref.square().sum(), experts), strict=True):
        assert torch.equal(g, r)
    with torch.no_grad():  # and the patched model is still the stock one's, up to fp32 rounding
        assert torch.allclose(ref, stock(ids).logits, rtol=1e-4, atol=1e-5)
