"""The norm backward's weight- and bias-gradient column sums: ``out[n] = Σ_p part[p, n]`` over the
backward's (P, N) fp32 partial rows, rounded once to the parameter's dtype.

Two ways to run the same sum (the same bits, ``tests/test_norm.py``):

* ``kernels/norm.py::_sum_partials_kernel``: a second launch after the backward (any GPU, the CPU
  interpreter).
* ``fused_col_sums``: the backward's own epilogue (CUDA, Hopper): every program writes its partial
  row, meets the others at a grid-wide barrier, then sums a share of the column tiles. The launch
  must be cooperative (``launch_cooperative_grid=True``: all P programs co-resident, else the
  barrier would wait for a program that never starts). It saves the second kernel, but under PDL
  that kernel and its boundary cost about what the barrier and the epilogue cost: measured 1-5 µs
  slower at most sizes on an H200 (experiments/exp_norm_fused_sum.py), so ``ops/norm.py`` runs it
  only when asked (``norm_bwd(fused_sum=True)``, ``fused_sum_ok``).

Both sum a column tile with ``_col_sums``: BLOCK_P partial rows at a time into a (BLOCK_P, BLOCK_N)
fp32 accumulator, then its rows in a fixed pairwise tree (``_tree_rows``): the order is fixed by P
and BLOCK_P alone, so the two give the same bits at the same tile (``ops/norm.py::fused_sum_config``)
whatever their num_warps. (The sum kernel's own configurations reduce with ``tl.sum``, whose order
follows the register layout Triton picks: the same tile and warps in the epilogue gave other bits.)

The barrier (``grid_barrier``) needs no zeroing per call: a count and a generation word in a small
int32 workspace (``ops/norm.py::_barrier_slot``, one per device and stream). The last program to
arrive takes the count back to 0 and moves the generation on; the others wait for it to move. A
workspace must never serve two grids at once: two grids would mix their counts.
"""

import triton
import triton.language as tl

# polls before a waiting program gives up and traps (an error, not a hang): ~10 s at ~0.5 µs a poll,
# where the wait is a few µs; only a workspace shared by two running grids could get there
_SPIN_LIMIT = tl.constexpr(1 << 25)


@triton.jit
def _tree_rows(acc, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_N,) sums of a (BLOCK_P, BLOCK_N) tile's rows in a fixed pairwise order: row i plus
    row i + BLOCK_P / 2, then the same on the halved tile, down to one row. Written with reshape,
    permute and split (exact element moves), so the order is the program's, whatever register
    layout Triton picks (``tl.sum``'s order follows the layout: the same tile, warps and code
    measured other bits in the backward's epilogue than in its own kernel, 2026-11-23)."""
    if BLOCK_P == 1:
        out = tl.reshape(acc, (BLOCK_N,))
    else:
        H: tl.constexpr = BLOCK_P // 2
        a, b = tl.split(tl.permute(tl.reshape(acc, (2, H, BLOCK_N)), (1, 2, 0)))
        out = _tree_rows(a + b, H, BLOCK_N)
    return out


@triton.jit
def _col_sums(part_ptr, part2_ptr, P, N, cols, TWO: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
              TREE: tl.constexpr = False):  # fmt: skip
    """The fp32 column sums of rows [0, P) of the (P, N) ``part`` at ``cols`` (BLOCK_N columns; past N
    masked), and with TWO of ``part2`` too. Order: row p into accumulator row p % BLOCK_P in turn,
    then the accumulator's rows by ``_tree_rows`` (TREE: fixed by BLOCK_P alone) or ``tl.sum`` (fixed
    by BLOCK_P, BLOCK_N, num_warps and the kernel around it). TREE (the fused epilogue's order) also
    loads ``.cg`` (L2): there other SMs wrote the rows and L1 is not coherent."""
    CACHE: tl.constexpr = ".cg" if TREE else ""
    rows = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        r = p0 + rows
        mask = (r[:, None] < P) & (cols[None, :] < N)
        acc += tl.load(part_ptr + r[:, None] * N + cols[None, :], mask=mask, other=0.0, cache_modifier=CACHE)
        if TWO:
            acc2 += tl.load(part2_ptr + r[:, None] * N + cols[None, :], mask=mask, other=0.0, cache_modifier=CACHE)
    if TREE:
        return _tree_rows(acc, BLOCK_P, BLOCK_N), _tree_rows(acc2, BLOCK_P, BLOCK_N)
    return tl.sum(acc, axis=0), tl.sum(acc2, axis=0)


@triton.jit
def _fence_gpu(dep):
    """One ``fence.acq_rel.gpu`` in every thread (``dep``: any scalar, only an operand for the asm)."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _trap(dep):
    tl.inline_asm_elementwise("trap; mov.u32 $0, $1;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def grid_barrier(bar_ptr, P):
    """Every program of the (cooperative) grid waits here until all ``P`` have arrived; each one's
    global stores before the call are visible to every program after it.

    ``bar_ptr``: two int32 words, [count, generation], count 0 between calls (each call leaves it
    so). A scalar atomic is issued by one thread and its result broadcast to the program (Triton's
    lowering): that thread reads the generation, then counts itself in with a gpu-scope acq_rel
    add (after a CTA barrier: every thread's stores are issued first; release is cumulative). The
    last arrival takes the count back by P and moves the generation on (release); in the others one
    thread polls the generation (acquire) until it moves; then every thread fences."""
    cnt_ptr = bar_ptr
    gen_ptr = bar_ptr + 1
    tl.debug_barrier()
    gen = tl.atomic_add(gen_ptr, 0, sem="relaxed", scope="gpu")
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == P - 1:
        tl.atomic_add(cnt_ptr, -P, sem="relaxed", scope="gpu")
        tl.atomic_add(gen_ptr, 1, sem="release", scope="gpu")
    else:
        # one thread polls (a scalar atomic: the rest wait at the CTA barrier its broadcast takes);
        # every thread polling one word measured 5-11 µs slower at 8192 (4224 warps, 2026-11-23)
        polls = 0
        while (tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu") == gen) & (polls < _SPIN_LIMIT):
            polls += 1
        if polls >= _SPIN_LIMIT:
            _trap(polls)
    _fence_gpu(gen)
    tl.debug_barrier()


@triton.jit
def fused_col_sums(dw_part_ptr, db_part_ptr, dw_ptr, db_ptr, bar_ptr, N,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The epilogue of a norm backward launched cooperatively: after ``grid_barrier``, program p
    sums column tiles p, p + P, ... of the (P, N) fp32 partials (``dw_part`` with HAS_W, ``db_part``
    with HAS_B; P = the grid's programs, each having written its row before the call) into ``dw`` /
    ``db`` (N,), rounded once to their dtype: the bits of ``_sum_partials_kernel`` launched with the
    same BLOCK_P, BLOCK_N and TREE=True.

    Preconditions: a 1-D grid launched with ``launch_cooperative_grid=True``; every program calls
    this (a program with no rows too, after storing its zero partial row); ``bar_ptr`` two int32
    words of a workspace no other running grid uses, count 0 (``ops/norm.py::_barrier_slot``); not
    under the CPU interpreter (programs run one after another there: the first would wait forever)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    grid_barrier(bar_ptr, P)
    TWO: tl.constexpr = HAS_W and HAS_B
    first_ptr = dw_part_ptr if HAS_W else db_part_ptr
    for t in range(pid, tl.cdiv(N, BLOCK_N), P):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        s, s2 = _col_sums(first_ptr, db_part_ptr, P, N, cols, TWO, BLOCK_P, BLOCK_N, True)
        if HAS_W:
            tl.store(dw_ptr + cols, s.to(dw_ptr.dtype.element_ty), mask=cols < N)
            if HAS_B:
                tl.store(db_ptr + cols, s2.to(db_ptr.dtype.element_ty), mask=cols < N)
        else:
            tl.store(db_ptr + cols, s.to(db_ptr.dtype.element_ty), mask=cols < N)
