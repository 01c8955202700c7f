"""``python -m truefuse bench linear_log_probs``: per-token log-probs and entropy from the LM head
(what GRPO/PPO trainers compute), forward + backward with random upstream gradients of both, bf16.

Providers, side by side in one run (ratios against ``gemms``, the shape's three cuBLAS GEMMs):

* ``truefuse``: ``truefuse.linear_log_probs`` (default chunk; the backward recomputes the logits:
  four GEMMs); ``truefuse_main_grad``: the weight gradient into an fp32 ``main_grad`` (an input);
* ``plain``: ``F.linear`` in bf16, then ``log_softmax`` / ``logsumexp − Σ softmax·u`` on the fp32
  logits (what trainers write, materializing them), and ``compile_plain``: ``torch.compile`` of it.

``peak MiB`` is above the inputs; the returned gradients (input + weight, bf16) are part of it.
"""

from __future__ import annotations

import torch

from truefuse.autograd.linear_log_probs import linear_log_probs
from truefuse.bench.bench_linear_cross_entropy import _compiled_step, _gemms, _inputs
from truefuse.bench.harness import Sweep
from truefuse.ops.lm_head.linear_log_probs import linear_log_probs_plain


def _step(fn, main_grad=False):
    def make(p, device):
        x, W, t = _inputs(p, device)
        if main_grad:
            W.main_grad = torch.zeros(W.shape, dtype=torch.float32, device=device)
        g = torch.Generator(device=device).manual_seed(1)
        a = torch.randn(p["N"], generator=g, device=device)
        c = torch.randn(p["N"], generator=g, device=device)

        def run():
            x.grad = W.grad = None
            lp, ent = fn(x, W, t)
            torch.autograd.backward((lp, ent), (a, c))

        return run

    return make


def _plain(x, W, t):
    return tuple(linear_log_probs_plain(x, W, t))


def sweep(quick: bool) -> Sweep:
    if quick:
        points = [{"N": 64, "V": 500, "H": 32}]
    else:
        points = [
            {"N": 4096, "V": 128256, "H": 4096},
            {"N": 8192, "V": 128256, "H": 4096},
            {"N": 8192, "V": 152064, "H": 3584},  # Qwen2.5-7B's head
        ]
    providers = {
        "gemms": _gemms,
        "truefuse": _step(lambda x, W, t: tuple(linear_log_probs(x, W, t))),
        "truefuse_main_grad": _step(lambda x, W, t: tuple(linear_log_probs(x, W, t, fuse_wgrad_accumulation=True)), True),
        "plain": _step(_plain),
        "compile_plain": _step(_compiled_step("log_probs_plain", _plain)),
    }
    return Sweep(
        name="linear_log_probs",
        points=points,
        providers=providers,
        reference="gemms",
        x="N",
        flops=lambda p: 6.0 * p["N"] * p["V"] * p["H"],
        rounds=2,
    )
