"""The allreduce kernels' protocols on the CPU: W processes (ranks) share their "symmetric" buffers
and signal pads through shared memory and run the real kernel under Triton's interpreter, in
every variant: LL (data and flag in each word), 1-stage and 2-stage with per-program barriers,
pushing or pulling. Each rank sums in rank order, adds its own residual and norms. Three
consecutive calls exercise the alternating halves and the epoch. The interpreter runs one program
at a time and x86 keeps store order, so the PTX fences are left out there (kernels/allreduce.py);
on GPUs `verify --world-size N` checks the real thing.

fp32 and fp16 only: the interpreter truncates bf16 casts (docs/design.md §8)."""

import os
import time

import pytest
import torch
from _interpreter_speedup import forkserver

from truefuse.distributed.allreduce import ordered_sum
from truefuse.distributed.workspace import layout

_CALLS, _MAX_BYTES = 3, 16 << 10
_VARIANTS = {  # name: (LL, TWO_STAGE, PUSH)
    "ll": (True, False, True),
    "1stage_push": (False, False, True),
    "1stage_pull": (False, False, False),
    "2stage_push": (False, True, True),
    "2stage_pull": (False, True, False),
}


def _rank(r, W, cases, queue):
    """Rank r's kernel calls for every case of ``cases`` in turn (one spawn for all of them: a spawn
    costs ~2.7 s of the CI's 2 cores, the calls ~1-2 s); each case's buffers and pads are its own."""
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported in this process
    import triton
    from _interpreter_speedup import install

    install()  # conftest's interpreter speed-up, in this spawned process

    from truefuse.kernels.allreduce import _allreduce_add_rmsnorm_kernel
    from truefuse.ops.norm.norm_config import block_and_warps

    epochs = []
    try:
        for (variant, M, N, programs, _), (bufs, sigs, xs, res, w, outs, normed, rstds) in cases:
            half, ll_offset, _ = layout(W, _MAX_BYTES)
            buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)  # this process's mappings
            sig_ptrs = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64)
            epoch, done = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            block, warps = block_and_warps(N)
            ll, two_stage, push = _VARIANTS[variant]
            for c in range(_CALLS):
                # a different rank starts late each call: a reader that does not wait for its peers
                # (a broken barrier or flag) would read their rows before they are written
                time.sleep(0.3 * ((r + c) % W))
                _allreduce_add_rmsnorm_kernel[(programs,)](
                    xs[r][c],
                    res[r],
                    w,
                    outs[r][c],
                    normed[r][c],
                    buf_ptrs,
                    sig_ptrs,
                    epoch,
                    done,
                    half // xs[r].element_size(),
                    half // 8,
                    ll_offset // 8,
                    M,
                    N,
                    -(-M // W),
                    1e-6,
                    r,
                    W=W,
                    WP=triton.next_power_of_2(W),
                    MAXP=512,
                    HAS_RES=True,
                    HAS_NORM=True,
                    TWO_STAGE=two_stage,
                    PUSH=push,
                    LL=ll,
                    BLOCK_N=block,
                    INTERPRETED=True,
                    num_warps=warps,
                    # rstd on calls 0 and 2, none on call 1 (the launcher's choice: only when a gradient is wanted)
                    rstd_ptr=rstds[r][c] if rstds is not None and c != 1 else None,
                )
            epochs.append(int(epoch.item()))
        queue.put((r, None, epochs))
    except Exception:  # noqa: BLE001  (reported to the parent)
        import traceback

        queue.put((r, traceback.format_exc(), epochs))


def _bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _inputs(W, M, N, dtype, with_rstd):
    """One case's shared tensors: (bufs, sigs, xs, res, w, outs, normed, rstds)."""
    half, _, _ = layout(W, _MAX_BYTES)
    g = torch.Generator().manual_seed(W * 100 + M)
    shared = lambda t: t.share_memory_()  # noqa: E731
    bufs = [shared(torch.zeros(2 * half, dtype=torch.uint8)) for _ in range(W)]
    sigs = [shared(torch.zeros(2 * 512 * W, dtype=torch.int32)) for _ in range(W)]  # 2 regions × MAXP × W flags
    # new inputs every call: stale rows of an earlier call must not pass for this call's
    xs = [shared(torch.randn(_CALLS, M, N, generator=g).to(dtype)) for _ in range(W)]
    res = [shared(torch.randn(M, N, generator=g).to(dtype)) for _ in range(W)]  # each rank its own
    for t in xs + res:  # -0 everywhere in column 0: the sum must stay -0 (a sum from +0 gives +0)
        t[..., 0] = -0.0
    w = shared(torch.randn(N, generator=g).to(dtype))
    outs = [shared(torch.zeros(_CALLS, M, N, dtype=dtype)) for _ in range(W)]
    normed = [shared(torch.zeros(_CALLS, M, N, dtype=dtype)) for _ in range(W)]
    rstds = [shared(torch.full((_CALLS, M), -1.0)) for _ in range(W)] if with_rstd else None
    return bufs, sigs, xs, res, w, outs, normed, rstds


def _run(W, cases, with_rstd=False):
    """Every rank's _CALLS kernel calls for each case (variant, M, N, programs, dtype), ranks as W
    spawned processes: per case (xs, res, w, outs, normed, rstds), and the ranks' epochs per case."""
    data = [(case, _inputs(W, case[1], case[2], case[4], with_rstd)) for case in cases]
    ctx = forkserver()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, W, data, queue)) for r in range(W)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120 * len(cases)) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    failures = [err for _, err, _ in results if err]
    assert not failures, failures[0]
    for _, _, epochs in results:
        assert epochs == [_CALLS] * len(cases), epochs  # every call moved each case's epoch on once
    return [d[2:] for _, d in data]


_INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU interpreter path; GPUs run the real kernel in verify"
)


#: every variant in fp32 on the 3-rank shape; the 2-rank shape with a row width no block divides
#: (41) for one variant of each stage count; fp16 (its own loads, stores and LL word packing) on the
#: 3-rank shape for one variant of each kind. One spawn per world size: with a spawn per case (these
#: 11 and the rstd test's 3) the file took 78 s alone on the 2-core box, in three spawns 37 s
#: (a spawn of 3 ranks costs ~2.7 s). (variant, M, N, programs, dtype)
_CASES = {
    3: [
        *[(v, 7, 64, 2, torch.float32) for v in _VARIANTS],
        *[(v, 7, 64, 2, torch.float16) for v in ("ll", "1stage_push", "2stage_pull")],
    ],
    2: [(v, 5, 41, 2, torch.float32) for v in ("ll", "1stage_pull", "2stage_push")],
}


@_INTERPRETER_ONLY
@pytest.mark.parametrize("W", sorted(_CASES), ids=lambda w: f"{w}ranks")
def test_kernels_across_processes(W):
    from truefuse.autograd.norm import rms_norm

    for case, (xs, res, w, outs, normed, _) in zip(_CASES[W], _run(W, _CASES[W]), strict=True):
        dtype = case[-1]
        for c in range(_CALLS):
            total = ordered_sum([x[c] for x in xs])
            for r in range(W):
                assert torch.equal(_bits(outs[r][c]), _bits(total + res[r])), (case, c, r)  # bits: -0 is not +0
                want = rms_norm(outs[r][c], w, 1e-6)
                if dtype == torch.float32:  # truefuse.rms_norm runs the same Triton row code here: bitwise
                    assert torch.equal(normed[r][c], want), (case, c, r)
                else:  # the fp16 reference runs in PyTorch on the CPU: another summation order
                    torch.testing.assert_close(normed[r][c], want, rtol=1e-3, atol=1e-3, msg=str((case, c, r)))


_RSTD_CASES = [
    ("ll", 5, 41, 2, torch.float32),
    ("2stage_push", 5, 41, 2, torch.float32),
    ("1stage_pull", 5, 41, 2, torch.float16),
]


@_INTERPRETER_ONLY
def test_kernel_rstd_is_the_norm_forwards():
    """With ``rstd_ptr`` every rank stores each row's rstd: bitwise what the norm's own forward
    kernel (``ops.norm.norm_fwd``, what ``truefuse.rms_norm`` saves for its backward) gives on
    that rank's residual_out; without it (call 1) nothing is written and the outputs are unchanged."""
    from truefuse.ops.norm.norm import norm_fwd

    W = 2
    for case, (xs, res, w, outs, normed, rstds) in zip(_RSTD_CASES, _run(W, _RSTD_CASES, True), strict=True):
        for c in range(_CALLS):
            for r in range(W):
                want_normed, _, want_rstd = norm_fwd(outs[r][c], w, None, 1e-6, rms=True, zero_centered_gamma=False)
                assert torch.equal(_bits(outs[r][c]), _bits(ordered_sum([x[c] for x in xs]) + res[r])), (case, c, r)
                assert torch.equal(_bits(normed[r][c]), _bits(want_normed)), (case, c, r)
                if c == 1:
                    assert torch.all(rstds[r][c] == -1.0), (case, c, r)  # not written
                else:
                    assert torch.equal(_bits(rstds[r][c]), _bits(want_rstd)), (case, c, r)
