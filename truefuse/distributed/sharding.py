"""Cutting full weights into tensor-parallel shards and back (Megatron's layout;
docs/tensor_parallel.md): a column-parallel layer's rows, a row-parallel layer's columns, and the
gated layout ``[gate_r; up_r]`` of a gated MLP's fc1."""

from __future__ import annotations

import torch


def _check_split(t, size: int, rank: int, world_size: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if size % world_size:
        raise ValueError(f"{what} has {size} there, not divisible by world_size={world_size}")


def shard_rows(t: torch.Tensor, rank: int, world_size: int, *, gated: bool = False) -> torch.Tensor:
    """Rank ``rank``'s block of ``t``'s first dimension (a column-parallel weight (N, K) or bias (N,)).

    ``gated=True``: ``t`` is ``[gate; up]`` (2F, ...) and the block is ``[gate_r; up_r]``, each
    F / world_size rows of the same features (the gated layout of :class:`TensorParallelMLP`).
    Returns a contiguous copy.
    """
    if gated:
        n = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else None
        if n is not None and isinstance(world_size, int) and world_size > 0 and n % (2 * world_size):
            raise ValueError(
                f"gated: t's first dimension is [gate; up], 2F = {n}, but F is not divisible by world_size={world_size}"
            )
        _check_split(t, n or 0, rank, world_size, "t's first dimension")
        gate, up = t.chunk(2, 0)
        return torch.cat([shard_rows(gate, rank, world_size), shard_rows(up, rank, world_size)], 0)
    _check_split(t, t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else 1, rank, world_size, "t's first dimension")
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n].contiguous()


def shard_columns(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s block of ``t``'s last dimension (a row-parallel weight (N, K) -> (N, K / world)),
    a contiguous copy."""
    _check_split(t, t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() else 1, rank, world_size, "t's last dimension")
    n = t.shape[-1] // world_size
    return t[..., rank * n : (rank + 1) * n].contiguous()


def unshard_rows(shards: list[torch.Tensor], *, gated: bool = False) -> torch.Tensor:
    """The inverse of :func:`shard_rows`: the full tensor from every rank's block, in rank order."""
    if gated:
        halves = [s.chunk(2, 0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(list(shards), 0)


def unshard_columns(shards: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`shard_columns`."""
    return torch.cat(list(shards), -1)
