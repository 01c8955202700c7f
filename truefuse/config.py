"""The one reader of environment variables, and the frozen tuning knobs that come from them.

Everything else in truefuse asks :func:`get_config` instead of reading ``os.environ`` itself, so
that a run's behaviour can be explained from one object (``python -m truefuse info`` prints it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

#: The GEMM backends ``TRUEFUSE_GEMM_BACKENDS`` may name, in default preference order. Each is one
#: file of ``truefuse/ops/gemm_backends/``, whose registry checks at import that it lists exactly
#: these (config sits below ops: it names them, it does not import them).
KNOWN_GEMM_BACKENDS: tuple[str, ...] = ("torch", "triton")


def known_gemm_backends() -> tuple[str, ...]:
    """:data:`KNOWN_GEMM_BACKENDS`."""
    return KNOWN_GEMM_BACKENDS


class ConfigError(ValueError):
    """An environment variable truefuse reads has a value it cannot use (the message names both)."""


def _gemm_backends(raw: str | None) -> tuple[str, ...]:
    """``TRUEFUSE_GEMM_BACKENDS`` parsed (None: unset, the registry's order), or :class:`ConfigError`:
    empty, unknown or repeated names."""
    known = known_gemm_backends()
    if raw is None:
        return known
    names = tuple(s.strip() for s in raw.split(",") if s.strip())
    hint = (
        f"known backends: {', '.join(known)}; give a comma-separated preference order "
        f"such as TRUEFUSE_GEMM_BACKENDS={','.join(known)}, or unset it for that default"
    )
    if not names:
        raise ConfigError(f"TRUEFUSE_GEMM_BACKENDS={raw!r} names no GEMM backend; {hint}")
    unknown = [n for n in names if n not in known]
    if unknown:
        what = "backend" if len(unknown) == 1 else "backends"
        raise ConfigError(f"TRUEFUSE_GEMM_BACKENDS={raw!r}: unknown GEMM {what} {', '.join(map(repr, unknown))}; {hint}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"TRUEFUSE_GEMM_BACKENDS={raw!r} names {', '.join(map(repr, repeated))} more than once; {hint}")
    return names


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
            backends (default: every registered backend in the registry's order, today
            ``torch,triton``). A backend left out is never planned. An empty list, a name not in
            :func:`known_gemm_backends` or a repeated name raises :class:`ConfigError` (a
            ``ValueError``) from :func:`get_config`.
    """

    triton_interpret: bool
    gemm_backends: tuple[str, ...]

    @classmethod
    def from_env(cls) -> Config:
        return cls(
            triton_interpret=_flag("TRITON_INTERPRET"),
            gemm_backends=_gemm_backends(os.environ.get("TRUEFUSE_GEMM_BACKENDS")),
        )


@functools.cache
def get_config() -> Config:
    """The configuration read once from the environment of this process.

    Raises:
        ConfigError: (a ``ValueError``) for a value it cannot use, e.g. ``TRUEFUSE_GEMM_BACKENDS=cublas``;
            nothing is cached then, so every later call raises the same error.
    """
    return Config.from_env()
