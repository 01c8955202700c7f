"""``python -m truefuse demo --world-size N``: the demo's runs under FSDP2 on N local ranks.

Every rank builds the one initial state (on the CPU under ``cfg.seed``: the same weights on every
rank), and for each run builds the model, loads that state, applies the run's patch (before
sharding: ``apply_truefuse`` replaces modules), then ``fully_shard``s each decoder layer, lm_head
when ``cfg.head_unit``, and the root (torch.distributed.fsdp, FSDP2). Each step's batch has
``world_size x batch`` sequences; rank r trains on rows ``[r*batch, (r+1)*batch)``, so the ranks'
data are disjoint and every rank's loss is over the same number of tokens: the mean of the ranks'
losses is the loss over the whole step's batch (the value the table shows, the same on every rank).
The runs go one after the other in each rank (each run's peak memory its own), with the same
number of steps on every rank (each step has collectives). Rank 0's table is the demo's; step time
is the slowest rank's, peak memory the largest rank's.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from truefuse.demo.train import (
    DemoConfig,
    DemoResult,
    Patch,
    RunResult,
    Trainer,
    environment,
    initial_state,
    llama_config,
    prepare_data,
)


def mixed_precision(cfg: DemoConfig):
    """``fully_shard``'s ``mp_policy`` for ``cfg.fsdp_policy`` ("mp": bf16 compute, fp32 gradient
    reduction over fp32 parameters), or None (parameters used in their own dtype)."""
    if cfg.fsdp_policy != "mp":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard(model: torch.nn.Module, mesh, cfg: DemoConfig) -> torch.nn.Module:
    """FSDP2 units: each decoder layer, then lm_head (``cfg.head_unit``), then the root (which keeps
    the embedding, the final norm and, by default, lm_head)."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh}
    if (policy := mixed_precision(cfg)) is not None:
        kwargs["mp_policy"] = policy
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    if cfg.head_unit:
        fully_shard(model.lm_head, **kwargs)
    fully_shard(model, **kwargs)
    return model


class FsdpTrainer(Trainer):
    """One run on one rank: :class:`Trainer` with the model sharded after the patch, this rank's
    rows of each batch, and the loss averaged over the ranks (after the step's timing)."""

    def __init__(self, name: str, cfg: DemoConfig, model_config, state, patch: Patch | None, mesh):
        self.mesh, self.rank, self.world = mesh, dist.get_rank(), dist.get_world_size()
        self.local_losses: list[float] = []
        super().__init__(name, cfg, model_config, state, patch)
        if cfg.fsdp_policy == "mp":
            self.autocast_dtype = None  # the policy casts to bf16 (as amp-bf16's autocast does on one GPU)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return shard(model, self.mesh, self.cfg)

    def step(self, ids: torch.Tensor) -> float:
        """``ids``: the step's whole ``(world_size * batch, seq)`` batch; this rank trains on its rows."""
        b = self.cfg.batch
        local = super().step(ids[self.rank * b : (self.rank + 1) * b])
        self.local_losses.append(local)
        value = global_mean(local, self.device)
        self.result.losses[-1] = value
        return value


def global_mean(value: float, device: torch.device) -> float:
    """The mean of ``value`` over the ranks, the same bits on every rank (a float64 sum, then / N)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def rank_main(rank: int, world: int, cfg: DemoConfig, model_config_dict: dict, batches: torch.Tensor, runs: dict, opts: dict):
    """One rank (``run_local``'s ``fn``): every run of ``runs`` (name -> patch or None) in order;
    returns one record per run (a dict: :class:`RunResult`'s fields, the local losses, the truefuse
    warnings, and the sync counts and profile files of ``opts``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig

    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)  # nccl: one GPU per rank; the config's "cuda" is this rank's
        device = torch.device("cuda", rank)
    else:  # the ranks share the cores: without this each takes them all (oversubscribed)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh(device.type, (world,))
    model_config = LlamaConfig.from_dict(model_config_dict)
    state = initial_state(cfg, model_config)
    records = []
    for name, patch in runs.items():
        try:
            records.append(_one_run(name, patch, cfg, model_config, state, mesh, batches, opts, rank))
        except Exception:
            # a peer that fails (the same way on every rank: same code, same data) costs its row, not
            # the table; stock is the yardstick and must run
            if name == "stock":
                raise
            records.append({"name": name, "failed": traceback.format_exc(limit=-6)})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def _one_run(name, patch, cfg, model_config, state, mesh, batches, opts, rank) -> dict:
    from truefuse.demo.profile import after_run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = FsdpTrainer(name, cfg, model_config, state, patch, mesh)
        for i in range(cfg.steps):
            trainer.step(batches[i])
            if rank == 0 and not opts.get("quiet"):
                print(f"{name}: step {i + 1}/{cfg.steps}, loss {trainer.result.losses[-1]:.4f}", file=sys.stderr)
    extra = after_run(trainer, batches, opts, rank)
    extra["local_losses"] = trainer.local_losses
    extra["warnings"] = sorted({str(w.message) for w in caught if "truefuse" in str(w.message)})
    result = trainer.close()
    result.extra.update(extra)
    return vars(result)


def merge(per_rank: list[list[dict]]) -> tuple[list[RunResult], dict[str, str]]:
    """Rank 0's runs, with each step's time the slowest rank's, memory the largest rank's, and every
    rank's losses, step times and warnings under ``extra["ranks"]``; and the runs that failed on a
    rank (name -> that rank's traceback), left out of the runs."""
    runs, failed = [], {}
    for recs in zip(*per_rank, strict=True):
        broken = [r for r in recs if "failed" in r]
        if broken:
            failed[recs[0]["name"]] = broken[0]["failed"]
            continue
        first = dict(recs[0])
        first["step_s"] = [max(ts) for ts in zip(*(r["step_s"] for r in recs), strict=True)]
        first["host_s"] = [max(ts) for ts in zip(*(r["host_s"] for r in recs), strict=True)]
        if first["mem_bytes"] is not None:
            first["mem_bytes"] = [max(ms) for ms in zip(*(r["mem_bytes"] for r in recs), strict=True)]
        first["extra"] = dict(first["extra"])
        keys = ("losses", "step_s", "host_s", "mem_bytes")
        first["extra"]["ranks"] = [{k: r[k] for k in keys} | {"local_losses": r["extra"]["local_losses"]} for r in recs]
        first["extra"]["warnings"] = sorted({w for r in recs for w in r["extra"]["warnings"]})
        runs.append(RunResult(**first))
    return runs, failed


def run_fsdp_demo(
    cfg: DemoConfig,
    peers: dict[str, Patch],
    cache_dir: str | None = None,
    quiet: bool = False,
    log: Callable[[str], None] | None = None,
    sync_debug: bool = False,
    profile_dir: str | None = None,
    timeout_s: float = 1800.0,
) -> DemoResult:
    """:func:`~truefuse.demo.train.run_demo` under FSDP2 on ``cfg.world_size`` local ranks (nccl on
    CUDA, one GPU per rank; gloo on the CPU). ``peers`` must pickle (module-level functions or
    partials of them): each rank applies them itself. ``sync_debug``: count host synchronisations
    in one extra step after each run; ``profile_dir``: profile a few extra steps on rank 0
    (demo/profile.py). Extra steps are neither timed nor in the curve."""
    from truefuse.distributed.launch import run_local

    if "stock" in peers:
        raise ValueError('"stock" is the unpatched reference run; give the peers other names')
    if cfg.world_size < 2:
        raise ValueError(f"world_size must be at least 2 for FSDP2 runs, got {cfg.world_size}")
    log = log or (lambda _msg: None)
    cfg = replace(cfg, schedule="sequential")
    device = torch.device(cfg.device)
    if device.type == "cuda" and torch.cuda.device_count() < cfg.world_size:
        raise ValueError(f"world_size {cfg.world_size} needs {cfg.world_size} GPUs, found {torch.cuda.device_count()}")
    data, batches, facts = prepare_data(cfg, cache_dir, log)
    model_config = llama_config(cfg, data.vocab_size)
    opts = {"sync_debug": sync_debug, "profile_dir": profile_dir, "quiet": quiet}
    runs = {"stock": None, **peers}
    backend = "nccl" if device.type == "cuda" else "gloo"
    per_rank = run_local(
        cfg.world_size, rank_main, cfg, model_config.to_dict(), batches, runs, opts, backend=backend, timeout_s=timeout_s
    )
    env = environment(torch.device("cuda", 0) if device.type == "cuda" else device)
    env["device"] = f"{cfg.world_size} x {env['device']}, FSDP2 ({backend})"
    result = DemoResult(cfg, facts, env, model_config.to_dict())
    runs, failed = merge(per_rank)
    result.runs.extend(runs)
    for name, tb in failed.items():
        log(f"{name}: FAILED, left out of the table:\n{tb}")
    for run in result.runs:
        if run.patch_report is not None:
            log(f"{run.name}: {run.patch_report}")
    return result
