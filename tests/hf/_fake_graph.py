"""A stand-in for CUDA graphs on the CPU, for ``graph_decode``'s tests (tests/hf/test_graphed_decode.py,
tests/hf/test_trl.py): what the wrapper relies on of a capture, without a GPU."""

from __future__ import annotations

import torch


class _FakeGraph:
    """A stand-in for ``GraphedStep``: eager for ``warmup`` calls; then "captured": the step's
    output tensors are kept and each later call copies its inputs into the captured ones, reruns
    the step on those and writes the results into the kept outputs in place (as a replay would),
    leaving the cache's host ints as they were (a replay runs no Python)."""

    def __init__(self, step, *, warmup, pool=None):
        self.step, self.warmup, self.calls, self.outputs, self.inputs = step, warmup, 0, None, None

    def __call__(self, *inputs):
        self.calls += 1
        if self.calls <= self.warmup:
            return self.step(*inputs)
        if self.outputs is None:
            self.inputs = [t.clone() for t in inputs]
            self.outputs = self.step(*self.inputs)
            return self.outputs
        for old, new in zip(self.inputs, inputs, strict=True):
            old.copy_(new)
        # a replay runs no Python: the cache's host values (a sliding window's count) stay as they were
        kept = _host_values(self.step, self.inputs)
        fresh = self.step(*self.inputs)
        for obj, name, value in kept:
            setattr(obj, name, value)
        for old, new in zip(_tensors(self.outputs), _tensors(fresh), strict=True):
            old.copy_(new)
        return self.outputs


def _host_values(step, inputs) -> list:
    """``(layer, name, value)`` of the ints of the cache the step's call passes (``GraphedDecode._step``
    rebuilds the call's arguments around its tensors)."""
    kwargs = step.__self__._rebuild(inputs)
    caches = [v for v in kwargs.values() if hasattr(v, "layers") and hasattr(v, "is_compileable")]
    return [(layer, n, v) for c in caches for layer in c.layers for n, v in vars(layer).items() if type(v) is int]


def _tensors(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def install(monkeypatch) -> None:
    """``graph_decode`` on the CPU (the ``fake_cuda`` fixture, tests/conftest.py): every tensor counts
    as on CUDA, and graphs are :class:`_FakeGraph`."""
    from truefuse.integrations.huggingface import graphed_decode as gd

    monkeypatch.setattr(gd, "_on_cuda", lambda t: True)
    monkeypatch.setattr(gd.cuda_graph, "graph_step", _FakeGraph)
    monkeypatch.setattr(gd.torch.cuda, "graph_pool_handle", lambda: None)
