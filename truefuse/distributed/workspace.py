"""``Workspace``: what a process group's allreduce calls share, created once and reused."""

from __future__ import annotations

import torch.distributed as dist


class Workspace:
    """Per-process-group state of ``allreduce`` / ``allreduce_add_rmsnorm``, sized by the largest message.

    Args:
        group: the process group (None: the default group).
        max_bytes: the largest ``x`` (in bytes) a call may pass; a larger one is a clear error on
            every rank.

    Create it once per group, pass it to every call, and ``close()`` it (or use ``with``). Today it
    carries the size limit and the group only: the symmetric-memory buffers of DESIGN §4 come with
    the GPU kernels. Every rank must create it with the same ``max_bytes``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, max_bytes: int = 64 << 20) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Workspace needs an initialised process group (torch.distributed.init_process_group)")
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.max_bytes = max_bytes
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.closed = False

    def close(self) -> None:
        """Release the workspace; using it afterwards is an error."""
        self.closed = True

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Workspace(world_size={self.world_size}, max_bytes={self.max_bytes}, closed={self.closed})"
