"""DTensor inputs (torch tensor parallelism, transformers' ``tp_plan``; docs/design.md §6.9).

No truefuse kernel knows a DTensor's sharding. Before this check a DTensor reaching an op either
failed deep inside (``truefuse.norm_fwd.default does not have a sharding strategy registered``,
``Attempted to access the data pointer on an invalid python storage``, ``mixed torch.Tensor and
DTensor``) or, on the CPU where the reference ran, worked through DTensor's own ops: a different
answer to "what happens" on each device. Every public op now calls :func:`refuse_dtensor` first
and raises one ``TypeError`` naming itself and the argument, on every device, before any kernel.
Under FSDP2 the ops see plain tensors (its forward unshards the parameters), so it passes there.
"""

from __future__ import annotations

import sys

import torch


def _dtensor_class() -> type | None:
    # A DTensor exists only once torch.distributed.tensor is imported: reading sys.modules keeps
    # the check free of that import (about 0.3 s) and of torch builds without torch.distributed.
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def dtensor_message(op: str, name: str, t: torch.Tensor) -> str:
    """The one refusal of every truefuse op (``op``: its public name, ``"rms_norm"``, ``"Linear"``)."""
    return (
        f"truefuse.{op} does not take DTensor inputs ({name} is a DTensor, placements {tuple(t.placements)}); "
        f"its kernels run on plain tensors: run it on the local shards (torch.distributed.tensor.experimental.local_map, "
        f"or .to_local() where each shard is a whole problem, e.g. rows of a row-wise op), or use the unfused reference"
    )


def refuse_dtensor(op: str, **tensors: object) -> None:
    """Raise ``TypeError(dtensor_message(op, name, t))`` for the first DTensor among ``tensors``
    (None and non-tensors are skipped). Costs one ``isinstance`` per argument when DTensor is loaded."""
    cls = _dtensor_class()
    if cls is None:
        return
    for name, t in tensors.items():
        if isinstance(t, cls):
            raise TypeError(dtensor_message(op, name, t))
