"""``Workspace``: what a process group's allreduce calls share, created once and reused, and its
symmetric memory (buffers, signal pads, call epoch) for the kernel path.

The kernel's launcher and the thresholds that pick its variant are ``truefuse/ops/allreduce.py``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from truefuse.config import get_tuning
from truefuse.ops import allreduce as allreduce_ops
from truefuse.ops._launch.triton import sm_count


def layout(world_size: int, max_bytes: int) -> tuple[int, int, int]:
    """``(half_bytes, ll_offset, ll_slot_bytes)`` of a symmetric buffer for messages of up to
    ``max_bytes``: each half holds world_size + 1 regions of ``max_bytes`` (rounded up to 64), then
    world_size LL slots (their words carry 4 data bytes in 8: twice the message, plus a word's
    padding per row), sized for the ``ll_max_bytes`` tuning knob (``truefuse.config.Tuning``) as it
    is when the buffer is made."""
    max_bytes = -(-max_bytes // 64) * 64
    ll_slot_bytes = 2 * min(max_bytes, get_tuning().ll_max_bytes) + (64 << 10)
    ll_offset = (world_size + 1) * max_bytes
    return ll_offset + world_size * ll_slot_bytes, ll_offset, ll_slot_bytes


def available(group, device: torch.device) -> bool:
    """Symmetric memory needs CUDA tensors and an NCCL group on one host."""
    if device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return dist.get_backend(group) == "nccl"


class SymmetricState:
    """One rank's symmetric buffer, the peers' pointers, and the call epoch (device counters: every
    rank runs the same calls, so they agree). The buffer has 2 halves, each of world_size + 1
    regions of ``max_bytes`` and world_size LL slots (kernels/allreduce.py). What the launcher
    (``ops.allreduce.allreduce_add_rmsnorm_fwd``) reads of a workspace."""

    def __init__(self, group, max_bytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        import triton

        # docs/design.md §4: never NVLink multicast (it can take shared GPUs out of service)
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.world_size = dist.get_world_size(group)
        self.half_bytes, self.ll_offset, self.ll_slot_bytes = layout(self.world_size, max_bytes)
        # the kernel's barrier flags: 2 regions of maxp x world_size int32s; a launch may use fewer
        # programs (a smaller knob later), never more (the launcher checks)
        self.maxp = get_tuning().maxp
        need = 2 * self.maxp * self.world_size * 4
        if symm_mem.get_signal_pad_size() < need:
            symm_mem.set_signal_pad_size(need)
        self.buffer = symm_mem.empty(2 * self.half_bytes, dtype=torch.uint8, device=device)
        # LL readers trust a word whose flag matches the call: no stale word may match by chance
        self.buffer.zero_()
        torch.cuda.synchronize(device)  # zeroed before any peer can write (rendezvous waits for every rank)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        if self.handle.signal_pad_size < need:
            raise RuntimeError(f"symmetric memory signal pad holds {self.handle.signal_pad_size} bytes, {need} needed")
        self.buffer_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.signal_ptrs = torch.tensor(self.handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self.rank = self.handle.rank
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)
        self.poll_width = triton.next_power_of_2(self.world_size)  # the kernel's WP: one vector poll of W flags
        self.sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())


class Workspace:
    """Per-process-group state of ``allreduce`` / ``allreduce_add_rmsnorm``, sized by the largest message.

    Args:
        group: the process group (None: the default group).
        max_bytes: the largest ``x`` (in bytes) a call may pass; a larger one is a clear error on
            every rank. On an NCCL group of CUDA devices this allocates 2 × (world_size + 1) ×
            max_bytes of symmetric memory (``torch.distributed._symmetric_memory``) once, for the
            Triton kernels (alternate calls use alternate halves).
        two_stage_bytes: messages of at least this many bytes take the 2-stage kernel (default by
            world size: the ``two_stage_bytes`` tuning knob, ``truefuse.config.Tuning``, when the
            workspace is made).
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
        self.two_stage_bytes = (
            two_stage_bytes if two_stage_bytes is not None else allreduce_ops.default_two_stage_bytes(self.world_size)
        )
        self.closed = False
        self.symmetric = None
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if available(self.group, device):
            self.symmetric = SymmetricState(self.group, max_bytes, device)

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
