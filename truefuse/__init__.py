"""truefuse: fused kernels and modules for training and serving LLMs, numerically faithful.

Public API (see README.md and DESIGN §3):

* :func:`gemm` / :func:`gemm_ref`: the one GEMM entry point and its reference.
* :func:`gemm_plan_for`, :func:`override_capabilities`, :class:`Capability`: read and steer plans.
"""

from truefuse.ops.gemm import GemmOutput, gemm, gemm_plan_for, gemm_ref
from truefuse.ops.gemm_plan import Capability, GemmPlan, override_capabilities

__version__ = "0.1.0"

__all__ = [
    "Capability",
    "GemmOutput",
    "GemmPlan",
    "__version__",
    "gemm",
    "gemm_plan_for",
    "gemm_ref",
    "override_capabilities",
]
