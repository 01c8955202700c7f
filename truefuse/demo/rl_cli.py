"""The ``rl`` command: check what it needs, build the config, run, report (docs/rl.md)."""

from __future__ import annotations

import argparse
import sys

from truefuse.demo import needs

#: command-line settings that override the preset (None: the preset's)
_SETTINGS = ("dtype", "steps", "hidden", "layers", "digits", "prompts", "group", "lr", "temperature", "seed")


def _fail(msg: str) -> int:
    print(f"rl: {msg}", file=sys.stderr)
    return 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if present, else cpu; picks the preset")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="parameters and compute (preset: fp32 on cpu, bf16 on cuda)")
    g = p.add_argument_group("size (each overrides the preset)")
    for name, typ, help_ in [
        ("steps", int, "GRPO steps per run"),
        ("hidden", int, "hidden size (heads keep the preset's head size)"),
        ("layers", int, "decoder layers"),
        ("digits", int, "digits of each operand (1-6); the answer has one more"),
        ("prompts", int, "prompts a step"),
        ("group", int, "completions a prompt (GRPO's G, at least 2)"),
        ("lr", float, "AdamW learning rate"),
        ("temperature", float, "sampling temperature (> 0)"),
        ("seed", int, "weights, prompts and sampling (default 0)"),
    ]:
        g.add_argument(f"--{name}", type=typ, help=help_)
    p.add_argument("--fast", action="store_true", help="add a third run: plain apply_truefuse (fast mode, not batch-invariant)")
    p.add_argument(
        "--graphed-generate",
        action="store_true",
        help="every run samples with generate's decode steps replayed as CUDA graphs (graph_decode; cuda only)",
    )
    p.add_argument("--out", default="rl_out", help="folder for rl.json and rl.png (default: ./rl_out)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    why = needs.missing(("transformers",), "pip install truefuse[hf]")
    if why:
        return _fail(why)
    from truefuse.demo.rl import make_config, progress_bar, run_rl
    from truefuse.demo.rl_report import bi_exact, print_table, summarize, write

    device, why = needs.device(args.device)
    if why:
        return _fail(why)
    settings = {k: getattr(args, k, None) for k in _SETTINGS}
    try:
        cfg = make_config(
            "gpu" if device == "cuda" else "cpu",
            device=device,
            fast=bool(args.fast) or None,
            graphed=bool(getattr(args, "graphed_generate", False)) or None,
            **settings,
        )
    except ValueError as e:
        return _fail(str(e))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    with progress_bar(cfg.steps * len(cfg.runs), args.quiet) as on_step:
        result = run_rl(cfg, on_step=on_step, log=log)
    rows = summarize(result)
    print_table(result, rows)
    paths = write(result, rows, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    # the command fails when the batch-invariant run's sampler and trainer disagree anywhere
    return 0 if bi_exact(rows) else 1
