"""Host time of truefuse's paths: one harness for the host-time questions (issue 34: batch-invariant
``generate`` and training are host-bound on an H100; issue 35: the small model's step under FSDP2 is
host time). Each subcommand was its own script until the fold (``git show 19c142b:experiments/<was>``):

============  =====  ==========================================================  ======================
subcommand    where  what                                                        was
============  =====  ==========================================================  ======================
bi-stubbed    CPU    BI mode's paths, every Triton launch stubbed                exp_bi_host_time.py
eager         CPU    eager mode's autograd Function vs the dispatcher, stubbed   exp_eager_host_time.py
launch        GPU    decode-sized ops vs stock; each Triton launch five ways     exp_launch_host.py
kept          CPU    kept launches off / on: the tiny Llama and single ops      (new, issue 47)
bi-linear     GPU    routed BI ``F.linear`` fwd + bwd vs stock; cProfile         exp_bi_linear_host.py
generate      GPU    which ``apply_truefuse`` patch costs ``generate`` its host  exp_generate_host.py
train         GPU    a training step's forward / backward host, per op + model   exp_train_host.py
gaps          GPU    a demo step's idle GPU gaps, by the host phase behind each  exp_step_gaps.py
============  =====  ==========================================================  ======================

Two ways of timing host: on the CPU with the launches stubbed (``stub_launches``: what the host spends
around the kernels, ``time.thread_time`` so that other processes on a loaded box count less; not the
real launcher's cost), and on the GPU with the work queued and no synchronisation inside a round
(``gpu_host_us``: the wall time is the host's wherever the host is slower). Each subcommand's own
docstring (``--help``) says what its rows are.

Run from the repository root: ``PYTHONPATH=. python experiments/host_time.py SUBCOMMAND [options]``
(the same file run from another checkout's root measures that checkout: the base numbers in
docs/benchmarks.md came that way). ``generate``, ``bi-linear`` and ``gaps`` import their models from
``exp_bi_speed.py`` / ``exp_hf_profile.py`` in this folder.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # exp_bi_speed, exp_hf_profile

# --------------------------------------------------------------------------------------------------
# timing helpers


def stub_launches() -> None:
    """Every Triton launch a no-op (host work only). Needs ``TRITON_INTERPRET=1`` before truefuse's
    kernels import (``main`` sets it for the CPU subcommands)."""
    import triton.runtime.interpreter as interpreter

    interpreter.InterpretedFunction.run = lambda self, *a, **k: None


def thread_us(fn, calls: int, warmup: int = 2) -> float:
    """µs of this thread's CPU time per ``fn()`` over ``calls`` calls after ``warmup`` (the CPU
    subcommands' one round: ``time.thread_time``, so other processes on a loaded box count less)."""
    for _ in range(warmup):
        fn()
    t = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t) / calls * 1e6


def gpu_host_us(fn, calls: int, warmup: int = 20) -> float:
    """µs of host per ``fn()`` on CUDA: the best of 5 rounds of ``calls`` calls, no synchronisation
    inside a round (the GPU work queued, so the wall time is the host's wherever the host is slower).
    Keep ``calls`` under CUDA's queue (~1000 launches): past it a launch waits for the GPU."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def cprofile_text(fn, title: str, rows: int = 28, sort: str = "tottime", calls: int = 1) -> str:
    """cProfile's top ``rows`` functions (by ``sort``) over ``calls`` calls of ``fn``."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(rows)
    return f"==== cProfile: {title}\n{buf.getvalue()}"


# --------------------------------------------------------------------------------------------------
# bi-stubbed


def cmd_bi_stubbed(args) -> None:
    """Batch-invariant (BI) mode's hot paths on the CPU, every Triton launch stubbed. The GEMMs are
    planned as on CUDA: the Triton backend gets a ``batch_invariant`` row on the CPU
    (``override_capabilities``), so the plan is ``triton[float32]: fused mm+batch_invariant`` as
    CUDA's ``triton[bfloat16]``. Rows (µs per call, the minimum over ``--rounds`` of ``--calls``):

    * ``gemm bi``: ``truefuse.gemm(x, w.t(), batch_invariant=True)``, 8 rows, outside the mode;
    * ``F.linear M=1 / M=8``: ``F.linear`` routed by ``apply_truefuse(batch_invariant=True)``'s mode,
      no grad (``generate``'s decode);
    * ``F.linear grad fwd`` / ``F.linear grad fwd+bwd``: with a weight that requires grad, the forward
      alone and forward + backward (the weight gradient is a real CPU GEMM of a 64 x 64 weight);
    * ``attention decode``: ``attn_implementation="truefuse"``'s forward for one query against 256
      cached keys with a bool mask (``integrations/huggingface/attention.py``), no grad;
    * ``attention fwd+bwd``: ``truefuse.attention`` causal, 64 queries, forward + backward;
    * ``generate tiny`` / ``train step tiny`` (stock, fast, BI): a 2-layer Llama (hidden 64,
      vocabulary 256): greedy ``generate`` of 8 tokens for 4 prompts of 16, and forward + backward of
      4 x 32 tokens (the whole call's host time, transformers' own included; ``--calls`` / 20 calls),
      and issue 34's two ratios on this host time alone (an upper bound where the GPU run is
      host-bound, not a prediction of it)."""
    import torch
    import torch.nn.functional as F

    import truefuse
    import truefuse.ops.lm_head.linear_cross_entropy as lce
    from truefuse.integrations.huggingface.attention import attention_forward
    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant
    from truefuse.ops.gemm.gemm import gemm_plan_for
    from truefuse.ops.gemm.gemm_plan import Capability, override_capabilities

    stub_launches()
    lce._check_finish = lambda *a, **k: lambda: None  # the targets' check reads a stubbed kernel's flag
    torch.set_num_threads(1)
    H, F32 = args.hidden, torch.float32
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(H, H, generator=gen)
    b = torch.randn(H, generator=gen)
    x1, x8 = torch.randn(1, 1, H, generator=gen), torch.randn(4, 2, H, generator=gen)
    wg = w.clone().requires_grad_()
    xg = torch.randn(4, 2, H, generator=gen, requires_grad=True)
    dy = torch.ones(4, 2, H)
    Lk = 256  # decode attention: 4 sequences, 16/8 heads, D 64, 256 cached keys, transformers' bool mask
    q = torch.randn(4, 16, 1, 64, generator=gen)
    k, v = torch.randn(4, 8, Lk, 64, generator=gen), torch.randn(4, 8, Lk, 64, generator=gen)
    mask = torch.ones(4, 1, 1, Lk, dtype=torch.bool)
    mask[0, ..., :5] = False
    module = torch.nn.Module()
    module.is_causal = True
    qt = torch.randn(2, 4, 64, 64, generator=gen, requires_grad=True)
    kt = torch.randn(2, 2, 64, 64, generator=gen, requires_grad=True)
    vt = torch.randn(2, 2, 64, 64, generator=gen, requires_grad=True)
    do = torch.ones(2, 4, 64, 64)

    def attn_train():
        truefuse.attention(qt, kt, vt, is_causal=True, enable_gqa=True).backward(do)

    # name -> (in the mode: True, the switch alone: False, nothing (a patched model enters it): None; fn)
    rows = {
        "gemm bi": (False, lambda: truefuse.gemm(x8.view(8, H), w.t(), batch_invariant=True)),
        "F.linear M=1": (True, lambda: F.linear(x1, w, b)),
        "F.linear M=8": (True, lambda: F.linear(x8, w, b)),
        "F.linear grad fwd": (True, lambda: F.linear(xg, wg, b)),
        "F.linear grad fwd+bwd": (True, lambda: F.linear(xg, wg, b).backward(dy)),
        "attention decode": (True, lambda: attention_forward(module, q, k, v, mask, scaling=0.125)),
        "attention fwd+bwd": (True, attn_train),
    }
    grads = {"F.linear grad fwd", "F.linear grad fwd+bwd", "attention fwd+bwd"}
    ids = torch.randint(1, 256, (4, 16), generator=gen)
    train_ids = torch.randint(1, 256, (4, 32), generator=gen)
    for run in ("stock", "fast", "BI"):
        model = _tiny_llama(run)
        if model is None:
            break

        def generate(model=model):
            model.eval()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False, pad_token_id=0)  # fmt: skip

        def train_step(model=model):
            model.train()
            model(input_ids=train_ids, labels=train_ids).loss.backward()

        rows[f"generate tiny {run}"] = (None, generate)
        rows[f"train step tiny {run}"] = (None, train_step)
        grads.add(f"train step tiny {run}")

    def scope(in_mode):
        if in_mode is None:
            return contextlib.nullcontext()
        return running_batch_invariant() if in_mode else truefuse.batch_invariant()

    res: dict = {}
    with override_capabilities(add=[Capability("batch_invariant", F32, F32, "cpu", "triton")]):
        print("plan:", gemm_plan_for(x8.view(8, H), w.t(), batch_invariant=True))
        for _ in range(args.rounds):
            for name, (in_mode, fn) in rows.items():
                calls = args.calls if in_mode is not None else max(1, args.calls // 20)
                with torch.set_grad_enabled(name in grads), scope(in_mode):
                    res.setdefault(name, []).append(thread_us(fn, calls))
        for name in rows:
            print(f"{name:24s} {min(res[name]):8.1f} us")
        if "generate tiny BI" in res:
            best = {k: min(v) for k, v in res.items()}
            print(f"BI generate vs stock (tokens/s): {best['generate tiny stock'] / best['generate tiny BI']:.2f}x; "
                  f"BI train step vs fast: {best['train step tiny fast'] / best['train step tiny BI']:.2f}x")  # fmt: skip
        if args.profile:
            in_mode, fn = rows[args.profile]
            calls = args.calls if in_mode is not None else max(1, args.calls // 20)
            with torch.set_grad_enabled(args.profile in grads), scope(in_mode):
                print(cprofile_text(fn, args.profile, rows=30, calls=calls))


def _tiny_llama(run: str, **fusions):
    """A 2-layer Llama, stock (``run="stock"``) or under ``apply_truefuse`` (``"fast"``) or
    ``apply_truefuse(batch_invariant=True)`` (``"BI"``), with ``fusions`` (``apply_truefuse``'s
    opt-in flags); None without transformers."""
    try:
        import transformers as tf
    except ImportError:
        return None
    import torch

    from truefuse.integrations.huggingface import apply_truefuse

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    if run != "stock":
        apply_truefuse(model, batch_invariant=run == "BI", **fusions)
    return model


# --------------------------------------------------------------------------------------------------
# fusions


def cmd_fusions(args) -> None:
    """The host cost of issue 48's opt-in fusions (``fuse_sibling_grads``, ``fuse_residual_norm``)
    on the CPU with every Triton launch stubbed: the tiny Llama of ``kept`` (2 layers, hidden 64), a
    training step's forward + backward (4 x 32 tokens) and one attention's q/k/v calls + backward,
    fast and batch-invariant mode, each fusion alone and both; µs of host a call, the minimum over
    ``--rounds`` interleaved rounds of ``--calls`` (``time.thread_time``). Their kernel time is the
    GPU's question (``exp_hf_profile.py``); this is what their Python adds where the host decides."""
    import torch

    from truefuse.integrations.huggingface.batch_invariant import model_mode
    from truefuse.ops.lm_head.linear_cross_entropy import targets_checked

    stub_launches()
    torch.set_num_threads(1)
    runs = {
        f"{mode}{tag}": _tiny_llama(mode, **kw)
        for mode in ("fast", "BI")
        for tag, kw in (
            ("", {}),
            (" +siblings", {"fuse_sibling_grads": True}),
            (" +resnorm", {"fuse_residual_norm": True}),
            (" +both", {"fuse_sibling_grads": True, "fuse_residual_norm": True}),
        )
    }
    if runs["fast"] is None:
        print("fusions: needs transformers")
        return
    ids = torch.randint(1, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 32, 64, requires_grad=True)

    def step(model):
        with targets_checked():  # the loss's label check reads a flag its (stubbed) kernel never wrote
            model(input_ids=ids, labels=ids).loss.backward()

    def qkv(model):
        attn = model.model.layers[0].self_attn
        with model_mode(model):
            outs = (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    res: dict = {}
    for _ in range(args.rounds):
        for run, model in runs.items():
            model.train()
            for what, fn in (("train step", step), ("q/k/v fwd+bwd", qkv)):
                res.setdefault((what, run), []).append(thread_us(lambda fn=fn, m=model: fn(m), args.calls))
    print(f"{'host us (min of rounds)':26}" + "".join(f"{r:>15}" for r in runs))
    for what in ("train step", "q/k/v fwd+bwd"):
        print(f"{what:26}" + "".join(f"{min(res[what, r]):15.1f}" for r in runs))


# --------------------------------------------------------------------------------------------------
# kept


def cmd_kept(args) -> None:
    """Kept launches (``ops/_launch/prepared.py``; docs/design.md §6.10) off and on, on the CPU with
    every Triton launch stubbed: the tiny Llama of ``bi-stubbed`` (2 layers, hidden 64), stock /
    fast / batch-invariant, greedy ``generate`` of 8 tokens for 4 prompts of 16 and a training step
    of 4 x 32 tokens, µs of host a call (minimum over ``--rounds`` rounds of ``--calls``).

    On the CPU no launch has a compiled kernel's handle to keep, so "on" stands the CPU in for CUDA
    (``prepared._on_device``) and keeps a no-op for each launch: the rows show the Python a
    kept call no longer runs (checks, plans, ``fast_launch``'s key), not the launcher's own cost,
    which the GPU's ``launch`` table measures. The batch-invariant rows take the norm's statistics
    from its kernel as on CUDA (``kernel_statistics``) and plan the GEMMs as on CUDA (the Triton
    backend's batch-invariant row added for the CPU). Then single ops off and on (``_kept_ops``): the
    routed BI linear and attention at decode, swiglu's and ``rms_norm_hf``'s forward + backward."""
    import torch

    import truefuse.autograd.norm as autograd_norm
    import truefuse.integrations.huggingface.siblings as siblings
    import truefuse.ops._launch.prepared as prepared
    import truefuse.ops.attention.attention_kept as attention_kept
    import truefuse.ops.gated_activation.gated_kept as gated_kept
    import truefuse.ops.gemm.gemm_backends.triton as triton_backend
    import truefuse.ops.gemm.gemm_kept as gemm_kept
    import truefuse.ops.norm.norm_kept as norm_kept
    import truefuse.ops.rope_kept as rope_kept
    from truefuse.ops.gemm.gemm_plan import Capability, override_capabilities
    from truefuse.ops.lm_head.linear_cross_entropy import targets_checked

    stub_launches()
    mods = (gemm_kept, gated_kept, norm_kept, rope_kept, siblings, attention_kept)
    real = prepared._on_device
    noop = lambda *a: None  # noqa: E731  a kept launch that launches nothing (the stubbed launches' stand-in)
    for m in mods:
        m.launchable, m.stream = (lambda go: True), (lambda go: 0)
    gemm_kept._prepared = gated_kept.fwd_prepared = norm_kept.hf_prepared = rope_kept.rope_prepared = lambda *a: noop
    gated_kept.bwd_prepared = lambda *a: noop
    attention_kept.prepare = lambda *a, **k: noop
    triton_backend.bi_segments_prepared = lambda *a: noop
    autograd_norm.kernel_statistics = lambda x, bi: bi  # the mode's statistics are the kernel's, as on CUDA

    def kept(on: bool) -> None:
        prepared._on_device = (lambda x: True) if on else real
        for m in mods:
            getattr(m, "clear", m._KEPT.clear)()

    gen = torch.Generator().manual_seed(0)
    ids, train_ids = torch.randint(1, 256, (4, 16), generator=gen), torch.randint(1, 256, (4, 32), generator=gen)
    res: dict = {}
    F32 = torch.float32
    with override_capabilities(add=[Capability("batch_invariant", F32, F32, "cpu", "triton")]):
        models = {run: _tiny_llama(run) for run in ("stock", "fast", "BI")}
        if models["stock"] is None:
            print("kept: needs transformers")
            return

        def generate(model):
            model.eval()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                               do_sample=False, pad_token_id=0)  # fmt: skip

        def train_step(model):
            model.train()
            with targets_checked():  # the loss's own label check reads a flag its (stubbed) kernel never wrote
                model(input_ids=train_ids, labels=train_ids).loss.backward()

        for _ in range(args.rounds):  # interleaved: the box drifts
            for run, model in models.items():
                for on in (False, True):
                    kept(on)
                    for what, fn in (("generate", generate), ("train step", train_step)):
                        res.setdefault((what, run, on), []).append(thread_us(lambda fn=fn, m=model: fn(m), args.calls))
        ops = _kept_ops(torch)
        for _ in range(args.rounds):
            for on in (False, True):
                kept(on)
                for name, fn in ops.items():
                    res.setdefault((name, on), []).append(thread_us(fn, 100 * args.calls, warmup=3))
    kept(False)
    best = {k: min(v) for k, v in res.items()}
    print(f"{'tiny Llama, host us':<24} {'kept off':>10} {'kept on':>10} {'on/off':>7}   vs stock (kept on)")
    for what in ("generate", "train step"):
        for run in ("stock", "fast", "BI"):
            off, on = best[what, run, False], best[what, run, True]
            print(f"{what + ' ' + run:<24} {off:10.0f} {on:10.0f} {on / off:7.2f}   {best[what, 'stock', True] / on:5.2f}x")
    print(f"{'one op, host us':<32} {'kept off':>10} {'kept on':>10} {'on/off':>7}")
    for name in ops:
        off, on = best[name, False], best[name, True]
        print(f"{name:<32} {off:10.1f} {on:10.1f} {on / off:7.2f}")


def _kept_ops(torch) -> dict:
    """``cmd_kept``'s single ops (fp32, the CPU): a routed batch-invariant ``F.linear`` at decode, a
    decode step's attention through transformers' interface (4 sequences, 16/8 heads of 64, 256
    keys, a padding mask), and forward + backward of the two-tensor swiglu and of ``rms_norm_hf``
    in fast and batch-invariant mode (64 x 512, 64 x 256)."""
    import torch.nn.functional as F

    from truefuse.autograd.gated_activation import gated_activation
    from truefuse.autograd.norm import rms_norm_hf
    from truefuse.config import batch_invariant
    from truefuse.integrations.huggingface.attention import attention_forward
    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    x, w = torch.randn(4, 1, 64), torch.randn(64, 64)
    qa, ka, va = torch.randn(4, 16, 1, 64), torch.randn(4, 8, 256, 64), torch.randn(4, 8, 256, 64)
    mask = torch.ones(4, 1, 1, 256, dtype=torch.bool)
    mask[0, ..., :5] = False
    module = torch.nn.Module()
    module.is_causal = True
    g, u, dg = torch.randn(64, 512, requires_grad=True), torch.randn(64, 512, requires_grad=True), torch.randn(64, 512)
    nx, nw, dn = torch.randn(64, 256, requires_grad=True), torch.ones(256, requires_grad=True), torch.randn(64, 256)

    def linear():
        with torch.no_grad(), running_batch_invariant():
            F.linear(x, w)

    def attention():
        with torch.no_grad():
            attention_forward(module, qa, ka, va, mask, scaling=0.125)

    def swiglu():
        torch.autograd.grad(gated_activation(g, "swiglu", u), (g, u), dg)

    def norm(bi):
        def run():
            with batch_invariant(bi):
                torch.autograd.grad(rms_norm_hf(nx, nw, 1e-6), (nx, nw), dn)

        return run

    return {
        "routed BI F.linear, decode": linear,
        "attention, decode": attention,
        "swiglu fwd+bwd": swiglu,
        "rms_norm_hf fwd+bwd": norm(False),
        "rms_norm_hf fwd+bwd, BI": norm(True),
    }


# --------------------------------------------------------------------------------------------------
# eager


def cmd_eager(args) -> None:
    """A forward + backward of ``rms_norm_hf``, rope and the two-tensor gated activation through
    ``autograd/_eager_op.py`` (eager mode's plain autograd Function) against the same
    ``torch.library`` ops through the dispatcher, on the CPU with every launch stubbed. Minimum over
    ``--rounds`` interleaved rounds of 100 calls, one thread (wall time)."""
    import torch

    import truefuse.autograd._eager_op as eager_op
    import truefuse.autograd.gated_activation as ag
    import truefuse.autograd.norm as an
    import truefuse.autograd.rope as ar

    stub_launches()
    torch.set_num_threads(1)
    H = 256
    x, w = torch.randn(2, 32, H, requires_grad=True), torch.ones(H, requires_grad=True)
    q, k = torch.randn(2, 4, 32, 64, requires_grad=True), torch.randn(2, 2, 32, 64, requires_grad=True)
    cos, sin = torch.randn(2, 32, 64), torch.randn(2, 32, 64)
    g, u = torch.randn(64, 512, requires_grad=True), torch.randn(64, 512, requires_grad=True)

    def rope():  # q and k come from one op (one node): one backward for both
        outs = ar.apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    fns = {
        "rms_norm_hf": lambda: an.rms_norm_hf(x, w, 1e-6, style="llama").backward(torch.ones(2, 32, H)),
        "rope": rope,
        "gated2": lambda: ag.gated_activation(g, "swiglu", u).backward(torch.ones(64, 512)),
    }
    modes = {"eager": eager_op.call, "dispatcher": lambda op, *a: op(*a)}
    res: dict = {}
    for _ in range(args.rounds):
        for mode, call in modes.items():
            for m in (an, ar, ag):
                m.call = call
            for name, fn in fns.items():
                for _ in range(5):
                    fn()
                t = time.perf_counter()
                for _ in range(100):
                    fn()
                res.setdefault((name, mode), []).append((time.perf_counter() - t) / 100 * 1e6)
    for name in fns:
        e, d = min(res[name, "eager"]), min(res[name, "dispatcher"])
        print(f"{name:12s} eager {e:7.1f} us  dispatcher {d:7.1f} us  (saved {d - e:+.1f} us, {e / d:.2f}x)")


def cmd_function_floor(args) -> None:
    """Issue 47.3's per-op host goal against what a Python autograd Function costs doing nothing: on
    the CPU, tiny fp32 tensors (1 x 8: the compute is noise), forward + ``torch.autograd.grad``,
    µs a call, the minimum over ``--rounds`` interleaved rounds of 500. Rows: stock's two-op swiglu
    (``F.silu(g) * u``: C++ nodes both ways); a Function whose forward and backward only allocate
    their outputs, through ``Function.apply`` and through the raw C ``apply`` truefuse's eager ops
    use (``autograd/_eager_op.py``): the floor of any one-kernel op written as a Python Function;
    and truefuse's swiglu, launches stubbed, its kept launches off and on (on: the CPU standing in for
    CUDA as in ``kept``, the kept launches no-ops: the GPU's path)."""
    import torch
    import torch.nn.functional as F

    import truefuse.autograd.gated_activation as ag
    import truefuse.ops._launch.prepared as prepared
    import truefuse.ops.gated_activation.gated_kept as gated_kept

    stub_launches()
    torch.set_num_threads(1)
    noop = lambda *a: None  # noqa: E731
    gated_kept.launchable, gated_kept.stream = (lambda go: True), (lambda go: 0)
    gated_kept.fwd_prepared = gated_kept.bwd_prepared = lambda *a: noop
    real = prepared._on_device

    def swiglu(on: bool):
        def run():
            prepared._on_device = (lambda x: True) if on else real
            try:
                return torch.autograd.grad(ag.gated_activation(g, "swiglu", u), (g, u), dy)
            finally:
                prepared._on_device = real

        return run

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g, u):
            return torch.empty_like(g)

        @staticmethod
        def backward(ctx, dy):
            return torch.empty_like(dy), torch.empty_like(dy)

    raw = super(torch.autograd.Function, Empty).apply
    g, u, dy = torch.randn(1, 8, requires_grad=True), torch.randn(1, 8, requires_grad=True), torch.randn(1, 8)
    rows = {
        "stock silu(g) * u": lambda: torch.autograd.grad(F.silu(g) * u, (g, u), dy),
        "empty Function, apply": lambda: torch.autograd.grad(Empty.apply(g, u), (g, u), dy),
        "empty Function, raw C apply": lambda: torch.autograd.grad(raw(g, u), (g, u), dy),
        "truefuse swiglu, stubbed": swiglu(False),
        "truefuse swiglu, kept": swiglu(True),
    }
    res: dict = {}
    for _ in range(args.rounds):
        for name, fn in rows.items():
            res.setdefault(name, []).append(thread_us(fn, 500, warmup=20))
    stock = min(res["stock silu(g) * u"])
    for name in rows:
        print(f"{name:30s} {min(res[name]):7.1f} us  {min(res[name]) / stock:5.2f}x stock")


# --------------------------------------------------------------------------------------------------
# launch


def cmd_launch(args) -> None:
    """Truefuse's eager ops on CUDA against the stock ops they replace, and the Triton launches inside
    them: ``JITFunction.run`` against a launch through the compiled kernel's handle. Decode-sized bf16
    inputs (4 sequences, hidden 2048, 16/8 heads of 64), so that the GPU is never the bottleneck: each
    row is the host µs of one call (``gpu_host_us``), a truefuse op's both with the eager fast launch
    (``ops/_launch/fast_launch.py``, the default) and without it (``fast off``). Each truefuse op's
    Triton launches are recorded (fast launch off) and replayed: ``jit.run`` (Triton's own path),
    ``handle`` (the compiled kernel's ``run`` with the bound arguments precomputed: the floor of any
    launch), ``handle+key`` (the same with Triton's specialisation flags computed in Python each
    call: on an H100 host 15-23 µs against Triton's 17-26, and a full cache keyed on the exact
    arguments measured 19-28 µs, so the ops launched through Triton until issue 47), ``handle+minimal
    key`` (keyed on the tensors' alignment alone) and ``fast_launch`` (the ops' launch now: the
    recorded call through ``ops/_launch/fast_launch.py::fast_launch``).

    Then issue 47's host table (``--no-fwd-bwd`` skips it): each op's eager forward + backward with
    a gradient (hidden 1024, 128 tokens, bf16), host µs a call, stock's expression / truefuse with
    the fast launch off / on: ``rms_norm``, ``rms_norm_hf``, rope (q and k), the two-tensor swiglu
    and, in batch-invariant mode, a routed ``F.linear`` (the plain Triton GEMM's launches)."""
    import torch
    import torch.nn.functional as F
    from triton import knobs
    from triton.runtime.jit import JITFunction

    import truefuse
    from truefuse.autograd.gated_activation import gated_activation
    from truefuse.autograd.norm import rms_norm, rms_norm_hf
    from truefuse.autograd.rope import apply_rotary_pos_emb
    from truefuse.config import eager_fast_launch
    from truefuse.integrations.huggingface.attention import attention_forward

    dev, bf = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", _triton_version())
    torch.manual_seed(0)
    H, B = 2048, 4
    x = torch.randn(B, 1, H, device=dev, dtype=bf)
    w = torch.randn(H, H, device=dev, dtype=bf) * 0.02
    nw = torch.ones(H, device=dev, dtype=bf)
    q = torch.randn(B, 1, 16, 64, device=dev, dtype=bf).transpose(1, 2)
    k = torch.randn(B, 1, 8, 64, device=dev, dtype=bf).transpose(1, 2)
    cos = torch.randn(B, 1, 64, device=dev, dtype=bf)
    sin = torch.randn(B, 1, 64, device=dev, dtype=bf)
    g = torch.randn(B, 1, 5632, device=dev, dtype=bf)
    u = torch.randn(B, 1, 5632, device=dev, dtype=bf)
    qa = torch.randn(B, 16, 1, 64, device=dev, dtype=bf)  # decode attention against 256 cached keys
    ka, va = (torch.randn(B, 8, 256, 64, device=dev, dtype=bf) for _ in range(2))
    mask = torch.ones(B, 1, 1, 256, device=dev, dtype=torch.bool)
    mask[0, ..., :5] = False
    module = torch.nn.Module()
    module.is_causal = True

    def stock_norm():
        return _stock_rms_norm(x, nw)

    def stock_rope():
        return _stock_rope(q, k, cos, sin)

    def bi_linear():
        return _bi_linear(x, w)

    rows = {  # name -> (stock fn, truefuse fn)
        "F.linear (cuBLAS)": (lambda: F.linear(x, w), None),
        "gemm BI": (None, lambda: truefuse.gemm(x.view(B, H), w.t(), batch_invariant=True)),
        "F.linear routed BI": (None, bi_linear),
        "rms norm stock ops": (stock_norm, None),
        "rms_norm_hf": (None, lambda: rms_norm_hf(x, nw, 1e-6)),
        "rms_norm": (None, lambda: rms_norm(x, nw, 1e-6)),
        "rope stock ops": (stock_rope, None),
        "apply_rotary_pos_emb": (None, lambda: apply_rotary_pos_emb(q, k, cos, sin)),
        "silu(g)*u stock": (lambda: F.silu(g) * u, None),
        "swiglu": (None, lambda: gated_activation(g, "swiglu", u)),
        "SDPA decode": (lambda: F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, enable_gqa=True), None),
        "attention decode (HF)": (None, lambda: attention_forward(module, qa, ka, va, mask, scaling=0.125)),
        "torch.empty": (lambda: torch.empty(B, H, device=dev, dtype=bf), None),
    }

    def host_us(fn):
        return gpu_host_us(fn, args.calls)

    records: list = []
    orig_run = JITFunction.run

    def recording_run(self, *a, grid, warmup, **kw):
        kernel = orig_run(self, *a, grid=grid, warmup=warmup, **kw)
        records.append((self, a, dict(kw), grid, kernel))
        return kernel

    torch.set_grad_enabled(False)
    ways = "jit.run / handle / handle+key / handle+minimal key / fast_launch / handle (ints) / static (tensors) / static (ints)"
    print(f"{'row':26s} {'host us':>9s} {'fast off':>9s}  launches: {ways} us")
    for name, (stock, ours) in rows.items():
        line = f"{name:26s} {host_us(stock or ours):9.1f}"
        if ours is not None:
            with eager_fast_launch(False):
                line += f" {host_us(ours):9.1f}"
                records.clear()
                JITFunction.run = recording_run
                try:
                    ours()
                finally:
                    JITFunction.run = orig_run
            for jit, a, kw, grid, kernel in records:
                line += "  " + _replay(jit, a, kw, grid, kernel, host_us, torch, knobs)
        print(line, flush=True)
    torch.set_grad_enabled(True)
    if args.fwd_bwd:
        print("\n".join(_launch_fwd_bwd(max(20, args.calls // 20))), flush=True)
    if args.profile:
        for name, (_, ours) in rows.items():
            if ours is not None:
                print(cprofile_text(ours, f"{name} (500 calls)", rows=14, calls=500))


def _replay(jit, a, kw, grid, kernel, host_us, torch, knobs) -> str:
    """One recorded launch timed five ways (``cmd_launch``'s docstring)."""
    from truefuse.ops._launch.fast_launch import fast_launch

    opts = {k: v for k, v in kw.items() if k not in {p.name for p in jit.params}}
    names = [p.name for p in jit.params]
    bound = list(a) + [kw[n] if n in kw else jit.params[i].default for i, n in enumerate(names) if i >= len(a)]
    g = grid(dict(zip(names, bound, strict=False))) if callable(grid) else grid
    g0, g1, g2 = g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1
    dev = torch.cuda.current_device()

    def via_jit():
        jit.run(*a, grid=grid, warmup=False, **kw)

    def via_handle():
        stream = torch.cuda.current_stream(dev).cuda_stream
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound)  # fmt: skip

    def key_of(vals):
        out = []
        for v in vals:
            if isinstance(v, torch.Tensor):
                out.append((v.dtype, v.data_ptr() % 16 == 0))
            elif isinstance(v, int) and not isinstance(v, bool):
                out.append((v == 1, v % 16 == 0, -(2**31) <= v < 2**31))
            else:
                out.append(v)
        return tuple(out), tuple(opts.items())

    cache = {key_of(bound): kernel}

    def via_key():
        kern = cache[key_of(bound)]
        stream = torch.cuda.current_stream(dev).cuda_stream
        kern.run(g0, g1, g2, stream, kern.function, kern.packed_metadata, None,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound)  # fmt: skip

    tensors = [v for v in bound if isinstance(v, torch.Tensor)]
    min_cache = {(tensors[0].dtype, tuple(t.data_ptr() % 16 == 0 for t in tensors)): kernel} if tensors else {}

    def via_min_key():
        # what an op that validated its inputs (dtypes, shapes) still has to key: its tensors' 16-byte
        # alignment, which Triton specialises on (issue 47.3's "minimal cached key")
        kern = min_cache[(tensors[0].dtype, tuple(t.data_ptr() % 16 == 0 for t in tensors))] if tensors else kernel
        stream = torch.cuda.current_stream(dev).cuda_stream
        kern.run(g0, g1, g2, stream, kern.function, kern.packed_metadata, None,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound)  # fmt: skip

    def via_fast():
        fast_launch(jit, grid, *a, **kw)

    int_bound = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in bound]

    def via_handle_ints():  # Triton's launcher given the addresses as ints: no driver call a pointer
        stream = torch.cuda.current_stream(dev).cuda_stream
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *int_bound)  # fmt: skip

    fns = [via_jit, via_handle, via_key, via_min_key, via_fast, via_handle_ints]
    static = _static_launcher(kernel, dev, torch)
    if static is not None:
        launch, types, runtime = static
        rt = [bound[i] for i in runtime]
        ints = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in rt)

        def via_static():  # the pointers as tensors: torch's launcher reads each one's address (a driver call)
            launch(g0, g1, g2, types, (*rt, None, None), torch.cuda.current_stream(dev).cuda_stream)

        def via_static_ints():  # the addresses as ints, read in Python: no driver call a pointer
            launch(g0, g1, g2, types, (*ints, None, None), torch.cuda.current_stream(dev).cuda_stream)

        fns += [via_static, via_static_ints]
    times = [host_us(f) for f in fns]
    return f"{jit.fn.__name__}: " + " / ".join(f"{t:.1f}" for t in times) + ("" if static else " / static n/a")


def _static_launcher(kernel, dev, torch):
    """``(launch, arg_types, runtime_param_indices)`` launching ``kernel`` (a Triton 3.6+
    ``CompiledKernel``) through torch's static CUDA launcher (``torch._C._StaticCudaLauncher``, what
    Inductor launches its own kernels with), or None where it cannot: no such launcher, PDL,
    cooperative grids, clusters, scratch memory, tensor descriptors. ``launch(gx, gy, gz, types,
    args, stream)``, ``args`` the runtime parameters then the two scratch pointers (None)."""
    import tempfile

    C = getattr(torch._C, "_StaticCudaLauncher", None)
    md = kernel.metadata
    if C is None or md.launch_pdl or md.launch_cooperative_grid or md.num_ctas != 1:
        return None
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return None
    codes = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
             "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "fp64": "d"}  # fmt: skip
    names = list(kernel.src.signature)
    consts = {k[0] if isinstance(k, tuple) else (names.index(k) if isinstance(k, str) else k) for k in kernel.src.constants}
    types, runtime = "", []
    for i, ty in enumerate(kernel.src.signature.values()):
        if ty == "constexpr" or i in consts:
            continue
        if ty.startswith("*"):
            types += "O"
        elif ty in codes:
            types += codes[ty]
        else:
            return None  # a tensor descriptor
        runtime.append(i)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    loaded = C._load_kernel(f.name, md.name, md.shared, dev)
    function = loaded[1] if len(loaded) == 4 else loaded[0]  # torch 2.12+ returns the module first
    warps, shared = md.num_warps, md.shared

    def launch(gx, gy, gz, types, args, stream):
        C._launch_kernel(function, gx, gy, gz, warps, shared, types + "OO", args, stream)

    return launch, types, runtime


def _stock_rms_norm(x, w):
    """A transformers RMSNorm's forward as stock writes it (eps 1e-6)."""
    import torch

    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _stock_rope(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` as stock writes it (head dimension 64)."""
    import torch

    def rot(t):
        return torch.cat((-t[..., 32:], t[..., :32]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rot(q) * s, k * c + rot(k) * s


def _bi_linear(x, w):
    """``F.linear`` routed as a batch-invariant model's (its plain Triton GEMM)."""
    import torch.nn.functional as F

    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    with running_batch_invariant():
        return F.linear(x, w)


def _triton_version() -> str:
    import triton

    return triton.__version__


def _launch_fwd_bwd(calls: int) -> list[str]:
    """``cmd_launch``'s second table: each op's eager forward + backward, host µs a call, stock /
    fast launch off / on (``gpu_host_us`` over ``calls``: few rows, so that each kernel's GPU time
    stays below its launch's host time). The backward runs on the calling thread
    (``set_multithreading_enabled(False)``): with the autograd engine's hand-off to its CUDA device
    thread, one stock expression measured 547.6 and 334.6 µs in two rows of one table (H100,
    docs/results/bi/launch_host_h100_2026-12-07e.txt). Stock, off and on alternate over 3 rounds,
    each row's median kept."""
    import torch
    import torch.nn.functional as F

    from truefuse.autograd.gated_activation import gated_activation
    from truefuse.autograd.norm import rms_norm, rms_norm_hf
    from truefuse.autograd.rope import apply_rotary_pos_emb
    from truefuse.config import eager_fast_launch

    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    H, T = 1024, 128

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=bf).requires_grad_()

    x, nw = leaf(T, H), leaf(H)
    q, k = leaf(1, 16, T, 64), leaf(1, 8, T, 64)
    cos, sin = torch.randn(1, T, 64, device=dev, dtype=bf), torch.randn(1, T, 64, device=dev, dtype=bf)
    g, u = leaf(T, 2816), leaf(T, 2816)
    w = leaf(H, H)

    pairs = {  # name -> (stock, truefuse, the inputs differentiated)
        "rms_norm": (lambda: _stock_rms_norm(x, nw), lambda: rms_norm(x, nw, 1e-6), (x, nw)),
        "rms_norm_hf": (lambda: _stock_rms_norm(x, nw), lambda: rms_norm_hf(x, nw, 1e-6), (x, nw)),
        "rope": (lambda: _stock_rope(q, k, cos, sin), lambda: apply_rotary_pos_emb(q, k, cos, sin), (q, k)),
        "swiglu (g, u)": (lambda: F.silu(g) * u, lambda: gated_activation(g, "swiglu", u), (g, u)),
        "F.linear routed BI": (lambda: F.linear(x, w), lambda: _bi_linear(x, w), (x, w)),
    }

    def fwd_bwd(f, inputs):
        def run():
            out = f()
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs])

        return run

    head = f"{'fwd+bwd (grad)':<20} {'stock':>8} {'fast off':>9} {'fast on':>8} {'on/off':>7} {'on/stock':>9}"
    lines = [head + "  (host us a call)"]
    with torch.autograd.set_multithreading_enabled(False):
        for name, (stock, ours, inputs) in pairs.items():
            rounds = []
            for _ in range(3):
                s = gpu_host_us(fwd_bwd(stock, inputs), calls)
                with eager_fast_launch(False):
                    off = gpu_host_us(fwd_bwd(ours, inputs), calls)
                rounds.append((s, off, gpu_host_us(fwd_bwd(ours, inputs), calls)))
            s, off, on = (statistics.median(r[i] for r in rounds) for i in range(3))
            lines.append(f"{name:<20} {s:8.1f} {off:9.1f} {on:8.1f} {on / off:7.2f} {on / s:9.2f}")
    return lines


# --------------------------------------------------------------------------------------------------
# bi-linear


def cmd_bi_linear(args) -> None:
    """Where batch-invariant training spends its host time: a BI training step of the demo's model is
    host-bound on slower H100 hosts (wall 199 ms against 117 ms of GPU work, one profiled step,
    docs/results/bi/bi_profile_train_h100_2026-11-27.txt), and ``LinearFunction``'s forward and
    backward are most of it. Host µs per ``F.linear`` forward + backward (8192 × 2048 @ 2048², bf16;
    ``gpu_host_us`` over 30 calls) for stock and the routed BI call, one ``torch.mm``, one TMA
    ``bi_launch`` and one plain BI kernel launch; then cProfile of 30 BI calls and of one whole BI
    training step of the demo's model. Writes ``OUT/bi_linear_host.txt``."""
    import exp_bi_speed as bs
    import torch
    import torch.nn.functional as F

    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant
    from truefuse.kernels.gemm import _gemm_kernel
    from truefuse.ops.gemm.gemm_backends import triton as T

    os.makedirs(args.out, exist_ok=True)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 2048, **bf, requires_grad=True)
    w = torch.randn(2048, 2048, **bf, requires_grad=True)
    g = torch.randn(8192, 2048, **bf)

    def stock():
        F.linear(x, w).backward(g)
        x.grad = w.grad = None

    def bi():
        with running_batch_invariant():
            y = F.linear(x, w)
        y.backward(g)
        x.grad = w.grad = None

    out_t = torch.empty(8192, 2048, **bf)
    xd, wd = x.detach(), w.detach()
    tile = {**T._bi_meta(torch.bfloat16, 8192, "nt")}
    grid = T._bi_grid(8192, 2048, tile)
    fns = {
        "stock F.linear fwd+bwd": stock,
        "BI F.linear fwd+bwd": bi,
        "torch.mm": lambda: torch.mm(xd, wd.t(), out=out_t),
        "bi_launch (TMA kernel)": lambda: T.bi_launch(xd, wd.t(), out_t),
        "plain BI kernel launch": lambda: T._launch(_gemm_kernel, grid, xd, wd.t(), out_t, xd, out_t, False, 0, False, tile),
    }
    lines = [f"{k}: {gpu_host_us(f, 30, warmup=5):.1f} us host" for k, f in fns.items()]
    print("\n".join(lines), flush=True)
    text = ["\n".join(lines), bs._cprofile(lambda: [bi() for _ in range(30)], "BI F.linear fwd+bwd, 30 calls")]
    c = bs.CONFIGS["demo"]
    m = bs.variant(bs.build(c), "truefuse BI")
    m.train()
    ids = torch.randint(1, c["vocab"], (c["batch"], c["seq"]), device="cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    def step():
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    text.append(bs._cprofile(step, "one BI training step of the demo model", rows=45))
    with open(os.path.join(args.out, "bi_linear_host.txt"), "w") as f:
        f.write("\n\n".join(text))


# --------------------------------------------------------------------------------------------------
# generate

#: run name -> apply_truefuse's keywords (None: stock)
_ONLY = dict(rms_norm=False, mlp=False, rope=False, linear_cross_entropy=False, experts=False)
GENERATE_RUNS = {
    "stock": None,
    "fast": {},
    "norm only": {**_ONLY, "rms_norm": True},
    "rope only": {**_ONLY, "rope": True},
    "mlp only": {**_ONLY, "mlp": True},
    "loss only": {**_ONLY, "linear_cross_entropy": True},
    "none (wrappers)": dict(_ONLY),
    "attention only": {**_ONLY, "attention": True},
    "BI": {"batch_invariant": True},
}


def cmd_generate(args) -> None:
    """Which of ``apply_truefuse``'s patches costs greedy ``generate`` its host time (fast mode ran
    0.65-1.02x stock ``generate`` on H100 hosts, host-bound). The demo's GPU model (``exp_bi_speed``'s
    ``demo``: Llama 16 x 2048, vocabulary 128256, bf16), ``--new-tokens`` for 4 prompts of 64, under:
    stock; every patch; one patch only (``rms_norm``, ``rope``, ``mlp``, ``linear_cross_entropy``);
    ``attention=True`` only; batch-invariant. Timed round-robin (``--rounds``; each round one
    ``generate`` of every run, so the host's drift hits all alike): ms per new token, the median
    round, and the ratio to stock (a decode step is host time on an H100: ~2 ms of kernels a token
    against ~16 of host). Writes ``OUT/generate_host.json``; ``--config tiny --device cpu`` smoke-tests."""
    import copy
    import json

    import exp_bi_speed
    import torch

    from truefuse.integrations.huggingface import apply_truefuse

    exp_bi_speed.DEVICE = args.device
    c = exp_bi_speed.CONFIGS[args.config]
    base = exp_bi_speed.build(c).eval()
    g = torch.Generator(args.device).manual_seed(0)
    prompts = torch.randint(1, c["vocab"], (4, 64), device=args.device, generator=g)
    models = {}
    for name, kw in GENERATE_RUNS.items():
        m = copy.deepcopy(base)
        if kw is not None:
            apply_truefuse(m, **kw)
        models[name] = m.eval()

    def gen(m):
        m.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                   min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    times: dict = {n: [] for n in models}
    with torch.no_grad():
        for m in models.values():
            gen(m)
        for _ in range(args.rounds):
            for n, m in models.items():
                sync()
                t = time.perf_counter()
                gen(m)
                sync()
                times[n].append((time.perf_counter() - t) * 1e3 / args.new_tokens)
    med = {n: sorted(ts)[len(ts) // 2] for n, ts in times.items()}
    lines = [f"{'run':<18} {'ms/token':>9} {'x stock time':>13}"]
    lines += [f"{n:<18} {t:>9.2f} {t / med['stock']:>13.3f}" for n, t in med.items()]
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "generate_host.json"), "w") as f:
        json.dump(
            {
                "device": dev,
                "torch": torch.__version__,
                "args": {k: v for k, v in vars(args).items() if k != "fn"},
                "ms_per_token": times,
            },
            f,
            indent=1,
        )
    print("\n".join(lines))


# --------------------------------------------------------------------------------------------------
# train


def cmd_train(args) -> None:
    """A training step's forward and backward host time, stock transformers against
    ``apply_truefuse`` (under FSDP2 the small model's step is host time, and truefuse's forward took
    ~5 ms more host than stock's on 2 H100s, ``exp_fsdp_profile.py``'s phases).

    1. Per op, with a gradient (hidden 1024, 2 x 64 tokens, bf16): host µs of a forward alone and of
       forward + backward, stock's against truefuse's (``rms_norm_hf`` against the stock module,
       rope, the gated activation), ``gpu_host_us`` over ``--calls`` (few rows, so each kernel's GPU
       time stays below its launch's host time: training-sized rows measured the GPU, not the host).
    2. The small model of ``exp_fsdp_profile.py`` (Llama 4 x 1024, vocabulary 32000, 4 x 2048 tokens,
       bf16) on one GPU without FSDP: host ms of the forward and of the backward (no synchronisation
       inside; the median of 7 steps), then cProfile (``--sort``) over one forward of each run."""
    import torch

    print(torch.cuda.get_device_name(), torch.__version__)
    if args.ops:
        print("\n".join(_train_ops(args.calls, args.cprofile_ops, args.rows)))
    if args.model:
        print("\n".join(_train_model(args.rows, args.sort)))


def _train_ops(calls: int, cprofile: bool, rows: int) -> list[str]:
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as stock_rope

    from truefuse.autograd.gated_activation import gated_activation
    from truefuse.autograd.norm import rms_norm_hf
    from truefuse.autograd.rope import apply_rotary_pos_emb

    dev, bf = "cuda", torch.bfloat16
    H, B, L = 1024, 2, 64
    x = torch.randn(B, L, H, device=dev, dtype=bf, requires_grad=True)
    norm = LlamaRMSNorm(H).to(dev, bf)
    q = torch.randn(B, 16, L, 64, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(B, 8, L, 64, device=dev, dtype=bf, requires_grad=True)
    cos = torch.randn(B, L, 64, device=dev, dtype=bf)
    sin = torch.randn(B, L, 64, device=dev, dtype=bf)
    g = torch.randn(B * L, 2816, device=dev, dtype=bf, requires_grad=True)
    u = torch.randn(B * L, 2816, device=dev, dtype=bf, requires_grad=True)
    F = torch.nn.functional
    pairs = {
        "rms norm": (lambda: norm(x), lambda: rms_norm_hf(x, norm.weight, norm.variance_epsilon, style="llama")),
        "rope": (lambda: stock_rope(q, k, cos, sin), lambda: apply_rotary_pos_emb(q, k, cos, sin)),
        "silu(g) * u": (lambda: F.silu(g) * u, lambda: gated_activation(g, "swiglu", u)),
    }

    def fb(f):
        def run():
            out = f()
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        return run

    profiles: list[str] = []
    lines = [f"{'op (grad)':<14} {'stock fwd':>10} {'truefuse fwd':>13} {'stock f+b':>10} {'truefuse f+b':>13}  (host us)"]
    for name, (s, t) in pairs.items():
        row = [gpu_host_us(f, calls) for f in (s, t)] + [gpu_host_us(fb(f), calls // 2) for f in (s, t)]
        lines.append(f"{name:<14} {row[0]:>10.1f} {row[1]:>13.1f} {row[2]:>10.1f} {row[3]:>13.1f}")
        if cprofile:
            for who, f in (("stock", s), ("truefuse", t)):
                profiles.append(cprofile_text(fb(f), f"50 x forward + backward, {name}, {who}", rows=rows, calls=50))
                torch.cuda.synchronize()
    return lines + profiles


def _train_model(rows: int, sort: str) -> list[str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from truefuse.integrations.huggingface import apply_truefuse

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)  # fmt: skip
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    lines, profiles = [], []
    for run in ("stock", "truefuse"):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
        if run == "truefuse":
            apply_truefuse(m)
        fwd, bwd = [], []
        for i in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            m.zero_grad(set_to_none=True)
            if i >= 3:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
        lines.append(f"{run:<9} host forward {sorted(fwd)[3]:6.2f} ms  backward {sorted(bwd)[3]:6.2f} ms (median of 7)")
        torch.cuda.synchronize()
        profiles.append(cprofile_text(lambda m=m: m(input_ids=ids, labels=ids, use_cache=False), f"one forward, {run}",
                                      rows=rows, sort=sort))  # fmt: skip
        del m, loss
        torch.cuda.empty_cache()
    return lines + profiles


# --------------------------------------------------------------------------------------------------
# gaps

PHASES = ("forward", "backward", "optimizer")


def cmd_gaps(args) -> None:
    """Where a demo-style training step leaves the GPU idle: stock vs ``apply_truefuse`` vs
    Liger-Kernel, eager or with compiled layers, on the demo's GPU model (``exp_hf_profile.prepared``,
    fused AdamW as the demo). A demo step starts from an empty queue and ends in ``loss.item()``
    (``truefuse/demo/train.py``): the time between the step's host start and its last kernel's end
    that no kernel covers is idle. Each idle gap is charged to the host phase that launched the kernel
    after it (``forward`` = the model's forward and loss, ``backward``, ``optimizer``; before the first
    kernel: ``ramp``). Prints per run: step ms, kernel ms, idle ms by phase (means over ``--steps``
    profiled steps), then the ``--top`` largest gaps with the kernels around them. Liger runs last
    (liger_kernel importable for its run)."""
    from exp_hf_profile import run_names

    cols = ("ramp",) + PHASES + ("other",)
    print(f"{'run':<20}{'step ms':>9}{'kernel ms':>10}" + "".join(f"{'idle ' + c:>15}" for c in cols), flush=True)
    tops = {}
    for n in run_names(args.runs):
        idle, busy, total, gaps = _gaps_run(n, args.steps)
        tops[n] = gaps[: args.top]
        row = f"{n:<20}{total / 1e3:>9.2f}{busy / 1e3:>10.2f}" + "".join(f"{idle.get(c, 0.0) / 1e3:>15.2f}" for c in cols)
        print(row, flush=True)
    for n, gaps in tops.items():
        print(f"\n{n}: largest gaps over {args.steps} steps (µs, launching phase, kernel before -> after)")
        for us, ph, a, b in gaps:
            print(f"  {us:8.1f}  {ph:<9} {a} -> {b}")


def _gaps_run(name: str, steps: int, warmup: int = 4):
    import json
    import tempfile

    import torch
    from exp_hf_profile import prepared, release
    from torch.profiler import ProfilerActivity, profile, record_function

    model, opt, ids = prepared(name, fused=True)

    def step():
        with record_function("phase:forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step().item()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            with record_function("demo_step"):
                step().item()
                torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(f)
    release(model, opt)
    return gaps_of(trace)


def gaps_of(trace: dict):
    """(idle µs by phase, kernel µs, step µs: each a mean over the trace's ``demo_step`` marks;
    every gap [(µs, phase, kernel before, kernel after)], largest first)."""
    import collections

    ev = trace["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("name", "").startswith("phase:") and "dur" in e)
    step_marks = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == "demo_step" and "dur" in e)
    launch_ts = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"], e["args"].get("correlation"))
        for e in ev
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )

    def phase_at(t):
        for a, b, name in spans:
            if a <= t <= b:
                return name.split(":")[1]
        return "other"

    idle = collections.Counter()
    busy = total = 0.0
    gaps = []
    for s0, s1 in step_marks:
        ks = [k for k in kernels if s0 <= launch_ts.get(k[3], k[0]) <= s1]
        if not ks:
            continue
        total += max(k[1] for k in ks) - s0
        idle["ramp"] += max(0.0, ks[0][0] - s0)
        reach, prev = ks[0][0], None
        for k in ks:
            busy += max(0.0, k[1] - max(k[0], reach))
            if k[0] > reach and prev is not None:
                ph = phase_at(launch_ts.get(k[3], k[0]))
                idle[ph] += k[0] - reach
                gaps.append((k[0] - reach, ph, prev[:50], k[2][:50]))
            if k[1] > reach:
                reach, prev = k[1], k[2]
    n = max(len(step_marks), 1)
    return {k: v / n for k, v in idle.items()}, busy / n, total / n, sorted(gaps, reverse=True)


# --------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name, fn, what):
        s = sub.add_parser(name, help=what, description=fn.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        s.set_defaults(fn=fn)
        return s

    s = add("bi-stubbed", cmd_bi_stubbed, "CPU: BI mode's paths, every Triton launch stubbed")
    s.add_argument("--calls", type=int, default=200)
    s.add_argument("--rounds", type=int, default=7)
    s.add_argument("--hidden", type=int, default=64, help="K = N of the GEMMs (host time does not depend on it)")
    s.add_argument("--profile", default=None, help="a row name: print cProfile's top functions for it")
    s = add("function-floor", cmd_function_floor, "CPU: a do-nothing Python autograd Function against stock's swiglu")
    s.add_argument("--rounds", type=int, default=9)
    s = add("fusions", cmd_fusions, "CPU: issue 48's opt-in fusions' host cost, the tiny Llama, stubbed")
    s.add_argument("--calls", type=int, default=10)
    s.add_argument("--rounds", type=int, default=7)
    s = add("kept", cmd_kept, "CPU: kept launches off / on, the tiny Llama's generate and training step, stubbed")
    s.add_argument("--calls", type=int, default=10)
    s.add_argument("--rounds", type=int, default=5)
    s = add("eager", cmd_eager, "CPU: eager mode's autograd Function vs the dispatcher, launches stubbed")
    s.add_argument("--rounds", type=int, default=9)
    s = add("launch", cmd_launch, "GPU: decode-sized ops vs stock; each Triton launch five ways; fwd+bwd fast launch on/off")
    s.add_argument("--calls", type=int, default=2000)
    s.add_argument("--profile", action="store_true", help="cProfile each truefuse op's calls")
    s.add_argument("--no-fwd-bwd", dest="fwd_bwd", action="store_false", help="skip the forward + backward table")
    s = add("bi-linear", cmd_bi_linear, "GPU: routed BI F.linear forward + backward vs stock; cProfile of a BI step")
    s.add_argument("out", nargs="?", default="bi_linear_host")
    s = add("generate", cmd_generate, "GPU: which apply_truefuse patch costs generate its host time")
    s.add_argument("out")
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--new-tokens", type=int, default=32)
    s.add_argument("--config", default="demo", help="exp_bi_speed.CONFIGS: small, demo, tiny")
    s.add_argument("--device", default="cuda")
    s = add("train", cmd_train, "GPU: a training step's forward / backward host, per op and the small model")
    s.add_argument("--calls", type=int, default=100)
    s.add_argument("--rows", type=int, default=30)
    s.add_argument("--sort", default="cumulative", help="cProfile's order: cumulative or tottime")
    s.add_argument("--no-ops", dest="ops", action="store_false", help="the model runs only")
    s.add_argument("--no-model", dest="model", action="store_false", help="the ops only")
    s.add_argument("--cprofile-ops", action="store_true", help="cProfile 50 forward + backward calls of each op")
    s = add("gaps", cmd_gaps, "GPU: a demo step's idle gaps, by the host phase that launched each")
    s.add_argument("--runs", default="truefuse,truefuse+compile,stock+compile,liger")
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--top", type=int, default=8)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.cmd in ("bi-stubbed", "eager", "kept", "fusions", "function-floor"):
        os.environ["TRITON_INTERPRET"] = "1"  # before truefuse's kernels import: their launches are stubbed
    args.fn(args)


if __name__ == "__main__":
    main()
