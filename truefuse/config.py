"""The one reader of environment variables, and the frozen tuning knobs that come from them.

Everything else in truefuse asks :func:`get_config` instead of reading ``os.environ`` itself, so
that a run's behaviour can be explained from one object (``python -m truefuse info`` prints it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Config:
    """Process-wide settings.

    Attributes:
        triton_interpret: ``TRITON_INTERPRET=1``: Triton kernels run in Triton's CPU interpreter.
            Then the Triton backend is offered on the CPU too (for fp32 kernel-logic tests; the
            interpreter's bf16 casts truncate, so bf16 numerics are only checked on a GPU).
        gemm_backends: ``TRUEFUSE_GEMM_BACKENDS``, a comma-separated preference order of GEMM
            backends (default ``torch,triton``). A backend left out is never planned.
    """

    triton_interpret: bool
    gemm_backends: tuple[str, ...]

    @classmethod
    def from_env(cls) -> Config:
        order = os.environ.get("TRUEFUSE_GEMM_BACKENDS", "torch,triton")
        return cls(
            triton_interpret=_flag("TRITON_INTERPRET"),
            gemm_backends=tuple(s.strip() for s in order.split(",") if s.strip()),
        )


@functools.cache
def get_config() -> Config:
    """The configuration read once from the environment of this process."""
    return Config.from_env()
