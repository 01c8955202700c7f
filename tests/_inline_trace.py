"""Run by tests/test_compile.py::test_inline_ops_trace_to_their_kernels in a process without
TRITON_INTERPRET (the interpreter's kernels cannot be traced, so the inline path is only
registered where Triton compiles): AOT autograd traces each inline op on CPU tensors, and this
prints, as JSON, per op, the truefuse ops left opaque in the graph and, per traced kernel launch,
its name and the kernel parameters the launch did not pass. No kernel runs: the graph is taken
at the compiler's entry."""

import json
import logging
import os
import warnings

os.environ.pop("TRITON_INTERPRET", None)
# without a GPU driver, the launch's mutation analysis fails and assumes every input is mutated (a
# warning): a Hopper target stands in for the driver below, so that the analysis reads each kernel
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)

import torch  # noqa: E402
from torch._functorch.aot_autograd import aot_function  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402

from truefuse.ops.gated_activation.gated_activation import gated2_bwd_op, gated2_fwd_op  # noqa: E402
from truefuse.ops.norm.norm import norm_bwd_op, norm_fwd_op, rms_norm_hf_fwd_op  # noqa: E402
from truefuse.ops.rope import rope_bwd_op, rope_fwd_op  # noqa: E402


class _Graph(Exception):
    pass


def _capture(gm, _inputs):
    raise _Graph(gm)


def _launches(f, *args) -> dict:
    try:
        aot_function(f, fw_compiler=_capture)(*args)
    except _Graph as g:
        gm = g.args[0]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    launches = []
    for n in calls:
        if "triton_kernel_wrapper" not in str(n.target):
            continue
        kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        while not hasattr(kernel, "params"):  # launch options come back as a one-config autotuner
            kernel = kernel.fn
        passed = set(n.kwargs["kwargs"]) | set(kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"]))
        launches.append([kernel.fn.__name__, [p.name for p in kernel.params if p.name not in passed]])
    return {"opaque": [str(n.target) for n in calls if "truefuse" in str(n.target)], "launches": launches}


def _dynamic_grids() -> list:
    """torch.compile(dynamic=True) of the norm's forward: the traced launch's grid follows the
    symbolic row count (a new sequence length reuses the graph): each launch's grid as strings."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm)
        raise _Graph(gm)

    f = torch.compile(
        lambda x, w: norm_fwd_op(x, w, None, 1e-6, True, False)[0], backend=aot_autograd(fw_compiler=capture), dynamic=True
    )
    try:
        f(torch.randn(8, 64), torch.randn(64))
    except Exception:  # noqa: BLE001 - the capture's stop, wrapped by Dynamo
        if not graphs:
            raise
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target)]
    return [[str(d) for d in n.kwargs["grid"][0]] for n in calls]


class _Hopper:
    """A driver that names a target and nothing else (the launches' mutation analysis asks only that)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def _attention_cases() -> dict:
    """Attention's kernel ops traced as if inline (registered here only: in the library they stay
    opaque until a GPU run confirms the trace, docs/design.md §6.7): forward with q, k and v leaves
    that require grad (the joint trace takes the backward op's body too; a kernel analysed as
    writing an input failed here writing back into the leaf), and the backward op."""
    from truefuse.ops._launch.custom_op import _inline_when_traced
    from truefuse.ops.attention.attention import attention_bwd_op, attention_fwd_op

    for op in (attention_fwd_op, attention_bwd_op):
        _inline_when_traced(op, op.body, None)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    ks, lse = torch.zeros(1, dtype=torch.int32), torch.rand(1, 4, 8)
    opts = (0.25, True, 0, 0.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return {
        "attention_fwd": (lambda q, k, v, ks: attention_fwd_op(q, k, v, None, ks, *opts)[0], (*leaves, ks)),
        "attention_bwd": (
            lambda do, q, k, v, o, lse, ks: attention_bwd_op(do, q, k, v, o, lse, None, ks, *opts),
            (q, q, k, v, q, lse, ks),
        ),
    }


def main() -> None:
    import triton

    triton.runtime.driver.set_active(_Hopper())
    x, w, rstd = torch.randn(8, 64), torch.randn(64), torch.rand(8)
    q, k, cos, sin = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    g, u = torch.randn(8, 32), torch.randn(8, 32)
    cases = {
        "norm_fwd": (lambda x, w: norm_fwd_op(x, w, None, 1e-6, True, False), (x, w)),
        "layer_norm_fwd": (lambda x, w: norm_fwd_op(x, w, w, 1e-5, False, False), (x, w)),
        "rms_norm_hf_fwd": (lambda x, w, r: rms_norm_hf_fwd_op(x, w, r, "llama"), (x, w, rstd)),
        "norm_bwd": (lambda dy, x, w, r: norm_bwd_op(dy, x, w, None, r.new_empty(0), r, True, False), (x, x, w, rstd)),
        "rope_fwd": (rope_fwd_op, (q, k, cos, sin)),
        "rope_bwd": (lambda dq, dk, c, s: rope_bwd_op(dq, dk, c, s, torch.float32, torch.float32), (q, k, cos, sin)),
        "gated2_fwd": (lambda g, u: gated2_fwd_op(g, u, "swiglu"), (g, u)),
        "gated2_bwd": (lambda d, g, u: gated2_bwd_op(d, g, u, "swiglu"), (g, g, u)),
        **_attention_cases(),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {name: _launches(f, *args) for name, (f, args) in cases.items()}
        out["dynamic_grids"] = _dynamic_grids()
        print(json.dumps(out))


if __name__ == "__main__":
    main()
