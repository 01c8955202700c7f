"""Command line: ``python -m truefuse {verify,info,bench,demo,parity,rl}``."""

from __future__ import annotations

import argparse
import sys

import torch


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _positive_int(text: str) -> int:
    """argparse type of ``--world-size``: a whole number of at least 1 (absent means no group)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n} (leave it out for the plain verify)")
    return n


def _cmd_verify(args: argparse.Namespace) -> int:
    from truefuse.verify import print_table, verify

    if args.device == "cuda" and not torch.cuda.is_available():
        print("verify: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.world_size is not None:
        return _verify_distributed(args.world_size, args.device, args.op)
    device = torch.device(args.device)
    try:
        rows = verify(device, args.op or None, quiet=args.quiet)
    except ValueError as e:
        print(f"verify: {e}", file=sys.stderr)
        return 2
    print_table(rows, device)
    return 0 if rows and all(r.passed for r in rows) else 1


def _verify_distributed(world_size: int, device: str, ops: list[str] | None = None) -> int:
    """The bitwise table of the allreduce + RMSNorm contract and the tensor-parallel layers' table
    (``verify/distributed_tp.py``) on one local process group."""
    from truefuse.distributed.launch import run_local
    from truefuse.verify.distributed_table import OPS, format_table
    from truefuse.verify.distributed_tp import OPS as TP_OPS
    from truefuse.verify.distributed_tp import format_tp_table, tables
    from truefuse.verify.distributed_vocab import OP as VOCAB_OP

    # every row of the allreduce table checks all of OPS: an --op among them runs that whole table
    known = OPS + TP_OPS + (VOCAB_OP,)
    unknown = [o for o in ops or () if o not in known]
    if unknown:
        print(
            f"verify: --op {unknown[0]!r} is not in the distributed tables that --world-size runs; their ops: {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    if device == "cuda" and torch.cuda.device_count() < world_size:
        print(f"verify: --world-size {world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    per_rank = run_local(world_size, tables, device, ops or None, backend="nccl" if device == "cuda" else "gloo")
    allreduce_rows = [r for r in per_rank[0] if "op" not in r]  # the layers' rows carry "op"
    if allreduce_rows:
        print(format_table(allreduce_rows, world_size))
    if len(allreduce_rows) < len(per_rank[0]):
        print(format_tp_table([r for r in per_rank[0] if "op" in r], world_size))
    failed = sum(not r["passed"] for rows in per_rank for r in rows)
    print(f"{sum(len(r) for r in per_rank) - failed} passed, {failed} failed (all ranks)")
    return 0 if failed == 0 else 1


def _cmd_info(args: argparse.Namespace) -> int:
    from truefuse.info import print_info

    try:
        print_info()
    except ValueError as e:  # bad configuration (e.g. TRUEFUSE_GEMM_BACKENDS): one line, not a traceback
        print(f"info: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from truefuse.bench import run_bench

    return run_bench(args.name, args.providers, args.out, args.quick, args.world_size)


def _cmd_demo(args: argparse.Namespace) -> int:
    from truefuse.demo.cli import main as run_demo_cli

    return run_demo_cli(args)


def _cmd_parity(args: argparse.Namespace) -> int:
    from truefuse.demo.parity_cli import main as run_parity

    return run_parity(args)


def _cmd_rl(args: argparse.Namespace) -> int:
    from truefuse.demo.rl_cli import main as run_rl_cli

    return run_rl_cli(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m truefuse", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    v = sub.add_parser("verify", help="check every declared numerics contract on a device")
    v.add_argument("--device", choices=["cpu", "cuda"], default=_default_device(), help="default: cuda if present, else cpu")
    v.add_argument(
        "--op",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="only these ops, e.g. --op gemm rms_norm (or --op gemm --op rms_norm)",
    )
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.add_argument(
        "--world-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="run the allreduce + RMSNorm table, the tensor-parallel layers' and the vocab-parallel loss's tables on "
        "N >= 1 local processes "
        "(gloo on cpu, nccl on cuda) instead of the plain verify",
    )
    v.set_defaults(fn=_cmd_verify)

    i = sub.add_parser("info", help="versions, devices, GEMM capabilities and plans")
    i.set_defaults(fn=_cmd_info)

    b = sub.add_parser("bench", help="benchmarks (meaningful on a GPU)")
    b.add_argument("name", help="which benchmark, e.g. gemm")
    b.add_argument("--providers", nargs="+", help="only these providers")
    b.add_argument("--out", default="bench_results", help="folder for JSON and PNG results")
    b.add_argument("--quick", action="store_true", help="small shapes (a smoke run, not a measurement)")
    b.add_argument("--world-size", type=int, default=0, help="GPUs for a distributed benchmark (allreduce_add_rmsnorm)")
    b.set_defaults(fn=_cmd_bench)

    d = sub.add_parser("demo", help="train a small Llama on the stdlib's sources, stock vs truefuse: loss, time, memory")
    from truefuse.demo.cli import add_arguments

    add_arguments(d)
    d.set_defaults(fn=_cmd_demo)

    q = sub.add_parser("parity", help="stock, truefuse, truefuse BI: alone vs batched, generate vs forward, two runs")
    from truefuse.demo.parity_cli import add_arguments as parity_arguments

    parity_arguments(q)
    q.set_defaults(fn=_cmd_parity)

    r = sub.add_parser("rl", help="GRPO on digit addition, stock vs truefuse BI: reward, sampler-trainer gap, time")
    from truefuse.demo.rl_cli import add_arguments as rl_arguments

    rl_arguments(r)
    r.set_defaults(fn=_cmd_rl)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
