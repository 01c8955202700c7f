"""``ops/_launch.py``: a Triton kernel launched through its compiled handle after the first call of a
key. The key's logic on the CPU with a stand-in kernel (the handle's launcher needs a GPU); on CUDA
the real kernels, whose every launch in the suite goes through it."""

from __future__ import annotations

import inspect

import pytest
import torch

from truefuse.ops import _launch


class _Param:
    def __init__(self, name, constexpr, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *a):
        self.runs.append(a)


class _Jit:
    """A ``triton.jit`` function's stand-in: ``x_ptr, n, eps, BLOCK (constexpr), M=0, FLAG=False (constexpr)``."""

    params = [_Param("x_ptr", False), _Param("n", False), _Param("eps", False), _Param("BLOCK", True),
              _Param("M", False, 0), _Param("FLAG", True, False)]  # fmt: skip

    def __init__(self):
        self.slow, self.compiled = [], _Compiled()

    def __getitem__(self, grid):
        return lambda *a, **kw: self.slow.append((grid, a, kw)) or self.compiled


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(_launch, "_on_device", lambda t: isinstance(t, torch.Tensor))
    monkeypatch.setattr(_launch, "_triton_only", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 77, raising=False)


def test_second_call_of_a_key_uses_the_handle(fake_device):
    fn, x = _Jit(), torch.zeros(8)
    assert _launch.launch(fn, (3,), x, 8, 1e-6, BLOCK=16, num_warps=4) is fn.compiled
    assert len(fn.slow) == 1 and fn.compiled.runs == []
    _launch.launch(fn, (3,), x, 8, 1e-6, BLOCK=16, num_warps=4)
    assert len(fn.slow) == 1
    # every parameter in signature order, defaults filled, after the grid, stream, handle and hooks
    assert fn.compiled.runs == [(3, 1, 1, 77, "function", "metadata", None, None, None, x, 8, 1e-6, 16, 0, False)]


@pytest.mark.parametrize(
    "change",
    ["alignment", "dtype", "int", "float for int", "constexpr", "option", "callable grid"],
)
def test_anything_triton_specialises_on_is_a_new_key(fake_device, change):
    fn, x = _Jit(), torch.zeros(8)
    args, kw, grid = [x, 8, 1e-6], {"BLOCK": 16, "num_warps": 4}, (3,)
    _launch.launch(fn, grid, *args, **kw)
    if change == "alignment":
        args[0] = x[1:]  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args[0] = x.double()
    elif change == "int":
        args[1] = 16
    elif change == "float for int":
        args[1] = 8.0
    elif change == "constexpr":
        kw["BLOCK"] = 32
    elif change == "option":
        kw["num_warps"] = 8
    else:
        grid = lambda meta: (3,)  # noqa: E731
    _launch.launch(fn, grid, *args, **kw)
    assert len(fn.slow) == 2 and fn.compiled.runs == []


def test_a_tensor_given_by_name_is_the_calls_own(fake_device):
    fn, x, y = _Jit(), torch.zeros(8), torch.ones(8)
    _launch.launch(fn, (1,), x, 8, 1e-6, BLOCK=16, M=x)
    _launch.launch(fn, (1,), x, 8, 1e-6, BLOCK=16, M=y)  # same key (dtype, alignment), another tensor
    assert fn.compiled.runs[0][-2] is y


def test_off_device_and_under_the_interpreter_triton_runs_it(monkeypatch):
    fn = _Jit()
    monkeypatch.setattr(_launch, "_triton_only", lambda: False)
    for _ in range(2):
        _launch.launch(fn, (1,), torch.zeros(8), 8, 1e-6, BLOCK=16)  # a CPU tensor
    monkeypatch.setattr(_launch, "_on_device", lambda t: True)
    monkeypatch.setattr(_launch, "_triton_only", lambda: True)
    for _ in range(2):
        _launch.launch(fn, (1,), torch.zeros(8), 8, 1e-6, BLOCK=16)
    assert len(fn.slow) == 4 and fn.compiled.runs == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_handle_launch_same_bits_as_triton_gpu():
    """A real kernel (the norm forward) through the handle: the bits of Triton's own launch."""
    from truefuse.kernels.norm import _norm_fwd_kernel
    from truefuse.ops.norm import norm_fwd

    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(1000, device="cuda", dtype=torch.bfloat16)
    before = len(_launch._KERNELS.get(id(_norm_fwd_kernel), _launch._Kernel(_norm_fwd_kernel)).compiled)
    first = norm_fwd(x, w, None, 1e-6, rms=True, zero_centered_gamma=False)
    again = norm_fwd(x, w, None, 1e-6, rms=True, zero_centered_gamma=False)
    assert len(_launch._KERNELS[id(_norm_fwd_kernel)].compiled) >= max(before, 1)
    for a, b in zip(first, again, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
