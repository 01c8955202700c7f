"""``python -m truefuse bench bi_gemm``: batch-invariant mode's GEMMs against cuBLAS (issue 34).

Llama-8B shapes, bf16, (K, N) = (4096, 4096), (4096, 14336), (14336, 4096); M = 8192 (prefill,
training) and 1, 2, 4, 8, 16, 32, 64 (decode):

* ``fwd``: ``y = x Wᵀ`` (M×K by N×K), ``dgrad``: ``dx = dy W`` (M×N by N×K). Providers ``cublas``
  (``torch.mm``, the reference) and ``bi`` (``truefuse.gemm(..., batch_invariant=True)``: the
  Triton GEMM with the mode's launch table, ``truefuse/ops/gemm/gemm_bi_config.py``);
* the decode points again under CUDA-graph replay (the kernels' own time: an eager decode call is
  bound by its launch's host time): ``bi_gemm_decode_graph`` with each call on the next of several
  operand copies (the weight from HBM, as in a model's decode step), ``bi_gemm_decode_graph_l2``
  with the same operands every call (a 4096² weight then stays in L2);
* ``wgrad``: ``dW = dyᵀ x`` at M = 8192. ``bi`` is what batch-invariant mode runs for a weight
  gradient (the plain plan: cuBLAS through ``truefuse.gemm``, the same bits run to run), and
  ``bi_triton`` the Triton GEMM with the mode's table.

``python -m truefuse.bench.bench_bi_gemm OUT_DIR`` also runs the bitwise checks of the same call
(rows of every M against the M = 8192 call, cuBLAS's for contrast; the weight gradient run to run;
every tile of the mode's table and of the autotuned set against the reference tile, bf16 and fp32,
forward and input gradient; the embedding's backward run to run; ``rms_norm_hf``'s rows), writing
JSON under OUT_DIR. The tiles' timings: ``experiments/exp_bi_gemm_tiles.py``.
"""

from __future__ import annotations

import json
import sys

import torch

from truefuse.bench.harness import Sweep, environment
from truefuse.ops.gemm.gemm import gemm

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


#: bytes of operands a rotating provider cycles through: over twice the H100's 50 MB L2, so each call
#: reads its weight from HBM, as a model's decode step does (one pass over every layer's weights)
ROTATE_BYTES = 128 * 2**20


def _provider(name: str, rotate: bool = False):
    def make(p, device):
        if not rotate:
            a, w, x = _operands(p, device)
            return _call(p, a, w, x, name)
        n = max(2, -(-ROTATE_BYTES // (2 * p["N"] * p["K"])))
        calls = [_call(p, *_operands(p, device), name) for _ in range(n)]
        turn = [0]

        def fn():  # under graph capture each captured call gets the next operands
            turn[0] = (turn[0] + 1) % n
            return calls[turn[0]]()

        return fn

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


def decode_graph_sweep(quick: bool, rotate: bool = True) -> Sweep:
    """The decode points (M = 1…64) under CUDA-graph replay: the kernels' own time, without the
    launch's host time that bounds an eager call of a few microseconds. ``rotate``
    (``bi_gemm_decode_graph``): each call takes the next of several operand copies (``ROTATE_BYTES``),
    so the weight comes from HBM as in a model; else (``bi_gemm_decode_graph_l2``) the same operands
    every call, a 4096 × 4096 weight (32 MB) then stays in the 50 MB L2."""
    shapes, ms = (((64, 96),), (1,)) if quick else (SHAPES, DECODE)
    return Sweep(
        name="bi_gemm_decode_graph" if rotate else "bi_gemm_decode_graph_l2",
        points=[{"form": f, "K": K, "N": N, "M": m} for K, N in shapes for f in ("fwd", "dgrad") for m in ms],
        providers={"cublas": _provider("cublas", rotate), "bi": _provider("bi", rotate)},
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
    """Every tile of batch-invariant mode's table (``ops/gemm/gemm_bi_config.py``), of the autotuned set
    and 16/32-row tiles (mma instead of wgmma) on the same 200 rows, forward and input gradient:
    whether each gives the reference tile's bits (``REFERENCE``, the mode's former one tile)."""
    import truefuse.ops.gemm.gemm_bi_config as bc
    from truefuse.ops.gemm.gemm_backends.triton import _configs, run_tiles

    cfgs = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in _configs(torch.bfloat16)}
    cfgs |= {(16, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (64, 256, 8, 3), *bc.entries("bf16")}
    res = {}
    for form in ("fwd", "dgrad"):
        a, w, _ = _operands({"form": form, "M": 200, "K": K, "N": N}, device)
        b = w.t() if form == "fwd" else w
        ref = run_tiles(a, b, bc.REFERENCE["bf16"])
        for t in sorted(cfgs):
            res[f"{form}_{t[0]}x{t[1]}w{t[2]}s{t[3]}"] = bool(torch.equal(run_tiles(a, b, t), ref))
    return res


def table_same_bits(device) -> dict:
    """Each bf16 and fp32 entry of the table against the reference tile, at M = 1, 40, 200."""
    import truefuse.ops.gemm.gemm_bi_config as bc
    from truefuse.ops.gemm.gemm_backends.triton import run_tiles

    res = {}
    for g, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        gen = torch.Generator(device=device).manual_seed(1)
        for M, K, N in ((1, 4096, 4096), (40, 1000, 3000), (200, 4096, 14336)):
            a = torch.randn(M, K, generator=gen, device=device, dtype=dtype)
            w = torch.randn(N, K, generator=gen, device=device, dtype=dtype)
            for form, b in (("fwd", w.t()), ("dgrad", w.t().contiguous())):
                ref = run_tiles(a, b, bc.REFERENCE[g])
                for t in bc.entries(g):
                    res[f"{g}_{form}_{M}x{K}x{N}_{t}"] = bool(torch.equal(run_tiles(a, b, t), ref))
    return res


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
    res["table_same_bits"] = table_same_bits(device)
    res["embedding_backward_run_to_run_equal"] = all(torch.equal(grads[0], g) for g in grads[1:])
    # rms_norm_hf's rows in batch-invariant mode (kernel statistics) and torch's statistics
    import truefuse
    from truefuse.ops.norm.norm import hf_rstd

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
    sweeps = [(sweep(False), False), (decode_graph_sweep(False), True), (decode_graph_sweep(False, False), True)]
    sweeps.append((wgrad_sweep(False), False))
    for sw, graph in sweeps:
        sw.run(device, cuda_graph=graph)
        sw.save(out, meta)
        sw.print()
    bad = [k for k, v in res["table_same_bits"].items() if not v]
    bad += [f"{s}:{k}" for s, d in res.items() if s.startswith("configs_same_bits") for k, v in d.items() if not v]
    print("tiles with other bits:", bad or "none")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench_results")
