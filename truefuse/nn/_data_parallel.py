"""Which of torch's data-parallel wrappers reduces a module's weight gradients, for the refusal of the
§2 options that put them where that wrapper never looks (docs/design.md §2, docs/linear.md).

FSDP2 (``fully_shard``) reduce-scatters each parameter's ``.grad`` at the end of its unit's backward;
DDP all-reduces ``.grad`` from the parameter's gradient-accumulation hook. ``fuse_wgrad_accumulation``
writes ``main_grad`` instead (never reduced: each rank keeps its own), and ``delay_wgrad_compute``
adds to ``.grad`` in ``backward_dw()``, after the reduction ran (measured on 2 gloo ranks before this
refusal: delayed weight gradients None under FSDP2; under DDP fused ones zero in ``.grad`` with
``main_grad`` unreduced, delayed ones different on each rank; tests/distributed/test_fsdp.py).
"""

from __future__ import annotations

import sys

import torch


def _fsdp2(module: torch.nn.Module) -> bool:
    """``module``'s parameters are managed by FSDP2: it is a unit, or a unit's lazy init registered
    its state-dict hook (``FSDPParamGroup._register_state_dict_hooks``) on it as a parameter owner.
    Only once torch.distributed.fsdp is imported (its import took 5 s on the 2-core dev machine)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return False
    if isinstance(module, fsdp.FSDPModule):
        return True
    return any("FSDPParamGroup" in getattr(h, "__qualname__", "") for h in module._state_dict_pre_hooks.values())


def _ddp(params: list[torch.Tensor]) -> bool:
    """A DDP forward is running (``DistributedDataParallel._get_active_ddp_module``, set around
    the wrapped module's call) and reduces one of ``params``."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return False
    ids = {id(p) for p in params}
    return any(id(q) in ids for q in getattr(ddp, "_module_parameters", ()))


def reducing_wrapper(module: torch.nn.Module, params: list[torch.Tensor]) -> str | None:
    """``"FSDP2 (fully_shard)"`` or ``"DistributedDataParallel"`` when that wrapper reduces
    ``params``' ``.grad`` (the GEMM weights of ``module``), else None."""
    if not torch.distributed.is_available():
        return None
    if _fsdp2(module):
        return "FSDP2 (fully_shard)"
    if _ddp(params):
        return "DistributedDataParallel"
    return None


def refusal(owner: str, wrapper: str, fused: bool) -> str:
    """The error for a §2 option under ``wrapper``, naming the option."""
    short = wrapper.split(" ")[0]
    if fused:
        what = (
            "fuse_wgrad_accumulation=True writes the weight gradients into main_grad, which "
            f"{short} never reduces (it reduces .grad): each rank would keep its own"
        )
        fix = "construct the module with fuse_wgrad_accumulation=False"
        if short == "FSDP2":
            fix += " (FSDP2 reduces in fp32 with MixedPrecisionPolicy(reduce_dtype=torch.float32))"
    else:
        what = (
            "delay_wgrad_compute=True adds the weight gradients to .grad in backward_dw(), after "
            f"{short} has reduced .grad in the backward: they would never be reduced"
        )
        fix = "construct the module with delay_wgrad_compute=False"
    return f"{owner} under {wrapper}: {what}; {fix}"
