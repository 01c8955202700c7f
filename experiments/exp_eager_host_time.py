"""Host time of a forward + backward of ``rms_norm_hf``, rope and the two-tensor gated activation:
through ``autograd/_eager_op.py`` (eager mode's plain autograd Function) against the same
``torch.library`` ops through the dispatcher, with every Triton launch stubbed to a no-op (CPU,
``TRITON_INTERPRET=1``): what the host spends around the kernels, no GPU needed. Minimum over 9
interleaved rounds of 100 calls, one thread.

Run: ``PYTHONPATH=. python experiments/exp_eager_host_time.py`` on the CPU.
"""

import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # before truefuse's kernels import: their launches are stubbed below


def main() -> None:
    import torch
    import triton.runtime.interpreter as interpreter

    import truefuse.autograd._eager_op as eager_op
    import truefuse.autograd.gated_activation as ag
    import truefuse.autograd.norm as an
    import truefuse.autograd.rope as ar

    interpreter.InterpretedFunction.run = lambda self, *a, **k: None  # host work only
    torch.set_num_threads(1)
    H = 256
    x, w = torch.randn(2, 32, H, requires_grad=True), torch.ones(H, requires_grad=True)
    q, k = torch.randn(2, 4, 32, 64, requires_grad=True), torch.randn(2, 2, 32, 64, requires_grad=True)
    cos, sin = torch.randn(2, 32, 64), torch.randn(2, 32, 64)
    g, u = torch.randn(64, 512, requires_grad=True), torch.randn(64, 512, requires_grad=True)

    def rope():  # q and k come from one op (one node): one backward for both
        outs = ar.apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    fns = {
        "rms_norm_hf": lambda: an.rms_norm_hf(x, w, 1e-6, style="llama").backward(torch.ones(2, 32, H)),
        "rope": rope,
        "gated2": lambda: ag.gated_activation(g, "swiglu", u).backward(torch.ones(64, 512)),
    }

    def dispatcher(op, *args):
        return op(*args)

    modes = {"eager": eager_op.call, "dispatcher": dispatcher}
    res: dict = {}
    for _ in range(9):
        for mode, call in modes.items():
            for m in (an, ar, ag):
                m.call = call
            for name, fn in fns.items():
                for _ in range(5):
                    fn()
                t = time.perf_counter()
                for _ in range(100):
                    fn()
                res.setdefault((name, mode), []).append((time.perf_counter() - t) / 100 * 1e6)
    for name in fns:
        e, d = min(res[name, "eager"]), min(res[name, "dispatcher"])
        print(f"{name:12s} eager {e:7.1f} us  dispatcher {d:7.1f} us  (saved {d - e:+.1f} us, {e / d:.2f}x)")


if __name__ == "__main__":
    main()
