"""Batch-invariant mode's cost on a GPU (issue 34; docs/batch_invariance.md): tokens/s of a training
step (forward + backward + AdamW) of a transformers Llama under ``apply_truefuse`` (fast) and
``apply_truefuse(batch_invariant=True)`` (which puts attention on ``truefuse.attention``), and of
greedy ``generate`` (KV cache) stock vs batch-invariant; with ``--profile`` also where the time goes.
One run, one card; prints a table, writes ``bi_speed_<tag>.json`` (and ``bi_profile_<tag>.txt``)
under OUT_DIR.

    python experiments/exp_bi_speed.py OUT_DIR [--configs small,demo] [--profile] [--tag TAG]
        [--train-rounds N] [--gen-rounds N]

``--train-rounds`` / ``--gen-rounds`` time the runs round-robin after their own timing (one step or
one ``generate`` of each run a round; the median round is the row, the best round in brackets): the
H100 hosts' speed drifts by up to 1.7x within one process over seconds (stock ``generate`` measured
16-28 ms a token in five rounds of one call, ``host_time.py generate``), and interleaving lets the
drift hit every run alike.

Configurations (``CONFIGS``): ``small`` the 6-layer Llama of docs/benchmarks.md (hidden 1024,
vocabulary 32000, 8 x 1024 tokens), ``demo`` the demo's GPU configuration
(``truefuse/demo/train.py``'s ``gpu`` preset: hidden 2048, 16 layers, 16/8 heads, intermediate
5632, vocabulary 128256, 4 x 2048 tokens). The profile: torch.profiler over one training step of
fast and batch-invariant mode (the top ops by self GPU and by self CPU time, the GPU time by kind
of kernel, the step's wall time against its GPU busy time: a wall time well above the busy time is
host-bound) and over a short ``generate``; and the host time of one decode-sized ``F.linear``
stock vs routed in the mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.nn.functional as F

CONFIGS = {
    "small": dict(layers=6, hidden=1024, heads=16, kv_heads=8, intermediate=2048, vocab=32000, batch=8, seq=1024),
    "demo": dict(layers=16, hidden=2048, heads=16, kv_heads=8, intermediate=5632, vocab=128256, batch=4, seq=2048),
    # a smoke test of this script (``--device cpu``)
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, batch=2, seq=80),
}
DEVICE = "cuda"
#: kernel name fragments -> the kind the profile sums them under (first match wins)
KINDS = (
    ("attention", ("attention", "attn", "flash", "fmha")),
    ("bi gemm (triton)", ("_gemm_kernel",)),
    ("gemm (cublas)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_")),
    ("loss / log-probs", ("cross_entropy", "log_prob", "lce", "_loss")),
    ("norm", ("norm",)),
    ("rope", ("rope", "rotary")),
    ("gated act", ("gated", "swiglu", "silu")),
    ("optimizer", ("adam", "multi_tensor")),
)


def build(c: dict):
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(device=DEVICE, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32)


def variant(base, name: str):
    import copy

    from truefuse.integrations.huggingface import apply_truefuse

    m = copy.deepcopy(base)
    if name == "truefuse":
        apply_truefuse(m)
    elif name == "truefuse fused":  # issue 48's opt-in fusions; exp_graphs steps it with truefuse.optim.AdamW
        apply_truefuse(m, fuse_residual_norm=True, fuse_sibling_grads=True)
        m._exp_truefuse_adamw = True
    elif name == "truefuse siblings":  # each fusion alone, torch's AdamW (round-robin against "truefuse")
        apply_truefuse(m, fuse_sibling_grads=True)
    elif name == "truefuse resnorm":
        apply_truefuse(m, fuse_residual_norm=True)
    elif name == "truefuse BI fused":  # 48.6: batch-invariant mode with the same fusions and AdamW
        apply_truefuse(m, batch_invariant=True, fuse_residual_norm=True, fuse_sibling_grads=True)
        m._exp_truefuse_adamw = True
    elif name.startswith("truefuse BI"):
        apply_truefuse(m, batch_invariant=True)  # attention on truefuse.attention too
        if name == "truefuse BI 1by1":
            m._truefuse_bi_groups = []  # each projection its own launch (integrations/huggingface/siblings.py)
    return m


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t) / iters


def _kind(name: str) -> str:
    low = name.lower()
    for kind, frags in KINDS:
        if any(f in low for f in frags):
            return kind
    return "other"


def _profile(fn, title: str, rows: int = 22) -> tuple[str, dict]:
    """One call of ``fn`` under torch.profiler: (text tables, summary)."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - t
    ka = prof.key_averages()
    kinds: dict[str, float] = {}
    busy = 0.0
    for e in prof.events():
        # kernels only: a user annotation on the GPU row (``Optimizer.step#AdamW.step``) spans kernels
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            dur = e.time_range.elapsed_us() if hasattr(e, "time_range") else e.cuda_time_total
            busy += dur
            kinds[_kind(e.name)] = kinds.get(_kind(e.name), 0.0) + dur
    counts = {k: 0 for k in ("cudaLaunchKernel", "cuLaunchKernel", "cudaStreamSynchronize", "aten::_local_scalar_dense")}
    for e in ka:
        for k in counts:
            if e.key == k or e.key.startswith(k):
                counts[k] += e.count
    summary = {
        "wall_ms": wall * 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_ms_by_kind": {k: round(v / 1e3, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "counts": counts,
    }
    text = [f"==== {title}: wall {wall * 1e3:.2f} ms, GPU busy {busy / 1e3:.2f} ms", json.dumps(summary, indent=1)]
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        try:
            text.append(ka.table(sort_by=key, row_limit=rows, max_name_column_width=70))
        except Exception as exc:  # noqa: BLE001 - a profiler API that moved: keep the rest of the run
            text.append(f"(table by {key}: {exc})")
    return "\n".join(text), summary


def _linear_host_us(hidden: int, calls: int = 300) -> dict:
    """µs per decode-sized (8 rows) ``F.linear``, no grad: stock, routed in batch-invariant mode,
    and ``truefuse.gemm(batch_invariant=True)`` alone (a wall time over many queued calls: the
    host's cost wherever it exceeds the kernel's)."""
    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant
    from truefuse.ops.gemm.gemm import gemm

    x = torch.randn(8, hidden, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(hidden, hidden, device=DEVICE, dtype=torch.bfloat16)
    res = {}
    with torch.no_grad():
        res["F.linear stock"] = _timed(lambda: F.linear(x, w), 20, calls) * 1e6
        res["gemm(batch_invariant=True)"] = _timed(lambda: gemm(x, w.t(), batch_invariant=True), 20, calls) * 1e6
        with running_batch_invariant():
            res["F.linear in BI mode"] = _timed(lambda: F.linear(x, w), 20, calls) * 1e6
    with running_batch_invariant():
        wg = w.clone().requires_grad_()
        res["F.linear in BI mode, grad"] = _timed(lambda: F.linear(x, wg), 20, calls) * 1e6
    return {k: round(v, 1) for k, v in res.items()}


def run_config(name: str, c: dict, args, prof_lines: list[str]) -> dict:
    tokens = c["batch"] * c["seq"]
    base = build(c)
    ids = torch.randint(1, c["vocab"], (c["batch"], c["seq"]), device=DEVICE)
    prompts = ids[:, :64]
    rows, profiles, gens, steps = {}, {}, {}, {}
    for vname in ("stock", "truefuse", "truefuse BI") + (("truefuse BI 1by1",) if args.one_by_one else ()):
        m = variant(base, vname)
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)  # the demo's and Trainer's default

        def step(m=m, opt=opt):
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        train_s = _timed(step, args.warmup, args.iters) if args.train else float("nan")
        if args.train and args.train_rounds:
            steps[vname] = (m, step)  # kept (model and optimizer) for the interleaved rounds below
        if args.profile and args.train and vname != "stock":
            text, profiles[f"train {vname}"] = _profile(step, f"{name}: one training step, {vname}")
            prof_lines.append(text)
        del opt
        m.eval()
        new = args.new_tokens

        def gen(m=m, new=new):
            m.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)  # fmt: skip

        with torch.no_grad():
            gen_s = _timed(gen, 1, args.gen_iters)
            if args.profile and vname != "truefuse":
                text, profiles[f"generate {vname}"] = _profile(
                    lambda: gen(new=8), f"{name}: generate 8 tokens, batch {c['batch']}, {vname}"
                )
                prof_lines.append(text)
            if args.cprofile:
                prof_lines.append(_cprofile(lambda: gen(new=8), f"{name}: generate 8 tokens, batch {c['batch']}, {vname}"))
        rows[vname] = {"train_tok_s": tokens / train_s, "gen_tok_s": c["batch"] * new / gen_s}
        gens[vname] = gen
        if args.gen_rounds or steps:
            continue  # kept for the interleaved rounds below
        del m
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if steps:  # each round times one training step of every run in turn: the host's drift hits all alike
        step_times: dict = {v: [] for v in steps}
        for m, _ in steps.values():
            m.train()
        for _ in range(args.train_rounds):
            for v, (_, step) in steps.items():
                step_times[v].append(_timed(step, 0, 1))
        for m, _ in steps.values():
            m.eval()
        for v, ts in step_times.items():
            rows[v]["train_tok_s"] = tokens / sorted(ts)[len(ts) // 2]
            rows[v]["train_tok_s_best"] = tokens / min(ts)
        steps.clear()
    if args.gen_rounds:  # each round times one generate of every run in turn: the host's drift hits all alike
        times: dict = {v: [] for v in gens}
        with torch.no_grad():
            for _ in range(args.gen_rounds):
                for v, gen in gens.items():
                    times[v].append(_timed(gen, 0, 1))
        for v, ts in times.items():
            rows[v]["gen_tok_s"] = c["batch"] * args.new_tokens / sorted(ts)[len(ts) // 2]
            rows[v]["gen_tok_s_best"] = c["batch"] * args.new_tokens / min(ts)
        gens.clear()
    out = {"config": c, "rows": rows, "profiles": profiles}
    if args.profile:
        out["linear_host_us"] = _linear_host_us(c["hidden"])
        prof_lines.append(f"==== {name}: host time of one F.linear (8 x {c['hidden']} @ {c['hidden']}^2), us\n"
                          + json.dumps(out["linear_host_us"], indent=1))  # fmt: skip
    del base
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def _cprofile(fn, title: str, rows: int = 28) -> str:
    """cProfile's top functions by own time over one call of ``fn`` (after a warm call): where a
    host-bound ``generate`` spends its host time, by Python function."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize() if DEVICE == "cuda" else None
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(rows)
    pstats.Stats(pr, stream=buf).sort_stats("cumtime").print_stats(rows)
    return f"==== cProfile {title}\n" + buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--configs", default="small", help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--cprofile", action="store_true", help="Python's profile of one generate per run (host time by function)")
    p.add_argument("--no-train", dest="train", action="store_false", help="generate only")
    p.add_argument("--tag", default="run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--gen-iters", type=int, default=3)
    p.add_argument("--one-by-one", action="store_true", help="also BI with each sibling projection launched alone")
    p.add_argument("--gen-rounds", type=int, default=0, help="then time generate round-robin over the runs (median of N)")
    p.add_argument(
        "--train-rounds",
        type=int,
        default=0,
        help="then time training steps round-robin over the runs (median of N; the best too)",
    )
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (config tiny)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    os.makedirs(args.out_dir, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "configs": {}}
    prof_lines: list[str] = []
    table = [f"{'config':<7} {'run':<12} {'train tok/s':>12} {'vs fast':>8} {'generate tok/s':>15} {'vs stock':>9}"
             "  (best round: vs fast, vs stock)"]  # fmt: skip
    for name in args.configs.split(","):
        r = run_config(name, CONFIGS[name], args, prof_lines)
        result["configs"][name] = r
        fast, stock = r["rows"]["truefuse"], r["rows"]["stock"]
        for vname, row in r["rows"].items():
            tr, gn = row["train_tok_s"], row["gen_tok_s"]
            tf, gs = tr / fast["train_tok_s"], gn / stock["gen_tok_s"]
            line = f"{name:<7} {vname:<12} {tr:>12.0f} {tf:>8.3f} {gn:>15.0f} {gs:>9.3f}"
            best = [row.get(k, float("nan")) / base.get(k, float("nan")) for k, base in
                    (("train_tok_s_best", fast), ("gen_tok_s_best", stock))]  # fmt: skip
            table.append(line + f"  ({best[0]:.3f}, {best[1]:.3f})")
        with open(os.path.join(args.out_dir, f"bi_speed_{args.tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
        if prof_lines:
            with open(os.path.join(args.out_dir, f"bi_profile_{args.tag}.txt"), "w") as f:
                f.write("\n\n".join(prof_lines) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
