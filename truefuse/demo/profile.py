"""Where a demo step goes (issue 35, item 1): host synchronisations per step and a torch.profiler record.

Both run on extra steps after a run's measured ones (the curve and the step times stay clean), on
every rank alike (an FSDP2 step has collectives, so every rank must take the same steps):

* ``--sync-debug``: one step under ``torch.cuda.set_sync_debug_mode("warn")``; every warning it
  raises is a host synchronisation (a ``.item()``, a D2H copy, a host-sized op). Each is counted
  under its call site: the innermost Python frame (where the op was called) and the innermost frame
  in truefuse or transformers on the way there (which of their lines caused it). CUDA only.
* ``--profile DIR``: a few steps under ``torch.profiler`` on rank 0; ``DIR/<run>_top.txt`` holds
  ``key_averages`` sorted by self device time and by self CPU time (40 rows each), and
  ``DIR/<run>_trace.json.gz`` the chrome trace, unless it is larger than :data:`TRACE_MAX_BYTES`.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

#: a torch warning raised by set_sync_debug_mode("warn") (c10/cuda/CUDAFunctions.h's message)
SYNC_MESSAGE = "called a synchronizing CUDA operation"
#: steps recorded by --profile (after one unrecorded warm-up step)
PROFILE_STEPS = 2
#: the largest gzipped chrome trace kept (the device call's files come back up to 16 MiB each)
TRACE_MAX_BYTES = 16 << 20
#: frames never named as a call site: the warning machinery and this file
_SKIP = (os.sep + "warnings.py", os.path.join("truefuse", "demo", "profile.py"))
_OWNERS = re.compile(r"[\\/](truefuse|transformers)[\\/]")


def _site(frame: traceback.FrameSummary) -> str:
    """``file:line (function)``, the file from its package (``transformers/...``, ``truefuse/...``)."""
    path = frame.filename.replace(os.sep, "/")
    if "/site-packages/" in path:
        path = path.rsplit("/site-packages/", 1)[1]
    elif "/truefuse/" in path:
        path = "truefuse/" + path.rsplit("/truefuse/", 1)[1]
    return f"{path}:{frame.lineno} ({frame.name})"


def call_site(stack: list[traceback.FrameSummary]) -> str:
    """``"file:line (function)"`` of the innermost frame of ``stack`` (outermost first) outside the
    warning machinery, followed by ``" <- file:line (function)"`` of the innermost truefuse or
    transformers frame above it when that is another frame."""
    frames = [f for f in stack if not f.filename.endswith(_SKIP)]
    if not frames:
        return "?"
    site = _site(frames[-1])
    owner = next((f for f in reversed(frames) if _OWNERS.search(f.filename)), None)
    if owner is not None and owner is not frames[-1]:
        site += f" <- {_site(owner)}"
    return site


@contextlib.contextmanager
def count_syncs(enabled: bool = True):
    """Count the host synchronisations in the block: yields a ``Counter`` of call sites (filled when
    the block ends), or None when not ``enabled`` or no CUDA device is used."""
    if not enabled or not torch.cuda.is_available():
        yield None
        return
    with sync_warnings() as sites:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def sync_warnings():
    """Yields a ``Counter`` of the call sites of the sync warnings raised in the block, every one
    counted (also those Python's filters would show once); other warnings pass through."""
    sites: Counter[str] = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                sites[call_site(traceback.extract_stack())] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield sites


def top_syncs(sites: dict[str, int] | None, n: int = 10) -> list[tuple[str, int]]:
    """The ``n`` most frequent call sites (most first; ties by name)."""
    return sorted((sites or {}).items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def _step_untimed(trainer, ids: torch.Tensor) -> None:
    """One more training step on ``ids`` that leaves the run's record as it was."""
    res = trainer.result
    lengths = [len(x) for x in (res.losses, res.step_s, res.host_s, res.mem_bytes or [])]
    local = list(getattr(trainer, "local_losses", []))
    trainer.step(ids)
    for x, n in zip((res.losses, res.step_s, res.host_s, res.mem_bytes or []), lengths, strict=True):
        del x[n:]
    if hasattr(trainer, "local_losses"):
        trainer.local_losses[:] = local


def write_profile(prof, out_dir: Path, name: str, cuda: bool, wall_s: float) -> dict:
    """``<name>_top.txt`` (and the gzipped trace when small enough) under ``out_dir``: their paths,
    and on CUDA the kernels' time per step against the profiled steps' wall time per step."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    avgs = prof.key_averages()
    files: dict = {"wall_ms_per_step": 1e3 * wall_s / PROFILE_STEPS}
    parts = []
    if cuda:
        # NCCL kernels count while they wait for the peer, and the profiler slows the host: a bound
        us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in avgs)
        files["kernel_ms_per_step"] = us / 1e3 / PROFILE_STEPS
        parts.append(
            f"# {name}: kernels {files['kernel_ms_per_step']:.1f} ms of {files['wall_ms_per_step']:.1f} ms wall a step "
            "(under the profiler; NCCL kernels count while they wait)\n"
        )
    sorts = (("self_device_time_total", "self device (CUDA) time"),) if cuda else ()
    for key, words in sorts + (("self_cpu_time_total", "self CPU time"),):
        try:
            table = avgs.table(sort_by=key, row_limit=40)
        except (KeyError, AttributeError):  # torch before the "device" names: the CUDA ones
            table = avgs.table(sort_by=key.replace("device", "cuda"), row_limit=40)
        parts.append(f"# {name}: {PROFILE_STEPS} steps, by {words}\n{table}\n")
    top = out_dir / f"{stem}_top.txt"
    top.write_text("\n".join(parts))
    files["top"] = str(top)
    raw = out_dir / f"{stem}_trace.json"
    prof.export_chrome_trace(str(raw))
    gz = raw.with_suffix(".json.gz")
    with open(raw, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    if gz.stat().st_size > TRACE_MAX_BYTES:
        files["trace_skipped"] = f"{gz.stat().st_size >> 20} MiB gzipped, over {TRACE_MAX_BYTES >> 20} MiB"
        gz.unlink()
    else:
        files["trace"] = str(gz)
    return files


def after_run(trainer, batches: torch.Tensor, opts: dict, rank: int) -> dict:
    """The extra steps of ``opts`` (``sync_debug``, ``profile_dir``) on ``trainer`` after its run,
    on the run's last batches; returns ``{"syncs": {site: count} or None, "profile": {...}}``
    (the profile on rank 0 only; every rank takes the same steps)."""
    extra: dict = {}
    if opts.get("sync_debug"):
        extra["syncs"] = _count_update_syncs(trainer, batches[-1])
    if opts.get("profile_dir"):
        from torch.profiler import ProfilerActivity, profile

        _step_untimed(trainer, batches[-1])  # warm: nothing of the profiler's own start in the record
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.cuda else [])
        with profile(activities=activities) if rank == 0 else contextlib.nullcontext() as prof:
            t0 = time.perf_counter()
            for i in range(PROFILE_STEPS):
                _step_untimed(trainer, batches[-1 - i % len(batches)])
            wall_s = time.perf_counter() - t0
        if rank == 0:
            extra["profile"] = write_profile(prof, Path(opts["profile_dir"]), trainer.name, trainer.cuda, wall_s)
    return extra


def _count_update_syncs(trainer, ids: torch.Tensor) -> dict[str, int] | None:
    """The syncs of one step's training work (``trainer.update``: forward, backward, clip, AdamW),
    not the demo's own around it (its timing syncs, reading the loss, the ranks' mean loss)."""
    found = {}
    update = trainer.update

    def counted(step_ids):
        with count_syncs(trainer.cuda) as sites:
            loss = update(step_ids)
        found["sites"] = sites
        return loss

    trainer.update = counted
    try:
        _step_untimed(trainer, ids)
    finally:
        del trainer.update  # the class's method again
    return None if found["sites"] is None else dict(found["sites"])
