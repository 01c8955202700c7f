"""``Workspace``: what a process group's allreduce calls share, created once and reused."""

from __future__ import annotations

import torch
import torch.distributed as dist

#: Message size (bytes) from which the 2-stage kernel is used, by world size: measured on 2 and 4
#: H200 (docs/benchmarks.md); 8 is a guess, not measured. Override per workspace with ``two_stage_bytes``.
TWO_STAGE_BYTES = {2: 1 << 30, 4: 1 << 20, 8: 512 << 10}


class Workspace:
    """Per-process-group state of ``allreduce`` / ``allreduce_add_rmsnorm``, sized by the largest message.

    Args:
        group: the process group (None: the default group).
        max_bytes: the largest ``x`` (in bytes) a call may pass; a larger one is a clear error on
            every rank. On an NCCL group of CUDA devices this allocates 2 × (world_size + 1) ×
            max_bytes of symmetric memory (``torch.distributed._symmetric_memory``) once, for the
            Triton kernels (alternate calls use alternate halves).
        two_stage_bytes: messages of at least this many bytes take the 2-stage kernel (default by
            world size, :data:`TWO_STAGE_BYTES`).
        validate: every call first agrees on the inputs across ranks (one small host all-gather),
            so bad input is a clear error on every rank instead of a hang. Skipped while a CUDA
            graph is being captured (the shapes were checked in the warm-up call); set False to
            drop it from eager calls too once the shapes are known good.

    Create it once per group, pass it to every call, and ``close()`` it (or use ``with``). Every
    rank must create it with the same arguments.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        max_bytes: int = 32 << 20,
        *,
        two_stage_bytes: int | None = None,
        validate: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Workspace needs an initialised process group (torch.distributed.init_process_group)")
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.max_bytes = max_bytes
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.validate = validate
        self.two_stage_bytes = two_stage_bytes if two_stage_bytes is not None else TWO_STAGE_BYTES.get(self.world_size, 512 << 10)
        self.closed = False
        self.symmetric = None
        from truefuse.distributed import symm

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if symm.available(self.group, device):
            self.symmetric = symm.SymmetricState(self.group, max_bytes, device)

    @property
    def path(self) -> str:
        """``"symmetric"`` (Triton kernels) or ``"reference"`` (all-gather + ordered sum)."""
        return "symmetric" if self.symmetric is not None else "reference"

    def close(self) -> None:
        """Release the workspace (its symmetric memory); using it afterwards is an error."""
        self.symmetric = None
        self.closed = True

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Workspace(world_size={self.world_size}, max_bytes={self.max_bytes}, path={self.path}, closed={self.closed})"
