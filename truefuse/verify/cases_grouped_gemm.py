"""Contract cases of the batch-invariant grouped GEMM (``truefuse/ops/grouped_gemm/grouped_gemm.py``,
docs/design.md §1 "Grouped GEMM"):

* ``bounded_<dtype>``: forward with bias, input gradient, weight gradient (written, and accumulated
  into an fp32 ``main_grad``) and bias gradient, bounded against one GEMM per group (float64
  reference, the same-dtype per-group ``F.linear``/matmul as the baseline), with an empty and a
  one-row group.
* ``batch_invariant_<dtype>``: bitwise, each expert's output rows, input-gradient rows, dW_g and
  db_g equal those of the whole batch when the experts are permuted, when tokens move between the
  other experts, when the expert runs alone, and when the batch is split in two.

fp32 runs on the CPU under ``TRITON_INTERPRET=1`` (no rows without it) and on CUDA; fp16/bf16 on CUDA.
"""

from __future__ import annotations

import torch

from truefuse.ops.grouped_gemm.grouped_gemm import (
    grouped_bias_grad,
    grouped_gemm_available,
    grouped_gemm_ref,
    grouped_gemm_wgrad_ref,
    grouped_mm_rows,
    grouped_mm_wgrad,
    split_offsets,
)
from truefuse.testing import bitwise_report, bounded_report
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _shape(device: torch.device) -> tuple[int, int, list[int]]:
    """(K, N, splits): small under the interpreter, several tiles and ragged edges on CUDA."""
    if device.type == "cuda":
        return 320, 200, [130, 0, 1, 257, 64, 3]
    return 24, 20, [5, 0, 1, 19, 3]


def _rand(shape, seed, device, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _slices(splits):
    start = 0
    for m in splits:
        yield slice(start, start + m)
        start += m


def _run(x, w, b, dy, splits):
    off = split_offsets(splits, len(splits), x.shape[0], x.device)
    return {
        "y": grouped_mm_rows(x, w, off, transpose_w=True, bias=b),
        "dx": grouped_mm_rows(dy, w, off, transpose_w=False),
        "dW": grouped_mm_wgrad(dy, x, off),
        "db": grouped_bias_grad(dy, off),
    }


def _ref(x, w, b, dy, splits):
    return {
        "y": grouped_gemm_ref(x, w, splits, bias=b),
        "dx": grouped_gemm_ref(dy, w, splits, transpose_w=False),
        "dW": grouped_gemm_wgrad_ref(dy, x, splits),
        "db": torch.stack(
            [dy[s].sum(0, dtype=torch.promote_types(dy.dtype, torch.float32)).to(dy.dtype) for s in _slices(splits)]
        ),
    }


def bounded_case(dtype: torch.dtype, device: torch.device) -> dict:
    if not grouped_gemm_available(device, dtype):
        return {}
    K, N, splits = _shape(device)
    G, M = len(splits), sum(splits)
    x, dy = _rand((M, K), 0, device, dtype), _rand((M, N), 1, device, dtype)
    w, b = _rand((G, N, K), 2, device, dtype), _rand((G, N), 3, device, dtype)
    got, base = _run(x, w, b, dy, splits), _ref(x, w, b, dy, splits)
    ref64 = _ref(*(t.cpu().double() for t in (x, w, b, dy)), splits)
    reports = {k: bounded_report(got[k], ref64[k], base[k]) for k in got}
    start = _rand((G, N, K), 4, device, torch.float32)
    mg = start.clone()
    grouped_mm_wgrad(dy, x, split_offsets(splits, G, M, device), out=mg, accumulate=True)
    reports["dW_main_grad"] = bounded_report(mg, start.cpu().double() + ref64["dW"], start + base["dW"].float())
    return reports


def _pieces(sizes, K, N, device, dtype, seed):
    return [
        tuple(_rand(s, seed + 4 * g + i, device, dtype) for i, s in enumerate(((m, K), (m, N), (N, K), (N,))))
        for g, m in enumerate(sizes)
    ]


def _batch(parts, sizes):
    x = torch.cat([p[0] for p in parts])
    dy = torch.cat([p[1] for p in parts])
    return _run(x, torch.stack([p[2] for p in parts]), torch.stack([p[3] for p in parts]), dy, sizes)


def _group(outs, splits, g):
    s = list(_slices(splits))[g]
    return {"y": outs["y"][s], "dx": outs["dx"][s], "dW": outs["dW"][g], "db": outs["db"][g]}


def invariance_case(dtype: torch.dtype, device: torch.device) -> dict:
    if not grouped_gemm_available(device, dtype):
        return {}
    K, N, splits = _shape(device)
    G = len(splits)
    parts = _pieces(splits, K, N, device, dtype, seed=10)
    whole = _batch(parts, splits)
    variants = {}  # label -> list of (outputs, splits, group in them, group in the whole batch)
    perm = list(reversed(range(G)))
    p_splits = [splits[i] for i in perm]
    variants["permuted"] = [(_batch([parts[i] for i in perm], p_splits), p_splits, new, old) for new, old in enumerate(perm)]
    g = max(range(G), key=lambda i: splits[i])  # the largest group keeps its rows
    others = [(3 * m + 17) % 41 if i != g else m for i, m in enumerate(splits)]
    moved = _pieces(others, K, N, device, dtype, seed=99)
    moved[g] = parts[g]
    variants["other_sizes"] = [(_batch(moved, others), others, g, g)]
    variants["alone"] = [(_batch([parts[i]], [splits[i]]), [splits[i]], 0, i) for i in range(G)]
    halves = []
    for half in (set(range(0, G, 2)), set(range(1, G, 2))):
        sizes = [m if i in half else 0 for i, m in enumerate(splits)]
        sub = [parts[i] if i in half else (parts[i][0][:0], parts[i][1][:0], parts[i][2], parts[i][3]) for i in range(G)]
        outs = _batch(sub, sizes)
        halves += [(outs, sizes, i, i) for i in sorted(half)]
    variants["split_in_two"] = halves
    reports = {}
    for label, runs in variants.items():
        for key in ("y", "dx", "dW", "db"):
            got = torch.cat([_group(o, s, gi)[key].reshape(-1) for o, s, gi, _ in runs])
            want = torch.cat([_group(whole, splits, gw)[key].reshape(-1) for _, _, _, gw in runs])
            reports[f"{label}/{key}"] = bitwise_report(got, want)
    return reports


for _dn, _dt in _DTYPES.items():
    _devices = ("cpu", "cuda") if _dt == torch.float32 else ("cuda",)
    register("grouped_gemm", f"bounded_{_dn}", "bounded", _devices)(lambda device, dt=_dt: bounded_case(dt, device))
    register("grouped_gemm", f"batch_invariant_{_dn}", "bitwise", _devices)(lambda device, dt=_dt: invariance_case(dt, device))
