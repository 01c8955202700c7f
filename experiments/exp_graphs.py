"""What issue 47 must show, in one run on one GPU: a whole training step captured in one CUDA graph
(``truefuse.integrations.cuda_graph.graph_step``, docs/cuda_graphs.md) against the same step eager,
stock / truefuse / truefuse BI / Liger; and greedy ``generate`` eager (dynamic cache) against a
static cache with ``model.forward = torch.compile(model.forward, mode="reduce-overhead")``, stock /
truefuse / truefuse BI; every speed with a bitwise check. Prints a compact table last and writes
``graphs_<config>.json`` to OUT (rewritten after every phase, so a run cut short keeps what it has).

    PYTHONPATH=. python experiments/exp_graphs.py OUT [--config small|demo] [--parts train,generate]
        [--variants "stock,truefuse,truefuse BI,liger,liger nolce"] [--train-rounds 15] [--gen-rounds 5]
        [--gen-batches 1,8,32] [--recipes eager,compiled] [--deadline-s S] [--share-pool]
    python experiments/exp_graphs.py --smoke OUT     # the CPU, a tiny Llama: eager and static cache only

Run from the repository root (it imports ``build`` / ``variant`` from its sibling ``exp_bi_speed``).
Configurations: ``small`` hidden 1024, 4 layers, vocabulary 32000, 16/8 heads, intermediate 2816,
4 x 2048 tokens a step; ``demo`` the demo's GPU preset (hidden 2048, 16 layers, vocabulary 128256,
intermediate 5632, 4 x 2048); bf16 parameters (``exp_bi_speed.build``: transformers' Llama, SDPA).

``train``: every run keeps its model and optimizer resident; the step is docs/cuda_graphs.md's
(forward with ``labels``, backward, ``clip_grad_norm_(1.0)``, fused AdamW ``capturable=True`` with a
tensor learning rate, ``zero_grad(set_to_none=True)``, returns ``loss.detach()``), the same function
eager and graphed. Two phases:

1. bits, one variant at a time: two copies of the variant from the same weights, one stepped eagerly,
   one through ``graph_step(step, warmup=--graph-warmup)`` (eager warm-up, capture, replays), on
   the same ``--bits-steps`` batches; every loss compared bit for bit, and every parameter after.
2. speed, all variants resident: one model and optimizer a variant, stepped both eagerly and through
   its graph (so graphed / eager compares the same weights and optimizer); each round runs one step
   of every (variant, eager | graphed) in turn (the hosts drift by up to 1.7x within a process:
   interleaving spreads it over every run), after ``--graph-warmup + 2`` untimed rounds. A step is
   timed by CUDA events around it (the device synchronised before it); the row is the median round.
   MFU = (6 N T + 6 L S d T) / (t * 989.5 TFLOP/s): N the parameters less the input embedding (the
   untied head counted), T tokens a step, L layers, S the sequence, d hidden; 6 L S d a token is
   causal attention's QK^T and PV forward + backward (half of PaLM's 12 L S d); 989.5 = H100/H200
   SXM dense bf16.

Liger: ``apply_liger_kernel_to_llama(model=...)`` (the demo's patch, truefuse/demo/cli.py). It also
rebinds module-level names of ``transformers.models.llama.modeling_llama`` (its RoPE function, the
norm and MLP classes): those are put back at once and installed only around the Liger runs' own
calls, so the stock and truefuse runs resident beside it keep theirs. Liger's fused loss reads a
count on the host (``.item()``), which a capture cannot do, and a failed capture leaves torch 2.11's
CUDA generator unusable for the process: so ``liger`` runs eagerly in both columns (``READS_HOST``).
``liger nolce`` is Liger without its fused loss (transformers' loss), which can be captured; it is
the last variant, so that a failed capture of it spoils no other.

``generate``: prompts of ``--prompt-len`` random tokens, ``--new-tokens`` new tokens (``min_new_tokens``
too), greedy, at each of ``--gen-batches``. Recipes: ``eager`` (dynamic cache), ``static`` (static
cache, eager forward: the smoke test's), ``graphed`` (static cache, decode steps replayed as CUDA
graphs of the eager forward: ``truefuse.integrations.huggingface.graph_decode``), ``compiled``
(static cache, forward compiled with ``--compile-mode``; transformers' own auto-compile off,
``disable_compile=True``, so the forward is compiled once, by this script). Eager, static and
graphed are timed round-robin over variants and batches.
``compiled`` runs a block per variant (``torch._dynamo.reset()`` before each, as a compiled forward per
variant would hit Dynamo's recompile limit and share its CUDA-graph trees; the limit raised to 64 for
the graph breaks' frames): per batch one eager ``generate`` with logits (the reference), one compiled
``generate`` untimed (compile; its time is ``warm_s``), one compiled with logits (the bits check
against the eager one: logits and tokens); then per batch (one after the other: a new batch size
gets a new static cache, whose new addresses the CUDA-graph trees record again) one untimed
``generate`` and ``--gen-rounds`` rounds, each timing one compiled ``generate`` and one eager stock
``generate`` at the first batch (a separate stock copy: the yardstick every block shares, so "BI
compiled vs stock eager at batch 1" is paired within BI's block; ratios between compiled blocks are
not interleaved, and the JSON keeps each block's yardstick to correct for drift). Each block's
Dynamo counters (graphs, graph breaks, CUDA-graph skips) go to the table. A recipe that fails is
one line in the table (exception type, first 200 characters); the others go on.

Budget (one H100, not yet measured): ``--config small`` both parts ~4-6 minutes, most of it cold
Triton and Inductor compiles (give ``--deadline-s 420``: past it no new block starts and the table
still prints); ``--config demo`` needs more: its four variants' weights and AdamW states are ~8 GB
each, so run ``--variants "stock,truefuse,truefuse BI" --share-pool`` (one CUDA-graph pool for every
graph: safe here because every step's temporaries die inside it and its loss is cloned before the
next call) or fewer variants, ``--train-rounds 8``, and allow ~10-15 minutes (or one part per call).
Neither configuration has run on a GPU yet (written 2026-12-07 without one; ``--smoke`` checked).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exp_bi_speed as bis  # noqa: E402  (build, variant: the same Llama and patches as exp_bi_speed)

from truefuse.demo.cli import LIGER_READS_HOST  # noqa: E402
from truefuse.integrations.huggingface import graph_decode  # noqa: E402

CONFIGS = {
    "small": dict(layers=4, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=32000, batch=4, seq=2048),
    "demo": dict(layers=16, hidden=2048, heads=16, kv_heads=8, intermediate=5632, vocab=128256, batch=4, seq=2048),
    # --smoke: the CPU, this script's logic only
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, batch=2, seq=64),
}
PEAK_TFLOPS = 989.5  # H100 / H200 SXM, dense bf16
TRAIN_VARIANTS = (
    "stock", "truefuse", "truefuse fused", "truefuse siblings", "truefuse resnorm", "truefuse BI", "truefuse BI fused",
    "liger", "liger nolce",
)  # fmt: skip
GEN_VARIANTS = ("stock", "truefuse", "truefuse BI")
LIGER = ("liger", "liger nolce")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def err_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}".replace("\n", " ")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


class Ctx:
    """The run's settings, its results (the JSON) and its deadline."""

    def __init__(self, args):
        self.args = args
        self.device = args.device
        self.cuda = args.device == "cuda"
        self.c = CONFIGS[args.config]
        self.result: dict = {"meta": meta(args), "args": vars(args), "notes": [], "elapsed_s": {}}
        self.path = os.path.join(args.out, f"graphs_{args.config}.json")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def past_deadline(self) -> bool:
        d = self.args.deadline_s
        return bool(d) and time.perf_counter() - T0 > d

    def note(self, msg: str) -> None:
        log("note: " + msg)
        self.result["notes"].append(msg)

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.result, f, indent=1, default=str)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def meta(args) -> dict:
    m = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    from importlib.metadata import PackageNotFoundError, version

    for mod, dist in (("triton", "triton"), ("transformers", "transformers"), ("liger_kernel", "liger-kernel")):
        try:
            m[mod] = version(dist)
        except PackageNotFoundError:
            m[mod] = "not installed"
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        m["commit"] = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except Exception:  # noqa: BLE001 - no git on the machine
        m["commit"] = "?"
    return m


# ---------------------------------------------------------------- the variants


class LigerScope:
    """Liger's patch on one model; its module-level rebindings in ``modeling_llama`` (RoPE function,
    norm and MLP classes) undone at once and installed only inside ``with scope():``, around this
    run's own calls (a captured step records them at capture)."""

    _MISSING = object()

    def __init__(self, model, **kw):
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.models.llama import modeling_llama

        self.mod = modeling_llama
        before = dict(vars(modeling_llama))
        apply_liger_kernel_to_llama(model=model, **kw)
        after = dict(vars(modeling_llama))
        self.theirs = {k: v for k, v in after.items() if before.get(k, self._MISSING) is not v}
        self.ours = {k: before.get(k, self._MISSING) for k in self.theirs}
        self._install(self.ours)

    def _install(self, values: dict) -> None:
        for k, v in values.items():
            if v is self._MISSING:
                vars(self.mod).pop(k, None)
            else:
                setattr(self.mod, k, v)

    @contextlib.contextmanager
    def __call__(self):
        self._install(self.theirs)
        try:
            yield
        finally:
            self._install(self.ours)


def make_model(base, name: str):
    """(model, scope): ``scope()`` is the context every call of this run runs in."""
    if name in LIGER:
        m = copy.deepcopy(base)
        scope = LigerScope(m, fused_linear_cross_entropy=name == "liger")
        return m, scope
    return bis.variant(base, name), contextlib.nullcontext


def make_step(model, ctx: Ctx):
    """docs/cuda_graphs.md's step, eager or to capture: the same function either way."""
    params = [p for p in model.parameters() if p.requires_grad]
    lr = torch.tensor(3e-4, device=ctx.device) if ctx.cuda else 3e-4  # a tensor: a replay reads it
    if getattr(model, "_exp_truefuse_adamw", False):  # "truefuse fused" (exp_bi_speed.variant): always capturable
        from truefuse.optim import AdamW

        opt = AdamW(params, lr=lr)
    else:
        opt = torch.optim.AdamW(params, lr=lr, fused=True, capturable=ctx.cuda)

    def step(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, opt


#: variants whose step reads the host, so that a capture of it would fail (and a failed capture leaves
#: torch 2.11's CUDA generator unusable for the process): they run eagerly in both columns. No eager
#: check finds these: transformers' masks sync in eager mode and not while capturing, so a step
#: run under ``set_sync_debug_mode("error")`` raised for every variant (H100, 2026-12-07).
READS_HOST = {"liger": LIGER_READS_HOST}


# ---------------------------------------------------------------- training


def flops_per_step(c: dict, n: int) -> float:
    t = c["batch"] * c["seq"]
    return 6 * n * t + 6 * c["layers"] * c["seq"] * c["hidden"] * t


def timed(ctx: Ctx, fn):
    """(fn's output, ms): CUDA events around ``fn`` after a device sync (the CPU: wall time)."""
    ctx.sync()
    if ctx.cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        b.synchronize()
        return out, a.elapsed_time(b)
    t = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t) * 1e3


def train_bits(ctx: Ctx, base, names, batches, blockers) -> dict:
    """Per variant, one at a time: eager copy vs graphed copy, same weights and batches."""
    args, out = ctx.args, {}
    for name in names:
        if ctx.past_deadline():
            out[name] = {"skipped": "deadline"}
            continue
        row: dict = {}
        out[name] = row
        try:
            if ctx.cuda and name in READS_HOST:
                blockers[name] = READS_HOST[name]
            graphs = ctx.cuda and blockers.get(name) is None
            m_e, scope_e = make_model(base, name)
            m_g, scope_g = make_model(base, name)
            m_e.train(), m_g.train()
            step_e, _ = make_step(m_e, ctx)
            step_g, _ = make_step(m_g, ctx)
            if graphs:
                from truefuse.integrations.cuda_graph import graph_step

                step_g = graph_step(step_g, warmup=args.graph_warmup, packed_sequences=False)
            row["against"] = "graphed" if graphs else "eager (no graph: " + (blockers.get(name) or "CPU") + ")"
            la, lb = [], []
            for i in range(args.bits_steps):
                ids = batches[i % len(batches)]
                with scope_e():
                    la.append(step_e(ids).clone())
                with scope_g():
                    lb.append(step_g(ids).clone())
            a, b = torch.stack(la).float().cpu(), torch.stack(lb).float().cpu()
            same = [bool(x) for x in (a == b)]
            diff_params = [n for (n, p), q in zip(m_e.named_parameters(), m_g.parameters(), strict=True) if not torch.equal(p, q)]
            row.update(
                steps=len(same),
                losses_equal=all(same),
                first_diff_step=same.index(False) if not all(same) else None,
                max_abs_diff=float((a - b).abs().max()),
                params_equal=not diff_params,
                params_differing=len(diff_params),
                losses_eager=a.tolist(),
                losses_other=b.tolist(),
            )
            verdict = "equal" if row["losses_equal"] else "DIFFER"
            params = "equal" if row["params_equal"] else f"{len(diff_params)} differ"
            log(f"train bits {name}: {row['against']}: losses {verdict} ({sum(same)}/{len(same)}), params {params}")
        except Exception as e:  # noqa: BLE001 - one line, the rest goes on
            row["error"] = err_line(e)
            log(f"train bits {name}: FAILED {row['error']}")
            # no second capture of a step that failed here (a failed capture spoils the CUDA generator)
            blockers.setdefault(name, None)
            blockers[name] = blockers[name] or "its bits phase failed: " + row["error"]
        finally:
            m_e = m_g = step_e = step_g = scope_e = scope_g = None  # noqa: F841 - freed before the next variant
            ctx.free()
    return out


def train_speed(ctx: Ctx, base, names, batches, blockers) -> dict:
    args = ctx.args
    pool = torch.cuda.graph_pool_handle() if ctx.cuda and args.share_pool else None
    runs: dict = {}  # (name, mode) -> (callable, scope)
    errors: dict = {}
    keep = []
    for name in names:
        try:
            m, scope = make_model(base, name)
            m.train()
            step, opt = make_step(m, ctx)
            keep.append((m, opt))
            runs[(name, "eager")] = (step, scope)
            if not ctx.cuda:
                continue
            if blockers.get(name):
                errors[(name, "graphed")] = "skipped: " + blockers[name]
                continue
            from truefuse.integrations.cuda_graph import graph_step

            runs[(name, "graphed")] = (graph_step(step, warmup=args.graph_warmup, pool=pool, packed_sequences=False), scope)
        except Exception as e:  # noqa: BLE001
            errors[(name, "eager")] = err_line(e)
    warm = args.graph_warmup + 2 if ctx.cuda else 1
    times: dict = {k: [] for k in runs}
    done_rounds = 0
    for r in range(warm + args.train_rounds):
        if r >= warm + min(5, args.train_rounds) and ctx.past_deadline():
            ctx.note(f"train: rounds cut to {done_rounds} by the deadline")
            break
        ids = batches[r % len(batches)]
        for key in list(runs):
            if key not in runs:  # dropped earlier in this round
                continue
            fn, scope = runs[key]
            try:
                with scope():
                    _, ms = timed(ctx, lambda fn=fn, ids=ids: fn(ids).clone())
            except Exception as e:  # noqa: BLE001 - drop this run, keep the others
                errors[key] = err_line(e) + (
                    " (in its capture: the process's CUDA generator may be unusable now)" if key[1] == "graphed" else ""
                )
                log(f"train {key}: FAILED {errors[key]}")
                del runs[key]
                if key[1] == "eager" and (key[0], "graphed") in runs:  # not captured after its eager step failed
                    errors[(key[0], "graphed")] = "skipped: its eager step failed"
                    del runs[(key[0], "graphed")]
                continue
            if r >= warm:
                times[key].append(ms)
        if r == warm - 1:
            log(f"train: {warm} warm-up rounds done" + (" (graphs captured)" if ctx.cuda else ""))
        if r >= warm:
            done_rounds += 1
    n = ctx.result["train"]["params_n"]
    rows = {}
    for key, ts in times.items():
        if not ts:
            continue
        med = median(ts)
        rows[f"{key[0]} | {key[1]}"] = {
            "variant": key[0],
            "mode": key[1],
            "ms": med,
            "ms_best": min(ts),
            "ms_rounds": ts,
            "tok_s": ctx.c["batch"] * ctx.c["seq"] / med * 1e3,
            "mfu": flops_per_step(ctx.c, n) / (med * 1e-3) / (PEAK_TFLOPS * 1e12) if ctx.cuda else float("nan"),
        }
    peak = torch.cuda.max_memory_allocated() / 2**30 if ctx.cuda else None
    del runs, keep
    ctx.free()
    return {
        "rows": rows,
        "errors": {f"{k[0]} | {k[1]}": v for k, v in errors.items()},
        "rounds": done_rounds,
        "warm_rounds": warm,
        "peak_gib": peak,
        "shared_pool": pool is not None,
    }


def train_ratios(rows: dict) -> dict:
    """Speed ratios (tokens/s; > 1 = the first faster): ratio of the medians, and the median of the
    per-round ratios (paired: the same round's drift in both)."""
    pairs = [
        ("truefuse | eager", "stock | eager"),
        ("truefuse | graphed", "stock | graphed"),
        ("truefuse BI | graphed", "truefuse | graphed"),
        ("truefuse BI | eager", "truefuse | eager"),
        ("truefuse BI fused | graphed", "truefuse fused | graphed"),
        ("truefuse BI fused | eager", "truefuse fused | eager"),
        ("truefuse fused | graphed", "stock | graphed"),
        ("truefuse | graphed", "stock | eager"),
        ("truefuse | eager", "liger | eager"),
        ("truefuse | graphed", "liger nolce | graphed"),
    ]
    for v in TRAIN_VARIANTS:
        pairs.append((f"{v} | graphed", f"{v} | eager"))
    out = {}
    for a, b in pairs:
        if a in rows and b in rows:
            ra, rb = rows[a]["ms_rounds"], rows[b]["ms_rounds"]
            paired = median([y / x for x, y in zip(ra, rb, strict=False)])
            out[f"{a} / {b}"] = {"ratio": rows[b]["ms"] / rows[a]["ms"], "paired": paired}
    return out


def part_train(ctx: Ctx) -> None:
    c, args = ctx.c, ctx.args
    t0 = time.perf_counter()
    names = [v for v in args.variants.split(",") if v]
    res: dict = {"config": c, "variants": names, "skipped": {}}
    ctx.result["train"] = res
    if any(v in LIGER for v in names):
        why = None
        if not ctx.cuda:
            why = "Liger's kernels are Triton GPU kernels (no CPU path)"
        else:
            try:
                import liger_kernel.transformers  # noqa: F401
            except Exception as e:  # noqa: BLE001
                why = "liger_kernel not importable: " + err_line(e)
        if why:
            for v in LIGER:
                if v in names:
                    names.remove(v)
                    res["skipped"][v] = why
            ctx.note(f"train: liger skipped: {why}")
    base = bis.build(c)
    embed = base.get_input_embeddings().weight
    total = sum(p.numel() for p in base.parameters())
    tied = base.get_output_embeddings().weight is embed
    res["params_total"] = total
    res["params_n"] = total - (0 if tied else embed.numel())
    res["flops_per_step"] = flops_per_step(c, res["params_n"])
    res["mfu_formula"] = "(6 N T + 6 L S d T) / (t * 989.5e12); N = params less the input embedding (head counted)"
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, c["vocab"], (c["batch"], c["seq"]), generator=g).to(ctx.device) for _ in range(4)]
    blockers: dict = {}
    sizes = f"{total / 1e6:.1f} M parameters (N {res['params_n'] / 1e6:.1f} M), {c['batch']} x {c['seq']} tokens"
    log(f"train: {sizes}, variants {names}")
    res["bits"] = train_bits(ctx, base, names, batches, blockers)
    res["graph_blockers"] = {k: v for k, v in blockers.items() if v}
    ctx.write()
    log(f"train: bits done ({time.perf_counter() - t0:.1f} s)")
    res.update(train_speed(ctx, base, names, batches, blockers))
    res["ratios"] = train_ratios(res["rows"])
    ctx.result["elapsed_s"]["train"] = time.perf_counter() - t0
    log(f"train: done in {ctx.result['elapsed_s']['train']:.1f} s")
    ctx.write()


# ---------------------------------------------------------------- generate


def gen_kwargs(args, recipe: str, logits: bool = False) -> dict:
    kw = dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, disable_compile=True
    )
    if recipe != "eager":
        kw["cache_implementation"] = "static"
    if logits:
        kw.update(output_logits=True, return_dict_in_generate=True)
    return kw


def compare_outputs(a, b) -> dict:
    """Tokens and logits of two ``generate(..., output_logits=True, return_dict_in_generate=True)``."""
    la, lb = torch.stack(a.logits, 1), torch.stack(b.logits, 1)  # (batch, new tokens, vocab)
    out = {"tokens_equal": torch.equal(a.sequences, b.sequences)}
    if la.shape != lb.shape:
        return out | {"logits_equal": False, "why": f"shapes {tuple(la.shape)} vs {tuple(lb.shape)}"}
    ne = la != lb
    rows = ne.any(-1)  # (batch, step)
    steps = rows.any(0)
    out.update(
        logits_equal=not bool(ne.any()),
        rows_differing=int(rows.sum()),
        rows=rows.numel(),
        first_diff_step=int(steps.nonzero()[0]) if bool(steps.any()) else None,
        max_abs_diff=float(torch.where(ne, (la.float() - lb.float()).abs(), 0).max()),
    )
    return out


def part_generate(ctx: Ctx) -> None:
    args, c = ctx.args, ctx.c
    t0 = time.perf_counter()
    batches = [int(b) for b in args.gen_batches.split(",")]
    recipes = [r for r in args.recipes.split(",") if r]
    res: dict = {
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batches": batches,
        "recipes": recipes,
        "compile_mode": args.compile_mode,
        "times_ms": {},
        "errors": {},
        "bits": {},
        "blocks": {},
    }
    ctx.result["generate"] = res
    base = bis.build(c)
    models = {}
    for v in GEN_VARIANTS:
        try:
            models[v] = bis.variant(base, v).eval()
        except Exception as e:  # noqa: BLE001
            res["errors"][f"{v} | build"] = err_line(e)
    ref = bis.variant(base, "stock").eval()  # the compiled blocks' yardstick: stock eager at the first batch
    del base
    g = torch.Generator().manual_seed(2)
    prompts = {b: torch.randint(1, c["vocab"], (b, args.prompt_len), generator=g).to(ctx.device) for b in batches}

    graphs = {}  # model -> graph_decode's handle: installed only around its "graphed" runs

    def gen(model, b, recipe, logits=False):
        ids = prompts[b]
        if recipe == "graphed":
            if model not in graphs:
                graphs[model] = graph_decode(model)
            vars(model)["forward"] = graphs[model]
        try:
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen_kwargs(args, recipe, logits))
        finally:
            if recipe == "graphed":
                vars(model).pop("forward", None)

    def key(recipe, v, b):
        return f"{recipe} | {v} | {b}"

    # eager, static and graphed: every (recipe, variant, batch) resident, one generate of each a round
    plain = [r for r in recipes if r in ("eager", "static", "graphed")]
    runs = [(r, v, b) for r in plain for b in batches for v in models]
    eager_logits: dict = {}
    for r, v, b in list(runs):
        try:
            out = gen(models[v], b, r, logits=True)  # the warm-up, with logits for the bits checks
            if r == "graphed":
                out = gen(models[v], b, r, logits=True)  # the first call captured: check a replayed one
            if r == "eager":
                eager_logits[(v, b)] = out
            elif (v, b) in eager_logits:
                res["bits"][key(r, v, b)] = compare_outputs(eager_logits[(v, b)], out)
        except Exception as e:  # noqa: BLE001
            res["errors"][key(r, v, b)] = err_line(e)
            log(f"generate {key(r, v, b)}: FAILED {res['errors'][key(r, v, b)]}")
            runs.remove((r, v, b))
    log(f"generate: eager warm-up done ({time.perf_counter() - t0:.1f} s)")
    times: dict = {key(*k): [] for k in runs}
    for rnd in range(args.gen_rounds):
        if rnd >= 1 and ctx.past_deadline():
            ctx.note(f"generate: eager rounds cut to {rnd} by the deadline")
            break
        for r, v, b in list(runs):
            try:
                _, ms = timed(ctx, lambda r=r, v=v, b=b: gen(models[v], b, r))
                times[key(r, v, b)].append(ms)
            except Exception as e:  # noqa: BLE001
                res["errors"][key(r, v, b)] = err_line(e)
                runs.remove((r, v, b))
    res["times_ms"].update(times)
    ctx.write()
    log(f"generate: eager rounds done ({time.perf_counter() - t0:.1f} s)")

    # compiled: a block per variant (BI first: the question), dynamo reset before each
    if "compiled" in recipes:
        # prefill and decode at each batch size, and the graph breaks' own frames: past Dynamo's
        # recompile limit a frame would run eagerly, unnoticed
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
                res["dynamo_" + name] = getattr(torch._dynamo.config, name)
        order = [v for v in ("truefuse BI", "stock", "truefuse") if v in models]
        yard = batches[0]
        for v in order:
            if ctx.past_deadline():
                res["errors"][f"compiled | {v}"] = "skipped: deadline"
                continue
            block = {"warm_s": {}, "yardstick": key("eager", "stock (yardstick)", yard), "yardstick_ms": {}}
            res["blocks"][v] = block
            model = models[v]
            torch._dynamo.reset()
            before = dynamo_counters()
            live = []
            try:
                compiled = torch.compile(model.forward, mode=args.compile_mode)
                for b in batches:
                    k = key("compiled", v, b)
                    if ctx.past_deadline():
                        res["errors"][k] = "skipped: deadline"
                        continue
                    try:
                        want = eager_logits.get((v, b))
                        if want is None:
                            want = gen(model, b, "eager", logits=True)
                        model.forward = compiled
                        tw = time.perf_counter()
                        gen(model, b, "compiled")  # compile (prefill and decode shapes), untimed
                        block["warm_s"][b] = time.perf_counter() - tw
                        got = gen(model, b, "compiled", logits=True)
                        res["bits"][k] = compare_outputs(want, got)
                        del want, got
                        live.append(b)
                        log(
                            f"generate {k}: compiled in {block['warm_s'][b]:.1f} s; logits "
                            f"{'equal' if res['bits'][k]['logits_equal'] else 'DIFFER'} to eager"
                        )
                    except Exception as e:  # noqa: BLE001
                        res["errors"][k] = err_line(e)
                        log(f"generate {k}: FAILED {res['errors'][k]}")
                    finally:
                        vars(model).pop("forward", None)
                # the rounds one batch after the other: a new batch size makes generate a new static
                # cache (new addresses: the CUDA-graph trees record again), so alternating would time that
                model.forward = compiled
                for b in live:
                    k = key("compiled", v, b)
                    res["times_ms"][k], block["yardstick_ms"][b] = [], []
                    gen(model, b, "compiled")  # this batch's cache and graphs again, untimed
                    for rnd in range(args.gen_rounds):
                        if rnd >= 1 and ctx.past_deadline():
                            ctx.note(f"generate {k}: rounds cut to {rnd} by the deadline")
                            break
                        _, ms = timed(ctx, lambda b=b, model=model: gen(model, b, "compiled"))
                        res["times_ms"][k].append(ms)
                        _, ms = timed(ctx, lambda: gen(ref, yard, "eager"))
                        block["yardstick_ms"][b].append(ms)
            except Exception as e:  # noqa: BLE001
                res["errors"][f"compiled | {v}"] = err_line(e)
                log(f"generate compiled {v}: FAILED {res['errors'][f'compiled | {v}']}")
            finally:
                vars(model).pop("forward", None)
                block["counters"] = counters_diff(before, dynamo_counters())
                ctx.write()
        torch._dynamo.reset()
        log(f"generate: compiled blocks done ({time.perf_counter() - t0:.1f} s)")
    res["rows"] = gen_rows(res, args, list(models))
    res["ratios"] = gen_ratios(res, batches)
    models.clear()
    eager_logits.clear()
    ctx.result["elapsed_s"]["generate"] = time.perf_counter() - t0
    log(f"generate: done in {ctx.result['elapsed_s']['generate']:.1f} s")
    ctx.write()


def dynamo_counters() -> dict:
    """Dynamo's and Inductor's counters now, flat: ``{"category: key": n}`` (graph breaks, unique
    graphs, CUDA-graph skips: a compiled forward in pieces or without CUDA graphs is not the recipe's)."""
    try:
        from torch._dynamo.utils import counters

        return {f"{cat}: {str(k)[:100]}": n for cat, d in counters.items() for k, n in d.items() if isinstance(n, (int, float))}
    except Exception as e:  # noqa: BLE001
        return {"error": err_line(e)}


def counters_diff(before: dict, after: dict) -> dict:
    return {k: n - before.get(k, 0) for k, n in after.items() if k != "error" and n != before.get(k, 0)}


def counters_text(d: dict) -> str:
    graphs = d.get("stats: unique_graphs", 0)
    breaks = sum(n for k, n in d.items() if k.startswith("graph_break: "))
    skips = sum(n for k, n in d.items() if "cudagraph" in k and "skip" in k)
    return f"{graphs} graphs, {breaks} graph breaks, {skips} CUDA-graph skips"


def gen_rows(res: dict, args, variants) -> dict:
    rows = {}
    for k, ts in res["times_ms"].items():
        if not ts:
            continue
        recipe, v, b = k.split(" | ")
        med = median(ts)
        rows[k] = {
            "recipe": recipe,
            "variant": v,
            "batch": int(b),
            "ms": med,
            "ms_best": min(ts),
            "tok_s": int(b) * args.new_tokens / med * 1e3,
            "rounds": len(ts),
        }
    return rows


def gen_ratios(res: dict, batches) -> dict:
    """tokens/s ratios (> 1 = faster): each variant vs stock under the same recipe; compiled vs
    eager per variant; BI compiled vs stock eager at the first batch (across phases, and paired
    within BI's block against the block's yardstick)."""
    rows, out = res["rows"], {}

    def tok(recipe, v, b):
        r = rows.get(f"{recipe} | {v} | {b}")
        return r["tok_s"] if r else None

    for recipe in res["recipes"]:
        for b in batches:
            for v in ("truefuse", "truefuse BI"):
                a, s = tok(recipe, v, b), tok(recipe, "stock", b)
                if a and s:
                    out[f"{recipe} {v} / {recipe} stock @ {b}"] = a / s
    for recipe in ("compiled", "static", "graphed"):
        for b in batches:
            for v in GEN_VARIANTS:
                a, e = tok(recipe, v, b), tok("eager", v, b)
                if a and e:
                    out[f"{recipe} {v} / eager {v} @ {b}"] = a / e
    for b in batches:  # what a user switching to graph_decode gets against stock's eager generate
        for v in ("truefuse", "truefuse BI"):
            a, s = tok("graphed", v, b), tok("eager", "stock", b)
            if a and s:
                out[f"graphed {v} / eager stock @ {b}"] = a / s
    b = batches[0]
    a, s = tok("compiled", "truefuse BI", b), tok("eager", "stock", b)
    if a and s:
        out[f"compiled truefuse BI / eager stock @ {b}"] = a / s
    blk = res["blocks"].get("truefuse BI")
    ts = res["times_ms"].get(f"compiled | truefuse BI | {b}")
    if blk and ts and blk["yardstick_ms"].get(b):
        out[f"compiled truefuse BI / eager stock @ {b} (paired in BI's block)"] = median(
            [y / x for x, y in zip(ts, blk["yardstick_ms"][b], strict=False)]
        )
    return out


# ---------------------------------------------------------------- the table


def table(ctx: Ctx) -> str:
    R, lines = ctx.result, []
    m = R["meta"]
    lines.append(
        f"== exp_graphs: {m['device']}, torch {m['torch']}, triton {m.get('triton')}, transformers "
        f"{m.get('transformers')}, liger {m.get('liger_kernel')}, commit {m.get('commit')}, config {ctx.args.config}"
    )
    tr = R.get("train")
    if tr and "rows" in tr:
        c = tr["config"]
        size = f"{tr['params_total'] / 1e6:.1f} M params (N {tr['params_n'] / 1e6:.1f} M)"
        lines.append(
            f"-- train: {c['batch']} x {c['seq']} tokens, {size}, median of {tr['rounds']} interleaved rounds "
            f"({tr['warm_rounds']} warm); MFU = {tr['mfu_formula']}"
        )
        head = f"{'variant':<13} {'mode':<8} {'ms/step':>8} {'best':>8} {'tok/s':>9} {'MFU':>6}"
        lines.append(head + "  bits (graphed vs eager, same init/batches)")
        for r in tr["rows"].values():
            bits = bits_train_text(tr["bits"].get(r["variant"], {})) if r["mode"] == "graphed" else ""
            cells = f"{r['variant']:<13} {r['mode']:<8} {r['ms']:>8.2f} {r['ms_best']:>8.2f} {r['tok_s']:>9.0f} {r['mfu']:>6.3f}"
            lines.append(f"{cells}  {bits}")
        for v, b in tr["bits"].items():
            if f"{v} | graphed" not in tr["rows"]:
                lines.append(f"{v:<13} bits: {bits_train_text(b)}")
        for k, e in tr["errors"].items():
            lines.append(f"{k}: {e}")
        for v, why in tr.get("skipped", {}).items():
            lines.append(f"{v}: skipped: {why}")
        lines.append("ratios (tokens/s; ratio of medians [median of per-round ratios]):")
        for k, r in tr["ratios"].items():
            lines.append(f"  {k:<48} {r['ratio']:.3f} [{r['paired']:.3f}]")
        peak = f", peak {tr['peak_gib']:.2f} GiB allocated" if tr.get("peak_gib") else ""
        lines.append(f"train: {R['elapsed_s'].get('train', float('nan')):.1f} s{peak}")
    ge = R.get("generate")
    if ge and "rows" in ge:
        bs = ge["batches"]
        lines.append(
            f"-- generate: prompt {ge['prompt_len']}, {ge['new_tokens']} new tokens, greedy; tok/s (median of rounds) "
            f"and x stock under the same recipe; compiled = static cache + torch.compile(forward, mode={ge['compile_mode']!r})"
        )
        lines.append(f"{'recipe':<9} {'variant':<12} " + " ".join(f"{'b=' + str(b):>17}" for b in bs))
        for recipe in ge["recipes"]:
            for v in GEN_VARIANTS:
                cells = []
                for b in bs:
                    r = ge["rows"].get(f"{recipe} | {v} | {b}")
                    s = ge["rows"].get(f"{recipe} | stock | {b}")
                    if r is None:
                        err = ge["errors"].get(f"{recipe} | {v} | {b}") or ge["errors"].get(f"{recipe} | {v}")
                        cells.append(f"{'FAILED' if err and 'deadline' not in err else '-':>17}")
                    else:
                        rel = f"({r['tok_s'] / s['tok_s']:.2f}x)" if s and v != "stock" else ""
                        cells.append(f"{r['tok_s']:>10.0f} {rel:>6}")
                lines.append(f"{recipe:<9} {v:<12} " + " ".join(cells))
        for k, r in ge["ratios"].items():
            if " / eager " in k and not k.startswith("eager "):  # the same-recipe ratios are in the cells
                lines.append(f"  {k:<62} {r:.3f}")
        for k, b in ge["bits"].items():
            req = " (required)" if "truefuse BI" in k else ""
            if b.get("logits_equal"):
                lines.append(f"  bits {k} vs eager{req}: logits and tokens EQUAL")
            else:
                lines.append(
                    f"  bits {k} vs eager{req}: logits differ: {b.get('rows_differing')}/{b.get('rows')} rows from step "
                    f"{b.get('first_diff_step')}, max {b.get('max_abs_diff', float('nan')):.3g}; tokens "
                    f"{'equal' if b.get('tokens_equal') else 'differ'}{' ' + b['why'] if 'why' in b else ''}"
                )
        for k, e in ge["errors"].items():
            lines.append(f"  {k}: {e}")
        for v, blk in ge["blocks"].items():
            warm = ", ".join(f"b={b}: {s:.1f} s" for b, s in blk["warm_s"].items())
            yard = ", ".join(f"{median(ts):.1f}" for ts in blk["yardstick_ms"].values() if ts)
            lines.append(
                f"  compiled {v}: first generate (compile) {warm or '-'}; {counters_text(blk.get('counters', {}))}; "
                f"yardstick (stock eager b={ge['batches'][0]}) ms per batch's rounds: {yard or '-'}"
            )
        lines.append(f"generate: {R['elapsed_s'].get('generate', float('nan')):.1f} s")
    for n in R["notes"]:
        lines.append(f"note: {n}")
    lines.append(f"total {time.perf_counter() - T0:.1f} s; JSON {ctx.path}")
    return "\n".join(lines)


def bits_train_text(b: dict) -> str:
    if not b:
        return "-"
    if "error" in b or "skipped" in b:
        return "FAILED " + b.get("error", b.get("skipped", ""))
    verdict = "EQUAL" if b["losses_equal"] and b["params_equal"] else "DIFFER"
    detail = f"{b['steps']} losses" + (
        "" if b["losses_equal"] else f", first at step {b['first_diff_step']}, max {b['max_abs_diff']:.3g}"
    )
    detail += ", params equal" if b["params_equal"] else f", {b['params_differing']} params differ"
    return f"{verdict} ({detail}){'' if b['against'] == 'graphed' else ' vs ' + b['against']}"


# ---------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for graphs_<config>.json")
    p.add_argument("--config", choices=["small", "demo", "tiny"], default="small")
    p.add_argument("--parts", default="train,generate", help="comma-separated: train, generate")
    p.add_argument("--smoke", action="store_true", help="the CPU, config tiny, eager and static cache only, 2 rounds")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default=",".join(TRAIN_VARIANTS), help=f"train's, of {TRAIN_VARIANTS}")
    p.add_argument("--train-rounds", type=int, default=15)
    p.add_argument("--graph-warmup", type=int, default=2, help="graph_step's eager steps before the capture")
    p.add_argument("--bits-steps", type=int, default=8, help="steps of the graphed-vs-eager bits check")
    p.add_argument("--share-pool", action="store_true", help="one CUDA-graph memory pool for every captured step (demo)")
    p.add_argument("--gen-batches", default="1,8,32")
    p.add_argument("--gen-rounds", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--recipes", default="eager,graphed,compiled", help="of eager, static, graphed, compiled")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--deadline-s", type=float, default=0, help="past this many seconds no new block or round starts (0: none)")
    args = p.parse_args()
    if args.smoke:
        args.device, args.config, args.recipes = "cpu", "tiny", "eager,static"
        args.train_rounds, args.gen_rounds, args.bits_steps = 2, 2, 3
        args.gen_batches, args.prompt_len, args.new_tokens = "1,2", 16, 8
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: --smoke runs this script's logic on the CPU")
    if (
        args.device != "cuda"
        and "generate" in args.parts
        and "compiled" in args.recipes
        and args.compile_mode == "reduce-overhead"
    ):
        p.error("reduce-overhead (CUDA graphs) needs CUDA")
    unknown = [v for v in args.variants.split(",") if v and v not in TRAIN_VARIANTS]
    if unknown:  # exp_bi_speed.variant would make an unknown name a stock copy
        p.error(f"unknown variants {unknown}; known: {', '.join(TRAIN_VARIANTS)}")
    bis.DEVICE = args.device  # exp_bi_speed.build's device (bf16 on CUDA, fp32 on the CPU)
    os.makedirs(args.out, exist_ok=True)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass
    ctx = Ctx(args)
    parts = [x for x in args.parts.split(",") if x]
    for part in parts:
        if part not in ("train", "generate"):
            p.error(f"unknown part {part!r}")
        part_train(ctx) if part == "train" else part_generate(ctx)
        ctx.free()  # the part's models are gone with its frame
    ctx.write()
    print(table(ctx), flush=True)


if __name__ == "__main__":
    main()
