"""DTensor inputs (torch tensor parallelism, transformers' ``tp_plan``; docs/design.md §6.9).

No truefuse kernel knows a DTensor's sharding. Before this check a DTensor reaching an op either
failed deep inside (``truefuse.norm_fwd.default does not have a sharding strategy registered``,
``Attempted to access the data pointer on an invalid python storage``, ``mixed torch.Tensor and
DTensor``) or, on the CPU where the reference ran, worked through DTensor's own ops: a different
answer to "what happens" on each device. Now, on every device and before any kernel, the
row-wise ops (the norms, ``rms_norm_hf``, ``gated_activation``) run on each rank's rows where
that is exact (:func:`on_local_rows`), and every other public op and module calls
:func:`refuse_dtensor` first: one ``TypeError`` naming itself and the argument. Under FSDP2 the
ops see plain tensors (its forward unshards the parameters), so neither fires there.
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
        "its kernels run on plain tensors: run it on the local shards (torch.distributed.tensor.experimental.local_map, "
        "or .to_local() where each shard is a whole problem), or use the unfused reference"
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


def on_local_rows(op: str, fn, rows: dict, params: dict, out_width: int | None = None):
    """A row-wise op (each output row from the same row of its inputs and the parameters) on a
    DTensor: ``fn(*local rows, *local params)`` on each rank's rows, wrapped back with the rows'
    placements; None when no argument is a DTensor (the caller runs as usual).

    Exact, not bounded: each rank runs the op on whole rows, and no truefuse launch parameter that
    orders a row's reduction depends on the row count (docs/design.md §6.4), so the output and the
    rows' gradients are the bits of the op on the whole tensor (``rms_norm_hf``'s statistics on
    CUDA outside batch-invariant mode are torch's reduction, as stock's: not checked there). A
    parameter's gradient is each rank's sum over its rows (``Partial``), which DTensor then adds
    across ranks: a different order of the same sum than one rank's. Refused with a ``TypeError``
    naming the argument: rows that differ in placements or mesh, rows that are ``Partial`` (a
    pending sum: the norm of a sum is not the sum of norms) or sharded along the last dimension (a
    row's own), a parameter that is not a DTensor replicated on the rows' mesh (a plain one would
    keep each rank's partial gradient unsummed).

    Args:
        op: the public name. rows: name -> (..., H) tensor, the first one setting placements.
        params: name -> (H,) tensor or None. out_width: the output's last dimension (default H).
    """
    cls = _dtensor_class()
    if cls is None or not any(isinstance(t, cls) for t in (*rows.values(), *params.values())):
        return None
    from torch.distributed.tensor import DTensor, Partial, Replicate

    (first, x), *_ = rows.items()

    def refuse(name: str, why: str):
        raise TypeError(
            f"truefuse.{op} runs on a DTensor only row by row (each rank's rows, exact): {name} {why}; "
            "pass rows sharded on a dimension other than the last (or replicated) and replicated parameters, "
            "or run it on the local shards yourself (torch.distributed.tensor.experimental.local_map)"
        )

    for name, t in rows.items():
        if not isinstance(t, cls):
            refuse(name, "is a plain tensor while another argument is a DTensor")
        if t.device_mesh != x.device_mesh or t.placements != x.placements:
            refuse(name, f"has placements {tuple(t.placements)} on {t.device_mesh}, {first} {tuple(x.placements)}")
    for pl in x.placements:
        if pl.is_partial():
            refuse(first, f"is Partial {tuple(x.placements)} (a pending sum)")
        if pl.is_shard() and pl.dim % x.ndim == x.ndim - 1:
            refuse(first, f"is sharded along its last dimension {tuple(x.placements)} (a row's own)")
    grad = tuple(Partial() if pl.is_shard() else Replicate() for pl in x.placements)
    local = []
    for name, p in params.items():
        if p is None:
            local.append(None)
        elif not isinstance(p, cls) or p.device_mesh != x.device_mesh or not all(pl.is_replicate() for pl in p.placements):
            got = f"placements {tuple(p.placements)}" if isinstance(p, cls) else "a plain tensor"
            refuse(name, f"must be a DTensor replicated on {first}'s mesh, got {got}")
        else:
            local.append(p.to_local(grad_placements=grad))
    y = fn(*(t.to_local() for t in rows.values()), *local)
    shape = tuple(x.shape) if out_width is None else (*x.shape[:-1], out_width)
    # the global shape and stride given: from_local would infer them as if every shard were even
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=torch.Size(shape), stride=stride)
