"""The host launcher of the symmetric-memory allreduce + residual add + RMSNorm kernel
(``truefuse/kernels/allreduce.py``, docs/design.md §4). The thresholds that pick its variant are
tuning knobs (``truefuse.config.Tuning``: ``ll_max_bytes``, ``push_max_bytes``, ``two_stage_bytes``,
``programs_per_sm``, ``maxp``), read at each call.

The kernel norms each row with ``kernels/norm.py::rms_norm_row`` and must give the bits of
``truefuse.rms_norm``: it is launched with the norm launcher's own choice of BLOCK_N and num_warps
(``ops.norm.block_and_warps``, called here, not copied). The symmetric buffers themselves (one
``SymmetricState`` per ``truefuse.distributed.Workspace``) are allocated in ``truefuse/distributed/``.
"""

from __future__ import annotations

import torch

from truefuse.config import get_config, get_tuning
from truefuse.ops.norm import block_and_warps


def default_two_stage_bytes(world_size: int) -> int:
    """The default 2-stage threshold of a group of ``world_size`` ranks: the ``two_stage_bytes``
    tuning knob's entry (measured on 2 and 4 H200, 8 a guess; docs/benchmarks.md), else
    ``two_stage_bytes_other``. A workspace may override it (``Workspace(two_stage_bytes=...)``)."""
    return get_tuning().two_stage_threshold(world_size)


def allreduce_add_rmsnorm_fwd(state, x, residual, weight, eps: float, two_stage_bytes: int, *, want_rstd: bool = False):
    """Run the fused kernel on 2-D contiguous ``x`` (M, N) over a workspace's symmetric buffers.

    Args:
        state: the workspace's ``SymmetricState`` (``truefuse/distributed/workspace.py``): its
            ``buffer_ptrs``, ``signal_ptrs``, ``epoch``, ``done``, ``half_bytes``, ``ll_offset``,
            ``ll_slot_bytes``, ``maxp``, ``rank``, ``world_size``, ``poll_width`` and ``sms``.
        residual: (M, N) like ``x``, or None (no add).
        weight: (N,), or None: the plain allreduce (no norm).
        two_stage_bytes: messages of at least this many bytes take the 2-stage kernel.
        want_rstd: also return each row's fp32 rstd (the norm's statistic, for its backward).

    Returns:
        ``(normed or None, out, rstd or None)``; ``out`` is the sum (plus the residual).

    Raises:
        ValueError: the ``maxp`` tuning knob exceeds the programs the workspace's signal pad was
            sized for (``state.maxp``, the knob when the workspace was made).
    """
    from truefuse.kernels.allreduce import _allreduce_add_rmsnorm_kernel

    knobs = get_tuning()
    if knobs.maxp > state.maxp:
        raise ValueError(
            f"tuning knob maxp={knobs.maxp} exceeds the {state.maxp} programs this workspace's signal pad "
            "holds flags for: make the Workspace inside the same truefuse.config.tuning(maxp=...) block"
        )
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
    ll = not two_stage and nbytes <= knobs.ll_max_bytes and M * -(-N // per_word) * 8 <= state.ll_slot_bytes
    block, warps = block_and_warps(N)  # the norm launcher's choice: the bits of truefuse.rms_norm
    # every program must be resident at once (the barriers wait on peers' programs): with more than
    # one per SM registers are capped below
    per_sm = max(1, min(knobs.programs_per_sm, 16 // warps))
    programs = max(1, min(knobs.maxp, state.sms * per_sm, rows))
    # registers are capped only when programs must share SMs: uncapped, the LL kernel keeps its rows
    # in registers (capped at 128 it spilled ~500 bytes a thread to local memory)
    cap = 128 if programs > state.sms else None
    _allreduce_add_rmsnorm_kernel[(programs,)](
        x, residual if residual is not None else x, weight if weight is not None else x, out,
        normed if normed is not None else out, state.buffer_ptrs, state.signal_ptrs, state.epoch, state.done,
        state.half_bytes // x.element_size(), state.half_bytes // 8, state.ll_offset // 8, M, N, share, float(eps),
        state.rank, W=W, WP=state.poll_width, MAXP=state.maxp, HAS_RES=residual is not None, HAS_NORM=weight is not None,
        TWO_STAGE=two_stage, PUSH=nbytes <= knobs.push_max_bytes, LL=ll, BLOCK_N=block,
        INTERPRETED=get_config().triton_interpret, rstd_ptr=rstd, num_warps=warps, maxnreg=cap,
    )  # fmt: skip
    return normed, out, rstd
