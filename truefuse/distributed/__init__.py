"""Tensor-parallel collectives and layers (docs/design.md §4, docs/tensor_parallel.md).

Collectives: ``allreduce`` and ``allreduce_add_rmsnorm``. Two paths with the same bits. The
reference (all-gather, an fp32 sum in rank order, one rounding, then the residual add and
``truefuse.rms_norm``) runs on any process group (gloo on the CPU, NCCL) and whenever no
:class:`Workspace` is passed. With a ``Workspace`` on an NCCL group of CUDA devices, the
symmetric-memory Triton kernel runs (``truefuse/kernels/allreduce.py``, launched by
``truefuse/ops/allreduce.py``; the workspace holds its buffers).

Layers (``tensor_parallel.py``): ``ColumnParallelLinear``, ``RowParallelLinear`` and
``TensorParallelMLP`` in Megatron's layout, under the weight-gradient contract (docs/design.md §2),
with the sharding helpers (``sharding.py``: ``shard_rows`` / ``shard_columns``), the cross-rank
validation (``_agree.py``) and Megatron's region functions
(``_regions.py``). No sequence parallelism.

Loss: ``linear_cross_entropy`` (``linear_cross_entropy.py``), the vocab-parallel LM head and
cross-entropy: each rank a contiguous vocabulary shard, one all-gather of per-token statistics
merged in rank order (the same bits on every rank), d_input summed with ``allreduce``.
"""

from truefuse.distributed._regions import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region, scatter_to_tp_region
from truefuse.distributed.allreduce import allreduce, allreduce_add_rmsnorm, allreduce_add_rmsnorm_ref, allreduce_ref
from truefuse.distributed.linear_cross_entropy import linear_cross_entropy
from truefuse.distributed.sharding import shard_columns, shard_rows, unshard_columns, unshard_rows
from truefuse.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from truefuse.distributed.workspace import Workspace

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLP",
    "Workspace",
    "allreduce",
    "allreduce_add_rmsnorm",
    "allreduce_add_rmsnorm_ref",
    "allreduce_ref",
    "copy_to_tp_region",
    "gather_from_tp_region",
    "linear_cross_entropy",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "shard_columns",
    "shard_rows",
    "unshard_columns",
    "unshard_rows",
]
