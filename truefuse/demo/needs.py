"""What a demo command (``demo``, ``rl``) checks before it builds anything: its optional
dependencies, and the device asked for. Each returns the one-line reason it cannot run, or None."""

from __future__ import annotations

import importlib
import importlib.util

import torch


def missing(modules: tuple[str, ...], hint: str) -> str | None:
    """The first of ``modules`` that does not import (``hint``: how to install them), then matplotlib
    (every command draws its plot)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            return f"needs {' and '.join(modules)} ({e.name or e} is missing): {hint}"
    if importlib.util.find_spec("matplotlib") is None:
        return "needs matplotlib for its plot: pip install truefuse[bench]"
    return None


def device(asked: str | None) -> tuple[str, str | None]:
    """``(device, reason)``: the device asked for (default: cuda if present), and why it cannot be had."""
    name = asked or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        return name, "--device cuda asked for, but torch sees no CUDA device"
    return name, None
