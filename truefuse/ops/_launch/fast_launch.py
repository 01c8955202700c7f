"""Eager Triton launches through the compiled kernel's own launcher (issue 47 item 3; docs/design.md §6.7).

``kernel[grid](*args, **kwargs)`` goes through ``JITFunction.run``: Triton binds the arguments, runs its
specialisation of each, builds a string key of them and its options, checks the kernel's globals,
builds the launch hooks' metadata and only then calls the compiled kernel's launcher: 11-27 µs of host
a launch on an H100 host, against ~3.4-4 µs for that launcher alone (``experiments/host_time.py
launch``). :func:`fast_launch` means the same call and, in eager mode on CUDA, keeps the
``CompiledKernel`` each first launch returns under a key of everything Triton's own key is made of
(the current device; every argument's type; each tensor's dtype and 16-byte alignment; each int's
== 1 and % 16 == 0; every constexpr's value; the launch options, ``num_warps``, ``launch_pdl``, ...),
and launches the next call with the same key through that kernel's launcher. The same compiled
kernel, arguments, grid and stream: the same bits. Measured without a GPU (the CPU box, a norm
forward's 33 arguments, the launcher a no-op stand-in): ~5 µs of host against ~14 through Triton
3.9's ``JITFunction.run``; the GPU machine's numbers come from ``host_time.py launch``.

Anything it cannot key takes Triton's path unchanged: a traced or other non-plain tensor (the
launcher's ``kernel_for`` then hands a wrapper, not a ``JITFunction``), Dynamo tracing the launch,
the CPU interpreter, an autotuned or heuristics-wrapped kernel, ``None`` or any argument of another
type, an int outside int32's range, launch hooks set (a profiler's), Triton's debug or
instrumentation mode, the switch off (``truefuse.config.eager_fast_launch(False)``,
``TRUEFUSE_FAST_LAUNCH=0``), ROCm. A Triton whose
``JITFunction.run`` launches its kernel differently than 3.6-3.9 do, or whose compiled kernel lacks
the launcher's handle, turns the fast path off (one log line) instead of failing.
"""

from __future__ import annotations

import inspect
import logging
from operator import itemgetter

import torch

import truefuse.config as _config
from truefuse.ops._launch.triton import PLAIN_TENSORS, raw_stream

log = logging.getLogger(__name__)

#: what ``JITFunction.run`` of Triton 3.6 to 3.9 does to launch, whitespace removed: the fast path
#: makes the same call, so a Triton that makes another one (its launcher's arguments changed) turns it off
_LAUNCH_CALL = (
    "kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
    "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*bound_args.values())"
)
#: ...and a callable grid gets the bound arguments by name
_GRID_CALL = "grid=grid(bound_args)"

#: most keys kept per call shape and argument types (each a distinct specialisation; a handful in practice)
MAX_KEYS = 256


def _getter(keys: list):
    """A function of a mapping or sequence giving the tuple of its ``keys`` (itemgetter returns a
    bare value for one key)."""
    if not keys:
        return lambda _: ()
    if len(keys) == 1:
        (k,) = keys
        return lambda m: (m[k],)
    return itemgetter(*keys)


def _no_key(bound, device, options):
    return None, None


def key_function(types: tuple, constexpr: tuple):
    """``key(bound, device, options)`` for launches whose bound arguments have these ``types``
    (``constexpr``: each parameter's flag), or :func:`_no_key` where one is of a type the key does
    not cover: None, a tuple, a tensor descriptor or subclass (a traced tensor), anything but a
    plain tensor, int, float or bool at a runtime parameter. It returns ``(key, arguments)``, or
    ``(None, None)`` where Triton's path must launch: ``arguments`` are what the launcher takes, with
    each tensor's address as an int where every tensor is on CUDA (the launcher then skips its own
    ``data_ptr()`` call and driver query a pointer: 1-3 µs of a launch on an H100 host,
    docs/benchmarks.md, Eager host time per op), the tensors themselves otherwise (its check of a
    CPU tensor stays).

    What Triton specialises a launch on (its ``native_specialize_impl``, 3.6 and 3.9 alike), given
    the types (the caller keys on them): a tensor's dtype and whether its address is a multiple of
    16; an int's == 1 (a constexpr then) and % 16 == 0 in int32's range (``key`` returns None for an
    int outside it, which Triton's path then takes: i64 / u64); nothing of a float (fp32) or bool
    (u1) argument's value; each constexpr's value. The function is generated for the types, one
    expression per argument: the same key built by a loop or by ``map`` over the ~30 arguments of a
    norm launch cost 4.8 µs on the CPU box, about what the launch saves."""
    dtypes, ptrs, cuda, int_checks, ints, consts, args = [], [], [], [], [], [], []
    for i, (t, c) in enumerate(zip(types, constexpr, strict=True)):
        p = f"p{i}"
        args.append(p)
        if c:
            if t is type(None):
                return _no_key
            consts.append(p)
        elif t in PLAIN_TENSORS:
            dtypes.append(f"{p}.dtype")
            ptrs.append(f"a{i}")
            cuda.append(f"{p}.is_cuda")
            args[-1] = f"a{i}"
        elif t is int:
            int_checks.append(f"-2147483648 <= {p} <= 2147483647")
            ints += [f"{p} == 1", f"not {p} & 15"]
        elif t is not float and t is not bool:
            return _no_key
    aligned = f"({' | '.join(ptrs)}) & 15 == 0 or ({''.join(f'not {q} & 15, ' for q in ptrs)})" if ptrs else "True"
    src = f"def key(bound, device, options):\n    {''.join(f'p{i}, ' for i in range(len(types)))}= bound\n"
    if int_checks:
        src += f"    if not ({' and '.join(int_checks)}):\n        return None, None\n"
    src += "".join(f"    {a} = p{a[1:]}.data_ptr()\n" for a in ptrs)
    src += f"    key = (device, options, {aligned}, {''.join(f'{e}, ' for e in dtypes + ints + consts)})\n"
    if cuda:
        src += f"    if not ({' and '.join(cuda)}):\n        return key, bound\n"
    src += f"    return key, ({''.join(f'{a}, ' for a in args)})\n"
    namespace: dict = {}
    exec(compile(src, f"<fast_launch key {len(types)}>", "exec"), namespace)
    return namespace["key"]


class _Variant:
    """One call shape's launches with one tuple of argument types: their key function and the
    compiled kernels' handles by key."""

    __slots__ = ("key", "handles")

    def __init__(self, key):
        self.key, self.handles = key, {}


class _Plan:
    """How a call of one shape (the number of positional arguments, the keyword names in order)
    binds: ``rest`` reads the parameters after the positional ones from the keywords (with the
    ``defaults`` of those not named), ``options`` the launch options' values; its variants by the
    bound arguments' types, ``last`` the one the previous call took."""

    __slots__ = ("rest", "defaults", "options", "variants", "last_types", "last")

    def __init__(self, rest, defaults: dict | None, options):
        self.rest, self.defaults, self.options = rest, defaults, options
        self.variants: dict = {}
        self.last_types = self.last = None


class _Kernel:
    """One ``JITFunction``'s fast-path state: its parameters read once and its call plans. ``on``
    False: the fast path is off for it (logged once)."""

    __slots__ = ("jit", "names", "params", "constexpr", "plans", "on")

    def __init__(self, jit):
        self.jit = jit  # kept: the registry is keyed by id()
        self.names = tuple(p.name for p in jit.params)
        self.params = {p.name: p for p in jit.params}
        self.constexpr = tuple(bool(p.is_constexpr) for p in jit.params)
        self.plans: dict = {}
        self.on = isinstance(getattr(jit, "pre_run_hooks", None), list)  # read at every launch

    def plan(self, nargs: int, kwargs: dict) -> _Plan | None:
        """The plan of a call with ``nargs`` positional arguments and these keywords, or None where
        the call does not bind (too many positional arguments, a parameter neither given nor
        defaulted, a parameter given twice: Triton's path raises its own error)."""
        names = tuple(kwargs)
        plan = self.plans.get((nargs, names), False)
        if plan is False:
            plan = self.plans[nargs, names] = self._new_plan(nargs, kwargs)
        return plan

    def _new_plan(self, nargs: int, kwargs: dict) -> _Plan | None:
        params = self.jit.params
        if nargs > len(params) or any(p.name in kwargs for p in params[:nargs]):
            return None
        rest = params[nargs:]
        defaults = {}
        for p in rest:
            if p.name not in kwargs:
                if not p.has_default:
                    return None
                defaults[p.name] = p.default
        options = [k for k in kwargs if k not in self.params]
        return _Plan(_getter([p.name for p in rest]), defaults or None, _getter(options))

    def variant(self, plan: _Plan, bound: tuple) -> _Variant:
        """The variant of ``plan`` for ``bound``'s argument types."""
        types = tuple(map(type, bound))
        if types is not plan.last_types and types != plan.last_types:
            v = plan.variants.get(types)
            if v is None:
                v = plan.variants[types] = _Variant(key_function(types, self.constexpr))
            plan.last_types, plan.last = types, v
        return plan.last


_KERNELS: dict[int, _Kernel] = {}

# Set by _setup() on the first launch of a JITFunction: None until then, False where the fast path
# cannot run in this process (logged once), True once Triton's launch was found as expected.
_ready: bool | None = None
_JIT: type | None = None
_HOOKS: type | None = None
_runtime = _compilation = None
_stages_hook = False  # Triton 3.9's add_stages_inspection_hook exists (it changes the compiled kernel)
_device = _stream = None


def _setup() -> bool:
    """Check once per process that this Triton launches as the fast path does (Triton 3.6 to 3.9):
    ``JITFunction.run``'s launch call, the knobs read on each launch. Off (logged) otherwise."""
    global _ready, _JIT, _HOOKS, _runtime, _compilation, _stages_hook, _device, _stream
    _ready = False
    try:
        import triton
        from triton import knobs
        from triton.knobs import HookChain
        from triton.runtime.jit import JITFunction

        _JIT = JITFunction
        run = "".join(inspect.getsource(JITFunction.run).split())
        why = None
        if torch.version.hip is not None:
            why = "ROCm (Triton's AMD backend also specialises on a pointer's range)"
        elif _LAUNCH_CALL not in run or _GRID_CALL not in run:
            why = "its JITFunction.run launches differently than Triton 3.6-3.9"
        elif not isinstance(knobs.runtime.debug, bool) or not isinstance(knobs.compilation.instrumentation_mode, str):
            why = "its runtime knobs differ"
        if why is not None:
            log.warning("truefuse: eager fast launch off for Triton %s: %s", triton.__version__, why)
            return False
        _HOOKS, _runtime, _compilation = HookChain, knobs.runtime, knobs.compilation
        _stages_hook = hasattr(knobs.runtime, "add_stages_inspection_hook")
        _device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        _stream = raw_stream
    except Exception as e:  # an import or a source read that fails: Triton's path, not an error
        log.warning("truefuse: eager fast launch off: %s: %s", type(e).__name__, e)
        return False
    _ready = True
    return True


def _triton_plain(jit) -> bool:
    """No launch hook (a profiler's), no debug or instrumentation mode, no pre-run hook: Triton's
    path would make exactly the launcher call the fast path makes."""
    enter, leave = _runtime.launch_enter_hook, _runtime.launch_exit_hook
    return not (
        type(enter) is not _HOOKS
        or enter.calls
        or type(leave) is not _HOOKS
        or leave.calls
        or _runtime.debug
        or _compilation.instrumentation_mode
        or (_stages_hook and _runtime.add_stages_inspection_hook is not None)
        or jit.pre_run_hooks
    )


def _handle(compiled) -> tuple | None:
    """``(launcher, function, packed metadata, compiled kernel)`` of what a launch returned, or None
    where it lacks them."""
    try:
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return None
    if not callable(run) or function is None or packed is None or hasattr(compiled, "result"):
        return None
    return run, function, packed, compiled


def fast_launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel's own launcher where a launch
    of the same key ran before (module docstring). ``grid``: a tuple of up to 3 ints, or a callable
    of the bound arguments by name. Returns what Triton's launch returns (the compiled kernel)."""
    if torch.compiler.is_compiling() or not _config._eager_fast_launch:
        return kernel[grid](*args, **kwargs)
    st = _KERNELS.get(id(kernel)) if type(kernel) is _JIT else None
    if st is None:
        st = _first(kernel)
    if st is None or not st.on or not _triton_plain(kernel):
        return kernel[grid](*args, **kwargs)
    found = lookup(st, args, kwargs)
    if found is None:
        return kernel[grid](*args, **kwargs)
    bound, variant, device, key, launch_args, handle = found
    if handle is None:
        compiled = kernel[grid](*args, **kwargs)  # compiles where Triton has not
        if key is not None:
            handle = _handle(compiled)
            if handle is None:
                st.on = False
                log.warning("truefuse: eager fast launch off for %s: its compiled kernel has no launcher handle", kernel)
            elif len(variant.handles) < MAX_KEYS:
                variant.handles[key] = handle
        return compiled
    if callable(grid):
        grid = grid(dict(zip(st.names, bound, strict=True)))
    n = len(grid)
    run, function, packed, compiled = handle
    # no launch metadata and no hooks: _triton_plain saw both hook chains empty
    g1, g2 = (grid[1] if n > 1 else 1), (grid[2] if n > 2 else 1)
    run(grid[0], g1, g2, _stream(device), function, packed, None, None, None, *launch_args)
    return compiled


def lookup(st: _Kernel, args: tuple, kwargs: dict):
    """A launch's ``(bound arguments, variant, device, key, launcher arguments, kept handle)``, the
    key None where Triton's path must launch and the handle None where none is kept for the key;
    None where the call does not bind (``_Kernel.plan``). Also ``prepared.py``'s way to the handle."""
    plan = st.plan(len(args), kwargs)
    if plan is None:
        return None
    bound = args + plan.rest(kwargs if plan.defaults is None else {**plan.defaults, **kwargs})
    variant = st.variant(plan, bound)
    device = _device()
    key, launch_args = variant.key(bound, device, plan.options(kwargs))
    try:
        handle = None if key is None else variant.handles.get(key)
    except TypeError:  # an unhashable constexpr or option value
        key = handle = None
    return bound, variant, device, key, launch_args, handle


def _first(kernel) -> _Kernel | None:
    """The state of a kernel not seen yet (the process checked first), or None: not a plain
    ``JITFunction`` (a traced wrapper, the interpreter's, an autotuner), or the fast path off."""
    if _ready is None and type(kernel).__name__ == "JITFunction":
        _setup()
    if not _ready or type(kernel) is not _JIT:
        return None
    st = _KERNELS.get(id(kernel))
    if st is None:
        st = _KERNELS[id(kernel)] = _Kernel(kernel)
    return st


def clear() -> None:
    """Forget every kept handle and the per-process check (tests; a Triton swapped at run time)."""
    global _ready
    _KERNELS.clear()
    _ready = None
