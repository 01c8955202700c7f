"""``python -m truefuse parity``: stock, truefuse and truefuse in batch-invariant mode on one model,
through the checks of ``demo/parity.py``; one table (docs/batch_invariance.md)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys

import torch

ARCHS = ("llama", "qwen3", "qwen3_moe")
MODES = ("stock", "truefuse", "truefuse BI")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=ARCHS, default="llama", help="model family, built from a config (random weights)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if present, else cpu")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "amp-bf16"],
        default="fp32",
        help="the model's dtype; amp-bf16: an fp32 model under bf16 torch.autocast (TRL's bf16=True)",
    )
    for name, default, help_ in [
        ("layers", 2, "decoder layers"),
        ("hidden", 64, "hidden size (head size 64 from 256 on, else 16)"),
        ("vocab", 256, "vocabulary"),
        ("batch", 4, "sequences per batch (a), prompts (b)"),
        ("seq", 24, "longest sequence (a); prompts are up to half of it"),
        ("new-tokens", 8, "tokens generated per prompt (b)"),
        ("steps", 3, "training steps per run (c)"),
        ("seed", 0, "weights and data"),
    ]:
        p.add_argument(f"--{name}", type=int, default=default, help=f"{help_} (default {default})")


def build(arch: str, layers: int, hidden: int, vocab: int, dtype, device, seed: int):
    """A ``*ForCausalLM`` of ``arch`` with random weights (seeded), eager attention."""
    import transformers as tf

    d = 64 if hidden >= 256 else 16  # head size
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // d,
        num_key_value_heads=max(1, hidden // (2 * d)),
        max_position_embeddings=4096,
    )
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**kw), tf.LlamaForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(head_dim=d, **kw), tf.Qwen3ForCausalLM
    else:
        cfg = tf.Qwen3MoeConfig(head_dim=d, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, **kw)
        cls = tf.Qwen3MoeForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return cls(cfg).to(device=device, dtype=dtype).eval()


def variant(model, mode: str):
    """A copy of ``model`` as ``mode`` runs it: the patched model alone carries its mode (no
    ``truefuse.batch_invariant()`` around the checks: a user's code has none)."""
    m = copy.deepcopy(model)
    if mode != "stock":
        from truefuse.integrations.huggingface import apply_truefuse

        apply_truefuse(m, batch_invariant=mode == "truefuse BI")
    return m


def run(args: argparse.Namespace) -> list[dict]:
    from truefuse.demo import parity  # imports transformers: here, not when the CLI builds its parser

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    amp = args.dtype == "amp-bf16"
    base = build(args.arch, args.layers, args.hidden, args.vocab, dtype, device, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(max(2, args.seq // 3), args.seq + 1, (args.batch,), generator=g).tolist()
    seqs = [torch.randint(1, args.vocab, (n,), generator=g).to(device) for n in lengths]
    prompts = [s[: max(2, len(s) // 2)] for s in seqs]
    batches = [torch.randint(1, args.vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(args.steps)]
    rows, stock_losses = [], None
    for mode in MODES:
        model = variant(base, mode)
        with torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            checks = {f"alone vs {side}-padded": parity.alone_vs_batch(model, seqs, side) for side in ("right", "left")}
            checks["generate vs forward"] = parity.generate_vs_forward(model, prompts, args.new_tokens)
            checks["sampler vs trainer"] = parity.sampler_vs_trainer(model, prompts, args.new_tokens, seed=args.seed)
            first = {side: parity.first_divergence(model, seqs, side) for side in ("right", "left")}
            runs = [parity.training_runs(model, batches), parity.training_runs(model, batches)]
        if mode == "stock":
            stock_losses = runs[0]
        for name, d in checks.items():
            side = name.split()[2].split("-")[0] if "padded" in name else None
            rows.append(
                {
                    "mode": mode,
                    "check": name,
                    "rows": d.rows,
                    "differing": d.differing,
                    "max_dlp": d.max_dlp,
                    "ratio_out": d.ratio_out,
                    "first": first.get(side) if d.differing else None,
                }
            )
        same_step = next((k for k, (a, b) in enumerate(zip(*runs, strict=True)) if a != b), None)
        rel = max(abs(a - b) / abs(b) for a, b in zip(runs[0], stock_losses, strict=True))
        differing = sum(a != b for a, b in zip(*runs, strict=True))
        rows.append(
            {
                "mode": mode,
                "check": "training twice",
                "rows": len(runs[0]),
                "differing": differing,
                "max_dlp": None,
                "ratio_out": None,
                "first": None if same_step is None else f"step {same_step}",
                "rel_dloss_vs_stock": rel,
            }
        )
    return rows


def print_table(rows: list[dict], out=sys.stdout) -> None:
    head = f"{'mode':<12} {'check':<22} {'rows differing':>15} {'max |Δ logp|':>13} {'ratio out':>10}  first divergence / note"
    print(head, file=out)
    for r in rows:
        dlp = "-" if r["max_dlp"] is None else f"{r['max_dlp']:.3e}"
        ratio = "-" if r["ratio_out"] is None else f"{100 * r['ratio_out']:.2f}%"
        note = r["first"] or ""
        if "rel_dloss_vs_stock" in r:
            note = (f"differ from {note}; " if note else "identical; ") + f"max rel Δloss vs stock {r['rel_dloss_vs_stock']:.1e}"
        print(
            f"{r['mode']:<12} {r['check']:<22} {str(r['differing']) + ' / ' + str(r['rows']):>15} {dlp:>13} {ratio:>10}  {note}",
            file=out,
        )


def main(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("parity: needs transformers: pip install truefuse[hf]", file=sys.stderr)
        return 2
    rows = run(args)
    print_table(rows)
    bi = [r for r in rows if r["mode"] == "truefuse BI"]
    return 0 if all(r["differing"] == 0 for r in bi) else 1
