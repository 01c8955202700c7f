"""Host time of batch-invariant (BI) mode's hot paths with every Triton launch stubbed to a no-op
(CPU, ``TRITON_INTERPRET=1``): what the host spends around the kernels, no GPU needed (issue 34:
BI ``generate`` and the BI training step are host-bound on an H100). A host-time count on this
box, not a GPU timing; the real launcher's cost (Triton's ``JITFunction.run``) is not in it. Timed
as this thread's CPU time (``time.thread_time``), so other processes on a loaded box count less.

The GEMMs are planned as on CUDA: the Triton backend gets a ``batch_invariant`` row on the CPU for
the block (``override_capabilities``), so the plan is ``triton[float32]: fused mm+batch_invariant``
as CUDA's ``triton[bfloat16]`` (fp32 here: the interpreter's bf16 is not the GPU's, and the launch
is stubbed anyway). Rows (µs per call, the minimum over rounds of ``--calls`` calls, one thread):

* ``gemm bi``: ``truefuse.gemm(x, w.t(), batch_invariant=True)``, 8 rows, outside the mode;
* ``F.linear M=1 / M=8``: ``F.linear`` routed by ``apply_truefuse(batch_invariant=True)``'s mode,
  no grad (``generate``'s decode);
* ``F.linear grad fwd`` / ``F.linear grad fwd+bwd``: with a weight that requires grad, the forward
  alone and forward + backward (the weight gradient is a real CPU GEMM of a 64 x 64 weight);
* ``attention decode``: ``attn_implementation="truefuse"``'s forward for one query against 256
  cached keys with a bool mask (``integrations/huggingface/attention.py``), no grad;
* ``attention fwd+bwd``: ``truefuse.attention`` causal, 64 queries, forward + backward;
* ``generate tiny`` / ``train step tiny`` (stock, fast, BI): a 2-layer Llama (hidden 64,
  vocabulary 256) stock, under ``apply_truefuse`` and ``apply_truefuse(batch_invariant=True)``:
  greedy ``generate`` of 8 tokens for 4 prompts of 16, and forward + backward of 4 x 32 tokens
  (µs per call: the whole call's host time, transformers' own included; ``--calls`` / 20 calls),
  and the two ratios of issue 34's goals on this host time alone (kernels cost nothing here: an
  upper bound where the GPU run is host-bound, not a prediction of it).

Run: ``PYTHONPATH=. python experiments/exp_bi_host_time.py [--calls 200] [--rounds 7] [--profile ROW]``
from a checkout (the same file run from another checkout's root measures that checkout; the base
numbers in docs/benchmarks.md came that way).
"""

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # before truefuse's kernels import: their launches are stubbed below


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--hidden", type=int, default=64, help="K = N of the GEMMs (host time does not depend on it)")
    p.add_argument("--profile", default=None, help="a row name: print cProfile's top functions for it")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    import triton.runtime.interpreter as interpreter

    import truefuse
    import truefuse.ops.lm_head.linear_cross_entropy as lce
    from truefuse.integrations.huggingface.attention import attention_forward
    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant
    from truefuse.ops.gemm import gemm_plan_for
    from truefuse.ops.gemm_plan import Capability, override_capabilities

    interpreter.InterpretedFunction.run = lambda self, *a, **k: None  # host work only
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
    # decode attention: 4 sequences, 16/8 heads, D 64, 256 cached keys, transformers' bool mask
    Lk = 256
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

    def lin_grad_fwd():
        F.linear(xg, wg, b)

    def lin_grad_bwd():
        F.linear(xg, wg, b).backward(dy)

    def attn_train():
        truefuse.attention(qt, kt, vt, is_causal=True, enable_gqa=True).backward(do)

    rows = {
        "gemm bi": (False, lambda: truefuse.gemm(x8.view(8, H), w.t(), batch_invariant=True)),
        "F.linear M=1": (True, lambda: F.linear(x1, w, b)),
        "F.linear M=8": (True, lambda: F.linear(x8, w, b)),
        "F.linear grad fwd": (True, lin_grad_fwd),
        "F.linear grad fwd+bwd": (True, lin_grad_bwd),
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

        # a BI model's own hooks enter the mode: run outside it
        rows[f"generate tiny {run}"] = (None, generate)
        rows[f"train step tiny {run}"] = (None, train_step)
        grads.add(f"train step tiny {run}")
    res: dict = {}
    with override_capabilities(add=[Capability("batch_invariant", F32, F32, "cpu", "triton")]):
        print("plan:", gemm_plan_for(x8.view(8, H), w.t(), batch_invariant=True))
        for _ in range(args.rounds):
            for name, (in_mode, fn) in rows.items():
                calls = args.calls if in_mode is not None else max(1, args.calls // 20)
                with torch.set_grad_enabled(name in grads), _scope(in_mode, running_batch_invariant, truefuse):
                    for _ in range(2):
                        fn()
                    t = time.thread_time()
                    for _ in range(calls):
                        fn()
                    res.setdefault(name, []).append((time.thread_time() - t) / calls * 1e6)
        for name in rows:
            print(f"{name:24s} {min(res[name]):8.1f} us")
        if "generate tiny BI" in res:
            best = {k: min(v) for k, v in res.items()}
            print(f"BI generate vs stock (tokens/s): {best['generate tiny stock'] / best['generate tiny BI']:.2f}x; "
                  f"BI train step vs fast: {best['train step tiny fast'] / best['train step tiny BI']:.2f}x")  # fmt: skip
        if args.profile:
            import cProfile
            import pstats

            in_mode, fn = rows[args.profile]
            with torch.set_grad_enabled(args.profile in grads), _scope(in_mode, running_batch_invariant, truefuse):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(args.calls if in_mode is not None else max(1, args.calls // 20)):
                    fn()
                pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def _scope(in_mode, running_batch_invariant, truefuse):
    """The row's context: the model's mode (``running_batch_invariant``), the switch alone, or
    nothing (a patched model enters the mode itself)."""
    import contextlib

    if in_mode is None:
        return contextlib.nullcontext()
    return running_batch_invariant() if in_mode else truefuse.batch_invariant()


def _tiny_llama(run: str):
    """A 2-layer Llama, stock (``run="stock"``) or under ``apply_truefuse`` (``"fast"``) or
    ``apply_truefuse(batch_invariant=True)`` (``"BI"``); None without transformers."""
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
        apply_truefuse(model, batch_invariant=run == "BI")
    return model


if __name__ == "__main__":
    main()
