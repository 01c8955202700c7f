"""Triton allreduce + residual add + RMSNorm over torch symmetric memory (DESIGN §4). No multicast.

Every rank's workspace buffer (symmetric: every peer can write and read it) has two halves, used
by alternate calls, each of W + 2 regions of M×N elements: one input slot per source rank, and for
the 2-stage path the share's residual_out and normed rows.

* 1-stage: push x into slot ``rank`` of every peer's buffer (or, for large messages, into my own
  slot 0 for peers to pull); barrier; every row: sum the W ranks' rows in rank order 0..W-1 in
  fp32, round once, add the residual (fp32 add, one rounding: what PyTorch
  does for a bf16 ``a + b``), RMSNorm by ``rms_norm_row`` (the bits of ``truefuse.rms_norm``).
* 2-stage: push each share's rows to its owner only; barrier; the owner reduces its share the same
  way into its buffer; barrier; every rank copies every share from its owner.

Barriers are per program: program p of every rank handles the same rows, so it only waits for
program p of the peers. A signal writes the call's epoch (a device counter, the same on every
rank, moved on by the last program of each call) with release semantics at system scope; the
waiter spins with acquire loads until its flags reach it. No end barrier: a rank writes a half
again only two calls later, after the first barrier of the call in between, which every peer can
reach only once its own kernel of the call before (the one reading that half) has finished.
"""

import triton
import triton.language as tl

from truefuse.kernels.norm import rms_norm_row


@triton.jit
def _barrier(sig_ptrs, region: tl.constexpr, pid, rank, value, W: tl.constexpr, MAXP: tl.constexpr):
    """Program ``pid`` of every rank meets. Flag (region, pid, source) of each pad takes the call's
    epoch ``value`` (release, system scope); the waiter spins until its flags reach it (acquire).
    Epochs only grow, so a peer already in the next call (value + 1) also satisfies the wait."""
    tl.debug_barrier()  # every thread's stores of this program are issued before the release
    base = (region * MAXP + pid) * W
    for q in tl.static_range(W):
        tl.atomic_xchg(tl.load(sig_ptrs + q).to(tl.pointer_type(tl.int32)) + base + rank, value, sem="release", scope="sys")
    mine = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(W):
        while tl.atomic_add(mine + base + q, 0, sem="acquire", scope="sys") < value:
            pass
    tl.debug_barrier()  # no thread reads a peer's rows before the acquire


@triton.jit
def _reduce_row(mine, buf_ptrs, base, MN, off, cols, mask, W: tl.constexpr, DT: tl.constexpr, PUSH: tl.constexpr):
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for q in tl.static_range(W):  # rank order 0..W-1, fp32
        if PUSH:  # slot q of my buffer holds rank q's rows
            src = mine + q * MN
        else:  # rank q's rows are in slot 0 of its buffer
            src = tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base
        acc += tl.load(src + off + cols, mask=mask, other=0.0).to(tl.float32)
    return acc.to(DT)  # the one rounding


@triton.jit(do_not_specialize=["half", "M", "N", "share", "eps", "rank"])  # 1 must not become a constant
def _allreduce_add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    normed_ptr,
    buf_ptrs,
    sig_ptrs,
    epoch_ptr,
    done_ptr,
    half,
    M,
    N,
    share,
    eps,
    rank,
    W: tl.constexpr,
    MAXP: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_NORM: tl.constexpr,
    TWO_STAGE: tl.constexpr,
    PUSH: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    MN = M.to(tl.int64) * N
    # this call's epoch: the same on every rank (every rank runs the same sequence of calls)
    epoch = tl.load(epoch_ptr)
    base = (epoch % 2).to(tl.int64) * half  # alternate halves: no end barrier needed (see module doc)
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(DT)) + base

    # PUSH (small messages): my rows go into slot ``rank`` of every reader's buffer (posted remote
    # stores: the barrier is the call's only round trip) and the sum reads local slots. Otherwise
    # (large messages) my rows go into my own slot 0 and the sum reads every peer's slot 0 (remote
    # loads: measured faster at volume). Rows are partitioned over programs exactly as they are
    # read below (per share in the 2-stage path), so each program's barrier covers them.
    if TWO_STAGE:
        for q in tl.static_range(W):
            if PUSH:
                dst = tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base + rank * MN
            else:
                dst = mine
            for row in range(q * share + pid, tl.minimum(q * share + share, M), P):
                off = row.to(tl.int64) * N
                tl.store(dst + off + cols, tl.load(x_ptr + off + cols, mask=mask), mask=mask)
    else:
        for row in range(pid, M, P):
            off = row.to(tl.int64) * N
            v = tl.load(x_ptr + off + cols, mask=mask)
            if PUSH:
                for q in tl.static_range(W):
                    dst = tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base + rank * MN
                    tl.store(dst + off + cols, v, mask=mask)
            else:
                tl.store(mine + off + cols, v, mask=mask)
    _barrier(sig_ptrs, 0, pid, rank, epoch + 1, W, MAXP)

    if TWO_STAGE:
        lo = rank * share
        hi = tl.minimum(lo + share, M)
    else:
        lo = 0
        hi = M
    for row in range(lo + pid, hi, P):
        off = row.to(tl.int64) * N
        r = _reduce_row(mine, buf_ptrs, base, MN, off, cols, mask, W, DT, PUSH)
        if HAS_RES:
            r = (r.to(tl.float32) + tl.load(res_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)).to(DT)
        if TWO_STAGE:
            tl.store(mine + W * MN + off + cols, r, mask=mask)
        else:
            tl.store(out_ptr + off + cols, r, mask=mask)
        if HAS_NORM:
            y, _ = rms_norm_row(r.to(tl.float32), w_ptr, cols, mask, N, eps, True, False)
            if TWO_STAGE:
                tl.store(mine + (W + 1) * MN + off + cols, y.to(DT), mask=mask)
            else:
                tl.store(normed_ptr + off + cols, y.to(DT), mask=mask)

    if TWO_STAGE:
        _barrier(sig_ptrs, 1, pid, rank, epoch + 1, W, MAXP)
        for q in tl.static_range(W):  # gather every share from its owner
            peer = tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base
            q_lo = q * share
            q_hi = tl.minimum(q_lo + share, M)
            for row in range(q_lo + pid, q_hi, P):
                off = row.to(tl.int64) * N
                tl.store(out_ptr + off + cols, tl.load(peer + W * MN + off + cols, mask=mask), mask=mask)
                if HAS_NORM:
                    tl.store(normed_ptr + off + cols, tl.load(peer + (W + 1) * MN + off + cols, mask=mask), mask=mask)
    # the last program to finish moves the epoch on, for the next call (after this kernel)
    if tl.atomic_add(done_ptr, 1) == tl.num_programs(0) - 1:
        tl.store(done_ptr, 0)
        tl.store(epoch_ptr, epoch + 1)
