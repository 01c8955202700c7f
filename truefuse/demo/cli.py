"""The ``demo`` command: check what it needs, build the config and the patches, run, report."""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from truefuse.demo import needs

HF_HINT = "pip install truefuse[hf]"

#: command-line settings that override the --size preset (None: the preset's)
_SETTINGS = ("dtype", "steps", "hidden", "layers", "heads", "kv_heads", "vocab", "seq", "batch", "lr", "corpus_bytes", "tol")
_SETTINGS += ("seed", "schedule", "world_size", "fsdp_policy", "head_unit", "compile_layers", "cuda_graphs")


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


def _apply_truefuse_adamw(model):
    """``apply_truefuse``, the run then stepping with ``truefuse.optim.AdamW`` (one launch a step)
    instead of torch's fused AdamW: the optimizer's share of the step (issue 48.4)."""
    from truefuse.integrations.huggingface import apply_truefuse

    return apply_truefuse(model)


_apply_truefuse_adamw.optimizer = "truefuse"  # read by train.py's Trainer


def _apply_truefuse_fusions(model):
    """``apply_truefuse`` with issue 48's opt-in fusions (the residual add + norm, the sibling
    projections' input gradient in the GEMMs), stepping with ``truefuse.optim.AdamW``."""
    from truefuse.integrations.huggingface import apply_truefuse

    return apply_truefuse(model, fuse_residual_norm=True, fuse_sibling_grads=True)


_apply_truefuse_fusions.optimizer = "truefuse"


def _apply_truefuse_bi_fusions(model):
    """The same fusions in batch-invariant mode (issue 48.6), stepping with ``truefuse.optim.AdamW``."""
    from truefuse.integrations.huggingface import apply_truefuse

    return apply_truefuse(model, batch_invariant=True, fuse_residual_norm=True, fuse_sibling_grads=True)


_apply_truefuse_bi_fusions.optimizer = "truefuse"


def stock_again(model):
    """The yardstick run: stock again, nothing patched (how far stock is from itself)."""
    return "nothing: stock run a second time (the yardstick of the loss columns)"


def liger_patch():
    """Liger-Kernel's Llama patch on the given model instance. Its RoPE patch replaces transformers'
    module-level function, so the liger run goes last (after stock and truefuse)."""
    import liger_kernel.transformers  # noqa: F401  (fails here, not in a rank, when it is missing)

    return _apply_liger


def _apply_liger(model):
    """Module-level (the FSDP2 ranks unpickle their patches)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(model=model)
    return "liger_kernel.transformers.apply_liger_kernel_to_llama(model=...) with its defaults"


def _apply_liger_nolce(model):
    """Liger's patch without its fused linear cross-entropy (transformers' loss): the Liger run whose
    step a CUDA graph can capture (``--cuda-graphs``)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(model=model, fused_linear_cross_entropy=False)
    return "apply_liger_kernel_to_llama(model=..., fused_linear_cross_entropy=False): transformers' loss"


#: why ``--cuda-graphs`` leaves Liger's step eager (demo/train.py reads it off the patch; so does
#: experiments/exp_graphs.py): a capture of it would fail
LIGER_READS_HOST = "Liger's fused linear cross-entropy reads its token count on the host (.item())"
_apply_liger.reads_host = LIGER_READS_HOST


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
        "--compile-layers",
        action="store_true",
        help="torch.compile each decoder layer of every run after its patch (before FSDP2's sharding): on a GPU, "
        "Inductor launches truefuse's kernels itself (docs/huggingface.md, 'With torch.compile'); slow to start on the CPU",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture every run's whole step (forward, backward, clip, AdamW) in one CUDA graph after the timing warm-up "
        "and replay it (docs/cuda_graphs.md); CUDA, one process",
    )
    p.add_argument(
        "--truefuse-adamw",
        action="store_true",
        help="add a run of truefuse stepping with truefuse.optim.AdamW instead of torch's fused AdamW (docs/optim.md)",
    )
    p.add_argument(
        "--fusions",
        action="store_true",
        help="add a run of truefuse with the opt-in fusions (fuse_residual_norm, fuse_sibling_grads) and "
        "truefuse.optim.AdamW (docs/add_norm.md, docs/sibling_linears.md); with --batch-invariant one in that mode too",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="add a run of truefuse in batch-invariant mode, and stock run twice (how far stock is from itself)",
    )
    f = p.add_argument_group("FSDP2 (--world-size N >= 2; also on the CPU, gloo)")
    f.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="train each run under FSDP2 on N local ranks (one GPU each, nccl; gloo on the CPU), each rank on its own "
        "--batch sequences of every step; default 1: the one-process demo",
    )
    f.add_argument(
        "--fsdp-policy",
        choices=["mp", "bf16", "none"],
        help="mp: fp32 parameters, MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), no autocast "
        "(implies --dtype amp-bf16); bf16: pure bf16 parameters, no policy (implies --dtype bf16); none: --dtype's "
        "parameters and autocast. Default: by --dtype (amp-bf16: mp, bf16: bf16, fp32: none)",
    )
    f.add_argument("--head-unit", action="store_true", help="also fully_shard(model.lm_head) as its own unit (before the root)")
    f.add_argument(
        "--sync-debug",
        action="store_true",
        help="count host synchronisations in the training work (forward, backward, clip, AdamW) of one extra step after "
        "each run (torch.cuda.set_sync_debug_mode('warn'); CUDA only) and print each run's top 10 call sites",
    )
    f.add_argument(
        "--profile",
        metavar="DIR",
        help="record a few extra steps of each run with torch.profiler on rank 0: DIR/<run>_top.txt (self CUDA and self "
        "CPU time, 40 rows each) and DIR/<run>_trace.json.gz (chrome trace, skipped over 16 MiB)",
    )
    p.add_argument("--out", default="demo_out", help="folder for results.json and demo.png (default: ./demo_out)")
    p.add_argument("--cache-dir", help="tokenizer cache (default: $TRUEFUSE_CACHE_DIR or ~/.cache/truefuse)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    why = needs.missing(("transformers", "tokenizers"), HF_HINT)
    if why:
        return _fail(why)
    from truefuse.demo.report import print_syncs, print_table, summarize, write
    from truefuse.demo.train import make_config, run_demo

    device, why = needs.device(args.device)
    if why:
        return _fail(why)
    size = args.size or ("gpu" if device == "cuda" else "cpu")
    settings = {k: getattr(args, k, None) for k in _SETTINGS}
    settings["head_unit"] = settings["head_unit"] or None
    settings["compile_layers"] = settings["compile_layers"] or None
    settings["cuda_graphs"] = settings["cuda_graphs"] or None
    try:
        cfg = make_config(size, device=device, **settings)
    except ValueError as e:
        return _fail(str(e))
    fsdp = cfg.world_size > 1
    if not fsdp and (getattr(args, "sync_debug", False) or getattr(args, "profile", None)):
        return _fail("--sync-debug and --profile look at FSDP2 runs: give --world-size N (N >= 2)")
    if fsdp and device == "cuda" and torch.cuda.device_count() < cfg.world_size:
        return _fail(f"--world-size {cfg.world_size} needs {cfg.world_size} GPUs, torch sees {torch.cuda.device_count()}")
    if fsdp and getattr(args, "batch_invariant", False):
        return _fail("--batch-invariant is a one-process demo (no --world-size)")

    try:
        peers = {"truefuse": truefuse_patch()}
    except ImportError as e:
        return _fail(f"truefuse.integrations.huggingface.apply_truefuse is not importable here ({e})")
    if getattr(args, "truefuse_adamw", False):
        peers["truefuse adamw"] = _apply_truefuse_adamw
    if getattr(args, "fusions", False):
        peers["truefuse fused"] = _apply_truefuse_fusions
    if getattr(args, "batch_invariant", False):
        peers["stock again"] = stock_again
        peers["truefuse BI"] = truefuse_bi_patch()
        if getattr(args, "fusions", False):
            peers["truefuse BI fused"] = _apply_truefuse_bi_fusions
    if args.peer == "liger":
        try:
            peers["liger"] = liger_patch()
        except ImportError as e:
            return _fail(f"--peer liger needs liger-kernel, which is not importable here ({e}): pip install liger-kernel")
        if device != "cuda":
            return _fail("--peer liger needs a CUDA device (Liger's kernels are Triton GPU kernels)")
        if cfg.schedule != "sequential":
            return _fail("--peer liger needs --schedule sequential (its RoPE patch is process-wide)")
        if cfg.cuda_graphs:  # Liger's own step stays eager (it reads the host): its graphable form beside it
            peers["liger, no fused loss"] = _apply_liger_nolce

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    if fsdp:
        from truefuse.demo.fsdp import run_fsdp_demo

        result = run_fsdp_demo(cfg, peers, args.cache_dir, args.quiet, log, sync_debug=args.sync_debug, profile_dir=args.profile)
        for run in result.runs:
            for w in run.extra.get("warnings", []):
                log(f"{run.name}: warning: {w}")
    else:
        # the BI run apart: interleaved, its slower steps slowed the others (train.py::run_demo)
        apart = ("truefuse BI",) if "truefuse BI" in peers else ()
        result = run_demo(cfg, peers, cache_dir=args.cache_dir, quiet=args.quiet, log=log, apart=apart)
    rows = summarize(result)
    print_table(result, rows)
    print_syncs(result)
    paths = write(result, rows, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    # the command fails when truefuse's curve leaves stock's by more than the tolerance (or it failed)
    ok = any(r["run"] == "truefuse" for r in rows) and not any(r["run"] == "truefuse" and r["verdict"] == "DIFFERS" for r in rows)
    return 0 if ok else 1
