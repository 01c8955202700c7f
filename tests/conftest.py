"""Test session set-up: without a GPU, Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, hence here. The interpreter is
right for fp32 and wrong for bf16 (docs/design.md §8): the Triton backend offers only fp32 on the CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CPU suite (a GPU machine keeps its threads for the float64 references): one thread a
# process. pytest -n auto runs a worker per core, and the gloo tests several ranks on the 2 CI
# cores; with torch's default of a thread per core as well, MKL/OpenMP threads waiting for each
# other took ~20 ms a tiny GEMM instead of microseconds (tests/test_batch_invariant.py's fixture;
# a tiny Qwen3-MoE's 20 training steps 15 s -> 0.3 s of CPU time). OMP_NUM_THREADS for the
# processes the tests spawn (ranks, the CLI), which read it at start. Every comparison of bits is
# within one process or between processes that have the same setting.
if not torch.cuda.is_available():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

from _interpreter_speedup import install as _install_interpreter_speedup  # noqa: E402

# the interpreter without its repeated language patching (tests/_interpreter_speedup.py)
_install_interpreter_speedup()

import pytest  # noqa: E402

from truefuse.config import get_config  # noqa: E402

# read (and cached) now, for this process: a test that changes TRITON_INTERPRET for the processes it
# spawns (tests/distributed/test_demo_fsdp.py) must not decide this worker's path for later tests
get_config()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _no_autocast_left_on():
    """A test that leaves autocast on fails here, not the unrelated tests its worker runs next
    under it (a patched ``torch.is_autocast_enabled`` once turned it on for good: every later
    test of that process ran in bf16)."""
    yield
    left = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    for d in left:
        torch.set_autocast_enabled(d, False)
    assert not left, f"the test left torch.autocast on for {left}"


@pytest.fixture
def fake_cuda(monkeypatch):
    """``graph_decode`` on the CPU: every tensor counts as on CUDA, and graphs are a stand-in that
    keeps what the wrapper relies on of a capture (tests/hf/_fake_graph.py)."""
    from tests.hf._fake_graph import install

    install(monkeypatch)
