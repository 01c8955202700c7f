"""``ops/_launch/fast_launch.py``: eager launches through the compiled kernel's launcher (issue 47
item 3; docs/design.md §6.7).

On the CPU, a real ``JITFunction`` (Triton's own class, so the per-process check reads this
Triton's ``JITFunction.run``) whose ``run`` is replaced by a recorder standing in for Triton's path:
each call of it is an ordinary launch and returns a stand-in compiled kernel whose launcher records
the fast launches. On CUDA, the ops' outputs and gradients with the fast path against without it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import requires_cuda

import truefuse.ops._launch.fast_launch as fl
from truefuse.config import eager_fast_launch, get_config
from truefuse.ops._launch.prepared import NOT_NOW, launchable, prepare
from truefuse.ops._launch.triton import kernel_for, traced

triton = pytest.importorskip("triton")


def _body(x_ptr, y_ptr, n, stride, eps, BLOCK: triton.language.constexpr, FLAG: triton.language.constexpr = False):
    pass


class _Compiled:
    """A stand-in ``CompiledKernel``: its launcher records each fast launch's arguments."""

    def __init__(self, function: int, handle: bool = True):
        self.launches: list[tuple] = []
        self.run = lambda *a: self.launches.append(a)
        self.packed_metadata = (4, 1, 0)
        if handle:  # else no launcher handle, as a Triton that names it otherwise
            self.function = function


class _Recorder:
    """``JITFunction.run`` standing in for Triton's path: records each call, returns a new
    :class:`_Compiled`."""

    def __init__(self, handle: bool = True):
        self.calls: list[tuple] = []
        self.compiled: list[_Compiled] = []
        self.handle = handle

    def __call__(self, *args, grid, warmup, **kwargs):
        self.calls.append((args, kwargs, grid))
        self.compiled.append(_Compiled(100 + len(self.calls), self.handle))
        return self.compiled[-1]


@pytest.fixture
def jit(monkeypatch):
    """A real ``JITFunction`` with a recording ``run``; the fast path's state fresh, the current
    device 0 and its stream 7 (no CUDA needed)."""
    from triton.runtime.jit import JITFunction

    fl.clear()
    kernel = JITFunction(_body)
    kernel.run = _Recorder()
    assert fl._setup(), "this Triton's JITFunction.run no longer launches as fast_launch does (see its log line)"
    monkeypatch.setattr(fl, "_device", lambda: 0)
    monkeypatch.setattr(fl, "_stream", lambda device: 7)
    yield kernel
    fl.clear()


def _args(n=32, dtype=torch.float32, offset=0):
    x = torch.zeros(64, dtype=dtype)[offset:]
    return (x, torch.zeros(64, dtype=dtype), n, 16, 1e-6)


def _launch(kernel, *args, grid=(3,), BLOCK=16, **kw):
    return fl.fast_launch(kernel, grid, *args, BLOCK=BLOCK, **kw)


def test_a_miss_launches_through_triton_once_then_the_same_key_hits(jit):
    args = _args()
    first = _launch(jit, *args)
    assert len(jit.run.calls) == 1 and first is jit.run.compiled[0] and not first.launches
    second = _launch(jit, *args)
    assert len(jit.run.calls) == 1, "the same key went through JITFunction.run again"
    assert second is first
    # the launcher's arguments: the grid made 3-D, the stream, the handles, no launch metadata and no
    # hooks, then every parameter in order with the defaults filled (FLAG)
    assert first.launches == [(3, 1, 1, 7, 101, (4, 1, 0), None, None, None, *args, 16, False)]


def test_the_same_specialisation_hits(jit):
    _launch(jit, *_args(n=32))
    _launch(jit, *_args(n=48))  # another multiple of 16, new tensors of the same dtype and alignment
    x, y, n, stride, _ = _args(n=48)
    _launch(jit, x, y, n, stride, 2.5)  # a float argument's value is not specialised on (fp32)
    assert len(jit.run.calls) == 1
    assert len(jit.run.compiled[0].launches) == 2


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(offset=1), id="tensor-not-16-byte-aligned"),
        pytest.param(dict(dtype=torch.float64), id="dtype"),
        pytest.param(dict(n=1), id="int-equal-to-1"),
        pytest.param(dict(n=33), id="int-not-multiple-of-16"),
        pytest.param(dict(BLOCK=32), id="constexpr-value"),
        pytest.param(dict(FLAG=True), id="constexpr-default-overridden"),
    ],
)
def test_a_different_key_misses(jit, change):
    change = dict(change)
    args = _args(**{k: change.pop(k) for k in ("n", "dtype", "offset") if k in change})
    _launch(jit, *_args())
    _launch(jit, *args, **change)
    assert len(jit.run.calls) == 2, f"{change} reused the kernel of another specialisation"
    _launch(jit, *args, **change)
    assert len(jit.run.calls) == 2, f"{change}'s own key then hits"


@pytest.mark.parametrize("option", [("num_warps", 4, 8), ("num_stages", 2, 3), ("launch_pdl", False, True)])
def test_another_launch_option_value_misses(jit, option):
    name, before, after = option
    for value in (before, before, after, after):
        _launch(jit, *_args(), **{name: value})
    assert len(jit.run.calls) == 2, f"{name}={after} reused the kernel compiled for {before}"


def test_constexpr_true_and_1_are_two_kernels(jit):
    """True == 1 as dict keys; Triton compiles them apart, and so must the key."""
    _launch(jit, *_args(), FLAG=True)
    _launch(jit, *_args(), FLAG=1)
    assert len(jit.run.calls) == 2


def test_an_int_outside_int32_takes_triton_path(jit):
    for _ in range(2):
        _launch(jit, *_args(n=1 << 33))
    assert len(jit.run.calls) == 2


class _OnCuda:
    """Stands in for a CUDA tensor in a generated key function (which reads only these)."""

    def __init__(self, address: int, dtype=torch.float32, is_cuda: bool = True):
        self.address, self.dtype, self.is_cuda = address, dtype, is_cuda

    def data_ptr(self) -> int:
        return self.address


def test_cuda_tensors_reach_the_launcher_as_their_addresses():
    """Where every tensor is on CUDA, the launcher gets each one's address as an int (it then skips
    its own ``data_ptr()`` call and driver query); with a tensor elsewhere, the tensors themselves,
    so that the launcher's check of a CPU tensor still raises. The key is the same either way."""
    types = (torch.Tensor, torch.Tensor, int, float, int)
    key = fl.key_function(types, (False, False, False, False, True))
    x, y = _OnCuda(4096), _OnCuda(8192, torch.bfloat16)
    k, args = key((x, y, 32, 0.5, 64), 0, ())
    assert args == (4096, 8192, 32, 0.5, 64)
    y_cpu = _OnCuda(8192, torch.bfloat16, is_cuda=False)
    k_cpu, args_cpu = key((x, y_cpu, 32, 0.5, 64), 0, ())
    assert args_cpu[1] is y_cpu and args_cpu[0] is x
    assert k == k_cpu
    assert key((x, y, 1 << 33, 0.5, 64), 0, ()) == (None, None)  # outside int32: Triton's path


def test_parameters_by_name_bind_as_by_position(jit):
    x, y, n, stride, eps = _args()
    _launch(jit, x, y, n, stride=stride, eps=eps, FLAG=True)
    _launch(jit, x, y, n, stride=stride, eps=eps, FLAG=True)
    assert len(jit.run.calls) == 1
    assert jit.run.compiled[0].launches[0][9:] == (x, y, n, stride, eps, 16, True)


def test_callable_grid_gets_the_bound_arguments(jit):
    grid = lambda meta: (meta["n"] // meta["BLOCK"], 2)  # noqa: E731
    for _ in range(2):
        _launch(jit, *_args(n=64), grid=grid)
    assert jit.run.compiled[0].launches[0][:3] == (4, 2, 1)


@pytest.mark.parametrize("where", ["enter", "exit"])
def test_launch_hooks_take_triton_path(jit, where):
    """A profiler's launch hook must see every launch: Triton's path calls it."""
    from triton import knobs

    chain = knobs.runtime.launch_enter_hook if where == "enter" else knobs.runtime.launch_exit_hook
    hook = lambda metadata: None  # noqa: E731
    _launch(jit, *_args())  # kept
    chain.add(hook)
    try:
        for _ in range(2):
            _launch(jit, *_args())
    finally:
        chain.remove(hook)
    assert len(jit.run.calls) == 3
    _launch(jit, *_args())  # hook gone: the kept key hits again
    assert len(jit.run.calls) == 3


def test_triton_debug_mode_takes_triton_path(jit, monkeypatch):
    from triton import knobs

    _launch(jit, *_args())
    monkeypatch.setattr(knobs.runtime, "debug", True)
    _launch(jit, *_args())
    assert len(jit.run.calls) == 2


def test_a_traced_or_other_tensor_takes_triton_path(jit):
    class Sub(torch.Tensor):
        pass

    x, y, n, stride, eps = _args()
    sub = x.as_subclass(Sub)
    assert traced(sub)  # what kernel_for wraps the kernel for
    for _ in range(2):
        _launch(jit, sub, y, n, stride, eps)
    assert len(jit.run.calls) == 2
    assert kernel_for(jit, x) is jit  # eager: the kernel itself, so the fast path applies


def test_none_takes_triton_path(jit):
    x, y, n, stride, eps = _args()
    for _ in range(2):
        _launch(jit, x, None, n, stride, eps)
    assert len(jit.run.calls) == 2


def test_a_traced_launch_wrapper_and_dynamo_take_triton_path(jit, monkeypatch):
    class Wrapper:  # what kernel_for hands back for a traced tensor (_Traced): not a JITFunction
        def __init__(self):
            self.grids = []

        def __getitem__(self, grid):
            self.grids.append(grid)
            return lambda *a, **k: "launched"

    w = Wrapper()
    assert fl.fast_launch(w, (3,), *_args(), BLOCK=16) == "launched" and w.grids == [(3,)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for _ in range(2):
        _launch(jit, *_args())
    assert len(jit.run.calls) == 2


def test_a_heuristics_wrapped_kernel_takes_triton_path(jit):
    wrapped = triton.heuristics({"FLAG": lambda meta: meta["n"] > 16})(jit)
    for _ in range(2):
        _launch(wrapped, *_args())
    assert len(jit.run.calls) == 2
    assert id(wrapped) not in fl._KERNELS


def test_the_switch_turns_it_off(jit):
    _launch(jit, *_args())
    with eager_fast_launch(False):
        _launch(jit, *_args())
    assert len(jit.run.calls) == 2
    _launch(jit, *_args())
    assert len(jit.run.calls) == 2
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with eager_fast_launch(0):
            pass


def test_a_triton_that_launches_differently_turns_it_off_once(jit, monkeypatch, caplog):
    monkeypatch.setattr(fl, "_LAUNCH_CALL", "kernel.launch(grid,*args)")
    fl.clear()
    with caplog.at_level(logging.WARNING, logger=fl.__name__):
        for _ in range(3):
            _launch(jit, *_args())
    assert len(jit.run.calls) == 3
    assert [r.getMessage() for r in caplog.records if "fast launch off" in r.getMessage()] == [
        f"truefuse: eager fast launch off for Triton {triton.__version__}: "
        "its JITFunction.run launches differently than Triton 3.6-3.9"
    ]


def test_a_compiled_kernel_without_a_handle_turns_it_off_for_that_kernel(jit, caplog):
    jit.run = _Recorder(handle=False)
    with caplog.at_level(logging.WARNING, logger=fl.__name__):
        for _ in range(3):
            _launch(jit, *_args())
    assert len(jit.run.calls) == 3
    assert sum("no launcher handle" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.skipif(not get_config().triton_interpret, reason="the CPU interpreter's path")
def test_the_interpreter_takes_triton_path():
    from truefuse.ops.rope import rope_launch, rope_ref

    fl.clear()
    x, cos, sin = torch.randn(2, 3, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    for _ in range(2):
        out = rope_launch(x, cos, sin, torch.float32, backward=False)
    torch.testing.assert_close(out, rope_ref(x, cos, sin), rtol=0, atol=1e-6)
    assert fl._KERNELS == {}


# -- prepared launches (ops/_launch/prepared.py) ---------------------------------------------


def test_a_prepared_launch_is_the_fast_launch_with_new_addresses(jit):
    x, y, n, stride, eps = _args()
    assert prepare((x, y), jit, (3,), x, y, n, stride, eps, BLOCK=16) is None  # no handle yet: nothing kept
    _launch(jit, x, y, n, stride, eps)  # compiles through Triton's path: now kept
    go = prepare((x, y), jit, (3,), x, y, n, stride, eps, BLOCK=16)
    assert go is not None and launchable(go)
    _launch(jit, x, y, n, stride, eps)  # the fast launch, for comparison
    go(9, 4096, 8192)
    fast, prepared = jit.run.compiled[0].launches
    assert prepared == (fast[:3] + (9,) + fast[4:9] + (4096, 8192) + fast[11:]), "not the fast launch's call"
    assert len(jit.run.calls) == 1


def test_a_prepared_launch_takes_its_varying_ints_and_grid_at_each_call(jit):
    """``varying``: ints passed to ``go`` after the addresses, in place of the ones fixed at
    ``prepare`` (a decode step's key length); ``varying_grid``: grid dimensions after them."""
    x, y, n, stride, eps = _args()
    _launch(jit, x, y, n, stride, eps)
    go = prepare((x, y), jit, (3, 2, 1), x, y, n, stride, eps, varying=(2, 3), varying_grid=(2,), BLOCK=16)
    go(9, 4096, 8192, 77, 33, 5)
    launch = jit.run.compiled[0].launches[-1]
    assert launch[:4] == (3, 2, 5, 9) and launch[9:13] == (4096, 8192, 77, 33) and launch[13] == eps
    assert prepare((x, y), jit, (3,), x, y, n, stride, eps, varying=(4,), BLOCK=16) is None, "a float is no varying int"


def test_a_prepared_launch_maps_each_tensor_to_its_slot(jit):
    x, y, n, stride, eps = _args()
    _launch(jit, x, x, n, stride, eps)
    go = prepare((y, x), jit, (3,), x, x, n, stride, eps, BLOCK=16)
    go(7, 1, 2)
    assert jit.run.compiled[0].launches[-1][9:11] == (2, 2)  # both arguments are x: the second slot
    assert prepare((y,), jit, (3,), x, x, n, stride, eps, BLOCK=16) is None, "a tensor that is no slot"


def test_a_launch_with_one_tensor_in_two_slots_is_not_kept(jit):
    """Kept with ``cos is sin``, a later call with two tensors would read the first's address for
    both (rope's slots are distinct tensors): such a launch is not kept."""
    x, y, n, stride, eps = _args()
    _launch(jit, x, x, n, stride, eps)
    assert prepare((x, x), jit, (3,), x, x, n, stride, eps, BLOCK=16) is None


def test_a_prepared_launch_keeps_its_compiled_kernel(jit):
    """A freed CompiledKernel unloads its module (Triton 3.9): ``go`` holds it, as fast_launch's handle does."""
    x, y, n, stride, eps = _args()
    _launch(jit, x, y, n, stride, eps)
    assert prepare((x, y), jit, (3,), x, y, n, stride, eps, BLOCK=16).compiled is jit.run.compiled[0]


def test_a_prepared_launch_is_not_launchable_where_fast_launch_would_not_launch(jit, monkeypatch):
    from triton import knobs

    _launch(jit, *_args())
    x, y, n, stride, eps = _args()
    go = prepare((x, y), jit, (3,), x, y, n, stride, eps, BLOCK=16)
    with eager_fast_launch(False):
        assert not launchable(go)
        assert prepare((x, y), jit, (3,), x, y, n, stride, eps, BLOCK=16) is NOT_NOW  # a passing reason: no try counted
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not launchable(go)
        assert prepare((x, y), jit, (3,), x, y, n, stride, eps, BLOCK=16) is NOT_NOW
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert launchable(go)
    monkeypatch.setattr(fl, "_device", lambda: 1)
    assert not launchable(go), "another current device"


# -- CUDA: the fast path's bits are Triton's path's --------------------------------------------


def _ops_fwd_bwd():
    """Outputs and gradients of rms_norm, rms_norm_hf, rope, the gated activation and attention
    (prefill and decode), forward + backward, on bf16 CUDA inputs made from one seed."""
    import truefuse

    g = torch.Generator("cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, **bf).requires_grad_()

    out = {}
    x, w = leaf(4, 64, 1024), leaf(1024)
    out["rms_norm"] = (truefuse.rms_norm(x, w, 1e-6), x, w)
    x2, w2 = leaf(4, 64, 1024), leaf(1024)
    out["rms_norm_hf"] = (truefuse.rms_norm_hf(x2, w2, 1e-6), x2, w2)
    q, k = leaf(2, 8, 64, 64), leaf(2, 4, 64, 64)
    cos, sin = torch.randn(2, 64, 64, generator=g, **bf), torch.randn(2, 64, 64, generator=g, **bf)
    qo, ko = truefuse.apply_rotary_pos_emb(q, k, cos, sin)
    out["rope"] = (torch.cat([qo.flatten(), ko.flatten()]), q, k)
    gate, up = leaf(256, 2816), leaf(256, 2816)
    out["gated_activation"] = (truefuse.gated_activation(gate, "swiglu", up), gate, up)
    qa, ka, va = leaf(2, 8, 64, 64), leaf(2, 4, 64, 64), leaf(2, 4, 64, 64)
    out["attention"] = (truefuse.attention(qa, ka, va, is_causal=True, enable_gqa=True), qa, ka, va)
    qd, kd, vd = leaf(2, 8, 1, 64), leaf(2, 4, 1100, 64), leaf(2, 4, 1100, 64)  # decode: 3 key chunks, split and merged
    out["attention decode"] = (truefuse.attention(qd, kd, vd, enable_gqa=True), qd, kd, vd)
    res = {}
    for name, (y, *inputs) in out.items():
        dy = torch.randn(y.shape, generator=g, **bf)
        res[name] = (y.detach(), *torch.autograd.grad(y, inputs, dy))
    torch.cuda.synchronize()
    return res


@requires_cuda
def test_fast_launch_gives_triton_paths_bits_and_hits_on_cuda(monkeypatch):
    from triton.runtime.jit import JITFunction

    fl.clear()
    with eager_fast_launch(False):
        ref = _ops_fwd_bwd()
    first = _ops_fwd_bwd()  # keys each launch (misses, through Triton)
    ours = [k for k in fl._KERNELS.values() if k.plans]
    assert ours, "no launch took the fast path's bookkeeping"
    calls = []
    run = JITFunction.run

    def counting(self, *a, **k):
        calls.append(self.fn.__name__)
        return run(self, *a, **k)

    monkeypatch.setattr(JITFunction, "run", counting)
    second = _ops_fwd_bwd()  # every launch a hit: none through JITFunction.run
    assert calls == [], f"launches that missed the second time: {sorted(set(calls))}"
    for name in ref:
        for i, (a, b, c) in enumerate(zip(ref[name], first[name], second[name], strict=True)):
            assert torch.equal(a, b) and torch.equal(a, c), f"{name} output/gradient {i} differs from Triton's path"
