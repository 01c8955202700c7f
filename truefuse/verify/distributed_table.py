"""The bitwise table of docs/design.md §4 (``allreduce`` and ``allreduce_add_rmsnorm``), run inside every
rank of a process group: ``python -m truefuse verify --world-size N`` and tests/distributed. Not a
``cases_<op>`` module of the registry: its rows need a process group, which ``run_local`` makes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from truefuse.autograd.norm import rms_norm
from truefuse.distributed.allreduce import allreduce, allreduce_add_rmsnorm, ordered_sum
from truefuse.ops.norm.norm import use_kernel
from truefuse.testing import bitwise_report

ROWS = (1, 4, 8, 16, 20, 32, 64, 128, 1000)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The ops the table checks. Every row checks both (the sum, then the fused add + RMSNorm on the
#: same inputs), so the table has no per-op subset: ``verify --world-size N --op`` accepts these
#: names and runs the whole table, and refuses any other.
OPS = ("allreduce", "allreduce_add_rmsnorm")


def _rand(shape, seed, dtype, device):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def case(m: int, hidden: int, dtype: torch.dtype, device, workspace=None, path: str = "reference", reference=None) -> dict:
    """One row: the allreduce against the ordered fp32 sum of every rank's input (rebuilt locally
    from the seeds, no collective involved), equal bits on every rank, residual_out, normed, a zero
    residual, untouched inputs, and the gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = (m * 7919 + hidden) * 16
    xs = [_rand((m, hidden), seed + r, dtype, device) for r in range(world)]
    x = xs[rank]
    residual = _rand((m, hidden), seed - 3 - rank, dtype, device)  # each rank its own: outputs are per rank
    weight = _rand((hidden,), seed - 2, dtype, device)
    x0, res0 = x.clone(), residual.clone()

    want = ordered_sum(xs)
    got = allreduce(x, workspace=workspace)
    rep = bitwise_report(got, want)
    everyone = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(everyone, got)
    same_everywhere = all(bitwise_report(e, everyone[0]).equal for e in everyone)

    normed, residual_out = allreduce_add_rmsnorm(x, residual, weight, 1e-6, workspace=workspace)
    ok_res = bitwise_report(residual_out, got + residual).equal
    ok_norm = bitwise_report(normed, rms_norm(residual_out, weight, 1e-6)).equal
    _, res_zero = allreduce_add_rmsnorm(x, torch.zeros_like(residual), weight, 1e-6, workspace=workspace)
    ok_zero = bitwise_report(res_zero, got).equal
    # batch invariance: row r of the m-row call is the 1-row call on row r (first and last rows)
    invariant = True
    for r in sorted({0, m - 1}):
        n1, o1 = allreduce_add_rmsnorm(x[r : r + 1], residual[r : r + 1], weight, 1e-6, workspace=workspace)
        invariant &= bitwise_report(n1, normed[r : r + 1]).equal and bitwise_report(o1, residual_out[r : r + 1]).equal
    untouched = bitwise_report(x, x0).equal and bitwise_report(residual, res0).equal
    # the backward: d_x = d_residual = the residual's gradient plus the norm's backward (on the rstd
    # the forward saved), d_weight the norm's; bitwise autograd through truefuse.rms_norm on residual_out.
    # Wherever the norm's kernels run (use_kernel): every row on a GPU (each kernel variant stores
    # rstd); on the CPU (fp32 under TRITON_INTERPRET=1: one code path at any size, and slow) rows up
    # to 8. Elsewhere autograd differentiates the norm's reference inside the composition, whose
    # gradient sums its terms in the engine's order, not as gr + dr
    grads = True
    if use_kernel(x) and (x.is_cuda or m <= 8):
        xg, rg, wg = (t.clone().requires_grad_() for t in (x, residual, weight))
        normed_g, res_out_g = allreduce_add_rmsnorm(xg, rg, wg, 1e-6, workspace=workspace)
        gy, gr = _rand((m, hidden), seed - 5, dtype, device), _rand((m, hidden), seed - 6, dtype, device)
        dx, dres, dw = torch.autograd.grad((normed_g, res_out_g), (xg, rg, wg), (gy, gr))
        r, w2 = res_out_g.detach().requires_grad_(), weight.clone().requires_grad_()
        dr, want_dw = torch.autograd.grad(rms_norm(r, w2, 1e-6), (r, w2), gy)
        want = gr + dr
        grads = all(bitwise_report(a, b).equal for a, b in ((dx, want), (dres, want), (dw, want_dw)))
    # the CPU result for the same inputs (what gloo computes): sum and residual_out bitwise. normed is
    # bitwise only on one device (docs/design.md §1: the norm's mean may sum in another order on the CPU)
    cpu = True
    if got.device.type != "cpu":
        want_cpu = ordered_sum([t.cpu() for t in xs])
        cpu = bitwise_report(got.cpu(), want_cpu).equal and bitwise_report(residual_out.cpu(), want_cpu + residual.cpu()).equal
    outputs = (got, residual_out, normed)
    same_as_reference = reference is None or all(bitwise_report(a, b).equal for a, b in zip(outputs, reference, strict=True))
    checks = {
        "sum": rep.equal,
        "all_ranks": same_everywhere,
        "residual_out": ok_res,
        "normed": ok_norm,
        "zero_residual": ok_zero,
        "batch_invariant": invariant,
        "cpu_equal": cpu,
        "inputs_unchanged": untouched,
        "grads": grads,
        "same_as_reference": same_as_reference,
    }
    return {
        "rows": m,
        "hidden": hidden,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": m * hidden * x.element_size(),
        "path": path,
        "max_diff": rep.max_diff,
        "frac_nonzero": rep.frac_nonzero,
        "checks": {name: ok for name, ok in checks.items() if not ok},  # the failed ones
        "passed": all(checks.values()),
        "outputs": outputs,
    }


def table(rank: int, world_size: int, device: str = "cpu", hiddens=(4096, 1001), rows=ROWS, dtypes=tuple(DTYPES)) -> list[dict]:
    """Every (rows, hidden, dtype) case on this rank (a ``run_local`` target): the reference path,
    and on CUDA also the 1-stage and 2-stage kernels, each bitwise equal to the reference."""
    from truefuse.distributed import Workspace

    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    paths = {}
    if dev.type == "cuda":
        biggest = max(rows) * max(hiddens) * 4
        paths = {
            "1-stage": Workspace(max_bytes=biggest, two_stage_bytes=1 << 62),
            "2-stage": Workspace(max_bytes=biggest, two_stage_bytes=0),
        }
    out = []
    for h in hiddens:
        for d in dtypes:
            for m in rows:
                ref = case(m, h, DTYPES[d], dev)
                out.append(ref)
                for name, ws in paths.items():
                    out.append(case(m, h, DTYPES[d], dev, ws, name, reference=ref["outputs"]))
    for r in out:  # tensors stay on the rank
        r.pop("outputs")
    return out


def format_table(results: list[dict], world_size: int) -> str:
    lines = [
        f"world size {world_size}",
        f"{'rows':>6} {'hidden':>6} {'dtype':>8} {'bytes':>10} {'path':>10} {'max_diff':>9} {'frac_nonzero':>12} result",
    ]
    for r in results:
        lines.append(
            f"{r['rows']:>6} {r['hidden']:>6} {r['dtype']:>8} {r['bytes']:>10} {r['path']:>10} {r['max_diff']:>9.2e} "
            f"{r['frac_nonzero']:>12.2%} {'PASS' if r['passed'] else 'FAIL ' + str(r['checks'])}"
        )
    return "\n".join(lines)
