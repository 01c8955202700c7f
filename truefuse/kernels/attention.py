"""Triton kernels of batch-invariant attention (docs/attention.md): the forward (prefill and
decode are the same kernel), the backward's delta = rowsum(dO · O), a dK/dV pass over key blocks
and a separate dQ pass (no atomics: every gradient element is written by one program).

Batch invariance (docs/design.md §1): a query row of batch ``b`` reduces over the keys in blocks of
``BLOCK_N`` (a constexpr from the head dim and dtype, ``ops/attention/attention_config.py``) starting at its
sequence's first valid key ``key_start[b]``, with one online-softmax merge per block in key order.
A block in which the row sees no key leaves (m, l, acc) bit for bit unchanged (max unchanged,
rescale factor exp2(0) = 1, p = 0), so it does not matter whether a launch visits it: prefill
(causal, trailing blocks masked), a padded batch (the row's keys shifted by its left padding, the
blocks shifted with them) and decode (one or a few rows against a cache, the last block cut at the
cache's end) run the same arithmetic per row. Each output element of ``tl.dot`` reduces over the
head dim in an order that does not depend on the other rows of the tile. Conversely a block in which every row
sees every key is unchanged by the mask, so with the launch table's ``full_blocks`` the forward and
dQ run those blocks (a prefix of each row's key order, ``_full_end``) without it.

Scores are fp32: s = (q · k) · scale, then ``softcap · tanh(s / softcap)``, then the mask (bool:
False → −inf; float: added), then −inf outside [key_start, L_k), above the causal diagonal
(top-left, as SDPA's ``is_causal``) and outside the sliding window (q_pos − k_pos < window with
q_pos = row + L_k − L_q). A row with no valid key outputs zeros and stores lse = +inf, so its
backward probabilities are exp2(−inf) = 0.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits ±1 at ±inf (tl has no tanh on every backend)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b. Under the interpreter, products summed over the inner dimension in its order:
    its tl.dot is a BLAS matmul whose result for a row depends on the row's place in the tile
    (a row alone and the same row in a left-padded batch differed by 1 ulp in 21% of elements)."""
    if INTERPRETED:
        return acc + tl.sum(a[:, :, None] * b[None, :, :], 1)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _rows(base, offs, stride, offs_d, msk):
    """A (rows, BLOCK_D) tile of rows ``offs`` (int64 offsets), zeros outside ``msk``."""
    return tl.load(base + offs[:, None].to(tl.int64) * stride + offs_d[None, :], mask=msk, other=0.0)


@triton.jit
def _tile_pair(A, sab, sah, sar, B, sbb, sbh, sbr, b64, head, offs, L, D, BLOCK_D: tl.constexpr):
    """Rows ``offs`` (< L) of one (batch, head) of two tensors, with the head-dim offsets and masks."""
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    msk = (offs < L)[:, None] & in_d[None, :]
    h64 = head.to(tl.int64)
    a = _rows(A + b64 * sab + h64 * sah, offs, sar, offs_d, msk)
    return a, _rows(B + b64 * sbb + h64 * sbh, offs, sbr, offs_d, msk), offs_d, in_d, msk


@triton.jit
def _query_program(H, GROUP, BLOCK_M: tl.constexpr):
    """A query-block program's (batch·head, batch, head, kv head, first row)."""
    bh = tl.program_id(1)
    h = bh % H
    return bh, bh // H, h, h // GROUP, tl.program_id(0) * BLOCK_M


@triton.jit
def _scores(
    q,
    kt,
    offs_m,
    offs_n,
    mask_row_ptr,
    smm,
    smn,
    start,
    L_q,
    L_k,
    scale,
    softcap,
    window,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    MASKED: tl.constexpr,
):
    """(BM, BN) fp32 scores and, with softcap, tanh's value (for the backward's derivative).
    ``MASKED=False``: a block every row sees whole (``_full_end``; no mask tensor, no window), whose
    masking would keep every score as it is."""
    s = _dot(q, kt, tl.zeros([q.shape[0], kt.shape[1]], tl.float32), PRECISION, INTERPRETED) * scale
    t = s
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = softcap * t
    if MASKED:
        in_m = offs_m < L_q
        in_n = (offs_n < L_k) & (offs_n >= start)
        if MASK_KIND == 1:
            mv = tl.load(
                mask_row_ptr + offs_m[:, None] * smm + offs_n[None, :] * smn, mask=in_m[:, None] & in_n[None, :], other=0
            )
            s = tl.where(mv != 0, s, float("-inf"))
        if MASK_KIND == 2:
            mv = tl.load(
                mask_row_ptr + offs_m[:, None] * smm + offs_n[None, :] * smn, mask=in_m[:, None] & in_n[None, :], other=0.0
            )
            s = s + mv.to(tl.float32)
        valid = in_n[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            valid = valid & ((offs_m[:, None] + (L_k - L_q) - offs_n[None, :]) < window)
        s = tl.where(valid, s, float("-inf"))
    return s, t


@triton.jit
def _full_end(start, m0, L_k, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The end of the key blocks (on the grid start + j·BLOCK_N) that every row of [m0, m0 + BLOCK_M)
    sees whole: a block before it lies in [start, L_k) and, causal, at or left of row m0's diagonal
    (no mask tensor, no window: the caller's FULL_BLOCKS). These blocks come first in the key
    order, so running them unmasked and the rest masked keeps each row's order and bits."""
    e = L_k
    if CAUSAL:
        e = tl.minimum(e, m0 + 1)
    return start + tl.maximum(e - start, 0) // BLOCK_N * BLOCK_N


@triton.jit
def _key_range(
    start, m0, L_q, L_k, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """Key blocks [lo, hi) that rows [m0, m0 + BLOCK_M) can see, lo on the grid start + j·BLOCK_N.
    Skipping the others is bit-neutral (module doc)."""
    hi = L_k
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M)
    lo = start
    if HAS_WINDOW:
        lowest = m0 + (L_k - L_q) - window + 1
        lo = start + tl.maximum(lowest - start, 0) // BLOCK_N * BLOCK_N
    return lo, hi


@triton.jit
def _row_sum(p, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Σ_n p[m, n] in an order fixed by the dot instruction: a one-hot (BLOCK_N, 16) matrix puts
    the sum in column 0 and zeros elsewhere, so the final tl.sum adds only zeros (exact). A tl.sum
    over p itself reduces in the order of whatever register layout the compiler gives p, which
    changed with the mask: on an H100 a row alone and the same row in a masked batch differed by
    1 ulp in ~20% of fp32 outputs."""
    one_hot = (tl.arange(0, p.shape[1])[:, None] >= 0) & (tl.arange(0, 16)[None, :] == 0)
    return tl.sum(_dot(p, one_hot.to(p.dtype), tl.zeros([p.shape[0], 16], tl.float32), PRECISION, INTERPRETED), 1)


@triton.jit
def _merge(m1, l1, acc1, m2, l2, acc2):
    """Two online-softmax states (max, sum, accumulator) as one. An empty state (−inf, 0, 0) is
    neutral on either side, bit for bit."""
    m = tl.maximum(m1, m2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    a1 = tl.exp2((m1 - m_safe) * LOG2E)
    a2 = tl.exp2((m2 - m_safe) * LOG2E)
    return m, l1 * a1 + l2 * a2, acc1 * a1[:, None] + acc2 * a2[:, None]


@triton.jit
def _cols(base, offs, stride, offs_d, in_rows, in_d):
    """The (BLOCK_D, rows) transpose of rows ``offs`` (int64 offsets), loaded through the strides
    (zeros outside ``in_rows`` and ``in_d``): a dot's second operand without a ``tl.trans``."""
    return tl.load(base + offs[None, :].to(tl.int64) * stride + offs_d[:, None], mask=in_rows[None, :] & in_d[:, None], other=0.0)


@triton.jit
def _block_step(
    q,
    k_base,
    v_base,
    skn,
    svn,
    n0,
    offs_m,
    offs_d,
    in_d,
    mask_row_ptr,
    smm,
    smn,
    start,
    L_q,
    L_k,
    scale,
    softcap,
    window,
    m_i,
    l_i,
    acc,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The online softmax's step over the key block [n0, n0 + BLOCK_N) from the state (m, l, acc)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_n = offs_n < L_k
    kt = _cols(k_base, offs_n, skn, offs_d, in_n, in_d)
    s, _ = _scores(
        q,
        kt,
        offs_m,
        offs_n,
        mask_row_ptr,
        smm,
        smn,
        start,
        L_q,
        L_k,
        scale,
        softcap,
        window,
        CAUSAL,
        HAS_WINDOW,
        SOFTCAP,
        MASK_KIND,
        PRECISION,
        INTERPRETED,
        MASKED,
    )
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_i - m_safe) * LOG2E)
    v = _rows(v_base, offs_n, svn, offs_d, in_n[:, None] & in_d[None, :])
    p = tl.exp2((s - m_safe[:, None]) * LOG2E).to(v.dtype)
    l_i = l_i * alpha + _row_sum(p, PRECISION, INTERPRETED)
    acc = _dot(p, v, acc * alpha[:, None], PRECISION, INTERPRETED)
    return m_new, l_i, acc


@triton.jit
def _chunk_state(
    q, k_base, v_base, skn, svn, offs_m, offs_d, in_d, mask_row_ptr, smm, smn, start, c0, lo, hi, full,
    L_q, L_k, scale, softcap, window,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, FULL_BLOCKS: tl.constexpr,
):  # fmt: skip
    """The online softmax of the chunk [c0, c0 + CHUNK)'s blocks within [lo, hi), from the empty
    state. FULL_BLOCKS: the blocks before ``full`` (``_full_end``) skip the mask."""
    m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_c = tl.zeros([BLOCK_M], tl.float32)
    acc_c = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    c_lo = tl.maximum(c0, lo)
    c_hi = tl.minimum(c0 + CHUNK, hi)
    if FULL_BLOCKS:  # the blocks every row sees whole first, unmasked (_full_end)
        for n0 in range(c_lo, tl.minimum(c_hi, full), BLOCK_N):
            m_c, l_c, acc_c = _block_step(
                q, k_base, v_base, skn, svn, n0, offs_m, offs_d, in_d, mask_row_ptr, smm, smn, start, L_q, L_k,
                scale, softcap, window, m_c, l_c, acc_c,
                BLOCK_N, CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, False,
            )  # fmt: skip
        c_lo = tl.maximum(c_lo, full)
    for n0 in range(c_lo, c_hi, BLOCK_N):
        m_c, l_c, acc_c = _block_step(
            q, k_base, v_base, skn, svn, n0, offs_m, offs_d, in_d, mask_row_ptr, smm, smn, start, L_q, L_k,
            scale, softcap, window, m_c, l_c, acc_c,
            BLOCK_N, CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, True,
        )  # fmt: skip
    return m_c, l_c, acc_c


@triton.jit
def _row_state(
    q, k_base, v_base, skn, svn, offs_m, offs_d, in_d, mask_row_ptr, smm, smn, start, lo, hi, full,
    L_q, L_k, scale, softcap, window, state,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, FULL_BLOCKS: tl.constexpr, STATE_IN_MEMORY: tl.constexpr,
):  # fmt: skip
    """The rows' state over the key blocks [lo, hi) (on the grid start + j·BLOCK_N): the keys go in
    chunks of CHUNK from ``start``, each chunk's online softmax from the empty state
    (``_chunk_state``), merged into the rows' state at the chunk's end, in chunk order.

    STATE_IN_MEMORY: between chunks the rows' accumulator waits in ``state`` (this program's
    (BLOCK_M, BLOCK_D) fp32 tile of global memory) instead of registers, so that one accumulator,
    not two, is live through the key loop (254 registers a thread against 188 for the 128 x 64
    forward, experiments/exp_kernel_registers.py); the same merges of the same values in the same
    order, so the same bits."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    c_first = start + (lo - start) // CHUNK * CHUNK
    tile = state + tl.arange(0, BLOCK_M)[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    # one loop per chunk: a single loop over the blocks that merges at chunk ends under an `if`
    # ran 1.2x slower (H100, L=4096, docs/benchmarks.md "Attention")
    for c0 in range(c_first, hi, CHUNK):
        if STATE_IN_MEMORY:  # the rows' state out of registers while the chunk runs (none yet at the first)
            later = tl.zeros([BLOCK_M, BLOCK_D], tl.int32) < c0 - c_first
            tl.store(tile, acc, mask=later)
            tl.debug_barrier()  # the merge's threads read what others wrote
        m_c, l_c, acc_c = _chunk_state(
            q, k_base, v_base, skn, svn, offs_m, offs_d, in_d, mask_row_ptr, smm, smn, start, c0, lo, hi, full,
            L_q, L_k, scale, softcap, window,
            BLOCK_M, BLOCK_N, BLOCK_D, CHUNK, CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, FULL_BLOCKS,
        )  # fmt: skip
        if STATE_IN_MEMORY:
            acc = tl.load(tile, mask=later, other=0.0)
        m_i, l_i, acc = _merge(m_i, l_i, acc, m_c, l_c, acc_c)
    return m_i, l_i, acc


@triton.jit
def _finish(m_i, l_i, acc, Out, Lse, b64, h, bh, offs_m, offs_d, in_d, sob, soh, som, L_q):
    """out = acc / l (zeros where the row saw no key) and lse in base 2 (+inf there)."""
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = tl.where(has, m_safe * LOG2E + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    in_m = offs_m < L_q
    o_ptr = Out + b64 * sob + h.to(tl.int64) * soh + offs_m[:, None].to(tl.int64) * som + offs_d[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])
    tl.store(Lse + bh.to(tl.int64) * L_q + offs_m, lse2, mask=in_m)


@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    Mask,
    KeyStart,
    Out,
    Lse,
    Part,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    som,
    smb,
    smh,
    smm,
    smn,
    H,
    GROUP,
    L_q,
    L_k,
    D,
    scale,
    softcap,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    FULL_BLOCKS: tl.constexpr,
    STATE_IN_MEMORY: tl.constexpr,
):
    """The forward (``_row_state``). SPLIT=False: one program takes every chunk of its rows
    (prefill). SPLIT=True (decode: too few query programs to fill the GPU): the grid's third axis
    is the chunk; each program writes its chunk's state, merged into the empty state as prefill
    merges its first chunk, to ``Part`` (n_chunks, B·H, L_q, BLOCK_D + 2), and
    ``_attention_fwd_merge_kernel`` merges them in the same order with the same ``_merge``
    (merging into the empty state twice gives the bits of once), so both give the same bits.
    STATE_IN_MEMORY (prefill): ``Part`` is the programs' (BLOCK_M, BLOCK_D) fp32 tiles, where the
    rows' accumulator waits between chunks (``_row_state``)."""
    bh, b, h, hk, m0 = _query_program(H, GROUP, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    b64 = b.to(tl.int64)
    k_base = K + b64 * skb + hk.to(tl.int64) * skh
    v_base = V + b64 * svb + hk.to(tl.int64) * svh
    mask_row_ptr = Mask + b64 * smb + h.to(tl.int64) * smh
    q = _rows(Q + b64 * sqb + h.to(tl.int64) * sqh, offs_m, sqm, offs_d, (offs_m[:, None] < L_q) & in_d[None, :])
    start = tl.load(KeyStart + b)
    lo, hi = _key_range(start, m0, L_q, L_k, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    if SPLIT:
        c0 = start + tl.program_id(2) * CHUNK
        lo = tl.maximum(c0, lo)
        hi = tl.minimum(c0 + CHUNK, hi)
    state = Part + ((tl.program_id(0) * tl.num_programs(1) + bh).to(tl.int64) * BLOCK_M * BLOCK_D)
    m_i, l_i, acc = _row_state(
        q, k_base, v_base, skn, svn, offs_m, offs_d, in_d, mask_row_ptr, smm, smn, start, lo, hi,
        _full_end(start, m0, L_k, BLOCK_N, CAUSAL), L_q, L_k, scale, softcap, window, state,
        BLOCK_M, BLOCK_N, BLOCK_D, CHUNK, CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED,
        FULL_BLOCKS, STATE_IN_MEMORY,
    )  # fmt: skip
    if SPLIT:
        row = ((tl.program_id(2) * tl.num_programs(1) + bh).to(tl.int64) * L_q + offs_m) * (BLOCK_D + 2)
        in_m = offs_m < L_q
        tl.store(Part + row[:, None] + offs_d[None, :], acc, mask=in_m[:, None])
        tl.store(Part + row + BLOCK_D, m_i, mask=in_m)
        tl.store(Part + row + BLOCK_D + 1, l_i, mask=in_m)
    else:
        _finish(m_i, l_i, acc, Out, Lse, b64, h, bh, offs_m, offs_d, in_d, sob, soh, som, L_q)


@triton.jit
def _attention_fwd_merge_kernel(Part, Out, Lse, sob, soh, som, H, L_q, D, n_chunks, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The split forward's second step: the chunks' states merged in chunk order (``_merge``, as
    the one-program forward merges them), then ``_finish``."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_m = offs_m < L_q
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c in range(0, n_chunks):
        row = ((c * tl.num_programs(1) + bh).to(tl.int64) * L_q + offs_m) * (BLOCK_D + 2)
        acc_c = tl.load(Part + row[:, None] + offs_d[None, :], mask=in_m[:, None], other=0.0)
        m_c = tl.load(Part + row + BLOCK_D, mask=in_m, other=float("-inf"))
        l_c = tl.load(Part + row + BLOCK_D + 1, mask=in_m, other=0.0)
        m_i, l_i, acc = _merge(m_i, l_i, acc, m_c, l_c, acc_c)
    b = bh // H
    _finish(m_i, l_i, acc, Out, Lse, b.to(tl.int64), bh % H, bh, offs_m, offs_d, offs_d < D, sob, soh, som, L_q)


@triton.jit
def _attention_bwd_delta_kernel(
    Out, DO, Delta, sob, soh, som, sdb, sdh, sdm, H, L_q, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr
):
    """delta[b, h, m] = Σ_d dO · O in fp32."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    msk = (offs_m[:, None] < L_q) & (offs_d[None, :] < D)
    o = _rows(Out + b * sob + h * soh, offs_m, som, offs_d, msk)
    do = _rows(DO + b * sdb + h * sdh, offs_m, sdm, offs_d, msk)
    tl.store(Delta + bh.to(tl.int64) * L_q + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < L_q)


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    Mask,
    KeyStart,
    DO,
    Lse,
    Delta,
    DK,
    DV,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdb,
    sdh,
    sdm,
    smb,
    smh,
    smm,
    smn,
    sdkb,
    sdkh,
    sdkn,
    sdvb,
    sdvh,
    sdvn,
    H,
    HK,
    GROUP,
    L_q,
    L_k,
    D,
    scale,
    softcap,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    FULL_BLOCKS: tl.constexpr,
):
    """One program per (key block, batch, kv head): dK and dV summed over the group's query heads
    in head order, then over the query blocks in row order (deterministic). FULL_BLOCKS: a query
    block whose every row sees every key of the block (inside [start, L_k), causal at or below the
    diagonal) takes its scores unmasked, in the same order."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HK
    hk = bhk % HK
    b64 = b.to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    in_n = offs_n < L_k
    # K and V transposed through the strides; no tl.trans of a loop-invariant tile
    kt = _cols(K + b64 * skb + hk.to(tl.int64) * skh, offs_n, skn, offs_d, in_n, in_d)
    vt = _cols(V + b64 * svb + hk.to(tl.int64) * svh, offs_n, svn, offs_d, in_n, in_d)
    start = tl.load(KeyStart + b)
    # query rows that can see these keys: causal rows >= n0; window rows < n0 + BLOCK_N - 1 + window - (L_k - L_q)
    m_lo = 0
    if CAUSAL:
        m_lo = n0 // BLOCK_M * BLOCK_M
    m_hi = L_q
    if HAS_WINDOW:
        m_hi = tl.minimum(L_q, tl.maximum(n0 + BLOCK_N - 1 + window - (L_k - L_q), 0))
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    keys_whole = (n0 >= start) & (n0 + BLOCK_N <= L_k)  # FULL_BLOCKS: no key of the block is masked out
    # one loop over (head, query block), head-major: the order of the nested loops, without the
    # software pipeline draining at every head
    n_m = tl.cdiv(tl.maximum(m_hi - m_lo, 0), BLOCK_M)
    for it in range(0, GROUP * n_m):
        g = it // n_m
        h = hk * GROUP + g
        h64 = h.to(tl.int64)
        bh = b64 * H + h
        offs_m = m_lo + (it - g * n_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_m = offs_m < L_q
        q = _rows(Q + b64 * sqb + h64 * sqh, offs_m, sqm, offs_d, in_m[:, None] & in_d[None, :])
        do = _rows(DO + b64 * sdb + h64 * sdh, offs_m, sdm, offs_d, in_m[:, None] & in_d[None, :])
        lse2 = tl.load(Lse + bh * L_q + offs_m, mask=in_m, other=float("inf"))
        delta = tl.load(Delta + bh * L_q + offs_m, mask=in_m, other=0.0)
        if FULL_BLOCKS:
            whole = keys_whole
            if CAUSAL:
                whole = whole & (m_lo + (it - g * n_m) * BLOCK_M >= n0 + BLOCK_N - 1)
            if whole:
                s, t = _scores(
                    q, kt, offs_m, offs_n, Mask + b64 * smb + h64 * smh, smm, smn, start, L_q, L_k, scale, softcap, window,
                    CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, False,
                )  # fmt: skip
            else:
                s, t = _scores(
                    q, kt, offs_m, offs_n, Mask + b64 * smb + h64 * smh, smm, smn, start, L_q, L_k, scale, softcap, window,
                    CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, True,
                )  # fmt: skip
        else:
            s, t = _scores(
                q, kt, offs_m, offs_n, Mask + b64 * smb + h64 * smh, smm, smn, start, L_q, L_k, scale, softcap, window,
                CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, True,
            )  # fmt: skip
        p = tl.exp2(s * LOG2E - lse2[:, None])
        dv = _dot(tl.trans(p.to(do.dtype)), do, dv, PRECISION, INTERPRETED)
        dp = _dot(do, vt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION, INTERPRETED)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dk = _dot(tl.trans(ds.to(q.dtype)), q, dk, PRECISION, INTERPRETED)
    dk = dk * scale
    kv_msk = in_n[:, None] & in_d[None, :]
    tl.store(
        DK + b64 * sdkb + hk.to(tl.int64) * sdkh + offs_n[:, None].to(tl.int64) * sdkn + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_msk,
    )
    tl.store(
        DV + b64 * sdvb + hk.to(tl.int64) * sdvh + offs_n[:, None].to(tl.int64) * sdvn + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_msk,
    )


@triton.jit
def _dq_step(
    q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_d, in_d, mask_row_ptr, smm, smn,
    start, L_q, L_k, scale, softcap, window, dq,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """dQ's step over the key block [n0, n0 + BLOCK_N): dq + (p · (dO·Vᵀ − delta)) · K, unscaled."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_n = offs_n < L_k
    kt = _cols(k_base, offs_n, skn, offs_d, in_n, in_d)
    vt = _cols(v_base, offs_n, svn, offs_d, in_n, in_d)
    s, t = _scores(
        q, kt, offs_m, offs_n, mask_row_ptr, smm, smn, start, L_q, L_k, scale, softcap, window,
        CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, MASKED,
    )  # fmt: skip
    p = tl.exp2(s * LOG2E - lse2[:, None])
    dp = _dot(do, vt, tl.zeros([q.shape[0], BLOCK_N], tl.float32), PRECISION, INTERPRETED)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return _dot(ds.to(kt.dtype), tl.trans(kt), dq, PRECISION, INTERPRETED)


@triton.jit
def _attention_bwd_dq_kernel(
    Q,
    K,
    V,
    Mask,
    KeyStart,
    DO,
    Lse,
    Delta,
    DQ,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdb,
    sdh,
    sdm,
    smb,
    smh,
    smm,
    smn,
    sdqb,
    sdqh,
    sdqm,
    H,
    GROUP,
    L_q,
    L_k,
    D,
    scale,
    softcap,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    FULL_BLOCKS: tl.constexpr,
):
    """One program per (query block, batch, head): dQ over the key blocks of the forward's grid
    (FULL_BLOCKS: those every row sees whole first, unmasked)."""
    bh, b, h, hk, m0 = _query_program(H, GROUP, BLOCK_M)
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    in_m = offs_m < L_q
    q, do, offs_d, in_d, q_msk = _tile_pair(Q, sqb, sqh, sqm, DO, sdb, sdh, sdm, b64, h, offs_m, L_q, D, BLOCK_D)
    lse2 = tl.load(Lse + bh.to(tl.int64) * L_q + offs_m, mask=in_m, other=float("inf"))
    delta = tl.load(Delta + bh.to(tl.int64) * L_q + offs_m, mask=in_m, other=0.0)
    k_base = K + b64 * skb + hk.to(tl.int64) * skh
    v_base = V + b64 * svb + hk.to(tl.int64) * svh
    mask_row_ptr = Mask + b64 * smb + h.to(tl.int64) * smh
    start = tl.load(KeyStart + b)
    lo, hi = _key_range(start, m0, L_q, L_k, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if FULL_BLOCKS:  # the blocks every row sees whole first, unmasked (_full_end)
        full = _full_end(start, m0, L_k, BLOCK_N, CAUSAL)
        for n0 in range(lo, tl.minimum(hi, full), BLOCK_N):
            dq = _dq_step(
                q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_d, in_d, mask_row_ptr, smm, smn,
                start, L_q, L_k, scale, softcap, window, dq,
                BLOCK_N, CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, False,
            )  # fmt: skip
        lo = tl.maximum(lo, full)
    for n0 in range(lo, hi, BLOCK_N):
        dq = _dq_step(
            q, do, lse2, delta, k_base, v_base, skn, svn, n0, offs_m, offs_d, in_d, mask_row_ptr, smm, smn,
            start, L_q, L_k, scale, softcap, window, dq,
            BLOCK_N, CAUSAL, HAS_WINDOW, SOFTCAP, MASK_KIND, PRECISION, INTERPRETED, True,
        )  # fmt: skip
    dq = dq * scale
    # the address from this kernel's own arange, not _tile_pair's offs_d: torch's mutation analysis of
    # a traced launch walks a store's address back through the call that returned it, to Q and DO,
    # and took both as written (the failed inlined trace of issue 47.4; tests/_inline_trace.py)
    cols = tl.arange(0, BLOCK_D)
    tl.store(
        DQ + b64 * sdqb + h.to(tl.int64) * sdqh + offs_m[:, None].to(tl.int64) * sdqm + cols[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=q_msk,
    )
