"""Triton kernels compiled for a Hopper GPU (sm_90) on the CPU, for tests that read what the GPU
compiler makes of them (tests/test_kernel_compile.py, tests/test_kernel_ptx.py).

In a process of its own: the CPU suite runs Triton's interpreter (``TRITON_INTERPRET=1``), under
which the kernels are interpreted functions that compile to nothing. A spec is
``{"module", "name", "sig", "const", "options"}``: the ``JITFunction`` at ``module.name``, its
signature (parameter name -> Triton type, ``"constexpr"`` for a compile-time one), the constexprs'
values, and compile options (``num_warps``...)."""

import json
import os
import subprocess
import sys

import pytest

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for spec in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    names = list(spec["sig"])
    const = {(names.index(k),): v for k, v in spec["const"].items()}
    try:
        src = ASTSource(kernel, spec["sig"], const)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec.get("options", {}))
        out.append({"ptx": compiled.asm["ptx"]})
    except Exception as e:
        out.append({"error": f"{spec['name']} {spec['const']}: {type(e).__name__}: {str(e)[-600:]}"})
print(json.dumps(out))
"""


def compile_sm90(specs: list[dict]) -> list[dict]:
    """``{"ptx": ...}`` or ``{"error": ...}`` per spec; skips the test where Triton cannot compile for
    sm_90 on this machine (no NVIDIA backend)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default today, said (3.9 warns while it is unset)
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        input=json.dumps(specs, default=str),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if run.returncode:
        if "GPUTarget" in run.stderr or "backends" in run.stderr:
            pytest.skip(f"Triton cannot compile for sm_90 here: {run.stderr.strip().splitlines()[-1:]}")
        raise AssertionError(run.stderr[-2000:])
    return json.loads(run.stdout.strip().splitlines()[-1])
