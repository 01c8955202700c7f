"""Run a function on N local processes joined in a process group (tests, ``verify --world-size``)."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, init_file, backend, fn, args, queue, received):
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (reported to the parent with its traceback)
        queue.put((rank, False, traceback.format_exc()))
    # tensors in the result travel as shared-memory handles that this process serves: stay alive
    # until the parent has received every result (exiting first reset the connection under load)
    received.wait(timeout=120)


def run_local(
    world_size: int, fn: Callable, *args, backend: str = "gloo", timeout_s: float = 300.0, start_method: str = "spawn"
) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; returns their results by rank.

    ``fn`` must be importable (a module-level function) and its result picklable. A failure on any
    rank raises ``RuntimeError`` with that rank's traceback. ``start_method``: multiprocessing's
    (the CPU tests fork their ranks from a server that has imported torch once: "forkserver").
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    received = ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, backend, fn, args, queue, received))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        try:
            for _ in procs:
                rank, ok, value = queue.get(timeout=timeout_s)
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = value
        finally:
            received.set()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
    return [results[r] for r in range(world_size)]
