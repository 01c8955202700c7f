"""Where the elementwise and row Triton kernels (norms, gated activations) run."""

from __future__ import annotations

import functools

import torch

from truefuse.config import get_config


def triton_runs(x: torch.Tensor) -> bool:
    """Whether a Triton kernel takes ``x``: on CUDA for fp16/bf16/fp32, or on the CPU under
    ``TRITON_INTERPRET=1`` for fp32 only (the interpreter truncates bf16 casts, docs/design.md §8)."""
    if x.is_cuda:
        return x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return x.device.type == "cpu" and get_config().triton_interpret and x.dtype == torch.float32


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (persistent kernels size their grids from it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """A CUDA device's compute capability (cached: the launchers ask at every call)."""
    return torch.cuda.get_device_capability(device_index)


def hopper(x: torch.Tensor) -> bool:
    """Whether ``x``'s device has Hopper's launch and copy features (TMA tensor descriptors,
    programmatic dependent launch): CUDA, not ROCm, compute capability 9+."""
    if not x.is_cuda or torch.version.hip is not None:
        return False
    return capability(x.device.index if x.device.index is not None else torch.cuda.current_device())[0] >= 9
