"""Batch-invariant mode's cost on a GPU (issue 34; docs/batch_invariance.md): tokens/s of a training
step (forward + backward + AdamW) of a transformers Llama under ``apply_truefuse`` (fast) and
``apply_truefuse(batch_invariant=True)`` with ``truefuse.attention``, and of greedy ``generate``
(KV cache) stock vs batch-invariant. One run, one card; prints a table, writes JSON to argv[1].

    python experiments/exp_bi_speed.py out.json [layers hidden vocab batch seq]
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch

from truefuse.demo.parity import register_attention
from truefuse.demo.parity_cli import build
from truefuse.integrations.huggingface import apply_truefuse


def _timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main() -> None:
    out = sys.argv[1]
    layers, hidden, vocab, batch, seq = (int(a) for a in (sys.argv[2:] or [6, 1024, 32000, 8, 1024]))
    base = build("llama", layers, hidden, vocab, torch.bfloat16, torch.device("cuda"), 0)
    base.config._attn_implementation = "sdpa"
    ids = torch.randint(1, vocab, (batch, seq), device="cuda")
    prompts = ids[:, :64]
    variants = {"stock": copy.deepcopy(base), "truefuse": copy.deepcopy(base), "truefuse BI": copy.deepcopy(base)}
    apply_truefuse(variants["truefuse"])
    apply_truefuse(variants["truefuse BI"], batch_invariant=True)
    variants["truefuse BI"].set_attn_implementation(register_attention())
    rows = {}
    for name, m in variants.items():
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step(m=m, opt=opt):
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        train_s = _timed(step, 3, 10)
        m.eval()

        def gen(m=m):
            m.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=64,
                       min_new_tokens=64, do_sample=False, pad_token_id=0)  # fmt: skip

        with torch.no_grad():
            gen_s = _timed(gen, 1, 3)
        rows[name] = {"train_tok_s": batch * seq / train_s, "gen_tok_s": batch * 64 / gen_s}
        del opt
    fast, stock = rows["truefuse"]["train_tok_s"], rows["stock"]["gen_tok_s"]
    print(f"{'run':<12} {'train tok/s':>12} {'vs fast':>8} {'generate tok/s':>15} {'vs stock':>9}")
    for name, r in rows.items():
        tr, gn = r["train_tok_s"], r["gen_tok_s"]
        print(f"{name:<12} {tr:>12.0f} {tr / fast:>8.3f} {gn:>15.0f} {gn / stock:>9.3f}")
    result = {"shape": [layers, hidden, vocab, batch, seq], "rows": rows, "device": torch.cuda.get_device_name()}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
