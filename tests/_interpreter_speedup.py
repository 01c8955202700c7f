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
    interp._truefuse_fast_patch = True


def interpreted(rank: int, world_size: int, fn, *args):
    """A ``run_local`` target: :func:`install` in the spawned process, then ``fn(rank, world_size, *args)``."""
    install()
    return fn(rank, world_size, *args)


def run_local(world_size: int, fn, *args, **kwargs) -> list:
    """``truefuse.distributed.launch.run_local`` with :func:`install` in every spawned process."""
    from truefuse.distributed.launch import run_local as launch

    return launch(world_size, interpreted, fn, *args, **kwargs)
