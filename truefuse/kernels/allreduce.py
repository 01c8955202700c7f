"""Triton allreduce + residual add + RMSNorm over torch symmetric memory (docs/design.md §4). No multicast.

Every rank's workspace buffer (symmetric: every peer can write and read it) has two halves, used
by alternate calls. Each half holds W + 1 regions of M×N elements (one input slot per source
rank, and the 2-stage path's rounded sums of the shares), then W slots of "LL" words.

* LL 1-stage (small messages): every 8-byte word a rank pushes into slot ``rank`` of each peer's LL
  region carries 4 bytes of data and the call's flag (epoch + 1) in its other 4 bytes. An aligned
  8-byte store lands whole, so a reader that sees the flag sees the data: no fence, no barrier, one
  one-way trip over NVLink. Then as below: sum in rank order, residual, norm.
* 1-stage: push x into slot ``rank`` of every peer's buffer (or, for large messages, into my own
  slot 0 for peers to pull); barrier; every row: sum the W ranks' rows in rank order 0..W-1 in
  fp32, round once, add the residual (fp32 add, one rounding: what PyTorch does for a bf16
  ``a + b``), RMSNorm by ``rms_norm_row`` (the bits of ``truefuse.rms_norm``).
* 2-stage: each share's rows go to their owner (pushed, or staged for it to pull); barrier; the
  owner reduces its share the same way (the rounded sum only) and pushes the sums to every rank
  (or keeps them for them to pull); barrier; every rank adds its own residual and norms locally.
  Only the sums cross NVLink twice (not residual_out and normed), and each rank's outputs use its
  own residual, as the contract says.

Barriers are per program: program p of every rank handles the same rows, so it only waits for
program p of the peers. A signal is one system fence, then the call's epoch (a device counter, the
same on every rank, moved on by program 0 of each call once all its programs have read it, see
``_advance_epoch``) written into each peer's flag; the
waiter polls its flags until they reach it, then fences. No end barrier: a rank writes a half
again only two calls later, after the first wait of the call in between (a barrier, or the LL
flags), which it can pass only once every peer has started that call, so has finished the one
before (the one reading that half).

With ``rstd_ptr`` (the launcher passes it when a gradient is wanted) every rank also stores each
row's fp32 ``rstd`` from ``rms_norm_row``: what ``truefuse.rms_norm``'s forward saves for its backward.

``INTERPRETED`` (a constexpr the launcher passes, ``ops/allreduce.py``; False on a GPU): Triton's
CPU interpreter cannot run PTX. There (the CPU tests: ranks as processes sharing memory) x86's
store order and the interpreter's one-program-at-a-time execution need no fence, and the epoch
moves on in the last program instead of program 0 (see ``_advance_epoch``).
"""

import triton
import triton.language as tl

from truefuse.kernels.norm import rms_norm_row


@triton.jit
def _fence_sys(dep, INTERPRETED: tl.constexpr):
    """One ``fence.acq_rel.sys`` (``dep``: any scalar, only to give the asm an operand); none in the interpreter."""
    if not INTERPRETED:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, $1;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(
    sig_ptrs,
    region: tl.constexpr,
    pid,
    rank,
    value,
    W: tl.constexpr,
    WP: tl.constexpr,
    MAXP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program ``pid`` of every rank meets. One system fence orders this program's stores before
    the flag (region, pid, source) of each pad takes the call's epoch ``value``; the waiter polls
    its flags until they reach it, then fences (measured on 4 H200: 9.5 us against 11.8 with a
    release per flag and an acquire per poll). Epochs only grow, so a peer already in the next
    call (value + 1) also satisfies the wait."""
    tl.debug_barrier()  # every thread's stores of this program are issued before the fence
    base = (region * MAXP + pid) * W
    _fence_sys(value, INTERPRETED)
    for q in tl.static_range(W):
        tl.atomic_xchg(tl.load(sig_ptrs + q).to(tl.pointer_type(tl.int32)) + base + rank, value, sem="relaxed", scope="sys")
    # every peer's flag in one load per poll (WP: W rounded up to a power of 2): W flags cost one
    # round trip, not W in turn
    qs = tl.arange(0, WP)
    flags = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int32)) + base + qs
    while tl.min(tl.load(flags, mask=qs < W, other=value, volatile=True), axis=0) < value:
        pass
    _fence_sys(value, INTERPRETED)
    tl.debug_barrier()  # no thread reads a peer's rows before the fence


@triton.jit
def _advance_epoch(epoch_ptr, done_ptr, epoch, pid, P, INTERPRETED: tl.constexpr):
    """Program 0 moves the epoch on for the next call once every program of this call has read it
    (each other program counts itself in ``done`` with a release right after its read). Called
    after the sends, so the wait for the count overlaps the wait for the peers' data; the other
    programs' tails have no atomic round trip (with every program counting in at its end, the
    last moving the epoch on, 4 and 16 rows took ~0.9 us more than 1 row on one H200)."""
    if INTERPRETED:  # programs run one after another, in order: the last one has seen all read it
        if pid == P - 1:
            tl.store(epoch_ptr, epoch + 1)
    elif pid == 0:
        if P > 1:
            while tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu") < P - 1:
                pass
            tl.store(done_ptr, 0)
        tl.store(epoch_ptr, epoch + 1)


@triton.jit
def _ll_pack(v, EPW: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row of BLOCK_N values (16- or 32-bit) as BLOCK_N / EPW int64 words holding 32 data bits each
    (little-endian: word j holds elements EPW·j ..., as the row's memory does)."""
    if EPW == 2:
        bits = tl.reshape(v.to(tl.int16, bitcast=True), (BLOCK_N // 2, 2))
        lo, hi = tl.split(bits)
        word = (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)
    else:
        word = v.to(tl.int32, bitcast=True)
    return word.to(tl.int64) & 0xFFFFFFFF


@triton.jit
def _ll_wait_words(src, words, wmask, flag):
    """The LL words at ``src + words`` (any shape; masked by ``wmask``), once every one carries ``flag``."""
    flag_bits = flag.to(tl.int64) << 32
    w = tl.load(src + words, mask=wmask, other=flag_bits, volatile=True)
    while tl.sum(((w >> 32).to(tl.int32) != flag).to(tl.int32)) > 0:
        w = tl.load(src + words, mask=wmask, other=flag_bits, volatile=True)
    return w


@triton.jit
def _ll_unpack(w, DT: tl.constexpr, EPW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The inverse of ``_ll_pack``. 16-bit rows come out in the layout join/reshape gives, not the
    plain layout of ``cols``: a row in another layout sums the norm's mean in another order, hence
    other bits than ``truefuse.rms_norm`` (seen in fp16 on the H200), so ``_ll_one_stage`` brings
    rows back through memory. 32-bit words map one to one onto the elements."""
    d = w.to(tl.int32)
    if EPW == 2:
        return tl.reshape(tl.join(d.to(tl.int16), (d >> 16).to(tl.int16)), (BLOCK_N,)).to(DT, bitcast=True)
    else:
        return d.to(DT, bitcast=True)


@triton.jit
def _finish_row(
    s, res, w, out_ptr, normed_ptr, rstd_ptr, row, off, cols, mask, N, eps, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr
):
    """This rank's end of a row from the rounded sum ``s``: its own residual row ``res`` added (fp32
    add, one rounding), stored, and normed by ``rms_norm_row`` (the bits of ``truefuse.rms_norm``);
    the row's rstd stored too when ``rstd_ptr`` is given (None: no code for it)."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    r = s
    if HAS_RES:
        r = (s.to(tl.float32) + res.to(tl.float32)).to(DT)
    tl.store(out_ptr + off + cols, r, mask=mask)
    if HAS_NORM:
        y, rstd = rms_norm_row(r.to(tl.float32), w, N, eps, True, False)
        tl.store(normed_ptr + off + cols, y.to(DT), mask=mask)
        if rstd_ptr is not None:
            tl.store(rstd_ptr + row, rstd)


@triton.jit
def _reduce_row(mine, buf_ptrs, base, MN, off, cols, mask, W: tl.constexpr, DT: tl.constexpr, PUSH: tl.constexpr):
    for q in tl.static_range(W):  # rank order 0..W-1, fp32, from rank 0's row (-0 stays -0)
        if PUSH:  # slot q of my buffer holds rank q's rows
            src = mine + q * MN
        else:  # rank q's rows are in slot 0 of its buffer
            src = tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base
        v = tl.load(src + off + cols, mask=mask, other=0.0).to(tl.float32)
        if q == 0:
            acc = v
        else:
            acc += v
    return acc.to(DT)  # the one rounding


@triton.jit
def _ll_one_stage(
    x_ptr,
    res_ptr,
    w,
    out_ptr,
    normed_ptr,
    rstd_ptr,
    buf_ptrs,
    ll_base,
    epoch_ptr,
    done_ptr,
    epoch,
    pid,
    P,
    M,
    N,
    eps,
    rank,
    W: tl.constexpr,
    WP: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    EPW: tl.constexpr = 32 // DT.primitive_bitwidth  # elements per 32 data bits
    BLOCK_W: tl.constexpr = BLOCK_N // EPW
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    words = tl.arange(0, BLOCK_W)
    RW = (N + EPW - 1) // EPW  # words per row
    wmask = words < RW
    flag = epoch + 1
    flag_bits = flag.to(tl.int64) << 32
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(tl.int64)) + ll_base
    qs = tl.arange(0, WP)
    for row in range(pid, M, P):
        packed = _ll_pack(tl.load(x_ptr + tl.cast(row, tl.int64) * N + cols, mask=mask, other=0.0), EPW, BLOCK_N) | flag_bits
        for q in tl.static_range(W):
            dst = tl.load(buf_ptrs + q).to(tl.pointer_type(tl.int64)) + ll_base + tl.cast(rank * M + row, tl.int64) * RW
            tl.store(dst + words, packed, mask=wmask)
    _advance_epoch(epoch_ptr, done_ptr, epoch, pid, P, INTERPRETED)
    for row in range(pid, M, P):
        off = tl.cast(row, tl.int64) * N
        res = tl.load(res_ptr + off + cols, mask=mask & HAS_RES, other=0.0)  # in flight while we wait
        # every rank's words of the row in one 2-D load per poll (W slots: one round trip, not W
        # in turn), then the ranks' rows taken out one by one (an integer select: exact) and summed
        # in rank order 0..W-1 in fp32, from rank 0's row (not from +0: -0 stays -0)
        slots = mine + (qs[:, None] * M + row).to(tl.int64) * RW
        w2 = _ll_wait_words(slots, words[None, :], (qs[:, None] < W) & wmask[None, :], flag)
        for q in tl.static_range(W):
            v = _ll_unpack(tl.sum(tl.where(qs[:, None] == q, w2, 0), axis=0), DT, EPW, BLOCK_N).to(tl.float32)
            if q == 0:
                acc = v
            else:
                acc += v
        # the rounded sum goes through the out row to come back in the plain layout of ``cols``:
        # the norm's mean must sum as truefuse.rms_norm's does, and acc has the layout of the 2-D
        # load (and for 16-bit rows, of join/reshape)
        if EPW == 2:
            at = tl.reshape(tl.join(2 * words, 2 * words + 1), (BLOCK_N,))  # the columns of acc's elements
        else:
            at = words
        tl.store(out_ptr + off + at, acc.to(DT), mask=at < N)
        tl.debug_barrier()  # the whole row is stored before any thread reads it back
        s = tl.load(out_ptr + off + cols, mask=mask, other=0.0)  # masked lanes enter the norm's sum
        _finish_row(s, res, w, out_ptr, normed_ptr, rstd_ptr, row, off, cols, mask, N, eps, HAS_RES, HAS_NORM)


# no argument may be specialised: a value of 1 must not become a constant (one kernel for every call)
@triton.jit(do_not_specialize=["half", "half_words", "ll_words", "M", "N", "share", "eps", "rank"])
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
    half_words,
    ll_words,
    M,
    N,
    share,
    eps,
    rank,
    W: tl.constexpr,
    WP: tl.constexpr,  # W rounded up to a power of 2 (the polls' vector width)
    MAXP: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_NORM: tl.constexpr,
    TWO_STAGE: tl.constexpr,
    PUSH: tl.constexpr,
    LL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter (no PTX fences, see _advance_epoch); False on a GPU
    rstd_ptr=None,  # (M,) fp32: each row's rstd (for the norm's backward); None: not stored, no code for it
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    MN = M.to(tl.int64) * N
    # this call's epoch: the same on every rank (every rank runs the same sequence of calls)
    epoch = tl.load(epoch_ptr)
    if pid > 0 and not INTERPRETED:  # counted in once the epoch is read (the release orders the read first)
        tl.atomic_add(done_ptr, 1, sem="release", scope="gpu")
    base = (epoch % 2).to(tl.int64) * half  # alternate halves: no end barrier needed (see module doc)
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(DT)) + base
    # the norm's weight once per program, before any store (loaded after one, it would wait)
    w = tl.load(w_ptr + cols, mask=mask & HAS_NORM, other=0.0).to(tl.float32)

    if LL:
        ll_base = (epoch % 2).to(tl.int64) * half_words + ll_words
        _ll_one_stage(
            x_ptr,
            res_ptr,
            w,
            out_ptr,
            normed_ptr,
            rstd_ptr,
            buf_ptrs,
            ll_base,
            epoch_ptr,
            done_ptr,
            epoch,
            pid,
            P,
            M,
            N,
            eps,
            rank,
            W,
            WP,
            HAS_RES,
            HAS_NORM,
            BLOCK_N,
            INTERPRETED,
        )
    else:
        # PUSH (small messages): my rows go into slot ``rank`` of every reader's buffer (posted
        # remote stores) and the sum reads local slots. Otherwise my rows go into my own slot 0 and
        # the sum reads every peer's slot 0 (remote loads). Rows are partitioned over programs
        # exactly as they are read below (per share in the 2-stage path), so each program's
        # barrier covers them.
        if TWO_STAGE:
            for q in tl.static_range(W):
                if PUSH:
                    dst = tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base + rank * MN
                else:
                    dst = mine
                for row in range(q * share + pid, tl.minimum(q * share + share, M), P):
                    off = tl.cast(row, tl.int64) * N
                    tl.store(dst + off + cols, tl.load(x_ptr + off + cols, mask=mask), mask=mask)
        else:
            for row in range(pid, M, P):
                off = tl.cast(row, tl.int64) * N
                v = tl.load(x_ptr + off + cols, mask=mask)
                if PUSH:
                    for q in tl.static_range(W):
                        dst = tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base + rank * MN
                        tl.store(dst + off + cols, v, mask=mask)
                else:
                    tl.store(mine + off + cols, v, mask=mask)
        _advance_epoch(epoch_ptr, done_ptr, epoch, pid, P, INTERPRETED)
        _barrier(sig_ptrs, 0, pid, rank, epoch + 1, W, WP, MAXP, INTERPRETED)

        if TWO_STAGE:
            # stage 1: I reduce my share; the rounded sums go to region W (every rank's when pushing)
            for row in range(rank * share + pid, tl.minimum(rank * share + share, M), P):
                off = tl.cast(row, tl.int64) * N
                s = _reduce_row(mine, buf_ptrs, base, MN, off, cols, mask, W, DT, PUSH)
                if PUSH:
                    for q in tl.static_range(W):
                        tl.store(tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base + W * MN + off + cols, s, mask=mask)
                else:
                    tl.store(mine + W * MN + off + cols, s, mask=mask)
            _barrier(sig_ptrs, 1, pid, rank, epoch + 1, W, WP, MAXP, INTERPRETED)
            # stage 2: every row's sum from its owner (or my region W), then MY residual and norm:
            # the outputs are this rank's own, bitwise the 1-stage result, whatever the peers' residuals
            for q in tl.static_range(W):
                if PUSH:
                    src = mine + W * MN
                else:
                    src = tl.load(buf_ptrs + q).to(tl.pointer_type(DT)) + base + W * MN
                for row in range(q * share + pid, tl.minimum(q * share + share, M), P):
                    off = tl.cast(row, tl.int64) * N
                    s = tl.load(src + off + cols, mask=mask, other=0.0)  # masked lanes enter the norm's sum
                    res = tl.load(res_ptr + off + cols, mask=mask & HAS_RES, other=0.0)
                    _finish_row(s, res, w, out_ptr, normed_ptr, rstd_ptr, row, off, cols, mask, N, eps, HAS_RES, HAS_NORM)
        else:
            for row in range(pid, M, P):
                off = tl.cast(row, tl.int64) * N
                res = tl.load(res_ptr + off + cols, mask=mask & HAS_RES, other=0.0)
                s = _reduce_row(mine, buf_ptrs, base, MN, off, cols, mask, W, DT, PUSH)
                _finish_row(s, res, w, out_ptr, normed_ptr, rstd_ptr, row, off, cols, mask, N, eps, HAS_RES, HAS_NORM)
