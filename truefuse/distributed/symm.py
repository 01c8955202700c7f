"""The symmetric-memory path: buffers and signal pads of a Workspace, and the kernel launch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from truefuse.ops.norm import block_and_warps

#: Messages up to this size push rows into the readers' buffers; larger ones are pulled (measured on
#: 2 H200: push 7.7 vs pull 8.2 us at 1 row, pull 41 vs push 49 us at 1024 rows × 4096 bf16).
PUSH_MAX_BYTES = 1 << 20
#: Messages up to this size take the LL kernel (data and flag in each 8-byte word: no barrier).
LL_MAX_BYTES = 512 << 10
MAXP = 128  # most programs per launch; the signal pad holds 2 regions of MAXP × world_size flags


class SymmetricState:
    """One rank's symmetric buffer, the peers' pointers, and the call epoch (device counters: every
    rank runs the same calls, so they agree). The buffer has 2 halves, each of world_size + 1
    regions of ``max_bytes`` and world_size LL slots (kernels/allreduce.py)."""

    def __init__(self, group, max_bytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        # DESIGN §4: never NVLink multicast (it can take shared GPUs out of service)
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.world_size = dist.get_world_size(group)
        max_bytes = -(-max_bytes // 64) * 64
        # LL words carry 4 data bytes in 8: twice the message, plus a word's padding per row
        self.ll_slot_bytes = 2 * min(max_bytes, LL_MAX_BYTES) + (64 << 10)
        self.ll_offset = (self.world_size + 1) * max_bytes  # one input slot per rank + the 2-stage sums
        self.half_bytes = self.ll_offset + self.world_size * self.ll_slot_bytes
        self.buffer = symm_mem.empty(2 * self.half_bytes, dtype=torch.uint8, device=device)
        # LL readers trust a word whose flag matches the call: no stale word may match by chance
        self.buffer.zero_()
        torch.cuda.synchronize(device)  # zeroed before any peer can write (rendezvous waits for every rank)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        need = 2 * MAXP * self.world_size * 4
        if self.handle.signal_pad_size < need:
            raise RuntimeError(f"symmetric memory signal pad holds {self.handle.signal_pad_size} bytes, {need} needed")
        self.buffer_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.signal_ptrs = torch.tensor(self.handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self.rank = self.handle.rank
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)
        self.programs = min(MAXP, torch.cuda.get_device_properties(device).multi_processor_count)


def available(group, device: torch.device) -> bool:
    """Symmetric memory needs CUDA tensors and an NCCL group on one host."""
    if device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return dist.get_backend(group) == "nccl"


def launch(state: SymmetricState, x, residual, weight, eps: float, two_stage: bool):
    """Run the fused kernel on 2-D contiguous ``x`` (M, N); returns ``(normed or None, out)``."""
    from truefuse.kernels.allreduce import _allreduce_add_rmsnorm_kernel

    M, N = x.shape
    out = torch.empty_like(x)
    normed = torch.empty_like(x) if weight is not None else None
    if M == 0:
        return normed, out
    W = state.world_size
    share = -(-M // W)
    rows = share if two_stage else M
    nbytes = x.numel() * x.element_size()
    per_word = 4 // x.element_size()
    ll = not two_stage and nbytes <= LL_MAX_BYTES and M * -(-N // per_word) * 8 <= state.ll_slot_bytes
    block, warps = block_and_warps(N)  # the same as truefuse.rms_norm: the same bits
    _allreduce_add_rmsnorm_kernel[(max(1, min(state.programs, rows)),)](
        x, residual if residual is not None else x, weight if weight is not None else x, out,
        normed if normed is not None else out, state.buffer_ptrs, state.signal_ptrs, state.epoch, state.done,
        state.half_bytes // x.element_size(), state.half_bytes // 8, state.ll_offset // 8, M, N, share, float(eps),
        state.rank, W=W, MAXP=MAXP, HAS_RES=residual is not None, HAS_NORM=weight is not None,
        TWO_STAGE=two_stage, PUSH=nbytes <= PUSH_MAX_BYTES, LL=ll, BLOCK_N=block, num_warps=warps,
    )  # fmt: skip
    return normed, out
