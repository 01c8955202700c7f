"""Where a training step goes under FSDP2: stock transformers vs ``apply_truefuse`` (vs Liger-Kernel
when importable), each decoder layer and the root ``fully_shard``-ed, on every local GPU.

Per run and rank: ms per step (after warm-up), then one step under
``torch.cuda.set_sync_debug_mode("warn")`` (the host synchronisations and where they are called),
then one profiled step (rank 0 records it): the top ops by self CPU and self CUDA time, the host time spent
waiting in CUDA synchronisation calls, and how much of the step's wall time the GPU's compute
stream is busy (the union of kernel intervals). Writes ``OUT/fsdp_<policy>.txt`` and ``.json``.

Run: ``PYTHONPATH=. python experiments/exp_fsdp_profile.py OUT --policy mp`` on 2+ GPUs
(``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1``); ``--policy bf16``
for pure bf16 parameters; ``--small`` for hidden 1024, 4 layers, vocabulary 32000. A run named
``<run>+compile`` (``--runs stock+compile,truefuse+compile``) has each decoder layer
``torch.compile``-d before it is sharded (TorchTitan's recipe). ``--abba`` runs them in order and
then in reverse (the host slows within a call: the first run had a faster host than the last).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import gc
import json
import os
import signal
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, heads=16, kv=8)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, heads=4, kv=2)
SMALL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, heads=16, kv=8)


def _no_target_wait(*args):
    return lambda: None


def _patch(name):
    if name == "truefuse-nocheck":  # the loss's target check neither waited for nor raised: its cost
        import truefuse.ops.lm_head.linear_cross_entropy as lce

        lce._check_finish = _no_target_wait
    if name.startswith("truefuse"):
        from truefuse.integrations.huggingface import apply_truefuse

        return apply_truefuse
    if name == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        return lambda m: apply_liger_kernel_to_llama(model=m)
    return None


def _log(rank, msg):
    print(f"[{time.strftime('%H:%M:%S')} rank{rank}] {msg}", flush=True)


def _build(shape, policy, run, head_unit, dev, no_fsdp=False, prefetch=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    dtype = torch.float32 if policy == "mp" else torch.bfloat16
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype)
    patch = _patch(run.removesuffix("+compile"))
    if patch is not None:
        patch(model)
    if run.endswith("+compile"):  # TorchTitan's recipe: each decoder layer compiled, then sharded
        from truefuse.integrations.huggingface import compile_layers

        compile_layers(model)
    kw = {}
    if no_fsdp:  # the same model and step without FSDP2 (its hooks' host time, by difference)
        model.train()
        return model
    if policy == "mp":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    if prefetch:  # explicit forward prefetch: layer i's all-gather issued at layer i-1's, not when the host reaches it
        layers = list(model.model.layers)
        for a, b in zip(layers, layers[1:], strict=False):
            a.set_modules_to_forward_prefetch([b])
    if head_unit:
        fully_shard(model.lm_head, **kw)
    fully_shard(model, **kw)
    model.train()
    return model


def _kernel_spans(prof) -> list[tuple[float, float]]:
    """The profiled window's GPU kernel intervals, merged where they overlap, in time order (µs)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    )
    merged: list[list[float]] = []
    for s, t in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    return [(s, t) for s, t in merged]


def _busy_fraction(prof, wall_ms: float) -> float:
    """Union of GPU kernel intervals over the profiled window / its wall time."""
    busy = sum(t - s for s, t in _kernel_spans(prof))
    return busy / 1000.0 / wall_ms if wall_ms else 0.0


def _idle_attribution(prof, min_gap_us: float = 50.0, top: int = 14) -> dict:
    """Where the host was while the GPU sat idle: the GPU's idle gaps (between kernel intervals,
    longer than ``min_gap_us``) and, per CPU op name at depth 0, 1 and 2 of the host's op tree, the
    time its interval overlaps those gaps (ms). A host-bound step shows here which work the GPU waited for."""
    spans = _kernel_spans(prof)
    gaps = [(a[1], b[0]) for a, b in zip(spans, spans[1:], strict=False) if b[0] - a[1] > min_gap_us]
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    out = {"gaps": len(gaps), "idle_ms": sum(b - a for a, b in gaps) / 1e3}
    starts = [g[0] for g in gaps]

    def depth(e):
        d, p = 0, e.cpu_parent
        while p is not None:
            d, p = d + 1, p.cpu_parent
        return d

    acc = {level: collections.Counter() for level in (0, 1, 2)}
    for e in cpu:
        level = depth(e)
        if level not in acc:
            continue
        a, b = e.time_range.start, e.time_range.end
        i = max(0, bisect.bisect_right(starts, a) - 1)
        ov = 0.0
        while i < len(gaps) and gaps[i][0] < b:
            ov += max(0.0, min(b, gaps[i][1]) - max(a, gaps[i][0]))
            i += 1
        acc[level][e.name] += ov / 1e3
    for level, counts in acc.items():
        out[f"depth{level}"] = [(k, round(v, 2)) for k, v in counts.most_common(top) if v > 0]
    return out


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


class _GcClock:
    """Wall time spent in Python's garbage collector (``gc.callbacks``), ms since the last read."""

    def __init__(self):
        self.ms, self._t = 0.0, None
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.ms += (time.perf_counter() - self._t) * 1e3
            self._t = None

    def read(self) -> float:
        ms, self.ms = self.ms, 0.0
        return ms

    def close(self):
        gc.callbacks.remove(self._cb)


def _one_run(rank, shape, policy, run, head_unit, seq, batch, steps, warmup, dev, no_fsdp=False, optim="foreach",
             prefetch=False, cprofile=False):  # fmt: skip
    _log(rank, f"{run} {policy}: build")
    model = _build(shape, policy, run, head_unit, dev, no_fsdp, prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if optim == "fused" else {}))
    g = torch.Generator(dev).manual_seed(1 + rank)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=dev, generator=g)
    losses = []

    marks: list[float] = []

    def step(fwd_ctx=contextlib.nullcontext):
        with fwd_ctx():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, host, phases, gcs = [], [], [], []
    clock = _GcClock()
    for i in range(warmup + steps):
        _sync(dev)
        dist.barrier()
        marks.clear()
        clock.read()
        t0 = time.perf_counter()
        loss = step()
        if i >= warmup:  # every kernel queued: host ≈ step time means the GPU waited on the host
            t1 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            # host ms of forward, backward, clip, optimizer (no synchronisation between them)
            phases.append([(b - a) * 1e3 for a, b in zip([t0, *marks], [*marks, t1], strict=True)])
            gcs.append(clock.read())
        losses.append(loss.item())
        _sync(dev)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        _log(rank, f"{run} step {i}: {(time.perf_counter() - t0) * 1e3:.1f} ms loss {losses[-1]:.4f}")
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
    # host synchronisations of one step, by call site
    sites = collections.Counter()
    _sync(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if dev == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = step()
        finally:
            if dev == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
    loss.item()
    clock.close()
    mid = sorted(range(len(host)), key=host.__getitem__)[len(host) // 2]
    from torch._dynamo.utils import counters

    breaks = {r[:160]: n for r, n in counters["graph_break"].items()}  # Dynamo's so far in this process
    res = dict(graph_breaks=breaks, run=run, policy=policy, ms=sorted(times)[len(times) // 2], ms_all=times, host_ms=host[mid],
               host_phases_ms=[round(x, 1) for x in phases[mid]], gc_ms=round(max(gcs), 2),
               peak_gib=peak, losses=losses,
               syncs=sum(sites.values()), sync_sites=sites.most_common(12))  # fmt: skip
    _log(rank, f"{run}: {res['syncs']} syncs in one step; profiling")
    # every rank runs the profiled steps (FSDP2's collectives need them all); rank 0 records them
    from torch.profiler import ProfilerActivity, profile

    _sync(dev)
    dist.barrier()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) if rank == 0 else contextlib.nullcontext() as prof:
        t0 = time.perf_counter()
        step()
        _sync(dev)
        wall = (time.perf_counter() - t0) * 1e3
    if rank == 0:
        ka = prof.key_averages()
        res["profile_wall_ms"] = wall
        res["gpu_busy"] = _busy_fraction(prof, wall)
        try:  # a diagnostic: never lose the run's timings to it
            res["idle"] = _idle_attribution(prof)
        except Exception as err:  # noqa: BLE001
            _log(rank, f"idle attribution failed: {err!r}")
        waits = {k.key: k.cpu_time_total / 1e3 for k in ka if "Synchronize" in k.key or "cudaStreamWait" in k.key}
        res["sync_wait_ms_per_step"] = waits
        res["top_cuda"] = ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
        res["top_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
        _log(rank, f"{run}: profiled, GPU busy {res['gpu_busy']:.0%}")
    if cprofile:  # the host's Python of one forward (rank 0), by function: where the forward's host time goes
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()

        @contextlib.contextmanager
        def fwd():
            pr.enable()
            try:
                yield
            finally:
                pr.disable()

        _sync(dev)
        dist.barrier()
        step(fwd if rank == 0 else contextlib.nullcontext)
        _sync(dev)
        if rank == 0:
            out = io.StringIO()
            st = pstats.Stats(pr, stream=out)
            st.sort_stats("tottime").print_stats(25)
            st.sort_stats("cumulative").print_stats(40)
            res["cprofile_fwd"] = out.getvalue()
    dist.barrier()
    return res


def _sequence(runs: str, abba: bool) -> list[tuple[str, int]]:
    """The runs in the order they run, each with its pass (1, or 2 for ``--abba``'s reversed
    second pass). Liger last and once: ``apply_liger_kernel_to_llama`` replaces transformers'
    Llama classes for the whole process, so every model built after it is Liger's (a stock or
    truefuse run after it failed: ``'LigerSwiGLUMLP' object has no attribute 'act_fn'``)."""
    names = runs.split(",")
    rest = [n for n in names if n != "liger"]
    order = [(n, 1) for n in rest] + ([(n, 2) for n in reversed(rest)] if abba else [])
    return order + ([("liger", 1)] if "liger" in names else [])


def _merged(results: list[dict]) -> list[dict]:
    """One entry per run: ``--abba``'s two passes as their mean (``ms``), each kept in ``ms_passes``
    (the host slows within a call, 1.0-1.8x between its first and last run on 2 H100s, so a
    run's place in the order moves its time)."""
    merged: dict[str, dict] = {}
    for r in results:
        m = merged.setdefault(r["run"], {**r, "ms_passes": []})
        m["ms_passes"].append(r["ms"])
    for m in merged.values():
        m["ms"] = sum(m["ms_passes"]) / len(m["ms_passes"])
    return list(merged.values())


def _worker(rank, world, args, q):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dev = args.device
    if dev == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    _log(rank, "process group up")
    shape = TINY if args.tiny else SMALL if args.small else BIG
    out = []
    for run, npass in _sequence(args.runs, args.abba):
        if run == "liger":
            try:
                import liger_kernel  # noqa: F401
            except ImportError:
                continue
        r = _one_run(
            rank,
            shape,
            args.policy,
            run,
            args.head_unit,
            args.seq,
            args.batch,
            args.steps,
            args.warmup,
            dev,
            args.no_fsdp,
            args.optim,
            args.prefetch,
            args.cprofile,
        )
        r["rank"], r["pass"] = rank, npass
        out.append(r)
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--policy", choices=["mp", "bf16"], default="mp")
    p.add_argument("--small", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy (check the script on the CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--world", type=int, default=0, help="ranks (default: the GPU count)")
    p.add_argument("--head-unit", action="store_true")
    p.add_argument("--optim", choices=["foreach", "fused"], default="foreach", help="torch AdamW's implementation")
    p.add_argument("--no-fsdp", action="store_true", help="the same step without fully_shard (--policy bf16, --world 1)")
    p.add_argument("--prefetch", action="store_true", help="explicit forward prefetch of the next layer's all-gather")
    p.add_argument("--runs", default="stock,truefuse,liger")
    p.add_argument("--cprofile", action="store_true", help="cProfile one forward per run (rank 0), in the .txt")
    p.add_argument("--abba", action="store_true", help="the runs, then again in reverse order (Liger once, last); the mean")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    world = args.world or torch.cuda.device_count()
    if args.no_fsdp and (args.policy != "bf16" or world != 1):
        p.error("--no-fsdp needs --policy bf16 and --world 1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, args, q), daemon=True) for r in range(world)]

    def stop(*_):  # a timeout's SIGTERM: take the ranks down too (orphans would hold the GPUs)
        for pr in procs:
            pr.kill()
        os._exit(124)

    signal.signal(signal.SIGTERM, stop)
    for pr in procs:
        pr.start()
    results = dict(q.get() for _ in procs)
    for pr in procs:
        pr.join()
    tag = f"fsdp_{args.policy}{'_small' if args.small else ''}{'_head' if args.head_unit else ''}"
    tag += ("_nofsdp" if args.no_fsdp else "") + ("_fused" if args.optim == "fused" else "")
    tag += ("_prefetch" if args.prefetch else "") + (f"_world{world}" if world != torch.cuda.device_count() else "")
    with open(os.path.join(args.out, tag + ".json"), "w") as f:
        json.dump({"world": world, "args": vars(args), "results": results}, f, indent=1, default=str)
    lines = [f"{tag}: world {world}, {args.batch}x{args.seq} tokens per rank"]
    r0 = _merged(results[0])
    base = next((r["ms"] for r in r0 if r["run"] == "stock"), None)
    for r in r0:
        other = [x for x in _merged(results[1]) if x["run"] == r["run"]] if world > 1 else []
        passes = f" (passes {' / '.join(f'{t:.1f}' for t in r['ms_passes'])})" if len(r["ms_passes"]) > 1 else ""
        lines.append(
            f"{r['run']:>9}: {r['ms']:7.1f} ms/step{passes} (rank1 {other[0]['ms'] if other else float('nan'):7.1f})"
            f"  host {r['host_ms']:6.1f} ms"
            f"  {base / r['ms'] if base else float('nan'):.2f}x stock  peak {r['peak_gib']:.1f} GiB"
            f"  syncs/step {r['syncs']}  gpu busy {r.get('gpu_busy', 0):.0%}  loss0 {r['losses'][0]:.4f}"
        )
        lines.append(f"           host fwd/bwd/clip/opt ms: {r['host_phases_ms']}  gc ms (max step): {r['gc_ms']}")
        lines.append(f"           sync sites: {r['sync_sites'][:6]}")
        if r.get("graph_breaks"):
            lines.append(f"           Dynamo graph breaks (process so far): {r['graph_breaks']}")
        lines.append(f"           sync waits ms/step: {r.get('sync_wait_ms_per_step')}")
        idle = r.get("idle")
        if idle:
            lines.append(f"           GPU idle: {idle['gaps']} gaps, {idle['idle_ms']:.1f} ms; host during them:")
            for level in ("depth0", "depth1", "depth2"):
                lines.append(f"             {level}: {idle[level]}")
    with open(os.path.join(args.out, tag + ".txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
        for r in r0:
            f.write(f"\n==== {r['run']} top CUDA\n{r.get('top_cuda', '')}\n==== {r['run']} top CPU\n{r.get('top_cpu', '')}\n")
            if r.get("cprofile_fwd"):
                f.write(f"\n==== {r['run']} cProfile of one forward (rank 0)\n{r['cprofile_fwd']}\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
