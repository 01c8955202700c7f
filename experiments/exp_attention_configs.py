"""Which tiles and loop shapes of the attention kernels are fastest for bf16, head dim 128, and
keep the bits (issue 33)?

For each candidate (``ops/attention/attention_config.py``'s tiles, replaced through
``truefuse.ops.attention.attention.attention_config``):

* backward: two or more identical backward runs bitwise equal (random dO, B=2, 8/2 heads,
  L=2048, and verify's ones-dO case), where the differing dK elements sit, and fwd + bwd time at
  B=4, 32/8 heads, L=4096, causal;
* forward: verify's bf16 bitwise cases (a sequence alone vs padded; decode vs prefill) and the
  prefill time at L=2048 and 4096; decode latency at B=1, 8, 32 and 2k / 8k cached keys;

all against SDPA's flash and cuDNN backends in the same run (``vs_sdpa`` against the faster of the
two: cuDNN's ran 2× our kernels in the demo's step on an H100, docs/benchmarks.md), timed under
CUDA graphs as ``python -m truefuse bench attention`` times them (the heads repeated outside the
timing). The forward candidates include a 128-key block (``block_n``: it orders every row's
reduction, prefill and decode alike, so the bitwise cases decide whether it may replace 64).
Run: ``PYTHONPATH=. python experiments/exp_attention_configs.py [OUT_DIR [BUDGET_S]]`` on one GPU.
"""

import dataclasses
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import truefuse.ops.attention.attention as ops_attention
from truefuse.autograd.attention import attention
from truefuse.ops.attention import attention_kept
from truefuse.ops.attention.attention_config import attention_config
from truefuse.verify import cases_attention

BF = torch.bfloat16
BASE = attention_config(128, BF, False)
T0 = time.time()

# (dK/dV tile (m, n, warps, stages), dQ tile): the committed one first. The first call's sweep
# (docs/results/attention/attention_sweep_h100_2026-11-26.json) also ran the loop variants since
# removed: dK/dV as nested (head, rows) loops and with tl.trans of K and V, the forward as one
# loop merging at chunk ends under an `if`
BWD = [
    ((64, 64, 4, 2), (128, 64, 8, 2)),  # the launch table's
    ((64, 64, 4, 2), (128, 64, 8, 2, True)),  # full_blocks: every pass's fully seen blocks unmasked (same bits)
    ((64, 64, 8, 2), (128, 64, 8, 2, True)),  # dK/dV at 8 warps: 234 registers with it, no spill (exp_kernel_registers)
    ((64, 64, 8, 3), (128, 64, 8, 2, True)),  # 240, no spill
    ((64, 64, 8, 2), (128, 64, 8, 2)),  # the tiles before
    ((64, 64, 4, 3), (128, 64, 8, 2)),
    ((128, 64, 8, 2), (128, 128, 8, 2)),
    ((32, 64, 4, 1), (128, 64, 8, 2)),
    ((32, 64, 4, 3), (128, 64, 8, 2)),  # bf16 dK not reproducible
    ((64, 128, 8, 2), (128, 64, 8, 2)),
]
#: prefill forward tile (m, warps, stages, block_n[, full_blocks[, state_in_memory]]): full_blocks runs the
#: key blocks every row sees whole without the mask, state_in_memory keeps the rows' accumulator in
#: memory between key chunks (the same bits either way; attention_config.py). 128-key blocks spill
#: in registers unless the state is in memory (experiments/exp_kernel_registers.py)
FWD = [
    (128, 8, 3, 64), (128, 8, 3, 64, True), (128, 8, 3, 64, False, True), (128, 8, 3, 64, True, True),
    (64, 4, 3, 64), (64, 4, 3, 64, True), (128, 8, 2, 64), (128, 4, 3, 64),
    (128, 8, 3, 128), (128, 8, 3, 128, False, True), (128, 8, 3, 128, True, True), (128, 8, 2, 128, True, True),
    (64, 4, 3, 128, False, True),
]  # fmt: skip
DECODE = [(3, False), (2, False), (3, True)]  # (stages, full_blocks) of the 64-row decode tile


def _t(fn):
    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _use(cfg):
    ops_attention.attention_config = lambda *a, cfg=cfg: cfg
    # a no-grad forward replays its kept launch (ops/attention/attention_kept.py), keyed on the call
    # and not the tiles (a constant of the dtype and head dim outside this experiment): forget them,
    # or every forward candidate times the first one's launch (0.5511-0.5515 ms on 2026-12-08)
    attention_kept.clear()


def _rnd(g, *s):
    return torch.randn(*s, generator=g, device="cuda", dtype=BF)


def _fwd_bwd(q, k, v, dy, fn):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return lambda: torch.autograd.grad(fn(*leaves), leaves, dy)


#: SDPA's backends timed, by name (the faster one is each row's yardstick)
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _sdpa(q, k, v, causal=True, backend="flash"):
    with sdpa_kernel(BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _ours(q, k, v, causal=True):
    return attention(q, k, v, is_causal=causal, enable_gqa=True)


def _grads(q, k, v, dy):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _ours(*leaves)
    out.backward(dy)
    return [t.grad for t in leaves]


def _bits_diff(a, b):
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def _determinism(det, runs=4):
    """Differing elements of dq, dk, dv between identical backward runs, and where dK's sit."""
    q, k, v, dy = det
    first = _grads(q, k, v, dy)
    worst = [0, 0, 0]
    where = None
    for _ in range(runs - 1):
        again = _grads(q, k, v, dy)
        for i in range(3):
            worst[i] = max(worst[i], _bits_diff(first[i], again[i]))
        d = first[1].view(torch.int16) != again[1].view(torch.int16)
        if d.any():
            rows = d.any(-1).nonzero()[:, 2]  # key positions with a differing dK element
            rel = ((first[1].float() - again[1].float()).abs() / first[1].float().abs().clamp_min(1e-6))[d]
            where = {
                "key_mod_64_hist16": torch.bincount(rows % 64 // 16, minlength=4).tolist(),
                "key_block_hist8": torch.bincount(rows * 8 // k.shape[2], minlength=8).tolist(),
                "max_rel": float(rel.max()),
            }
    n = [t.numel() for t in first]
    q, k, v = cases_attention._qkv(1, 4, 2, 1100, 128, "cuda", BF, seed=3)
    ones = [_grads(q, k, v, torch.ones_like(q)) for _ in range(2)]
    return {
        "rand_frac": [w / m for w, m in zip(worst, n, strict=True)],
        "ones_diff": [_bits_diff(a, b) for a, b in zip(*ones, strict=True)],
        "dk_where": where,
    }


def _fails(case):
    return sum(not r.passed for r in case(BF)(torch.device("cuda")).values())


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
    budget = float(sys.argv[2]) if len(sys.argv) > 2 else 200.0  # seconds; later candidates are skipped
    g = torch.Generator(device="cuda").manual_seed(0)
    train = {L: (_rnd(g, 4, 32, L, 128), _rnd(g, 4, 8, L, 128), _rnd(g, 4, 8, L, 128)) for L in (2048, 4096)}
    dy = _rnd(g, 4, 32, 4096, 128)
    det = (_rnd(g, 2, 8, 2048, 128), _rnd(g, 2, 2, 2048, 128), _rnd(g, 2, 2, 2048, 128), _rnd(g, 2, 8, 2048, 128))
    shapes = [(b, n) for n in (2048, 8192) for b in (1, 8, 32)]
    dec = {(b, n): (_rnd(g, b, 32, 1, 128), _rnd(g, b, 8, n, 128), _rnd(g, b, 8, n, 128)) for b, n in shapes}
    rep = {key: (val[0], *(t.repeat_interleave(4, 1) for t in val[1:])) for key, val in train.items()}
    rep_dec = {key: (val[0], *(t.repeat_interleave(4, 1) for t in val[1:])) for key, val in dec.items()}
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    def sdpa_times(backend):
        def fn(*a, causal=True):
            return _sdpa(*a, causal=causal, backend=backend)

        try:
            return {
                "fwd": {L: _t(lambda L=L: fn(*rep[L])) for L in rep},
                "fwd_bwd": _t(_fwd_bwd(*rep[4096], dy, fn)),
                "decode": {f"{b}x{n}": _t(lambda key=(b, n): fn(*rep_dec[key], causal=False)) for b, n in dec},
            }
        except RuntimeError as e:  # a backend this build or shape lacks
            print(f"sdpa {backend}: {e}", flush=True)
            return None

    per = results["sdpa_before"] = {b: sdpa_times(b) for b in BACKENDS}
    print("sdpa", json.dumps(per), flush=True)
    timed = [t for t in per.values() if t]
    sd = {  # the faster backend's time, entry by entry
        "fwd": {L: min(t["fwd"][L] for t in timed) for L in rep},
        "fwd_bwd": min(t["fwd_bwd"] for t in timed),
        "decode": {k: min(t["decode"][k] for t in timed) for k in timed[0]["decode"]},
    }
    rows = results["rows"] = []

    def record(row):
        row["elapsed_s"] = round(time.time() - T0)
        rows.append(row)
        print(json.dumps(row), flush=True)

    def backward(tile, dq):
        cfg = dataclasses.replace(BASE, dkdv_m=tile[0], dkdv_n=tile[1], dkdv_warps=tile[2], dkdv_stages=tile[3])
        full = dq[4] if len(dq) > 4 else False
        _use(dataclasses.replace(cfg, dq_m=dq[0], dq_n=dq[1], dq_warps=dq[2], dq_stages=dq[3], full_blocks=full))
        row = {"pass": "bwd", "dkdv": tile, "dq": dq}
        try:
            row.update(_determinism(det))
            ms = _t(_fwd_bwd(*train[4096], dy, _ours))
            row.update(fwd_bwd_ms=ms, vs_sdpa=sd["fwd_bwd"] / ms)
        except Exception as e:  # a tile that does not fit shared memory
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        record(row)

    for tile, dq in BWD:
        if time.time() - T0 < budget * 0.5:
            backward(tile, dq)
    for m, warps, stages, block_n, *switches in FWD:
        if time.time() - T0 > budget * 0.8:
            break
        full, in_memory = (*map(bool, switches), False, False)[:2]
        tiles = dict(block_m=m, fwd_warps=warps, fwd_stages=stages, block_n=block_n)
        _use(dataclasses.replace(BASE, **tiles, full_blocks=full, state_in_memory=in_memory))
        row = {"pass": "fwd", "tile": (m, warps, stages, block_n, full, in_memory)}
        row["bitwise_fails"] = _fails(cases_attention._batch_invariant) + _fails(cases_attention._decode_vs_prefill)
        for L in train:
            ms = _t(lambda L=L: _ours(*train[L]))
            row[f"L{L}_ms"], row[f"L{L}_vs_sdpa"] = ms, sd["fwd"][L] / ms
        record(row)
    for stages, full in DECODE:
        if time.time() - T0 > budget:
            break
        _use(dataclasses.replace(BASE, fwd_stages=stages, full_blocks=full))
        row = {"pass": "decode", "stages": stages, "full_blocks": full}
        for b, n in dec:
            ms = _t(lambda key=(b, n): _ours(*dec[key], causal=False))
            row[f"{b}x{n}"] = [ms, ms / sd["decode"][f"{b}x{n}"]]
        record(row)
    results["sdpa_after"] = {b: sdpa_times(b) for b in BACKENDS}
    print("sdpa_after", json.dumps(results["sdpa_after"]), flush=True)
    if out_dir:
        with open(f"{out_dir}/sweep.json", "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'candidate':52} {'result'}")
    for r in rows:
        name = " ".join(f"{k}={r[k]}" for k in ("pass", "dkdv", "dq", "tile", "stages", "full_blocks") if k in r)
        keys = ("rand_frac", "ones_diff", "fwd_bwd_ms", "vs_sdpa", "bitwise_fails", "L2048_vs_sdpa", "L4096_vs_sdpa", "error")
        res = {k: (round(r[k], 3) if isinstance(r[k], float) else r[k]) for k in keys if k in r}
        if r["pass"] == "decode":
            res = {k: round(v[1], 2) for k, v in r.items() if "x" in k}
        print(f"{name:52} {res}")


if __name__ == "__main__":
    main()
