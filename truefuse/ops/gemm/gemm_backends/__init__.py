"""The registry of GEMM backends, in default preference order.

Each backend is one module here defining ``BACKEND`` (a :class:`~._base.GemmBackend`): its
capability rows, its availability check and its product. The planner (``gemm_plan``), the executor
(``gemm_exec``) and ``truefuse info`` read this list. ``truefuse.config`` (below ops) holds the
names ``TRUEFUSE_GEMM_BACKENDS`` may give, in the default order; this module checks at import that
the two agree. To add a backend, write its module, list it in :data:`BACKENDS` and its name in
``truefuse.config.KNOWN_GEMM_BACKENDS``.

``torch`` comes first by default because on the H200 cuBLAS measured faster than the Triton GEMM
even where the Triton one fuses the bias-gradient (docs/benchmarks.md).

This module must not ``import torch``: the submodule ``torch`` below takes that name here.
"""

from __future__ import annotations

from truefuse.config import KNOWN_GEMM_BACKENDS
from truefuse.ops.gemm.gemm_backends import torch as _torch_backend
from truefuse.ops.gemm.gemm_backends import triton as _triton_backend
from truefuse.ops.gemm.gemm_backends._base import GemmBackend

#: name -> backend, in default preference order.
BACKENDS: dict[str, GemmBackend] = {b.name: b for b in (_torch_backend.BACKEND, _triton_backend.BACKEND)}
if tuple(BACKENDS) != KNOWN_GEMM_BACKENDS:
    raise ImportError(f"GEMM backends registered {tuple(BACKENDS)} but truefuse.config lists {KNOWN_GEMM_BACKENDS}")


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, in default preference order."""
    return tuple(BACKENDS)


def get_backend(name: str) -> GemmBackend:
    return BACKENDS[name]
