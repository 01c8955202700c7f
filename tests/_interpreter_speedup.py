"""Triton's CPU interpreter without its repeated language patching (the CPU suite's largest cost).

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language`` for the interpreter once
(``_patch_lang``, undone when the grid has run), but every call of a ``@triton.jit`` helper from
inside the kernel patches it again, per program instance, and never undoes it: each time
``inspect.getmembers`` over ``tl``, ``tl.tensor`` and ``tl.math`` finds nothing left to patch
(the launch replaced every builtin already) and re-sets the same interpreter hooks. In the CPU
suite that was half of the interpreter's time (cProfile of the allreduce table: 110 of 220 s).

:func:`install` skips that second patching when the running launch has already patched every
``triton.language`` module the helper sees (its globals); anything else goes through Triton's own
``_patch_lang`` as before (once per launch for each such module: Triton never undoes a helper's
patching, so a second one would find it done). The kernels run the same interpreted code on the same values: only
the redundant re-patching is gone. The suite installs it in ``conftest.py``; a test whose spawned
processes run kernels calls :func:`install` in them (conftest does not run there).

:func:`install` also folds a custom-combine ``tl.reduce`` along its axis for every output at once
(Triton's folds one element at a time) and builds ``_get_np_dtype``'s table once: the same values.
:func:`run_local` and :func:`forkserver` start the tests' ranks from a server that has imported
torch, Triton and truefuse once, instead of each rank importing them again.
"""

from __future__ import annotations

import inspect


def install() -> None:
    """Idempotent; a no-op unless Triton's interpreter module is importable."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:  # pragma: no cover
        return
    if getattr(interp, "_truefuse_fast_patch", False):
        return
    if not (callable(getattr(interp, "_patch_lang", None)) and hasattr(interp, "GridExecutor")):
        return  # another Triton's interpreter: run it as it is (slower, the same results)
    original_patch = interp._patch_lang
    original_call = interp.GridExecutor.__call__
    launches: list[list] = []  # per running launch: [the langs it patched, whether it has patched yet]
    langs_of: dict = {}

    def langs(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in langs_of:
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[key]

    class _Nothing:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        if launches:
            top = launches[-1]
            if not top[1]:  # the launch's own patching (GridExecutor.__call__)
                top[1] = True
                top[0] = langs(fn)
                return original_patch(fn)
            if langs(fn) <= top[0]:  # a helper called from inside the kernel: already patched
                return _Nothing()
            # a helper seeing a module the launch did not patch (triton.language.standard's
            # combine functions see tl.core): Triton patches it and never undoes that, so it
            # stays patched for the rest of the launch too
            top[0] = top[0] | langs(fn)
        return original_patch(fn)

    def grid_call(self, *args, **kwargs):
        launches.append([frozenset(), False])
        try:
            return original_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = grid_call
    _install_dtype_table(interp, tl)
    _install_axis_reduce(interp, tl)
    interp._truefuse_fast_patch = True


def _install_dtype_table(interp, tl) -> None:
    """``_get_np_dtype`` from a table built once (Triton's builds its 19-entry dict on every call,
    a tensor op calls it several times: ~7% of the interpreter's time); the same mapping."""
    import numpy as np

    original = getattr(interp, "_get_np_dtype", None)
    if not callable(original):
        return  # another Triton's interpreter: as it is
    table = {t: original(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.bfloat16)}
    table |= {getattr(tl, n): original(getattr(tl, n)) for n in ("int8", "int16", "int32", "int64")}
    table |= {getattr(tl, f"u{n}"): original(getattr(tl, f"u{n}")) for n in ("int8", "int16", "int32", "int64")}
    u64 = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return u64
        found = table.get(tt_dtype)
        return original(tt_dtype) if found is None else found  # fp8 and the rest: Triton's own

    interp._get_np_dtype = get_np_dtype


#: combine functions whose every output is the sum of its pair of inputs (``a0 + a1, b0 + b1``)
_SUM_COMBINES = {"truefuse.kernels.norm._add2"}


def _install_axis_reduce(interp, tl) -> None:
    """``tl.reduce`` with a combine function of its own (LayerNorm's two sums in one reduction):
    Triton's interpreter folds it one element at a time, a combine call per element (20 s of a
    16384-wide backward's test). Here the same left fold along the axis, each combine call on every
    output position at once: the same operations in the same order on each element, so the same bits
    (tests/test_interpreter_speedup.py compares them). A combine of :data:`_SUM_COMBINES` (each
    output the sum of its pair) on fp32 or fp64: numpy's running sum, the same left fold in C."""
    import numpy as np

    ops = getattr(interp, "ReduceOps", None)
    if not all(hasattr(ops, n) for n in ("generic_reduce", "unravel", "to_tensor")):
        return  # another Triton's interpreter: as it is
    ops._truefuse_element_reduce = ops.generic_reduce

    def generic_reduce(self, input):
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)
        data = [arg.handle.data for arg in input]
        out_shape = data[0].shape[:axis] + data[0].shape[axis + 1 :]
        acc = [np.take(d, 0, axis=axis).astype(d.dtype).reshape(out_shape) for d in data]
        fn, steps = self.combine_fn.fn, data[0].shape[axis]
        if f"{fn.__module__}.{fn.__name__}" in _SUM_COMBINES and all(d.dtype in (np.float32, np.float64) for d in data):
            acc, steps = [np.take(np.add.accumulate(d, axis=axis), -1, axis=axis).reshape(out_shape) for d in data], 1
        for k in range(1, steps):
            accs = tuple(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input, strict=True))
            items = tuple(self.to_tensor(np.take(d, k, axis=axis), arg.dtype) for d, arg in zip(data, input, strict=True))
            got = self.combine_fn.fn(*accs, *items)
            got = got if isinstance(got, tuple) else (got,)
            for j, g in enumerate(got):
                value = np.asarray(g.handle.data if isinstance(g, tl.core.tensor) else g).astype(acc[j].dtype)
                acc[j] = value.reshape(out_shape) if value.size == acc[j].size else np.full(out_shape, value.item(), acc[j].dtype)
        ret = []
        for d, arg in zip(acc, input, strict=True):
            if self.keep_dims:
                d = np.expand_dims(d, axis) if original_axis is not None else d.reshape((1,) * len(data[0].shape))
            elif original_axis is None:
                d = d.item()
            ret.append(self.to_tensor(d, arg.dtype))
        return ret

    ops.generic_reduce = generic_reduce


def interpreted(rank: int, world_size: int, fn, *args):
    """A ``run_local`` target: :func:`install` in the spawned process, then ``fn(rank, world_size, *args)``."""
    install()
    return fn(rank, world_size, *args)


def run_local(world_size: int, fn, *args, **kwargs) -> list:
    """``truefuse.distributed.launch.run_local`` with :func:`install` in every rank, the ranks
    forked from :func:`forkserver`'s server."""
    from truefuse.distributed.launch import run_local as launch

    forkserver()
    return launch(world_size, interpreted, fn, *args, start_method="forkserver", **kwargs)


#: imported once in the fork server, before it forks any rank: a spawned rank imported them itself,
#: ~4-5 s of CPU a rank (the suite starts ~40 ranks on the 2 CI cores). symbolic_shapes: sympy,
#: which autograd imports at a rank's first backward (1 s)
_PRELOAD = [
    *("torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "triton.language", "triton.runtime.interpreter"),
    *("truefuse", "truefuse.distributed", "truefuse.kernels.norm", "truefuse.verify.distributed_table"),
    *("truefuse.verify.distributed_tp", "truefuse.verify.distributed_vocab"),
]


def forkserver():
    """multiprocessing's "forkserver" context, its server to preload :data:`_PRELOAD` (one server a
    pytest process, started at its first rank). It starts with this process's environment
    (conftest's TRITON_INTERPRET and OMP_NUM_THREADS), which the ranks inherit from it: a test whose
    ranks need another environment spawns them (launch.run_local's default), as test_demo_fsdp does."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx
