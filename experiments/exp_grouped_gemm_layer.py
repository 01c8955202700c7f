"""Issue 16, follow-up: where GroupedMLP's time goes above its GEMMs, and the layer under other
configuration tables side by side with the code's own.

Run on the H200: ``PYTHONPATH=. python experiments/exp_grouped_gemm_layer.py [--cases a,b] [--out DIR]
[--tune DIR/tune.jsonl]``.

1. Per case of ``truefuse bench grouped`` (bf16, swiglu, packed, uniform routing): the host time of
   one forward + backward call (Python and launches, no sync: above the GPU time the layer waits on
   the CPU), its time under ``do_bench`` (what the bench reports) and under CUDA-graph replay
   (device splits: GPU time alone), and at 128 × 128 the profiler's GPU time per kernel of one step.
2. The layer (plain and fused ``main_grad``) under each set of :data:`SETS` (entries replacing the
   code's ``_TUNED_CONFIGS``; "before": the table this follow-up started from), and under the best
   per-kind candidates of an ``exp_grouped_gemm_tune.py --set mini`` sweep (``--tune``), with
   ``floor``, ``floor_main_grad`` and ``per_group`` + ``main_grad`` in the same process. Each set's
   dW and ``main_grad`` after one step are compared bitwise with the code's own table's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from truefuse.bench import bench_grouped as bg
from truefuse.bench.harness import measure
from truefuse.nn.grouped import GroupedMLP
from truefuse.ops import grouped_gemm_config as ggc

sys.path.insert(0, os.path.dirname(__file__))
from exp_grouped_gemm_tune import CASES, ROWS_MINI, WGRAD_MINI  # noqa: E402

BF = torch.bfloat16
LARGE = {"8x2048"}  # the cases whose layers are >= 2^24 weights per group (wgrad_large)


def _t(*a, **k):
    return ggc.TileConfig(*a, tma=True, **k)


#: Named sets of configuration entries ({kind: TileConfig, or None: no such entry}) tried against the
#: code's own table ("final": no change). "before" is the table this follow-up started from.
SETS = {
    "before": {"wgrad_large_acc": None, "wgrad": _t(64, 128, 128, 8, 3, 2)},
    "final": {},
    "small_ptr_epi": {"wgrad": _t(64, 128, 128, 8, 3, 2)},
    "large_acc_epi4": {"wgrad_large_acc": _t(64, 128, 256, 8, 3, 1, tma_epilogue=True, epilogue_split=4)},
}
#: The sets that change anything at a case (the others are "final" there).
SMALL_ONLY = {"small_ptr_epi"}
LARGE_ONLY = {"large_acc_epi4"}


@contextlib.contextmanager
def configs(entries: dict):
    """``_TUNED_CONFIGS`` with ``entries`` ({kind: TileConfig or None}, fp16/bf16 on sm_90) for a while."""
    saved = dict(ggc._TUNED_CONFIGS)
    for kind, cfg in entries.items():
        for dt in (torch.float16, torch.bfloat16):
            if cfg is None:
                ggc._TUNED_CONFIGS.pop((kind, dt, (9, 0)), None)
            else:
                ggc._TUNED_CONFIGS[(kind, dt, (9, 0))] = cfg
    try:
        yield
    finally:
        ggc._TUNED_CONFIGS.clear()
        ggc._TUNED_CONFIGS.update(saved)


def pick(tune_path: str) -> dict:
    """{kind: (name, TileConfig)} with the least summed time per kind, size class and variant."""
    rows = [json.loads(line) for line in open(tune_path)]
    out = {}
    kinds = (
        ("rows", False), ("rows_large", False),
        ("wgrad", False), ("wgrad_acc", True), ("wgrad_large", False), ("wgrad_large_acc", True),
    )  # fmt: skip
    for kind, acc in kinds:
        large, wgrad = "_large" in kind, kind.startswith("wgrad")
        cands = WGRAD_MINI if wgrad else ROWS_MINI
        rs = [r for r in rows if (r["case"] in LARGE) == large and r["gemm"].startswith("wgrad") == wgrad]
        rs = [r for r in rs if r["gemm"].endswith("+main_grad") == acc]
        if not rs:
            continue
        tot = {n: sum(r["cfg"][n]["ms"] for r in rs) for n in cands if all(n in r["cfg"] for r in rs)}
        tot = {n: t for n, t in tot.items() if t == t}  # NaN: failed to compile or run
        best = min(tot, key=tot.get)
        first = next(iter(cands))
        print(f"{kind:16s} best {best:24s} {tot[best]:.3f} ms, committed-like {first} {tot.get(first, float('nan')):.3f} ms")
        print("    " + ", ".join(f"{n} {t:.3f}" for n, t in tot.items()))
        out[kind] = (best, cands[best])
    return out


def host_ms(fn, n: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    ms = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    return ms


def where_time_goes(name: str, p: dict, dev, profile: bool) -> dict:
    fn = bg._truefuse(False)(p, dev)
    row = {"case": name, "host_ms": host_ms(fn), "do_bench_ms": measure(fn, dev).ms}
    try:
        row["graph_ms"] = measure(bg._truefuse(False, device_splits=True)(p, dev), dev, cuda_graph=True).ms
    except Exception as e:  # noqa: BLE001
        row["graph_ms"] = float("nan")
        print("graph:", repr(e)[:300])
    print(json.dumps(row), flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof_ctx

        fn()
        torch.cuda.synchronize()
        with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.key_averages():
            dt = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if dt > 0:
                kernels[e.key] = (dt / 5 / 1e3, e.count // 5)
        tot = sum(v[0] for v in kernels.values())
        print(f"\n== {name}: GPU time per step by kernel (profiler, 5 steps), sum {tot:.3f} ms ==")
        for k, (ms, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:16]:
            print(f"  {ms:8.3f} ms x{c:<3d} {k[:110]}")
        row["kernels"] = kernels
        row["kernel_sum_ms"] = tot
    return row


def grads(p, dev, main_grad: bool):
    """One step's weight gradients (or main_grads) of the default layer: for the bitwise check."""
    torch.manual_seed(0)
    m = GroupedMLP(p["E"], p["H"], p["F"], device=dev, dtype=BF, single_grouped_weight=True, fuse_wgrad_accumulation=main_grad)
    if main_grad:
        for _, q in m.gemm_weights():
            q.main_grad = torch.randn(q.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(9))
    x = bg._rand(p["E"] * p["tokens"], p["H"], device=dev, seed=0)
    m(x, bg._splits(p)).backward(bg._rand(p["E"] * p["tokens"], p["H"], device=dev, seed=5))
    return [(q.main_grad if main_grad else q.grad).clone() for _, q in m.gemm_weights()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tune", default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    import triton

    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    cases = args.cases.split(",")
    res = {"where": [], "layer": []}
    for name in cases:
        res["where"].append(where_time_goes(name, CASES[name], dev, profile=name == "128x128"))
    picks = pick(args.tune) if args.tune else {}
    sets = dict(SETS)
    if picks:
        sets["picked"] = {k: c for k, (_, c) in picks.items()}
    print("\n== the layer, ms (ratio to floor); bitwise: dW and main_grad equal the final table's ==", flush=True)
    for name in cases:
        p = CASES[name]
        f = measure(bg._floor(p, dev), dev).ms
        row = {
            "case": name,
            "floor": f,
            "floor_main_grad": measure(bg._floor_main_grad(p, dev), dev).ms,
            "per_group_main_grad": measure(bg._truefuse(True, "per_group")(p, dev), dev).ms,
        }
        print(f"{name:8s} floor {f:.3f}  floor_main_grad {row['floor_main_grad'] / f:.3f}  per_group+main_grad "
              f"{row['per_group_main_grad'] / f:.3f}", flush=True)  # fmt: skip
        ref = {mg: grads(p, dev, mg) for mg in (False, True)}
        for sname, entries in sets.items():
            if sname in (SMALL_ONLY if name in LARGE else LARGE_ONLY):
                continue
            with configs(entries):
                try:
                    t = measure(bg._truefuse(False)(p, dev), dev).ms
                    tm = measure(bg._truefuse(True)(p, dev), dev).ms
                    same = [
                        all(torch.equal(a, b) for a, b in zip(grads(p, dev, mg), ref[mg], strict=True)) for mg in (False, True)
                    ]
                except Exception as e:  # noqa: BLE001
                    print(f"  {sname}: {repr(e)[:300]}", flush=True)
                    continue
            row[sname] = {"ms": t, "main_grad_ms": tm, "bitwise": same}
            print(f"  {sname:18s} {t:8.3f} ({t / f:.3f})  main_grad {tm:8.3f} ({tm / f:.3f})  bitwise {same}", flush=True)
        res["layer"].append(row)
        torch.cuda.empty_cache()
    res["picks"] = {k: n for k, (n, _) in picks.items()}
    with open(os.path.join(args.out, "layer.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
