"""Where batch-invariant training spends its host time (issue 34): a BI training step of the demo's
model is host-bound on slower H100 hosts (wall 199 ms against 117 ms of GPU work, one profiled step,
docs/results/bi/bi_profile_train_h100_2026-11-27.txt), and ``LinearFunction``'s forward and backward
are most of that host time.

Measures, on the GPU, host µs per ``F.linear`` forward + backward (8192 × 2048 @ 2048², bf16; a
wall time until the last launch returned, over calls whose GPU work is queued: the host's cost) for
stock and for the routed batch-invariant call; then Python's profile (cProfile, by own time and
cumulative) of those calls and of one whole BI training step of the demo's model.

Run: ``PYTHONPATH=. python experiments/exp_bi_linear_host.py OUT_DIR`` (CUDA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def _host_us(fn) -> float:
    from exp_launch_host import host_time_us

    return host_time_us(fn, 30, warmup=5)


def main(out: Path) -> None:
    import exp_bi_speed as bs

    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    out.mkdir(parents=True, exist_ok=True)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 2048, **bf, requires_grad=True)
    w = torch.randn(2048, 2048, **bf, requires_grad=True)
    g = torch.randn(8192, 2048, **bf)

    def stock():
        F.linear(x, w).backward(g)
        x.grad = w.grad = None

    def bi():
        with running_batch_invariant():
            y = F.linear(x, w)
        y.backward(g)
        x.grad = w.grad = None

    from truefuse.kernels.gemm import _gemm_kernel
    from truefuse.ops.gemm_backends import triton as T

    out_t = torch.empty(8192, 2048, **bf)
    xd, wd = x.detach(), w.detach()
    tile = {**T._bi_meta(torch.bfloat16, 8192, "nt")}
    res = {
        "stock F.linear fwd+bwd": _host_us(stock),
        "BI F.linear fwd+bwd": _host_us(bi),
        "torch.mm": _host_us(lambda: torch.mm(xd, wd.t(), out=out_t)),
        "bi_launch (TMA kernel)": _host_us(lambda: T.bi_launch(xd, wd.t(), out_t)),
        "plain BI kernel launch": _host_us(
            lambda: T._launch(_gemm_kernel, T._bi_grid(8192, 2048, tile), xd, wd.t(), out_t, xd, out_t, False, 0, False, tile)
        ),
    }
    lines = [f"{k}: {v:.1f} us host" for k, v in res.items()]
    print("\n".join(lines), flush=True)
    text = ["\n".join(lines), bs._cprofile(lambda: [bi() for _ in range(30)], "BI F.linear fwd+bwd, 30 calls")]
    c = bs.CONFIGS["demo"]
    m = bs.variant(bs.build(c), "truefuse BI")
    m.train()
    ids = torch.randint(1, c["vocab"], (c["batch"], c["seq"]), device="cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    def step():
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    text.append(bs._cprofile(step, "one BI training step of the demo model", rows=45))
    (out / "bi_linear_host.txt").write_text("\n\n".join(text))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # exp_bi_speed, exp_launch_host
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bi_linear_host"))
