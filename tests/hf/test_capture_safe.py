"""A patched training step reads nothing on the host while a CUDA graph is captured (issue 47,
docs/cuda_graphs.md): a read of device data during capture breaks it, and a value read once would be
replayed for every step. On the CPU the capture is faked (``ops/_launch/capture.py::capturing`` says yes)
and every host read whose innermost caller outside torch is truefuse's code is recorded. A host-split
experts backend, which cannot be captured, is refused with an error that names it."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers")

import truefuse  # noqa: E402
from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse  # noqa: E402
from truefuse.ops._launch import capture as _capture  # noqa: E402

#: tensor methods and functions that hand device data to the host (a sync on CUDA)
HOST_READS = {
    *("item", "tolist", "__bool__", "__int__", "__float__", "__index__"),
    *("nonzero", "cpu", "numpy", "unique", "masked_select"),
}
PACKAGE = os.path.dirname(truefuse.__file__)
OUTSIDE = (os.path.dirname(torch.__file__), os.sep + "triton" + os.sep)


def _reads_host(func, args) -> bool:
    name = getattr(func, "__name__", "")
    if name in HOST_READS:
        return True
    if name == "__getitem__" and len(args) > 1:  # boolean-mask indexing sizes its result on the host
        idx = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
    if name == "to" and any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu" for a in args[1:]):
        return True
    return False


class HostReads(TorchFunctionMode):
    """Records ``file:line function`` of each host read made directly by truefuse's code."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _reads_host(func, args):
            for frame in reversed(traceback.extract_stack()[:-1]):
                if frame.filename.startswith(OUTSIDE):
                    continue
                if frame.filename.startswith(PACKAGE):
                    self.sites.append(f"{os.path.relpath(frame.filename, PACKAGE)}:{frame.lineno} {frame.name}")
                break
        return func(*args, **(kwargs or {}))


def _step(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return out.loss


@pytest.mark.parametrize("mode", ["fast", "bi", "lean", "fast fused", "bi fused"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_captured_step_reads_nothing_on_the_host(model_type, mode, monkeypatch):
    """Each mode, and with issue 48's opt-in fusions (the sibling groups, fast and batch-invariant,
    and the fused residual norms)."""
    model = tiny_model(model_type, num_hidden_layers=1).train()
    fused = dict(fuse_sibling_grads=True, fuse_residual_norm=True) if mode.endswith("fused") else {}
    apply_truefuse(model, batch_invariant=mode.startswith("bi"), loss_memory="lean" if mode == "lean" else "default", **fused)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    eager = _step(tiny_model(model_type, num_hidden_layers=1).train(), ids)  # stock: a finite loss to compare
    monkeypatch.setattr(_capture, "capturing", lambda t: True)
    with HostReads() as reads:
        loss = _step(model, ids)
    assert reads.sites == [], "host reads in truefuse's code under capture:\n" + "\n".join(reads.sites)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)  # the device-side checks changed no result


def test_captured_step_still_refuses_a_bad_label(monkeypatch):
    """Under capture the label range check stays on the device: a bad label still raises (on the
    CPU ``torch._assert_async`` raises at once; on CUDA it is a device-side assert)."""
    model = tiny_model("llama", num_hidden_layers=1)
    apply_truefuse(model)
    ids = torch.randint(1, VOCAB, (2, 8))
    labels = ids.clone()
    labels[1, 5] = VOCAB + 3
    monkeypatch.setattr(_capture, "capturing", lambda t: True)
    with pytest.raises(RuntimeError, match="outside"):
        model(input_ids=ids, labels=labels)


def test_host_split_experts_refused_under_capture(monkeypatch):
    """A host-split experts backend reads the group sizes on the host: under capture it is refused
    by name, before the read."""
    model = tiny_model("qwen3_moe", num_hidden_layers=1)
    apply_truefuse(model, experts_backend="per_group")
    ids = torch.randint(1, VOCAB, (2, 8))
    monkeypatch.setattr(_capture, "capturing", lambda t: True)
    with pytest.raises(RuntimeError, match=r"experts' group sizes \(experts_backend='per_group'\).*CUDA-graph capture"):
        model(input_ids=ids)


def test_attention_keeps_no_mask_result_across_a_capture(monkeypatch):
    """``truefuse.attention`` keeps a mask's first valid keys on the mask between calls; under
    capture it computes them (a replay runs no Python: a result kept from before the capture would
    be replayed whatever the mask's input later holds)."""
    import truefuse.autograd.attention as A

    calls = []
    real = A.first_valid_key
    monkeypatch.setattr(A, "first_valid_key", lambda *a: calls.append(1) or real(*a))
    mask = torch.ones(2, 1, 4, 6, dtype=torch.bool)
    A._first_valid_key(mask, 2, 6, mask.device)
    A._first_valid_key(mask, 2, 6, mask.device)
    assert len(calls) == 1  # kept: the mask is unwritten
    monkeypatch.setattr(_capture, "capturing", lambda t: True)
    A._first_valid_key(mask, 2, 6, mask.device)
    assert len(calls) == 2
