"""Which tile of batch-invariant mode's Triton GEMM is fastest per M bucket and form (issue 34)?

For each M bucket of ``truefuse/ops/gemm/gemm_bi_config.py`` (a representative M each: 16, 64, 256,
8192), each form (``fwd``: ``x Wᵀ``, B's K contiguous, table layout ``nt``; ``dgrad``: ``dy W``,
layout ``nn``) and the Llama-8B shapes (K, N) of ``bench_bi_gemm``: every candidate tile through
``truefuse.gemm(..., batch_invariant=True)`` (the table entry patched), timed against cuBLAS
``torch.mm`` (plain ``do_bench``; at M ≤ 64 also under a CUDA graph: the kernel without the
launch's host time), and its bits against the reference tile (128×128, 8 warps, 4 stages; fp32
64×64). The pick per (form, bucket): the lowest geometric mean of the ratios over the shapes among
the candidates bitwise equal at every shape. fp32: the forward at (4096, 4096) only, its pick used
for both layouts.

``python experiments/exp_bi_gemm_tiles.py OUT [--write]``: JSON and a table under OUT;
``--write`` rewrites the TABLE block of ``gemm_bi_config.py`` with the picks (copied to OUT too).
``--decode``: the two decode buckets (M ≤ 64), bf16 only; picks by the CUDA-graph ratios (the
kernels' own time: eager decode calls are bound by the launch's host time).
``--smoke``: tiny fp32 shapes under ``TRITON_INTERPRET=1`` on the CPU (the code paths only).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

import truefuse.ops.gemm.gemm_bi_config as bc
from truefuse.bench.harness import environment, measure
from truefuse.ops.gemm.gemm import gemm
from truefuse.ops.gemm.gemm_backends.triton import _BI_META, run_tiles

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N)
BUCKET_M = (16, 64, 256, 8192)
CANDS = {
    "bf16": (
        [
            (16, 16, 2, 6),
            (16, 16, 2, 8),
            (16, 16, 2, 10),
            (16, 16, 4, 6),
            (16, 16, 4, 8),
            (16, 16, 4, 10),
            (16, 32, 4, 6),
            (16, 32, 4, 8),
            (16, 32, 4, 10),
            (16, 64, 4, 4),
            (16, 64, 4, 6),
        ],
        [
            (16, 32, 4, 6),
            (32, 16, 4, 8),
            (32, 32, 4, 6),
            (64, 16, 4, 6),
            (64, 16, 4, 8),
            (64, 32, 4, 4),
            (64, 32, 4, 6),
            (64, 32, 4, 8),
            (64, 64, 4, 4),
            (64, 64, 4, 6),
        ],
        [(64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 4)],
        [(128, 128, 8, 4), (256, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 4)],
    ),
    "fp32": (
        [(64, 64, 4, 3), (16, 64, 4, 3), (32, 32, 4, 3)],
        [(64, 64, 4, 3), (32, 64, 4, 3), (64, 32, 4, 3)],
        [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3)],
        [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)],
    ),
}
#: buckets in the order swept (the prefill bucket first: a timeout keeps the picks made)
ORDER = (3, 0, 1, 2)
LAYOUT = {"fwd": "nt", "dgrad": "nn"}


def _operands(form, M, K, N, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(N, K, generator=g, device=device, dtype=dtype) * K**-0.5
    a = torch.randn(M, K if form == "fwd" else N, generator=g, device=device, dtype=dtype)
    return a, (w.t() if form == "fwd" else w)


def _gmean(rows) -> float:
    return math.exp(sum(math.log(r["ratio"]) for r in rows) / len(rows)) if rows else float("nan")


def sweep(
    g: str, forms, shapes, bucket_m, device, timing: dict, on_pick, order=ORDER, graph_pick: bool = False
) -> tuple[list[dict], dict]:
    dtype = torch.float32 if g == "fp32" else torch.bfloat16
    rows, picks = [], {}
    saved = dict(bc.TABLE)
    try:
        for bi, form in [(bi, form) for bi in order for form in forms]:
            key = (g, LAYOUT[form])
            M = bucket_m[bi]
            per_cand: dict = {}
            for K, N in shapes:
                a, b = _operands(form, M, K, N, dtype, device)
                ref_bits = run_tiles(a, b, bc.REFERENCE[g])
                cub = measure(lambda a=a, b=b: torch.mm(a, b), device, **timing).ms
                graph = M <= 64 and device.type == "cuda"
                cub_g = measure(lambda a=a, b=b: torch.mm(a, b), device, cuda_graph=True, **timing).ms if graph else None
                for t in CANDS[g][bi]:
                    tiles = list(bc.TABLE[key])
                    tiles[bi] = t
                    bc.TABLE[key] = tuple(tiles)
                    _BI_META.clear()  # the launcher keeps each bucket's tile after its first call
                    try:
                        same = bool(torch.equal(run_tiles(a, b, t), ref_bits))
                        fn = lambda a=a, b=b: gemm(a, b, batch_invariant=True)  # noqa: E731
                        ms = measure(fn, device, **timing).ms
                        ms_g = measure(fn, device, cuda_graph=True, **timing).ms if cub_g is not None else None
                    except Exception as e:  # a tile that does not compile or launch: no candidate
                        print(f"{g} {form} M {M} {t}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        per_cand.setdefault(t, []).append({"same_bits": False, "ratio": float("inf")})
                        continue
                    row = {"dtype": g, "form": form, "M": M, "K": K, "N": N, "tiles": list(t), "same_bits": same}
                    row.update(ms=ms, cublas_ms=cub, ratio=ms / cub, graph_ms=ms_g, cublas_graph_ms=cub_g)
                    row["graph_ratio"] = ms_g / cub_g if ms_g else None
                    rows.append(row)
                    per_cand.setdefault(t, []).append(row)
                    gr = f" graph x{row['graph_ratio']:.3f}" if ms_g else ""
                    bits = "=" if same else "DIFF"
                    print(f"{g} {form:>5} M {M:>5} K {K:>5} N {N:>5} {t!s:<18} bits {bits} x{row['ratio']:.3f}{gr}", flush=True)
                bc.TABLE[key] = saved[key]
                _BI_META.clear()
            if graph_pick and bi < 2:
                rs_of = {
                    t: [{"ratio": r["graph_ratio"] or r["ratio"], "same_bits": r["same_bits"]} for r in rs]
                    for t, rs in per_cand.items()
                }
            else:
                rs_of = per_cand
            ok = {t: _gmean(rs) for t, rs in rs_of.items() if all(r["same_bits"] for r in rs)}
            picks[(form, bi)] = min(ok, key=ok.get) if ok else bc.REFERENCE[g]
            on_pick(rows, {(g, form, bi): picks[(form, bi)]})
    finally:
        bc.TABLE.clear()
        bc.TABLE.update(saved)
        _BI_META.clear()
    return rows, picks


def write_table(picks: dict, path: Path) -> str:
    text = path.read_text()
    head, rest = text.split("# BEGIN TABLE\n")
    _, tail = rest.split("# END TABLE\n")
    table = dict(bc.TABLE)
    for (g, form, bi), t in picks.items():
        lay = LAYOUT[form]
        for k in [(g, lay)] if g == "bf16" else [(g, "nt"), (g, "nn")]:
            tiles = list(table[k])
            tiles[bi] = t
            table[k] = tuple(tiles)
    body = "".join(f'    ("{k[0]}", "{k[1]}"): {v!r},\n' for k, v in table.items())
    new = f"{head}# BEGIN TABLE\nTABLE = {{\n{body}}}\n# END TABLE\n{tail}"
    path.write_text(new)
    bc.TABLE.clear()
    bc.TABLE.update(table)
    _BI_META.clear()
    return new


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0] if args else "bi_tiles_results")
    out.mkdir(parents=True, exist_ok=True)
    smoke = "--smoke" in sys.argv
    if smoke:
        device, timing = torch.device("cpu"), {}
        CANDS["fp32"] = tuple([c[0]] for c in CANDS["fp32"])
        plan = [("fp32", ("fwd", "dgrad"), ((40, 48),), (3, 20, 40, 70))]
    else:
        device, timing = torch.device("cuda"), {"warmup_ms": 10, "rep_ms": 40}
        plan = [("bf16", ("fwd", "dgrad"), SHAPES, BUCKET_M), ("fp32", ("fwd",), ((4096, 4096),), BUCKET_M)]
    decode = "--decode" in sys.argv
    if decode:
        plan = plan[:1]
    meta = environment()
    all_rows: list = []
    picks: dict = {}

    def on_pick(rows, pick):
        picks.update(pick)
        done = all_rows + rows
        res = {"meta": meta, "rows": done, "picks": [[*k, list(v)] for k, v in picks.items()]}
        (out / "bi_tiles.json").write_text(json.dumps(res, indent=1))
        if "--write" in sys.argv:  # after each pick: a later timeout keeps the earlier ones
            (out / "gemm_bi_config.py").write_text(write_table(picks, Path(bc.__file__)))

    for g, forms, shapes, ms in plan:
        rows, _ = sweep(g, forms, shapes, ms, device, timing, on_pick, (0, 1) if decode else ORDER, graph_pick=decode)
        all_rows += rows
    print("\npicks (dtype, form, bucket -> tiles; ratio = geometric mean over the shapes):")
    for (g, form, bi), t in sorted(picks.items()):
        M = plan[0][3][bi]
        rs = [r for r in all_rows if (r["dtype"], r["form"], r["M"], tuple(r["tiles"])) == (g, form, M, tuple(t))]
        print(f"{g} {form:>5} M<={bc.M_BUCKETS[bi]!s:>5} (M={M}) {t!s:<18} x{_gmean(rs):.3f}")


if __name__ == "__main__":
    main()
