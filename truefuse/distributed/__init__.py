"""Tensor-parallel collectives: ``allreduce`` and ``allreduce_add_rmsnorm`` (DESIGN §4).

The reference path (all-gather, an fp32 sum in rank order, one rounding, then the residual add and
``truefuse.rms_norm``) runs on any process group (gloo on the CPU, NCCL). The symmetric-memory
Triton kernels of DESIGN §4 are not built yet: every call takes the reference path today.
"""

from truefuse.distributed.allreduce import allreduce, allreduce_add_rmsnorm, allreduce_add_rmsnorm_ref, allreduce_ref
from truefuse.distributed.workspace import Workspace

__all__ = ["Workspace", "allreduce", "allreduce_add_rmsnorm", "allreduce_add_rmsnorm_ref", "allreduce_ref"]
