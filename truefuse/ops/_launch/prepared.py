"""A launch kept whole: every argument fixed but the tensors' addresses (issue 47 item 3;
docs/design.md §6.10).

:func:`fast_launch` still binds, keys and looks up each launch (3-7 µs of host on an H100 host
above the launcher it calls: docs/benchmarks.md, "Eager host time per op"), and the op above it
validates, plans and shapes its call every time. Where an op's call repeats exactly (a decode step:
the same shapes, strides, dtypes and modes every token), the op keeps the launch its path made,
:func:`prepare`'s ``go``, under a key of everything that path read, and the next such call is
``go(stream, *addresses)``: the launcher's own call with the kept grid, compiled kernel and
arguments. The same compiled kernel, arguments, grid and stream as the path it replaces: the same
bits. The ops' kept calls: ``ops/gemm/gemm_kept.py``, ``ops/norm/norm_kept.py``, ``ops/rope_kept.py``,
``ops/gated_activation/gated_kept.py``, ``integrations/huggingface/siblings.py``.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from truefuse.ops._launch import fast_launch as _fl
from truefuse.ops._launch.triton import PLAIN_TENSORS


def prepare(slots: tuple, kernel, grid, *args, varying: tuple = (), varying_grid: tuple = (), **kwargs):
    """The launch ``fast_launch(kernel, grid, *args, **kwargs)`` would make through a kept handle,
    as ``go(stream, *addresses)``: ``slots`` are the tensors whose addresses ``go`` takes, in its
    order; every tensor argument must be one of them (by identity: a view is another tensor), and
    gets the address of its slot (an int, as the launcher takes a CUDA tensor's; the tensor itself
    works too). Every other argument, the grid and the compiled kernel are fixed. None where
    ``fast_launch`` would take Triton's path or has no handle for this launch yet (the caller
    launches through it first), where a tensor argument is not a slot, or where the kernel needs
    Triton's scratch allocator at launch (the TMA GEMM's device-made descriptors).

    :data:`NOT_NOW` where the launch went through Triton's path for a passing reason (the fast
    path's switch off, tracing, a launch hook or Triton's debug mode): the caller counts no try.
    None also where one tensor fills two slots: a later call whose slots are distinct tensors
    would get the first slot's address for both (``rope(cos is sin)``).

    ``varying``: the positions (in the kernel's parameters) of int arguments passed at each call
    rather than fixed, and ``varying_grid`` the grid's dimensions likewise: ``go(stream,
    *addresses, *ints, *dims)`` (a decode step's key length: ``ops/attention/attention_kept.py``).
    The key must then hold each such int's :func:`specs` (what Triton compiled this launch for).

    The caller keeps ``go`` under a key of everything that decided these arguments, and calls it
    only where :func:`launchable` holds (the fast path's switch, Triton's hooks, the device)."""
    if torch.compiler.is_compiling() or not _fl._config._eager_fast_launch:
        return NOT_NOW
    if len({id(t) for t in slots}) != len(slots):
        return None
    st = _fl._KERNELS.get(id(kernel)) if type(kernel) is _fl._JIT else None
    if st is None or not st.on:
        return None
    if not _fl._triton_plain(kernel):
        return NOT_NOW
    found = _fl.lookup(st, args, kwargs)
    if found is None or found[-1] is None:
        return None
    bound, _, device, _, _, handle = found
    run, function, packed, compiled = handle
    meta = getattr(compiled, "metadata", None)
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return None
    if callable(grid):
        grid = grid(dict(zip(st.names, bound, strict=True)))
    grid = [*grid, 1, 1][:3]
    for d in varying_grid:
        grid[d] = f"g{d}"
    names, consts = [], {}
    for i, a in enumerate(bound):
        if i in varying:
            if type(a) is not int:
                return None
            names.append(f"i{i}")
        elif type(a) in PLAIN_TENSORS:
            j = next((k for k, t in enumerate(slots) if t is a), None)
            if j is None:
                return None
            names.append(f"t{j}")
        else:
            names.append(f"c{i}")
            consts[f"c{i}"] = a
    params = "".join(f", t{j}" for j in range(len(slots))) + "".join(f", i{i}" for i in varying)
    params += "".join(f", g{d}" for d in varying_grid)
    src = (
        f"def go(stream{params}):\n"
        f"    run({grid[0]}, {grid[1]}, {grid[2]}, stream, function, packed, None, None, None, {', '.join(names)})\n"
    )
    namespace = {"run": run, "function": function, "packed": packed, **consts}
    exec(compile(src, f"<prepared {getattr(kernel, '__name__', 'kernel')}>", "exec"), namespace)
    go = namespace["go"]
    go.kernel, go.device = kernel, device
    go.compiled = compiled  # kept alive with ``go``: a freed CompiledKernel unloads its module (Triton 3.9)
    return go


def _on_device(x: torch.Tensor) -> bool:
    """Whether kept launches serve ``x``'s device (CUDA; tests stand the CPU in)."""
    return x.is_cuda


def replayable(*tensors, recording: bool = False) -> bool:
    """Whether a kept launch may serve a call on ``tensors`` (None entries skipped; the first on
    the device): plain tensors on CUDA, none requiring grad with grad mode on (``recording``: the
    caller records the graph itself, around kept launches of its forward and backward), not traced,
    no dispatch mode, functorch transform or functorch wrapper (each of which must see the op's own
    path)."""
    grad = torch.is_grad_enabled() and not recording
    for t in tensors:
        if t is not None and (type(t) not in PLAIN_TENSORS or (grad and t.requires_grad)):
            return False
    if not _on_device(tensors[0]) or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    for t in tensors:  # after the tracing check: Dynamo cannot trace this call
        if t is not None and _wrapped(t):
            return False
    return True


def specs(*ints: int) -> tuple | None:
    """What Triton compiles a launch for of each int argument (``fast_launch.key_function``'s: == 1,
    a multiple of 16), None where one is outside int32's range (Triton's path: i64): the key's part
    of :func:`prepare`'s ``varying`` ints."""
    out = []
    for v in ints:
        if not -2147483648 <= v <= 2147483647:
            return None
        out.append((v == 1, not v & 15))
    return tuple(out)


#: a functorch wrapper (a transform's tensor, or one that outlived its transform: its type is
#: torch.Tensor, it has no storage, and the path unwraps it, ``autograd/_eager_op.py``)
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def layout(t: torch.Tensor, address: int) -> tuple:
    """The part of a kept launch's key that one operand (at ``address``) decides: its shape,
    strides, dtype, device and 16-byte alignment (what Triton specialises on, with the shapes)."""
    return t.shape, t.stride(), t.dtype, t.get_device(), address & 15


#: :func:`prepare`'s answer where the launch it would keep went through Triton's path for a passing
#: reason: nothing to keep now, and no try counted
NOT_NOW = object()


def launchable(go) -> bool:
    """Whether ``go`` may launch now: the fast path on, not tracing, Triton's launch hooks and
    debug modes off (``fast_launch._triton_plain``), the current device the one it was made on."""
    return (
        _fl._config._eager_fast_launch
        and not torch.compiler.is_compiling()
        and _fl._device() == go.device
        and _fl._triton_plain(go.kernel)
    )


def stream(go) -> int:
    """The current stream of ``go``'s device (what Triton's launch and :func:`fast_launch` pass)."""
    return _fl._stream(go.device)


class ToKeep:
    """What an op's kept path hands back where this call's launch may be kept once the caller's path
    ran: the call's key and the tries left (a type of its own: a kept hit may return a tuple)."""

    __slots__ = ("key", "left")

    def __init__(self, key, left: int) -> None:
        self.key, self.left = key, left


class KeptLaunches:
    """One op's kept launches by key: an entry (``go`` and what the op needs to replay it), or for
    a key whose launch is not kept yet the tries left (a first call compiles through Triton's path,
    so its launch has no handle to keep yet; a launch that cannot be kept stops being tried)."""

    __slots__ = ("entries", "size", "tries")

    def __init__(self, size: int = 1024, tries: int = 2) -> None:
        self.entries: dict = {}
        self.size, self.tries = size, tries

    def get(self, key):
        """The entry kept for ``key`` (a tuple), else the tries left (an int)."""
        return self.entries.get(key, self.tries)

    def put(self, key, left: int, go, *extra) -> None:
        """Keep ``(go, *extra)`` for ``key``; where ``go`` is None (:func:`prepare` kept nothing) count
        a try (``left``: the tries left before it); where it is :data:`NOT_NOW`, nothing."""
        if go is NOT_NOW:
            return
        if len(self.entries) >= self.size:
            self.entries.clear()
        self.entries[key] = (go, *extra) if go is not None else left - 1

    def keep(self, pending: ToKeep, go, *extra) -> None:
        """:meth:`put` for a :class:`ToKeep`."""
        self.put(pending.key, pending.left, go, *extra)

    def clear(self) -> None:
        self.entries.clear()
