"""Bad input as the same clear error on every rank, before any collective can hang
(docs/design.md §4): each rank checks locally, then one small all-gather compares the verdicts, the
process group each rank passed, and what must match across ranks. The allreduce, the parallel
layers and the vocab-parallel loss all agree through here."""

from __future__ import annotations

import torch
import torch.distributed as dist

from truefuse.distributed.workspace import Workspace
from truefuse.ops._launch.capture import capturing

_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}


def validating(x, workspace: Workspace | None) -> bool:
    """Agree across ranks (one small all-gather) unless a CUDA graph is being captured or the
    workspace says ``validate=False``: then each rank checks locally only (docs/design.md §4)."""
    if isinstance(x, torch.Tensor) and capturing(x):
        return False
    return workspace is None or workspace.validate


def problem_of(*checks) -> tuple[str, str] | None:
    """(error class name, message) of the first check that raises, or None."""
    for check in checks:
        try:
            check()
        except (TypeError, ValueError, RuntimeError) as e:
            return type(e).__name__ if type(e).__name__ in _ERRORS else "ValueError", str(e)
    return None


def agree(group, owner: str, problem: tuple[str, str] | None, desc: tuple, validate: bool) -> None:
    """Raise the same error on every rank when any rank's input is bad, the ranks passed different
    process groups, or their ``desc`` (what must match: shapes, dtypes, whether a gradient is
    wanted) differ; with ``validate=False`` only this rank's ``problem`` is raised. The error's
    class is the lowest bad rank's."""
    if not validate:
        if problem is not None:
            raise _ERRORS[problem[0]](f"{owner}: {problem[1]}")
        return
    everyone = gather_verdicts(group, owner, problem, desc)
    raise_problems(owner, [p for p, _, _ in everyone])
    raise_disagreement(owner, [d for _, d, _ in everyone])


def agreement_group(group):
    """The process group the agreement's all-gather runs on: the first-made group this process holds
    over the same global ranks in the same order as ``group`` (the default group when it is that).

    Every rank of a group makes the groups over its ranks in the same order (``new_group`` is
    collective), so ranks that passed different group objects over the same ranks (the default
    group on one, an equal subgroup on another; two ``new_group`` calls) still meet in this
    all-gather and are told their groups differ, where a collective on their own groups hangs on
    every rank (docs/design.md §4). ``group`` itself when torch's group table is not there."""
    ranks = dist.get_process_group_ranks(group)
    table = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_group_ranks", None)
    if not isinstance(table, dict):
        return group
    want = {g: i for i, g in enumerate(ranks)}  # global rank -> group rank, as the table holds them
    for pg, members in table.items():  # creation order; a group this rank is not in is keyed by an int
        if isinstance(pg, dist.ProcessGroup) and members == want:
            return pg
    return group


def group_identity(group) -> str:
    """What the ranks compare of the group they passed: its name and its global ranks."""
    default = " (the default group)" if group == dist.group.WORLD else ""
    return f"process group {group.group_name!r}{default} over global ranks {dist.get_process_group_ranks(group)}"


def gather_verdicts(group, owner: str, problem: tuple[str, str] | None, desc: tuple, extra=None) -> list[tuple]:
    """Every rank's ``(problem, desc, extra)`` in rank order (one small host all-gather, over
    :func:`agreement_group`), after raising on every rank when the ranks passed different process
    groups: a caller that needs other ranks' data to check its input (``extra``, e.g. the shard
    sizes) decides from this list, the same on every rank, so it raises the same error everywhere
    without a second gather.

    Ranks whose groups differ in members do not meet here: a rank waits for a peer whose own group
    leaves it out, until the group's timeout, and that peer goes on (docs/design.md §4)."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (group_identity(group), problem, desc, extra), group=agreement_group(group))
    raise_disagreement(owner, [(("group", g),) for g, _, _, _ in everyone], " (every rank must pass the same process group)")
    return [e[1:] for e in everyone]


def raise_problems(owner: str, problems: list) -> None:
    """One error listing every rank's ``(class name, message)`` problem (None: fine), of the lowest
    bad rank's class; nothing when there is none."""
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    if bad:
        listing = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in bad)
        raise _ERRORS[bad[0][1][0]](f"{owner}: bad input on {listing}")


def raise_disagreement(owner: str, descs: list, hint: str = "") -> None:
    """ValueError naming what differs when the ranks' ``desc`` tuples (of (name, value) pairs) do."""
    if len(set(descs)) > 1:
        first = dict(descs[0])
        diff = [k for k in first if any(dict(d).get(k) != first[k] for d in descs)]
        listing = "; ".join(f"rank {r}: " + ", ".join(f"{k}={dict(d).get(k)}" for k in diff) for r, d in enumerate(descs))
        raise ValueError(f"{owner}: ranks disagree on {', '.join(diff)} ({listing}){hint}")
