"""Which of ``apply_truefuse``'s patches costs ``generate`` its host time (issue 34: BI ``generate``
against stock; fast mode itself ran 0.65-1.02x stock ``generate`` on H100 hosts, host-bound).

The demo's GPU model (``exp_bi_speed.py``'s ``demo``: Llama 16 x 2048, vocabulary 128256, bf16),
greedy ``generate`` of ``--new-tokens`` for 4 prompts of 64, under: stock; ``apply_truefuse`` with
every patch; with one patch only (``rms_norm``, ``rope``, ``mlp``, ``linear_cross_entropy``); with
``attention=True`` only; and batch-invariant. The runs are timed round-robin (``--rounds``; each
round one ``generate`` of every run, so the host's drift hits all alike): ms per new token, the
median round, and the ratio to stock. A decode step is host time on an H100 (~2 ms of kernels a
token against ~16 of host), so each ratio is the patch's host cost.

    PYTHONPATH=. python experiments/exp_generate_host.py OUT_DIR [--rounds 5] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from exp_bi_speed import CONFIGS, build  # noqa: E402

#: run name -> apply_truefuse's keywords (None: stock)
ONLY = dict(rms_norm=False, mlp=False, rope=False, linear_cross_entropy=False, experts=False)
RUNS = {
    "stock": None,
    "fast": {},
    "norm only": {**ONLY, "rms_norm": True},
    "rope only": {**ONLY, "rope": True},
    "mlp only": {**ONLY, "mlp": True},
    "loss only": {**ONLY, "linear_cross_entropy": True},
    "none (wrappers)": dict(ONLY),
    "attention only": {**ONLY, "attention": True},
    "BI": {"batch_invariant": True},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--config", default="demo", choices=sorted(CONFIGS))
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    import copy

    import exp_bi_speed

    from truefuse.integrations.huggingface import apply_truefuse

    exp_bi_speed.DEVICE = args.device
    c = CONFIGS[args.config]
    base = build(c).eval()
    g = torch.Generator(args.device).manual_seed(0)
    prompts = torch.randint(1, c["vocab"], (4, 64), device=args.device, generator=g)
    models = {}
    for name, kw in RUNS.items():
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
    for n, t in med.items():
        lines.append(f"{n:<18} {t:>9.2f} {t / med['stock']:>13.3f}")
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "generate_host.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "args": vars(args), "ms_per_token": times}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
