"""The ``demo`` command: check what it needs, build the config and the patches, run, report."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys

import torch

HF_HINT = "pip install truefuse[hf]"

#: command-line settings that override the --size preset (None: the preset's)
_SETTINGS = ("dtype", "steps", "hidden", "layers", "heads", "kv_heads", "vocab", "seq", "batch", "lr", "corpus_bytes", "tol")
_SETTINGS += ("seed", "schedule")


def _fail(msg: str) -> int:
    print(f"demo: {msg}", file=sys.stderr)
    return 2


def truefuse_patch():
    """``apply_truefuse`` from truefuse's Hugging Face integration (imported only when a demo runs)."""
    from truefuse.integrations.huggingface import apply_truefuse

    return apply_truefuse


def truefuse_bi_patch():
    """``apply_truefuse(model, batch_invariant=True)``, which also puts the model's attention on
    ``truefuse.attention`` (docs/batch_invariance.md)."""
    from truefuse.integrations.huggingface import apply_truefuse

    return functools.partial(apply_truefuse, batch_invariant=True)


def stock_again(model):
    """The yardstick run: stock again, nothing patched (how far stock is from itself)."""
    return "nothing: stock run a second time (the yardstick of the loss columns)"


def liger_patch():
    """Liger-Kernel's Llama patch on the given model instance. Its RoPE patch replaces transformers'
    module-level function, so the liger run goes last (after stock and truefuse)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    def patch(model):
        apply_liger_kernel_to_llama(model=model)
        return "liger_kernel.transformers.apply_liger_kernel_to_llama(model=...) with its defaults"

    return patch


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("size (each overrides the --size preset)")
    p.add_argument("--size", choices=["cpu", "gpu"], help="preset: cpu (small, fp32) or gpu (~1.3B, bf16); default: by --device")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if present, else cpu")
    p.add_argument(
        "--dtype", choices=["fp32", "bf16", "amp-bf16"], help="bf16 = pure bf16 training; amp-bf16 = fp32 weights + bf16 autocast"
    )
    for name, typ, help_ in [
        ("steps", int, "training steps per run"),
        ("hidden", int, "hidden size (heads keep the preset's head size unless --heads)"),
        ("layers", int, "decoder layers"),
        ("heads", int, "attention heads"),
        ("kv-heads", int, "key/value heads"),
        ("vocab", int, "the model's vocab_size; the BPE tokenizer is trained to at most this"),
        ("seq", int, "sequence length"),
        ("batch", int, "sequences per step"),
        ("lr", float, "peak learning rate"),
        ("corpus-bytes", int, "bytes of stdlib source to read"),
        ("tol", float, "max |loss - stock loss| for a run to count as matching"),
    ]:
        g.add_argument(f"--{name}", type=typ, help=help_)
    p.add_argument("--seed", type=int, help="seed of the initial weights and the batch order (default 0)")
    p.add_argument(
        "--schedule",
        choices=["auto", "interleaved", "sequential"],
        help="interleaved: the runs take turns step by step (fair timings on a shared CPU); sequential: one run "
        "after the other (each run's CUDA peak memory its own); auto (default): interleaved on cpu, sequential on cuda",
    )
    p.add_argument("--peer", choices=["liger"], help="add a third run patched by this library")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="add a run of truefuse in batch-invariant mode, and stock run twice (how far stock is from itself)",
    )
    p.add_argument("--out", default="demo_out", help="folder for results.json and demo.png (default: ./demo_out)")
    p.add_argument("--cache-dir", help="tokenizer cache (default: $TRUEFUSE_CACHE_DIR or ~/.cache/truefuse)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return _fail(f"needs transformers and tokenizers ({e.name or e} is missing): {HF_HINT}")
    if importlib.util.find_spec("matplotlib") is None:
        return _fail("needs matplotlib for its plot: pip install truefuse[bench]")
    from truefuse.demo.report import print_table, summarize, write
    from truefuse.demo.train import make_config, run_demo

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda asked for, but torch sees no CUDA device")
    size = args.size or ("gpu" if device == "cuda" else "cpu")
    settings = {k: getattr(args, k) for k in _SETTINGS}
    try:
        cfg = make_config(size, device=device, **settings)
    except ValueError as e:
        return _fail(str(e))

    try:
        peers = {"truefuse": truefuse_patch()}
    except ImportError as e:
        return _fail(f"truefuse.integrations.huggingface.apply_truefuse is not importable here ({e})")
    if getattr(args, "batch_invariant", False):
        peers["stock again"] = stock_again
        peers["truefuse BI"] = truefuse_bi_patch()
    if args.peer == "liger":
        try:
            peers["liger"] = liger_patch()
        except ImportError as e:
            return _fail(f"--peer liger needs liger-kernel, which is not importable here ({e}): pip install liger-kernel")
        if device != "cuda":
            return _fail("--peer liger needs a CUDA device (Liger's kernels are Triton GPU kernels)")
        if cfg.schedule != "sequential":
            return _fail("--peer liger needs --schedule sequential (its RoPE patch is process-wide)")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    result = run_demo(cfg, peers, cache_dir=args.cache_dir, quiet=args.quiet, log=log)
    rows = summarize(result)
    print_table(result, rows)
    paths = write(result, rows, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    # the command fails when truefuse's curve leaves stock's by more than the tolerance
    return 1 if any(r["run"] == "truefuse" and r["verdict"] == "DIFFERS" for r in rows) else 0
