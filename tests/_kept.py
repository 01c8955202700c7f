"""Kept launches on the CPU (``ops/_launch/prepared.py``; tests/test_kept_launches.py,
tests/hf/test_siblings.py): the CPU stands in for CUDA, and each launch an op keeps is a :class:`Go`
that records its calls (no kernel handle exists without CUDA)."""

from __future__ import annotations

import truefuse.ops._launch.prepared as prepared


class Go:
    """A kept launch standing in for ``prepared.prepare``'s: the addresses of the slots it was made
    for, and each call's ``(stream, *addresses)``."""

    def __init__(self, slots):
        self.slots = tuple(t.data_ptr() for t in slots)
        self.calls: list[tuple] = []

    def __call__(self, stream, *addresses):
        self.calls.append((stream, *addresses))


def stand_in(monkeypatch, module, owner, name: str, slots) -> list[Go]:
    """``module``'s kept launches on the CPU: ``prepared.replayable`` takes CPU tensors,
    ``owner.name`` (the op's ``*_prepared``) makes a :class:`Go` of the tensors ``slots(*args)``
    gives, appended to the list returned; every kept launch launchable, on stream 5; ``module``'s
    kept launches forgotten."""
    made: list[Go] = []

    def make(*args):
        made.append(Go(slots(*args)))
        return made[-1]

    module._KEPT.clear()
    monkeypatch.setattr(prepared, "_on_device", lambda x: True)
    monkeypatch.setattr(owner, name, make)
    monkeypatch.setattr(module, "launchable", lambda go: True)
    monkeypatch.setattr(module, "stream", lambda go: 5)
    return made
