"""``python -m truefuse bench bi_gemm``: batch-invariant mode's GEMMs against cuBLAS (issue 34).

Llama-8B shapes, bf16, (K, N) = (4096, 4096), (4096, 14336), (14336, 4096); M = 8192 (prefill,
training) and 1, 2, 4, 8, 16, 32, 64 (decode):

* ``fwd``: ``y = x Wᵀ`` (M×K by N×K), ``dgrad``: ``dx = dy W`` (M×N by N×K). Providers ``cublas``
  (``torch.mm``, the reference) and ``bi`` (``truefuse.gemm(..., batch_invariant=True)``: the
  Triton GEMM with its one configuration per dtype);
* ``wgrad``: ``dW = dyᵀ x`` at M = 8192. ``bi`` is what batch-invariant mode runs for a weight
  gradient (the plain plan: cuBLAS through ``truefuse.gemm``, the same bits run to run), and
  ``bi_triton`` the Triton GEMM with the fixed configuration.

``python -m truefuse.bench.bench_bi_gemm OUT_DIR`` also runs the bitwise checks of the same call
(rows of every M against the M = 8192 call, cuBLAS's for contrast; the weight gradient run to run;
every tile configuration of the autotuned set on the same rows; the embedding's backward run to
run; ``rms_norm_hf``'s rows) and times each candidate configuration, writing JSON under OUT_DIR.
"""

from __future__ import annotations

import json
import sys

import torch

from truefuse.bench.harness import Sweep, environment, measure
from truefuse.ops.gemm import gemm

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N)
DECODE = (1, 2, 4, 8, 16, 32, 64)


def _operands(p: dict, device):
    g = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    M, K, N = p["M"], p["K"], p["N"]
    w = torch.randn(N, K, generator=g, **bf) * K**-0.5
    a = torch.randn(M, K if p["form"] == "fwd" else N, generator=g, **bf)
    x = torch.randn(M, K, generator=g, **bf) if p["form"] == "wgrad" else None
    return a, w, x


def _call(p: dict, a, w, x, provider: str):
    form = p["form"]
    if form == "wgrad":
        if provider == "cublas":
            return lambda: torch.mm(a.t(), x)
        return lambda: gemm(a.t(), x, batch_invariant=provider == "bi_triton")
    b = w.t() if form == "fwd" else w
    if provider == "cublas":
        return lambda: torch.mm(a, b)
    return lambda: gemm(a, b, batch_invariant=True)


def _provider(name: str):
    def make(p, device):
        a, w, x = _operands(p, device)
        return _call(p, a, w, x, name)

    return make


def sweep(quick: bool) -> Sweep:
    """Forward and input gradient (``bi_gemm``)."""
    shapes, ms = (((64, 96),), (1, 40)) if quick else (SHAPES, (8192, *DECODE))
    return Sweep(
        name="bi_gemm",
        points=[{"form": f, "K": K, "N": N, "M": m} for K, N in shapes for f in ("fwd", "dgrad") for m in ms],
        providers={"cublas": _provider("cublas"), "bi": _provider("bi")},
        reference="cublas",
        x="M",
        flops=lambda p: 2.0 * p["M"] * p["N"] * p["K"],
    )


def wgrad_sweep(quick: bool) -> Sweep:
    """The weight gradient (``bi_gemm_wgrad``): what the mode runs, and the Triton GEMM."""
    shapes, m = (((64, 96),), 40) if quick else (SHAPES, 8192)
    return Sweep(
        name="bi_gemm_wgrad",
        points=[{"form": "wgrad", "K": K, "N": N, "M": m} for K, N in shapes],
        providers={"cublas": _provider("cublas"), "bi": _provider("bi"), "bi_triton": _provider("bi_triton")},
        reference="cublas",
        x="N",
        flops=lambda p: 2.0 * p["M"] * p["N"] * p["K"],
    )


# ---------------------------------------------------------------------------------------------
# bitwise checks and the configuration sweep (the GPU run: ``main``)


def _rows_differing(fn, a, ms=(*DECODE, 8192)) -> dict:
    """For each M: how many of the first M rows of ``fn(a[:M])`` differ from ``fn(a)``'s, plus rows
    of slices that start mid-batch (rows at other places in a tile)."""
    full = fn(a)
    out = {m: int((fn(a[:m]) != full[:m]).any(-1).sum()) for m in ms if m <= a.shape[0]}
    for start, m in ((5, 1), (77, 40), (1000, 300)):
        out[f"{start}+{m}"] = int((fn(a[start : start + m]) != full[start : start + m]).any(-1).sum())
    return out


def _configs_same_bits(K: int, N: int, device) -> dict:
    """Every tile configuration of the autotuned set (and 16/32-row tiles, which take mma instead of
    wgmma) on the same 64 rows: whether each gives the fixed configuration's bits."""
    import triton

    from truefuse.kernels.gemm import _gemm_kernel
    from truefuse.ops.gemm_backends.triton import _configs

    a, w, _ = _operands({"form": "fwd", "M": 200, "K": K, "N": N}, device)
    ref = gemm(a, w.t(), batch_invariant=True)
    cfgs = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in _configs(torch.bfloat16)]
    cfgs += [(16, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (64, 256, 8, 3)]
    res = {}
    for bm, bn, warps, stages in cfgs:
        out = torch.empty(200, N, device=device, dtype=torch.bfloat16)
        grid = (triton.cdiv(200, bm) * triton.cdiv(N, bn),)
        _gemm_kernel[grid](
            a, w.t(), out, a, out, 200, N, K, a.stride(0), a.stride(1), w.t().stride(0), w.t().stride(1),
            out.stride(0), out.stride(1), a.stride(0), a.stride(1), ACCUMULATE=False, GRAD_ACT=0, GRAD_BIAS=False,
            IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        res[f"{bm}x{bn}w{warps}s{stages}"] = bool(torch.equal(out, ref))
    return res


def _config_times(device) -> list[dict]:
    """Each candidate single configuration's time, forward, at M = 8192 and 16 (ms)."""
    from truefuse.ops.gemm_backends import triton as tb

    rows = []
    cands = [(128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4)]
    saved = dict(tb.BI_TILES)
    try:
        for cand in cands:
            tb.BI_TILES[torch.bfloat16] = cand
            tb._FIXED.clear()
            for K, N in SHAPES:
                for M in (8192, 16):
                    a, w, _ = _operands({"form": "fwd", "M": M, "K": K, "N": N}, device)
                    ms = measure(lambda a=a, w=w: gemm(a, w.t(), batch_invariant=True), device).ms
                    ref = measure(lambda a=a, w=w: torch.mm(a, w.t()), device).ms
                    rows.append({"tiles": "x".join(map(str, cand)), "K": K, "N": N, "M": M, "ms": ms, "ratio": ms / ref})
    finally:
        tb.BI_TILES.clear()
        tb.BI_TILES.update(saved)
        tb._FIXED.clear()
    return rows


def checks(device) -> dict:
    res: dict = {}
    for K, N in SHAPES:
        a, w, _ = _operands({"form": "fwd", "M": 8192, "K": K, "N": N}, device)
        dy, _, _ = _operands({"form": "dgrad", "M": 8192, "K": K, "N": N}, device)
        key = f"{K}x{N}"
        res[f"fwd_bi_{key}"] = _rows_differing(lambda t, w=w: gemm(t, w.t(), batch_invariant=True), a)
        res[f"fwd_cublas_{key}"] = _rows_differing(lambda t, w=w: torch.mm(t, w.t()), a)
        res[f"dgrad_bi_{key}"] = _rows_differing(lambda t, w=w: gemm(t, w, batch_invariant=True), dy)
        res[f"dgrad_cublas_{key}"] = _rows_differing(lambda t, w=w: torch.mm(t, w), dy)
        x = torch.randn_like(a)
        w1, w2 = gemm(dy.t(), x, batch_invariant=False), gemm(dy.t(), x, batch_invariant=False)
        mg1, mg2 = torch.zeros(N, K, device=device), torch.zeros(N, K, device=device)
        for mg in (mg1, mg2):
            for _ in range(2):
                gemm(dy.t(), x, out=mg, accumulate=True, batch_invariant=False)
        res[f"wgrad_run_to_run_equal_{key}"] = bool(torch.equal(w1, w2) and torch.equal(mg1, mg2))
        res[f"configs_same_bits_{key}"] = _configs_same_bits(K, N, device)
    # the embedding's backward (index_put with accumulate / embedding_dense_backward): run to run
    emb = torch.nn.Embedding(32000, 1024, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (8192,), device=device)  # many repeats of each row
    grads = []
    for _ in range(3):
        emb.weight.grad = None
        emb(ids).float().pow(2).sum().backward()
        grads.append(emb.weight.grad.clone())
    res["embedding_backward_run_to_run_equal"] = all(torch.equal(grads[0], g) for g in grads[1:])
    # rms_norm_hf's rows in batch-invariant mode (kernel statistics) and torch's statistics
    import truefuse
    from truefuse.ops.norm import hf_rstd

    for H in (1024, 4096):
        x = torch.randn(8192, H, device=device, dtype=torch.bfloat16)
        wt = torch.randn(H, device=device, dtype=torch.bfloat16)
        with truefuse.batch_invariant():
            res[f"rms_norm_hf_bi_{H}"] = _rows_differing(lambda t, wt=wt: truefuse.rms_norm_hf(t, wt, 1e-6), x)
        res[f"hf_rstd_torch_{H}"] = _rows_differing(lambda t: hf_rstd(t, 1e-6)[:, None], x)
    return res


def main(out_dir: str) -> None:
    from pathlib import Path

    device = torch.device("cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = environment()
    res = checks(device)
    (out / "bi_checks.json").write_text(json.dumps({"meta": meta, "checks": res}, indent=1))
    print(json.dumps(res))
    sweeps = [sweep(False), wgrad_sweep(False)]
    for sw in sweeps:
        sw.run(device)
        sw.save(out, meta)
        sw.print()
    cfg = _config_times(device)
    (out / "bi_configs.json").write_text(json.dumps({"meta": meta, "rows": cfg}, indent=1))
    for r in cfg:
        print(f"tiles {r['tiles']:<14} K {r['K']:>5} N {r['N']:>5} M {r['M']:>5} {r['ms']:.4f} ms  x{r['ratio']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench_results")
