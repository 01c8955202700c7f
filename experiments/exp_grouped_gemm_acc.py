"""Issue 16, fused ``main_grad``: the weight gradient adding into an fp32 ``main_grad`` under candidate
configurations of the accumulate kinds (``wgrad_acc``, ``wgrad_large_acc``), each GEMM alone and in
the layer.

Run on the H200: ``PYTHONPATH=. python experiments/exp_grouped_gemm_acc.py [--out DIR] [--cases a,b]``.

Per case of ``truefuse bench grouped`` (bf16, uniform routing) and weight-gradient GEMM (fc2, fc1):

* cuBLAS ``grouped_mm`` writing bf16 (the floor's GEMM) and adding into ``main_grad``
  (``truefuse.gemm(..., out=main_grad, accumulate=True)``); ``rw``: ``main_grad`` read and written
  once (``mul_(1.0)``), the epilogue's bytes at the copy rate with no GEMM;
* each candidate of :data:`CANDS`: ms (uniform and ragged routing), the compiled kernel's registers,
  spills and shared memory (two programs share an SM only if both fit); bounded against cuBLAS
  (relative error of the sum from zeros); bitwise on ragged splits (odd sizes, an empty group):
  equal to the code's own configuration, a device tensor of splits equal to the host list, and the
  code's own ``main_grad`` equal to ``start + the plain fp32 dW`` (one fp32 add);
* the same for the bf16 weight gradient (no ``main_grad``).

Then the layer (forward + backward): ``floor``, ``floor_main_grad``, ``truefuse`` and
``truefuse_main_grad`` with each candidate as its kind's entry, ``main_grad`` (or dW) after one step
bitwise equal to the code's own table's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from truefuse.bench import bench_grouped as bg
from truefuse.bench.harness import measure
from truefuse.ops import grouped_gemm as gg
from truefuse.ops import grouped_gemm_config as ggc
from truefuse.ops.gemm import gemm

sys.path.insert(0, os.path.dirname(__file__))
from exp_grouped_gemm_layer import LARGE, configs, grads  # noqa: E402
from exp_grouped_gemm_tune import CASES  # noqa: E402

BF = torch.bfloat16


def _t(bm, bn, bk, warps, stages, per_sm, split, epi=True):
    return ggc.TileConfig(bm, bn, bk, warps, stages, per_sm, tma=True, tma_epilogue=epi, epilogue_split=split)


#: Candidates per size class (the code's own first), adding into main_grad (``acc``: the
#: ``wgrad_acc`` / ``wgrad_large_acc`` entry) or writing bf16 dW (``plain``: ``wgrad`` /
#: ``wgrad_large``): two or three programs per SM, so that one program's memory-bound epilogue
#: overlaps another's mainloop (``sN``: stages, ``eN``: epilogue parts, ``pN``: programs per SM;
#: shared memory from the compiled kernel: the epilogue's buffer reuses the pipeline's on triton 3.6).
#:
#: Measured on an H200 (2026-11-23, docs/benchmarks.md; none beat the code's own table):
#:
#: * these: the large layer at 128×128 two per SM 1.27-1.40× cuBLAS adding into main_grad against
#:   1.07-1.17× (its mainloop is slower); the small layers at 64×128, 4 warps, three per SM:
#:   ±4% per GEMM, up to 8% slower in the layer;
#: * main_grad prefetched into L2 (``cp.async.bulk.prefetch.L2.global`` per tile row, at the tile's
#:   start or one or two tiles ahead; never committed): 5-35% slower everywhere;
#: * the programs' starts staggered (``(pid % P) * T`` ns on the GPU timer, P = 2 … 264, up to one
#:   tile period; commit ee22b62 has the knob and its candidates): −1 … +9% per GEMM at 8 × 2048,
#:   ±2% at the small layers: the equal tiles of a uniform batch do not lose their time by meeting
#:   in the epilogue all at once.
CANDS = {
    ("large", "acc"): {
        "128x256 s3 e2": _t(64, 128, 256, 8, 3, 1, 2),
        "128x128 s2 e2 p2": _t(64, 128, 128, 8, 2, 2, 2),
        "128x128 s3 e4 p2": _t(64, 128, 128, 8, 3, 2, 4),
    },
    ("large", "plain"): {
        "128x256 s3": _t(64, 128, 256, 8, 3, 1, 1, epi=False),
    },
    ("small", "acc"): {
        "128x128 s3 e1 p2": _t(64, 128, 128, 8, 3, 2, 1),
        "128x128 s2 e2 p2": _t(64, 128, 128, 8, 2, 2, 2),
        "64x128 w4 s3 e1 p3": _t(64, 64, 128, 4, 3, 3, 1),
        "64x128 w4 s2 e1 p3": _t(64, 64, 128, 4, 2, 3, 1),
    },
    ("small", "plain"): {
        "128x128 s3 e1 p2": _t(64, 128, 128, 8, 3, 2, 1),
        "128x128 s3 e2 p2": _t(64, 128, 128, 8, 3, 2, 2),
        "64x128 w4 s3 e1 p3": _t(64, 64, 128, 4, 3, 3, 1),
    },
}


def _bench(fn, rep=100):
    import triton.testing

    fn()
    if not torch.cuda.is_available():  # the CPU dry run (--device cpu --tiny): the code paths only
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=20, rep=rep, return_mode="median"))


def _ragged(E: int, M: int) -> list[int]:
    """E sizes summing to M: odd sizes (64-row tails), group 1 empty, its rows in group 0."""
    g = torch.Generator().manual_seed(E)
    w = torch.rand(E, generator=g) + 0.5
    s = (w / w.sum() * M).floor().long()
    s[-1] += M - int(s.sum())
    s[0] += s[1]
    s[1] = 0
    return [int(v) for v in s]


def _kinfo(k) -> dict:
    try:
        return {"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared}
    except Exception as e:  # noqa: BLE001
        return {"kinfo": repr(e)[:100]}


def gemm_rows(name: str, p: dict, dev, log) -> list[dict]:
    E, H, Fd, tok = p["E"], p["H"], p["F"], p["tokens"]
    M = E * tok
    s = [tok] * E
    rag = _ragged(E, M)
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*sh):
        return torch.randn(*sh, generator=g, device=dev, dtype=BF) * 0.5

    x, a, dy, h = r(M, H), r(M, Fd), r(M, H), r(M, 2 * Fd)
    off = gg.split_offsets(s, E, M, dev)
    off_r = gg.split_offsets(rag, E, M, dev)
    off_rd = gg.split_offsets(torch.tensor(rag, device=dev), E, M, dev)
    cls = "large" if name in LARGE else "small"
    big = 1 << 30 if cls == "large" else 1
    own_acc = ggc.tile_config("wgrad", BF, dev, big, True)
    own_plain = ggc.tile_config("wgrad", BF, dev, big, False)
    rows = []
    for label, A, B in (("wgrad fc2", dy, a), ("wgrad fc1", h, x)):
        shape = (E, A.shape[1], B.shape[1])
        row = {"case": name, "gemm": label, "weights": shape[0] * shape[1] * shape[2]}
        row["cublas_bf16"] = _bench(lambda: gemm(A.t(), B, m_splits=s))  # noqa: B023
        mg = torch.zeros(shape, device=dev)
        row["cublas_acc"] = _bench(lambda: gemm(A.t(), B, m_splits=s, out=mg, accumulate=True))  # noqa: B023
        row["rw"] = _bench(lambda: mg.mul_(1.0))  # noqa: B023
        ref = torch.zeros(shape, device=dev)
        gemm(A.t(), B, m_splits=s, out=ref, accumulate=True)
        start = torch.randn(shape, generator=torch.Generator(device=dev).manual_seed(3), device=dev)
        start[1] = -0.0
        own = start.clone()
        gg._launch_wgrad(A, B, off_r, own, True, own_acc)
        fresh = torch.empty(shape, device=dev)
        gg._launch_wgrad(A, B, off_r, fresh, False, own_plain)
        plain_add = start + fresh
        plain_add[1] = start[1]
        row["own_eq_start_plus_plain"] = bool(torch.equal(own, plain_add))
        fresh = plain_add = None
        row["acc"] = {}
        for cname, cfg in CANDS[(cls, "acc")].items():
            try:
                z = torch.zeros(shape, device=dev)
                k = gg._launch_wgrad(A, B, off, z, True, cfg)
                err = float((z - ref).norm() / ref.norm())
                z = None
                t = _bench(lambda: gg._launch_wgrad(A, B, off, mg, True, cfg))  # noqa: B023
                t_rag = _bench(lambda: gg._launch_wgrad(A, B, off_r, mg, True, cfg))  # noqa: B023
                got = start.clone()
                gg._launch_wgrad(A, B, off_r, got, True, cfg)
                same_own = bool(torch.equal(got, own))
                got.copy_(start)
                gg._launch_wgrad(A, B, off_rd, got, True, cfg)
                same_dev = bool(torch.equal(got, own))
                got = None
                bits = {"bitwise_own": same_own, "bitwise_device_splits": same_dev}
                row["acc"][cname] = {"ms": t, "ms_ragged": t_rag, "err": err, **bits, **_kinfo(k)}
            except Exception as e:  # noqa: BLE001
                row["acc"][cname] = {"ms": float("nan"), "error": repr(e)[:300]}
        own = start = ref = mg = None  # free before the next buffers
        row["plain"] = {}
        want = torch.empty(shape, device=dev, dtype=BF)
        gg._launch_wgrad(A, B, off_r, want, False, own_plain)
        for cname, cfg in CANDS[(cls, "plain")].items():
            try:
                o = torch.empty(shape, device=dev, dtype=BF)
                k = gg._launch_wgrad(A, B, off, o, False, cfg)
                t = _bench(lambda: gg._launch_wgrad(A, B, off, o, False, cfg))  # noqa: B023
                t_rag = _bench(lambda: gg._launch_wgrad(A, B, off_r, o, False, cfg))  # noqa: B023
                gg._launch_wgrad(A, B, off_rd, o, False, cfg)
                row["plain"][cname] = {"ms": t, "ms_ragged": t_rag, "bitwise_own": bool(torch.equal(o, want)), **_kinfo(k)}
            except Exception as e:  # noqa: BLE001
                row["plain"][cname] = {"ms": float("nan"), "error": repr(e)[:300]}
        want = o = None
        torch.cuda.empty_cache()
        log(row)
        rows.append(row)
    return rows


def layer_rows(name: str, p: dict, dev, log) -> dict:
    large = name in LARGE
    f = measure(bg._floor(p, dev), dev).ms
    row = {"case": name, "floor": f, "floor_main_grad": measure(bg._floor_main_grad(p, dev), dev).ms}
    if large:
        row["per_group_main_grad"] = measure(bg._truefuse(True, "per_group")(p, dev), dev).ms
    ref = {mg: grads(p, dev, mg) for mg in (False, True)}
    cls, kind = ("large", "wgrad_large") if large else ("small", "wgrad")
    sets = [(True, cname, {f"{kind}_acc": cfg}) for cname, cfg in CANDS[(cls, "acc")].items()]
    sets += [(False, cname, {kind: cfg}) for cname, cfg in CANDS[(cls, "plain")].items()]
    row["sets"] = {}
    for fused, cname, entries in sets:
        with configs(entries):
            try:
                t = measure(bg._truefuse(fused)(p, dev), dev).ms
                same = all(torch.equal(u, v) for u, v in zip(grads(p, dev, fused), ref[fused], strict=True))
            except Exception as e:  # noqa: BLE001
                row["sets"][("mg " if fused else "plain ") + cname] = {"error": repr(e)[:300]}
                continue
        row["sets"][("mg " if fused else "plain ") + cname] = {"ms": t, "ratio": t / f, "bitwise": same}
    torch.cuda.empty_cache()
    log(row)
    return row


def _warm_one(task) -> str:
    """Compile one launch (the on-disk Triton cache then serves the measurements): tiny operands with
    the real shapes' integer specialisations (multiples of 16; 8 groups for the large case)."""
    kind, G, cfg, accumulate, large = task
    t0 = time.time()
    try:
        _warm_launch(kind, G, cfg, accumulate)
    except Exception as e:  # noqa: BLE001
        return f"{kind} G={G} {cfg} failed: {repr(e)[:200]} 0 s"
    return f"{kind} G={G} {cfg} {time.time() - t0:.1f} s"


def _warm_launch(kind, G, cfg, accumulate) -> None:
    dev = torch.device("cuda")
    N = K = 256
    M = 64 * G
    a = torch.randn(M, N, device=dev, dtype=BF)
    b = torch.randn(M, K, device=dev, dtype=BF)
    off = gg.split_offsets([64] * G, G, M, dev)
    if kind == "rows":
        w = torch.randn(G, N, K, device=dev, dtype=BF)
        for tw in (True, False):
            gg._launch_rows(b if tw else a, w, off, None, tw, torch.empty(M, N, device=dev, dtype=BF), cfg)
    else:
        out = torch.zeros(G, N, K, device=dev, dtype=torch.float32 if accumulate else BF)
        gg._launch_wgrad(a, b, off, out, accumulate, cfg)
    torch.cuda.synchronize()


def warm(cases: list[str], procs: int) -> None:
    import multiprocessing as mp

    dev = torch.device("cuda")
    tasks = []
    for name in cases:
        large = name in LARGE
        G = CASES[name]["E"]
        big = 1 << 30 if large else 1
        tasks.append(("rows", G, ggc.tile_config("rows", BF, dev, big), False, large))
        tasks.append(("wgrad", G, ggc.tile_config("wgrad", BF, dev, big), False, large))
        cls = "large" if large else "small"
        tasks += [("wgrad", G, c, True, large) for c in CANDS[(cls, "acc")].values()]
        tasks += [("wgrad", G, c, False, large) for c in CANDS[(cls, "plain")].values()]
    uniq = list({(k, G % 16 == 0, c, acc): (k, G, c, acc, lg) for k, G, c, acc, lg in tasks}.values())
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(procs, len(uniq))) as pool:
        msgs = list(pool.imap_unordered(_warm_one, uniq))
    slowest = max(msgs, key=lambda m: float(m.split()[-2]))
    print(f"warm: {len(uniq)} launches compiled in {time.time() - t0:.0f} s (slowest: {slowest[-70:]})", flush=True)


def picks(res: dict, margin: float = 0.02) -> dict:
    """{kind: (name, TileConfig)} per size class and kind: the candidate with the least layer time
    whose every bitwise check held, where it beats the code's own by more than ``margin`` in the
    layer and in its GEMMs' summed time; else the code's own. Both kinds of a class are named (a
    ``wgrad`` entry alone would also serve the accumulate kind)."""
    out = {}
    for cls, kind in (("large", "wgrad_large"), ("small", "wgrad")):
        for mode, key in (("acc", f"{kind}_acc"), ("plain", kind)):
            cands = CANDS[(cls, mode)]
            own = next(iter(cands))
            lay = [r for r in res["layer"] if (r["case"] in LARGE) == (cls == "large")]
            gem = [r for r in res["gemm"] if (r["case"] in LARGE) == (cls == "large")]
            if not lay or not gem:
                continue
            prefix = "mg " if mode == "acc" else "plain "

            def tot(c, lay=lay, gem=gem, prefix=prefix, mode=mode):
                sets = [r["sets"].get(prefix + c, {}) for r in lay]
                gs = [r[mode].get(c, {}) for r in gem]
                ok = all(v.get("bitwise") for v in sets) and all(
                    v.get("bitwise_own") and v.get("bitwise_device_splits", True) for v in gs
                )
                if not ok:
                    return float("inf"), float("inf")
                return sum(v["ms"] for v in sets), sum(v["ms"] for v in gs)

            best = min(cands, key=lambda c: tot(c)[0])
            (lb, gb), (lo, go) = tot(best), tot(own)
            name = best if lb < lo * (1 - margin) and gb < go else own
            out[key] = (name, cands[name])
            print(f"pick {key:16s} {name:28s} layer {lb:.3f} vs own {lo:.3f} ms, GEMMs {gb:.3f} vs {go:.3f} ms", flush=True)
    return out


def bench_picked(acc_json: str, providers: list[str], out: str) -> int:
    """``python -m truefuse bench grouped --providers ...`` with the picks of ``acc_json`` as the
    configuration table (the same table a commit of them would give)."""
    from truefuse.bench import run_bench

    chosen = picks(json.load(open(acc_json)))
    dev = torch.device("cuda")
    own = {k: ggc.tile_config("wgrad", BF, dev, 1 << 30 if "large" in k else 1, k.endswith("_acc")) for k in chosen}
    if all(c == own[k] for k, (_, c) in chosen.items()):
        print("bench-picked: the picks are the code's own table; not run again")
        return 0
    with configs({k: c for k, (_, c) in chosen.items()}):
        return run_bench("grouped", providers, out, False, 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--no-layer", action="store_true")
    ap.add_argument("--warm", type=int, default=12, help="processes compiling the kernels first (0: none)")
    ap.add_argument("--device", default="cuda", help="cpu with --tiny: a dry run under TRITON_INTERPRET=1")
    ap.add_argument("--tiny", action="store_true", help="the cases at toy sizes (their group counts kept)")
    ap.add_argument("--bench-picked", default=None, help="acc.json: run bench grouped with its picks, then stop")
    ap.add_argument("--providers", nargs="*", default=["floor", "truefuse", "truefuse_main_grad", "floor_main_grad"])
    args = ap.parse_args()
    if args.bench_picked:
        return bench_picked(args.bench_picked, args.providers, args.out)
    if args.tiny:
        for p in CASES.values():
            p.update(tokens=40, H=64, F=48)
    dev = torch.device(args.device)
    if args.warm and dev.type == "cuda":
        warm(args.cases.split(","), args.warm)
    import triton

    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} triton {triton.__version__} {gpu}", flush=True)
    fh = open(os.path.join(args.out, "acc.jsonl"), "w")

    def log(row):
        fh.write(json.dumps(row) + "\n")
        fh.flush()

    t0 = time.time()
    res = {"gemm": [], "layer": []}
    for name in args.cases.split(","):
        res["gemm"] += gemm_rows(name, CASES[name], dev, log)
        print(f"[{time.time() - t0:.0f} s] {name} GEMMs done", flush=True)
    if not args.no_layer:
        for name in args.cases.split(","):
            res["layer"].append(layer_rows(name, CASES[name], dev, log))
            print(f"[{time.time() - t0:.0f} s] {name} layer done", flush=True)
    print("\n== weight gradient adding into main_grad: ms (ratio to cuBLAS adding into main_grad) ==")
    for r in res["gemm"]:
        print(f"{r['case']} {r['gemm']}: cuBLAS bf16 {r['cublas_bf16']:.3f}, cuBLAS+main_grad {r['cublas_acc']:.3f}, "
              f"rw {r['rw']:.3f}; own acc == start + plain: {r['own_eq_start_plus_plain']}")  # fmt: skip
        for kind in ("acc", "plain"):
            for c, v in r.get(kind, {}).items():
                base = r["cublas_acc"] if kind == "acc" else r["cublas_bf16"]
                keys = ("ms_ragged", "regs", "spills", "shared", "err", "bitwise_own", "bitwise_device_splits")
                extra = {k: v[k] for k in keys if k in v}
                print(f"   {kind:5s} {c:24s} {v['ms']:8.3f} ({v['ms'] / base:.3f})  {extra or v.get('error')}")
    print("\n== the layer: ms (ratio to floor) ==")
    for r in res["layer"]:
        fl, fmg = r["floor"], r["floor_main_grad"]
        pg = f", per_group_main_grad {r['per_group_main_grad'] / fl:.3f}" if "per_group_main_grad" in r else ""
        print(f"{r['case']}: floor {fl:.3f}, floor_main_grad {fmg:.3f} ({fmg / fl:.3f}){pg}")
        for c, v in r["sets"].items():
            ok = f"{v['ms']:8.3f} ({v['ratio']:.3f}) bitwise {v['bitwise']}" if "ms" in v else v["error"]
            print(f"   {c:28s} {ok}")
    with open(os.path.join(args.out, "acc.json"), "w") as f:
        json.dump(res, f, indent=1)
    if res["layer"]:
        picks(res)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
