"""The symmetric-memory path: buffers and signal pads of a Workspace, and the kernel launch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from truefuse.ops._triton import sm_count
from truefuse.ops.norm import block_and_warps

#: Messages up to this size push rows into the readers' buffers; larger ones are pulled (measured on
#: 4 H200, 1-stage at 64 rows × 4096 bf16: pull 16.1 us, push 17.5; docs/benchmarks.md).
PUSH_MAX_BYTES = 256 << 10
#: Messages up to this size take the LL kernel (data and flag in each 8-byte word: no barrier; the
#: words double the bytes, so it loses beyond: 4 H200, 16 rows 9.5 us against 11.2, 64 rows 20.3 against 16.1).
LL_MAX_BYTES = 128 << 10
#: Programs per SM (at most; 1 where a program needs 16 warps). Two keep more rows in flight; every
#: program must be resident at once (the barriers wait on peers' programs), so registers are capped
#: at 128 a thread to make two fit (65536 / (128 × 256 threads)).
PROGRAMS_PER_SM = 2
MAXP = 512  # most programs per launch; the signal pad holds 2 regions of MAXP × world_size flags


def layout(world_size: int, max_bytes: int) -> tuple[int, int, int]:
    """``(half_bytes, ll_offset, ll_slot_bytes)`` of a symmetric buffer for messages of up to
    ``max_bytes``: each half holds world_size + 1 regions of ``max_bytes`` (rounded up to 64), then
    world_size LL slots (their words carry 4 data bytes in 8: twice the message, plus a word's
    padding per row)."""
    max_bytes = -(-max_bytes // 64) * 64
    ll_slot_bytes = 2 * min(max_bytes, LL_MAX_BYTES) + (64 << 10)
    ll_offset = (world_size + 1) * max_bytes
    return ll_offset + world_size * ll_slot_bytes, ll_offset, ll_slot_bytes


class SymmetricState:
    """One rank's symmetric buffer, the peers' pointers, and the call epoch (device counters: every
    rank runs the same calls, so they agree). The buffer has 2 halves, each of world_size + 1
    regions of ``max_bytes`` and world_size LL slots (kernels/allreduce.py)."""

    def __init__(self, group, max_bytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        import triton

        # DESIGN §4: never NVLink multicast (it can take shared GPUs out of service)
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.world_size = dist.get_world_size(group)
        self.half_bytes, self.ll_offset, self.ll_slot_bytes = layout(self.world_size, max_bytes)
        need = 2 * MAXP * self.world_size * 4
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
    per_sm = max(1, min(PROGRAMS_PER_SM, 16 // warps))
    programs = max(1, min(MAXP, state.sms * per_sm, rows))
    # registers are capped only when programs must share SMs: uncapped, the LL kernel keeps its rows
    # in registers (capped at 128 it spilled ~500 bytes a thread to local memory)
    cap = 128 if programs > state.sms else None
    _allreduce_add_rmsnorm_kernel[(programs,)](
        x, residual if residual is not None else x, weight if weight is not None else x, out,
        normed if normed is not None else out, state.buffer_ptrs, state.signal_ptrs, state.epoch, state.done,
        state.half_bytes // x.element_size(), state.half_bytes // 8, state.ll_offset // 8, M, N, share, float(eps),
        state.rank, W=W, WP=state.poll_width, MAXP=MAXP, HAS_RES=residual is not None, HAS_NORM=weight is not None,
        TWO_STAGE=two_stage, PUSH=nbytes <= PUSH_MAX_BYTES, LL=ll, BLOCK_N=block, num_warps=warps,
        maxnreg=cap,
    )  # fmt: skip
    return normed, out
