"""Fixtures of the Hugging Face integration's tests."""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture
def torch_paths(monkeypatch):
    """Every truefuse op on its PyTorch path on the CPU (the Triton interpreter off): for tests of
    the integration's logic over many steps, where the interpreter (~1 s a kernel call) would take
    minutes; the kernels' own numerics are tested op by op."""
    import truefuse.ops._launch.triton as tr

    real = tr.get_config
    monkeypatch.setattr(tr, "get_config", lambda: dataclasses.replace(real(), triton_interpret=False))
