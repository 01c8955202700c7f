"""The host launcher of the symmetric-memory allreduce + residual add + RMSNorm kernel
(``truefuse/kernels/allreduce.py``, docs/design.md §4) and the thresholds that pick its variant.

The kernel norms each row with ``kernels/norm.py::rms_norm_row`` and must give the bits of
``truefuse.rms_norm``: it is launched with the norm launcher's own choice of BLOCK_N and num_warps
(``ops.norm.block_and_warps``, called here, not copied). The symmetric buffers themselves (one
``SymmetricState`` per ``truefuse.distributed.Workspace``) are allocated in ``truefuse/distributed/``.
"""

from __future__ import annotations

import torch

from truefuse.config import get_config
from truefuse.ops.norm import block_and_warps

#: Messages up to this size push rows into the readers' buffers; larger ones are pulled (measured on
#: 4 H200, 1-stage at 64 rows × 4096 bf16: pull 16.1 us, push 17.5; docs/benchmarks.md).
PUSH_MAX_BYTES = 256 << 10
#: Messages up to this size take the LL kernel (data and flag in each 8-byte word: no barrier; the
#: words double the bytes, so it loses beyond: 4 H200, 16 rows 9.5 us against 11.2, 64 rows 20.3 against 16.1).
#: The workspace's LL slots are sized from it (``truefuse.distributed.workspace.layout``).
LL_MAX_BYTES = 128 << 10
#: Programs per SM (at most; 1 where a program needs 16 warps). Two keep more rows in flight; every
#: program must be resident at once (the barriers wait on peers' programs), so registers are capped
#: at 128 a thread to make two fit (65536 / (128 × 256 threads)).
PROGRAMS_PER_SM = 2
MAXP = 512  # most programs per launch; the signal pad holds 2 regions of MAXP × world_size flags
#: Message size (bytes) from which the 2-stage kernel is used, by world size: measured on 2 and 4
#: H200 (docs/benchmarks.md); 8 is a guess, not measured. A workspace may override it (``two_stage_bytes``).
TWO_STAGE_BYTES = {2: 1 << 30, 4: 1 << 20, 8: 512 << 10}
TWO_STAGE_BYTES_OTHER = 512 << 10  # any other world size (a guess, like 8)


def default_two_stage_bytes(world_size: int) -> int:
    """The default 2-stage threshold of a group of ``world_size`` ranks."""
    return TWO_STAGE_BYTES.get(world_size, TWO_STAGE_BYTES_OTHER)


def allreduce_add_rmsnorm_fwd(state, x, residual, weight, eps: float, two_stage_bytes: int, *, want_rstd: bool = False):
    """Run the fused kernel on 2-D contiguous ``x`` (M, N) over a workspace's symmetric buffers.

    Args:
        state: the workspace's ``SymmetricState`` (``truefuse/distributed/workspace.py``): its
            ``buffer_ptrs``, ``signal_ptrs``, ``epoch``, ``done``, ``half_bytes``, ``ll_offset``,
            ``ll_slot_bytes``, ``rank``, ``world_size``, ``poll_width`` and ``sms``.
        residual: (M, N) like ``x``, or None (no add).
        weight: (N,), or None: the plain allreduce (no norm).
        two_stage_bytes: messages of at least this many bytes take the 2-stage kernel.
        want_rstd: also return each row's fp32 rstd (the norm's statistic, for its backward).

    Returns:
        ``(normed or None, out, rstd or None)``; ``out`` is the sum (plus the residual).
    """
    from truefuse.kernels.allreduce import _allreduce_add_rmsnorm_kernel

    M, N = x.shape
    out = torch.empty_like(x)
    normed = torch.empty_like(x) if weight is not None else None
    rstd = torch.empty(M, dtype=torch.float32, device=x.device) if want_rstd and weight is not None else None
    if M == 0:
        return normed, out, rstd
    W = state.world_size
    nbytes = x.numel() * x.element_size()
    two_stage = nbytes >= two_stage_bytes
    share = -(-M // W)
    rows = share if two_stage else M
    per_word = 4 // x.element_size()
    ll = not two_stage and nbytes <= LL_MAX_BYTES and M * -(-N // per_word) * 8 <= state.ll_slot_bytes
    block, warps = block_and_warps(N)  # the norm launcher's choice: the bits of truefuse.rms_norm
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
        TWO_STAGE=two_stage, PUSH=nbytes <= PUSH_MAX_BYTES, LL=ll, BLOCK_N=block,
        INTERPRETED=get_config().triton_interpret, rstd_ptr=rstd, num_warps=warps, maxnreg=cap,
    )  # fmt: skip
    return normed, out, rstd
