"""The host launcher of the symmetric-memory allreduce + residual add + RMSNorm kernel
(``truefuse/kernels/allreduce.py``, docs/design.md §4). The thresholds that pick its variant are
tuning knobs (``truefuse.config.Tuning``: ``ll_max_bytes``, ``push_max_bytes``, ``two_stage_bytes``,
``programs_per_sm``, ``maxp``), read at each call.

The kernel norms each row with ``kernels/norm.py::rms_norm_row`` and must give the bits of
``truefuse.rms_norm``: it is launched with the norm launcher's own choice of BLOCK_N and num_warps
(``ops.norm_config.block_and_warps``, called here, not copied). The symmetric buffers themselves (one
``SymmetricState`` per ``truefuse.distributed.Workspace``) are allocated in ``truefuse/distributed/``.
"""

from __future__ import annotations

import torch

from truefuse.config import get_config, get_tuning
from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops.norm.norm_config import block_and_warps


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
    knobs = get_tuning()
    if knobs.maxp > state.maxp:
        raise ValueError(
            f"tuning knob maxp={knobs.maxp} exceeds the {state.maxp} programs this workspace's signal pad "
            "holds flags for: make the Workspace inside the same truefuse.config.tuning(maxp=...) block"
        )
    normed, out, rstd = launch(
        allreduce_add_rmsnorm_op,
        x,
        residual,
        weight,
        state.buffer_ptrs,
        state.signal_ptrs,
        state.epoch,
        state.done,
        state.half_bytes,
        state.ll_offset,
        state.ll_slot_bytes,
        state.maxp,
        state.rank,
        state.world_size,
        state.poll_width,
        state.sms,
        float(eps),
        int(two_stage_bytes),
        bool(want_rstd and weight is not None),
    )
    # an op returns no None: its empty placeholders stand for "not computed"
    return (normed if weight is not None else None), out, (rstd if want_rstd and weight is not None else None)


# The launch as a custom op (docs/design.md §6.7). It advances the device counters ``epoch`` and
# ``done`` (declared mutated); the symmetric buffers and signal pads it writes through
# ``buffer_ptrs``/``signal_ptrs`` are scratch no traced code reads.
@custom_op("truefuse::allreduce_add_rmsnorm", mutates_args=("epoch", "done"))
def allreduce_add_rmsnorm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    epoch: torch.Tensor,
    done: torch.Tensor,
    half_bytes: int,
    ll_offset: int,
    ll_slot_bytes: int,
    maxp: int,
    rank: int,
    world_size: int,
    poll_width: int,
    sms: int,
    eps: float,
    two_stage_bytes: int,
    want_rstd: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(normed or empty, out, rstd or empty)`` of the fused kernel on a contiguous (M, N) ``x``."""
    from truefuse.kernels.allreduce import _allreduce_add_rmsnorm_kernel

    knobs = get_tuning()
    M, N = x.shape
    out = torch.empty_like(x)
    normed = torch.empty_like(x) if weight is not None else x.new_empty(0)
    rstd = torch.empty(M if want_rstd else 0, dtype=torch.float32, device=x.device)
    if M == 0:
        return normed, out, rstd
    W = world_size
    nbytes = x.numel() * x.element_size()
    two_stage = nbytes >= two_stage_bytes
    share = -(-M // W)
    rows = share if two_stage else M
    per_word = 4 // x.element_size()
    ll = not two_stage and nbytes <= knobs.ll_max_bytes and M * -(-N // per_word) * 8 <= ll_slot_bytes
    block, warps = block_and_warps(N)  # the norm launcher's choice: the bits of truefuse.rms_norm
    # every program must be resident at once (the barriers wait on peers' programs): with more than
    # one per SM registers are capped below
    per_sm = max(1, min(knobs.programs_per_sm, 16 // warps))
    programs = max(1, min(knobs.maxp, sms * per_sm, rows))
    # registers are capped only when programs must share SMs: uncapped, the LL kernel keeps its rows
    # in registers (capped at 128 it spilled ~500 bytes a thread to local memory)
    cap = 128 if programs > sms else None
    _allreduce_add_rmsnorm_kernel[(programs,)](
        x,
        residual if residual is not None else x,
        weight if weight is not None else x,
        out,
        normed if weight is not None else out,
        buffer_ptrs,
        signal_ptrs,
        epoch,
        done,
        half_bytes // x.element_size(),
        half_bytes // 8,
        ll_offset // 8,
        M,
        N,
        share,
        float(eps),
        rank,
        W=W,
        WP=poll_width,
        MAXP=maxp,
        HAS_RES=residual is not None,
        HAS_NORM=weight is not None,
        TWO_STAGE=two_stage,
        PUSH=nbytes <= knobs.push_max_bytes,
        LL=ll,
        BLOCK_N=block,
        INTERPRETED=get_config().triton_interpret,
        rstd_ptr=rstd if want_rstd else None,
        num_warps=warps,
        maxnreg=cap,
    )
    return normed, out, rstd


@allreduce_add_rmsnorm_op.register_fake
def _(
    x,
    residual,
    weight,
    buffer_ptrs,
    signal_ptrs,
    epoch,
    done,
    half_bytes,
    ll_offset,
    ll_slot_bytes,
    maxp,
    rank,
    world_size,
    poll_width,
    sms,
    eps,
    two_stage_bytes,
    want_rstd,
):
    M = x.shape[0]
    normed = torch.empty_like(x) if weight is not None else x.new_empty(0)
    return normed, torch.empty_like(x), x.new_empty((M if want_rstd else 0,), dtype=torch.float32)
