"""Issue 16: tile-configuration sweep of the batch-invariant grouped GEMM, per GEMM of GroupedMLP.

Run on the H200: ``PYTHONPATH=. python experiments/exp_grouped_gemm_tune.py [--out DIR] [--cases a,b] [--set full|mini]``.

For each case of ``truefuse bench grouped`` (8 × 2048 h4096 f14336, 64 × 256 h2048 f1408,
128 × 128 h2048 f768; uniform routing, bf16) and each of its GEMMs (fc1/fc2 forward, fc2/fc1 input
gradient, fc2/fc1 weight gradient written in bf16 and accumulated into an fp32 main_grad), the time
of cuBLAS ``grouped_mm`` (through ``truefuse.gemm``, the bench's floor) and of the Triton kernels
under each candidate :class:`TileConfig` (``rows`` for forward/dgrad, ``wgrad`` for the weight
gradient), as a ratio to cuBLAS. Last: per config, the sum over the cases' GEMMs of that kind
(one configuration per kind and dtype: the contract), and which is best.

Every candidate is checked first against the current default configuration's output (bounded:
bits differ between tile shapes, but not by more than a few bf16 ulps at fp32 accumulation).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import truefuse.ops.grouped_gemm.grouped_gemm as gg
import truefuse.ops.grouped_gemm.grouped_gemm_config as ggc
from truefuse.ops.gemm.gemm import gemm

T = ggc.TileConfig

ROWS = {
    "ptr128x128x64w8s3p2": T(128, 128, 64, 8, 3, 2, tma=False),
    "tma128x128x64w8s3p1": T(128, 128, 64, 8, 3, 1, tma=True),
    "tma128x128x64w8s3p2": T(128, 128, 64, 8, 3, 2, tma=True),
    "tma128x128x64w8s4p1": T(128, 128, 64, 8, 4, 1, tma=True),
    "tma128x128x64w4s4p1": T(128, 128, 64, 4, 4, 1, tma=True),
    "tma128x256x64w8s3p1": T(128, 256, 64, 8, 3, 1, tma=True),
    "tma128x256x64w8s4p1": T(128, 256, 64, 8, 4, 1, tma=True),
    "tma64x128x64w4s4p2": T(64, 128, 64, 4, 4, 2, tma=True),
    "tma128x128x128w8s3p1": T(128, 128, 128, 8, 3, 1, tma=True),
    "tma128x128x64w8s3p0": T(128, 128, 64, 8, 3, 0, tma=True),
}
WGRAD = {  # block_m: rows reduced per step; (block_n, block_k): the dW tile
    "ptr64|128x128w8s3p1": T(64, 128, 128, 8, 3, 1, tma=False),
    "tma64|128x128w8s3p1": T(64, 128, 128, 8, 3, 1, tma=True),
    "tma64|128x128w8s3p2": T(64, 128, 128, 8, 3, 2, tma=True),
    "tma64|128x128w8s4p1": T(64, 128, 128, 8, 4, 1, tma=True),
    "tma64|128x128w4s4p1": T(64, 128, 128, 4, 4, 1, tma=True),
    "tma64|128x256w8s3p1": T(64, 128, 256, 8, 3, 1, tma=True),
    "tma64|256x128w8s3p1": T(64, 256, 128, 8, 3, 1, tma=True),
    "tma128|128x128w8s2p1": T(128, 128, 128, 8, 2, 1, tma=True),
    "tma64|128x128w8s3p0": T(64, 128, 128, 8, 3, 0, tma=True),
    "tma32|128x128w4s4p2": T(32, 128, 128, 4, 4, 2, tma=True),
}

#: ``--set mini``: the wgrad candidates around the committed defaults (the first of each size), with
#: the output through a TMA descriptor in 1, 2 or 4 column parts (``eN``; the same bits).
WGRAD_MINI = {
    "tma64|128x128w8s3p2": T(64, 128, 128, 8, 3, 2, tma=True),
    "tma64|128x128w8s3p2e1": T(64, 128, 128, 8, 3, 2, tma=True, tma_epilogue=True),
    "tma64|128x128w8s3p2e2": T(64, 128, 128, 8, 3, 2, tma=True, tma_epilogue=True, epilogue_split=2),
    "tma64|128x128w8s2p2e2": T(64, 128, 128, 8, 2, 2, tma=True, tma_epilogue=True, epilogue_split=2),
    "tma128|128x128w8s2p1e2": T(128, 128, 128, 8, 2, 1, tma=True, tma_epilogue=True, epilogue_split=2),
    "tma64|128x256w8s3p1": T(64, 128, 256, 8, 3, 1, tma=True),
    "tma64|128x256w8s3p1e1": T(64, 128, 256, 8, 3, 1, tma=True, tma_epilogue=True),
    "tma64|128x256w8s3p1e2": T(64, 128, 256, 8, 3, 1, tma=True, tma_epilogue=True, epilogue_split=2),
    "tma64|128x256w8s3p1e4": T(64, 128, 256, 8, 3, 1, tma=True, tma_epilogue=True, epilogue_split=4),
    "tma64|256x128w8s3p1e2": T(64, 256, 128, 8, 3, 1, tma=True, tma_epilogue=True, epilogue_split=2),
}

#: ``--set mini``: the forward/dgrad candidates for the small-expert layers (the committed one first).
ROWS_MINI = {
    "tma128x256x64w8s4p1": T(128, 256, 64, 8, 4, 1, tma=True),
    "tma128x128x64w8s4p1": T(128, 128, 64, 8, 4, 1, tma=True),
    "tma128x128x64w8s3p2": T(128, 128, 64, 8, 3, 2, tma=True),
}

CASES = {
    "8x2048": dict(E=8, tokens=2048, H=4096, F=14336),
    "64x256": dict(E=64, tokens=256, H=2048, F=1408),
    "128x128": dict(E=128, tokens=128, H=2048, F=768),
}


def _bench(fn, rep=60):
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=15, rep=rep, return_mode="median"))


def _rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(name, p, dev, log):
    E, H, Fd, tok = p["E"], p["H"], p["F"], p["tokens"]
    M = E * tok
    s = [tok] * E
    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*sh):
        return torch.randn(*sh, generator=g, device=dev, dtype=bf) * 0.5

    x, w1, w2 = r(M, H), r(E, 2 * Fd, H), r(E, H, Fd)
    a, dy, h = r(M, Fd), r(M, H), r(M, 2 * Fd)
    off = gg.split_offsets(s, E, M, dev)
    # (label, kind, cuBLAS fn, triton fn(cfg), flops)
    gemms = [
        (
            "fwd fc1",
            "rows",
            lambda: gemm(x, w1.transpose(1, 2), m_splits=s),
            lambda c, o: gg._launch_rows(x, w1, off, None, True, o, c),
            (M, 2 * Fd),
            2 * M * H * 2 * Fd,
        ),
        (
            "fwd fc2",
            "rows",
            lambda: gemm(a, w2.transpose(1, 2), m_splits=s),
            lambda c, o: gg._launch_rows(a, w2, off, None, True, o, c),
            (M, H),
            2 * M * Fd * H,
        ),
        (
            "dgrad fc2",
            "rows",
            lambda: gemm(dy, w2, m_splits=s),
            lambda c, o: gg._launch_rows(dy, w2, off, None, False, o, c),
            (M, Fd),
            2 * M * Fd * H,
        ),
        (
            "dgrad fc1",
            "rows",
            lambda: gemm(h, w1, m_splits=s),
            lambda c, o: gg._launch_rows(h, w1, off, None, False, o, c),
            (M, H),
            2 * M * H * 2 * Fd,
        ),
        (
            "wgrad fc2",
            "wgrad",
            lambda: gemm(dy.t(), a, m_splits=s),
            lambda c, o: gg._launch_wgrad(dy, a, off, o, False, c),
            (E, H, Fd),
            2 * M * Fd * H,
        ),
        (
            "wgrad fc1",
            "wgrad",
            lambda: gemm(h.t(), x, m_splits=s),
            lambda c, o: gg._launch_wgrad(h, x, off, o, False, c),
            (E, 2 * Fd, H),
            2 * M * H * 2 * Fd,
        ),
    ]
    mgs = {}
    results = []
    for label, kind, cub, tri, oshape, flops in gemms:
        cfgs = ROWS if kind == "rows" else WGRAD
        if not cfgs:
            continue
        t_cub = _bench(cub)
        ref = cub()
        row = {"case": name, "gemm": label, "cublas_ms": t_cub, "tflops_cublas": flops / t_cub / 1e9, "cfg": {}}
        for cname, cfg in cfgs.items():
            out = torch.empty(oshape, device=dev, dtype=bf)
            try:
                tri(cfg, out)
                torch.cuda.synchronize()
                err = _rel(out, ref)
                t = _bench(lambda: tri(cfg, out))  # noqa: B023
                row["cfg"][cname] = {"ms": t, "ratio": t / t_cub, "err": err}
            except Exception as e:  # noqa: BLE001
                row["cfg"][cname] = {"ms": float("nan"), "ratio": float("nan"), "err": repr(e)[:200]}
        results.append(row)
        log(row)
        if kind == "wgrad":  # into an fp32 main_grad (beta=1), vs cuBLAS writing fp32 then adding
            mg = torch.zeros(oshape, device=dev)
            mgs[label] = mg
            A, B = (dy, a) if label == "wgrad fc2" else (h, x)
            try:
                t_cub = _bench(lambda: gemm(A.t(), B, m_splits=s, out=mg, accumulate=True))  # noqa: B023
            except Exception as e:  # noqa: BLE001
                print("cuBLAS accumulate:", repr(e)[:200])
                t_cub = float("nan")
            row2 = {
                "case": name,
                "gemm": label + " +main_grad",
                "cublas_ms": t_cub,
                "tflops_cublas": flops / t_cub / 1e9,
                "cfg": {},
            }
            for cname, cfg in cfgs.items():
                try:
                    t = _bench(lambda: gg._launch_wgrad(A, B, off, mg, True, cfg))  # noqa: B023
                    row2["cfg"][cname] = {"ms": t, "ratio": t / t_cub, "err": 0.0}
                except Exception as e:  # noqa: BLE001
                    row2["cfg"][cname] = {"ms": float("nan"), "ratio": float("nan"), "err": repr(e)[:200]}
            results.append(row2)
            log(row2)
        del ref
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--set", default="full", choices=("full", "mini"))
    args = ap.parse_args()
    global ROWS, WGRAD
    if args.set == "mini":
        ROWS, WGRAD = ROWS_MINI, WGRAD_MINI
    dev = torch.device("cuda")
    import triton

    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    allr = []
    fh = open(os.path.join(args.out, "tune.jsonl"), "w")

    def log(row):
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        best = min(row["cfg"].items(), key=lambda kv: kv[1]["ratio"] if kv[1]["ratio"] == kv[1]["ratio"] else 1e9)
        errs = [k for k, v in row["cfg"].items() if isinstance(v["err"], str) or v["err"] > 2e-2]
        print(
            f"{row['case']:8s} {row['gemm']:22s} cublas {row['cublas_ms']:.3f} ms ({row['tflops_cublas']:.0f} TF/s) "
            f"best {best[0]} {best[1]['ratio']:.2f}x  bad={errs}",
            flush=True,
        )

    t0 = time.time()
    for name in args.cases.split(","):
        allr += run_case(name, CASES[name], dev, log)
        torch.cuda.empty_cache()
    # tables: per row the ratio of every config
    for kind, cfgs in (("rows", ROWS), ("wgrad", WGRAD)):
        if not cfgs:
            continue
        rows = [r for r in allr if (r["gemm"].startswith("wgrad")) == (kind == "wgrad")]
        names = list(cfgs)
        print(f"\n== {kind}: time / cuBLAS grouped_mm ==")
        print(f"{'case gemm':32s} {'cuBLAS ms':>9s} " + " ".join(f"{i:>5d}" for i in range(len(names))))
        for r in rows:
            print(
                f"{r['case'] + ' ' + r['gemm']:32s} {r['cublas_ms']:9.3f} "
                + " ".join(f"{r['cfg'][n]['ratio']:5.2f}" for n in names)
            )
        tot_c = sum(r["cublas_ms"] for r in rows)
        print(f"{'sum':32s} {tot_c:9.3f} " + " ".join(f"{sum(r['cfg'][n]['ms'] for r in rows) / tot_c:5.2f}" for n in names))
        for case in CASES:
            cr = [r for r in rows if r["case"] == case]
            if cr:
                tc = sum(r["cublas_ms"] for r in cr)
                print(
                    f"{'sum ' + case:32s} {tc:9.3f} " + " ".join(f"{sum(r['cfg'][n]['ms'] for r in cr) / tc:5.2f}" for n in names)
                )
        for i, n in enumerate(names):
            print(f"  {i}: {n}")
    print(f"sweep {time.time() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
