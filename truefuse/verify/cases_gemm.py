"""Contract cases of ``truefuse.gemm`` (bounded against ``gemm_ref`` in float64, docs/design.md §1/§3).

Each case runs the planned GEMM, the same-dtype ``gemm_ref`` (the baseline) and ``gemm_ref`` on
float64 CPU copies (the reference), and reports every output the call returns. The split cases
play a platform without the fused path through ``override_capabilities``.
"""

from __future__ import annotations

import torch

from truefuse.config import batch_invariant
from truefuse.ops.gemm.gemm import GemmOutput, gemm, gemm_ref
from truefuse.ops.gemm.gemm_plan import Capability, override_capabilities
from truefuse.testing import bitwise_report, bounded_report
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sizes(device) -> tuple[int, int, int]:
    """(tokens, in_features, out_features): odd sizes on purpose (tails in every tile dimension).
    Smaller under the CPU interpreter, whose 32x32x16 tile (ops/gemm/gemm_backends/triton.py) they
    still split into several tiles with tails in every dimension (the weight gradient's M = 136:
    five row tiles, more than one GROUP_M group; N = 41: two column tiles; K = 150: ten K steps),
    at a seventh of the interpreted programs of the GPU's sizes."""
    return (333, 200, 136) if device.type == "cuda" else (150, 41, 136)


def _to64(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().double()
    return v


def check_gemm(a: torch.Tensor, b: torch.Tensor, *, return_result: bool = False, **kw):
    """Reports for every output of ``gemm(a, b, **kw)`` against ``gemm_ref`` (float64) with the
    same-dtype ``gemm_ref`` as the baseline. ``out`` in ``kw`` is cloned per run (never mutated).
    With ``return_result`` returns ``(reports, GemmOutput of the gemm call)``."""
    out0 = kw.pop("out", None)
    fresh = (lambda: {"out": out0.clone()}) if out0 is not None else (lambda: {})
    got = gemm(a, b, **kw, **fresh())
    base = gemm_ref(a, b, **kw, **fresh())
    kw64 = {k: _to64(v) for k, v in kw.items()}
    if kw.get("out_dtype") is not None:
        kw64["out_dtype"] = torch.float64
    if out0 is not None:
        kw64["out"] = _to64(out0)
    ref = gemm_ref(_to64(a), _to64(b), **kw64)
    as_tuple = lambda r: r if isinstance(r, GemmOutput) else GemmOutput(r, None, None)  # noqa: E731
    got, base, ref = as_tuple(got), as_tuple(base), as_tuple(ref)
    reports = {"out": bounded_report(got.out, ref.out, base.out)}
    if got.pre_activation is not None:
        reports["pre_activation"] = bounded_report(got.pre_activation, ref.pre_activation, base.pre_activation)
    if got.grad_bias is not None:
        reports["grad_bias"] = bounded_report(got.grad_bias, ref.grad_bias, base.grad_bias)
    return (reports, got) if return_result else reports


def _inputs(device, dtype, seed=0):
    m, k, n = _sizes(torch.device(device))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    pre = torch.randn(m, n, generator=g).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    main_grad = torch.randn(n, k, generator=g).to(device, torch.float32)
    return x, w, dy, pre, bias, main_grad


def _register_dtype(tag: str, dtype: torch.dtype) -> None:
    @register("gemm", f"fwd_bias_gelu_{tag}", "bounded")
    def _fwd(device):
        x, w, _, _, bias, _ = _inputs(device, dtype)
        return check_gemm(x, w.t(), bias=bias, activation="gelu", return_pre_activation=True)

    @register("gemm", f"dgrad_{tag}", "bounded")
    def _dgrad(device):
        _, w, dy, _, _, _ = _inputs(device, dtype)
        return check_gemm(dy, w)

    @register("gemm", f"wgrad_accumulate_fp32_{tag}", "bounded")
    def _wgrad(device):
        x, _, dy, _, _, mg = _inputs(device, dtype)
        return check_gemm(dy.t(), x, out=mg, accumulate=True)

    for act in (None, "gelu"):
        suffix = "" if act is None else f"_d{act}"
        extra = {} if act is None else {"grad_activation": act}

        @register("gemm", f"wgrad_accumulate_fp32_bgrad{suffix}_{tag}", "bounded")
        def _wgrad_bgrad(device, extra=extra):
            x, _, dy, pre, _, mg = _inputs(device, dtype)
            kw = dict(extra, pre_activation=pre.t()) if extra else {}
            return check_gemm(dy.t(), x, out=mg, accumulate=True, grad_bias=True, **kw)

        @register("gemm", f"wgrad_accumulate_fp32_bgrad{suffix}_triton_first_{tag}", "bounded")
        def _wgrad_bgrad_triton(device, extra=extra):
            # the fused Triton epilogue where it runs (CUDA; fp32 under the CPU interpreter)
            x, _, dy, pre, _, mg = _inputs(device, dtype)
            kw = dict(extra, pre_activation=pre.t()) if extra else {}
            with override_capabilities(backends=["triton", "torch"]):
                return check_gemm(dy.t(), x, out=mg, accumulate=True, grad_bias=True, **kw)

        @register("gemm", f"wgrad_bgrad{suffix}_split_{tag}", "bounded")
        def _wgrad_bgrad_split(device, extra=extra):
            # a platform with no fused bias-gradient (or activation derivative) for fp32 output
            x, _, dy, pre, _, mg = _inputs(device, dtype)
            kw = dict(extra, pre_activation=pre.t()) if extra else {}
            off = [Capability("grad_bias", out_dtype=torch.float32), Capability("grad_activation", out_dtype=torch.float32)]
            with override_capabilities(remove=off):
                return check_gemm(dy.t(), x, out=mg, accumulate=True, grad_bias=True, **kw)


for _tag, _dt in _DTYPES.items():
    _register_dtype(_tag, _dt)


@register("gemm", "grouped_rows_bf16", "bounded")
def _grouped_rows(device):
    g = torch.Generator().manual_seed(1)
    splits = [64, 0, 1, 200, 31]
    x = torch.randn(sum(splits), 128, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(len(splits), 128, 96, generator=g) / 128**0.5).to(device, torch.bfloat16)
    return check_gemm(x, w, m_splits=splits, out_dtype=torch.float32)


@register("gemm", "grouped_wgrad_accumulate_fp32_bgrad_bf16", "bounded")
def _grouped_wgrad(device):
    g = torch.Generator().manual_seed(2)
    splits = [64, 0, 1, 200, 31]
    dy = torch.randn(sum(splits), 96, generator=g).to(device, torch.bfloat16)
    x = torch.randn(sum(splits), 128, generator=g).to(device, torch.bfloat16)
    mg = torch.randn(len(splits), 96, 128, generator=g).to(device)
    return check_gemm(dy.t(), x, out=mg, accumulate=True, grad_bias=True, m_splits=splits)


def batch_invariant_case(dtype: torch.dtype, device: torch.device) -> dict:
    """Batch-invariant mode (docs/design.md §1): the forward's and the input gradient's rows of
    M = 1, 3, 64 and of a slice from mid-batch equal the same rows of the whole call (M = 333 on a GPU, 150 on the CPU), bit
    for bit; the weight gradient (the mode's plain plan) and its fp32 ``main_grad`` accumulation give
    the same bits twice."""
    x, w, dy, _, bias, mg = _inputs(device, dtype, seed=3)
    reports = {}
    with batch_invariant():
        for form, a, b, kw in (("fwd", x, w.t(), {"bias": bias}), ("dgrad", dy, w, {})):
            whole = gemm(a, b, **kw)
            for rows in (slice(0, 1), slice(0, 3), slice(0, 64), slice(100, 140)):
                reports[f"{form}/rows_{rows.start}_{rows.stop}"] = bitwise_report(gemm(a[rows], b, **kw), whole[rows])
        dw = [gemm(dy.t(), x, batch_invariant=False) for _ in range(2)]
        acc = [gemm(dy.t(), x, out=mg.clone(), accumulate=True, batch_invariant=False) for _ in range(2)]
    reports["wgrad/run_to_run"] = bitwise_report(dw[1], dw[0])
    reports["wgrad_main_grad/run_to_run"] = bitwise_report(acc[1], acc[0])
    return reports


for _tag, _dt in _DTYPES.items():
    register("gemm", f"batch_invariant_{_tag}", "bitwise")(lambda device, dt=_dt: batch_invariant_case(dt, device))
