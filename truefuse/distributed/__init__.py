"""Tensor-parallel collectives: ``allreduce`` and ``allreduce_add_rmsnorm`` (docs/design.md §4).

Two paths with the same bits. The reference (all-gather, an fp32 sum in rank order, one rounding,
then the residual add and ``truefuse.rms_norm``) runs on any process group (gloo on the CPU, NCCL)
and whenever no :class:`Workspace` is passed. With a ``Workspace`` on an NCCL group of CUDA
devices, the symmetric-memory Triton kernel runs (``truefuse/kernels/allreduce.py``, launched by
``truefuse/ops/allreduce.py``; the workspace holds its buffers).
"""

from truefuse.distributed.allreduce import allreduce, allreduce_add_rmsnorm, allreduce_add_rmsnorm_ref, allreduce_ref
from truefuse.distributed.workspace import Workspace

__all__ = ["Workspace", "allreduce", "allreduce_add_rmsnorm", "allreduce_add_rmsnorm_ref", "allreduce_ref"]
