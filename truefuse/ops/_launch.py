"""Launching a Triton kernel through its compiled handle (docs/design.md §6.8).

``kernel[grid](*args, **kw)`` specialises every argument and looks the compiled kernel up on every
call: ~20 µs of host time per launch on an H100 host, where the compiled kernel's own launcher takes
~10 (``experiments/exp_launch_host.py``). Where the host is what a step waits for (``generate``, a
small model under FSDP2) that is the step's time. :func:`launch` keeps each compiled kernel under the
call's exact arguments (each tensor's dtype and 16-byte alignment, every other argument's value, the
constexprs and launch options, the device): a key at least as fine as Triton's own specialisation,
so it names the kernel Triton would pick. The first call of a key goes through Triton (compile,
cache, checks). Triton's path runs every call under its interpreter, for a tensor not on CUDA, and
while a launch hook is set (a profiler such as proton reads each launch). The same compiled kernel
on the same arguments: the same bits.
"""

from __future__ import annotations

import torch

_MAX_KEYS = 1024  # per kernel; a new prefill length is a new key (the ints are in it), so bound the dict


class _Kernel:
    """One ``triton.jit`` function's compiled kernels by exact launch key, and what its handle's
    launcher needs beside the arguments: every parameter in signature order, defaults filled."""

    __slots__ = ("fn", "names", "defaults", "runtime", "compiled")

    def __init__(self, fn):
        self.fn = fn
        self.names = [p.name for p in fn.params]
        self.defaults = {p.name: p.default for p in fn.params}
        self.runtime = {p.name for p in fn.params if not p.is_constexpr}
        self.compiled: dict[tuple, tuple] = {}


_KERNELS: dict[int, _Kernel] = {}


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    return a if not isinstance(a, float) else ("f", a)  # 1.0 == 1: a float is not the int it equals


_knobs = None


def _triton_only() -> bool:
    """Triton's own path for every launch: its interpreter, or a launch hook set (a profiler)."""
    global _knobs
    if _knobs is None:
        from triton import knobs as _knobs
    from truefuse.config import get_config

    hooks = _knobs.runtime.launch_enter_hook is not None or _knobs.runtime.launch_exit_hook is not None
    return hooks or get_config().triton_interpret


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda


def launch(fn, grid: tuple, *args, **kw):
    """``fn[grid](*args, **kw)``, through the compiled kernel's handle after the first call of the
    same key. ``args``: positional, in the kernel's parameter order; ``kw``: the rest by name
    (constexprs, runtime arguments with defaults, options such as ``num_warps``)."""
    if not _on_device(args[0]) or callable(grid) or _triton_only():
        return fn[grid](*args, **kw)  # (the handle's launcher checks every other pointer is the device's)
    k = _KERNELS.get(id(fn))
    if k is None or k.fn is not fn:
        k = _KERNELS[id(fn)] = _Kernel(fn)
    dev = torch.cuda.current_device()
    key = (dev, tuple(map(_arg_key, args)), tuple((n, _arg_key(v)) for n, v in kw.items()))
    hit = k.compiled.get(key)
    if hit is None:
        compiled = fn[grid](*args, **kw)  # compiles on a miss, launches, returns the compiled kernel
        if compiled is None:
            return None
        if len(k.compiled) >= _MAX_KEYS:
            k.compiled.clear()
        names = k.names[len(args) :]
        tail = tuple(kw[n] if n in kw else k.defaults[n] for n in names)
        # a tensor given by name is this call's, not the key's: its tail is rebuilt each call
        k.compiled[key] = (compiled, names if any(isinstance(v, torch.Tensor) for v in kw.values()) else None, tail)
        return compiled
    compiled, names, tail = hit
    if names is not None:
        tail = tuple(kw[n] if n in kw else k.defaults[n] for n in names)
    g = tuple(grid) + (1, 1)
    stream = torch._C._cuda_getCurrentRawStream(dev)
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
    return compiled
