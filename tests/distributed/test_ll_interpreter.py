"""The LL allreduce kernel's protocol on the CPU: W processes (ranks) share their "symmetric"
buffers through shared memory and run the real kernel under Triton's interpreter. Each rank's
words reach its peers' buffers with the call's flag; the readers wait for them, sum in rank order,
add their own residual and norm. Three consecutive calls exercise the alternating halves and the
epoch. (The barrier kernels use a PTX fence the interpreter cannot run: they are checked on GPUs.)

fp32 and fp16 only: the interpreter truncates bf16 casts (DESIGN §8)."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from truefuse.distributed.symm import layout

_CALLS, _MAX_BYTES = 3, 16 << 10


def _rank(r, W, M, N, programs, bufs, sigs, xs, res, w, outs, normed, queue):
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported in this process
    from truefuse.kernels.allreduce import _allreduce_add_rmsnorm_kernel
    from truefuse.ops.norm import block_and_warps

    try:
        half, ll_offset, _ = layout(W, _MAX_BYTES)
        buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)  # this process's mappings
        sig_ptrs = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64)
        epoch, done = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        block, warps = block_and_warps(N)
        for _ in range(_CALLS):
            _allreduce_add_rmsnorm_kernel[(programs,)](
                xs[r], res[r], w, outs[r], normed[r], buf_ptrs, sig_ptrs, epoch, done,
                half // xs[r].element_size(), half // 8, ll_offset // 8, M, N, -(-M // W), 1e-6, r,
                W=W, MAXP=512, HAS_RES=True, HAS_NORM=True, TWO_STAGE=False, PUSH=True, LL=True, BLOCK_N=block,
                num_warps=warps,
            )  # fmt: skip
        queue.put((r, None, int(epoch.item())))
    except Exception:  # noqa: BLE001  (reported to the parent)
        import traceback

        queue.put((r, traceback.format_exc(), -1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter path; GPUs run the real kernel in verify")
@pytest.mark.parametrize("W, M, N, programs", [(2, 5, 41, 2), (3, 4, 64, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_ll_kernel_across_processes(W, M, N, programs, dtype):
    from truefuse.autograd.norm import rms_norm

    half, _, _ = layout(W, _MAX_BYTES)
    g = torch.Generator().manual_seed(W * 100 + M)
    shared = lambda t: t.share_memory_()  # noqa: E731
    bufs = [shared(torch.zeros(2 * half, dtype=torch.uint8)) for _ in range(W)]
    sigs = [shared(torch.zeros(64, dtype=torch.int32)) for _ in range(W)]
    xs = [shared(torch.randn(M, N, generator=g).to(dtype)) for _ in range(W)]
    res = [shared(torch.randn(M, N, generator=g).to(dtype)) for _ in range(W)]  # each rank its own
    w = shared(torch.randn(N, generator=g).to(dtype))
    outs = [shared(torch.zeros(M, N, dtype=dtype)) for _ in range(W)]
    normed = [shared(torch.zeros(M, N, dtype=dtype)) for _ in range(W)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (W, M, N, programs, bufs, sigs, xs, res, w, outs, normed, queue)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(W)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    failures = [err for _, err, _ in results if err]
    assert not failures, failures[0]
    assert all(ep == _CALLS for _, _, ep in results)  # every call moved the epoch on once

    acc = xs[0].to(torch.float32, copy=True)
    for x in xs[1:]:
        acc += x.float()
    total = acc.to(dtype)  # the ordered fp32 sum, rounded once
    for r in range(W):
        assert torch.equal(outs[r], total + res[r]), r
        want = rms_norm(outs[r], w, 1e-6)
        if dtype == torch.float32:  # truefuse.rms_norm runs the same Triton row code here: bitwise
            assert torch.equal(normed[r], want), r
        else:  # the fp16 reference runs in PyTorch on the CPU: another summation order
            torch.testing.assert_close(normed[r], want, rtol=1e-3, atol=1e-3)
