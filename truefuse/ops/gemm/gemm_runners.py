"""The plain call's kept plans: the batch-invariant plan's host-time cut (docs/benchmarks.md,
"Batch-invariant mode").

For the common call that ``gemm_checks.validate`` accepts in its first step, the request
(``gemm_plan.request``), its plan and the call that runs it
are made once and kept, by the request's fields and :func:`plan_context` (:func:`plain_runner`):
for the batch-invariant Triton product that call is the very launch its backend makes
(``gemm_backends/triton.py::bi_launch``), for the ``torch`` backend's bare product the backend's
product in its scope, else ``gemm_exec.run`` of the plan. The entries in ``gemm.py`` run it.
"""

from __future__ import annotations

import torch

from truefuse.ops.gemm.gemm_exec import GemmArgs, run
from truefuse.ops.gemm.gemm_plan import GemmPlan, plan, plan_context, request


def plain_runner(a, b, odt, accumulate: bool, has_bias: bool, bi: bool):
    """The kept runner of the plain call's request (by :func:`plan_context` too)."""
    kind = a.device.type
    key = (kind, a.dtype, odt, accumulate, has_bias, bi, *plan_context(kind))
    runner = _RUNNERS.get(key)
    if runner is None:
        if len(_RUNNERS) >= _MAX_RUNNERS:
            _RUNNERS.clear()
        req = request(a, b, odt, accumulate, True if has_bias else None, None, None, False, False, False, bi)
        runner = _RUNNERS[key] = _runner(plan(req))
    return runner


def runs_bi_triton(a: torch.Tensor, b: torch.Tensor, has_bias: bool) -> bool:
    """Whether the plain batch-invariant call ``gemm(a, b[, bias])`` (2-D, a's dtype out, not
    accumulated) runs as ``gemm_backends/triton.py::bi_launch`` plus a split bias add: what a fused
    launch of several such products must reproduce (``integrations/huggingface/siblings.py``)."""
    runner = plain_runner(a, b, a.dtype, False, has_bias, True)
    return getattr(runner, "bi_launch", None) is a.dtype and a.shape[0] > 0 and b.shape[1] > 0


#: The plain call's runners, by its request's fields and :func:`plan_context` (what the plan
#: depends on): the request, the plan and its executor looked up per call cost ~25 µs of host time
#: on the 2-core CI box, where a decode-sized batch-invariant GEMM's kernel takes ~15 µs on an
#: H100 (experiments/host_time.py bi-stubbed; docs/benchmarks.md, "Batch-invariant mode")
_RUNNERS: dict[tuple, object] = {}
_MAX_RUNNERS = 4096


def _runner(chosen: GemmPlan):
    """The call that runs ``chosen`` for the plain call: ``run(chosen, ...)``, or for the
    batch-invariant Triton product with at most a split bias (the mode's every forward and input
    gradient on CUDA) the very launch ``gemm_backends/triton.py::product`` makes, without the
    executor's steps around it; the split bias is then added as ``gemm_exec._run_one`` adds it."""

    def general(a, b, out, odt, accumulate, bias):
        return run(chosen, GemmArgs(a, b, out, odt, accumulate, bias, None, None, None, None, None), None, False)

    if chosen.backend == "torch" and not chosen.split and set(chosen.fused) <= {"mm", "out_dtype"}:
        return _torch_mm_runner(chosen, general)
    if not (
        chosen.backend == "triton"
        and "batch_invariant" in chosen.fused
        and set(chosen.split) <= {"bias"}
        and "bias" not in chosen.fused
    ):
        return general
    from truefuse.ops.gemm.gemm_backends.triton import bi_launch

    def triton_bi(a, b, out, odt, accumulate, bias):
        if a.dtype is not chosen.compute_dtype or a.shape[0] == 0 or b.shape[1] == 0:
            return general(a, b, out, odt, accumulate, bias)
        if accumulate and (out.dtype is not a.dtype or bias is not None or "accumulate" not in chosen.fused):
            return general(a, b, out, odt, accumulate, bias)
        bi_launch(a, b, out, accumulate)  # accumulated: the running sum added in the epilogue (siblings' dx)
        if bias is not None:  # split (the plan fuses none): added as gemm_exec._run_one adds it
            out.add_(bias.to(out.dtype))
        return out

    triton_bi.bi_launch = chosen.compute_dtype  # runs_bi_triton: it launches bi_launch for inputs of this dtype
    return triton_bi


def _torch_mm_runner(chosen: GemmPlan, general):
    """The runner of a bare product on the ``torch`` backend (the weight gradient in every mode,
    fast mode's GEMMs): the backend's product in its scope, as ``gemm_exec.run`` calls it for such a
    plan, without the executor's steps between."""
    from truefuse.ops.gemm.gemm_backends import get_backend

    backend = get_backend("torch")
    product, scope, fused = backend.product, backend.scope, chosen.fused

    def torch_mm(a, b, out, odt, accumulate, bias):
        if accumulate or bias is not None or a.dtype is not chosen.compute_dtype:
            return general(a, b, out, odt, accumulate, bias)
        with scope(a.device):
            product(GemmArgs(a, b, out, odt, False, None, None, None, None, None, None), a, b, fused, out, False)
        return out

    return torch_mm
