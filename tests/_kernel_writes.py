"""Run by tests/test_compile.py::test_torch_sees_each_kernel_write_only_its_outputs in a process
without TRITON_INTERPRET: torch's mutation analysis of a traced Triton launch (what ``wrap_triton``
and Inductor use to decide which arguments a kernel writes, and so which inputs a compiled graph
must treat as written) on each of truefuse's attention, norm, rope and gated-activation kernels.
The analysis reads the kernel's TTIR, which needs a GPU target: a Hopper one stands in for the
driver (no kernel is compiled to machine code or run). Prints, as JSON, per kernel launch, the
parameters the analysis says it writes."""

import json
import os
import warnings

os.environ.pop("TRITON_INTERPRET", None)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class _Hopper:
    """A driver that names a target and nothing else (the analysis asks only that)."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def main() -> None:
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    import truefuse.ops.attention.attention as attention
    import truefuse.ops.gated_activation.gated_activation as gated
    import truefuse.ops.norm.norm as norm
    import truefuse.ops.rope as rope

    triton.runtime.driver.set_active(_Hopper())
    writes: list = []

    def analysed(kernel, grid, *args, **kwargs):
        names = kernel.arg_names
        bound = {**dict(zip(names, args, strict=False)), **{n: v for n, v in kwargs.items() if n in names}}
        for p in kernel.params[len(args) :]:
            bound.setdefault(p.name, p.default)
        idx, cidx = tkw.kernel_side_table.add_kernel(kernel), tkw.kernel_side_table.add_constant_args({})
        writes.append([kernel.fn.__name__, sorted(tkw.get_mutated_tensors(idx, cidx, bound, {}))])

    for module in (attention, gated, norm, rope):
        module.fast_launch = analysed
    attention.sm_count = lambda i: 132  # an H100's: decode splits its keys
    bf = torch.bfloat16
    q, k, v = torch.randn(2, 16, 128, 128, dtype=bf), torch.randn(2, 8, 128, 128, dtype=bf), torch.randn(2, 8, 128, 128, dtype=bf)
    ks = torch.zeros(2, dtype=torch.int32)
    out, lse = attention.fwd_outputs(q)
    for launch in attention.fwd_launches(q, k, v, None, ks, out, lse, 0.088, True, 0, 0.0):
        analysed(launch[0], launch[1], *launch[2], **launch[3])
    qd, kd = torch.randn(2, 16, 1, 128, dtype=bf), torch.randn(2, 8, 2048, 128, dtype=bf)
    od, ld = attention.fwd_outputs(qd)
    mask = torch.ones(2, 1, 1, 2048, dtype=torch.bool).expand(2, 16, 1, 2048)
    for launch in attention.fwd_launches(qd, kd, kd, mask, ks, od, ld, 0.088, False, 0, 0.0):
        analysed(launch[0], launch[1], *launch[2], **launch[3])
    attention.attention_bwd_launch(torch.randn_like(out), q, k, v, out, lse, None, ks, 0.088, True, 0, 0.0)
    x, w = torch.randn(64, 1024, dtype=bf), torch.randn(1024, dtype=bf)
    y, _, rstd = norm.norm_fwd(x, w, None, 1e-6, rms=True, zero_centered_gamma=False)
    norm.norm_bwd(torch.randn_like(x), x, w, None, None, torch.rand(64), rms=True, zero_centered_gamma=False)
    g, u = torch.randn(64, 512, dtype=bf), torch.randn(64, 512, dtype=bf)
    gated.gated_fwd(g, "swiglu", u)
    gated.gated_bwd(torch.randn(64, 512, dtype=bf), g, "swiglu", up=u)
    cos, sin = torch.randn(1, 128, 128, dtype=bf), torch.randn(1, 128, 128, dtype=bf)
    rope.rope_launch(q, cos, sin, bf, backward=False)
    print(json.dumps(writes))


if __name__ == "__main__":
    main()
